//! Messages between the pipeline foreman and its workers, and how tensors ride in them.
//!
//! Every request is a typed message to the worker actor ([`crate::typed::RemoteMessage`], one
//! type per command with its reply type) riding the runtime's one wire path; the receiver reads
//! it with checked access and never trusts lengths it did not check. f32 tensors travel through the transport codec
//! (byte-shuffle + zstd, lossless unless bf16 was asked for); i64 tensors (token ids, masks) go
//! as plain little-endian integers. A tensor whose encoded form is above
//! [`BY_REFERENCE_ABOVE`] travels by reference: the sender keeps the bytes in its [`BlobShelf`]
//! and sends the BLAKE3 hash; the receiver pulls them over the QUIC blob stream.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use crate::decode::DecodeError;
use crate::typed::RemoteMessage;
use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};
use troupe_kernels::onnx::{NamedTensor, TensorData};
use troupe_transport::codec::{
    Compression, DecodeBudget, TensorDecoder, TensorEncodeOptions, TensorEncoder, TensorLimits,
};
use troupe_transport::quic::BlobServer;
use troupe_transport::{Link, NodeId, NodeLink};

/// Encoded tensors above this many bytes travel by reference (a hash pulled over QUIC).
pub const BY_REFERENCE_ABOVE: usize = 1 << 20;
/// Largest message body accepted (the control plane's own cap is 16 MiB).
pub const MAX_MESSAGE_BYTES: usize = crate::decode::MAX_MESSAGE_BYTES;
/// Largest tensor accepted from a peer, in decoded bytes.
pub const MAX_TENSOR_BYTES: usize = 256 << 20;
/// Default decoded-bytes budget of one request or response: all its tensors together (f32
/// decoded, i64 as carried) decode to at most this much, however small they are on the wire.
pub const MAX_MESSAGE_DECODED_BYTES: u64 = 512 << 20;
/// Most tensors one request or response may carry.
pub const MAX_TENSORS: usize = 64;
/// Most bytes a [`BlobShelf`] keeps for tensors before it drops the oldest.
pub const SHELF_TENSOR_BUDGET: usize = 512 << 20;

/// A named tensor on the wire.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct WireNamed {
    /// Graph input/output name.
    pub name: String,
    /// The payload.
    pub body: TensorBody,
}

/// A worker's telemetry sample (CPU and RSS from the OS; battery and temperature from its
/// configured device model: simulated on hardware that is not a phone).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Default)]
pub struct TelemetrySample {
    /// CPU time of the worker process per wall second since the last sample (0..cores).
    pub cpu_load: f64,
    /// Resident set size now, bytes.
    pub rss_bytes: u64,
    /// Peak resident set size (VmHWM), bytes.
    pub peak_rss_bytes: u64,
    /// The worker's RAM budget, bytes.
    pub ram_budget_bytes: u64,
    /// Budget left: budget minus RSS.
    pub free_ram_bytes: u64,
    /// Simulated battery level, percent.
    pub battery_pct: f64,
    /// Simulated temperature, degrees Celsius.
    pub temperature_c: f64,
    /// The worker's process id: a foreman that sees another pid than the one that joined knows
    /// the worker's node was restarted (a new incarnation answered), so the calls it has out to
    /// the old one will never be answered.
    pub pid: u32,
}

/// A worker's own counters, for the residency invariant and the benchmark.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Default)]
pub struct WorkerStats {
    /// Most sessions ever live at once in the worker process (must be at most 1).
    pub max_live_sessions: u32,
    /// Sessions created.
    pub loads: u32,
    /// Sessions dropped on request.
    pub unloads: u32,
    /// Loads refused because a session was live.
    pub refused_loads: u32,
    /// Stage files pulled over the network.
    pub pulls: u32,
    /// Tasks run.
    pub runs: u32,
    /// Peak RSS of the worker process (VmHWM), bytes.
    pub peak_rss_bytes: u64,
    /// Size of the largest stage file the process pulled or loaded, bytes (its weights plus a
    /// graph of a few KB): what its peak is held against, over the same lifetime as the peak.
    pub largest_stage_bytes: u64,
    /// The worker's process id: these counters are that process's (a restarted worker's start
    /// from zero), so a foreman keeps them only from the process it knows.
    pub pid: u32,
}

