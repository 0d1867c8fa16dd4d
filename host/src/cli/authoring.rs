//! Plugin authoring, for the CLI: `km0 plugin new` writes a self-contained plugin project
//! from the templates in `plugins/templates/` (embedded in the binary together with the
//! language's SDK and the WIT contract, so what ships is what the repository tests);
//! `km0 plugin build` turns a project into a component, installing the piece of toolchain
//! it needs or saying exactly what is missing; `km0 plugin test` builds it and runs the
//! project's test case (`test/`) through the real host, comparing with `expected.jsonl`.
//!
//! Tooling that shells out to cargo, pip, componentize-py and node lives here, at the CLI
//! edge, not in the `km0` library.

use anyhow::{bail, Context, Result};
use km0::job::{self, RunOptions};
use km0::pipeline::Pipeline;
use km0::plugin::PluginRuntime;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::SystemTime;

/// The language of a plugin project.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    Js,
}

impl std::fmt::Display for Lang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Lang::Rust => "Rust",
            Lang::Python => "Python",
            Lang::Js => "JavaScript",
        })
    }
}

/// A file of a new project: its path in the project and its text.
type Template = (&'static str, &'static str);

const WIT: &str = include_str!("../../../wit/aggregate.wit");

const RUST: &[Template] = &[
    ("Cargo.toml", include_str!("../../../plugins/templates/rust/Cargo.toml")),
    ("src/lib.rs", include_str!("../../../plugins/templates/rust/src/lib.rs")),
];
/// The Rust SDK, vendored into the project as `km0-plugin/` (rewritten by `vendor_sdk`).
const RUST_SDK: &[Template] = &[
    ("km0-plugin/Cargo.toml", include_str!("../../../plugins/sdk/Cargo.toml")),
    ("km0-plugin/src/lib.rs", include_str!("../../../plugins/sdk/src/lib.rs")),
    ("km0-plugin/src/runtime.rs", include_str!("../../../plugins/sdk/src/runtime.rs")),
    ("km0-plugin/src/json.rs", include_str!("../../../plugins/sdk/src/json.rs")),
    ("km0-plugin/wit/aggregate.wit", WIT),
    // The versions the repository's plugins are tested with, as a starting lock file.
    ("Cargo.lock", include_str!("../../../plugins/Cargo.lock")),
];
const PYTHON: &[Template] = &[
    ("aggregate.py", include_str!("../../../plugins/templates/python/aggregate.py")),
    ("km0_sdk.py", include_str!("../../../plugins/python/km0_sdk.py")),
    ("wit/aggregate.wit", WIT),
];
const JS: &[Template] = &[
    ("aggregate.js", include_str!("../../../plugins/templates/js/aggregate.js")),
    ("km0_sdk.js", include_str!("../../../plugins/js/km0_sdk.js")),
    ("build.mjs", include_str!("../../../plugins/js/build.mjs")),
    ("package.json", include_str!("../../../plugins/js/package.json")),
    ("package-lock.json", include_str!("../../../plugins/js/package-lock.json")),
    ("wit/aggregate.wit", WIT),
];
const TEST: &[Template] = &[
    ("test/pipeline.toml", include_str!("../../../plugins/templates/test/pipeline.toml")),
    ("test/events.jsonl", include_str!("../../../plugins/templates/test/events.jsonl")),
    ("test/expected.jsonl", include_str!("../../../plugins/templates/test/expected.jsonl")),
    (".gitignore", "/dist/\n/target/\n/test/out/\nnode_modules/\n__pycache__/\n"),
];

/// The Rust toolchain's target for components.
const WASM_TARGET: &str = "wasm32-wasip2";
const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";

/// `km0 plugin new`: write the project `parent/name` and return its path.
pub fn new(name: &str, lang: Lang, parent: &Path) -> Result<PathBuf> {
    check_name(name)?;
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists: choose another name or folder", dir.display());
    }
    let files: Vec<(&str, String)> = match lang {
        Lang::Rust => RUST
            .iter()
            .map(|(p, t)| (*p, t.replace("{{name}}", name)))
            .chain(RUST_SDK.iter().map(|(p, t)| (*p, vendor_sdk(p, t))))
            .collect(),
        Lang::Python => PYTHON.iter().map(|(p, t)| (*p, t.replace("{{name}}", name))).collect(),
        Lang::Js => JS
            .iter()
            .map(|(p, t)| (*p, t.replace("{{name}}", name).replace("km0-js-plugins", name)))
            .collect(),
    };
    for (path, text) in files.into_iter().chain(TEST.iter().map(|(p, t)| (*p, t.replace("{{name}}", name)))) {
        let path = dir.join(path);
        if let Some(folder) = path.parent() {
            std::fs::create_dir_all(folder).with_context(|| format!("create {}", folder.display()))?;
        }
        std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    }
    Ok(dir)
}

