/* Compiled fast path of the Kineto / Chrome-trace loader (tracelens.io.kineto).

   One pass over the JSON bytes of a trace file that writes the loader's event columns directly:
   nanosecond timestamps and ids into int64 arrays, integer args into arrays of the narrowest of
   int8/16/32/64 that holds every value seen so far (widened in place when one does not fit: most
   args are absent, -1, from most events, so 8 bytes each would be most of the scan's memory),
   strings into int32 dictionary codes (one hash table per column, values in order of first
   appearance), without creating a Python object per event. The msgspec path in kineto.py builds ~2 objects per event and reads ~30 attributes
   back from them; this is what docs/performance.md measured as the cost the 10x target could not
   absorb.

   Contract with kineto.py, which is the reference implementation:
   - For every file this scanner accepts, the tables built from its output are the ones the msgspec
     path builds (tests/tracelens/test_loader_compiled.py checks every fixture and fuzzed variants).
   - Arg values of another JSON type than their column's ("stream": "0x0" in ROCm traces) are handed
     back for the caller to convert as the msgspec path's lenient decode does: int and float args as
     (row, arg, span) fix-ups, string args as dictionary entries flagged F_JSON.
   - Anything else it does not reproduce exactly -- an escaped key, a pid that is a float, invalid or
     truncated JSON, a timed event without 'ts' -- raises Unsupported and the caller parses the file with the msgspec path instead, which also
     gives every error message. So this file only needs to be exact and fast on what it accepts,
     and safe on everything.
   - Only timed events (ph X/i/I) become columns. Metadata (ph M) and flow (ph s/t/f) events are
     returned as byte spans, which the caller decodes with msgspec (a few hundred of the first, and
     the second only when asked for).

   The GIL is released while scanning; a Parser must not be fed from two threads at once (checked).

   Parallel scan (scanner.Scan.run): the events array is cut at guessed event boundaries (a '{' behind
   "}," found by a byte search, which may lie inside a string); each later part is scanned by a Parser
   `fork`ed from the first, in its own thread, as if its first event opened the array. A parser stops
   ("hands off") only where it lands exactly on the start of an event that is a later part's guessed
   start (`set_limits`): that confirms the guess, since it is where one parser would have gone on. A part
   whose start no parser lands on is ignored (its bytes are scanned by the part before it, which does not
   stop there). `absorb` then appends each confirmed part's rows to the first parser's, renumbering
   dictionary codes in order of first appearance, so the result is the one a single parser gives.
*/

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_ARGS 64
#define MAX_GROUPS 8
#define MAX_CATS 32
#define MAX_KEY_LEN 64
#define MAX_DEPTH 256
#define MAX_NUMBER_LEN 64

static PyObject *Unsupported;

/* The layout of Parser.result(); scanner.py refuses a build whose LAYOUT is not the one it reads (an
   extension built from an older copy of this file), and the loader then uses its msgspec path.
   1: every int arg as int64. 2: int args in 'arg_widths' bytes each. 3: str/raw args' codes too. */
#define LAYOUT 3

/* ----------------------------------------------------------------------------------------------
   Dictionary encoding: spans of the input buffer -> int32 codes in order of first appearance. */

/* What a dictionary entry's bytes are: a JSON string's content (plain, or with backslash escapes), or
   the JSON text of a non-string value in a string column (the caller applies str() to it, as the
   msgspec path's lenient decode does). Part of the key: the string "true" and the literal true differ. */
enum { F_PLAIN = 0, F_ESCAPED = 1, F_JSON = 2 };

typedef struct {
    int64_t off;
    int64_t len;
    uint64_t hash;
    int64_t copy; /* where the entry's bytes are in the dictionary's own copy (`Dict.bytes`) */
    int escaped;  /* F_* */
} DictEntry;

/* The bytes of every entry are also copied, back to back, into `bytes`: a lookup compares the value with
   that copy (small and hot in the cache) rather than with the entry's first occurrence in the file (tens of
   MB back, a cache miss per event); `off` still names the first occurrence, for the result. */
typedef struct {
    uint32_t *slots; /* code + 1; 0 = empty */
    size_t mask;
    DictEntry *entries;
    size_t n, cap;
    unsigned char *bytes;
    size_t bytes_n, bytes_cap;
} Dict;

/* (the tail read without a call: the last 8 bytes of a value of 8 or more, else its bytes one by one; the hash
   only orders a table's probing, never the codes, which are in order of first appearance) */
static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    const size_t len = n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    uint64_t w = 0;
    if (n && len >= 8) {
        memcpy(&w, p + n - 8, 8);
    } else {
        for (size_t k = 0; k < n; k++) w |= (uint64_t)p[k] << (8 * k);
    }
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    return h;
}

static void dict_free(Dict *d) {
    free(d->slots);
    free(d->entries);
    free(d->bytes);
    memset(d, 0, sizeof(*d));
}

static int dict_grow(Dict *d) {
    size_t size = d->slots ? (d->mask + 1) * 2 : 64;
    uint32_t *slots = calloc(size, sizeof(uint32_t));
    if (!slots) return -1;
    for (size_t c = 0; c < d->n; c++) {
        size_t i = d->entries[c].hash & (size - 1);
        while (slots[i]) i = (i + 1) & (size - 1);
        slots[i] = (uint32_t)(c + 1);
    }
    free(d->slots);
    d->slots = slots;
    d->mask = size - 1;
    return 0;
}

/* The code of the len bytes at src, added when new (remembering `off`, where they stand in the document); -1 on
   allocation failure or too many values. */
static int64_t dict_code_at(Dict *d, const unsigned char *src, int64_t off, int64_t len, int escaped) {
    if (!d->slots || (d->n + 1) * 2 > d->mask + 1) {
        if (dict_grow(d) < 0) return -1;
    }
    uint64_t h = hash_bytes(src, (size_t)len);
    size_t i = h & d->mask;
    for (;;) {
        uint32_t s = d->slots[i];
        if (!s) break;
        DictEntry *e = &d->entries[s - 1];
        if (e->hash == h && e->len == len && e->escaped == escaped &&
            memcmp(d->bytes + e->copy, src, (size_t)len) == 0)
            return s - 1;
        i = (i + 1) & d->mask;
    }
    if (d->n >= 0x7fffffff) return -1;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 64;
        DictEntry *e = realloc(d->entries, cap * sizeof(DictEntry));
        if (!e) return -1;
        d->entries = e;
        d->cap = cap;
    }
    if (d->bytes_n + (size_t)len + 1 > d->bytes_cap) {
        size_t cap = d->bytes_cap ? d->bytes_cap : 4096;
        while (cap < d->bytes_n + (size_t)len + 1) cap *= 2;
        unsigned char *b = realloc(d->bytes, cap);
        if (!b) return -1;
        d->bytes = b;
        d->bytes_cap = cap;
    }
    memcpy(d->bytes + d->bytes_n, src, (size_t)len);
    d->entries[d->n] = (DictEntry){off, len, h, (int64_t)d->bytes_n, escaped};
    d->bytes_n += (size_t)len;
    d->slots[i] = (uint32_t)(d->n + 1);
    return (int64_t)d->n++;
}

/* The code of buf[off:off+len] (`dict_code_at`). */
static int64_t dict_code(Dict *d, const unsigned char *buf, int64_t off, int64_t len, int escaped) {
    return dict_code_at(d, buf + off, off, len, escaped);
}

/* ----------------------------------------------------------------------------------------------
   Growable int64 array (spans of metadata and flow events). */

typedef struct {
    int64_t *data;
    size_t n, cap;
} I64Vec;

static int i64_push2(I64Vec *v, int64_t a, int64_t b) {
    if (v->n + 2 > v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 1024;
        int64_t *d = realloc(v->data, cap * sizeof(int64_t));
        if (!d) return -1;
        v->data = d;
        v->cap = cap;
    }
    v->data[v->n++] = a;
    v->data[v->n++] = b;
    return 0;
}

/* ----------------------------------------------------------------------------------------------
   The parser. */

enum { T_ABSENT = 0, T_NULL, T_INT, T_NUM, T_STR, T_OTHER };
enum { ST_START = 0, ST_ARRAY_FIRST, ST_ARRAY_NEXT, ST_TAIL, ST_DONE, ST_HANDOFF };

