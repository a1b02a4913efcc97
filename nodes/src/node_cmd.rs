//! `troupe node --config FILE`: runs one node until ctrl-c, until its job ends, or until its
//! root supervisor escalates.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::sync::broadcast;
use troupe_actors::hello::{HelloExpert, ask_all, remote_experts};
use troupe_actors::supervisor::ChildSpec;
use troupe_actors::{DeviceActor, DeviceArgs, Intensity, MembershipConfig, NodeRuntime, NodeSpec, PeerAddr};
use troupe_transport::{FrameLimits, NodeId, NodeIdentity, QuicConfig};

use crate::config::{JobConfig, NodeConfig};

/// Builds the runtime spec a config describes.
pub fn spec_from_config(cfg: &NodeConfig) -> Result<NodeSpec> {
    let identity = NodeIdentity::load(&cfg.keys, &cfg.name)
        .with_context(|| format!("loading the identity of node {} from {}", cfg.name, cfg.keys.display()))?;
    let mut children = Vec::new();
    for d in &cfg.devices {
        let (tx, _) = broadcast::channel(16);
        let (name, kind, budget) = (d.name.clone(), d.kind.clone(), d.memory_mb << 20);
        let period = cfg.heartbeat();
        children.push(ChildSpec::new(d.name.clone(), move || {
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
        }));
    }
    for a in &cfg.actors {
        let name = a.name.clone().unwrap_or_else(|| a.kind.clone());
        match a.kind.as_str() {
            "hello-expert" => {
                let node = cfg.name.clone();
                children.push(ChildSpec::new(name, move || (HelloExpert, node.clone())));
            }
            other => bail!("unknown actor kind {other:?}"),
        }
    }
    Ok(NodeSpec {
        identity,
        quic: QuicConfig {
            bind: cfg.listen,
            limits: FrameLimits { max_body: cfg.transport.max_frame_mb << 20 },
            idle_timeout: Duration::from_millis(cfg.transport.idle_timeout_ms),
            ..QuicConfig::default()
        },
        peers: cfg
            .peers
            .iter()
            .map(|p| PeerAddr { name: NodeId::new(p.name.clone()), addr: p.addr })
            .collect(),
        membership: MembershipConfig {
            heartbeat: cfg.heartbeat(),
            timeout: Duration::from_millis(cfg.membership.timeout_ms),
        },
        intensity: Intensity {
            max_restarts: cfg.supervision.max_restarts,
            period: Duration::from_secs(cfg.supervision.period_s),
        },
        cookie: cfg.cookie.clone(),
        children,
        redial: Duration::from_millis(cfg.membership.heartbeat_ms.max(50)),
    })
}

/// Runs the node described by `cfg`.
pub async fn run(cfg: NodeConfig) -> Result<()> {
    let spec = spec_from_config(&cfg)?;
    let runtime = NodeRuntime::start(spec).await.context("starting the node runtime")?;
    tracing::info!(node = %cfg.name, listen = %cfg.listen, "node up");
    match &cfg.job {
        Some(job) => {
            let outcome = tokio::select! {
                r = run_job(job) => r,
                _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
            };
            runtime.shutdown().await;
            outcome
        }
        None => {
            let mut supervision = runtime.subscribe_supervision();
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {
                    tracing::info!(node = %cfg.name, "ctrl-c: shutting down");
                    runtime.shutdown().await;
                    Ok(())
                }
                ev = wait_escalation(&mut supervision) => {
                    runtime.shutdown().await;
                    bail!("root supervisor escalated: {ev}")
                }
            }
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

async fn run_job(job: &JobConfig) -> Result<()> {
    match job.kind.as_str() {
        "hello" => hello_job(job).await,
        other => bail!("unknown job kind {other:?}"),
    }
}

async fn hello_job(job: &JobConfig) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(job.timeout_s);
    let experts = loop {
        let found = remote_experts();
        if found.len() >= job.experts {
            break found;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("only {} of {} hello experts joined within {} s", found.len(), job.experts, job.timeout_s);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    println!("hello: asking {} experts over QUIC: {:?}", experts.len(), job.question);
    let answers =
        ask_all(&experts, &job.question, Duration::from_secs(10)).await.map_err(anyhow::Error::msg)?;
    for a in &answers {
        println!("hello: answer from {a}");
    }
    println!("hello: done, {} answers", answers.len());
    Ok(())
}
