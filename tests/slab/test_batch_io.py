"""The C batch I/O library (hicache_l3._batch_io) against the Python reference: the same
checksums, the same bytes on disk, and every failure reported per page."""

from __future__ import annotations

import array
import errno
import importlib.util
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.integrity import page_checksum
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import FlatPages, Page
from hicache_l3.conformance.pages import Pages
from hicache_l3.slab import native as batch_io
from hicache_l3.slab.format import MARKER_RECORD, RECORD_BYTES, encode_marker
from hicache_l3.slab.native import PageBatch

MR = RECORD_BYTES  # a marker record
HL = 64  # a marker of hl3_markers (any length)
SLOT = 3 * 4096
DATA0 = 4096  # data after a one-block marker table


@pytest.fixture
def native() -> batch_io.BatchIO:
    lib = batch_io.library()
    assert lib is not None
    return lib


@pytest.fixture
def buf() -> HostBuffer:
    b = HostBuffer(8 * 4096)
    b.view()[:] = os.urandom(8 * 4096)
    return b


def _pages(buf: HostBuffer) -> list[Page]:
    a = buf.address
    return [((a, 4096),), ((a + 4096, 1000), (a + 3 * 4096, 3096)), ((a + 5 * 4096, 8192),)]


def _data_offsets(pages: list[Page], adjacent: bool) -> list[int]:
    """Each page right after the previous one (``adjacent``: one call moves them all), or
    one per SLOT (one call each)."""
    if not adjacent:
        return [DATA0 + j * SLOT for j in range(len(pages))]
    out, at = [], DATA0
    for page in pages:
        out.append(at)
        at += sum(n for _, n in page)
    return out


def _write(native: batch_io.BatchIO, fd: int, pages: list[Page], checksum: bool = True,
           adjacent: bool = False) -> PageBatch:
    n = len(pages)
    records = [encode_marker(j + 1, 4096, 0, bytes([j]) * 16) for j in range(n)]
    w = PageBatch(MR, [fd] * n, _data_offsets(pages, adjacent), [j * MR for j in range(n)], pages,
                  records, writing=True)
    assert native.write(w, 0, n, checksum) == 0
    assert list(w.status) == [batch_io.OK] * n
    return w


def _read(native: batch_io.BatchIO, fd: int, pages: list[Page], w: PageBatch,
          adjacent: bool = False) -> PageBatch:
    n = len(pages)
    r = PageBatch(MR, [fd] * n, _data_offsets(pages, adjacent), [j * MR for j in range(n)], pages,
                  [bytes(w.markers[j * MR : (j + 1) * MR]) for j in range(n)], list(w.checksums),
                  writing=False)
    native.read(r, 0, n)
    return r


@pytest.mark.parametrize("adjacent", [False, True], ids=["apart", "adjacent"])
def test_round_trip_matches_the_python_checksums_and_layout(native: batch_io.BatchIO, buf: HostBuffer,
                                                             tmp_path: Path, adjacent: bool) -> None:
    pages = _pages(buf)
    expected = [page_checksum(p) for p in pages]
    original = bytes(buf.view())
    offsets = _data_offsets(pages, adjacent)
    with open(tmp_path / "slab", "w+b") as f:
        w = _write(native, f.fileno(), pages, adjacent=adjacent)
        assert list(w.checksums) == expected
        raw = (tmp_path / "slab").read_bytes()
        for j, page in enumerate(pages):
            record = MARKER_RECORD.unpack(raw[j * MR : (j + 1) * MR])
            assert record[5] == expected[j]  # the checksum field was filled in
            assert raw[j * MR : (j + 1) * MR] == encode_marker(j + 1, 4096, expected[j], bytes([j]) * 16)
            data = b"".join(original[a - buf.address : a - buf.address + n] for a, n in page)
            assert raw[offsets[j] : offsets[j] + len(data)] == data
        buf.view()[:] = bytes(len(original))
        r = _read(native, f.fileno(), pages, w, adjacent)
        assert list(r.status) == [batch_io.OK] * 3
        for page in pages:
            for a, n in page:
                assert bytes(buf.view()[a - buf.address : a - buf.address + n]) == \
                    original[a - buf.address : a - buf.address + n]


