//! Online accuracy-gain-per-epoch (AGE) prediction (paper §3.4.2).
//!
//! "With a fixed V-MoE architecture and update rule, varying resource schedules changes
//! wall-clock time but not the accuracy-vs.-epoch trajectory", so each task keeps an NNLS fit of
//! accuracy against epoch. The basis is a saturating curve linearised over a fixed grid of rates:
//! `acc(e) = a - Σ_k b_k exp(-c_k e)` with `a, b_k >= 0`, so every fit is non-decreasing and
//! levels off at `a`. AGE at epoch `e` is `acc(e + 1) - acc(e)`.

use std::collections::VecDeque;

use super::nnls::{NnlsError, nnls};

/// Default grid of convergence rates `c_k` (per epoch).
pub const DEFAULT_RATES: [f64; 6] = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6];
/// Points kept per task (oldest dropped).
pub const MAX_HISTORY: usize = 64;
/// Points needed before the model predicts.
pub const MIN_POINTS: usize = 3;
/// Floor on the gain used to normalise AGE errors (one accuracy point).
pub const ERROR_FLOOR: f64 = 0.01;

/// A fitted accuracy-vs-epoch curve.
#[derive(Debug, Clone, PartialEq)]
pub struct AccuracyCurve {
    /// Asymptote `a`.
    pub asymptote: f64,
    /// `(c_k, b_k)` with `b_k` above 1e-9 (solver round-off dropped).
    pub terms: Vec<(f64, f64)>,
}

impl AccuracyCurve {
    /// `acc(e)`.
    pub fn accuracy(&self, epoch: f64) -> f64 {
        self.asymptote - self.terms.iter().map(|(c, b)| b * (-c * epoch).exp()).sum::<f64>()
    }

    /// AGE: `acc(e + 1) - acc(e)`.
    pub fn gain_per_epoch(&self, epoch: f64) -> f64 {
        self.accuracy(epoch + 1.0) - self.accuracy(epoch)
    }

    /// Whole epochs after `epoch` until the curve reaches `target`, if within `horizon`.
    pub fn epochs_to_reach(&self, epoch: f64, target: f64, horizon: u32) -> Option<u32> {
        (0..=horizon).find(|&k| self.accuracy(epoch + k as f64) >= target)
    }
}

/// Fits `acc(e) = a - Σ b_k exp(-c_k e)` to `(epoch, accuracy)` points by NNLS.
pub fn fit_curve(points: &[(f64, f64)], rates: &[f64]) -> Result<AccuracyCurve, NnlsError> {
    let mut cols = vec![vec![1.0; points.len()]];
    for &c in rates {
        cols.push(points.iter().map(|&(e, _)| -(-c * e).exp()).collect());
    }
    let y: Vec<f64> = points.iter().map(|&(_, a)| a).collect();
    let fit = nnls(&cols, &y)?;
    Ok(AccuracyCurve {
        asymptote: fit.x[0],
        terms: rates.iter().zip(&fit.x[1..]).filter(|(_, b)| **b > 1e-9).map(|(c, b)| (*c, *b)).collect(),
    })
}

/// Per-task online AGE estimator.
#[derive(Debug, Clone, PartialEq)]
pub struct AgeModel {
    rates: Vec<f64>,
    points: VecDeque<(f64, f64)>,
    curve: Option<AccuracyCurve>,
}

impl Default for AgeModel {
    fn default() -> Self {
        AgeModel::new(&DEFAULT_RATES)
    }
}

impl AgeModel {
    /// A model over the given rate grid.
    pub fn new(rates: &[f64]) -> Self {
        AgeModel { rates: rates.to_vec(), points: VecDeque::new(), curve: None }
    }

