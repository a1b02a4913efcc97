//! Live figures of this process's workloads, for the node's status and metrics: the experts
//! each coe executor holds per tier, queue lengths, the stage each pipeline worker holds, and
//! memory pools with their used bytes over time.
//!
//! Workloads publish here where their own state changes (an executor after each command, the
//! coe scheduler on accept and answer, the request service on admit and release, the pipeline
//! foreman each time it drains its policy's actions, a worker at start and after each request,
//! the coadapt edge on accept, answer and after each cycle); the status handler and the
//! metrics endpoint read a [`snapshot`]. Nothing here is read by a decision, and the actors do
//! not reach into each other: this is a one-way mirror, as [`crate::work`] is for counters.
//!
//! Every map is bounded by the status caps in [`crate::wire`] (entries past a cap are not kept,
//! and say so once in the log), so a snapshot always fits a status a peer will accept.
//!
//! A snapshot also carries the mailbox depths [`crate::mailbox`] counts (ractor exposes no
//! mailbox length, so the runtime counts its own actors' messages itself).

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::wire::{
    MAX_POOL_SAMPLES, MAX_STATUS_EXECUTORS, MAX_STATUS_POOLS, MAX_STATUS_QUEUES, MAX_STATUS_STAGES,
    MailboxView, PoolView, QueueView, ResidencyView, StageView,
};

/// Everything published so far, keyed so a later value replaces an earlier one.
#[derive(Default)]
struct Live {
    residency: BTreeMap<String, ResidencyView>,
    queues: BTreeMap<(String, String), u64>,
    stages: BTreeMap<String, Option<u32>>,
    pools: BTreeMap<String, PoolView>,
}

static LIVE: Mutex<Live> = Mutex::new(Live {
    residency: BTreeMap::new(),
    queues: BTreeMap::new(),
    stages: BTreeMap::new(),
    pools: BTreeMap::new(),
});

fn live() -> MutexGuard<'static, Live> {
    LIVE.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Inserts `value` at `key` unless the map is full and `key` is new (then logs and drops it).
fn bounded<K: Ord, V>(map: &mut BTreeMap<K, V>, key: K, value: V, cap: usize, what: &str) {
    if map.len() >= cap && !map.contains_key(&key) {
        tracing::warn!(cap, "live figures: more {what} than a status carries; this one is not shown");
        return;
    }
    map.insert(key, value);
}

/// Records what coe executor `r.executor` holds now.
pub fn set_residency(r: ResidencyView) {
    let mut l = live();
    bounded(&mut l.residency, r.executor.clone(), r, MAX_STATUS_EXECUTORS, "executors");
}

/// Records the length of `workload`'s queue `queue`.
pub fn set_queue(workload: &str, queue: &str, depth: u64) {
    let mut l = live();
    bounded(&mut l.queues, (workload.to_string(), queue.to_string()), depth, MAX_STATUS_QUEUES, "queues");
}

/// Records the stage pipeline worker `worker` holds live (`None`: none).
pub fn set_stage(worker: &str, stage: Option<u32>) {
    let mut l = live();
    bounded(&mut l.stages, worker.to_string(), stage, MAX_STATUS_STAGES, "workers");
}

/// Records pool `pool`'s figures; a change of its used bytes is added to its history (the
/// oldest sample goes past [`MAX_POOL_SAMPLES`]).
pub fn set_pool(pool: &str, budget_bytes: u64, used_bytes: u64, fragmentation: f64) {
    let at_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut l = live();
    let mut view = l.pools.get(pool).cloned().unwrap_or_else(|| PoolView {
        pool: pool.to_string(),
        budget_bytes,
        used_bytes,
        fragmentation,
        history: Vec::new(),
    });
    if view.history.last().is_none_or(|(_, used)| *used != used_bytes) {
        if view.history.len() >= MAX_POOL_SAMPLES {
            view.history.remove(0);
        }
        view.history.push((at_ms, used_bytes));
    }
    view.budget_bytes = budget_bytes;
    view.used_bytes = used_bytes;
    view.fragmentation = if fragmentation.is_finite() { fragmentation } else { 0.0 };
    bounded(&mut l.pools, pool.to_string(), view, MAX_STATUS_POOLS, "pools");
}

/// What has been published, in name order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Per executor.
    pub residency: Vec<ResidencyView>,
    /// Per workload and queue.
    pub queues: Vec<QueueView>,
    /// Per worker.
    pub stages: Vec<StageView>,
    /// Per pool.
    pub pools: Vec<PoolView>,
    /// Per counted actor ([`crate::mailbox::depths`]).
    pub mailboxes: Vec<MailboxView>,
}

/// The figures now.
pub fn snapshot() -> Snapshot {
    let l = live();
    Snapshot {
        residency: l.residency.values().cloned().collect(),
        queues: l
            .queues
            .iter()
            .map(|((workload, queue), depth)| QueueView {
                workload: workload.clone(),
                queue: queue.clone(),
                depth: *depth,
            })
            .collect(),
        stages: l
            .stages
            .iter()
            .map(|(worker, stage)| StageView { worker: worker.clone(), stage: *stage })
            .collect(),
        pools: l.pools.values().cloned().collect(),
        mailboxes: crate::mailbox::depths(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_values_replace_earlier_ones_and_pool_history_is_bounded() {
        set_queue("test-live", "ready", 3);
        set_queue("test-live", "ready", 1);
        set_stage("test-live-worker", Some(2));
        for i in 0..(MAX_POOL_SAMPLES as u64 + 5) {
            set_pool("test-live/pool", 100, i, 0.5);
        }
        set_pool("test-live/pool", 100, MAX_POOL_SAMPLES as u64 + 4, 0.25);
        let s = snapshot();
        let q: Vec<_> = s.queues.iter().filter(|q| q.workload == "test-live").collect();
        assert_eq!(q.len(), 1);
        assert_eq!(q[0].depth, 1);
        assert!(s.stages.contains(&StageView { worker: "test-live-worker".into(), stage: Some(2) }));
        let p = s.pools.iter().find(|p| p.pool == "test-live/pool").expect("the pool is listed");
        assert_eq!(p.history.len(), MAX_POOL_SAMPLES, "an unchanged value adds no sample");
        assert_eq!(p.history.first().map(|h| h.1), Some(5));
        assert_eq!((p.used_bytes, p.fragmentation), (MAX_POOL_SAMPLES as u64 + 4, 0.25));
    }
}
