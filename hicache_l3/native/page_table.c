/* The slab index's page table: key digest -> (writer, slab, slot, generation, length,
 * checksum), plus the slot inverse (writer, slab, slot) -> digest, as two open-addressing
 * hash tables with linear probing and backward-shift deletion (no tombstones), each
 * doubled before its load exceeds 0.7. Loaded with ctypes.PyDLL (the GIL stays held:
 * every call is short, and the caller's Python threads see each call as atomic, as they
 * saw dict operations): see hicache_l3/slab/table.py, which keeps a dict-backed table as
 * the reference and the fallback when this library is not built.
 *
 * Values cross the boundary as six uint64 per page, in Entry's order: writer, slab, slot,
 * generation, length, checksum. A page whose writer, slab or slot does not fit in 32 bits
 * (or whose writer is the empty mark) or whose length does not fit in 32 bits is refused
 * (HL3_PT_BADVALUE): nothing of the call is applied.
 *
 * Invariant: the inverse is exactly the inverse of the page map. Putting digest D at slot
 * W removes the page another digest had at W, and D's former slot from the inverse.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define HL3_PT_EMPTY UINT32_MAX /* writer of a free bucket */
#define HL3_PT_NOMEM (-1)
#define HL3_PT_BADVALUE (-2)
#define HL3_PT_MIN_CAP 64

typedef struct {
    uint8_t digest[16];
    uint64_t gen;
    uint64_t checksum;
    uint32_t length;
    uint32_t writer; /* HL3_PT_EMPTY: a free bucket */
    uint32_t slab;
    uint32_t slot;
} hl3_page; /* 48 bytes */

typedef struct {
    uint32_t writer; /* HL3_PT_EMPTY: a free bucket */
    uint32_t slab;
    uint32_t slot;
    uint32_t pad;
    uint8_t digest[16];
} hl3_inv; /* 32 bytes */

typedef struct {
    hl3_page *pages;
    size_t pcap, plen; /* pcap: a power of two */
    hl3_inv *inv;
    size_t icap, ilen;
} hl3_table;

_Static_assert(sizeof(hl3_page) == 48, "page bucket layout");
_Static_assert(sizeof(hl3_inv) == 32, "inverse bucket layout");

static inline uint64_t page_home(const uint8_t *digest)
{
    uint64_t h;
    memcpy(&h, digest, 8); /* a digest is uniformly distributed already */
    return h;
}

static inline uint64_t slot_home(uint32_t writer, uint32_t slab, uint32_t slot)
{
    uint64_t h = ((uint64_t)writer << 32 | slab) * 0x9E3779B97F4A7C15ULL ^ slot;
    h ^= h >> 33; /* murmur3's fmix64 */
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static hl3_page *new_pages(size_t cap)
{
    hl3_page *p = malloc(cap * sizeof(hl3_page));
    if (p != NULL)
        for (size_t i = 0; i < cap; i++)
            p[i].writer = HL3_PT_EMPTY;
    return p;
}

static hl3_inv *new_inv(size_t cap)
{
    hl3_inv *p = malloc(cap * sizeof(hl3_inv));
    if (p != NULL)
        for (size_t i = 0; i < cap; i++)
            p[i].writer = HL3_PT_EMPTY;
    return p;
}

hl3_table *hl3_pt_new(void)
{
    hl3_table *t = calloc(1, sizeof(*t));
    if (t == NULL)
        return NULL;
    t->pages = new_pages(HL3_PT_MIN_CAP);
    t->inv = new_inv(HL3_PT_MIN_CAP);
    if (t->pages == NULL || t->inv == NULL) {
        free(t->pages);
        free(t->inv);
        free(t);
        return NULL;
    }
    t->pcap = t->icap = HL3_PT_MIN_CAP;
    return t;
}

void hl3_pt_free(hl3_table *t)
{
    if (t == NULL)
        return;
    free(t->pages);
    free(t->inv);
    free(t);
}

size_t hl3_pt_len(const hl3_table *t) { return t->plen; }

/* Bytes the two bucket arrays take (what a page costs, with the load factor). */
size_t hl3_pt_nbytes(const hl3_table *t)
{
    return t->pcap * sizeof(hl3_page) + t->icap * sizeof(hl3_inv) + sizeof(*t);
}

/* ---- the page map --------------------------------------------------------------------- */

/* The bucket holding ``digest`` (*found = 1) or the free bucket ending its probe run. */
static size_t page_find(const hl3_table *t, const uint8_t *digest, int *found)
{
    size_t mask = t->pcap - 1, i = page_home(digest) & mask;
    while (t->pages[i].writer != HL3_PT_EMPTY) {
        if (memcmp(t->pages[i].digest, digest, 16) == 0) {
            *found = 1;
            return i;
        }
        i = (i + 1) & mask;
    }
    *found = 0;
    return i;
}

/* Is ``k`` cyclically in (i, j]? */
static inline int between(size_t i, size_t k, size_t j)
{
    return i <= j ? (i < k && k <= j) : (k > i || k <= j);
}

static void page_delete_at(hl3_table *t, size_t i)
{
    size_t mask = t->pcap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (t->pages[j].writer == HL3_PT_EMPTY)
            break;
        size_t k = page_home(t->pages[j].digest) & mask;
        if (!between(i, k, j)) { /* j's bucket may fill the hole: shift it back */
            t->pages[i] = t->pages[j];
            i = j;
        }
    }
    t->pages[i].writer = HL3_PT_EMPTY;
    t->plen--;
}

