//! `troupe node --config FILE`: runs one node until ctrl-c, until its job ends, or until its
//! root supervisor escalates.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::sync::broadcast;
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::{
    Actors, Children, DeviceActor, DeviceArgs, Intensity, MembershipConfig, MembershipEvents, NodeRuntime,
    NodeSpec, PeerAddr, Services,
};
use troupe_transport::{FrameLimits, NodeId, NodeIdentity, QuicConfig, QuicNode};

use crate::config::{DeviceConfig, NodeConfig};
use crate::kinds::{Kinds, NodeContext};

/// Builds the runtime spec a config describes; its actors are built by their kinds in `kinds`.
pub fn spec_from_config(cfg: &NodeConfig, kinds: &Kinds) -> Result<NodeSpec> {
    let identity = NodeIdentity::load(&cfg.keys, &cfg.name)
        .with_context(|| format!("loading the identity of node {} from {}", cfg.name, cfg.keys.display()))?;
    let cookie = cfg.cookie().context("reading the cluster cookie")?;
    let admission = cfg.admission().context("reading [security]")?;
    let (config, kinds) = (cfg.clone(), kinds.clone());
    let children: Children = Box::new(
        move |link: &QuicNode, services: &Services, membership: &MembershipEvents, actors: &Actors| {
            let ctx = NodeContext {
                config: config.clone(),
                link: link.clone(),
                services: services.clone(),
                membership: membership.clone(),
                actors: actors.clone(),
            };
            let mut children = Vec::new();
            for d in &config.devices {
                children.push(device_child(d, config.heartbeat()));
            }
            for a in &config.actors {
                children.extend(kinds.build_actor(&ctx, a).map_err(|e| format!("{e:#}"))?);
            }
            Ok(children)
        },
    );
    Ok(NodeSpec {
        identity,
        quic: QuicConfig {
            bind: cfg.listen,
            limits: FrameLimits { max_body: cfg.transport.max_frame_mb << 20 },
            idle_timeout: Duration::from_millis(cfg.transport.idle_timeout_ms),
            conn_budget: cfg.transport.peer_buffer_bytes(),
            max_uni_streams: cfg.transport.max_peer_streams,
            admission,
            // validated with the config; an out-of-range section never reaches here
            impairment: cfg.links.impairment().unwrap_or(None),
            ..QuicConfig::default()
        },
        peers: cfg
            .peers
            .iter()
            .map(|p| PeerAddr { name: NodeId::new(p.name.clone()), addr: p.addr.clone() })
            .collect(),
        membership: MembershipConfig {
            heartbeat: cfg.heartbeat(),
            timeout: Duration::from_millis(cfg.membership.timeout_ms),
        },
        intensity: Intensity {
            max_restarts: cfg.supervision.max_restarts,
            period: Duration::from_secs(cfg.supervision.period_s),
        },
        cookie,
        children,
        redial: Duration::from_millis(cfg.membership.heartbeat_ms.max(50)),
        placement: Default::default(),
    })
}

fn device_child(d: &DeviceConfig, period: Duration) -> ChildSpec {
    let (tx, _) = broadcast::channel(16);
    let (name, kind, budget) = (d.name.clone(), d.kind.clone(), d.memory_mb << 20);
    ChildSpec::new(d.name.clone(), move || {
        (
            DeviceActor,
            DeviceArgs {
                name: name.clone(),
                kind: kind.clone(),
                budget_bytes: budget,
                telemetry_period: period,
                telemetry: tx.clone(),
            },
        )
    })
}

/// The start of the line a node prints when its job ends (`... finished: ok` or
/// `... finished: failed: REASON`); `troupe up` reads it from lingering job nodes.
pub const JOB_FINISHED: &str = "troupe-node: job ";

