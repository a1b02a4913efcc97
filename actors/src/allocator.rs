//! glibc allocator thresholds for a troupe process: fixed once at start instead of left to
//! drift as blocks are freed.
//!
//! Blocks of [`MMAP_THRESHOLD`] and more (a stage file, a session's large weights, a whole
//! tensor frame) are mapped and go back to the OS when freed. Smaller ones come from the heap,
//! whose free pages stay (up to [`TRIM_THRESHOLD`] at its top) for the next ones, rather than
//! being unmapped and faulted in again each time. Measured here: a pipeline task's ~200 KiB
//! activations cost ~0.4 ms per task with glibc's 128 KiB default, and the QUIC receive path
//! (a fresh 64 KiB buffer per datagram) spent about a quarter of its time in page faults and
//! page clearing. Code that drops a large working set trims explicitly
//! ([`release_free_memory`]), so RSS still follows what is live. No-ops off glibc.

/// Smallest block glibc maps on its own (see the module docs).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub const MMAP_THRESHOLD: i32 = 512 << 10;
/// Free bytes at the heap's top glibc keeps before returning them on its own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub const TRIM_THRESHOLD: i32 = 8 << 20;

/// Fixes the thresholds (idempotent; call before the process allocates its working set).
pub fn fix_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tunables.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

/// Returns freed heap memory to the OS (after a session or a large buffer is dropped).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory at the allocator's discretion.
    unsafe {
        libc::malloc_trim(0);
    }
}
