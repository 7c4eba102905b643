/* BuildChunk's common case in one compiled call: request wire bytes in, response wire bytes out.
 *
 * Why: on a small or medium batch the Python request path (parse, validate, a dozen numpy calls, encode,
 * metrics) costs more server CPU than gRPC itself (docs/performance.md). This file does the same work for
 * the requests schedulers send all day (well-formed, within the limits, no DCP) without a Python object per
 * step, and writes the arrays straight into the response bytes.
 *
 * It never answers differently from the Python path: it answers only what it can prove valid and otherwise
 * returns None, and service/dataplane.py then serves the request the general way, which owns every error
 * message, DCP, PlanBatch, and anything unusual on the wire (unknown or repeated fields). The formulas are
 * kernels/inputs.py (host part) and kernels/numpy_backend.py (arrays) for DCP off; the limits come from Python
 * (service/compute/fastpath.py FastPathLimits, built by service/overload/limits.py fast_path_limits); the field
 * numbers, tags and types come from the proto through the generated header below; the layout is the one
 * service/codec.py derives from the message descriptors.
 * tests/service/test_fastpath.py holds the three to each other byte for byte, on the golden cases, on every
 * limit at and one past its boundary, and on hypothesis-generated requests, valid and not;
 * tests/service/test_compiled_sanitized.py runs those tests again against an ASan + UBSan build of this file.
 *
 * One call: parse (wire bytes to Request), check (Request to Chunk, or step aside), size and write (Chunk to
 * the response's bytes, the same emit code run twice: counting, then writing, bounds-checked), then the arrays.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Every message's field numbers, tags and types, generated from protos/indexer/v1/indexer.proto by
 * `python -m indexer_service.protos.generate` (the command that generates the Python code;
 * tests/service/test_protos.py checks it is fresh). No field number is written by hand in this file. */
#include "../../protos/indexer/v1/indexer_wire.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wire arrays are little-endian int32 and are copied here as host integers"
#endif

/* What this file assumes of the proto, checked as it compiles: a field retyped or reordered, or one added to a
 * message this file writes, stops the build here instead of answering with other bytes than service/codec.py's.
 * A field added to BuildChunkRequest needs nothing: on the wire its tag is unknown here, and the general path
 * serves the request. */
#define EXPECT_TYPE(field, type) _Static_assert(field##_TYPE == PB_TYPE_##type, #field " is not " #type)
EXPECT_TYPE(BUILD_CHUNK_REQUEST_QUERY_START_LOC, BYTES);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_SEQ_LENS, BYTES);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_COMPRESS_RATIO, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_REQ_START, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_REQ_END, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_QUERY_SLICE, MESSAGE);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_SKIP_KV_GATHER, BOOL);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_DCP_RANK, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_DCP_WORLD_SIZE, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_DCP_INTERLEAVE, INT32);
EXPECT_TYPE(BUILD_CHUNK_REQUEST_OMIT_TOKEN_TO_SEQ, BOOL);
EXPECT_TYPE(QUERY_SLICE_START, INT32);
EXPECT_TYPE(QUERY_SLICE_STOP, INT32);
EXPECT_TYPE(BUILD_CHUNK_RESPONSE_METADATA, MESSAGE);
EXPECT_TYPE(CHUNK_METADATA_CU_SEQ_LENS, BYTES);
EXPECT_TYPE(CHUNK_METADATA_TOKEN_TO_SEQ, BYTES);
EXPECT_TYPE(CHUNK_METADATA_CU_SEQLEN_KS, BYTES);
EXPECT_TYPE(CHUNK_METADATA_CU_SEQLEN_KE, BYTES);
EXPECT_TYPE(CHUNK_METADATA_TOTAL_SEQ_LENS, INT64);
EXPECT_TYPE(CHUNK_METADATA_TOKEN_START, INT64);
EXPECT_TYPE(CHUNK_METADATA_TOKEN_END, INT64);
EXPECT_TYPE(CHUNK_METADATA_NUM_REQS, INT32);
EXPECT_TYPE(CHUNK_METADATA_SKIP_KV_GATHER, BOOL);
EXPECT_TYPE(CHUNK_METADATA_LOCAL_CU_SEQ_LENS, BYTES);
EXPECT_TYPE(CHUNK_METADATA_LOCAL_TOTAL_SEQ_LENS, INT64);
EXPECT_TYPE(CHUNK_METADATA_MAX_LOCAL_TOTAL_SEQ_LENS, INT64);
EXPECT_TYPE(CHUNK_METADATA_REQ_START, INT32);
EXPECT_TYPE(CHUNK_METADATA_REQ_END, INT32);
EXPECT_TYPE(CHUNK_METADATA_QUERY_SLICE, MESSAGE);
EXPECT_TYPE(CHUNK_METADATA_TOKEN_TO_SEQ_OMITTED, BOOL);
_Static_assert(CHUNK_METADATA_FIELD_COUNT == 16, "ChunkMetadata has a field emit_metadata does not write");
#define IN_ORDER(a, b, c, d) (CHUNK_METADATA_##a < CHUNK_METADATA_##b && CHUNK_METADATA_##b < CHUNK_METADATA_##c && \
                              CHUNK_METADATA_##c < CHUNK_METADATA_##d)
