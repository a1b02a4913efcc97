//! The tiered weight store: blobs (expert weights, stage files) by id across three tiers.
//!
//! - **Disk**: every blob has a file `<dir>/<id>.blob`: a 4 KiB header (magic, length, blake3, id)
//!   then the data, zero-padded to 4 KiB so `O_DIRECT` reads stay aligned. Loads bypass the page cache.
//! - **Host**: a budgeted set of in-RAM copies.
//! - **Device**: a budgeted arena (a [`MemoryPool`] over device memory; on a CPU device, an arena in RAM).
//!
//! A blob is resident in at most one of device / host (tiers are exclusive, so budgets count each
//! byte once); disk always holds it. The blake3 checksum is verified on every load into a tier.
//! The store moves bytes and accounts for them; *which* blob to move is a policy's decision, so a
//! full tier is an error ([`KernelError::TierFull`]), never a silent eviction.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::cuda::{CudaDevice, CudaSlice};
use crate::device::Device;
use crate::direct_io::{DIRECT_ALIGN, ReadBytes, ReadMode, open_direct, read_range_with};
use crate::error::{KernelError, Result};
use crate::pool::{Allocation, MemoryPool, PoolStats};
use crate::reclaimer::free_later;
use crate::spare_buffers::SpareBuffers;

const MAGIC: &[u8; 8] = b"TRPBLOB1";
const HEADER: usize = DIRECT_ALIGN;
const MAX_ID: usize = 200;

/// A blob's id: 1-200 characters of `[A-Za-z0-9._-]`, not starting with a dot (it names a file).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobId(String);

impl BlobId {
    /// Validate an id.
    pub fn new(id: &str) -> Result<Self> {
        let ok = !id.is_empty()
            && id.len() <= MAX_ID
            && !id.starts_with('.')
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(KernelError::invalid(
                "BlobId",
                format!("{id:?} is not 1-{MAX_ID} chars of [A-Za-z0-9._-] (no leading dot)"),
            ));
        }
        Ok(Self(id.to_string()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for BlobId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where a blob's fastest copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// In the device arena.
    Device,
    /// In host RAM.
    Host,
    /// Only on disk.
    Disk,
}

/// Bytes moved along one path between tiers, and the time it took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Transfer {
    /// Number of moves.
    pub count: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time spent, including checksum verification.
    pub seconds: f64,
}

impl Transfer {
    /// Bandwidth in MB/s (10^6 bytes), 0 when nothing moved.
    pub fn mb_per_s(&self) -> f64 {
        if self.seconds > 0.0 { self.bytes as f64 / self.seconds / 1e6 } else { 0.0 }
    }

    fn record(&mut self, bytes: usize, since: Instant) {
        self.count += 1;
        self.bytes += bytes as u64;
        self.seconds += since.elapsed().as_secs_f64();
    }
}

/// Per-tier occupancy and traffic.
#[derive(Clone, Debug)]
pub struct StoreStats {
    /// Blob files written by `put`.
    pub disk_writes: Transfer,
    /// Disk -> host loads.
    pub disk_to_host: Transfer,
    /// Disk -> device loads (through a transient staging buffer).
    pub disk_to_device: Transfer,
    /// Host -> device promotions.
    pub host_to_device: Transfer,
    /// Device -> host evictions.
    pub device_to_host: Transfer,
    /// Host tier budget.
    pub host_budget: u64,
    /// Host tier bytes in use.
    pub host_used: u64,
    /// Device arena occupancy.
    pub device: PoolStats,
    /// Disk reads where the filesystem refused `O_DIRECT` (the page cache was used, then dropped).
    pub odirect_fallbacks: u64,
    /// Demotions that reused a spare host buffer instead of allocating one.
    pub spare_reuses: u64,
    /// Bytes of spare host buffers held now (within what the host tier leaves of its budget).
    pub spare_bytes: u64,
}

/// The device tier's traffic so far: [`StoreStats`]'s three device paths, read without the rest
/// (a load or eviction reads them before and after each move, so they must cost next to nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DeviceTraffic {
    /// Host -> device promotions.
    pub host_to_device: Transfer,
    /// Disk -> device loads.
    pub disk_to_device: Transfer,
    /// Device -> host demotions.
    pub device_to_host: Transfer,
}

