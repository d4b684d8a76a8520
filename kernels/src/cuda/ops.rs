//! Kernels on device buffers: launches, and the small host-side steps between them (combining
//! chunk partials in the CPU's order, choosing radix bins, scanning tile counts).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{CudaBackend, CudaError};
use crate::types::{CountSketch, Rounding, Stats};

/// Elements per partial-sum chunk and lanes per chunk: the CPU's layout (`cpu::CHUNK`, `LANES`).
const CHUNK: usize = 1 << 14;
const LANES: usize = 16;
const THREADS: u32 = 256;
/// Elements per top-k compaction tile (`TILE` in `kernels.cu`).
const TILE: usize = 4096;
const ABS: u32 = 0x7fff_ffff;
const INF_BITS: u32 = 0x7f80_0000;
const QMAX: f32 = 127.0;
/// The largest finite magnitude's bit pattern.
const MAX_FINITE: u32 = 0x7f7f_ffff;
/// Entries the top-k samples to place its magnitude window.
const SAMPLES: usize = 16_384;

/// What the ordered compaction needs: the threshold's bit pattern, how many entries equal to it
/// are kept (the lowest-index ones), and per tile the entries above it and equal to it.
struct TopkCounts {
    threshold: u32,
    ties: u64,
    gt: CudaSlice<u32>,
    eq: CudaSlice<u32>,
}

/// A top-k selection left on the device: indices increasing, values signed, `len` entries.
#[derive(Debug)]
#[must_use = "the selected entries were zeroed in the residual; dropping them loses them"]
pub struct DeviceSelection {
    /// Positions of the kept entries, strictly increasing.
    pub indices: CudaSlice<u32>,
    /// The kept values, one per index.
    pub values: CudaSlice<f32>,
    /// The smallest kept magnitude (0 when nothing was kept).
    pub threshold: f32,
}

fn cfg(blocks: usize, shared: u32) -> Result<LaunchConfig, CudaError> {
    let grid = u32::try_from(blocks.max(1)).map_err(|_| CudaError::Shape {
        kernel: "launch",
        detail: format!("{blocks} blocks"),
    })?;
    Ok(LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    })
}

/// Chunk partials as the CPU combines them: sums in chunk order from 0.0, max of bit patterns.
fn combine(sums: &[f64], sqs: &[f64], maxes: &[u32]) -> (f64, f64, u32) {
    let (mut sum, mut sum_sq, mut max) = (0.0f64, 0.0f64, 0u32);
    for ((s, q), m) in sums.iter().zip(sqs).zip(maxes) {
        sum += s;
        sum_sq += q;
        max = max.max(*m);
    }
    (sum, sum_sq, max)
}

impl CudaBackend {
    /// Grid for a grid-stride kernel over `n` elements.
    fn stride_cfg(&self, n: usize, shared: u32) -> Result<LaunchConfig, CudaError> {
        let want = n.div_ceil(THREADS as usize);
        cfg(want.min(self.inner.sms as usize * 8), shared)
    }

    /// Grid for a per-chunk kernel: one block of 256 threads per chunk.
    fn chunk_cfg(n: usize) -> Result<LaunchConfig, CudaError> {
        cfg(n.div_ceil(CHUNK), 0)
    }

    /// Grid for a (chunk, lane) kernel: one thread per lane of every chunk.
    fn lane_cfg(n: usize) -> Result<LaunchConfig, CudaError> {
        cfg((n.div_ceil(CHUNK) * LANES).div_ceil(THREADS as usize), 0)
    }

