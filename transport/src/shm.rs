//! Same-host fast path: a large frame body handed over through a file in `/dev/shm` instead of
//! the encrypted QUIC stream, used automatically between two nodes that proved they share a host.
//! The API is the normal [`Link::send`](crate::link::Link::send); only the bytes take another road.
//!
//! # Protocol (per direction, per connection)
//! 1. **Offer.** The would-be sender writes a *probe* segment holding a random nonce and sends
//!    [`ShmOffer`] `{ host, probe }` on a bidirectional stream of the authenticated connection.
//! 2. **Answer.** The receiver accepts only if `host` equals its own [`HostId`] *and* it can read
//!    the probe (so both see the same `/dev/shm`, which two containers of one host may not); it
//!    echoes the nonce and issues a random 32-byte token for this peer ([`ShmAnswer`]).
//! 3. **Send.** A body of at least [`ShmConfig::min_bytes`] goes into a fresh segment created
//!    `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600, under an unguessable name
//!    (`troupe-shm-<pid>-<128 random bits in hex>`); its 64-byte header carries the token and the
//!    length. The stream carries only a small frame with [`FLAG_SHM`] whose body is [`ShmRef`].
//!    **Warm pool.** Rather than a fresh segment per frame, the sender keeps up to
//!    [`ShmConfig::pool_bytes`] of *pooled* segments per peer connection (header kind 3, a state
//!    word at byte 56: ready or free) and rewrites one the receiver has marked free, so the
//!    tmpfs pages are allocated and faulted once, not per frame (a fresh 64 MiB segment cost
//!    ~24 ms of page allocation here, more under reclaim; a warm one is written at memcpy
//!    speed). A pool that is full of segments still held by the receiver falls back to
//!    one-shot segments ([`ShmStats::sent_one_shot`]). Each pool belongs to one connection's
//!    token: a reconnect gets a new token and a new pool, the old one is removed.
//! 4. **Receive (no copy).** The receiver validates the name strictly (fixed prefix, digits,
//!    32 hex characters: no `/`, no `..`), checks the length against its frame cap *before*
//!    anything is opened or mapped, charges it to the connection's memory budget, opens with
//!    `O_NOFOLLOW`, requires a regular file owned by its own uid with no group/other permission
//!    and exactly header + length bytes (pooled: at least), checks the header's magic, token and
//!    length (and, pooled, that it is marked ready), then maps it **read-only** and delivers a
//!    frame whose [`Body`] is that mapping: the bytes are never copied on
//!    this side. A one-shot segment is unlinked at open (only its mapping keeps its pages) and
//!    unmapped when the body is dropped. A pooled segment stays in place and is marked free
//!    (token checked again) only when the last holder of its body drops it; the budget charge
//!    ([`Held`]) lives with the mapping too, so bodies an application keeps count against its
//!    peer's cap until dropped.
//!
//! # Why a peer that lies cannot hurt the receiver
//! The host identity is only a hint that decides whether to *try*; nothing the receiver does
//! trusts it. A peer on another host that claims ours can only send names: a name is never a
//! path (it cannot leave `/dev/shm`), a symlink is refused, a file of another user is refused,
//! and a file whose header lacks the token this receiver issued *to that peer* is refused and
//! left in place, so a liar cannot read our files, cannot consume or destroy a segment meant for
//! another connection (another user on this host can list `/dev/shm`, but cannot create a file
//! owned by us nor learn the token), and cannot make us allocate past the frame cap. The worst
//! it gets is a named [`ShmError`] for its own frame while the connection keeps serving. A
//! sender that wrongly believes it shares our host (a cloned machine-id; `boot_id` differs per
//! boot) fails the probe and keeps using QUIC. Integrity: the segment is a 0600 file of our
//! uid, so only processes that could also write into our memory can change it; QUIC's AEAD is
//! not needed for bytes that never leave the kernel.
//!
//! **Mapped bodies.** Our mapping is read-only (`PROT_READ`): nothing in this process can
//! write the sender's segment through it. The sender could still change the bytes we hold, or
//! truncate the file (a later access would then raise `SIGBUS`), but only a process of our own
//! uid can write that file, and such a process could already write our memory (`ptrace`,
//! `/proc/<pid>/mem`), so this adds no power to anyone. By protocol the sender never does:
//! it rewrites a pooled segment only after *we* mark it free, which happens only once the last
//! clone of the body is dropped (a held body makes the sender take another segment), and it
//! never writes a one-shot segment again. What the receiver checked at open (header, token,
//! length) therefore still holds for as long as the body lives, and rkyv's checked access on
//! the mapped bytes is as sound as on heap bytes for a sender that follows the protocol.
//!
//! # Nothing leaks forever
//! The receiver unlinks each one-shot segment when it opens it; its pages are freed when the
//! mapped body is dropped. The sender tracks the segments it
//! created per connection (pooled and one-shot) and unlinks whatever is left when that
//! connection closes or the node shuts down;
//! a node starting up removes segments whose creating process no longer exists.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use quinn::{Connection, RecvStream, SendStream};
use rkyv::{Archive, Deserialize, Serialize};
use tracing::{debug, warn};

use crate::budget::Held;
use crate::frame::{Body, FLAG_SHM, Frame, FrameError, FrameKind, FrameLimits, read_frame, write_frame};
use crate::link::{Channel, NodeId};

/// Folder holding the segments (a tmpfs on Linux).
pub const SHM_DIR: &str = "/dev/shm";
/// Every segment name starts with this.
pub const SEGMENT_PREFIX: &str = "troupe-shm-";
/// Length of the segment file header in bytes.
pub const SEGMENT_HEADER_LEN: usize = 64;
/// Default smallest body sent through a segment (smaller ones stay on the stream).
pub const DEFAULT_MIN_BYTES: usize = 64 << 10;
/// First eight bytes of every segment file.
const SEGMENT_MAGIC: [u8; 8] = *b"TRPESHM1";
/// Header kind byte: a frame body.
const KIND_BODY: u8 = 1;
/// Header kind byte: a handshake probe.
const KIND_PROBE: u8 = 2;
/// Header kind byte: a frame body in a pooled segment that the sender rewrites once freed.
const KIND_POOLED: u8 = 3;
/// Offset of a pooled segment's state word in the header.
const STATE_AT: u64 = 56;
/// State word of a pooled segment the receiver has read (the sender may rewrite it).
const STATE_FREE: u64 = 0;
/// State word of a pooled segment holding a body not yet read.
const STATE_READY: u64 = 1;
/// Default cap on the bytes of warm segments kept per peer.
pub const DEFAULT_POOL_BYTES: u64 = 256 << 20;
/// Most warm segments kept per peer.
const MAX_POOL_SEGMENTS: usize = 64;
/// Length of a probe's body (the nonce).
const PROBE_LEN: u64 = 32;
/// Longest name accepted (prefix, up to 10 pid digits, a dash, 32 hex characters).
const MAX_NAME_LEN: usize = SEGMENT_PREFIX.len() + 10 + 1 + 32;
/// Cap on handshake frames.
const HANDSHAKE_LIMITS: FrameLimits = FrameLimits { max_body: 1024 };

