//! Shared fixtures for the proto tests: a fixed spec, deterministic keys, a body using every
//! payload kind.
#![allow(clippy::unwrap_used)]
#![allow(dead_code, unreachable_pub)]

use half::{bf16, f16};
use kindred_proto::*;
use libp2p_identity::ed25519;

/// Deterministic ed25519 key number `n`.
pub fn key(n: u8) -> ed25519::Keypair {
    ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([n; 32]).unwrap())
}

/// A four-layer spec exercising every payload kind.
pub fn spec() -> ModelSpec {
    ModelSpec::new(vec![
        LayerSpec::new("conv.weight", [4, 1, 3, 3], DType::F32),
        LayerSpec::new("conv.bias", [4], DType::F32),
        LayerSpec::new("fc.weight", [10, 20], DType::F32),
        LayerSpec::new("fc.bias", [10], DType::BF16),
    ])
    .unwrap()
}

/// A valid body for [`spec`]: sign, dense f16, top-k, dense bf16.
pub fn body() -> PacketBody {
    PacketBody {
        layers: vec![
            LayerPayload::Sign(SignBits {
                len: 36,
                words: vec![0x0000_000a_5a5a_f00f],
                scale: 0.125,
            }),
            LayerPayload::Dense(DenseValues::F16(
                [0.5f32, -1.0, 0.0, 2.0]
                    .iter()
                    .map(|&x| f16::from_f32(x))
                    .collect(),
            )),
            LayerPayload::TopK(TopK {
                len: 200,
                indices: vec![0, 7, 8, 130, 199],
                values: vec![127, -127, 3, -1, 64],
                scale: 0.001,
            }),
            LayerPayload::Dense(DenseValues::BF16(
                (0..10).map(|i| bf16::from_f32(i as f32 * 0.1)).collect(),
            )),
        ],
    }
}

pub fn embedding() -> Embedding {
    let mut simhash = [0u8; 32];
    for (i, b) in simhash.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37);
    }
    Embedding {
        simhash: SimHash(simhash),
        sketch: (0..16).map(|i| (i * 8 - 64) as i8).collect(),
        sketch_scale: 0.02,
    }
}

pub fn fields() -> HeaderFields {
    HeaderFields {
        round: 42,
        unix_ms: 1_700_000_000_000,
        samples: 600,
        loss: 0.3125,
        embedding: embedding(),
    }
}

/// A sealed, valid packet.
pub fn sealed() -> SealedPacket {
    seal(&key(1), &spec(), fields(), &body()).unwrap()
}

/// Re-sign a header for `body_bytes` (length and hash updated) with `signer`, without any
/// validation: how a buggy or hostile peer would produce a packet.
pub fn forge(mut header: PacketHeader, body_bytes: &[u8], signer: &ed25519::Keypair) -> Vec<u8> {
    header.body_len = body_bytes.len() as u32;
    header.body_hash = *blake3::hash(body_bytes).as_bytes();
    encode_header(&header, signer)
}
