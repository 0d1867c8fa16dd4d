// Low-stock alert in JavaScript: minimum stock_actual and number of updates per
// (producto, mercado) window; an alert when the minimum is below `threshold`. The same
// logic, accumulator layout (state schema 1) and output as plugins/min-stock (Rust).

import { items, pack, keys, groupRows, Writer, Reader } from '../km0_sdk.js';

let threshold = 10n;

function decode(acc) {
  if (acc.length === 0) return [null, 0n];
  const r = new Reader(acc);
  const decoded = [r.optionI64(), r.u64()];
  r.end();
  return decoded;
}

function encode(min, count) {
  return new Writer().optionI64(min).u64(count).bytes();
}

const minOf = (a, b) => (a === null ? b : b === null ? a : a < b ? a : b);

export const aggregate = {
  info() {
    return {
      name: 'min-stock',
      version: '0.1.0',
      stateSchema: 1,
      fields: [{ name: 'stock_actual', type: 'int' }],
      orderedInput: false,
    };
  },
  // Reads producto and mercado from every group's key.
  keyFields() {
    return 2;
  },
  configure(config) {
    for (const [name, value] of config) {
      if (name !== 'threshold') throw `unknown config \`${name}\` (known: threshold)`;
      if (!/^-?\d+$/.test(value)) throw `config \`threshold\` must be an integer, got ${value}`;
      threshold = BigInt(value);
    }
  },
  create() {
    return encode(null, 0n);
  },
  add(groups, events) {
    const stock = events.columns[0].val;
    const out = [];
    const rows = groupRows(events);
    for (const acc of items(groups.accumulators)) {
      const [s, e] = rows.next().value;
      let [min, count] = decode(acc);
      for (let i = s; i < e; i++) min = minOf(min, stock[i]);
      out.push(encode(min, count + BigInt(e - s)));
    }
    return pack(out);
  },
  merge(left, right) {
    const out = [];
    const rights = items(right);
    for (const a of items(left)) {
      const [ma, ca] = decode(a);
      const [mb, cb] = decode(rights.next().value);
      out.push(encode(minOf(ma, mb), ca + cb));
    }
    return pack(out);
  },
  finish(groups) {
    const out = [];
    const ks = keys(groups);
    let i = 0;
    for (const acc of items(groups.accumulators)) {
      const [min, count] = decode(acc);
      if (min !== null && min < threshold) {
        const value = `{"ventana_inicio":${groups.windowStart[i]},"ventana_fin":${groups.windowEnd[i]},` +
          `"producto":${JSON.stringify(ks[i][0])},"mercado":${JSON.stringify(ks[i][1])},` +
          `"stock_minimo":${min},"actualizaciones":${count}}`;
        out.push({ group: i, value });
      }
      i++;
    }
    return out;
  },
  migrate(fromSchema, accumulators) {
    if (fromSchema !== 1) throw `min-stock (state schema 1) cannot read accumulators of state schema ${fromSchema}`;
    return accumulators;
  },
};
