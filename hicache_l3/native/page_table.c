/* The page table (page_table.h): mappings, the page map and its inverse, the two layers,
 * the journal and the batch operations. */
#include "page_table.h"

/* ---- mappings ------------------------------------------------------------------------- */

static size_t mapped(size_t bytes)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (bytes + page - 1) / page * page;
}

void *pt_map_zero(size_t bytes)
{
    void *p = mmap(NULL, mapped(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

/* pt_map_zero for an array filled whole at once (a copy, a rebuild): big ones ask for
 * transparent huge pages; sparse and small ones stay 4 KiB paged. */
#define HL3_HUGE_MIN (8u << 20)
void *pt_map_dense(size_t bytes)
{
    void *p = pt_map_zero(bytes);
#ifdef MADV_HUGEPAGE
    if (p != NULL && bytes >= HL3_HUGE_MIN)
        (void)madvise(p, mapped(bytes), MADV_HUGEPAGE);
#endif
    return p;
}

void pt_unmap(void *p, size_t bytes)
{
    if (p != NULL)
        munmap(p, mapped(bytes));
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

/* Forget the classes from ``keep`` on (added by a refused call), newest first: no probe
 * run of an older class passes through a newer one. */
static void drop_classes(hl3_header *h, uint64_t keep)
{
    while (h->nclasses > keep) {
        h->nclasses--;
        h->classes[class_bucket(h, h->lengths[h->nclasses])] = 0;
        h->lengths[h->nclasses] = 0;
    }
}

/* ---- the table ------------------------------------------------------------------------ */

void pt_unmap_arrays(hl3_page *pages, uint32_t *inv, uint16_t *meta, uint64_t cap)
{
    pt_unmap(pages, cap * sizeof(hl3_page));
    pt_unmap(inv, cap * sizeof(uint32_t));
    pt_unmap(meta, cap * sizeof(uint16_t));
}

/* Zeroed arrays for ``cap`` buckets: 0, or HL3_PT_NOMEM (none left mapped). */
int pt_map_arrays(uint64_t cap, hl3_page **pages, uint32_t **inv, uint16_t **meta)
{
    *pages = pt_map_dense(cap * sizeof(hl3_page));
    *inv = pt_map_dense(cap * sizeof(uint32_t));
    *meta = pt_map_dense(cap * sizeof(uint16_t));
    if (*pages != NULL && *inv != NULL && *meta != NULL)
        return 0;
    pt_unmap_arrays(*pages, *inv, *meta, cap);
    return HL3_PT_NOMEM;
}

/* Move every page into new arrays of ``cap`` buckets (>= len / 0.8) and build their inverse. */
static int rebuild(hl3_table *t, uint64_t cap)
{
    hl3_page *pages;
    uint32_t *inv;
    uint16_t *meta;
    if (cap > HL3_PT_MAX_CAP || pt_map_arrays(cap, &pages, &inv, &meta) != 0)
        return HL3_PT_NOMEM;
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
    pt_unmap_arrays(old, t->inv, t->meta, oldcap);
    t->pages = pages;
    t->inv = inv;
    t->meta = meta;
    t->h->cap = cap;
    return 0;
}

static inline uint64_t cap_of(uint64_t pages) { return (pages * 5 + 3) / 4; } /* load 0.8 */

/* The capacity to rebuild at for pages needing ``need`` buckets that would get ``cap``:
 * the expected one instead when it holds them and ``cap`` passes it or is within a step. */
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
    t->h = pt_map_zero(sizeof(hl3_header));
    if (t->h == NULL || rebuild(t, HL3_PT_MIN_CAP) != 0) {
        pt_unmap(t->h, sizeof(hl3_header));
        free(t);
        return NULL;
    }
    return t;
}

void hl3_pt_journal_stop(hl3_table *t)
{
    hl3_pt_journal_free(t->journal);
    t->journal = NULL;
}

void hl3_pt_free(hl3_table *t)
{
    if (t == NULL)
        return;
    hl3_pt_journal_stop(t);
    if (t->base != NULL) {
        pt_unmap(t->dead, dead_bytes(t->base->h->cap));
        pt_free_base(t->base);
    }
    pt_unmap_arrays(t->pages, t->inv, t->meta, t->h->cap);
    pt_unmap(t->h, sizeof(hl3_header));
    free(t);
}

/* Presize both arrays for ``pages`` pages at load <= 0.8 (never shrinks; the expected
 * capacity instead when within one growth step): 0, or HL3_PT_NOMEM (table unchanged). */
int hl3_pt_reserve(hl3_table *t, uint64_t pages)
{
    if (fits(pages, t->h->cap))
        return 0;
    if (pages > HL3_PT_MAX_CAP)
        return HL3_PT_NOMEM;
    return rebuild(t, toward_expected(t->h, cap_of(pages), cap_of(pages)));
}

/* The table is expected to hold at most ``pages`` pages (0: no hint): nothing is
 * allocated now, but a growth or reserve within one 1.5x step of that capacity goes to it. */
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

/* Private bytes mapped for the table (with a base: its header copy and dead bits too, not
 * its shared file mapping). */
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
size_t pt_page_find(const hl3_table *t, const uint8_t *digest, int *found)
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

/* The inverse bucket naming page bucket ``page`` (at ``location``): there by the
 * invariant. Compares indices only, so it holds while a page is copied. */
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

/* Remove page bucket ``i`` and its inverse entry ``inv`` (the one naming ``i``). */
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

static void page_delete_at(hl3_table *t, size_t i) { page_delete_with(t, i, inv_of(t, t->pages[i].location, i)); }

/* ---- the two layers ------------------------------------------------------------------- */

/* The page of ``digest`` (the delta's, else the base's live one) and, in *h, the header
 * of the layer holding it (for its length classes); NULL when none. */
const hl3_page *pt_lookup(const hl3_table *t, const uint8_t *digest, const hl3_header **h)
{
    int found;
    size_t i = pt_page_find(t, digest, &found);
    if (found) {
        *h = t->h;
        return &t->pages[i];
    }
    const hl3_table *b = t->base;
    if (b != NULL) {
        i = pt_page_find(b, digest, &found);
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
const hl3_page *pt_page_at(const hl3_table *t, uint64_t location)
{
    int found;
    size_t i = inv_find(t, location, &found);
    if (found)
        return &t->pages[t->inv[i] - 1];
    long j = base_at(t, location);
    return j < 0 ? NULL : &t->base->pages[j];
}

/* Before the delta takes ``digest`` at ``location``: the base's live pages of that digest
 * and in that slot are removed. */
static void kill_base_of(hl3_table *t, const uint8_t *digest, uint64_t location)
{
    if (t->base == NULL)
        return;
    int found;
    size_t i = pt_page_find(t->base, digest, &found);
    if (found && alive(t, i))
        kill(t, i);
    long j = base_at(t, location);
    if (j >= 0)
        kill(t, (size_t)j);
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
int pt_pop_one(hl3_table *t, const uint8_t *digest, uint64_t *v)
{
    int found;
    size_t i = pt_page_find(t, digest, &found);
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
    i = pt_page_find(t->base, digest, &found);
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
    size_t i = pt_page_find(t, digest, &found);
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
    if (in_slot || found) /* else the inverse is as inv_find left it: j ends the probe run */
        j = inv_find(t, location, &in_slot);
    inv_place(t, location, i, j);
}

/* Put pages ``i`` (digest ``digests + 16 i``, values ``values + 6 i``) in order, each
 * superseding the slot's page and the key's former slot. 0, or HL3_PT_* (nothing applied). */
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

/* found[i] = 1 where digest i has a page (its values at values + 6 i when values is not
 * NULL), else 0; the number found. */
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
        const hl3_page *p = pt_lookup(t, digests + 16 * i, &h);
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
        gone += (size_t)pt_pop_one(t, digests + 16 * i, NULL);
    return gone;
}

/* Remove the page of ``digest``: 1 (its values in v) or 0. */
int hl3_pt_pop(hl3_table *t, const uint8_t *digest, uint64_t *v) { return pt_pop_one(t, digest, v); }

/* The digest of the page in slot (writer, slab, slot): 1 (copied to ``digest``) or 0. */
int hl3_pt_at(const hl3_table *t, uint64_t w, uint64_t s, uint64_t sl, uint8_t *digest)
{
    const hl3_page *p = slot_in_range(w, s, sl) ? pt_page_at(t, pack_location(w, s, sl)) : NULL;
    if (p != NULL)
        memcpy(digest, p->digest, 16);
    return p != NULL;
}

/* hl3_pt_at of slot (writer, slab, slot) then hl3_pt_pop of the digest found, in one
 * probe: 1 (the digest at ``digest``, the values at ``v``) or 0 (no page there). */
int hl3_pt_take_at(hl3_table *t, uint64_t w, uint64_t s, uint64_t sl, uint8_t *digest, uint64_t *v)
{
    if (!slot_in_range(w, s, sl))
        return 0;
    int found;
    uint64_t location = pack_location(w, s, sl);
    size_t j = inv_find(t, location, &found), i;
    const hl3_table *layer = t; /* the delta's page, else the base's live one */
    if (found) {
        i = t->inv[j] - 1;
    } else {
        long b = base_at(t, location);
        if (b < 0)
            return 0;
        layer = t->base;
        i = (size_t)b;
    }
    memcpy(digest, layer->pages[i].digest, 16);
    if (t->journal != NULL)
        journal_add(t, 2, digest, NULL);
    unpack(layer->h, &layer->pages[i], v);
    if (found)
        page_delete_with(t, i, j);
    else
        kill(t, i);
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

/* The pages of ``writer`` (any when negative) in ``slab`` (any when negative) in bucket
 * order, counted from ``n``: copied out (up to ``max``) when ``digests`` is not NULL;
 * returns ``n`` + how many match (also past ``max``). */
size_t pt_select_layer(const hl3_table *t, const hl3_table *layer, int64_t writer, int64_t slab,
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
    size_t n = pt_select_layer(t, t, writer, slab, digests, values, 0, max);
    if (t->base != NULL)
        n = pt_select_layer(t, t->base, writer, slab, digests, values, n, max);
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

/* One layer's invariants: 0, or 1 (a page not found from its home), 2 (an inverse entry
 * not found from its home or naming a free bucket), 3 (counts disagree), 4 (a bad class). */
static int check_layer(const hl3_table *t)
{
    uint64_t cap = t->h->cap, pages = 0, entries = 0;
    for (size_t i = 0; i < cap; i++) {
        const hl3_page *p = &t->pages[i];
        if (p->location == 0)
            continue;
        pages++;
        int found;
        if (pt_page_find(t, p->digest, &found) != i || !found)
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

/* The table's invariants, for tests: 0, check_layer's codes, 5 (a dead bit on a free base
 * bucket, or ndead wrong) or 6 (a live base page has a delta page's digest or slot). */
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
        size_t j = pt_page_find(b, p->digest, &found);
        if ((found && alive(t, j)) || base_at(t, p->location) >= 0)
            return 6;
    }
    return 0;
}
