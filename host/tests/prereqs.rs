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
