//! Your own ONNX model served as an actor from your own code, and called from another node
//! process by name.
//!
//!     scripts/setup    # once: builds .cache, with the ONNX Runtime library and the model used here
//!     cargo run -p troupe-examples --bin own_expert
//!
//! With no arguments it runs the whole demo on this machine: it makes a throwaway cluster CA and
//! node certificates in a temporary directory, then starts itself as two node processes:
//!
//! - `expert` (role executor) loads an ONNX model (here setup's `tiny_mlp.onnx`, 4 inputs to 2
//!   outputs) into the actor `tiny-mlp`, which runs it with troupe's ONNX executor;
//! - `app` (role scheduler) looks `tiny-mlp` up by name and asks it for predictions.
//!
//! The demo echoes what the nodes print and exits non-zero if anything went wrong; each node
//! process stops when its stdin closes, so none outlives the demo. To serve your own model (one
//! f32 input `[batch, features]`, an f32 output `[batch, classes]` first), run
//! `own_expert serve DIR path/to/model.onnx` with certificates from `troupe keys`; the ONNX
//! Runtime library comes from `ORT_DYLIB_PATH`, else from the setup cache.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use troupe::kernels::assets::{Assets, TINY_MLP};
use troupe::kernels::onnx::{IoSpec, NamedTensor, OnnxSession, SessionConfig};
use troupe::prelude::*;
use troupe::transport::NodeIdentity;
use troupe_examples::demo::{Node, TempDir, WAIT, or_stdin_closed, stdin_closed};

// ---- the actor: a model behind typed messages ------------------------------------------------

/// Runs the model on a batch of rows; answers one row of outputs per input row.
#[derive(troupe::rkyv::Archive, troupe::rkyv::Serialize, troupe::rkyv::Deserialize)]
#[rkyv(crate = troupe::rkyv)]
pub struct Predict {
    /// The inputs, each as wide as the model's input.
    pub rows: Vec<Vec<f32>>,
}

impl RemoteMessage for Predict {
    const NAME: &'static str = "predict";
    type Reply = Vec<Vec<f32>>;
}

/// An ONNX model with one f32 input `[batch, features]`, answering its first output.
pub struct OnnxExpert {
    session: OnnxSession,
    input: String,
    features: usize,
}

impl TypedActor for OnnxExpert {
    const KIND: &'static str = "onnx-expert";
    /// The model file (on the node that runs the actor).
    type Args = String;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Predict>(Allow::AnyMember);
    }

    async fn start(model: String, ctx: &ActorContext) -> Result<Self, ActorFailure> {
        let session = OnnxSession::from_file(Path::new(&model), &SessionConfig::default())?;
        let (input, features) = match session.inputs() {
            [x] => match x.dims[..] {
                [_, Some(features)] => (x.name.clone(), usize::try_from(features)?),
                _ => {
                    return Err(ActorFailure::msg(format!(
                        "{model}: input {} is not [batch, features]",
                        x.name
                    )));
                }
            },
            other => return Err(ActorFailure::msg(format!("{model}: {} inputs, not one", other.len()))),
        };
        let (inputs, outputs) = (shapes(session.inputs()), shapes(session.outputs()));
        println!("{} loaded {model}: {inputs} -> {outputs}", ctx.name);
        Ok(OnnxExpert { session, input, features })
    }
}

impl Handles<Predict> for OnnxExpert {
    async fn handle(
        &mut self,
        Predict { rows }: Predict,
        _: &ActorContext,
    ) -> Result<Vec<Vec<f32>>, ActorFailure> {
        if let Some(row) = rows.iter().find(|r| r.len() != self.features) {
            let wanted = self.features;
            return Err(ActorFailure::msg(format!("each row takes {wanted} values, not {}", row.len())));
        }
        let x = NamedTensor::f32(&self.input, vec![rows.len(), self.features], rows.concat());
        // the model runs on this thread: tell the runtime, so other tasks move elsewhere meanwhile
        let outputs = tokio::task::block_in_place(|| self.session.run(&[x]))?;
        let y = outputs.first().ok_or_else(|| ActorFailure::msg("the model has no output"))?;
        let width =
            y.shape.get(1).copied().ok_or_else(|| ActorFailure::msg("the output is not [batch, classes]"))?;
        let y = y.as_f32().ok_or_else(|| ActorFailure::msg("the output is not f32"))?;
        Ok(y.chunks(width.max(1)).map(<[f32]>::to_vec).collect())
    }
}

