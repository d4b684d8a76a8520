//! Bad inputs give typed errors and leave state untouched; no input slice panics a kernel.

#![allow(clippy::unwrap_used)]

mod common;

use common::{backends, gaussian};
use kindred_kernels::{
    AccumulateError, Backend, CountSketch, DequantizeError, Kernels, QuantizeError, Rounding,
    SignPackError, SignUnpackError, SimHashError, SimHasher, SketchError, TopKError,
};
use proptest::prelude::*;

const BAD: [f32; 3] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY];

#[test]
fn non_finite_inputs_are_reported_with_their_index() {
    for backend in backends() {
        for n in [1usize, 7, 4096, 300_001] {
            for bad in BAD {
                let at = n / 2;
                let mut x = gaussian(n, n as u64);
                x[at] = bad;

                let mut residual = gaussian(n, 1);
                let before = residual.clone();
                match backend.accumulate(&mut residual, &x) {
                    Err(AccumulateError::NonFinite { index, .. }) => assert_eq!(index, at),
                    other => panic!("accumulate: {other:?}"),
                }
                assert_eq!(residual, before, "accumulate must not write on error");
                assert!(matches!(
                    backend.stats(&x),
                    Err(AccumulateError::NonFinite { index, .. }) if index == at
                ));

                for sampled in [false, true] {
                    let mut r = x.clone();
                    let k = (n / 100).max(1);
                    let res = if sampled {
                        backend.topk_sampled(&mut r, k, 1)
                    } else {
                        backend.topk_exact(&mut r, k)
                    };
                    assert!(
                        matches!(res, Err(TopKError::NonFinite { index, .. }) if index == at),
                        "topk sampled={sampled}: {res:?}"
                    );
                    assert_eq!(r.len(), x.len());
                    assert!(r.iter().zip(&x).all(|(a, b)| a.to_bits() == b.to_bits()));
                }

                let mut q = vec![0i8; n];
                assert!(matches!(
                    backend.quantize_i8(&x, Rounding::Nearest, &mut q),
                    Err(QuantizeError::NonFinite { index, .. }) if index == at
                ));
                let mut words = vec![0u64; n.div_ceil(64)];
                assert!(matches!(
                    backend.sign_pack(&x, &mut words),
                    Err(SignPackError::NonFinite { index, .. }) if index == at
                ));
                let sketch = CountSketch {
                    seed: 1,
                    buckets: 256,
                };
                let mut out = vec![0f32; 256];
                assert!(matches!(
                    backend.count_sketch(&sketch, &x, None, 0, &mut out),
                    Err(SketchError::NonFinite { index, .. }) if index == at
                ));
                assert!(out.iter().all(|&v| v == 0.0), "sketch output untouched");
            }
        }
    }
}

#[test]
fn overflowing_sum_is_reported() {
    let backend = Backend::cpu();
    let mut residual = vec![f32::MAX, 1.0];
    let err = backend
        .accumulate(&mut residual, &[f32::MAX, 1.0])
        .unwrap_err();
    assert_eq!(err, AccumulateError::Overflow { index: 0 });
}

