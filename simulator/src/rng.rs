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
    fn hashes_depend_on_every_word() {
        assert_ne!(hash_words(1, &[1, 2]), hash_words(1, &[2, 1]));
        assert_ne!(hash_words(1, &[1]), hash_words(2, &[1]));
        assert_eq!(hash_words(5, &[7, 8]), hash_words(5, &[7, 8]));
    }
}
