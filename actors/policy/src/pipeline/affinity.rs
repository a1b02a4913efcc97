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
//!
//! Cost rules (only with [`DispatchInput::flow`] and per-worker [`WorkerView::costs`], which the
//! foreman fills from [`super::costs::CostModel`]; without them dispatch is exactly the above).
//! Notation, per stage `k`: `U_k` unclaimed tasks, `n_k` alive holders (live or loading), their
//! throughput `R_k = sum_h 1/tau_h(k)`, `d_k` µs until the first is productive; for a worker `w`:
//! `tau_w(k)` its predicted task time, `L_w(k)` its predicted load time (warm or cold).
//! Without the rules, phase 1 skips a stage with no free holder, so the holders of stage `k`
//! keep claiming `k` until none is ready: `k + 1` starts only once `k` is all claimed, and
//! streaming degenerates into barrier.
//! 1. Pull (phase 0, before phase 1; stages `j` with ready tasks, later first, repeated while it
//!    pays). A free holder `w` of `k = j - 1` is moved to `j` (claiming `j`'s oldest ready task,
//!    its own output first) when `U_k > 0`, `n_k >= 2`, every holder of `k` has a measured task
//!    time, `R_j < R_k` (the downstream does not keep up), and `F_pull < (1 - 0.02) F_stay`, where
//!    `F` is the predicted time stage `j` is done:
//!    - `t_e`, when `k` is done: list scheduling of the `U_k` tasks over the holders of `k`
//!      (each task to the holder that would finish it first; busy ones from when they are free),
//!      with `w` for `F_stay`, without for `F_pull`: this is "the remaining stage-`k` work over
//!      the holders left", discrete, so a pull that adds a round upstream is seen.
//!    - then a fluid model of `j`: its holders run at `b` from `d`; the holders of `k` switch at
//!      `t_e` and run at `c = sum_{h holds k} 1/tau_h(j)` from `t_e + Lbar` (`Lbar` their mean
//!      load of `j`); `F` solves `b (F - d)^+ + c (F - t_e - Lbar)^+ = U_j`, and
//!      `F >= t_e + tau(j)` (`+ Lbar` too when `j` has no holder).
//!    - stay: `(b, d) = (R_j, d_j)`; pull: `b = R_j + 1/tau_w(j)`, `d = min(d_j, L_w(j))` (just
//!      `L_w(j)` when `j` had no holder) and `c` less `1/tau_w(j)`. Among the free holders that
//!      qualify, the one with the least `F_pull` is pulled.
//!
//!    So `w` pays `L_w(j)` only when its downstream work, started after that load, brings the end
//!    forward by more than the upstream loses without it (including what the switchers would
//!    idle loading `j` at `t_e`).
//! 2. Load gate (phase 2). A task of stage `s` takes a free worker `w` that must load `s` only if
//!    `s` has no holder, or `L_w(s) + tau_w(s) < d_s + taubar_s (f + ceil(U_s / n_s))`, with
//!    `taubar_s = n_s / R_s` and `f = 1` if the holders are still loading (`d_s > 0`), else `1/2`
//!    (in phase 2 every holder of `s` is busy: it first ends the task in flight). Otherwise the
//!    holders finish the stage sooner than `w` would finish this one task.
//! 3. Tail decline (phase 1). A free Tier-1 holder `w` of `k` does not claim `k` (and is not
//!    offered `k` in phase 2) when every holder of `k` is measured, `n_k >= 2`, `w` is not the
//!    fastest (`tau_w(k) > min_h tau_h(k)`), and
//!    `tau_w(k) > U_k / (R_k - 1/tau_w(k)) + (sum_h tau_h(k) - tau_w(k)) / (2 (n_k - 1))`:
//!    the others would clear all of `k` before `w` finished one task. It stays free for other
//!    stages (rules 1 and 2). The fastest holder never declines, so a stage with holders always
//!    progresses; a holder leaving in the same round turns declines off for that stage.
//!
//! 4. Stage plan (all phases; only for workers with [`WorkerView::home`], which the foreman sets
//!    from [`super::plan::plan_stages`] for streaming jobs). While its home stage `h` has
//!    unclaimed tasks a worker takes only tasks of `h` (until `h` has a ready task it may go on
//!    claiming its live stage, so no worker idles at a job's start); it is never pulled (rule 1),
//!    its loads of `h` are not gated (rule 2), and it declines `h`'s tail (rule 3) only when no
//!    holder of `h` is bound to another home that still has work (those would not take it).
//!    Once `h` is all claimed, the ordinary rules apply to it: the tail is shared.
//!
//! Residency is unchanged: a pulled or gated worker still runs one live stage (unload, then
//! load) and only stages that fit its RAM budget are offered.

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
    /// Predicted costs on this worker; `None` turns the cost rules off for it.
    pub costs: Option<WorkerCosts>,
    /// Its home stage under the foreman's stage plan ([`super::plan`]), if any: while that stage
    /// has unclaimed tasks ([`DispatchInput::backlog`]) the worker takes only its tasks (rule 4).
    pub home: Option<usize>,
}