/// Plugin names become crate names, file names and savepoint identities: keep them plain.
fn check_name(name: &str) -> Result<()> {
    let ok = name.starts_with(|c: char| c.is_ascii_lowercase())
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.ends_with('-');
    if !ok {
        bail!("plugin name {name:?}: use lowercase letters, digits and '-', starting with a letter");
    }
    Ok(())
}

/// The SDK as a stand-alone crate: its own copy of the WIT, no workspace inheritance.
fn vendor_sdk(path: &str, text: &str) -> String {
    match path {
        "km0-plugin/src/lib.rs" => text.replace("path: \"../../wit\"", "path: \"wit\""),
        "km0-plugin/Cargo.toml" => text
            .replace("version.workspace = true", "version = \"0.1.0\"")
            .replace("edition.workspace = true", "edition = \"2021\"")
            .replace("license.workspace = true", "license = \"Apache-2.0\"")
            .replace(
                "serde = { workspace = true }",
                "serde = { version = \"1\", default-features = false, features = [\"derive\", \"alloc\"] }",
            ),
        _ => text.to_string(),
    }
}

/// `km0 plugin build`: build the project in `dir` into `dir/dist/<folder name>.wasm`.
pub fn build(dir: &Path) -> Result<PathBuf> {
    let dir = dir.canonicalize().with_context(|| format!("plugin project {}", dir.display()))?;
    let name = dir.file_name().and_then(|n| n.to_str()).context("plugin project folder has no name")?;
    let dist = dir.join("dist");
    std::fs::create_dir_all(&dist).with_context(|| format!("create {}", dist.display()))?;
    let out = dist.join(format!("{name}.wasm"));
    let lang = detect(&dir)?;
    // Cargo knows when a Rust build is up to date; the other two are built again only when
    // the project changed (each takes 10 s or more, and `km0 plugin test` builds first).
    if lang != Lang::Rust && up_to_date(&dir, &out) {
        eprintln!("km0: {} is up to date (no file of the project changed since it was built)", out.display());
        return Ok(out);
    }
    // Built beside, then renamed: a build that fails leaves no component that looks new.
    // (It is dated when written, as make's targets are: the tools create caches in the
    // project while they run, `__pycache__/`, which changes its folder.)
    let fresh = dist.join(format!(".{name}.wasm.tmp"));
    match lang {
        Lang::Rust => build_rust(&dir, &fresh)?,
        Lang::Python => build_python(&dir, &fresh)?,
        Lang::Js => build_js(&dir, &fresh)?,
    }
    std::fs::rename(&fresh, &out)
        .with_context(|| format!("rename {} to {}", fresh.display(), out.display()))?;
    Ok(out)
}

/// Folders of a project that its build does not read (besides hidden ones): what builds
/// and tests write, and the installed tools.
const NOT_SOURCES: &[&str] = &["dist", "test", "target", "node_modules", "__pycache__"];

/// Whether the component `out` was built after the last change to the project in `dir`:
/// to any of its files and folders (a file removed changes its folder), but those in
/// [`NOT_SOURCES`] and hidden ones. False when something cannot be read.
fn up_to_date(dir: &Path, out: &Path) -> bool {
    let Ok(built) = std::fs::metadata(out).and_then(|m| m.modified()) else { return false };
    newest_change(dir).is_ok_and(|newest| newest < built)
}

/// The latest modification time of `dir` and what it holds, but [`NOT_SOURCES`] and
/// hidden entries.
fn newest_change(dir: &Path) -> std::io::Result<SystemTime> {
    let mut newest = std::fs::metadata(dir)?.modified()?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || NOT_SOURCES.contains(&name.as_ref()) {
            continue;
        }
        // Followed, as the build tools follow links.
        let path = entry.path();
        let meta = std::fs::metadata(&path)?;
        let changed = if meta.is_dir() { newest_change(&path)? } else { meta.modified()? };
        newest = newest.max(changed);
    }
    Ok(newest)
}

fn detect(dir: &Path) -> Result<Lang> {
    if dir.join("Cargo.toml").is_file() {
        Ok(Lang::Rust)
    } else if dir.join("aggregate.py").is_file() {
        Ok(Lang::Python)
    } else if dir.join("aggregate.js").is_file() {
        Ok(Lang::Js)
    } else {
        bail!(
            "{}: no Cargo.toml, aggregate.py or aggregate.js, so not a plugin project (start one with `km0 plugin new`)",
            dir.display()
        )
    }
}