typedef struct {
    uint32_t gen; /* == parser's event generation when set in this event */
    uint8_t tag;
    uint8_t escaped;
    int64_t off, len; /* the value's JSON text */
    int64_t ival;
} Slot;

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int have_view;
    const unsigned char *buf;
    int64_t n, pos;
    int state, top_object, busy, taken;
    int64_t ev_lo, ev_hi;
    int64_t start;            /* where this parser began: 0, or a forked part's first event */
    int64_t *limits;          /* sorted event starts of later parts: stop on landing exactly on one */
    size_t n_limits, li;
    int64_t stopped_at;       /* the limit this parser stopped at (state ST_HANDOFF), else -1 */
    const char *err;
    int64_t err_pos;
    /* spec (fork copies it as one block: every field from n_args up to rows) */
    int n_args;
    char kinds[MAX_ARGS];
    unsigned char keys[MAX_ARGS][MAX_KEY_LEN];
    int key_len[MAX_ARGS];
    int by_len[MAX_KEY_LEN][MAX_ARGS];
    int by_len_n[MAX_KEY_LEN];
    int n_groups;
    uint64_t group_mask[MAX_GROUPS];
    int n_cats;
    unsigned char cat_names[MAX_CATS][MAX_KEY_LEN];
    int cat_len[MAX_CATS], cat_group_of[MAX_CATS];
    /* rows of timed events */
    size_t rows, cap;
    size_t filled; /* rows [0, filled) of every arg column hold "absent" (-1, NaN) or a value: see prefill */
    int32_t *ph, *cat, *name, *pid_s, *tid_s;
    int64_t *pid, *tid, *ts, *dur;
    void *arg[MAX_ARGS];
    uint8_t arg_w[MAX_ARGS]; /* bytes per value of an int arg's column or a str/raw arg's codes (1, 2, 4 or 8);
                                see put_int */
    Dict d_ph, d_cat, d_name, d_pidtid, d_arg[MAX_ARGS];
    int8_t *cat_group; /* per cat code */
    size_t cat_group_cap;
    I64Vec meta, flow;
    I64Vec fixups; /* (row, arg, value offset, value length): int/float args of another JSON type */
    int64_t n_events;
    /* per-event scratch */
    uint32_t gen;
    Slot slot[MAX_ARGS];
} Parser;

#define FAIL(p, msg, at)       \
    do {                       \
        (p)->err = (msg);      \
        (p)->err_pos = (at);   \
        return -1;             \
    } while (0)

static inline int64_t skip_ws(const Parser *p, int64_t i) {
    const unsigned char *b = p->buf;
    if (i < p->n && b[i] > ' ') return i; /* compact JSON: the common case */
    while (i < p->n && (b[i] == ' ' || b[i] == '\n' || b[i] == '\r' || b[i] == '\t')) i++;
    return i;
}

static const unsigned char HEX[256] = {
    ['0'] = 1, ['1'] = 1, ['2'] = 1, ['3'] = 1, ['4'] = 1, ['5'] = 1, ['6'] = 1, ['7'] = 1, ['8'] = 1,
    ['9'] = 1, ['a'] = 1, ['b'] = 1, ['c'] = 1, ['d'] = 1, ['e'] = 1, ['f'] = 1, ['A'] = 1, ['B'] = 1,
    ['C'] = 1, ['D'] = 1, ['E'] = 1, ['F'] = 1};

/* Bytes that end the fast scan of a string: the quote, the backslash and control characters
   (invalid in JSON strings). */
static unsigned char STR_STOP[256];

/* A string starting at its opening quote at *i. On success *i is past the closing quote and
   *escaped tells whether it holds backslash escapes (validated, not decoded). */
/* Whether any of 8 bytes is a quote, a backslash or below 0x20 (SWAR; may also flag a byte after a
   real one, never misses one). */
static inline uint64_t special8(uint64_t x) {
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    uint64_t q = x ^ (ones * '"'), s = x ^ (ones * '\\');
    return ((q - ones) & ~q & high) | ((s - ones) & ~s & high) | ((x - ones * 0x20) & ~x & high);
}

static int scan_string(Parser *p, int64_t *i, int *escaped) {
    const unsigned char *b = p->buf;
    int64_t j = *i + 1, n = p->n;
    *escaped = 0;
    for (;;) {
#if defined(__SSE2__)
        /* 16 bytes at a time (kernel names run to hundreds of bytes): the first quote, backslash or byte
           below 0x20 exactly, as the byte loop below finds it */
        const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'), below = _mm_set1_epi8(0x1F);
        int found = 0;
        while (j + 16 <= n) {
            __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(b + j));
            __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, quote), _mm_cmpeq_epi8(x, bslash)),
                                     _mm_cmpeq_epi8(_mm_max_epu8(x, below), below)); /* x <= 0x1F */
            int bits = _mm_movemask_epi8(m);
            if (bits) {
                j += __builtin_ctz((unsigned)bits);
                found = 1;
                break;
            }
            j += 16;
        }
        if (!found) {
#endif
        while (j + 8 <= n) {
            uint64_t w;
            memcpy(&w, b + j, 8);
            if (special8(w)) break;
            j += 8;
        }
        while (j < n && !STR_STOP[b[j]]) j++;
#if defined(__SSE2__)
        }
#endif
        if (j >= n) FAIL(p, "unterminated string", *i);
        unsigned char c = b[j];
        if (c == '"') break;
        if (c < 0x20) FAIL(p, "control character in string", j);
        /* backslash */
        *escaped = 1;
        if (j + 1 >= n) FAIL(p, "unterminated string", *i);
        c = b[j + 1];
        if (c == 'u') {
            if (j + 5 >= n || !HEX[b[j + 2]] || !HEX[b[j + 3]] || !HEX[b[j + 4]] || !HEX[b[j + 5]])
                FAIL(p, "invalid \\u escape", j);
            j += 6;
        } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' || c == 'r' || c == 't') {
            j += 2;
        } else {
            FAIL(p, "invalid escape", j);
        }
    }
    *i = j + 1;
    return 0;
}

/* A JSON number at *i (validated against the grammar). *is_int: an integer literal that fits int64
   (then *ival holds it). */
static int scan_number(Parser *p, int64_t *i, int *is_int, int64_t *ival) {
    const unsigned char *b = p->buf;
    int64_t j = *i, n = p->n;
    int neg = 0, overflow = 0;
    uint64_t v = 0;
    if (j < n && b[j] == '-') {
        neg = 1;
        j++;
    }
    if (j >= n || b[j] < '0' || b[j] > '9') FAIL(p, "invalid number", *i);
    if (b[j] == '0') {
        j++;
    } else {
        while (j < n && b[j] >= '0' && b[j] <= '9') {
            if (v > (UINT64_MAX - 9) / 10) overflow = 1;
            v = v * 10 + (uint64_t)(b[j] - '0');
            j++;
        }
    }
    int frac = 0;
    if (j < n && b[j] == '.') {
        frac = 1;
        j++;
        if (j >= n || b[j] < '0' || b[j] > '9') FAIL(p, "invalid number", *i);
        while (j < n && b[j] >= '0' && b[j] <= '9') j++;
    }
    if (j < n && (b[j] == 'e' || b[j] == 'E')) {
        frac = 1;
        j++;
        if (j < n && (b[j] == '+' || b[j] == '-')) j++;
        if (j >= n || b[j] < '0' || b[j] > '9') FAIL(p, "invalid number", *i);
        while (j < n && b[j] >= '0' && b[j] <= '9') j++;
    }
    *is_int = !frac && !overflow && (neg ? v <= (uint64_t)INT64_MAX + 1 : v <= (uint64_t)INT64_MAX);
    if (*is_int) *ival = neg ? (int64_t)(0 - v) : (int64_t)v;
    *i = j;
    return 0;
}

/* The double a number's text stands for (correctly rounded, as msgspec and Python's float() give). */
static int number_double(Parser *p, int64_t off, int64_t len, double *out) {
    char tmp[MAX_NUMBER_LEN + 1];
    if (len > MAX_NUMBER_LEN) FAIL(p, "number too long", off);
    memcpy(tmp, p->buf + off, (size_t)len);
    tmp[len] = 0;
    char *end;
    *out = strtod(tmp, &end);
    if (end != tmp + len) FAIL(p, "unparsable number", off);
    return 0;
}

/* Microseconds (a JSON number's text, validated by scan_number) -> integer nanoseconds: the number's
   exact decimal value times 1000, rounded to the nearest integer, ties to even, from the digits alone
   (no double: an epoch-scale 1732662400123456.789 us is 2**50.6, where a double's step is 0.25 us).
   Any number of digits and any exponent; the same integers as tracelens/io/timestamps.py gives on the
   msgspec path. |value| >= 2**53 us (int64 ns overflow is at 9.2e15 us) fails: the msgspec path then
   parses the file and drops the event as unrepresentable. */
