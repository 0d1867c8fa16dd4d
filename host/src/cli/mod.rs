//! The `km0` command line: run, validate, deploy, status, savepoint and stop a job; plugin
//! authoring; generated streams; benchmarks. Each command's work is in the library (km0);
//! this folder parses, prints and talks to a running job's control API.
//!
//! - [`serve`]: a job run with its control API, progress bar and signal handlers;
//! - [`api`]: the calls to a running job's control API (status, savepoint, stop, live
//!   deploys);
//! - [`deploy`]: `km0 deploy`, live (through [`api`]) or from a savepoint;
//! - [`report`]: what the commands print;
//! - [`authoring`], [`generate`], [`bench`], [`progress`].

mod api;
mod authoring;
mod bench;
mod deploy;
mod generate;
mod progress;
mod report;
mod serve;

use anyhow::Result;
use bench::BenchArgs;
use clap::{Parser, Subcommand};
use deploy::DeployArgs;
use generate::Stream;
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::path::{Path, PathBuf};

#[derive(Parser)]
#[command(name = "km0", version = km0::BUILD, about = "Event-time stream processing with WebAssembly plugins")]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Read records from this file instead of the pipeline's source (`-` = stdin).
    #[arg(long)]
    input: Option<PathBuf>,
    /// Write results to this file instead of the pipeline's sink.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Process N records, write a savepoint and stop.
    #[arg(long, value_name = "N")]
    stop_with_savepoint_after: Option<u64>,
    /// Folder for new savepoints (default: the pipeline's `savepoints.dir`).
    #[arg(long, value_name = "DIR")]
    savepoint_dir: Option<PathBuf>,
    /// Keep reading the input files as they grow (an unbounded source).
    #[arg(long)]
    follow: bool,
    /// Do not recover from the pipeline's checkpoints: start from the beginning.
    #[arg(long)]
    no_recover: bool,
    /// The control API's address (`off`: none). Default 127.0.0.1:8081, skipped with a
    /// warning when that port is taken.
    #[arg(long, value_name = "ADDR|off")]
    http: Option<String>,
    /// No progress bar (there is none either when standard error is not a terminal).
    #[arg(long)]
    quiet: bool,
    /// Threads that run the job's tasks (a task per partition, with `[event_time] watermark =
    /// "per-partition"`); default: `[job] parallelism`, else the cores, at most the tasks.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1024))]
    parallelism: Option<u32>,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run a pipeline over its input (all windows fire at the end of a bounded input).
    Run {
        pipeline: PathBuf,
        /// Resume from this savepoint.
        #[arg(long, value_name = "DIR")]
        from_savepoint: Option<PathBuf>,
        #[command(flatten)]
        args: RunArgs,
    },
    /// Check a pipeline file and its plugin.
    Validate { pipeline: PathBuf },
    /// A new plugin version: swapped live into a running job (`--job URL`), or resumed
    /// from a savepoint (`--from-savepoint DIR --pipeline FILE`); state is migrated.
    Deploy(DeployArgs),
    /// Plugins: scaffold, build, test and inspect.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
    /// Generate a synthetic Kilómetro Cero stream (JSON lines).
    Generate {
        #[command(subcommand)]
        stream: Stream,
    },
    /// The status of a running job (its control API at URL, e.g. http://127.0.0.1:8081).
    Status {
        #[arg(long, value_name = "URL")]
        job: String,
        /// Print the JSON (counters under the run summary's names).
        #[arg(long)]
        json: bool,
    },
    /// Ask a running job for a savepoint; prints its path.
    Savepoint {
        #[arg(long, value_name = "URL")]
        job: String,
        /// The job's token (default: $KM0_TOKEN).
        #[arg(long)]
        token: Option<String>,
    },
    /// Stop a running job: with a savepoint (default; prints its path) or `--drain`ing its
    /// windows first.
    Stop {
        #[arg(long, value_name = "URL")]
        job: String,
        #[arg(long)]
        drain: bool,
        #[arg(long)]
        token: Option<String>,
    },
    /// The savepoints of a job shared by a consumer group, in its checkpoint store (the
    /// pipeline's `[checkpoints] dir`, e.g. s3://bucket/prefix): complete ones first
    /// in what they hold, open and abandoned ones with why.
    Savepoints {
        #[arg(long, value_name = "URL")]
        store: String,
        /// Print the JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure events per CPU-second of a pipeline on a generated stream.
    Bench(BenchArgs),
}

