//! The reclaimer: a `SCHED_IDLE` thread that frees host buffers an executor gave up.
//!
//! Unmapping megabytes costs tens to hundreds of microseconds (page frees and TLB shootdowns
//! across the process's threads), which an executor between two experts should not wait for.
//! Handing a buffer over must be cheap too: waking a blocked thread is a futex syscall, about
//! 4 us per buffer on these VMs, which was most of the coe executors' expert-management time.
//! So buffers are handed over in batches: an idle reclaimer is woken by the first buffer, then
//! gathers for up to [`GATHER`] before freeing; a full batch ([`BATCH_BYTES`] or
//! [`BATCH_COUNT`]) wakes it at once. Nothing waits longer than [`GATHER`] to be freed, and at
//! most [`RECLAIM_QUEUE_BYTES`] are ever held for it.

use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use crate::direct_io::AlignedBuf;

/// Buffers waiting for the reclaimer at most; past that a buffer is freed where it is dropped.
const RECLAIM_QUEUE: usize = 64;
/// Bytes waiting for or being freed by the reclaimer at most (a starved `SCHED_IDLE` thread must
/// not hold memory past the budgets that freed it); past that a buffer is freed where it is
/// dropped.
pub const RECLAIM_QUEUE_BYTES: u64 = 32 << 20;
/// Bytes waiting that wake the reclaimer at once.
pub const BATCH_BYTES: u64 = 4 << 20;
/// Buffers waiting that wake the reclaimer at once.
pub const BATCH_COUNT: usize = 16;
/// How long a woken reclaimer gathers buffers before it frees them (when no batch fills).
pub const GATHER: Duration = Duration::from_millis(20);

/// What [`Reclaimer::hand_over`] did with a buffer.
#[derive(Debug)]
pub enum Handed {
    /// Queued; `wake` says whether the caller must notify the reclaimer.
    Queued {
        /// Notify the reclaimer (it is idle, or a batch just filled).
        wake: bool,
    },
    /// Refused (the queue is full by count or bytes): the caller frees it.
    Refused(AlignedBuf),
}

#[derive(Debug, Default)]
struct Pending {
    bufs: Vec<AlignedBuf>,
    bytes: u64,
    /// Bytes of the batch the reclaimer is freeing now.
    freeing: u64,
    /// The reclaimer is blocked until a first buffer comes.
    idle: bool,
    /// The reclaimer was notified and has not taken its batch yet.
    woken: bool,
}

impl Pending {
    fn batch_full(&self) -> bool {
        self.bytes >= BATCH_BYTES || self.bufs.len() >= BATCH_COUNT
    }
}

/// The queue between the threads that free buffers and the reclaimer thread.
#[derive(Debug, Default)]
pub struct Reclaimer {
    pending: Mutex<Pending>,
    wake: Condvar,
}

impl Reclaimer {
    /// Queue `buf` for freeing, saying whether the reclaimer must be notified (then call
    /// [`Self::notify`]); refuses it when the queue is full.
    pub fn hand_over(&self, buf: AlignedBuf) -> Handed {
        let Ok(mut p) = self.pending.lock() else { return Handed::Refused(buf) };
        let bytes = buf.capacity() as u64;
        if p.bufs.len() >= RECLAIM_QUEUE || p.bytes + p.freeing + bytes > RECLAIM_QUEUE_BYTES {
            return Handed::Refused(buf);
        }
        p.bufs.push(buf);
        p.bytes += bytes;
        let wake = !p.woken && (p.idle || p.batch_full());
        if wake {
            p.woken = true;
            p.idle = false;
        }
        Handed::Queued { wake }
    }

    /// Wake the reclaimer (after [`Self::hand_over`] said so).
    pub fn notify(&self) {
        self.wake.notify_one();
    }

    /// Bytes queued or being freed now.
    pub fn held_bytes(&self) -> u64 {
        self.pending.lock().map(|p| p.bytes + p.freeing).unwrap_or(0)
    }

