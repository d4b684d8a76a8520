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

/// `with_backend` moves the embedding onto the backend too: a "single-threaded" distiller must
/// not sketch its update on rayon's pool (it did once, and one-core benchmarks counted two cores).
#[test]
fn the_backend_chosen_is_used_for_the_embedding_too() {
    use kindred_kernels::{Backend, Threading};
    let spec = common::spec();
    let d = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default())
        .unwrap()
        .with_backend(Backend::cpu_single_threaded());
    let single = |b: &Backend| matches!(b, Backend::Cpu(c) if c.threading() == Threading::Single);
    assert!(single(d.embedder().backend()));
    // Same results either way.
    let n = spec.numel() as usize;
    let mut a = Distiller::new(spec, Policy::default(), EmbeddingConfig::default()).unwrap();
    let mut b = d;
    let u = common::update(n, 3);
    assert_eq!(a.distill(&u).unwrap(), b.distill(&u).unwrap());
}
