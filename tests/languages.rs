//! Plugins in other languages: the Python `min-stock` (plugins/python/min-stock, built
//! with componentize-py) and the JavaScript one (plugins/js/min-stock, componentize-js)
//! give byte-identical alerts to the Rust one on the same stream, and share its
//! accumulator encoding, so a savepoint taken with one resumes with another, both ways.

use km0::generate::{stock_stream, StockStream};
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::*;

fn fixture(plugin_name: &str) -> (tempfile::TempDir, Pipeline) {
    let dir = tempfile::tempdir().unwrap();
    let spec = StockStream {
        events: 60_000,
        seed: 21,
        late_fraction: 0.004,
        bad_fraction: 0.002,
        ..Default::default()
    };
    stock_stream(&spec, &mut std::fs::File::create(dir.path().join("in.jsonl")).unwrap()).unwrap();
    let mut job = StockJob::new("2m", 10);
    job.plugin = plugin(plugin_name);
    let p = Pipeline::load(&job.write(dir.path())).unwrap();
    (dir, p)
}

fn alerts(dir: &tempfile::TempDir) -> String {
    std::fs::read_to_string(dir.path().join("out/alertas.jsonl")).unwrap()
}

const OTHERS: [&str; 2] = ["min-stock-py", "min-stock-js"];

#[test]
fn python_and_javascript_min_stock_give_the_same_alerts_as_rust() {
    for other in OTHERS {
        same_alerts_as_rust(other);
    }
}

fn same_alerts_as_rust(other: &str) {
    let runtime = PluginRuntime::new().unwrap();
    let (rust_dir, rust) = fixture("min-stock");
    let (py_dir, py) = fixture(other);
    let a = job::run(&rust, &RunOptions::default(), &runtime).unwrap();
    let b = job::run(&py, &RunOptions::default(), &runtime).unwrap();
    assert_eq!(b.plugin.name, "min-stock");
    assert_ne!(a.plugin.sha256, b.plugin.sha256, "two different components");
    assert!(alerts(&rust_dir).lines().count() > 100);
    assert!(alerts(&rust_dir) == alerts(&py_dir), "{other}: alerts differ from the Rust plugin's");
    assert_eq!(a.counters, b.counters);
}

#[test]
fn a_savepoint_moves_between_rust_python_and_javascript() {
    let runtime = PluginRuntime::new().unwrap();
    let (dir, rust) = fixture("min-stock");
    job::run(&rust, &RunOptions::default(), &runtime).unwrap();
    let want = alerts(&dir);
    let mut py = rust.clone();
    py.aggregations[0].plugin.path = plugin("min-stock-py");
    let mut js = rust.clone();
    js.aggregations[0].plugin.path = plugin("min-stock-js");
    for (first, second) in [(&rust, &py), (&py, &js), (&js, &rust)] {
        let sp = job::run(
            first,
            &RunOptions { stop_with_savepoint_after: Some(25_000), ..Default::default() },
            &runtime,
        )
        .unwrap()
        .savepoint
        .unwrap();
        let s = job::run(
            second,
            &RunOptions { from_savepoint: Some(sp.clone()), ..Default::default() },
            &runtime,
        )
        .unwrap();
        assert!(s.open_windows == 0 && alerts(&dir) == want, "resuming across languages changed the alerts");
        std::fs::remove_dir_all(sp).unwrap();
    }
}

