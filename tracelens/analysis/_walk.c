/* Compiled walk of the cross-rank critical path (tracelens.analysis.critical_path).

   `critical_path` builds every per-row and per-rank array the walk reads (numpy, all at once); the walk itself
   visits about one GPU event per segment it emits (2.2M segments on a 2 GB trace of 620 steps), which as a Python
   loop cost ~1.7 us a segment (3.8 s of CPU there, on the summary's longest chain). This is that loop, statement
   for statement: `_walk_python` in critical_path.py is the reference and the fallback where this module is not
   built, and tests/tracelens/test_critical_path.py compares the two on every fixture.

   walk(ts, end, pred, launch, rank, is_comm, hit, hit_a, hit_last, hit_fam, hit_pos, rank_val, ends, at, rank_off,
        sync_end, sync_off, step_t0, step_last, consts) -> (records: bytearray, blocks: bytes, unfollowed: bytes)

   Every argument but `consts` is a C-contiguous int64 buffer. Per GPU row (its position in the GPU table): ts,
   end, pred (position in its rank's `ends` of the event ending last at or before ts), launch (ns, or -1), rank
   (the rank's index), is_comm (0/1) and hit: its index in the tables of matched comm kernels (-1: none), which
   give per matched kernel hit_a (its instance's last arrival, ns), hit_last (the last rank's index), hit_fam (the
   `what` code) and hit_pos (the last rank's kernel, a row position). Per rank index: rank_val (the rank), and slices [rank_off[i], rank_off[i + 1]) of `ends` (its
   events' ends, sorted) / `at` (their rows) and [sync_off[i], sync_off[i + 1]) of `sync_end` (sorted ends of its
   blocking host syncs). Per step walked: its first start and the row ending it last. consts: (K_COMPUTE,
   K_LAUNCH, K_SYNC, K_IDLE, K_TRANSFER, K_COMM, K_WAIT, W_CATEGORY, W_BEFORE, W_NONE, SYNC_TOLERANCE_NS).

   records: 7 int64 a segment (rank, start, end, kind, what, row, to_rank), each step's latest first; blocks and
   unfollowed: int64 per step (its first record; its waits not followed). The GIL is held throughout (the inputs
   are the caller's numpy arrays, alive for the call). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define N_IN 19
#define WIDTH 7

typedef struct {
    int64_t *p;
    Py_ssize_t n;
} Col;

/* (rank index, time) pairs of one step's hops: open addressing, a slot live when its stamp is the step's */
typedef struct {
    int64_t *key_t;
    int64_t *key_r;
    int64_t *stamp;
    Py_ssize_t cap, used;
} Visited;

static uint64_t mix(int64_t r, int64_t t) {
    uint64_t h = (uint64_t)t * 0x9E3779B97F4A7C15ULL ^ ((uint64_t)r + 0x632BE59BD9B4E019ULL);
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 32);
}

static int visited_grow(Visited *v, int64_t stamp) {
    Py_ssize_t cap = v->cap ? v->cap * 2 : 64;
    int64_t *kt = calloc((size_t)cap, sizeof(int64_t)), *kr = calloc((size_t)cap, sizeof(int64_t)),
            *st = calloc((size_t)cap, sizeof(int64_t));
    if (!kt || !kr || !st) {
        free(kt), free(kr), free(st);
        return -1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) st[i] = -1;
    for (Py_ssize_t i = 0; i < v->cap; i++) {
        if (v->stamp[i] != stamp) continue;
        Py_ssize_t j = (Py_ssize_t)(mix(v->key_r[i], v->key_t[i]) & (uint64_t)(cap - 1));
        while (st[j] == stamp) j = (j + 1) & (cap - 1);
        kt[j] = v->key_t[i], kr[j] = v->key_r[i], st[j] = stamp;
    }
    free(v->key_t), free(v->key_r), free(v->stamp);
    v->key_t = kt, v->key_r = kr, v->stamp = st, v->cap = cap;
    return 0;
}

static int visited_has(const Visited *v, int64_t stamp, int64_t r, int64_t t) {
    if (!v->cap) return 0;
    Py_ssize_t j = (Py_ssize_t)(mix(r, t) & (uint64_t)(v->cap - 1));
    while (v->stamp[j] == stamp) {
        if (v->key_t[j] == t && v->key_r[j] == r) return 1;
        j = (j + 1) & (v->cap - 1);
    }
    return 0;
}

static int visited_add(Visited *v, int64_t stamp, int64_t r, int64_t t) {
    if (visited_has(v, stamp, r, t)) return 0;
    if ((v->used + 1) * 2 > v->cap && visited_grow(v, stamp) < 0) return -1;
    Py_ssize_t j = (Py_ssize_t)(mix(r, t) & (uint64_t)(v->cap - 1));
    while (v->stamp[j] == stamp) j = (j + 1) & (v->cap - 1);
    v->key_t[j] = t, v->key_r[j] = r, v->stamp[j] = stamp;
    v->used++;
    return 0;
}

