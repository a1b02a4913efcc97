//! troupe: an actor runtime for edge ML.
//!
//! This crate is the `troupe` binary (CLI, config, topology launcher, benchmarks) and the facade an
//! embedding service uses: the crates below are re-exported whole.

pub use troupe_actors as actors;
pub use troupe_kernels as kernels;
pub use troupe_policy as policy;
pub use troupe_transport as transport;

pub mod bench;
pub mod chaos;
pub mod cli;
pub mod config;
pub mod dashboard;
pub mod metrics;
pub mod netns;
pub mod node_cmd;
pub mod progress;
pub mod status;
pub mod summary;
pub mod up;
pub mod workloads;
