/* Reads served from a shared mapping of a slab file: the page's bytes copied from the page
 * cache to the caller's memory and hashed (XXH3-64) in one pass, with streaming stores.
 *
 * Why. A get with checksums is two passes over every byte when it goes through preadv:
 * the kernel copies the page into the caller's memory, then XXH3 reads it back. On the
 * 2-core VM, 1 MiB pages, 2 threads (one reading each half of 256 pages from the page
 * cache): preadv alone 12.5-12.9 GB/s, preadv + XXH3 9.1-10.7, this copy + XXH3 in one
 * pass 14.5-16.1 (with the residency check, cold and warm page tables): the hash runs on
 * the registers the copy loaded, and the streaming stores skip reading the destination's
 * lines into cache before writing them (which the kernel's copy does). Pages that are not
 * in the page cache are left to preadv (big requests to the disk), and so are pages under
 * 64 KiB (HL3_MAPPED_MIN_PAGE). A file is mapped at a 2 MiB-aligned address, so that the
 * 2 MiB folios the set path makes (batch_io.c hl3_folio_cut) map with one entry each. The
 * page-table entries a read call made are dropped when it ends (unmap_span).
 *
 * XXH3 here is written from its specification (xxHash's doc/xxhash_spec.md: the
 * accumulate, scramble and merge steps of the long-input path, inputs over 240 bytes,
 * seed 0, default secret); a test checks it against the xxhash wheel on random lengths
 * and segmentations, for each vector width. AVX-512F or AVX2 is chosen at run time; a CPU
 * with neither maps nothing (the caller keeps preadv).
 *
 * A mapping is registered per descriptor (hl3_map_fd) by the Python side that opens the
 * slab files (slab/files.py) and removed before the descriptor closes (hl3_unmap_fd),
 * which waits for copies in flight. A file shrunk under a copy raises SIGBUS: a handler
 * installed with the first mapping jumps back out of the copy (per-thread jump buffer),
 * and the pages not yet copied are left to preadv, which reports the short read; a SIGBUS
 * elsewhere goes to the handler there was before.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mapped_read.h"

#define HL3_MAPPED_RUN (4 << 20) /* most bytes of one run: one residency check, one guard */
#define HL3_MAX_MAPPED_FD 65536
#define HL3_SHORT_INPUT 240      /* XXH3 hashes inputs up to this long another way */
/* Smaller pages are left to preadv. SGLang's controller path, 2 cores, get / raw preadv of 2
 * threads, mapped reads / preadv: 64 KiB pages 0.79-0.80 / 0.89-0.91 (Intel VM, session 14),
 * 1 MiB 0.98-1.02 / 0.82-0.85. Since the mappings are 2 MiB-aligned (map_aligned) and sets
 * write 2 MiB-aligned chunks (batch_io.c hl3_folio_cut), a 64 KiB page lies in a 2 MiB
 * folio mapped by one entry: 0.89-0.94 / 0.74-0.79 on the AMD EPYC VM (session 18). */
#define HL3_MAPPED_MIN_PAGE ((size_t)64 << 10)

/* ---- XXH3-64 of a page while it is copied ---------------------------------------------- */

/* The vector copies are x86 code; elsewhere there is no variant and nothing is mapped. */
#if defined(__x86_64__)

static const unsigned char k_secret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1U
#define PRIME32_2 0x85EBCA77U
#define PRIME32_3 0xC2B2AE3DU
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL

#define STRIPE 64
#define STRIPES_PER_BLOCK ((sizeof k_secret - STRIPE) / 8) /* the secret advances 8 bytes a stripe */
#define BLOCK (STRIPE * STRIPES_PER_BLOCK)
#define SCRAMBLE_AT (sizeof k_secret - STRIPE)
#define LAST_STRIPE_AT (sizeof k_secret - STRIPE - 7)
#define MERGE_AT 11

static uint64_t read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8); /* x86: little-endian, as the specification reads it */
    return v;
}

static uint64_t merge(const uint64_t acc[8], uint64_t len)
{
    uint64_t r = len * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        __uint128_t p = (__uint128_t)(acc[2 * i] ^ read64(k_secret + MERGE_AT + 16 * i)) *
                        (acc[2 * i + 1] ^ read64(k_secret + MERGE_AT + 16 * i + 8));
        r += (uint64_t)p ^ (uint64_t)(p >> 64);
    }
    r ^= r >> 37;
    r *= 0x165667919E3779F9ULL;
    return r ^ (r >> 32);
}

