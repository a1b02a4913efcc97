//! Payloads by reference: content-addressed blobs (blake3) and the messages that move them.
//!
//! A frame whose body is larger than [`BlobPolicy::by_reference_above`] is sent as a small
//! [`BlobRef`] (same kind, [`FLAG_BY_REFERENCE`] set) while its body goes into the sender's
//! [`BlobStore`]; the receiver pulls it with a [`BlobRequest`], gets a [`FrameKind::BlobData`]
//! frame back, verifies the hash of what arrived before caching it, and rebuilds the original
//! frame. A blob that is already cached (a model shard, a repeated prompt) is never pulled
//! twice. Everything here is pure bookkeeping; the QUIC streams that carry pulls live elsewhere.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rkyv::ser::{Allocator, Writer};
use rkyv::util::AlignedVec;
use rkyv::vec::{ArchivedVec, VecResolver};
use rkyv::{Archive, Deserialize, Place, Serialize};

use crate::frame::{DEFAULT_MAX_BODY, FLAG_BY_REFERENCE, Frame, FrameError, FrameKind};

/// Default size above which a frame body travels by reference.
pub const DEFAULT_BY_REFERENCE_ABOVE: usize = 1 << 20;
/// Default cap on one blob in a [`BlobStore`] (a cached file larger than this is refused).
pub const DEFAULT_MAX_BLOB_BYTES: u64 = 1 << 30;
/// Room a [`BlobData`] body needs besides the blob's bytes (id, vector header, alignment).
pub const BLOB_DATA_OVERHEAD: u64 = 64;
/// Default cap on a pulled blob: the largest that fits one [`BlobData`] frame of the default
/// frame cap (a larger one would need chunked pulls, which this protocol version lacks).
pub const DEFAULT_MAX_PULL_BYTES: u64 = DEFAULT_MAX_BODY as u64 - BLOB_DATA_OVERHEAD;

/// A blob's identity: the blake3 hash of its bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(pub [u8; 32]);

impl BlobId {
    /// The id of some bytes.
    pub fn of(bytes: &[u8]) -> Self {
        Self(*blake3::hash(bytes).as_bytes())
    }

    /// Lower-case hex (64 characters): also the blob's file name in a disk cache.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Option<Self> {
        blake3::Hash::from_hex(s).ok().map(|h| Self(*h.as_bytes()))
    }
}

impl fmt::Display for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for BlobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlobId({})", &self.to_hex()[..16])
    }
}

/// Sent inline instead of a large body (frame flag [`FLAG_BY_REFERENCE`]).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct BlobRef {
    /// blake3 hash of the body.
    pub id: [u8; 32],
    /// Length of the body in bytes.
    pub len: u64,
}

impl BlobRef {
    /// The referenced blob's id.
    pub fn blob_id(&self) -> BlobId {
        BlobId(self.id)
    }
}

/// Asks a peer for a blob's bytes (a [`FrameKind::BlobRequest`] body).
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct BlobRequest {
    /// blake3 hash of the wanted blob.
    pub id: [u8; 32],
}

/// A blob's bytes (a [`FrameKind::BlobData`] body).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[rkyv(derive(Debug))]
pub struct BlobData {
    /// blake3 hash the sender claims for `bytes` (the receiver checks it).
    pub id: [u8; 32],
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// When frames travel by reference, and how large a pulled blob may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlobPolicy {
    /// Bodies strictly larger than this are sent as a [`BlobRef`].
    pub by_reference_above: usize,
    /// Largest blob a receiver agrees to pull; keep it within the frame cap minus
    /// [`BLOB_DATA_OVERHEAD`], since one [`BlobData`] frame carries the whole blob.
    pub max_blob_bytes: u64,
}

impl Default for BlobPolicy {
    fn default() -> Self {
        Self { by_reference_above: DEFAULT_BY_REFERENCE_ABOVE, max_blob_bytes: DEFAULT_MAX_PULL_BYTES }
    }
}

impl BlobPolicy {
    /// True when a body of `len` bytes should travel by reference.
    pub fn by_reference(&self, len: usize) -> bool {
        len > self.by_reference_above
    }
}

