//! Seeded, platform-independent randomness for kernels.
//!
//! Every random choice a kernel makes (stochastic rounding, top-k sampling positions, count-sketch
//! hashes, SimHash projections) must be reproducible from a seed alone: the count-sketch and SimHash
//! seeds are network-wide, so two nodes on different machines must derive bit-identical hashes, and
//! the determinism tests compare runs across thread counts. So this module uses no external
//! generator whose stream could change with a crate version, only SplitMix64 (Steele, Lea and
//! Flood, 2014), a tiny, well-studied generator with published test vectors:
//!
//! - [`SplitMix64`] is the sequential stream (sampling positions, projection matrices);
//! - [`mix64`] is its output function used *counter-style*: `mix64(seed ^ f(i))` gives element `i`
//!   its own random word, so a parallel kernel draws the same number for element `i` whichever
//!   thread processes it.

/// The golden-ratio increment of SplitMix64.
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a bijective 64-bit mixer with full avalanche.
///
/// ```
/// use kindred_kernels::rng::mix64;
/// assert_ne!(mix64(1), mix64(2));
/// assert_eq!(mix64(0), 0); // zero is the mixer's fixed point; seed through an offset.
/// ```
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random word of element `index` under `seed`, independent of evaluation order.
#[inline]
pub const fn hash_index(seed: u64, index: u64) -> u64 {
    mix64(
        seed.wrapping_add(GOLDEN_GAMMA)
            .wrapping_add(index.wrapping_mul(GOLDEN_GAMMA)),
    )
}

/// A uniform `f32` in `[0, 1)` on a grid of 2^-24 from a random word.
#[inline]
pub fn unit_f32(word: u64) -> f32 {
    (word >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// The SplitMix64 generator.
///
/// ```
/// use kindred_kernels::rng::SplitMix64;
/// let mut rng = SplitMix64::new(1234567);
/// assert_eq!(rng.next_u64(), 6457827717110365317); // the published test vector
/// ```
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator whose stream is a pure function of `seed`.
    pub const fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform integer in `[0, bound)` (Lemire's multiply-shift; bias below 2^-32 for the bounds
    /// kernels use). Returns 0 when `bound` is 0.
    #[inline]
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// A uniform `f64` in `[0, 1)` with 53 random bits.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// A standard normal `f64` by the Box-Muller transform (one of the pair; the other is dropped
    /// so that the stream position does not depend on call history).
    ///
    /// Uses only `ln`, `sqrt` and `cos` in f64; callers round the result to `f32`, which hides
    /// last-bit differences between platform math libraries in all but vanishingly rare cases.
    pub fn next_gaussian(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_matches_published_vector() {
        let mut rng = SplitMix64::new(1_234_567);
        assert_eq!(rng.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(rng.next_u64(), 3_203_168_211_198_807_973);
        assert_eq!(rng.next_u64(), 9_817_491_932_198_370_423);
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = SplitMix64::new(7);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let v = rng.below(10);
            assert!(v < 10);
            seen[v as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(rng.below(0), 0);
    }

    #[test]
    fn unit_and_gaussian_moments() {
        let mut rng = SplitMix64::new(42);
        let n = 200_000;
        let (mut s, mut q) = (0.0, 0.0);
        for _ in 0..n {
            let g = rng.next_gaussian();
            s += g;
            q += g * g;
        }
        let mean = s / f64::from(n);
        let var = q / f64::from(n) - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        let u: f64 = (0..n)
            .map(|i| f64::from(unit_f32(hash_index(3, i as u64))))
            .sum::<f64>()
            / f64::from(n);
        assert!((u - 0.5).abs() < 0.005, "uniform mean {u}");
    }

    #[test]
    fn hash_index_depends_on_seed_and_index() {
        assert_ne!(hash_index(1, 5), hash_index(2, 5));
        assert_ne!(hash_index(1, 5), hash_index(1, 6));
        assert_eq!(hash_index(9, 77), hash_index(9, 77));
    }
}