static int page_grow(hl3_table *t, size_t need)
{
    if ((need) * 10 <= t->pcap * 7)
        return 0;
    size_t cap = t->pcap;
    while (need * 10 > cap * 7)
        cap *= 2;
    hl3_page *old = t->pages, *p = new_pages(cap);
    if (p == NULL)
        return HL3_PT_NOMEM;
    size_t oldcap = t->pcap;
    t->pages = p;
    t->pcap = cap;
    for (size_t i = 0; i < oldcap; i++) {
        if (old[i].writer == HL3_PT_EMPTY)
            continue;
        size_t j = page_home(old[i].digest) & (cap - 1);
        while (p[j].writer != HL3_PT_EMPTY)
            j = (j + 1) & (cap - 1);
        p[j] = old[i];
    }
    free(old);
    return 0;
}

/* ---- the slot inverse ----------------------------------------------------------------- */

static size_t inv_find(const hl3_table *t, uint32_t w, uint32_t s, uint32_t sl, int *found)
{
    size_t mask = t->icap - 1, i = slot_home(w, s, sl) & mask;
    while (t->inv[i].writer != HL3_PT_EMPTY) {
        const hl3_inv *b = &t->inv[i];
        if (b->writer == w && b->slab == s && b->slot == sl) {
            *found = 1;
            return i;
        }
        i = (i + 1) & mask;
    }
    *found = 0;
    return i;
}

static void inv_delete_at(hl3_table *t, size_t i)
{
    size_t mask = t->icap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        const hl3_inv *b = &t->inv[j];
        if (b->writer == HL3_PT_EMPTY)
            break;
        size_t k = slot_home(b->writer, b->slab, b->slot) & mask;
        if (!between(i, k, j)) {
            t->inv[i] = t->inv[j];
            i = j;
        }
    }
    t->inv[i].writer = HL3_PT_EMPTY;
    t->ilen--;
}

static int inv_grow(hl3_table *t, size_t need)
{
    if (need * 10 <= t->icap * 7)
        return 0;
    size_t cap = t->icap;
    while (need * 10 > cap * 7)
        cap *= 2;
    hl3_inv *old = t->inv, *p = new_inv(cap);
    if (p == NULL)
        return HL3_PT_NOMEM;
    size_t oldcap = t->icap;
    t->inv = p;
    t->icap = cap;
    for (size_t i = 0; i < oldcap; i++) {
        if (old[i].writer == HL3_PT_EMPTY)
            continue;
        size_t j = slot_home(old[i].writer, old[i].slab, old[i].slot) & (cap - 1);
        while (p[j].writer != HL3_PT_EMPTY)
            j = (j + 1) & (cap - 1);
        p[j] = old[i];
    }
    free(old);
    return 0;
}

static void inv_remove(hl3_table *t, uint32_t w, uint32_t s, uint32_t sl)
{
    int found;
    size_t i = inv_find(t, w, s, sl, &found);
    if (found)
        inv_delete_at(t, i);
}

/* ---- operations ----------------------------------------------------------------------- */

static int valid(const uint64_t *v)
{
    return v[0] < HL3_PT_EMPTY && v[1] <= UINT32_MAX && v[2] <= UINT32_MAX && v[4] <= UINT32_MAX;
}

static void unpack(const hl3_page *p, uint64_t *v)
{
    v[0] = p->writer;
    v[1] = p->slab;
    v[2] = p->slot;
    v[3] = p->gen;
    v[4] = p->length;
    v[5] = p->checksum;
}

/* Remove the page of ``digest`` and its inverse; 1 if there was one (its values in v). */
static int pop_one(hl3_table *t, const uint8_t *digest, uint64_t *v)
{
    int found;
    size_t i = page_find(t, digest, &found);
    if (!found)
        return 0;
    hl3_page p = t->pages[i];
    if (v != NULL)
        unpack(&p, v);
    page_delete_at(t, i);
    inv_remove(t, p.writer, p.slab, p.slot);
    return 1;
}

