"""Where `lmforge serve` listens, and the socket, bound before the model loads so that a port in use
is one clear error line at once.

Binds 127.0.0.1 unless told otherwise. Inside a SageMaker container (SAGEMAKER_BIND_TO_PORT set) the
port comes from that variable and the host defaults to 0.0.0.0, as the platform's health checks
need.

The Host names the server answers to (lmforge.serve.middleware.HostCheck) beyond IP addresses and
localhost: the --host name, this machine's name where it listens beyond loopback, and
--allowed-hosts. Inside SageMaker, any: its proxy sends a Host of its own, and the endpoint is
reached only through SageMaker's signed (IAM) API.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence

from lmforge.errors import UserError


def listen_address(host: str | None, port: int | None) -> tuple[str, int]:
    env = os.environ.get("SAGEMAKER_BIND_TO_PORT")
    if port is None and env:
        if not env.isdigit():
            raise UserError(
                f"SAGEMAKER_BIND_TO_PORT is '{env}', not a port number: fix the variable"
            )
        port = int(env)
    if host is None:
        host = "0.0.0.0" if env else "127.0.0.1"
    return host, 8000 if port is None else port


def bind(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn, or a UserError saying why not."""
    if not 0 <= port <= 65535:
        raise UserError(f"port {port} is out of range: use 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
    # it each keep-alive answer waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fix = (
            "stop the other server or pick another --port"
            if e.errno == 98
            else "check --host and --port"
        )
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}): {fix}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def allowed_hosts(host: str, flag: str | None) -> Sequence[str]:
    """The Host names `lmforge serve --host HOST --allowed-hosts FLAG` answers to besides
    addresses and localhost."""
    if flag is None and os.environ.get("SAGEMAKER_BIND_TO_PORT"):
        return ("*",)
    names = [n.strip().lower() for n in (flag or "").split(",") if n.strip()]
    if "*" in names:
        return ("*",)
    extra = [host.lower()] if host and not _is_address(host) else []
    if not is_loopback(host):  # reached from other machines, most often by this one's name
        extra.append(socket.gethostname().lower())
    return tuple(dict.fromkeys(n for n in [*names, *extra] if n))


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
