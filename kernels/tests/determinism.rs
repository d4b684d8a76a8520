//! Results are bit-identical across runs and rayon thread counts.

#![allow(clippy::unwrap_used)]

mod common;

use common::{gaussian, heavy};
use kindred_kernels::{Backend, CountSketch, Kernels, Rounding, SimHasher};

/// Everything every kernel outputs for one input, as bits.
fn run_all(backend: &Backend, update: &[f32], residual: &[f32]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut r = residual.to_vec();
    let stats = backend.accumulate(&mut r, update).unwrap();
    out.extend(
        [stats.mean, stats.variance, stats.abs_max, stats.l2]
            .iter()
            .map(|v| u64::from(v.to_bits())),
    );
    out.extend(r.iter().map(|v| u64::from(v.to_bits())));
    let k = r.len() / 100;
    for sampled in [false, true] {
        let mut rr = r.clone();
        let sel = if sampled {
            backend.topk_sampled(&mut rr, k, 9).unwrap()
        } else {
            backend.topk_exact(&mut rr, k).unwrap()
        };
        out.extend(sel.indices.iter().map(|&i| u64::from(i)));
        out.extend(sel.values.iter().map(|v| u64::from(v.to_bits())));
    }
    let mut q = vec![0i8; r.len()];
    for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 4 }] {
        let scale = backend.quantize_i8(&r, rounding, &mut q).unwrap();
        out.push(u64::from(scale.to_bits()));
        out.extend(q.iter().map(|&v| v as u8 as u64));
    }
    let mut words = vec![0u64; r.len().div_ceil(64)];
    let scale = backend.sign_pack(&r, &mut words).unwrap();
    out.push(u64::from(scale.to_bits()));
    out.extend(&words);
    let sketch = CountSketch {
        seed: 77,
        buckets: 1024,
    };
    let mut s = vec![0f32; 1024];
    let sq = backend
        .count_sketch(&sketch, update, Some(residual), 3, &mut s)
        .unwrap();
    out.push(sq.to_bits());
    out.extend(s.iter().map(|v| u64::from(v.to_bits())));
    let hasher = SimHasher::new(5, 1024).unwrap();
    let h = backend.simhash(&hasher, &s).unwrap();
    out.extend(h.bits.iter().map(|&b| u64::from(b)));
    out.extend(h.margins.iter().map(|v| u64::from(v.to_bits())));
    out
}

#[test]
fn identical_across_runs_and_thread_counts() {
    // Above the parallel threshold, with a ragged last chunk.
    let n = (1 << 20) + 12_345;
    let update = heavy(n, 1);
    let residual = gaussian(n, 2);
    let reference = run_all(&Backend::cpu_single_threaded(), &update, &residual);
    assert_eq!(
        reference,
        run_all(&Backend::cpu_single_threaded(), &update, &residual),
        "two sequential runs differ"
    );
    for threads in [1, 2, 3, 4] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| run_all(&Backend::cpu(), &update, &residual));
        assert!(got == reference, "{threads} threads differ from one");
    }
}

#[test]
fn a_tensor_quantised_in_pieces_is_the_tensor_quantised_whole() {
    // Pieces of uneven lengths, ragged against the 2^14 chunks (aligned ones for stochastic
    // rounding, whose stream is keyed by chunk).
    let x = heavy((1 << 18) + 777, 5);
    let abs_max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    for backend in common::backends() {
        for (rounding, cuts) in [
            (
                Rounding::Nearest,
                vec![0, 1, 5_000, 70_001, 200_000, x.len()],
            ),
            (
                Rounding::Stochastic { seed: 3 },
                vec![0, 1 << 14, 5 << 14, 12 << 14, x.len()],
            ),
        ] {
            let mut whole = vec![0i8; x.len()];
            let scale = backend.quantize_i8(&x, rounding, &mut whole).unwrap();
            let mut pieces = vec![0i8; x.len()];
            for w in cuts.windows(2) {
                let (a, b) = (w[0], w[1]);
                let s = backend
                    .quantize_i8_piece(&x[a..b], abs_max, a, rounding, &mut pieces[a..b])
                    .unwrap();
                assert_eq!(s.to_bits(), scale.to_bits(), "{}", backend.name());
            }
            assert!(whole == pieces, "{} {rounding:?}", backend.name());
        }
        // A piece whose own max is larger takes its own scale; a bad max is refused.
        let mut q = vec![0i8; 4];
        let s = backend
            .quantize_i8_piece(&[0.0, 2.54, -1.0, 0.5], 1.27, 8, Rounding::Nearest, &mut q)
            .unwrap();
        assert_eq!((s, q), (0.02, vec![0, 127, -50, 25]));
        assert!(
            backend
                .quantize_i8_piece(&[1.0], f32::NAN, 0, Rounding::Nearest, &mut [0])
                .is_err()
        );
    }
}
