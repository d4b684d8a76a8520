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
use kindred_proto::{DenseValues, LayerPayload, ModelSpec, PacketBody, TopK, TopK4};

use crate::error::DecodeError;
use crate::layout::Layout;
use crate::update::{Update, UpdateBuilder};

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
    let layout = checked_layout(body, spec)?;
    let backend = Backend::cpu();
    let mut out = vec![0f32; layout.len()];
    for (layer, (payload, range)) in body.layers.iter().zip(layout.ranges()).enumerate() {
        let dst = out.get_mut(range).unwrap_or_default();
        decode_layer(&backend, layer, payload, dst)?;
    }
    Ok(out)
}

/// [`decode`], kept as its nonzero entries when the body carries few ([`Update`]): a top-k
/// body at a few percent density costs 12 bytes an entry instead of 4 an element. Top-k layers
/// are read entry by entry; other layers through a buffer of the layer's size. The same
/// checks, errors and values as [`decode`].
///
/// ```
/// use kindred_distill::{decode, decode_update};
/// use kindred_proto::*;
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [8], DType::F32)])?;
/// let body = PacketBody {
///     layers: vec![LayerPayload::TopK(TopK { len: 8, indices: vec![1, 4], values: vec![127, -64], scale: 0.5 })],
/// };
/// let u = decode_update(&body, &spec)?;
/// assert!(u.is_sparse());
/// assert_eq!(u.to_dense(), decode(&body, &spec)?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`DecodeError`] naming the first layer that does not fit the spec.
pub fn decode_update(body: &PacketBody, spec: &ModelSpec) -> Result<Update, DecodeError> {
    let layout = checked_layout(body, spec)?;
    // Entries the body can hold: a top-k layer's entries, every element of any other layer.
    let entries: u64 = body.layers.iter().map(LayerPayload::carried).sum();
    if entries > layout.len() as u64 / 4 {
        return decode(body, spec).map(Update::Dense);
    }
    let backend = Backend::cpu();
    let mut out = UpdateBuilder::with_capacity(layout.len(), entries as usize);
    for (layer, (payload, range)) in body.layers.iter().zip(layout.ranges()).enumerate() {
        let offset = range.start;
        if let Some(t) = TopKRef::of(payload) {
            for_each_topk(layer, t, range.len(), |i, v| out.push(offset + i, v))?;
        } else {
            let mut dst = vec![0f32; range.len()];
            decode_layer(&backend, layer, payload, &mut dst)?;
            for (i, &v) in dst.iter().enumerate() {
                out.push(offset + i, v);
            }
        }
    }
    Ok(out.finish())
}

/// [`decode`]'s values one at a time, a layer decoded when the iterator reaches it: a whole
/// model's body (a hub's int8 snapshot, a quarter of the model in f32) is read without ever
/// being held in f32, one layer's buffer at most.
///
/// A layer that does not decode ends the iteration early ([`DecodedValues::error`] says why),
/// so a consumer that counts the values it read (every one here checks lengths) refuses it.
///
/// ```
/// use kindred_distill::{decode, decode_iter};
/// use kindred_proto::*;
/// let spec = ModelSpec::new(vec![LayerSpec::new("a", [2], DType::F32), LayerSpec::new("b", [6], DType::F32)])?;
/// let body = PacketBody {
///     layers: vec![
///         LayerPayload::Dense(DenseValues::F32(vec![1.0, -1.0])),
///         LayerPayload::TopK(TopK { len: 6, indices: vec![1, 4], values: vec![127, -64], scale: 0.5 }),
///     ],
/// };
/// let values: Vec<f32> = decode_iter(&body, &spec)?.collect();
/// assert_eq!(values, decode(&body, &spec)?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Errors
/// [`DecodeError`] when the body's layer count or a layer's size does not fit the spec (the
/// layers' values are checked as they are reached).
pub fn decode_iter<'a>(
    body: &'a PacketBody,
    spec: &ModelSpec,
) -> Result<DecodedValues<'a>, DecodeError> {
    let layout = checked_layout(body, spec)?;
    Ok(DecodedValues {
        layers: body
            .layers
            .iter()
            .zip(layout.ranges().map(|r| r.len()).collect::<Vec<_>>()),
        layer: 0,
        buffer: Vec::new(),
        next: 0,
        backend: Backend::cpu(),
        error: None,
    })
}

/// The iterator of [`decode_iter`].
#[derive(Debug)]
pub struct DecodedValues<'a> {
    layers: std::iter::Zip<std::slice::Iter<'a, LayerPayload>, std::vec::IntoIter<usize>>,
    /// Index of the next layer to decode.
    layer: usize,
    buffer: Vec<f32>,
    /// Next value of `buffer` to hand out.
    next: usize,
    backend: Backend,
    error: Option<DecodeError>,
}

impl DecodedValues<'_> {
    /// Why the iteration ended before the body's end, if it did.
    pub fn error(&self) -> Option<&DecodeError> {
        self.error.as_ref()
    }
}

impl Iterator for DecodedValues<'_> {
    type Item = f32;

    fn next(&mut self) -> Option<f32> {
        loop {
            if let Some(&v) = self.buffer.get(self.next) {
                self.next += 1;
                return Some(v);
            }
            if self.error.is_some() {
                return None;
            }
            let (payload, len) = self.layers.next()?;
            self.buffer.clear();
            self.buffer.resize(len, 0.0);
            self.next = 0;
            if let Err(e) = decode_layer(&self.backend, self.layer, payload, &mut self.buffer) {
                self.buffer.clear();
                self.error = Some(e);
            }
            self.layer += 1;
        }
    }
}

