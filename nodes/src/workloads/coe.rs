//! Workload `coe`: `troupe coe gen | profile | run | serve | request`, the CoServe-style CoE application on real
//! ONNX experts (see `troupe_actors::coe`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use troupe_actors::coe::app::{self, App, GenKnobs, Scale};
use troupe_actors::coe::appfile::{LoadedApp, Memory, Requests, open_for_serving};
use troupe_actors::coe::profiler;
use troupe_actors::coe::runner::{RunOptions, RunReport, run_local_watched};
use troupe_policy::coe::{EvictionPolicy, LatencyModel, Profile, SchedulerConfig};

/// Workload knobs of `coe gen` and `bench coe` (each absent keeps the scale's, or the app's).
#[derive(clap::Args, Clone, Copy, Debug, Default, PartialEq)]
pub struct KnobArgs {
    /// Device (GPU-executor) expert memory as a fraction of all expert bytes, in (0, 1] (the
    /// CPU executor keeps the scale's CPU : GPU ratio; raised to hold the largest expert).
    #[arg(long, value_parser = fraction)]
    pub device_budget: Option<f64>,
    /// Bytes of the most used experts homed in host memory, fraction of all expert bytes, in (0, 1].
    #[arg(long, value_parser = fraction)]
    pub host_budget: Option<f64>,
    /// Zipf skew of the mix over entry experts (>= 0).
    #[arg(long, value_parser = skew)]
    pub zipf: Option<f64>,
    /// Mean arrival rate, requests/s (bursty Poisson).
    #[arg(long, value_parser = rate)]
    pub rate: Option<f64>,
    /// About this many experts (generation only).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Smallest expert, bytes (generation only).
    #[arg(long)]
    pub min_bytes: Option<u64>,
    /// Largest expert, bytes (generation only).
    #[arg(long)]
    pub max_bytes: Option<u64>,
    /// Skip the single-model baseline's training (generation only; its accuracy is then NaN).
    #[arg(long)]
    pub no_single_model: bool,
    /// Serve a trace of this many requests, redrawn (seeded) from the app's recorded walks
    /// (bench only; a generated app keeps its scale's count). Paper scale's 20,000 requests
    /// take FCFS+LRU hours for real; a shorter trace measures it in minutes.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub requests: Option<u64>,
    /// Seed of the redrawn trace (bench only; default 1): another seed draws other requests
    /// from the same recorded walks, to see how a figure varies from trace to trace.
    #[arg(long)]
    pub trace_seed: Option<u64>,
}

impl KnobArgs {
    /// The generator's knobs.
    pub fn gen_knobs(&self) -> GenKnobs {
        GenKnobs {
            device_budget: self.device_budget,
            host_budget: self.host_budget,
            zipf: self.zipf,
            rate_rps: self.rate,
            experts: self.experts,
            min_bytes: self.min_bytes,
            max_bytes: self.max_bytes,
            skip_single_model: self.no_single_model,
        }
    }
}

fn number(s: &str) -> Result<f64, String> {
    s.parse::<f64>().map_err(|_| format!("`{s}` is not a number"))
}

/// A budget fraction in (0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    troupe_policy::coe::sweep::check_fraction("budget", number(s)?).map_err(|e| e.to_string())
}

fn skew(s: &str) -> Result<f64, String> {
    troupe_policy::coe::sweep::check_skew(number(s)?).map_err(|e| e.to_string())
}

fn rate(s: &str) -> Result<f64, String> {
    troupe_policy::coe::sweep::check_rate(number(s)?).map_err(|e| e.to_string())
}