#[derive(Subcommand)]
pub enum PluginCommand {
    /// Start a plugin project NAME (logic, SDK, WIT contract and a test case) in DIR.
    New {
        name: String,
        #[arg(long, value_enum, default_value = "rust")]
        lang: authoring::Lang,
        /// The folder to create the project in.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
    /// Build a plugin project into PATH/dist/<folder name>.wasm (a Python or JavaScript one
    /// only when a file of it changed since) and inspect the result.
    Build {
        #[arg(default_value = ".")]
        path: PathBuf,
    },
    /// Build a plugin project and run its test case (PATH/test) through km0.
    Test {
        #[arg(default_value = ".")]
        path: PathBuf,
    },
    /// Print a plugin's name, version, state schema, contract and the fields it reads.
    Inspect { plugin: PathBuf },
}

/// Carry out the command line's command.
pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run { pipeline, from_savepoint, args } => {
            let p = load(&pipeline)?;
            let summary = serve::serve_job(&p, args, from_savepoint, job::run)?;
            report::print_summary(&summary);
        }
        Command::Status { job, json } => api::status(&job, json)?,
        Command::Savepoint { job, token } => api::savepoint(&job, token)?,
        Command::Stop { job, drain, token } => api::stop(&job, drain, token)?,
        Command::Savepoints { store, json } => report::print_group_savepoints(&store, json)?,
        Command::Validate { pipeline } => validate(&pipeline)?,
        Command::Deploy(args) => deploy::deploy(args)?,
        Command::Generate { stream } => generate::generate(stream)?,
        Command::Plugin { command } => plugin(command)?,
        Command::Bench(args) => bench::bench(args)?,
    }
    Ok(())
}

/// `km0 validate`: the pipeline and its plugins checked, their identities printed.
fn validate(pipeline: &Path) -> Result<()> {
    let p = load(pipeline)?;
    let ids = job::validate(&p, &PluginRuntime::new()?)?;
    println!("ok: pipeline {:?}", p.name);
    for (a, id) in p.aggregations.iter().zip(ids) {
        println!(
            "  aggregation {:?}: plugin {} {} (state schema {}, contract {}, sha256 {})",
            a.name, id.name, id.version, id.state_schema, id.contract, id.sha256
        );
    }
    Ok(())
}

/// `km0 plugin ...`: scaffold, build, test or inspect a plugin.
fn plugin(command: PluginCommand) -> Result<()> {
    match command {
        PluginCommand::New { name, lang, dir } => {
            let project = authoring::new(&name, lang, &dir)?;
            println!("created {} ({lang} plugin)", project.display());
            println!("next: km0 plugin test {}", project.display());
        }
        PluginCommand::Build { path } => {
            let wasm = authoring::build(&path)?;
            println!("built {}", wasm.display());
            report::print_plugin(&PluginRuntime::new()?, &wasm)?;
        }
        PluginCommand::Test { path } => {
            let report = authoring::test(&path, &PluginRuntime::new()?)?;
            println!(
                "ok: {} results as expected ({} late, {} dead-lettered)",
                report.results, report.late, report.dead_lettered
            );
        }
        PluginCommand::Inspect { plugin } => report::print_plugin(&PluginRuntime::new()?, &plugin)?,
    }
    Ok(())
}

/// A run's options from its command line.
fn options(args: RunArgs, from_savepoint: Option<PathBuf>) -> RunOptions {
    RunOptions {
        input: args.input,
        output: args.output,
        stop_with_savepoint_after: args.stop_with_savepoint_after,
        savepoint_dir: args.savepoint_dir,
        from_savepoint,
        follow: args.follow.then_some(true),
        no_recover: args.no_recover,
        control: None,
        parallelism: args.parallelism.map(|n| n as usize),
        committer: None,
        since_stop: None,
    }
}

/// The pipeline file at `path`, parsed and checked.
fn load(path: &Path) -> Result<Pipeline> {
    Ok(Pipeline::load(path)?)
}
