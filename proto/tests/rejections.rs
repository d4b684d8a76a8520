//! One crafted packet per rejection cause, each asserting the exact error.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kindred_proto::*;

/// Encode `body` and sign a header for it whose compression summary matches, so only the defect
/// planted in the body is wrong.
fn forged_packet(body: &PacketBody) -> (PacketHeader, Vec<u8>) {
    let good = sealed();
    let mut header = good.header.header().clone();
    header.compression = CompressionSummary::of(body);
    let body_bytes = encode_body(body);
    let header_bytes = forge(header, &body_bytes, &key(1));
    (
        decode_header(&header_bytes).unwrap().into_header(),
        body_bytes,
    )
}

fn body_error(body: &PacketBody) -> DecodeError {
    let (header, bytes) = forged_packet(body);
    decode_body(&header, &spec(), &bytes).unwrap_err()
}

fn with_layer(i: usize, payload: LayerPayload) -> PacketBody {
    let mut b = body();
    b.layers[i] = payload;
    b
}

fn topk(indices: Vec<u32>, scale: f32) -> LayerPayload {
    let values = vec![1; indices.len()];
    LayerPayload::TopK(TopK {
        len: 200,
        indices,
        values,
        scale,
    })
}

#[test]
fn valid_packet_is_accepted() {
    let p = sealed();
    let h = decode_header(&p.header_bytes).unwrap();
    assert_eq!(
        decode_body(h.header(), &spec(), &p.body_bytes).unwrap(),
        body()
    );
}

#[test]
fn unknown_version() {
    let mut bytes = sealed().header_bytes;
    assert_eq!(bytes[0], FORMAT_VERSION as u8);
    bytes[0] = 2;
    assert_eq!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::UnknownVersion {
            found: 2,
            supported: FORMAT_VERSION
        }
    );
}

#[test]
fn oversize_header() {
    let bytes = vec![1u8; MAX_HEADER_BYTES + 1];
    assert_eq!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::Oversize {
            what: "header",
            len: MAX_HEADER_BYTES as u64 + 1,
            max: MAX_HEADER_BYTES as u64
        }
    );
}

#[test]
fn oversize_sketch() {
    let mut header = sealed().header.into_header();
    header.embedding.sketch = vec![1; MAX_SKETCH_LEN + 1];
    let bytes = encode_header(&header, &key(1));
    assert!(bytes.len() <= MAX_HEADER_BYTES);
    assert_eq!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::Oversize {
            what: "embedding sketch",
            len: MAX_SKETCH_LEN as u64 + 1,
            max: MAX_SKETCH_LEN as u64
        }
    );
}

#[test]
fn oversize_body_length_in_header() {
    let mut header = sealed().header.into_header();
    header.body_len = kindred_proto::MAX_PIECED_BODY_BYTES as u32 + 1;
    let bytes = encode_header(&header, &key(1));
    assert!(matches!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::Oversize { what: "body", .. }
    ));
}

/// A body longer than its header announces is refused before it is hashed or parsed.
#[test]
fn oversize_body() {
    let header = sealed().header.into_header();
    let bytes = vec![0u8; MAX_BODY_BYTES + 1];
    assert!(matches!(
        decode_body(&header, &spec(), &bytes).unwrap_err(),
        DecodeError::BodyLengthMismatch { .. }
    ));
}

/// Every header may announce a body past one message's limit (it travels in pieces), up to
/// `MAX_PIECED_BODY_BYTES`, under every domain; not more.
#[test]
fn a_header_announces_a_body_up_to_the_pieced_limit() {
    let keypair = key(1);
    let mut header = sealed().header.into_header();
    let domains = |header: &kindred_proto::PacketHeader| {
        let packet = encode_header(header, &keypair);
        let snapshot = kindred_proto::encode_snapshot_header(header, &keypair);
        let merge = kindred_proto::encode_merge_header(header, &keypair);
        [
            decode_header(&packet).map(drop),
            kindred_proto::decode_snapshot_header(&snapshot).map(drop),
            kindred_proto::decode_merge_header(&merge).map(drop),
        ]
    };
    header.body_len = MAX_BODY_BYTES as u32 + 1;
    assert_eq!(domains(&header), [Ok(()), Ok(()), Ok(())]);
    header.body_len = kindred_proto::MAX_PIECED_BODY_BYTES as u32;
    assert_eq!(domains(&header), [Ok(()), Ok(()), Ok(())]);
    header.body_len += 1;
    for r in domains(&header) {
        assert!(
            matches!(r, Err(DecodeError::Oversize { what: "body", .. })),
            "{r:?}"
        );
    }
}

