//! The curve of `troupe bench pipeline`: streaming, barrier and B*(N)
//! (`troupe_policy::pipeline::bound`) at N in {W, 2W, 5W, 10W}, with the starvation check, and
//! the larger model (all-mpnet-base-v2 in 4 stages on 4 workers) as the second case.
//!
//! - Costs for B*: each stage's task and warm load on this thread's CPU clock at full speed
//!   ([`measure_cpu_costs`]); the runtime's own CPU per task (decode, encode, transport on the
//!   worker) from the workers' CPU over one-input jobs at full speed less their ONNX Runtime
//!   time ([`runtime_cpu_per_task`]); capacity `min(sum of quotas, cores - the foreman's CPU)`,
//!   the foreman's CPU read on this process's clock over each streaming run.
//! - The starvation check ([`quota_use`]): the CPU each worker's own cgroup counted over a run
//!   (`cpu.rs`) over what its quota allows while it had work (the union of its load and task
//!   spans); below [`MIN_QUOTA_USE`] the run did not get its quotas and the bench says the
//!   measurement is invalid. The same over the whole makespan (the literal form, which
//!   also counts the waits a schedule leaves) is printed beside it.
//! - `real_over_sim_streaming`: the real streaming makespan over the policy simulator's on the
//!   same costs (task CPU plus runtime CPU scaled by each quota, loads as CPU, the rest of the
//!   measured per-task overhead as latency), the largest over N.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use troupe_actors::pipeline::{JobOutcome, PipelineJob, ShellSettings, SpanKind, StageFile, build_job};
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_policy::Micros;
use troupe_policy::pipeline::bound::{CpuCosts, capacity, captured_share, lower_bound};
use troupe_policy::pipeline::costs::CostModel;
use troupe_policy::pipeline::sim::{SimSetup, SimWorker, StageCost, simulate_on};
use troupe_policy::pipeline::{Chain, Foreman, ForemanConfig, Mode, Telemetry, WorkerId};

use troupe::workloads::pipeline::local::{LocalCluster, WorkerSpec};

use super::cpu::{CpuSource, process_cpu_s, thread_cpu_s};
use super::{TempDir, mean, median, overhead_s, run_remembering};

/// Job sizes of the curve, as multiples of the crowd's size W.
pub const MULTIPLES: [usize; 4] = [1, 2, 5, 10];
/// Below this share of its quotas (while the workers had work) a run was starved.
pub const MIN_QUOTA_USE: f64 = 0.8;
/// Quotas of the large case's 4 workers (3:2:2:1, 1.2 CPUs in all), percent of one CPU.
pub const LARGE_QUOTAS: [u32; 4] = [45, 30, 30, 15];
/// Rows of `mpnet_check.json` per input of the large case.
pub const LARGE_BATCH: usize = 2;
/// One-input jobs run at full speed for the runtime's CPU per task (the first is not counted).
const ISOLATED_JOBS: usize = 11;

/// Per-stage CPU at full speed, seconds.
#[derive(Clone, Debug, Default)]
pub struct MeasuredCosts {
    /// One task of stage `k` (ONNX Runtime only), median over inputs.
    pub task_cpu_s: Vec<f64>,
    /// One warm load of stage `k` (hash check and memory-mapped session, as a worker loads
    /// it), median of 3.
    pub load_cpu_s: Vec<f64>,
}

