"""Several hosts: a Ray cluster made with scripts/cluster.sh (keys, head, worker, run, stop), one host
cut off in the middle of `dph-async run`.

The hosts are network namespaces this test creates (a veth pair from each to a bridge, addresses in a
private subnet that exists only inside the test), each running its `cluster.sh` in its namespace. The
actor hosts also have the head's directory (run directory, model, data, the head's Ray files) hidden
under an empty tmpfs, so the model, the tokenizer and the prompts can reach their actor only through
the learner and Ray's object store. The replay and the weight server listen on the head's non-loopback
address with CURVE; Ray runs with token authentication.

One actor, and a spare actor host: the run can only finish if the actor of the host that is cut off
(its link taken down) is restarted on the other one, where it regenerates the prompts it had been
granted and never delivered. Checked afterwards: where every process ran, that the replay voided the
cut-off actor's unused tickets, that its replacement's stream covered every position granted before
the cut, and that no group was delivered or trained on twice.

Without root or `ip`, the namespace test skips with the reason, and `test_cut_off_host_on_loopback`
runs the same run on three Ray nodes on 127.0.0.1 instead (the cut: the actor host crashes, its
Ray node's processes SIGKILLed; DPH_CLUSTER_LOOPBACK=1 runs it where namespaces work too).
Namespaces, veths, the bridge, processes and files are removed at the end, also on failure, and
leftovers of an earlier run that crashed are found by their name prefix and removed first.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import SMALL, alive, copy_base, descendants, kill_tree, processes

from dph_async.replay.state import read_state

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PREFIX = "dphc"  # namespaces and directories of this test: dphc<pid of the test process>...
SUBNET = "10.213.7"  # only inside the test's namespaces: nothing outside routes to it
# Enough steps that the actor's replacement, which starts on the learner's newest weights, still has
# newer ones to load when the cut lands late in the run (at 6, one run's replacement loaded none).
STEPS = 10
# Ray notices a silent node within ~5 s instead of its default ~30 s.
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}
# One actor at most one batch ahead (eta = 0): the steps after the cut need its replacement.
RUN_ARGS = ["--preset", "grpo", *SMALL, "actors.num_actors=1", f"learner.steps={STEPS}",
            f"learner.checkpoint_every={STEPS}", "replay.max_staleness=0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Host:
    name: str
    ip: str
    root: Path  # this host's own files: Ray's pid and log (DPH_STATE), TMPDIR
    netns: str | None = None
    port: str | None = None  # its veth's end on the bridge
    ray_args: tuple[str, ...] = ()  # for `ray start`: ports that nodes sharing one address must not share

    def env(self, base: Path) -> dict[str, str]:
        return {**os.environ, **HEALTH_CHECK, "DPH_KEYS": str(base / "shared" / "keys"),
                "DPH_STATE": str(self.root / "state"), "TMPDIR": str(self.root / "tmp"), "DPH_NODE_IP": self.ip,
                "DPH_CPUS": "2", "RAY_PORT": (base / "shared" / "port").read_text()}

    def command(self, *args: str, hide: Path | None = None) -> list[str]:
        """`cluster.sh ARGS` on this host: in its namespace, with `hide` under an empty tmpfs."""
        cmd = ["bash", str(REPO / "scripts" / "cluster.sh"), *args]
        if hide is not None:
            cmd = ["sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', str(hide), *cmd]
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else cmd

    def ray_pid(self) -> int | None:
        """The pid of this host's `ray start --block`, while that process lives."""
        path = self.root / "state" / "ray.pid"
        if not path.is_file():
            return None
        pid = int(path.read_text())
        args = processes().get(pid, (0, ""))[1]
        return pid if "ray start" in args else None


def host_running(title: str, hosts: list[Host]) -> list[Host]:
    """The hosts with a process titled `title` (Ray names an actor's process ray::Class...) under their Ray node."""
    table = processes()
    return [h for h in hosts if (pid := h.ray_pid()) and
            any(table[p][1].startswith(title) for p in descendants(pid, table))]


def sh(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)


def leftovers(names: list[str]) -> list[tuple[str, int]]:
    """(name, pid) for names made by an earlier run of this test whose process is gone."""
    found = []
    for name in names:
        m = re.match(rf"{PREFIX}(\d+)", name)
        if m and int(m[1]) != os.getpid() and not alive(int(m[1])):
            found.append((name, int(m[1])))
    return found


def remove_stale_dirs() -> None:
    """Directories (and Ray processes living in them) of a crashed earlier run on loopback."""
    tmp = Path(tempfile.gettempdir())
    for name, _ in leftovers([p.name for p in tmp.glob(f"{PREFIX}*")]):
        stale = str(tmp / name) + os.sep
        for pid, (_, args) in processes().items():
            if stale in args:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmp / name, ignore_errors=True)


