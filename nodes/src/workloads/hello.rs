//! The `hello` workload: expert actors that answer questions, and a job that finds them through
//! a cluster-wide process group and asks each over QUIC.

use std::time::Duration;

use anyhow::{Result, bail};
use serde::Deserialize;
use troupe_actors::NodeRuntime;
use troupe_actors::hello::{HelloArgs, HelloExpert, ask_each, find_experts};
use troupe_actors::supervisor::ChildSpec;

use super::NodeContext;
use crate::config::{ActorConfig, JobConfig};

/// `params` of the `hello` job.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HelloJob {
    /// Number of experts to wait for.
    #[serde(default = "default_experts")]
    pub experts: usize,
    /// The question to ask.
    #[serde(default = "default_question")]
    pub question: String,
}

fn default_experts() -> usize {
    2
}

fn default_question() -> String {
    "What do the experts of this troupe say?".into()
}

/// Checks the job's params.
pub fn check_job(p: &HelloJob) -> Result<(), (String, String)> {
    if p.experts == 0 {
        return Err(("experts".into(), "must be at least 1".into()));
    }
    Ok(())
}

/// A hello expert answering as this node (`hello-expert` takes no params).
pub fn actor(ctx: &NodeContext, a: &ActorConfig) -> ChildSpec {
    let args = HelloArgs { node: ctx.config.name.clone(), services: Some(ctx.services.clone()) };
    ChildSpec::new(a.actor_name(), move || (HelloExpert, args.clone()))
}

/// Waits for the experts (woken by service announcements), asks each, prints the answers.
pub async fn run_job(_runtime: &NodeRuntime, ctx: &NodeContext, job: &JobConfig, p: HelloJob) -> Result<()> {
    let experts = match find_experts(&ctx.services, p.experts, Duration::from_secs(job.timeout_s)).await {
        Ok(found) => found,
        Err(found) => bail!("only {found} of {} hello experts joined within {} s", p.experts, job.timeout_s),
    };
    println!("hello: asking {} experts over QUIC: {:?}", experts.len(), p.question);
    let asked = std::time::Instant::now();
    let answers = ask_each(&ctx.services, &experts, &p.question, Duration::from_secs(10))
        .await
        .map_err(anyhow::Error::msg)?;
    let took = asked.elapsed();
    for a in &answers {
        println!("hello: answer from {a}");
    }
    crate::summary::Summary::new("hello job summary")
        .row("experts found", format!("{} (waited for {})", experts.len(), p.experts))
        .row("answers", format!("{} of {}", answers.len(), experts.len()))
        .row("asking took", crate::summary::ms(took.as_secs_f64() * 1e3))
        .print();
    println!("hello: done, {} answers", answers.len());
    Ok(())
}
