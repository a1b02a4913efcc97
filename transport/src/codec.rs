//! Tensor transfer encoding: f32 tensors as rkyv [`WireTensor`] frame bodies, optionally
//! byte-shuffled and zstd-compressed, optionally truncated to bf16 (lossy, only when asked).
//!
//! Compression is chosen per tensor and only kept when it pays: fp32 activations gain little from
//! plain zstd, but splitting the bytes of every element into planes (all low bytes, then all
//! second bytes, ...) groups the slowly varying sign/exponent bytes so zstd finds them. Decoding
//! treats the frame as untrusted: checked rkyv access, the shape must explain `raw_len`, the
//! decoded size is capped before anything is allocated, and decompression is bounded by the
//! declared size, so a zstd bomb is an error rather than an allocation.
//!
//! Caps apply per tensor ([`TensorLimits`]) **and** per message: every decode charges its output
//! to a [`DecodeBudget`] before allocating it, so a message of many tensors that are small on the
//! wire cannot decode past the budget either.

use std::borrow::Cow;

use rkyv::Place;
use rkyv::rancor;
use rkyv::ser::{Allocator, Writer};
use rkyv::util::AlignedVec;
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Deserialize, Serialize};

use crate::frame::{FLAG_BY_REFERENCE, Frame, FrameError, FrameKind, HEADER_LEN};

/// Default smallest tensor (in f32 input bytes) that `Compression::Auto` tries to compress.
pub const DEFAULT_MIN_COMPRESS_BYTES: usize = 64 << 10;
/// Default: keep the compressed form only when it is below this fraction of the uncompressed size.
pub const DEFAULT_KEEP_RATIO: f32 = 0.95;
/// Default cap on a decoded tensor, in f32 output bytes.
pub const DEFAULT_MAX_DECODED_BYTES: usize = 256 << 20;

/// A per-message budget of decoded bytes: every tensor decoded for one message charges its
/// output here before it is allocated, and a decode that would pass the cap is refused with
/// [`CodecError::OverBudget`]. Create one per message (or per batch that is held at once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeBudget {
    cap: u64,
    used: u64,
}

impl DecodeBudget {
    /// A budget of `cap` decoded bytes.
    pub fn new(cap: u64) -> Self {
        Self { cap, used: 0 }
    }

    /// The cap in bytes.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Bytes charged so far.
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Bytes left.
    pub fn remaining(&self) -> u64 {
        self.cap - self.used
    }

    /// Charges `bytes` of decoded output, or refuses (charging nothing) past the cap.
    pub fn charge(&mut self, bytes: u128) -> Result<(), CodecError> {
        let wanted = u128::from(self.used) + bytes;
        if wanted > u128::from(self.cap) {
            return Err(CodecError::OverBudget { bytes, used: self.used, cap: self.cap });
        }
        // below a u64 cap, so it fits
        self.used = wanted as u64;
        Ok(())
    }
}

/// Element type of the payload on the wire (decoding always yields f32).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
#[repr(u8)]
pub enum WireDtype {
    /// IEEE-754 binary32, little-endian: lossless.
    F32,
    /// bfloat16 (the high half of an f32, rounded to nearest even), little-endian: lossy.
    Bf16,
}

impl WireDtype {
    /// Bytes per element on the wire.
    pub const fn size(self) -> usize {
        match self {
            WireDtype::F32 => 4,
            WireDtype::Bf16 => 2,
        }
    }
}

impl ArchivedWireDtype {
    /// The native dtype of an archived one.
    pub fn to_native(&self) -> WireDtype {
        match self {
            ArchivedWireDtype::F32 => WireDtype::F32,
            ArchivedWireDtype::Bf16 => WireDtype::Bf16,
        }
    }
}

pub use encoding::{ArchivedEncoding, Encoding};

/// Holds [`Encoding`]: the resolver rkyv derives for it has undocumented variant fields, and the
/// private module keeps that generated type out of the public API.
mod encoding {
    use rkyv::{Archive, Deserialize, Serialize};

    /// How the payload bytes are laid out.
    #[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
    #[rkyv(derive(Debug))]
    #[repr(u8)]
    pub enum Encoding {
        /// Little-endian elements, one after another.
        Raw,
        /// Byte planes (byte 0 of every element, then byte 1, ...) compressed with zstd.
        ShuffleZstd {
            /// The zstd level used (informational; decoding does not need it).
            level: i32,
        },
    }
}

/// A tensor as it travels: the body of a [`FrameKind::Tensor`] frame.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[rkyv(derive(Debug))]
pub struct WireTensor {
    /// Element type of the payload once decoded.
    pub dtype_on_wire: WireDtype,
    /// Dimensions; the element count is their product (1 for an empty shape).
    pub shape: Vec<u64>,
    /// Bytes of the payload after decoding (element count times the dtype size).
    pub raw_len: u64,
    /// Layout of `payload`.
    pub encoding: Encoding,
    /// The encoded bytes.
    pub payload: Vec<u8>,
}

/// When to compress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Compression {
    /// Compress tensors of at least `min_compress_bytes`; keep the result only if it is below
    /// `keep_ratio` of the uncompressed size.
    #[default]
    Auto,
    /// Never compress.
    Never,
    /// Always compress (even when it does not pay; for tests and measurements).
    Always,
}

/// Options for encoding one tensor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorEncodeOptions {
    /// When to compress.
    pub compress: Compression,
    /// zstd level (1 is fast and gets most of the gain on activations).
    pub level: i32,
    /// Truncate to bf16 (lossy: halves the bytes; the report carries the error it caused).
    pub lossy_bf16: bool,
    /// Smallest tensor, in f32 input bytes, that `Auto` tries to compress.
    pub min_compress_bytes: usize,
    /// `Auto` keeps the compressed payload only when `compressed < keep_ratio * uncompressed`.
    pub keep_ratio: f32,
}

impl Default for TensorEncodeOptions {
    fn default() -> Self {
        Self {
            compress: Compression::Auto,
            level: 1,
            lossy_bf16: false,
            min_compress_bytes: DEFAULT_MIN_COMPRESS_BYTES,
            keep_ratio: DEFAULT_KEEP_RATIO,
        }
    }
}

