//! The CUDA backend (feature `cuda`): the distillation kernels on an NVIDIA GPU through cudarc.
//!
//! # Why it looks like this
//! - **Run-time compilation.** The kernels are CUDA C ([`KERNEL_SOURCE`], `kernels.cu`) compiled
//!   by NVRTC for the device's compute capability the first time a backend is created for it,
//!   loaded once and cached for the life of the process. No CUDA toolkit is needed at build time,
//!   and the same binary runs on any GPU the driver supports.
//! - **Dynamic loading, never a panic.** cudarc is built with `dynamic-loading`: `libcuda` and
//!   `libnvrtc` are opened on first use, and cudarc *panics* when one is missing. So
//!   [`CudaBackend::new`] first asks cudarc whether each library can be opened
//!   (`is_culib_present`) and returns [`CudaError::NoDriver`] / [`CudaError::NoNvrtc`] before any
//!   CUDA call; everything after that runs inside `catch_unwind`, so a missing symbol in an old
//!   driver becomes [`CudaError::Panicked`] (with `panic = "abort"` it would still abort).
//!   [`crate::Backend::detect`] turns any error into the CPU backend and one log line.
//! - **Same numbers as the CPU.** Statistics and the sign-pack scale are reduced with the CPU's
//!   chunk/lane layout and combined on the host in the CPU's order; int8 rounding (nearest and
//!   stochastic) uses the CPU's formulas with scale and inverse computed on the host; top-k
//!   returns exactly the CPU's selection (ties towards the lower index). These are bit-identical
//!   to the CPU kernels. The count-sketch adds into buckets with atomics, so its buckets equal the
//!   CPU's up to the order of float additions.
//! - **Two ways in.** Data already on the GPU uses the `*_on_device` methods on [`CudaBackend`]
//!   (no host round trip). The [`crate::Kernels`] implementation takes host slices like every
//!   backend: for slices of at least [`DEVICE_MIN_LEN`] elements, `accumulate`, `stats`,
//!   `topk_exact`, `quantize_i8`, `sign_pack` and `count_sketch` copy to the device, run there and
//!   copy back; every other kernel (and any of these on a short slice, or whose device run fails
//!   for any reason) runs on the CPU implementation, which also produces the exact typed errors.
//!
//! # Safety
//! Kernel launches are `unsafe` in cudarc (it cannot check argument types against the kernel's
//! signature), as is probing for a shared library. This module therefore allows `unsafe_code`;
//! each block states why it is sound.

#![allow(unsafe_code)]

mod error;
mod host;
mod ops;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::cpu::CpuBackend;

pub use error::CudaError;
pub use ops::DeviceSelection;

/// The CUDA C source of every kernel, compiled at run time by NVRTC.
pub const KERNEL_SOURCE: &str = include_str!("kernels.cu");

/// The `extern "C"` entry points of [`KERNEL_SOURCE`], all loaded when a backend starts.
pub const KERNEL_NAMES: &[&str] = &[
    "accumulate_stats",
    "sign_pack",
    "abs_max_bits",
    "quantize_ef",
    "radix_histogram",
    "topk_count",
    "topk_sample",
    "topk_gather",
    "topk_candidate_counts",
    "topk_compact",
    "count_sketch",
];

/// Host slices shorter than this run on the CPU even on a [`CudaBackend`]: below it, the two
/// host-device copies cost more than the CPU kernel.
pub const DEVICE_MIN_LEN: usize = 1 << 16;

/// Whether cudarc can open an NVRTC library (`libnvrtc.so*` on the library search path).
pub fn nvrtc_available() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on candidate library names and closes what
    // it opened; NVRTC's initialisers have no preconditions.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cudarc can open a CUDA driver library (`libcuda.so*`).
pub fn driver_available() -> bool {
    // SAFETY: as in `nvrtc_available`: a `dlopen` probe of the driver library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Run `f`, turning a cudarc panic into [`CudaError::Panicked`].
fn guarded<T>(
    during: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Err(CudaError::Panicked { during, message })
    })
}

