//! Workloads: the actor kinds and job kinds a node config can name. Each workload owns a prefix
//! (`hello-`, `coe-`, `pipeline-`, `coadapt-`), validates its own `params`, builds its actors and
//! runs its jobs; the node runtime underneath is shared.

use anyhow::{Result, bail};
use serde::de::DeserializeOwned;
use troupe_actors::NodeRuntime;
use troupe_actors::supervisor::{ChildSpec, SupervisorMsg};
use troupe_transport::QuicNode;

use crate::config::{ActorConfig, JobConfig, NodeConfig};

pub mod coadapt;
pub mod coe;
pub mod coe_request;
pub mod hello;
pub mod pipeline;

/// What a workload's actors and jobs get from the node.
#[derive(Clone)]
pub struct NodeContext {
    /// The node's full configuration.
    pub config: NodeConfig,
    /// The node's QUIC link (data plane).
    pub link: QuicNode,
    /// The node's role-checked service router (data plane RPC).
    pub services: troupe_actors::Services,
    /// The node's membership events (subscribe for members up and down).
    pub membership: troupe_actors::MembershipEvents,
}

/// The certificate roles a node needs for the actors and the job it runs (`troupe up` issues
/// them): executors and hello experts `executor`, pipeline workers `worker`, co-adaptation
/// `edge` / `camera`, and any job `scheduler` (the job node drives the workload).
pub fn roles_for(actors: &[ActorConfig], job: Option<&JobConfig>) -> troupe_transport::RoleSet {
    use troupe_transport::{Role, RoleSet};
    let mut roles = RoleSet::EMPTY;
    for a in actors {
        roles = match a.kind.as_str() {
            "hello-expert" | "coe-executor" => roles.with(Role::Executor),
            "pipeline-worker" => roles.with(Role::Worker),
            // it drives workers, as a job's foreman does
            "pipeline-foreman" => roles.with(Role::Scheduler),
            "coadapt-edge" => roles.with(Role::Edge),
            "coadapt-camera" => roles.with(Role::Camera),
            _ => roles,
        };
    }
    if job.is_some() {
        roles = roles.with(Role::Scheduler);
    }
    roles
}

/// Parses a `params` table into the workload's own settings type, naming the bad field by its
/// path (from serde's path, not the message text).
pub fn params<T: DeserializeOwned>(table: &toml::Table) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
        let field = crate::config::field_path(e.path())
            .map(|f| format!("params.{f}"))
            .unwrap_or_else(|| "params".into());
        (field, e.into_inner().message().trim().to_string())
    })
}

/// Checks an `[[actors]]` entry: `Err((field, problem))`.
pub fn validate_actor(a: &ActorConfig) -> Result<(), (String, String)> {
    match a.kind.as_str() {
        "hello-expert" => hello::validate_actor(a),
        "coe-executor" => coe::validate_actor(a),
        "pipeline-worker" => pipeline::validate_actor(a),
        "pipeline-foreman" => pipeline::validate_foreman(a),
        "coadapt-edge" | "coadapt-camera" => coadapt::validate_actor(a),
        other => Err(("kind".into(), format!("unknown actor kind {other:?} (known: {:?})", ACTOR_KINDS))),
    }
}

/// Checks a `[job]`: `Err((field, problem))`.
pub fn validate_job(j: &JobConfig) -> Result<(), (String, String)> {
    match j.kind.as_str() {
        "hello" => hello::validate_job(j),
        "coe" => coe::validate_job(j),
        "pipeline" => pipeline::validate_job(j),
        "coadapt" => coadapt::validate_job(j),
        other => Err(("kind".into(), format!("unknown job kind {other:?} (known: {:?})", JOB_KINDS))),
    }
}

/// Actor kinds known to this build.
pub const ACTOR_KINDS: &[&str] = &[
    "hello-expert",
    "coe-executor",
    "pipeline-worker",
    "pipeline-foreman",
    "coadapt-edge",
    "coadapt-camera",
];
/// Job kinds known to this build.
pub const JOB_KINDS: &[&str] = &["hello", "coe", "pipeline", "coadapt"];

/// Actor kinds started once the runtime is up ([`start_with_runtime`]) rather than among the
/// root supervisor's first children: they need the node's typed-actor registry.
pub const RUNTIME_KINDS: &[&str] = &["pipeline-worker", "pipeline-foreman"];

/// The child spec for one `[[actors]]` entry; `None` for the kinds in [`RUNTIME_KINDS`].
pub fn actor(ctx: &NodeContext, a: &ActorConfig) -> Result<Option<ChildSpec>> {
    Ok(Some(match a.kind.as_str() {
        "hello-expert" => hello::actor(ctx, a)?,
        "coe-executor" => coe::actor(ctx, a)?,
        "pipeline-worker" | "pipeline-foreman" => return Ok(None),
        "coadapt-edge" | "coadapt-camera" => coadapt::actor(ctx, a)?,
        other => bail!("unknown actor kind {other:?}"),
    }))
}

/// Starts the `[[actors]]` entries of the kinds in [`RUNTIME_KINDS`] under the node's root
/// supervisor: the pipeline worker (a typed actor, spawned by name) and the pipeline foreman
/// service (it reaches the workers through typed handles).
pub async fn start_with_runtime(runtime: &NodeRuntime, ctx: &NodeContext) -> Result<()> {
    for a in &ctx.config.actors {
        match a.kind.as_str() {
            "pipeline-worker" => pipeline::spawn_worker(runtime, ctx, a).await?,
            "pipeline-foreman" => {
                let spec = pipeline::foreman_actor(ctx, &runtime.actors, a)?;
                let started = ractor::call!(runtime.supervisor, SupervisorMsg::StartChild, spec)
                    .map_err(|e| anyhow::anyhow!("starting the pipeline foreman: {e}"))?;
                started.map_err(|e| anyhow::anyhow!("starting the pipeline foreman: {e}"))?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Runs the node's job to completion.
pub async fn run_job(runtime: &NodeRuntime, ctx: &NodeContext, job: &JobConfig) -> Result<()> {
    match job.kind.as_str() {
        "hello" => hello::run_job(runtime, ctx, job).await,
        "coe" => coe::run_job(runtime, ctx, job).await,
        "pipeline" => pipeline::run_job(runtime, ctx, job).await,
        "coadapt" => coadapt::run_job(runtime, ctx, job).await,
        other => bail!("unknown job kind {other:?}"),
    }
}