_Static_assert(IN_ORDER(CU_SEQ_LENS, TOKEN_TO_SEQ, CU_SEQLEN_KS, CU_SEQLEN_KE) &&
                   IN_ORDER(CU_SEQLEN_KE, TOTAL_SEQ_LENS, TOKEN_START, TOKEN_END) &&
                   IN_ORDER(TOKEN_END, NUM_REQS, SKIP_KV_GATHER, LOCAL_CU_SEQ_LENS) &&
                   IN_ORDER(LOCAL_CU_SEQ_LENS, LOCAL_TOTAL_SEQ_LENS, MAX_LOCAL_TOTAL_SEQ_LENS, REQ_START) &&
                   IN_ORDER(REQ_START, REQ_END, QUERY_SLICE, TOKEN_TO_SEQ_OMITTED) &&
                   QUERY_SLICE_START < QUERY_SLICE_STOP,
               "emit_metadata and emit_query_slice write the fields in number order, as protobuf does");
_Static_assert(QUERY_SLICE_FIELD_COUNT == 2, "QuerySlice has a field emit_query_slice does not write");
_Static_assert(BUILD_CHUNK_RESPONSE_FIELD_COUNT == 1, "BuildChunkResponse has a field this file does not write");
_Static_assert(BUILD_CHUNK_REQUEST_MAX_FIELD < 32 && QUERY_SLICE_MAX_FIELD < 32, "a seen mask has 32 bits");

/* An element of the wire arrays: little-endian int32 (the proto's wire conventions). */
#define I32_BYTES ((Py_ssize_t)sizeof(int32_t))
/* Above this many int32 written, the GIL is released while writing: other calls' Python goes on meanwhile.
 * Below it, releasing would cost more than the work (a contended GIL is re-acquired only at a switch). A speed
 * setting, not a check: every answer is the same either way. */
#define RELEASE_GIL_ELEMENTS 65536

/* service/compute/fastpath.py FastPathLimits: every limit this file checks against comes from there. */
typedef struct {
    long long max_num_seqs, max_num_batched_tokens, max_model_len, workspace_tokens, max_message_bytes,
        chunk_overhead_bytes;
} Limits;

/* The limits object's fields, read by name (attributes of the NamedTuple), not by position: the Python class is
 * their one definition. The module exports the names as `limit_fields`, which a test holds equal to its fields. */
static const struct {
    const char *name;
    size_t offset;
} LIMIT_FIELDS[] = {
    {"max_num_seqs", offsetof(Limits, max_num_seqs)},
    {"max_num_batched_tokens", offsetof(Limits, max_num_batched_tokens)},
    {"max_model_len", offsetof(Limits, max_model_len)},
    {"workspace_tokens", offsetof(Limits, workspace_tokens)},
    {"max_message_bytes", offsetof(Limits, max_message_bytes)},
    {"chunk_overhead_bytes", offsetof(Limits, chunk_overhead_bytes)},
};
#define NUM_LIMIT_FIELDS (sizeof LIMIT_FIELDS / sizeof LIMIT_FIELDS[0])
/* The names as interned strings, made once at import: a lookup per call then hashes nothing. */
static PyObject *limit_names[NUM_LIMIT_FIELDS];

/* The last limits object read and what it held: the data plane passes the same FastPathLimits on every call, so its
 * six attributes are read once, not per call (docs/performance.md). Only a tuple (a NamedTuple) is remembered: its
 * fields cannot change; any other object is read each time. Under the GIL, as every call here. */
static PyObject *last_limits;
static Limits last_lim;

static int read_limits(PyObject *limits, Limits *lim) {
    if (limits == last_limits) {
        *lim = last_lim;
        return 0;
    }
    for (size_t i = 0; i < NUM_LIMIT_FIELDS; i++) {
        PyObject *value = PyObject_GetAttr(limits, limit_names[i]);
        if (!value) return -1;
        long long number = PyLong_AsLongLong(value);
        Py_DECREF(value);
        if (number == -1 && PyErr_Occurred()) return -1;
        *(long long *)((char *)lim + LIMIT_FIELDS[i].offset) = number;
    }
    if (PyTuple_Check(limits)) {
        Py_INCREF(limits);
        Py_XSETREF(last_limits, limits);
        last_lim = *lim;
    }
    return 0;
}