/// `troupe coe ...`.
#[derive(Subcommand, Debug)]
pub enum CoeCommand {
    /// Generate the application (ONNX experts, manifest) and its request trace.
    Gen {
        /// `ci` (seconds, tens of MB) or `paper` (~300 experts, several GB).
        #[arg(long, default_value = "ci")]
        scale: String,
        /// Output folder (default .cache/coe/SCALE).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Generator seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Workload knobs.
        #[command(flatten)]
        knobs: KnobArgs,
    },
    /// Measure this machine and write the profile the scheduler reads.
    Profile {
        /// Which app to profile with.
        #[arg(long, default_value = "ci")]
        scale: String,
        /// App folder (default .cache/coe/SCALE).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Profile file (default DIR/profile.txt).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Serve the trace for real in this process (scheduler + one thread per executor).
    Run {
        /// Which app.
        #[arg(long, default_value = "ci")]
        scale: String,
        /// App folder (default .cache/coe/SCALE).
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Trace file (default DIR/trace.txt).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Profile file (default DIR/profile.txt).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// `ours`, `fcfs+lru`, `sched-only`, `evict-only`, `paper-two-stage` or `fcfs+two-stage`.
        #[arg(long, default_value = "ours")]
        policy: String,
        /// Eviction: `two-stage` (the paper's two stages), `two-stage+lookahead` (also keeps what
        /// queued work needs) or `lru`. Replaces the policy's own (ours: two-stage+lookahead).
        #[arg(long)]
        eviction: Option<EvictionPolicy>,
        /// Write `request <id> digest <hex>` lines here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Serve only the first N requests of the trace.
        #[arg(long)]
        requests: Option<usize>,
        /// Also replay the same requests through the simulator with the profiled latencies
        /// (a cross-check of the simulator against real execution).
        #[arg(long)]
        simulate: bool,
    },
    /// Serve a user's application (an app file, see the README) for real in this process.
    Serve {
        /// The app file (TOML): experts' ONNX files, dependency edges, usage probabilities.
        #[arg(long)]
        app: PathBuf,
        /// Work folder: the imported weight store and the profile (default FILE's folder
        /// joined with `<FILE stem>.serve`).
        #[arg(long)]
        work: Option<PathBuf>,
        /// Serve this trace file's requests (the `coe run` format, e.g. a generated app's
        /// trace.txt). Without it, requests are generated from the app's probabilities.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Requests to generate (without --trace), or the first N of the trace.
        #[arg(long)]
        requests: Option<usize>,
        /// Seed of the generated requests.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Profile file (default WORK/profile.txt, measured now and written there if missing).
        #[arg(long)]
        profile: Option<PathBuf>,
        /// Policy label, as for `coe run`.
        #[arg(long, default_value = "ours")]
        policy: String,
        /// Eviction override, as for `coe run`.
        #[arg(long)]
        eviction: Option<EvictionPolicy>,
        /// Write `request <id> digest <hex>` lines here.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Send an input to a serving scheduler (a `coe` job with `serve = true`) and print the
    /// answer as JSON; `--count N --rate R` runs an open-loop load and reports p50/p99.
    Request(super::coe_request::RequestArgs),
}

/// Requests `serve --app` generates when neither --trace nor --requests is given.
pub const DEFAULT_SERVE_REQUESTS: usize = 300;

/// `troupe coe serve --app FILE`: open the app file, make or read the requests, profile if
/// needed, serve, print the run line and write the results.
#[allow(clippy::too_many_arguments)]
pub fn serve_app(
    app_file: &Path,
    work: Option<PathBuf>,
    trace: Option<PathBuf>,
    requests: Option<usize>,
    seed: u64,
    profile: Option<PathBuf>,
    config: SchedulerConfig,
    out: Option<PathBuf>,
) -> Result<()> {
    let loaded = LoadedApp::load(app_file)?;
    let work = work.unwrap_or_else(|| {
        let stem = app_file.file_stem().map_or_else(|| "app".into(), |s| s.to_string_lossy().into_owned());
        app_file.parent().unwrap_or(Path::new(".")).join(format!("{stem}.serve"))
    });
    let source = match &trace {
        Some(t) => Requests::Trace(t.clone()),
        None => Requests::Generated { count: requests.unwrap_or(DEFAULT_SERVE_REQUESTS), seed },
    };
    let mut app = open_for_serving(&loaded, &work, &source)
        .with_context(|| format!("opening {} for serving", app_file.display()))?;
    if let (Some(n), Some(_)) = (requests, &trace) {
        app.trace.requests.truncate(n);
    }
    let path = profile.unwrap_or_else(|| work.join("profile.txt"));
    let profile = if path.is_file() {
        profiler::load_profile(&path)?
    } else {
        let defaults = Scale::Ci.config();
        let memory = loaded.file.memory.unwrap_or(Memory {
            gpu_expert_bytes: defaults.gpu_expert_bytes,
            cpu_expert_bytes: defaults.cpu_expert_bytes,
        });
        let p = profiler::profile(&app, &profiler::plan(memory.gpu_expert_bytes, memory.cpu_expert_bytes))?;
        app::write_file(&path, p.to_text().as_bytes())?;
        println!("coe serve: profiled this machine -> {}", path.display());
        p
    };
    let latency = LatencyModel::from_profile(&profile)?;
    let requests_from = match &trace {
        Some(t) => format!("from {}", t.display()),
        None => format!("generated (seed {seed})"),
    };
    println!(
        "coe serve: {} experts from {}, {} requests {requests_from}",
        app.trace.model.len(),
        app_file.display(),
        app.trace.requests.len()
    );
    let app = std::sync::Arc::new(app);
    let report = run_with_bar(&app, &latency, config)?;
    println!("{}", run_line(&report));
    summary("coe serve summary", &report).print();
    if let Some(out) = out {
        app::write_file(&out, troupe_actors::coe::runner::results_text(&report).as_bytes())?;
        println!("results written to {}", out.display());
    }
    Ok(())
}

/// Serves the app's trace in this process ([`run_local_watched`]) with a bar of requests answered.
fn run_with_bar(
    app: &std::sync::Arc<App>,
    latency: &LatencyModel,
    config: SchedulerConfig,
) -> Result<RunReport> {
    let bar = crate::progress::bar(app.trace.requests.len() as u64, "coe requests");
    let feed = bar.clone();
    let report = run_local_watched(app, latency, &RunOptions::new(config), move |done, _| {
        feed.set_position(done as u64)
    });
    bar.finish_and_clear();
    Ok(report?)
}

/// The table printed at the end of a coe run (`coe run`, `coe serve`, the `coe` job): requests,
/// throughput, latency percentiles, expert loads, executors lost.
pub fn summary(title: &str, r: &RunReport) -> crate::summary::Summary {
    use crate::summary::{Summary, ms};
    Summary::new(title)
        .row("policy", r.label)
        .row("requests answered", r.requests.to_string())
        .row("makespan", format!("{:.2} s", r.makespan_s))
        .row("throughput", format!("{:.1} req/s", r.throughput_rps))
        .row("latency p50", ms(r.p50_ms))
        .row("latency p99", ms(r.p99_ms))
        .row("expert loads", format!("{} ({:.2}x Belady's MIN)", r.loads, r.loads_over_belady()))
        .row("switching", format!("{:.1}% of executor busy time", 100.0 * r.switch_share()))
        .row("executors lost", if r.lost.is_empty() { "none".to_string() } else { r.lost.join(", ") })
}

/// Parse a scale name.
pub fn scale(name: &str) -> Result<Scale> {
    Scale::from_name(name).with_context(|| format!("unknown scale {name:?} (use ci or paper)"))
}

/// Parse a policy label.
pub fn policy(label: &str) -> Result<SchedulerConfig> {
    SchedulerConfig::all().into_iter().find(|c| c.label() == label).with_context(|| {
        let names: Vec<&str> = SchedulerConfig::all().iter().map(|c| c.label()).collect();
        format!("unknown policy {label:?} (use {})", names.join(", "))
    })
}

/// The policy `label` with its eviction replaced by `eviction` when given.
pub fn config(label: &str, eviction: Option<EvictionPolicy>) -> Result<SchedulerConfig> {
    let config = policy(label)?;
    Ok(eviction.map_or(config, |e| config.with_eviction(e)))
}

/// The app folder: `dir` or the scale's default.
pub fn app_dir(scale: Scale, dir: Option<PathBuf>) -> PathBuf {
    dir.unwrap_or_else(|| scale.default_dir())
}

/// Generate and print a summary.
pub fn gen_app(dir: &Path, scale: Scale, seed: u64, knobs: &GenKnobs) -> Result<()> {
    let working = crate::progress::spinner("coe gen");
    working.set_message("training the experts");
    let r = app::generate_with(dir, scale, seed, knobs);
    working.finish_and_clear();
    let r = r.with_context(|| format!("generating the {} app in {}", scale.name(), dir.display()))?;
    println!(
        "coe gen: {} experts (depth {}), {:.1} MB of ONNX ({:.2}-{:.2} MB each), {} requests, experts trained on {} digit images ({} epochs of samples each), usage probabilities from {} calibration images; {:.1}s -> {}",
        r.experts,
        r.depth,
        r.total_bytes as f64 / 1e6,
        r.min_bytes as f64 / 1e6,
        r.max_bytes as f64 / 1e6,
        r.requests,
        r.accuracy.train_images,
        r.accuracy.epochs,
        r.accuracy.calibration_images,
        r.seconds,
        dir.display()
    );
    let a = &r.accuracy;
    println!(
        "coe gen: accuracy on {} held-out images: coe_accuracy {:.4}, single_model_accuracy {:.4} (one MLP of {:.1} MB, same training; NaN: not trained) -> {}",
        a.test_images,
        a.coe_accuracy,
        a.single_model_accuracy,
        a.single_model_bytes as f64 / 1e6,
        dir.join(troupe_actors::coe::accuracy::ACCURACY_FILE).display()
    );
    println!(
        "coe gen: the preliminaries route {:.1}% of the walks to a leaf of the digit's group; the CoE answers {:.4} of those right",
        100.0 * a.routed_share,
        a.accuracy_when_routed
    );
    Ok(())
}

/// Profile and write the file.
pub fn profile_app(dir: &Path, out: &Path) -> Result<Profile> {
    let app = App::open(dir, None)?;
    let working = crate::progress::spinner("coe profile");
    working.set_message("measuring the executors");
    let profile = profiler::profile(&app, &profiler::default_plan(&app));
    working.finish_and_clear();
    let profile = profile?;
    app::write_file(out, profile.to_text().as_bytes())?;
    println!(
        "coe profile: {} executors measured on `{}` -> {}",
        profile.executors.len(),
        profile.hardware_fingerprint,
        out.display()
    );
    for e in &profile.executors {
        println!(
            "  {} ({}): max batch {}, experts {:.1} MB of {:.1} MB, load {:.0} MB/s from ssd, {:.0} MB/s from host",
            e.name,
            e.kind.name(),
            e.max_batch,
            e.expert_memory_bytes as f64 / 1e6,
            e.memory_bytes as f64 / 1e6,
            e.ssd_bandwidth as f64 / 1e6,
            e.host_bandwidth as f64 / 1e6
        );
    }
    Ok(profile)
}

/// One line describing a real run.
pub fn run_line(r: &RunReport) -> String {
    format!(
        "{:<15} {:>7.1} req/s  loads {:>5} ({:.2}x belady)  switching {:>4.1}%  p50 {:>7.1} ms  p99 {:>7.1} ms",
        r.label,
        r.throughput_rps,
        r.loads,
        r.loads_over_belady(),
        100.0 * r.switch_share(),
        r.p50_ms,
        r.p99_ms
    )
}

/// Write a file (creating its folder), for the benchmark's plot.
pub fn app_write(path: &Path, text: &str) -> Result<()> {
    app::write_file(path, text.as_bytes())?;
    Ok(())
}

/// Runs a `troupe coe` command.
pub fn run(cmd: CoeCommand) -> Result<()> {
    match cmd {
        CoeCommand::Gen { scale: s, dir, seed, knobs } => {
            let s = scale(&s)?;
            if knobs.requests.is_some() {
                bail!(
                    "--requests applies to `troupe bench coe` (the trace it serves); `coe gen` draws the scale's {} requests",
                    s.config().requests
                );
            }
            if knobs.trace_seed.is_some() {
                bail!(
                    "--trace-seed applies to `troupe bench coe` (the trace it redraws); `coe gen` takes --seed"
                );
            }
            gen_app(&app_dir(s, dir), s, seed, &knobs.gen_knobs())
        }
        CoeCommand::Profile { scale: s, dir, out } => {
            let dir = app_dir(scale(&s)?, dir);
            let out = out.unwrap_or_else(|| dir.join("profile.txt"));
            profile_app(&dir, &out).map(|_| ())
        }
        CoeCommand::Request(args) => {
            tokio::runtime::Handle::current().block_on(super::coe_request::run(args))
        }
        CoeCommand::Serve { app, work, trace, requests, seed, profile, policy: p, eviction, out } => {
            serve_app(&app, work, trace, requests, seed, profile, config(&p, eviction)?, out)
        }
        CoeCommand::Run { scale: s, dir, trace, profile, policy: p, eviction, out, requests, simulate } => {
            let dir = app_dir(scale(&s)?, dir);
            let config = config(&p, eviction)?;
            let mut app = App::open(&dir, trace.as_deref())?;
            if let Some(n) = requests {
                app.trace.requests.truncate(n);
            }
            let path = profile.unwrap_or_else(|| dir.join("profile.txt"));
            if !path.is_file() {
                bail!(
                    "{} is missing: run `troupe coe profile --dir {}` first",
                    path.display(),
                    dir.display()
                );
            }
            let latency = LatencyModel::from_profile(&profiler::load_profile(&path)?)?;
            let app = std::sync::Arc::new(app);
            let report = run_with_bar(&app, &latency, config)?;
            println!("{}", run_line(&report));
            if simulate {
                let sim = troupe_policy::coe::simulate(&app.trace, &latency, config, &Default::default())?;
                println!(
                    "{:<15} {:>7.1} req/s  loads {:>5} ({:.2}x belady)  switching {:>4.1}%  [simulated, profiled latencies]",
                    sim.label,
                    sim.throughput_rps,
                    sim.loads,
                    sim.loads_over_belady(),
                    100.0 * sim.switch_share
                );
            }
            summary("coe run summary", &report).print();
            if let Some(out) = out {
                app::write_file(&out, troupe_actors::coe::runner::results_text(&report).as_bytes())?;
                println!("results written to {}", out.display());
            }
            Ok(())
        }
    }
}

// ---- the distributed workload: actor kind `coe-executor`, job kind `coe` -------------------

/// `params` of a `coe-executor` actor.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExecutorParams {
    /// The app folder (with profile.txt).
    pub dir: String,
    /// The executor's name in the profile (e.g. `gpu0-standin-cpu`, `cpu0`).
    pub executor: String,
}

/// `params` of the `coe` job (the scheduler).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoeJob {
    /// The app folder (with profile.txt and trace.txt).
    pub dir: String,
    /// Policy label (default `ours`).
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Eviction policy name (`two-stage`, `two-stage+lookahead` or `lru`) replacing the policy's
    /// own; absent keeps it (ours: `two-stage+lookahead`).
    #[serde(default)]
    pub eviction: Option<String>,
    /// Trace arrival times are multiplied by this.
    #[serde(default = "default_scale")]
    pub arrival_scale: f64,
    /// Where to write `request <id> digest <hex>` lines.
    #[serde(default)]
    pub out: Option<String>,
    /// Seconds an executor call may take before the executor counts as lost.
    #[serde(default = "default_call_timeout")]
    pub call_timeout_s: u64,
    /// The job's journal (default `DIR/journal/NODE.journal`): accepted and answered requests,
    /// so a restarted node resumes the job. Removed once the results are written.
    #[serde(default)]
    pub journal: Option<String>,
    /// MiB past which the journal is compacted to what a restart needs (and then only once it
    /// has doubled since; `troupe_policy::compaction`).
    #[serde(default = "default_journal_compact_mib")]
    pub journal_compact_mib: u64,
    /// Serve clients' requests over QUIC (`troupe coe request`) until the job's `timeout_s`
    /// instead of the trace (see `troupe_actors::coe::requests`).
    #[serde(default)]
    pub serve: bool,
    /// With `serve`: requests outstanding on this scheduler before more are answered busy.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// With `serve`: requests outstanding from one client before more are answered busy.
    #[serde(default = "default_queue_per_client")]
    pub queue_per_client: usize,
    /// With `serve`: longest a request waits for its answer, seconds.
    #[serde(default = "default_answer_timeout")]
    pub answer_timeout_s: u64,
}