impl StoreStats {
    /// Whether any disk read had to fall back to the page cache.
    pub fn odirect_refused(&self) -> bool {
        self.odirect_fallbacks > 0
    }
}

struct Entry {
    len: u64,
    hash: blake3::Hash,
    path: PathBuf,
    host: Option<Arc<ReadBytes>>,
    device: Option<Allocation>,
}

/// A device-resident blob's bytes in the arena (see [`WeightStore::device_bytes`]).
pub enum DeviceBytes<'a> {
    /// A host-memory arena: the bytes themselves.
    Host(&'a [u8]),
    /// A GPU arena: the buffer, and the blob's offset and length in it.
    Cuda {
        /// The arena's buffer.
        arena: &'a CudaSlice<u8>,
        /// Offset of the blob's first byte.
        offset: usize,
        /// The blob's length.
        len: usize,
    },
}

enum Arena {
    Host(Vec<u8>),
    Cuda(CudaDevice, CudaSlice<u8>),
}

/// The tiered weight store (see the module docs).
pub struct WeightStore {
    dir: PathBuf,
    entries: HashMap<BlobId, Entry>,
    pool: MemoryPool,
    arena: Arena,
    host_budget: u64,
    host_used: u64,
    /// Host buffers freed by promotions and host evictions, for the next demotion; they fill at
    /// most what the host tier leaves of its budget.
    spares: SpareBuffers,
    stats: StoreStats,
    /// Opens blob files with O_DIRECT (tests swap in one that refuses, like some filesystems do).
    open_direct: fn(&Path) -> std::io::Result<File>,
}

impl std::fmt::Debug for WeightStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightStore")
            .field("dir", &self.dir)
            .field("blobs", &self.entries.len())
            .field("host_used", &self.host_used)
            .field("device", &self.pool.stats())
            .finish()
    }
}

fn hex(h: &blake3::Hash) -> String {
    h.to_hex().to_string()
}

fn parse_header(path: &Path, h: &[u8], file_len: u64) -> Result<(BlobId, u64, blake3::Hash)> {
    let bad = |detail: String| KernelError::BadBlobFile { path: path.to_path_buf(), detail };
    if h.len() < HEADER || &h[..8] != MAGIC {
        return Err(bad("missing TRPBLOB1 magic".to_string()));
    }
    let mut len8 = [0u8; 8];
    len8.copy_from_slice(&h[8..16]);
    let len = u64::from_le_bytes(len8);
    let mut hash = [0u8; 32];
    hash.copy_from_slice(&h[16..48]);
    let id_len = usize::from(u16::from_le_bytes([h[48], h[49]]));
    if id_len == 0 || id_len > MAX_ID {
        return Err(bad(format!("id length {id_len} out of 1..={MAX_ID}")));
    }
    let id = std::str::from_utf8(&h[50..50 + id_len])
        .map_err(|_| bad("id is not UTF-8".to_string()))
        .and_then(|s| BlobId::new(s).map_err(|e| bad(e.to_string())))?;
    if len > file_len.saturating_sub(HEADER as u64) {
        return Err(bad(format!(
            "header says {len} data bytes, file has {}",
            file_len.saturating_sub(HEADER as u64)
        )));
    }
    Ok((id, len, blake3::Hash::from_bytes(hash)))
}

impl WeightStore {
    /// Open (or create) a store in `dir`, indexing the blob files already there. The device tier is
    /// an arena of `device_budget` bytes on `device`; the host tier may hold `host_budget` bytes.
    pub fn open(dir: &Path, device: &Device, device_budget: u64, host_budget: u64) -> Result<Self> {
        fs::create_dir_all(dir).map_err(|e| KernelError::io("creating store directory", dir, e))?;
        let pool = MemoryPool::new(format!("{} weights", device.name()), device_budget, 256)?;
        let arena_len = usize::try_from(pool.budget())
            .map_err(|_| KernelError::invalid("WeightStore::open", "device budget exceeds usize"))?;
        let arena = match device {
            Device::Cpu => Arena::Host(vec![0u8; arena_len]),
            Device::Cuda(d) => Arena::Cuda(d.clone(), d.alloc_bytes(arena_len)?),
        };
        let mut store = Self {
            dir: dir.to_path_buf(),
            entries: HashMap::new(),
            stats: StoreStats {
                disk_writes: Transfer::default(),
                disk_to_host: Transfer::default(),
                disk_to_device: Transfer::default(),
                host_to_device: Transfer::default(),
                device_to_host: Transfer::default(),
                host_budget,
                host_used: 0,
                device: pool.stats(),
                odirect_fallbacks: 0,
                spare_reuses: 0,
                spare_bytes: 0,
            },
            pool,
            arena,
            host_budget,
            host_used: 0,
            spares: SpareBuffers::default(),
            open_direct,
        };
        store.index()?;
        Ok(store)
    }

