//! The CUDA device handle: run-time detection, one stream, a lazily created cuBLAS handle and
//! NVRTC modules compiled on first use and cached per device.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream};

use crate::error::{KernelError, Result};

/// One CUDA GPU: context, stream, cuBLAS handle and compiled-kernel cache. Cheap to clone.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    name: String,
    stream: Arc<CudaStream>,
    blas: Mutex<Option<Arc<CudaBlas>>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ordinal)
            .field("name", &self.inner.name)
            .finish()
    }
}

/// Whether a CUDA driver library (libcuda) can be loaded; makes no CUDA call.
pub fn driver_library_present() -> bool {
    // SAFETY: only tries to dlopen libcuda by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Compile CUDA C to PTX with NVRTC (needs libnvrtc, not a GPU).
pub(crate) fn compile(src: &str) -> Result<cudarc::nvrtc::Ptx> {
    // SAFETY: only tries to dlopen libnvrtc; without it compile_ptx would panic.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(KernelError::CudaUnavailable("libnvrtc was not found on the library path".to_string()));
    }
    guarded("compiling CUDA kernels", || {
        cudarc::nvrtc::compile_ptx(src).map_err(|e| KernelError::cuda("NVRTC compile", e))
    })
}

/// The PTX of the expert-FFN elementwise kernels, compiled now (checks the CUDA C without a GPU).
pub fn ffn_kernels_ptx() -> Result<String> {
    Ok(compile(super::kernels::SRC)?.to_src())
}

/// Whether CUDA device `ordinal` can be opened; `Err` carries the reason. Never panics.
pub fn cuda_available(ordinal: usize) -> Result<()> {
    probe(ordinal).map(|_| ())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Runs a cudarc call that may panic when a dynamically loaded library lacks a symbol.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        Err(KernelError::CudaUnavailable(format!(
            "{what}: CUDA library is incomplete ({})",
            panic_message(p.as_ref())
        )))
    })
}

fn probe(ordinal: usize) -> Result<Arc<CudaContext>> {
    // Without this check CudaContext::new panics when libcuda is absent.
    if !driver_library_present() {
        return Err(KernelError::CudaUnavailable(
            "no CUDA driver: libcuda.so was not found on the library path".to_string(),
        ));
    }
    guarded("probing the CUDA driver", || {
        let count = CudaContext::device_count().map_err(|e| {
            KernelError::CudaUnavailable(format!("no CUDA device: driver initialisation failed: {e}"))
        })?;
        if count <= 0 {
            return Err(KernelError::CudaUnavailable(
                "no CUDA device: the driver reports 0 devices".to_string(),
            ));
        }
        if ordinal >= count as usize {
            return Err(KernelError::CudaUnavailable(format!(
                "no CUDA device with ordinal {ordinal} ({count} present)"
            )));
        }
        CudaContext::new(ordinal)
            .map_err(|e| KernelError::CudaUnavailable(format!("cannot open CUDA device {ordinal}: {e}")))
    })
}

