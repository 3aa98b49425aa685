"""Implementations of the ``pyperm bench`` sub-commands (timing harness in _timing.py)."""