/* Capacity for one more page and inverse entry is there (callers grow first). */
static void put_one(hl3_table *t, const uint8_t *digest, const uint64_t *v)
{
    uint32_t w = (uint32_t)v[0], s = (uint32_t)v[1], sl = (uint32_t)v[2];
    int found;
    size_t j = inv_find(t, w, s, sl, &found);
    if (found && memcmp(t->inv[j].digest, digest, 16) != 0) {
        /* the slot held another key's page: that page is gone */
        uint8_t other[16];
        memcpy(other, t->inv[j].digest, 16);
        int had;
        size_t k = page_find(t, other, &had);
        if (had)
            page_delete_at(t, k);
        inv_delete_at(t, j);
    }
    size_t i = page_find(t, digest, &found);
    if (found) {
        hl3_page *p = &t->pages[i];
        if (p->writer != w || p->slab != s || p->slot != sl)
            inv_remove(t, p->writer, p->slab, p->slot); /* the key's former slot */
    } else {
        memcpy(t->pages[i].digest, digest, 16);
        t->plen++;
    }
    hl3_page *p = &t->pages[i];
    p->writer = w;
    p->slab = s;
    p->slot = sl;
    p->gen = v[3];
    p->length = (uint32_t)v[4];
    p->checksum = v[5];
    j = inv_find(t, w, s, sl, &found);
    if (!found) {
        t->inv[j].writer = w;
        t->inv[j].slab = s;
        t->inv[j].slot = sl;
        t->inv[j].pad = 0;
        t->ilen++;
    }
    memcpy(t->inv[j].digest, digest, 16);
}

static int reserve(hl3_table *t, size_t more)
{
    if (page_grow(t, t->plen + more) != 0 || inv_grow(t, t->ilen + more) != 0)
        return HL3_PT_NOMEM;
    return 0;
}

/* Put pages ``i`` (digest ``digests + 16 i``, values ``values + 6 i``) in order, each
 * superseding the slot's page and the key's former slot. 0, or a negative HL3_PT_*
 * code (nothing applied). */
int hl3_pt_put_many(hl3_table *t, size_t n, const uint8_t *digests, const uint64_t *values)
{
    for (size_t i = 0; i < n; i++)
        if (!valid(values + 6 * i))
            return HL3_PT_BADVALUE;
    if (reserve(t, n) != 0)
        return HL3_PT_NOMEM;
    enum { AHEAD = 8 }; /* buckets of later pages are fetched while this one is put */
    for (size_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const uint64_t *v = values + 6 * (i + AHEAD);
            __builtin_prefetch(&t->pages[page_home(digests + 16 * (i + AHEAD)) & (t->pcap - 1)], 1);
            __builtin_prefetch(&t->inv[slot_home((uint32_t)v[0], (uint32_t)v[1], (uint32_t)v[2])
                                      & (t->icap - 1)], 1);
        }
        put_one(t, digests + 16 * i, values + 6 * i);
    }
    return 0;
}

/* found[i] = 1 where digest i has a page (its values land in values + 6 i when values is
 * not NULL), else 0; the number found. Probes are prefetched a few keys ahead. */
