//! Pure decision cores (sans-IO) for troupe.
//!
//! Every policy is a plain struct driven by its caller: `handle_*(now, input)` feeds it events,
//! `poll_action()` drains the decisions it made, `poll_timeout()` says when it next wants to be
//! woken. Time ([`Micros`]) and randomness (a seeded RNG) always come from outside, so the same
//! policy runs live inside an actor, under a seeded simulation, and in a benchmark replaying a trace.

pub mod adapt;
pub mod chaos;
pub mod coe;
pub mod compaction;
pub mod fault;
pub mod impair;
pub mod membership;
pub mod pipeline;
pub mod placement;
pub mod restart;
pub mod roster;
pub mod sim;
pub mod stats;
pub mod time;

pub use chaos::{ChaosNode, ChaosSite, ChaosSpec, Fault, ScheduleError};
pub use fault::{FaultPlan, SiteRule};
pub use impair::{LinkImpairment, Verdict};
pub use membership::{FailureDetector, MemberStatus, MembershipEvent};
pub use restart::{RestartDecision, RestartIntensity};
pub use roster::{AllLost, Roster};
pub use time::Micros;
