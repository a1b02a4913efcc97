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
//!    ~24 ms of page allocation here, more under reclaim). A pool that is full of segments not
//!    yet read falls back to one-shot segments. Each pool belongs to one connection's token: a
//!    reconnect gets a new token and a new pool, the old one is removed.
//! 4. **Receive.** The receiver validates the name strictly (fixed prefix, digits, 32 hex
//!    characters: no `/`, no `..`), checks the length against its frame cap *before* anything
//!    is opened or allocated, opens with `O_NOFOLLOW`, requires a regular file owned by its own
//!    uid with no group/other permission and exactly header + length bytes, checks the header's
//!    magic, token and length, unlinks it, then reads it into an aligned buffer (one copy). A
//!    pooled segment must also be marked ready; it is read the same way, then marked free (with
//!    the token checked first, so no other peer can free, read or replay it) and left in place.
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
//! not needed for a copy that never leaves the kernel.
//!
//! # Nothing leaks forever
//! The receiver unlinks each one-shot segment it consumes. The sender tracks the segments it
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
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};
use tracing::{debug, warn};

use crate::frame::{FLAG_SHM, Frame, FrameError, FrameKind, FrameLimits, read_frame, write_frame};
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
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self { enabled: true, min_bytes: DEFAULT_MIN_BYTES, pool_bytes: DEFAULT_POOL_BYTES }
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
fn random_bytes(buf: &mut [u8]) -> Result<(), ShmError> {
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
fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Opens, checks and reads segment `name` of `len` body bytes. The file must be a regular file
/// of our uid with mode 0600 and carry `token` and `kind`; it is unlinked (when `consume`) only
/// after those checks, so a segment meant for another connection is left alone. Where a body is
/// expected, a pooled segment is accepted too: it must be marked ready, is read in place and then
/// marked free for its sender to rewrite (never unlinked, never read twice).
fn read_segment(
    name: &str,
    len: u64,
    kind: u8,
    token: &[u8; 32],
    consume: bool,
) -> Result<AlignedVec<16>, ShmError> {
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
    let len = usize::try_from(len).map_err(|_| refused("length does not fit in memory".into()))?;
    let mut body = AlignedVec::<16>::with_capacity(len);
    advise_huge_pages(&mut body);
    let read = read_into_spare(&f, &mut body, len, SEGMENT_HEADER_LEN as u64).map_err(|e| io("read body", e));
    if pooled {
        // read or not, the sender may have it back: the token proved it is this peer's segment
        use std::os::unix::fs::FileExt;
        f.write_all_at(&STATE_FREE.to_le_bytes(), STATE_AT).map_err(|e| io("mark free", e))?;
    }
    read?;
    Ok(body)
}

fn pread_exact(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, offset)
}

/// Asks for transparent huge pages on the 2 MiB-aligned interior of `body`'s capacity: a fresh
/// 64 MiB buffer then costs 32 page faults instead of 16,384 (measured here: copying into fresh
/// 4 KiB pages runs at ~1.6 GB/s, into huge pages at ~4 GB/s). Best effort; small buffers skip it.
fn advise_huge_pages(body: &mut AlignedVec<16>) {
    const HUGE: usize = 2 << 20;
    let start = body.as_mut_ptr() as usize;
    let end = start + body.capacity();
    let (lo, hi) = (start.next_multiple_of(HUGE), end / HUGE * HUGE);
    if hi > lo {
        // SAFETY: [lo, hi) lies inside `body`'s allocation; MADV_HUGEPAGE only changes how the
        // kernel backs those pages, never their contents or validity.
        unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    }
}

