//! The bench's crowd, one definition for every pipeline run: worker processes named
//! `{prefix}-1..`, each with a CPU quota and a battery level falling 15 points per worker (the
//! policy ranks workers by telemetry), the shell settings that wait for them, and the same crowd
//! as the simulator's workers.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use troupe_actors::pipeline::worker::{cached_path, install_stage_file, write_in_chunks};
use troupe_actors::pipeline::{ShellSettings, StageFile};
use troupe_policy::pipeline::sim::SimWorker;
use troupe_policy::pipeline::{Telemetry, WorkerId};

use troupe::workloads::pipeline::local::WorkerSpec;

/// Battery level of worker `i` (0-based), percent.
fn battery(i: usize) -> f64 {
    95.0 - 15.0 * i as f64
}

/// Worker processes `{prefix}-1..` with the given quotas (percent of one CPU), under `dir`.
pub fn worker_specs(prefix: &str, quotas: &[u32], dir: &Path) -> Vec<WorkerSpec> {
    quotas
        .iter()
        .enumerate()
        .map(|(i, &q)| {
            let mut w = WorkerSpec::new(&format!("{prefix}-{}", i + 1), q, dir);
            w.battery_pct = battery(i);
            w
        })
        .collect()
}

/// The same workers at full speed (no quota).
pub fn full_speed(specs: &[WorkerSpec]) -> Vec<WorkerSpec> {
    specs.iter().map(|w| WorkerSpec { cpu_quota_pct: 100, ..w.clone() }).collect()
}

/// Puts each stage file in each worker's disk cache where the worker lacks it, with the
/// rewrite a mapped load reads, as a pull leaves them; returns how many it put. Run after the
/// cold run and the warm-up, so that no measured (warm) run pulls a stage: a job need not send
/// every stage to every worker (the large model's 4-input barrier warm-up left a worker without
/// one, and its pull in a measured barrier run took 5.6 s at 15 %, 2-4x that run's makespan).
pub fn fill_caches(specs: &[WorkerSpec], files: &[StageFile]) -> Result<usize> {
    let mut put = 0;
    for w in specs {
        std::fs::create_dir_all(&w.cache_dir).with_context(|| format!("{}", w.cache_dir.display()))?;
        for f in files {
            let path = cached_path(&w.cache_dir, &f.signature.sha256);
            if path.is_file() {
                continue;
            }
            let tmp = path.with_extension("part-bench");
            write_in_chunks(&tmp, &f.bytes).with_context(|| format!("writing {}", tmp.display()))?;
            install_stage_file(&tmp, &path, true).map_err(anyhow::Error::msg)?;
            put += 1;
        }
    }
    Ok(put)
}

/// Shell settings for a job on `workers` workers that may take `join` to join.
pub fn settings(workers: usize, join: Duration) -> ShellSettings {
    ShellSettings { workers, join_timeout: join, ..ShellSettings::default() }
}

/// The crowd as the simulator's workers: speed = quota (CPUs), the telemetry the real workers
/// report (battery as [`worker_specs`]), every one of `stages` stage files on disk.
pub fn sim_workers(quotas_cpus: &[f64], stages: usize) -> Vec<SimWorker> {
    quotas_cpus
        .iter()
        .enumerate()
        .map(|(i, &speed)| SimWorker {
            id: WorkerId(i as u32),
            speed,
            telemetry: Telemetry {
                ram_budget_bytes: 512 << 20,
                free_ram_bytes: 256 << 20,
                battery_pct: battery(i),
                ..Telemetry::default()
            },
            cached: (0..stages).collect(),
        })
        .collect()
}
