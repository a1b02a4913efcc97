//! Lifespan-aware aligning: fill-clamp-refill allocation of compute within a slice
//! (paper §3.2.2, "Expert Lifespan-aware Aligning").
//!
//! Each expert is pre-profiled for its per-token latency (at one thread, or one SM share) and its
//! saturation point (threads beyond which it gets no faster). Its work coefficient is
//! `tokens × per-token latency`. The controller then
//! 1. seeds every expert with its minimum threads;
//! 2. distributes the remaining budget proportional to work coefficients so heavy experts catch up;
//! 3. clamps saturated experts at their saturation point and redistributes the excess to the
//!    unsaturated ones, repeating until nothing is left or everyone is saturated.
//!
//! Threads that would only push experts past saturation stay idle (the paper's "avoids waste
//! beyond saturation"), so `Σ threads + idle == total` always.

use super::ExpertId;

/// Profiled resource behaviour of one expert in a slice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertProfile {
    /// The expert.
    pub expert: ExpertId,
    /// Tokens routed to it in this mini-batch.
    pub tokens: u64,
    /// Per-token latency at one thread, in microseconds.
    pub per_token_us: f64,
    /// Least threads it can run with (at least 1 is used).
    pub min_threads: u32,
    /// Saturation point: more threads than this do not speed it up.
    pub saturation: u32,
}

impl ExpertProfile {
    /// Work coefficient `tokens × per-token latency` (microseconds at one thread).
    pub fn work(&self) -> f64 {
        self.tokens as f64 * self.per_token_us.max(0.0)
    }

    /// Predicted latency in microseconds with `threads` threads (linear up to saturation);
    /// infinite with no threads and some work.
    pub fn latency_us(&self, threads: u32) -> f64 {
        let eff = threads.min(self.saturation.max(1));
        if eff == 0 {
            return if self.work() > 0.0 { f64::INFINITY } else { 0.0 };
        }
        self.work() / eff as f64
    }

    fn floor(&self) -> u32 {
        self.min_threads.max(1)
    }

    fn cap(&self) -> u32 {
        self.saturation.max(self.floor())
    }
}

/// Threads per expert (same order as the profiles) plus the idle remainder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadAllocation {
    /// `(expert, threads)` in input order.
    pub threads: Vec<(ExpertId, u32)>,
    /// Threads left unused because every expert is saturated.
    pub idle: u32,
}

impl ThreadAllocation {
    /// Slice makespan: the slowest expert's predicted latency, in microseconds.
    pub fn makespan_us(&self, profiles: &[ExpertProfile]) -> f64 {
        profiles.iter().zip(&self.threads).map(|(p, (_, t))| p.latency_us(*t)).fold(0.0, f64::max)
    }

    /// Busy thread-microseconds over `threads × makespan`: how much of the slice's compute is used.
    pub fn utilisation(&self, profiles: &[ExpertProfile], total: u32) -> f64 {
        let span = self.makespan_us(profiles);
        if span <= 0.0 || total == 0 {
            return 0.0;
        }
        let busy: f64 = profiles
            .iter()
            .zip(&self.threads)
            .map(|(p, (_, t))| p.latency_us(*t) * (*t).min(p.cap()) as f64)
            .sum();
        busy / (span * total as f64)
    }
}

/// Why threads could not be allocated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ThreadError {
    /// The experts' minimum threads add up to more than the budget.
    #[error("minimum threads {need} exceed the {total} available")]
    Insufficient {
        /// Σ min threads.
        need: u64,
        /// Threads available.
        total: u32,
    },
}

/// Fill-clamp-refill (see the module doc). Deterministic: fractional shares are rounded by the
/// largest-remainder rule, ties to the earlier expert.
pub fn fill_clamp_refill(profiles: &[ExpertProfile], total: u32) -> Result<ThreadAllocation, ThreadError> {
    let need: u64 = profiles.iter().map(|p| p.floor() as u64).sum();
    if need > total as u64 {
        return Err(ThreadError::Insufficient { need, total });
    }
    let mut alloc: Vec<u32> = profiles.iter().map(ExpertProfile::floor).collect();
    let mut left = total - need as u32;
    while left > 0 {
        let open: Vec<usize> = (0..profiles.len()).filter(|&i| alloc[i] < profiles[i].cap()).collect();
        if open.is_empty() {
            break;
        }
        let weights: Vec<f64> = open.iter().map(|&i| profiles[i].work()).collect();
        let shares = apportion(left, &weights);
        let mut excess = 0u32;
        for (k, &i) in open.iter().enumerate() {
            let want = alloc[i] + shares[k];
            let cap = profiles[i].cap();
            if want > cap {
                excess += want - cap;
                alloc[i] = cap;
            } else {
                alloc[i] = want;
            }
        }
        left = excess;
    }
    Ok(ThreadAllocation { threads: profiles.iter().map(|p| p.expert).zip(alloc).collect(), idle: left })
}