    /// `residual += update` on the device, returning statistics of the new residual,
    /// bit-identical to [`crate::Kernels::accumulate`]'s.
    ///
    /// # Errors
    /// [`CudaError::Shape`] on a length mismatch (nothing written), [`CudaError::NonFinite`] when
    /// the new residual holds a NaN or an infinity (the residual *has* been updated),
    /// [`CudaError::Driver`] when a CUDA call fails.
    pub fn accumulate_on_device(
        &self,
        residual: &mut CudaSlice<f32>,
        update: &CudaSlice<f32>,
    ) -> Result<Stats, CudaError> {
        let n = residual.len();
        if update.len() != n {
            return Err(CudaError::Shape {
                kernel: "accumulate",
                detail: format!("residual {n}, update {}", update.len()),
            });
        }
        self.stats_launch(n, |b, c| {
            let mut l = b.inner.stream.launch_builder(&b.inner.f.accumulate_stats);
            l.arg(&mut *residual).arg(update);
            c.push(&mut l);
            // SAFETY: `accumulate_stats(float*, const float*, u64, double*, double*, u32*)`; the
            // buffers hold `n` elements and one partial per chunk, as the kernel indexes (one
            // block per chunk).
            unsafe { l.launch(Self::chunk_cfg(n)?) }?;
            Ok(())
        })
    }

    /// Statistics of a device slice, bit-identical to [`crate::Kernels::stats`]'s.
    ///
    /// # Errors
    /// [`CudaError::NonFinite`] on a NaN or an infinity, [`CudaError::Driver`].
    pub fn stats_on_device(&self, x: &CudaSlice<f32>) -> Result<Stats, CudaError> {
        let n = x.len();
        self.stats_launch(n, |b, c| {
            let null = 0u64;
            let mut l = b.inner.stream.launch_builder(&b.inner.f.accumulate_stats);
            l.arg(x).arg(&null);
            c.push(&mut l);
            // SAFETY: as in `accumulate_on_device`; with a null update the kernel only reads `x`.
            unsafe { l.launch(Self::chunk_cfg(n)?) }?;
            Ok(())
        })
    }

    /// Run a statistics kernel (given the partial buffers) and combine its partials.
    fn stats_launch(
        &self,
        n: usize,
        launch: impl FnOnce(&Self, &mut Partials) -> Result<(), CudaError>,
    ) -> Result<Stats, CudaError> {
        if n == 0 {
            return Ok(Stats::default());
        }
        let s = &self.inner.stream;
        let chunks = n.div_ceil(CHUNK);
        let mut parts = Partials {
            n: n as u64,
            sum: s.alloc_zeros::<f64>(chunks)?,
            sq: s.alloc_zeros::<f64>(chunks)?,
            max: s.alloc_zeros::<u32>(chunks)?,
        };
        launch(self, &mut parts)?;
        let sum = s.clone_dtoh(&parts.sum)?;
        let sq = s.clone_dtoh(&parts.sq)?;
        let max = s.clone_dtoh(&parts.max)?;
        let (sum, sum_sq, max) = combine(&sum, &sq, &max);
        if max >= INF_BITS {
            return Err(CudaError::NonFinite {
                kernel: "accumulate",
            });
        }
        Ok(Stats::from_sums(n, sum, sum_sq, f32::from_bits(max)))
    }

    /// 1-bit sign packing of a device slice into `words` (`x.len().div_ceil(64)` of them),
    /// returning the mean `|x|`: words and scale bit-identical to [`crate::Kernels::sign_pack`].
    ///
    /// # Errors
    /// [`CudaError::Shape`] on a word-count mismatch, [`CudaError::NonFinite`],
    /// [`CudaError::Driver`].
    pub fn sign_pack_on_device(
        &self,
        x: &CudaSlice<f32>,
        words: &mut CudaSlice<u64>,
    ) -> Result<f32, CudaError> {
        let n = x.len();
        if words.len() != n.div_ceil(64) {
            return Err(CudaError::Shape {
                kernel: "sign_pack",
                detail: format!("{n} elements, {} words", words.len()),
            });
        }
        if n == 0 {
            return Ok(0.0);
        }
        let s = &self.inner.stream;
        let chunks = n.div_ceil(CHUNK);
        // Sums, then per-chunk scratch the shared reduction writes and the kernel ignores.
        let mut sums = s.alloc_zeros::<f64>(2 * chunks)?;
        let mut maxes = s.alloc_zeros::<u32>(chunks)?;
        let n64 = n as u64;
        let mut l = s.launch_builder(&self.inner.f.sign_pack);
        l.arg(x)
            .arg(&n64)
            .arg(&mut *words)
            .arg(&mut sums)
            .arg(&mut maxes);
        // SAFETY: `sign_pack(const float*, u64, u64*, double*, u32*)`; `words` holds
        // `n.div_ceil(64)` words, `sums` 2 partials per chunk and `maxes` one.
        unsafe { l.launch(Self::lane_cfg(n)?) }?;
        let sums = s.clone_dtoh(&sums)?;
        let maxes = s.clone_dtoh(&maxes)?;
        let mut sum = 0.0f64;
        for v in sums.iter().take(chunks) {
            sum += v;
        }
        if maxes.iter().any(|&m| m >= INF_BITS) {
            return Err(CudaError::NonFinite {
                kernel: "sign_pack",
            });
        }
        Ok((sum / n as f64) as f32)
    }