    fn index(&mut self) -> Result<()> {
        let rd = fs::read_dir(&self.dir).map_err(|e| KernelError::io("listing", &self.dir, e))?;
        for ent in rd {
            let path = ent.map_err(|e| KernelError::io("listing", &self.dir, e))?.path();
            if path.extension().and_then(|e| e.to_str()) != Some("blob") {
                continue;
            }
            let mut f = File::open(&path).map_err(|e| KernelError::io("opening", &path, e))?;
            let file_len = f.metadata().map_err(|e| KernelError::io("stat", &path, e))?.len();
            let mut h = vec![0u8; HEADER];
            f.read_exact(&mut h).map_err(|_| KernelError::BadBlobFile {
                path: path.clone(),
                detail: format!("shorter ({file_len} bytes) than the {HEADER}-byte header"),
            })?;
            let (id, len, hash) = parse_header(&path, &h, file_len)?;
            if path.file_stem().and_then(|s| s.to_str()) != Some(id.as_str()) {
                return Err(KernelError::BadBlobFile {
                    path,
                    detail: format!("header names blob {id}, file name differs"),
                });
            }
            self.entries.insert(id, Entry { len, hash, path, host: None, device: None });
        }
        Ok(())
    }

    fn entry(&self, id: &BlobId) -> Result<&Entry> {
        self.entries.get(id).ok_or_else(|| KernelError::UnknownBlob(id.to_string()))
    }

