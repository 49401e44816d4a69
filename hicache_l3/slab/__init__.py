"""The slab store: pages packed into preallocated, reused slab files, with an index that
every process of a namespace can read (file, nixl file mode and hf3fs connectors).

Modules, one job each:

* :mod:`~hicache_l3.slab.format`: on-disk slot geometry, header / marker / index record
  encodings, ``namespace.json``;
* :mod:`~hicache_l3.slab.files`: slab file paths and the cache of open descriptors;
* :mod:`~hicache_l3.slab.index`: the index every process reads (digest -> entry, unlogged pages);
* :mod:`~hicache_l3.slab.log_follow`: following every writer's log (tails, records applied);
* :mod:`~hicache_l3.slab.index_checkpoint`: the index's checkpoints, rebases and shared base;
* :mod:`~hicache_l3.slab.table`: the index's page table (key digest -> entry, C or dict);
* :mod:`~hicache_l3.slab.face`: the store's face, :class:`~hicache_l3.slab.face.PageStore`;
* :mod:`~hicache_l3.slab.store`: the writer (own slots, LRU, eviction, compaction);
* :mod:`~hicache_l3.slab.ownership`: owning a writer directory on one node (flock);
* :mod:`~hicache_l3.slab.shared`: the multi-node store (claims, leases, fencing);
* :mod:`~hicache_l3.slab.native`: the required C batch library, loaded lazily;
* :mod:`~hicache_l3.slab.io`: the slot-transport interface and its local transports;
* :mod:`~hicache_l3.slab.connector`: set/get orchestration written once, for every connector.
"""
