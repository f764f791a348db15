/* hicache_draft._native: the data plane's hot loops, without the GIL.
 *
 * What it holds, and why it is compiled (issue 15): per page, the core makes a 64-byte header
 * (page_format.py) before every page_set and checks it after every page_get; a backend moves the
 * page's buffers with preadv/pwritev. Done in Python that is about 15 us of interpreter work per
 * page (memoryviews, struct packing, one hash call per buffer), most of it holding the GIL, which
 * caps 64 KiB pages far below what the kernel and the hash can do, and leaves the other cores idle.
 * Here one call handles a whole batch: the Python objects are read with the GIL held (a few
 * attribute reads per page), then every hash, comparison and system call runs with the GIL
 * released, so threads that split a batch run in parallel.
 *
 * The header rule itself is page_format.py's; this file computes the same bytes (tests compare
 * both on every field) and page_format.py's Python parser still names the problem of a page that
 * fails here. xxhash is the reference C library (Debian's libxxhash-dev header, inlined: the
 * built module needs no shared library), the same code the `xxhash` Python package binds.
 *
 * Memory: a buffer is either an object with the buffer protocol (held for the whole call) or an
 * object with integer `ptr` and `nbytes` attributes (hicache_draft.Buffer: host memory its owner
 * keeps alive, exactly as Buffer.view() trusts it). Built against the stable ABI of Python 3.11.
 */
#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "_native_team.h"

#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

/* xxh3_64 over spans or streamed, one build per instruction set (_native_hash_*.c); `hash` is the
 * best set this CPU runs, chosen once at import */
typedef struct {
    uint64_t (*spans)(const struct iovec *, long);
    void (*reset)(XXH3_state_t *);
    void (*update)(XXH3_state_t *, const void *, size_t);
    uint64_t (*digest)(const XXH3_state_t *);
    const char *isa;
} xxh3_impl;

#define HCD_DECLARE(isa)                                                                    \
    uint64_t hcd_xxh3_spans_##isa(const struct iovec *iov, long n);                         \
    void hcd_xxh3_reset_##isa(XXH3_state_t *st);                                            \
    void hcd_xxh3_update_##isa(XXH3_state_t *st, const void *p, size_t n);                  \
    uint64_t hcd_xxh3_digest_##isa(const XXH3_state_t *st);                                 \
    static const xxh3_impl impl_##isa = {hcd_xxh3_spans_##isa, hcd_xxh3_reset_##isa,        \
                                         hcd_xxh3_update_##isa, hcd_xxh3_digest_##isa, #isa};
HCD_DECLARE(base)
#if defined(__x86_64__) && defined(__GNUC__)
HCD_DECLARE(avx2)
HCD_DECLARE(avx512)
#endif
static const xxh3_impl *hash = &impl_base;

static void choose_xxh3(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        hash = &impl_avx512;
    else if (__builtin_cpu_supports("avx2"))
        hash = &impl_avx2;
#endif
}

#define HEADER_SIZE 64
#define FORMAT_VERSION 1
static const unsigned char MAGIC[8] = {'H', 'C', 'D', 'P', 'A', 'G', 'E', 0};

#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

static PyObject *str_ptr, *str_nbytes, *str_key, *str_namespace, *str_buffers, *str_header;
static double monotonic_now(void);

/* ---- buffers ---------------------------------------------------------------------------- */

typedef struct {
    struct iovec *iov;
    Py_ssize_t n, cap;
    Py_buffer *views; /* buffer-protocol objects held until release */
    Py_ssize_t nviews, capviews;
} spans;

static void spans_free(spans *s) {
    for (Py_ssize_t i = 0; i < s->nviews; i++) PyBuffer_Release(&s->views[i]);
    free(s->iov);
    free(s->views);
    memset(s, 0, sizeof(*s));
}

static int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = realloc(*p, (size_t)c * item);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    *cap = c;
    return 0;
}

/* Append one buffer's memory to `s`: the buffer protocol first, else `ptr`/`nbytes`. */
static int spans_add(spans *s, PyObject *obj, int writable) {
    void *base;
    Py_ssize_t len;
    if (PyObject_CheckBuffer(obj)) {
        if (grow((void **)&s->views, &s->capviews, s->nviews + 1, sizeof(Py_buffer)) < 0) return -1;
        Py_buffer *v = &s->views[s->nviews];
        if (PyObject_GetBuffer(obj, v, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
        s->nviews++;
        base = v->buf;
        len = v->len;
    } else {
        PyObject *p = PyObject_GetAttr(obj, str_ptr);
        if (p == NULL) return -1;
        base = PyLong_AsVoidPtr(p);
        Py_DECREF(p);
        if (base == NULL && PyErr_Occurred()) return -1;
        PyObject *n = PyObject_GetAttr(obj, str_nbytes);
        if (n == NULL) return -1;
        len = PyLong_AsSsize_t(n);
        Py_DECREF(n);
        if (len == -1 && PyErr_Occurred()) return -1;
        if (len < 0) {
            PyErr_SetString(PyExc_ValueError, "buffer with negative nbytes");
            return -1;
        }
        if (base == NULL && len > 0) {
            PyErr_SetString(PyExc_ValueError, "buffer at address 0");
            return -1;
        }
    }
    if (grow((void **)&s->iov, &s->cap, s->n + 1, sizeof(struct iovec)) < 0) return -1;
    s->iov[s->n].iov_base = base;
    s->iov[s->n].iov_len = (size_t)len;
    s->n++;
    return 0;
}

static int spans_add_all(spans *s, PyObject *seq, int writable) {
    PyObject *t = PySequence_Tuple(seq);
    if (t == NULL) return -1;
    Py_ssize_t n = PyTuple_Size(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (spans_add(s, PyTuple_GetItem(t, i), writable) < 0) {
            Py_DECREF(t);
            return -1;
        }
    }
    Py_DECREF(t);
    return 0;
}

/* ---- headers ------------------------------------------------------------------------------ */

typedef struct {
    const char *key;
    Py_ssize_t key_len;
    unsigned char ns[12];
    unsigned char code;
    Py_ssize_t first, count; /* its payload spans */
    unsigned char *header;   /* where the header is written (pack) or read (check) */
} page_job;

static void le16(unsigned char *p, uint16_t v) { p[0] = v & 0xff; p[1] = v >> 8; }
static void le32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (v >> (8 * i)) & 0xff; }
static void le64(unsigned char *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (v >> (8 * i)) & 0xff; }

/* The header page_format.make_header makes for this job's key, namespace and pool, and a payload
 * of `n` bytes whose xxh3_64 is `sum`. */
static void make_header_of(const page_job *j, uint64_t n, uint64_t sum, unsigned char out[HEADER_SIZE]) {
    memcpy(out, MAGIC, 8);
    le16(out + 8, FORMAT_VERSION);
    out[10] = j->code;
    out[11] = 0;
    le32(out + 12, HEADER_SIZE);
    le64(out + 16, n);
    le64(out + 24, sum);
    memcpy(out + 32, j->ns, 12);
    XXH128_canonical_t kd;
    XXH128_canonicalFromHash(&kd, XXH3_128bits(j->key, (size_t)j->key_len));
    memcpy(out + 44, kd.digest, 16);
    le32(out + 60, XXH32(out, 60, 0));
}

/* The header for this job's payload spans. */
static void make_one(const page_job *j, const struct iovec *iov, unsigned char out[HEADER_SIZE]) {
    uint64_t n = 0;
    for (Py_ssize_t k = j->first; k < j->first + j->count; k++) n += iov[k].iov_len;
    make_header_of(j, n, hash->spans(iov + j->first, (long)j->count), out);
}

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* The 12 namespace bytes: a 24-hex-digit string parsed here, anything else through `fallback`
 * (page_format.namespace_bytes, which hashes it). `last`/`last_ns` remember the previous one:
 * a batch mostly has one namespace. */
static int namespace_of(PyObject *ns, PyObject *fallback, PyObject **last, unsigned char out[12],
                        unsigned char last_ns[12]) {
    if (ns == *last) {
        memcpy(out, last_ns, 12);
        return 0;
    }
    int done = 0;
    if (PyUnicode_Check(ns)) {
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(ns, &len);
        if (s == NULL) return -1;
        if (len == 24) {
            done = 1;
            for (int i = 0; i < 12; i++) {
                int hi = hexval((unsigned char)s[2 * i]), lo = hexval((unsigned char)s[2 * i + 1]);
                if (hi < 0 || lo < 0) {
                    done = 0;
                    break;
                }
                out[i] = (unsigned char)(hi << 4 | lo);
            }
        }
    }
    if (!done) {
        PyObject *b = PyObject_CallFunctionObjArgs(fallback, ns, NULL);
        if (b == NULL) return -1;
        char *p;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(b, &p, &len) < 0 || len != 12) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "namespace bytes must be 12 bytes");
            Py_DECREF(b);
            return -1;
        }
        memcpy(out, p, 12);
        Py_DECREF(b);
    }
    *last = ns;
    memcpy(last_ns, out, 12);
    return 0;
}

typedef struct {
    PyObject *items; /* tuple, holds every object the jobs point into */
    page_job *jobs;
    Py_ssize_t n;
    spans payload;
    spans heads; /* one span per job (check: the stored header) */
} batch;

static void batch_free(batch *b) {
    spans_free(&b->payload);
    spans_free(&b->heads);
    free(b->jobs);
    Py_XDECREF(b->items);
    memset(b, 0, sizeof(*b));
}

/* Read `items` into jobs. An item is a page (attributes key, namespace, buffers and, with
 * `with_header`, header) or a tuple (key, namespace, parts). `codes`: an int for every item, or a
 * bytes-like object of one pool code per item. */
static int batch_load(batch *b, PyObject *items, PyObject *codes, PyObject *fallback, int with_header) {
    memset(b, 0, sizeof(*b));
    b->items = PySequence_Tuple(items);
    if (b->items == NULL) return -1;
    b->n = PyTuple_Size(b->items);
    b->jobs = calloc((size_t)(b->n ? b->n : 1), sizeof(page_job));
    if (b->jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    long one_code = -1;
    Py_buffer cv;
    int have_cv = 0;
    if (PyLong_Check(codes)) {
        one_code = PyLong_AsLong(codes);
        if (one_code < 0 || one_code > 255) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "pool code out of range 0..255");
            return -1;
        }
    } else {
        if (PyObject_GetBuffer(codes, &cv, PyBUF_SIMPLE) < 0) return -1;
        have_cv = 1;
        if (cv.len != b->n) {
            PyBuffer_Release(&cv);
            PyErr_SetString(PyExc_ValueError, "one pool code per item");
            return -1;
        }
    }
    PyObject *last = NULL;
    unsigned char last_ns[12];
    int rc = -1;
    for (Py_ssize_t i = 0; i < b->n; i++) {
        PyObject *it = PyTuple_GetItem(b->items, i);
        page_job *j = &b->jobs[i];
        PyObject *key, *ns, *parts, *head = NULL;
        if (PyTuple_Check(it)) {
            if (PyTuple_Size(it) != 3) {
                PyErr_SetString(PyExc_TypeError, "an item is a page or (key, namespace, parts)");
                goto out;
            }
            key = PyTuple_GetItem(it, 0);
            ns = PyTuple_GetItem(it, 1);
            parts = PyTuple_GetItem(it, 2);
            Py_INCREF(key);
            Py_INCREF(ns);
            Py_INCREF(parts);
        } else {
            key = PyObject_GetAttr(it, str_key);
            ns = key ? PyObject_GetAttr(it, str_namespace) : NULL;
            parts = ns ? PyObject_GetAttr(it, str_buffers) : NULL;
            if (parts == NULL) {
                Py_XDECREF(key);
                Py_XDECREF(ns);
                goto out;
            }
        }
        /* the page holds key and namespace: borrowed pointers stay valid while b->items lives */
        int bad = 0;
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "page key must be a str");
            bad = 1;
        } else {
            j->key = PyUnicode_AsUTF8AndSize(key, &j->key_len);
            bad = j->key == NULL;
        }
        if (!bad) bad = namespace_of(ns, fallback, &last, j->ns, last_ns) < 0;
        j->code = (unsigned char)(have_cv ? ((unsigned char *)cv.buf)[i] : one_code);
        j->first = b->payload.n;
        if (!bad) bad = spans_add_all(&b->payload, parts, 0) < 0;
        j->count = b->payload.n - j->first;
        if (!bad && with_header) {
            head = PyObject_GetAttr(it, str_header);
            if (head == NULL) {
                bad = 1;
            } else if (head == Py_None) {
                PyErr_SetString(PyExc_ValueError, "page without a header");
                bad = 1;
            } else {
                bad = spans_add(&b->heads, head, with_header > 1) < 0; /* 2: written into */
                if (!bad && b->heads.iov[b->heads.n - 1].iov_len < HEADER_SIZE) {
                    PyErr_SetString(PyExc_ValueError, "page header shorter than 64 bytes");
                    bad = 1;
                }
                if (!bad) j->header = b->heads.iov[b->heads.n - 1].iov_base;
            }
            Py_XDECREF(head);
        }
        Py_DECREF(key);
        Py_DECREF(ns);
        Py_DECREF(parts);
        if (bad) goto out;
    }
    rc = 0;
