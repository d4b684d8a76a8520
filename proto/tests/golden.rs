//! Pins the v1 encoding of one fixed packet. If this test fails, the wire format changed: that is
//! a protocol change, to be made deliberately (new `FORMAT_VERSION`, new golden bytes).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use kindred_proto::*;

const GOLDEN_HEADER: &str = concat!(
    "013985bcbe20bfccf987dbca4f0b4f4706d82da1a227f5ce872ff29e2d8e5cb6342a260024080112208a88e3",
    "dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c80d095ffbc31d8040000a03e00254a",
    "6f94b9de03284d7297bce1062b50759abfe4092e53789dc2e70c31567b10c0c8d0d8e0e8f0f8000810182028",
    "30380ad7a33c4640e59528c2714c8981187305663c7001242bf8750032ef04cc0e96ef1ee52670020101fa01",
    "37208a88e3dd7409f195fd52db2d3cba5d72ca6709bf1d94121bf3748801b40f6f5c404c58943acc9e6c3e95",
    "2be64ac41d6507483fdc874a77bf5ccf39d2f72f6fcf860051b221d9dcdee326ed64e280715e7175a15ddc46",
    "97034b0022a3477a5c9f0d"
);
const GOLDEN_BODY: &str = concat!(
    "040224080ff05a5a0a0000000000003e000108003800bc0000004001c80105050007017a45057f8103ff406f",
    "12833a0002140000cd3d4d3e9a3ecd3e003f1a3f333f4d3f663f"
);
const GOLDEN_ID: &str = "b2d7e3641201c1e1afc3aee2ad93f6ecc8a36ce0e3cfa63f2d492709e1944883";
const GOLDEN_MODEL: &str = "3985bcbe20bfccf987dbca4f0b4f4706d82da1a227f5ce872ff29e2d8e5cb634";

#[test]
fn v1_encoding_is_pinned() {
    let p = sealed();
    let header = hex::encode(&p.header_bytes);
    let body = hex::encode(&p.body_bytes);
    let id = hex::encode(p.id().0);
    let model = hex::encode(spec().id().0);
    println!("header {header}\nbody {body}\nid {id}\nmodel {model}");
    assert_eq!(model, GOLDEN_MODEL, "model id encoding changed");
    assert_eq!(body, GOLDEN_BODY, "body encoding changed");
    assert_eq!(header, GOLDEN_HEADER, "header encoding changed");
    assert_eq!(id, GOLDEN_ID, "packet id changed");
}

#[test]
fn golden_bytes_decode() {
    let header = decode_header(&hex::decode(GOLDEN_HEADER).unwrap()).unwrap();
    assert_eq!(header.header().round, 42);
    let decoded =
        decode_body(header.header(), &spec(), &hex::decode(GOLDEN_BODY).unwrap()).unwrap();
    assert_eq!(decoded, body());
}

/// The 4-bit top-k layer's encoding: tag 4, length, count, the delta-coded indices, the packed
/// codes (low nibble first), then scale and ratio as little-endian f32.
#[test]
fn v1_topk4_layer_is_pinned() {
    let body = PacketBody {
        layers: vec![LayerPayload::TopK4(TopK4 {
            len: 200,
            indices: vec![0, 7, 130],
            codes: vec![0x9F, 0x07],
            scale: 0.5,
            ratio: 0.25,
        })],
    };
    let bytes = encode_body(&body);
    assert_eq!(
        hex::encode(&bytes),
        "0104c801030300077b029f070000003f0000803e"
    );
    assert_eq!(bytes.len(), 1 + encoded_layer_len(&body.layers[0]));
}
