//! The `pipeline` workload (CROWDio): `pipeline-worker` actors (one per node: a phone-class stage
//! runner with a RAM budget, a CPU quota and a simulated battery) and the `pipeline` job, whose
//! node is the foreman. Also `troupe pipeline submit` (a local foreman plus worker processes),
//! `troupe pipeline split` (cuts one model into checked stage files, see [`split_to_dir`]) and
//! `troupe pipeline probe-rss` (peak RSS of one model in a fresh process).
//!
//! Inputs file format: UTF-8 text, one sentence per line; blank lines and lines starting with `#`
//! are skipped. Each sentence is one job input, tokenised with the project's WordPiece tokenizer
//! into `input_ids` and `attention_mask` (i64 `[1, S]`, at most 256 tokens). At most
//! [`MAX_SENTENCES`] sentences and [`MAX_INPUTS_FILE_BYTES`] bytes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use clap::Subcommand;
use serde::Deserialize;
use troupe_actors::NodeRuntime;
use troupe_actors::pipeline::telemetry::DeviceModel;
use troupe_actors::pipeline::{
    AcceptedJob, BlobShelf, JobOutcome, PipelineJob, PipelineWorker, ShellSettings, StageFile,
    WorkerSettings, build_job, run_pipeline_job, worker_name,
};
use troupe_actors::supervisor::ChildSpec;
use troupe_kernels::assets::{self, Assets};
use troupe_kernels::onnx::split::{self, CutPlan, Limits};
use troupe_kernels::onnx::{NamedTensor, cosine, proto};
use troupe_kernels::tokenizer::WordPiece;
use troupe_policy::pipeline::Mode;
use troupe_policy::pipeline::chain::{Chain, DType, TensorSig, check_chain};

use super::NodeContext;
use crate::config::{ActorConfig, JobConfig};

pub mod local;
pub mod memory;

/// Most sentences an inputs file may hold.
pub const MAX_SENTENCES: usize = 4096;
/// Largest inputs file read.
pub const MAX_INPUTS_FILE_BYTES: u64 = 4 << 20;

/// `params` of a `pipeline-worker` actor.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkerParams {
    /// RAM budget for stage sessions, MiB.
    #[serde(default = "default_budget")]
    pub ram_budget_mb: u64,
    /// Enforce the budget with a cgroup memory limit, v2 or v1 (going over it gets the worker killed by
    /// the OS, and the foreman re-plans its tasks); otherwise it only steers scheduling.
    #[serde(default)]
    pub enforce_ram_budget: bool,
    /// CPU speed in percent of one CPU: a cgroup v2 or v1 quota where available, else pacing.
    #[serde(default = "default_quota")]
    pub cpu_quota_pct: u32,
    /// Simulated battery at start, percent.
    #[serde(default = "default_battery")]
    pub battery_pct: f64,
    /// Simulated temperature at rest, Celsius.
    #[serde(default = "default_ambient")]
    pub ambient_c: f64,
    /// Disk cache of stage files (default `.cache/pipeline/<node>`).
    #[serde(default)]
    pub cache_dir: Option<PathBuf>,
    /// ONNX Runtime intra-op threads.
    #[serde(default = "default_threads")]
    pub intra_threads: usize,
}

fn default_budget() -> u64 {
    512
}
fn default_quota() -> u32 {
    100
}
fn default_battery() -> f64 {
    90.0
}
fn default_ambient() -> f64 {
    30.0
}
fn default_threads() -> usize {
    1
}

/// `params` of a `pipeline-foreman` actor: a long-lived foreman taking jobs from clients
/// (`troupe pipeline submit --foreman ADDR`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ForemanParams {
    /// Workers each job waits for.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// How long a job waits for them, seconds.
    #[serde(default = "default_join_timeout")]
    pub join_timeout_s: u64,
    /// Telemetry period, ms.
    #[serde(default = "default_telemetry")]
    pub telemetry_ms: u64,
    /// Where job journals go (default `.cache/pipeline/journal/NODE`).
    #[serde(default)]
    pub journal_dir: Option<PathBuf>,
}

fn default_join_timeout() -> u64 {
    60
}

/// Checks a `pipeline-foreman` entry's params.
pub fn check_foreman(p: &ForemanParams) -> Result<(), (String, String)> {
    if p.workers == 0 {
        return Err(("workers".into(), "must be at least 1".into()));
    }
    if p.join_timeout_s == 0 {
        return Err(("join_timeout_s".into(), "must be at least 1".into()));
    }
    if p.telemetry_ms == 0 {
        return Err(("telemetry_ms".into(), "must be at least 1".into()));
    }
    Ok(())
}

/// The foreman service actor of one `pipeline-foreman` entry; installs its blob shelf on the
/// node's link.
pub fn foreman_actor(ctx: &NodeContext, a: &ActorConfig, p: ForemanParams) -> ChildSpec {
    let actors = &ctx.actors;
    use troupe_actors::pipeline::service::{ForemanServiceActor, ForemanServiceArgs, ServiceSettings};
    let journal_dir = p
        .journal_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(".cache/pipeline/journal").join(&ctx.config.name));
    let args = ForemanServiceArgs {
        actors: actors.clone(),
        membership: ctx.membership.clone(),
        settings: ServiceSettings {
            job: ShellSettings {
                workers: p.workers,
                join_timeout: Duration::from_secs(p.join_timeout_s),
                telemetry_period: Duration::from_millis(p.telemetry_ms),
                ..ShellSettings::default()
            },
            journal_dir,
        },
    };
    ChildSpec::new(a.actor_name(), move || (ForemanServiceActor, args.clone()))
}