#[test]
fn oversize_layer_count() {
    // A body that claims 2^20 layers in three bytes: rejected before any layer vector exists.
    let body_bytes = vec![0x80, 0x80, 0x40];
    let mut header = sealed().header.into_header();
    header.body_len = 3;
    header.body_hash = *blake3::hash(&body_bytes).as_bytes();
    assert_eq!(
        decode_body(&header, &spec(), &body_bytes).unwrap_err(),
        DecodeError::Oversize {
            what: "layer count",
            len: 1 << 20,
            max: MAX_LAYERS as u64
        }
    );
}

#[test]
fn oversize_topk_count() {
    // Layer 2 claims more entries than the layer has. The header keeps the honest summary (a
    // summary with more values carried than parameters is itself rejected), so the body decoder
    // is what must catch the count, before it allocates the index vector.
    let good = sealed();
    let bad = with_layer(
        2,
        LayerPayload::TopK(TopK {
            len: 200,
            indices: (0..201).collect(),
            values: vec![1; 201],
            scale: 1.0,
        }),
    );
    let bytes = encode_body(&bad);
    let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
    let err = decode_body(header.header(), &spec(), &bytes).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Oversize {
            what: "top-k count",
            len: 201,
            max: 200
        }
    );
}

fn topk4(count: usize, codes: Vec<u8>, scale: f32, ratio: f32) -> LayerPayload {
    LayerPayload::TopK4(TopK4 {
        len: 200,
        indices: (0..count as u32).map(|i| i * 3).collect(),
        codes,
        scale,
        ratio,
    })
}

#[test]
fn topk4_checks() {
    // A valid 4-bit layer decodes to what was sent.
    let good = with_layer(2, topk4(3, vec![0x9F, 0x07], 0.5, 0.25));
    let (header, bytes) = forged_packet(&good);
    assert_eq!(decode_body(&header, &spec(), &bytes).unwrap(), good);
    let malformed = |detail| DecodeError::Malformed {
        part: Part::Layer(2),
        detail,
    };
    let ratio = malformed("4-bit level ratio outside (0, 1]");
    for r in [0.0, -0.5, 1.5, f32::NAN, f32::INFINITY] {
        let bad = with_layer(2, topk4(3, vec![0x9F, 0x07], 0.5, r));
        assert_eq!(body_error(&bad), ratio, "ratio {r}");
    }
    for s in [-1.0, f32::NAN, f32::INFINITY] {
        let bad = with_layer(2, topk4(3, vec![0x9F, 0x07], s, 0.5));
        match body_error(&bad) {
            DecodeError::NonFiniteScale { layer: 2, scale } => {
                assert_eq!(scale.to_bits(), s.to_bits());
            }
            other => panic!("scale {s}: {other:?}"),
        }
    }
    let count = malformed("4-bit code bytes do not match the entry count");
    for codes in [vec![0x9F], vec![0x9F, 0x07, 0x00], vec![]] {
        assert_eq!(body_error(&with_layer(2, topk4(3, codes, 0.5, 0.5))), count);
    }
    assert_eq!(
        body_error(&with_layer(2, topk4(3, vec![0x9F, 0x17], 0.5, 0.5))),
        malformed("unused 4-bit code is not zero")
    );
    let mut unsorted = topk4(3, vec![0x9F, 0x07], 0.5, 0.5);
    if let LayerPayload::TopK4(t) = &mut unsorted {
        t.indices = vec![0, 9, 9];
    }
    assert_eq!(
        body_error(&with_layer(2, unsorted)),
        DecodeError::IndexNotIncreasing {
            layer: 2,
            position: 2
        }
    );
    // More entries than the layer has, under the honest summary (see `oversize_topk_count`).
    let bytes = encode_body(&with_layer(2, topk4(201, vec![0; 101], 0.5, 0.5)));
    let header = decode_header(&forge(sealed().header.into_header(), &bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(header.header(), &spec(), &bytes).unwrap_err(),
        DecodeError::Oversize {
            what: "top-k count",
            len: 201,
            max: 200
        }
    );
}

#[test]
fn truncated_header() {
    let bytes = sealed().header_bytes;
    for cut in [1, 10, bytes.len() / 2, bytes.len() - 1] {
        assert_eq!(
            decode_header(&bytes[..cut]).unwrap_err(),
            DecodeError::Truncated { part: Part::Header },
            "cut at {cut}"
        );
    }
    assert_eq!(
        decode_header(&[]).unwrap_err(),
        DecodeError::Truncated { part: Part::Header }
    );
}

#[test]
fn truncated_body() {
    let good = sealed();
    let bytes = &good.body_bytes[..good.body_bytes.len() - 3];
    let header = decode_header(&forge(good.header.into_header(), bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(header.header(), &spec(), bytes).unwrap_err(),
        DecodeError::Truncated {
            part: Part::Layer(3)
        }
    );
}

#[test]
fn truncated_topk_indices() {
    // Five entries but the delta bytes hold four varints.
    let mut bytes = encode_body(&body());
    let good = sealed();
    // Locate layer 2's delta blob: its length prefix (5) precedes the deltas [0,7,1,122,69].
    let pos = bytes
        .windows(6)
        .position(|w| w == [5, 0, 7, 1, 122, 69])
        .unwrap();
    bytes[pos] = 4;
    bytes.remove(pos + 5);
    let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(header.header(), &spec(), &bytes).unwrap_err(),
        DecodeError::Truncated {
            part: Part::Layer(2)
        }
    );
}

#[test]
fn trailing_bytes_header() {
    let mut bytes = sealed().header_bytes;
    bytes.push(0);
    assert_eq!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::TrailingBytes {
            part: Part::Header,
            extra: 1
        }
    );
}

