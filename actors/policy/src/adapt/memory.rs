//! Per-expert temporary-memory estimator (paper §3.2.1, "Fast per-expert DRAM estimator").
//!
//! `M_tmp(e) = m_c(e) + m_f(e)` with `m_c(e) ≈ B_p (θ1 T d_k + θ2 T²)`: `T = b · n_t` tokens,
//! key dimension `d_k`, numeric precision `B_p` (bytes per element here), and `m_f` the
//! hardware/system-stable function-call overhead profiled offline. `θ1, θ2, m_f` are fitted from
//! profiled `(shape, measured bytes)` samples by non-negative least squares.

use super::nnls::{NnlsError, nnls};

/// Most profiled samples [`MemoryModel::fit`] accepts (callers pass profiler output).
pub const MAX_FIT_SAMPLES: usize = 4096;

/// The workload shape of one expert in one mini-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShape {
    /// Token count `T = b · n_t` routed to the expert.
    pub tokens: u64,
    /// Key dimension `d_k` of the attention block.
    pub d_k: u64,
}

/// One profiled measurement: a shape and the temporary bytes it really used.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemorySample {
    /// The measured expert's shape.
    pub shape: ExpertShape,
    /// Peak temporary bytes observed.
    pub measured_bytes: f64,
}

/// The fitted estimator `M_tmp = B_p (θ1 T d_k + θ2 T²) + m_f`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryModel {
    /// `B_p`: bytes per element (4 for fp32, 2 for fp16, 1 for int8).
    pub precision_bytes: f64,
    /// `θ1`: elements per token per key dimension (Q/K/V projections).
    pub theta1: f64,
    /// `θ2`: elements per token pair (attention scores).
    pub theta2: f64,
    /// `m_f`: fixed function-call overhead in bytes (kernels, framework metadata).
    pub fixed_bytes: f64,
}

/// Why [`MemoryModel::fit`] failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Three coefficients need at least three samples.
    #[error("need at least {need} samples, got {got}")]
    TooFewSamples {
        /// Minimum sample count.
        need: usize,
        /// Samples given.
        got: usize,
    },
    /// More samples than [`MAX_FIT_SAMPLES`].
    #[error("{got} samples exceed the cap of {cap}")]
    TooManySamples {
        /// Samples given.
        got: usize,
        /// The cap.
        cap: usize,
    },
    /// The precision is not a positive finite number.
    #[error("precision must be positive and finite, got {0}")]
    BadPrecision(f64),
    /// The samples do not vary enough in `T` and `d_k` to separate the three terms.
    #[error("samples do not determine theta1, theta2 and m_f (vary T and d_k)")]
    Degenerate,
    /// The solver rejected the data.
    #[error(transparent)]
    Solver(#[from] NnlsError),
}

impl MemoryModel {
    /// `m_c(e) = B_p (θ1 T d_k + θ2 T²)` in bytes.
    pub fn compute_bytes(&self, s: ExpertShape) -> f64 {
        let t = s.tokens as f64;
        self.precision_bytes * (self.theta1 * t * s.d_k as f64 + self.theta2 * t * t)
    }

    /// `M_tmp(e) = m_c(e) + m_f(e)`, rounded up to whole bytes (estimates must not undershoot).
    pub fn temporary_bytes(&self, s: ExpertShape) -> u64 {
        let v = (self.compute_bytes(s) + self.fixed_bytes).ceil();
        if v.is_finite() && v > 0.0 { v.min(u64::MAX as f64) as u64 } else { 0 }
    }

    /// Fits `θ1, θ2, m_f >= 0` to profiled samples for a known precision `B_p`.
    pub fn fit(precision_bytes: f64, samples: &[MemorySample]) -> Result<Self, FitError> {
        if !(precision_bytes.is_finite() && precision_bytes > 0.0) {
            return Err(FitError::BadPrecision(precision_bytes));
        }
        if samples.len() < 3 {
            return Err(FitError::TooFewSamples { need: 3, got: samples.len() });
        }
        if samples.len() > MAX_FIT_SAMPLES {
            return Err(FitError::TooManySamples { got: samples.len(), cap: MAX_FIT_SAMPLES });
        }
        let td: Vec<f64> =
            samples.iter().map(|s| precision_bytes * s.shape.tokens as f64 * s.shape.d_k as f64).collect();
        let tt: Vec<f64> =
            samples.iter().map(|s| precision_bytes * (s.shape.tokens as f64).powi(2)).collect();
        let ones = vec![1.0; samples.len()];
        let cols = [td, tt, ones];
        let col_refs: Vec<&[f64]> = cols.iter().map(Vec::as_slice).collect();
        let y: Vec<f64> = samples.iter().map(|s| s.measured_bytes).collect();
        // Identifiability: the three columns must be linearly independent.
        if super::linalg::least_squares(&col_refs, &y).is_none() {
            return Err(FitError::Degenerate);
        }
        let fit = nnls(&cols, &y)?;
        Ok(MemoryModel { precision_bytes, theta1: fit.x[0], theta2: fit.x[1], fixed_bytes: fit.x[2] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(m: &MemoryModel, tokens: u64, d_k: u64) -> MemorySample {
        let shape = ExpertShape { tokens, d_k };
        MemorySample { shape, measured_bytes: m.compute_bytes(shape) + m.fixed_bytes }
    }

    #[test]
    fn hand_checked_estimate() {
        // fp32, θ1 = 3 (Q, K, V), θ2 = 1 (scores), m_f = 1 MiB; T = 196, d_k = 64:
        // 4 * (3*196*64 + 196^2) + 1048576 = 4 * (37632 + 38416) + 1048576 = 1352768.
        let m = MemoryModel { precision_bytes: 4.0, theta1: 3.0, theta2: 1.0, fixed_bytes: 1_048_576.0 };
        assert_eq!(m.temporary_bytes(ExpertShape { tokens: 196, d_k: 64 }), 1_352_768);
    }

    #[test]
    fn fit_recovers_the_generating_coefficients() {
        let truth = MemoryModel { precision_bytes: 2.0, theta1: 3.0, theta2: 1.5, fixed_bytes: 65_536.0 };
        let samples: Vec<_> = [(196, 64), (392, 64), (196, 128), (784, 32), (50, 256)]
            .iter()
            .map(|&(t, d)| sample(&truth, t, d))
            .collect();
        let fit = MemoryModel::fit(2.0, &samples).unwrap();
        assert!((fit.theta1 - 3.0).abs() < 1e-6, "{fit:?}");
        assert!((fit.theta2 - 1.5).abs() < 1e-6, "{fit:?}");
        assert!((fit.fixed_bytes - 65_536.0).abs() < 1e-3, "{fit:?}");
    }

    #[test]
    fn fit_rejects_degenerate_or_bad_input() {
        let m = MemoryModel { precision_bytes: 4.0, theta1: 1.0, theta2: 1.0, fixed_bytes: 0.0 };
        let same: Vec<_> = (0..4).map(|_| sample(&m, 100, 64)).collect();
        assert_eq!(MemoryModel::fit(4.0, &same), Err(FitError::Degenerate));
        assert!(matches!(MemoryModel::fit(4.0, &same[..2]), Err(FitError::TooFewSamples { .. })));
        assert!(matches!(MemoryModel::fit(0.0, &same), Err(FitError::BadPrecision(_))));
    }
}