/// A worker's own account of one task outside the compute: where its time went (microseconds)
/// and which input bytes it read from where. Measured by the worker, sent with the answer.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Default)]
pub struct RunTimes {
    /// Reading the request (checked access) once the actor took it.
    pub request_micros: u64,
    /// Getting the inputs: pulling references and decoding tensors.
    pub inputs_micros: u64,
    /// Encoding the outputs (and putting them on the shelf when kept).
    pub encode_micros: u64,
    /// From the actor taking the request to the answer being ready to serialise.
    pub handled_micros: u64,
    /// Tensor bytes pulled from other nodes by reference.
    pub pulled_bytes: u64,
    /// Tensor bytes taken by reference from this worker's own shelf (no transfer).
    pub local_bytes: u64,
    /// f32 payload bytes that came inline in the request.
    pub inline_f32_bytes: u64,
    /// CPU the session's run took on its thread (ONNX Runtime runs on the calling thread with
    /// one intra-op thread): what a task's compute costs in this process, where the wall time
    /// counts the waits a quota or a loaded host adds.
    pub compute_cpu_micros: u64,
}

use messages::ArchivedTensorBody;
pub use messages::{RunReply, TensorBody};

/// Who are you: node name, pid, cached stage files, straggler mode. Answered with [`Joined`].
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Join;

/// A worker's answer to [`Join`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Joined {
    /// Node name.
    pub node: String,
    /// OS process id.
    pub pid: u32,
    /// SHA-256 of the stage files in its disk cache.
    pub cached: Vec<String>,
    /// SHA-256 of the stage file of its live session, if any.
    pub live: Option<String>,
    /// How it is slowed, in words ("none", "cgroup v2 cpu quota 50% of one CPU (...)", "pacing 2.0x (emulation)").
    pub straggler: String,
    /// First telemetry.
    pub telemetry: TelemetrySample,
}

/// Make the stage file available on disk (pull it from `from` by its BLAKE3 unless cached).
/// Answered with [`Fetched`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Fetch {
    /// Stage index (for logs).
    pub stage: u32,
    /// SHA-256 of the file (hex): its name in the disk cache, checked after the pull.
    pub sha256: String,
    /// BLAKE3 of the file: the blob id to pull.
    pub blob: [u8; 32],
    /// File size in bytes.
    pub size: u64,
    /// The node holding the blob (the foreman).
    pub from: String,
}

/// A worker's answer to [`Fetch`].
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fetched {
    /// True when the file was already on disk (nothing pulled).
    pub cached: bool,
    /// Microseconds spent pulling and writing.
    pub micros: u64,
}

/// Create the session of a cached stage file; refused while another session is live. Answered
/// with [`Loaded`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Load {
    /// Stage index.
    pub stage: u32,
    /// SHA-256 of the file.
    pub sha256: String,
}

/// A worker's answer to [`Load`].
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Loaded {
    /// Microseconds to read, verify and create the session.
    pub micros: u64,
    /// Process RSS after the load, bytes.
    pub rss_bytes: u64,
    /// CPU the hash check and the session's creation took on their thread (0 for a simulated
    /// stage): what the load costs in this process, where `micros` counts the waits too.
    pub cpu_micros: u64,
}

/// Drop the live session (answered with `()`).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unload;

/// Run the live session on these inputs. Answered with a [`RunReply`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Run {
    /// Job input index.
    pub input: u32,
    /// Stage index.
    pub stage: u32,
    /// The stage's inputs.
    pub tensors: Vec<WireNamed>,
    /// Node holding any by-reference tensor (the foreman).
    pub from: String,
    /// Send f32 outputs as bf16 (lossy).
    pub lossy_bf16: bool,
    /// Compress f32 outputs (byte planes + zstd); false when the whole crowd shares one host
    /// (`troupe_policy::pipeline::coding`).
    pub compress: bool,
    /// Keep the outputs on the worker's blob shelf and answer with references to them (an
    /// intermediate stage: the next stage's worker pulls them from here).
    pub keep_outputs: bool,
}

/// The outputs of a [`Run`] and what the worker measured of it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Ran {
    /// The stage's outputs.
    pub tensors: Vec<WireNamed>,
    /// Microseconds inside ONNX Runtime.
    pub compute_micros: u64,
    /// Microseconds of pacing added after it (emulated straggler; 0 otherwise).
    pub paced_micros: u64,
    /// Raw f32 bytes of the outputs.
    pub raw_f32_bytes: u64,
    /// Their encoded payload bytes.
    pub wire_f32_bytes: u64,
    /// Largest absolute error the encoding caused (0 when lossless).
    pub max_abs_error: f32,
    /// Where the worker's time outside the compute went, and the bytes it moved.
    pub times: RunTimes,
}

