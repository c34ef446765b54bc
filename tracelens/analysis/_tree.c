/* Compiled linking of the call tree (tracelens.analysis.calltree.build_tree).

   build_tree sorts the host events by (thread, start, longer first, kind) in numpy; this links them in that
   order, one pass per thread, where the vectorized code (`link_ranges` + `_innermost_range_at`, the reference and
   the fallback where this module is not built) takes ~40 numpy passes over the events and a sort of the ranges'
   ends (~85 ms of the ~180 of build_tree on a 200 MB trace). The results are the same arrays;
   tests/tracelens/test_calltree_unit.py compares the two on every fixture and on random inputs.

   link(group, ts, end, kind, name, step, parent, depth, inner, outer, path) -> None | (nested, path_parent, path_name)

   Inputs, per sorted position: group (int32, the thread, ascending), ts and end (int64), kind (int8: 0 annotation,
   1 module, 2 op, 3 runtime call), name (int32 name code, -1 none), step (uint8: a profiler-step range). Outputs,
   int32 per sorted position, written in place: parent, depth, inner (innermost op), outer (outermost op), path
   (path id; 0 is the empty path). Returns None, writing nothing useful, when a range (kind != 3) ends before it
   starts (the vectorized code then decides; the loader drops such events).

   Ranges (kind != 3), the vectorized `link_ranges` exactly: the depth of range i is the number of earlier ranges
   of its thread still open at its start (end > ts_i, kept in a min-heap of ends); its parent the last earlier
   range of its thread one level up; inner/outer op and the path flow from the parent (an annotation or module
   range that is not a profiler step adds its name to the path).

   Runtime calls (kind 3), `_innermost_range_at` exactly: the innermost range open at the call's start is the
   stack top as a step function of time, decided by the last boundary at or before it: the last range opened
   (ts <= t, in tree order) against the last range closed (non-empty ranges with end <= t, the latest end, then the
   shallowest, then the last in tree order); a closing wins only when strictly later than the opening, and leaves
   that range's parent on top; a zero-length range that opened last has closed again (its parent on top). The
   call's parent is that range, its depth one more, its path the range's; inner and outer are left -1 (build_tree
   sets them from the launching op).

   nested: whether every range ends no later than its parent (then a call's innermost op is its parent's).
   path_parent, path_name: int32 per path id (id 0: -1, -1), a path's parent path and its last name. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define N_IN 6
#define N_OUT 5
#define KIND_OP 2
#define KIND_RUNTIME 3

/* min-heap of ends (the open ranges of `link`'s first pass) */
typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} EndHeap;

static int end_push(EndHeap *h, int64_t x) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? h->cap * 2 : 64;
        int64_t *v = realloc(h->v, (size_t)cap * sizeof(int64_t));
        if (!v) return -1;
        h->v = v, h->cap = cap;
    }
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (h->v[p] <= x) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = x;
    return 0;
}

static void end_pop(EndHeap *h) {
    int64_t x = h->v[--h->n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->v[c + 1] < h->v[c]) c++;
        if (h->v[c] >= x) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n) h->v[i] = x;
}

/* min-heap of the positions of opened non-empty ranges, by end (the closings of the second pass) */
typedef struct {
    int32_t *v;
    Py_ssize_t n, cap;
    const int64_t *end;
} PosHeap;

static int pos_push(PosHeap *h, int32_t x) {
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? h->cap * 2 : 64;
        int32_t *v = realloc(h->v, (size_t)cap * sizeof(int32_t));
        if (!v) return -1;
        h->v = v, h->cap = cap;
    }
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (h->end[h->v[p]] <= h->end[x]) break;
        h->v[i] = h->v[p];
        i = p;
    }
    h->v[i] = x;
    return 0;
}

static int32_t pos_pop(PosHeap *h) {
    int32_t top = h->v[0], x = h->v[--h->n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= h->n) break;
        if (c + 1 < h->n && h->end[h->v[c + 1]] < h->end[h->v[c]]) c++;
        if (h->end[h->v[c]] >= h->end[x]) break;
        h->v[i] = h->v[c];
        i = c;
    }
    if (h->n) h->v[i] = x;
    return top;
}

/* path ids of (parent path, name): open addressing on the pair, ids in order of first sight */
typedef struct {
    uint64_t *key;
    int32_t *id; /* -1: empty slot */
    Py_ssize_t cap;
    int32_t *parent, *name;
    Py_ssize_t n, n_cap;
} Paths;

