"""The `bootseer` subcommands, one module per part: argument parsing, config
sections and flags, and the translation of a part's errors into
`CommandError`. Each module's `register(subparsers)` adds its commands."""
