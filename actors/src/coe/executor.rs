//! One CoE executor: its own tiered weight store, device budget, host tier and loaded experts.
//!
//! **Engines** ([`troupe_policy::coe::choose_engine`] decides, from the executor's kind): a GPU
//! executor opens `Device::cuda(0)`; when that succeeds its device arena is GPU memory and each
//! expert runs in the kernels' MLP engine ([`MlpEngine`]: cuBLAS GEMM, bias, ReLU, softmax on the
//! GPU), built from the arena copy. When CUDA is unusable (the reason is logged once per process)
//! it stays a CPU executor under ONNX Runtime, the stand-in, named so ([`standin_name`]) and
//! reported as `standin-cpu`. A CPU executor runs ONNX Runtime, or the MLP engine on the CPU when
//! [`ExecutorOptions::mlp_on_cpu`] asks for it.
//!
//! Three tiers per executor, all in its [`WeightStore`]:
//!
//! - **device**: the store's device arena, a kernels `MemoryPool` with one allocation per
//!   resident expert (sized to its bytes, 256-byte aligned), in GPU memory on a CUDA executor.
//!   The ONNX session or MLP engine is built from the arena's bytes (checksummed); the arena copy
//!   is what the budget accounts. The MLP engine runs the weights in place there ([`ArenaMlp`],
//!   at the expert's current offset) when the file lays them out aligned, as the app writer
//!   does; otherwise it keeps its own f32 copy, outside the pool, as ONNX Runtime's session
//!   always does (at most the blob's bytes). The byte budget
//!   the scheduler plans with is checked on the raw sizes; the pool gets one alignment unit of
//!   slack per expert that could be resident at once, so alignment never refuses what the
//!   budget allows. Fragmentation is handled by compaction: when a load fits in the free bytes
//!   but in no free range, every resident allocation is re-placed contiguously
//!   ([`WeightStore::compact_device`]) and the load proceeds.
//! - **host**: a budget of its own ([`ExecutorOptions::host_budget`]). At start it holds the
//!   host-homed experts by descending usage probability while they fit. An expert evicted from
//!   the device budget is *demoted* here (a device -> host copy, checksummed) when the policy's
//!   [`plan_demotion`] says so, which may first evict colder host experts to disk; otherwise it
//!   is dropped to disk. A load of a host-resident expert is a *promotion* (a host -> device
//!   copy, the host copy then released), a load of any other an `O_DIRECT` disk read.
//! - **disk**: the blob files.
//!
//! Counters separate promotions from disk loads, time the tier moves, compaction, session
//! creation and the rest (expert management: planning, pool accounting, bookkeeping), and count
//! demotions, drops, host evictions and compactions, and record the engine used
//! ([`ExecutorCounters::engine`]).
//!
//! The executor refuses a load that would exceed its budget, an eviction of an expert it is not
//! holding, and a batch of an expert that is not loaded: a policy bug surfaces as an error,
//! never as silent overuse. [`ExpertExecutor::check_accounting`] checks both tiers' bytes
//! against their budgets and against what the executor holds.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use troupe_kernels::mlp_engine::{ArenaMlp, MlpEngine};
use troupe_kernels::onnx::mlp_graph::MlpLimits;
use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_kernels::{BlobId, Device, DeviceBytes, Tier as StoreTier, WeightStore};
use troupe_policy::coe::{
    CoeModel, Demotion, ExecutorKind, ExpertEngine, ExpertId, HostCandidate, HostTier, choose_engine,
    plan_demotion,
};

use super::CoeError;
use super::app::{INPUT_NAME, INPUT_WIDTH, Manifest};
use crate::clock::Clock;

/// Alignment of the device arena's allocations (the weight store's pool).
pub const DEVICE_ALIGN: u64 = 256;

/// The executor name used when a CPU stands in for a GPU, e.g. `gpu0-standin-cpu`.
pub fn standin_name(index: usize) -> String {
    format!("gpu{index}-standin-cpu")
}

/// The GPU executor's name: `gpu{index}` when CUDA device 0 opens, else [`standin_name`].
pub fn gpu_name(index: usize) -> String {
    if troupe_kernels::cuda::cuda_available(0).is_ok() { format!("gpu{index}") } else { standin_name(index) }
}