/// Each stage's task and warm-load CPU on this thread's clock (ONNX Runtime runs a session on
/// the calling thread with one intra-op thread, as the workers do). A load is what a worker's
/// is: the cached file's SHA-256 checked, then the session made with its initializers mapped.
pub fn measure_cpu_costs(stages: &[PathBuf], inputs: &[Vec<NamedTensor>]) -> Result<MeasuredCosts> {
    let cfg = SessionConfig::default();
    let mut sessions =
        stages.iter().map(|p| OnnxSession::from_file(p, &cfg)).collect::<Result<Vec<_>, _>>()?;
    let mut times = vec![Vec::new(); sessions.len()];
    for (round, input) in inputs.iter().enumerate().take(8) {
        let mut carried = input.clone();
        for (k, s) in sessions.iter_mut().enumerate() {
            let wanted: Vec<_> = s
                .inputs()
                .iter()
                .filter_map(|spec| carried.iter().chain(input.iter()).find(|t| t.name == spec.name).cloned())
                .collect();
            let start = thread_cpu_s();
            let out = s.run(&wanted)?;
            if round > 0 || inputs.len() == 1 {
                times[k].push(thread_cpu_s() - start);
            }
            carried = out;
        }
    }
    drop(sessions);
    // Links in a temp dir, so the mapped rewrite of each file lands there, not in the cache.
    let tmp = TempDir(std::env::temp_dir().join(format!("troupe-bench-loads-{}", std::process::id())));
    std::fs::create_dir_all(tmp.path()).context("temp dir for the loads")?;
    let mut loads = Vec::new();
    for (k, p) in stages.iter().enumerate() {
        let link = tmp.path().join(format!("stage{k}.onnx"));
        std::os::unix::fs::symlink(p.canonicalize()?, &link).context("linking a stage file")?;
        let mut t = Vec::new();
        // the first load writes the mapped copy (a worker does that once per file)
        for round in 0..4 {
            let start = thread_cpu_s();
            troupe_actors::pipeline::worker::sha256_file(&link).map_err(anyhow::Error::msg)?;
            let s = OnnxSession::from_file_mapped(&link, &cfg)?;
            let used = thread_cpu_s() - start;
            drop(s);
            if round > 0 {
                t.push(used);
            }
        }
        loads.push(median(&t));
    }
    Ok(MeasuredCosts { task_cpu_s: times.iter().map(|t| median(t)).collect(), load_cpu_s: loads })
}

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
fn used(before: &BTreeMap<u32, f64>, after: &BTreeMap<u32, f64>) -> BTreeMap<u32, f64> {
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

/// The runtime's CPU per task on the workers: their CPU over `jobs` (one-input jobs at full
/// speed, read around all of them) less the idle CPU they use anyway (`idle_cpu_s`) and less
/// ONNX Runtime's own CPU (`task_cpu_s` per stage, measured on a CPU clock: the workers' own
/// compute times are wall times, which a loaded host stretches), over the tasks.
pub fn runtime_cpu_per_task(cpu_s: f64, idle_cpu_s: f64, task_cpu_s: &[f64], jobs: &[JobOutcome]) -> f64 {
    let tasks: Vec<_> = jobs.iter().flat_map(|o| o.task_times.iter()).collect();
    let compute: f64 = tasks.iter().map(|t| task_cpu_s.get(t.task.stage).copied().unwrap_or(0.0)).sum();
    ((cpu_s - idle_cpu_s - compute) / tasks.len().max(1) as f64).max(0.0)
}

/// What the runtime's CPU per task was measured on (a full-speed cluster).
#[derive(Clone, Copy, Debug, Default)]
pub struct RuntimeCpu {
    /// CPU per task beyond ONNX Runtime's, seconds.
    pub per_task_s: f64,
    /// The per-task overhead in wall time (span minus compute), seconds.
    pub overhead_wall_s: f64,
    /// The workers' idle CPU, CPUs in all.
    pub idle_cpus: f64,
}

/// Runs one-input jobs back to back on a cluster at full speed (each stage on a worker that
/// holds it) and reads the workers' CPU around them; `warm` already ran there.
pub async fn measure_runtime_cpu(
    cluster: &LocalCluster,
    quotas: &[u32],
    files: &[StageFile],
    inputs: &[Vec<NamedTensor>],
    settings: &ShellSettings,
    task_cpu_s: &[f64],
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
    Ok(RuntimeCpu {
        per_task_s: runtime_cpu_per_task(cpu, idle * window, task_cpu_s, &jobs),
        overhead_wall_s: overhead_s(&times),
        idle_cpus: idle,
    })
}

/// The medians of one job size: streaming and barrier.
pub struct Point {
    /// Inputs.
    pub n: usize,
    /// The median streaming run.
    pub streaming: Metered,
    /// The median barrier run.
    pub barrier: Metered,
}

/// All a curve's figures need besides its points.
pub struct CurveSetup<'a> {
    /// Key prefix (`""` or `"large_"`).
    pub prefix: &'a str,
    /// The workers' quotas, percent of one CPU.
    pub quotas: &'a [u32],
    /// Per-stage CPU at full speed.
    pub costs: &'a MeasuredCosts,
    /// The runtime's CPU per task.
    pub runtime: RuntimeCpu,
    /// Mean pull of each stage file in the cold run, seconds (the simulator's download).
    pub pulls_s: Vec<f64>,
    /// The job's chain (for the simulator).
    pub chain: Chain,
    /// Cores of this host.
    pub cores: f64,
    /// Starvation check over every measured run: smallest (busy share, makespan share).
    pub quota_use: (f64, f64),
    /// Whether every worker's CPU was read from a cgroup.
    pub from_cgroups: bool,
}