#define NS_BOUND 9007199254740992000ull /* 2**53 us in ns */
static int number_ns(Parser *p, int64_t off, int64_t len, int64_t *out) {
    const unsigned char *s = p->buf + off, *e = s + len;
    int neg = 0;
    if (s < e && *s == '-') {
        neg = 1;
        s++;
    }
    const unsigned char *ip = s;
    while (s < e && *s >= '0' && *s <= '9') s++;
    int64_t ni = s - ip, nf = 0;
    const unsigned char *fp = s;
    if (s < e && *s == '.') {
        fp = ++s;
        while (s < e && *s >= '0' && *s <= '9') s++;
        nf = s - fp;
    }
    int64_t ex = 0;
    if (s < e && (*s == 'e' || *s == 'E')) {
        int eneg = 0;
        s++;
        if (s < e && (*s == '+' || *s == '-')) eneg = *s++ == '-';
        while (s < e && *s >= '0' && *s <= '9') {
            if (ex < 1000000) ex = ex * 10 + (*s - '0'); /* beyond, the value is 0 or out of range anyway */
            s++;
        }
        if (eneg) ex = -ex;
    }
    if (s != e || ni == 0) FAIL(p, "unparsable number", off);
    if (ex == 0 && nf <= 3 && ni <= 16) {
        /* the common case, microseconds with at most 3 decimals (and no exponent, or e0): the integer and the
           fraction digits as one number of ns, nothing to round, below 10**19 (the general path's value, its
           bound and its message) */
        uint64_t v = 0;
        for (int64_t k = 0; k < ni; k++) v = v * 10 + (uint64_t)(ip[k] - '0');
        for (int64_t k = 0; k < 3; k++) v = v * 10 + (uint64_t)(k < nf ? fp[k] - '0' : 0);
        if (v >= NS_BOUND) FAIL(p, "timestamp out of range", off);
        *out = neg ? -(int64_t)v : (int64_t)v;
        return 0;
    }
    /* The digits D[0..nd) (integer then fraction digits); the value in ns is D[0..point) . D[point..) */
    int64_t nd = ni + nf, point = ni + ex + 3, z = 0;
#define DIGIT(i) ((i) < ni ? ip[(i)] - '0' : fp[(i) - ni] - '0')
    while (z < nd && DIGIT(z) == 0) z++;
    uint64_t v = 0;
    if (z < nd && point > z) {
        if (point - z > 19) FAIL(p, "timestamp out of range", off);
        for (int64_t i = z; i < point; i++) {
            if (v > NS_BOUND / 10) FAIL(p, "timestamp out of range", off);
            v = v * 10 + (uint64_t)(i < nd ? DIGIT(i) : 0);
        }
        if (v >= NS_BOUND) FAIL(p, "timestamp out of range", off);
    }
    /* round half to even on the digits past the point */
    int64_t r = point >= 0 ? point : -1;
    int first = r >= 0 && r < nd ? DIGIT(r) : 0;
    if (first >= 5) {
        int sticky = 0;
        for (int64_t i = r + 1; i < nd && !sticky; i++) sticky = DIGIT(i) != 0;
        if (first > 5 || sticky || (v & 1)) v++;
    }
#undef DIGIT
    *out = neg ? -(int64_t)v : (int64_t)v;
    return 0;
}

static int skip_value(Parser *p, int64_t *i, int depth);

static int expect_literal(Parser *p, int64_t *i, const char *lit, size_t len) {
    if (*i + (int64_t)len > p->n || memcmp(p->buf + *i, lit, len) != 0) FAIL(p, "invalid literal", *i);
    *i += (int64_t)len;
    return 0;
}

/* Any JSON value at *i (after whitespace), validated and skipped; *tag says what it was. */
static int scan_value(Parser *p, int64_t *i, int depth, uint8_t *tag, int *escaped, int64_t *ival) {
    const unsigned char *b = p->buf;
    if (*i >= p->n) FAIL(p, "unexpected end of data", *i);
    unsigned char c = b[*i];
    *escaped = 0;
    switch (c) {
    case '"':
        *tag = T_STR;
        return scan_string(p, i, escaped);
    case '{':
    case '[':
        *tag = T_OTHER;
        return skip_value(p, i, depth);
    case 't':
        *tag = T_OTHER;
        return expect_literal(p, i, "true", 4);
    case 'f':
        *tag = T_OTHER;
        return expect_literal(p, i, "false", 5);
    case 'n':
        *tag = T_NULL;
        return expect_literal(p, i, "null", 4);
    default: {
        int is_int;
        int64_t v = 0;
        if (scan_number(p, i, &is_int, &v) < 0) return -1;
        *tag = is_int ? T_INT : T_NUM;
        *ival = v;
        return 0;
    }
    }
}

/* A member's key at *j (an object's opening brace or a comma behind it): on success *k0 is the key's
   opening quote, *klen its length, *esc whether it holds escapes, and *j is at the value (past ':'
   and whitespace). */
static int scan_key(Parser *p, int64_t *j, int64_t *k0, int64_t *klen, int *esc) {
    if (*j >= p->n || p->buf[*j] != '"') FAIL(p, "expected a key", *j);
    *k0 = *j;
    if (scan_string(p, j, esc) < 0) return -1;
    *klen = *j - *k0 - 2;
    int64_t k = skip_ws(p, *j);
    if (k >= p->n || p->buf[k] != ':') FAIL(p, "expected ':'", k);
    *j = skip_ws(p, k + 1);
    return 0;
}

/* After a value inside an object or array, at *j: 1 when a ',' follows (*j then past it and the
   whitespace after it), 0 when `close` follows (*j at it), -1 (error set) when anything else does. */
static int after_value(Parser *p, int64_t *j, unsigned char close) {
    int64_t k = skip_ws(p, *j);
    if (k >= p->n) FAIL(p, "unexpected end of data", k);
    if (p->buf[k] == ',') {
        *j = skip_ws(p, k + 1);
        return 1;
    }
    *j = k;
    if (p->buf[k] == close) return 0;
    FAIL(p, "expected ',' or a closing bracket", k);
}

/* Objects and arrays, recursively (depth-limited); other values through scan_value. */
static int skip_value(Parser *p, int64_t *i, int depth) {
    const unsigned char *b = p->buf;
    if (*i >= p->n) FAIL(p, "unexpected end of data", *i);
    unsigned char c = b[*i];
    if (c != '{' && c != '[') {
        uint8_t tag;
        int esc;
        int64_t iv;
        return scan_value(p, i, depth, &tag, &esc, &iv);
    }
    if (depth >= MAX_DEPTH) FAIL(p, "nesting too deep", *i);
    unsigned char close = c == '{' ? '}' : ']';
    int64_t j = skip_ws(p, *i + 1);
    if (j < p->n && b[j] == close) {
        *i = j + 1;
        return 0;
    }
    for (int more = 1; more;) {
        if (c == '{') {
            int esc;
            int64_t k0, klen;
            if (scan_key(p, &j, &k0, &klen, &esc) < 0) return -1;
        }
        if (skip_value(p, &j, depth + 1) < 0) return -1;
        if ((more = after_value(p, &j, close)) < 0) return -1;
    }
    *i = j + 1;
    return 0;
}

static int arg_index(const Parser *p, const unsigned char *key, int64_t len) {
    if (len >= MAX_KEY_LEN) return -1;
    for (int k = 0; k < p->by_len_n[len]; k++) {
        int a = p->by_len[len][k];
        if (memcmp(p->keys[a], key, (size_t)len) == 0) return a;
    }
    return -1;
}

/* The args object of one event into the slots (every arg the spec names; others skipped). */
static int scan_args(Parser *p, int64_t *i) {
    const unsigned char *b = p->buf;
    int64_t j = skip_ws(p, *i + 1);
    if (j < p->n && b[j] == '}') {
        *i = j + 1;
        return 0;
    }
    for (int more = 1; more;) {
        int esc;
        int64_t k0, klen;
        if (scan_key(p, &j, &k0, &klen, &esc) < 0) return -1;
        if (esc) FAIL(p, "escaped key in args", k0);
        int a = arg_index(p, b + k0 + 1, klen);
        int64_t v0 = j;
        if (a < 0) {
            if (skip_value(p, &j, 2) < 0) return -1;
        } else {
            Slot *s = &p->slot[a];
            int e2;
            int64_t iv = 0;
            if (scan_value(p, &j, 2, &s->tag, &e2, &iv) < 0) return -1;
            s->gen = p->gen;
            s->escaped = (uint8_t)e2;
            s->off = v0;
            s->len = j - v0;
            s->ival = iv;
        }
        if ((more = after_value(p, &j, '}')) < 0) return -1;
    }
    *i = j + 1;
    return 0;
}

/* Room for `need` rows in every row column (exactly that many: `take` trims the capacity later anyway). */
static int reserve_rows(Parser *p, size_t need) {
    if (need <= p->cap) return 0;
    size_t cap = need;
#define GROW(field, type)                                       \
    do {                                                        \
        void *q = realloc(p->field, cap * sizeof(type));        \
        if (!q) FAIL(p, "out of memory", p->pos);               \
        p->field = q;                                           \
    } while (0)
    GROW(ph, int32_t);
    GROW(cat, int32_t);
    GROW(name, int32_t);
    GROW(pid_s, int32_t);
    GROW(tid_s, int32_t);
    GROW(pid, int64_t);
    GROW(tid, int64_t);
    GROW(ts, int64_t);
    GROW(dur, int64_t);
    for (int a = 0; a < p->n_args; a++) {
        if (p->kinds[a] != 'f' && !p->arg_w[a]) p->arg_w[a] = 1;
        size_t size = p->kinds[a] == 'f' ? sizeof(double) : p->arg_w[a];
        void *q = realloc(p->arg[a], cap * size);
        if (!q) FAIL(p, "out of memory", p->pos);
        p->arg[a] = q;
    }
#undef GROW
    p->cap = cap;
    return 0;
}

