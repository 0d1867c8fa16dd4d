//! The Rust guest SDK's JSON writer (`plugins/sdk/src/json.rs`, which plugins' `emit` uses),
//! built natively, against the reference: serde_json's text for the same values. Where the
//! writer answers, it must write serde_json's bytes; where it gives up, serde_json writes.

#[path = "../../plugins/sdk/src/json.rs"]
mod sdk_json;

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// The writer's text for `v` is serde_json's; `taken`: it writes `v` itself (no give-up).
/// Appended after another record's text, which stays as it was, as when it gives up.
fn same<T: Serialize + ?Sized>(v: &T, taken: bool) {
    let want = serde_json::to_string(v).expect("serde_json writes it");
    let before = b"{\"earlier\":1}";
    let mut out = before.to_vec();
    let written = sdk_json::write(&mut out, v);
    assert_eq!(&out[..before.len()], before);
    match written {
        true => assert_eq!(std::str::from_utf8(&out[before.len()..]).unwrap(), want, "for {want}"),
        false => {
            assert!(!taken, "gave up on {want}");
            assert_eq!(out.len(), before.len(), "a give-up left bytes behind for {want}");
        }
    }
}

#[derive(Serialize)]
struct Alert<'a> {
    ventana_inicio: i64,
    ventana_fin: i64,
    producto: &'a str,
    mercado: &'a str,
    stock_minimo: i64,
    actualizaciones: u64,
}

#[derive(Serialize)]
struct Renamed {
    #[serde(rename = "a\"b")]
    quote: u8,
    #[serde(rename = "tab\there")]
    tab: bool,
    #[serde(rename = "ñame €")]
    unicode: Option<i32>,
    #[serde(rename = "")]
    empty: (),
    #[serde(rename = "\u{1}\u{1f}\\")]
    control: char,
}