/// Current telemetry (answered with a [`TelemetrySample`]).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetTelemetry;

/// The worker's own counters: residency, loads, peak RSS (answered with [`WorkerStats`]).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetStats;

impl RemoteMessage for Join {
    const NAME: &'static str = "join";
    type Reply = Joined;
}

impl RemoteMessage for Fetch {
    const NAME: &'static str = "fetch";
    type Reply = Fetched;
}

impl RemoteMessage for Load {
    const NAME: &'static str = "load";
    type Reply = Loaded;
}

impl RemoteMessage for Unload {
    const NAME: &'static str = "unload";
    type Reply = ();
}

impl RemoteMessage for Run {
    const NAME: &'static str = "run";
    type Reply = RunReply;
}

impl RemoteMessage for GetTelemetry {
    const NAME: &'static str = "telemetry";
    type Reply = TelemetrySample;
}

impl RemoteMessage for GetStats {
    const NAME: &'static str = "stats";
    type Reply = WorkerStats;
}

/// Holds the enums with fielded variants: the resolvers rkyv derives for them have undocumented
/// fields, and the private module keeps those generated types out of the public API.
mod messages {
    use rkyv::{Archive, Deserialize, Serialize};
    use troupe_transport::codec::WireTensor;

    use super::Ran;

    /// A tensor's payload as it travels.
    #[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
    pub enum TensorBody {
        /// f32 through the transport codec.
        F32(WireTensor),
        /// i64 elements as they are.
        I64 {
            /// Dimensions.
            shape: Vec<u64>,
            /// Elements, row-major.
            data: Vec<i64>,
        },
        /// The serialised [`super::WireNamed`] is on the sender's blob shelf under this BLAKE3
        /// hash.
        ByRef {
            /// BLAKE3 of the serialised tensor.
            blob: [u8; 32],
            /// Its length in bytes.
            len: u64,
        },
        /// The serialised [`super::WireNamed`] is on `node`'s blob shelf (the worker that
        /// produced it): the receiver pulls it from there, so an activation goes from the
        /// producing worker to the consuming one without passing through the foreman.
        At {
            /// The node holding it.
            node: String,
            /// BLAKE3 of the serialised tensor.
            blob: [u8; 32],
            /// Its length in bytes.
            len: u64,
        },
    }

    /// A worker's answer to a [`super::Run`].
    #[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
    pub enum RunReply {
        /// The task ran.
        Ran(Ran),
        /// The worker could not pull an input from the worker `node` that holds it (not
        /// connected to it, say, after one of them was restarted): the foreman may relay it.
        PullFailed {
            /// The node the pull went to.
            node: String,
            /// Why it failed.
            detail: String,
        },
    }
}

/// Why a message or tensor could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// Serialising failed.
    #[error("encoding {what}: {detail}")]
    Encode {
        /// What was encoded.
        what: &'static str,
        /// The error.
        detail: String,
    },
    /// A peer's bytes are over the cap or the budget, or not a valid message.
    #[error("from peer: {0}")]
    Decode(#[from] DecodeError),
    /// Over a size cap.
    #[error("{what} of {got} exceeds the cap of {cap}")]
    TooLarge {
        /// What.
        what: &'static str,
        /// Its size.
        got: usize,
        /// The cap.
        cap: usize,
    },
    /// A tensor could not be encoded or decoded.
    #[error("tensor {name}: {detail}")]
    Tensor {
        /// The tensor.
        name: String,
        /// What went wrong.
        detail: String,
    },
    /// A by-reference tensor could not be pulled.
    #[error("pulling tensor {name} from {from}: {detail}")]
    Pull {
        /// The tensor.
        name: String,
        /// The peer.
        from: String,
        /// What went wrong.
        detail: String,
    },
}

/// Serialises a request or response.
pub fn to_bytes<T>(what: &'static str, value: &T) -> Result<Vec<u8>, WireError>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rancor::Error,
        >,
    >,
{
    let bytes = rkyv::to_bytes::<rancor::Error>(value)
        .map_err(|e| WireError::Encode { what, detail: e.to_string() })?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(WireError::TooLarge { what, got: bytes.len(), cap: MAX_MESSAGE_BYTES });
    }
    Ok(bytes.to_vec())
}