static int grow_rows(Parser *p) { return reserve_rows(p, p->cap ? p->cap * 2 : 65536); }

static int code_of(Parser *p, Dict *d, int64_t off, int64_t len, int escaped, int32_t *out) {
    int64_t c = dict_code(d, p->buf, off, len, escaped);
    if (c < 0) FAIL(p, "out of memory", off);
    *out = (int32_t)c;
    return 0;
}

/* The args group of a category code (-1: its args are not read), looked up once per new category. */
static int cat_group(Parser *p, int32_t code, int *group) {
    if ((size_t)code >= p->cat_group_cap) {
        size_t cap = p->cat_group_cap ? p->cat_group_cap * 2 : 64;
        while (cap <= (size_t)code) cap *= 2;
        int8_t *q = realloc(p->cat_group, cap);
        if (!q) FAIL(p, "out of memory", p->pos);
        memset(q + p->cat_group_cap, -2, cap - p->cat_group_cap);
        p->cat_group = q;
        p->cat_group_cap = cap;
    }
    if (p->cat_group[code] == -2) {
        const DictEntry *e = &p->d_cat.entries[code];
        int g = -1;
        if (e->escaped) FAIL(p, "escaped category name", e->off);
        for (int k = 0; k < p->n_cats; k++) {
            if (p->cat_len[k] == e->len && memcmp(p->cat_names[k], p->buf + e->off, (size_t)e->len) == 0) {
                g = p->cat_group_of[k];
                break;
            }
        }
        p->cat_group[code] = (int8_t)g;
    }
    *group = p->cat_group[code];
    return 0;
}

/* Bytes needed to hold v as a signed integer: 1, 2, 4 or 8. */
static inline int int_width(int64_t v) {
    if (v >= INT8_MIN && v <= INT8_MAX) return 1;
    if (v >= INT16_MIN && v <= INT16_MAX) return 2;
    if (v >= INT32_MIN && v <= INT32_MAX) return 4;
    return 8;
}

static inline int64_t int_at(const void *col, int w, size_t i) {
    switch (w) {
    case 1: return ((const int8_t *)col)[i];
    case 2: return ((const int16_t *)col)[i];
    case 4: return ((const int32_t *)col)[i];
    default: return ((const int64_t *)col)[i];
    }
}

static inline void int_put(void *col, int w, size_t i, int64_t v) {
    switch (w) {
    case 1: ((int8_t *)col)[i] = (int8_t)v; break;
    case 2: ((int16_t *)col)[i] = (int16_t)v; break;
    case 4: ((int32_t *)col)[i] = (int32_t)v; break;
    default: ((int64_t *)col)[i] = v;
    }
}

/* Row r of int arg a := v (or of a str/raw arg's codes: -1 = absent). The column is kept in the narrowest
   width that holds every value written so far: a value that does not fit widens rows [0, r) in place (from the last row down, so no value is
   overwritten before it is read: row i's new bytes start at or after its old ones), at most 3 times per
   column. The column's width is thus the narrowest that holds all its values, as trace.narrow_args
   would choose it over the finished column. */
static int widen(Parser *p, int a, size_t rows, int need) {
    int w = p->arg_w[a];
    if (need <= w) return 0; /* (put_int checks first: this is the rare path) */
    void *q = realloc(p->arg[a], p->cap * (size_t)need);
    if (!q) FAIL(p, "out of memory", p->pos);
    for (size_t i = rows; i-- > 0;) int_put(q, need, i, int_at(q, w, i));
    if (p->filled > rows) memset((char *)q + rows * (size_t)need, 0xFF, (p->filled - rows) * (size_t)need); /* -1 */
    p->arg[a] = q;
    p->arg_w[a] = (uint8_t)need;
    return 0;
}

/* Most args are absent from most events: rather than writing -1 (or NaN) into every arg column for every
   row, the next PREFILL rows of each (within the capacity) are set to absent ahead (-1 is all one bits at
   any width), and an event writes only the args its category carries. Filling ahead in chunks keeps the
   pages the capacity's doubling reserves untouched until rows reach them. */
#define PREFILL 65536
static void prefill(Parser *p) {
    size_t lo = p->filled, hi = p->cap < lo + PREFILL ? p->cap : lo + PREFILL;
    for (int a = 0; a < p->n_args; a++) {
        if (p->kinds[a] == 'f') {
            double *d = p->arg[a];
            for (size_t i = lo; i < hi; i++) d[i] = NAN;
        } else {
            memset((char *)p->arg[a] + lo * p->arg_w[a], 0xFF, (hi - lo) * p->arg_w[a]);
        }
    }
    p->filled = hi;
}

static inline int put_int(Parser *p, int a, size_t r, int64_t v) {
    int need = int_width(v);
    if (need > p->arg_w[a] && widen(p, a, r, need) < 0) return -1;
    int_put(p->arg[a], p->arg_w[a], r, v);
    return 0;
}

typedef struct {
    int64_t off, len; /* string content (inside the quotes); len -1 = absent */
    int escaped;
} Str;

