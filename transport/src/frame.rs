//! Frames: a fixed 12-byte header `{magic, version, kind, flags, length}` followed by an rkyv body.
//!
//! The length is checked against [`FrameLimits`] before anything is allocated, and the body buffer
//! grows only as bytes actually arrive, so a peer that announces a huge frame and sends nothing
//! costs nothing; [`read_frame_budgeted`] also charges every growth of that buffer to the
//! connection's [`ConnBudget`] before it is allocated. Bodies land in a 16-byte aligned buffer and are only ever read through checked
//! rkyv access ([`Frame::access`]). A delivered frame's [`Body`] is that buffer, or, for a body
//! that came through the same-host path, a read-only mapping of the sender's segment.

use rkyv::api::high::{HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Portable, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::budget::{BudgetExceeded, ConnBudget, FrameCharge, Held};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"TRPE";
/// Wire protocol version carried in every frame header.
pub const PROTOCOL_VERSION: u8 = 1;
/// Size of the fixed header in bytes.
pub const HEADER_LEN: usize = 12;
/// Default cap on a frame body (configurable per endpoint).
pub const DEFAULT_MAX_BODY: u32 = 128 << 20;
/// The body buffer starts at most this large; after that it grows with the bytes received.
const READ_CHUNK: usize = 1 << 20;

/// What a frame carries; unknown kinds are rejected before the body is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Application hello: node name and protocol version, sent first on a new connection.
    Hello = 1,
    /// Answer to a hello: accepted or refused with a reason.
    HelloAck = 2,
    /// An application message (an rkyv body the receiver's handler understands).
    Message = 3,
    /// An encoded tensor (see `codec`).
    Tensor = 4,
    /// A request for a blob by content hash.
    BlobRequest = 5,
    /// The bytes of a blob, answering a request.
    BlobData = 6,
    /// A liveness heartbeat.
    Heartbeat = 7,
    /// The sender reports an error and closes the stream.
    Error = 8,
    /// A service call or its response (see `service`): role-checked workload RPC.
    Service = 9,
}

impl FrameKind {
    /// Parses the kind byte of a header.
    pub fn from_u8(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Message,
            4 => Self::Tensor,
            5 => Self::BlobRequest,
            6 => Self::BlobData,
            7 => Self::Heartbeat,
            8 => Self::Error,
            9 => Self::Service,
            _ => return None,
        })
    }
}

/// Flag bits defined by this protocol version; any other bit set is an error.
pub const KNOWN_FLAGS: u16 = FLAG_BY_REFERENCE | FLAG_SHM;
/// Flag: the body is a tensor whose payload is stored by reference (a content hash).
pub const FLAG_BY_REFERENCE: u16 = 0x0001;
/// Flag: the body names a same-host shared-memory segment holding the real body (see `shm`).
pub const FLAG_SHM: u16 = 0x0002;

/// Limits applied to every frame read from a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest body accepted, in bytes.
    pub max_body: u32,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self { max_body: DEFAULT_MAX_BODY }
    }
}

/// Why a frame was refused; every variant names the problem for the log.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream failed underneath.
    #[error("i/o error reading frame: {0}")]
    Io(#[from] std::io::Error),
    /// The first four bytes are not [`MAGIC`].
    #[error("bad magic {0:02x?}: not a troupe frame")]
    BadMagic([u8; 4]),
    /// The peer speaks another protocol version.
    #[error("unsupported protocol version {got} (this node speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion {
        /// Version in the header.
        got: u8,
    },
    /// The kind byte is not a known [`FrameKind`].
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Flag bits outside [`KNOWN_FLAGS`] are set.
    #[error("unknown flag bits {0:#06x}")]
    UnknownFlags(u16),
    /// The announced body length exceeds the cap.
    #[error("frame body of {len} bytes exceeds the cap of {max} bytes")]
    TooLong {
        /// Announced length.
        len: u64,
        /// Configured cap.
        max: u32,
    },
    /// The stream ended inside a frame.
    #[error("truncated frame: expected {expected} bytes, stream ended after {got}")]
    Truncated {
        /// Bytes the frame needed.
        expected: usize,
        /// Bytes that arrived.
        got: usize,
    },
    /// The body failed checked rkyv access or serialisation.
    #[error("invalid frame body for {what}: {detail}")]
    Body {
        /// The type the body was read as.
        what: &'static str,
        /// The validator's message.
        detail: String,
    },
    /// Growing the body buffer would take the connection past its memory budget.
    #[error(transparent)]
    OverBudget(#[from] BudgetExceeded),
    /// The frame has a different kind than the reader expected.
    #[error("expected a {expected:?} frame, got {got:?}")]
    UnexpectedKind {
        /// What the protocol step needs.
        expected: FrameKind,
        /// What arrived.
        got: FrameKind,
    },
}

