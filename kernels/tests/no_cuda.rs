//! The no-GPU paths: without a driver library, and with a driver (our stub) that sees no device.
//! Both must give a clear `CudaUnavailable` error and a CPU fallback, never a panic.
#![cfg(feature = "cuda")]

use std::path::Path;
use std::process::Command;

use troupe_kernels::ops::{Op, Softmax};
use troupe_kernels::{Device, KernelError, Tensor};

/// Set in the child process that runs with the stub driver on LD_LIBRARY_PATH.
const CHILD_ENV: &str = "TROUPE_KERNELS_STUB_CHILD";
const STUB_TEST: &str = "stub_driver_without_device_is_an_error_not_a_panic";

#[test]
fn without_driver_library_cuda_is_a_clear_error() {
    if troupe_kernels::cuda::driver_library_present() {
        // A driver is installed (a GPU machine): the missing-library path cannot be reached in
        // this process, so check the other side of the same contract: opening the device either
        // works or names the driver's reason, never a panic or a missing-library error.
        match Device::cuda(0) {
            Ok(d) => assert!(d.name().starts_with("cuda"), "{}", d.name()),
            Err(KernelError::CudaUnavailable(reason)) => {
                assert!(!reason.contains("libcuda"), "the driver library is present, yet: {reason}")
            }
            Err(other) => panic!("expected Ok or CudaUnavailable, got {other:?}"),
        }
        return;
    }
    match Device::cuda(0) {
        Err(KernelError::CudaUnavailable(reason)) => {
            assert!(reason.contains("libcuda"), "{reason}");
        }
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
    assert!(Device::from_name("cuda:0").is_err());
    assert!(Device::from_name("tpu").is_err());
    let best = Device::best();
    assert_eq!(best.name(), "cpu");
    // Ops still run on the fallback device.
    let x = Tensor::from_f32(&[1, 2], vec![0.0, 0.0]).unwrap();
    assert_eq!(Softmax.run(&best, &x).unwrap().to_vec_f32(), vec![0.5, 0.5]);
}

/// The stub's C source, embedded so the test binary also runs away from the source tree.
const STUB_C: &str = include_str!("stub-libcuda/stub.c");

/// A scratch directory: under the target directory when it exists (a real disk), else the system's.
fn scratch_dir() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    if base.is_dir() {
        tempfile::tempdir_in(base).expect("temp dir under the target dir")
    } else {
        tempfile::tempdir().expect("temp dir")
    }
}

fn compile_stub(dir: &Path) {
    let src = dir.join("stub.c");
    std::fs::write(&src, STUB_C).expect("write stub.c");
    let so = dir.join("libcuda.so.1");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("no C compiler {cc:?} to build the stub driver (set CC): {e}"));
    assert!(status.success(), "compiling {} failed", src.display());
    // cudarc tries `libcuda.so` before `libcuda.so.1`; offer both names.
    std::os::unix::fs::symlink(&so, dir.join("libcuda.so")).expect("symlink libcuda.so");
}

#[test]
fn stub_driver_without_device_is_an_error_not_a_panic() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // Child: the stub is first on LD_LIBRARY_PATH.
        println!("CHILD-DRIVER-PRESENT: {}", troupe_kernels::cuda::driver_library_present());
        match Device::cuda(0) {
            Err(e) => println!("CHILD-RESULT: Err({e})"),
            Ok(d) => println!("CHILD-RESULT: Ok({})", d.name()),
        }
        println!("CHILD-BEST: {}", Device::best().name());
        return;
    }
    let dir = scratch_dir();
    compile_stub(dir.path());
    let mut lib_path = dir.path().as_os_str().to_owned();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
        lib_path.push(":");
        lib_path.push(old);
    }
    // dlopen reads LD_LIBRARY_PATH at process start, hence a fresh process of this test binary.
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", STUB_TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("LD_LIBRARY_PATH", &lib_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(
        !stderr.contains("panicked") && !stdout.contains("panicked"),
        "child panicked:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("CHILD-DRIVER-PRESENT: true"), "stub not loaded:\n{stdout}");
    assert!(
        stdout.contains("CHILD-RESULT: Err(CUDA unavailable: no CUDA device"),
        "expected a no-device error:\n{stdout}"
    );
    assert!(
        stdout.contains("no CUDA-capable device is detected"),
        "the reason should carry the driver's own message (from the stub):\n{stdout}"
    );
    assert!(stdout.contains("CHILD-BEST: cpu"), "{stdout}");
}
