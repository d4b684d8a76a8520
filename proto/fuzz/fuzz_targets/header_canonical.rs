//! One signed content, one encoding: whatever header the decoder accepts must
//! re-encode to exactly the bytes received, so it has exactly one packet id.
//!
//! Random bytes almost never carry a valid signature, so besides decoding the input as-is, the
//! target treats it as the *signed part* of a header, signs it with a fixed key under the packet
//! domain and appends the seal (its two length prefixes overlong when the selector byte says so):
//! the fuzzer then explores the field parsers and the canonical-form check behind a valid
//! signature, and any overlong varint it finds that is still accepted fails the assertion.
#![no_main]

use kindred_proto::{PacketId, decode_header};
use libfuzzer_sys::fuzz_target;
use libp2p_identity::ed25519;
use std::sync::OnceLock;

const PACKET_DOMAIN: &[u8] = b"kindred/packet-header/v1\0";

fn key() -> &'static ed25519::Keypair {
    static KEY: OnceLock<ed25519::Keypair> = OnceLock::new();
    KEY.get_or_init(|| {
        ed25519::Keypair::from(
            ed25519::SecretKey::try_from_bytes([5u8; 32]).unwrap_or_else(|_| unreachable!()),
        )
    })
}

fn check(bytes: &[u8]) -> bool {
    match decode_header(bytes) {
        Ok(header) => {
            assert_eq!(header.to_bytes(), bytes, "accepted header re-encodes differently");
            assert_eq!(header.id(), PacketId::of_header_bytes(bytes));
            true
        }
        Err(_) => false,
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let Some((&selector, signed)) = data.split_first() else {
        return;
    };
    let key = key();
    let mut message = Vec::with_capacity(PACKET_DOMAIN.len() + signed.len());
    message.extend_from_slice(PACKET_DOMAIN);
    message.extend_from_slice(signed);
    let signature = key.sign(&message);
    let (pad_key, pad_sig) = (selector & 1 != 0, selector & 2 != 0);
    let mut bytes = signed.to_vec();
    if pad_key {
        bytes.extend_from_slice(&[0xa0, 0x00]);
    } else {
        bytes.push(32);
    }
    bytes.extend_from_slice(&key.public().to_bytes());
    if pad_sig {
        bytes.extend_from_slice(&[0xc0, 0x00]);
    } else {
        bytes.push(64);
    }
    bytes.extend_from_slice(&signature);
    if check(&bytes) {
        assert!(!pad_key && !pad_sig, "overlong seal prefix accepted");
    }
});
