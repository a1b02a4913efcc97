//! The process's resident memory figures, in a test binary of their own: RSS is the whole
//! process's, so a test running beside others (which allocate and free) could see it shrink.
#![cfg(feature = "onnx")]

use troupe_kernels::onnx::{peak_resident_bytes, resident_bytes};

#[test]
fn resident_memory_grows_when_pages_are_touched() {
    let before = resident_bytes().expect("/proc/self/statm (Linux)");
    let block = vec![1u8; 64 << 20];
    let after = resident_bytes().expect("/proc/self/statm (Linux)");
    assert!(block.iter().step_by(4096).all(|&b| b == 1));
    assert!(after >= before + (32 << 20), "{before} -> {after}");
    assert!(peak_resident_bytes().expect("VmHWM in /proc/self/status") >= after);
}
