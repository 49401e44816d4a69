"""The shared behavioural suite every connector runs (see :mod:`.suite`); the launchers of
the real engines it runs against live in :mod:`hicache_l3.engines`."""

from hicache_l3.conformance.suite import ConnectorTests, page_pattern

__all__ = ["ConnectorTests", "page_pattern"]
