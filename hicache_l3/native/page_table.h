#ifndef HL3_PAGE_TABLE_H
#define HL3_PAGE_TABLE_H
/* The slab index's page table: key digest -> (writer, slab, slot, generation, length,
 * checksum), plus the slot inverse (writer, slab, slot) -> digest. Loaded with
 * ctypes.PyDLL (the GIL stays held: every call is short, and the caller's Python threads
 * see each call as atomic, as they saw dict operations): see hicache_l3/slab/table.py.
 * The table's code is in page_table.c, the scan of an index log in log_scan.c, the plan of
 * a get batch in get_plan.c, a table's file image and the base layer in table_image.c.
 *
 * Layout (docs/architecture.md, "Compact bucket"): a header (counts, capacity, length
 * classes) and two arrays of `cap` buckets, home bucket (hash * cap) >> 64, linear probing,
 * backward-shift deletion, rebuilt 1.5 times larger before the load exceeds 0.8: 40-byte
 * page buckets keyed by digest (location 0: free) and a u32 slot inverse with 16 bits a
 * bucket beside it (a hash byte, the distance from home). Every move of a page bucket
 * updates its inverse bucket. The areas are anonymous private mappings that hold no
 * pointers (all-zero is empty), so the same layout also lives in a shared file mapping.
 *
 * Values cross the boundary as six uint64 per page, in Entry's order: writer, slab, slot,
 * generation, length, checksum. A page with writer >= 65535, slab or slot >= 2^24,
 * generation >= 2^48 or length >= 2^32, or whose length would be the 65536th distinct
 * length the table has seen, is refused (HL3_PT_BADVALUE): nothing of the call is
 * applied. A length class, once seen, stays (a namespace has one page size).
 *
 * Invariant: the inverse is exactly the inverse of the page map. Putting digest D at slot
 * W removes the page another digest had at W, and D's former slot from the inverse.
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
#define HL3_PT_MIN_CAP 64
#define HL3_PT_MAX_CAP ((uint64_t)UINT32_MAX) /* the inverse holds 1 + a bucket index in 32 bits */
#define HL3_PT_WRITERS 65535                  /* writer + 1 fits in 16 bits */
#define HL3_PT_SLABS (1u << 24)
#define HL3_PT_SLOTS (1u << 24)
#define HL3_PT_GENS (1ULL << 48)
#define HL3_PT_CLASSES 65535                /* distinct lengths: a class fits in 16 bits */
#define HL3_PT_CLASS_HASH (1u << 17)        /* buckets of the length -> class hash (load <= 0.5) */

typedef struct {
    uint8_t digest[16];
    uint64_t checksum;
    uint64_t genlen;   /* generation << 16 | length class */
    uint64_t location; /* (writer + 1) << 48 | slab << 24 | slot; 0: a free bucket */
} hl3_page;            /* 40 bytes */

typedef struct {
    uint64_t cap;      /* buckets in each of the two arrays */
    uint64_t len;      /* pages (= inverse entries) */
    uint64_t nclasses; /* distinct lengths seen */
    uint64_t expect;   /* buckets for the pages expected at most (hl3_pt_expect), 0: none */
    uint32_t lengths[HL3_PT_CLASSES + 1];  /* class -> length */
    uint16_t classes[HL3_PT_CLASS_HASH];   /* 1 + the class of a length, 0: free (linear probing, never deleted) */
} hl3_header;

typedef struct hl3_table hl3_table;
struct hl3_table { /* this process's handle: where the four areas are mapped */
    hl3_header *h;
    hl3_page *pages;
    uint32_t *inv;
    uint16_t *meta; /* per inverse bucket: a tag (8 bits of its location's hash: probes skip
                     * others) | its distance from its home bucket << 8 (HL3_PT_FAR: as far or more) */
    /* Two layers (hl3_pt_attach, hl3_pt_rebase): ``base``, a read-only table in a shared
     * file mapping, under this table's own arrays (the delta). A base page whose bit is set
     * in ``dead`` is removed here. Invariant: no live base page has the digest or the
     * location of a delta page (a put kills them), so each lookup answers from one layer. */
    hl3_table *base;
    uint64_t *dead;   /* one bit per base bucket */
    uint64_t ndead;
    void *map;        /* a base's own handle: its file mapping */
    size_t map_len;
    uint64_t refs;    /* a base's: the tables over it (hl3_pt_fork shares it); freed at 0 */
    struct hl3_journal *journal; /* every put and pop, recorded while not NULL (hl3_pt_journal_start) */
};

/* A record of the changes made to a table since a snapshot of it, replayed later onto
 * another table that holds that snapshot (hl3_pt_journal_replay): what lets a table move
 * onto a checkpoint built off the lock, holding the lock only for the changes since. */
typedef struct hl3_journal {
    uint64_t *records; /* per change: kind (1 put, 2 pop), digest (2 words), 6 values */
    size_t n, cap;     /* records, and room for them */
    int failed;        /* a record could not be kept: the journal cannot be replayed */
} hl3_journal;

#define HL3_JOURNAL_WORDS 9
#define HL3_PT_NOJOURNAL (-4) /* no journal, or one that lost a record */

_Static_assert(sizeof(hl3_page) == 40, "page bucket layout");

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

/* Is ``k`` cyclically in (i, j]? (any capacity: indices are in [0, cap)) */
static inline int between(size_t i, size_t k, size_t j)
{
    return i <= j ? (i < k && k <= j) : (k > i || k <= j);
}

/* ---- values --------------------------------------------------------------------------- */

static inline uint64_t pack_location(uint64_t w, uint64_t s, uint64_t sl)
{
    return (w + 1) << 48 | s << 24 | sl;
}

static inline int in_range(const uint64_t *v)
{
    return v[0] < HL3_PT_WRITERS && v[1] < HL3_PT_SLABS && v[2] < HL3_PT_SLOTS && v[3] < HL3_PT_GENS
           && v[4] <= UINT32_MAX;
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

/* Shared by the page table's files (hidden: not part of the library's interface). */
#define HL3_HIDDEN __attribute__((visibility("hidden")))
HL3_HIDDEN void *pt_map_zero(size_t bytes);
HL3_HIDDEN void *pt_map_dense(size_t bytes);
HL3_HIDDEN void pt_unmap(void *p, size_t bytes);
HL3_HIDDEN void pt_unmap_arrays(hl3_page *pages, uint32_t *inv, uint16_t *meta, uint64_t cap);
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
hl3_table *hl3_pt_new(void);
size_t hl3_pt_len(const hl3_table *t);
size_t hl3_pt_select(const hl3_table *t, int64_t writer, int64_t slab, uint8_t *digests, uint64_t *values, size_t max);

/* The xxhash library's XXH3_128bits_withSeed (the caller passes it, as for batch_io.c). */
typedef struct {
    uint64_t low64, high64;
} hl3_xxh128;
typedef hl3_xxh128 (*hl3_xxh128_fn)(const void *, size_t, uint64_t);

#endif
