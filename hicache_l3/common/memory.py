"""Host memory regions, page-aligned host buffers, and the table of registered regions."""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import mmap
import threading
from collections.abc import Sequence
from typing import Any

from hicache_l3.common.errors import MemoryRegistrationError
from hicache_l3.common.pages import Page

PAGE_ALIGN = mmap.PAGESIZE


@dataclasses.dataclass(frozen=True, eq=False)
class MemoryRegion:
    """``size`` bytes of host memory at ``address``; ``owner`` keeps the memory alive."""

    address: int
    size: int
    owner: Any = None
    pinned: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise MemoryRegistrationError(f"memory region size must be > 0, got {self.size}")
        if self.address <= 0:
            raise MemoryRegistrationError(f"memory region address must be > 0, got {self.address}")

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.address + self.size

    @classmethod
    def from_buffer(cls, buf: Any, name: str = "") -> MemoryRegion:
        """Wrap any writable buffer-protocol object (bytearray, mmap, numpy array...)."""
        view = memoryview(buf).cast("B")
        if view.readonly:
            raise MemoryRegistrationError("memory region buffer must be writable")
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        return cls(address, view.nbytes, owner=(buf, view), name=name)

    @classmethod
    def from_tensor(cls, tensor: Any, name: str = "") -> MemoryRegion:
        """Wrap a contiguous CPU torch tensor (e.g. SGLang's ``kv_buffer``)."""
        if tensor.device.type != "cpu":
            raise MemoryRegistrationError(f"tensor must live in host memory, not {tensor.device}")
        if not tensor.is_contiguous():
            raise MemoryRegistrationError("tensor must be contiguous to register as one region")
        size = tensor.numel() * tensor.element_size()
        return cls(tensor.data_ptr(), size, owner=tensor, pinned=tensor.is_pinned(), name=name)

    def view(self) -> memoryview:
        """A writable byte view of the whole region (no copy)."""
        arr = (ctypes.c_char * self.size).from_address(self.address)
        return memoryview(arr).cast("B")

    def contains(self, address: int, length: int) -> bool:
        """True when ``[address, address + length)`` lies inside this region."""
        return self.address <= address and address + length <= self.end


class HostBuffer(MemoryRegion):
    """A page-aligned host buffer of ``size`` bytes. ``pin=None`` pins through torch when
    CUDA is available (``pin=True`` requires it); ``touch=True`` faults every page in now."""

    def __init__(self, size: int, *, pin: bool | None = None, touch: bool = True, name: str = ""):
        if size <= 0:
            raise MemoryRegistrationError(f"host buffer size must be > 0, got {size}")
        owner: Any
        pinned = False
        if pin is None or pin:
            owner = _pinned_tensor(size, required=bool(pin))
            pinned = owner is not None
        if not pinned:
            owner = mmap.mmap(-1, _round_up(size, PAGE_ALIGN))
        address = owner.data_ptr() if pinned else ctypes.addressof(ctypes.c_char.from_buffer(owner))
        super().__init__(address, size, owner=owner, pinned=pinned, name=name)
        if touch:
            self.touch()

    def touch(self) -> None:
        """Write one byte per OS page so that every page is faulted in."""
        view = self.view()
        view[::PAGE_ALIGN] = bytes(len(range(0, self.size, PAGE_ALIGN)))
        view.release()


def _pinned_tensor(size: int, required: bool) -> Any:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    except ImportError:
        pass
    if required:
        raise MemoryRegistrationError("pin=True needs torch with CUDA; use pin=None")
    return None


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class RegionTable:
    """The non-overlapping regions registered with one connector. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._regions: list[MemoryRegion] = []
        self._views: list[memoryview] = []

    def __len__(self) -> int:
        return len(self._regions)

    def __iter__(self) -> Any:
        return iter(list(self._regions))

    def add(self, region: MemoryRegion) -> bool:
        """Add ``region``; False if that exact region is already there; raises on overlap."""
        with self._lock:
            i = bisect.bisect_right(self._starts, region.address)
            if i > 0 and self._regions[i - 1].address == region.address and (
                self._regions[i - 1].size == region.size
            ):
                return False
            prev_end = self._regions[i - 1].end if i > 0 else 0
            next_start = self._starts[i] if i < len(self._starts) else 1 << 64
            if region.address < prev_end or region.end > next_start:
                raise MemoryRegistrationError(
                    f"region [{region.address:#x}, +{region.size}) overlaps a registered region"
                )
            starts, regions, views = list(self._starts), list(self._regions), list(self._views)
            starts.insert(i, region.address)
            regions.insert(i, region)
            views.insert(i, region.view())
            self._starts, self._regions, self._views = starts, regions, views
            return True

    def remove(self, region: MemoryRegion) -> bool:
        """Remove a region added before; False when it was not there."""
        with self._lock:
            for i, r in enumerate(self._regions):
                if r.address == region.address and r.size == region.size:
                    self._starts = self._starts[:i] + self._starts[i + 1 :]
                    self._regions = self._regions[:i] + self._regions[i + 1 :]
                    self._views = self._views[:i] + self._views[i + 1 :]
                    return True
            return False

    def find(self, address: int, length: int) -> MemoryRegion | None:
        """The region holding ``[address, address + length)``, or None."""
        starts, regions = self._starts, self._regions  # one consistent snapshot
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and length >= 0 and address + length <= regions[i].end:
            return regions[i]
        return None

    def covers(self, page: Page) -> bool:
        """True when every segment of ``page`` lies inside a registered region."""
        starts, regions = self._starts, self._regions
        for address, length in page:
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or length <= 0 or address + length > regions[i].end:
                return False
        return True

    def batch_views(self, pages: Sequence[Page]) -> list[list[memoryview]] | None:
        """Views of every page when all their segments lie in one region; else None."""
        if not pages or not pages[0]:
            return None
        starts, regions, views = self._starts, self._regions, self._views
        i = bisect.bisect_right(starts, pages[0][0][0]) - 1
        if i < 0:
            return None
        region, view, base = regions[i], views[i], starts[i]
        try:
            low = min(a for page in pages for a, _ in page)
            high = max(a + n for page in pages for a, n in page)
            if low < base or high > region.end or min(n for page in pages for _, n in page) <= 0:
                return None
        except ValueError:  # an empty page
            return None
        return [[view[a - base : a - base + n] for a, n in page] for page in pages]

    def views(self, page: Page) -> list[memoryview] | None:
        """Memoryviews over the page's segments (no copy), or None if any is unregistered."""
        starts, regions, views = self._starts, self._regions, self._views
        out = []
        for address, length in page:
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or length <= 0:
                return None
            offset = address - starts[i]
            if offset + length > regions[i].size:
                return None
            out.append(views[i][offset : offset + length])
        return out
