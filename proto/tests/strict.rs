//! Regression tests for the hostile-input audit: forged signatures under small-order
//! keys, inflated claims, and non-canonical encodings that gave one signed header several ids.
//!
//! Headers here are built by a second, independent encoder of the v1 layout that can pad any
//! varint or length prefix to an overlong form and seal with any key and signature bytes: the
//! crate's own encoder only ever writes canonical, honestly signed headers.
#![allow(clippy::unwrap_used, clippy::indexing_slicing)]

mod common;

use common::*;
use curve25519_dalek::constants::EIGHT_TORSION;
use kindred_proto::*;
use proptest::prelude::*;

const PACKET_DOMAIN: &[u8] = b"kindred/packet-header/v1\0";

/// Fields of the v1 header layout, in wire order.
#[derive(Debug, Clone)]
struct RawHeader {
    version: u64,
    model: [u8; 32],
    round: u64,
    sender: Vec<u8>,
    unix_ms: u64,
    samples: u64,
    loss: f32,
    simhash: [u8; 32],
    sketch: Vec<u8>,
    sketch_scale: f32,
    body_len: u64,
    body_hash: [u8; 32],
    dense: u64,
    topk: u64,
    sign: u64,
    params: u64,
    carried: u64,
}

impl RawHeader {
    fn of(h: &PacketHeader) -> Self {
        let sketch = h.embedding.sketch.iter().map(|&x| x as u8).collect();
        Self {
            version: u64::from(FORMAT_VERSION),
            model: h.model.0,
            round: h.round,
            sender: h.sender.to_bytes(),
            unix_ms: h.unix_ms,
            samples: h.samples,
            loss: h.loss,
            simhash: h.embedding.simhash.0,
            sketch,
            sketch_scale: h.embedding.sketch_scale,
            body_len: u64::from(h.body_len),
            body_hash: h.body_hash,
            dense: u64::from(h.compression.dense_layers),
            topk: u64::from(h.compression.topk_layers),
            sign: u64::from(h.compression.sign_layers),
            params: h.compression.params,
            carried: h.compression.carried,
        }
    }

    /// The signed bytes; varint number `i` (in wire order, 12 of them) is written one byte longer
    /// than needed when bit `i` of `pad` is set.
    fn encode(&self, pad: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut n = 0;
        let mut varint = |out: &mut Vec<u8>, v: u64| {
            put_varint(out, v, pad & (1 << n) != 0);
            n += 1;
        };
        varint(&mut out, self.version);
        out.extend_from_slice(&self.model);
        varint(&mut out, self.round);
        varint(&mut out, self.sender.len() as u64);
        out.extend_from_slice(&self.sender);
        varint(&mut out, self.unix_ms);
        varint(&mut out, self.samples);
        out.extend_from_slice(&self.loss.to_le_bytes());
        out.extend_from_slice(&self.simhash);
        varint(&mut out, self.sketch.len() as u64);
        out.extend_from_slice(&self.sketch);
        out.extend_from_slice(&self.sketch_scale.to_le_bytes());
        varint(&mut out, self.body_len);
        out.extend_from_slice(&self.body_hash);
        for v in [self.dense, self.topk, self.sign, self.params, self.carried] {
            varint(&mut out, v);
        }
        out
    }
}

/// LEB128, optionally overlong by one byte (a continuation bit, then a zero byte).
fn put_varint(out: &mut Vec<u8>, mut v: u64, overlong: bool) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    if overlong {
        out.push(v as u8 | 0x80);
        out.push(0);
    } else {
        out.push(v as u8);
    }
}

/// `signed ‖ varint(32) ‖ key ‖ varint(64) ‖ signature`, prefixes optionally overlong.
fn with_seal(mut signed: Vec<u8>, key: &[u8], sig: &[u8], pad_key: bool, pad_sig: bool) -> Vec<u8> {
    put_varint(&mut signed, key.len() as u64, pad_key);
    signed.extend_from_slice(key);
    put_varint(&mut signed, sig.len() as u64, pad_sig);
    signed.extend_from_slice(sig);
    signed
}

