//! Live plugin deploys into a running job, with the real binary, real HTTP and the real
//! components of plugins/: min-stock 0.1 (state schema 1) swapped for min-stock 0.2
//! (schema 2, migrated) while the job follows its input. The reference for every live
//! run is the offline procedure it replaces: stop with a savepoint at the record the
//! swap happened at, then `km0 deploy NEW --from-savepoint`.

mod common;
use common::*;

use km0::control::client::{call, send};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const TOKEN: &str = "d3ploy";

/// A stock-alert pipeline over the followed `dir/live.jsonl` running `plugin`, with
/// checkpoints under `out/chk`.
fn pipeline(dir: &Path, plugin_name: &str) -> PathBuf {
    let job = stock_pipeline(
        dir,
        &dir.join("live.jsonl"),
        "out",
        "[checkpoints]\ndir = \"out/chk\"\ninterval = \"300ms\"",
    );
    let text = std::fs::read_to_string(&job).unwrap();
    std::fs::write(
        &job,
        text.replace(&*plugin("min-stock").to_string_lossy(), &plugin(plugin_name).to_string_lossy()),
    )
    .unwrap();
    job
}

fn km0(args: &[&str]) -> std::process::Output {
    Command::new(common::km0()).args(args).env("KM0_TOKEN", TOKEN).output().unwrap()
}

