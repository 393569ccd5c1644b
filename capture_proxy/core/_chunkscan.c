/* The per-event scan of a streamed chat chunk, in one pass over its bytes.
 *
 * One function, scan_chat_chunk(data, flags), for the middle chunks of vLLM's chat stream
 * (vLLM 0.32 `chat.completion.chunk`, compact JSON from pydantic's model_dump_json):
 *
 *   {"id":...,"object":"chat.completion.chunk","created":...,"model":...,
 *    "choices":[{"index":0,"delta":{...},"logprobs":{"content":[{"token":...,
 *    "logprob":-0.25,"bytes":[...],"top_logprobs":[]}]},"finish_reason":null,
 *    "token_ids":[1234]}]}
 *
 * It validates the whole event as JSON, and returns
 * (event, delta, content, token_ids, log_probs):
 *   event      bytes: b"data: " + the chunk with what the harness did not ask for cut out
 *              (the same members, in the same order, as capture.strip_chat_chunk leaves;
 *              the values kept are the engine's own bytes) + b"\n\n"; None with
 *              SCAN_NO_EVENT;
 *   delta      bytes: choices[0].delta's raw JSON when it has members and is not
 *              content-only, else None;
 *   content    str: the text of a delta that is exactly {"content": <string>}, else None;
 *   token_ids  list[int]: choices[0].token_ids, or None when absent or null;
 *   log_probs  list[float | int | None]: each choices[0].logprobs.content entry's
 *              "logprob" (None when absent or null), or None when there is no content.
 *
 * It returns None, and the caller takes the Python path (orjson's parse, the assembler, the
 * strip), for everything else: bytes that are not strict JSON or not UTF-8, a chunk that is not
 * one object with one choice of index 0, a finish_reason, a usage, prompt ids, routed experts,
 * NaN or infinite numbers, integers of more than 18 digits, exponents of more than 2 digits,
 * \u escapes of surrogates, escaped or repeated member names, objects of more than 32, nesting
 * deeper than 64, line breaks when it makes the event (it keeps the engine's bytes: see
 * scan_chat_chunk). So what it accepts, the Python path would read the same way; what it is
 * not sure of, it leaves to the Python path. It never raises on the event's bytes.
 *
 * Pure C against CPython's API, no I/O, no state: safe to call from any thread holding the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* flags (capture.HarnessAsked.scan_flags) */
#define SCAN_STRIP_TOKEN_IDS 1 /* drop choices[0].token_ids (harness did not ask for them) */
#define SCAN_NULL_LOGPROBS 2   /* choices[0].logprobs -> null (harness did not ask) */
#define SCAN_DROP_USAGE 4      /* a top-level "usage": null is dropped (no include_usage) */
#define SCAN_NO_EVENT 8        /* the caller needs no event bytes (another API's front) */

#define MAX_DEPTH 64
#define MAX_MEMBERS 32
#define MAX_NUMBER 40

typedef struct {
    const unsigned char *p;
    const unsigned char *end;
} Cur;

/* A member of an object: key (without its quotes), the member's whole span, its value. */
typedef struct {
    const unsigned char *key;
    Py_ssize_t key_len;
    const unsigned char *start; /* the key's opening quote */
    const unsigned char *value;
    const unsigned char *value_end;
} Member;

static void skip_ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static int hex4(const unsigned char *s, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char ch = s[i];
        v <<= 4;
        if (ch >= '0' && ch <= '9') v |= (unsigned)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') v |= (unsigned)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') v |= (unsigned)(ch - 'A' + 10);
        else return -1;
    }
    *out = v;
    return 0;
}

/* Length of the UTF-8 sequence at s (strict, RFC 3629), 0 when invalid. */
static int utf8_len(const unsigned char *s, const unsigned char *end) {
    unsigned char b0 = s[0];
    Py_ssize_t left = end - s;
    if (b0 >= 0xC2 && b0 <= 0xDF) {
        return (left >= 2 && (s[1] & 0xC0) == 0x80) ? 2 : 0;
    }
    if (b0 >= 0xE0 && b0 <= 0xEF) {
        if (left < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80) return 0;
        if (b0 == 0xE0 && s[1] < 0xA0) return 0; /* overlong */
        if (b0 == 0xED && s[1] > 0x9F) return 0; /* a surrogate */
        return 3;
    }
    if (b0 >= 0xF0 && b0 <= 0xF4) {
        if (left < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 ||
            (s[3] & 0xC0) != 0x80)
            return 0;
        if (b0 == 0xF0 && s[1] < 0x90) return 0; /* overlong */
        if (b0 == 0xF4 && s[1] > 0x8F) return 0; /* past U+10FFFF */
        return 4;
    }
    return 0;
}

/* 1 for the bytes a string holds as they are: printable ASCII but '"' and '\\'. */
static unsigned char plain[256];

static void init_plain(void) {
    for (int ch = 0x20; ch < 0x80; ch++) plain[ch] = ch != '"' && ch != '\\';
}

/* A string at c->p (its opening quote). Sets *escaped when it holds an escape. */
static int scan_string(Cur *c, int *escaped) {
    const unsigned char *p = c->p + 1, *end = c->end;
    *escaped = 0;
    while (p < end) {
        while (p + 4 <= end && plain[p[0]] && plain[p[1]] && plain[p[2]] && plain[p[3]]) p += 4;
        while (p < end && plain[*p]) p++;
        if (p >= end) break;
        unsigned char ch = *p;
        if (ch == '"') {
            c->p = p + 1;
            return 0;
        }
        if (ch < 0x20) return -1;
        if (ch == '\\') {
            *escaped = 1;
            if (p + 1 >= end) return -1;
            unsigned char e = p[1];
            if (e == 'u') {
                unsigned v;
                if (end - p < 6 || hex4(p + 2, &v) < 0) return -1;
                if (v >= 0xD800 && v <= 0xDFFF) return -1; /* surrogates: the Python path's */
                p += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' ||
                       e == 'r' || e == 't') {
                p += 2;
            } else {
                return -1;
            }
        } else if (ch < 0x80) {
            p++;
        } else {
            int n = utf8_len(p, end);
            if (n == 0) return -1;
            p += n;
        }
    }
    return -1;
}

