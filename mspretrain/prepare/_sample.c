/* The tokenizer sample's bottom-k heap (`sink.RefSample.feed`) over one chunk's documents, in C.
 *
 * Why C: the heap is order-dependent, so it is replayed document by document in prepare's main
 * process, where every nanosecond per document is serial time for the whole corpus. The Python
 * loop (two float comparisons per document that changes nothing, a heapq push and pop per event,
 * ~1 in 9 documents) set the main process's ceiling at ~2 M documents/s; this loop is ~10 ns a
 * document. Optional (setup.py): without it, `RefSample` runs the same heap in Python, with the
 * same members (tests/test_prepare_sample.py compares both).
 *
 * feed(heap, size, budget, total, order, u, chars, index, chunk) -> (size, total, order)
 *   heap: writable buffer of `Entry` (numpy RefSample.DTYPE: neg_u f8, order i8, chunk i8,
 *   index i8, chars i8), a binary min-heap on (neg_u, order) in its first `size` entries, with
 *   room for size + len(u) entries; u: float64[n], chars, index: int64[n] (one chunk's kept
 *   train documents in input order). For each document: push (-u, order, chunk, index, chars),
 *   order += 1, total += chars, then pop the smallest (-u, order) (the largest u; the older on a
 *   tie) while total > budget and more than one entry is left. The keys (neg_u, order) are unique,
 *   so the members do not depend on the heap's layout: the same as heapq's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    double neg_u;
    int64_t order, chunk, index, chars;
} Entry;

static inline int less(const Entry *a, const Entry *b) {
    return a->neg_u < b->neg_u || (a->neg_u == b->neg_u && a->order < b->order);
}

static void sift_up(Entry *h, Py_ssize_t i) {
    Entry x = h[i];
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!less(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static void sift_down(Entry *h, Py_ssize_t n, Py_ssize_t i) {
    Entry x = h[i];
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && less(&h[c + 1], &h[c])) c++;
        if (!less(&h[c], &x)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = x;
}

static PyObject *feed(PyObject *self, PyObject *args) {
    Py_buffer hb, ub, cb, ib;
    Py_ssize_t size;
    long long budget, total, order, chunk;
    if (!PyArg_ParseTuple(args, "w*nLLLy*y*y*L", &hb, &size, &budget, &total, &order, &ub, &cb, &ib, &chunk)) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = ub.len / 8, cap = hb.len / (Py_ssize_t)sizeof(Entry);
    if (cb.len != ub.len || ib.len != ub.len || size < 0 || size + n > cap) {
        PyErr_SetString(PyExc_ValueError, "bad arguments (the heap needs room for size + len(u) entries)");
        goto done;
    }
    Entry *h = (Entry *)hb.buf;
    const double *u = (const double *)ub.buf;
    const int64_t *chars = (const int64_t *)cb.buf, *index = (const int64_t *)ib.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t k = 0; k < n; k++) {
        /* a document above the heap's largest u that does not fit the room is pushed and popped
         * at once: only its order number is used (the heap is not empty, so the pop happens) */
        if (size > 0 && -u[k] < h[0].neg_u && chars[k] > budget - total) {
            order++;
            continue;
        }
        h[size] = (Entry){-u[k], order++, chunk, index[k], chars[k]};
        sift_up(h, size++);
        total += chars[k];
        while (total > budget && size > 1) {
            total -= h[0].chars;
            h[0] = h[--size];
            sift_down(h, size, 0);
        }
    }
    Py_END_ALLOW_THREADS
    res = Py_BuildValue("nLL", size, total, order);
done:
    PyBuffer_Release(&hb);
    PyBuffer_Release(&ub);
    PyBuffer_Release(&cb);
    PyBuffer_Release(&ib);
    return res;
}

static PyMethodDef methods[] = {
    {"feed", feed, METH_VARARGS, "The tokenizer sample's heap over one chunk (see the file header)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__sample(void) { return PyModule_Create(&module); }