/// What an executor has done.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExecutorCounters {
    /// The engine that ran its experts (`None` where only the scheduler's view is known).
    pub engine: Option<ExpertEngine>,
    /// Experts loaded.
    pub loads: u64,
    /// Seconds spent loading (tier move + verify + session creation + management).
    pub load_seconds: f64,
    /// Batches run.
    pub batches: u64,
    /// Requests run (sum of batch sizes).
    pub tasks: u64,
    /// Seconds spent running batches.
    pub run_seconds: f64,
    /// Highest resident expert bytes seen.
    pub peak_bytes: u64,
    /// Loads that were promotions from the host tier.
    pub promotions: u64,
    /// Bytes promoted from the host tier.
    pub promoted_bytes: u64,
    /// Seconds of the host -> device copies (verify included, session creation excluded).
    pub promotion_seconds: f64,
    /// Loads read from disk (`O_DIRECT`).
    pub disk_loads: u64,
    /// Bytes loaded from disk.
    pub disk_load_bytes: u64,
    /// Seconds of the disk -> device reads (verify included, session creation excluded).
    pub disk_load_seconds: f64,
    /// Seconds creating sessions from the device copy (read in place from a host-memory arena;
    /// from a GPU arena, its read-back and checksum included) and dropping them on eviction.
    pub session_seconds: f64,
    /// Evicted experts kept in the host tier.
    pub demotions: u64,
    /// Bytes demoted.
    pub demoted_bytes: u64,
    /// Seconds of the device -> host copies.
    pub demotion_seconds: f64,
    /// Evicted experts dropped to disk (no room in the host tier for them).
    pub drops: u64,
    /// Host-resident experts evicted to disk to make room for a demotion.
    pub host_evictions: u64,
    /// Device-arena compactions.
    pub compactions: u64,
    /// Bytes moved by compactions.
    pub compacted_bytes: u64,
    /// Seconds compacting (moving bytes: not part of `management_seconds`).
    pub compaction_seconds: f64,
    /// Seconds of expert management: load and evict time minus every byte move (tier copies,
    /// compaction) and session creation and teardown, i.e. planning, pool accounting, host
    /// evictions and bookkeeping.
    pub management_seconds: f64,
    /// Highest host-tier bytes seen.
    pub peak_host_bytes: u64,
    /// Loads whose MLP engine reads the weights in place from the device arena (no copy of its
    /// own outside the pool; see [`ArenaMlp`]).
    pub in_arena_loads: u64,
}

/// How an executor is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecutorOptions {
    /// Device budget for resident experts, bytes.
    pub budget: u64,
    /// Host-tier budget, bytes; `None` sizes it to the model's host-homed experts.
    pub host_budget: Option<u64>,
    /// ONNX Runtime intra-op threads per session (0 = ONNX Runtime's default).
    pub threads: usize,
    /// The executor's kind: a GPU executor runs on CUDA when it can (see the module docs).
    pub kind: ExecutorKind,
    /// A CPU executor runs the MLP engine on the CPU instead of ONNX Runtime.
    pub mlp_on_cpu: bool,
}

impl ExecutorOptions {
    /// A CPU executor with a device budget, the default host tier, one thread, ONNX Runtime.
    pub fn new(budget: u64) -> Self {
        ExecutorOptions { budget, host_budget: None, threads: 1, kind: ExecutorKind::Cpu, mlp_on_cpu: false }
    }
}

/// A loaded expert: an ONNX Runtime session or an MLP engine on the executor's device.
enum Loaded {
    /// ONNX Runtime (the CPU executor's default, the GPU stand-in).
    Onnx(OnnxSession),
    /// The kernels' MLP engine with its own copy of the weights (a file it cannot read in place).
    Mlp(MlpEngine),
    /// The kernels' MLP engine reading the weights where the device arena holds the file.
    InArena(ArenaMlp),
}

