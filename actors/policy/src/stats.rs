//! The one quantile definition troupe uses (nearest rank), for benchmarks, profilers and reports, so
//! every figure called a median or p99 means the same thing (even counts take the lower middle).

/// The `q` quantile (0..=1) of `samples` (sorted in place), nearest rank.
pub fn quantile(samples: &mut [f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let rank = ((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len());
    samples[rank - 1]
}

/// Median of `samples` (sorted in place).
pub fn median(samples: &mut [f64]) -> f64 {
    quantile(samples, 0.5)
}

/// Median of owned `samples`.
pub fn median_of(mut samples: Vec<f64>) -> f64 {
    median(&mut samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let mut v = vec![5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(median(&mut v), 3.0);
        assert_eq!(quantile(&mut v, 0.99), 5.0);
        assert_eq!(quantile(&mut v, 0.0), 1.0);
        assert!(quantile(&mut [], 0.5).is_nan());
        // Even counts: the lower middle, as nearest rank defines it.
        assert_eq!(median_of(vec![4.0, 1.0, 3.0, 2.0]), 2.0);
    }
}
