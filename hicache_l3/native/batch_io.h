/* What the batch page I/O files share (batch_io.c, batch_share.c, nixl_rows.c, uring_io.c). */
#ifndef HL3_BATCH_IO_H
#define HL3_BATCH_IO_H
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* The xxhash wheel's XXH3-64 entry points, passed by the caller. */
struct hl3_xxh3 {
    uint64_t (*one)(const void *, size_t);
    void *(*create)(void);
    int (*free_state)(void *);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    uint64_t (*digest)(void *);
};

/* HL3_AGAIN: a page of a nowait read whose data were not all in the page cache (not read) */
enum { HL3_OK = 0, HL3_SHORT = 1, HL3_HEADER = 2, HL3_CHECKSUM = 3, HL3_NOMEM = 4, HL3_AGAIN = 5 };

/* Internal page states within one call (never returned): to do; data in and good (or no
 * checksum); data in, checksum bad. */
enum { HL3_TODO = 100, HL3_STEP = 101, HL3_BADSUM = 102 };

#define HL3_CSUM_AT 24 /* byte offset of the checksum in a marker record (slab/format.py START) */
#define HL3_MAX_IOV 1024

static inline size_t iov_bytes(const struct iovec *iov, int n)
{
    size_t t = 0;
    for (int i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* Whether a page of n segments fits one vectored call. */
static inline int nseg_ok(int n) { return n >= 1 && n < HL3_MAX_IOV; }

static inline void xxh_free(const struct hl3_xxh3 *x, void *state)
{
    if (state != NULL)
        x->free_state(state);
}

#define HL3_HIDDEN __attribute__((visibility("hidden")))
/* The XXH3 of n segments (0 is never a checksum: it becomes 1); 0 when no hash state could
 * be made (*state: the caller's, made on first need). */
HL3_HIDDEN uint64_t io_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n);
/* A page's XXH3 into *csum and its marker's checksum field: HL3_OK, or HL3_NOMEM. */
HL3_HIDDEN int io_stamp_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n,
                                 unsigned char *marker, uint64_t *csum);
HL3_HIDDEN int io_count_bad(int lo, int hi, const int32_t *status);
/* Move the marker records of items lo..hi-1 whose status is `from` (len bytes each, at
 * offs[j] of fds[j], in bufs[(j - base) * len ..]), adjacent ones in one call; a moved
 * item's status becomes `to`, a failed one's HL3_SHORT or -errno. */
HL3_HIDDEN void io_move_markers(int writing, int lo, int hi, const int32_t *fds, const int64_t *offs,
                                unsigned char *bufs, int base, int64_t len, int32_t *status, int32_t from,
                                int32_t to);
HL3_HIDDEN int io_read_plan(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                            const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                            const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                            const struct hl3_xxh3 *x, int32_t *status, int nowait);
int hl3_write_pages(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                    const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                    unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                    const struct hl3_xxh3 *x, int32_t *status);

/* A read page's checksum check: `ok` when the XXH3 of its segments is `want`, `bad` when
 * not, HL3_NOMEM when no hash state could be made. */
static inline int32_t io_verify(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n,
                                uint64_t want, int32_t ok, int32_t bad)
{
    uint64_t c = io_checksum(x, state, seg, n);
    return c == 0 ? HL3_NOMEM : c == want ? ok : bad;
}

#endif
