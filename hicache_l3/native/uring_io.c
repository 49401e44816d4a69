/* Batch page I/O through io_uring: a batch's pages in flight at once, up to the ring's depth,
 * from one call on the caller's thread with the GIL released; for pages that wait on the
 * device (O_DIRECT, or cold pages beyond the page cache), where one blocking call per page
 * and thread leaves the device a queue of one or two.
 *
 * Raw syscalls (io_uring_setup, io_uring_enter, mmap of the rings): no liburing. A ring is
 * made per transport and direction (hl3_ring_open), used by one call at a time (its mutex),
 * and torn down by hl3_ring_close; between calls nothing runs (no SQPOLL thread).
 *
 * The order of slab format 2 (hicache_l3/slab/format.py, "The torn-slot argument") holds:
 * a read links each page's marker read after its data read (IOSQE_IO_LINK: the marker read
 * starts only once the data are in); a write puts every marker record first and waits for
 * them all, then the data. Checks and statuses are batch_io.c's read_pages / hl3_write_pages'.
 */
#include "batch_io.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#if defined(__has_include)
#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
#endif
#endif

struct hl3_ring;

/* Kernel headers older than Linux 5.6 (no IORING_OP_READ): the calls are built, and every
 * ring is refused with ENOSYS, as a kernel without io_uring refuses it. */
#if !defined(IORING_FEAT_RW_CUR_POS) || !defined(__NR_io_uring_setup) || !defined(__NR_io_uring_enter)
struct hl3_ring *hl3_ring_open(int depth)
{
    (void)depth;
    errno = ENOSYS;
    return NULL;
}

void hl3_ring_close(struct hl3_ring *r)
{
    (void)r;
}

int hl3_ring_read(struct hl3_ring *r, int lo, int hi, int only, const int32_t *data_fds, const int32_t *fds,
                  const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                  const int32_t *at, const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                  const struct hl3_xxh3 *x, int32_t *status)
{
    (void)r, (void)lo, (void)hi, (void)only, (void)data_fds, (void)fds, (void)data_offs, (void)marker_offs;
    (void)segs, (void)at, (void)expect, (void)mlen, (void)csums, (void)x, (void)status;
    return -ENOSYS;
}

int hl3_ring_write(struct hl3_ring *r, int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                   const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                   const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    (void)r, (void)lo, (void)hi, (void)data_fds, (void)fds, (void)data_offs, (void)marker_offs, (void)segs;
    (void)at, (void)markers, (void)mlen, (void)with_csum, (void)csums, (void)x, (void)status;
    return -ENOSYS;
}
#else

struct hl3_ring {
    pthread_mutex_t lock;
    int fd, depth, broken;
    unsigned sq_entries, cq_entries;
    void *sq_map, *cq_map;
    size_t sq_size, cq_size;
    struct io_uring_sqe *sqes;
    size_t sqes_size;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    unsigned tail; /* our copy of *sq_tail */
};

static int ring_enter(int fd, unsigned submit, unsigned wait)
{
    long r = syscall(__NR_io_uring_enter, fd, submit, wait, wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
    return r < 0 ? -errno : (int)r;
}

void hl3_ring_close(struct hl3_ring *r)
{
    if (r == NULL)
        return;
    if (r->sqes != NULL && r->sqes != MAP_FAILED)
        munmap(r->sqes, r->sqes_size);
    if (r->cq_map != NULL && r->cq_map != MAP_FAILED && r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_size);
    if (r->sq_map != NULL && r->sq_map != MAP_FAILED)
        munmap(r->sq_map, r->sq_size);
    if (r->fd >= 0)
        close(r->fd); /* the kernel reaps what a broken call left in flight */
    pthread_mutex_destroy(&r->lock);
    free(r);
}

/* A ring for `depth` pages in flight (2 entries each: data and marker), or NULL with errno
 * set (ENOSYS, EPERM under a seccomp profile or io_uring_disabled, EINVAL, ENOMEM...). */
struct hl3_ring *hl3_ring_open(int depth)
{
    if (depth < 1 || depth > 4096) {
        errno = EINVAL;
        return NULL;
    }
    struct hl3_ring *r = calloc(1, sizeof(*r));
    if (r == NULL)
        return NULL;
    pthread_mutex_init(&r->lock, NULL);
    r->depth = depth;
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
    long fd = syscall(__NR_io_uring_setup, (unsigned)(2 * depth), &p);
    r->fd = fd < 0 ? -1 : (int)fd;
    if (fd < 0)
        goto fail;
    r->sq_entries = p.sq_entries;
    r->cq_entries = p.cq_entries;
    r->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_size > r->sq_size)
        r->sq_size = r->cq_size;
    r->sq_map = mmap(NULL, r->sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                     IORING_OFF_SQ_RING);
    if (r->sq_map == MAP_FAILED)
        goto fail;
    r->cq_map = single ? r->sq_map
                       : mmap(NULL, r->cq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                              IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED)
        goto fail;
    r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED)
        goto fail;
    char *sq = r->sq_map, *cq = r->cq_map;
    r->sq_head = (unsigned *)(sq + p.sq_off.head);
    r->sq_tail = (unsigned *)(sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)(sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)(sq + p.sq_off.array);
    r->cq_head = (unsigned *)(cq + p.cq_off.head);
    r->cq_tail = (unsigned *)(cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)(cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    r->tail = *r->sq_tail;
    return r;
fail:;
    int e = errno;
    hl3_ring_close(r);
    errno = e;
    return NULL;
}

