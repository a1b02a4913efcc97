//! The registry of actor kinds and job kinds a node binary knows: each kind's name, the
//! certificate roles a node running it needs, its typed `params` and what it builds or runs.
//! `troupe node` uses [`Kinds::builtin`]; a user's own node binary adds its kinds to it (see
//! [`crate::node_main::NodeMain`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use anyhow::{Result, anyhow, bail};
use serde::de::DeserializeOwned;
use troupe_actors::NodeRuntime;
use troupe_actors::supervisor::ChildSpec;
use troupe_transport::{QuicNode, RoleSet};

use crate::config::{ActorConfig, JobConfig, KindCheck, NodeConfig};

/// What a kind's actors and jobs get from the node.
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
    /// The node's typed actors: spawn, look up by name.
    pub actors: troupe_actors::Actors,
}

/// A `params` problem a kind's check reports: the field under `params` (`""` for the table as
/// a whole) and what is wrong. The registry names it by its full path in the config.
pub type ParamsProblem = (String, String);

/// The future a job kind's run returns.
pub type JobFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

type CheckFn<P> = dyn Fn(&P) -> Result<(), ParamsProblem> + Send + Sync;
type TypedBuildFn<P> = dyn Fn(&NodeContext, &ActorConfig, P) -> Result<Vec<ChildSpec>> + Send + Sync;
type TypedRunFn<P> =
    dyn for<'a> Fn(&'a NodeRuntime, &'a NodeContext, &'a JobConfig, P) -> JobFuture<'a> + Send + Sync;
type ValidateFn = dyn Fn(&toml::Table) -> Result<(), (String, String)> + Send + Sync;
type BuildFn = dyn Fn(&NodeContext, &ActorConfig) -> Result<Vec<ChildSpec>> + Send + Sync;
type RunFn = dyn for<'a> Fn(&'a NodeRuntime, &'a NodeContext, &'a JobConfig) -> JobFuture<'a> + Send + Sync;

/// The `params` of a kind that takes none: any key is refused, named by its path.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// Parses a `params` table into a kind's own settings type, naming the bad field by its
/// path (from serde's path, not the message text): `Err(("params.FIELD", problem))`.
pub fn params<T: DeserializeOwned>(table: &toml::Table) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
        let field = crate::config::field_path(e.path())
            .map(|f| format!("params.{f}"))
            .unwrap_or_else(|| "params".into());
        (field, e.into_inner().message().trim().to_string())
    })
}

/// Parses `table` as `P` and runs the kind's check on it; fields are named from `params` on.
fn parse_checked<P: DeserializeOwned>(
    table: &toml::Table,
    check: Option<&CheckFn<P>>,
) -> Result<P, (String, String)> {
    let p: P = params(table)?;
    if let Some(check) = check {
        check(&p)
            .map_err(|(f, m)| (if f.is_empty() { "params".into() } else { format!("params.{f}") }, m))?;
    }
    Ok(p)
}

/// One actor kind, typed by its `params` type `P`; registered with [`Kinds::add_actor`].
pub struct ActorKind<P> {
    name: String,
    roles: RoleSet,
    check: Option<Arc<CheckFn<P>>>,
    build: Arc<TypedBuildFn<P>>,
}

impl<P: DeserializeOwned + 'static> ActorKind<P> {
    /// The kind `name`, run by nodes whose certificates grant `roles`; `build` gets each
    /// `[[actors]]` entry's parsed `params` and returns its child specs in start order.
    pub fn new(
        name: &str,
        roles: RoleSet,
        build: impl Fn(&NodeContext, &ActorConfig, P) -> Result<Vec<ChildSpec>> + Send + Sync + 'static,
    ) -> Self {
        Self { name: name.into(), roles, check: None, build: Arc::new(build) }
    }

    /// Adds a check of values that parse but make no sense (run when the config is loaded).
    pub fn check(mut self, check: impl Fn(&P) -> Result<(), ParamsProblem> + Send + Sync + 'static) -> Self {
        self.check = Some(Arc::new(check));
        self
    }

    fn erase(self) -> Registered<BuildFn> {
        let check = self.check.clone();
        let validate: Arc<ValidateFn> =
            Arc::new(move |t: &toml::Table| parse_checked::<P>(t, check.as_deref()).map(drop));
        let (check, build) = (self.check, self.build);
        let run: Arc<BuildFn> = Arc::new(move |ctx: &NodeContext, a: &ActorConfig| {
            let p = parse_checked::<P>(&a.params, check.as_deref()).map_err(|(f, m)| anyhow!("{f}: {m}"))?;
            build(ctx, a, p)
        });
        Registered { name: self.name, roles: self.roles, validate, run }
    }
}

/// One job kind, typed by its `params` type `P`; registered with [`Kinds::add_job`].
pub struct JobKind<P> {
    name: String,
    roles: RoleSet,
    check: Option<Arc<CheckFn<P>>>,
    run: Arc<TypedRunFn<P>>,
}