/// Header fields after validation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the body is.
    pub kind: FrameKind,
    /// Flag bits (a subset of [`KNOWN_FLAGS`]).
    pub flags: u16,
    /// Body length in bytes (at most the cap).
    pub len: u32,
}

impl FrameHeader {
    /// Validates a raw header against the limits; nothing is allocated.
    pub fn parse(raw: &[u8; HEADER_LEN], limits: &FrameLimits) -> Result<Self, FrameError> {
        let magic = [raw[0], raw[1], raw[2], raw[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if raw[4] != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion { got: raw[4] });
        }
        let kind = FrameKind::from_u8(raw[5]).ok_or(FrameError::UnknownKind(raw[5]))?;
        let flags = u16::from_le_bytes([raw[6], raw[7]]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnknownFlags(flags));
        }
        let len = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
        if len > limits.max_body {
            return Err(FrameError::TooLong { len: u64::from(len), max: limits.max_body });
        }
        Ok(Self { kind, flags, len })
    }

    /// The 12 header bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4] = PROTOCOL_VERSION;
        h[5] = self.kind as u8;
        h[6..8].copy_from_slice(&self.flags.to_le_bytes());
        h[8..].copy_from_slice(&self.len.to_le_bytes());
        h
    }
}

/// A frame body: 16-byte aligned bytes (so rkyv can access them in place), either owned on the
/// heap or, for a body that arrived through the same-host path, a read-only mapping of the
/// sender's shared-memory segment (no copy on receive; see [`crate::shm`]). It derefs to `[u8]`.
///
/// A mapped body keeps its segment (and the bytes charged against its connection's memory
/// budget) for as long as it or any clone of it lives: hold it only as long as the bytes are
/// needed, or copy them out ([`Body::to_vec`], [`Body::into_aligned`]). Clones of a heap body
/// copy it; clones of a mapped body share the mapping.
#[derive(Clone)]
pub struct Body(Repr);

enum Repr {
    Heap(AlignedVec<16>),
    /// A received body whose buffer goes back to the receive pool when dropped (see
    /// [`recv_pool`]).
    Pooled(AlignedVec<16>),
    Mapped(std::sync::Arc<crate::shm::MappedBody>),
}

impl Clone for Repr {
    fn clone(&self) -> Self {
        match self {
            // a clone is a plain heap copy: only the original goes back to the pool
            Self::Heap(v) | Self::Pooled(v) => Self::Heap(v.clone()),
            Self::Mapped(m) => Self::Mapped(m.clone()),
        }
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        if let Repr::Pooled(v) = &mut self.0 {
            recv_pool::give(std::mem::replace(v, AlignedVec::new()));
        }
    }
}

impl Body {
    /// An empty heap body.
    pub fn new() -> Self {
        Self(Repr::Heap(AlignedVec::new()))
    }

    /// A heap body holding a copy of `bytes`.
    pub fn copy_from_slice(bytes: &[u8]) -> Self {
        let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        Self(Repr::Heap(aligned))
    }