/* A BuildChunkRequest as parsed: the arrays stay in the caller's buffer. */
typedef struct {
    const uint8_t *qsl, *seq; /* little-endian int32 arrays, possibly unaligned */
    Py_ssize_t qsl_bytes, seq_bytes;
    int64_t ratio, req_start, req_end, slice_start, slice_stop, dcp_rank, dcp_world_size, dcp_interleave;
    int has_slice, skip_kv_gather, omit_token_to_seq;
    uint32_t seen; /* bit n: field n was on the wire */
} Request;

/* A request the checks passed: what the response says, all of it proven in range. */
typedef struct {
    const Request *r;
    Py_ssize_t reqs;               /* requests in the chunk: req_end - req_start */
    int64_t ratio;                 /* the compress ratio, 0 normalised to 1 */
    int64_t total;                 /* compressed tokens of the chunk, <= INT32_MAX */
    int64_t base;                  /* absolute index of the chunk's first query token */
    int64_t rows_start, rows_stop; /* the chunk-local query rows [start, stop) */
    int skip_kv_gather;            /* the request's, or the slice starts after row 0 */
} Chunk;

static inline int64_t load_i32(const uint8_t *array, Py_ssize_t i) {
    int32_t value;
    memcpy(&value, array + I32_BYTES * i, sizeof value);
    return value;
}

static inline void store_i32(uint8_t *array, Py_ssize_t i, int64_t value) {
    int32_t narrow = (int32_t)value;
    memcpy(array + I32_BYTES * i, &narrow, sizeof narrow);
}

/* ---- parse: wire bytes to a Request; -1 for anything the general path should look at ------------------- */

static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*p >= end) return -1;
        uint8_t byte = *(*p)++;
        if (shift == 63 && byte > 1) return -1; /* more than 64 bits */
        value |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 0;
        }
    }
    return -1;
}

/* An int32 field's value; a varint that protobuf would truncate to fit is left to the general path. */
static int read_int32(const uint8_t **p, const uint8_t *end, int64_t *out) {
    uint64_t raw;
    if (read_varint(p, end, &raw)) return -1;
    int64_t value = (int64_t)raw;
    if (value < INT32_MIN || value > INT32_MAX) return -1;
    *out = value;
    return 0;
}

/* A bool field: protobuf reads any non-zero varint as true; only the canonical 0 and 1 are taken here. */
static int read_bool(const uint8_t **p, const uint8_t *end, int *out) {
    uint64_t raw;
    if (read_varint(p, end, &raw) || raw > 1) return -1;
    *out = (int)raw;
    return 0;
}

/* A length-delimited field's bytes, in place: [*at, *at + *length). */
static int read_bytes(const uint8_t **p, const uint8_t *end, const uint8_t **at, Py_ssize_t *length) {
    uint64_t raw;
    if (read_varint(p, end, &raw) || raw > (uint64_t)(end - *p)) return -1;
    *at = *p, *length = (Py_ssize_t)raw;
    *p += raw;
    return 0;
}

/* Protobuf keeps the last of a repeated scalar and merges repeated messages: both are the general path's. */
static int mark_seen(uint32_t *seen, uint64_t tag) {
    uint64_t field = tag >> 3;
    if (field >= 32 || (*seen & (UINT32_C(1) << field))) return -1;
    *seen |= UINT32_C(1) << field;
    return 0;
}

/* BuildChunkRequest.query_slice: a QuerySlice, each field at most once, nothing else. */
static int read_query_slice(const uint8_t **p, const uint8_t *end, Request *r) {
    const uint8_t *body, *stop;
    Py_ssize_t length;
    uint32_t seen = 0;
    if (read_bytes(p, end, &body, &length)) return -1;
    for (stop = body + length; body < stop;) {
        uint64_t tag;
        if (read_varint(&body, stop, &tag) || mark_seen(&seen, tag)) return -1;
        int64_t *into = tag == QUERY_SLICE_START_TAG ? &r->slice_start
                        : tag == QUERY_SLICE_STOP_TAG ? &r->slice_stop
                                                      : NULL;
        if (!into || read_int32(&body, stop, into)) return -1;
    }
    r->has_slice = 1;
    return 0;
}

/* BuildChunkRequest: each known field at most once, with its declared wire type (the generated tag holds both);
 * any other tag is the general path's. */
