//! Benchmark: km0's JSON projection scanner (`km0::source::json::Projection`) against
//! sonic-rs (lazy field access, and serde), simd-json (serde, and its DOM) and serde_json,
//! on the streams `make bench` times: the stock alert's default stream (1 000 keys), its
//! 10 000-key stream, and the delivery panel's positions. Each parser pulls out the
//! fields the job reads, typed (strings, integers, floats), and every one of them must
//! give the same digest of those values over the stream, or the benchmark fails: they
//! are compared doing the same work. Then a corpus of malformed records shows what each
//! refuses (`km0` turns a refused record into a dead letter with the reason).
//!
//! Run: `cargo bench --workspace --bench json` (`KM0_BENCH_RECORDS` sets each stream's
//! size, 1 000 000 by default). Prints ns per record, best of 5 rounds, by thread CPU time.

use km0::generate::{delivery_stream, stock_stream, DeliveryStream, StockStream};
use km0::metrics::thread_cpu_time;
use km0::source::json::{number_f64, unescape, Projection, Scalar};
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use sonic_rs::{JsonNumberTrait, JsonValueTrait, PointerTree};
use std::borrow::Cow;
use std::time::Duration;

/// How a job reads a field.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Str,
    Int,
    Float,
}

/// A projected value, as a parser gives it.
enum Val<'a> {
    Absent,
    Str(Cow<'a, [u8]>),
    Int(i64),
    Float(f64),
    /// A boolean, null, object or array.
    Other,
}

/// What a stream's records yield: the values of its complete records folded, and how
/// many records were refused as JSON or lacked a field of the right kind.
#[derive(Clone, Copy, Default, PartialEq, Debug)]
struct Digest {
    complete: u64,
    incomplete: u64,
    refused: u64,
    hash: u64,
}

impl Digest {
    fn mix(&mut self, x: u64) {
        self.hash = (self.hash ^ x).wrapping_mul(0x0000_0100_0000_01b3);
    }

    /// One record's values, field by field in the projection's order.
    fn record(&mut self, kinds: &[Kind], vals: &[Val]) {
        let fits = kinds.iter().zip(vals).all(|(k, v)| {
            matches!(
                (k, v),
                (Kind::Str, Val::Str(_))
                    | (Kind::Int, Val::Int(_))
                    | (Kind::Float, Val::Float(_) | Val::Int(_))
            )
        });
        if !fits {
            self.incomplete += 1;
            return;
        }
        self.complete += 1;
        for v in vals {
            match v {
                // A kind tag first, and a string's length: "ab","c" and "a","bc" differ.
                Val::Str(s) => {
                    self.mix(1);
                    self.mix(s.len() as u64);
                    s.iter().for_each(|&c| self.mix(c as u64));
                }
                Val::Int(i) => {
                    self.mix(2);
                    self.mix(*i as u64);
                }
                Val::Float(f) => {
                    self.mix(3);
                    self.mix(f.to_bits());
                }
                Val::Absent | Val::Other => {}
            }
        }
    }
}

/// Which job's records a stream holds (and so which serde struct reads them).
#[derive(Clone, Copy, PartialEq)]
enum Job {
    Stock,
    Panel,
}

/// The fields the stock alert's job reads, in its projection's order (time, filter, key,
/// plugin field), and the delivery panel's.
const STOCK_FIELDS: &[(&str, Kind)] = &[
    ("fecha_ms", Kind::Int),
    ("tipo", Kind::Str),
    ("producto", Kind::Str),
    ("mercado", Kind::Str),
    ("stock_actual", Kind::Int),
];
const PANEL_FIELDS: &[(&str, Kind)] =
    &[("fecha_ms", Kind::Int), ("repartidor", Kind::Str), ("lat", Kind::Float), ("lon", Kind::Float)];

/// One stream: its records, line by line, and the fields its job reads.
struct Stream {
    name: &'static str,
    job: Job,
    data: Vec<u8>,
    lines: Vec<(usize, usize)>,
    fields: &'static [(&'static str, Kind)],
}

