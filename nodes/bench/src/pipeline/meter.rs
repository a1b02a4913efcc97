//! The workers' CPU read around each run, and the starvation check ([`quota_use`]): the CPU
//! each worker's own cgroup counted over a run over what its quota allows while it had work;
//! below [`super::curve::MIN_QUOTA_USE`] the run did not get its quotas.

use std::collections::BTreeMap;

use anyhow::Result;
use troupe_actors::pipeline::{JobOutcome, PipelineJob, ShellSettings, SpanKind};
use troupe_policy::pipeline::costs::CostModel;

use troupe::workloads::pipeline::local::LocalCluster;

use super::cpu::{CpuSource, process_cpu_s};
use super::run_remembering;

/// A job run with each worker's CPU (by pid) and the foreman's read around it.
pub struct Metered {
    /// What the job did.
    pub outcome: JobOutcome,
    /// CPU seconds each worker used over the job, by pid.
    pub worker_cpu_s: BTreeMap<u32, f64>,
    /// CPU seconds this process (the foreman) used over the job.
    pub foreman_cpu_s: f64,
}

/// Each worker's CPU clock (`CpuSource`), by pid.
pub struct Meters(Vec<(u32, u32, CpuSource)>);

impl Meters {
    /// Attaches to the cluster's workers (`quotas`, percent, in the order they were started).
    pub fn attach(cluster: &LocalCluster, quotas: &[u32]) -> Self {
        let v = cluster
            .pids()
            .into_iter()
            .zip(quotas)
            .filter_map(|((name, pid), &q)| pid.map(|p| (p, q, CpuSource::attach(p, &name))))
            .collect();
        Self(v)
    }

    /// CPU seconds so far, by pid.
    pub fn read(&self) -> BTreeMap<u32, f64> {
        self.0.iter().filter_map(|(pid, _, s)| s.read_s().map(|v| (*pid, v))).collect()
    }

    /// Quota of each worker, CPUs, by pid.
    pub fn quotas(&self) -> BTreeMap<u32, f64> {
        self.0.iter().map(|(pid, q, _)| (*pid, f64::from(*q) / 100.0)).collect()
    }

    /// Whether every worker is read from a cgroup, and the sources in words.
    pub fn describe(&self) -> (bool, Vec<String>) {
        (self.0.iter().all(|(_, _, s)| s.is_cgroup()), self.0.iter().map(|(_, _, s)| s.describe()).collect())
    }

    /// Removes the groups the bench made (after the cluster is shut down).
    pub fn release(&self) {
        self.0.iter().for_each(|(_, _, s)| s.release());
    }
}

/// CPU used between two readings, by pid.
pub(super) fn used(before: &BTreeMap<u32, f64>, after: &BTreeMap<u32, f64>) -> BTreeMap<u32, f64> {
    after.iter().filter_map(|(p, a)| before.get(p).map(|b| (*p, (a - b).max(0.0)))).collect()
}

/// `run_remembering` with the CPU read around it.
pub async fn run_metered(
    cluster: &LocalCluster,
    meters: &Meters,
    job: PipelineJob,
    settings: ShellSettings,
    memory: &mut Option<CostModel>,
) -> Result<Metered> {
    let (w0, f0) = (meters.read(), process_cpu_s());
    let outcome = run_remembering(cluster, job, settings, memory).await?;
    let (w1, f1) = (meters.read(), process_cpu_s());
    Ok(Metered { outcome, worker_cpu_s: used(&w0, &w1), foreman_cpu_s: (f1 - f0).max(0.0) })
}

/// The run with the median makespan.
pub fn take_median_metered(mut runs: Vec<Metered>) -> Metered {
    runs.sort_by(|a, b| a.outcome.makespan_s.total_cmp(&b.outcome.makespan_s));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

/// Total length of the union of intervals.
fn union_len(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut cur) = (0.0, None::<(f64, f64)>);
    for (s, e) in v {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// The starvation check of one run: `(CPU used / sum_w busy_w q_w, CPU used / (makespan sum_w
/// q_w))`, `busy_w` the union of worker `w`'s load and task spans.
pub fn quota_use(m: &Metered, quotas: &BTreeMap<u32, f64>) -> (f64, f64) {
    let o = &m.outcome;
    let mut allowed = 0.0;
    for (i, w) in o.workers.iter().enumerate() {
        let busy: Vec<(f64, f64)> = o
            .spans
            .iter()
            .filter(|s| s.worker == i && matches!(s.kind, SpanKind::Run(_) | SpanKind::Load { .. }))
            .map(|s| (s.start, s.end))
            .collect();
        allowed += union_len(busy) * quotas.get(&w.pid).copied().unwrap_or(0.0);
    }
    let used: f64 = m.worker_cpu_s.values().sum();
    let sum_q: f64 = quotas.values().sum();
    (used / allowed.max(1e-9), used / (o.makespan_s * sum_q).max(1e-9))
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_actors::pipeline::{Span, WorkerSummary};
    use troupe_policy::pipeline::TaskId;

    #[test]
    fn union_of_overlapping_spans() {
        assert!((union_len(vec![(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) - 3.0).abs() < 1e-12);
        assert_eq!(union_len(Vec::new()), 0.0);
    }

    /// Two workers at 50 % and 25 %, busy 2 s and 1 s of a 4 s job, used 0.9 and 0.2 s of CPU:
    /// 1.1 / (2 x 0.5 + 1 x 0.25) of what their quotas allowed while busy, 1.1 / (4 x 0.75) over
    /// the makespan. A fetch is not busy time (it waits on the network).
    #[test]
    fn quota_use_counts_busy_time_at_each_quota() {
        let worker = |pid| WorkerSummary { pid, ..WorkerSummary::default() };
        let span = |worker, kind, start, end| Span { worker, kind, start, end };
        let outcome = JobOutcome {
            makespan_s: 4.0,
            workers: vec![worker(10), worker(11)],
            spans: vec![
                span(0, SpanKind::Load { stage: 0, cold: false, cpu_micros: 0 }, 0.0, 1.0),
                span(0, SpanKind::Run(TaskId::new(0, 0)), 0.5, 2.0),
                span(1, SpanKind::Fetch(1), 0.0, 3.0),
                span(1, SpanKind::Run(TaskId::new(0, 1)), 3.0, 4.0),
            ],
            ..JobOutcome::default()
        };
        let m = Metered { outcome, worker_cpu_s: BTreeMap::from([(10, 0.9), (11, 0.2)]), foreman_cpu_s: 0.1 };
        let (busy, whole) = quota_use(&m, &BTreeMap::from([(10, 0.5), (11, 0.25)]));
        assert!((busy - 1.1 / 1.25).abs() < 1e-9, "{busy}");
        assert!((whole - 1.1 / 3.0).abs() < 1e-9, "{whole}");
    }
}