/// `params` of the `pipeline` job.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JobParams {
    /// Stage files in order; empty means MiniLM's 3 stages from the setup cache.
    #[serde(default)]
    pub stages: Vec<PathBuf>,
    /// Inputs file (see the module doc for the format).
    pub inputs: PathBuf,
    /// "streaming" (1:1 dependencies) or "barrier" (stage k waits for all of stage k-1).
    #[serde(default = "default_mode")]
    pub mode: String,
    /// Workers to wait for.
    #[serde(default = "default_workers")]
    pub workers: usize,
    /// Send activations as bf16 (lossy) instead of lossless.
    #[serde(default)]
    pub bf16: bool,
    /// Telemetry period, ms.
    #[serde(default = "default_telemetry")]
    pub telemetry_ms: u64,
    /// Where the outputs go: JSON lines, one row per input (see [`write_outputs`]).
    #[serde(default)]
    pub out: Option<PathBuf>,
    /// The job's journal (default `.cache/pipeline/journal/NODE.journal`): its acceptance and
    /// every answer, synced before they count, so a foreman node killed mid-job and started
    /// again resumes the job. Removed once the outputs are written.
    #[serde(default)]
    pub journal: Option<PathBuf>,
}

fn default_mode() -> String {
    "streaming".into()
}
fn default_workers() -> usize {
    1
}
fn default_telemetry() -> u64 {
    500
}

/// Parses a mode name.
pub fn parse_mode(s: &str) -> Result<Mode, String> {
    match s {
        "streaming" => Ok(Mode::Streaming),
        "barrier" => Ok(Mode::Barrier),
        other => Err(format!("unknown mode {other:?} (use \"streaming\" or \"barrier\")")),
    }
}

/// Checks a `pipeline-worker` entry's params.
pub fn check_worker(p: &WorkerParams) -> Result<(), (String, String)> {
    if p.ram_budget_mb == 0 {
        return Err(("ram_budget_mb".into(), "must be at least 1".into()));
    }
    if p.cpu_quota_pct == 0 || p.cpu_quota_pct > 100 {
        return Err(("cpu_quota_pct".into(), "must be between 1 and 100".into()));
    }
    if !(0.0..=100.0).contains(&p.battery_pct) {
        return Err(("battery_pct".into(), "must be between 0 and 100".into()));
    }
    if p.intra_threads == 0 || p.intra_threads > 64 {
        return Err(("intra_threads".into(), "must be between 1 and 64".into()));
    }
    Ok(())
}

/// Checks the job's params.
pub fn check_job(p: &JobParams) -> Result<(), (String, String)> {
    parse_mode(&p.mode).map_err(|e| ("mode".to_string(), e))?;
    if p.workers == 0 {
        return Err(("workers".into(), "must be at least 1".into()));
    }
    if p.telemetry_ms == 0 {
        return Err(("telemetry_ms".into(), "must be at least 1".into()));
    }
    Ok(())
}

/// Settings of a worker from its params.
pub fn worker_settings(node: &str, p: &WorkerParams) -> WorkerSettings {
    WorkerSettings {
        node: node.to_owned(),
        ram_budget_bytes: p.ram_budget_mb << 20,
        cpu_quota_pct: p.cpu_quota_pct,
        device: DeviceModel { battery_pct: p.battery_pct, ambient_c: p.ambient_c, ..DeviceModel::default() },
        enforce_ram_budget: p.enforce_ram_budget,
        cache_dir: p
            .cache_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(".cache/pipeline").join(node))
            .to_string_lossy()
            .into_owned(),
        intra_threads: u32::try_from(p.intra_threads).unwrap_or(u32::MAX),
        sim: false,
    }
}

/// The worker of one `pipeline-worker` entry: a typed actor named `pipeline-worker/NODE`
/// under the node's root supervisor (it installs its blob shelf on the node's link as it
/// starts); the foreman reaches it by that name.
pub fn actor(ctx: &NodeContext, p: &WorkerParams) -> Result<ChildSpec> {
    let settings = worker_settings(&ctx.config.name, p);
    Ok(ctx.actors.child_spec::<PipelineWorker>(&worker_name(&ctx.config.name), settings)?)
}