static uint64_t mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    return h ^ (h >> 33);
}

static int paths_grow(Paths *t) {
    Py_ssize_t cap = t->cap ? t->cap * 2 : 1024;
    uint64_t *key = malloc((size_t)cap * sizeof(uint64_t));
    int32_t *id = malloc((size_t)cap * sizeof(int32_t));
    if (!key || !id) {
        free(key), free(id);
        return -1;
    }
    for (Py_ssize_t i = 0; i < cap; i++) id[i] = -1;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        if (t->id[i] < 0) continue;
        Py_ssize_t s = (Py_ssize_t)(mix64(t->key[i]) & (uint64_t)(cap - 1));
        while (id[s] >= 0) s = (s + 1) & (cap - 1);
        key[s] = t->key[i], id[s] = t->id[i];
    }
    free(t->key), free(t->id);
    t->key = key, t->id = id, t->cap = cap;
    return 0;
}

static int paths_add_row(Paths *t, int32_t parent, int32_t name) {
    if (t->n == t->n_cap) {
        Py_ssize_t cap = t->n_cap ? t->n_cap * 2 : 256;
        int32_t *p = realloc(t->parent, (size_t)cap * sizeof(int32_t));
        if (!p) return -1;
        t->parent = p;
        int32_t *nm = realloc(t->name, (size_t)cap * sizeof(int32_t));
        if (!nm) return -1;
        t->name = nm, t->n_cap = cap;
    }
    t->parent[t->n] = parent, t->name[t->n] = name;
    t->n++;
    return 0;
}

/* the id of path (parent, name), made when new; -1 on a failed allocation */
static int32_t path_of(Paths *t, int32_t parent, int32_t name) {
    if (2 * (t->n + 1) > t->cap && paths_grow(t) < 0) return -1;
    uint64_t k = ((uint64_t)(uint32_t)parent << 32) | (uint32_t)name;
    Py_ssize_t s = (Py_ssize_t)(mix64(k) & (uint64_t)(t->cap - 1));
    while (t->id[s] >= 0) {
        if (t->key[s] == k) return t->id[s];
        s = (s + 1) & (t->cap - 1);
    }
    if (t->n >= INT32_MAX) return -1;
    int32_t id = (int32_t)t->n;
    if (paths_add_row(t, parent, name) < 0) return -1;
    t->key[s] = k, t->id[s] = id;
    return id;
}

static int get_view(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n, int writable) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return -1;
    if (view->itemsize != itemsize || view->len != n * itemsize) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "link: an array of the wrong item size or length");
        return -1;
    }
    return 0;
}