static int parse_request(const uint8_t *p, const uint8_t *end, Request *r) {
    while (p < end) {
        uint64_t tag;
        int rc;
        if (read_varint(&p, end, &tag) || mark_seen(&r->seen, tag)) return -1;
        switch (tag) {
        case BUILD_CHUNK_REQUEST_QUERY_START_LOC_TAG: rc = read_bytes(&p, end, &r->qsl, &r->qsl_bytes); break;
        case BUILD_CHUNK_REQUEST_SEQ_LENS_TAG: rc = read_bytes(&p, end, &r->seq, &r->seq_bytes); break;
        case BUILD_CHUNK_REQUEST_COMPRESS_RATIO_TAG: rc = read_int32(&p, end, &r->ratio); break;
        case BUILD_CHUNK_REQUEST_REQ_START_TAG: rc = read_int32(&p, end, &r->req_start); break;
        case BUILD_CHUNK_REQUEST_REQ_END_TAG: rc = read_int32(&p, end, &r->req_end); break;
        case BUILD_CHUNK_REQUEST_QUERY_SLICE_TAG: rc = read_query_slice(&p, end, r); break;
        case BUILD_CHUNK_REQUEST_SKIP_KV_GATHER_TAG: rc = read_bool(&p, end, &r->skip_kv_gather); break;
        case BUILD_CHUNK_REQUEST_DCP_RANK_TAG: rc = read_int32(&p, end, &r->dcp_rank); break;
        case BUILD_CHUNK_REQUEST_DCP_WORLD_SIZE_TAG: rc = read_int32(&p, end, &r->dcp_world_size); break;
        case BUILD_CHUNK_REQUEST_DCP_INTERLEAVE_TAG: rc = read_int32(&p, end, &r->dcp_interleave); break;
        case BUILD_CHUNK_REQUEST_OMIT_TOKEN_TO_SEQ_TAG: rc = read_bool(&p, end, &r->omit_token_to_seq); break;
        default: return -1;
        }
        if (rc) return -1;
    }
    return 0;
}

/* ---- check: 0 to serve here, 1 to step aside (the general path then says what is wrong), -1 on a Python error */

/* The whole batch: kernels.inputs.validate_batch, then the server's limits (service/overload/limits.py,
 * RequestLimits.check_request). int32 elements cannot exceed int32, and a non-negative query length with
 * seq_len >= it makes seq_len >= 0. */
static int check_batch(const Request *r, const Limits *lim, Py_ssize_t *batch) {
    if (r->qsl_bytes % I32_BYTES || r->seq_bytes % I32_BYTES || r->qsl_bytes == 0) return 1;
    *batch = r->seq_bytes / I32_BYTES;
    if (*batch != r->qsl_bytes / I32_BYTES - 1 || *batch > lim->max_num_seqs) return 1;
    if (load_i32(r->qsl, 0) != 0) return 1;
    for (Py_ssize_t i = 0; i < *batch; i++) {
        int64_t q0 = load_i32(r->qsl, i), q1 = load_i32(r->qsl, i + 1), s = load_i32(r->seq, i);
        if (q1 < q0 || q1 > lim->max_num_batched_tokens || s < q1 - q0 || s > lim->max_model_len) return 1;
    }
    return 0;
}

/* Strict mode's policy: the normalised ratio must be one the warmup compiled (None: any). */
static int check_admitted(PyObject *admitted, int64_t ratio) {
    if (admitted == Py_None) return 0;
    PyObject *key = PyLong_FromLongLong(ratio);
    if (!key) return -1;
    int found = PySequence_Contains(admitted, key);
    Py_DECREF(key);
    return found < 0 ? -1 : !found;
}

/* The chunk: kernels.inputs._chunk_host_part with DCP off (DCP is the general path's), and the policy. */
static int check_chunk(const Request *r, Py_ssize_t batch, PyObject *admitted, Chunk *c) {
    if (r->ratio < 0 || r->dcp_rank != 0 || r->dcp_world_size != 1 || r->dcp_interleave != 1) return 1;
    c->r = r;
    c->ratio = r->ratio > 1 ? r->ratio : 1; /* kernels.specialization.normalize_compress_ratio: 0 means 1 */
    int policy = check_admitted(admitted, c->ratio);
    if (policy) return policy;
    if (r->req_start < 0 || r->req_start > batch || r->req_end < r->req_start || r->req_end > batch) return 1;
    c->reqs = (Py_ssize_t)(r->req_end - r->req_start);
    c->total = 0;
    for (Py_ssize_t i = 0; i < c->reqs; i++) c->total += load_i32(r->seq, r->req_start + i) / c->ratio;
    if (c->total > INT32_MAX) return 1; /* the arrays hold int32 */
    c->base = load_i32(r->qsl, r->req_start);
    int64_t queries = load_i32(r->qsl, r->req_end) - c->base;
    c->rows_start = r->has_slice ? r->slice_start : 0;
    c->rows_stop = r->has_slice ? r->slice_stop : queries;
    if (c->rows_start < 0 || c->rows_start > queries || c->rows_stop < c->rows_start || c->rows_stop > queries)
        return 1;
    c->skip_kv_gather = r->skip_kv_gather || (r->has_slice && c->rows_start > 0);
    return 0;
}

/* The limits on the answer (RequestLimits.check_sizes): the KV workspace, then the estimate of the response's
 * bytes against max_message_bytes (here the fast path's reserve, which the data plane passes in its place). */
