//! What can go wrong on the CUDA side, as one typed error.
//!
//! Probing (library missing, no device, NVRTC failure) and running (a driver call failing, a
//! non-finite input found on the device) are reported the same way, so that
//! [`crate::Backend::detect`] can log the reason and fall back to the CPU, and the `Kernels`
//! implementation of [`super::CudaBackend`] can rerun a call on the CPU, which then reports the
//! precise kernel error.

use thiserror::Error;

/// Why the CUDA backend could not start or could not run a kernel on the device.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum CudaError {
    /// No CUDA driver library (`libcuda.so*`) could be loaded: no NVIDIA driver on this host.
    #[error("no CUDA driver library found")]
    NoDriver,
    /// No NVRTC library (`libnvrtc.so*`) could be loaded, so the kernels cannot be compiled.
    #[error(
        "no NVRTC library found (install the CUDA toolkit or the nvidia-cuda-nvrtc-cu12 wheel and put its lib/ on LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    /// The driver loaded but reports no device with this ordinal.
    #[error("no CUDA device {ordinal} ({count} found)")]
    NoDevice {
        /// Requested device.
        ordinal: usize,
        /// Devices the driver reports.
        count: i32,
    },
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// NVRTC rejected the kernel source (the log says why).
    #[error("NVRTC failed to compile the kernels for {arch}: {log}")]
    Compile {
        /// The virtual architecture compiled for (`compute_90`).
        arch: String,
        /// NVRTC's message and log.
        log: String,
    },
    /// cudarc panicked (a symbol missing from an old driver, for instance); the panic was caught.
    #[error("cudarc panicked during {during}: {message}")]
    Panicked {
        /// What was being done.
        during: &'static str,
        /// The panic message.
        message: String,
    },
    /// Buffer lengths do not fit together, or exceed what the kernel indexes.
    #[error("{kernel}: buffer lengths do not fit together ({detail})")]
    Shape {
        /// The kernel.
        kernel: &'static str,
        /// Which lengths.
        detail: String,
    },
    /// The input holds a NaN or an infinity (found on the device; the CPU kernel reports where).
    #[error("{kernel}: the input holds a NaN or an infinity")]
    NonFinite {
        /// The kernel.
        kernel: &'static str,
    },
}
