"""The listening address of ``vitkit serve`` and ``vitkit demo``, taken before anything else happens, so a port
already in use is one line naming ``--port`` (exit 2) instead of a banner followed by a server's own errors."""

from __future__ import annotations

import errno
import socket

from vitkit.errors import ConfigError


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` the way uvicorn binds one (SO_REUSEADDR; IPv6 when the host has a
    colon), not yet listening; uvicorn takes it as it is (``Server.run(sockets=[...])``).

    Raises ConfigError naming ``--port`` when the port is taken or needs privileges, ``--host`` when the host is
    not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except socket.gaierror as e:
        sock.close()
        raise ConfigError(f"--host {host}: not a name or address of this machine ({e.strerror})") from None
    except OSError as e:
        sock.close()
        raise ConfigError(_bind_error(host, port, e)) from None
    sock.set_inheritable(True)
    return sock


def check_free(host: str, port: int) -> None:
    """Raise ConfigError (as :func:`bind`) unless ``host``:``port`` can be listened on now."""
    bind(host, port).close()


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is already in use by another program; choose another --port"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied to listen on {host}:{port} (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    return f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})"
