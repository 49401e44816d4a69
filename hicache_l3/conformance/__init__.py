"""The shared behavioural suite every connector runs (see :mod:`.suite`), and the
launchers of the real engines it runs against (see :mod:`.engines`)."""

from hicache_l3.conformance.suite import ConnectorTests, page_pattern

__all__ = ["ConnectorTests", "page_pattern"]
