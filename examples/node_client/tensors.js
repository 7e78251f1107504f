'use strict';
// Tensors on the Fleet wire (protos/fedloom/v1/fleet.proto, version 5).
//
// A payload is every tensor's elements as raw little-endian bytes in C (row-major)
// order, the tensors one after another in the order the PayloadHeader lists them: no
// padding, no alignment, no per-tensor header. A tensor of shape [] holds one element;
// a tensor with a 0 in its shape holds none. The header's sha256 is the SHA-256 of
// exactly these bytes (the header itself is not hashed), and total_bytes their count.
//
// Here a tensor is { name, dtype, shape, values }: values is a flat array in C order,
// of numbers, of BigInts for int64 and uint64, and of booleans for bool.

const crypto = require('node:crypto');

// Wire dtype name -> element size in bytes, kind, and little-endian DataView access.
const DTYPES = {
  bool: { size: 1, kind: 'bool', get: (v, o) => v.getUint8(o) !== 0, set: (v, o, x) => v.setUint8(o, x ? 1 : 0) },
  int8: { size: 1, kind: 'int', get: (v, o) => v.getInt8(o), set: (v, o, x) => v.setInt8(o, x) },
  uint8: { size: 1, kind: 'int', get: (v, o) => v.getUint8(o), set: (v, o, x) => v.setUint8(o, x) },
  int16: { size: 2, kind: 'int', get: (v, o) => v.getInt16(o, true), set: (v, o, x) => v.setInt16(o, x, true) },
  uint16: { size: 2, kind: 'int', get: (v, o) => v.getUint16(o, true), set: (v, o, x) => v.setUint16(o, x, true) },
  int32: { size: 4, kind: 'int', get: (v, o) => v.getInt32(o, true), set: (v, o, x) => v.setInt32(o, x, true) },
  uint32: { size: 4, kind: 'int', get: (v, o) => v.getUint32(o, true), set: (v, o, x) => v.setUint32(o, x, true) },
  int64: { size: 8, kind: 'int', get: (v, o) => v.getBigInt64(o, true), set: (v, o, x) => v.setBigInt64(o, BigInt(x), true) },
  uint64: { size: 8, kind: 'int', get: (v, o) => v.getBigUint64(o, true), set: (v, o, x) => v.setBigUint64(o, BigInt(x), true) },
  float16: { size: 2, kind: 'float', get: (v, o) => halfToNumber(v.getUint16(o, true)), set: (v, o, x) => v.setUint16(o, numberToHalf(x), true) },
  float32: { size: 4, kind: 'float', get: (v, o) => v.getFloat32(o, true), set: (v, o, x) => v.setFloat32(o, x, true) },
  float64: { size: 8, kind: 'float', get: (v, o) => v.getFloat64(o, true), set: (v, o, x) => v.setFloat64(o, x, true) },
};

function dtypeOf(name) {
  const dtype = DTYPES[name];
  if (!dtype) throw new Error(`unsupported dtype ${JSON.stringify(name)}`);
  return dtype;
}

function elementCount(shape) {
  return shape.reduce((count, dim) => count * Number(dim), 1); // [] -> 1 (a scalar)
}

function byteSize(specs) {
  return specs.reduce((sum, s) => sum + elementCount(s.shape) * dtypeOf(s.dtype).size, 0);
}

// Payload bytes -> tensors, for the layout a PayloadHeader lists.
function decodePayload(specs, payload) {
  if (payload.length !== byteSize(specs)) {
    throw new Error(`payload is ${payload.length} bytes, its layout needs ${byteSize(specs)}`);
  }
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  let offset = 0;
  return specs.map(({ name, dtype, shape }) => {
    const type = dtypeOf(dtype);
    const values = new Array(elementCount(shape));
    for (let i = 0; i < values.length; i += 1, offset += type.size) values[i] = type.get(view, offset);
    return { name, dtype, shape: shape.map(Number), values };
  });
}

// Tensors -> payload bytes (a Buffer).
function encodePayload(tensors) {
  const payload = Buffer.alloc(byteSize(tensors));
  const view = new DataView(payload.buffer, payload.byteOffset, payload.byteLength);
  let offset = 0;
  for (const { dtype, shape, values } of tensors) {
    const type = dtypeOf(dtype);
    if (values.length !== elementCount(shape)) throw new Error('values do not fill the shape');
    for (const value of values) {
      type.set(view, offset, value);
      offset += type.size;
    }
  }
  return payload;
}

function sha256(payload) {
  return crypto.createHash('sha256').update(payload).digest();
}

// The payload in pieces of chunkSize bytes, the last one shorter: [{ offset, data }].
// A payload of 0 bytes has no chunks.
function chunksOf(payload, chunkSize) {
  const out = [];
  for (let offset = 0; offset < payload.length; offset += chunkSize) {
    out.push({ offset, data: payload.subarray(offset, offset + chunkSize) });
  }
  return out;
}

// Round half to even, as numpy.rint (FedAvg rounds integer means this way).
function roundHalfEven(x) {
  const floor = Math.floor(x);
  const rest = x - floor;
  if (rest !== 0.5) return rest < 0.5 ? floor : floor + 1;
  return floor % 2 === 0 ? floor : floor + 1;
}

// A number rounded to a floating dtype (to nearest, ties to even).
function roundToFloat(dtype, x) {
  if (dtype === 'float32') return Math.fround(x);
  if (dtype === 'float16') return halfToNumber(numberToHalf(x));
  return x;
}

// IEEE-754 binary16 <-> number. Node 20 has no Float16Array, so by hand.
function halfToNumber(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24; // zero and subnormals
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1024 + fraction) * 2 ** (exponent - 25);
}

function numberToHalf(x) {
  if (Number.isNaN(x)) return 0x7e00;
  const sign = x < 0 || Object.is(x, -0) ? 0x8000 : 0;
  const a = Math.abs(x);
  if (a >= 65520) return sign | 0x7c00; // past the largest half (65504) by half a step
  if (a < 2 ** -14) return sign | roundHalfEven(a * 2 ** 24); // subnormal (1024: the least normal)
  let exponent = Math.floor(Math.log2(a));
  if (2 ** exponent > a) exponent -= 1; // log2 may be off by one near powers of two
  if (2 ** (exponent + 1) <= a) exponent += 1;
  let fraction = roundHalfEven((a / 2 ** exponent - 1) * 1024);
  if (fraction === 1024) {
    fraction = 0;
    exponent += 1;
  }
  if (exponent > 15) return sign | 0x7c00;
  return sign | ((exponent + 15) << 10) | fraction;
}

module.exports = {
  DTYPES, dtypeOf, elementCount, byteSize, decodePayload, encodePayload, sha256, chunksOf,
  roundHalfEven, roundToFloat,
};
