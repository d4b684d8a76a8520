//! Counter-style randomness for the simulator, built on the kernels' SplitMix64.
//!
//! Every random quantity is a pure function of the run seed and the identity of what it
//! describes (a node, a link, a lookup), never of evaluation order: lookups run in parallel and
//! must draw the same numbers whichever thread runs them.

use kindred_kernels::rng::{SplitMix64, hash_index, mix64};

/// Mix any number of words into one random word under `seed`.
#[inline]
pub fn hash_words(seed: u64, words: &[u64]) -> u64 {
    words
        .iter()
        .fold(mix64(seed ^ 0x5EED_51B0_u64), |acc, &w| hash_index(acc, w))
}

/// A generator for the object named by `words` under `seed`.
pub fn stream(seed: u64, words: &[u64]) -> SplitMix64 {
    SplitMix64::new(hash_words(seed, words))
}

/// A uniform `f64` in `(0, 1]` from a random word (never 0, so logarithms stay finite).
#[inline]
pub fn unit_open(word: u64) -> f64 {
    ((word >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A standard normal from two random words (Box-Muller).
#[inline]
pub fn gaussian(w1: u64, w2: u64) -> f64 {
    let u1 = unit_open(w1);
    let u2 = unit_open(w2);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// The standard normal quantile `Φ⁻¹(p)` for `p` in `(0, 1)` (Acklam's rational approximation,
/// relative error below 1.2·10⁻⁹): one uniform word gives one normal deviate, without the
/// trigonometry of Box-Muller, and the same word always gives the same deviate.
#[inline]
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.024_25 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.024_25 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// A Lomax (Pareto type II) sample with shape `alpha` and mean `mean`, from a uniform `u` in
/// `(0, 1]`: `P(X > x) = (1 + x/λ)^-α` with `λ = mean·(α − 1)`. Heavy-tailed: its variance is
/// infinite for `α ≤ 2`.
#[inline]
pub fn lomax(u: f64, alpha: f64, mean: f64) -> f64 {
    let lambda = mean * (alpha - 1.0);
    lambda * (u.powf(-1.0 / alpha) - 1.0)
}

/// The residual of a Lomax(α, mean) duration seen at a random instant (its equilibrium
/// distribution): Lomax with shape `α − 1` and the same scale, `P(R > x) = (1 + x/λ)^(1−α)`.
/// Used to start churn in steady state.
#[inline]
pub fn lomax_residual(u: f64, alpha: f64, mean: f64) -> f64 {
    let lambda = mean * (alpha - 1.0);
    lambda * (u.powf(-1.0 / (alpha - 1.0)) - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lomax_has_the_requested_mean_and_a_heavy_tail() {
        let mut rng = stream(1, &[2]);
        let n = 400_000;
        let xs: Vec<f64> = (0..n)
            .map(|_| lomax(unit_open(rng.next_u64()), 3.0, 2.0))
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        assert!((mean - 2.0).abs() < 0.05, "{mean}");
        // Heavier than exponential with the same mean: P(X > 5·mean) ≈ (1 + 5/2)^-3 ≈ 2.3 %
        // against e^-5 ≈ 0.7 %.
        let tail = xs.iter().filter(|&&x| x > 10.0).count() as f64 / n as f64;
        assert!((tail - 0.0233).abs() < 0.003, "{tail}");
    }

    #[test]
    fn residual_matches_the_equilibrium_tail() {
        // P(R > x) = (1 + x/λ)^(1-α); α = 3, mean 1 → λ = 2: P(R > 2) = 2^-2.
        let mut rng = stream(9, &[]);
        let n = 200_000;
        let over = (0..n)
            .filter(|_| lomax_residual(unit_open(rng.next_u64()), 3.0, 1.0) > 2.0)
            .count() as f64
            / n as f64;
        assert!((over - 0.25).abs() < 0.01, "{over}");
    }

    #[test]
    fn gaussian_is_standard() {
        let mut rng = stream(3, &[]);
        let n = 200_000;
        let xs: Vec<f64> = (0..n)
            .map(|_| gaussian(rng.next_u64(), rng.next_u64()))
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }

    #[test]
    fn normal_quantile_inverts_the_cdf() {
        for (p, z) in [
            (0.5, 0.0),
            (0.975, 1.959_964),
            (0.025, -1.959_964),
            (0.001, -3.090_232),
        ] {
            assert!((normal_quantile(p) - z).abs() < 1e-5, "{p}");
        }
        let mut rng = stream(4, &[]);
        let n = 200_000;
        let xs: Vec<f64> = (0..n)
            .map(|_| normal_quantile(unit_open(rng.next_u64())))
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.01 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }

    #[test]
    fn hashes_depend_on_every_word() {
        assert_ne!(hash_words(1, &[1, 2]), hash_words(1, &[2, 1]));
        assert_ne!(hash_words(1, &[1]), hash_words(2, &[1]));
        assert_eq!(hash_words(5, &[7, 8]), hash_words(5, &[7, 8]));
    }
}
