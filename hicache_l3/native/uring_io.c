/* Batch page I/O through io_uring (hicache_l3/slab/uring.py): a batch's pages in flight at
 * once, up to the ring's depth, from one call with the GIL released. Raw syscalls, no
 * liburing; a ring is used by one call at a time (its mutex). Slab format 2's order holds:
 * a read links each page's marker read after its data read; a write queues a page's data
 * once its marker record is written. Checks and statuses are batch_io.c's.
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

/* Kernel headers older than Linux 5.6: every ring is refused with ENOSYS. */
#if !defined(IORING_FEAT_RW_CUR_POS) || !defined(__NR_io_uring_setup) || !defined(__NR_io_uring_enter)
#pragma GCC diagnostic ignored "-Wunused-parameter"
struct hl3_ring *hl3_ring_open(int depth)
{
    errno = ENOSYS;
    return NULL;
}

void hl3_ring_close(struct hl3_ring *r) {}

int hl3_ring_read(struct hl3_ring *r, int lo, int hi, int only, const int32_t *data_fds, const int32_t *fds,
                  const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                  const int32_t *at, const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                  const struct hl3_xxh3 *x, int32_t *status)
{
    return -ENOSYS;
}

int hl3_ring_write(struct hl3_ring *r, int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                   const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                   const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    return -ENOSYS;
}
#else

struct hl3_ring {
    pthread_mutex_t lock;
    int fd, depth, broken;
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

static void *ring_map(int fd, size_t size, off_t off)
{
    return mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, off);
}

/* A ring for `depth` pages in flight (2 entries each: data and marker), or NULL with errno
 * set (ENOSYS, EPERM, EINVAL, ENOMEM...). */
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
    r->sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    int single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single && r->cq_size > r->sq_size)
        r->sq_size = r->cq_size;
    if ((r->sq_map = ring_map(r->fd, r->sq_size, IORING_OFF_SQ_RING)) == MAP_FAILED)
        goto fail;
    r->cq_map = single ? r->sq_map : ring_map(r->fd, r->cq_size, IORING_OFF_CQ_RING);
    if (r->cq_map == MAP_FAILED)
        goto fail;
    r->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    if ((r->sqes = ring_map(r->fd, r->sqes_size, IORING_OFF_SQES)) == MAP_FAILED)
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

/* Put op on the ring's submission queue (published by the next ring_enter's caller). */
static void queue_op(struct hl3_ring *r, const struct op *o, uint64_t user_data)
{
    unsigned idx = r->tail & *r->sq_mask;
    struct io_uring_sqe *s = r->sqes + idx;
    memset(s, 0, sizeof(*s));
    s->opcode = o->opcode;
    s->fd = o->fd;
    s->addr = o->addr;
    s->len = o->len;
    s->off = (uint64_t)o->off;
    s->flags = o->link ? IOSQE_IO_LINK : 0;
    s->user_data = user_data;
    r->sq_array[idx] = idx;
    r->tail++;
}

typedef void (*cqe_fn)(void *ctx, uint64_t user_data, int res);

/* Publish what was queued and enter the ring, waiting for a completion when `wait`; then
 * reap(ctx, user_data, res) for every completion there. Returns how many were reaped, or
 * -errno when the ring failed: it is then broken (ops may be in flight: closing the ring
 * reaps them). */
static int ring_step(struct hl3_ring *r, int wait, cqe_fn reap, void *ctx)
{
    atomic_store_explicit((_Atomic unsigned *)r->sq_tail, r->tail, memory_order_release);
    unsigned pending = r->tail - atomic_load_explicit((_Atomic unsigned *)r->sq_head, memory_order_acquire);
    int e = ring_enter(r->fd, pending, wait);
    if (e == -EAGAIN || e == -EBUSY) { /* the kernel short of memory, or CQ full: wait */
        struct timespec pause = {0, 100000};
        nanosleep(&pause, NULL);
    } else if (e < 0 && e != -EINTR) {
        r->broken = 1;
        return e;
    }
    int got = 0;
    unsigned cmask = *r->cq_mask, head = *r->cq_head;
    unsigned tail = atomic_load_explicit((_Atomic unsigned *)r->cq_tail, memory_order_acquire);
    for (; head != tail; head++, got++) {
        const struct io_uring_cqe *c = r->cqes + (head & cmask);
        uint64_t user_data = c->user_data;
        int res = c->res;
        atomic_store_explicit((_Atomic unsigned *)r->cq_head, head + 1, memory_order_release);
        reap(ctx, user_data, res);
    }
    return got;
}