impl Stream {
    fn new(name: &'static str, job: Job, data: Vec<u8>) -> Stream {
        let fields = match job {
            Job::Stock => STOCK_FIELDS,
            Job::Panel => PANEL_FIELDS,
        };
        let mut lines = Vec::new();
        let mut start = 0;
        for (i, &c) in data.iter().enumerate() {
            if c == b'\n' {
                lines.push((start, i));
                start = i + 1;
            }
        }
        if start < data.len() {
            lines.push((start, data.len()));
        }
        Stream { name, job, data, lines, fields }
    }

    fn names(&self) -> Vec<&'static str> {
        self.fields.iter().map(|f| f.0).collect()
    }

    fn kinds(&self) -> Vec<Kind> {
        self.fields.iter().map(|f| f.1).collect()
    }

    fn lines(&self) -> impl Iterator<Item = &[u8]> {
        self.lines.iter().map(|&(a, b)| &self.data[a..b])
    }
}

const MAX_FIELDS: usize = 8;

/// A km0 scalar as the job reads it. An unescaped string's UTF-8 is not checked here, as
/// the job does not check it per record either: it checks a key's once, when it first
/// sees the key (the other parsers check every string they read).
fn km0_val<'a>(s: &Option<Scalar<'a>>) -> Val<'a> {
    match *s {
        None => Val::Absent,
        Some(Scalar::Str { raw, escaped: false }) => Val::Str(Cow::Borrowed(raw)),
        Some(Scalar::Str { raw, escaped: true }) => match unescape(raw) {
            Ok(s) => Val::Str(Cow::Owned(s.into_bytes())),
            Err(_) => Val::Other,
        },
        Some(Scalar::Int(i)) => Val::Int(i),
        Some(Scalar::Number(raw)) => number_f64(raw).map_or(Val::Other, Val::Float),
        Some(_) => Val::Other,
    }
}

/// km0 as its file source reads: each record scanned where it lies in the input, which
/// finds its end too; a record the scan cannot take is found by its line break first.
fn km0_framed(s: &Stream) -> Digest {
    let (names, kinds) = (s.names(), s.kinds());
    let mut p = Projection::new(&names);
    let mut slots = [None; MAX_FIELDS];
    let slots = &mut slots[..names.len()];
    let mut d = Digest::default();
    let (b, mut at) = (&s.data[..], 0);
    while at < b.len() {
        if p.frames() {
            if let Some(len) = p.scan_framed(&b[at..], slots) {
                d.record(&kinds, &slots.iter().map(km0_val).collect::<Vals>());
                at += len;
                at += if b[at] == b'\r' { 2 } else { 1 };
                continue;
            }
        }
        let end = memchr::memchr(b'\n', &b[at..]).map_or(b.len(), |n| at + n);
        let line = b[at..end].strip_suffix(b"\r").unwrap_or(&b[at..end]);
        km0_fold(&mut p, line, slots, &kinds, &mut d);
        at = end + 1;
    }
    d
}

fn km0_fold<'a>(
    p: &mut Projection,
    line: &'a [u8],
    slots: &mut [Option<Scalar<'a>>],
    kinds: &[Kind],
    d: &mut Digest,
) {
    match p.scan(line, slots) {
        Ok(()) => d.record(kinds, &slots.iter().map(km0_val).collect::<Vals>()),
        Err(_) => d.refused += 1,
    }
}

/// km0's scan of each line, the lines found beforehand (as every other parser here).
fn km0_lines(s: &Stream) -> Digest {
    let (names, kinds) = (s.names(), s.kinds());
    let mut p = Projection::new(&names);
    let mut slots = [None; MAX_FIELDS];
    let mut d = Digest::default();
    for line in s.lines() {
        km0_fold(&mut p, line, &mut slots[..names.len()], &kinds, &mut d);
    }
    d
}

fn sonic_val<'b>(v: &'b Option<sonic_rs::LazyValue>) -> Val<'b> {
    let Some(v) = v else { return Val::Absent };
    // By the type its first byte gives: each accessor of a lazy value parses it again.
    match v.get_type() {
        sonic_rs::JsonType::String => {
            v.as_str().map_or(Val::Other, |s| Val::Str(Cow::Borrowed(s.as_bytes())))
        }
        sonic_rs::JsonType::Number => match v.as_number() {
            Some(n) => n.as_i64().map(Val::Int).or_else(|| n.as_f64().map(Val::Float)).unwrap_or(Val::Other),
            None => Val::Other,
        },
        _ => Val::Other,
    }
}

