//! A CPU-heavy step (hashing or writing a large blob) run from async code without holding up
//! the other tasks of its runtime thread: on a node under a phone's CPU quota such a step takes
//! seconds, and the node's heartbeats must not wait on it.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Smallest blob whose check, hash and hand-over run [`off_the_runtime`]: a stage file (20 MB
/// and more), not an activation (a few MB at most), whose pull is on every task's path and
/// would pay for the hand-over each time (tried on every blob: MiniLM's streaming runs at N = W
/// went from 1.09x to 1.79x the simulator, median of five).
pub const OFF_RUNTIME_MIN_BYTES: usize = 16 << 20;

/// Runs `f`, which keeps its thread busy for a while, so that a multi-thread runtime first hands
/// this worker thread's other tasks on (`block_in_place`); on a current-thread runtime (the
/// simulation, most unit tests) or outside a runtime it runs in place.
pub fn off_the_runtime<T>(f: impl FnOnce() -> T) -> T {
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::off_the_runtime;

    #[test]
    fn runs_in_place_outside_a_runtime() {
        assert_eq!(off_the_runtime(|| 7), 7);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn runs_in_place_on_a_current_thread_runtime() {
        // block_in_place would panic here
        assert_eq!(off_the_runtime(|| 8), 8);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hands_the_other_tasks_on_in_a_multi_thread_runtime() {
        // on a runtime worker thread, a task spawned just before the blocking step sits in this
        // thread's queue; the step waits for it, so it returns in time only if the runtime ran
        // that task on another thread meanwhile (the 30 s wait is a guard, not a measurement)
        let step = tokio::spawn(async {
            let (tx, rx) = std::sync::mpsc::channel();
            let other = tokio::spawn(async move { tx.send(()).ok() });
            let got = off_the_runtime(|| rx.recv_timeout(std::time::Duration::from_secs(30)));
            (got.is_ok(), other)
        });
        let (ran, other) = step.await.unwrap();
        assert!(ran, "the other task did not run while this thread was blocked");
        other.await.unwrap();
    }
}
