"""`dph-async keys`: make a CURVE key directory for the replay and weight endpoints."""

from __future__ import annotations

import argparse

from dph_async.cli.commands.common import fail
from dph_async.net import generate_keys

DESCRIPTION = """\
Create a key directory: the service key pair, one client key pair, and authorized/ holding the
client public keys the services accept. Point every process at it with net.curve_keys=DIR (or
--curve-keys DIR). A client whose key is not in authorized/ is refused during the handshake.
To admit another client, put its public .key file into authorized/. Example:

    dph-async keys runs/keys
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write the keys (must not hold keys already)")


def main(args: argparse.Namespace) -> int:
    try:
        keys = generate_keys(args.directory)
    except FileExistsError as e:
        return fail(str(e), 1)
    print(f"keys written to {keys} (secret files are readable by you only)")
    return 0