/* A number at c->p. Sets *integral when it has no fraction and no exponent. */
static int scan_number(Cur *c, int *integral) {
    const unsigned char *p = c->p, *end = c->end, *start = c->p;
    *integral = 1;
    if (p < end && *p == '-') p++;
    if (p >= end) return -1;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') p++;
    } else {
        return -1;
    }
    if (p < end && *p == '.') {
        *integral = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return -1;
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        *integral = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        const unsigned char *digits = p;
        while (p < end && *p >= '0' && *p <= '9') p++;
        if (p == digits || p - digits > 2) return -1; /* none, or a range orjson may refuse */
    }
    if (p - start > MAX_NUMBER) return -1;
    if (*integral && p - start > 18 + (*start == '-')) return -1; /* orjson: a float past i64 */
    c->p = p;
    return 0;
}

static int scan_value(Cur *c, int depth);

static int scan_literal(Cur *c, const char *word, Py_ssize_t n) {
    if (c->end - c->p < n || memcmp(c->p, word, (size_t)n) != 0) return -1;
    c->p += n;
    return 0;
}

/* Reads the value at c->p of member `index` (its name in `key`): 0, -1 (the Python path's),
 * -2 (a Python error is set). */
typedef int (*ValueReader)(Cur *c, const Member *key, int index, void *ctx, int depth);

/* No two members of one object with the same name (orjson keeps the last; this would see
 * the first): the caller takes the Python path. */
static int distinct(const Member *members, int n) {
    for (int i = 1; i < n; i++)
        for (int j = 0; j < i; j++)
            if (members[i].key_len == members[j].key_len &&
                memcmp(members[i].key, members[j].key, (size_t)members[i].key_len) == 0)
                return 0;
    return 1;
}

/* The object at c->p ('{'): at most MAX_MEMBERS members, names without escapes, no name
 * twice. With `members`, each member is recorded there; its value is read by `read` (NULL:
 * validated only). */
static int walk_object(Cur *c, int depth, Member *members, int *count, ValueReader read,
                       void *ctx) {
    /* Every object's names are checked, not only those this reads: the event keeps the
     * engine's bytes, and a repeated name there reaches the harness twice where the Python
     * path (orjson: the last) writes it once; a harness keeping the first would see a value
     * the record does not hold. */
    Member local[MAX_MEMBERS];
    if (members == NULL) members = local;
    int n = 0;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == '}') {
        c->p++;
        if (count) *count = 0;
        return 0;
    }
    for (;;) {
        if (c->p >= c->end || *c->p != '"') return -1;
        Member m;
        int escaped, rc;
        m.start = c->p;
        if (scan_string(c, &escaped) < 0) return -1;
        m.key = m.start + 1;
        m.key_len = (c->p - 1) - m.key;
        skip_ws(c);
        if (c->p >= c->end || *c->p != ':') return -1;
        c->p++;
        skip_ws(c);
        m.value = c->p;
        if (c->p >= c->end) return -1; /* the readers look at the value's first byte */
        if (escaped || n >= MAX_MEMBERS) return -1;
        rc = read != NULL ? read(c, &m, n, ctx, depth + 1) : scan_value(c, depth + 1);
        if (rc < 0) return rc;
        m.value_end = c->p;
        members[n] = m;
        n++;
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ',') {
            c->p++;
            skip_ws(c);
            continue;
        }
        if (*c->p != '}') return -1;
        c->p++;
        if (!distinct(members, n)) return -1;
        if (count) *count = n;
        return 0;
    }
}

/* Reads one element of an array at c->p (its first byte, c->p < c->end): 0, -1, -2. */
typedef int (*ItemReader)(Cur *c, void *ctx, int depth);

/* The array at c->p ('['), each element read by `read` (NULL: validated only). */
static int walk_array(Cur *c, int depth, ItemReader read, void *ctx) {
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == ']') {
        c->p++;
        return 0;
    }
    for (;;) {
        int rc;
        if (c->p >= c->end) return -1;
        rc = read != NULL ? read(c, ctx, depth + 1) : scan_value(c, depth + 1);
        if (rc < 0) return rc;
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ']') {
            c->p++;
            return 0;
        }
        if (*c->p != ',') return -1;
        c->p++;
        skip_ws(c);
    }
}

static int scan_value(Cur *c, int depth) {
    if (depth > MAX_DEPTH || c->p >= c->end) return -1;
    int flag;
    switch (*c->p) {
    case '{':
        return walk_object(c, depth, NULL, NULL, NULL, NULL);
    case '[':
        return walk_array(c, depth, NULL, NULL);
    case '"':
        return scan_string(c, &flag);
    case 't':
        return scan_literal(c, "true", 4);
    case 'f':
        return scan_literal(c, "false", 5);
    case 'n':
        return scan_literal(c, "null", 4);
    default:
        return scan_number(c, &flag);
    }
}

/* A growing list of Python objects: steals each reference it is given. */
typedef struct {
    PyObject *list;
} Out;

static int out_append(Out *o, PyObject *item) {
    if (item == NULL) return -2;
    int rc = PyList_Append(o->list, item);
    Py_DECREF(item);
    return rc < 0 ? -2 : 0;
}

static int out_start(Out *o) {
    if (o->list != NULL) return -1; /* a repeated member: the Python path's */
    o->list = PyList_New(0);
    return o->list == NULL ? -2 : 0;
}