/// Checked decode of a message of `what` from a peer, through the runtime's one decode path
/// (size-capped, charged to a fresh per-message budget, copied aligned first).
pub(crate) fn from_bytes<T>(what: &'static str, bytes: &[u8]) -> Result<T, WireError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rancor::Error>>
        + Deserialize<T, rkyv::api::high::HighDeserializer<rancor::Error>>,
{
    Ok(crate::decode::decode(what, bytes, MAX_MESSAGE_BYTES, &mut crate::decode::plain_budget())?)
}

/// Byte counts of the f32 tensors one side encoded.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EncodeTally {
    /// Raw f32 bytes.
    pub raw: u64,
    /// Encoded payload bytes (by-reference ones counted at their pulled size).
    pub wire: u64,
    /// Largest absolute error caused (bf16 only).
    pub max_abs_error: f32,
    /// Tensors sent by reference.
    pub by_reference: u32,
}

/// Content-addressed bytes this node serves to peers: stage files (pinned) and large tensors
/// (dropped oldest first above [`SHELF_TENSOR_BUDGET`]). Installed with `NodeLink::set_blob_server`.
#[derive(Clone, Default)]
pub struct BlobShelf {
    inner: Arc<Mutex<ShelfInner>>,
}

#[derive(Default)]
struct ShelfInner {
    blobs: HashMap<[u8; 32], Arc<Vec<u8>>>,
    transient: VecDeque<[u8; 32]>,
    transient_bytes: usize,
}

impl BlobShelf {
    /// Keeps `bytes` until the shelf is dropped; returns its BLAKE3.
    pub fn pin(&self, bytes: Arc<Vec<u8>>) -> [u8; 32] {
        let id = *blake3::hash(&bytes).as_bytes();
        if let Ok(mut g) = self.inner.lock() {
            g.blobs.insert(id, bytes);
        }
        id
    }

    /// Stops serving a pinned blob (a finished job's stage file).
    pub fn unpin(&self, id: &[u8; 32]) {
        if let Ok(mut g) = self.inner.lock()
            && !g.transient.contains(id)
        {
            g.blobs.remove(id);
        }
    }

    /// Keeps `bytes` for a while (oldest dropped first over the budget); returns its BLAKE3.
    pub fn put_transient(&self, bytes: Vec<u8>) -> [u8; 32] {
        let id = *blake3::hash(&bytes).as_bytes();
        if let Ok(mut g) = self.inner.lock() {
            g.transient_bytes += bytes.len();
            g.blobs.insert(id, Arc::new(bytes));
            g.transient.push_back(id);
            while g.transient_bytes > SHELF_TENSOR_BUDGET && g.transient.len() > 1 {
                if let Some(old) = g.transient.pop_front()
                    && let Some(b) = g.blobs.remove(&old)
                {
                    g.transient_bytes = g.transient_bytes.saturating_sub(b.len());
                }
            }
        }
        id
    }
}

impl BlobServer for BlobShelf {
    fn blob(&self, id: &[u8; 32]) -> Option<Arc<Vec<u8>>> {
        self.inner.lock().ok().and_then(|g| g.blobs.get(id).cloned())
    }
}

/// How f32 tensors are coded for the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coding {
    /// Truncate to bf16 (lossy).
    pub lossy_bf16: bool,
    /// Compress (byte planes + zstd) where it pays; raw otherwise.
    pub compress: bool,
}

/// Encodes tensors for sending (compressed, bf16 if asked); large ones go on `shelf` by reference.
pub fn encode_tensors(
    tensors: &[NamedTensor],
    lossy_bf16: bool,
    shelf: &BlobShelf,
    tally: &mut EncodeTally,
) -> Result<Vec<WireNamed>, WireError> {
    let coding = Coding { lossy_bf16, compress: true };
    encode_tensors_above(tensors, coding, shelf, tally, BY_REFERENCE_ABOVE)
}

