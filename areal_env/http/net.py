"""Sockets for the HTTP apps: binding with TCP_NODELAY, and what counts as loopback."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """``True`` for names and addresses that only this machine can reach (all of 127/8, ::1)."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int, *, inheritable: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: a free port, read it back with
    ``getsockname``), bound before any server starts so there is no race for the port.

    ``proto=IPPROTO_TCP`` matters: asyncio sets TCP_NODELAY on accepted sockets only when the
    protocol is explicit, and without it Nagle + delayed ACK add ~40 ms to every response.
    ``inheritable``: the socket survives ``exec`` (for a server process handed the socket).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    if inheritable:
        sock.set_inheritable(True)
    return sock


def port_is_free(host: str, port: int) -> bool:
    """True when ``host:port`` can be bound now (nothing listens on it or holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def url_host(host: str) -> str:
    """``host`` as written in a URL: wildcard addresses read as loopback, IPv6 in brackets."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{shown}]" if ":" in shown else shown
