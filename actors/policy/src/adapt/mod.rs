//! Co-adaptation policies after AdaSprite (paper in `shared/seeds/adasprite-coadaptation.txt`).
//!
//! Several V-MoEs are merged into one co-adaptation pool (shared parts once, experts per model);
//! these modules decide how that pool uses one edge device:
//! * [`memory`]: per-expert temporary-memory estimator (§3.2.1);
//! * [`grouping`]: knapsack DP packing experts into ordered time slices (§3.2.1);
//! * [`plan`]: the executor's per-step slice plan from the two above (§3.2.1);
//! * [`layout`]: the lifespan-ordered pool: long-lived buffers low, the reuse tier on top, each
//!   step's temporaries in contiguous slots placed by execution order (§3.2.1, §3.3);
//! * [`evict`]: what the executor unloads, splits or gives up when the pool refuses memory;
//! * [`threads`]: fill-clamp-refill compute allocation within a slice (§3.2.2);
//! * [`reuse`] and [`predictor`]: budgeted disk-backed reuse cache with I/O-hiding token order
//!   and importance-aware residency (§3.3);
//! * [`age`], [`nnls`] and [`twin`]: twin-buffer scheduler driven by accuracy gain per epoch (§3.4);
//! * [`slo`]: Moore–Hodgson ordering and cycle sizing for tasks that carry an SLO deadline;
//! * [`baselines`]: isolated, AMS-like, RECL-like and MoE-SE schedulers (§5.1);
//! * [`oracle`]: the compute limit: which tasks preemptive EDF with no overhead gets done on
//!   time from their measured CPU work (the bench's K*);
//! * [`sim`]: a seeded discrete-event simulator comparing them (§5.3-5.4 style figures).
//! * [`drift`] and [`online`]: a camera's drift detection, re-arming after each update, its
//!   bounded accuracy log, and when a job over streaming cameras may end;
//! * [`transfer`]: cross-task expert transfer, whose experts in the group's parallel expert set a
//!   member may update (§2.2);
//! * [`storage`]: storage read throttles, the bandwidth that makes an un-hidden reuse read cost
//!   0.7x the compute it saves, and the FoggyCache-like on-demand reuse the bench compares with;
//! * [`replay`]: which uploads repeat a drift phase already adapted or under way (a restarted
//!   camera), so each phase is adapted once.

pub mod age;
pub mod baselines;
pub mod drift;
pub mod evict;
pub mod grouping;
pub mod layout;
pub(crate) mod linalg;
pub mod memory;
pub mod nnls;
pub mod online;
pub mod oracle;
pub mod plan;
pub mod predictor;
pub mod replay;
pub mod reuse;
pub mod sched;
pub mod sim;
pub mod slo;
pub mod storage;
pub mod threads;
pub mod transfer;
pub mod twin;

#[cfg(test)]
pub(crate) mod golden;
#[cfg(test)]
mod golden_tests;

/// An expert in the co-adaptation pool (unique across the merged models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExpertId(pub u32);

/// A V-MoE model (one per device) in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelId(pub u32);

/// One adaptation task (a job to re-train one model's experts after drift).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId(pub u32);
