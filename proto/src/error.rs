//! Typed errors: one enum per operation, one variant per cause, each carrying what a caller needs
//! to act (ban a peer, count a reject reason, report a bad local configuration).

use libp2p_identity::PeerId;

/// Which part of a packet a length or format error refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Part {
    /// The signed header.
    Header,
    /// The body (all layer payloads).
    Body,
    /// One layer payload inside the body.
    Layer(usize),
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Header => f.write_str("header"),
            Self::Body => f.write_str("body"),
            Self::Layer(i) => write!(f, "layer {i}"),
        }
    }
}

/// Why bytes received from a peer were rejected.
///
/// Every variant is a distinct reason a node counts and may penalise a peer for; see
/// [`DecodeError::reason`] for a stable label usable as a metric name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The format version is not one this node speaks.
    #[error("unknown packet format version {found} (this node speaks version {supported})")]
    UnknownVersion {
        /// Version found on the wire.
        found: u16,
        /// Version this crate implements ([`crate::FORMAT_VERSION`]).
        supported: u16,
    },
    /// A length exceeds its limit; rejected before anything was allocated.
    #[error("{what} is {len} long, over the limit of {max}")]
    Oversize {
        /// What was too long.
        what: &'static str,
        /// The length claimed or seen.
        len: u64,
        /// The limit it broke.
        max: u64,
    },
    /// The bytes ended before the structure did.
    #[error("{part} is truncated")]
    Truncated {
        /// Where the bytes ran out.
        part: Part,
    },
    /// Bytes were left over after a complete structure.
    #[error("{part} has {extra} trailing bytes")]
    TrailingBytes {
        /// Which structure had bytes after its end.
        part: Part,
        /// How many bytes were left.
        extra: usize,
    },
    /// The bytes do not follow the encoding (bad varint, unknown enum tag, invalid UTF-8...).
    #[error("{part} is malformed: {detail}")]
    Malformed {
        /// Where.
        part: Part,
        /// What the decoder saw.
        detail: &'static str,
    },
    /// A header field holds a value outside its valid range.
    #[error("header field `{field}` is invalid: {reason}")]
    InvalidField {
        /// The field's name.
        field: &'static str,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// The packet is for another model than the one it is decoded against.
    #[error("packet is for another model than the local spec")]
    ModelMismatch,
    /// The body's layer count differs from the model spec.
    #[error("body has {found} layers, the model spec has {expected}")]
    LayerCountMismatch {
        /// Layers in the spec.
        expected: usize,
        /// Layers in the body.
        found: usize,
    },
    /// A layer payload covers a different number of elements than the spec's shape.
    #[error("layer {layer} covers {found} elements, its shape in the spec has {expected}")]
    ShapeMismatch {
        /// Layer position in model order.
        layer: usize,
        /// Elements in the spec's shape.
        expected: u64,
        /// Elements the payload covers.
        found: u64,
    },
    /// A top-k index is not below the layer's element count.
    #[error("layer {layer}: index {index} is out of range for {len} elements")]
    IndexOutOfRange {
        /// Layer position.
        layer: usize,
        /// The offending index.
        index: u64,
        /// The layer's element count.
        len: u64,
    },
    /// Top-k indices must be strictly increasing; the entry at `position` is not.
    #[error("layer {layer}: index at position {position} is not strictly increasing")]
    IndexNotIncreasing {
        /// Layer position.
        layer: usize,
        /// Position of the offending index in the payload.
        position: usize,
    },
    /// A quantisation scale is NaN, infinite or negative, or so large that an int8 value times
    /// it is not finite.
    #[error(
        "layer {layer}: scale {scale} is not finite and non-negative, or 127 times it overflows"
    )]
    NonFiniteScale {
        /// Layer position.
        layer: usize,
        /// The scale found.
        scale: f32,
    },
    /// A dense value is NaN or infinite.
    #[error("layer {layer}: dense value at {index} is not finite")]
    NonFiniteValue {
        /// Layer position.
        layer: usize,
        /// Element index.
        index: usize,
    },
    /// The padding bits after the last sign in a bit-packed layer are not zero.
    #[error("layer {layer}: sign padding bits are not zero")]
    SignPadding {
        /// Layer position.
        layer: usize,
    },
    /// The body's length differs from the length the signed header commits to.
    #[error("body is {found} bytes, the header commits to {expected}")]
    BodyLengthMismatch {
        /// Length named in the header.
        expected: u64,
        /// Length received.
        found: u64,
    },
    /// The body's blake3 hash differs from the hash the signed header commits to.
    #[error("body hash does not match the signed header")]
    BodyHashMismatch,
    /// The compression summary in the header does not describe the body.
    #[error("header compression summary does not match the body")]
    SummaryMismatch,
    /// The header's public key is not a valid ed25519 key.
    #[error("header carries an invalid ed25519 public key")]
    InvalidPublicKey,
    /// The header's public key is a point of small order: signatures under it can be forged
    /// without a secret key, so it can speak for no one.
    #[error("header carries a weak (small-order) ed25519 public key")]
    WeakPublicKey,
    /// The bytes decode, but not in their one canonical form (an overlong varint or length
    /// prefix, a non-canonical point encoding): accepting them would give one signed content
    /// several encodings and so several packet ids.
    #[error("{part} is not canonically encoded: {detail}")]
    NonCanonical {
        /// Where.
        part: Part,
        /// Which field.
        detail: &'static str,
    },
    /// The signature does not verify against the header and its public key.
    #[error("header signature does not verify")]
    BadSignature,
    /// The signing key does not belong to the peer named as sender.
    #[error("header names sender {claimed} but is signed by {actual}")]
    SenderMismatch {
        /// The `PeerId` in the header (boxed: keeps the error small on the hot path).
        claimed: Box<PeerId>,
        /// The `PeerId` of the key that signed it.
        actual: Box<PeerId>,
    },
}

