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
    """A result value as the Rust SDK writes it (serde_json: compact, UTF-8, in order;
    NaN and infinities as null; floats as Rust writes them: 1e+16, 1e-7, 0.00001, 1.0)."""
    return _Encoder(separators=(",", ":"), ensure_ascii=False).encode(_floats(value))


class _RustFloat(float):
    """A float that JSON-encodes the way serde_json (ryu) writes it."""

    def __repr__(self):
        return rust_float(float(self))


def _floats(v):
    if isinstance(v, float):
        return None if v != v or v in (float("inf"), float("-inf")) else _RustFloat(v)
    if isinstance(v, dict):
        return {k: _floats(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_floats(x) for x in v]
    return v


class _Encoder(json.JSONEncoder):
    def iterencode(self, o, _one_shot=False):
        # The C encoder formats floats with float.__repr__: use the Python one, which
        # calls repr() on floats, hence _RustFloat.__repr__.
        return json.encoder._make_iterencode(
            {}, self.default, json.encoder.py_encode_basestring, self.indent, repr,
            self.key_separator, self.item_separator, self.sort_keys, self.skipkeys, _one_shot,
        )(o, 0)


def rust_float(x: float) -> str:
    """A finite float as Rust's serde_json writes it: shortest round-trip digits; plain
    notation with at least one decimal when the point falls within 16 digits before or 5
    after the first digit, else `<d>[.<ddd>]e<exp>` (`e+16`, `e-7`)."""
    if x == 0.0:
        return "-0.0" if str(x).startswith("-") else "0.0"
    sign = "-" if x < 0 else ""
    mantissa, _, exp = f"{abs(x):.17e}".partition("e")
    # Shortest digits that round-trip: repr() has them.
    r = repr(abs(x))
    if "e" in r:
        m, _, e = r.partition("e")
        digits, point = m.replace(".", ""), int(e) + 1
    else:
        whole, _, frac = r.partition(".")
        frac = frac.rstrip("0")
        if whole != "0":
            digits, point = (whole + frac), len(whole)
        else:
            stripped = frac.lstrip("0")
            digits, point = stripped, -(len(frac) - len(stripped))
    digits = digits.lstrip("0").rstrip("0") or "0"
    if 0 < point <= 16:
        if len(digits) <= point:
            return f"{sign}{digits}{'0' * (point - len(digits))}.0"
        return f"{sign}{digits[:point]}.{digits[point:]}"
    if -5 < point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    e = point - 1
    body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{body}e{'+' if e > 0 else ''}{e}"


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
    """postcard decoding, as strict as the Rust SDK's: a varint of at most 10 bytes that
    fits 64 bits, an option tag of 0 or 1, and (with `end`) no bytes left over."""

    def __init__(self, b: bytes):
        self.b = b
        self.i = 0

    def u64(self) -> int:
        n, shift = 0, 0
        for _ in range(10):
            if self.i >= len(self.b):
                raise ValueError("truncated accumulator")
            c = self.b[self.i]
            self.i += 1
            n |= (c & 0x7F) << shift
            if c < 0x80:
                if n >> 64:
                    raise ValueError("varint out of range in accumulator")
                return n
            shift += 7
        raise ValueError("varint longer than 10 bytes in accumulator")

    def end(self):
        """The accumulator must hold nothing more."""
        if self.i != len(self.b):
            raise ValueError(f"{len(self.b) - self.i} bytes left over in accumulator")
        return self

    def i64(self) -> int:
        n = self.u64()
        return (n >> 1) ^ -(n & 1)

    def option_i64(self):
        if self.i >= len(self.b):
            raise ValueError("truncated accumulator")
        tag = self.b[self.i]
        self.i += 1
        if tag > 1:
            raise ValueError(f"option tag {tag} in accumulator")
        return self.i64() if tag == 1 else None
