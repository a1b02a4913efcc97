//! One ONNX Runtime session: created from a file or bytes, run with named f32/i64 tensors, its
//! inputs and outputs introspected, its resident memory measured.
//!
//! Memory method: the process RSS (`/proc/self/statm`) is read just before the session is created,
//! just after, and just after the first run; [`SessionMemory::resident_bytes`] is the growth from
//! before creation to after the first run (weights, graph, and the arena the first run allocates).
//! It is a process-wide counter, so it is exact only when no other thread allocates meanwhile;
//! memory another session already freed may also be reused.

use std::path::Path;

use ort::session::builder::SessionBuilder;
use ort::session::{Session, SessionInputValue};
use ort::value::{TensorRef, ValueType};

use super::OnnxError;
use super::memory::resident_bytes;
use super::runtime::runtime;
use super::tensor::{ElementType, NamedTensor, TensorData};

/// Options for creating a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Threads ONNX Runtime uses inside one operator; 0 lets it choose (one per core).
    pub intra_threads: usize,
    /// Memory before speed, for a phone-class process that holds one session: no CPU arena (freed
    /// buffers go back to the allocator, not to an arena that keeps them) and no memory pattern
    /// (no block planned for the largest run). Outputs are bit for bit the same.
    pub lean_memory: bool,
}

impl Default for SessionConfig {
    /// One intra-op thread: actors run sessions side by side on small machines.
    fn default() -> Self {
        Self { intra_threads: 1, lean_memory: false }
    }
}

impl SessionConfig {
    /// `intra_threads` threads, memory before speed (see [`SessionConfig::lean_memory`]).
    pub fn lean(intra_threads: usize) -> Self {
        Self { intra_threads, lean_memory: true }
    }
}

/// A graph input or output as the model declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: ElementType,
    /// Dimensions; `None` where symbolic (e.g. batch, seq). The length is the rank.
    pub dims: Vec<Option<u64>>,
}

impl IoSpec {
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    fn from_ort(name: &str, dtype: &ValueType) -> Self {
        match dtype {
            ValueType::Tensor { ty, shape, .. } => Self {
                name: name.to_owned(),
                dtype: match ty {
                    ort::value::TensorElementType::Float32 => ElementType::F32,
                    ort::value::TensorElementType::Int64 => ElementType::I64,
                    other => ElementType::Other(format!("{other:?}")),
                },
                dims: shape.iter().map(|&d| u64::try_from(d).ok()).collect(),
            },
            other => Self {
                name: name.to_owned(),
                dtype: ElementType::Other(format!("{other:?}")),
                dims: Vec::new(),
            },
        }
    }
}

/// Process RSS around a session's creation and first run (see the module doc for the method).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SessionMemory {
    /// RSS just before the session was created, bytes.
    pub rss_before: u64,
    /// RSS just after it was created.
    pub rss_after_load: u64,
    /// RSS just after its first run; `None` until it has run.
    pub rss_after_first_run: Option<u64>,
}

impl SessionMemory {
    /// Growth from before creation to after creation.
    pub fn load_bytes(&self) -> u64 {
        self.rss_after_load.saturating_sub(self.rss_before)
    }

    /// Growth from before creation to after the first run: the session's resident footprint.
    pub fn resident_bytes(&self) -> Option<u64> {
        self.rss_after_first_run.map(|r| r.max(self.rss_after_load).saturating_sub(self.rss_before))
    }
}

/// A loaded model, ready to run.
#[derive(Debug)]
pub struct OnnxSession {
    origin: String,
    session: Session,
    inputs: Vec<IoSpec>,
    outputs: Vec<IoSpec>,
    memory: SessionMemory,
}

impl OnnxSession {
    /// Loads the model at `path`.
    pub fn from_file(path: &Path, config: &SessionConfig) -> Result<Self, OnnxError> {
        if !path.is_file() {
            return Err(OnnxError::ModelMissing { path: path.to_path_buf() });
        }
        let env = runtime()?;
        let origin = path.display().to_string();
        Self::create(origin, config, |builder| builder.commit_from_file(path), env)
    }

    /// Loads the model at `path` with its large initializers memory-mapped from disk rather than
    /// copied into memory: the file is rewritten once, streaming, into `<path>.mapped/` (a small
    /// model plus a page-aligned external-data file, see [`super::mapped`]) and ONNX Runtime
    /// loads that, mapping the data file. Only the pages a run reads (e.g. the embedding rows of
    /// the tokens seen) become resident; outputs are those of [`Self::from_file`]. The folder
    /// needs to be writable; it is reused while the source's length and mtime are unchanged.
    pub fn from_file_mapped(path: &Path, config: &SessionConfig) -> Result<Self, OnnxError> {
        if !path.is_file() {
            return Err(OnnxError::ModelMissing { path: path.to_path_buf() });
        }
        let env = runtime()?;
        let rewritten = super::mapped::externalized_beside(path)?;
        let origin = path.display().to_string();
        Self::create(origin, config, |builder| builder.commit_from_file(&rewritten), env)
    }

