/* Batch page I/O for the slab connectors (hicache_l3/slab/native.py, loaded with ctypes):
 * one call moves a share of a batch (the data, the slots' marker records, their check,
 * XXH3 checksums) with the GIL released once; adjacent slots move in one syscall.
 */
#include "batch_io.h"

uint64_t io_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n)
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

int io_stamp_checksum(const struct hl3_xxh3 *x, void **state, const struct iovec *seg, int n,
                      unsigned char *marker, uint64_t *csum)
{
    uint64_t c = io_checksum(x, state, seg, n);
    if (c == 0)
        return HL3_NOMEM;
    *csum = c;
    for (int b = 0; b < 8; b++)
        marker[HL3_CSUM_AT + b] = (unsigned char)(c >> (8 * b));
    return HL3_OK;
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

/* A read of `want` bytes (as transfer). With nowait, only what the page cache holds
 * (preadv2 RWF_NOWAIT, where supported): *again set when that is not all of it. */
static ssize_t read_iov(int fd, const struct iovec *iov, int n, off_t off, int nowait, size_t want, int *again)
{
    *again = 0;
#ifdef RWF_NOWAIT
    if (nowait) {
        ssize_t r;
        do {
            r = preadv2(fd, iov, n, off, RWF_NOWAIT);
        } while (r < 0 && errno == EINTR);
        r = r < 0 ? -errno : r;
        if (r != -EOPNOTSUPP && r != -EINVAL) {
            *again = r != (ssize_t)want;
            return r;
        }
    }
#else
    (void)nowait, (void)want;
#endif
    return transfer(0, fd, iov, n, off);
}

#ifndef HL3_READ_RUN
#define HL3_READ_RUN (256 << 10) /* most bytes of one coalesced read: hashed while in cache */
#endif

/* The ABI of this library's calls (slab format 2: marker records apart from the data). */
int hl3_abi(void)
{
    return 2;
}

/* (batch_io.h; a failed run is retried item by item) */
void io_move_markers(int writing, int lo, int hi, const int32_t *fds, const int64_t *offs,
                     unsigned char *bufs, int base, int64_t len, int32_t *status, int32_t from, int32_t to)
{
    int j = lo;
    while (j < hi) {
        if (status[j] != from) {
            j++;
            continue;
        }
        int k = j + 1;
        while (k < hi && status[k] == from && fds[k] == fds[j] && offs[k] == offs[k - 1] + len)
            k++;
        struct iovec v = {bufs + (size_t)(j - base) * len, (size_t)(k - j) * (size_t)len};
        ssize_t r = transfer(writing, fds[j], &v, 1, offs[j]);
        if (r == (ssize_t)v.iov_len) {
            for (int i = j; i < k; i++)
                status[i] = to;
        } else {
            for (int i = j; i < k; i++) {
                struct iovec one = {bufs + (size_t)(i - base) * len, (size_t)len};
                r = k - j == 1 ? r : transfer(writing, fds[i], &one, 1, offs[i]);
                status[i] = r < 0 ? (int32_t)r : r == len ? to : HL3_SHORT;
            }
        }
        j = k;
    }
}

/* Read one page (its nseg segments) from fd at off in pieces of at most `piece` bytes,
 * hashing each right after its read when want != 0. Returns `to` (read; its hash matches
 * or none is wanted), HL3_CHECKSUM, HL3_NOMEM, HL3_SHORT, -errno, or HL3_AGAIN (nowait). */
static int32_t read_in_pieces(int fd, int64_t off, const struct iovec *segs, int nseg, size_t piece,
                              uint64_t want, const struct hl3_xxh3 *x, void **state, int nowait, int32_t to)
{
    if (want != 0) {
        if (*state == NULL && (*state = x->create()) == NULL)
            return HL3_NOMEM;
        x->reset(*state);
    }
    struct iovec part[HL3_MAX_IOV];
    int s = 0;
    size_t in = 0; /* bytes of segs[s] already read */
    while (s < nseg) {
        int m = 0;
        size_t got = 0;
        while (s < nseg && got < piece && m < HL3_MAX_IOV) {
            size_t take = segs[s].iov_len - in;
            if (take > piece - got)
                take = piece - got;
            part[m].iov_base = (char *)segs[s].iov_base + in;
            part[m].iov_len = take;
            m++;
            got += take;
            in += take;
            if (in == segs[s].iov_len) {
                s++;
                in = 0;
            }
        }
        int again;
        ssize_t r = read_iov(fd, part, m, off, nowait, got, &again);
        if (again)
            return HL3_AGAIN;
        if (r < 0)
            return (int32_t)r;
        if ((size_t)r != got)
            return HL3_SHORT;
        if (want != 0)
            for (int i = 0; i < m; i++)
                x->update(*state, part[i].iov_base, part[i].iov_len);
        off += (int64_t)got;
    }
    if (want == 0)
        return to;
    uint64_t c = x->digest(*state);
    return (c ? c : 1) == want ? to : HL3_CHECKSUM;
}

/* Move the data of pages lo..hi-1 whose status is `from`: page j's segments
 * segs[at[j] .. at[j+1]) at offs[j] of fds[j]; pages adjacent in the file go in one call
 * of up to HL3_MAX_IOV iovecs and (max_bytes > 0) until it holds max_bytes. A moved page's
 * status becomes `to`; a failed one's HL3_SHORT or -errno (retried page by page). Where
 * csums is not NULL (a read), each moved page with csums[i] != 0 is hashed right after
 * its call (HL3_CHECKSUM or HL3_NOMEM when bad); such a page bigger than max_bytes is
 * read in pieces. With nowait (reads only), a call the page cache cannot serve whole
 * leaves its pages HL3_AGAIN. */
static void move_pages(int writing, int lo, int hi, const int32_t *fds, const int64_t *offs,
                       const struct iovec *segs, const int32_t *at, int32_t *status, int32_t from,
                       int32_t to, int64_t max_bytes, const uint64_t *csums,
                       const struct hl3_xxh3 *x, void **state, int nowait)
{
    int j = lo;
    while (j < hi) {
        if (status[j] != from) {
            j++;
            continue;
        }
        int nv = at[j + 1] - at[j];
        int64_t end = offs[j] + (int64_t)iov_bytes(segs + at[j], nv);
        if (csums != NULL && csums[j] != 0 && max_bytes > 0 && end - offs[j] > max_bytes) {
            status[j] = read_in_pieces(fds[j], offs[j], segs + at[j], nv, (size_t)max_bytes, csums[j], x,
                                       state, nowait && !writing, to);
            j++;
            continue;
        }
        int k = j + 1;
        while (k < hi && status[k] == from && fds[k] == fds[j] && offs[k] == end) {
            int m = at[k + 1] - at[k];
            if (nv + m > HL3_MAX_IOV || (max_bytes > 0 && end - offs[j] >= max_bytes))
                break;
            nv += m;
            end += (int64_t)iov_bytes(segs + at[k], m);
            k++;
        }
        ssize_t r;
        int again = 0;
        if (writing)
            r = transfer(1, fds[j], segs + at[j], nv, offs[j]);
        else
            r = read_iov(fds[j], segs + at[j], nv, offs[j], nowait, (size_t)(end - offs[j]), &again);
        if (again) {
            for (int i = j; i < k; i++)
                status[i] = HL3_AGAIN;
        } else if (r == end - offs[j]) {
            for (int i = j; i < k; i++)
                status[i] = to;
        } else {
            for (int i = j; i < k; i++) {
                int m = at[i + 1] - at[i];
                size_t want = iov_bytes(segs + at[i], m);
                r = k - j == 1 ? r : transfer(writing, fds[i], segs + at[i], m, offs[i]);
                status[i] = r < 0 ? (int32_t)r : (size_t)r == want ? to : HL3_SHORT;
            }
        }
        if (csums != NULL) /* a read: hash the run's pages while their bytes are in cache */
            for (int i = j; i < k; i++)
                if (status[i] == to && csums[i] != 0)
                    status[i] = io_verify(x, state, segs + at[i], at[i + 1] - at[i], csums[i], to, HL3_CHECKSUM);
        j = k;
    }
}

/* HL3_TODO for pages lo..hi-1 whose segment count fits one call, -EINVAL for the others. */
static void check_segments(int lo, int hi, const int32_t *at, int32_t *status)
{
    for (int j = lo; j < hi; j++)
        status[j] = nseg_ok(at[j + 1] - at[j]) ? HL3_TODO : -EINVAL;
}

int io_count_bad(int lo, int hi, const int32_t *status)
{
    int bad = 0;
    for (int j = lo; j < hi; j++)
        bad += status[j] != HL3_OK;
    return bad;
}

/* Pages lo..hi-1 of a read batch (slab format 2, slab/format.py "The torn-slot argument"):
 * first the data of every page (segments segs[at[j] .. at[j+1]) from fds[j] at
 * data_offs[j]), then every page's marker record (mlen bytes at marker_offs[j], into
 * markers[(j - base) * mlen ..]). A page is HL3_OK when its record equals expect[j * mlen
 * ..] and, where csums[j] != 0, the XXH3 of its segments equals csums[j]; HL3_HEADER when
 * the record differs (whatever the checksum), HL3_CHECKSUM when only the checksum does.
 * status[j]: HL3_* or -errno; returns the number not OK. */
static int read_pages(int lo, int hi, const int32_t *data_fds, const int32_t *fds, const int64_t *data_offs,
                      const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                      unsigned char *markers, int base, const unsigned char *expect, int64_t mlen,
                      const uint64_t *csums, const struct hl3_xxh3 *x, int32_t *status, int nowait)
{
    void *state = NULL;
    check_segments(lo, hi, at, status);
    move_pages(0, lo, hi, data_fds, data_offs, segs, at, status, HL3_TODO, HL3_STEP, HL3_READ_RUN, csums, x,
               &state, nowait);
    /* a page that failed its checksum still has its marker read: it may be a torn miss */
    for (int j = lo; j < hi; j++)
        if (status[j] == HL3_CHECKSUM)
            status[j] = HL3_BADSUM;
    io_move_markers(0, lo, hi, fds, marker_offs, markers, base, mlen, status, HL3_STEP, HL3_TODO);
    io_move_markers(0, lo, hi, fds, marker_offs, markers, base, mlen, status, HL3_BADSUM, HL3_CHECKSUM);
    for (int j = lo; j < hi; j++) {
        int32_t s = status[j]; /* HL3_TODO: data and marker read, checksum good or none */
        if (s != HL3_TODO && s != HL3_CHECKSUM)
            continue;
        if (memcmp(markers + (size_t)(j - base) * mlen, expect + (size_t)j * mlen, (size_t)mlen) != 0)
            status[j] = HL3_HEADER;
        else
            status[j] = s == HL3_TODO ? HL3_OK : HL3_CHECKSUM;
    }
    xxh_free(x, state);
    return io_count_bad(lo, hi, status);
}

int hl3_read_pages(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                   const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                   unsigned char *markers, const unsigned char *expect, int64_t mlen,
                   const uint64_t *csums, const struct hl3_xxh3 *x, int32_t *status)
{
    return read_pages(lo, hi, fds, fds, data_offs, marker_offs, segs, at, markers, 0, expect, mlen, csums, x,
                      status, 0);
}

/* hl3_read_pages with page j's data read from data_fds[j] (an O_DIRECT descriptor of the
 * slab, for an aligned page) and its marker record from fds[j]. */
int hl3_read_pages_apart(int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                         const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                         const int32_t *at, unsigned char *markers, const unsigned char *expect, int64_t mlen,
                         const uint64_t *csums, const struct hl3_xxh3 *x, int32_t *status)
{
    return read_pages(lo, hi, data_fds, fds, data_offs, marker_offs, segs, at, markers, 0, expect, mlen, csums,
                      x, status, 0);
}

/* hl3_read_pages of a planned get (slab/plan.py), the records read into scratch memory of
 * its own (every page HL3_NOMEM when it cannot be had); returns the number not OK. */
int io_read_plan(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                     const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                     const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                     const struct hl3_xxh3 *x, int32_t *status, int nowait)
{
    if (hi <= lo)
        return 0;
    unsigned char *markers = malloc((size_t)(hi - lo) * (size_t)mlen);
    if (markers == NULL) {
        for (int j = lo; j < hi; j++)
            status[j] = HL3_NOMEM;
        return hi - lo;
    }
    int bad = read_pages(lo, hi, fds, fds, data_offs, marker_offs, segs, at, markers, lo, expect, mlen, csums,
                         x, status, nowait);
    free(markers);
    return bad;
}

int hl3_read_plan(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                  const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                  const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                  const struct hl3_xxh3 *x, int32_t *status)
{
    return io_read_plan(lo, hi, fds, data_offs, marker_offs, segs, at, expect, mlen, csums, x, status, 0);
}

/* hl3_read_plan of what the page cache holds: a page whose data would wait for the disk
 * is left HL3_AGAIN (nothing of it read), for a blocking call. Returns the number not OK. */
int hl3_read_plan_nowait(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                         const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                         const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                         const struct hl3_xxh3 *x, int32_t *status)
{
    return io_read_plan(lo, hi, fds, data_offs, marker_offs, segs, at, expect, mlen, csums, x, status, 1);
}

/* Pages lo..hi-1 of a write batch (slab format 2): where with_csum, the XXH3 of page j's
 * segments goes into csums[j] and its marker record markers[j * mlen ..]; then every
 * page's marker record is written at marker_offs[j], and only then every page's data at
 * data_offs[j] (not where its marker failed), adjacent pages coalesced. status[j]: HL3_OK,
 * HL3_SHORT, HL3_NOMEM or -errno; returns the number not OK. */
static int write_pages(int lo, int hi, const int32_t *data_fds, const int32_t *fds, const int64_t *data_offs,
                       const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                       unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                       const struct hl3_xxh3 *x, int32_t *status)
{
    if (with_csum && hi - lo > 1 && iov_bytes(segs + at[lo], at[lo + 1] - at[lo]) > HL3_READ_RUN) {
        /* big checksummed pages: one at a time, written while still in cache */
        int bad = 0;
        for (int j = lo; j < hi; j++)
            bad += write_pages(j, j + 1, data_fds, fds, data_offs, marker_offs, segs, at, markers, mlen,
                               with_csum, csums, x, status);
        return bad;
    }
    void *state = NULL;
    check_segments(lo, hi, at, status);
    if (with_csum) {
        for (int j = lo; j < hi; j++) {
            if (status[j] != HL3_TODO)
                continue;
            if (io_stamp_checksum(x, &state, segs + at[j], at[j + 1] - at[j], markers + (size_t)j * mlen,
                                  csums + j) != HL3_OK)
                status[j] = HL3_NOMEM;
        }
    }
    xxh_free(x, state);
    io_move_markers(1, lo, hi, fds, marker_offs, markers, 0, mlen, status, HL3_TODO, HL3_STEP);
    move_pages(1, lo, hi, data_fds, data_offs, segs, at, status, HL3_STEP, HL3_OK, 0, NULL, x, NULL, 0);
    return io_count_bad(lo, hi, status);
}

int hl3_write_pages(int lo, int hi, const int32_t *fds, const int64_t *data_offs,
                    const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                    unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                    const struct hl3_xxh3 *x, int32_t *status)
{
    return write_pages(lo, hi, fds, fds, data_offs, marker_offs, segs, at, markers, mlen, with_csum, csums, x,
                       status);
}

/* hl3_write_pages with page j's data written to data_fds[j] (an O_DIRECT descriptor of
 * the slab, for an aligned page) and its marker record to fds[j]. */
int hl3_write_pages_apart(int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                          const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                          const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum,
                          uint64_t *csums, const struct hl3_xxh3 *x, int32_t *status)
{
    return write_pages(lo, hi, data_fds, fds, data_offs, marker_offs, segs, at, markers, mlen, with_csum, csums,
                       x, status);
}


/* Slot markers lo..hi-1 of a batch, each len bytes at offs[j] of fds[j] and in bufs[j *
 * len ..]: written, or read and (expect not NULL) compared with expect[j * len ..]
 * (HL3_HEADER when it differs). status[j]: HL3_OK, HL3_SHORT, HL3_HEADER or -errno;
 * returns the number not OK. */
int hl3_markers(int writing, int lo, int hi, const int32_t *fds, const int64_t *offs,
                unsigned char *bufs, const unsigned char *expect, int64_t len, int32_t *status)
{
    for (int j = lo; j < hi; j++)
        status[j] = HL3_TODO;
    io_move_markers(writing, lo, hi, fds, offs, bufs, 0, len, status, HL3_TODO, HL3_OK);
    if (!writing && expect != NULL) {
        for (int j = lo; j < hi; j++) {
            if (status[j] == HL3_OK && memcmp(bufs + (size_t)j * len, expect + (size_t)j * len, (size_t)len) != 0)
                status[j] = HL3_HEADER;
        }
    }
    return io_count_bad(lo, hi, status);
}

