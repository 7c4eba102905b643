/* BuildChunk's common case in one compiled call: request wire bytes in, response wire bytes out.
 *
 * Why: on a small or medium batch the Python request path (parse, validate, a dozen numpy calls, encode,
 * metrics) cost more server CPU than gRPC itself (benchmarks/RESULTS.md). This file does the same work for
 * the requests schedulers send all day (well-formed, within the limits, no DCP) without a Python object per
 * step, and writes the arrays straight into the response bytes.
 *
 * It never answers differently from the Python path: it answers only what it can prove valid and otherwise
 * returns None, and service/dataplane.py then serves the request the general way, which owns every error
 * message, DCP, PlanBatch, and anything unusual on the wire (unknown or repeated fields). The formulas are
 * kernels/inputs.py (host part) and kernels/naive.py (arrays) for DCP off; the layout is the one
 * service/codec.py derives from the message descriptors. tests/test_service_fastpath.py holds the three
 * to each other byte for byte, on the golden cases and on hypothesis-generated requests, valid and not.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <time.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "wire arrays are little-endian int32 and are copied here as host integers"
#endif

#define I32_MAX INT64_C(2147483647)
#define I32_MIN (-INT64_C(2147483647) - 1)
/* Above this many int32 written, the GIL is released while writing: other calls' Python goes on meanwhile.
 * Below it, releasing would cost more than the work (a contended GIL is re-acquired only at a switch). */
#define RELEASE_GIL_ELEMENTS 65536

typedef struct {
    long long max_num_seqs, max_num_batched_tokens, max_model_len, workspace_tokens, max_message_bytes,
        chunk_overhead_bytes;
} Limits;

typedef struct {
    const uint8_t *qsl, *seq; /* little-endian int32 arrays, possibly unaligned */
    Py_ssize_t qsl_bytes, seq_bytes;
    int64_t ratio, req_start, req_end, slice_start, slice_stop, dcp_rank, dcp_world_size, dcp_interleave;
    int has_slice, skip_kv_gather, omit_token_to_seq;
    uint32_t seen; /* bit n: field n was on the wire */
} Request;

/* ---- wire reading: 0 on success, -1 for anything the general path should look at ---------------------- */

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
    if (value < I32_MIN || value > I32_MAX) return -1;
    *out = value;
    return 0;
}

static int read_bool(const uint8_t **p, const uint8_t *end, int *out) {
    uint64_t raw;
    if (read_varint(p, end, &raw) || raw > 1) return -1;
    *out = (int)raw;
    return 0;
}

static int read_length(const uint8_t **p, const uint8_t *end, Py_ssize_t *out) {
    uint64_t raw;
    if (read_varint(p, end, &raw) || raw > (uint64_t)(end - *p)) return -1;
    *out = (Py_ssize_t)raw;
    return 0;
}

/* QuerySlice {int32 start = 1; int32 stop = 2;} */
static int parse_query_slice(const uint8_t *p, const uint8_t *end, Request *r) {
    int seen = 0;
    while (p < end) {
        uint64_t tag;
        if (read_varint(&p, end, &tag)) return -1;
        int field = (int)(tag >> 3);
        if ((tag & 7) != 0 || (field != 1 && field != 2) || (seen & (1 << field))) return -1;
        seen |= 1 << field;
        if (read_int32(&p, end, field == 1 ? &r->slice_start : &r->slice_stop)) return -1;
    }
    return 0;
}

/* BuildChunkRequest; each known field at most once, with its declared wire type; no unknown field. */
static int parse_request(const uint8_t *p, const uint8_t *end, Request *r) {
    while (p < end) {
        uint64_t tag;
        if (read_varint(&p, end, &tag)) return -1;
        uint64_t field = tag >> 3;
        int wire_type = (int)(tag & 7);
        if (field < 1 || field > 11 || (r->seen & (1u << field))) return -1;
        r->seen |= 1u << field;
        int length_delimited = field == 1 || field == 2 || field == 6;
        if (wire_type != (length_delimited ? 2 : 0)) return -1;
        Py_ssize_t length;
        int rc = 0;
        switch (field) {
        case 1:
        case 2:
            if (read_length(&p, end, &length)) return -1;
            if (field == 1) r->qsl = p, r->qsl_bytes = length;
            else r->seq = p, r->seq_bytes = length;
            p += length;
            break;
        case 6:
            if (read_length(&p, end, &length) || parse_query_slice(p, p + length, r)) return -1;
            r->has_slice = 1;
            p += length;
            break;
        case 3: rc = read_int32(&p, end, &r->ratio); break;
        case 4: rc = read_int32(&p, end, &r->req_start); break;
        case 5: rc = read_int32(&p, end, &r->req_end); break;
        case 7: rc = read_bool(&p, end, &r->skip_kv_gather); break;
        case 8: rc = read_int32(&p, end, &r->dcp_rank); break;
        case 9: rc = read_int32(&p, end, &r->dcp_world_size); break;
        case 10: rc = read_int32(&p, end, &r->dcp_interleave); break;
        case 11: rc = read_bool(&p, end, &r->omit_token_to_seq); break;
        }
        if (rc) return -1;
    }
    return 0;
}

