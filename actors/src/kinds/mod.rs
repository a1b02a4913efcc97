//! The runtime's own actor kinds: device and scheduler (users' kinds are [`crate::typed`]).
//! Work a scheduler has accepted lives in a store apart from it (see [`scheduler`]), not in a
//! buffer actor.

pub mod device;
pub mod scheduler;
