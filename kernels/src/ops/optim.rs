//! Optimiser steps over flat parameter buffers: SGD (with momentum) and AdamW (decoupled decay).

use crate::error::{KernelError, Result};

fn check_lens(op: &'static str, params: &[f32], grads: &[f32], state: &mut Vec<f32>) -> Result<()> {
    if params.len() != grads.len() {
        return Err(KernelError::shape(op, format!("{} params vs {} grads", params.len(), grads.len())));
    }
    if state.is_empty() {
        state.resize(params.len(), 0.0);
    } else if state.len() != params.len() {
        return Err(KernelError::shape(
            op,
            format!("optimiser state for {} params, called with {}", state.len(), params.len()),
        ));
    }
    Ok(())
}

/// Stochastic gradient descent: `v = momentum v + g + wd p; p -= lr v`. One instance per parameter buffer.
#[derive(Clone, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum (0 disables it).
    pub momentum: f32,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
    velocity: Vec<f32>,
}

impl Sgd {
    /// Plain SGD with learning rate `lr`.
    pub fn new(lr: f32) -> Self {
        Self { lr, momentum: 0.0, weight_decay: 0.0, velocity: Vec::new() }
    }

    /// Set the momentum.
    pub fn with_momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// One step; the buffer length is fixed by the first call.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<()> {
        check_lens("sgd", params, grads, &mut self.velocity)?;
        for ((p, &g), v) in params.iter_mut().zip(grads).zip(&mut self.velocity) {
            *v = self.momentum * *v + g + self.weight_decay * *p;
            *p -= self.lr * *v;
        }
        Ok(())
    }
}

/// AdamW (Loshchilov & Hutter): Adam moments with bias correction, weight decay applied to the
/// parameters directly (`p -= lr wd p`), not through the gradient. One instance per parameter buffer.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator guard.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
}

impl AdamW {
    /// Moves the moments into fresh buffers of the same values (a pool compaction's copy).
    pub fn relocate(&mut self) {
        self.m = self.m.clone();
        self.v = self.v.clone();
    }

    /// AdamW with the usual defaults (0.9, 0.999, 1e-8) and weight decay 0.01.
    pub fn new(lr: f32) -> Self {
        Self {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            m: Vec::new(),
            v: Vec::new(),
            t: 0,
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i32 {
        self.t
    }

    /// One step; the buffer length is fixed by the first call.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<()> {
        check_lens("adamw", params, grads, &mut self.m)?;
        check_lens("adamw", params, grads, &mut self.v)?;
        self.t = self.t.saturating_add(1);
        let bc1 = 1.0 - self.beta1.powi(self.t);
        let bc2 = 1.0 - self.beta2.powi(self.t);
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(&mut self.m).zip(&mut self.v) {
            *m = self.beta1 * *m + (1.0 - self.beta1) * g;
            *v = self.beta2 * *v + (1.0 - self.beta2) * g * g;
            let update = (*m / bc1) / ((*v / bc2).sqrt() + self.eps);
            *p -= self.lr * (update + self.weight_decay * *p);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sgd_step_by_hand() {
        let mut p = [1.0, -2.0];
        let mut opt = Sgd::new(0.1);
        opt.step(&mut p, &[0.5, -1.0]).unwrap();
        assert_eq!(p, [0.95, -1.9]);
        let mut q = [0.0];
        let mut mom = Sgd::new(1.0).with_momentum(0.5);
        mom.step(&mut q, &[1.0]).unwrap(); // v = 1, q = -1
        mom.step(&mut q, &[1.0]).unwrap(); // v = 1.5, q = -2.5
        assert_eq!(q, [-2.5]);
        assert!(opt.step(&mut [0.0; 3], &[0.0; 3]).is_err(), "length fixed by first call");
    }

    #[test]
    fn adamw_first_step_is_lr_times_sign() {
        // After one step m_hat = g and v_hat = g^2, so the Adam part moves each parameter by lr * sign(g).
        let mut p = [1.0f32, 1.0, 1.0];
        let mut opt = AdamW::new(0.01);
        opt.weight_decay = 0.0;
        opt.step(&mut p, &[3.0, -0.2, 50.0]).unwrap();
        for (got, want) in p.iter().zip([0.99, 1.01, 0.99]) {
            assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        }
        // Decoupled decay alone: zero gradient shrinks p by lr * wd * p.
        let mut q = [2.0f32];
        let mut decay = AdamW::new(0.1);
        decay.weight_decay = 0.5;
        decay.step(&mut q, &[0.0]).unwrap();
        assert!((q[0] - (2.0 - 0.1 * 0.5 * 2.0)).abs() < 1e-6);
    }

    #[test]
    fn adamw_minimises_a_quadratic() {
        // f(p) = sum (p - c)^2 has gradient 2 (p - c).
        let c = [3.0f32, -1.0, 0.5];
        let mut p = [0.0f32; 3];
        let mut opt = AdamW::new(0.05);
        opt.weight_decay = 0.0;
        for _ in 0..2000 {
            let g: Vec<f32> = p.iter().zip(&c).map(|(p, c)| 2.0 * (p - c)).collect();
            opt.step(&mut p, &g).unwrap();
        }
        for (p, c) in p.iter().zip(&c) {
            assert!((p - c).abs() < 1e-2, "{p} vs {c}");
        }
    }
}
