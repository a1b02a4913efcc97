//! `troupe sim`: the fault explorer (simulation only) from the command line — seeds of a
//! workload on the simulated cluster under seeded faults, every invariant checked
//! ([`troupe_actors::sim::explore`]). Prints seeds run, violations, seeds per minute and events
//! per second, and for each violation the one command that replays its seed; `--json` writes
//! the same figures, prefixed `sim_` as they come from the simulation.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use troupe_actors::sim::explore::coadapt::CoadaptWorkload;
#[cfg(feature = "onnx")]
use troupe_actors::sim::explore::pipeline::PipelineWorkload;
use troupe_actors::sim::explore::typed::TypedWorkload;
use troupe_actors::sim::explore::{ExploreConfig, Sweep, replay_command, sweep};

/// The workloads `troupe sim` runs (`coe` and `pipeline` need the `onnx` feature, as their
/// shells do).
pub const WORKLOADS: &[&str] = &[
    "typed",
    "coadapt",
    #[cfg(feature = "onnx")]
    "coe",
    #[cfg(feature = "onnx")]
    "pipeline",
];

/// Runs `seeds` seeds from `from` of `workload` (`all`: each in turn); exit code 1 on any
/// violation.
pub fn run(workload: &str, seeds: u64, from: u64, json: Option<&Path>) -> Result<ExitCode> {
    quiet_injected_panics();
    let names: Vec<&str> = match workload {
        "all" => WORKLOADS.to_vec(),
        w if WORKLOADS.contains(&w) => vec![w],
        w => anyhow::bail!("unknown workload {w:?}: one of {} or all", WORKLOADS.join(", ")),
    };
    let config = ExploreConfig::default();
    let mut sweeps = Vec::new();
    for name in names {
        let s = match name {
            #[cfg(feature = "onnx")]
            "pipeline" => sweep(&PipelineWorkload::default(), from, seeds, &config, |_| {}),
            #[cfg(feature = "onnx")]
            "coe" => {
                let w = troupe_actors::sim::explore::coe::CoeWorkload::standard()?;
                troupe_actors::sim::explore::sweep_with(
                    &w,
                    from,
                    seeds,
                    |tag, seed| w.schedule(tag, seed, &config),
                    |_| {},
                )
            }
            "coadapt" => sweep(&CoadaptWorkload::default(), from, seeds, &config, |_| {}),
            "typed" => sweep(&TypedWorkload::default(), from, seeds, &config, |_| {}),
            other => anyhow::bail!("workload {other} has no arm in troupe sim"),
        };
        for v in &s.failed {
            println!("{} seed {}: {}", v.workload, v.seed, v.violations.join("; "));
            println!("  replay: {}", replay_command(v.workload, v.seed));
        }
        println!(
            "{}: {} seeds, {} violations, {:.0} seeds/min, {:.0} events/s (simulated, {:.1} s wall)",
            s.workload,
            s.seeds,
            s.failed.len(),
            s.seeds_per_min(),
            s.events_per_s(),
            s.wall.as_secs_f64()
        );
        sweeps.push(s);
    }
    let total = figures(&sweeps);
    if sweeps.len() > 1 {
        println!(
            "all: {} seeds, {} violations, {:.0} seeds/min, {:.0} events/s",
            total["sim_seeds"],
            total["sim_violations"],
            total["sim_seeds_per_min"],
            total["sim_events_per_s"]
        );
    }
    if let Some(path) = json {
        std::fs::write(path, serde_json::to_string_pretty(&total)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed = sweeps.iter().any(|s| !s.failed.is_empty());
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// The flat figures: totals as `sim_seeds`, `sim_violations`, `sim_seeds_per_min`,
/// `sim_events_per_s`, and per workload `sim_<workload>_seeds` and so on.
pub fn figures(sweeps: &[Sweep]) -> Value {
    let mut out = Map::new();
    let (mut seeds, mut violations, mut events, mut wall) = (0u64, 0usize, 0u64, 0f64);
    for s in sweeps {
        let w = s.workload;
        out.insert(format!("sim_{w}_seeds"), json!(s.seeds));
        out.insert(format!("sim_{w}_violations"), json!(s.failed.len()));
        out.insert(format!("sim_{w}_seeds_per_min"), json!(s.seeds_per_min().round()));
        out.insert(format!("sim_{w}_events_per_s"), json!(s.events_per_s().round()));
        seeds += s.seeds;
        violations += s.failed.len();
        events += s.events;
        wall += s.wall.as_secs_f64();
    }
    let wall = wall.max(1e-9);
    out.insert("sim_seeds".into(), json!(seeds));
    out.insert("sim_violations".into(), json!(violations));
    out.insert("sim_seeds_per_min".into(), json!((seeds as f64 * 60.0 / wall).round()));
    out.insert("sim_events_per_s".into(), json!((events as f64 / wall).round()));
    Value::Object(out)
}

/// The explorer injects scheduler panics on purpose (thousands a sweep): those print nothing,
/// any other panic prints as before.
fn quiet_injected_panics() {
    let before = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected =
            info.payload().downcast_ref::<String>().is_some_and(|m| m.starts_with("fault injected at "));
        if !injected {
            before(info);
        }
    }));
}
