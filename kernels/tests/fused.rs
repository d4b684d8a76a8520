//! The fused pass equals the separate kernels it replaces.

#![allow(clippy::unwrap_used)]

mod common;

use common::{SIZES, backends, gaussian, heavy};
use kindred_kernels::{
    AccumulateError, Backend, Candidates, CountSketch, Kernels, SelectMethod, SketchInto,
};

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn fused_pass_matches_separate_kernels() {
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            for &(first, centred) in &[(0u64, false), (37, true), (4096 + 5, false)] {
                let update = heavy(n, 40 + s as u64);
                let residual = gaussian(n, 50 + s as u64);
                let center = gaussian(n, 60 + s as u64);
                let center = centred.then_some(center.as_slice());
                let sketch = CountSketch {
                    seed: 3,
                    buckets: 512,
                };
                let k = n / 100;
                let threshold = backend.sample_threshold(&residual, &update, k, 9);

                let mut fused_r = residual.clone();
                let mut fused_sketch = vec![0f32; 512];
                let fused = backend
                    .accumulate_fused(
                        &mut fused_r,
                        &update,
                        Some(SketchInto {
                            sketch: &sketch,
                            center,
                            first_index: first,
                            out: &mut fused_sketch,
                        }),
                        threshold,
                    )
                    .unwrap();

                let mut r = residual.clone();
                let stats = backend.accumulate(&mut r, &update).unwrap();
                assert_eq!(fused_r, r, "n={n}");
                assert_eq!(fused.stats.len, n);
                assert_eq!(fused.stats.abs_max, stats.abs_max);
                assert!(close(f64::from(fused.stats.mean), f64::from(stats.mean)));
                assert!(close(f64::from(fused.stats.l2), f64::from(stats.l2)));
                let mut sk = vec![0f32; 512];
                let sum_sq = backend
                    .count_sketch(&sketch, &update, center, first, &mut sk)
                    .unwrap();
                if backend.name() == "cpu" {
                    assert_eq!(fused_sketch, sk, "sketch bits, n={n} first={first}");
                    assert_eq!(fused.sketch_sum_sq.to_bits(), sum_sq.to_bits());
                } else {
                    // The device adds into buckets with atomics: equal up to the order of
                    // float additions (the documented contract of `count_sketch_on_device`).
                    let scale = sk.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                    for (a, b) in fused_sketch.iter().zip(&sk) {
                        assert!((a - b).abs() <= 1e-4 * scale, "sketch, n={n} first={first}");
                    }
                    assert!(close(fused.sketch_sum_sq, sum_sq), "sum of squares, n={n}");
                }
                match threshold {
                    Some(t) => {
                        let expected: Vec<u32> = (0..n as u32)
                            .filter(|&i| r[i as usize].abs() >= t)
                            .collect();
                        assert_eq!(fused.candidates.indices, expected, "n={n}");
                        let values: Vec<f32> = expected.iter().map(|&i| r[i as usize]).collect();
                        assert_eq!(fused.candidates.values, values);
                        let mut a = r.clone();
                        let sel = backend
                            .topk_candidates(&mut a, fused.candidates.clone(), k)
                            .unwrap();
                        let mut b = r.clone();
                        let exact = backend.topk_exact(&mut b, k).unwrap();
                        assert_eq!(sel.indices, exact.indices);
                        assert_eq!(sel.values, exact.values);
                        assert!(matches!(sel.method, SelectMethod::Sampled { .. }));
                        // The selected entries left for the caller (as they were, or zeroed),
                        // every other one untouched.
                        for &i in &sel.indices {
                            let i = i as usize;
                            assert!(a[i] == r[i] || a[i] == 0.0, "n={n} i={i}");
                            a[i] = 0.0;
                        }
                        assert_eq!(a, b);
                    }
                    None => assert!(fused.candidates.is_empty()),
                }
            }
        }
    }
}

#[test]
fn too_few_candidates_fall_back_to_exact() {
    let backend = Backend::cpu();
    let x = heavy(100_000, 1);
    let mut a = x.clone();
    let few = Candidates {
        indices: vec![5, 9],
        values: vec![x[5], x[9]],
    };
    let sel = backend.topk_candidates(&mut a, few, 100).unwrap();
    assert_eq!(sel.method, SelectMethod::SampledFellBack);
    let mut b = x.clone();
    assert_eq!(
        sel.indices,
        backend.topk_exact(&mut b, 100).unwrap().indices
    );
}

