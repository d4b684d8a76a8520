//! 1-bit sign packing with a mean-magnitude scale (scaled SignSGD).
//!
//! A bit is the IEEE sign bit of its element, so packing is a shift-and-or with no comparison, and
//! the layout (bit `i % 64` of word `i / 64`, zero padding) is exactly `kindred_proto::SignBits`.
//! The scale is the mean `|x|`, which makes `scale · sign(x)` the best one-scale approximation of
//! `x` in L2 among those with the same signs.

use rayon::prelude::*;

use super::{ABS, CHUNK, INF_BITS, LANES, first_non_finite};
use crate::error::{SignPackError, SignUnpackError};

/// Words per chunk ([`CHUNK`] is a multiple of 64).
const CHUNK_WORDS: usize = CHUNK / 64;

/// Pack one chunk; returns (sum of |x|, max magnitude bits).
fn pack_chunk(x: &[f32], words: &mut [u64]) -> (f64, u32) {
    let mut s = [0f32; LANES];
    let mut m = 0u32;
    for (w, c) in words.iter_mut().zip(x.chunks(64)) {
        // 16-bit masks per 16 elements compile to SIMD sign extraction (2x a 64-bit-wide loop).
        let mut bits = 0u64;
        let mut groups = c.chunks_exact(16);
        for (q, g) in (&mut groups).enumerate() {
            let mut mask = 0u32;
            for (j, v) in g.iter().enumerate() {
                mask |= (v.to_bits() >> 31) << j;
            }
            bits |= u64::from(mask) << (16 * q);
        }
        let done = c.len() - groups.remainder().len();
        for (j, &v) in groups.remainder().iter().enumerate() {
            bits |= u64::from(v.to_bits() >> 31) << (done + j);
        }
        *w = bits;
        for &v in c {
            m = m.max(v.to_bits() & ABS);
        }
        for chunk in c.chunks(LANES) {
            for (lane, &v) in s.iter_mut().zip(chunk) {
                *lane += v.abs();
            }
        }
    }
    (s.iter().map(|&v| f64::from(v)).sum(), m)
}

pub(super) fn pack(parallel: bool, x: &[f32], words: &mut [u64]) -> Result<f32, SignPackError> {
    let expected = x.len().div_ceil(64);
    if words.len() != expected {
        return Err(SignPackError::WordCount {
            len: x.len(),
            expected,
            found: words.len(),
        });
    }
    let parts: Vec<(f64, u32)> = if parallel {
        x.par_chunks(CHUNK)
            .zip(words.par_chunks_mut(CHUNK_WORDS))
            .map(|(xs, ws)| pack_chunk(xs, ws))
            .collect()
    } else {
        x.chunks(CHUNK)
            .zip(words.chunks_mut(CHUNK_WORDS))
            .map(|(xs, ws)| pack_chunk(xs, ws))
            .collect()
    };
    let mut sum = 0.0f64;
    let mut max = 0u32;
    for (s, m) in parts {
        sum += s;
        max = max.max(m);
    }
    if max >= INF_BITS {
        let (index, value) = first_non_finite(x).unwrap_or((0, f32::NAN));
        return Err(SignPackError::NonFinite { index, value });
    }
    if x.is_empty() {
        return Ok(0.0);
    }
    Ok((sum / x.len() as f64) as f32)
}

fn unpack_chunk(words: &[u64], scale: f32, out: &mut [f32]) {
    let scale_bits = scale.to_bits() & ABS;
    for (os, &w) in out.chunks_mut(64).zip(words) {
        for (j, o) in os.iter_mut().enumerate() {
            let sign = ((w >> j) as u32 & 1) << 31;
            *o = f32::from_bits(scale_bits | sign);
        }
    }
}

pub(super) fn unpack(
    parallel: bool,
    words: &[u64],
    scale: f32,
    out: &mut [f32],
) -> Result<(), SignUnpackError> {
    let len = out.len();
    let expected = len.div_ceil(64);
    if words.len() != expected {
        return Err(SignUnpackError::WordCount {
            len,
            expected,
            found: words.len(),
        });
    }
    let tail = len % 64;
    if tail != 0 && words.last().is_some_and(|w| w >> tail != 0) {
        return Err(SignUnpackError::Padding { len });
    }
    if !(scale.is_finite() && scale >= 0.0) {
        return Err(SignUnpackError::BadScale { scale });
    }
    if parallel {
        out.par_chunks_mut(CHUNK)
            .zip(words.par_chunks(CHUNK_WORDS))
            .for_each(|(os, ws)| unpack_chunk(ws, scale, os));
    } else {
        out.chunks_mut(CHUNK)
            .zip(words.chunks(CHUNK_WORDS))
            .for_each(|(os, ws)| unpack_chunk(ws, scale, os));
    }
    Ok(())
}
