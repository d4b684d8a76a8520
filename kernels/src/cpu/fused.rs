//! The fused distillation pass: one read of `update` and `residual`, one write of `residual`.
//!
//! Distilling a layer needs, from the same data, (a) `residual += update` with statistics,
//! (b) the count-sketch of `update − center` for the embedding, and (c) the entries of the new
//! residual above a top-k threshold. Done as separate kernels that is four or five passes over
//! memory; here it is one, with the threshold estimated beforehand from a small sample of
//! `residual + update` ([`sample_threshold`]). Per 64 KiB chunk, one loop does the add and the
//! statistics lanes; while the chunk is still in L2, a branch-free threshold scan collects the
//! candidates (walking hit bits only where there are hits) and a third loop sketches the chunk's
//! update (64 consecutive buckets per block, see [`CountSketch`]). Main-memory traffic is one
//! read of each input and one write of the residual.
//!
//! Unlike [`super::accumulate`], the update is not validated in a separate read before the
//! residual is written: callers that must keep the residual intact on a NaN (the distiller) run
//! `find_non_finite` over the whole update first, once for all layers.
//!
//! The sketch buckets and their sum of squares are computed with exactly the arithmetic of
//! [`super::sketch`] (same chunks, blocks, lanes and combination order), so a fused embedding is
//! bit-identical to one computed by `count_sketch` alone.
//!
//! A residual may also be held in bf16 ([`ResidualElem`]): each chunk is widened into an f32
//! buffer that stays in L1/L2, passed through the same chunk loop, and rounded back. Statistics
//! and candidates are those of the f32 sums (bit-identical to the f32 pass over the widened
//! residual); main-memory traffic on the residual halves.

use std::cell::RefCell;

use half::bf16;
use rayon::prelude::*;

use super::sketch::{ZEROS, fold, scratch, sketch_block};
use super::topk::{
    OVERSAMPLE, RUN, SAMPLE_RUNS, SAMPLED_MIN_LEN, SIGMAS, collect_at_least, sample_starts,
};
use super::{ABS, CHUNK, INF_BITS, LANES, first_non_finite, fmax};
use crate::error::AccumulateError;
use crate::types::{Candidates, CountSketch, Fused, SketchInto, Stats};

const BLOCK: usize = 64;

/// What one chunk produced.
struct Part {
    sum: f64,
    sum_sq: f64,
    abs_max: f32,
    nan: bool,
    buckets: Vec<f32>,
    sketch_sq: f64,
}

/// Per-chunk accumulators.
struct Acc {
    s: [f32; LANES],
    q: [f32; LANES],
    m: [f32; LANES],
    /// `Σ (update − centre)²` by lane, from the sketch loop.
    sq: [f32; 8],
}

/// The sketch part of a chunk's job.
struct ChunkSketch<'a> {
    sketch: &'a CountSketch,
    center: Option<&'a [f32]>,
    first: u64,
}

/// How a residual's elements are held: f32, or bf16 widened a chunk at a time.
pub(crate) trait ResidualElem: Copy + Send + Sync {
    /// Run `f` over `chunk` as f32 values and keep what it wrote (rounded, for bf16).
    fn as_f32<T>(chunk: &mut [Self], f: impl FnOnce(&mut [f32]) -> T) -> T;
    /// The value as f32.
    fn widen(self) -> f32;
}

impl ResidualElem for f32 {
    #[inline]
    fn as_f32<T>(chunk: &mut [Self], f: impl FnOnce(&mut [Self]) -> T) -> T {
        f(chunk)
    }

    #[inline]
    fn widen(self) -> f32 {
        self
    }
}

