/* MinHash signatures for `prepare`'s near dedup: the same numbers as `dedup.signatures`'s numpy
 * path (datasketch's affine32 scheme over pre-mixed 32-bit shingle hashes), in one pass.
 *
 * Why C: numpy needs three passes over a (permutations x shingles) array per chunk (multiply,
 * add, reduceat), each through memory; this loop keeps one document's 128 minima in registers /
 * L1 and lets the compiler vectorise over the permutations. Optional (setup.py): without it,
 * the numpy path computes the same signatures.
 *
 * signatures(hashes, starts, a, b) -> bytes
 *   hashes: uint32[N] (already fmix32-ed), starts: int64[D + 1] (document d owns
 *   hashes[starts[d]:starts[d + 1]], never empty), a, b: uint32[K]; returns uint32[D * K],
 *   row d = min over its shingles h of (a * h + b) mod 2^32.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define MULTIVERSION
#endif

MULTIVERSION
static void minhash_rows(const uint32_t *h, const int64_t *starts, Py_ssize_t docs, const uint32_t *a,
                         const uint32_t *b, Py_ssize_t k, uint32_t *out) {
    for (Py_ssize_t d = 0; d < docs; d++) {
        uint32_t *row = out + d * k;
        for (Py_ssize_t j = 0; j < k; j++) row[j] = 0xFFFFFFFFu;
        for (int64_t i = starts[d]; i < starts[d + 1]; i++) {
            const uint32_t x = h[i];
            for (Py_ssize_t j = 0; j < k; j++) {
                const uint32_t v = a[j] * x + b[j];
                row[j] = v < row[j] ? v : row[j];
            }
        }
    }
}

static PyObject *signatures(PyObject *self, PyObject *args) {
    Py_buffer hb, sb, ab, bb;
    if (!PyArg_ParseTuple(args, "y*y*y*y*", &hb, &sb, &ab, &bb)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = hb.len / 4, docs = sb.len / 8 - 1, k = ab.len / 4;
    const int64_t *starts = (const int64_t *)sb.buf;
    if (docs < 0 || bb.len != ab.len || (docs > 0 && (starts[0] < 0 || starts[docs] > n))) {
        PyErr_SetString(PyExc_ValueError, "bad arguments");
        goto done;
    }
    for (Py_ssize_t d = 0; d < docs; d++) {
        if (starts[d + 1] < starts[d]) {
            PyErr_SetString(PyExc_ValueError, "starts must not decrease");
            goto done;
        }
    }
    res = PyBytes_FromStringAndSize(NULL, docs * k * 4);
    if (res == NULL) goto done;
    Py_BEGIN_ALLOW_THREADS
    minhash_rows((const uint32_t *)hb.buf, starts, docs, (const uint32_t *)ab.buf, (const uint32_t *)bb.buf, k,
                 (uint32_t *)PyBytes_AS_STRING(res));
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&hb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&ab);
    PyBuffer_Release(&bb);
    return res;
}

static PyMethodDef methods[] = {
    {"signatures", signatures, METH_VARARGS, "MinHash signatures (see the file header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_minhash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__minhash(void) { return PyModule_Create(&module); }
