//! The CPU backend: always built, the reference every other backend is tested against.
//!
//! Each kernel splits its slice into fixed chunks of [`CHUNK`] elements, computes a partial result
//! per chunk and combines the partials *in chunk order*. Whether the chunks run on one thread or on
//! rayon's pool only changes who computes them, never the arithmetic, so every result is
//! bit-identical across thread counts. Inner loops keep several independent `f32` lanes and avoid
//! data-dependent branches so the compiler vectorises them.

mod accumulate;
mod fused;
mod quant;
mod sign;
mod sketch;
mod topk;

use half::bf16;
use rayon::prelude::*;

use crate::error::{
    AccumulateError, DequantizeError, QuantizeError, SignPackError, SignUnpackError, SimHashError,
    SketchError, TopKError,
};
use crate::simhash::SimHasher;
use crate::types::{
    Candidates, CountSketch, Fused, Rounding, Selection, SimHashOutput, SketchInto, Stats,
};

/// Elements per chunk: the unit of parallel work and of partial sums (64 KiB of f32, a multiple
/// of 64 so sign words and sketch blocks never straddle chunks).
pub(crate) const CHUNK: usize = 1 << 14;

/// Slices shorter than this run on the calling thread even in [`Threading::Rayon`] mode: below
/// it, waking the pool costs more than it saves.
pub(crate) const PARALLEL_MIN: usize = 1 << 18;

/// `f32` lanes kept independent in reductions (enough to hide add latency at any SIMD width).
pub(crate) const LANES: usize = 16;

/// Mask of an `f32`'s magnitude bits; magnitudes compare as integers under it.
pub(crate) const ABS: u32 = 0x7fff_ffff;

/// Magnitude bits of infinity: anything at or above is infinite or NaN.
pub(crate) const INF_BITS: u32 = 0x7f80_0000;

/// How the CPU backend uses threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Threading {
    /// Large slices (≥ 2^18 elements) are split across rayon's current pool (the global one, or
    /// the pool a caller `install`s).
    #[default]
    Rayon,
    /// Everything runs on the calling thread. Used for one-core measurements and by callers that
    /// parallelise at a coarser level (the simulator's thousands of virtual nodes).
    Single,
}

/// The CPU implementation of every kernel.
///
/// ```
/// use kindred_kernels::{CpuBackend, Kernels};
/// let cpu = CpuBackend::single_threaded();
/// let mut residual = vec![1.0, -2.0, 0.5];
/// let stats = cpu.accumulate(&mut residual, &[1.0, 1.0, 1.0])?;
/// assert_eq!(residual, [2.0, -1.0, 1.5]);
/// assert_eq!(stats.abs_max, 2.0);
/// # Ok::<(), kindred_kernels::AccumulateError>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct CpuBackend {
    threading: Threading,
}

impl CpuBackend {
    /// A backend that uses rayon's pool for large slices.
    pub fn new() -> Self {
        Self {
            threading: Threading::Rayon,
        }
    }

    /// A backend that never leaves the calling thread.
    pub fn single_threaded() -> Self {
        Self {
            threading: Threading::Single,
        }
    }

    /// This backend's threading mode.
    pub fn threading(&self) -> Threading {
        self.threading
    }

    fn parallel(&self, len: usize) -> bool {
        self.threading == Threading::Rayon && len >= PARALLEL_MIN
    }
}

/// Map `f(start, chunk)` over the [`CHUNK`]-sized chunks of `x`, results in chunk order.
pub(crate) fn map_chunks<T, R, F>(parallel: bool, x: &[T], f: F) -> Vec<R>
where
    T: Sync,
    R: Send,
    F: Fn(usize, &[T]) -> R + Sync + Send,
{
    if parallel {
        x.par_chunks(CHUNK)
            .enumerate()
            .map(|(c, s)| f(c * CHUNK, s))
            .collect()
    } else {
        x.chunks(CHUNK)
            .enumerate()
            .map(|(c, s)| f(c * CHUNK, s))
            .collect()
    }
}

/// `max(a, b)` as one SIMD max instruction. `f32::max` must return the non-NaN operand, which
/// costs three more instructions per vector; kernels detect NaN separately (through sums), so a
/// plain compare-select is enough here. With a NaN operand the result is unspecified (one of the
/// two), never a panic.
#[inline(always)]
pub(crate) fn fmax(a: f32, b: f32) -> f32 {
    if a > b { a } else { b }
}

