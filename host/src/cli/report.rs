//! What the commands print: a job's status, a live deploy's record, a shadow's status, a
//! run's summary and a plugin's identity. Names from the input (partitions, tasks, keys)
//! are shown as text, never as terminal commands.

use anyhow::Result;
use km0::job::Summary;
use km0::plugin::PluginRuntime;
use std::path::Path;

/// A running job's status (`v`: its control API's JSON, made printable).
pub fn print_status(v: &serde_json::Value) {
    let c = &v["counters"];
    println!(
        "job {} ({}), up {:.1} s",
        v["pipeline"].as_str().unwrap_or("?"),
        v["state"].as_str().unwrap_or("?"),
        v["uptime_ms"].as_f64().unwrap_or(0.0) / 1e3
    );
    println!(
        "read {} filtered {} dead-lettered {} accepted {} late {} emitted {}",
        c["read"], c["filtered"], c["dead_lettered"], c["accepted"], c["late"], c["emitted"]
    );
    println!("watermark {}  checkpoints {}", v["watermark"], v["checkpoints"]);
    for p in v["partitions"].as_array().into_iter().flatten() {
        println!(
            "  partition {}: max event time {}, idle {}, finished {}",
            p["name"].as_str().unwrap_or("?"),
            p["max_event_time"],
            p["idle"],
            p["finished"]
        );
    }
    if let Some(g) = v["group"].as_object() {
        print_group(g);
    }
    for t in v["tasks"].as_array().into_iter().flatten() {
        println!(
            "  task {} ({}) on thread {}: {}, watermark {}, read {}, {} open windows{}",
            t["task"].as_str().unwrap_or("?"),
            t["partition"].as_str().unwrap_or("?"),
            t["thread"],
            t["state"].as_str().unwrap_or("?"),
            t["watermark"],
            t["read"],
            t["open_windows"],
            t["lag"].as_i64().map(|l| format!(", lag {l}")).unwrap_or_default()
        );
    }
    for a in v["aggregations"].as_array().into_iter().flatten() {
        print_aggregation(a);
    }
    if v["shadow"].is_object() {
        print_shadow(&v["shadow"], "running");
    }
}

/// The job's share of its consumer group.
fn print_group(g: &serde_json::Map<String, serde_json::Value>) {
    let owned: Vec<&str> =
        g["partitions"].as_array().into_iter().flatten().filter_map(|p| p.as_str()).collect();
    println!(
        "member {} of consumer group {}: owns {} ({} assigned, {} revoked since it started)",
        g["member_id"].as_str().filter(|m| !m.is_empty()).unwrap_or("(joining)"),
        g["group"].as_str().unwrap_or("?"),
        if owned.is_empty() { "no partition".to_string() } else { owned.join(", ") },
        g["assigned"],
        g["revoked"]
    );
}

/// One aggregation of a job's status: its plugin, windows and keys, quarantined keys.
fn print_aggregation(a: &serde_json::Value) {
    println!(
        "  aggregation {}: {} {} (contract {}), {} open windows, {} keys",
        a["name"].as_str().unwrap_or("?"),
        a["plugin"].as_str().unwrap_or("?"),
        a["plugin_version"].as_str().unwrap_or("?"),
        a["contract"].as_str().unwrap_or("?"),
        a["open_windows"],
        a["keys"]
    );
    if let Some(on) = a["tasks_on"].as_object().filter(|on| on.len() > 1) {
        let each: Vec<String> = on.iter().map(|(v, n)| format!("{v} in {n} tasks")).collect();
        println!("    tasks on different versions (a deploy under way): {}", each.join(", "));
    }
    if a["quarantined"].as_u64().unwrap_or(0) > 0 {
        let keys: Vec<String> = a["quarantined_keys"]
            .as_array()
            .into_iter()
            .flatten()
            .take(5)
            .map(|q| {
                format!(
                    "{:?}",
                    q["key"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|f| f.as_str())
                        .collect::<Vec<_>>()
                        .join("|")
                )
            })
            .collect();
        println!("    {} keys quarantined: {}", a["quarantined"], keys.join(", "));
    }
    if a["faults_untracked"].as_u64().unwrap_or(0) > 0 {
        println!(
            "    {} faults of keys not followed for quarantine ({} keys followed: see \
             `[plugin] quarantine_max_keys`)",
            a["faults_untracked"], a["faulted_keys"]
        );
    }
}