/* Where the copy writes: the page's destination segments, consumed in order. */
struct cursor {
    const struct iovec *seg, *end;
    size_t in; /* bytes of *seg already written */
};

/* The next n bytes' place when they lie in one segment (then consumed), else NULL. */
static inline char *cursor_take(struct cursor *c, size_t n)
{
    if (c->seg == c->end || c->seg->iov_len - c->in < n)
        return NULL;
    char *p = (char *)c->seg->iov_base + c->in;
    c->in += n;
    if (c->in == c->seg->iov_len) {
        c->seg++;
        c->in = 0;
    }
    return p;
}

/* Copy n bytes to the next places, across segment ends. */
static void cursor_copy(struct cursor *c, const char *src, size_t n)
{
    while (n > 0 && c->seg != c->end) {
        size_t left = c->seg->iov_len - c->in, take = n < left ? n : left;
        memcpy((char *)c->seg->iov_base + c->in, src, take);
        src += take;
        n -= take;
        c->in += take;
        if (c->in == c->seg->iov_len) {
            c->seg++;
            c->in = 0;
        }
    }
}

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2")))

AVX512 static inline __m512i accumulate512(__m512i acc, __m512i data, const unsigned char *secret)
{
    __m512i key = _mm512_xor_si512(data, _mm512_loadu_si512(secret));
    __m512i key_hi = _mm512_shuffle_epi32(key, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1));
    __m512i swapped = _mm512_shuffle_epi32(data, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_add_epi64(_mm512_mul_epu32(key, key_hi), _mm512_add_epi64(acc, swapped));
}

AVX512 static inline __m512i scramble512(__m512i acc)
{
    __m512i prime = _mm512_set1_epi32((int)PRIME32_1);
    __m512i mixed = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
    __m512i key = _mm512_xor_si512(mixed, _mm512_loadu_si512(k_secret + SCRAMBLE_AT));
    __m512i key_hi = _mm512_shuffle_epi32(key, (_MM_PERM_ENUM)_MM_SHUFFLE(0, 3, 0, 1));
    return _mm512_add_epi64(_mm512_mul_epu32(key, prime), _mm512_slli_epi64(_mm512_mul_epu32(key_hi, prime), 32));
}

AVX512 static inline void put512(struct cursor *c, const char *src, __m512i data)
{
    char *to = cursor_take(c, STRIPE);
    if (to == NULL)
        cursor_copy(c, src, STRIPE);
    else if (((uintptr_t)to & 63) == 0)
        _mm512_stream_si512((void *)to, data);
    else
        _mm512_storeu_si512(to, data);
}

/* Copy len (> 240) bytes from src to the segments; their XXH3-64 when hash (else 0). */
AVX512 static uint64_t copy_avx512(const char *src, size_t len, const struct iovec *segs, int nseg, int hash)
{
    struct cursor c = {segs, segs + nseg, 0};
    __m512i acc = _mm512_set_epi64((long long)PRIME32_1, (long long)PRIME64_5, (long long)PRIME32_2,
                                   (long long)PRIME64_4, (long long)PRIME64_3, (long long)PRIME64_2,
                                   (long long)PRIME64_1, (long long)PRIME32_3);
    const char *p = src;
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b < blocks; b++) {
        for (size_t s = 0; s < STRIPES_PER_BLOCK; s++, p += STRIPE) {
            __m512i data = _mm512_loadu_si512(p);
            put512(&c, p, data);
            if (hash)
                acc = accumulate512(acc, data, k_secret + 8 * s);
        }
        if (hash)
            acc = scramble512(acc);
    }
    size_t stripes = ((len - 1) - BLOCK * blocks) / STRIPE;
    for (size_t s = 0; s < stripes; s++, p += STRIPE) {
        __m512i data = _mm512_loadu_si512(p);
        put512(&c, p, data);
        if (hash)
            acc = accumulate512(acc, data, k_secret + 8 * s);
    }
    cursor_copy(&c, p, (size_t)(src + len - p));
    _mm_sfence();
    if (!hash)
        return 0;
    acc = accumulate512(acc, _mm512_loadu_si512(src + len - STRIPE), k_secret + LAST_STRIPE_AT);
    uint64_t lanes[8];
    _mm512_storeu_si512(lanes, acc);
    return merge(lanes, len);
}

