//! The PostgreSQL sink's progress against a real PostgreSQL (started by the test on
//! loopback): it belongs to the job's checkpoint lineage. A run whose results the table's
//! progress cannot place (a fresh run of a job the table has, a savepoint behind the table
//! with another configuration) is refused with the SQL that fixes it, never skipped
//! silently; after that SQL the table is rewritten from the savepoint.

use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use km0_e2e::services::Postgres;
use km0_e2e::*;
use std::collections::BTreeMap;
use std::path::Path;

fn table(pg: &Postgres) -> BTreeMap<String, serde_json::Value> {
    pg.query("SELECT key, value::text FROM alertas ORDER BY key")
        .iter()
        .map(|r| (r[0].clone(), serde_json::from_str(&r[1]).unwrap()))
        .collect()
}

fn stock_input(dir: &Path, seed: u64) {
    let spec = km0::generate::StockStream { events: 30_000, seed, ..Default::default() };
    km0::generate::stock_stream(&spec, &mut std::fs::File::create(dir.join("in.jsonl")).unwrap()).unwrap();
}

fn pg_job(dir: &Path, pg: &Postgres, threshold: i64) -> Pipeline {
    let mut job = StockJob::new("2m", threshold);
    job.sink = format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"alertas\"", pg.url());
    Pipeline::load(&job.write(dir)).unwrap()
}

fn file_job(dir: &Path, threshold: i64) -> Pipeline {
    Pipeline::load(&StockJob::new("2m", threshold).write(dir)).unwrap()
}

#[test]
fn a_fresh_run_of_a_job_the_table_already_has_is_refused() {
    let pg = Postgres::start();
    let runtime = PluginRuntime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    stock_input(dir.path(), 1);
    let s = job::run(&pg_job(dir.path(), &pg, 10), &RunOptions::default(), &runtime).unwrap();
    let before = table(&pg);
    assert_eq!(before.len() as u64, s.counters.emitted);
    // New input, the same job, no state to resume from.
    stock_input(dir.path(), 2);
    let err =
        job::run(&pg_job(dir.path(), &pg, 10), &RunOptions::default(), &runtime).unwrap_err().to_string();
    assert!(err.contains("starts afresh") && err.contains("TRUNCATE alertas"), "{err}");
    assert!(table(&pg) == before, "the refused run changed the table");
    // Starting over as the message says writes every result of the new input.
    pg.query(
        "TRUNCATE alertas; DELETE FROM km0_sink_epochs WHERE job = 'stock-alert' AND sink_table = 'alertas'",
    );
    let s = job::run(&pg_job(dir.path(), &pg, 10), &RunOptions::default(), &runtime).unwrap();
    let files = tempfile::tempdir().unwrap();
    std::fs::copy(dir.path().join("in.jsonl"), files.path().join("in.jsonl")).unwrap();
    job::run(&file_job(files.path(), 10), &RunOptions::default(), &runtime).unwrap();
    let want = keyed_view(&files.path().join("out/alertas.jsonl"));
    assert_eq!(s.counters.emitted, want.len() as u64);
    assert!(table(&pg) == want, "{} rows, {} expected", table(&pg).len(), want.len());
}

#[test]
fn a_savepoint_behind_the_table_with_another_threshold_is_refused_until_the_later_epochs_go() {
    let pg = Postgres::start();
    let runtime = PluginRuntime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    stock_input(dir.path(), 3);
    let p10 = pg_job(dir.path(), &pg, 10);
    let stopped = job::run(
        &p10,
        &RunOptions { stop_with_savepoint_after: Some(12_000), ..Default::default() },
        &runtime,
    )
    .unwrap();
    let sp = stopped.savepoint.unwrap();
    job::run(&p10, &RunOptions { from_savepoint: Some(sp.clone()), ..Default::default() }, &runtime).unwrap();
    let epochs_before = pg.query("SELECT count(*) FROM km0_sink_epochs")[0][0].clone();

    // The same savepoint again, now alerting below 20: the table is ahead of it.
    let p20 = pg_job(dir.path(), &pg, 20);
    let opts = RunOptions { from_savepoint: Some(sp.clone()), ..Default::default() };
    let err = job::run(&p20, &opts, &runtime).unwrap_err().to_string();
    assert!(err.contains("another configuration"), "{err}");
    let sql = err.split("delete the later epochs: ").nth(1).and_then(|s| s.split("; or").next()).unwrap();
    assert!(sql.starts_with("DELETE FROM km0_sink_epochs WHERE job = 'stock-alert'"), "{sql}");
    assert_eq!(pg.query("SELECT count(*) FROM km0_sink_epochs")[0][0], epochs_before);
    pg.query(sql);
    let s = job::run(&p20, &opts, &runtime).unwrap();
    assert!(s.counters.emitted > stopped.counters.emitted);

    // Expected: the threshold-10 results up to the savepoint, then threshold 20's (a
    // superset of threshold 10's windows, so every later key is rewritten).
    let files = tempfile::tempdir().unwrap();
    std::fs::copy(dir.path().join("in.jsonl"), files.path().join("in.jsonl")).unwrap();
    let f10 = file_job(files.path(), 10);
    let fsp = job::run(
        &f10,
        &RunOptions { stop_with_savepoint_after: Some(12_000), ..Default::default() },
        &runtime,
    )
    .unwrap()
    .savepoint;
    job::run(
        &file_job(files.path(), 20),
        &RunOptions { from_savepoint: fsp, ..Default::default() },
        &runtime,
    )
    .unwrap();
    let want = keyed_view(&files.path().join("out/alertas.jsonl"));
    let got = table(&pg);
    assert_eq!(got.len(), want.len());
    assert!(got == want, "the table differs from threshold 10 then 20");
}

