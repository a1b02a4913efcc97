//! The reuse cache of stem tokens (AdaSprite §3.3 on this V-MoE): during adaptation everything
//! before block 0's MoE is frozen, so the residual-stream tokens entering it
//! ([`VMoe::stem`]) are the same every epoch for a given (model's shared parts, image). Caching them
//! skips the patch embedding and block 0's attention, which dominate a step at 64 tokens.
//!
//! This module carries out decisions, it makes none: [`troupe_policy::adapt::reuse::ReuseCache`]
//! (importance with λ = 0.55, DRAM/disk tiers) says what is computed, reused, prefetched, kept in
//! memory, spilled to disk or dropped. Here:
//! - **Memory tier**: one arena of `budget` bytes allocated in the pool's [`crate::MemoryPool`] when
//!   the cache is enabled, so every cached byte is accounted and the pool budget holds; entries live
//!   inside it (the policy's DRAM budget is the arena's length, checked again here).
//! - **Disk tier**: [`SlotFile`]s (one per entry size) in a directory of its own (created fresh,
//!   removed on drop; written without fsync, as nothing in it must survive a crash), owned by one
//!   background thread that runs writes and reads in submission order, so a read always sees the
//!   write before it. Reads bypass the page cache; bytes read back are checked (length, BLAKE3 of
//!   the write); a bad entry is recomputed, never trusted.
//! - **Prefetch**: once a batch's stem is settled, the next batch's plan is made and its disk reads
//!   start on the background thread while the current step computes; the share of prefetch wall
//!   time that overlapped compute is measured ([`ReuseStats::prefetch_hidden_share`]).
//! - **Stall**: the wall time the step spends blocked waiting for disk reads (a prefetch that
//!   finished behind compute costs none; a read the step waits for costs its wait) is measured per
//!   cache ([`ReuseStats::stall_us`]) and for the whole process ([`io_stall_us`]), which a clock
//!   of CPU time adds to charge storage its time.
//! - **On demand** ([`ReuseSetup::on_demand`], a FoggyCache-like ablation): every entry on disk
//!   only, each reuse read while the step waits, nothing prefetched or kept in memory; decided by
//!   [`troupe_policy::adapt::storage::OnDemand`].
//! - **Throttle**: the disk thread can join a cgroup v1 blkio group before its first I/O
//!   ([`ReuseSetup::disk_thread_cgroup`]), so a storage read throttle slows its reads alone.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::Instant;

use troupe_policy::Micros;
use troupe_policy::adapt::ExpertId;
use troupe_policy::adapt::reuse::{
    DEFAULT_LAMBDA, ExpertBatch, OutputCandidate, Placement, ReuseAction, ReuseCache, ReuseConfig, Tier,
    TokenKey, TokenRequest,
};
use troupe_policy::adapt::storage::OnDemand;

use super::VMoeError;
use super::config::IMAGE_PIXELS;
use super::model::VMoe;
use crate::error::KernelError;
use crate::pool::{Allocation, MemoryPool};
use crate::slot_file::SlotFile;
use crate::tensor::Tensor;

/// How to set the cache up.
#[derive(Clone, Debug, PartialEq)]
pub struct ReuseSetup {
    /// Bytes of the pool carved for the memory tier.
    pub budget: u64,
    /// Most bytes of cached tokens on disk (data bytes; each blob file adds a 4 KiB header and
    /// pads to 4 KiB).
    pub disk_budget: u64,
    /// The disk tier lives in a fresh directory created under this one, removed when the cache drops.
    pub disk_parent: PathBuf,
    /// Residency threshold on importance (the paper's λ).
    pub lambda: f64,
    /// Entries no batch used for this many batches leave memory for disk (the policy's idle
    /// eviction on a clock of batches, so decisions do not depend on wall time).
    pub idle_batches: u64,
    /// FoggyCache-like: reuse without prefetch or residency (see the module docs).
    pub on_demand: bool,
    /// A cgroup v1 `tasks` file the disk thread writes its own thread id into before any I/O (the
    /// blkio group of a storage read throttle); the cache is refused when that write fails.
    pub disk_thread_cgroup: Option<PathBuf>,
}

/// One batch on the cache's logical clock (the policy's [`Micros`]).
const BATCH_TICK: u64 = 1000;

