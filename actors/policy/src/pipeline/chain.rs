//! Job submission check: a pipeline job's stages must form a linear DAG.
//!
//! Each stage is described by a [`StageSignature`] (name, SHA-256, size, input and output
//! tensors). [`check_chain`] refuses a broken chain before any task runs, naming the stage pair and
//! the tensor that does not connect and what differs (missing, dtype or rank).
//!
//! Connection rule (decided here; the paper only says "topology check"): stage `k`'s input named
//! `x` is satisfied by stage `k-1`'s output named `x` if there is one (then dtype and rank must
//! match), otherwise by the job's own input named `x` (a side input such as `attention_mask`, again
//! with matching dtype and rank). Stage 0 reads only job inputs. Every stage after the first must
//! consume at least one output of its predecessor, or the chain is not linear.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// Most stages a job may have (signatures come from an untrusted submission).
pub const MAX_STAGES: usize = 256;
/// Most input or output tensors a stage (or the job) may declare.
pub const MAX_TENSORS_PER_STAGE: usize = 256;
/// Longest stage or tensor name, in bytes.
pub const MAX_NAME_LEN: usize = 256;
/// Highest tensor rank accepted.
pub const MAX_RANK: usize = 16;

/// Element type of a tensor, as ONNX declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// bfloat16.
    Bf16,
    /// 64-bit float.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean.
    Bool,
}

impl DType {
    /// Lower-case name used in messages and test files.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = ChainError;
    fn from_str(s: &str) -> Result<Self, ChainError> {
        Ok(match s {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::Bf16,
            "f64" => DType::F64,
            "i8" => DType::I8,
            "i16" => DType::I16,
            "i32" => DType::I32,
            "i64" => DType::I64,
            "u8" => DType::U8,
            "bool" => DType::Bool,
            other => {
                return Err(ChainError::UnknownDType { dtype: other.chars().take(32).collect() });
            }
        })
    }
}

/// Name, element type and rank of one tensor a stage reads or writes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorSig {
    /// Tensor name (ONNX graph input/output name).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Number of dimensions.
    pub rank: usize,
}

impl TensorSig {
    /// Convenience constructor.
    pub fn new(name: &str, dtype: DType, rank: usize) -> Self {
        TensorSig { name: name.to_owned(), dtype, rank }
    }
}

impl fmt::Display for TensorSig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.name, self.dtype, self.rank)
    }
}

/// What the foreman knows about one stage file of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSignature {
    /// Human name of the stage (e.g. `cell_a`).
    pub name: String,
    /// SHA-256 of the stage file, 64 lower-case hex digits; the file travels by this reference.
    pub sha256: String,
    /// Size of the stage file in bytes.
    pub size_bytes: u64,
    /// Tensors the stage reads.
    pub inputs: Vec<TensorSig>,
    /// Tensors the stage writes.
    pub outputs: Vec<TensorSig>,
}

/// A checked linear chain of stages, ready to be turned into tasks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    stages: Vec<StageSignature>,
    job_inputs: Vec<TensorSig>,
}

impl Chain {
    /// The stages, in pipeline order.
    pub fn stages(&self) -> &[StageSignature] {
        &self.stages
    }

    /// Number of stages (at least 1).
    pub fn len(&self) -> usize {
        self.stages.len()
    }

    /// Always false: a checked chain has at least one stage.
    pub fn is_empty(&self) -> bool {
        self.stages.is_empty()
    }

    /// Stage `k`'s signature, if it exists.
    pub fn stage(&self, k: usize) -> Option<&StageSignature> {
        self.stages.get(k)
    }

    /// The job's original inputs.
    pub fn job_inputs(&self) -> &[TensorSig] {
        &self.job_inputs
    }

    /// Index of the smallest stage file (ties: the earliest), the one broadcast at job start.
    pub fn smallest_stage(&self) -> usize {
        let mut best = 0;
        for (k, s) in self.stages.iter().enumerate() {
            if s.size_bytes < self.stages[best].size_bytes {
                best = k;
            }
        }
        best
    }

    /// Index of the stage whose file has this hash, if any.
    pub fn stage_by_hash(&self, sha256: &str) -> Option<usize> {
        self.stages.iter().position(|s| s.sha256 == sha256)
    }
}

/// One end of a failed connection: a stage or the job's inputs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Producer {
    /// The job's original inputs.
    JobInputs,
    /// Stage `index` named `name`.
    Stage {
        /// Position in the chain.
        index: usize,
        /// Stage name.
        name: String,
    },
}

impl fmt::Display for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Producer::JobInputs => f.write_str("job inputs"),
            Producer::Stage { index, name } => write!(f, "stage #{index} '{name}'"),
        }
    }
}