static int is_null(const unsigned char *v, const unsigned char *end) {
    return end - v == 4 && memcmp(v, "null", 4) == 0;
}

static int key_is(const Member *m, const char *name) {
    size_t n = strlen(name);
    return (size_t)m->key_len == n && memcmp(m->key, name, n) == 0;
}

/* A number's value as orjson gives it: int for an integral number, else a finite float.
 * -1: not a number, or not finite. */
static int read_number(Cur *c, PyObject **out) {
    char buf[MAX_NUMBER + 1];
    const unsigned char *v = c->p;
    int integral;
    if (scan_number(c, &integral) < 0) return -1;
    size_t n = (size_t)(c->p - v);
    memcpy(buf, v, n);
    buf[n] = '\0';
    if (integral) {
        *out = PyLong_FromString(buf, NULL, 10);
        return *out == NULL ? -2 : 0;
    }
    double d = PyOS_string_to_double(buf, NULL, NULL);
    if (d == -1.0 && PyErr_Occurred()) return -2;
    if (!isfinite(d)) return -1;
    *out = PyFloat_FromDouble(d);
    return *out == NULL ? -2 : 0;
}

/* choices[0].token_ids: an array of integers from 0 to 2**31 - 1, or null. */
static int token_id_item(Cur *c, void *ctx, int depth) {
    (void)depth;
    long long id = 0;
    const unsigned char *digits = c->p;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        id = id * 10 + (*c->p - '0');
        if (id > 2147483647LL) return -1;
        c->p++;
    }
    if (c->p == digits || (*digits == '0' && c->p - digits > 1)) return -1;
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E')) return -1;
    return out_append(ctx, PyLong_FromLongLong(id));
}

/* null, or an array whose elements `item` reads into `o` (a member read twice: -1). */
static int read_list(Cur *c, Out *o, ItemReader item, int depth) {
    if (*c->p == 'n') return o->list != NULL ? -1 : scan_literal(c, "null", 4);
    if (*c->p != '[') return -1;
    int rc = out_start(o);
    return rc < 0 ? rc : walk_array(c, depth, item, o);
}

/* A logprobs.content entry's member: "logprob" read into *ctx (a PyObject *). */
static int entry_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    (void)index;
    PyObject **slot = ctx;
    if (!key_is(key, "logprob")) return scan_value(c, depth);
    if (*slot != NULL) return -1; /* repeated */
    if (*c->p == 'n') {
        if (scan_literal(c, "null", 4) < 0) return -1;
        *slot = Py_NewRef(Py_None);
        return 0;
    }
    return read_number(c, slot); /* a string, an object, ...: -1, the Python path's */
}

/* One entry of logprobs.content: its "logprob" (None when absent or null; None for an entry
 * that is not an object, as the assembler reads it). */
static int read_entry(Cur *c, void *ctx, int depth) {
    Member members[MAX_MEMBERS];
    PyObject *logprob = NULL;
    int n;
    if (*c->p != '{') {
        if (scan_value(c, depth) < 0) return -1;
        return out_append(ctx, Py_NewRef(Py_None));
    }
    int rc = walk_object(c, depth, members, &n, entry_member, &logprob);
    if (rc < 0) {
        Py_XDECREF(logprob);
        return rc;
    }
    return out_append(ctx, logprob != NULL ? logprob : Py_NewRef(Py_None));
}

/* A member of choices[0].logprobs: "content" (null or an array) read into *ctx (an Out). */
static int logprobs_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    (void)index;
    Out *o = ctx;
    if (!key_is(key, "content")) return scan_value(c, depth);
    return read_list(c, o, read_entry, depth);
}

/* choices[0].logprobs: null, or an object whose "content" is null or an array. */
static int read_logprobs(Cur *c, Out *o, int depth) {
    Member members[MAX_MEMBERS];
    int n;
    if (*c->p == 'n') return scan_literal(c, "null", 4);
    if (*c->p != '{') return -1;
    return walk_object(c, depth, members, &n, logprobs_member, o);
}

typedef struct {
    Member members[MAX_MEMBERS]; /* the choice's */
    int count;
    int token_ids; /* index of "token_ids" in members, -1 */
    int logprobs;  /* index of "logprobs", -1 */
    int delta;     /* index of "delta", -1 */
    int choices;   /* index of "choices" in the top level's members, -1 */
    int usage;     /* index of "usage" there, -1 */
    Out ids;
    Out lps;
} Chunk;

/* A member of choices[0]: none the Python path reads that this does not. */
static int choice_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    Chunk *k = ctx;
    const unsigned char *v = c->p;
    if (key_is(key, "logprobs")) {
        k->logprobs = index;
        return read_logprobs(c, &k->lps, depth);
    }
    if (key_is(key, "token_ids")) {
        k->token_ids = index;
        return read_list(c, &k->ids, token_id_item, depth);
    }
    if (key_is(key, "prompt_token_ids") || key_is(key, "routed_experts") ||
        key_is(key, "routed_experts_prompt_start"))
        return -1;
    if (scan_value(c, depth) < 0) return -1;
    if (key_is(key, "index")) {
        if (!(c->p - v == 1 && v[0] == '0')) return -1;
    } else if (key_is(key, "finish_reason")) {
        if (!is_null(v, c->p)) return -1; /* the last chunk: the Python path's */
    } else if (key_is(key, "delta")) {
        if (*v != '{' && !is_null(v, c->p)) return -1;
        k->delta = index;
    }
    return 0;
}

/* "choices": an array of exactly one object. */
static int read_choices(Cur *c, Chunk *k, int depth) {
    if (*c->p != '[') return -1;
    c->p++;
    skip_ws(c);
    if (c->p >= c->end || *c->p != '{') return -1;
    int rc = walk_object(c, depth + 1, k->members, &k->count, choice_member, k);
    if (rc < 0) return rc;
    skip_ws(c);
    if (c->p >= c->end || *c->p != ']') return -1; /* more than one choice */
    c->p++;
    return 0;
}