impl ResidualElem for bf16 {
    fn as_f32<T>(chunk: &mut [Self], f: impl FnOnce(&mut [f32]) -> T) -> T {
        thread_local! {
            // One chunk's f32 buffer per thread, reused: no allocation or zeroing per chunk.
            static WIDE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        WIDE.with(|wide| {
            let mut taken = wide.take();
            taken.resize(chunk.len(), 0.0);
            crate::convert::widen_bf16(chunk, &mut taken);
            let out = f(&mut taken);
            crate::convert::narrow_bf16(&taken, chunk);
            wide.replace(taken);
            out
        })
    }

    #[inline]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// `r += u` with statistics lanes, flat over a chunk (the loop of `accumulate`).
#[inline]
fn add_stats(acc: &mut Acc, r: &mut [f32], u: &[f32]) {
    let mut rc = r.chunks_exact_mut(LANES);
    let mut uc = u.chunks_exact(LANES);
    for (a, b) in (&mut rc).zip(&mut uc) {
        for j in 0..LANES {
            let v = a[j] + b[j];
            a[j] = v;
            acc.s[j] += v;
            acc.q[j] += v * v;
            acc.m[j] = fmax(acc.m[j], v.abs());
        }
    }
    for ((a, &b), j) in rc.into_remainder().iter_mut().zip(uc.remainder()).zip(0..) {
        let v = *a + b;
        *a = v;
        acc.s[j] += v;
        acc.q[j] += v * v;
        acc.m[j] = fmax(acc.m[j], v.abs());
    }
}

fn fused_chunk(
    r: &mut [f32],
    u: &[f32],
    start: usize,
    sk: Option<&ChunkSketch<'_>>,
    threshold: i32,
    candidates: &mut Candidates,
) -> Part {
    let mut acc = Acc {
        s: [0.0; LANES],
        q: [0.0; LANES],
        m: [0.0; LANES],
        sq: [0.0; 8],
    };
    let mut buckets = sk.map_or_else(Vec::new, |s| scratch(s.sketch.buckets));
    // Separate loops over the chunk rather than one over 64-element blocks: the add and statistics
    // run flat over the chunk, then the threshold scan and the sketch re-read the chunk (64 KiB
    // per array) from L2. Main-memory traffic is that of one loop, and each loop keeps few enough
    // values live to stay in SIMD registers on baseline x86-64 (measured on 16M elements: 13.8 ms
    // against 16.5 ms for the threshold test folded into the add loop and 19 ms for one
    // interleaved loop over 64-element blocks).
    add_stats(&mut acc, r, u);
    if threshold != i32::MAX {
        collect_at_least(r, start, threshold as u32, candidates);
    }
    if let Some(s) = sk {
        let len = u.len();
        let mut i = 0usize;
        while i < len {
            let g = s.first + (start + i) as u64;
            let pos = (g % BLOCK as u64) as usize;
            let n = (BLOCK - pos).min(len - i);
            let Some(ub) = u.get(i..i + n) else {
                break;
            };
            let (h, signs) = s.sketch.block_hash(g / BLOCK as u64);
            let off = CountSketch::offset(h, s.sketch.buckets) as usize;
            let cb = match s.center {
                Some(c) => c.get(start + i..start + i + n).unwrap_or_default(),
                None => ZEROS.get(..n).unwrap_or_default(),
            };
            if s.center.is_some() {
                sketch_block::<true>(&mut acc.sq, &mut buckets, ub, cb, pos, off, signs);
            } else {
                sketch_block::<false>(&mut acc.sq, &mut buckets, ub, cb, pos, off, signs);
            }
            i += n;
        }
    }
    let sum: f64 = acc.s.iter().map(|&v| f64::from(v)).sum();
    let sum_sq: f64 = acc.q.iter().map(|&v| f64::from(v)).sum();
    Part {
        sum,
        sum_sq,
        abs_max: acc.m.iter().fold(0f32, |a, &b| a.max(b)),
        nan: sum.is_nan() || sum_sq.is_nan(),
        buckets: match sk {
            Some(s) => fold(buckets, s.sketch.buckets),
            None => buckets,
        },
        sketch_sq: acc.sq.iter().map(|&v| f64::from(v)).sum(),
    }
}

pub(super) fn accumulate_fused<R: ResidualElem>(
    parallel: bool,
    residual: &mut [R],
    update: &[f32],
    sketch: Option<SketchInto<'_>>,
    threshold: Option<f32>,
) -> Result<Fused, AccumulateError> {
    if residual.len() != update.len() {
        return Err(AccumulateError::LengthMismatch {
            residual: residual.len(),
            update: update.len(),
        });
    }
    if let Some(s) = &sketch {
        let bad = s.sketch.buckets == 0
            || s.out.len() != s.sketch.buckets
            || s.center.is_some_and(|c| c.len() != update.len())
            || s.first_index.checked_add(update.len() as u64).is_none();
        if bad {
            return Err(AccumulateError::SketchShape);
        }
    }
    if residual.len() > u32::MAX as usize && threshold.is_some() {
        return Err(AccumulateError::SketchShape);
    }
    let threshold = threshold.map_or(i32::MAX, |t| (t.to_bits() & ABS).min(INF_BITS) as i32);
    let chunk_sketch = sketch.as_ref().map(|s| ChunkSketch {
        sketch: s.sketch,
        center: s.center,
        first: s.first_index,
    });
    // Candidates: one list filled in order on one thread; per-chunk lists concatenated in chunk
    // order on several (the same entries either way).
    let mut candidates = Candidates::default();
    if threshold != i32::MAX && !parallel {
        // Top-k thresholds keep a few percent; reserving 2% up front avoids regrowth (pages that
        // are never written cost nothing).
        candidates.indices.reserve(update.len() / 50);
        candidates.values.reserve(update.len() / 50);
    }
    let parts: Vec<Part> = if parallel {
        // A few contiguous runs of whole chunks per thread, each filling one candidate list
        // reserved up front: a list per chunk grew by doubling, hundreds per layer, and the
        // allocator handed their pages back and faulted them in again layer after layer (6% of
        // a profile of a 10^9-parameter node's distill step in the kernel's `clear_page`).
        let runs = rayon::current_num_threads().max(1) * 4;
        let run = update.len().div_ceil(runs).div_ceil(CHUNK).max(1) * CHUNK;
        let reserve = if threshold == i32::MAX { 0 } else { run / 50 };
        let per_run: Vec<(Vec<Part>, Candidates)> = residual
            .par_chunks_mut(run)
            .zip(update.par_chunks(run))
            .enumerate()
            .map(|(i, (r, u))| {
                let mut cand = Candidates::default();
                cand.indices.reserve(reserve);
                cand.values.reserve(reserve);
                let parts = r
                    .chunks_mut(CHUNK)
                    .zip(u.chunks(CHUNK))
                    .enumerate()
                    .map(|(c, (r, u))| {
                        let start = i * run + c * CHUNK;
                        R::as_f32(r, |r| {
                            fused_chunk(r, u, start, chunk_sketch.as_ref(), threshold, &mut cand)
                        })
                    })
                    .collect();
                (parts, cand)
            })
            .collect();
        let total: usize = per_run.iter().map(|(_, c)| c.len()).sum();
        candidates.indices.reserve(total);
        candidates.values.reserve(total);
        per_run
            .into_iter()
            .flat_map(|(parts, cand)| {
                candidates.extend(&cand);
                parts
            })
            .collect()
    } else {
        residual
            .chunks_mut(CHUNK)
            .zip(update.chunks(CHUNK))
            .enumerate()
            .map(|(c, (r, u))| {
                R::as_f32(r, |r| {
                    fused_chunk(
                        r,
                        u,
                        c * CHUNK,
                        chunk_sketch.as_ref(),
                        threshold,
                        &mut candidates,
                    )
                })
            })
            .collect()
    };
    let (mut sum, mut sum_sq, mut abs_max, mut nan) = (0.0f64, 0.0f64, 0f32, false);
    let mut sketch_sq = 0.0f64;
    for p in &parts {
        sum += p.sum;
        sum_sq += p.sum_sq;
        abs_max = abs_max.max(p.abs_max);
        nan |= p.nan;
        sketch_sq += p.sketch_sq;
    }
    if nan || abs_max.is_infinite() {
        // Unlike `accumulate`, the update is not pre-scanned (that would be a second read of it):
        // a non-finite update is found here, after the residual was written.
        if let Some((index, value)) = first_non_finite(update) {
            return Err(AccumulateError::NonFinite { index, value });
        }
        let index = residual
            .iter()
            .position(|r| !r.widen().is_finite())
            .unwrap_or(0);
        return Err(AccumulateError::Overflow { index });
    }
    if let Some(s) = sketch {
        for p in &parts {
            for (o, &b) in s.out.iter_mut().zip(&p.buckets) {
                *o += b;
            }
        }
        if !sketch_sq.is_finite() {
            if let Some((index, _)) = s.center.and_then(first_non_finite) {
                return Err(AccumulateError::NonFiniteCenter { index });
            }
            // Finite differences whose squares overflowed f32 lanes: recompute exactly.
            sketch_sq = update
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let c = s.center.and_then(|c| c.get(i)).copied().unwrap_or(0.0);
                    f64::from(v - c).powi(2)
                })
                .sum();
        }
    }
    Ok(Fused {
        stats: Stats::from_sums(update.len(), sum, sum_sq, abs_max),
        sketch_sum_sq: sketch_sq,
        candidates,
    })
}

