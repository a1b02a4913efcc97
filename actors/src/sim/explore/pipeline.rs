//! The `pipeline` workload of the fault explorer (simulation only): a client node submits jobs
//! to the real foreman service on its own node, which runs each over three real workers on the
//! stand-in stages ([`crate::sim::pipeline`]). Faults hit the workers and the foreman's node: a
//! crashed foreman loses everything but its disk, and the restarted service resumes the job
//! from its ledger when the client submits it again.
//!
//! The client submits [`PipelineWorkload::jobs`] jobs one after another (each starting no
//! sooner than [`PipelineWorkload::stagger`] after the last, so they meet the schedule's
//! faults), each of [`PipelineWorkload::inputs`] inputs; request `j * inputs + i` is input `i`
//! of job `j`, answered with a hash of its outputs. A job is submitted again only when the
//! call failed (the foreman lost, refused or silent past the call timeout); the stand-in is a
//! pure function of the inputs, so every answer must equal the fault-free run's.

use std::path::PathBuf;
use std::time::Duration;

use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::Mode;
use troupe_transport::{NodeId, Role, RoleSet};

use troupe_policy::sim::SimFault;

use super::{Answers, SimWorkload};
use crate::membership::MembershipConfig;
use crate::pipeline::ledger::hash_tensor;
use crate::pipeline::service::{FOREMAN_SERVICE, ForemanClient};
use crate::sim::pipeline::{foreman_spec, service_settings, sim_inputs, sim_stages, start_worker};
use crate::sim::{SimNode, SimNodeSpec};
use crate::supervisor::SupervisorMsg;

/// The workload: `jobs` jobs of `inputs` inputs each, started at least `stagger` apart.
#[derive(Clone, Debug)]
pub struct PipelineWorkload {
    /// Jobs the client submits, one after another.
    pub jobs: u64,
    /// Inputs of each job.
    pub inputs: u64,
    /// Least virtual time between two jobs' starts.
    pub stagger: Duration,
    /// Where each simulated world's disks go (a folder per hub, removed when its client ends).
    pub root: PathBuf,
    /// Each run's world (by tag), for tearing its foreman's journals on a crash.
    worlds: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, PathBuf>>>,
}

impl Default for PipelineWorkload {
    fn default() -> Self {
        Self {
            jobs: 4,
            inputs: 6,
            stagger: Duration::from_secs(2),
            root: super::disk::sim_disk_root()
                .join(format!("troupe-sim-pipeline-{}", super::disk::process_tag())),
            worlds: std::sync::Arc::default(),
        }
    }
}

/// The fault-switch site of run `tag`'s foremen (its own, so runs sharing the process never
/// share the switch).
fn fault_site(tag: &str) -> String {
    format!("{}/{tag}", crate::pipeline::FAULT_SITE)
}

/// The seed of the job's stages and inputs (the same in every run: answers are compared).
const JOB_SEED: u64 = 11;
/// The workers' names after the tag.
const WORKERS: [&str; 3] = ["w1", "w2", "w3"];
/// One submission's timeout.
const CALL: Duration = Duration::from_secs(30);
/// Longest wait for the foreman's service to be announced before a try.
const ANNOUNCED: Duration = Duration::from_secs(5);
/// The pause after a failed try.
const BACKOFF: Duration = Duration::from_millis(500);
/// The client gives a job up past this much virtual time from its start.
const GIVE_UP: Duration = Duration::from_secs(100);

/// Membership periods: heartbeats are most of a run's events, so fewer of them than the
/// `typed` workload's (a seed costs less wall time); a loss is still noticed within 1.5 s.
fn spec(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(250),
        timeout: Duration::from_millis(1500),
    })
}

/// A hash of one input's outputs (names, shapes, values).
pub fn digest(outputs: &[NamedTensor]) -> u64 {
    let mut h = blake3::Hasher::new();
    for t in outputs {
        hash_tensor(&mut h, t);
    }
    let mut out = [0u8; 8];
    out.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(out)
}

impl PipelineWorkload {
    /// Job `j`'s inputs.
    pub fn job_inputs(&self, j: u64) -> Vec<Vec<NamedTensor>> {
        sim_inputs(JOB_SEED + j * 1000, usize::try_from(self.inputs).unwrap_or(usize::MAX))
    }

    /// The folder of the world `node` lives in (its hub's number names it).
    fn world(&self, node: &SimNode) -> PathBuf {
        let hub = match node.actors.link() {
            troupe_transport::NodeLink::Sim(l) => l.hub().id(),
            troupe_transport::NodeLink::Quic(_) => 0,
        };
        self.root.join(format!("hub{hub}"))
    }
}