static int top_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    Chunk *k = ctx;
    const unsigned char *v = c->p;
    if (key_is(key, "choices")) {
        if (k->choices >= 0) return -1;
        k->choices = index;
        return read_choices(c, k, depth);
    }
    if (key_is(key, "prompt_token_ids") || key_is(key, "routed_experts") ||
        key_is(key, "prompt_routed_experts"))
        return -1;
    if (scan_value(c, depth) < 0) return -1;
    if (key_is(key, "usage")) {
        if (!is_null(v, c->p)) return -1; /* the usage chunk: the Python path's */
        k->usage = index;
    }
    return 0;
}

/* The chunk: one object, its "choices" read. */
static int read_chunk(const unsigned char *s, const unsigned char *end, Member *top, int *count,
                      Chunk *k) {
    Cur c = {s, end};
    k->choices = k->usage = k->token_ids = k->logprobs = k->delta = -1;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != '{') return -1;
    int rc = walk_object(&c, 0, top, count, top_member, k);
    if (rc < 0) return rc;
    skip_ws(&c);
    if (c.p != c.end || k->choices < 0) return -1;
    return 0;
}

static char *put(char *w, const void *src, Py_ssize_t n) {
    memcpy(w, src, (size_t)n);
    return w + n;
}

/* b"data: " + the chunk less the members cut + b"\n\n". */
static PyObject *event_bytes(const Member *top, int top_count, const Chunk *ch, long flags) {
    int choices = ch->choices, usage = ch->usage;
    int skip_usage = usage >= 0 && (flags & SCAN_DROP_USAGE);
    int skip_ids = ch->token_ids >= 0 && (flags & SCAN_STRIP_TOKEN_IDS);
    int null_lp = ch->logprobs >= 0 && (flags & SCAN_NULL_LOGPROBS);
    Py_ssize_t size = 6 + 2 + 2; /* "data: ", "{}", "\n\n" */
    for (int i = 0; i < top_count; i++) {
        if (i == usage && skip_usage) continue;
        if (i == choices) {
            size += (top[i].value - top[i].start) + 4; /* '"choices":' + "[{" "}]" */
            for (int j = 0; j < ch->count; j++) {
                const Member *m = &ch->members[j];
                if (j == ch->token_ids && skip_ids) continue;
                if (j == ch->logprobs && null_lp) size += (m->value - m->start) + 4 + 1;
                else size += (m->value_end - m->start) + 1;
            }
        } else {
            size += (top[i].value_end - top[i].start);
        }
        size += 1; /* a comma (one too many at most: trimmed below) */
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL) return NULL;
    char *base = PyBytes_AS_STRING(out), *w = base;
    w = put(w, "data: {", 7);
    int first = 1;
    for (int i = 0; i < top_count; i++) {
        if (i == usage && skip_usage) continue;
        if (!first) *w++ = ',';
        first = 0;
        if (i != choices) {
            w = put(w, top[i].start, top[i].value_end - top[i].start);
            continue;
        }
        w = put(w, top[i].start, top[i].value - top[i].start);
        w = put(w, "[{", 2);
        int inner_first = 1;
        for (int j = 0; j < ch->count; j++) {
            const Member *m = &ch->members[j];
            if (j == ch->token_ids && skip_ids) continue;
            if (!inner_first) *w++ = ',';
            inner_first = 0;
            if (j == ch->logprobs && null_lp) {
                w = put(w, m->start, m->value - m->start);
                w = put(w, "null", 4);
            } else {
                w = put(w, m->start, m->value_end - m->start);
            }
        }
        w = put(w, "}]", 2);
    }
    w = put(w, "}\n\n", 3);
    if (_PyBytes_Resize(&out, w - base) < 0) return NULL;
    return out;
}

static int delta_has_members(const unsigned char *v, const unsigned char *end) {
    if (*v != '{') return 0;
    v++;
    while (v < end && (*v == ' ' || *v == '\t' || *v == '\n' || *v == '\r')) v++;
    return v < end && *v != '}';
}

/* The text of the JSON string between `s` and `end` (its quotes excluded), already validated
 * by scan_string: escapes decoded (no surrogates: scan_string refused them), UTF-8 kept. */
static PyObject *string_text(const unsigned char *s, const unsigned char *end) {
    if (memchr(s, '\\', (size_t)(end - s)) == NULL)
        return PyUnicode_DecodeUTF8((const char *)s, end - s, "strict");
    char *buf = PyMem_Malloc((size_t)(end - s)); /* a decoded escape is never longer */
    if (buf == NULL) return PyErr_NoMemory();
    char *w = buf;
    while (s < end) {
        if (*s != '\\') {
            *w++ = (char)*s++;
            continue;
        }
        unsigned char e = s[1];
        if (e == 'u') {
            unsigned v = 0;
            hex4(s + 2, &v);
            if (v < 0x80) {
                *w++ = (char)v;
            } else if (v < 0x800) {
                *w++ = (char)(0xC0 | (v >> 6));
                *w++ = (char)(0x80 | (v & 0x3F));
            } else {
                *w++ = (char)(0xE0 | (v >> 12));
                *w++ = (char)(0x80 | ((v >> 6) & 0x3F));
                *w++ = (char)(0x80 | (v & 0x3F));
            }
            s += 6;
            continue;
        }
        *w++ = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r'
             : e == 't' ? '\t' : (char)e; /* '"', '\\', '/' */
        s += 2;
    }
    PyObject *text = PyUnicode_DecodeUTF8(buf, w - buf, "strict");
    PyMem_Free(buf);
    return text;
}

