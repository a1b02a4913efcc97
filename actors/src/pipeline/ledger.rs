//! The durable half of a pipeline job: that it was accepted, and each input's answer (its
//! last-stage outputs), journaled on the foreman's node before they count, so that a foreman
//! node killed mid-job and started again resumes the job: nothing accepted is lost, no input is
//! answered twice.
//!
//! Records (rkyv, read with checked access) in a [`Journal`]:
//! - `Accepted { job, inputs }` first and once: the job's BLAKE3 digest (stage SHA-256s, mode,
//!   encoding and every input tensor), so a journal is never replayed against another job;
//! - `Answered { input, outputs }` at most once per input.
//!
//! Anything else (a second acceptance, an answer before it, an input out of range, an answer
//! twice, a tensor whose shape does not match its data) is refused by name at open.
//!
//! Never compacted ([`Journal::compact`]): every record stays live until the job's outputs are
//! written (each answer is part of them), and then the journal is removed; it is bounded by the
//! job itself (one acceptance, at most one answer per input).

use std::path::{Path, PathBuf};

use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};
use troupe_kernels::onnx::{NamedTensor, TensorData};

use super::job::PipelineJob;
use crate::journal::{Journal, JournalError, MAX_RECORD, TailDamage};

/// Most output tensors one answer may carry.
const MAX_TENSORS: usize = 64;

/// Why a job's journal could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The journal itself (I/O, magic, corruption, a record past the cap).
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The journal holds records this job cannot replay.
    #[error("journal {path}: {detail}")]
    Invalid {
        /// The journal file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
}

/// One tensor as journaled.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
struct JournalTensor {
    name: String,
    shape: Vec<u64>,
    f32: Vec<f32>,
    i64: Vec<i64>,
    is_f32: bool,
}

/// One journal record of a pipeline job.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
enum PipelineRecord {
    /// The job was accepted.
    Accepted {
        /// BLAKE3 of the job (see [`job_digest`]).
        job: [u8; 32],
        /// Its number of inputs.
        inputs: u32,
    },
    /// Input `input` was answered with these outputs.
    Answered {
        /// The input.
        input: u32,
        /// Its last-stage outputs.
        outputs: Vec<JournalTensor>,
    },
}

fn to_journal(t: &NamedTensor) -> JournalTensor {
    let shape = t.shape.iter().map(|&d| d as u64).collect();
    match &t.data {
        TensorData::F32(v) => {
            JournalTensor { name: t.name.clone(), shape, f32: v.clone(), i64: Vec::new(), is_f32: true }
        }
        TensorData::I64(v) => {
            JournalTensor { name: t.name.clone(), shape, f32: Vec::new(), i64: v.clone(), is_f32: false }
        }
    }
}

fn from_journal(t: JournalTensor) -> Result<NamedTensor, String> {
    let shape: Vec<usize> = t
        .shape
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("tensor '{}': dimension {d} too large", t.name)))
        .collect::<Result<_, _>>()?;
    let tensor = if t.is_f32 {
        NamedTensor::f32(t.name, shape, t.f32)
    } else {
        NamedTensor::i64(t.name, shape, t.i64)
    };
    tensor.check_shape().map_err(|e| format!("tensor '{}': {e}", tensor.name))?;
    Ok(tensor)
}

/// BLAKE3 of what makes a job this job: its stages (SHA-256), mode, encoding and every input
/// tensor (name, shape, elements).
pub fn job_digest(job: &PipelineJob) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"troupe pipeline job v1");
    for s in &job.stages {
        h.update(s.signature.sha256.as_bytes());
    }
    h.update(job.mode.to_string().as_bytes());
    h.update(&[u8::from(job.lossy_bf16)]);
    h.update(&(job.inputs.len() as u64).to_le_bytes());
    for input in &job.inputs {
        h.update(&(input.len() as u64).to_le_bytes());
        for t in input {
            hash_tensor(&mut h, t);
        }
    }
    *h.finalize().as_bytes()
}

/// Adds tensor `t` to `h`: its name and shape (each length-prefixed) and its values, little
/// endian (what a job's digest is made of; the simulation hashes outputs the same way).
pub fn hash_tensor(h: &mut blake3::Hasher, t: &NamedTensor) {
    h.update(&(t.name.len() as u64).to_le_bytes());
    h.update(t.name.as_bytes());
    h.update(&(t.shape.len() as u64).to_le_bytes());
    for d in &t.shape {
        h.update(&(*d as u64).to_le_bytes());
    }
    match &t.data {
        TensorData::F32(v) => v.iter().for_each(|x| {
            h.update(&x.to_le_bytes());
        }),
        TensorData::I64(v) => v.iter().for_each(|x| {
            h.update(&x.to_le_bytes());
        }),
    }
}

fn encode(record: &PipelineRecord) -> Result<Vec<u8>, String> {
    rkyv::to_bytes::<rancor::Error>(record).map(|b| b.to_vec()).map_err(|e| e.to_string())
}

fn decode(bytes: &[u8]) -> Result<PipelineRecord, String> {
    crate::decode::decode("pipeline journal record", bytes, MAX_RECORD, &mut crate::decode::plain_budget())
        .map_err(|e| e.to_string())
}

/// What a journal held when the job was opened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resumed {
    /// The journal's path.
    pub path: Option<PathBuf>,
    /// The job was accepted by an earlier run of this node.
    pub resumed: bool,
    /// Inputs already answered.
    pub answered: usize,
    /// A torn tail that was found, named and cut off (never replayed).
    pub damage: Option<TailDamage>,
}

