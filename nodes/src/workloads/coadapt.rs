//! The `coadapt` workload (AdaSprite): a `coadapt-edge` actor that co-adapts the cameras' V-MoEs
//! in one pool, `coadapt-camera` actors that stream drifting frames for their whole stream and
//! upload samples whenever they notice drift, and a `coadapt` job (on the edge node) that waits
//! until every camera's stream ended and every adaptation came back, then prints each
//! adaptation's exact match and accuracy before and after, the pool's memory and fragmentation
//! over time, and (with `out`) writes accuracy over time per camera as CSV and an SVG plot.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use troupe_actors::NodeRuntime;
use troupe_actors::coadapt::camera::{CameraActor, CameraArgs, CameraCompute};
use troupe_actors::coadapt::detect::DetectorConfig;
use troupe_actors::coadapt::edge::{EdgeArgs, EdgeCompute, EdgeShared};
use troupe_actors::coadapt::engine::{EngineConfig, SchedulerChoice};
use troupe_actors::coadapt::student_config;
use troupe_actors::coadapt::wire::{DecodeBudget, EdgeSummary, MAX_ADAPTATIONS, MAX_DECODED_BYTES, decode};
use troupe_actors::supervisor::ChildSpec;
use troupe_kernels::drift::DriftSchedule;

use super::NodeContext;
use crate::chart::{Curve, LineChart, Mark};
use crate::config::{ActorConfig, JobConfig};

/// `params` of a `coadapt-edge` actor.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeParams {
    /// Pool budget in MiB (the device memory given to co-adaptation).
    #[serde(default = "default_memory_mb")]
    pub memory_mb: u64,
    /// `twin` (ours), `ams`, `recl` or `fifo`.
    #[serde(default = "default_scheduler")]
    pub scheduler: String,
    /// Exact-match gain at which a task completes.
    #[serde(default = "default_target_gain")]
    pub target_gain: f64,
    /// Epoch cap per task.
    #[serde(default = "default_max_epochs")]
    pub max_epochs: u32,
    /// Optimiser steps per epoch.
    #[serde(default = "default_steps")]
    pub steps_per_epoch: usize,
    /// Student sizes the cameras run.
    #[serde(default = "default_students")]
    pub students: Vec<String>,
    /// Seed of the edge's sampling.
    #[serde(default)]
    pub seed: u64,
    /// The edge's journal (default `.cache/coadapt/journal/NODE.journal`): uploads, reports and
    /// answers, so a restarted edge node resumes; removed when the node's `coadapt` job is done.
    #[serde(default)]
    pub journal: Option<PathBuf>,
    /// The reuse cache's storage reads throttled to this many bytes per second, an edge board's
    /// storage (cgroup v1 blkio or v2 io; the node fails to start where it cannot be set); 0 or
    /// absent: unthrottled.
    #[serde(default)]
    pub storage_read_bps: u64,
}

/// `params` of a `coadapt-camera` actor.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraParams {
    /// Student size (`tiny`, `small`, `base`, `large`, `sprite`: the paper's shape).
    #[serde(default = "default_model")]
    pub model: String,
    /// Drift schedule lines `start_frame corruption severity`.
    pub drift: Vec<String>,
    /// Seeds the stream.
    pub seed: u64,
    /// Frames uploaded after drift is noticed.
    #[serde(default = "default_uploads")]
    pub uploads: usize,
    /// Frames in the held-out evaluation window.
    #[serde(default = "default_eval")]
    pub eval: usize,
    /// Confidence drop that counts as drift.
    #[serde(default = "default_drop")]
    pub drop: f64,
    /// Move of the input's pixel mean or contrast (pixels in 0..1) that counts as drift.
    #[serde(default = "default_shift")]
    pub shift: f64,
    /// Frames the camera streams in all (its stream then ends).
    #[serde(default = "default_frames")]
    pub frames: u64,
    /// Most adaptations the camera asks for over its stream.
    #[serde(default = "default_max_adaptations")]
    pub max_adaptations: u32,
    /// Batches of 64 frames between progress reports to the edge.
    #[serde(default = "default_report_every")]
    pub report_every: u64,
    /// Seconds to wait for the edge (to appear and to answer).
    #[serde(default = "default_edge_timeout")]
    pub edge_timeout_s: u64,
    /// The adaptation objective: exact-match gain to reach (0 = the edge's `target_gain`).
    #[serde(default)]
    pub target_gain: f64,
}