#[test]
fn a_nul_character_is_dead_lettered_and_the_other_results_are_committed() {
    let pg = Postgres::start();
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_757_844_000_000i64;
    let line = |p: &str, m: &str, t: i64, stock: i64| {
        format!(
            r#"{{"tipo":"stock.actualizado","producto":"{p}","mercado":"{m}","fecha_ms":{t},"stock_actual":{stock},"delta":0}}"#
        )
    };
    let lines = [
        line(r"queso\u0000curado", "girona", t0, 3),
        line("pan", "vic", t0, 4),
        line("aceite", "reus", t0 + 20 * 60_000, 50),
    ];
    std::fs::write(dir.path().join("in.jsonl"), lines.join("\n")).unwrap();
    let runtime = PluginRuntime::new().unwrap();
    let s =
        job::run(&pg_job(dir.path(), &pg, 10), &RunOptions::default(), &runtime).expect("the job goes on");
    assert_eq!(s.counters.dead_lettered, 1);
    let got = table(&pg);
    assert_eq!(got.keys().collect::<Vec<_>>(), [&format!("{t0}|pan|vic")]);
    let dead = read_jsonl(&dir.path().join("out/dead-letter.jsonl"));
    assert_eq!(dead.len(), 1);
    assert!(dead[0]["reason"].as_str().unwrap().contains("NUL"), "{dead:?}");
    assert!(dead[0]["key"].as_str().unwrap().contains('\0'));
}

#[test]
fn running_a_finished_job_again_is_refused_not_replayed_into_the_table() {
    // A job with checkpoints that went to the end of its input; its input then changes and
    // it is run again: it would recover from its last checkpoint and replay, but the run
    // from there already ended. Refused: nothing is skipped or rewritten silently.
    let pg = Postgres::start();
    let runtime = PluginRuntime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    stock_input(dir.path(), 4);
    let mut job = StockJob::new("2m", 10);
    job.sink = format!("kind = \"postgres\"\nurl = \"{}\"\ntable = \"alertas\"", pg.url());
    job.extra = "[checkpoints]\ndir = \"chk\"\ninterval = \"1h\"\nevery_records = 10000".into();
    let p = Pipeline::load(&job.write(dir.path())).unwrap();
    job::run(&p, &RunOptions::default(), &runtime).unwrap();
    let before = table(&pg);
    stock_input(dir.path(), 5);
    let err = job::run(&p, &RunOptions::default(), &runtime).unwrap_err().to_string();
    assert!(err.contains("already went to the end") && err.contains("TRUNCATE alertas"), "{err}");
    assert!(table(&pg) == before);
}

#[test]
fn an_older_owner_of_a_task_commits_nothing_once_a_newer_one_took_it() {
    use km0::sink::postgres::{fence, Barrier, PostgresSink, StartPoint};
    let pg = Postgres::start();
    let start = StartPoint { snapshot: None, ordinal: 0, fingerprint: "f".into(), replayable: true };
    let barrier = |n: u32, parent: &str| Barrier {
        id: format!("chk-{n}"),
        parent: parent.into(),
        fingerprint: "f".into(),
    };
    let mut old = PostgresSink::open(&pg.url(), "owned", "job/task-0", &start, Some(1)).unwrap();
    old.write("a", Some("1"), 1).unwrap();
    old.commit(1, &barrier(1, "")).unwrap();
    // Another process takes the task (generation 2) before it restores it.
    fence(&pg.url(), "owned", "job/task-0", 2).unwrap();
    old.write("b", Some("2"), 2).unwrap();
    let err = old.commit(2, &barrier(2, "chk-1")).unwrap_err();
    assert!(matches!(err, km0::Error::Fenced { .. }), "{err}");
    assert!(err.to_string().contains("generation 2 after this one's 1"), "{err}");
    // An owner older than the table's cannot even open it; the newer one goes on.
    let again = PostgresSink::open(&pg.url(), "owned", "job/task-0", &start, Some(1));
    assert!(matches!(again, Err(km0::Error::Fenced { .. })));
    let resumed = StartPoint { snapshot: Some("chk-1".into()), ordinal: 1, ..start };
    let mut new = PostgresSink::open(&pg.url(), "owned", "job/task-0", &resumed, Some(3)).unwrap();
    new.write("b", Some("3"), 2).unwrap();
    new.commit(2, &barrier(2, "chk-1")).unwrap();
    let rows = pg.query("SELECT key, value::text FROM owned ORDER BY key");
    assert_eq!(rows, [["a", "1"], ["b", "3"]]);
}
