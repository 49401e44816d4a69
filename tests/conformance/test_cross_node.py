"""Two nodes on one real distributed filesystem (GlusterFS, mounted twice: two FUSE
clients, each with its own page cache) for every connector whose store several nodes
share: the file connector (its C and its Python I/O paths), hf3fs in POSIX mode, nixl in
file mode (:class:`~hicache_l3.conformance.cross_node.CrossNodeTests`)."""

from __future__ import annotations

from typing import Any

from hicache_l3.conformance.cross_node import CrossNodeTests
from hicache_l3.slab.format import Geometry


class TestFileAcrossNodes(CrossNodeTests):
    connector_name = "file"

    def node_settings(self, root: str) -> dict[str, Any]:
        return {"root": root, "capacity_bytes": "256MiB", "slab_bytes": "8MiB"}


class TestHf3fsPosixAcrossNodes(CrossNodeTests):
    connector_name = "hf3fs"

    def node_settings(self, root: str) -> dict[str, Any]:
        return {"root": root, "capacity_bytes": "256MiB", "slab_bytes": "8MiB", "usrbio": "off",
                "max_writers": 4, "lease_s": 10.0}

    def capacity_settings(self, pages: int) -> dict[str, Any]:
        # hf3fs bounds each writer to capacity_bytes / max_writers
        return {"capacity_bytes": 4 * pages * Geometry(self.page_bytes).stride}


class TestNixlFileAcrossNodes(CrossNodeTests):
    connector_name = "nixl"

    def node_settings(self, root: str) -> dict[str, Any]:
        return {"mode": "file", "root": root, "capacity_bytes": "256MiB", "slab_bytes": "8MiB"}