def delete_netns(name: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextlib.contextmanager
def base_dir() -> Iterator[Path]:
    # Short on purpose: Ray's socket paths live under it and must stay below ~107 bytes.
    remove_stale_dirs()
    base = Path(tempfile.gettempdir()) / f"{PREFIX}{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    (base / "shared").mkdir(parents=True)
    (base / "shared" / "port").write_text(str(free_port()))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None if made.returncode == 0 else f"`ip netns add` refused: {made.stderr.strip()}"


@contextlib.contextmanager
def netns_hosts(base: Path, count: int) -> Iterator[list[Host]]:
    """`count` hosts, each a network namespace with a veth pair to a bridge in a namespace of its own."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for name, _ in leftovers([n for n in names if n.startswith(PREFIX)]):
        delete_netns(name)
    tag = f"{PREFIX}{os.getpid()}"
    switch = f"{tag}-sw"
    hosts = [Host(f"h{i}", f"{SUBNET}.{i + 1}", base / f"h{i}", f"{tag}-h{i}", f"p{i}") for i in range(count)]
    try:
        sh(["ip", "netns", "add", switch])
        sh(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", switch, "link", "set", "br0", "up"])
        for h in hosts:
            assert h.netns and h.port
            sh(["ip", "netns", "add", h.netns])
            sh(["ip", "link", "add", "eth0", "netns", h.netns, "type", "veth", "peer", "name", h.port, "netns", switch])
            sh(["ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", "eth0"])
            for dev in ("eth0", "lo"):
                sh(["ip", "-n", h.netns, "link", "set", dev, "up"])
            sh(["ip", "-n", switch, "link", "set", h.port, "master", "br0", "up"])
        yield hosts
    finally:
        for ns in [h.netns for h in hosts] + [switch]:
            delete_netns(ns)  # its processes, then it: the veths and the bridge go with their namespaces


def start_cluster(base: Path, hosts: list[Host], hide_head: bool) -> None:
    head, workers = hosts[0], hosts[1:]
    sh(["bash", str(REPO / "scripts" / "cluster.sh"), "keys"], env=head.env(base), timeout=120)
    for h in hosts:
        (h.root / "tmp").mkdir(parents=True)
    sh(head.command("head", *head.ray_args), env=head.env(base), timeout=300)
    # Actor hosts do not see the head's directory (with namespaces: an empty tmpfs over it).
    hide = head.root if hide_head else None
    def worker(w: Host) -> subprocess.Popen:
        return subprocess.Popen(w.command("worker", head.ip, *w.ray_args, hide=hide), env=w.env(base),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    # Nodes sharing one Ray session directory (no hiding) must not name their sockets at the same time.
    for group in ([workers] if hide_head else [[w] for w in workers]):
        for p in [worker(w) for w in group]:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, out


def stop_cluster(base: Path, hosts: list[Host], gone: list[Host]) -> None:
    for h in reversed(hosts):
        if h not in gone:  # a cut-off host's `stop` would wait on a head it cannot reach
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(h.command("stop"), env=h.env(base), capture_output=True, timeout=120)
        if pid := h.ray_pid():
            kill_tree(pid)


def read_versions(metrics: Path) -> list[int]:
    if not metrics.is_file():
        return []
    return [int(json.loads(line)["learner/version"]) for line in metrics.read_text().splitlines() if line]


def cut_off_run(base: Path, hosts: list[Host], hide_head: bool, cut: Callable[[Host], None], small_base: Path) -> None:
    head, actor_hosts = hosts[0], hosts[1:]
    out = head.root / "run"
    rl_dir = out / "rl" / "grpo"
    gone: list[Host] = []
    run_log = base / "run.log"
    proc = None
    try:
        copy_base(small_base, out)  # the warm start and pre-sampling are skipped; RL and evaluation run
        start_cluster(base, hosts, hide_head)
        with run_log.open("w") as log:
            proc = subprocess.Popen(head.command("run", "--output", str(out), *RUN_ARGS), env=head.env(base),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 900
        # Where the actor runs is found before the first step, so that the cut follows it at once.
        while not (victims := host_running("ray::ActorProcess", hosts)):
            assert proc.poll() is None, run_log.read_text()[-4000:]
            assert time.time() < deadline, "no actor started"
            time.sleep(0.5)
        assert len(victims) == 1 and victims[0] in actor_hosts, victims
        victim = victims[0]
        survivor = next(h for h in actor_hosts if h is not victim)
        while not read_versions(rl_dir / "metrics.jsonl") or max(read_versions(rl_dir / "metrics.jsonl")) < 1:
            assert proc.poll() is None, run_log.read_text()[-4000:]
            assert time.time() < deadline, "RL made no step"
            time.sleep(0.2)
        cut(victim)
        assert host_running("ray::LearnerProcess", hosts) == [head]
        gone.append(victim)
        cut_version = max(read_versions(rl_dir / "metrics.jsonl"))
        assert proc.wait(timeout=900) == 0, run_log.read_text()[-4000:]
        assert cut_version < STEPS  # the steps after the cut needed the restarted actor

        result = json.loads((rl_dir / "result.json").read_text())
        # The actor ran on the cut-off host, then on another node: the other actor host (its address, with
        # namespaces; on loopback every node has 127.0.0.1 and the node ids tell them apart).
        (ip_before, node_before), (ip_after, node_after) = result["nodes"]["actor0"]
        assert node_before != node_after
        if victim.ip != survivor.ip:
            assert (ip_before, ip_after) == (victim.ip, survivor.ip)
        assert result["actor_restarts"] == 1
        if victim.ip != survivor.ip:  # hosts of their own: weights came over the network, not a shared /dev/shm
            assert all(a["weight_loads"] >= 1 and a["weight_shm_loads"] == 0 for a in result["actors"]), \
                (cut_version, result["actors"])
        assert read_versions(rl_dir / "metrics.jsonl") == list(range(1, STEPS + 1))
        # The cut-off process had been granted positions it never delivered; its replacement started at
        # the replay's watermark (passing positions accepted above it), so every position granted
        # before the cut lies below watermark + skipped + voided. All of them were accepted in the end.
        # (voided is 0 when the cut lands while the actor, its batch delivered, waits for new weights;
        # tests/test_replay_staleness.py voids held tickets deterministically.)
        replay = result["replay"]
        voided = replay["tickets"]["voided"]
        (replacement,) = result["actors"]
        granted_before_cut = replacement["resumed_at"] + replacement["skipped_accepted"] + voided
        watermark, above = read_state(rl_dir / "checkpoints" / f"v{STEPS}" / "replay").accepted["0"]
        assert watermark >= granted_before_cut, (watermark, above, replacement["resumed_at"], voided)
        # Exactly once: no group trained on twice, each from an accepted position, nothing dropped unseen.
        consumed = [(a, s) for line in (rl_dir / "consumed.jsonl").read_text().splitlines()
                    for a, s, *_ in json.loads(line)["groups"]]
        assert len(consumed) == len(set(consumed)) == STEPS * 4
        assert all(a == 0 and (s < watermark or s in above) for a, s in consumed)
        assert replay["accepted"] == len(consumed) + sum(replay["drops"].values()) + replay["occupancy"]["unserved"]
        assert (out / "summary.json").is_file()  # evaluation and the report ran too
    finally:
        if proc is not None and proc.poll() is None:
            kill_tree(proc.pid)
        stop_cluster(base, hosts, gone)


def test_cut_off_host_in_network_namespaces(small_base):
    reason = netns_unavailable()
    if reason:
        pytest.skip(f"{reason}; test_cut_off_host_on_loopback runs the same cluster on 127.0.0.1")

    def link_down(host: Host) -> None:
        sh(["ip", "-n", f"{PREFIX}{os.getpid()}-sw", "link", "set", str(host.port), "down"])

    with base_dir() as base, netns_hosts(base, 3) as hosts:
        cut_off_run(base, hosts, hide_head=True, cut=link_down, small_base=small_base)
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(f"{PREFIX}{os.getpid()}-")]


def test_cut_off_host_on_loopback(small_base):
    if not netns_unavailable() and not os.environ.get("DPH_CLUSTER_LOOPBACK"):
        pytest.skip("network namespaces work here: test_cut_off_host_in_network_namespaces runs the same run on "
                    "real addresses (DPH_CLUSTER_LOOPBACK=1 runs this one as well)")

    def crash(host: Host) -> None:  # the host's Ray node and every process under it, at once
        pid = host.ray_pid()
        assert pid is not None
        kill_tree(pid)

    with base_dir() as base:
        agents = [("--dashboard-agent-listen-port", str(free_port())) for _ in range(3)]
        hosts = [Host(f"h{i}", "127.0.0.1", base / f"h{i}", ray_args=agents[i]) for i in range(3)]
        hosts[0].ray_args += ("--ray-client-server-port", str(free_port()))
        cut_off_run(base, hosts, hide_head=False, cut=crash, small_base=small_base)
        assert not [h for h in hosts if (pid := h.ray_pid()) and alive(pid)]