/// The device of `kind`'s engine: CUDA device 0 for a GPU executor when it opens (else the
/// reason, logged once per process, and the CPU), the CPU otherwise.
fn engine_device(kind: ExecutorKind, mlp_on_cpu: bool) -> (ExpertEngine, Device) {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    let cuda = match kind {
        ExecutorKind::Gpu => Device::cuda(0).map_err(|e| {
            LOGGED.call_once(|| tracing::warn!(reason = %e, "no CUDA: the GPU executor is a CPU stand-in"));
        }),
        ExecutorKind::Cpu => Err(()),
    };
    let engine = choose_engine(kind, cuda.is_ok(), mlp_on_cpu);
    match cuda {
        Ok(d) if engine.on_cuda() => (engine, d),
        _ => (engine, Device::Cpu),
    }
}

/// `expert`'s blob id in `blobs` (a field-level borrow, so the caller may use the store's `&mut`
/// beside it), or an error naming executor `name` and the expert.
fn blob_of<'a>(blobs: &'a [BlobId], name: &str, expert: ExpertId) -> Result<&'a BlobId, CoeError> {
    blobs.get(expert.index()).ok_or_else(|| CoeError::Executor {
        executor: name.to_string(),
        problem: format!("unknown expert {expert}"),
    })
}

/// One executor (see the module docs).
pub struct ExpertExecutor {
    name: String,
    store: WeightStore,
    blobs: Vec<BlobId>,
    sizes: Vec<u64>,
    usage: Vec<f64>,
    outputs: Vec<usize>,
    engine: ExpertEngine,
    device: Device,
    sessions: HashMap<ExpertId, Loaded>,
    /// Per expert: whether the store holds it in the host tier, kept in step with every store
    /// call that moves it (so a demotion's plan needs no lookups); checked against the store by
    /// [`ExpertExecutor::check_accounting`].
    in_host: Vec<bool>,
    /// The host tier's candidates for a demotion's plan, reused from one eviction to the next.
    host_scratch: Vec<HostCandidate>,
    budget: u64,
    host_budget: u64,
    resident: u64,
    session_config: SessionConfig,
    counters: ExecutorCounters,
}

impl std::fmt::Debug for ExpertExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertExecutor")
            .field("name", &self.name)
            .field("engine", &self.engine)
            .field("budget", &self.budget)
            .field("host_budget", &self.host_budget)
            .field("resident", &self.resident)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

/// Most experts of `sizes` resident at once under `budget` (the smallest ones).
fn max_resident(sizes: &[u64], budget: u64) -> u64 {
    let mut sorted = sizes.to_vec();
    sorted.sort_unstable();
    let (mut used, mut n) = (0u64, 0u64);
    for s in sorted {
        match used.checked_add(s) {
            Some(t) if t <= budget => {
                used = t;
                n += 1;
            }
            _ => break,
        }
    }
    n
}

impl ExpertExecutor {
    /// Open an executor named `name` over the app's store in `store_dir`, holding at most
    /// `budget` bytes of experts, with the default host tier and one thread.
    pub fn open(
        name: &str,
        store_dir: &Path,
        manifest: &Manifest,
        model: &CoeModel,
        budget: u64,
    ) -> Result<ExpertExecutor, CoeError> {
        Self::open_with(name, store_dir, manifest, model, ExecutorOptions::new(budget))
    }

