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
        DeviceKind::parse(name)?.open()
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

/// Which device to use, before it is opened: a plain value that configs can copy and compare.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceKind {
    /// The host CPU.
    #[default]
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

impl DeviceKind {
    /// Parse `"cpu"`, `"cuda"` (device 0) or `"cuda:N"`.
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda(0)),
            _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceKind::Cuda(n)),
                _ => Err(crate::KernelError::invalid(
                    "device name",
                    format!("unknown device {name:?} (expected cpu, cuda or cuda:N)"),
                )),
            },
        }
    }

    /// Whether work several tasks submit at once runs side by side (a GPU's streams) rather than
    /// in turn on the same processors (the CPU, where one task's step already uses the cores its
    /// work pays for), so co-running tasks finish sooner than one after another.
    pub fn runs_tasks_side_by_side(self) -> bool {
        matches!(self, DeviceKind::Cuda(_))
    }

    /// Open it ([`crate::KernelError::CudaUnavailable`] saying why a GPU cannot be used).
    pub fn open(self) -> Result<Device> {
        match self {
            DeviceKind::Cpu => Ok(Device::Cpu),
            DeviceKind::Cuda(n) => Device::cuda(n),
        }
    }

    /// A short name: `cpu` or `cuda:N`.
    pub fn name(self) -> String {
        match self {
            DeviceKind::Cpu => "cpu".to_string(),
            DeviceKind::Cuda(n) => format!("cuda:{n}"),
        }
    }
}
