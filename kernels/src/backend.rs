//! The dispatch point: one enum over every backend, CPU always present.
//!
//! Callers hold a [`Backend`] and call [`Kernels`] methods on it; each call is a `match` over the
//! variants that forwards to that backend's implementation, as candle's `Storage` does. The CPU arm
//! is always compiled. A GPU backend is added as a new variant behind its cargo feature (for CUDA:
//! `#[cfg(feature = "cuda")] Cuda(CudaBackend)`, one arm per method in [`dispatch!`], and a
//! constructor such as `Backend::detect()` that falls back to the CPU). The enum is
//! `#[non_exhaustive]`, so adding that variant breaks no caller.
//!
//! [`Backend::detect`] is how a program picks its backend: the CUDA one when the `cuda` feature
//! is built *and* the driver library, a device and NVRTC are all there and the kernels compile
//! and load, otherwise the CPU. It never panics, and logs one `info` line saying which backend
//! runs and why, so an operator can tell from the log whether a GPU host is using its GPU.

use half::bf16;

use crate::cpu::{CpuBackend, Kernels};
#[cfg(feature = "cuda")]
use crate::cuda::CudaBackend;
use crate::error::{
    AccumulateError, DequantizeError, QuantizeError, SignPackError, SignUnpackError, SimHashError,
    SketchError, TopKError,
};
use crate::simhash::SimHasher;
use crate::types::{
    Candidates, CountSketch, Fused, Rounding, Selection, SimHashOutput, SketchInto, Stats,
};

/// A compute backend. Use it through the [`Kernels`] trait.
///
/// ```
/// use kindred_kernels::{Backend, Kernels};
/// let backend = Backend::cpu();
/// let mut residual = vec![0.0f32; 8];
/// backend.accumulate(&mut residual, &[0.1, -3.0, 0.2, 2.0, 0.0, 0.0, 1.0, 0.0])?;
/// let top = backend.topk_exact(&mut residual, 2)?;
/// assert_eq!(top.indices, [1, 3]);
/// assert_eq!(top.values, [-3.0, 2.0]);
/// assert_eq!(residual[1], 0.0); // what was selected leaves the residual
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Backend {
    /// The CPU backend (rayon + auto-vectorised loops).
    Cpu(CpuBackend),
    /// The CUDA backend (feature `cuda`): kernels it does not run on the device run on its CPU
    /// backend (see [`CudaBackend`]).
    #[cfg(feature = "cuda")]
    Cuda(CudaBackend),
}

impl Default for Backend {
    fn default() -> Self {
        Self::cpu()
    }
}

impl Backend {
    /// The CPU backend, using rayon's pool for large slices.
    pub fn cpu() -> Self {
        Self::Cpu(CpuBackend::new())
    }

    /// The CPU backend on the calling thread only.
    pub fn cpu_single_threaded() -> Self {
        Self::Cpu(CpuBackend::single_threaded())
    }

    /// A short name for logs and benchmark output (`"cpu"` or `"cuda"`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            Self::Cuda(_) => "cuda",
        }
    }

    /// The best backend this host can run: CUDA on device 0 when the `cuda` feature is built and
    /// the driver library, a device and NVRTC are present and the kernels compile and load;
    /// otherwise the CPU backend. Logs one `tracing::info!` line with the choice and its reason
    /// (`kernels: CPU backend (no CUDA driver library found)`).
    ///
    /// Never panics: library presence is checked before any CUDA call, and every failure after
    /// that is a value (see `cuda::CudaBackend::new`). Repeated calls reuse the device's
    /// compiled kernels.
    ///
    /// ```
    /// let backend = kindred_kernels::Backend::detect();
    /// assert!(matches!(backend.name(), "cpu" | "cuda"));
    /// ```
    pub fn detect() -> Self {
        let (backend, reason) = Self::probe();
        tracing::info!("kernels: {} backend ({reason})", backend.label());
        backend
    }

    /// The backend [`Backend::detect`] picks and the reason, without logging.
    #[cfg(feature = "cuda")]
    fn probe() -> (Self, String) {
        match CudaBackend::new(0) {
            Ok(cuda) => {
                let (major, minor) = cuda.compute_capability();
                let reason = format!(
                    "device 0: {}, compute capability {major}.{minor}, kernels compiled by NVRTC",
                    cuda.device_name()
                );
                (Self::Cuda(cuda), reason)
            }
            Err(e) => (Self::cpu(), e.to_string()),
        }
    }

    /// The backend [`Backend::detect`] picks and the reason, without logging.
    #[cfg(not(feature = "cuda"))]
    fn probe() -> (Self, String) {
        (Self::cpu(), "built without the `cuda` feature".to_owned())
    }

    /// The backend's name as the detection log line writes it.
    fn label(&self) -> &'static str {
        match self {
            Self::Cpu(_) => "CPU",
            #[cfg(feature = "cuda")]
            Self::Cuda(_) => "CUDA",
        }
    }
}