/// sonic-rs's lazy access: the projected fields of each line, the rest skipped. Checked,
/// it validates what it reads (UTF-8 included) but stops once it has every field, so it
/// takes a record cut short after them (see the corpus); with `CHECKED` false it
/// validates nothing (`get_many_unchecked`: what skipping costs without checking).
fn sonic_lazy<const CHECKED: bool>(s: &Stream) -> Digest {
    let kinds = s.kinds();
    let mut tree = PointerTree::new();
    for name in s.names() {
        tree.add_path([name]);
    }
    let mut d = Digest::default();
    for line in s.lines() {
        let got = match CHECKED {
            true => sonic_rs::get_many(line, &tree),
            // SAFETY: `main` runs this only over a stream that is UTF-8 throughout and of
            // which serde_json, a full validator, refused no record: valid JSON.
            false => unsafe { sonic_rs::get_many_unchecked(line, &tree) },
        };
        match got {
            Ok(vals) => d.record(&kinds, &vals.iter().map(sonic_val).collect::<Vals>()),
            Err(_) => d.refused += 1,
        }
    }
    d
}

/// sonic-rs's lazy object iterator: each field of each line, the projected ones kept
/// (the last one wins), the others skipped (and validated).
fn sonic_iter(s: &Stream) -> Digest {
    let (names, kinds) = (s.names(), s.kinds());
    let mut d = Digest::default();
    'line: for line in s.lines() {
        let mut vals: [Option<sonic_rs::LazyValue>; MAX_FIELDS] = Default::default();
        for field in sonic_rs::to_object_iter(line) {
            let Ok((name, value)) = field else {
                d.refused += 1;
                continue 'line;
            };
            if let Some(i) = names.iter().position(|&n| n == name) {
                vals[i] = Some(value);
            }
        }
        d.record(&kinds, &vals[..names.len()].iter().map(sonic_val).collect::<Vals>());
    }
    d
}

type Vals<'a> = smallvec::SmallVec<[Val<'a>; MAX_FIELDS]>;

/// Any JSON value, deserialized through serde the way a struct's field is: strings
/// borrowed where they can be, numbers typed, the rest skipped.
struct Any<'a>(Val<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for Any<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Any<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Any<'de>, E> {
                Ok(Any(Val::Str(Cow::Borrowed(v.as_bytes()))))
            }
            fn visit_str<E>(self, v: &str) -> Result<Any<'de>, E> {
                Ok(Any(Val::Str(Cow::Owned(v.as_bytes().to_vec()))))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Any<'de>, E> {
                Ok(Any(Val::Int(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Any<'de>, E> {
                Ok(Any(i64::try_from(v).map_or(Val::Float(v as f64), Val::Int)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Any<'de>, E> {
                Ok(Any(Val::Float(v)))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Any<'de>, E> {
                Ok(Any(Val::Other))
            }
            fn visit_unit<E>(self) -> Result<Any<'de>, E> {
                Ok(Any(Val::Other))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Any<'de>, A::Error> {
                while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Any(Val::Other))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Any<'de>, A::Error> {
                while s.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Any(Val::Other))
            }
        }
        d.deserialize_any(V)
    }
}

fn any(v: Option<Any>) -> Val {
    v.map_or(Val::Absent, |a| a.0)
}

/// The stock alert's record as a serde struct: the fields its job reads, in the
/// projection's order (time, filter, key, plugin field).
#[derive(serde::Deserialize)]
struct StockEvent<'a> {
    #[serde(borrow)]
    fecha_ms: Option<Any<'a>>,
    #[serde(borrow)]
    tipo: Option<Any<'a>>,
    #[serde(borrow)]
    producto: Option<Any<'a>>,
    #[serde(borrow)]
    mercado: Option<Any<'a>>,
    #[serde(borrow)]
    stock_actual: Option<Any<'a>>,
}

