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

use half::bf16;
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

/// Where the [`SAMPLE_RUNS`] runs of a sample of a `len`-element slice start: seeded uniform
/// draws, in increasing order. The order does not change the sample (a multiset, whose rank
/// statistic is the threshold); read in address order, the runs of a large layer share TLB
/// entries and page-table walks, and a mapped file's pages come in as one forward pass. In a
/// profile of a 10^9-parameter node's distill step, the sample in drawing order (with the page
/// faults of its first touches) was a third of the CPU time; at 10^8, with the pages mapped, its
/// share fell from 15% to 8% in address order.
pub(super) fn sample_starts(seed: u64, len: usize) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed);
    let span = (len.saturating_sub(RUN) + 1) as u64;
    let mut starts: Vec<usize> = (0..SAMPLE_RUNS).map(|_| rng.below(span) as usize).collect();
    starts.sort_unstable();
    starts
}

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

/// Keep the `k` largest of `candidates` (by magnitude, then lower index) and, with `zero`, zero
/// them in `residual`. `candidates` are in increasing index order and must include every element
/// at or above some magnitude that at least `k` of them reach, so their top `k` is the global top
/// `k`. Keys come from the candidates' own values: nothing is gathered back from `residual`.
fn finish(
    residual: &mut [f32],
    candidates: Candidates,
    k: usize,
    method: SelectMethod,
    zero: bool,
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
        if zero && let Some(slot) = residual.get_mut(i as usize) {
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
/// at least `k`, their top `k` is the global top `k` (zeroed in `residual` with `zero`);
/// otherwise the exact method runs on the whole slice (and zeroes them).
pub(super) fn from_candidates(
    parallel: bool,
    residual: &mut [f32],
    candidates: Candidates,
    k: usize,
    zero: bool,
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
        zero,
    ))
}

/// [`from_candidates`] of a residual held in bf16, which it leaves as it was: the top `k` of the
/// candidates when they are enough (the residual is not read), otherwise the exact method on a
/// widened copy.
pub(super) fn from_candidates_bf16(
    parallel: bool,
    residual: &[bf16],
    candidates: Candidates,
    k: usize,
) -> Result<Selection, TopKError> {
    check(residual.len(), k)?;
    let consistent = candidates.indices.len() == candidates.values.len()
        && candidates.values.iter().all(|v| v.is_finite())
        && candidates
            .indices
            .last()
            .is_none_or(|&i| (i as usize) < residual.len());
    if consistent && candidates.len() >= k {
        let n = candidates.len();
        return Ok(finish(
            &mut [],
            candidates,
            k,
            SelectMethod::Sampled { candidates: n },
            false,
        ));
    }
    let mut wide = vec![0f32; residual.len()];
    crate::convert::widen_bf16(residual, &mut wide);
    exact_with(parallel, &mut wide, k, SelectMethod::SampledFellBack)
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
    Ok(finish(residual, cand, k, method, true))
}

/// Push the index (offset by `start`) of every element whose magnitude bits are ≥ `threshold`.
///
/// On x86-64 CPUs with AVX-512F (detected at run time) each 16 elements are one compare into a
/// mask and two compress-and-store instructions, with no branch per element or per hit: measured
/// in the distill pipeline at 16M elements and 1.4% hits, this scan went from about 4.3 ms to
/// about 1.2 ms. With AVX2 only, each 8 elements are a compare, a mask and two permutes from a
/// table. Elsewhere the portable loop below runs; all three push the same entries.
pub(super) fn collect_at_least(chunk: &[f32], start: usize, threshold: u32, out: &mut Candidates) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512::available() {
            avx512::collect_at_least(chunk, start, threshold, out);
            return;
        }
        if avx2::available() {
            avx2::collect_at_least(chunk, start, threshold, out);
            return;
        }
    }
    collect_at_least_portable(chunk, start, threshold, out);
}