/// `params` of the `coadapt` job.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoadaptJob {
    /// Cameras to wait for: the job ends when this many cameras have streamed to their end and
    /// had every adaptation answered (cameras that join late included).
    pub cameras: u32,
    /// Smallest exact-match gain every adaptation must show for the job to succeed.
    #[serde(default)]
    pub min_gain: f64,
    /// Folder for `accuracy.csv`, `adaptations.csv` and `accuracy.svg` (none when absent).
    #[serde(default)]
    pub out: Option<PathBuf>,
}

fn default_memory_mb() -> u64 {
    64
}
fn default_scheduler() -> String {
    "twin".into()
}
fn default_target_gain() -> f64 {
    0.10
}
fn default_max_epochs() -> u32 {
    30
}
fn default_steps() -> usize {
    8
}
fn default_students() -> Vec<String> {
    vec!["tiny".into()]
}
fn default_model() -> String {
    "tiny".into()
}
fn default_uploads() -> usize {
    320
}
fn default_eval() -> usize {
    256
}
fn default_drop() -> f64 {
    0.08
}
fn default_shift() -> f64 {
    0.05
}
fn default_frames() -> u64 {
    1536
}
fn default_max_adaptations() -> u32 {
    4
}
fn default_report_every() -> u64 {
    4
}
fn default_edge_timeout() -> u64 {
    300
}

/// Checks a `coadapt-edge` entry's params.
pub fn check_edge(p: &EdgeParams) -> Result<(), (String, String)> {
    let bad = |f: &str, m: String| Err((f.to_string(), m));
    if p.memory_mb == 0 || p.memory_mb > 1 << 20 {
        return bad("memory_mb", "must be between 1 and 1048576".into());
    }
    if SchedulerChoice::parse(&p.scheduler).is_none() {
        return bad("scheduler", format!("unknown scheduler {:?} (twin, ams, recl, fifo)", p.scheduler));
    }
    if !(p.target_gain > 0.0 && p.target_gain < 1.0) {
        return bad("target_gain", "must be in (0, 1)".into());
    }
    if p.max_epochs == 0 || p.steps_per_epoch == 0 {
        return bad("max_epochs", "max_epochs and steps_per_epoch must be at least 1".into());
    }
    if let Some(s) = p.students.iter().find(|s| student_config(s).is_err()) {
        return bad("students", format!("unknown student size {s:?} (tiny, small, base, large, sprite)"));
    }
    if let Err(why) = troupe_policy::adapt::storage::check_read_bps(p.storage_read_bps) {
        return bad("storage_read_bps", why);
    }
    Ok(())
}

/// Checks a `coadapt-camera` entry's params and returns its drift schedule.
pub fn camera_schedule(p: &CameraParams) -> Result<DriftSchedule, (String, String)> {
    let bad = |f: &str, m: String| Err((f.to_string(), m));
    if let Err(e) = student_config(&p.model) {
        return bad("model", e.to_string());
    }
    let schedule = match DriftSchedule::parse(&p.drift.join("\n")) {
        Ok(s) => s,
        Err(e) => return bad("drift", e.to_string()),
    };
    if p.uploads < 64 || p.uploads > 10_000 || p.eval < 32 || p.eval > 10_000 {
        return bad("uploads", "uploads must be 64..=10000 and eval 32..=10000".into());
    }
    if !(0.0..1.0).contains(&p.target_gain) {
        return bad("target_gain", "must be in 0..1 (0 = the edge's default)".into());
    }
    if !(p.drop > 0.0 && p.drop < 1.0) {
        return bad("drop", "must be in (0, 1)".into());
    }
    if !(p.shift > 0.0 && p.shift < 1.0) {
        return bad("shift", "must be in (0, 1)".into());
    }
    if p.frames < 64 || p.frames > 1 << 24 {
        return bad("frames", "must be 64..=16777216".into());
    }
    if p.max_adaptations as usize > MAX_ADAPTATIONS {
        return bad("max_adaptations", format!("must be at most {MAX_ADAPTATIONS}"));
    }
    if p.report_every == 0 {
        return bad("report_every", "must be at least 1".into());
    }
    Ok(schedule)
}

