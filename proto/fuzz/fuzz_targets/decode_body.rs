//! Arbitrary bytes into the body decoder, behind a header that commits to exactly those bytes (so
//! the hash check passes and every layer parser is reached). The first byte picks which of three
//! compression summaries the header claims, so the fuzzer can also reach full acceptance.
#![no_main]

use kindred_proto::*;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn spec() -> &'static ModelSpec {
    static SPEC: OnceLock<ModelSpec> = OnceLock::new();
    SPEC.get_or_init(|| {
        ModelSpec::new(vec![
            LayerSpec::new("a", [3, 3], DType::F32),
            LayerSpec::new("b", [70], DType::F32),
            LayerSpec::new("c", [2, 100], DType::F16),
        ])
        .unwrap_or_else(|e| panic!("fixed spec is valid: {e}"))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else { return };
    let spec = spec();
    let sender = libp2p_identity::PublicKey::from(
        libp2p_identity::ed25519::Keypair::from(
            libp2p_identity::ed25519::SecretKey::try_from_bytes([3u8; 32])
                .unwrap_or_else(|_| unreachable!()),
        )
        .public(),
    )
    .to_peer_id();
    let compression = CompressionSummary {
        dense_layers: u16::from(selector & 3),
        topk_layers: u16::from((selector >> 2) & 3),
        sign_layers: u16::from((selector >> 4) & 3),
        params: 279,
        carried: u64::from(selector >> 6) * 50,
    };
    let header = PacketHeader {
        model: spec.id(),
        round: 1,
        sender,
        unix_ms: 0,
        samples: 1,
        loss: 0.0,
        embedding: Embedding::default(),
        body_len: body.len() as u32,
        body_hash: *blake3::hash(body).as_bytes(),
        compression,
    };
    let decoded = decode_body(&header, spec, body);
    // The layer-at-a-time check seals use reaches the same verdict.
    // Compared as `Debug` shows them: an error may carry a NaN scale, never `==` to itself.
    assert_eq!(
        format!("{:?}", check_body(&header, spec, body)),
        format!("{:?}", decoded.as_ref().map(|_| ()))
    );
    if let Ok(decoded) = decoded {
        // Whatever is accepted re-encodes to the very bytes received.
        assert_eq!(encode_body(&decoded), body);
    }
});
