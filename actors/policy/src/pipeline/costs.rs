//! Per-stage task and load costs, learned online from what the foreman observes.
//!
//! Inputs are durations the foreman measures between its own calls, with the caller's `now`:
//! - task time of `(w, k)`: from the `Assign` of a stage-`k` task on `w` to its completion. This is
//!   the worker's occupancy per task (input transfer, compute, reply), which is what dispatch must
//!   weigh; a failed run is not a sample.
//! - load time of stage `k`: from the decision to load (`Unload`/`SendStage`/`Load`) to the load
//!   report, split into *cold* (the file was sent for this load) and *warm* (it was on disk).
//!
//! Model, all times in microseconds, each mean an exponentially weighted moving average with
//! weight [`ALPHA`] on the newest sample (the first sample is taken as is):
//! - a reference task time per stage `T_k` (normalised to the speed of the workers seen) and a
//!   slowness factor per worker `r_w` (`observed / T_k`, 1 until seen); plus the direct mean
//!   `t_wk` of `(w, k)`. Prediction: `tau_w(k) = t_wk` if `w` ran `k`, else `T_k * r_w`.
//! - a warm and a cold load time per stage, pooled over workers ([`CostModel::load`]); and warm
//!   loads per worker as for tasks, a reference per stage and a load slowness per worker
//!   ([`CostModel::load_on`]: a quota'd worker makes a session at its own speed).
//!
//! Priors, used until a stage has its own samples: task `max(1 ms, 10 ms per MB)`; warm load
//! `100 ms + size / (200 MB/s)`; cold load `warm + size / (20 MB/s)`. Once some stages are seen,
//! an unseen stage's prior is scaled by the mean `observed / prior` ratio of the seen stages (a
//! crowd twice as slow as the prior on stage 0 is guessed twice as slow on stage 1).

use std::collections::BTreeMap;

use super::WorkerId;

/// Weight of the newest sample in the moving averages.
pub const ALPHA: f64 = 0.3;

fn ewma(old: Option<f64>, sample: f64) -> f64 {
    match old {
        Some(m) => m + ALPHA * (sample - m),
        None => sample,
    }
}

fn clean(d: f64) -> Option<f64> {
    (d.is_finite() && d >= 0.0).then_some(d.max(1.0))
}

/// Prior task time of a stage file of `size` bytes, µs.
pub fn prior_task(size: u64) -> f64 {
    (size as f64 / 100.0).max(1_000.0)
}

/// Prior warm load time of a stage file of `size` bytes, µs.
pub fn prior_warm(size: u64) -> f64 {
    100_000.0 + size as f64 / 200.0
}

/// Prior cold load time of a stage file of `size` bytes, µs.
pub fn prior_cold(size: u64) -> f64 {
    prior_warm(size) + size as f64 / 20.0
}

#[derive(Clone, Debug, Default)]
struct WorkerCost {
    slowness: Option<f64>,
    task: BTreeMap<usize, f64>,
    /// Warm loads on this worker over the stage's reference ([`CostModel::load_on`]).
    load_slowness: Option<f64>,
    /// Mean warm load per stage on this worker.
    warm: BTreeMap<usize, f64>,
}

/// Online cost estimates for one job's stages; see the module doc.
#[derive(Clone, Debug)]
pub struct CostModel {
    sizes: Vec<u64>,
    task_ref: Vec<Option<f64>>,
    warm: Vec<Option<f64>>,
    cold: Vec<Option<f64>>,
    /// Warm load per stage normalised to the workers' load slowness.
    warm_ref: Vec<Option<f64>>,
    workers: BTreeMap<WorkerId, WorkerCost>,
}

impl CostModel {
    /// Priors only, for stages of the given file sizes.
    pub fn new(sizes: &[u64]) -> Self {
        let s = sizes.len();
        CostModel {
            sizes: sizes.to_vec(),
            task_ref: vec![None; s],
            warm: vec![None; s],
            cold: vec![None; s],
            warm_ref: vec![None; s],
            workers: BTreeMap::new(),
        }
    }

