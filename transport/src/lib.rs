//! troupe's transport: QUIC endpoints with mutual TLS, framed rkyv messages, tensor codecs,
//! content-addressed blobs, and the [`Link`] seam with a seeded in-memory implementation.

pub mod admission;
pub mod blob;
pub mod blocking;
pub mod budget;
pub mod codec;
pub mod control;
pub mod cookie;
pub mod datagram;
pub mod frame;
pub mod hello;
pub mod identity;
pub mod impaired;
pub mod link;
pub mod local;
pub mod quic;
pub mod roles;
pub mod runtime_link;
pub mod service;
pub mod shm;
pub mod sim;
pub mod traffic;

pub use admission::{Admission, Refusal, RevocationError, Revocations};
pub use blob::{
    BlobData, BlobError, BlobId, BlobPolicy, BlobRef, BlobRequest, BlobStore, BlobStoreConfig, Incoming,
};
pub use blocking::off_the_runtime;
pub use budget::{BudgetExceeded, ConnBudget, DEFAULT_CONN_BUDGET, Held};
pub use codec::{
    CodecError, Compression, DecodeBudget, DecodedTensor, EncodeReport, Encoding, TensorDecoder,
    TensorEncodeOptions, TensorEncoder, TensorLimits, WireDtype, WireTensor, decode_tensor, encode_tensor,
};
pub use control::ControlStream;
pub use frame::{Body, Frame, FrameError, FrameKind, FrameLimits};
pub use identity::{CertInfo, ClusterCa, IdentityError, IssueOptions, NodeIdentity, Validity};
pub use link::{Channel, Delivery, Link, LinkError, NodeId};
pub use local::{LocalError, LocalStats};
pub use quic::{PeerEvent, QuicConfig, QuicError, QuicNode};
pub use roles::{Role, RoleError, RoleSet};
pub use runtime_link::{DeliverySink, NodeLink, RuntimeLink};
pub use shm::{ShmConfig, ShmError, ShmStats};
pub use sim::{DropReason, SendOutcome, SimConfig, SimHub, SimLink, SimNet, SimStats};
pub use traffic::ChannelTraffic;