@pytest.mark.parametrize("adjacent", [False, True], ids=["apart", "adjacent"])
def test_each_failure_is_reported_for_its_page_only(native: batch_io.BatchIO, buf: HostBuffer,
                                                    tmp_path: Path, adjacent: bool) -> None:
    pages = _pages(buf)
    offsets = _data_offsets(pages, adjacent)
    with open(tmp_path / "slab", "w+b") as f:
        fd = f.fileno()
        w = _write(native, fd, pages, adjacent=adjacent)
        at = offsets[1] + 10
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)  # page 1: a flipped data byte
        w.markers[2 * MR + 8] ^= 1  # page 2: the reader expects another generation
        r = _read(native, fd, pages, w, adjacent)
        assert list(r.status) == [batch_io.OK, batch_io.CHECKSUM, batch_io.HEADER]
        os.ftruncate(fd, offsets[2] + 100)  # page 2 cut short (a coalesced read is retried per page)
        r = _read(native, fd, pages, w, adjacent)
        assert list(r.status) == [batch_io.OK, batch_io.CHECKSUM, batch_io.SHORT]
        w.markers[1 * MR + 8] ^= 1  # page 1 rewritten meanwhile: bad data and a new record
        r = _read(native, fd, pages, w, adjacent)
        assert list(r.status) == [batch_io.OK, batch_io.HEADER, batch_io.SHORT]  # a miss, not corrupt
    closed = os.open(tmp_path / "slab", os.O_RDONLY)
    os.close(closed)
    r = _read(native, closed, pages, w)
    assert list(r.status) == [-errno.EBADF] * 3
    ro = os.open(tmp_path / "slab", os.O_RDONLY)
    try:
        n = len(pages)
        bad = PageBatch(MR, [ro] * n, offsets, [j * MR for j in range(n)], pages, [bytes(MR)] * n,
                        writing=True)
        assert native.write(bad, 0, n, True) == n
        assert list(bad.status) == [-errno.EBADF] * n
    finally:
        os.close(ro)


def test_out_of_range_shares_and_mismatched_lists_are_refused(native: batch_io.BatchIO,
                                                              buf: HostBuffer) -> None:
    pages = _pages(buf)
    empty = PageBatch(MR, [], [], [], [], [], writing=False)
    assert native.read(empty, 0, 0) == 0 and native.write(empty, 0, 0, True) == 0  # nothing to move
    r = PageBatch(MR, [0, 0, 0], [0, 0, 0], [0, 0, 0], pages, [bytes(MR)] * 3, writing=False)
    with pytest.raises(ValueError, match="read of pages"):
        native.read(r, 0, 4)
    with pytest.raises(ValueError, match="write of pages"):
        native.write(r, 0, 3, True)  # a read batch
    with pytest.raises(ValueError, match="differ in length"):
        PageBatch(MR, [0, 0], [0, 0, 0], [0, 0, 0], pages, [bytes(MR)] * 3, writing=False)
    with pytest.raises(ValueError, match="128 bytes"):
        PageBatch(MR, [0, 0, 0], [0, 0, 0], [0, 0, 0], pages, [bytes(MR - 1)] * 3, writing=False)


def test_a_library_of_another_format_is_refused() -> None:
    """A build without hl3_abi (the format-1 library, or any other .so) is refused at load,
    never called with format-2 arguments."""
    spec = importlib.util.find_spec("hicache_l3._loopback_bind")
    assert spec is not None and spec.origin is not None
    with pytest.raises(RuntimeError, match="another slab format"):
        batch_io.BatchIO(spec.origin)


@pytest.mark.parametrize("writer, reader", [({}, {"o_direct": True, "io_uring_depth": 0}),
                                            ({"o_direct": True, "io_uring_depth": 0}, {})])
def test_buffered_and_o_direct_paths_read_each_others_pages(tmp_path: Path, writer: dict[str, object],
                                                            reader: dict[str, object]) -> None:
    """One slab format: pages written by either C path are read back exactly by the other."""
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    keys = [f"x{i}" for i in range(40)]
    with open_connector("file", ns, root=str(tmp_path), **writer) as w:
        pages = Pages(w, 16 << 10, len(keys))
        pages.fill(keys)
        assert w.batch_set(keys, pages.pages) == [True] * len(keys)
    with open_connector("file", ns, root=str(tmp_path), **reader) as r:
        got = Pages(r, 16 << 10, len(keys))
        assert r.batch_get(keys, got.pages) == [True] * len(keys)
        assert all(got.matches(i, k) for i, k in enumerate(keys))