    pub(crate) fn mapped(body: crate::shm::MappedBody) -> Self {
        Self(Repr::Mapped(std::sync::Arc::new(body)))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            Repr::Heap(v) | Repr::Pooled(v) => v.as_slice(),
            Repr::Mapped(m) => m.bytes(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether the body holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes allocated for a heap body (its length for a mapped one).
    pub fn capacity(&self) -> usize {
        match &self.0 {
            Repr::Heap(v) | Repr::Pooled(v) => v.capacity(),
            Repr::Mapped(m) => m.bytes().len(),
        }
    }

    /// Whether the body is a mapping of a same-host segment rather than heap bytes.
    pub fn is_mapped(&self) -> bool {
        matches!(self.0, Repr::Mapped(_))
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.as_slice().to_vec()
    }

    /// The body as an owned aligned buffer: a heap body as it is, a mapped one copied (which
    /// releases the mapping once no clone holds it).
    pub fn into_aligned(mut self) -> AlignedVec<16> {
        match &mut self.0 {
            // taken out of the pool's reach: the caller owns it now
            Repr::Heap(v) | Repr::Pooled(v) => std::mem::replace(v, AlignedVec::new()),
            Repr::Mapped(m) => {
                let mut v = AlignedVec::<16>::with_capacity(m.bytes().len());
                v.extend_from_slice(m.bytes());
                v
            }
        }
    }
}

impl Default for Body {
    fn default() -> Self {
        Self::new()
    }
}

impl From<AlignedVec<16>> for Body {
    fn from(v: AlignedVec<16>) -> Self {
        Self(Repr::Heap(v))
    }
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for Body {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Body {}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.is_mapped() { "mapped" } else { "heap" };
        write!(f, "Body({} bytes, {what})", self.len())
    }
}

/// One frame: its kind, flags and an aligned body.
#[derive(Clone, Debug)]
pub struct Frame {
    /// What the body is.
    pub kind: FrameKind,
    /// Flag bits.
    pub flags: u16,
    /// The body, 16-byte aligned so rkyv can access it in place.
    pub body: Body,
}

/// Serializer type used for frame bodies.
pub type BodySerializer<'a> = HighSerializer<AlignedVec<16>, ArenaHandle<'a>, rancor::Error>;

impl Frame {
    /// A frame from raw body bytes.
    pub fn from_bytes(kind: FrameKind, flags: u16, body: &[u8]) -> Self {
        Self { kind, flags, body: Body::copy_from_slice(body) }
    }

    /// A frame whose body is the rkyv archive of `value`.
    pub fn encode<T>(kind: FrameKind, value: &T) -> Result<Self, FrameError>
    where
        T: for<'a> Serialize<BodySerializer<'a>>,
    {
        let body = rkyv::to_bytes::<rancor::Error>(value)
            .map_err(|e| FrameError::Body { what: std::any::type_name::<T>(), detail: e.to_string() })?;
        Ok(Self { kind, flags: 0, body: body.into() })
    }

    /// Checked, zero-copy access to the body as an archived `T`.
    pub fn access<T>(&self) -> Result<&T::Archived, FrameError>
    where
        T: Archive,
        T::Archived: Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>>,
    {
        rkyv::access::<T::Archived, rancor::Error>(self.body.as_slice())
            .map_err(|e| FrameError::Body { what: std::any::type_name::<T>(), detail: e.to_string() })
    }

    /// Checked access that also requires a given kind.
    pub fn access_as<T>(&self, kind: FrameKind) -> Result<&T::Archived, FrameError>
    where
        T: Archive,
        T::Archived: Portable + for<'a> CheckBytes<HighValidator<'a, rancor::Error>>,
    {
        if self.kind != kind {
            return Err(FrameError::UnexpectedKind { expected: kind, got: self.kind });
        }
        self.access::<T>()
    }

    /// The header this frame will be sent with.
    pub fn header(&self) -> Result<FrameHeader, FrameError> {
        let len = u32::try_from(self.body.len())
            .map_err(|_| FrameError::TooLong { len: self.body.len() as u64, max: u32::MAX })?;
        Ok(FrameHeader { kind: self.kind, flags: self.flags, len })
    }

    /// Header and body as one contiguous byte vector.
    pub fn to_wire(&self) -> Result<Vec<u8>, FrameError> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.body.len());
        out.extend_from_slice(&self.header()?.to_bytes());
        out.extend_from_slice(&self.body);
        Ok(out)
    }
}

/// Decodes one frame from the front of `bytes`, returning it and the bytes consumed.
pub fn decode_frame(bytes: &[u8], limits: &FrameLimits) -> Result<(Frame, usize), FrameError> {
    let raw: &[u8; HEADER_LEN] = bytes
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(FrameError::Truncated { expected: HEADER_LEN, got: bytes.len() })?;
    let header = FrameHeader::parse(raw, limits)?;
    let total = HEADER_LEN + header.len as usize;
    let body =
        bytes.get(HEADER_LEN..total).ok_or(FrameError::Truncated { expected: total, got: bytes.len() })?;
    Ok((Frame::from_bytes(header.kind, header.flags, body), total))
}

/// Reads one frame; `Ok(None)` when the stream ends cleanly between frames.
pub async fn read_frame<R>(r: &mut R, limits: &FrameLimits) -> Result<Option<Frame>, FrameError>
where
    R: AsyncRead + Unpin,
{
    Ok(read_frame_charged(r, limits, FrameCharge::unbounded(), false).await?.map(|(frame, _)| frame))
}

