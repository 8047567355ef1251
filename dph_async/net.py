"""Socket security shared by every service and client: loopback by default, CURVE otherwise.

A service binds 127.0.0.1 unless told otherwise. Binding any other address needs CURVE keys (a
directory made by `dph-async keys`) or an explicit insecure flag. With keys, the server encrypts and
authenticates every connection: only clients whose public key is in the directory's `authorized/`
folder get through (pyzmq's ZAP authenticator refuses the rest during the handshake).

Key directory layout (`dph-async keys DIR`):
    DIR/server.key, DIR/server.key_secret    the service's key pair
    DIR/client.key, DIR/client.key_secret    the key pair actors use
    DIR/control.key, DIR/control.key_secret  the learner's key pair: the control identity, the only
                                             one whose batch requests and commands the replay obeys
    DIR/authorized/*.key                     public keys of the clients the service accepts
Give actor nodes only client.key_secret and server.key: what they lack is the control identity.
The authorized keys and the control key are read again when they change (`CurveKeys`): a key added
is accepted and a key removed is refused from then on, open connections included, without a restart.

Without CURVE (loopback), control is authorized by a random token that the process starting the
replay creates and hands to the learner's client (`control_token`).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import shutil
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)


class InsecureBindError(ValueError):
    """A service was asked to listen beyond this machine without CURVE keys or the insecure flag."""


@dataclass(frozen=True)
class NetSecurity:
    """How sockets are secured. curve_keys: a key directory (see module docstring); insecure: allow a
    non-loopback bind in the clear; gate: services read peers through a gate process allowed
    gate_memory_mb (dph_async/gate.py)."""

    curve_keys: str | None = None
    insecure: bool = False
    gate: bool = True
    gate_memory_mb: float = 1024.0

    @classmethod
    def from_config(cls, net: object) -> NetSecurity:
        """From the run config's `net` section."""
        return cls(net.curve_keys, net.insecure, net.gate, net.gate_memory_mb)

    def require_gate_room(self, mb: float, key: str) -> None:
        """Raise ValueError if a gate is on and cannot hold two messages of `mb` MB (`key`: the setting)."""
        if self.gate and self.gate_memory_mb < 2 * mb:
            raise ValueError(f"net.gate_memory_mb ({self.gate_memory_mb:g}) must be at least twice {key} ({mb:g})")