/// Encodes tensors for sending as `coding` says; those whose encoded form is above
/// `by_reference_above` bytes go on `shelf` by reference (`0`: every tensor with a payload does).
pub fn encode_tensors_above(
    tensors: &[NamedTensor],
    coding: Coding,
    shelf: &BlobShelf,
    tally: &mut EncodeTally,
    by_reference_above: usize,
) -> Result<Vec<WireNamed>, WireError> {
    let compress = if coding.compress { Compression::Auto } else { Compression::Never };
    let options = TensorEncodeOptions {
        lossy_bf16: coding.lossy_bf16,
        compress,
        min_compress_bytes: 1024,
        ..TensorEncodeOptions::default()
    };
    let mut encoder = TensorEncoder::new(options);
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let bad = |detail: String| WireError::Tensor { name: t.name.clone(), detail };
        let body = match &t.data {
            TensorData::F32(data) => {
                let (wire, report) = encoder.encode_wire(&t.shape, data).map_err(|e| bad(e.to_string()))?;
                tally.raw += report.raw_bytes as u64;
                tally.wire += wire.payload.len() as u64;
                tally.max_abs_error = tally.max_abs_error.max(report.max_abs_error);
                TensorBody::F32(wire)
            }
            TensorData::I64(data) => {
                TensorBody::I64 { shape: t.shape.iter().map(|&d| d as u64).collect(), data: data.clone() }
            }
        };
        let named = WireNamed { name: t.name.clone(), body };
        let encoded_len = match &named.body {
            TensorBody::F32(w) => w.payload.len(),
            TensorBody::I64 { data, .. } => data.len() * 8,
            TensorBody::ByRef { .. } | TensorBody::At { .. } => 0,
        };
        if encoded_len > by_reference_above {
            let bytes = to_bytes("tensor", &named)?;
            let len = bytes.len() as u64;
            let blob = shelf.put_transient(bytes);
            tally.by_reference += 1;
            out.push(WireNamed { name: t.name.clone(), body: TensorBody::ByRef { blob, len } });
        } else {
            out.push(named);
        }
    }
    Ok(out)
}

/// Longest node name a by-reference tensor may name.
pub const MAX_NODE_NAME: usize = 255;

/// Where the bytes of the tensors one message decoded came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// Pulled from other nodes by reference.
    pub pulled: u64,
    /// Taken by reference from this node's own shelf.
    pub local: u64,
    /// f32 payload bytes carried inline in the message.
    pub inline_f32: u64,
}

/// Decodes received tensors, pulling by-reference ones from `from` over `link`. Everything the
/// message decodes to is charged to `budget` before it is allocated (a compression bomb is
/// refused with an error naming the budget); a pull is capped by what the budget has left.
pub async fn decode_tensors(
    tensors: Vec<WireNamed>,
    link: &NodeLink,
    from: &str,
    budget: &mut DecodeBudget,
) -> Result<Vec<NamedTensor>, WireError> {
    decode_tensors_from(tensors, link, from, None, budget, &mut Moved::default()).await
}

/// [`decode_tensors`], also resolving [`TensorBody::At`] references: pulled from the node they
/// name, or read from `local` (this node's own shelf) when they name this node; what came from
/// where is added to `moved`.
pub async fn decode_tensors_from(
    tensors: Vec<WireNamed>,
    link: &NodeLink,
    from: &str,
    local: Option<&BlobShelf>,
    budget: &mut DecodeBudget,
    moved: &mut Moved,
) -> Result<Vec<NamedTensor>, WireError> {
    if tensors.len() > MAX_TENSORS {
        return Err(WireError::TooLarge { what: "tensor list", got: tensors.len(), cap: MAX_TENSORS });
    }
    let mut decoder = TensorDecoder::new(TensorLimits { max_decoded_bytes: MAX_TENSOR_BYTES });
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let (blob, len, node) = match t.body {
            TensorBody::ByRef { blob, len } => (blob, len, from.to_owned()),
            TensorBody::At { node, blob, len } => {
                if node.len() > MAX_NODE_NAME {
                    return Err(WireError::TooLarge {
                        what: "node name",
                        got: node.len(),
                        cap: MAX_NODE_NAME,
                    });
                }
                (blob, len, node)
            }
            body => {
                if let TensorBody::F32(w) = &body {
                    moved.inline_f32 += w.payload.len() as u64;
                }
                out.push(decode_one(WireNamed { name: t.name, body }, &mut decoder, budget)?);
                continue;
            }
        };
        let pull = |detail: String| WireError::Pull { name: t.name.clone(), from: node.clone(), detail };
        if len > budget.remaining() {
            return Err(WireError::Tensor {
                name: t.name.clone(),
                detail: format!(
                    "a {len}-byte reference passes the message's decoded-bytes budget of {} bytes \
                     ({} already decoded)",
                    budget.cap(),
                    budget.used()
                ),
            });
        }
        let cap = u32::try_from(len.min(MAX_MESSAGE_BYTES as u64 * 16)).unwrap_or(u32::MAX);
        let own = local.filter(|_| node == link.local_id().as_str());
        let bytes: Arc<Vec<u8>> = match own {
            Some(shelf) => {
                let b = shelf.blob(&blob).ok_or_else(|| pull("no longer on this node's shelf".into()))?;
                if b.len() > cap as usize {
                    return Err(pull(format!("{} bytes, more than the {cap} it was announced as", b.len())));
                }
                moved.local += b.len() as u64;
                b
            }
            None => {
                let b =
                    link.fetch_blob(&NodeId::new(&node), blob, cap).await.map_err(|e| pull(e.to_string()))?;
                moved.pulled += b.len() as u64;
                Arc::new(b)
            }
        };
        let nested = || pull("a by-reference tensor points at another reference".into());
        out.push(decode_pulled(&bytes, cap as usize, &mut decoder, budget, nested)?);
    }
    Ok(out)
}