impl<P: DeserializeOwned + 'static> JobKind<P> {
    /// The job kind `name`, run by nodes whose certificates grant `roles`; `run` gets the node,
    /// the `[job]` entry and its parsed `params`, and runs the job to its end.
    pub fn new(
        name: &str,
        roles: RoleSet,
        run: impl for<'a> Fn(&'a NodeRuntime, &'a NodeContext, &'a JobConfig, P) -> JobFuture<'a>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        Self { name: name.into(), roles, check: None, run: Arc::new(run) }
    }

    /// Adds a check of values that parse but make no sense (run when the config is loaded).
    pub fn check(mut self, check: impl Fn(&P) -> Result<(), ParamsProblem> + Send + Sync + 'static) -> Self {
        self.check = Some(Arc::new(check));
        self
    }

    fn erase(self) -> Registered<RunFn> {
        let check = self.check.clone();
        let validate: Arc<ValidateFn> =
            Arc::new(move |t: &toml::Table| parse_checked::<P>(t, check.as_deref()).map(drop));
        let (check, job_run) = (self.check, self.run);
        let run: Arc<RunFn> =
            Arc::new(move |rt: &NodeRuntime, ctx: &NodeContext, job: &JobConfig| -> JobFuture<'_> {
                match parse_checked::<P>(&job.params, check.as_deref()) {
                    Ok(p) => job_run(rt, ctx, job, p),
                    Err((f, m)) => Box::pin(std::future::ready(Err(anyhow!("job.{f}: {m}")))),
                }
            });
        Registered { name: self.name, roles: self.roles, validate, run }
    }
}

/// A kind with its type erased: what the registry stores.
struct Registered<F: ?Sized> {
    name: String,
    roles: RoleSet,
    validate: Arc<ValidateFn>,
    run: Arc<F>,
}

impl<F: ?Sized> Clone for Registered<F> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            roles: self.roles,
            validate: self.validate.clone(),
            run: self.run.clone(),
        }
    }
}

/// The actor kinds and job kinds a node binary knows, in registration order. Cheap to clone.
#[derive(Clone, Default)]
pub struct Kinds {
    actors: Vec<Registered<BuildFn>>,
    jobs: Vec<Registered<RunFn>>,
}

impl std::fmt::Debug for Kinds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kinds").field("actors", &self.actor_names()).field("jobs", &self.job_names()).finish()
    }
}

impl Kinds {
    /// No kinds at all (see `Kinds::builtin` for troupe's own).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers an actor kind; a kind of the same name registered before is replaced.
    pub fn add_actor<P: DeserializeOwned + 'static>(mut self, kind: ActorKind<P>) -> Self {
        let kind = kind.erase();
        self.actors.retain(|k| k.name != kind.name);
        self.actors.push(kind);
        self
    }

    /// Registers an actor kind without extra checks: shorthand for [`ActorKind::new`] and
    /// [`Kinds::add_actor`].
    pub fn actor<P: DeserializeOwned + 'static>(
        self,
        name: &str,
        roles: RoleSet,
        build: impl Fn(&NodeContext, &ActorConfig, P) -> Result<Vec<ChildSpec>> + Send + Sync + 'static,
    ) -> Self {
        self.add_actor(ActorKind::new(name, roles, build))
    }

    /// Registers a job kind; a kind of the same name registered before is replaced.
    pub fn add_job<P: DeserializeOwned + 'static>(mut self, kind: JobKind<P>) -> Self {
        let kind = kind.erase();
        self.jobs.retain(|k| k.name != kind.name);
        self.jobs.push(kind);
        self
    }

    /// Registers a job kind without extra checks: shorthand for [`JobKind::new`] and
    /// [`Kinds::add_job`].
    pub fn job<P: DeserializeOwned + 'static>(
        self,
        name: &str,
        roles: RoleSet,
        run: impl for<'a> Fn(&'a NodeRuntime, &'a NodeContext, &'a JobConfig, P) -> JobFuture<'a>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.add_job(JobKind::new(name, roles, run))
    }

    /// Adds every kind of `other`, replacing kinds of the same names.
    pub fn extend(mut self, other: Kinds) -> Self {
        for a in other.actors {
            self.actors.retain(|k| k.name != a.name);
            self.actors.push(a);
        }
        for j in other.jobs {
            self.jobs.retain(|k| k.name != j.name);
            self.jobs.push(j);
        }
        self
    }

    /// The actor kinds' names, in registration order.
    pub fn actor_names(&self) -> Vec<&str> {
        self.actors.iter().map(|k| k.name.as_str()).collect()
    }

    /// The job kinds' names, in registration order.
    pub fn job_names(&self) -> Vec<&str> {
        self.jobs.iter().map(|k| k.name.as_str()).collect()
    }

    fn actor_kind(&self, kind: &str) -> Result<&Registered<BuildFn>, (String, String)> {
        self.actors.iter().find(|k| k.name == kind).ok_or_else(|| {
            ("kind".into(), format!("unknown actor kind {kind:?} (known: {:?})", self.actor_names()))
        })
    }

    fn job_kind(&self, kind: &str) -> Result<&Registered<RunFn>, (String, String)> {
        self.jobs.iter().find(|k| k.name == kind).ok_or_else(|| {
            ("kind".into(), format!("unknown job kind {kind:?} (known: {:?})", self.job_names()))
        })
    }

    /// The certificate roles a node needs for the actors and the job it runs (`troupe up` issues
    /// them); kinds not registered add none (validation names them).
    pub fn roles_for(&self, actors: &[ActorConfig], job: Option<&JobConfig>) -> RoleSet {
        let actor_roles = actors.iter().filter_map(|a| self.actor_kind(&a.kind).ok()).map(|k| k.roles);
        let job_roles = job.and_then(|j| self.job_kind(&j.kind).ok()).map(|k| k.roles);
        actor_roles.chain(job_roles).flat_map(RoleSet::iter).collect()
    }

    /// The child specs for one `[[actors]]` entry, in start order.
    pub fn build_actor(&self, ctx: &NodeContext, a: &ActorConfig) -> Result<Vec<ChildSpec>> {
        match self.actor_kind(&a.kind) {
            Ok(k) => (k.run)(ctx, a),
            Err((_, problem)) => bail!("{problem}"),
        }
    }

    /// Runs the node's job to completion.
    pub async fn run_job(&self, runtime: &NodeRuntime, ctx: &NodeContext, job: &JobConfig) -> Result<()> {
        match self.job_kind(&job.kind) {
            Ok(k) => (k.run)(runtime, ctx, job).await,
            Err((_, problem)) => bail!("{problem}"),
        }
    }
}