static int64_t response_estimate(const Chunk *c, const Limits *lim) {
    int64_t estimate = lim->chunk_overhead_bytes;
    if (c->total > 0) {
        int64_t rows = c->rows_stop - c->rows_start;
        estimate += 2 * I32_BYTES * rows + 2 * I32_BYTES * (int64_t)(c->reqs + 1) +
                    (c->r->omit_token_to_seq ? 0 : I32_BYTES * c->total);
    }
    return estimate;
}

static int check_response(const Chunk *c, const Limits *lim) {
    if (c->total > 0 && c->total > lim->workspace_tokens / c->ratio) return 1;
    return response_estimate(c, lim) > lim->max_message_bytes;
}

/* ---- size and write: one emit code, run counting and then writing -------------------------------------- */

/* Where emitted bytes go. Counting (pos == NULL): only `count` grows, the size pass. Writing: into [pos, end),
 * the write pass; a write that does not fit writes nothing and sets `overrun`, for good. The size of the bytes
 * object comes from the counting run of the very code that then writes it, and should the two still disagree
 * (a bug), the bounds make it an exception instead of a write past the object. */
typedef struct {
    uint8_t *pos, *end;
    Py_ssize_t count; /* bytes emitted so far, fitting or not */
    int overrun;
} Writer;

#define COUNTING ((Writer){NULL, NULL, 0, 0})

/* Room for n bytes: where to write them, or NULL when counting or when they do not fit. */
static uint8_t *reserve(Writer *w, Py_ssize_t n) {
    w->count += n;
    if (!w->pos) return NULL;
    if (w->overrun || w->end - w->pos < n) {
        w->overrun = 1;
        return NULL;
    }
    uint8_t *at = w->pos;
    w->pos += n;
    return at;
}

static void put_varint(Writer *w, uint64_t value) {
    uint8_t bytes[10];
    Py_ssize_t n = 0;
    for (; value > 0x7F; value >>= 7) bytes[n++] = (uint8_t)(value & 0x7F) | 0x80;
    bytes[n++] = (uint8_t)value;
    uint8_t *at = reserve(w, n);
    if (at) memcpy(at, bytes, (size_t)n);
}

/* proto3 fields without presence are left out at their default, as protobuf and service/codec.py do. */
static void put_varint_field(Writer *w, uint64_t tag, uint64_t value) {
    if (!value) return;
    put_varint(w, tag);
    put_varint(w, value);
}

/* A bytes field's tag and length; returns where its `length` bytes go (NULL when empty, counting or overrun). */
static uint8_t *put_bytes_field(Writer *w, uint64_t tag, Py_ssize_t length) {
    if (!length) return NULL;
    put_varint(w, tag);
    put_varint(w, (uint64_t)length);
    return reserve(w, length);
}

/* Where each array's bytes are in the response, filled in by the writing run. */
typedef struct {
    const Chunk *c;
    uint8_t *cu, *token_to_seq, *ks, *ke, *local_cu;
} Layout;

static void emit_query_slice(Writer *w, int64_t start, int64_t stop) {
    put_varint_field(w, QUERY_SLICE_START_TAG, (uint64_t)start);
    put_varint_field(w, QUERY_SLICE_STOP_TAG, (uint64_t)stop);
}

/* ChunkMetadata's fields in number order (protobuf's and service/codec.py's), for DCP off: the rank's own
 * lengths and totals are the chunk's. The arrays' bytes are only reserved here; fill_arrays writes them. */
static void emit_metadata(Writer *w, const Chunk *c, Layout *l) {
    const Request *r = c->r;
    Py_ssize_t cu_bytes = I32_BYTES * (c->reqs + 1);
    Py_ssize_t rows_bytes = I32_BYTES * (Py_ssize_t)(c->rows_stop - c->rows_start);
    l->cu = put_bytes_field(w, CHUNK_METADATA_CU_SEQ_LENS_TAG, cu_bytes);
    l->token_to_seq = put_bytes_field(w, CHUNK_METADATA_TOKEN_TO_SEQ_TAG,
                                      r->omit_token_to_seq ? 0 : I32_BYTES * (Py_ssize_t)c->total);
    l->ks = put_bytes_field(w, CHUNK_METADATA_CU_SEQLEN_KS_TAG, rows_bytes);
    l->ke = put_bytes_field(w, CHUNK_METADATA_CU_SEQLEN_KE_TAG, rows_bytes);
    put_varint_field(w, CHUNK_METADATA_TOTAL_SEQ_LENS_TAG, (uint64_t)c->total);
    put_varint_field(w, CHUNK_METADATA_TOKEN_START_TAG, (uint64_t)(c->base + c->rows_start));
    put_varint_field(w, CHUNK_METADATA_TOKEN_END_TAG, (uint64_t)(c->base + c->rows_stop));
    put_varint_field(w, CHUNK_METADATA_NUM_REQS_TAG, (uint64_t)c->reqs);
    put_varint_field(w, CHUNK_METADATA_SKIP_KV_GATHER_TAG, (uint64_t)c->skip_kv_gather);
    l->local_cu = put_bytes_field(w, CHUNK_METADATA_LOCAL_CU_SEQ_LENS_TAG, cu_bytes);
    put_varint_field(w, CHUNK_METADATA_LOCAL_TOTAL_SEQ_LENS_TAG, (uint64_t)c->total);
    put_varint_field(w, CHUNK_METADATA_MAX_LOCAL_TOTAL_SEQ_LENS_TAG, (uint64_t)c->total);
    put_varint_field(w, CHUNK_METADATA_REQ_START_TAG, (uint64_t)r->req_start);
    put_varint_field(w, CHUNK_METADATA_REQ_END_TAG, (uint64_t)r->req_end);
    Writer slice = COUNTING;
    emit_query_slice(&slice, c->rows_start, c->rows_stop);
    put_varint(w, CHUNK_METADATA_QUERY_SLICE_TAG); /* a message field: present even when empty */
    put_varint(w, (uint64_t)slice.count);
    emit_query_slice(w, c->rows_start, c->rows_stop);
    put_varint_field(w, CHUNK_METADATA_TOKEN_TO_SEQ_OMITTED_TAG, (uint64_t)r->omit_token_to_seq);
}

