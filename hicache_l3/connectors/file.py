"""The file connector: pages in preallocated slab files on any POSIX path (the shared slab
store, :mod:`hicache_l3.slab`), moved zero-copy between registered memory and the slabs by
the C batch library, a share of a batch per call; a torn, stale, recycled or corrupted slot
is a miss. With O_DIRECT (``o_direct=true``, or ``auto`` once the page size shows a store of
large pages many times the page cache: :mod:`hicache_l3.slab.auto_direct`) a page whose
segments are 4 KiB-aligned bypasses the page cache, other pages go through it (counted
``direct_fallback``). Roots that are URLs go through fsspec instead
(:mod:`hicache_l3.connectors.fsspec_root`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Literal

from hicache_l3.common.compression import COMPRESSION_HELP
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.safe_fs import private_root
from hicache_l3.slab.auto_direct import choose_o_direct, page_cache_bytes
from hicache_l3.slab.connector import SlabConnector
from hicache_l3.slab.format import ALIGN
from hicache_l3.slab.io import SlotTransport
from hicache_l3.slab.store import SlabStore
from hicache_l3.slab.uring import MAX_DEPTH as URING_MAX_DEPTH
from hicache_l3.slab.uring import select_transport

log = logging.getLogger(__name__)


@dataclasses.dataclass
class FileConfig(ConnectorConfig):
    """Settings of the file connector (``HICACHE_L3_FILE_<FIELD>`` in the environment)."""

    root: str = setting("", "directory holding the pages (or an fsspec URL: slower copying path)")
    capacity_bytes: int = setting(
        0, "slab bytes this process may fill before evicting its LRU pages; "
        "0 = half the free space of the filesystem at open", size=True,
    )
    slab_bytes: int = setting(256 << 20, "size of one preallocated slab file", size=True)
    io_threads: int = setting(2, "threads reading the pages of one batch in parallel (a batch of "
                              "under 1 MiB is read by the calling thread alone)")
    cold_read_threads: int = setting(
        16, "threads reading the pages of a batch that are not in the page cache (each waits on the "
        "disk, so this is the batch's queue depth on a store bigger than the page cache; 0 or 1: "
        "they are read by the io_threads, one or two at a time)")
    io_uring_depth: int = setting(
        128, "pages in flight at once through io_uring (one C call per batch, no thread per page) "
        "for O_DIRECT pages and for pages of 256 KiB or more that a read finds outside the page "
        "cache (smaller ones: the cold_read_threads); 0: blocking calls by threads. Where the kernel "
        "refuses io_uring (ENOSYS, EPERM under seccomp) one log line says so and the blocking path "
        "is kept (docs/benchmarks.md, 'Beyond memory')")
    write_threads: int = setting(
        2, "threads writing the pages of one batch of 1 MiB or more")
    checksum: Literal["xxh3", "none"] = setting(
        "xxh3", "page checksum written on set, verified on every get; with xxh3 a page another "
        "writer stored without one (checksum=none) is a miss (unverified) and is stored again, "
        "checksummed. none gives up detecting bytes altered at rest, and is refused on a root "
        "other nodes may mount (multi_node)")
    multi_node: Literal["auto", "true", "false"] = setting(
        "auto", "whether other nodes, each with its own page cache, may mount root: auto = by the "
        "filesystem type (NFS, FUSE, CephFS, Lustre... yes; ext4, xfs, btrfs, tmpfs... no). There, "
        "pages must carry checksums and a page failing its checks is read again past the page "
        "cache before it is a miss (docs/reliability.md, 'Several nodes')")
    compression: Literal["none", "zstd"] = setting("none", COMPRESSION_HELP)
    fsync: Literal["none", "data", "always"] = setting("none", "durability policy (see docs)")
    o_direct: Literal["auto", "true", "false"] = setting(
        "auto", "move aligned pages with O_DIRECT, bypassing the page cache, io_uring_depth at once "
        "(io_uring_depth=0: max(io_threads, write_threads, cold_read_threads) threads): faster gets "
        "from a store much bigger than memory, slower whenever the page cache would have held the "
        "pages, and for bursts of sets. auto = true for pages of 1 MiB or more in a store "
        "(capacity_bytes) at least 4x the page cache this process may use (memory, or its memory "
        "cgroup's limit), where the filesystem takes O_DIRECT; else false (docs/benchmarks.md, "
        "'Beyond memory')")

    def validate(self) -> None:
        """Check values that types alone cannot."""
        super().validate()
        if not self.root:
            raise ConfigError(
                "file connector: set root to a directory (e.g. root=/mnt/nvme/hicache) "
                "or an fsspec URL (s3://bucket/prefix)"
            )
        if not 0 <= self.io_uring_depth <= URING_MAX_DEPTH:
            raise ConfigError(f"io_uring_depth must be in 0..{URING_MAX_DEPTH}, got {self.io_uring_depth}")
        if self.cold_read_threads < 0:
            raise ConfigError(f"cold_read_threads must be >= 0, got {self.cold_read_threads}")
        if self.io_threads < 1 or self.write_threads < 1:
            raise ConfigError(
                f"io_threads and write_threads must be >= 1, got {self.io_threads}, {self.write_threads}"
            )
        if self.slab_bytes < ALIGN:
            raise ConfigError(f"slab_bytes must be >= {ALIGN}, got {self.slab_bytes}")


def open_file_connector(settings: dict[str, Any], namespace: Namespace) -> Connector[Any]:
    """Registry factory: slab-backed :class:`FileConnector` for paths, the fsspec connector
    (:mod:`hicache_l3.connectors.fsspec_root`) for URLs."""
    config = FileConfig.load("file", settings)
    if "://" in config.root:
        from hicache_l3.connectors.fsspec_root import FsspecConnector

        return FsspecConnector.open(settings, namespace)
    return FileConnector(config, namespace)


class FileConnector(SlabConnector, Connector[FileConfig]):
    """Pages in slab files under a local (or mounted) directory; see module docstring."""

    name = "file"
    config_class = FileConfig

    def __init__(self, config: FileConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self.checksum_writes = config.checksum != "none"
        if config.o_direct == "true":
            _probe_o_direct(private_root(config.root, f"{self.name} connector: root"))
        self.transport = self._select_transport(direct=config.o_direct == "true")
        self._init_slab_root()

    def _select_transport(self, direct: bool) -> SlotTransport:
        config = self.config
        return select_transport(
            self.metrics, direct=direct, io_threads=config.io_threads, write_threads=config.write_threads,
            cold_threads=config.cold_read_threads, ring_depth=config.io_uring_depth,
            what=f"{self.name} connector")

    def _store_opened(self, store: SlabStore) -> None:
        """``o_direct=auto``: O_DIRECT from now on where :func:`choose_o_direct` says so for
        this store's pages and the filesystem takes it."""
        if self.config.o_direct != "auto":
            return
        slot_bytes, cache = store.geometry.slot_bytes, page_cache_bytes()
        if not choose_o_direct(slot_bytes, self.capacity_bytes, cache):
            return
        try:
            _probe_o_direct(self.root)
        except ConfigError as exc:
            log.info("%s connector: o_direct=auto stays buffered: %s", self.name, exc)
            return
        old, self.transport = self.transport, self._select_transport(direct=True)
        old.close()
        log.info("%s connector: o_direct=auto chose O_DIRECT (%d KiB pages, capacity %.1f GiB, "
                 "%.1f GiB of page cache)", self.name, slot_bytes >> 10, self.capacity_bytes / 2**30,
                 cache / 2**30)


def _probe_o_direct(root: Path) -> None:
    probe = root / f".o_direct_probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"file connector: o_direct=true but the filesystem of {root} refuses O_DIRECT "
            f"({exc.strerror}); use o_direct=false or auto"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
