"""Guest helper for km0 plugins written in Python (componentize-py).

It plays the part of the Rust SDK (plugins/sdk): reads the packed and columnar batches of
the km0:plugin contract and writes accumulators in the same encoding as the Rust SDK
(postcard: varints, zigzag for signed integers, a 0/1 tag before an optional value), so
a savepoint taken with a Rust plugin can be deployed with its Python twin and back.
"""

import json

from wit_world.imports import types


def items(p: types.Packed):
    """The byte strings of a packed buffer."""
    start = 0
    for end in p.ends:
        yield p.bytes[start:end]
        start = end


def pack(blobs) -> types.Packed:
    out = bytearray()
    ends = []
    for b in blobs:
        out += b
        ends.append(len(out))
    return types.Packed(bytes=bytes(out), ends=ends)


def keys(groups: types.Groups):
    """The key fields of every group, as lists of strings."""
    fields = [b.decode("utf-8") for b in items(groups.keys)]
    n = groups.key_arity
    return [fields[i * n:(i + 1) * n] for i in range(len(groups.window_start))]


def group_rows(events: types.Events):
    """(start, end) row range of every group."""
    start = 0
    for end in events.group_ends:
        yield start, end
        start = end


def record(value: dict) -> str:
    """A result value as the Rust SDK writes it (serde_json: compact, UTF-8, in order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Writer:
    """postcard encoding."""

    def __init__(self):
        self.out = bytearray()

    def u64(self, n: int):
        while True:
            b = n & 0x7F
            n >>= 7
            if n:
                self.out.append(b | 0x80)
            else:
                self.out.append(b)
                return self

    def i64(self, n: int):
        return self.u64(((n << 1) ^ (n >> 63)) & 0xFFFFFFFFFFFFFFFF)

    def option_i64(self, v):
        if v is None:
            self.out.append(0)
            return self
        self.out.append(1)
        return self.i64(v)


class Reader:
    def __init__(self, b: bytes):
        self.b = b
        self.i = 0

    def u64(self) -> int:
        n, shift = 0, 0
        while True:
            if self.i >= len(self.b):
                raise ValueError("truncated accumulator")
            c = self.b[self.i]
            self.i += 1
            n |= (c & 0x7F) << shift
            if c < 0x80:
                return n
            shift += 7

    def i64(self) -> int:
        n = self.u64()
        return (n >> 1) ^ -(n & 1)

    def option_i64(self):
        if self.i >= len(self.b):
            raise ValueError("truncated accumulator")
        tag = self.b[self.i]
        self.i += 1
        return self.i64() if tag == 1 else None