/* BuildChunkResponse up to its only field's body: the metadata's tag and length. */
static void emit_response_head(Writer *w, Py_ssize_t metadata_bytes) {
    put_varint(w, BUILD_CHUNK_RESPONSE_METADATA_TAG);
    put_varint(w, (uint64_t)metadata_bytes);
}

/* The answer's exact size (a counting run of the code that writes it), and its metadata's part of it. */
static Py_ssize_t answer_size(const Chunk *c, Py_ssize_t *metadata_bytes) {
    Writer metadata = COUNTING, head = COUNTING;
    Layout unused = {.c = c};
    emit_metadata(&metadata, c, &unused);
    emit_response_head(&head, metadata.count);
    *metadata_bytes = metadata.count;
    return head.count + metadata.count;
}

/* The response bytes, `size` of them as answer_size counted, with everything but the arrays written, bounds-checked;
 * the write must end exactly at the end. NULL with RuntimeError when it does not. `size_skew` is 0 except through
 * the test builds' seam, which makes the size pass wrong on purpose. */
static PyObject *write_response(const Chunk *c, Layout *l, Py_ssize_t size, Py_ssize_t metadata_bytes,
                                Py_ssize_t size_skew) {
    size += size_skew;
    PyObject *response = PyBytes_FromStringAndSize(NULL, size > 0 ? size : 0);
    if (!response) return NULL;
    Writer w = {(uint8_t *)PyBytes_AS_STRING(response), NULL, 0, 0};
    w.end = w.pos + PyBytes_GET_SIZE(response);
    emit_response_head(&w, metadata_bytes);
    emit_metadata(&w, c, l);
    if (!w.overrun && w.pos == w.end) return response;
    Py_DECREF(response);
    return PyErr_Format(PyExc_RuntimeError,
                        "_fastpath: the size pass counted %zd response bytes and the write pass %zd; nothing "
                        "was written past the bytes object (a bug in service/compute/fastpath.c)",
                        size, w.count);
}

/* ---- the arrays ----------------------------------------------------------------------------------------- */

/* cu_seq_lens, local_cu_seq_lens and token_to_seq. Each run of token_to_seq is checked against the room the
 * size pass gave it, and the sum against the total: with a buffer another thread changes while the GIL is
 * released, the arrays may be wrong but never written out of place. -1 on a mismatch. */
static int fill_lengths(const Layout *l) {
    const Chunk *c = l->c;
    int64_t cumulative = 0;
    store_i32(l->cu, 0, 0);
    for (Py_ssize_t i = 0; i < c->reqs; i++) {
        int64_t compressed = load_i32(c->r->seq, c->r->req_start + i) / c->ratio;
        if (compressed < 0 || compressed > c->total - cumulative) return -1;
        if (l->token_to_seq) {
            uint8_t *run = l->token_to_seq + I32_BYTES * cumulative;
            int32_t request = (int32_t)i;
            for (int64_t t = 0; t < compressed; t++) memcpy(run + I32_BYTES * t, &request, sizeof request);
        }
        cumulative += compressed;
        store_i32(l->cu, i + 1, cumulative);
    }
    memcpy(l->local_cu, l->cu, (size_t)(I32_BYTES * (c->reqs + 1))); /* the rank's own lengths are all of them */
    return cumulative == c->total ? 0 : -1;
}

/* cu_seqlen_ks and cu_seqlen_ke: each query row's window, spec section 1 with DCP off. Bounded like
 * fill_lengths: each request's rows against the room left, and all of them against the slice. */
