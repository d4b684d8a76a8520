//! One error enum per operation of this crate.

use kindred_kernels::{
    AccumulateError, QuantizeError, SignPackError, SignUnpackError, SimHashError, SketchError,
    TopKError,
};
use thiserror::Error;

/// Why a [`crate::Distiller`] or an [`crate::Embedder`] could not be built.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A [`crate::Policy`] field is out of range.
    #[error("policy field `{field}` {reason}")]
    Policy {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An [`crate::EmbeddingConfig`] field is out of range.
    #[error("embedding config field `{field}` {reason}")]
    Embedding {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// Building the SimHash hyperplanes failed.
    #[error("SimHash: {0}")]
    SimHash(#[from] SimHashError),
}

/// Why an update could not be embedded.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum EmbedError {
    /// The update (or the running mean) does not have the spec's element count.
    #[error("expected {expected} values, found {found}")]
    Length {
        /// Elements of the spec.
        expected: usize,
        /// Elements given.
        found: usize,
    },
    /// The update holds a NaN or an infinity.
    #[error("layer {layer} element {index} is not finite ({value})")]
    NonFinite {
        /// Layer index.
        layer: usize,
        /// Position within the layer.
        index: usize,
        /// The value (update − mean).
        value: f32,
    },
    /// The count-sketch kernel failed (an internal invariant broke).
    #[error("layer {layer}: count-sketch: {source}")]
    Sketch {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: SketchError,
    },
    /// The SimHash kernel failed (an internal invariant broke).
    #[error("SimHash: {0}")]
    SimHash(SimHashError),
    /// Quantising the sketch failed (an internal invariant broke).
    #[error("sketch quantisation: {0}")]
    Quantize(QuantizeError),
}

/// Why [`crate::Distiller::distill`] failed.
///
/// A bad update ([`DistillError::Update`]) is detected before any state changes, so the
/// distiller is exactly as before the call. The kernel variants mean an internal invariant broke
/// (they cannot happen on a validated update); the round counter is then not advanced, but
/// residuals may hold this update partially.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum DistillError {
    /// The update is invalid for embedding (wrong length, NaN or infinity): checked before any
    /// state changes.
    #[error("invalid update: {0}")]
    Update(#[from] EmbedError),
    /// The fused accumulate pass failed (a kernel invariant was broken).
    #[error("layer {layer}: accumulate: {source}")]
    Accumulate {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: AccumulateError,
    },
    /// Selecting a layer's top-k failed (a kernel invariant was broken).
    #[error("layer {layer}: top-k: {source}")]
    TopK {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: TopKError,
    },
    /// Quantising a layer failed (a kernel invariant was broken).
    #[error("layer {layer}: quantise: {source}")]
    Quantize {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: QuantizeError,
    },
    /// Sign-packing a layer failed (a kernel invariant was broken).
    #[error("layer {layer}: sign pack: {source}")]
    Sign {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: SignPackError,
    },
}

/// Why a packet body could not be decoded into a dense update.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The body's layer count differs from the spec's.
    #[error("spec has {expected} layers, body has {found}")]
    LayerCount {
        /// Layers in the spec.
        expected: usize,
        /// Layers in the body.
        found: usize,
    },
    /// A payload's element count differs from its layer's.
    #[error("layer {layer}: spec has {expected} elements, payload has {found}")]
    Shape {
        /// Layer index.
        layer: usize,
        /// Elements in the spec.
        expected: u64,
        /// Elements in the payload.
        found: u64,
    },
    /// A dense value is NaN or infinite.
    #[error("layer {layer}: value {index} is not finite")]
    NonFinite {
        /// Layer index.
        layer: usize,
        /// Position in the layer.
        index: usize,
    },
    /// Top-k indices are out of range or not strictly increasing, or values and indices differ in
    /// number.
    #[error("layer {layer}: malformed top-k ({reason})")]
    TopK {
        /// Layer index.
        layer: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// A scale is negative or not finite.
    #[error("layer {layer}: scale {scale} is not a finite non-negative number")]
    Scale {
        /// Layer index.
        layer: usize,
        /// The scale.
        scale: f32,
    },
    /// Sign bits are malformed.
    #[error("layer {layer}: {source}")]
    Sign {
        /// Layer index.
        layer: usize,
        /// Kernel error.
        source: SignUnpackError,
    },
}

/// Why saved distiller state could not be restored.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum RestoreError {
    /// More bytes than any state of this spec can take.
    #[error("state is {len} bytes, more than the {max} a state for this model can take")]
    Oversize {
        /// Bytes given.
        len: usize,
        /// Largest possible state.
        max: usize,
    },
    /// The trailing checksum does not match: the bytes are truncated or corrupted.
    #[error("state checksum mismatch (truncated or corrupted)")]
    Checksum,
    /// The bytes do not parse as a state.
    #[error("malformed state: {0}")]
    Malformed(&'static str),
    /// The state was written by an unknown format version.
    #[error("state format version {found} is not supported (expected {supported})")]
    Version {
        /// Version found.
        found: u16,
        /// Version this build reads.
        supported: u16,
    },
    /// The state belongs to a different model.
    #[error("state is for another model")]
    ModelMismatch,
    /// A vector's length does not match the spec.
    #[error("{what}: expected {expected} bytes, found {found}")]
    Length {
        /// Which vector.
        what: &'static str,
        /// Expected bytes.
        expected: usize,
        /// Bytes found.
        found: usize,
    },
    /// A stored value is NaN or infinite.
    #[error("{what}: value {index} is not finite")]
    NonFinite {
        /// Which vector.
        what: &'static str,
        /// Position.
        index: usize,
    },
}

/// Why [`crate::synthesize`] could not merge at all. Problems with single peers are not errors:
/// they are reported as rejections in [`crate::Synthesis::verdicts`].
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SynthError {
    /// The node's own update holds a NaN or an infinity.
    #[error("own update element {index} is not finite")]
    OwnNonFinite {
        /// Position.
        index: usize,
    },
    /// A [`crate::SynthConfig`] field is out of range.
    #[error("synthesis config field `{field}` {reason}")]
    Config {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: &'static str,
    },
}
