//! The coadapt workload on a simulated cluster (simulation only): the real edge (its typed
//! front, its scheduler shell, its journal on a real file, the replay and admission policy) and
//! the real camera actors (the online drift policy, the retrying edge calls, the reports), on
//! [`SimNode`]s.
//!
//! What is simulated: the model compute on both sides
//! ([`sim_compute`](crate::coadapt::sim_compute): hashed frames, confidences and answers, the
//! real co-adaptation scheduler over modelled epochs, costs on tokio's clock), and the disk is a
//! real file that keeps what was synced (a simulated disk that loses unsynced writes is a later
//! step). Node and actor names carry the caller's tag, as ractor's registry is process-wide.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use ractor::ActorRef;
use troupe_kernels::drift::{Corruption, DriftPhase, DriftSchedule};
use troupe_transport::{Role, RoleSet};

use super::explore::Answers;
use super::{SimNode, SimNodeSpec};
use crate::coadapt::camera::{CameraActor, CameraArgs, CameraCompute};
use crate::coadapt::detect::DetectorConfig;
use crate::coadapt::edge::{EdgeArgs, EdgeCompute, EdgeShared, Resumed};
use crate::coadapt::engine::EngineConfig;
use crate::coadapt::sim_compute::{SimAdaptSpec, SimCameraLog};
use crate::coadapt::wire::MAX_ADAPTATIONS;
use crate::membership::MembershipConfig;
use crate::supervisor::{ChildSpec, SupervisorMsg};
use crate::typed::Actors;

/// The student every simulated camera runs.
pub const SIM_STUDENT: &str = "tiny";
/// Frames each simulated camera streams.
pub const SIM_FRAMES: u64 = 1024;
/// Frames in a camera's held-out evaluation window.
pub const EVAL_FRAMES: u64 = 16;
/// How long a camera waits for the edge to appear and to answer, and keeps asking again.
pub const EDGE_PATIENCE: Duration = Duration::from_secs(10);

/// A node of the coadapt simulation named `name` with `role`, on quick membership periods.
pub fn spec(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(250),
        timeout: Duration::from_millis(1000),
    })
}

/// Camera `i`'s weather: clean, then two drifts at frames drawn from `seed` (so a camera
/// uploads twice over its stream).
pub fn drift_schedule(seed: u64, i: u64) -> DriftSchedule {
    let h = blake3::hash(&[seed.to_le_bytes(), i.to_le_bytes()].concat());
    let b = h.as_bytes();
    let first = 192 + 64 * u64::from(b[0] % 3);
    let second = first + 320 + 64 * u64::from(b[1] % 3);
    let weather = |k: u8| Corruption::ALL[1 + usize::from(k % 4)];
    let phases = vec![
        DriftPhase { start_frame: 0, corruption: Corruption::Clean, severity: 0.0 },
        DriftPhase { start_frame: first, corruption: weather(b[2]), severity: 0.5 },
        DriftPhase { start_frame: second, corruption: weather(b[3]), severity: 0.8 },
    ];
    DriftSchedule::new(phases).unwrap_or_else(|_| DriftSchedule::clean())
}

/// The edge's settings on the stand-in: the default engine (twin-buffer scheduler), every
/// camera's student expected.
pub fn edge_args() -> EdgeArgs {
    EdgeArgs {
        engine: EngineConfig::default(),
        expected: vec![SIM_STUDENT.into()],
        compute: EdgeCompute::Sim(SimAdaptSpec::default()),
    }
}

/// What starting actors on a simulated node takes, cloned out of the [`SimNode`] so that a
/// task may own it.
#[derive(Clone)]
pub struct NodeHandles {
    /// The node's name.
    pub name: String,
    /// Its typed actors.
    pub actors: Actors,
    /// Its root supervisor.
    pub supervisor: ActorRef<SupervisorMsg>,
}

impl From<&SimNode> for NodeHandles {
    fn from(node: &SimNode) -> Self {
        Self { name: node.name.to_string(), actors: node.actors.clone(), supervisor: node.supervisor.clone() }
    }
}