static int fill_windows(const Layout *l) {
    const Chunk *c = l->c;
    const Request *r = c->r;
    int64_t capacity = c->rows_stop - c->rows_start, row = 0;
    int shift = -1; /* log2(ratio) when ratio is a power of two: a shift instead of a division */
    if ((c->ratio & (c->ratio - 1)) == 0)
        for (shift = 0; (INT64_C(1) << shift) < c->ratio;) shift++;
    for (Py_ssize_t i = 0; i < c->reqs && row < capacity; i++) {
        int64_t lo = load_i32(r->qsl, r->req_start + i) - c->base;
        int64_t hi = load_i32(r->qsl, r->req_start + i + 1) - c->base;
        int64_t from = lo > c->rows_start ? lo : c->rows_start, to = hi < c->rows_stop ? hi : c->rows_stop;
        if (from >= to) continue;
        if (to - from > capacity - row) return -1;
        int32_t start = (int32_t)load_i32(l->cu, i), rows = (int32_t)(to - from);
        /* Row q of request i sees causal position seq_len - (hi - lo) + 1 + (q - lo): one more per row. All of
         * it fits int32 (positions <= seq_len), and int32 loops without division vectorize. */
        int32_t position = (int32_t)(load_i32(r->seq, r->req_start + i) - (hi - lo) + 1 + (from - lo));
        uint8_t *ks = l->ks + I32_BYTES * row, *ke = l->ke + I32_BYTES * row;
        for (int32_t k = 0; k < rows; k++) memcpy(ks + I32_BYTES * k, &start, sizeof start);
        if (shift >= 0) {
            for (int32_t k = 0; k < rows; k++) {
                int32_t end = start + ((position + k) >> shift);
                memcpy(ke + I32_BYTES * k, &end, sizeof end);
            }
        } else { /* quotient and remainder carried from row to row instead of a division per row */
            int32_t visible = position / (int32_t)c->ratio, remainder = position % (int32_t)c->ratio;
            for (int32_t k = 0; k < rows; k++) {
                int32_t end = start + visible;
                memcpy(ke + I32_BYTES * k, &end, sizeof end);
                if (++remainder == c->ratio) remainder = 0, visible++;
            }
        }
        row += rows;
    }
    return row == capacity ? 0 : -1;
}

static double monotonic_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Both array passes, without the GIL when they are large; the seconds they took. -1 on a mismatch. */
static int fill_arrays(const Layout *l, double *seconds) {
    const Chunk *c = l->c;
    int rc;
    double started = monotonic_seconds();
    if (c->total + 2 * (c->rows_stop - c->rows_start) > RELEASE_GIL_ELEMENTS) {
        Py_BEGIN_ALLOW_THREADS
        rc = fill_lengths(l) || fill_windows(l);
        Py_END_ALLOW_THREADS
    } else {
        rc = fill_lengths(l) || fill_windows(l);
    }
    *seconds = monotonic_seconds() - started;
    return rc ? -1 : 0;
}

/* ---- the call ------------------------------------------------------------------------------------------- */

/* The answer tuple (response, requests, query rows, seconds), taking over `response`; NULL with an exception. */
static PyObject *answer(PyObject *response, Py_ssize_t reqs, Py_ssize_t rows, double seconds) {
    if (!response) return NULL;
    PyObject *items[4] = {response, PyLong_FromSsize_t(reqs), PyLong_FromSsize_t(rows), PyFloat_FromDouble(seconds)};
    PyObject *tuple = items[1] && items[2] && items[3] ? PyTuple_New(4) : NULL;
    for (Py_ssize_t i = 0; i < 4; i++) {
        if (tuple) PyTuple_SET_ITEM(tuple, i, items[i]);
        else Py_XDECREF(items[i]);
    }
    return tuple;
}

/* Parse, check, size, admit and write: the answer tuple, None to step aside, or NULL with an exception.
 * `admit` (None: no admission) is called with the general path's estimate of the answer's bytes (what the heavy
 * lane is decided on) and its exact size (what the response budget holds) once the request is known valid and
 * in limits, before any array is written: it reserves the response budget and the heavy lane, or raises. After
 * it returns, the call no longer steps aside, so what it reserved is the caller's to release. */
