//! Failure paths end in clear errors naming the file, never a panic: missing or bogus ONNX Runtime
//! library (in a child process, since the library loads once per process), missing and malformed
//! model files, wrong inputs. Needs `scripts/setup`.
#![cfg(feature = "onnx")]
#![allow(clippy::unwrap_used)] // test helpers: a panic is the failure report

use std::process::Command;

use troupe_kernels::assets::{self, Assets};
use troupe_kernels::onnx::{NamedTensor, OnnxError, OnnxSession, SessionConfig};

fn assets() -> Assets {
    Assets::locate().unwrap_or_else(|e| panic!("{e}"))
}

/// Runs one ignored `child_*` test of this binary in a fresh process with `env` set; returns stdout.
fn run_child(test: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--ignored", "--nocapture", "--test-threads=1"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child {test} failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("1 passed"), "child {test} did not run:\n{stdout}");
    stdout
}

/// In the child: creating a session must fail cleanly, twice (the failure is remembered).
fn expect_library_error(check: impl Fn(&OnnxError) -> bool) {
    let model = assets().path(assets::TINY_MLP).unwrap();
    for _ in 0..2 {
        let err = OnnxSession::from_file(&model, &SessionConfig::default()).unwrap_err();
        assert!(check(&err), "unexpected error: {err:?}");
        println!("CHILD-ERROR: {err}");
    }
}

#[test]
#[ignore = "run by missing_library_is_a_clear_error in a child process"]
fn child_missing_library() {
    expect_library_error(|e| matches!(e, OnnxError::LibraryMissing { .. }));
}

#[test]
#[ignore = "run by bogus_library_is_a_clear_error in a child process"]
fn child_bogus_library() {
    expect_library_error(|e| matches!(e, OnnxError::LibraryLoad { .. }));
}

#[test]
#[ignore = "run by unconfigured_library_is_a_clear_error in a child process"]
fn child_unconfigured_library() {
    let err = OnnxSession::from_bytes(b"", "empty", &SessionConfig::default()).unwrap_err();
    assert!(matches!(err, OnnxError::LibraryNotConfigured { .. }), "{err:?}");
    println!("CHILD-ERROR: {err}");
}

#[test]
fn missing_library_is_a_clear_error() {
    let path = "/nonexistent/dir/libonnxruntime.so.1.31.1";
    let out = run_child("child_missing_library", &[("ORT_DYLIB_PATH", path)]);
    assert!(
        out.contains(&format!(
            "CHILD-ERROR: ONNX Runtime library {path} (from ORT_DYLIB_PATH) does not exist"
        )),
        "{out}"
    );
    assert!(out.contains("run scripts/setup or set ORT_DYLIB_PATH"), "{out}");
}

#[test]
fn bogus_library_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let fake = dir.path().join("libonnxruntime.so");
    std::fs::write(&fake, b"this is not a shared library").unwrap();
    let out = run_child("child_bogus_library", &[("ORT_DYLIB_PATH", fake.to_str().unwrap())]);
    assert!(
        out.contains(&format!(
            "CHILD-ERROR: ONNX Runtime library {} could not be initialised",
            fake.display()
        )),
        "{out}"
    );
}

#[test]
fn unconfigured_library_is_a_clear_error() {
    let out = run_child(
        "child_unconfigured_library",
        &[("ORT_DYLIB_PATH", ""), ("TROUPE_CACHE", "/nonexistent/cache")],
    );
    assert!(out.contains("CHILD-ERROR: no ONNX Runtime library configured"), "{out}");
    assert!(out.contains("/nonexistent/cache/manifest.json"), "{out}");
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no_such_model.onnx");
    let err = OnnxSession::from_file(&path, &SessionConfig::default()).unwrap_err();
    assert!(matches!(err, OnnxError::ModelMissing { .. }), "{err:?}");
    assert!(err.to_string().contains("no_such_model.onnx"), "{err}");
}

/// Deterministic pseudo-random bytes (xorshift64).
fn noise(len: usize, mut state: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

#[test]
fn malformed_model_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    for (i, bytes) in
        [noise(4096, 0x9e37_79b9_7f4a_7c15), Vec::new(), b"\x08\x07".to_vec()].iter().enumerate()
    {
        let path = dir.path().join(format!("garbage{i}.onnx"));
        std::fs::write(&path, bytes).unwrap();
        let err = OnnxSession::from_file(&path, &SessionConfig::default()).unwrap_err();
        assert!(matches!(err, OnnxError::ModelMalformed { .. }), "{i}: {err:?}");
        assert!(err.to_string().contains(&format!("garbage{i}.onnx")), "{err}");
        let err = OnnxSession::from_bytes(bytes, "peer-bytes", &SessionConfig::default()).unwrap_err();
        assert!(matches!(err, OnnxError::ModelMalformed { .. }), "{i}: {err:?}");
        assert!(err.to_string().contains("peer-bytes"), "{err}");
    }
    // a valid model cut short
    let whole = std::fs::read(assets().path(assets::TINY_MLP).unwrap()).unwrap();
    let err = OnnxSession::from_bytes(&whole[..whole.len() / 2], "truncated", &SessionConfig::default())
        .unwrap_err();
    assert!(matches!(err, OnnxError::ModelMalformed { .. }), "{err:?}");
}

#[test]
fn wrong_inputs_are_named() {
    let mut s =
        OnnxSession::from_file(&assets().path(assets::TINY_MLP).unwrap(), &SessionConfig::default()).unwrap();
    let cases = [
        (vec![], "input x not given"),
        (vec![NamedTensor::i64("x", vec![1, 4], vec![0; 4])], "x is i64, the model wants f32"),
        (vec![NamedTensor::f32("x", vec![4], vec![0.0; 4])], "x has rank 1"),
        (vec![NamedTensor::f32("x", vec![1, 3], vec![0.0; 3])], "x has 3 on axis 1, the model wants 4"),
        (vec![NamedTensor::f32("x", vec![2, 4], vec![0.0; 4])], "8 elements but 4"),
        (
            vec![NamedTensor::f32("x", vec![1, 4], vec![0.0; 4]), NamedTensor::f32("z", vec![1], vec![0.0])],
            "z is not an input (inputs: x)",
        ),
    ];
    for (inputs, want) in cases {
        let err = s.run(&inputs).unwrap_err();
        assert!(matches!(err, OnnxError::Input { .. }), "{err:?}");
        assert!(err.to_string().contains(want), "{err} lacks {want}");
    }
    // the session still works afterwards
    assert!(s.run(&[NamedTensor::f32("x", vec![1, 4], vec![0.0; 4])]).is_ok());
}
