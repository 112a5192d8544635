"""Free loopback ports for local stacks and tests.

Ports are drawn at random from below the kernel's ephemeral range, so a port chosen now cannot
be taken meanwhile by an outgoing connection or by a `bind(0)` elsewhere on the machine.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_FALLBACK_EPHEMERAL_START = 32768
_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_START
    return low if low > _LOWEST + 1000 else _FALLBACK_EPHEMERAL_START


def _bindable(sock: socket.socket, host: str, port: int) -> bool:
    try:
        sock.bind((host, port))
    except OSError:
        return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free right now, outside the ephemeral range."""
    upper = _ephemeral_start()
    held: list[socket.socket] = []
    try:
        for _ in range(200 * count):
            if len(held) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            if _bindable(sock, host, random.randrange(_LOWEST, upper)):
                held.append(sock)
            else:
                sock.close()
        if len(held) < count:
            raise OSError(f"found only {len(held)} of {count} free ports on {host}")
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for sock in held:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port free right now, outside the ephemeral range."""
    return free_ports(1, host)[0]
