//! A pipeline job as submitted: stage files with their SHA-256 and tensor signatures, the inputs,
//! and the checks that refuse a broken job before any task runs.

use std::path::Path;
use std::sync::Arc;

use troupe_kernels::onnx::{ElementType, IoSpec, NamedTensor, OnnxSession, SessionConfig};
use troupe_policy::pipeline::chain::{Chain, DType, StageSignature, TensorSig, check_chain};
use troupe_policy::pipeline::{ChainError, Mode};

use super::worker::{MAX_STAGE_BYTES, sha256_hex};

/// Most inputs one job may have.
pub const MAX_INPUTS: usize = 4096;

/// One stage file, in memory on the foreman (served to workers by its BLAKE3).
#[derive(Clone, Debug)]
pub struct StageFile {
    /// Where it came from (a path or a label).
    pub origin: String,
    /// Its bytes.
    pub bytes: Arc<Vec<u8>>,
    /// What the chain check sees: name, SHA-256, size, inputs and outputs.
    pub signature: StageSignature,
}

/// A checked job, ready for the foreman.
#[derive(Clone, Debug)]
pub struct PipelineJob {
    /// The checked chain.
    pub chain: Chain,
    /// The stage files, in chain order.
    pub stages: Vec<StageFile>,
    /// Per input, the job's tensors (e.g. `input_ids`, `attention_mask`).
    pub inputs: Vec<Vec<NamedTensor>>,
    /// Streaming or barrier dependencies.
    pub mode: Mode,
    /// Send f32 activations as bf16 (lossy) instead of lossless.
    pub lossy_bf16: bool,
}

/// Why a job was refused.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// A stage file could not be read.
    #[error("stage file {path}: {detail}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        detail: String,
    },
    /// A stage file is not a usable ONNX model.
    #[error("stage file {origin} is not a usable ONNX model: {detail}")]
    Malformed {
        /// The file.
        origin: String,
        /// ONNX Runtime's message.
        detail: String,
    },
    /// A stage declares a tensor type the pipeline cannot carry.
    #[error("stage file {origin}: tensor '{tensor}' has type {dtype}; stages may only pass f32 and i64")]
    Unsupported {
        /// The file.
        origin: String,
        /// The tensor.
        tensor: String,
        /// Its type.
        dtype: String,
    },
    /// The chain is not a linear DAG (the message names the tensor).
    #[error("stage chain refused: {0}")]
    Chain(#[from] ChainError),
    /// Inputs missing, too many, or not alike.
    #[error("inputs: {0}")]
    Inputs(String),
}

fn dtype_of(origin: &str, spec: &IoSpec) -> Result<DType, JobError> {
    match &spec.dtype {
        ElementType::F32 => Ok(DType::F32),
        ElementType::I64 => Ok(DType::I64),
        ElementType::Other(o) => Err(JobError::Unsupported {
            origin: origin.to_owned(),
            tensor: spec.name.clone(),
            dtype: o.clone(),
        }),
    }
}

impl StageFile {
    /// Reads a stage file (size-capped) and introspects it with ONNX Runtime.
    pub fn from_path(path: &Path) -> Result<Self, JobError> {
        let origin = path.display().to_string();
        let read = |detail: String| JobError::Read { path: origin.clone(), detail };
        let len = std::fs::metadata(path).map_err(|e| read(e.to_string()))?.len();
        if len > MAX_STAGE_BYTES {
            return Err(read(format!("{len} bytes is above the {MAX_STAGE_BYTES}-byte cap")));
        }
        let bytes = std::fs::read(path).map_err(|e| read(e.to_string()))?;
        let name = path.file_stem().map_or_else(|| origin.clone(), |s| s.to_string_lossy().into_owned());
        Self::from_bytes(&name, &origin, bytes)
    }

    /// Introspects a stage from its bytes: the session is created once and dropped.
    pub fn from_bytes(name: &str, origin: &str, bytes: Vec<u8>) -> Result<Self, JobError> {
        if bytes.is_empty() {
            return Err(JobError::Malformed {
                origin: origin.to_owned(),
                detail: "the file is empty".into(),
            });
        }
        let session = OnnxSession::from_bytes(&bytes, origin, &SessionConfig::default())
            .map_err(|e| JobError::Malformed { origin: origin.to_owned(), detail: e.to_string() })?;
        let sigs = |specs: &[IoSpec]| -> Result<Vec<TensorSig>, JobError> {
            specs
                .iter()
                .map(|s| Ok(TensorSig { name: s.name.clone(), dtype: dtype_of(origin, s)?, rank: s.rank() }))
                .collect()
        };
        let signature = StageSignature {
            name: name.to_owned(),
            sha256: sha256_hex(&bytes),
            size_bytes: bytes.len() as u64,
            inputs: sigs(session.inputs())?,
            outputs: sigs(session.outputs())?,
        };
        drop(session);
        Ok(StageFile { origin: origin.to_owned(), bytes: Arc::new(bytes), signature })
    }
}

/// Checks stages and inputs together and builds the job; nothing runs if this fails.
pub fn build_job(
    stages: Vec<StageFile>,
    inputs: Vec<Vec<NamedTensor>>,
    mode: Mode,
    lossy_bf16: bool,
) -> Result<PipelineJob, JobError> {
    let first = inputs.first().ok_or_else(|| JobError::Inputs("no inputs".into()))?;
    if inputs.len() > MAX_INPUTS {
        return Err(JobError::Inputs(format!("{} inputs, more than the limit {MAX_INPUTS}", inputs.len())));
    }
    let sig_of = |t: &NamedTensor| -> Result<TensorSig, JobError> {
        let dtype = match t.element_type() {
            ElementType::F32 => DType::F32,
            ElementType::I64 => DType::I64,
            ElementType::Other(o) => return Err(JobError::Inputs(format!("{}: type {o}", t.name))),
        };
        Ok(TensorSig { name: t.name.clone(), dtype, rank: t.shape.len() })
    };
    let job_inputs: Vec<TensorSig> = first.iter().map(sig_of).collect::<Result<_, _>>()?;
    for (i, inp) in inputs.iter().enumerate() {
        let sigs: Vec<TensorSig> = inp.iter().map(sig_of).collect::<Result<_, _>>()?;
        if sigs != job_inputs {
            return Err(JobError::Inputs(format!("input {i} has other tensors than input 0")));
        }
        for t in inp {
            t.check_shape().map_err(|e| JobError::Inputs(format!("input {i}: {e}")))?;
        }
    }
    let signatures: Vec<StageSignature> = stages.iter().map(|s| s.signature.clone()).collect();
    let chain = check_chain(&signatures, &job_inputs)?;
    Ok(PipelineJob { chain, stages, inputs, mode, lossy_bf16 })
}
