//! Layer payloads: what one layer of an update becomes on the wire.
//!
//! The distiller picks one encoding per layer and round. Every one is self-describing in element
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

/// The k largest-magnitude entries of a layer at 4 bits each: a sign and one of eight
/// log-spaced magnitudes.
///
/// Entry `i` sits at flat position `indices[i]` (strictly increasing, below `len`, delta-coded on
/// the wire as in [`TopK`]); its code is nibble `i % 2` of `codes[i / 2]` (the low nibble first).
/// Bit 3 of a code is the sign (set: negative), bits 0-2 its level `l`, and its magnitude is
/// `scale · ratio^(7 − l)` ([`TopK4::levels`]): level 7 is `scale`, level 0 `scale · ratio^7`.
/// With error feedback a top-k value's rounding error is sent in a later round, and the eight
/// levels spread from a layer's smallest selected magnitude to its largest cost no accuracy
/// against int8 at 1.5 bytes an entry instead of 2 (BENCHMARKS.md).
///
/// `scale` is finite and non-negative and `ratio` in (0, 1], so every magnitude is finite and at
/// most `scale`. When the count is odd the unused high nibble of the last byte is zero.
///
/// ```
/// use kindred_proto::TopK4;
/// // Entries +scale (level 7) and −scale·ratio (level 6, sign bit set).
/// let t = TopK4 { len: 100, indices: vec![3, 50], codes: vec![0x7 | (0xE << 4)], scale: 2.0, ratio: 0.5 };
/// assert_eq!(t.value(0), Some(2.0));
/// assert_eq!(t.value(1), Some(-1.0));
/// assert_eq!(t.value(2), None);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct TopK4 {
    /// Elements of the whole layer.
    pub len: u32,
    /// Flat positions of the kept entries, strictly increasing.
    pub indices: Vec<u32>,
    /// Packed 4-bit codes, `indices.len().div_ceil(2)` bytes.
    pub codes: Vec<u8>,
    /// The largest magnitude (level 7): finite and non-negative.
    pub scale: f32,
    /// Ratio of one level's magnitude to the next one up: in (0, 1].
    pub ratio: f32,
}

impl TopK4 {
    /// Bit of a code that marks a negative value.
    pub const SIGN: u8 = 0x8;

    /// The eight magnitudes of a layer with this `scale` and `ratio`, level 0 first:
    /// `scale · ratio^(7 − l)`. Encoders and decoders compute them with this one function,
    /// so what a sender keeps in its residual is exactly what receivers decode.
    pub fn levels(scale: f32, ratio: f32) -> [f32; 8] {
        let mut levels = [0f32; 8];
        let mut m = scale;
        for slot in levels.iter_mut().rev() {
            *slot = m;
            m *= ratio;
        }
        levels
    }

    /// The value a 4-bit code stands for among `levels`.
    pub fn decode_code(code: u8, levels: &[f32; 8]) -> f32 {
        let m = levels.get(usize::from(code & 0x7)).copied().unwrap_or(0.0);
        if code & Self::SIGN != 0 { -m } else { m }
    }

    /// Code of entry `i`, or `None` past the entries.
    pub fn code(&self, i: usize) -> Option<u8> {
        if i >= self.indices.len() {
            return None;
        }
        let byte = self.codes.get(i / 2)?;
        Some(if i.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        })
    }

    /// Value of entry `i`, or `None` past the entries.
    pub fn value(&self, i: usize) -> Option<f32> {
        let levels = Self::levels(self.scale, self.ratio);
        self.code(i).map(|c| Self::decode_code(c, &levels))
    }
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
    /// Sparse top-k with 4-bit log-spaced values.
    TopK4(TopK4),
    /// 1-bit signs with one scale.
    Sign(SignBits),
}

impl LayerPayload {
    /// Number of elements of the layer this payload describes.
    pub fn numel(&self) -> u64 {
        match self {
            Self::Dense(d) => d.len() as u64,
            Self::TopK(t) => u64::from(t.len),
            Self::TopK4(t) => u64::from(t.len),
            Self::Sign(s) => u64::from(s.len),
        }
    }

    /// Number of values actually carried (dense: all; top-k: k; sign: all, at one bit each).
    pub fn carried(&self) -> u64 {
        match self {
            Self::Dense(d) => d.len() as u64,
            Self::TopK(t) => t.indices.len() as u64,
            Self::TopK4(t) => t.indices.len() as u64,
            Self::Sign(s) => u64::from(s.len),
        }
    }

    /// The payload's kind.
    pub fn kind(&self) -> PayloadKind {
        match self {
            Self::Dense(_) => PayloadKind::Dense,
            Self::TopK(_) | Self::TopK4(_) => PayloadKind::TopK,
            Self::Sign(_) => PayloadKind::Sign,
        }
    }
}

/// The three payload encodings, without their data (a kind, like [`LayerPayload::Dense`]'s,
/// may come in several value formats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// [`LayerPayload::Dense`].
    Dense,
    /// [`LayerPayload::TopK`] or [`LayerPayload::TopK4`].
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
    /// Layers sent as top-k (int8 or 4-bit values).
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
