//! ExpertActor: one expert (a CoE expert model, a V-MoE expert, a pipeline stage). It knows where
//! its weights live and executes batches on its device; the model itself is an [`Expert`].

use std::marker::PhantomData;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

/// What an expert does; implemented by each workload's model wrapper.
pub trait Expert: Send + 'static {
    /// One input item.
    type Input: Send + 'static;
    /// One output item.
    type Output: Send + 'static;

    /// Brings the weights to the executing device (a real load: disk, host, device).
    fn load(&mut self) -> Result<(), ActorProcessingErr>;
    /// Releases the device copy of the weights.
    fn unload(&mut self);
    /// Whether the weights are on the device now.
    fn resident(&self) -> bool;
    /// Runs one batch; output `i` belongs to input `i`.
    fn execute(&mut self, batch: Vec<Self::Input>) -> Result<Vec<Self::Output>, ActorProcessingErr>;
}

/// Messages of an expert actor.
pub enum ExpertMsg<I, O> {
    /// Executes a batch (loading first if needed).
    Execute(Vec<I>, RpcReplyPort<Result<Vec<O>, String>>),
    /// Loads the weights.
    Load(RpcReplyPort<Result<(), String>>),
    /// Unloads the weights.
    Unload,
    /// Whether the weights are resident.
    Resident(RpcReplyPort<bool>),
}

impl<I: Send + 'static, O: Send + 'static> ractor::Message for ExpertMsg<I, O> {}

/// The expert actor over an [`Expert`] implementation.
pub struct ExpertActor<E>(PhantomData<fn() -> E>);

impl<E> Default for ExpertActor<E> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<E: Expert> Actor for ExpertActor<E> {
    type Msg = ExpertMsg<E::Input, E::Output>;
    type State = E;
    type Arguments = E;

    async fn pre_start(&self, _me: ActorRef<Self::Msg>, expert: E) -> Result<E, ActorProcessingErr> {
        Ok(expert)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        e: &mut E,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            ExpertMsg::Execute(batch, reply) => {
                let out = (|| {
                    if !e.resident() {
                        e.load()?;
                    }
                    e.execute(batch)
                })();
                let _ = reply.send(out.map_err(|err| err.to_string()));
            }
            ExpertMsg::Load(reply) => {
                let _ = reply.send(e.load().map_err(|err| err.to_string()));
            }
            ExpertMsg::Unload => e.unload(),
            ExpertMsg::Resident(reply) => {
                let _ = reply.send(e.resident());
            }
        }
        Ok(())
    }
}
