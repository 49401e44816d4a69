/* The slab index's page table: key digest -> (writer, slab, slot, generation, length,
 * checksum), plus the slot inverse (writer, slab, slot) -> digest. Loaded with
 * ctypes.PyDLL (the GIL stays held: every call is short, and the caller's Python threads
 * see each call as atomic, as they saw dict operations): see hicache_l3/slab/table.py,
 * which keeps a dict-backed table as the reference and the fallback when this library is
 * not built.
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

/* ---- mappings ------------------------------------------------------------------------- */

static size_t mapped(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

static void *map_zero(size_t bytes)
{
    void *p = mmap(NULL, mapped(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* map_zero for an array that is filled whole at once (a copy, a rebuild): big ones asked
 * for transparent huge pages (a no-op where THP is off), so that making one takes a fault
 * per 2 MiB instead of per 4 KiB -- most of a snapshot's time under the lock -- and
 * random probes into it miss the TLB less. Small ones, and sparse ones, stay 4 KiB paged:
 * a huge page would make their untouched parts resident. */
#define HL3_HUGE_MIN (8u << 20)
static void *map_dense(size_t bytes)
{
    void *p = map_zero(bytes);
#ifdef MADV_HUGEPAGE
    if (p != NULL && bytes >= HL3_HUGE_MIN)
        (void)madvise(p, mapped(bytes), MADV_HUGEPAGE);
#endif
    return p;
}

static void unmap(void *p, size_t bytes)
{
    if (p != NULL)
        munmap(p, mapped(bytes));
}

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

static void unpack(const hl3_header *h, const hl3_page *p, uint64_t *v)
{
    v[0] = (p->location >> 48) - 1;
    v[1] = (p->location >> 24) & (HL3_PT_SLABS - 1);
    v[2] = p->location & (HL3_PT_SLOTS - 1);
    v[3] = p->genlen >> 16;
    v[4] = h->lengths[p->genlen & 0xFFFF];
    v[5] = p->checksum;
}

/* The bucket of ``length`` in the class hash: its class there, or the free bucket. */
static size_t class_bucket(const hl3_header *h, uint32_t length)
{
    size_t i = (size_t)(fmix64(length) & (HL3_PT_CLASS_HASH - 1));
    while (h->classes[i] != 0 && h->lengths[h->classes[i] - 1] != length)
        i = (i + 1) & (HL3_PT_CLASS_HASH - 1);
    return i;
}

/* The class of ``length``, added when new; -1 when HL3_PT_CLASSES are taken. */
static long class_of(hl3_header *h, uint32_t length)
{
    size_t i = class_bucket(h, length);
    if (h->classes[i] != 0)
        return h->classes[i] - 1;
    if (h->nclasses >= HL3_PT_CLASSES)
        return -1;
    h->lengths[h->nclasses] = length;
    h->classes[i] = (uint16_t)(h->nclasses + 1);
    return (long)h->nclasses++;
}

/* Forget the classes from ``keep`` on (added by a call that is refused), newest first:
 * no probe run of an older class passes through a newer one, so none is cut. */
static void drop_classes(hl3_header *h, uint64_t keep)
{
    while (h->nclasses > keep) {
        h->nclasses--;
        h->classes[class_bucket(h, h->lengths[h->nclasses])] = 0;
        h->lengths[h->nclasses] = 0;
    }
}

/* ---- the table ------------------------------------------------------------------------ */

static void unmap_arrays(hl3_page *pages, uint32_t *inv, uint16_t *meta, uint64_t cap)
{
    unmap(pages, cap * sizeof(hl3_page));
    unmap(inv, cap * sizeof(uint32_t));
    unmap(meta, cap * sizeof(uint16_t));
}

/* Move every page into new arrays of ``cap`` buckets (>= len / 0.8) and build their inverse. */
static int rebuild(hl3_table *t, uint64_t cap)
{
    if (cap > HL3_PT_MAX_CAP)
        return HL3_PT_NOMEM;
    hl3_page *pages = map_dense(cap * sizeof(hl3_page));
    uint32_t *inv = map_dense(cap * sizeof(uint32_t));
    uint16_t *meta = map_dense(cap * sizeof(uint16_t));
    if (pages == NULL || inv == NULL || meta == NULL) {
        unmap_arrays(pages, inv, meta, cap);
        return HL3_PT_NOMEM;
    }
    hl3_page *old = t->pages;
    uint64_t oldcap = old == NULL ? 0 : t->h->cap;
    for (size_t i = 0; i < oldcap; i++) {
        if (old[i].location == 0)
            continue;
        size_t j = page_home(old[i].digest, cap);
        while (pages[j].location != 0)
            j = next(j, cap);
        pages[j] = old[i];
    }
    for (size_t i = 0; i < cap; i++) {
        if (pages[i].location == 0)
            continue;
        size_t home = inv_home(pages[i].location, cap), j = home;
        while (inv[j] != 0)
            j = next(j, cap);
        inv[j] = (uint32_t)(i + 1);
        meta[j] = inv_meta(inv_tag(pages[i].location), home, j, cap);
    }
    unmap_arrays(old, t->inv, t->meta, oldcap);
    t->pages = pages;
    t->inv = inv;
    t->meta = meta;
    t->h->cap = cap;
    return 0;
}

static inline int fits(uint64_t pages, uint64_t cap) { return pages * 5 <= cap * 4; } /* load <= 0.8 */

static inline uint64_t cap_of(uint64_t pages) { return (pages * 5 + 3) / 4; } /* load 0.8 */

/* The capacity to rebuild at, for pages that need ``need`` buckets and would get ``cap``:
 * the expected capacity instead when it holds them and ``cap`` passes it or is within
 * one growth step of it (the table reaches it without a last rebuild, nor the load of a
 * step past it). */
static inline uint64_t toward_expected(const hl3_header *h, uint64_t need, uint64_t cap)
{
    uint64_t e = h->expect;
    return e >= need && (e <= cap || cap + cap / 2 >= e) ? e : cap;
}

/* Room for ``pages`` pages at load <= 0.8, growing 1.5 times at a time. */
static int grow(hl3_table *t, uint64_t pages)
{
    uint64_t cap = t->h->cap;
    if (fits(pages, cap))
        return 0;
    if (pages > HL3_PT_MAX_CAP)
        return HL3_PT_NOMEM;
    while (!fits(pages, cap))
        cap += cap / 2;
    return rebuild(t, toward_expected(t->h, cap_of(pages), cap));
}

hl3_table *hl3_pt_new(void)
{
    hl3_table *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->h = map_zero(sizeof(hl3_header));
    if (t->h == NULL || rebuild(t, HL3_PT_MIN_CAP) != 0) {
        unmap(t->h, sizeof(hl3_header));
        free(t);
        return NULL;
    }
    return t;
}

static size_t dead_bytes(uint64_t cap) { return (cap + 63) / 64 * sizeof(uint64_t); }

static void free_base(hl3_table *b);

void hl3_pt_journal_stop(hl3_table *t)
{
    if (t->journal != NULL) {
        free(t->journal->records);
        free(t->journal);
        t->journal = NULL;
    }
}

void hl3_pt_free(hl3_table *t)
{
    if (t == NULL)
        return;
    hl3_pt_journal_stop(t);
    if (t->base != NULL) {
        unmap(t->dead, dead_bytes(t->base->h->cap));
        free_base(t->base);
    }
    unmap_arrays(t->pages, t->inv, t->meta, t->h->cap);
    unmap(t->h, sizeof(hl3_header));
    free(t);
}

/* Presize both arrays for ``pages`` pages at load <= 0.8 now (never shrinks; the
 * expected capacity instead when that is within one growth step): 0, or HL3_PT_NOMEM
 * (the table is unchanged). */
int hl3_pt_reserve(hl3_table *t, uint64_t pages)
{
    if (fits(pages, t->h->cap))
        return 0;
    if (pages > HL3_PT_MAX_CAP)
        return HL3_PT_NOMEM;
    return rebuild(t, toward_expected(t->h, cap_of(pages), cap_of(pages)));
}

/* The table is expected to hold at most ``pages`` pages (a capacity hint; 0: none):
 * nothing is allocated now, but a growth (or reserve) that comes within one 1.5x step
 * of that capacity goes to it, so that a table at the expected capacity is at load 0.8
 * and was not rebuilt past it. Presizing at once instead would cost a store far below
 * its capacity a memory page per indexed page (digests spread over the whole array)
 * until every page of the arrays is touched. */
void hl3_pt_expect(hl3_table *t, uint64_t pages)
{
    t->h->expect = pages > HL3_PT_MAX_CAP || cap_of(pages) > HL3_PT_MAX_CAP ? 0 : cap_of(pages);
}

/* Pages in the table: the delta's and the base's live ones. */
size_t hl3_pt_len(const hl3_table *t)
{
    return t->h->len + (t->base != NULL ? t->base->h->len - t->ndead : 0);
}

/* Pages in the delta (this process's own arrays) alone. */
size_t hl3_pt_delta_len(const hl3_table *t) { return t->h->len; }

/* Private bytes mapped for the table (header and the two bucket arrays; with a base, its
 * header copy and the dead bits too): not the base's shared file mapping. */
size_t hl3_pt_nbytes(const hl3_table *t)
{
    uint64_t cap = t->h->cap;
    size_t n = mapped(sizeof(hl3_header)) + mapped(cap * sizeof(hl3_page)) + mapped(cap * sizeof(uint32_t))
               + mapped(cap * sizeof(uint16_t));
    if (t->base != NULL)
        n += mapped(sizeof(hl3_header)) + mapped(dead_bytes(t->base->h->cap));
    return n;
}

/* Bytes of the base's shared file mapping (0: no base). */
size_t hl3_pt_shared_nbytes(const hl3_table *t) { return t->base != NULL ? t->base->map_len : 0; }

/* ---- the page map and its inverse ----------------------------------------------------- */

/* The bucket holding ``digest`` (*found = 1) or the free bucket ending its probe run. */
static size_t page_find(const hl3_table *t, const uint8_t *digest, int *found)
{
    uint64_t cap = t->h->cap;
    size_t i = page_home(digest, cap);
    while (t->pages[i].location != 0) {
        if (memcmp(t->pages[i].digest, digest, 16) == 0) {
            *found = 1;
            return i;
        }
        i = next(i, cap);
    }
    *found = 0;
    return i;
}

/* The inverse bucket of ``location`` (*found = 1: it names the page there) or the free
 * bucket ending its probe run. */
static size_t inv_find(const hl3_table *t, uint64_t location, int *found)
{
    uint64_t cap = t->h->cap;
    size_t i = inv_home(location, cap);
    uint8_t tag = inv_tag(location);
    while (t->inv[i] != 0) {
        if ((uint8_t)t->meta[i] == tag && t->pages[t->inv[i] - 1].location == location) {
            *found = 1;
            return i;
        }
        i = next(i, cap);
    }
    *found = 0;
    return i;
}

/* The inverse bucket naming page bucket ``page`` (whose location is ``location``): it is
 * there, by the invariant. Compares indices only, so it holds while a page is copied. */
static size_t inv_of(const hl3_table *t, uint64_t location, size_t page)
{
    uint64_t cap = t->h->cap;
    size_t i = inv_home(location, cap);
    while (t->inv[i] != page + 1)
        i = next(i, cap);
    return i;
}

/* The home bucket of inverse entry ``j``: from its distance, or its page when that is far. */
static inline size_t inv_home_of(const hl3_table *t, size_t j, uint64_t cap)
{
    uint64_t d = t->meta[j] >> 8;
    if (d == HL3_PT_FAR)
        return inv_home(t->pages[t->inv[j] - 1].location, cap);
    return j >= d ? j - d : j + cap - d;
}

static void inv_delete_at(hl3_table *t, size_t i)
{
    uint64_t cap = t->h->cap;
    size_t j = i;
    for (;;) {
        j = next(j, cap);
        if (t->inv[j] == 0)
            break;
        size_t k = inv_home_of(t, j, cap);
        if (!between(i, k, j)) { /* j's entry may fill the hole: shift it back */
            t->inv[i] = t->inv[j];
            t->meta[i] = inv_meta((uint8_t)t->meta[j], k, i, cap);
            i = j;
        }
    }
    t->inv[i] = 0;
    t->meta[i] = 0;
}

/* Name page ``page`` (in slot ``location``) in inverse bucket ``j``: the free bucket that
 * ends the probe run of ``location`` (inv_find's answer when not found). */
static void inv_place(hl3_table *t, uint64_t location, size_t page, size_t j)
{
    t->inv[j] = (uint32_t)(page + 1);
    t->meta[j] = inv_meta(inv_tag(location), inv_home(location, t->h->cap), j, t->h->cap);
}

static void inv_insert(hl3_table *t, uint64_t location, size_t page)
{
    int found;
    inv_place(t, location, page, inv_find(t, location, &found));
}

static void page_delete_with(hl3_table *t, size_t i, size_t inv);

/* Remove page bucket ``i`` and its inverse entry. */
static void page_delete_at(hl3_table *t, size_t i) { page_delete_with(t, i, inv_of(t, t->pages[i].location, i)); }

/* page_delete_at, its inverse bucket ``inv`` known (the one naming ``i``). */
static void page_delete_with(hl3_table *t, size_t i, size_t inv)
{
    uint64_t cap = t->h->cap;
    inv_delete_at(t, inv);
    size_t j = i;
    for (;;) {
        j = next(j, cap);
        if (t->pages[j].location == 0)
            break;
        size_t k = page_home(t->pages[j].digest, cap);
        if (!between(i, k, j)) { /* j's bucket may fill the hole: shift it back */
            t->inv[inv_of(t, t->pages[j].location, j)] = (uint32_t)(i + 1);
            t->pages[i] = t->pages[j];
            i = j;
        }
    }
    memset(&t->pages[i], 0, sizeof(hl3_page));
    t->h->len--;
}

/* ---- the two layers ------------------------------------------------------------------- */

static inline int alive(const hl3_table *t, size_t i) { return !(t->dead[i >> 6] >> (i & 63) & 1); }

static inline void kill(hl3_table *t, size_t i)
{
    t->dead[i >> 6] |= 1ULL << (i & 63);
    t->ndead++;
}

/* The page of ``digest`` (the delta's, else the base's live one) and, in *h, the header
 * of the layer holding it (for its length classes); NULL when none. */
static const hl3_page *lookup(const hl3_table *t, const uint8_t *digest, const hl3_header **h)
{
    int found;
    size_t i = page_find(t, digest, &found);
    if (found) {
        *h = t->h;
        return &t->pages[i];
    }
    const hl3_table *b = t->base;
    if (b != NULL) {
        i = page_find(b, digest, &found);
        if (found && alive(t, i)) {
            *h = b->h;
            return &b->pages[i];
        }
    }
    return NULL;
}

/* The base's live page in slot ``location``: its bucket, or -1. */
static long base_at(const hl3_table *t, uint64_t location)
{
    const hl3_table *b = t->base;
    if (b == NULL)
        return -1;
    int found;
    size_t j = inv_find(b, location, &found);
    if (!found || !alive(t, b->inv[j] - 1))
        return -1;
    return (long)(b->inv[j] - 1);
}

/* The live page in slot ``location`` (the delta's, else the base's), or NULL. */
static const hl3_page *page_at(const hl3_table *t, uint64_t location)
{
    int found;
    size_t i = inv_find(t, location, &found);
    if (found)
        return &t->pages[t->inv[i] - 1];
    long j = base_at(t, location);
    return j < 0 ? NULL : &t->base->pages[j];
}

/* Before the delta takes ``digest`` at ``location``: the base's live page of that digest
 * and its live page in that slot are removed (the invariant of struct hl3_table). */
static void kill_base_of(hl3_table *t, const uint8_t *digest, uint64_t location)
{
    if (t->base == NULL)
        return;
    int found;
    size_t i = page_find(t->base, digest, &found);
    if (found && alive(t, i))
        kill(t, i);
    long j = base_at(t, location);
    if (j >= 0)
        kill(t, (size_t)j);
}

static inline void prefetch_page(const hl3_table *t, const uint8_t *digest)
{
    __builtin_prefetch(&t->pages[page_home(digest, t->h->cap)]);
    if (t->base != NULL)
        __builtin_prefetch(&t->base->pages[page_home(digest, t->base->h->cap)]);
}

/* ---- the journal ---------------------------------------------------------------------- */

static void journal_add(hl3_table *t, uint64_t kind, const uint8_t *digest, const uint64_t *v)
{
    hl3_journal *j = t->journal;
    if (j->failed)
        return;
    if (j->n == j->cap) {
        size_t cap = j->cap ? 2 * j->cap : 1024;
        uint64_t *r = realloc(j->records, cap * HL3_JOURNAL_WORDS * sizeof(uint64_t));
        if (r == NULL) {
            j->failed = 1;
            return;
        }
        j->records = r;
        j->cap = cap;
    }
    uint64_t *r = j->records + HL3_JOURNAL_WORDS * j->n++;
    r[0] = kind;
    memcpy(r + 1, digest, 16);
    if (v != NULL)
        memcpy(r + 3, v, 6 * sizeof(uint64_t));
}

/* Start recording every put and pop of ``t`` (a journal already there is kept): 0, or
 * HL3_PT_NOMEM. */
int hl3_pt_journal_start(hl3_table *t)
{
    if (t->journal == NULL && (t->journal = calloc(1, sizeof(hl3_journal))) == NULL)
        return HL3_PT_NOMEM;
    return 0;
}

/* ---- operations ----------------------------------------------------------------------- */

/* Remove the page of ``digest`` and its inverse; 1 if there was one (its values in v). */
static int pop_one(hl3_table *t, const uint8_t *digest, uint64_t *v)
{
    int found;
    size_t i = page_find(t, digest, &found);
    if (t->journal != NULL && (found || t->base != NULL))
        journal_add(t, 2, digest, NULL); /* (a pop of nothing replays as nothing) */
    if (found) {
        if (v != NULL)
            unpack(t->h, &t->pages[i], v);
        page_delete_at(t, i);
        return 1;
    }
    if (t->base == NULL)
        return 0;
    i = page_find(t->base, digest, &found);
    if (!found || !alive(t, i))
        return 0;
    if (v != NULL)
        unpack(t->base->h, &t->base->pages[i], v);
    kill(t, i);
    return 1;
}

/* Room for one more page is there (callers grow first); v is in range and its length has
 * the class ``cls``. */
static void put_one(hl3_table *t, const uint8_t *digest, const uint64_t *v, uint64_t cls)
{
    uint64_t location = pack_location(v[0], v[1], v[2]);
    if (t->journal != NULL)
        journal_add(t, 1, digest, v);
    kill_base_of(t, digest, location);
    int in_slot, found;
    size_t j = inv_find(t, location, &in_slot);
    if (in_slot && memcmp(t->pages[t->inv[j] - 1].digest, digest, 16) != 0)
        page_delete_at(t, t->inv[j] - 1); /* the slot held another key's page: that page is gone */
    size_t i = page_find(t, digest, &found);
    hl3_page *p = &t->pages[i];
    if (!found) {
        memcpy(p->digest, digest, 16);
        t->h->len++;
    } else if (p->location != location) {
        inv_delete_at(t, inv_of(t, p->location, i)); /* the key's former slot */
    }
    int moved = !found || p->location != location;
    p->location = location;
    p->genlen = v[3] << 16 | cls;
    p->checksum = v[5];
    if (!moved)
        return;
    if (!in_slot && !found) /* the inverse is as inv_find left it: j ends the slot's probe run */
        inv_place(t, location, i, j);
    else
        inv_insert(t, location, i);
}

/* Put pages ``i`` (digest ``digests + 16 i``, values ``values + 6 i``) in order, each
 * superseding the slot's page and the key's former slot. 0, or a negative HL3_PT_*
 * code (nothing applied). */
int hl3_pt_put_many(hl3_table *t, size_t n, const uint8_t *digests, const uint64_t *values)
{
    for (size_t i = 0; i < n; i++)
        if (!in_range(values + 6 * i))
            return HL3_PT_BADVALUE;
    if (grow(t, t->h->len + n) != 0)
        return HL3_PT_NOMEM;
    hl3_header *h = t->h;
    uint64_t keep = h->nclasses, cls = 0;
    uint32_t last = 0;
    for (size_t i = 0; i < n; i++) { /* every length has a class before anything is put */
        uint32_t length = (uint32_t)values[6 * i + 4];
        if (i == 0 || length != last) {
            long c = class_of(h, length);
            if (c < 0) {
                drop_classes(h, keep);
                return HL3_PT_BADVALUE;
            }
            last = length;
        }
    }
    enum { AHEAD = 8 }; /* buckets of later pages are fetched while this one is put */
    uint64_t cap = h->cap;
    for (size_t i = 0; i < n; i++) {
        const uint64_t *v = values + 6 * i;
        if (i + AHEAD < n) {
            const uint64_t *a = v + 6 * AHEAD;
            __builtin_prefetch(&t->pages[page_home(digests + 16 * (i + AHEAD), cap)], 1);
            size_t k = inv_home(pack_location(a[0], a[1], a[2]), cap);
            __builtin_prefetch(&t->inv[k], 1);
            __builtin_prefetch(&t->meta[k], 1);
        }
        if (i == 0 || v[4] != last) {
            last = (uint32_t)v[4];
            cls = h->classes[class_bucket(h, last)] - 1u;
        }
        put_one(t, digests + 16 * i, v, cls);
    }
    return 0;
}

/* found[i] = 1 where digest i has a page (its values land in values + 6 i when values is
 * not NULL), else 0; the number found. Probes are prefetched a few keys ahead. */
size_t hl3_pt_get_many(const hl3_table *t, size_t n, const uint8_t *digests, uint64_t *values,
                       uint8_t *found)
{
    enum { AHEAD = 8 };
    size_t hits = 0;
    for (size_t i = 0; i < n && i < AHEAD; i++)
        prefetch_page(t, digests + 16 * i);
    for (size_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            prefetch_page(t, digests + 16 * (i + AHEAD));
        const hl3_header *h;
        const hl3_page *p = lookup(t, digests + 16 * i, &h);
        found[i] = p != NULL;
        if (p != NULL) {
            hits++;
            if (values != NULL)
                unpack(h, p, values + 6 * i);
        }
    }
    return hits;
}

/* Remove the pages of the n digests (and their inverse); how many there were. */
size_t hl3_pt_pop_many(hl3_table *t, size_t n, const uint8_t *digests)
{
    size_t gone = 0;
    for (size_t i = 0; i < n; i++)
        gone += (size_t)pop_one(t, digests + 16 * i, NULL);
    return gone;
}

/* Remove the page of ``digest``: 1 (its values in v) or 0. */
int hl3_pt_pop(hl3_table *t, const uint8_t *digest, uint64_t *v) { return pop_one(t, digest, v); }

/* The digest of the page in slot (writer, slab, slot): 1 (copied to ``digest``) or 0. */
int hl3_pt_at(const hl3_table *t, uint64_t w, uint64_t s, uint64_t sl, uint8_t *digest)
{
    if (w >= HL3_PT_WRITERS || s >= HL3_PT_SLABS || sl >= HL3_PT_SLOTS)
        return 0;
    int found;
    uint64_t location = pack_location(w, s, sl);
    size_t i = inv_find(t, location, &found);
    if (found) {
        memcpy(digest, t->pages[t->inv[i] - 1].digest, 16);
        return 1;
    }
    long j = base_at(t, location);
    if (j < 0)
        return 0;
    memcpy(digest, t->base->pages[j].digest, 16);
    return 1;
}

/* hl3_pt_at of slot (writer, slab, slot) then hl3_pt_pop of the digest found, with one
 * probe for both (the slot's inverse bucket names the page to remove): 1 (the digest at
 * ``digest``, the values at ``v``) or 0 (no page there, nothing changed). The eviction
 * take of a run of slots (evict.c) calls it per slot. */
int hl3_pt_take_at(hl3_table *t, uint64_t w, uint64_t s, uint64_t sl, uint8_t *digest, uint64_t *v)
{
    if (w >= HL3_PT_WRITERS || s >= HL3_PT_SLABS || sl >= HL3_PT_SLOTS)
        return 0;
    int found;
    uint64_t location = pack_location(w, s, sl);
    size_t j = inv_find(t, location, &found);
    if (found) { /* the delta's page (pop_one's first case) */
        size_t i = t->inv[j] - 1;
        memcpy(digest, t->pages[i].digest, 16);
        if (t->journal != NULL)
            journal_add(t, 2, digest, NULL);
        unpack(t->h, &t->pages[i], v);
        page_delete_with(t, i, j);
        return 1;
    }
    long b = base_at(t, location);
    if (b < 0)
        return 0;
    /* the base's live page: the delta holds no page of its digest (struct hl3_table's
     * invariant), so pop_one of that digest journals it and kills this bucket */
    memcpy(digest, t->base->pages[b].digest, 16);
    if (t->journal != NULL)
        journal_add(t, 2, digest, NULL);
    unpack(t->base->h, &t->base->pages[b], v);
    kill(t, (size_t)b);
    return 1;
}

/* hl3_pt_at of the n slots ``where`` (writer, slab, slot as three uint64 each): found[i]
 * 1 (digest at ``digests + 16 i``) or 0; how many were found. */
size_t hl3_pt_at_many(const hl3_table *t, size_t n, const uint64_t *where, uint8_t *digests,
                      uint8_t *found)
{
    size_t hits = 0;
    for (size_t i = 0; i < n; i++) {
        found[i] = (uint8_t)hl3_pt_at(t, where[3 * i], where[3 * i + 1], where[3 * i + 2], digests + 16 * i);
        hits += found[i];
    }
    return hits;
}

/* The pages of ``writer`` (all when negative) in ``slab`` (any when negative), in bucket
 * order: digests and values copied out (up to ``max``) when ``digests`` is not NULL; how
 * many match (all of them, also past ``max``). */
static size_t select_layer(const hl3_table *t, const hl3_table *layer, int64_t writer, int64_t slab,
                           uint8_t *digests, uint64_t *values, size_t n, size_t max)
{
    uint64_t cap = layer->h->cap;
    for (size_t i = 0; i < cap; i++) {
        const hl3_page *p = &layer->pages[i];
        uint64_t loc = p->location;
        if (loc == 0 || (writer >= 0 && (loc >> 48) - 1 != (uint64_t)writer)
            || (slab >= 0 && ((loc >> 24) & (HL3_PT_SLABS - 1)) != (uint64_t)slab)
            || (layer != t && !alive(t, i)))
            continue;
        if (digests != NULL && n < max) {
            memcpy(digests + 16 * n, p->digest, 16);
            unpack(layer->h, p, values + 6 * n);
        }
        n++;
    }
    return n;
}

size_t hl3_pt_select(const hl3_table *t, int64_t writer, int64_t slab, uint8_t *digests,
                     uint64_t *values, size_t max)
{
    size_t n = select_layer(t, t, writer, slab, digests, values, 0, max);
    if (t->base != NULL)
        n = select_layer(t, t->base, writer, slab, digests, values, n, max);
    return n;
}

/* The inverse: (writer, slab, slot) as three uint64 and the digest, per entry (up to
 * ``max``), in inverse bucket order; how many entries there are. */
static size_t slots_layer(const hl3_table *t, const hl3_table *layer, uint64_t *where,
                          uint8_t *digests, size_t n, size_t max)
{
    uint64_t cap = layer->h->cap;
    for (size_t i = 0; i < cap; i++) {
        if (layer->inv[i] == 0 || (layer != t && !alive(t, layer->inv[i] - 1)))
            continue;
        if (n < max) {
            const hl3_page *p = &layer->pages[layer->inv[i] - 1];
            uint64_t v[6];
            unpack(layer->h, p, v);
            memcpy(where + 3 * n, v, 3 * sizeof(uint64_t));
            memcpy(digests + 16 * n, p->digest, 16);
        }
        n++;
    }
    return n;
}

size_t hl3_pt_slots(const hl3_table *t, uint64_t *where, uint8_t *digests, size_t max)
{
    size_t n = slots_layer(t, t, where, digests, 0, max);
    if (t->base != NULL)
        n = slots_layer(t, t->base, where, digests, n, max);
    return n;
}

/* The table's invariants, for tests: 0 when they hold, else which failed (1: a page is
 * not found from its home, 2: an inverse entry is not found from its home or names a
 * free bucket, 3: the counts disagree (pages, inverse entries, len), 4: a page's length
 * class is not a class). */
static int check_layer(const hl3_table *t)
{
    uint64_t cap = t->h->cap, pages = 0, entries = 0;
    for (size_t i = 0; i < cap; i++) {
        const hl3_page *p = &t->pages[i];
        if (p->location == 0)
            continue;
        pages++;
        int found;
        if (page_find(t, p->digest, &found) != i || !found)
            return 1;
        if ((p->genlen & 0xFFFF) >= t->h->nclasses)
            return 4;
    }
    for (size_t i = 0; i < cap; i++) {
        if (t->inv[i] == 0)
            continue;
        entries++;
        if (t->inv[i] > cap || t->pages[t->inv[i] - 1].location == 0
            || t->meta[i] != inv_meta(inv_tag(t->pages[t->inv[i] - 1].location),
                                      inv_home(t->pages[t->inv[i] - 1].location, cap), i, cap))
            return 2;
        int found;
        if (inv_find(t, t->pages[t->inv[i] - 1].location, &found) != i || !found)
            return 2;
    }
    return pages == entries && pages == t->h->len ? 0 : 3;
}

/* hl3_pt_check's layer checks (5: a dead bit is set on a free base bucket, or their count
 * is not ndead; 6: a live base page has the digest or the slot of a delta page). */
int hl3_pt_check(const hl3_table *t)
{
    int bad = check_layer(t);
    if (bad != 0 || t->base == NULL)
        return bad;
    const hl3_table *b = t->base;
    if ((bad = check_layer(b)) != 0)
        return bad;
    uint64_t ndead = 0;
    for (size_t i = 0; i < b->h->cap; i++)
        if (!alive(t, i)) {
            if (b->pages[i].location == 0)
                return 5;
            ndead++;
        }
    if (ndead != t->ndead)
        return 5;
    for (size_t i = 0; i < t->h->cap; i++) {
        const hl3_page *p = &t->pages[i];
        if (p->location == 0)
            continue;
        int found;
        size_t j = page_find(b, p->digest, &found);
        if ((found && alive(t, j)) || base_at(t, p->location) >= 0)
            return 6;
    }
    return 0;
}

/* ---- live PUT records of an index log ------------------------------------------------- */

/* The xxhash library's XXH3_128bits_withSeed (the caller passes it, as for batch_io.c). */
typedef struct {
    uint64_t low64, high64;
} hl3_xxh128;
typedef hl3_xxh128 (*hl3_xxh128_fn)(const void *, size_t, uint64_t);

/* zlib.crc32 (records.c: slicing by 8, its tables made on first use) */
uint32_t hl3_crc32(const unsigned char *p, size_t n);

static uint64_t le64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* little-endian hosts only: the Python side checks sys.byteorder */
}

static uint32_t le32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

#define HL3_RECORD 48 /* slab/format.py RECORD: crc, kind, pad, key length, w, slab, slot, pad, gen, length, checksum */
#define HL3_PUT 1
#define HL3_GEN 3

/* Walk ``n`` bytes of index log records (slab/format.py). When they are all whole records
 * with a good CRC, a known kind and an ASCII key (what decode_records reads without its
 * slow path), writes the start and end offsets of every PUT record whose key's digest
 * (XXH3-128 with ``seed``, through ``hash``) the table maps to exactly that (writer, slab,
 * slot, generation), and returns how many (at most ``max``, n / 48 always suffices).
 * Returns -1 when any byte is not such a record: the caller decodes the log in Python. */
long hl3_pt_live_puts(const hl3_table *t, const uint8_t *data, size_t n, uint64_t seed,
                      hl3_xxh128_fn hash, uint64_t *starts, uint64_t *ends, size_t max)
{
    size_t pos = 0, live = 0;
    while (pos < n) {
        if (n - pos < HL3_RECORD)
            return -1;
        const uint8_t *r = data + pos;
        uint8_t kind = r[4];
        size_t keylen = (size_t)r[6] | (size_t)r[7] << 8;
        if (n - pos - HL3_RECORD < keylen || kind < HL3_PUT || kind > HL3_GEN)
            return -1;
        const uint8_t *key = r + HL3_RECORD;
        for (size_t i = 0; i < keylen; i++)
            if (key[i] >= 0x80)
                return -1;
        if (hl3_crc32(r + 4, HL3_RECORD - 4 + keylen) != le32(r))
            return -1;
        if (kind == HL3_PUT) {
            /* Live: the table's page of the key's digest is this record's (writer, slab,
             * slot, generation). Asked from the slot's side -- the page in the record's
             * slot has its generation and the key's digest -- which is the same page by
             * the inverse's invariants (one page per slot and per digest, over both
             * layers): most records of a log to compact are dead, their slot holds a
             * newer page, and that answer needs neither the key's hash nor the page
             * map's probe for a digest it does not hold. */
            uint64_t w = le32(r + 8), slab = le32(r + 12), slot = le32(r + 16), gen = le64(r + 24);
            const hl3_page *p = NULL;
            if (w < HL3_PT_WRITERS && slab < HL3_PT_SLABS && slot < HL3_PT_SLOTS)
                p = page_at(t, pack_location(w, slab, slot));
            if (p != NULL && p->genlen >> 16 == gen) {
                hl3_xxh128 h = hash(key, keylen, seed);
                uint8_t digest[16]; /* the canonical (big-endian) form, as xxhash.xxh3_128_digest */
                uint64_t hi = __builtin_bswap64(h.high64), lo = __builtin_bswap64(h.low64);
                memcpy(digest, &hi, 8);
                memcpy(digest + 8, &lo, 8);
                if (memcmp(p->digest, digest, 16) == 0) {
                    if (live >= max)
                        return -1;
                    starts[live] = pos;
                    ends[live] = pos + HL3_RECORD + keylen;
                    live++;
                }
            }
        }
        pos += HL3_RECORD + keylen;
    }
    return (long)live;
}

/* Write the ``n`` byte spans [starts[k], ends[k]) of ``data`` (hl3_pt_live_puts' answer:
 * in order, inside data) one after another to ``fd`` at its file offset, adjacent spans
 * as one iovec, HL3_SPAN_IOVS iovecs a call, short writes resumed: what a compaction
 * writes, without an object per record or a buffer of them all. The bytes written, or
 * -errno (-EIO: a write that moved nothing). */
#define HL3_SPAN_IOVS 1024 /* Linux's IOV_MAX */
long hl3_write_spans(int fd, const uint8_t *data, const uint64_t *starts, const uint64_t *ends, size_t n)
{
    struct iovec iov[HL3_SPAN_IOVS];
    long total = 0;
    size_t k = 0;
    while (k < n) {
        int m = 0;
        while (k < n && m < HL3_SPAN_IOVS) {
            uint64_t lo = starts[k], hi = ends[k++];
            while (k < n && starts[k] == hi) /* the next record follows: one iovec */
                hi = ends[k++];
            iov[m++] = (struct iovec){(void *)(data + lo), (size_t)(hi - lo)};
        }
        int first = 0;
        while (first < m) {
            ssize_t w = writev(fd, iov + first, m - first);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            if (w == 0)
                return -EIO;
            total += (long)w;
            while (first < m && (size_t)w >= iov[first].iov_len)
                w -= (ssize_t)iov[first++].iov_len;
            if (first < m) {
                iov[first].iov_base = (char *)iov[first].iov_base + w;
                iov[first].iov_len -= (size_t)w;
            }
        }
    }
    return total;
}

/* ---- the plan of a get batch ---------------------------------------------------------- */

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
        const hl3_page *bucket = lookup(t, digests + 16 * i, &h);
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

/* ---- images: a table's file form, and the base layer ---------------------------------- */

/* An image (little-endian hosts only: the Python side checks sys.byteorder): this header,
 * the length classes (nclasses uint32, padded to 8 bytes), then the page array (cap
 * 40-byte buckets), the inverse (cap uint32) and its tags and distances (cap uint16), each
 * exactly as in memory, so that a read-only mapping of the file is a table to probe. */
typedef struct {
    char magic[8]; /* "HL3PTIMG" */
    uint32_t version;
    uint32_t nclasses;
    uint64_t cap;
    uint64_t len;
    uint64_t bytes; /* the whole image */
} hl3_image;

#define HL3_IMG_MAGIC "HL3PTIMG"
#define HL3_IMG_VERSION 1

static uint64_t image_pages_at(uint64_t nclasses) { return (sizeof(hl3_image) + 4 * nclasses + 7) / 8 * 8; }

static uint64_t image_bytes(uint64_t nclasses, uint64_t cap)
{
    return image_pages_at(nclasses) + cap * (sizeof(hl3_page) + sizeof(uint32_t) + sizeof(uint16_t));
}

/* Bytes of the image of ``t`` (0: ``t`` has a base, and no image of its own). */
size_t hl3_pt_image_bytes(const hl3_table *t)
{
    return t->base != NULL ? 0 : image_bytes(t->h->nclasses, t->h->cap);
}

static int write_all(int fd, const void *data, size_t n, uint64_t *at)
{
    const uint8_t *p = data;
    while (n > 0) {
        ssize_t w = pwrite(fd, p, n < (1u << 30) ? n : (1u << 30), (off_t)*at);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? errno : EIO;
        p += w;
        n -= (size_t)w;
        *at += (uint64_t)w;
    }
    return 0;
}

/* Write the image of ``t`` (a table without a base) at ``offset`` of ``fd``: 0, or an
 * errno (EINVAL: ``t`` has a base). Called without the GIL on a table no one else uses. */
int hl3_pt_write_image(const hl3_table *t, int fd, uint64_t offset)
{
    if (t->base != NULL)
        return EINVAL;
    const hl3_header *h = t->h;
    hl3_image img;
    memset(&img, 0, sizeof(img));
    memcpy(img.magic, HL3_IMG_MAGIC, 8);
    img.version = HL3_IMG_VERSION;
    img.nclasses = (uint32_t)h->nclasses;
    img.cap = h->cap;
    img.len = h->len;
    img.bytes = image_bytes(h->nclasses, h->cap);
    static const uint8_t pad[8];
    size_t lengths = 4 * h->nclasses;
    uint64_t at = offset;
    int rc;
    if ((rc = write_all(fd, &img, sizeof(img), &at)) != 0 || (rc = write_all(fd, h->lengths, lengths, &at)) != 0
        || (rc = write_all(fd, pad, image_pages_at(h->nclasses) - sizeof(img) - lengths, &at)) != 0
        || (rc = write_all(fd, t->pages, h->cap * sizeof(hl3_page), &at)) != 0
        || (rc = write_all(fd, t->inv, h->cap * sizeof(uint32_t), &at)) != 0
        || (rc = write_all(fd, t->meta, h->cap * sizeof(uint16_t), &at)) != 0)
        return rc;
    return 0;
}

static void free_base(hl3_table *b)
{
    if (__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    unmap(b->h, sizeof(hl3_header));
    munmap(b->map, b->map_len);
    free(b);
}

/* The image of ``bytes`` bytes at ``offset`` (a multiple of 8) of ``fd``, mapped read-only
 * and shared, as a table to probe (never written: a write would fault), or NULL (*err:
 * HL3_PT_BADIMAGE, HL3_PT_NOMEM). The checks make every probe safe whatever the bytes:
 * the counts agree and leave a free bucket to end every probe run, inverse entries name
 * occupied page buckets, length classes are in range. (Damage that keeps them, a page
 * not found from its home, gives wrong answers, not a fault: the caller checks the
 * image's hash first, and readers check every slot's header.) */
static hl3_table *map_base(int fd, uint64_t offset, uint64_t bytes, int *err)
{
    *err = HL3_PT_BADIMAGE;
    if (bytes < sizeof(hl3_image) || offset % 8 != 0)
        return NULL;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE), start = offset / page * page;
    size_t len = (size_t)(offset - start + bytes);
    void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, (off_t)start);
    if (map == MAP_FAILED)
        return NULL;
    const uint8_t *img = (const uint8_t *)map + (offset - start);
    hl3_image hd;
    memcpy(&hd, img, sizeof(hd));
    hl3_table *b = NULL;
    if (memcmp(hd.magic, HL3_IMG_MAGIC, 8) != 0 || hd.version != HL3_IMG_VERSION
        || hd.nclasses > HL3_PT_CLASSES || hd.cap < 1 || hd.cap > HL3_PT_MAX_CAP || hd.len >= hd.cap
        || !fits(hd.len, hd.cap) || hd.bytes != bytes || image_bytes(hd.nclasses, hd.cap) != bytes)
        goto bad;
    b = calloc(1, sizeof(*b));
    if (b == NULL || (b->h = map_zero(sizeof(hl3_header))) == NULL) {
        *err = HL3_PT_NOMEM;
        goto bad;
    }
    b->h->cap = hd.cap;
    b->h->len = hd.len;
    b->h->nclasses = hd.nclasses;
    memcpy(b->h->lengths, img + sizeof(hd), 4 * hd.nclasses);
    uint64_t at = image_pages_at(hd.nclasses);
    b->pages = (hl3_page *)(uintptr_t)(img + at);
    b->inv = (uint32_t *)(uintptr_t)(img + at + hd.cap * sizeof(hl3_page));
    b->meta = (uint16_t *)(uintptr_t)(img + at + hd.cap * (sizeof(hl3_page) + sizeof(uint32_t)));
    b->map = map;
    b->map_len = len;
    b->refs = 1;
    uint64_t pages = 0, entries = 0;
    for (size_t i = 0; i < hd.cap; i++)
        if (b->pages[i].location != 0) {
            pages++;
            if ((b->pages[i].genlen & 0xFFFF) >= hd.nclasses)
                goto bad;
        }
    for (size_t i = 0; i < hd.cap; i++)
        if (b->inv[i] != 0) {
            entries++;
            if (b->inv[i] > hd.cap || b->pages[b->inv[i] - 1].location == 0)
                goto bad;
        }
    if (pages != hd.len || entries != hd.len)
        goto bad;
    *err = 0;
    return b;
bad:
    if (b != NULL) {
        unmap(b->h, sizeof(hl3_header));
        free(b);
    }
    munmap(map, len);
    return NULL;
}

/* The empty table ``t`` takes the image at ``offset`` of ``fd`` (``bytes`` long) as its
 * base: its pages are then the image's, read through a shared read-only mapping (the
 * file may be renamed over or unlinked meanwhile: the mapping keeps it). 0, or
 * HL3_PT_BADIMAGE, HL3_PT_NOMEM, HL3_PT_BADVALUE (``t`` is not empty); ``t`` unchanged
 * on failure. */
int hl3_pt_attach(hl3_table *t, int fd, uint64_t offset, uint64_t bytes)
{
    if (t->h->len != 0 || t->base != NULL)
        return HL3_PT_BADVALUE;
    int err;
    hl3_table *b = map_base(fd, offset, bytes, &err);
    if (b == NULL)
        return err;
    uint64_t *dead = map_zero(dead_bytes(b->h->cap));
    if (dead == NULL) {
        free_base(b);
        return HL3_PT_NOMEM;
    }
    t->base = b;
    t->dead = dead;
    t->ndead = 0;
    return 0;
}

static int same_page(const hl3_header *ha, const hl3_page *a, const hl3_header *hb, const hl3_page *b)
{
    uint64_t va[6], vb[6];
    unpack(ha, a, va);
    unpack(hb, b, vb);
    return memcmp(va, vb, sizeof(va)) == 0;
}

/* Move ``t``'s pages onto the image at ``offset`` of ``fd`` as their new base, without
 * changing them: the new delta holds exactly the pages the image lacks or holds
 * otherwise, and the image's pages ``t`` lacks or holds otherwise are dead. (What lets a
 * process drop its delta when another writes a newer checkpoint.) 0, or HL3_PT_BADIMAGE,
 * HL3_PT_NOMEM; ``t`` unchanged on failure. */
int hl3_pt_rebase(hl3_table *t, int fd, uint64_t offset, uint64_t bytes)
{
    int rc;
    hl3_table *b = map_base(fd, offset, bytes, &rc);
    if (b == NULL)
        return rc;
    hl3_table *n = hl3_pt_new();
    uint64_t *dead = map_zero(dead_bytes(b->h->cap));
    size_t total = hl3_pt_len(t), m = 0;
    uint8_t *ds = malloc(16 * (total ? total : 1));
    uint64_t *vs = malloc(48 * (total ? total : 1));
    if (n == NULL || dead == NULL || ds == NULL || vs == NULL) {
        if (n != NULL)
            hl3_pt_free(n);
        unmap(dead, dead_bytes(b->h->cap));
        free_base(b);
        free(ds);
        free(vs);
        return HL3_PT_NOMEM;
    }
    n->h->expect = t->h->expect;
    n->base = b;
    n->dead = dead;
    size_t all = hl3_pt_select(t, -1, -1, ds, vs, total);
    for (size_t k = 0; k < all; k++) { /* t's pages the image lacks or holds otherwise */
        int found;
        size_t i = page_find(b, ds + 16 * k, &found);
        if (found) {
            uint64_t v[6];
            unpack(b->h, &b->pages[i], v);
            if (memcmp(v, vs + 6 * k, sizeof(v)) == 0)
                continue;
        }
        memmove(ds + 16 * m, ds + 16 * k, 16);
        memmove(vs + 6 * m, vs + 6 * k, 48);
        m++;
    }
    rc = hl3_pt_put_many(n, m, ds, vs); /* (kills the image's pages of their digests and slots) */
    free(ds);
    free(vs);
    if (rc != 0) {
        hl3_pt_free(n);
        return rc;
    }
    for (size_t i = 0; i < b->h->cap; i++) { /* the image's pages t lacks or holds otherwise */
        if (b->pages[i].location == 0 || !alive(n, i))
            continue;
        const hl3_header *h;
        const hl3_page *p = lookup(t, b->pages[i].digest, &h);
        if (p == NULL || !same_page(h, p, b->h, &b->pages[i]))
            kill(n, i);
    }
    hl3_table old = *t;
    *t = *n;
    *n = old;
    t->journal = old.journal; /* (the journal records t's changes, wherever its pages are) */
    n->journal = NULL;
    hl3_pt_free(n);
    return 0;
}

static int apply_journal(hl3_table *dst, const hl3_journal *j)
{
    int rc = 0;
    for (size_t k = 0; k < j->n && rc == 0; k++) {
        const uint64_t *r = j->records + HL3_JOURNAL_WORDS * k;
        if (r[0] == 1)
            rc = hl3_pt_put_many(dst, 1, (const uint8_t *)(r + 1), r + 3);
        else
            pop_one(dst, (const uint8_t *)(r + 1), NULL);
    }
    return rc;
}

/* Apply the changes ``src`` recorded since its journal started, in order, to ``dst`` (a
 * table holding what ``src`` held then), and stop ``src``'s journal: ``dst`` then holds
 * what ``src`` holds. 0, or HL3_PT_NOJOURNAL (``src`` kept none, or lost a record:
 * ``dst`` is unchanged), HL3_PT_NOMEM (``dst`` is partly changed: drop it). */
int hl3_pt_journal_replay(hl3_table *dst, hl3_table *src)
{
    hl3_journal *j = src->journal;
    if (j == NULL || j->failed) {
        hl3_pt_journal_stop(src);
        return HL3_PT_NOJOURNAL;
    }
    int rc = apply_journal(dst, j);
    hl3_pt_journal_stop(src);
    return rc;
}

void hl3_pt_journal_free(hl3_journal *j);

/* Whether ``t`` keeps a journal (hl3_pt_journal_start). */
int hl3_pt_journal_has(const hl3_table *t) { return t->journal != NULL; }

/* Records in ``t``'s journal (0: none, or no journal). */
size_t hl3_pt_journal_len(const hl3_table *t) { return t->journal != NULL ? t->journal->n : 0; }

/* The records ``t``'s journal holds, handed over: ``t`` journals on from none (what
 * lets a long catch-up be replayed in parts, each but the last off the caller's lock,
 * by hl3_pt_journal_apply). NULL when ``t`` keeps no journal, or it lost a record
 * (then it stops: a catch-up is impossible), or out of memory (the journal stays). */
hl3_journal *hl3_pt_journal_take(hl3_table *t)
{
    hl3_journal *j = t->journal, *fresh;
    if (j == NULL || j->failed) {
        hl3_pt_journal_stop(t);
        return NULL;
    }
    if ((fresh = calloc(1, sizeof(hl3_journal))) == NULL)
        return NULL;
    t->journal = fresh;
    return j;
}

/* Apply the records of ``j`` (hl3_pt_journal_take) in order to ``dst``, then free ``j``.
 * 0, or HL3_PT_NOMEM (``dst`` is partly changed: drop it). */
int hl3_pt_journal_apply(hl3_table *dst, hl3_journal *j)
{
    int rc = apply_journal(dst, j);
    hl3_pt_journal_free(j);
    return rc;
}

/* Free a taken journal without applying it. */
void hl3_pt_journal_free(hl3_journal *j)
{
    if (j != NULL) {
        free(j->records);
        free(j);
    }
}

/* A table (no base, no journal) whose arrays are copies of ``src``'s own, expecting
 * ``expect`` buckets (hl3_pt_expect); NULL when out of memory. */
static hl3_table *copy_arrays(const hl3_table *src, uint64_t expect)
{
    uint64_t cap = src->h->cap;
    hl3_table *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->h = map_zero(sizeof(hl3_header));
    c->pages = map_dense(cap * sizeof(hl3_page));
    c->inv = map_dense(cap * sizeof(uint32_t));
    c->meta = map_dense(cap * sizeof(uint16_t));
    if (c->h == NULL || c->pages == NULL || c->inv == NULL || c->meta == NULL) {
        if (c->h != NULL)
            unmap(c->h, sizeof(hl3_header));
        unmap_arrays(c->pages, c->inv, c->meta, cap);
        free(c);
        return NULL;
    }
    memcpy(c->pages, src->pages, cap * sizeof(hl3_page));
    memcpy(c->inv, src->inv, cap * sizeof(uint32_t));
    memcpy(c->meta, src->meta, cap * sizeof(uint16_t));
    c->h->cap = cap;
    c->h->len = src->h->len;
    c->h->expect = expect;
    c->h->nclasses = src->h->nclasses;
    memcpy(c->h->lengths, src->h->lengths, src->h->nclasses * sizeof(uint32_t));
    for (uint64_t k = 0; k < c->h->nclasses; k++) /* (a base's header copy has no class hash) */
        c->h->classes[class_bucket(c->h, c->h->lengths[k])] = (uint16_t)(k + 1);
    return c;
}

/* A copy of ``t`` (no journal) over the same base: its own copies of the delta's arrays
 * and of the dead bits, the base's read-only mapping shared (counted: it stays mapped
 * while either table holds it, whatever the other does). What a snapshot has to cost
 * under the caller's lock: the delta and a bit per base bucket, not the base (57 B a
 * page); hl3_pt_flatten of the fork then makes the image off the lock. A table without
 * a base is copied whole. NULL when out of memory. */
hl3_table *hl3_pt_fork(const hl3_table *t)
{
    hl3_table *c = copy_arrays(t, t->h->expect);
    if (c == NULL || t->base == NULL)
        return c;
    size_t bytes = dead_bytes(t->base->h->cap);
    uint64_t *dead = map_dense(bytes);
    if (dead == NULL) {
        hl3_pt_free(c);
        return NULL;
    }
    memcpy(dead, t->dead, bytes);
    __atomic_add_fetch(&t->base->refs, 1, __ATOMIC_ACQ_REL);
    c->base = t->base;
    c->dead = dead;
    c->ndead = t->ndead;
    return c;
}

/* A standalone copy (no base, no journal) of ``t``'s pages with the ``n`` pages of
 * ``digests``/``values`` put after them: what a checkpoint's image is written from. A
 * copy of the arrays (the base's, then its dead pages removed and the delta's pages put;
 * or t's own) rather than a rebuild page by page: about a memcpy of the table. Called
 * on a fork (hl3_pt_fork) off the lock, without the GIL. NULL when out of memory or a
 * value is refused. */
hl3_table *hl3_pt_flatten(const hl3_table *t, size_t n, const uint8_t *digests, const uint64_t *values)
{
    const hl3_table *src = t->base != NULL ? t->base : t;
    uint64_t cap = src->h->cap;
    hl3_table *c = copy_arrays(src, t->h->expect);
    if (c == NULL)
        return NULL;
    int rc = 0;
    if (t->base != NULL) {
        for (size_t i = 0; i < cap; i++) /* the base's dead pages leave the copy */
            if (src->pages[i].location != 0 && !alive(t, i))
                pop_one(c, src->pages[i].digest, NULL);
        size_t m = t->h->len; /* then the delta's pages are put */
        uint8_t *ds = malloc(16 * (m ? m : 1));
        uint64_t *vs = malloc(48 * (m ? m : 1));
        if (ds == NULL || vs == NULL)
            rc = HL3_PT_NOMEM;
        else
            rc = hl3_pt_put_many(c, select_layer(t, t, -1, -1, ds, vs, 0, m), ds, vs);
        free(ds);
        free(vs);
    }
    if (rc == 0 && n > 0)
        rc = hl3_pt_put_many(c, n, digests, values);
    if (rc != 0) {
        hl3_pt_free(c);
        return NULL;
    }
    return c;
}