/// Forward a [`Kernels`] call to the active variant.
macro_rules! dispatch {
    ($self:ident, $b:ident => $call:expr) => {
        match $self {
            Backend::Cpu($b) => $call,
            #[cfg(feature = "cuda")]
            Backend::Cuda($b) => $call,
        }
    };
}

impl Kernels for Backend {
    fn accumulate(&self, residual: &mut [f32], update: &[f32]) -> Result<Stats, AccumulateError> {
        dispatch!(self, b => b.accumulate(residual, update))
    }

    fn stats(&self, x: &[f32]) -> Result<Stats, AccumulateError> {
        dispatch!(self, b => b.stats(x))
    }

    fn find_non_finite(&self, x: &[f32]) -> Option<(usize, f32)> {
        dispatch!(self, b => b.find_non_finite(x))
    }

    fn topk_exact(&self, residual: &mut [f32], k: usize) -> Result<Selection, TopKError> {
        dispatch!(self, b => b.topk_exact(residual, k))
    }

    fn topk_sampled(
        &self,
        residual: &mut [f32],
        k: usize,
        seed: u64,
    ) -> Result<Selection, TopKError> {
        dispatch!(self, b => b.topk_sampled(residual, k, seed))
    }

    fn quantize_i8(
        &self,
        x: &[f32],
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        dispatch!(self, b => b.quantize_i8(x, rounding, out))
    }

    fn quantize_i8_piece(
        &self,
        x: &[f32],
        abs_max: f32,
        start: usize,
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        dispatch!(self, b => b.quantize_i8_piece(x, abs_max, start, rounding, out))
    }

    fn dequantize_i8(&self, q: &[i8], scale: f32, out: &mut [f32]) -> Result<(), DequantizeError> {
        dispatch!(self, b => b.dequantize_i8(q, scale, out))
    }

    fn sign_pack(&self, x: &[f32], words: &mut [u64]) -> Result<f32, SignPackError> {
        dispatch!(self, b => b.sign_pack(x, words))
    }

    fn sign_unpack(
        &self,
        words: &[u64],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), SignUnpackError> {
        dispatch!(self, b => b.sign_unpack(words, scale, out))
    }

    fn count_sketch(
        &self,
        sketch: &CountSketch,
        x: &[f32],
        center: Option<&[f32]>,
        first_index: u64,
        out: &mut [f32],
    ) -> Result<f64, SketchError> {
        dispatch!(self, b => b.count_sketch(sketch, x, center, first_index, out))
    }

    fn simhash(&self, hasher: &SimHasher, v: &[f32]) -> Result<SimHashOutput, SimHashError> {
        dispatch!(self, b => b.simhash(hasher, v))
    }

    fn accumulate_fused(
        &self,
        residual: &mut [f32],
        update: &[f32],
        sketch: Option<SketchInto<'_>>,
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        dispatch!(self, b => b.accumulate_fused(residual, update, sketch, threshold))
    }

    fn sample_threshold(
        &self,
        residual: &[f32],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        dispatch!(self, b => b.sample_threshold(residual, update, k, seed))
    }

    fn topk_candidates(
        &self,
        residual: &mut [f32],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        dispatch!(self, b => b.topk_candidates(residual, candidates, k))
    }

    fn accumulate_fused_bf16(
        &self,
        residual: &mut [bf16],
        update: &[f32],
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        dispatch!(self, b => b.accumulate_fused_bf16(residual, update, threshold))
    }

    fn sample_threshold_bf16(
        &self,
        residual: &[bf16],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        dispatch!(self, b => b.sample_threshold_bf16(residual, update, k, seed))
    }

    fn topk_candidates_bf16(
        &self,
        residual: &[bf16],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        dispatch!(self, b => b.topk_candidates_bf16(residual, candidates, k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This crate's CI hosts have no GPU: detection must pick the CPU, with or without the `cuda`
    /// feature, and must not panic when the driver or NVRTC is missing.
    #[test]
    fn detect_falls_back_to_cpu_without_a_gpu() {
        #[cfg(feature = "cuda")]
        if crate::cuda::driver_available() {
            // A host with a driver (the GPU machine): whatever it picks must be usable.
            let b = Backend::detect();
            let mut r = vec![1.0f32; 4];
            assert!(b.accumulate(&mut r, &[1.0; 4]).is_ok());
            return;
        }
        let (backend, reason) = Backend::probe();
        assert_eq!(backend.name(), "cpu");
        assert!(!reason.is_empty());
        assert_eq!(Backend::detect().name(), "cpu");
    }
}