/// The curve's keys, and the lines that explain them.
pub fn curve_figures(s: &CurveSetup<'_>, points: &[Point]) -> (BTreeMap<String, f64>, Vec<String>) {
    let p = s.prefix;
    let mut f = BTreeMap::new();
    let mut lines = Vec::new();
    let mut put = |k: &str, v: f64| {
        f.insert(format!("{p}{k}"), v);
    };
    let w = s.quotas.len();
    let q: Vec<f64> = s.quotas.iter().map(|&q| f64::from(q) / 100.0).collect();
    let us = |x: f64| Micros((x.max(0.0) * 1e6).round() as u64);
    let cpu = CpuCosts {
        task: s.costs.task_cpu_s.iter().map(|t| us(t + s.runtime.per_task_s)).collect(),
        load: s.costs.load_cpu_s.iter().map(|&l| us(l)).collect(),
    };
    for (k, (t, l)) in s.costs.task_cpu_s.iter().zip(&s.costs.load_cpu_s).enumerate() {
        put(&format!("stage{k}_task_cpu_ms"), t * 1e3);
        put(&format!("stage{k}_load_cpu_ms"), l * 1e3);
    }
    put("runtime_cpu_per_task_ms", s.runtime.per_task_s * 1e3);
    put("workers_idle_cpus", s.runtime.idle_cpus);
    put("quota_sum_cpus", q.iter().sum());
    let valid = s.from_cgroups && s.quota_use.0 >= MIN_QUOTA_USE;
    put("quota_use_share", s.quota_use.0);
    put("quota_use_share_of_makespan", s.quota_use.1);
    put("measurement_valid", if valid { 1.0 } else { 0.0 });
    let mut worst_sim: f64 = 0.0;
    lines.push(format!(
        "{p}curve (B* = troupe_policy::pipeline::bound: task CPU {:?} ms + runtime {:.2} ms per task, \
         loads {:?} ms of CPU, quotas {:?}):",
        s.costs.task_cpu_s.iter().map(|t| (t * 1e4).round() / 10.0).collect::<Vec<_>>(),
        s.runtime.per_task_s * 1e3,
        s.costs.load_cpu_s.iter().map(|t| (t * 1e4).round() / 10.0).collect::<Vec<_>>(),
        s.quotas
    ));
    for pt in points {
        let m = pt.n / w.max(1);
        let (ts, tb) = (pt.streaming.outcome.makespan_s, pt.barrier.outcome.makespan_s);
        let foreman = pt.streaming.foreman_cpu_s / ts.max(1e-9);
        let cap = capacity(&q, s.cores, foreman);
        let bound = lower_bound(&cpu, &q, cap, pt.n).map_or(f64::NAN, |b| b.0 as f64 / 1e6);
        let sim = sim_streaming(s, &q, pt.n);
        let share = captured_share(tb, ts, bound);
        worst_sim = worst_sim.max(ts / sim);
        put(&format!("streaming_s_n{m}w"), ts);
        put(&format!("barrier_s_n{m}w"), tb);
        put(&format!("bound_s_n{m}w"), bound);
        put(&format!("capacity_cpus_n{m}w"), cap);
        put(&format!("foreman_cpus_n{m}w"), foreman);
        put(&format!("streaming_over_bound_n{m}w"), ts / bound);
        put(&format!("barrier_over_bound_n{m}w"), tb / bound);
        put(&format!("captured_share_n{m}w"), share);
        put(&format!("streaming_speedup_over_barrier_n{m}w"), tb / ts);
        put(&format!("sim_streaming_s_n{m}w"), sim);
        put(&format!("real_over_sim_streaming_n{m}w"), ts / sim);
        put(&format!("sim_streaming_over_bound_n{m}w"), sim / bound);
        lines.push(format!(
            "  N = {:>2} W ({:>3} inputs): streaming {ts:.3} s, barrier {tb:.3} s ({:.2}x), B* {bound:.3} s \
             (capacity {cap:.2} CPUs, foreman {foreman:.2}); streaming/B* {:.2} (goal <= 1.2), captured \
             share (Tb - Ts)/(Tb - B*) = ({tb:.3} - {ts:.3})/({tb:.3} - {bound:.3}) = {share:.2} (goal >= 0.5); \
             sim_streaming {sim:.3} s, real/sim {:.2} (goal <= 1.15); sim/B* {:.2}{}",
            m,
            pt.n,
            tb / ts,
            ts / bound,
            ts / sim,
            sim / bound,
            if sim / bound > 1.2 {
                " (this policy's own schedule, every worker at its full quota, is above 1.2 B* here: \
                 <= 1.2 B* is out of its reach at this N on any host)"
            } else {
                ""
            }
        ));
    }
    put("real_over_sim_streaming", worst_sim);
    // (the MiniLM case has this key from its main runs, the same medians)
    if let Some(pt) = points.iter().find(|pt| pt.n == w && !p.is_empty()) {
        put(
            "streaming_speedup_over_barrier_n_eq_w",
            pt.barrier.outcome.makespan_s / pt.streaming.outcome.makespan_s,
        );
    }
    lines.push(format!(
        "  starvation check: CPU read from the workers' cgroups / (quota x time each had work) = {:.2} at the \
         smallest over the runs (>= {MIN_QUOTA_USE} wanted; over the whole makespan, waits included: {:.2}){}",
        s.quota_use.0,
        s.quota_use.1,
        if !s.from_cgroups {
            " -- INVALID: not every worker's CPU came from a cgroup".to_string()
        } else if !valid {
            format!(
                " -- INVALID: the workers got {:.0}% of their quotas while they had work; the host is \
                 loaded by something else (or the quotas add to more than its free cores), so these times \
                 are not this schedule's",
                s.quota_use.0 * 100.0
            )
        } else {
            String::new()
        }
    ));
    (f, lines)
}

