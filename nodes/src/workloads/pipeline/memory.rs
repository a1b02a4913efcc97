//! What a pipeline job cost each worker in memory: its idle floor (RSS when it joined holding no
//! session: runtime and ONNX Runtime loaded, no stage), its peak (`VmHWM`) and the size of the
//! largest stage file it pulled or loaded, both from its own final report, so that "peak at most
//! the floor plus 1.3x the stage's weights" can be read per worker, in the job summary and the
//! bench alike. A stage file is its weights plus a graph of a few KB (MiniLM's and
//! all-mpnet-base-v2's stages: within 0.1%), so its size stands for its weight bytes.

use troupe_actors::pipeline::JobOutcome;

/// The phone-weight goal: a worker's peak above its idle floor, over the size of the largest
/// stage it pulled or loaded, at most this.
pub const PEAK_ABOVE_FLOOR_OVER_STAGE_GOAL: f64 = 1.3;

/// One worker's memory over a job.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerMemory {
    /// Node name.
    pub node: String,
    /// RSS when it joined holding no session, bytes.
    pub idle_rss: Option<u64>,
    /// Peak RSS over its life up to the job's end (`VmHWM`), bytes; `None` when lost.
    pub peak_rss: Option<u64>,
    /// Size of the largest stage file it pulled or loaded, bytes; `None` when none.
    pub stage_weight: Option<u64>,
}

impl WorkerMemory {
    /// Peak above the idle floor, over the stage's weight bytes (goal:
    /// [`PEAK_ABOVE_FLOOR_OVER_STAGE_GOAL`]).
    pub fn peak_above_floor_over_stage(&self) -> Option<f64> {
        let (idle, peak, w) = (self.idle_rss?, self.peak_rss?, self.stage_weight?);
        Some(peak.saturating_sub(idle) as f64 / w.max(1) as f64)
    }

    /// Peak over the floor plus the stage's weight bytes (1.0: the stage costs its weights and
    /// nothing more).
    pub fn peak_over_floor_plus_stage(&self) -> Option<f64> {
        let (idle, peak, w) = (self.idle_rss?, self.peak_rss?, self.stage_weight?);
        Some(peak as f64 / (idle + w).max(1) as f64)
    }
}

/// Each worker's memory in `outcome`.
pub fn worker_memory(outcome: &JobOutcome) -> Vec<WorkerMemory> {
    outcome
        .workers
        .iter()
        .map(|w| WorkerMemory {
            node: w.node.clone(),
            idle_rss: w.idle_rss_bytes,
            peak_rss: w.stats.map(|s| s.peak_rss_bytes).filter(|&b| b > 0),
            stage_weight: w.stats.map(|s| s.largest_stage_bytes).filter(|&b| b > 0),
        })
        .collect()
}

/// The largest of `f` over the workers, if any has it.
pub fn largest(workers: &[WorkerMemory], f: impl Fn(&WorkerMemory) -> Option<f64>) -> Option<f64> {
    workers.iter().filter_map(f).reduce(f64::max)
}

/// The summary rows: the largest idle floor and the largest peak above it over the stage.
pub fn summary_rows(workers: &[WorkerMemory]) -> Vec<(String, String)> {
    let mut rows = Vec::new();
    if let Some(idle) = largest(workers, |w| w.idle_rss.map(|b| b as f64)) {
        rows.push(("worker idle RSS".into(), format!("{:.1} MB (largest, at join)", idle / 1e6)));
    }
    if let Some(r) = largest(workers, WorkerMemory::peak_above_floor_over_stage) {
        rows.push((
            "worker peak above idle".into(),
            format!("{r:.2}x its largest stage (largest; goal {PEAK_ABOVE_FLOOR_OVER_STAGE_GOAL})"),
        ));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_actors::pipeline::WorkerSummary;
    use troupe_actors::pipeline::wire::WorkerStats;

    #[test]
    fn each_worker_is_held_to_the_largest_stage_it_reported() {
        let worker = |node: &str, idle: Option<u64>, peak: u64, stage: u64| WorkerSummary {
            node: node.into(),
            idle_rss_bytes: idle,
            stats: Some(WorkerStats {
                peak_rss_bytes: peak,
                largest_stage_bytes: stage,
                ..WorkerStats::default()
            }),
            ..WorkerSummary::default()
        };
        let lost =
            WorkerSummary { node: "d".into(), idle_rss_bytes: Some(30), lost: true, ..Default::default() };
        let outcome = JobOutcome {
            workers: vec![
                worker("a", Some(40), 140, 100),
                worker("b", Some(50), 60, 10),
                worker("c", None, 90, 10),
                lost,
            ],
            ..JobOutcome::default()
        };
        let m = worker_memory(&outcome);
        assert_eq!(m[0].peak_above_floor_over_stage(), Some(1.0));
        assert_eq!(m[1].peak_above_floor_over_stage(), Some(1.0));
        assert_eq!(m[1].peak_over_floor_plus_stage(), Some(1.0));
        // joined with a live session: no floor, so no ratio; lost: no peak
        assert_eq!(m[2].peak_above_floor_over_stage(), None);
        assert_eq!(m[3].peak_above_floor_over_stage(), None);
        assert_eq!(largest(&m, |w| w.idle_rss.map(|b| b as f64)), Some(50.0));
        let rows = summary_rows(&m);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert!(rows[1].1.starts_with("1.00x"), "{rows:?}");
    }
}
