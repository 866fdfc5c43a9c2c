"""The TCP addresses a `radix-mlx` command listens on, parsed and checked before it loads
the model: a port out of range or already in use is one line naming the flag, at once,
rather than a bind error (a `zmq.error.ZMQError` traceback) minutes later."""

from __future__ import annotations

import errno
import os
import socket

MAX_PORT = 65535
WILDCARD_HOSTS = ("*", "0.0.0.0", "")  # ZMQ's `*` is every interface, as 0.0.0.0 is


def check_port(port: int, flag: str) -> None:
    """ValueError naming `flag` unless `port` is a TCP port one can listen on."""
    if not 1 <= port <= MAX_PORT:
        raise ValueError(f"{flag} {port}: a TCP port is 1..{MAX_PORT}")


def tcp_address(address: str, flag: str) -> tuple[str, int]:
    """(host, port) of a `tcp://HOST:PORT` flag value; ValueError naming `flag`."""
    expected = f"{flag} {address}: expected tcp://HOST:PORT"
    host, colon, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not colon or not host or not port.isdigit():
        raise ValueError(expected)
    if not 1 <= int(port) <= MAX_PORT:
        raise ValueError(f"{flag} {address}: a TCP port is 1..{MAX_PORT}")
    return host.strip("[]"), int(port)  # [::1]: an IPv6 host


def listen_addresses(args, command: str) -> list[tuple[str, str, int]]:
    """(flag, host, port) of every TCP address `command` (serve, replica) listens on: the
    HTTP port and the SDK front door, or a replica's --listen, and the loopback ring of a
    distributed worker on this machine."""
    if command == "serve":
        out = [("--port", args.host, args.port)]
        zmq_flag = "--zmq-port" if args.zmq_port else "--zmq-port (default: --port + 1)"
        out.append((zmq_flag, args.host, args.zmq_port or args.port + 1))
    else:
        out = [("--listen", *tcp_address(args.listen, "--listen"))]
    if args.group_size > 1 and args.dist_port and not args.dist_hostfile:
        ring = range(args.dist_port, args.dist_port + args.group_size)
        out += [("--dist-port", "127.0.0.1", port) for port in ring]
    return out


def unavailable_address(args, command: str) -> str | None:
    """The one line naming the flag and the address of the first TCP address `command`
    cannot listen on (in use, or not this machine's), or None."""
    for flag, host, port in listen_addresses(args, command):
        problem = _bind_problem(host, port)
        if problem:
            return f"{flag}: cannot listen on {host}:{port}: {problem}"
    return None


def _bind_problem(host: str, port: int) -> str | None:
    """Why binding (host, port) fails now, as uvicorn and ZMQ bind it (SO_REUSEADDR, so a
    closed connection's TIME_WAIT is no conflict), or None."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            None if host in WILDCARD_HOSTS else host, port, type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE,
        )[0]  # fmt: skip
    except socket.gaierror:
        return None  # a ZMQ interface name, say: the bind itself will say what is wrong
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "the address is already in use (another server on that port?)"
            return os.strerror(exc.errno).lower() if exc.errno else str(exc)
    return None