/// Largest magnitude bit pattern in `x` (≥ [`INF_BITS`] when some element is not finite).
///
/// Finiteness is tested with `v - v` (0 for finite values, NaN otherwise), which vectorises on
/// every SIMD level, unlike 32-bit integer max on baseline x86-64; the max itself is a float max
/// over finite values.
// `v - v` is deliberate: 0 for every finite value, NaN for infinities and NaNs.
#[allow(clippy::eq_op)]
pub(crate) fn max_abs_bits(x: &[f32]) -> u32 {
    let mut m = [0f32; LANES];
    let mut nan = [0f32; LANES];
    let mut it = x.chunks_exact(LANES);
    for c in &mut it {
        for j in 0..LANES {
            let v = c[j];
            nan[j] += v - v;
            m[j] = fmax(m[j], v.abs());
        }
    }
    let mut finite = nan.iter().all(|z| *z == 0.0);
    let mut max = m.iter().fold(0f32, |a, &b| a.max(b));
    for &v in it.remainder() {
        finite &= v.is_finite();
        max = max.max(v.abs());
    }
    if finite { max.to_bits() } else { INF_BITS }
}

/// Largest magnitude bit pattern over a whole slice, chunked like every other kernel.
pub(crate) fn max_abs_bits_chunked(parallel: bool, x: &[f32]) -> u32 {
    map_chunks(parallel, x, |_, c| max_abs_bits(c))
        .into_iter()
        .max()
        .unwrap_or(0)
}

/// Position and value of the first non-finite element.
pub(crate) fn first_non_finite(x: &[f32]) -> Option<(usize, f32)> {
    x.iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
        .map(|(i, &v)| (i, v))
}

/// Every kernel, implemented by each backend and dispatched by [`crate::Backend`].
///
/// Methods take host slices and return host values. They validate every length and value they
/// depend on and report problems as typed errors; no input slice can make them panic.
pub trait Kernels {
    /// Fused error-feedback accumulation: `residual[i] += update[i]`, returning statistics of the
    /// *new* residual computed in the same pass.
    ///
    /// # Errors
    /// [`AccumulateError::LengthMismatch`] and [`AccumulateError::NonFinite`] (checked before
    /// anything is written), [`AccumulateError::Overflow`] when a finite sum overflows.
    fn accumulate(&self, residual: &mut [f32], update: &[f32]) -> Result<Stats, AccumulateError>;

    /// Position and value of the first NaN or infinity in `x`, if any: a fast read-only
    /// validation pass (a vectorised test over the whole slice, then a scan only on failure).
    fn find_non_finite(&self, x: &[f32]) -> Option<(usize, f32)>;

    /// Statistics of a slice without modifying it (same arithmetic as [`Kernels::accumulate`]).
    ///
    /// # Errors
    /// [`AccumulateError::NonFinite`] on a NaN or an infinity.
    fn stats(&self, x: &[f32]) -> Result<Stats, AccumulateError>;

    /// Exact top-k by magnitude: the `k` largest `|x|`, ties broken towards the lower index.
    /// The selected entries are zeroed in `residual`.
    ///
    /// # Errors
    /// [`TopKError`] when `k > len`, the slice is longer than `u32` indices allow, or it holds a
    /// NaN or an infinity (then `residual` is untouched).
    fn topk_exact(&self, residual: &mut [f32], k: usize) -> Result<Selection, TopKError>;

    /// DGC-style top-k: a magnitude threshold estimated from a seeded sample, one scanning pass,
    /// and an exact-count fix-up among the candidates. Selects *exactly* the same entries as
    /// [`Kernels::topk_exact`] (falling back to it when the sample under-shoots); only the speed
    /// differs. The selected entries are zeroed in `residual`.
    ///
    /// # Errors
    /// As [`Kernels::topk_exact`].
    fn topk_sampled(
        &self,
        residual: &mut [f32],
        k: usize,
        seed: u64,
    ) -> Result<Selection, TopKError>;

