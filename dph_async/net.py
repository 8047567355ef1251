"""Socket security shared by every service and client: loopback by default, CURVE otherwise.

A service binds 127.0.0.1 unless told otherwise. Binding any other address needs CURVE keys (a
directory made by `dph-async keys`) or an explicit insecure flag. With keys, the server encrypts and
authenticates every connection: only clients whose public key is in the directory's `authorized/`
folder get through (pyzmq's ZAP authenticator refuses the rest during the handshake).

Key directory layout (`dph-async keys DIR`):
    DIR/server.key, DIR/server.key_secret   the service's key pair
    DIR/client.key, DIR/client.key_secret   the key pair clients use
    DIR/authorized/*.key                    public keys of the clients the service accepts
For a stricter set-up give actor and learner nodes only client.key_secret and server.key.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import threading
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
    non-loopback bind in the clear."""

    curve_keys: str | None = None
    insecure: bool = False

    @classmethod
    def from_config(cls, net: object) -> NetSecurity:
        """From the run config's `net` section (fields curve_keys and insecure)."""
        return cls(
            curve_keys=getattr(net, "curve_keys", None), insecure=bool(getattr(net, "insecure", False))
        )


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


# One ZAP authenticator per context: libzmq routes every handshake of a context to one handler.
_authenticators: weakref.WeakKeyDictionary[zmq.Context, ThreadAuthenticator] = weakref.WeakKeyDictionary()
_auth_lock = threading.Lock()


def _ensure_authenticator(ctx: zmq.Context, keys: Path) -> None:
    authorized = keys / "authorized"
    if not authorized.is_dir():
        raise FileNotFoundError(f"CURVE key directory {keys} has no authorized/ folder of client public keys")
    with _auth_lock:
        if ctx in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=log)
        auth.start()
        auth.configure_curve(domain="*", location=str(authorized))
        _authenticators[ctx] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's authenticator thread, if one was started (before ctx.term())."""
    with _auth_lock:
        auth = _authenticators.pop(ctx, None)
    if auth is not None:
        auth.stop()


def bind(sock: zmq.Socket, addr: str, security: NetSecurity) -> str:
    """Bind `sock` under the security rules; returns the bound endpoint (a tcp port 0 or * is resolved)."""
    if not is_local_endpoint(addr):
        if security.curve_keys is None and not security.insecure:
            raise InsecureBindError(
                f"refusing to bind {addr}: it is reachable from other machines. Give CURVE keys "
                "(`dph-async keys DIR`, then net.curve_keys=DIR) or pass --insecure (net.insecure=true)."
            )
        if security.curve_keys is None:
            log.warning("binding %s without encryption or authentication (insecure flag set)", addr)
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


def connect(sock: zmq.Socket, addr: str, security: NetSecurity) -> None:
    """Connect `sock`, as a CURVE client when keys are configured."""
    if security.curve_keys is not None:
        keys = Path(security.curve_keys)
        sock.curve_publickey, sock.curve_secretkey = _load_pair(keys, "client")
        server_public, _ = zmq.auth.load_certificate(keys / "server.key")
        sock.curve_serverkey = server_public
    sock.connect(addr)


def generate_keys(directory: str | os.PathLike) -> Path:
    """Create a key directory (server and client pairs, the client authorized). Refuses to overwrite."""
    keys = Path(directory)
    if (keys / "server.key_secret").exists():
        raise FileExistsError(f"{keys} already holds keys; remove it first to make new ones")
    (keys / "authorized").mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        _, secret_file = zmq.auth.create_certificates(keys, name)
        os.chmod(secret_file, 0o600)
    shutil.copy(keys / "client.key", keys / "authorized" / "client.key")
    return keys
