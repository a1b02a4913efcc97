//! `Tensor`: a shape over a shared, contiguous f32 or bf16 buffer.
//!
//! Buffers are `Arc`'d so clones, `reshape` and `narrow_rows` are views that copy nothing; writing
//! through [`Tensor::f32_mut`] copies only when the buffer is shared or the tensor is a view
//! (copy-on-write). bf16 is stored as raw `u16` bits; ops compute in f32.

use std::borrow::Cow;
use std::sync::Arc;

use crate::error::{KernelError, Result};

/// Element type of a tensor's storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE-754 single precision.
    F32,
    /// bfloat16 (the top 16 bits of an f32), stored as `u16` bits.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
        }
    }
}

/// f32 -> bf16 bits, rounding to nearest even; NaN stays NaN (quiet), overflow goes to infinity.
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let rounding_bias = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding_bias) >> 16) as u16
}

/// bf16 bits -> f32 (exact).
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

#[derive(Clone, Debug)]
enum Buffer {
    F32(Arc<Vec<f32>>),
    Bf16(Arc<Vec<u16>>),
}

/// An n-dimensional, row-major, contiguous tensor on the host.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    buf: Buffer,
    /// First element of this view inside `buf`.
    offset: usize,
}

fn numel_of(op: &'static str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| KernelError::shape(op, format!("element count of {shape:?} overflows")))
}

impl Tensor {
    /// A tensor owning `data` (row-major) with `shape`.
    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> Result<Self> {
        let n = numel_of("from_f32", shape)?;
        if n != data.len() {
            return Err(KernelError::shape(
                "from_f32",
                format!("shape {shape:?} needs {n} elements, got {}", data.len()),
            ));
        }
        Ok(Self { shape: shape.to_vec(), buf: Buffer::F32(Arc::new(data)), offset: 0 })
    }

    /// A bf16 tensor from raw bf16 bits.
    pub fn from_bf16_bits(shape: &[usize], bits: Vec<u16>) -> Result<Self> {
        let n = numel_of("from_bf16_bits", shape)?;
        if n != bits.len() {
            return Err(KernelError::shape(
                "from_bf16_bits",
                format!("shape {shape:?} needs {n} elements, got {}", bits.len()),
            ));
        }
        Ok(Self { shape: shape.to_vec(), buf: Buffer::Bf16(Arc::new(bits)), offset: 0 })
    }

    /// An f32 tensor filled with `value`.
    pub fn full(shape: &[usize], value: f32) -> Result<Self> {
        let n = numel_of("full", shape)?;
        Self::from_f32(shape, vec![value; n])
    }

