//! 4-tier affinity, entropy-weighted telemetry ranking and two-phase batch dispatch.
//!
//! Tiers (what a worker must do before it can run a task of stage `s`):
//! - Tier 1 [`Tier::Resident`]: `s` is its live session; nothing to do.
//! - Tier 2 [`Tier::Cached`]: nothing live, `s` cached on its disk: a warm load.
//! - Tier 3 [`Tier::Idle`]: nothing live, `s` not on disk: a cold load (download, then load).
//! - Tier 4 [`Tier::Swap`]: another stage is live: explicit UNLOAD, then LOAD (warm or cold).
//!
//! The paper lists the tiers without saying where "another stage live but `s` on disk" falls; it
//! is Tier 4 here because it must destroy a live session. Inside Tier 4 a cached `s` is preferred.
//!
//! Ranking inside a tier uses the entropy weight method over the crowd's telemetry: for each
//! metric `j`, `p_ij = x_ij / sum_i x_ij` over the `m` workers, `e_j = -(1/ln m) sum_i p_ij ln p_ij`
//! (with `0 ln 0 = 0`), `w_j = (1 - e_j) / sum_k (1 - e_k)`. A metric equal everywhere has
//! `e_j = 1` and weighs 0; if every metric is constant (or `m < 2`) all weights are 0 and ranking
//! falls back to the worker id. The score of a worker is `sum_j w_j u_ij`, with `u_ij` the min-max
//! normalised metric turned so that 1 is best (free RAM and battery: higher is better; CPU load,
//! temperature and RTT: lower is better).
//!
//! Two-phase dispatch ([`two_phase_dispatch`]), run over the free workers and ready tasks:
//! 1. Worker claims. Stages with ready tasks are visited rarest coverage first (fewest free
//!    workers holding the stage live; ties: the later stage first, to drain the pipeline). Each
//!    free Tier-1 worker of that stage, best score first, claims the oldest ready task (lowest
//!    input) of its stage, preferring a task whose input tensor it produced itself (no transfer).
//!    Under single-partition residency a worker is Tier 1 for one stage only, so claims never
//!    conflict across stages; the visiting order fixes the decision order.
//! 2. Task claims. Each remaining ready task (later stage first; then tasks whose input lies on a
//!    free worker; then lowest input) claims the best
//!    remaining free worker whose RAM budget fits the stage, ranked by the multi-criteria key
//!    (tier; in Tier 4 the victim's safety: first workers whose live stage has no unclaimed work
//!    left, then those whose live stage another worker also holds, then last holders; the worker
//!    that produced the task's input; a cached stage; entropy score, higher first; worker id).
//!    A free worker that is the last holder of a stage with unclaimed tasks whose upstream is in
//!    flight is not offered in phase 2: work for its session is on the way, and swapping it out
//!    would only force a reload (decided here; the paper calls Tier 4 a last resort). This never
//!    deadlocks: such a worker waits only on a task that is running, loading or pinned.

use std::cmp::Ordering;
use std::fmt;

use super::{TaskId, WorkerId};

/// Residency tier of a worker for a stage (lower is better).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    /// Tier 1: the stage is the live session.
    Resident = 1,
    /// Tier 2: nothing live; the stage file is on the worker's disk.
    Cached = 2,
    /// Tier 3: nothing live; the stage file must be downloaded.
    Idle = 3,
    /// Tier 4: another stage is live and must be unloaded first.
    Swap = 4,
}

impl Tier {
    /// 1..=4.
    pub fn number(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "T{}", self.number())
    }
}

/// Tier of a worker whose live session is `live` and whose disk holds `stage` iff `cached`.
pub fn classify(live: Option<usize>, cached: bool, stage: usize) -> Tier {
    match live {
        Some(l) if l == stage => Tier::Resident,
        Some(_) => Tier::Swap,
        None if cached => Tier::Cached,
        None => Tier::Idle,
    }
}

