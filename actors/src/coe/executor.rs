//! One CoE executor: its own tiered weight store, expert memory budget and ONNX sessions.
//!
//! Loading an expert is real work: its blob is read from the weight store (an `O_DIRECT` read
//! from disk for SSD-homed experts, a copy of the host tier for host-homed ones, blake3 verified
//! either way), then an ONNX Runtime session is created from those bytes; the session is the
//! expert's device-resident copy. Evicting drops the session. Without CUDA the "GPU" executor is
//! a second CPU executor; its name says so ([`standin_name`]).
//!
//! The executor keeps its own byte accounting against the budget the scheduler was given and
//! refuses a load that would exceed it, an eviction of an expert it is not holding, and a batch
//! of an expert that is not loaded: a policy bug surfaces as an error, never as silent overuse.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use troupe_kernels::onnx::{NamedTensor, OnnxSession, SessionConfig};
use troupe_kernels::{BlobId, Device, WeightStore};
use troupe_policy::coe::{CoeModel, ExpertId, Tier};

use super::CoeError;
use super::app::{INPUT_NAME, INPUT_WIDTH, Manifest};

/// The executor name used when a CPU stands in for a GPU, e.g. `gpu0-standin-cpu`.
pub fn standin_name(index: usize) -> String {
    format!("gpu{index}-standin-cpu")
}

/// What an executor has done.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExecutorCounters {
    /// Experts loaded.
    pub loads: u64,
    /// Seconds spent loading (read + verify + session creation).
    pub load_seconds: f64,
    /// Batches run.
    pub batches: u64,
    /// Requests run (sum of batch sizes).
    pub tasks: u64,
    /// Seconds spent running batches.
    pub run_seconds: f64,
    /// Highest resident expert bytes seen.
    pub peak_bytes: u64,
}

/// One executor (see the module docs).
pub struct ExpertExecutor {
    name: String,
    store: WeightStore,
    blobs: Vec<BlobId>,
    sizes: Vec<u64>,
    outputs: Vec<usize>,
    sessions: HashMap<ExpertId, OnnxSession>,
    budget: u64,
    resident: u64,
    session_config: SessionConfig,
    counters: ExecutorCounters,
}

impl std::fmt::Debug for ExpertExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertExecutor")
            .field("name", &self.name)
            .field("budget", &self.budget)
            .field("resident", &self.resident)
            .field("sessions", &self.sessions.len())
            .finish()
    }
}

impl ExpertExecutor {
    /// Open an executor named `name` over the app's store in `store_dir`, holding at most
    /// `budget` bytes of experts. Host-homed experts are read into the host tier now (the
    /// host tier is sized to hold exactly those).
    pub fn open(
        name: &str,
        store_dir: &Path,
        manifest: &Manifest,
        model: &CoeModel,
        budget: u64,
    ) -> Result<ExpertExecutor, CoeError> {
        let host_bytes: u64 =
            model.experts().iter().filter(|e| e.home == Tier::Host).map(|e| e.size_bytes).sum();
        // ONNX Runtime here is CPU-only: the session holds the device-resident copy of an expert,
        // so the store's own device arena is not used (it would be a second copy); the budget
        // the scheduler plans with is enforced by this executor's accounting of its sessions.
        let mut store = WeightStore::open(store_dir, &Device::Cpu, 0, host_bytes + 4096)?;
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
            if e.home == Tier::Host {
                store.load_to_host(&id)?;
            }
            blobs.push(id);
        }
        Ok(ExpertExecutor {
            name: name.to_string(),
            store,
            blobs,
            sizes: model.experts().iter().map(|e| e.size_bytes).collect(),
            outputs: manifest.experts.iter().map(|f| f.widths.last().copied().unwrap_or(0)).collect(),
            sessions: HashMap::new(),
            budget,
            resident: 0,
            session_config: SessionConfig { intra_threads: 1 },
            counters: ExecutorCounters::default(),
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

    /// Bytes the host tier holds (the store's own accounting; host-homed experts only).
    pub fn store_host_bytes(&self) -> u64 {
        self.store.stats().host_used
    }

    /// Bytes of sessions loaded, summed from the expert sizes (independent of `resident_bytes`).
    pub fn loaded_bytes(&self) -> u64 {
        self.sessions.keys().map(|e| self.sizes[e.index()]).sum()
    }

    /// What it has done so far.
    pub fn counters(&self) -> ExecutorCounters {
        self.counters
    }

    fn fail(&self, problem: String) -> CoeError {
        CoeError::Executor { executor: self.name.clone(), problem }
    }

    fn blob(&self, expert: ExpertId) -> Result<&BlobId, CoeError> {
        self.blobs.get(expert.index()).ok_or_else(|| self.fail(format!("unknown expert {expert}")))
    }

    /// Load `expert`: into the device tier (O_DIRECT read or host copy, checksummed), then a
    /// session from those bytes. Returns the time it took.
    pub fn load(&mut self, expert: ExpertId) -> Result<Duration, CoeError> {
        let start = Instant::now();
        let id = self.blob(expert)?.clone();
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
        // Disk-homed: an O_DIRECT read into a host buffer; host-homed: a copy of the host tier's
        // bytes. Both are checksummed; the session is the device-resident copy.
        let bytes = self.store.read(&id)?;
        let session = OnnxSession::from_bytes(&bytes, id.as_str(), &self.session_config)?;
        self.sessions.insert(expert, session);
        self.resident += size;
        self.counters.peak_bytes = self.counters.peak_bytes.max(self.resident);
        let took = start.elapsed();
        self.counters.loads += 1;
        self.counters.load_seconds += took.as_secs_f64();
        Ok(took)
    }

    /// Evict `expert`: drop its session and move the blob back to its home tier.
    pub fn evict(&mut self, expert: ExpertId) -> Result<(), CoeError> {
        let id = self.blob(expert)?.clone();
        if self.sessions.remove(&expert).is_none() {
            return Err(self.fail(format!("evicting {expert}, which is not loaded")));
        }
        self.resident -= self.sizes[expert.index()];
        let tier = self.store.tier(&id)?;
        tracing::trace!(executor = %self.name, %expert, ?tier, "evicted");
        Ok(())
    }

    /// Run one batch of `expert` on `inputs` (64 floats each); one output row per input.
    pub fn run_batch(&mut self, expert: ExpertId, inputs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CoeError> {
        let start = Instant::now();
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
        let out = session.run(&[NamedTensor::f32(INPUT_NAME, vec![inputs.len(), INPUT_WIDTH], x)])?;
        let probs = out
            .first()
            .and_then(NamedTensor::as_f32)
            .ok_or_else(|| self.fail(format!("{expert}: no f32 output")))?;
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
