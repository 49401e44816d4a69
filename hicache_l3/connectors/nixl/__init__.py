"""The nixl connector: pages moved by NIXL agents, ``mode`` ``file`` (POSIX plugin on the
slab store) or ``obj`` (OBJ plugin, one S3 object per page)."""

from __future__ import annotations

from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.keys import Namespace
from hicache_l3.connectors.nixl.base import NixlConfig, NixlConnector

__all__ = ["NixlConfig", "NixlConnector", "open_nixl_connector"]


def open_nixl_connector(settings: dict[str, Any], namespace: Namespace) -> Connector[Any]:
    """Build the settings and open the connector of their ``mode`` (file or obj)."""
    config = NixlConfig.load(NixlConnector.name, settings)
    if config.mode == "obj":
        from hicache_l3.connectors.nixl.obj import NixlObjConnector

        return NixlObjConnector(config, namespace)
    from hicache_l3.connectors.nixl.file import NixlFileConnector

    return NixlFileConnector(config, namespace)
