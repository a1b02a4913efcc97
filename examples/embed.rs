//! Embedding troupe in your own service: start a node runtime in-process with your own actor
//! under its root supervisor, then talk to the actor.
//!
//!     cargo run -p troupe-examples --example embed

use std::time::Duration;

use anyhow::Result;
use ractor::{ActorProcessingErr, ActorRef};
use troupe::actors::supervisor::ChildSpec;
use troupe::actors::{
    Expert, ExpertActor, ExpertMsg, MembershipConfig, NodeRuntime, NodeSpec, fixed_children,
};
use troupe::transport::{ClusterCa, QuicConfig};

/// Your model: here a tiny "expert" that scales its inputs; a real one would hold an ONNX session.
struct Scaler {
    factor: f32,
    loaded: bool,
}

impl Expert for Scaler {
    type Input = Vec<f32>;
    type Output = Vec<f32>;

    fn load(&mut self) -> Result<(), ActorProcessingErr> {
        self.loaded = true;
        Ok(())
    }
    fn unload(&mut self) {
        self.loaded = false;
    }
    fn resident(&self) -> bool {
        self.loaded
    }
    fn execute(&mut self, batch: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, ActorProcessingErr> {
        Ok(batch.into_iter().map(|x| x.into_iter().map(|v| v * self.factor).collect()).collect())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    // In production the identity comes from `troupe keys`; here a throwaway CA.
    let ca = ClusterCa::generate("embedded")?;
    let spec = NodeSpec {
        identity: ca.issue_node("my-service")?,
        quic: QuicConfig::default(), // 127.0.0.1, any port
        peers: Vec::new(),
        membership: MembershipConfig::default(),
        intensity: Default::default(),
        cookie: "embedded".into(),
        children: fixed_children(vec![ChildSpec::new("scaler", || {
            (ExpertActor::<Scaler>::default(), Scaler { factor: 2.0, loaded: false })
        })]),
        redial: Duration::from_millis(200),
        placement: Default::default(),
    };
    let node = NodeRuntime::start(spec).await?;
    let scaler: ActorRef<ExpertMsg<Vec<f32>, Vec<f32>>> =
        ractor::registry::where_is("scaler").ok_or_else(|| anyhow::anyhow!("scaler not running"))?.into();
    let out = ractor::call_t!(scaler, ExpertMsg::Execute, 2000, vec![vec![1.0, 2.0, 3.0]])?
        .map_err(anyhow::Error::msg)?;
    println!("my-service at {}: scaler answered {out:?}", node.link.local_addr()?);
    println!("status: {:?}", node.status().await?);
    node.shutdown().await;
    Ok(())
}