/// The portable [`collect_at_least`]. Per 16 elements a hit mask is built without branches
/// (signed compares are exact here, both sides being below 2^31) and its set bits are walked, so
/// the cost is one mispredicted branch per hit rather than per element: measured 5.7 G elements/s
/// at 1.7% hits, against ~1 G/s for a per-element branch.
fn collect_at_least_portable(chunk: &[f32], start: usize, threshold: u32, out: &mut Candidates) {
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

/// The block structure both SIMD scans share. `scan_block(block, start, out)` is handed blocks of
/// [`SIMD_BLOCK`] elements, then the whole groups of `group` elements left; each call reserves
/// room for its whole block first, so every full-width store stays inside the allocation while a
/// list that collects few hits stays small. The tail shorter than a group goes to the portable
/// scan.
#[cfg(target_arch = "x86_64")]
#[inline]
fn scan_in_blocks(
    chunk: &[f32],
    start: usize,
    threshold: u32,
    group: usize,
    out: &mut Candidates,
    mut scan_block: impl FnMut(&[f32], usize, &mut Candidates),
) {
    let mut blocks = chunk.chunks_exact(SIMD_BLOCK);
    let mut base = start;
    for block in &mut blocks {
        scan_block(block, base, out);
        base += SIMD_BLOCK;
    }
    let rest = blocks.remainder();
    let full = rest.len() - rest.len() % group.max(1);
    let (groups, tail) = rest.split_at(full);
    scan_block(groups, base, out);
    collect_at_least_portable(tail, base + full, threshold, out);
}

/// Elements per reservation of the SIMD scans.
#[cfg(target_arch = "x86_64")]
const SIMD_BLOCK: usize = 256;

/// The AVX-512F candidate scan. With the AVX2 one below, this is the crate's only hand-written
/// SIMD: the scan is the one loop whose cost is set by branches (one per hit), which the compiler
/// cannot remove and compress (or table-driven permute) instructions do.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx512 {
    use std::arch::x86_64::{
        __m512i, _mm512_add_epi32, _mm512_and_si512, _mm512_castps_si512, _mm512_cmpge_epi32_mask,
        _mm512_loadu_ps, _mm512_maskz_compress_epi32, _mm512_maskz_compress_ps, _mm512_set1_epi32,
        _mm512_setr_epi32, _mm512_storeu_epi32, _mm512_storeu_ps,
    };

    use super::{ABS, Candidates, scan_in_blocks};

    const GROUP: usize = 16;

    /// Whether this CPU runs AVX-512F and POPCNT (std caches the CPUID answer).
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("popcnt")
    }

    /// [`super::collect_at_least`] for a CPU where [`available`] is true.
    pub(super) fn collect_at_least(
        chunk: &[f32],
        start: usize,
        threshold: u32,
        out: &mut Candidates,
    ) {
        // SAFETY: callers check `available()` first, so the CPU executes these instructions.
        unsafe { scan(chunk, start, threshold, out) }
    }

    #[target_feature(enable = "avx512f,popcnt")]
    fn scan(chunk: &[f32], start: usize, threshold: u32, out: &mut Candidates) {
        let t = _mm512_set1_epi32(threshold.min(ABS) as i32);
        let abs = _mm512_set1_epi32(ABS as i32);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        scan_in_blocks(chunk, start, threshold, GROUP, out, |block, base, out| {
            scan_block(block, base, t, abs, lanes, out);
        });
    }

    /// Compress the hits of `block` (a whole number of groups) onto the ends of `out`.
    #[target_feature(enable = "avx512f,popcnt")]
    fn scan_block(
        block: &[f32],
        start: usize,
        t: __m512i,
        abs: __m512i,
        lanes: __m512i,
        out: &mut Candidates,
    ) {
        out.indices.reserve(block.len());
        out.values.reserve(block.len());
        let (mut li, mut lv) = (out.indices.len(), out.values.len());
        let (pi, pv) = (out.indices.as_mut_ptr(), out.values.as_mut_ptr());
        // Indices are u32 (callers check that slices fit); the lane arithmetic wraps like `as u32`.
        let mut base = start as u32;
        for g in block.chunks_exact(GROUP) {
            // SAFETY: `g` is exactly 16 f32 (`chunks_exact`); an unaligned load reads just those.
            let v = unsafe { _mm512_loadu_ps(g.as_ptr()) };
            // Magnitude bits as i32: both sides are below 2^31, so the signed compare is exact.
            let hits = _mm512_cmpge_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs), t);
            let index = _mm512_add_epi32(lanes, _mm512_set1_epi32(base as i32));
            let packed_index = _mm512_maskz_compress_epi32(hits, index);
            let packed_value = _mm512_maskz_compress_ps(hits, v);
            // SAFETY: each earlier group of this block kept at most 16 lanes, so the lengths are
            // at most the old ones plus the elements before this group, and both vectors have
            // room for `block.len()` more: the 16-lane stores stay inside the allocations.
            unsafe {
                _mm512_storeu_epi32(pi.add(li).cast(), packed_index);
                _mm512_storeu_ps(pv.add(lv), packed_value);
            }
            let n = hits.count_ones() as usize;
            li += n;
            lv += n;
            base = base.wrapping_add(GROUP as u32);
        }
        // SAFETY: the first `li` (`lv`) elements are initialised: the old ones, then the first
        // `n` lanes of each group's store, which are the compressed hits.
        unsafe {
            out.indices.set_len(li);
            out.values.set_len(lv);
        }
    }
}