/// Most requests a serving scheduler may be configured to hold outstanding.
pub const MAX_QUEUE: usize = 65_536;
/// Largest journal compaction threshold, MiB (half the journal's cap, so a compaction is always
/// due before the journal is too large to open).
pub const MAX_JOURNAL_COMPACT_MIB: u64 = (troupe_actors::journal::MAX_JOURNAL >> 20) / 2;

fn default_journal_compact_mib() -> u64 {
    troupe_policy::compaction::DEFAULT_THRESHOLD >> 20
}

fn default_queue() -> usize {
    64
}

fn default_queue_per_client() -> usize {
    16
}

fn default_answer_timeout() -> u64 {
    120
}

impl CoeJob {
    /// The eviction override, parsed.
    pub fn eviction(&self) -> Result<Option<EvictionPolicy>, troupe_policy::coe::UnknownEvictionPolicy> {
        self.eviction.as_deref().map(str::parse).transpose()
    }

    /// The scheduler configuration these params name.
    pub fn config(&self) -> Result<SchedulerConfig> {
        config(&self.policy, self.eviction()?)
    }
}

fn default_policy() -> String {
    "ours".into()
}

fn default_scale() -> f64 {
    1.0
}

fn default_call_timeout() -> u64 {
    30
}

/// Checks the `coe` job's params.
pub fn check_job(p: &CoeJob) -> Result<(), (String, String)> {
    policy(&p.policy).map_err(|e| ("policy".to_string(), e.to_string()))?;
    p.eviction().map_err(|e| ("eviction".to_string(), e.to_string()))?;
    if !(p.arrival_scale.is_finite() && p.arrival_scale >= 0.0) {
        return Err(("arrival_scale".into(), "must be a finite number >= 0".into()));
    }
    if p.journal_compact_mib == 0 || p.journal_compact_mib > MAX_JOURNAL_COMPACT_MIB {
        return Err((
            "journal_compact_mib".into(),
            format!("must be between 1 and {MAX_JOURNAL_COMPACT_MIB}, got {}", p.journal_compact_mib),
        ));
    }
    for (field, v) in [("queue", p.queue), ("queue_per_client", p.queue_per_client)] {
        if v == 0 || v > MAX_QUEUE {
            return Err((field.into(), format!("must be between 1 and {MAX_QUEUE}, got {v}")));
        }
    }
    Ok(())
}

