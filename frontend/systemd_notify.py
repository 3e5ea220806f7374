"""systemd's service notifications (``Type=notify``, ``WatchdogSec=``), without libsystemd.

The protocol is one datagram of ``KEY=value`` lines to the socket named by
``$NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``); without it
(not under systemd) every call does nothing.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


def notify(*lines: str) -> bool:
    """Send ``READY=1``, ``STOPPING=1``, ``STATUS=...``, ``WATCHDOG=1``...; returns whether
    a notification socket was there to take it."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(lines).encode())
    except OSError as error:
        logger.warning("systemd notification %r failed: %s", lines, error)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WatchdogSec=`` (systemd's advice), when
    the watchdog is on for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