impl ReuseSetup {
    /// `budget` bytes in memory, `disk_budget` on disk under `disk_parent`, λ = 0.55, entries idle
    /// for 4 batches leave memory.
    pub fn new(budget: u64, disk_budget: u64, disk_parent: &Path) -> Self {
        Self {
            budget,
            disk_budget,
            disk_parent: disk_parent.to_path_buf(),
            lambda: DEFAULT_LAMBDA,
            idle_batches: 4,
            on_demand: false,
            disk_thread_cgroup: None,
        }
    }
}

/// What the cache did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReuseStats {
    /// Images whose stem tokens were served from the cache (memory or prefetched from disk).
    pub hits: u64,
    /// Images whose stem tokens were computed.
    pub misses: u64,
    /// Entries written to the disk tier.
    pub spilled: u64,
    /// Entries read back from disk into memory (on demand: read while the step waits).
    pub prefetched: u64,
    /// Of those, reads whose bytes failed a check (length, checksum, I/O) and were recomputed.
    pub bad_reads: u64,
    /// Wall time of all prefetch reads, microseconds.
    pub prefetch_us: u64,
    /// Of it, the time a step was computing at the same moment.
    pub prefetch_hidden_us: u64,
    /// `prefetch_hidden_us / prefetch_us` (0 when nothing was prefetched).
    pub prefetch_hidden_share: f64,
    /// Wall time steps spent blocked waiting for disk reads, microseconds.
    pub stall_us: u64,
    /// Bytes held in the memory tier now.
    pub memory_bytes: u64,
    /// Bytes held on disk now (data bytes).
    pub disk_bytes: u64,
    /// The memory tier's budget (bytes carved from the pool).
    pub budget: u64,
    /// The disk tier's budget.
    pub disk_budget: u64,
}

/// Work for the disk thread, run in order.
enum DiskCmd {
    Put(Slot, Vec<u8>),
    /// Reads of slots (`None`: the key has no copy on disk, answered as a failed read).
    Read(Vec<(TokenKey, Option<Slot>)>, Sender<ReadDone>),
}

/// Where a disk copy lives: slot `index` of the slot file for entries of `len` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    len: usize,
    index: u32,
}

/// Which slot holds each disk copy. A copy the policy drops frees its slot, and the next spill of
/// the same size rewrites it in place, so the slot files span as many slots as copies were ever
/// live at once (freed ones holding stale bytes that nothing reads).
#[derive(Debug, Default)]
struct DiskSlots {
    of: BTreeMap<TokenKey, Slot>,
    /// Free slot indices per entry length.
    free: BTreeMap<usize, Vec<u32>>,
    /// Slots spanned per entry length.
    created: BTreeMap<usize, u32>,
}

impl DiskSlots {
    /// The slot of `key`'s copy of `len` bytes, assigning a free (or new) one.
    fn assign(&mut self, key: TokenKey, len: usize) -> Slot {
        if let Some(&s) = self.of.get(&key).filter(|s| s.len == len) {
            return s;
        }
        self.release(&key);
        let index = self.free.get_mut(&len).and_then(Vec::pop).unwrap_or_else(|| {
            let n = self.created.entry(len).or_default();
            *n += 1;
            *n - 1
        });
        let slot = Slot { len, index };
        self.of.insert(key, slot);
        slot
    }

    /// Frees `key`'s slot (its bytes stay for the next spill to overwrite).
    fn release(&mut self, key: &TokenKey) {
        if let Some(s) = self.of.remove(key) {
            self.free.entry(s.len).or_default().push(s.index);
        }
    }

    fn get(&self, key: &TokenKey) -> Option<Slot> {
        self.of.get(key).copied()
    }

    /// Slots spanned, over every entry length.
    fn spanned(&self) -> usize {
        self.created.values().map(|&n| n as usize).sum()
    }
}

/// Wall time, microseconds, every reuse cache of this process spent blocked on disk reads.
static IO_STALL_US: AtomicU64 = AtomicU64::new(0);

/// Wall time (microseconds) steps of this process have spent blocked waiting for reuse-cache disk
/// reads so far, over every cache; a CPU-time clock adds it so storage stalls cost time.
pub fn io_stall_us() -> u64 {
    IO_STALL_US.load(Ordering::Relaxed)
}

