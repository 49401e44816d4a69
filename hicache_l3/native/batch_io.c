/* Batch page I/O for the slab connectors: one call moves a share of a batch (preadv /
 * pwritev, start-header check, XXH3 checksum) with the GIL released once, instead of
 * several ctypes / os calls per page. Loaded with ctypes (no Python C API): see
 * hicache_l3/slab/native.py (loaded by hicache_l3/slab/io.py), which keeps a pure-Python path as the reference and
 * the fallback when this library is not built.
 *
 * XXH3 is not compiled in: the caller passes the entry points of the xxhash wheel's
 * own library, so checksums are bit-identical to xxhash.xxh3_64 (a test checks it).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

typedef uint64_t (*xxh_one_fn)(const void *, size_t);
typedef void *(*xxh_create_fn)(void);
typedef int (*xxh_free_fn)(void *);
typedef int (*xxh_reset_fn)(void *);
typedef int (*xxh_update_fn)(void *, const void *, size_t);
typedef uint64_t (*xxh_digest_fn)(void *);

struct hl3_xxh3 {
    xxh_one_fn one;
    xxh_create_fn create;
    xxh_free_fn free_state;
    xxh_reset_fn reset;
    xxh_update_fn update;
    xxh_digest_fn digest;
};

enum { HL3_OK = 0, HL3_SHORT = 1, HL3_HEADER = 2, HL3_CHECKSUM = 3, HL3_NOMEM = 4 };

#define HL3_CSUM_AT 24 /* byte offset of the checksum in a start header (slabs.START) */
#define HL3_MAX_IOV 1024

static uint64_t checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n)
{
    uint64_t v;
    if (n == 1) {
        v = x->one(seg[0].iov_base, seg[0].iov_len);
    } else {
        if (*state == NULL && (*state = x->create()) == NULL)
            return 0;
        x->reset(*state);
        for (int i = 0; i < n; i++)
            x->update(*state, seg[i].iov_base, seg[i].iov_len);
        v = x->digest(*state);
    }
    return v ? v : 1; /* 0 means "no checksum" in a header */
}

/* preadv (writing = 0) or pwritev, retried on EINTR: bytes moved, or -errno. */
static ssize_t transfer(int writing, int fd, const struct iovec *iov, int n, off_t off)
{
    ssize_t r;
    do {
        r = writing ? pwritev(fd, iov, n, off) : preadv(fd, iov, n, off);
    } while (r < 0 && errno == EINTR);
    return r < 0 ? -errno : r;
}

