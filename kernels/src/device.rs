//! `Device`: where a computation runs. The CUDA variant always exists; whether a GPU is usable is
//! decided at run time (no driver or no device is a clear [`crate::KernelError::CudaUnavailable`], never a panic).

use crate::cuda::CudaDevice;
use crate::error::Result;

/// A compute device.
#[derive(Clone, Debug)]
pub enum Device {
    /// The host CPU (reference implementations).
    Cpu,
    /// One CUDA GPU.
    Cuda(CudaDevice),
}

impl Device {
    /// The CUDA GPU with this ordinal, or [`crate::KernelError::CudaUnavailable`] saying why not.
    pub fn cuda(ordinal: usize) -> Result<Self> {
        Ok(Device::Cuda(CudaDevice::new(ordinal)?))
    }

    /// CUDA device 0 when usable, else the CPU (the reason is logged at `info`).
    pub fn best() -> Self {
        match Self::cuda(0) {
            Ok(d) => d,
            Err(e) => {
                tracing::info!(reason = %e, "using the CPU device");
                Device::Cpu
            }
        }
    }

    /// Parse `"cpu"` or `"cuda"` / `"cuda:N"` (config files) and open that device.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Self::cuda(0),
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Self::cuda(n),
                _ => Err(crate::KernelError::invalid(
                    "Device::from_name",
                    format!("unknown device {name:?} (expected cpu, cuda or cuda:N)"),
                )),
            },
        }
    }

    /// A short name: `cpu` or `cuda:N`.
    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(d) => format!("cuda:{}", d.ordinal()),
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// Wait for all queued work (a no-op on the CPU). Benchmarks call it before reading the clock.
    pub fn sync(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Cuda(d) => d.sync(),
        }
    }
}
