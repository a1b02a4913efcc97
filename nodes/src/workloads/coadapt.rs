//! The `coadapt` workload (AdaSprite): a `coadapt-edge` actor that co-adapts the cameras' V-MoEs
//! in one pool, `coadapt-camera` actors that stream drifting frames and upload samples when they
//! notice drift, and a `coadapt` job (on the edge node) that waits for every camera's report and
//! prints each camera's exact match and accuracy before and after, plus the pool's memory and
//! fragmentation over time.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use troupe_actors::NodeRuntime;
use troupe_actors::coadapt::camera::{CameraActor, CameraArgs};
use troupe_actors::coadapt::detect::DetectorConfig;
use troupe_actors::coadapt::edge::{EdgeArgs, EdgeShared};
use troupe_actors::coadapt::engine::{EngineConfig, SchedulerChoice};
use troupe_actors::coadapt::student_config;
use troupe_actors::coadapt::wire::{DecodeBudget, EdgeSummary, MAX_DECODED_BYTES, decode};
use troupe_actors::supervisor::ChildSpec;
use troupe_kernels::drift::DriftSchedule;

use super::{NodeContext, params};
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
}

/// `params` of a `coadapt-camera` actor.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraParams {
    /// Student size (`tiny`, `small`, `base`, `large`).
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
    /// Frames after which the camera gives up noticing drift.
    #[serde(default = "default_max_frames")]
    pub max_frames: u64,
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
    /// Camera reports to wait for.
    pub cameras: u32,
    /// Smallest exact-match gain every camera must show for the job to succeed.
    #[serde(default)]
    pub min_gain: f64,
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
fn default_max_frames() -> u64 {
    4096
}
fn default_edge_timeout() -> u64 {
    300
}

fn edge_params(a: &ActorConfig) -> Result<EdgeParams, (String, String)> {
    let p: EdgeParams = params(&a.params)?;
    let bad = |f: &str, m: String| Err((format!("params.{f}"), m));
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
        return bad("students", format!("unknown student size {s:?} (tiny, small, base, large)"));
    }
    Ok(p)
}

fn camera_params(a: &ActorConfig) -> Result<(CameraParams, DriftSchedule), (String, String)> {
    let p: CameraParams = params(&a.params)?;
    let bad = |f: &str, m: String| Err((format!("params.{f}"), m));
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
    Ok((p, schedule))
}

/// Checks a `coadapt-edge` or `coadapt-camera` entry.
pub fn validate_actor(a: &ActorConfig) -> Result<(), (String, String)> {
    match a.kind.as_str() {
        "coadapt-edge" => edge_params(a).map(|_| ()),
        _ => camera_params(a).map(|_| ()),
    }
}

/// Checks the `coadapt` job's params.
pub fn validate_job(j: &JobConfig) -> Result<(), (String, String)> {
    let p: CoadaptJob = params(&j.params)?;
    if p.cameras == 0 {
        return Err(("params.cameras".into(), "must be at least 1".into()));
    }
    Ok(())
}

/// The edges this node runs (set when its actors are built, read by its job).
static LOCAL_EDGES: std::sync::Mutex<Vec<std::sync::Arc<EdgeShared>>> = std::sync::Mutex::new(Vec::new());

/// The child spec of a `coadapt-edge` or `coadapt-camera` entry.
pub fn actor(ctx: &NodeContext, a: &ActorConfig) -> Result<ChildSpec> {
    let name = a.name.clone().unwrap_or_else(|| a.kind.clone());
    let err = |(f, m): (String, String)| anyhow::anyhow!("{f}: {m}");
    if a.kind == "coadapt-edge" {
        let p = edge_params(a).map_err(err)?;
        let engine = EngineConfig {
            budget: p.memory_mb << 20,
            scheduler: SchedulerChoice::parse(&p.scheduler).context("scheduler")?,
            steps_per_epoch: p.steps_per_epoch,
            max_epochs: p.max_epochs,
            target_gain: p.target_gain,
            seed: p.seed,
            ..EngineConfig::default()
        };
        let edge = EdgeShared::new(EdgeArgs { engine, expected: p.students });
        edge.serve(&ctx.services);
        if let Ok(mut edges) = LOCAL_EDGES.lock() {
            edges.push(edge.clone());
        }
        return Ok(edge.child_spec(&name));
    }
    let (p, schedule) = camera_params(a).map_err(err)?;
    let args = CameraArgs {
        name: ctx.config.name.clone(),
        model: p.model,
        schedule,
        seed: p.seed,
        detector: DetectorConfig { drop: p.drop, ..DetectorConfig::default() },
        uploads: p.uploads,
        eval: p.eval,
        max_frames: p.max_frames,
        edge_timeout: Duration::from_secs(p.edge_timeout_s),
        target_gain: p.target_gain,
        services: ctx.services.clone(),
    };
    Ok(ChildSpec::new(name, move || (CameraActor, args.clone())))
}

