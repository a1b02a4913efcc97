//! Storage at an edge device's bandwidth (issue 43, item 6): the decisions around the reuse
//! cache's disk reads that are not the cache's own.
//!
//! * [`check_read_bps`]: which storage read throttles a node may ask for.
//! * [`read_bps_for`]: the bandwidth at which one un-hidden reuse read costs a chosen share of the
//!   compute it saves (the seed's 25 s of I/O against 35 s of compute: 0.7x).
//! * [`OnDemand`]: a FoggyCache-like reuse cache (reuse without prefetch or residency), the
//!   ablation the seed compares its I/O stall against: every computed entry is kept on disk only,
//!   every reuse is a disk read the step waits for, nothing stays in memory.

use std::collections::BTreeMap;

use super::reuse::TokenKey;

/// The slowest storage read throttle accepted, bytes per second (256 KiB/s: a reuse entry of a
/// few tens of KiB then already costs a tenth of a second; slower is a misconfiguration).
pub const MIN_READ_BPS: u64 = 256 << 10;
/// The fastest accepted, bytes per second (64 GB/s: beyond any storage an edge board has, so a
/// throttle there limits nothing).
pub const MAX_READ_BPS: u64 = 64_000_000_000;
/// The seed's ratio of an un-hidden reuse read to the compute it saves (25 s of I/O vs 35 s).
pub const SEED_READ_OVER_COMPUTE: f64 = 25.0 / 35.0;

/// Whether `bps` is a storage read throttle a node may ask for (0 means none); the error says why
/// not, for the caller to name its field.
pub fn check_read_bps(bps: u64) -> Result<(), String> {
    if bps == 0 || (MIN_READ_BPS..=MAX_READ_BPS).contains(&bps) {
        Ok(())
    } else {
        Err(format!(
            "{bps} B/s is outside {MIN_READ_BPS}..={MAX_READ_BPS} (0: no throttle); an edge board's \
             storage reads at tens to hundreds of MB/s"
        ))
    }
}

/// The read bandwidth (bytes per second) at which reading one entry of `entry_bytes` costs
/// `ratio` times `saved_us`, the compute its reuse saves, given that the storage's own latency
/// already costs `base_read_us` per entry unthrottled (the throttle adds `entry_bytes / bps`).
/// `None` when the storage is already that slow (no throttle can make it faster) or an input is
/// not positive; the result is clamped into [`check_read_bps`]'s range.
pub fn read_bps_for(entry_bytes: u64, saved_us: f64, base_read_us: f64, ratio: f64) -> Option<u64> {
    let target_us = saved_us * ratio;
    let added_us = target_us - base_read_us.max(0.0);
    if entry_bytes == 0 || added_us.is_nan() || added_us <= 0.0 || !target_us.is_finite() {
        return None;
    }
    let bps = entry_bytes as f64 * 1e6 / added_us;
    Some((bps.round() as u64).clamp(MIN_READ_BPS, MAX_READ_BPS))
}

/// What [`OnDemand`] says for one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OnDemandPlan {
    /// Keys to read from disk now, the step waiting for them (in the batch's order).
    pub read: Vec<TokenKey>,
    /// Keys to compute (no disk copy).
    pub compute: Vec<TokenKey>,
}

/// A FoggyCache-like reuse cache: entries live on disk only, under `disk_budget` bytes, first come
/// first kept (nothing evicted, as nothing is ranked); each batch reads its entries with a copy
/// on demand and computes the rest; nothing is prefetched and nothing stays in memory.
#[derive(Clone, Debug)]
pub struct OnDemand {
    disk_budget: u64,
    on_disk: BTreeMap<TokenKey, u64>,
    used: u64,
}

impl OnDemand {
    /// An empty cache of at most `disk_budget` bytes on disk.
    pub fn new(disk_budget: u64) -> Self {
        Self { disk_budget, on_disk: BTreeMap::new(), used: 0 }
    }

    /// Which of `keys` are read from disk and which computed.
    pub fn handle_batch(&self, keys: &[TokenKey]) -> OnDemandPlan {
        let (read, compute) = keys.iter().partition(|k| self.on_disk.contains_key(k));
        OnDemandPlan { read, compute }
    }

    /// A computed entry of `bytes`: `true` when it is to be written to disk (room left, not there
    /// yet), and it then counts as on disk.
    pub fn handle_computed(&mut self, key: TokenKey, bytes: u64) -> bool {
        if self.on_disk.contains_key(&key) || self.used.saturating_add(bytes) > self.disk_budget {
            return false;
        }
        self.on_disk.insert(key, bytes);
        self.used += bytes;
        true
    }

    /// A disk copy that failed its checks: forgotten, so the next batch recomputes it.
    pub fn disk_copy_lost(&mut self, key: &TokenKey) {
        if let Some(b) = self.on_disk.remove(key) {
            self.used -= b;
        }
    }

    /// Bytes on disk.
    pub fn disk_used(&self) -> u64 {
        self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapt::ExpertId;

    fn key(sig: u64) -> TokenKey {
        TokenKey { expert: ExpertId(1), sig }
    }

    #[test]
    fn zero_means_none_and_absurd_rates_are_refused() {
        assert!(check_read_bps(0).is_ok());
        assert!(check_read_bps(MIN_READ_BPS).is_ok());
        assert!(check_read_bps(MAX_READ_BPS).is_ok());
        assert!(check_read_bps(MIN_READ_BPS - 1).is_err());
        assert!(check_read_bps(MAX_READ_BPS + 1).is_err());
    }

    #[test]
    fn the_bandwidth_makes_a_read_cost_the_ratio_of_the_compute_saved() {
        // 12 KiB saves 200 us; at 0.7 a read may take 140 us, 40 of which the device already
        // spends: the throttle's 100 us carry 12288 B, 122.88 MB/s.
        assert_eq!(read_bps_for(12288, 200.0, 40.0, 0.7), Some(122_880_000));
        // Slower storage cannot be made faster.
        assert_eq!(read_bps_for(12288, 200.0, 150.0, 0.7), None);
        assert_eq!(read_bps_for(0, 200.0, 0.0, 0.7), None);
        // Out-of-range answers are clamped into the accepted range.
        assert_eq!(read_bps_for(1 << 30, 1.0, 0.0, 0.7), Some(MAX_READ_BPS));
        assert_eq!(read_bps_for(1, 1e9, 0.0, 0.7), Some(MIN_READ_BPS));
    }

    #[test]
    fn on_demand_reads_what_it_stored_and_keeps_nothing_past_its_budget() {
        let mut c = OnDemand::new(100);
        let plan = c.handle_batch(&[key(1), key(2)]);
        assert_eq!(plan.read, Vec::<TokenKey>::new());
        assert_eq!(plan.compute, vec![key(1), key(2)]);
        assert!(c.handle_computed(key(1), 60));
        assert!(!c.handle_computed(key(1), 60), "stored once");
        assert!(!c.handle_computed(key(2), 60), "over the disk budget");
        let plan = c.handle_batch(&[key(2), key(1)]);
        assert_eq!((plan.read, plan.compute), (vec![key(1)], vec![key(2)]));
        c.disk_copy_lost(&key(1));
        assert_eq!(c.disk_used(), 0);
        assert_eq!(c.handle_batch(&[key(1)]).compute, vec![key(1)]);
    }
}
