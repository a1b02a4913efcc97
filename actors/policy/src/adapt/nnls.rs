//! Non-negative least squares (Lawson and Hanson's active-set method).
//!
//! AdaSprite keeps "an online convergence fit of accuracy using a non-negative least squares
//! (NNLS) solver" (paper §3.4.2); the same solver fits the memory estimator's non-negative
//! coefficients (§3.2.1).

use super::linalg::least_squares;

/// Why an NNLS problem could not be solved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NnlsError {
    /// Columns of different lengths, or a right-hand side of another length.
    #[error("shape mismatch: {0}")]
    Shape(&'static str),
    /// A NaN or infinite input value.
    #[error("non-finite input")]
    NonFinite,
}

/// Result of [`nnls`]: the coefficients and the residual norm `||A x - b||`.
#[derive(Debug, Clone, PartialEq)]
pub struct NnlsFit {
    /// Non-negative coefficients, one per column.
    pub x: Vec<f64>,
    /// Euclidean norm of the residual.
    pub residual: f64,
}

/// Solves `min ||A x - b||` subject to `x >= 0`; `cols` are the columns of `A`.
///
/// Columns are scaled to unit norm internally (the memory fit mixes `T` and `T^2` columns that
/// differ by orders of magnitude) and the coefficients are scaled back. A column whose passive
/// subproblem turns out rank deficient is left at zero.
pub fn nnls(cols: &[Vec<f64>], b: &[f64]) -> Result<NnlsFit, NnlsError> {
    let m = b.len();
    let n = cols.len();
    if cols.iter().any(|c| c.len() != m) {
        return Err(NnlsError::Shape("every column must have b.len() rows"));
    }
    if b.iter().chain(cols.iter().flatten()).any(|v| !v.is_finite()) {
        return Err(NnlsError::NonFinite);
    }
    let norms: Vec<f64> = cols.iter().map(|c| c.iter().map(|v| v * v).sum::<f64>().sqrt()).collect();
    let scaled: Vec<Vec<f64>> = cols
        .iter()
        .zip(&norms)
        .map(|(c, &nrm)| if nrm > 0.0 { c.iter().map(|v| v / nrm).collect() } else { c.clone() })
        .collect();
    let mut x = vec![0.0; n];
    let mut passive = vec![false; n];
    let mut excluded: Vec<bool> = norms.iter().map(|&nrm| nrm == 0.0).collect();
    let bnorm = b.iter().map(|v| v * v).sum::<f64>().sqrt().max(1.0);
    let tol = 1e-12 * bnorm * (m.max(n) as f64);
    for _outer in 0..(3 * n + 3) {
        let w = gradient(&scaled, b, &x);
        let candidate = (0..n)
            .filter(|&j| !passive[j] && !excluded[j] && w[j] > tol)
            .max_by(|&i, &j| w[i].total_cmp(&w[j]));
        let Some(t) = candidate else { break };
        passive[t] = true;
        for _inner in 0..(3 * n + 3) {
            let idx: Vec<usize> = (0..n).filter(|&j| passive[j]).collect();
            let sub: Vec<&[f64]> = idx.iter().map(|&j| scaled[j].as_slice()).collect();
            let Some(z_sub) = least_squares(&sub, b) else {
                // Adding `t` made the passive set degenerate: give up on that column.
                passive[t] = false;
                excluded[t] = true;
                x[t] = 0.0;
                break;
            };
            let mut z = vec![0.0; n];
            for (k, &j) in idx.iter().enumerate() {
                z[j] = z_sub[k];
            }
            if idx.iter().all(|&j| z[j] > 0.0) {
                x = z;
                break;
            }
            // Step from x towards z until the first passive coefficient hits zero.
            let alpha = idx
                .iter()
                .filter(|&&j| z[j] <= 0.0)
                .map(|&j| x[j] / (x[j] - z[j]))
                .fold(f64::INFINITY, f64::min)
                .clamp(0.0, 1.0);
            for j in 0..n {
                x[j] += alpha * (z[j] - x[j]);
            }
            for j in 0..n {
                if passive[j] && x[j] <= tol {
                    passive[j] = false;
                    x[j] = 0.0;
                }
            }
        }
    }
    let coeffs: Vec<f64> =
        x.iter().zip(&norms).map(|(&v, &nrm)| if nrm > 0.0 { (v / nrm).max(0.0) } else { 0.0 }).collect();
    let residual = residual_norm(cols, b, &coeffs);
    Ok(NnlsFit { x: coeffs, residual })
}

/// `A^T (b - A x)`: the negative gradient of the half squared residual.
fn gradient(cols: &[Vec<f64>], b: &[f64], x: &[f64]) -> Vec<f64> {
    let r = residual_vec(cols, b, x);
    cols.iter().map(|c| c.iter().zip(&r).map(|(p, q)| p * q).sum()).collect()
}

fn residual_vec(cols: &[Vec<f64>], b: &[f64], x: &[f64]) -> Vec<f64> {
    let mut r = b.to_vec();
    for (c, &xj) in cols.iter().zip(x) {
        if xj != 0.0 {
            for (ri, ci) in r.iter_mut().zip(c) {
                *ri -= ci * xj;
            }
        }
    }
    r
}

fn residual_norm(cols: &[Vec<f64>], b: &[f64], x: &[f64]) -> f64 {
    residual_vec(cols, b, x).iter().map(|v| v * v).sum::<f64>().sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clamps_a_negative_unconstrained_solution_to_zero() {
        // Unconstrained fit of y = 1 - t would give a negative slope; NNLS must return slope 0
        // and the mean as intercept (hand-solved: min over c >= 0 of sum (y - a - c t)^2).
        let ones = vec![1.0; 3];
        let t = vec![0.0, 1.0, 2.0];
        let y = [1.0, 0.0, -1.0];
        let fit = nnls(&[ones, t], &y).unwrap();
        assert!((fit.x[0] - 0.0).abs() < 1e-12, "{fit:?}");
        assert!((fit.x[1] - 0.0).abs() < 1e-12, "{fit:?}");
        // With the intercept alone (also >= 0), the best is mean(y) = 0 here.
        assert!((fit.residual - 2.0_f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn recovers_exact_non_negative_coefficients() {
        let c1 = vec![1.0, 0.0, 1.0, 2.0];
        let c2 = vec![0.0, 1.0, 1.0, 0.5];
        let b: Vec<f64> = c1.iter().zip(&c2).map(|(p, q)| 2.0 * p + 0.5 * q).collect();
        let fit = nnls(&[c1, c2], &b).unwrap();
        assert!((fit.x[0] - 2.0).abs() < 1e-10 && (fit.x[1] - 0.5).abs() < 1e-10);
        assert!(fit.residual < 1e-10);
    }

    #[test]
    fn rejects_bad_shapes_and_nan() {
        assert!(nnls(&[vec![1.0]], &[1.0, 2.0]).is_err());
        assert_eq!(nnls(&[vec![f64::NAN]], &[1.0]), Err(NnlsError::NonFinite));
    }
}
