/* The eviction take of the slab store's writer (hicache_l3/slab/evict.py): the pages of a
 * run of slots of one slab removed from the page table in one call, exactly as
 * SlabIndex's take_at_many of those slots. */
#include <stddef.h>
#include <stdint.h>

int hl3_pt_take_at(void *t, uint64_t w, uint64_t s, uint64_t sl, uint8_t *digest, uint64_t *v);

/* Remove the pages in slots first .. first + n - 1 of (writer, slab): their digests land
 * at digests + 16 k and their entries (Entry's order) at values + 6 k for k = 0.. in slot
 * order, slots without a page skipped; returns how many there were. */
size_t hl3_pt_take_run(void *t, uint64_t writer, uint64_t slab, uint64_t first, size_t n,
                       uint8_t *digests, uint64_t *values)
{
    size_t hits = 0;
    for (size_t i = 0; i < n; i++)
        if (hl3_pt_take_at(t, writer, slab, first + i, digests + 16 * hits, values + 6 * hits))
            hits++;
    return hits;
}
