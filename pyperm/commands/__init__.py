"""The checkpoint sub-commands of ``pyperm`` (one module each: ``HELP``, ``add_arguments(parser)``, ``run(args)``).

Registered by name in :data:`pyperm.cli.COMMANDS`; ``_common`` holds the options, ``--model``
parsing, data and output handling they share.
"""