    /// Open an executor with `options`; the host tier is filled now (see the module docs).
    pub fn open_with(
        name: &str,
        store_dir: &Path,
        manifest: &Manifest,
        model: &CoeModel,
        options: ExecutorOptions,
    ) -> Result<ExpertExecutor, CoeError> {
        let budget = options.budget;
        let host_budget = options.host_budget.unwrap_or_else(|| HostTier::default_budget(model));
        let sizes: Vec<u64> = model.experts().iter().map(|e| e.size_bytes).collect();
        // Slack for alignment: one unit per expert that could be resident, one for rounding.
        let slack = (max_resident(&sizes, budget) + 1).saturating_mul(DEVICE_ALIGN);
        let arena = budget.checked_add(slack).ok_or_else(|| CoeError::Executor {
            executor: name.to_string(),
            problem: format!("device budget {budget} bytes overflows with alignment slack"),
        })?;
        let (engine, device) = engine_device(options.kind, options.mlp_on_cpu);
        // The arena lives where the engine runs: GPU memory for a CUDA executor.
        let mut store = WeightStore::open(store_dir, &device, arena, host_budget)?;
        let mut blobs = Vec::with_capacity(model.len());
        for (e, f) in model.experts().iter().zip(&manifest.experts) {
            let id = BlobId::new(&f.blob)?;
            let len = store.len_of(&id)?;
            if len != e.size_bytes {
                return Err(CoeError::BadFile {
                    path: store.path_of(&id)?.to_path_buf(),
                    problem: format!("{} bytes, the trace says expert {} has {}", len, e.id, e.size_bytes),
                });
            }
            blobs.push(id);
        }
        // The same initial set the scheduler assumes (its HostTier starts from it).
        let mut in_host = vec![false; blobs.len()];
        for id in HostTier::new(model, host_budget).resident() {
            if let Some(blob) = blobs.get(id.index()) {
                store.load_to_host(blob)?;
                in_host[id.index()] = true;
            }
        }
        let counters = ExecutorCounters {
            engine: Some(engine),
            peak_host_bytes: store.host_used(),
            ..Default::default()
        };
        Ok(ExpertExecutor {
            name: name.to_string(),
            store,
            blobs,
            sizes,
            usage: model.experts().iter().map(|e| e.usage_prob).collect(),
            outputs: manifest.experts.iter().map(|f| f.widths.last().copied().unwrap_or(0)).collect(),
            engine,
            device,
            sessions: HashMap::new(),
            in_host,
            host_scratch: Vec::new(),
            budget,
            host_budget,
            resident: 0,
            session_config: SessionConfig { intra_threads: options.threads, ..SessionConfig::default() },
            counters,
        })
    }

    /// The executor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Expert memory budget, bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Host-tier budget, bytes.
    pub fn host_budget(&self) -> u64 {
        self.host_budget
    }

    /// The engine that runs this executor's experts.
    pub fn engine(&self) -> ExpertEngine {
        self.engine
    }

    /// The device the experts run on (`cpu` or `cuda:N`).
    pub fn device_name(&self) -> String {
        self.device.name()
    }

    /// ONNX Runtime intra-op threads of this executor's sessions.
    pub fn threads(&self) -> usize {
        self.session_config.intra_threads
    }

    /// Bytes of experts now resident.
    pub fn resident_bytes(&self) -> u64 {
        self.resident
    }

    /// Whether `expert` is loaded.
    pub fn is_loaded(&self, expert: ExpertId) -> bool {
        self.sessions.contains_key(&expert)
    }

    /// Experts loaded now.
    pub fn loaded(&self) -> Vec<ExpertId> {
        let mut v: Vec<ExpertId> = self.sessions.keys().copied().collect();
        v.sort();
        v
    }

    /// Bytes the host tier holds (the store's own accounting).
    pub fn store_host_bytes(&self) -> u64 {
        self.store.host_used()
    }

    /// Experts in the host tier now, in id order (as tracked; [`Self::check_accounting`]
    /// checks it against the store's tiers).
    pub fn host_resident(&self) -> Vec<ExpertId> {
        self.in_host.iter().enumerate().filter(|(_, h)| **h).map(|(i, _)| ExpertId(i as u32)).collect()
    }

    /// Experts the store holds in the host tier, asked blob by blob.
    fn store_host_resident(&self) -> Vec<ExpertId> {
        (0..self.blobs.len())
            .map(|i| ExpertId(i as u32))
            .filter(|e| self.source_tier(*e).is_ok_and(|t| t == StoreTier::Host))
            .collect()
    }

    /// The tier a load of `expert` would come from now (device when it is loaded).
    pub fn source_tier(&self, expert: ExpertId) -> Result<StoreTier, CoeError> {
        Ok(self.store.tier(self.blob(expert)?)?)
    }

    /// Bytes of sessions loaded, summed from the expert sizes (independent of `resident_bytes`).
    pub fn loaded_bytes(&self) -> u64 {
        self.sessions.keys().map(|e| self.sizes[e.index()]).sum()
    }

