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

static void put_le16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static void put_le64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); } /* little-endian hosts only */

static void canonical128(hl3_xxh128 h, uint8_t *out) /* xxhash's xxh3_128_digest byte order */
{
    uint64_t hi = __builtin_bswap64(h.high64), lo = __builtin_bswap64(h.low64);
    memcpy(out, &hi, 8);
    memcpy(out + 8, &lo, 8);
}

/* The marker record (128 bytes, slab/format.py MARKER_RECORD: START "<4sHHQQQ16s16x" then
 * END "<4s4xQ16s32x") a slot holding generation gen, length and checksum for the key of
 * fingerprint fp carries. */
static void marker_record(uint8_t *r, uint64_t gen, uint64_t length, uint64_t csum, const uint8_t *fp)
{
    memset(r, 0, 128);
    memcpy(r, "HL3S", 4);
    put_le16(r + 4, 2); /* FORMAT_VERSION */
    put_le64(r + 8, gen);
    put_le64(r + 16, length);
    put_le64(r + 24, csum);
    memcpy(r + 32, fp, 16);
    memcpy(r + 64, "HL3E", 4);
    put_le64(r + 72, gen);
    memcpy(r + 80, fp, 16);
}

/* Everything a get batch needs before its I/O, in one call (slab/index.py SlabIndex.plan).
 * ``keys`` holds the batch's n keys, ASCII, each followed by one '\n' (valid page keys
 * never contain one: common/keys.py). Per key i: its digest (XXH3-128 with ``seed``) is
 * probed in the table; its fingerprint is XXH3-128 with seed 0 (= xxhash's unseeded
 * xxh3_128, common/integrity.key_fingerprint). code[i] is HL3_PLAN_MISS (not indexed),
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
    /* Pass 1: split the keys, hash them and prefetch their buckets; pass 2: probe. A batch
     * follows its data (megabytes) through the cache: probing right after hashing would
     * wait for one bucket's cache miss at a time. */
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
        const uint8_t *key = keys + pos;
        const uint8_t *nl = pos < keys_len ? memchr(key, '\n', keys_len - pos) : NULL;
        if (nl == NULL)
            goto done;
        at[i] = pos;
        pos += (size_t)(nl - key) + 1;
        canonical128(hash(key, (size_t)(nl - key), seed), digests + 16 * i);
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
        /* the slab of every indexed key (a batch's pages share few: look back at the distinct
         * ones seen so far): the caller opens each, and an unopenable one makes its keys
         * miss whatever else they are, as SlabIndex.lookup does */
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

/* The descriptor of every page of a get plan: fds[j] = by_slab[slab_of[where[j]]] for j <
 * count (hl3_pt_plan_get's where and slab_of, by_slab the descriptor Python opened for each
 * distinct slab); what a batch over several slabs would otherwise map page by page. */
void hl3_plan_fds(size_t count, const int32_t *where, const int32_t *slab_of, const int32_t *by_slab,
                  int32_t *fds)
{
    for (size_t j = 0; j < count; j++)
        fds[j] = by_slab[slab_of[where[j]]];
}
