"""hicache-l3: L3 KV-cache storage connectors for SGLang HiCache.

One page-batch contract (:class:`~hicache_l3.common.connector.Connector`) over files,
Mooncake Store, NIXL and 3FS. Open a connector by name with :func:`open_connector`; add
one of your own with :func:`register_connector` or the ``hicache_l3.connectors`` entry-point
group (docs/connectors.md, "Writing a connector").
"""

from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import (
    ConfigError,
    ConnectorClosedError,
    EngineUnavailableError,
    HiCacheL3Error,
    Reason,
)
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer, MemoryRegion
from hicache_l3.common.registry import available_connectors, open_connector, register_connector

__version__ = "0.1.0"

__all__ = [
    "Capabilities",
    "ConfigError",
    "Connector",
    "ConnectorClosedError",
    "EngineUnavailableError",
    "HiCacheL3Error",
    "HostBuffer",
    "MemoryRegion",
    "Namespace",
    "Reason",
    "available_connectors",
    "open_connector",
    "register_connector",
]