/// Checks the `coadapt` job's params.
pub fn check_job(p: &CoadaptJob) -> Result<(), (String, String)> {
    if p.cameras == 0 {
        return Err(("cameras".into(), "must be at least 1".into()));
    }
    Ok(())
}

/// The edges this node runs (set when its actors are built, read by its job).
static LOCAL_EDGES: std::sync::Mutex<Vec<std::sync::Arc<EdgeShared>>> = std::sync::Mutex::new(Vec::new());

/// The child specs of a `coadapt-edge` entry: its front and its scheduler.
pub fn edge_actor(ctx: &NodeContext, a: &ActorConfig, p: EdgeParams) -> Result<Vec<ChildSpec>> {
    let name = a.actor_name();
    let engine = EngineConfig {
        budget: p.memory_mb << 20,
        scheduler: SchedulerChoice::parse(&p.scheduler).context("scheduler")?,
        steps_per_epoch: p.steps_per_epoch,
        max_epochs: p.max_epochs,
        target_gain: p.target_gain,
        seed: p.seed,
        storage_read_bps: p.storage_read_bps,
        ..EngineConfig::default()
    };
    let journal = p.journal.clone().unwrap_or_else(|| {
        PathBuf::from(".cache/coadapt/journal").join(format!("{}.journal", ctx.config.name))
    });
    let (edge, resumed) =
        EdgeShared::open(EdgeArgs { engine, expected: p.students, compute: EdgeCompute::Real }, &journal)
            .map_err(|e| anyhow::anyhow!("coadapt edge: {e}"))?;
    for d in &resumed.damage {
        println!("coadapt: journal {}: {d}; that record was not replayed", journal.display());
    }
    if resumed.pending + resumed.answered as usize + resumed.cameras > 0 {
        println!(
            "coadapt: resuming from journal {}: {} uploads pending, {} adaptations answered, {} cameras known",
            journal.display(),
            resumed.pending,
            resumed.answered,
            resumed.cameras
        );
    }
    let children = edge.children(&ctx.actors, name).map_err(|e| anyhow::anyhow!("coadapt edge: {e}"))?;
    if let Ok(mut edges) = LOCAL_EDGES.lock() {
        edges.push(edge.clone());
    }
    Ok(children)
}

/// The child spec of a `coadapt-camera` entry.
pub fn camera_actor(ctx: &NodeContext, a: &ActorConfig, p: CameraParams) -> Result<Vec<ChildSpec>> {
    let schedule = camera_schedule(&p).map_err(|(f, m)| anyhow::anyhow!("params.{f}: {m}"))?;
    let args = CameraArgs {
        name: ctx.config.name.clone(),
        model: p.model,
        schedule,
        seed: p.seed,
        detector: DetectorConfig { drop: p.drop, ..DetectorConfig::default() },
        shift: p.shift,
        uploads: p.uploads,
        eval: p.eval,
        frames: p.frames,
        max_adaptations: p.max_adaptations,
        report_every: p.report_every,
        edge_timeout: Duration::from_secs(p.edge_timeout_s),
        target_gain: p.target_gain,
        actors: ctx.actors.clone(),
        compute: CameraCompute::Real,
    };
    Ok(vec![ChildSpec::new(a.actor_name(), move || (CameraActor, args.clone()))])
}