/// The `coe-executor` typed actor of this node, named `coe-executor/EXECUTOR`.
pub fn actor(ctx: &super::NodeContext, p: ExecutorParams) -> Result<troupe_actors::supervisor::ChildSpec> {
    use troupe_actors::coe::remote::{CoeExecutor, ExecutorSpec};
    let name = troupe_actors::coe::exec_wire::actor_name(&p.executor);
    let spec = ExecutorSpec::real(p.dir, p.executor);
    Ok(ctx.actors.child_spec::<CoeExecutor>(&name, spec)?)
}

/// The scheduler: find the executors, start the scheduler actor under the root supervisor, feed
/// it the trace with every acceptance journaled, put lost executors back in service when their
/// node rejoins, and write the results once every request is answered.
pub async fn run_job(
    runtime: &troupe_actors::NodeRuntime,
    ctx: &super::NodeContext,
    job: &crate::config::JobConfig,
    p: CoeJob,
) -> Result<()> {
    use std::sync::Arc;
    use troupe_actors::coe::remote::find_executors_for_job;
    use troupe_actors::coe::serve::{CoeShared, serve_trace};
    use troupe_actors::supervisor::SupervisorMsg;

    let config = p.config()?;
    let dir = PathBuf::from(&p.dir);
    let (app, latency) = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || -> Result<(App, LatencyModel)> {
            let app = App::open(&dir, None)?;
            let latency = LatencyModel::from_profile(&profiler::load_profile(&dir.join("profile.txt"))?)?;
            Ok((app, latency))
        })
        .await??
    };
    let journal = p
        .journal
        .as_ref()
        .map_or_else(|| dir.join("journal").join(format!("{}.journal", ctx.config.name)), PathBuf::from);
    let (shared, damage) = CoeShared::open(Arc::new(app), latency.clone(), config, Some(&journal))?;
    shared
        .set_compaction(troupe_policy::compaction::CompactionRule { threshold: p.journal_compact_mib << 20 });
    if let Some(d) = damage {
        println!("coe: journal {}: {d}; that record was not replayed", journal.display());
    }
    let (accepted, answered) = (shared.accepted().len(), *shared.answered().borrow());
    if accepted > 0 {
        println!(
            "coe: resuming from journal {}: {accepted} requests accepted, {answered} answered",
            journal.display()
        );
    }
    let names: Vec<String> = (0..latency.executors()).map(|i| latency.name(i).to_string()).collect();
    let wait = std::time::Duration::from_secs(job.timeout_s);
    // a serving node restarted must serve again; a batch job must finish what it accepted
    let keep_searching = p.serve || !shared.pending().is_empty();
    let missed = |e: &troupe_actors::coe::CoeError| {
        crate::progress::println(format!("coe: {e}; still waiting (the job must come back)"))
    };
    let found = find_executors_for_job(&runtime.actors, &names, wait, keep_searching, missed).await?;
    println!(
        "coe: serving {} requests through {} ({}), policy {}",
        shared.total(),
        found.iter().map(|f| format!("{} on {}", f.name, f.node)).collect::<Vec<_>>().join(", "),
        if troupe_kernels::cuda::cuda_available(0).is_ok() {
            "CUDA present; ONNX Runtime is CPU-only"
        } else {
            "no CUDA: the gpu executor is a CPU stand-in"
        },
        config.label()
    );
    let call_timeout = std::time::Duration::from_secs(p.call_timeout_s.max(1));
    for (exec, x) in found.iter().enumerate() {
        connect_executor(&shared, exec, x, call_timeout);
    }
    let failures = runtime.subscribe_supervision();
    let started = ractor::call!(runtime.supervisor, SupervisorMsg::StartChild, shared.child_spec())
        .map_err(|e| anyhow::anyhow!("asking the root supervisor to start the coe scheduler: {e}"))?;
    started.map_err(|e| anyhow::anyhow!("starting the coe scheduler: {e}"))?;

    // Membership: a down executor node loses its work; one that rejoins serves again.
    let members = runtime.subscribe_membership();
    let nodes: Vec<String> = found.iter().map(|f| f.node.clone()).collect();
    let lost = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::<String>::new()));
    let watcher = {
        use troupe_actors::coe::remote::{ExecutorChange, follow_executors};
        let lost = lost.clone();
        let report = move |change: ExecutorChange| match change {
            ExecutorChange::Down { name, node } => {
                crate::progress::println(format!(
                    "coe: executor {name} on {node} is down; requeueing its work"
                ));
                if let Ok(mut l) = lost.lock() {
                    l.insert(name);
                }
            }
            ExecutorChange::Restored { name, node } => {
                crate::progress::println(format!("coe: executor {name} rejoined on {node}; back in service"));
            }
            ExecutorChange::NotFound { name, error } => {
                crate::progress::println(format!(
                    "coe: executor {name} rejoined but was not found yet: {error}"
                ));
            }
        };
        tokio::spawn(follow_executors(
            shared.clone(),
            runtime.actors.clone(),
            members,
            nodes,
            call_timeout,
            report,
        ))
    };
    if p.serve {
        let limits = troupe_policy::coe::admission::AdmissionLimits {
            per_node: p.queue,
            per_peer: p.queue_per_client,
        };
        let answer_timeout = std::time::Duration::from_secs(p.answer_timeout_s.max(1));
        troupe_actors::coe::requests::serve_requests(
            &runtime.services,
            shared.clone(),
            limits,
            answer_timeout,
        );
        println!(
            "coe: serving requests on {} (at most {} outstanding, {} per client), policy {}",
            ctx.config.listen,
            p.queue,
            p.queue_per_client,
            config.label()
        );
        let served = until_escalation(failures).await;
        runtime.services.unregister(troupe_actors::coe::requests::REQUEST_SERVICE);
        watcher.abort();
        return served;
    }
    let bar = crate::progress::bar(shared.total() as u64, "coe requests");
    bar.set_position(answered as u64);
    let progress = {
        let mut answered = shared.answered();
        let total = shared.total();
        let bar = bar.clone();
        tokio::spawn(async move {
            let mut last = 0;
            while answered.changed().await.is_ok() {
                let done = *answered.borrow_and_update();
                bar.set_position(done as u64);
                // the last line is printed by the job itself once everything is answered
                for step in (last / 25 + 1)..=(done.min(total.saturating_sub(1)) / 25) {
                    crate::progress::println(format!("coe: completed {} of {total}", step * 25));
                }
                last = done;
            }
        })
    };
    let served =
        serve_trace(&shared, p.arrival_scale, std::time::Duration::from_secs(job.timeout_s), failures).await;
    watcher.abort();
    progress.abort();
    bar.finish_and_clear();
    served?;
    println!("coe: completed {0} of {0}", shared.total());
    let lost: Vec<String> = lost.lock().map(|l| l.iter().cloned().collect()).unwrap_or_default();
    let report = shared.report(config.label(), lost)?;
    println!("coe: {}", run_line(&report));
    if !report.lost.is_empty() {
        println!("coe: lost executors {:?}; their work was reassigned", report.lost);
    }
    let (restored, after) = shared.restorations();
    if restored > 0 {
        println!("coe: {restored} executor restorations; {after} requests ran on a restored executor");
    }
    summary("coe job summary", &report)
        .row("resumed from the journal", format!("{answered} answered before this start"))
        .row("executor restorations", format!("{restored} ({after} requests ran on a restored one)"))
        .print();
    if let Some(out) = &p.out {
        app::write_file(Path::new(out), troupe_actors::coe::runner::results_text(&report).as_bytes())?;
    }
    // The answers are out: the journal has done its job, and a rerun starts afresh. It goes
    // before the last line, so whoever waits for that line finds the job wholly finished.
    if let Some(path) = shared.finish_journal()
        && let Err(e) = std::fs::remove_file(&path)
    {
        println!("coe: could not remove the finished job's journal {}: {e}", path.display());
    }
    if let Some(out) = &p.out {
        println!("coe: results written to {out}");
    }
    Ok(())
}

