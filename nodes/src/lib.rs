//! troupe: an actor runtime for edge ML. This facade re-exports what an embedding service needs.

pub use troupe_actors as actors;
pub use troupe_kernels as kernels;
pub use troupe_policy as policy;
pub use troupe_transport as transport;