/// What an encode did, for logs and for the wire/raw ratio benchmarks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EncodeReport {
    /// Bytes of the f32 input.
    pub raw_bytes: usize,
    /// Bytes that go on the wire: frame header plus body.
    pub wire_bytes: usize,
    /// True when values changed (bf16 truncation).
    pub lossy: bool,
    /// Largest absolute error the encoding caused (0 when lossless; infinite when a finite value
    /// overflowed bf16).
    pub max_abs_error: f32,
    /// True when the payload is compressed.
    pub compressed: bool,
    /// Element type on the wire.
    pub dtype_on_wire: WireDtype,
}

impl EncodeReport {
    /// Wire bytes over raw bytes (below 1 means the encoding saved bytes).
    pub fn ratio(&self) -> f64 {
        if self.raw_bytes == 0 {
            return 1.0;
        }
        self.wire_bytes as f64 / self.raw_bytes as f64
    }
}

/// Limits applied when decoding a tensor from a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorLimits {
    /// Largest decoded tensor accepted, in f32 output bytes (checked before any allocation).
    pub max_decoded_bytes: usize,
}

impl Default for TensorLimits {
    fn default() -> Self {
        Self { max_decoded_bytes: DEFAULT_MAX_DECODED_BYTES }
    }
}

/// A decoded tensor: always f32, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedTensor {
    /// Dimensions.
    pub shape: Vec<usize>,
    /// Elements (product of `shape` of them).
    pub data: Vec<f32>,
    /// The element type it travelled as (`Bf16` means the values were rounded by the sender).
    pub dtype_on_wire: WireDtype,
    /// Whether the payload was compressed.
    pub compressed: bool,
}

/// Why a tensor could not be encoded or decoded; each variant names the problem.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    /// The frame itself was refused (wrong kind, invalid rkyv body).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The frame carries a blob reference, not the tensor: resolve it through the blob store.
    #[error("tensor frame is by reference (flags {flags:#06x}): pull the blob first")]
    ByReference {
        /// The frame's flags.
        flags: u16,
    },
    /// The data length does not match the shape given to the encoder.
    #[error("tensor data has {got} elements but shape {shape:?} needs {expected}")]
    DataShapeMismatch {
        /// The shape given.
        shape: Vec<usize>,
        /// Elements the shape needs.
        expected: usize,
        /// Elements supplied.
        got: usize,
    },
    /// The shape's element count overflows.
    #[error("tensor shape {0:?} overflows the element count")]
    ShapeOverflow(Vec<u64>),
    /// The shape, dtype and declared decoded length disagree.
    #[error("tensor shape {shape:?} of {dtype:?} needs {expected} bytes but raw_len says {raw_len}")]
    ShapeMismatch {
        /// Shape on the wire.
        shape: Vec<u64>,
        /// Dtype on the wire.
        dtype: WireDtype,
        /// Bytes the shape needs.
        expected: u128,
        /// Bytes the sender declared.
        raw_len: u64,
    },
    /// The decoded tensor would exceed the configured cap.
    #[error("decoded tensor of {bytes} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// Decoded f32 bytes the tensor would need.
        bytes: u128,
        /// The configured cap.
        max: usize,
    },
    /// Decoding this tensor would take its message past its decoded-bytes budget.
    #[error(
        "decoding {bytes} more bytes would pass the message's decoded-bytes budget of {cap} bytes ({used} already decoded)"
    )]
    OverBudget {
        /// Decoded bytes the refused tensor needs.
        bytes: u128,
        /// Bytes the message had already decoded.
        used: u64,
        /// The message's budget.
        cap: u64,
    },
    /// An uncompressed payload has the wrong length.
    #[error("raw tensor payload has {got} bytes, raw_len says {expected}")]
    PayloadLength {
        /// Declared length.
        expected: u64,
        /// Actual payload length.
        got: usize,
    },
    /// zstd refused the payload (corrupt, or it would decompress past raw_len: a bomb).
    #[error("tensor decompression failed (bounded by raw_len {raw_len}): {detail}")]
    Decompress {
        /// Declared decoded length (the bound).
        raw_len: u64,
        /// zstd's message.
        detail: String,
    },
    /// The payload decompressed to fewer bytes than declared.
    #[error("tensor payload decompressed to {got} bytes, raw_len says {expected}")]
    DecodedSize {
        /// Declared length.
        expected: u64,
        /// Bytes produced.
        got: usize,
    },
    /// zstd failed while compressing.
    #[error("tensor compression failed: {0}")]
    Compress(String),
}

/// Serialises exactly like [`WireTensor`] but borrows the shape and payload, so encoding a frame
/// copies the tensor bytes once (into the frame body) instead of twice.
struct WireTensorRef<'a> {
    dtype_on_wire: WireDtype,
    shape: &'a [u64],
    raw_len: u64,
    encoding: Encoding,
    payload: &'a [u8],
}

/// Where the out-of-line parts of a [`WireTensorRef`] were written.
struct WireTensorRefResolver {
    dtype_on_wire: WireDtypeResolver,
    shape: VecResolver,
    encoding: encoding::EncodingResolver,
    payload: VecResolver,
}

impl Archive for WireTensorRef<'_> {
    type Archived = ArchivedWireTensor;
    type Resolver = WireTensorRefResolver;

    fn resolve(&self, resolver: Self::Resolver, out: Place<Self::Archived>) {
        // An exhaustive pattern: a field added to WireTensor stops this from compiling.
        rkyv::munge::munge!(
            let ArchivedWireTensor { dtype_on_wire, shape, raw_len, encoding, payload } = out
        );
        self.dtype_on_wire.resolve(resolver.dtype_on_wire, dtype_on_wire);
        ArchivedVec::resolve_from_slice(self.shape, resolver.shape, shape);
        self.raw_len.resolve((), raw_len);
        self.encoding.resolve(resolver.encoding, encoding);
        ArchivedVec::resolve_from_slice(self.payload, resolver.payload, payload);
    }
}

impl<S> Serialize<S> for WireTensorRef<'_>
where
    S: rancor::Fallible + Allocator + Writer + ?Sized,
{
    fn serialize(&self, serializer: &mut S) -> Result<Self::Resolver, S::Error> {
        Ok(WireTensorRefResolver {
            dtype_on_wire: self.dtype_on_wire.serialize(serializer)?,
            shape: ArchivedVec::serialize_from_slice(self.shape, serializer)?,
            encoding: self.encoding.serialize(serializer)?,
            payload: ArchivedVec::serialize_from_slice(self.payload, serializer)?,
        })
    }
}

