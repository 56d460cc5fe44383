/* A SentencePiece BPE encoder for the one model shape `prepare` trains: identity normaliser,
 * no dummy prefix, no extra-whitespace removal, byte fallback, no user-defined or unused pieces.
 *
 * Why it exists: SentencePiece's own encode builds a SentencePieceText protobuf (piece and
 * surface strings) for every token and then throws it away when only ids are asked for; that
 * is most of `prepare`'s CPU time. This file runs the same algorithm as SentencePiece's
 * bpe::Model::SampleEncode (alpha = 0): split the normalised text into UTF-8 characters, then
 * repeatedly merge the adjacent pair whose concatenation is a piece with the highest score
 * (ties: the leftmost pair), then map each final symbol to its id, or to its bytes' ids when
 * it is not a piece (byte fallback). Normalisation for that model shape is ' ' -> U+2581.
 *
 * mspretrain/data/tokenizer.py uses it only after it has encoded probe texts exactly like
 * SentencePiece, and tests compare it with SentencePiece on a whole corpus; any other model
 * shape goes to SentencePiece itself.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint64_t hash;
    int32_t offset; /* into blob */
    int32_t len;    /* 0 = empty slot */
    int32_t id;
    float score;
} Slot;

typedef struct {
    uint64_t key; /* (left id << 32 | right id) + 1; 0 = empty slot */
    int32_t id;   /* the merged piece */
    float score;
} PairSlot;

typedef struct {
    float score;
    int32_t left, right, size, id;
} Pair;

typedef struct {
    int32_t start, len, prev, next, id; /* id -1: not a piece (byte fallback) */
} Symbol;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    uint64_t mask;
    char *blob;
    PairSlot *pairs; /* every split of a piece into two pieces, by their ids */
    uint64_t pair_mask;
    int32_t *bmp_ids; /* id of each single-character piece below U+10000, else -1 */
    int32_t byte_ids[256];
    /* scratch, reused across texts */
    Symbol *sym;
    Py_ssize_t sym_cap;
    Pair *heap;
    Py_ssize_t heap_len, heap_cap;
    char *norm;
    Py_ssize_t norm_cap;
} Encoder;

static inline uint64_t hash_bytes(const char *p, Py_ssize_t n) {
    /* FNV-1a over 8-byte words, then a final mix: pieces are short (a few CJK characters). */
    uint64_t h = 1469598103934665603ULL ^ (uint64_t)n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 1099511628211ULL;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    if (n > 0) {
        uint64_t w = 0;
        memcpy(&w, p, (size_t)n);
        h = (h ^ w) * 1099511628211ULL;
    }
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 32;
    return h;
}

static inline const Slot *lookup(const Encoder *e, const char *p, Py_ssize_t n) {
    uint64_t h = hash_bytes(p, n);
    uint64_t i = h & e->mask;
    for (;;) {
        const Slot *s = &e->slots[i];
        if (s->len == 0) return NULL;
        if (s->hash == h && s->len == n && memcmp(e->blob + s->offset, p, (size_t)n) == 0) return s;
        i = (i + 1) & e->mask;
    }
}

static inline uint64_t pair_key(int32_t l, int32_t r) {
    return (((uint64_t)(uint32_t)l << 32) | (uint32_t)r) + 1;
}

static inline uint64_t pair_slot(uint64_t key, uint64_t mask) {
    return ((key * 0x9E3779B97F4A7C15ULL) >> 20) & mask;
}

static inline const PairSlot *lookup_pair(const Encoder *e, int32_t l, int32_t r) {
    uint64_t key = pair_key(l, r);
    for (uint64_t i = pair_slot(key, e->pair_mask);; i = (i + 1) & e->pair_mask) {
        const PairSlot *s = &e->pairs[i];
        if (s->key == key) return s;
        if (s->key == 0) return NULL;
    }
}

/* id of the piece made of one UTF-8 character, or -1 */
static inline int32_t char_id(const Encoder *e, const char *p, int len) {
    const unsigned char *u = (const unsigned char *)p;
    uint32_t cp;
    switch (len) {
    case 1: cp = u[0]; break;
    case 2: cp = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F); break;
    case 3: cp = ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F); break;
    default: {
        const Slot *s = lookup(e, p, len);
        return s ? s->id : -1;
    }
    }
    return e->bmp_ids[cp];
}