/// The delivery panel's record.
#[derive(serde::Deserialize)]
struct Position<'a> {
    #[serde(borrow)]
    fecha_ms: Option<Any<'a>>,
    #[serde(borrow)]
    repartidor: Option<Any<'a>>,
    #[serde(borrow)]
    lat: Option<Any<'a>>,
    #[serde(borrow)]
    lon: Option<Any<'a>>,
}

impl<'a> StockEvent<'a> {
    fn vals(self) -> Vals<'a> {
        smallvec::smallvec![
            any(self.fecha_ms),
            any(self.tipo),
            any(self.producto),
            any(self.mercado),
            any(self.stock_actual)
        ]
    }
}

impl<'a> Position<'a> {
    fn vals(self) -> Vals<'a> {
        smallvec::smallvec![any(self.fecha_ms), any(self.repartidor), any(self.lat), any(self.lon)]
    }
}

/// A serde parser over each line of the stream, into the stream's record struct: `$body`
/// gives a `Result` of it from `$line` (`$scratch`: a buffer to copy the line into, for
/// parsers that parse in place).
macro_rules! serde_lines {
    ($s:expr, |$line:ident, $scratch:ident| $body:expr) => {{
        let s: &Stream = $s;
        let kinds = s.kinds();
        let (mut d, mut scratch) = (Digest::default(), Vec::<u8>::new());
        for $line in s.lines() {
            let $scratch = &mut scratch;
            let vals = match s.job {
                Job::Panel => $body.map(Position::vals),
                Job::Stock => $body.map(StockEvent::vals),
            };
            match vals {
                Ok(vals) => d.record(&kinds, &vals),
                Err(_) => d.refused += 1,
            }
        }
        d
    }};
}

fn sonic_serde(s: &Stream) -> Digest {
    serde_lines!(s, |line, _scratch| sonic_rs::from_slice(line))
}

fn serde_json_serde(s: &Stream) -> Digest {
    serde_lines!(s, |line, _scratch| serde_json::from_slice(line))
}

/// simd-json parses in place: each line is copied into a buffer first (counted).
fn simd_serde(s: &Stream) -> Digest {
    let mut buffers = simd_json::Buffers::default();
    serde_lines!(s, |line, scratch| {
        scratch.clear();
        scratch.extend_from_slice(line);
        simd_json::serde::from_slice_with_buffers(scratch, &mut buffers)
    })
}

/// simd-json's DOM (`to_borrowed_value`), its fields looked up by name.
fn simd_dom(s: &Stream) -> Digest {
    use simd_json::prelude::*;
    let (names, kinds) = (s.names(), s.kinds());
    let mut buffers = simd_json::Buffers::default();
    let (mut d, mut scratch) = (Digest::default(), Vec::<u8>::new());
    for line in s.lines() {
        scratch.clear();
        scratch.extend_from_slice(line);
        let Ok(v) = simd_json::to_borrowed_value_with_buffers(&mut scratch, &mut buffers) else {
            d.refused += 1;
            continue;
        };
        let vals: Vals = names
            .iter()
            .map(|&n| match v.get(n) {
                None => Val::Absent,
                Some(f) => {
                    if let Some(i) = f.as_i64() {
                        Val::Int(i)
                    } else if let Some(x) = f.as_f64() {
                        Val::Float(x)
                    } else if let Some(t) = f.as_str() {
                        Val::Str(Cow::Borrowed(t.as_bytes()))
                    } else {
                        Val::Other
                    }
                }
            })
            .collect();
        d.record(&kinds, &vals);
    }
    d
}

type Parser = fn(&Stream) -> Digest;

/// How much of a record a parser checks to be JSON.
#[derive(Clone, Copy, PartialEq)]
enum Checks {
    /// All of it: syntax, the end of the object, UTF-8 (km0 and serde_json: of the
    /// strings they read).
    All,
    /// What it reads before it has its fields (sonic-rs's lazy ways; see the corpus).
    Part,
    /// Nothing: valid JSON is assumed.
    Nothing,
}

impl Checks {
    fn tag(self) -> &'static str {
        match self {
            Checks::All => "checks all",
            Checks::Part => "checks part",
            Checks::Nothing => "checks nothing",
        }
    }
}

