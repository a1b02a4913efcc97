//! `SimCompute`: a deterministic stand-in for one executor's model compute (simulation only).
//!
//! The coe executor actor ([`super::remote::CoeExecutor`]) carries out the scheduler's commands
//! on one of two computes: the real [`super::executor::ExpertExecutor`] (weight store, ONNX
//! Runtime or the MLP engine, run with `block_in_place` off the async workers), or this
//! stand-in, which a simulated cluster uses. It opens no file and runs no model: an expert's
//! output is a hash of the expert id and the input ([`SimCompute::output`]), and each command
//! costs a modelled time ([`SimCompute::cost`]) that the actor spends on tokio's clock (under
//! paused time, virtual time). It keeps the executor's rules: a load past the device budget,
//! a second load of a loaded expert, an eviction of an expert not loaded and a batch of one
//! not loaded are refused as the real executor refuses them. It has no host tier: a reset
//! reports an empty one, so the scheduler plans every load as from disk.

use std::collections::BTreeSet;
use std::time::Duration;

use troupe_policy::coe::{ExpertId, LatencyModel, Tier};

use super::CoeError;
use super::app::INPUT_WIDTH;
use super::runner::{Cmd, Event};

/// What a `SimCompute` executor is: its device budget, each expert's bytes and output width,
/// and the costs its commands are charged. Sent as part of the executor actor's start
/// arguments, so the executor node needs no app folder.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SimComputeSpec {
    /// Device budget for resident experts, bytes.
    pub budget: u64,
    /// Per expert (by id): its bytes.
    pub sizes: Vec<u64>,
    /// Per expert (by id): its output width.
    pub widths: Vec<u32>,
    /// Per expert (by id): the modelled time of a load from disk, microseconds.
    pub load_us: Vec<u64>,
    /// Per expert (by id): the modelled time of a one-request batch, microseconds.
    pub batch_us: Vec<u64>,
    /// Extra modelled time per request past the first in a batch, microseconds.
    pub per_request_us: u64,
}

impl SimComputeSpec {
    /// Executor `e` of `latency` over experts of these `sizes` and output `widths`: its
    /// profiled budget, a load's time from disk and a one-request batch's time as the latency
    /// model predicts them (so the stand-in costs what the scheduler plans with).
    pub fn from_latency(latency: &LatencyModel, e: usize, sizes: &[u64], widths: &[u32]) -> Self {
        let load_us = sizes.iter().map(|&s| latency.load_time(e, s, Tier::Ssd).0).collect();
        let batch_us = sizes.iter().map(|&s| latency.batch_latency(e, s, 1).0).collect();
        SimComputeSpec {
            budget: latency.expert_budget(e),
            sizes: sizes.to_vec(),
            widths: widths.to_vec(),
            load_us,
            batch_us,
            per_request_us: 100,
        }
    }
}

/// The deterministic compute stand-in of one executor (see the module docs).
#[derive(Debug)]
pub struct SimCompute {
    name: String,
    spec: SimComputeSpec,
    loaded: BTreeSet<ExpertId>,
    resident: u64,
}

impl SimCompute {
    /// A stand-in named `name` (its profile name) from `spec`; refused when the spec's
    /// per-expert lists differ in length.
    pub fn new(name: &str, spec: SimComputeSpec) -> Result<Self, CoeError> {
        let n = spec.sizes.len();
        if [spec.widths.len(), spec.load_us.len(), spec.batch_us.len()].iter().any(|&l| l != n) {
            return Err(CoeError::Invalid(format!(
                "sim compute {name}: per-expert lists of {n}, {}, {} and {} entries",
                spec.widths.len(),
                spec.load_us.len(),
                spec.batch_us.len()
            )));
        }
        Ok(SimCompute { name: name.to_string(), spec, loaded: BTreeSet::new(), resident: 0 })
    }

    /// Expert `expert`'s output (`width` values, positive, summing to about 1) for `input`: a
    /// hash of the expert id and the input's bits, so the same pair always gives the same row.
    /// The reference a test checks answers against.
    pub fn output(expert: ExpertId, width: usize, input: &[f32]) -> Vec<f32> {
        let mut h = blake3::Hasher::new();
        h.update(&expert.0.to_le_bytes());
        for v in input {
            h.update(&v.to_bits().to_le_bytes());
        }
        let mut stream = h.finalize_xof();
        let raw: Vec<f32> = (0..width)
            .map(|_| {
                let mut four = [0u8; 4];
                stream.fill(&mut four);
                // 1..=65536, so no output is zero
                f32::from(u16::from_le_bytes([four[0], four[1]])) + 1.0
            })
            .collect();
        let total: f32 = raw.iter().sum();
        raw.into_iter().map(|v| v / total).collect()
    }

    /// The modelled time `cmd` takes: a load from disk, a batch's base time plus a step per
    /// further request; an eviction or reset costs nothing.
    pub fn cost(&self, cmd: &Cmd) -> Duration {
        let us = match cmd {
            Cmd::Load(e) => self.spec.load_us.get(e.index()).copied().unwrap_or(0),
            Cmd::Run { expert, requests, .. } => {
                let base = self.spec.batch_us.get(expert.index()).copied().unwrap_or(0);
                let more = requests.len().saturating_sub(1) as u64;
                base.saturating_add(more.saturating_mul(self.spec.per_request_us))
            }
            Cmd::Evict(_) | Cmd::Reset => 0,
        };
        Duration::from_micros(us)
    }