out:
    if (have_cv) PyBuffer_Release(&cv);
    return rc;
}

/* TimeoutError(ETIMEDOUT, what): a call that stopped at its deadline (or was told to stop). */
static PyObject *raise_late(const char *what) {
    PyObject *exc_args = Py_BuildValue("(is)", ETIMEDOUT, what);
    if (exc_args != NULL) {
        PyErr_SetObject(PyExc_TimeoutError, exc_args);
        Py_DECREF(exc_args);
    }
    return NULL;
}

/* The indices i < n where bad[i] is set, as a list. */
static PyObject *bad_indices(const unsigned char *bad, Py_ssize_t n) {
    PyObject *lst = PyList_New(0);
    for (Py_ssize_t i = 0; lst != NULL && i < n; i++) {
        if (!bad[i]) continue;
        PyObject *v = PyLong_FromSsize_t(i);
        if (v == NULL || PyList_Append(lst, v) < 0) Py_CLEAR(lst);
        Py_XDECREF(v);
    }
    return lst;
}

/* One batch's headers made (pack: written to `out`, or into each page's own header) or checked
 * (against each page's header, `bad` set where they differ), page i by whichever thread takes it
 * (_native_team.c). A pack with a deadline or a stop flag makes no header once either is hit. */
typedef struct {
    batch *b;
    unsigned char *out; /* pack: the headers, 64 bytes each (NULL: each page's own header) */
    unsigned char *bad; /* check: 1 where a page's header is not the one made from its bytes */
    double deadline;
    const volatile unsigned char *stop; /* a byte the caller sets to stop it (NULL: none) */
    _Atomic int late;   /* a page was not made: the deadline passed or stop was set */
} headers_ctx;

/* Whether a team's work must stop before its next page (the deadline passed, `stop` was set, or
 * another page already stopped): then `late` is set. */
static int halted(_Atomic int *late, const volatile unsigned char *stop, double deadline) {
    if (atomic_load(late) || (stop != NULL && stop[0]) || (isfinite(deadline) && monotonic_now() > deadline)) {
        atomic_store(late, 1);
        return 1;
    }
    return 0;
}

/* Run `work` over `n` pages on the team (GIL released); -1 with TimeoutError(what) when `late`
 * says a page stopped at the deadline or the stop flag. */
static int team_in_time(hcd_work work, void *ctx, Py_ssize_t n, int threads, _Atomic int *late, const char *what) {
    Py_BEGIN_ALLOW_THREADS
    hcd_team_run(work, ctx, n, threads);
    Py_END_ALLOW_THREADS
    if (!atomic_load(late)) return 0;
    raise_late(what);
    return -1;
}

static void pack_one(void *ctx, ptrdiff_t i) {
    headers_ctx *c = ctx;
    if (halted(&c->late, c->stop, c->deadline)) return;
    page_job *j = &c->b->jobs[i];
    make_one(j, c->b->payload.iov, c->out != NULL ? c->out + i * HEADER_SIZE : j->header);
}

static void check_one(void *ctx, ptrdiff_t i) {
    headers_ctx *c = ctx;
    unsigned char made[HEADER_SIZE];
    make_one(&c->b->jobs[i], c->b->payload.iov, made);
    c->bad[i] = memcmp(made, c->b->jobs[i].header, HEADER_SIZE) != 0;
}

/* pack_headers(out, items, codes, namespace_bytes, threads=1, deadline=inf, stop=None)
 *
 * Every item's header into `out` at 64 * i, or, with `out` None, into each item's own `header`
 * buffer. Past `deadline` (time.monotonic), or once the first byte of the buffer `stop` is
 * nonzero, no further header is made and TimeoutError is raised. */
static PyObject *pack_headers(PyObject *self, PyObject *args) {
    PyObject *out, *items, *codes, *fallback, *stop = Py_None;
    int threads = 1;
    double deadline = INFINITY;
    if (!PyArg_ParseTuple(args, "OOOO|idO:pack_headers", &out, &items, &codes, &fallback, &threads, &deadline, &stop))
        return NULL;
    Py_buffer ov = {0}, sv = {0};
    int own = out == Py_None; /* into each page's own header */
    if (!own && PyObject_GetBuffer(out, &ov, PyBUF_WRITABLE) < 0) return NULL;
    if (stop != Py_None && PyObject_GetBuffer(stop, &sv, PyBUF_SIMPLE) < 0) {
        if (!own) PyBuffer_Release(&ov);
        return NULL;
    }
    PyObject *res = NULL;
    batch b;
    if (stop != Py_None && sv.len < 1) {
        PyErr_SetString(PyExc_ValueError, "stop must hold at least one byte");
        memset(&b, 0, sizeof(b));
        goto done;
    }
    if (batch_load(&b, items, codes, fallback, own ? 2 : 0) < 0) goto done;
    if (!own && ov.len < b.n * HEADER_SIZE) {
        PyErr_Format(PyExc_ValueError, "output holds %zd bytes, %zd headers need %zd", ov.len, b.n, b.n * HEADER_SIZE);
        goto done;
    }
    headers_ctx c = {&b, own ? NULL : ov.buf, NULL, deadline, stop != Py_None ? sv.buf : NULL, 0};
    if (team_in_time(pack_one, &c, b.n, threads, &c.late, "headers past the deadline or after stop") < 0) goto done;
    res = Py_None;
    Py_INCREF(res);
done:
    batch_free(&b);
    if (!own) PyBuffer_Release(&ov);
    if (stop != Py_None) PyBuffer_Release(&sv);
    return res;
}

/* ---- records packed into memory, their headers made from the copy ---------------------------- */

/* Pieces a large page is copied and hashed in: each is hashed right after it is copied, while it
 * is still in this core's cache, so the page's memory is read once. */
#define PACK_PIECE_BYTES (64u << 10)

typedef struct {
    batch *b;
    spans *dst;   /* one writable span per page: its record (header, then payload) goes there */
    double deadline;
    const volatile unsigned char *stop;
    _Atomic int late;
} records_ctx;

static void record_one(void *ctx, ptrdiff_t i) {
    records_ctx *c = ctx;
    if (halted(&c->late, c->stop, c->deadline)) return;
    page_job *j = &c->b->jobs[i];
    const struct iovec *iov = c->b->payload.iov + j->first;
    unsigned char *rec = c->dst->iov[i].iov_base, *at = rec + HEADER_SIZE;
    uint64_t len = 0;
    for (Py_ssize_t k = 0; k < j->count; k++) len += iov[k].iov_len;
    uint64_t sum;
    if (len <= PACK_PIECE_BYTES) { /* copied whole, then hashed from the copy */
        for (Py_ssize_t k = 0; k < j->count; k++) {
            memcpy(at, iov[k].iov_base, iov[k].iov_len);
            at += iov[k].iov_len;
        }
        struct iovec whole = {rec + HEADER_SIZE, (size_t)len};
        sum = hash->spans(&whole, 1);
    } else {
        XXH3_state_t st;
        hash->reset(&st);
        for (Py_ssize_t k = 0; k < j->count; k++) {
            const unsigned char *p = iov[k].iov_base;
            size_t left = iov[k].iov_len;
            while (left > 0) {
                size_t take = left < PACK_PIECE_BYTES ? left : PACK_PIECE_BYTES;
                memcpy(at, p, take);
                hash->update(&st, at, take);
                at += take;
                p += take;
                left -= take;
            }
        }
        sum = hash->digest(&st);
    }
    make_header_of(j, len, sum, j->header);
    memcpy(rec, j->header, HEADER_SIZE);
}

/* pack_records(items, dsts, codes, namespace_bytes, threads=1, deadline=inf, stop=None)
 *
 * Each page's record (its 64-byte header, then its payload) written into dsts[i], a writable
 * buffer of at least 64 + the page's bytes: the payload is copied there and the header made from
 * the copy (one pass over the page's memory), and put into the page's own `header` too. Past
 * `deadline`, or once the first byte of `stop` is nonzero, no further page is read or written:
 * TimeoutError. */