    /// An f32 tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Result<Self> {
        Self::full(shape, 0.0)
    }

    /// A tensor from little-endian bytes of the given dtype (e.g. a blob from the weight store).
    pub fn from_le_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let n = numel_of("from_le_bytes", shape)?;
        let want = n
            .checked_mul(dtype.size_in_bytes())
            .ok_or_else(|| KernelError::shape("from_le_bytes", "byte size overflows"))?;
        if bytes.len() != want {
            return Err(KernelError::shape(
                "from_le_bytes",
                format!("{dtype:?} {shape:?} needs {want} bytes, got {}", bytes.len()),
            ));
        }
        match dtype {
            DType::F32 => Self::from_f32(
                shape,
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            DType::BF16 => Self::from_bf16_bits(
                shape,
                bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
            ),
        }
    }

    /// The tensor's elements as little-endian bytes of its dtype.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.buf {
            Buffer::F32(v) => v[self.range()].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::Bf16(v) => v[self.range()].iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel()
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        match self.buf {
            Buffer::F32(_) => DType::F32,
            Buffer::Bf16(_) => DType::BF16,
        }
    }

    /// Bytes the elements of this view occupy.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }

    /// `(rows, cols)` of a rank-2 tensor.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match self.shape[..] {
            [r, c] => Ok((r, c)),
            _ => Err(KernelError::shape("dims2", format!("expected rank 2, got {:?}", self.shape))),
        }
    }

    /// The same elements under a new shape (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        let n = numel_of("reshape", shape)?;
        if n != self.numel() {
            return Err(KernelError::shape(
                "reshape",
                format!("cannot reshape {:?} to {shape:?}", self.shape),
            ));
        }
        Ok(Self { shape: shape.to_vec(), buf: self.buf.clone(), offset: self.offset })
    }

    /// Rows `start..start+len` along the first dimension (no copy).
    pub fn narrow_rows(&self, start: usize, len: usize) -> Result<Self> {
        let Some(&rows) = self.shape.first() else {
            return Err(KernelError::shape("narrow_rows", "rank-0 tensor has no rows"));
        };
        if start.checked_add(len).is_none_or(|end| end > rows) {
            return Err(KernelError::shape(
                "narrow_rows",
                format!("rows {start}..{start}+{len} out of 0..{rows}"),
            ));
        }
        let row_len: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = len;
        Ok(Self { shape, buf: self.buf.clone(), offset: self.offset + start * row_len })
    }

    /// The f32 elements, borrowed; an error for bf16 tensors (use [`Tensor::f32_cow`]).
    pub fn as_f32(&self) -> Result<&[f32]> {
        match &self.buf {
            Buffer::F32(v) => Ok(&v[self.range()]),
            Buffer::Bf16(_) => {
                Err(KernelError::invalid("as_f32", "tensor is bf16; convert with to_dtype(F32)"))
            }
        }
    }

    /// The raw bf16 bits, borrowed; an error for f32 tensors.
    pub fn as_bf16_bits(&self) -> Result<&[u16]> {
        match &self.buf {
            Buffer::Bf16(v) => Ok(&v[self.range()]),
            Buffer::F32(_) => Err(KernelError::invalid("as_bf16_bits", "tensor is f32")),
        }
    }

    /// The elements as f32: borrowed for f32, converted for bf16.
    pub fn f32_cow(&self) -> Cow<'_, [f32]> {
        match &self.buf {
            Buffer::F32(v) => Cow::Borrowed(&v[self.range()]),
            Buffer::Bf16(v) => Cow::Owned(v[self.range()].iter().map(|&b| bf16_to_f32(b)).collect()),
        }
    }

    /// A copy of the elements as f32.
    pub fn to_vec_f32(&self) -> Vec<f32> {
        self.f32_cow().into_owned()
    }

    /// The tensor converted to `dtype` (a cheap clone when it already has it).
    pub fn to_dtype(&self, dtype: DType) -> Self {
        if self.dtype() == dtype {
            return self.clone();
        }
        let buf = match (&self.buf, dtype) {
            (Buffer::F32(v), DType::BF16) => {
                Buffer::Bf16(Arc::new(v[self.range()].iter().map(|&x| f32_to_bf16(x)).collect()))
            }
            (Buffer::Bf16(v), DType::F32) => {
                Buffer::F32(Arc::new(v[self.range()].iter().map(|&b| bf16_to_f32(b)).collect()))
            }
            _ => self.buf.clone(),
        };
        Self { shape: self.shape.clone(), buf, offset: 0 }
    }

    /// Mutable f32 elements; copies first if the buffer is shared or this is a view (copy-on-write).
    pub fn f32_mut(&mut self) -> Result<&mut [f32]> {
        let range = self.range();
        match &mut self.buf {
            Buffer::F32(v) => {
                if range.start != 0 || range.end != v.len() {
                    *v = Arc::new(v[range.clone()].to_vec());
                    self.offset = 0;
                }
                Ok(Arc::make_mut(v).as_mut_slice())
            }
            Buffer::Bf16(_) => {
                Err(KernelError::invalid("f32_mut", "tensor is bf16; convert with to_dtype(F32)"))
            }
        }
    }

    /// Whether two tensors are views of the same buffer (for tests of the no-copy paths).
    pub fn shares_buffer_with(&self, other: &Tensor) -> bool {
        match (&self.buf, &other.buf) {
            (Buffer::F32(a), Buffer::F32(b)) => Arc::ptr_eq(a, b),
            (Buffer::Bf16(a), Buffer::Bf16(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_round_trip_and_rounding() {
        // Exactly representable values survive.
        for x in [0.0f32, 1.0, -2.5, 0.15625, 65280.0] {
            assert_eq!(bf16_to_f32(f32_to_bf16(x)), x);
        }
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
        assert_eq!(bf16_to_f32(f32_to_bf16(1.0 + 3.0 / 256.0)), 1.0 + 1.0 / 64.0);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        assert_eq!(bf16_to_f32(f32_to_bf16(f32::MAX)), f32::INFINITY);
        // bf16 keeps 8 significant bits, so round-to-nearest is within 2^-8 relative.
        for i in 1..1000 {
            let x = i as f32 * 0.7311;
            let y = bf16_to_f32(f32_to_bf16(x));
            assert!(((y - x) / x).abs() <= 1.0 / 256.0, "{x} -> {y}");
        }
    }

    #[test]
    fn views_share_and_copy_on_write() {
        let t = Tensor::from_f32(&[3, 2], vec![1., 2., 3., 4., 5., 6.]).unwrap();
        let r = t.reshape(&[2, 3]).unwrap();
        assert!(r.shares_buffer_with(&t));
        let mid = t.narrow_rows(1, 2).unwrap();
        assert!(mid.shares_buffer_with(&t));
        assert_eq!(mid.shape(), &[2, 2]);
        assert_eq!(mid.as_f32().unwrap(), &[3., 4., 5., 6.]);
        let mut m = mid.clone();
        m.f32_mut().unwrap()[0] = 30.0;
        assert!(!m.shares_buffer_with(&t));
        assert_eq!(m.to_vec_f32(), vec![30., 4., 5., 6.]);
        assert_eq!(t.as_f32().unwrap()[2], 3.0, "original untouched");
        assert!(t.narrow_rows(2, 2).is_err());
        assert!(t.reshape(&[4, 2]).is_err());
        assert!(Tensor::from_f32(&[2, 2], vec![0.0; 3]).is_err());
    }

    #[test]
    fn dtype_and_bytes_round_trip() {
        let t = Tensor::from_f32(&[2, 2], vec![1.0, -0.5, 3.0, 1e-3]).unwrap();
        let b = t.to_dtype(DType::BF16);
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(b.size_in_bytes(), 8);
        let back = b.to_vec_f32();
        assert_eq!(&back[..3], &[1.0, -0.5, 3.0]);
        assert!((back[3] - 1e-3).abs() < 1e-5);
        let bytes = t.to_le_bytes();
        let t2 = Tensor::from_le_bytes(DType::F32, &[2, 2], &bytes).unwrap();
        assert_eq!(t2.to_vec_f32(), t.to_vec_f32());
        assert!(Tensor::from_le_bytes(DType::F32, &[3], &bytes).is_err());
    }
}
