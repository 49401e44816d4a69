"""One module per storage engine; import them through :mod:`hicache_l3.common.registry`."""