struct run_ctx {
    const struct op *ops;
    int n;
    done_fn done;
    void *ctx;
};

static void run_reap(void *vctx, uint64_t k, int res)
{
    struct run_ctx *c = vctx;
    if (k < (uint64_t)c->n)
        c->done(c->ctx, c->ops + k, res);
}

/* Run ops[0..n) through the ring, `group` consecutive ops per page, at most r->depth groups
 * in flight; done(ctx, op, res) for every op, in completion order. Returns 0, or -errno
 * when the ring failed: it is then broken, and the ops without a done() are the caller's. */
static int ring_run(struct hl3_ring *r, const struct op *ops, int n, int group, done_fn done, void *ctx)
{
    int next = 0, inflight = 0; /* inflight: ops submitted, not completed */
    struct run_ctx rc = {ops, n, done, ctx};
    while (next < n || inflight > 0) {
        while (next < n && inflight + group <= group * r->depth) {
            for (int g = 0; g < group && next < n; g++, next++) {
                queue_op(r, ops + next, (uint64_t)next);
                inflight++;
            }
        }
        int got = ring_step(r, 1, run_reap, &rc);
        if (got < 0)
            return got;
        inflight -= got;
    }
    return 0;
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
        c->status[j] = io_verify(c->x, &c->state, c->segs + c->at[j], c->at[j + 1] - c->at[j], c->csums[j],
                                 HL3_STEP, HL3_BADSUM);
    } else {
        c->status[j] = HL3_STEP;
    }
}

/* The op moving page j's data (segments segs[at[j] .. at[j+1]), nseg of them) at off of fd. */
static struct op data_op(uint8_t one, uint8_t vec, uint8_t link, int32_t fd, const struct iovec *segs,
                         const int32_t *at, int j, int64_t off)
{
    int nseg = at[j + 1] - at[j];
    size_t len = iov_bytes(segs + at[j], nseg);
    return (struct op){nseg == 1 ? one : vec, link, fd,
                       nseg == 1 ? (uint64_t)(uintptr_t)segs[at[j]].iov_base : (uint64_t)(uintptr_t)(segs + at[j]),
                       nseg == 1 ? (uint32_t)len : (uint32_t)nseg, off, j, 0, len};
}

/* The op reading page j's marker record (mlen bytes into buf) from off of fd. */
static struct op marker_read(int32_t fd, unsigned char *buf, int64_t mlen, int j, int64_t off)
{
    return (struct op){IORING_OP_READ, 0, fd, (uint64_t)(uintptr_t)buf, (uint32_t)mlen, off, j, 1, (uint64_t)mlen};
}

/* Read pages lo..hi-1 (those whose status is `only`, or all when only < 0) as batch_io.c's
 * read_pages: page j's data from data_fds[j] (fds[j] when data_fds is NULL) at
 * data_offs[j], then, linked after it, its marker record from fds[j] at marker_offs[j].
 * status[j]: HL3_* or -errno (a page not taken is left as it was). Returns the number not
 * OK among the pages taken, or -errno when the ring is broken (nothing read) or failed
 * (then every page not done is -errno). */
int hl3_ring_read(struct hl3_ring *r, int lo, int hi, int only, const int32_t *data_fds, const int32_t *fds,
                  const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                  const int32_t *at, const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                  const struct hl3_xxh3 *x, int32_t *status)
{
    if (hi <= lo)
        return 0;
    if (data_fds == NULL)
        data_fds = fds;
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
        if (!nseg_ok(at[j + 1] - at[j])) {
            status[j] = -EINVAL;
            continue;
        }
        status[j] = HL3_TODO;
        ops[m++] = data_op(IORING_OP_READ, IORING_OP_READV, 1, data_fds[j], segs, at, j, data_offs[j]);
        ops[m++] = marker_read(fds[j], marks + (size_t)(j - lo) * mlen, mlen, j, marker_offs[j]);
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
        if (s == HL3_TODO || (err != 0 && (s == HL3_STEP || s == HL3_BADSUM) && mr == INT32_MIN))
            s = err != 0 ? err : HL3_SHORT;
        else if (s == HL3_STEP || s == HL3_BADSUM) {
            if (mr < 0)
                s = mr;
            else if (mr != mlen)
                s = HL3_SHORT;
            else if (memcmp(marks + (size_t)(j - lo) * mlen, expect + (size_t)j * mlen, (size_t)mlen) != 0)
                s = HL3_HEADER; /* rewritten meanwhile: a miss, whatever the checksum */
            else
                s = s == HL3_STEP ? HL3_OK : HL3_CHECKSUM;
        }
        status[j] = s;
        bad += s != HL3_OK;
    }
    xxh_free(x, c.state);
    free(marks), free(mres), free(ops), free(taken);
    return err != 0 ? err : bad;
}