static size_t total(const struct iovec *iov, int n)
{
    size_t t = 0;
    for (int i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* The iovecs of page j: its start header (hdr_len bytes at headers + j * hdr_len), then
 * its segments segs[at[j] .. at[j+1]); the count, or -EINVAL. */
static int page_iov(struct iovec *v, int j, unsigned char *headers, int64_t hdr_len,
                    const struct iovec *segs, const int32_t *at)
{
    int n = at[j + 1] - at[j];
    if (n < 1 || n >= HL3_MAX_IOV)
        return -EINVAL;
    v[0].iov_base = headers + (size_t)j * hdr_len;
    v[0].iov_len = (size_t)hdr_len;
    memcpy(v + 1, segs + at[j], (size_t)n * sizeof *v);
    return n + 1;
}

/* Read one page (its n iovecs v, header first); HL3_* or -errno. */
static int32_t read_one(int fd, off_t off, const struct iovec *v, int n, const unsigned char *expect,
                        int64_t hdr_len, uint64_t csum, const struct hl3_xxh3 *x, void **state)
{
    ssize_t got = transfer(0, fd, v, n, off);
    if (got < 0)
        return (int32_t)got;
    if ((size_t)got != total(v, n))
        return HL3_SHORT;
    if (memcmp(v[0].iov_base, expect, (size_t)hdr_len) != 0)
        return HL3_HEADER;
    if (csum == 0)
        return HL3_OK;
    uint64_t c = checksum(x, state, v + 1, n - 1);
    return c == 0 ? HL3_NOMEM : (c == csum ? HL3_OK : HL3_CHECKSUM);
}

/* Write one page (its n iovecs v, header first, with room for one more): checksum it into
 * csum and its header when with_csum, then write it. Without a checksum the end marker goes
 * first, in its own pwrite, then header + segments: a reader that overlaps the rewrite and
 * saw any new byte then reads the new end marker (it reads the marker last). With a
 * checksum, and the marker right after the data, header + segments + end marker go in one
 * pwritev: every reader of a checksummed entry verifies the checksum, which catches an
 * overlapped (torn) read without the marker's ordering. HL3_* or -errno. */
static int32_t write_one(int fd, off_t off, struct iovec *v, int n, const unsigned char *end_marker,
                         off_t end_off, int64_t hdr_len, int with_csum, uint64_t *csum,
                         const struct hl3_xxh3 *x, void **state)
{
    if (with_csum) {
        uint64_t c = checksum(x, state, v + 1, n - 1);
        if (c == 0)
            return HL3_NOMEM;
        *csum = c;
        unsigned char *h = v[0].iov_base;
        for (int b = 0; b < 8; b++)
            h[HL3_CSUM_AT + b] = (unsigned char)(c >> (8 * b));
    }
    size_t body = total(v, n);
    ssize_t put;
    if (with_csum && n < HL3_MAX_IOV && end_off == off + (off_t)body) {
        v[n].iov_base = (void *)end_marker;
        v[n].iov_len = (size_t)hdr_len;
        put = transfer(1, fd, v, n + 1, off);
        if (put < 0)
            return (int32_t)put;
        return (size_t)put == body + (size_t)hdr_len ? HL3_OK : HL3_SHORT;
    }
    struct iovec end = {(void *)end_marker, (size_t)hdr_len};
    put = transfer(1, fd, &end, 1, end_off);
    if (put < 0)
        return (int32_t)put;
    if (put != hdr_len)
        return HL3_SHORT;
    put = transfer(1, fd, v, n, off);
    if (put < 0)
        return (int32_t)put;
    return (size_t)put == body ? HL3_OK : HL3_SHORT;
}

/* Pages lo..hi-1 of a batch. Page j reads its start header into headers[j * hdr_len ..]
 * and its segments segs[at[j] .. at[j+1]) from fds[j] at offs[j] in one preadv. The
 * header must equal expect[j * hdr_len ..] and, where csums[j] != 0, the XXH3 of the
 * segments must equal csums[j]. status[j]: HL3_* or -errno; returns the number not OK. */
int hl3_read_pages(int lo, int hi, const int32_t *fds, const int64_t *offs,
                   const struct iovec *segs, const int32_t *at, unsigned char *headers,
                   const unsigned char *expect, int64_t hdr_len, const uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    struct iovec v[HL3_MAX_IOV];
    void *state = NULL;
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        int n = page_iov(v, j, headers, hdr_len, segs, at);
        status[j] = n < 0 ? n : read_one(fds[j], offs[j], v, n, expect + (size_t)j * hdr_len, hdr_len,
                                         csums[j], x, &state);
        bad += status[j] != HL3_OK;
    }
    if (state != NULL)
        x->free_state(state);
    return bad;
}

/* Pages lo..hi-1: where with_csum, the XXH3 of page j's segments segs[at[j] .. at[j+1])
 * goes into csums[j] and into its start header headers[j * hdr_len ..] (little-endian at
 * HL3_CSUM_AT); then the end marker ends[j * hdr_len ..] is written at end_offs[j] and
 * the header + segments at offs[j]: end marker first, or all three in one pwritev when
 * checksummed and the marker follows the data (write_one; slab/format.py "Slots").
 * status[j]: HL3_OK, HL3_SHORT, HL3_NOMEM or -errno; returns the number not OK. */
int hl3_write_pages(int lo, int hi, const int32_t *fds, const int64_t *offs,
                    const struct iovec *segs, const int32_t *at, unsigned char *headers,
                    const unsigned char *ends, const int64_t *end_offs, int64_t hdr_len,
                    int with_csum, uint64_t *csums, const struct hl3_xxh3 *x, int32_t *status)
{
    struct iovec v[HL3_MAX_IOV + 1]; /* + 1: the end marker (write_one) */
    void *state = NULL;
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        int n = page_iov(v, j, headers, hdr_len, segs, at);
        status[j] = n < 0 ? n : write_one(fds[j], offs[j], v, n, ends + (size_t)j * hdr_len, end_offs[j],
                                          hdr_len, with_csum, csums + j, x, &state);
        bad += status[j] != HL3_OK;
    }
    if (state != NULL)
        x->free_state(state);
    return bad;
}

/* Slot markers lo..hi-1 of a batch, each len bytes: marker j is at offs[j] of fds[j] and
 * in bufs[j * len ..]. writing: pwrite each. Reading: pread each into bufs and, where
 * expect is not NULL, compare it with expect[j * len ..] (HL3_HEADER when it differs).
 * status[j]: HL3_OK, HL3_SHORT, HL3_HEADER or -errno; returns the number not OK. For
 * the NIXL file transport, whose page data move in one NIXL transfer per batch while
 * the markers around it move here, with the GIL released once per batch. */
int hl3_markers(int writing, int lo, int hi, const int32_t *fds, const int64_t *offs,
                unsigned char *bufs, const unsigned char *expect, int64_t len, int32_t *status)
{
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        struct iovec v = {bufs + (size_t)j * len, (size_t)len};
        ssize_t r = transfer(writing, fds[j], &v, 1, offs[j]);
        if (r < 0)
            status[j] = (int32_t)r;
        else if (r != len)
            status[j] = HL3_SHORT;
        else if (!writing && expect != NULL && memcmp(v.iov_base, expect + (size_t)j * len, (size_t)len) != 0)
            status[j] = HL3_HEADER;
        else
            status[j] = HL3_OK;
        bad += status[j] != HL3_OK;
    }
    return bad;
}