#[test]
fn fused_errors_are_typed() {
    let backend = Backend::cpu();
    let sketch = CountSketch {
        seed: 1,
        buckets: 8,
    };
    let mut r = vec![1.0f32; 100];
    let mut u = vec![0.5f32; 100];
    u[42] = f32::NAN;
    let mut out = vec![0f32; 8];
    let res = backend.accumulate_fused(
        &mut r,
        &u,
        Some(SketchInto {
            sketch: &sketch,
            center: None,
            first_index: 0,
            out: &mut out,
        }),
        None,
    );
    assert!(matches!(
        res,
        Err(AccumulateError::NonFinite { index: 42, .. })
    ));
    assert!(out.iter().all(|&v| v == 0.0), "sketch output untouched");
    // Callers that must keep the residual validate first.
    let (index, value) = backend.find_non_finite(&u).unwrap();
    assert!(index == 42 && value.is_nan());
    // The fused pass does not pre-scan: the residual was written (documented).
    assert!(r[42].is_nan());
    r.fill(1.0);
    u[42] = 0.5;
    let mut short = vec![0f32; 7];
    let res = backend.accumulate_fused(
        &mut r,
        &u,
        Some(SketchInto {
            sketch: &sketch,
            center: None,
            first_index: 0,
            out: &mut short,
        }),
        None,
    );
    assert_eq!(res, Err(AccumulateError::SketchShape));
    let mut c = vec![0f32; 100];
    c[3] = f32::INFINITY;
    let res = backend.accumulate_fused(
        &mut r,
        &u,
        Some(SketchInto {
            sketch: &sketch,
            center: Some(&c),
            first_index: 0,
            out: &mut out,
        }),
        None,
    );
    assert_eq!(res, Err(AccumulateError::NonFiniteCenter { index: 3 }));
    assert_eq!(
        backend.accumulate_fused(&mut r[..5], &u, None, None),
        Err(AccumulateError::LengthMismatch {
            residual: 5,
            update: 100
        })
    );
    assert!(
        backend.sample_threshold(&r, &u, 1, 0).is_none(),
        "too short to sample"
    );
}

/// A residual held in bf16 goes through the same f32 arithmetic as its widened copy: the same
/// statistics, candidates, sampled threshold and selection, and the new residual is the f32
/// result rounded to nearest.
#[test]
fn a_bf16_residual_is_its_widened_copy_rounded_after_the_same_pass() {
    use half::bf16;
    use kindred_kernels::{narrow_bf16, widen_bf16};
    for backend in backends() {
        for (s, &n) in SIZES.iter().enumerate() {
            let update = heavy(n, 70 + s as u64);
            let mut narrow = vec![bf16::ZERO; n];
            narrow_bf16(&gaussian(n, 80 + s as u64), &mut narrow);
            let mut wide = vec![0f32; n];
            widen_bf16(&narrow, &mut wide);
            let k = n / 100;
            let threshold = backend.sample_threshold(&wide, &update, k, 9);
            assert_eq!(
                backend.sample_threshold_bf16(&narrow, &update, k, 9),
                threshold,
                "n={n}"
            );

            let fused = backend
                .accumulate_fused(&mut wide, &update, None, threshold)
                .unwrap();
            let fused16 = backend
                .accumulate_fused_bf16(&mut narrow, &update, threshold)
                .unwrap();
            assert_eq!(fused16.stats, fused.stats, "n={n}");
            assert_eq!(fused16.candidates, fused.candidates, "n={n}");
            let mut rounded = vec![bf16::ZERO; n];
            narrow_bf16(&wide, &mut rounded);
            assert_eq!(narrow, rounded, "n={n}");

            if threshold.is_some() {
                let sel16 = backend
                    .topk_candidates_bf16(&narrow, fused16.candidates, k)
                    .unwrap();
                let sel = backend
                    .topk_candidates(&mut wide, fused.candidates, k)
                    .unwrap();
                assert_eq!(sel16.indices, sel.indices, "n={n}");
                assert_eq!(sel16.values, sel.values, "n={n}");
                // Too few candidates: the exact top-k of the widened residual, which is left
                // as it was.
                let before = narrow.clone();
                let few = backend
                    .topk_candidates_bf16(&narrow, Candidates::default(), k)
                    .unwrap();
                widen_bf16(&narrow, &mut wide);
                let exact = backend.topk_exact(&mut wide, k).unwrap();
                assert_eq!(few.indices, exact.indices, "n={n}");
                assert_eq!(narrow, before);
            }
        }
    }
}