    /// Number of stages.
    pub fn stages(&self) -> usize {
        self.sizes.len()
    }

    /// A completed task of stage `k` occupied worker `w` for `d` µs.
    pub fn observe_task(&mut self, w: WorkerId, k: usize, d: f64) {
        let Some(d) = clean(d) else { return };
        if k >= self.stages() {
            return;
        }
        let entry = self.workers.entry(w).or_default();
        if let Some(reference) = self.task_ref[k] {
            entry.slowness = Some(ewma(entry.slowness, d / reference));
        }
        let slowness = entry.slowness.unwrap_or(1.0);
        let direct = ewma(entry.task.get(&k).copied(), d);
        entry.task.insert(k, direct);
        self.task_ref[k] = Some(ewma(self.task_ref[k], d / slowness));
    }

    /// A load of stage `k` took `d` µs; `cold` when the file was sent for it (note: [`Self::load`]
    /// takes the opposite, whether the file is cached).
    pub fn observe_load(&mut self, k: usize, cold: bool, d: f64) {
        let Some(d) = clean(d) else { return };
        if k >= self.stages() {
            return;
        }
        let slot = if cold { &mut self.cold[k] } else { &mut self.warm[k] };
        *slot = Some(ewma(*slot, d));
    }

    /// [`Self::observe_load`], and a warm load also teaches worker `w`'s own load times: a
    /// quota'd worker makes a session at its own speed (it is CPU work), so a slow worker's
    /// loads are slow on every stage. Same scheme as task times: a reference per stage and a
    /// slowness per worker.
    pub fn observe_worker_load(&mut self, w: WorkerId, k: usize, cold: bool, d: f64) {
        self.observe_load(k, cold, d);
        let Some(d) = clean(d) else { return };
        if cold || k >= self.stages() {
            return;
        }
        let entry = self.workers.entry(w).or_default();
        if let Some(reference) = self.warm_ref[k] {
            entry.load_slowness = Some(ewma(entry.load_slowness, d / reference));
        }
        let slowness = entry.load_slowness.unwrap_or(1.0);
        let direct = ewma(entry.warm.get(&k).copied(), d);
        entry.warm.insert(k, direct);
        self.warm_ref[k] = Some(ewma(self.warm_ref[k], d / slowness));
    }

    /// Predicted load time of stage `k` on worker `w`, µs: a warm load is `w`'s own mean for
    /// `k` if it loaded it, else the stage's reference times `w`'s load slowness (its task
    /// slowness until a load of its is seen); a cold one is [`Self::load`].
    pub fn load_on(&self, w: WorkerId, k: usize, cached: bool) -> f64 {
        if !cached || k >= self.stages() {
            return self.load(k, cached);
        }
        let wc = self.workers.get(&w);
        if let Some(&t) = wc.and_then(|c| c.warm.get(&k)) {
            return t;
        }
        let slowness = wc.and_then(|c| c.load_slowness.or(c.slowness)).unwrap_or(1.0);
        self.warm_ref[k].unwrap_or_else(|| self.load(k, true)) * slowness
    }

    /// Mean `observed / prior` over the stages with samples in `seen` (1 when none).
    fn prior_scale(&self, seen: &[Option<f64>], prior: impl Fn(u64) -> f64) -> f64 {
        let ratios: Vec<f64> =
            seen.iter().zip(&self.sizes).filter_map(|(o, &sz)| o.map(|o| o / prior(sz))).collect();
        if ratios.is_empty() { 1.0 } else { ratios.iter().sum::<f64>() / ratios.len() as f64 }
    }

    /// Reference task time of stage `k`, µs.
    fn reference_task(&self, k: usize) -> f64 {
        match self.task_ref.get(k).copied().flatten() {
            Some(t) => t,
            None => prior_task(self.sizes[k]) * self.prior_scale(&self.task_ref, prior_task),
        }
    }