/// Why a blob operation failed; each variant names the blob or file.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// A disk cache file could not be read or written.
    #[error("blob cache file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A disk cache file does not hash to its name.
    #[error("blob cache file {path} is corrupt: its content hashes to {actual}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The hash of what is in it.
        actual: BlobId,
    },
    /// Received bytes do not hash to the id they were requested by.
    #[error("blob {expected} failed verification: the bytes hash to {actual}")]
    HashMismatch {
        /// The id asked for.
        expected: BlobId,
        /// The hash of what arrived.
        actual: BlobId,
    },
    /// Received bytes have a different length than the reference announced.
    #[error("blob {id} has {got} bytes, the reference announced {expected}")]
    LengthMismatch {
        /// The blob.
        id: BlobId,
        /// Announced length.
        expected: u64,
        /// Received length.
        got: u64,
    },
    /// A peer answered with a different blob than the one asked for.
    #[error("asked for blob {expected}, the peer sent {got}")]
    WrongBlob {
        /// The id asked for.
        expected: BlobId,
        /// The id in the answer.
        got: BlobId,
    },
    /// A blob (announced, pulled or cached) is larger than the cap.
    #[error("blob {id} of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge {
        /// The blob.
        id: BlobId,
        /// Its length.
        len: u64,
        /// The cap.
        max: u64,
    },
    /// A blob larger than the whole memory budget, with no disk cache to hold it.
    #[error("blob {id} of {len} bytes exceeds the memory budget of {budget} bytes")]
    ExceedsBudget {
        /// The blob.
        id: BlobId,
        /// Its length.
        len: usize,
        /// The budget.
        budget: usize,
    },
    /// The store does not have the blob (never stored, or evicted with no disk copy).
    #[error("blob {0} not found")]
    NotFound(BlobId),
    /// A frame could not be built or read.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// Where a [`BlobStore`] keeps blobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlobStoreConfig {
    /// Bytes held in memory at most; least recently used blobs are evicted past it.
    pub memory_budget: usize,
    /// Optional write-through disk cache: one file per blob, named by its hex hash.
    pub disk_dir: Option<PathBuf>,
    /// Largest blob stored or read back from disk.
    pub max_blob_bytes: u64,
}

impl Default for BlobStoreConfig {
    fn default() -> Self {
        Self { memory_budget: 256 << 20, disk_dir: None, max_blob_bytes: DEFAULT_MAX_BLOB_BYTES }
    }
}

struct Entry {
    bytes: Arc<[u8]>,
    last_used: u64,
}

/// Content-addressed blobs in memory (byte budget, LRU eviction) with an optional disk cache
/// whose files are re-hashed on every read.
pub struct BlobStore {
    config: BlobStoreConfig,
    entries: HashMap<BlobId, Entry>,
    /// Use tick -> id, oldest first.
    lru: BTreeMap<u64, BlobId>,
    tick: u64,
    held: usize,
}

impl BlobStore {
    /// A store; creates the disk cache directory when one is configured.
    pub fn new(config: BlobStoreConfig) -> Result<Self, BlobError> {
        if let Some(dir) = &config.disk_dir {
            std::fs::create_dir_all(dir).map_err(|source| BlobError::Io { path: dir.clone(), source })?;
        }
        Ok(Self { config, entries: HashMap::new(), lru: BTreeMap::new(), tick: 0, held: 0 })
    }