/// Run Python code with `plugins/python` importable (the componentize-py `wit_world`
/// module stubbed: the helpers under test do not use it).
fn python(code: &str) -> String {
    let prelude = format!(
        "import sys, types as T\nm = T.ModuleType('wit_world'); mi = T.ModuleType('wit_world.imports')\n\
         mi.types = T.SimpleNamespace(Packed=None, Groups=None, Events=None)\n\
         sys.modules['wit_world'] = m; sys.modules['wit_world.imports'] = mi\nsys.path.insert(0, {:?})\n",
        repo().join("plugins/python").display().to_string()
    );
    let out = std::process::Command::new("python3").arg("-c").arg(prelude + code).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

fn node(code: &str) -> String {
    let sdk = repo().join("plugins/js/km0_sdk.js");
    let code = format!("import {{ Reader }} from {:?};\n{code}", sdk.display().to_string());
    let out = std::process::Command::new("node").args(["--input-type=module", "-e", &code]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_python_sdk_writes_results_as_serde_json_does() {
    // serde_json (what the Rust SDK writes with) is the oracle.
    let floats = [
        1e16,
        1e-7,
        1e-5,
        1e-4,
        0.1 + 0.2,
        1.0,
        100.0,
        123.456,
        1e21,
        1.5e300,
        -2.5,
        0.0,
        -0.0,
        5e-324,
        1234567890123456.0,
        12345678901234567.0,
        9007199254740993.0,
        0.000123,
        2.5e-308,
        1e15,
        1e17,
    ];
    let list = floats.iter().map(|f| format!("{f:e}")).collect::<Vec<_>>().join(", ");
    let got = python(&format!(
        "import km0_sdk\nfor x in [{list}]:\n    print(km0_sdk.record({{'v': x}}))\n\
         print(km0_sdk.record({{'nan': float('nan'), 'inf': float('inf'), 'n': [1, 2.0], 's': 'ñ\"'}}))"
    ));
    let mut want: Vec<String> = floats.iter().map(|f| serde_json::json!({ "v": f }).to_string()).collect();
    // serde_json writes NaN and infinities as null.
    want.push(r#"{"nan":null,"inf":null,"n":[1,2.0],"s":"ñ\""}"#.to_string());
    assert_eq!(got.lines().collect::<Vec<_>>(), want);
}

#[test]
fn the_python_and_javascript_decoders_refuse_what_the_rust_one_refuses() {
    // Accumulators of the shape (option<i64>, u64), as min-stock keeps them, each with
    // what the Rust SDK's decoder (postcard, nothing left over) makes of it.
    let cases: [(&[u8], &str); 7] = [
        (&[1, 4, 7], "ok 2 7"),
        (&[0, 7], "ok None 7"),
        (&[2, 4, 7], "err option tag"),
        (&[1, 4, 7, 0], "err left over"),
        (&[0, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01], "err varint longer"),
        (&[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f], "err out of range"),
        (&[1], "err truncated"),
    ];
    for (bytes, want) in cases {
        let list = bytes.iter().map(u8::to_string).collect::<Vec<_>>().join(",");
        let py = python(&format!(
            "import km0_sdk\ntry:\n    r = km0_sdk.Reader(bytes([{list}]))\n    v = (r.option_i64(), r.u64())\n    r.end()\n    print('ok', v[0], v[1])\nexcept ValueError as e:\n    print('err', e)"
        ));
        let js = node(&format!(
            "try {{ const r = new Reader(Uint8Array.from([{list}])); const v = [r.optionI64(), r.u64()]; r.end(); \
             console.log('ok', v[0] === null ? 'None' : v[0].toString(), v[1].toString()); }} \
             catch (e) {{ console.log('err', e.message); }}"
        ));
        let expect_ok = want.starts_with("ok");
        for (lang, got) in [("python", py.trim()), ("javascript", js.trim())] {
            assert_eq!(got.starts_with("ok"), expect_ok, "{lang} on {bytes:?}: {got} (want {want})");
            if let Some(reason) = want.strip_prefix("err ") {
                assert!(got.contains(reason), "{lang} on {bytes:?}: {got} (want {want})");
            }
        }
        if want == "ok None 7" {
            assert_eq!((py.trim(), js.trim()), ("ok None 7", "ok None 7"));
        }
        if bytes == [1, 4, 7] {
            // zigzag 4 = 2
            assert_eq!((py.trim(), js.trim()), ("ok 2 7", "ok 2 7"));
        }
    }
}
