//! `troupe bench pipeline`: the CROWDio workload measured in one run on this machine.
//!
//! - RSS: the whole model and each stage file are loaded and run in fresh processes
//!   (`troupe pipeline probe-rss`), their peak RSS (`VmHWM`) read from the OS. Each worker
//!   process's peak RSS is read from `/proc/<pid>/status` after the cold run (it includes the
//!   buffers of the stage-file pulls) and, after resetting it (`clear_refs`), over the warm runs
//!   (`worker_peak_rss_mb_max`: what single-partition residency costs).
//! - Streaming vs barrier: the same job (MiniLM in 3 stages, `inputs` inputs of `batch`
//!   sentences, default N = 10 W; and again with N = W inputs, the `_n_eq_w` figures) on 5 worker processes slowed for real (cgroup v1 CPU quota where available,
//!   else pacing, which the table says) to 39/26/26/13/13% of one CPU ([`QUOTAS`]). The ideal pipeline bound
//!   comes from per-stage compute times measured here at full speed and the workers' quotas
//!   (`troupe_policy::pipeline::sim::ideal_pipeline_bound`): compute only, no loads or transfers.
//!   `streaming_over_ideal_with_loads` divides by the bound that also counts loads
//!   ([`BOUND_WITH_LOADS`], printed with the figures); `barrier_over_ideal_with_loads` is the
//!   most any streaming schedule could gain over the barrier run (one at the bound itself).
//! - Cold vs warm load: the first job pulls every stage file (cold: pull + session creation);
//!   later jobs find them in the workers' disk caches (warm: session creation only; the file is
//!   in the page cache, so this is the best case for a warm load).
//! - Wire bytes: f32 activations, both directions, lossless (byte-shuffle + zstd) and bf16 apart.
//! - Overhead per task ([`OVERHEAD_DOC`]): on the same workers at full speed (a second local
//!   cluster, no quota, warm disk caches), `task_overhead_ms` from one-input jobs (one task in
//!   flight) and `task_overhead_loaded_ms` from a whole streaming job, each with its parts from
//!   the workers' own timings; `task_overhead_ms_under_quota` from the streaming run under
//!   the quotas. The quotas are CFS quotas with a 10 ms period (`cfs_period_ms`), so a 20 %
//!   worker stalls at most 8 ms at a time rather than 80 ms.
//! - Activations: `foreman_share_of_activation_bytes` is the foreman's share of the
//!   intermediate activation bytes that moved between nodes, from counters kept as they moved
//!   (the foreman's own sends and receives; the bytes workers pulled from each other).
//!
//! - The policy's own prediction: the simulator replays both modes with the measured per-stage
//!   compute, pull and warm-load times, the quotas as speeds and the measured per-task overhead
//!   (`sim_*` figures), to tell scheduling effects from measurement noise on a shared machine.
//!
//! - Ablations (item 8, `ablation_*`), each the median of `repeats` real runs alternated with
//!   the main ones: eager stage loads under the stage plan against just in time (the main
//!   streaming runs), residency on (a streaming job right after an eager one, without unloading
//!   the workers: each keeps its live stage) against off, and per run how often each tier (1-4)
//!   served a claim (the `assign ... (Tn)` log lines), tasks and home stage per worker, loads.
//!   Every job starts from the costs the jobs before it learned (`ShellSettings::prior_costs`).
//!
//! - The curve ([`curve`], issue 44): streaming, barrier and B*(N) at N = W, 2W, 5W, 10W, the
//!   starvation check read from the workers' cgroups, and the large model as a second case.
//!
//! Streaming and barrier runs alternate `repeats` times on the same warm cluster; the median run
//! of each is reported (with the spread), and drawn: the SVG is a Gantt chart of those two runs,
//! one row per worker.

mod cpu;
mod cpu_costs;
pub(crate) mod crowd;
pub mod curve;
mod large;
mod meter;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use troupe_actors::pipeline::telemetry::CFS_PERIOD_US;
use troupe_actors::pipeline::{JobOutcome, PipelineJob, ShellSettings, Span, SpanKind, StageFile, build_job};
use troupe_kernels::onnx::{OnnxSession, SessionConfig};
use troupe_policy::Micros;
use troupe_policy::pipeline::Mode;
use troupe_policy::pipeline::costs::CostModel;
use troupe_policy::pipeline::sim::{
    SimSetup, StageCost, ideal_pipeline_bound, ideal_pipeline_bound_with_loads, simulate_on,
};
use troupe_policy::pipeline::{Foreman, ForemanConfig};

use troupe::chart::{Bar, BarChart, BarGroup, BarRow, COLOURS};
use troupe::workloads::pipeline::local::LocalCluster;
use troupe::workloads::pipeline::{final_vector, minilm_stages, tokenize_batches};

/// Sentences the benchmark embeds (the example's inputs file, compiled in).
const SENTENCES: &str = include_str!("../../../examples/pipeline-sentences.txt");
/// The sentences the benchmark embeds.
pub(crate) fn sentences() -> Vec<String> {
    SENTENCES
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

/// CPU quotas of the 5 workers, percent of one CPU: 3:2:2:1:1, 1.17 CPUs in all, so the crowd
/// fits a 2-core host beside the foreman (at 60/40/40/20/20, 1.8 CPUs, the workers got less than
/// their quotas and the bound counted capacity that was not there).
pub const QUOTAS: [u32; 5] = [39, 26, 26, 13, 13];

const MIB: f64 = (1u64 << 20) as f64;

fn probe(exe: &Path, model: &Path) -> Result<u64> {
    probe_with(exe, model, false)
}

/// Peak RSS of `model` loaded and run once in a fresh process (`mapped`: as a worker loads a
/// stage file).
pub(crate) fn probe_with(exe: &Path, model: &Path, mapped: bool) -> Result<u64> {
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["pipeline", "probe-rss", "--model"]).arg(model);
    if mapped {
        cmd.arg("--mapped");
    }
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("probing {}", model.display()))?;
    if !out.status.success() {
        bail!("probe of {} failed", model.display());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("probe output")?;
    v.get("peak_rss_bytes").and_then(serde_json::Value::as_u64).context("probe output has no peak_rss_bytes")
}

