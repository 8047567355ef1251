"""The command line: `main.py` parses `dph-async COMMAND`, and `commands/` holds one module per
command (imported only when that command runs); `ablate_common.py` is what the ablate commands
share. The top layer: nothing imports it.
"""
