//! This thread's CPU clock, for timings that time spent preempted by other processes must not
//! inflate (the kernel benchmark's GEMM and FMA peak, the reuse cache's step-time measurement).

/// This thread's CPU time in seconds (time spent preempted by other processes does not count).
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_THREAD_CPUTIME_ID always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
