//! Fused `residual += update` with statistics of the result, in one pass over memory.
//!
//! The distiller needs the statistics of `update + residual` to choose a layer's encoding, and the
//! new residual itself to select from. Computing both while the data streams through once is what
//! keeps error feedback near memory bandwidth. The update is validated first (a read-only pass that
//! is cheap next to the read-modify-write), so a NaN from the trainer is reported before the
//! residual is touched.

use rayon::prelude::*;

use super::{CHUNK, INF_BITS, LANES, first_non_finite, fmax, map_chunks, max_abs_bits_chunked};
use crate::error::AccumulateError;
use crate::types::Stats;

/// Sums of one chunk.
#[derive(Clone, Copy, Default)]
struct Partial {
    sum: f64,
    sum_sq: f64,
    abs_max: u32,
}

fn combine(len: usize, parts: &[Partial]) -> (Stats, u32) {
    let (mut sum, mut sum_sq, mut abs_max) = (0.0f64, 0.0f64, 0u32);
    for p in parts {
        sum += p.sum;
        sum_sq += p.sum_sq;
        abs_max = abs_max.max(p.abs_max);
    }
    (
        Stats::from_sums(len, sum, sum_sq, f32::from_bits(abs_max.min(INF_BITS))),
        abs_max,
    )
}

fn lanes_to_partial(s: [f32; LANES], q: [f32; LANES], m: [f32; LANES]) -> Partial {
    let sum: f64 = s.iter().map(|&v| f64::from(v)).sum();
    let sum_sq: f64 = q.iter().map(|&v| f64::from(v)).sum();
    let max = m.iter().fold(0f32, |a, &b| a.max(b));
    // A NaN anywhere poisons the sums (f32::max would skip it); report it as non-finite.
    let abs_max = if sum.is_nan() || sum_sq.is_nan() {
        INF_BITS
    } else {
        max.to_bits()
    };
    Partial {
        sum,
        sum_sq,
        abs_max,
    }
}

fn add_chunk(r: &mut [f32], u: &[f32]) -> Partial {
    let (mut s, mut q, mut m) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let mut rc = r.chunks_exact_mut(LANES);
    let mut uc = u.chunks_exact(LANES);
    for (a, b) in (&mut rc).zip(&mut uc) {
        for j in 0..LANES {
            let v = a[j] + b[j];
            a[j] = v;
            s[j] += v;
            q[j] += v * v;
            m[j] = fmax(m[j], v.abs());
        }
    }
    for ((a, b), j) in rc.into_remainder().iter_mut().zip(uc.remainder()).zip(0..) {
        let v = *a + b;
        *a = v;
        s[j] += v;
        q[j] += v * v;
        m[j] = fmax(m[j], v.abs());
    }
    lanes_to_partial(s, q, m)
}

fn stats_chunk(x: &[f32]) -> Partial {
    let (mut s, mut q, mut m) = ([0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let mut xc = x.chunks_exact(LANES);
    for a in &mut xc {
        for j in 0..LANES {
            let v = a[j];
            s[j] += v;
            q[j] += v * v;
            m[j] = fmax(m[j], v.abs());
        }
    }
    for (&v, j) in xc.remainder().iter().zip(0..) {
        s[j] += v;
        q[j] += v * v;
        m[j] = fmax(m[j], v.abs());
    }
    lanes_to_partial(s, q, m)
}

pub(super) fn accumulate(
    parallel: bool,
    residual: &mut [f32],
    update: &[f32],
) -> Result<Stats, AccumulateError> {
    if residual.len() != update.len() {
        return Err(AccumulateError::LengthMismatch {
            residual: residual.len(),
            update: update.len(),
        });
    }
    if max_abs_bits_chunked(parallel, update) >= INF_BITS
        && let Some((index, value)) = first_non_finite(update)
    {
        return Err(AccumulateError::NonFinite { index, value });
    }
    let parts: Vec<Partial> = if parallel {
        residual
            .par_chunks_mut(CHUNK)
            .zip(update.par_chunks(CHUNK))
            .map(|(r, u)| add_chunk(r, u))
            .collect()
    } else {
        residual
            .chunks_mut(CHUNK)
            .zip(update.chunks(CHUNK))
            .map(|(r, u)| add_chunk(r, u))
            .collect()
    };
    let (stats, abs_max) = combine(update.len(), &parts);
    if abs_max >= INF_BITS {
        let index = first_non_finite(residual).map_or(0, |(i, _)| i);
        return Err(AccumulateError::Overflow { index });
    }
    Ok(stats)
}

pub(super) fn stats(parallel: bool, x: &[f32]) -> Result<Stats, AccumulateError> {
    let parts = map_chunks(parallel, x, |_, c| stats_chunk(c));
    let (stats, abs_max) = combine(x.len(), &parts);
    if abs_max >= INF_BITS
        && let Some((index, value)) = first_non_finite(x)
    {
        return Err(AccumulateError::NonFinite { index, value });
    }
    Ok(stats)
}
