/* The NIXL file transport's batch helpers (hicache_l3/connectors/nixl/file.py). */
#include "batch_io.h"

/* The NIXL transfer rows of pages 0..n-1 (page j's segments segs[at[j] .. at[j+1]) to /
 * from offs[j] of fds[j] onward): local (address, length, 0) and remote (offset, length,
 * fd) at local[3 m ..] and remote[3 m ..] (room for at[n] rows), a row continuing the
 * previous one on both sides joined into it within max_bytes (<= 0: none joined). The
 * rows of connectors/nixl/base.py coalesce(). Returns m, the number of rows. */
int64_t hl3_join_rows(int n, const struct iovec *segs, const int32_t *at, const int32_t *fds,
                      const int64_t *offs, uint64_t *local, uint64_t *remote, int64_t max_bytes)
{
    int64_t m = 0;
    for (int j = 0; j < n; j++) {
        uint64_t off = (uint64_t)offs[j], fd = (uint64_t)(int64_t)fds[j];
        for (int s = at[j]; s < at[j + 1]; s++) {
            uint64_t addr = (uint64_t)(uintptr_t)segs[s].iov_base, len = (uint64_t)segs[s].iov_len;
            if (m > 0) {
                uint64_t *l = local + 3 * (m - 1), *r = remote + 3 * (m - 1);
                if (l[0] + l[1] == addr && r[0] + r[1] == off && r[2] == fd && max_bytes > 0
                    && l[1] + len <= (uint64_t)max_bytes) {
                    l[1] += len;
                    r[1] += len;
                    off += len;
                    continue;
                }
            }
            uint64_t *l = local + 3 * m, *r = remote + 3 * m;
            l[0] = addr;
            l[1] = len;
            l[2] = 0;
            r[0] = off;
            r[1] = len;
            r[2] = fd;
            off += len;
            m++;
        }
    }
    return m;
}

/* The checksums of pages lo..hi-1 with status[j] == HL3_OK and csums[j] != 0: the XXH3 of
 * segs[at[j] .. at[j+1]) must equal csums[j] (HL3_CHECKSUM when not, HL3_NOMEM when no
 * hash state could be made). Returns the number not OK. */
int hl3_check_sums(int lo, int hi, const struct iovec *segs, const int32_t *at, const uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    void *state = NULL;
    for (int j = lo; j < hi; j++)
        if (status[j] == HL3_OK && csums[j] != 0)
            status[j] = io_verify(x, &state, segs + at[j], at[j + 1] - at[j], csums[j], HL3_OK, HL3_CHECKSUM);
    xxh_free(x, state);
    return io_count_bad(lo, hi, status);
}