/* One event object at *i. */
static int parse_event(Parser *p, int64_t *i) {
    const unsigned char *b = p->buf;
    int64_t start = *i;
    if (start >= p->n || b[start] != '{') FAIL(p, "event is not an object", start);
    Str ph = {0, 0, 0}, cat = {0, 0, 0}, name = {0, 0, 0}, pid_str = {0, -1, 0}, tid_str = {0, -1, 0};
    int64_t pid = 0, tid = 0, ts_off = -1, ts_len = 0, dur_off = -1, dur_len = 0;
    int ts_null = 0, args_bad = 0, args_seen = 0;
    p->gen++;
    if (p->gen == 0) { /* wrapped: forget every slot */
        for (int a = 0; a < p->n_args; a++) p->slot[a].gen = 0;
        p->gen = 1;
    }
    int64_t j = skip_ws(p, start + 1);
    if (j < p->n && b[j] == '}') {
        j++;
        goto done;
    }
    for (int more = 1; more;) {
        int esc;
        int64_t k0, klen;
        if (scan_key(p, &j, &k0, &klen, &esc) < 0) return -1;
        if (esc) FAIL(p, "escaped key", k0);
        const unsigned char *key = b + k0 + 1;
        int64_t v0 = j;
        uint8_t tag;
        int64_t iv = 0;
        Str *target = NULL;
        int which = 0; /* 1 pid, 2 tid, 3 ts, 4 dur, 5 id, 6 bp, 7 args */
        if (klen == 2 && key[0] == 'p' && key[1] == 'h') target = &ph;
        else if (klen == 3 && memcmp(key, "cat", 3) == 0) target = &cat;
        else if (klen == 4 && memcmp(key, "name", 4) == 0) target = &name;
        else if (klen == 3 && memcmp(key, "pid", 3) == 0) which = 1;
        else if (klen == 3 && memcmp(key, "tid", 3) == 0) which = 2;
        else if (klen == 2 && key[0] == 't' && key[1] == 's') which = 3;
        else if (klen == 3 && memcmp(key, "dur", 3) == 0) which = 4;
        else if (klen == 2 && key[0] == 'i' && key[1] == 'd') which = 5;
        else if (klen == 2 && key[0] == 'b' && key[1] == 'p') which = 6;
        else if (klen == 4 && memcmp(key, "args", 4) == 0) which = 7;
        if (which == 7) {
            if (args_seen++) FAIL(p, "duplicate args", k0); /* msgspec keeps the last; slots would merge */
            if (j < p->n && b[j] == '{') {
                if (scan_args(p, &j) < 0) return -1;
                args_bad = 0;
            } else {
                if (skip_value(p, &j, 1) < 0) return -1;
                args_bad = 1;
            }
        } else if (target || which) {
            if (scan_value(p, &j, 1, &tag, &esc, &iv) < 0) return -1;
            if (target) {
                if (tag != T_STR) FAIL(p, "ph/cat/name is not a string", v0);
                *target = (Str){v0 + 1, j - v0 - 2, esc};
            } else if (which == 1 || which == 2) {
                Str *s = which == 1 ? &pid_str : &tid_str;
                if (tag == T_INT) {
                    *(which == 1 ? &pid : &tid) = iv;
                    s->len = -1;
                } else if (tag == T_STR) {
                    *s = (Str){v0 + 1, j - v0 - 2, esc};
                } else {
                    FAIL(p, "pid/tid is neither an integer nor a string", v0);
                }
            } else if (which == 3) {
                if (tag == T_NULL) {
                    ts_null = 1;
                    ts_off = -1;
                } else if (tag == T_INT || tag == T_NUM) {
                    ts_null = 0;
                    ts_off = v0;
                    ts_len = j - v0;
                } else {
                    FAIL(p, "ts is not a number", v0);
                }
            } else if (which == 4) {
                if (tag != T_INT && tag != T_NUM) FAIL(p, "dur is not a number", v0);
                dur_off = v0;
                dur_len = j - v0;
            } else if (which == 5) {
                if (tag != T_INT && tag != T_STR && tag != T_NULL) FAIL(p, "id is not an integer or string", v0);
            } else if (which == 6) {
                if (tag != T_STR && tag != T_NULL) FAIL(p, "bp is not a string", v0);
            }
        } else {
            if (skip_value(p, &j, 1) < 0) return -1;
        }
        if ((more = after_value(p, &j, '}')) < 0) return -1;
    }
    j++; /* past the closing brace */
done:
    *i = j;
    p->n_events++;
    if (ph.escaped) FAIL(p, "escaped ph", ph.off);
    unsigned char phc = ph.len == 1 ? b[ph.off] : 0;
    if (phc == 'M') return i64_push2(&p->meta, start, j) < 0 ? (p->err = "out of memory", -1) : 0;
    if (phc == 's' || phc == 't' || phc == 'f')
        return i64_push2(&p->flow, start, j) < 0 ? (p->err = "out of memory", -1) : 0;
    if (phc != 'X' && phc != 'i' && phc != 'I') return 0; /* other phases are not read */

    /* a timed event: one row */
    if (ts_off < 0) FAIL(p, ts_null ? "timed event with null ts" : "timed event without ts", start);
    if (args_bad) FAIL(p, "args is not an object", start);
    if (p->rows == p->cap && grow_rows(p) < 0) return -1;
    size_t r = p->rows;
    if (r >= p->filled) prefill(p);
    if (code_of(p, &p->d_ph, ph.off, ph.len, 0, &p->ph[r]) < 0) return -1;
    if (code_of(p, &p->d_cat, cat.off, cat.len, cat.escaped, &p->cat[r]) < 0) return -1;
    if (code_of(p, &p->d_name, name.off, name.len, name.escaped, &p->name[r]) < 0) return -1;
    p->pid[r] = pid;
    p->tid[r] = tid;
    p->pid_s[r] = p->tid_s[r] = -1;
    if (pid_str.len >= 0 && code_of(p, &p->d_pidtid, pid_str.off, pid_str.len, pid_str.escaped, &p->pid_s[r]) < 0)
        return -1;
    if (tid_str.len >= 0 && code_of(p, &p->d_pidtid, tid_str.off, tid_str.len, tid_str.escaped, &p->tid_s[r]) < 0)
        return -1;
    if (number_ns(p, ts_off, ts_len, &p->ts[r]) < 0) return -1;
    p->dur[r] = 0;
    if (dur_off >= 0 && number_ns(p, dur_off, dur_len, &p->dur[r]) < 0) return -1;

    int group;
    if (cat_group(p, p->cat[r], &group) < 0) return -1;
    /* the args this category carries that the event has (the others are absent: prefilled) */
    for (uint64_t mask = group >= 0 ? p->group_mask[group] : 0; mask; mask &= mask - 1) {
        int a = __builtin_ctzll(mask);
        const Slot *s = &p->slot[a];
        if (s->gen != p->gen || s->tag == T_ABSENT || s->tag == T_NULL) {
            if (s->gen == p->gen && s->tag == T_NULL && p->kinds[a] == 'r') { /* raw keeps null's text */
                int32_t c;
                if (code_of(p, &p->d_arg[a], s->off, s->len, 0, &c) < 0 || put_int(p, a, r, c) < 0) return -1;
            }
            continue;
        }
        switch (p->kinds[a]) {
        case 'i':
            if (s->tag == T_INT) {
                if (put_int(p, a, r, s->ival) < 0) return -1;
            } else { /* "0x0", 3.0, true: converted by the caller (the row keeps -1 until then) */
                if (i64_push2(&p->fixups, (int64_t)r, a) < 0 || i64_push2(&p->fixups, s->off, s->len) < 0)
                    FAIL(p, "out of memory", s->off);
            }
            break;
        case 'f':
            if (s->tag == T_INT || s->tag == T_NUM) {
                if (number_double(p, s->off, s->len, &((double *)p->arg[a])[r]) < 0) return -1;
            } else {
                if (i64_push2(&p->fixups, (int64_t)r, a) < 0 || i64_push2(&p->fixups, s->off, s->len) < 0)
                    FAIL(p, "out of memory", s->off);
            }
            break;
        case 's': {
            int32_t c;
            if (s->tag == T_STR) {
                if (code_of(p, &p->d_arg[a], s->off + 1, s->len - 2, s->escaped ? F_ESCAPED : F_PLAIN, &c) < 0)
                    return -1;
            } else if (code_of(p, &p->d_arg[a], s->off, s->len, F_JSON, &c) < 0) {
                return -1;
            }
            if (put_int(p, a, r, c) < 0) return -1; /* codes as narrow as the dictionary's size allows */
            break;
        }
        default: { /* raw: the value's JSON text as written */
            int32_t c;
            if (code_of(p, &p->d_arg[a], s->off, s->len, 0, &c) < 0) return -1;
            if (put_int(p, a, r, c) < 0) return -1;
        }
        }
    }
    p->rows++;
    return 0;
}

/* Find the events array: a bare top-level array, or the value of the top-level 'traceEvents' key
   (other keys before it are validated and skipped). */
static int locate(Parser *p) {
    const unsigned char *b = p->buf;
    int64_t j = skip_ws(p, 0);
    if (j >= p->n) FAIL(p, "empty document", 0);
    if (b[j] == '[') {
        p->top_object = 0;
        p->ev_lo = j;
        p->pos = j + 1;
        p->state = ST_ARRAY_FIRST;
        return 0;
    }
    if (b[j] != '{') FAIL(p, "not a JSON object or array", j);
    p->top_object = 1;
    j = skip_ws(p, j + 1);
    if (j < p->n && b[j] == '}') FAIL(p, "no traceEvents", j);
    for (;;) {
        int esc;
        int64_t k0, klen;
        if (scan_key(p, &j, &k0, &klen, &esc) < 0) return -1;
        if (esc) FAIL(p, "escaped top-level key", k0);
        if (klen == 11 && memcmp(b + k0 + 1, "traceEvents", 11) == 0) {
            if (j >= p->n || b[j] != '[') FAIL(p, "traceEvents is not an array", j);
            p->ev_lo = j;
            p->pos = j + 1;
            p->state = ST_ARRAY_FIRST;
            return 0;
        }
        if (skip_value(p, &j, 1) < 0) return -1;
        int more = after_value(p, &j, '}');
        if (more < 0) return -1;
        if (!more) FAIL(p, "no traceEvents", j);
    }
}

/* After the events array: the rest of the top-level object (no second traceEvents), then only
   whitespace. */
static int finish(Parser *p) {
    const unsigned char *b = p->buf;
    int64_t j = skip_ws(p, p->pos);
    if (p->top_object) {
        for (;;) {
            if (j >= p->n) FAIL(p, "unexpected end of data", j);
            if (b[j] == '}') {
                j++;
                break;
            }
            if (b[j] != ',') FAIL(p, "expected ',' or '}'", j);
            j = skip_ws(p, j + 1);
            int esc;
            if (j >= p->n || b[j] != '"') FAIL(p, "expected a key", j);
            int64_t k0 = j;
            if (scan_string(p, &j, &esc) < 0) return -1;
            if (esc) FAIL(p, "escaped top-level key", k0);
            if (j - k0 - 2 == 11 && memcmp(b + k0 + 1, "traceEvents", 11) == 0) FAIL(p, "second traceEvents", k0);
            j = skip_ws(p, j);
            if (j >= p->n || b[j] != ':') FAIL(p, "expected ':'", j);
            j = skip_ws(p, j + 1);
            if (skip_value(p, &j, 1) < 0) return -1;
            j = skip_ws(p, j);
        }
        j = skip_ws(p, j);
    }
    if (j != p->n) FAIL(p, "trailing data after the document", j);
    p->pos = j;
    p->state = ST_DONE;
    return 0;
}

/* Up to max_events events; 1 when the document is done (or this part handed off), 0 when more remain,
   -1 on error. */
static int feed(Parser *p, int64_t max_events) {
    const unsigned char *b = p->buf;
    if (p->state == ST_START && locate(p) < 0) return -1;
    for (int64_t k = 0; k < max_events && (p->state == ST_ARRAY_FIRST || p->state == ST_ARRAY_NEXT); k++) {
        int64_t j = skip_ws(p, p->pos);
        if (j >= p->n) FAIL(p, "unexpected end of data (truncated?)", j);
        if (p->state == ST_ARRAY_NEXT) {
            if (b[j] == ']') {
                p->ev_hi = j + 1;
                p->pos = j + 1;
                p->state = ST_TAIL;
                break;
            }
            if (b[j] != ',') FAIL(p, "expected ',' or ']' between events", j);
            j = skip_ws(p, j + 1);
        } else if (b[j] == ']') {
            p->ev_hi = j + 1;
            p->pos = j + 1;
            p->state = ST_TAIL;
            break;
        }
        if (p->li < p->n_limits) { /* a later part's guessed start: hand off when landing on it exactly */
            while (p->li < p->n_limits && p->limits[p->li] < j) p->li++;
            if (p->li < p->n_limits && p->limits[p->li] == j) {
                p->pos = p->stopped_at = j;
                p->state = ST_HANDOFF;
                return 1;
            }
        }
        if (parse_event(p, &j) < 0) return -1;
        p->pos = j;
        p->state = ST_ARRAY_NEXT;
    }
    if (p->state == ST_TAIL && finish(p) < 0) return -1;
    return p->state == ST_DONE || p->state == ST_HANDOFF;
}

