"""`dph-async status` against endpoints and run directories that misbehave: a trickle, a huge /metrics,
JSON of the wrong shape, markup in a peer's labels, a FIFO, /dev/zero, symlinks, a damaged summary.json.
Each is bounded (time, bytes) and is a row or one error line, never a traceback. Loopback only."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_telemetry import announce_dead, closed_port, rl_result, write_summary

from dph_async.cli.main import main as cli
from dph_async.runtime import endpoints
from dph_async.runtime.endpoints import Endpoint, find_endpoints, scrape
from dph_async.safe_files import UnsafeFile, read_regular

Answer = Callable[[str, socket.socket], None]


@contextlib.contextmanager
def serve(answer: Answer) -> Iterator[str]:
    """A loopback server thread taking one connection at a time; `answer(path, conn)` writes the reply."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn, contextlib.suppress(OSError):  # the client gave up: it may
                conn.settimeout(5)
                request = conn.recv(4096).decode(errors="replace").split()
                answer(request[1] if len(request) > 1 else "", conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def reply(conn: socket.socket, body: bytes, head: str = "HTTP/1.1 200 OK") -> None:
    conn.sendall(f"{head}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)


def answers(health: bytes, metrics: bytes = b"") -> Answer:
    return lambda path, conn: reply(conn, health if path == "/health" else metrics)


OK = json.dumps({"status": "ok"}).encode()


def trickle(where: str) -> Answer:
    """A byte every 50 ms, for at most 10 s: in the headers or in the body."""
    def answer(path: str, conn: socket.socket) -> None:
        head = b"HTTP/1.1 200 OK\r\n" + (b"" if where == "headers" else b"Content-Length: 200\r\n\r\n")
        conn.sendall(head)
        for _ in range(200):
            conn.sendall(b"X" if where == "headers" else b" ")
            time.sleep(0.05)
    return answer


@pytest.mark.parametrize("where", ["headers", "body"])
def test_a_trickling_endpoint_is_cut_off_at_the_deadline_of_the_whole_scrape(monkeypatch, where):
    """Before: httpx's 3 s timeout was per read, so a byte every 2 s held status for ever."""
    monkeypatch.setattr(endpoints, "TIMEOUT_S", 1.0)
    with serve(trickle(where)) as url:
        start = time.monotonic()
        reading = scrape(Endpoint("slow", url))
        elapsed = time.monotonic() - start
    assert reading.error.startswith("/health: timeout:") and not reading.up, reading.error
    assert 0.9 < elapsed < 1.6


def flood(declare: bool) -> Answer:
    """/metrics: 32 MiB of valid samples, declared in Content-Length or sent until the connection closes."""
    line = b"dph_flood 1\n" * 4096

    def answer(path: str, conn: socket.socket) -> None:
        if path == "/health":
            return reply(conn, OK)
        conn.sendall(b"HTTP/1.1 200 OK\r\n" + (f"Content-Length: {300 << 20}\r\n".encode() if declare else b"")
                     + b"Connection: close\r\n\r\n")
        for _ in range((32 << 20) // len(line)):
            conn.sendall(line)
    return answer


@pytest.mark.parametrize("declare", [True, False])
def test_a_huge_metrics_is_refused_within_its_bytes(monkeypatch, declare):
    """Before: a 300 MB /metrics took 1.8 GB of RSS to read and parse."""
    monkeypatch.setattr(endpoints, "MAX_METRICS_BYTES", 1 << 20)
    with serve(flood(declare)) as url:
        tracemalloc.start()
        try:
            reading = scrape(Endpoint("big", url))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert "more than 1048576" in reading.error and not reading.samples
    assert peak < 4 << 20, f"{peak / 2**20:.0f} MiB held to refuse a 1 MiB limit"


@pytest.mark.parametrize(("answer", "says"), [
    (answers(b"[1, 2]"), "/health: a JSON list, not an object"),
    (answers(b'"ok"'), "/health: a JSON str, not an object"),
    (answers(b"[" * 60_000), "/health: not JSON (RecursionError)"),
    (answers(b"\xff{}"), "/health: not JSON (UnicodeDecodeError)"),
    (answers(OK, b"dph_x{ 1\n"), "/metrics: not Prometheus text"),
    (answers(OK, b"dph_x{a=1} 1\n"), "/metrics: not Prometheus text"),
    (lambda path, conn: conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"), "not an HTTP answer"),
    (lambda path, conn: reply(conn, b"no", "HTTP/1.1 500 Oops") if path == "/metrics" else reply(conn, OK),
     "/metrics: HTTP 500"),
])
def test_an_answer_of_the_wrong_shape_is_a_down_row_with_its_reason(capsys, answer, says):
    """Before: a list-shaped /health was a traceback (`list` has no `get`)."""
    with serve(answer) as url:
        reading = scrape(Endpoint("odd", url))
        assert says in reading.error and not reading.up, reading.error
        assert cli(["status", url]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    [line] = [x for x in captured.out.splitlines() if x.startswith("down ")]
    assert says[:40] in line


def test_a_peers_markup_and_non_finite_counts_are_shown_as_text(capsys, monkeypatch):
    """Before: a label "[/x]" raised rich's MarkupError and a NaN drop count a ValueError."""
    monkeypatch.setenv("COLUMNS", "200")
    health = json.dumps({"status": "ok", "pid": "[/pid]"}).encode()
    metrics = (b"dph_replay_ingest_groups_per_second 1\n"
               b'dph_replay_drops_total{reason="[/x]"} NaN\n'
               b'dph_replay_rejected_total{reason="[bold]y"} +Inf\n')
    with serve(answers(health, metrics)) as url:
        assert cli(["status", url]) == 0
    out = capsys.readouterr().out
    assert "[/pid]" in out and "'[/x]': nan" in out and "'[bold]y': inf" in out


@pytest.mark.timeout(30)  # opening a FIFO without O_NONBLOCK waits for a writer: this would end it
def test_announce_files_that_are_not_small_regular_files_are_unreadable_rows(tmp_path, capsys, monkeypatch):
    """Before: a FIFO hung status, /dev/zero ended in MemoryError, a list-shaped file was skipped in silence."""
    monkeypatch.setenv("COLUMNS", "200")
    directory = tmp_path / "rl" / "m" / "endpoints"
    announce_dead(directory, "learner")
    os.mkfifo(directory / "fifo.json")
    (directory / "zero.json").symlink_to("/dev/zero")
    (directory / "list.json").write_text("[1, 2]")
    (directory / "big.json").write_text(json.dumps({"name": "big", "url": "http://x", "pad": "x" * 5000}))
    problems = {ep.name: ep.problem for ep in find_endpoints([str(tmp_path)])}
    assert problems == {"big": "big.json: 5045 bytes, more than the 4096 allowed",
                        "fifo": "fifo.json: a FIFO, not read",
                        "learner": "",
                        "list": "Expected `object`, got `array`",
                        "zero": "zero.json: a symbolic link, not followed"}
    assert cli(["status", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "down fifo: unreadable: fifo.json: a FIFO, not read" in lines
    assert "down learner (pid 4242): connection refused" in lines


def test_a_symlinked_endpoints_directory_is_not_followed_out_of_the_run(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    announce_dead(elsewhere, "outsider")
    run = tmp_path / "run"
    (run / "rl" / "m").mkdir(parents=True)
    (run / "rl" / "m" / "endpoints").symlink_to(elsewhere)
    announce_dead(run / "rl" / "n" / "endpoints", "learner")
    found = find_endpoints([str(run)])
    assert [ep.name for ep in found if not ep.problem] == ["learner"]
    [link] = [ep for ep in found if ep.problem]
    assert link.name == str(run / "rl" / "m" / "endpoints") and "symbolic link" in link.problem


def test_read_regular_refuses_devices_and_what_is_longer_than_its_limit(tmp_path):
    with pytest.raises(UnsafeFile, match=r"^/dev/zero: a device, not read$"):
        read_regular(Path("/dev/zero"), 1 << 20)
    (tmp_path / "f").write_bytes(b"x" * 11)
    assert read_regular(tmp_path / "f", 11) == b"x" * 11
    with pytest.raises(UnsafeFile, match="11 bytes, more than the 10 allowed"):
        read_regular(tmp_path / "f", 10)
    with pytest.raises(UnsafeFile, match="a directory"):
        read_regular(tmp_path, 10)


@pytest.mark.parametrize(("text", "says"), [
    ("{", "Expecting property name"),
    ("[]", "Expected `object`, got `array`"),
    ('{"wall_seconds": 1}', "Object missing required field `stage_seconds`"),
    ('{"wall_seconds": NaN, "stage_seconds": {}, "rl": {}}', "wall_seconds is nan"),
    ('{"wall_seconds": 1, "stage_seconds": {"a": "b"}, "rl": {}}', "Expected `float`, got `str` - at "
                                                                    "`$.stage_seconds[...]`"),
    (None, "a symbolic link, not followed"),
])
def test_a_damaged_summary_is_one_error_line(tmp_path, capsys, text, says):
    """Before: a traceback (KeyError, JSONDecodeError, AttributeError)."""
    if text is None:
        (tmp_path / "real.json").write_text("{}")
        (tmp_path / "summary.json").symlink_to(tmp_path / "real.json")
    else:
        (tmp_path / "summary.json").write_text(text)
    assert cli(["status", str(tmp_path)]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {tmp_path / 'summary.json'}: ") and says in errors[0]


def test_a_damaged_result_json_is_a_line_and_its_processes_are_still_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    announce_dead(tmp_path / "rl" / "bad" / "endpoints", "learner", "actor0")
    (tmp_path / "rl" / "bad" / "result.json").write_text('{"name": 3}')
    announce_dead(tmp_path / "rl" / "good" / "endpoints", "learner")
    (tmp_path / "rl" / "good" / "result.json").write_text(json.dumps(rl_result(150, 0)))
    write_summary(tmp_path, ["good"])  # read only when nothing answers: here it is good, the run finished
    (tmp_path / "summary.json").unlink()
    assert cli(["status", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    [unreadable] = [x for x in lines if x.startswith("unreadable ")]
    assert f"{tmp_path / 'rl' / 'bad' / 'result.json'}: Expected `str`, got `int` - at `$.name`" in unreadable
    assert "down actor0 (pid 4242): connection refused" in lines and "rl/good: finished, 150 steps in 16 s" in lines


def test_a_peers_control_characters_are_shown_escaped_never_sent_to_the_terminal(tmp_path, capsys, monkeypatch):
    """Before: markup was escaped but an ESC went through as it came, so a peer's pid, an announce file's
    name or a summary's mode could clear the screen, retitle the terminal or colour what followed."""
    monkeypatch.setenv("COLUMNS", "200")
    evil = "\x1b]0;owned\x07\x1b[2J"
    health = json.dumps({"status": "ok", "pid": evil}).encode()
    directory = tmp_path / "rl" / "m" / "endpoints"
    directory.mkdir(parents=True)
    (directory / "x.json").write_text(json.dumps({"name": evil, "url": f"http://127.0.0.1:{closed_port()}",
                                                  "pid": 1}))
    with serve(answers(health, b"dph_replay_ingest_groups_per_second 1\n")) as url:
        assert cli(["status", url, str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert out.count("\\x1b]0;owned\\x07") == 2  # the pid's row and the announce file's


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://127.0.0.1:80:80", "http://[::1",
                                 "http://[zz]:1", f"http://{'a' * 70}.x:80"])
def test_an_announced_url_that_cannot_be_used_is_a_down_row(tmp_path, capsys, url):
    """Before: a port past 65535 (or an IPv6 host left open, a label IDNA refuses) in one announce file
    was a ValueError traceback, and no other process of the run was shown."""
    directory = tmp_path / "rl" / "m" / "endpoints"
    announce_dead(directory, "learner")
    (directory / "odd.json").write_text(json.dumps({"name": "odd", "url": url, "pid": 7}))
    assert cli(["status", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.out.splitlines()
    assert "down learner (pid 4242): connection refused" in lines
    assert any(line.startswith("down odd (pid 7): ") for line in lines)
