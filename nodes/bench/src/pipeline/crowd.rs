//! The bench's crowd, one definition for every pipeline run: worker processes named
//! `{prefix}-1..`, each with a CPU quota and a battery level falling 15 points per worker (the
//! policy ranks workers by telemetry), the shell settings that wait for them, and the same crowd
//! as the simulator's workers.

use std::path::Path;
use std::time::Duration;

use troupe_actors::pipeline::ShellSettings;
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