/// Run a tool, its output going to our stderr; `what` names it in errors.
fn run_tool(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd.stdout(Stdio::inherit()).stderr(Stdio::inherit()).status().with_context(|| {
        format!("could not start {what} ({:?}): is it installed and on PATH?", cmd.get_program())
    })?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

fn found(program: &str, arg: &str) -> bool {
    Command::new(program)
        .arg(arg)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn build_rust(dir: &Path, out: &Path) -> Result<()> {
    let installed = Command::new("rustup").args(["target", "list", "--installed"]).output();
    match installed {
        Ok(o) if String::from_utf8_lossy(&o.stdout).lines().any(|l| l.trim() == WASM_TARGET) => {}
        Ok(_) => {
            eprintln!("km0: installing the Rust target {WASM_TARGET}");
            run_tool(Command::new("rustup").args(["target", "add", WASM_TARGET]), "rustup target add")?;
        }
        Err(_) => bail!(
            "rustup is not on PATH, so km0 cannot check or install the Rust target {WASM_TARGET}: \
             install Rust with rustup, or make sure your toolchain has {WASM_TARGET}"
        ),
    }
    let manifest = dir.join("Cargo.toml");
    let output = Command::new("cargo")
        .args(["build", "--release", "--target", WASM_TARGET, "--message-format=json-render-diagnostics"])
        .arg("--manifest-path")
        .arg(&manifest)
        .stderr(Stdio::inherit())
        .output()
        .context("could not start cargo: is Rust installed and on PATH?")?;
    if !output.status.success() {
        bail!("cargo build of {} failed ({})", manifest.display(), output.status);
    }
    // The component is the cdylib artifact of the project's own package.
    let mut wasm = None;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        if msg["target"]["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "cdylib")) {
            let mut files = msg["filenames"].as_array().into_iter().flatten().filter_map(|f| f.as_str());
            wasm = files.rfind(|f| f.ends_with(".wasm")).map(PathBuf::from).or(wasm);
        }
    }
    let wasm = wasm.with_context(|| {
        format!(
            "cargo built no .wasm component: {} needs `[lib] crate-type = [\"cdylib\"]`",
            manifest.display()
        )
    })?;
    std::fs::copy(&wasm, out).with_context(|| format!("copy {} to {}", wasm.display(), out.display()))?;
    Ok(())
}

fn build_python(dir: &Path, out: &Path) -> Result<()> {
    if !found("componentize-py", "--version") {
        eprintln!("km0: installing {COMPONENTIZE_PY} (PyPI)");
        let pip = Command::new("python3").args(["-m", "pip", "install", "--quiet", COMPONENTIZE_PY]).status();
        if !pip.is_ok_and(|s| s.success()) || !found("componentize-py", "--version") {
            bail!(
                "componentize-py is missing and could not be installed: run `python3 -m pip install {COMPONENTIZE_PY}` \
                 (needs Python 3.10+ with pip) and make sure `componentize-py` is on PATH"
            );
        }
    }
    run_tool(
        Command::new("componentize-py")
            .arg("--wit-path")
            .arg(dir.join("wit"))
            .args(["--world", "aggregate-plugin", "componentize", "-p"])
            .arg(dir)
            .args(["aggregate", "-o"])
            .arg(out),
        "componentize-py",
    )
}

fn build_js(dir: &Path, out: &Path) -> Result<()> {
    if !found("node", "--version") || !found("npm", "--version") {
        bail!("node and npm are needed to build JavaScript plugins: install Node.js 18+ (e.g. `apt-get install nodejs npm`)");
    }
    if !dir.join("node_modules/@bytecodealliance/componentize-js").is_dir() {
        eprintln!("km0: installing componentize-js (npm) into {}", dir.display());
        run_tool(
            Command::new("npm").args(["install", "--no-audit", "--no-fund"]).current_dir(dir),
            "npm install",
        )?;
    }
    run_tool(
        Command::new("node")
            .arg(dir.join("build.mjs"))
            .arg(dir.join("aggregate.js"))
            .arg(dir.join("wit"))
            .arg(out),
        "componentize-js (build.mjs)",
    )
}

/// What `km0 plugin test` found.
pub struct TestReport {
    pub results: usize,
    pub late: u64,
    pub dead_lettered: u64,
}

/// `km0 plugin test`: build, run `test/pipeline.toml`, compare `test/out/results.jsonl`
/// with `test/expected.jsonl` line by line.
pub fn test(dir: &Path, runtime: &PluginRuntime) -> Result<TestReport> {
    build(dir)?;
    let case = dir.join("test");
    let pipeline = Pipeline::load(&case.join("pipeline.toml"))?;
    let out = case.join("out");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("clear {}", out.display()))?;
    }
    let summary = job::run(&pipeline, &RunOptions { no_recover: true, ..Default::default() }, runtime)?;
    let read = |p: &Path| std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()));
    let expected = read(&case.join("expected.jsonl"))?;
    let got = match &pipeline.sink {
        km0::pipeline::SinkSpec::File { path } => read(path)?,
        _ => bail!("{}: the test pipeline must write to a file sink", case.display()),
    };
    let (expected, got): (Vec<&str>, Vec<&str>) = (expected.lines().collect(), got.lines().collect());
    let mut differences = Vec::new();
    for i in 0..expected.len().max(got.len()) {
        let (e, g) = (expected.get(i), got.get(i));
        if e != g {
            differences.push(format!(
                "  line {}:\n    expected {}\n    got      {}",
                i + 1,
                e.unwrap_or(&"(nothing)"),
                g.unwrap_or(&"(nothing)")
            ));
        }
    }
    if !differences.is_empty() {
        bail!(
            "{} of {} result lines differ from {}:\n{}{}",
            differences.len(),
            expected.len().max(got.len()),
            case.join("expected.jsonl").display(),
            differences.into_iter().take(10).collect::<Vec<_>>().join("\n"),
            dead_letter_reasons(&pipeline.dead_letter)
        );
    }
    let c = &summary.counters;
    Ok(TestReport { results: got.len(), late: c.late, dead_lettered: c.dead_lettered })
}

