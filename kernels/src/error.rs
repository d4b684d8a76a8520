//! One error enum per kernel.
//!
//! Kernels run on data that may come from a buggy trainer (NaN gradients) or a hostile peer
//! (decoded payloads), so every precondition a kernel has is checked and reported as a typed value
//! carrying what a caller needs to act on it (the offending index and value, both lengths), never a
//! panic. Every enum is `#[non_exhaustive]` so that backends added later (CUDA) can report their
//! own failures without breaking callers.

use thiserror::Error;

/// Why [`crate::Kernels::accumulate`] failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum AccumulateError {
    /// `residual` and `update` have different lengths. Nothing was written.
    #[error("residual has {residual} elements but the update has {update}")]
    LengthMismatch {
        /// Residual length.
        residual: usize,
        /// Update length.
        update: usize,
    },
    /// The update holds a NaN or an infinity. `accumulate` wrote nothing; the fused pass has
    /// already updated the residual (see [`crate::Kernels::accumulate_fused`]).
    #[error("update element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// The new residual is not finite at `index`: `residual + update` overflowed `f32`, or the
    /// residual passed in was not finite. The residual has been updated: the caller must reset it.
    #[error("residual element {index} is not finite after the update")]
    Overflow {
        /// First non-finite position.
        index: usize,
    },
    /// A fused pass was given a sketch whose output length or centre length does not match, zero
    /// buckets, positions that overflow `u64`, or a threshold on a slice too long for `u32`
    /// indices. Nothing was written.
    #[error("fused pass arguments do not fit together")]
    SketchShape,
    /// A fused pass was given a non-finite centre. The residual has been updated (its statistics
    /// are lost) and the sketch output is untouched.
    #[error("centre element {index} is not finite")]
    NonFiniteCenter {
        /// First offending position.
        index: usize,
    },
}

/// Why a top-k selection failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum TopKError {
    /// `k` is larger than the slice.
    #[error("k = {k} is out of range for {len} elements")]
    KOutOfRange {
        /// Requested count.
        k: usize,
        /// Slice length.
        len: usize,
    },
    /// The slice is too long for `u32` indices.
    #[error("{len} elements do not fit u32 indices")]
    TooLong {
        /// Slice length.
        len: usize,
    },
    /// The slice holds a NaN or an infinity. The residual is untouched.
    #[error("element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// Why an int8 quantisation failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// Output and input lengths differ.
    #[error("input has {input} elements but the output has room for {output}")]
    LengthMismatch {
        /// Input length.
        input: usize,
        /// Output length.
        output: usize,
    },
    /// The input holds a NaN or an infinity.
    #[error("element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// Why an int8 dequantisation failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum DequantizeError {
    /// Output and input lengths differ.
    #[error("input has {input} elements but the output has room for {output}")]
    LengthMismatch {
        /// Input length.
        input: usize,
        /// Output length.
        output: usize,
    },
    /// The scale is negative, NaN or infinite.
    #[error("scale {scale} is not a finite non-negative number")]
    BadScale {
        /// The scale given.
        scale: f32,
    },
}

/// Why sign packing failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SignPackError {
    /// The word buffer is not `len.div_ceil(64)` long.
    #[error("{len} elements need {expected} words, got {found}")]
    WordCount {
        /// Elements to pack.
        len: usize,
        /// Words needed.
        expected: usize,
        /// Words given.
        found: usize,
    },
    /// The input holds a NaN or an infinity.
    #[error("element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position.
        index: usize,
        /// Its value.
        value: f32,
    },
}

/// Why sign unpacking failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SignUnpackError {
    /// The word buffer is not `out.len().div_ceil(64)` long.
    #[error("{len} elements need {expected} words, got {found}")]
    WordCount {
        /// Elements to unpack.
        len: usize,
        /// Words needed.
        expected: usize,
        /// Words given.
        found: usize,
    },
    /// Bits past the last element are set.
    #[error("padding bits past element {len} are set")]
    Padding {
        /// Elements to unpack.
        len: usize,
    },
    /// The scale is negative, NaN or infinite.
    #[error("scale {scale} is not a finite non-negative number")]
    BadScale {
        /// The scale given.
        scale: f32,
    },
}

/// Why a count-sketch failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SketchError {
    /// The sketch has zero buckets.
    #[error("a count-sketch needs at least one bucket")]
    ZeroBuckets,
    /// The output buffer does not have `buckets` entries.
    #[error("the sketch has {expected} buckets but the output has {found}")]
    OutputLength {
        /// Buckets of the sketch.
        expected: usize,
        /// Output length.
        found: usize,
    },
    /// The centre vector's length differs from the input's.
    #[error("input has {input} elements but the centre has {center}")]
    CenterLength {
        /// Input length.
        input: usize,
        /// Centre length.
        center: usize,
    },
    /// `first_index + len` overflows `u64`.
    #[error("element positions overflow u64")]
    IndexOverflow,
    /// The input (or input − centre) holds a NaN or an infinity. The output is untouched.
    #[error("element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position (local to the input slice).
        index: usize,
        /// The offending value (input − centre).
        value: f32,
    },
}

/// Why building or applying a SimHash failed.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum SimHashError {
    /// The input dimension is zero or above [`crate::MAX_SIMHASH_DIM`].
    #[error("SimHash dimension {dim} is outside 1..={max}")]
    DimOutOfRange {
        /// Requested dimension.
        dim: usize,
        /// Largest supported.
        max: usize,
    },
    /// The vector's length is not the hasher's dimension.
    #[error("the hasher projects {expected} dimensions but the vector has {found}")]
    LengthMismatch {
        /// Hasher dimension.
        expected: usize,
        /// Vector length.
        found: usize,
    },
    /// The vector holds a NaN or an infinity.
    #[error("element {index} is not finite ({value})")]
    NonFinite {
        /// First offending position.
        index: usize,
        /// Its value.
        value: f32,
    },
}