    /// A memory-only store with the given byte budget.
    pub fn in_memory(memory_budget: usize) -> Self {
        Self {
            config: BlobStoreConfig { memory_budget, ..BlobStoreConfig::default() },
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            held: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BlobStoreConfig {
        &self.config
    }

    /// Bytes held in memory.
    pub fn held_bytes(&self) -> usize {
        self.held
    }

    /// Blobs held in memory.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is held in memory.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the blob is in memory (no disk lookup, no LRU update).
    pub fn in_memory_contains(&self, id: &BlobId) -> bool {
        self.entries.contains_key(id)
    }

    /// Whether the blob is in memory or has a file in the disk cache (not verified here).
    pub fn contains(&self, id: &BlobId) -> bool {
        self.entries.contains_key(id) || self.disk_path(id).is_some_and(|p| p.is_file())
    }

    /// Stores bytes under their hash and returns the id.
    pub fn put(&mut self, bytes: impl Into<Arc<[u8]>>) -> Result<BlobId, BlobError> {
        let bytes = bytes.into();
        let id = BlobId::of(&bytes);
        self.insert(id, bytes)?;
        Ok(id)
    }

    /// Stores bytes that must hash to `id` (pulled from a peer): a mismatch is an error and
    /// nothing is stored.
    pub fn put_verified(&mut self, id: BlobId, bytes: impl Into<Arc<[u8]>>) -> Result<(), BlobError> {
        let bytes = bytes.into();
        let actual = BlobId::of(&bytes);
        if actual != id {
            return Err(BlobError::HashMismatch { expected: id, actual });
        }
        self.insert(id, bytes)
    }

    /// The blob's bytes: from memory, else from the disk cache (re-hashed, then kept in memory).
    pub fn get(&mut self, id: &BlobId) -> Result<Option<Arc<[u8]>>, BlobError> {
        if let Some(e) = self.entries.get_mut(id) {
            self.tick += 1;
            self.lru.remove(&e.last_used);
            e.last_used = self.tick;
            self.lru.insert(self.tick, *id);
            return Ok(Some(e.bytes.clone()));
        }
        let Some(path) = self.disk_path(id) else {
            return Ok(None);
        };
        let Some(bytes) = read_verified(&path, id, self.config.max_blob_bytes)? else {
            return Ok(None);
        };
        let bytes: Arc<[u8]> = bytes.into();
        if bytes.len() <= self.config.memory_budget {
            self.insert_in_memory(*id, bytes.clone());
        }
        Ok(Some(bytes))
    }

    /// Drops a blob from memory and disk.
    pub fn remove(&mut self, id: &BlobId) -> Result<(), BlobError> {
        if let Some(e) = self.entries.remove(id) {
            self.lru.remove(&e.last_used);
            self.held -= e.bytes.len();
        }
        if let Some(path) = self.disk_path(id) {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(BlobError::Io { path, source }),
            }
        }
        Ok(())
    }

    fn insert(&mut self, id: BlobId, bytes: Arc<[u8]>) -> Result<(), BlobError> {
        let len = bytes.len() as u64;
        if len > self.config.max_blob_bytes {
            return Err(BlobError::TooLarge { id, len, max: self.config.max_blob_bytes });
        }
        if let Some(path) = self.disk_path(&id) {
            write_once(&path, &bytes)?;
        } else if bytes.len() > self.config.memory_budget {
            return Err(BlobError::ExceedsBudget { id, len: bytes.len(), budget: self.config.memory_budget });
        }
        if bytes.len() <= self.config.memory_budget {
            self.insert_in_memory(id, bytes);
        }
        Ok(())
    }

    fn insert_in_memory(&mut self, id: BlobId, bytes: Arc<[u8]>) {
        if let Some(old) = self.entries.remove(&id) {
            self.lru.remove(&old.last_used);
            self.held -= old.bytes.len();
        }
        while self.held + bytes.len() > self.config.memory_budget {
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&victim) {
                self.held -= e.bytes.len();
            }
        }
        self.tick += 1;
        self.held += bytes.len();
        self.lru.insert(self.tick, id);
        self.entries.insert(id, Entry { bytes, last_used: self.tick });
    }

    fn disk_path(&self, id: &BlobId) -> Option<PathBuf> {
        self.config.disk_dir.as_ref().map(|d| d.join(id.to_hex()))
    }
}