/// Waits for every camera's report from the local edge and prints the results.
pub async fn run_job(_runtime: &NodeRuntime, _ctx: &NodeContext, job: &JobConfig) -> Result<()> {
    let p: CoadaptJob = params(&job.params).map_err(|(f, e)| anyhow::anyhow!("job.{f}: {e}"))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(job.timeout_s);
    let edge = LOCAL_EDGES
        .lock()
        .ok()
        .and_then(|e| e.first().cloned())
        .context("no coadapt-edge actor on this node (add one to [[actors]])")?;
    println!("coadapt: waiting for {} camera reports", p.cameras);
    let (tx, rx) = ractor::concurrency::oneshot();
    edge.wait_summary(p.cameras, tx.into()).map_err(|e| anyhow::anyhow!("asking the edge: {e}"))?;
    let bytes = tokio::time::timeout_at(deadline, rx)
        .await
        .map_err(|_| anyhow::anyhow!("no summary from the edge within {} s", job.timeout_s))?
        .context("the edge dropped the summary request")?;
    let s: EdgeSummary = decode("edge summary", &bytes, &mut DecodeBudget::new(MAX_DECODED_BYTES))?;
    print!("{}", render(&s));
    let mut failures = Vec::new();
    for c in &s.cameras {
        if !c.error.is_empty() {
            failures.push(format!("{}: {}", c.camera, c.error));
        } else if c.exact_after - c.exact_before < p.min_gain {
            failures.push(format!(
                "{}: gain {:.3} below {:.3}",
                c.camera,
                c.exact_after - c.exact_before,
                p.min_gain
            ));
        }
    }
    if s.peak_used > s.budget {
        failures.push(format!("pool peak {} exceeded its budget {}", s.peak_used, s.budget));
    }
    if !failures.is_empty() {
        bail!("coadapt: {}", failures.join("; "));
    }
    println!("coadapt: done");
    Ok(())
}

/// The job's printout (stable lines the tests read).
pub fn render(s: &EdgeSummary) -> String {
    let mut out = String::new();
    for c in &s.cameras {
        if c.error.is_empty() {
            out.push_str(&format!(
                "coadapt: camera {} drift_frame {} exact_match_vs_teacher {:.3} -> {:.3} accuracy {:.3} -> {:.3} edge_latency_ms {}\n",
                c.camera, c.drift_frame, c.exact_before, c.exact_after, c.accuracy_before, c.accuracy_after, c.latency_ms
            ));
        } else {
            out.push_str(&format!("coadapt: camera {} failed: {}\n", c.camera, c.error));
        }
    }
    out.push_str(&format!(
        "coadapt: scheduler {} tasks_done {} pool_budget {} peak_used {} within_budget {}\n",
        s.scheduler,
        s.tasks_done,
        s.budget,
        s.peak_used,
        s.peak_used <= s.budget
    ));
    out.push_str(&format!(
        "coadapt: fragmentation over {} pool events: mean {:.3} max {:.3}\n",
        s.events, s.mean_fragmentation, s.max_fragmentation
    ));
    for (event, used, frag) in &s.timeline {
        out.push_str(&format!("coadapt:   event {event:>5} used {used:>10} fragmentation {frag:.3}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn render_names_each_camera_and_the_budget_check() {
        let s = EdgeSummary {
            cameras: vec![troupe_actors::coadapt::wire::CameraReport {
                camera: "cam-1".into(),
                drift_frame: 320,
                exact_before: 0.25,
                exact_after: 0.8125,
                accuracy_before: 0.2,
                accuracy_after: 0.7,
                latency_ms: 5,
                error: String::new(),
            }],
            budget: 100,
            peak_used: 90,
            events: 2,
            max_fragmentation: 0.5,
            mean_fragmentation: 0.25,
            timeline: vec![(0, 10, 0.0)],
            tasks_done: 1,
            scheduler: "twin-buffer".into(),
        };
        let out = render(&s);
        assert!(out.contains("camera cam-1 drift_frame 320 exact_match_vs_teacher 0.250 -> 0.812"), "{out}");
        assert!(out.contains("peak_used 90 within_budget true"), "{out}");
    }
}