/// Waits until every camera is done (see [`CoadaptJob::cameras`]), prints the results, writes the
/// accuracy files; fails naming what is missing when the job's timeout passes first.
pub async fn run_job(
    _runtime: &NodeRuntime,
    _ctx: &NodeContext,
    job: &JobConfig,
    p: CoadaptJob,
) -> Result<()> {
    // a second before the node's own job timeout, so this job's failure names what is missing
    let wait = Duration::from_secs(job.timeout_s).saturating_sub(Duration::from_secs(1));
    let deadline = tokio::time::Instant::now() + wait;
    let edge = LOCAL_EDGES
        .lock()
        .ok()
        .and_then(|e| e.first().cloned())
        .context("no coadapt-edge actor on this node (add one to [[actors]])")?;
    println!("coadapt: waiting for {} cameras to stream to their end", p.cameras);
    let (tx, rx) = ractor::concurrency::oneshot();
    edge.wait_summary(p.cameras, tx.into()).map_err(|e| anyhow::anyhow!("asking the edge: {e}"))?;
    let bar = crate::progress::spinner("coadapt frames");
    let poll = (!bar.is_hidden()).then(|| {
        let (edge, bar) = (edge.clone(), bar.clone());
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_millis(500));
            loop {
                every.tick().await;
                let s = edge.streamed();
                if s.frames > 0 {
                    crate::progress::set_total(&bar, s.frames);
                }
                bar.set_position(s.frame);
                bar.set_message(format!(
                    "{} cameras, adaptations {} of {}",
                    s.cameras, s.answered, s.requested
                ));
            }
        })
    });
    let answer = tokio::time::timeout_at(deadline, rx).await;
    if let Some(poll) = poll {
        poll.abort();
    }
    bar.finish_and_clear();
    let Ok(answer) = answer else {
        let missing = edge.progress(p.cameras).missing;
        bail!("coadapt: not done within {} s: {}", wait.as_secs(), missing.join("; "));
    };
    let bytes = answer.context("the edge dropped the summary request")?;
    let s: EdgeSummary = decode("edge summary", &bytes, &mut DecodeBudget::new(MAX_DECODED_BYTES))?;
    print!("{}", render(&s));
    if let Some(dir) = &p.out {
        write_outputs(dir, &s)?;
        println!("coadapt: accuracy over time written to {}", dir.join("accuracy.svg").display());
    }
    summary(&s).print();
    let mut failures = Vec::new();
    for c in &s.cameras {
        if !c.error.is_empty() {
            failures.push(format!("{}: {}", c.camera, c.error));
        }
        for a in &c.adaptations {
            if !a.error.is_empty() {
                failures.push(format!("{} adaptation {}: {}", a.camera, a.adaptation, a.error));
            } else if a.exact_after - a.exact_before < p.min_gain {
                failures.push(format!(
                    "{} adaptation {}: gain {:.3} below {:.3}",
                    a.camera,
                    a.adaptation,
                    a.exact_after - a.exact_before,
                    p.min_gain
                ));
            }
        }
    }
    if s.peak_used > s.budget {
        failures.push(format!("pool peak {} exceeded its budget {}", s.peak_used, s.budget));
    }
    if !failures.is_empty() {
        bail!("coadapt: {}", failures.join("; "));
    }
    if let Some(path) = edge.finish_journal()
        && let Err(e) = std::fs::remove_file(&path)
    {
        tracing::warn!(journal = %path.display(), "removing the finished job's journal: {e}");
    }
    println!("coadapt: done");
    Ok(())
}

