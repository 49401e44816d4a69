"""Everything the connectors share: the contract, memory, keys, config, metrics, slabs."""
