"""CURVE keys for links that leave the machine: a router and its remote replicas.

`radix-mlx keys --out DIR` writes two key pairs with pyzmq's `zmq.auth`:
  DIR/replica.key, DIR/replica.key_secret   the replicas' (server) pair
  DIR/router.key, DIR/router.key_secret     the router's (client) pair
  DIR/authorized/router.key                 the router's public key, the replicas' allow-list
The replica runs with `--curve-secret-key DIR/replica.key_secret --curve-authorized-keys
DIR/authorized`; the router with `--curve-secret-key DIR/router.key_secret
--curve-server-key DIR/replica.key`. Each machine needs only its own secret file and the
other side's public one. CURVE encrypts the link and authenticates both ends; the replica's
ZAP handler (`zmq.auth.thread.ThreadAuthenticator`) admits only the listed client keys.
"""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

REPLICA, ROUTER, AUTHORIZED = "replica", "router", "authorized"


def generate_keys(out_dir: str | Path) -> list[Path]:
    """Write both key pairs and the allow-list into out_dir; returns the files written.
    Refuses to overwrite existing keys (a router would lose its replicas)."""
    out = Path(out_dir)
    existing = [out / f"{n}.key_secret" for n in (REPLICA, ROUTER)]
    if any(p.exists() for p in existing):
        raise FileExistsError(f"{out} already holds keys; remove them or choose another --out")
    (out / AUTHORIZED).mkdir(parents=True, exist_ok=True)
    files = []
    for name in (REPLICA, ROUTER):
        public, secret = zmq.auth.create_certificates(out, name)
        Path(secret).chmod(0o600)
        files += [Path(public), Path(secret)]
    files.append(Path(shutil.copy(out / f"{ROUTER}.key", out / AUTHORIZED / f"{ROUTER}.key")))
    return files


def load_secret(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a `.key_secret` file; ValueError naming the file otherwise."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the key file {path}: {exc}") from None
    if secret is None:
        raise ValueError(f"{path} holds no secret key (give the .key_secret file)")
    return public, secret


def load_public(path: str) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the key file {path}: {exc}") from None
    return public


def make_client(sock: zmq.Socket, secret_file: str, server_public_file: str) -> None:
    """Make `sock` (before it connects) a CURVE client of the server with that public key."""
    public, secret = load_secret(secret_file)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = load_public(server_public_file)


def make_server(sock: zmq.Socket, secret_file: str) -> None:
    """Make `sock` (before it binds) a CURVE server; the ZAP handler decides who may connect."""
    public, secret = load_secret(secret_file)
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


def start_authenticator(ctx: zmq.Context, authorized_dir: str) -> ThreadAuthenticator:
    """The allow-list of client public keys (every `*.key` in the directory), in its own
    thread on `ctx` (a sync context: the ZAP handler must share the sockets' context)."""
    if not Path(authorized_dir).is_dir() or not list(Path(authorized_dir).glob("*.key")):
        raise ValueError(f"--curve-authorized-keys {authorized_dir}: no *.key files there")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_dir))
    return auth


def is_loopback(address: str) -> bool:
    """Whether a `tcp://HOST:PORT` address can only be reached from this machine."""
    host = urlsplit(address).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name, an interface name or `*`: reachable from elsewhere
