"""Types of the optional C module built from hicache_l3/native/host_pages.c."""

import array

def model_pointers(
    address: int, n: int, page_tokens: int, divide: bool, limit: int, terms: bytes, /
) -> array.array[int] | None: ...
