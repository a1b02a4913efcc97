//! The curve's second case: all-mpnet-base-v2 in 4 stages on 4 workers ([`LARGE_QUOTAS`]), when
//! `scripts/setup --large` put it in the cache; its keys carry the prefix `large_`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use troupe_actors::pipeline::{PipelineJob, StageFile, build_job};
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::Mode;

use troupe::workloads::pipeline::local::LocalCluster;

use super::cpu_costs::{ISOLATED_JOBS, measure_cpu_costs, measure_runtime_cpu};
use super::crowd;
use super::curve::{CurveSetup, MULTIPLES, Point, curve_figures, pulls};
use super::meter::{Metered, Meters, quota_use, run_metered, take_median_metered};
use super::run_remembering;

/// Quotas of the large case's 4 workers (3:2:2:1, 1.2 CPUs in all), percent of one CPU.
pub const LARGE_QUOTAS: [u32; 4] = [45, 30, 30, 15];
/// Rows of `mpnet_check.json` per input of the large case.
pub const LARGE_BATCH: usize = 2;

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
    let specs = |full: bool, dir: &Path| {
        let s = crowd::worker_specs("large", &LARGE_QUOTAS, dir);
        if full { crowd::full_speed(&s) } else { s }
    };
    // a 15 % worker starting ONNX Runtime on a loaded host took over 60 s to join once
    let settings = crowd::settings(w, Duration::from_secs(180));
    let _ = std::fs::remove_dir_all(workdir.join("cache"));
    let cluster = LocalCluster::start(exe, workdir, &specs(false, workdir)).await?;
    let meters = Meters::attach(&cluster, &LARGE_QUOTAS);
    let mut memory = None;
    let result = async {
        let cold = run_remembering(&cluster, job(Mode::Streaming, w)?, settings.clone(), &mut memory).await?;
        run_remembering(&cluster, job(Mode::Barrier, w)?, settings.clone(), &mut memory).await?;
        let filled = crowd::fill_caches(&specs(false, workdir), &files)?;
        println!(
            "large case, warm caches: the bench put {filled} stage files the first two jobs had not sent"
        );
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
        measure_runtime_cpu(&full, &[100; 4], &files, &inputs_of(ISOLATED_JOBS)?, &settings).await
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