/// Settings of the same-host path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmConfig {
    /// Offer and accept the path at all (both sides must allow it).
    pub enabled: bool,
    /// Bodies of at least this many bytes go through a segment.
    pub min_bytes: usize,
    /// Bytes of warm segments kept per peer for reuse (0: a fresh segment per frame). Past it,
    /// frames use fresh one-shot segments.
    pub pool_bytes: u64,
    /// Carry every channel's frames to a same-host peer over a Unix-domain stream instead of
    /// QUIC ([`crate::local`]); off, only large bodies take the same-host road.
    pub streams: bool,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self { enabled: true, min_bytes: DEFAULT_MIN_BYTES, pool_bytes: DEFAULT_POOL_BYTES, streams: true }
    }
}

/// Why the same-host path refused or failed; every variant names the problem.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// A segment name that is not of the one accepted form.
    #[error("bad segment name {name:?}: {reason}")]
    BadName {
        /// The name as received (clipped).
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The announced length exceeds the receiver's frame cap.
    #[error("segment of {len} bytes exceeds the cap of {max} bytes")]
    TooLong {
        /// Announced length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// A segment arrived from a peer that never completed the same-host handshake with us.
    #[error("segment from {0}, which was not offered the same-host path")]
    NotOffered(NodeId),
    /// A file could not be created, opened, read or removed.
    #[error("segment {path}: {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not one we accept (type, owner, mode, size, header).
    #[error("segment {path} refused: {reason}")]
    Refused {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The handshake failed or was declined.
    #[error("same-host handshake: {0}")]
    Handshake(String),
    /// A blocking segment reader or writer task failed.
    #[error("same-host worker task failed: {0}")]
    Task(String),
    /// A frame could not be built or read.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Identity of the running host: blake3 of `/etc/machine-id` and the kernel's `boot_id` (which
/// changes every boot, so cloned images with one machine-id still differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostId(pub [u8; 32]);

impl HostId {
    /// This host's identity, or `None` where either file is missing (the path stays off).
    pub fn current() -> Option<Self> {
        let machine = ["/etc/machine-id", "/var/lib/dbus/machine-id"]
            .iter()
            .find_map(|p| std::fs::read_to_string(p).ok())
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())?;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let mut h = blake3::Hasher::new();
        h.update(b"troupe-host-id-v1\0");
        h.update(machine.as_bytes());
        h.update(b"\0");
        h.update(boot.trim().as_bytes());
        Some(Self(*h.finalize().as_bytes()))
    }
}

/// Sent by the would-be sender to open the path.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ShmOffer {
    /// The sender's [`HostId`].
    pub host: [u8; 32],
    /// Name of the probe segment holding the nonce.
    pub probe: String,
}

/// The receiver's answer to a [`ShmOffer`].
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ShmAnswer {
    /// Whether segments will be accepted.
    pub accepted: bool,
    /// The token every segment header must carry (zero when refused).
    pub token: [u8; 32],
    /// The nonce read from the probe (zero when refused).
    pub nonce: [u8; 32],
    /// Why it was refused (empty when accepted).
    pub reason: String,
    /// The abstract name of the receiver's local-stream listener ([`crate::local`]); empty when
    /// it takes frames on QUIC only.
    pub stream: String,
}

/// What a sender needs to open local streams to a peer that accepted its same-host offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalTarget {
    /// The peer's listener name.
    pub name: String,
    /// The token the peer issued to us.
    pub token: [u8; 32],
}

/// Body of a [`FLAG_SHM`] frame: which segment holds the real body.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ShmRef {
    /// The segment's file name in [`SHM_DIR`].
    pub name: String,
    /// Length of the body in bytes.
    pub len: u64,
}

/// True when `frame` names a segment instead of carrying its body.
pub fn is_shm(frame: &Frame) -> bool {
    frame.flags & FLAG_SHM != 0
}

/// The body length a segment frame announces (checked access), to charge before reading it.
pub fn declared_len(frame: &Frame) -> Option<u64> {
    frame.access::<ShmRef>().ok().map(|r| r.len.to_native())
}

/// Checks that `name` is exactly `troupe-shm-<1..10 digits>-<32 lower-case hex>`.
pub fn validate_name(name: &str) -> Result<(), ShmError> {
    let bad = |reason| ShmError::BadName { name: name.chars().take(80).collect(), reason };
    if name.contains('/') || name.contains("..") || name.contains('\0') {
        return Err(bad("contains a path separator or '..' (path traversal)"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(bad("too long"));
    }
    let rest = name.strip_prefix(SEGMENT_PREFIX).ok_or_else(|| bad("does not start with troupe-shm-"))?;
    let (pid, hex) = rest.split_once('-').ok_or_else(|| bad("no pid field"))?;
    if pid.is_empty() || pid.len() > 10 || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("pid field is not 1 to 10 digits"));
    }
    if hex.len() != 32 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(bad("random field is not 32 lower-case hex characters"));
    }
    Ok(())
}

/// Fills `buf` from the operating system's secure random source (through ring).
pub(crate) fn random_bytes(buf: &mut [u8]) -> Result<(), ShmError> {
    crate::identity::crypto_provider()
        .secure_random
        .fill(buf)
        .map_err(|_| ShmError::Handshake("no secure random source".into()))
}

fn random32() -> Result<[u8; 32], ShmError> {
    let mut b = [0u8; 32];
    random_bytes(&mut b)?;
    Ok(b)
}

fn new_name() -> Result<String, ShmError> {
    let mut r = [0u8; 16];
    random_bytes(&mut r)?;
    let hex: String = r.iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!("{SEGMENT_PREFIX}{}-{hex}", std::process::id()))
}

fn header(kind: u8, token: &[u8; 32], len: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    h[..8].copy_from_slice(&SEGMENT_MAGIC);
    h[8] = kind;
    h[16..48].copy_from_slice(token);
    h[48..56].copy_from_slice(&len.to_le_bytes());
    if kind == KIND_POOLED {
        h[56..64].copy_from_slice(&STATE_READY.to_le_bytes());
    }
    h
}

/// A segment this process created.
#[derive(Debug)]
struct Segment {
    name: String,
    path: PathBuf,
}