/// Reads an inputs file: one sentence per line (see the module doc).
pub fn read_sentences(path: &Path) -> Result<Vec<String>> {
    let len = std::fs::metadata(path).with_context(|| format!("inputs file {}", path.display()))?.len();
    if len > MAX_INPUTS_FILE_BYTES {
        bail!("inputs file {}: {len} bytes is above the {MAX_INPUTS_FILE_BYTES}-byte cap", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("inputs file {}", path.display()))?;
    let sentences: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if sentences.is_empty() {
        bail!("inputs file {}: no sentences (one per line)", path.display());
    }
    if sentences.len() > MAX_SENTENCES {
        bail!(
            "inputs file {}: {} sentences, more than the limit {MAX_SENTENCES}",
            path.display(),
            sentences.len()
        );
    }
    Ok(sentences)
}

/// Tokenises each sentence into one job input (`input_ids`, `attention_mask`, i64 `[1, S]`).
pub fn tokenize(sentences: &[String]) -> Result<Vec<Vec<NamedTensor>>> {
    let tokenizer = WordPiece::from_assets(&Assets::locate()?)?;
    Ok(sentences
        .iter()
        .map(|s| {
            let b = tokenizer.encode_batch(std::slice::from_ref(s));
            let shape = vec![b.batch, b.seq_len];
            vec![
                NamedTensor::i64("input_ids", shape.clone(), b.ids),
                NamedTensor::i64("attention_mask", shape, b.attention_mask),
            ]
        })
        .collect())
}

/// Tokenises `count` inputs of `batch` sentences each (sentences taken in order, cycling), each
/// input padded to its longest sentence: heavier tasks for the benchmark.
pub fn tokenize_batches(sentences: &[String], count: usize, batch: usize) -> Result<Vec<Vec<NamedTensor>>> {
    if sentences.is_empty() || batch == 0 {
        bail!("no sentences to batch");
    }
    let tokenizer = WordPiece::from_assets(&Assets::locate()?)?;
    Ok((0..count)
        .map(|i| {
            let group: Vec<&String> =
                (0..batch).map(|j| &sentences[(i * batch + j) % sentences.len()]).collect();
            let b = tokenizer.encode_batch(&group);
            let shape = vec![b.batch, b.seq_len];
            vec![
                NamedTensor::i64("input_ids", shape.clone(), b.ids),
                NamedTensor::i64("attention_mask", shape, b.attention_mask),
            ]
        })
        .collect())
}

/// MiniLM's three stage files from the setup cache.
pub fn minilm_stages() -> Result<Vec<PathBuf>> {
    let a = Assets::locate()?;
    assets::MINILM_STAGES.iter().map(|s| a.path(s).map_err(Into::into)).collect()
}

/// What [`split_to_dir`] made.
#[derive(Debug, Clone)]
pub struct SplitOutcome {
    /// The cut tensors.
    pub cuts: Vec<String>,
    /// The stage files, in chain order.
    pub stages: Vec<PathBuf>,
    /// Weight (initializer) bytes per stage.
    pub weight_bytes: Vec<u64>,
    /// File bytes per stage.
    pub file_bytes: Vec<u64>,
    /// The manifest written next to them.
    pub manifest: PathBuf,
    /// The checked chain.
    pub chain: Chain,
}

impl SplitOutcome {
    /// A short report: one line per stage.
    pub fn render(&self) -> String {
        let mut s = format!(
            "pipeline split: {} stages, cut at {}; chain checked; manifest {}\n",
            self.stages.len(),
            if self.cuts.is_empty() { "nothing".to_owned() } else { self.cuts.join(", ") },
            self.manifest.display()
        );
        for (k, p) in self.stages.iter().enumerate() {
            s += &format!(
                "  stage {k}: {} ({} bytes, {} weight bytes)\n",
                p.display(),
                self.file_bytes[k],
                self.weight_bytes[k]
            );
        }
        s
    }
}

/// Cuts `model` by `plan` into `out` (`PREFIX_stageK.onnx` and `PREFIX_split.json`, PREFIX the
/// model's file stem without a trailing `_whole`), then checks the written files as a chain with
/// ONNX Runtime (`StageFile::from_path` and the pipeline chain check, fed by the model's inputs).
pub fn split_to_dir(model: &Path, plan: &CutPlan, out: &Path, limits: &Limits) -> Result<SplitOutcome> {
    let loaded = split::load_model(model, limits)?;
    let parts = split::split_model(&loaded.model, plan)?;
    let stem = model.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let prefix = stem.strip_suffix("_whole").filter(|p| !p.is_empty()).unwrap_or(&stem).to_owned();
    let (written, manifest) = split::write_split(&parts, (model, &loaded), out, &prefix)?;
    let files = written.iter().map(|w| StageFile::from_path(&w.path)).collect::<Result<Vec<_>, _>>()?;
    let job_inputs = loaded
        .model
        .graph
        .iter()
        .flat_map(|g| &g.input)
        .filter(|i| parts.stages.iter().any(|s| s.inputs.iter().any(|t| Some(&t.name) == i.name.as_ref())))
        .map(|i| {
            let name = i.name.clone().unwrap_or_default();
            let (dtype, rank) = match i.r#type.as_ref().and_then(|t| t.value.as_ref()) {
                Some(proto::type_proto::Value::TensorType(t)) => (
                    match t.elem_type {
                        Some(1) => DType::F32,
                        Some(7) => DType::I64,
                        other => {
                            bail!("model input '{name}' has element type {other:?}; stages pass f32 and i64")
                        }
                    },
                    t.shape.as_ref().map_or(0, |s| s.dim.len()),
                ),
                _ => bail!("model input '{name}' is not a tensor"),
            };
            Ok(TensorSig { name, dtype, rank })
        })
        .collect::<Result<Vec<_>>>()?;
    let signatures: Vec<_> = files.iter().map(|f| f.signature.clone()).collect();
    let chain = check_chain(&signatures, &job_inputs).context("the written stages do not chain")?;
    Ok(SplitOutcome {
        cuts: parts.cuts,
        weight_bytes: parts.stages.iter().map(|s| s.weight_bytes).collect(),
        file_bytes: written.iter().map(|w| w.bytes).collect(),
        stages: written.into_iter().map(|w| w.path).collect(),
        manifest,
        chain,
    })
}

