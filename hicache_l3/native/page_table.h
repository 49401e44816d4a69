#ifndef HL3_PAGE_TABLE_H
#define HL3_PAGE_TABLE_H
/* The slab index's page table (hicache_l3/slab/table.py): key digest -> (writer, slab, slot,
 * generation, length, checksum), plus the slot inverse (writer, slab, slot) -> digest. Two
 * arrays of `cap` buckets, linear probing, backward-shift deletion, load <= 0.8; the areas
 * hold no pointers, so the same layout lives in a shared file mapping (table_image.c).
 *
 * Values cross the boundary as six uint64 per page, in Entry's order. A page with writer >=
 * 65535, slab or slot >= 2^24, generation >= 2^48 or length >= 2^32, or whose length would be
 * the 65536th distinct one, is refused (HL3_PT_BADVALUE) and nothing of the call is applied.
 * Invariant: the inverse is exactly the inverse of the page map.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#define HL3_PT_NOMEM (-1)
#define HL3_PT_BADVALUE (-2)
#define HL3_PT_BADIMAGE (-3) /* a table image that is not whole or not one this code writes */
#define HL3_PT_NOJOURNAL (-4) /* no journal, or one that lost a record */
#define HL3_PT_MIN_CAP 64
#define HL3_PT_MAX_CAP ((uint64_t)UINT32_MAX) /* the inverse holds 1 + a bucket index in 32 bits */
#define HL3_PT_WRITERS 65535                  /* writer + 1 fits in 16 bits */
#define HL3_PT_SLABS (1u << 24)
#define HL3_PT_SLOTS (1u << 24)
#define HL3_PT_GENS (1ULL << 48)
#define HL3_PT_CLASSES 65535                /* distinct lengths: a class fits in 16 bits */
#define HL3_PT_CLASS_HASH (1u << 17)        /* buckets of the length -> class hash (load <= 0.5) */
#define HL3_JOURNAL_WORDS 9
#define HL3_RECORD 48 /* an index log record's fixed part (slab/format.py RECORD) */
#define HL3_PUT 1

typedef struct {
    uint8_t digest[16];
    uint64_t checksum;
    uint64_t genlen;   /* generation << 16 | length class */
    uint64_t location; /* (writer + 1) << 48 | slab << 24 | slot; 0: a free bucket */
} hl3_page;

_Static_assert(sizeof(hl3_page) == 40, "page bucket layout");

typedef struct {
    uint64_t cap;      /* buckets in each of the two arrays */
    uint64_t len;      /* pages (= inverse entries) */
    uint64_t nclasses; /* distinct lengths seen */
    uint64_t expect;   /* buckets for the pages expected at most (hl3_pt_expect), 0: none */
    uint32_t lengths[HL3_PT_CLASSES + 1];  /* class -> length */
    uint16_t classes[HL3_PT_CLASS_HASH];   /* 1 + the class of a length, 0: free (never deleted) */
} hl3_header;

/* Puts and pops recorded since a snapshot, for hl3_pt_journal_replay. */
typedef struct hl3_journal {
    uint64_t *records; /* per change: kind (1 put, 2 pop), digest (2 words), 6 values */
    size_t n, cap;     /* records, and room for them */
    int failed;        /* a record could not be kept: the journal cannot be replayed */
} hl3_journal;

/* A process's handle: where the areas are mapped. With a base (a read-only table in a
 * shared file mapping under this delta), a base page whose bit is set in `dead` is removed;
 * no live base page has the digest or location of a delta page. */
typedef struct hl3_table hl3_table;
struct hl3_table {
    hl3_header *h;
    hl3_page *pages;
    uint32_t *inv;
    uint16_t *meta;   /* per inverse bucket: 8 bits of its location's hash | distance from home << 8 */
    hl3_table *base;
    uint64_t *dead;   /* one bit per base bucket */
    uint64_t ndead;
    void *map;        /* a base's own file mapping */
    size_t map_len;
    uint64_t refs;    /* a base's: the tables over it; freed at 0 */
    hl3_journal *journal; /* every put and pop, recorded while not NULL */
};