/* One operation of a call: a page's data or its marker record. */
struct op {
    uint8_t opcode, link;
    int32_t fd;
    uint64_t addr;
    uint32_t len; /* bytes, or the iovec count of a vectored op */
    int64_t off;
    int32_t page, marker;
    uint64_t want; /* the bytes it moves when whole */
};

typedef void (*done_fn)(void *ctx, const struct op *op, int res);

/* Run ops[0..n) through the ring, `group` consecutive ops per page (a group's ops linked in
 * order), at most r->depth groups in flight; done(ctx, op, res) for every op, in completion
 * order. Returns 0, or -errno when the ring failed: the ring is then broken (never used
 * again), and the ops without a done() call are the caller's to fail. */
static int ring_run(struct hl3_ring *r, const struct op *ops, int n, int group, done_fn done, void *ctx)
{
    int next = 0, inflight = 0, err = 0; /* inflight: ops submitted, not completed */
    unsigned mask = *r->sq_mask, cmask = *r->cq_mask;
    while (next < n || inflight > 0) {
        while (next < n && inflight + group <= group * r->depth) {
            for (int g = 0; g < group && next < n; g++, next++) {
                const struct op *o = ops + next;
                unsigned idx = r->tail & mask;
                struct io_uring_sqe *s = r->sqes + idx;
                memset(s, 0, sizeof(*s));
                s->opcode = o->opcode;
                s->fd = o->fd;
                s->addr = o->addr;
                s->len = o->len;
                s->off = (uint64_t)o->off;
                s->flags = o->link ? IOSQE_IO_LINK : 0;
                s->user_data = (uint64_t)next;
                r->sq_array[idx] = idx;
                r->tail++;
                inflight++;
            }
        }
        atomic_store_explicit((_Atomic unsigned *)r->sq_tail, r->tail, memory_order_release);
        unsigned pending = r->tail - atomic_load_explicit((_Atomic unsigned *)r->sq_head, memory_order_acquire);
        int e = ring_enter(r->fd, pending, 1);
        if (e == -EAGAIN || e == -EBUSY) { /* the kernel short of memory, or CQ full: wait */
            struct timespec pause = {0, 100000};
            nanosleep(&pause, NULL);
        } else if (e < 0 && e != -EINTR) {
            err = e;
            break;
        }
        unsigned head = *r->cq_head;
        unsigned tail = atomic_load_explicit((_Atomic unsigned *)r->cq_tail, memory_order_acquire);
        for (; head != tail; head++) {
            const struct io_uring_cqe *c = r->cqes + (head & cmask);
            uint64_t k = c->user_data;
            int res = c->res;
            atomic_store_explicit((_Atomic unsigned *)r->cq_head, head + 1, memory_order_release);
            inflight--;
            if (k < (uint64_t)n)
                done(ctx, ops + k, res);
        }
    }
    if (err == 0)
        return 0;
    /* the ring failed while ops may still be in flight: no further use of it; what it never
     * completed fails (closing the ring makes the kernel cancel and reap them) */
    r->broken = 1;
    return err;
}

/* Per-call state of a read. */
struct read_ctx {
    const struct iovec *segs;
    const int32_t *at;
    const uint64_t *csums;
    const struct hl3_xxh3 *x;
    void *state;
    int32_t *status;
    int32_t *mres; /* the marker read's result per page (INT32_MIN: none yet) */
    int lo;
};