    /// Largest magnitude bit pattern of `x (+ update)`.
    fn abs_max_bits(
        &self,
        x: &CudaSlice<f32>,
        update: Option<&CudaSlice<f32>>,
    ) -> Result<u32, CudaError> {
        let n = x.len();
        let s = &self.inner.stream;
        let mut max = s.alloc_zeros::<u32>(1)?;
        let null = 0u64;
        let n64 = n as u64;
        let mut l = s.launch_builder(&self.inner.f.abs_max_bits);
        l.arg(x);
        match update {
            Some(u) => l.arg(u),
            None => l.arg(&null),
        };
        l.arg(&n64).arg(&mut max);
        // SAFETY: `abs_max_bits(const float*, const float*, u64, u32*)`; `update` is null or
        // holds `n` elements (checked by callers), `max` one word.
        unsafe { l.launch(self.stride_cfg(n, 0)?) }?;
        Ok(s.clone_dtoh(&max)?.first().copied().unwrap_or(INF_BITS))
    }

    /// Int8 quantisation fused with error feedback, on device buffers: `v = residual (+ update)`,
    /// `out = round(v / scale)` with `scale = max|v| / 127`, and `residual = v − out · scale`
    /// (what the payload did not carry). Returns the scale. One read-only pass finds `max|v|`,
    /// then one pass reads `update` and `residual` once and writes `residual` and `out` once.
    /// `out` is bit-identical to [`crate::Kernels::quantize_i8`] of `v` under the same rounding.
    ///
    /// # Errors
    /// [`CudaError::Shape`] on mismatched lengths, [`CudaError::NonFinite`] when `v` is not
    /// finite (nothing written), [`CudaError::Driver`].
    pub fn quantize_i8_ef_on_device(
        &self,
        residual: &mut CudaSlice<f32>,
        update: Option<&CudaSlice<f32>>,
        rounding: Rounding,
        out: &mut CudaSlice<i8>,
    ) -> Result<f32, CudaError> {
        check_quant(residual.len(), update.map(CudaSlice::len), out.len())?;
        if residual.is_empty() {
            return Ok(0.0);
        }
        let bits = self.abs_max_bits(residual, update)?;
        if bits >= INF_BITS {
            return Err(CudaError::NonFinite {
                kernel: "quantize_i8",
            });
        }
        self.quantize_i8_ef_with_abs_max(residual, update, f32::from_bits(bits), rounding, out)
    }

