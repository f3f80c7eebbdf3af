"""The ``vitkit`` subcommands, one module per group, each exposing ``add_parser(sub)`` (registered in cli.py)."""
