/* The plan of a get batch: everything it needs before its I/O, in one call. */
#include "page_table.h"

/* Geometry of a slot (slab/format.py Geometry.offsets), as the caller passes it. */
typedef struct {
    int64_t slot_bytes; /* every page's length (the namespace's page size) */
    int64_t shift;      /* log2(GROUP_SLOTS) */
    int64_t table;      /* bytes of a group's marker table */
    int64_t data_stride;
    int64_t span;       /* GROUP_SLOTS * data_stride */
    int64_t record;     /* RECORD_BYTES: one marker record (start header, then end marker) */
} hl3_geometry;

enum { HL3_PLAN_READ = 0, HL3_PLAN_MISS = 1, HL3_PLAN_SIZE = 2, HL3_PLAN_UNVERIFIED = 3 };

/* Everything a get batch needs before its I/O (slab/index.py SlabIndex.plan). ``keys``
 * holds the batch's n keys, each followed by one '\n'. Per key i: its digest (XXH3-128
 * with ``seed``) is probed in the table; its fingerprint is XXH3-128 with seed 0
 * (common/integrity.key_fingerprint). code[i] is HL3_PLAN_MISS (not indexed),
 * HL3_PLAN_SIZE (indexed with another length than g->slot_bytes), HL3_PLAN_UNVERIFIED
 * (``verified_only`` and the entry has no checksum) or HL3_PLAN_READ; for every indexed
 * key values[6 i ..] holds its entry (Entry's order). For the keys to read, packed in
 * order at position j (0.. the returned count): data_offs[j], marker_offs[j], expect[128 j
 * ..] (the marker record the slot must carry), csums[j] (the entry's checksum) and where[j]
 * (the index i of the key). slab_of[i]: for every indexed key, an index into ``slabs``, the
 * distinct (writer, slab) pairs of the indexed keys, 2 uint64 each, *nslabs of them (at
 * most n); -1 for a key not indexed.
 * Returns the number of pages to read, -1 when ``keys`` is not n '\n'-ended keys, -2
 * when out of memory (the caller takes its reference path then). */
long hl3_pt_plan_get(const hl3_table *t, size_t n, const uint8_t *keys, size_t keys_len,
                     uint64_t seed, hl3_xxh128_fn hash, const hl3_geometry *g, int verified_only,
                     uint64_t *values, int32_t *code, int64_t *data_offs, int64_t *marker_offs,
                     uint8_t *expect, uint64_t *csums, int32_t *where, int32_t *slab_of,
                     uint64_t *slabs, size_t *nslabs)
{
    /* pass 1: split the keys, hash them and prefetch their buckets; pass 2: probe */
    size_t *at = malloc((n + 1) * sizeof(size_t));
    uint8_t *digests = malloc(16 * (n ? n : 1));
    if (at == NULL || digests == NULL) {
        free(at);
        free(digests);
        return -2;
    }
    size_t pos = 0, read = 0, m = 0;
    long out = -1;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        at[i] = pos;
        const uint8_t *key = next_key(keys, keys_len, &pos, &len);
        if (key == NULL)
            goto done;
        canonical128(hash(key, len, seed), digests + 16 * i);
        prefetch_page(t, digests + 16 * i);
    }
    if (pos != keys_len)
        goto done;
    at[n] = pos;
    for (size_t i = 0; i < n; i++) {
        const hl3_header *h;
        const hl3_page *bucket = pt_lookup(t, digests + 16 * i, &h);
        if (bucket == NULL) {
            code[i] = HL3_PLAN_MISS;
            slab_of[i] = -1;
            continue;
        }
        uint64_t *p = values + 6 * i; /* its entry: writer, slab, slot, gen, length, checksum */
        unpack(h, bucket, p);
        /* the slab of every indexed key (a batch's share few: the last one, else a scan) */
        size_t k = m;
        if (m > 0 && slabs[2 * (m - 1)] == p[0] && slabs[2 * (m - 1) + 1] == p[1])
            k = m - 1;
        else
            for (k = 0; k < m; k++)
                if (slabs[2 * k] == p[0] && slabs[2 * k + 1] == p[1])
                    break;
        if (k == m) {
            slabs[2 * m] = p[0];
            slabs[2 * m + 1] = p[1];
            m++;
        }
        slab_of[i] = (int32_t)k;
        if ((int64_t)p[4] != g->slot_bytes) {
            code[i] = HL3_PLAN_SIZE;
            continue;
        }
        if (verified_only && p[5] == 0) {
            code[i] = HL3_PLAN_UNVERIFIED;
            continue;
        }
        code[i] = HL3_PLAN_READ;
        uint64_t s = p[2];
        data_offs[read] = (int64_t)(((s >> g->shift) + 1) * (uint64_t)g->table + s * (uint64_t)g->data_stride);
        marker_offs[read] = (int64_t)((s >> g->shift) * (uint64_t)g->span + s * (uint64_t)g->record);
        uint8_t fp[16];
        canonical128(hash(keys + at[i], at[i + 1] - at[i] - 1, 0), fp);
        marker_record(expect + 128 * read, p[3], p[4], p[5], fp);
        csums[read] = p[5];
        where[read] = (int32_t)i;
        read++;
    }
    *nslabs = m;
    out = (long)read;
done:
    free(at);
    free(digests);
    return out;
}

/* fds[j] = by_slab[slab_of[where[j]]] for j < count (hl3_pt_plan_get's where and slab_of;
 * by_slab: the descriptor opened for each distinct slab). */
void hl3_plan_fds(size_t count, const int32_t *where, const int32_t *slab_of, const int32_t *by_slab,
                  int32_t *fds)
{
    for (size_t j = 0; j < count; j++)
        fds[j] = by_slab[slab_of[where[j]]];
}