#[test]
fn trailing_bytes_body() {
    let good = sealed();
    let mut bytes = good.body_bytes.clone();
    bytes.extend_from_slice(&[0, 0]);
    let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(header.header(), &spec(), &bytes).unwrap_err(),
        DecodeError::TrailingBytes {
            part: Part::Body,
            extra: 2
        }
    );
}

#[test]
fn malformed_enum_tag() {
    let good = sealed();
    let mut bytes = good.body_bytes.clone();
    // Byte 1 is layer 0's payload tag (0 dense, 1 top-k, 2 sign, 3 dense int8).
    assert_eq!(bytes[1], 2);
    bytes[1] = 9;
    let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(header.header(), &spec(), &bytes).unwrap_err(),
        DecodeError::Malformed {
            part: Part::Layer(0),
            detail: "unknown enum tag"
        }
    );
}

#[test]
fn shape_mismatch_dense() {
    let five = DenseValues::F16(vec![half::f16::ONE; 5]);
    assert_eq!(
        body_error(&with_layer(1, LayerPayload::Dense(five))),
        DecodeError::ShapeMismatch {
            layer: 1,
            expected: 4,
            found: 5
        }
    );
}

#[test]
fn shape_mismatch_dense_int8() {
    let three = DenseValues::Int8 {
        values: vec![1, -1, 0],
        scale: 0.5,
    };
    assert_eq!(
        body_error(&with_layer(1, LayerPayload::Dense(three))),
        DecodeError::ShapeMismatch {
            layer: 1,
            expected: 4,
            found: 3
        }
    );
}

#[test]
fn shape_mismatch_topk_and_sign() {
    let t = LayerPayload::TopK(TopK {
        len: 199,
        indices: vec![1],
        values: vec![1],
        scale: 1.0,
    });
    assert_eq!(
        body_error(&with_layer(2, t)),
        DecodeError::ShapeMismatch {
            layer: 2,
            expected: 200,
            found: 199
        }
    );
    let s = LayerPayload::Sign(SignBits {
        len: 37,
        words: vec![0],
        scale: 1.0,
    });
    assert_eq!(
        body_error(&with_layer(0, s)),
        DecodeError::ShapeMismatch {
            layer: 0,
            expected: 36,
            found: 37
        }
    );
}

#[test]
fn layer_count_mismatch() {
    let mut b = body();
    b.layers.pop();
    assert_eq!(
        body_error(&b),
        DecodeError::LayerCountMismatch {
            expected: 4,
            found: 3
        }
    );
}

#[test]
fn model_mismatch() {
    let p = sealed();
    let h = decode_header(&p.header_bytes).unwrap();
    let other = ModelSpec::new(vec![LayerSpec::new("w", [3], DType::F32)]).unwrap();
    assert_eq!(
        decode_body(h.header(), &other, &p.body_bytes).unwrap_err(),
        DecodeError::ModelMismatch
    );
}