/// Runs `stages` as a chain on `input` in this process and returns the last stage's outputs.
fn run_chain(
    stages: &[PathBuf],
    mapped: bool,
    input: &[troupe_kernels::onnx::NamedTensor],
) -> Result<Vec<troupe_kernels::onnx::NamedTensor>> {
    let mut carried = input.to_vec();
    for p in stages {
        let cfg = SessionConfig::default();
        let mut s =
            if mapped { OnnxSession::from_file_mapped(p, &cfg)? } else { OnnxSession::from_file(p, &cfg)? };
        let wanted: Vec<_> = s
            .inputs()
            .iter()
            .filter_map(|spec| carried.iter().chain(input.iter()).find(|t| t.name == spec.name).cloned())
            .collect();
        carried = s.run(&wanted)?;
    }
    Ok(carried)
}

/// Memory that shows the split: peak RSS, each in a fresh process, of the runtime's floor (the
/// setup cache's `tiny_mlp.onnx`, a 2-layer MLP of a few hundred bytes: what a session of
/// anything costs), the whole MiniLM model (loaded as the baseline loads it) and every stage of
/// K = 2, 3 and 4, cut by the Rust splitter (`--balance weights`) into a temp dir and loaded as
/// a worker loads a stage file (initializers memory-mapped). Per K,
/// `worker_rss_above_floor_over_whole_kK` = max over stages of (stage - floor) / (whole - floor),
/// beside its target 1.3/K; `_plain_` variants load the stages without mapping, `_mapped_whole_`
/// variants divide by the whole model loaded with mapping too (the fair contrast for mapping
/// alone). The mapped chains' outputs are checked against the whole model's here.
pub async fn memory_split(exe: &Path) -> Result<BTreeMap<String, f64>> {
    memory_split_of(exe, MemoryModel::MiniLm).await
}

/// The model [`memory_split_of`] cuts and probes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryModel {
    /// all-MiniLM-L6-v2 (90 MB of weights), from plain `scripts/setup`.
    MiniLm,
    /// all-mpnet-base-v2 (435 MB, ~4.8x), from `scripts/setup --large`; its input is the first
    /// sentence of `mpnet_check.json` (ids from the model's own tokenizer).
    Large,
}

impl std::str::FromStr for MemoryModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "minilm" => Ok(Self::MiniLm),
            "large" | "mpnet" => Ok(Self::Large),
            other => Err(format!("--model {other}: use minilm or large (all-mpnet-base-v2)")),
        }
    }
}

/// Largest `mpnet_check.json` read (it is ~150 KB).
const MAX_CHECK_BYTES: u64 = 16 << 20;