/* The text of a delta that is exactly {"content": <string>} (the most common per token);
 * NULL without an error set when the delta is anything else. */
static PyObject *content_only(const unsigned char *v, const unsigned char *end) {
    Cur c = {v + 1, end};
    int escaped;
    skip_ws(&c);
    if (c.end - c.p < 9 || memcmp(c.p, "\"content\"", 9) != 0) return NULL;
    c.p += 9;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != ':') return NULL;
    c.p++;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != '"') return NULL;
    const unsigned char *start = c.p + 1;
    if (scan_string(&c, &escaped) < 0) return NULL;
    const unsigned char *stop = c.p - 1;
    skip_ws(&c);
    if (c.p >= c.end || *c.p != '}') return NULL;
    return string_text(start, stop);
}

static PyObject *scan_chat_chunk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "scan_chat_chunk(data: bytes, flags: int)");
        return NULL;
    }
    long flags = PyLong_AsLong(args[1]);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *end = s + PyBytes_GET_SIZE(args[0]);
    /* A line break is JSON whitespace, but the event keeps the engine's bytes: one inside a
     * value the harness gets would end the event's data line there (an engine's JSON over
     * several `data:` lines arrives joined by "\n"). The Python path writes it on one line. */
    if (!(flags & SCAN_NO_EVENT) && (memchr(s, '\n', (size_t)(end - s)) != NULL ||
                                     memchr(s, '\r', (size_t)(end - s)) != NULL))
        return Py_NewRef(Py_None);
    Member top[MAX_MEMBERS];
    int top_count;
    Chunk k;
    PyObject *event = NULL, *delta = NULL, *content = NULL, *result = NULL;
    k.ids.list = k.lps.list = NULL;
    int rc = read_chunk(s, end, top, &top_count, &k);
    if (rc == -2) goto done; /* a Python error (memory) */
    if (rc < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (flags & SCAN_NO_EVENT) {
        event = Py_NewRef(Py_None);
    } else {
        event = event_bytes(top, top_count, &k, flags);
        if (event == NULL) goto done;
    }
    if (k.delta >= 0 && delta_has_members(k.members[k.delta].value, k.members[k.delta].value_end)) {
        const Member *m = &k.members[k.delta];
        content = content_only(m->value, m->value_end);
        if (content == NULL) {
            if (PyErr_Occurred()) goto done;
            delta = PyBytes_FromStringAndSize((const char *)m->value, m->value_end - m->value);
            if (delta == NULL) goto done;
        }
    }
    result = PyTuple_Pack(5, event, delta ? delta : Py_None, content ? content : Py_None,
                          k.ids.list ? k.ids.list : Py_None, k.lps.list ? k.lps.list : Py_None);
done:
    Py_XDECREF(event);
    Py_XDECREF(delta);
    Py_XDECREF(content);
    Py_XDECREF(k.ids.list);
    Py_XDECREF(k.lps.list);
    return result;
}

/* --- vLLM's completions stream (exact-token mode) --------------------------------------- */

/* What a middle chunk of vLLM's /v1/completions stream gives (engine_formats.Piece). */
typedef struct {
    PyObject *text; /* choices[0].text decoded; NULL: absent or null ("") */
    Out ids;        /* choices[0].token_ids */
    Out lps;        /* choices[0].logprobs.token_logprobs */
    Out tokens;     /* the ids of choices[0].logprobs.tokens ("token_id:<id>" each) */
    int choices;
} Completion;

/* logprobs.tokens as vLLM writes them with return_tokens_as_token_ids: an array of
 * "token_id:<id>" (ASCII digits, id < 2**31); anything else: -1 (the Python path's). */
static int token_string_item(Cur *c, void *ctx, int depth) {
    static const char prefix[] = "token_id:";
    const Py_ssize_t n = sizeof(prefix) - 1;
    const unsigned char *start = c->p;
    int escaped;
    long long id = 0;
    (void)depth;
    if (*c->p != '"' || scan_string(c, &escaped) < 0 || escaped) return -1;
    const unsigned char *d = start + 1 + n, *stop = c->p - 1;
    if (stop - (start + 1) <= n || memcmp(start + 1, prefix, (size_t)n) != 0) return -1;
    for (; d < stop; d++) {
        if (*d < '0' || *d > '9') return -1;
        id = id * 10 + (*d - '0');
        if (id > 2147483647LL) return -1;
    }
    return out_append(ctx, PyLong_FromLongLong(id));
}

/* A number or null of logprobs.token_logprobs (a string, an object, ...: -1). */
static int log_prob_item(Cur *c, void *ctx, int depth) {
    PyObject *value = NULL;
    int rc;
    (void)depth;
    if (*c->p == 'n') {
        if (scan_literal(c, "null", 4) < 0) return -1;
        return out_append(ctx, Py_NewRef(Py_None));
    }
    if ((rc = read_number(c, &value)) < 0) return rc;
    return out_append(ctx, value);
}

/* A member of choices[0].logprobs: "token_logprobs" (null, or an array of numbers and nulls)
 * read into the Completion's lps, "tokens" into its tokens; "text_offset", "top_logprobs"
 * validated only. */
static int completion_logprobs_member(Cur *c, const Member *key, int index, void *ctx,
                                      int depth) {
    (void)index;
    Completion *k = ctx;
    Out *o = &k->lps;
    if (key_is(key, "tokens")) return read_list(c, &k->tokens, token_string_item, depth);
    if (!key_is(key, "token_logprobs")) return scan_value(c, depth);
    return read_list(c, o, log_prob_item, depth);
}