/// A job's accepted inputs and their answers, journaled when a journal is given.
#[derive(Debug)]
pub struct Ledger {
    journal: Option<Journal>,
    answered: Vec<Option<Vec<NamedTensor>>>,
}

impl Ledger {
    /// A ledger kept in memory only (a job that does not outlive its process).
    pub fn in_memory(inputs: usize) -> Self {
        Ledger { journal: None, answered: vec![None; inputs] }
    }

    /// Opens (or creates) `path` for `job`: replays what an earlier run of this node accepted and
    /// answered, or journals the acceptance (synced) when the journal is new.
    pub fn open(path: &Path, job: &PipelineJob) -> Result<(Self, Resumed), LedgerError> {
        let invalid = |detail: String| LedgerError::Invalid { path: path.to_path_buf(), detail };
        let (mut journal, replay) = Journal::open(path)?;
        let digest = job_digest(job);
        let n = job.inputs.len();
        let mut answered: Vec<Option<Vec<NamedTensor>>> = vec![None; n];
        let mut accepted = false;
        for (i, body) in replay.records.iter().enumerate() {
            let record = decode(body).map_err(|e| invalid(format!("record {i} does not decode: {e}")))?;
            match record {
                PipelineRecord::Accepted { job, inputs } => {
                    if accepted {
                        return Err(invalid(format!("record {i}: the job is accepted twice")));
                    }
                    if job != digest || inputs as usize != n {
                        return Err(invalid(format!(
                            "it belongs to another job ({inputs} inputs, digest {}; this job: {n} inputs, \
                             digest {}); remove it to start this job afresh",
                            hex(&job),
                            hex(&digest)
                        )));
                    }
                    accepted = true;
                }
                PipelineRecord::Answered { input, outputs } => {
                    if !accepted {
                        return Err(invalid(format!(
                            "record {i}: input {input} answered before the job was accepted"
                        )));
                    }
                    let slot = answered.get_mut(input as usize).ok_or_else(|| {
                        invalid(format!("record {i}: input {input} is not in the job ({n} inputs)"))
                    })?;
                    if slot.is_some() {
                        return Err(invalid(format!("record {i}: input {input} answered twice")));
                    }
                    if outputs.len() > MAX_TENSORS {
                        return Err(invalid(format!("record {i}: {} output tensors", outputs.len())));
                    }
                    let tensors = outputs
                        .into_iter()
                        .map(from_journal)
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| invalid(format!("record {i}: {e}")))?;
                    *slot = Some(tensors);
                }
            }
        }
        if !accepted {
            let body = encode(&PipelineRecord::Accepted { job: digest, inputs: n as u32 })
                .map_err(|e| invalid(format!("encoding the acceptance: {e}")))?;
            journal.append(&[&body])?;
        }
        let resumed = Resumed {
            path: Some(path.to_path_buf()),
            resumed: accepted,
            answered: answered.iter().filter(|a| a.is_some()).count(),
            damage: replay.damage,
        };
        Ok((Ledger { journal: Some(journal), answered }, resumed))
    }

    /// Records input `input`'s answer: journaled (synced) before it counts. `Ok(false)` when it
    /// was answered already (the second answer is dropped).
    pub fn answer(&mut self, input: usize, outputs: &[NamedTensor]) -> Result<bool, LedgerError> {
        let Some(slot) = self.answered.get_mut(input) else { return Ok(false) };
        if slot.is_some() {
            return Ok(false);
        }
        if let Some(j) = self.journal.as_mut() {
            let record = PipelineRecord::Answered {
                input: input as u32,
                outputs: outputs.iter().map(to_journal).collect(),
            };
            let body = encode(&record).map_err(|e| LedgerError::Invalid {
                path: j.path().to_path_buf(),
                detail: format!("encoding the answer of input {input}: {e}"),
            })?;
            j.append(&[&body])?;
        }
        *slot = Some(outputs.to_vec());
        Ok(true)
    }

    /// Each input's answer so far.
    pub fn answers(&self) -> &[Option<Vec<NamedTensor>>] {
        &self.answered
    }

    /// Detaches the journal (the job's outputs are out) and says where it was.
    pub fn finish(&mut self) -> Option<PathBuf> {
        self.journal.take().map(|j| j.path().to_path_buf())
    }
}

fn hex(d: &[u8; 32]) -> String {
    d.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn tensors_round_trip_bit_exact_and_bad_shapes_are_named() {
        let t = NamedTensor::f32("e", vec![1, 3], vec![0.1, -2.5e-8, f32::MAX]);
        assert_eq!(from_journal(to_journal(&t)).unwrap(), t);
        let i = NamedTensor::i64("ids", vec![2], vec![i64::MIN, 7]);
        assert_eq!(from_journal(to_journal(&i)).unwrap(), i);
        let mut bad = to_journal(&t);
        bad.shape = vec![2, 3];
        assert!(from_journal(bad).unwrap_err().contains("tensor 'e'"));
    }

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let r = PipelineRecord::Answered {
            input: 3,
            outputs: vec![to_journal(&NamedTensor::f32("e", vec![2], vec![1.0, 2.0]))],
        };
        assert_eq!(decode(&encode(&r).unwrap()).unwrap(), r);
        assert!(decode(&[7u8; 11]).is_err());
    }
}
