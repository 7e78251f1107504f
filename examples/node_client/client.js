#!/usr/bin/env node
'use strict';
// A reference client of fedloom's Fleet protocol, version 5, in plain Node.js: what a
// client in another language must do, with nothing of fedloom's Python code.
//
//   1. Join: protocol_version 5 and the task kinds it runs ("fit", "evaluate"). The
//      answer holds the session (client_id and a secret) that every later call
//      carries, the heartbeat interval and the chunk size for uploads.
//   2. Heartbeat every heartbeat_interval_s until the end: the server ends a session it
//      has not heard from for a while (an open Tasks stream does not count).
//   3. Tasks: one server stream for the whole session. A task is a TaskHeader followed
//      by the global model in Chunks (offsets contiguous from 0, total_bytes in all);
//      the next task comes only after this one is answered. A NoTask arrives every
//      long_poll_s while there is none; NoTask.run_finished says the run is over.
//   4. A fit task: check the model's SHA-256, "train", and Push the result: a
//      ResultHeader (num_examples, base_round = the task's round - 1, the update's
//      PayloadHeader), then the update in chunks of exactly chunk_size bytes (the last
//      one shorter). The update is a delta: new weights minus the task's weights.
//   5. An evaluate task: answer with Report, the ResultHeader alone (a loss).
//   6. Leave when the run is finished.
//
// The "training" is deterministic so that a test can predict the aggregate exactly:
// every floating value w moves by -lr * w (rounded to its dtype), every integer value
// by int-step.
//
// Plaintext only (the server runs with --insecure): a real deployment uses TLS, with
// grpc.credentials.createSsl(rootCa, key, cert) in place of createInsecure().
// A production client would also join again (with backoff) when the stream breaks or
// a call answers UNAUTHENTICATED (a restarted server forgets sessions); this one exits
// with an error instead.
//
// Usage: node client.js --server HOST:PORT [--name NAME] [--lr 0.1]
//                       [--num-examples 10] [--int-step 0]

const path = require('node:path');
const { once } = require('node:events');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const {
  dtypeOf, decodePayload, encodePayload, sha256, chunksOf, roundToFloat,
} = require('./tensors');

const PROTOCOL_VERSION = 5;
const PROTO_PATH = path.join(__dirname, '..', '..', 'protos', 'fedloom', 'v1', 'fleet.proto');
const RPC_TIMEOUT_S = 30;

function parseOptions() {
  const { values } = parseArgs({
    options: {
      server: { type: 'string' },
      name: { type: 'string', default: 'node-client' },
      lr: { type: 'string', default: '0.1' },
      'num-examples': { type: 'string', default: '10' },
      'int-step': { type: 'string', default: '0' },
    },
  });
  if (!values.server) throw new Error('usage: node client.js --server HOST:PORT [options]');
  return {
    server: values.server,
    name: values.name,
    lr: Number(values.lr),
    numExamples: Number(values['num-examples']),
    intStep: Number(values['int-step']),
  };
}

function loadFleet() {
  const definition = protoLoader.loadSync(PROTO_PATH, {
    keepCase: true, // the .proto's snake_case field names
    longs: Number, // uint64 sizes, offsets and rounds: far below 2**53 here
    bytes: Buffer,
    defaults: true, // an absent field reads as its default (proto3 omits offset 0, ...)
    oneofs: true, // the oneof's name holds the member that is set: message.part === 'chunk'
  });
  return grpc.loadPackageDefinition(definition).fedloom.v1.Fleet;
}

let logName = 'node-client';
function log(message) {
  process.stderr.write(`[${logName}] ${message}\n`);
}

const deadline = (seconds) => ({ deadline: Date.now() + seconds * 1000 });

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, deadline(RPC_TIMEOUT_S), (error, response) => (
      error ? reject(error) : resolve(response)));
  });
}

// Push: the ResultHeader, then the payload's chunks, on one client stream; waits for
// the write buffer to drain, so a large update is not held in memory twice.
async function push(client, result, payload, chunkSize) {
  let call;
  const answered = new Promise((resolve, reject) => {
    call = client.Push(deadline(RPC_TIMEOUT_S + payload.length / 2 ** 20), (error, response) => (
      error ? reject(error) : resolve(response)));
  });
  const messages = [{ result }, ...chunksOf(payload, chunkSize).map((chunk) => ({ chunk }))];
  for (const message of messages) {
    if (!call.write(message)) await once(call, 'drain');
  }
  call.end();
  return answered;
}

// The deterministic "training": new = w - lr * w for floating values (rounded to the
// tensor's dtype), new = w + int-step for integer ones; returns the delta new - w.
// A bool tensor (not aggregatable) is sent back unchanged: a delta of false.
function train(weights, options) {
  return weights.map((tensor) => {
    const { kind, size } = dtypeOf(tensor.dtype);
    const step = size === 8 ? BigInt(options.intStep) : options.intStep; // 64-bit: a BigInt
    const deltaOf = {
      float: (w) => roundToFloat(tensor.dtype, -options.lr * w),
      int: () => step,
      bool: () => false,
    }[kind];
    return { ...tensor, values: tensor.values.map(deltaOf) };
  });
}