def test_header_struct_matches_the_library() -> None:
    """The C code patches the checksum at byte 24 of a marker record (HL3_CSUM_AT)."""
    packed = encode_marker(2, 3, 0x0102030405060708, bytes(16))
    assert struct.unpack_from("<Q", packed, 24)[0] == 0x0102030405060708
    assert f"HL3_CSUM_AT {24}" in Path(batch_io.__file__).parent.parent.joinpath(
        "native", "batch_io.h").read_text()


def test_stats_name_the_io_path(tmp_path: Path) -> None:
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    with open_connector("file", ns, root=str(tmp_path)) as conn:
        assert conn.stats()["engine"]["io_path"] == "native batch I/O (C)"
    with open_connector("file", ns, root=str(tmp_path), o_direct=True, io_uring_depth=0) as conn:
        assert conn.stats()["engine"]["io_path"] == "native O_DIRECT (C)"


_ORDER_SCRIPT = r"""
import os, resource, signal, sys
from hicache_l3.common.memory import HostBuffer
from hicache_l3.slab import native as batch_io
from hicache_l3.slab.native import PageBatch
lib = batch_io.library()
buf = HostBuffer(2 * 4096)
buf.view()[:] = b"D" * 8192
pages = [((buf.address, 4096),), ((buf.address + 4096, 4096),)]
path, marker_at, data_at, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ring = sys.argv[5] == "ring"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
w = PageBatch(128, [fd, fd], [data_at, data_at + 4096], [marker_at, marker_at + 128], pages,
              [b"M" * 128] * 2, writing=True)
if ring:
    from hicache_l3.slab.uring import Rings
    Rings(4).write(w, None, False)
else:
    lib.write(w, 0, 2, False)
print(w.status[0], w.status[1], os.fstat(fd).st_size)
"""


def _cut_write(tmp_path: Path, marker_at: int, data_at: int, limit: int, how: str) -> tuple[int, int, int]:
    out = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, str(tmp_path / "slab"), str(marker_at),
                          str(data_at), str(limit), how], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    a, b, size = map(int, out.stdout.split())
    return a, b, size


@pytest.mark.parametrize("how", ["calls", "ring"])
def test_marker_records_are_written_before_any_data(tmp_path: Path, how: str) -> None:
    """The write order of format 2, by blocking calls or through the write ring: a page's
    marker record first, then its data; a page whose marker was not written writes no
    data. Writes are cut short by RLIMIT_FSIZE here."""
    # markers before the data in the file: the limit lets the markers land, not the data
    assert _cut_write(tmp_path, 0, 4096, 4096 + 100, how) == (batch_io.SHORT, -errno.EFBIG, 4096 + 100)
    assert (tmp_path / "slab").read_bytes()[:256] == b"M" * 256
    # markers after the data in the file: they fail, and no data byte is written
    assert _cut_write(tmp_path, 16384, 0, 8192, how) == (-errno.EFBIG, -errno.EFBIG, 0)


def test_marker_calls_report_each_marker(native: batch_io.BatchIO, tmp_path: Path) -> None:
    """write_markers / read_markers (the NIXL file transport's): one status per marker, a
    differing or cut-short marker and a bad descriptor reported for that marker only."""
    with open(tmp_path / "slab", "w+b") as f:
        fd = f.fileno()
        markers = [bytes([j + 1]) * HL for j in range(3)]
        # adjacent markers move in one call; the results are the same
        assert list(native.write_markers([fd] * 3, [100, 100 + HL, 100 + 2 * HL], b"".join(markers),
                                         HL)) == [0, 0, 0]
        assert os.pread(fd, 3 * HL, 100) == b"".join(markers)
        got = native.read_markers([fd] * 3, [100, 100 + HL, 100 + 2 * HL],
                                  b"".join([markers[0], b"y" * HL, markers[2]]), HL)
        assert list(got) == [batch_io.OK, batch_io.HEADER, batch_io.OK]
        assert list(native.write_markers([fd] * 3, [0, 1000, 5000], b"".join(markers), HL)) == [0, 0, 0]
        assert os.pread(fd, HL, 1000) == markers[1]
        expect = [markers[0], b"x" * HL, markers[2]]
        got = native.read_markers([fd] * 4, [0, 1000, 5000, 5000 + 10], b"".join([*expect, markers[2]]), HL)
        assert list(got) == [batch_io.OK, batch_io.HEADER, batch_io.OK, batch_io.SHORT]
    closed = os.open(tmp_path / "slab", os.O_RDONLY)
    os.close(closed)
    assert list(native.read_markers([closed], [0], markers[0], HL)) == [-errno.EBADF]
    with pytest.raises(ValueError, match="markers"):
        native.write_markers([0, 0], [0], bytes(2 * HL), HL)