    /// Carries out `cmd` (its time is the caller's to spend: [`Self::cost`]); the event to
    /// report, as [`super::runner::execute`] reports the real executor's.
    pub fn execute(&mut self, exec: usize, cmd: Cmd) -> Result<Option<Event>, CoeError> {
        let seconds = self.cost(&cmd).as_secs_f64();
        match cmd {
            Cmd::Load(expert) => {
                let size = self.size(expert)?;
                if self.loaded.contains(&expert) {
                    return Err(self.fail(format!("{expert} is already loaded")));
                }
                if self.resident + size > self.spec.budget {
                    return Err(self.fail(format!(
                        "loading {expert} ({size} bytes) would exceed the budget: {} of {} bytes in use",
                        self.resident, self.spec.budget
                    )));
                }
                self.loaded.insert(expert);
                self.resident += size;
                Ok(Some(Event::Loaded { exec, expert, seconds, resident: self.resident }))
            }
            Cmd::Evict(expert) => {
                if !self.loaded.remove(&expert) {
                    return Err(self.fail(format!("evicting {expert}, which is not loaded")));
                }
                self.resident -= self.size(expert)?;
                Ok(None)
            }
            Cmd::Reset => {
                let evicted = self.loaded.len();
                self.loaded.clear();
                self.resident = 0;
                Ok(Some(Event::Reset { exec, evicted, host_budget: 0, host: Vec::new() }))
            }
            Cmd::Run { batch, expert, requests } => {
                if !self.loaded.contains(&expert) {
                    return Err(self.fail(format!("running {expert}, which is not loaded")));
                }
                let width = self.spec.widths[expert.index()] as usize;
                let mut rows = Vec::with_capacity(requests.len());
                for (request, input) in requests {
                    if input.len() != INPUT_WIDTH {
                        return Err(
                            self.fail(format!("input of {} floats, expected {INPUT_WIDTH}", input.len()))
                        );
                    }
                    rows.push((request, Self::output(expert, width, &input)));
                }
                Ok(Some(Event::Ran { exec, batch, expert, rows, seconds }))
            }
        }
    }

    /// Bytes of experts loaded now.
    pub fn resident_bytes(&self) -> u64 {
        self.resident
    }

    fn size(&self, expert: ExpertId) -> Result<u64, CoeError> {
        self.spec
            .sizes
            .get(expert.index())
            .copied()
            .ok_or_else(|| self.fail(format!("unknown expert {expert}")))
    }

    fn fail(&self, problem: String) -> CoeError {
        CoeError::Executor { executor: self.name.clone(), problem }
    }
}

#[cfg(test)]
mod tests {
    use troupe_policy::coe::{BatchId, RequestId};

    use super::*;

    fn spec() -> SimComputeSpec {
        SimComputeSpec {
            budget: 300,
            sizes: vec![100, 250],
            widths: vec![3, 5],
            load_us: vec![1_000, 2_500],
            batch_us: vec![400, 900],
            per_request_us: 10,
        }
    }

    #[test]
    fn outputs_depend_on_the_expert_and_the_input_only() {
        let a = SimCompute::output(ExpertId(1), 4, &[0.5; INPUT_WIDTH]);
        assert_eq!(a, SimCompute::output(ExpertId(1), 4, &[0.5; INPUT_WIDTH]));
        assert_ne!(a, SimCompute::output(ExpertId(2), 4, &[0.5; INPUT_WIDTH]));
        assert_ne!(a, SimCompute::output(ExpertId(1), 4, &[0.25; INPUT_WIDTH]));
        assert_eq!(a.len(), 4);
        assert!(a.iter().all(|v| *v > 0.0) && (a.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{a:?}");
    }

    #[test]
    fn the_stand_in_keeps_the_executor_s_budget_and_loaded_rules() {
        let mut c = SimCompute::new("sim0", spec()).unwrap();
        let run = |e: u32| Cmd::Run {
            batch: BatchId(1),
            expert: ExpertId(e),
            requests: vec![(RequestId(7), vec![0.0; INPUT_WIDTH]), (RequestId(8), vec![1.0; INPUT_WIDTH])],
        };
        assert!(c.execute(0, run(0)).unwrap_err().to_string().contains("not loaded"));
        assert_eq!(c.cost(&Cmd::Load(ExpertId(1))), Duration::from_micros(2_500));
        assert!(matches!(
            c.execute(0, Cmd::Load(ExpertId(0))),
            Ok(Some(Event::Loaded { resident: 100, .. }))
        ));
        let e = c.execute(0, Cmd::Load(ExpertId(1))).unwrap_err().to_string();
        assert!(e.contains("would exceed the budget"), "{e}");
        assert_eq!(c.cost(&run(0)), Duration::from_micros(410));
        match c.execute(3, run(0)).unwrap() {
            Some(Event::Ran { exec: 3, rows, .. }) => {
                assert_eq!(rows[0], (RequestId(7), SimCompute::output(ExpertId(0), 3, &[0.0; INPUT_WIDTH])));
                assert_eq!(rows[1].0, RequestId(8));
            }
            other => panic!("{other:?}"),
        }
        c.execute(0, Cmd::Evict(ExpertId(0))).unwrap();
        assert!(c.execute(0, Cmd::Evict(ExpertId(0))).unwrap_err().to_string().contains("not loaded"));
        c.execute(0, Cmd::Load(ExpertId(1))).unwrap();
        assert!(matches!(c.execute(0, Cmd::Reset), Ok(Some(Event::Reset { evicted: 1, .. }))));
        assert_eq!(c.resident_bytes(), 0);
        let mut bad = spec();
        bad.widths.pop();
        assert!(SimCompute::new("sim1", bad).is_err());
    }
}