    /// Stage file sizes the model was made for.
    pub fn sizes(&self) -> &[u64] {
        &self.sizes
    }

    /// Whether worker `w` completed a task of any stage (its speed is measured, not guessed).
    pub fn knows(&self, w: WorkerId) -> bool {
        self.workers.get(&w).is_some_and(|c| !c.task.is_empty())
    }

    /// Whether worker `w` completed a task of stage `k` (its time there is measured, not guessed).
    pub fn measured(&self, w: WorkerId, k: usize) -> bool {
        self.workers.get(&w).is_some_and(|c| c.task.contains_key(&k))
    }

    /// Predicted task time (occupancy) of stage `k` on worker `w`, µs.
    pub fn task(&self, w: WorkerId, k: usize) -> f64 {
        if k >= self.stages() {
            return f64::INFINITY;
        }
        let wc = self.workers.get(&w);
        if let Some(&t) = wc.and_then(|c| c.task.get(&k)) {
            return t;
        }
        self.reference_task(k) * wc.and_then(|c| c.slowness).unwrap_or(1.0)
    }

    /// [`Self::task`], but for a worker whose tasks were never seen and whose loads were, its
    /// load slowness stands in (loads and tasks are CPU work at the same quota): what the start
    /// plan weighs ([`super::start`]); dispatch keeps [`Self::task`].
    pub fn task_guess(&self, w: WorkerId, k: usize) -> f64 {
        let wc = self.workers.get(&w);
        match wc {
            Some(c) if c.slowness.is_none() && !c.task.contains_key(&k) && k < self.stages() => {
                self.reference_task(k) * c.load_slowness.unwrap_or(1.0)
            }
            _ => self.task(w, k),
        }
    }

    /// Whether worker `w` completed a task or a warm load (its speed is measured, not guessed).
    pub fn seen(&self, w: WorkerId) -> bool {
        self.workers
            .get(&w)
            .is_some_and(|c| !c.task.is_empty() || c.load_slowness.is_some() || !c.warm.is_empty())
    }

    /// Predicted load time of stage `k` (warm when `cached`), µs.
    pub fn load(&self, k: usize, cached: bool) -> f64 {
        if k >= self.stages() {
            return f64::INFINITY;
        }
        let seen = if cached { &self.warm } else { &self.cold };
        let prior = if cached { prior_warm } else { prior_cold };
        match seen[k] {
            Some(t) => t,
            None => prior(self.sizes[k]) * self.prior_scale(seen, prior),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker three times as slow at loading stage 0 is predicted three times as slow at
    /// loading stage 1, which only another worker loaded; its own sample wins where it has one.
    #[test]
    fn load_slowness_carries_over_stages() {
        let (fast, slow, new) = (WorkerId(1), WorkerId(2), WorkerId(3));
        let mut m = CostModel::new(&[1_000_000, 1_000_000]);
        m.observe_worker_load(fast, 0, false, 100_000.0);
        m.observe_worker_load(slow, 0, false, 300_000.0);
        m.observe_worker_load(fast, 1, false, 50_000.0);
        assert_eq!(m.load_on(slow, 0, true), 300_000.0);
        assert!((m.load_on(slow, 1, true) - 150_000.0).abs() < 1e-6, "{}", m.load_on(slow, 1, true));
        assert_eq!(m.load_on(fast, 1, true), 50_000.0);
        // unseen worker: the reference; cold loads stay pooled
        assert!((m.load_on(new, 1, true) - 50_000.0).abs() < 1e-6);
        assert_eq!(m.load_on(slow, 1, false), m.load(1, false));
        // a cold load teaches no worker's warm time
        m.observe_worker_load(new, 1, true, 900_000.0);
        assert!((m.load_on(new, 1, true) - 50_000.0).abs() < 1e-6);
    }
}
