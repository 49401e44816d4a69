"""Lossless page compression: the ``compression`` setting's codec and its stored frame.

A compressed page is a frame (16-byte header, the body, then ``pad`` zero bytes); a raw
page has no header. A stored object of exactly ``page_bytes`` is raw, a shorter one starting
with the magic is a frame. Readers decode frames whatever their own setting; a bad frame is
CORRUPT. The padding lets a store keep frame lengths to a few classes (slab slots).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache_l3.common.errors import ConfigError, Reason

COMPRESSIONS = ("none", "zstd")
FRAME = struct.Struct("<4sBBHQ")  # magic, codec, transform, pad (zero bytes after the body), raw length
FRAME_MAGIC = b"HLZ\x01"
CODEC_ZSTD = 1
WHOLE = 0  # zstd over the page
HIGH_PLANE = 1  # 2-byte elements: low plane as is, then zstd(high plane)
BOTH_PLANES = 2  # 2-byte elements: zstd(low plane + high plane)
_TRANSFORMS = (WHOLE, HIGH_PLANE, BOTH_PLANES)

_TWO_BYTE = ("bfloat16", "bf16", "float16", "fp16", "half")


def element_bytes(kv_dtype: str) -> int:
    """Bytes per element of a KV dtype name (``bfloat16``, ``float8_e4m3fn``...); 1 for
    names it does not know (no transform is then applied)."""
    name = kv_dtype.lower().removeprefix("torch.")
    if any(name.startswith(p) for p in _TWO_BYTE):
        return 2
    if name in ("float32", "fp32", "float"):
        return 4
    return 1


def transform_for(kv_dtype: str) -> int:
    """The transform used for pages of ``kv_dtype``: byte planes for 2-byte elements."""
    return HIGH_PLANE if element_bytes(kv_dtype) == 2 else WHOLE


COMPRESSION_HELP = ("none: pages stored as they are (no copy); zstd: pages stored compressed "
                    "where that makes them shorter (byte planes for 2-byte KV dtypes). Readers "
                    "read both, whatever their setting. Pays only where the tier moves bytes "
                    "slower than the cores decode them (a remote filesystem or object store read "
                    "by a many-core host; docs/benchmarks.md), never on the page cache. In a slab "
                    "store a frame still takes a whole slot: fewer bytes move, the capacity in "
                    "pages is the same")


def check_compression(value: str) -> None:
    """ConfigError naming the setting unless ``value`` is a known compression."""
    if value not in COMPRESSIONS:
        raise ConfigError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {value!r}")


def _zstd() -> Any:
    import zstandard

    return zstandard


class _PerThread(threading.local):
    """zstd contexts are not safe for concurrent use: one pair per thread."""

    def __init__(self) -> None:
        zstd = _zstd()
        self.dctx = zstd.ZstdDecompressor()
        self.cctx: dict[int, Any] = {}

    def compressor(self, level: int) -> Any:
        cctx = self.cctx.get(level)
        if cctx is None:
            cctx = self.cctx[level] = _zstd().ZstdCompressor(level=level, write_content_size=True)
        return cctx


_local = _PerThread()


def _contiguous(views: Sequence[memoryview]) -> Any:
    """The page as one buffer (its single segment as is, several joined)."""
    return views[0] if len(views) == 1 else b"".join(views)


class PageCodec:
    """Encodes pages for one ``compression`` setting and KV dtype. Thread-safe.

    :meth:`encode` gives the frame to store, or None when the page is to be stored as is
    (``compression="none"``, or a frame that would not be shorter than the page).
    """

    def __init__(self, compression: str, kv_dtype: str, level: int = 1,
                 transform: int | None = None) -> None:
        check_compression(compression)
        self.enabled = compression == "zstd"
        self.level = level
        self.transform = transform_for(kv_dtype) if transform is None else transform
        if self.transform not in _TRANSFORMS:
            raise ConfigError(f"unknown compression transform {self.transform}")
        if self.enabled:
            _zstd()  # the install hint now, not at the first set

    def encode(self, views: Sequence[memoryview], align: int = 1) -> bytes | None:
        """The frame of the page made of ``views``, zero-padded to a multiple of ``align``
        bytes (below 65,536), or None to store the page as is."""
        if not self.enabled:
            return None
        raw = _contiguous(views)
        n = len(raw) if not isinstance(raw, memoryview) else raw.nbytes
        transform = self.transform if n % 2 == 0 else WHOLE
        cctx = _local.compressor(self.level)
        if transform == WHOLE:
            parts = [cctx.compress(raw)]
        else:
            words = np.frombuffer(raw, "<u2")
            low, high = words.astype(np.uint8), (words >> 8).astype(np.uint8)
            if transform == HIGH_PLANE:
                parts = [low, cctx.compress(high)]
            else:
                parts = [cctx.compress(np.concatenate([low, high]))]
        size = FRAME.size + sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)
        pad = -size % align
        if size + pad >= n:
            return None
        return b"".join([FRAME.pack(FRAME_MAGIC, CODEC_ZSTD, transform, pad, n), *parts, bytes(pad)])


def is_frame(stored: Any, page_bytes: int) -> bool:
    """Whether ``stored`` (the bytes at rest) is a frame rather than a raw page: shorter
    than the page and starting with the magic."""
    return len(stored) < page_bytes and bytes(stored[:4]) == FRAME_MAGIC


def decode(stored: Any, page_bytes: int, into: Any = None) -> tuple[Reason, Any]:
    """The raw page of the frame ``stored``: ``(Reason.OK, buffer of page_bytes)`` (``into``,
    a writable buffer of ``page_bytes``, when given), or ``(Reason.CORRUPT, None)`` for
    anything but a well-formed frame of exactly that raw length, ``into`` then untouched.
    Never raises for bad bytes."""
    try:
        return Reason.OK, _decode(memoryview(stored).cast("B"), page_bytes, into)
    except (_Corrupt, ValueError, MemoryError, struct.error):
        return Reason.CORRUPT, None
    except Exception as exc:  # zstandard.ZstdError and whatever a damaged frame raises
        if type(exc).__module__.startswith("zstandard"):
            return Reason.CORRUPT, None
        raise


class _Corrupt(Exception):
    pass


def _decompress(body: memoryview, size: int) -> bytes:
    zstd = _zstd()
    declared = zstd.frame_content_size(body)
    if declared != size:  # -1: not written (not ours), else another size
        raise _Corrupt
    out = _local.dctx.decompress(body, max_output_size=size, allow_extra_data=False)
    if len(out) != size:
        raise _Corrupt
    return out


def _decode(mv: memoryview, page_bytes: int, into: Any) -> Any:
    if mv.nbytes < FRAME.size or mv.nbytes >= page_bytes:
        raise _Corrupt
    magic, codec, transform, pad, raw = FRAME.unpack_from(mv)
    if magic != FRAME_MAGIC or codec != CODEC_ZSTD or raw != page_bytes or FRAME.size + pad > mv.nbytes:
        raise _Corrupt
    end = mv.nbytes - pad
    if pad and mv[end:] != bytes(pad):
        raise _Corrupt
    body = mv[FRAME.size:end]
    if transform == WHOLE:
        whole = _decompress(body, raw)
        if into is None:
            return whole
        memoryview(into).cast("B")[:] = whole
        return into
    if transform not in (HIGH_PLANE, BOTH_PLANES) or raw % 2:
        raise _Corrupt
    half = raw // 2
    if transform == HIGH_PLANE:
        if body.nbytes <= half:
            raise _Corrupt
        low: Any = body[:half]
        high: Any = _decompress(body[half:], half)
    else:
        planes = _decompress(body, raw)
        low, high = planes[:half], planes[half:]
    out = np.frombuffer(into, "<u2") if into is not None else np.empty(half, "<u2")
    np.left_shift(np.frombuffer(high, np.uint8), 8, out=out, dtype="<u2")
    np.bitwise_or(out, np.frombuffer(low, np.uint8), out=out)
    return out.view(np.uint8) if into is None else into


def leading_bytes(views: Sequence[memoryview], length: int) -> bytes:
    """A copy of the first ``length`` bytes of the page made of ``views``."""
    parts, left = [], length
    for v in views:
        if left <= 0:
            break
        parts.append(v[:left])
        left -= len(parts[-1])
    return b"".join(parts)


def read_stored(stored: Any, views: Sequence[memoryview]) -> Reason:
    """Copy the page stored as ``stored`` (raw or a frame) into ``views``, the segments of
    the caller's page: OK, SIZE_MISMATCH (a raw page of another length), or CORRUPT (a
    bad frame; nothing written then)."""
    page_bytes = sum(v.nbytes for v in views)
    n = len(stored)
    if n == page_bytes:
        src: Any = memoryview(stored).cast("B")
    elif is_frame(stored, page_bytes):
        if len(views) == 1:  # decoded straight into the page
            return decode(stored, page_bytes, views[0])[0]
        reason, src = decode(stored, page_bytes)
        if reason is not Reason.OK:
            return reason
        src = memoryview(src).cast("B")
    else:
        return Reason.SIZE_MISMATCH
    pos = 0
    for v in views:
        v[:] = src[pos:pos + v.nbytes]
        pos += v.nbytes
    return Reason.OK
