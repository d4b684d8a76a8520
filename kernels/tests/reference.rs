//! Every kernel against a naive reference on fresh random inputs over many sizes.

#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

mod common;

use common::{SIZES, backends, gaussian, heavy, ties};
use kindred_kernels::{CountSketch, Kernels, Rounding, SelectMethod};

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn accumulate_matches_naive() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            let update = heavy(n, 10 + s as u64);
            let mut residual = gaussian(n, 20 + s as u64);
            let expected: Vec<f32> = residual.iter().zip(&update).map(|(r, u)| r + u).collect();
            let stats = backend.accumulate(&mut residual, &update).unwrap();
            assert_eq!(residual, expected, "n={n}");
            let sum: f64 = expected.iter().map(|&v| f64::from(v)).sum();
            let sq: f64 = expected.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
            let max = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(stats.len, n);
            assert_eq!(stats.abs_max, max);
            if n > 0 {
                let mean = sum / n as f64;
                assert!(close(f64::from(stats.mean), mean, 1e-5), "mean n={n}");
                assert!(
                    close(f64::from(stats.variance), sq / n as f64 - mean * mean, 1e-5),
                    "var n={n}"
                );
                assert!(close(f64::from(stats.l2), sq.sqrt(), 1e-5), "l2 n={n}");
            }
            let again = backend.stats(&expected).unwrap();
            assert_eq!(again, stats, "stats() and accumulate() agree, n={n}");
        }
    }
}

/// The unique top-k: by magnitude, ties towards the lower index, returned in index order.
fn naive_topk(x: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..x.len() as u32).collect();
    order.sort_by(|&a, &b| {
        x[b as usize]
            .abs()
            .total_cmp(&x[a as usize].abs())
            .then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable();
    order
}

#[test]
fn topk_matches_naive_for_both_methods() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            for (d, data) in [heavy(n, s as u64), ties(n, 100 + s as u64)]
                .into_iter()
                .enumerate()
            {
                let ks = [0, 1, n / 100, n / 7, n];
                for &k in &ks {
                    if k > n {
                        continue;
                    }
                    let expected = naive_topk(&data, k);
                    for sampled in [false, true] {
                        let mut residual = data.clone();
                        let sel = if sampled {
                            backend.topk_sampled(&mut residual, k, 7).unwrap()
                        } else {
                            backend.topk_exact(&mut residual, k).unwrap()
                        };
                        let ctx = format!("n={n} k={k} data={d} sampled={sampled}");
                        assert_eq!(sel.indices, expected, "{ctx}");
                        let values: Vec<f32> = expected.iter().map(|&i| data[i as usize]).collect();
                        assert_eq!(sel.values, values, "{ctx}");
                        let min = values.iter().fold(f32::INFINITY, |m, v| m.min(v.abs()));
                        assert_eq!(sel.threshold, if k == 0 { 0.0 } else { min }, "{ctx}");
                        let mut zeroed = data.clone();
                        for &i in &expected {
                            zeroed[i as usize] = 0.0;
                        }
                        assert_eq!(residual, zeroed, "{ctx}");
                    }
                }
            }
        }
    }
}

#[test]
fn sampled_topk_samples_on_large_inputs() {
    let data = heavy(1 << 20, 5);
    let mut residual = data.clone();
    let k = data.len() / 100;
    let sel = kindred_kernels::Backend::cpu()
        .topk_sampled(&mut residual, k, 3)
        .unwrap();
    match sel.method {
        SelectMethod::Sampled { candidates } => {
            assert!(
                candidates >= k && candidates < 2 * k,
                "{candidates} for k={k}"
            );
        }
        other => panic!("expected the sampled path, got {other:?}"),
    }
}

fn naive_quantize(x: &[f32]) -> (Vec<i8>, f32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max == 0.0 {
        return (vec![0; x.len()], 0.0);
    }
    let inv = 127.0 / max;
    let q = x
        .iter()
        .map(|&v| (v * inv).clamp(-127.0, 127.0).round_ties_even() as i8)
        .collect();
    (q, max / 127.0)
}

#[test]
fn int8_nearest_matches_naive_and_round_trips() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            let x = heavy(n, 300 + s as u64);
            let (expected, expected_scale) = naive_quantize(&x);
            let mut q = vec![0i8; n];
            let scale = backend.quantize_i8(&x, Rounding::Nearest, &mut q).unwrap();
            assert_eq!(scale, expected_scale, "n={n}");
            assert_eq!(q, expected, "n={n}");
            let mut back = vec![0f32; n];
            backend.dequantize_i8(&q, scale, &mut back).unwrap();
            for (i, (&b, &v)) in back.iter().zip(&x).enumerate() {
                assert_eq!(b, f32::from(q[i]) * scale);
                assert!((b - v).abs() <= scale * 0.5 * (1.0 + 1e-5), "n={n} i={i}");
            }
        }
    }
}

