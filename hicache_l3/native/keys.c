/* Page-key checks and storage-key prefixing for a whole batch in one pass
 * (hicache_l3._keys; tests/reference/keys.py is the reference). A valid key is
 * hicache_l3.common.keys.is_valid_key's: a str of 1..256 ASCII characters of
 * [A-Za-z0-9_.:=+@-], not starting with '.' or '-'.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_KEY_LENGTH 256

static unsigned char allowed[256];

/* Strings are always "ready" from 3.12 on, where PyUnicode_READY is deprecated. */
#if PY_VERSION_HEX < 0x030C0000
#define NOT_READY(s) (PyUnicode_READY(s) < 0)
#else
#define NOT_READY(s) 0
#endif

static void init_allowed(void)
{
    const char *ok = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:=+@-";
    for (const char *c = ok; *c; c++)
        allowed[(unsigned char)*c] = 1;
}

/* 1 when every byte of s[0..n) is allowed: 16 bytes at a time while they are all
 * [0-9A-Za-z] (SSE2), the table for the rest. */
static int allowed_bytes(const unsigned char *s, Py_ssize_t n)
{
    Py_ssize_t i = 0;
#if defined(__SSE2__)
    const __m128i lo0 = _mm_set1_epi8('0' - 1), hi0 = _mm_set1_epi8('9' + 1);
    const __m128i loA = _mm_set1_epi8('A' - 1), hiA = _mm_set1_epi8('Z' + 1);
    const __m128i loa = _mm_set1_epi8('a' - 1), hia = _mm_set1_epi8('z' + 1);
    for (; i + 16 <= n; i += 16) {
        /* signed compares: bytes >= 0x80 are negative and fall outside every range */
        __m128i x = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i d = _mm_and_si128(_mm_cmpgt_epi8(x, lo0), _mm_cmpgt_epi8(hi0, x));
        __m128i u = _mm_and_si128(_mm_cmpgt_epi8(x, loA), _mm_cmpgt_epi8(hiA, x));
        __m128i l = _mm_and_si128(_mm_cmpgt_epi8(x, loa), _mm_cmpgt_epi8(hia, x));
        if (_mm_movemask_epi8(_mm_or_si128(d, _mm_or_si128(u, l))) != 0xFFFF)
            break; /* punctuation or a bad byte: the table decides from here */
    }
#endif
    unsigned char all = 1;
    for (; i < n; i++)
        all &= allowed[s[i]];
    return all;
}

/* The key's ASCII bytes and length when it is a valid page key, else NULL. */
static const unsigned char *valid_key(PyObject *key, Py_ssize_t *len)
{
    if (!PyUnicode_Check(key) || NOT_READY(key) || !PyUnicode_IS_ASCII(key)) {
        PyErr_Clear();
        return NULL;
    }
    Py_ssize_t n = PyUnicode_GET_LENGTH(key);
    if (n < 1 || n > MAX_KEY_LENGTH)
        return NULL;
    const unsigned char *s = PyUnicode_1BYTE_DATA(key);
    if (s[0] == '.' || s[0] == '-')
        return NULL;
    if (!allowed_bytes(s, n))
        return NULL;
    *len = n;
    return s;
}

static int all_valid(PyObject **items, Py_ssize_t n)
{
    Py_ssize_t len;
    for (Py_ssize_t i = 0; i < n; i++)
        if (valid_key(items[i], &len) == NULL)
            return 0;
    return 1;
}

/* valid_keys(keys) -> bool: every key of the sequence is valid (an empty batch is). */
static PyObject *valid_keys(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "valid_keys: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    int ok = all_valid(PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq));
    Py_DECREF(seq);
    return PyBool_FromLong(ok);
}

/* prefixed_keys(prefix, keys) -> [prefix + key for key in keys] when every key is valid,
 * else None; TypeError unless prefix is an ASCII str. */