fn shapes(specs: &[IoSpec]) -> String {
    let shape = |s: &IoSpec| {
        let dims: Vec<String> = s.dims.iter().map(|d| d.map_or("?".into(), |d| d.to_string())).collect();
        format!("{} {} [{}]", s.name, s.dtype, dims.join(", "))
    };
    specs.iter().map(shape).collect::<Vec<_>>().join(", ")
}

// ---- the node processes ----------------------------------------------------------------------

/// The cluster's shared secret (in production: the one `troupe keys init` writes).
const COOKIE: &str = "own-expert-demo-cookie-000000000";

/// `serve DIR MODEL`: as node `expert`, serves MODEL as the actor `tiny-mlp` until stdin closes.
async fn serve(dir: &Path, model: &str) -> Result<()> {
    let node = start_node(dir, "expert", &[]).await?;
    node.actors.spawn::<OnnxExpert>("tiny-mlp", model.to_string()).await?;
    println!("serving tiny-mlp");
    stdin_closed().await;
    node.shutdown().await;
    Ok(())
}

/// `ask DIR expert=ADDR`: as node `app`, asks `tiny-mlp` for two predictions.
async fn ask(dir: &Path, peers: &[&str]) -> Result<()> {
    let node = start_node(dir, "app", peers).await?;
    let expert = node.actors.wait_for::<OnnxExpert>("tiny-mlp", WAIT).await?;
    let rows = vec![vec![1.0, 2.0, 3.0, 4.0], vec![0.5, 1.0, -0.5, 2.0]];
    let answers = expert.call(Predict { rows: rows.clone() }, WAIT).await?;
    for (x, y) in rows.iter().zip(&answers) {
        println!("{x:?} -> {y:.3?}");
    }
    // a wrong-sized row is the handler's failure, answered as such; the actor goes on
    match expert.call(Predict { rows: vec![vec![1.0]] }, WAIT).await {
        Err(ActorError::Failed { detail, .. }) => println!("refused: {detail}"),
        other => bail!("a row of one value: {other:?}"),
    }
    node.shutdown().await;
    Ok(())
}

/// Starts node `name` from its certificate in `dir`, dialing `peers` (`NAME=ADDR` each), and
/// prints the address it listens on.
async fn start_node(dir: &Path, name: &str, peers: &[&str]) -> Result<NodeRuntime> {
    let peers = peers
        .iter()
        .map(|p| {
            let (name, addr) = p.split_once('=').with_context(|| format!("peer {p:?} is not NAME=ADDR"))?;
            Ok(PeerAddr { name: NodeId::new(name), addr: addr.parse()? })
        })
        .collect::<Result<Vec<_>>>()?;
    let spec =
        NodeSpec::new(NodeIdentity::load(dir, name)?, COOKIE).peers(peers).redial(Duration::from_millis(100));
    let node = NodeRuntime::start(spec).await?;
    println!("listening {}", node.link.local_addr()?);
    Ok(node)
}

// ---- the demo: a throwaway cluster of processes ------------------------------------------------

async fn demo() -> Result<()> {
    let model = Assets::locate()
        .and_then(|a| a.path(TINY_MLP))
        .context("the demo serves the setup cache's tiny_mlp.onnx")?;
    let model = model.to_str().context("the model's path is not UTF-8")?.to_string();
    let dir = TempDir::new("own-expert")?;
    let ca = ClusterCa::generate("own-expert-demo")?;
    std::fs::write(dir.0.join("ca.crt"), ca.cert_pem())?;
    for (name, role) in [("expert", Role::Executor), ("app", Role::Scheduler)] {
        ca.issue(name, &IssueOptions::new(RoleSet::only(role))?)?.write(&dir.0)?;
    }
    let dir_arg = dir.0.to_str().context("the temporary directory's path is not UTF-8")?;

    let mut expert = Node::spawn("expert", &["serve", dir_arg, &model])?;
    let peer = format!("expert={}", expert.expect("listening ").await?);
    expert.expect("serving tiny-mlp").await?;
    let app = Node::spawn("app", &["ask", dir_arg, &peer])?.wait().await?;
    ensure!(app.iter().filter(|l| l.contains("] -> [")).count() == 2, "app got no predictions");
    expert.stop().await?;
    println!("demo ok");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.iter().map(String::as_str).collect::<Vec<_>>().as_slice() {
        [] => demo().await,
        ["serve", dir, model] => serve(Path::new(dir), model).await,
        ["ask", dir, peers @ ..] => or_stdin_closed(ask(Path::new(dir), peers)).await,
        _ => bail!("usage: own_expert [serve DIR MODEL.onnx | ask DIR NAME=ADDR...]"),
    }
}
