// {{name}}: a km0 aggregate plugin in JavaScript. Per key and window, the number of events
// and the largest `value`; a record for every window with at least `min_count` events.
//
// Build with `km0 plugin build .`, check with `km0 plugin test .` (runs `test/`).
// The accumulator (state schema 1) is written in the Rust SDK's encoding (count as a
// varint, then the optional maximum), so savepoints move between languages.

import { items, pack, keys, groupRows, Writer, Reader } from './km0_sdk.js';

let minCount = 1n;

function decode(acc) {
  if (acc.length === 0) return [0n, null];
  const r = new Reader(acc);
  const decoded = [r.u64(), r.optionI64()];
  r.end();
  return decoded;
}

function encode(count, max) {
  return new Writer().u64(count).optionI64(max).bytes();
}

const larger = (a, b) => (a === null ? b : b === null ? a : a > b ? a : b);

export const aggregate = {
  info() {
    return {
      name: '{{name}}',
      version: '0.1.0',
      stateSchema: 1,
      fields: [{ name: 'value', type: 'int' }],
      orderedInput: false,
    };
  },
  // How many key fields this logic reads (0: any; the key is reported whole).
  keyFields() {
    return 0;
  },
  configure(config) {
    for (const [name, value] of config) {
      if (name !== 'min_count') throw `unknown config \`${name}\` (known: min_count)`;
      if (!/^\d+$/.test(value)) throw `config \`min_count\` must be an integer >= 0, got ${value}`;
      minCount = BigInt(value);
    }
  },
  create() {
    return encode(0n, null);
  },
  add(groups, events) {
    const values = events.columns[0].val;
    const out = [];
    const rows = groupRows(events);
    for (const acc of items(groups.accumulators)) {
      const [s, e] = rows.next().value;
      let [count, max] = decode(acc);
      for (let i = s; i < e; i++) max = larger(max, values[i]);
      out.push(encode(count + BigInt(e - s), max));
    }
    return pack(out);
  },
  merge(left, right) {
    const out = [];
    const rights = items(right);
    for (const a of items(left)) {
      const [ca, ma] = decode(a);
      const [cb, mb] = decode(rights.next().value);
      out.push(encode(ca + cb, larger(ma, mb)));
    }
    return pack(out);
  },
  finish(groups) {
    const out = [];
    const ks = keys(groups);
    let i = 0;
    for (const acc of items(groups.accumulators)) {
      const [count, max] = decode(acc);
      if (count >= minCount) {
        // BigInt is not JSON-serialisable: write the record by hand, fields in order.
        const value = `{"window_start":${groups.windowStart[i]},"window_end":${groups.windowEnd[i]},` +
          `"key":${JSON.stringify(ks[i])},"count":${count},"max":${max === null ? 'null' : max}}`;
        out.push({ group: i, value });
      }
      i++;
    }
    return out;
  },
  migrate(fromSchema, accumulators) {
    if (fromSchema !== 1) throw `{{name}} (state schema 1) cannot read accumulators of state schema ${fromSchema}`;
    return accumulators;
  },
};
