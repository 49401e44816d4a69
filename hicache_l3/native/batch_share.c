/* One batch of page I/O shared by threads, joined without the GIL. */
#include "batch_io.h"

/* A batch of n pages shared by the calling thread and the I/O pool's
 * (hicache_l3/common/parallel.py BatchPool.run_shared): each thread claims chunks from
 * `next` until none is left; the caller then spins without the GIL until `done` reaches
 * n (no chunk running, none can start). Python allocates it (an int64 array of six) and
 * keeps it alive while any thread may still be inside a call on it. */
struct hl3_share {
    int64_t next;    /* the first page not claimed yet (hl3_share_stop: past the last) */
    int64_t done;    /* pages of finished chunks */
    int64_t n;       /* pages */
    int64_t chunk;   /* the fewest pages a chunk has (>= 1) */
    int64_t parts;   /* a chunk is what is left / parts (0: always `chunk` pages) */
    int64_t spins;   /* the calling thread's wait: loops of the spin, for the benchmarks */
};

#define HL3_NO_MORE_CHUNKS (INT64_MAX / 2)

/* The next chunk [*lo, *hi) of s (0 when none is left): `chunk` pages, handed out from the
 * two halves of the batch in turn (0, h, 1, h + 1, ...: a set's two slab files); or, where
 * parts > 0, what is left / parts and at least `chunk` pages. */
static int share_claim(struct hl3_share *s, int *lo, int *hi)
{
    int64_t a = __atomic_load_n(&s->next, __ATOMIC_ACQUIRE);
    int64_t least = s->chunk < 1 ? 1 : s->chunk, parts = s->parts;
    for (;;) {
        if (a < 0 || a >= s->n)
            return 0;
        if (parts <= 0) {
            if (!__atomic_compare_exchange_n(&s->next, &a, a + least, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
                continue;
            int64_t chunks = (s->n + least - 1) / least, c = a / least, half = (chunks + 1) / 2;
            int64_t b = c % 2 == 0 ? c / 2 : half + c / 2;
            int64_t end = (b + 1) * least;
            *lo = (int)(b * least);
            *hi = (int)(end < s->n ? end : s->n);
            return 1;
        }
        int64_t left = s->n - a, size = left / parts;
        if (size < least)
            size = least;
        if (size > left)
            size = left;
        if (__atomic_compare_exchange_n(&s->next, &a, a + size, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
            *lo = (int)a;
            *hi = (int)(a + size);
            return 1;
        }
    }
}

static void share_done(struct hl3_share *s, int lo, int hi)
{
    __atomic_fetch_add(&s->done, (int64_t)(hi - lo), __ATOMIC_RELEASE);
}

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* 1 once every chunk finished, spinning up to wait_ns for the running ones; 0 when they
 * did not finish in time. */
static int share_wait(struct hl3_share *s, int64_t wait_ns)
{
    if (__atomic_load_n(&s->done, __ATOMIC_ACQUIRE) >= s->n)
        return 1;
    if (wait_ns <= 0)
        return 0;
    int64_t start = now_ns();
    for (int64_t i = 1;; i++) {
#if defined(__x86_64__) || defined(__i386__)
        _mm_pause();
#endif
        if (__atomic_load_n(&s->done, __ATOMIC_ACQUIRE) >= s->n) {
            s->spins += i;
            return 1;
        }
        if ((i & 63) == 0 && now_ns() - start > wait_ns) {
            s->spins += i;
            return 0;
        }
    }
}

/* No chunk of s is claimed from now on. */
void hl3_share_stop(struct hl3_share *s)
{
    __atomic_store_n(&s->next, HL3_NO_MORE_CHUNKS, __ATOMIC_RELEASE);
}

/* hl3_read_plan (nowait: hl3_read_plan_nowait) of every chunk of s this thread claims,
 * then share_wait: 1 when every chunk of s had finished on return, else 0. */
int hl3_share_read_plan(struct hl3_share *s, int64_t wait_ns, int nowait, const int32_t *fds,
                        const int64_t *data_offs, const int64_t *marker_offs, const struct iovec *segs,
                        const int32_t *at, const unsigned char *expect, int64_t mlen, const uint64_t *csums,
                        const struct hl3_xxh3 *x, int32_t *status)
{
    int lo, hi;
    while (share_claim(s, &lo, &hi)) {
        io_read_plan(lo, hi, fds, data_offs, marker_offs, segs, at, expect, mlen, csums, x, status, nowait);
        share_done(s, lo, hi);
    }
    return share_wait(s, wait_ns);
}

/* hl3_write_pages of every chunk of s this thread claims, then the wait of
 * hl3_share_read_plan; same return. */
int hl3_share_write_pages(struct hl3_share *s, int64_t wait_ns, const int32_t *fds, const int64_t *data_offs,
                          const int64_t *marker_offs, const struct iovec *segs, const int32_t *at,
                          unsigned char *markers, int64_t mlen, int with_csum, uint64_t *csums,
                          const struct hl3_xxh3 *x, int32_t *status)
{
    int lo, hi;
    while (share_claim(s, &lo, &hi)) {
        hl3_write_pages(lo, hi, fds, data_offs, marker_offs, segs, at, markers, mlen, with_csum, csums, x,
                        status);
        share_done(s, lo, hi);
    }
    return share_wait(s, wait_ns);
}
