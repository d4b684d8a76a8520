//! SimHash collision rate matches 1 − θ/π within sampling error.

#![allow(clippy::unwrap_used)]

use kindred_kernels::rng::SplitMix64;
use kindred_kernels::{Backend, Kernels, SimHasher};

fn normalise(v: &mut [f64]) {
    let n = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    v.iter_mut().for_each(|x| *x /= n);
}

/// A random pair of unit vectors at exactly angle `theta`.
fn pair(rng: &mut SplitMix64, dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let mut a: Vec<f64> = (0..dim).map(|_| rng.next_gaussian()).collect();
    normalise(&mut a);
    let mut b: Vec<f64> = (0..dim).map(|_| rng.next_gaussian()).collect();
    let d: f64 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    b.iter_mut().zip(&a).for_each(|(y, x)| *y -= d * x);
    normalise(&mut b);
    let c: Vec<f32> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (theta.cos() * x + theta.sin() * y) as f32)
        .collect();
    (a.iter().map(|&x| x as f32).collect(), c)
}

#[test]
fn collision_rate_is_one_minus_theta_over_pi() {
    let dim = 256;
    let hasher = SimHasher::new(2024, dim).unwrap();
    let backend = Backend::cpu();
    let mut rng = SplitMix64::new(1);
    let pairs = 200;
    for theta in [
        0.2,
        std::f64::consts::FRAC_PI_4,
        1.2,
        std::f64::consts::FRAC_PI_2,
        2.5,
    ] {
        let mut same = 0u64;
        for _ in 0..pairs {
            let (a, b) = pair(&mut rng, dim, theta);
            let ha = backend.simhash(&hasher, &a).unwrap();
            let hb = backend.simhash(&hasher, &b).unwrap();
            let diff: u32 = ha
                .bits
                .iter()
                .zip(&hb.bits)
                .map(|(x, y)| (x ^ y).count_ones())
                .sum();
            same += 256 - u64::from(diff);
        }
        let trials = (pairs * 256) as f64;
        let p = 1.0 - theta / std::f64::consts::PI;
        let observed = same as f64 / trials;
        let sigma = (p * (1.0 - p) / trials).sqrt();
        assert!(
            (observed - p).abs() < 5.0 * sigma,
            "θ={theta}: observed {observed:.4}, expected {p:.4} ± {sigma:.4}"
        );
    }
}

#[test]
fn margins_are_normalised_projection_magnitudes() {
    let hasher = SimHasher::new(3, 64).unwrap();
    let mut rng = SplitMix64::new(4);
    let v: Vec<f32> = (0..64).map(|_| rng.next_gaussian() as f32).collect();
    let a = hasher.hash(&v).unwrap();
    let scaled: Vec<f32> = v.iter().map(|x| x * 1000.0).collect();
    let b = hasher.hash(&scaled).unwrap();
    assert_eq!(a.bits, b.bits);
    for (x, y) in a.margins.iter().zip(&b.margins) {
        assert!(
            (x - y).abs() <= 1e-4 * x.max(1.0),
            "scale-invariant margins"
        );
    }
    // Gaussian hyperplanes: the margin |⟨g, v⟩|/‖v‖ is |N(0,1)|, mean √(2/π) ≈ 0.80.
    let mean: f32 = a.margins.iter().sum::<f32>() / 256.0;
    assert!((0.6..1.0).contains(&mean), "mean margin {mean}");
    let zero = hasher.hash(&[0.0; 64]).unwrap();
    assert!(zero.margins.iter().all(|&m| m == 0.0));
    // A different seed gives a different signature.
    let other = SimHasher::new(4, 64).unwrap().hash(&v).unwrap();
    assert_ne!(a.bits, other.bits);
}
