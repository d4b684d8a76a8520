//! Symmetric int8 quantisation with one scale per tensor.
//!
//! `scale = max|x| / 127`, so the largest magnitude maps to ±127 and zero stays exactly zero
//! (a sparse payload must not drift). Rounding uses the `1.5 · 2^23` trick (adding and subtracting
//! it rounds any `|y| < 2^22` to the nearest integer, ties to even, in the default FP mode) because
//! `f32::round` is a libm call on baseline x86-64 and would stop vectorisation. Stochastic rounding
//! draws its uniform from the element's position and the seed (a counter-based 32-bit hash), so
//! it is unbiased, reproducible and independent of how chunks are scheduled.

use rayon::prelude::*;

use super::{CHUNK, INF_BITS, first_non_finite, max_abs_bits_chunked};
use crate::error::{DequantizeError, QuantizeError};
use crate::rng::hash_index;
use crate::types::Rounding;

/// `1.5 · 2^23`: `(y + MAGIC) - MAGIC` is `y` rounded to the nearest integer for `|y| < 2^22`.
const MAGIC: f32 = 12_582_912.0;
const QMAX: f32 = 127.0;

/// `round_half_even(y)` as an integer, for `|y| < 2^22`: after adding [`MAGIC`] the integer sits
/// in the low mantissa bits, so subtracting the bit patterns yields it without a float-to-int
/// conversion (which does not vectorise to i8 on baseline x86-64: measured 6x slower).
#[inline]
fn round_even_int(y: f32) -> i32 {
    (y + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits()) as i32
}

fn quantize_nearest(x: &[f32], inv: f32, out: &mut [i8]) {
    for (o, &v) in out.iter_mut().zip(x) {
        let y = (v * inv).clamp(-QMAX, QMAX);
        // In [-127, 127]: the truncation to i8 is exact.
        *o = round_even_int(y) as i8;
    }
}

/// A uniform in `[0, 1)` (24 bits) for element `i` from a 32-bit counter hash. 32-bit
/// multiplies vectorise where SplitMix64's 64-bit ones do not; the seed is pre-mixed with the
/// high bits of the position so positions beyond 2^32 still get distinct streams.
#[inline]
fn unit_u32(key: u32, i: u32) -> f32 {
    let mut h = (i ^ key).wrapping_mul(0x9E37_79B1);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA77);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE3D);
    h ^= h >> 16;
    (h >> 8) as f32 * (1.0 / (1u32 << 24) as f32)
}

fn quantize_stochastic(x: &[f32], inv: f32, seed: u64, start: usize, out: &mut [i8]) {
    let mut base = start as u64;
    for (os, xs) in out.chunks_mut(CHUNK).zip(x.chunks(CHUNK)) {
        // Chunks never straddle a multiple of 2^32 (CHUNK divides it), so positions are exact.
        let key = hash_index(seed, base >> 32) as u32;
        let low = base as u32;
        for ((o, &v), j) in os.iter_mut().zip(xs).zip(0u32..) {
            let y = (v * inv).clamp(-QMAX, QMAX);
            let t = y + unit_u32(key, low.wrapping_add(j));
            let r = (t + MAGIC) - MAGIC;
            // floor(t): round-to-even, minus one where that rounded up.
            let q = round_even_int(t) - i32::from(r > t);
            *o = q.clamp(-127, 127) as i8;
        }
        base += CHUNK as u64;
    }
}

pub(super) fn quantize(
    parallel: bool,
    x: &[f32],
    rounding: Rounding,
    out: &mut [i8],
) -> Result<f32, QuantizeError> {
    quantize_piece(parallel, x, 0.0, 0, rounding, out)
}

/// [`quantize`] of `x` as positions `start..` of a larger tensor whose max |value| is
/// `abs_max` (the scale is that of `abs_max` or `x`'s own max, the larger).
pub(super) fn quantize_piece(
    parallel: bool,
    x: &[f32],
    abs_max: f32,
    start: usize,
    rounding: Rounding,
    out: &mut [i8],
) -> Result<f32, QuantizeError> {
    if x.len() != out.len() {
        return Err(QuantizeError::LengthMismatch {
            input: x.len(),
            output: out.len(),
        });
    }
    if !abs_max.is_finite() {
        return Err(QuantizeError::NonFinite {
            index: 0,
            value: abs_max,
        });
    }
    let max_bits = max_abs_bits_chunked(parallel, x);
    if max_bits >= INF_BITS {
        let (index, value) = first_non_finite(x).unwrap_or((0, f32::NAN));
        return Err(QuantizeError::NonFinite { index, value });
    }
    let abs_max = f32::from_bits(max_bits).max(abs_max.abs());
    if abs_max == 0.0 {
        out.fill(0);
        return Ok(0.0);
    }
    let mut scale = abs_max / QMAX;
    // Near f32::MAX, 127 · scale can round up to infinity; step down so every dequantised value
    // stays finite (at most a couple of ulps).
    while (scale * QMAX).is_infinite() {
        scale = f32::from_bits(scale.to_bits() - 1);
    }
    // Multiplying by the inverse keeps the loop free of divisions; |x · inv| ≤ 127 up to one ulp,
    // which the clamp absorbs.
    let inv = QMAX / abs_max;
    let run = |start: usize, xs: &[f32], os: &mut [i8]| match rounding {
        Rounding::Nearest => quantize_nearest(xs, inv, os),
        Rounding::Stochastic { seed } => quantize_stochastic(xs, inv, seed, start, os),
    };
    if parallel {
        x.par_chunks(CHUNK)
            .zip(out.par_chunks_mut(CHUNK))
            .enumerate()
            .for_each(|(c, (xs, os))| run(start + c * CHUNK, xs, os));
    } else {
        run(start, x, out);
    }
    Ok(scale)
}

pub(super) fn dequantize(
    parallel: bool,
    q: &[i8],
    scale: f32,
    out: &mut [f32],
) -> Result<(), DequantizeError> {
    if q.len() != out.len() {
        return Err(DequantizeError::LengthMismatch {
            input: q.len(),
            output: out.len(),
        });
    }
    if !(scale.is_finite() && scale >= 0.0) {
        return Err(DequantizeError::BadScale { scale });
    }
    let run = |qs: &[i8], os: &mut [f32]| {
        for (o, &v) in os.iter_mut().zip(qs) {
            *o = f32::from(v) * scale;
        }
    };
    if parallel {
        q.par_chunks(CHUNK)
            .zip(out.par_chunks_mut(CHUNK))
            .for_each(|(qs, os)| run(qs, os));
    } else {
        run(q, out);
    }
    Ok(())
}