static PyObject *prefixed_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prefixed_keys(prefix, keys) takes 2 arguments");
        return NULL;
    }
    PyObject *prefix = args[0];
    if (!PyUnicode_Check(prefix) || NOT_READY(prefix) || !PyUnicode_IS_ASCII(prefix)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "prefixed_keys: prefix must be an ASCII str");
        return NULL;
    }
    Py_ssize_t plen = PyUnicode_GET_LENGTH(prefix);
    const unsigned char *pdata = PyUnicode_1BYTE_DATA(prefix);
    PyObject *seq = PySequence_Fast(args[1], "prefixed_keys: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(count);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t len;
        const unsigned char *s = valid_key(items[i], &len);
        PyObject *skey = s == NULL ? NULL : PyUnicode_New(plen + len, 127);
        if (skey == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            if (s == NULL)
                Py_RETURN_NONE;
            return NULL;
        }
        unsigned char *d = PyUnicode_1BYTE_DATA(skey);
        memcpy(d, pdata, (size_t)plen);
        memcpy(d + plen, s, (size_t)len);
        PyList_SET_ITEM(out, i, skey);
    }
    Py_DECREF(seq);
    return out;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_pair(const void *a, const void *b)
{
    const uint64_t *x = a, *y = b;
    if (x[0] != y[0])
        return x[0] < y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

/* 1 when the n pages of `per` segments (each `size` bytes) are disjoint by columns:
 * segment j of each page at least `size` above segment j of the page before, and the
 * columns' spans pairwise disjoint (ascending pool pages in any layout); 0 proves nothing;
 * -1 on no memory. */
static int columns_disjoint(const uint64_t *flat, Py_ssize_t n, Py_ssize_t per, uint64_t size)
{
    uint64_t *spans = PyMem_Malloc((size_t)per * 2 * sizeof(uint64_t));
    if (spans == NULL)
        return -1;
    int ok = 1;
    for (Py_ssize_t r = 0; r < per && ok; r++) {
        uint64_t prev = flat[2 * r];
        for (Py_ssize_t i = 1; i < n && ok; i++) {
            uint64_t a = flat[2 * (i * per + r)];
            ok = a > prev && a - prev >= size;
            prev = a;
        }
        spans[2 * r] = flat[2 * r];
        spans[2 * r + 1] = prev + size;
    }
    if (ok && per > 1) {
        qsort(spans, (size_t)per, 2 * sizeof(uint64_t), cmp_pair);
        for (Py_ssize_t r = 1; r < per && ok; r++)
            ok = spans[2 * r] >= spans[2 * (r - 1) + 1];
    }
    PyMem_Free(spans);
    return ok;
}

/* 1 when two of the n * per segments at flat (each `size` bytes) share a byte; -1 on no
 * memory. */
static int segments_overlap(const uint64_t *flat, Py_ssize_t n, Py_ssize_t per, uint64_t size)
{
    Py_ssize_t m = n * per;
    int sorted = 1;
    for (Py_ssize_t i = 1; i < m && sorted; i++)
        sorted = flat[2 * i] > flat[2 * (i - 1)];
    if (sorted) { /* ascending pages (a contiguous batch): one pass */
        for (Py_ssize_t i = 1; i < m; i++)
            if (flat[2 * i] - flat[2 * (i - 1)] < size)
                return 1;
        return 0;
    }
    int disjoint = columns_disjoint(flat, n, per, size);
    if (disjoint != 0)
        return disjoint < 0 ? -1 : 0;
    uint64_t *a = PyMem_Malloc((size_t)m * sizeof(uint64_t));
    if (a == NULL)
        return -1;
    for (Py_ssize_t i = 0; i < m; i++)
        a[i] = flat[2 * i];
    qsort(a, (size_t)m, sizeof(uint64_t), cmp_u64);
    int hit = 0;
    for (Py_ssize_t i = 1; i < m && !hit; i++)
        hit = a[i] - a[i - 1] < size;
    PyMem_Free(a);
    return hit;
}

/* An exact tuple or list of length n: its items, else NULL. */
static PyObject **exact_items(PyObject *o, Py_ssize_t *n)
{
    if (PyTuple_CheckExact(o)) {
        *n = PyTuple_GET_SIZE(o);
        return &PyTuple_GET_ITEM(o, 0);
    }
    if (PyList_CheckExact(o)) {
        *n = PyList_GET_SIZE(o);
        return PySequence_Fast_ITEMS(o);
    }
    return NULL;
}

/* A plain int in [0, 2**64) into *v; 0 (no error set) otherwise. */
static int plain_u64(PyObject *o, uint64_t *v)
{
    if (!PyLong_CheckExact(o))
        return 0;
#if ULONG_MAX == UINT64_MAX /* PyLong_AsUnsignedLong walks the digits; ...LongLong goes through bytes */
    unsigned long long x = PyLong_AsUnsignedLong(o);
#else
    unsigned long long x = PyLong_AsUnsignedLongLong(o);
#endif
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *v = (uint64_t)x;
    return 1;
}

/* The bounds of a batch whose segments are all `size` bytes: segment f (address, length)
 * taken into `size` (the first one's length), `low` and `high` (its lowest and highest
 * address); 0 when its length is 0 or another than the batch's. */
static int take_segment(const uint64_t *f, uint64_t *size, uint64_t *low, uint64_t *high)
{
    if (*size == 0)
        *size = f[1];
    if (f[1] != *size || *size == 0)
        return 0;
    *low = f[0] < *low ? f[0] : *low;
    *high = f[0] > *high ? f[0] : *high;
    return 1;
}

/* The answer of common_batch / pointer_batch for the n pages of `per` segments flattened
 * in `out` (consumed): the tuple, or None when the highest segment ends past 2**64. */
static PyObject *batch_result(PyObject *out, Py_ssize_t n, Py_ssize_t per, uint64_t size,
                              uint64_t low, uint64_t high)
{
    if (high + size < high) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    int overlap = segments_overlap((const uint64_t *)PyBytes_AS_STRING(out), n, per, size);
    if (overlap < 0) {
        Py_DECREF(out);
        return PyErr_NoMemory();
    }
    return Py_BuildValue("(NnKKKO)", out, per, (unsigned long long)size, (unsigned long long)low,
                         (unsigned long long)(high + size), overlap ? Py_True : Py_False);
}

/* common_batch(keys, pages) -> (segments, per, size, low, end, overlap) | None: as many
 * pages as keys (at least one), every key valid, every page a tuple or list of `per` >= 1
 * segments, each a tuple or list of two plain ints (address, length == size > 0, below
 * 2**64). `segments`: a bytes of the native uint64 (address, length) pairs in order; low:
 * the lowest address; end: the end of the highest segment; overlap: whether two segments
 * share a byte. None when any of it does not hold. */
static PyObject *common_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "common_batch(keys, pages) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t n = 0, nk = 0, per;
    PyObject **pages = exact_items(args[1], &n);
    PyObject **keys = exact_items(args[0], &nk);
    if (pages == NULL || keys == NULL || n != nk || n == 0 || !all_valid(keys, n))
        Py_RETURN_NONE;
    if (exact_items(pages[0], &per) == NULL || per < 1 || per > PY_SSIZE_T_MAX / 16 / n)
        Py_RETURN_NONE;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * per * 16);
    if (out == NULL)
        return NULL;
    uint64_t *flat = (uint64_t *)PyBytes_AS_STRING(out);
    uint64_t size = 0, low = UINT64_MAX, high = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k, two;
        PyObject **segs = exact_items(pages[i], &k);
        if (segs == NULL || k != per)
            goto refuse;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject **pair = exact_items(segs[j], &two);
            uint64_t *f = flat + 2 * (i * per + j);
            if (pair == NULL || two != 2 || !plain_u64(pair[0], &f[0]) || !plain_u64(pair[1], &f[1])
                || !take_segment(f, &size, &low, &high))
                goto refuse;
        }
    }
    return batch_result(out, n, per, size, low, high);
