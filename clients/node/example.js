// Calls BuildChunk (the spec's example E1) and the health check of an indexer-service, and prints the answer.
// Usage: node example.js [HOST:PORT] [PATH/TO/indexer.proto]
// Needs: npm install @grpc/grpc-js @grpc/proto-loader
"use strict";
const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const address = process.argv[2] || "127.0.0.1:50051";
const protoPath = process.argv[3] || path.join(__dirname, "../../protos/indexer/v1/indexer.proto");

// keepCase: the proto's snake_case names (the default camelCases them, and snake_case keys you pass are then
// dropped without an error). longs: String, so int64 fields arrive as decimal strings, not Long objects.
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };
const indexer = grpc.loadPackageDefinition(protoLoader.loadSync(protoPath, LOADER_OPTIONS)).indexer.v1;

// Arrays are little-endian int32 bytes. Never pass a plain number array to a bytes field (protobufjs keeps
// one byte per element, silently) and never view a received Buffer as an Int32Array: its byteOffset inside
// the message is usually not a multiple of 4, and the view throws (it would also assume host byte order).
function toInt32LE(values) {
  const buffer = Buffer.alloc(4 * values.length);
  values.forEach((v, i) => buffer.writeInt32LE(v, 4 * i));
  return buffer;
}
function fromInt32LE(buffer) {
  const values = [];
  for (let offset = 0; offset < buffer.length; offset += 4) values.push(buffer.readInt32LE(offset));
  return values;
}

// grpc.health.v1, declared inline (no extra package needed).
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
const health = grpc.loadPackageDefinition(protoLoader.fromJSON(healthJson, LOADER_OPTIONS)).grpc.health.v1;

const client = new indexer.PrefillMetadata(address, grpc.credentials.createInsecure());
const healthClient = new health.Health(address, grpc.credentials.createInsecure());
const deadline = () => new Date(Date.now() + 5000);

healthClient.check({ service: "indexer.v1.PrefillMetadata" }, { deadline: deadline() }, (err, reply) => {
  if (err) throw err;
  console.log(`health: ${reply.status}`);
  const request = {
    query_start_loc: toInt32LE([0, 1, 4, 9]),
    seq_lens: toInt32LE([20, 10, 5]),
    compress_ratio: 4,
    req_start: 1,
    req_end: 3,
  };
  client.BuildChunk(request, { deadline: deadline() }, (error, response) => {
    if (error) {
      // error.code is a grpc.status number, error.details the server's message (field and index).
      console.error(`BuildChunk failed: ${grpc.status[error.code]}: ${error.details}`);
      process.exit(1);
    }
    const m = response.metadata; // null when the chunk holds no compressed token
    console.log(`cu_seq_lens: ${fromInt32LE(m.cu_seq_lens)}`);
    console.log(`cu_seqlen_ks: ${fromInt32LE(m.cu_seqlen_ks)}`);
    console.log(`cu_seqlen_ke: ${fromInt32LE(m.cu_seqlen_ke)}`);
    console.log(`total_seq_lens: ${Number(m.total_seq_lens)}`); // int64: a string with longs: String
    client.close();
    healthClient.close();
  });
});
