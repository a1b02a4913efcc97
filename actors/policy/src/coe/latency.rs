//! The latency model the scheduler plans with, built from a [`Profile`].
//!
//! Batch latency is interpolated linearly between the profiled batch sizes of the expert's size
//! class (extrapolated along the last segment past the last point); an expert larger than every
//! class scales the largest class linearly by size. Load time is size / bandwidth of the tier the
//! expert is read from.

use super::model::Tier;
use super::profile::{ExecutorKind, ExecutorProfile, Profile, ProfileError, SizeClass};
use crate::Micros;

/// Batch and load latencies per executor, derived from a validated profile. Executor indices
/// are positions in the profile; an index at or above [`LatencyModel::executors`] is a caller
/// bug and panics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatencyModel {
    executors: Vec<ExecutorProfile>,
}

impl LatencyModel {
    /// Build from a profile (validated again here, so a profile built in code is checked too).
    pub fn from_profile(profile: &Profile) -> Result<LatencyModel, ProfileError> {
        profile.validate()?;
        Ok(LatencyModel { executors: profile.executors.clone() })
    }

    /// Number of executors.
    pub fn executors(&self) -> usize {
        self.executors.len()
    }

    /// The profile entry of executor `e`.
    fn exec(&self, e: usize) -> &ExecutorProfile {
        &self.executors[e]
    }

    /// Name of executor `e`.
    pub fn name(&self, e: usize) -> &str {
        &self.exec(e).name
    }

    /// Whether executor `e` is a CPU or a GPU (each kind gets its own thread settings).
    pub fn kind(&self, e: usize) -> ExecutorKind {
        self.exec(e).kind
    }

    /// Bytes executor `e` keeps for resident experts.
    pub fn expert_budget(&self, e: usize) -> u64 {
        self.exec(e).expert_memory_bytes
    }

    /// Largest useful batch on executor `e`.
    pub fn max_batch(&self, e: usize) -> usize {
        self.exec(e).max_batch as usize
    }

    /// Time to load an expert of `size_bytes` onto executor `e` from `tier`.
    pub fn load_time(&self, e: usize, size_bytes: u64, tier: Tier) -> Micros {
        let bw = u128::from(self.exec(e).bandwidth(tier).max(1));
        let us = (u128::from(size_bytes) * 1_000_000).div_ceil(bw);
        Micros(u64::try_from(us).unwrap_or(u64::MAX))
    }

    /// Time to run one batch of `batch` requests through an expert of `size_bytes` on executor
    /// `e` (zero for an empty batch).
    pub fn batch_latency(&self, e: usize, size_bytes: u64, batch: usize) -> Micros {
        if batch == 0 {
            return Micros::ZERO;
        }
        let classes = &self.exec(e).size_classes;
        let (class, scale) = match classes.iter().find(|c| c.max_expert_bytes >= size_bytes) {
            Some(c) => (c, 1.0),
            None => {
                // Validation guarantees at least one class.
                let last = &classes[classes.len() - 1];
                (last, size_bytes as f64 / last.max_expert_bytes as f64)
            }
        };
        let us = interpolate(class, batch as f64) * scale;
        Micros(us.round().max(1.0) as u64)
    }

    /// Time to run `count` queued requests of one expert as full batches plus a remainder.
    pub fn group_latency(&self, e: usize, size_bytes: u64, count: usize) -> Micros {
        let max = self.max_batch(e).max(1);
        let full = (count / max) as u64;
        let rest = count % max;
        let full_time = self.batch_latency(e, size_bytes, max).0.saturating_mul(full);
        Micros(full_time) + self.batch_latency(e, size_bytes, rest)
    }
}

/// Linear interpolation of a class's latency curve at `batch` (>= 1).
fn interpolate(class: &SizeClass, batch: f64) -> f64 {
    let pts = &class.points;
    let at = |i: usize| (f64::from(pts[i].batch), pts[i].latency.0 as f64);
    if pts.len() == 1 {
        let (b0, l0) = at(0);
        return l0 * batch / b0;
    }
    // Find the segment [i, i+1] containing batch, or the last one to extrapolate.
    let mut i = 0;
    while i + 2 < pts.len() && f64::from(pts[i + 1].batch) < batch {
        i += 1;
    }
    let (b0, l0) = at(i);
    let (b1, l1) = at(i + 1);
    let slope = ((l1 - l0) / (b1 - b0)).max(0.0);
    (l0 + slope * (batch - b0)).max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coe::profile::{ExecutorKind, LatencyPoint};

    fn model() -> LatencyModel {
        let class = |max, pts: &[(u32, u64)]| SizeClass {
            max_expert_bytes: max,
            points: pts.iter().map(|&(b, l)| LatencyPoint { batch: b, latency: Micros(l) }).collect(),
        };
        let profile = Profile {
            hardware_fingerprint: "test".into(),
            executors: vec![ExecutorProfile {
                name: "gpu0".into(),
                kind: ExecutorKind::Gpu,
                memory_bytes: 1000,
                expert_memory_bytes: 800,
                max_batch: 8,
                host_bandwidth: 4_000_000,
                ssd_bandwidth: 1_000_000,
                size_classes: vec![class(100, &[(1, 10), (4, 16), (8, 32)]), class(400, &[(1, 50)])],
            }],
        };
        LatencyModel::from_profile(&profile).unwrap()
    }

    #[test]
    fn interpolates_batch_latency_within_a_class() {
        let m = model();
        assert_eq!(m.batch_latency(0, 100, 1), Micros(10));
        assert_eq!(m.batch_latency(0, 100, 2), Micros(12)); // 10 + 2 * (2 - 1)
        assert_eq!(m.batch_latency(0, 100, 4), Micros(16));
        assert_eq!(m.batch_latency(0, 50, 6), Micros(24)); // 16 + 4 * (6 - 4)
        assert_eq!(m.batch_latency(0, 100, 10), Micros(40)); // extrapolated along the last segment
        assert_eq!(m.batch_latency(0, 100, 0), Micros::ZERO);
    }

    #[test]
    fn picks_size_class_and_scales_past_the_largest() {
        let m = model();
        assert_eq!(m.batch_latency(0, 101, 1), Micros(50));
        assert_eq!(m.batch_latency(0, 400, 3), Micros(150)); // single point: linear in batch
        assert_eq!(m.batch_latency(0, 800, 1), Micros(100)); // twice the largest class
    }

    #[test]
    fn load_time_is_size_over_tier_bandwidth() {
        let m = model();
        assert_eq!(m.load_time(0, 1_000_000, Tier::Ssd), Micros(1_000_000));
        assert_eq!(m.load_time(0, 1_000_000, Tier::Host), Micros(250_000));
        assert_eq!(m.load_time(0, 1, Tier::Ssd), Micros(1)); // rounds up
    }

    #[test]
    fn group_latency_splits_into_max_batches() {
        let m = model();
        // 8 + 8 + 3 requests: 32 + 32 + 14
        assert_eq!(m.group_latency(0, 100, 19), Micros(78));
        assert_eq!(m.group_latency(0, 100, 0), Micros::ZERO);
    }
}