/// Reads and checks the stage files and the inputs; a broken chain is refused here, before any
/// task runs, with a message naming the tensor.
pub fn load_job(stages: &[PathBuf], sentences: &[String], mode: Mode, bf16: bool) -> Result<PipelineJob> {
    let files = stages.iter().map(|p| StageFile::from_path(p)).collect::<Result<Vec<_>, _>>()?;
    Ok(build_job(files, tokenize(sentences)?, mode, bf16)?)
}

/// Writes a job's outputs as JSON lines: per input, in order, `{"input": i, "text": sentence,
/// NAME: [elements...], ..., "shapes": {NAME: [dims...]}}` with one field per last-stage output
/// (`pandas.read_json(path, lines=True)` reads it; numpy takes a column as an array).
pub fn write_outputs(path: &Path, sentences: &[String], outputs: &[Vec<NamedTensor>]) -> Result<()> {
    use std::io::Write;
    let mut text = Vec::new();
    for (i, (s, tensors)) in sentences.iter().zip(outputs).enumerate() {
        let mut row = serde_json::Map::new();
        row.insert("input".into(), i.into());
        row.insert("text".into(), s.as_str().into());
        let mut shapes = serde_json::Map::new();
        for t in tensors {
            let data: serde_json::Value = match &t.data {
                troupe_kernels::onnx::TensorData::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
                troupe_kernels::onnx::TensorData::I64(v) => v.iter().copied().collect(),
            };
            row.insert(t.name.clone(), data);
            shapes.insert(t.name.clone(), t.shape.iter().copied().collect());
        }
        row.insert("shapes".into(), shapes.into());
        serde_json::to_writer(&mut text, &row)?;
        text.write_all(b"\n")?;
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, &text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Prints `pipeline: K of N inputs answered` every tenth answer while the job runs (`lines`)
/// and moves `bar` on each answer.
fn print_progress(
    total: usize,
    stages: usize,
    already: usize,
    bar: indicatif::ProgressBar,
    lines: bool,
) -> (tokio::sync::mpsc::UnboundedSender<troupe_actors::pipeline::Progress>, tokio::task::JoinHandle<()>) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    bar.set_position(already as u64);
    let task = tokio::spawn(async move {
        let mut answered = already;
        while let Some(p) = rx.recv().await {
            if let troupe_actors::pipeline::Progress::Done { task } = p
                && task.stage + 1 == stages
            {
                answered += 1;
                bar.set_position(answered as u64);
                if lines && answered.is_multiple_of(10) && answered < total {
                    crate::progress::println(format!("pipeline: {answered} of {total} inputs answered"));
                }
            }
        }
    });
    (tx, task)
}

/// A bar of the job's inputs answered.
fn inputs_bar(total: usize) -> indicatif::ProgressBar {
    crate::progress::bar(total as u64, "pipeline inputs")
}

/// The table printed at the end of a pipeline job: inputs, time, throughput, workers, failures.
pub fn summary(
    title: &str,
    o: &JobOutcome,
    inputs: usize,
    resumed: Option<usize>,
) -> crate::summary::Summary {
    let lost: Vec<&str> = o.workers.iter().filter(|w| w.lost).map(|w| w.node.as_str()).collect();
    let peak = o.workers.iter().filter_map(|w| w.stats.map(|s| s.peak_rss_bytes)).max();
    let t = &o.tally;
    let memory = memory::summary_rows(&memory::worker_memory(o));
    let summary = crate::summary::Summary::new(title)
        .row("inputs answered", format!("{} of {inputs}", o.outputs.len()))
        .row_if(
            "resumed from the journal",
            resumed.filter(|&r| r > 0).map(|r| format!("{r} answered before this start")),
        )
        .row("makespan", format!("{:.3} s", o.makespan_s))
        .row(
            "throughput",
            if o.makespan_s > 0.0 {
                format!("{:.2} inputs/s", o.outputs.len() as f64 / o.makespan_s)
            } else {
                "-".into()
            },
        )
        .row(
            "workers",
            format!("{} ({} tasks)", o.workers.len(), o.workers.iter().map(|w| w.tasks).sum::<usize>()),
        )
        .row_if("worker peak RSS", peak.map(|b| format!("{:.1} MB (largest)", b as f64 / 1e6)));
    memory
        .into_iter()
        .fold(summary, |s, (k, v)| s.row(k, v))
        .row_if(
            "activations on the wire",
            (t.raw > 0).then(|| format!("{:.3}x of raw", t.wire as f64 / t.raw as f64)),
        )
        .row("workers lost", if lost.is_empty() { "none".to_string() } else { lost.join(", ") })
        .row("tasks moved", o.moves.len().to_string())
}

/// Runs the `pipeline` job on this (foreman) node and prints the results.
pub async fn run_job(runtime: &NodeRuntime, ctx: &NodeContext, job: &JobConfig, p: JobParams) -> Result<()> {
    let mode = parse_mode(&p.mode).map_err(|e| anyhow!("job.params.mode: {e}"))?;
    let stages = if p.stages.is_empty() { minilm_stages()? } else { p.stages.clone() };
    let sentences = read_sentences(&p.inputs)?;
    let membership = runtime.subscribe_membership();
    let join_wait = Duration::from_secs(job.timeout_s.clamp(1, 60));
    let job = load_job(&stages, &sentences, mode, p.bf16)?;
    let journal = p.journal.clone().unwrap_or_else(|| {
        PathBuf::from(".cache/pipeline/journal").join(format!("{}.journal", ctx.config.name))
    });
    let (job, resumed) = AcceptedJob::open(job, Some(&journal))?;
    if let Some(d) = &resumed.damage {
        println!("pipeline: journal {}: {d}; that record was not replayed", journal.display());
    }
    if resumed.resumed {
        println!(
            "pipeline: resuming from journal {}: {} of {} inputs answered",
            journal.display(),
            resumed.answered,
            sentences.len()
        );
    }
    let shelf = BlobShelf::default();
    runtime.link.set_blob_server(std::sync::Arc::new(shelf.clone()));
    let settings = ShellSettings {
        workers: p.workers,
        join_timeout: join_wait,
        telemetry_period: Duration::from_millis(p.telemetry_ms),
        ..ShellSettings::default()
    };
    let stage_count = stages.len();
    let bar = inputs_bar(sentences.len());
    let (progress, printer) =
        print_progress(sentences.len(), stage_count, resumed.answered, bar.clone(), true);
    let outcome = run_pipeline_job(&runtime.actors, &shelf, membership, job, settings, Some(progress)).await;
    printer.abort();
    bar.finish_and_clear();
    let outcome = outcome?;
    print!("{}", render_outcome(&sentences, &outcome));
    summary("pipeline job summary", &outcome, sentences.len(), Some(resumed.answered)).print();
    if let Some(out) = &p.out {
        write_outputs(out, &sentences, &outcome.outputs)?;
    }
    // The outputs are out: the journal has done its job, and a rerun starts afresh. It goes
    // before the last line, so whoever waits for that line finds the job wholly finished.
    if let Some(path) = &outcome.journal
        && let Err(e) = std::fs::remove_file(path)
    {
        println!("pipeline: could not remove the finished job's journal {}: {e}", path.display());
    }
    if let Some(out) = &p.out {
        println!("pipeline: results written to {}", out.display());
    }
    Ok(())
}

/// The final embedding of one input (the last stage's first f32 output).
pub fn final_vector(outputs: &[NamedTensor]) -> Option<&[f32]> {
    outputs.iter().find_map(NamedTensor::as_f32)
}

/// Results and metrics of a run as text.
pub fn render_outcome(sentences: &[String], o: &JobOutcome) -> String {
    let mut out = String::new();
    out.push_str(&format!("pipeline: {} inputs done in {:.3} s\n", o.outputs.len(), o.makespan_s));
    for (i, s) in sentences.iter().enumerate() {
        let Some(v) = o.outputs.get(i).and_then(|t| final_vector(t)) else {
            out.push_str(&format!("  [{i:>3}] {s:?}: no output\n"));
            continue;
        };
        let head: Vec<String> = v.iter().take(4).map(|x| format!("{x:+.4}")).collect();
        let nearest = (0..sentences.len())
            .filter(|&j| j != i)
            .filter_map(|j| o.outputs.get(j).and_then(|t| final_vector(t)).map(|w| (j, cosine(v, w))))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let short: String = s.chars().take(48).collect();
        match nearest {
            Some((j, c)) => out.push_str(&format!(
                "  [{i:>3}] {short:<48} dim {} [{} ...] nearest [{j}] cos {c:.3}\n",
                v.len(),
                head.join(", ")
            )),
            None => {
                out.push_str(&format!("  [{i:>3}] {short:<48} dim {} [{} ...]\n", v.len(), head.join(", ")))
            }
        }
    }
    out.push_str("workers:\n");
    for w in &o.workers {
        let stats = w.stats.map_or_else(
            || "no final report (lost)".to_string(),
            |s| {
                format!(
                    "max live sessions {}, loads {}, unloads {}, pulls {}, peak RSS {:.1} MB",
                    s.max_live_sessions,
                    s.loads,
                    s.unloads,
                    s.pulls,
                    s.peak_rss_bytes as f64 / 1e6
                )
            },
        );
        out.push_str(&format!(
            "  {:<10} pid {:<7} tasks {:>3}  {}  | cpu {:.2} battery {:.1}% (simulated) temp {:.1} C (simulated) rtt {:.2} ms | {}{}{}\n",
            w.node,
            w.pid,
            w.tasks,
            stats,
            w.telemetry.cpu_load,
            w.telemetry.battery_pct,
            w.telemetry.temperature_c,
            w.rtt_ms,
            w.straggler,
            if w.lost { " | LOST" } else { "" },
            if w.rejoined > 0 {
                format!(" | rejoined {} time(s), {} tasks since rejoin", w.rejoined, w.tasks_since_rejoin)
            } else {
                String::new()
            }
        ));
    }
    let t = &o.tally;
    if t.raw > 0 {
        out.push_str(&format!(
            "activations: {} raw bytes, {} on the wire ({:.3}x), max abs error {:e}, {} by reference\n",
            t.raw,
            t.wire,
            t.wire as f64 / t.raw as f64,
            t.max_abs_error,
            t.by_reference
        ));
    }
    for m in &o.moves {
        out.push_str(&format!("moved: {m}\n"));
    }
    out
}

/// `troupe pipeline ...`.
#[allow(clippy::large_enum_variant)] // parsed once per process: the size does not matter
#[derive(Subcommand, Debug)]
pub enum PipelineCommand {
    /// Checks the chain and runs the job: on a running cluster's foreman (`--foreman`), or on a
    /// local foreman and worker processes started for it; prints the results.
    Submit {
        /// A running foreman service's node address (a node with a `pipeline-foreman` actor);
        /// without it a local crowd is started for this job.
        #[arg(long, value_parser = troupe_actors::address::parse_resolved)]
        foreman: Option<std::net::SocketAddr>,
        /// Keys folder of that cluster (with `--foreman`).
        #[arg(long, default_value = "keys")]
        keys: PathBuf,
        /// Identity to submit as, from the keys folder: a certificate with the client role
        /// (`troupe keys node client --role client --keys DIR`).
        #[arg(long = "as", default_value = "client")]
        as_name: String,
        /// Longest the job may take, seconds (with `--foreman`).
        #[arg(long, default_value_t = 3600)]
        timeout_s: u64,
        /// Write the outputs here: JSON lines, one row per input (see `write_outputs`).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Stage files, comma-separated, in order (default: MiniLM's 3 stages from the setup cache).
        #[arg(long, value_delimiter = ',')]
        stages: Vec<PathBuf>,
        /// Inputs file: one sentence per line.
        #[arg(long)]
        inputs: PathBuf,
        /// Number of worker processes.
        #[arg(long, default_value_t = 3)]
        workers: usize,
        /// CPU quota of each worker in percent of one CPU, comma-separated, cycled over the
        /// workers (real stragglers through cgroup v2 or v1 where available; default: all at 100).
        #[arg(long, value_delimiter = ',')]
        quotas: Vec<u32>,
        /// "streaming" or "barrier".
        #[arg(long, default_value = "streaming")]
        mode: String,
        /// Send activations as bf16 (lossy).
        #[arg(long)]
        bf16: bool,
        /// Working folder (keys, configs, worker logs and disk caches).
        #[arg(long, default_value = ".cache/pipeline-submit")]
        workdir: PathBuf,
    },
    /// Cuts one ONNX model into stage files where a single activation crosses (side inputs such as
    /// `attention_mask` pass through), balanced by weight bytes; writes the stages and a manifest
    /// (`PREFIX_split.json`) to `--out`, then checks the chain as `submit` would.
    Split {
        /// The whole model.
        model: PathBuf,
        /// Number of stages (K).
        #[arg(long, required_unless_present_any = ["at", "list"])]
        stages: Option<usize>,
        /// What to balance: "weights" (initializer bytes per stage; the only measure so far).
        #[arg(long, default_value = "weights")]
        balance: String,
        /// Cut at these tensors instead (comma-separated, in graph order), e.g. hidden_2,hidden_5.
        #[arg(long, value_delimiter = ',', conflicts_with = "stages")]
        at: Vec<String>,
        /// Output folder.
        #[arg(long, required_unless_present = "list")]
        out: Option<PathBuf>,
        /// Largest model file read, MiB (external data is capped at the same size).
        #[arg(long, default_value_t = 2047)]
        max_model_mb: u64,
        /// Print the valid cut points (tensor, nodes before it, why one cannot be used) and stop.
        #[arg(long)]
        list: bool,
    },
    /// Loads one model in this process, runs it once, prints its peak RSS as JSON (used by the
    /// benchmark to measure a model's RSS in a fresh process).
    ProbeRss {
        /// The ONNX file.
        #[arg(long)]
        model: PathBuf,
        /// Load it as a pipeline worker loads a stage file: large initializers memory-mapped
        /// (rewritten once into `MODEL.mapped/` beside the file).
        #[arg(long)]
        mapped: bool,
        /// First put this process in a cgroup (v2 or v1) memory group with this limit (fails if there
        /// is no controller); the OS kills the process if the model does not fit.
        #[arg(long)]
        memory_limit_mb: Option<u64>,
    },
}

/// Runs `troupe pipeline ...`.
pub async fn command(cmd: PipelineCommand) -> Result<()> {
    match cmd {
        PipelineCommand::Submit {
            foreman: Some(addr),
            keys,
            as_name,
            timeout_s,
            out,
            stages,
            inputs,
            mode,
            bf16,
            ..
        } => {
            if bf16 {
                bail!("--bf16 is not supported with --foreman (the service runs jobs losslessly)");
            }
            let mode = parse_mode(&mode).map_err(anyhow::Error::msg)?;
            let stages = if stages.is_empty() { minilm_stages()? } else { stages };
            let sentences = read_sentences(&inputs)?;
            let job = load_job(&stages, &sentences, mode, false)?;
            let id = troupe_transport::NodeIdentity::load(&keys, &as_name).with_context(|| {
                format!(
                    "loading identity {as_name} from {}; make one with `troupe keys node {as_name} --role client --keys {}`",
                    keys.display(),
                    keys.display()
                )
            })?;
            let client = troupe_actors::pipeline::service::ForemanClient::connect(&id, addr).await?;
            println!(
                "pipeline: submitting {} inputs x {} stages to the foreman on {} ({addr})",
                sentences.len(),
                job.stages.len(),
                client.foreman()
            );
            let waiting = crate::progress::spinner("pipeline job");
            waiting.set_message(format!("{} inputs on the foreman", sentences.len()));
            let answer = client.submit(&job.stages, &job.inputs, mode, Duration::from_secs(timeout_s)).await;
            waiting.finish_and_clear();
            client.close().await;
            let answer = answer?;
            println!(
                "pipeline: {} inputs answered in {:.3} s by {} ({} from the foreman's journal)",
                answer.outputs.len(),
                answer.makespan_s,
                answer.workers.join(", "),
                answer.resumed
            );
            let throughput = answer.outputs.len() as f64 / answer.makespan_s;
            crate::summary::Summary::new("pipeline submit summary")
                .row("inputs answered", format!("{} of {}", answer.outputs.len(), sentences.len()))
                .row("resumed from the journal", answer.resumed.to_string())
                .row("makespan", format!("{:.3} s", answer.makespan_s))
                .row(
                    "throughput",
                    if throughput.is_finite() { format!("{throughput:.2} inputs/s") } else { "-".into() },
                )
                .row("workers", answer.workers.join(", "))
                .print();
            if let Some(out) = &out {
                write_outputs(out, &sentences, &answer.outputs)?;
                println!("pipeline: results written to {}", out.display());
            }
            Ok(())
        }
        PipelineCommand::Submit {
            foreman: None,
            stages,
            inputs,
            workers,
            quotas,
            mode,
            bf16,
            workdir,
            out,
            ..
        } => {
            if workers == 0 || workers > 64 {
                bail!("--workers must be between 1 and 64");
            }
            if let Some(q) = quotas.iter().find(|&&q| q == 0 || q > 100) {
                bail!("--quotas: {q} is not between 1 and 100");
            }
            let mode = parse_mode(&mode).map_err(anyhow::Error::msg)?;
            let stages = if stages.is_empty() { minilm_stages()? } else { stages };
            let sentences = read_sentences(&inputs)?;
            let job = load_job(&stages, &sentences, mode, bf16)?;
            println!(
                "pipeline: chain of {} stages checked (SHA-256: {}); {} inputs",
                job.stages.len(),
                job.stages.iter().map(|s| &s.signature.sha256[..12]).collect::<Vec<_>>().join(", "),
                sentences.len()
            );
            let exe = std::env::current_exe()?;
            let quota = |i: usize| if quotas.is_empty() { 100 } else { quotas[i % quotas.len()] };
            let specs: Vec<local::WorkerSpec> = (0..workers)
                .map(|i| local::WorkerSpec::new(&format!("worker-{}", i + 1), quota(i), &workdir))
                .collect();
            let cluster = local::LocalCluster::start(&exe, &workdir, &specs).await?;
            let bar = inputs_bar(sentences.len());
            let (progress, watcher) =
                print_progress(sentences.len(), job.stages.len(), 0, bar.clone(), false);
            let settings = ShellSettings { workers, ..ShellSettings::default() };
            let result = cluster.run(job, settings, Some(progress)).await;
            watcher.abort();
            bar.finish_and_clear();
            cluster.shutdown().await;
            let outcome = result?;
            print!("{}", render_outcome(&sentences, &outcome));
            summary("pipeline submit summary", &outcome, sentences.len(), None).print();
            if let Some(out) = &out {
                write_outputs(out, &sentences, &outcome.outputs)?;
                println!("pipeline: results written to {}", out.display());
            }
            Ok(())
        }
        PipelineCommand::Split { model, stages, balance, at, out, max_model_mb, list } => {
            if balance != "weights" {
                bail!("--balance {balance}: only \"weights\" (initializer bytes) is supported");
            }
            let bytes = max_model_mb.saturating_mul(1 << 20);
            let limits = Limits { max_model_bytes: bytes, max_external_bytes: bytes };
            if list {
                let loaded = split::load_model(&model, &limits)?;
                for c in split::cut_points(&loaded.model)? {
                    let problem = c.problem.map(|p| format!("  (refused: {p})")).unwrap_or_default();
                    println!("{:>6}  {}{problem}", c.position, c.tensor);
                }
                return Ok(());
            }
            let plan = match stages {
                Some(stages) => CutPlan::Balanced { stages },
                None => CutPlan::At(at),
            };
            let out = out.ok_or_else(|| anyhow!("--out is required"))?;
            let done =
                tokio::task::spawn_blocking(move || split_to_dir(&model, &plan, &out, &limits)).await??;
            print!("{}", done.render());
            Ok(())
        }
        PipelineCommand::ProbeRss { model, mapped, memory_limit_mb } => {
            if let Some(mb) = memory_limit_mb {
                let limit = troupe_actors::pipeline::telemetry::apply_memory_limit(
                    "probe-rss",
                    mb.saturating_mul(1 << 20),
                    true,
                );
                if !matches!(limit, troupe_actors::pipeline::telemetry::MemoryLimit::Cgroup { .. }) {
                    bail!("--memory-limit-mb {mb}: {}", limit.describe());
                }
                eprintln!("{}", limit.describe());
            }
            let json = tokio::task::spawn_blocking(move || local::probe_rss(&model, mapped)).await??;
            println!("{json}");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KindCheck;

    fn validate_actor(a: &ActorConfig) -> Result<(), (String, String)> {
        crate::kinds::Kinds::builtin().check_actor(a)
    }

    fn validate_job(j: &JobConfig) -> Result<(), (String, String)> {
        crate::kinds::Kinds::builtin().check_job(j)
    }

    fn actor_with(params: &str) -> ActorConfig {
        ActorConfig { kind: "pipeline-worker".into(), name: None, params: toml::from_str(params).unwrap() }
    }

    fn job_with(params: &str) -> JobConfig {
        JobConfig { kind: "pipeline".into(), timeout_s: 60, params: toml::from_str(params).unwrap() }
    }

    #[test]
    fn worker_and_job_params_are_checked_field_by_field() {
        assert!(validate_actor(&actor_with("cpu_quota_pct = 50\nram_budget_mb = 300")).is_ok());
        let (f, e) = validate_actor(&actor_with("cpu_quota_pct = 0")).unwrap_err();
        assert_eq!(f, "params.cpu_quota_pct", "{e}");
        let (f, _) = validate_actor(&actor_with("cpu_quota_pct = 150")).unwrap_err();
        assert_eq!(f, "params.cpu_quota_pct");
        let (f, _) = validate_actor(&actor_with("ram_budget_mb = 0")).unwrap_err();
        assert_eq!(f, "params.ram_budget_mb");
        let (f, _) = validate_actor(&actor_with("colour = 1")).unwrap_err();
        assert!(f.contains("colour") || f == "params", "{f}");

        assert!(validate_job(&job_with("inputs = \"x.txt\"\nmode = \"barrier\"")).is_ok());
        let (f, e) = validate_job(&job_with("inputs = \"x.txt\"\nmode = \"sideways\"")).unwrap_err();
        assert_eq!(f, "params.mode");
        assert!(e.contains("sideways"), "{e}");
        let (f, _) = validate_job(&job_with("inputs = \"x.txt\"\nworkers = 0")).unwrap_err();
        assert_eq!(f, "params.workers");
        assert!(validate_job(&job_with("mode = \"streaming\"")).is_err(), "inputs is required");
    }

    #[test]
    fn inputs_file_skips_comments_and_blank_lines_and_refuses_empty_or_huge() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("in.txt");
        std::fs::write(&p, "# header\n\n  first sentence  \nsecond one\n").unwrap();
        assert_eq!(read_sentences(&p).unwrap(), vec!["first sentence".to_string(), "second one".into()]);
        std::fs::write(&p, "# only a comment\n\n").unwrap();
        assert!(read_sentences(&p).unwrap_err().to_string().contains("no sentences"));
        std::fs::write(&p, "x\n".repeat(MAX_SENTENCES + 1)).unwrap();
        assert!(read_sentences(&p).unwrap_err().to_string().contains("more than the limit"));
        let big = vec![b'a'; usize::try_from(MAX_INPUTS_FILE_BYTES).unwrap() + 1];
        std::fs::write(&p, big).unwrap();
        assert!(read_sentences(&p).unwrap_err().to_string().contains("cap"));
        assert!(
            read_sentences(&d.path().join("missing.txt")).unwrap_err().to_string().contains("missing.txt")
        );
    }

    #[tokio::test]
    async fn split_refuses_an_unknown_balance_measure_and_a_missing_model() {
        let d = tempfile::tempdir().unwrap();
        let split = |balance: &str| PipelineCommand::Split {
            model: d.path().join("m.onnx"),
            stages: Some(2),
            balance: balance.into(),
            at: vec![],
            out: Some(d.path().join("out")),
            max_model_mb: 1,
            list: false,
        };
        let err = command(split("flops")).await.unwrap_err();
        assert!(err.to_string().contains("--balance flops"), "{err}");
        let err = command(split("weights")).await.unwrap_err();
        assert!(err.to_string().contains("m.onnx"), "{err}");
    }

    #[test]
    fn modes_parse() {
        assert_eq!(parse_mode("streaming"), Ok(Mode::Streaming));
        assert_eq!(parse_mode("barrier"), Ok(Mode::Barrier));
        assert!(parse_mode("Barrier").is_err());
    }
}