/// `km0 deploy PLUGIN --job URL --json`: the deploy's record.
fn deploy(url: &str, plugin_name: &str) -> serde_json::Value {
    let out = km0(&["deploy", &plugin(plugin_name).to_string_lossy(), "--job", url, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    json(&String::from_utf8_lossy(&out.stdout))
}

/// Wait for a job to end; its stderr.
fn ended(child: Child) -> String {
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    err
}

/// The offline procedure into `off/`: a bounded run of the whole input that stops with a
/// savepoint after `at` records, then `km0 deploy min-stock-v2 --from-savepoint` from it.
fn offline_deploy(dir: &Path, job: &Path, at: u64) {
    offline_deploy_of(dir, job, at, "min-stock-v2")
}

fn offline_deploy_of(dir: &Path, job: &Path, at: u64, new: &str) {
    let off = dir.join("off.toml");
    std::fs::write(&off, std::fs::read_to_string(job).unwrap().replace("out/", "off/")).unwrap();
    let off = off.to_string_lossy().to_string();
    let r = km0(&["run", "--http", "off", "--stop-with-savepoint-after", &at.to_string(), &off]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let savepoint = dir.join(format!("off/savepoints/savepoint-{at:012}"));
    let r = km0(&[
        "deploy",
        &plugin(new).to_string_lossy(),
        "--from-savepoint",
        &savepoint.to_string_lossy(),
        "--pipeline",
        &off,
        "--http",
        "off",
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

/// The first `n` lines of `text`, and the rest.
fn split(text: &str, n: usize) -> (String, String) {
    let lines: Vec<&str> = text.lines().collect();
    let part = |l: &[&str]| l.iter().map(|l| format!("{l}\n")).collect::<String>();
    (part(&lines[..n]), part(&lines[n..]))
}

/// [`started`] with min-stock and more `[plugin]` settings (lines of TOML).
fn started_with(dir: &Path, first: &str, settings: &str) -> (PathBuf, String, Child) {
    std::fs::write(dir.join("live.jsonl"), first).unwrap();
    let job = pipeline(dir, "min-stock");
    let text = std::fs::read_to_string(&job)
        .unwrap()
        .replace("[plugin.config]", &format!("{settings}\n[plugin.config]"));
    std::fs::write(&job, text).unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    (job, url, child)
}

fn started(dir: &Path, plugin_name: &str, first: &str) -> (PathBuf, String, Child) {
    std::fs::write(dir.join("live.jsonl"), first).unwrap();
    let job = pipeline(dir, plugin_name);
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    (job, url, child)
}

#[test]
fn a_live_swap_gives_the_output_of_an_offline_deploy_at_the_same_record_and_its_savepoints_resume_with_the_new_plugin(
) {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(60_000, 41);
    let (first, rest) = split(&text, 30_000);
    let (job, url, child) = started(dir.path(), "min-stock", &first);
    wait_for_read(&url, 30_000);

    let d = deploy(&url, "min-stock-v2");
    assert_eq!(d["status"], "swapped", "{d}");
    assert_eq!(d["at_record"], 30_000, "{d}");
    assert_eq!(d["from"][0]["version"], "0.1.0");
    assert_eq!(d["to"]["version"], "0.2.0");
    assert_eq!(d["migrated"], serde_json::json!([["window-aggregate", 1, 2]]));
    let rollback = PathBuf::from(d["savepoint"].as_str().unwrap());
    assert!(rollback.join("savepoint.json").exists());
    assert!(d["pause_ms"].as_f64().unwrap() > 0.0);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.2.0", "{status}");
    let history = json(&call(&url, "GET", "/api/v1/deployments", None).unwrap().1);
    assert_eq!(history.as_array().unwrap().len(), 1);
    assert_eq!(history[0]["savepoint"], d["savepoint"]);

    append(dir.path(), &rest);
    wait_for_read(&url, 60_000);
    let (code, body) = call(&url, "POST", "/api/v1/savepoints", Some(TOKEN)).unwrap();
    assert_eq!(code, 200, "{body}");
    let after = json(&body)["path"].as_str().unwrap().to_string();
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);

    offline_deploy(dir.path(), &job, 30_000);
    let live = stock_outputs(dir.path(), "out");
    assert!(
        live == stock_outputs(dir.path(), "off"),
        "the live swap's output differs from the offline deploy's"
    );
    // The swap happened mid-stream: windows that fired before it have min-stock 0.1's
    // results, later ones min-stock 0.2's.
    let results: Vec<&str> = live[0].lines().collect();
    assert!(results.first().is_some_and(|l| !l.contains("suma_delta")));
    assert!(results.last().is_some_and(|l| l.contains("suma_delta")));

    // A savepoint taken after the swap resumes with min-stock 0.2, although the pipeline
    // file still names 0.1 (its outputs are rewritten from the savepoint on).
    let r = km0(&["run", "--http", "off", &job.to_string_lossy(), "--from-savepoint", &after]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    assert!(err.contains("resuming with the plugin the job ran"), "{err}");
    assert!(Path::new(&after).join("components").read_dir().unwrap().count() == 1);
    assert!(stock_outputs(dir.path(), "out") == live, "resumed output differs");
}

#[test]
fn a_job_killed_right_after_a_live_swap_recovers_with_the_new_plugin() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(60_000, 42);
    let (first, rest) = split(&text, 30_000);
    let (job, url, mut child) = started(dir.path(), "min-stock", &first);
    wait_for_read(&url, 30_000);
    let d = deploy(&url, "min-stock-v2");
    // The reply comes once the checkpoint after the swap is durable.
    let checkpoint = d["checkpoint"].as_str().unwrap();
    assert!(dir.path().join("out/chk").join(checkpoint).join("savepoint.json").exists(), "{d}");
    child.kill().unwrap();
    child.wait().unwrap();

    // Restarted with the same command: the pipeline file still names min-stock 0.1.
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    wait_for_read(&url, 30_000);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.2.0", "{status}");
    append(dir.path(), &rest);
    wait_for_read(&url, 60_000);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    let err = ended(child);
    assert!(err.contains("resuming with the plugin the job ran"), "{err}");

    offline_deploy(dir.path(), &job, 30_000);
    assert!(
        stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "off"),
        "the recovered output differs from a run without the crash"
    );
}

#[test]
fn refused_live_deploys_leave_the_job_running_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(40_000, 43);
    let (first, rest) = split(&text, 20_000);
    let (job, url, child) = started(dir.path(), "min-stock-v2", &first);
    wait_for_read(&url, 20_000);
    let bytes = |name: &str| std::fs::read(plugin(name)).unwrap();
    let post = |body: &[u8], token: Option<&str>, query: &str| {
        let (code, reply) = send(&url, "POST", &format!("/api/v1/deployments{query}"), token, body).unwrap();
        (code, json(&reply)["error"].as_str().unwrap_or("").to_string())
    };
    // No token, a wrong one.
    assert_eq!(post(&bytes("min-stock"), None, "").0, 401);
    assert_eq!(post(&bytes("min-stock"), Some("wrong"), "").0, 401);
    // Not a component; a plugin of another name; an aggregation the job does not have.
    let (code, why) = post(b"name = \"not wasm\"", Some(TOKEN), "");
    assert_eq!(code, 400, "{why}");
    assert!(why.contains("not a km0 plugin"), "{why}");
    let (code, why) = post(&bytes("distance"), Some(TOKEN), "");
    assert_eq!(code, 409, "{why}");
    assert!(why.contains("different logic"), "{why}");
    assert_eq!(post(&bytes("min-stock-v2"), Some(TOKEN), "?aggregation=nope").0, 404);
    // A downgrade: min-stock 0.1 cannot read state schema 2 (the CLI says why, exit 1).
    let out = km0(&["deploy", &plugin("min-stock").to_string_lossy(), "--job", &url]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("422") && err.contains("cannot read accumulators of state schema 2"), "{err}");
    // A migrate that traps.
    let (code, why) = post(&bytes("min-stock-broken"), Some(TOKEN), "");
    assert_eq!(code, 422, "{why}");
    assert!(
        why.contains("migrate") && why.contains("panicked at") && why.contains("cannot read state schema 2"),
        "{why}"
    );

    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["state"], "running");
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.2.0");
    let history = json(&call(&url, "GET", "/api/v1/deployments", None).unwrap().1);
    let refused: Vec<&str> =
        history.as_array().unwrap().iter().map(|d| d["status"].as_str().unwrap()).collect();
    assert_eq!(refused, ["refused", "refused"], "{history}");

    append(dir.path(), &rest);
    wait_for_read(&url, 40_000);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);
    reference_run(dir.path(), &job);
    assert!(
        stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "ref"),
        "refused deploys changed the output"
    );
}

