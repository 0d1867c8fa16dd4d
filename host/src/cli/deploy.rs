//! `km0 deploy`: a new plugin version swapped live into a running job (or run as its
//! shadow, promoted, abandoned), or resumed from a savepoint with its state migrated.

use super::api::{api_reply, api_token, query_escape};
use super::report::{print_deployed, print_shadow};
use super::{load, report, serve, RunArgs};
use anyhow::{Context, Result};
use km0::control::client;
use km0::job;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct DeployArgs {
    /// The new plugin component.
    #[arg(required_unless_present_any = ["promote", "abandon"])]
    pub plugin: Option<PathBuf>,
    /// Run it beside the current plugin over the same events, compare their results
    /// window by window and write nothing of it (see `--promote`, `--abandon`).
    #[arg(long, requires = "job", conflicts_with_all = ["promote", "abandon"])]
    pub shadow: bool,
    /// Swap the shadow in (its accumulators are warm: no migration pause).
    #[arg(long, requires = "job", conflicts_with = "abandon")]
    pub promote: bool,
    /// Drop the shadow.
    #[arg(long, requires = "job")]
    pub abandon: bool,
    /// The running job's control API (e.g. http://127.0.0.1:8081).
    #[arg(long, value_name = "URL")]
    pub job: Option<String>,
    /// Replace this aggregation's plugin only (default: every one whose plugin has
    /// the new plugin's name).
    #[arg(long, requires = "job")]
    pub aggregation: Option<String>,
    /// The job's token (default: $KM0_TOKEN).
    #[arg(long, requires = "job")]
    pub token: Option<String>,
    /// Print the deploy's record as JSON.
    #[arg(long, requires = "job")]
    pub json: bool,
    #[arg(long, value_name = "DIR", conflicts_with = "job")]
    pub from_savepoint: Option<PathBuf>,
    #[arg(long, conflicts_with = "job")]
    pub pipeline: Option<PathBuf>,
    #[command(flatten)]
    pub args: RunArgs,
}

/// Deploy as `args` say: live with `--job`, else from a savepoint.
pub fn deploy(args: DeployArgs) -> Result<()> {
    if let Some(url) = &args.job {
        return live(url, &args);
    }
    let (Some(plugin), Some(from_savepoint), Some(pipeline)) =
        (args.plugin, args.from_savepoint, args.pipeline)
    else {
        return Err(km0::Error::Usage(
            "deploy needs --job URL (a running job) or --from-savepoint DIR and --pipeline FILE".into(),
        )
        .into());
    };
    let p = load(&pipeline)?;
    let summary = serve::serve_job(&p, args.args, None, |p, opts, runtime| {
        job::deploy(p, &plugin, &from_savepoint, opts, runtime)
    })?;
    for (aggregation, from, to) in &summary.migrated {
        eprintln!("km0: aggregation {aggregation:?}: migrated state schema {from} -> {to}");
    }
    report::print_summary(&summary);
    Ok(())
}

/// `km0 deploy --job URL`: the plugin swapped in (or run as a shadow), or the shadow
/// promoted or abandoned.
fn live(url: &str, args: &DeployArgs) -> Result<()> {
    let token = api_token(args.token.clone());
    let token = token.as_deref();
    let (v, shown) = if args.promote {
        (api_reply(url, client::call(url, "POST", "/api/v1/shadow/promote", token)?)?, "deployed")
    } else if args.abandon {
        (api_reply(url, client::call(url, "DELETE", "/api/v1/shadow", token)?)?, "abandoned")
    } else {
        let Some(plugin) = &args.plugin else {
            return Err(km0::Error::Usage(
                "deploy --job URL needs the plugin, --promote or --abandon".into(),
            )
            .into());
        };
        let bytes = std::fs::read(plugin).with_context(|| format!("read {}", plugin.display()))?;
        let mut query = Vec::new();
        if let Some(a) = &args.aggregation {
            query.push(format!("aggregation={}", query_escape(a)));
        }
        if args.shadow {
            query.push("shadow=true".to_string());
        }
        let path = match query.is_empty() {
            true => "/api/v1/deployments".to_string(),
            false => format!("/api/v1/deployments?{}", query.join("&")),
        };
        let v = api_reply(url, client::send(url, "POST", &path, token, &bytes)?)?;
        (v, if args.shadow { "started" } else { "deployed" })
    };
    if args.json {
        println!("{v:#}");
    } else if shown == "deployed" {
        print_deployed(&v);
    } else {
        print_shadow(&v, shown);
    }
    Ok(())
}
