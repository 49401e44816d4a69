/* Index log records for the slab store's commit (hicache_l3/slab/records.py): the PUT
 * records of a batch -- header, key bytes and the CRC-32 of each -- encoded in one call
 * instead of a struct pack, a zlib.crc32 and two list appends per page in Python. The
 * bytes are exactly those of hicache_l3/slab/format.py encode_puts (the reference, and
 * the fallback: the Python side checks this library against it when it loads).
 *
 * Record (little endian, slab/format.py RECORD "<IBBHIIIIQQQ", 48 bytes, then the key):
 *   crc u32 | kind u8 | 0 u8 | key length u16 | writer u32 | slab u32 | slot u32 | 0 u32 |
 *   gen u64 | length u64 | checksum u64 | key bytes
 * the CRC (zlib's CRC-32, IEEE polynomial) covering everything after it. Little-endian
 * hosts only: the self-test refuses the library elsewhere.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define HL3_RECORD_BYTES 48
#define HL3_PUT 1

static uint32_t crc_table[8][256];
static int crc_ready;

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
    crc_ready = 1; /* (racing first calls compute the same table: harmless) */
}

/* zlib's crc32(0, p, n), slicing by 8 (little endian). */
static uint32_t crc32_ieee(const unsigned char *p, size_t n)
{
    uint32_t c = 0xFFFFFFFFu;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF]
            ^ crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF]
            ^ crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* The PUT records of n pages into out (cap bytes): page j's key is keys[key_ends[j-1] ..
 * key_ends[j]) (key_ends[-1] = 0), its entry the six values[6j .. 6j+6) (writer, slab,
 * slot, gen, length, checksum). Returns the bytes written (48 n + the keys' bytes), -1
 * when out is too small or key_ends decrease, -2 when a value does not fit its field
 * (the Python reference then raises its own error); nothing is promised of out then. */
long hl3_encode_puts(size_t n, const char *keys, const uint64_t *key_ends, const uint64_t *values,
                     char *out, size_t cap)
{
    if (!crc_ready)
        crc_init();
    size_t pos = 0;
    uint64_t start = 0;
    for (size_t j = 0; j < n; j++) {
        const uint64_t *v = values + 6 * j;
        uint64_t end = key_ends[j];
        if (end < start)
            return -1;
        uint64_t keylen = end - start;
        if (keylen > 0xFFFF || v[0] > 0xFFFFFFFFu || v[1] > 0xFFFFFFFFu || v[2] > 0xFFFFFFFFu
            || v[4] > 0xFFFFFFFFu)
            return -2;
        if (pos + HL3_RECORD_BYTES + keylen > cap)
            return -1;
        unsigned char *r = (unsigned char *)out + pos;
        uint16_t klen = (uint16_t)keylen;
        uint32_t w = (uint32_t)v[0], slab = (uint32_t)v[1], slot = (uint32_t)v[2], zero = 0;
        r[4] = HL3_PUT;
        r[5] = 0;
        memcpy(r + 6, &klen, 2);
        memcpy(r + 8, &w, 4);
        memcpy(r + 12, &slab, 4);
        memcpy(r + 16, &slot, 4);
        memcpy(r + 20, &zero, 4);
        memcpy(r + 24, &v[3], 8);
        memcpy(r + 32, &v[4], 8);
        memcpy(r + 40, &v[5], 8);
        memcpy(r + HL3_RECORD_BYTES, keys + start, keylen);
        uint32_t crc = crc32_ieee(r + 4, HL3_RECORD_BYTES - 4 + keylen);
        memcpy(r, &crc, 4);
        pos += HL3_RECORD_BYTES + keylen;
        start = end;
    }
    return (long)pos;
}
