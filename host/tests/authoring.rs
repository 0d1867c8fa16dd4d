//! Plugin authoring through the CLI: `km0 plugin new` for each language gives a project
//! whose `km0 plugin test` builds a real component (cargo, componentize-py,
//! componentize-js) and passes its test case; a wrong expectation makes it fail with the
//! differing line; bad names, existing folders and non-projects are refused clearly.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn km0(args: &[&str], dir: &Path) -> Output {
    let mut cmd = Command::new(common::km0());
    cmd.args(args).current_dir(dir);
    // Rust templates build in a target folder of their own: the outer `cargo test` may
    // hold the shared one's lock.
    if let Ok(target) = std::env::var("CARGO_TARGET_DIR") {
        cmd.env("CARGO_TARGET_DIR", Path::new(&target).join("plugin-templates"));
    }
    cmd.output().expect("run km0")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn scaffold_builds_and_passes_its_test(lang: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let name = format!("tpl-{lang}");
    let o = km0(&["plugin", "new", &name, "--lang", lang, "--dir", "."], tmp.path());
    assert!(o.status.success(), "plugin new: {}", text(&o));
    let project = tmp.path().join(&name);
    assert!(project.join("test/expected.jsonl").is_file());

    let o = km0(&["plugin", "test", &name], tmp.path());
    assert!(o.status.success(), "plugin test ({lang}): {}", text(&o));
    assert!(text(&o).contains("ok: 4 results as expected (0 late, 0 dead-lettered)"), "{}", text(&o));

    let wasm = project.join(format!("dist/{name}.wasm"));
    let o = km0(&["plugin", "inspect", wasm.to_str().unwrap()], tmp.path());
    assert!(o.status.success(), "{}", text(&o));
    let info = text(&o);
    assert!(info.contains(&format!("name:          {name}\n")), "{info}");
    assert!(
        info.contains("state schema:  1\n") && info.contains("contract:      km0:plugin@0.5.0"),
        "{info}"
    );
    assert!(info.contains("field:         value (int)"), "{info}");

    // The case really checks the plugin's output: a wrong expectation fails, naming the line.
    let expected = project.join("test/expected.jsonl");
    let right = std::fs::read_to_string(&expected).unwrap();
    let wrong = right.replace("\"max\":8}", "\"max\":80}");
    std::fs::write(&expected, wrong).unwrap();
    let o = km0(&["plugin", "test", &name], tmp.path());
    assert!(!o.status.success());
    let err = text(&o);
    assert!(err.contains("1 of 4 result lines differ") && err.contains("line 2:"), "{err}");
    assert!(err.contains(r#"got      {"key":"0|b","value":{"window_start":0,"window_end":60000,"key":["b"],"count":2,"max":8}}"#), "{err}");
    // Only the test case changed: a Python or JavaScript component is not built again
    // (cargo decides for Rust).
    if lang != "rust" {
        assert!(err.contains(&format!("dist/{name}.wasm is up to date")), "{err}");
    }

    // A changed source is built again (checked with Python, the quicker of the two tools
    // that km0 decides for; which files count is the unit test's).
    if lang == "python" {
        std::fs::write(&expected, &right).unwrap();
        let source = project.join("aggregate.py");
        let before = std::fs::read_to_string(&source).unwrap();
        let changed =
            before.replace(r#""max": maximum,"#, r#""max": None if maximum is None else maximum + 1,"#);
        assert_ne!(changed, before);
        std::fs::write(&source, changed).unwrap();
        let o = km0(&["plugin", "test", &name], tmp.path());
        assert!(!o.status.success());
        let err = text(&o);
        assert!(!err.contains("is up to date") && err.contains("4 of 4 result lines differ"), "{err}");
        assert!(err.contains(r#"got      {"key":"0|b","value":{"window_start":0,"window_end":60000,"key":["b"],"count":2,"max":9}}"#), "{err}");

        // A plugin that raises: the failed test says why, in the plugin's own words (what
        // it printed, Python's traceback).
        let raising = before.replace(
            "    def add(self, groups, events):\n",
            "    def add(self, groups, events):\n        print(\"adding\", len(groups.window_start), \"groups\")\n        raise ValueError(\"boom from python\")\n",
        );
        assert_ne!(raising, before, "the template's add changed: update this case");
        std::fs::write(&source, raising).unwrap();
        let o = km0(&["plugin", "test", &name], tmp.path());
        assert!(!o.status.success());
        let err = text(&o);
        assert!(
            err.contains("dead letters")
                && err.contains("add: ")
                && err.contains("adding 1 groups")
                && err.contains("ValueError: boom from python")
                && !err.contains("memory"),
            "{err}"
        );
    }
}

#[test]
fn rust_template_builds_and_passes_its_test() {
    scaffold_builds_and_passes_its_test("rust");
}

#[test]
fn python_template_builds_and_passes_its_test() {
    scaffold_builds_and_passes_its_test("python");
}

#[test]
fn javascript_template_builds_and_passes_its_test() {
    scaffold_builds_and_passes_its_test("js");
}

#[test]
fn bad_names_existing_folders_and_non_projects_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["My_Plugin", "9lives", "x-", "a/b"] {
        let o = km0(&["plugin", "new", bad], tmp.path());
        assert!(!o.status.success());
        assert!(text(&o).contains("use lowercase letters, digits and '-'"), "{bad}: {}", text(&o));
    }
    std::fs::create_dir(tmp.path().join("taken")).unwrap();
    let o = km0(&["plugin", "new", "taken", "--lang", "python"], tmp.path());
    assert!(!o.status.success() && text(&o).contains("already exists"), "{}", text(&o));
    let o = km0(&["plugin", "build", "taken"], tmp.path());
    assert!(!o.status.success());
    assert!(text(&o).contains("no Cargo.toml, aggregate.py or aggregate.js"), "{}", text(&o));
}