AVX2 static inline __m256i accumulate256(__m256i acc, __m256i data, const unsigned char *secret)
{
    __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256((const __m256i *)secret));
    __m256i swapped = _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm256_add_epi64(_mm256_mul_epu32(key, _mm256_srli_epi64(key, 32)), _mm256_add_epi64(acc, swapped));
}

AVX2 static inline __m256i scramble256(__m256i acc, const unsigned char *secret)
{
    __m256i prime = _mm256_set1_epi32((int)PRIME32_1);
    __m256i mixed = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    __m256i key = _mm256_xor_si256(mixed, _mm256_loadu_si256((const __m256i *)secret));
    __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(key, 32), prime);
    return _mm256_add_epi64(_mm256_mul_epu32(key, prime), _mm256_slli_epi64(hi, 32));
}

AVX2 static inline void put256(struct cursor *c, const char *src, __m256i lo, __m256i hi)
{
    char *to = cursor_take(c, STRIPE);
    if (to == NULL) {
        cursor_copy(c, src, STRIPE);
    } else if (((uintptr_t)to & 31) == 0) {
        _mm256_stream_si256((__m256i *)to, lo);
        _mm256_stream_si256((__m256i *)(to + 32), hi);
    } else {
        _mm256_storeu_si256((__m256i *)to, lo);
        _mm256_storeu_si256((__m256i *)(to + 32), hi);
    }
}

/* copy_avx512 with two 256-bit halves of the eight accumulators. */
AVX2 static uint64_t copy_avx2(const char *src, size_t len, const struct iovec *segs, int nseg, int hash)
{
    struct cursor c = {segs, segs + nseg, 0};
    __m256i acc_lo = _mm256_set_epi64x((long long)PRIME64_3, (long long)PRIME64_2, (long long)PRIME64_1,
                                       (long long)PRIME32_3);
    __m256i acc_hi = _mm256_set_epi64x((long long)PRIME32_1, (long long)PRIME64_5, (long long)PRIME32_2,
                                       (long long)PRIME64_4);
    const char *p = src;
    size_t blocks = (len - 1) / BLOCK;
    for (size_t b = 0; b <= blocks; b++) {
        /* whole blocks, then the stripes of the last, partial one (no scramble after it) */
        size_t stripes = b < blocks ? STRIPES_PER_BLOCK : ((len - 1) - BLOCK * blocks) / STRIPE;
        for (size_t s = 0; s < stripes; s++, p += STRIPE) {
            __m256i lo = _mm256_loadu_si256((const __m256i *)p);
            __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 32));
            put256(&c, p, lo, hi);
            if (hash) {
                acc_lo = accumulate256(acc_lo, lo, k_secret + 8 * s);
                acc_hi = accumulate256(acc_hi, hi, k_secret + 8 * s + 32);
            }
        }
        if (hash && b < blocks) {
            acc_lo = scramble256(acc_lo, k_secret + SCRAMBLE_AT);
            acc_hi = scramble256(acc_hi, k_secret + SCRAMBLE_AT + 32);
        }
    }
    cursor_copy(&c, p, (size_t)(src + len - p));
    _mm_sfence();
    if (!hash)
        return 0;
    const char *last = src + len - STRIPE;
    acc_lo = accumulate256(acc_lo, _mm256_loadu_si256((const __m256i *)last), k_secret + LAST_STRIPE_AT);
    acc_hi = accumulate256(acc_hi, _mm256_loadu_si256((const __m256i *)(last + 32)), k_secret + LAST_STRIPE_AT + 32);
    uint64_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, acc_lo);
    _mm256_storeu_si256((__m256i *)(lanes + 4), acc_hi);
    return merge(lanes, len);
}

#endif /* __x86_64__ */

typedef uint64_t (*copy_fn)(const char *, size_t, const struct iovec *, int, int);

enum { VARIANT_NONE = 0, VARIANT_AVX2 = 2, VARIANT_AVX512 = 3 };

static int best_variant(void)
{
#if !defined(__x86_64__)
    return VARIANT_NONE;
#else
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return VARIANT_AVX512;
    if (__builtin_cpu_supports("avx2"))
        return VARIANT_AVX2;
    return VARIANT_NONE;
#endif
}

static int variant = -1; /* -1: not chosen yet */
static pthread_once_t variant_once = PTHREAD_ONCE_INIT;