    /// The single fused pass of [`CudaBackend::quantize_i8_ef_on_device`] with `max|v|` already
    /// known (from [`CudaBackend::accumulate_on_device`]'s statistics, for instance): one read of
    /// `update` and `residual`, one write of `residual` and `out`. A wrong `abs_max` saturates
    /// values at ±127, never fails.
    ///
    /// # Errors
    /// [`CudaError::Shape`], [`CudaError::NonFinite`] for a non-finite or negative `abs_max`,
    /// [`CudaError::Driver`].
    pub fn quantize_i8_ef_with_abs_max(
        &self,
        residual: &mut CudaSlice<f32>,
        update: Option<&CudaSlice<f32>>,
        abs_max: f32,
        rounding: Rounding,
        out: &mut CudaSlice<i8>,
    ) -> Result<f32, CudaError> {
        let n = residual.len();
        check_quant(n, update.map(CudaSlice::len), out.len())?;
        let (scale, inv) = scale_of(abs_max)?;
        if n == 0 {
            return Ok(scale);
        }
        let (stochastic, seed) = rounding_args(rounding);
        let (null, n64, write) = (0u64, n as u64, 1i32);
        let s = &self.inner.stream;
        let mut l = s.launch_builder(&self.inner.f.quantize_ef);
        l.arg(&mut *residual);
        match update {
            Some(u) => l.arg(u),
            None => l.arg(&null),
        };
        l.arg(&n64)
            .arg(&inv)
            .arg(&scale)
            .arg(&stochastic)
            .arg(&seed)
            .arg(&write)
            .arg(&mut *out);
        // SAFETY: `quantize_ef(float*, const float*, u64, float, float, int, u64, int, i8*)`;
        // residual, update (or null) and out all hold `n` elements (checked above).
        unsafe { l.launch(self.stride_cfg(n, 0)?) }?;
        Ok(scale)
    }

    /// Int8 quantisation of a device slice without error feedback (`x` is only read), bit-
    /// identical to [`crate::Kernels::quantize_i8`]. Returns the scale.
    ///
    /// # Errors
    /// [`CudaError::Shape`], [`CudaError::NonFinite`], [`CudaError::Driver`].
    pub fn quantize_i8_on_device(
        &self,
        x: &CudaSlice<f32>,
        rounding: Rounding,
        out: &mut CudaSlice<i8>,
    ) -> Result<f32, CudaError> {
        let n = x.len();
        check_quant(n, None, out.len())?;
        if n == 0 {
            return Ok(0.0);
        }
        let bits = self.abs_max_bits(x, None)?;
        if bits >= INF_BITS {
            return Err(CudaError::NonFinite {
                kernel: "quantize_i8",
            });
        }
        let (scale, inv) = scale_of(f32::from_bits(bits))?;
        let (stochastic, seed) = rounding_args(rounding);
        let (null, n64, write) = (0u64, n as u64, 0i32);
        let s = &self.inner.stream;
        let mut l = s.launch_builder(&self.inner.f.quantize_ef);
        l.arg(x)
            .arg(&null)
            .arg(&n64)
            .arg(&inv)
            .arg(&scale)
            .arg(&stochastic)
            .arg(&seed)
            .arg(&write)
            .arg(&mut *out);
        // SAFETY: as in `quantize_i8_ef_with_abs_max`; with `write_residual = 0` the kernel only
        // reads `x`.
        unsafe { l.launch(self.stride_cfg(n, 0)?) }?;
        Ok(scale)
    }

    /// One radix histogram pass over the first `len` entries of `x` (see `radix_histogram` in
    /// `kernels.cu`).
    fn radix_pass(
        &self,
        x: &CudaSlice<f32>,
        len: usize,
        match_shift: u32,
        prefix: u32,
        shift: u32,
        bins: u32,
    ) -> Result<Vec<u32>, CudaError> {
        let s = &self.inner.stream;
        let mut hist = s.alloc_zeros::<u32>(bins as usize)?;
        let n64 = len.min(x.len()) as u64;
        let mut l = s.launch_builder(&self.inner.f.radix_histogram);
        l.arg(x)
            .arg(&n64)
            .arg(&match_shift)
            .arg(&prefix)
            .arg(&shift)
            .arg(&bins)
            .arg(&mut hist);
        // SAFETY: `radix_histogram(const float*, u64, u32, u32, u32, u32, u32*)`; `x` holds at
        // least `n64` entries, `hist` holds `bins` counters (a power of two) and the launch
        // gives `bins` words of shared memory.
        unsafe { l.launch(self.stride_cfg(n64 as usize, bins * 4)?) }?;
        Ok(s.clone_dtoh(&hist)?)
    }