/// A magnitude that, with high probability, at least `k` entries of `residual + update` reach,
/// estimated from a seeded sample; `None` when sampling cannot save work (short slices, large k).
pub(super) fn sample_threshold<R: ResidualElem>(
    residual: &[R],
    update: &[f32],
    k: usize,
    seed: u64,
) -> Option<f32> {
    let len = residual.len().min(update.len());
    if k == 0 || len < SAMPLED_MIN_LEN || k > len / 8 {
        return None;
    }
    let mut sample: Vec<u32> = Vec::with_capacity(SAMPLE_RUNS * RUN);
    for start in sample_starts(seed, len) {
        if let (Some(r), Some(u)) = (
            residual.get(start..start + RUN),
            update.get(start..start + RUN),
        ) {
            sample.extend(
                r.iter()
                    .zip(u)
                    .map(|(a, b)| (a.widen() + b).to_bits() & ABS),
            );
        }
    }
    let expect = k as f64 / len as f64 * sample.len() as f64;
    let rank = (expect * OVERSAMPLE + SIGMAS * expect.sqrt()).ceil() as usize;
    if rank == 0 || rank >= sample.len() {
        return None;
    }
    let (_, &mut t, _) = sample.select_nth_unstable_by(rank - 1, |a, b| b.cmp(a));
    (t < INF_BITS).then(|| f32::from_bits(t))
}