#[test]
fn index_out_of_range() {
    assert_eq!(
        body_error(&with_layer(2, topk(vec![3, 200], 1.0))),
        DecodeError::IndexOutOfRange {
            layer: 2,
            index: 200,
            len: 200
        }
    );
}

#[test]
fn index_not_increasing() {
    assert_eq!(
        body_error(&with_layer(2, topk(vec![3, 9, 9, 20], 1.0))),
        DecodeError::IndexNotIncreasing {
            layer: 2,
            position: 2
        }
    );
    // Decreasing indices wrap to a huge delta: out of range, never accepted.
    assert!(matches!(
        body_error(&with_layer(2, topk(vec![30, 9], 1.0))),
        DecodeError::IndexOutOfRange { layer: 2, .. }
    ));
}

#[test]
fn non_finite_scale() {
    for scale in [f32::NAN, f32::INFINITY, -1.0] {
        let err = body_error(&with_layer(2, topk(vec![1, 2], scale)));
        assert!(
            matches!(err, DecodeError::NonFiniteScale { layer: 2, .. }),
            "{err:?}"
        );
        let s = LayerPayload::Sign(SignBits {
            len: 36,
            words: vec![0],
            scale,
        });
        let err = body_error(&with_layer(0, s));
        assert!(
            matches!(err, DecodeError::NonFiniteScale { layer: 0, .. }),
            "{err:?}"
        );
    }
    // Int8 payloads also refuse a finite scale that 127 steps of would overflow: every value a
    // receiver dequantises must be finite.
    for scale in [f32::NAN, f32::INFINITY, -1.0, f32::MAX, f32::MAX / 100.0] {
        let err = body_error(&with_layer(2, topk(vec![1, 2], scale)));
        assert!(
            matches!(err, DecodeError::NonFiniteScale { layer: 2, .. }),
            "{err:?}"
        );
        let d = DenseValues::Int8 {
            values: vec![127, -127, 0, 1],
            scale,
        };
        let err = body_error(&with_layer(1, LayerPayload::Dense(d)));
        assert!(
            matches!(err, DecodeError::NonFiniteScale { layer: 1, .. }),
            "{err:?}"
        );
    }
    let largest = f32::MAX / 127.5;
    let d = DenseValues::Int8 {
        values: vec![127, -127, 0, 1],
        scale: largest,
    };
    let (header, bytes) = forged_packet(&with_layer(1, LayerPayload::Dense(d.clone())));
    let body = decode_body(&header, &spec(), &bytes).unwrap();
    assert_eq!(body.layers[1], LayerPayload::Dense(d));
}

#[test]
fn int8_minus_128_is_refused() {
    // No quantiser writes -128: values are symmetric, so 127 steps bound every one.
    let detail = "int8 value -128 (values are within ±127)";
    let t = LayerPayload::TopK(TopK {
        len: 200,
        indices: vec![1, 2],
        values: vec![5, -128],
        scale: 0.5,
    });
    assert_eq!(
        body_error(&with_layer(2, t)),
        DecodeError::Malformed {
            part: Part::Layer(2),
            detail
        }
    );
    let d = DenseValues::Int8 {
        values: vec![-128, 0, 1, 127],
        scale: 0.5,
    };
    assert_eq!(
        body_error(&with_layer(1, LayerPayload::Dense(d))),
        DecodeError::Malformed {
            part: Part::Layer(1),
            detail
        }
    );
}

#[test]
fn non_finite_dense_value() {
    let v = DenseValues::F16(vec![
        half::f16::ONE,
        half::f16::NAN,
        half::f16::ONE,
        half::f16::ONE,
    ]);
    assert_eq!(
        body_error(&with_layer(1, LayerPayload::Dense(v))),
        DecodeError::NonFiniteValue { layer: 1, index: 1 }
    );
}

#[test]
fn sign_padding_bits() {
    let s = LayerPayload::Sign(SignBits {
        len: 36,
        words: vec![1 << 40],
        scale: 1.0,
    });
    assert_eq!(
        body_error(&with_layer(0, s)),
        DecodeError::SignPadding { layer: 0 }
    );
}