/// The parsers compared, in the table's order; the first is km0's baseline.
const PARSERS: &[(&str, Checks, Parser)] = &[
    ("km0 projection, as the job reads (framed)", Checks::All, km0_framed),
    ("km0 projection, line by line", Checks::All, km0_lines),
    ("sonic-rs get_many (lazy)", Checks::Part, sonic_lazy::<true>),
    ("sonic-rs to_object_iter (lazy)", Checks::Part, sonic_iter),
    ("sonic-rs from_slice into a struct", Checks::All, sonic_serde),
    ("simd-json serde into a struct", Checks::All, simd_serde),
    ("simd-json borrowed DOM", Checks::All, simd_dom),
    ("serde_json from_slice into a struct", Checks::All, serde_json_serde),
    ("sonic-rs get_many_unchecked", Checks::Nothing, sonic_lazy::<false>),
];

fn streams(records: u64) -> Vec<Stream> {
    let stock = |spec: &StockStream| {
        let mut data = Vec::new();
        stock_stream(spec, &mut data).map(|_| data)
    };
    let default = StockStream { events: records, ..Default::default() };
    // `make bench`'s 10 000-key case: an event every 8 ms, 1% late.
    let many = StockStream {
        events: records,
        products: 500,
        markets: 20,
        gap_ms: 8,
        late_fraction: 0.01,
        ..default
    };
    let riders = 140;
    let minutes = (records / (riders * 6)).max(1) as u32;
    let mut positions = Vec::new();
    let spec = DeliveryStream { minutes, riders: riders as u32, ..Default::default() };
    let written = delivery_stream(&spec, &mut positions).map(|_| positions);
    let (Ok(default), Ok(many), Ok(positions)) = (stock(&default), stock(&many), written) else {
        panic!("bench json: writing the streams to memory failed");
    };
    vec![
        Stream::new("stock alert, 1 000 keys", Job::Stock, default),
        Stream::new("stock alert, 10 000 keys", Job::Stock, many),
        Stream::new("delivery panel, 140 riders", Job::Panel, positions),
    ]
}