static PyObject *link_tree(PyObject *self, PyObject *args) {
    PyObject *objs[N_IN + N_OUT];
    Py_buffer views[N_IN + N_OUT];
    int got = 0;
    EndHeap open = {0};
    PosHeap closed = {0};
    Paths paths = {0};
    int32_t *last_at = NULL;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6],
                          &objs[7], &objs[8], &objs[9], &objs[10]))
        return NULL;
    Py_ssize_t n;
    {
        Py_buffer v;
        if (PyObject_GetBuffer(objs[1], &v, PyBUF_SIMPLE) < 0) return NULL;
        n = v.len / (Py_ssize_t)sizeof(int64_t);
        PyBuffer_Release(&v);
    }
    if (n >= INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "link: 2**31 events or more");
        return NULL;
    }
    static const Py_ssize_t sizes[N_IN + N_OUT] = {4, 8, 8, 1, 4, 1, 4, 4, 4, 4, 4};
    for (; got < N_IN + N_OUT; got++)
        if (get_view(objs[got], &views[got], sizes[got], n, got >= N_IN) < 0) goto fail;
    const int32_t *group = views[0].buf, *name = views[4].buf;
    const int64_t *ts = views[1].buf, *end = views[2].buf;
    const int8_t *kind = views[3].buf;
    const uint8_t *step = views[5].buf;
    int32_t *parent = views[6].buf, *depth = views[7].buf, *inner = views[8].buf, *outer = views[9].buf,
            *path = views[10].buf;

    for (Py_ssize_t i = 0; i < n; i++)
        if (kind[i] != KIND_RUNTIME && end[i] < ts[i]) {
            result = Py_None;
            Py_INCREF(result);
            goto done;
        }
    if (path_of(&paths, -1, -1) != 0) goto nomem; /* id 0: the empty path */
    last_at = malloc((size_t)(n + 1) * sizeof(int32_t));
    if (!last_at) goto nomem;
    closed.end = end;
    int nested = 1;
    Py_ssize_t lo = 0;
    while (lo < n) {
        Py_ssize_t hi = lo + 1;
        while (hi < n && group[hi] == group[lo]) hi++;
        /* ranges: depth = ranges of the thread still open, parent = the last range one level up */
        open.n = 0;
        Py_ssize_t max_depth = -1;
        for (Py_ssize_t i = lo; i < hi; i++) {
            if (kind[i] == KIND_RUNTIME) continue;
            while (open.n && open.v[0] <= ts[i]) end_pop(&open);
            Py_ssize_t d = open.n;
            int32_t p = -1;
            if (d > 0 && d - 1 <= max_depth) p = last_at[d - 1];
            int32_t p_inner = -1, p_outer = -1, p_path = 0;
            if (p >= 0) {
                p_inner = inner[p], p_outer = outer[p], p_path = path[p];
                if (end[i] > end[p]) nested = 0;
            }
            parent[i] = p, depth[i] = (int32_t)d;
            if (kind[i] == KIND_OP) {
                inner[i] = (int32_t)i;
                outer[i] = p_outer < 0 ? (int32_t)i : p_outer;
                path[i] = p_path;
            } else {
                inner[i] = p_inner, outer[i] = p_outer;
                if (step[i]) {
                    path[i] = p_path;
                } else {
                    int32_t id = path_of(&paths, p_path, name[i]);
                    if (id < 0) goto nomem;
                    path[i] = id;
                }
            }
            /* (levels up to max_depth all have a range of this thread: a depth is at most one more than the
               previous range's, and the first range of a thread has depth 0) */
            last_at[d] = (int32_t)i;
            if (d > max_depth) max_depth = d;
            if (end_push(&open, end[i]) < 0) goto nomem;
        }
        /* runtime calls: the last opening against the last closing at or before the call's start */
        closed.n = 0;
        Py_ssize_t r = lo;
        int32_t o = -1, c = -1;
        for (Py_ssize_t q = lo; q < hi; q++) {
            if (kind[q] != KIND_RUNTIME) continue;
            int64_t t = ts[q];
            for (; r < hi && (kind[r] == KIND_RUNTIME || ts[r] <= t); r++) {
                if (kind[r] == KIND_RUNTIME) continue;
                o = (int32_t)r;
                if (end[r] > ts[r] && pos_push(&closed, (int32_t)r) < 0) goto nomem;
            }
            while (closed.n && end[closed.v[0]] <= t) {
                int32_t x = pos_pop(&closed);
                if (c < 0 || end[x] > end[c] || (end[x] == end[c] && (depth[x] < depth[c] || (depth[x] == depth[c] && x > c))))
                    c = x;
            }
            int32_t top;
            if (c >= 0 && (o < 0 || end[c] > ts[o]))
                top = parent[c];
            else if (o >= 0)
                top = end[o] == ts[o] ? parent[o] : o;
            else
                top = -1;
            parent[q] = top;
            depth[q] = top >= 0 ? depth[top] + 1 : 0;
            path[q] = top >= 0 ? path[top] : 0;
            inner[q] = -1, outer[q] = -1;
        }
        lo = hi;
    }
    {
        PyObject *pp = PyBytes_FromStringAndSize((const char *)paths.parent, paths.n * (Py_ssize_t)sizeof(int32_t));
        PyObject *pn = PyBytes_FromStringAndSize((const char *)paths.name, paths.n * (Py_ssize_t)sizeof(int32_t));
        if (pp && pn) result = Py_BuildValue("(ONN)", nested ? Py_True : Py_False, pp, pn);
        else Py_XDECREF(pp), Py_XDECREF(pn);
    }
    goto done;
nomem:
    PyErr_NoMemory();
fail:
    result = NULL;
done:
    for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    free(open.v), free(closed.v), free(last_at);
    free(paths.key), free(paths.id), free(paths.parent), free(paths.name);
    return result;
}

static PyMethodDef methods[] = {
    {"link", link_tree, METH_VARARGS, "Link the sorted host events of the call tree (see the module's comment)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__tree(void) { return PyModule_Create(&module); }