/// Where the payload of a prepared encode lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PayloadSource {
    /// The caller's f32 data, as little-endian bytes.
    Input,
    /// The encoder's `plain` buffer (bf16 elements).
    Plain,
    /// The encoder's `packed` buffer (zstd output).
    Packed,
}

/// Encodes tensors, reusing its zstd context and scratch buffers between calls.
pub struct TensorEncoder {
    options: TensorEncodeOptions,
    compressor: Option<zstd::bulk::Compressor<'static>>,
    /// Element bytes before compression (byte planes when compressing).
    plain: Vec<u8>,
    /// Compressed bytes.
    packed: Vec<u8>,
}

impl TensorEncoder {
    /// An encoder with the given options.
    pub fn new(options: TensorEncodeOptions) -> Self {
        Self { options, compressor: None, plain: Vec::new(), packed: Vec::new() }
    }

    /// The options in use.
    pub fn options(&self) -> &TensorEncodeOptions {
        &self.options
    }

    /// Encodes `data` (row-major, `shape`) into a [`FrameKind::Tensor`] frame.
    pub fn encode_frame(
        &mut self,
        shape: &[usize],
        data: &[f32],
    ) -> Result<(Frame, EncodeReport), CodecError> {
        self.encode_frame_reusing(shape, data, AlignedVec::new())
    }

    /// Like [`Self::encode_frame`], writing into `body` (e.g. the body of a frame already sent)
    /// so a steady stream of tensors does not allocate a fresh body each time.
    pub fn encode_frame_reusing(
        &mut self,
        shape: &[usize],
        data: &[f32],
        mut body: AlignedVec<16>,
    ) -> Result<(Frame, EncodeReport), CodecError> {
        let (prepared, mut report) = self.prepare(shape, data)?;
        let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
        let payload = self.payload(prepared.source, data);
        let wire = WireTensorRef {
            dtype_on_wire: prepared.dtype,
            shape: &dims,
            raw_len: prepared.raw_len as u64,
            encoding: prepared.encoding,
            payload: &payload,
        };
        body.clear();
        body.reserve(wire.payload.len() + 8 * shape.len() + 64);
        let body = rkyv::api::high::to_bytes_in::<_, rancor::Error>(&wire, body)
            .map_err(|e| FrameError::Body { what: "WireTensor", detail: e.to_string() })?;
        report.wire_bytes = HEADER_LEN + body.len();
        Ok((Frame { kind: FrameKind::Tensor, flags: 0, body: body.into() }, report))
    }

    /// Encodes into an owned [`WireTensor`] (to embed in a larger message); `wire_bytes` in the
    /// report counts the payload only.
    pub fn encode_wire(
        &mut self,
        shape: &[usize],
        data: &[f32],
    ) -> Result<(WireTensor, EncodeReport), CodecError> {
        let (prepared, report) = self.prepare(shape, data)?;
        let wire = WireTensor {
            dtype_on_wire: prepared.dtype,
            shape: shape.iter().map(|&d| d as u64).collect(),
            raw_len: prepared.raw_len as u64,
            encoding: prepared.encoding,
            payload: self.payload(prepared.source, data).into_owned(),
        };
        Ok((wire, report))
    }

    /// Chooses dtype and encoding, fills the scratch buffers, and says where the payload is.
    fn prepare(&mut self, shape: &[usize], data: &[f32]) -> Result<(Prepared, EncodeReport), CodecError> {
        let expected = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| CodecError::ShapeOverflow(shape.iter().map(|&d| d as u64).collect()))?;
        if expected != data.len() {
            return Err(CodecError::DataShapeMismatch { shape: shape.to_vec(), expected, got: data.len() });
        }
        let opts = self.options;
        let raw_bytes = data.len() * 4;
        let dtype = if opts.lossy_bf16 { WireDtype::Bf16 } else { WireDtype::F32 };
        let raw_len = data.len() * dtype.size();
        let try_compress = match opts.compress {
            Compression::Never => false,
            Compression::Always => true,
            Compression::Auto => raw_bytes >= opts.min_compress_bytes,
        };

        let mut max_abs_error = 0.0;
        let mut compressed = false;
        if try_compress {
            // Byte planes, then zstd.
            self.plain.clear();
            self.plain.resize(raw_len, 0);
            match dtype {
                WireDtype::F32 => shuffle_f32(data, &mut self.plain),
                WireDtype::Bf16 => max_abs_error = bf16_encode(data, &mut self.plain, true),
            }
            self.compress_plain(opts.level)?;
            compressed = match opts.compress {
                Compression::Always => true,
                _ => (self.packed.len() as f64) < f64::from(opts.keep_ratio) * raw_len as f64,
            };
        }
        let source = if compressed {
            PayloadSource::Packed
        } else {
            match dtype {
                WireDtype::F32 => PayloadSource::Input,
                WireDtype::Bf16 => {
                    // Plain little-endian pairs (recomputed if the planes were not kept).
                    self.plain.clear();
                    self.plain.resize(raw_len, 0);
                    max_abs_error = bf16_encode(data, &mut self.plain, false);
                    PayloadSource::Plain
                }
            }
        };
        let encoding = if compressed { Encoding::ShuffleZstd { level: opts.level } } else { Encoding::Raw };
        let payload_len = match source {
            PayloadSource::Input => raw_bytes,
            PayloadSource::Plain => self.plain.len(),
            PayloadSource::Packed => self.packed.len(),
        };
        let report = EncodeReport {
            raw_bytes,
            wire_bytes: payload_len,
            lossy: dtype == WireDtype::Bf16,
            max_abs_error,
            compressed,
            dtype_on_wire: dtype,
        };
        Ok((Prepared { dtype, raw_len, encoding, source }, report))
    }

    fn payload<'a>(&'a self, source: PayloadSource, data: &'a [f32]) -> Cow<'a, [u8]> {
        match source {
            PayloadSource::Input => f32_le_bytes(data),
            PayloadSource::Plain => Cow::Borrowed(&self.plain),
            PayloadSource::Packed => Cow::Borrowed(&self.packed),
        }
    }

    fn compress_plain(&mut self, level: i32) -> Result<(), CodecError> {
        let compressor = match &mut self.compressor {
            Some(c) => c,
            none => none
                .insert(zstd::bulk::Compressor::new(level).map_err(|e| CodecError::Compress(e.to_string()))?),
        };
        self.packed.clear();
        self.packed.reserve(zstd::zstd_safe::compress_bound(self.plain.len()));
        compressor
            .compress_to_buffer(&self.plain, &mut self.packed)
            .map_err(|e| CodecError::Compress(e.to_string()))?;
        Ok(())
    }
}