static PyObject *pack_records(PyObject *self, PyObject *args) {
    PyObject *items, *dsts, *codes, *fallback, *stop = Py_None;
    int threads = 1;
    double deadline = INFINITY;
    if (!PyArg_ParseTuple(args, "OOOO|idO:pack_records", &items, &dsts, &codes, &fallback, &threads, &deadline,
                          &stop))
        return NULL;
    Py_buffer sv = {0};
    if (stop != Py_None && PyObject_GetBuffer(stop, &sv, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *res = NULL;
    batch b;
    spans d;
    memset(&b, 0, sizeof(b));
    memset(&d, 0, sizeof(d));
    if (stop != Py_None && sv.len < 1) {
        PyErr_SetString(PyExc_ValueError, "stop must hold at least one byte");
        goto done;
    }
    if (batch_load(&b, items, codes, fallback, 2) < 0 || spans_add_all(&d, dsts, 1) < 0) goto done;
    if (d.n != b.n) {
        PyErr_Format(PyExc_ValueError, "pack_records: %zd pages but %zd destinations", b.n, d.n);
        goto done;
    }
    for (Py_ssize_t i = 0; i < b.n; i++) {
        uint64_t len = HEADER_SIZE;
        for (Py_ssize_t k = b.jobs[i].first; k < b.jobs[i].first + b.jobs[i].count; k++)
            len += b.payload.iov[k].iov_len;
        if ((uint64_t)d.iov[i].iov_len < len) {
            PyErr_Format(PyExc_ValueError, "pack_records: destination %zd holds %zu bytes, its record needs %llu", i,
                         d.iov[i].iov_len, (unsigned long long)len);
            goto done;
        }
    }
    records_ctx c = {&b, &d, deadline, stop != Py_None ? sv.buf : NULL, 0};
    if (team_in_time(record_one, &c, b.n, threads, &c.late, "records past the deadline or after stop") < 0) goto done;
    res = Py_None;
    Py_INCREF(res);
done:
    spans_free(&d);
    batch_free(&b);
    if (stop != Py_None) PyBuffer_Release(&sv);
    return res;
}

static PyObject *mismatches(PyObject *self, PyObject *args) {
    PyObject *items, *codes, *fallback;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOO|i:mismatches", &items, &codes, &fallback, &threads)) return NULL;
    batch b;
    if (batch_load(&b, items, codes, fallback, 1) < 0) {
        batch_free(&b);
        return NULL;
    }
    unsigned char *bad = calloc((size_t)(b.n ? b.n : 1), 1);
    if (bad == NULL) {
        batch_free(&b);
        return PyErr_NoMemory();
    }
    headers_ctx c = {&b, NULL, bad, INFINITY, NULL, 0};
    Py_BEGIN_ALLOW_THREADS
    hcd_team_run(check_one, &c, b.n, threads);
    Py_END_ALLOW_THREADS
    PyObject *res = bad_indices(bad, b.n);
    free(bad);
    batch_free(&b);
    return res;
}

/* ---- positional vectored I/O ---------------------------------------------------------------- */

static double monotonic_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Advance `iov` (n entries, cursor *i) by `done` bytes. */
static void advance(struct iovec *iov, Py_ssize_t n, Py_ssize_t *i, size_t done) {
    while (*i < n && done >= iov[*i].iov_len) {
        done -= iov[*i].iov_len;
        (*i)++;
    }
    if (*i < n && done) {
        iov[*i].iov_base = (char *)iov[*i].iov_base + done;
        iov[*i].iov_len -= done;
    }
}

static PyObject *read_into(PyObject *self, PyObject *args) {
    int fd;
    long long offset;
    PyObject *bufs;
    if (!PyArg_ParseTuple(args, "iLO:read_into", &fd, &offset, &bufs)) return NULL;
    if (offset < 0) return PyErr_Format(PyExc_ValueError, "negative offset");
    spans s = {0};
    if (spans_add_all(&s, bufs, 1) < 0) {
        spans_free(&s);
        return NULL;
    }
    long long total = 0;
    int err = 0;
    Py_ssize_t i = 0;
    Py_BEGIN_ALLOW_THREADS
    while (i < s.n && s.iov[i].iov_len == 0) i++;
    while (i < s.n) {
        int cnt = (int)(s.n - i < IOV_MAX ? s.n - i : IOV_MAX);
        ssize_t got = preadv(fd, s.iov + i, cnt, (off_t)offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        if (got == 0) break; /* end of file */
        offset += got;
        total += got;
        advance(s.iov, s.n, &i, (size_t)got);
        while (i < s.n && s.iov[i].iov_len == 0) i++;
    }
    Py_END_ALLOW_THREADS
    spans_free(&s);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong(total);
}

/* Write `n` spans from file offset *offset in calls that end on multiples of `chunk` (IOV_MAX
 * spans at most), as write_from does; *offset advances. 0, an errno, or -1 past the deadline. */
static int write_spans(int fd, long long *offset, struct iovec *iov, Py_ssize_t n, long long chunk, double deadline,
                       struct iovec *call) {
    Py_ssize_t i = 0;
    while (i < n && iov[i].iov_len == 0) i++;
    while (i < n) {
        if (isfinite(deadline) && monotonic_now() > deadline) return -1;
        size_t room = (size_t)(chunk - *offset % chunk);
        int cnt = 0;
        size_t want = 0;
        for (Py_ssize_t k = i; k < n && cnt < IOV_MAX && want < room; k++) {
            size_t take = iov[k].iov_len;
            if (take == 0) continue;
            if (take > room - want) take = room - want;
            call[cnt].iov_base = iov[k].iov_base;
            call[cnt].iov_len = take;
            cnt++;
            want += take;
        }
        ssize_t done = pwritev(fd, call, cnt, (off_t)*offset);
        if (done < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (done == 0) return EIO;
        *offset += done;
        advance(iov, n, &i, (size_t)done);
        while (i < n && iov[i].iov_len == 0) i++;
    }
    return 0;
}

static PyObject *write_from(PyObject *self, PyObject *args) {
    int fd;
    long long offset, chunk;
    double deadline;
    PyObject *bufs;
    if (!PyArg_ParseTuple(args, "iLOLd:write_from", &fd, &offset, &bufs, &chunk, &deadline)) return NULL;
    if (offset < 0 || chunk <= 0) return PyErr_Format(PyExc_ValueError, "negative offset or non-positive chunk");
    spans s = {0};
    if (spans_add_all(&s, bufs, 0) < 0) {
        spans_free(&s);
        return NULL;
    }
    /* calls end on multiples of `chunk` in the file (large page-cache folios), IOV_MAX at most */
    struct iovec *call = malloc(sizeof(struct iovec) * IOV_MAX);
    if (call == NULL) {
        spans_free(&s);
        return PyErr_NoMemory();
    }
    long long start = offset;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = write_spans(fd, &offset, s.iov, s.n, chunk, deadline, call);
    Py_END_ALLOW_THREADS
    free(call);
    spans_free(&s);
    if (err > 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (err < 0) return raise_late("write ran past its deadline");
    return PyLong_FromLongLong(offset - start);
}

/* ---- writing pages, their headers made as they go ------------------------------------------ */

/* Pages up to this size are hashed whole and then written with their neighbours (a group of at
 * most this many bytes, still in this core's cache when written); a larger page is hashed and
 * written piece by piece (each piece ends on a `chunk` multiple of the file) and its header is
 * written again once made, in its place before the payload. */
#define WRITE_GROUP_BYTES (1u << 20)

/* Pending spans of write_records: made (hashed, headers in place) but not yet written. */
typedef struct {
    struct iovec *iov;
    Py_ssize_t n;
    size_t bytes;
} pending;

/* Write the first `want` bytes (at most all) of `q` at *offset (which advances) and keep the rest,
 * in order, at the front of `q`. 0, an errno, or -1 past the deadline. */
static int pending_write(int fd, long long *offset, pending *q, size_t want, long long chunk, double deadline,
                         struct iovec *call) {
    if (want == 0) return 0;
    Py_ssize_t k = 0;
    size_t before = 0;
    while (before + q->iov[k].iov_len < want) before += q->iov[k++].iov_len;
    struct iovec last = q->iov[k]; /* written in part (or whole) */
    size_t part = want - before;
    q->iov[k].iov_len = part;
    int err = write_spans(fd, offset, q->iov, k + 1, chunk, deadline, call);
    if (err) return err;
    Py_ssize_t rest = 0;
    if (part < last.iov_len) q->iov[rest++] = (struct iovec){(char *)last.iov_base + part, last.iov_len - part};
    for (Py_ssize_t m = k + 1; m < q->n; m++) q->iov[rest++] = q->iov[m];
    q->n = rest;
    q->bytes -= want;
    return 0;
}

/* Write what of `q` ends on the last `chunk` multiple of the file it reaches; the rest waits for
 * the next spans, so every write call but the last of write_records ends on a multiple. */
static int pending_whole_chunks(int fd, long long *offset, pending *q, long long chunk, double deadline,
                                struct iovec *call) {
    long long cut = (*offset + (long long)q->bytes) / chunk * chunk;
    return cut > *offset ? pending_write(fd, offset, q, (size_t)(cut - *offset), chunk, deadline, call) : 0;
}

static void pending_add(pending *q, void *p, size_t len) {
    q->iov[q->n++] = (struct iovec){p, len};
    q->bytes += len;
}

/* write_records(fd, offset, pages, codes, namespace_bytes, chunk, deadline) -> bytes written
 *
 * Store `pages` back to back from `offset` in the core's page format (each its 64-byte header,
 * then its payload), making each page's header from the bytes as they are written (one pass over
 * the memory) and putting it into the page's `header` buffer too. Every write call but the last
 * (and a large page's header, written again once made) ends on a multiple of `chunk` in the
 * file: a call that ended inside a page of the file would make the kernel read that page from
 * the disk first when the file's blocks hold data that is not cached (a recycled or prefaulted
 * segment file whose pages were reclaimed). Past `deadline` no further byte of any page is read
 * or written: TimeoutError. The GIL is released throughout. */
/* The runs of read_runs / write_runs: `seq` as a tuple (*t, a new reference) of *n runs, and
 * zeroed state of `item` bytes for each; NULL with an exception (nothing to release) otherwise. */
static void *runs_new(PyObject *seq, size_t item, PyObject **t, Py_ssize_t *n) {
    *t = PySequence_Tuple(seq);
    if (*t == NULL) return NULL;
    *n = PyTuple_Size(*t);
    void *runs = calloc((size_t)(*n ? *n : 1), item);
    if (runs == NULL) {
        Py_CLEAR(*t);
        PyErr_NoMemory();
    }
    return runs;
}

/* One run of read_runs / write_runs: (fd, offset, pages, codes); -1 with an exception if it is not. */
static int run_args(PyObject *run, const char *format, int *fd, long long *offset, PyObject **items, PyObject **codes) {
    if (!PyTuple_Check(run)) {
        PyErr_SetString(PyExc_TypeError, "a run is (fd, offset, pages, codes)");
        return -1;
    }
    if (!PyArg_ParseTuple(run, format, fd, offset, items, codes)) return -1;
    if (*offset < 0) {
        PyErr_SetString(PyExc_ValueError, "a run's offset is negative");
        return -1;
    }
    return 0;
}

/* Write batch `b` from *offset (which advances), as write_records does (see below). 0, an errno
 * (ENOMEM: no memory for the scratch), or -1 past the deadline. No GIL needed. */
static int records_write(int fd, long long *offset_io, batch *b, long long chunk, double deadline) {
    struct iovec *call = malloc(sizeof(struct iovec) * IOV_MAX);
    /* every header and payload span once, a large page's pieces, and one span split by a cut */
    pending q = {malloc(sizeof(struct iovec) * (size_t)(b->n + b->payload.n + 4)), 0, 0};
    XXH3_state_t *st = XXH3_createState();
    if (call == NULL || q.iov == NULL || st == NULL) {
        free(call);
        free(q.iov);
        XXH3_freeState(st);
        return ENOMEM;
    }
    long long offset = *offset_io;
    int err = 0;
    Py_ssize_t i = 0;
    while (i < b->n && !err) {
        page_job *j = &b->jobs[i];
        uint64_t len = 0;
        for (Py_ssize_t k = j->first; k < j->first + j->count; k++) len += b->payload.iov[k].iov_len;
        if (isfinite(deadline) && monotonic_now() > deadline) {
            err = -1;
            break;
        }
        if (len > WRITE_GROUP_BYTES) { /* hashed and written piece by piece, header again once made */
            long long head_at = offset + (long long)q.bytes;
            long long at = head_at + HEADER_SIZE;
            pending_add(&q, j->header, HEADER_SIZE); /* its place (bytes made below) */
            hash->reset(st);
            for (Py_ssize_t k = j->first; k < j->first + j->count && !err; k++) {
                unsigned char *p = b->payload.iov[k].iov_base;
                size_t left = b->payload.iov[k].iov_len;
                while (left > 0 && !err) {
                    size_t take = (size_t)(chunk - at % chunk);
                    if (take > left) take = left;
                    hash->update(st, p, take);
                    pending_add(&q, p, take);
                    at += take;
                    err = pending_whole_chunks(fd, &offset, &q, chunk, deadline, call);
                    p += take;
                    left -= take;
                }
            }
            if (err) break;
            make_header_of(j, len, hash->digest(st), j->header);
            if (offset > head_at) { /* some of its place was written before the header was made */
                struct iovec h = {j->header, HEADER_SIZE};
                long long again = head_at;
                err = write_spans(fd, &again, &h, 1, chunk, deadline, call);
            }
            i++;
            continue;
        }
        /* a group of small pages: each hashed whole, then written with the spans before them */
        Py_ssize_t e = i;
        uint64_t group = 0;
        while (e < b->n) {
            page_job *g = &b->jobs[e];
            uint64_t gl = 0;
            for (Py_ssize_t k = g->first; k < g->first + g->count; k++) gl += b->payload.iov[k].iov_len;
            if (e > i && (gl > WRITE_GROUP_BYTES || group + gl + HEADER_SIZE > WRITE_GROUP_BYTES)) break;
            make_header_of(g, gl, hash->spans(b->payload.iov + g->first, (long)g->count), g->header);
            pending_add(&q, g->header, HEADER_SIZE);
            for (Py_ssize_t k = g->first; k < g->first + g->count; k++)
                pending_add(&q, b->payload.iov[k].iov_base, b->payload.iov[k].iov_len);
            group += gl + HEADER_SIZE;
            e++;
        }
        err = pending_whole_chunks(fd, &offset, &q, chunk, deadline, call);
        i = e;
    }
    if (!err) err = pending_write(fd, &offset, &q, q.bytes, chunk, deadline, call); /* the last call */
    XXH3_freeState(st);
    free(call);
    free(q.iov);
    *offset_io = offset;
    return err;
}

/* write_records(fd, offset, pages, codes, namespace_bytes, chunk, deadline) -> bytes written
 *
 * Store `pages` back to back from `offset` in the core's page format (each its 64-byte header,
 * then its payload), making each page's header from the bytes as they are written (one pass over
 * the memory) and putting it into the page's `header` buffer too. Every write call but the last
 * (and a large page's header, written again once made) ends on a multiple of `chunk` in the
 * file: a call that ended inside a page of the file would make the kernel read that page from
 * the disk first when the file's blocks hold data that is not cached (a recycled or prefaulted
 * segment file whose pages were reclaimed). Past `deadline` no further byte of any page is read
 * or written: TimeoutError. The GIL is released throughout. */
static PyObject *write_records(PyObject *self, PyObject *args) {
    int fd;
    long long offset, chunk;
    double deadline;
    PyObject *items, *codes, *fallback;
    if (!PyArg_ParseTuple(args, "iLOOOLd:write_records", &fd, &offset, &items, &codes, &fallback, &chunk, &deadline))
        return NULL;
    if (offset < 0 || chunk <= 0) return PyErr_Format(PyExc_ValueError, "negative offset or non-positive chunk");
    batch b;
    if (batch_load(&b, items, codes, fallback, 2) < 0) {
        batch_free(&b);
        return NULL;
    }
    long long start = offset;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = records_write(fd, &offset, &b, chunk, deadline);
    Py_END_ALLOW_THREADS
    batch_free(&b);
    if (err > 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (err < 0) return raise_late("write ran past its deadline");
    return PyLong_FromLongLong(offset - start);
}

/* One run of write_runs: loaded with the GIL, written without it. */
typedef struct {
    int fd;
    long long start, offset; /* where the run starts; where its written bytes end */
    batch b;
    int err; /* an errno, -1 past the deadline (started or not) */
} wrun;

typedef struct {
    wrun *runs;
    long long chunk;
    double deadline;
    PyObject *meanwhile;  /* called in the owner's thread while the helpers write (NULL: none) */
    PyThreadState *saved; /* the owner's thread state while the GIL is let go */
    int meanwhile_failed;
} wruns_ctx;

static void write_one(void *ctx, ptrdiff_t i) {
    wruns_ctx *c = ctx;
    wrun *r = &c->runs[i];
    if (isfinite(c->deadline) && monotonic_now() > c->deadline) {
        r->err = -1;
        return;
    }
    r->err = records_write(r->fd, &r->offset, &r->b, c->chunk, c->deadline);
}

/* The owner's work before it takes runs: `meanwhile()` with the GIL (its exception kept). */
static void run_meanwhile(void *ctx) {
    wruns_ctx *c = ctx;
    PyEval_RestoreThread(c->saved);
    PyObject *r = PyObject_CallNoArgs(c->meanwhile);
    if (r == NULL) c->meanwhile_failed = 1; /* the exception stays set until the runs are done */
    Py_XDECREF(r);
    c->saved = PyEval_SaveThread();
}

/* write_runs(runs, namespace_bytes, chunk, threads, deadline, meanwhile=None) -> one result per run
 *
 * `runs`: (fd, offset, pages, codes) each, written as write_records writes its pages, shared by
 * the calling thread and up to threads - 1 helpers (_native_team.c), each taking the next run as
 * it gets free. With `meanwhile`, the calling thread first calls it (with the GIL: Python work that
 * does not need the runs' bytes, done while the helpers write) and then takes any run not yet
 * taken. A run's result: the bytes written, or the OSError its writes raised (TimeoutError: the
 * deadline passed before or while it was written; nothing more of it was read or written).
 * Returns once no thread touches any page any more; an exception `meanwhile` raised is raised
 * then. The GIL is released while writing. */
static PyObject *write_runs(PyObject *self, PyObject *args) {
    PyObject *seq, *fallback, *meanwhile = Py_None;
    long long chunk;
    int threads;
    double deadline;
    if (!PyArg_ParseTuple(args, "OOLid|O:write_runs", &seq, &fallback, &chunk, &threads, &deadline, &meanwhile))
        return NULL;
    if (chunk <= 0) return PyErr_Format(PyExc_ValueError, "non-positive chunk");
    if (meanwhile != Py_None && !PyCallable_Check(meanwhile)) return PyErr_Format(PyExc_TypeError, "meanwhile is not callable");
    PyObject *t;
    Py_ssize_t n;
    wrun *runs = runs_new(seq, sizeof(wrun), &t, &n);
    if (runs == NULL) return NULL;
    Py_ssize_t loaded = 0;
    PyObject *out = NULL;
    for (; loaded < n; loaded++) {
        int fd;
        long long offset;
        PyObject *items, *codes;
        if (run_args(PyTuple_GetItem(t, loaded), "iLOO:write_runs run", &fd, &offset, &items, &codes) < 0) goto fail;
        runs[loaded].fd = fd;
        runs[loaded].start = runs[loaded].offset = offset;
        if (batch_load(&runs[loaded].b, items, codes, fallback, 2) < 0) {
            loaded++; /* partly loaded: freed below */
            goto fail;
        }
    }
    wruns_ctx ctx = {runs, chunk, deadline, meanwhile == Py_None ? NULL : meanwhile, NULL, 0};
    ctx.saved = PyEval_SaveThread();
    hcd_team_run_first(write_one, &ctx, n, threads, ctx.meanwhile ? run_meanwhile : NULL, &ctx);
    PyEval_RestoreThread(ctx.saved);
    if (ctx.meanwhile_failed) goto fail;
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        wrun *r = &runs[i];
        PyObject *v;
        if (r->err < 0) {
            v = PyObject_CallFunction(PyExc_TimeoutError, "s", "write ran past its deadline");
        } else if (r->err) {
            v = PyObject_CallFunction(PyExc_OSError, "is", r->err, strerror(r->err));
        } else {
            v = PyLong_FromLongLong(r->offset - r->start);
        }
        if (v == NULL || PyList_SetItem(out, i, v) < 0) Py_CLEAR(out);
    }
fail:
    for (Py_ssize_t i = 0; i < loaded; i++) batch_free(&runs[i].b);
    free(runs);
    Py_DECREF(t);
    return out;
}

/* ---- reading stored pages, verified as they land -------------------------------------------- */

/* One piece of the byte stream of stored pages: a page's header or a part of its payload. */
typedef struct {
    unsigned char *p;
    size_t len;
    Py_ssize_t page;
    int header; /* the page's header (not hashed) */
    int last;   /* the page's last piece: its payload is complete once this one is */
} piece;

/* One run of stored pages to read and verify: loaded with the GIL, read without it. */
typedef struct {
    int fd;
    long long offset, chunk;
    batch b;
    long long total;    /* bytes read */
    int err;            /* errno of a failed read (ENOMEM: no memory for the run) */
    int late;           /* not started: the deadline had passed */
    int check;          /* verify (0: only read, for benchmarks' bare variant) */
    unsigned char *bad; /* per page: 1 unless it was read whole and verified */
} run_state;

/* Read `r`'s pages back to back from its offset in calls of at most `chunk` bytes, hash each
 * payload part right after it arrives (while it is in this core's cache) and check every header
 * against the one made for the page's key, namespace, pool and the bytes read. No GIL needed. */
static void run_read(run_state *r, double deadline) {
    batch *b = &r->b;
    if (isfinite(deadline) && monotonic_now() > deadline) {
        r->late = 1;
        return;
    }
    Py_ssize_t np = 0;
    piece *pieces = malloc(sizeof(piece) * (size_t)(b->n + b->payload.n + 1));
    struct iovec *call = malloc(sizeof(struct iovec) * IOV_MAX);
    XXH3_state_t *st = XXH3_createState();
    if (pieces == NULL || call == NULL || st == NULL) {
        r->err = ENOMEM;
        goto done;
    }
    for (Py_ssize_t i = 0; i < b->n; i++) {
        page_job *j = &b->jobs[i];
        pieces[np++] = (piece){j->header, HEADER_SIZE, i, 1, 1};
        for (Py_ssize_t k = j->first; k < j->first + j->count; k++) {
            if (b->payload.iov[k].iov_len == 0) continue;
            pieces[np - 1].last = 0;
            pieces[np++] = (piece){b->payload.iov[k].iov_base, b->payload.iov[k].iov_len, i, 0, 1};
        }
    }
    long long offset = r->offset, chunk = r->chunk;
    Py_ssize_t at = 0; /* the piece being filled, and how much of it is */
    size_t done_in = 0;
    uint64_t page_len = 0;
    while (at < np) {
        int cnt = 0;
        size_t want = 0;
        Py_ssize_t k = at;
        size_t o = done_in;
        while (k < np && cnt < IOV_MAX && want < (size_t)chunk) {
            size_t take = pieces[k].len - o;
            if (take > (size_t)chunk - want) take = (size_t)chunk - want;
            call[cnt].iov_base = pieces[k].p + o;
            call[cnt].iov_len = take;
            cnt++;
            want += take;
            o += take;
            if (o == pieces[k].len) {
                k++;
                o = 0;
            }
        }
        ssize_t got = preadv(r->fd, call, cnt, (off_t)offset);
        if (got < 0) {
            if (errno == EINTR) continue;
            r->err = errno;
            break;
        }
        if (got == 0) break; /* end of file: the pages not read whole fail */
        offset += got;
        r->total += got;
        size_t left = (size_t)got;
        while (left > 0) { /* hash what arrived, piece by piece, and finish the pages it completes */
            piece *pc = &pieces[at];
            size_t take = pc->len - done_in;
            if (take > left) take = left;
            if (pc->header) {
                if (done_in == 0) {
                    hash->reset(st);
                    page_len = 0;
                }
            } else if (r->check) {
                hash->update(st, pc->p + done_in, take);
                page_len += take;
            }
            done_in += take;
            left -= take;
            if (done_in == pc->len) {
                if (pc->last && !r->check) {
                    r->bad[pc->page] = 0;
                } else if (pc->last) {
                    unsigned char made[HEADER_SIZE];
                    page_job *j = &b->jobs[pc->page];
                    make_header_of(j, page_len, hash->digest(st), made);
                    r->bad[pc->page] = memcmp(made, j->header, HEADER_SIZE) != 0;
                }
                at++;
                done_in = 0;
            }
        }
    }
done:
    XXH3_freeState(st);
    free(call);
    free(pieces);
}

/* Load a run (pages with header buffers written into, their pool codes) with the GIL. */
static int run_load(run_state *r, int fd, long long offset, PyObject *items, PyObject *codes, PyObject *fallback,
                    long long chunk) {
    memset(r, 0, sizeof(*r));
    if (offset < 0 || chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "negative offset or non-positive chunk");
        return -1;
    }
    r->fd = fd;
    r->offset = offset;
    r->chunk = chunk;
    r->check = 1;
    if (batch_load(&r->b, items, codes, fallback, 2) < 0) return -1;
    r->bad = malloc((size_t)(r->b.n ? r->b.n : 1));
    if (r->bad == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(r->bad, 1, (size_t)(r->b.n ? r->b.n : 1)); /* until verified */
    return 0;
}

static void run_free(run_state *r) {
    free(r->bad);
    batch_free(&r->b);
    memset(r, 0, sizeof(*r));
}

/* (bytes read, [indices of pages that fail]) of a run read without error. */
static PyObject *run_result(const run_state *r) {
    PyObject *lst = bad_indices(r->bad, r->b.n);
    if (lst == NULL) return NULL;
    PyObject *res = Py_BuildValue("(LO)", r->total, lst);
    Py_DECREF(lst);
    return res;
}

/* read_check(fd, offset, pages, codes, namespace_bytes, chunk) -> (bytes read, [indices that fail])
 *
 * `pages` are stored back to back from `offset` in the core's page format (each: its 64-byte
 * header, then its payload): read them into each page's header and buffers and verify each as it
 * lands (run_read). A page not read whole (end of file) fails. The GIL is released throughout. */
static PyObject *read_check(PyObject *self, PyObject *args) {
    int fd;
    long long offset, chunk;
    PyObject *items, *codes, *fallback;
    if (!PyArg_ParseTuple(args, "iLOOOL:read_check", &fd, &offset, &items, &codes, &fallback, &chunk)) return NULL;
    run_state r;
    if (run_load(&r, fd, offset, items, codes, fallback, chunk) < 0) {
        run_free(&r);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    run_read(&r, INFINITY);
    Py_END_ALLOW_THREADS
    PyObject *res = NULL;
    if (r.err) {
        errno = r.err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        res = run_result(&r);
    }
    run_free(&r);
    return res;
}

typedef struct {
    run_state *runs;
    double deadline;
} runs_ctx;

static void read_one(void *ctx, ptrdiff_t i) {
    runs_ctx *c = ctx;
    run_read(&c->runs[i], c->deadline);
}

/* read_runs(runs, namespace_bytes, chunk, threads, deadline, check=True) -> one result per run
 *
 * `runs`: (fd, offset, pages, codes) each, read and verified as read_check does it, shared by the
 * calling thread and up to threads - 1 helpers (_native_team.c), each taking the next run as it
 * gets free. A run's result: (bytes read, [indices that fail]); an OSError if a read failed; None
 * if it was not started because `deadline` (time.monotonic) had passed. Returns once no thread
 * touches any page any more. The GIL is released while reading. `check` false: read only, every
 * page read whole passes (the benchmarks' bare variant). */
static PyObject *read_runs(PyObject *self, PyObject *args) {
    PyObject *seq, *fallback;
    long long chunk;
    int threads, check = 1;
    double deadline;
    if (!PyArg_ParseTuple(args, "OOLid|p:read_runs", &seq, &fallback, &chunk, &threads, &deadline, &check))
        return NULL;
    PyObject *t;
    Py_ssize_t n;
    run_state *runs = runs_new(seq, sizeof(run_state), &t, &n);
    if (runs == NULL) return NULL;
    Py_ssize_t loaded = 0;
    PyObject *out = NULL;
    for (; loaded < n; loaded++) {
        int fd;
        long long offset;
        PyObject *items, *codes;
        if (run_args(PyTuple_GetItem(t, loaded), "iLOO:read_runs run", &fd, &offset, &items, &codes) < 0) goto fail;
        if (run_load(&runs[loaded], fd, offset, items, codes, fallback, chunk) < 0) {
            loaded++; /* partly loaded: freed below */
            goto fail;
        }
        runs[loaded].check = check;
    }
    runs_ctx ctx = {runs, deadline};
    Py_BEGIN_ALLOW_THREADS
    hcd_team_run(read_one, &ctx, n, threads);
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        run_state *r = &runs[i];
        PyObject *v;
        if (r->late) {
            v = Py_None;
            Py_INCREF(v);
        } else if (r->err) {
            v = PyObject_CallFunction(PyExc_OSError, "is", r->err, strerror(r->err));
        } else {
            v = run_result(r);
        }
        if (v == NULL || PyList_SetItem(out, i, v) < 0) Py_CLEAR(out);
    }
fail:
    for (Py_ssize_t i = 0; i < loaded; i++) run_free(&runs[i]);
    free(runs);
    Py_DECREF(t);
    return out;
}

/* ---- marking the pages a backend hands the core to read ------------------------------------ */

/* Set every slot this call marked back to None (the pairs of marked[0..n)). */
static void unmark(PyObject **slot_lists, Py_ssize_t *indices, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_INCREF(Py_None);
        PyList_SetItem(slot_lists[k], indices[k], Py_None); /* steals; the slot's reference dropped */
    }
}

/* mark_runs(runs, pages, slots, mark, codes) -> [(fd, offset, [Page, ...], codes), ...]
 *
 * The Store's marking rule for the runs a backend hands read_records/read_runs: `runs` are
 * (fd, offset, [(pool, index), ...]); `pages`, `slots` and `codes` map each pool of the call to its
 * pages, its list of per-page marks (None: not read or announced yet) and its header pool code.
 * Every (pool, index) must name a page of the call (an exact int index, 0 <= index < len) not
 * marked yet; its slot is set to `mark`. Returns each run ready for read_runs: its Page objects
 * in order, and one pool code (int) or one per page (bytes) when its pages' codes differ. On any
 * refusal (ValueError naming the pool and index) every slot this call set is None again. With
 * `writes` true the same rule checks the runs a backend hands write_runs (its messages name it). */
static PyObject *mark_runs(PyObject *self, PyObject *args) {
    PyObject *runs_in, *pages, *slots, *mark, *codes;
    int writes = 0;
    if (!PyArg_ParseTuple(args, "OO!O!OO!|p:mark_runs", &runs_in, &PyDict_Type, &pages, &PyDict_Type, &slots, &mark,
                          &PyDict_Type, &codes, &writes))
        return NULL;
    PyObject *runs = PySequence_Tuple(runs_in);
    if (runs == NULL) return NULL;
    Py_ssize_t nruns = PyTuple_Size(runs), lists_cap = 0, idx_cap = 0, marked = 0;
    PyObject **mlists = NULL;
    Py_ssize_t *midx = NULL;
    unsigned char *run_codes = NULL;
    Py_ssize_t codes_cap = 0;
    PyObject *out = PyList_New(nruns);
    PyObject *bad_pool = NULL, *bad_index = NULL; /* borrowed: the pair refused */
    int already = 0;
    if (out == NULL) goto fail;
    PyObject *last = NULL, *got = NULL, *marks = NULL; /* borrowed: the last pool looked up */
    long code = 0;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        PyObject *run = PyTuple_GetItem(runs, r);
        if (!PyTuple_Check(run) || PyTuple_Size(run) != 3 || !PyLong_Check(PyTuple_GetItem(run, 0)) ||
            !PyLong_Check(PyTuple_GetItem(run, 1))) {
            PyErr_SetString(PyExc_TypeError, "a run is (fd, offset, [(pool, index), ...])");
            goto fail;
        }
        PyObject *pairs_in = PyTuple_GetItem(run, 2);
        PyObject *pairs = PyList_Check(pairs_in) ? PyList_AsTuple(pairs_in) : PySequence_Tuple(pairs_in);
        if (pairs == NULL) goto fail;
        Py_ssize_t n = PyTuple_Size(pairs);
        PyObject *list = PyList_New(n);
        if (list == NULL || grow((void **)&run_codes, &codes_cap, n ? n : 1, 1) < 0) {
            Py_XDECREF(list);
            Py_DECREF(pairs);
            goto fail;
        }
        int mixed = 0;
        for (Py_ssize_t j = 0; j < n; j++) {
            PyObject *pair = PyTuple_GetItem(pairs, j);
            PyObject *pool = NULL, *index = NULL;
            if (PyTuple_Check(pair) && PyTuple_Size(pair) == 2) {
                pool = PyTuple_GetItem(pair, 0);
                index = PyTuple_GetItem(pair, 1);
            } else if (PyList_Check(pair) && PyList_Size(pair) == 2) {
                pool = PyList_GetItem(pair, 0);
                index = PyList_GetItem(pair, 1);
            }
            if (pool == NULL) {
                bad_pool = Py_None;
                bad_index = pair;
                goto refuse;
            }
            if (pool != last) {
                got = PyDict_GetItemWithError(pages, pool);
                marks = got ? PyDict_GetItemWithError(slots, pool) : NULL;
                PyObject *c = marks ? PyDict_GetItemWithError(codes, pool) : NULL;
                if (c == NULL || !PyList_Check(got) || !PyList_Check(marks)) {
                    PyErr_Clear(); /* an unhashable or unknown pool (or not a list): not in this call */
                    last = NULL;
                    bad_pool = pool;
                    bad_index = index;
                    goto refuse;
                }
                code = PyLong_AsLong(c);
                if (code == -1 && PyErr_Occurred()) goto fail_run;
                last = pool;
            }
            Py_ssize_t i = PyLong_CheckExact(index) ? PyLong_AsSsize_t(index) : -1;
            if (i == -1 && PyErr_Occurred()) PyErr_Clear();
            if (i < 0 || i >= PyList_Size(got) || i >= PyList_Size(marks)) {
                bad_pool = pool;
                bad_index = index;
                goto refuse;
            }
            if (PyList_GetItem(marks, i) != Py_None) {
                bad_pool = pool;
                bad_index = index;
                already = 1;
                goto refuse;
            }
            if (grow((void **)&mlists, &lists_cap, marked + 1, sizeof(PyObject *)) < 0 ||
                grow((void **)&midx, &idx_cap, marked + 1, sizeof(Py_ssize_t)) < 0)
                goto fail_run;
            Py_INCREF(mark);
            PyList_SetItem(marks, i, mark);
            mlists[marked] = marks;
            midx[marked++] = i;
            PyObject *page = PyList_GetItem(got, i);
            Py_INCREF(page);
            PyList_SetItem(list, j, page);
            run_codes[j] = (unsigned char)code;
            mixed = mixed || run_codes[j] != run_codes[0];
            continue;
        refuse:
            if (already)
                PyErr_Format(PyExc_ValueError,
                             writes ? "write_runs: page %S of pool %R is in two runs"
                                    : "read_records: page %S of pool %R was already read or announced",
                             bad_index, bad_pool);
            else
                PyErr_Format(PyExc_ValueError, "%s: no page %R of pool %R in this call",
                             writes ? "write_runs" : "read_records", bad_index, bad_pool);
        fail_run:
            Py_DECREF(list);
            Py_DECREF(pairs);
            goto fail;
        }
        Py_DECREF(pairs);
        PyObject *c = mixed ? PyBytes_FromStringAndSize((const char *)run_codes, n)
                            : PyLong_FromLong(n ? run_codes[0] : 0);
        PyObject *item = c ? PyTuple_Pack(4, PyTuple_GetItem(run, 0), PyTuple_GetItem(run, 1), list, c) : NULL;
        Py_DECREF(list);
        Py_XDECREF(c);
        if (item == NULL) goto fail;
        PyList_SetItem(out, r, item);
    }
    free(mlists);
    free(midx);
    free(run_codes);
    Py_DECREF(runs);
    return out;
fail:
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        unmark(mlists, midx, marked);
        PyErr_Restore(et, ev, tb);
    }
    free(mlists);
    free(midx);
    free(run_codes);
    Py_XDECREF(out);
    Py_DECREF(runs);
    return NULL;
}

static PyObject *team_helped(PyObject *self, PyObject *unused) { return PyLong_FromLongLong(hcd_team_helped()); }

static PyObject *team_spin(PyObject *self, PyObject *args) {
    long long ns = -1;
    if (!PyArg_ParseTuple(args, "|L:team_spin", &ns)) return NULL;
    long long was = hcd_team_spin_ns();
    if (ns >= 0) hcd_team_spin(ns);
    return PyLong_FromLongLong(was);
}

static PyObject *team_expect(PyObject *self, PyObject *args) {
    int threads;
    if (!PyArg_ParseTuple(args, "i:team_expect", &threads)) return NULL;
    hcd_team_expect(threads);
    Py_RETURN_NONE;
}

static PyObject *team_unexpect(PyObject *self, PyObject *unused) {
    hcd_team_unexpect();
    Py_RETURN_NONE;
}

static PyObject *team_expecting(PyObject *self, PyObject *unused) { return PyLong_FromLong(hcd_team_expecting()); }

/* ---- pages with headers ------------------------------------------------------------------- */

/* The fields of slotted (frozen) dataclass instances are set through their member descriptors'
   own setters, as object.__setattr__ does, without running the generated __init__ (a Python-level
   setattr per field): the Store hands a backend every page of a call anew, each with its header
   buffer, and that construction was the largest per-page cost left in a call. */

typedef struct {
    descrgetfunc get;
    descrsetfunc set;
    PyObject *desc;
} field_ref;

static int fields_load(PyObject *seq, field_ref *out, Py_ssize_t n) {
    if (!PyTuple_Check(seq) || PyTuple_Size(seq) != n) {
        PyErr_Format(PyExc_TypeError, "expected a tuple of %zd member descriptors", n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GetItem(seq, i);
        out[i].desc = d;
        out[i].get = (descrgetfunc)PyType_GetSlot(Py_TYPE(d), Py_tp_descr_get);
        out[i].set = (descrsetfunc)PyType_GetSlot(Py_TYPE(d), Py_tp_descr_set);
        if (out[i].get == NULL || out[i].set == NULL) {
            PyErr_SetString(PyExc_TypeError, "a field is not a data descriptor");
            return -1;
        }
    }
    return 0;
}

static PyObject *new_of(PyObject *type) {
    allocfunc alloc = (allocfunc)PyType_GetSlot((PyTypeObject *)type, Py_tp_alloc);
    if (alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "type without tp_alloc");
        return NULL;
    }
    return alloc((PyTypeObject *)type, 0);
}

/* with_headers(pages, base, owner, page_type, page_fields, buffer_type, buffer_fields) -> list:
   for each page, a new page_type instance with the same first len(page_fields)-1 fields and, as
   its last field, a new buffer_type (ptr=base + HEADER_SIZE*i, nbytes=HEADER_SIZE, owner). */
static PyObject *with_headers(PyObject *self, PyObject *args) {
    PyObject *pages, *owner, *page_type, *page_fields, *buffer_type, *buffer_fields;
    unsigned long long base;
    if (!PyArg_ParseTuple(args, "OKOOOOO", &pages, &base, &owner, &page_type, &page_fields, &buffer_type,
                          &buffer_fields))
        return NULL;
    if (!PyType_Check(page_type) || !PyType_Check(buffer_type)) {
        PyErr_SetString(PyExc_TypeError, "page_type and buffer_type must be types");
        return NULL;
    }
    field_ref pf[8], bf[3];
    Py_ssize_t npf = PyTuple_Check(page_fields) ? PyTuple_Size(page_fields) : -1;
    if (npf < 2 || npf > 8) {
        PyErr_SetString(PyExc_TypeError, "page_fields: a tuple of 2 to 8 member descriptors");
        return NULL;
    }
    if (fields_load(page_fields, pf, npf) < 0 || fields_load(buffer_fields, bf, 3) < 0) return NULL;
    PyObject *seq = PySequence_Tuple(pages);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(seq);
    PyObject *out = PyList_New(n);
    PyObject *hsize = PyLong_FromLong(HEADER_SIZE);
    if (out == NULL || hsize == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *src = PyTuple_GetItem(seq, i); /* borrowed */
        PyObject *page = new_of(page_type);
        if (page == NULL) goto fail;
        PyList_SetItem(out, i, page); /* steals: owned by the list from here */
        for (Py_ssize_t f = 0; f < npf - 1; f++) {
            PyObject *v = pf[f].get(pf[f].desc, src, NULL);
            if (v == NULL) goto fail;
            int rc = pf[f].set(pf[f].desc, page, v);
            Py_DECREF(v);
            if (rc < 0) goto fail;
        }
        PyObject *head = new_of(buffer_type);
        if (head == NULL) goto fail;
        PyObject *ptr = PyLong_FromUnsignedLongLong(base + (unsigned long long)HEADER_SIZE * (unsigned long long)i);
        int rc = ptr == NULL ? -1 : bf[0].set(bf[0].desc, head, ptr);
        Py_XDECREF(ptr);
        if (rc == 0) rc = bf[1].set(bf[1].desc, head, hsize);
        if (rc == 0) rc = bf[2].set(bf[2].desc, head, owner);
        if (rc == 0) rc = pf[npf - 1].set(pf[npf - 1].desc, page, head);
        Py_DECREF(head);
        if (rc < 0) goto fail;
    }
    Py_DECREF(hsize);
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(hsize);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

/* out[i] = a new page_type instance with its fields (key, group, namespace, buffers, header) set
   to the values given and None, without running the type's __init__; -1 with an exception set. */
static int page_into(PyObject *out, Py_ssize_t i, PyObject *page_type, const field_ref *pf, PyObject *key,
                     PyObject *group, PyObject *ns, PyObject *bufs, PyObject *head) {
    PyObject *page = new_of(page_type);
    if (page == NULL) return -1;
    PyList_SetItem(out, i, page); /* steals: owned by the list from here */
    PyObject *vals[5] = {key, group, ns, bufs, head};
    for (int f = 0; f < 5; f++)
        if (pf[f].set(pf[f].desc, page, vals[f]) < 0) return -1;
    return 0;
}

/* make_pages(keys, groups, namespaces, buffers, page_type, page_fields) -> list: a new page_type
   instance per page, its fields (key, group, namespace, buffers, header) set to keys[i],
   groups[i], namespaces (one str for every page, or namespaces[i]), buffers[i] and None, without
   running the type's __init__ (a frozen dataclass's sets each field through object.__setattr__:
   about 1 us a page). The sequences must have one length. */
static PyObject *make_pages(PyObject *self, PyObject *args) {
    PyObject *keys_in, *groups_in, *ns_in, *bufs_in, *page_type, *page_fields;
    if (!PyArg_ParseTuple(args, "OOOOOO:make_pages", &keys_in, &groups_in, &ns_in, &bufs_in, &page_type,
                          &page_fields))
        return NULL;
    if (!PyType_Check(page_type)) {
        PyErr_SetString(PyExc_TypeError, "page_type must be a type");
        return NULL;
    }
    field_ref pf[5];
    if (fields_load(page_fields, pf, 5) < 0) return NULL;
    PyObject *keys = PySequence_Tuple(keys_in), *groups = NULL, *nss = NULL, *bufs = NULL, *out = NULL;
    if (keys == NULL) return NULL;
    int one_ns = PyUnicode_Check(ns_in);
    groups = PySequence_Tuple(groups_in);
    nss = one_ns ? (Py_INCREF(ns_in), ns_in) : PySequence_Tuple(ns_in);
    bufs = groups && nss ? PySequence_Tuple(bufs_in) : NULL;
    if (bufs == NULL) goto fail;
    Py_ssize_t n = PyTuple_Size(keys);
    if (PyTuple_Size(groups) != n || PyTuple_Size(bufs) != n || (!one_ns && PyTuple_Size(nss) != n)) {
        PyErr_SetString(PyExc_ValueError, "make_pages: keys, groups, buffers (and namespaces) differ in length");
        goto fail;
    }
    out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        if (page_into(out, i, page_type, pf, PyTuple_GetItem(keys, i), PyTuple_GetItem(groups, i),
                      one_ns ? nss : PyTuple_GetItem(nss, i), PyTuple_GetItem(bufs, i), Py_None) < 0)
            goto fail;
    Py_DECREF(keys);
    Py_DECREF(groups);
    Py_DECREF(nss);
    Py_DECREF(bufs);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(keys);
    Py_XDECREF(groups);
    Py_XDECREF(nss);
    Py_XDECREF(bufs);
    return NULL;
}

/* slot_pages(slots, page_size, limit, template, owner, cache, cache_limit, keys, groups, namespace,
   page_type, page_fields, buffer_type, buffer_fields) -> list | None: the zero-copy pages of host
   slots in one call (what binding.slot_batch made from SlotBuffers.buffers and make_pages: two
   Python passes, each paying for interpreter caches that a storage call has just cooled). Page i
   (key keys[i], group groups[i], namespace, header None) gets slot i's buffers: cache[slot][0] when
   the slot is in `cache` (a dict: slot -> (buffers,), SlotBuffers.cache), else one buffer_type per
   template entry (ptr, nbytes, stride): ptr + (slot / page_size) * stride, nbytes, owner, kept in
   `cache` while it holds fewer than cache_limit slots. None, before anything is made, unless every
   slot is a multiple of page_size in [0, limit). */
#define SLOT_PAGES_MAX_BUFFERS 64
static PyObject *slot_buffers_new(PyObject *buffer_type, const field_ref *bf, Py_ssize_t nb,
                                  const unsigned long long *at, const long long *stride, PyObject *const *size,
                                  PyObject *owner, long long page) {
    PyObject *bufs = PyTuple_New(nb);
    if (bufs == NULL) return NULL;
    for (Py_ssize_t j = 0; j < nb; j++) {
        PyObject *b = new_of(buffer_type);
        if (b == NULL) goto fail;
        PyTuple_SetItem(bufs, j, b); /* steals */
        PyObject *ptr = PyLong_FromUnsignedLongLong(at[j] + (unsigned long long)(page * stride[j]));
        int rc = ptr == NULL ? -1 : bf[0].set(bf[0].desc, b, ptr);
        Py_XDECREF(ptr);
        if (rc == 0) rc = bf[1].set(bf[1].desc, b, size[j]);
        if (rc == 0) rc = bf[2].set(bf[2].desc, b, owner);
        if (rc < 0) goto fail;
    }
    return bufs;
fail:
    Py_DECREF(bufs);
    return NULL;
}

static PyObject *slot_pages(PyObject *self, PyObject *args) {
    PyObject *slots_in, *tmpl_in, *owner, *cache, *keys_in, *groups_in, *ns, *page_type, *page_fields,
        *buffer_type, *buffer_fields;
    Py_ssize_t ps, limit, cache_limit;
    unsigned long long head_base = 0;
    PyObject *head_owner = Py_None;
    if (!PyArg_ParseTuple(args, "OnnOOOnOOOOOOO|KO:slot_pages", &slots_in, &ps, &limit, &tmpl_in, &owner, &cache,
                          &cache_limit, &keys_in, &groups_in, &ns, &page_type, &page_fields, &buffer_type,
                          &buffer_fields, &head_base, &head_owner))
        return NULL;
    if (head_owner != Py_None && head_base == 0) {
        PyErr_SetString(PyExc_ValueError, "slot_pages: headers need a base address");
        return NULL;
    }
    if (!PyType_Check(page_type) || !PyType_Check(buffer_type) || !PyDict_Check(cache)) {
        PyErr_SetString(PyExc_TypeError, "slot_pages: page_type and buffer_type must be types, cache a dict");
        return NULL;
    }
    if (ps < 1 || limit < 0 || !PyUnicode_Check(ns)) {
        PyErr_Format(PyExc_ValueError, "slot_pages: bad arguments (page_size %zd, limit %zd, namespace a str)", ps,
                     limit);
        return NULL;
    }
    field_ref pf[5], bf[3];
    if (fields_load(page_fields, pf, 5) < 0 || fields_load(buffer_fields, bf, 3) < 0) return NULL;
    PyObject *tmpl = PySequence_Tuple(tmpl_in);
    if (tmpl == NULL) return NULL;
    Py_ssize_t nb = PyTuple_Size(tmpl);
    unsigned long long at[SLOT_PAGES_MAX_BUFFERS];
    long long stride[SLOT_PAGES_MAX_BUFFERS];
    PyObject *size[SLOT_PAGES_MAX_BUFFERS]; /* borrowed from tmpl */
    if (nb < 1 || nb > SLOT_PAGES_MAX_BUFFERS) {
        PyErr_Format(PyExc_ValueError, "slot_pages: template of %zd buffers (1 to %d)", nb, SLOT_PAGES_MAX_BUFFERS);
        Py_DECREF(tmpl);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < nb; j++) {
        PyObject *t = PyTuple_GetItem(tmpl, j);
        if (!PyTuple_Check(t) || PyTuple_Size(t) != 3) {
            PyErr_SetString(PyExc_TypeError, "slot_pages: each template entry is (ptr, nbytes, stride)");
            Py_DECREF(tmpl);
            return NULL;
        }
        at[j] = PyLong_AsUnsignedLongLong(PyTuple_GetItem(t, 0));
        size[j] = PyTuple_GetItem(t, 1);
        stride[j] = PyLong_AsLongLong(PyTuple_GetItem(t, 2));
        if (PyErr_Occurred()) {
            Py_DECREF(tmpl);
            return NULL;
        }
    }
    PyObject *slots = PySequence_Tuple(slots_in), *keys = NULL, *groups = NULL, *out = NULL, *hsize = NULL;
    if (slots == NULL) goto fail;
    keys = PySequence_Tuple(keys_in);
    groups = keys ? PySequence_Tuple(groups_in) : NULL;
    if (groups == NULL) goto fail;
    Py_ssize_t n = PyTuple_Size(slots);
    if (PyTuple_Size(keys) != n || PyTuple_Size(groups) != n) {
        PyErr_SetString(PyExc_ValueError, "slot_pages: slots, keys and groups differ in length");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = PyLong_AsLongLong(PyTuple_GetItem(slots, i));
        if (v == -1 && PyErr_Occurred()) goto fail;
        if (v < 0 || v >= (long long)limit || v % ps) {
            Py_DECREF(slots);
            Py_DECREF(keys);
            Py_DECREF(groups);
            Py_DECREF(tmpl);
            Py_RETURN_NONE;
        }
    }
    out = PyList_New(n);
    hsize = PyLong_FromLong(HEADER_SIZE);
    if (out == NULL || hsize == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *slot = PyTuple_GetItem(slots, i), *bufs = NULL;
        PyObject *parts = PyDict_GetItemWithError(cache, slot); /* borrowed */
        if (parts != NULL && PyTuple_Check(parts) && PyTuple_Size(parts) == 1) {
            bufs = PyTuple_GetItem(parts, 0);
            Py_INCREF(bufs);
        } else {
            if (PyErr_Occurred()) goto fail;
            bufs = slot_buffers_new(buffer_type, bf, nb, at, stride, size, owner, PyLong_AsLongLong(slot) / ps);
            if (bufs == NULL) goto fail;
            if (PyDict_Size(cache) < cache_limit) {
                PyObject *kept = PyTuple_Pack(1, bufs);
                int rc = kept == NULL ? -1 : PyDict_SetItem(cache, slot, kept);
                Py_XDECREF(kept);
                if (rc < 0) {
                    Py_DECREF(bufs);
                    goto fail;
                }
            }
        }
        PyObject *head = Py_None;
        if (head_owner != Py_None) { /* header i: HEADER_SIZE bytes at head_base + HEADER_SIZE * i */
            head = new_of(buffer_type);
            PyObject *hptr = head == NULL ? NULL
                : PyLong_FromUnsignedLongLong(head_base + (unsigned long long)HEADER_SIZE * (unsigned long long)i);
            int hrc = hptr == NULL ? -1 : bf[0].set(bf[0].desc, head, hptr);
            Py_XDECREF(hptr);
            if (hrc == 0) hrc = bf[1].set(bf[1].desc, head, hsize);
            if (hrc == 0) hrc = bf[2].set(bf[2].desc, head, head_owner);
            if (hrc < 0) {
                Py_XDECREF(head);
                Py_DECREF(bufs);
                goto fail;
            }
        } else {
            Py_INCREF(head);
        }
        int rc = page_into(out, i, page_type, pf, PyTuple_GetItem(keys, i), PyTuple_GetItem(groups, i), ns, bufs,
                           head);
        Py_DECREF(bufs);
        Py_DECREF(head);
        if (rc < 0) goto fail;
    }
    Py_DECREF(slots);
    Py_DECREF(keys);
    Py_DECREF(groups);
    Py_DECREF(tmpl);
    Py_DECREF(hsize);
    return out;
fail:
    Py_XDECREF(hsize);
    Py_XDECREF(out);
    Py_XDECREF(slots);
    Py_XDECREF(keys);
    Py_XDECREF(groups);
    Py_DECREF(tmpl);
    return NULL;
}

/* ---- spinning hand-over (the Store's worker threads, hicache_draft/workers.py) ---------------- */

/* A flag: a byte set once a call's result is ready. A count: 8 bytes holding a native int64, the
   calls queued (written under the workers' lock). A ring: a native uint64 each waiting caller
   bumps, atomically and without the GIL, once it has let go of the GIL. */

static int flag_set(const void *flag) { return __atomic_load_n((const unsigned char *)flag, __ATOMIC_ACQUIRE) != 0; }
static int count_positive(const void *count) { return __atomic_load_n((const int64_t *)count, __ATOMIC_ACQUIRE) > 0; }
static uint64_t ring_value(const void *ring) { return __atomic_load_n((const uint64_t *)ring, __ATOMIC_ACQUIRE); }

/* Poll until seen(p) or `end` (monotonic seconds), yielding the CPU between polls so
   that a thread waiting to run on this CPU (the one handed the work, say) runs first. Called
   without the GIL. */
static int spin_until(int (*seen)(const void *), const void *p, double end) {
    for (;;) {
        if (seen(p)) return 1;
        if (monotonic_now() >= end) return 0;
        sched_yield();
    }
}

static int spin_buffers(PyObject **objs, Py_buffer *views, const Py_ssize_t *need, const char *const *what, int n) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(objs[i], &views[i], PyBUF_WRITABLE) < 0 || views[i].len < need[i]) {
            if (!PyErr_Occurred()) {
                PyBuffer_Release(&views[i]);
                PyErr_Format(PyExc_ValueError, "%s must be a writable buffer of at least %zd bytes", what[i], need[i]);
            }
            while (i-- > 0) PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

/* spin_wait(flag, ring, seconds) -> bool */
static PyObject *spin_wait(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    double seconds;
    if (!PyArg_ParseTuple(args, "OOd", &objs[0], &objs[1], &seconds)) return NULL;
    Py_buffer v[2];
    static const Py_ssize_t need[2] = {1, 8};
    static const char *const what[2] = {"flag", "ring"};
    if (spin_buffers(objs, v, need, what, 2) < 0) return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS
    __atomic_fetch_add((uint64_t *)v[1].buf, 1, __ATOMIC_RELEASE); /* the GIL is free now */
    got = spin_until(flag_set, v[0].buf, monotonic_now() + (seconds > 0 ? seconds : 0));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v[0]);
    PyBuffer_Release(&v[1]);
    return PyBool_FromLong(got);
}

/* post_and_spin(flag, count, ring, seconds, settle) -> bool */
static PyObject *post_and_spin(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    double seconds, settle;
    if (!PyArg_ParseTuple(args, "OOOdd", &objs[0], &objs[1], &objs[2], &seconds, &settle)) return NULL;
    Py_buffer v[3];
    static const Py_ssize_t need[3] = {1, 8, 8};
    static const char *const what[3] = {"flag", "count", "ring"};
    if (spin_buffers(objs, v, need, what, 3) < 0) return NULL;
    int got;
    Py_BEGIN_ALLOW_THREADS
    uint64_t before = ring_value(v[2].buf);
    __atomic_store_n((unsigned char *)v[0].buf, 1, __ATOMIC_RELEASE); /* the GIL is free now */
    double start = monotonic_now();
    got = spin_until(count_positive, v[1].buf, start + (seconds > 0 ? seconds : 0));
    if (got) { /* a call is queued: give its caller a moment to let go of the GIL (it rings) */
        double end = monotonic_now() + (settle > 0 ? settle : 0);
        while (ring_value(v[2].buf) == before && monotonic_now() < end) sched_yield();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v[0]);
    PyBuffer_Release(&v[1]);
    PyBuffer_Release(&v[2]);
    return PyBool_FromLong(got);
}

static int all_hex(const unsigned char *p, Py_ssize_t n) {
    unsigned char bad = 0; /* branch-free, so the compiler checks many bytes at a time */
    for (Py_ssize_t c = 0; c < n; c++) bad |= ((unsigned char)(p[c] - '0') > 9) & ((unsigned char)(p[c] - 'a') > 5);
    return !bad;
}

/* copy_regions(dsts, srcs, nbytes, threads=1): nbytes copied from each address srcs[i] to dsts[i]
   (regions that do not overlap), with the GIL released, region i by whichever of the calling
   thread and up to threads - 1 helpers takes it: a batch of flat pages into or out of a staging
   area in one call, where one torch copy a page cost its call on top of the bytes, on one core. */
typedef struct {
    const uintptr_t *dsts, *srcs;
    size_t nbytes;
} regions_ctx;

static void copy_region(void *ctx_in, ptrdiff_t i) {
    const regions_ctx *c = ctx_in;
    memcpy((void *)c->dsts[i], (const void *)c->srcs[i], c->nbytes);
}

/* The addresses of a sequence of ints into out[0..n) (n already known); -1 with an error. */
static int addresses(PyObject *seq, uintptr_t *out, Py_ssize_t n, const char *what) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_GetItem(seq, i);
        if (o == NULL) return -1;
        unsigned long long v = PyLong_AsUnsignedLongLong(o);
        Py_DECREF(o);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
        if (v == 0) {
            PyErr_Format(PyExc_ValueError, "copy_regions: %s[%zd] is a null address", what, i);
            return -1;
        }
        out[i] = (uintptr_t)v;
    }
    return 0;
}