@pytest.mark.parametrize("flat", [False, True], ids=["lists", "flat-pages"])
def test_for_write_batches_write_what_per_page_lists_do(native: batch_io.BatchIO, buf: HostBuffer,
                                                         tmp_path: Path, flat: bool) -> None:
    """PageBatch.for_write (the native set path's: arrays taken as they are, a FlatPages'
    segments used as flattened) puts the same bytes on disk, with the same checksums, as a
    batch built from per-page lists; mismatched arrays are refused."""
    a = buf.address
    pages: list[Page] = [((a, 2048), (a + 4096, 2048)), ((a + 3 * 4096, 2048), (a + 5 * 4096, 2048)),
                         ((a + 6 * 4096, 2048), (a + 2 * 4096, 2048))]
    segments = b"".join(struct.pack("=QQ", addr, n) for page in pages for addr, n in page)
    given: list[Page] = FlatPages(pages, segments, 2) if flat else pages
    records = [encode_marker(j + 7, 4096, 0, bytes([j + 1]) * 16) for j in range(3)]
    offsets, markers = [DATA0 + j * SLOT for j in range(3)], [j * MR for j in range(3)]
    files = []
    for name in ("lists", "arrays"):
        with open(tmp_path / name, "w+b") as f:
            fd = f.fileno()
            if name == "lists":
                w = PageBatch(MR, [fd] * 3, offsets, markers, pages, records, writing=True)
            else:
                w = PageBatch.for_write(MR, array.array("i", [fd] * 3), array.array("q", offsets),
                                        array.array("q", markers), given, bytearray(b"".join(records)))
                assert bytes(w.segments) == segments
            assert native.write(w, 0, 3, True) == 0 and list(w.status) == [batch_io.OK] * 3
            assert list(w.checksums) == [page_checksum(p) for p in pages]
        files.append((tmp_path / name).read_bytes())
    assert files[0] == files[1] and len(files[0]) == DATA0 + 2 * SLOT + 4096
    with pytest.raises(ValueError, match="for_write"):
        PageBatch.for_write(MR, array.array("i", [3] * 2), array.array("q", offsets),
                            array.array("q", markers), pages, bytearray(b"".join(records)))
    with pytest.raises(ValueError, match="for_write"):
        PageBatch.for_write(MR, array.array("i", [3] * 3), array.array("q", offsets),
                            array.array("q", markers), pages, bytearray(b"".join(records)[:-1]))


