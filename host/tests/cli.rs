//! The `km0` binary at its edge: exit codes and messages a user sees.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;

fn km0() -> Command {
    Command::new(common::km0())
}

fn example() -> PathBuf {
    repo().join("examples/stock-alert/pipeline.toml")
}

/// The stock-alert example with `from` replaced by `to`, in a temporary folder (kept while
/// the returned guard lives; relative paths then point nowhere).
fn edited_example(from: &str, to: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example()).unwrap().replace(from, to);
    let p = dir.path().join("p.toml");
    std::fs::write(&p, text).unwrap();
    (dir, p)
}

#[test]
fn validate_names_an_unknown_field() {
    let (_dir, p) = edited_example("[window]", "[window]\nslid = \"1m\"");
    let out = km0().arg("validate").arg(&p).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field `slid`"), "{err}");
}

#[test]
fn a_missing_plugin_is_named_with_its_cause_said_once() {
    let (_dir, p) = edited_example("min-stock.wasm", "no-such-plugin.wasm");
    let out = km0().arg("bench").arg(&p).args(["--events", "100"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // ENOENT's text, as the OS says it ("No such file or directory (os error 2)").
    let cause = std::io::Error::from_raw_os_error(2).to_string();
    assert!(err.contains("read plugin ") && err.contains("no-such-plugin.wasm"), "{err}");
    assert_eq!(err.matches(cause.as_str()).count(), 1, "{err}");
}

#[test]
fn run_prints_a_summary_and_deploy_refuses_a_downgrade() {
    let plugins = repo().join("plugins/dist");
    assert!(plugins.join("min-stock-v2.wasm").exists(), "build the plugins first (scripts/build-plugins.sh)");
    let dir = tempfile::tempdir().unwrap();
    let pipeline = dir.path().join("pipeline.toml");
    let text = std::fs::read_to_string(example())
        .unwrap()
        .replace(
            "../../plugins/dist/min-stock.wasm",
            &plugins.join("min-stock-v2.wasm").display().to_string(),
        )
        .replace(
            "data/stock.jsonl",
            &repo().join("examples/stock-alert/data/golden-trace.jsonl").display().to_string(),
        );
    std::fs::write(&pipeline, text).unwrap();

    let out = km0().args(["run", "--stop-with-savepoint-after", "7"]).arg(&pipeline).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("read 7 records: 0 filtered, 0 dead-lettered; 7 accepted, 0 late"), "{err}");
    let savepoint = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(Path::new(&savepoint).join("savepoint.json").exists(), "{savepoint}");

    let out = km0()
        .arg("deploy")
        .arg(plugins.join("min-stock.wasm"))
        .args(["--from-savepoint", &savepoint, "--pipeline"])
        .arg(&pipeline)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("deploy refused") && err.contains("state schema 2"), "{err}");
}

#[test]
fn plugin_inspect_describes_a_component() {
    let out =
        km0().args(["plugin", "inspect"]).arg(repo().join("plugins/dist/distance.wasm")).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "name:          distance",
        "state schema:  1",
        "km0:plugin@0.5.0 (world firing-aggregate-plugin)",
        "key fields:    1",
        "ordered input: true",
        "field:         lat",
    ] {
        assert!(text.contains(want), "{want:?} not in {text}");
    }
    let out = km0().args(["plugin", "inspect"]).arg(repo().join("README.md")).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a WebAssembly component"));
}

#[test]
fn every_example_pipeline_validates() {
    let mut checked = 0;
    for dir in std::fs::read_dir(repo().join("examples")).unwrap().flatten() {
        for f in std::fs::read_dir(dir.path()).unwrap().flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.starts_with("pipeline") && name.ends_with(".toml") {
                let out = km0().arg("validate").arg(f.path()).output().unwrap();
                assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
                checked += 1;
            }
        }
    }
    assert!(checked >= 6, "example pipelines found: {checked}");
}

#[test]
fn validate_refuses_a_key_shorter_than_the_plugin_reads() {
    // min-stock reads producto and mercado from every group's key.
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(example())
        .unwrap()
        .replace("key = [\"producto\", \"mercado\"]", "key = [\"producto\"]")
        .replace(
            "data/stock.jsonl",
            &repo().join("examples/stock-alert/data/stock.jsonl").display().to_string(),
        )
        .replace("../../plugins/dist/", &format!("{}/", repo().join("plugins/dist").display()));
    let p = dir.path().join("p.toml");
    std::fs::write(&p, text).unwrap();
    let out = km0().arg("validate").arg(&p).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("reads 2 key fields") && err.contains("[\"producto\"] has 1"), "{err}");
    // And a run refuses before writing anything.
    let out = km0().arg("run").arg(&p).output().unwrap();
    assert!(!out.status.success());
    assert!(!dir.path().join("out/alertas.jsonl").exists());
}

#[test]
fn a_bounded_run_on_a_terminal_shows_its_progress_and_not_with_quiet_or_a_pipe() {
    // `script` (util-linux) gives the run a pseudo-terminal.
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    // Long enough (about half a second) for the bar to show the job's status.
    std::fs::write(&input, stream(1_000_000, 61)).unwrap();
    let job = stock_pipeline(dir.path(), &input, "out", "");
    let on_terminal = |extra: &str| {
        let cmd = format!("{} run --http off {extra} {}", common::km0().display(), job.display());
        let out = Command::new("script").args(["-qec", &cmd, "/dev/null"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let shown = on_terminal("");
    assert!(shown.contains("records/s") || shown.contains("/s, watermark"), "a progress bar: {shown}");
    assert!(shown.contains("watermark 2025-09-14"), "the watermark as a UTC time: {shown}");
    assert!(shown.contains("km0: read 1000000 records"), "then the summary: {shown}");
    let quiet = on_terminal("--quiet");
    assert!(!quiet.contains("watermark 2025"), "--quiet: {quiet}");
    let piped = km0().args(["run", "--http", "off"]).arg(&job).output().unwrap();
    assert!(!String::from_utf8_lossy(&piped.stderr).contains("watermark 2025"));
}

#[test]
fn bench_times_the_job_and_with_reference_a_plain_loop_over_the_same_input() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.jsonl");
    // Two stock events, another kind of event, a line that is not JSON, a blank line: four
    // records for both (the loop skips what it cannot parse, as the job dead-letters it).
    std::fs::write(
        &input,
        concat!(
            r#"{"tipo": "stock.actualizado", "producto": "pan", "mercado": "reus", "stock_actual": 3, "fecha_ms": 1757836800000}"#,
            "\n",
            r#"{"tipo": "stock.actualizado", "producto": "pan", "mercado": "vic", "stock_actual": 30, "fecha_ms": 1757836900000}"#,
            "\n",
            r#"{"tipo": "pedido.creado", "fecha_ms": 1757836900000}"#,
            "\nnot json\n\n"
        ),
    )
    .unwrap();
    let out = km0()
        .arg("bench")
        .arg(example())
        .arg("--input")
        .arg(&input)
        .args(["--repeat", "1", "--reference"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("bench stock-alert: 4 records"), "{text}");
    assert!(text.contains("; 1 results"), "{text}");
    assert!(
        text.contains("reference loop (native, serde_json, a hash map of windows): 4 records, best "),
        "{text}"
    );
    assert!(text.contains("; km0 over it, median of 1 runs each followed by the loop: "), "{text}");
    // The loop is the stock alert's: refused with another stream.
    let out = km0()
        .arg("bench")
        .arg(example())
        .args(["--stream", "delivery", "--events", "100", "--repeat", "1", "--reference"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--reference times the stock stream's loop"), "{err}");
}
