//! troupe's transport: QUIC endpoints with mutual TLS, framed rkyv messages, tensor codecs,
//! content-addressed blobs, and the [`Link`] seam with a seeded in-memory implementation.

pub mod frame;
pub mod link;

pub use frame::{Frame, FrameError, FrameKind, FrameLimits};
pub use link::{Channel, Delivery, Link, LinkError, NodeId};
