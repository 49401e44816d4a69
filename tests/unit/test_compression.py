"""The page codec (hicache_l3.common.compression): frames, transforms, strict decoding."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hicache_l3.common.compression import (
    BOTH_PLANES,
    FRAME,
    FRAME_MAGIC,
    HIGH_PLANE,
    WHOLE,
    PageCodec,
    element_bytes,
    is_frame,
    read_stored,
    transform_for,
)
from hicache_l3.common.errors import ConfigError, Reason
from hicache_l3.conformance.compression import hostile_frames, kv_pattern

PAGE = 64 << 10


def _bf16(n: int, seed: int = 0) -> bytes:
    x = np.random.default_rng(seed).normal(0, 0.05, n // 2).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _read(stored: bytes, n: int = PAGE) -> tuple[Reason, bytes]:
    out = bytearray(n)
    reason = read_stored(stored, [memoryview(out)])
    return reason, bytes(out)


@pytest.mark.parametrize("transform", [WHOLE, HIGH_PLANE, BOTH_PLANES])
def test_roundtrip_each_transform(transform: int) -> None:
    page = _bf16(PAGE)
    frame = PageCodec("zstd", "bfloat16", transform=transform).encode([memoryview(page)])
    assert frame is not None and is_frame(frame, PAGE) and len(frame) < PAGE
    assert _read(frame) == (Reason.OK, page)


def test_planes_beat_whole_on_bf16() -> None:
    page = _bf16(PAGE)
    sizes = {t: len(PageCodec("zstd", "bf16", transform=t).encode([memoryview(page)]) or b"")
             for t in (WHOLE, HIGH_PLANE)}
    assert sizes[HIGH_PLANE] < sizes[WHOLE]


def test_multi_segment_pages_roundtrip() -> None:
    page = _bf16(PAGE, 1)
    segs = [memoryview(page)[i:i + PAGE // 4] for i in range(0, PAGE, PAGE // 4)]
    frame = PageCodec("zstd", "bfloat16").encode(segs)
    assert frame is not None
    outs = [bytearray(PAGE // 4) for _ in range(4)]
    assert read_stored(frame, [memoryview(o) for o in outs]) is Reason.OK
    assert b"".join(outs) == page


def test_incompressible_and_none_store_raw() -> None:
    page = random.Random(3).randbytes(PAGE)
    assert PageCodec("zstd", "bfloat16").encode([memoryview(page)]) is None
    assert PageCodec("none", "bfloat16").encode([memoryview(_bf16(PAGE))]) is None
    assert _read(page) == (Reason.OK, page)  # a raw page is read as is


def test_dtype_picks_the_transform() -> None:
    assert element_bytes("bfloat16") == 2 and element_bytes("torch.float16") == 2
    assert element_bytes("float8_e4m3fn") == 1 and element_bytes("float32") == 4
    assert transform_for("bfloat16") == HIGH_PLANE
    assert transform_for("float8_e4m3fn") == WHOLE


def test_unknown_setting_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="compression"):
        PageCodec("lz4", "bfloat16")


def test_raw_page_of_another_length_is_a_size_mismatch() -> None:
    assert _read(b"\1" * (PAGE + 1))[0] is Reason.SIZE_MISMATCH
    assert _read(b"\1" * 100)[0] is Reason.SIZE_MISMATCH  # short, no magic


@pytest.mark.parametrize("name", list(hostile_frames(PAGE)))
def test_hostile_frames_are_corrupt_and_write_nothing(name: str) -> None:
    stored = hostile_frames(PAGE)[name]
    out = bytearray(b"\x5a" * PAGE)
    assert read_stored(stored, [memoryview(out)]) is Reason.CORRUPT
    assert out == b"\x5a" * PAGE


def test_every_truncation_and_byte_flip_of_the_header_is_refused() -> None:
    page = kv_pattern("trunc", PAGE)
    frame = PageCodec("zstd", "bfloat16").encode([memoryview(page)])
    assert frame is not None
    rng = random.Random(7)
    for cut in sorted({1, 2, 3, 4, 8, *rng.sample(range(1, len(frame)), 40)}):
        assert _read(frame[:-cut])[0] is not Reason.OK, cut
    for i in range(FRAME.size):  # any header byte changed: never OK
        for bit in range(8):
            bad = bytearray(frame)
            bad[i] ^= 1 << bit
            reason, got = _read(bytes(bad))
            assert reason is not Reason.OK or got == page, (i, bit)


def test_random_damage_never_crashes_or_overflows() -> None:
    page = kv_pattern("fuzz", PAGE)
    frame = PageCodec("zstd", "bfloat16", transform=WHOLE).encode([memoryview(page)])
    assert frame is not None
    rng = random.Random(11)
    for _ in range(300):
        bad = bytearray(frame)
        for _ in range(rng.randint(1, 8)):
            bad[rng.randrange(FRAME.size, len(bad))] = rng.randrange(256)
        out = bytearray(PAGE + 64)
        reason = read_stored(bytes(bad), [memoryview(out)[:PAGE]])
        assert reason in (Reason.OK, Reason.CORRUPT)
        assert out[PAGE:] == bytes(64)


def test_header_is_the_documented_layout() -> None:
    frame = PageCodec("zstd", "bfloat16").encode([memoryview(_bf16(PAGE))])
    assert frame is not None
    assert FRAME.unpack_from(frame) == (FRAME_MAGIC, 1, HIGH_PLANE, 0, PAGE)


def test_leading_bytes_across_segments() -> None:
    from hicache_l3.common.compression import leading_bytes

    data = bytes(range(200))
    views = [memoryview(data)[i:i + 50] for i in range(0, 200, 50)]
    assert leading_bytes(views, 120) == data[:120]
    assert leading_bytes(views, 200) == data
    assert leading_bytes(views, 0) == b""