/* A write pass stamps the pages totalling at least this many bytes and writes their marker
 * records, so the device writes one pass's data while the next pass is hashed. */
#define WRITE_PASS_BYTES ((size_t)2 << 20)

struct pipe_ctx {
    const struct iovec *segs;
    const int32_t *at;
    int32_t *status;
};

static void pipe_reap(void *vctx, uint64_t j, int res)
{
    struct pipe_ctx *c = vctx;
    size_t want = iov_bytes(c->segs + c->at[j], c->at[j + 1] - c->at[j]);
    c->status[j] = res < 0 ? res : (size_t)res == want ? HL3_OK : HL3_SHORT;
}

/* The pipeline of hl3_ring_write (status[lo..hi) HL3_TODO on entry): passes of pages
 * stamped and their marker records written (blocking calls, adjacent ones together), each
 * pass's data then queued, at most r->depth data writes in flight. A page ends HL3_OK,
 * HL3_SHORT, -errno, or HL3_STEP where the ring failed first. Returns 0, or -errno when the
 * ring failed (it is then broken). */
static int write_pipe(struct hl3_ring *r, int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                      const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                      const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                      const struct hl3_xxh3 *x, void **state, int32_t *status)
{
    int next = lo, queued = lo, inflight = 0; /* [queued, next): markers in, data not queued */
    struct pipe_ctx pc = {segs, at, status};
    while (queued < hi || inflight > 0) {
        if (next == queued && next < hi) {
            int first = next;
            for (size_t bytes = 0; next < hi && bytes < WRITE_PASS_BYTES; next++) {
                int nseg = at[next + 1] - at[next];
                if (!nseg_ok(nseg))
                    status[next] = -EINVAL;
                else if (with_csum && io_stamp_checksum(x, state, segs + at[next], nseg,
                                                        markers + (size_t)next * mlen, csums + next) != HL3_OK)
                    status[next] = HL3_NOMEM;
                else
                    bytes += iov_bytes(segs + at[next], nseg);
            }
            io_move_markers(1, first, next, fds, marker_offs, markers, 0, mlen, status, HL3_TODO, HL3_STEP);
        }
        for (; queued < next && inflight < r->depth; queued++) {
            int j = queued;
            if (status[j] != HL3_STEP)
                continue;
            struct op o = data_op(IORING_OP_WRITE, IORING_OP_WRITEV, 0, data_fds[j], segs, at, j, data_offs[j]);
            queue_op(r, &o, (uint64_t)j);
            inflight++;
        }
        if (inflight == 0)
            continue;
        int more = next == queued && next < hi; /* a pass to hash while the device writes */
        int got = ring_step(r, !more, pipe_reap, &pc);
        if (got < 0)
            return got;
        inflight -= got;
    }
    return 0;
}

/* Write pages lo..hi-1 as hl3_write_pages, each page's marker record (to fds[j] at
 * marker_offs[j], stamped with its checksum when with_csum) written before its data goes
 * to data_fds[j] (fds[j] when NULL) at data_offs[j]; not every record before any data, so
 * hashing later pages overlaps the device writing earlier ones. Returns the number not OK,
 * or -errno when the ring is broken (nothing written) or failed (the pages not done carry
 * it). */
int hl3_ring_write(struct hl3_ring *r, int lo, int hi, const int32_t *data_fds, const int32_t *fds,
                   const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                   const int32_t *at, unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                   const struct hl3_xxh3 *x, int32_t *status)
{
    if (hi <= lo)
        return 0;
    if (data_fds == NULL)
        data_fds = fds;
    for (int j = lo; j < hi; j++)
        status[j] = HL3_TODO;
    void *state = NULL;
    int err;
    pthread_mutex_lock(&r->lock);
    err = r->broken ? -EIO
                    : write_pipe(r, lo, hi, data_fds, fds, data_offs, marker_offs, segs, at, markers, mlen,
                                 with_csum, csums, x, &state, status);
    pthread_mutex_unlock(&r->lock);
    xxh_free(x, state);
    int bad = 0;
    for (int j = lo; j < hi; j++) {
        if (status[j] == HL3_TODO || status[j] == HL3_STEP)
            status[j] = err != 0 ? err : HL3_SHORT;
        bad += status[j] != HL3_OK;
    }
    return err != 0 ? err : bad;
}
#endif
