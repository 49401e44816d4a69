/* SGLang host-pool page addresses in one pass (hicache_l3._host_pages): the pointer
 * arithmetic of hicache_l3/sglang/page_meta.py's PointerModel (its numpy path is the
 * reference). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *array_type;

/* model_pointers(address, n, page_tokens, divide, limit, terms) -> array('q') | None:
 * page i's first host index is s = ((const int64_t *)address)[i * page_tokens], its
 * column c = s / page_tokens when divide, else s, and its segment j is at terms[2j] + c *
 * terms[2j + 1] (terms: native int64 (base, multiplier) pairs). None when a start is
 * negative, >= limit or not a multiple of page_tokens. The caller guarantees (n - 1) *
 * page_tokens + 1 readable int64s at address. */
static PyObject *model_pointers(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    Py_buffer terms;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "model_pointers(address, n, page_tokens, divide, limit, terms)");
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t n = PyLong_AsSsize_t(args[1]), pt = PyLong_AsSsize_t(args[2]);
    int divide = PyObject_IsTrue(args[3]);
    long long limit = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred() || divide < 0)
        return NULL;
    if (address == 0 || n < 1 || pt < 1 || PyObject_GetBuffer(args[5], &terms, PyBUF_SIMPLE) != 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_ssize_t per = terms.len / 16;
    if (per < 1 || terms.len % 16 || n > PY_SSIZE_T_MAX / 8 / per) {
        PyBuffer_Release(&terms);
        Py_RETURN_NONE;
    }
    const int64_t *starts = (const int64_t *)(uintptr_t)address;
    const uint64_t *t = (const uint64_t *)terms.buf;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * per * 8);
    if (out == NULL) {
        PyBuffer_Release(&terms);
        return NULL;
    }
    uint64_t *ptrs = (uint64_t *)PyBytes_AS_STRING(out);
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        int64_t s = starts[i * pt];
        ok = s >= 0 && s < limit && s % pt == 0;
        uint64_t c = (uint64_t)(divide ? s / pt : s);
        for (Py_ssize_t j = 0; j < per; j++)
            ptrs[i * per + j] = t[2 * j] + c * t[2 * j + 1]; /* unsigned: wraps as numpy's int64 */
    }
    PyBuffer_Release(&terms);
    if (!ok) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    PyObject *arr = PyObject_CallFunction(array_type, "sO", "q", out);
    Py_DECREF(out);
    return arr;
}

static PyMethodDef methods[] = {
    {"model_pointers", (PyCFunction)(void (*)(void))model_pointers, METH_FASTCALL,
     "The segment addresses of pages by a learned pointer model, as array('q'), or None (see host_pages.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_host_pages", "SGLang host-pool page addresses (see host_pages.c).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__host_pages(void)
{
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL)
        return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL)
        return NULL;
    return PyModule_Create(&module);
}