    /// Loads a model from its bytes; `origin` labels it in errors (e.g. the peer or file it came from).
    pub fn from_bytes(bytes: &[u8], origin: &str, config: &SessionConfig) -> Result<Self, OnnxError> {
        let env = runtime()?;
        Self::create(origin.to_owned(), config, |builder| builder.commit_from_memory(bytes), env)
    }

    fn create(
        origin: String,
        config: &SessionConfig,
        commit: impl FnOnce(&mut SessionBuilder) -> ort::Result<Session>,
        env: &ort::environment::Environment,
    ) -> Result<Self, OnnxError> {
        let session_err = |detail: String| OnnxError::Session { origin: origin.clone(), detail };
        let rss_before = resident_bytes().unwrap_or(0);
        let mut builder = Session::builder(env).map_err(|e| session_err(e.to_string()))?;
        if config.intra_threads > 0 {
            builder =
                builder.with_intra_threads(config.intra_threads).map_err(|e| session_err(e.to_string()))?;
        }
        if config.lean_memory {
            builder = lean(builder).map_err(|e| session_err(e.to_string()))?;
        }
        let session = commit(&mut builder).map_err(|e| {
            use ort::error::ErrorCode as C;
            match e.code() {
                // what ORT reports for garbage, empty, truncated or unsupported graphs
                C::InvalidProtobuf
                | C::InvalidGraph
                | C::InvalidArgument
                | C::NoModel
                | C::NotImplemented
                | C::GenericFailure => {
                    OnnxError::ModelMalformed { origin: origin.clone(), detail: e.to_string() }
                }
                _ => session_err(format!("{e} [code {:?}]", e.code())),
            }
        })?;
        let rss_after_load = resident_bytes().unwrap_or(0);
        let inputs = session.inputs().iter().map(|o| IoSpec::from_ort(o.name(), o.dtype())).collect();
        let outputs = session.outputs().iter().map(|o| IoSpec::from_ort(o.name(), o.dtype())).collect();
        Ok(Self {
            origin,
            session,
            inputs,
            outputs,
            memory: SessionMemory { rss_before, rss_after_load, rss_after_first_run: None },
        })
    }

    /// The file path or label the session was created from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The model's inputs, in graph order.
    pub fn inputs(&self) -> &[IoSpec] {
        &self.inputs
    }

    /// The model's outputs, in graph order.
    pub fn outputs(&self) -> &[IoSpec] {
        &self.outputs
    }

    /// Resident memory measured around creation and the first run.
    pub fn memory(&self) -> SessionMemory {
        self.memory
    }

    /// Runs the model. Every model input must be given exactly once, with its type and rank (and
    /// any fixed dimension); outputs come back in graph order.
    pub fn run(&mut self, inputs: &[NamedTensor]) -> Result<Vec<NamedTensor>, OnnxError> {
        self.check_inputs(inputs)?;
        let input_err = |detail: String| OnnxError::Input { origin: self.origin.clone(), detail };
        let mut values: Vec<(String, SessionInputValue<'_>)> = Vec::with_capacity(inputs.len());
        for t in inputs {
            let value: SessionInputValue<'_> = match &t.data {
                TensorData::F32(v) => TensorRef::from_array_view((t.shape.clone(), v.as_slice()))
                    .map_err(|e| input_err(format!("{}: {e}", t.name)))?
                    .into(),
                TensorData::I64(v) => TensorRef::from_array_view((t.shape.clone(), v.as_slice()))
                    .map_err(|e| input_err(format!("{}: {e}", t.name)))?
                    .into(),
            };
            values.push((t.name.clone(), value));
        }
        let origin = &self.origin;
        let outputs = self
            .session
            .run(values)
            .map_err(|e| OnnxError::Run { origin: origin.clone(), detail: e.to_string() })?;
        let mut result = Vec::with_capacity(self.outputs.len());
        for spec in &self.outputs {
            let value = outputs.get(&spec.name).ok_or_else(|| OnnxError::Run {
                origin: origin.clone(),
                detail: format!("output {} missing from the results", spec.name),
            })?;
            let unsupported = || OnnxError::Output {
                origin: origin.clone(),
                name: spec.name.clone(),
                dtype: format!("{:?}", value.dtype()),
            };
            let tensor = match value.dtype().tensor_type() {
                Some(ort::value::TensorElementType::Float32) => {
                    let (shape, data) = value.try_extract_tensor::<f32>().map_err(|_| unsupported())?;
                    NamedTensor::f32(&spec.name, dims(shape), data.to_vec())
                }
                Some(ort::value::TensorElementType::Int64) => {
                    let (shape, data) = value.try_extract_tensor::<i64>().map_err(|_| unsupported())?;
                    NamedTensor::i64(&spec.name, dims(shape), data.to_vec())
                }
                _ => return Err(unsupported()),
            };
            result.push(tensor);
        }
        drop(outputs);
        if self.memory.rss_after_first_run.is_none() {
            self.memory.rss_after_first_run = resident_bytes();
        }
        Ok(result)
    }

