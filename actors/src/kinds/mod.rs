//! The actor kinds of the architecture: device, expert, scheduler. Work a scheduler has accepted
//! lives in a store apart from it (see [`scheduler`]), not in a buffer actor.

pub mod device;
pub mod expert;
pub mod scheduler;