static inline int64_t load_i32(const uint8_t *array, Py_ssize_t i) {
    int32_t value;
    memcpy(&value, array + 4 * i, 4);
    return value;
}

static inline void store_i32(uint8_t *array, Py_ssize_t i, int64_t value) {
    int32_t narrow = (int32_t)value;
    memcpy(array + 4 * i, &narrow, 4);
}

/* ---- wire writing --------------------------------------------------------------------------------------- */

static int varint_size(uint64_t value) {
    int n = 1;
    while (value > 0x7F) value >>= 7, n++;
    return n;
}

static uint8_t *put_varint(uint8_t *out, uint64_t value) {
    while (value > 0x7F) *out++ = (uint8_t)(value & 0x7F) | 0x80, value >>= 7;
    *out++ = (uint8_t)value;
    return out;
}

/* Sizes of a proto3 field without presence: nothing at its default. Field numbers here are all below 16. */
static Py_ssize_t scalar_size(uint64_t value) { return value ? 1 + varint_size(value) : 0; }
static Py_ssize_t bytes_size(Py_ssize_t length) { return length ? 1 + varint_size((uint64_t)length) + length : 0; }

static uint8_t *put_scalar(uint8_t *out, int field, uint64_t value) {
    if (!value) return out;
    *out++ = (uint8_t)(field << 3);
    return put_varint(out, value);
}

/* The tag and length of a length-delimited field; its body comes next. Nothing when empty. */
static uint8_t *put_bytes_header(uint8_t *out, int field, Py_ssize_t length) {
    if (!length) return out;
    *out++ = (uint8_t)(field << 3 | 2);
    return put_varint(out, (uint64_t)length);
}

/* ---- the call ------------------------------------------------------------------------------------------- */

static double monotonic_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

typedef struct {
    const Request *r;
    int64_t ratio, base, rows_start, rows_stop;
    int shift; /* log2(ratio) when ratio is a power of two, else -1 */
    Py_ssize_t reqs;
    uint8_t *cu, *token_to_seq, *ks, *ke, *local_cu; /* where each array's bytes go in the response */
} Layout;

/* cu_seq_lens, token_to_seq, and each query row's window: spec section 1 with DCP off. */
static void write_arrays(const Layout *l) {
    const Request *r = l->r;
    int64_t cumulative = 0;
    store_i32(l->cu, 0, 0);
    for (Py_ssize_t i = 0; i < l->reqs; i++) {
        int64_t compressed = load_i32(r->seq, r->req_start + i) / l->ratio;
        if (l->token_to_seq) {
            uint8_t *run = l->token_to_seq + 4 * cumulative;
            int32_t request = (int32_t)i;
            for (int64_t t = 0; t < compressed; t++) memcpy(run + 4 * t, &request, 4);
        }
        cumulative += compressed;
        store_i32(l->cu, i + 1, cumulative);
    }
    memcpy(l->local_cu, l->cu, 4 * (size_t)(l->reqs + 1)); /* the rank's own lengths are all of them */

    Py_ssize_t row = 0;
    for (Py_ssize_t i = 0; i < l->reqs && row < l->rows_stop - l->rows_start; i++) {
        int64_t lo = load_i32(r->qsl, r->req_start + i) - l->base, hi = load_i32(r->qsl, r->req_start + i + 1) - l->base;
        int64_t from = lo > l->rows_start ? lo : l->rows_start, to = hi < l->rows_stop ? hi : l->rows_stop;
        if (from >= to) continue;
        int32_t start = (int32_t)load_i32(l->cu, i);
        /* Row q of request i sees causal position seq_len - (hi - lo) + 1 + (q - lo): one more per row. All of
         * it fits int32 (positions <= seq_len), and int32 loops without division vectorize. */
        int32_t position = (int32_t)(load_i32(r->seq, r->req_start + i) - (hi - lo) + 1 + (from - lo));
        int32_t rows = (int32_t)(to - from);
        uint8_t *ks = l->ks + 4 * row, *ke = l->ke + 4 * row;
        for (int32_t k = 0; k < rows; k++) memcpy(ks + 4 * k, &start, 4);
        if (l->shift >= 0) {
            for (int32_t k = 0; k < rows; k++) {
                int32_t end = start + ((position + k) >> l->shift);
                memcpy(ke + 4 * k, &end, 4);
            }
        } else { /* quotient and remainder carried from row to row instead of a division per row */
            int32_t visible = position / (int32_t)l->ratio, remainder = position % (int32_t)l->ratio;
            for (int32_t k = 0; k < rows; k++) {
                int32_t end = start + visible;
                memcpy(ke + 4 * k, &end, 4);
                if (++remainder == l->ratio) remainder = 0, visible++;
            }
        }
        row += rows;
    }
}

