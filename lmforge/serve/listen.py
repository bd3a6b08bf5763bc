"""Where `lmforge serve` listens, and the socket, bound before the model loads so that a port in use is one
clear error line at once.

Binds 127.0.0.1 unless told otherwise. Inside a SageMaker container (SAGEMAKER_BIND_TO_PORT set) the
port comes from that variable and the host defaults to 0.0.0.0, as the platform's health checks need.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from lmforge.errors import UserError


def listen_address(host: str | None, port: int | None) -> tuple[str, int]:
    env = os.environ.get("SAGEMAKER_BIND_TO_PORT")
    if port is None and env:
        if not env.isdigit():
            raise UserError(f"SAGEMAKER_BIND_TO_PORT is '{env}', not a port number: fix the variable")
        port = int(env)
    if host is None:
        host = "0.0.0.0" if env else "127.0.0.1"
    return host, 8000 if port is None else port


def bind(host: str, port: int) -> socket.socket:
    """A bound socket for uvicorn, or a UserError saying why not."""
    if not 0 <= port <= 65535:
        raise UserError(f"port {port} is out of range: use 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        fix = "stop the other server or pick another --port" if e.errno == 98 else "check --host and --port"
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}): {fix}") from None
    return sock


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