/* ----------------------------------------------------------------------------------------------
   Python type. */

static void free_rows(Parser *p);

static void Parser_dealloc(Parser *p) {
    free_rows(p);
    free(p->limits);
    if (p->have_view) PyBuffer_Release(&p->view);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* Parser(buf, arg_keys: tuple[bytes], arg_kinds: bytes ('i','s','r','f' per arg),
          cat_groups: tuple[tuple[bytes, int]], group_masks: tuple[int]) */
static int Parser_init(Parser *p, PyObject *args, PyObject *kw) {
    PyObject *buf, *keys, *cats, *masks;
    Py_buffer kinds;
    if (!PyArg_ParseTuple(args, "OO!y*O!O!", &buf, &PyTuple_Type, &keys, &kinds, &PyTuple_Type, &cats,
                          &PyTuple_Type, &masks))
        return -1;
    int rc = -1;
    if (p->have_view) {
        PyErr_SetString(PyExc_RuntimeError, "Parser already initialized");
        goto out;
    }
    Py_ssize_t na = PyTuple_GET_SIZE(keys);
    if (na > MAX_ARGS || kinds.len != na) {
        PyErr_SetString(PyExc_ValueError, "arg_keys and arg_kinds must have the same length (<= 64)");
        goto out;
    }
    p->n_args = (int)na;
    for (int a = 0; a < na; a++) {
        PyObject *k = PyTuple_GET_ITEM(keys, a);
        char kind = ((const char *)kinds.buf)[a];
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) >= MAX_KEY_LEN || !strchr("isrf", kind) || kind == 0) {
            PyErr_SetString(PyExc_ValueError, "bad arg key or kind");
            goto out;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(k);
        memcpy(p->keys[a], PyBytes_AS_STRING(k), (size_t)len);
        p->key_len[a] = (int)len;
        p->kinds[a] = kind;
        p->by_len[len][p->by_len_n[len]++] = a;
    }
    Py_ssize_t nc = PyTuple_GET_SIZE(cats), ng = PyTuple_GET_SIZE(masks);
    if (nc > MAX_CATS || ng > MAX_GROUPS) {
        PyErr_SetString(PyExc_ValueError, "too many categories or groups");
        goto out;
    }
    for (int g = 0; g < ng; g++) {
        unsigned long long m = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(masks, g));
        if (m == (unsigned long long)-1 && PyErr_Occurred()) goto out;
        p->group_mask[g] = m;
    }
    p->n_groups = (int)ng;
    for (int c = 0; c < nc; c++) {
        PyObject *pair = PyTuple_GET_ITEM(cats, c);
        const char *s;
        Py_ssize_t len;
        int g;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "y#i", &s, &len, &g)) goto out;
        if (len >= MAX_KEY_LEN || g < 0 || g >= ng) {
            PyErr_SetString(PyExc_ValueError, "bad category");
            goto out;
        }
        memcpy(p->cat_names[c], s, (size_t)len);
        p->cat_len[c] = (int)len;
        p->cat_group_of[c] = g;
    }
    p->n_cats = (int)nc;
    if (PyObject_GetBuffer(buf, &p->view, PyBUF_SIMPLE) < 0) goto out;
    p->have_view = 1;
    p->buf = p->view.buf;
    p->n = p->view.len;
    p->state = ST_START;
    p->ev_lo = p->ev_hi = -1;
    p->stopped_at = -1;
    rc = 0;
out:
    PyBuffer_Release(&kinds);
    return rc;
}

/* A memory-mapped file truncated by another process while it is scanned: touching a page past its new end
   raises SIGBUS, which would kill the process. `feed` runs under a guard: a SIGBUS whose address lies in the
   buffer being scanned, in the thread that scans it, jumps back out of the scan (the parser is then marked
   failed and never read again); any other SIGBUS goes to the handler that was installed before (Python's
   faulthandler, or the default: the process dies, as it would have). */
static __thread sigjmp_buf *guard_jmp;
static __thread const unsigned char *guard_lo, *guard_hi;
static struct sigaction prev_bus;

static void on_sigbus(int sig, siginfo_t *si, void *ctx) {
    const unsigned char *a = (const unsigned char *)si->si_addr;
    if (guard_jmp != NULL && a >= guard_lo && a < guard_hi) siglongjmp(*guard_jmp, 1);
    sigaction(SIGBUS, &prev_bus, NULL); /* not a scan's fault: returning re-runs the access under the old handler */
    (void)sig;
    (void)ctx;
}

static void ensure_bus_handler(void) {
    struct sigaction cur;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_sigbus) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &prev_bus) != 0) return;
}

static int guarded_feed(Parser *p, int64_t max_events) {
    sigjmp_buf jb;
    volatile int r = -1;
    if (sigsetjmp(jb, 1) == 0) {
        guard_lo = p->buf;
        guard_hi = p->buf + p->n;
        guard_jmp = &jb;
        r = feed(p, max_events);
    } else {
        p->err = "the file shrank while it was read (truncated or rewritten by another process)";
        p->err_pos = p->pos;
        r = -1;
    }
    guard_jmp = NULL;
    return r;
}

static PyObject *Parser_feed(Parser *p, PyObject *arg) {
    long long max_events = PyLong_AsLongLong(arg);
    if (max_events == -1 && PyErr_Occurred()) return NULL;
    if (!p->have_view) {
        PyErr_SetString(PyExc_RuntimeError, "Parser not initialized");
        return NULL;
    }
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Parser is being fed from another thread");
        return NULL;
    }
    if (p->err) {
        PyErr_Format(Unsupported, "%s at byte %lld", p->err, (long long)p->err_pos);
        return NULL;
    }
    int r;
    p->busy = 1;
    ensure_bus_handler();
    Py_BEGIN_ALLOW_THREADS
    r = guarded_feed(p, max_events);
    Py_END_ALLOW_THREADS
    p->busy = 0;
    if (r < 0) {
        PyErr_Format(Unsupported, "%s at byte %lld", p->err ? p->err : "error", (long long)p->err_pos);
        return NULL;
    }
    return PyBool_FromLong(r);
}

/* A column handed to Python without a copy: a buffer object that owns the malloc'd memory (frees it
   when the last numpy/Arrow view of it goes). */
typedef struct {
    PyObject_HEAD
    void *data;
    Py_ssize_t len;
} Column;

static void Column_dealloc(Column *c) {
    free(c->data);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Column_getbuffer(Column *c, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)c, c->data, c->len, 0, flags);
}

static PyBufferProcs Column_as_buffer = {(getbufferproc)Column_getbuffer, NULL};

static PyTypeObject ColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelens.io._kineto_fast.Column",
    .tp_basicsize = sizeof(Column),
    .tp_dealloc = (destructor)Column_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A scanned column's bytes (buffer protocol; numpy.frombuffer views it without copying).",
    .tp_as_buffer = &Column_as_buffer,
};

/* The n bytes at *ptr as a Column, which takes ownership (*ptr becomes NULL). */
static PyObject *take(void **ptr, size_t n) {
    Column *c = PyObject_New(Column, &ColumnType);
    if (!c) return NULL;
    void *data = *ptr ? realloc(*ptr, n ? n : 1) : malloc(1); /* give back the unused capacity */
    if (!data) {
        Py_DECREF(c);
        return PyErr_NoMemory();
    }
    *ptr = NULL;
    c->data = data;
    c->len = (Py_ssize_t)n;
    return (PyObject *)c;
}

/* (codes: Column of int32, values: list[bytes], flags: bytes of F_* per value); takes the codes. */
static PyObject *dict_result(const Parser *p, const Dict *d, void **codes, size_t rows, size_t width) {
    PyObject *values = PyList_New((Py_ssize_t)d->n);
    PyObject *esc = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)d->n);
    PyObject *c = take(codes, rows * width);
    if (!values || !esc || !c) goto fail;
    for (size_t k = 0; k < d->n; k++) {
        const DictEntry *e = &d->entries[k];
        /* from the dictionary's own copy, not the document: a memory-mapped trace's values lie all over the file
           (800,000 distinct step names in a 2 GB one: reading them there faulted the whole file back in) */
        PyObject *v = PyBytes_FromStringAndSize((const char *)d->bytes + e->copy, (Py_ssize_t)e->len);
        if (!v) goto fail;
        PyList_SET_ITEM(values, (Py_ssize_t)k, v);
        PyBytes_AS_STRING(esc)[k] = (char)e->escaped;
    }
    return Py_BuildValue("(NNN)", c, values, esc);
