//! Property tests: every payload kind survives seal → decode unchanged, and decoders never panic
//! on arbitrary or mutated bytes.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use half::{bf16, f16};
use kindred_proto::*;
use proptest::prelude::*;

/// A finite f32, as every sender must produce.
fn finite() -> impl Strategy<Value = f32> {
    prop::num::f32::NORMAL | prop::num::f32::ZERO | prop::num::f32::SUBNORMAL
}

fn dense(n: usize) -> impl Strategy<Value = LayerPayload> {
    prop_oneof![
        prop::collection::vec(finite(), n).prop_map(|v| LayerPayload::Dense(DenseValues::F32(v))),
        prop::collection::vec(-60000f32..60000.0, n).prop_map(|v| {
            LayerPayload::Dense(DenseValues::F16(v.into_iter().map(f16::from_f32).collect()))
        }),
        prop::collection::vec(-1e30f32..1e30, n).prop_map(|v| {
            LayerPayload::Dense(DenseValues::BF16(
                v.into_iter().map(bf16::from_f32).collect(),
            ))
        }),
        (prop::collection::vec(-127i8..=127, n), 0f32..10.0)
            .prop_map(|(values, scale)| LayerPayload::Dense(DenseValues::Int8 { values, scale })),
    ]
}

fn topk(n: usize) -> impl Strategy<Value = LayerPayload> {
    (
        prop::collection::btree_set(0..n as u32, 0..=n.min(300)),
        0f32..10.0,
    )
        .prop_flat_map(move |(set, scale)| {
            let k = set.len();
            prop::collection::vec(-127i8..=127, k).prop_map(move |values| {
                LayerPayload::TopK(TopK {
                    len: n as u32,
                    indices: set.iter().copied().collect(),
                    values,
                    scale,
                })
            })
        })
}

fn topk4(n: usize) -> impl Strategy<Value = LayerPayload> {
    (
        prop::collection::btree_set(0..n as u32, 0..=n.min(300)),
        0f32..10.0,
        prop::num::f32::POSITIVE.prop_filter("at most 1", |r| *r <= 1.0),
    )
        .prop_flat_map(move |(set, scale, ratio)| {
            let k = set.len();
            prop::collection::vec(0u8..16, k).prop_map(move |nibbles| {
                // Pack two codes a byte, the low nibble first; an odd count leaves a zero nibble.
                let codes = nibbles
                    .chunks(2)
                    .map(|c| c[0] | c.get(1).map_or(0, |h| h << 4))
                    .collect();
                LayerPayload::TopK4(TopK4 {
                    len: n as u32,
                    indices: set.iter().copied().collect(),
                    codes,
                    scale,
                    ratio,
                })
            })
        })
}

fn sign(n: usize) -> impl Strategy<Value = LayerPayload> {
    (
        prop::collection::vec(any::<u64>(), n.div_ceil(64)),
        0f32..10.0,
    )
        .prop_map(move |(mut words, scale)| {
            if !n.is_multiple_of(64)
                && let Some(last) = words.last_mut()
            {
                *last &= (1u64 << (n % 64)) - 1;
            }
            LayerPayload::Sign(SignBits {
                len: n as u32,
                words,
                scale,
            })
        })
}

fn payload(n: usize) -> BoxedStrategy<LayerPayload> {
    prop_oneof![dense(n), topk(n), topk4(n), sign(n)].boxed()
}

/// A random spec of 1..6 layers and a valid body for it.
fn spec_and_body() -> impl Strategy<Value = (ModelSpec, PacketBody)> {
    prop::collection::vec((1u32..70, 1u32..70), 1..6).prop_flat_map(|shapes| {
        let spec = ModelSpec::new(
            shapes
                .iter()
                .enumerate()
                .map(|(i, &(a, b))| LayerSpec::new(format!("l{i}"), [a, b], DType::F32))
                .collect(),
        )
        .unwrap();
        let layers: Vec<_> = shapes
            .iter()
            .map(|&(a, b)| payload((a * b) as usize))
            .collect();
        (Just(spec), layers).prop_map(|(spec, layers)| (spec, PacketBody { layers }))
    })
}

fn embedding() -> impl Strategy<Value = Embedding> {
    (
        any::<[u8; 32]>(),
        prop::collection::vec(any::<i8>(), 0..=MAX_SKETCH_LEN),
        0f32..1e6,
    )
        .prop_map(|(simhash, sketch, sketch_scale)| Embedding {
            simhash: SimHash(simhash),
            sketch,
            sketch_scale,
        })
}