#[test]
fn shape_errors_are_typed() {
    let b = Backend::cpu();
    assert_eq!(
        b.accumulate(&mut [0.0; 3], &[0.0; 4]).unwrap_err(),
        AccumulateError::LengthMismatch {
            residual: 3,
            update: 4
        }
    );
    assert_eq!(
        b.topk_exact(&mut [0.0; 3], 4).unwrap_err(),
        TopKError::KOutOfRange { k: 4, len: 3 }
    );
    assert_eq!(
        b.topk_sampled(&mut [], 1, 0).unwrap_err(),
        TopKError::KOutOfRange { k: 1, len: 0 }
    );
    assert!(matches!(
        b.quantize_i8(&[1.0; 3], Rounding::Nearest, &mut [0; 2]),
        Err(QuantizeError::LengthMismatch {
            input: 3,
            output: 2
        })
    ));
    assert!(matches!(
        b.dequantize_i8(&[1; 3], f32::NAN, &mut [0.0; 3]),
        Err(DequantizeError::BadScale { .. })
    ));
    assert!(matches!(
        b.dequantize_i8(&[1; 3], -1.0, &mut [0.0; 3]),
        Err(DequantizeError::BadScale { .. })
    ));
    assert!(matches!(
        b.sign_pack(&[1.0; 65], &mut [0; 1]),
        Err(SignPackError::WordCount {
            len: 65,
            expected: 2,
            found: 1
        })
    ));
    assert!(matches!(
        b.sign_unpack(&[1 << 5], 1.0, &mut [0.0; 5]),
        Err(SignUnpackError::Padding { len: 5 })
    ));
    assert!(matches!(
        b.sign_unpack(&[0, 0], 1.0, &mut [0.0; 5]),
        Err(SignUnpackError::WordCount { .. })
    ));
    assert!(matches!(
        b.sign_unpack(&[0], f32::INFINITY, &mut [0.0; 5]),
        Err(SignUnpackError::BadScale { .. })
    ));
    let zero = CountSketch {
        seed: 0,
        buckets: 0,
    };
    assert_eq!(
        b.count_sketch(&zero, &[1.0], None, 0, &mut []),
        Err(SketchError::ZeroBuckets)
    );
    let s = CountSketch {
        seed: 0,
        buckets: 4,
    };
    assert!(matches!(
        b.count_sketch(&s, &[1.0], None, 0, &mut [0.0; 3]),
        Err(SketchError::OutputLength { .. })
    ));
    assert!(matches!(
        b.count_sketch(&s, &[1.0], Some(&[1.0, 2.0]), 0, &mut [0.0; 4]),
        Err(SketchError::CenterLength { .. })
    ));
    assert_eq!(
        b.count_sketch(&s, &[1.0, 2.0], None, u64::MAX, &mut [0.0; 4]),
        Err(SketchError::IndexOverflow)
    );
    assert!(matches!(
        SimHasher::new(1, 0),
        Err(SimHashError::DimOutOfRange { .. })
    ));
    let h = SimHasher::new(1, 4).unwrap();
    assert!(matches!(
        b.simhash(&h, &[1.0; 3]),
        Err(SimHashError::LengthMismatch { .. })
    ));
    assert!(matches!(
        b.simhash(&h, &[1.0, f32::NAN, 0.0, 0.0]),
        Err(SimHashError::NonFinite { index: 1, .. })
    ));
}

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        4 => -10.0f32..10.0,
        1 => any::<f32>(),
        1 => Just(0.0f32),
        1 => Just(-0.0f32),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Arbitrary bit patterns, lengths and parameters: every kernel returns, none panics.
    #[test]
    fn no_kernel_panics(
        x in proptest::collection::vec(any_f32(), 0..300),
        y in proptest::collection::vec(any_f32(), 0..300),
        k in 0usize..400,
        words in proptest::collection::vec(any::<u64>(), 0..6),
        scale in any::<f32>(),
        buckets in 0usize..130,
        first in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let b = Backend::cpu();
        let mut r = y.clone();
        let _ = b.accumulate(&mut r, &x);
        let _ = b.stats(&x);
        let mut r = x.clone();
        let _ = b.topk_exact(&mut r, k);
        let mut r = x.clone();
        let _ = b.topk_sampled(&mut r, k, seed);
        let mut q = vec![0i8; x.len()];
        let _ = b.quantize_i8(&x, Rounding::Nearest, &mut q);
        let _ = b.quantize_i8(&x, Rounding::Stochastic { seed }, &mut q);
        let mut out = vec![0f32; q.len()];
        let _ = b.dequantize_i8(&q, scale, &mut out);
        let mut w = words.clone();
        let _ = b.sign_pack(&x, &mut w);
        let mut out = vec![0f32; y.len()];
        let _ = b.sign_unpack(&words, scale, &mut out);
        let s = CountSketch { seed, buckets };
        let mut out = vec![0f32; buckets];
        let _ = b.count_sketch(&s, &x, Some(&y), first, &mut out);
        let _ = b.count_sketch(&s, &x, None, first % 1000, &mut out);
        if let Ok(h) = SimHasher::new(seed, x.len()) {
            let _ = b.simhash(&h, &x);
            let _ = b.simhash(&h, &y);
        }
    }
}

#[test]
fn quantizing_near_f32_max_stays_finite() {
    let b = Backend::cpu();
    let x = [f32::MAX, -f32::MAX, 1.0, 3.0e38];
    let mut q = [0i8; 4];
    let scale = b.quantize_i8(&x, Rounding::Nearest, &mut q).unwrap();
    let mut back = [0f32; 4];
    b.dequantize_i8(&q, scale, &mut back).unwrap();
    assert!(back.iter().all(|v| v.is_finite()), "{back:?}");
    assert_eq!(q[..2], [127, -127]);
}