static void choose_variant(void)
{
    __atomic_store_n(&variant, best_variant(), __ATOMIC_RELEASE);
}

static copy_fn copier(void)
{
    pthread_once(&variant_once, choose_variant);
    int v = __atomic_load_n(&variant, __ATOMIC_ACQUIRE);
#if defined(__x86_64__)
    return v == VARIANT_AVX512 ? copy_avx512 : v == VARIANT_AVX2 ? copy_avx2 : NULL;
#else
    (void)v;
    return NULL;
#endif
}

/* The vector width in use (VARIANT_*); want >= 0 sets it first (tests: AVX2 on an AVX-512
 * CPU; 0 turns mapped reads off), never to one the CPU lacks. */
int hl3_mapped_variant(int want)
{
    pthread_once(&variant_once, choose_variant);
    int best = best_variant();
    if (want == VARIANT_NONE || (want == VARIANT_AVX2 && best >= VARIANT_AVX2) || (want == VARIANT_AVX512 && best == VARIANT_AVX512))
        __atomic_store_n(&variant, want, __ATOMIC_RELEASE);
    return __atomic_load_n(&variant, __ATOMIC_ACQUIRE);
}

/* ---- mappings, per descriptor ------------------------------------------------------------ */

/* Never freed: a reader may hold the pointer after the descriptor's entry is cleared (it then
 * sees `dead` and lets go). One per slab file a process opens. */
struct mapping {
    char *base;
    size_t len;
    dev_t dev; /* the file's identity, should its descriptor number come back mapped */
    ino_t ino;
    int users; /* copies in flight */
    int dead;  /* being unmapped: no new copy */
};

static struct mapping *maps[HL3_MAX_MAPPED_FD];
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;

/* counters: pages copied, runs left to preadv as not resident, SIGBUS recoveries, mappings
 * left in place at unmap because a copy did not end in time */
static int64_t stat_pages, stat_not_resident, stat_bus, stat_kept;

static struct mapping *acquire(int fd)
{
    if (fd < 0 || fd >= HL3_MAX_MAPPED_FD)
        return NULL;
    struct mapping *m = __atomic_load_n(&maps[fd], __ATOMIC_ACQUIRE);
    if (m == NULL)
        return NULL;
    __atomic_add_fetch(&m->users, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&m->dead, __ATOMIC_SEQ_CST)) {
        __atomic_sub_fetch(&m->users, 1, __ATOMIC_SEQ_CST);
        return NULL;
    }
    return m;
}

static void release(struct mapping *m)
{
    __atomic_sub_fetch(&m->users, 1, __ATOMIC_SEQ_CST);
}

/* ---- SIGBUS: a file shrunk (or a disk failed) under a copy -------------------------------- */

static __thread sigjmp_buf *bus_jump; /* set while this thread copies from a mapping */
static struct sigaction bus_before;
static int bus_installed;

static void on_bus(int sig, siginfo_t *info, void *context)
{
    sigjmp_buf *jump = bus_jump;
    if (jump != NULL) {
        bus_jump = NULL;
        siglongjmp(*jump, 1);
    }
    if (bus_before.sa_flags & SA_SIGINFO) {
        if (bus_before.sa_sigaction != NULL) {
            bus_before.sa_sigaction(sig, info, context);
            return;
        }
    } else if (bus_before.sa_handler != SIG_DFL && bus_before.sa_handler != SIG_IGN) {
        bus_before.sa_handler(sig);
        return;
    }
    signal(SIGBUS, SIG_DFL); /* not ours: fatal, as it was before us */
    raise(SIGBUS);
}

/* Under maps_lock. */
static int install_bus_handler(void)
{
    if (bus_installed)
        return 0;
    struct sigaction a;
    memset(&a, 0, sizeof a);
    a.sa_sigaction = on_bus;
    a.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER; /* NODEFER: nothing to unblock after the jump */
    sigemptyset(&a.sa_mask);
    if (sigaction(SIGBUS, &a, &bus_before) != 0)
        return -errno;
    bus_installed = 1;
    return 0;
}

/* Copy len bytes at src to the nseg segments (their lengths must add up to len) as a mapped
 * read does, under the same SIGBUS guard: returns their XXH3-64 when hash (never 0: 0
 * means none in a header), else 0; *faulted = 1 when src could not be read (SIGBUS: a
 * mapped file shrunk under it; the segments then hold part of the bytes). Copies nothing
 * and returns 0 for len <= 240 or without a variant. For the tests. */