#[test]
fn a_live_deploy_needs_a_running_job_to_answer() {
    // Nothing listens: the CLI says so and fails.
    let port = free_port();
    let out = Command::new(common::km0())
        .args([
            "deploy",
            &plugin("min-stock-v2").to_string_lossy(),
            "--job",
            &format!("http://127.0.0.1:{port}"),
        ])
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not answer"));
}

#[test]
fn a_live_swap_of_an_ordered_plugin_hands_its_held_panes_to_the_new_instance() {
    // The delivery panel: `distance` (ordered input, sliding panes held until their last
    // window is past) and `session-gap` (left alone). distance 0.3 (same state schema,
    // other logic: it counts positions and adds no metres) is deployed mid-stream: the
    // held panes are handed to it again, so every window fired after the swap reports 0
    // metres, and the output is that of the offline deploy at the same record. distance
    // 0.2 reads a third field, which the held rows do not have: refused.
    let dir = tempfile::tempdir().unwrap();
    let spec = km0::generate::DeliveryStream { riders: 40, minutes: 40, seed: 45, ..Default::default() };
    let mut text = Vec::new();
    km0::generate::delivery_stream(&spec, &mut text).unwrap();
    let text = String::from_utf8(text).unwrap();
    let n = text.lines().count();
    let (first, rest) = split(&text, n / 2);
    std::fs::write(dir.path().join("live.jsonl"), &first).unwrap();
    let example = std::fs::read_to_string(repo().join("examples/delivery-panel/pipeline.toml")).unwrap();
    let job = dir.path().join("panel.toml");
    std::fs::write(
        &job,
        example
            .replace("data/posiciones.jsonl", "live.jsonl")
            .replace("../../plugins/dist", &repo().join("plugins/dist").to_string_lossy()),
    )
    .unwrap();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    wait_for_read(&url, (n / 2) as u64);

    let (code, body) = send(
        &url,
        "POST",
        "/api/v1/deployments",
        Some(TOKEN),
        &std::fs::read(plugin("distance-v2")).unwrap(),
    )
    .unwrap();
    assert_eq!(code, 422, "{body}");
    assert!(body.contains("rows are held"), "{body}");
    let d = deploy(&url, "distance-v3");
    assert_eq!(d["aggregations"], serde_json::json!(["distancia"]), "{d}");
    assert_eq!(d["at_record"], (n / 2) as u64);
    assert_eq!(d["migrated"], serde_json::json!([]));
    // The rollback savepoint made the sink durable up to the swap.
    let before = std::fs::read_to_string(dir.path().join("out/panel.jsonl")).unwrap().lines().count();
    append(dir.path(), &rest);
    wait_for_read(&url, n as u64);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);

    offline_deploy_of(dir.path(), &job, (n / 2) as u64, "distance-v3");
    let outputs = |out: &str| {
        ["panel.jsonl", "late.jsonl", "dead-letter.jsonl"]
            .map(|f| std::fs::read_to_string(dir.path().join(out).join(f)).unwrap_or_default())
    };
    let live = outputs("out");
    let after: Vec<serde_json::Value> =
        live[0].lines().skip(before).map(json).filter(|r| r["value"].get("distancia_m").is_some()).collect();
    assert!(after.len() > 100, "{} distance windows fired after the swap", after.len());
    for r in &after {
        assert_eq!(r["value"]["distancia_m"], 0.0, "a pane distance 0.1 computed reached 0.3: {r}");
    }
    assert!(live == outputs("off"), "the live swap of an ordered plugin differs from the offline deploy");
}