/// One heartbeat of a worker (the paper's 30 s report).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Telemetry {
    /// CPU utilisation, 0..1.
    pub cpu_load: f64,
    /// Free RAM in bytes.
    pub free_ram_bytes: u64,
    /// Hard RAM budget for stage sessions on this worker, in bytes.
    pub ram_budget_bytes: u64,
    /// Battery level in percent, 0..100.
    pub battery_pct: f64,
    /// Device temperature in degrees Celsius.
    pub temperature_c: f64,
    /// Round-trip time to the foreman in milliseconds.
    pub rtt_ms: f64,
}

/// Number of ranked telemetry metrics.
pub const METRICS: usize = 5;
/// Names of the ranked metrics, in row order.
pub const METRIC_NAMES: [&str; METRICS] = ["cpu", "free_ram", "battery", "temp", "rtt"];
/// Whether a higher value is better, per metric.
pub const HIGHER_IS_BETTER: [bool; METRICS] = [false, true, true, false, false];

impl Telemetry {
    /// The ranked metrics as a row; non-finite or negative values (untrusted reports) become 0.
    pub fn metric_row(&self) -> [f64; METRICS] {
        let clean = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
        [
            clean(self.cpu_load),
            self.free_ram_bytes as f64,
            clean(self.battery_pct),
            clean(self.temperature_c),
            clean(self.rtt_ms),
        ]
    }
}

/// Entropy weights of the columns of `rows` (one row per worker); see the module doc.
///
/// Values must be non-negative (negative or non-finite ones are read as 0). The weights sum to 1,
/// or are all 0 when every column is constant or there are fewer than two rows. Never NaN.
pub fn entropy_weights<const N: usize>(rows: &[[f64; N]]) -> [f64; N] {
    let m = rows.len();
    let mut weights = [0.0; N];
    if m < 2 {
        return weights;
    }
    let clean = |x: f64| if x.is_finite() && x > 0.0 { x } else { 0.0 };
    let ln_m = (m as f64).ln();
    let mut divergence = [0.0; N];
    for j in 0..N {
        let first = clean(rows[0][j]);
        let constant = rows.iter().all(|r| clean(r[j]) == first);
        let total: f64 = rows.iter().map(|r| clean(r[j])).sum();
        let entropy = if constant {
            // Equal everywhere: exactly uniform, so exactly 1 (no rounding residue).
            1.0
        } else if total > 0.0 && total.is_finite() {
            let h: f64 =
                rows.iter().map(|r| clean(r[j]) / total).filter(|&p| p > 0.0).map(|p| -p * p.ln()).sum();
            (h / ln_m).clamp(0.0, 1.0)
        } else {
            // All zero: the metric is the same everywhere.
            1.0
        };
        divergence[j] = 1.0 - entropy;
    }
    let sum: f64 = divergence.iter().sum();
    if sum > 0.0 && sum.is_finite() {
        for j in 0..N {
            weights[j] = divergence[j] / sum;
        }
    }
    weights
}

/// Weighted score of each row, `sum_j w_j u_ij` with `u` min-max normalised so 1 is best.
pub fn weighted_scores<const N: usize>(
    rows: &[[f64; N]],
    weights: &[f64; N],
    higher_is_better: &[bool; N],
) -> Vec<f64> {
    let mut lo = [f64::INFINITY; N];
    let mut hi = [f64::NEG_INFINITY; N];
    for r in rows {
        for j in 0..N {
            lo[j] = lo[j].min(r[j]);
            hi[j] = hi[j].max(r[j]);
        }
    }
    rows.iter()
        .map(|r| {
            (0..N)
                .map(|j| {
                    let range = hi[j] - lo[j];
                    let u = if range > 0.0 && range.is_finite() {
                        let x = (r[j] - lo[j]) / range;
                        if higher_is_better[j] { x } else { 1.0 - x }
                    } else {
                        0.0
                    };
                    if u.is_finite() { weights[j] * u } else { 0.0 }
                })
                .sum()
        })
        .collect()
}

