//! troupe's transport: QUIC endpoints with mutual TLS, framed rkyv messages, tensor codecs,
//! content-addressed blobs, and the [`Link`] seam with a seeded in-memory implementation.

pub mod blob;
pub mod codec;
pub mod frame;
pub mod hello;
pub mod identity;
pub mod link;
pub mod quic;
pub mod shm;
pub mod sim;

pub use blob::{
    BlobData, BlobError, BlobId, BlobPolicy, BlobRef, BlobRequest, BlobStore, BlobStoreConfig, Incoming,
};
pub use codec::{
    CodecError, Compression, DecodedTensor, EncodeReport, Encoding, TensorDecoder, TensorEncodeOptions,
    TensorEncoder, TensorLimits, WireDtype, WireTensor, decode_tensor, encode_tensor,
};
pub use frame::{Frame, FrameError, FrameKind, FrameLimits};
pub use identity::{ClusterCa, IdentityError, NodeIdentity};
pub use link::{Channel, Delivery, Link, LinkError, NodeId};
pub use quic::{PeerEvent, QuicConfig, QuicError, QuicNode};
pub use shm::{ShmConfig, ShmError, ShmStats};
pub use sim::{DropReason, SendOutcome, SimConfig, SimHub, SimLink, SimNet, SimStats};