/// The distinct reasons of a test run's dead letters (its file), first three, as lines to
/// add to a failed test's message: why the plugin failed, in its own words.
fn dead_letter_reasons(spec: &km0::pipeline::DeadLetterSpec) -> String {
    let km0::pipeline::DeadLetterSpec::File(path) = spec else { return String::new() };
    let Ok(text) = std::fs::read_to_string(path) else { return String::new() };
    let mut reasons: Vec<String> = Vec::new();
    for line in text.lines() {
        let reason = serde_json::from_str::<serde_json::Value>(line)
            .ok()
            .and_then(|v| v["reason"].as_str().map(str::to_string));
        if let Some(r) = reason.filter(|r| !reasons.contains(r)) {
            reasons.push(r);
        }
        if reasons.len() == 3 {
            break;
        }
    }
    let n = text.lines().count();
    match reasons.is_empty() {
        true => String::new(),
        false => format!(
            "\n{n} dead letters ({}); why:\n{}",
            path.display(),
            reasons.iter().map(|r| format!("  {r}")).collect::<Vec<_>>().join("\n")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_component_is_up_to_date_until_a_file_its_build_reads_changes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("p");
        let now = SystemTime::now();
        let at = |secs_ago: u64| now - Duration::from_secs(secs_ago);
        let write = |rel: &str, when: SystemTime| {
            let path = dir.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, rel).unwrap();
            std::fs::File::options().write(true).open(&path).unwrap().set_modified(when).unwrap();
        };
        // Folders are dated as well (a file created or removed changes its folder).
        let date_dir = |rel: &str, when: SystemTime| {
            std::fs::File::open(dir.join(rel)).unwrap().set_modified(when).unwrap();
        };
        for f in ["aggregate.py", "km0_sdk.py", "wit/aggregate.wit", "test/expected.jsonl"] {
            write(f, at(100));
        }
        for d in ["wit", "test", ""] {
            date_dir(d, at(100));
        }
        let out = dir.join("dist/p.wasm");
        assert!(!up_to_date(&dir, &out), "no component yet");
        write("dist/p.wasm", at(50));
        date_dir("", at(100));
        assert!(up_to_date(&dir, &out));

        // What builds, tests and tools write is not read by the build.
        for f in [
            "test/expected.jsonl",
            "test/out/results.jsonl",
            "node_modules/x/y.js",
            ".git/HEAD",
            "__pycache__/a.pyc",
        ] {
            write(f, at(10));
        }
        for d in ["node_modules", ".git", "__pycache__", ""] {
            date_dir(d, at(100));
        }
        assert!(up_to_date(&dir, &out));

        // A source changed, at the top or deeper down; a source removed.
        write("aggregate.py", at(10));
        assert!(!up_to_date(&dir, &out));
        write("aggregate.py", at(100));
        assert!(up_to_date(&dir, &out));
        write("wit/aggregate.wit", at(10));
        assert!(!up_to_date(&dir, &out));
        write("wit/aggregate.wit", at(100));
        date_dir("wit", at(100));
        assert!(up_to_date(&dir, &out));
        std::fs::remove_file(dir.join("km0_sdk.py")).unwrap();
        assert!(!up_to_date(&dir, &out));
    }
}