/* ---- hashing -------------------------------------------------------------------------- */

static inline uint64_t fmix64(uint64_t h) /* murmur3's finaliser */
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline size_t fastrange(uint64_t h, uint64_t cap)
{
    return (size_t)(((unsigned __int128)h * cap) >> 64);
}

static inline size_t page_home(const uint8_t *digest, uint64_t cap)
{
    uint64_t h;
    memcpy(&h, digest, 8); /* a digest is uniformly distributed already */
    return fastrange(h, cap);
}

static inline size_t inv_home(uint64_t location, uint64_t cap) { return fastrange(fmix64(location), cap); }

/* Low bits of the hash whose high bits place the location (independent of them). */
static inline uint8_t inv_tag(uint64_t location) { return (uint8_t)fmix64(location); }

#ifndef HL3_PT_FAR /* (tests build with a smaller one, to take the far path often) */
#define HL3_PT_FAR 255 /* an inverse entry this far from its home or more: its home is computed */
#endif

static inline uint16_t inv_meta(uint8_t tag, size_t home, size_t at, uint64_t cap)
{
    uint64_t d = at >= home ? at - home : at + cap - home;
    return (uint16_t)(tag | (d < HL3_PT_FAR ? d : HL3_PT_FAR) << 8);
}

static inline size_t next(size_t i, uint64_t cap) { return i + 1 == cap ? 0 : i + 1; }

/* Is ``k`` cyclically in (i, j]? */
static inline int between(size_t i, size_t k, size_t j)
{
    return i <= j ? (i < k && k <= j) : (k > i || k <= j);
}

/* ---- values --------------------------------------------------------------------------- */

static inline uint64_t pack_location(uint64_t w, uint64_t s, uint64_t sl)
{
    return (w + 1) << 48 | s << 24 | sl;
}

static inline int slot_in_range(uint64_t w, uint64_t s, uint64_t sl)
{
    return w < HL3_PT_WRITERS && s < HL3_PT_SLABS && sl < HL3_PT_SLOTS;
}

static inline int in_range(const uint64_t *v)
{
    return slot_in_range(v[0], v[1], v[2]) && v[3] < HL3_PT_GENS && v[4] <= UINT32_MAX;
}

static inline void unpack(const hl3_header *h, const hl3_page *p, uint64_t *v)
{
    v[0] = (p->location >> 48) - 1;
    v[1] = (p->location >> 24) & (HL3_PT_SLABS - 1);
    v[2] = p->location & (HL3_PT_SLOTS - 1);
    v[3] = p->genlen >> 16;
    v[4] = h->lengths[p->genlen & 0xFFFF];
    v[5] = p->checksum;
}

/* The bucket of ``length`` in the class hash: its class there, or the free bucket. */
static inline size_t class_bucket(const hl3_header *h, uint32_t length)
{
    size_t i = (size_t)(fmix64(length) & (HL3_PT_CLASS_HASH - 1));
    while (h->classes[i] != 0 && h->lengths[h->classes[i] - 1] != length)
        i = (i + 1) & (HL3_PT_CLASS_HASH - 1);
    return i;
}

static inline int alive(const hl3_table *t, size_t i) { return !(t->dead[i >> 6] >> (i & 63) & 1); }

static inline void kill(hl3_table *t, size_t i)
{
    t->dead[i >> 6] |= 1ULL << (i & 63);
    t->ndead++;
}

static inline void prefetch_page(const hl3_table *t, const uint8_t *digest)
{
    __builtin_prefetch(&t->pages[page_home(digest, t->h->cap)]);
    if (t->base != NULL)
        __builtin_prefetch(&t->base->pages[page_home(digest, t->base->h->cap)]);
}

static inline int fits(uint64_t pages, uint64_t cap) { return pages * 5 <= cap * 4; } /* load <= 0.8 */

static inline size_t dead_bytes(uint64_t cap) { return (cap + 63) / 64 * sizeof(uint64_t); }

/* ---- keys, digests and marker records (slab/format.py) -------------------------------- */