size_t hl3_pt_get_many(const hl3_table *t, size_t n, const uint8_t *digests, uint64_t *values,
                       uint8_t *found)
{
    enum { AHEAD = 8 };
    size_t mask = t->pcap - 1, hits = 0;
    for (size_t i = 0; i < n && i < AHEAD; i++)
        __builtin_prefetch(&t->pages[page_home(digests + 16 * i) & mask]);
    for (size_t i = 0; i < n; i++) {
        if (i + AHEAD < n)
            __builtin_prefetch(&t->pages[page_home(digests + 16 * (i + AHEAD)) & mask]);
        int f;
        size_t b = page_find(t, digests + 16 * i, &f);
        found[i] = (uint8_t)f;
        if (f) {
            hits++;
            if (values != NULL)
                unpack(&t->pages[b], values + 6 * i);
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
    if (w >= HL3_PT_EMPTY || s > UINT32_MAX || sl > UINT32_MAX)
        return 0;
    int found;
    size_t i = inv_find(t, (uint32_t)w, (uint32_t)s, (uint32_t)sl, &found);
    if (found)
        memcpy(digest, t->inv[i].digest, 16);
    return found;
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
size_t hl3_pt_select(const hl3_table *t, int64_t writer, int64_t slab, uint8_t *digests,
                     uint64_t *values, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; i < t->pcap; i++) {
        const hl3_page *p = &t->pages[i];
        if (p->writer == HL3_PT_EMPTY || (writer >= 0 && p->writer != (uint64_t)writer)
            || (slab >= 0 && p->slab != (uint64_t)slab))
            continue;
        if (digests != NULL && n < max) {
            memcpy(digests + 16 * n, p->digest, 16);
            unpack(p, values + 6 * n);
        }
        n++;
    }
    return n;
}

/* The inverse: (writer, slab, slot) as three uint64 and the digest, per entry (up to
 * ``max``); how many entries there are. */
size_t hl3_pt_slots(const hl3_table *t, uint64_t *where, uint8_t *digests, size_t max)
{
    size_t n = 0;
    for (size_t i = 0; i < t->icap; i++) {
        const hl3_inv *b = &t->inv[i];
        if (b->writer == HL3_PT_EMPTY)
            continue;
        if (n < max) {
            where[3 * n] = b->writer;
            where[3 * n + 1] = b->slab;
            where[3 * n + 2] = b->slot;
            memcpy(digests + 16 * n, b->digest, 16);
        }
        n++;
    }
    return n;
}

/* ---- live PUT records of an index log ------------------------------------------------- */

/* The xxhash library's XXH3_128bits_withSeed (the caller passes it, as for batch_io.c). */
typedef struct {
    uint64_t low64, high64;
} hl3_xxh128;
typedef hl3_xxh128 (*hl3_xxh128_fn)(const void *, size_t, uint64_t);

static uint32_t crc_table[256];

static void crc_init(void)
{
    if (crc_table[1] != 0)
        return;
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}

static uint32_t crc32_of(const uint8_t *p, size_t n) /* zlib.crc32 */
{
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++)
        c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

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
    crc_init();
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
        if (crc32_of(r + 4, HL3_RECORD - 4 + keylen) != le32(r))
            return -1;
        if (kind == HL3_PUT) {
            hl3_xxh128 h = hash(key, keylen, seed);
            uint8_t digest[16]; /* the canonical (big-endian) form, as xxhash.xxh3_128_digest */
            uint64_t hi = __builtin_bswap64(h.high64), lo = __builtin_bswap64(h.low64);
            memcpy(digest, &hi, 8);
            memcpy(digest + 8, &lo, 8);
            int found;
            size_t b = page_find(t, digest, &found);
            if (found) {
                const hl3_page *p = &t->pages[b];
                if (p->writer == le32(r + 8) && p->slab == le32(r + 12) && p->slot == le32(r + 16)
                    && p->gen == le64(r + 24)) {
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
    size_t pos = 0, read = 0, m = 0, mask = t->pcap - 1;
    long out = -1;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *key = keys + pos;
        const uint8_t *nl = pos < keys_len ? memchr(key, '\n', keys_len - pos) : NULL;
        if (nl == NULL)
            goto done;
        at[i] = pos;
        pos += (size_t)(nl - key) + 1;
        canonical128(hash(key, (size_t)(nl - key), seed), digests + 16 * i);
        __builtin_prefetch(&t->pages[page_home(digests + 16 * i) & mask]);
    }
    if (pos != keys_len)
        goto done;
    at[n] = pos;
    for (size_t i = 0; i < n; i++) {
        int found;
        size_t b = page_find(t, digests + 16 * i, &found);
        if (!found) {
            code[i] = HL3_PLAN_MISS;
            slab_of[i] = -1;
            continue;
        }
        const hl3_page *p = &t->pages[b];
        unpack(p, values + 6 * i);
        /* the slab of every indexed key (a batch's pages share few: look back at the distinct
         * ones seen so far): the caller opens each, and an unopenable one makes its keys
         * miss whatever else they are, as SlabIndex.lookup does */
        size_t k = m;
        if (m > 0 && slabs[2 * (m - 1)] == p->writer && slabs[2 * (m - 1) + 1] == p->slab)
            k = m - 1;
        else
            for (k = 0; k < m; k++)
                if (slabs[2 * k] == p->writer && slabs[2 * k + 1] == p->slab)
                    break;
        if (k == m) {
            slabs[2 * m] = p->writer;
            slabs[2 * m + 1] = p->slab;
            m++;
        }
        slab_of[i] = (int32_t)k;
        if ((int64_t)p->length != g->slot_bytes) {
            code[i] = HL3_PLAN_SIZE;
            continue;
        }
        if (verified_only && p->checksum == 0) {
            code[i] = HL3_PLAN_UNVERIFIED;
            continue;
        }
        code[i] = HL3_PLAN_READ;
        uint64_t s = p->slot;
        data_offs[read] = (int64_t)(((s >> g->shift) + 1) * (uint64_t)g->table + s * (uint64_t)g->data_stride);
        marker_offs[read] = (int64_t)((s >> g->shift) * (uint64_t)g->span + s * (uint64_t)g->record);
        uint8_t fp[16];
        canonical128(hash(keys + at[i], at[i + 1] - at[i] - 1, 0), fp);
        marker_record(expect + 128 * read, p->gen, p->length, p->checksum, fp);
        csums[read] = p->checksum;
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