def is_local_endpoint(addr: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address; False for anything else."""
    scheme, _, rest = addr.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host in ("localhost", "lo"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


def _load_pair(keys: Path, name: str) -> tuple[bytes, bytes]:
    path = keys / f"{name}.key_secret"
    if not path.is_file():
        raise FileNotFoundError(
            f"CURVE key file {path} not found (create the directory with `dph-async keys {keys}`)"
        )
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key")
    return public, secret


class CurveKeys:
    """The client public keys a service accepts (DIR/authorized/*.key) and the control key
    (DIR/control.key), as z85 text, read again when the files change (checked at most every
    `check_s` seconds). The ZAP authenticator asks `callback` at each handshake; a service asks
    `allows` for each message, so a removed key's open connections are refused too."""

    def __init__(self, keys: Path, check_s: float = 1.0):
        self.dir = keys
        self.check_s = check_s
        self._lock = threading.Lock()
        self._signature: tuple = ()
        self._checked = -float("inf")
        self.allowed: frozenset[str] = frozenset()
        self.control = ""
        self.refresh()

    def _files(self) -> list[Path]:
        files = sorted((self.dir / "authorized").glob("*.key"))
        return [*files, self.dir / "control.key"]

    def refresh(self) -> None:
        """Re-read the keys if `check_s` has passed and a key file was added, removed or changed."""
        now = time.monotonic()
        if now - self._checked < self.check_s:
            return
        with self._lock:
            self._checked = now
            files = self._files()
            signature = tuple((p.name, st.st_mtime_ns, st.st_size) for p in files if (st := _stat(p)) is not None)
            if signature == self._signature:
                return
            self._signature = signature
            keys = {key for p in files[:-1] if (key := _public_key(p))}
            self.control = _public_key(files[-1]) if files[-1].is_file() else ""
            self.allowed = frozenset(keys | ({self.control} if self.control else set()))
            log.info("CURVE keys of %s: %d authorized, control key %s", self.dir, len(self.allowed),
                     "present" if self.control else "absent")

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials-provider hook: may the client with this z85 key connect?"""
        return self.allows(key.decode("ascii", "replace"))

    def allows(self, user_id: str) -> bool:
        self.refresh()
        return user_id in self.allowed

    def is_control(self, user_id: str) -> bool:
        self.refresh()
        return bool(self.control) and user_id == self.control


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _public_key(path: Path) -> str:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        log.warning("CURVE key file %s unreadable, ignored: %s", path, e)
        return ""
    return public.decode("ascii")


_curve_keys: dict[Path, CurveKeys] = {}
# One ZAP authenticator per context: libzmq routes every handshake of a context to one handler.
_authenticators: weakref.WeakKeyDictionary[zmq.Context, ThreadAuthenticator] = weakref.WeakKeyDictionary()
_auth_lock = threading.Lock()


def curve_keys(directory: str | os.PathLike) -> CurveKeys:
    """The process's one CurveKeys for a key directory (the authenticator and the services share it)."""
    keys = Path(directory).resolve()
    if not (keys / "authorized").is_dir():
        raise FileNotFoundError(f"CURVE key directory {keys} has no authorized/ folder of client public keys")
    with _auth_lock:
        if keys not in _curve_keys:
            _curve_keys[keys] = CurveKeys(keys)
        return _curve_keys[keys]


def _ensure_authenticator(ctx: zmq.Context, keys: Path) -> None:
    provider = curve_keys(keys)
    with _auth_lock:
        if ctx in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=provider)
        _authenticators[ctx] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's authenticator thread, if one was started (before ctx.term())."""
    with _auth_lock:
        auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


def check_bind(addr: str, security: NetSecurity) -> None:
    """Raise InsecureBindError if the security rules forbid binding `addr` (warn if only the insecure
    flag allows it)."""
    if not is_local_endpoint(addr):
        if security.curve_keys is None and not security.insecure:
            raise InsecureBindError(
                f"refusing to bind {addr}: it is reachable from other machines. Give CURVE keys "
                "(`dph-async keys DIR`, then net.curve_keys=DIR) or pass --insecure (net.insecure=true)."
            )
        if security.curve_keys is None:
            log.warning("binding %s without encryption or authentication (insecure flag set)", addr)


def bind(sock: zmq.Socket, addr: str, security: NetSecurity) -> str:
    """Bind `sock` under the security rules; returns the bound endpoint (a tcp port 0 or * is resolved)."""
    check_bind(addr, security)
    if security.curve_keys is not None:
        keys = Path(security.curve_keys)
        public, secret = _load_pair(keys, "server")
        _ensure_authenticator(sock.context, keys)
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_server = True
    if addr.startswith("tcp://") and addr.endswith(":0"):
        addr = addr[:-1] + "*"
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, addr: str, security: NetSecurity, identity: str = "client") -> None:
    """Connect `sock`, as a CURVE client when keys are configured: with the key pair `identity`
    ("client" for actors, "control" for the learner)."""
    if security.curve_keys is not None:
        keys = Path(security.curve_keys)
        sock.curve_publickey, sock.curve_secretkey = _load_pair(keys, identity)
        server_public, _ = zmq.auth.load_certificate(keys / "server.key")
        sock.curve_serverkey = server_public
    sock.connect(addr)


def generate_keys(directory: str | os.PathLike) -> Path:
    """Create a key directory (server, client and control pairs, the client authorized). Refuses to
    overwrite."""
    keys = Path(directory)
    if (keys / "server.key_secret").exists():
        raise FileExistsError(f"{keys} already holds keys; remove it first to make new ones")
    (keys / "authorized").mkdir(parents=True, exist_ok=True)
    for name in ("server", "client", "control"):
        _, secret_file = zmq.auth.create_certificates(keys, name)
        os.chmod(secret_file, 0o600)
    shutil.copy(keys / "client.key", keys / "authorized" / "client.key")
    return keys


CONTROL_TOKEN_FILE = "control.token"
ACTOR_TOKEN_FILE = "actor.token"


def control_token(directory: str | os.PathLike, name: str = CONTROL_TOKEN_FILE) -> bytes:
    """The replay's control token kept in `directory` (created, readable by its owner only, if
    absent): whoever starts the replay makes it, the learner's client reads it, actors never get it.
    Kept in a file so a restarted replay keeps the token its learner holds. name=ACTOR_TOKEN_FILE:
    the actor token, which the run's actors' ticket requests carry (never the control token)."""
    path = Path(directory) / name
    token = secret_file(path)
    # A data directory may have been copied or shared: a token file someone else owns, or one others
    # may read, is a token others may know, and it commands the replay (batches, snapshots, shutdown)
    # or, for the actor token, takes the tickets kept for the run's own actors.
    info = os.stat(path, follow_symlinks=False)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"{path}: a token must be this user's and readable by its owner only "
                         f"(owner uid {info.st_uid}, mode {stat.filemode(info.st_mode)}); remove it to make a new one")
    return token


def secret_file(path: Path) -> bytes:
    """The random token kept in `path`, made (readable by its owner only) if absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        # Written whole under a private name, then linked into place: a reader never sees it half
        # written, and of two processes starting at once the first link wins and both read it.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_bytes(32).hex())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    token = read_secret(path)
    if token is None:
        raise FileNotFoundError(f"{path}: token file vanished as it was made")
    return token


SECRET_MAX_BYTES = 4096


def read_secret(path: Path) -> bytes | None:
    """The token in `path`, or None when there is none. The file must be a regular file (a symlink,
    a FIFO or a device is refused, never followed or waited on) of hex digits."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ValueError(f"{path}: not a token file ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which refuses a directory naming only the fd
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        text = f.read(SECRET_MAX_BYTES + 1)
    try:
        token = bytes.fromhex(text.decode("ascii").strip()) if len(text) <= SECRET_MAX_BYTES else b""
    except ValueError:
        token = b""
    if len(token) < 16:  # an empty or short token would let anyone guess it
        raise ValueError(f"{path}: not a token (at least 32 hex digits expected); remove it to make a new one")
    return token
