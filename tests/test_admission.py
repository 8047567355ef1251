"""Admission of connections per connection and per credential (dph_async/admission.py), and the token
files the credentials live in (dph_async/net.py)."""

from __future__ import annotations

import os
import stat

import pytest

from dph_async.admission import Connections, authorized, bearer
from dph_async.net import read_secret, secret_file
from dph_async.rewards.service import ServiceSettings


class Closed:
    """A connection's close callback that records which connection was closed."""

    def __init__(self) -> None:
        self.order: list[int] = []

    def of(self, i: int):
        return lambda: self.order.append(i)


def test_a_new_connection_closes_the_one_that_has_waited_longest():
    closed = Closed()
    c = Connections(limit=3, reserved=1)
    tickets = [c.open(closed.of(i)) for i in range(3)]
    assert c.serve(tickets[1], trusted=False)  # 1 is served: only 0 and 2 wait
    fourth = c.open(closed.of(3))
    assert fourth is not None and closed.order == [0]
    c.idle(tickets[1])  # 1 waits again, after 2
    c.open(closed.of(4))
    assert closed.order == [0, 2]
    assert c.open_count == 3


def test_anonymous_requests_never_take_the_reserved_connections():
    c = Connections(limit=4, reserved=1)
    tickets = [c.open(lambda: None) for _ in range(4)]
    assert [c.serve(t, trusted=False) for t in tickets[:3]] == [True] * 3
    assert not c.serve(tickets[3], trusted=False)  # the fourth slot is the run's own
    assert c.serve(tickets[3], trusted=True)
    assert c.open(lambda: None) is None  # every slot serves a request: nothing to close for a newcomer
    c.idle(tickets[0])  # an anonymous connection between requests waits again: the next anonymous fits
    assert c.serve(tickets[0], trusted=False)
    c.idle(tickets[3])
    assert c.serve(tickets[3], trusted=False)  # a connection that showed the token stays the run's own


def test_every_ending_gives_the_connection_back_once():
    c = Connections(limit=2, reserved=1)
    a, b = c.open(lambda: None), c.open(lambda: None)
    c.serve(a, trusted=False)
    c.close(a)
    c.close(a)  # a handler's own close after the connection was closed for a newcomer
    assert (c.open_count, c.anonymous) == (1, 0)
    assert not c.serve(a, trusted=True)  # a closed connection is served nothing
    c.close(b)
    assert (c.open_count, c.anonymous) == (0, 0)


def test_limits_must_leave_anonymous_clients_something():
    with pytest.raises(ValueError, match="reserved connections"):
        Connections(limit=4, reserved=4)


def test_the_credential_is_the_bearer_token_and_nothing_else():
    assert authorized("s3cret", "Bearer s3cret") and authorized("s3cret", b"Bearer s3cret")
    assert bearer("s3cret") == {"Authorization": "Bearer s3cret"}
    for wrong in ["Bearer s3cre", "Bearer s3cret ", "s3cret", "", None, "Bearer s3crét"]:
        assert not authorized("s3cret", wrong), wrong
    assert not authorized(None, "Bearer ") and not authorized("", "Bearer ") and bearer(None) == {}


def test_the_scorer_settings_never_show_the_token():
    assert "s3cret" not in repr(ServiceSettings(token="s3cret"))
    assert "s3cret" not in str(ServiceSettings(token="s3cret"))


def test_a_token_file_is_made_once_private_and_read_back(tmp_path):
    path = tmp_path / "endpoints" / "access.token"
    first = secret_file(path)
    assert len(first) == 32 and secret_file(path) == first == read_secret(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(tmp_path / "none.token") is None


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "short", "not_hex", "huge"])
def test_a_token_file_that_is_not_one_is_refused_naming_it(tmp_path, kind):
    path = tmp_path / "access.token"
    if kind == "symlink":
        real = tmp_path / "real.token"
        real.write_text("ab" * 32)
        path.symlink_to(real)
    elif kind == "fifo":
        os.mkfifo(path)  # a reader that opened it for reading would wait for a writer for ever
    elif kind == "directory":
        path.mkdir()  # before: "[Errno 21] Is a directory: 3", naming a file descriptor, not the file
    else:
        path.write_text({"short": "abcd", "not_hex": "zz" * 32, "huge": "ab" * 4096}[kind])
    with pytest.raises(ValueError, match=r"access\.token"):
        read_secret(path)


def test_a_control_token_that_others_may_read_is_refused_not_trusted(tmp_path, capsys):
    """The control token commands the replay (batches, snapshots, shutdown). Before: `serve replay`
    took a control.token planted in a copied or shared data directory, mode 0644 and of a value the
    planter knows, and obeyed whoever sent it."""
    from dph_async.cli.main import main
    from dph_async.net import CONTROL_TOKEN_FILE, control_token

    path = tmp_path / CONTROL_TOKEN_FILE
    path.write_text("00" * 32)
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"control\.token: a token must be this user's and readable by its "
                                         r"owner only \(owner uid \d+, mode -rw-r--r--\)"):
        control_token(tmp_path)
    assert main(["serve", "replay", "--ingest", "tcp://127.0.0.1:0", "--batch", "tcp://127.0.0.1:0", "--no-wal",
                 "--data-dir", str(tmp_path), f"output_dir={tmp_path}"]) == 2
    assert "control.token: a token must be this user's" in capsys.readouterr().err
    path.chmod(0o600)
    assert control_token(tmp_path) == bytes(32)
    path.unlink()
    made = control_token(tmp_path)  # made afresh, private
    assert len(made) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_actor_token_equal_to_the_control_token_is_refused(tmp_path, capsys):
    """An actor token copied from control.token would let every actor take batches and shut the
    replay down. Before: `serve replay` started with the two files equal."""
    from dph_async.cli.main import main
    from dph_async.net import ACTOR_TOKEN_FILE, CONTROL_TOKEN_FILE

    for name in (CONTROL_TOKEN_FILE, ACTOR_TOKEN_FILE):
        (tmp_path / name).write_text("ab" * 32)
        (tmp_path / name).chmod(0o600)
    assert main(["serve", "replay", "--ingest", "tcp://127.0.0.1:0", "--batch", "tcp://127.0.0.1:0", "--no-wal",
                 "--data-dir", str(tmp_path), f"output_dir={tmp_path}"]) == 2
    assert "the actor token must not be the control token" in capsys.readouterr().err
