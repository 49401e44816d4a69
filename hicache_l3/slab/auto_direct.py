"""``o_direct=auto``: O_DIRECT for a store of large pages many times bigger than the page
cache its process may use. There most random gets miss the page cache, and a buffered read
pays a copy through it and evicts pages another tier (SGLang's host memory) already holds;
with small pages or a store the page cache covers, buffered I/O is as fast or faster
(docs/benchmarks.md, 'Beyond memory')."""

from __future__ import annotations

import os
from pathlib import Path

AUTO_PAGE_BYTES = 1 << 20  # pages at least this large
AUTO_STORE_RATIO = 4  # in a store at least this many times the page cache


def memory_total(proc: Path = Path("/proc")) -> int:
    """Bytes of memory of this machine (``MemTotal`` of ``/proc/meminfo``)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def page_cache_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of page cache this process may take: the machine's memory, or less where the
    memory cgroup holding the process, or one above it, has a lower limit (v1 or v2)."""
    limit = memory_total(proc)
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return limit
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = cgroups, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroups / "memory", "memory.limit_in_bytes"
        else:
            continue
        here = Path(path.lstrip("/"))
        for directory in (base / here, *(base / up for up in here.parents)):
            try:
                value = (directory / name).read_text().strip()
            except OSError:
                continue
            if value.isdigit():
                limit = min(limit, int(value))
    return limit


def choose_o_direct(slot_bytes: int, capacity_bytes: int, page_cache: int) -> bool:
    """Whether ``o_direct=auto`` moves pages of ``slot_bytes`` with O_DIRECT in a store of
    ``capacity_bytes`` whose process may cache ``page_cache`` bytes."""
    return slot_bytes >= AUTO_PAGE_BYTES and capacity_bytes >= AUTO_STORE_RATIO * page_cache