/// Reads exactly `len` bytes at `offset` into `body`'s spare capacity (no zero-fill pass).
fn read_into_spare(f: &File, body: &mut AlignedVec<16>, len: usize, offset: u64) -> std::io::Result<()> {
    debug_assert!(body.is_empty() && body.capacity() >= len);
    let fd = f.as_raw_fd();
    let mut done = 0usize;
    while done < len {
        let at = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| std::io::Error::other("offset out of range"))?;
        // SAFETY: `body` has capacity for `len` bytes, so `ptr + done .. ptr + len` is writable
        // memory owned by `body`; pread writes at most `len - done` bytes there.
        let n = unsafe { libc::pread(fd, body.as_mut_ptr().add(done).cast(), len - done, at) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "segment shrank while read"));
        }
        done += n as usize;
    }
    // SAFETY: the loop above initialised all `len` bytes, and `len <= capacity`.
    unsafe { body.set_len(len) };
    Ok(())
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
    /// Maps all `len` bytes of `file` shared and writable, with its pages populated up front
    /// (MAP_POPULATE: the tmpfs pages are allocated and faulted here, once).
    fn new(file: &File, len: usize) -> std::io::Result<Self> {
        // SAFETY: a fresh mapping chosen by the kernel (addr NULL) of a file we own and sized to
        // `len` beforehand; nothing else in this process refers to that range.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| std::io::Error::other("mmap gave NULL"))?;
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
    /// Frames this node received through segments.
    pub received: u64,
    /// Segment frames this node refused.
    pub refused: u64,
}

/// A node's same-host state: its host identity, the paths it may send on, the tokens it issued.
pub struct ShmState {
    config: ShmConfig,
    host: Option<HostId>,
    outbound: DashMap<NodeId, Arc<Outbound>>,
    inbound: DashMap<NodeId, [u8; 32]>,
    sent: AtomicU64,
    received: AtomicU64,
    refused: AtomicU64,
}

impl ShmState {
    /// State for a node with `config`; removes stale segments of dead processes.
    pub fn new(config: ShmConfig) -> Self {
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
            outbound: DashMap::new(),
            inbound: DashMap::new(),
            sent: AtomicU64::new(0),
            received: AtomicU64::new(0),
            refused: AtomicU64::new(0),
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
            received: self.received.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// Whether this node offers the path at all.
    pub(crate) fn offers(&self) -> bool {
        self.config.enabled && self.host.is_some()
    }

    /// Sender side of the handshake on connection `generation` to `peer` (bi stream tagged `tag`).
    pub(crate) async fn offer(
        &self,
        conn: &Connection,
        peer: &NodeId,
        generation: u64,
        tag: u8,
    ) -> Result<(), ShmError> {
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
            Ok(answer.token)
        }
        .await;
        let _ = std::fs::remove_file(&probe.path);
        let token = exchange?;
        let out = Arc::new(Outbound::new(generation, token, self.config.pool_bytes));
        if let Some(old) = self.outbound.insert(peer.clone(), out) {
            old.remove_all();
        }
        Ok(())
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
            let nonce = tokio::task::spawn_blocking(move || {
                read_segment(&name, PROBE_LEN, KIND_PROBE, &[0; 32], false)
            })
            .await
            .map_err(|e| ShmError::Handshake(format!("probe reader: {e}")))??;
            <[u8; 32]>::try_from(nonce.as_slice())
                .map_err(|_| ShmError::Handshake("probe of wrong size".into()))
        }
        .await;
        let answer = match verdict.and_then(|nonce| Ok((nonce, random32()?))) {
            Ok((nonce, token)) => {
                self.inbound.insert(peer.clone(), token);
                ShmAnswer { accepted: true, token, nonce, reason: String::new() }
            }
            Err(e) => {
                debug!(%peer, error = %e, "same-host path declined");
                ShmAnswer { accepted: false, token: [0; 32], nonce: [0; 32], reason: e.to_string() }
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
    /// Fails only when the writer task died (taking the frame with it).
    pub(crate) async fn outgoing(
        &self,
        to: &NodeId,
        channel: Channel,
        frame: Frame,
    ) -> Result<Frame, ShmError> {
        if channel == Channel::Control || frame.body.len() < self.config.min_bytes || is_shm(&frame) {
            return Ok(frame);
        }
        let Some(out) = self.outbound.get(to).map(|o| o.clone()) else { return Ok(frame) };
        let (kind, flags, len) = (frame.kind, frame.flags, frame.body.len() as u64);
        // the frame moves into the writer and comes back, so a failure falls back to the stream
        let started = std::time::Instant::now();
        let writer = out.clone();
        let written = tokio::task::spawn_blocking(move || {
            let slot = writer.slot(len);
            let seg = writer.write(slot, &frame.body);
            (frame, seg)
        })
        .await;
        debug!(peer = %to, bytes = len, us = started.elapsed().as_micros() as u64, "segment written");
        let (frame, seg) = written.map_err(|e| ShmError::Task(e.to_string()))?;
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
                Ok(reference)
            }
            Err(e) => {
                warn!(peer = %to, error = %e, "same-host segment failed; sending on the stream");
                Ok(frame)
            }
        }
    }