def test_big_checksummed_pages_are_written_one_at_a_time_and_read_back(native: batch_io.BatchIO,
                                                                      tmp_path: Path) -> None:
    """Pages bigger than one coalesced read (256 KiB) are hashed and written one at a time:
    the same records, checksums and bytes as the Python reference computes, and a read
    back (in pieces) verifies them; a page whose record cannot be written writes no data
    while the others land."""
    seg, n = 200 << 10, 3
    big = HostBuffer(2 * seg * n)
    big.view()[:] = os.urandom(2 * seg * n)
    pages: list[Page] = [((big.address + (2 * j + 1) * seg, seg), (big.address + 2 * j * seg, seg))
                         for j in range(n)]
    records = [encode_marker(j + 1, 2 * seg, 0, bytes([j]) * 16) for j in range(n)]
    offsets = [DATA0 + j * 2 * seg for j in range(n)]
    with open(tmp_path / "slab", "w+b") as f:
        fd = f.fileno()
        w = PageBatch(MR, [fd, -1, fd], offsets, [j * MR for j in range(n)], pages, records, writing=True)
        assert native.write(w, 0, n, True) == 1
        assert list(w.status) == [batch_io.OK, -errno.EBADF, batch_io.OK]
        raw = (tmp_path / "slab").read_bytes()
        for j in (0, 2):
            assert w.checksums[j] == page_checksum(pages[j])
            assert raw[j * MR:(j + 1) * MR] == encode_marker(j + 1, 2 * seg, w.checksums[j], bytes([j]) * 16)
            want = b"".join(bytes(big.view()[a - big.address:a - big.address + k]) for a, k in pages[j])
            assert raw[offsets[j]:offsets[j] + 2 * seg] == want
        assert raw[offsets[1]:offsets[1] + 2 * seg].count(0) == 2 * seg  # page 1 wrote no data
        ok = [pages[0], pages[2]]
        r = PageBatch(MR, [fd, fd], [offsets[0], offsets[2]], [0, 2 * MR], ok,
                      [bytes(w.markers[0:MR]), bytes(w.markers[2 * MR:3 * MR])],
                      [w.checksums[0], w.checksums[2]], writing=False)
        big.view()[:] = bytes(2 * seg * n)
        assert native.read(r, 0, 2) == 0 and list(r.status) == [batch_io.OK, batch_io.OK]
        got = b"".join(bytes(big.view()[a - big.address:a - big.address + k]) for p in ok for a, k in p)
        assert got == raw[offsets[0]:offsets[0] + 2 * seg] + raw[offsets[2]:offsets[2] + 2 * seg]


@pytest.mark.parametrize("threads, chunk", [(1, 1), (2, 1), (3, 2), (2, 3)])
def test_a_shared_write_writes_what_one_call_writes(native: batch_io.BatchIO, buf: HostBuffer, tmp_path: Path,
                                                    threads: int, chunk: int) -> None:
    """hl3_share_write_pages: threads claiming chunks of one write batch write the same
    records, checksums and data as one hl3_write_pages call; the calling thread's drain
    returns True only once every chunk finished."""
    pages = _pages(buf)
    n = len(pages)
    with open(tmp_path / "one", "w+b") as one, open(tmp_path / "shared", "w+b") as shared:
        ref = _write(native, one.fileno(), pages)
        records = [encode_marker(j + 1, 4096, 0, bytes([j]) * 16) for j in range(n)]
        w = PageBatch(MR, [shared.fileno()] * n, _data_offsets(pages, False), [j * MR for j in range(n)],
                      pages, records, writing=True)
        share = batch_io.Share(n, chunk)
        others = [threading.Thread(target=native.share_write, args=(share, w, 0, True))
                  for _ in range(threads - 1)]
        for t in others:
            t.start()
        finished = native.share_write(share, w, 5_000_000_000, True)
        done_then = share.done
        for t in others:
            t.join()
        assert finished and done_then == n
        assert list(w.status) == [batch_io.OK] * n
        assert list(w.checksums) == list(ref.checksums)
        assert (tmp_path / "shared").read_bytes() == (tmp_path / "one").read_bytes()
    with pytest.raises(ValueError, match="share"):
        native.share_write(batch_io.Share(n + 1, 1), w, 0, True)


def test_a_refused_library_is_an_import_error_naming_the_fix() -> None:
    """The C library is required: a view whose calls are missing (a build for another
    ABI) or whose self-test disagrees is an ImportError that says how to get a good one,
    on every use, never a silent Python path."""
    from hicache_l3.common.keys import BUILD_HINT

    def stale(path: str) -> None:
        raise AttributeError(f"{path}: undefined symbol: hl3_abi")

    def disagrees(view: None) -> None:
        raise RuntimeError("disagrees with the reference")

    for loaded in (batch_io.LoadedOnce(stale, lambda view: None, "refused"),
                   batch_io.LoadedOnce(lambda path: None, disagrees, "refused")):
        for _ in range(2):
            with pytest.raises(ImportError, match="refused") as raised:
                loaded.get()
            assert BUILD_HINT in str(raised.value) and raised.value.name == "hicache_l3._batch_io"
