"""Exactly once across crashes: two actor processes stream 1,200 groups to a replay process that is
SIGKILLed and restarted twice mid-stream, and one actor is killed and restarted too; the learner
side receives every group once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

PER_ACTOR = 600
ACTORS = 2
BATCH = 16


def actor(addr: str, actor_id: int) -> int:
    """An actor process: resume, then stream its shard at a steady pace under admission tickets."""
    from dph_async.replay_client import RolloutSender
    from dph_async.tools.bench.transport import synthetic_group

    sender = RolloutSender(addr, actor_id, reply_timeout_s=1.0, request_timeout_s=60)
    info = sender.resume()
    seqs = [s for s in range(PER_ACTOR) if not info.is_accepted(s)]
    while seqs:
        for _ in range(sender.tickets(min(8, len(seqs)), wait_s=0.5)):
            sender.send(synthetic_group(actor_id, seqs.pop(0), n=2, tokens=16))
            time.sleep(0.003)  # ~300 groups/s: the stream is still running when the replay dies
        sender.poll(0.0)
    ok = sender.flush(60)
    print(f"actor {actor_id}: accepted {sender.accepted}, duplicates {sender.duplicates}", flush=True)
    sender.close()
    return 0 if ok else 1


def start_replay(ingest: str, batch: str, wal_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dph_async.cli.main", "serve", "replay", "--ingest", ingest,
           "--batch", batch, "--wal-dir", str(wal_dir), "--groups-per-batch", str(BATCH),
           "replay.max_staleness=1000000"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def start_actor(ingest: str, actor_id: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "actor", ingest, str(actor_id)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_group_arrives_exactly_once_across_replay_crashes(tmp_path, ipc):
    from dph_async.net import control_token
    from dph_async.replay_client import ReplayClient

    ingest, out = ipc("in"), ipc("out")
    replay = start_replay(ingest, out, tmp_path / "wal")
    actors = [start_actor(ingest, i) for i in range(ACTORS)]
    client = ReplayClient(out, reply_timeout_s=1.0, request_timeout_s=60, token=control_token(tmp_path))
    received: list[tuple[int, int]] = []
    kills = [(300, "replay"), (500, "actor"), (800, "replay")]
    done = threading.Event()

    def killer() -> None:
        """Kill a process when the learner has seen so many groups, whatever it is doing then."""
        nonlocal replay
        while kills and not done.wait(0.002):
            if len(received) >= kills[0][0]:
                _, who = kills.pop(0)
                victim = replay if who == "replay" else actors[0]
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                if who == "replay":
                    replay = start_replay(ingest, out, tmp_path / "wal")
                else:  # it resumes: skips what was accepted, regenerates what was in flight
                    actors[0] = start_actor(ingest, 0)

    thread = threading.Thread(target=killer)
    thread.start()
    deadline = time.monotonic() + 240
    try:
        version = 0
        while len(received) < ACTORS * PER_ACTOR and time.monotonic() < deadline:
            batch = client.get_batch(version, BATCH, wait_s=0.5)
            received += [g.group_id for g in batch.groups]
            version += 1
        done.set()
        thread.join()
        stats = client.stats()
        outputs = [a.communicate(timeout=90)[0] for a in actors]
    finally:
        done.set()
        client.close()
        for p in [replay, *actors]:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not kills, "not every kill happened: the stream ended too early"
    assert [a.returncode for a in actors] == [0] * ACTORS, outputs
    assert len(received) == len(set(received)), "a group was delivered twice"
    assert set(received) == {(a, s) for a in range(ACTORS) for s in range(PER_ACTOR)}, "a group was lost"
    assert stats.drops == {} and stats.accepted == ACTORS * PER_ACTOR


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "actor":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        sys.exit(actor(sys.argv[2], int(sys.argv[3])))
    sys.exit("usage: test_exactly_once.py actor ADDR ACTOR_ID (started by the test)")