/// The policy simulator's streaming makespan on the measured costs (the second job of a
/// foreman, as the bench runs), seconds.
fn sim_streaming(s: &CurveSetup<'_>, q: &[f64], inputs: usize) -> f64 {
    let us = |x: f64| Micros((x.max(0.0) * 1e6).round() as u64);
    let costs: Vec<StageCost> = (0..s.costs.task_cpu_s.len())
        .map(|k| StageCost {
            compute: us(s.costs.task_cpu_s[k] + s.runtime.per_task_s),
            download: us(s.pulls_s.get(k).copied().unwrap_or(0.0)),
            warm_load: us(s.costs.load_cpu_s[k]),
        })
        .collect();
    let workers: Vec<SimWorker> = q
        .iter()
        .enumerate()
        .map(|(i, &speed)| SimWorker {
            id: WorkerId(i as u32),
            speed,
            telemetry: Telemetry {
                ram_budget_bytes: 512 << 20,
                free_ram_bytes: 256 << 20,
                battery_pct: 95.0 - 15.0 * i as f64,
                ..Telemetry::default()
            },
            cached: (0..costs.len()).collect(),
        })
        .collect();
    let setup = SimSetup {
        chain: s.chain.clone(),
        costs,
        workers,
        inputs,
        mode: Mode::Streaming,
        hop: Micros::ZERO,
        // the wall overhead beyond the CPU already in `compute`: latency, not scaled by speed
        task_overhead: us(s.runtime.overhead_wall_s - s.runtime.per_task_s),
        loads_are_cpu: true,
        crashes: Vec::new(),
        deliver_late_completions: false,
        foreman: ForemanConfig::default(),
    };
    simulate_on(&setup, Foreman::new(setup.foreman))
        .and_then(|(_, f)| simulate_on(&setup, f))
        .ok()
        .and_then(|(r, _)| r.makespan)
        .map_or(f64::NAN, |m| m.0 as f64 / 1e6)
}