/// A shadow's status (`what`: started, running, abandoned).
pub fn print_shadow(v: &serde_json::Value, what: &str) {
    let id = |p: &serde_json::Value| {
        format!("{} {}", p["name"].as_str().unwrap_or("?"), p["version"].as_str().unwrap_or("?"))
    };
    println!(
        "shadow {what}: {} beside {} in aggregation(s) {} since record {}",
        id(&v["to"]),
        v["from"].as_array().into_iter().flatten().map(id).collect::<Vec<_>>().join(", "),
        v["aggregations"],
        v["since_record"]
    );
    println!(
        "  windows compared {}: equal {}, different {}, faulted {}",
        v["windows"], v["equal"], v["different"], v["faulted"]
    );
    if let Some(f) = v["differences_file"].as_str() {
        println!("  differences: {f}");
    }
}

/// A live deploy's record, readable.
pub fn print_deployed(v: &serde_json::Value) {
    let id = |p: &serde_json::Value| {
        format!("{} {}", p["name"].as_str().unwrap_or("?"), p["version"].as_str().unwrap_or("?"))
    };
    let from: Vec<String> = v["from"].as_array().into_iter().flatten().map(id).collect();
    println!(
        "{} {} -> {} in aggregation(s) {} at record {}",
        v["status"].as_str().unwrap_or("swapped"),
        from.join(", "),
        id(&v["to"]),
        v["aggregations"],
        v["at_record"]
    );
    for m in v["migrated"].as_array().into_iter().flatten() {
        println!("  aggregation {}: state schema {} -> {}", m[0], m[1], m[2]);
    }
    println!(
        "  pause {:.1} ms (rollback savepoint {:.1} ms, swap {:.1} ms); prepared in {:.1} ms",
        v["pause_ms"].as_f64().unwrap_or(0.0),
        v["savepoint_ms"].as_f64().unwrap_or(0.0),
        v["swap_ms"].as_f64().unwrap_or(0.0),
        v["prepare_ms"].as_f64().unwrap_or(0.0)
    );
    println!("  rollback savepoint: {}", v["savepoint"].as_str().unwrap_or("-"));
    if let Some(c) = v["checkpoint"].as_str() {
        println!("  checkpoint after the swap: {c}");
    }
}

/// A run's summary (on standard error; a savepoint's path on standard output).
pub fn print_summary(s: &Summary) {
    for l in &s.lag {
        eprintln!(
            "km0: lag {}: {} (position {}, log end {})",
            l.partition, l.lag, l.position, l.high_watermark
        );
    }
    if s.backpressure_pauses > 0 {
        eprintln!("km0: the source paused {} times for a slow sink", s.backpressure_pauses);
    }
    let c = &s.counters;
    eprintln!(
        "km0: read {} records: {} filtered, {} dead-lettered; {} accepted, {} late, {} late updates; {} windows fired, {} results emitted",
        c.read, c.filtered, c.dead_lettered, c.accepted, c.late, c.late_updates, c.windows_fired, c.emitted
    );
    if c.retracted > 0 {
        eprintln!("km0: {} results retracted (sessions that merged under another start)", c.retracted);
    }
    if s.operators.len() > 1 {
        for o in &s.operators {
            let c = &o.counters;
            eprintln!(
                "km0:   {} ({} {}): {} accepted, {} late, {} late updates, {} windows fired, {} emitted",
                o.name,
                o.plugin.name,
                o.plugin.version,
                c.accepted,
                c.late,
                c.late_updates,
                c.windows_fired,
                c.emitted
            );
        }
    }
    let secs = s.cpu.as_secs_f64();
    if s.records_this_run > 0 && secs > 0.0 {
        eprintln!(
            "km0: this run: {} records in {:.3} s wall, {:.3} s CPU ({:.0} records per CPU-second)",
            s.records_this_run,
            s.elapsed.as_secs_f64(),
            secs,
            s.records_this_run as f64 / secs
        );
    }
    if s.recovered_from.is_none() && s.restore_time > std::time::Duration::ZERO {
        eprintln!("km0: restored from the savepoint in {:.1} ms", s.restore_time.as_secs_f64() * 1e3);
    }
    if let Some(c) = &s.recovered_from {
        eprintln!("km0: recovered from checkpoint {c} in {:.1} ms", s.restore_time.as_secs_f64() * 1e3);
    }
    if s.checkpoints > 0 {
        eprintln!(
            "km0: {} checkpoints, processing paused {:.1} ms at most, {:.1} ms on average",
            s.checkpoints,
            s.checkpoint_pause_max.as_secs_f64() * 1e3,
            s.checkpoint_pause_total.as_secs_f64() * 1e3 / s.checkpoints as f64
        );
    }
    if let Some(sp) = &s.savepoint {
        eprintln!(
            "km0: stopped with savepoint {} ({} open windows, written in {:.1} ms)",
            sp.display(),
            s.open_windows,
            s.savepoint_pause.as_secs_f64() * 1e3
        );
        println!("{}", sp.display());
    }
}

