"""Heterogeneous TP for the SGLang adapter: with ``tp_lcm_size`` set and the ``page_head``
layout, every MHA page is stored as ``tp_lcm_size`` objects, one per head group (key plus
``@h<g>``, in a namespace of their own), so instances of different TP sizes share them.
Imports neither torch nor SGLang.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hicache_l3.common.errors import ConfigError

HEAD_LAYOUT = "page_head"


@dataclasses.dataclass(frozen=True)
class HeadGroups:
    """The head groups one rank stores per page: ``split`` groups of ``lcm`` per page,
    the first being group ``first``; key ``k`` of a page becomes ``k@h<g>`` per group."""

    lcm: int
    split: int
    first: int

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The key suffix of each of this rank's groups, in the order their pages come."""
        return tuple(f"@h{self.first + j}" for j in range(self.split))

    def keys(self, keys: Sequence[str]) -> list[str]:
        """One key per group of every page: page ``i``'s groups at ``[i * split, (i + 1) * split)``."""
        suffixes = self.suffixes
        if len(suffixes) == 1:
            return [k + suffixes[0] for k in keys]
        return [k + s for k in keys for s in suffixes]

    def fold(self, ok: Sequence[bool]) -> list[bool]:
        """Per-group results back to one per page: True when every group of the page is."""
        s = self.split
        if s == 1:
            return [bool(v) for v in ok]
        return [all(ok[i : i + s]) for i in range(0, len(ok), s)]

    def leading_pages(self, leading_groups: int) -> int:
        """Leading pages whose groups are all stored, from the leading stored groups."""
        return leading_groups // self.split


def groups_tag(tag: str, groups: HeadGroups) -> str:
    """The namespace tag of pages stored per head group: ``tag`` marked ``heads=<lcm>``."""
    return f"{tag}+heads={groups.lcm}" if tag else f"heads={groups.lcm}"


def head_groups(storage_config: Any, host: Any) -> HeadGroups | None:
    """This rank's head groups for MHA in the ``page_head`` layout with ``tp_lcm_size`` set,
    else None. ConfigError naming ``tp_lcm_size`` when it does not divide this rank's heads."""
    lcm = int(getattr(storage_config, "tp_lcm_size", None) or 0)
    if not lcm or storage_config.is_mla_model or str(getattr(host, "layout", "")) != HEAD_LAYOUT:
        return None
    tp_size, tp_rank = int(storage_config.tp_size or 1), int(storage_config.tp_rank or 0)
    if lcm % tp_size:
        raise ConfigError(f"hicache-l3: tp_lcm_size={lcm} is not a multiple of this instance's "
                          f"TP size {tp_size}; set it to the lcm of every TP size sharing the store")
    split = lcm // tp_size
    heads = int(getattr(host, "head_num", 0) or 0)
    if not heads or heads % split:
        raise ConfigError(f"hicache-l3: tp_lcm_size={lcm} splits this rank's {heads} KV heads "
                          f"(TP size {tp_size}) into {split} groups, which does not divide; "
                          "use a tp_lcm_size whose groups hold whole heads")
    return HeadGroups(lcm=lcm, split=split, first=tp_rank * split)


class SplitHeadsView:
    """A host pool whose ``get_page_buffer_meta`` is ``get_split_heads_page_buffer_meta``."""

    def __init__(self, host: Any, split: int) -> None:
        self.host, self.split = host, split

    def get_page_buffer_meta(self, indices: Any) -> Any:
        """The pool's segments of every page's head groups."""
        return self.host.get_split_heads_page_buffer_meta(indices, self.split)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.host, name)