#[derive(Serialize)]
struct Nested {
    list: Vec<i64>,
    none: Option<String>,
    map: BTreeMap<String, Vec<f64>>,
    unit: Unit,
    newtype: Meters,
    pair: (u8, &'static str),
    kind: Kind,
}

#[derive(Serialize)]
struct Unit;

#[derive(Serialize)]
struct Meters(f64);

#[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Low,
    Other(u8),
    Pair(i8, &'static str),
    Named { at: i16, what: Option<bool> },
    Empty(),
}

#[test]
fn records_are_written_as_serde_json_writes_them() {
    let alert = |producto, mercado, min| Alert {
        ventana_inicio: 1_757_836_800_000,
        ventana_fin: 1_757_837_100_000,
        producto,
        mercado,
        stock_minimo: min,
        actualizaciones: 4,
    };
    // Twice: nothing the writer does for one record may change the next one's text.
    for (p, m, min) in
        [("queso-curado-9", "sabadell", 7), ("vino \"priorat\"", "reus\n", -3), ("", "ñ€😀", 0)]
    {
        same(&alert(p, m, min), true);
        same(&alert(p, m, min), true);
    }
    // Names that need escapes are escaped every time.
    for _ in 0..2 {
        same(&Renamed { quote: 1, tab: true, unicode: Some(-2), empty: (), control: '"' }, true);
        same(&Renamed { quote: 255, tab: false, unicode: None, empty: (), control: '\n' }, true);
    }
    let mut map = BTreeMap::new();
    map.insert("x\"y".to_string(), vec![1.5, -0.0, 1e300, f64::NAN, f64::INFINITY]);
    map.insert(String::new(), vec![]);
    same(
        &Nested {
            list: vec![i64::MIN, -1, 0, 1, i64::MAX],
            none: None,
            map,
            unit: Unit,
            newtype: Meters(0.1),
            pair: (7, "\u{7f}\u{80}"),
            kind: Kind::Low,
        },
        true,
    );
}

#[test]
fn a_word_scan_finds_every_byte_that_is_escaped_at_every_place() {
    // JSON's rule (RFC 8259, 7), which serde_json follows: the control characters below
    // 0x20, the quote and the backslash are escaped; every other byte is written as is.
    let escaped = |c: u8| c < 0x20 || c == b'"' || c == b'\\';
    for len in 0..=40usize {
        for at in 0..len {
            for c in 0..=255u8 {
                let mut b = vec![b'a'; len];
                b[at] = c;
                assert_eq!(sdk_json::needs_escape(&b), escaped(c), "{c:#x} at {at} of {len}");
            }
        }
        assert!(!sdk_json::needs_escape(&vec![0x7f; len]));
    }
}

#[test]
fn a_word_scan_finds_every_byte_that_is_not_ascii_at_every_place() {
    // ASCII is the bytes below 0x80 (the standard library's `is_ascii` is the reference).
    for len in 0..=40usize {
        for at in 0..len {
            for c in 0..=255u8 {
                let mut b = vec![b'a'; len];
                b[at] = c;
                assert_eq!(sdk_json::is_ascii(&b), b.is_ascii(), "{c:#x} at {at} of {len}");
            }
        }
        assert!(sdk_json::is_ascii(&vec![0x7f; len]));
        assert_eq!(sdk_json::is_ascii(&vec![0x80; len]), len == 0);
    }
}

#[test]
fn strings_with_every_escape_at_every_place_are_written_as_serde_json_writes_them() {
    // Independent of the writer: serde_json's text for each string is the reference.
    let mut all: String = (0u8..0x80).map(char::from).collect();
    all.push_str("ñ€😀");
    same(&all, true);
    for c in (0u8..0x80).map(char::from).chain(['ñ', '😀']) {
        same(&c, true);
        for len in [0usize, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 40] {
            for at in [0, len / 2, len] {
                let mut s: String =
                    "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGH".chars().take(len).collect();
                s.insert(at.min(s.len()), c);
                same(&s, true);
            }
        }
    }
}

#[test]
fn numbers_and_other_values_are_written_as_serde_json_writes_them() {
    same(&[i8::MIN as i64, i16::MIN as i64, i32::MIN as i64, i64::MIN, i64::MAX], true);
    same(&(u8::MAX, u16::MAX, u32::MAX, u64::MAX), true);
    same(&(i128::MIN, i128::MAX, u128::MAX), true);
    same(&(i8::MIN, i16::MIN, -1i8, -1i16, i32::MIN), true);
    same(&(0.0f32, -1.25f32, f32::MAX, f32::NAN), true);
    same(&(true, false, (), None::<u8>, Some("x")), true);
    same(&Vec::<u8>::new(), true);
    same(&BTreeMap::<String, u8>::new(), true);
    same(&serde_json::json!({"a": [1, {"b": null}], "c\n": "d", "e": 1.5}), true);
    // Enum variants of every kind, bytes, keys that are not strings.
    same(
        &[
            Kind::Low,
            Kind::Other(3),
            Kind::Pair(-1, "\"x\""),
            Kind::Named { at: -7, what: None },
            Kind::Empty(),
        ],
        true,
    );
    same(&serde_bytes_like(), true);
    same(&BTreeMap::from([(-1i64, 2), (i64::MAX, 3)]), true);
    same(&BTreeMap::from([(i128::MIN, 0)]), true);
    same(&BTreeMap::from([(true, 1), (false, 2)]), true);
    same(&BTreeMap::from([('"', 1), ('ñ', 2)]), true);
    same(&BTreeMap::from([(Kind::Low, 1)]), true);
    same(&HashMap::from([(7u8, vec![Kind::Other(1)])]), true);
    // Left to serde_json: float keys.
    same(&FloatKeys, false);
    // A value whose serialization fails: no text, and what was written of it is taken
    // back (serde_json fails on it too).
    let mut out = b"{}".to_vec();
    assert!(!sdk_json::write(&mut out, &Failing));
    assert_eq!(out, b"{}");
    assert!(serde_json::to_string(&Failing).is_err());
}

/// A map with a float key.
struct FloatKeys;

impl Serialize for FloatKeys {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry(&2.5f64, &1)?;
        m.end()
    }
}

/// A value whose `Serialize` fails halfway.
struct Failing;

impl Serialize for Failing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::{Error, SerializeSeq};
        let mut seq = s.serialize_seq(None)?;
        seq.serialize_element(&1)?;
        Err(S::Error::custom("cannot"))
    }
}

/// A value serialized as bytes.
fn serde_bytes_like() -> impl Serialize {
    struct Bytes;
    impl Serialize for Bytes {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.serialize_bytes(b"ab")
        }
    }
    Bytes
}