/// Writes the calling thread's id into the cgroup v1 `tasks` file `tasks` (it joins that group
/// alone; its process's other threads stay where they are).
fn join_cgroup(tasks: &Path) -> Result<(), String> {
    let me =
        std::fs::read_link("/proc/thread-self").map_err(|e| format!("reading /proc/thread-self: {e}"))?;
    let tid = me.file_name().map(|t| t.to_string_lossy().into_owned()).unwrap_or_default();
    std::fs::write(tasks, &tid).map_err(|e| format!("writing thread {tid} into {}: {e}", tasks.display()))
}

/// A finished batch of reads.
struct ReadDone {
    data: Vec<(TokenKey, Result<Vec<u8>, KernelError>)>,
    started: Instant,
    ended: Instant,
}

/// The name of the slot file for entries of `len` bytes.
pub fn slot_file_name(len: usize) -> String {
    format!("slots-{len}.bin")
}

/// The disk thread: owns the slot files (created in `dir` on first use); a failed write is kept
/// for the owner to report (the slot then reads as missing).
fn disk_worker(
    dir: PathBuf,
    rx: Receiver<DiskCmd>,
    cgroup: Option<PathBuf>,
    ready: Sender<Result<(), String>>,
) -> Result<(), KernelError> {
    let joined = cgroup.as_deref().map_or(Ok(()), join_cgroup);
    let failed = joined.is_err();
    let _ = ready.send(joined);
    if failed {
        return Ok(());
    }
    let mut files: BTreeMap<usize, SlotFile> = BTreeMap::new();
    let mut first_err = None;
    for cmd in rx {
        match cmd {
            DiskCmd::Put(slot, bytes) => {
                let file = match files.entry(slot.len) {
                    std::collections::btree_map::Entry::Occupied(o) => Ok(o.into_mut()),
                    std::collections::btree_map::Entry::Vacant(v) => {
                        SlotFile::create(&dir.join(slot_file_name(slot.len)), slot.len).map(|f| v.insert(f))
                    }
                };
                if let Err(e) = file.and_then(|f| f.write(slot.index, &bytes)) {
                    first_err.get_or_insert(e);
                }
            }
            DiskCmd::Read(slots, reply) => {
                let started = Instant::now();
                // A prefetched entry keeps its slot: the policy counts its clean disk copy until it
                // says `Evict { tier: Disk }`.
                let data = slots
                    .into_iter()
                    .map(|(k, slot)| {
                        let read = slot
                            .ok_or_else(|| KernelError::UnknownBlob(format!("no disk slot for {k:?}")))
                            .and_then(|s| {
                                files
                                    .get(&s.len)
                                    .ok_or_else(|| KernelError::UnknownBlob(slot_file_name(s.len)))?
                                    .read(s.index)
                            });
                        (k, read)
                    })
                    .collect();
                let _ = reply.send(ReadDone { data, started, ended: Instant::now() });
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// A batch whose plan the policy already made (prefetches in flight), for the step that runs it.
struct Planned {
    expert: ExpertId,
    keys: Vec<TokenKey>,
    hits: BTreeSet<TokenKey>,
}

/// The cache (see the module docs).
pub struct StemCache {
    policy: ReuseCache,
    arena: Allocation,
    memory: BTreeMap<TokenKey, Vec<f32>>,
    memory_bytes: u64,
    slots: DiskSlots,
    dir: PathBuf,
    disk: Option<Sender<DiskCmd>>,
    worker: Option<JoinHandle<Result<(), KernelError>>>,
    pending: Vec<Receiver<ReadDone>>,
    planned: Option<Planned>,
    on_demand: Option<OnDemand>,
    compute_spans: Vec<(Instant, Instant)>,
    /// Batches planned so far: the policy's clock.
    batches: u64,
    stats: ReuseStats,
}

impl std::fmt::Debug for StemCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StemCache").field("dir", &self.dir).field("stats", &self.stats).finish()
    }
}

/// The identity of a model's shared parts: blake3 over the pool's hashes of its shared tensors.
pub fn shared_identity(keys: &[[u8; 32]]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    keys.iter().for_each(|k| {
        h.update(k);
    });
    *h.finalize().as_bytes()
}

/// The cache key of one image under a model's shared identity: the expert slot names the shared
/// parts, the signature hashes the identity with the image's bytes (so two models share an entry
/// only when their shared parts are identical).
pub fn token_key(identity: &[u8; 32], image: &[f32]) -> TokenKey {
    let mut h = blake3::Hasher::new();
    h.update(identity);
    image.iter().for_each(|v| {
        h.update(&v.to_le_bytes());
    });
    let sig = h.finalize();
    let b = sig.as_bytes();
    let expert = ExpertId(u32::from_le_bytes([identity[0], identity[1], identity[2], identity[3]]));
    TokenKey { expert, sig: u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) }
}

/// Name prefix of a reuse cache's disk directory: then the owner's pid, `-`, a random part.
pub const DIR_PREFIX: &str = "troupe-reuse-";

/// Removes the disk directories under `parent` whose owner no longer runs (a killed process's
/// slot files would otherwise stay until the disk, or a tmpfs's memory, runs out); returns how
/// many. Liveness is judged by `/proc/<pid>`, so nothing is removed where `/proc` is not mounted;
/// a process of another pid namespace sharing `parent` would look dead (give each its own).
pub fn sweep_stale_dirs(parent: &Path) -> usize {
    if !Path::new("/proc/self").exists() {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    let me = std::process::id();
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let owner = name
                .to_str()
                .and_then(|n| n.strip_prefix(DIR_PREFIX))
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok());
            owner.is_some_and(|pid| {
                pid != me
                    && !Path::new("/proc").join(pid.to_string()).exists()
                    && std::fs::remove_dir_all(e.path()).is_ok()
            })
        })
        .count()
}

