//! Decisions of the seeded simulation (simulation only): what faults a simulated run injects.

pub mod faults;

pub use faults::{FaultSchedule, FaultSpace, SimFault, TimedFault};