static PyObject *serve(const Py_buffer *request, const Limits *lim, PyObject *admitted, PyObject *admit,
                       Py_ssize_t size_skew) {
    Request r = {.dcp_world_size = 1, .dcp_interleave = 1}; /* optional fields: absent means 1 */
    Chunk c;
    Py_ssize_t batch;
    const uint8_t *wire = request->buf;
    if (parse_request(wire, wire + request->len, &r) || check_batch(&r, lim, &batch)) Py_RETURN_NONE;
    int rc = check_chunk(&r, batch, admitted, &c);
    if (rc < 0) return NULL;
    if (rc > 0 || check_response(&c, lim)) Py_RETURN_NONE;
    /* no chunk metadata when there is nothing to build: an empty BuildChunkResponse */
    Py_ssize_t metadata_bytes = 0, size = c.total == 0 ? 0 : answer_size(&c, &metadata_bytes);
    if (admit != Py_None) {
        PyObject *sizes[2] = {PyLong_FromSsize_t((Py_ssize_t)response_estimate(&c, lim)), PyLong_FromSsize_t(size)};
        PyObject *admitted_ok = sizes[0] && sizes[1] ? PyObject_Vectorcall(admit, sizes, 2, NULL) : NULL;
        Py_XDECREF(sizes[0]);
        Py_XDECREF(sizes[1]);
        if (!admitted_ok) return NULL;
        Py_DECREF(admitted_ok);
    }
    if (c.total == 0) return answer(PyBytes_FromStringAndSize(NULL, 0), c.reqs, 0, 0.0);
    Layout layout = {.c = &c};
    PyObject *response = write_response(&c, &layout, size, metadata_bytes, size_skew);
    if (!response) return NULL;
    double seconds;
    if (fill_arrays(&layout, &seconds)) {
        Py_DECREF(response);
        return PyErr_Format(PyExc_RuntimeError, "_fastpath: the arrays disagree with their size pass (the "
                                                "request's buffer changed during the call?)");
    }
    return answer(response, c.reqs, (Py_ssize_t)(c.rows_stop - c.rows_start), seconds);
}

/* build_chunk's arguments (request, limits, admitted_ratios, admit=None), positional, as a fast call: what
 * PyArg_ParseTuple's "y*OO|O" would accept, without building an argument tuple per call. */
static PyObject *build_chunk_skewed(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t size_skew) {
    if (nargs < 3 || nargs > 4) {
        return PyErr_Format(PyExc_TypeError, "build_chunk() takes from 3 to 4 positional arguments (%zd given)",
                            nargs);
    }
    if (PyUnicode_Check(args[0])) return PyErr_Format(PyExc_TypeError, "build_chunk(): request must be bytes-like");
    Py_buffer buffer;
    Limits lim;
    PyObject *limits = args[1], *admitted = args[2], *admit = nargs == 4 ? args[3] : Py_None;
    if (PyObject_GetBuffer(args[0], &buffer, PyBUF_SIMPLE) < 0) return NULL;
    if (read_limits(limits, &lim) < 0) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    PyObject *result = serve(&buffer, &lim, admitted, admit, size_skew);
    PyBuffer_Release(&buffer);
    return result;
}

/* The signature below (Python's __text_signature__) is service/compute/fastpath.py's BuildChunk, which documents
 * the call; tests/service/test_fastpath_contract.py holds the two equal. */
PyDoc_STRVAR(build_chunk_doc,
"build_chunk($module, request, limits, admitted_ratios, admit=None, /)\n--\n\n"
"Serve one serialized BuildChunkRequest, or None where the general path must: see\n"
"indexer_service.service.compute.fastpath.BuildChunk. The arrays are written without the GIL when large.\n"
"RuntimeError if its size and write passes disagree (a bug).");

static PyObject *build_chunk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return build_chunk_skewed(args, nargs, 0);
}

#ifdef FASTPATH_TEST_SEAMS
/* Test builds only (tests/service/test_compiled_sanitized.py compiles with -DFASTPATH_TEST_SEAMS): build_chunk with its
 * size pass off by `skew` bytes, to show that a disagreement is an exception and never a heap overrun. */
static PyObject *build_chunk_with_size_skew(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *request, *limits, *admitted;
    Py_ssize_t skew;
    if (!PyArg_ParseTuple(args, "OOOn:_build_chunk_with_size_skew", &request, &limits, &admitted, &skew)) return NULL;
    PyObject *rest[3] = {request, limits, admitted};
    return build_chunk_skewed(rest, 3, skew);
}
#endif

static PyMethodDef methods[] = {
    {"build_chunk", (PyCFunction)(void (*)(void))build_chunk, METH_FASTCALL, build_chunk_doc},
#ifdef FASTPATH_TEST_SEAMS
    {"_build_chunk_with_size_skew", build_chunk_with_size_skew, METH_VARARGS, NULL},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "indexer_service.service.compute._fastpath",
    "BuildChunk's common case in compiled code; see service/compute/fastpath.c.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    PyObject *names = PyTuple_New((Py_ssize_t)NUM_LIMIT_FIELDS);
    if (!names) goto fail;
    for (size_t i = 0; i < NUM_LIMIT_FIELDS; i++) {
        if (!limit_names[i] && !(limit_names[i] = PyUnicode_InternFromString(LIMIT_FIELDS[i].name))) {
            Py_DECREF(names);
            goto fail;
        }
        Py_INCREF(limit_names[i]);
        PyTuple_SET_ITEM(names, (Py_ssize_t)i, limit_names[i]);
    }
    if (PyModule_AddObject(m, "limit_fields", names) < 0) {
        Py_DECREF(names);
        goto fail;
    }
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