    /// Records accuracy after `epoch` epochs and refits. Returns the relative error of the AGE
    /// predicted for this step before seeing it (`|pred - actual| / max(|actual|, |pred|, 1 pt)`),
    /// when a prediction existed.
    pub fn observe(&mut self, epoch: f64, accuracy: f64) -> Option<f64> {
        if !(epoch.is_finite() && accuracy.is_finite()) {
            return None;
        }
        let err = match (&self.curve, self.points.back()) {
            (Some(curve), Some(&(e0, a0))) if epoch > e0 => {
                let pred = curve.accuracy(epoch) - curve.accuracy(e0);
                let actual = accuracy - a0;
                Some((pred - actual).abs() / actual.abs().max(pred.abs()).max(ERROR_FLOOR))
            }
            _ => None,
        };
        if self.points.len() == MAX_HISTORY {
            self.points.pop_front();
        }
        self.points.push_back((epoch, accuracy));
        if self.points.len() >= MIN_POINTS {
            let pts: Vec<(f64, f64)> = self.points.iter().copied().collect();
            self.curve = fit_curve(&pts, &self.rates).ok();
        }
        err
    }

    /// The current fit, once [`MIN_POINTS`] points are in.
    pub fn curve(&self) -> Option<&AccuracyCurve> {
        self.curve.as_ref()
    }

    /// Predicted gain of the next epoch, from the latest observed epoch.
    pub fn predicted_age(&self) -> Option<f64> {
        let (e, _) = *self.points.back()?;
        self.curve.as_ref().map(|c| c.gain_per_epoch(e))
    }

    /// Predicted epochs from the latest point until `target` (within `horizon`).
    pub fn epochs_to(&self, target: f64, horizon: u32) -> Option<u32> {
        let &(e, a) = self.points.back()?;
        if a >= target {
            return Some(0);
        }
        self.curve.as_ref()?.epochs_to_reach(e, target, horizon)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnls_fit_on_exact_data_recovers_the_coefficients() {
        // acc(e) = 0.8 - 0.5 exp(-0.2 e), epochs 0..=12, on the default grid.
        let pts: Vec<(f64, f64)> =
            (0..=12).map(|e| (e as f64, 0.8 - 0.5 * (-0.2 * e as f64).exp())).collect();
        let curve = fit_curve(&pts, &DEFAULT_RATES).unwrap();
        assert!((curve.asymptote - 0.8).abs() < 1e-6, "{curve:?}");
        assert_eq!(curve.terms.len(), 1, "{curve:?}");
        assert!((curve.terms[0].0 - 0.2).abs() < 1e-12);
        assert!((curve.terms[0].1 - 0.5).abs() < 1e-6);
        // AGE at epoch 0 by hand: 0.5 (1 - e^-0.2) = 0.0906346...
        assert!((curve.gain_per_epoch(0.0) - 0.5 * (1.0 - (-0.2f64).exp())).abs() < 1e-6);
        // Reaching 0.7 needs exp(-0.2 e) <= 0.2, e >= ln 5 / 0.2 = 8.05 -> 9 epochs from 0.
        assert_eq!(curve.epochs_to_reach(0.0, 0.7, 50), Some(9));
    }

    #[test]
    fn online_model_predicts_after_three_points_and_reports_error() {
        let mut m = AgeModel::default();
        let acc = |e: f64| 0.4 + 0.3 * (1.0 - (-0.4 * e).exp());
        assert_eq!(m.observe(0.0, acc(0.0)), None);
        assert_eq!(m.observe(1.0, acc(1.0)), None);
        assert_eq!(m.predicted_age(), None);
        assert_eq!(m.observe(2.0, acc(2.0)), None);
        let age = m.predicted_age().unwrap();
        assert!((age - (acc(3.0) - acc(2.0))).abs() < 1e-6, "{age}");
        let err = m.observe(3.0, acc(3.0)).unwrap();
        assert!(err < 1e-4, "{err}");
        // A sudden drop is a large relative error.
        let err = m.observe(4.0, acc(3.0) - 0.05).unwrap();
        assert!(err > 1.0, "{err}");
    }
}
