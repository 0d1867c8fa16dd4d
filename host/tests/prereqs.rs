//! The set-up scripts' detection of libclang, against file layouts like real images: the
//! fresh image ships only `libclang-cpp.so.14`, which bindgen cannot load, and must be
//! found wanting; `libclang-dev`'s layouts must be found. And the profile-guided build's
//! rustc wrapper, which must give its flags to the km0 crate alone.

mod common;
use common::*;

use std::path::Path;
use std::process::Command;

/// What `km0_find_libclang` prints for a fake root with these files (None: not found).
fn find_libclang(files: &[&str]) -> Option<String> {
    let root = tempfile::tempdir().unwrap();
    for f in files {
        let p = root.path().join(f.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, b"").unwrap();
    }
    let script = repo().join("scripts/lib/prereqs.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(r#". "$1"; km0_find_libclang "$2""#)
        .arg("bash")
        .arg(&script)
        .arg(root.path())
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if out.status.success() {
        assert!(!printed.is_empty(), "found, but printed no path");
        let rel = Path::new(&printed).strip_prefix(root.path()).unwrap();
        Some(format!("/{}", rel.display()))
    } else {
        assert!(printed.is_empty(), "not found, yet printed {printed}");
        None
    }
}

#[test]
fn the_fresh_images_libclang_cpp_is_not_libclang() {
    // The fresh image: LLVM 14 and libclang-cpp14, no libclang1-14 / libclang-dev.
    assert_eq!(
        find_libclang(&[
            "/usr/lib/x86_64-linux-gnu/libclang-cpp.so.14",
            "/usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "/usr/lib/llvm-14/lib/libclang-cpp.so",
            "/usr/lib/llvm-14/lib/libLLVM-14.so",
        ]),
        None
    );
    assert_eq!(find_libclang(&[]), None);
}

#[test]
fn libclang_dev_layouts_are_found() {
    // libclang-dev + libclang1-14 on Debian 12.
    assert_eq!(
        find_libclang(&[
            "/usr/lib/llvm-14/lib/libclang-cpp.so.14",
            "/usr/lib/llvm-14/lib/libclang.so",
            "/usr/lib/llvm-14/lib/libclang-14.so.1",
        ]),
        Some("/usr/lib/llvm-14/lib/libclang.so".into())
    );
    // libclang1-14 alone (runtime library, no -dev symlink): bindgen loads it too.
    assert_eq!(
        find_libclang(&["/usr/lib/x86_64-linux-gnu/libclang-14.so.14.0.6"]),
        Some("/usr/lib/x86_64-linux-gnu/libclang-14.so.14.0.6".into())
    );
    assert_eq!(find_libclang(&["/usr/lib64/libclang.so.17"]), Some("/usr/lib64/libclang.so.17".into()));
}

/// What a fake rustc gets through `scripts/lib/rustc-pgo.sh` (the profile-guided build's
/// workspace wrapper) when cargo runs it with `args`, with KM0_PGO_MODE `mode` and KM0_PGO_PATH
/// `path`: the wrapper's exit code and the arguments, one per line. The fake rustc exits 3
/// when its first argument is `fail`.
fn through_pgo_wrapper(args: &[&str], mode: &str, path: &str) -> (Option<i32>, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let rustc = dir.path().join("rustc");
    let script = "#!/bin/sh\nprintf '%s\\n' \"$@\"\n[ \"$1\" = fail ] && exit 3\nexit 0\n";
    std::fs::write(&rustc, script).unwrap();
    Command::new("chmod").arg("+x").arg(&rustc).status().unwrap();
    let run = || {
        Command::new(repo().join("scripts/lib/rustc-pgo.sh"))
            .arg(&rustc)
            .args(args)
            .env("KM0_PGO_MODE", mode)
            .env("KM0_PGO_PATH", path)
            .output()
    };
    // A fork elsewhere in this process may still hold the script open for writing a
    // moment (ETXTBSY): tried again.
    let out = (0..50)
        .find_map(|_| match run() {
            Err(e) if e.raw_os_error() == Some(26) => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                None
            }
            other => Some(other.unwrap()),
        })
        .expect("the wrapper ran");
    (out.status.code(), String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect())
}