/// Mean pull time of each stage file in `o` (a cold run), seconds.
pub fn pulls(o: &JobOutcome, stages: usize) -> Vec<f64> {
    (0..stages)
        .map(|k| {
            mean(
                &o.spans
                    .iter()
                    .filter(|s| s.kind == SpanKind::Fetch(k))
                    .map(|s| s.end - s.start)
                    .collect::<Vec<_>>(),
            )
        })
        .collect()
}

/// The large model's inputs: `count` inputs of [`LARGE_BATCH`] rows of `mpnet_check.json`.
fn large_inputs(path: &Path, count: usize) -> Result<Vec<Vec<NamedTensor>>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?;
    let rows = |key: &str| -> Result<Vec<Vec<i64>>> {
        serde_json::from_value(json[key].clone())
            .with_context(|| format!("{}: \"{key}\" rows", path.display()))
    };
    let (ids, mask) = (rows("ids")?, rows("attention_mask")?);
    let width = ids.first().map_or(0, Vec::len);
    if ids.is_empty() || ids.len() != mask.len() || ids.iter().chain(&mask).any(|r| r.len() != width) {
        bail!("{}: ids and attention_mask are not rows of one length", path.display());
    }
    Ok((0..count)
        .map(|i| {
            let pick: Vec<usize> = (0..LARGE_BATCH).map(|j| (i * LARGE_BATCH + j) % ids.len()).collect();
            let shape = vec![LARGE_BATCH, width];
            vec![
                NamedTensor::i64(
                    "input_ids",
                    shape.clone(),
                    pick.iter().flat_map(|&r| ids[r].clone()).collect(),
                ),
                NamedTensor::i64(
                    "attention_mask",
                    shape,
                    pick.iter().flat_map(|&r| mask[r].clone()).collect(),
                ),
            ]
        })
        .collect())
}

