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
