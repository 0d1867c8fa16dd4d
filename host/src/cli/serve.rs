//! A job run from the command line: one process per state folder, its control API (with
//! its token and deployer), stop-on-signal handlers, and a progress bar on a terminal.

use super::{options, progress, RunArgs};
use anyhow::Result;
use km0::job::{self, RunOptions, Summary};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::path::PathBuf;

/// Run a job with its control API and the stop-on-signal handlers.
pub fn serve_job(
    p: &Pipeline,
    args: RunArgs,
    from_savepoint: Option<PathBuf>,
    go: impl FnOnce(&Pipeline, &RunOptions, &PluginRuntime) -> km0::Result<Summary>,
) -> Result<Summary> {
    // One process per state folder: a second would clear the first's (and its token).
    let _lock = km0::state::lock::StateLock::acquire(&p.state.dir)?;
    let runtime = std::sync::Arc::new(PluginRuntime::new()?);
    job::signals::stop_with_savepoint_on_signals();
    let http = args.http.clone();
    let quiet = args.quiet || !std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut opts = options(args, from_savepoint);
    opts.control = control(p, http.as_deref(), &runtime)?;
    // A bounded run on a terminal shows its progress, read from the job's status.
    let bar = (!quiet && !job::unbounded(p, &opts)).then(|| {
        let handle = opts.control.get_or_insert_with(job::commands::ControlHandle::new).clone();
        progress::show(handle)
    });
    let summary = go(p, &opts, &runtime);
    if let Some(bar) = bar {
        bar.finish();
    }
    if let Some(c) = &opts.control {
        c.close();
    }
    Ok(summary?)
}

/// Start the control API for a run (`--http`, else the pipeline's, else the default address),
/// unless it is `off`.
fn control(
    pipeline: &Pipeline,
    http: Option<&str>,
    runtime: &std::sync::Arc<PluginRuntime>,
) -> Result<Option<job::commands::ControlHandle>> {
    // `--http`, else the pipeline's `[control] http`, else the default address.
    let http = http.or(pipeline.control.http.as_deref());
    let addr = match http {
        Some("off") => return Ok(None),
        Some(a) => a,
        None => km0::control::DEFAULT_ADDR,
    };
    let parsed: std::net::SocketAddr = addr.parse().map_err(|e| km0::Error::Address {
        flag: "--http",
        addr: addr.to_string(),
        source: e,
    })?;
    // Beside the job's state folder (which a RocksDB start clears), not in it.
    let token = km0::control::token_for(&parsed, &pipeline.state.dir.with_extension("token"))?;
    let mut handle = job::commands::ControlHandle::new();
    let mut deployer = job::deployment::Deployer::new(runtime.clone(), pipeline.clone());
    if let Some(max) = pipeline.control.max_upload_bytes {
        deployer.max_bytes = max;
    }
    handle.deployer = Some(std::sync::Arc::new(deployer));
    match km0::control::serve(parsed, token, pipeline.control.allowed_hosts.clone(), handle.clone()) {
        Ok(bound) => {
            eprintln!("km0: control API on http://{bound}");
            Ok(Some(handle))
        }
        Err(e) if http.is_none() => {
            eprintln!("km0: warning: {e}; running without the control API (choose one with --http ADDR)");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}