    /// Symmetric int8 quantisation: `scale = max|x| / 127`, `out[i] = round(x[i] / scale)` in
    /// `[-127, 127]`. Returns the scale (0 for an all-zero or empty input, with `out` all zero).
    /// `rounding`'s per-element randomness is keyed by the position in `x`.
    ///
    /// # Errors
    /// [`QuantizeError`] on a length mismatch or a non-finite input.
    fn quantize_i8(
        &self,
        x: &[f32],
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError>;

    /// [`Kernels::quantize_i8`] of one piece `x` of a larger tensor, at positions `start..`,
    /// whose max |value| over the whole tensor is `abs_max`: each piece gets the values and
    /// the scale the whole tensor's quantisation gives it (with stochastic rounding, when
    /// `start` is a multiple of 2^14), so a large tensor is quantised without being held in f32
    /// at once. The scale is that of `abs_max` or the piece's own max, the larger.
    ///
    /// # Errors
    /// [`QuantizeError`] on a length mismatch or a non-finite input (`abs_max` itself is
    /// reported at index 0).
    fn quantize_i8_piece(
        &self,
        x: &[f32],
        abs_max: f32,
        start: usize,
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError>;

    /// `out[i] = q[i] as f32 * scale`.
    ///
    /// # Errors
    /// [`DequantizeError`] on a length mismatch or a negative or non-finite scale.
    fn dequantize_i8(&self, q: &[i8], scale: f32, out: &mut [f32]) -> Result<(), DequantizeError>;

    /// 1-bit sign packing: bit `i % 64` of `words[i / 64]` is set when `x[i]`'s sign bit is set
    /// (negative, including −0.0), padding bits are zero, and the returned scale is the mean
    /// `|x|` (the layout of `kindred_proto::SignBits`).
    ///
    /// # Errors
    /// [`SignPackError`] when `words.len() != x.len().div_ceil(64)` or `x` is not finite.
    fn sign_pack(&self, x: &[f32], words: &mut [u64]) -> Result<f32, SignPackError>;

    /// Inverse of [`Kernels::sign_pack`]: `out[i] = ∓scale` by bit `i`.
    ///
    /// # Errors
    /// [`SignUnpackError`] on a word-count mismatch, set padding bits or a bad scale.
    fn sign_unpack(
        &self,
        words: &[u64],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), SignUnpackError>;

    /// Count-sketch of `x − center` (or of `x` without a centre), *added* into `out`
    /// (`sketch.buckets` entries). `first_index` is the global position of `x[0]`, so a vector
    /// sketched in pieces equals the vector sketched whole. Returns `‖x − center‖²`.
    ///
    /// # Errors
    /// [`SketchError`] on zero buckets, mismatched lengths, position overflow or a non-finite
    /// element (then `out` is untouched).
    fn count_sketch(
        &self,
        sketch: &CountSketch,
        x: &[f32],
        center: Option<&[f32]>,
        first_index: u64,
        out: &mut [f32],
    ) -> Result<f64, SketchError>;

    /// SimHash of `v` by the hasher's Gaussian hyperplanes, with per-bit margins.
    ///
    /// # Errors
    /// [`SimHashError`] when `v.len()` is not the hasher's dimension or `v` is not finite.
    fn simhash(&self, hasher: &SimHasher, v: &[f32]) -> Result<SimHashOutput, SimHashError>;

    /// The fused distillation pass, one read of `update` and `residual` and one write of
    /// `residual`: [`Kernels::accumulate`], plus (when `sketch` is given) the count-sketch of
    /// `update − center` added into `sketch.out`, plus (when `threshold` is given) the indices of
    /// every new residual entry with magnitude ≥ `threshold`, for [`Kernels::topk_candidates`].
    /// Sketch buckets and `sketch_sum_sq` are bit-identical to [`Kernels::count_sketch`]'s.
    ///
    /// Unlike [`Kernels::accumulate`], the update is *not* validated in a separate read before the
    /// residual is written (that would cost a second pass): run [`Kernels::find_non_finite`] first
    /// when the residual must survive a bad update.
    ///
    /// # Errors
    /// [`AccumulateError::LengthMismatch`] and [`AccumulateError::SketchShape`] (nothing written);
    /// [`AccumulateError::NonFinite`] for a NaN or infinity in the update,
    /// [`AccumulateError::Overflow`] and [`AccumulateError::NonFiniteCenter`] (the residual has
    /// been updated, the sketch output is untouched).
    fn accumulate_fused(
        &self,
        residual: &mut [f32],
        update: &[f32],
        sketch: Option<SketchInto<'_>>,
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError>;

    /// A magnitude that at least `k` entries of `residual + update` reach with high probability,
    /// estimated from a seeded sample of runs (DGC-style; a little lower than the k-th largest so
    /// that the scan rarely under-shoots). `None` where sampling cannot save work: `k == 0`,
    /// slices under 2^15 elements, or `k` above an eighth of the slice. Reads only.
    fn sample_threshold(
        &self,
        residual: &[f32],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32>;

    /// Finish a top-k from the `candidates` of [`Kernels::accumulate_fused`]: the exact top `k`
    /// of them when there are at least `k` (which is then the global top `k`), otherwise
    /// [`Kernels::topk_exact`] on the whole slice. The selected entries are left for the caller
    /// to overwrite (the distiller puts back what quantisation lost): each is left as it was or
    /// zeroed, as the backend finds cheaper. The CPU leaves them when it selects from the
    /// candidates, which spares a pass of scattered writes over the layer (at 5% of 2^24
    /// elements, 12% of the distiller's time: `distill_bench`, BENCHMARKS.md).
    ///
    /// `candidates` must be every entry whose magnitude reaches some threshold, with its value in
    /// `residual`, increasing (as [`Kernels::accumulate_fused`] returns them). Inconsistent
    /// candidates give a wrong selection, never a panic.
    ///
    /// # Errors
    /// As [`Kernels::topk_exact`].
    fn topk_candidates(
        &self,
        residual: &mut [f32],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError>;

    /// [`Kernels::accumulate_fused`] without the sketch, over a residual held in bf16:
    /// `residual += update` in f32 a chunk at a time (the chunk widened in cache, never the
    /// slice), rounded back with [`crate::narrow_bf16`]. Statistics and candidates are those of
    /// the f32 sums before rounding, bit-identical to `accumulate_fused` over the widened
    /// residual.
    ///
    /// # Errors
    /// As [`Kernels::accumulate_fused`].
    fn accumulate_fused_bf16(
        &self,
        residual: &mut [bf16],
        update: &[f32],
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError>;

    /// [`Kernels::sample_threshold`] of a residual held in bf16 (the same sample, widened).
    fn sample_threshold_bf16(
        &self,
        residual: &[bf16],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32>;

    /// [`Kernels::topk_candidates`] of a residual held in bf16, which is left as it was (the
    /// caller writes the selected entries): the top `k` of the candidates when there are at
    /// least `k` (the residual is not read), otherwise the exact top `k` of a widened copy.
    ///
    /// # Errors
    /// As [`Kernels::topk_exact`].
    fn topk_candidates_bf16(
        &self,
        residual: &[bf16],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError>;
}

impl Kernels for CpuBackend {
    fn accumulate(&self, residual: &mut [f32], update: &[f32]) -> Result<Stats, AccumulateError> {
        accumulate::accumulate(self.parallel(update.len()), residual, update)
    }

    fn stats(&self, x: &[f32]) -> Result<Stats, AccumulateError> {
        accumulate::stats(self.parallel(x.len()), x)
    }

    fn find_non_finite(&self, x: &[f32]) -> Option<(usize, f32)> {
        if max_abs_bits_chunked(self.parallel(x.len()), x) >= INF_BITS {
            first_non_finite(x)
        } else {
            None
        }
    }

    fn topk_exact(&self, residual: &mut [f32], k: usize) -> Result<Selection, TopKError> {
        topk::exact(self.parallel(residual.len()), residual, k)
    }

    fn topk_sampled(
        &self,
        residual: &mut [f32],
        k: usize,
        seed: u64,
    ) -> Result<Selection, TopKError> {
        topk::sampled(self.parallel(residual.len()), residual, k, seed)
    }

    fn quantize_i8(
        &self,
        x: &[f32],
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        quant::quantize(self.parallel(x.len()), x, rounding, out)
    }

    fn quantize_i8_piece(
        &self,
        x: &[f32],
        abs_max: f32,
        start: usize,
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        quant::quantize_piece(self.parallel(x.len()), x, abs_max, start, rounding, out)
    }

    fn dequantize_i8(&self, q: &[i8], scale: f32, out: &mut [f32]) -> Result<(), DequantizeError> {
        quant::dequantize(self.parallel(q.len()), q, scale, out)
    }

    fn sign_pack(&self, x: &[f32], words: &mut [u64]) -> Result<f32, SignPackError> {
        sign::pack(self.parallel(x.len()), x, words)
    }

    fn sign_unpack(
        &self,
        words: &[u64],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), SignUnpackError> {
        sign::unpack(self.parallel(out.len()), words, scale, out)
    }

    fn count_sketch(
        &self,
        sketch: &CountSketch,
        x: &[f32],
        center: Option<&[f32]>,
        first_index: u64,
        out: &mut [f32],
    ) -> Result<f64, SketchError> {
        sketch::count_sketch(self.parallel(x.len()), sketch, x, center, first_index, out)
    }

    fn simhash(&self, hasher: &SimHasher, v: &[f32]) -> Result<SimHashOutput, SimHashError> {
        hasher.hash(v)
    }

    fn accumulate_fused(
        &self,
        residual: &mut [f32],
        update: &[f32],
        sketch: Option<SketchInto<'_>>,
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        fused::accumulate_fused(
            self.parallel(update.len()),
            residual,
            update,
            sketch,
            threshold,
        )
    }

    fn sample_threshold(
        &self,
        residual: &[f32],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        fused::sample_threshold(residual, update, k, seed)
    }

    fn topk_candidates(
        &self,
        residual: &mut [f32],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        topk::from_candidates(
            self.parallel(residual.len()),
            residual,
            candidates,
            k,
            false,
        )
    }

    fn accumulate_fused_bf16(
        &self,
        residual: &mut [bf16],
        update: &[f32],
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        fused::accumulate_fused(
            self.parallel(update.len()),
            residual,
            update,
            None,
            threshold,
        )
    }

    fn sample_threshold_bf16(
        &self,
        residual: &[bf16],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        fused::sample_threshold(residual, update, k, seed)
    }

    fn topk_candidates_bf16(
        &self,
        residual: &[bf16],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        topk::from_candidates_bf16(self.parallel(residual.len()), residual, candidates, k)
    }
}
