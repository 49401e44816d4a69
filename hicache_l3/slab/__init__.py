"""The slab store: pages in preallocated, reused slab files, with an index every process
of a namespace can read (file, nixl file mode and hf3fs connectors). The face a connector
calls: :class:`~hicache_l3.slab.face.PageStore`.
"""