/// The AVX2 candidate scan, for x86-64 CPUs without AVX-512: AVX2 has no compress instruction,
/// so the hit mask of 8 lanes picks a permutation from a 256-entry table that moves the hits to
/// the front.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod avx2 {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_and_si256, _mm256_castps_si256, _mm256_castsi256_ps,
        _mm256_cmpgt_epi32, _mm256_loadu_ps, _mm256_loadu_si256, _mm256_movemask_ps,
        _mm256_permutevar8x32_epi32, _mm256_permutevar8x32_ps, _mm256_set1_epi32,
        _mm256_setr_epi32, _mm256_storeu_ps, _mm256_storeu_si256,
    };

    use super::{ABS, Candidates, scan_in_blocks};

    const GROUP: usize = 8;

    /// For each 8-bit hit mask, the lanes of its set bits in order, then zeros.
    const PACK: [[u32; GROUP]; 256] = pack_table();

    const fn pack_table() -> [[u32; GROUP]; 256] {
        let mut table = [[0u32; GROUP]; 256];
        let mut mask = 0;
        while mask < 256 {
            let (mut n, mut lane) = (0, 0);
            while lane < GROUP {
                if mask & (1 << lane) != 0 {
                    table[mask][n] = lane as u32;
                    n += 1;
                }
                lane += 1;
            }
            mask += 1;
        }
        table
    }

    /// Whether this CPU runs AVX2 and POPCNT (std caches the CPUID answer).
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("popcnt")
    }

    /// [`super::collect_at_least`] for a CPU where [`available`] is true.
    pub(super) fn collect_at_least(
        chunk: &[f32],
        start: usize,
        threshold: u32,
        out: &mut Candidates,
    ) {
        // SAFETY: callers check `available()` first, so the CPU executes these instructions.
        unsafe { scan(chunk, start, threshold, out) }
    }

    #[target_feature(enable = "avx2,popcnt")]
    fn scan(chunk: &[f32], start: usize, threshold: u32, out: &mut Candidates) {
        let t = _mm256_set1_epi32(threshold.min(ABS) as i32);
        let abs = _mm256_set1_epi32(ABS as i32);
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        scan_in_blocks(chunk, start, threshold, GROUP, out, |block, base, out| {
            scan_block(block, base, t, abs, lanes, out);
        });
    }

    /// Pack the hits of `block` (a whole number of groups) onto the ends of `out`.
    #[target_feature(enable = "avx2,popcnt")]
    fn scan_block(
        block: &[f32],
        start: usize,
        t: __m256i,
        abs: __m256i,
        lanes: __m256i,
        out: &mut Candidates,
    ) {
        out.indices.reserve(block.len());
        out.values.reserve(block.len());
        let (mut li, mut lv) = (out.indices.len(), out.values.len());
        let (pi, pv) = (out.indices.as_mut_ptr(), out.values.as_mut_ptr());
        // Indices are u32 (callers check that slices fit); the lane arithmetic wraps like `as u32`.
        let mut base = start as u32;
        for g in block.chunks_exact(GROUP) {
            // SAFETY: `g` is exactly 8 f32 (`chunks_exact`); an unaligned load reads just those.
            let v = unsafe { _mm256_loadu_ps(g.as_ptr()) };
            // Magnitude bits as i32: both sides are below 2^31, so the signed compare is exact.
            let bits = _mm256_and_si256(_mm256_castps_si256(v), abs);
            let misses = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(t, bits)));
            let hits = !misses & 0xff;
            let order = PACK[hits as usize & 0xff];
            // SAFETY: `order` is 8 u32 (32 bytes); an unaligned load reads just those.
            let perm = unsafe { _mm256_loadu_si256(order.as_ptr().cast()) };
            let index = _mm256_add_epi32(lanes, _mm256_set1_epi32(base as i32));
            let packed_index = _mm256_permutevar8x32_epi32(index, perm);
            let packed_value = _mm256_permutevar8x32_ps(v, perm);
            // SAFETY: each earlier group of this block kept at most 8 lanes, so the lengths are
            // at most the old ones plus the elements before this group, and both vectors have
            // room for `block.len()` more: the 8-lane stores stay inside the allocations.
            unsafe {
                _mm256_storeu_si256(pi.add(li).cast(), packed_index);
                _mm256_storeu_ps(pv.add(lv), packed_value);
            }
            let n = hits.count_ones() as usize;
            li += n;
            lv += n;
            base = base.wrapping_add(GROUP as u32);
        }
        // SAFETY: the first `li` (`lv`) elements are initialised: the old ones, then the first
        // `n` lanes of each group's store, which are the packed hits.
        unsafe {
            out.indices.set_len(li);
            out.values.set_len(lv);
        }
    }
}