    /// The device arena's pool occupancy.
    pub fn device_pool(&self) -> troupe_kernels::PoolStats {
        self.store.stats().device
    }

    /// What it has done so far.
    pub fn counters(&self) -> ExecutorCounters {
        self.counters
    }

    /// Checks both tiers: device bytes within the budget and equal to the sessions held (also
    /// as the pool's aligned allocations, one per session, each in the device tier); host bytes
    /// within the host budget and equal to the experts the store holds there.
    pub fn check_accounting(&self) -> Result<(), CoeError> {
        let pool = self.device_pool();
        let aligned: u64 =
            self.sessions.keys().map(|e| self.sizes[e.index()].div_ceil(DEVICE_ALIGN) * DEVICE_ALIGN).sum();
        let on_device =
            self.sessions.keys().all(|e| self.source_tier(*e).is_ok_and(|t| t == StoreTier::Device));
        let host = self.store_host_bytes();
        let tracked = self.host_resident();
        let stored = self.store_host_resident();
        let host_sum: u64 = stored.iter().map(|e| self.sizes[e.index()]).sum();
        let problems = [
            (
                self.resident > self.budget,
                format!("{} resident over the budget {}", self.resident, self.budget),
            ),
            (
                self.loaded_bytes() != self.resident,
                format!("{} resident, {} in sessions", self.resident, self.loaded_bytes()),
            ),
            (
                pool.used != aligned || pool.allocations != self.sessions.len() || !on_device,
                format!(
                    "device pool holds {} bytes in {} allocations, sessions {} ({aligned} aligned)",
                    pool.used,
                    pool.allocations,
                    self.sessions.len()
                ),
            ),
            (host > self.host_budget, format!("host tier {host} bytes over its budget {}", self.host_budget)),
            (host != host_sum, format!("host tier {host} bytes, its experts sum to {host_sum}")),
            (tracked != stored, format!("host tier tracked as {tracked:?}, the store holds {stored:?}")),
        ];
        match problems.into_iter().find(|(bad, _)| *bad) {
            Some((_, problem)) => Err(self.fail(format!("memory accounting broken: {problem}"))),
            None => Ok(()),
        }
    }

    fn fail(&self, problem: String) -> CoeError {
        CoeError::Executor { executor: self.name.clone(), problem }
    }

    fn blob(&self, expert: ExpertId) -> Result<&BlobId, CoeError> {
        blob_of(&self.blobs, &self.name, expert)
    }