/// A live deploy of a release that panics on every call: the job watches the new plugin's
/// first events and windows, finds it failing on more than half of them, and rolls the
/// deploy back by itself: it goes on from the deploy's rollback savepoint with the plugin
/// it ran before, reading again what came after it. Its output (results, late events,
/// dead letters) is that of a run that never deployed it; the deploy history says why.
#[test]
fn a_live_deploy_that_fails_on_every_call_is_rolled_back_by_the_job() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(60_000, 43);
    let (first, rest) = split(&text, 30_000);
    let (job, url, child) = started(dir.path(), "min-stock", &first);
    wait_for_read(&url, 30_000);
    let d = deploy(&url, "min-stock-trap");
    assert_eq!(d["status"], "swapped", "{d}");
    assert_eq!(d["rollback_fault_rate"], 0.5, "{d}");
    assert!(d["watch"].as_str().unwrap().contains("more than 50%"), "{d}");
    append(dir.path(), &rest);
    let history = || json(&call(&url, "GET", "/api/v1/deployments", None).unwrap().1);
    wait_for("the job rolls the deploy back", || history()[0]["status"] == "rolled_back");
    let reason = history()[0]["reason"].as_str().unwrap().to_string();
    assert!(reason.contains("rolled back by the job") && reason.contains("failed on"), "{reason}");
    eprintln!("the deploy's history says: {reason}");
    assert_eq!(history()[0]["savepoint"], d["savepoint"]);
    wait_for_read(&url, 60_000);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.1.0", "{status}");
    assert_eq!(status["aggregations"][0]["quarantined"], 0, "{status}");
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    let err = ended(child);
    assert!(err.contains("live deploy rolled back"), "{err}");

    reference_run(dir.path(), &job);
    let (out, reference) = (stock_outputs(dir.path(), "out"), stock_outputs(dir.path(), "ref"));
    assert!(!reference[0].is_empty());
    assert!(out == reference, "the rolled-back run's output differs from a run that never deployed");
}

/// A job killed while a live deploy of a release that panics on every call is on
/// probation (its swap checkpointed, the plugin not judged yet): the restart recovers into
/// that release, goes on judging it from where the checkpoint left it, and rolls it back
/// by itself; the deploy history survived the crash, and the output is that of a run that
/// never deployed. A stop and resume of the rolled-back job keeps the history.
#[test]
fn probation_survives_a_sigkill_and_the_restarted_job_rolls_the_deploy_back() {
    let dir = tempfile::tempdir().unwrap();
    let text = stream(60_000, 47);
    let (first, rest) = split(&text, 30_000);
    let (job, url, mut child) = started(dir.path(), "min-stock", &first);
    wait_for_read(&url, 30_000);
    let d = deploy(&url, "min-stock-trap");
    assert_eq!(d["status"], "swapped", "{d}");
    assert!(d["checkpoint"].is_string(), "{d}");
    child.kill().unwrap();
    child.wait().unwrap();

    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    wait_for_read(&url, 30_000);
    let history = || json(&call(&url, "GET", "/api/v1/deployments", None).unwrap().1);
    assert_eq!(history().as_array().map(Vec::len), Some(1), "{}", history());
    append(dir.path(), &rest);
    wait_for("the restarted job rolls the deploy back", || history()[0]["status"] == "rolled_back");
    assert_eq!(history()[0]["savepoint"], d["savepoint"]);
    wait_for_read(&url, 60_000);
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.1.0", "{status}");

    // Stopped with a savepoint and resumed from it: the history is still there.
    let (code, body) = call(&url, "POST", "/api/v1/stop", Some(TOKEN)).unwrap();
    assert_eq!(code, 200, "{body}");
    ended(child);
    let savepoint = json(&body)["savepoint"].as_str().unwrap().to_string();
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = Command::new(common::km0())
        .args(["run", "--follow", "--http", &format!("127.0.0.1:{port}"), "--from-savepoint", &savepoint])
        .arg(&job)
        .env("KM0_TOKEN", TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_read(&url, 60_000);
    let history = json(&call(&url, "GET", "/api/v1/deployments", None).unwrap().1);
    assert_eq!(history[0]["status"], "rolled_back", "{history}");
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);

    reference_run(dir.path(), &job);
    assert!(
        stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "ref"),
        "the output differs from a run that never deployed"
    );
}