/* A member of choices[0]: none the Python path reads that this does not. */
static int completion_choice_member(Cur *c, const Member *key, int index, void *ctx,
                                    int depth) {
    (void)index;
    Completion *k = ctx;
    const unsigned char *v = c->p;
    if (key_is(key, "token_ids")) return read_list(c, &k->ids, token_id_item, depth);
    if (key_is(key, "logprobs")) {
        Member members[MAX_MEMBERS];
        int n;
        if (*c->p == 'n') return scan_literal(c, "null", 4);
        if (*c->p != '{') return -1;
        return walk_object(c, depth, members, &n, completion_logprobs_member, k);
    }
    if (key_is(key, "text")) {
        int escaped;
        if (k->text != NULL) return -1; /* repeated */
        if (*c->p == 'n') return scan_literal(c, "null", 4);
        if (*c->p != '"' || scan_string(c, &escaped) < 0) return -1;
        k->text = string_text(v + 1, c->p - 1);
        return k->text == NULL ? -2 : 0;
    }
    if (scan_value(c, depth) < 0) return -1;
    if (key_is(key, "index")) {
        if (!(c->p - v == 1 && v[0] == '0')) return -1;
    } else if (key_is(key, "finish_reason") || key_is(key, "prompt_token_ids") ||
               key_is(key, "routed_experts")) {
        /* the last chunk, the first (vLLM writes these null in every other one) */
        if (!is_null(v, c->p)) return -1;
    }
    return 0;
}

static int completion_top_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    (void)index;
    Completion *k = ctx;
    const unsigned char *v = c->p;
    if (key_is(key, "choices")) {
        Member members[MAX_MEMBERS];
        int n, rc;
        k->choices++;
        if (*c->p != '[') return -1;
        c->p++;
        skip_ws(c);
        if (c->p >= c->end || *c->p != '{') return -1;
        rc = walk_object(c, depth + 1, members, &n, completion_choice_member, k);
        if (rc < 0) return rc;
        skip_ws(c);
        if (c->p >= c->end || *c->p != ']') return -1; /* more than one choice */
        c->p++;
        return 0;
    }
    if (scan_value(c, depth) < 0) return -1;
    if ((key_is(key, "usage") || key_is(key, "prompt_token_ids")) && !is_null(v, c->p))
        return -1; /* the usage chunk, the first */
    return 0;
}

/* scan_completions_chunk(data: bytes) -> (text, token_ids, log_probs) | None: a middle chunk
 * of vLLM's completions stream (vLLM 0.32 `text_completion`, compact JSON):
 *   {"id":...,"object":"text_completion","created":...,"model":...,"choices":[{"index":0,
 *    "text":" hi","logprobs":{"text_offset":[..],"token_logprobs":[-0.25],"tokens":[..],
 *    "top_logprobs":[..]},"finish_reason":null,"stop_reason":null,"token_ids":[1234]}],
 *    "usage":null}
 * text: str (choices[0].text; "" when absent or null); token_ids: list[int]
 * (choices[0].token_ids, else the ids of logprobs.tokens, "token_id:<id>" each as vLLM writes
 * them with return_tokens_as_token_ids); log_probs: list[float | int | None]
 * (logprobs.token_logprobs; None when absent or null). None, for the Python path
 * (engine_formats.VllmCompletionsReader), on the same grounds as scan_chat_chunk's, when
 * neither ids are there, and when a token is not of that form. */
static PyObject *scan_completions_chunk(PyObject *self, PyObject *data) {
    (void)self;
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "scan_completions_chunk(data: bytes)");
        return NULL;
    }
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(data);
    Cur c = {s, s + PyBytes_GET_SIZE(data)};
    Member top[MAX_MEMBERS];
    Completion k = {NULL, {NULL}, {NULL}, {NULL}, 0};
    PyObject *ids;
    PyObject *result = NULL;
    int n, rc = -1;
    skip_ws(&c);
    if (c.p < c.end && *c.p == '{') rc = walk_object(&c, 0, top, &n, completion_top_member, &k);
    if (rc == 0) {
        skip_ws(&c);
        if (c.p != c.end || k.choices != 1 || (k.ids.list == NULL && k.tokens.list == NULL))
            rc = -1;
    }
    if (rc == -2) goto done;
    if (rc < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (k.text == NULL && (k.text = PyUnicode_FromStringAndSize("", 0)) == NULL) goto done;
    ids = k.ids.list != NULL ? k.ids.list : k.tokens.list; /* token_ids first, as the reader */
    result = PyTuple_Pack(3, k.text, ids, k.lps.list ? k.lps.list : Py_None);
done:
    Py_XDECREF(k.text);
    Py_XDECREF(k.ids.list);
    Py_XDECREF(k.lps.list);
    Py_XDECREF(k.tokens.list);
    return result;
}

/* take_prompt_ids(data): the prompt ids of a whole engine answer, as their uint32 array.
 *
 * A vLLM chat answer (or a stream's first chunk) asked with return_token_ids carries the whole
 * prompt's ids as a top-level "prompt_token_ids" array: thousands of integers on an agent's
 * call, which orjson would make Python ints of and the assembler an array of again. This
 * reads them straight into their array, in one pass that also validates the whole body as
 * strict JSON (the same rules as the scans above), and gives back the body with that value
 * written as null, for orjson to parse the rest. Returns (rest, ids): rest bytes; ids a
 * bytearray of native uint32 (numpy.frombuffer(ids, numpy.uint32): [num_prompt_tokens]).
 * None, for the Python path, when the body is not one object read exactly as orjson reads it
 * (see the module's first comment), when it has no top-level "prompt_token_ids" array, and
 * when an element is not a plain integer from 0 to 2**32 - 1 (the assembler names it).
 * Raises only MemoryError. */

typedef struct {
    uint32_t *ids;
    Py_ssize_t n, cap;
    const unsigned char *start, *end; /* the array's span in the body */
} PromptIds;