    /// Load `expert`: into the device tier (a promotion from the host tier or an `O_DIRECT`
    /// disk read, checksummed; compacting the arena first when fragmented), then a session or
    /// MLP engine from the device copy. Returns the time it took.
    pub fn load(&mut self, expert: ExpertId) -> Result<Duration, CoeError> {
        let start = Clock::start();
        // The blob id is borrowed from its own field (no clone), beside the store's `&mut`.
        let id = blob_of(&self.blobs, &self.name, expert)?;
        if self.sessions.contains_key(&expert) {
            return Err(self.fail(format!("{expert} is already loaded")));
        }
        let size = self.sizes[expert.index()];
        if self.resident + size > self.budget {
            return Err(self.fail(format!(
                "loading {expert} ({size} bytes) would exceed the budget: {} of {} bytes in use",
                self.resident, self.budget
            )));
        }
        let mut compact_s = 0.0;
        if !self.store.device_can_fit(size) {
            let compact_start = Clock::start();
            self.counters.compacted_bytes += self.store.compact_device()?;
            self.counters.compactions += 1;
            compact_s = compact_start.elapsed().as_secs_f64();
            self.counters.compaction_seconds += compact_s;
        }
        let from = self.store.tier(id)?;
        let before = self.store.device_traffic();
        self.store.promote_to_device(id)?;
        // a promotion releases the host copy
        self.in_host[expert.index()] = false;
        let after = self.store.device_traffic();
        let session_start = Clock::start();
        // A host-memory arena's copy was checksummed on its way in (disk read or promotion), so
        // the session is built from it in place; a GPU arena's is read back and checked again.
        let built = match self.store.device_bytes(id) {
            Ok(DeviceBytes::Host(bytes)) => self.build(expert, id, bytes),
            _ => self.store.read(id).map_err(CoeError::from).and_then(|bytes| self.build(expert, id, &bytes)),
        };
        let session = match built {
            Ok(s) => s,
            Err(e) => {
                // The device copy goes down again (to the host tier if it has room).
                let landed = self.store.evict(id)?;
                self.in_host[expert.index()] = landed == StoreTier::Host;
                return Err(e);
            }
        };
        let session_s = session_start.elapsed().as_secs_f64();
        self.counters.in_arena_loads += u64::from(matches!(session, Loaded::InArena(_)));
        self.sessions.insert(expert, session);
        self.resident += size;
        let c = &mut self.counters;
        c.peak_bytes = c.peak_bytes.max(self.resident);
        let moved_s = if from == StoreTier::Host {
            let s = after.host_to_device.seconds - before.host_to_device.seconds;
            c.promotions += 1;
            c.promoted_bytes += size;
            c.promotion_seconds += s;
            s
        } else {
            let s = after.disk_to_device.seconds - before.disk_to_device.seconds;
            c.disk_loads += 1;
            c.disk_load_bytes += size;
            c.disk_load_seconds += s;
            s
        };
        let took = start.elapsed();
        c.session_seconds += session_s;
        c.management_seconds += (took.as_secs_f64() - moved_s - session_s - compact_s).max(0.0);
        c.loads += 1;
        c.load_seconds += took.as_secs_f64();
        Ok(took)
    }

    /// A session or MLP engine (on the executor's device) from `bytes`, as the engine says.
    fn build(&self, expert: ExpertId, id: &BlobId, bytes: &[u8]) -> Result<Loaded, CoeError> {
        if self.engine.uses_onnx_runtime() {
            return Ok(Loaded::Onnx(OnnxSession::from_bytes(bytes, id.as_str(), &self.session_config)?));
        }
        let refused = |e: &dyn std::fmt::Display| {
            self.fail(format!("{expert} ({id}) in the MLP engine on {}: {e}", self.device.name()))
        };
        match ArenaMlp::from_onnx(bytes, &MlpLimits::default()).map_err(|e| refused(&e))? {
            Some(layout) => Ok(Loaded::InArena(layout)),
            None => MlpEngine::from_onnx(bytes, &MlpLimits::default(), &self.device)
                .map(Loaded::Mlp)
                .map_err(|e| refused(&e)),
        }
    }

    /// Evict `expert` from the device budget: drop its session, then demote its device copy
    /// to the host tier or drop it to disk, as [`plan_demotion`] decides.
    pub fn evict(&mut self, expert: ExpertId) -> Result<(), CoeError> {
        let start = Clock::start();
        let Some(session) = self.sessions.remove(&expert) else {
            return Err(self.fail(format!("evicting {expert}, which is not loaded")));
        };
        let drop_start = Clock::start();
        drop(session);
        let session_s = drop_start.elapsed().as_secs_f64();
        self.resident -= self.sizes[expert.index()];
        let leaving = HostCandidate {
            id: expert,
            size_bytes: self.sizes[expert.index()],
            usage_prob: self.usage[expert.index()],
        };
        // The host tier's experts, into a buffer kept between evictions (no allocation per call).
        let mut resident = std::mem::take(&mut self.host_scratch);
        resident.clear();
        resident.extend(self.in_host.iter().enumerate().filter(|(_, h)| **h).map(|(i, _)| HostCandidate {
            id: ExpertId(i as u32),
            size_bytes: self.sizes[i],
            usage_prob: self.usage[i],
        }));
        let plan = plan_demotion(&leaving, &resident, self.host_budget, self.store.host_used());
        self.host_scratch = resident;
        let before = self.store.device_traffic().device_to_host.seconds;
        let want = match plan {
            Demotion::ToHost { evict } => {
                for victim in evict {
                    let blob = blob_of(&self.blobs, &self.name, victim)?;
                    self.store.evict(blob)?;
                    self.in_host[victim.index()] = false;
                    self.counters.host_evictions += 1;
                }
                StoreTier::Host
            }
            Demotion::Drop => StoreTier::Disk,
        };
        let id = blob_of(&self.blobs, &self.name, expert)?;
        let landed = self.store.evict(id)?;
        self.in_host[expert.index()] = landed == StoreTier::Host;
        if landed != want {
            return Err(self.fail(format!("{expert} went to the {landed:?} tier, the plan said {want:?}")));
        }
        let moved_s = self.store.device_traffic().device_to_host.seconds - before;
        let c = &mut self.counters;
        if landed == StoreTier::Host {
            c.demotions += 1;
            c.demoted_bytes += leaving.size_bytes;
            c.demotion_seconds += moved_s;
        } else {
            c.drops += 1;
        }
        c.peak_host_bytes = c.peak_host_bytes.max(self.store.host_used());
        c.session_seconds += session_s;
        c.management_seconds += (start.elapsed().as_secs_f64() - moved_s - session_s).max(0.0);
        tracing::trace!(executor = %self.name, %expert, ?landed, "evicted");
        Ok(())
    }

