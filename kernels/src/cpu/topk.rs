//! Top-k selection by magnitude, exact (radix histogram) and DGC-style (sampled threshold).
//!
//! Both work on the magnitude *bit patterns* of the values: for non-negative IEEE floats the
//! integer order of the bits is the numeric order, NaN and infinities sort above every finite
//! value (so they are found, not silently skipped), and a key `(|x| bits, !index)` gives a strict
//! total order whose top `k` is the unique answer with ties broken towards the lower index. Both
//! methods therefore return exactly the same entries; sampling only saves passes.
//!
//! - **Exact**: one pass builds a histogram of the top 11 magnitude bits; the bin holding the k-th
//!   largest is found from the counts; a second pass collects everything in that bin or above,
//!   and a selection among those few candidates finishes.
//! - **Sampled** (Lin et al., *Deep Gradient Compression*, 2018): the threshold is read off a
//!   seeded sample of runs of the slice, lowered a little so that at least `k` entries pass with
//!   high probability; one pass collects the entries above it, and the exact top `k` of those is
//!   the answer. If the sample over-estimated the threshold, the exact method runs instead.

use rayon::prelude::*;

use super::{ABS, INF_BITS, first_non_finite, map_chunks};
use crate::error::TopKError;
use crate::rng::SplitMix64;
use crate::types::{Candidates, SelectMethod, Selection};

/// Histogram key: the top 11 bits of the 31 magnitude bits.
const KEY_SHIFT: u32 = 20;
const BINS: usize = 1 << 11;
/// Interleaved histograms, so consecutive increments of one hot bin do not serialise.
const WAYS: usize = 4;

/// Below this length, or above this fraction of selected entries, sampling cannot save a pass.
pub(super) const SAMPLED_MIN_LEN: usize = 1 << 15;
/// Sample layout: `SAMPLE_RUNS` runs of `RUN` consecutive elements (cache-line friendly).
pub(super) const RUN: usize = 8;
pub(super) const SAMPLE_RUNS: usize = 4096;
/// Aim for this many times `k` candidates, plus [`SIGMAS`] standard deviations of the sample
/// count: few enough candidates to keep the scan cheap, enough that falling back is rare.
pub(super) const OVERSAMPLE: f64 = 1.15;
/// See [`OVERSAMPLE`].
pub(super) const SIGMAS: f64 = 3.5;

fn check(len: usize, k: usize) -> Result<(), TopKError> {
    if len > u32::MAX as usize {
        return Err(TopKError::TooLong { len });
    }
    if k > len {
        return Err(TopKError::KOutOfRange { k, len });
    }
    Ok(())
}

fn non_finite(residual: &[f32]) -> TopKError {
    let (index, value) = first_non_finite(residual).unwrap_or((0, f32::NAN));
    TopKError::NonFinite { index, value }
}

#[inline]
fn key_of(v: f32) -> usize {
    ((v.to_bits() & ABS) >> KEY_SHIFT) as usize
}

/// Magnitude histogram of the top 11 bits. Counts are integers, so partial histograms can be
/// combined in any grouping: parallel runs use one per rayon split, not one per chunk.
fn histogram(parallel: bool, x: &[f32]) -> Vec<u64> {
    fn count(x: &[f32]) -> Vec<u64> {
        let mut h = vec![[0u32; BINS]; WAYS];
        let mut total = vec![0u64; BINS];
        // u32 counters are flushed before they can overflow.
        for block in x.chunks(1 << 30) {
            let mut it = block.chunks_exact(WAYS);
            for c in &mut it {
                for (way, &v) in h.iter_mut().zip(c) {
                    // The key is < BINS by construction; the mask lets the compiler drop the check.
                    way[key_of(v) & (BINS - 1)] += 1;
                }
            }
            for (&v, way) in it.remainder().iter().zip(h.iter_mut()) {
                way[key_of(v) & (BINS - 1)] += 1;
            }
            for way in h.iter_mut() {
                for (t, c) in total.iter_mut().zip(way.iter_mut()) {
                    *t += u64::from(*c);
                    *c = 0;
                }
            }
        }
        total
    }
    if !parallel {
        return count(x);
    }
    x.par_chunks(super::PARALLEL_MIN).map(count).reduce(
        || vec![0u64; BINS],
        |mut a, b| {
            a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
            a
        },
    )
}

