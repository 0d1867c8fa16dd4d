"""{{name}}: a km0 aggregate plugin in Python. Per key and window, the number of events and
the largest `value`; a record for every window with at least `min_count` events.

Build with `km0 plugin build .`, check with `km0 plugin test .` (runs `test/`).
The accumulator (state schema 1) is written in the Rust SDK's encoding (count as a
varint, then the optional maximum), so savepoints move between languages."""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types

import km0_sdk as sdk


def decode(acc: bytes):
    """(count, max or None); an empty accumulator is the fresh one."""
    if not acc:
        return 0, None
    r = sdk.Reader(acc)
    decoded = r.u64(), r.option_i64()
    r.end()
    return decoded


def encode(count, maximum) -> bytes:
    return bytes(sdk.Writer().u64(count).option_i64(maximum).out)


def larger(a, b):
    return b if a is None else (a if b is None else max(a, b))


class Aggregate(exports.Aggregate):
    min_count = 1

    def info(self) -> types.PluginInfo:
        return types.PluginInfo(
            name="{{name}}",
            version="0.1.0",
            state_schema=1,
            fields=[types.Field(name="value", type=types.FieldType.INT)],
            ordered_input=False,
        )

    def key_fields(self) -> int:
        # How many key fields this logic reads (0: any; the key is reported whole).
        return 0

    def configure(self, config):
        for name, value in config:
            if name != "min_count":
                raise Err(f"unknown config `{name}` (known: min_count)")
            v = json.loads(value)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise Err(f"config `min_count` must be an integer >= 0, got {value}")
            Aggregate.min_count = v

    def create(self) -> bytes:
        return encode(0, None)

    def add(self, groups, events):
        values = events.columns[0].value
        out = []
        for acc, (s, e) in zip(sdk.items(groups.accumulators), sdk.group_rows(events)):
            count, maximum = decode(acc)
            if e > s:
                maximum = larger(maximum, max(values[s:e]))
            out.append(encode(count + (e - s), maximum))
        return sdk.pack(out)

    def merge(self, left, right):
        out = []
        for a, b in zip(sdk.items(left), sdk.items(right)):
            (ca, ma), (cb, mb) = decode(a), decode(b)
            out.append(encode(ca + cb, larger(ma, mb)))
        return sdk.pack(out)

    def finish(self, groups):
        out = []
        for i, (acc, key) in enumerate(zip(sdk.items(groups.accumulators), sdk.keys(groups))):
            count, maximum = decode(acc)
            if count >= Aggregate.min_count:
                value = {
                    "window_start": groups.window_start[i],
                    "window_end": groups.window_end[i],
                    "key": key,
                    "count": count,
                    "max": maximum,
                }
                out.append(types.Emitted(group=i, value=sdk.record(value)))
        return out

    def migrate(self, from_schema, accumulators):
        if from_schema != 1:
            raise Err(f"{{name}} (state schema 1) cannot read accumulators of state schema {from_schema}")
        return accumulators