fn honestly_signed(raw: &RawHeader, pad: u32, pad_key: bool, pad_sig: bool) -> Vec<u8> {
    let signed = raw.encode(pad);
    let k = key(1);
    let sig = k.sign(&[PACKET_DOMAIN, &signed].concat());
    with_seal(signed, &k.public().to_bytes(), &sig, pad_key, pad_sig)
}

/// A header "signed" by a small-order key with R = identity, S = 0: no secret involved.
fn forged_by_small_order_key(point: [u8; 32], samples: u64) -> Vec<u8> {
    let weak = libp2p_identity::ed25519::PublicKey::try_from_bytes(&point).unwrap();
    let mut raw = RawHeader::of(sealed().header.header());
    raw.sender = libp2p_identity::PublicKey::from(weak)
        .to_peer_id()
        .to_bytes();
    raw.samples = samples;
    let mut identity = [0u8; 32];
    identity[0] = 1;
    let sig = [identity, [0u8; 32]].concat();
    with_seal(raw.encode(0), &point, &sig, false, false)
}

#[test]
fn small_order_forgeries_are_rejected() {
    for point in EIGHT_TORSION {
        let point = point.compress().to_bytes();
        let forged = forged_by_small_order_key(point, MAX_SAMPLES);
        assert_eq!(
            decode_header(&forged).unwrap_err(),
            DecodeError::WeakPublicKey,
            "key {point:02x?}"
        );
        assert_eq!(
            decode_snapshot_header(&forged).unwrap_err(),
            DecodeError::WeakPublicKey
        );
        // The claim the audit paired with it is refused by itself.
        assert_eq!(
            decode_header(&forged_by_small_order_key(point, u64::MAX)).unwrap_err(),
            DecodeError::InvalidField {
                field: "samples",
                reason: "over MAX_SAMPLES"
            }
        );
    }
}

#[test]
fn non_canonical_public_key_is_rejected() {
    // y = p + 1, a second encoding of the identity point.
    let mut point = [0xffu8; 32];
    point[0] = 0xee;
    point[31] = 0x7f;
    let raw = RawHeader::of(sealed().header.header());
    let mut identity = [0u8; 32];
    identity[0] = 1;
    let forged = with_seal(
        raw.encode(0),
        &point,
        &[identity, [0u8; 32]].concat(),
        false,
        false,
    );
    assert_eq!(
        decode_header(&forged).unwrap_err(),
        DecodeError::NonCanonical {
            part: Part::Header,
            detail: "public key point encoding"
        }
    );
}

#[test]
fn inflated_claims_are_rejected() {
    let mut h = sealed().header.into_header();
    h.samples = MAX_SAMPLES + 1;
    assert!(matches!(
        decode_header(&encode_header(&h, &key(1))).unwrap_err(),
        DecodeError::InvalidField {
            field: "samples",
            ..
        }
    ));
    h.samples = MAX_SAMPLES;
    assert!(decode_header(&encode_header(&h, &key(1))).is_ok());
    h.loss = 3e38;
    assert!(matches!(
        decode_header(&encode_header(&h, &key(1))).unwrap_err(),
        DecodeError::InvalidField { field: "loss", .. }
    ));
    let mut f = fields();
    f.samples = u64::MAX;
    assert!(seal(&key(1), &spec(), f, &body()).is_err());
}

#[test]
fn the_independent_encoder_matches_the_crate() {
    let good = sealed();
    let raw = RawHeader::of(good.header.header());
    assert_eq!(honestly_signed(&raw, 0, false, false), good.header_bytes);
}

#[test]
fn overlong_seal_prefixes_are_rejected() {
    let raw = RawHeader::of(sealed().header.header());
    for (pad_key, pad_sig) in [(true, false), (false, true), (true, true)] {
        assert_eq!(
            decode_header(&honestly_signed(&raw, 0, pad_key, pad_sig)).unwrap_err(),
            DecodeError::NonCanonical {
                part: Part::Header,
                detail: "seal length prefix"
            }
        );
    }
}