/// Keep the `k` largest of `candidates` (by magnitude, then lower index) and zero them in
/// `residual`. `candidates` are in increasing index order and must include every element at or
/// above some magnitude that at least `k` of them reach, so their top `k` is the global top `k`.
/// Keys come from the candidates' own values: nothing is gathered back from `residual`.
fn finish(
    residual: &mut [f32],
    candidates: Candidates,
    k: usize,
    method: SelectMethod,
) -> Selection {
    let Candidates {
        mut indices,
        mut values,
    } = candidates;
    if indices.len() > k {
        if k == 0 {
            indices.clear();
            values.clear();
        } else {
            // The k-th largest magnitude, then one order-preserving filter (no sort): keep all
            // above it and, of those equal to it, the first (lowest-index) ones.
            let mut mags: Vec<u32> = values.iter().map(|v| v.to_bits() & ABS).collect();
            let (_, &mut kth, _) = mags.select_nth_unstable_by(k - 1, |a, b| b.cmp(a));
            drop(mags);
            let above = values.iter().filter(|v| v.to_bits() & ABS > kth).count();
            let mut ties = k - above;
            let mut kept = 0;
            for j in 0..indices.len() {
                let (i, v) = (indices[j], values[j]);
                let m = v.to_bits() & ABS;
                let keep = m > kth || (m == kth && ties > 0);
                if m == kth && keep {
                    ties -= 1;
                }
                if keep {
                    indices[kept] = i;
                    values[kept] = v;
                    kept += 1;
                }
            }
            indices.truncate(kept);
            values.truncate(kept);
        }
    }
    let mut threshold_bits = u32::MAX;
    for (&i, v) in indices.iter().zip(&values) {
        threshold_bits = threshold_bits.min(v.to_bits() & ABS);
        if let Some(slot) = residual.get_mut(i as usize) {
            *slot = 0.0;
        }
    }
    Selection {
        indices,
        values,
        threshold: if threshold_bits == u32::MAX {
            0.0
        } else {
            f32::from_bits(threshold_bits)
        },
        method,
    }
}

/// Top-k among `candidates`, which must be *every* entry whose magnitude is at or above some
/// threshold, in increasing order, with its value (what a scanning pass collects). When they are
/// at least `k`, their top `k` is the global top `k`; otherwise the exact method runs on the whole
/// slice.
pub(super) fn from_candidates(
    parallel: bool,
    residual: &mut [f32],
    candidates: Candidates,
    k: usize,
) -> Result<Selection, TopKError> {
    check(residual.len(), k)?;
    if candidates.indices.len() != candidates.values.len()
        || candidates.values.iter().any(|v| !v.is_finite())
        || candidates
            .indices
            .last()
            .is_some_and(|&i| i as usize >= residual.len())
    {
        // Not what a scanning pass of this slice produces: start over, exactly.
        return exact_with(parallel, residual, k, SelectMethod::SampledFellBack);
    }
    if candidates.len() < k {
        return exact_with(parallel, residual, k, SelectMethod::SampledFellBack);
    }
    let n = candidates.len();
    Ok(finish(
        residual,
        candidates,
        k,
        SelectMethod::Sampled { candidates: n },
    ))
}

pub(super) fn exact(
    parallel: bool,
    residual: &mut [f32],
    k: usize,
) -> Result<Selection, TopKError> {
    exact_with(parallel, residual, k, SelectMethod::Exact)
}

fn exact_with(
    parallel: bool,
    residual: &mut [f32],
    k: usize,
    method: SelectMethod,
) -> Result<Selection, TopKError> {
    check(residual.len(), k)?;
    let hist = histogram(parallel, residual);
    let inf_key = (INF_BITS >> KEY_SHIFT) as usize;
    if hist
        .get(inf_key..)
        .is_some_and(|h| h.iter().any(|&c| c > 0))
    {
        return Err(non_finite(residual));
    }
    if k == 0 {
        return Ok(Selection::default());
    }
    // The bin holding the k-th largest magnitude: every element in it or above is a candidate.
    let mut above = 0usize;
    let mut bin = 0usize;
    for (b, &count) in hist.iter().enumerate().rev() {
        let count = count as usize;
        if above + count >= k {
            bin = b;
            break;
        }
        above += count;
    }
    let threshold = (bin as u32) << KEY_SHIFT;
    let cand = collect(parallel, residual, threshold);
    Ok(finish(residual, cand, k, method))
}

