"""Implementations of the ``pyperm bench`` sub-commands; shared timing, tables and plots in _report.py."""
