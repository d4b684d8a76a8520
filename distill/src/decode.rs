//! Packet body → dense flat update.
//!
//! The inverse of distillation as far as the sender's payloads go: dense values widened to f32,
//! top-k entries dequantised into an otherwise zero layer, signs expanded to `±scale`. Every
//! element is written exactly once from one payload value, with no summation at all, so the result
//! is bit-identical on every machine and thread count. Bodies straight from
//! `kindred_proto::decode_body` are already validated; this re-checks what it relies on (layer
//! count and sizes, index order and range, finite values and scales), so a body built any other
//! way is rejected with a [`DecodeError`] rather than mis-decoded.

use kindred_kernels::{Backend, Kernels};
use kindred_proto::{DenseValues, LayerPayload, ModelSpec, PacketBody};

use crate::error::DecodeError;
use crate::layout::Layout;

/// Decode `body` against `spec` into one flat update in model order.
///
/// ```
/// use kindred_distill::decode;
/// use kindred_proto::*;
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [6], DType::F32)])?;
/// let body = PacketBody {
///     layers: vec![LayerPayload::TopK(TopK { len: 6, indices: vec![1, 4], values: vec![127, -64], scale: 0.5 })],
/// };
/// assert_eq!(decode(&body, &spec)?, [0.0, 63.5, 0.0, 0.0, -32.0, 0.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`DecodeError`] naming the first layer that does not fit the spec.
pub fn decode(body: &PacketBody, spec: &ModelSpec) -> Result<Vec<f32>, DecodeError> {
    let layout = Layout::new(spec);
    if body.layers.len() != layout.layers() {
        return Err(DecodeError::LayerCount {
            expected: layout.layers(),
            found: body.layers.len(),
        });
    }
    // Validate every layer's size before allocating the output.
    for (layer, (payload, range)) in body.layers.iter().zip(layout.ranges()).enumerate() {
        let expected = range.len() as u64;
        if payload.numel() != expected {
            return Err(DecodeError::Shape {
                layer,
                expected,
                found: payload.numel(),
            });
        }
    }
    let backend = Backend::cpu();
    let mut out = vec![0f32; layout.len()];
    for (layer, (payload, range)) in body.layers.iter().zip(layout.ranges()).enumerate() {
        let dst = out.get_mut(range).unwrap_or_default();
        decode_layer(&backend, layer, payload, dst)?;
    }
    Ok(out)
}

fn decode_layer(
    backend: &Backend,
    layer: usize,
    payload: &LayerPayload,
    dst: &mut [f32],
) -> Result<(), DecodeError> {
    // An int8 scale must keep 127 steps of itself finite (a value of -128, which no quantiser
    // writes, is caught by the finite checks below).
    let scale_ok = |scale: f32| {
        if scale.is_finite() && scale >= 0.0 && (scale * 127.0).is_finite() {
            Ok(())
        } else {
            Err(DecodeError::Scale { layer, scale })
        }
    };
    match payload {
        LayerPayload::Dense(values) => {
            match values {
                DenseValues::F32(v) => dst.iter_mut().zip(v).for_each(|(d, x)| *d = *x),
                DenseValues::F16(v) => dst.iter_mut().zip(v).for_each(|(d, h)| *d = h.to_f32()),
                DenseValues::BF16(v) => dst.iter_mut().zip(v).for_each(|(d, h)| *d = h.to_f32()),
                DenseValues::Int8 { values, scale } => {
                    scale_ok(*scale)?;
                    backend
                        .dequantize_i8(values, *scale, dst)
                        .map_err(|_| DecodeError::Scale {
                            layer,
                            scale: *scale,
                        })?;
                }
            }
            if let Some(index) = dst.iter().position(|v| !v.is_finite()) {
                return Err(DecodeError::NonFinite { layer, index });
            }
        }
        LayerPayload::TopK(t) => {
            scale_ok(t.scale)?;
            if t.values.len() != t.indices.len() {
                return Err(DecodeError::TopK {
                    layer,
                    reason: "value count differs from index count",
                });
            }
            let mut prev: Option<u32> = None;
            for (&i, &q) in t.indices.iter().zip(&t.values) {
                if prev.is_some_and(|p| i <= p) {
                    return Err(DecodeError::TopK {
                        layer,
                        reason: "indices not strictly increasing",
                    });
                }
                prev = Some(i);
                let v = f32::from(q) * t.scale;
                if !v.is_finite() {
                    return Err(DecodeError::NonFinite {
                        layer,
                        index: i as usize,
                    });
                }
                match dst.get_mut(i as usize) {
                    Some(d) => *d = v,
                    None => {
                        return Err(DecodeError::TopK {
                            layer,
                            reason: "index out of range",
                        });
                    }
                }
            }
        }
        LayerPayload::Sign(s) => {
            backend
                .sign_unpack(&s.words, s.scale, dst)
                .map_err(|source| DecodeError::Sign { layer, source })?;
        }
    }
    Ok(())
}