/* heap order: higher score first; equal scores: smaller left first (SentencePiece's comparator) */
static inline int better(const Pair *a, const Pair *b) {
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

static int heap_push(Encoder *e, Pair p) {
    if (e->heap_len == e->heap_cap) {
        Py_ssize_t cap = e->heap_cap ? e->heap_cap * 2 : 1024;
        Pair *h = (Pair *)realloc(e->heap, (size_t)cap * sizeof(Pair));
        if (!h) return -1;
        e->heap = h;
        e->heap_cap = cap;
    }
    Py_ssize_t i = e->heap_len++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!better(&p, &e->heap[parent])) break;
        e->heap[i] = e->heap[parent];
        i = parent;
    }
    e->heap[i] = p;
    return 0;
}

static Pair heap_pop(Encoder *e) {
    Pair top = e->heap[0];
    Pair last = e->heap[--e->heap_len];
    Py_ssize_t n = e->heap_len, i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && better(&e->heap[c + 1], &e->heap[c])) c++;
        if (!better(&e->heap[c], &last)) break;
        e->heap[i] = e->heap[c];
        i = c;
    }
    if (n > 0) e->heap[i] = last;
    return top;
}

static inline int maybe_add(Encoder *e, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return 0;
    const Symbol *l = &e->sym[left], *r = &e->sym[right];
    if (l->id < 0 || r->id < 0) return 0; /* checked at init: no piece holds a non-piece character */
    const PairSlot *s = lookup_pair(e, l->id, r->id);
    if (!s) return 0;
    Pair p = {s->score, left, right, l->len + r->len, s->id};
    return heap_push(e, p);
}

typedef struct {
    int32_t *data;
    Py_ssize_t len, cap;
} IntBuf;

static inline int put(IntBuf *b, int32_t v) {
    if (b->len == b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
        int32_t *d = (int32_t *)realloc(b->data, (size_t)cap * sizeof(int32_t));
        if (!d) return -1;
        b->data = d;
        b->cap = cap;
    }
    b->data[b->len++] = v;
    return 0;
}