PyDoc_STRVAR(build_chunk_doc,
"build_chunk(request, limits, admitted_ratios) -> (response, num_reqs, query_tokens, seconds) | None\n\n"
"Serve one serialized BuildChunkRequest: the serialized BuildChunkResponse, the request count and query rows\n"
"for the size metrics, and the seconds spent writing the arrays. None when the request is not the common\n"
"case this function proves valid (any error, DCP, a limit reached, an unusual encoding): the caller then\n"
"takes the general path. ``limits``: (max_num_seqs, max_num_batched_tokens, max_model_len,\n"
"workspace_tokens, max_message_bytes, chunk_overhead_bytes); ``admitted_ratios``: the normalised compress\n"
"ratios strict mode admits, or None for any.");

static PyObject *build_chunk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buffer;
    Limits lim;
    PyObject *admitted;
    if (!PyArg_ParseTuple(args, "y*(LLLLLL)O:build_chunk", &buffer, &lim.max_num_seqs, &lim.max_num_batched_tokens,
                          &lim.max_model_len, &lim.workspace_tokens, &lim.max_message_bytes,
                          &lim.chunk_overhead_bytes, &admitted))
        return NULL;
    PyObject *result = NULL;
    Request r = {.dcp_world_size = 1, .dcp_interleave = 1};
    const uint8_t *wire = buffer.buf;