/* Internal page states (batch_io.c's): data to read; data in and good; data in, bad sum. */
enum { R_TODO = 100, R_STEP = 101, R_BADSUM = 102 };

static void read_done(void *vctx, const struct op *op, int res)
{
    struct read_ctx *c = vctx;
    int j = op->page;
    if (op->marker) {
        c->mres[j - c->lo] = res;
        return;
    }
    if (res < 0) {
        c->status[j] = res;
    } else if ((uint64_t)res != op->want) {
        c->status[j] = HL3_SHORT;
    } else if (c->csums != NULL && c->csums[j] != 0) {
        uint64_t s = io_checksum(c->x, &c->state, c->segs + c->at[j], c->at[j + 1] - c->at[j]);
        c->status[j] = s == 0 ? HL3_NOMEM : s == c->csums[j] ? R_STEP : R_BADSUM;
    } else {
        c->status[j] = R_STEP;
    }
}

/* Read pages lo..hi-1 (only those whose status is `only`, or all when only < 0) as
 * batch_io.c's read_pages does: page j's data (segments segs[at[j] .. at[j+1])) from
 * data_fds[j] (fds[j] when data_fds is NULL) at data_offs[j], then, linked after it, its
 * marker record from fds[j] at marker_offs[j], compared with expect[j * mlen ..]; with
 * csums[j] != 0, its XXH3 checked. status[j]: HL3_* or -errno (a page not taken is left
 * as it was). Returns the number not OK among the pages taken, or -errno when the ring
 * cannot run (already broken: nothing read) or failed (then every page not done is
 * -errno). */
int hl3_ring_read(struct hl3_ring *r, int lo, int hi, int only, const int32_t *data_fds, const int32_t *fds,
                  const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                  const int32_t *at, const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                  const struct hl3_xxh3 *x, int32_t *status)
{
    if (hi <= lo)
        return 0;
    int n = hi - lo;
    unsigned char *marks = malloc((size_t)n * (size_t)mlen);
    int32_t *mres = malloc((size_t)n * sizeof(int32_t));
    struct op *ops = malloc((size_t)n * 2 * sizeof(struct op));
    unsigned char *taken = calloc((size_t)n, 1);
    if (marks == NULL || mres == NULL || ops == NULL || taken == NULL) {
        free(marks), free(mres), free(ops), free(taken);
        for (int j = lo; j < hi; j++)
            if (only < 0 || status[j] == only)
                status[j] = HL3_NOMEM;
        return n;
    }
    int m = 0;
    for (int j = lo; j < hi; j++) {
        if (only >= 0 && status[j] != only)
            continue;
        taken[j - lo] = 1;
        mres[j - lo] = INT32_MIN;
        int nseg = at[j + 1] - at[j];
        if (nseg < 1 || nseg >= HL3_MAX_IOV) {
            status[j] = -EINVAL;
            continue;
        }
        size_t len = 0;
        for (int s = at[j]; s < at[j + 1]; s++)
            len += segs[s].iov_len;
        status[j] = R_TODO;
        ops[m++] = (struct op){nseg == 1 ? IORING_OP_READ : IORING_OP_READV, 1,
                               data_fds != NULL ? data_fds[j] : fds[j],
                               nseg == 1 ? (uint64_t)(uintptr_t)segs[at[j]].iov_base
                                         : (uint64_t)(uintptr_t)(segs + at[j]),
                               nseg == 1 ? (uint32_t)len : (uint32_t)nseg, data_offs[j], j, 0, len};
        ops[m++] = (struct op){IORING_OP_READ, 0, fds[j], (uint64_t)(uintptr_t)(marks + (size_t)(j - lo) * mlen),
                               (uint32_t)mlen, marker_offs[j], j, 1, (uint64_t)mlen};
    }
    struct read_ctx c = {segs, at, csums, x, NULL, status, mres, lo};
    int err = 0;
    pthread_mutex_lock(&r->lock);
    if (r->broken)
        err = -EIO;
    else if (m > 0)
        err = ring_run(r, ops, m, 2, read_done, &c);
    pthread_mutex_unlock(&r->lock);
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        if (!taken[j - lo])
            continue;
        int32_t s = status[j], mr = mres[j - lo];
        if (s == R_TODO || (err != 0 && (s == R_STEP || s == R_BADSUM) && mr == INT32_MIN))
            s = err != 0 ? err : HL3_SHORT;
        else if (s == R_STEP || s == R_BADSUM) {
            if (mr < 0)
                s = mr;
            else if (mr != mlen)
                s = HL3_SHORT;
            else if (memcmp(marks + (size_t)(j - lo) * mlen, expect + (size_t)j * mlen, (size_t)mlen) != 0)
                s = HL3_HEADER; /* rewritten meanwhile: a miss, whatever the checksum */
            else
                s = s == R_STEP ? HL3_OK : HL3_CHECKSUM;
        }
        status[j] = s;
        bad += s != HL3_OK;
    }
    if (c.state != NULL)
        x->free_state(c.state);
    free(marks), free(mres), free(ops), free(taken);
    return err != 0 ? err : bad;
}