/// Predicted costs of one worker, per stage, in µs (from [`super::costs::CostModel`]).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerCosts {
    /// Per stage: predicted task time (occupancy) on this worker.
    pub task_us: Vec<f64>,
    /// Per stage: predicted time to make the stage live here (warm if cached, else cold).
    pub load_us: Vec<f64>,
}

impl WorkerView {
    fn tier(&self, stage: usize) -> Tier {
        classify(self.live, self.cached.get(stage).copied().unwrap_or(false), stage)
    }
    fn fits(&self, stage: usize) -> bool {
        self.fits.get(stage).copied().unwrap_or(false)
    }
    /// Rule 4: whether the stage plan lets this worker take a task of `stage` now (`home_ready`:
    /// its home stage has a ready task).
    fn planned_for(&self, stage: usize, backlog: &[usize], home_ready: bool) -> bool {
        match self.home {
            Some(h) if backlog.get(h).copied().unwrap_or(0) > 0 => {
                h == stage || (!home_ready && self.live == Some(stage) && self.live != Some(h))
            }
            _ => true,
        }
    }
    /// Predicted task time on `stage`, µs (`None` without costs).
    fn task_us(&self, stage: usize) -> Option<f64> {
        self.costs.as_ref().and_then(|c| c.task_us.get(stage).copied()).filter(|t| *t > 0.0 && t.is_finite())
    }
    /// Predicted load time of `stage`, µs (`None` without costs).
    fn load_us(&self, stage: usize) -> Option<f64> {
        self.costs.as_ref().and_then(|c| c.load_us.get(stage).copied()).filter(|t| *t >= 0.0 && t.is_finite())
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
    /// Per-stage flow predictions; `None` (or of the wrong length) turns the cost rules off:
    /// pure tier and rank dispatch.
    pub flow: Option<StageFlow>,
}

/// Per-stage predictions for the cost rules, each a vector over the stages, times in µs.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct StageFlow {
    /// `R_k = sum_{h holds k} 1 / tau_h(k)`: throughput of the alive holders of `k` (free or busy,
    /// live or loading), tasks per µs.
    pub rate: Vec<f64>,
    /// `d_k`: µs until the first holder of `k` is productive (0 if one holds it live, else the
    /// least predicted remaining load time; 0 when there is no holder).
    pub wait: Vec<f64>,
    /// `C_k = sum_{h holds k} 1 / tau_h(k + 1)`: what the holders of `k` would do on stage `k + 1`.
    pub next_rate: Vec<f64>,
    /// `Lbar_k`: mean predicted load time of stage `k + 1` over the holders of `k`.
    pub next_load: Vec<f64>,
    /// Every alive holder of `k` has completed a task of `k`, so `R_k` is measured, not guessed.
    pub measured: Vec<bool>,
    /// `sum_{h holds k} tau_h(k)`, µs (with the holder count, the mean task time of the holders).
    pub task_sum: Vec<f64>,
    /// `min_{h holds k} tau_h(k)`, µs (`+inf` without holders).
    pub fastest: Vec<f64>,
    /// Per stage, its busy holders as `(µs until free, tau_h(k))`: free after the task running
    /// (or loading, then running) now.
    pub busy: Vec<Vec<(f64, f64)>>,
    /// Per stage, whether a holder of it has a home elsewhere with work left (under a stage
    /// plan it takes only its home's tasks, so it is no help to this stage's tail).
    pub bound_elsewhere: Vec<bool>,
}

