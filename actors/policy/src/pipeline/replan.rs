//! Failure planner: where the tasks of a lost worker go.
//!
//! When a worker is lost, every task it had assigned, in flight or loading for goes back to ready
//! and is given to a survivor chosen here. Each survivor whose RAM budget fits the task's stage
//! is scored
//!
//! `score = w_success * success_rate + w_ram * free_ram / max_free_ram + w_battery * battery/100
//!          + w_tier * tier_value - w_queue * queued`
//!
//! with `success_rate = (ok + 1) / (ok + failed + 2)` (Laplace smoothing, so a new worker counts
//! as 0.5), `tier_value` 1, 2/3, 1/3, 0 for Tiers 1..4 and `queued` the tasks the survivor already
//! runs or has been given by this plan (so orphans spread out). After a task of stage `s` is
//! planned onto a survivor, that survivor counts as holding `s` live for the next orphans. Orphans
//! are planned in task order (input, then stage). Ties go to the lower worker id.

use super::affinity::{Tier, classify};
use super::{TaskId, WorkerId};

/// Weights of the survivor score.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReplanWeights {
    /// Weight of the smoothed success rate.
    pub success: f64,
    /// Weight of free RAM (relative to the best survivor).
    pub ram: f64,
    /// Weight of battery level.
    pub battery: f64,
    /// Weight of the residency tier.
    pub tier: f64,
    /// Penalty per task the survivor already has.
    pub queue_penalty: f64,
}

impl Default for ReplanWeights {
    fn default() -> Self {
        ReplanWeights { success: 0.3, ram: 0.2, battery: 0.2, tier: 0.3, queue_penalty: 0.25 }
    }
}

/// A surviving worker as the planner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct SurvivorView {
    /// Worker id.
    pub id: WorkerId,
    /// Tasks it completed.
    pub ok: u32,
    /// Tasks or loads it failed.
    pub failed: u32,
    /// Free RAM from its last telemetry.
    pub free_ram_bytes: u64,
    /// Battery from its last telemetry, percent.
    pub battery_pct: f64,
    /// Its live (or loading) stage.
    pub live: Option<usize>,
    /// Per stage: cached on its disk.
    pub cached: Vec<bool>,
    /// Per stage: fits its RAM budget.
    pub fits: Vec<bool>,
    /// Tasks it is already running, loading for or has pinned.
    pub queued: usize,
}

/// One planned move.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Move {
    /// The orphaned task.
    pub task: TaskId,
    /// The lost worker.
    pub from: WorkerId,
    /// The survivor chosen, or `None` when no survivor's budget fits the stage.
    pub to: Option<WorkerId>,
    /// The winning score (0 when `to` is `None`).
    pub score: f64,
}

/// Laplace-smoothed success rate.
pub fn success_rate(ok: u32, failed: u32) -> f64 {
    (f64::from(ok) + 1.0) / (f64::from(ok) + f64::from(failed) + 2.0)
}

/// Value of a tier for the planner: 1 for Tier 1 down to 0 for Tier 4.
pub fn tier_value(t: Tier) -> f64 {
    match t {
        Tier::Resident => 1.0,
        Tier::Cached => 2.0 / 3.0,
        Tier::Idle => 1.0 / 3.0,
        Tier::Swap => 0.0,
    }
}

/// Plans where each of `orphans` (tasks of the lost worker `from`) goes among `survivors`; see
/// the module doc. `survivors` are the candidates as given: a worker that rejoined fresh under
/// the lost id may be among them.
pub fn plan_reassignment(
    from: WorkerId,
    orphans: &[TaskId],
    survivors: &[SurvivorView],
    weights: &ReplanWeights,
) -> Vec<Move> {
    let mut pool: Vec<SurvivorView> = survivors.to_vec();
    let max_ram = pool.iter().map(|s| s.free_ram_bytes).max().unwrap_or(0);
    let mut tasks = orphans.to_vec();
    tasks.sort();
    tasks.dedup();
    let mut moves = Vec::with_capacity(tasks.len());
    for task in tasks {
        let st = task.stage;
        let mut best: Option<(f64, usize)> = None;
        for (i, s) in pool.iter().enumerate() {
            if !s.fits.get(st).copied().unwrap_or(false) {
                continue;
            }
            let ram = if max_ram > 0 { s.free_ram_bytes as f64 / max_ram as f64 } else { 0.0 };
            let battery =
                if s.battery_pct.is_finite() { (s.battery_pct / 100.0).clamp(0.0, 1.0) } else { 0.0 };
            let tier = classify(s.live, s.cached.get(st).copied().unwrap_or(false), st);
            let score = weights.success * success_rate(s.ok, s.failed)
                + weights.ram * ram
                + weights.battery * battery
                + weights.tier * tier_value(tier)
                - weights.queue_penalty * s.queued as f64;
            let better = match best {
                None => true,
                Some((b, j)) => score > b || (score == b && s.id < pool[j].id),
            };
            if better {
                best = Some((score, i));
            }
        }
        match best {
            Some((score, i)) => {
                let s = &mut pool[i];
                s.queued += 1;
                s.live = Some(st);
                moves.push(Move { task, from, to: Some(s.id), score });
            }
            None => moves.push(Move { task, from, to: None, score: 0.0 }),
        }
    }
    moves
}
