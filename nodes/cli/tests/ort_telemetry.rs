//! `troupe` opts out of ONNX Runtime's telemetry before the library loads: a real `troupe embed`
//! (ONNX Runtime loaded, a model run) with a fresh `HOME` and no `ORT_DISABLE_TELEMETRY` of its
//! own leaves no telemetry cache there. Without the opt-out, Microsoft's Linux build (1.31, the one
//! `scripts/setup` installs) creates `~/.cache/Microsoft/DeveloperTools/.onnxruntime/` while the
//! environment is being created, before the first session.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn embed_leaves_no_onnx_runtime_telemetry_cache() {
    let home = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args(["embed", "the opt-out holds"])
        .env("HOME", home.path())
        .env_remove("XDG_CACHE_HOME")
        .env_remove("ORT_DISABLE_TELEMETRY")
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "troupe embed failed (ONNX Runtime and the model come from scripts/setup):\n{log}"
    );
    let cache = home.path().join(".cache").join("Microsoft");
    assert!(!cache.exists(), "ONNX Runtime wrote its telemetry cache {}:\n{log}", cache.display());
}
