//! Elementwise ops on device buffers (row bias add, ReLU, row softmax) through the NVRTC kernels
//! of [`super::kernels`], and their host-tensor forms behind the ops' [`crate::Op::cuda`].

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use super::CudaDevice;
use super::kernels::{MODULE, SRC};
use crate::error::{KernelError, Result};
use crate::tensor::Tensor;

/// `v` as the `int` the kernels take, or an error naming `what`.
fn as_i32(what: &str, v: usize) -> Result<i32> {
    i32::try_from(v)
        .map_err(|_| KernelError::invalid("cuda elementwise", format!("{what} = {v} exceeds i32")))
}

/// A launch of one thread per item (at least one block, so zero items launch nothing harmful).
fn launch_for(items: i32) -> LaunchConfig {
    LaunchConfig::for_num_elems(items.max(1) as u32)
}

/// Checks that `len` is `rows * cols`, naming `op`.
fn check_matrix(op: &'static str, len: usize, rows: usize, cols: usize) -> Result<()> {
    if rows.checked_mul(cols) != Some(len) {
        return Err(KernelError::shape(op, format!("{len} elements for {rows} x {cols}")));
    }
    Ok(())
}

/// `y[r, c] += bias[c]` for the row-major `rows x cols` buffer `y`.
pub fn bias_add_rows_device(
    dev: &CudaDevice,
    y: &mut CudaSlice<f32>,
    bias: &CudaView<'_, f32>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    check_matrix("bias_add", y.len(), rows, cols)?;
    if bias.len() != cols {
        return Err(KernelError::shape(
            "bias_add",
            format!("bias of {} elements for {cols} columns", bias.len()),
        ));
    }
    let (total, c) = (as_i32("elements", y.len())?, as_i32("columns", cols)?);
    if total == 0 {
        return Ok(());
    }
    dev.bind()?;
    let f = dev.function(MODULE, SRC, "bias_add_rows")?;
    // SAFETY: y holds `total` f32s and bias `c`; the kernel bounds-checks `i < total`.
    unsafe { dev.stream().launch_builder(&f).arg(y).arg(bias).arg(&total).arg(&c).launch(launch_for(total)) }
        .map_err(|e| KernelError::cuda("launch bias_add_rows", e))?;
    Ok(())
}

/// `y = max(y, 0)` in place.
pub fn relu_device(dev: &CudaDevice, y: &mut CudaSlice<f32>) -> Result<()> {
    let total = as_i32("elements", y.len())?;
    if total == 0 {
        return Ok(());
    }
    dev.bind()?;
    let f = dev.function(MODULE, SRC, "relu_inplace")?;
    // SAFETY: y holds `total` f32s; the kernel bounds-checks `i < total`.
    unsafe { dev.stream().launch_builder(&f).arg(y).arg(&total).launch(launch_for(total)) }
        .map_err(|e| KernelError::cuda("launch relu_inplace", e))?;
    Ok(())
}

/// Softmax of each row of the row-major `rows x cols` buffer `y`, in place.
pub fn softmax_rows_device(dev: &CudaDevice, y: &mut CudaSlice<f32>, rows: usize, cols: usize) -> Result<()> {
    check_matrix("softmax", y.len(), rows, cols)?;
    let (r, c) = (as_i32("rows", rows)?, as_i32("columns", cols)?);
    if r == 0 || c == 0 {
        return Ok(());
    }
    dev.bind()?;
    let f = dev.function(MODULE, SRC, "softmax_rows")?;
    // SAFETY: y holds `r * c` f32s; the kernel bounds-checks `row < rows` and reads `cols` per row.
    unsafe { dev.stream().launch_builder(&f).arg(y).arg(&r).arg(&c).launch(launch_for(r)) }
        .map_err(|e| KernelError::cuda("launch softmax_rows", e))?;
    Ok(())
}

/// `x + bias` per row on the GPU (host tensors in and out).
pub fn bias_add(dev: &CudaDevice, x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    let (rows, cols) = crate::ops::rows_cols("bias_add", x)?;
    let mut y = dev.upload(&x.f32_cow())?;
    let b = dev.upload(&bias.f32_cow())?;
    bias_add_rows_device(dev, &mut y, &b.as_view(), rows, cols)?;
    Tensor::from_f32(x.shape(), dev.download(&y)?)
}

/// ReLU of every element on the GPU (host tensors in and out).
pub fn relu(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    let mut y = dev.upload(&x.f32_cow())?;
    relu_device(dev, &mut y)?;
    Tensor::from_f32(x.shape(), dev.download(&y)?)
}

/// Row softmax on the GPU (host tensors in and out).
pub fn softmax(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    let (rows, cols) = crate::ops::rows_cols("softmax", x)?;
    let mut y = dev.upload(&x.f32_cow())?;
    softmax_rows_device(dev, &mut y, rows, cols)?;
    Tensor::from_f32(&[rows, cols], dev.download(&y)?)
}