    /// The threshold of the three radix passes (11, 10 and 10 bits) over the first `len`
    /// magnitudes of `x` for the `need`-th largest: its bit pattern and how many entries equal
    /// to it are kept. `h1` is the first pass's histogram when the caller already has it.
    fn radix_select(
        &self,
        x: &CudaSlice<f32>,
        len: usize,
        need: u64,
        h1: Option<Vec<u32>>,
    ) -> Result<(u32, u64), CudaError> {
        let h1 = match h1 {
            Some(h) => h,
            None => self.radix_pass(x, len, 32, 0, 20, 2048)?,
        };
        let (b1, need) = pick(&h1, need);
        let h2 = self.radix_pass(x, len, 20, b1, 10, 1024)?;
        let (b2, need) = pick(&h2, need);
        let prefix2 = (b1 << 10) | b2;
        let h3 = self.radix_pass(x, len, 10, prefix2, 0, 1024)?;
        let (b3, ties) = pick(&h3, need);
        Ok(((prefix2 << 10) | b3, ties))
    }

    /// Threshold, ties kept and per-tile counts (above, equal) from a sampled window: one pass
    /// over `x` counts each tile's entries above the window and gathers those inside it; radix
    /// passes over the gathered candidates find the k-th largest. `Ok(None)` when the window
    /// missed it (the sample was unlucky or ties crowd it): the caller runs the full passes.
    fn topk_by_window(
        &self,
        x: &CudaSlice<f32>,
        k: usize,
        tiles: usize,
    ) -> Result<Option<TopkCounts>, CudaError> {
        let s = &self.inner.stream;
        let n = x.len();
        let Some((lo, hi, cap)) = self.topk_window(x, k)? else {
            return Ok(None);
        };
        let n64 = n as u64;
        let mut gt = s.alloc_zeros::<u32>(tiles)?;
        let mut totals = s.alloc_zeros::<u32>(3)?;
        let mut mags = s.alloc_zeros::<f32>(cap.max(1))?;
        let mut idx = s.alloc_zeros::<u32>(cap.max(1))?;
        let cap32 = cap as u32;
        let mut l = s.launch_builder(&self.inner.f.topk_gather);
        l.arg(x)
            .arg(&n64)
            .arg(&lo)
            .arg(&hi)
            .arg(&mut gt)
            .arg(&mut totals)
            .arg(&mut mags)
            .arg(&mut idx)
            .arg(&cap32);
        // SAFETY: `topk_gather(const float*, u64, u32, u32, u32*, u32*, float*, u32*, u32)`, one
        // block per tile writing `gt[tile]`, three totals; candidate slots are written only
        // below `cap`, which both candidate buffers hold.
        unsafe { l.launch(cfg(tiles, 0)?) }?;
        let totals = s.clone_dtoh(&totals)?;
        let (above, found, bad) = match totals[..] {
            [a, f, b] => (u64::from(a), f as usize, b),
            _ => return Ok(None),
        };
        if bad != 0 {
            return Err(CudaError::NonFinite { kernel: "topk" });
        }
        // The k-th largest is in the window iff fewer than k lie above it and at least k at or
        // above its low end; every candidate must also have been stored.
        let (k64, found64) = (k as u64, found as u64);
        if above >= k64 || above + found64 < k64 || found > cap {
            return Ok(None);
        }
        let (threshold, ties) = self.radix_select(&mags, found, k64 - above, None)?;
        let mut eq = s.alloc_zeros::<u32>(tiles)?;
        let mut l = s.launch_builder(&self.inner.f.topk_candidate_counts);
        l.arg(&mags)
            .arg(&idx)
            .arg(&found64)
            .arg(&threshold)
            .arg(&mut gt)
            .arg(&mut eq);
        // SAFETY: `topk_candidate_counts(const float*, const u32*, u64, u32, u32*, u32*)`; the
        // candidate buffers hold `found` entries, every index is below `x.len()`, so its tile is
        // below `tiles`.
        unsafe { l.launch(self.stride_cfg(found, 0)?) }?;
        Ok(Some(TopkCounts {
            threshold,
            ties,
            gt,
            eq,
        }))
    }