/// Windows `from..to` of a hand-made stock stream: 20 products at one market, 10 updates
/// each per 5-minute window, in time order (no event is late); the minimum of product `k`
/// in window `w` is `(7k + 13w) % 30`.
fn windows_of_stock(from: i64, to: i64) -> String {
    let t0: i64 = 1_767_225_600_000;
    let mut out = String::new();
    for w in from..to {
        for j in 0..10i64 {
            for k in 0..20i64 {
                let t = t0 + w * 300_000 + j * 30_000 + k * 1_000;
                let stock = (7 * k + 13 * w) % 30 + j;
                out.push_str(&format!(
                    "{{\"tipo\":\"stock.actualizado\",\"producto\":\"p{k:02}\",\"mercado\":\"m\",\"stock_actual\":{stock},\"delta\":-1,\"fecha_ms\":{t}}}\n"
                ));
            }
        }
    }
    out
}

/// Shadow deploys over a live job. min-stock 0.2 beside 0.1 writes the same alerts (on the
/// fields both have): no difference. min-stock-strict (alerts below threshold + 5) beside
/// 0.1: the differences are exactly the windows fired meanwhile whose minimum is in
/// [10, 15), by the stream's construction. Promoted, the job's output is that of an
/// offline deploy of min-stock-strict at the promotion's record.
#[test]
fn a_shadow_deploy_reports_the_windows_it_would_change_and_promotes_like_an_offline_deploy() {
    let dir = tempfile::tempdir().unwrap();
    let (job, url, child) = started(dir.path(), "min-stock", &windows_of_stock(0, 10));
    wait_for_read(&url, 2_000);
    let shadow = || json(&call(&url, "GET", "/api/v1/shadow", None).unwrap().1);
    let bytes = |name: &str| std::fs::read(plugin(name)).unwrap();
    assert_eq!(call(&url, "GET", "/api/v1/shadow", None).unwrap().0, 404);

    // min-stock 0.2 as a shadow: the windows 9..=14 fire meanwhile, alike.
    let out =
        km0(&["deploy", &plugin("min-stock-v2").to_string_lossy(), "--job", &url, "--shadow", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let started_v2 = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(started_v2["to"]["version"], "0.2.0", "{started_v2}");
    assert_eq!(started_v2["since_record"], 2_000);
    append(dir.path(), &windows_of_stock(10, 16));
    wait_for_read(&url, 3_200);
    wait_for("the shadow fires windows 9..=14", || shadow()["windows"] == 6 * 20);
    let s = shadow();
    assert_eq!(
        (s["different"].clone(), s["faulted"].clone(), s["equal"].clone()),
        (0.into(), 0.into(), 120.into()),
        "{s}"
    );
    // A live deploy waits for the shadow to be promoted or abandoned.
    let (code, body) =
        send(&url, "POST", "/api/v1/deployments", Some(TOKEN), &bytes("min-stock-v2")).unwrap();
    assert_eq!(code, 409, "{body}");
    let out = km0(&["deploy", "--abandon", "--job", &url]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(call(&url, "GET", "/api/v1/shadow", None).unwrap().0, 404);

    // min-stock-strict as a shadow from record 3 200: windows 15..=24 fire meanwhile.
    let (code, body) =
        send(&url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &bytes("min-stock-strict"))
            .unwrap();
    assert_eq!(code, 200, "{body}");
    let file = json(&body)["differences_file"].as_str().unwrap().to_string();
    append(dir.path(), &windows_of_stock(16, 26));
    wait_for_read(&url, 5_200);
    wait_for("the shadow fires windows 15..=24", || shadow()["windows"] == 10 * 20);
    let t0: i64 = 1_767_225_600_000;
    let want: std::collections::BTreeSet<String> = (15..25i64)
        .flat_map(|w| (0..20i64).map(move |k| (w, k)))
        .filter(|&(w, k)| (10..15).contains(&((7 * k + 13 * w) % 30)))
        .map(|(w, k)| format!("{}|p{k:02}|m", t0 + w * 300_000))
        .collect();
    let s = shadow();
    assert_eq!(s["different"], want.len(), "{s}");
    assert_eq!(s["equal"], 200 - want.len(), "{s}");
    // Written out with the status (four times a second).
    let written = || std::fs::read_to_string(&file).unwrap_or_default().lines().count();
    wait_for("the differences are written", || written() == want.len());
    let got: std::collections::BTreeSet<String> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| {
            let d = json(l);
            assert!(d["current"].is_null() && d["shadow"].is_string(), "only the strict release alerts: {d}");
            d["key"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(got, want);
    let metrics = call(&url, "GET", "/metrics", None).unwrap().1;
    assert!(metrics.contains("km0_shadow_windows_total{"), "{metrics}");

    // Promoted at record 5 200; the job goes on to the end of the input.
    let out = km0(&["deploy", "--promote", "--job", &url, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!((d["status"].clone(), d["at_record"].clone()), ("promoted".into(), 5_200.into()), "{d}");
    assert_eq!(d["to"]["version"], "0.1.1");
    let status = json(&call(&url, "GET", "/api/v1/job", None).unwrap().1);
    assert_eq!(status["aggregations"][0]["plugin_version"], "0.1.1", "{status}");
    assert!(status["shadow"].is_null());
    append(dir.path(), &windows_of_stock(26, 36));
    wait_for_read(&url, 7_200);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    let err = ended(child);
    // The promoted operator counts on from the current one's counters: the summary's
    // results and late events are the lines the files hold.
    let lines =
        |name: &str| std::fs::read_to_string(dir.path().join("out").join(name)).unwrap().lines().count();
    let summary = err.lines().find(|l| l.starts_with("km0: read ")).unwrap_or_else(|| panic!("{err}"));
    assert!(summary.ends_with(&format!("{} results emitted", lines("alertas.jsonl"))), "{summary}");
    assert!(summary.contains(&format!(" {} late,", lines("late.jsonl"))), "{summary}");
    offline_deploy_of(dir.path(), &job, 5_200, "min-stock-strict");
    let live = stock_outputs(dir.path(), "out");
    assert!(
        live == stock_outputs(dir.path(), "off"),
        "the promoted shadow's output differs from the offline deploy's"
    );
}

/// A shadow is in the job's checkpoints: killed while min-stock-strict runs as a shadow of
/// min-stock 0.1, the job restarts with the shadow running again and its counts kept; the
/// differences are exactly the windows, fired before and after the crash, whose minimum
/// is in [10, 15); promoted, the output is that of an offline deploy at the promotion's
/// record.
#[test]
fn a_shadow_runs_again_after_a_sigkill_and_promotes_like_an_offline_deploy() {
    let dir = tempfile::tempdir().unwrap();
    let (job, url, mut child) = started(dir.path(), "min-stock", &windows_of_stock(0, 10));
    wait_for_read(&url, 2_000);
    let strict = std::fs::read(plugin("min-stock-strict")).unwrap();
    let (code, body) = send(&url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &strict).unwrap();
    assert_eq!(code, 200, "{body}");
    append(dir.path(), &windows_of_stock(10, 16));
    wait_for_read(&url, 3_200);
    let shadow_of = |url: &str| json(&call(url, "GET", "/api/v1/shadow", None).unwrap().1);
    wait_for("the shadow fires windows 9..=14", || shadow_of(&url)["windows"] == 6 * 20);
    // A checkpoint (every 300 ms) after the firing.
    std::thread::sleep(std::time::Duration::from_millis(1_000));
    child.kill().unwrap();
    child.wait().unwrap();

    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let child = start_following(&job, port, TOKEN);
    wait_for_read(&url, 3_200);
    let s = shadow_of(&url);
    assert_eq!((s["windows"].clone(), s["to"]["version"].clone()), (120.into(), "0.1.1".into()), "{s}");
    append(dir.path(), &windows_of_stock(16, 26));
    wait_for_read(&url, 5_200);
    wait_for("the shadow fires windows 15..=24", || shadow_of(&url)["windows"] == 16 * 20);
    let s = shadow_of(&url);
    let want = (9..25i64)
        .flat_map(|w| (0..20i64).map(move |k| (w, k)))
        .filter(|&(w, k)| (10..15).contains(&((7 * k + 13 * w) % 30)))
        .count();
    assert_eq!(s["different"], want, "{s}");
    assert_eq!((s["equal"].clone(), s["faulted"].clone()), ((320 - want).into(), 0.into()), "{s}");

    let out = km0(&["deploy", "--promote", "--job", &url, "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let d = json(&String::from_utf8_lossy(&out.stdout));
    assert_eq!((d["status"].clone(), d["at_record"].clone()), ("promoted".into(), 5_200.into()), "{d}");
    append(dir.path(), &windows_of_stock(26, 36));
    wait_for_read(&url, 7_200);
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);
    offline_deploy_of(dir.path(), &job, 5_200, "min-stock-strict");
    assert!(
        stock_outputs(dir.path(), "out") == stock_outputs(dir.path(), "off"),
        "the promoted shadow's output differs from the offline deploy's"
    );
}

/// `on_breaker = "stop"`: a live deploy of a release that fails on 60% of the products
/// passes its probation (`rollback_fault_rate = 0.7`), then trips its breaker
/// (`breaker_fault_rate = 0.5`): the job stops by itself with a savepoint and fails with a
/// reason that names the breaker and the savepoint.
#[test]
fn a_tripped_breaker_that_says_stop_stops_the_job_with_a_savepoint() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, url, child) = started_with(
        dir.path(),
        &windows_of_stock(0, 10),
        "rollback_fault_rate = 0.7\nbreaker_fault_rate = 0.5\non_breaker = \"stop\"",
    );
    wait_for_read(&url, 2_000);
    let d = deploy(&url, "min-stock-flaky");
    assert_eq!(d["status"], "swapped", "{d}");
    append(dir.path(), &windows_of_stock(10, 100));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job went on: {err}");
    assert!(err.contains("stopped by the job") && err.contains("circuit breaker"), "{err}");
    let savepoint = err
        .split("(savepoint: ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no savepoint named: {err}"));
    let meta = json(&std::fs::read_to_string(Path::new(savepoint).join("savepoint.json")).unwrap());
    assert_eq!(meta["operators"][0]["plugin"]["version"], "0.1.2", "{meta}");
}

/// The shadow's verdict counts every window it failed on, in `add` as in `finish`, and
/// adds up. min-stock-flaky (fails in `add` on 12 of the 20 products, alerts below 15) as a
/// shadow from record 2 000, windows 9..=14 fired meanwhile: window 9's events all came
/// before the shadow (its state is a copy of the current one's), so its 20 windows are
/// compared on their results; in windows 10..=14 the 12 products it fails on are faulted
/// and the 8 others compared. Different: the compared windows whose minimum is in [10, 15).
/// Then min-stock-trap (fails on every call) from record 3 200, windows 15..=20 fired: every
/// window faulted, none different or equal.
#[test]
fn a_shadows_verdict_counts_the_windows_it_failed_on_in_add_and_in_finish() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, url, child) = started(dir.path(), "min-stock", &windows_of_stock(0, 10));
    wait_for_read(&url, 2_000);
    let shadow = || json(&call(&url, "GET", "/api/v1/shadow", None).unwrap().1);
    let start = |name: &str| {
        let bytes = std::fs::read(plugin(name)).unwrap();
        let (code, body) =
            send(&url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &bytes).unwrap();
        assert_eq!(code, 200, "{body}");
    };
    let minimum = |w: i64, k: i64| (7 * k + 13 * w) % 30;
    let fails = |k: i64| (2..=7).contains(&k) || (11..=16).contains(&k);

    start("min-stock-flaky");
    append(dir.path(), &windows_of_stock(10, 16));
    wait_for_read(&url, 3_200);
    wait_for("the flaky shadow compares windows 9..=14", || shadow()["windows"] == 120);
    let compared: Vec<(i64, i64)> = (9..15i64)
        .flat_map(|w| (0..20i64).map(move |k| (w, k)))
        .filter(|&(w, k)| w == 9 || !fails(k))
        .collect();
    let different = compared.iter().filter(|&&(w, k)| (10..15).contains(&minimum(w, k))).count();
    let s = shadow();
    assert_eq!(
        (s["faulted"].clone(), s["different"].clone(), s["equal"].clone()),
        (60.into(), different.into(), (compared.len() - different).into()),
        "{s}"
    );
    // The events of windows 10..=15 of the 12 products it fails on (faulted or quarantined).
    assert_eq!(s["failed_events"], 6 * 12 * 10, "{s}");
    let out = km0(&["deploy", "--abandon", "--job", &url]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    start("min-stock-trap");
    append(dir.path(), &windows_of_stock(16, 22));
    wait_for_read(&url, 4_400);
    wait_for("the trap's shadow judges windows 15..=20", || shadow()["windows"] == 120);
    let s = shadow();
    assert_eq!(
        (s["faulted"].clone(), s["different"].clone(), s["equal"].clone()),
        (120.into(), 0.into(), 0.into()),
        "{s}"
    );
    assert_eq!(s["failed_events"], 6 * 200, "{s}");
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);
}

/// A promoted shadow runs with the pipeline's own fault handling: with `on_error = "fail"`
/// the shadow of min-stock-flaky dead-letters its faults and the job goes on; promoted,
/// its next fault fails the job, as min-stock-flaky deployed offline would.
#[test]
fn a_promoted_shadow_fails_the_job_when_the_pipeline_says_on_error_fail() {
    let dir = tempfile::tempdir().unwrap();
    let (_job, url, child) = started_with(dir.path(), &windows_of_stock(0, 10), "on_error = \"fail\"");
    wait_for_read(&url, 2_000);
    let flaky = std::fs::read(plugin("min-stock-flaky")).unwrap();
    let (code, body) = send(&url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &flaky).unwrap();
    assert_eq!(code, 200, "{body}");
    append(dir.path(), &windows_of_stock(10, 12));
    wait_for_read(&url, 2_400);
    let shadow = || json(&call(&url, "GET", "/api/v1/shadow", None).unwrap().1);
    wait_for("the shadow fails on events", || shadow()["failed_events"].as_u64().is_some_and(|n| n > 0));
    // The swap's checkpoint hands the staged rows to the promoted plugin: the promotion
    // is answered with the fault that failed the job, or the job fails at its next rows.
    let promoted = km0(&["deploy", "--promote", "--job", &url, "--json"]);
    let said = String::from_utf8_lossy(&promoted.stderr).to_string();
    assert!(promoted.status.success() || said.contains("fails on product"), "{said}");
    append(dir.path(), &windows_of_stock(12, 14));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the job went on after a fault with on_error = \"fail\": {err}");
    assert!(err.contains("min-stock 0.1.2 fails on product"), "{err}");
}

/// A shadow that hangs (min-stock-hang's `add` never returns) holds the live job up once,
/// for its budget, not for a call timeout (10 s here) per batch: the job reads on, the
/// token holder's savepoints and the health check are answered, the shadow says why it
/// stopped and cannot be promoted, and the job's output is the uninterrupted run's.
#[test]
fn a_shadow_that_hangs_stops_at_its_budget_and_the_live_job_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (job, url, child) = started(dir.path(), "min-stock", &windows_of_stock(0, 10));
    wait_for_read(&url, 2_000);
    let hang = std::fs::read(plugin("min-stock-hang")).unwrap();
    let (code, body) = send(&url, "POST", "/api/v1/deployments?shadow=true", Some(TOKEN), &hang).unwrap();
    assert_eq!(code, 200, "{body}");
    let t = std::time::Instant::now();
    append(dir.path(), &windows_of_stock(10, 40));
    // Savepoints and health checks while the shadow's first call runs and after.
    let mut savepoint_ms = Vec::new();
    let mut health_ms = Vec::new();
    while t.elapsed() < std::time::Duration::from_secs(2) {
        let s = std::time::Instant::now();
        let (code, body) = call(&url, "POST", "/api/v1/savepoints", Some(TOKEN)).unwrap();
        assert_eq!(code, 200, "{body}");
        savepoint_ms.push(s.elapsed().as_millis());
        let s = std::time::Instant::now();
        assert_eq!(call(&url, "GET", "/healthz", None).unwrap().0, 200);
        health_ms.push(s.elapsed().as_millis());
    }
    wait_for_read(&url, 8_000);
    let read_in = t.elapsed();
    let shadow = json(&call(&url, "GET", "/api/v1/shadow", None).unwrap().1);
    eprintln!(
        "read in {read_in:?}; savepoints {savepoint_ms:?} ms; health {health_ms:?} ms; shadow {shadow}"
    );
    let failed = shadow["failed"].as_str().unwrap_or_default();
    assert!(failed.contains("so as not to slow the job down"), "{shadow}");
    assert!(shadow["call_seconds"].as_f64().is_some_and(|s| (0.4..1.0).contains(&s)), "{shadow}");
    assert!(read_in < std::time::Duration::from_secs(4), "6 000 records read in {read_in:?}");
    assert!(health_ms.iter().all(|&ms| ms < 100), "health checks {health_ms:?} ms");
    assert!(savepoint_ms.iter().all(|&ms| ms < 1_000), "savepoints {savepoint_ms:?} ms");
    let promoted = km0(&["deploy", "--promote", "--job", &url]);
    assert!(!promoted.status.success());
    assert!(String::from_utf8_lossy(&promoted.stderr).contains("abandon it"));
    assert!(km0(&["deploy", "--abandon", "--job", &url]).status.success());
    assert_eq!(call(&url, "POST", "/api/v1/stop?mode=drain", Some(TOKEN)).unwrap().0, 200);
    ended(child);
    reference_run(dir.path(), &job);
    assert_eq!(stock_outputs(dir.path(), "out")[0], stock_outputs(dir.path(), "ref")[0]);
}
