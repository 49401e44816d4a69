/* What the batch page I/O files share (batch_io.c, batch_share.c, nixl_rows.c). */
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

/* HL3_AGAIN: a page of a nowait read (hl3_read_plan_nowait) whose data were not all in the
 * page cache: not read, to be read again by a blocking call */
enum { HL3_OK = 0, HL3_SHORT = 1, HL3_HEADER = 2, HL3_CHECKSUM = 3, HL3_NOMEM = 4, HL3_AGAIN = 5 };

#define HL3_CSUM_AT 24 /* byte offset of the checksum in a marker record (slab/format.py START) */
#define HL3_MAX_IOV 1024

#define HL3_HIDDEN __attribute__((visibility("hidden")))
HL3_HIDDEN uint64_t io_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n);
HL3_HIDDEN int io_stamp_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n,
                                 unsigned char *marker, uint64_t *csum);
HL3_HIDDEN int io_count_bad(int lo, int hi, const int32_t *status);
HL3_HIDDEN int io_read_plan(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                            const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                            const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                            const struct hl3_xxh3 *x, int32_t *status, int nowait);
int hl3_write_pages(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                    const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                    unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                    const struct hl3_xxh3 *x, int32_t *status);

#endif
