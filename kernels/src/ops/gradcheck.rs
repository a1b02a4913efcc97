//! Test helper: central finite differences in f64 against an analytic gradient.

/// Deterministic pseudo-random values in `[-scale, scale]` (a tiny LCG; tests need no RNG crate here).
pub(crate) fn random_vec(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

/// Step of the central difference. f32 forward passes lose ~1e-7 relative per value; with this
/// step the truncation error (~h^2) and the rounding error (~1e-7/h) both stay below ~1e-4.
pub(crate) const STEP: f32 = 1e-2;
/// Tolerance: |numeric - analytic| <= ABS_TOL + REL_TOL * max(|numeric|, |analytic|).
pub(crate) const ABS_TOL: f64 = 2e-3;
/// See [`ABS_TOL`].
pub(crate) const REL_TOL: f64 = 1e-2;

/// Assert that `analytic` is the gradient of the scalar `f` at `x` (central differences, f64 loss).
pub(crate) fn check_grad(name: &str, x: &[f32], analytic: &[f32], f: impl Fn(&[f32]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let mut xs = x.to_vec();
    for i in 0..x.len() {
        let orig = xs[i];
        xs[i] = orig + STEP;
        let plus = f(&xs);
        xs[i] = orig - STEP;
        let minus = f(&xs);
        xs[i] = orig;
        let numeric = (plus - minus) / (2.0 * f64::from(STEP));
        let a = f64::from(analytic[i]);
        let tol = ABS_TOL + REL_TOL * numeric.abs().max(a.abs());
        assert!(
            (numeric - a).abs() <= tol,
            "{name}[{i}]: numeric {numeric:.6} vs analytic {a:.6} (tol {tol:.2e})"
        );
    }
}
