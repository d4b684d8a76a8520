//! Shared helpers for the kernel tests: fresh random inputs and the backends every test runs on.

#![allow(dead_code, unreachable_pub)]

use kindred_kernels::Backend;
use kindred_kernels::rng::SplitMix64;

/// Sizes every kernel is checked at: empty, tiny, odd, around chunk and word boundaries, 1M.
pub const SIZES: &[usize] = &[0, 1, 7, 63, 64, 65, 1000, 4096, 16_385, 65_537, 1 << 20];

/// Every backend available in this build and on this host (candle's `test_device!` idea):
/// kernels must agree on all of them. With the `cuda` feature and a usable GPU that includes the
/// CUDA backend; `KINDRED_REQUIRE_GPU` makes its absence an error, so a GPU run cannot pass on the
/// CPU alone.
pub fn backends() -> Vec<Backend> {
    #[allow(unused_mut)]
    let mut all = vec![Backend::cpu(), Backend::cpu_single_threaded()];
    #[cfg(feature = "cuda")]
    match kindred_kernels::CudaBackend::new(0) {
        Ok(gpu) => all.push(Backend::Cuda(gpu)),
        Err(e) => assert!(
            std::env::var_os("KINDRED_REQUIRE_GPU").is_none(),
            "KINDRED_REQUIRE_GPU is set but the CUDA backend is unusable: {e}"
        ),
    }
    all
}

/// `n` Gaussian values with a spread of scales, from `seed`.
pub fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_gaussian() as f32).collect()
}

/// Heavy-tailed values (Gaussian times a log-uniform scale), like real gradients.
pub fn heavy(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let g = rng.next_gaussian();
            let s = (rng.next_f64() * 8.0 - 6.0).exp2();
            (g * s) as f32
        })
        .collect()
}

/// Small integers: lots of exact ties.
pub fn ties(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.below(9) as f32 - 4.0).collect()
}