static inline int utf8_len(unsigned char c) {
    return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* Encodes one UTF-8 text into `out`; returns 0, or -1 on memory failure. */
static int encode_one(Encoder *e, const char *text, Py_ssize_t n, IntBuf *out) {
    /* normalise: ' ' -> U+2581 (3 bytes) */
    if (n * 3 > e->norm_cap) {
        Py_ssize_t cap = n * 3 + 64;
        char *d = (char *)realloc(e->norm, (size_t)cap);
        if (!d) return -1;
        e->norm = d;
        e->norm_cap = cap;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (text[i] == ' ') {
            e->norm[m++] = (char)0xE2;
            e->norm[m++] = (char)0x96;
            e->norm[m++] = (char)0x81;
        } else {
            e->norm[m++] = text[i];
        }
    }
    if (m == 0) return 0;
    if (m > e->sym_cap) {
        Py_ssize_t cap = m + 64;
        Symbol *d = (Symbol *)realloc(e->sym, (size_t)cap * sizeof(Symbol));
        if (!d) return -1;
        e->sym = d;
        e->sym_cap = cap;
    }
    int32_t count = 0;
    for (Py_ssize_t i = 0; i < m;) {
        int len = utf8_len((unsigned char)e->norm[i]);
        if (i + len > m) len = (int)(m - i);
        Symbol *s = &e->sym[count];
        s->start = (int32_t)i;
        s->len = len;
        s->id = char_id(e, e->norm + i, len);
        s->prev = count - 1;
        s->next = count + 1;
        count++;
        i += len;
    }
    e->sym[count - 1].next = -1;
    e->heap_len = 0;
    for (int32_t i = 1; i < count; i++)
        if (maybe_add(e, i - 1, i) < 0) return -1;
    while (e->heap_len > 0) {
        Pair top = heap_pop(e);
        Symbol *l = &e->sym[top.left], *r = &e->sym[top.right];
        /* stale: a side was merged away, or grew since this pair was queued */
        if (l->len == 0 || r->len == 0 || l->len + r->len != top.size) continue;
        l->len += r->len;
        l->id = top.id;
        l->next = r->next;
        if (r->next >= 0) e->sym[r->next].prev = top.left;
        r->len = 0;
        if (maybe_add(e, l->prev, top.left) < 0) return -1;
        if (maybe_add(e, top.left, l->next) < 0) return -1;
    }
    for (int32_t i = 0; i != -1; i = e->sym[i].next) {
        const Symbol *s = &e->sym[i];
        if (s->id >= 0) {
            if (put(out, s->id) < 0) return -1;
        } else {
            for (int32_t k = 0; k < s->len; k++)
                if (put(out, e->byte_ids[(unsigned char)e->norm[s->start + k]]) < 0) return -1;
        }
    }
    return 0;
}

static void Encoder_dealloc(Encoder *e) {
    free(e->slots);
    free(e->blob);
    free(e->pairs);
    free(e->bmp_ids);
    free(e->sym);
    free(e->heap);
    free(e->norm);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

/* Encoder(pieces: list[bytes], scores: list[float], ids: list[int], byte_ids: list[int] (256)) */
static int Encoder_init(Encoder *e, PyObject *args, PyObject *kw) {
    PyObject *pieces, *scores, *ids, *byte_ids;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &pieces, &PyList_Type, &scores, &PyList_Type, &ids,
                          &PyList_Type, &byte_ids))
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(pieces);
    if (PyList_GET_SIZE(scores) != n || PyList_GET_SIZE(ids) != n || PyList_GET_SIZE(byte_ids) != 256) {
        PyErr_SetString(PyExc_ValueError, "pieces, scores and ids differ in length, or byte_ids is not 256 long");
        return -1;
    }
    uint64_t cap = 16;
    while (cap < (uint64_t)n * 2 + 2) cap <<= 1;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i);
        if (!PyBytes_Check(p) || PyBytes_GET_SIZE(p) == 0) {
            PyErr_SetString(PyExc_TypeError, "pieces must be non-empty bytes");
            return -1;
        }
        total += PyBytes_GET_SIZE(p);
    }
    e->slots = (Slot *)calloc((size_t)cap, sizeof(Slot));
    e->blob = (char *)malloc((size_t)total + 1);
    if (!e->slots || !e->blob) {
        PyErr_NoMemory();
        return -1;
    }
    e->mask = cap - 1;
    Py_ssize_t off = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i);
        Py_ssize_t len = PyBytes_GET_SIZE(p);
        long id = PyLong_AsLong(PyList_GET_ITEM(ids, i));
        double score = PyFloat_AsDouble(PyList_GET_ITEM(scores, i));
        if (PyErr_Occurred()) return -1;
        memcpy(e->blob + off, PyBytes_AS_STRING(p), (size_t)len);
        uint64_t h = hash_bytes(e->blob + off, len);
        uint64_t j = h & e->mask;
        while (e->slots[j].len != 0) {
            Slot *s = &e->slots[j];
            if (s->hash == h && s->len == len && memcmp(e->blob + s->offset, e->blob + off, (size_t)len) == 0) {
                PyErr_SetString(PyExc_ValueError, "duplicate piece");
                return -1;
            }
            j = (j + 1) & e->mask;
        }
        e->slots[j] = (Slot){h, (int32_t)off, (int32_t)len, (int32_t)id, (float)score};
        off += len;
    }
    for (int i = 0; i < 256; i++) {
        e->byte_ids[i] = (int32_t)PyLong_AsLong(PyList_GET_ITEM(byte_ids, i));
        if (PyErr_Occurred()) return -1;
    }
    /* Single characters below U+10000 by table; merges by the ids of their two halves. A merge
     * looks at the ids of the two symbols, so every character inside a piece must be a piece
     * itself (true of trained models: rare characters are dropped before merging); a model
     * where it is not is refused and stays with SentencePiece. */
    e->bmp_ids = (int32_t *)malloc(65536 * sizeof(int32_t));
    if (!e->bmp_ids) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < 65536; i++) e->bmp_ids[i] = -1;
    Py_ssize_t splits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i);
        const char *b = PyBytes_AS_STRING(p);
        Py_ssize_t len = PyBytes_GET_SIZE(p);
        int first = utf8_len((unsigned char)b[0]);
        if (first == len && first < 4) {
            const Slot *s = lookup(e, b, len);
            uint32_t cp = 0;
            const unsigned char *u = (const unsigned char *)b;
            cp = len == 1 ? u[0] : len == 2 ? ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F)
                                            : ((uint32_t)(u[0] & 0x0F) << 12) | ((uint32_t)(u[1] & 0x3F) << 6) | (u[2] & 0x3F);
            e->bmp_ids[cp] = s->id;
        }
        for (Py_ssize_t k = 0; k < len; k += utf8_len((unsigned char)b[k])) {
            if (k > 0) splits++;
            int cl = utf8_len((unsigned char)b[k]);
            if (k + cl > len || !lookup(e, b + k, cl)) {
                PyErr_SetString(PyExc_ValueError, "a piece holds a character that is not a piece");
                return -1;
            }
        }
    }
    uint64_t pcap = 16;
    while (pcap < (uint64_t)splits * 2 + 2) pcap <<= 1;
    e->pairs = (PairSlot *)calloc((size_t)pcap, sizeof(PairSlot));
    if (!e->pairs) {
        PyErr_NoMemory();
        return -1;
    }
    e->pair_mask = pcap - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(pieces, i);
        const char *b = PyBytes_AS_STRING(p);
        Py_ssize_t len = PyBytes_GET_SIZE(p);
        const Slot *whole = lookup(e, b, len);
        for (Py_ssize_t k = utf8_len((unsigned char)b[0]); k < len; k += utf8_len((unsigned char)b[k])) {
            const Slot *l = lookup(e, b, k), *r = lookup(e, b + k, len - k);
            if (!l || !r) continue;
            uint64_t key = pair_key(l->id, r->id);
            uint64_t j = pair_slot(key, e->pair_mask);
            while (e->pairs[j].key != 0) j = (j + 1) & e->pair_mask;
            e->pairs[j] = (PairSlot){key, whole->id, whole->score};
        }
    }
    return 0;
}