/// Waits until the scheduler's supervisor gives up on it (serve mode ends by the job's
/// timeout otherwise); restarts are logged.
async fn until_escalation(
    mut failures: tokio::sync::broadcast::Receiver<troupe_actors::supervisor::SupervisorEvent>,
) -> Result<()> {
    use tokio::sync::broadcast::error::RecvError;
    use troupe_actors::supervisor::SupervisorEvent;
    loop {
        match failures.recv().await {
            Ok(SupervisorEvent::Escalated { child, reason, .. }) => {
                bail!("{child} failed past its restart intensity: {reason}")
            }
            Ok(SupervisorEvent::Restarted { child, reason, .. }) => {
                println!("coe: {child} restarted ({reason}); its accepted requests are rescheduled");
            }
            Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => bail!("the scheduler's supervisor stopped"),
        }
    }
}

/// Links executor `exec` (found on the cluster) to the job: commands go out in order through
/// its typed handle, its events come back tagged with the new link's generation.
fn connect_executor(
    shared: &std::sync::Arc<troupe_actors::coe::serve::CoeShared>,
    exec: usize,
    x: &troupe_actors::coe::remote::RemoteExecutor,
    call_timeout: std::time::Duration,
) {
    let link = troupe_actors::coe::link::ExecLink::Remote { handle: x.handle.clone(), timeout: call_timeout };
    shared.install_link(exec, link);
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use troupe_policy::coe::{EvictionPolicy, SchedulerConfig};

    use super::*;

    /// The `troupe coe ...` part of the command line (the whole one is troupe-cli's).
    #[derive(Parser, Debug)]
    enum Cli {
        Coe {
            #[command(subcommand)]
            command: CoeCommand,
        },
    }

    fn run_args(extra: &[&str]) -> Result<CoeCommand, clap::Error> {
        let args = ["troupe", "coe", "run"].iter().chain(extra);
        Cli::try_parse_from(args).map(|Cli::Coe { command }| command)
    }

    fn eviction_of(cmd: CoeCommand) -> Option<EvictionPolicy> {
        match cmd {
            CoeCommand::Run { eviction, .. } => eviction,
            other => panic!("parsed as {other:?}"),
        }
    }

    fn gen_args(extra: &[&str]) -> Result<CoeCommand, clap::Error> {
        let args = ["troupe", "coe", "gen"].iter().chain(extra);
        Cli::try_parse_from(args).map(|Cli::Coe { command }| command)
    }

    #[test]
    fn budget_fractions_outside_zero_one_are_refused_by_the_cli() {
        for flag in ["--device-budget", "--host-budget"] {
            for bad in ["0", "-0.1", "1.5", "nan", "x"] {
                let e = gen_args(&[&format!("{flag}={bad}")]).unwrap_err().to_string();
                assert!(e.contains(flag) && e.contains(bad), "{flag} {bad}: {e}");
            }
            match gen_args(&[flag, "1"]).unwrap() {
                CoeCommand::Gen { knobs, .. } => {
                    assert_eq!(knobs.device_budget.or(knobs.host_budget), Some(1.0));
                }
                other => panic!("{other:?}"),
            }
        }
        let e = gen_args(&["--device-budget", "2"]).unwrap_err().to_string();
        assert!(e.contains("(0, 1]"), "{e}");
        assert!(gen_args(&["--zipf", "-1"]).is_err() && gen_args(&["--rate", "0"]).is_err());
    }

    #[test]
    fn eviction_flag_takes_each_name_and_refuses_others_naming_the_valid_ones() {
        assert_eq!(eviction_of(run_args(&[]).unwrap()), None);
        for p in EvictionPolicy::ALL {
            assert_eq!(eviction_of(run_args(&["--eviction", p.name()]).unwrap()), Some(p));
        }
        let e = run_args(&["--eviction", "fifo"]).unwrap_err().to_string();
        assert!(e.contains("fifo"), "{e}");
        for name in ["two-stage", "two-stage+lookahead", "lru"] {
            assert!(e.contains(name), "{e:?} does not name {name}");
        }
    }

    #[test]
    fn eviction_replaces_the_policy_s_own_and_defaults_to_lookahead_for_ours() {
        assert_eq!(config("ours", None).unwrap().eviction, EvictionPolicy::TwoStageLookahead);
        let paper = config("ours", Some(EvictionPolicy::TwoStage)).unwrap();
        assert_eq!(paper, SchedulerConfig::paper_two_stage());
        assert_eq!(paper.label(), "paper-two-stage");
        assert_eq!(config("fcfs+lru", None).unwrap(), SchedulerConfig::fcfs_lru());
        assert_eq!(config("paper-two-stage", None).unwrap(), SchedulerConfig::paper_two_stage());
        let e = policy("best").unwrap_err().to_string();
        assert!(e.contains("paper-two-stage") && e.contains("fcfs+lru"), "{e}");
    }

    fn validate_job(j: &crate::config::JobConfig) -> Result<(), (String, String)> {
        use crate::config::KindCheck;
        crate::kinds::Kinds::builtin().check_job(j)
    }

    fn job_with(params: &str) -> crate::config::JobConfig {
        crate::config::JobConfig {
            kind: "coe".into(),
            timeout_s: 60,
            params: toml::from_str(params).unwrap(),
        }
    }

    #[test]
    fn serve_params_take_bounded_queues_and_refuse_zero_or_huge_ones() {
        let p: CoeJob = super::super::params(&job_with("dir = \"d\"\nserve = true").params).unwrap();
        assert!(p.serve && p.queue == 64 && p.queue_per_client == 16);
        assert!(
            validate_job(&job_with("dir = \"d\"\nserve = true\nqueue = 2\nqueue_per_client = 1")).is_ok()
        );
        let (f, e) = validate_job(&job_with("dir = \"d\"\nserve = true\nqueue = 0")).unwrap_err();
        assert_eq!(f, "params.queue", "{e}");
        let (f, e) = validate_job(&job_with("dir = \"d\"\nqueue_per_client = 70000")).unwrap_err();
        assert_eq!(f, "params.queue_per_client", "{e}");
        assert!(e.contains("70000"), "{e}");
    }

    #[test]
    fn the_journal_compaction_threshold_defaults_to_64_mib_and_is_bounded() {
        let p: CoeJob = super::super::params(&job_with("dir = \"d\"").params).unwrap();
        assert_eq!(p.journal_compact_mib, 64);
        assert!(validate_job(&job_with("dir = \"d\"\njournal_compact_mib = 512")).is_ok());
        for bad in [0, 513] {
            let (f, e) =
                validate_job(&job_with(&format!("dir = \"d\"\njournal_compact_mib = {bad}"))).unwrap_err();
            assert_eq!(f, "params.journal_compact_mib", "{e}");
        }
    }

    #[test]
    fn job_params_take_an_eviction_name_and_refuse_unknown_ones() {
        assert!(validate_job(&job_with("dir = \"d\"")).is_ok());
        assert!(validate_job(&job_with("dir = \"d\"\neviction = \"two-stage\"")).is_ok());
        let (f, e) = validate_job(&job_with("dir = \"d\"\neviction = \"mru\"")).unwrap_err();
        assert_eq!(f, "params.eviction", "{e}");
        assert!(e.contains("two-stage+lookahead") && e.contains("lru"), "{e}");
        let p: CoeJob = super::super::params(&job_with("dir = \"d\"\neviction = \"lru\"").params).unwrap();
        assert_eq!(p.config().unwrap(), SchedulerConfig::scheduling_only());
        let p: CoeJob = super::super::params(&job_with("dir = \"d\"").params).unwrap();
        assert_eq!(p.config().unwrap(), SchedulerConfig::ours());
    }
}
