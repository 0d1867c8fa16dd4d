//! Records that a differential fuzzer found km0 treating otherwise than its README says
//! (issue 51), each a few hand-made lines run through the real binary: a late record with
//! a key that is not UTF-8, a line of form feeds, invalid UTF-8 in a field the job does
//! not read, deep nesting, and the order of the results of several aggregations. The
//! expected outputs are worked out by hand from the README's rules.

use km0_e2e::*;
use std::path::Path;
use std::process::Command;

const T0: i64 = 1_757_844_000_000;

fn stock(producto: &str, t: i64, stock: i64) -> String {
    format!(
        r#"{{"tipo":"stock.actualizado","producto":"{producto}","mercado":"m","fecha_ms":{t},"stock_actual":{stock}}}"#
    )
}

/// Run the stock alert (tumbling 5 min, delay 2 min, threshold 10) over `input`; its
/// summary on standard error.
fn run_stock(dir: &Path, input: &[u8]) -> String {
    std::fs::write(dir.join("in.jsonl"), input).unwrap();
    let path = StockJob::new("2m", 10).write(dir);
    let out = Command::new(km0_bin()).args(["run", "--http", "off", "--quiet"]).arg(&path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    err
}

fn lines(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.iter().flat_map(|p| p.iter().copied().chain([b'\n'])).collect()
}

#[test]
fn a_late_record_whose_key_is_not_utf8_is_a_bad_record_not_a_late_one() {
    let dir = tempfile::tempdir().unwrap();
    // Event at T0, then T0 + 10 min (the watermark moves to T0 + 8 min: [T0, T0+5m) fires),
    // then two records at T0 that would be late: one whose producto holds a raw 0xFF, one
    // with a lone surrogate escape. Both keys are not UTF-8: both are dead letters.
    let raw_key = r#"{"tipo":"stock.actualizado","producto":"p"#.to_string().into_bytes();
    let raw =
        [raw_key, vec![0xff], format!(r#"","mercado":"m","fecha_ms":{T0},"stock_actual":1}}"#).into_bytes()]
            .concat();
    let input = lines(&[
        stock("a", T0, 50).into_bytes(),
        stock("a", T0 + 600_000, 50).into_bytes(),
        raw,
        format!(r#"{{"tipo":"stock.actualizado","producto":"p\ud800","mercado":"m","fecha_ms":{T0},"stock_actual":1}}"#)
            .into_bytes(),
    ]);
    run_stock(dir.path(), &input);
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(dead[0]["reason"].as_str().unwrap().contains("not valid UTF-8"), "{}", dead[0]);
    assert!(dead[1]["reason"].as_str().unwrap().contains("surrogate"), "{}", dead[1]);
    let late = std::fs::read_to_string(dir.path().join("out/late.jsonl")).unwrap_or_default();
    assert_eq!(late, "", "no late event");
}

#[test]
fn a_line_of_form_feeds_is_a_bad_record_and_blank_lines_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let input = lines(&[
        stock("a", T0, 5).into_bytes(),
        b"\x0c\x0c\x0c".to_vec(),
        b" \t\r".to_vec(),
        Vec::new(),
        stock("a", T0 + 1000, 7).into_bytes(),
    ]);
    let err = run_stock(dir.path(), &input);
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["record"], "\u{c}\u{c}\u{c}");
    assert_eq!(dead[0]["line"], 2, "{}", dead[0]);
    // Read: the two events and the form feeds; the blank lines are not records.
    assert!(err.contains("this run: 3 records"), "{err}");
    let alerts = read_jsonl(&dir.path().join("out/alertas.jsonl"));
    assert_eq!(alerts.len(), 1);
}

#[test]
fn invalid_utf8_in_a_field_the_job_does_not_read_is_accepted_and_never_written_raw() {
    // The README's "Bad records": the scanner decodes the fields the job reads; bytes in
    // the names and values of others are not decoded. Such a record counts as an event,
    // and the side outputs write it with the invalid bytes replaced (valid JSON lines).
    let dir = tempfile::tempdir().unwrap();
    let with_bad = |t: i64| {
        [
            br#"{"tipo":"stock.actualizado","producto":"a","mercado":"m","nota":""#.to_vec(),
            vec![0xc3, 0x28],
            r#"","x"#.to_string().into_bytes(),
            vec![0xff],
            format!(r#"":1,"fecha_ms":{t},"stock_actual":3}}"#).into_bytes(),
        ]
        .concat()
    };
    let input = lines(&[with_bad(T0), stock("b", T0 + 600_000, 50).into_bytes(), with_bad(T0 + 1000)]);
    run_stock(dir.path(), &input);
    let alerts = read_jsonl(&dir.path().join("out/alertas.jsonl"));
    assert_eq!(alerts.len(), 1, "{alerts:?}");
    assert_eq!(alerts[0]["key"], format!("{T0}|a|m"));
    let late = std::fs::read_to_string(dir.path().join("out/late.jsonl")).unwrap();
    assert_eq!(late.lines().count(), 1);
    let record: serde_json::Value = serde_json::from_str(late.lines().next().unwrap()).unwrap();
    assert!(record["record"].as_str().unwrap().contains("\u{fffd}"), "{record}");
}

#[test]
fn a_value_nested_deeper_than_128_is_a_bad_record_and_up_to_128_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let nested = |depth: usize, t: i64| {
        // `extra` holds `depth` levels: the record itself is one more.
        let value = format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        format!(
            r#"{{"tipo":"stock.actualizado","producto":"a","mercado":"m","extra":{value},"fecha_ms":{t},"stock_actual":3}}"#
        )
        .into_bytes()
    };
    let input = lines(&[nested(127, T0), nested(128, T0 + 1), nested(129, T0 + 2), nested(130, T0 + 3)]);
    run_stock(dir.path(), &input);
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert_eq!(dead.iter().map(|d| d["line"].as_u64().unwrap()).collect::<Vec<_>>(), [3, 4]);
    assert!(dead.iter().all(|d| d["reason"].as_str().unwrap().contains("nesting")), "{dead:?}");
    let alerts = read_jsonl(&dir.path().join("out/alertas.jsonl"));
    assert_eq!(alerts.len(), 1);
}

#[test]
fn the_results_of_several_aggregations_come_aggregation_by_aggregation() {
    // Two aggregations of min-stock over tumbling windows of 1 and 5 minutes, nothing
    // fired before the input ends (delay 1 h): the end of the input fires every window.
    // README: aggregation by aggregation in the pipeline's order, each by window end,
    // window start, then key.
    let dir = tempfile::tempdir().unwrap();
    let mut input = Vec::new();
    for (i, p) in ["b", "a", "c"].iter().enumerate() {
        for m in 0..7 {
            input.push(stock(p, T0 + m * 60_000 + i as i64, 1).into_bytes());
        }
    }
    std::fs::write(dir.path().join("in.jsonl"), lines(&input)).unwrap();
    let plugin = plugin("min-stock");
    let text = format!(
        r#"
name = "two"
key = ["producto", "mercado"]
[source]
kind = "file"
path = "in.jsonl"
[event_time]
field = "fecha_ms"
watermark_delay = "1h"
[[aggregations]]
name = "per_minute"
window = {{ kind = "tumbling", size = "1m" }}
plugin = {{ path = "{p}", config = {{ threshold = 10 }} }}
[[aggregations]]
name = "five"
window = {{ kind = "tumbling", size = "5m" }}
plugin = {{ path = "{p}", config = {{ threshold = 10 }} }}
[sink]
kind = "file"
path = "out/results.jsonl"
[late]
path = "out/late.jsonl"
[dead_letter]
path = "out/dead.jsonl"
"#,
        p = plugin.display()
    );
    std::fs::write(dir.path().join("pipeline.toml"), text).unwrap();
    let out = Command::new(km0_bin())
        .args(["run", "--http", "off", "--quiet", "pipeline.toml"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let got: Vec<String> = read_jsonl(&dir.path().join("out/results.jsonl"))
        .iter()
        .map(|r| r["key"].as_str().unwrap().to_string())
        .collect();
    // By hand: per_minute's 7 minutes x 3 products, by window (end, start), then key;
    // then five's windows [T0, T0+5m) and [T0+5m, T0+10m), each a, b, c.
    let mut want = Vec::new();
    for m in 0..7 {
        for p in ["a", "b", "c"] {
            want.push(format!("per_minute|{}|{p}|m", T0 + m * 60_000));
        }
    }
    for w in 0..2 {
        for p in ["a", "b", "c"] {
            want.push(format!("five|{}|{p}|m", T0 + w * 300_000));
        }
    }
    assert_eq!(got, want);
}
