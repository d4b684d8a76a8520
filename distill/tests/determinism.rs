//! Distillation and decoding are deterministic across runs and rayon thread counts.

#![allow(clippy::unwrap_used)]

mod common;

use kindred_distill::{Distilled, Distiller, EmbeddingConfig, Policy, decode};
use kindred_proto::{DType, LayerSpec, ModelSpec};

fn run(spec: &ModelSpec, rounds: u64) -> (Vec<Distilled>, Vec<u32>) {
    let n = spec.numel() as usize;
    let mut d =
        Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default()).unwrap();
    d.accept_peer(&common::update(n, 999)).unwrap();
    let outs: Vec<Distilled> = (0..rounds)
        .map(|r| d.distill(&common::update(n, r)).unwrap())
        .collect();
    let decoded = decode(&outs[outs.len() - 1].body, spec).unwrap();
    (outs, decoded.iter().map(|v| v.to_bits()).collect())
}

#[test]
fn same_bits_across_runs_and_thread_counts() {
    // Large enough (600k) for the kernels to go parallel.
    let spec = ModelSpec::new(vec![
        LayerSpec::new("big", [1000, 600], DType::F32),
        LayerSpec::new("bias", [1000], DType::F32),
    ])
    .unwrap();
    let reference = run(&spec, 3);
    assert_eq!(reference, run(&spec, 3));
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| run(&spec, 3));
        assert!(got == reference, "{threads} threads differ");
    }
}
