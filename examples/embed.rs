//! Embedding troupe in your own service: start a node in-process, spawn your own typed actor on
//! it, and call it through a handle. The same handle type reaches the actor from any other node
//! by name (see remote_counter.rs); here the call stays in-process and nothing is encoded.
//!
//!     cargo run -p troupe-examples --bin embed

use std::time::Duration;

use anyhow::Result;
use troupe::prelude::*;

/// Multiplies each value by the actor's factor.
#[derive(troupe::rkyv::Archive, troupe::rkyv::Serialize, troupe::rkyv::Deserialize)]
#[rkyv(crate = troupe::rkyv)]
pub struct Scale(pub Vec<f32>);

impl RemoteMessage for Scale {
    const NAME: &'static str = "scale";
    type Reply = Vec<f32>;
}

/// Your model: here a scaler; a real one would hold an ONNX session (see own_expert.rs).
pub struct Scaler {
    factor: f32,
}

impl TypedActor for Scaler {
    const KIND: &'static str = "scaler";
    type Args = f32;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Scale>(Allow::AnyMember);
    }

    async fn start(factor: f32, _: &ActorContext) -> Result<Self, ActorFailure> {
        Ok(Scaler { factor })
    }
}

impl Handles<Scale> for Scaler {
    async fn handle(&mut self, Scale(x): Scale, _: &ActorContext) -> Result<Vec<f32>, ActorFailure> {
        Ok(x.into_iter().map(|v| v * self.factor).collect())
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    // In production the identity and the cookie come from `troupe keys`; here a throwaway CA.
    let ca = ClusterCa::generate("embedded")?;
    // 127.0.0.1, any free port, no peers: NodeSpec's defaults
    let node =
        NodeRuntime::start(NodeSpec::new(ca.issue_node("my-service")?, "embedded-demo-cookie-00000000000"))
            .await?;
    // started under the node's supervisor: restarted from its arguments if it crashes
    let scaler = node.actors.spawn::<Scaler>("scaler", 2.0).await?;
    let out = scaler.call(Scale(vec![1.0, 2.0, 3.0]), Duration::from_secs(2)).await?;
    println!("my-service at {}: scaler answered {out:?}", node.link.local_addr()?);
    node.shutdown().await;
    Ok(())
}
