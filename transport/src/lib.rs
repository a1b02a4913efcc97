//! troupe's transport: QUIC endpoints with mutual TLS, framed rkyv messages, tensor codecs,
//! content-addressed blobs, and the [`Link`] seam with a seeded in-memory implementation.

pub mod frame;
pub mod hello;
pub mod identity;
pub mod link;
pub mod quic;

pub use frame::{Frame, FrameError, FrameKind, FrameLimits};
pub use identity::{ClusterCa, IdentityError, NodeIdentity};
pub use link::{Channel, Delivery, Link, LinkError, NodeId};
pub use quic::{PeerEvent, QuicConfig, QuicError, QuicNode};