/// Writes a blob file unless it already exists (temporary file, then rename).
fn write_once(path: &Path, bytes: &[u8]) -> Result<(), BlobError> {
    if path.is_file() {
        return Ok(());
    }
    let io = |source| BlobError::Io { path: path.to_path_buf(), source };
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

/// Reads a cache file (capped at `max` bytes) and checks it hashes to `id`.
fn read_verified(path: &Path, id: &BlobId, max: u64) -> Result<Option<Vec<u8>>, BlobError> {
    let io = |source| BlobError::Io { path: path.to_path_buf(), source };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    let len = file.metadata().map_err(io)?.len();
    if len > max {
        return Err(BlobError::TooLarge { id: *id, len, max });
    }
    let mut bytes = Vec::with_capacity(len as usize);
    // Read at most max + 1 bytes, in case the file grew after the metadata call.
    file.take(max + 1).read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 > max {
        return Err(BlobError::TooLarge { id: *id, len: bytes.len() as u64, max });
    }
    let actual = BlobId::of(&bytes);
    if actual != *id {
        return Err(BlobError::Corrupt { path: path.to_path_buf(), actual });
    }
    Ok(Some(bytes))
}

/// Sender side: returns `frame` unchanged when small, else stores its body and returns a frame of
/// the same kind carrying a [`BlobRef`] with [`FLAG_BY_REFERENCE`] set.
pub fn prepare_outgoing(
    frame: Frame,
    policy: &BlobPolicy,
    store: &mut BlobStore,
) -> Result<Frame, BlobError> {
    if !policy.by_reference(frame.body.len()) {
        return Ok(frame);
    }
    let len = frame.body.len() as u64;
    let id = store.put(frame.body.as_slice())?;
    let mut reference = Frame::encode(frame.kind, &BlobRef { id: id.0, len })?;
    reference.flags = frame.flags | FLAG_BY_REFERENCE;
    Ok(reference)
}

/// What arrived, from the receiver's point of view.
#[derive(Debug)]
pub enum Incoming {
    /// An ordinary frame: use it.
    Ready(Frame),
    /// A by-reference frame: pull `reference` (unless cached), then [`rebuild_frame`].
    NeedsBlob {
        /// Kind of the original frame.
        kind: FrameKind,
        /// Flags of the original frame (without [`FLAG_BY_REFERENCE`]).
        flags: u16,
        /// The blob to pull.
        reference: BlobRef,
    },
}

/// Receiver side: passes ordinary frames through, reads the [`BlobRef`] of by-reference ones and
/// refuses references over the policy's cap.
pub fn classify_incoming(frame: Frame, policy: &BlobPolicy) -> Result<Incoming, BlobError> {
    if frame.flags & FLAG_BY_REFERENCE == 0 {
        return Ok(Incoming::Ready(frame));
    }
    let archived = frame.access::<BlobRef>()?;
    let reference = BlobRef { id: archived.id, len: archived.len.to_native() };
    if reference.len > policy.max_blob_bytes {
        return Err(BlobError::TooLarge {
            id: reference.blob_id(),
            len: reference.len,
            max: policy.max_blob_bytes,
        });
    }
    Ok(Incoming::NeedsBlob { kind: frame.kind, flags: frame.flags & !FLAG_BY_REFERENCE, reference })
}

/// The frame that asks a peer for a blob.
pub fn request_frame(id: BlobId) -> Result<Frame, BlobError> {
    Ok(Frame::encode(FrameKind::BlobRequest, &BlobRequest { id: id.0 })?)
}

/// Reads a [`FrameKind::BlobRequest`] frame.
pub fn parse_request(frame: &Frame) -> Result<BlobId, BlobError> {
    let req = frame.access_as::<BlobRequest>(FrameKind::BlobRequest)?;
    Ok(BlobId(req.id))
}

/// Serving side: answers a [`FrameKind::BlobRequest`] frame with a [`FrameKind::BlobData`] frame.
pub fn answer_request(request: &Frame, store: &mut BlobStore) -> Result<Frame, BlobError> {
    let id = parse_request(request)?;
    let bytes = store.get(&id)?.ok_or(BlobError::NotFound(id))?;
    data_frame(id, &bytes)
}

/// A [`FrameKind::BlobData`] frame carrying `bytes` (copied once, straight into the body).
pub fn data_frame(id: BlobId, bytes: &[u8]) -> Result<Frame, BlobError> {
    let mut body = AlignedVec::<16>::with_capacity(bytes.len() + BLOB_DATA_OVERHEAD as usize);
    body = rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(&BlobDataRef { id: id.0, bytes }, body)
        .map_err(|e| FrameError::Body { what: "BlobData", detail: e.to_string() })?;
    Ok(Frame { kind: FrameKind::BlobData, flags: 0, body: body.into() })
}

/// Serialises exactly like [`BlobData`] while borrowing the bytes.
struct BlobDataRef<'a> {
    id: [u8; 32],
    bytes: &'a [u8],
}