    /// Write `data` as blob `id` (replacing any blob of that id) and fsync it. Returns the id.
    pub fn put(&mut self, id: &str, data: &[u8]) -> Result<BlobId> {
        let id = BlobId::new(id)?;
        if self.entries.contains_key(&id) {
            self.remove(&id)?;
        }
        let start = Instant::now();
        let hash = blake3::hash(data);
        let path = self.dir.join(format!("{id}.blob"));
        let tmp = self.dir.join(format!(".{id}.tmp"));
        let mut header = vec![0u8; HEADER];
        header[..8].copy_from_slice(MAGIC);
        header[8..16].copy_from_slice(&(data.len() as u64).to_le_bytes());
        header[16..48].copy_from_slice(hash.as_bytes());
        header[48..50].copy_from_slice(&(id.0.len() as u16).to_le_bytes());
        header[50..50 + id.0.len()].copy_from_slice(id.0.as_bytes());
        let pad = data.len().div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN - data.len();
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
            f.write_all(&header)?;
            f.write_all(data)?;
            f.write_all(&vec![0u8; pad])?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| KernelError::io("writing blob", &path, e))?;
        self.stats.disk_writes.record(data.len(), start);
        self.entries
            .insert(id.clone(), Entry { len: data.len() as u64, hash, path, host: None, device: None });
        Ok(id)
    }

    /// Drop a blob from every tier, deleting its file.
    pub fn remove(&mut self, id: &BlobId) -> Result<()> {
        self.release_host(id)?;
        if let Some(a) = self.entries.get_mut(id).and_then(|e| e.device.take()) {
            self.pool.free(a)?;
        }
        let e = self.entries.remove(id).ok_or_else(|| KernelError::UnknownBlob(id.to_string()))?;
        fs::remove_file(&e.path).map_err(|err| KernelError::io("deleting blob", &e.path, err))
    }

    /// Ids of all blobs.
    pub fn ids(&self) -> Vec<BlobId> {
        let mut v: Vec<BlobId> = self.entries.keys().cloned().collect();
        v.sort();
        v
    }

    /// A blob's length in bytes.
    pub fn len_of(&self, id: &BlobId) -> Result<u64> {
        Ok(self.entry(id)?.len)
    }

    /// The fastest tier holding the blob.
    pub fn tier(&self, id: &BlobId) -> Result<Tier> {
        let e = self.entry(id)?;
        Ok(if e.device.is_some() {
            Tier::Device
        } else if e.host.is_some() {
            Tier::Host
        } else {
            Tier::Disk
        })
    }

    /// The blob's range in the device arena, when it is on the device.
    pub fn device_allocation(&self, id: &BlobId) -> Result<Option<Allocation>> {
        Ok(self.entry(id)?.device)
    }

    /// Where the device-resident blob's bytes lie now (they move when the arena is compacted, so
    /// ask again after any load). Errors when the blob is not in the device tier.
    pub fn device_bytes(&self, id: &BlobId) -> Result<DeviceBytes<'_>> {
        let e = self.entry(id)?;
        let a = e
            .device
            .ok_or_else(|| KernelError::invalid("device bytes", format!("blob {id} is not on the device")))?;
        let (offset, len) = (a.offset as usize, e.len as usize);
        match &self.arena {
            Arena::Host(buf) => Ok(DeviceBytes::Host(&buf[offset..offset + len])),
            Arena::Cuda(_, buf) => Ok(DeviceBytes::Cuda { arena: buf, offset, len }),
        }
    }

    /// The device arena's GPU buffer (None on a CPU device); blobs live at their allocation offsets.
    pub fn cuda_arena(&self) -> Option<&CudaSlice<u8>> {
        match &self.arena {
            Arena::Cuda(_, buf) => Some(buf),
            Arena::Host(_) => None,
        }
    }

    fn verify(&self, id: &BlobId, bytes: &[u8], source_tier: &'static str) -> Result<()> {
        self.check(id, bytes.len(), blake3::hash(bytes), source_tier)
    }

    fn check(&self, id: &BlobId, len: usize, got: blake3::Hash, source_tier: &'static str) -> Result<()> {
        let e = self.entry(id)?;
        if len as u64 != e.len || got != e.hash {
            return Err(KernelError::Corrupted {
                blob: id.to_string(),
                source_tier,
                expected: hex(&e.hash),
                actual: hex(&got),
            });
        }
        Ok(())
    }

    fn read_disk(&mut self, id: &BlobId) -> Result<ReadBytes> {
        let (path, len) = {
            let e = self.entry(id)?;
            (e.path.clone(), e.len)
        };
        let len = usize::try_from(len).map_err(|_| KernelError::invalid("load", "blob exceeds usize"))?;
        // The checksum is computed on a helper thread while the next block is read.
        let mut hasher = blake3::Hasher::new();
        let (bytes, mode) = read_range_with(&path, HEADER as u64, len, self.open_direct, &mut |p| {
            hasher.update(p);
        })?;
        if mode == ReadMode::BufferedFallback {
            if self.stats.odirect_fallbacks == 0 {
                tracing::warn!(
                    path = %path.display(),
                    "filesystem refused O_DIRECT: blob loads use buffered reads + fadvise(DONTNEED)"
                );
            }
            self.stats.odirect_fallbacks += 1;
        }
        self.check(id, bytes.len(), hasher.finalize(), "disk")?;
        Ok(bytes)
    }

    fn host_room(&self, id: &BlobId, need: u64) -> Result<()> {
        let available = self.host_budget - self.host_used;
        if need > available {
            return Err(KernelError::TierFull {
                tier: "host",
                blob: id.to_string(),
                needed: need,
                available,
                budget: self.host_budget,
            });
        }
        Ok(())
    }

    /// Make the blob host-resident (from disk, or moved down from the device) and return its bytes.
    pub fn load_to_host(&mut self, id: &BlobId) -> Result<Arc<ReadBytes>> {
        let e = self.entry(id)?;
        if let Some(h) = &e.host {
            return Ok(h.clone());
        }
        let (len, on_device) = (e.len, e.device.is_some());
        self.host_room(id, len)?;
        if on_device {
            // Room was checked, so this moves the blob to the host tier.
            self.evict(id)?;
            if let Some(h) = &self.entry(id)?.host {
                return Ok(h.clone());
            }
        }
        let start = Instant::now();
        let bytes = Arc::new(self.read_disk(id)?);
        self.stats.disk_to_host.record(bytes.len(), start);
        self.host_used += len;
        if let Some(e) = self.entries.get_mut(id) {
            e.host = Some(bytes.clone());
        }
        Ok(bytes)
    }

    /// Drop the blob's host copy; its buffer becomes a spare unless a reader still holds it.
    fn release_host(&mut self, id: &BlobId) -> Result<()> {
        let e = self.entries.get_mut(id).ok_or_else(|| KernelError::UnknownBlob(id.to_string()))?;
        if let Some(bytes) = e.host.take() {
            self.host_used -= e.len;
            if let Ok(bytes) = Arc::try_unwrap(bytes) {
                self.spares.put(bytes.into_buf(), self.host_budget - self.host_used);
            }
        }
        Ok(())
    }

    fn arena_write(&mut self, a: Allocation, data: &[u8]) -> Result<()> {
        let off = a.offset as usize;
        match &mut self.arena {
            Arena::Host(buf) => {
                buf[off..off + data.len()].copy_from_slice(data);
                Ok(())
            }
            Arena::Cuda(dev, buf) => {
                dev.write_bytes(buf, off, data)?;
                dev.sync()
            }
        }
    }

    fn arena_read(&self, a: Allocation, len: usize) -> Result<Vec<u8>> {
        let mut bytes = vec![0u8; len];
        self.arena_read_into(a, &mut bytes)?;
        Ok(bytes)
    }

    /// Copy `dst.len()` bytes at `a`'s offset of the arena into `dst`.
    fn arena_read_into(&self, a: Allocation, dst: &mut [u8]) -> Result<()> {
        let off = a.offset as usize;
        match &self.arena {
            Arena::Host(buf) => {
                dst.copy_from_slice(&buf[off..off + dst.len()]);
                Ok(())
            }
            Arena::Cuda(dev, buf) => dev.read_bytes_into(buf, off, dst),
        }
    }

    /// Move the blob into the device arena (from host, or from disk through a staging buffer).
    pub fn promote_to_device(&mut self, id: &BlobId) -> Result<Allocation> {
        let e = self.entry(id)?;
        if let Some(a) = e.device {
            return Ok(a);
        }
        let (len, host) = (e.len, e.host.clone());
        let alloc = self.pool.alloc(len).map_err(|err| match err {
            KernelError::OutOfMemory { free, largest_free, budget, .. } => KernelError::TierFull {
                tier: "device",
                blob: id.to_string(),
                needed: len,
                available: largest_free.min(free),
                budget,
            },
            other => other,
        })?;
        let start = Instant::now();
        let result = match &host {
            Some(bytes) => self.verify(id, bytes, "host").and_then(|()| self.arena_write(alloc, bytes)),
            None => self.read_disk(id).and_then(|bytes| {
                let written = self.arena_write(alloc, &bytes);
                // the staging buffer is unmapped off this thread (see `spare_buffers`)
                free_later(bytes.into_buf());
                written
            }),
        };
        if let Err(err) = result {
            self.pool.free(alloc)?;
            return Err(err);
        }
        let from_host = host.is_some();
        // The last reference to the host copy goes with release_host, so its buffer becomes a spare.
        drop(host);
        if from_host {
            self.stats.host_to_device.record(len as usize, start);
            self.release_host(id)?;
        } else {
            self.stats.disk_to_device.record(len as usize, start);
        }
        if let Some(e) = self.entries.get_mut(id) {
            e.device = Some(alloc);
        }
        Ok(alloc)
    }

    /// Whether a blob of `len` bytes fits in one free range of the device arena right now.
    pub fn device_can_fit(&self, len: u64) -> bool {
        self.pool.can_fit(len)
    }

    /// Re-place every device-resident blob contiguously from offset 0, in offset order, so the
    /// arena's free space becomes one range (the fix for external fragmentation: a blob that fits
    /// in the free bytes but in no single free range fits after this). Returns the bytes moved.
    pub fn compact_device(&mut self) -> Result<u64> {
        let mut live: Vec<(BlobId, Allocation)> =
            self.entries.iter().filter_map(|(id, e)| e.device.map(|a| (id.clone(), a))).collect();
        live.sort_by_key(|(_, a)| a.offset);
        let mut pool =
            MemoryPool::new(self.pool.label().to_string(), self.pool.budget(), self.pool.alignment())?;
        let mut moved = 0;
        for (id, old) in live {
            // One free range remains, at the end of what is placed: this lands at or below `old`.
            let new = pool.alloc(old.len)?;
            if new.offset != old.offset {
                self.arena_move(old, new.offset)?;
                moved += old.len;
            }
            if let Some(e) = self.entries.get_mut(&id) {
                e.device = Some(new);
            }
        }
        self.pool = pool;
        Ok(moved)
    }

    /// Copy `from`'s bytes to offset `to` of the arena (ranges may overlap).
    fn arena_move(&mut self, from: Allocation, to: u64) -> Result<()> {
        let (src, dst, len) = (from.offset as usize, to as usize, from.len as usize);
        match &mut self.arena {
            Arena::Host(buf) => {
                buf.copy_within(src..src + len, dst);
                Ok(())
            }
            Arena::Cuda(dev, buf) => {
                // Through the host: the ranges may overlap.
                let bytes = dev.read_bytes(buf, src, len)?;
                dev.write_bytes(buf, dst, &bytes)?;
                dev.sync()
            }
        }
    }

    /// Move the blob one tier down: device -> host (-> disk when the host tier is full), host -> disk.
    /// Returns the tier it now occupies. Bytes copied back from the device are checksummed.
    pub fn evict(&mut self, id: &BlobId) -> Result<Tier> {
        let e = self.entry(id)?;
        let len = e.len;
        if let Some(a) = e.device {
            if self.host_room(id, len).is_ok() {
                let start = Instant::now();
                let (mut buf, reused) = self.spares.take(len as usize)?;
                let copied = self
                    .arena_read_into(a, buf.as_mut_slice())
                    .and_then(|()| self.verify(id, &buf, "device"));
                if let Err(e) = copied {
                    self.spares.put(buf, self.host_budget - self.host_used);
                    return Err(e);
                }
                self.stats.spare_reuses += u64::from(reused);
                let host = Arc::new(ReadBytes::from_buf(buf));
                self.stats.device_to_host.record(len as usize, start);
                self.host_used += len;
                self.spares.trim(self.host_budget - self.host_used);
                self.pool.free(a)?;
                if let Some(e) = self.entries.get_mut(id) {
                    e.device = None;
                    e.host = Some(host);
                }
                return Ok(Tier::Host);
            }
            self.pool.free(a)?;
            if let Some(e) = self.entries.get_mut(id) {
                e.device = None;
            }
            return Ok(Tier::Disk);
        }
        self.release_host(id)?;
        Ok(Tier::Disk)
    }

    /// A copy of the blob's bytes from its fastest tier, checksum verified.
    pub fn read(&mut self, id: &BlobId) -> Result<Vec<u8>> {
        let e = self.entry(id)?;
        let len = e.len as usize;
        if let Some(a) = e.device {
            let bytes = self.arena_read(a, len)?;
            self.verify(id, &bytes, "device")?;
            return Ok(bytes);
        }
        if let Some(h) = &e.host {
            let bytes = h.to_vec();
            self.verify(id, &bytes, "host")?;
            return Ok(bytes);
        }
        Ok(self.read_disk(id)?.to_vec())
    }

    /// Path of the blob's file (benchmarks read it directly for comparison).
    pub fn path_of(&self, id: &BlobId) -> Result<&Path> {
        Ok(&self.entry(id)?.path)
    }

    /// Byte offset of the data inside each blob file.
    pub fn data_offset() -> u64 {
        HEADER as u64
    }

    /// The device tier's traffic so far, without [`Self::stats`]'s walk of the arena's free ranges.
    pub fn device_traffic(&self) -> DeviceTraffic {
        DeviceTraffic {
            host_to_device: self.stats.host_to_device,
            disk_to_device: self.stats.disk_to_device,
            device_to_host: self.stats.device_to_host,
        }
    }

    /// Bytes of the host tier in use now (what [`Self::stats`] reports as `host_used`).
    pub fn host_used(&self) -> u64 {
        self.host_used
    }

    /// Traffic and occupancy per tier.
    pub fn stats(&self) -> StoreStats {
        let mut s = self.stats.clone();
        s.host_used = self.host_used;
        s.host_budget = self.host_budget;
        s.device = self.pool.stats();
        s.spare_bytes = self.spares.bytes();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compaction_joins_the_free_ranges_and_keeps_the_bytes() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let mut s = WeightStore::open(dir.path(), &Device::Cpu, 4 * 4096, 0).unwrap();
        let blobs: Vec<(BlobId, Vec<u8>)> = (0..4u32)
            .map(|i| {
                let data: Vec<u8> = (0..4096u32).map(|j| ((j * 7 + i * 31) % 251) as u8).collect();
                (s.put(&format!("b{i}"), &data).unwrap(), data)
            })
            .collect();
        for (id, _) in &blobs {
            s.promote_to_device(id).unwrap();
        }
        // Free the first and third: 8 KiB free in two 4 KiB holes, so 8 KiB does not fit.
        s.evict(&blobs[0].0).unwrap();
        s.evict(&blobs[2].0).unwrap();
        assert!(!s.device_can_fit(8192));
        assert_eq!(s.compact_device().unwrap(), 8192, "both survivors move down");
        assert!(s.device_can_fit(8192));
        let st = s.stats().device;
        assert_eq!((st.free_blocks, st.largest_free_block, st.used), (1, 8192, 8192));
        for (id, data) in [&blobs[1], &blobs[3]] {
            assert_eq!(&s.read(id).unwrap(), data, "moved bytes are intact (checksummed)");
        }
        let big: Vec<u8> = vec![9; 8192];
        let id = s.put("big", &big).unwrap();
        s.promote_to_device(&id).unwrap();
        assert_eq!(s.read(&id).unwrap(), big);
    }

    #[test]
    fn refused_odirect_is_reported_in_stats() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let mut s = WeightStore::open(dir.path(), &Device::Cpu, 0, 1 << 20).unwrap();
        let data: Vec<u8> = (0..70_000u32).map(|i| (i % 241) as u8).collect();
        let id = s.put("fallback", &data).unwrap();
        // A filesystem that refuses O_DIRECT fails the open with EINVAL.
        s.open_direct = |_| Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        assert_eq!(&s.load_to_host(&id).unwrap()[..], &data[..]);
        assert_eq!(s.stats().odirect_fallbacks, 1);
        assert!(s.stats().odirect_refused());
        s.evict(&id).unwrap();
        s.open_direct = open_direct;
        s.load_to_host(&id).unwrap();
        assert_eq!(s.stats().odirect_fallbacks, 1, "a direct read does not count");
    }

    #[test]
    fn a_promotion_leaves_a_spare_that_the_next_demotion_reuses_within_the_host_budget() {
        let exe = std::env::current_exe().unwrap();
        let dir = tempfile::tempdir_in(exe.parent().unwrap()).unwrap();
        let mut s = WeightStore::open(dir.path(), &Device::Cpu, 64 * 1024, 24 * 1024).unwrap();
        let a: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let b: Vec<u8> = (0..9_000u32).map(|i| (i % 239) as u8).collect();
        let (ia, ib) = (s.put("a", &a).unwrap(), s.put("b", &b).unwrap());
        for id in [&ia, &ib] {
            s.promote_to_device(id).unwrap();
        }
        assert_eq!(s.evict(&ia).unwrap(), Tier::Host, "a demotion");
        assert_eq!(s.stats().spare_reuses, 0, "nothing to reuse yet");
        s.promote_to_device(&ia).unwrap();
        assert_eq!(s.stats().spare_bytes, 12_288, "a's host buffer is kept");
        // b rounds to the same three pages: a's old buffer takes b's bytes.
        assert_eq!(s.evict(&ib).unwrap(), Tier::Host);
        let st = s.stats();
        assert_eq!((st.spare_reuses, st.spare_bytes, st.host_used), (1, 0, 9_000));
        assert_eq!(s.read(&ib).unwrap(), b, "the reused buffer holds exactly b (checksummed)");
        assert_eq!(s.read(&ia).unwrap(), a);
        // Spares never hold more than the host tier leaves of its budget.
        s.promote_to_device(&ib).unwrap();
        assert_eq!(s.evict(&ia).unwrap(), Tier::Host);
        let st = s.stats();
        assert!(st.host_used + st.spare_bytes <= st.host_budget, "{st:?}");
        assert_eq!(s.read(&ia).unwrap(), a);
    }
}
