//! The costs B*(N) and the simulator are given, measured at full speed on CPU clocks: each
//! stage's task and warm load on this thread ([`measure_cpu_costs`]), and the runtime's own CPU
//! per task on the workers (decode, encode, transport: [`measure_runtime_cpu`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use troupe_actors::pipeline::{JobOutcome, ShellSettings, SpanKind, StageFile, build_job};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_policy::pipeline::Mode;

use troupe::workloads::pipeline::local::LocalCluster;

use super::cpu::thread_cpu_s;
use super::meter::{Meters, used};
use super::overhead_s;

/// One-input jobs run at full speed for the runtime's CPU per task (the first is not counted).
pub const ISOLATED_JOBS: usize = 11;

/// Most inputs whose task CPU is measured one by one (a job's inputs repeat past them).
pub const MAX_COST_INPUTS: usize = 64;

/// Passes over the inputs when a task's CPU is measured alone: each input's cost is its least
/// over the passes, so a burst of noise on the host in one pass does not raise the bound.
pub const COST_PASSES: usize = 3;

/// Per-stage CPU at full speed, seconds.
#[derive(Clone, Debug, Default)]
pub struct MeasuredCosts {
    /// One task of stage `k` (ONNX Runtime only), the mean over the measured inputs of each
    /// input's least CPU over `COST_PASSES` passes.
    pub task_cpu_s: Vec<f64>,
    /// The same per input: `[k][i]`, stage `k`, input `i` of the jobs (a job of `N` inputs runs
    /// inputs `0..N`; past the measured ones they repeat).
    pub task_cpu_s_by_input: Vec<Vec<f64>>,
    /// One warm load of stage `k` (hash check and memory-mapped session, as a worker loads
    /// it), the least of 3.
    pub load_cpu_s: Vec<f64>,
}

impl MeasuredCosts {
    /// Stage `stage`'s task CPU for input `input`, seconds (0 for an unknown stage).
    pub fn task_cpu_s_of(&self, stage: usize, input: usize) -> f64 {
        match self.task_cpu_s_by_input.get(stage) {
            Some(v) if !v.is_empty() => v[input % v.len()],
            _ => 0.0,
        }
    }

    /// Each stage's mean task CPU over a job's inputs `0..inputs`, seconds: what a job of that
    /// size asks of the crowd per task.
    pub fn task_cpu_s_over(&self, inputs: usize) -> Vec<f64> {
        let n = inputs.max(1);
        (0..self.task_cpu_s_by_input.len())
            .map(|k| (0..n).map(|i| self.task_cpu_s_of(k, i)).sum::<f64>() / n as f64)
            .collect()
    }
}

/// The session options a pipeline worker runs its stage with (one intra-op thread, memory
/// before speed: no CPU arena, no memory pattern); with them a task costs ~3 % more CPU alone
/// than with ONNX Runtime's defaults.
fn worker_session_config() -> SessionConfig {
    SessionConfig::lean(1)
}

/// Each stage's task and warm-load CPU on this thread's clock (ONNX Runtime runs a session on
/// the calling thread with one intra-op thread, as the workers do). A load is what a worker's
/// is: the cached file's SHA-256 checked, then the session made with its initializers mapped.
/// Costs are least over repeats (noise on a CPU clock only ever adds), so B* stays below a run
/// whose costs matched the alone ones (a median of one pass once read a large-model task 6 %
/// high and put a real run at 0.98 B*).
pub fn measure_cpu_costs(stages: &[PathBuf], inputs: &[Vec<NamedTensor>]) -> Result<MeasuredCosts> {
    let cfg = worker_session_config();
    // Links in a temp dir, so the mapped rewrite of each file lands there, not in the cache.
    let tmp =
        tempfile::Builder::new().prefix("troupe-bench-loads-").tempdir().context("temp dir for the loads")?;
    let mut links = Vec::new();
    for (k, p) in stages.iter().enumerate() {
        let link = tmp.path().join(format!("stage{k}.onnx"));
        std::os::unix::fs::symlink(p.canonicalize()?, &link).context("linking a stage file")?;
        links.push(link);
    }
    // sessions made as a worker makes them, initializers mapped from the stage file
    let mut sessions =
        links.iter().map(|p| OnnxSession::from_file_mapped(p, &cfg)).collect::<Result<Vec<_>, _>>()?;
    let inputs = &inputs[..inputs.len().min(MAX_COST_INPUTS)];
    // least[k][i]: stage k's CPU for input i, least over the passes
    let mut least = vec![vec![f64::INFINITY; inputs.len()]; sessions.len()];
    for pass in 0..COST_PASSES {
        for (i, input) in inputs.iter().enumerate() {
            let mut carried = input.clone();
            for (k, s) in sessions.iter_mut().enumerate() {
                let wanted: Vec<_> = s
                    .inputs()
                    .iter()
                    .filter_map(|spec| {
                        carried.iter().chain(input.iter()).find(|t| t.name == spec.name).cloned()
                    })
                    .collect();
                let start = thread_cpu_s();
                let out = s.run(&wanted)?;
                // the very first run of a session warms it up
                if pass > 0 || i > 0 || inputs.len() == 1 {
                    least[k][i] = least[k][i].min(thread_cpu_s() - start);
                }
                carried = out;
            }
        }
    }
    let task_cpu_s = least
        .iter()
        .map(|per_input| {
            let v: Vec<f64> = per_input.iter().copied().filter(|t| t.is_finite()).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        })
        .collect();
    drop(sessions);
    let mut loads = Vec::new();
    for link in &links {
        let mut t = Vec::new();
        // the sessions above wrote the mapped copy (a worker does that once per file, at its pull)
        for round in 0..4 {
            let start = thread_cpu_s();
            troupe_actors::pipeline::worker::sha256_file(link).map_err(anyhow::Error::msg)?;
            let s = OnnxSession::from_file_mapped(link, &cfg)?;
            let used = thread_cpu_s() - start;
            drop(s);
            if round > 0 {
                t.push(used);
            }
        }
        loads.push(t.iter().copied().fold(f64::INFINITY, f64::min));
    }
    Ok(MeasuredCosts { task_cpu_s, task_cpu_s_by_input: least, load_cpu_s: loads })
}

