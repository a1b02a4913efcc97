//! The pipeline workload on a simulated cluster (simulation only): the real foreman service
//! (admission, stage pulls from the client, the job's ledger journaled to a real file, the
//! foreman shell and its policy under their own supervisor) and the real workers (typed actor,
//! wire codec, role checks, disk cache of stage files), on [`SimNode`]s.
//!
//! What is simulated: the stages ([`SimStage`]: hashed outputs, modelled load and run times on
//! tokio's clock; no ONNX file, no ONNX Runtime), blob pulls (a modelled transfer time on the
//! simulated net) and the workers' telemetry (the idle device model). The journal and the
//! workers' stage caches are real files in a folder the caller owns; a simulated disk that
//! loses unsynced writes on a crash is a later step.

use std::path::Path;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use troupe_kernels::onnx::NamedTensor;

use super::SimNode;
use crate::pipeline::service::{ForemanServiceActor, ForemanServiceArgs, ServiceSettings};
use crate::pipeline::sim_stage::{SimInput, SimStage, reference_outputs};
use crate::pipeline::telemetry::DeviceModel;
use crate::pipeline::{PipelineWorker, ShellSettings, WorkerSettings, worker_name};
use crate::supervisor::{ChildSpec, SupervisorMsg};
use crate::typed::Actors;

/// Stages of a simulated job.
pub const SIM_STAGES: usize = 3;
/// Tokens in each input (`input_ids`, i64 `[1, SIM_TOKENS]`).
pub const SIM_TOKENS: usize = 8;

/// `seed`'s stages: `input_ids` -> `h0` -> `h1` -> `logits`, each with a modelled load of
/// 50-150 ms and run of 10-40 ms.
pub fn sim_stages(seed: u64) -> Vec<SimStage> {
    let mut rng = SmallRng::seed_from_u64(seed ^ 0x5157_a6e5);
    let names = ["input_ids", "h0", "h1", "logits"];
    (0..SIM_STAGES)
        .map(|k| SimStage {
            name: format!("sim-stage-{k}"),
            inputs: vec![SimInput { name: names[k].into(), i64: k == 0, rank: 2 }],
            outputs: vec![(names[k + 1].into(), if k + 1 == SIM_STAGES { 4 } else { 32 })],
            load_us: rng.random_range(50_000..150_000),
            run_us: rng.random_range(10_000..40_000),
        })
        .collect()
}

/// `n` job inputs made from `seed`.
pub fn sim_inputs(seed: u64, n: usize) -> Vec<Vec<NamedTensor>> {
    (0..n)
        .map(|i| {
            let ids = (0..SIM_TOKENS).map(|j| ((seed as usize + i * 131 + j * 17) % 30_522) as i64).collect();
            vec![NamedTensor::i64("input_ids", vec![1, SIM_TOKENS], ids)]
        })
        .collect()
}

/// What the job should answer: each input walked through the stand-in stages.
pub fn reference(stages: &[SimStage], inputs: &[Vec<NamedTensor>]) -> Result<Vec<Vec<NamedTensor>>, String> {
    inputs.iter().map(|input| reference_outputs(stages, input)).collect()
}

/// A simulated worker of node `node`, caching stage files under `cache_root/node`.
pub fn worker_settings(node: &str, cache_root: &Path) -> WorkerSettings {
    WorkerSettings {
        node: node.to_owned(),
        ram_budget_bytes: 1 << 30,
        cpu_quota_pct: 100,
        device: DeviceModel::default(),
        enforce_ram_budget: false,
        cache_dir: cache_root.join(node).to_string_lossy().into_owned(),
        intra_threads: 1,
        sim: true,
    }
}

/// Starts node `node`'s worker under the root supervisor of `actors` (that node's), named
/// [`worker_name`]`(node)`.
pub async fn start_worker(actors: &Actors, name: &str, cache_root: &Path) -> Result<(), String> {
    actors
        .spawn::<PipelineWorker>(&worker_name(name), worker_settings(name, cache_root))
        .await
        .map(|_| ())
        .map_err(|e| format!("starting the worker on {name}: {e}"))
}

/// A foreman service's settings for `workers` workers, journaling under `journal_dir`, with
/// timeouts sized for the simulated net (a call unanswered for 5 s loses its worker).
pub fn service_settings(workers: usize, journal_dir: &Path) -> ServiceSettings {
    ServiceSettings {
        job: ShellSettings {
            workers,
            join_timeout: Duration::from_secs(30),
            telemetry_period: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(5),
            ..ShellSettings::default()
        },
        journal_dir: journal_dir.to_path_buf(),
    }
}

/// The foreman service actor of `node` as a child named `name` (ractor's registry is
/// process-wide: the name carries the caller's tag).
pub fn foreman_spec(node: &SimNode, name: &str, settings: ServiceSettings) -> ChildSpec {
    let args = ForemanServiceArgs {
        actors: node.actors.clone(),
        membership: node.membership_events().clone(),
        settings,
    };
    ChildSpec::new(name, move || (ForemanServiceActor, args.clone()))
}

/// Starts the foreman service on `node` under its root supervisor, as the `pipeline-foreman`
/// actor entry does on a real node.
pub async fn start_foreman(node: &SimNode, name: &str, settings: ServiceSettings) -> Result<(), String> {
    let spec = foreman_spec(node, name, settings);
    ractor::call!(node.supervisor, SupervisorMsg::StartChild, spec)
        .map_err(|e| format!("asking the root supervisor to start the foreman: {e}"))?
        .map(|_| ())
        .map_err(|e| format!("starting the foreman: {e}"))
}
