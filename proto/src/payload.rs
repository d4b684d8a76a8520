//! Layer payloads: what one layer of an update becomes on the wire.
//!
//! The distiller picks one encoding per layer and round. All three are self-describing in element
//! count so that a receiver can check them against its own [`crate::ModelSpec`] before it decodes a
//! single value.

use half::{bf16, f16};

/// Dense values of one layer: every element, in one of three float precisions or as int8 with
/// one scale.
#[derive(Debug, Clone, PartialEq)]
pub enum DenseValues {
    /// Full precision.
    F32(Vec<f32>),
    /// Half precision: the default for small and one-dimensional layers.
    F16(Vec<f16>),
    /// bfloat16: f32's range at half the bytes.
    BF16(Vec<bf16>),
    /// One byte per element: element `i` is `values[i] as f32 * scale`. Half of f16's bytes, for
    /// values whose error budget is a layer-wide step rather than a relative one (model
    /// snapshots). Values are within ±127, `scale` is finite and non-negative, and `127 · scale`
    /// is finite, so every element is.
    Int8 {
        /// Quantised values.
        values: Vec<i8>,
        /// Dequantisation scale.
        scale: f32,
    },
}

impl DenseValues {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::BF16(v) => v.len(),
            Self::Int8 { values, .. } => values.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element at `i` widened to f32, or `None` past the end.
    pub fn get_f32(&self, i: usize) -> Option<f32> {
        match self {
            Self::F32(v) => v.get(i).copied(),
            Self::F16(v) => v.get(i).map(|x| x.to_f32()),
            Self::BF16(v) => v.get(i).map(|x| x.to_f32()),
            Self::Int8 { values, scale } => values.get(i).map(|&q| f32::from(q) * scale),
        }
    }
}

/// The k largest-magnitude entries of a layer, int8-quantised with one scale.
///
/// Value `i` is `values[i] as f32 * scale` at flat position `indices[i]`; every other entry is
/// zero. `indices` are strictly increasing and below `len`. On the wire they are delta-coded
/// LEB128 varints (first index, then successive differences), so a 1% top-k of a large layer
/// costs little more than one byte per index.
#[derive(Debug, Clone, PartialEq)]
pub struct TopK {
    /// Elements of the whole layer.
    pub len: u32,
    /// Flat positions of the kept entries, strictly increasing.
    pub indices: Vec<u32>,
    /// Quantised values, one per index, within ±127.
    pub values: Vec<i8>,
    /// Dequantisation scale: finite and non-negative, with `127 · scale` finite.
    pub scale: f32,
}

/// One sign bit per element with one magnitude for the whole layer (1-bit SignSGD with a scale).
///
/// Element `i` is `-scale` when bit `i % 64` of `words[i / 64]` is set and `+scale` otherwise (the
/// IEEE sign-bit convention). Bits past `len` in the last word are zero.
#[derive(Debug, Clone, PartialEq)]
pub struct SignBits {
    /// Elements of the whole layer.
    pub len: u32,
    /// Packed sign bits, `len.div_ceil(64)` words.
    pub words: Vec<u64>,
    /// Magnitude of every element (the mean absolute value): finite and non-negative.
    pub scale: f32,
}

/// One layer of an outcome packet body.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerPayload {
    /// Every value, at f32, f16 or bf16, or int8 with one scale.
    Dense(DenseValues),
    /// Sparse top-k with int8 values.
    TopK(TopK),
    /// 1-bit signs with one scale.
    Sign(SignBits),
}

impl LayerPayload {
    /// Number of elements of the layer this payload describes.
    pub fn numel(&self) -> u64 {
        match self {
            Self::Dense(d) => d.len() as u64,
            Self::TopK(t) => u64::from(t.len),
            Self::Sign(s) => u64::from(s.len),
        }
    }

    /// Number of values actually carried (dense: all; top-k: k; sign: all, at one bit each).
    pub fn carried(&self) -> u64 {
        match self {
            Self::Dense(d) => d.len() as u64,
            Self::TopK(t) => t.indices.len() as u64,
            Self::Sign(s) => u64::from(s.len),
        }
    }

    /// The payload's kind.
    pub fn kind(&self) -> PayloadKind {
        match self {
            Self::Dense(_) => PayloadKind::Dense,
            Self::TopK(_) => PayloadKind::TopK,
            Self::Sign(_) => PayloadKind::Sign,
        }
    }
}

/// The three payload encodings, without their data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// [`LayerPayload::Dense`].
    Dense,
    /// [`LayerPayload::TopK`].
    TopK,
    /// [`LayerPayload::Sign`].
    Sign,
}

/// The body of an outcome packet: one payload per layer, in model order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PacketBody {
    /// Payloads in the order of the model spec's layers.
    pub layers: Vec<LayerPayload>,
}

/// How a body was compressed, carried in the signed header so that a node can judge a packet's
/// cost before it fetches the body. A receiver checks it against the body it decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CompressionSummary {
    /// Layers sent dense.
    pub dense_layers: u16,
    /// Layers sent as top-k + int8.
    pub topk_layers: u16,
    /// Layers sent as 1-bit signs.
    pub sign_layers: u16,
    /// Parameters the update covers (sum of layer element counts).
    pub params: u64,
    /// Values carried (dense elements + top-k entries + sign bits).
    pub carried: u64,
}

impl CompressionSummary {
    /// Summarise a body.
    pub fn of(body: &PacketBody) -> Self {
        let mut s = Self::default();
        for layer in &body.layers {
            s.add(layer);
        }
        s
    }

    /// Count one more layer (what [`CompressionSummary::of`] does for each of a body's).
    pub fn add(&mut self, layer: &LayerPayload) {
        match layer.kind() {
            PayloadKind::Dense => self.dense_layers = self.dense_layers.saturating_add(1),
            PayloadKind::TopK => self.topk_layers = self.topk_layers.saturating_add(1),
            PayloadKind::Sign => self.sign_layers = self.sign_layers.saturating_add(1),
        }
        self.params = self.params.saturating_add(layer.numel());
        self.carried = self.carried.saturating_add(layer.carried());
    }

    /// Total layers.
    pub fn layers(&self) -> usize {
        usize::from(self.dense_layers)
            + usize::from(self.topk_layers)
            + usize::from(self.sign_layers)
    }
}