/// The choices of one encode.
struct Prepared {
    dtype: WireDtype,
    raw_len: usize,
    encoding: Encoding,
    source: PayloadSource,
}

/// The little-endian bytes of `data`: a view on little-endian targets, a copy elsewhere.
fn f32_le_bytes(data: &[f32]) -> Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f32 has no padding and no invalid bit patterns, u8 has alignment 1, and the
        // slice covers exactly the memory of `data` (size_of_val), borrowed for its lifetime. On
        // a little-endian target these bytes are the wire's little-endian encoding.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data))
        })
    }
    #[cfg(not(target_endian = "little"))]
    {
        Cow::Owned(data.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

impl Default for TensorEncoder {
    fn default() -> Self {
        Self::new(TensorEncodeOptions::default())
    }
}

/// Decodes tensors from untrusted frames, reusing its zstd context and scratch buffer.
pub struct TensorDecoder {
    limits: TensorLimits,
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
    scratch: Vec<u8>,
}

impl TensorDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: TensorLimits) -> Self {
        Self { limits, decompressor: None, scratch: Vec::new() }
    }

    /// Decodes a [`FrameKind::Tensor`] frame (refusing by-reference frames and other kinds),
    /// charging its output to `budget` (the budget of the message it belongs to).
    pub fn decode_frame(
        &mut self,
        frame: &Frame,
        budget: &mut DecodeBudget,
    ) -> Result<DecodedTensor, CodecError> {
        self.decode_frame_into(frame, Vec::new(), budget)
    }

    /// Like [`Self::decode_frame`], writing the elements into `out` (e.g. the `data` of a tensor
    /// decoded earlier) so a steady stream of tensors does not allocate each time.
    pub fn decode_frame_into(
        &mut self,
        frame: &Frame,
        out: Vec<f32>,
        budget: &mut DecodeBudget,
    ) -> Result<DecodedTensor, CodecError> {
        if frame.flags & FLAG_BY_REFERENCE != 0 {
            return Err(CodecError::ByReference { flags: frame.flags });
        }
        let wire = frame.access_as::<WireTensor>(FrameKind::Tensor)?;
        self.decode_archived_into(wire, out, budget)
    }

    /// Decodes an archived tensor that was already accessed with checked rkyv access, charging
    /// its output to `budget`.
    pub fn decode_archived(
        &mut self,
        wire: &ArchivedWireTensor,
        budget: &mut DecodeBudget,
    ) -> Result<DecodedTensor, CodecError> {
        self.decode_archived_into(wire, Vec::new(), budget)
    }

    /// Like [`Self::decode_archived`], writing the elements into `out`. Every check (shape,
    /// per-tensor cap, message budget) runs before anything is allocated.
    pub fn decode_archived_into(
        &mut self,
        wire: &ArchivedWireTensor,
        mut out: Vec<f32>,
        budget: &mut DecodeBudget,
    ) -> Result<DecodedTensor, CodecError> {
        let dtype = wire.dtype_on_wire.to_native();
        let raw_len = wire.raw_len.to_native();
        let shape_u64 = || wire.shape.iter().map(|d| d.to_native()).collect::<Vec<_>>();
        // Every prefix product must fit: a shape like [2^40, 2^40, 0] has no elements but would
        // overflow whoever multiplies its dimensions in order.
        let count = wire
            .shape
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(d.to_native()))
            .ok_or_else(|| CodecError::ShapeOverflow(shape_u64()))?;
        let expected = u128::from(count) * dtype.size() as u128;
        if expected != u128::from(raw_len) {
            return Err(CodecError::ShapeMismatch { shape: shape_u64(), dtype, expected, raw_len });
        }
        let out_bytes = u128::from(count) * 4;
        if out_bytes > self.limits.max_decoded_bytes as u128 {
            return Err(CodecError::TooLarge { bytes: out_bytes, max: self.limits.max_decoded_bytes });
        }
        budget.charge(out_bytes)?;
        // Both fit in usize now: they are below a usize cap.
        let count = count as usize;
        let raw_len_usize = raw_len as usize;
        let mut shape = Vec::with_capacity(wire.shape.len());
        for d in wire.shape.iter() {
            let d = usize::try_from(d.to_native()).map_err(|_| CodecError::ShapeOverflow(shape_u64()))?;
            shape.push(d);
        }

        let payload = wire.payload.as_slice();
        out.clear();
        out.reserve_exact(count);
        let compressed = match wire.encoding {
            ArchivedEncoding::Raw => {
                if payload.len() != raw_len_usize {
                    return Err(CodecError::PayloadLength { expected: raw_len, got: payload.len() });
                }
                match dtype {
                    WireDtype::F32 => le_to_f32(payload, &mut out),
                    WireDtype::Bf16 => bf16_decode(payload, count, false, &mut out),
                }
                false
            }
            ArchivedEncoding::ShuffleZstd { .. } => {
                self.decompress(payload, raw_len)?;
                let planes = &self.scratch[..raw_len_usize];
                match dtype {
                    WireDtype::F32 => unshuffle_f32(planes, count, &mut out),
                    WireDtype::Bf16 => bf16_decode(planes, count, true, &mut out),
                }
                true
            }
        };
        debug_assert_eq!(out.len(), count);
        Ok(DecodedTensor { shape, data: out, dtype_on_wire: dtype, compressed })
    }

    /// Decompresses into `scratch[..raw_len]`, bounded by `raw_len` (already checked against the cap).
    fn decompress(&mut self, payload: &[u8], raw_len: u64) -> Result<(), CodecError> {
        let bound = raw_len as usize;
        let zerr = |detail: String| CodecError::Decompress { raw_len, detail };
        let decompressor = match &mut self.decompressor {
            Some(d) => d,
            none => none.insert(zstd::bulk::Decompressor::new().map_err(|e| zerr(e.to_string()))?),
        };
        // A frame that declares more than `bound` is refused up front; one that declares nothing
        // stops at the end of the bounded slice with "destination buffer is too small".
        if let Ok(Some(declared)) = zstd::zstd_safe::get_frame_content_size(payload)
            && declared > raw_len
        {
            return Err(zerr(format!("zstd frame declares {declared} bytes, more than raw_len")));
        }
        // The scratch buffer keeps its high-water length, so it is zeroed only when it grows.
        if self.scratch.len() < bound {
            self.scratch.resize(bound, 0);
        }
        let got = decompressor
            .decompress_to_buffer(payload, &mut self.scratch[..bound])
            .map_err(|e| zerr(e.to_string()))?;
        if got != bound {
            return Err(CodecError::DecodedSize { expected: raw_len, got });
        }
        Ok(())
    }
}