#[test]
fn int8_stochastic_is_unbiased_and_brackets() {
    let backend = kindred_kernels::Backend::cpu();
    let n = 4096;
    let x = gaussian(n, 11);
    let mut q = vec![0i8; n];
    let mut mean = vec![0f64; n];
    let seeds = 400;
    let mut scale = 0.0;
    for seed in 0..seeds {
        scale = backend
            .quantize_i8(&x, Rounding::Stochastic { seed }, &mut q)
            .unwrap();
        for (i, (&qi, &v)) in q.iter().zip(&x).enumerate() {
            let y = v / scale;
            assert!(
                f32::from(qi) >= y.floor() - 1e-3 && f32::from(qi) <= y.ceil() + 1e-3,
                "q={qi} y={y}"
            );
            mean[i] += f64::from(qi) * f64::from(scale);
        }
    }
    // Averaged over seeds, the dequantised value converges to x (std of one draw ≤ scale/2).
    let tol = f64::from(scale) * 0.5 / f64::from(seeds as u32).sqrt() * 5.0;
    let bad = mean
        .iter()
        .zip(&x)
        .filter(|&(m, &v)| (m / f64::from(seeds as u32) - f64::from(v)).abs() > tol)
        .count();
    assert!(bad <= n / 1000, "{bad} of {n} outside 5 sigma");
    // Same seed, same output; different seed, different output.
    let mut a = vec![0i8; n];
    let mut b = vec![0i8; n];
    backend
        .quantize_i8(&x, Rounding::Stochastic { seed: 1 }, &mut a)
        .unwrap();
    backend
        .quantize_i8(&x, Rounding::Stochastic { seed: 1 }, &mut b)
        .unwrap();
    assert_eq!(a, b);
    backend
        .quantize_i8(&x, Rounding::Stochastic { seed: 2 }, &mut b)
        .unwrap();
    assert_ne!(a, b);
}

#[test]
fn sign_pack_matches_naive_and_round_trips() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            let mut x = gaussian(n, 500 + s as u64);
            if let Some(v) = x.first_mut() {
                *v = -0.0; // the sign bit, not the comparison, decides
            }
            let mut words = vec![0u64; n.div_ceil(64)];
            let scale = backend.sign_pack(&x, &mut words).unwrap();
            let mut expected = vec![0u64; n.div_ceil(64)];
            for (i, v) in x.iter().enumerate() {
                if v.is_sign_negative() {
                    expected[i / 64] |= 1 << (i % 64);
                }
            }
            assert_eq!(words, expected, "n={n}");
            let mean_abs = x.iter().map(|v| f64::from(v.abs())).sum::<f64>() / n.max(1) as f64;
            assert!(close(f64::from(scale), mean_abs, 1e-5), "n={n}");
            let mut back = vec![0f32; n];
            backend.sign_unpack(&words, scale, &mut back).unwrap();
            for (b, v) in back.iter().zip(&x) {
                assert_eq!(b.abs(), scale);
                assert_eq!(b.is_sign_negative(), v.is_sign_negative());
            }
        }
    }
}

fn naive_sketch(s: &CountSketch, x: &[f32], c: Option<&[f32]>, first: u64) -> (Vec<f64>, f64) {
    let mut out = vec![0f64; s.buckets];
    let mut sq = 0.0;
    for (i, &v) in x.iter().enumerate() {
        let v = f64::from(v - c.map_or(0.0, |c| c[i]));
        sq += v * v;
        let (b, neg) = s.locate(first + i as u64).unwrap();
        out[b] += if neg { -v } else { v };
    }
    (out, sq)
}

#[test]
fn count_sketch_matches_naive() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            for &(buckets, first) in &[(1024usize, 0u64), (100, 37), (1, 5), (64, 64)] {
                let sketch = CountSketch {
                    seed: 99 + s as u64,
                    buckets,
                };
                let x = heavy(n, 700 + s as u64);
                let c = gaussian(n, 800 + s as u64);
                for center in [None, Some(c.as_slice())] {
                    let mut out = vec![0f32; buckets];
                    let sq = backend
                        .count_sketch(&sketch, &x, center, first, &mut out)
                        .unwrap();
                    let (expected, expected_sq) = naive_sketch(&sketch, &x, center, first);
                    let mass: f64 = x.iter().map(|v| f64::from(v.abs()) + 3.0).sum::<f64>();
                    let tol = 1e-6 * mass + 1e-6;
                    for (o, e) in out.iter().zip(&expected) {
                        assert!((f64::from(*o) - e).abs() <= tol, "n={n} D={buckets}");
                    }
                    assert!(close(sq, expected_sq, 1e-5), "n={n}");
                }
            }
        }
    }
}

#[test]
fn count_sketch_in_pieces_equals_whole_and_preserves_inner_products() {
    let backend = kindred_kernels::Backend::cpu();
    let sketch = CountSketch {
        seed: 5,
        buckets: 1024,
    };
    let x = gaussian(100_003, 1);
    let mut whole = vec![0f32; 1024];
    backend
        .count_sketch(&sketch, &x, None, 0, &mut whole)
        .unwrap();
    let mut pieces = vec![0f32; 1024];
    let (a, b) = x.split_at(40_001);
    backend
        .count_sketch(&sketch, a, None, 0, &mut pieces)
        .unwrap();
    backend
        .count_sketch(&sketch, b, None, 40_001, &mut pieces)
        .unwrap();
    for (w, p) in whole.iter().zip(&pieces) {
        assert!((w - p).abs() < 1e-3, "{w} vs {p}");
    }
    // ⟨S x, S y⟩ estimates ⟨x, y⟩: y = x + noise has cosine ≈ 0.7 with x.
    let noise = gaussian(100_003, 2);
    let y: Vec<f32> = x.iter().zip(&noise).map(|(a, b)| a + b).collect();
    let mut sy = vec![0f32; 1024];
    backend.count_sketch(&sketch, &y, None, 0, &mut sy).unwrap();
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(x * y)).sum::<f64>();
    let cos_true = dot(&x, &y) / (dot(&x, &x) * dot(&y, &y)).sqrt();
    let cos_sketch = dot(&whole, &sy) / (dot(&whole, &whole) * dot(&sy, &sy)).sqrt();
    assert!(
        (cos_true - cos_sketch).abs() < 0.06,
        "{cos_true} vs {cos_sketch}"
    );
}