/// Like [`read_frame`], reading into a reused buffer from the [`recv_pool`] when one of about the
/// right size is idle, and handing the body's buffer back to it when the frame is dropped (for
/// streams of many large frames; see [`recv_pool`] for what that keeps idle).
pub async fn read_frame_reusing<R>(r: &mut R, limits: &FrameLimits) -> Result<Option<Frame>, FrameError>
where
    R: AsyncRead + Unpin,
{
    Ok(read_frame_charged(r, limits, FrameCharge::unbounded(), true).await?.map(|(frame, _)| frame))
}

/// Like [`read_frame`], charging the body buffer to `budget` as it grows (before each
/// allocation). Returns the frame with the charge it keeps ([`Held`]): hand both on together, and
/// the bytes count against the connection until the `Held` is dropped. Fails with
/// [`FrameError::OverBudget`] when a growth would pass the connection's cap.
pub async fn read_frame_budgeted<R>(
    r: &mut R,
    limits: &FrameLimits,
    budget: &ConnBudget,
) -> Result<Option<(Frame, Held)>, FrameError>
where
    R: AsyncRead + Unpin,
{
    Ok(read_frame_charged(r, limits, budget.frame(), false)
        .await?
        .map(|(frame, charge)| (frame, charge.into_held())))
}

/// [`read_frame_budgeted`] with the buffer reuse of [`read_frame_reusing`] (a pooled buffer's
/// whole capacity is charged). The QUIC link reads its channels' streams this way.
pub async fn read_frame_budgeted_reusing<R>(
    r: &mut R,
    limits: &FrameLimits,
    budget: &ConnBudget,
) -> Result<Option<(Frame, Held)>, FrameError>
where
    R: AsyncRead + Unpin,
{
    Ok(read_frame_charged(r, limits, budget.frame(), true)
        .await?
        .map(|(frame, charge)| (frame, charge.into_held())))
}

async fn read_frame_charged<R>(
    r: &mut R,
    limits: &FrameLimits,
    mut charge: FrameCharge,
    reuse: bool,
) -> Result<Option<(Frame, FrameCharge)>, FrameError>
where
    R: AsyncRead + Unpin,
{
    let mut raw = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        let n = r.read(&mut raw[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(FrameError::Truncated { expected: HEADER_LEN, got });
        }
        got += n;
    }
    let header = FrameHeader::parse(&raw, limits)?;
    let len = header.len as usize;
    // A buffer of an earlier frame of about this size, already resident: no page faults and no
    // growth. Its whole capacity is charged at once; when that does not fit, the frame takes the
    // path below, which charges as bytes arrive.
    let mut pooled = false;
    let mut body = match if reuse { recv_pool::take(len) } else { None } {
        Some(buf) => match charge.grow_to(buf.capacity() as u64) {
            Ok(()) => {
                pooled = true;
                buf
            }
            Err(_) => {
                recv_pool::give(buf);
                AlignedVec::new()
            }
        },
        None => AlignedVec::new(),
    };
    if !pooled {
        let first = len.min(READ_CHUNK);
        charge.grow_to(first as u64)?;
        body.reserve_exact(first);
    }
    // Read straight into the body's spare capacity: no zero-fill pass, one copy. The buffer
    // grows only once it is full of bytes that actually arrived.
    while body.len() < len {
        let start = body.len();
        if start == body.capacity() {
            // Doubling, but never past the announced length, and charged before it is allocated
            // (AlignedVec's own growth rounds up to a power of two).
            let cap = (2 * body.capacity()).max(start + 1).min(len);
            charge.grow_to(cap as u64)?;
            body.reserve_exact(cap - start);
        }
        let room = len.min(body.capacity()) - start;
        let n = read_spare(r, &mut body, room).await?;
        if n == 0 {
            return Err(FrameError::Truncated { expected: HEADER_LEN + len, got: HEADER_LEN + start });
        }
    }
    // only a complete frame's buffer may go back to the pool (a frame cut off mid-way is freed)
    let body =
        if reuse && body.capacity() >= recv_pool::MIN_BYTES { Body(Repr::Pooled(body)) } else { body.into() };
    Ok(Some((Frame { kind: header.kind, flags: header.flags, body }, charge)))
}