/// When `uk` more tasks of a stage are done if each goes, in turn, to the holder that would finish
/// it first (holders given as `(µs until free, task time)`); list scheduling, so the discrete tail
/// counts. Above [`EXACT_TAIL_STEPS`] steps: the fluid time plus half a mean task.
pub fn upstream_end(holders: &[(f64, f64)], uk: usize) -> f64 {
    if holders.is_empty() {
        return f64::INFINITY;
    }
    if uk.saturating_mul(holders.len()) > EXACT_TAIL_STEPS {
        let rate: f64 = holders.iter().map(|h| 1.0 / h.1).sum();
        let start = holders.iter().map(|h| h.0).sum::<f64>() / holders.len() as f64;
        let mean = holders.len() as f64 / rate;
        return start + uk as f64 / rate + 0.5 * mean;
    }
    let mut free: Vec<(f64, f64)> = holders.to_vec();
    let mut end = free.iter().map(|h| h.0).fold(0.0, f64::max);
    for _ in 0..uk {
        let Some(best) = free.iter_mut().min_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1))) else { break };
        best.0 += best.1;
        end = end.max(best.0);
    }
    end
}

/// Most `tasks x holders` steps [`upstream_end`] simulates exactly.
pub const EXACT_TAIL_STEPS: usize = 1 << 16;

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
    /// Phase 0: a free upstream holder was pulled into the next stage (cost rule 1).
    Pull,
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

/// Fluid estimate of when stage `j = k + 1` finishes (module doc, rule 1): the holders of `k`
/// are done with `k` at `te`, then switch to `j`, productive there from `te + lbar` at rate `c`;
/// the holders of `j` are productive from `d` at rate `b`; `uj` tasks of `j` are left. The result
/// `F` solves `b (F - d)^+ + c (F - te - lbar)^+ = uj`, and `F >= te + last` (the last upstream
/// output still has to cross `j`, taking `last`).
fn fluid_finish(te: f64, uj: f64, b: f64, d: f64, c: f64, lbar: f64, last: f64) -> f64 {
    let mut ramps: Vec<(f64, f64)> = [(d, b), (te + lbar, c)].into_iter().filter(|r| r.1 > 0.0).collect();
    ramps.sort_by(|x, y| x.0.total_cmp(&y.0));
    let f = match ramps[..] {
        [(s1, r1)] => s1 + uj / r1,
        [(s1, r1), (s2, r2)] => {
            if r1 * (s2 - s1) >= uj {
                s1 + uj / r1
            } else {
                s2 + (uj - r1 * (s2 - s1)) / (r1 + r2)
            }
        }
        _ => f64::INFINITY,
    };
    f.max(te + last)
}

/// Required relative gain of a pull (rule 1), against prediction noise.
pub const PULL_MARGIN: f64 = 0.02;

/// Mutable per-stage bookkeeping of one dispatch round (cost rules only).
struct Flow {
    f: Option<StageFlow>,
    holders: Vec<usize>,
    backlog: Vec<usize>,
}

fn inv(t: Option<f64>) -> f64 {
    t.map_or(0.0, |t| 1.0 / t)
}

