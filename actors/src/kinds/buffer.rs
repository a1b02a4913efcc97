//! BufferActor: holds data between computations (request queues, tensors in flight). A push is
//! either accepted (then the item is held until popped) or refused with the item handed back:
//! nothing accepted is ever dropped.

use std::collections::VecDeque;
use std::marker::PhantomData;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

/// Messages of a buffer of `T`.
pub enum BufferMsg<T> {
    /// Adds an item; `Err(item)` when the buffer is full.
    Push(T, RpcReplyPort<Result<(), T>>),
    /// Removes the oldest item.
    Pop(RpcReplyPort<Option<T>>),
    /// Number of items held.
    Len(RpcReplyPort<usize>),
}

impl<T: Send + 'static> ractor::Message for BufferMsg<T> {}

/// A bounded FIFO buffer actor.
pub struct BufferActor<T>(PhantomData<fn() -> T>);

impl<T> Default for BufferActor<T> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

/// Buffer state: the items and the capacity.
pub struct BufferState<T> {
    items: VecDeque<T>,
    capacity: usize,
}

impl<T: Send + 'static> Actor for BufferActor<T> {
    type Msg = BufferMsg<T>;
    type State = BufferState<T>;
    type Arguments = usize;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        capacity: usize,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(BufferState { items: VecDeque::with_capacity(capacity.min(1024)), capacity })
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            BufferMsg::Push(item, reply) => {
                if st.items.len() >= st.capacity {
                    let _ = reply.send(Err(item));
                } else {
                    st.items.push_back(item);
                    let _ = reply.send(Ok(()));
                }
            }
            BufferMsg::Pop(reply) => {
                let _ = reply.send(st.items.pop_front());
            }
            BufferMsg::Len(reply) => {
                let _ = reply.send(st.items.len());
            }
        }
        Ok(())
    }
}
