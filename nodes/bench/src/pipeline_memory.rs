//! `troupe bench pipeline`, the worker-memory figures: each real worker process's idle floor
//! (RSS at join: runtime and ONNX Runtime loaded, no stage) and its peak over a job against the
//! largest stage file it pulled or loaded (`troupe::workloads::pipeline::memory`), and, when
//! `scripts/setup --large` has built all-mpnet-base-v2, the same for its 4 stages on 4 workers
//! against the whole model's RSS (goal: above the floor at most 1.3/K of it).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use troupe::workloads::pipeline::local::LocalCluster;
use troupe::workloads::pipeline::memory::{WorkerMemory, largest, worker_memory};
use troupe_actors::pipeline::{JobOutcome, StageFile, build_job};
use troupe_kernels::assets::{Assets, LARGE_SETUP_HINT, MPNET_CHECK, MPNET_STAGES, MPNET_WHOLE, TINY_MLP};
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::Mode;

const MIB: f64 = (1u64 << 20) as f64;
/// Stages (and workers) of the large case.
const LARGE_K: usize = 4;
/// Inputs of the large case (and of the MiniLM job of [`run`]).
const LARGE_INPUTS: usize = 20;
/// Largest `mpnet_check.json` read (it is ~150 KB).
const MAX_CHECK_BYTES: u64 = 16 << 20;

/// The figures of one job's workers under `prefix`: `{prefix}worker_idle_rss_mb`,
/// `{prefix}worker_peak_rss_over_floor_plus_stage` and `{prefix}worker_peak_rss_above_floor_over_stage`,
/// each the largest over the workers; prints one line per worker.
pub fn worker_figures(prefix: &str, outcome: &JobOutcome) -> BTreeMap<String, f64> {
    let workers = worker_memory(outcome);
    print_workers(prefix, &workers);
    let mut f = BTreeMap::new();
    let mut put = |k: &str, v: Option<f64>| {
        if let Some(v) = v {
            f.insert(format!("{prefix}{k}"), v);
        }
    };
    put("worker_idle_rss_mb", largest(&workers, |w| w.idle_rss.map(|b| b as f64 / MIB)));
    put("worker_peak_rss_over_floor_plus_stage", largest(&workers, WorkerMemory::peak_over_floor_plus_stage));
    put(
        "worker_peak_rss_above_floor_over_stage",
        largest(&workers, WorkerMemory::peak_above_floor_over_stage),
    );
    f
}

fn print_workers(prefix: &str, workers: &[WorkerMemory]) {
    let mib = |b: Option<u64>| b.map_or_else(|| "-".to_string(), |b| format!("{:.1}", b as f64 / MIB));
    println!(
        "{}worker memory (MiB; goal: idle <= 45 MB, peak <= idle + 1.3 x largest stage):",
        prefix.replace('_', " ")
    );
    for w in workers {
        println!(
            "  {:<10} idle {:>6}  peak {:>6}  largest stage {:>6}  peak above idle / stage {}",
            w.node,
            mib(w.idle_rss),
            mib(w.peak_rss),
            mib(w.stage_weight),
            w.peak_above_floor_over_stage().map_or_else(|| "-".into(), |r| format!("{r:.2}"))
        );
    }
}

/// The worker-memory figures on their own (`--memory-only`): one streaming job of MiniLM's
/// stages over 20 inputs on fresh workers with the bench's quotas ([`worker_figures`]), then the
/// large case.
pub async fn run(exe: &Path, workdir: &Path) -> Result<BTreeMap<String, f64>> {
    let stages = troupe::workloads::pipeline::minilm_stages()?;
    let files = stages.iter().map(|p| StageFile::from_path(p)).collect::<Result<Vec<_>, _>>()?;
    let sentences: Vec<String> = crate::pipeline::sentences().into_iter().take(LARGE_INPUTS).collect();
    let inputs = troupe::workloads::pipeline::tokenize(&sentences)?;
    let job = build_job(files, inputs, Mode::Streaming, false)?;
    let dir = workdir.join("memory");
    let _ = std::fs::remove_dir_all(dir.join("cache"));
    let specs = crate::pipeline::crowd::worker_specs("phone", &crate::pipeline::QUOTAS, &dir);
    let cluster = LocalCluster::start(exe, &dir, &specs).await?;
    let settings = crate::pipeline::crowd::settings(specs.len(), Duration::from_secs(60));
    let outcome = cluster.run(job, settings, None).await;
    cluster.shutdown().await;
    let mut f = worker_figures("", &outcome?);
    f.extend(large_case(exe, workdir).await?);
    Ok(f)
}