impl Archive for BlobDataRef<'_> {
    type Archived = ArchivedBlobData;
    type Resolver = VecResolver;

    fn resolve(&self, resolver: VecResolver, out: Place<ArchivedBlobData>) {
        // An exhaustive pattern: a field added to BlobData stops this from compiling.
        rkyv::munge::munge!(let ArchivedBlobData { id, bytes } = out);
        self.id.resolve([(); 32], id);
        ArchivedVec::resolve_from_slice(self.bytes, resolver, bytes);
    }
}

impl<S> Serialize<S> for BlobDataRef<'_>
where
    S: rkyv::rancor::Fallible + Allocator + Writer + ?Sized,
{
    fn serialize(&self, serializer: &mut S) -> Result<VecResolver, S::Error> {
        ArchivedVec::serialize_from_slice(self.bytes, serializer)
    }
}

/// Receiver side: checks a [`FrameKind::BlobData`] answer against the reference it was pulled
/// for (id, length, then the hash of the bytes) and caches it; returns the verified bytes.
pub fn accept_data(data: &Frame, expected: &BlobRef, store: &mut BlobStore) -> Result<Arc<[u8]>, BlobError> {
    let archived = data.access_as::<BlobData>(FrameKind::BlobData)?;
    let want = expected.blob_id();
    if archived.id != expected.id {
        return Err(BlobError::WrongBlob { expected: want, got: BlobId(archived.id) });
    }
    let got = archived.bytes.len() as u64;
    if got != expected.len {
        return Err(BlobError::LengthMismatch { id: want, expected: expected.len, got });
    }
    let bytes: Arc<[u8]> = archived.bytes.as_slice().into();
    store.put_verified(want, bytes.clone())?;
    Ok(bytes)
}