/// The job's printout (stable lines the tests read: one `coadapt: camera NAME drift_frame ...`
/// line per adaptation, one `coadapt: stream NAME ...` line per camera).
pub fn render(s: &EdgeSummary) -> String {
    let mut out = String::new();
    for c in &s.cameras {
        for a in &c.adaptations {
            if a.error.is_empty() {
                let _ = writeln!(
                    out,
                    "coadapt: camera {} drift_frame {} exact_match_vs_teacher {:.3} -> {:.3} accuracy {:.3} -> {:.3} edge_latency_ms {} adaptation {} installed_frame {}",
                    a.camera,
                    a.drift_frame,
                    a.exact_before,
                    a.exact_after,
                    a.accuracy_before,
                    a.accuracy_after,
                    a.latency_ms,
                    a.adaptation,
                    a.installed_frame
                );
            } else {
                let _ = writeln!(
                    out,
                    "coadapt: camera {} adaptation {} failed: {}",
                    a.camera, a.adaptation, a.error
                );
            }
        }
        let _ = writeln!(
            out,
            "coadapt: stream {} frames {} ended {} adaptations {} of {} requested accuracy_samples {}{}",
            c.camera,
            c.frame,
            c.ended,
            c.adaptations.iter().filter(|a| a.error.is_empty()).count(),
            c.requested,
            c.samples.len(),
            if c.error.is_empty() { String::new() } else { format!(" failed: {}", c.error) }
        );
    }
    let _ = writeln!(
        out,
        "coadapt: scheduler {} tasks_done {} pool_budget {} peak_used {} within_budget {}",
        s.scheduler,
        s.tasks_done,
        s.budget,
        s.peak_used,
        s.peak_used <= s.budget
    );
    let _ = writeln!(
        out,
        "coadapt: fragmentation over {} pool events: mean {:.3} max {:.3}",
        s.events, s.mean_fragmentation, s.max_fragmentation
    );
    for (event, used, frag) in &s.timeline {
        let _ = writeln!(out, "coadapt:   event {event:>5} used {used:>10} fragmentation {frag:.3}");
    }
    out
}

/// The table printed at the end of the job: cameras, frames, adaptations and their mean gain
/// and latency, failures, the pool against its budget.
pub fn summary(s: &EdgeSummary) -> crate::summary::Summary {
    let done: Vec<_> = s.cameras.iter().flat_map(|c| &c.adaptations).filter(|a| a.error.is_empty()).collect();
    let failed = s.cameras.iter().flat_map(|c| &c.adaptations).filter(|a| !a.error.is_empty()).count();
    let streams_failed = s.cameras.iter().filter(|c| !c.error.is_empty()).count();
    let requested: u64 = s.cameras.iter().map(|c| u64::from(c.requested)).sum();
    let mean = |f: &dyn Fn(&&troupe_actors::coadapt::wire::CameraReport) -> f64| {
        if done.is_empty() { f64::NAN } else { done.iter().map(f).sum::<f64>() / done.len() as f64 }
    };
    let gain = mean(&|a| a.exact_after - a.exact_before);
    let latency = mean(&|a| a.latency_ms as f64);
    crate::summary::Summary::new("coadapt job summary")
        .row("scheduler", s.scheduler.clone())
        .row("cameras", s.cameras.len().to_string())
        .row("frames streamed", s.cameras.iter().map(|c| c.frame).sum::<u64>().to_string())
        .row("adaptations", format!("{} installed of {requested} requested", done.len()))
        .row("mean exact-match gain", if gain.is_finite() { format!("{gain:+.3}") } else { "-".into() })
        .row("mean edge latency", crate::summary::ms(latency))
        .row("failures", format!("{failed} adaptations, {streams_failed} streams"))
        .row(
            "pool peak",
            format!(
                "{:.1} of {:.1} MiB ({})",
                s.peak_used as f64 / 1048576.0,
                s.budget as f64 / 1048576.0,
                if s.peak_used <= s.budget { "within budget" } else { "OVER BUDGET" }
            ),
        )
        .row("fragmentation", format!("mean {:.3}, max {:.3}", s.mean_fragmentation, s.max_fragmentation))
}

/// `accuracy.csv` (camera, frame, accuracy, confidence), `adaptations.csv` and `accuracy.svg`
/// under `dir`.
pub fn write_outputs(dir: &Path, s: &EdgeSummary) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut acc = String::from("camera,frame,accuracy,confidence\n");
    let mut adapt = String::from(
        "camera,adaptation,drift_frame,installed_frame,exact_before,exact_after,accuracy_before,accuracy_after,edge_latency_ms,error\n",
    );
    for c in &s.cameras {
        for x in &c.samples {
            let _ = writeln!(acc, "{},{},{:.4},{:.4}", c.camera, x.frame, x.accuracy, x.confidence);
        }
        for a in &c.adaptations {
            let _ = writeln!(
                adapt,
                "{},{},{},{},{:.4},{:.4},{:.4},{:.4},{},{:?}",
                a.camera,
                a.adaptation,
                a.drift_frame,
                a.installed_frame,
                a.exact_before,
                a.exact_after,
                a.accuracy_before,
                a.accuracy_after,
                a.latency_ms,
                a.error
            );
        }
    }
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    };
    write("accuracy.csv", &acc)?;
    write("adaptations.csv", &adapt)?;
    write("accuracy.svg", &accuracy_chart(s).render())
}