/// Buffers of received frame bodies, reused for later frames of about the same size.
///
/// A fresh receive buffer costs a page fault and a kernel zero-fill per page before the first
/// byte lands in it: profiled (perf, 2026-12-02) that was ~48% of the receiving process's work
/// for 1 MiB QUIC frames. A delivered body read from a stream goes back here when its last
/// owner drops it ([`Body::into_aligned`] takes it out for good), and the next frame of about
/// its size is read into it. The pool is process-wide and bounded (`MAX_BYTES`,
/// `MAX_BUFFERS`); the oldest buffers are freed first. Only complete frames' buffers return,
/// so a peer that never finishes its frames puts nothing here, and a frame read into a pooled
/// buffer charges the buffer's whole capacity to its connection's budget.
pub mod recv_pool {
    use std::collections::VecDeque;
    use std::sync::Mutex;

    use rkyv::util::AlignedVec;

    /// Smaller bodies are left to the allocator (which reuses them well).
    pub const MIN_BYTES: usize = 64 << 10;
    /// Most bytes kept idle in the pool.
    pub const MAX_BYTES: usize = 128 << 20;
    /// Most buffers kept idle in the pool.
    pub const MAX_BUFFERS: usize = 32;

    struct Pool {
        bufs: VecDeque<AlignedVec<16>>,
        bytes: usize,
    }

    static POOL: Mutex<Pool> = Mutex::new(Pool { bufs: VecDeque::new(), bytes: 0 });

    /// An empty buffer with room for `len` bytes and at most `len / 16` more, if one is idle.
    pub(crate) fn take(len: usize) -> Option<AlignedVec<16>> {
        if len < MIN_BYTES {
            return None;
        }
        let mut pool = POOL.lock().ok()?;
        let slack = len / 16;
        let (at, _) = pool
            .bufs
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= len && b.capacity() - len <= slack)
            .min_by_key(|(_, b)| b.capacity())?;
        let mut buf = pool.bufs.remove(at)?;
        pool.bytes -= buf.capacity();
        buf.clear();
        Some(buf)
    }

    /// Keeps `buf` for a later frame, freeing the oldest idle buffers to make room.
    pub(crate) fn give(buf: AlignedVec<16>) {
        let cap = buf.capacity();
        if !(MIN_BYTES..=MAX_BYTES).contains(&cap) {
            return;
        }
        let mut freed = Vec::new();
        if let Ok(mut pool) = POOL.lock() {
            while pool.bufs.len() >= MAX_BUFFERS || pool.bytes + cap > MAX_BYTES {
                let Some(old) = pool.bufs.pop_front() else { break };
                pool.bytes -= old.capacity();
                freed.push(old);
            }
            pool.bytes += cap;
            pool.bufs.push_back(buf);
        }
        // freed outside the lock (unmapping large buffers takes a while)
        drop(freed);
    }

    /// Bytes idle in the pool now.
    pub fn idle_bytes() -> usize {
        POOL.lock().map_or(0, |p| p.bytes)
    }
}

/// Reads at most `max` bytes (no more than `body`'s spare capacity) onto the end of `body`
/// without initialising them first; returns how many arrived (0 at the end of the stream).
async fn read_spare<R>(r: &mut R, body: &mut AlignedVec<16>, max: usize) -> std::io::Result<usize>
where
    R: AsyncRead + Unpin,
{
    use std::mem::MaybeUninit;
    let start = body.len();
    let max = max.min(body.capacity() - start);
    std::future::poll_fn(|cx| {
        // SAFETY: `start + max <= capacity`, so these bytes lie inside `body`'s allocation and
        // belong to no other value; they are only exposed as `MaybeUninit`, never read as `u8`.
        let spare = unsafe {
            std::slice::from_raw_parts_mut(body.as_mut_ptr().add(start).cast::<MaybeUninit<u8>>(), max)
        };
        let at = spare.as_ptr().cast::<u8>();
        let mut buf = tokio::io::ReadBuf::uninit(spare);
        std::task::ready!(std::pin::Pin::new(&mut *r).poll_read(cx, &mut buf))?;
        let n = buf.filled().len();
        if buf.filled().as_ptr() != at || n > max {
            return std::task::Poll::Ready(Err(std::io::Error::other("reader swapped its buffer")));
        }
        // SAFETY: `ReadBuf` guarantees its first `n` bytes were initialised (written by the
        // reader), they are the bytes right after `start` (checked above), and `n <= max`.
        unsafe { body.set_len(start + n) };
        std::task::Poll::Ready(Ok(n))
    })
    .await
}