    /// The next batch to free: blocks while nothing is queued, then gathers for up to `gather`
    /// unless a batch fills. The caller frees the batch, then calls [`Self::freed`].
    pub fn next_batch(&self, gather: Duration) -> Vec<AlignedBuf> {
        let Ok(mut p) = self.pending.lock() else { return Vec::new() };
        while p.bufs.is_empty() {
            p.idle = true;
            p.woken = false;
            p = match self.wake.wait(p) {
                Ok(p) => p,
                Err(_) => return Vec::new(),
            };
        }
        p.idle = false;
        if !p.batch_full() {
            p.woken = false;
            p = match self.wake.wait_timeout(p, gather) {
                Ok((p, _)) => p,
                Err(_) => return Vec::new(),
            };
        }
        p.woken = false;
        p.freeing = p.bytes;
        p.bytes = 0;
        std::mem::take(&mut p.bufs)
    }

    /// The batch [`Self::next_batch`] returned is freed.
    pub fn freed(&self) {
        if let Ok(mut p) = self.pending.lock() {
            p.freeing = 0;
        }
    }
}

/// Run the calling thread under `SCHED_IDLE`, so that it takes only cores nothing else wants
/// (on two cores a woken reclaimer would otherwise preempt the executor that woke it).
fn lowest_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread (pid 0) with a valid parameter block.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "reclaimer keeps the normal priority");
    }
}

/// Free `buf` on the process's reclaimer thread (started on first use), or here when its queue
/// is full (by count or by [`RECLAIM_QUEUE_BYTES`]) or the thread could not start.
pub fn free_later(buf: AlignedBuf) {
    static RECLAIMER: OnceLock<Option<&'static Reclaimer>> = OnceLock::new();
    let reclaimer = RECLAIMER.get_or_init(|| {
        let shared: &'static Reclaimer = Box::leak(Box::default());
        std::thread::Builder::new()
            .name("troupe-reclaim".into())
            .spawn(move || {
                lowest_priority();
                loop {
                    drop(shared.next_batch(GATHER));
                    shared.freed();
                }
            })
            .map_err(|e| tracing::warn!(error = %e, "no reclaimer thread: host buffers are freed inline"))
            .ok()
            .map(|_| shared)
    });
    let Some(reclaimer) = reclaimer else { return drop(buf) };
    match reclaimer.hand_over(buf) {
        Handed::Queued { wake: true } => reclaimer.notify(),
        Handed::Queued { wake: false } => {}
        Handed::Refused(buf) => drop(buf),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(len: usize) -> AlignedBuf {
        AlignedBuf::zeroed(len).unwrap()
    }

    #[test]
    fn an_idle_reclaimer_is_woken_once_then_again_only_by_a_full_batch() {
        let r = Reclaimer::default();
        r.pending.lock().unwrap().idle = true;
        assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { wake: true }));
        // Woken already: the next buffers ride along without another wake.
        for _ in 1..BATCH_COUNT {
            assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { wake: false }));
        }
        // It takes its batch (full: no gathering wait) and frees it.
        let batch = r.next_batch(Duration::ZERO);
        assert_eq!(batch.len(), BATCH_COUNT);
        assert_eq!(r.held_bytes(), BATCH_COUNT as u64 * 4096);
        drop(batch);
        r.freed();
        assert_eq!(r.held_bytes(), 0);
        // Busy (not idle, not woken): small buffers wait for the gather; a full batch wakes.
        for _ in 1..BATCH_COUNT {
            assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { wake: false }));
        }
        assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { wake: true }));
        assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { wake: false }));
    }

    #[test]
    fn the_queue_refuses_past_its_byte_cap_counting_what_is_being_freed() {
        let r = Reclaimer::default();
        let big = (RECLAIM_QUEUE_BYTES / 2) as usize;
        assert!(matches!(r.hand_over(buf(big)), Handed::Queued { .. }));
        let batch = r.next_batch(Duration::ZERO);
        assert_eq!(batch.len(), 1);
        // Still being freed: with it, another half and a page exceed the cap.
        assert!(matches!(r.hand_over(buf(big)), Handed::Queued { .. }));
        assert!(matches!(r.hand_over(buf(4096)), Handed::Refused(_)));
        drop(batch);
        r.freed();
        assert!(matches!(r.hand_over(buf(4096)), Handed::Queued { .. }));
        assert_eq!(r.held_bytes(), RECLAIM_QUEUE_BYTES / 2 + 4096);
    }
}