/// A plugin's identity and the fields it reads (inspected without configuring it: a plugin
/// may refuse an empty configuration).
pub fn print_plugin(runtime: &PluginRuntime, plugin: &Path) -> Result<()> {
    let (id, info) = runtime.inspect(plugin)?;
    println!("name:          {}", id.name);
    println!("version:       {}", id.version);
    println!("state schema:  {}", id.state_schema);
    println!("contract:      km0:plugin@{} (world {})", id.contract, runtime.world(plugin)?);
    println!("sha256:        {}", id.sha256);
    println!("ordered input: {}", info.ordered_input);
    println!(
        "key fields:    {}",
        if id.key_fields == 0 { "any".to_string() } else { id.key_fields.to_string() }
    );
    for f in &info.fields {
        let ty = format!("{:?}", f.type_);
        println!("field:         {} ({})", f.name, ty.trim_start_matches("FieldType::").to_lowercase());
    }
    Ok(())
}

/// `km0 savepoints --store URL`: the group's savepoints, oldest first.
pub fn print_group_savepoints(store: &str, json: bool) -> Result<()> {
    use km0::checkpoint::group::{GroupSavepoints, Progress};
    let g = GroupSavepoints::open(store)?;
    let all = g.list()?;
    let rows: Vec<serde_json::Value> = all
        .iter()
        .map(|p| {
            let (r, state, tasks, why) = match p {
                Progress::Complete(r, m) => {
                    (r, "complete", m.tasks.iter().map(|t| t.partition.clone()).collect(), None)
                }
                Progress::Open(r, saved) => (r, "open", saved.clone(), None),
                Progress::Abandoned(r, why) => (r, "abandoned", Vec::new(), Some(why.clone())),
            };
            serde_json::json!({
                "id": r.id, "url": g.url_of(&r.id), "state": state, "stop": r.stop,
                "at_ms": r.at_ms, "by": r.by, "tasks": tasks, "reason": why,
            })
        })
        .collect();
    if json {
        println!("{:#}", serde_json::Value::Array(rows));
        return Ok(());
    }
    if rows.is_empty() {
        println!("no savepoint of the group in {store}");
    }
    for (p, row) in all.iter().zip(&rows) {
        let kind = if row["stop"] == true { "stop" } else { "savepoint" };
        match p {
            Progress::Complete(_, m) => println!(
                "{}  complete  {kind}  {} tasks ({})",
                km0::text::printable(row["url"].as_str().unwrap_or_default()),
                m.tasks.len(),
                m.tasks.iter().map(|t| t.partition.as_str()).collect::<Vec<_>>().join(", ")
            ),
            Progress::Open(_, saved) => {
                println!(
                    "{}  open  {kind}  {} tasks saved so far",
                    km0::text::printable(row["url"].as_str().unwrap_or_default()),
                    saved.len()
                )
            }
            Progress::Abandoned(_, why) => println!(
                "{}  abandoned  {kind}  {}",
                km0::text::printable(row["url"].as_str().unwrap_or_default()),
                km0::text::printable(why)
            ),
        }
    }
    Ok(())
}
