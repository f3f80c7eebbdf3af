"""The CLI's subcommands, one module per group, each exposing ``add_parser(sub)`` (``cli.COMMANDS`` lists them)."""
