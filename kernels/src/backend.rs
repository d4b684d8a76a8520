//! The dispatch point: one enum over every backend, CPU always present.
//!
//! Callers hold a [`Backend`] and call [`Kernels`] methods on it; each call is a `match` over the
//! variants that forwards to that backend's implementation, as candle's `Storage` does. The CPU arm
//! is always compiled. A GPU backend is added as a new variant behind its cargo feature (for CUDA:
//! `#[cfg(feature = "cuda")] Cuda(CudaBackend)`, one arm per method in [`dispatch!`], and a
//! constructor such as `Backend::detect()` that falls back to the CPU). The enum is
//! `#[non_exhaustive]`, so adding that variant breaks no caller.

use crate::cpu::{CpuBackend, Kernels};
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

    /// A short name for logs and benchmark output (`"cpu"`).
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu(_) => "cpu",
        }
    }
}

/// Forward a [`Kernels`] call to the active variant.
macro_rules! dispatch {
    ($self:ident, $b:ident => $call:expr) => {
        match $self {
            Backend::Cpu($b) => $call,
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
}