    /// Run one batch of `expert` on `inputs` (64 floats each); one output row per input.
    pub fn run_batch(&mut self, expert: ExpertId, inputs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CoeError> {
        let start = Clock::start();
        let width =
            *self.outputs.get(expert.index()).ok_or_else(|| self.fail(format!("unknown expert {expert}")))?;
        let name = self.name.clone();
        let session = self.sessions.get_mut(&expert).ok_or_else(|| CoeError::Executor {
            executor: name,
            problem: format!("running {expert}, which is not loaded"),
        })?;
        let mut x = Vec::with_capacity(inputs.len() * INPUT_WIDTH);
        for i in inputs {
            if i.len() != INPUT_WIDTH {
                return Err(self.fail(format!("input of {} floats, expected {INPUT_WIDTH}", i.len())));
            }
            x.extend_from_slice(i);
        }
        let ran: Vec<f32>;
        let out;
        let probs = match session {
            Loaded::Onnx(session) => {
                out = session.run(&[NamedTensor::f32(INPUT_NAME, vec![inputs.len(), INPUT_WIDTH], x)])?;
                out.first()
                    .and_then(NamedTensor::as_f32)
                    .ok_or_else(|| self.fail(format!("{expert}: no f32 output")))?
            }
            Loaded::Mlp(engine) => {
                ran = engine
                    .run(&x, inputs.len())
                    .map_err(|e| self.fail(format!("{expert} in the MLP engine: {e}")))?;
                &ran
            }
            Loaded::InArena(layout) => {
                let id = &self.blobs[expert.index()];
                let result = match (self.store.device_bytes(id), &self.device) {
                    (Ok(DeviceBytes::Host(file)), _) => layout.run_host(file, &x, inputs.len()),
                    (Ok(DeviceBytes::Cuda { arena, offset, len }), Device::Cuda(dev))
                        if len == layout.file_len() =>
                    {
                        layout.run_cuda(dev, arena, offset, &x, inputs.len())
                    }
                    (Ok(DeviceBytes::Cuda { len, .. }), _) => Err(troupe_kernels::KernelError::invalid(
                        "coe executor",
                        format!(
                            "a GPU arena blob of {len} bytes for a layout of {} on {}",
                            layout.file_len(),
                            self.device.name()
                        ),
                    )),
                    (Err(e), _) => Err(e),
                };
                ran = result.map_err(|e| self.fail(format!("{expert} in the MLP engine, in place: {e}")))?;
                &ran
            }
        };
        if probs.len() != inputs.len() * width {
            return Err(self.fail(format!(
                "{expert}: {} outputs for {} inputs of width {width}",
                probs.len(),
                inputs.len()
            )));
        }
        let rows = probs.chunks(width.max(1)).map(<[f32]>::to_vec).collect();
        self.counters.batches += 1;
        self.counters.tasks += inputs.len() as u64;
        self.counters.run_seconds += start.elapsed().as_secs_f64();
        Ok(rows)
    }
}
