"""The Mooncake Store connector: one object per page in a Mooncake distributed store,
moved zero-copy from and into registered host memory. Per-key results come from
Mooncake's codes (:data:`CODE_REASONS`). Settings, lowest first: SGLang's ``MOONCAKE_*``
variables, the JSON file at ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``,
``HICACHE_L3_MOONCAKE_<FIELD>``, then the settings passed in.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Literal

from hicache_l3.common.compression import COMPRESSION_HELP, PageCodec, leading_bytes, read_stored
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint, page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer, MemoryRegion
from hicache_l3.common.pages import Page, page_nbytes

log = logging.getLogger("hicache_l3.mooncake")


def load_mooncake_store() -> tuple[Any, Any]:
    """``(MooncakeDistributedStore, ReplicateConfig)``; EngineUnavailableError with the
    install hint when ``mooncake.store`` is not importable."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise EngineUnavailableError(
            f"mooncake connector: mooncake.store is not importable ({exc}); pip install "
            "'hicache-l3[mooncake]' (CPU build) or 'hicache-l3[mooncake-cuda]'; Mooncake also "
            "needs the system libraries libibverbs1, librdmacm1 and libnuma1"
        ) from exc
    return MooncakeDistributedStore, ReplicateConfig


# Mooncake ErrorCode values (mooncake-store types.h) -> what a key's failure means here.
NO_AVAILABLE_HANDLE = -200  # no segment, or no space left in any
INVALID_PARAMS = -600  # bad buffer, size mismatch of a multi-buffer get, ...
REPLICA_IS_NOT_READY = -703  # another client is still writing the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707  # the read outlived its lease: data discarded
TRANSFER_FAIL = -800  # e.g. the segment's owner is gone
RPC_FAIL = -900  # master unreachable
RPC_TIMEOUT = -901
UNAVAILABLE_IN_CURRENT_STATUS = -1010

CODE_REASONS: dict[int, Reason] = {
    NO_AVAILABLE_HANDLE: Reason.NO_SPACE,
    REPLICA_IS_NOT_READY: Reason.MISS,
    OBJECT_NOT_FOUND: Reason.MISS,
    LEASE_EXPIRED: Reason.TIMEOUT,
    TRANSFER_FAIL: Reason.ENGINE_ERROR,
    RPC_FAIL: Reason.ENGINE_DOWN,
    RPC_TIMEOUT: Reason.TIMEOUT,
    UNAVAILABLE_IN_CURRENT_STATUS: Reason.ENGINE_DOWN,
}
_MASTER_DOWN = (RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_STATUS)

TRAILER = struct.Struct("<8sQQ8s")  # magic, page length, xxh3-64 of the page, key fingerprint
TRAILER_MAGIC = b"HCL3MC01"

# SGLang's MooncakeStoreConfig names -> ours. Env vars are read only when set.
SGLANG_ENV = {
    "MOONCAKE_MASTER": "master_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_names",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_TENANT_ID": "tenant_id",
}
SGLANG_JSON = {
    "master_server_address": "master_address",
    "metadata_server": "metadata_server",
    "global_segment_size": "global_segment_size",
    "protocol": "protocol",
    "device_name": "device_names",
    "local_hostname": "local_hostname",
    "tenant_id": "tenant_id",
}
# SGLang settings that have no meaning here; accepted and ignored (with a log line).
SGLANG_IGNORED = {"master_metrics_port", "check_server", "enable_ssd_offload", "ssd_offload_path"}
SGLANG_UNSUPPORTED = {
    "client_server_address": "the standalone 'real client' mode is not supported; "
    "set master_server_address instead",
    "standalone_storage": "standalone storage mode is not supported",
}


