//! `SimStage`: a deterministic stand-in for one pipeline stage's model compute (simulation only).
//!
//! A simulated cluster runs the real foreman and workers on stages that are not ONNX models: a
//! stage "file" is a [`SimStage`] (its tensors and modelled costs) rkyv-encoded behind
//! [`SIM_STAGE_MAGIC`]. It is hashed, served, pulled, cached and checked exactly as an ONNX file
//! is; a worker loading it spends [`SimStage::load_us`] on tokio's clock, and a run spends
//! [`SimStage::run_us`] and answers with outputs that are a BLAKE3 of the stage and its inputs
//! ([`SimStage::run`]): no ONNX Runtime, no `block_in_place`, the same bytes in every run.
//! [`reference_outputs`] walks a job's input through the stages as the pipeline should.

use std::sync::Arc;
use std::time::Duration;

use rkyv::{Archive, Deserialize, Serialize};
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::chain::{DType, StageSignature, TensorSig};

use super::job::StageFile;
use super::ledger::hash_tensor;
use super::wire::{from_bytes, to_bytes};
use super::worker::sha256_hex;

/// The first bytes of a simulated stage file (no ONNX file starts so).
pub const SIM_STAGE_MAGIC: &[u8; 8] = b"SIMSTAGE";

/// One input a simulated stage reads: its name, whether it is i64 (else f32), and its rank.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SimInput {
    /// Tensor name.
    pub name: String,
    /// i64 (true) or f32.
    pub i64: bool,
    /// Rank.
    pub rank: u32,
}

/// A simulated stage: what it reads, what it makes (f32 tensors of shape `[1, width]`) and what
/// it costs (see the module docs).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SimStage {
    /// The stage's name.
    pub name: String,
    /// Its inputs.
    pub inputs: Vec<SimInput>,
    /// Its outputs: name and width.
    pub outputs: Vec<(String, u32)>,
    /// Modelled time of a load, microseconds.
    pub load_us: u64,
    /// Modelled time of one run, microseconds.
    pub run_us: u64,
}

impl SimStage {
    /// The stage file: the magic, then the rkyv encoding.
    pub fn to_file(&self) -> Vec<u8> {
        let mut out = SIM_STAGE_MAGIC.to_vec();
        // a stage description is a few hundred bytes: far below the message cap
        out.extend(to_bytes("sim stage", self).unwrap_or_default());
        out
    }

    /// Reads a stage file (checked: it may come from a peer or a disk).
    pub fn from_file(bytes: &[u8]) -> Result<Self, String> {
        let body = bytes.strip_prefix(SIM_STAGE_MAGIC.as_slice()).ok_or("not a simulated stage file")?;
        from_bytes("sim stage", body).map_err(|e| e.to_string())
    }

    /// The stage as the foreman holds it: its file and signature (no ONNX Runtime involved).
    pub fn stage_file(&self) -> StageFile {
        let bytes = self.to_file();
        let sig = |name: &str, dtype, rank| TensorSig { name: name.to_owned(), dtype, rank };
        let signature = StageSignature {
            name: self.name.clone(),
            sha256: sha256_hex(&bytes),
            size_bytes: bytes.len() as u64,
            inputs: self
                .inputs
                .iter()
                .map(|i| sig(&i.name, if i.i64 { DType::I64 } else { DType::F32 }, i.rank as usize))
                .collect(),
            outputs: self.outputs.iter().map(|(n, _)| sig(n, DType::F32, 2)).collect(),
        };
        StageFile { origin: format!("sim:{}", self.name), bytes: Arc::new(bytes), signature }
    }

    /// The modelled load time.
    pub fn load_time(&self) -> Duration {
        Duration::from_micros(self.load_us)
    }

    /// The modelled run time.
    pub fn run_time(&self) -> Duration {
        Duration::from_micros(self.run_us)
    }

    /// The outputs of stage `self` for `inputs`: each a BLAKE3 (keyed by stage and output name)
    /// of the inputs it reads, in its declared order, read as f32 values in `[0, 1)` that a
    /// lossless coding carries exactly. An input it reads that is missing is an error.
    pub fn run(&self, inputs: &[NamedTensor]) -> Result<Vec<NamedTensor>, String> {
        let mut h = blake3::Hasher::new();
        h.update(self.name.as_bytes());
        for want in &self.inputs {
            let t = inputs
                .iter()
                .find(|t| t.name == want.name)
                .ok_or_else(|| format!("stage {}: no input named {}", self.name, want.name))?;
            hash_tensor(&mut h, t);
        }
        let seed = h.finalize();
        Ok(self
            .outputs
            .iter()
            .map(|(name, width)| {
                let mut xof = blake3::Hasher::new_keyed(seed.as_bytes());
                xof.update(name.as_bytes());
                let mut bytes = vec![0u8; *width as usize * 4];
                xof.finalize_xof().fill(&mut bytes);
                let values = bytes
                    .chunks_exact(4)
                    .map(|c| (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) >> 8) as f32 / (1u32 << 24) as f32)
                    .collect();
                NamedTensor::f32(name.clone(), vec![1, *width as usize], values)
            })
            .collect())
    }
}

/// What the last stage answers for one job `input`, walking it through `stages` as the
/// foreman feeds them (each stage reads the previous stage's outputs by name, else the job's).
pub fn reference_outputs(stages: &[SimStage], input: &[NamedTensor]) -> Result<Vec<NamedTensor>, String> {
    let mut prev: Vec<NamedTensor> = Vec::new();
    for s in stages {
        let feed: Vec<NamedTensor> = s
            .inputs
            .iter()
            .filter_map(|want| prev.iter().chain(input.iter()).find(|t| t.name == want.name).cloned())
            .collect();
        prev = s.run(&feed)?;
    }
    Ok(prev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(name: &str, input: &str, output: &str) -> SimStage {
        SimStage {
            name: name.into(),
            inputs: vec![SimInput { name: input.into(), i64: false, rank: 2 }],
            outputs: vec![(output.into(), 8)],
            load_us: 1000,
            run_us: 500,
        }
    }

    #[test]
    fn a_stage_file_round_trips_and_outputs_follow_the_inputs() {
        let s = stage("s0", "x", "h");
        assert_eq!(SimStage::from_file(&s.to_file()).unwrap(), s);
        assert!(SimStage::from_file(b"ONNX....").is_err());
        let mut torn = s.to_file();
        torn.truncate(torn.len() - 3);
        assert!(SimStage::from_file(&torn).is_err(), "a torn file is refused");
        let x = NamedTensor::f32("x", vec![1, 2], vec![1.0, 2.0]);
        let a = s.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(a, s.run(std::slice::from_ref(&x)).unwrap(), "deterministic");
        assert_eq!(a[0].shape, vec![1, 8]);
        let y = NamedTensor::f32("x", vec![1, 2], vec![1.0, 2.5]);
        assert_ne!(a, s.run(&[y]).unwrap(), "another input, other outputs");
        assert!(s.run(&[]).is_err());
        let file = s.stage_file();
        assert_eq!(file.signature.outputs[0].name, "h");
        assert_eq!(file.signature.sha256, sha256_hex(&file.bytes));
    }

    #[test]
    fn the_reference_walk_chains_the_stages() {
        let stages = [stage("s0", "x", "h"), stage("s1", "h", "y")];
        let x = NamedTensor::f32("x", vec![1, 2], vec![1.0, 2.0]);
        let h = stages[0].run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(reference_outputs(&stages, &[x]).unwrap(), stages[1].run(&h).unwrap());
    }
}
