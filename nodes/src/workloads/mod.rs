//! Workloads: the built-in actor kinds and job kinds a node config can name. Each workload owns
//! a prefix (`hello-`, `coe-`, `pipeline-`, `coadapt-`), its typed `params` and their checks,
//! builds its actors and runs its jobs; [`Kinds::builtin`] registers them all.

use troupe_transport::{Role, RoleSet};

use crate::kinds::{ActorKind, JobKind, Kinds, NoParams};
pub use crate::kinds::{NodeContext, params};

pub mod coadapt;
pub mod coe;
pub mod coe_request;
pub mod hello;
pub mod pipeline;

impl Kinds {
    /// troupe's own kinds: actors `hello-expert` and `coe-executor` (role executor),
    /// `pipeline-worker` (worker), `pipeline-foreman` (scheduler: it drives workers, as a job's
    /// foreman does), `coadapt-edge` (edge), `coadapt-camera` (camera); jobs `hello`, `coe`,
    /// `pipeline`, `coadapt` (scheduler: the job node drives the workload).
    pub fn builtin() -> Self {
        let scheduler = RoleSet::only(Role::Scheduler);
        Kinds::new()
            .actor("hello-expert", RoleSet::only(Role::Executor), |ctx, a, _: NoParams| {
                Ok(vec![hello::actor(ctx, a)])
            })
            .actor("coe-executor", RoleSet::only(Role::Executor), |ctx, _, p| Ok(vec![coe::actor(ctx, p)?]))
            .add_actor(
                ActorKind::new("pipeline-worker", RoleSet::only(Role::Worker), |ctx, _, p| {
                    Ok(vec![pipeline::actor(ctx, &p)?])
                })
                .check(pipeline::check_worker),
            )
            .add_actor(
                ActorKind::new("pipeline-foreman", scheduler, |ctx, a, p| {
                    Ok(vec![pipeline::foreman_actor(ctx, a, p)])
                })
                .check(pipeline::check_foreman),
            )
            .add_actor(
                ActorKind::new("coadapt-edge", RoleSet::only(Role::Edge), coadapt::edge_actor)
                    .check(coadapt::check_edge),
            )
            .add_actor(
                ActorKind::new("coadapt-camera", RoleSet::only(Role::Camera), coadapt::camera_actor)
                    .check(|p| coadapt::camera_schedule(p).map(drop)),
            )
            .add_job(
                JobKind::new("hello", scheduler, |rt, ctx, job, p| Box::pin(hello::run_job(rt, ctx, job, p)))
                    .check(hello::check_job),
            )
            .add_job(
                JobKind::new("coe", scheduler, |rt, ctx, job, p| Box::pin(coe::run_job(rt, ctx, job, p)))
                    .check(coe::check_job),
            )
            .add_job(
                JobKind::new("pipeline", scheduler, |rt, ctx, job, p| {
                    Box::pin(pipeline::run_job(rt, ctx, job, p))
                })
                .check(pipeline::check_job),
            )
            .add_job(
                JobKind::new("coadapt", scheduler, |rt, ctx, job, p| {
                    Box::pin(coadapt::run_job(rt, ctx, job, p))
                })
                .check(coadapt::check_job),
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ActorConfig, JobConfig, KindCheck};

    #[test]
    fn the_builtin_kinds_give_the_roles_troupe_up_issues() {
        let k = Kinds::builtin();
        assert_eq!(
            k.actor_names(),
            [
                "hello-expert",
                "coe-executor",
                "pipeline-worker",
                "pipeline-foreman",
                "coadapt-edge",
                "coadapt-camera"
            ]
        );
        assert_eq!(k.job_names(), ["hello", "coe", "pipeline", "coadapt"]);
        let actor = |kind: &str| ActorConfig { kind: kind.into(), name: None, params: toml::Table::new() };
        let job = JobConfig { kind: "hello".into(), timeout_s: 1, params: toml::Table::new() };
        assert_eq!(k.roles_for(&[actor("hello-expert")], None), RoleSet::only(Role::Executor));
        let both = k.roles_for(&[actor("pipeline-worker"), actor("coadapt-camera")], Some(&job));
        assert_eq!(both, RoleSet::only(Role::Worker).with(Role::Camera).with(Role::Scheduler));
        let mut with_param = actor("hello-expert");
        with_param.params.insert("colour".into(), toml::Value::Integer(1));
        assert_eq!(k.check_actor(&with_param).unwrap_err().0, "params.colour");
    }
}