/// Least rows (tokens) one thread takes in an expert's step: past `rows / MIN_ROWS_PER_THREAD`
/// threads an expert is saturated (its chunks get too small to pay for a thread).
pub const MIN_ROWS_PER_THREAD: usize = 8;

/// Profiles of the experts of one block for [`fill_clamp_refill`], from the rows routed to each:
/// the experts of a block share one shape, so the work of each is proportional to its rows
/// (`per_token_us` is the measured time per row, the same for all of them); at least one thread,
/// saturated at `rows / MIN_ROWS_PER_THREAD`. Expert `i` is `ExpertId(i)`.
pub fn block_profiles(rows: &[usize], per_token_us: f64) -> Vec<ExpertProfile> {
    rows.iter()
        .enumerate()
        .map(|(i, &n)| ExpertProfile {
            expert: ExpertId(i as u32),
            tokens: n as u64,
            per_token_us,
            min_threads: 1,
            saturation: (n / MIN_ROWS_PER_THREAD).max(1) as u32,
        })
        .collect()
}

/// Least multiply-adds one expert thread should carry to pay for itself: handing a chunk to the
/// kernels' expert pool and back, and chunking an expert's cache, cost about as much as 10^5
/// multiply-adds of the expert's own work, so at 2^20 per thread the overhead stays a few percent.
pub const MIN_MACS_PER_THREAD: u64 = 1 << 20;

/// Whether running a block's experts concurrently on threads pays: the block's expert work
/// (`rows x row_macs` multiply-adds summed over its experts) is at least two threads' worth of
/// `min_macs`. Below that the experts run in turn on the executor's thread (threads would only
/// add spawn and copy work, and the bench's clock is process CPU time). `min_macs` 0: always.
pub fn threads_pay(rows: &[usize], row_macs: u64, min_macs: u64) -> bool {
    let work = rows.iter().map(|&n| n as u64).sum::<u64>().saturating_mul(row_macs);
    work >= min_macs.saturating_mul(2)
}

/// Threads for each expert of a block (the executor's split): fill-clamp-refill over the experts
/// that have rows, with `total` threads or one per such expert if that is more (each runs on at
/// least one); experts without rows get 0. Returns the split and the allocation it came from.
pub fn block_threads(rows: &[usize], per_token_us: f64, total: u32) -> (Vec<u32>, ThreadAllocation) {
    let active: Vec<usize> = (0..rows.len()).filter(|&i| rows[i] > 0).collect();
    let profiles: Vec<ExpertProfile> =
        block_profiles(rows, per_token_us).into_iter().filter(|p| p.tokens > 0).collect();
    let total = total.max(active.len() as u32);
    // Σ min threads = active experts <= total, so fill-clamp-refill cannot refuse.
    let alloc = fill_clamp_refill(&profiles, total).unwrap_or_else(|_| ThreadAllocation {
        threads: profiles.iter().map(|p| (p.expert, 1)).collect(),
        idle: 0,
    });
    let mut split = vec![0u32; rows.len()];
    for (i, (_, t)) in active.iter().zip(&alloc.threads) {
        split[*i] = *t;
    }
    (split, alloc)
}

/// Uniform split (the ablation / default-parallel baseline): `total / n` each, remainder to the
/// first experts, no saturation awareness.
pub fn uniform_split(profiles: &[ExpertProfile], total: u32) -> ThreadAllocation {
    let n = profiles.len() as u32;
    if n == 0 {
        return ThreadAllocation { threads: Vec::new(), idle: total };
    }
    let (base, extra) = (total / n, total % n);
    ThreadAllocation {
        threads: profiles
            .iter()
            .enumerate()
            .map(|(i, p)| (p.expert, base + u32::from((i as u32) < extra)))
            .collect(),
        idle: 0,
    }
}

