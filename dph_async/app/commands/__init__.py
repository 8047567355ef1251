"""One module per command-line command.

Each module defines NAME ("run", or "bench kernels" for a subcommand), HELP (one line), DESCRIPTION
(the --help text), `add_arguments(parser)` and `main(args) -> int`. `dph_async.app.cli` discovers them,
so adding a command is adding a file. Keep module top levels import-light: heavy imports go in main().
"""