    fn check_inputs(&self, given: &[NamedTensor]) -> Result<(), OnnxError> {
        let err = |detail: String| OnnxError::Input { origin: self.origin.clone(), detail };
        for (i, t) in given.iter().enumerate() {
            if given[..i].iter().any(|o| o.name == t.name) {
                return Err(err(format!("{} given twice", t.name)));
            }
            let spec = self.inputs.iter().find(|s| s.name == t.name).ok_or_else(|| {
                err(format!("{} is not an input (inputs: {})", t.name, names(&self.inputs)))
            })?;
            t.check_shape().map_err(&err)?;
            if spec.dtype != t.element_type() {
                return Err(err(format!(
                    "{} is {}, the model wants {}",
                    t.name,
                    t.element_type(),
                    spec.dtype
                )));
            }
            if spec.rank() != t.shape.len() {
                return Err(err(format!(
                    "{} has rank {} (shape {:?}), the model wants rank {}",
                    t.name,
                    t.shape.len(),
                    t.shape,
                    spec.rank()
                )));
            }
            for (axis, (want, &got)) in spec.dims.iter().zip(&t.shape).enumerate() {
                if let Some(want) = *want
                    && want != got as u64
                {
                    return Err(err(format!("{} has {got} on axis {axis}, the model wants {want}", t.name)));
                }
            }
        }
        if let Some(missing) = self.inputs.iter().find(|s| !given.iter().any(|t| t.name == s.name)) {
            return Err(err(format!("input {} not given", missing.name)));
        }
        Ok(())
    }
}

/// Checks that consecutive stage sessions fit: each input of stage k must be an output of stage k-1
/// or an input of stage 0 (job inputs such as `attention_mask` travel with the activations), with
/// the same element type and rank. A first stage that does not itself read every job input (a
/// stage holding only the embedding table takes `input_ids` alone) needs [`check_chain_with`].
pub fn check_chain(stages: &[&OnnxSession]) -> Result<(), OnnxError> {
    let Some(first) = stages.first() else {
        return Ok(());
    };
    check_chain_with(stages, first.inputs())
}

/// [`check_chain`] with the job's inputs named explicitly: each input of stage k must be an output
/// of stage k-1 or one of `job_inputs`, with the same element type and rank.
pub fn check_chain_with(stages: &[&OnnxSession], job_inputs: &[IoSpec]) -> Result<(), OnnxError> {
    if let Some(first) = stages.first() {
        for input in first.inputs() {
            let given = job_inputs.iter().find(|j| j.name == input.name);
            if !given.is_some_and(|g| g.dtype == input.dtype && g.rank() == input.rank()) {
                return Err(OnnxError::Chain {
                    detail: format!(
                        "stage 0 ({}) needs {} as {} rank {}, which the job does not provide (inputs: {})",
                        first.origin(),
                        input.name,
                        input.dtype,
                        input.rank(),
                        names(job_inputs)
                    ),
                });
            }
        }
    }
    for (k, pair) in stages.windows(2).enumerate() {
        let (prev, next) = (pair[0], pair[1]);
        for input in next.inputs() {
            let provider = prev
                .outputs()
                .iter()
                .chain(job_inputs)
                .find(|o| o.name == input.name)
                .ok_or_else(|| OnnxError::Chain {
                    detail: format!(
                        "stage {} ({}) needs {}, which stage {k} ({}) does not produce (outputs: {}) and the job does not provide (inputs: {})",
                        k + 1,
                        next.origin(),
                        input.name,
                        prev.origin(),
                        names(prev.outputs()),
                        names(job_inputs)
                    ),
                })?;
            if provider.dtype != input.dtype || provider.rank() != input.rank() {
                return Err(OnnxError::Chain {
                    detail: format!(
                        "stage {} ({}) wants {} as {} rank {}, it comes as {} rank {}",
                        k + 1,
                        next.origin(),
                        input.name,
                        input.dtype,
                        input.rank(),
                        provider.dtype,
                        provider.rank()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The session options of [`SessionConfig::lean_memory`]. Prepacking stays on: off, it saved
/// about 5% of a stage's weight bytes in peak RSS but moved outputs by up to 1.3e-7 (MatMul packs
/// its weights per run and sums in another order).
fn lean(builder: SessionBuilder) -> ort::Result<SessionBuilder> {
    let cpu = ort::ep::CPU::default().with_arena_allocator(false).build();
    Ok(builder.with_execution_providers([cpu])?.with_memory_pattern(false)?)
}

fn names(specs: &[IoSpec]) -> String {
    specs.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(", ")
}

/// ONNX Runtime reports concrete output dims as non-negative i64.
fn dims(shape: &[i64]) -> Vec<usize> {
    shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect()
}
