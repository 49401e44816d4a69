"""Listening TCP sockets of given processes, from ``ss -ltnpH`` (iproute2): what the
exposure tests check against loopback."""

from __future__ import annotations

import re
import shutil
import subprocess

LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
_USER = re.compile(r'\("([^"]+)",pid=(\d+)')


def listening(pids: set[int]) -> list[tuple[str, int, str, int]]:
    """(host, port, process name, pid) of every listening TCP socket of ``pids``, sorted;
    hosts without brackets or zone (``::ffff:127.0.0.1``, ``0.0.0.0``, ``*``)."""
    ss = shutil.which("ss")
    if ss is None:
        raise RuntimeError("listing sockets needs `ss` (Debian package iproute2)")
    out = subprocess.run([ss, "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        host, _, port = fields[3].rpartition(":")
        for name, pid in _USER.findall(line):
            if int(pid) in pids:
                rows.append((host.strip("[]").split("%")[0], int(port), name, int(pid)))
    return sorted(set(rows))