struct write_ctx {
    int32_t *status;
    int32_t to;
};

static void write_done(void *vctx, const struct op *op, int res)
{
    struct write_ctx *c = vctx;
    c->status[op->page] = res < 0 ? res : (uint64_t)res == op->want ? c->to : HL3_SHORT;
}

/* Write pages lo..hi-1 as hl3_write_pages does (where with_csum, the XXH3 of page j into
 * csums[j] and into its record markers[j * mlen ..]): every page's marker record to
 * fds[j] at marker_offs[j], all of them completed, then the data of the pages whose record
 * went in, to data_fds[j] (fds[j] when NULL) at data_offs[j]. status[j]: HL3_OK,
 * HL3_SHORT, HL3_NOMEM or -errno; returns the number not OK, or -errno when the ring is
 * broken (nothing written) or failed (the pages not done carry that -errno). */
int hl3_ring_write(struct hl3_ring *r, int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                   const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                   const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    if (hi <= lo)
        return 0;
    int n = hi - lo;
    struct op *ops = malloc((size_t)n * sizeof(struct op));
    if (ops == NULL) {
        for (int j = lo; j < hi; j++)
            status[j] = HL3_NOMEM;
        return n;
    }
    void *state = NULL;
    int m = 0;
    for (int j = lo; j < hi; j++) {
        int nseg = at[j + 1] - at[j];
        if (nseg < 1 || nseg >= HL3_MAX_IOV) {
            status[j] = -EINVAL;
            continue;
        }
        status[j] = R_TODO;
        if (with_csum) {
            if (io_stamp_checksum(x, &state, segs + at[j], nseg, markers + (size_t)j * mlen, csums + j) != HL3_OK) {
                status[j] = HL3_NOMEM;
                continue;
            }
        }
        ops[m++] = (struct op){IORING_OP_WRITE, 0, fds[j], (uint64_t)(uintptr_t)(markers + (size_t)j * mlen),
                               (uint32_t)mlen, marker_offs[j], j, 1, (uint64_t)mlen};
    }
    if (state != NULL)
        x->free_state(state);
    int err = 0;
    pthread_mutex_lock(&r->lock);
    if (r->broken) {
        err = -EIO;
    } else {
        struct write_ctx c = {status, R_STEP};
        err = m > 0 ? ring_run(r, ops, m, 1, write_done, &c) : 0;
        int d = 0;
        for (int j = lo; j < hi && err == 0; j++) {
            if (status[j] != R_STEP)
                continue;
            int nseg = at[j + 1] - at[j];
            size_t len = 0;
            for (int s = at[j]; s < at[j + 1]; s++)
                len += segs[s].iov_len;
            ops[d++] = (struct op){nseg == 1 ? IORING_OP_WRITE : IORING_OP_WRITEV, 0,
                                   data_fds != NULL ? data_fds[j] : fds[j],
                                   nseg == 1 ? (uint64_t)(uintptr_t)segs[at[j]].iov_base
                                             : (uint64_t)(uintptr_t)(segs + at[j]),
                                   nseg == 1 ? (uint32_t)len : (uint32_t)nseg, data_offs[j], j, 0, len};
        }
        c.to = HL3_OK;
        if (err == 0 && d > 0)
            err = ring_run(r, ops, d, 1, write_done, &c);
    }
    pthread_mutex_unlock(&r->lock);
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        if (status[j] == R_TODO || status[j] == R_STEP)
            status[j] = err != 0 ? err : HL3_SHORT;
        bad += status[j] != HL3_OK;
    }
    free(ops);
    return err != 0 ? err : bad;
}
#endif