/// The large case: all-mpnet-base-v2's 4 stages (from `scripts/setup --large`) as one streaming
/// job of 20 recorded inputs on 4 full-speed workers; each worker's peak above its idle
/// floor over the whole model's RSS above the probe floor (`large_worker_rss_above_floor_over_whole_k4`,
/// goal <= 1.3/4), and the figures of [`worker_figures`] with the prefix `large_`. Without the
/// large model it says it skipped and returns nothing.
pub async fn large_case(exe: &Path, workdir: &Path) -> Result<BTreeMap<String, f64>> {
    let assets = Assets::locate()?;
    let stages: Vec<_> = MPNET_STAGES.iter().map(|s| assets.path(s)).collect();
    let (Ok(whole), Ok(check), true) =
        (assets.path(MPNET_WHOLE), assets.path(MPNET_CHECK), stages.iter().all(Result::is_ok))
    else {
        println!("large model case skipped: all-mpnet-base-v2 is not set up ({LARGE_SETUP_HINT})");
        return Ok(BTreeMap::new());
    };
    let stages: Vec<_> = stages.into_iter().filter_map(Result::ok).collect();
    let floor = crate::pipeline::probe_with(exe, &assets.path(TINY_MLP)?, false)?;
    let whole_rss = crate::pipeline::probe_with(exe, &whole, false)?;
    let files = stages.iter().map(|p| StageFile::from_path(p)).collect::<Result<Vec<_>, _>>()?;
    let job = build_job(files, recorded_inputs(&check)?, Mode::Streaming, false)?;
    let dir = workdir.join("large");
    let _ = std::fs::remove_dir_all(dir.join("cache"));
    let specs = crate::pipeline::crowd::worker_specs("large", &[100; LARGE_K], &dir);
    let cluster = LocalCluster::start(exe, &dir, &specs).await?;
    let settings = crate::pipeline::crowd::settings(LARGE_K, Duration::from_secs(60));
    let outcome = cluster.run(job, settings, None).await;
    cluster.shutdown().await;
    let outcome = outcome?;
    let mut f = worker_figures("large_", &outcome);
    let whole_above = whole_rss.saturating_sub(floor).max(1) as f64;
    let workers = worker_memory(&outcome);
    let worst = largest(&workers, |w| Some(w.peak_rss?.saturating_sub(w.idle_rss?) as f64 / whole_above));
    let k = LARGE_K as f64;
    if let Some(r) = worst {
        f.insert(format!("large_worker_rss_above_floor_over_whole_k{LARGE_K}"), r);
        println!(
            "  whole model {:.1} MiB above the probe floor; worker peak above idle / whole {r:.3} (goal {:.3})",
            whole_above / MIB,
            1.3 / k
        );
    }
    f.insert(format!("large_worker_rss_above_floor_target_k{LARGE_K}"), 1.3 / k);
    f.insert("large_whole_model_rss_mb".into(), whole_rss as f64 / MIB);
    f.insert("large_makespan_s".into(), outcome.makespan_s);
    Ok(f)
}

/// [`LARGE_INPUTS`] inputs from the recorded ones of `mpnet_check.json` (ids from the model's
/// own tokenizer; it holds 4, taken in turn), one `[1, S]` input each.
fn recorded_inputs(path: &Path) -> Result<Vec<Vec<NamedTensor>>> {
    let len = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?.len();
    if len > MAX_CHECK_BYTES {
        bail!("{}: {len} bytes, more than the {MAX_CHECK_BYTES} accepted", path.display());
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let json: serde_json::Value =
        serde_json::from_slice(&bytes).with_context(|| format!("{}: not JSON", path.display()))?;
    let rows = |key: &str| -> Result<Vec<Vec<i64>>> {
        serde_json::from_value(json[key].clone())
            .with_context(|| format!("{}: \"{key}\" rows", path.display()))
    };
    let (ids, masks) = (rows("ids")?, rows("attention_mask")?);
    let rows: Vec<(Vec<i64>, Vec<i64>)> =
        ids.into_iter().zip(masks).filter(|(i, m)| !i.is_empty() && i.len() == m.len()).collect();
    let inputs: Vec<Vec<NamedTensor>> = rows
        .into_iter()
        .cycle()
        .take(LARGE_INPUTS)
        .map(|(i, m)| {
            let shape = vec![1, i.len()];
            vec![
                NamedTensor::i64("input_ids", shape.clone(), i),
                NamedTensor::i64("attention_mask", shape, m),
            ]
        })
        .collect();
    if inputs.is_empty() {
        bail!("{}: no usable recorded inputs", path.display());
    }
    Ok(inputs)
}