/* Room for one more id (the buffer doubled: 1,024 ids first). 0, or -2 with MemoryError. */
static int grow_prompt_ids(PromptIds *pr) {
    if (pr->cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_NoMemory(); /* (a size past any allocation: refused before it could wrap) */
        return -2;
    }
    Py_ssize_t cap = pr->cap ? pr->cap * 2 : 1024;
    uint32_t *grown = PyMem_Realloc(pr->ids, (size_t)cap * sizeof(uint32_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -2;
    }
    pr->ids = grown;
    pr->cap = cap;
    return 0;
}

#define IS_WS(ch) ((ch) == ' ' || (ch) == '\t' || (ch) == '\n' || (ch) == '\r')

/* The prompt ids' array at c->p ('['): what walk_array(c, depth, <an item reader>, pr) does
 * with an item reader that takes a plain integer from 0 to 2**32 - 1 (at most 10 digits, no
 * leading zero, no fraction or exponent after it) and refuses anything else, in one loop over
 * a local cursor (the per-item call, the cursor kept in memory and the bound checked at every
 * byte cost more than half of the work on an agent's prompt of thousands of ids). The bytes
 * must be a bytes object's whole buffer: its end is never compared, as every loop stops and
 * every test fails at the NUL each bytes object ends with (not a digit, a space, a comma or
 * a bracket), so none reads past it. 0 with c->p after the array; -1 refused (the cursor
 * left anywhere); -2 error (MemoryError). */
static int read_prompt_ids(Cur *c, PromptIds *pr) {
    const unsigned char *p = c->p + 1;
    while (IS_WS(*p)) p++;
    if (*p == ']') {
        c->p = p + 1;
        return 0;
    }
    for (;;) {
        const unsigned char *digits = p;
        uint64_t id = 0;
        while ((unsigned)(*p - '0') <= 9u) {
            id = id * 10 + (uint64_t)(*p - '0');
            p++;
        }
        Py_ssize_t len = p - digits;
        /* (past 10 digits id may have wrapped: refused by its length first) */
        if (len == 0 || len > 10 || (*digits == '0' && len > 1) || id > 0xFFFFFFFFu) return -1;
        if (*p == '.' || *p == 'e' || *p == 'E') return -1;
        if (pr->n == pr->cap && grow_prompt_ids(pr) < 0) return -2;
        pr->ids[pr->n++] = (uint32_t)id;
        while (IS_WS(*p)) p++;
        if (*p == ']') {
            c->p = p + 1;
            return 0;
        }
        if (*p != ',') return -1;
        p++;
        while (IS_WS(*p)) p++;
    }
}

static int prompt_top_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    (void)index;
    PromptIds *pr = ctx;
    if (!key_is(key, "prompt_token_ids") || *c->p != '[') return scan_value(c, depth);
    (void)depth; /* (its items are ids, whatever the depth) */
    pr->start = c->p;
    int rc = read_prompt_ids(c, pr);
    pr->end = c->p;
    return rc;
}

static PyObject *take_prompt_ids(PyObject *self, PyObject *data) {
    (void)self;
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "take_prompt_ids(data: bytes)");
        return NULL;
    }
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    /* read_prompt_ids stops at this NUL (every bytes object, subclasses too, ends with one) */
    assert(s[len] == '\0');
    Cur c = {s, s + len};
    PromptIds pr = {NULL, 0, 0, NULL, NULL};
    PyObject *rest = NULL, *ids = NULL, *result = NULL;
    int rc = -1;
    skip_ws(&c);
    if (c.p < c.end && *c.p == '{') rc = walk_object(&c, 0, NULL, NULL, prompt_top_member, &pr);
    if (rc == 0) {
        skip_ws(&c);
        if (c.p != c.end || pr.start == NULL) rc = -1;
    }
    if (rc == -2) goto done;
    if (rc < 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t head = pr.start - s, tail = (s + len) - pr.end;
    rest = PyBytes_FromStringAndSize(NULL, head + 4 + tail);
    if (rest == NULL) goto done;
    char *w = PyBytes_AS_STRING(rest);
    w = put(w, s, head);
    w = put(w, "null", 4);
    put(w, pr.end, tail);
    ids = PyByteArray_FromStringAndSize((const char *)pr.ids, pr.n * (Py_ssize_t)sizeof(uint32_t));
    if (ids == NULL) goto done;
    result = PyTuple_Pack(2, rest, ids);
done:
    PyMem_Free(pr.ids);
    Py_XDECREF(rest);
    Py_XDECREF(ids);
    return result;
}

/* --- a request's history array: where its elements end ------------------------------- */

/* What scan_history reads: the member named `name` (`name_len` bytes) of the top-level object,
 * an array; from element `skip_count` on (the cursor put at `skip_to`, the end of element
 * skip_count - 1, when skip_count > 0), each element's end offset appended to `ends`; stopped
 * (-3) once `stop_after` elements (all counted) are read, when stop_after > 0. */
typedef struct {
    const unsigned char *s;
    const char *name;
    Py_ssize_t name_len;
    Py_ssize_t skip_to, skip_count, stop_after;
    PyObject *ends;
    Py_ssize_t array_open, array_close;
} History;

#define HISTORY_STOPPED (-3)

static int history_end(History *h, const unsigned char *at) {
    PyObject *offset = PyLong_FromSsize_t(at - h->s);
    if (offset == NULL) return -2;
    int rc = PyList_Append(h->ends, offset);
    Py_DECREF(offset);
    return rc < 0 ? -2 : 0;
}

/* The history array at c->p ('['): walk_array's reading, each element validated by
 * scan_value and its end recorded. */