#[test]
fn body_length_mismatch() {
    let p = sealed();
    let h = decode_header(&p.header_bytes).unwrap();
    let short = &p.body_bytes[..p.body_bytes.len() - 1];
    assert_eq!(
        decode_body(h.header(), &spec(), short).unwrap_err(),
        DecodeError::BodyLengthMismatch {
            expected: p.body_bytes.len() as u64,
            found: short.len() as u64
        }
    );
}

#[test]
fn body_hash_mismatch() {
    let p = sealed();
    let h = decode_header(&p.header_bytes).unwrap();
    let mut bytes = p.body_bytes.clone();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    assert_eq!(
        decode_body(h.header(), &spec(), &bytes).unwrap_err(),
        DecodeError::BodyHashMismatch
    );
}

#[test]
fn summary_mismatch() {
    let good = sealed();
    let mut header = good.header.into_header();
    header.compression.carried -= 1;
    let h = decode_header(&forge(header, &good.body_bytes, &key(1))).unwrap();
    assert_eq!(
        decode_body(h.header(), &spec(), &good.body_bytes).unwrap_err(),
        DecodeError::SummaryMismatch
    );
}

#[test]
fn invalid_header_fields() {
    let good = sealed().header.into_header();
    let mut h = good.clone();
    h.loss = f32::NAN;
    assert_eq!(
        decode_header(&encode_header(&h, &key(1))).unwrap_err(),
        DecodeError::InvalidField {
            field: "loss",
            reason: "not finite, or its magnitude is over MAX_ABS_LOSS"
        }
    );
    let mut h = good.clone();
    h.embedding.sketch_scale = f32::INFINITY;
    assert!(matches!(
        decode_header(&encode_header(&h, &key(1))).unwrap_err(),
        DecodeError::InvalidField {
            field: "sketch_scale",
            ..
        }
    ));
    let mut h = good;
    h.compression.carried = h.compression.params + 1;
    assert!(matches!(
        decode_header(&encode_header(&h, &key(1))).unwrap_err(),
        DecodeError::InvalidField {
            field: "compression",
            ..
        }
    ));
}

/// Offset of the seal (public key + signature) in an encoded header: the last 98 bytes are
/// `varint(32) ‖ key ‖ varint(64) ‖ signature`.
const SEAL_LEN: usize = 1 + 32 + 1 + 64;

#[test]
fn bad_signature() {
    let bytes = sealed().header_bytes;
    // Tamper with the round (byte 33, after the version and the model id): still well-formed.
    let mut tampered = bytes.clone();
    assert_eq!(tampered[33], 42);
    tampered[33] = 43;
    assert_eq!(
        decode_header(&tampered).unwrap_err(),
        DecodeError::BadSignature
    );
    // Corrupt the signature itself.
    let mut tampered = bytes.clone();
    let last = tampered.len() - 1;
    tampered[last] ^= 0x10;
    assert_eq!(
        decode_header(&tampered).unwrap_err(),
        DecodeError::BadSignature
    );
    // A signature of the wrong length.
    let mut short = bytes[..bytes.len() - 65].to_vec();
    short.push(63);
    short.extend_from_slice(&bytes[bytes.len() - 63..]);
    assert_eq!(
        decode_header(&short).unwrap_err(),
        DecodeError::BadSignature
    );
}

#[test]
fn invalid_public_key() {
    let bytes = sealed().header_bytes;
    let split = bytes.len() - SEAL_LEN;
    let mut short_key = bytes[..split].to_vec();
    short_key.push(31);
    short_key.extend_from_slice(&bytes[split + 2..]);
    assert_eq!(
        decode_header(&short_key).unwrap_err(),
        DecodeError::InvalidPublicKey
    );
}

#[test]
fn sender_mismatch() {
    // Key 1 signs a header that names key 2's peer as sender: a forgery.
    let victim = libp2p_identity::PublicKey::from(key(2).public()).to_peer_id();
    let forger = libp2p_identity::PublicKey::from(key(1).public()).to_peer_id();
    let mut header = sealed().header.into_header();
    header.sender = victim;
    let bytes = encode_header(&header, &key(1));
    assert_eq!(
        decode_header(&bytes).unwrap_err(),
        DecodeError::SenderMismatch {
            claimed: Box::new(victim),
            actual: Box::new(forger)
        }
    );
    // Swapping in the victim's public key does not help: the signature no longer verifies.
    let split = bytes.len() - SEAL_LEN;
    let mut swapped = bytes.clone();
    swapped[split + 1..split + 33].copy_from_slice(&key(2).public().to_bytes());
    assert_eq!(
        decode_header(&swapped).unwrap_err(),
        DecodeError::BadSignature
    );
}