static PyObject *copy_regions(PyObject *self, PyObject *args) {
    PyObject *dsts, *srcs;
    Py_ssize_t nbytes;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOn|i", &dsts, &srcs, &nbytes, &threads)) return NULL;
    Py_ssize_t n = PySequence_Size(dsts);
    if (n < 0) return NULL;
    if (PySequence_Size(srcs) != n || nbytes < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "copy_regions: %zd destinations, %zd sources, %zd bytes each", n,
                         PySequence_Size(srcs), nbytes);
        return NULL;
    }
    uintptr_t *addr = PyMem_Malloc(sizeof(uintptr_t) * (size_t)(2 * n + 1));
    if (addr == NULL) return PyErr_NoMemory();
    regions_ctx c = {.dsts = addr, .srcs = addr + n, .nbytes = (size_t)nbytes};
    if (addresses(dsts, addr, n, "dsts") < 0 || addresses(srcs, addr + n, n, "srcs") < 0) {
        PyMem_Free(addr);
        return NULL;
    }
    if (n > 0 && nbytes > 0) {
        Py_BEGIN_ALLOW_THREADS
        hcd_team_run(copy_region, &c, n, threads < 1 ? 1 : threads);
        Py_END_ALLOW_THREADS
    }
    PyMem_Free(addr);
    Py_RETURN_NONE;
}