/// Entropy-weighted scores of the crowd's telemetry, one per entry, plus the weights used.
pub fn rank_telemetry(crowd: &[Telemetry]) -> (Vec<f64>, [f64; METRICS]) {
    let rows: Vec<[f64; METRICS]> = crowd.iter().map(Telemetry::metric_row).collect();
    let weights = entropy_weights(&rows);
    (weighted_scores(&rows, &weights, &HIGHER_IS_BETTER), weights)
}

/// A free worker as the dispatcher sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerView {
    /// Worker id.
    pub id: WorkerId,
    /// Its live stage, if any.
    pub live: Option<usize>,
    /// Per stage: the stage file is on its disk.
    pub cached: Vec<bool>,
    /// Per stage: the stage's session RSS estimate fits its RAM budget.
    pub fits: Vec<bool>,
    /// Entropy-weighted telemetry score (higher is better).
    pub score: f64,
}

impl WorkerView {
    fn tier(&self, stage: usize) -> Tier {
        classify(self.live, self.cached.get(stage).copied().unwrap_or(false), stage)
    }
    fn fits(&self, stage: usize) -> bool {
        self.fits.get(stage).copied().unwrap_or(false)
    }
}

/// Everything two-phase dispatch decides from.
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchInput {
    /// Free workers (alive, nothing running or loading, nothing pinned).
    pub workers: Vec<WorkerView>,
    /// Ready, unclaimed tasks.
    pub ready: Vec<ReadyTask>,
    /// Per stage: tasks not yet claimed by any worker (waiting or ready).
    pub backlog: Vec<usize>,
    /// Per stage: tasks claimed but not done (pinned, loading or running).
    pub in_flight: Vec<usize>,
    /// Per stage: alive workers (free or busy) holding it live or loading it.
    pub holders: Vec<usize>,
}

/// A ready task and where its input tensor was produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ReadyTask {
    /// The task.
    pub task: TaskId,
    /// The worker that computed its upstream task (`None` for stage 0 or when unknown).
    pub input_on: Option<WorkerId>,
}

/// Which phase made a claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Phase 1: a Tier-1 worker claimed the task.
    WorkerClaim,
    /// Phase 2: the task claimed the best-ranked worker.
    TaskClaim,
}

/// One dispatch decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The task.
    pub task: TaskId,
    /// The worker that runs it.
    pub worker: WorkerId,
    /// The worker's tier for the task's stage at decision time.
    pub tier: Tier,
    /// The phase that decided.
    pub phase: Phase,
}

fn by_score_then_id(a: &WorkerView, b: &WorkerView) -> Ordering {
    b.score.partial_cmp(&a.score).unwrap_or(Ordering::Equal).then(a.id.cmp(&b.id))
}

/// Tier-4 victim safety class: 0 its live stage has no unclaimed work, 1 another holder exists,
/// 2 it is the last holder of a stage with work left.
fn victim_class(w: &WorkerView, input: &DispatchInput) -> u8 {
    let Some(live) = w.live else { return 0 };
    if input.backlog.get(live).copied().unwrap_or(0) == 0 {
        0
    } else if input.holders.get(live).copied().unwrap_or(0) > 1 {
        1
    } else {
        2
    }
}

/// Whether a free worker stays with its live stage: it is the last holder of a stage that still
/// has unclaimed tasks and their upstream is in flight, so work for it is on the way.
fn holds_for_incoming(w: &WorkerView, input: &DispatchInput) -> bool {
    let Some(live) = w.live else { return false };
    victim_class(w, input) == 2 && live > 0 && input.in_flight.get(live - 1).copied().unwrap_or(0) > 0
}