/// The second case: all-mpnet-base-v2 in 4 stages on 4 workers ([`LARGE_QUOTAS`]), its curve
/// (`large_` keys). `None` (and a line saying how to enable it) without `scripts/setup --large`.
pub async fn large_case(exe: &Path, workdir: &Path, repeats: usize) -> Result<Option<BTreeMap<String, f64>>> {
    use troupe_kernels::assets::{Assets, LARGE_SETUP_HINT, MPNET_CHECK, MPNET_STAGES};
    let assets = Assets::locate()?;
    let found: Result<Vec<PathBuf>, _> = MPNET_STAGES.iter().map(|s| assets.path(s)).collect();
    let (Ok(stages), Ok(check)) = (found, assets.path(MPNET_CHECK)) else {
        println!(
            "large case skipped: all-mpnet-base-v2 is not in the setup cache; to run it: {LARGE_SETUP_HINT}"
        );
        return Ok(None);
    };
    let w = LARGE_QUOTAS.len();
    let inputs_of = |n: usize| large_inputs(&check, n);
    let costs = measure_cpu_costs(&stages, &inputs_of(8)?)?;
    let files = stages.iter().map(|p| StageFile::from_path(p)).collect::<Result<Vec<_>, _>>()?;
    let job = |mode: Mode, n: usize| -> Result<PipelineJob> {
        Ok(build_job(files.clone(), inputs_of(n)?, mode, false)?)
    };
    let chain = job(Mode::Streaming, 1)?.chain;
    let specs = |full: bool, dir: &Path| -> Vec<WorkerSpec> {
        LARGE_QUOTAS
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let mut s = WorkerSpec::new(&format!("large-{}", i + 1), if full { 100 } else { q }, dir);
                s.battery_pct = 95.0 - 15.0 * i as f64;
                s
            })
            .collect()
    };
    // a 15 % worker starting ONNX Runtime on a loaded host took over 60 s to join once
    let settings =
        ShellSettings { workers: w, join_timeout: Duration::from_secs(180), ..ShellSettings::default() };
    let _ = std::fs::remove_dir_all(workdir.join("cache"));
    let cluster = LocalCluster::start(exe, workdir, &specs(false, workdir)).await?;
    let meters = Meters::attach(&cluster, &LARGE_QUOTAS);
    let mut memory = None;
    let result = async {
        let cold = run_remembering(&cluster, job(Mode::Streaming, w)?, settings.clone(), &mut memory).await?;
        run_remembering(&cluster, job(Mode::Barrier, w)?, settings.clone(), &mut memory).await?;
        let mut runs: BTreeMap<(usize, bool), Vec<Metered>> = BTreeMap::new();
        let mut qu = (f64::INFINITY, f64::INFINITY);
        for _ in 0..repeats.clamp(1, 3) {
            for m in MULTIPLES {
                for streaming in [true, false] {
                    let mode = if streaming { Mode::Streaming } else { Mode::Barrier };
                    let r = run_metered(&cluster, &meters, job(mode, m * w)?, settings.clone(), &mut memory)
                        .await?;
                    let u = quota_use(&r, &meters.quotas());
                    qu = (qu.0.min(u.0), qu.1.min(u.1));
                    runs.entry((m * w, streaming)).or_default().push(r);
                }
            }
        }
        anyhow::Ok((cold, runs, qu))
    }
    .await;
    let (from_cgroups, sources) = meters.describe();
    cluster.shutdown().await;
    meters.release();
    let (cold, mut runs, qu) = result?;
    let full_dir = workdir.join("full-speed");
    let full = LocalCluster::start(exe, &full_dir, &specs(true, &full_dir)).await?;
    let runtime = async {
        full.run(job(Mode::Streaming, w)?, settings.clone(), None).await?;
        measure_runtime_cpu(
            &full,
            &[100; 4],
            &files,
            &inputs_of(ISOLATED_JOBS)?,
            &settings,
            &costs.task_cpu_s,
        )
        .await
    }
    .await;
    full.shutdown().await;
    let runtime = runtime?;
    let points: Vec<Point> = MULTIPLES
        .iter()
        .filter_map(|&m| {
            let s = runs.remove(&(m * w, true))?;
            let b = runs.remove(&(m * w, false))?;
            Some(Point { n: m * w, streaming: take_median_metered(s), barrier: take_median_metered(b) })
        })
        .collect();
    let setup = CurveSetup {
        prefix: "large_",
        quotas: &LARGE_QUOTAS,
        costs: &costs,
        runtime,
        pulls_s: pulls(&cold, stages.len()),
        chain,
        cores: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        quota_use: qu,
        from_cgroups,
    };
    let (mut f, lines) = curve_figures(&setup, &points);
    println!("large case: all-mpnet-base-v2 in 4 stages on 4 workers, {LARGE_BATCH} sentences per input");
    for l in lines {
        println!("{l}");
    }
    println!("  workers' CPU read from: {}", sources.join("; "));
    f.insert("large_cold_streaming_s".into(), cold.makespan_s);
    Ok(Some(f))
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
                span(0, SpanKind::Load { stage: 0, cold: false }, 0.0, 1.0),
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
