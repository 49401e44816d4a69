/* What the slab layout costs in the kernel alone, on this kernel (issue 17): the syscalls of
 * three layouts for PAGES pages of PAGE_BYTES, one thread, no checksum, no Python:
 *
 *   today    the slab format: 72 KiB stride for 64 KiB pages, [header | data | end marker]
 *            contiguous, data 4 KiB into the slot; one pwritev / one preadv per page;
 *   grouped  a possible format: groups of 512 slots, [64 KiB of 128-byte marker records |
 *            512 slots of data back to back], so data sit at 64 KiB-aligned offsets; per
 *            page a 128-byte pwrite of the markers then the data, a preadv of the data then
 *            a 128-byte pread of the markers;
 *   raw      data only, back to back from offset 0 (what the benches' raw contenders do).
 *
 * Each: a fresh posix_fallocate-d file written once (fresh write), written again
 * (overwrite), then read (page cache warm). Linux 6.x ext4/xfs give a file written at
 * aligned offsets large page-cache folios; data 4 KiB past a 72 KiB stride get small ones.
 *
 *   cc -O2 -o /tmp/slab_layout benchmarks/slab_layout.c
 *   /tmp/slab_layout /path/on/the/disk/scratch.dat 4096 65536 3
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

enum { TODAY, GROUPED, RAW };
static const char *names[] = {"today (72K stride, hdr|data|end, 1 call)", "grouped (meta table, aligned data, 2 calls)", "raw (aligned, data only)"};

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: %s PATH PAGES PAGE_BYTES REPS\n", argv[0]);
        return 2;
    }
    const char *path = argv[1];
    long n = atol(argv[2]), pb = atol(argv[3]); int reps = atoi(argv[4]);
    long stride = 4096 + ((pb + 64 + 4095) / 4096) * 4096;
    long group = 512, meta = 65536; /* grouped: [64K meta of 512 slots][512 slots of data] */
    char *buf = mmap(NULL, n * pb, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    for (long i = 0; i < n * pb; i += 8) *(uint64_t *)(buf + i) = i * 2654435761u;
    char hdr[128]; memset(hdr, 'H', sizeof hdr);
    for (int rep = 0; rep < reps; rep++) {
        for (int l = 0; l < 3; l++) {
            double w[2], r;
            unlink(path);
            int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
            long size = l == TODAY ? n * stride : l == GROUPED ? (n / group + 1) * (meta + group * pb) : n * pb;
            posix_fallocate(fd, 0, size);
            for (int pass = 0; pass < 2; pass++) { /* fresh, then overwrite */
                double t = now();
                for (long j = 0; j < n; j++) {
                    struct iovec v[3];
                    if (l == TODAY) {
                        v[0] = (struct iovec){hdr, 64}; v[1] = (struct iovec){buf + j * pb, pb}; v[2] = (struct iovec){hdr, 64};
                        pwritev(fd, v, 3, j * stride + 4096 - 64);
                    } else if (l == GROUPED) {
                        long g = j / group, i = j % group, base = g * (meta + group * pb);
                        pwrite(fd, hdr, 128, base + i * 128);
                        v[0] = (struct iovec){buf + j * pb, pb};
                        pwritev(fd, v, 1, base + meta + i * pb);
                    } else {
                        v[0] = (struct iovec){buf + j * pb, pb};
                        pwritev(fd, v, 1, j * pb);
                    }
                }
                w[pass] = n * pb / (now() - t) / (1 << 30);
            }
            double t = now();
            for (long j = 0; j < n; j++) {
                struct iovec v[2];
                if (l == TODAY) {
                    v[0] = (struct iovec){hdr, 64}; v[1] = (struct iovec){buf + j * pb, pb};
                    preadv(fd, v, 2, j * stride + 4096 - 64);
                } else if (l == GROUPED) {
                    long g = j / group, i = j % group, base = g * (meta + group * pb);
                    v[0] = (struct iovec){buf + j * pb, pb};
                    preadv(fd, v, 1, base + meta + i * pb);
                    pread(fd, hdr, 128, base + i * 128);
                } else {
                    v[0] = (struct iovec){buf + j * pb, pb};
                    preadv(fd, v, 1, j * pb);
                }
            }
            r = n * pb / (now() - t) / (1 << 30);
            printf("rep %d %-46s fresh write %5.2f  overwrite %5.2f  read %5.2f GiB/s\n", rep, names[l], w[0], w[1], r);
            close(fd);
        }
    }
    unlink(path);
    return 0;
}