/// Runs the node described by `cfg`, its actors and job by their kinds in `kinds`; with
/// `linger`, it keeps serving after its job ends.
pub async fn run(cfg: NodeConfig, linger: bool, kinds: &Kinds) -> Result<()> {
    if !cfg.faults.is_off() {
        tracing::warn!(node = %cfg.name, sites = cfg.faults.sites.len(), "fault switch on");
        troupe_actors::fault::install(cfg.faults.plan());
    }
    let spec = spec_from_config(&cfg, kinds)?;
    // listen for SIGHUP before anyone can see the node: its default action would end the process
    let hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        .context("listening for SIGHUP (revocation list reloads)")?;
    let mut runtime = NodeRuntime::start(spec).await.context("starting the node runtime")?;
    if let Some(seed) = &cfg.join {
        tracing::info!(node = %cfg.name, %seed, "joining through the seed");
        runtime.join(seed.clone());
    }
    tracing::info!(node = %cfg.name, listen = %cfg.listen, roles = %identity_roles(&cfg), "node up");
    let _metrics = match cfg.metrics.listen {
        Some(addr) => {
            let served = crate::metrics::serve(
                addr,
                runtime.status_probe(),
                runtime.link.clone(),
                runtime.subscribe_supervision(),
            )
            .await;
            match served {
                Ok(server) => {
                    tracing::info!(node = %cfg.name, url = %format!("http://{}/metrics", server.addr), "metrics served");
                    Some(server)
                }
                Err(e) => {
                    runtime.shutdown().await;
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let reload = tokio::spawn(reload_on_sighup(cfg.clone(), runtime.link.clone(), hup));
    let outcome = run_until_done(&cfg, runtime, linger, kinds).await;
    reload.abort();
    outcome
}

fn identity_roles(cfg: &NodeConfig) -> String {
    NodeIdentity::load(&cfg.keys, &cfg.name).map(|i| i.roles().to_string()).unwrap_or_default()
}

/// On SIGHUP: re-reads the revocation list (and allow-list) and disconnects peers now refused.
/// A file that no longer parses is logged and the rules in force are kept.
async fn reload_on_sighup(cfg: NodeConfig, link: QuicNode, mut hup: tokio::signal::unix::Signal) {
    while hup.recv().await.is_some() {
        match cfg.admission() {
            Ok(admission) => {
                let refused = link.set_admission(admission);
                tracing::info!(node = %cfg.name, disconnected = refused.len(), "SIGHUP: admission rules reloaded");
                for (peer, why) in refused {
                    tracing::warn!(node = %cfg.name, %peer, reason = %why, "disconnected peer after reload");
                }
            }
            Err(e) => tracing::error!(node = %cfg.name, error = %e, "SIGHUP: keeping the rules in force"),
        }
    }
}

/// What a workload gets from the running node.
fn context(cfg: &NodeConfig, runtime: &NodeRuntime) -> NodeContext {
    NodeContext {
        config: cfg.clone(),
        link: runtime.link.clone(),
        services: runtime.services.clone(),
        membership: runtime.membership_events(),
        actors: runtime.actors.clone(),
    }
}

async fn run_until_done(cfg: &NodeConfig, runtime: NodeRuntime, linger: bool, kinds: &Kinds) -> Result<()> {
    let ctx = context(cfg, &runtime);
    // one SIGINT and SIGTERM listener for the node's whole life: a ctrl-c that arrives between the
    // job's end and the linger loop (as `troupe up` sends it on reading the job's end) is kept,
    // not missed; SIGTERM (what systemd and docker send) stops the node the same graceful way
    let mut interrupt = Stop::listen()?;
    match &cfg.job {
        Some(job) => {
            let outcome = tokio::select! {
                r = tokio::time::timeout(Duration::from_secs(job.timeout_s), kinds.run_job(&runtime, &ctx, job)) => {
                    r.unwrap_or_else(|_| Err(anyhow::anyhow!("job {} did not finish within {} s", job.kind, job.timeout_s)))
                }
                _ = interrupt.recv() => {
                    // interrupted before the job ended: nothing to linger for
                    runtime.shutdown().await;
                    return Err(anyhow::anyhow!("interrupted"));
                }
            };
            match &outcome {
                Ok(()) => println!("{JOB_FINISHED}{} finished: ok", job.kind),
                Err(e) => println!("{JOB_FINISHED}{} finished: failed: {e:#}", job.kind),
            }
            if linger {
                serve_until_stopped(cfg, runtime, &mut interrupt).await?;
            } else {
                runtime.shutdown().await;
            }
            outcome
        }
        None => serve_until_stopped(cfg, runtime, &mut interrupt).await,
    }
}

/// Serves the node's actors until ctrl-c (SIGINT) or until its root supervisor escalates.
async fn serve_until_stopped(cfg: &NodeConfig, runtime: NodeRuntime, interrupt: &mut Stop) -> Result<()> {
    let mut supervision = runtime.subscribe_supervision();
    tokio::select! {
        signal = interrupt.recv() => {
            tracing::info!(node = %cfg.name, %signal, "shutting down: leaving the cluster");
            runtime.shutdown().await;
            Ok(())
        }
        ev = wait_escalation(&mut supervision) => {
            runtime.shutdown().await;
            bail!("root supervisor escalated: {ev}")
        }
    }
}

/// SIGINT or SIGTERM: either asks the node to leave gracefully.
struct Stop {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Stop {
    fn listen() -> Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            int: signal(SignalKind::interrupt()).context("listening for SIGINT")?,
            term: signal(SignalKind::terminate()).context("listening for SIGTERM")?,
        })
    }

    /// The next stop signal's name.
    async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}

async fn wait_escalation(rx: &mut broadcast::Receiver<troupe_actors::SupervisorEvent>) -> String {
    loop {
        match rx.recv().await {
            Ok(troupe_actors::SupervisorEvent::Escalated { supervisor, child, reason })
                if supervisor == troupe_actors::node::ROOT =>
            {
                return format!("child {child}: {reason}");
            }
            Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
            Err(broadcast::error::RecvError::Closed) => std::future::pending::<()>().await,
        }
    }
}
