//! Blocked count-sketch (see [`CountSketch`] for the hashing scheme).
//!
//! A classic count-sketch scatters every element to a random bucket, which no compiler can
//! vectorise. Here positions come in blocks of 64 that land on 64 *consecutive* buckets at a
//! random offset, each element keeping its own random sign. The inner loop is then a contiguous
//! `dst[j] += x[j] ^ sign_mask[j]` over a destination that stays in L1, two hashes per 64
//! elements, while collision probabilities and the unbiasedness of inner products are those of the
//! classic sketch.

use super::map_chunks;
use crate::error::SketchError;
use crate::types::CountSketch;

const BLOCK: usize = 64;

/// For each byte of a sign word, the XOR masks that flip the sign of its 8 elements.
pub(super) static SIGN_MASKS: [[u32; 8]; 256] = sign_masks();

const fn sign_masks() -> [[u32; 8]; 256] {
    let mut t = [[0u32; 8]; 256];
    let mut byte = 0;
    while byte < 256 {
        let mut bit = 0;
        while bit < 8 {
            if (byte >> bit) & 1 == 1 {
                t[byte][bit] = 1 << 31;
            }
            bit += 1;
        }
        byte += 1;
    }
    t
}

pub(super) static ZEROS: [f32; BLOCK] = [0.0; BLOCK];

/// Eight elements of a sketch block: `dst[l] ±= x[l] − c[l]` by the bits of `signs`, and
/// `sq[l] += (x[l] − c[l])²`; without a centre `c` is ignored (no load, no subtraction).
/// Fixed-size arrays let the compiler keep this in SIMD registers (on slices it fell back to
/// scalar code).
#[inline]
pub(super) fn sketch8<const CENTER: bool>(
    sq: &mut [f32; 8],
    dst: &mut [f32],
    x: &[f32],
    c: &[f32],
    signs: u8,
) {
    let (Ok(dst), Ok(x), Ok(c)) = (
        <&mut [f32; 8]>::try_from(dst),
        <&[f32; 8]>::try_from(x),
        <&[f32; 8]>::try_from(c),
    ) else {
        return;
    };
    let masks = &SIGN_MASKS[usize::from(signs)];
    for l in 0..8 {
        let v = if CENTER { x[l] - c[l] } else { x[l] };
        sq[l] += v * v;
        dst[l] += f32::from_bits(v.to_bits() ^ masks[l]);
    }
}

/// Per-chunk partial: buckets and Σ v² (non-finite when some v is).
struct Partial {
    buckets: Vec<f32>,
    sum_sq: f64,
}

/// Scratch buckets for one chunk: `buckets + 64` entries, so that every block writes to 64
/// consecutive entries without wrapping; [`fold`] then adds the overhang back onto buckets
/// `(d + j) mod d`, giving exactly the wrap-around mapping of [`CountSketch::locate`].
pub(super) fn scratch(buckets: usize) -> Vec<f32> {
    vec![0f32; buckets + BLOCK]
}

/// Fold the overhang of a [`scratch`] buffer back and drop it.
pub(super) fn fold(mut buf: Vec<f32>, buckets: usize) -> Vec<f32> {
    for j in buckets..buf.len() {
        let v = buf.get(j).copied().unwrap_or(0.0);
        if let Some(b) = buf.get_mut(j % buckets.max(1)) {
            *b += v;
        }
    }
    buf.truncate(buckets);
    buf
}