#[test]
fn overlong_signed_varints_are_rejected() {
    let raw = RawHeader::of(sealed().header.header());
    // The version is read before postcard: its overlong form fails there, the others after.
    for i in 0..12 {
        let err = decode_header(&honestly_signed(&raw, 1 << i, false, false)).unwrap_err();
        assert!(
            matches!(err, DecodeError::NonCanonical { .. }),
            "varint {i}: {err:?}"
        );
    }
}

#[test]
fn overlong_body_varints_are_rejected() {
    let good = sealed();
    let bytes = good.body_bytes.clone();
    // `04` layer count, then layer 0: `02` (sign), `24` (36 elements), ...
    assert_eq!(&bytes[..3], &[0x04, 0x02, 0x24]);
    let cases = [
        ([0x84, 0x00, 0x02, 0x24].as_slice(), Part::Body),
        ([0x04, 0x82, 0x00, 0x24].as_slice(), Part::Layer(0)),
        ([0x04, 0x02, 0xa4, 0x00].as_slice(), Part::Layer(0)),
    ];
    for (prefix, part) in cases {
        let padded = [prefix, &bytes[3..]].concat();
        let header = forge(good.header.header().clone(), &padded, &key(1));
        let header = decode_header(&header).unwrap();
        let err = decode_body(header.header(), &spec(), &padded).unwrap_err();
        assert!(
            matches!(err, DecodeError::NonCanonical { part: p, .. } if p == part),
            "{prefix:02x?}: {err:?}"
        );
    }
}

fn raw_header() -> impl Strategy<Value = RawHeader> {
    (
        0u64..1 << 60,
        0..=MAX_SAMPLES,
        -1000.0f32..1000.0,
        proptest::collection::vec(any::<u8>(), 0..64),
        any::<[u8; 32]>(),
        0u64..1 << 20,
    )
        .prop_map(|(round, samples, loss, sketch, simhash, body_len)| {
            let mut raw = RawHeader::of(sealed().header.header());
            raw.round = round;
            raw.unix_ms = round ^ 0x5555_5555;
            raw.samples = samples;
            raw.loss = loss;
            raw.sketch = sketch;
            raw.simhash = simhash;
            raw.body_len = body_len;
            raw
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// decode → encode reproduces the input, for every accepted input; every padded form is
    /// refused as non-canonical, never accepted under another id.
    #[test]
    fn accepted_headers_have_one_encoding(
        raw in raw_header(),
        pad in prop_oneof![Just(0u32), 0u32..1 << 12],
        pad_key: bool,
        pad_sig: bool,
    ) {
        let bytes = honestly_signed(&raw, pad, pad_key, pad_sig);
        match decode_header(&bytes) {
            Ok(header) => {
                prop_assert_eq!(pad, 0);
                prop_assert!(!pad_key && !pad_sig);
                prop_assert_eq!(header.to_bytes(), bytes.clone());
                prop_assert_eq!(header.id(), PacketId::of_header_bytes(&bytes));
            }
            Err(err) => {
                prop_assert!(pad != 0 || pad_key || pad_sig, "unpadded header refused: {:?}", err);
                prop_assert!(matches!(err, DecodeError::NonCanonical { .. }), "{:?}", err);
            }
        }
    }

    /// Bodies: whatever is accepted re-encodes to exactly its bytes (mutations included).
    #[test]
    fn accepted_bodies_have_one_encoding(pos in any::<prop::sample::Index>(), byte: u8, insert: bool) {
        let good = sealed();
        let mut bytes = good.body_bytes.clone();
        let i = pos.index(bytes.len());
        if insert { bytes.insert(i, byte) } else { bytes[i] = byte }
        let header = decode_header(&forge(good.header.into_header(), &bytes, &key(1))).unwrap();
        if let Ok(decoded) = decode_body(header.header(), &spec(), &bytes) {
            prop_assert_eq!(encode_body(&decoded), bytes);
        }
    }
}
