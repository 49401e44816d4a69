/* Images: a page table's file form, the base layer mapped from one, and the journal
 * replayed onto a table built from one. */
#include "page_table.h"

/* An image (little-endian hosts only): this header, the length classes (nclasses uint32,
 * padded to 8 bytes), the page array, the inverse and its meta, each exactly as in memory,
 * so that a read-only mapping of the file is a table to probe. */
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

void pt_free_base(hl3_table *b)
{
    if (__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    pt_unmap(b->h, sizeof(hl3_header));
    munmap(b->map, b->map_len);
    free(b);
}

/* The image of ``bytes`` bytes at ``offset`` (a multiple of 8) of ``fd``, mapped read-only
 * and shared, as a table to probe, or NULL (*err: HL3_PT_BADIMAGE, HL3_PT_NOMEM). The
 * checks make every probe safe (no fault) whatever the bytes. */
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
    if (b == NULL || (b->h = pt_map_zero(sizeof(hl3_header))) == NULL) {
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
        pt_unmap(b->h, sizeof(hl3_header));
        free(b);
    }
    munmap(map, len);
    return NULL;
}

/* The empty table ``t`` takes the image at ``offset`` of ``fd`` (``bytes`` long) as its
 * base (the mapping outlives a rename or unlink of the file). 0, or HL3_PT_BADIMAGE,
 * HL3_PT_NOMEM, HL3_PT_BADVALUE (``t`` is not empty); ``t`` unchanged on failure. */
int hl3_pt_attach(hl3_table *t, int fd, uint64_t offset, uint64_t bytes)
{
    if (t->h->len != 0 || t->base != NULL)
        return HL3_PT_BADVALUE;
    int err;
    hl3_table *b = map_base(fd, offset, bytes, &err);
    if (b == NULL)
        return err;
    uint64_t *dead = pt_map_zero(dead_bytes(b->h->cap));
    if (dead == NULL) {
        pt_free_base(b);
        return HL3_PT_NOMEM;
    }
    t->base = b;
    t->dead = dead;
    t->ndead = 0;
    return 0;
}

/* Whether page ``p`` (of header ``h``) has the values ``v``. */
static int same_page(const hl3_header *h, const hl3_page *p, const uint64_t *v)
{
    uint64_t u[6];
    unpack(h, p, u);
    return memcmp(u, v, sizeof(u)) == 0;
}

/* Move ``t``'s pages onto the image at ``offset`` of ``fd`` as their new base, without
 * changing them: the delta holds the pages the image lacks or holds otherwise, and the
 * image's pages ``t`` lacks or holds otherwise are dead. 0, or HL3_PT_BADIMAGE,
 * HL3_PT_NOMEM; ``t`` unchanged on failure. */
int hl3_pt_rebase(hl3_table *t, int fd, uint64_t offset, uint64_t bytes)
{
    int rc;
    hl3_table *b = map_base(fd, offset, bytes, &rc);
    if (b == NULL)
        return rc;
    hl3_table *n = hl3_pt_new();
    uint64_t *dead = pt_map_zero(dead_bytes(b->h->cap));
    size_t total = hl3_pt_len(t), m = 0;
    uint8_t *ds = malloc(16 * (total ? total : 1));
    uint64_t *vs = malloc(48 * (total ? total : 1));
    if (n == NULL || dead == NULL || ds == NULL || vs == NULL) {
        hl3_pt_free(n);
        pt_unmap(dead, dead_bytes(b->h->cap));
        pt_free_base(b);
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
        size_t i = pt_page_find(b, ds + 16 * k, &found);
        if (found && same_page(b->h, &b->pages[i], vs + 6 * k))
            continue;
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
        const hl3_page *p = pt_lookup(t, b->pages[i].digest, &h);
        uint64_t v[6];
        unpack(b->h, &b->pages[i], v);
        if (p == NULL || !same_page(h, p, v))
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
            pt_pop_one(dst, (const uint8_t *)(r + 1), NULL);
    }
    return rc;
}

/* Apply the changes ``src`` recorded since its journal started, in order, to ``dst`` (a
 * table holding what ``src`` held then), and stop ``src``'s journal. 0, or
 * HL3_PT_NOJOURNAL (none kept or a record lost: ``dst`` unchanged), HL3_PT_NOMEM (``dst``
 * partly changed: drop it). */
int hl3_pt_journal_replay(hl3_table *dst, hl3_table *src)
{
    hl3_journal *j = src->journal;
    int rc = j == NULL || j->failed ? HL3_PT_NOJOURNAL : apply_journal(dst, j);
    hl3_pt_journal_stop(src);
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

/* Whether ``t`` keeps a journal (hl3_pt_journal_start). */
int hl3_pt_journal_has(const hl3_table *t) { return t->journal != NULL; }

/* Records in ``t``'s journal (0: none, or no journal). */
size_t hl3_pt_journal_len(const hl3_table *t) { return t->journal != NULL ? t->journal->n : 0; }

/* ``t``'s journal, handed over (``t`` journals on from none). NULL when ``t`` keeps none,
 * or it lost a record (then it stops), or out of memory (the journal stays). */
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

/* A table (no base, no journal) whose arrays are copies of ``src``'s own, expecting
 * ``expect`` buckets (hl3_pt_expect); NULL when out of memory. */
static hl3_table *copy_arrays(const hl3_table *src, uint64_t expect)
{
    uint64_t cap = src->h->cap;
    hl3_table *c = calloc(1, sizeof(*c));
    if (c == NULL)
        return NULL;
    c->h = pt_map_zero(sizeof(hl3_header));
    if (c->h == NULL || pt_map_arrays(cap, &c->pages, &c->inv, &c->meta) != 0) {
        pt_unmap(c->h, sizeof(hl3_header));
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

/* A copy of ``t`` (no journal) over the same base: copies of the delta's arrays and dead
 * bits, the base's mapping shared (reference counted). A table without a base is copied
 * whole. NULL when out of memory. */
hl3_table *hl3_pt_fork(const hl3_table *t)
{
    hl3_table *c = copy_arrays(t, t->h->expect);
    if (c == NULL || t->base == NULL)
        return c;
    size_t bytes = dead_bytes(t->base->h->cap);
    uint64_t *dead = pt_map_dense(bytes);
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
 * ``digests``/``values`` put after them (a checkpoint's image). Called on a fork off the
 * lock, without the GIL. NULL when out of memory or a value is refused. */
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
                pt_pop_one(c, src->pages[i].digest, NULL);
        size_t m = t->h->len; /* then the delta's pages are put */
        uint8_t *ds = malloc(16 * (m ? m : 1));
        uint64_t *vs = malloc(48 * (m ? m : 1));
        if (ds == NULL || vs == NULL)
            rc = HL3_PT_NOMEM;
        else
            rc = hl3_pt_put_many(c, pt_select_layer(t, t, -1, -1, ds, vs, 0, m), ds, vs);
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
