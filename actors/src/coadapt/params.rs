//! The trainable part of a V-MoE (experts, projector, head) as one flat `f32` vector: what the edge
//! sends back to a camera after adaptation and what the camera installs. Shared parts never travel.

use troupe_kernels::tensor::Tensor;
use troupe_kernels::vmoe::{ParamGroup, VMoe};

/// Why an update could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The update has the wrong number of values for this model.
    #[error("update has {got} values, the model's trainable part has {expected}")]
    Length {
        /// Values expected.
        expected: usize,
        /// Values received.
        got: usize,
    },
    /// A value is NaN or infinite.
    #[error("update value {index} is not finite")]
    NotFinite {
        /// Its position.
        index: usize,
    },
    /// A tensor could not be rebuilt.
    #[error("rebuilding a tensor: {0}")]
    Tensor(String),
}

/// Number of trainable values of `model`.
pub fn trainable_len(model: &VMoe) -> usize {
    model.params.tensors().iter().filter(|(g, _)| *g != ParamGroup::Shared).map(|(_, t)| t.numel()).sum()
}

/// Experts, projector and head, flattened in [`troupe_kernels::vmoe::VMoeParams::tensors`] order.
pub fn trainable_params(model: &VMoe) -> Vec<f32> {
    let mut out = Vec::with_capacity(trainable_len(model));
    for (g, t) in model.params.tensors() {
        if g != ParamGroup::Shared {
            out.extend_from_slice(&t.f32_cow());
        }
    }
    out
}

/// Replaces the trainable part of `model` with `values` (checked: length and finiteness first, so
/// a bad update changes nothing).
pub fn install_trainable(model: &mut VMoe, values: &[f32]) -> Result<(), InstallError> {
    let expected = trainable_len(model);
    if values.len() != expected {
        return Err(InstallError::Length { expected, got: values.len() });
    }
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(InstallError::NotFinite { index });
    }
    let mut at = 0;
    for (g, t) in model.params.tensors_mut() {
        if g == ParamGroup::Shared {
            continue;
        }
        let n = t.numel();
        let shape = t.shape().to_vec();
        *t = Tensor::from_f32(&shape, values[at..at + n].to_vec())
            .map_err(|e| InstallError::Tensor(e.to_string()))?;
        at += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::SmallRng;
    use troupe_kernels::vmoe::VMoeConfig;

    #[test]
    fn round_trip_moves_only_trainable_parts() {
        let a = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(1)).unwrap();
        let mut b = VMoe::new(VMoeConfig::tiny(), &mut SmallRng::seed_from_u64(2)).unwrap();
        let c = VMoeConfig::tiny();
        // Per expert: two dense layers with biases; then the projector and the head.
        let (d, h, p) = (c.dim, c.hidden, c.proj);
        let expected =
            c.blocks * c.experts * (d * h + h + h * d + d) + (d * p + p) + (p * c.classes + c.classes);
        assert_eq!(trainable_len(&a), expected);
        assert_eq!(expected, c.param_count() - c.shared_params());
        install_trainable(&mut b, &trainable_params(&a)).unwrap();
        assert_eq!(trainable_params(&b), trainable_params(&a));
        // Shared parts are b's own.
        assert_ne!(b.params.patch_w.to_vec_f32(), a.params.patch_w.to_vec_f32());
        let before = trainable_params(&b);
        assert!(matches!(install_trainable(&mut b, &[0.0; 3]), Err(InstallError::Length { .. })));
        let mut nan = before.clone();
        nan[7] = f32::NAN;
        assert!(matches!(install_trainable(&mut b, &nan), Err(InstallError::NotFinite { index: 7 })));
        assert_eq!(trainable_params(&b), before, "refused updates change nothing");
    }
}