impl Default for TensorDecoder {
    fn default() -> Self {
        Self::new(TensorLimits::default())
    }
}

/// Encodes one tensor with default limits on a fresh encoder (see [`TensorEncoder`]).
pub fn encode_tensor(
    shape: &[usize],
    data: &[f32],
    options: &TensorEncodeOptions,
) -> Result<(Frame, EncodeReport), CodecError> {
    TensorEncoder::new(*options).encode_frame(shape, data)
}

/// Decodes one tensor frame on a fresh decoder (see [`TensorDecoder`]): a message of one
/// tensor, whose decoded-bytes budget is the per-tensor cap.
pub fn decode_tensor(frame: &Frame, limits: &TensorLimits) -> Result<DecodedTensor, CodecError> {
    let mut budget = DecodeBudget::new(limits.max_decoded_bytes as u64);
    TensorDecoder::new(*limits).decode_frame(frame, &mut budget)
}

/// Rounds an f32 to bf16 bits, nearest even; NaN stays NaN (quieted).
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    let rounded = (bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((bits >> 16) as u16) | 0x0040;
    // Both computed, one selected: keeps the conversion loops branch-free and vectorisable.
    if x.is_nan() { quiet_nan } else { rounded }
}

/// The f32 value of bf16 bits (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// Appends the f32 values of little-endian bytes (`src.len()` a multiple of 4) to `out`.
fn le_to_f32(src: &[u8], out: &mut Vec<f32>) {
    // Grow once, then a plain zip loop: the compiler turns it into a vectorised copy (an
    // `extend` over `chunks_exact` is not `TrustedLen` and would push element by element).
    let start = out.len();
    out.resize(start + src.len() / 4, 0.0);
    for (x, b) in out[start..].iter_mut().zip(src.chunks_exact(4)) {
        *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// Elements per block in the shuffle loops: fixed-size inner loops the compiler can vectorise.
const BLOCK: usize = 64;

/// Splits the bytes of every f32 into four planes: `out[k*n + i]` = byte k of element i.
fn shuffle_f32(src: &[f32], out: &mut [u8]) {
    let n = src.len();
    let (p0, rest) = out.split_at_mut(n);
    let (p1, rest) = rest.split_at_mut(n);
    let (p2, p3) = rest.split_at_mut(n);
    let mut blocks = src.chunks_exact(BLOCK);
    let mut i = 0;
    for block in &mut blocks {
        let (a, b, c, d) =
            (&mut p0[i..i + BLOCK], &mut p1[i..i + BLOCK], &mut p2[i..i + BLOCK], &mut p3[i..i + BLOCK]);
        for j in 0..BLOCK {
            let v = block[j].to_bits();
            a[j] = v as u8;
            b[j] = (v >> 8) as u8;
            c[j] = (v >> 16) as u8;
            d[j] = (v >> 24) as u8;
        }
        i += BLOCK;
    }
    for (j, x) in blocks.remainder().iter().enumerate() {
        let v = x.to_bits();
        p0[i + j] = v as u8;
        p1[i + j] = (v >> 8) as u8;
        p2[i + j] = (v >> 16) as u8;
        p3[i + j] = (v >> 24) as u8;
    }
}

/// Inverse of [`shuffle_f32`]: appends the `n` elements stored as four byte planes to `out`.
fn unshuffle_f32(src: &[u8], n: usize, out: &mut Vec<f32>) {
    let (p0, rest) = src.split_at(n);
    let (p1, rest) = rest.split_at(n);
    let (p2, p3) = rest.split_at(n);
    let start = out.len();
    out.resize(start + n, 0.0);
    let mut blocks = out[start..].chunks_exact_mut(BLOCK);
    let mut i = 0;
    for block in &mut blocks {
        let (a, b, c, d) = (&p0[i..i + BLOCK], &p1[i..i + BLOCK], &p2[i..i + BLOCK], &p3[i..i + BLOCK]);
        for j in 0..BLOCK {
            block[j] = f32::from_bits(u32::from_le_bytes([a[j], b[j], c[j], d[j]]));
        }
        i += BLOCK;
    }
    for (j, x) in blocks.into_remainder().iter_mut().enumerate() {
        *x = f32::from_bits(u32::from_le_bytes([p0[i + j], p1[i + j], p2[i + j], p3[i + j]]));
    }
}

/// Rounds to bf16 into `out` (two planes when `shuffled`, else little-endian pairs) and returns
/// the largest absolute error caused.
fn bf16_encode(src: &[f32], out: &mut [u8], shuffled: bool) -> f32 {
    // The error of one element as the bits of a non-negative float, which order like the floats;
    // a NaN input (NaN error) counts as 0, a finite value rounded to infinity as infinity.
    fn err_bits(x: f32, b: u16) -> u32 {
        let err = (x - bf16_to_f32(b)).abs();
        if err.is_nan() { 0 } else { err.to_bits() }
    }
    let n = src.len();
    let mut max_bits = 0u32;
    if shuffled {
        let (lo, hi) = out.split_at_mut(n);
        for ((x, l), h) in src.iter().zip(lo).zip(hi) {
            let b = f32_to_bf16(*x);
            *l = b as u8;
            *h = (b >> 8) as u8;
            max_bits = max_bits.max(err_bits(*x, b));
        }
    } else {
        for (x, dst) in src.iter().zip(out.chunks_exact_mut(2)) {
            let b = f32_to_bf16(*x);
            dst.copy_from_slice(&b.to_le_bytes());
            max_bits = max_bits.max(err_bits(*x, b));
        }
    }
    f32::from_bits(max_bits)
}

/// Appends the `n` f32 values of bf16 bytes (two planes when `shuffled`, else little-endian
/// pairs) to `out`.
fn bf16_decode(src: &[u8], n: usize, shuffled: bool, out: &mut Vec<f32>) {
    let start = out.len();
    out.resize(start + n, 0.0);
    let dst = &mut out[start..];
    if shuffled {
        let (lo, hi) = src.split_at(n);
        for ((x, l), h) in dst.iter_mut().zip(lo).zip(hi) {
            *x = bf16_to_f32(u16::from_le_bytes([*l, *h]));
        }
    } else {
        for (x, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *x = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
        }
    }
}

/// A smooth, activation-like test signal (deterministic): sums of sines with a slow envelope,
/// roughly what a hidden state of a small transformer looks like in magnitude and texture.
pub fn smooth_activation(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let t = i as f32;
            0.8 * (t * 0.013).sin() + 0.3 * (t * 0.17).cos() + 0.05 * (t * 1.3).sin()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(compress: Compression, lossy_bf16: bool) -> TensorEncodeOptions {
        TensorEncodeOptions { compress, lossy_bf16, ..Default::default() }
    }

    #[test]
    fn f32_round_trip_is_exact_raw_and_compressed() {
        let data = smooth_activation(3 * 40_007);
        let shape = [3, 40_007];
        for c in [Compression::Never, Compression::Always, Compression::Auto] {
            let (frame, report) = encode_tensor(&shape, &data, &opts(c, false)).unwrap();
            assert_eq!(report.raw_bytes, data.len() * 4);
            assert!(!report.lossy);
            assert_eq!(report.max_abs_error, 0.0);
            assert_eq!(report.wire_bytes, frame.to_wire().unwrap().len());
            let back = decode_tensor(&frame, &TensorLimits::default()).unwrap();
            assert_eq!(back.shape, vec![3, 40_007]);
            assert_eq!(back.compressed, report.compressed);
            assert_eq!(
                back.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{c:?}"
            );
        }
    }

    #[test]
    fn special_values_survive_f32_and_bf16() {
        let data = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::MIN_POSITIVE, 1.0];
        let (frame, _) = encode_tensor(&[6], &data, &opts(Compression::Always, false)).unwrap();
        let back = decode_tensor(&frame, &TensorLimits::default()).unwrap();
        assert_eq!(back.data, data.to_vec());
        let (frame, report) = encode_tensor(&[6], &data, &opts(Compression::Never, true)).unwrap();
        let back = decode_tensor(&frame, &TensorLimits::default()).unwrap();
        assert_eq!(back.data, data.to_vec(), "all exactly representable in bf16");
        assert!(report.lossy);
        assert_eq!(report.max_abs_error, 0.0);
        let nan = encode_tensor(&[1], &[f32::NAN], &opts(Compression::Never, true)).unwrap();
        assert!(decode_tensor(&nan.0, &TensorLimits::default()).unwrap().data[0].is_nan());
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1.0 + 2^-8 is exactly halfway between bf16 1.0 and 1.0 + 2^-7: ties go to even (1.0).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        // 1.0 + 3 * 2^-8 is halfway between 1+2^-7 (odd mantissa) and 1+2^-6: goes to 1+2^-6.
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)), 1.0 + 1.0 / 64.0);
        // Just above the halfway point rounds up.
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0)), 1.0 + 1.0 / 128.0);
        // The largest finite f32 overflows bf16 to infinity.
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
    }

    #[test]
    fn bf16_error_is_bounded_and_reported() {
        let data = smooth_activation(100_000);
        let (frame, report) = encode_tensor(&[100_000], &data, &opts(Compression::Auto, true)).unwrap();
        assert!(report.lossy);
        assert_eq!(report.dtype_on_wire, WireDtype::Bf16);
        let back = decode_tensor(&frame, &TensorLimits::default()).unwrap();
        let actual = data.iter().zip(&back.data).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert_eq!(report.max_abs_error, actual, "the report is the real error");
        assert!(actual > 0.0);
        // |x| < 1.2 here, and bf16 keeps 8 significant bits: half an ulp at [1, 2) is 2^-8.
        assert!(actual <= 1.0 / 256.0, "{actual}");
        for (a, b) in data.iter().zip(&back.data) {
            assert!((a - b).abs() <= a.abs() / 256.0 + f32::MIN_POSITIVE, "{a} {b}");
        }
        assert!(report.ratio() < 0.55, "bf16 at least halves: {}", report.ratio());
    }

    #[test]
    fn auto_skips_small_and_incompressible_tensors() {
        // Small: below the threshold, never compressed even though it would compress.
        let small = vec![0.0f32; 1000];
        let (_, r) = encode_tensor(&[1000], &small, &opts(Compression::Auto, false)).unwrap();
        assert!(!r.compressed);
        let (_, r) = encode_tensor(&[1000], &small, &opts(Compression::Always, false)).unwrap();
        assert!(r.compressed && r.wire_bytes < 200, "{r:?}");
        // Incompressible: big, but pseudo-random bits gain nothing, so the raw form is kept.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<f32> = (0..100_000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                f32::from_bits((state >> 32) as u32)
            })
            .collect();
        let (frame, r) = encode_tensor(&[100_000], &noise, &opts(Compression::Auto, false)).unwrap();
        assert!(!r.compressed, "{r:?}");
        let back = decode_tensor(&frame, &TensorLimits::default()).unwrap();
        assert_eq!(
            back.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            noise.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // Compressible and big: compressed, and smaller than the keep ratio.
        let zeros = vec![0.0f32; 100_000];
        let (_, r) = encode_tensor(&[100_000], &zeros, &opts(Compression::Auto, false)).unwrap();
        assert!(r.compressed && r.ratio() < 0.01, "{r:?}");
    }

    fn frame_of(wire: &WireTensor) -> Frame {
        Frame::encode(FrameKind::Tensor, wire).unwrap()
    }

    #[test]
    fn zstd_bomb_is_an_error() {
        // 16 MiB of zeros compresses to a few hundred bytes; declare only 4 KiB.
        let bomb = zstd::bulk::compress(&vec![0u8; 16 << 20], 3).unwrap();
        let wire = WireTensor {
            dtype_on_wire: WireDtype::F32,
            shape: vec![1024],
            raw_len: 4096,
            encoding: Encoding::ShuffleZstd { level: 3 },
            payload: bomb,
        };
        let e = decode_tensor(&frame_of(&wire), &TensorLimits::default()).unwrap_err();
        assert!(matches!(e, CodecError::Decompress { raw_len: 4096, .. }), "{e}");
        assert!(e.to_string().contains("decompression failed"), "{e}");

        // A stream that does not declare its size must also stop at raw_len.
        let mut enc = zstd::stream::Encoder::new(Vec::new(), 3).unwrap();
        enc.include_contentsize(false).unwrap();
        std::io::Write::write_all(&mut enc, &vec![0u8; 1 << 20]).unwrap();
        let undeclared = enc.finish().unwrap();
        let wire = WireTensor { payload: undeclared, ..wire };
        let e = decode_tensor(&frame_of(&wire), &TensorLimits::default()).unwrap_err();
        assert!(matches!(e, CodecError::Decompress { .. }), "{e}");

        // Too short is an error too.
        let short = zstd::bulk::compress(&[0u8; 100], 3).unwrap();
        let wire = WireTensor { payload: short, ..wire };
        let e = decode_tensor(&frame_of(&wire), &TensorLimits::default()).unwrap_err();
        assert!(matches!(e, CodecError::DecodedSize { expected: 4096, got: 100 }), "{e}");
    }

    #[test]
    fn a_message_of_many_small_bombs_is_refused_by_its_budget_before_allocating() {
        // Each tensor: 1 MiB of zeros decoded, ~60 bytes on the wire, under the per-tensor cap.
        let mut enc = TensorEncoder::new(opts(Compression::Always, false));
        let zeros = vec![0.0f32; 1 << 18];
        let (bomb, report) = enc.encode_frame(&[1 << 18], &zeros).unwrap();
        assert!(report.wire_bytes < 200, "{report:?}");
        let mut dec = TensorDecoder::new(TensorLimits { max_decoded_bytes: 1 << 20 });
        // a message budget of 8 MiB: eight tensors decode, the ninth is refused
        let mut budget = DecodeBudget::new(8 << 20);
        let mut kept = Vec::new();
        for _ in 0..8 {
            kept.push(dec.decode_frame(&bomb, &mut budget).unwrap());
        }
        assert_eq!(budget.used(), 8 << 20);
        let e = dec.decode_frame(&bomb, &mut budget).unwrap_err();
        assert!(
            matches!(e, CodecError::OverBudget { bytes: 1_048_576, used: 8_388_608, cap: 8_388_608 }),
            "{e}"
        );
        assert!(e.to_string().contains("decoded-bytes budget of 8388608 bytes"), "{e}");
        // a single tensor that alone exceeds the message budget is refused on its declared size
        let wire = WireTensor {
            dtype_on_wire: WireDtype::F32,
            shape: vec![1 << 30],
            raw_len: 4 << 30,
            encoding: Encoding::ShuffleZstd { level: 1 },
            payload: vec![0x28, 0xb5, 0x2f, 0xfd],
        };
        let mut dec = TensorDecoder::new(TensorLimits { max_decoded_bytes: usize::MAX });
        let e = dec.decode_frame(&frame_of(&wire), &mut DecodeBudget::new(64 << 20)).unwrap_err();
        assert!(matches!(e, CodecError::OverBudget { bytes, used: 0, .. } if bytes == 4 << 30), "{e}");
        assert_eq!(kept.len(), 8);
    }

    #[test]
    fn raw_len_over_the_cap_is_refused_before_allocation() {
        // Claims a 1 TiB tensor with a tiny payload: must fail on the size check alone.
        let wire = WireTensor {
            dtype_on_wire: WireDtype::F32,
            shape: vec![1 << 18, 1 << 20],
            raw_len: 1 << 40,
            encoding: Encoding::ShuffleZstd { level: 1 },
            payload: vec![1, 2, 3],
        };
        let limits = TensorLimits { max_decoded_bytes: 1 << 20 };
        let e = decode_tensor(&frame_of(&wire), &limits).unwrap_err();
        assert!(
            matches!(e, CodecError::TooLarge { bytes, max } if bytes == 1 << 40 && max == 1 << 20),
            "{e}"
        );
        // bf16 on the wire decodes to twice its raw_len: the cap counts the f32 output.
        let wire = WireTensor {
            dtype_on_wire: WireDtype::Bf16,
            shape: vec![300_000],
            raw_len: 600_000,
            encoding: Encoding::Raw,
            payload: vec![0; 600_000],
        };
        let e = decode_tensor(&frame_of(&wire), &limits).unwrap_err();
        assert!(matches!(e, CodecError::TooLarge { bytes: 1_200_000, .. }), "{e}");
    }

    #[test]
    fn inconsistent_headers_are_refused() {
        let base = WireTensor {
            dtype_on_wire: WireDtype::F32,
            shape: vec![2, 3],
            raw_len: 24,
            encoding: Encoding::Raw,
            payload: vec![0; 24],
        };
        let limits = TensorLimits::default();
        let wrong_len = WireTensor { raw_len: 20, ..base.clone() };
        let e = decode_tensor(&frame_of(&wrong_len), &limits).unwrap_err();
        assert!(e.to_string().contains("needs 24 bytes but raw_len says 20"), "{e}");
        let overflow = WireTensor { shape: vec![u64::MAX, u64::MAX, 4], ..base.clone() };
        let e = decode_tensor(&frame_of(&overflow), &limits).unwrap_err();
        assert!(matches!(e, CodecError::ShapeOverflow(_)), "{e}");
        // The element count fits u128 but the byte count does not (found by frame_fuzz).
        let overflow = WireTensor { shape: vec![u64::MAX, u64::MAX], ..base.clone() };
        let e = decode_tensor(&frame_of(&overflow), &limits).unwrap_err();
        assert!(matches!(e, CodecError::ShapeOverflow(_)), "{e}");
        let short = WireTensor { payload: vec![0; 23], ..base.clone() };
        let e = decode_tensor(&frame_of(&short), &limits).unwrap_err();
        assert!(matches!(e, CodecError::PayloadLength { expected: 24, got: 23 }), "{e}");
        let mut by_ref = frame_of(&base);
        by_ref.flags = FLAG_BY_REFERENCE;
        assert!(matches!(decode_tensor(&by_ref, &limits), Err(CodecError::ByReference { .. })));
        let mut other = frame_of(&base);
        other.kind = FrameKind::Message;
        assert!(matches!(
            decode_tensor(&other, &limits),
            Err(CodecError::Frame(FrameError::UnexpectedKind { .. }))
        ));
        assert!(decode_tensor(&frame_of(&base), &limits).is_ok());
        let e = encode_tensor(&[2, 2], &[1.0; 3], &TensorEncodeOptions::default()).unwrap_err();
        assert!(matches!(e, CodecError::DataShapeMismatch { expected: 4, got: 3, .. }), "{e}");
    }

    #[test]
    fn scalar_and_empty_tensors() {
        let (f, _) = encode_tensor(&[], &[2.5], &TensorEncodeOptions::default()).unwrap();
        let back = decode_tensor(&f, &TensorLimits::default()).unwrap();
        assert_eq!((back.shape, back.data), (vec![], vec![2.5]));
        let (f, _) = encode_tensor(&[0, 5], &[], &opts(Compression::Always, false)).unwrap();
        let back = decode_tensor(&f, &TensorLimits::default()).unwrap();
        assert_eq!((back.shape, back.data), (vec![0, 5], vec![]));
    }

    /// Measurement, not a check: wire/raw ratios and encode+decode time over memcpy of the same
    /// bytes. Run with
    /// `cargo test --release -p troupe-transport codec_throughput -- --ignored --nocapture`.
    #[test]
    #[ignore = "measurement; run in release"]
    fn codec_throughput() {
        use std::time::Instant;
        use troupe_policy::stats::median_of as median;

        // Activation-like: the smooth signal plus deterministic noise of ~5% of its range.
        fn noisy(n: usize) -> Vec<f32> {
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            smooth_activation(n)
                .into_iter()
                .map(|x| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    x + ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                })
                .collect()
        }
        let modes = [
            ("raw f32", opts(Compression::Never, false)),
            ("shuffle+zstd1 f32", opts(Compression::Always, false)),
            ("auto f32", opts(Compression::Auto, false)),
            ("bf16 raw", opts(Compression::Never, true)),
            ("bf16 shuffle+zstd1", opts(Compression::Always, true)),
        ];
        for (signal, make) in
            [("smooth", smooth_activation as fn(usize) -> Vec<f32>), ("smooth+noise", noisy)]
        {
            for mib in [1usize, 64] {
                let n = (mib << 20) / 4;
                let data = make(n);
                let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
                let reps = if mib == 1 { 41 } else { 5 };
                let mut dst = vec![0u8; bytes.len()];
                let warm: Vec<f64> = (0..reps)
                    .map(|_| {
                        let t = Instant::now();
                        dst.copy_from_slice(std::hint::black_box(&bytes));
                        std::hint::black_box(&dst);
                        t.elapsed().as_secs_f64()
                    })
                    .collect();
                let memcpy = median(warm);
                let cold = median(
                    (0..reps)
                        .map(|_| {
                            let t = Instant::now();
                            let v = std::hint::black_box(&bytes).to_vec();
                            std::hint::black_box(&v);
                            t.elapsed().as_secs_f64()
                        })
                        .collect(),
                );
                println!(
                    "{signal} {mib} MiB: memcpy warm {:.0} MB/s, into fresh Vec {:.0} MB/s",
                    bytes.len() as f64 / memcpy / 1e6,
                    bytes.len() as f64 / cold / 1e6
                );
                for (name, o) in modes {
                    let mut enc = TensorEncoder::new(o);
                    let mut dec = TensorDecoder::default();
                    let mut report = None;
                    let (mut te, mut td, mut tr) = (Vec::new(), Vec::new(), Vec::new());
                    let (mut body, mut out) = (AlignedVec::new(), Vec::new());
                    for _ in 0..reps {
                        // Fresh buffers each time (a new frame body and a new output tensor).
                        let t = Instant::now();
                        let (f, r) = enc.encode_frame(&[n], &data).unwrap();
                        te.push(t.elapsed().as_secs_f64());
                        let t = Instant::now();
                        let back = dec.decode_frame(&f, &mut DecodeBudget::new(u64::MAX)).unwrap();
                        td.push(t.elapsed().as_secs_f64());
                        std::hint::black_box(&back);
                        report = Some(r);
                        // Steady state: the previous body and output reused.
                        let t = Instant::now();
                        let (f, _) = enc.encode_frame_reusing(&[n], &data, body).unwrap();
                        let back = dec.decode_frame_into(&f, out, &mut DecodeBudget::new(u64::MAX)).unwrap();
                        tr.push(t.elapsed().as_secs_f64());
                        (body, out) = (f.body.into_aligned(), back.data);
                    }
                    let r = report.unwrap();
                    let (e, d, reuse) = (median(te), median(td), median(tr));
                    let mbs = |t: f64| bytes.len() as f64 / t / 1e6;
                    println!(
                        "  {name:<19} wire/raw {:.4} (compressed {}, lossy {}, max err {:.2e}) \
                         enc {:.0} MB/s, dec {:.0} MB/s, enc+dec {:.1}x memcpy; \
                         reusing buffers enc+dec {:.0} MB/s = {:.1}x memcpy",
                        r.ratio(),
                        r.compressed,
                        r.lossy,
                        r.max_abs_error,
                        mbs(e),
                        mbs(d),
                        (e + d) / memcpy,
                        mbs(reuse),
                        reuse / memcpy
                    );
                }
            }
        }
    }

    #[test]
    fn borrowed_serialisation_matches_the_owned_type_byte_for_byte() {
        for (c, bf16) in [
            (Compression::Never, false),
            (Compression::Always, false),
            (Compression::Never, true),
            (Compression::Always, true),
        ] {
            let data = smooth_activation(5000);
            let mut enc = TensorEncoder::new(opts(c, bf16));
            let (frame, report) = enc.encode_frame(&[50, 100], &data).unwrap();
            let (wire, wire_report) = enc.encode_wire(&[50, 100], &data).unwrap();
            assert_eq!(wire.payload.len(), wire_report.wire_bytes);
            assert_eq!(report.compressed, wire_report.compressed);
            let owned = Frame::encode(FrameKind::Tensor, &wire).unwrap();
            assert_eq!(frame.body.as_slice(), owned.body.as_slice(), "{c:?} bf16 {bf16}");
        }
    }

    #[test]
    fn encoder_and_decoder_reuse_buffers_across_calls() {
        let mut enc = TensorEncoder::new(opts(Compression::Auto, false));
        let mut dec = TensorDecoder::default();
        for n in [100_000usize, 20, 70_000, 100_000] {
            let data = smooth_activation(n);
            let (f, r) = enc.encode_frame(&[n], &data).unwrap();
            assert_eq!(r.compressed, n * 4 >= DEFAULT_MIN_COMPRESS_BYTES && r.ratio() < 0.95);
            assert_eq!(dec.decode_frame(&f, &mut DecodeBudget::new(1 << 20)).unwrap().data, data);
        }
    }
}