/// Push the index (offset by `start`) of every element whose magnitude bits are ≥ `threshold`.
///
/// Per 16 elements a hit mask is built without branches (signed compares are exact here, both
/// sides being below 2^31) and its set bits are walked, so the cost is one mispredicted branch per
/// hit rather than per element: measured 5.7 G elements/s at 1.7% hits, against ~1 G/s for a
/// per-element branch.
pub(super) fn collect_at_least(chunk: &[f32], start: usize, threshold: u32, out: &mut Candidates) {
    const GROUP: usize = 16;
    let t = threshold.min(ABS) as i32;
    let mut groups = chunk.chunks_exact(GROUP);
    let mut base = start;
    for g in &mut groups {
        let mut mask = 0u32;
        for (j, &v) in g.iter().enumerate() {
            mask |= u32::from((v.to_bits() & ABS) as i32 >= t) << j;
        }
        while mask != 0 {
            let j = mask.trailing_zeros() as usize;
            out.push((base + j) as u32, g.get(j).copied().unwrap_or(0.0));
            mask &= mask - 1;
        }
        base += GROUP;
    }
    for (i, &v) in groups.remainder().iter().enumerate() {
        if (v.to_bits() & ABS) as i32 >= t {
            out.push((base + i) as u32, v);
        }
    }
}

/// Every entry of `x` with magnitude bits ≥ `threshold`, chunked (in chunk order).
fn collect(parallel: bool, x: &[f32], threshold: u32) -> Candidates {
    let parts = map_chunks(parallel, x, |start, chunk| {
        let mut cand = Candidates::default();
        collect_at_least(chunk, start, threshold, &mut cand);
        cand
    });
    let total: usize = parts.iter().map(Candidates::len).sum();
    let mut all = Candidates {
        indices: Vec::with_capacity(total),
        values: Vec::with_capacity(total),
    };
    for p in &parts {
        all.extend(p);
    }
    all
}

pub(super) fn sampled(
    parallel: bool,
    residual: &mut [f32],
    k: usize,
    seed: u64,
) -> Result<Selection, TopKError> {
    check(residual.len(), k)?;
    let len = residual.len();
    if len < SAMPLED_MIN_LEN || k > len / 8 {
        return exact(parallel, residual, k);
    }
    if k == 0 {
        // Nothing to select, but a non-finite input is still an error.
        return exact(parallel, residual, 0);
    }
    // Seeded sample of magnitude bits, in runs of consecutive elements.
    let mut rng = SplitMix64::new(seed);
    let mut sample: Vec<u32> = Vec::with_capacity(SAMPLE_RUNS * RUN);
    let span = (len - RUN + 1) as u64;
    for _ in 0..SAMPLE_RUNS {
        let start = rng.below(span) as usize;
        if let Some(run) = residual.get(start..start + RUN) {
            sample.extend(run.iter().map(|v| v.to_bits() & ABS));
        }
    }
    let s = sample.len() as f64;
    let expect = k as f64 / len as f64 * s;
    let rank = (expect * OVERSAMPLE + SIGMAS * expect.sqrt()).ceil() as usize;
    if rank == 0 || rank >= sample.len() {
        return exact(parallel, residual, k);
    }
    sample.select_nth_unstable_by(rank - 1, |a, b| b.cmp(a));
    let threshold = sample.get(rank - 1).copied().unwrap_or(0);
    if threshold >= INF_BITS {
        return exact(parallel, residual, k);
    }
    let cand = collect(parallel, residual, threshold);
    if cand.values.iter().any(|v| !v.is_finite()) {
        return Err(non_finite(residual));
    }
    from_candidates(parallel, residual, cand, k)
}