impl SimWorkload for PipelineWorkload {
    fn name(&self) -> &'static str {
        "pipeline"
    }

    /// The foreman's node keeps the jobs' ledgers: its crashes tear them.
    fn disks(&self, tag: &str) -> Vec<String> {
        vec![format!("{tag}-foreman")]
    }

    /// The foreman's node runs the jobs' schedulers, behind the run's own fault site.
    fn schedulers(&self, tag: &str) -> Vec<String> {
        vec![format!("{tag}-foreman")]
    }

    fn begin(&self, tag: &str) {
        super::arm_scheduler_panic(&fault_site(tag), false);
    }

    fn process_fault(&self, tag: &str, fault: &SimFault) -> Result<usize, String> {
        match fault {
            SimFault::Tear(_, tear) => {
                let world =
                    self.worlds.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(tag).cloned();
                world.map_or(Ok(0), |w| super::disk::tear_journals_in(&w.join("journal"), *tear))
            }
            SimFault::Panic(_) => {
                super::arm_scheduler_panic(&fault_site(tag), true);
                Ok(0)
            }
            _ => Ok(0),
        }
    }

    fn nodes(&self, tag: &str) -> Vec<SimNodeSpec> {
        let mut nodes = vec![
            spec(&format!("{tag}-client"), Role::Client),
            spec(&format!("{tag}-foreman"), Role::Scheduler),
        ];
        nodes.extend(WORKERS.iter().map(|w| spec(&format!("{tag}-{w}"), Role::Executor)));
        nodes
    }

    /// Starts the node's worker, or its foreman service (the client's node starts nothing).
    fn prepare(&self, node: &SimNode) {
        let world = self.world(node);
        let name = node.name.as_str().to_owned();
        if let Some(tag) = name.strip_suffix("-foreman") {
            self.worlds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(tag.into(), world.clone());
            let mut settings = service_settings(WORKERS.len(), &world.join("journal"));
            settings.job.fault_site = fault_site(tag);
            let spec = foreman_spec(node, &format!("{name}-service"), settings);
            let sup = node.supervisor.clone();
            tokio::spawn(async move {
                // a node crashed meanwhile starts nothing: its restart prepares it again
                let _ = ractor::call!(sup, SupervisorMsg::StartChild, spec);
            });
        } else if WORKERS.iter().any(|w| name.ends_with(&format!("-{w}"))) {
            let actors = node.actors.clone();
            tokio::spawn(async move {
                let _ = start_worker(&actors, &name, &world.join("cache")).await;
            });
        }
    }

    fn client(&self, tag: &str, node: &SimNode) -> impl Future<Output = Answers> + Send + 'static {
        let foreman = NodeId::new(format!("{tag}-foreman"));
        let client = ForemanClient::on_node(&node.actors, foreman.clone());
        let services = node.services.clone();
        let world = self.world(node);
        let this = self.clone();
        async move {
            let stages: Vec<_> = sim_stages(JOB_SEED).iter().map(|s| s.stage_file()).collect();
            let origin = crate::clock::timer_now();
            let mut answers = Answers::default();
            for j in 0..this.jobs {
                tokio::time::sleep_until(origin + this.stagger * u32::try_from(j).unwrap_or(u32::MAX)).await;
                let inputs = this.job_inputs(j);
                let started = crate::clock::timer_now();
                let ids = (0..this.inputs).map(|i| j * this.inputs + i);
                loop {
                    let announced = |s: &crate::service::Services| {
                        s.providers(FOREMAN_SERVICE).contains(&foreman).then_some(())
                    };
                    let _ = services.wait_for(ANNOUNCED, announced).await;
                    match client.submit(&stages, &inputs, Mode::Streaming, CALL).await {
                        Ok(answer) => {
                            for (id, out) in ids.clone().zip(&answer.outputs) {
                                answers.answers.entry(id).or_default().push(digest(out));
                            }
                            // an input with no output in the answer was never answered
                            answers.given_up.extend(ids.skip(answer.outputs.len()));
                            break;
                        }
                        Err(_) if started.elapsed() < GIVE_UP => tokio::time::sleep(BACKOFF).await,
                        Err(_) => {
                            answers.given_up.extend(ids);
                            break;
                        }
                    }
                }
            }
            client.close().await;
            let _ = std::fs::remove_dir_all(&world);
            // the process's root goes too once no other run's world is in it (not recursive:
            // a world still in use keeps it)
            if let Some(root) = world.parent() {
                let _ = std::fs::remove_dir(root);
            }
            answers
        }
    }
}