/* encode(texts: list[str], eos: int) -> (bytes of int32 ids with eos after each text,
 *                                        bytes of int32 token counts per text incl. the eos) */
static PyObject *Encoder_encode(Encoder *e, PyObject *args) {
    PyObject *texts;
    long eos;
    if (!PyArg_ParseTuple(args, "O!l", &PyList_Type, &texts, &eos)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(texts);
    IntBuf out = {NULL, 0, 0};
    int32_t *lengths = (int32_t *)malloc((size_t)(n ? n : 1) * sizeof(int32_t));
    if (!lengths) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len;
        const char *utf8 = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(texts, i), &len);
        if (!utf8) goto fail; /* not a str, or a lone surrogate: the caller falls back */
        Py_ssize_t before = out.len;
        if (encode_one(e, utf8, len, &out) < 0 || put(&out, (int32_t)eos) < 0) {
            PyErr_NoMemory();
            goto fail;
        }
        lengths[i] = (int32_t)(out.len - before);
    }
    PyObject *ids = PyBytes_FromStringAndSize((const char *)out.data, out.len * (Py_ssize_t)sizeof(int32_t));
    PyObject *lens = PyBytes_FromStringAndSize((const char *)lengths, n * (Py_ssize_t)sizeof(int32_t));
    free(out.data);
    free(lengths);
    if (!ids || !lens) {
        Py_XDECREF(ids);
        Py_XDECREF(lens);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, ids, lens);
    Py_DECREF(ids);
    Py_DECREF(lens);
    return res;
fail:
    free(out.data);
    free(lengths);
    return NULL;
}

static PyMethodDef Encoder_methods[] = {
    {"encode", (PyCFunction)Encoder_encode, METH_VARARGS,
     "encode(texts, eos) -> (int32 ids with eos after each text, int32 tokens per text incl. eos), as bytes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mspretrain.data._bpe.Encoder",
    .tp_basicsize = sizeof(Encoder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SentencePiece BPE encoder for identity-normalised, byte-fallback models",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Encoder_init,
    .tp_dealloc = (destructor)Encoder_dealloc,
    .tp_methods = Encoder_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bpe", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__bpe(void) {
    if (PyType_Ready(&EncoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EncoderType);
    if (PyModule_AddObject(m, "Encoder", (PyObject *)&EncoderType) < 0) {
        Py_DECREF(&EncoderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
