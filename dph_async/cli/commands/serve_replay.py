"""`dph-async serve replay`: the replay service as its own process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, fail
from dph_async.config import load_config
from dph_async.metrics_endpoint import start_endpoint
from dph_async.net import ACTOR_TOKEN_FILE, CONTROL_TOKEN_FILE, InsecureBindError, NetSecurity, control_token
from dph_async.replay.reference_pool import ReferencePoolError
from dph_async.replay.service import ReplayService
from dph_async.replay.state import ReplayStateError
from dph_async.replay.telemetry import ReplayCollector, replay_health
from dph_async.replay.wal import WalFormatError
from dph_async.tasks.model_limits import replay_config

DESCRIPTION = """\
Run the replay service in this process: actors send rollout groups to the ingest endpoint, the
learner asks the batch endpoint for batches (docs/data_plane.md). Settings come from the config (a
preset or YAML file) and key=value overrides; flags override both. The write-ahead log defaults to
<output_dir>/<replay.wal_dir>, so a restarted service recovers everything it acknowledged. Example:

    dph-async serve replay --reference runs/default/presample/reference_pool.parquet \\
        replay.max_staleness=2 learner.groups_per_step=64

Endpoints bind 127.0.0.1 unless told otherwise; another address needs CURVE keys (--curve-keys, a
directory made by `dph-async keys`) or --insecure. A gate process binds them and reads the peers, so
a message of many frames grows the gate (limited to net.gate_memory_mb, restarted if exhausted), not
the replay; net.gate=false reads peers in this process (docs/data_plane.md, section 9).
SIGINT/SIGTERM stop it cleanly. GET /health and /metrics are served on net.metrics_host (port
net.metrics_port, 0: the OS chooses); the URL is printed and written to
<output_dir>/endpoints/replay.json for `dph-async status`.

Batch requests and commands (snapshot, restore, shutdown) are obeyed only from the control
identity: with CURVE keys the control key pair, otherwise the token in <data-dir>/control.token
(made at the first start, kept across restarts, readable by its owner only): give it to the
learner, never to actors. Ticket requests without CURVE carry the token in <data-dir>/actor.token
(`RolloutSender(token=...)`: the file's text as read, or `dph_async.net.read_secret` of it), made
and kept the same way: a peer without it is anonymous, granted tickets only from what is left once
one batch of them is kept for the actors that have it (none at replay.max_staleness=0).
Snapshots are written and read only inside the data directory.
"""

INGEST_PORT = 5555
BATCH_PORT = 5556


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, "config overrides (replay.*, net.*, ...)")
    parser.add_argument("--ingest", help=f"actor endpoint (default: tcp://<net.host>:{INGEST_PORT})")
    parser.add_argument("--batch", help=f"learner endpoint (default: tcp://<net.host>:{BATCH_PORT})")
    parser.add_argument(
        "--groups-per-batch", type=int, help="B in the admission rule (default: learner.groups_per_step)"
    )
    parser.add_argument("--reference", help="D_pef parquet file or directory of them (default: no reference pool)")
    parser.add_argument("--wal-dir", help="write-ahead log directory (default: <output_dir>/<replay.wal_dir>)")
    parser.add_argument("--no-wal", action="store_true", help="run without a write-ahead log (a restart loses all)")
    parser.add_argument(
        "--data-dir",
        help="where snapshots go and the control token is kept (default: the log's parent, or <output_dir>)",
    )
    parser.add_argument("--curve-keys", help="CURVE key directory (default: net.curve_keys)")
    parser.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without CURVE keys")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    wal_dir = args.wal_dir
    if wal_dir is None and cfg.replay.wal_dir and not args.no_wal:
        wal_dir = str(Path(cfg.output_dir) / cfg.replay.wal_dir)
    if args.no_wal:
        wal_dir = None
    data_dir = Path(args.data_dir or (Path(wal_dir).parent if wal_dir else cfg.output_dir))
    security = dataclasses.replace(NetSecurity.from_config(cfg.net), curve_keys=args.curve_keys or cfg.net.curve_keys,
                                   insecure=args.insecure or cfg.net.insecure)  # fmt: skip
    try:
        replay_cfg = replay_config(cfg, cfg.model.path) if cfg.model.path else cfg.replay
        if replay_cfg.vocab_size is None:
            print("replay: token ids are checked only for sign; set replay.vocab_size (or model.path) so that "
                  "ids the learner's embedding lacks are refused", file=sys.stderr)
        token = control_token(data_dir) if security.curve_keys is None else None
        actors = control_token(data_dir, ACTOR_TOKEN_FILE) if security.curve_keys is None else None
        service = ReplayService(
            replay_cfg,
            args.ingest or f"tcp://{cfg.net.host}:{INGEST_PORT}",
            args.batch or f"tcp://{cfg.net.host}:{BATCH_PORT}",
            args.groups_per_batch or cfg.learner.groups_per_step,
            reference_path=args.reference,
            wal_dir=wal_dir,
            security=security,
            seed=cfg.seed,
            data_dir=str(data_dir),
            control_token=token,
            actor_token=actors,
        )
    except (InsecureBindError, ReferencePoolError, ReplayStateError, WalFormatError, OSError, ValueError) as e:
        return fail(str(e))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: service.stop())
    endpoint = start_endpoint("replay", [ReplayCollector(service)], lambda: replay_health(service), cfg.net, 0,
                              Path(cfg.output_dir) / "endpoints")
    metrics = f", metrics {endpoint.url}" if endpoint is not None else ""
    control = "the CURVE control key" if token is None else f"the token in {data_dir / CONTROL_TOKEN_FILE}"
    actor_line = "" if token is None else f"; actors: the token in {data_dir / ACTOR_TOKEN_FILE}"
    print(f"replay: ingest {service.ingest_endpoint}, batch {service.batch_endpoint}{metrics}; control: {control}"
          f"{actor_line}", file=sys.stderr, flush=True)
    try:
        service.serve_forever()
    except OSError as e:
        return fail(f"write-ahead log: {e}", 1)
    finally:
        if endpoint is not None:
            endpoint.close()
    return 0
