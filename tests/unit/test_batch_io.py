"""The C batch I/O library (hicache_l3._batch_io) against the Python reference: the same
checksums, the same bytes on disk, and every failure reported per page."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.integrity import page_checksum
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page
from hicache_l3.conformance.pages import Pages
from hicache_l3.slab import native as batch_io
from hicache_l3.slab.format import START
from hicache_l3.slab.native import PageBatch

HL = 64
SLOT = 3 * 4096


def test_library_is_built_and_loaded() -> None:
    """CI builds it (pyproject's ext-modules); a silent fallback would hide a broken build.
    The ``native_io`` setting is the one way to turn it off."""
    assert batch_io.library() is not None, "hicache_l3._batch_io is not built: pip install -e . needs cc"
    assert "native" in batch_io.describe()


def test_importing_the_slab_package_loads_nothing() -> None:
    """No file I/O or ctypes work at import: the library loads on first use."""
    code = ("import sys; import hicache_l3.slab.io, hicache_l3.connectors.file; "
            "from hicache_l3.slab import native; "
            "assert native._loaded is None and 'hicache_l3._batch_io' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


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


def _write(native: batch_io.BatchIO, fd: int, pages: list[Page], checksum: bool = True) -> PageBatch:
    n = len(pages)
    headers = [START.pack(b"TEST", 1, 0, j + 1, 4096, 0, bytes(16)) for j in range(n)]
    w = PageBatch(HL, [fd] * n, [j * SLOT for j in range(n)], pages, headers,
                  ends=[bytes([j + 1]) * HL for j in range(n)],
                  end_offsets=[j * SLOT + SLOT - HL for j in range(n)])
    assert native.write(w, 0, n, checksum) == 0
    assert list(w.status) == [batch_io.OK] * n
    return w


def _read(native: batch_io.BatchIO, fd: int, pages: list[Page], w: PageBatch) -> PageBatch:
    n = len(pages)
    r = PageBatch(HL, [fd] * n, [j * SLOT for j in range(n)], pages,
                  [bytes(w.headers[j * HL : (j + 1) * HL]) for j in range(n)], list(w.checksums))
    native.read(r, 0, n)
    return r


def test_round_trip_matches_the_python_checksums_and_layout(native: batch_io.BatchIO, buf: HostBuffer,
                                                             tmp_path: Path) -> None:
    pages = _pages(buf)
    expected = [page_checksum(p) for p in pages]
    original = bytes(buf.view())
    with open(tmp_path / "slab", "w+b") as f:
        w = _write(native, f.fileno(), pages)
        assert list(w.checksums) == expected
        raw = (tmp_path / "slab").read_bytes()
        for j, page in enumerate(pages):
            header = START.unpack(raw[j * SLOT : j * SLOT + HL])
            assert header[5] == expected[j]  # the checksum field was filled in
            data = b"".join(original[a - buf.address : a - buf.address + n] for a, n in page)
            assert raw[j * SLOT + HL : j * SLOT + HL + len(data)] == data
            assert raw[j * SLOT + SLOT - HL : (j + 1) * SLOT] == bytes([j + 1]) * HL
        buf.view()[:] = bytes(len(original))
        r = _read(native, f.fileno(), pages, w)
        assert list(r.status) == [batch_io.OK] * 3
        for page in pages:
            for a, n in page:
                assert bytes(buf.view()[a - buf.address : a - buf.address + n]) == \
                    original[a - buf.address : a - buf.address + n]


def test_each_failure_is_reported_for_its_page_only(native: batch_io.BatchIO, buf: HostBuffer,
                                                    tmp_path: Path) -> None:
    pages = _pages(buf)
    with open(tmp_path / "slab", "w+b") as f:
        fd = f.fileno()
        w = _write(native, fd, pages)
        at = 1 * SLOT + HL + 10
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)  # page 1: a flipped data byte
        w.headers[2 * HL + 8] ^= 1  # page 2: the reader expects another generation
        r = _read(native, fd, pages, w)
        assert list(r.status) == [batch_io.OK, batch_io.CHECKSUM, batch_io.HEADER]
        os.ftruncate(fd, 2 * SLOT + 100)  # page 2 cut short
        r = _read(native, fd, pages, w)
        assert r.status[2] == batch_io.SHORT
    closed = os.open(tmp_path / "slab", os.O_RDONLY)
    os.close(closed)
    r = _read(native, closed, pages, w)
    assert list(r.status) == [-errno.EBADF] * 3
    ro = os.open(tmp_path / "slab", os.O_RDONLY)
    try:
        n = len(pages)
        bad = PageBatch(HL, [ro] * n, [0] * n, pages, [bytes(HL)] * n, ends=[bytes(HL)] * n,
                        end_offsets=[0] * n)
        assert native.write(bad, 0, n, True) == n
        assert list(bad.status) == [-errno.EBADF] * n
    finally:
        os.close(ro)


def test_out_of_range_shares_and_mismatched_lists_are_refused(native: batch_io.BatchIO,
                                                              buf: HostBuffer) -> None:
    pages = _pages(buf)
    empty = PageBatch(HL, [], [], [], [])
    assert native.read(empty, 0, 0) == 0 and native.write(empty, 0, 0, True) == 0  # nothing to move
    r = PageBatch(HL, [0, 0, 0], [0, 0, 0], pages, [bytes(HL)] * 3)
    with pytest.raises(ValueError, match="read of pages"):
        native.read(r, 0, 4)
    with pytest.raises(ValueError, match="write of pages"):
        native.write(r, 0, 3, True)  # a read batch has no end markers
    with pytest.raises(ValueError, match="differ in length"):
        PageBatch(HL, [0, 0], [0, 0, 0], pages, [bytes(HL)] * 3)
    with pytest.raises(ValueError, match="64 bytes"):
        PageBatch(HL, [0, 0, 0], [0, 0, 0], pages, [bytes(HL - 1)] * 3)


@pytest.mark.parametrize("writer_native, reader_native", [(True, False), (False, True)])
def test_native_and_python_paths_read_each_others_pages(tmp_path: Path, writer_native: bool,
                                                         reader_native: bool) -> None:
    """One slab format: pages written by either path are read back exactly by the other."""
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    keys = [f"x{i}" for i in range(40)]
    with open_connector("file", ns, root=str(tmp_path), native_io=writer_native) as w:
        pages = Pages(w, 16 << 10, len(keys))
        pages.fill(keys)
        assert w.batch_set(keys, pages.pages) == [True] * len(keys)
    with open_connector("file", ns, root=str(tmp_path), native_io=reader_native) as r:
        got = Pages(r, 16 << 10, len(keys))
        assert r.batch_get(keys, got.pages) == [True] * len(keys)
        assert all(got.matches(i, k) for i, k in enumerate(keys))


def test_header_struct_matches_the_library() -> None:
    """The C code patches the checksum at byte 24 of a start header (HL3_CSUM_AT)."""
    packed = START.pack(b"ABCD", 1, 0, 2, 3, 0x0102030405060708, bytes(16))
    assert struct.unpack_from("<Q", packed, 24)[0] == 0x0102030405060708
    assert f"HL3_CSUM_AT {24}" in Path(batch_io.__file__).parent.parent.joinpath(
        "native", "batch_io.c").read_text()


def test_stats_name_the_io_path(tmp_path: Path) -> None:
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    with open_connector("file", ns, root=str(tmp_path)) as conn:
        assert conn.stats()["engine"]["io_path"] == batch_io.describe()
    with open_connector("file", ns, root=str(tmp_path), native_io=False) as conn:
        assert conn.stats()["engine"]["io_path"] == "Python I/O"


_ONE_CALL_SCRIPT = r"""
import os, resource, signal, sys
from hicache_l3.common.memory import HostBuffer
from hicache_l3.slab import native as batch_io
from hicache_l3.slab.native import PageBatch
lib = batch_io.library()
buf = HostBuffer(4096)
buf.view()[:] = b"D" * 4096
page = ((buf.address, 4096),)
path, checksum = sys.argv[1], sys.argv[2] == "1"
fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 + 4096, 64 + 4096))  # room for header + data only
w = PageBatch(64, [fd], [0], [page], [bytes(64)], ends=[b"E" * 64], end_offsets=[64 + 4096])
lib.write(w, 0, 1, checksum)
print(w.status[0], os.fstat(fd).st_size)
"""


@pytest.mark.parametrize("checksum", [True, False])
def test_a_checksummed_write_is_one_call_in_file_order(tmp_path: Path, checksum: bool) -> None:
    """With a checksum and the end marker right after the data, header, data and marker go
    in one pwritev, in file order: a write cut short (here by RLIMIT_FSIZE) leaves header
    and data without the marker. Without a checksum the marker goes first, alone: cut
    short, nothing else is written."""
    out = subprocess.run([sys.executable, "-c", _ONE_CALL_SCRIPT, str(tmp_path / "slab"),
                          "1" if checksum else "0"], check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    status, size = map(int, out.stdout.split())
    if checksum:
        assert (status, size) == (batch_io.SHORT, 64 + 4096)
    else:
        assert (status, size) == (-errno.EFBIG, 0)


def test_marker_calls_report_each_marker(native: batch_io.BatchIO, tmp_path: Path) -> None:
    """write_markers / read_markers (the NIXL file transport's): one status per marker, a
    differing or cut-short marker and a bad descriptor reported for that marker only."""
    with open(tmp_path / "slab", "w+b") as f:
        fd = f.fileno()
        markers = [bytes([j + 1]) * HL for j in range(3)]
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