    /// A magnitude window `[lo, hi]` (bit patterns) that holds the k-th largest of `x` with
    /// high probability, from `SAMPLES` evenly spaced entries, and the candidate capacity to
    /// allocate for it. `None` when the window would hold too much of the slice to pay.
    fn topk_window(
        &self,
        x: &CudaSlice<f32>,
        k: usize,
    ) -> Result<Option<(u32, u32, usize)>, CudaError> {
        let s = &self.inner.stream;
        let n = x.len();
        let count = SAMPLES.min(n);
        let mut sample = s.alloc_zeros::<u32>(count)?;
        let (n64, count32) = (n as u64, count as u32);
        let mut l = s.launch_builder(&self.inner.f.topk_sample);
        l.arg(x).arg(&n64).arg(&count32).arg(&mut sample);
        // SAFETY: `topk_sample(const float*, u64, u32, u32*)`; sample j reads element
        // `j * n / count < n` and writes `out[j]`, `j < count`.
        unsafe { l.launch(self.stride_cfg(count, 0)?) }?;
        let mut sample = s.clone_dtoh(&sample)?;
        // Expected sample entries above the k-th largest, and a margin of about five standard
        // deviations of that count (binomial) plus a few entries.
        let expect = k as f64 * count as f64 / n as f64;
        let margin = 5.0 * expect.sqrt() + 8.0;
        let hi_rank = (expect - margin).floor();
        let lo_rank = (expect + margin).ceil();
        let window = ((lo_rank - hi_rank.max(0.0)) / count as f64 * n as f64).ceil();
        if window > (n / 8) as f64 {
            return Ok(None);
        }
        // Ranks count from the largest: rank r is ascending position count - 1 - r.
        let mut at_rank = |r: f64| -> u32 {
            let pos = count - 1 - (r as usize).min(count - 1);
            *sample.select_nth_unstable(pos).1
        };
        let hi = if hi_rank < 0.0 {
            MAX_FINITE
        } else {
            at_rank(hi_rank)
        };
        let lo = if lo_rank >= count as f64 {
            0
        } else {
            at_rank(lo_rank)
        };
        // Room for twice the window's expected share of the slice.
        let cap = ((2.0 * window) as usize + 4096).min(n);
        Ok(Some((lo, hi, cap)))
    }

    /// The full passes: three radix passes over the whole slice, then a counting pass.
    fn topk_full(
        &self,
        x: &CudaSlice<f32>,
        k: usize,
        tiles: usize,
        h1: Vec<u32>,
    ) -> Result<TopkCounts, CudaError> {
        let s = &self.inner.stream;
        let (threshold, ties) = self.radix_select(x, x.len(), k as u64, Some(h1))?;
        let mut gt = s.alloc_zeros::<u32>(tiles)?;
        let mut eq = s.alloc_zeros::<u32>(tiles)?;
        let n64 = x.len() as u64;
        let mut l = s.launch_builder(&self.inner.f.topk_count);
        l.arg(x).arg(&n64).arg(&threshold).arg(&mut gt).arg(&mut eq);
        // SAFETY: `topk_count(const float*, u64, u32, u32*, u32*)`, one block per tile, one
        // counter per tile in each output.
        unsafe { l.launch(cfg(tiles, 0)?) }?;
        Ok(TopkCounts {
            threshold,
            ties,
            gt,
            eq,
        })
    }