impl CudaDevice {
    /// Open GPU `ordinal`, or say why not ([`KernelError::CudaUnavailable`]).
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = probe(ordinal)?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let stream = ctx.default_stream();
        Ok(Self {
            inner: Arc::new(Inner {
                ordinal,
                name,
                stream,
                blas: Mutex::new(None),
                modules: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The GPU's marketing name as the driver reports it.
    pub fn gpu_name(&self) -> &str {
        &self.inner.name
    }

    /// The stream all of this crate's work on the device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.inner.stream.context().mem_get_info().map_err(|e| KernelError::cuda("mem_get_info", e))
    }

    /// Block until all queued work has finished.
    pub fn sync(&self) -> Result<()> {
        self.inner.stream.synchronize().map_err(|e| KernelError::cuda("stream synchronize", e))
    }

    /// Copy host f32s to a new device buffer.
    pub fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        self.inner.stream.clone_htod(data).map_err(|e| KernelError::cuda("host-to-device copy", e))
    }

    /// A zeroed device buffer of `len` f32s.
    pub fn zeros(&self, len: usize) -> Result<CudaSlice<f32>> {
        self.inner.stream.alloc_zeros::<f32>(len).map_err(|e| KernelError::cuda("device alloc", e))
    }

    /// Copy a device buffer back to the host.
    pub fn download(&self, data: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.inner.stream.clone_dtoh(data).map_err(|e| KernelError::cuda("device-to-host copy", e))
    }

    /// Make this device's context current on the calling thread (cuBLAS calls do not do it
    /// themselves; actors may call from any worker thread).
    pub(crate) fn bind(&self) -> Result<()> {
        self.inner.stream.context().bind_to_thread().map_err(|e| KernelError::cuda("bind context", e))
    }

    /// The cuBLAS handle (created on first use).
    pub(crate) fn blas(&self) -> Result<Arc<CudaBlas>> {
        let mut slot =
            self.inner.blas.lock().map_err(|_| KernelError::cuda("cuBLAS handle", "lock poisoned"))?;
        if let Some(b) = slot.as_ref() {
            return Ok(b.clone());
        }
        // SAFETY: only tries to dlopen libcublas; without it CudaBlas::new would panic.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(KernelError::CudaUnavailable(
                "libcublas was not found on the library path".to_string(),
            ));
        }
        let stream = self.inner.stream.clone();
        let blas = guarded("creating a cuBLAS handle", || {
            CudaBlas::new(stream).map_err(|e| KernelError::cuda("cublasCreate", e))
        })?;
        let blas = Arc::new(blas);
        *slot = Some(blas.clone());
        Ok(blas)
    }

    /// Function `name` from the NVRTC module `module` (compiled from `src` and loaded on first use).
    pub(crate) fn function(
        &self,
        module: &'static str,
        src: &'static str,
        name: &str,
    ) -> Result<CudaFunction> {
        let mut modules =
            self.inner.modules.lock().map_err(|_| KernelError::cuda("module cache", "lock poisoned"))?;
        let m = match modules.get(module) {
            Some(m) => m.clone(),
            None => {
                let ptx = compile(src)?;
                let m = self
                    .inner
                    .stream
                    .context()
                    .load_module(ptx)
                    .map_err(|e| KernelError::cuda("load PTX module", e))?;
                modules.insert(module, m.clone());
                m
            }
        };
        m.load_function(name).map_err(|e| KernelError::cuda("load kernel function", e))
    }
}

/// Byte buffers on the device (the weight store's device-tier arena).
impl CudaDevice {
    /// A zeroed device buffer of `len` bytes.
    pub fn alloc_bytes(&self, len: usize) -> Result<CudaSlice<u8>> {
        self.inner.stream.alloc_zeros::<u8>(len).map_err(|e| KernelError::cuda("device alloc", e))
    }

    /// Copy `data` into `buf` at `offset`.
    pub fn write_bytes(&self, buf: &mut CudaSlice<u8>, offset: usize, data: &[u8]) -> Result<()> {
        let end = offset
            .checked_add(data.len())
            .filter(|&e| e <= buf.len())
            .ok_or_else(|| KernelError::invalid("write_bytes", "range outside the device buffer"))?;
        let mut dst = buf.slice_mut(offset..end);
        self.inner.stream.memcpy_htod(data, &mut dst).map_err(|e| KernelError::cuda("host-to-device copy", e))
    }

    /// Copy `len` bytes at `offset` of `buf` back to the host.
    pub fn read_bytes(&self, buf: &CudaSlice<u8>, offset: usize, len: usize) -> Result<Vec<u8>> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= buf.len())
            .ok_or_else(|| KernelError::invalid("read_bytes", "range outside the device buffer"))?;
        let src = buf.slice(offset..end);
        self.inner.stream.clone_dtoh(&src).map_err(|e| KernelError::cuda("device-to-host copy", e))
    }

    /// Copy `dst.len()` bytes at `offset` of `buf` into `dst`, waiting for the copy.
    pub fn read_bytes_into(&self, buf: &CudaSlice<u8>, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(dst.len())
            .filter(|&e| e <= buf.len())
            .ok_or_else(|| KernelError::invalid("read_bytes_into", "range outside the device buffer"))?;
        let src = buf.slice(offset..end);
        self.inner.stream.memcpy_dtoh(&src, dst).map_err(|e| KernelError::cuda("device-to-host copy", e))?;
        self.sync()
    }
}
