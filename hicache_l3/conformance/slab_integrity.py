"""Integrity tests every slab-store connector runs (file, hf3fs, nixl file mode): damage
at rest, faults and hostile entries in the store's own files. Mix
:class:`SlabIntegrityTests` into a :class:`~hicache_l3.conformance.suite.ConnectorTests`
subclass; its ``settings`` must hold the store's ``root`` and accept ``checksum`` and
``slab_bytes``.
"""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance.pages import Pages, store_pages
from hicache_l3.conformance.slab_backdoor import SlabBackdoor, live_entries
from hicache_l3.slab.files import slab_file_name
from hicache_l3.slab.format import NAMESPACE_FILE, RECORD, Geometry, decode_records


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` with its holes left holes (a slab is mostly unwritten)."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        size = os.fstat(fin.fileno()).st_size
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole is left
                break
            end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
            fout.seek(start)
            fout.write(os.pread(fin.fileno(), end - start, start))
            pos = end
        fout.truncate(size)


def json_format(settings: dict[str, Any], namespace: Namespace) -> int:
    """The on-disk format the namespace's ``namespace.json`` says."""
    path = Path(settings["root"]) / f"ns-{namespace.digest()}" / NAMESPACE_FILE
    return int(json.loads(path.read_text())["format"])


def _writers(settings: dict[str, Any], namespace: Namespace) -> Path:
    return Path(settings["root"]) / f"ns-{namespace.digest()}" / "writers"


class SlabIntegrityTests(SlabBackdoor):
    """The slab store's integrity promises, run against the connector under test."""

    page_bytes: int

    def _stored(self, conn: Any, keys: list[str]) -> Pages:
        return store_pages(conn, self.page_bytes, keys)

    def _stored_and_closed(self, open_conn: Any, settings: dict[str, Any], namespace: Namespace,
                           keys: list[str]) -> Path:
        """Store ``keys`` with a writer that then closes; that writer's directory."""
        writer = open_conn()
        self._stored(writer, keys)
        me = writer.stats()["engine"]["writer"]
        writer.close()
        return _writers(settings, namespace) / f"w{me:04d}"

    def _read(self, conn: Any, keys: list[str]) -> tuple[list[bool], Pages]:
        pages = Pages(conn, self.page_bytes, len(keys))
        return conn.batch_get(keys, pages.pages), pages

    def test_small_pages_are_packed_and_read_back_whole(self, open_conn: Any,
                                                         settings: dict[str, Any]) -> None:
        """Small pages are packed (format 3) and read back exactly, by the writer and another
        connector; a flipped byte misses that page only, not its block's neighbours."""
        small = Namespace(model="m-packed", kv_dtype="bfloat16", layout="page_first", page_size=1)
        keys = [f"packed-{i}" for i in range(600)]  # a group is 512 slots
        writer = open_conn(small)
        store_pages(writer, 256, keys)
        assert json_format(settings, small) == 3
        for conn in (writer, open_conn(small)):
            back = Pages(conn, 256, len(keys))
            assert conn.batch_get(keys, back.pages) == [True] * len(keys)
            assert back.holds(keys)
        if not writer.capabilities.detects_corruption:
            return
        self.backdoor_corrupt(settings, small, keys[300], "flip")
        reader = open_conn(small)
        back = Pages(reader, 256, 3)
        assert reader.batch_get(keys[299:302], back.pages) == [True, False, True]
        assert back.matches(0, keys[299]) and back.matches(2, keys[301])

    def test_corrupt_unchecksummed_page_is_a_miss_for_a_checksumming_reader(
            self, open_conn: Any, settings: dict[str, Any], namespace: Namespace) -> None:
        """A page stored without a checksum is an ``unverified`` miss for a checksumming
        reader (flipped bit or not), which then stores it again, checksummed."""
        writer = open_conn(checksum="none")
        reader = open_conn(checksum="xxh3")
        assert reader.capabilities.detects_corruption
        keys = ["plain-0", "plain-1"]
        self._stored(writer, keys)
        self.backdoor_corrupt(settings, namespace, keys[0], "flip")
        got, _ = self._read(reader, keys)
        assert got == [False, False]
        assert reader.stats()["ops"]["get"]["failed"] == {"unverified": 2}
        assert reader.batch_exists(keys) == [False, False]
        self._stored(reader, keys)
        got, back = self._read(reader, keys)
        assert got == [True, True] and back.holds(keys)

    def test_hostile_stray_entry_under_writers_is_ignored(self, open_conn: Any,
                                                         settings: dict[str, Any],
                                                         namespace: Namespace) -> None:
        """A file named like a writer directory (and junk) never fails a call or hides a page."""
        keys = [f"stray-{i}" for i in range(4)]
        self._stored(open_conn(), keys)
        writers = _writers(settings, namespace)
        (writers / "w0003").write_bytes(b"not a directory")
        (writers / "junk.txt").write_bytes(b"junk")
        reader = open_conn()
        got, pages = self._read(reader, keys)
        assert got == [True] * 4 and pages.holds(keys)
        assert reader.batch_exists(keys) == [True] * 4
        other = ["stray-new-0", "stray-new-1"]
        self._stored(reader, other)  # a new writer directory is found past the stray file
        assert open_conn().batch_exists(other) == [True, True]

    def test_fault_missing_slab_file_misses_only_its_keys(self, open_conn: Any,
                                                         settings: dict[str, Any],
                                                         namespace: Namespace) -> None:
        """A slab file gone: its keys miss and stop existing, other slabs' keys still read,
        and a later set stores the lost keys again."""
        stride = Geometry(self.page_bytes).stride
        keys = [f"slab-{i}" for i in range(4)]
        writer = open_conn(slab_bytes=2 * stride)
        self._stored(writer, keys)
        entries = live_entries(Path(settings["root"]), namespace)
        lost = [k for k in keys if entries[k][1] == 1]
        assert len(lost) == 2
        w = entries[lost[0]][0]
        os.unlink(_writers(settings, namespace) / f"w{w:04d}"
                  / slab_file_name(1, Geometry(self.page_bytes).packed))
        reader = open_conn(slab_bytes=2 * stride)
        expect = [k not in lost for k in keys]
        got, back = self._read(reader, keys)
        assert got == expect
        assert all(back.matches(i, k) for i, k in enumerate(keys) if expect[i])
        assert reader.batch_exists(keys) == expect
        self._stored(reader, lost)
        got, back = self._read(open_conn(), keys)
        assert got == [True] * 4 and back.holds(keys)

    @pytest.mark.parametrize("damage", [b"", b"{not json", b"[]"], ids=["empty", "garbled", "list"])
    def test_corrupt_namespace_file_is_rebuilt(self, open_conn: Any, settings: dict[str, Any],
                                               namespace: Namespace, damage: bytes) -> None:
        """namespace.json is derivable: damaged, it is rebuilt and no page is lost."""
        keys = ["nsf-0", "nsf-1"]
        self._stored(open_conn(), keys)
        path = _writers(settings, namespace).parent / NAMESPACE_FILE
        path.write_bytes(damage)
        reader = open_conn()
        got, back = self._read(reader, keys)
        assert got == [True, True] and back.holds(keys)
        writer = open_conn()
        self._stored(writer, ["nsf-2"])
        assert '"slot_bytes"' in path.read_text()

    def test_torn_slot_after_crash_is_dropped_from_the_index(self, open_conn: Any,
                                                            settings: dict[str, Any],
                                                            namespace: Namespace) -> None:
        """A slot rewritten without a log record (a crash mid-eviction) is a miss that
        corrects exists; a later set stores the key again."""
        keys = ["evicted-0", "evicted-1"]
        self._stored(open_conn(), keys)
        reader = open_conn()
        assert reader.batch_exists(keys) == [True, True]
        self.backdoor_corrupt(settings, namespace, keys[1], "truncate")
        got, _ = self._read(reader, keys)
        assert got == [True, False]
        assert reader.batch_exists(keys) == [True, False]
        self._stored(reader, keys[1:])
        got, back = self._read(open_conn(), keys)
        assert got == [True, True] and back.holds(keys)

    def test_writer_whose_log_appears_after_the_scan_is_seen(self, open_conn: Any,
                                                             settings: dict[str, Any],
                                                             namespace: Namespace) -> None:
        """A reader that listed writers/ while a writer directory had no index.log yet sees
        that writer's pages on its next call."""
        first = open_conn()
        self._stored(first, ["early"])
        reader = open_conn()
        assert reader.batch_exists(["early"]) == [True]
        taken = {int(p.name[1:]) for p in _writers(settings, namespace).iterdir()}
        (_writers(settings, namespace) / f"w{max(taken) + 1:04d}").mkdir()
        assert reader.batch_exists(["late"]) == [False]  # lists the new, empty directory
        self._stored(open_conn(), ["late"])  # adopts that directory, creating its log
        assert reader.batch_exists(["late"]) == [True]

    def test_corrupt_index_record_loses_only_itself(self, open_conn: Any, settings: dict[str, Any],
                                                    namespace: Namespace) -> None:
        """A flipped bit in index.log loses that record only, adoption keeps the rest, and a
        torn tail is moved aside (index.log.damaged-N), not destroyed."""
        keys = [f"rec-{i}" for i in range(4)]
        wdir = self._stored_and_closed(open_conn, settings, namespace, keys)
        log = wdir / "index.log"
        data = bytearray(log.read_bytes())
        records, _, _ = decode_records(bytes(data))
        pos = 0
        for _, key, _ in records:
            if key == keys[1]:
                data[pos + RECORD.size + 2] ^= 0x40  # a bit of the key: the CRC no longer holds
                break
            pos += RECORD.size + len(key)
        data += b"\x07" * 30  # and a torn tail
        log.write_bytes(bytes(data))
        expect = [True, False, True, True]
        assert open_conn().batch_exists(keys) == expect
        adopter = open_conn()
        self._stored(adopter, ["after-adoption"])
        assert adopter.stats()["engine"]["writer"] == int(wdir.name[1:])  # it adopted the damaged log
        aside = list(log.parent.glob("index.log.damaged-*"))
        assert len(aside) == 1 and aside[0].read_bytes() == b"\x07" * 30
        got, _ = self._read(open_conn(), [*keys, "after-adoption"])
        assert got == [*expect, True]

    def test_hostile_symlinked_slab_file_is_not_followed(self, open_conn: Any,
                                                        settings: dict[str, Any],
                                                        namespace: Namespace,
                                                        tmp_path: Path) -> None:
        """A slab file replaced by a symlink (to a copy of itself) is a miss for readers,
        and an adopting writer never writes through it."""
        keys = [f"link-{i}" for i in range(3)]
        slab = (self._stored_and_closed(open_conn, settings, namespace, keys)
                / slab_file_name(0, Geometry(self.page_bytes).packed))
        victim = tmp_path / "victim.dat"
        _sparse_copy(slab, victim)
        assert filecmp.cmp(slab, victim, shallow=False)
        before = victim.read_bytes()
        slab.unlink()
        slab.symlink_to(victim)
        reader = open_conn()
        got, _ = self._read(reader, keys)
        assert got == [False] * 3
        adopter = open_conn()
        self._stored(adopter, keys)
        got, back = self._read(open_conn(), keys)
        assert got == [True] * 3 and back.holds(keys)
        assert victim.read_bytes() == before

    def test_hostile_symlinked_index_log_is_not_followed(self, open_conn: Any,
                                                        settings: dict[str, Any],
                                                        namespace: Namespace,
                                                        tmp_path: Path) -> None:
        """An index.log replaced by a symlink: that writer is skipped (no error), and no
        writer appends to or truncates its target."""
        log = self._stored_and_closed(open_conn, settings, namespace, ["log-0"]) / "index.log"
        outside = tmp_path / "outside.log"
        outside.write_bytes(log.read_bytes() + b"\x07" * 9)  # a torn tail adoption would cut
        before = outside.read_bytes()
        log.unlink()
        log.symlink_to(outside)
        reader = open_conn()
        assert reader.batch_exists(["log-0"]) == [False]
        self._stored(open_conn(), ["log-1"])
        assert open_conn().batch_exists(["log-0", "log-1"]) == [False, True]
        assert outside.read_bytes() == before

    def test_hostile_umask_files_are_private(self, open_conn: Any, settings: dict[str, Any],
                                             namespace: Namespace) -> None:
        """Under umask 022 every directory the store creates is 0700 and every file 0600."""
        old = os.umask(0o022)
        try:
            conn = open_conn()
            self._stored(conn, ["mode-0"])
            assert conn.delete(["mode-0"]) == [True]
            conn.close()
        finally:
            os.umask(old)
        nsdir = _writers(settings, namespace).parent
        for path in [nsdir, *nsdir.rglob("*")]:
            mode = path.lstat().st_mode & 0o777
            assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {oct(mode)}"