/// The spec's layout once `body` has its layer count and every layer its size.
fn checked_layout(body: &PacketBody, spec: &ModelSpec) -> Result<Layout, DecodeError> {
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
    Ok(layout)
}

/// An int8 scale must keep 127 steps of itself finite (a value of -128, which no quantiser
/// writes, is caught by the finite checks after it).
fn check_scale(layer: usize, scale: f32) -> Result<(), DecodeError> {
    if scale.is_finite() && scale >= 0.0 && (scale * 127.0).is_finite() {
        Ok(())
    } else {
        Err(DecodeError::Scale { layer, scale })
    }
}

/// A top-k payload, int8 or 4-bit.
#[derive(Clone, Copy)]
enum TopKRef<'a> {
    Int8(&'a TopK),
    Log4(&'a TopK4),
}

impl<'a> TopKRef<'a> {
    /// `payload` if it is a top-k one.
    fn of(payload: &'a LayerPayload) -> Option<Self> {
        match payload {
            LayerPayload::TopK(t) => Some(Self::Int8(t)),
            LayerPayload::TopK4(t) => Some(Self::Log4(t)),
            LayerPayload::Dense(_) | LayerPayload::Sign(_) => None,
        }
    }
}

/// Every entry of top-k payload `t` of layer `layer` (of `len` elements) in order, dequantised,
/// once the payload is checked: as many values as indices, indices strictly increasing and
/// below `len`, a finite scale (and a 4-bit ratio in (0, 1]) and finite values.
fn for_each_topk(
    layer: usize,
    t: TopKRef<'_>,
    len: usize,
    entry: impl FnMut(usize, f32),
) -> Result<(), DecodeError> {
    let count_error = DecodeError::TopK {
        layer,
        reason: "value count differs from index count",
    };
    match t {
        TopKRef::Int8(t) => {
            check_scale(layer, t.scale)?;
            if t.values.len() != t.indices.len() {
                return Err(count_error);
            }
            let value = |j: usize| t.values.get(j).map(|&q| f32::from(q) * t.scale);
            for_each_entry(layer, &t.indices, len, value, entry)
        }
        TopKRef::Log4(t) => {
            // Every level is at most the scale: a finite one is enough.
            if !(t.scale.is_finite() && t.scale >= 0.0) {
                return Err(DecodeError::Scale {
                    layer,
                    scale: t.scale,
                });
            }
            if !(t.ratio > 0.0 && t.ratio <= 1.0) {
                return Err(DecodeError::TopK {
                    layer,
                    reason: "4-bit level ratio outside (0, 1]",
                });
            }
            if t.codes.len() != t.indices.len().div_ceil(2) {
                return Err(count_error);
            }
            let levels = TopK4::levels(t.scale, t.ratio);
            let value = |j: usize| t.code(j).map(|c| TopK4::decode_code(c, &levels));
            for_each_entry(layer, &t.indices, len, value, entry)
        }
    }
}

/// Top-k payload `t` written into `dst`, its layer's elements (the others left as they are).
fn scatter_topk(layer: usize, t: TopKRef<'_>, dst: &mut [f32]) -> Result<(), DecodeError> {
    let len = dst.len();
    for_each_topk(layer, t, len, |i, v| {
        if let Some(d) = dst.get_mut(i) {
            *d = v;
        }
    })
}

/// `entry(index, value(j))` for the `j`-th of `indices`, checked strictly increasing, below
/// `len`, with a finite value.
fn for_each_entry(
    layer: usize,
    indices: &[u32],
    len: usize,
    value: impl Fn(usize) -> Option<f32>,
    mut entry: impl FnMut(usize, f32),
) -> Result<(), DecodeError> {
    let mut prev: Option<u32> = None;
    for (j, &i) in indices.iter().enumerate() {
        if prev.is_some_and(|p| i <= p) {
            return Err(DecodeError::TopK {
                layer,
                reason: "indices not strictly increasing",
            });
        }
        prev = Some(i);
        let v = value(j).unwrap_or(f32::NAN);
        if !v.is_finite() {
            return Err(DecodeError::NonFinite {
                layer,
                index: i as usize,
            });
        }
        if i as usize >= len {
            return Err(DecodeError::TopK {
                layer,
                reason: "index out of range",
            });
        }
        entry(i as usize, v);
    }
    Ok(())
}

fn decode_layer(
    backend: &Backend,
    layer: usize,
    payload: &LayerPayload,
    dst: &mut [f32],
) -> Result<(), DecodeError> {
    match payload {
        LayerPayload::Dense(values) => {
            match values {
                DenseValues::F32(v) => dst.iter_mut().zip(v).for_each(|(d, x)| *d = *x),
                DenseValues::F16(v) => dst.iter_mut().zip(v).for_each(|(d, h)| *d = h.to_f32()),
                DenseValues::BF16(v) => dst.iter_mut().zip(v).for_each(|(d, h)| *d = h.to_f32()),
                DenseValues::Int8 { values, scale } => {
                    check_scale(layer, *scale)?;
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
        LayerPayload::TopK(t) => scatter_topk(layer, TopKRef::Int8(t), dst)?,
        LayerPayload::TopK4(t) => scatter_topk(layer, TopKRef::Log4(t), dst)?,
        LayerPayload::Sign(s) => {
            backend
                .sign_unpack(&s.words, s.scale, dst)
                .map_err(|source| DecodeError::Sign { layer, source })?;
        }
    }
    Ok(())
}