fail:
    Py_XDECREF(values);
    Py_XDECREF(esc);
    Py_XDECREF(c);
    return NULL;
}

static int put(PyObject *d, const char *key, PyObject *v) {
    if (!v) return -1;
    int r = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return r;
}

/* Everything scanned, as a dict of Columns (buffers, no copies); call once, after feed returned True. Row columns:
   'ph','cat','name','pid_tid_str' and each str/raw arg -> (codes, values, escaped), codes int32 (a str/raw
   arg's: of 'arg_widths'[a] bytes, the narrowest that holds its dictionary's codes); 'pid','tid',
   'ts','dur' -> int64; int args -> signed integers of 'arg_widths'[a] bytes each (1, 2, 4 or 8: the
   narrowest that holds the column's values); float args -> float64; 'pid_s','tid_s' ->
   int32 codes into 'pid_tid_str' (-1: the id was an integer); 'fixups' -> int64 quadruples (row, arg,
   offset, length) of int/float arg values of another JSON type, left -1/NaN for the caller to convert;
   'meta_spans', 'flow_spans' -> int64 (start, end) pairs. */
static PyObject *Parser_result(Parser *p, PyObject *Py_UNUSED(ignored)) {
    if (p->state != ST_DONE) {
        PyErr_SetString(PyExc_RuntimeError, "Parser.result() before the document was fed to its end");
        return NULL;
    }
    if (p->taken) {
        PyErr_SetString(PyExc_RuntimeError, "Parser.result() hands the columns over once");
        return NULL;
    }
    p->taken = 1; /* the columns move into Column objects: no copy */
    size_t r = p->rows;
    void *no_codes = NULL;
    PyObject *d = PyDict_New();
    PyObject *args = PyList_New(p->n_args);
    if (!d || !args) goto fail;
    if (put(d, "rows", PyLong_FromSize_t(r)) < 0 || put(d, "n_events", PyLong_FromLongLong(p->n_events)) < 0 ||
        put(d, "events_span", Py_BuildValue("(LL)", (long long)p->ev_lo, (long long)p->ev_hi)) < 0 ||
        put(d, "top_object", PyBool_FromLong(p->top_object)) < 0 ||
        put(d, "ph", dict_result(p, &p->d_ph, (void **)&p->ph, r, 4)) < 0 ||
        put(d, "cat", dict_result(p, &p->d_cat, (void **)&p->cat, r, 4)) < 0 ||
        put(d, "name", dict_result(p, &p->d_name, (void **)&p->name, r, 4)) < 0 ||
        put(d, "pid_tid_str", dict_result(p, &p->d_pidtid, &no_codes, 0, 4)) < 0 ||
        put(d, "pid", take((void **)&p->pid, r * 8)) < 0 || put(d, "tid", take((void **)&p->tid, r * 8)) < 0 ||
        put(d, "pid_s", take((void **)&p->pid_s, r * 4)) < 0 || put(d, "tid_s", take((void **)&p->tid_s, r * 4)) < 0 ||
        put(d, "ts", take((void **)&p->ts, r * 8)) < 0 || put(d, "dur", take((void **)&p->dur, r * 8)) < 0 ||
        put(d, "meta_spans", take((void **)&p->meta.data, p->meta.n * 8)) < 0 ||
        put(d, "flow_spans", take((void **)&p->flow.data, p->flow.n * 8)) < 0 ||
        put(d, "fixups", take((void **)&p->fixups.data, p->fixups.n * 8)) < 0)
        goto fail;
    for (int a = 0; a < p->n_args; a++) {
        PyObject *v;
        if (p->kinds[a] == 's' || p->kinds[a] == 'r') v = dict_result(p, &p->d_arg[a], &p->arg[a], r, p->arg_w[a]);
        else v = take(&p->arg[a], r * (p->kinds[a] == 'i' ? p->arg_w[a] : 8));
        if (!v) goto fail;
        PyList_SET_ITEM(args, a, v);
    }
    if (put(d, "arg_widths", PyBytes_FromStringAndSize((const char *)p->arg_w, p->n_args)) < 0) goto fail;
    if (PyDict_SetItemString(d, "args", args) < 0) goto fail;
    Py_DECREF(args);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(args);
    return NULL;
}

/* ----------------------------------------------------------------------------------------------
   Parallel scan: fork, set_limits, absorb (see the top of this file). */

static void free_rows(Parser *p) {
    free(p->ph);
    free(p->cat);
    free(p->name);
    free(p->pid_s);
    free(p->tid_s);
    free(p->pid);
    free(p->tid);
    free(p->ts);
    free(p->dur);
    p->ph = p->cat = p->name = p->pid_s = p->tid_s = NULL;
    p->pid = p->tid = p->ts = p->dur = NULL;
    for (int a = 0; a < MAX_ARGS; a++) {
        free(p->arg[a]);
        p->arg[a] = NULL;
        dict_free(&p->d_arg[a]);
    }
    dict_free(&p->d_ph);
    dict_free(&p->d_cat);
    dict_free(&p->d_name);
    dict_free(&p->d_pidtid);
    free(p->cat_group);
    p->cat_group = NULL;
    p->cat_group_cap = 0;
    free(p->meta.data);
    free(p->flow.data);
    free(p->fixups.data);
    memset(&p->meta, 0, sizeof(p->meta));
    memset(&p->flow, 0, sizeof(p->flow));
    memset(&p->fixups, 0, sizeof(p->fixups));
    p->rows = p->cap = 0;
}

/* The codes in `dst` of every entry of `src` (entries new to `dst` are added in `src`'s order). */
static int32_t *dict_remap(Parser *p, Dict *dst, const Dict *src) {
    int32_t *m = malloc((src->n ? src->n : 1) * sizeof(int32_t));
    if (!m) return NULL;
    for (size_t k = 0; k < src->n; k++) {
        const DictEntry *e = &src->entries[k];
        int64_t c = dict_code_at(dst, src->bytes + e->copy, e->off, e->len, e->escaped); /* (not the document) */
        if (c < 0) {
            free(m);
            return NULL;
        }
        m[k] = (int32_t)c;
    }
    return m;
}

/* dst[r0 + i] = remapped src[i] for an int32 code column (-1, absent, stays -1). */
static int append_codes(Parser *p, int32_t *dst, const int32_t *src, size_t n, Dict *dd, const Dict *sd) {
    int32_t *m = dict_remap(p, dd, sd);
    if (!m) FAIL(p, "out of memory", p->pos);
    for (size_t i = 0; i < n; i++) dst[i] = src[i] < 0 ? src[i] : m[src[i]];
    free(m);
    return 0;
}

static int append_pairs(I64Vec *dst, const I64Vec *src) {
    for (size_t k = 0; k + 1 < src->n; k += 2)
        if (i64_push2(dst, src->data[k], src->data[k + 1]) < 0) return -1;
    return 0;
}

#define DROP(ptr)   \
    do {            \
        free(ptr);  \
        (ptr) = NULL; \
    } while (0)

/* Append o's rows (and its metadata / flow spans and fix-ups) to p's, as if p had scanned them. Each of
   o's columns is freed as soon as it is copied (p's grown columns take pages only as they are written),
   so the merge adds one column to the scan's peak, not a part's columns. */