/// The runtime's CPU per task on the workers: their CPU over `jobs` (one-input jobs at full
/// speed, read around all of them) less the idle CPU they use anyway (`idle_cpu_s`) and less
/// ONNX Runtime's own CPU, as each worker read it on its run's thread CPU clock
/// (`compute_cpu_micros`), less the CPU of any load the jobs made (as the worker read it on
/// the load's thread clock), over the tasks. (Subtracting the compute measured alone in this
/// process instead put any difference between the two into the runtime's share: 0.6 to 5.6 ms
/// per task from one run to the next.)
pub fn runtime_cpu_per_task(cpu_s: f64, idle_cpu_s: f64, jobs: &[JobOutcome]) -> f64 {
    let tasks: Vec<_> = jobs.iter().flat_map(|o| o.task_times.iter()).collect();
    let compute: f64 = tasks.iter().map(|t| t.reported.compute_cpu_micros as f64 / 1e6).sum();
    // a job may make a worker load a stage (each load is hundreds of ms of CPU for the large
    // model): that is a load's CPU, not the runtime's per task
    let (loads, _) = load_cpu(jobs.iter(), &[]);
    ((cpu_s - idle_cpu_s - compute - loads) / tasks.len().max(1) as f64).max(0.0)
}

/// The loads in `outcomes`: their CPU as the workers read it on the loads' thread clocks, and
/// what the loads measured alone in this process (`load_cpu_s` per stage) predict for them,
/// seconds.
fn load_cpu<'a>(outcomes: impl Iterator<Item = &'a JobOutcome>, load_cpu_s: &[f64]) -> (f64, f64) {
    outcomes.flat_map(|o| o.spans.iter()).fold((0.0, 0.0), |(used, alone), s| match s.kind {
        SpanKind::Load { stage, cpu_micros, .. } => {
            (used + cpu_micros as f64 / 1e6, alone + load_cpu_s.get(stage).copied().unwrap_or(0.0))
        }
        _ => (used, alone),
    })
}

/// A run's load CPU, as its workers read it, over what the loads measured alone in this process
/// predict (NaN without loads): the loads' counterpart of [`compute_cpu_over_measured`].
pub fn load_cpu_over_measured(o: &JobOutcome, costs: &MeasuredCosts) -> f64 {
    let (used, alone) = load_cpu(std::iter::once(o), &costs.load_cpu_s);
    if alone > 0.0 { used / alone } else { f64::NAN }
}

/// A run's ONNX Runtime CPU, as its workers read it, over what the compute measured alone in
/// this process predicts for the tasks it ran (NaN without tasks). Above 1 when the crowd's
/// processes, sharing this host's cores and caches, make each task cost more CPU.
pub fn compute_cpu_over_measured(o: &JobOutcome, costs: &MeasuredCosts) -> f64 {
    let (mut used, mut alone) = (0.0, 0.0);
    for t in &o.task_times {
        used += t.reported.compute_cpu_micros as f64 / 1e6;
        alone += costs.task_cpu_s_of(t.task.stage, t.task.input);
    }
    if alone > 0.0 { used / alone } else { f64::NAN }
}

/// What the runtime's CPU per task was measured on (a full-speed cluster).
#[derive(Clone, Debug, Default)]
pub struct RuntimeCpu {
    /// CPU per task beyond ONNX Runtime's, seconds.
    pub per_task_s: f64,
    /// The per-task overhead in wall time (span minus compute), seconds.
    pub overhead_wall_s: f64,
    /// The workers' idle CPU, CPUs in all.
    pub idle_cpus: f64,
    /// ONNX Runtime's CPU of each task on a worker at full speed, one task in flight: (stage,
    /// the input's index among the jobs' inputs, seconds), the workers' own reading of what the
    /// bench process measures alone.
    pub worker_tasks: Vec<(usize, usize, f64)>,
}

