//! The set-up scripts' detection of libclang, against file layouts like real images: the
//! fresh image ships only `libclang-cpp.so.14`, which bindgen cannot load, and must be
//! found wanting; `libclang-dev`'s layouts must be found.

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
