//! The benchmark fixture shared by `benches/packet.rs` and `examples/proto_bench.rs`: a
//! 1,068,810-parameter MLP (784-1024-256-10) update at 1% top-k density (the distillation
//! default was 1% when the figures in BENCHMARKS.md were taken; it is 2% now) — weights as top-k
//! + int8, biases dense f16 — sealed with a fixed key.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use half::f16;
use kindred_proto::*;
use libp2p_identity::ed25519;
use rand::{Rng, SeedableRng, rngs::StdRng};

/// Fraction of weight entries kept.
pub const DENSITY: f64 = 0.01;

/// The 784-1024-256-10 MLP.
pub fn spec() -> ModelSpec {
    ModelSpec::new(vec![
        LayerSpec::new("fc1.weight", [1024, 784], DType::F32),
        LayerSpec::new("fc1.bias", [1024], DType::F32),
        LayerSpec::new("fc2.weight", [256, 1024], DType::F32),
        LayerSpec::new("fc2.bias", [256], DType::F32),
        LayerSpec::new("fc3.weight", [10, 256], DType::F32),
        LayerSpec::new("fc3.bias", [10], DType::F32),
    ])
    .unwrap()
}

/// A body at the default density; `seed` picks the entries.
pub fn body(seed: u64) -> PacketBody {
    let mut rng = StdRng::seed_from_u64(seed);
    let layers = spec()
        .layers()
        .iter()
        .map(|l| {
            let n = l.numel() as u32;
            if l.is_1d() {
                let v = (0..n)
                    .map(|_| f16::from_f32(rng.random_range(-0.1..0.1)))
                    .collect();
                LayerPayload::Dense(DenseValues::F16(v))
            } else {
                let k = ((f64::from(n) * DENSITY).ceil() as usize).max(1);
                let mut idx: Vec<u32> = rand::seq::index::sample(&mut rng, n as usize, k)
                    .into_iter()
                    .map(|i| i as u32)
                    .collect();
                idx.sort_unstable();
                let values = (0..k).map(|_| rng.random_range(-127i8..=127)).collect();
                LayerPayload::TopK(TopK {
                    len: n,
                    indices: idx,
                    values,
                    scale: 1e-3,
                })
            }
        })
        .collect();
    PacketBody { layers }
}

/// The fixed signing key.
pub fn key() -> ed25519::Keypair {
    ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([5u8; 32]).unwrap())
}

/// Header fields for `round`.
pub fn fields(round: u64) -> HeaderFields {
    let mut rng = StdRng::seed_from_u64(round);
    HeaderFields {
        round,
        unix_ms: 1_700_000_000_000 + round,
        samples: 600,
        loss: 0.25,
        embedding: Embedding {
            simhash: SimHash(rng.random()),
            sketch: (0..256).map(|_| rng.random()).collect(),
            sketch_scale: 0.01,
        },
    }
}

/// A sealed packet for `round`.
pub fn sealed(round: u64) -> SealedPacket {
    seal(&key(), &spec(), fields(round), &body(round)).unwrap()
}