/// Why a submitted chain was refused.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ChainError {
    /// No stages at all.
    #[error("job has no stages")]
    Empty,
    /// More stages than [`MAX_STAGES`].
    #[error("job has {count} stages, more than the limit {MAX_STAGES}")]
    TooManyStages {
        /// Stages submitted.
        count: usize,
    },
    /// A stage or the job declares more tensors than [`MAX_TENSORS_PER_STAGE`].
    #[error("{owner} declares {count} tensors, more than the limit {MAX_TENSORS_PER_STAGE}")]
    TooManyTensors {
        /// Who declared them.
        owner: String,
        /// How many.
        count: usize,
    },
    /// A name is empty or longer than [`MAX_NAME_LEN`].
    #[error("{owner}: name of {len} bytes is empty or longer than {MAX_NAME_LEN}")]
    BadName {
        /// Who carries the name.
        owner: String,
        /// Its length.
        len: usize,
    },
    /// A rank above [`MAX_RANK`].
    #[error("{owner}: tensor '{tensor}' has rank {rank}, above the limit {MAX_RANK}")]
    BadRank {
        /// Who declared it.
        owner: String,
        /// Tensor name.
        tensor: String,
        /// Declared rank.
        rank: usize,
    },
    /// An unknown dtype name.
    #[error("unknown dtype '{dtype}'")]
    UnknownDType {
        /// The name given (first 32 chars).
        dtype: String,
    },
    /// The SHA-256 is not 64 lower-case hex digits.
    #[error("stage #{stage} '{name}': sha256 is not 64 lower-case hex digits")]
    BadHash {
        /// Stage index.
        stage: usize,
        /// Stage name.
        name: String,
    },
    /// A stage file of size zero.
    #[error("stage #{stage} '{name}': size is zero")]
    EmptyStage {
        /// Stage index.
        stage: usize,
        /// Stage name.
        name: String,
    },
    /// Two tensors with the same name on one side of a stage (or among the job inputs).
    #[error("{owner}: tensor '{tensor}' declared twice")]
    DuplicateTensor {
        /// Who declared it.
        owner: String,
        /// Tensor name.
        tensor: String,
    },
    /// A stage produces no output.
    #[error("stage #{stage} '{name}' has no outputs")]
    NoOutputs {
        /// Stage index.
        stage: usize,
        /// Stage name.
        name: String,
    },
    /// An input that neither the previous stage nor the job inputs provide.
    #[error(
        "{from} -> stage #{to} '{to_name}': input '{tensor}' is produced by neither {from} nor the job inputs"
    )]
    MissingInput {
        /// The upstream side.
        from: Producer,
        /// Consuming stage index.
        to: usize,
        /// Consuming stage name.
        to_name: String,
        /// The input tensor.
        tensor: String,
    },
    /// A first-stage input that is not among the job inputs.
    #[error("job inputs -> stage #{to} '{to_name}': input '{tensor}' is not a job input")]
    MissingJobInput {
        /// Consuming stage index.
        to: usize,
        /// Consuming stage name.
        to_name: String,
        /// The input tensor.
        tensor: String,
    },
    /// A connected tensor whose element type differs.
    #[error(
        "{from} -> stage #{to} '{to_name}': tensor '{tensor}' dtype differs: produced {produced}, expected {expected}"
    )]
    DTypeMismatch {
        /// The producing side.
        from: Producer,
        /// Consuming stage index.
        to: usize,
        /// Consuming stage name.
        to_name: String,
        /// The tensor.
        tensor: String,
        /// What the producer declares.
        produced: DType,
        /// What the consumer expects.
        expected: DType,
    },
    /// A connected tensor whose rank differs.
    #[error(
        "{from} -> stage #{to} '{to_name}': tensor '{tensor}' rank differs: produced {produced}, expected {expected}"
    )]
    RankMismatch {
        /// The producing side.
        from: Producer,
        /// Consuming stage index.
        to: usize,
        /// Consuming stage name.
        to_name: String,
        /// The tensor.
        tensor: String,
        /// Rank the producer declares.
        produced: usize,
        /// Rank the consumer expects.
        expected: usize,
    },
    /// A stage reads nothing its predecessor wrote: the chain is not linear.
    #[error(
        "stage #{from} '{from_name}' -> stage #{to} '{to_name}': no output of the first feeds the second"
    )]
    Disconnected {
        /// Upstream stage index.
        from: usize,
        /// Upstream stage name.
        from_name: String,
        /// Downstream stage index.
        to: usize,
        /// Downstream stage name.
        to_name: String,
    },
}