static int merge(Parser *p, Parser *o) {
    size_t r0 = p->rows, r1 = o->rows;
    if (append_pairs(&p->meta, &o->meta) < 0 || append_pairs(&p->flow, &o->flow) < 0)
        FAIL(p, "out of memory", p->pos);
    for (size_t k = 0; k + 3 < o->fixups.n; k += 4) {
        if (i64_push2(&p->fixups, o->fixups.data[k] + (int64_t)r0, o->fixups.data[k + 1]) < 0 ||
            i64_push2(&p->fixups, o->fixups.data[k + 2], o->fixups.data[k + 3]) < 0)
            FAIL(p, "out of memory", p->pos);
    }
    if (!r1) return 0;
    if (reserve_rows(p, r0 + r1) < 0) return -1;
    if (append_codes(p, p->ph + r0, o->ph, r1, &p->d_ph, &o->d_ph) < 0) return -1;
    DROP(o->ph);
    if (append_codes(p, p->cat + r0, o->cat, r1, &p->d_cat, &o->d_cat) < 0) return -1;
    DROP(o->cat);
    if (append_codes(p, p->name + r0, o->name, r1, &p->d_name, &o->d_name) < 0) return -1;
    DROP(o->name);
    int32_t *m = dict_remap(p, &p->d_pidtid, &o->d_pidtid);
    if (!m) FAIL(p, "out of memory", p->pos);
    for (size_t i = 0; i < r1; i++) {
        p->pid_s[r0 + i] = o->pid_s[i] < 0 ? -1 : m[o->pid_s[i]];
        p->tid_s[r0 + i] = o->tid_s[i] < 0 ? -1 : m[o->tid_s[i]];
    }
    free(m);
    DROP(o->pid_s);
    DROP(o->tid_s);
    memcpy(p->pid + r0, o->pid, r1 * sizeof(int64_t));
    DROP(o->pid);
    memcpy(p->tid + r0, o->tid, r1 * sizeof(int64_t));
    DROP(o->tid);
    memcpy(p->ts + r0, o->ts, r1 * sizeof(int64_t));
    DROP(o->ts);
    memcpy(p->dur + r0, o->dur, r1 * sizeof(int64_t));
    DROP(o->dur);
    for (int a = 0; a < p->n_args; a++) {
        if (p->kinds[a] == 'f') {
            memcpy((double *)p->arg[a] + r0, o->arg[a], r1 * sizeof(double));
            DROP(o->arg[a]);
            continue;
        }
        int w1 = o->arg_w[a];
        int32_t *rm = NULL;
        int need = w1;
        if (p->kinds[a] != 'i') { /* codes: renumbered; as wide as the merged dictionary's codes need */
            if (!(rm = dict_remap(p, &p->d_arg[a], &o->d_arg[a]))) FAIL(p, "out of memory", p->pos);
            need = p->d_arg[a].n ? int_width((int64_t)p->d_arg[a].n - 1) : 1;
        }
        if (widen(p, a, r0, need) < 0) {
            free(rm);
            return -1;
        }
        int w = p->arg_w[a];
        if (!rm && w == w1) {
            memcpy((char *)p->arg[a] + r0 * (size_t)w, o->arg[a], r1 * (size_t)w);
        } else {
            for (size_t i = 0; i < r1; i++) {
                int64_t v = int_at(o->arg[a], w1, i);
                int_put(p->arg[a], w, r0 + i, rm && v >= 0 ? rm[v] : v);
            }
        }
        free(rm);
        DROP(o->arg[a]);
    }
    p->rows = r0 + r1;
    return 0;
}
#undef DROP

/* fork(pos) -> a Parser of the same document and spec that starts at the event at byte pos, as if it
   opened the events array (pos: a guessed event start behind the first event). */
static PyObject *Parser_fork(Parser *p, PyObject *arg) {
    long long pos = PyLong_AsLongLong(arg);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    if (!p->have_view || p->ev_lo < 0 || p->start != 0) {
        PyErr_SetString(PyExc_RuntimeError, "fork() needs the first parser, past the start of the events array");
        return NULL;
    }
    if (pos <= p->ev_lo || pos >= p->n) {
        PyErr_SetString(PyExc_ValueError, "fork(): position outside the events array");
        return NULL;
    }
    Parser *c = (Parser *)PyType_GenericNew(Py_TYPE(p), NULL, NULL);
    if (!c) return NULL;
    /* the spec: the fields from n_args up to rows */
    memcpy(&c->n_args, &p->n_args, offsetof(Parser, rows) - offsetof(Parser, n_args));
    if (PyObject_GetBuffer(p->view.obj, &c->view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    c->have_view = 1;
    c->buf = c->view.buf;
    c->n = c->view.len;
    if (c->buf != p->buf || c->n != p->n) {
        Py_DECREF(c);
        PyErr_SetString(PyExc_RuntimeError, "fork(): the document's buffer moved");
        return NULL;
    }
    c->state = ST_ARRAY_FIRST;
    c->pos = c->start = pos;
    c->top_object = p->top_object;
    c->ev_lo = p->ev_lo;
    c->ev_hi = -1;
    c->stopped_at = -1;
    return (PyObject *)c;
}

/* set_limits(positions): the later parts' starts (ascending) at which this parser hands off. */
static PyObject *Parser_set_limits(Parser *p, PyObject *arg) {
    if (p->busy) {
        PyErr_SetString(PyExc_RuntimeError, "Parser is being fed from another thread");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "set_limits() takes a sequence of positions");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *lim = n ? malloc((size_t)n * sizeof(int64_t)) : NULL;
    if (n && !lim) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        lim[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, k));
        if ((lim[k] == -1 && PyErr_Occurred()) || (k && lim[k] <= lim[k - 1]) || lim[k] <= p->start) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "set_limits(): ascending positions past the start");
            free(lim);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    free(p->limits);
    p->limits = lim;
    p->n_limits = (size_t)n;
    p->li = 0;
    Py_RETURN_NONE;
}

/* absorb(part): append the rows of the part this parser handed off to (scanned to its own end or
   hand-off), taking over its position and state; its columns are freed. Raises Unsupported when the
   part met something the scanner does not take (as one parser would have there). */
static PyObject *Parser_absorb(Parser *p, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, Py_TYPE(p))) {
        PyErr_SetString(PyExc_TypeError, "absorb() takes a Parser");
        return NULL;
    }
    Parser *o = (Parser *)arg;
    if (o == p || p->busy || o->busy || p->taken || o->taken || p->err || p->state != ST_HANDOFF ||
        o->start != p->stopped_at || o->buf != p->buf) {
        PyErr_SetString(PyExc_RuntimeError, "absorb(): not the part this parser handed off to, or one in use");
        return NULL;
    }
    if (o->err) {
        p->err = o->err;
        p->err_pos = o->err_pos;
        PyErr_Format(Unsupported, "%s at byte %lld", p->err, (long long)p->err_pos);
        return NULL;
    }
    if (o->state != ST_DONE && o->state != ST_HANDOFF) {
        PyErr_SetString(PyExc_RuntimeError, "absorb(): the part was not scanned to its end");
        return NULL;
    }
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = merge(p, o);
    Py_END_ALLOW_THREADS
    if (r < 0) {
        PyErr_Format(Unsupported, "%s at byte %lld", p->err ? p->err : "error", (long long)p->err_pos);
        return NULL;
    }
    p->n_events += o->n_events;
    p->state = o->state;
    p->pos = o->pos;
    p->ev_hi = o->ev_hi;
    p->stopped_at = o->stopped_at;
    free_rows(o);
    o->taken = 1;
    Py_RETURN_NONE;
}

static PyObject *Parser_stopped_at(Parser *p, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(p->stopped_at); }
static PyObject *Parser_start(Parser *p, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(p->start); }
static PyObject *Parser_events_start(Parser *p, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(p->ev_lo); }

static PyObject *Parser_position(Parser *p, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(p->pos); }

static PyMethodDef Parser_methods[] = {
    {"feed", (PyCFunction)Parser_feed, METH_O,
     "feed(max_events) -> bool: scan up to max_events more events; True once the whole document is read. "
     "Raises Unsupported for anything the msgspec path must handle."},
    {"result", (PyCFunction)Parser_result, METH_NOARGS, "The scanned columns (see the module docstring)."},
    {"fork", (PyCFunction)Parser_fork, METH_O,
     "fork(pos) -> Parser: a parser of the same document and spec starting at the (guessed) event at byte pos."},
    {"set_limits", (PyCFunction)Parser_set_limits, METH_O,
     "set_limits(positions): hand off (feed returns True) on landing exactly on one of these event starts."},
    {"absorb", (PyCFunction)Parser_absorb, METH_O,
     "absorb(part): append the rows of the part this parser handed off to; raises Unsupported for its errors."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Parser_getset[] = {
    {"position", (getter)Parser_position, NULL, "bytes of the document scanned so far", NULL},
    {"stopped_at", (getter)Parser_stopped_at, NULL, "the part start this parser handed off at, -1 if none", NULL},
    {"start", (getter)Parser_start, NULL, "where this parser began (0, or a forked part's first event)", NULL},
    {"events_start", (getter)Parser_events_start, NULL, "the events array's '[' (-1 until located)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ParserType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tracelens.io._kineto_fast.Parser",
    .tp_basicsize = sizeof(Parser),
    .tp_dealloc = (destructor)Parser_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One-pass scanner of a Kineto/Chrome-trace JSON document into event columns.",
    .tp_methods = Parser_methods,
    .tp_getset = Parser_getset,
    .tp_init = (initproc)Parser_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_kineto_fast",
    "Compiled fast path of tracelens.io.kineto: Kineto JSON -> event columns without per-event Python objects.",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__kineto_fast(void) {
    for (int c = 0; c < 0x20; c++) STR_STOP[c] = 1;
    STR_STOP['"'] = STR_STOP['\\'] = 1;
    if (PyType_Ready(&ParserType) < 0 || PyType_Ready(&ColumnType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Unsupported = PyErr_NewException("tracelens.io._kineto_fast.Unsupported", PyExc_ValueError, NULL);
    if (!Unsupported || PyModule_AddObject(m, "Unsupported", Unsupported) < 0) {
        Py_XDECREF(Unsupported);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "LAYOUT", LAYOUT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ParserType);
    if (PyModule_AddObject(m, "Parser", (PyObject *)&ParserType) < 0) {
        Py_DECREF(&ParserType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