    /// Exact top-k by magnitude of a device slice, ties towards the lower index: the same
    /// entries as [`crate::Kernels::topk_exact`]. 16,384 evenly spaced entries place a
    /// magnitude window that holds the k-th largest with high probability; one pass over the
    /// slice counts each tile's entries above the window and gathers those inside it (well
    /// under a percent of the slice for a 1% top-k); radix passes over the gathered entries find
    /// the k-th largest magnitude exactly; an ordered compaction writes the selection in index
    /// order and zeroes it in `x`. Two passes over the slice in all. When the window misses
    /// (ties crowd it, or an unlucky sample), three radix passes and a counting pass over the
    /// whole slice find the threshold instead: the result is the same, only slower.
    ///
    /// # Errors
    /// [`CudaError::Shape`] when `k > len` or `len` does not fit `u32` indices,
    /// [`CudaError::NonFinite`] (nothing written), [`CudaError::Driver`].
    pub fn topk_on_device(
        &self,
        x: &mut CudaSlice<f32>,
        k: usize,
    ) -> Result<DeviceSelection, CudaError> {
        let n = x.len();
        if n > u32::MAX as usize || k > n {
            return Err(CudaError::Shape {
                kernel: "topk",
                detail: format!("k = {k}, {n} elements"),
            });
        }
        let s = &self.inner.stream;
        let empty = || -> Result<DeviceSelection, CudaError> {
            Ok(DeviceSelection {
                indices: s.alloc_zeros::<u32>(0)?,
                values: s.alloc_zeros::<f32>(0)?,
                threshold: 0.0,
            })
        };
        if n == 0 {
            return empty();
        }
        let tiles = n.div_ceil(TILE);
        let n64 = n as u64;
        let window = if k == 0 {
            None
        } else {
            self.topk_by_window(x, k, tiles)?
        };
        let TopkCounts {
            threshold,
            ties,
            gt,
            eq,
        } = match window {
            Some(counts) => counts,
            None => {
                // First pass: the top 11 magnitude bits; it also finds NaN and infinities.
                let h1 = self.radix_pass(x, n, 32, 0, 20, 2048)?;
                if h1
                    .get((INF_BITS >> 20) as usize..)
                    .is_some_and(|h| h.iter().any(|&c| c > 0))
                {
                    return Err(CudaError::NonFinite { kernel: "topk" });
                }
                if k == 0 {
                    return empty();
                }
                self.topk_full(x, k, tiles, h1)?
            }
        };
        // `ties` of the entries equal to the threshold are kept: the lowest-index ones.
        let gt = s.clone_dtoh(&gt)?;
        let eq = s.clone_dtoh(&eq)?;
        let mut offsets = Vec::with_capacity(tiles);
        let mut take = Vec::with_capacity(tiles);
        let (mut at, mut ties) = (0u64, ties);
        for (&g, &e) in gt.iter().zip(&eq) {
            let t = u64::from(e).min(ties);
            offsets.push(at as u32);
            take.push(t as u32);
            at += u64::from(g) + t;
            ties -= t;
        }
        if at != k as u64 {
            // Cannot happen for a slice that did not change between passes; never write past k.
            return Err(CudaError::Shape {
                kernel: "topk",
                detail: format!("counted {at} entries for k = {k}"),
            });
        }
        let offsets = s.clone_htod(&offsets)?;
        let take = s.clone_htod(&take)?;
        let mut indices = s.alloc_zeros::<u32>(k)?;
        let mut values = s.alloc_zeros::<f32>(k)?;
        let mut l = s.launch_builder(&self.inner.f.topk_compact);
        l.arg(&mut *x)
            .arg(&n64)
            .arg(&threshold)
            .arg(&offsets)
            .arg(&take)
            .arg(&mut indices)
            .arg(&mut values);
        // SAFETY: `topk_compact(float*, u64, u32, const u32*, const u32*, u32*, float*)`, one
        // block of 256 per tile; the offsets were computed from this slice's counts so the k
        // outputs are written exactly once each.
        unsafe { l.launch(cfg(tiles, 0)?) }?;
        Ok(DeviceSelection {
            indices,
            values,
            threshold: f32::from_bits(threshold & ABS),
        })
    }