/// Writes one frame (header then body).
pub async fn write_frame<W>(w: &mut W, frame: &Frame) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
{
    w.write_all(&frame.header()?.to_bytes()).await?;
    w.write_all(&frame.body).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq)]
    struct Probe {
        id: u64,
        name: String,
        data: Vec<f32>,
    }

    fn probe() -> Probe {
        Probe { id: 7, name: "expert-3".into(), data: vec![1.0, -2.5, 3.25] }
    }

    #[test]
    fn round_trip_through_wire_bytes() {
        let f = Frame::encode(FrameKind::Message, &probe()).unwrap();
        let wire = f.to_wire().unwrap();
        let (back, used) = decode_frame(&wire, &FrameLimits::default()).unwrap();
        assert_eq!(used, wire.len());
        let a = back.access::<Probe>().unwrap();
        assert_eq!(a.id, 7);
        assert_eq!(a.name.as_str(), "expert-3");
        assert_eq!(a.data.iter().map(|x| x.to_native()).collect::<Vec<_>>(), probe().data);
    }

    #[test]
    fn constructed_bodies_are_aligned_heap_bytes() {
        let f = Frame::encode(FrameKind::Message, &probe()).unwrap();
        let g = Frame::from_bytes(FrameKind::Message, 0, &[1, 2, 3]);
        for body in [&f.body, &g.body] {
            assert!(!body.is_mapped());
            assert_eq!(body.as_ptr() as usize % 16, 0);
        }
        assert_eq!((g.body.len(), g.body.to_vec()), (3, vec![1, 2, 3]));
        assert_eq!(g.body.clone(), g.body);
        assert_eq!(g.body.clone().into_aligned().as_slice(), &[1, 2, 3]);
        assert_eq!(format!("{:?}", g.body), "Body(3 bytes, heap)");
        let shared = bytes::Bytes::from_owner(g.body);
        assert_eq!(&shared[..], &[1, 2, 3]);
    }

    #[test]
    fn header_errors_name_the_problem() {
        let limits = FrameLimits { max_body: 1024 };
        let good = FrameHeader { kind: FrameKind::Tensor, flags: 0, len: 10 }.to_bytes();
        let mut bad = good;
        bad[0] = b'X';
        assert!(matches!(FrameHeader::parse(&bad, &limits), Err(FrameError::BadMagic(_))));
        let mut bad = good;
        bad[4] = 9;
        let e = FrameHeader::parse(&bad, &limits).unwrap_err();
        assert!(e.to_string().contains("unsupported protocol version 9"), "{e}");
        let mut bad = good;
        bad[5] = 200;
        assert!(matches!(FrameHeader::parse(&bad, &limits), Err(FrameError::UnknownKind(200))));
        let mut bad = good;
        bad[6] = 0x80;
        assert!(matches!(FrameHeader::parse(&bad, &limits), Err(FrameError::UnknownFlags(_))));
        let big = FrameHeader { kind: FrameKind::Tensor, flags: 0, len: 1025 }.to_bytes();
        let e = FrameHeader::parse(&big, &limits).unwrap_err();
        assert!(e.to_string().contains("exceeds the cap of 1024"), "{e}");
    }

    #[test]
    fn garbage_body_fails_checked_access() {
        let f = Frame::from_bytes(FrameKind::Message, 0, &[0xFF; 40]);
        let e = f.access::<Probe>().err().unwrap();
        assert!(e.to_string().contains("Probe"), "{e}");
        let e = f.access_as::<Probe>(FrameKind::Hello).err().unwrap();
        assert!(matches!(e, FrameError::UnexpectedKind { .. }));
    }

    #[tokio::test]
    async fn async_reader_handles_truncation_and_clean_end() {
        let f = Frame::encode(FrameKind::Message, &probe()).unwrap();
        let wire = f.to_wire().unwrap();
        let limits = FrameLimits::default();
        let mut two = wire.clone();
        two.extend_from_slice(&wire);
        let mut r = &two[..];
        assert!(read_frame(&mut r, &limits).await.unwrap().is_some());
        assert!(read_frame(&mut r, &limits).await.unwrap().is_some());
        assert!(read_frame(&mut r, &limits).await.unwrap().is_none());
        let mut cut = &wire[..wire.len() - 3];
        let e = read_frame(&mut cut, &limits).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { .. }), "{e}");
        let mut half_header = &wire[..5];
        let e = read_frame(&mut half_header, &limits).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { expected: HEADER_LEN, got: 5 }));
    }

    #[tokio::test]
    async fn announced_length_is_not_allocated_up_front() {
        // A header announcing the full cap followed by 10 bytes: the reader fails with Truncated
        // and never holds more than what arrived plus one chunk.
        let limits = FrameLimits { max_body: 64 << 20 };
        let mut wire = FrameHeader { kind: FrameKind::Tensor, flags: 0, len: 64 << 20 }.to_bytes().to_vec();
        wire.extend_from_slice(&[0u8; 10]);
        let mut r = &wire[..];
        let e = read_frame(&mut r, &limits).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { got: 22, .. }), "{e}");
    }

    #[tokio::test]
    async fn reusing_reads_take_back_the_buffer_of_a_dropped_frame() {
        // a length no other test uses, so the pool's buffer of that size is this test's
        let f = Frame::from_bytes(FrameKind::Tensor, 0, &vec![3u8; 777_777]);
        let wire = f.to_wire().unwrap();
        let limits = FrameLimits::default();
        let budget = ConnBudget::new("peer-p", 8 << 20);
        let (first, held) =
            read_frame_budgeted_reusing(&mut &wire[..], &limits, &budget).await.unwrap().unwrap();
        assert_eq!(first.body.as_slice(), f.body.as_slice());
        assert_eq!(first.body.as_ptr() as usize % 16, 0);
        // a clone is a plain copy; only the original goes back
        let copy = first.body.clone();
        assert_eq!(copy, first.body);
        let at = first.body.as_ptr();
        drop((first, held, copy));
        assert_eq!(budget.held(), 0);
        let (second, held) =
            read_frame_budgeted_reusing(&mut &wire[..], &limits, &budget).await.unwrap().unwrap();
        assert_eq!(second.body.as_ptr(), at, "the second frame was read into the first one's buffer");
        assert_eq!(second.body.as_slice(), f.body.as_slice());
        // the reused buffer's whole capacity is charged
        assert_eq!(held.bytes(), second.body.capacity() as u64);
        // a frame cut off mid-way fails as before, whatever buffer it was read into
        let mut cut = &wire[..wire.len() - 1];
        let e = read_frame_reusing(&mut cut, &limits).await.unwrap_err();
        assert!(matches!(e, FrameError::Truncated { .. }), "{e}");
        // taken out for good: the owner keeps the bytes
        let owned = second.body.clone().into_aligned();
        assert_eq!(owned.as_slice(), f.body.as_slice());
    }

    #[tokio::test]
    async fn budgeted_reads_charge_what_they_allocate_and_refuse_past_the_cap() {
        let budget = ConnBudget::new("peer-x", 3 << 20);
        let f = Frame::from_bytes(FrameKind::Tensor, 0, &vec![7u8; (5 << 20) / 2]);
        let wire = f.to_wire().unwrap();
        let limits = FrameLimits::default();
        let mut r = &wire[..];
        let (back, held) = read_frame_budgeted(&mut r, &limits, &budget).await.unwrap().unwrap();
        assert_eq!(back.body.as_slice(), f.body.as_slice());
        // the buffer never grew past the announced length, and all of it is charged
        assert_eq!(back.body.capacity(), back.body.len());
        assert_eq!((held.bytes(), budget.held()), (back.body.len() as u64, back.body.len() as u64));
        // a second frame of the same size does not fit next to the first one
        let mut r = &wire[..];
        let e = read_frame_budgeted(&mut r, &limits, &budget).await.unwrap_err();
        let FrameError::OverBudget(over) = &e else { panic!("{e}") };
        assert_eq!((over.peer.as_str(), over.cap), ("peer-x", 3 << 20));
        assert!(e.to_string().contains("per-connection cap of 3145728 bytes"), "{e}");
        assert_eq!(budget.held(), back.body.len() as u64, "the refused frame released its charge");
        drop(held);
        assert_eq!(budget.held(), 0);
        let mut r = &wire[..];
        assert!(read_frame_budgeted(&mut r, &limits, &budget).await.unwrap().is_some());
        assert_eq!(budget.held(), 0, "dropped at once: nothing kept");
    }
}