uint64_t hl3_xxh3_copy(const void *src, size_t len, const struct iovec *segs, int nseg, int hash, int *faulted)
{
    copy_fn copy = copier();
    *faulted = 0;
    if (copy == NULL || len <= HL3_SHORT_INPUT)
        return 0;
    pthread_mutex_lock(&maps_lock);
    int r = install_bus_handler();
    pthread_mutex_unlock(&maps_lock);
    if (r != 0)
        return 0;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0) != 0) {
        bus_jump = NULL;
        __atomic_add_fetch(&stat_bus, 1, __ATOMIC_RELAXED);
        *faulted = 1;
        return 0;
    }
    bus_jump = &jump;
    uint64_t h = copy((const char *)src, len, segs, nseg, hash);
    bus_jump = NULL;
    return hash && h == 0 ? 1 : h;
}

/* Under maps_lock: clear fd's entry and unmap its mapping once no copy uses it (waiting up
 * to a second; one still in use then stays mapped, counted, never unmapped under a copy). */
static void retire(int fd)
{
    struct mapping *m = maps[fd];
    if (m == NULL)
        return;
    __atomic_store_n(&maps[fd], NULL, __ATOMIC_RELEASE);
    __atomic_store_n(&m->dead, 1, __ATOMIC_SEQ_CST);
    struct timespec pause = {0, 100000};
    for (int i = 0; i < 10000 && __atomic_load_n(&m->users, __ATOMIC_SEQ_CST) != 0; i++)
        nanosleep(&pause, NULL);
    if (__atomic_load_n(&m->users, __ATOMIC_SEQ_CST) == 0)
        munmap(m->base, m->len);
    else
        __atomic_add_fetch(&stat_kept, 1, __ATOMIC_RELAXED);
}

/* A shared read-only mapping of len bytes of fd at a 2 MiB-aligned address (the file
 * offset 0 aligned with it), so that a 2 MiB folio of the page cache maps with one PMD
 * entry (one fault, one TLB entry) instead of 512 small ones. MAP_FAILED on failure. */