#[test]
fn seal_refuses_what_receivers_reject() {
    let bad = with_layer(2, topk(vec![5, 5], 1.0));
    assert_eq!(
        seal(&key(1), &spec(), fields(), &bad).unwrap_err(),
        SealError::Invalid(DecodeError::IndexNotIncreasing {
            layer: 2,
            position: 1
        })
    );
    let mut f = fields();
    f.loss = f32::INFINITY;
    assert!(matches!(
        seal(&key(1), &spec(), f, &body()),
        Err(SealError::Invalid(DecodeError::InvalidField { .. }))
    ));
}

#[test]
fn every_reason_label_is_distinct() {
    let errors = [
        DecodeError::UnknownVersion {
            found: 0,
            supported: 1,
        },
        DecodeError::Oversize {
            what: "",
            len: 0,
            max: 0,
        },
        DecodeError::Truncated { part: Part::Body },
        DecodeError::TrailingBytes {
            part: Part::Body,
            extra: 0,
        },
        DecodeError::Malformed {
            part: Part::Body,
            detail: "",
        },
        DecodeError::InvalidField {
            field: "",
            reason: "",
        },
        DecodeError::ModelMismatch,
        DecodeError::LayerCountMismatch {
            expected: 0,
            found: 0,
        },
        DecodeError::ShapeMismatch {
            layer: 0,
            expected: 0,
            found: 0,
        },
        DecodeError::IndexOutOfRange {
            layer: 0,
            index: 0,
            len: 0,
        },
        DecodeError::IndexNotIncreasing {
            layer: 0,
            position: 0,
        },
        DecodeError::NonFiniteScale {
            layer: 0,
            scale: 0.0,
        },
        DecodeError::NonFiniteValue { layer: 0, index: 0 },
        DecodeError::SignPadding { layer: 0 },
        DecodeError::BodyLengthMismatch {
            expected: 0,
            found: 0,
        },
        DecodeError::BodyHashMismatch,
        DecodeError::SummaryMismatch,
        DecodeError::InvalidPublicKey,
        DecodeError::BadSignature,
        DecodeError::WeakPublicKey,
        DecodeError::NonCanonical {
            part: Part::Header,
            detail: "",
        },
    ];
    let labels: std::collections::HashSet<_> = errors.iter().map(DecodeError::reason).collect();
    assert_eq!(labels.len(), errors.len());
}

#[test]
fn a_layer_of_up_to_u32_max_elements_is_a_valid_spec_and_travels_as_top_k() {
    // 65,537 × 65,535 = 2^32 − 1: the largest layer whose length and indices fit the wire's u32.
    let largest = LayerSpec::new("wte.weight", [65_537, 65_535], DType::F32);
    assert_eq!(largest.numel(), MAX_LAYER_ELEMS);
    let spec = ModelSpec::new(vec![largest]).unwrap();
    let too_large = LayerSpec::new("wte.weight", [65_536, 65_536], DType::F32);
    assert!(ModelSpec::new(vec![too_large]).is_err());
    // Its top-k packet names its first and last entries, and is checked without allocating it.
    let top_k = |indices: Vec<u32>| PacketBody {
        layers: vec![LayerPayload::TopK(TopK {
            len: u32::MAX,
            values: vec![1; indices.len()],
            indices,
            scale: 0.5,
        })],
    };
    let body = top_k(vec![0, u32::MAX - 1]);
    let packet = seal(&key(1), &spec, fields(), &body).unwrap();
    let decoded = OutcomePacket::decode(&packet.header_bytes, &packet.body_bytes, &spec).unwrap();
    assert_eq!(decoded.body, body);
    // An index past the layer's end is refused.
    let past = top_k(vec![u32::MAX]);
    let mut header = packet.header.header().clone();
    header.compression = CompressionSummary::of(&past);
    let bytes = encode_body(&past);
    let header = decode_header(&forge(header, &bytes, &key(1)))
        .unwrap()
        .into_header();
    assert!(matches!(
        decode_body(&header, &spec, &bytes),
        Err(DecodeError::IndexOutOfRange { .. })
    ));
}