impl KindCheck for Kinds {
    fn check_actor(&self, a: &ActorConfig) -> Result<(), (String, String)> {
        (self.actor_kind(&a.kind)?.validate)(&a.params)
    }

    fn check_job(&self, j: &JobConfig) -> Result<(), (String, String)> {
        (self.job_kind(&j.kind)?.validate)(&j.params)
    }
}

#[cfg(test)]
mod tests {
    use troupe_transport::Role;

    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Start {
        start: u64,
    }

    fn kinds() -> Kinds {
        Kinds::new()
            .add_actor(
                ActorKind::new("counter", RoleSet::only(Role::Executor), |_, _, _: Start| Ok(vec![])).check(
                    |p| if p.start > 9 { Err(("start".into(), "must be at most 9".into())) } else { Ok(()) },
                ),
            )
            .add_job(JobKind::new("count", RoleSet::only(Role::Scheduler), |_, _, _, _: NoParams| {
                Box::pin(async { Ok(()) })
            }))
    }

    fn actor(kind: &str, params: &str) -> ActorConfig {
        ActorConfig { kind: kind.into(), name: None, params: toml::from_str(params).unwrap_or_default() }
    }

    #[test]
    fn params_are_typed_checked_and_named_by_their_path() {
        let k = kinds();
        assert!(k.check_actor(&actor("counter", "start = 5")).is_ok());
        let (f, e) = k.check_actor(&actor("counter", "start = \"x\"")).unwrap_err();
        assert_eq!(f, "params.start", "{e}");
        let (f, e) = k.check_actor(&actor("counter", "start = 10")).unwrap_err();
        assert_eq!((f.as_str(), e.as_str()), ("params.start", "must be at most 9"));
        let (f, e) = k.check_actor(&actor("counter", "")).unwrap_err();
        assert!(f == "params" && e.contains("start"), "{f}: {e}");
        let job = JobConfig { kind: "count".into(), timeout_s: 1, params: toml::from_str("x = 1").unwrap() };
        assert_eq!(k.check_job(&job).unwrap_err().0, "params.x");
    }

    #[test]
    fn an_unknown_kind_lists_the_known_ones_and_later_kinds_replace_earlier_ones() {
        let k = kinds();
        let (f, e) = k.check_actor(&actor("dragon", "")).unwrap_err();
        assert_eq!(f, "kind");
        assert!(e.contains("dragon") && e.contains("[\"counter\"]"), "{e}");
        let job = JobConfig { kind: "hunt".into(), timeout_s: 1, params: toml::Table::new() };
        assert!(k.check_job(&job).unwrap_err().1.contains("[\"count\"]"));
        let k = k.actor("counter", RoleSet::only(Role::Worker), |_, _, _: NoParams| Ok(vec![]));
        assert_eq!(k.actor_names(), ["counter"]);
        let roles = k.roles_for(&[actor("counter", ""), actor("dragon", "")], Some(&job));
        assert_eq!(roles, RoleSet::only(Role::Worker), "unknown kinds add no roles");
    }
}
