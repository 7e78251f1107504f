#!/usr/bin/env node
'use strict';
// Checks fedloom's conformance vectors (protos/conformance/vectors.json) from a second
// language: the payload layout, digest and chunks are recomputed with tensors.js (the
// code client.js runs), FedAvg with the arithmetic the vectors state, and every value,
// record and message is decoded and re-encoded with protobufjs from fleet.proto.
//
// Usage: node verify_vectors.js [path/to/vectors.json]   (exit status 1 on a mismatch)

const fs = require('node:fs');
const path = require('node:path');
const assert = require('node:assert/strict');
const protobuf = require('protobufjs');
const {
  dtypeOf, encodePayload, sha256, chunksOf, roundHalfEven, roundToFloat,
} = require('./tensors');

const ROOT = path.join(__dirname, '..', '..');
const PROTO_PATH = path.join(ROOT, 'protos', 'fedloom', 'v1', 'fleet.proto');

const fromBase64 = (text) => Buffer.from(text, 'base64');

// Tensors as the vectors give them, ready for tensors.js.
function tensorsOf(rows) {
  return rows.map(({ name, dtype, shape, values }) => ({
    name, dtype, shape,
    // 64-bit integers as BigInts
    values: dtypeOf(dtype).kind === 'int' && dtypeOf(dtype).size === 8
      ? values.map(BigInt) : values,
  }));
}

function checkPayload(vector) {
  const tensors = tensorsOf(vector.tensors);
  const payload = encodePayload(tensors);
  let offset = 0;
  for (const tensor of vector.tensors) {
    const expected = fromBase64(tensor.data_base64);
    assert.deepEqual(payload.subarray(offset, offset + expected.length), expected, tensor.name);
    offset += expected.length;
  }
  assert.equal(payload.length, vector.header.total_bytes);
  assert.equal(sha256(payload).toString('hex'), vector.header.sha256);
  const chunks = chunksOf(payload, vector.chunk_size);
  assert.deepEqual(
    chunks.map((c) => ({ offset: c.offset, data_base64: c.data.toString('base64') })),
    vector.chunks,
  );
}

// FedAvg, element by element: S = sum of n_i * delta_i in binary64 (a JS number), mean =
// S / N, rounded to the tensor's dtype (integers half to even), added in that dtype.
function fedavg(vector) {
  const weights = vector.updates.map((u) => u.num_examples);
  const total = weights.reduce((a, b) => a + b, 0);
  const means = [];
  const news = [];
  vector.global.forEach((tensor, index) => {
    const kind = dtypeOf(tensor.dtype).kind;
    const mean = [];
    const next = [];
    tensor.values.forEach((current, j) => {
      let sum = null; // starts from the first product: 0 + -0.0 would lose the sign
      vector.updates.forEach((u, i) => {
        const product = weights[i] * Number(u.delta[index].values[j]);
        sum = sum === null ? product : sum + product;
      });
      const mean64 = sum / total;
      if (kind === 'int') {
        mean.push(roundHalfEven(mean64));
        next.push(BigInt(current) + BigInt(roundHalfEven(mean64)));
      } else {
        const rounded = roundToFloat(tensor.dtype, mean64);
        mean.push(rounded);
        next.push(roundToFloat(tensor.dtype, current + rounded));
      }
    });
    means.push({ ...tensor, values: mean });
    news.push({ ...tensor, values: next });
  });
  return { means, news };
}

function checkFedAvg(vector) {
  const { means, news } = fedavg(vector);
  // Compared as bytes: the dtype's rounding and the sign of zero count.
  const bytes = (tensors) => encodePayload(tensorsOf(tensors));
  assert.deepEqual(bytes(means), bytes(vector.mean_delta), 'mean_delta');
  assert.deepEqual(bytes(news), bytes(vector.new_global), 'new_global');
}

// A JSON value with its object keys sorted, for comparisons that ignore key order.
function canonical(value) {
  if (Array.isArray(value)) return value.map(canonical);
  if (value && typeof value === 'object') {
    return Object.fromEntries(Object.keys(value).sort().map((k) => [k, canonical(value[k])]));
  }
  return value;
}

// Decoding the bytes gives the field view, and encoding the field view gives the bytes.
function checkMessage(root, name, vector) {
  const type = root.lookupType(`fedloom.v1.${name}`);
  const data = fromBase64(vector.encoding_base64);
  const view = type.toObject(type.decode(data), { longs: String, bytes: String });
  assert.deepEqual(canonical(view), canonical(vector.fields));
  assert.deepEqual(Buffer.from(type.encode(type.fromObject(vector.fields)).finish()), data);
}

function main() {
  const file = process.argv[2] || path.join(ROOT, 'protos', 'conformance', 'vectors.json');
  const vectors = JSON.parse(fs.readFileSync(file, 'utf8'));
  const root = new protobuf.Root().loadSync(PROTO_PATH, { keepCase: true });
  const groups = [
    ['payloads', checkPayload],
    ['fedavg', checkFedAvg],
    ['values', (v) => checkMessage(root, 'Value', v)],
    ['records', (v) => checkMessage(root, 'Record', v)],
    ['messages', (v) => checkMessage(root, v.message, v)],
  ];
  let failed = 0;
  for (const [group, check] of groups) {
    for (const vector of vectors[group]) {
      try {
        check(vector);
      } catch (error) {
        failed += 1;
        console.error(`FAIL ${group}: ${vector.description.slice(0, 80)}...\n  ${error.message}`);
      }
    }
  }
  const counts = groups.map(([group]) => `${vectors[group].length} ${group}`).join(', ');
  if (failed) {
    console.error(`${failed} vectors failed (of ${counts})`);
    process.exit(1);
  }
  console.log(`all vectors hold: ${counts}`);
}

main();
