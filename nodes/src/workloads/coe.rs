//! Workload `coe`: `troupe coe gen | profile | run`, the CoServe-style CoE application on real
//! ONNX experts (see `troupe_actors::coe`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use troupe_actors::coe::app::{self, App, Scale};
use troupe_actors::coe::profiler;
use troupe_actors::coe::runner::{RunOptions, RunReport, run_local};
use troupe_policy::coe::{LatencyModel, Profile, SchedulerConfig};

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
        /// `ours`, `fcfs+lru`, `sched-only` or `evict-only`.
        #[arg(long, default_value = "ours")]
        policy: String,
    },
}

/// Parse a scale name.
pub fn scale(name: &str) -> Result<Scale> {
    Scale::from_name(name).with_context(|| format!("unknown scale {name:?} (use ci or paper)"))
}

/// Parse a policy label.
pub fn policy(label: &str) -> Result<SchedulerConfig> {
    SchedulerConfig::combinations()
        .into_iter()
        .find(|c| c.label() == label)
        .with_context(|| format!("unknown policy {label:?} (use ours, fcfs+lru, sched-only, evict-only)"))
}

/// The app folder: `dir` or the scale's default.
pub fn app_dir(scale: Scale, dir: Option<PathBuf>) -> PathBuf {
    dir.unwrap_or_else(|| scale.default_dir())
}

/// Generate and print a summary.
pub fn gen_app(dir: &Path, scale: Scale, seed: u64) -> Result<()> {
    let r = app::generate(dir, scale, seed).with_context(|| format!("generating the {} app in {}", scale.name(), dir.display()))?;
    println!(
        "coe gen: {} experts (depth {}), {:.1} MB of ONNX ({:.2}-{:.2} MB each), {} requests, random-init weights, usage probabilities pre-assessed on digit images; {:.1}s -> {}",
        r.experts,
        r.depth,
        r.total_bytes as f64 / 1e6,
        r.min_bytes as f64 / 1e6,
        r.max_bytes as f64 / 1e6,
        r.requests,
        r.seconds,
        dir.display()
    );
    Ok(())
}

/// Profile and write the file.
pub fn profile_app(dir: &Path, out: &Path) -> Result<Profile> {
    let app = App::open(dir, None)?;
    let profile = profiler::profile(&app, &profiler::default_plan(&app))?;
    app::write_file(out, profile.to_text().as_bytes())?;
    println!("coe profile: {} executors measured on `{}` -> {}", profile.executors.len(), profile.hardware_fingerprint, out.display());
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
        "{:<10} {:>7.1} req/s  loads {:>5} ({:.2}x belady)  switching {:>4.1}%  p50 {:>7.1} ms  p99 {:>7.1} ms",
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
        CoeCommand::Gen { scale: s, dir, seed } => {
            let s = scale(&s)?;
            gen_app(&app_dir(s, dir), s, seed)
        }
        CoeCommand::Profile { scale: s, dir, out } => {
            let dir = app_dir(scale(&s)?, dir);
            let out = out.unwrap_or_else(|| dir.join("profile.txt"));
            profile_app(&dir, &out).map(|_| ())
        }
        CoeCommand::Run { scale: s, dir, trace, profile, policy: p } => {
            let dir = app_dir(scale(&s)?, dir);
            let config = policy(&p)?;
            let app = App::open(&dir, trace.as_deref())?;
            let path = profile.unwrap_or_else(|| dir.join("profile.txt"));
            if !path.is_file() {
                bail!("{} is missing: run `troupe coe profile --dir {}` first", path.display(), dir.display());
            }
            let latency = LatencyModel::from_profile(&profiler::load_profile(&path)?)?;
            let report = run_local(&app, &latency, &RunOptions::new(config))?;
            println!("{}", run_line(&report));
            Ok(())
        }
    }
}