impl Flow {
    fn new(input: &DispatchInput) -> Self {
        let s = input.backlog.len();
        let f = input.flow.clone().filter(|f| {
            [&f.rate, &f.wait, &f.next_rate, &f.next_load, &f.task_sum]
                .iter()
                .all(|v| v.len() == s && v.iter().all(|x| x.is_finite()))
                && input.holders.len() == s
                && f.measured.len() == s
                && f.fastest.len() == s
                && f.busy.len() == s
        });
        Flow { f, holders: input.holders.clone(), backlog: input.backlog.clone() }
    }
    /// Book a claim of a stage-`s` task by `w` (moving `w`'s residency if it is not Tier 1).
    fn claim(&mut self, w: &WorkerView, s: usize) {
        if let Some(b) = self.backlog.get_mut(s) {
            *b = b.saturating_sub(1);
        }
        let Some(f) = self.f.as_mut() else { return };
        if w.live == Some(s) || s >= f.rate.len() {
            return;
        }
        if let Some(k) = w.live.filter(|&k| k < f.rate.len()) {
            self.holders[k] = self.holders[k].saturating_sub(1);
            f.rate[k] = (f.rate[k] - inv(w.task_us(k))).max(0.0);
            f.task_sum[k] = (f.task_sum[k] - w.task_us(k).unwrap_or(0.0)).max(0.0);
            // The fastest holder may be the one leaving: no rule-3 declines on `k` this round.
            f.measured[k] = false;
            f.next_rate[k] = (f.next_rate[k] - inv(w.task_us(k + 1))).max(0.0);
        }
        let load = w.load_us(s).unwrap_or(0.0);
        f.wait[s] = if self.holders[s] == 0 { load } else { f.wait[s].min(load) };
        self.holders[s] += 1;
        f.rate[s] += inv(w.task_us(s));
        f.task_sum[s] += w.task_us(s).unwrap_or(0.0);
        f.next_rate[s] += inv(w.task_us(s + 1));
    }
    /// Rule 2: a load of `s` on `w` for one task pays off (see the module doc).
    fn load_pays(&self, w: &WorkerView, s: usize) -> bool {
        let Some(f) = &self.f else { return true };
        if w.tier(s) == Tier::Resident || self.holders.get(s).copied().unwrap_or(0) == 0 {
            return true;
        }
        let (Some(load), Some(tau)) = (w.load_us(s), w.task_us(s)) else { return true };
        let rate = f.rate[s];
        if rate <= 0.0 {
            return true;
        }
        // In phase 2 every holder of `s` is busy (a free one would have claimed in phase 1): each
        // first ends its task in flight (a whole task after its load, half a task on average when
        // running), then the `U_s` tasks left go `n_s` at a time.
        let n = self.holders[s] as f64;
        let mean_tau = n / rate;
        let in_flight = if f.wait[s] > 0.0 { 1.0 } else { 0.5 };
        let rounds = (self.backlog[s] as f64 / n).ceil();
        load + tau < f.wait[s] + mean_tau * (in_flight + rounds)
    }
    /// Rule 3: a free Tier-1 holder `w` of `k` leaves the stage's last tasks to faster holders
    /// when they would clear all of them before `w` finished one (see the module doc).
    fn declines(&self, w: &WorkerView, k: usize) -> bool {
        let Some(f) = self.f.as_ref() else { return false };
        // Under a stage plan a worker declines only its home's tail, and only when every holder
        // of it takes its tasks (none is bound to a home elsewhere that still has work).
        if w.home.is_some_and(|h| h != k || f.bound_elsewhere.get(k).copied().unwrap_or(true)) {
            return false;
        }
        if k >= f.rate.len() || !f.measured[k] || self.holders[k] < 2 {
            return false;
        }
        let Some(tk) = w.task_us(k) else { return false };
        // The fastest holder never declines, so some holder always takes the stage's work.
        if tk <= f.fastest[k] {
            return false;
        }
        let others = f.rate[k] - 1.0 / tk;
        if others <= 0.0 {
            return false;
        }
        let nk = self.holders[k] as f64;
        let clear = self.backlog[k] as f64 / others + 0.5 * (f.task_sum[k] - tk).max(0.0) / (nk - 1.0);
        tk > clear
    }

    /// Rule 1: the predicted finish of stage `j` if free holder `w` of `j - 1` is pulled into
    /// `j` now, when that beats staying by [`PULL_MARGIN`] (see the module doc).
    fn pull_finish(&self, w: &WorkerView, j: usize, free: &[&WorkerView]) -> Option<f64> {
        let f = self.f.as_ref()?;
        let k = j.checked_sub(1)?;
        if w.live != Some(k)
            || !w.fits(j)
            || self.holders[k] < 2
            || self.backlog[k] == 0
            || j >= f.rate.len()
            || !f.measured[k]
        {
            return None;
        }
        let (tk, tj, load) = (w.task_us(k)?, w.task_us(j)?, w.load_us(j)?);
        let (a, b) = (f.rate[k], f.rate[j]);
        if b >= a {
            return None;
        }
        let uj = self.backlog[j] as f64;
        let d = if self.holders[j] == 0 { 0.0 } else { f.wait[j] };
        // The upstream ends at `te = uk / R_k + tau_mean(k) / 2`: the fluid time, plus on average
        // half a holder's task time for the last tasks in flight (what barrier-like switching
        // waits for: with few tasks per worker it is most of the gap to the ideal bound).
        // When the holders of `k` are done with it: list scheduling of the `U_k` tasks left over
        // the busy holders and the free ones (with `w` when it stays, without when pulled).
        let mut others: Vec<(f64, f64)> = f.busy[k].clone();
        others.extend(
            free.iter()
                .filter(|v| v.id != w.id && v.live == Some(k))
                .filter_map(|v| v.task_us(k))
                .map(|t| (0.0, t)),
        );
        let te_pull = upstream_end(&others, self.backlog[k]);
        others.push((0.0, tk));
        let te_stay = upstream_end(&others, self.backlog[k]);
        // Without a holder of `j`, the last input waits for a switcher's load too.
        let last_stay = if self.holders[j] == 0 { f.next_load[k] + tj } else { tj };
        let stay = fluid_finish(te_stay, uj, b, d, f.next_rate[k], f.next_load[k], last_stay);
        let pull_d = if self.holders[j] == 0 { load } else { d.min(load) };
        let pulled =
            fluid_finish(te_pull, uj, b + 1.0 / tj, pull_d, f.next_rate[k] - 1.0 / tj, f.next_load[k], tj);
        (pulled < stay * (1.0 - PULL_MARGIN)).then_some(pulled)
    }
}