impl DecodeError {
    /// A short, stable label for the cause, suitable as a metric label or log field.
    ///
    /// ```
    /// use kindred_proto::DecodeError;
    /// assert_eq!(DecodeError::BadSignature.reason(), "bad_signature");
    /// ```
    pub fn reason(&self) -> &'static str {
        match self {
            Self::UnknownVersion { .. } => "unknown_version",
            Self::Oversize { .. } => "oversize",
            Self::Truncated { .. } => "truncated",
            Self::TrailingBytes { .. } => "trailing_bytes",
            Self::Malformed { .. } => "malformed",
            Self::InvalidField { .. } => "invalid_field",
            Self::ModelMismatch => "model_mismatch",
            Self::LayerCountMismatch { .. } => "layer_count_mismatch",
            Self::ShapeMismatch { .. } => "shape_mismatch",
            Self::IndexOutOfRange { .. } => "index_out_of_range",
            Self::IndexNotIncreasing { .. } => "index_not_increasing",
            Self::NonFiniteScale { .. } => "non_finite_scale",
            Self::NonFiniteValue { .. } => "non_finite_value",
            Self::SignPadding { .. } => "sign_padding",
            Self::BodyLengthMismatch { .. } => "body_length_mismatch",
            Self::BodyHashMismatch => "body_hash_mismatch",
            Self::SummaryMismatch => "summary_mismatch",
            Self::InvalidPublicKey => "invalid_public_key",
            Self::WeakPublicKey => "weak_public_key",
            Self::NonCanonical { .. } => "non_canonical",
            Self::BadSignature => "bad_signature",
            Self::SenderMismatch { .. } => "sender_mismatch",
        }
    }
}

/// Why a local model spec could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The spec has no layers or more than [`crate::MAX_LAYERS`].
    #[error("a model spec needs 1..={max} layers, got {found}")]
    LayerCount {
        /// Layers given.
        found: usize,
        /// The limit.
        max: usize,
    },
    /// A layer name is empty or longer than [`crate::MAX_NAME_BYTES`].
    #[error("layer {layer}: name must be 1..={max} bytes")]
    Name {
        /// Layer position.
        layer: usize,
        /// The limit.
        max: usize,
    },
    /// Two layers share a name.
    #[error("layer name `{name}` appears twice")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// A shape has no dimensions, too many, a zero dimension, or too many elements.
    #[error("layer `{name}`: shape {shape:?} is invalid ({reason})")]
    Shape {
        /// Layer name.
        name: String,
        /// The shape given.
        shape: Vec<u32>,
        /// Why.
        reason: &'static str,
    },
}

/// Why a packet could not be sealed (encoded and signed) locally.
///
/// Sealing validates the body exactly as a receiver would, so a node never sends a packet its
/// peers would reject.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The body or header fields would be rejected by a receiver.
    #[error("packet would be rejected by receivers: {0}")]
    Invalid(#[from] DecodeError),
}
