//! Kindred's compute kernels: the arithmetic that distillation runs on every layer of every update,
//! over plain slices.
//!
//! | kernel | [`Kernels`] method |
//! |---|---|
//! | fused `residual += update` with mean, variance, abs-max and L2 in one pass | [`Kernels::accumulate`] |
//! | top-k by magnitude, exact (radix histogram) or DGC-style sampled threshold with exact-count fix-up; sorted indices + values, selected entries zeroed | [`Kernels::topk_exact`], [`Kernels::topk_sampled`] |
//! | int8 symmetric quantisation, round-to-nearest or seeded stochastic rounding | [`Kernels::quantize_i8`], [`Kernels::dequantize_i8`] |
//! | 1-bit sign packing into u64 words with a mean-\|x\| scale | [`Kernels::sign_pack`], [`Kernels::sign_unpack`] |
//! | count-sketch into D buckets with seeded hashes | [`Kernels::count_sketch`] |
//! | 256-bit SimHash by seeded Gaussian hyperplanes, with per-bit margins | [`Kernels::simhash`] |
//! | the fused distillation pass: add + stats + sketch + top-k candidates in one pass | [`Kernels::accumulate_fused`], [`Kernels::sample_threshold`], [`Kernels::topk_candidates`] |
//! | the same over a residual held in bf16 (widened a chunk at a time in cache) | [`Kernels::accumulate_fused_bf16`], [`Kernels::sample_threshold_bf16`], [`Kernels::topk_candidates_bf16`]; [`widen_bf16`], [`narrow_bf16`] |
//!
//! Each kernel has one definition (the [`Kernels`] trait) dispatched through [`Backend`]: a CPU
//! backend that is always built ([`CpuBackend`]: rayon for large slices, loops shaped so the
//! compiler vectorises them, and an AVX-512 or AVX2 top-k candidate scan where the CPU has one,
//! detected at run time) and a CUDA backend (`cuda::CudaBackend`) behind the `cuda` feature
//! and a run-time check ([`Backend::detect`]), so the same binary runs on hosts with and without a
//! GPU.
//!
//! Every kernel is deterministic: randomness comes from explicit seeds through [`rng`], and
//! reductions combine fixed-size chunks in a fixed order, so results are bit-identical across runs
//! and thread counts. Every precondition is checked and reported as a typed error; no input slice
//! makes a kernel panic.
//!
//! The crate knows nothing of layers, packets or compression policy: those live in
//! `kindred-distill`.
//!
//! ```
//! use kindred_kernels::{Backend, Kernels, Rounding};
//! let backend = Backend::cpu();
//! let x = [0.5f32, -1.0, 0.25, 0.0];
//! let mut q = [0i8; 4];
//! let scale = backend.quantize_i8(&x, Rounding::Nearest, &mut q)?;
//! assert_eq!(q, [64, -127, 32, 0]);
//! let mut back = [0f32; 4];
//! backend.dequantize_i8(&q, scale, &mut back)?;
//! assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() <= scale / 2.0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod backend;
mod convert;
mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
pub mod rng;
mod simhash;
mod types;

pub use backend::Backend;
pub use convert::{narrow_bf16, widen_bf16};
pub use cpu::{CpuBackend, Kernels, Threading};
#[cfg(feature = "cuda")]
pub use cuda::{CudaBackend, CudaError, DeviceSelection};
/// The cudarc version the CUDA backend is built on, for callers that allocate device buffers.
#[cfg(feature = "cuda")]
pub use cudarc;
pub use error::{
    AccumulateError, DequantizeError, QuantizeError, SignPackError, SignUnpackError, SimHashError,
    SketchError, TopKError,
};
pub use simhash::{MAX_SIMHASH_DIM, SIMHASH_BITS, SimHasher};
pub use types::{
    Candidates, CountSketch, Fused, Rounding, SelectMethod, Selection, SimHashOutput, SketchInto,
    Stats,
};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