@dataclasses.dataclass
class MooncakeConfig(ConnectorConfig):
    """Settings of the Mooncake connector (SGLang's ``MOONCAKE_*`` variables and JSON file
    are read too)."""

    master_address: str = setting("", "host:port of mooncake_master's RPC service (required)")
    metadata_server: str = setting(
        "", "transfer-engine metadata: '' = the master's embedded HTTP server at "
        "http://<master host>:8080/metadata; an http:// URL; 'P2PHANDSHAKE'; or etcd://host:port",
    )
    protocol: str = setting("tcp", "transfer protocol: tcp or rdma (or another the build supports)")
    device_names: str = setting("", "RDMA device names, comma-separated (e.g. mlx5_0,mlx5_1); '' = auto")
    local_hostname: str = setting(
        "127.0.0.1", "address this client advertises to the others (loopback by default)")
    global_segment_size: int = setting(
        4 << 30, "memory this process contributes to the store; 0 = none (pages then live "
        "only in other processes' segments and survive this connector)", size=True,
    )
    local_buffer_size: int = setting(16 << 20, "the client's local transfer buffer", size=True)
    replica_num: int = setting(1, "replicas per page (in different segments)")
    preferred_segment: str = setting(
        "", "segment to place pages in first: host:port, 'local' (this process's own segment, "
        "needs global_segment_size > 0) or '' (the master picks)")
    tenant_id: str = setting("default", "Mooncake tenant the pages belong to")
    checksum: Literal["none", "xxh3"] = setting(
        "none", "xxh3: store a checksum trailer with every page and verify it on get")
    compression: Literal["none", "zstd"] = setting("none", COMPRESSION_HELP)
    capacity_bytes: int = setting(
        0, "0 = no limit of this connector's own (the segments bound the store, and the master "
        "evicts in the background); > 0 = this connector deletes its own least recently used "
        "pages to keep the pages it stored within this many bytes (others' pages not counted)",
        size=True,
    )
    max_batch: int = setting(
        1024, "most pages per Mooncake call; larger batches are split (the TCP transport "
        "rejects ~4096 transfers queued at once)")
    connect_timeout: float = setting(
        2.0, "seconds to wait for the master's TCP port at open, and when probing a master "
        "that stopped answering")

    def validate(self) -> None:
        """Check values that types alone cannot."""
        super().validate()
        if not self.master_address:
            raise ConfigError(
                "mooncake connector: set master_address (host:port of mooncake_master's RPC "
                "port, e.g. 127.0.0.1:50051), or MOONCAKE_MASTER as SGLang does")
        if not self.protocol:
            raise ConfigError("mooncake connector: protocol must not be empty (tcp or rdma)")
        if self.replica_num < 1:
            raise ConfigError(f"mooncake connector: replica_num must be >= 1, got {self.replica_num}")
        if self.max_batch < 1:
            raise ConfigError(f"mooncake connector: max_batch must be >= 1, got {self.max_batch}")
        if self.connect_timeout <= 0:
            raise ConfigError(f"mooncake connector: connect_timeout must be > 0, got {self.connect_timeout}")
        if self.preferred_segment == "local" and not self.global_segment_size:
            raise ConfigError("mooncake connector: preferred_segment='local' needs a segment of "
                              "this process: set global_segment_size > 0")
        if self.global_segment_size and self.global_segment_size < 16 << 20:
            raise ConfigError(
                f"mooncake connector: global_segment_size={self.global_segment_size} is below "
                "Mooncake's minimum of 16 MiB; use 0 (no segment) or >= 16MiB")

    @classmethod
    def load(
        cls,
        connector: str,
        settings: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> MooncakeConfig:
        """SGLang env, SGLang JSON file, our env, then ``settings`` (last wins)."""
        env = os.environ if environ is None else environ
        merged: dict[str, Any] = sglang_settings(env)
        merged.update(cls.env_values(connector, env))
        merged.update(settings or {})
        return cls.from_dict(merged, source=f"{connector} config")

    def metadata_url(self) -> str:
        """The metadata server to use (the master's embedded HTTP server by default)."""
        if self.metadata_server:
            return self.metadata_server
        host = self.master_address.rsplit(":", 1)[0]
        return f"http://{host}:8080/metadata"


def _sglang_size(value: Any) -> Any:
    """SGLang reads ``"4gb"`` as 4 GiB and plain digits as bytes; keep that meaning."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text.endswith("gb") and text[:-2].strip().isdigit():
            return int(text[:-2]) << 30
    return value


def sglang_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from SGLang's in-tree Mooncake configuration: ``MOONCAKE_*`` variables,
    overridden by the JSON file named by ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH``."""
    out: dict[str, Any] = {}
    for var, name in SGLANG_ENV.items():
        if environ.get(var):
            out[name] = environ[var]
    if not out.get("local_hostname") and environ.get("LOCAL_HOSTNAME"):
        out["local_hostname"] = environ["LOCAL_HOSTNAME"]
    path = environ.get("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
    if path:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH={path}: cannot read it: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH={path}: expected a JSON object")
        for key, value in data.items():
            if key in SGLANG_JSON:
                out[SGLANG_JSON[key]] = value
            elif key in SGLANG_UNSUPPORTED and value:
                raise ConfigError(f"{path}: {key}: {SGLANG_UNSUPPORTED[key]}")
            elif key not in SGLANG_IGNORED and key not in SGLANG_UNSUPPORTED:
                raise ConfigError(
                    f"{path}: unknown Mooncake setting {key!r}; known: "
                    f"{sorted([*SGLANG_JSON, *SGLANG_IGNORED, *SGLANG_UNSUPPORTED])}")
    if "global_segment_size" in out:
        out["global_segment_size"] = _sglang_size(out["global_segment_size"])
    if isinstance(out.get("device_names"), str) and out["device_names"].startswith("{"):
        raise ConfigError("MOONCAKE_DEVICE: the per-rank JSON form is not supported; "
                          "give the device names of this rank")
    return out


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def _listening() -> set[tuple[str, int]]:
    """(host, port) of this process's listening TCP sockets, from /proc (empty without it)."""
    inodes = set()
    try:
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    out = set()
    for table, family in (("/proc/self/net/tcp", socket.AF_INET), ("/proc/self/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as rows:
                lines = rows.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = fields[1].split(":")
            raw = bytes.fromhex(addr)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.add((socket.inet_ntop(family, raw), int(port, 16)))
    return out


def _exposed(listeners: set[tuple[str, int]]) -> list[str]:
    """The ``host:port`` of listeners not bound to a loopback address, sorted."""
    return sorted(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in listeners
                  if not (_is_loopback(h) or h == "::ffff:127.0.0.1"))


def _probe(address: str, timeout: float) -> str | None:
    """None when a TCP connection to ``host:port`` succeeds, else why it failed."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return None  # not a plain host:port (e.g. an HA etcd:// address): nothing to probe
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return str(exc) or type(exc).__name__


class _Trailers:
    """Per-thread registered scratch memory of ``count`` slots (trailers, or bytes with ``slot=1``)."""

    def __init__(self, store: Any, slot: int = TRAILER.size) -> None:
        self._store = store
        self._slot = slot
        self._local = threading.local()
        self._lock = threading.Lock()
        self._buffers: list[HostBuffer] = []

    def get(self, count: int) -> HostBuffer:
        """A registered buffer of at least ``count`` slots, private to this thread."""
        buf: HostBuffer | None = getattr(self._local, "buf", None)
        if buf is None or buf.size < count * self._slot:
            new = HostBuffer(max(count, 256) * self._slot, pin=False)
            rc = self._store.register_buffer(new.address, new.size)
            if rc != 0:
                raise RuntimeError(f"register_buffer of checksum scratch failed: {rc}")
            with self._lock:
                if buf is not None:
                    self._store.unregister_buffer(buf.address)
                    self._buffers.remove(buf)
                self._buffers.append(new)
            self._local.buf = buf = new
        return buf

    def release(self) -> None:
        """Unregister every scratch buffer (at close)."""
        with self._lock:
            for buf in self._buffers:
                self._store.unregister_buffer(buf.address)
            self._buffers.clear()


class MooncakeConnector(Connector[MooncakeConfig]):
    """Pages as objects in Mooncake Store."""

    name = "mooncake"
    config_class = MooncakeConfig

    def __init__(self, config: MooncakeConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self._prefix = self._key_prefix = f"{namespace.digest()}:"
        self._down_since: float | None = None
        self._down_lock = threading.Lock()
        self._store: Any = None
        store_class, replicate_class = load_mooncake_store()
        if _is_loopback(config.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        why = _probe(config.master_address, config.connect_timeout)
        if why is not None:
            raise EngineUnavailableError(
                f"mooncake connector: cannot reach mooncake_master at master_address="
                f"{config.master_address} within {config.connect_timeout:g}s: {why}")
        store = store_class()
        before = _listening()
        setup = {
            "local_hostname": config.local_hostname,
            "metadata_server": config.metadata_url(),
            "global_segment_size": config.global_segment_size,
            "local_buffer_size": config.local_buffer_size,
            "protocol": config.protocol,
            "rdma_devices": config.device_names,
            "master_server_addr": config.master_address,
            "tenant_id": config.tenant_id,
        }
        rc = store.setup(setup)
        if rc != 0:
            raise EngineUnavailableError(
                f"mooncake connector: setup failed with code {rc} (master_address="
                f"{config.master_address}, metadata_server={config.metadata_url()}, "
                f"protocol={config.protocol}, local_hostname={config.local_hostname}); "
                "see the Mooncake log lines above for the cause")
        self._store = store
        if _is_loopback(config.local_hostname):
            self._warn_exposed(_exposed(_listening() - before), config.local_hostname)
        self._replicate = replicate_class()
        self._replicate.replica_num = config.replica_num
        if config.preferred_segment == "local":
            self._replicate.preferred_segment = store.get_hostname()
        elif config.preferred_segment:
            self._replicate.preferred_segment = config.preferred_segment
        self._checksum = config.checksum == "xxh3"
        self._trailers = _Trailers(store) if self._checksum else None
        self._codec = PageCodec(config.compression, namespace.kv_dtype)
        self._frames = _Trailers(store, slot=1)  # frames to put, objects to read again
        self._lru: OrderedDict[str, None] | None = OrderedDict() if config.capacity_bytes else None
        self._lru_lock = threading.Lock()

    @staticmethod
    def _warn_exposed(exposed: list[str], advertised: str) -> None:
        """Warn when listeners that appeared during setup are beyond loopback."""
        if exposed:
            log.warning(
                "mooncake connector: its transfer engine listens beyond loopback on %s while "
                "it advertises local_hostname=%s: whoever reaches these ports can read and write "
                "the registered KV memory. On one machine, preload the loopback shim (the "
                "command `hicache-l3 sglang-args --backend mooncake` prints does); across "
                "machines, firewall these ports (README \"Security\")",
                ", ".join(exposed), advertised)

    @property
    def capabilities(self) -> Capabilities:
        """Shared; persistent only without a segment of this process; corruption detected
        with checksums; evicts only with ``capacity_bytes`` (its own LRU pages)."""
        return Capabilities(
            persistent=self.config.global_segment_size == 0,
            shared_across_processes=True,
            detects_corruption=self._checksum,
            evicts=self.config.capacity_bytes > 0,
            compresses=True,
        )

    # ---- memory -------------------------------------------------------------------
    def _register(self, region: MemoryRegion) -> None:
        rc = self._store.register_buffer(region.address, region.size)
        if rc != 0:
            raise RuntimeError(f"register_buffer returned {rc}")

    def _unregister(self, region: MemoryRegion) -> None:
        if self._store is not None:
            rc = self._store.unregister_buffer(region.address)
            if rc != 0:
                log.warning("mooncake: unregister_buffer(%#x) returned %s", region.address, rc)

    # ---- master liveness ------------------------------------------------------------
    def _master_unreachable(self) -> bool:
        """True (fail fast) while a master seen down still refuses TCP connections."""
        if self._down_since is None:
            return False
        if _probe(self.config.master_address, min(self.config.connect_timeout, 1.0)) is None:
            return False
        self.metrics.count("master_down_fast_fail")
        return True

    def _note_codes(self, codes: list[int]) -> None:
        """Count raw failure codes; track whether the master answers."""
        if not codes or (min(codes) >= 0 and self._down_since is None):
            return
        down = False
        for code in codes:
            if code < 0:
                self.metrics.count(f"mooncake_{code}")
                down = down or code in _MASTER_DOWN
        if down:
            with self._down_lock:
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    self._log.warning("master-down", "mooncake: master %s is not answering",
                                      self.config.master_address)
        elif self._down_since is not None:
            with self._down_lock:
                self._down_since = None
            log.info("mooncake: master %s answers again", self.config.master_address)

    # ---- hooks --------------------------------------------------------------------
    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        if self._master_unreachable():
            return [Reason.ENGINE_DOWN] * len(keys)
        skeys = [self._prefix + k for k in keys]
        if len(set(skeys)) == len(skeys):
            done = self._put_unique(skeys, pages)
        else:  # duplicates: put each key once, give all copies its result
            first: dict[str, int] = {}
            for i, k in enumerate(skeys):
                first.setdefault(k, i)
            result = dict(zip(first, self._put_unique(list(first), [pages[i] for i in first.values()])))
            done = [result[k] for k in skeys]
        if self._lru is not None:
            self._lru_stored(keys, done)
        return done

    def _put_unique(self, skeys: list[str], pages: list[Page]) -> list[Reason]:
        """Put pages under distinct storage keys; OK once each object is complete."""
        codes = self._chunked(self._put, skeys, pages)
        done = [Reason.OK if c in (0, OBJECT_ALREADY_EXISTS) else _reason(c) for c in codes]
        self._confirm_stored(skeys, done)
        return done

    def _confirm_stored(self, skeys: list[str], done: list[Reason]) -> None:
        """A put succeeds only once the object is complete: Mooncake answers 0 also for an
        object another client is still putting or died putting. One ``batch_is_exist``
        tells them apart; such keys get ``engine_error`` (``mooncake_put_pending_elsewhere``)."""
        put = [i for i, r in enumerate(done) if r is Reason.OK]
        if not put:
            return
        present = self._chunked(self._store.batch_is_exist, [skeys[i] for i in put])
        if present.count(1) == len(put):
            return
        for i, c in zip(put, present):
            if c != 1:
                done[i] = Reason.ENGINE_ERROR
                self.metrics.count("mooncake_put_pending_elsewhere")

    def _put(self, skeys: list[str], pages: list[Page]) -> list[int]:
        if self._codec.enabled:
            frames = self._encode(pages)
            if any(f is not None for f in frames):
                return self._put_framed(skeys, pages, frames)
        if not self._checksum and max(map(len, pages)) == 1:
            codes = self._store.batch_put_from(
                skeys, [p[0][0] for p in pages], [self.page_bytes or 0] * len(pages), self._replicate)
        else:
            codes = self._store.batch_put_from_multi_buffers(skeys, *self._sources(skeys, pages),
                                                             self._replicate)
        return list(codes)

    def _sources(self, skeys: list[str], pages: list[Page]) -> tuple[list[list[int]], list[list[int]]]:
        """Each page's segments for a multi-buffer put, then (with checksums) its trailer,
        written to registered scratch."""
        if not self._checksum or not pages:
            return _buffers(pages)
        assert self._trailers is not None
        scratch = self._trailers.get(len(pages))
        view = scratch.view()
        for j, (skey, page) in enumerate(zip(skeys, pages)):
            view[j * TRAILER.size:(j + 1) * TRAILER.size] = _trailer(
                skey, page_nbytes(page), page_checksum(page))
        return _buffers(pages, scratch.address)

    def _encode(self, pages: list[Page]) -> list[bytes | None]:
        """Each page's frame, or None where it is stored raw (a frame leaves room for the trailer)."""
        room = (self.page_bytes or 0) - TRAILER.size
        out: list[bytes | None] = []
        for page in pages:
            views = self.regions.views(page)
            frame = None if views is None else self._codec.encode(views)
            out.append(frame if frame is not None and len(frame) <= room else None)
        return out

    def _put_framed(self, skeys: list[str], pages: list[Page], frames: list[bytes | None]) -> list[int]:
        """Put frames from registered scratch (with their trailers), raw pages from the page."""
        extra = TRAILER.size if self._checksum else 0
        stage = self._frames.get(sum(len(f) + extra for f in frames if f is not None))
        view = stage.view()
        raw = [j for j, f in enumerate(frames) if f is None]
        sources = zip(*self._sources([skeys[j] for j in raw], [pages[j] for j in raw]))
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        off = 0
        for skey, frame in zip(skeys, frames):
            if frame is None:
                ptr, size = next(sources)
            else:
                n = len(frame)
                view[off:off + n] = frame
                if extra:
                    view[off + n:off + n + extra] = _trailer(skey, n, buffer_checksum([frame]))
                ptr, size = [stage.address + off], [n + extra]
                off += n + extra
            ptrs.append(ptr)
            sizes.append(size)
        self.metrics.count("compressed", len(frames) - len(raw))
        return list(self._store.batch_put_from_multi_buffers(skeys, ptrs, sizes, self._replicate))

    def _check_trailer(self, trailer: bytes | memoryview, skey: str, length: int, checksum: int) -> Reason:
        """OK when ``trailer`` is the one of ``length`` stored bytes of XXH3 ``checksum``
        under ``skey``; else CORRUPT (counted as ``mooncake_bad_checksum``)."""
        if trailer == _trailer(skey, length, checksum):
            return Reason.OK
        self.metrics.count("mooncake_bad_checksum")
        return Reason.CORRUPT

    def _from_stored(self, skey: str, page: Page, stored: bytes | memoryview) -> Reason:
        """The whole object ``stored`` (raw or a frame, then any trailer), checked, into ``page``."""
        views = self.regions.views(page)
        if views is None:
            return Reason.UNREGISTERED
        if self._checksum:
            body = len(stored) - TRAILER.size
            if body < 0:
                return Reason.SIZE_MISMATCH
            reason = self._check_trailer(stored[body:], skey, body, buffer_checksum([stored[:body]]))
            if reason is not Reason.OK:
                return reason
            stored = stored[:body]
        return read_stored(stored, views)

    def _get_staged(self, skeys: list[str], pages: list[Page]) -> list[Reason]:
        """Get whole objects into registered scratch, then check them into their pages."""
        slot = (self.page_bytes or 0) + TRAILER.size
        stage = self._frames.get(slot * len(skeys))
        got = self._store.batch_get_into(skeys, [stage.address + j * slot for j in range(len(skeys))],
                                         [slot] * len(skeys))
        self._note_codes(got)
        view = stage.view()
        return [self._from_stored(k, p, view[j * slot:j * slot + g]) if g >= 0 else _reason(g)
                for j, (k, p, g) in enumerate(zip(skeys, pages, got))]

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        out: list[Reason] = []
        step = self.config.max_batch
        for lo in range(0, len(keys), step):
            if self._master_unreachable():
                out += [Reason.ENGINE_DOWN] * (len(keys) - lo)
                break
            out += self._get_chunk(keys[lo : lo + step], pages[lo : lo + step])
        if self._lru is not None:
            self._lru_touch(keys, out)
        return out

    def _get_chunk(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        n = len(keys)
        skeys = [self._prefix + k for k in keys]
        page_bytes = self.page_bytes or 0  # the base class checked every page's size
        size = page_bytes + (TRAILER.size if self._checksum else 0)
        expected = [size] * n
        trailers: memoryview | None = None
        if self._checksum:
            assert self._trailers is not None
            scratch = self._trailers.get(n)
            trailers = scratch.view()
            got = self._store.batch_get_into_multi_buffers(skeys, *_buffers(pages, scratch.address))
        elif max(map(len, pages)) == 1:
            got = self._store.batch_get_into(skeys, [p[0][0] for p in pages], expected)
        else:
            got = self._store.batch_get_into_multi_buffers(skeys, *_buffers(pages))
        self._note_codes(got)
        if got == expected and trailers is None:  # the common case, compared in C
            return [Reason.OK] * n
        out = []
        for j, g in enumerate(got):
            if g == size:
                out.append(Reason.OK if trailers is None else self._check_trailer(
                    trailers[j * TRAILER.size:(j + 1) * TRAILER.size], skeys[j], page_bytes,
                    page_checksum(pages[j])))
            elif 0 <= g < page_bytes:  # a frame (or a short object): in the page
                views = self.regions.views(pages[j])
                out.append(Reason.UNREGISTERED if views is None
                           else self._from_stored(skeys[j], pages[j], leading_bytes(views, g)))
            elif g >= 0 or g == INVALID_PARAMS:  # -600: the object is larger than the buffer
                self.metrics.count("mooncake_short_object")
                out.append(Reason.SIZE_MISMATCH)
            else:
                out.append(_reason(g))
        if trailers is not None or max(map(len, pages)) > 1:  # a short object fails these gets
            again = [j for j, r in enumerate(out)
                     if got[j] < 0 and r not in (Reason.MISS, Reason.ENGINE_DOWN)]
            if again:
                for j, r in zip(again, self._get_staged([skeys[j] for j in again],
                                                        [pages[j] for j in again])):
                    out[j] = r
        return out

    def _exists(self, keys: list[str]) -> list[Reason]:
        return self._exists_prefixed([self._prefix + k for k in keys])

    def _exists_prefixed(self, skeys: list[str]) -> list[Reason]:
        """One ``batch_is_exist`` per ``max_batch`` storage keys: 1 ok, 0 miss, else its reason."""
        if self._master_unreachable():
            return [Reason.ENGINE_DOWN] * len(skeys)
        if len(skeys) <= self.config.max_batch:
            codes = self._store.batch_is_exist(skeys)
            if codes.count(1) == len(codes) and self._down_since is None:
                return [Reason.OK] * len(codes)
            self._note_codes(codes)
        else:
            codes = self._chunked(self._store.batch_is_exist, skeys)
        return [Reason.OK if c == 1 else Reason.MISS if c == 0 else _reason(c) for c in codes]

    def _lru_stored(self, keys: list[str], reasons: list[Reason]) -> None:
        """Record stored keys as most recent; delete the least recent beyond capacity."""
        assert self._lru is not None
        capacity = max(1, self.config.capacity_bytes // (self.page_bytes or 1))
        with self._lru_lock:
            for key, r in zip(keys, reasons):
                if r is Reason.OK:
                    self._lru[key] = None
                    self._lru.move_to_end(key)
            victims = [self._lru.popitem(last=False)[0] for _ in range(len(self._lru) - capacity)]
        if victims:
            self.metrics.count("capacity_evictions", self._remove(victims).count(0))

    def _lru_touch(self, keys: list[str], reasons: list[Reason]) -> None:
        """Hits become the most recently used pages."""
        assert self._lru is not None
        with self._lru_lock:
            for key, r in zip(keys, reasons):
                if r is Reason.OK and key in self._lru:
                    self._lru.move_to_end(key)

    def _delete(self, keys: list[str]) -> list[Reason]:
        if self._lru is not None:
            with self._lru_lock:
                for key in keys:
                    self._lru.pop(key, None)
        if self._master_unreachable():
            return [Reason.ENGINE_DOWN] * len(keys)
        return [Reason.OK if c == 0 else _reason(c) for c in self._remove(keys)]

    def _remove(self, keys: list[str]) -> list[int]:
        """Mooncake's code per key of removing it, forced: a page read within the last lease
        period (10 s by default) is removed too."""
        return self._chunked(lambda ks: self._store.batch_remove(ks, True), [self._prefix + k for k in keys])

    def _chunked(self, call: Any, skeys: list[str], *more: list[Any]) -> list[int]:
        """``call`` of every ``max_batch`` storage keys (and the same slice of ``more``)."""
        codes: list[int] = []
        step = self.config.max_batch
        for lo in range(0, len(skeys), step):
            if lo and self._master_unreachable():
                return codes + [RPC_FAIL] * (len(skeys) - lo)
            part = call(skeys[lo : lo + step], *(m[lo : lo + step] for m in more))
            self._note_codes(part)
            codes += part
        return codes

    def _clear(self) -> None:
        if self._lru is not None:
            with self._lru_lock:
                self._lru.clear()
        if self._master_unreachable():
            raise EngineUnavailableError(f"mooncake master {self.config.master_address} is down")
        # the prefix is 24 hex digits and a colon: nothing to escape
        rc = self._store.remove_by_regex(f"^{self._prefix}", True)
        if rc < 0:
            self._note_codes([rc])
            raise EngineUnavailableError(f"mooncake connector: clear failed with code {rc}")

    def _close(self) -> None:
        store, self._store = self._store, None
        if store is None:
            return
        for scratch in (self._trailers, self._frames):
            if scratch is not None:
                scratch.release()
        rc = store.close()
        if rc != 0:
            log.warning("mooncake: close returned %s", rc)

    def _engine_stats(self) -> dict[str, Any]:
        return {
            "master_address": self.config.master_address,
            "metadata_server": self.config.metadata_url(),
            "protocol": self.config.protocol,
            "global_segment_size": self.config.global_segment_size,
            "checksum": self.config.checksum,
            "master_down": self._down_since is not None,
        }


def _reason(code: int) -> Reason:
    return CODE_REASONS.get(code, Reason.ENGINE_ERROR)


def _trailer(skey: str, length: int, checksum: int) -> bytes:
    """The trailer stored after ``length`` bytes of XXH3 ``checksum`` under ``skey``."""
    return TRAILER.pack(TRAILER_MAGIC, length, checksum, key_fingerprint(skey)[:8])


def _buffers(pages: list[Page], trailers: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Each page's segment addresses and lengths, for Mooncake's multi-buffer calls; with
    ``trailers`` (an address), page ``j``'s trailer slot at ``trailers + j * TRAILER.size`` last."""
    if trailers is None:
        return [[a for a, _ in p] for p in pages], [[s for _, s in p] for p in pages]
    return ([[*(a for a, _ in p), trailers + j * TRAILER.size] for j, p in enumerate(pages)],
            [[*(s for _, s in p), TRAILER.size] for p in pages])
