"""Low-stock alert in Python: minimum stock_actual and number of updates per
(producto, mercado) window; an alert when the minimum is below `threshold`. The same
logic, accumulator layout (state schema 1) and output as plugins/min-stock (Rust)."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types

import km0_sdk as sdk


def decode(acc: bytes):
    """(min or None, count); an empty accumulator is the fresh one."""
    if not acc:
        return None, 0
    r = sdk.Reader(acc)
    decoded = r.option_i64(), r.u64()
    r.end()
    return decoded


def encode(minimum, count) -> bytes:
    return bytes(sdk.Writer().option_i64(minimum).u64(count).out)


class Aggregate(exports.Aggregate):
    threshold = 10

    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="min-stock",
            version="0.1.0",
            state_schema=1,
            fields=[types.Field(name="stock_actual", type=types.FieldType.INT)],
            ordered_input=False,
        )

    def key_fields(self) -> int:
        # Reads producto and mercado from every group's key.
        return 2

    def configure(self, config):
        for name, value in config:
            if name != "threshold":
                raise Err(f"unknown config `{name}` (known: threshold)")
            v = json.loads(value)
            if not isinstance(v, int) or isinstance(v, bool):
                raise Err(f"config `threshold` must be an integer, got {value}")
            Aggregate.threshold = v

    def create(self) -> bytes:
        return encode(None, 0)

    def add(self, groups, events):
        stock = events.columns[0].value
        out = []
        for acc, (s, e) in zip(sdk.items(groups.accumulators), sdk.group_rows(events)):
            minimum, count = decode(acc)
            if e > s:
                m = min(stock[s:e])
                minimum = m if minimum is None else min(minimum, m)
            out.append(encode(minimum, count + (e - s)))
        return sdk.pack(out)

    def merge(self, left, right):
        out = []
        for a, b in zip(sdk.items(left), sdk.items(right)):
            (ma, ca), (mb, cb) = decode(a), decode(b)
            m = mb if ma is None else (ma if mb is None else min(ma, mb))
            out.append(encode(m, ca + cb))
        return sdk.pack(out)

    def finish(self, groups):
        out = []
        for i, (acc, key) in enumerate(zip(sdk.items(groups.accumulators), sdk.keys(groups))):
            minimum, count = decode(acc)
            if minimum is not None and minimum < Aggregate.threshold:
                value = {
                    "ventana_inicio": groups.window_start[i],
                    "ventana_fin": groups.window_end[i],
                    "producto": key[0],
                    "mercado": key[1],
                    "stock_minimo": minimum,
                    "actualizaciones": count,
                }
                out.append(types.Emitted(group=i, value=sdk.record(value)))
        return out

    def migrate(self, from_schema, accumulators):
        if from_schema != 1:
            raise Err(f"min-stock (state schema 1) cannot read accumulators of state schema {from_schema}")
        return accumulators