/* xxhash's XXH3_128bits_withSeed (the caller passes the wheel's entry point). */
typedef struct {
    uint64_t low64, high64;
} hl3_xxh128;
typedef hl3_xxh128 (*hl3_xxh128_fn)(const void *, size_t, uint64_t);

static inline void canonical128(hl3_xxh128 h, uint8_t *out) /* xxhash's xxh3_128_digest byte order */
{
    uint64_t hi = __builtin_bswap64(h.high64), lo = __builtin_bswap64(h.low64);
    memcpy(out, &hi, 8);
    memcpy(out + 8, &lo, 8);
}

/* The key at *pos of a buffer of '\n'-ended keys (its length in *len, *pos moved past its
 * '\n'), or NULL when no '\n' ends one there. */
static inline const uint8_t *next_key(const uint8_t *keys, size_t keys_len, size_t *pos, size_t *len)
{
    const uint8_t *key = keys + *pos;
    const uint8_t *nl = *pos < keys_len ? memchr(key, '\n', keys_len - *pos) : NULL;
    if (nl == NULL)
        return NULL;
    *len = (size_t)(nl - key);
    *pos += *len + 1;
    return key;
}

/* The 128-byte marker record (MARKER_RECORD: START "<4sHHQQQ16s16x", END "<4s4xQ16s32x",
 * little-endian hosts only) of a slot holding generation gen, length and checksum for the
 * key of fingerprint fp. */
static inline void marker_record(uint8_t *r, uint64_t gen, uint64_t length, uint64_t csum, const uint8_t *fp)
{
    uint16_t version = 2; /* FORMAT_VERSION */
    memset(r, 0, 128);
    memcpy(r, "HL3S", 4);
    memcpy(r + 4, &version, 2);
    memcpy(r + 8, &gen, 8);
    memcpy(r + 16, &length, 8);
    memcpy(r + 24, &csum, 8);
    memcpy(r + 32, fp, 16);
    memcpy(r + 64, "HL3E", 4);
    memcpy(r + 72, &gen, 8);
    memcpy(r + 80, fp, 16);
}

/* ---- calls shared by the table's files (hidden: not part of the library's interface) -- */

#define HL3_HIDDEN __attribute__((visibility("hidden")))
HL3_HIDDEN void *pt_map_zero(size_t bytes);
HL3_HIDDEN void *pt_map_dense(size_t bytes);
HL3_HIDDEN void pt_unmap(void *p, size_t bytes);
HL3_HIDDEN void pt_unmap_arrays(hl3_page *pages, uint32_t *inv, uint16_t *meta, uint64_t cap);
HL3_HIDDEN int pt_map_arrays(uint64_t cap, hl3_page **pages, uint32_t **inv, uint16_t **meta);
HL3_HIDDEN size_t pt_page_find(const hl3_table *t, const uint8_t *digest, int *found);
HL3_HIDDEN int pt_pop_one(hl3_table *t, const uint8_t *digest, uint64_t *v);
HL3_HIDDEN size_t pt_select_layer(const hl3_table *t, const hl3_table *layer, int64_t writer, int64_t slab,
                                  uint8_t *digests, uint64_t *values, size_t skip, size_t max);
HL3_HIDDEN void pt_free_base(hl3_table *b);
HL3_HIDDEN const hl3_page *pt_lookup(const hl3_table *t, const uint8_t *digest, const hl3_header **h);
HL3_HIDDEN const hl3_page *pt_page_at(const hl3_table *t, uint64_t location);
int hl3_pt_put_many(hl3_table *t, size_t n, const uint8_t *digests, const uint64_t *values);
void hl3_pt_free(hl3_table *t);
void hl3_pt_journal_stop(hl3_table *t);
void hl3_pt_journal_free(hl3_journal *j);
hl3_table *hl3_pt_new(void);
size_t hl3_pt_len(const hl3_table *t);
size_t hl3_pt_select(const hl3_table *t, int64_t writer, int64_t slab, uint8_t *digests, uint64_t *values, size_t max);
uint32_t hl3_crc32(const unsigned char *p, size_t n);

#endif