static void *map_aligned(int fd, size_t len)
{
    size_t huge = (size_t)2 << 20;
    char *res = mmap(NULL, len + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (res == MAP_FAILED)
        return MAP_FAILED;
    char *al = (char *)(((uintptr_t)res + huge - 1) & ~(uintptr_t)(huge - 1));
    void *base = mmap(al, len, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0);
    if (base == MAP_FAILED) {
        munmap(res, len + huge);
        return MAP_FAILED;
    }
    if (al > res)
        munmap(res, (size_t)(al - res));
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char *end = al + ((len + page - 1) & ~(page - 1)); /* the reservation's tail, page-aligned */
    if (res + len + huge > end)
        munmap(end, (size_t)(res + len + huge - end));
    return base;
}

/* Map fd's file (read-only, shared) for mapped reads: 0, or 1 when there is nothing to map
 * (an empty file, or the descriptor maps this file already), or -errno (-ENOTSUP: no
 * vector variant, -EMFILE: a descriptor number beyond the table). A mapping the number
 * still holds for another file (its descriptor closed without hl3_unmap_fd) is removed
 * first: reads through fd never see another file's bytes. */
int hl3_map_fd(int fd)
{
    if (copier() == NULL)
        return -ENOTSUP;
    if (fd < 0 || fd >= HL3_MAX_MAPPED_FD)
        return -EMFILE;
    struct stat st;
    if (fstat(fd, &st) != 0)
        return -errno;
    if (!S_ISREG(st.st_mode))
        return -EINVAL;
    pthread_mutex_lock(&maps_lock);
    int r = install_bus_handler();
    struct mapping *old = maps[fd];
    if (r == 0 && old != NULL) {
        if (old->dev == st.st_dev && old->ino == st.st_ino)
            r = 1;
        else
            retire(fd);
    }
    if (r == 0 && st.st_size <= 0)
        r = 1;
    struct mapping *m = r == 0 ? malloc(sizeof *m) : NULL;
    if (r == 0 && m == NULL)
        r = -ENOMEM;
    if (r == 0) {
        void *base = map_aligned(fd, (size_t)st.st_size);
        if (base == MAP_FAILED) {
            r = -errno;
            free(m);
        } else {
            *m = (struct mapping){(char *)base, (size_t)st.st_size, st.st_dev, st.st_ino, 0, 0};
            __atomic_store_n(&maps[fd], m, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&maps_lock);
    return r;
}

/* Remove fd's mapping (before fd closes: its number may be reused), waiting up to a second
 * for copies in flight; a mapping still in use then stays mapped (counted), never unmapped
 * under a copy. No-op for a descriptor without one. */
void hl3_unmap_fd(int fd)
{
    if (fd < 0 || fd >= HL3_MAX_MAPPED_FD)
        return;
    pthread_mutex_lock(&maps_lock);
    retire(fd);
    pthread_mutex_unlock(&maps_lock);
}

/* out[0..3]: pages copied from mappings, runs not resident (left to preadv), SIGBUS
 * recoveries, mappings kept at unmap (a copy still running). */
void hl3_mapped_stats(int64_t *out)
{
    out[0] = __atomic_load_n(&stat_pages, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&stat_not_resident, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&stat_bus, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&stat_kept, __ATOMIC_RELAXED);
}

/* ---- the read -------------------------------------------------------------------------- */

size_t hl3_iov_bytes(const struct iovec *iov, int n)
{
    size_t t = 0;
    for (int i = 0; i < n; i++)
        t += iov[i].iov_len;
    return t;
}

/* cachestat(2) (Linux 6.5): how much of a file's byte range the page cache holds, from the
 * cache itself; a kernel without it, or a seccomp filter that refuses it, leaves mincore. */
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct hl3_cachestat_range {
    uint64_t off, len;
};
struct hl3_cachestat {
    uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};
static int cachestat_refused;

/* How residency is checked: 1 cachestat, 0 mincore; want >= 0 sets it first (tests: 0
 * checks the mincore path; 1 tries cachestat again, and a kernel that refuses it goes
 * back to 0 at the next check). */
int hl3_mapped_residency(int want)
{
    if (want >= 0)
        __atomic_store_n(&cachestat_refused, want == 0, __ATOMIC_RELAXED);
    return !__atomic_load_n(&cachestat_refused, __ATOMIC_RELAXED);
}

/* 1 when every page-cache page under bytes [off, off + len) of fd, mapped at addr, is
 * resident. cachestat counts them in one walk of the cache (large folios at once): on the
 * AMD EPYC VM, 0.1-0.5 Mcycles per 256 MiB, against 15 for mincore, which looks up every
 * 4 KiB page whose page-table entry the last read dropped (hl3_mapped_done). */
static int resident(int fd, int64_t off, const char *addr, size_t len)
{
    static long page_size;
    if (page_size == 0)
        page_size = sysconf(_SC_PAGESIZE);
    if (!__atomic_load_n(&cachestat_refused, __ATOMIC_RELAXED)) {
        struct hl3_cachestat_range range = {(uint64_t)off, (uint64_t)len};
        struct hl3_cachestat cs;
        if (syscall(__NR_cachestat, fd, &range, &cs, 0) == 0) {
            uint64_t first = (uint64_t)off / (uint64_t)page_size;
            uint64_t last = ((uint64_t)off + len - 1) / (uint64_t)page_size;
            return cs.nr_cache >= last - first + 1;
        }
        if (errno == ENOSYS || errno == EPERM)
            __atomic_store_n(&cachestat_refused, 1, __ATOMIC_RELAXED);
    }
    uintptr_t start = (uintptr_t)addr & ~((uintptr_t)page_size - 1);
    size_t span = (size_t)((uintptr_t)addr + len - start);
    unsigned char vec[1024];
    while (span > 0) {
        size_t part = span < sizeof vec * (size_t)page_size ? span : sizeof vec * (size_t)page_size;
        if (mincore((void *)start, part, vec) != 0)
            return 0;
        size_t pages = (part + (size_t)page_size - 1) / (size_t)page_size;
        for (size_t i = 0; i < pages; i++)
            if (!(vec[i] & 1))
                return 0;
        start += part;
        span -= part;
    }
    return 1;
}

/* Drop this process's page-table entries over [lo, hi) (whole pages around it): the page
 * cache keeps the pages. Why: a page mapped in a process is one the kernel will not drop on
 * POSIX_FADV_DONTNEED (cold-read benchmarks and tests) and counts in the process's RSS, and
 * entries kept from an earlier read measured slower to copy through than fresh ones once
 * other memory traffic had pushed the page tables out of cache (1 MiB pages, 256 MiB a get:
 * 120-180 Mcycles against ~100; the next read maps them again, 16 pages a fault). Once per
 * call and mapping, over the span of its pages (one madvise: each costs the other cores a
 * TLB flush, which per 64 KiB run cost more than the copy gained). */
static void unmap_span(uintptr_t lo, uintptr_t hi)
{
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    lo &= ~(page - 1);
    hi = (hi + page - 1) & ~(page - 1);
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

/* Note [lo, hi) of mapping m (held by this call: acquired once per span) in spans. */
static void add_span(struct hl3_mapped_spans *spans, struct mapping *m, uintptr_t lo, uintptr_t hi)
{
    for (int i = 0; i < spans->n; i++) {
        struct hl3_mapped_span *s = &spans->span[i];
        if (s->mapping == m) {
            s->lo = lo < s->lo ? lo : s->lo;
            s->hi = hi > s->hi ? hi : s->hi;
            release(m); /* held once already */
            return;
        }
    }
    if (spans->n == HL3_MAPPED_SPANS) {
        unmap_span(lo, hi);
        release(m);
        return;
    }
    spans->span[spans->n++] = (struct hl3_mapped_span){m, lo, hi};
}

void hl3_mapped_done(struct hl3_mapped_spans *spans)
{
    for (int i = 0; i < spans->n; i++) {
        unmap_span(spans->span[i].lo, spans->span[i].hi);
        release(spans->span[i].mapping);
    }
    spans->n = 0;
}

/* Copy pages lo..hi-1 (resident, inside m) under the SIGBUS guard; the number copied. */
static int copy_guarded(const struct mapping *m, int lo, int hi, const int64_t *offs, const struct iovec *segs,
                        const int32_t *at, volatile int32_t *status, int32_t to, int32_t bad_sum,
                        const uint64_t *csums, copy_fn copy)
{
    sigjmp_buf jump;
    volatile int copied = 0;
    if (sigsetjmp(jump, 0) != 0) {
        bus_jump = NULL;
        __atomic_add_fetch(&stat_bus, 1, __ATOMIC_RELAXED);
        return copied;
    }
    bus_jump = &jump;
    for (int j = lo; j < hi; j++) {
        int n = at[j + 1] - at[j];
        size_t len = hl3_iov_bytes(segs + at[j], n);
        uint64_t want = csums != NULL ? csums[j] : 0;
        uint64_t h = copy(m->base + offs[j], len, segs + at[j], n, want != 0);
        status[j] = want == 0 || (h ? h : 1) == want ? to : bad_sum;
        copied++;
    }
    bus_jump = NULL;
    return copied;
}

int hl3_mapped_run(int lo, int hi, const int32_t *fds, const int64_t *offs, const struct iovec *segs,
                   const int32_t *at, int32_t *status, int32_t from, int32_t to, int32_t bad_sum,
                   const uint64_t *csums, struct hl3_mapped_spans *spans)
{
    copy_fn copy = copier();
    if (copy == NULL || lo >= hi || hl3_iov_bytes(segs + at[lo], at[lo + 1] - at[lo]) < HL3_MAPPED_MIN_PAGE)
        return 0;
    struct mapping *m = acquire(fds[lo]);
    if (m == NULL)
        return 0;
    int k = lo;
    int64_t end = offs[lo];
    while (k < hi && status[k] == from && fds[k] == fds[lo] && offs[k] == end) {
        size_t n = hl3_iov_bytes(segs + at[k], at[k + 1] - at[k]);
        if (n < HL3_MAPPED_MIN_PAGE || (k > lo && (size_t)(end - offs[lo]) + n > HL3_MAPPED_RUN))
            break;
        end += (int64_t)n;
        k++;
    }
    int copied = 0;
    if (k > lo && offs[lo] >= 0 && (uint64_t)end <= m->len) {
        if (resident(fds[lo], offs[lo], m->base + offs[lo], (size_t)(end - offs[lo])))
            copied = copy_guarded(m, lo, k, offs, segs, at, status, to, bad_sum, csums, copy);
        else
            __atomic_add_fetch(&stat_not_resident, 1, __ATOMIC_RELAXED);
    }
    if (copied)
        add_span(spans, m, (uintptr_t)(m->base + offs[lo]), (uintptr_t)(m->base + end));
    else
        release(m);
    if (copied)
        __atomic_add_fetch(&stat_pages, copied, __ATOMIC_RELAXED);
    return copied;
}