    /// Count-sketch of `x − center` added into `out`, as [`crate::Kernels::count_sketch`]
    /// (buckets equal up to the order of float additions: the device adds with atomics).
    /// Returns `‖x − center‖²`.
    ///
    /// # Errors
    /// [`CudaError::Shape`] on zero buckets, mismatched lengths or position overflow,
    /// [`CudaError::NonFinite`] (then `out` holds a partial sum: reset it), [`CudaError::Driver`].
    pub fn count_sketch_on_device(
        &self,
        sketch: &CountSketch,
        x: &CudaSlice<f32>,
        center: Option<&CudaSlice<f32>>,
        first_index: u64,
        out: &mut CudaSlice<f32>,
    ) -> Result<f64, CudaError> {
        let n = x.len();
        if sketch.buckets == 0
            || out.len() != sketch.buckets
            || center.is_some_and(|c| c.len() != n)
            || first_index.checked_add(n as u64).is_none()
        {
            return Err(CudaError::Shape {
                kernel: "count_sketch",
                detail: format!(
                    "{n} elements, {} buckets, out {}",
                    sketch.buckets,
                    out.len()
                ),
            });
        }
        if n == 0 {
            return Ok(0.0);
        }
        let s = &self.inner.stream;
        let mut sum_sq = s.alloc_zeros::<f64>(1)?;
        let (null, n64, buckets) = (0u64, n as u64, sketch.buckets as u64);
        let mut l = s.launch_builder(&self.inner.f.count_sketch);
        l.arg(x);
        match center {
            Some(c) => l.arg(c),
            None => l.arg(&null),
        };
        l.arg(&n64)
            .arg(&first_index)
            .arg(&sketch.seed)
            .arg(&buckets)
            .arg(&mut *out)
            .arg(&mut sum_sq);
        // SAFETY: `count_sketch(const float*, const float*, u64, u64, u64, u64, float*,
        // double*)`; x and center (or null) hold `n` elements, `out` `buckets` (> 0) entries.
        unsafe { l.launch(self.stride_cfg(n, 0)?) }?;
        let sum_sq = s.clone_dtoh(&sum_sq)?.first().copied().unwrap_or(f64::NAN);
        if !sum_sq.is_finite() {
            return Err(CudaError::NonFinite {
                kernel: "count_sketch",
            });
        }
        Ok(sum_sq)
    }
}

/// Partial-sum buffers of a statistics kernel, pushed after its first two arguments.
struct Partials {
    n: u64,
    sum: CudaSlice<f64>,
    sq: CudaSlice<f64>,
    max: CudaSlice<u32>,
}

impl Partials {
    fn push<'a>(&'a mut self, l: &mut cudarc::driver::LaunchArgs<'a>) {
        l.arg(&self.n)
            .arg(&mut self.sum)
            .arg(&mut self.sq)
            .arg(&mut self.max);
    }
}

/// The bin holding the `need`-th largest entry of a histogram (scanning from the top), and how
/// many entries of that bin are still needed.
fn pick(hist: &[u32], need: u64) -> (u32, u64) {
    let mut above = 0u64;
    for (b, &c) in hist.iter().enumerate().rev() {
        let c = u64::from(c);
        if above + c >= need {
            return (b as u32, need - above);
        }
        above += c;
    }
    (0, need.saturating_sub(above))
}

fn check_quant(n: usize, update: Option<usize>, out: usize) -> Result<(), CudaError> {
    if out != n || update.is_some_and(|u| u != n) {
        return Err(CudaError::Shape {
            kernel: "quantize_i8",
            detail: format!("residual {n}, update {update:?}, out {out}"),
        });
    }
    Ok(())
}

/// The CPU's scale and inverse for a largest magnitude (`cpu/quant.rs`): `scale = abs_max / 127`
/// stepped down while `127 · scale` overflows, `inv = 127 / abs_max`; both 0 for 0.
fn scale_of(abs_max: f32) -> Result<(f32, f32), CudaError> {
    if !(abs_max.is_finite() && abs_max >= 0.0) {
        return Err(CudaError::NonFinite {
            kernel: "quantize_i8",
        });
    }
    if abs_max == 0.0 {
        return Ok((0.0, 0.0));
    }
    let mut scale = abs_max / QMAX;
    while (scale * QMAX).is_infinite() {
        scale = f32::from_bits(scale.to_bits() - 1);
    }
    Ok((scale, QMAX / abs_max))
}

fn rounding_args(rounding: Rounding) -> (i32, u64) {
    match rounding {
        Rounding::Nearest => (0, 0),
        Rounding::Stochastic { seed } => (1, seed),
    }
}