/// Runs one-input jobs back to back on a cluster at full speed (each stage on a worker that
/// holds it) and reads the workers' CPU around them; `warm` already ran there.
pub async fn measure_runtime_cpu(
    cluster: &LocalCluster,
    quotas: &[u32],
    files: &[StageFile],
    inputs: &[Vec<NamedTensor>],
    settings: &ShellSettings,
) -> Result<RuntimeCpu> {
    let meters = Meters::attach(cluster, quotas);
    let resident = ShellSettings { fresh_start: false, ..settings.clone() };
    // the first job loads the sessions; not counted
    let first = inputs.first().context("no inputs")?.clone();
    cluster
        .run(build_job(files.to_vec(), vec![first], Mode::Streaming, false)?, resident.clone(), None)
        .await?;
    let idle0 = (meters.read(), std::time::Instant::now());
    // a measurement window of the workers' idle CPU, not a synchronisation
    tokio::time::sleep(Duration::from_secs(1)).await;
    let idle = used(&idle0.0, &meters.read()).values().sum::<f64>() / idle0.1.elapsed().as_secs_f64();
    let before = (meters.read(), std::time::Instant::now());
    let mut jobs = Vec::new();
    for i in 1..ISOLATED_JOBS {
        let input = inputs[i % inputs.len()].clone();
        jobs.push(
            cluster
                .run(build_job(files.to_vec(), vec![input], Mode::Streaming, false)?, resident.clone(), None)
                .await?,
        );
    }
    let cpu: f64 = used(&before.0, &meters.read()).values().sum();
    let window = before.1.elapsed().as_secs_f64();
    meters.release();
    let times: Vec<_> = jobs.iter().flat_map(|o| o.task_times.iter().cloned()).collect();
    // job j ran input j + 1 (each job's one input is its input 0)
    let worker_tasks = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, o)| {
            o.task_times.iter().map(move |t| {
                (t.task.stage, (j + 1) % inputs.len(), t.reported.compute_cpu_micros as f64 / 1e6)
            })
        })
        .collect();
    Ok(RuntimeCpu {
        per_task_s: runtime_cpu_per_task(cpu, idle * window, &jobs),
        overhead_wall_s: overhead_s(&times),
        idle_cpus: idle,
        worker_tasks,
    })
}

#[cfg(test)]
mod tests {
    use troupe_actors::pipeline::wire::RunTimes;
    use troupe_actors::pipeline::{Span, TaskTimes};
    use troupe_policy::pipeline::TaskId;

    use super::*;

    fn outcome(loads: &[(usize, u64)], computes_us: &[u64]) -> JobOutcome {
        let spans = loads
            .iter()
            .map(|&(stage, cpu_micros)| Span {
                worker: 0,
                kind: SpanKind::Load { stage, cold: false, cpu_micros },
                start: 0.0,
                end: 1.0,
            })
            .collect();
        let task_times = computes_us
            .iter()
            .enumerate()
            .map(|(i, &c)| TaskTimes {
                task: TaskId { input: i, stage: 1 },
                worker: 0,
                span_s: 0.1,
                call_s: 0.1,
                compute_s: 0.05,
                reported: RunTimes { compute_cpu_micros: c, ..RunTimes::default() },
            })
            .collect();
        JobOutcome { spans, task_times, ..JobOutcome::default() }
    }

    /// The loads' factor is their reported CPU over the alone-measured CPU of the same stages.
    #[test]
    fn load_factor_weighs_each_load_by_its_stage() {
        let costs = MeasuredCosts {
            task_cpu_s: vec![0.0, 0.010],
            task_cpu_s_by_input: vec![vec![0.0], vec![0.010]],
            load_cpu_s: vec![0.040, 0.050],
        };
        let o = outcome(&[(0, 60_000), (1, 75_000), (1, 75_000)], &[]);
        assert!((load_cpu_over_measured(&o, &costs) - 210.0 / 140.0).abs() < 1e-12);
        assert!(load_cpu_over_measured(&outcome(&[], &[]), &costs).is_nan());
    }

    /// The runtime's CPU per task leaves out what the workers read for compute and for loads.
    #[test]
    fn runtime_cpu_leaves_out_reported_compute_and_loads() {
        let job = outcome(&[(1, 200_000)], &[10_000, 12_000]);
        // 0.5 s used, 0.1 s idle, 0.2 s load, 0.022 s compute: 0.178 s over two tasks
        let per_task = runtime_cpu_per_task(0.5, 0.1, std::slice::from_ref(&job));
        assert!((per_task - 0.089).abs() < 1e-9, "{per_task}");
        // never below zero
        assert_eq!(runtime_cpu_per_task(0.1, 0.1, &[job]), 0.0);
    }
}