/// The first recorded input of `mpnet_check.json`: `input_ids` and `attention_mask` `[1, S]`.
fn large_model_input(path: &Path) -> Result<Vec<troupe_kernels::onnx::NamedTensor>> {
    use troupe_kernels::onnx::NamedTensor;
    let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
    if len > MAX_CHECK_BYTES {
        bail!("{}: {len} bytes, more than the {MAX_CHECK_BYTES} accepted", path.display());
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?;
    let first_row = |key: &str| -> Result<Vec<i64>> {
        let row = json[key].get(0).and_then(serde_json::Value::as_array);
        let row = row.with_context(|| format!("{}: no \"{key}\" rows", path.display()))?;
        row.iter()
            .map(|v| v.as_i64().with_context(|| format!("{}: \"{key}\" holds a non-integer", path.display())))
            .collect()
    };
    let (ids, mask) = (first_row("ids")?, first_row("attention_mask")?);
    if ids.is_empty() || ids.len() != mask.len() {
        bail!("{}: ids ({}) and attention_mask ({}) differ in length", path.display(), ids.len(), mask.len());
    }
    let shape = vec![1, ids.len()];
    Ok(vec![
        NamedTensor::i64("input_ids", shape.clone(), ids),
        NamedTensor::i64("attention_mask", shape, mask),
    ])
}

/// [`memory_split`] for the given model (same figure keys).
pub async fn memory_split_of(exe: &Path, which: MemoryModel) -> Result<BTreeMap<String, f64>> {
    use troupe_kernels::assets::{
        Assets, LARGE_SETUP_HINT, MINILM_WHOLE, MPNET_CHECK, MPNET_WHOLE, TINY_MLP,
    };
    use troupe_kernels::onnx::split::{CutPlan, Limits};
    let assets = Assets::locate()?;
    let floor_model = assets.path(TINY_MLP)?;
    let (whole, input, name) = match which {
        MemoryModel::MiniLm => {
            let sentence =
                "A man is eating a piece of bread while the sun sets over the quiet harbour.".to_string();
            let input =
                troupe::workloads::pipeline::tokenize(&[sentence])?.into_iter().next().unwrap_or_default();
            (assets.path(MINILM_WHOLE)?, input, "minilm")
        }
        MemoryModel::Large => {
            let hint = || format!("the large model: {LARGE_SETUP_HINT}");
            let check = assets.path(MPNET_CHECK).with_context(hint)?;
            (assets.path(MPNET_WHOLE).with_context(hint)?, large_model_input(&check)?, "mpnet")
        }
    };
    let tmp = tempfile::Builder::new()
        .prefix("troupe-memory-split-")
        .tempdir()
        .context("temp dir for the split")?;
    let mut f = BTreeMap::new();
    let floor = probe_with(exe, &floor_model, false)?;
    let whole_rss = probe_with(exe, &whole, false)?;
    // A link in the temp dir, so the mapped rewrite lands there and not in the setup cache.
    let link = tmp.path().join(format!("{name}_whole.onnx"));
    std::os::unix::fs::symlink(&whole, &link).context("linking the whole model")?;
    let whole_mapped = probe_with(exe, &link, true)?;
    f.insert("rss_floor_mb".into(), floor as f64 / MIB);
    f.insert("whole_model_rss_mb".into(), whole_rss as f64 / MIB);
    f.insert("whole_model_mapped_rss_mb".into(), whole_mapped as f64 / MIB);
    let above = |r: u64, of: u64| r.saturating_sub(floor) as f64 / of.saturating_sub(floor).max(1) as f64;
    let want = run_chain(std::slice::from_ref(&whole), false, &input)?;
    let mut worst_err = 0.0f32;
    println!("memory split of {} (peak RSS, fresh process each; floor = tiny_mlp.onnx):", whole.display());
    for k in [2usize, 3, 4] {
        let out = tmp.path().join(format!("k{k}"));
        let model = whole.clone();
        let done = tokio::task::spawn_blocking(move || {
            troupe::workloads::pipeline::split_to_dir(
                &model,
                &CutPlan::Balanced { stages: k },
                &out,
                &Limits::default(),
            )
        })
        .await??;
        let (mut worst, mut worst_plain) = (0u64, 0u64);
        for (i, s) in done.stages.iter().enumerate() {
            let mapped = probe_with(exe, s, true)?;
            let plain = probe_with(exe, s, false)?;
            f.insert(format!("k{k}_stage{i}_rss_mb"), mapped as f64 / MIB);
            f.insert(format!("k{k}_stage{i}_plain_rss_mb"), plain as f64 / MIB);
            worst = worst.max(mapped);
            worst_plain = worst_plain.max(plain);
        }
        let got = run_chain(&done.stages, true, &input)?;
        for (a, b) in got.iter().zip(&want) {
            if let (Some(a), Some(b)) = (a.as_f32(), b.as_f32()) {
                if a.len() != b.len() {
                    bail!(
                        "K={k}: mapped chain output {} has {} values, whole model {}",
                        a.len(),
                        a.len(),
                        b.len()
                    );
                }
                worst_err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(worst_err, f32::max);
            }
        }
        let r = above(worst, whole_rss);
        f.insert(format!("worker_rss_above_floor_over_whole_k{k}"), r);
        f.insert(format!("worker_rss_above_floor_over_whole_plain_k{k}"), above(worst_plain, whole_rss));
        f.insert(format!("worker_rss_above_floor_over_whole_mapped_whole_k{k}"), above(worst, whole_mapped));
        f.insert(format!("worker_rss_above_floor_target_k{k}"), 1.3 / k as f64);
        println!(
            "  K={k}: largest stage {:>6.1} MiB mapped ({:>6.1} plain); above floor / whole {r:.3} (target {:.3}, plain {:.3})",
            worst as f64 / MIB,
            worst_plain as f64 / MIB,
            1.3 / k as f64,
            above(worst_plain, whole_rss)
        );
    }
    println!(
        "  floor {:.1} MiB, whole {:.1} MiB (mapped {:.1} MiB)",
        floor as f64 / MIB,
        whole_rss as f64 / MIB,
        whole_mapped as f64 / MIB
    );
    f.insert("mapped_stage_chain_max_abs_error".into(), f64::from(worst_err));
    Ok(f)
}

/// Median ONNX Runtime time of each stage per input at full speed, measured in this process.
fn stage_times(stages: &[PathBuf], inputs: &[Vec<troupe_kernels::onnx::NamedTensor>]) -> Result<Vec<f64>> {
    let mut sessions = stages
        .iter()
        .map(|p| OnnxSession::from_file(p, &SessionConfig::default()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut times = vec![Vec::new(); sessions.len()];
    for (round, input) in inputs.iter().enumerate().take(8) {
        let mut carried = input.clone();
        for (k, s) in sessions.iter_mut().enumerate() {
            let wanted: Vec<_> = s
                .inputs()
                .iter()
                .filter_map(|spec| carried.iter().chain(input.iter()).find(|t| t.name == spec.name).cloned())
                .collect();
            let start = Instant::now();
            let out = s.run(&wanted)?;
            if round > 0 {
                times[k].push(start.elapsed().as_secs_f64());
            }
            carried = out;
        }
    }
    Ok(times.into_iter().map(|t| median(&t)).collect())
}

fn median(v: &[f64]) -> f64 {
    troupe_policy::stats::median(&mut v.to_vec())
}

/// (max - min) / median of the runs' makespans.
fn spread(runs: &[JobOutcome]) -> f64 {
    let m: Vec<f64> = runs.iter().map(|o| o.makespan_s).collect();
    let (lo, hi) = (m.iter().copied().fold(f64::INFINITY, f64::min), m.iter().copied().fold(0.0, f64::max));
    (hi - lo) / median(&m).max(1e-9)
}

/// The run with the median makespan.
fn take_median(mut runs: Vec<JobOutcome>) -> JobOutcome {
    runs.sort_by(|a, b| a.makespan_s.total_cmp(&b.makespan_s));
    let mid = runs.len() / 2;
    runs.swap_remove(mid)
}

/// The bound behind `streaming_over_ideal_with_loads*`, printed with the figures.
pub const BOUND_WITH_LOADS: &str = "ideal bound with loads (troupe_policy::pipeline::sim::\
ideal_pipeline_bound_with_loads): T >= max(L_0 + sum_k t_k / s_max, min_{m=1..W} max(L_min + \
N sum_k t_k / S_m, (sum_k w_k + N sum_k t_k / s_max) / m)); t_k stage compute at full speed, s_w \
the quotas as speeds, S_m the sum of the m largest, L_k the cheapest load of stage k (here warm: \
every worker has the files after the cold run), L_min = min_k L_k, w_k the warm load of k: every \
worker used loads at least one stage before it computes, every stage is loaded at least once";

/// One-input jobs run back to back for `task_overhead_ms` (the first one's tasks are not counted).
const ISOLATED_JOBS: usize = 21;

/// What `task_overhead_*` mean, printed with the figures.
pub const OVERHEAD_DOC: &str = "task overhead = the foreman's Run span (request sent to outputs \
in hand) minus the ONNX Runtime time the worker reports, mean over tasks. \
task_overhead_ms: the runtime's own cost per task on loopback: workers at full speed (no quota), \
one-input jobs back to back (each stage on a worker that holds it), so one task is in flight and \
none waits for a core another task holds. task_overhead_loaded_ms: a whole streaming job at full \
speed, five worker processes on this host's cores, so run-queue waits land in it. \
task_overhead_ms_under_quota: the streaming run under the CPU quotas (CFS period cfs_period_ms), \
where the worker's share of it runs at its quota and throttling stalls land in it. Breakdown \
(of either): _worker_request_ms reading the request, _worker_inputs_ms pulling and decoding the \
inputs, _worker_encode_ms encoding the outputs onto the worker's shelf, _worker_other_ms the rest \
of the worker's handling (hand-off to the compute thread), _transport_ms the call minus the \
worker's handling (both serialisations, QUIC, the service router, the mailbox), _foreman_ms the \
span outside the call (reading the answer's references or pulling a last stage's outputs)";

/// Mean of Run span minus compute over tasks, seconds.
fn overhead_s(t: &[troupe_actors::pipeline::TaskTimes]) -> f64 {
    mean(&t.iter().map(|t| (t.span_s - t.compute_s).max(0.0)).collect::<Vec<_>>())
}

/// `prefix_ms` (the mean overhead), its median and its parts, ms, from tasks' times.
fn overhead_breakdown(t: &[troupe_actors::pipeline::TaskTimes], prefix: &str) -> Vec<(String, f64)> {
    let m = |f: &dyn Fn(&troupe_actors::pipeline::TaskTimes) -> f64| {
        mean(&t.iter().map(f).collect::<Vec<_>>()) * 1e3
    };
    let us = |v: u64| v as f64 / 1e6;
    let all: Vec<f64> = t.iter().map(|t| (t.span_s - t.compute_s).max(0.0)).collect();
    vec![
        (format!("{prefix}_ms"), overhead_s(t) * 1e3),
        (format!("{prefix}_median_ms"), median(&all) * 1e3),
        (format!("{prefix}_worker_request_ms"), m(&|t| us(t.reported.request_micros))),
        (format!("{prefix}_worker_inputs_ms"), m(&|t| us(t.reported.inputs_micros))),
        (format!("{prefix}_worker_encode_ms"), m(&|t| us(t.reported.encode_micros))),
        (
            format!("{prefix}_worker_other_ms"),
            m(&|t| {
                let r = &t.reported;
                (us(r.handled_micros)
                    - us(r.request_micros)
                    - us(r.inputs_micros)
                    - us(r.encode_micros)
                    - t.compute_s)
                    .max(0.0)
            }),
        ),
        (format!("{prefix}_transport_ms"), m(&|t| (t.call_s - us(t.reported.handled_micros)).max(0.0))),
        (format!("{prefix}_foreman_ms"), m(&|t| (t.span_s - t.call_s).max(0.0))),
        (format!("{prefix}_tasks"), t.len() as f64),
    ]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// Runs `job` on the cluster starting from the costs the jobs before it learned (the crowd
/// outlives its jobs: `ForemanConfig::remember_costs`), and keeps what this one learned.
async fn run_remembering(
    cluster: &LocalCluster,
    job: PipelineJob,
    mut settings: ShellSettings,
    memory: &mut Option<CostModel>,
) -> Result<JobOutcome> {
    settings.prior_costs = memory.clone();
    let o = cluster.run(job, settings, None).await?;
    if o.learned_costs.is_some() {
        memory.clone_from(&o.learned_costs);
    }
    Ok(o)
}

/// Per tier (1-4), how many claims of the job it served: its `assign ... (Tn)` log lines.
fn tier_counts(o: &JobOutcome) -> [usize; 4] {
    let mut n = [0; 4];
    for line in &o.log {
        if line.contains("] assign ") {
            for (t, slot) in n.iter_mut().enumerate() {
                if line.ends_with(&format!("(T{})", t + 1)) {
                    *slot += 1;
                }
            }
        }
    }
    n
}

/// Runs the benchmark; writes the SVG to `svg`.
pub async fn run(
    workdir: &Path,
    svg: &Path,
    inputs: usize,
    batch: usize,
    repeats: usize,
    memory_split_figures: bool,
    large_case: bool,
) -> Result<BTreeMap<String, f64>> {
    let exe = std::env::current_exe()?;
    let stages = minilm_stages()?;
    let whole = troupe_kernels::assets::Assets::locate()?.path(troupe_kernels::assets::MINILM_WHOLE)?;
    let sentences = sentences();
    let mut f = BTreeMap::new();
    let mut put = |k: &str, v: f64| {
        f.insert(k.to_string(), v);
    };

    // RSS of the whole model and of each stage, each in a fresh process.
    if memory_split_figures {
        for (k, v) in memory_split(&exe).await? {
            put(&k, v);
        }
        for (k, v) in crate::pipeline_memory::large_case(&exe, workdir).await? {
            put(&k, v);
        }
    }
    let whole_rss = probe(&exe, &whole)?;
    let mut stage_rss = Vec::new();
    for (k, s) in stages.iter().enumerate() {
        let r = probe(&exe, s)?;
        put(&format!("stage{k}_rss_mb"), r as f64 / MIB);
        stage_rss.push(r);
    }
    let largest_stage_rss = stage_rss.iter().copied().max().unwrap_or(1).max(1);

    let job_inputs = tokenize_batches(&sentences, inputs, batch)?;
    let t_k = stage_times(&stages, &job_inputs)?;
    for (k, t) in t_k.iter().enumerate() {
        put(&format!("stage{k}_compute_ms"), t * 1e3);
    }
    let files = stages.iter().map(|p| StageFile::from_path(p)).collect::<Result<Vec<_>, _>>()?;
    let job = |mode: Mode, bf16: bool| build_job(files.clone(), job_inputs.clone(), mode, bf16);
    // The paper's setting, N = W: one input per worker.
    let n_eq_w = QUOTAS.len();
    let small_inputs = tokenize_batches(&sentences, n_eq_w, batch)?;
    let job_n_eq_w = |mode: Mode| build_job(files.clone(), small_inputs.clone(), mode, false);
    let streaming_chain = job(Mode::Streaming, false)?.chain;
    // The curve's job sizes other than N = W and N = `inputs` (run in the main loop).
    let curve_sizes: Vec<usize> =
        curve::MULTIPLES.iter().map(|m| m * n_eq_w).filter(|&n| n != n_eq_w && n != inputs).collect();
    let curve_inputs = curve_sizes
        .iter()
        .map(|&n| tokenize_batches(&sentences, n, batch).map(|v| (n, v)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    let job_of_size = |mode: Mode, n: usize| -> Result<PipelineJob> {
        let v = curve_inputs.get(&n).context("a curve size without inputs")?;
        Ok(build_job(files.clone(), v.clone(), mode, false)?)
    };
    let cpu_costs = curve::measure_cpu_costs(&stages, &job_inputs)?;

    let _ = std::fs::remove_dir_all(workdir.join("cache"));
    let specs = crowd::worker_specs("phone", &QUOTAS, workdir);
    let cluster = LocalCluster::start(&exe, workdir, &specs).await?;
    let meters = curve::Meters::attach(&cluster, &QUOTAS);
    let settings = crowd::settings(specs.len(), Duration::from_secs(60));
    // Ablation settings (item 8): eager stage loads under the stage plan; residency across jobs
    // (the workers keep their live stage: no unload before the job).
    let eager =
        ShellSettings { policy: ForemanConfig { eager_loads: true, ..settings.policy }, ..settings.clone() };
    let resident = ShellSettings { fresh_start: false, ..eager.clone() };
    let mut memory: Option<CostModel> = None;
    let result = async {
        let cold =
            run_remembering(&cluster, job(Mode::Streaming, false)?, settings.clone(), &mut memory).await?;
        // A streaming job need not make every worker load every stage; a barrier one does. Run
        // one (not measured) so each worker has each stage file on disk before the measured
        // runs: otherwise the first streaming run alone pays cold pulls that barrier never sees.
        run_remembering(&cluster, job(Mode::Barrier, false)?, settings.clone(), &mut memory).await?;
        let filled = crowd::fill_caches(&specs, &files)?;
        println!("warm caches: the bench put {filled} stage files the first two jobs had not sent");
        // The cold runs' peak includes the stage-file pull buffers; the warm runs show what
        // residency alone costs.
        let cold_peaks = cluster.peak_rss();
        let reset = cluster.reset_peak_rss();
        // Alternate the modes so both see the same drift in machine load; keep the median run.
        // Both job sizes alternate too (N = `inputs`, then N = W), in one loop.
        let mut runs_s = Vec::new();
        let mut runs_b = Vec::new();
        let mut small_s = Vec::new();
        let mut small_b = Vec::new();
        let mut runs_eager = Vec::new();
        let mut runs_resident = Vec::new();
        let mut small_eager = Vec::new();
        // Every streaming and barrier run of the curve, metered, by (N, streaming).
        let mut curve_runs: BTreeMap<(usize, bool), Vec<curve::Metered>> = BTreeMap::new();
        let bar = troupe::progress::bar(repeats.max(1) as u64, "bench pipeline repeats");
        for _ in 0..repeats.max(1) {
            bar.inc(1);
            let m = &mut memory;
            let mut metered =
                async |n: usize, streaming: bool, job: PipelineJob, m: &mut Option<CostModel>| {
                    let r = curve::run_metered(&cluster, &meters, job, settings.clone(), m).await?;
                    let o = r.outcome.clone();
                    curve_runs.entry((n, streaming)).or_default().push(r);
                    anyhow::Ok(o)
                };
            runs_s.push(metered(inputs, true, job(Mode::Streaming, false)?, m).await?);
            runs_b.push(metered(inputs, false, job(Mode::Barrier, false)?, m).await?);
            small_s.push(metered(n_eq_w, true, job_n_eq_w(Mode::Streaming)?, m).await?);
            small_b.push(metered(n_eq_w, false, job_n_eq_w(Mode::Barrier)?, m).await?);
            for &n in &curve_sizes {
                metered(n, true, job_of_size(Mode::Streaming, n)?, m).await?;
                metered(n, false, job_of_size(Mode::Barrier, n)?, m).await?;
            }
            small_eager
                .push(run_remembering(&cluster, job_n_eq_w(Mode::Streaming)?, eager.clone(), m).await?);
            runs_eager.push(run_remembering(&cluster, job(Mode::Streaming, false)?, eager.clone(), m).await?);
            // right after an eager streaming job: the workers still hold the stages it left live
            runs_resident
                .push(run_remembering(&cluster, job(Mode::Streaming, false)?, resident.clone(), m).await?);
        }
        bar.finish_and_clear();
        let spreads = [spread(&runs_s), spread(&runs_b), spread(&small_s), spread(&small_b)];
        let streaming = take_median(runs_s);
        let barrier = take_median(runs_b);
        let small = (take_median(small_s).makespan_s, take_median(small_b).makespan_s);
        let ablations = (take_median(runs_eager), take_median(runs_resident), take_median(small_eager));
        let bf16 =
            run_remembering(&cluster, job(Mode::Streaming, true)?, settings.clone(), &mut memory).await?;
        anyhow::Ok((cold, cold_peaks, reset, streaming, barrier, bf16, spreads, small, ablations, curve_runs))
    }
    .await;
    let peaks = cluster.peak_rss();
    let quotas_by_pid = meters.quotas();
    let (from_cgroups, cpu_sources) = meters.describe();
    cluster.shutdown().await;
    meters.release();
    let (
        cold,
        cold_peaks,
        reset,
        streaming,
        barrier,
        bf16,
        spreads,
        (small_s, small_b),
        ablations,
        curve_runs,
    ) = result?;
    // The runtime's own overhead per task, measured with the same workers at full speed (no
    // quota: worker-side encode, decode and pulls are not multiplied by 1/quota), their disk
    // caches warm from the runs above.
    let full_specs = crowd::full_speed(&specs);
    let full_dir = workdir.join("full-speed");
    let full = LocalCluster::start(&exe, &full_dir, &full_specs).await?;
    let full_result = async {
        // the first run loads the sessions; the second is measured
        full.run(job(Mode::Streaming, false)?, settings.clone(), None).await?;
        let loaded = full.run(job(Mode::Streaming, false)?, settings.clone(), None).await?;
        // one input per job: one task in flight, so no task waits for a core another holds
        let resident = ShellSettings { fresh_start: false, ..settings.clone() };
        let mut isolated = Vec::new();
        for (i, input) in tokenize_batches(&sentences, ISOLATED_JOBS, batch)?.into_iter().enumerate() {
            let o = full
                .run(build_job(files.clone(), vec![input], Mode::Streaming, false)?, resident.clone(), None)
                .await?;
            // the first job may load sessions; its tasks wait on them
            if i > 0 {
                isolated.extend(o.task_times);
            }
        }
        let inputs_for_runtime = tokenize_batches(&sentences, ISOLATED_JOBS, batch)?;
        let runtime =
            curve::measure_runtime_cpu(&full, &[100; 5], &files, &inputs_for_runtime, &settings).await?;
        anyhow::Ok((loaded, isolated, runtime))
    }
    .await;
    full.shutdown().await;
    let (full_speed, isolated, runtime_cpu) = full_result?;
    // The curve (issue 44, item 1): streaming, barrier and B* at N = W, 2W, 5W, 10W.
    let mut quota_use = (f64::INFINITY, f64::INFINITY);
    for r in curve_runs.values().flatten() {
        let u = curve::quota_use(r, &quotas_by_pid);
        quota_use = (quota_use.0.min(u.0), quota_use.1.min(u.1));
    }
    let mut curve_runs = curve_runs;
    let points: Vec<curve::Point> = curve_runs
        .keys()
        .map(|k| k.0)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .filter_map(|n| {
            let s = curve_runs.remove(&(n, true))?;
            let b = curve_runs.remove(&(n, false))?;
            Some(curve::Point {
                n,
                streaming: curve::take_median_metered(s),
                barrier: curve::take_median_metered(b),
            })
        })
        .collect();
    let curve_setup = curve::CurveSetup {
        prefix: "",
        quotas: &QUOTAS,
        costs: &cpu_costs,
        runtime: runtime_cpu,
        pulls_s: curve::pulls(&cold, stages.len()),
        chain: streaming_chain.clone(),
        cores: std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        quota_use,
        from_cgroups,
    };
    let (curve_keys, curve_lines) = curve::curve_figures(&curve_setup, &points);
    for (k, v) in curve_keys {
        put(&k, v);
    }
    for l in curve_lines {
        println!("{l}");
    }
    println!("  workers' CPU read from: {}", cpu_sources.join("; "));
    if large_case {
        // the second case failing does not take the first case's figures with it
        match curve::large_case(&exe, &workdir.join("large"), repeats).await {
            Ok(Some(large)) => {
                for (k, v) in large {
                    put(&k, v);
                }
                put("large_case_ran", 1.0);
            }
            Ok(None) => put("large_case_ran", 0.0),
            Err(e) => {
                println!("large case FAILED (its figures are left out): {e:#}");
                put("large_case_ran", 0.0);
            }
        }
    } else {
        println!("large case skipped (--no-large)");
        put("large_case_ran", 0.0);
    }
    let (eager_run, resident_run, small_eager_run) = ablations;
    // Item 8, ablations (medians of `repeats` real runs each, alternated with the main runs).
    put("ablation_streaming_jit_s", streaming.makespan_s);
    put("ablation_streaming_eager_s", eager_run.makespan_s);
    put("ablation_eager_speedup_over_jit", streaming.makespan_s / eager_run.makespan_s);
    put("ablation_streaming_eager_speedup_over_barrier", barrier.makespan_s / eager_run.makespan_s);
    put("ablation_streaming_eager_s_n_eq_w", small_eager_run.makespan_s);
    put("ablation_streaming_eager_speedup_over_barrier_n_eq_w", small_b / small_eager_run.makespan_s);
    put("ablation_streaming_resident_s", resident_run.makespan_s);
    put("ablation_residency_speedup_over_fresh", eager_run.makespan_s / resident_run.makespan_s);
    put("ablation_streaming_resident_speedup_over_barrier", barrier.makespan_s / resident_run.makespan_s);
    for (name, o) in
        [("streaming", &streaming), ("barrier", &barrier), ("eager", &eager_run), ("resident", &resident_run)]
    {
        let tiers = tier_counts(o);
        for (t, n) in tiers.iter().enumerate() {
            put(&format!("ablation_{name}_claims_tier{}", t + 1), *n as f64);
        }
        for (i, w) in o.workers.iter().enumerate() {
            put(&format!("ablation_{name}_tasks_worker{}", i + 1), w.tasks as f64);
        }
        let loads = o.spans.iter().filter(|s| matches!(s.kind, SpanKind::Load { .. })).count();
        put(&format!("ablation_{name}_loads"), loads as f64);
        for &(w, k) in &o.stage_plan {
            put(&format!("ablation_{name}_home_stage_worker{}", w + 1), k as f64);
        }
    }
    put("streaming_runs_spread", spreads[0]);
    put("barrier_runs_spread", spreads[1]);
    put("streaming_runs_spread_n_eq_w", spreads[2]);
    put("barrier_runs_spread_n_eq_w", spreads[3]);
    put("inputs_n_eq_w", n_eq_w as f64);
    put("streaming_s_n_eq_w", small_s);
    put("barrier_s_n_eq_w", small_b);
    put("streaming_speedup_over_barrier_n_eq_w", small_b / small_s);
    put("repeats", repeats.max(1) as f64);

    let cold_peak = cold_peaks.iter().filter_map(|(_, p)| *p).max().unwrap_or(0);
    put("worker_peak_rss_mb_max_cold_run", cold_peak as f64 / MIB);
    put("worker_peak_rss_reset_after_cold_run", if reset == specs.len() { 1.0 } else { 0.0 });
    let worker_peak = peaks.iter().filter_map(|(_, p)| *p).max().unwrap_or(0);
    put("worker_peak_rss_mb_max", worker_peak as f64 / MIB);
    put("worker_peak_rss_over_stage_rss", worker_peak as f64 / largest_stage_rss as f64);
    put("worker_peak_rss_over_whole_model_rss", worker_peak as f64 / whole_rss.max(1) as f64);
    let max_live = [&cold, &streaming, &barrier, &bf16]
        .iter()
        .flat_map(|o| o.workers.iter().filter_map(|w| w.stats.map(|s| s.max_live_sessions)))
        .max()
        .unwrap_or(0);
    put("worker_max_live_sessions", f64::from(max_live));
    // each worker's idle floor and its peak over the cold run against its largest stage
    for (k, v) in crate::pipeline_memory::worker_figures("", &cold) {
        put(&k, v);
    }

    let streaming_makespan_s = streaming.makespan_s;
    let barrier_makespan_s = barrier.makespan_s;
    put("streaming_s", streaming.makespan_s);
    put("barrier_s", barrier.makespan_s);
    put("streaming_over_barrier", streaming.makespan_s / barrier.makespan_s);
    put("streaming_speedup_over_barrier", barrier.makespan_s / streaming.makespan_s);
    let costs: Vec<StageCost> = t_k
        .iter()
        .map(|t| StageCost { compute: Micros((t * 1e6) as u64), download: Micros(0), warm_load: Micros(0) })
        .collect();
    let speeds: Vec<f64> = QUOTAS.iter().map(|&q| f64::from(q) / 100.0).collect();
    let ideal = ideal_pipeline_bound(&costs, &speeds, inputs).0 as f64 / 1e6;
    put("ideal_pipeline_bound_s", ideal);
    put("streaming_over_ideal", streaming.makespan_s / ideal);
    put("barrier_over_ideal", barrier.makespan_s / ideal);
    put("cold_streaming_s", cold.makespan_s);

    let loads = |o: &JobOutcome, cold_wanted: bool| -> Vec<f64> {
        o.spans
            .iter()
            .filter_map(|s| match s.kind {
                SpanKind::Load { stage: 0, cold, .. } if cold == cold_wanted => Some(s.end - s.start),
                _ => None,
            })
            .collect()
    };
    let pulls: Vec<f64> =
        cold.spans.iter().filter(|s| s.kind == SpanKind::Fetch(0)).map(|s| s.end - s.start).collect();
    let cold_load = mean(&pulls) + mean(&loads(&cold, true));
    let mut warm: Vec<f64> = loads(&streaming, false);
    warm.extend(loads(&barrier, false));
    let warm_load = mean(&warm);
    put("cold_load_stage0_ms", cold_load * 1e3);
    put("warm_load_stage0_ms", warm_load * 1e3);
    put("cold_over_warm_load", if warm_load > 0.0 { cold_load / warm_load } else { f64::NAN });

    let ratio =
        |o: &JobOutcome| if o.tally.raw > 0 { o.tally.wire as f64 / o.tally.raw as f64 } else { f64::NAN };
    put("wire_over_raw_lossless", ratio(&streaming));
    put("wire_over_raw_bf16", ratio(&bf16));
    put("bf16_max_abs_error_activations", f64::from(bf16.tally.max_abs_error));
    put("lossless_max_abs_error_activations", f64::from(streaming.tally.max_abs_error));
    let mut out_err = 0.0f32;
    for (a, b) in bf16.outputs.iter().zip(&streaming.outputs) {
        if let (Some(a), Some(b)) = (final_vector(a), final_vector(b)) {
            out_err = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(out_err, f32::max);
        }
    }
    put("bf16_max_abs_error_embeddings", f64::from(out_err));
    put("inputs", inputs as f64);
    put("sentences_per_input", batch as f64);

    // The policy's prediction from the measured costs.
    let per_stage = |o: &[&JobOutcome], f: &dyn Fn(&SpanKind) -> Option<usize>| -> Vec<f64> {
        (0..t_k.len())
            .map(|k| {
                let v: Vec<f64> = o
                    .iter()
                    .flat_map(|o| o.spans.iter())
                    .filter(|s| f(&s.kind) == Some(k))
                    .map(|s| s.end - s.start)
                    .collect();
                mean(&v)
            })
            .collect()
    };
    let warm_k = per_stage(&[&streaming, &barrier], &|k| match k {
        SpanKind::Load { stage, cold: false, .. } => Some(*stage),
        _ => None,
    });
    let pull_k = per_stage(&[&cold], &|k| match k {
        SpanKind::Fetch(stage) => Some(*stage),
        _ => None,
    });
    for (k, w) in warm_k.iter().enumerate() {
        put(&format!("warm_load_stage{k}_wall_ms"), w * 1e3);
    }
    // Under the quotas: what the policy's simulation is given as the per-task hop.
    let hop = overhead_s(&streaming.task_times);
    put("task_overhead_ms_under_quota", hop * 1e3);
    for (k, v) in overhead_breakdown(&isolated, "task_overhead") {
        put(&k, v);
    }
    for (k, v) in overhead_breakdown(&full_speed.task_times, "task_overhead_loaded") {
        put(&k, v);
    }
    put("full_speed_streaming_s", full_speed.makespan_s);
    let a = streaming.activations;
    put("foreman_share_of_activation_bytes", a.foreman_share());
    put("activation_bytes_via_foreman", a.via_foreman as f64);
    put("activation_bytes_worker_to_worker", a.worker_to_worker as f64);
    put("activation_bytes_same_worker", a.same_worker as f64);
    put("output_bytes_to_foreman", a.outputs_to_foreman as f64);
    put("cfs_period_ms", CFS_PERIOD_US as f64 / 1e3);
    println!("{OVERHEAD_DOC}");
    println!(
        "activations (streaming run under quota, counted as they moved): {} B worker to worker, {} B \
         through the foreman (share {:.4}), {} B stayed on the worker that made them; {} B of answers \
         to the foreman",
        a.worker_to_worker,
        a.via_foreman,
        a.foreman_share(),
        a.same_worker,
        a.outputs_to_foreman
    );
    let us = |s: f64| Micros((s * 1e6) as u64);
    let sim_costs: Vec<StageCost> = (0..t_k.len())
        .map(|k| StageCost { compute: us(t_k[k]), download: us(pull_k[k]), warm_load: us(warm_k[k]) })
        .collect();
    let quota_cpus: Vec<f64> = QUOTAS.iter().map(|&q| f64::from(q) / 100.0).collect();
    let sim_workers = crowd::sim_workers(&quota_cpus, t_k.len());
    // the bound that also counts one (warm) load per stage for each worker it uses
    // (`ideal_pipeline_bound_with_loads`: formula in troupe_policy::pipeline::sim)
    let with_loads = ideal_pipeline_bound_with_loads(&sim_costs, &sim_workers, inputs).0 as f64 / 1e6;
    put("ideal_pipeline_bound_with_loads_s", with_loads);
    put("streaming_over_ideal_with_loads", streaming_makespan_s / with_loads.max(1e-9));
    // the most streaming could gain over this barrier run: a schedule at the bound itself
    put("barrier_over_ideal_with_loads", barrier_makespan_s / with_loads.max(1e-9));
    let with_loads_small = ideal_pipeline_bound_with_loads(&sim_costs, &sim_workers, n_eq_w).0 as f64 / 1e6;
    put("ideal_pipeline_bound_with_loads_s_n_eq_w", with_loads_small);
    put("streaming_over_ideal_with_loads_n_eq_w", small_s / with_loads_small.max(1e-9));
    println!("{BOUND_WITH_LOADS}");
    // the second of two jobs on one foreman, as the bench runs (costs remembered)
    let sim_with = |mode: Mode, inputs: usize, foreman: ForemanConfig| -> f64 {
        let setup = SimSetup {
            chain: streaming_chain.clone(),
            costs: sim_costs.clone(),
            workers: sim_workers.clone(),
            inputs,
            mode,
            // the measured overhead is paid by every task (transfer included), local or not
            hop: Micros::ZERO,
            task_overhead: us(hop),
            loads_are_cpu: false,
            crashes: Vec::new(),
            deliver_late_completions: false,
            foreman,
        };
        simulate_on(&setup, Foreman::new(foreman))
            .and_then(|(_, f)| simulate_on(&setup, f))
            .ok()
            .and_then(|(r, _)| r.makespan)
            .map_or(f64::NAN, |m| m.0 as f64 / 1e6)
    };
    let sim = |mode: Mode, inputs: usize| sim_with(mode, inputs, ForemanConfig::default());
    let sim_eager =
        sim_with(Mode::Streaming, inputs, ForemanConfig { eager_loads: true, ..ForemanConfig::default() });
    let (sim_s, sim_b) = (sim(Mode::Streaming, inputs), sim(Mode::Barrier, inputs));
    put("sim_streaming_s", sim_s);
    put("sim_barrier_s", sim_b);
    put("sim_streaming_speedup_over_barrier", sim_b / sim_s);
    put("sim_streaming_eager_s", sim_eager);
    put("sim_streaming_eager_speedup_over_barrier", sim_b / sim_eager);
    let (sim_s, sim_b) = (sim(Mode::Streaming, n_eq_w), sim(Mode::Barrier, n_eq_w));
    put("sim_streaming_speedup_over_barrier_n_eq_w", sim_b / sim_s);

    let stragglers: Vec<String> =
        streaming.workers.iter().map(|w| format!("{}: {}", w.node, w.straggler)).collect();
    println!("workers (streaming run):");
    for (w, (_, peak)) in streaming.workers.iter().zip(&peaks) {
        println!(
            "  {:<8} tasks {:>3}  peak RSS {:>6.1} MiB  {}",
            w.node,
            w.tasks,
            peak.unwrap_or(0) as f64 / MIB,
            w.straggler
        );
    }
    write_gantt(svg, &[("streaming", &streaming), ("barrier", &barrier)], &stragglers)?;
    println!("Gantt chart written to {}", svg.display());
    Ok(f)
}

/// The Gantt chart ([`troupe::chart::BarChart`]): one group per run, one row per worker, a bar
/// per task (coloured by stage), session load (grey) and stage file pull (black).
pub fn write_gantt(path: &Path, runs: &[(&str, &JobOutcome)], notes: &[String]) -> Result<()> {
    let t_max = runs.iter().map(|(_, o)| o.makespan_s).fold(0.0f64, f64::max).max(1e-3);
    let group = |(name, o): &(&str, &JobOutcome)| {
        let rows = o.workers.iter().enumerate().map(|(w, worker)| BarRow {
            name: worker.node.clone(),
            bars: o.spans.iter().filter(|s| s.worker == w).map(span_bar).collect(),
        });
        BarGroup { title: format!("{name}: {:.3} s", o.makespan_s), rows: rows.collect() }
    };
    let chart = BarChart {
        title: "troupe bench pipeline: tasks per worker (colour = stage; grey = session load; black = stage file pull)"
            .into(),
        legend: Vec::new(),
        x_range: (0.0, t_max),
        x_ticks: (0..=4).map(|k| t_max * f64::from(k) / 4.0).map(|t| (t, format!("{t:.2} s"))).collect(),
        groups: runs.iter().map(group).collect(),
        notes: notes.to_vec(),
    };
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(path, chart.render()).with_context(|| format!("writing {}", path.display()))
}

/// One span's bar: its time on the axis, a colour for its kind, and a tooltip saying what and when.
fn span_bar(s: &Span) -> Bar {
    let (fill, label) = match s.kind {
        SpanKind::Run(t) => (COLOURS[t.stage % COLOURS.len()], format!("{t}")),
        SpanKind::Load { stage, cold, .. } => {
            ("#bbbbbb", format!("load s{stage}{}", if cold { " (cold)" } else { "" }))
        }
        SpanKind::Fetch(stage) => ("#333333", format!("pull s{stage}")),
    };
    let tooltip = format!("{label}: {:.1}-{:.1} ms", s.start * 1e3, s.end * 1e3);
    Bar { start: s.start, end: s.end, fill: fill.into(), label: String::new(), tooltip }
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe_actors::pipeline::WorkerSummary;
    use troupe_policy::pipeline::TaskId;

    #[test]
    fn gantt_has_one_bar_per_span_in_each_panel() {
        let worker = |n: &str| WorkerSummary { node: n.into(), ..WorkerSummary::default() };
        let run = JobOutcome {
            makespan_s: 2.0,
            workers: vec![worker("a"), worker("b")],
            spans: vec![
                Span { worker: 0, kind: SpanKind::Fetch(0), start: 0.0, end: 0.5 },
                Span {
                    worker: 0,
                    kind: SpanKind::Load { stage: 0, cold: true, cpu_micros: 0 },
                    start: 0.5,
                    end: 1.0,
                },
                Span { worker: 1, kind: SpanKind::Run(TaskId::new(3, 1)), start: 1.0, end: 2.0 },
            ],
            ..JobOutcome::default()
        };
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("g.svg");
        write_gantt(&p, &[("streaming", &run), ("barrier", &run)], &["a <note>".into()]).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert_eq!(svg.matches("<rect ").count(), 1 + 2 * 3, "background plus 3 bars per panel");
        assert!(svg.contains("i3/s1") && svg.contains("load s0 (cold)") && svg.contains("pull s0"));
        assert!(svg.contains("a &lt;note&gt;"));
        // The run bar spans half the width: from t = 1 s to t = 2 s of a 2 s axis.
        assert!(svg.contains("x=\"560.00\"") && svg.contains("width=\"450.00\""), "{svg}");
    }

    #[test]
    fn median_run_and_spread() {
        let run = |m: f64| JobOutcome { makespan_s: m, ..JobOutcome::default() };
        let runs = vec![run(3.0), run(1.0), run(2.0)];
        assert!((spread(&runs) - 1.0).abs() < 1e-12);
        assert_eq!(take_median(runs).makespan_s, 2.0);
    }
}
