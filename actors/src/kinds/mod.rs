//! The four actor kinds of the architecture: device, expert, buffer, scheduler.

pub mod device;
pub mod expert;
pub mod scheduler;