#[test]
fn the_pgo_wrapper_gives_its_flag_to_the_km0_library_alone() {
    let km0 = ["--crate-name", "km0", "--edition=2021", "--crate-type", "lib", "host/src/lib.rs"];
    let bin = ["--crate-name", "km0", "--crate-type", "bin", "host/src/main.rs"];
    // km0's library; its binary too when instrumented: the flag comes last, one argument
    // even with a space.
    for (mode, path, args) in [
        ("generate", "/tmp/w/raw", &km0[..]),
        ("generate", "/tmp/w/raw", &bin),
        ("use", "/my data/km0.profdata", &km0),
    ] {
        let (code, got) = through_pgo_wrapper(args, mode, path);
        assert_eq!(code, Some(0));
        let flag = format!("-Cprofile-{mode}={path}");
        assert_eq!(got, [args, &[flag.as_str()]].concat(), "{mode}");
    }
    // km0's binary when optimised, other crates, a `km0` that is not the crate's name, and
    // cargo's `rustc -vV`: untouched, an argument with spaces kept whole.
    for args in [
        &bin[..],
        &["--crate-name", "km0_e2e", "--crate-type", "lib", "tests/lib.rs"],
        &["--crate-name", "wasmtime", "--cfg", "feature=\"a b\""],
        &["--cfg", "km0", "--crate-name", "hashbrown"],
        &["-vV"],
    ] {
        assert_eq!(
            through_pgo_wrapper(args, "use", "/p"),
            (Some(0), args.iter().map(|a| a.to_string()).collect())
        );
    }
    // No mode: km0 compiles as in a plain build. rustc's exit code is the wrapper's.
    assert_eq!(through_pgo_wrapper(&km0, "", "/p"), (Some(0), km0.map(String::from).to_vec()));
    assert_eq!(
        through_pgo_wrapper(&["fail", "--crate-name", "km0", "--crate-type", "lib"], "use", "/p").0,
        Some(3)
    );
    assert_eq!(through_pgo_wrapper(&["fail", "--crate-name", "serde"], "use", "/p").0, Some(3));
    // A mode it does not know, or no path: refused, rustc not run.
    assert_eq!(through_pgo_wrapper(&km0, "yes", "/p"), (Some(2), vec![]));
    assert_eq!(through_pgo_wrapper(&km0, "use", "").0, Some(1));
}

/// The defined functions of an object file (`nm`), sorted.
fn defined_functions(object: &Path) -> Vec<String> {
    let out = Command::new("nm").arg("--defined-only").arg(object).output().unwrap();
    assert!(out.status.success(), "nm {}", object.display());
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| match l.split_whitespace().collect::<Vec<_>>()[..] {
            [_, "T", name] => Some(name.to_string()),
            _ => None,
        })
        .collect();
    names.sort();
    names
}