/// Whether `s` is 64 lower-case hex digits.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn check_name(owner: &str, name: &str) -> Result<(), ChainError> {
    if name.is_empty() || name.len() > MAX_NAME_LEN {
        return Err(ChainError::BadName {
            owner: owner.chars().take(MAX_NAME_LEN).collect(),
            len: name.len(),
        });
    }
    Ok(())
}

/// Checks one side (inputs or outputs) of a stage, returning a by-name index.
fn index_side<'a>(
    owner: &str,
    side: &'a [TensorSig],
) -> Result<BTreeMap<&'a str, &'a TensorSig>, ChainError> {
    if side.len() > MAX_TENSORS_PER_STAGE {
        return Err(ChainError::TooManyTensors { owner: owner.to_owned(), count: side.len() });
    }
    let mut map = BTreeMap::new();
    for t in side {
        check_name(owner, &t.name)?;
        if t.rank > MAX_RANK {
            return Err(ChainError::BadRank {
                owner: owner.to_owned(),
                tensor: t.name.clone(),
                rank: t.rank,
            });
        }
        if map.insert(t.name.as_str(), t).is_some() {
            return Err(ChainError::DuplicateTensor { owner: owner.to_owned(), tensor: t.name.clone() });
        }
    }
    Ok(map)
}

/// Compares a consumer's expectation with what a producer declares.
fn connect(
    from: &Producer,
    to: usize,
    to_name: &str,
    produced: &TensorSig,
    expected: &TensorSig,
) -> Result<(), ChainError> {
    if produced.dtype != expected.dtype {
        return Err(ChainError::DTypeMismatch {
            from: from.clone(),
            to,
            to_name: to_name.to_owned(),
            tensor: expected.name.clone(),
            produced: produced.dtype,
            expected: expected.dtype,
        });
    }
    if produced.rank != expected.rank {
        return Err(ChainError::RankMismatch {
            from: from.clone(),
            to,
            to_name: to_name.to_owned(),
            tensor: expected.name.clone(),
            produced: produced.rank,
            expected: expected.rank,
        });
    }
    Ok(())
}

/// Checks that `stages` form a linear DAG fed by `job_inputs`; see the module doc for the rule.
pub fn check_chain(stages: &[StageSignature], job_inputs: &[TensorSig]) -> Result<Chain, ChainError> {
    if stages.is_empty() {
        return Err(ChainError::Empty);
    }
    if stages.len() > MAX_STAGES {
        return Err(ChainError::TooManyStages { count: stages.len() });
    }
    let job = index_side("job inputs", job_inputs)?;
    let mut prev_outputs: Option<BTreeMap<&str, &TensorSig>> = None;
    for (k, stage) in stages.iter().enumerate() {
        check_name(&format!("stage #{k}"), &stage.name)?;
        let owner = format!("stage #{k} '{}'", stage.name);
        if !is_sha256_hex(&stage.sha256) {
            return Err(ChainError::BadHash { stage: k, name: stage.name.clone() });
        }
        if stage.size_bytes == 0 {
            return Err(ChainError::EmptyStage { stage: k, name: stage.name.clone() });
        }
        index_side(&owner, &stage.inputs)?;
        let outputs = index_side(&owner, &stage.outputs)?;
        if outputs.is_empty() {
            return Err(ChainError::NoOutputs { stage: k, name: stage.name.clone() });
        }
        let upstream = match k {
            0 => Producer::JobInputs,
            _ => Producer::Stage { index: k - 1, name: stages[k - 1].name.clone() },
        };
        let mut fed_by_prev = 0usize;
        for t in &stage.inputs {
            let from_prev = prev_outputs.as_ref().and_then(|m| m.get(t.name.as_str()));
            if let Some(produced) = from_prev {
                connect(&upstream, k, &stage.name, produced, t)?;
                fed_by_prev += 1;
            } else if let Some(produced) = job.get(t.name.as_str()) {
                connect(&Producer::JobInputs, k, &stage.name, produced, t)?;
            } else if k == 0 {
                return Err(ChainError::MissingJobInput {
                    to: k,
                    to_name: stage.name.clone(),
                    tensor: t.name.clone(),
                });
            } else {
                return Err(ChainError::MissingInput {
                    from: upstream,
                    to: k,
                    to_name: stage.name.clone(),
                    tensor: t.name.clone(),
                });
            }
        }
        if k > 0 && fed_by_prev == 0 {
            return Err(ChainError::Disconnected {
                from: k - 1,
                from_name: stages[k - 1].name.clone(),
                to: k,
                to_name: stage.name.clone(),
            });
        }
        prev_outputs = Some(outputs);
    }
    Ok(Chain { stages: stages.to_vec(), job_inputs: job_inputs.to_vec() })
}