/// Every entry of `x` with magnitude bits ≥ `threshold`, in index order: one list filled by one
/// scan on one thread, per-chunk lists concatenated in chunk order on several.
fn collect(parallel: bool, x: &[f32], threshold: u32) -> Candidates {
    if !parallel {
        let mut all = Candidates::default();
        collect_at_least(x, 0, threshold, &mut all);
        return all;
    }
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
    let mut sample: Vec<u32> = Vec::with_capacity(SAMPLE_RUNS * RUN);
    for start in sample_starts(seed, len) {
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
    from_candidates(parallel, residual, cand, k, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The starts are in address order, inside the slice, spread uniformly over it (each eighth
    /// of the slice holds its share of the draws within 6 standard deviations), and another
    /// seed draws another sample.
    #[test]
    fn sample_starts_are_uniform_draws_in_address_order() {
        for (seed, len) in [(1u64, SAMPLED_MIN_LEN), (9, 1 << 20), (3, (1 << 24) + 5)] {
            let starts = sample_starts(seed, len);
            assert_eq!(starts.len(), SAMPLE_RUNS);
            assert!(starts.windows(2).all(|w| w[0] <= w[1]));
            assert!(starts.iter().all(|&s| s + RUN <= len));
            let mut bins = [0usize; 8];
            for &s in &starts {
                bins[s * 8 / (len - RUN + 1)] += 1;
            }
            let expect = SAMPLE_RUNS / 8;
            assert!(
                bins.iter().all(|&n| n.abs_diff(expect) <= 128),
                "seed {seed}, len {len}: {bins:?}"
            );
            assert_ne!(starts, sample_starts(seed + 1, len));
        }
    }

    /// The dispatched scan (AVX-512 where the CPU has it), the AVX2 one and the portable one push
    /// the same entries, at every length (remainders included), offset and threshold, NaN and ±inf too.
    #[test]
    fn the_simd_and_portable_scans_agree() {
        let mut rng = SplitMix64::new(7);
        for len in [0usize, 1, 7, 15, 16, 17, 31, 33, 100, 1000, 4099] {
            let mut x: Vec<f32> = (0..len)
                .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
                .collect();
            if len > 20 {
                x[3] = f32::NAN;
                x[5] = f32::INFINITY;
                x[19] = f32::NEG_INFINITY;
                x[11] = -0.0;
            }
            for start in [0usize, 5, 1 << 20] {
                for threshold in [
                    0u32,
                    0.5f32.to_bits(),
                    0.99f32.to_bits(),
                    INF_BITS,
                    u32::MAX,
                ] {
                    // A non-empty `out` whose two vectors differ in length must be appended to.
                    let seed = Candidates {
                        indices: vec![1, 2],
                        values: vec![9.0],
                    };
                    let (mut a, mut b) = (seed.clone(), seed);
                    collect_at_least(&x, start, threshold, &mut a);
                    collect_at_least_portable(&x, start, threshold, &mut b);
                    #[cfg(target_arch = "x86_64")]
                    if avx2::available() {
                        let mut c = Candidates {
                            indices: vec![1, 2],
                            values: vec![9.0],
                        };
                        avx2::collect_at_least(&x, start, threshold, &mut c);
                        assert_eq!(c.indices, b.indices, "avx2 len {len} start {start}");
                        assert_eq!(c.values.len(), b.values.len());
                        for (p, q) in c.values.iter().zip(&b.values) {
                            assert_eq!(p.to_bits(), q.to_bits());
                        }
                    }
                    assert_eq!(
                        a.indices, b.indices,
                        "len {len} start {start} t {threshold}"
                    );
                    let bits =
                        |c: &Candidates| c.values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&a), bits(&b), "len {len} start {start} t {threshold}");
                    // And the portable scan matches the plain definition.
                    let want: Vec<u32> = x
                        .iter()
                        .enumerate()
                        .filter(|(_, v)| v.to_bits() & ABS >= threshold.min(ABS))
                        .map(|(i, _)| (start + i) as u32)
                        .collect();
                    assert_eq!(b.indices.get(2..).unwrap_or_default(), want.as_slice());
                }
            }
        }
    }
}