/// Creates an empty segment file (`O_EXCL`, 0600, never following a link) under a fresh name.
fn create_segment() -> Result<(Segment, File), ShmError> {
    let name = new_name()?;
    let path = Path::new(SHM_DIR).join(&name);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| ShmError::Io { path: path.clone(), op: "create", source })?;
    Ok((Segment { name, path }, f))
}

/// Creates a one-shot segment holding `body` (the receiver unlinks it).
fn write_segment(kind: u8, token: &[u8; 32], body: &[u8]) -> Result<Segment, ShmError> {
    let (Segment { name, path }, mut f) = create_segment()?;
    let io = |op, source| ShmError::Io { path: path.clone(), op, source };
    let written = f
        .write_all(&header(kind, token, body.len() as u64))
        .and_then(|_| f.write_all(body))
        .map_err(|e| io("write", e));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    Ok(Segment { name, path })
}

/// This process's effective uid.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// A segment that passed every check of [`open_segment`].
struct Opened {
    file: File,
    path: PathBuf,
    /// A pooled segment (left in place, marked free once read) rather than a one-shot one.
    pooled: bool,
}

/// Opens and checks segment `name` of `len` body bytes. The file must be a regular file of our
/// uid with mode 0600 and exactly (pooled: at least) header + `len` bytes, and its header must
/// carry the magic, `kind`, `token` and `len`; a one-shot segment is unlinked (when `consume`)
/// only after those checks, so a segment meant for another connection is left alone. Where a
/// body is expected, a pooled segment is accepted too: it must be marked ready (never read twice).
fn open_segment(name: &str, len: u64, kind: u8, token: &[u8; 32], consume: bool) -> Result<Opened, ShmError> {
    validate_name(name)?;
    let path = Path::new(SHM_DIR).join(name);
    let io = |op, source| ShmError::Io { path: path.clone(), op, source };
    let refused = |reason: String| ShmError::Refused { path: path.clone(), reason };
    let f = OpenOptions::new()
        .read(true)
        .write(kind == KIND_BODY)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(&path)
        .map_err(|e| io("open", e))?;
    let meta = f.metadata().map_err(|e| io("fstat", e))?;
    if !meta.file_type().is_file() {
        return Err(refused("not a regular file".into()));
    }
    if meta.uid() != own_uid() {
        return Err(refused(format!("owned by uid {}, not ours ({})", meta.uid(), own_uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refused(format!("mode {:o} gives access to others", meta.mode() & 0o777)));
    }
    let expected = SEGMENT_HEADER_LEN as u64 + len;
    if meta.len() < expected {
        return Err(refused(format!("holds {} bytes, the frame announced {expected}", meta.len())));
    }
    let mut h = [0u8; SEGMENT_HEADER_LEN];
    pread_exact(&f, &mut h, 0).map_err(|e| io("read header", e))?;
    if h[..8] != SEGMENT_MAGIC {
        return Err(refused("bad magic".into()));
    }
    let pooled = kind == KIND_BODY && h[8] == KIND_POOLED;
    if h[8] != kind && !pooled {
        return Err(refused(format!("kind {} where {kind} was expected", h[8])));
    }
    if !pooled && meta.len() != expected {
        return Err(refused(format!("holds {} bytes, the frame announced {expected}", meta.len())));
    }
    if h[16..48] != token[..] {
        return Err(refused("token does not match the one issued to this peer".into()));
    }
    if h[48..56] != len.to_le_bytes() {
        return Err(refused("header length differs from the frame's".into()));
    }
    if pooled && h[56..64] != STATE_READY.to_le_bytes() {
        return Err(refused("pooled segment is not marked ready (already read)".into()));
    }
    if consume && !pooled {
        std::fs::remove_file(&path).map_err(|e| io("unlink", e))?;
    }
    Ok(Opened { file: f, path, pooled })
}

/// Reads the nonce of probe segment `name` (left in place for its sender to remove).
fn read_probe(name: &str) -> Result<[u8; PROBE_LEN as usize], ShmError> {
    let Opened { file, path, .. } = open_segment(name, PROBE_LEN, KIND_PROBE, &[0; 32], false)?;
    let mut nonce = [0u8; PROBE_LEN as usize];
    pread_exact(&file, &mut nonce, SEGMENT_HEADER_LEN as u64).map_err(|source| ShmError::Io {
        path,
        op: "read probe",
        source,
    })?;
    Ok(nonce)
}

/// Opens, checks (see [`open_segment`]) and maps body segment `name` of `len` bytes read-only:
/// no copy. `held` (the bytes charged against the peer's memory budget) and one count of `live`
/// stay with the mapping until it is dropped; a pooled segment is marked free for its sender
/// only then, a one-shot one was unlinked at open and its pages go with the mapping.
fn map_segment(
    name: &str,
    len: u64,
    token: &[u8; 32],
    held: Held,
    live: &Arc<AtomicU64>,
) -> Result<MappedBody, ShmError> {
    let Opened { file, path, pooled } = open_segment(name, len, KIND_BODY, token, true)?;
    let mapped = usize::try_from(len)
        .ok()
        .and_then(|l| l.checked_add(SEGMENT_HEADER_LEN))
        .ok_or_else(|| std::io::Error::other("length does not fit in memory"))
        .and_then(|total| ReadMapping::new(&file, total));
    let map = match mapped {
        Ok(map) => map,
        Err(source) => {
            if pooled {
                // not mapped, so not held: the sender may have it back (the token proved it is
                // this peer's segment)
                mark_free(&file);
            }
            return Err(ShmError::Io { path, op: "mmap", source });
        }
    };
    live.fetch_add(1, Ordering::AcqRel);
    Ok(MappedBody { map, pooled: pooled.then_some((file, *token)), path, _held: held, live: live.clone() })
}

/// Marks a pooled segment free for its sender to rewrite (best effort: a sender that never sees
/// it free falls back to one-shot segments).
fn mark_free(file: &File) {
    use std::os::unix::fs::FileExt;
    let _ = file.write_all_at(&STATE_FREE.to_le_bytes(), STATE_AT);
}

fn pread_exact(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset)
}

/// A shared, read-only mapping of the first `len` bytes of a segment file, unmapped on drop.
/// Pages are not populated up front: each is mapped on first touch (the segment's pages exist
/// already, so that costs a minor fault, no allocation or zeroing), and a consumer that reads
/// only part of a body pays only for that part.
struct ReadMapping {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is read-only memory owned by this value; any thread may read it and the
// value may be dropped (unmapped) on any thread.
unsafe impl Send for ReadMapping {}
// SAFETY: as above: shared access only ever reads.
unsafe impl Sync for ReadMapping {}

impl ReadMapping {
    fn new(file: &File, len: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of `len` bytes of a file that
        // holds at least that many (checked by the caller); read-only, so nothing in this
        // process can write through it.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap gave NULL"))?;
        Ok(Self { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is a live read-only mapping for as long as `self` is. Only
        // our sender (a process of our own uid, which could write our memory anyway) could
        // change these bytes, and by protocol it never rewrites a segment before we mark it free
        // (which happens only when this mapping is dropped); see the module doc.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for ReadMapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and the mapping is dropped once;
        // no borrow of `bytes()` outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A received body left in its segment and mapped read-only (see [`crate::frame::Body`]).
pub(crate) struct MappedBody {
    map: ReadMapping,
    /// A pooled segment's file and the token it was checked against: marked free on drop.
    pooled: Option<(File, [u8; 32])>,
    path: PathBuf,
    _held: Held,
    live: Arc<AtomicU64>,
}

impl std::fmt::Debug for MappedBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MappedBody({}, {} bytes)", self.path.display(), self.bytes().len())
    }
}

impl MappedBody {
    /// The body's bytes (after the segment header; 16-byte aligned, as the mapping is
    /// page-aligned and the header is 64 bytes).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map.bytes()[SEGMENT_HEADER_LEN..]
    }
}

impl Drop for MappedBody {
    fn drop(&mut self) {
        if let Some((file, token)) = &self.pooled {
            // the sender may rewrite it once it is free; check it is still ours first
            if self.map.bytes()[16..48] == token[..] {
                mark_free(file);
            } else {
                warn!(path = %self.path.display(), "a held segment was rewritten by its sender; not freeing it");
            }
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Removes segments left by processes that no longer exist (crashed senders); returns how many.
///
/// Liveness is judged by `/proc/<pid>`, so nothing is removed where `/proc` is not mounted; a
/// process of another pid namespace sharing this `/dev/shm` would look dead (keep one
/// `/dev/shm` per pid namespace, as container runtimes do by default).
pub fn sweep_stale() -> usize {
    if !Path::new("/proc/self").exists() {
        return 0;
    }
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    let me = std::process::id().to_string();
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if validate_name(name).is_err() {
            continue;
        }
        let pid = name[SEGMENT_PREFIX.len()..].split('-').next().unwrap_or_default();
        if pid == me || Path::new("/proc").join(pid).exists() {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// A shared, writable mapping of a whole segment file, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value alone (no aliasing Rust references
// exist), so moving it to another thread is sound.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps all `len` bytes of `file` shared and writable, with its pages allocated and faulted
    /// in writable up front (`MADV_POPULATE_WRITE`; here a first 64 MiB fill after
    /// `MAP_POPULATE`, which faults pages in read-only, took ~50 ms against ~30 ms, and later
    /// fills run at memcpy speed either way). Transparent huge pages are asked for first: tmpfs
    /// grants them only where `shmem_enabled` allows (`advise` or more; `never` on the machine
    /// this was measured on, so there the pages stay 4 KiB).
    fn new(file: &File, len: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of a file we own and sized to
        // `len` beforehand; nothing else in this process refers to that range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap gave NULL"))?;
        // SAFETY: both calls cover exactly the mapping made above; MADV_HUGEPAGE only changes how
        // the kernel backs it, MADV_POPULATE_WRITE faults its pages in as a write would (the file
        // is already `len` bytes long, so no page lies past its end). Both are best effort: an
        // older kernel that lacks POPULATE_WRITE leaves the pages to fault on the first fill.
        unsafe {
            libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE);
            libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE);
        }
        Ok(Self { ptr, len })
    }

    /// Copies `bytes` to `offset` (which must leave room for them).
    fn write(&mut self, offset: usize, bytes: &[u8]) {
        assert!(offset.checked_add(bytes.len()).is_some_and(|end| end <= self.len), "write past the mapping");
        // SAFETY: the range lies inside the mapping (asserted above), `bytes` is another
        // allocation (a mapping is never handed out as a slice), and u8 has no invalid values.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and the mapping is dropped once.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A warm segment of one peer's pool: created and mapped once (pages populated), rewritten with
/// a plain memory copy for every body that fits once its receiver has marked it free, so its
/// tmpfs pages are allocated and faulted only the first time. The file is ours (0600, created
/// `O_EXCL`); only a process of our uid could truncate it under the mapping.
#[derive(Debug)]
struct PoolSegment {
    seg: Segment,
    file: File,
    map: Mapping,
    /// Body bytes the file has room for.
    capacity: u64,
}

impl PoolSegment {
    /// A new pooled segment with room for `capacity` body bytes.
    fn create(capacity: u64) -> Result<Self, ShmError> {
        let (seg, file) = create_segment()?;
        let io = |op, source| ShmError::Io { path: seg.path.clone(), op, source };
        let made = usize::try_from(capacity)
            .ok()
            .and_then(|c| c.checked_add(SEGMENT_HEADER_LEN))
            .ok_or_else(|| io("size", std::io::Error::other("segment too large")))
            .and_then(|len| {
                file.set_len(len as u64).map_err(|e| io("truncate", e))?;
                Mapping::new(&file, len).map_err(|e| io("mmap", e))
            });
        match made {
            Ok(map) => Ok(Self { seg, file, map, capacity }),
            Err(e) => {
                let _ = std::fs::remove_file(&seg.path);
                Err(e)
            }
        }
    }

    /// Whether the receiver has read it (or it was never handed out).
    fn is_free(&self) -> bool {
        use std::os::unix::fs::FileExt;
        let mut w = [0u8; 8];
        self.file.read_exact_at(&mut w, STATE_AT).is_ok() && u64::from_le_bytes(w) == STATE_FREE
    }

    /// Writes `body`, then the header that marks it ready for the peer holding `token`.
    fn fill(&mut self, token: &[u8; 32], body: &[u8]) -> Result<(), ShmError> {
        use std::os::unix::fs::FileExt;
        if body.len() as u64 > self.capacity {
            return Err(ShmError::Refused {
                path: self.seg.path.clone(),
                reason: "body exceeds the segment".into(),
            });
        }
        self.map.write(SEGMENT_HEADER_LEN, body);
        self.file
            .write_all_at(&header(KIND_POOLED, token, body.len() as u64), 0)
            .map_err(|source| ShmError::Io { path: self.seg.path.clone(), op: "write", source })
    }
}

/// One peer's warm segments; `bytes` counts the capacity of all of them, lent out or not.
#[derive(Debug, Default)]
struct Pool {
    idle: Vec<PoolSegment>,
    bytes: u64,
    count: usize,
    closed: bool,
}

/// Which kind of [`Slot`] a body went to (for [`ShmStats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotKind {
    Reuse,
    Grow,
    OneShot,
}

impl Slot {
    fn counter(&self) -> SlotKind {
        match self {
            Slot::Reuse(_) => SlotKind::Reuse,
            Slot::Grow(_) => SlotKind::Grow,
            Slot::OneShot => SlotKind::OneShot,
        }
    }
}

/// Where a body goes.
enum Slot {
    /// A warm segment the receiver has freed.
    Reuse(PoolSegment),
    /// A new pooled segment of exactly this many bytes (already counted in the pool).
    Grow(u64),
    /// A fresh one-shot segment (the pool is full or busy).
    OneShot,
}

/// The sending side of one peer's path: its token, its warm segments and the one-shot segments
/// not yet known consumed.
struct Outbound {
    generation: u64,
    token: [u8; 32],
    pending: std::sync::Mutex<Vec<PathBuf>>,
    pool: std::sync::Mutex<Pool>,
    pool_cap: u64,
}

impl Outbound {
    fn new(generation: u64, token: [u8; 32], pool_cap: u64) -> Self {
        Self {
            generation,
            token,
            pending: std::sync::Mutex::new(Vec::new()),
            pool: std::sync::Mutex::new(Pool::default()),
            pool_cap,
        }
    }

    fn track(&self, path: PathBuf) {
        if let Ok(mut p) = self.pending.lock() {
            // whatever the receiver already unlinked needs no cleanup
            p.retain(|q| q.exists());
            p.push(path);
        }
    }

    /// Picks a segment for a body of `len` bytes: a free warm one that fits (not more than twice
    /// the size), else a new one while the pool stays within its cap (free segments that do not
    /// fit are removed to make room), else a one-shot segment.
    fn slot(&self, len: u64) -> Slot {
        let Ok(mut pool) = self.pool.lock() else { return Slot::OneShot };
        if pool.closed {
            return Slot::OneShot;
        }
        let fits = |s: &PoolSegment| s.capacity >= len && s.capacity / 2 <= len;
        if let Some(i) = pool.idle.iter().position(|s| fits(s) && s.is_free()) {
            return Slot::Reuse(pool.idle.swap_remove(i));
        }
        while pool.bytes + len > self.pool_cap || pool.count >= MAX_POOL_SEGMENTS {
            let Some(i) = pool.idle.iter().position(PoolSegment::is_free) else { break };
            let old = pool.idle.swap_remove(i);
            pool.bytes -= old.capacity;
            pool.count -= 1;
            let _ = std::fs::remove_file(&old.seg.path);
        }
        if pool.bytes + len <= self.pool_cap && pool.count < MAX_POOL_SEGMENTS {
            pool.bytes += len;
            pool.count += 1;
            Slot::Grow(len)
        } else {
            Slot::OneShot
        }
    }

    /// Puts a pooled segment back (removes it if the connection closed meanwhile).
    fn give_back(&self, seg: PoolSegment) {
        match self.pool.lock() {
            Ok(mut pool) if !pool.closed => pool.idle.push(seg),
            _ => {
                let _ = std::fs::remove_file(&seg.seg.path);
            }
        }
    }

    /// A [`Slot::Grow`] whose segment could not be made: its bytes leave the pool.
    fn shrink(&self, len: u64) {
        if let Ok(mut pool) = self.pool.lock() {
            pool.bytes -= len;
            pool.count -= 1;
        }
    }

    /// Bytes of warm segments held for this peer (lent out or not).
    #[cfg(test)]
    fn pool_bytes(&self) -> u64 {
        self.pool.lock().map(|p| p.bytes).unwrap_or(0)
    }

    /// Writes `body` into `slot`; the segment's name, and the warm segment to give back.
    fn write(&self, slot: Slot, body: &[u8]) -> Result<(String, Option<PoolSegment>), ShmError> {
        match slot {
            Slot::Reuse(mut seg) => match seg.fill(&self.token, body) {
                Ok(()) => Ok((seg.seg.name.clone(), Some(seg))),
                Err(e) => {
                    self.shrink(seg.capacity);
                    let _ = std::fs::remove_file(&seg.seg.path);
                    Err(e)
                }
            },
            Slot::Grow(capacity) => {
                let made =
                    PoolSegment::create(capacity).and_then(|mut seg| match seg.fill(&self.token, body) {
                        Ok(()) => Ok(seg),
                        Err(e) => {
                            let _ = std::fs::remove_file(&seg.seg.path);
                            Err(e)
                        }
                    });
                match made {
                    Ok(seg) => Ok((seg.seg.name.clone(), Some(seg))),
                    Err(e) => {
                        self.shrink(capacity);
                        Err(e)
                    }
                }
            }
            Slot::OneShot => {
                let seg = write_segment(KIND_BODY, &self.token, body)?;
                let name = seg.name.clone();
                self.track(seg.path);
                Ok((name, None))
            }
        }
    }

    fn remove_all(&self) {
        if let Ok(mut p) = self.pending.lock() {
            for path in p.drain(..) {
                let _ = std::fs::remove_file(path);
            }
        }
        if let Ok(mut pool) = self.pool.lock() {
            pool.closed = true;
            for seg in pool.idle.drain(..) {
                let _ = std::fs::remove_file(&seg.seg.path);
            }
        }
    }
}

/// Counters of the same-host path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShmStats {
    /// Frames this node sent through segments.
    pub sent: u64,
    /// Of those, frames written into a warm pooled segment that was reused (freed by its
    /// receiver), allocating nothing.
    pub sent_reused: u64,
    /// Of those, frames written into a fresh one-shot segment because the pool was full of
    /// segments still held by the receiver (or disabled).
    pub sent_one_shot: u64,
    /// Frames this node received through segments.
    pub received: u64,
    /// Segment frames this node refused.
    pub refused: u64,
    /// Received bodies still mapped now (held by the application or its queues).
    pub mapped: u64,
}

/// A node's same-host state: its host identity, the paths it may send on, the tokens it issued.
pub struct ShmState {
    config: ShmConfig,
    host: Option<HostId>,
    /// This node's local-stream listener name, sent in every accepted answer.
    stream_name: Option<String>,
    outbound: DashMap<NodeId, Arc<Outbound>>,
    inbound: DashMap<NodeId, [u8; 32]>,
    sent: AtomicU64,
    sent_reused: AtomicU64,
    sent_one_shot: AtomicU64,
    received: AtomicU64,
    refused: AtomicU64,
    mapped: Arc<AtomicU64>,
}

impl ShmState {
    /// State for a node with `config`; removes stale segments of dead processes. `stream_name`
    /// is the node's local-stream listener ([`crate::local`]), offered to peers that pass the
    /// handshake.
    pub fn new(config: ShmConfig, stream_name: Option<String>) -> Self {
        let host = if config.enabled { HostId::current() } else { None };
        if host.is_some() {
            let n = sweep_stale();
            if n > 0 {
                debug!(removed = n, "removed stale same-host segments");
            }
        }
        Self {
            config,
            host,
            stream_name,
            outbound: DashMap::new(),
            inbound: DashMap::new(),
            sent: AtomicU64::new(0),
            sent_reused: AtomicU64::new(0),
            sent_one_shot: AtomicU64::new(0),
            received: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            mapped: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Whether frames to `peer` currently go through segments.
    pub fn active_to(&self, peer: &NodeId) -> bool {
        self.outbound.contains_key(peer)
    }

    /// Counters so far.
    pub fn stats(&self) -> ShmStats {
        ShmStats {
            sent: self.sent.load(Ordering::Relaxed),
            sent_reused: self.sent_reused.load(Ordering::Relaxed),
            sent_one_shot: self.sent_one_shot.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            mapped: self.mapped.load(Ordering::Acquire),
        }
    }

    /// Whether this node offers the path at all.
    pub(crate) fn offers(&self) -> bool {
        self.config.enabled && self.host.is_some()
    }

    /// This node's local-stream listener name, when it has one.
    pub(crate) fn stream_name(&self) -> Option<&str> {
        self.stream_name.as_deref()
    }

    /// The peer this node issued `token` to, if any is connected.
    pub(crate) fn token_owner(&self, token: &[u8; 32]) -> Option<NodeId> {
        self.inbound.iter().find(|e| crate::local::same_token(e.value(), token)).map(|e| e.key().clone())
    }

    /// Sender side of the handshake on connection `generation` to `peer` (bi stream tagged `tag`).
    /// On success, where to open local streams to the peer, when it takes them and this node
    /// sends on them ([`ShmConfig::streams`]).
    pub(crate) async fn offer(
        &self,
        conn: &Connection,
        peer: &NodeId,
        generation: u64,
        tag: u8,
    ) -> Result<Option<LocalTarget>, ShmError> {
        let host =
            self.host.filter(|_| self.config.enabled).ok_or(ShmError::Handshake("disabled here".into()))?;
        let nonce = random32()?;
        let probe = tokio::task::spawn_blocking(move || write_segment(KIND_PROBE, &[0; 32], &nonce))
            .await
            .map_err(|e| ShmError::Handshake(format!("probe writer: {e}")))??;
        let hs = |e: String| ShmError::Handshake(e);
        let exchange = async {
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| hs(e.to_string()))?;
            send.write_all(&[tag]).await.map_err(|e| hs(e.to_string()))?;
            let offer = ShmOffer { host: host.0, probe: probe.name.clone() };
            write_frame(&mut send, &Frame::encode(FrameKind::Message, &offer)?).await?;
            let _ = send.finish();
            let reply = read_frame(&mut recv, &HANDSHAKE_LIMITS)
                .await?
                .ok_or_else(|| hs("stream closed before the answer".into()))?;
            let answer = reply.access_as::<ShmAnswer>(FrameKind::Message)?;
            if !answer.accepted {
                return Err(hs(format!("declined: {}", answer.reason)));
            }
            if answer.nonce != nonce {
                return Err(hs("the answer does not echo the probe's nonce".into()));
            }
            let stream = answer.stream.as_str();
            let target = if self.config.streams && !stream.is_empty() {
                crate::local::validate_name(stream).map_err(|e| hs(e.to_string()))?;
                Some(LocalTarget { name: stream.to_owned(), token: answer.token })
            } else {
                None
            };
            Ok((answer.token, target))
        }
        .await;
        let _ = std::fs::remove_file(&probe.path);
        let (token, target) = exchange?;
        let out = Arc::new(Outbound::new(generation, token, self.config.pool_bytes));
        if let Some(old) = self.outbound.insert(peer.clone(), out) {
            old.remove_all();
        }
        Ok(target)
    }

    /// Receiver side of the handshake: checks the host and the probe, issues a token.
    pub(crate) async fn answer(&self, peer: &NodeId, mut send: SendStream, mut recv: RecvStream) {
        let verdict = async {
            let frame = read_frame(&mut recv, &HANDSHAKE_LIMITS)
                .await?
                .ok_or_else(|| ShmError::Handshake("stream closed before the offer".into()))?;
            let offer = frame.access_as::<ShmOffer>(FrameKind::Message)?;
            let own = self
                .host
                .filter(|_| self.config.enabled)
                .ok_or(ShmError::Handshake("disabled here".into()))?;
            if offer.host != own.0 {
                return Err(ShmError::Handshake("the offer comes from another host".into()));
            }
            let name = offer.probe.as_str().to_owned();
            tokio::task::spawn_blocking(move || read_probe(&name))
                .await
                .map_err(|e| ShmError::Handshake(format!("probe reader: {e}")))?
        }
        .await;
        let answer = match verdict.and_then(|nonce| Ok((nonce, random32()?))) {
            Ok((nonce, token)) => {
                self.inbound.insert(peer.clone(), token);
                ShmAnswer {
                    accepted: true,
                    token,
                    nonce,
                    reason: String::new(),
                    stream: self.stream_name.clone().unwrap_or_default(),
                }
            }
            Err(e) => {
                debug!(%peer, error = %e, "same-host path declined");
                ShmAnswer {
                    accepted: false,
                    token: [0; 32],
                    nonce: [0; 32],
                    reason: e.to_string(),
                    stream: String::new(),
                }
            }
        };
        if let Ok(frame) = Frame::encode(FrameKind::Message, &answer)
            && write_frame(&mut send, &frame).await.is_ok()
        {
            let _ = send.finish();
            let _ = send.stopped().await;
        }
    }

    /// Sends `frame`'s body through a segment when the path to `to` is open and the body is
    /// large enough; otherwise (or when writing the segment fails) returns the frame unchanged.
    /// With the frame to send comes the original once its body is in a segment: drop it after
    /// the reference is sent (freeing a 64 MiB heap buffer takes milliseconds, which the
    /// receiver can spend reading meanwhile). Fails only when the writer task died (taking the
    /// frame with it).
    pub(crate) async fn outgoing(
        &self,
        to: &NodeId,
        channel: Channel,
        frame: Frame,
    ) -> Result<(Frame, Option<Frame>), ShmError> {
        if channel == Channel::Control || frame.body.len() < self.config.min_bytes || is_shm(&frame) {
            return Ok((frame, None));
        }
        let Some(out) = self.outbound.get(to).map(|o| o.clone()) else { return Ok((frame, None)) };
        let (kind, flags, len) = (frame.kind, frame.flags, frame.body.len() as u64);
        // the frame moves into the writer and comes back, so a failure falls back to the stream
        let started = std::time::Instant::now();
        let writer = out.clone();
        let written = tokio::task::spawn_blocking(move || {
            let slot = writer.slot(len);
            let how = slot.counter();
            let seg = writer.write(slot, &frame.body);
            (frame, seg, how)
        })
        .await;
        let (frame, seg, how) = written.map_err(|e| ShmError::Task(e.to_string()))?;
        debug!(peer = %to, bytes = len, us = started.elapsed().as_micros() as u64, ?how, "segment written");
        match seg.and_then(|(name, warm)| {
            let r = Frame::encode(kind, &ShmRef { name, len });
            if let Some(warm) = warm {
                // back in the pool now: it is only reused once the receiver has marked it free
                out.give_back(warm);
            }
            Ok(r?)
        }) {
            Ok(mut reference) => {
                reference.flags = flags | FLAG_SHM;
                self.sent.fetch_add(1, Ordering::Relaxed);
                match how {
                    SlotKind::Reuse => self.sent_reused.fetch_add(1, Ordering::Relaxed),
                    SlotKind::OneShot => self.sent_one_shot.fetch_add(1, Ordering::Relaxed),
                    SlotKind::Grow => 0,
                };
                Ok((reference, Some(frame)))
            }
            Err(e) => {
                warn!(peer = %to, error = %e, "same-host segment failed; sending on the stream");
                Ok((frame, None))
            }
        }
    }

    /// Resolves a [`FLAG_SHM`] frame from `peer` into the original frame, under `limits`; its
    /// body is the segment mapped read-only, keeping `held` (the bytes charged against the
    /// peer's budget) until the last clone of that body is dropped.
    pub(crate) async fn incoming(
        &self,
        peer: &NodeId,
        frame: Frame,
        limits: &FrameLimits,
        held: Held,
    ) -> Result<Frame, ShmError> {
        let result = self.resolve(peer, &frame, limits, held).await;
        match &result {
            Ok(_) => self.received.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.refused.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    async fn resolve(
        &self,
        peer: &NodeId,
        frame: &Frame,
        limits: &FrameLimits,
        held: Held,
    ) -> Result<Frame, ShmError> {
        let reference = frame.access::<ShmRef>()?;
        let name = reference.name.as_str().to_owned();
        validate_name(&name)?;
        let len = reference.len.to_native();
        if len > u64::from(limits.max_body) {
            return Err(ShmError::TooLong { len, max: u64::from(limits.max_body) });
        }
        let token = match self.inbound.get(peer) {
            Some(t) if self.config.enabled => *t,
            _ => return Err(ShmError::NotOffered(peer.clone())),
        };
        let started = std::time::Instant::now();
        let live = self.mapped.clone();
        let body = tokio::task::spawn_blocking(move || map_segment(&name, len, &token, held, &live))
            .await
            .map_err(|e| ShmError::Task(e.to_string()))??;
        debug!(%peer, bytes = len, us = started.elapsed().as_micros() as u64, "segment mapped");
        Ok(Frame { kind: frame.kind, flags: frame.flags & !FLAG_SHM, body: Body::mapped(body) })
    }

    /// Connection `generation` to `peer` ended: stop sending through segments on it and remove
    /// the ones it never consumed.
    pub(crate) fn connection_closed(&self, peer: &NodeId, generation: u64) {
        if let Some((_, out)) = self.outbound.remove_if(peer, |_, o| o.generation == generation) {
            out.remove_all();
        }
    }

    /// Removes every segment still pending (node shutdown).
    pub(crate) fn close_all(&self) {
        for e in self.outbound.iter() {
            e.value().remove_all();
        }
        self.outbound.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_strictly() {
        let good = new_name().unwrap();
        validate_name(&good).unwrap();
        for (bad, why) in [
            ("../../etc/passwd", "path traversal"),
            ("troupe-shm-1-../../../etc/shadow", "path traversal"),
            ("troupe-shm-12/0123456789abcdef0123456789abcdef", "path traversal"),
            ("other-1-0123456789abcdef0123456789abcdef", "does not start"),
            ("troupe-shm--0123456789abcdef0123456789abcdef", "pid field"),
            ("troupe-shm-1-0123456789ABCDEF0123456789abcdef", "hex"),
            ("troupe-shm-1-0123", "hex"),
            ("troupe-shm-12345678901-0123456789abcdef0123456789abcdef", "too long"),
        ] {
            let e = validate_name(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn segment_round_trip_checks_token_and_is_consumed() {
        let token = random32().unwrap();
        let body: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let seg = write_segment(KIND_BODY, &token, &body).unwrap();
        let meta = std::fs::metadata(&seg.path).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        // a wrong token is refused and the segment stays for its rightful reader
        let e = receive(&seg.name, body.len(), &[9; 32]).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        assert!(seg.path.exists());
        // a wrong length is refused
        let e = receive(&seg.name, 5, &token).unwrap_err();
        assert!(e.to_string().contains("announced"), "{e}");
        let got = receive(&seg.name, body.len(), &token).unwrap();
        assert!(!seg.path.exists(), "consumed segments are unlinked at open");
        assert_eq!(got.bytes(), &body[..], "the mapping outlives the name");
        assert_eq!(got.bytes().as_ptr() as usize % 16, 0, "rkyv needs 16-byte alignment");
    }

    /// Maps `name` as the receiver of the peer holding `token` does.
    fn receive(name: &str, len: usize, token: &[u8; 32]) -> Result<MappedBody, ShmError> {
        map_segment(name, len as u64, token, Held::default(), &Arc::new(AtomicU64::new(0)))
    }

    #[test]
    fn a_warm_segment_is_reused_and_never_readable_by_a_second_peer() {
        let (a, b) = (random32().unwrap(), random32().unwrap());
        let out = Outbound::new(1, a, DEFAULT_POOL_BYTES);
        let first: Vec<u8> = (0..200_000u32).map(|i| (i * 3) as u8).collect();
        let (name, warm) = out.write(out.slot(first.len() as u64), &first).unwrap();
        out.give_back(warm.expect("a pooled segment"));
        // busy until its receiver read it: the next body gets another segment
        let (other, warm2) = out.write(out.slot(first.len() as u64), &first).unwrap();
        assert_ne!(name, other);
        out.give_back(warm2.unwrap());
        // another peer (token b) naming it is refused and leaves it ready for its rightful reader
        let e = receive(&name, first.len(), &b).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        assert_eq!(receive(&name, first.len(), &a).unwrap().bytes(), &first[..]);
        // read once only: a replayed reference is refused, and the file stays for reuse
        let e = receive(&name, first.len(), &a).unwrap_err();
        assert!(e.to_string().contains("not marked ready"), "{e}");
        assert!(Path::new(SHM_DIR).join(&name).exists());
        // the freed segment is rewritten for the next body; peer b still cannot read it
        let second: Vec<u8> = (0..150_000u32).map(|i| (i * 11) as u8).collect();
        let (again, warm) = out.write(out.slot(second.len() as u64), &second).unwrap();
        assert_eq!(again, name, "the freed warm segment was not reused");
        out.give_back(warm.unwrap());
        let e = receive(&name, second.len(), &b).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        assert_eq!(receive(&name, second.len(), &a).unwrap().bytes(), &second[..]);
        out.remove_all();
        assert!(!Path::new(SHM_DIR).join(&name).exists());
        assert!(!Path::new(SHM_DIR).join(&other).exists());
    }

    #[test]
    fn a_held_mapping_keeps_its_segment_and_its_charge_until_dropped() {
        let token = random32().unwrap();
        let first: Vec<u8> = (0..200_000u32).map(|i| (i * 5) as u8).collect();
        let second: Vec<u8> = (0..200_000u32).map(|i| (i * 13 + 1) as u8).collect();
        let len = first.len() as u64;
        // room for exactly one warm segment
        let out = Outbound::new(1, token, len);
        let (name, warm) = out.write(out.slot(len), &first).unwrap();
        out.give_back(warm.expect("a pooled segment"));
        let budget = crate::budget::ConnBudget::new("peer-m", 1 << 20);
        let mut charge = budget.frame();
        charge.grow_to(len).unwrap();
        let live = Arc::new(AtomicU64::new(0));
        let held = map_segment(&name, len, &token, charge.into_held(), &live).unwrap();
        assert_eq!((live.load(Ordering::Acquire), budget.held()), (1, len));
        // while it is mapped the sender may not rewrite it: the next body goes one-shot
        let slot = out.slot(len);
        assert!(matches!(slot, Slot::OneShot), "a held segment was offered for reuse");
        let (other, warm) = out.write(slot, &second).unwrap();
        assert!(warm.is_none());
        assert_ne!(other, name);
        assert_eq!(receive(&other, second.len(), &token).unwrap().bytes(), &second[..]);
        assert_eq!(held.bytes(), &first[..], "the held body changed under its reader");
        // dropping it frees the segment (for reuse) and the charge
        drop(held);
        assert_eq!((live.load(Ordering::Acquire), budget.held()), (0, 0));
        let slot = out.slot(len);
        assert!(matches!(slot, Slot::Reuse(_)), "the dropped mapping did not free its segment");
        let (again, warm) = out.write(slot, &second).unwrap();
        out.give_back(warm.unwrap());
        assert_eq!(again, name);
        assert_eq!(receive(&name, second.len(), &token).unwrap().bytes(), &second[..]);
        out.remove_all();
        assert!(!Path::new(SHM_DIR).join(&name).exists());
    }

    #[test]
    fn the_pool_stays_within_its_cap() {
        let token = random32().unwrap();
        let body = vec![5u8; 100_000];
        let cap = 350_000;
        let out = Outbound::new(1, token, cap);
        let mut names = Vec::new();
        // nothing is read, so every body needs a segment of its own: three warm, then one-shot
        for _ in 0..6 {
            let (name, warm) = out.write(out.slot(body.len() as u64), &body).unwrap();
            if let Some(w) = warm {
                out.give_back(w);
            }
            assert!(out.pool_bytes() <= cap, "pool holds {} of {cap}", out.pool_bytes());
            names.push(name);
        }
        assert_eq!(out.pool_bytes(), 300_000);
        for name in &names {
            assert_eq!(receive(name, body.len(), &token).unwrap().bytes(), &body[..]);
        }
        // one-shot segments were consumed; warm ones stay for reuse
        let left = names.iter().filter(|n| Path::new(SHM_DIR).join(n).exists()).count();
        assert_eq!(left, 3);
        // a larger body evicts free warm segments that do not fit instead of growing past the cap
        let big = vec![9u8; 300_000];
        let (name, warm) = out.write(out.slot(big.len() as u64), &big).unwrap();
        assert!(warm.is_some(), "room was not made for the larger body");
        out.give_back(warm.unwrap());
        assert!(out.pool_bytes() <= cap, "pool holds {} of {cap}", out.pool_bytes());
        assert_eq!(receive(&name, big.len(), &token).unwrap().bytes(), &big[..]);
        out.remove_all();
        assert!(names.iter().chain([&name]).all(|n| !Path::new(SHM_DIR).join(n).exists()));
    }

    #[test]
    fn a_zero_cap_keeps_one_shot_segments() {
        let token = random32().unwrap();
        let out = Outbound::new(1, token, 0);
        let (name, warm) = out.write(out.slot(70_000), &[1u8; 70_000]).unwrap();
        assert!(warm.is_none());
        receive(&name, 70_000, &token).unwrap();
        assert!(!Path::new(SHM_DIR).join(&name).exists(), "one-shot segments are unlinked when read");
    }

    #[test]
    fn start_up_sweep_removes_segments_of_dead_processes_only() {
        // a pid that no process has right now (pid_max is at most 2^22)
        let dead =
            (4_000_000u32..4_194_304).find(|p| !Path::new("/proc").join(p.to_string()).exists()).unwrap();
        let hex = "00112233445566778899aabbccddeeff";
        let stale = Path::new(SHM_DIR).join(format!("{SEGMENT_PREFIX}{dead}-{hex}"));
        let live = Path::new(SHM_DIR).join(format!("{SEGMENT_PREFIX}1-{hex}"));
        std::fs::write(&stale, b"left by a crashed sender").unwrap();
        std::fs::write(&live, b"pid 1 is alive").unwrap();
        assert!(sweep_stale() >= 1);
        let live_kept = live.exists();
        let _ = std::fs::remove_file(&live);
        assert!(!stale.exists(), "the dead process's segment was not removed");
        assert!(live_kept, "a live process's segment was removed");
    }

    #[test]
    fn symlinks_and_foreign_modes_are_refused() {
        let name = new_name().unwrap();
        let path = Path::new(SHM_DIR).join(&name);
        std::os::unix::fs::symlink("/etc/hostname", &path).unwrap();
        let e = receive(&name, 1, &[0; 32]).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("open"), "{e}");
        let name = new_name().unwrap();
        let path = Path::new(SHM_DIR).join(&name);
        std::fs::write(&path, header(KIND_BODY, &[0; 32], 0)).unwrap();
        let mut perm = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o644);
        std::fs::set_permissions(&path, perm).unwrap();
        let e = receive(&name, 0, &[0; 32]).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("mode 644"), "{e}");
    }
}
