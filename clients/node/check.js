// CI client: checks a running indexer-service from Node against the BuildChunk golden cases, a bad request and health.
// Usage: node check.js HOST:PORT PATH/TO/indexer.proto PATH/TO/golden-cases.json
// Prints one JSON summary line; exits 1 when anything disagrees, 2 on a usage error (then prints the usage).
// Run by tests/system/test_clients_node.py.
"use strict";
const fs = require("node:fs");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const USAGE = "usage: node check.js HOST:PORT PATH/TO/indexer.proto PATH/TO/golden-cases.json";
if (process.argv.length !== 5) {
  console.error(USAGE);
  process.exit(2);
}
const [address, protoPath, goldenPath] = process.argv.slice(2);
const OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const indexer = grpc.loadPackageDefinition(protoLoader.loadSync(protoPath, OPTIONS)).indexer.v1;
const healthJson = {
  nested: { grpc: { nested: { health: { nested: { v1: { nested: {
    HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
    HealthCheckResponse: {
      fields: { status: { type: "ServingStatus", id: 1 } },
      nested: { ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } } },
    },
    Health: { methods: { Check: { requestType: "HealthCheckRequest", responseType: "HealthCheckResponse" } } },
  } } } } } } },
};
const health = grpc.loadPackageDefinition(protoLoader.fromJSON(healthJson, OPTIONS)).grpc.health.v1;

const toInt32LE = (values) => {
  const buffer = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => buffer.writeInt32LE(v, 4 * i));
  return buffer;
};
const fromInt32LE = (buffer) => {
  const values = [];
  for (let offset = 0; offset < buffer.length; offset += 4) values.push(buffer.readInt32LE(offset));
  return values;
};
const ARRAYS = ["cu_seq_lens", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke", "local_cu_seq_lens"];
const SCALARS = ["total_seq_lens", "token_start", "token_end", "num_reqs", "skip_kv_gather",
  "local_total_seq_lens", "max_local_total_seq_lens"];

const client = new indexer.PrefillMetadata(address, grpc.credentials.createInsecure());
const healthClient = new health.Health(address, grpc.credentials.createInsecure());
const call = (stub, method, request) =>
  new Promise((resolve) => {
    stub[method](request, { deadline: new Date(Date.now() + 10000) }, (error, response) => resolve({ error, response }));
  });

function requestOf(input) {
  const request = {
    query_start_loc: toInt32LE(input.qsl),
    seq_lens: toInt32LE(input.seq_lens),
    compress_ratio: input.ratio,
    req_start: input.start,
    req_end: input.end,
  };
  if (input.qslice) request.query_slice = { start: input.qslice[0], stop: input.qslice[1] };
  if (input.world !== undefined) {
    request.dcp_rank = input.rank || 0;
    request.dcp_world_size = input.world;
    request.dcp_interleave = input.inter || 1;
  }
  return request;
}

function compare(expected, m) {
  if (expected === null) return m === null ? [] : ["expected no metadata"];
  if (m === null) return ["metadata missing"];
  const problems = [];
  for (const name of ARRAYS) {
    const got = fromInt32LE(m[name]);
    if (JSON.stringify(got) !== JSON.stringify(expected[name])) problems.push(`${name}: ${got} != ${expected[name]}`);
  }
  for (const name of SCALARS) {
    // int64 fields arrive as strings (longs: String), int32 as numbers, bool as booleans.
    const got = typeof m[name] === "string" ? Number(m[name]) : m[name];
    if (got !== expected[name]) problems.push(`${name}: ${got} != ${expected[name]}`);
  }
  return problems;
}

async function main() {
  const golden = JSON.parse(fs.readFileSync(goldenPath, "utf8"));
  const summary = { cases: {}, problems: [], misaligned_buffers: 0 };
  for (const c of golden.chunk_metadata) {
    const { error, response } = await call(client, "BuildChunk", requestOf(c.input));
    if (error) {
      summary.problems.push(`${c.name}: ${grpc.status[error.code]} ${error.details}`);
      continue;
    }
    const m = response.metadata;
    if (m) summary.misaligned_buffers += ARRAYS.filter((n) => m[n].length && m[n].byteOffset % 4 !== 0).length;
    const problems = compare(c.expected, m);
    summary.cases[c.name] = problems.length ? "mismatch" : "ok";
    summary.problems.push(...problems.map((p) => `${c.name}: ${p}`));
  }
  // A bad request: 3 bytes is no whole int32.
  const bad = await call(client, "BuildChunk", { query_start_loc: toInt32LE([0, 1]), seq_lens: Buffer.from([1, 2, 3]), req_end: 1 });
  summary.bad_request = bad.error ? { code: grpc.status[bad.error.code], message: bad.error.details } : null;
  // The pitfall: a plain number array in a bytes field is cut to one byte per element (here 4 bytes: one int32).
  const cut = await call(client, "BuildChunk", { query_start_loc: [0, 1, 4, 9], seq_lens: toInt32LE([20, 10, 5]), req_end: 1 });
  summary.number_array = cut.error ? { code: grpc.status[cut.error.code], message: cut.error.details } : null;
  summary.health = {};
  for (const service of ["", "indexer.v1.PrefillMetadata"]) {
    const { error, response } = await call(healthClient, "Check", { service });
    summary.health[service] = error ? grpc.status[error.code] : response.status;
  }
  const unknown = await call(healthClient, "Check", { service: "no.such.Service" });
  summary.health["no.such.Service"] = unknown.error ? grpc.status[unknown.error.code] : unknown.response.status;
  client.close();
  healthClient.close();
  console.log(JSON.stringify(summary));
  process.exit(summary.problems.length ? 1 : 0);
}

main().catch((err) => {
  console.error(err);
  process.exit(2);
});