/// Two-phase batch dispatch; see the module doc. Each worker and each task is claimed at most once.
pub fn two_phase_dispatch(input: &DispatchInput) -> Vec<Claim> {
    let mut claims = Vec::new();
    let mut free: Vec<&WorkerView> = input.workers.iter().collect();
    let mut ready: Vec<ReadyTask> = input.ready.clone();
    ready.sort();
    ready.dedup_by_key(|r| r.task);

    // Phase 1: worker claims, rarest coverage first.
    let mut stages: Vec<usize> = ready.iter().map(|r| r.task.stage).collect();
    stages.sort_unstable();
    stages.dedup();
    let coverage = |s: usize| free.iter().filter(|w| w.live == Some(s) && w.fits(s)).count();
    let mut order: Vec<(usize, usize)> = stages.iter().map(|&s| (coverage(s), s)).collect();
    order.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
    for (cov, s) in order {
        if cov == 0 {
            continue;
        }
        let mut holders: Vec<&WorkerView> =
            free.iter().copied().filter(|w| w.live == Some(s) && w.fits(s)).collect();
        holders.sort_by(|a, b| by_score_then_id(a, b));
        let mut taken: Vec<(TaskId, WorkerId)> = Vec::new();
        let stage_tasks: Vec<ReadyTask> = ready.iter().copied().filter(|r| r.task.stage == s).collect();
        // Pass A: a holder first claims the oldest task whose input it produced itself.
        let mut unmatched = Vec::new();
        for w in holders {
            let local = stage_tasks
                .iter()
                .find(|r| r.input_on == Some(w.id) && !taken.iter().any(|(t, _)| *t == r.task));
            match local {
                Some(r) => taken.push((r.task, w.id)),
                None => unmatched.push(w),
            }
        }
        // Pass B: the others claim the oldest tasks left.
        let mut rest = stage_tasks
            .iter()
            .filter(|r| !taken.iter().any(|(t, _)| *t == r.task))
            .map(|r| r.task)
            .collect::<Vec<_>>()
            .into_iter();
        for w in unmatched {
            let Some(task) = rest.next() else { break };
            taken.push((task, w.id));
        }
        taken.sort();
        for &(task, worker) in &taken {
            claims.push(Claim { task, worker, tier: Tier::Resident, phase: Phase::WorkerClaim });
        }
        ready.retain(|r| !taken.iter().any(|(task, _)| *task == r.task));
        free.retain(|w| !taken.iter().any(|(_, id)| *id == w.id));
    }

    // Phase 2: task claims by multi-criteria ranking.
    free.retain(|w| !holds_for_incoming(w, input));
    let local_free = |r: &ReadyTask| r.input_on.is_some_and(|on| free.iter().any(|w| w.id == on));
    ready.sort_by(|a, b| {
        b.task
            .stage
            .cmp(&a.task.stage)
            .then(local_free(b).cmp(&local_free(a)))
            .then(a.task.input.cmp(&b.task.input))
    });
    for r in ready {
        let task = r.task;
        let s = task.stage;
        let best = free.iter().copied().filter(|w| w.fits(s)).min_by(|a, b| {
            let (ta, tb) = (a.tier(s), b.tier(s));
            ta.cmp(&tb)
                .then_with(|| {
                    if ta == Tier::Swap {
                        victim_class(a, input).cmp(&victim_class(b, input))
                    } else {
                        Ordering::Equal
                    }
                })
                .then_with(|| {
                    let la = r.input_on == Some(a.id);
                    let lb = r.input_on == Some(b.id);
                    lb.cmp(&la)
                })
                .then_with(|| {
                    let ca = a.cached.get(s).copied().unwrap_or(false);
                    let cb = b.cached.get(s).copied().unwrap_or(false);
                    cb.cmp(&ca)
                })
                .then_with(|| by_score_then_id(a, b))
        });
        if let Some(w) = best {
            claims.push(Claim { task, worker: w.id, tier: w.tier(s), phase: Phase::TaskClaim });
            let id = w.id;
            free.retain(|v| v.id != id);
        }
    }
    claims
}