/// Compiles every source of a fake librocksdb-sys the way `cc` does, through
/// `scripts/lib/rocksdb-cxx.sh` with batches of `batch`, links the objects with a main that
/// prints what each source's function returns, and gives: each source's object's defined
/// functions, what the program printed, and the wrapper's stderr.
fn through_rocksdb_cxx(batch: &str) -> (Vec<(String, Vec<String>)>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    // Sources of two folders; b's two each define their own `same` (a batch of them does not
    // compile as one unit); snappy/ is not RocksDB's and not in the list.
    let sources = [
        ("rocksdb/a/one.cc", "extern \"C\" int one() { return 1; }"),
        ("rocksdb/a/two.cc", "extern \"C\" int two() { return 2; }"),
        (
            "rocksdb/a/three.cc",
            "static int helper() { return 3; }\nextern \"C\" int three() { return helper(); }",
        ),
        (
            "rocksdb/b/clash1.cc",
            "static int same() { return 10; }\nextern \"C\" int clash1() { return same(); }",
        ),
        (
            "rocksdb/b/clash2.cc",
            "static int same() { return 20; }\nextern \"C\" int clash2() { return same(); }",
        ),
        ("snappy/own.cc", "extern \"C\" int own() { return 7; }"),
    ];
    for (path, text) in sources {
        std::fs::create_dir_all(root.join(path).parent().unwrap()).unwrap();
        std::fs::write(root.join(path), text).unwrap();
    }
    std::fs::create_dir_all(root.join("rocksdb/include/rocksdb")).unwrap();
    std::fs::write(root.join("rocksdb/include/rocksdb/db.h"), "").unwrap();
    std::fs::write(
        root.join("rocksdb_lib_sources.txt"),
        "a/one.cc\na/two.cc\na/three.cc\nb/clash1.cc\nb/clash2.cc\nutil/build_version.cc\n",
    )
    .unwrap();
    let out = root.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let mut objects = vec![];
    let mut stderr = String::new();
    for (path, _) in sources {
        let object = out.join(format!("h-{}.o", Path::new(path).file_stem().unwrap().to_string_lossy()));
        let run = Command::new(repo().join("scripts/lib/rocksdb-cxx.sh"))
            .current_dir(root)
            .args(["-O2", "-fPIC", "-I", "rocksdb/include/", "-o"])
            .arg(&object)
            .args(["-c", path])
            .env("KM0_ROCKSDB_BATCH", batch)
            .env_remove("CXX")
            .output()
            .unwrap();
        stderr.push_str(&String::from_utf8_lossy(&run.stderr));
        assert!(run.status.success(), "{path}: {stderr}");
        objects.push((path.to_string(), defined_functions(&object)));
    }
    let main = root.join("main.cc");
    std::fs::write(
        &main,
        "#include <cstdio>\nextern \"C\" { int one(); int two(); int three(); int clash1(); int clash2(); int own(); }\n\
         int main() { std::printf(\"%d %d %d %d %d %d\", one(), two(), three(), clash1(), clash2(), own()); }\n",
    )
    .unwrap();
    let program = root.join("program");
    let linked = Command::new("c++")
        .arg(&main)
        .args(objects.iter().map(|(path, _)| {
            out.join(format!("h-{}.o", Path::new(path).file_stem().unwrap().to_string_lossy()))
        }))
        .arg("-o")
        .arg(&program)
        .status()
        .unwrap();
    assert!(linked.success());
    let printed = Command::new(&program).output().unwrap();
    (objects, String::from_utf8_lossy(&printed.stdout).into_owned(), stderr)
}

#[test]
fn rocksdbs_sources_compile_in_batches_into_the_same_program() {
    let (objects, printed, stderr) = through_rocksdb_cxx("24");
    let defined = |path: &str| objects.iter().find(|(p, _)| p == path).unwrap().1.clone();
    // a/'s three sources are one batch, compiled into its first source's object.
    assert_eq!(defined("rocksdb/a/one.cc"), ["one", "three", "two"]);
    assert_eq!(defined("rocksdb/a/two.cc"), Vec::<String>::new());
    assert_eq!(defined("rocksdb/a/three.cc"), Vec::<String>::new());
    // b/'s batch does not compile as one unit: one by one, linked into its first object,
    // each source keeping its own `same`; and said.
    assert_eq!(defined("rocksdb/b/clash1.cc"), ["clash1", "clash2"]);
    assert_eq!(defined("rocksdb/b/clash2.cc"), Vec::<String>::new());
    assert!(stderr.contains("the batch of b/clash1.cc did not compile as one unit"), "{stderr}");
    // Not one of RocksDB's listed sources: compiled as asked.
    assert_eq!(defined("snappy/own.cc"), ["own"]);
    assert_eq!(printed, "1 2 3 10 20 7");

    // Batches of two: a/three.cc is a batch of its own.
    let (objects, printed, _) = through_rocksdb_cxx("2");
    let defined = |path: &str| objects.iter().find(|(p, _)| p == path).unwrap().1.clone();
    assert_eq!(defined("rocksdb/a/one.cc"), ["one", "two"]);
    assert_eq!(defined("rocksdb/a/three.cc"), ["three"]);
    assert_eq!(printed, "1 2 3 10 20 7");
}
