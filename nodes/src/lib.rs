//! troupe: an actor runtime for edge ML.
//!
//! This crate is what the `troupe` binary runs (config, nodes, topology launcher, chaos, status,
//! dashboard, workloads) and the facade an embedding service uses: the crates below are re-exported
//! whole. The command line is `troupe-cli` (nodes/cli), the benchmarks `troupe-bench` (nodes/bench).
//! A node binary of your own, with your actor kinds beside troupe's, is a [`NodeMain`].
//!
//! # Features
//!
//! - `cuda` (default): CUDA devices through cudarc, loaded at run time. Without it no cudarc is
//!   built and asking for a CUDA device is `KernelError::CudaUnavailable`; the CPU is used.
//! - `onnx` (default): ONNX Runtime (ort), the ONNX proto (prost) and the workloads that run ONNX
//!   models: `kernels::onnx`, `kernels::mlp_engine`, `actors::coe`, `actors::pipeline` and the
//!   `coe-` / `pipeline-` kinds and jobs.
//!
//! With `default-features = false` the node runtime, membership, services, supervision, typed
//! actors ([`prelude`]), transport and the `hello` and `coadapt` workloads build and work as
//! before. The `troupe` binary (troupe-cli) has both features on.

/// The actor library troupe's runtime is built on, at the version it uses.
pub use ractor;
/// The zero-copy serialisation typed messages use, at the version the runtime checks with.
pub use rkyv;
pub use troupe_actors as actors;
pub use troupe_kernels as kernels;
pub use troupe_policy as policy;
pub use troupe_transport as transport;

pub use kinds::Kinds;
pub use node_main::NodeMain;

/// What a service embedding troupe usually needs: the node runtime and typed actors.
pub mod prelude {
    pub use troupe_actors::service::Allow;
    pub use troupe_actors::supervisor::{Intensity, SupervisorEvent};
    pub use troupe_actors::typed::{
        ActorContext, ActorError, ActorFailure, ActorHandle, Actors, Handles, PlacementRules, Protocol,
        RemoteChild, RemoteMessage, TypedActor,
    };
    pub use troupe_actors::{MembershipConfig, NodeRuntime, NodeSpec, PeerAddr, fixed_children};
    pub use troupe_transport::{ClusterCa, IssueOptions, NodeId, NodeIdentity, Role, RoleSet};
}

/// The README's embedding snippet, compiled by `cargo test --doc` so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

pub mod config;
pub mod kinds;
pub mod node_main;
pub mod workloads;

// The `troupe` binary's own machinery (launcher, chaos, status, dashboard, metrics endpoint,
// progress bars, summaries): public for troupe's CLI, benches and tests, not an API to build on.
#[doc(hidden)]
pub mod chaos;
#[doc(hidden)]
pub mod chart;
#[doc(hidden)]
pub mod dashboard;
#[doc(hidden)]
pub mod metrics;
#[doc(hidden)]
pub mod netns;
#[doc(hidden)]
pub mod node_cmd;
#[doc(hidden)]
pub mod progress;
#[doc(hidden)]
pub mod sim;
#[doc(hidden)]
pub mod status;
#[doc(hidden)]
pub mod summary;
#[doc(hidden)]
pub mod up;