    /// Resolves a [`FLAG_SHM`] frame from `peer` into the original frame, under `limits`.
    pub(crate) async fn incoming(
        &self,
        peer: &NodeId,
        frame: Frame,
        limits: &FrameLimits,
    ) -> Result<Frame, ShmError> {
        let result = self.resolve(peer, &frame, limits).await;
        match &result {
            Ok(_) => self.received.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.refused.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    async fn resolve(&self, peer: &NodeId, frame: &Frame, limits: &FrameLimits) -> Result<Frame, ShmError> {
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
        let body = tokio::task::spawn_blocking(move || read_segment(&name, len, KIND_BODY, &token, true))
            .await
            .map_err(|e| ShmError::Task(e.to_string()))??;
        debug!(%peer, bytes = len, us = started.elapsed().as_micros() as u64, "segment read");
        Ok(Frame { kind: frame.kind, flags: frame.flags & !FLAG_SHM, body })
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
        let e = read_segment(&seg.name, body.len() as u64, KIND_BODY, &[9; 32], true).unwrap_err();
        assert!(e.to_string().contains("token"), "{e}");
        assert!(seg.path.exists());
        // a wrong length is refused
        let e = read_segment(&seg.name, 5, KIND_BODY, &token, true).unwrap_err();
        assert!(e.to_string().contains("announced"), "{e}");
        let got = read_segment(&seg.name, body.len() as u64, KIND_BODY, &token, true).unwrap();
        assert_eq!(got.as_slice(), &body[..]);
        assert!(!seg.path.exists(), "consumed segments are unlinked");
    }

    /// Reads `name` as the receiver of the peer holding `token` does.
    fn receive(name: &str, len: usize, token: &[u8; 32]) -> Result<AlignedVec<16>, ShmError> {
        read_segment(name, len as u64, KIND_BODY, token, true)
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
        assert_eq!(receive(&name, first.len(), &a).unwrap().as_slice(), &first[..]);
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
        assert_eq!(receive(&name, second.len(), &a).unwrap().as_slice(), &second[..]);
        out.remove_all();
        assert!(!Path::new(SHM_DIR).join(&name).exists());
        assert!(!Path::new(SHM_DIR).join(&other).exists());
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
            assert_eq!(receive(name, body.len(), &token).unwrap().as_slice(), &body[..]);
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
        assert_eq!(receive(&name, big.len(), &token).unwrap().as_slice(), &big[..]);
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
        let e = read_segment(&name, 1, KIND_BODY, &[0; 32], true).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("open"), "{e}");
        let name = new_name().unwrap();
        let path = Path::new(SHM_DIR).join(&name);
        std::fs::write(&path, header(KIND_BODY, &[0; 32], 0)).unwrap();
        let mut perm = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o644);
        std::fs::set_permissions(&path, perm).unwrap();
        let e = read_segment(&name, 0, KIND_BODY, &[0; 32], true).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert!(e.to_string().contains("mode 644"), "{e}");
    }
}
