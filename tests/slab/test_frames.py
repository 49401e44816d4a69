"""Compressed pages in slab slots (hicache_l3.slab.frames) through the file connector:
frame lengths padded to few classes, checksum policy, and frames beside whole pages."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_l3.common.compression import FRAME, FRAME_MAGIC
from hicache_l3.common.errors import Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.compression import kv_pattern
from hicache_l3.conformance.pages import Pages, page_pattern, store_pages
from hicache_l3.conformance.slab_backdoor import live_entries, slab_location
from hicache_l3.slab.frames import FrameBuffers, frame_align, frame_passes, is_frame_length

NS = Namespace(model="frames/model", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = 64 << 10


def _varied(key: str, nbytes: int) -> bytes:
    """KV-like bytes whose compressibility depends on the key (frames of many lengths)."""
    raw = bytearray(kv_pattern(key, nbytes))
    n = int(key.rsplit("-", 1)[1])
    noisy = page_pattern(key, nbytes)
    cut = (n * 997) % (nbytes // 2)
    raw[:cut] = noisy[:cut]
    return bytes(raw)


@pytest.mark.parametrize("slot_bytes", [2048, 16 << 10, 64 << 10, 1 << 20, 256 << 20])
def test_frame_align_bounds_the_number_of_lengths(slot_bytes: int) -> None:
    align = frame_align(slot_bytes)
    assert 64 <= align <= 1 << 15 and align & (align - 1) == 0
    assert slot_bytes // align <= 8192


def test_frames_are_padded_to_few_lengths_and_read_back(tmp_path: Path) -> None:
    conn = open_connector("file", NS, {"root": str(tmp_path / "s"), "compression": "zstd"})
    keys = [f"v-{i}" for i in range(40)]
    pages = store_pages(conn, PAGE, keys, _varied)
    stored = [e[4] for e in live_entries(tmp_path / "s", NS).values()]
    lengths = set(stored)
    framed = [n for n in lengths if is_frame_length(n, PAGE)]
    assert len(framed) > 5, lengths
    assert all(n % frame_align(PAGE) == 0 for n in framed), lengths
    for key in keys[:3]:
        where = slab_location(tmp_path / "s", NS, key)
        assert where is not None
        path, offset, stored_bytes, _ = where
        assert stored_bytes < PAGE
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(FRAME.size)[:4] == FRAME_MAGIC
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
    assert pages.holds(keys, _varied)
    counters = conn.stats()["ops"]["counters"]
    frames = sum(is_frame_length(n, PAGE) for n in stored)
    assert counters["frames_written"] == counters["frames_read"] == frames
    conn.close()


def test_unchecked_frame_is_unverified_for_a_checking_reader(tmp_path: Path) -> None:
    root = str(tmp_path / "s")
    plain = open_connector("file", NS, {"root": root, "compression": "zstd", "checksum": "none",
                                        "multi_node": "false"})
    keys = [f"u-{i}" for i in range(4)]
    store_pages(plain, PAGE, keys, kv_pattern)
    checking = open_connector("file", NS, {"root": root})
    pages = Pages(checking, PAGE, len(keys))
    assert checking.batch_reasons("get", keys, pages.pages) == [Reason.UNVERIFIED] * len(keys)
    # dropped from the checking reader's index: a set stores them again, checksummed
    pages.fill(keys, kv_pattern)
    assert checking.batch_set(keys, pages.pages) == [True] * len(keys)
    pages.wipe()
    assert checking.batch_get(keys, pages.pages) == [True] * len(keys)
    assert pages.holds(keys, kv_pattern)
    plain.close()
    checking.close()


def test_frames_and_whole_pages_in_one_batch_after_eviction(tmp_path: Path) -> None:
    """A slot that held a frame is reused for a whole page and the other way round."""
    from hicache_l3.slab.format import Geometry

    conn = open_connector("file", NS, {"root": str(tmp_path / "s"), "compression": "zstd",
                                       "capacity_bytes": 16 * Geometry(PAGE).stride})
    for round_ in range(4):
        keys = [f"e{round_}-{i}" for i in range(16)]

        def pattern(key: str, nbytes: int, r: int = round_) -> bytes:
            i = int(key.rsplit("-", 1)[1])
            return (kv_pattern if (i + r) % 2 else page_pattern)(key, nbytes)

        pages = store_pages(conn, PAGE, keys, pattern)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * 16
        assert pages.holds(keys, pattern)
    conn.close()


def test_flipped_frame_on_a_shared_store_is_read_again_then_kept_as_suspect(tmp_path: Path) -> None:
    """multi_node: a frame failing its checks is read again past the page cache; still bad,
    it is a corrupt miss but stays indexed (suspect) rather than being dropped at once."""
    from hicache_l3.conformance.slab_backdoor import SlabBackdoor

    class Door(SlabBackdoor):
        connector_name = "file"
        page_bytes = PAGE

    settings = {"root": str(tmp_path / "s"), "compression": "zstd", "multi_node": "true"}
    conn = open_connector("file", NS, settings)
    keys = [f"m-{i}" for i in range(3)]
    pages = store_pages(conn, PAGE, keys, kv_pattern)
    Door().backdoor_corrupt(settings, NS, keys[1], "flip")
    pages.wipe()
    assert conn.batch_reasons("get", keys, pages.pages) == [Reason.OK, Reason.CORRUPT, Reason.OK]
    assert pages.matches(0, keys[0], kv_pattern) and pages.matches(2, keys[2], kv_pattern)
    assert conn.batch_exists(keys) == [True, True, True]
    conn.close()


def test_frame_passes_fill_each_buffer_and_take_a_longer_frame_alone() -> None:
    assert list(frame_passes([], 10)) == []
    assert list(frame_passes([4, 4, 4, 12, 3, 3], 10)) == [(0, 2), (2, 3), (3, 4), (4, 6)]


def test_a_get_larger_than_its_buffer_is_read_in_passes_and_the_buffer_kept(tmp_path: Path) -> None:
    conn = open_connector("file", NS, {"root": str(tmp_path / "s"), "compression": "zstd"})
    keys = [f"p-{i}" for i in range(24)]
    pages = store_pages(conn, PAGE, keys, _varied)
    buffers = FrameBuffers(3 * PAGE // 2, keep=1)  # a frame or two a pass
    conn._frame_buffers = buffers  # type: ignore[attr-defined]
    for _ in range(2):
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert pages.holds(keys, _varied)
    assert len(buffers._free) == 1
    conn.close()