/// Sketch one (possibly partial) block of `x − c` into a [`scratch`] buffer: the block's first
/// element is at position `pos` of its 64, the block lands at bucket offset `off`.
#[inline]
pub(super) fn sketch_block<const CENTER: bool>(
    sq: &mut [f32; 8],
    buf: &mut [f32],
    x: &[f32],
    c: &[f32],
    pos: usize,
    off: usize,
    signs: u64,
) {
    let n = x.len();
    match buf.get_mut(off..off + BLOCK) {
        Some(dst) if n == BLOCK => {
            for (byte, ((d8, x8), c8)) in dst
                .chunks_exact_mut(8)
                .zip(x.chunks_exact(8))
                .zip(c.chunks_exact(8))
                .enumerate()
            {
                sketch8::<CENTER>(sq, d8, x8, c8, (signs >> (8 * byte)) as u8);
            }
        }
        _ => {
            // A partial block at a chunk or slice edge.
            let dst = buf.get_mut(off + pos..off + pos + n).unwrap_or_default();
            for (j, ((d, &xv), &cv)) in dst.iter_mut().zip(x).zip(c).enumerate() {
                let v = if CENTER { xv - cv } else { xv };
                sq[j % 8] += v * v;
                let flip = (((signs >> (pos + j)) & 1) as u32) << 31;
                *d += f32::from_bits(v.to_bits() ^ flip);
            }
        }
    }
}

fn sketch_chunk(sketch: &CountSketch, x: &[f32], c: Option<&[f32]>, g0: u64) -> Partial {
    let buckets = sketch.buckets;
    let mut buf = scratch(buckets);
    let mut q = [0f32; 8];
    let mut i = 0usize;
    while i < x.len() {
        let g = g0 + i as u64;
        let (block, pos) = (g / BLOCK as u64, (g % BLOCK as u64) as usize);
        let n = (BLOCK - pos).min(x.len() - i);
        let (h, signs) = sketch.block_hash(block);
        let off = CountSketch::offset(h, buckets) as usize;
        let xs = x.get(i..i + n).unwrap_or_default();
        let cs = match c {
            Some(c) => c.get(i..i + n).unwrap_or_default(),
            None => ZEROS.get(..n).unwrap_or_default(),
        };
        if c.is_some() {
            sketch_block::<true>(&mut q, &mut buf, xs, cs, pos, off, signs);
        } else {
            sketch_block::<false>(&mut q, &mut buf, xs, cs, pos, off, signs);
        }
        i += n;
    }
    Partial {
        buckets: fold(buf, buckets),
        sum_sq: q.iter().map(|&v| f64::from(v)).sum(),
    }
}

pub(super) fn count_sketch(
    parallel: bool,
    sketch: &CountSketch,
    x: &[f32],
    center: Option<&[f32]>,
    first_index: u64,
    out: &mut [f32],
) -> Result<f64, SketchError> {
    if sketch.buckets == 0 {
        return Err(SketchError::ZeroBuckets);
    }
    if out.len() != sketch.buckets {
        return Err(SketchError::OutputLength {
            expected: sketch.buckets,
            found: out.len(),
        });
    }
    if let Some(c) = center
        && c.len() != x.len()
    {
        return Err(SketchError::CenterLength {
            input: x.len(),
            center: c.len(),
        });
    }
    if first_index.checked_add(x.len() as u64).is_none() {
        return Err(SketchError::IndexOverflow);
    }
    let parts = map_chunks(parallel, x, |start, xs| {
        let cs = center.and_then(|c| c.get(start..start + xs.len()));
        sketch_chunk(sketch, xs, cs, first_index + start as u64)
    });
    let mut sum_sq: f64 = parts.iter().fold(0.0, |a, p| a + p.sum_sq);
    if !sum_sq.is_finite() {
        // Either some x − c is not finite, or finite squares overflowed f32 lanes.
        let diff = |i: usize, v: f32| v - center.and_then(|c| c.get(i)).copied().unwrap_or(0.0);
        if let Some((index, value)) = x
            .iter()
            .enumerate()
            .map(|(i, &v)| (i, diff(i, v)))
            .find(|(_, v)| !v.is_finite())
        {
            return Err(SketchError::NonFinite { index, value });
        }
        sum_sq = x
            .iter()
            .enumerate()
            .map(|(i, &v)| f64::from(diff(i, v)).powi(2))
            .sum();
    }
    for p in &parts {
        for (o, &b) in out.iter_mut().zip(&p.buckets) {
            *o += b;
        }
    }
    Ok(sum_sq)
}