/* bisect.bisect_right / bisect_left over a[0:n] */
static Py_ssize_t bisect_right(const int64_t *a, Py_ssize_t n, int64_t x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < a[mid]) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

static Py_ssize_t bisect_left(const int64_t *a, Py_ssize_t n, int64_t x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (a[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

typedef struct {
    PyObject *out; /* bytearray, grown by doubling */
    Py_ssize_t n, cap; /* records */
} Records;

static int emit(Records *rec, int64_t r, int64_t lo, int64_t hi, int64_t kind, int64_t what, int64_t row,
                int64_t to) {
    if (rec->n == rec->cap) {
        Py_ssize_t cap = rec->cap ? rec->cap * 2 : 4096;
        if (PyByteArray_Resize(rec->out, cap * WIDTH * (Py_ssize_t)sizeof(int64_t)) < 0) return -1;
        rec->cap = cap;
    }
    int64_t *p = (int64_t *)PyByteArray_AS_STRING(rec->out) + rec->n * WIDTH;
    p[0] = r, p[1] = lo, p[2] = hi, p[3] = kind, p[4] = what, p[5] = row, p[6] = to;
    rec->n++;
    return 0;
}

/* critical_path's idle_kind(r, gs, ge, launch): a blocking host sync of rank r returned in the stretch, else the
   successor launched after it began, else neither */
static int64_t idle_kind(const int64_t *se, Py_ssize_t n_se, int64_t gs, int64_t ge, int64_t launch, int64_t tol,
                         int64_t k_sync, int64_t k_launch, int64_t k_idle) {
    Py_ssize_t j = bisect_left(se, n_se, ge) - 1;
    if (j >= 0 && se[j] >= gs - tol) return k_sync;
    return launch >= 0 && launch > gs ? k_launch : k_idle;
}

#define EMIT(...)                                                                                                  \
    do {                                                                                                           \
        if (emit(&rec, __VA_ARGS__) < 0) goto fail;                                                               \
    } while (0)

#define IDLE_KIND(gs, ge)                                                                                          \
    idle_kind(sync_end + sync_off[r], (Py_ssize_t)(sync_off[r + 1] - sync_off[r]), gs, ge, succ_launch, TOL, K_SYNC, \
              K_LAUNCH, K_IDLE)

static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *objs[N_IN + 1];
    Py_buffer views[N_IN];
    int got = 0;
    Records rec = {NULL, 0, 0};
    Visited vis = {NULL, NULL, NULL, 0, 0};
    PyObject *blocks = NULL, *unfollowed = NULL, *result = NULL;
    if (!PyArg_UnpackTuple(args, "walk", N_IN + 1, N_IN + 1, &objs[0], &objs[1], &objs[2], &objs[3], &objs[4],
                           &objs[5], &objs[6], &objs[7], &objs[8], &objs[9], &objs[10], &objs[11], &objs[12],
                           &objs[13], &objs[14], &objs[15], &objs[16], &objs[17], &objs[18], &objs[19]))
        return NULL;
    int64_t K_COMPUTE, K_LAUNCH, K_SYNC, K_IDLE, K_TRANSFER, K_COMM, K_WAIT, W_CATEGORY, W_BEFORE, W_NONE, TOL;
    if (!PyArg_ParseTuple(objs[N_IN], "LLLLLLLLLLL", &K_COMPUTE, &K_LAUNCH, &K_SYNC, &K_IDLE, &K_TRANSFER, &K_COMM,
                          &K_WAIT, &W_CATEGORY, &W_BEFORE, &W_NONE, &TOL))
        return NULL;
    Col c[N_IN];
    for (; got < N_IN; got++) {
        if (PyObject_GetBuffer(objs[got], &views[got], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
        if (views[got].itemsize != 8 || !views[got].format || (strcmp(views[got].format, "q") != 0 &&
                                                               strcmp(views[got].format, "l") != 0)) {
            got++;
            PyErr_Format(PyExc_TypeError, "walk: argument %d is not an int64 array", got);
            goto fail;
        }
        c[got].p = (int64_t *)views[got].buf;
        c[got].n = views[got].len / 8;
    }
    const int64_t *ts = c[0].p, *end = c[1].p, *pred = c[2].p, *launch = c[3].p, *rank = c[4].p, *is_comm = c[5].p,
                  *hit = c[6].p, *hit_a = c[7].p, *hit_last = c[8].p, *hit_fam = c[9].p, *hit_pos = c[10].p,
                  *rank_val = c[11].p, *ends_all = c[12].p, *at_all = c[13].p, *rank_off = c[14].p,
                  *sync_end = c[15].p, *sync_off = c[16].p, *step_t0 = c[17].p, *step_last = c[18].p;
    Py_ssize_t n_rows = c[0].n, n_hits = c[7].n, n_ranks = c[11].n, n_steps = c[17].n;
    for (int i = 1; i < 7; i++)
        if (c[i].n != n_rows) {
            PyErr_SetString(PyExc_ValueError, "walk: per-row arrays of different lengths");
            goto fail;
        }
    if (c[8].n != n_hits || c[9].n != n_hits || c[10].n != n_hits || c[14].n != n_ranks + 1 ||
        c[16].n != n_ranks + 1 || c[18].n != n_steps) {
        PyErr_SetString(PyExc_ValueError, "walk: per-hit, per-rank or per-step arrays of the wrong length");
        goto fail;
    }
    rec.out = PyByteArray_FromStringAndSize(NULL, 0);
    blocks = PyBytes_FromStringAndSize(NULL, n_steps * (Py_ssize_t)sizeof(int64_t));
    unfollowed = PyBytes_FromStringAndSize(NULL, n_steps * (Py_ssize_t)sizeof(int64_t));
    if (!rec.out || !blocks || !unfollowed) goto fail;
    int64_t *blk = (int64_t *)PyBytes_AS_STRING(blocks), *unf = (int64_t *)PyBytes_AS_STRING(unfollowed);
#define ROW_OK(x) ((x) >= 0 && (x) < n_rows)
#define RANK_OK(x) ((x) >= 0 && (x) < n_ranks)
    for (Py_ssize_t s = 0; s < n_steps; s++) {
        int64_t t0 = step_t0[s], cur = step_last[s];
        blk[s] = rec.n;
        unf[s] = 0;
        vis.used = 0; /* a fresh set per step: slots of earlier stamps read as free */
        if (!ROW_OK(cur)) goto bad_index;
        int64_t r = rank[cur];
        for (;;) {
            if (!RANK_OK(r)) goto bad_index;
            int64_t lo_e = ts[cur], hi_e = end[cur];
            int64_t t = lo_e; /* where the walk goes on from, on rank r */
            int64_t succ_launch = launch[cur];
            int64_t h = hit[cur];
            if (h >= n_hits) goto bad_index;
            if (h >= 0) {
                int64_t fam = hit_fam[h], a = hit_a[h], last = hit_last[h];
                if (!RANK_OK(last)) goto bad_index;
                if (last != r && a > lo_e) { /* r waited for `last` until a: the transfer, then the hop */
                    if (a > hi_e) a = hi_e;
                    if (a < hi_e) EMIT(rank_val[r], a > t0 ? a : t0, hi_e, K_TRANSFER, fam, cur, -1);
                    if (a <= t0) break;
                    if (!visited_has(&vis, s, last, a)) {
                        if (visited_add(&vis, s, r, a) < 0 || visited_add(&vis, s, last, a) < 0) {
                            PyErr_NoMemory();
                            goto fail;
                        }
                        EMIT(rank_val[r], a, a, K_WAIT, fam, cur, rank_val[last]);
                        r = last, t = a;
                        if (!ROW_OK(hit_pos[h])) goto bad_index;
                        succ_launch = launch[hit_pos[h]];
                    } else {
                        unf[s]++;
                        EMIT(rank_val[r], lo_e > t0 ? lo_e : t0, a, K_WAIT, fam, cur, rank_val[last]);
                    }
                } else {
                    EMIT(rank_val[r], lo_e > t0 ? lo_e : t0, hi_e, K_TRANSFER, fam, cur, -1);
                }
            } else {
                EMIT(rank_val[r], lo_e > t0 ? lo_e : t0, hi_e, is_comm[cur] ? K_COMM : K_COMPUTE, W_CATEGORY, cur,
                     -1);
            }
            if (t <= t0) break;
            const int64_t *ends = ends_all + rank_off[r];
            Py_ssize_t n_ends = (Py_ssize_t)(rank_off[r + 1] - rank_off[r]);
            /* the event that ended last at or before t */
            int64_t k = (t == lo_e && rank[cur] == r) ? pred[cur] : (int64_t)bisect_right(ends, n_ends, t) - 1;
            if (k >= n_ends) goto bad_index;
            if (k < 0 || ends[k] <= t0) {
                if (k < 0) EMIT(rank_val[r], t0, t, K_IDLE, W_BEFORE, -1, -1);
                else EMIT(rank_val[r], t0, t, IDLE_KIND(ends[k], t), W_NONE, -1, -1);
                break;
            }
            if (ends[k] < t) EMIT(rank_val[r], ends[k], t, IDLE_KIND(ends[k], t), W_NONE, -1, -1);
            cur = at_all[rank_off[r] + k];
            if (!ROW_OK(cur)) goto bad_index;
        }
    }
    if (PyByteArray_Resize(rec.out, rec.n * WIDTH * (Py_ssize_t)sizeof(int64_t)) < 0) goto fail;
    result = Py_BuildValue("(OOO)", rec.out, blocks, unfollowed);
    goto done;
bad_index:
    PyErr_SetString(PyExc_IndexError, "walk: a row, rank or position out of range");
fail:
    result = NULL;
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    Py_XDECREF(rec.out);
    Py_XDECREF(blocks);
    Py_XDECREF(unfollowed);
    free(vis.key_t), free(vis.key_r), free(vis.stamp);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "The critical path's walk over every step (see the module's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walk", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__walk(void) { return PyModule_Create(&module); }