/// On `node`: opens the edge's journal at `journal` (replaying what it holds) and starts the
/// edge's front and scheduler (named with `tag`) under the node's root supervisor, as the
/// `coadapt-edge` entry does on a real node. Returns what it resumed from the journal.
pub async fn start_edge(node: &NodeHandles, tag: &str, journal: &Path) -> Result<Resumed, String> {
    let (edge, resumed) = EdgeShared::open(edge_args(), journal)?;
    edge.set_fault_site(&edge_fault_site(tag));
    if !resumed.damage.is_empty() {
        tracing::warn!(damage = ?resumed.damage, "the simulated edge's journal was damaged");
    }
    let children =
        edge.children(&node.actors, &format!("{tag}-edge-scheduler")).map_err(|e| e.to_string())?;
    for child in children {
        start_child(node, child).await?;
    }
    Ok(resumed)
}

/// The start arguments of camera `i` of `node` on the stand-in, recording into `log`.
pub fn camera_args(node: &NodeHandles, i: u64, seed: u64, log: &SimCameraLog) -> CameraArgs {
    CameraArgs {
        name: node.name.clone(),
        model: SIM_STUDENT.into(),
        schedule: drift_schedule(seed, i),
        seed: seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        detector: DetectorConfig::default(),
        shift: 0.5,
        uploads: 64,
        eval: EVAL_FRAMES as usize,
        frames: SIM_FRAMES,
        max_adaptations: 4,
        report_every: 4,
        edge_timeout: EDGE_PATIENCE,
        target_gain: 0.1,
        actors: node.actors.clone(),
        compute: CameraCompute::Sim { spec: SimAdaptSpec::default(), log: log.clone() },
    }
}

/// Starts a camera with `args` on `node` under its root supervisor (a restarted node's camera
/// streams from its first frame again).
pub async fn start_camera(node: &NodeHandles, args: CameraArgs) -> Result<(), String> {
    let name = format!("{}-camera", node.name);
    start_child(node, ChildSpec::new(name, move || (CameraActor, args.clone()))).await
}

async fn start_child(node: &NodeHandles, child: ChildSpec) -> Result<(), String> {
    let what = child.name.clone();
    ractor::call!(node.supervisor, SupervisorMsg::StartChild, child)
        .map_err(|e| format!("asking the root supervisor to start {what}: {e}"))?
        .map(|_| ())
        .map_err(|e| format!("starting {what}: {e}"))
}

/// The fault-switch site of run `tag`'s edge scheduler (its own, so runs sharing the process
/// never share the switch).
pub fn edge_fault_site(tag: &str) -> String {
    format!("{}/{tag}", crate::coadapt::edge::FAULT_SITE)
}

/// Request number of adaptation `adaptation` of the `camera`-th camera.
pub fn request_id(camera: usize, adaptation: u32) -> u64 {
    camera as u64 * MAX_ADAPTATIONS as u64 + u64::from(adaptation)
}

/// Whether every one of `cameras` has streamed to its end in its latest incarnation.
pub fn all_ended(log: &SimCameraLog, cameras: &[String]) -> bool {
    log.read(|seen| cameras.iter().all(|c| seen.get(c).and_then(|v| v.last()).is_some_and(|i| i.ended)))
}

/// What `cameras` installed, by [`request_id`]: one answer per adaptation when every
/// incarnation that got one got the same one, once; every answer otherwise (a violation). An
/// adaptation the latest incarnation uploaded and was never answered is given up on.
pub fn answers(log: &SimCameraLog, cameras: &[String]) -> Answers {
    let seen = log.snapshot();
    let mut out = Answers::default();
    for (c, name) in cameras.iter().enumerate() {
        let incarnations = seen.get(name).map(Vec::as_slice).unwrap_or_default();
        // per adaptation: every answer, and whether one incarnation got two
        let mut per: BTreeMap<u32, (Vec<u64>, bool)> = BTreeMap::new();
        for inc in incarnations {
            let mut here = BTreeSet::new();
            for &(a, digest) in &inc.answered {
                let e = per.entry(a).or_default();
                e.0.push(digest);
                e.1 |= !here.insert(a);
            }
        }
        for (a, (digests, twice)) in per {
            let same = digests.windows(2).all(|w| w[0] == w[1]);
            let kept = if same && !twice { digests.into_iter().take(1).collect() } else { digests };
            out.answers.insert(request_id(c, a), kept);
        }
        if let Some(last) = incarnations.last() {
            for &a in &last.uploaded {
                if !last.answered.iter().any(|(b, _)| *b == a) {
                    out.given_up.push(request_id(c, a));
                }
            }
        }
    }
    out.given_up.sort_unstable();
    out
}