/* strided_ints(address, count, step, itemsize, limit=-1) -> every step-th of count native signed
   integers (itemsize 4 or 8) at address, from the first, as a list: each page's first host slot from a
   CPU index tensor's memory, without the tensor operations that slice and convert it (those cost tens
   of microseconds when the interpreter's caches are cold). With limit >= 0, None unless every value
   is a multiple of step in [0, limit) (each starts a page of a pool of limit slots), checked in the
   same pass. The caller keeps the memory alive. */
static PyObject *strided_ints(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t count, step, itemsize, limit = -1;
    if (!PyArg_ParseTuple(args, "Knnn|n", &address, &count, &step, &itemsize, &limit)) return NULL;
    if (count < 0 || step < 1 || (itemsize != 4 && itemsize != 8) || (address == 0 && count > 0)) {
        PyErr_Format(PyExc_ValueError, "strided_ints: bad arguments (count %zd, step %zd, itemsize %zd)", count, step,
                     itemsize);
        return NULL;
    }
    Py_ssize_t n = (count + step - 1) / step;
    if (limit >= 0) {
        for (Py_ssize_t i = 0; i < n; i++) {
            long long v = itemsize == 8 ? (long long)((const int64_t *)(uintptr_t)address)[i * step]
                                        : (long long)((const int32_t *)(uintptr_t)address)[i * step];
            if (v < 0 || v >= (long long)limit || v % step) Py_RETURN_NONE;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long v = itemsize == 8 ? (long long)((const int64_t *)(uintptr_t)address)[i * step]
                                    : (long long)((const int32_t *)(uintptr_t)address)[i * step];
        PyObject *o = PyLong_FromLongLong(v);
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(out, i, o); /* steals o; cannot fail here */
    }
    return out;
}

/* lower_hex(keys) -> bool: whether every key is a non-empty str of lowercase hex digits (SGLang's
   page hashes are: each is then its own page group), in one branch-free pass over the bytes. */
static PyObject *lower_hex(PyObject *self, PyObject *keys_in) {
    PyObject *keys = PySequence_Tuple(keys_in);
    if (keys == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(keys);
    int ok = 1;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *k = PyTuple_GetItem(keys, i);
        Py_ssize_t len;
        const char *p = PyUnicode_Check(k) ? PyUnicode_AsUTF8AndSize(k, &len) : NULL;
        if (p == NULL) {
            PyErr_Clear(); /* not str, or not encodable: not a page hash */
            ok = 0;
            break;
        }
        ok = len > 0 && all_hex((const unsigned char *)p, len);
    }
    Py_DECREF(keys);
    return PyBool_FromLong(ok);
}

/* hex_names(names, left_max, right_max) -> bool: whether every name is a str of 1..left_max
   lowercase hex digits (right_max 0), or (right_max > 0) two such runs joined by one dot, the
   second of 1..right_max digits: storage keys "<hex>.<hex>" and page groups, checked in one pass
   (a compiled regex over the joined names cost about 0.4 us a name). */
static PyObject *hex_names(PyObject *self, PyObject *args) {
    PyObject *names_in;
    Py_ssize_t left_max, right_max;
    if (!PyArg_ParseTuple(args, "Onn", &names_in, &left_max, &right_max)) return NULL;
    PyObject *names = PySequence_Tuple(names_in);
    if (names == NULL) return NULL;
    Py_ssize_t n = PyTuple_Size(names);
    int ok = n > 0;
    for (Py_ssize_t i = 0; i < n && ok; i++) {
        PyObject *k = PyTuple_GetItem(names, i);
        Py_ssize_t len;
        const char *p = PyUnicode_Check(k) ? PyUnicode_AsUTF8AndSize(k, &len) : NULL;
        if (p == NULL) { /* not str, or not encodable: not a name */
            PyErr_Clear();
            ok = 0;
            break;
        }
        Py_ssize_t dot = -1;
        if (right_max > 0) {
            const char *at = memchr(p, '.', (size_t)len);
            if (at == NULL) { ok = 0; break; }
            dot = at - p;
            if (dot < 1 || dot > left_max || len - dot - 1 < 1 || len - dot - 1 > right_max) { ok = 0; break; }
        } else if (len < 1 || len > left_max) {
            ok = 0;
            break;
        }
        /* a second dot (or any byte >= 0x80 of a non-ASCII name) is not a hex digit */
        ok = dot < 0 ? all_hex((const unsigned char *)p, len)
                     : all_hex((const unsigned char *)p, dot) && all_hex((const unsigned char *)p + dot + 1, len - dot - 1);
    }
    Py_DECREF(names);
    return PyBool_FromLong(ok);
}

/* ---- module ------------------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"pack_headers", pack_headers, METH_VARARGS,
     "pack_headers(out, items, codes, namespace_bytes, threads=1, deadline=inf, stop=None): write the 64-byte "
     "header of every item into out (None: into each item's header), the items shared by the calling thread and "
     "up to threads - 1 helper threads; TimeoutError past deadline or once stop[0] is set."},
    {"mismatches", mismatches, METH_VARARGS,
     "mismatches(pages, codes, namespace_bytes, threads=1) -> indices of pages whose header is not the one made "
     "from their key, namespace, pool and buffers (shared like pack_headers)."},
    {"read_check", read_check, METH_VARARGS,
     "read_check(fd, offset, pages, codes, namespace_bytes, chunk) -> (bytes read, indices of pages that "
     "fail): stored pages read back to back and verified as they land."},
    {"read_runs", read_runs, METH_VARARGS,
     "read_runs(runs, namespace_bytes, chunk, threads, deadline, check=True) -> per run (bytes read, indices of pages that "
     "fail), an OSError or None (not started by the deadline): runs (fd, offset, pages, codes) read and verified "
     "as read_check does, shared by the calling thread and up to threads - 1 helper threads."},
    {"mark_runs", mark_runs, METH_VARARGS,
     "mark_runs(runs, pages, slots, mark, codes, writes=False) -> [(fd, offset, pages, codes), ...]: every (pool, index) of "
     "runs (fd, offset, pairs) marked read by setting its slot to mark (ValueError, nothing left marked, for a "
     "page not in the call or already marked); each run's Page objects and pool code(s) ready for read_runs."},
    {"team_spin", team_spin, METH_VARARGS,
     "team_spin(ns=-1) -> the previous setting; sets how long a helper thread that finished a piece stays awake for "
     "the next shared call (0: it sleeps at once; -1: only asks)"},
    {"team_expect", team_expect, METH_VARARGS,
     "team_expect(threads) -> None: a shared call of up to `threads` is about to start: wake up to threads - 1 "
     "sleeping helpers, which stay awake (at most 2 ms) until it starts or team_unexpect()"},
    {"team_unexpect", team_unexpect, METH_NOARGS, "team_unexpect() -> None: ends one team_expect"},
    {"team_expecting", team_expecting, METH_NOARGS, "team_expecting() -> team_expect calls not yet ended (tests)"},
    {"team_helped", team_helped, METH_NOARGS,
     "team_helped() -> how many times a helper thread took part in a shared call (read_runs, pack_headers, "
     "mismatches; tests)."},
    {"read_into", read_into, METH_VARARGS,
     "read_into(fd, offset, buffers) -> bytes read (fewer only at end of file)."},
    {"pack_records", pack_records, METH_VARARGS,
     "pack_records(items, dsts, codes, namespace_bytes, threads=1, deadline=inf, stop=None): each page's record "
     "(header, payload) into dsts[i], the header made from the copy and put into the page's header too."},
    {"make_pages", make_pages, METH_VARARGS,
     "make_pages(keys, groups, namespaces, buffers, page_type, page_fields) -> new pages (header None), without "
     "__init__; namespaces: one str for every page or one per page."},
    {"spin_wait", spin_wait, METH_VARARGS,
     "spin_wait(flag, ring, seconds) -> whether flag[0] was set within seconds: the GIL let go, the ring (8 bytes, "
     "a native uint64) bumped, then flag polled, yielding the CPU between polls."},
    {"post_and_spin", post_and_spin, METH_VARARGS,
     "post_and_spin(flag, count, ring, seconds, settle) -> whether the count (a native int64) became positive "
     "within seconds: the GIL let go, flag[0] set, the count polled as spin_wait polls; once positive, up to settle "
     "seconds more for the ring to move (the caller has let go of the GIL)."},
    {"copy_regions", copy_regions, METH_VARARGS,
     "copy_regions(dsts, srcs, nbytes, threads=1): nbytes copied from each address srcs[i] to dsts[i], shared by "
     "the calling thread and up to threads - 1 helper threads, the GIL released."},
    {"strided_ints", strided_ints, METH_VARARGS,
     "strided_ints(address, count, step, itemsize, limit=-1) -> every step-th of count native signed integers "
     "(itemsize 4 or 8) at address, from the first; with limit >= 0, None unless each is a multiple of step in "
     "[0, limit)."},
    {"slot_pages", slot_pages, METH_VARARGS,
     "slot_pages(slots, page_size, limit, template, owner, cache, cache_limit, keys, groups, namespace, page_type, "
     "page_fields, buffer_type, buffer_fields, header_base=0, header_owner=None) -> the zero-copy pages of host "
     "slots (each slot's buffers from cache[slot][0], else one per template entry (ptr, nbytes, stride) at ptr + "
     "slot // page_size * stride, kept in cache below cache_limit slots; with header_owner, page i's header a new "
     "buffer of HEADER_SIZE bytes at header_base + HEADER_SIZE * i owned by it, else None), or None unless every "
     "slot is a multiple of page_size in [0, limit)."},
    {"lower_hex", lower_hex, METH_O,
     "lower_hex(keys) -> whether every key is a non-empty str of lowercase hex digits."},
    {"hex_names", hex_names, METH_VARARGS,
     "hex_names(names, left_max, right_max) -> whether every name is 1..left_max lowercase hex digits, or with "
     "right_max > 0 '<1..left_max hex>.<1..right_max hex>'."},
    {"with_headers", with_headers, METH_VARARGS,
     "with_headers(pages, base, owner, page_type, page_fields, buffer_type, buffer_fields) -> new pages, "
     "each with a HEADER_SIZE-byte header buffer at base + HEADER_SIZE * i."},
    {"write_records", write_records, METH_VARARGS,
     "write_records(fd, offset, pages, codes, namespace_bytes, chunk, deadline) -> bytes written: pages stored "
     "back to back in the core's page format, each header made from the bytes as they are written."},
    {"write_runs", write_runs, METH_VARARGS,
     "write_runs(runs, namespace_bytes, chunk, threads, deadline, meanwhile=None) -> per run the bytes written or "
     "an OSError (TimeoutError past the deadline): runs (fd, offset, pages, codes) written as write_records writes, "
     "shared by the calling thread and up to threads - 1 helper threads; meanwhile() runs in the calling thread "
     "while the helpers write."},
    {"write_from", write_from, METH_VARARGS,
     "write_from(fd, offset, buffers, chunk, deadline) -> bytes written; calls end on chunk multiples."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    str_ptr = PyUnicode_InternFromString("ptr");
    str_nbytes = PyUnicode_InternFromString("nbytes");
    str_key = PyUnicode_InternFromString("key");
    str_namespace = PyUnicode_InternFromString("namespace");
    str_buffers = PyUnicode_InternFromString("buffers");
    str_header = PyUnicode_InternFromString("header");
    if (!str_ptr || !str_nbytes || !str_key || !str_namespace || !str_buffers || !str_header) return NULL;
    choose_xxh3();
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddStringConstant(m, "XXH3_ISA", hash->isa) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "IOV_MAX", IOV_MAX) < 0 || PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
