"""NIXL file mode: the shared slab store, with page bytes moved by NIXL's POSIX plugin.

The on-disk layout is the slab store's (:mod:`hicache_l3.slab`), the one the
file connector uses, so both connectors read each other's pages. What differs is how
bytes move:

* page data: one NIXL transfer per batch between DRAM registered once (the host
  regions) and slab files registered once per agent as ``FILE`` (a slab's descriptor is
  registered the first time a page touches it and kept until close: no per-batch
  registration);
* slot markers (64-byte start header and end marker): ``os.pwrite``/``os.pread``.
  They are tiny, and the slot protocol needs an order that one NIXL transfer does not
  give (its descriptors complete in any order): a set writes the end marker, then the
  data (NIXL), then the start header; a get reads the data (NIXL), then header and end
  marker, and accepts the page only if both carry the generation and key fingerprint
  the index gave. A reader overlapping a reuse of the slot sees a new end marker and
  misses; a torn or recycled slot is a miss, never somebody else's bytes.

Checksums: ``checksum=auto`` means none here. Measured on this machine, XXH3 over a
batch runs at ~10 GB/s on one core and does not overlap with the transfer, which
would cost 35-45% of get throughput against raw NIXL; the slot markers already catch
torn, stale and recycled slots. ``checksum=xxh3`` adds detection of bytes altered at
rest (and pages written with a checksum, e.g. by the file connector, are always
verified).
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import Any

from hicache_l3.common.connector import Capabilities
from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import key_fingerprint, page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.connectors.nixl.base import Agent, NixlConfig, NixlConnector, Unit, run_units
from hicache_l3.slab.engine import SlabConnector
from hicache_l3.slab.format import MARKER, encode_end, encode_start
from hicache_l3.slab.io import CHECKSUM, HEADER, OK, ReadBatch, SlotTransport, WriteBatch, verify
from hicache_l3.slab.store import SlabStore

ENGINE_PARAMS = {"aio": "use_aio", "uring": "use_uring", "posix_aio": "use_posix_aio"}


def posix_params(engine: str) -> dict[str, str]:
    """POSIX plugin init parameters selecting one kernel I/O engine."""
    return {flag: "true" if name == engine else "false" for name, flag in ENGINE_PARAMS.items()}


class NixlTransport(SlotTransport):
    """Slot bytes moved by NIXL's POSIX plugin, markers by ``pwrite``/``pread`` (module
    docstring). ``transfer(op)`` gives the connector's transfer function for ``op`` (it
    runs on the live agent and registers the slab files it touches).

    A write transfer that timed out or was interrupted may still write its slots later:
    they are *held* (:attr:`~hicache_l3.slab.io.WriteBatch.held`), never reused or
    published by this process (a restart's adoption frees them; no record names them)."""

    name = "NIXL POSIX transfers"

    def __init__(self, transfer: Callable[[str], Callable[[list[Any], list[Any]], None]],
                 max_descs: int, checksum_threads: int) -> None:
        self._transfer, self.max_descs = transfer, max_descs
        self._pool = BatchPool(checksum_threads, "hicache-nixl-csum", min_share=4)

    def _checksums(self, pages: list[Page]) -> list[int]:
        """XXH3 of each page, over ``checksum_threads`` threads (the hash releases the GIL)."""
        shares = self._pool.map(lambda lo, hi: [page_checksum(p) for p in pages[lo:hi]], len(pages))
        return [c for share in shares for c in share]

    @staticmethod
    def _unit(page: Page, fd: int, offset: int) -> Unit:
        local, remote = [], []
        for address, length in page:
            local.append((address, length, 0))
            remote.append((offset, length, fd))
            offset += length
        return Unit(local, remote)

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """End markers (``pwrite``), the data of every page (one NIXL transfer), then
        each start header (``pwrite``)."""
        geometry, slots, status = batch.geometry, batch.slots, batch.status
        nbytes = geometry.slot_bytes
        sums = self._checksums(batch.pages) if batch.checksum else [0] * len(slots)
        units, staged = [], []
        for j, (fd, _, slot, gen) in enumerate(slots):
            try:
                os.pwrite(fd, encode_end(gen, key_fingerprint(batch.keys[j])), geometry.end_offset(slot))
            except OSError as exc:
                status[j] = -(exc.errno or errno.EIO)
                continue
            units.append(self._unit(batch.pages[j], fd, geometry.data_offset(slot)))
            staged.append(j)
        batch.held.update(staged)  # until the transfer is known to have ended
        results = run_units(self._transfer("WRITE"), units, self.max_descs)
        for j, result in zip(staged, results):
            fd, _, slot, gen = slots[j]
            if result is not Reason.TIMEOUT:
                batch.held.discard(j)
            if result is not Reason.OK:
                batch.fail(j, result)
                continue
            head = encode_start(gen, nbytes, sums[j], key_fingerprint(batch.keys[j]))
            try:
                ok = os.pwrite(fd, head, geometry.header_offset(slot)) == MARKER
            except OSError as exc:
                status[j] = -(exc.errno or errno.EIO)
                continue
            if ok:
                batch.checksums[j] = sums[j]
                status[j] = OK
            else:
                batch.fail(j, Reason.ENGINE_ERROR)

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """The data of every page (one NIXL transfer), then each header and end marker
        (a rewrite that began meanwhile shows in the end marker), then checksums."""
        geometry, located, status = batch.geometry, batch.located, batch.status
        work = list(range(len(located)))
        units = [self._unit(batch.pages[j], fd, geometry.data_offset(entry.slot))
                 for j, (fd, entry) in enumerate(located)]
        results = run_units(self._transfer("READ"), units, self.max_descs, reread=True)
        start, end = memoryview(bytearray(MARKER)), memoryview(bytearray(MARKER))
        moved = [j for j, r in zip(work, results) if r is Reason.OK]
        check = [j for j in moved if located[j].entry.checksum]
        sums = dict(zip(check, self._checksums([batch.pages[j] for j in check])))
        for j, result in zip(work, results):
            if result is not Reason.OK:
                batch.fail(j, result)
                continue
            fd, entry = located[j]
            try:
                ok = os.preadv(fd, [start], geometry.header_offset(entry.slot)) == MARKER
                ok = ok and os.preadv(fd, [end], geometry.end_offset(entry.slot)) == MARKER
            except OSError as exc:
                status[j] = -(exc.errno or errno.EIO)
                continue
            code = verify(start, end, entry, batch.keys[j], None) if ok else HEADER
            if code == OK and entry.checksum and sums[j] != entry.checksum:
                code = CHECKSUM
            status[j] = code

    def close(self) -> None:
        """Stop the checksum threads (the agent deregisters the slab files it registered)."""
        self._pool.shutdown()


class NixlFileConnector(SlabConnector, NixlConnector):
    """Pages in slab files under ``root``, moved by NIXL's POSIX plugin (module docstring)."""

    def __init__(self, config: NixlConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self.checksum_writes = config.use_checksum()
        self._agent_params = posix_params(config.posix_engine)
        self._renew_lock = threading.Lock()
        self.agent = Agent("POSIX", self._agent_params, abandon_on_timeout=True)
        self.transport = NixlTransport(lambda op: self._xfer(op, "FILE"), config.max_descs,
                                       config.checksum_threads)
        self._init_slab_root(config.root, config.capacity_bytes)

    @property
    def capabilities(self) -> Capabilities:
        """Persistent, shared across processes, evicting; corruption detected with checksums."""
        return Capabilities(persistent=True, shared_across_processes=True,
                            detects_corruption=self.checksum_writes, evicts=True)

    def _make_store(self, slot_bytes: int) -> SlabStore:
        return SlabStore(
            self.root, self.namespace, slot_bytes, capacity_bytes=self.capacity_bytes,
            slab_bytes=self.config.slab_bytes, fsync=self.config.fsync,
        )

    def _close(self) -> None:
        self.agent.close()  # deregisters the slab files before the store closes them
        super()._close()

    def _engine_stats(self) -> dict[str, Any]:
        return {"mode": "file", "posix_engine": self.config.posix_engine,
                "checksum": self.checksum_writes, "registered_files": self.agent.registered_files,
                "agent_renewals": self.agent_renewals, **self._slab_stats()}