static int read_history(Cur *c, History *h, int depth) {
    Py_ssize_t count = 0;
    h->array_open = c->p - h->s;
    c->p++;
    if (h->skip_count > 0) {
        if (h->skip_to <= h->array_open) return -1; /* not inside this array */
        c->p = h->s + h->skip_to; /* (at most the data's length: checked by scan_history) */
        count = h->skip_count;
    } else {
        skip_ws(c);
        if (c->p < c->end && *c->p == ']') {
            h->array_close = c->p - h->s;
            c->p++;
            return 0;
        }
        int rc = scan_value(c, depth + 1);
        if (rc < 0) return rc;
        count = 1;
        if (history_end(h, c->p) < 0) return -2;
    }
    for (;;) {
        if (h->stop_after > 0 && count >= h->stop_after) return HISTORY_STOPPED;
        skip_ws(c);
        if (c->p >= c->end) return -1;
        if (*c->p == ']') {
            h->array_close = c->p - h->s;
            c->p++;
            return 0;
        }
        if (*c->p != ',') return -1;
        c->p++;
        skip_ws(c);
        int rc = scan_value(c, depth + 1);
        if (rc < 0) return rc;
        count++;
        if (history_end(h, c->p) < 0) return -2;
    }
}

static int history_top_member(Cur *c, const Member *key, int index, void *ctx, int depth) {
    (void)index;
    History *h = ctx;
    if ((size_t)key->key_len != (size_t)h->name_len ||
        memcmp(key->key, h->name, (size_t)h->name_len) != 0)
        return scan_value(c, depth);
    if (*c->p != '[' || h->array_open >= 0) return -1; /* not an array; or a repeated name */
    return read_history(c, h, depth);
}

/* scan_history(data, name, skip_to, skip_count, stop_after) -> (ends, array_close) | None:
 * the end offset of each element read, and the offset of the array's ']' (-1 when stopped).
 * See chunk_scan.py and known_bodies.py. */
static PyObject *scan_history(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "scan_history(data: bytes, name: bytes, skip_to: int, skip_count: int, "
                        "stop_after: int)");
        return NULL;
    }
    History h;
    h.s = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    Py_ssize_t len = PyBytes_GET_SIZE(args[0]);
    h.name = PyBytes_AS_STRING(args[1]);
    h.name_len = PyBytes_GET_SIZE(args[1]);
    h.skip_to = PyLong_AsSsize_t(args[2]);
    h.skip_count = PyLong_AsSsize_t(args[3]);
    h.stop_after = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (h.skip_count < 0 || (h.skip_count > 0 && (h.skip_to < 1 || h.skip_to > len))) {
        PyErr_SetString(PyExc_ValueError, "scan_history: skip_to out of the data");
        return NULL;
    }
    h.array_open = h.array_close = -1;
    h.ends = PyList_New(0);
    if (h.ends == NULL) return NULL;
    Cur c = {h.s, h.s + len};
    int rc = -1;
    skip_ws(&c);
    if (c.p < c.end && *c.p == '{') rc = walk_object(&c, 0, NULL, NULL, history_top_member, &h);
    if (rc == 0) {
        skip_ws(&c);
        if (c.p != c.end || h.array_open < 0) rc = -1;
    } else if (rc == HISTORY_STOPPED) {
        rc = 0; /* stop_after elements read: the rest is not looked at */
    }
    if (rc < 0) {
        Py_DECREF(h.ends);
        if (rc == -2) return NULL;
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(Nn)", h.ends, h.array_close);
}

/* common_prefix(a, b) -> the length of the longest prefix the two bytes objects share. */
static PyObject *common_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "common_prefix(a: bytes, b: bytes)");
        return NULL;
    }
    const unsigned char *a = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]), m = PyBytes_GET_SIZE(args[1]);
    if (m < n) n = m;
    Py_ssize_t i = 0;
    /* whole 4 KB pages by memcmp (the libc's vector compare), then byte by byte */
    while (i + 4096 <= n && memcmp(a + i, b + i, 4096) == 0) i += 4096;
    while (i < n && a[i] == b[i]) i++;
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"scan_chat_chunk", (PyCFunction)(void (*)(void))scan_chat_chunk, METH_FASTCALL,
     "scan_chat_chunk(data: bytes, flags: int) -> (event, delta, content, token_ids, log_probs) | None"},
    {"scan_completions_chunk", scan_completions_chunk, METH_O,
     "scan_completions_chunk(data: bytes) -> (text, token_ids, log_probs) | None"},
    {"take_prompt_ids", take_prompt_ids, METH_O,
     "take_prompt_ids(data: bytes) -> (rest: bytes, ids: bytearray of uint32) | None"},
    {"common_prefix", (PyCFunction)(void (*)(void))common_prefix, METH_FASTCALL,
     "common_prefix(a: bytes, b: bytes) -> int"},
    {"scan_history", (PyCFunction)(void (*)(void))scan_history, METH_FASTCALL,
     "scan_history(data, name, skip_to, skip_count, stop_after) -> (ends, array_close) | None"},
    {NULL, NULL, 0, NULL},
};

#ifndef CHUNKSCAN_SOURCE_SHA256
#define CHUNKSCAN_SOURCE_SHA256 "" /* built without setup.py: not checked against the source */
#endif

static int exec_module(PyObject *m) {
    init_plain();
    if (PyModule_AddStringConstant(m, "SOURCE_SHA256", CHUNKSCAN_SOURCE_SHA256) < 0) return -1;
    if (PyModule_AddIntConstant(m, "SCAN_STRIP_TOKEN_IDS", SCAN_STRIP_TOKEN_IDS) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_NULL_LOGPROBS", SCAN_NULL_LOGPROBS) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_DROP_USAGE", SCAN_DROP_USAGE) < 0 ||
        PyModule_AddIntConstant(m, "SCAN_NO_EVENT", SCAN_NO_EVENT) < 0)
        return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chunkscan",
    "The per-event scan of a streamed chat chunk in compiled code (see the C source).", 0,
    methods, slots, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__chunkscan(void) { return PyModuleDef_Init(&module); }
