"""The nixl connector: pages moved by NIXL agents, in one of two modes (``mode``):

* ``file`` (:mod:`.file`): NIXL's POSIX plugin on the shared slab store;
* ``obj`` (:mod:`.obj`): NIXL's OBJ plugin, one S3 object per page.

:mod:`.base` holds what both share (settings, the agent, transfers) and imports neither
mode; :func:`open_nixl_connector` (the registry's target) picks the mode. The NIXL package
itself is imported only when a connector opens.
"""

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
