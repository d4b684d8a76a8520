//! Decoding rejects bodies that do not fit the spec, with the layer that is wrong, whether it
//! keeps the update dense or sparse.

#![allow(clippy::unwrap_used)]

use half::f16;
use kindred_distill::{DecodeError, decode, decode_iter, decode_update};
use kindred_proto::{
    DType, DenseValues, LayerPayload, LayerSpec, ModelSpec, PacketBody, SignBits, TopK, TopK4,
};

fn spec() -> ModelSpec {
    ModelSpec::new(vec![
        LayerSpec::new("a", [4], DType::F32),
        LayerSpec::new("b", [70], DType::F32),
    ])
    .unwrap()
}

fn sign(len: u32) -> LayerPayload {
    LayerPayload::Sign(SignBits {
        len,
        words: (0..(len as usize).div_ceil(64))
            .map(|w| if w == 0 { 0b101 } else { 0 })
            .collect(),
        scale: 0.5,
    })
}

fn dense(v: Vec<f32>) -> LayerPayload {
    LayerPayload::Dense(DenseValues::F16(v.into_iter().map(f16::from_f32).collect()))
}

#[test]
fn decodes_every_encoding() {
    let body = PacketBody {
        layers: vec![dense(vec![1.0, -2.0, 0.5, 0.0]), sign(70)],
    };
    let out = decode(&body, &spec()).unwrap();
    assert_eq!(&out[..4], &[1.0, -2.0, 0.5, 0.0]);
    assert_eq!(&out[4..7], &[-0.5, 0.5, -0.5]);
    assert!(out[7..].iter().all(|&v| v == 0.5));
}

#[test]
fn decodes_4_bit_top_k() {
    // Codes: +level 7, −level 6, +level 0 (the high nibble of the last byte unused).
    let t = TopK4 {
        len: 70,
        indices: vec![2, 40, 69],
        codes: vec![0x07 | (0x0E << 4), 0x00],
        scale: 2.0,
        ratio: 0.5,
    };
    let body = PacketBody {
        layers: vec![dense(vec![0.0; 4]), LayerPayload::TopK4(t.clone())],
    };
    let out = both(&body, &spec()).unwrap();
    assert_eq!(
        (out[4 + 2], out[4 + 40], out[4 + 69]),
        (2.0, -1.0, 2.0 / 128.0)
    );
    assert_eq!(out.iter().filter(|v| **v != 0.0).count(), 3);
    let bad = |t: TopK4| PacketBody {
        layers: vec![dense(vec![0.0; 4]), LayerPayload::TopK4(t)],
    };
    for ratio in [0.0, 1.5, f32::NAN] {
        let r = both(&bad(TopK4 { ratio, ..t.clone() }), &spec());
        assert!(
            matches!(r, Err(DecodeError::TopK { layer: 1, .. })),
            "{ratio}: {r:?}"
        );
    }
    let short = TopK4 {
        codes: vec![0x07],
        ..t.clone()
    };
    assert!(matches!(
        both(&bad(short), &spec()),
        Err(DecodeError::TopK { layer: 1, .. })
    ));
    let scale = TopK4 {
        scale: f32::INFINITY,
        ..t
    };
    assert!(matches!(
        both(&bad(scale), &spec()),
        Err(DecodeError::Scale { layer: 1, .. })
    ));
}

/// `decode`, after checking that `decode_update` gives the same values or the same error.
fn both(body: &PacketBody, spec: &ModelSpec) -> Result<Vec<f32>, DecodeError> {
    let dense = decode(body, spec);
    let kept = decode_update(body, spec).map(|u| u.to_dense());
    // Through Debug: an error may carry a NaN scale.
    assert_eq!(format!("{dense:?}"), format!("{kept:?}"));
    // A layer at a time: the same values, or the same error (up front, or where it stops).
    let iterated = match decode_iter(body, spec) {
        Err(e) => format!("{:?}", Err::<Vec<f32>, _>(e)),
        Ok(mut values) => {
            let read: Vec<f32> = values.by_ref().collect();
            match values.error() {
                Some(e) => format!("{:?}", Err::<Vec<f32>, _>(e)),
                None => format!("{:?}", Ok::<_, DecodeError>(read)),
            }
        }
    };
    assert_eq!(format!("{dense:?}"), iterated);
    dense
}

#[test]
fn mismatches_are_typed() {
    let s = spec();
    let one = PacketBody {
        layers: vec![dense(vec![0.0; 4])],
    };
    assert_eq!(
        both(&one, &s),
        Err(DecodeError::LayerCount {
            expected: 2,
            found: 1
        })
    );
    let wrong = PacketBody {
        layers: vec![dense(vec![0.0; 4]), sign(71)],
    };
    assert!(matches!(
        both(&wrong, &s),
        Err(DecodeError::Shape { layer: 1, .. })
    ));
    let topk = |indices: Vec<u32>, values: Vec<i8>, scale: f32| PacketBody {
        layers: vec![
            dense(vec![0.0; 4]),
            LayerPayload::TopK(TopK {
                len: 70,
                indices,
                values,
                scale,
            }),
        ],
    };
    assert!(matches!(
        both(&topk(vec![3, 3], vec![1, 1], 1.0), &s),
        Err(DecodeError::TopK { layer: 1, .. })
    ));
    assert!(matches!(
        both(&topk(vec![70], vec![1], 1.0), &s),
        Err(DecodeError::TopK { layer: 1, .. })
    ));
    assert!(matches!(
        both(&topk(vec![1, 2], vec![1], 1.0), &s),
        Err(DecodeError::TopK { layer: 1, .. })
    ));
    assert!(matches!(
        both(&topk(vec![1], vec![1], f32::NAN), &s),
        Err(DecodeError::Scale { layer: 1, .. })
    ));
    let inf = PacketBody {
        layers: vec![dense(vec![0.0, f32::INFINITY, 0.0, 0.0]), sign(70)],
    };
    assert_eq!(
        both(&inf, &s),
        Err(DecodeError::NonFinite { layer: 0, index: 1 })
    );
    let mut padded = sign(70);
    if let LayerPayload::Sign(sb) = &mut padded {
        sb.words[1] |= 1 << 10;
    }
    let bad_sign = PacketBody {
        layers: vec![dense(vec![0.0; 4]), padded],
    };
    assert!(matches!(
        both(&bad_sign, &s),
        Err(DecodeError::Sign { layer: 1, .. })
    ));
}
