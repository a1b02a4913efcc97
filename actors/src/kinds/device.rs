//! DeviceActor: owns one compute device's memory budget (a `troupe_kernels::MemoryPool`, a hard
//! cap with fragmentation figures) and reports telemetry on a heartbeat.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use tokio::sync::broadcast;
use troupe_kernels::{Allocation, MemoryPool};

use crate::wire::DeviceView;

/// Start arguments of a device actor.
pub struct DeviceArgs {
    /// Name (also the ractor registry name).
    pub name: String,
    /// "cpu" or "cuda:N".
    pub kind: String,
    /// Memory budget in bytes.
    pub budget_bytes: u64,
    /// Telemetry period.
    pub telemetry_period: Duration,
    /// Where telemetry goes.
    pub telemetry: broadcast::Sender<DeviceView>,
}

/// Messages of a device actor.
#[derive(RactorMessage)]
pub enum DeviceMsg {
    /// Reserves `bytes`; an error names the budget when it does not fit.
    Alloc(u64, RpcReplyPort<Result<Allocation, String>>),
    /// Releases an allocation.
    Free(Allocation, RpcReplyPort<Result<(), String>>),
    /// The current budget view.
    View(RpcReplyPort<DeviceView>),
    /// Telemetry period elapsed.
    Tick,
}

/// The device actor.
pub struct DeviceActor;

/// Device state: its pool and where telemetry goes.
pub struct DeviceState {
    name: String,
    kind: String,
    pool: MemoryPool,
    telemetry: broadcast::Sender<DeviceView>,
}

impl DeviceState {
    fn view(&self) -> DeviceView {
        let s = self.pool.stats();
        DeviceView {
            name: self.name.clone(),
            kind: self.kind.clone(),
            budget_bytes: s.budget,
            used_bytes: s.used,
            fragmentation: s.external_fragmentation,
        }
    }
}

impl Actor for DeviceActor {
    type Msg = DeviceMsg;
    type State = DeviceState;
    type Arguments = DeviceArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        a: DeviceArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        ractor::pg::join_scoped("troupe".into(), "devices".into(), vec![me.get_cell()]);
        ractor::time::send_interval(a.telemetry_period, me.get_cell(), || DeviceMsg::Tick);
        Ok(DeviceState {
            pool: MemoryPool::new(a.name.clone(), a.budget_bytes, 256)?,
            name: a.name,
            kind: a.kind,
            telemetry: a.telemetry,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            DeviceMsg::Alloc(bytes, reply) => {
                let _ = reply.send(st.pool.alloc(bytes).map_err(|e| e.to_string()));
            }
            DeviceMsg::Free(a, reply) => {
                let _ = reply.send(st.pool.free(a).map_err(|e| e.to_string()));
            }
            DeviceMsg::View(reply) => {
                let _ = reply.send(st.view());
            }
            DeviceMsg::Tick => {
                let _ = st.telemetry.send(st.view());
            }
        }
        Ok(())
    }
}
