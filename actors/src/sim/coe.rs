//! The coe workload on a simulated cluster (simulation only): the real coe scheduler actor
//! (policy, journal, links, recovery), the real executor actors (typed actor, wire codec, role
//! checks) and the real client request service, on [`SimNode`](super::SimNode)s.
//!
//! What is simulated: the executors' compute
//! ([`SimCompute`](crate::coe::sim_compute::SimCompute): hashed outputs, modelled costs on
//! tokio's clock; no weight store, no host tier, no model files) and the app, made in memory
//! from the policy's synthetic model ([`sim_app`]: no trained experts, no trace requests, no
//! digit images; requests come from clients). The scheduler's journal is a real file; what a
//! crash can leave of it (a torn tail, a compaction's temp file) the fault explorer writes there
//! ([`super::explore::coe`]).

use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use troupe_kernels::assets::Digits;
use troupe_policy::coe::synth::{ModelConfig, synthetic_edge_profile, synthetic_model};
use troupe_policy::coe::{LatencyModel, Trace};

use crate::coe::CoeError;
use crate::coe::app::{App, ExpertFile, INPUT_WIDTH, Manifest, Scale};
use crate::coe::link::ExecLink;
use crate::coe::remote::{CoeExecutor, ExecutorSpec, RemoteExecutor, find_executors_for_job};
use crate::coe::serve::CoeShared;
use crate::coe::sim_compute::SimComputeSpec;
use crate::supervisor::SupervisorMsg;
use crate::typed::Actors;

/// A coe app made in memory for a simulated cluster (simulation only): `seed`'s synthetic
/// ci-sized model (about 40 experts of 1-16 MB, three levels), each expert's output as wide as
/// its children (at least 2), no trace requests, and the synthetic edge profile (`gpu0` with
/// 32 MiB of expert memory, `cpu0` with 64 MiB) as its latency model.
pub fn sim_app(seed: u64) -> Result<(Arc<App>, LatencyModel), CoeError> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let model =
        synthetic_model(&ModelConfig::ci_like(), &mut rng).map_err(|e| CoeError::Invalid(e.to_string()))?;
    let experts = model
        .experts()
        .iter()
        .map(|e| ExpertFile {
            id: e.id,
            widths: vec![INPUT_WIDTH, e.children.len().max(2)],
            blob: format!("e{}", e.id.0),
        })
        .collect();
    let manifest = Manifest { scale: Scale::Ci, seed, knobs: None, generator: None, experts };
    let routes = model.experts().iter().map(|e| (0..e.children.len()).collect()).collect();
    let digits = Digits { rows: 8, cols: 8, pixels: Vec::new(), labels: Vec::new() };
    let app = App {
        dir: "sim-coe-app".into(),
        manifest,
        trace: Trace { model, requests: Vec::new() },
        digits,
        routes,
    };
    let profile = synthetic_edge_profile("sim", 32 << 20, 64 << 20);
    let latency = LatencyModel::from_profile(&profile).map_err(|e| CoeError::Invalid(e.to_string()))?;
    Ok((Arc::new(app), latency))
}

/// Expert `expert`'s output width in `app` (the last of its manifest widths).
pub fn output_width(app: &App, expert: troupe_policy::coe::ExpertId) -> usize {
    app.manifest.experts.get(expert.index()).and_then(|f| f.widths.last()).copied().unwrap_or(0)
}

/// The start arguments of executor `e` of `latency` on [`SimCompute`](crate::coe::sim_compute::SimCompute),
/// over `app`'s experts.
pub fn executor_spec(app: &App, latency: &LatencyModel, e: usize) -> ExecutorSpec {
    let model = &app.trace.model;
    let sizes: Vec<u64> = model.experts().iter().map(|x| x.size_bytes).collect();
    let widths: Vec<u32> =
        model.experts().iter().map(|x| u32::try_from(output_width(app, x.id)).unwrap_or(u32::MAX)).collect();
    ExecutorSpec::sim(latency.name(e), SimComputeSpec::from_latency(latency, e, &sizes, &widths))
}

/// On the scheduler's node (its typed actors and root supervisor): finds every executor of the
/// job (within `wait` of virtual time, then on past it, as a serving `coe` job does), links each (calls bounded by `call_timeout`) and starts
/// the coe scheduler under the root supervisor, as the `coe` job does on a real node. Returns
/// the executors found.
pub async fn start_scheduler(
    actors: &Actors,
    supervisor: &ActorRef<SupervisorMsg>,
    shared: &Arc<CoeShared>,
    wait: Duration,
    call_timeout: Duration,
) -> Result<Vec<RemoteExecutor>, CoeError> {
    let names: Vec<String> = (0..shared.executors()).map(|e| shared.executor_name(e).to_string()).collect();
    // the simulated scheduler serves requests: its node restarted must serve again
    let missed = |e: &CoeError| tracing::warn!("the coe scheduler waits on for its executors: {e}");
    let found = find_executors_for_job(actors, &names, wait, true, missed).await?;
    for (exec, x) in found.iter().enumerate() {
        shared.install_link(exec, ExecLink::Remote { handle: x.handle.clone(), timeout: call_timeout });
    }
    let started = ractor::call!(supervisor, SupervisorMsg::StartChild, shared.child_spec()).map_err(|e| {
        CoeError::Invalid(format!("asking the root supervisor to start the coe scheduler: {e}"))
    })?;
    started.map_err(|e| CoeError::Invalid(format!("starting the coe scheduler: {e}")))?;
    Ok(found)
}

/// Starts executor `e` of `latency` among a node's typed `actors` (on SimCompute), under its
/// profile name, as an executor node's job does at every start.
pub async fn start_executor(
    actors: &Actors,
    app: &App,
    latency: &LatencyModel,
    e: usize,
) -> Result<(), crate::typed::SpawnError> {
    let name = crate::coe::exec_wire::actor_name(latency.name(e));
    actors.spawn::<CoeExecutor>(&name, executor_spec(app, latency, e)).await.map(|_| ())
}
