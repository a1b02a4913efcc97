//! Named host tensors passed to and from ONNX sessions: a shape and f32 or i64 data, row-major.
//! Kept independent of the kernels' own tensor type so the executor stands alone.

use std::fmt;

/// Element types the executor reports; only `F32` and `I64` can be passed in and out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ElementType {
    /// 32-bit float.
    F32,
    /// 64-bit signed integer.
    I64,
    /// Anything else, as ONNX Runtime names it (e.g. `Float16`, or `sequence` for non-tensors).
    Other(String),
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::F32 => f.write_str("f32"),
            Self::I64 => f.write_str("i64"),
            Self::Other(s) => f.write_str(s),
        }
    }
}

/// The data of a tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 64-bit signed integers.
    I64(Vec<i64>),
}

/// A tensor with the graph input/output name it binds to.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// Graph input or output name.
    pub name: String,
    /// Dimensions; their product equals the data length.
    pub shape: Vec<usize>,
    /// The elements, row-major.
    pub data: TensorData,
}

impl NamedTensor {
    /// An f32 tensor.
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Self {
        Self { name: name.into(), shape, data: TensorData::F32(data) }
    }

    /// An i64 tensor.
    pub fn i64(name: impl Into<String>, shape: Vec<usize>, data: Vec<i64>) -> Self {
        Self { name: name.into(), shape, data: TensorData::I64(data) }
    }

    /// The element type.
    pub fn element_type(&self) -> ElementType {
        match self.data {
            TensorData::F32(_) => ElementType::F32,
            TensorData::I64(_) => ElementType::I64,
        }
    }

    /// Number of elements held.
    pub fn len(&self) -> usize {
        match &self.data {
            TensorData::F32(v) => v.len(),
            TensorData::I64(v) => v.len(),
        }
    }

    /// True when the tensor holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The data as f32, if that is its type.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            TensorData::F32(v) => Some(v),
            TensorData::I64(_) => None,
        }
    }

    /// The data as i64, if that is its type.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            TensorData::I64(v) => Some(v),
            TensorData::F32(_) => None,
        }
    }

    /// Checks that the shape's element count equals the data length (without overflow).
    pub fn check_shape(&self) -> Result<(), String> {
        let count = self
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| format!("{}: shape {:?} overflows", self.name, self.shape))?;
        if count != self.len() {
            return Err(format!(
                "{}: shape {:?} holds {count} elements but {} were given",
                self.name,
                self.shape,
                self.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_checks() {
        assert!(NamedTensor::f32("x", vec![2, 3], vec![0.0; 6]).check_shape().is_ok());
        let short = NamedTensor::i64("ids", vec![2, 3], vec![0; 5]).check_shape();
        assert!(short.unwrap_err().contains("6 elements but 5"));
        let huge = NamedTensor::f32("x", vec![usize::MAX, 2], vec![]).check_shape();
        assert!(huge.unwrap_err().contains("overflows"));
        assert_eq!(NamedTensor::i64("a", vec![0], vec![]).element_type(), ElementType::I64);
    }
}
