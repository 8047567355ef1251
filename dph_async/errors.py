"""The one base class of what a user got wrong: a file, a config key or value, a data source.

Subclasses (`ConfigError`, `DatasetError`, `BatchFileError`, `UnknownDataSource`, `PluginError`) say
what is wrong and name the file or the dotted key. The command line prints such an error as one
`error: ...` line and exits with status 2; anything else is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """Bad input from the user; the message names the file or key and what is expected."""
