/* Page-key checks and storage-key prefixing for a whole batch in one pass
 * (hicache_l3._keys). The rule is hicache_l3.common.keys.is_valid_key's: a str of
 * 1..256 ASCII characters of [A-Za-z0-9_.:=+@-], not starting with '.' or '-'.
 * hicache_l3/common/keys.py keeps the pure-Python functions as the reference and the
 * fallback when this module is not built (tests check both agree).
 *
 *   valid_keys(keys) -> bool
 *       True when every key of the sequence is valid (an empty batch is valid).
 *   prefixed_keys(prefix, keys) -> list[str] | None
 *       [prefix + key for key in keys] when every key is valid, else None;
 *       prefix must be an ASCII str (TypeError otherwise).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* 1 when every byte of s[0..n) is allowed. Hex page hashes (the common key) pass the
 * SSE2 test of 16 bytes at a time for [0-9A-Za-z]; anything else (a tail, a key with
 * punctuation) is decided by the table. */
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

static PyObject *valid_keys(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "valid_keys: keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t len;
    int ok = 1;
    for (Py_ssize_t i = 0; i < count && ok; i++)
        ok = valid_key(items[i], &len) != NULL;
    Py_DECREF(seq);
    return PyBool_FromLong(ok);
}

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
        if (s == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
            Py_RETURN_NONE;
        }
        PyObject *skey = PyUnicode_New(plen + len, 127);
        if (skey == NULL) {
            Py_DECREF(out);
            Py_DECREF(seq);
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

static PyMethodDef methods[] = {
    {"valid_keys", valid_keys, METH_O, "True when every key of the sequence is a valid page key."},
    {"prefixed_keys", (PyCFunction)(void (*)(void))prefixed_keys, METH_FASTCALL,
     "[prefix + key for key in keys] when every key is valid, else None."},
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