/// Accuracy over time per camera: one curve each, its drift phases dashed and its installed
/// updates solid in its colour.
pub fn accuracy_chart(s: &EdgeSummary) -> LineChart {
    let end = s.cameras.iter().map(|c| c.frames.max(c.frame)).max().unwrap_or(1).max(1) as f64;
    let mut marks = Vec::new();
    for (i, c) in s.cameras.iter().enumerate() {
        for p in c.phases.iter().filter(|p| p.start_frame > 0) {
            marks.push(Mark {
                x: p.start_frame as f64,
                curve: Some(i),
                dashed: true,
                label: p.weather.clone(),
            });
        }
        for a in c.adaptations.iter().filter(|a| a.error.is_empty()) {
            marks.push(Mark {
                x: a.installed_frame as f64,
                curve: Some(i),
                dashed: false,
                label: format!("update {}", a.adaptation + 1),
            });
        }
    }
    LineChart {
        title: "coadapt: accuracy over time per camera (dashed: drift phase starts; solid: update installed)"
            .into(),
        x_label: "frame".into(),
        x_range: (0.0, end),
        x_ticks: (0..=4).map(|k| (end * k as f64 / 4.0, format!("{:.0}", end * k as f64 / 4.0))).collect(),
        reference: None,
        curves: s
            .cameras
            .iter()
            .map(|c| Curve {
                name: c.camera.clone(),
                points: c.samples.iter().map(|x| (x.frame as f64, f64::from(x.accuracy))).collect(),
            })
            .collect(),
        marks,
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

    fn actor(kind: &str, params: &str) -> ActorConfig {
        ActorConfig { kind: kind.into(), name: None, params: toml::from_str(params).unwrap() }
    }

    #[test]
    fn params_are_checked_field_by_field() {
        assert!(validate_actor(&actor("coadapt-edge", "memory_mb = 4\nscheduler = \"ams\"")).is_ok());
        let e = validate_actor(&actor("coadapt-edge", "scheduler = \"lottery\"")).unwrap_err();
        assert_eq!(e.0, "params.scheduler", "{e:?}");
        let e = validate_actor(&actor("coadapt-edge", "students = [\"teacher\"]")).unwrap_err();
        assert_eq!(e.0, "params.students", "{e:?}");
        assert!(validate_actor(&actor("coadapt-edge", "storage_read_bps = 90000000")).is_ok());
        for bad in ["1", "100000000000"] {
            let e = validate_actor(&actor("coadapt-edge", &format!("storage_read_bps = {bad}"))).unwrap_err();
            assert_eq!(e.0, "params.storage_read_bps", "{e:?}");
        }
        let cam = "seed = 1\ndrift = [\"0 clean 0\", \"100 fog 0.8\"]";
        assert!(validate_actor(&actor("coadapt-camera", cam)).is_ok());
        let e = validate_actor(&actor("coadapt-camera", "seed = 1\ndrift = [\"0 hail 0.5\"]")).unwrap_err();
        assert_eq!(e.0, "params.drift");
        assert!(e.1.contains("hail"), "{e:?}");
        let e = validate_actor(&actor("coadapt-camera", &format!("{cam}\nmodel = \"huge\""))).unwrap_err();
        assert_eq!(e.0, "params.model");
        let e = validate_actor(&actor("coadapt-camera", &format!("{cam}\ncolour = 1"))).unwrap_err();
        assert!(e.0.contains("colour"), "{e:?}");
        let job = JobConfig {
            kind: "coadapt".into(),
            timeout_s: 10,
            params: toml::from_str("cameras = 0").unwrap(),
        };
        assert_eq!(validate_job(&job).unwrap_err().0, "params.cameras");
    }

    fn summary() -> EdgeSummary {
        use troupe_actors::coadapt::wire::{AccuracySample, CameraReport, PhaseMark, StreamReport};
        let adaptation = |k: u32, drift: u64| CameraReport {
            camera: "cam-1".into(),
            adaptation: k,
            drift_frame: drift,
            installed_frame: drift + 256,
            exact_before: 0.25,
            exact_after: 0.8125,
            accuracy_before: 0.2,
            accuracy_after: 0.7,
            latency_ms: 5,
            error: String::new(),
        };
        EdgeSummary {
            cameras: vec![StreamReport {
                camera: "cam-1".into(),
                frame: 1000,
                frames: 1000,
                ended: true,
                requested: 2,
                phases: vec![
                    PhaseMark { start_frame: 0, weather: "clean 0".into() },
                    PhaseMark { start_frame: 250, weather: "fog 0.8".into() },
                ],
                samples: vec![
                    AccuracySample { frame: 0, accuracy: 1.0, confidence: 0.9 },
                    AccuracySample { frame: 1000, accuracy: 0.5, confidence: 0.6 },
                ],
                adaptations: vec![adaptation(0, 320), adaptation(1, 700)],
                error: String::new(),
            }],
            budget: 100,
            peak_used: 90,
            events: 2,
            max_fragmentation: 0.5,
            mean_fragmentation: 0.25,
            timeline: vec![(0, 10, 0.0)],
            tasks_done: 2,
            scheduler: "twin-buffer".into(),
        }
    }

    #[test]
    fn render_names_each_adaptation_and_the_budget_check() {
        let out = render(&summary());
        assert!(out.contains("camera cam-1 drift_frame 320 exact_match_vs_teacher 0.250 -> 0.812"), "{out}");
        assert!(out.contains("adaptation 1 installed_frame 956"), "{out}");
        assert_eq!(out.matches("coadapt: camera cam-1 drift_frame").count(), 2, "{out}");
        assert!(out.contains("coadapt: stream cam-1 frames 1000 ended true adaptations 2 of 2"), "{out}");
        assert!(out.contains("peak_used 90 within_budget true"), "{out}");
    }

    #[test]
    fn the_summary_table_counts_adaptations_and_means_their_gain() {
        let mut s = summary();
        s.cameras[0].adaptations[1].error = "evicted".into();
        let table = super::summary(&s).render();
        assert!(table.contains("| adaptations           | 1 installed of 2 requested"), "{table}");
        assert!(table.contains("| mean exact-match gain | +0.562"), "{table}");
        assert!(table.contains("| failures              | 1 adaptations, 0 streams"), "{table}");
        assert!(table.contains("(within budget)"), "{table}");
    }

    #[test]
    fn the_accuracy_plot_marks_drift_and_updates_per_camera() {
        let chart = accuracy_chart(&summary());
        assert_eq!(chart.x_range, (0.0, 1000.0));
        assert_eq!(chart.curves.len(), 1);
        assert_eq!(chart.curves[0].points, [(0.0, 1.0), (1000.0, 0.5)]);
        // the fog phase (frame 0 is the start, unmarked) dashed, both updates solid
        let marks: Vec<(f64, bool)> = chart.marks.iter().map(|m| (m.x, m.dashed)).collect();
        assert_eq!(marks, [(250.0, true), (576.0, false), (956.0, false)]);
        let dir = tempfile::tempdir().unwrap();
        write_outputs(dir.path(), &summary()).unwrap();
        let csv = std::fs::read_to_string(dir.path().join("accuracy.csv")).unwrap();
        assert_eq!(csv.lines().count(), 3, "{csv}");
        assert!(csv.contains("cam-1,1000,0.5000,0.6000"), "{csv}");
        let svg = std::fs::read_to_string(dir.path().join("accuracy.svg")).unwrap();
        assert_eq!(svg.matches("<polyline").count(), 1);
    }
}