// A stand-in for a loss: the mean square of the floating values.
function meanSquare(weights) {
  const values = weights.filter((t) => dtypeOf(t.dtype).kind === 'float').flatMap((t) => t.values);
  return values.length ? values.reduce((sum, w) => sum + w * w, 0) / values.length : 0;
}

// Answer one task whose payload has arrived whole.
async function answer(client, session, joined, task, payload, options) {
  const header = { session, task_id: task.task_id, round: task.round };
  const report = (fields) => unary(client, 'Report', { result: { ...header, ...fields } });
  if (!sha256(payload).equals(task.weights.sha256)) {
    // A failure is a result too: the round goes on without this client.
    await report({ failure: { message: 'the global model failed its SHA-256 check' } });
    return;
  }
  if (task.encoding) {
    // Only a client that asked for a download codec at Join gets an encoded model.
    await report({ failure: { message: `model encoded with ${task.encoding.codec}` } });
    return;
  }
  const weights = decodePayload(task.weights.tensors, payload);
  if (task.kind === 'fit') {
    const round = task.fit.config.entries.server_round;
    log(`fit task, round ${task.round} (config server_round ${round ? round.int_value : '-'})`);
    const delta = train(weights, options);
    const update = encodePayload(delta);
    await push(client, {
      ...header,
      update: {
        tensors: delta.map(({ name, dtype, shape }) => ({ name, dtype, shape })),
        total_bytes: update.length,
        sha256: sha256(update),
      },
      fit: {
        num_examples: options.numExamples,
        // The server requires the round whose model the delta is from: the task's
        // model is the one of the round before the task's (FAILED_PRECONDITION if not).
        base_round: task.round - 1,
        metrics: { entries: { train_loss: { float_value: meanSquare(weights) } } },
      },
    }, update, joined.chunk_size);
  } else if (task.kind === 'evaluate') {
    log(`evaluate task, round ${task.round}`);
    await report({ evaluate: { num_examples: options.numExamples, loss: meanSquare(weights) } });
  } else {
    // Only "fit" and "evaluate" were asked for at Join, so no other kind is sent; were
    // one sent, a failure tells the server at once rather than at the task's deadline.
    await report({ failure: { message: `task kind ${task.kind} is not supported` } });
  }
}

// Read the session's tasks from the Tasks stream until the run is finished.
async function serveTasks(client, session, joined, options) {
  const stream = client.Tasks({ session });
  let task = null; // the task whose model is arriving: { header, parts, received }
  let finished = false;
  for await (const message of stream) {
    if (message.part === 'no_task') {
      // The server ends the stream right after a run_finished NoTask.
      finished = finished || message.no_task.run_finished;
      continue;
    }
    if (message.part === 'task') {
      task = { header: message.task, parts: [], received: 0 };
    } else if (message.part === 'chunk') {
      const { offset, data } = message.chunk;
      if (task === null) throw new Error('a chunk arrived before any task header');
      if (offset !== task.received) {
        throw new Error(`chunk at offset ${offset}, expected ${task.received}`);
      }
      task.parts.push(data);
      task.received += data.length;
    }
    // A model of 0 bytes has no chunks: its task is whole with its header.
    if (task !== null && task.received >= task.header.weights.total_bytes) {
      if (task.received > task.header.weights.total_bytes) throw new Error('too many model bytes');
      const whole = task;
      task = null;
      await answer(client, session, joined, whole.header, Buffer.concat(whole.parts), options);
    }
  }
  if (!finished) throw new Error('the task stream ended before the run finished');
}

async function main() {
  const options = parseOptions();
  logName = options.name;
  const Fleet = loadFleet();
  const client = new Fleet(options.server, grpc.credentials.createInsecure(), {
    // Chunks are at most the server's max_message_bytes, which Join tells: accept any.
    'grpc.max_receive_message_length': -1,
  });
  const joined = await unary(client, 'Join', {
    protocol_version: PROTOCOL_VERSION,
    capabilities: ['fit', 'evaluate'],
    name: options.name,
  });
  if (joined.protocol_version !== PROTOCOL_VERSION) {
    throw new Error(`the server speaks protocol ${joined.protocol_version}, `
      + `this client ${PROTOCOL_VERSION}`);
  }
  const { session } = joined;
  log(`joined as ${session.client_id}: run ${joined.run_id}, chunk_size ${joined.chunk_size}`);
  const heartbeat = setInterval(() => {
    unary(client, 'Heartbeat', { session })
      .catch((error) => log(`heartbeat failed: ${error.message}`));
  }, joined.heartbeat_interval_s * 1000);
  try {
    await serveTasks(client, session, joined, options);
  } finally {
    clearInterval(heartbeat);
  }
  await unary(client, 'Leave', { session, reason: 'run finished' });
  log('the run is finished; left');
  client.close();
}

main().catch((error) => {
  log(`error: ${error.message}`);
  process.exit(1);
});
