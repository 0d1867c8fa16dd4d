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

/// The arguments a fake rustc gets through `scripts/lib/rustc-pgo.sh` (the profile-guided
/// build's workspace wrapper) when cargo runs it with `args`, one per line.
fn through_pgo_wrapper(args: &[&str], flags: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let rustc = dir.path().join("rustc");
    std::fs::write(&rustc, "#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n").unwrap();
    Command::new("chmod").arg("+x").arg(&rustc).status().unwrap();
    let out = Command::new(repo().join("scripts/lib/rustc-pgo.sh"))
        .arg(&rustc)
        .args(args)
        .env("KM0_PGO_FLAGS", flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect()
}

#[test]
fn the_pgo_wrapper_gives_its_flags_to_the_km0_crate_alone() {
    let flags = "-Cprofile-use=/p/km0.profdata -Cllvm-args=-x";
    // km0's library and binary: the flags come last, each its own argument.
    assert_eq!(
        through_pgo_wrapper(&["--crate-name", "km0", "--edition=2021", "host/src/lib.rs"], flags),
        [
            "--crate-name",
            "km0",
            "--edition=2021",
            "host/src/lib.rs",
            "-Cprofile-use=/p/km0.profdata",
            "-Cllvm-args=-x"
        ]
    );
    // Other crates, a `km0` that is not the crate's name, and cargo's `rustc -vV`: untouched,
    // an argument with spaces kept whole.
    for args in [
        &["--crate-name", "km0_e2e", "tests/lib.rs"][..],
        &["--crate-name", "wasmtime", "--cfg", "feature=\"a b\""],
        &["--cfg", "km0", "--crate-name", "hashbrown"],
        &["-vV"],
    ] {
        assert_eq!(through_pgo_wrapper(args, flags), args, "{args:?}");
    }
    // No flags set: km0 compiles as in a plain build.
    assert_eq!(through_pgo_wrapper(&["--crate-name", "km0", "a.rs"], ""), ["--crate-name", "km0", "a.rs"]);
}
