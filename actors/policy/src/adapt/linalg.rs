//! Dense least squares for the tiny systems the adaptation policies fit (a handful of columns).
//!
//! Householder QR on a column-major copy; used by [`super::nnls`] for its passive-set subproblems.

/// Solves `min ||A x - b||` for the columns `cols` of `A` (all of length `b.len()`).
///
/// Returns `None` when the columns are (numerically) rank deficient or there are more columns
/// than rows, so callers can treat the subproblem as degenerate instead of trusting noise.
pub(crate) fn least_squares(cols: &[&[f64]], b: &[f64]) -> Option<Vec<f64>> {
    let m = b.len();
    let n = cols.len();
    if n == 0 {
        return Some(Vec::new());
    }
    if n > m || cols.iter().any(|c| c.len() != m) {
        return None;
    }
    // Unit-norm columns so the rank test does not depend on the columns' units.
    let norms: Vec<f64> = cols.iter().map(|c| c.iter().map(|v| v * v).sum::<f64>().sqrt()).collect();
    if norms.iter().any(|n| !n.is_finite() || *n == 0.0) {
        return None;
    }
    let mut a: Vec<Vec<f64>> =
        cols.iter().zip(&norms).map(|(c, n)| c.iter().map(|v| v / n).collect()).collect();
    let mut y = b.to_vec();
    let scale = 1.0;
    for k in 0..n {
        let norm = a[k][k..].iter().map(|v| v * v).sum::<f64>().sqrt();
        if norm <= 1e-10 * scale {
            return None;
        }
        let alpha = if a[k][k] > 0.0 { -norm } else { norm };
        let mut v: Vec<f64> = a[k][k..].to_vec();
        v[0] -= alpha;
        let vnorm2: f64 = v.iter().map(|x| x * x).sum();
        if vnorm2 > 0.0 {
            for col in a.iter_mut().skip(k) {
                let dot: f64 = v.iter().zip(&col[k..]).map(|(p, q)| p * q).sum();
                let f = 2.0 * dot / vnorm2;
                for (c, vi) in col[k..].iter_mut().zip(&v) {
                    *c -= f * vi;
                }
            }
            let dot: f64 = v.iter().zip(&y[k..]).map(|(p, q)| p * q).sum();
            let f = 2.0 * dot / vnorm2;
            for (c, vi) in y[k..].iter_mut().zip(&v) {
                *c -= f * vi;
            }
        }
    }
    let mut x = vec![0.0; n];
    for k in (0..n).rev() {
        let mut s = y[k];
        for j in k + 1..n {
            s -= a[j][k] * x[j];
        }
        let d = a[k][k];
        if d.abs() <= 1e-10 * scale {
            return None;
        }
        x[k] = s / d;
    }
    for (xk, n) in x.iter_mut().zip(&norms) {
        *xk /= n;
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_an_exact_overdetermined_system() {
        // y = 2 + 3 t at t = 0..4.
        let ones = [1.0; 5];
        let t = [0.0, 1.0, 2.0, 3.0, 4.0];
        let y: Vec<f64> = t.iter().map(|t| 2.0 + 3.0 * t).collect();
        let x = least_squares(&[&ones, &t], &y).unwrap();
        assert!((x[0] - 2.0).abs() < 1e-12 && (x[1] - 3.0).abs() < 1e-12, "{x:?}");
    }

    #[test]
    fn rejects_collinear_columns() {
        let a = [1.0, 2.0, 3.0];
        let b = [2.0, 4.0, 6.0];
        assert!(least_squares(&[&a, &b], &[1.0, 1.0, 1.0]).is_none());
    }
}