/// Two-phase batch dispatch; see the module doc. Each worker and each task is claimed at most once.
pub fn two_phase_dispatch(input: &DispatchInput) -> Vec<Claim> {
    let mut claims = Vec::new();
    let mut free: Vec<&WorkerView> = input.workers.iter().collect();
    let mut ready: Vec<ReadyTask> = input.ready.clone();
    ready.sort();
    ready.dedup_by_key(|r| r.task);
    let mut flow = Flow::new(input);
    let ready_stages: Vec<usize> = ready.iter().map(|r| r.task.stage).collect();

    let mut stages: Vec<usize> = ready.iter().map(|r| r.task.stage).collect();
    stages.sort_unstable();
    stages.dedup();

    // Phase 0 (cost rule 1): pull free upstream holders into a later stage that falls behind.
    for &j in stages.iter().rev() {
        loop {
            let best = free
                .iter()
                .copied()
                .filter(|w| w.home.is_none())
                .filter_map(|w| flow.pull_finish(w, j, &free).map(|t| (w, t)))
                .min_by(|(a, ta), (b, tb)| {
                    ta.partial_cmp(tb).unwrap_or(Ordering::Equal).then_with(|| by_score_then_id(a, b))
                });
            let Some((w, _)) = best else { break };
            let task = ready
                .iter()
                .filter(|r| r.task.stage == j)
                .min_by_key(|r| (r.input_on != Some(w.id), r.task.input))
                .map(|r| r.task);
            let Some(task) = task else { break };
            claims.push(Claim { task, worker: w.id, tier: w.tier(j), phase: Phase::Pull });
            flow.claim(w, j);
            let id = w.id;
            ready.retain(|r| r.task != task);
            free.retain(|v| v.id != id);
        }
    }

    // Phase 1: worker claims, rarest coverage first (rule 3: slow holders decline a stage's
    // last tasks).
    let declined: Vec<WorkerId> = free
        .iter()
        .filter(|w| w.live.is_some_and(|k| ready.iter().any(|r| r.task.stage == k) && flow.declines(w, k)))
        .map(|w| w.id)
        .collect();
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
        let mut holders: Vec<&WorkerView> = free
            .iter()
            .copied()
            .filter(|w| w.live == Some(s) && w.fits(s) && !declined.contains(&w.id))
            .filter(|w| w.planned_for(s, &input.backlog, w.home.is_some_and(|h| ready_stages.contains(&h))))
            .collect();
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
            if let Some(b) = flow.backlog.get_mut(s) {
                *b = b.saturating_sub(1);
            }
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
        let offered = |w: &&WorkerView| {
            w.fits(s)
                && w.planned_for(s, &input.backlog, w.home.is_some_and(|h| ready_stages.contains(&h)))
                && (w.home == Some(s) || flow.load_pays(w, s))
                && !(w.live == Some(s) && declined.contains(&w.id))
        };
        let best = free.iter().copied().filter(offered).min_by(|a, b| {
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
            flow.claim(w, s);
            let id = w.id;
            free.retain(|v| v.id != id);
        }
    }
    claims
}
