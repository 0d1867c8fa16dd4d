// Guest helper for km0 plugins written in JavaScript (componentize-js). It plays the part
// of the Rust SDK (plugins/sdk): reads the packed and columnar batches of the km0:plugin
// contract and writes accumulators in the Rust SDK's encoding (postcard: varints, zigzag
// for signed integers, a 0/1 tag before an optional value), so savepoints move between
// the Rust, Python and JavaScript versions of a plugin.

/** The byte strings of a packed buffer. */
export function* items(p) {
  let start = 0;
  for (const end of p.ends) {
    yield p.bytes.subarray(start, end);
    start = end;
  }
}

export function pack(blobs) {
  const ends = new Uint32Array(blobs.length);
  let len = 0;
  blobs.forEach((b, i) => { len += b.length; ends[i] = len; });
  const bytes = new Uint8Array(len);
  let at = 0;
  for (const b of blobs) { bytes.set(b, at); at += b.length; }
  return { bytes, ends };
}

const utf8 = new TextDecoder();

/** The key fields of every group, as arrays of strings. */
export function keys(groups) {
  const fields = [...items(groups.keys)].map((b) => utf8.decode(b));
  const n = groups.keyArity;
  return Array.from(groups.windowStart, (_, i) => fields.slice(i * n, (i + 1) * n));
}

/** [start, end) row range of every group. */
export function* groupRows(events) {
  let start = 0;
  for (const end of events.groupEnds) {
    yield [start, end];
    start = end;
  }
}

export class Writer {
  constructor() { this.out = []; }
  u64(n) {
    n = BigInt.asUintN(64, BigInt(n));
    for (;;) {
      const b = Number(n & 0x7fn);
      n >>= 7n;
      if (n) { this.out.push(b | 0x80); } else { this.out.push(b); return this; }
    }
  }
  i64(n) {
    n = BigInt.asIntN(64, BigInt(n));
    return this.u64(BigInt.asUintN(64, (n << 1n) ^ (n >> 63n)));
  }
  optionI64(v) {
    if (v === null) { this.out.push(0); return this; }
    this.out.push(1);
    return this.i64(v);
  }
  bytes() { return Uint8Array.from(this.out); }
}

/** postcard decoding, as strict as the Rust SDK's: a varint of at most 10 bytes that
 * fits 64 bits, an option tag of 0 or 1, and (with `end`) no bytes left over. */
export class Reader {
  constructor(b) { this.b = b; this.i = 0; }
  u64() {
    let n = 0n;
    let shift = 0n;
    for (let k = 0; k < 10; k++) {
      if (this.i >= this.b.length) throw new Error('truncated accumulator');
      const c = this.b[this.i++];
      n |= BigInt(c & 0x7f) << shift;
      if (c < 0x80) {
        if (n >> 64n) throw new Error('varint out of range in accumulator');
        return n;
      }
      shift += 7n;
    }
    throw new Error('varint longer than 10 bytes in accumulator');
  }
  end() {
    if (this.i !== this.b.length) throw new Error(`${this.b.length - this.i} bytes left over in accumulator`);
    return this;
  }
  i64() {
    const n = this.u64();
    return BigInt.asIntN(64, (n >> 1n) ^ -(n & 1n));
  }
  optionI64() {
    if (this.i >= this.b.length) throw new Error('truncated accumulator');
    const tag = this.b[this.i++];
    if (tag > 1) throw new Error(`option tag ${tag} in accumulator`);
    return tag === 1 ? this.i64() : null;
  }
}