/// The tensor in `bytes` pulled by reference under the pull's own `cap`, decoded straight from
/// its checked archive (no owned copy of the envelope in between). The bytes are already held
/// (the pull was capped by the message's budget), so the envelope's access has a budget of its
/// own, its wire size decoded; the tensor inside is charged to the message's `budget`.
/// An envelope that holds another reference is refused with `nested()`.
fn decode_pulled(
    bytes: &[u8],
    cap: usize,
    decoder: &mut TensorDecoder,
    budget: &mut DecodeBudget,
    nested: impl FnOnce() -> WireError,
) -> Result<NamedTensor, WireError> {
    let mut envelope = DecodeBudget::new(bytes.len() as u64 * crate::decode::DECODED_PER_WIRE_BYTE);
    let decoded =
        crate::decode::access::<WireNamed, _>("tensor by reference", bytes, cap, &mut envelope, |t| {
            Ok(decode_archived(t, decoder, budget))
        })?;
    decoded.unwrap_or_else(|| Err(nested()))
}

/// Decodes one archived tensor of a message, charging it to the message's `budget`; `None` for a
/// reference (which only [`decode_tensors_from`] resolves).
fn decode_archived(
    t: &ArchivedWireNamed,
    decoder: &mut TensorDecoder,
    budget: &mut DecodeBudget,
) -> Option<Result<NamedTensor, WireError>> {
    let name = t.name.as_str();
    let bad = |detail: String| WireError::Tensor { name: name.to_owned(), detail };
    Some(match &t.body {
        ArchivedTensorBody::F32(wire) => decoder
            .decode_archived(wire, budget)
            .map(|d| NamedTensor::f32(name, d.shape, d.data))
            .map_err(|e| bad(e.to_string())),
        ArchivedTensorBody::I64 { shape, data } => {
            // within the message cap already, counted all the same
            budget.charge(data.len() as u128 * 8).map_err(|e| bad(e.to_string())).and_then(|()| {
                let shape =
                    shape.iter().map(|d| usize::try_from(d.to_native()).unwrap_or(usize::MAX)).collect();
                let tensor = NamedTensor::i64(name, shape, data.iter().map(|v| v.to_native()).collect());
                tensor.check_shape().map(|()| tensor).map_err(bad)
            })
        }
        ArchivedTensorBody::ByRef { .. } | ArchivedTensorBody::At { .. } => return None,
    })
}