/// Compile [`KERNEL_SOURCE`] with NVRTC for a virtual architecture such as `"compute_90"`,
/// with the options the backend uses (no FMA contraction, so rounding matches the CPU).
///
/// # Errors
/// [`CudaError::NoNvrtc`] when no NVRTC library can be loaded (checked first, so this never
/// panics for a missing library), [`CudaError::Compile`] when NVRTC rejects the source.
pub fn compile_kernels(arch: &str) -> Result<Ptx, CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    guarded("NVRTC compilation", || {
        let opts = CompileOptions {
            fmad: Some(false),
            ftz: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            options: vec![
                format!("--gpu-architecture={arch}"),
                "-std=c++14".to_owned(),
            ],
            name: Some("kindred_kernels.cu".to_owned()),
            ..CompileOptions::default()
        };
        cudarc::nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, opts).map_err(|e| CudaError::Compile {
            arch: arch.to_owned(),
            log: match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            },
        })
    })
}

/// The loaded kernels of one device.
#[derive(Debug)]
struct Functions {
    accumulate_stats: CudaFunction,
    sign_pack: CudaFunction,
    abs_max_bits: CudaFunction,
    quantize_ef: CudaFunction,
    radix_histogram: CudaFunction,
    topk_count: CudaFunction,
    topk_sample: CudaFunction,
    topk_gather: CudaFunction,
    topk_candidate_counts: CudaFunction,
    topk_compact: CudaFunction,
    count_sketch: CudaFunction,
}

struct Inner {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    f: Functions,
    cpu: CpuBackend,
    name: String,
    compute_capability: (i32, i32),
    /// Streaming multiprocessors, for sizing grid-stride launches.
    sms: u32,
}

/// The CUDA backend: one device, its stream and its compiled kernels. Cheap to clone (shared).
///
/// Kernels it does not run on the device run on its [`CpuBackend`] (see the module docs).
#[derive(Clone)]
pub struct CudaBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.inner.name)
            .field("ordinal", &self.inner.ctx.ordinal())
            .field("compute_capability", &self.inner.compute_capability)
            .finish()
    }
}

/// Backends already started, by device ordinal: each device's kernels are compiled and loaded
/// once per process.
fn started() -> &'static Mutex<HashMap<usize, CudaBackend>> {
    static STARTED: OnceLock<Mutex<HashMap<usize, CudaBackend>>> = OnceLock::new();
    STARTED.get_or_init(|| Mutex::new(HashMap::new()))
}

impl CudaBackend {
    /// The backend on device `ordinal`: checks that the driver and NVRTC libraries can be
    /// loaded, opens the device, compiles the kernels for its compute capability and loads them.
    /// The result is cached: later calls for the same device return the same backend.
    ///
    /// # Errors
    /// [`CudaError::NoDriver`], [`CudaError::NoNvrtc`], [`CudaError::NoDevice`],
    /// [`CudaError::Compile`], [`CudaError::Driver`] or [`CudaError::Panicked`]; never panics.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        let mut cache = started().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = cache.get(&ordinal) {
            return Ok(b.clone());
        }
        if !driver_available() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_available() {
            return Err(CudaError::NoNvrtc);
        }
        let backend = guarded("device start", || Self::start(ordinal))?;
        cache.insert(ordinal, backend.clone());
        Ok(backend)
    }

    fn start(ordinal: usize) -> Result<Self, CudaError> {
        cudarc::driver::result::init()?;
        let count = CudaContext::device_count()?;
        if usize::try_from(count).map_or(true, |c| ordinal >= c) {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        let ptx = compile_kernels(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(ptx)?;
        let load = |name: &str| module.load_function(name);
        let f = Functions {
            accumulate_stats: load("accumulate_stats")?,
            sign_pack: load("sign_pack")?,
            abs_max_bits: load("abs_max_bits")?,
            quantize_ef: load("quantize_ef")?,
            radix_histogram: load("radix_histogram")?,
            topk_count: load("topk_count")?,
            topk_sample: load("topk_sample")?,
            topk_gather: load("topk_gather")?,
            topk_candidate_counts: load("topk_candidate_counts")?,
            topk_compact: load("topk_compact")?,
            count_sketch: load("count_sketch")?,
        };
        let stream = ctx.default_stream();
        let name = ctx.name()?;
        Ok(Self {
            inner: Arc::new(Inner {
                ctx,
                stream,
                f,
                cpu: CpuBackend::new(),
                name,
                compute_capability: (major, minor),
                sms: u32::try_from(sms).unwrap_or(1).max(1),
            }),
        })
    }

    /// The device's name, as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.inner.name
    }

    /// The device's compute capability (major, minor).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// The cudarc context (to allocate device buffers for the `*_on_device` methods).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// The stream every kernel of this backend runs on, in order.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// The CPU backend this one falls back to.
    pub fn cpu(&self) -> &CpuBackend {
        &self.inner.cpu
    }
}