/// Malformed records (and two well-formed ones), each with the stock alert's five fields:
/// taken by a parser when it reads them all, of the right kinds.
const CORPUS: &[(&str, &[u8])] = &[
    ("well-formed", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#),
    (
        "well-formed, escapes and nesting",
        br#"{"tipo": "a", "producto": "mi\u00e9l", "x": [1, {"y": null}], "mercado": "gi\"rona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    ("cut short", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1"#),
    ("not JSON", b"a miel girona 7 1"),
    ("bytes after the object", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1} x"#),
    (
        "a second object after it",
        br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1} {}"#,
    ),
    ("trailing comma", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1,}"#),
    ("missing colon", br#"{"tipo": "a", "producto" "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#),
    ("leading zero", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 07, "fecha_ms": 1}"#),
    (
        "a dot with no digits in a skipped value",
        br#"{"tipo": "a", "producto": "miel", "x": 7., "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    (
        "a bad literal in a skipped value",
        br#"{"tipo": "a", "producto": "miel", "ok": tru, "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    (
        "a bad escape in a skipped string",
        br#"{"tipo": "a", "producto": "miel", "nota": "a\qb", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    (
        "a raw tab in a skipped string",
        b"{\"tipo\": \"a\", \"producto\": \"miel\", \"nota\": \"a\tb\", \"mercado\": \"girona\", \"stock_actual\": 7, \"fecha_ms\": 1}",
    ),
    (
        "invalid UTF-8 in a skipped string",
        b"{\"tipo\": \"a\", \"producto\": \"miel\", \"nota\": \"a\xff\", \"mercado\": \"girona\", \"stock_actual\": 7, \"fecha_ms\": 1}",
    ),
    (
        "invalid UTF-8 in a key field (km0's job: a dead letter when it first sees the key)",
        b"{\"tipo\": \"a\", \"producto\": \"mi\xffl\", \"mercado\": \"girona\", \"stock_actual\": 7, \"fecha_ms\": 1}",
    ),
    (
        "an unclosed array in a skipped value",
        br#"{"tipo": "a", "producto": "miel", "x": [1, 2, "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    (
        "a bad value after the last projected field",
        br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1, "x": [1,,2]}"#,
    ),
    (
        "a lone surrogate escape in a key field",
        br#"{"tipo": "a", "producto": "\ud800", "mercado": "girona", "stock_actual": 7, "fecha_ms": 1}"#,
    ),
    ("a string where a number is read", br#"{"tipo": "a", "producto": "miel", "mercado": "girona", "stock_actual": "7", "fecha_ms": 1}"#),
];

/// Whether each parser reads the stock alert's five fields from `record` (Some(true)) or
/// not; None for the one that checks nothing (not tried: it assumes valid JSON).
fn verdicts(record: &[u8]) -> Vec<Option<bool>> {
    let stream = Stream::new("corpus", Job::Stock, record.to_vec());
    PARSERS
        .iter()
        .map(|&(_, checks, parse)| (checks != Checks::Nothing).then(|| parse(&stream).complete == 1))
        .collect()
}

fn main() {
    let records: u64 =
        std::env::var("KM0_BENCH_RECORDS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000_000);
    let rounds = 5;
    let mut failed = false;
    for stream in streams(records) {
        let n = stream.lines.len() as f64;
        let bytes = stream.data.len() as f64 / n;
        // Every parser gives the stream's values alike, or they are not doing the same work;
        // and most records have every field, or the fields were misnamed.
        let want = km0_lines(&stream);
        if want.complete * 2 < stream.lines.len() as u64 {
            eprintln!(
                "bench json: {}: only {} of its records have the fields read",
                stream.name, want.complete
            );
            failed = true;
        }
        let valid = std::str::from_utf8(&stream.data).is_ok() && serde_json_serde(&stream).refused == 0;
        let mut digests = Vec::new();
        for &(name, checks, parse) in PARSERS {
            if checks == Checks::Nothing && !valid {
                digests.push(None);
                continue;
            }
            let got = parse(&stream);
            if got != want {
                eprintln!("bench json: {}: {name} read {got:?}, km0 {want:?}", stream.name);
                failed = true;
            }
            digests.push(Some(got));
        }
        let mut best = vec![Duration::MAX; PARSERS.len()];
        for _ in 0..rounds {
            for (i, (_, _, parse)) in PARSERS.iter().enumerate() {
                if digests[i].is_none() {
                    continue;
                }
                let cpu = thread_cpu_time();
                std::hint::black_box(parse(std::hint::black_box(&stream)));
                best[i] = best[i].min(thread_cpu_time().saturating_sub(cpu));
            }
        }
        println!(
            "bench json: {}: {} records of {bytes:.0} bytes, {} complete, {} lacking a field, best of {rounds}:",
            stream.name, n, want.complete, want.incomplete
        );
        let km0 = best[0].as_secs_f64();
        for (i, (name, checks, _)) in PARSERS.iter().enumerate() {
            if best[i] == Duration::MAX {
                continue;
            }
            let secs = best[i].as_secs_f64();
            println!(
                "bench json:   {name} [{}]: {:.0} ns per record, {:.2} M records per CPU-second, {:.2}x km0's time",
                checks.tag(),
                secs * 1e9 / n,
                n / secs / 1e6,
                secs / km0
            );
        }
    }
    println!("bench json: malformed records, read (+) or refused (-) by each parser in the order above (. not tried):");
    for (what, record) in CORPUS {
        let v = verdicts(record);
        let marks: String = v
            .iter()
            .map(|t| match t {
                Some(true) => '+',
                Some(false) => '-',
                None => '.',
            })
            .collect();
        println!("bench json:   {marks}  {what}");
        // What every parser must read, and what every one that checks all must refuse.
        let must_read = what.starts_with("well-formed");
        let must_refuse = matches!(*what, "cut short" | "not JSON" | "trailing comma");
        for (&(name, checks, _), verdict) in PARSERS.iter().zip(&v) {
            let wrong = match verdict {
                Some(read) => (must_read && !read) || (must_refuse && checks == Checks::All && *read),
                None => false,
            };
            if wrong {
                eprintln!("bench json: {name} got the corpus's \"{what}\" wrong");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
