//! Shared helpers: a small multi-layer spec and gradient-like updates.

#![allow(dead_code, unreachable_pub)]

use kindred_kernels::rng::SplitMix64;
use kindred_proto::{DType, LayerSpec, ModelSpec};

/// A model with every kind of layer the policy distinguishes: two large matrices, a bias, a
/// small matrix.
pub fn spec() -> ModelSpec {
    ModelSpec::new(vec![
        LayerSpec::new("fc1.weight", [256, 300], DType::F32),
        LayerSpec::new("fc1.bias", [256], DType::F32),
        LayerSpec::new("fc2.weight", [64, 256], DType::F32),
        LayerSpec::new("fc2.bias", [64], DType::F32),
        LayerSpec::new("head.weight", [10, 64], DType::F32),
    ])
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Heavy-tailed values around a direction: `base * 1 + noise * eps`.
pub fn update(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let g = rng.next_gaussian();
            let s = (rng.next_f64() * 6.0 - 3.0).exp2();
            (g * s * 1e-2) as f32
        })
        .collect()
}

/// `a + eps * b`.
pub fn mix(a: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + eps * y).collect()
}