/// Microseconds from `a` to `b` (0 if `b` is earlier).
fn span_us(a: Instant, b: Instant) -> u64 {
    u64::try_from(b.saturating_duration_since(a).as_micros()).unwrap_or(u64::MAX)
}

/// f32 little-endian bytes of an entry read back from disk, checked against the expected length.
fn decode(bytes: &[u8], floats: usize) -> Option<Vec<f32>> {
    if bytes.len() != floats.checked_mul(4)? {
        return None;
    }
    Some(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The stem rows of images `idx` of `px` (one pass over them as a batch), by image index.
fn compute_rows(model: &VMoe, px: &[f32], idx: &[usize]) -> Result<Vec<(usize, Vec<f32>)>, VMoeError> {
    if idx.is_empty() {
        return Ok(Vec::new());
    }
    let floats = model.config.tokens_per_image() * model.config.dim;
    let sub: Vec<f32> =
        idx.iter().flat_map(|&i| &px[i * IMAGE_PIXELS..(i + 1) * IMAGE_PIXELS]).copied().collect();
    let computed = model.stem(&Tensor::from_f32(&[idx.len(), IMAGE_PIXELS], sub)?)?;
    Ok(idx.iter().copied().zip(computed.f32_cow().chunks_exact(floats).map(<[f32]>::to_vec)).collect())
}

impl StemCache {
    /// Carves `setup.budget` bytes from `pool` (refused, nothing taken, when they do not fit),
    /// creates the disk directory and starts the disk thread.
    pub fn new(pool: &mut MemoryPool, setup: &ReuseSetup) -> Result<Self, VMoeError> {
        Self::new_at(pool, setup, None)
    }

    /// [`Self::new`] with the arena at offset `at` of the pool (the lifespan-ordered layout puts it
    /// at the top end); `None`: wherever the pool's best fit puts it.
    pub fn new_at(pool: &mut MemoryPool, setup: &ReuseSetup, at: Option<u64>) -> Result<Self, VMoeError> {
        // A fresh name each time, past the owner's pid (a pid recurs: a killed process's
        // directory must not be taken for this one's); dead owners' directories go first.
        let prefix = format!("{DIR_PREFIX}{}-", std::process::id());
        let dir = std::fs::create_dir_all(&setup.disk_parent)
            .map(|()| sweep_stale_dirs(&setup.disk_parent))
            .and_then(|_| tempfile::Builder::new().prefix(&prefix).tempdir_in(&setup.disk_parent))
            .map(tempfile::TempDir::keep)
            .map_err(|source| VMoeError::Io {
                context: "creating under",
                path: setup.disk_parent.clone(),
                source,
            })?;
        let carved = match at {
            Some(o) => pool.alloc_at(o, setup.budget.max(1)),
            None => pool.alloc(setup.budget.max(1)),
        };
        let arena = match carved {
            Ok(a) => a,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e.into());
            }
        };
        let (tx, rx) = channel();
        let (ready_tx, ready) = channel();
        let worker_dir = dir.clone();
        let cgroup = setup.disk_thread_cgroup.clone();
        let worker = std::thread::spawn(move || disk_worker(worker_dir, rx, cgroup, ready_tx));
        if let Err(why) = ready.recv().unwrap_or_else(|_| Err("the disk thread stopped at start".into())) {
            let _ = worker.join();
            let _ = std::fs::remove_dir_all(&dir);
            pool.free(arena)?;
            return Err(VMoeError::Config(format!(
                "the reuse cache's disk thread cannot join the storage read throttle's cgroup: {why}"
            )));
        }
        let policy = ReuseCache::new(ReuseConfig {
            dram_budget: setup.budget,
            disk_budget: setup.disk_budget,
            lambda: setup.lambda,
            idle_after: Micros(setup.idle_batches.max(1) * BATCH_TICK),
            // Disk entries stay until the disk budget needs their room.
            disk_idle_after: Micros(u64::MAX / 2),
        });
        Ok(Self {
            policy,
            arena,
            memory: BTreeMap::new(),
            memory_bytes: 0,
            slots: DiskSlots::default(),
            dir,
            disk: Some(tx),
            worker: Some(worker),
            pending: Vec::new(),
            planned: None,
            on_demand: setup.on_demand.then(|| OnDemand::new(setup.disk_budget)),
            compute_spans: Vec::new(),
            batches: 0,
            stats: ReuseStats {
                budget: setup.budget,
                disk_budget: setup.disk_budget,
                ..ReuseStats::default()
            },
        })
    }

    /// The pool allocation holding the memory tier (freed by [`Self::release`]).
    pub fn arena(&self) -> Allocation {
        self.arena
    }

    /// The disk tier's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Disk slots: `(holding a disk copy now, spanned so far)`; the slot files span the latter.
    pub fn disk_slots(&self) -> (usize, usize) {
        (self.slots.of.len(), self.slots.spanned())
    }

    /// Figures so far.
    pub fn stats(&self) -> ReuseStats {
        let mut s = self.stats;
        s.memory_bytes = self.policy.dram_used();
        s.disk_bytes = self.policy.disk_used();
        s.prefetch_hidden_share =
            if s.prefetch_us == 0 { 0.0 } else { s.prefetch_hidden_us as f64 / s.prefetch_us as f64 };
        s
    }

    /// Bytes of tokens actually held in memory (always within the budget).
    pub fn memory_held(&self) -> u64 {
        self.memory_bytes
    }

    fn now(&self) -> Micros {
        Micros(self.batches * BATCH_TICK)
    }

    fn send(&self, cmd: DiskCmd) -> Result<(), VMoeError> {
        self.disk
            .as_ref()
            .and_then(|tx| tx.send(cmd).ok())
            .ok_or_else(|| VMoeError::Config("the reuse cache's disk thread has stopped".into()))
    }

    /// Waits until the disk thread has done everything sent to it so far (writes included).
    pub fn flush(&mut self) -> Result<(), VMoeError> {
        let (tx, rx) = channel();
        self.send(DiskCmd::Read(Vec::new(), tx))?;
        rx.recv()
            .map(|_| ())
            .map_err(|_| VMoeError::Config("the reuse cache's disk thread has stopped".into()))
    }

    /// Records a span of step compute (prefetches running meanwhile are hidden behind it).
    pub fn record_compute(&mut self, start: Instant, end: Instant) {
        if !self.pending.is_empty() {
            self.compute_spans.push((start, end));
        }
    }

    /// Waits for `rx`'s reads, the wait counted as stall (none when they are already done).
    fn wait_reads(&mut self, rx: &Receiver<ReadDone>) -> Result<ReadDone, VMoeError> {
        let t = Instant::now();
        let done =
            rx.recv().map_err(|_| VMoeError::Config("the reuse cache's disk thread has stopped".into()))?;
        let waited = span_us(t, Instant::now());
        self.stats.stall_us += waited;
        IO_STALL_US.fetch_add(waited, Ordering::Relaxed);
        Ok(done)
    }

    /// Waits for every prefetch in flight and moves its entries into memory.
    fn join_prefetches(&mut self, floats: usize) -> Result<(), VMoeError> {
        for rx in std::mem::take(&mut self.pending) {
            let done = self.wait_reads(&rx)?;
            let total = span_us(done.started, done.ended);
            let hidden: u64 = self
                .compute_spans
                .iter()
                .map(|&(a, b)| span_us(a.max(done.started), b.min(done.ended)))
                .sum();
            self.stats.prefetch_us += total;
            self.stats.prefetch_hidden_us += hidden.min(total);
            for (key, bytes) in done.data {
                match bytes.ok().and_then(|b| decode(&b, floats)) {
                    Some(v) => self.insert_memory(key, v)?,
                    // Recomputed by the step (the policy already counts it in memory); the policy
                    // drops the bad copy, which frees its slot for the next demotion to rewrite.
                    None => {
                        self.stats.bad_reads += 1;
                        self.policy.disk_copy_lost(&key);
                    }
                }
            }
        }
        self.compute_spans.clear();
        self.execute(&BTreeMap::new())
    }

    fn insert_memory(&mut self, key: TokenKey, v: Vec<f32>) -> Result<(), VMoeError> {
        let bytes = (v.len() * 4) as u64;
        if let Some(old) = self.memory.insert(key, v) {
            self.memory_bytes -= (old.len() * 4) as u64;
        }
        self.memory_bytes += bytes;
        if self.memory_bytes > self.arena.len {
            return Err(VMoeError::Config(format!(
                "reuse cache holds {} bytes in a {}-byte arena",
                self.memory_bytes, self.arena.len
            )));
        }
        Ok(())
    }

    fn take_memory(&mut self, key: &TokenKey) -> Option<Vec<f32>> {
        let v = self.memory.remove(key)?;
        self.memory_bytes -= (v.len() * 4) as u64;
        Some(v)
    }

    /// Plans `images` of a model with `identity` with the policy; starts disk reads for its
    /// prefetches (in the background when `background`, else waits for them).
    fn plan(
        &mut self,
        model: &VMoe,
        identity: &[u8; 32],
        images: &Tensor,
        background: bool,
    ) -> Result<Planned, VMoeError> {
        let floats = model.config.tokens_per_image() * model.config.dim;
        let keys: Vec<TokenKey> =
            images.f32_cow().chunks_exact(IMAGE_PIXELS).map(|img| token_key(identity, img)).collect();
        let expert = token_key(identity, &[]).expert;
        self.batches += 1;
        let now = self.now();
        if self.policy.poll_timeout().is_some_and(|due| now >= due) {
            self.policy.handle_timeout(now);
            self.execute(&BTreeMap::new())?;
        }
        let tokens = keys.iter().map(|k| TokenRequest { sig: k.sig, bytes: (floats * 4) as u64 }).collect();
        let _ = self.policy.handle_batch_start(now, &[ExpertBatch { expert, tokens }]);
        let mut hits = BTreeSet::new();
        let mut reads = Vec::new();
        // Residents the policy moves out to make room for a prefetch come first. One of them may
        // be a prefetch still in flight: those reads land in memory before anything leaves it.
        let actions: Vec<ReuseAction> = std::iter::from_fn(|| self.policy.poll_action()).collect();
        if actions.iter().any(|a| matches!(a, ReuseAction::Evict { .. } | ReuseAction::Store { .. })) {
            self.join_prefetches(floats)?;
        }
        let mut evicted = BTreeMap::new();
        for a in actions {
            match a {
                ReuseAction::Prefetch { key, .. } => reads.push((key, self.slots.get(&key))),
                ReuseAction::Reuse { key } => {
                    hits.insert(key);
                }
                ReuseAction::Compute { .. } | ReuseAction::Relocate { .. } => {}
                ReuseAction::Store { at: Placement::Dram { .. }, .. } => {
                    return Err(VMoeError::Config(format!("unexpected reuse action at batch start: {a:?}")));
                }
                ReuseAction::Store { .. } | ReuseAction::Evict { .. } => {
                    self.apply(a, &BTreeMap::new(), &mut evicted)?
                }
            }
        }
        if !reads.is_empty() {
            self.stats.prefetched += reads.len() as u64;
            let (tx, rx) = channel();
            self.send(DiskCmd::Read(reads, tx))?;
            self.pending.push(rx);
            if !background {
                self.join_prefetches(floats)?;
            }
        }
        Ok(Planned { expert, keys, hits })
    }

    /// Plans the batch the next step will run and starts its prefetches in the background (call
    /// once the current step's stem is settled, before the rest of it computes).
    pub fn plan_next(&mut self, model: &VMoe, identity: &[u8; 32], images: &Tensor) -> Result<(), VMoeError> {
        if self.on_demand.is_some() {
            return Ok(());
        }
        let p = self.plan(model, identity, images, true)?;
        self.planned = Some(p);
        Ok(())
    }

    /// The stem tokens of `images` (`batch * tokens x dim`) for a model with `identity`: hits from
    /// memory (prefetched from disk where the policy said so), misses computed (as one batch, which
    /// gives the same rows as the full pass), then the policy decides what stays, what is spilled,
    /// what is dropped. Bit-identical to `model.stem(images)`.
    pub fn stem(&mut self, model: &VMoe, identity: &[u8; 32], images: &Tensor) -> Result<Tensor, VMoeError> {
        if self.on_demand.is_some() {
            return self.stem_on_demand(model, identity, images);
        }
        let (batch, _) = images.dims2()?;
        let c = model.config;
        let floats = c.tokens_per_image() * c.dim;
        let keys: Vec<TokenKey> =
            images.f32_cow().chunks_exact(IMAGE_PIXELS).map(|img| token_key(identity, img)).collect();
        let planned = match self.planned.take() {
            Some(p) if p.keys == keys => p,
            _ => self.plan(model, identity, images, false)?,
        };
        self.join_prefetches(floats)?;
        // Misses: every image not in memory (including a hit whose disk read failed its checks).
        let px = images.f32_cow();
        let miss_idx: Vec<usize> = (0..batch)
            .filter(|&i| !(planned.hits.contains(&keys[i]) && self.memory.contains_key(&keys[i])))
            .collect();
        self.stats.hits += (batch - miss_idx.len()) as u64;
        self.stats.misses += miss_idx.len() as u64;
        let mut fresh: BTreeMap<TokenKey, Vec<f32>> = BTreeMap::new();
        for (i, rows) in compute_rows(model, &px, &miss_idx)? {
            if planned.hits.contains(&keys[i]) {
                // The policy holds it in memory but its disk read failed: fill the slot.
                self.insert_memory(keys[i], rows.clone())?;
            }
            fresh.insert(keys[i], rows);
        }
        let mut out = Vec::with_capacity(batch * floats);
        for k in &keys {
            match fresh.get(k).or_else(|| self.memory.get(k)) {
                Some(rows) => out.extend_from_slice(rows),
                None => return Err(VMoeError::Config("a reused stem entry vanished".into())),
            }
        }
        // Residency: the images are revisited every epoch of the task, so P_reuse = 1 and the
        // policy's importance is the batch's reuse ratio.
        let candidates: Vec<OutputCandidate> = keys
            .iter()
            .map(|&key| OutputCandidate {
                key,
                bytes: (floats * 4) as u64,
                p_reuse: 1.0,
                sharers: Vec::new(),
            })
            .collect();
        debug_assert!(candidates.iter().all(|o| o.key.expert == planned.expert));
        self.policy.handle_batch_done(self.now(), &candidates);
        self.execute(&fresh)?;
        Ok(Tensor::from_f32(&[batch * c.tokens_per_image(), c.dim], out)?)
    }

    /// [`Self::stem`] FoggyCache-like: entries with a disk copy are read while the step waits, the
    /// rest computed and written to disk while it has room; nothing stays in memory.
    fn stem_on_demand(
        &mut self,
        model: &VMoe,
        identity: &[u8; 32],
        images: &Tensor,
    ) -> Result<Tensor, VMoeError> {
        let (batch, _) = images.dims2()?;
        let c = model.config;
        let floats = c.tokens_per_image() * c.dim;
        let px = images.f32_cow();
        let keys: Vec<TokenKey> = px.chunks_exact(IMAGE_PIXELS).map(|img| token_key(identity, img)).collect();
        let plan = self.on_demand.as_ref().map(|od| od.handle_batch(&keys)).unwrap_or_default();
        let mut rows: BTreeMap<TokenKey, Vec<f32>> = BTreeMap::new();
        if !plan.read.is_empty() {
            let reads = plan.read.iter().map(|k| (*k, self.slots.get(k))).collect();
            let (tx, rx) = channel();
            self.send(DiskCmd::Read(reads, tx))?;
            let done = self.wait_reads(&rx)?;
            self.stats.prefetched += plan.read.len() as u64;
            self.stats.prefetch_us += span_us(done.started, done.ended);
            for (key, bytes) in done.data {
                match bytes.ok().and_then(|b| decode(&b, floats)) {
                    Some(v) => {
                        rows.insert(key, v);
                    }
                    None => {
                        self.stats.bad_reads += 1;
                        self.slots.release(&key);
                        if let Some(od) = self.on_demand.as_mut() {
                            od.disk_copy_lost(&key);
                        }
                    }
                }
            }
        }
        let miss_idx: Vec<usize> = (0..batch).filter(|&i| !rows.contains_key(&keys[i])).collect();
        self.stats.hits += (batch - miss_idx.len()) as u64;
        self.stats.misses += miss_idx.len() as u64;
        for (i, v) in compute_rows(model, &px, &miss_idx)? {
            let keep =
                self.on_demand.as_mut().is_some_and(|od| od.handle_computed(keys[i], (floats * 4) as u64));
            if keep {
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                let slot = self.slots.assign(keys[i], bytes.len());
                self.send(DiskCmd::Put(slot, bytes))?;
                self.stats.spilled += 1;
            }
            rows.insert(keys[i], v);
        }
        let mut out = Vec::with_capacity(batch * floats);
        for k in &keys {
            out.extend_from_slice(
                rows.get(k).ok_or_else(|| VMoeError::Config("a stem entry vanished".into()))?,
            );
        }
        Ok(Tensor::from_f32(&[batch * c.tokens_per_image(), c.dim], out)?)
    }

    /// Carries out the policy's pending actions; `fresh` holds tokens computed this step.
    fn execute(&mut self, fresh: &BTreeMap<TokenKey, Vec<f32>>) -> Result<(), VMoeError> {
        let mut evicted: BTreeMap<TokenKey, Vec<f32>> = BTreeMap::new();
        while let Some(a) = self.policy.poll_action() {
            self.apply(a, fresh, &mut evicted)?;
        }
        Ok(())
    }

    /// Carries out one storage action; `evicted` holds what left memory earlier in the same run
    /// of actions (a demotion's write follows its eviction).
    fn apply(
        &mut self,
        a: ReuseAction,
        fresh: &BTreeMap<TokenKey, Vec<f32>>,
        evicted: &mut BTreeMap<TokenKey, Vec<f32>>,
    ) -> Result<(), VMoeError> {
        match a {
            ReuseAction::Store { key, at: Placement::Dram { .. }, .. } => {
                let v = fresh.get(&key).cloned().or_else(|| evicted.remove(&key));
                if let Some(v) = v {
                    self.insert_memory(key, v)?;
                }
            }
            ReuseAction::Store { key, at: Placement::Disk, .. } => {
                let v = fresh.get(&key).or_else(|| evicted.get(&key)).or_else(|| self.memory.get(&key));
                if let Some(v) = v {
                    let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                    let slot = self.slots.assign(key, bytes.len());
                    self.send(DiskCmd::Put(slot, bytes))?;
                    self.stats.spilled += 1;
                }
            }
            ReuseAction::Evict { key, tier: Tier::Dram } => {
                if let Some(v) = self.take_memory(&key) {
                    evicted.insert(key, v);
                }
            }
            ReuseAction::Evict { key, tier: Tier::Disk } => self.slots.release(&key),
            ReuseAction::Relocate { .. }
            | ReuseAction::Prefetch { .. }
            | ReuseAction::Compute { .. }
            | ReuseAction::Reuse { .. } => {}
        }
        Ok(())
    }

    /// Stops the disk thread, removes the disk directory and frees the arena from `pool`.
    pub fn release(mut self, pool: &mut MemoryPool) -> Result<(), VMoeError> {
        let r = self.shutdown();
        pool.free(self.arena)?;
        r
    }

    fn shutdown(&mut self) -> Result<(), VMoeError> {
        self.pending.clear();
        self.disk = None;
        let worker = self.worker.take().map(|h| h.join());
        let removed = if self.dir.exists() { std::fs::remove_dir_all(&self.dir) } else { Ok(()) };
        if let Some(r) = worker {
            r.map_err(|_| VMoeError::Config("the reuse cache's disk thread panicked".into()))??;
        }
        removed.map_err(|source| VMoeError::Io { context: "removing", path: self.dir.clone(), source })
    }
}

impl Drop for StemCache {
    /// Joins the disk thread and removes the disk directory (the arena goes with the pool).
    fn drop(&mut self) {
        let _ = self.shutdown();
    }
}
