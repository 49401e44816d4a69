/* Reads served from a shared mapping of a slab file (mapped_read.c), for batch_io.c. */
#ifndef HL3_MAPPED_READ_H
#define HL3_MAPPED_READ_H

#include <stdint.h>
#include <sys/uio.h>

/* The bytes of n iovecs (batch_io.c's too). */
size_t hl3_iov_bytes(const struct iovec *iov, int n);

/* What one read call copied from mappings, per mapping (held until hl3_mapped_done): the
 * span of its page-table entries to drop once the call is over. */
struct hl3_mapped_span {
    void *mapping;
    uintptr_t lo, hi;
};
#define HL3_MAPPED_SPANS 8
struct hl3_mapped_spans {
    int n;
    struct hl3_mapped_span span[HL3_MAPPED_SPANS];
};

/* Pages lo.. of a read whose status is `from`, one after another in the file of fds[lo]
 * from offs[lo] (the longest such run, up to HL3_MAPPED_RUN bytes), copied from the file's
 * mapping (hl3_map_fd) in one pass with their XXH3 where csums[j] != 0, when every byte of
 * them is in the page cache (pages that must come from the disk are left to preadv, which
 * reads them in big requests where faults on a mapping would read them a few pages at a
 * time). A handled page's status becomes `to` (its hash matches or none is wanted) or
 * `bad_sum`. Returns the number of pages handled, from lo: 0 when none was (no mapping,
 * not resident, a page under HL3_MAPPED_MIN_PAGE, or the file shrank under the copy: SIGBUS);
 * the caller reads those its usual way. The mapping stays held in `spans` (n = 0 at the
 * call's start) until hl3_mapped_done(spans), which the caller must call once its reads
 * are over. */
int hl3_mapped_run(int lo, int hi, const int32_t *fds, const int64_t *offs, const struct iovec *segs,
                   const int32_t *at, int32_t *status, int32_t from, int32_t to, int32_t bad_sum,
                   const uint64_t *csums, struct hl3_mapped_spans *spans);

/* Drop the page-table entries the call's copies made (the pages stay in the page cache)
 * and let go of its mappings. */
void hl3_mapped_done(struct hl3_mapped_spans *spans);

#endif