/// A decode's verdict, its error as `Debug` shows it: errors carry floats (a NaN scale), which
/// `==` never finds equal to themselves.
fn verdict<T>(r: Result<T, DecodeError>) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| format!("{e:?}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn round_trip((spec, body) in spec_and_body(), embedding in embedding(), round: u64, samples in 0..=MAX_SAMPLES, loss in finite().prop_filter("within MAX_ABS_LOSS", |l| l.abs() <= MAX_ABS_LOSS), key_n in 1u8..255) {
        let fields = HeaderFields { round, unix_ms: round ^ 77, samples, loss, embedding };
        let sealed = seal(&key(key_n), &spec, fields.clone(), &body).unwrap();
        prop_assert!(sealed.header_bytes.len() <= MAX_HEADER_BYTES);

        let packet = OutcomePacket::decode(&sealed.header_bytes, &sealed.body_bytes, &spec).unwrap();
        let h = packet.header.header();
        prop_assert_eq!(h.round, fields.round);
        prop_assert_eq!(h.samples, fields.samples);
        prop_assert_eq!(h.loss.to_bits(), fields.loss.to_bits());
        prop_assert_eq!(&h.embedding, &fields.embedding);
        prop_assert_eq!(h.model, spec.id());
        prop_assert_eq!(h.sender, libp2p_identity::PublicKey::from(key(key_n).public()).to_peer_id());
        prop_assert_eq!(h.compression, CompressionSummary::of(&body));
        prop_assert_eq!(packet.id(), PacketId::of_header_bytes(&sealed.header_bytes));
        prop_assert_eq!(&packet.body, &body);
        // Encoding is deterministic: re-encoding the decoded body gives the same bytes.
        prop_assert_eq!(encode_body(&packet.body), sealed.body_bytes);
        // The computed sizes add up to the encoded body, layer by layer.
        for layer in &body.layers {
            let one = PacketBody { layers: vec![layer.clone()] };
            prop_assert_eq!(encode_body(&one).len(), 1 + encoded_layer_len(layer));
        }
    }

    #[test]
    fn snapshots_and_packets_never_verify_as_each_other((spec, body) in spec_and_body(), embedding in embedding(), round: u64, key_n in 1u8..255) {
        let fields = HeaderFields { round, unix_ms: 0, samples: 0, loss: 0.0, embedding };
        let snapshot = seal_snapshot(&key(key_n), &spec, fields.clone(), &body).unwrap();
        let decoded = OutcomePacket::decode_snapshot(&snapshot.header_bytes, &snapshot.body_bytes, &spec).unwrap();
        prop_assert_eq!(&decoded.body, &body);
        prop_assert_eq!(decoded.header.header().round, round);
        prop_assert_eq!(decode_header(&snapshot.header_bytes), Err(DecodeError::BadSignature));
        let packet = seal(&key(key_n), &spec, fields, &body).unwrap();
        prop_assert_eq!(decode_snapshot_header(&packet.header_bytes), Err(DecodeError::BadSignature));
        // Same fields, different domains: different bytes, different ids.
        prop_assert_ne!(packet.id(), snapshot.id());
    }

    #[test]
    fn header_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        let _ = decode_header(&bytes);
    }

    #[test]
    fn mutated_header_is_rejected(pos in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let good = sealed();
        let mut bytes = good.header_bytes.clone();
        let i = pos.index(bytes.len());
        bytes[i] ^= xor;
        // Any single-byte change breaks the encoding, a field, or the signature.
        prop_assert!(decode_header(&bytes).is_err());
    }

    #[test]
    fn body_decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2000)) {
        // Sign a header for the random bytes so decoding gets past the hash check.
        let good = sealed();
        let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
        let decoded = decode_body(header.header(), &spec(), &bytes);
        // The layer-at-a-time check seals use reaches the same verdict.
        prop_assert_eq!(verdict(check_body(header.header(), &spec(), &bytes)), verdict(decoded));
    }

    #[test]
    fn mutated_body_never_panics(pos in any::<prop::sample::Index>(), xor in 1u8..=255) {
        let good = sealed();
        let mut bytes = good.body_bytes.clone();
        let i = pos.index(bytes.len());
        bytes[i] ^= xor;
        let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
        let checked = check_body(header.header(), &spec(), &bytes);
        prop_assert_eq!(verdict(checked), verdict(decode_body(header.header(), &spec(), &bytes)));
        if let Ok(decoded) = decode_body(header.header(), &spec(), &bytes) {
            // A mutation that still decodes must decode to exactly what the bytes say.
            prop_assert_eq!(encode_body(&decoded), bytes);
        }
    }
}
