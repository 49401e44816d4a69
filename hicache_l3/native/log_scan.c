/* Live PUT records of an index log (a compaction keeps them), and their write. */
#include "page_table.h"

#define HL3_GEN 3 /* the highest record kind */

static uint64_t le64(const uint8_t *p) /* little-endian hosts only */
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static uint32_t le32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Walk ``n`` bytes of index log records (slab/format.py). When they are all whole records
 * with a good CRC, a known kind and an ASCII key, writes the start and end offsets of every
 * PUT record whose key's digest (XXH3-128 with ``seed``) the table maps to exactly that
 * (writer, slab, slot, generation) and returns how many (at most ``max``; n / 48 always
 * suffices). -1 when any byte is not such a record (the caller decodes it in Python). */
long hl3_pt_live_puts(const hl3_table *t, const uint8_t *data, size_t n, uint64_t seed,
                      hl3_xxh128_fn hash, uint64_t *starts, uint64_t *ends, size_t max)
{
    size_t pos = 0, live = 0;
    while (pos < n) {
        if (n - pos < HL3_RECORD)
            return -1;
        const uint8_t *r = data + pos;
        uint8_t kind = r[4];
        size_t keylen = (size_t)r[6] | (size_t)r[7] << 8;
        if (n - pos - HL3_RECORD < keylen || kind < HL3_PUT || kind > HL3_GEN)
            return -1;
        const uint8_t *key = r + HL3_RECORD;
        for (size_t i = 0; i < keylen; i++)
            if (key[i] >= 0x80)
                return -1;
        if (hl3_crc32(r + 4, HL3_RECORD - 4 + keylen) != le32(r))
            return -1;
        if (kind == HL3_PUT) {
            /* live: the page in the record's slot has its generation and the key's digest */
            uint64_t w = le32(r + 8), slab = le32(r + 12), slot = le32(r + 16), gen = le64(r + 24);
            const hl3_page *p = NULL;
            if (w < HL3_PT_WRITERS && slab < HL3_PT_SLABS && slot < HL3_PT_SLOTS)
                p = pt_page_at(t, pack_location(w, slab, slot));
            if (p != NULL && p->genlen >> 16 == gen) {
                uint8_t digest[16];
                canonical128(hash(key, keylen, seed), digest);
                if (memcmp(p->digest, digest, 16) == 0) {
                    if (live >= max)
                        return -1;
                    starts[live] = pos;
                    ends[live] = pos + HL3_RECORD + keylen;
                    live++;
                }
            }
        }
        pos += HL3_RECORD + keylen;
    }
    return (long)live;
}

/* Write the ``n`` byte spans [starts[k], ends[k]) of ``data`` (in order, inside data) one
 * after another to ``fd`` at its file offset, short writes resumed: the bytes written, or
 * -errno (-EIO: a write that moved nothing). */
#define HL3_SPAN_IOVS 1024 /* Linux's IOV_MAX */
long hl3_write_spans(int fd, const uint8_t *data, const uint64_t *starts, const uint64_t *ends, size_t n)
{
    struct iovec iov[HL3_SPAN_IOVS];
    long total = 0;
    size_t k = 0;
    while (k < n) {
        int m = 0;
        while (k < n && m < HL3_SPAN_IOVS) {
            uint64_t lo = starts[k], hi = ends[k++];
            while (k < n && starts[k] == hi) /* the next record follows: one iovec */
                hi = ends[k++];
            iov[m++] = (struct iovec){(void *)(data + lo), (size_t)(hi - lo)};
        }
        int first = 0;
        while (first < m) {
            ssize_t w = writev(fd, iov + first, m - first);
            if (w < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            if (w == 0)
                return -EIO;
            total += (long)w;
            while (first < m && (size_t)w >= iov[first].iov_len)
                w -= (ssize_t)iov[first++].iov_len;
            if (first < m) {
                iov[first].iov_base = (char *)iov[first].iov_base + w;
                iov[first].iov_len -= (size_t)w;
            }
        }
    }
    return total;
}