/// Splits `amount` in proportion to `weights` (equal split if all weights are zero) with the
/// largest-remainder rule; the parts sum to `amount`.
fn apportion(amount: u32, weights: &[f64]) -> Vec<u32> {
    let sum: f64 = weights.iter().filter(|w| w.is_finite() && **w > 0.0).sum();
    let exact: Vec<f64> = weights
        .iter()
        .map(|&w| {
            if sum > 0.0 {
                if w.is_finite() && w > 0.0 { amount as f64 * w / sum } else { 0.0 }
            } else {
                amount as f64 / weights.len() as f64
            }
        })
        .collect();
    let mut parts: Vec<u32> = exact.iter().map(|e| e.floor() as u32).collect();
    let given: u32 = parts.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| {
        let ra = exact[a] - exact[a].floor();
        let rb = exact[b] - exact[b].floor();
        rb.total_cmp(&ra).then(a.cmp(&b))
    });
    for &i in order.iter().take(amount.saturating_sub(given) as usize) {
        parts[i] += 1;
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn prof(id: u32, tokens: u64, min: u32, sat: u32) -> ExpertProfile {
        ExpertProfile { expert: ExpertId(id), tokens, per_token_us: 1.0, min_threads: min, saturation: sat }
    }

    #[test]
    fn hand_checked_fill_clamp_refill() {
        // 16 threads. A: work 100, min 1, sat 8; B: work 300, min 1, sat 4; C: work 200, min 2, sat 16.
        // Fill: 1, 1, 2 (12 left). Proportional 100:300:200 -> +2, +6, +4 = 3, 7, 6.
        // Clamp B at 4 (3 excess). Refill A:C = 100:200 -> +1, +2 -> A 4, C 8. Sum 16.
        // Latencies: A 100/4 = 25, B 300/4 = 75, C 200/8 = 25.
        let ps = [prof(0, 100, 1, 8), prof(1, 300, 1, 4), prof(2, 200, 2, 16)];
        let a = fill_clamp_refill(&ps, 16).unwrap();
        let t: Vec<u32> = a.threads.iter().map(|(_, t)| *t).collect();
        assert_eq!(t, vec![4, 4, 8]);
        assert_eq!(a.idle, 0);
        assert_eq!(a.makespan_us(&ps), 75.0);
        // Uniform 6/5/5 leaves B at 300/4 = 75 as well but A idles; C = 200/5 = 40.
        let u = uniform_split(&ps, 16);
        assert_eq!(u.threads.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![6, 5, 5]);
    }

    #[test]
    fn all_saturated_leaves_threads_idle() {
        let ps = [prof(0, 10, 1, 2), prof(1, 10, 1, 3)];
        let a = fill_clamp_refill(&ps, 10).unwrap();
        assert_eq!(a.threads.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(a.idle, 5);
        assert_eq!(fill_clamp_refill(&ps, 1), Err(ThreadError::Insufficient { need: 2, total: 1 }));
    }

    #[test]
    fn aligned_allocation_beats_uniform_on_skewed_work() {
        let ps = [prof(0, 100, 1, 64), prof(1, 700, 1, 64)];
        let fcr = fill_clamp_refill(&ps, 8).unwrap();
        let uni = uniform_split(&ps, 8);
        // FCR: 1,1 + 6 split 1:7 -> 0.75, 5.25 -> 1, 5 (largest remainder 0.75) = 2, 6.
        assert_eq!(fcr.threads.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![2, 6]);
        assert!(fcr.makespan_us(&ps) < uni.makespan_us(&ps));
    }

    #[test]
    fn threads_pay_only_for_two_threads_worth_of_work() {
        // 256 rows of 2048 multiply-adds (the tiny student's block forward): 2^19, under 2^21.
        assert!(!threads_pay(&[32; 8], 2048, MIN_MACS_PER_THREAD));
        // Twice the rows and four times the width: 2^22.
        assert!(threads_pay(&[64; 8], 8192, MIN_MACS_PER_THREAD));
        assert!(threads_pay(&[1, 0], 1, 0));
        assert!(!threads_pay(&[0, 0], 1 << 30, 1));
    }

    #[test]
    fn block_threads_by_hand() {
        // Rows 80, 0, 16, 40 with 8 threads: active 0, 2, 3; saturation 10, 2, 5.
        // Fill 1,1,1 (5 left); shares 80:16:40 of 5 -> 2.94, 0.59, 1.47: floors 2, 0, 1, the two
        // left go to the largest remainders (.94, .59) -> +3, +1, +1 -> 4, 2, 2; none saturated.
        let (split, alloc) = block_threads(&[80, 0, 16, 40], 2.0, 8);
        assert_eq!(split, vec![4, 0, 2, 2]);
        assert_eq!(alloc.idle, 0);
        // More active experts than threads: one each.
        assert_eq!(block_threads(&[9, 9, 9], 1.0, 2).0, vec![1, 1, 1]);
        // All saturated: idle threads stay idle.
        let (split, alloc) = block_threads(&[8, 16], 1.0, 16);
        assert_eq!((split, alloc.idle), (vec![1, 2], 13));
    }

    proptest! {
        #[test]
        fn allocation_sums_to_the_available_threads(
            specs in proptest::collection::vec((0u64..10_000, 1u32..4, 1u32..40), 1..12),
            total in 0u32..200,
        ) {
            let ps: Vec<_> = specs.iter().enumerate()
                .map(|(i, &(t, m, s))| prof(i as u32, t, m, s)).collect();
            match fill_clamp_refill(&ps, total) {
                Ok(a) => {
                    let sum: u32 = a.threads.iter().map(|(_, t)| *t).sum();
                    prop_assert_eq!(sum + a.idle, total);
                    for (p, (_, t)) in ps.iter().zip(&a.threads) {
                        prop_assert!(*t >= p.min_threads.max(1));
                        prop_assert!(*t <= p.saturation.max(p.min_threads).max(1));
                    }
                    if a.idle > 0 {
                        prop_assert!(ps.iter().zip(&a.threads).all(|(p, (_, t))| *t == p.saturation.max(p.min_threads).max(1)));
                    }
                }
                Err(ThreadError::Insufficient { need, .. }) => prop_assert!(need > total as u64),
            }
        }
    }
}
