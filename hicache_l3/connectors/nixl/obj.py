"""NIXL obj mode: one S3 object per page, moved by NIXL's OBJ plugin.

Under ``<prefix><namespace digest>/``: ``d/<key>``, the page (or its zstd frame); with
checksums, ``h/<key>``, a commit record (length, XXH3, key fingerprint) written after the
page's PUT, required by ``exists`` and checked by ``get``. Delete, clear and eviction
(``capacity_bytes``, a per-process LRU) use boto3.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from hicache_l3.common.compression import PageCodec, leading_bytes, read_stored
from hicache_l3.common.connector import Capabilities
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint, page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page
from hicache_l3.connectors.nixl.base import Agent, NixlConfig, NixlConnector, TransferError, Unit, run_units
from hicache_l3.slab.format import MARKER, START, START_MAGIC, encode_start

CHUNK = 256  # pages per transfer round (one scratch buffer of commit records)
SCRATCH_BUFFERS = 4  # concurrent calls that can hold a scratch buffer
STAGE_PAGES = 16  # multi-segment pages gathered per staged PUT round
REG_CACHE = 1 << 16  # object keys kept registered with NIXL


def endpoint_address(config: NixlConfig) -> tuple[str, int, str]:
    """``(host, port, scheme)`` the OBJ plugin will connect to."""
    scheme: str = config.scheme
    url = endpoint_url(config, scheme or "https")
    host, port = f"s3.{config.region}.amazonaws.com", None
    if url is not None:
        parsed = urllib.parse.urlsplit(url)
        scheme = scheme or parsed.scheme
        if not parsed.hostname:
            raise ConfigError(f"nixl: endpoint {config.endpoint!r} has no host")
        host, port = parsed.hostname, parsed.port
    scheme = scheme or "https"
    return host, port or (443 if scheme == "https" else 80), scheme


def endpoint_url(config: NixlConfig, scheme: str) -> str | None:
    """The configured endpoint as a URL (``scheme://`` added when it has none), or None."""
    if not config.endpoint:
        return None
    return config.endpoint if "://" in config.endpoint else f"{scheme}://{config.endpoint}"


def obj_params(config: NixlConfig) -> dict[str, str]:
    """OBJ plugin init parameters for ``config`` (holds the credentials: never log it)."""
    _, _, scheme = endpoint_address(config)
    params = {
        "bucket": config.bucket, "region": config.region, "scheme": scheme,
        "use_virtual_addressing": "true" if config.virtual_addressing else "false",
        "num_threads": str(config.obj_threads),
    }
    url = endpoint_url(config, scheme)
    if url:
        params["endpoint_override"] = url
    for name in ("access_key", "secret_key", "session_token", "ca_bundle"):
        if getattr(config, name):
            params[name] = getattr(config, name)
    return params


def probe(host: str, port: int, timeout: float) -> None:
    """TCP-connect to ``host:port`` within ``timeout`` s, or EngineUnavailableError."""
    start = time.monotonic()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise EngineUnavailableError(
            f"nixl (obj): S3 endpoint {host}:{port} unreachable after "
            f"{time.monotonic() - start:.1f}s (connect_timeout_s={timeout:g}): "
            f"{exc.strerror or type(exc).__name__}"
        ) from None


class NixlObjConnector(NixlConnector):
    """Pages as S3 objects through NIXL's OBJ plugin."""

    def __init__(self, config: NixlConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self._checksum = config.use_checksum()
        self._codec = PageCodec(config.compression, namespace.kv_dtype)
        if self._codec.enabled and not self._checksum:
            raise ConfigError("nixl (obj): compression=zstd needs checksum (the commit record "
                              "carries a compressed page's length); drop checksum=none")
        host, port, scheme = endpoint_address(config)
        self._address = (host, port)
        probe(host, port, config.connect_timeout_s)
        self._suspect = False
        self._check_bucket(self._control_client(scheme, config.connect_timeout_s))
        self._s3 = self._control_client(scheme, max(config.connect_timeout_s, 10.0))
        self.agent = Agent("OBJ", obj_params(config))
        self.base = f"{config.prefix}{namespace.digest()}/"
        self._regs: collections.OrderedDict[str, tuple[int, int, Any]] = collections.OrderedDict()
        self._reg_lock = threading.Lock()
        self._dev_ids = itertools.count(1)
        self._scratch: queue.Queue[HostBuffer] = queue.Queue()
        if self._checksum:
            for _ in range(SCRATCH_BUFFERS):
                buf = HostBuffer(CHUNK * MARKER, name="nixl-obj-records")
                self.agent.register_dram(buf)
                self._scratch.put(buf)
        self._stages: queue.Queue[HostBuffer] = queue.Queue()
        self._stage_count = 0
        self._stage_lock = threading.Lock()
        self._lru: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lru_lock = threading.Lock()
        self.evictions = 0
        if config.capacity_bytes:
            self._seed_lru()

    @property
    def capabilities(self) -> Capabilities:
        """Persistent and shared (the bucket is); evicts when a capacity is set."""
        return Capabilities(persistent=True, shared_across_processes=True,
                            detects_corruption=self._checksum,
                            evicts=self.config.capacity_bytes > 0, compresses=True)

    def _control_client(self, scheme: str, read_timeout: float) -> Any:
        """A boto3 client (one attempt per call, bounded connect and read)."""
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise EngineUnavailableError(
                "nixl obj mode deletes and lists objects with boto3: pip install boto3"
            ) from exc
        c = self.config
        kwargs: dict[str, Any] = {}
        if c.access_key:
            kwargs.update(aws_access_key_id=c.access_key, aws_secret_access_key=c.secret_key)
            if c.session_token:
                kwargs["aws_session_token"] = c.session_token
        if c.ca_bundle:
            kwargs["verify"] = c.ca_bundle
        return boto3.client(
            "s3", endpoint_url=endpoint_url(c, scheme), region_name=c.region, use_ssl=scheme == "https",
            config=Config(
                connect_timeout=c.connect_timeout_s, read_timeout=read_timeout,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "virtual" if c.virtual_addressing else "path"},
            ),
            **kwargs,
        )

    def _check_bucket(self, client: Any) -> None:
        """One HEAD of the bucket, bounded by connect_timeout_s (connect and read)."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client.head_bucket(Bucket=self.config.bucket)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "?")
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise ConfigError(f"nixl (obj): bucket {self.config.bucket!r} does not exist at "
                                  f"the endpoint; create it first") from None
            raise EngineUnavailableError(f"nixl (obj): bucket {self.config.bucket!r} refused "
                                         f"access: {code}") from None
        except BotoCoreError as exc:
            raise EngineUnavailableError(
                f"nixl (obj): endpoint did not answer within connect_timeout_s="
                f"{self.config.connect_timeout_s:g}: {type(exc).__name__}") from None
        finally:
            client.close()

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """The listing entries of every object under ``prefix`` in the bucket."""
        pager = self._s3.get_paginator("list_objects_v2")
        for page in pager.paginate(Bucket=self.config.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def _seed_lru(self) -> None:
        """The LRU from the pages of this namespace in the bucket, oldest first."""
        prefix = self.base + ("h/" if self._checksum else "d/")
        found = sorted((obj["LastModified"], obj["Key"][len(prefix) :]) for obj in self._objects(prefix))
        self._lru.update((key, None) for _, key in found)

    def _remove(self, keys: list[str]) -> None:
        """Delete the records (first) and the page objects of ``keys``."""
        names = [self.base + "h/" + k for k in keys] if self._checksum else []
        names += [self.base + "d/" + k for k in keys]
        self._delete_objects(names)
        with self._reg_lock:
            for n in names:
                reg = self._regs.pop(n, None)
                if reg is not None:
                    self.agent.deregister(reg[2])

    def _remember(self, keys: list[str]) -> None:
        """Mark keys as recently used; evict beyond the capacity."""
        if not self.config.capacity_bytes or not self.page_bytes:
            return
        limit = max(1, self.config.capacity_bytes // self.page_bytes)
        with self._lru_lock:
            for k in keys:
                self._lru[k] = None
                self._lru.move_to_end(k)
            victims = [self._lru.popitem(last=False)[0] for _ in range(len(self._lru) - limit)]
        if victims:
            try:
                self._remove(victims)
                self.evictions += len(victims)
            except Exception as exc:
                self._log.warning("evict", "nixl (obj): eviction of %d pages failed: %s",
                                  len(victims), type(exc).__name__)

    def _devs(self, names: list[str], length: int) -> list[int]:
        """Device ids of object keys, registering the ones not cached (bounded LRU)."""
        out = []
        with self._reg_lock:
            for name in names:
                reg = self._regs.get(name)
                if reg is not None and reg[1] >= length:
                    self._regs.move_to_end(name)
                    out.append(reg[0])
                    continue
                if reg is not None:
                    self.agent.deregister(reg[2])
                dev = next(self._dev_ids)
                handle = self.agent.register([(0, length, dev, name)], "OBJ")
                self._regs[name] = (dev, length, handle)
                out.append(dev)
            while len(self._regs) > REG_CACHE:
                _, (_, _, handle) = self._regs.popitem(last=False)
                self.agent.deregister(handle)
        return out

    def _query(self, names: list[str]) -> list[bool]:
        """HEAD the objects (``query_memory``) in a thread of its own: TransferError(TIMEOUT)
        after ``timeout_s`` while an abandoned query finishes in the background."""
        descs = [(0, 0, 0, n) for n in names]
        box: dict[str, Any] = {}
        agent = self.agent

        def run() -> None:
            try:
                box["answers"] = agent.query(descs, "OBJ")
            except Exception as exc:
                box["error"] = exc

        worker = threading.Thread(target=run, name="hicache-nixl-query")
        worker.start()
        worker.join(self.config.timeout_s)
        if worker.is_alive():
            self._suspect = True
            raise TransferError(f"query_memory not done after {self.config.timeout_s:g}s",
                                Reason.TIMEOUT)
        if "error" in box:
            self._suspect = True
            raise TransferError(f"query_memory failed: {type(box['error']).__name__}")
        return [a is not None for a in box["answers"]]

    def _down(self) -> bool:
        """After a failure, True (ENGINE_DOWN) while a TCP probe of the endpoint fails."""
        if not self._suspect:
            return False
        try:
            probe(*self._address, self.config.connect_timeout_s)
        except EngineUnavailableError:
            return True
        self._suspect = False
        return False

    def _run(self, op: str, units: list[Unit]) -> list[Reason]:
        """Move ``units`` (one per object) by ``op``, READ or WRITE, one Reason per unit; a
        failed transfer makes the endpoint suspect (:meth:`_down`)."""
        inner = self._xfer(op, "OBJ")

        def go(local: list[Any], remote: list[Any]) -> None:
            try:
                inner(local, remote)
            except TransferError:
                self._suspect = True
                raise

        return run_units(go, units, self.config.max_descs, reread=op == "READ")

    @contextlib.contextmanager
    def _stage(self) -> Iterator[HostBuffer]:
        """A registered staging buffer of ``STAGE_PAGES`` pages, lent for the block (at most
        SCRATCH_BUFFERS are made)."""
        with self._stage_lock:
            make = self._stages.empty() and self._stage_count < SCRATCH_BUFFERS
            self._stage_count += make
        if make:
            try:
                buf = HostBuffer(STAGE_PAGES * (self.page_bytes or 0), name="nixl-obj-stage")
                self.agent.register_dram(buf)
            except BaseException:  # not made: a later call may make it (none waits for it)
                with self._stage_lock:
                    self._stage_count -= 1
                raise
        else:
            buf = self._stages.get()
        try:
            yield buf
        finally:
            self._stages.put(buf)

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        if self._down():
            return [Reason.ENGINE_DOWN] * len(keys)
        reasons = self._exists(keys)  # asked now, so a page another process deleted is written again
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        todo = [i for i in first.values() if reasons[i] is not Reason.OK]
        for lo in range(0, len(todo), CHUNK):
            self._set_chunk(keys, pages, todo[lo : lo + CHUNK], reasons)
        reasons = [reasons[first[key]] for key in keys]
        self._remember([k for k, r in zip(keys, reasons) if r is Reason.OK])
        return reasons

    def _set_chunk(self, keys: list[str], pages: list[Page], idx: list[int],
                   reasons: list[Reason]) -> None:
        """PUT pages ``idx`` (a raw single-segment page in place, the others staged), then,
        with checksums, the commit records of those written."""
        n = self.page_bytes
        assert n is not None
        devs = dict(zip(idx, self._devs([self.base + "d/" + keys[i] for i in idx], n)))
        frames: dict[int, bytes] = {}
        if self._codec.enabled:
            for i in idx:
                views = self.regions.views(pages[i])
                frame = None if views is None else self._codec.encode(views)
                if frame is not None:
                    frames[i] = frame
        direct = [i for i in idx if len(pages[i]) == 1 and i not in frames]
        units = [Unit([(pages[i][0][0], n, 0)], [(0, n, devs[i])]) for i in direct]
        for i, r in zip(direct, self._run("WRITE", units)):
            reasons[i] = r
        multi = [i for i in idx if len(pages[i]) > 1 and i not in frames]
        for items, counter in ((multi, "staged"), (list(frames), "compressed")):
            for lo in range(0, len(items), STAGE_PAGES):
                self._set_staged(pages, devs, items[lo : lo + STAGE_PAGES], frames, reasons, counter)
        written = [i for i in idx if reasons[i] is Reason.OK]
        if not self._checksum or not written:
            return
        scratch = self._scratch.get()
        try:
            view = scratch.view()
            for s, i in enumerate(written):
                frame = frames.get(i)
                record = (encode_start(0, n, page_checksum(pages[i]), key_fingerprint(keys[i]))
                          if frame is None else
                          encode_start(0, len(frame), buffer_checksum([frame]), key_fingerprint(keys[i])))
                view[s * MARKER : (s + 1) * MARKER] = record
            hdevs = self._devs([self.base + "h/" + keys[i] for i in written], MARKER)
            results = self._run("WRITE", [Unit([(scratch.address + s * MARKER, MARKER, 0)],
                                               [(0, MARKER, hdevs[s])]) for s in range(len(written))])
        finally:
            self._scratch.put(scratch)
        for i, r in zip(written, results):
            reasons[i] = r

    def _set_staged(self, pages: list[Page], devs: dict[int, int], items: list[int],
                    frames: dict[int, bytes], reasons: list[Reason], counter: str) -> None:
        """PUT pages ``items`` from a staging buffer: each one's frame, or its segments gathered."""
        n = self.page_bytes
        assert n is not None
        with self._stage() as stage:
            view = stage.view()
            units = []
            for s, i in enumerate(items):
                frame = frames.get(i)
                views = self.regions.views(pages[i]) if frame is None else [memoryview(frame)]
                assert views is not None  # the base class checked the page
                pos = s * n
                for v in views:
                    view[pos : pos + len(v)] = v
                    pos += len(v)
                size = pos - s * n
                units.append(Unit([(stage.address + s * n, size, 0)], [(0, size, devs[i])]))
            results = self._run("WRITE", units)
        self.metrics.count(counter, len(items))
        for i, r in zip(items, results):
            reasons[i] = r

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        if self._down():
            return [Reason.ENGINE_DOWN] * len(keys)
        reasons = [Reason.MISS] * len(keys)
        direct = list(range(len(keys)))
        if self._codec.enabled:  # frames likely: a multi-segment page through a staging buffer
            self._get_staged(keys, pages, [i for i in direct if len(pages[i]) > 1], reasons)
            direct = [i for i in direct if len(pages[i]) == 1]
        for lo in range(0, len(direct), CHUNK):
            self._get_chunk(keys, pages, direct[lo : lo + CHUNK], reasons)
        self._remember([k for k, r in zip(keys, reasons) if r is Reason.OK])
        return reasons

    def _get_chunk(self, keys: list[str], pages: list[Page], idx: list[int],
                   reasons: list[Reason]) -> None:
        n = self.page_bytes
        assert n is not None
        devs = self._devs([self.base + "d/" + keys[i] for i in idx], n)
        scratch = self._scratch.get() if self._checksum else None
        try:
            hdevs: list[int] = []
            if scratch is not None:
                hdevs = self._devs([self.base + "h/" + keys[i] for i in idx], MARKER)
                scratch.view()[: len(idx) * MARKER] = bytes(len(idx) * MARKER)
            units = []
            for j, i in enumerate(idx):
                local, remote = [], []
                offset = 0
                for address, length in pages[i]:
                    local.append((address, length, 0))
                    remote.append((offset, length, devs[j]))
                    offset += length
                if scratch is not None:
                    local.append((scratch.address + j * MARKER, MARKER, 0))
                    remote.append((0, MARKER, hdevs[j]))
                else:  # the last byte on its own: a short or empty object fails this GET
                    address, length, _ = local[-1]
                    if length > 1:
                        local[-1] = (address, length - 1, 0)
                        remote[-1] = (n - length, length - 1, devs[j])
                        local.append((address + length - 1, 1, 0))
                        remote.append((n - 1, 1, devs[j]))
                units.append(Unit(local, remote))
            results = self._run("READ", units)
            failed = self._settle(keys, idx, results, reasons, lambda j, i: (
                Reason.OK if scratch is None else self._check_record(scratch, j, keys[i], pages[i])))
        finally:
            if scratch is not None:
                self._scratch.put(scratch)
        if scratch is not None and failed:  # a frame's GET past its end fails: read it staged
            again = [idx[j] for j in failed if reasons[idx[j]] not in (Reason.MISS, Reason.TIMEOUT)]
            self._get_staged(keys, pages, again, reasons)

    def _get_staged(self, keys: list[str], pages: list[Page], items: list[int],
                    reasons: list[Reason]) -> None:
        """Read pages ``items`` (record and object) into a staging buffer, then check each into its page."""
        for lo in range(0, len(items), STAGE_PAGES):
            self._get_staged_part(keys, pages, items[lo : lo + STAGE_PAGES], reasons)

    def _get_staged_part(self, keys: list[str], pages: list[Page], part: list[int],
                         reasons: list[Reason]) -> None:
        n = self.page_bytes
        assert n is not None
        with self._stage() as stage:
            scratch = self._scratch.get()
            try:
                devs = self._devs([self.base + "d/" + keys[i] for i in part], n)
                hdevs = self._devs([self.base + "h/" + keys[i] for i in part], MARKER)
                records = scratch.view()
                records[: len(part) * MARKER] = bytes(len(part) * MARKER)
                results = self._run("READ", [
                    Unit([(stage.address + s * n, n, 0), (scratch.address + s * MARKER, MARKER, 0)],
                         [(0, n, devs[s]), (0, MARKER, hdevs[s])]) for s in range(len(part))])
                got = stage.view()
                self._settle(keys, part, results, reasons, lambda s, i: self._stored_into(
                    bytes(records[s * MARKER : (s + 1) * MARKER]), got[s * n : (s + 1) * n], keys[i],
                    pages[i]))
            finally:
                self._scratch.put(scratch)

    def _stored_into(self, record: bytes, got: memoryview, key: str, page: Page) -> Reason:
        """Check ``got`` (the object is its first ``length`` bytes) against its commit record,
        then copy or decode it into ``page``."""
        magic, _, _, _, length, checksum, fp = START.unpack_from(record)
        if magic != START_MAGIC:
            return Reason.MISS  # no commit record: the page was never fully stored
        if length > len(got):
            return Reason.SIZE_MISMATCH
        stored = got[:length]
        if fp != key_fingerprint(key) or buffer_checksum([stored]) != checksum:
            return Reason.CORRUPT
        views = self.regions.views(page)
        return Reason.UNREGISTERED if views is None else read_stored(stored, views)

    def _settle(self, keys: list[str], idx: list[int], results: list[Reason], reasons: list[Reason],
                ok: Callable[[int, int], Reason]) -> list[int]:
        """Results of transfer ``j`` (page ``idx[j]``) into ``reasons``: ``ok(j, i)`` for a done
        transfer, TIMEOUT as is, the others classified; returns the classified ``j``."""
        failed = [j for j, r in enumerate(results) if r is not Reason.OK and r is not Reason.TIMEOUT]
        if failed:
            self._classify_failures(keys, [idx[j] for j in failed], [results[j] for j in failed], reasons)
        for j, i in enumerate(idx):
            if results[j] is Reason.TIMEOUT:
                reasons[i] = Reason.TIMEOUT
            elif results[j] is Reason.OK:
                reasons[i] = ok(j, i)
        return failed

    def _classify_failures(self, keys: list[str], failed: list[int], results: list[Reason],
                           reasons: list[Reason]) -> None:
        """A failed GET of a page whose record or object is absent is a miss; else the error."""
        names = [self.base + "d/" + keys[i] for i in failed]
        if self._checksum:
            names += [self.base + "h/" + keys[i] for i in failed]
        try:
            present = self._query(names)
        except TransferError:
            present = [True] * len(names)
        k = len(failed)
        for m, i in enumerate(failed):
            there = present[m] and (not self._checksum or present[k + m])
            reasons[i] = results[m] if there else Reason.MISS

    def _check_record(self, scratch: HostBuffer, j: int, key: str, page: Page) -> Reason:
        record = bytes(scratch.view()[j * MARKER : (j + 1) * MARKER])
        magic, _, _, _, length, checksum, fp = START.unpack_from(record)
        if magic != START_MAGIC:
            return Reason.MISS  # no commit record: the page was never fully stored
        if length < (self.page_bytes or 0):  # a frame: its bytes are the page's first ones
            views = self.regions.views(page)
            if views is None:
                return Reason.UNREGISTERED
            return self._stored_into(record, memoryview(leading_bytes(views, length)), key, page)
        if length != self.page_bytes:
            return Reason.SIZE_MISMATCH
        if fp != key_fingerprint(key) or page_checksum(page) != checksum:
            return Reason.CORRUPT
        return Reason.OK

    def _exists(self, keys: list[str]) -> list[Reason]:
        if self._down():
            return [Reason.ENGINE_DOWN] * len(keys)
        marker = "h/" if self._checksum else "d/"
        out: list[Reason] = []
        for lo in range(0, len(keys), CHUNK * 4):
            hits = self._query([self.base + marker + k for k in keys[lo : lo + CHUNK * 4]])
            out.extend(Reason.OK if h else Reason.MISS for h in hits)
        return out

    def _delete(self, keys: list[str]) -> list[Reason]:
        found = self._exists(keys)
        gone = sorted({k for k, r in zip(keys, found) if r is Reason.OK})
        if gone:
            self._remove(gone)
            with self._lru_lock:
                for k in gone:
                    self._lru.pop(k, None)
        return found

    def _clear(self) -> None:
        self._delete_objects([obj["Key"] for obj in self._objects(self.base)])
        with self._lru_lock:
            self._lru.clear()

    def _delete_objects(self, names: list[str]) -> None:
        for lo in range(0, len(names), 1000):
            batch = [{"Key": n} for n in names[lo : lo + 1000]]
            self._s3.delete_objects(Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True})

    def _close(self) -> None:
        with self._reg_lock:
            handles = [h for _, _, h in self._regs.values()]
            self._regs.clear()
        for handle in handles:
            try:
                self.agent.deregister(handle)
            except Exception as exc:
                self._log.warning("close", "nixl (obj): deregister failed: %s", type(exc).__name__)
        self.agent.close(background=self._suspect)  # S3 requests may still be retrying
        self._s3.close()

    def _engine_stats(self) -> dict[str, Any]:
        host, port, scheme = endpoint_address(self.config)
        return {
            "mode": "obj", "endpoint": f"{scheme}://{host}:{port}", "bucket": self.config.bucket,
            "prefix": self.base, "checksum": self._checksum, "registered_objects": len(self._regs),
            "lru_pages": len(self._lru), "capacity_bytes": self.config.capacity_bytes,
            "evictions": self.evictions,
        }
