/* The records of a set batch (hicache_l3/slab/records.py): its index log PUT records, byte
 * for byte slab/format.py encode_puts', its key digests and its marker records.
 *
 * Record (little endian, slab/format.py RECORD "<IBBHIIIIQQQ", 48 bytes, then the key):
 *   crc u32 | kind u8 | 0 u8 | key length u16 | writer u32 | slab u32 | slot u32 | 0 u32 |
 *   gen u64 | length u64 | checksum u64 | key bytes
 * the CRC (zlib's CRC-32) covering everything after it.
 */
#include "page_table.h"

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
    /* racing first calls compute the same tables; the flag is published after them */
    __atomic_store_n(&crc_ready, 1, __ATOMIC_RELEASE);
}

/* zlib's crc32(0, p, n), slicing by 8; its tables made on first use. */
uint32_t hl3_crc32(const unsigned char *p, size_t n)
{
    if (!__atomic_load_n(&crc_ready, __ATOMIC_ACQUIRE))
        crc_init();
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

/* One PUT record at r: key (keylen bytes), entry v (six values). 0, or -2 when a value
 * does not fit its field. */
static int encode_one(unsigned char *r, const char *key, uint64_t keylen, const uint64_t *v)
{
    if (keylen > 0xFFFF || v[0] > 0xFFFFFFFFu || v[1] > 0xFFFFFFFFu || v[2] > 0xFFFFFFFFu
        || v[4] > 0xFFFFFFFFu)
        return -2;
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
    memcpy(r + HL3_RECORD, key, keylen);
    uint32_t crc = hl3_crc32(r + 4, HL3_RECORD - 4 + keylen);
    memcpy(r, &crc, 4);
    return 0;
}

/* The PUT records of n pages into out (cap bytes): page j's key is keys[key_ends[j-1] ..
 * key_ends[j]) (key_ends[-1] = 0), its entry values[6j .. 6j+6). Returns the bytes
 * written, -1 when out is too small or key_ends decrease, -2 when a value does not fit
 * its field; nothing is promised of out then. */
long hl3_encode_puts(size_t n, const char *keys, const uint64_t *key_ends, const uint64_t *values,
                     char *out, size_t cap)
{
    size_t pos = 0;
    uint64_t start = 0;
    for (size_t j = 0; j < n; j++) {
        uint64_t end = key_ends[j];
        if (end < start)
            return -1;
        uint64_t keylen = end - start;
        if (pos + HL3_RECORD + keylen > cap)
            return -1;
        if (encode_one((unsigned char *)out + pos, keys + start, keylen, values + 6 * j) != 0)
            return -2;
        pos += HL3_RECORD + keylen;
        start = end;
    }
    return (long)pos;
}

/* hl3_encode_puts with the keys as one buffer of n '\n'-ended keys (keys_len bytes).
 * Returns the bytes written, -1 when out is too small or keys is not n '\n'-ended keys,
 * -2 as hl3_encode_puts. */
long hl3_encode_puts_nl(size_t n, const char *keys, size_t keys_len, const uint64_t *values, char *out,
                        size_t cap)
{
    size_t pos = 0, at = 0, keylen;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *key = next_key((const uint8_t *)keys, keys_len, &at, &keylen);
        if (key == NULL || pos + HL3_RECORD + keylen > cap)
            return -1;
        if (encode_one((unsigned char *)out + pos, (const char *)key, keylen, values + 6 * j) != 0)
            return -2;
        pos += HL3_RECORD + keylen;
    }
    return at == keys_len ? (long)pos : -1;
}

/* What a set batch writes before its data (slab/io.py NativeTransport.write): for page j
 * of n, in slot slots[j] with generation gens[j], its data offset, its marker offset and
 * its marker record at records + 128 j (checksum 0: the write fills it in; fingerprint:
 * XXH3-128 with seed 0 of key j). geo: shift, table, data_stride, span, record, as
 * slab/format.py Geometry.offsets. 0, or -1 when keys is not n '\n'-ended keys. */
long hl3_write_markers(size_t n, const unsigned char *keys, size_t keys_len, hl3_xxh128_fn hash,
                       const uint64_t *gens, const uint64_t *slots, uint64_t length,
                       const int64_t *geo, unsigned char *records, int64_t *data_offs,
                       int64_t *marker_offs)
{
    uint64_t shift = (uint64_t)geo[0], table = (uint64_t)geo[1], stride = (uint64_t)geo[2];
    uint64_t span = (uint64_t)geo[3], record = (uint64_t)geo[4];
    size_t pos = 0, len;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *key = next_key(keys, keys_len, &pos, &len);
        if (key == NULL)
            return -1;
        uint8_t fp[16];
        canonical128(hash(key, len, 0), fp);
        uint64_t s = slots[j];
        data_offs[j] = (int64_t)(((s >> shift) + 1) * table + s * stride);
        marker_offs[j] = (int64_t)((s >> shift) * span + s * record);
        marker_record(records + 128 * j, gens[j], length, 0, fp);
    }
    return pos == keys_len ? 0 : -1;
}

/* Whether the n digests (16 bytes each) are all different: 1, 0 (one repeats), or -1 (no
 * memory). An open-addressing set of their indices keyed by a digest's first 8 bytes. */
static int all_distinct(size_t n, const unsigned char *ds)
{
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    uint32_t stack[256], *set = cap <= 256 ? stack : calloc(cap, sizeof(uint32_t));
    if (set == NULL || n >= UINT32_MAX)
        return -1;
    if (set == stack)
        memset(stack, 0, sizeof(stack));
    int distinct = 1;
    for (size_t j = 0; j < n && distinct; j++) {
        uint64_t h;
        memcpy(&h, ds + 16 * j, 8);
        size_t i = (size_t)h & (cap - 1);
        while (set[i] != 0) {
            if (memcmp(ds + 16 * (set[i] - 1), ds + 16 * j, 16) == 0) {
                distinct = 0;
                break;
            }
            i = (i + 1) & (cap - 1);
        }
        set[i] = (uint32_t)(j + 1);
    }
    if (set != stack)
        free(set);
    return distinct;
}

/* The page-table digests (slab/table.py digest: XXH3-128 with ``seed``) of n '\n'-ended
 * keys at out + 16 j. Returns 0 when they are all different, 1 when one repeats (the keys
 * may: the caller compares them), 2 when that could not be checked (no memory), -1 when
 * keys is not n '\n'-ended keys. */
long hl3_key_digests(size_t n, const unsigned char *keys, size_t keys_len, hl3_xxh128_fn hash,
                     uint64_t seed, unsigned char *out)
{
    size_t pos = 0, len;
    for (size_t j = 0; j < n; j++) {
        const uint8_t *key = next_key(keys, keys_len, &pos, &len);
        if (key == NULL)
            return -1;
        canonical128(hash(key, len, seed), out + 16 * j);
    }
    if (pos != keys_len)
        return -1;
    int distinct = all_distinct(n, out);
    return distinct == 1 ? 0 : distinct == 0 ? 1 : 2;
}