#define GENERAL_PATH goto general_path
    if (parse_request(wire, wire + buffer.len, &r)) GENERAL_PATH;

    /* the batch (kernels.inputs.validate_batch) and the server's limits (DataPlane._admit_request) */
    if (r.qsl_bytes % 4 || r.seq_bytes % 4 || r.qsl_bytes == 0) GENERAL_PATH;
    Py_ssize_t batch = r.seq_bytes / 4;
    if (batch != r.qsl_bytes / 4 - 1 || batch > lim.max_num_seqs) GENERAL_PATH;
    if (load_i32(r.qsl, 0) != 0) GENERAL_PATH;
    for (Py_ssize_t i = 0; i < batch; i++) {
        int64_t q0 = load_i32(r.qsl, i), q1 = load_i32(r.qsl, i + 1), s = load_i32(r.seq, i);
        if (q1 < q0 || q1 > lim.max_num_batched_tokens || s < q1 - q0 || s > lim.max_model_len) GENERAL_PATH;
    }

    /* the chunk (kernels.inputs._chunk_host_part) and policy: no DCP here, strict mode's admitted ratios */
    if (r.ratio < 0 || r.dcp_rank != 0 || r.dcp_world_size != 1 || r.dcp_interleave != 1) GENERAL_PATH;
    int64_t ratio = r.ratio > 1 ? r.ratio : 1;
    if (admitted != Py_None) {
        PyObject *key = PyLong_FromLongLong(ratio);
        if (!key) goto done;
        int found = PySequence_Contains(admitted, key);
        Py_DECREF(key);
        if (found < 0) goto done;
        if (!found) GENERAL_PATH;
    }
    if (r.req_start < 0 || r.req_start > batch || r.req_end < r.req_start || r.req_end > batch) GENERAL_PATH;
    Py_ssize_t reqs = (Py_ssize_t)(r.req_end - r.req_start);
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < reqs; i++) total += load_i32(r.seq, r.req_start + i) / ratio;
    if (total > I32_MAX) GENERAL_PATH;
    int64_t base = load_i32(r.qsl, r.req_start), queries = load_i32(r.qsl, r.req_end) - base;
    int64_t a = r.has_slice ? r.slice_start : 0, b = r.has_slice ? r.slice_stop : queries;
    if (a < 0 || a > queries || b < a || b > queries) GENERAL_PATH;

    /* the response limits (DataPlane._check_sizes) */
    int64_t estimate = lim.chunk_overhead_bytes;
    if (total > 0) {
        if (total > lim.workspace_tokens / ratio) GENERAL_PATH;
        estimate += 8 * (b - a) + 8 * (int64_t)(reqs + 1) + (r.omit_token_to_seq ? 0 : 4 * total);
    }
    if (estimate > lim.max_message_bytes) GENERAL_PATH;

    if (total == 0) { /* nothing to build: a BuildChunkResponse without metadata */
        PyObject *empty = PyBytes_FromStringAndSize(NULL, 0);
        if (empty) result = Py_BuildValue("(Nnnd)", empty, reqs, (Py_ssize_t)0, 0.0);
        goto done;
    }

    /* ChunkMetadata's fields in number order, proto3 defaults left out (service/codec.py's encoding) */
    Py_ssize_t cu_bytes = 4 * (reqs + 1), rows_bytes = 4 * (Py_ssize_t)(b - a);
    Py_ssize_t t2s_bytes = r.omit_token_to_seq ? 0 : 4 * (Py_ssize_t)total;
    int skip_kv_gather = r.skip_kv_gather || (r.has_slice && a > 0);
    Py_ssize_t slice_size = scalar_size((uint64_t)a) + scalar_size((uint64_t)b);
    Py_ssize_t meta_size = bytes_size(cu_bytes) + bytes_size(t2s_bytes) + 2 * bytes_size(rows_bytes) +
                           scalar_size((uint64_t)total) + scalar_size((uint64_t)(base + a)) +
                           scalar_size((uint64_t)(base + b)) + scalar_size((uint64_t)reqs) +
                           scalar_size((uint64_t)skip_kv_gather) + bytes_size(cu_bytes) +
                           2 * scalar_size((uint64_t)total) + scalar_size((uint64_t)r.req_start) +
                           scalar_size((uint64_t)r.req_end) + 1 + varint_size((uint64_t)slice_size) + slice_size +
                           (r.omit_token_to_seq ? 3 : 0);
    PyObject *response = PyBytes_FromStringAndSize(NULL, 1 + varint_size((uint64_t)meta_size) + meta_size);
    if (!response) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(response);
    Layout layout = {.r = &r, .ratio = ratio, .base = base, .rows_start = a, .rows_stop = b,
                     .reqs = reqs, .shift = -1};
    if ((ratio & (ratio - 1)) == 0) {
        for (layout.shift = 0; (INT64_C(1) << layout.shift) < ratio;) layout.shift++;
    }

    out = put_bytes_header(out, 1, meta_size); /* BuildChunkResponse.metadata */
    out = put_bytes_header(out, 1, cu_bytes), layout.cu = out, out += cu_bytes;
    out = put_bytes_header(out, 2, t2s_bytes), layout.token_to_seq = t2s_bytes ? out : NULL, out += t2s_bytes;
    out = put_bytes_header(out, 3, rows_bytes), layout.ks = out, out += rows_bytes;
    out = put_bytes_header(out, 4, rows_bytes), layout.ke = out, out += rows_bytes;
    out = put_scalar(out, 5, (uint64_t)total);
    out = put_scalar(out, 6, (uint64_t)(base + a));
    out = put_scalar(out, 7, (uint64_t)(base + b));
    out = put_scalar(out, 8, (uint64_t)reqs);
    out = put_scalar(out, 9, (uint64_t)skip_kv_gather);
    out = put_bytes_header(out, 10, cu_bytes), layout.local_cu = out, out += cu_bytes;
    out = put_scalar(out, 11, (uint64_t)total);
    out = put_scalar(out, 12, (uint64_t)total);
    out = put_scalar(out, 13, (uint64_t)r.req_start);
    out = put_scalar(out, 14, (uint64_t)r.req_end);
    *out++ = 15 << 3 | 2; /* query_slice: a message field, present even when empty */
    out = put_varint(out, (uint64_t)slice_size);
    out = put_scalar(out, 1, (uint64_t)a);
    out = put_scalar(out, 2, (uint64_t)b);
    if (r.omit_token_to_seq) *out++ = 0x80, *out++ = 0x01, *out++ = 1; /* field 16, token_to_seq_omitted */

    double started = monotonic_seconds();
    if (total + 2 * (b - a) > RELEASE_GIL_ELEMENTS) {
        Py_BEGIN_ALLOW_THREADS
        write_arrays(&layout);
        Py_END_ALLOW_THREADS
    } else {
        write_arrays(&layout);
    }
    result = Py_BuildValue("(Nnnd)", response, reqs, (Py_ssize_t)(b - a), monotonic_seconds() - started);
    goto done;

general_path:
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&buffer);
    return result;
#undef GENERAL_PATH
}

static PyMethodDef methods[] = {
    {"build_chunk", build_chunk, METH_VARARGS, build_chunk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "service._fastpath",
    "BuildChunk's common case in compiled code; see service/fastpath.c.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) { return PyModule_Create(&module); }