/// Receiver side: the original frame, from a reference's kind and flags and the verified bytes.
pub fn rebuild_frame(kind: FrameKind, flags: u16, bytes: &[u8]) -> Frame {
    let mut body = AlignedVec::<16>::with_capacity(bytes.len());
    body.extend_from_slice(bytes);
    Frame { kind, flags: flags & !FLAG_BY_REFERENCE, body: body.into() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{TensorEncodeOptions, decode_tensor, encode_tensor, smooth_activation};

    #[test]
    fn ids_are_blake3_and_print_as_hex() {
        let id = BlobId::of(b"abc");
        // blake3("abc") from the reference test vectors.
        assert_eq!(id.to_hex(), "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85");
        assert_eq!(id.to_string(), id.to_hex());
        assert_eq!(BlobId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(BlobId::from_hex("zz"), None);
    }

    #[test]
    fn verification_rejects_wrong_bytes() {
        let mut store = BlobStore::in_memory(1 << 20);
        let id = BlobId::of(b"the real bytes");
        let e = store.put_verified(id, &b"other bytes"[..]).unwrap_err();
        assert!(matches!(e, BlobError::HashMismatch { expected, .. } if expected == id));
        assert!(e.to_string().contains("failed verification"), "{e}");
        assert!(store.is_empty());
        store.put_verified(id, &b"the real bytes"[..]).unwrap();
        assert_eq!(&*store.get(&id).unwrap().unwrap(), b"the real bytes");
    }

    #[test]
    fn budget_evicts_least_recently_used() {
        let mut store = BlobStore::in_memory(300);
        let a = store.put(vec![1u8; 100]).unwrap();
        let b = store.put(vec![2u8; 100]).unwrap();
        let c = store.put(vec![3u8; 100]).unwrap();
        assert_eq!(store.held_bytes(), 300);
        // Touch a: b becomes the least recently used.
        assert!(store.get(&a).unwrap().is_some());
        let d = store.put(vec![4u8; 100]).unwrap();
        assert!(!store.in_memory_contains(&b), "b was least recently used");
        for id in [a, c, d] {
            assert!(store.in_memory_contains(&id));
        }
        assert_eq!(store.held_bytes(), 300);
        assert!(store.get(&b).unwrap().is_none());
        // A 250-byte blob evicts the two oldest (c then a) and keeps d.
        let e = store.put(vec![5u8; 250]).unwrap();
        assert!(store.in_memory_contains(&e) && !store.in_memory_contains(&d));
        assert!(!store.in_memory_contains(&a) && !store.in_memory_contains(&c));
        assert_eq!(store.held_bytes(), 250);
        // Re-putting the same bytes does not double count.
        store.put(vec![5u8; 250]).unwrap();
        assert_eq!((store.held_bytes(), store.len()), (250, 1));
        let e = store.put(vec![6u8; 301]).unwrap_err();
        assert!(matches!(e, BlobError::ExceedsBudget { len: 301, .. }), "{e}");
    }

    #[test]
    fn disk_cache_survives_eviction_and_detects_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = BlobStore::new(BlobStoreConfig {
            memory_budget: 150,
            disk_dir: Some(dir.path().to_path_buf()),
            max_blob_bytes: 1 << 20,
        })
        .unwrap();
        let a = store.put(vec![7u8; 100]).unwrap();
        let b = store.put(vec![8u8; 100]).unwrap();
        assert!(!store.in_memory_contains(&a), "evicted from memory");
        let path = dir.path().join(a.to_hex());
        assert!(path.is_file(), "written through to disk under its hex name");
        assert_eq!(&*store.get(&a).unwrap().unwrap(), &[7u8; 100][..]);
        assert!(!store.in_memory_contains(&b), "reloading a evicted b");
        // Larger than memory, kept on disk only.
        let big = store.put(vec![9u8; 1000]).unwrap();
        assert!(!store.in_memory_contains(&big));
        assert_eq!(store.get(&big).unwrap().unwrap().len(), 1000);

        // Corrupt b's file on disk: reading it back names the file.
        let b_path = dir.path().join(b.to_hex());
        let mut bytes = std::fs::read(&b_path).unwrap();
        bytes[10] ^= 1;
        std::fs::write(&b_path, &bytes).unwrap();
        let e = store.get(&b).unwrap_err();
        assert!(matches!(&e, BlobError::Corrupt { path, .. } if *path == b_path), "{e}");
        assert!(e.to_string().contains(&b.to_hex()), "{e}");

        // A fresh store over the same directory finds a, and still refuses b.
        let mut again = BlobStore::new(store.config().clone()).unwrap();
        assert!(again.contains(&a));
        assert_eq!(&*again.get(&a).unwrap().unwrap(), &[7u8; 100][..]);
        assert!(again.get(&b).is_err());
        again.remove(&a).unwrap();
        assert!(!again.contains(&a) && !path.exists());
        assert!(again.get(&BlobId::of(b"never stored")).unwrap().is_none());
    }

    #[test]
    fn oversized_cache_file_is_refused_before_reading() {
        let dir = tempfile::tempdir().unwrap();
        let id = BlobId::of(b"small");
        std::fs::write(dir.path().join(id.to_hex()), vec![0u8; 4096]).unwrap();
        let mut store = BlobStore::new(BlobStoreConfig {
            memory_budget: 1 << 20,
            disk_dir: Some(dir.path().to_path_buf()),
            max_blob_bytes: 1024,
        })
        .unwrap();
        let e = store.get(&id).unwrap_err();
        assert!(matches!(e, BlobError::TooLarge { len: 4096, max: 1024, .. }), "{e}");
    }

    #[test]
    fn a_big_tensor_travels_by_reference_and_is_verified() {
        let policy = BlobPolicy { by_reference_above: 64 << 10, ..Default::default() };
        let mut sender = BlobStore::in_memory(16 << 20);
        let mut receiver = BlobStore::in_memory(16 << 20);
        let data = smooth_activation(100_000);
        let (frame, _) = encode_tensor(&[100_000], &data, &TensorEncodeOptions::default()).unwrap();
        let original_len = frame.body.len();
        let out = prepare_outgoing(frame, &policy, &mut sender).unwrap();
        assert_eq!(out.flags & FLAG_BY_REFERENCE, FLAG_BY_REFERENCE);
        assert!(out.body.len() < 100, "only the reference travels inline");

        let Incoming::NeedsBlob { kind, flags, reference } = classify_incoming(out, &policy).unwrap() else {
            panic!("expected a reference");
        };
        assert_eq!((kind, flags, reference.len), (FrameKind::Tensor, 0, original_len as u64));
        let req = request_frame(reference.blob_id()).unwrap();
        let answer = answer_request(&req, &mut sender).unwrap();

        // Tampered answer: same id and length, different bytes.
        let mut tampered_bytes = sender.get(&reference.blob_id()).unwrap().unwrap().to_vec();
        tampered_bytes[500] ^= 0x10;
        let tampered =
            Frame::encode(FrameKind::BlobData, &BlobData { id: reference.id, bytes: tampered_bytes })
                .unwrap();
        let e = accept_data(&tampered, &reference, &mut receiver).unwrap_err();
        assert!(matches!(e, BlobError::HashMismatch { .. }), "{e}");
        assert!(!receiver.contains(&reference.blob_id()));

        let bytes = accept_data(&answer, &reference, &mut receiver).unwrap();
        assert!(receiver.contains(&reference.blob_id()));
        let rebuilt = rebuild_frame(kind, flags, &bytes);
        let back = decode_tensor(&rebuilt, &Default::default()).unwrap();
        assert_eq!(back.data, data);

        // Small frames pass through untouched.
        let small = Frame::from_bytes(FrameKind::Message, 0, &[1, 2, 3]);
        let out = prepare_outgoing(small, &policy, &mut sender).unwrap();
        assert!(matches!(classify_incoming(out, &policy).unwrap(), Incoming::Ready(f) if f.body.len() == 3));
    }

    #[test]
    fn borrowed_data_frame_matches_the_owned_type() {
        for len in [0usize, 3, 100, 5000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7) as u8).collect();
            let id = BlobId::of(&bytes);
            let owned =
                Frame::encode(FrameKind::BlobData, &BlobData { id: id.0, bytes: bytes.clone() }).unwrap();
            assert_eq!(data_frame(id, &bytes).unwrap().body.as_slice(), owned.body.as_slice());
        }
    }

    #[test]
    fn blob_data_overhead_covers_the_envelope() {
        for len in [0usize, 1, 15, 16, 17, 1000, 4096] {
            let f =
                Frame::encode(FrameKind::BlobData, &BlobData { id: [7; 32], bytes: vec![1; len] }).unwrap();
            assert!(f.body.len() as u64 <= len as u64 + BLOB_DATA_OVERHEAD, "{len}: {}", f.body.len());
        }
    }

    #[test]
    fn bad_answers_and_references_are_refused() {
        let policy = BlobPolicy { by_reference_above: 10, max_blob_bytes: 1000 };
        let mut store = BlobStore::in_memory(1 << 20);
        let reference = BlobRef { id: BlobId::of(b"wanted").0, len: 6 };
        let other = Frame::encode(
            FrameKind::BlobData,
            &BlobData { id: BlobId::of(b"other!").0, bytes: b"other!".to_vec() },
        )
        .unwrap();
        assert!(matches!(accept_data(&other, &reference, &mut store), Err(BlobError::WrongBlob { .. })));
        let short =
            Frame::encode(FrameKind::BlobData, &BlobData { id: reference.id, bytes: b"want".to_vec() })
                .unwrap();
        assert!(matches!(
            accept_data(&short, &reference, &mut store),
            Err(BlobError::LengthMismatch { expected: 6, got: 4, .. })
        ));
        let mut huge = Frame::encode(FrameKind::Tensor, &BlobRef { id: [0; 32], len: 5000 }).unwrap();
        huge.flags = FLAG_BY_REFERENCE;
        assert!(matches!(classify_incoming(huge, &policy), Err(BlobError::TooLarge { len: 5000, .. })));
        let req = request_frame(BlobId::of(b"absent")).unwrap();
        assert!(matches!(answer_request(&req, &mut store), Err(BlobError::NotFound(_))));
        let garbage = Frame::from_bytes(FrameKind::Tensor, FLAG_BY_REFERENCE, &[0xAB; 7]);
        assert!(matches!(classify_incoming(garbage, &policy), Err(BlobError::Frame(_))));
    }
}
