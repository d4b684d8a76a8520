//! f32 ↔ bf16 over slices, for error-feedback residuals held in 16 bits.
//!
//! A residual is what compression has not sent yet; it is re-added to the next update and only
//! its large entries are ever sent, so 8 bits of mantissa lose nothing measurable (BENCHMARKS.md,
//! the learning tier with residuals in bf16) and halve the memory a node holds for it. bf16 keeps
//! f32's exponent range, so the conversion only rounds: to nearest, ties to even, saturating at
//! bf16's largest finite value instead of rounding up to infinity. Both loops are branch-free
//! and vectorise; on x86-64 they are also compiled for AVX2 and AVX-512 and picked at run time
//! (baseline SSE2 converts 4 values an instruction, and the fused pass converts every residual
//! entry twice).

use half::bf16;

/// bf16's largest finite value, as f32 (exactly representable).
const BF16_MAX: f32 = 3.389_531_4e38;

/// `dst[i] = src[i]` widened to f32 (exact), over the shorter of the two.
///
/// ```
/// use half::bf16;
/// let mut out = [0f32; 2];
/// kindred_kernels::widen_bf16(&[bf16::from_f32(1.5), bf16::from_f32(-2.0)], &mut out);
/// assert_eq!(out, [1.5, -2.0]);
/// ```
pub fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(level) = x86::level() {
        return x86::widen(level, src, dst);
    }
    widen_portable(src, dst);
}

#[inline(always)]
fn widen_portable(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits(u32::from(s.to_bits()) << 16);
    }
}

/// `dst[i] = src[i]` rounded to bf16 (to nearest, ties to even; magnitudes past bf16's largest
/// finite value saturate to it), over the shorter of the two. A NaN stays a NaN.
///
/// ```
/// use half::bf16;
/// let mut out = [bf16::ZERO; 3];
/// kindred_kernels::narrow_bf16(&[1.0 + 1.0 / 256.0, f32::MAX, 0.1], &mut out);
/// assert_eq!(out[0], bf16::ONE); // a tie, to even
/// assert_eq!(out[1], bf16::MAX);
/// assert_eq!(out[2], bf16::from_f32(0.1));
/// ```
pub fn narrow_bf16(src: &[f32], dst: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(level) = x86::level() {
        return x86::narrow(level, src, dst);
    }
    narrow_portable(src, dst);
}

#[inline(always)]
fn narrow_portable(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16::from_bits(round_bits(s));
    }
}

/// The same loops compiled for wider vectors, chosen by what the CPU runs.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod x86 {
    use half::bf16;

    use super::{narrow_portable, widen_portable};

    /// A vector extension the CPU runs.
    #[derive(Clone, Copy)]
    pub(super) enum Level {
        Avx512,
        Avx2,
    }

    /// The widest level this CPU runs (std caches the CPUID answer), if any over baseline.
    pub(super) fn level() -> Option<Level> {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
        {
            Some(Level::Avx512)
        } else if std::arch::is_x86_feature_detected!("avx2") {
            Some(Level::Avx2)
        } else {
            None
        }
    }

    pub(super) fn widen(level: Level, src: &[bf16], dst: &mut [f32]) {
        // SAFETY: `level` comes from `level()`, so the CPU executes these instructions.
        unsafe {
            match level {
                Level::Avx512 => widen_avx512(src, dst),
                Level::Avx2 => widen_avx2(src, dst),
            }
        }
    }

    pub(super) fn narrow(level: Level, src: &[f32], dst: &mut [bf16]) {
        // SAFETY: as in `widen`.
        unsafe {
            match level {
                Level::Avx512 => narrow_avx512(src, dst),
                Level::Avx2 => narrow_avx2(src, dst),
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    fn widen_avx512(src: &[bf16], dst: &mut [f32]) {
        widen_portable(src, dst);
    }

    #[target_feature(enable = "avx2")]
    fn widen_avx2(src: &[bf16], dst: &mut [f32]) {
        widen_portable(src, dst);
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    fn narrow_avx512(src: &[f32], dst: &mut [bf16]) {
        narrow_portable(src, dst);
    }

    #[target_feature(enable = "avx2")]
    fn narrow_avx2(src: &[f32], dst: &mut [bf16]) {
        narrow_portable(src, dst);
    }
}

/// One value: see [`narrow_bf16`].
#[inline(always)]
fn round_bits(x: f32) -> u16 {
    // `clamp` leaves a NaN as it is, and rounding a NaN's payload could carry it anywhere: a
    // NaN becomes the canonical quiet one (a select, not a branch).
    let b = x.clamp(-BF16_MAX, BF16_MAX).to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    if x.is_nan() { 0x7fc0 } else { rounded }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_is_halfs_round_to_nearest_even_within_range() {
        let mut x = 0x1234_5678u32;
        let mut values = vec![
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            1e-40,
        ];
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = f32::from_bits(x);
            if v.is_finite() && v.abs() <= BF16_MAX {
                values.push(v);
            }
        }
        let mut out = vec![bf16::ZERO; values.len()];
        narrow_bf16(&values, &mut out);
        for (v, o) in values.iter().zip(&out) {
            assert_eq!(o.to_bits(), bf16::from_f32(*v).to_bits(), "{v:e}");
        }
        let mut back = vec![0f32; values.len()];
        widen_bf16(&out, &mut back);
        for (b, o) in back.iter().zip(&out) {
            assert_eq!(*b, o.to_f32());
        }
    }

    #[test]
    fn past_the_range_saturates_and_nan_stays_nan() {
        let mut out = [bf16::ZERO; 5];
        narrow_bf16(
            &[f32::MAX, -f32::MAX, f32::INFINITY, f32::NAN, -f32::NAN],
            &mut out,
        );
        assert_eq!(&out[..3], &[bf16::MAX, bf16::MIN, bf16::MAX]);
        assert!(out[3].is_nan() && out[4].is_nan());
    }
}