refuse:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* A flat list of integers: an exact tuple or list of ints, or a buffer of 8-byte ints. */
typedef struct {
    PyObject **items;  /* the tuple's or list's items; NULL for a buffer */
    Py_buffer view;    /* the buffer (view.obj NULL when none is held) */
    int is_signed;
    Py_ssize_t n;
} u64_source;

/* `o` as a u64_source: 1, or 0 (no error set) when it is neither kind. */
static int u64_open(PyObject *o, u64_source *src)
{
    memset(src, 0, sizeof(*src));
    if ((src->items = exact_items(o, &src->n)) != NULL)
        return 1;
    if (!PyObject_CheckBuffer(o) || PyObject_GetBuffer(o, &src->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
        PyErr_Clear();
        return 0;
    }
    const char *fmt = src->view.format != NULL ? src->view.format : "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<')
        fmt++;
    int ok = src->view.itemsize == 8 && src->view.ndim == 1 && fmt[0] != '\0' && fmt[1] == '\0'
             && strchr("lLqQ", fmt[0]) != NULL;
    if (!ok) {
        PyBuffer_Release(&src->view);
        return 0;
    }
    src->is_signed = fmt[0] == 'l' || fmt[0] == 'q';
    src->n = src->view.len / 8;
    return 1;
}

static int u64_at(const u64_source *src, Py_ssize_t j, uint64_t *v)
{
    if (src->items != NULL)
        return plain_u64(src->items[j], v);
    memcpy(v, (const char *)src->view.buf + 8 * j, 8);
    return !(src->is_signed && (int64_t)*v < 0);
}

static void u64_close(u64_source *src)
{
    if (src->view.obj != NULL)
        PyBuffer_Release(&src->view);
}

/* pointer_batch(keys, ptrs, sizes, per) -> as common_batch | None, for the pages of
 * common.pages.PointerPages(ptrs, sizes, per) read from the flat lists (exact tuples or
 * lists, or 1-D C-contiguous buffers of 8-byte ints; a negative value refuses the batch):
 * page i's segments i*per .. i*per+per-1, put in address order. */
static PyObject *pointer_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pointer_batch(keys, ptrs, sizes, per) takes 4 arguments");
        return NULL;
    }
    Py_ssize_t n = 0;
    PyObject **keys = exact_items(args[0], &n);
    Py_ssize_t per = PyLong_AsSsize_t(args[3]);
    if (per == -1 && PyErr_Occurred())
        return NULL;
    if (keys == NULL || n == 0 || per < 1 || per > PY_SSIZE_T_MAX / 16 / n || !all_valid(keys, n))
        Py_RETURN_NONE;
    u64_source ptrs, sizes = {0};
    PyObject *out = NULL;
    uint64_t size = 0, low = UINT64_MAX, high = 0;
    int ok = u64_open(args[1], &ptrs) && u64_open(args[2], &sizes) && ptrs.n == n * per && sizes.n == ptrs.n;
    if (ok && (out = PyBytes_FromStringAndSize(NULL, ptrs.n * 16)) == NULL)
        ok = -1;
    uint64_t *flat = ok == 1 ? (uint64_t *)PyBytes_AS_STRING(out) : NULL;
    for (Py_ssize_t j = 0; ok == 1 && j < ptrs.n; j++) {
        uint64_t *f = flat + 2 * j;
        ok = u64_at(&ptrs, j, &f[0]) && u64_at(&sizes, j, &f[1]) && take_segment(f, &size, &low, &high);
    }
    u64_close(&ptrs);
    u64_close(&sizes);
    if (ok != 1) {
        Py_XDECREF(out);
        if (ok < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    if (per > 1)
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t *page = flat + 2 * i * per;
            for (Py_ssize_t j = 1; j < per; j++)
                if (page[2 * j] < page[2 * (j - 1)]) { /* pool order is not address order */
                    qsort(page, (size_t)per, 2 * sizeof(uint64_t), cmp_pair);
                    break;
                }
        }
    return batch_result(out, n, per, size, low, high);
}

static PyMethodDef methods[] = {
    {"valid_keys", valid_keys, METH_O, "True when every key of the sequence is a valid page key."},
    {"prefixed_keys", (PyCFunction)(void (*)(void))prefixed_keys, METH_FASTCALL,
     "[prefix + key for key in keys] when every key is valid, else None."},
    {"common_batch", (PyCFunction)(void (*)(void))common_batch, METH_FASTCALL,
     "The common transfer batch checked and flattened in one pass, or None (see keys.c)."},
    {"pointer_batch", (PyCFunction)(void (*)(void))pointer_batch, METH_FASTCALL,
     "common_batch of PointerPages(ptrs, sizes, per), from the flat lists, or None (see keys.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_keys", "Batch page-key checks and prefixing (see keys.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__keys(void)
{
    init_allowed();
    return PyModule_Create(&module);
}