/// Decodes one tensor carried in a message (owned, as the message decoded), charging it to the
/// message's `budget`: through its archive, by the same path as a pulled one.
fn decode_one(
    t: WireNamed,
    decoder: &mut TensorDecoder,
    budget: &mut DecodeBudget,
) -> Result<NamedTensor, WireError> {
    let bad = |detail: String| WireError::Tensor { name: t.name.clone(), detail };
    let bytes = rkyv::to_bytes::<rancor::Error>(&t).map_err(|e| bad(e.to_string()))?;
    let archived =
        rkyv::access::<ArchivedWireNamed, rancor::Error>(&bytes).map_err(|e| bad(e.to_string()))?;
    decode_archived(archived, decoder, budget).unwrap_or_else(|| Err(bad("unresolved reference".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOSSLESS: Coding = Coding { lossy_bf16: false, compress: true };

    #[test]
    fn requests_round_trip_and_garbage_is_refused() {
        let req = Load { stage: 2, sha256: "ab".repeat(32) };
        let bytes = to_bytes("request", &req).unwrap();
        assert_eq!(from_bytes::<Load>("request", &bytes).unwrap(), req);
        let err = from_bytes::<Load>("request", &[0xff; 7]).unwrap_err();
        assert!(err.to_string().contains("invalid request"), "{err}");
        let mut cut = bytes.clone();
        cut.truncate(bytes.len() / 2);
        assert!(from_bytes::<Load>("request", &cut).is_err());
    }

    #[test]
    fn uncompressed_coding_sends_raw_bytes_that_round_trip() {
        let data: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.01).sin()).collect();
        let t = NamedTensor::f32("hidden", vec![1, 16, 256], data);
        let shelf = BlobShelf::default();
        let (mut packed, mut raw) = (EncodeTally::default(), EncodeTally::default());
        encode_tensors(std::slice::from_ref(&t), false, &shelf, &mut packed).unwrap();
        let coding = Coding { lossy_bf16: false, compress: false };
        let wire =
            encode_tensors_above(std::slice::from_ref(&t), coding, &shelf, &mut raw, usize::MAX).unwrap();
        assert_eq!(raw.wire, 4096 * 4, "raw coding carries every f32 byte");
        assert!(packed.wire < raw.wire, "compressed {} vs raw {}", packed.wire, raw.wire);
        let mut dec = TensorDecoder::default();
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let back = decode_one(wire.into_iter().next().unwrap(), &mut dec, &mut budget).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn f32_lossless_round_trips_and_bf16_reports_its_error() {
        let data: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.01).sin()).collect();
        let t = NamedTensor::f32("hidden", vec![1, 16, 256], data.clone());
        let shelf = BlobShelf::default();
        let mut tally = EncodeTally::default();
        let wire = encode_tensors(std::slice::from_ref(&t), false, &shelf, &mut tally).unwrap();
        assert_eq!(tally.raw, 4096 * 4);
        assert_eq!(tally.max_abs_error, 0.0);
        let mut dec = TensorDecoder::default();
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let back = decode_one(wire.into_iter().next().unwrap(), &mut dec, &mut budget).unwrap();
        assert_eq!(back, t);

        let mut lossy = EncodeTally::default();
        let wire = encode_tensors(std::slice::from_ref(&t), true, &shelf, &mut lossy).unwrap();
        assert!(lossy.wire < tally.wire, "bf16 {} vs f32 {}", lossy.wire, tally.wire);
        let back = decode_one(wire.into_iter().next().unwrap(), &mut dec, &mut budget).unwrap();
        let err = back.as_f32().unwrap().iter().zip(&data).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(err > 0.0 && err <= lossy.max_abs_error, "{err} vs {}", lossy.max_abs_error);
    }

    #[tokio::test]
    async fn a_message_of_compression_bombs_is_refused_by_its_decoded_bytes_budget() {
        use troupe_transport::codec::{Compression, TensorEncodeOptions};
        use troupe_transport::{ClusterCa, QuicConfig};
        // 32 inputs of 4 MiB of zeros each: ~200 bytes apiece on the wire, 128 MiB decoded.
        let opts = TensorEncodeOptions { compress: Compression::Always, ..TensorEncodeOptions::default() };
        let (bomb, _) = TensorEncoder::new(opts).encode_wire(&[1 << 20], &vec![0.0f32; 1 << 20]).unwrap();
        assert!(bomb.payload.len() < 1024);
        let tensors: Vec<WireNamed> = (0..32)
            .map(|i| WireNamed { name: format!("x{i}"), body: TensorBody::F32(bomb.clone()) })
            .collect();
        // the request carrying them is well under the message cap
        let request = Run {
            input: 0,
            stage: 0,
            tensors,
            from: "f".into(),
            lossy_bf16: false,
            compress: true,
            keep_outputs: false,
        };
        let bytes = to_bytes("request", &request).unwrap();
        assert!(bytes.len() < 64 << 10, "{}", bytes.len());
        let Run { tensors, .. } = from_bytes::<Run>("request", &bytes).unwrap();
        let ca = ClusterCa::generate("t").unwrap();
        let link = NodeLink::from(
            troupe_transport::QuicNode::bind(&ca.issue_node("worker").unwrap(), QuicConfig::default())
                .await
                .unwrap(),
        );
        // the path a worker takes for a Run, with a 32 MiB message budget
        let mut budget = DecodeBudget::new(32 << 20);
        let e = decode_tensors(tensors.clone(), &link, "f", &mut budget).await.unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("tensor x8") && text.contains("decoded-bytes budget of 33554432 bytes"),
            "{text}"
        );
        assert_eq!(budget.used(), 32 << 20, "eight tensors decoded, the ninth refused before allocating");
        // with the default budget the same message decodes
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        assert_eq!(decode_tensors(tensors, &link, "f", &mut budget).await.unwrap().len(), 32);
        link.quic().unwrap().shutdown().await;
    }

    /// A kept output goes on the shelf whatever its size; a reference naming this node is read
    /// from the node's own shelf (counted as local, nothing pulled), one naming a node with an
    /// over-long name is refused before any pull.
    #[tokio::test]
    async fn kept_outputs_are_references_read_from_the_own_shelf() {
        use troupe_transport::{ClusterCa, QuicConfig};
        let t = NamedTensor::f32("hidden", vec![1, 4, 8], (0..32).map(|i| i as f32 * 0.5).collect());
        let shelf = BlobShelf::default();
        let mut tally = EncodeTally::default();
        let wire = encode_tensors_above(std::slice::from_ref(&t), LOSSLESS, &shelf, &mut tally, 0).unwrap();
        let TensorBody::ByRef { blob, len } = wire[0].body else { panic!("not by reference") };
        assert_eq!(tally.by_reference, 1);
        let ca = ClusterCa::generate("t").unwrap();
        let link = NodeLink::from(
            troupe_transport::QuicNode::bind(&ca.issue_node("worker").unwrap(), QuicConfig::default())
                .await
                .unwrap(),
        );
        let me = link.local_id().as_str().to_owned();
        let at = vec![WireNamed { name: "hidden".into(), body: TensorBody::At { node: me, blob, len } }];
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let mut moved = Moved::default();
        let back = decode_tensors_from(at, &link, "f", Some(&shelf), &mut budget, &mut moved).await.unwrap();
        assert_eq!(back, vec![t]);
        assert_eq!(moved, Moved { pulled: 0, local: len, inline_f32: 0 });
        let far = vec![WireNamed {
            name: "hidden".into(),
            body: TensorBody::At { node: "n".repeat(MAX_NODE_NAME + 1), blob, len },
        }];
        let e =
            decode_tensors_from(far, &link, "f", Some(&shelf), &mut budget, &mut moved).await.unwrap_err();
        assert!(e.to_string().contains("node name"), "{e}");
        link.quic().unwrap().shutdown().await;
    }

    #[test]
    fn large_tensors_go_by_reference_on_the_shelf() {
        // Noise does not compress: 2 MiB of it stays above the 1 MiB threshold.
        let mut x = 0x9e3779b9u32;
        let data: Vec<f32> = (0..(512 << 10))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                f32::from_bits((x >> 9) | 0x3f80_0000)
            })
            .collect();
        let t = NamedTensor::f32("big", vec![512, 1024], data);
        let shelf = BlobShelf::default();
        let mut tally = EncodeTally::default();
        let wire = encode_tensors(std::slice::from_ref(&t), false, &shelf, &mut tally).unwrap();
        let TensorBody::ByRef { blob, len } = &wire[0].body else { panic!("not by reference") };
        assert_eq!(tally.by_reference, 1);
        let bytes = shelf.blob(blob).unwrap();
        assert_eq!(bytes.len() as u64, *len);
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let nested = || WireError::Tensor { name: "big".into(), detail: "nested".into() };
        let back =
            decode_pulled(&bytes, bytes.len(), &mut TensorDecoder::default(), &mut budget, nested).unwrap();
        assert_eq!(back, t);
        assert_eq!(budget.used(), 512 * 1024 * 4, "the tensor is charged to the message's budget");
        // the same bytes at an unaligned start (an aligned copy is made) decode alike
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let back =
            decode_pulled(&shifted[1..], bytes.len(), &mut TensorDecoder::default(), &mut budget, nested);
        assert_eq!(back.unwrap(), t);
        // an envelope that holds another reference is refused with the caller's error
        let reference = WireNamed { name: "r".into(), body: TensorBody::ByRef { blob: [7; 32], len: 9 } };
        let bytes = to_bytes("tensor", &reference).unwrap();
        let err = decode_pulled(&bytes, bytes.len(), &mut TensorDecoder::default(), &mut budget, nested);
        assert!(err.unwrap_err().to_string().contains("nested"));
    }
}
