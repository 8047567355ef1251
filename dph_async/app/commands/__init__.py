"""One module per command-line command, and the helpers they share (common.py).

Each command module defines NAME ("run", or "bench kernels" for a subcommand), HELP (one line),
DESCRIPTION (the --help text), `add_arguments(parser)` and `main(args) -> int`. `dph_async.app.cli`
discovers them, so adding a command is adding a file. Keep a command module's top level
import-light (the config, rich, the standard library): `dph-async --help` imports every one. Its
implementation, which pulls Ray, torch, vLLM, numpy or matplotlib, is imported inside main().
"""
