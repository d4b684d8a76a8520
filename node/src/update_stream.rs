//! An uploaded update decoded as its bytes arrive.
//!
//! A trainer uploads its update as one safetensors file (`POST /v1/update`). Holding the whole
//! body and then converting it would keep the update twice in memory, 8 bytes per parameter at
//! the moment the node also holds its model state; at 10^8-10^9 parameters that copy is what a
//! host runs out of. [`UpdateDecoder`] is a sans-IO state machine fed the body piece by piece:
//! it reads and checks the header against the model spec (bounded before anything is
//! allocated), then checks every little-endian f32 and hands it to an [`UpdateSink`] at its
//! place in the flat update: a vector (the update is the only model-sized allocation), or the
//! node's staging file through a [`crate::staged::StagedWriter`] (no model-sized allocation at all).

use std::collections::BTreeMap;

use kindred_proto::ModelSpec;
use serde::Deserialize;

use crate::api::MAX_ABS_UPDATE_VALUE;

/// Why an uploaded update was refused. Its message is what the API answers (422).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum UpdateError {
    /// The header length is over what this model's update can need.
    #[error(
        "not a safetensors file: a header of {len} bytes is over the limit of {limit} for this model"
    )]
    HeaderTooLarge {
        /// The length the file claims.
        len: u64,
        /// The most this model's update needs.
        limit: usize,
    },
    /// The header is not a safetensors JSON header.
    #[error("not a safetensors file: {0}")]
    Header(String),
    /// Not one tensor per layer of the model.
    #[error("{found} tensors, the model has {expected} layers")]
    TensorCount {
        /// Tensors in the file.
        found: usize,
        /// Layers of the model.
        expected: usize,
    },
    /// A layer of the model has no tensor.
    #[error("tensor `{0}` is missing")]
    Missing(String),
    /// A tensor is not f32 or not its layer's shape.
    #[error("tensor `{name}` is {dtype} {shape:?}, expected F32 {expected:?}")]
    Mismatch {
        /// The tensor.
        name: String,
        /// Its dtype in the file.
        dtype: String,
        /// Its shape in the file.
        shape: Vec<u64>,
        /// Its layer's shape.
        expected: Vec<u64>,
    },
    /// A tensor's data offsets do not span its values.
    #[error(
        "not a safetensors file: tensor `{name}` has data offsets {begin}..{end} for {values} values"
    )]
    Offsets {
        /// The tensor.
        name: String,
        /// Its first data byte.
        begin: u64,
        /// Past its last data byte.
        end: u64,
        /// Values in its layer.
        values: u64,
    },
    /// The tensors' data overlap or leave gaps.
    #[error("not a safetensors file: tensor data overlap or leave gaps")]
    Tiling,
    /// A value is over [`MAX_ABS_UPDATE_VALUE`] in magnitude.
    #[error(
        "tensor `{name}` holds {value:e}, over the bound of {MAX_ABS_UPDATE_VALUE:e} on an update value"
    )]
    OutOfBounds {
        /// The tensor.
        name: String,
        /// The value.
        value: f32,
    },
    /// A value is NaN or infinite.
    #[error("tensor `{name}` holds NaN or infinity")]
    NotFinite {
        /// The tensor.
        name: String,
    },
    /// Bytes after the last tensor's data.
    #[error("not a safetensors file: bytes past the end of its data")]
    PastEnd,
    /// The file ended before its last tensor's data.
    #[error("not a safetensors file: it ends early")]
    EndsEarly,
    /// The checked values could not be stored (the node's staging file).
    #[error("cannot store the update: {0}")]
    Store(String),
}

/// Where an [`UpdateDecoder`] puts the values it checked.
pub trait UpdateSink {
    /// Get ready for an update of `len` values (called once, before any [`UpdateSink::put`]).
    ///
    /// # Errors
    /// [`UpdateError::Store`] when the sink cannot hold that many.
    fn size(&mut self, len: usize) -> Result<(), UpdateError>;

    /// Store checked values, given as their little-endian bytes (a whole number of f32), from
    /// value `at` on.
    ///
    /// # Errors
    /// [`UpdateError::Store`] on a failed write; [`UpdateError::PastEnd`] past the end.
    fn put(&mut self, at: usize, le_bytes: &[u8]) -> Result<(), UpdateError>;
}

impl UpdateSink for Vec<f32> {
    fn size(&mut self, len: usize) -> Result<(), UpdateError> {
        self.clear();
        self.resize(len, 0.0);
        Ok(())
    }

    fn put(&mut self, at: usize, le_bytes: &[u8]) -> Result<(), UpdateError> {
        let Some(dst) = self.get_mut(at..at + le_bytes.len() / 4) else {
            return Err(UpdateError::PastEnd);
        };
        for (slot, b) in dst.iter_mut().zip(le_bytes.chunks_exact(4)) {
            *slot = b.try_into().map_or(f32::NAN, f32::from_le_bytes);
        }
        Ok(())
    }
}

impl UpdateSink for crate::staged::StagedWriter {
    fn size(&mut self, len: usize) -> Result<(), UpdateError> {
        if len == self.len() {
            Ok(())
        } else {
            Err(UpdateError::Store(format!(
                "the staging file holds {} values, the update {len}",
                self.len()
            )))
        }
    }

    fn put(&mut self, at: usize, le_bytes: &[u8]) -> Result<(), UpdateError> {
        self.write_le(at, le_bytes)
            .map_err(|e| UpdateError::Store(e.to_string()))
    }
}

/// One tensor's entry in a safetensors header.
#[derive(Deserialize)]
struct Entry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Where a stretch of the file's data goes: file bytes `begin..end` hold spec layer `layer`,
/// which starts at element `out` of the flat update.
#[derive(Debug, Clone, Copy)]
struct Segment {
    begin: u64,
    end: u64,
    out: usize,
    layer: usize,
}

#[derive(Debug)]
enum Phase {
    /// Reading the 8-byte header length.
    Length,
    /// Reading the JSON header of this many bytes.
    Header(usize),
    /// Reading tensor data: `pos` bytes of it so far, in `segments[seg]`.
    Data { pos: u64, seg: usize },
}

/// Decodes a safetensors update for one model spec from pieces of its bytes.
///
/// ```
/// use kindred_node::update_stream::UpdateDecoder;
/// use kindred_proto::{DType, LayerSpec, ModelSpec};
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [2, 2], DType::F32)])?;
/// let file = kindred_node::api::update_to_safetensors(&[1.0, 2.0, 3.0, 4.0], &spec)?;
/// let mut decoder = UpdateDecoder::new(&spec, 1 << 16);
/// for piece in file.chunks(3) {
///     decoder.feed(piece)?;
/// }
/// assert_eq!(decoder.finish()?, vec![1.0, 2.0, 3.0, 4.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct UpdateDecoder<'a, S = Vec<f32>> {
    spec: &'a ModelSpec,
    /// Most header bytes accepted (checked before the header is buffered).
    max_header: usize,
    phase: Phase,
    /// Bytes of the length or header read so far; then the bytes of a value split between
    /// two pieces.
    pending: Vec<u8>,
    segments: Vec<Segment>,
    out: S,
}

impl<'a> UpdateDecoder<'a> {
    /// A decoder for an update of `spec` whose header is at most `max_header` bytes, into a
    /// vector.
    pub fn new(spec: &'a ModelSpec, max_header: usize) -> Self {
        Self::with_sink(spec, max_header, Vec::new())
    }
}

impl<'a, S: UpdateSink> UpdateDecoder<'a, S> {
    /// A decoder for an update of `spec` whose header is at most `max_header` bytes, into
    /// `sink`.
    pub fn with_sink(spec: &'a ModelSpec, max_header: usize, sink: S) -> Self {
        Self {
            spec,
            max_header,
            phase: Phase::Length,
            pending: Vec::new(),
            segments: Vec::new(),
            out: sink,
        }
    }

    /// Take the next piece of the file.
    ///
    /// # Errors
    /// A message naming the first problem (a bad header, a tensor that does not match the
    /// spec, a value that is not finite or is out of bounds, bytes past the end); the decoder
    /// is of no further use then.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<(), UpdateError> {
        while !bytes.is_empty() {
            match self.phase {
                Phase::Length => {
                    let take = (8 - self.pending.len()).min(bytes.len());
                    let (head, rest) = bytes.split_at(take);
                    self.pending.extend_from_slice(head);
                    bytes = rest;
                    if let Ok(len) = <[u8; 8]>::try_from(self.pending.as_slice()) {
                        let len = u64::from_le_bytes(len);
                        let n = usize::try_from(len)
                            .ok()
                            .filter(|&n| n <= self.max_header)
                            .ok_or(UpdateError::HeaderTooLarge {
                                len,
                                limit: self.max_header,
                            })?;
                        self.pending.clear();
                        self.pending.reserve_exact(n);
                        self.phase = Phase::Header(n);
                        if n == 0 {
                            self.start_data()?;
                        }
                    }
                }
                Phase::Header(n) => {
                    let take = (n - self.pending.len()).min(bytes.len());
                    let (head, rest) = bytes.split_at(take);
                    self.pending.extend_from_slice(head);
                    bytes = rest;
                    if self.pending.len() == n {
                        self.start_data()?;
                    }
                }
                Phase::Data { .. } => {
                    let used = self.data(bytes)?;
                    if used == 0 {
                        return Err(UpdateError::PastEnd);
                    }
                    bytes = bytes.get(used..).unwrap_or_default();
                }
            }
        }
        Ok(())
    }

    /// The update, flat in spec order, once the whole file was fed.
    ///
    /// # Errors
    /// [`UpdateError::EndsEarly`] when the file ended before its last tensor's data.
    pub fn finish(self) -> Result<S, UpdateError> {
        match self.phase {
            Phase::Data { seg, .. } if seg == self.segments.len() && self.pending.is_empty() => {
                Ok(self.out)
            }
            _ => Err(UpdateError::EndsEarly),
        }
    }

    /// Parse and check the header held in `pending`; lay out the data.
    fn start_data(&mut self) -> Result<(), UpdateError> {
        let header = std::mem::take(&mut self.pending);
        let mut map: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&header).map_err(|e| UpdateError::Header(e.to_string()))?;
        map.remove("__metadata__");
        let layers = self.spec.layers();
        if map.len() != layers.len() {
            return Err(UpdateError::TensorCount {
                found: map.len(),
                expected: layers.len(),
            });
        }
        let mut segments = Vec::with_capacity(layers.len());
        let mut out = 0usize;
        for (index, layer) in layers.iter().enumerate() {
            let value = map
                .remove(layer.name())
                .ok_or_else(|| UpdateError::Missing(layer.name().to_owned()))?;
            let e: Entry = serde_json::from_value(value)
                .map_err(|e| UpdateError::Header(format!("tensor `{}`: {e}", layer.name())))?;
            let shape: Vec<u64> = layer.shape().iter().map(|&d| u64::from(d)).collect();
            if e.dtype != "F32" || e.shape != shape {
                return Err(UpdateError::Mismatch {
                    name: layer.name().to_owned(),
                    dtype: e.dtype,
                    shape: e.shape,
                    expected: shape,
                });
            }
            let (begin, end) = e.data_offsets;
            if end.checked_sub(begin) != Some(layer.numel() * 4) {
                return Err(UpdateError::Offsets {
                    name: layer.name().to_owned(),
                    begin,
                    end,
                    values: layer.numel(),
                });
            }
            segments.push(Segment {
                begin,
                end,
                out,
                layer: index,
            });
            out += layer.numel() as usize;
        }
        // The tensors must tile the data exactly, as the format requires.
        segments.sort_by_key(|s| s.begin);
        let mut at = 0u64;
        for s in &segments {
            if s.begin != at {
                return Err(UpdateError::Tiling);
            }
            at = s.end;
        }
        self.segments = segments;
        self.out.size(out)?;
        self.phase = Phase::Data { pos: 0, seg: 0 };
        self.skip_empty();
        Ok(())
    }

    /// Past segments with no data (zero-element layers).
    fn skip_empty(&mut self) {
        if let Phase::Data { pos, seg } = &mut self.phase {
            while self.segments.get(*seg).is_some_and(|s| s.end <= *pos) {
                *seg += 1;
            }
        }
    }

    /// Convert tensor data from `bytes`; returns how many bytes were used.
    fn data(&mut self, bytes: &[u8]) -> Result<usize, UpdateError> {
        let Phase::Data { pos, seg } = &mut self.phase else {
            return Ok(0);
        };
        let Some(s) = self.segments.get(*seg).copied() else {
            return Err(UpdateError::PastEnd);
        };
        // `pos` counts the bytes of values written; a value split between pieces waits in
        // `pending`. Only this segment's bytes are taken from this piece.
        let left = s.end - *pos - self.pending.len() as u64;
        let want = usize::try_from(left).unwrap_or(usize::MAX);
        let mut used = 0;
        let mut bytes = bytes.get(..want.min(bytes.len())).unwrap_or_default();
        if !self.pending.is_empty() {
            let take = (4 - self.pending.len()).min(bytes.len());
            let (head, rest) = bytes.split_at(take);
            self.pending.extend_from_slice(head);
            used += take;
            bytes = rest;
            if self.pending.len() == 4 {
                let at = s.out + ((*pos - s.begin) / 4) as usize;
                write(&mut self.out, at, &self.pending, self.spec, s.layer)?;
                *pos += 4;
                self.pending.clear();
            }
        }
        let whole = bytes.len() - bytes.len() % 4;
        let (values, tail) = bytes.split_at(whole);
        let first = s.out + ((*pos - s.begin) / 4) as usize;
        write(&mut self.out, first, values, self.spec, s.layer)?;
        *pos += whole as u64;
        used += whole;
        self.pending.extend_from_slice(tail);
        used += tail.len();
        if self.pending.is_empty() && *pos == s.end {
            *seg += 1;
            self.skip_empty();
        }
        Ok(used)
    }
}

/// Check the little-endian f32 values in `bytes` (a whole number of them) and store them from
/// element `at` of `out` on.
fn write(
    out: &mut impl UpdateSink,
    at: usize,
    bytes: &[u8],
    spec: &ModelSpec,
    layer: usize,
) -> Result<(), UpdateError> {
    for b in bytes.chunks_exact(4) {
        let v = b.try_into().map_or(f32::NAN, f32::from_le_bytes);
        if !v.is_finite() || v.abs() > MAX_ABS_UPDATE_VALUE {
            let name = spec
                .layers()
                .get(layer)
                .map_or("?", |l| l.name())
                .to_owned();
            return Err(if v.is_finite() {
                UpdateError::OutOfBounds { name, value: v }
            } else {
                UpdateError::NotFinite { name }
            });
        }
    }
    out.put(at, bytes)
}

#[cfg(test)]
mod tests {
    use kindred_proto::{DType, LayerSpec};

    use super::*;
    use crate::api::{update_header_cap, update_to_safetensors};

    fn spec() -> ModelSpec {
        ModelSpec::new(vec![
            LayerSpec::new("b.weight", [7, 5], DType::F32),
            LayerSpec::new("a.bias", [7], DType::F32),
            LayerSpec::new("c", [3, 2, 2], DType::F32),
        ])
        .unwrap()
    }

    fn decode_in_pieces(
        file: &[u8],
        spec: &ModelSpec,
        piece: usize,
    ) -> Result<Vec<f32>, UpdateError> {
        let mut d = UpdateDecoder::new(spec, update_header_cap(spec));
        for p in file.chunks(piece) {
            d.feed(p)?;
        }
        d.finish()
    }

    #[test]
    fn any_cut_into_pieces_decodes_to_the_same_update() {
        let spec = spec();
        let update: Vec<f32> = (0..spec.numel()).map(|i| i as f32 * 0.5 - 9.0).collect();
        let file = update_to_safetensors(&update, &spec).unwrap();
        for piece in [1, 2, 3, 4, 5, 7, 8, 13, 64, 100, file.len()] {
            assert_eq!(
                decode_in_pieces(&file, &spec, piece).unwrap(),
                update,
                "{piece}"
            );
        }
    }

    #[test]
    fn truncated_extended_or_bad_files_are_refused_whatever_the_pieces() {
        let spec = spec();
        let update = vec![0.25f32; spec.numel() as usize];
        let file = update_to_safetensors(&update, &spec).unwrap();
        for piece in [1, 5, 4096] {
            for cut in [0, 4, 8, 20, file.len() - 1] {
                assert!(
                    decode_in_pieces(&file[..cut], &spec, piece).is_err(),
                    "{cut}"
                );
            }
            let mut longer = file.clone();
            longer.extend_from_slice(&[0; 4]);
            assert!(decode_in_pieces(&longer, &spec, piece).is_err());
            let mut nan = file.clone();
            let n = nan.len();
            nan[n - 4..].copy_from_slice(&f32::NAN.to_le_bytes());
            let e = decode_in_pieces(&nan, &spec, piece).unwrap_err();
            assert!(matches!(e, UpdateError::NotFinite { .. }));
            assert!(e.to_string().contains("NaN"), "{e}");
            let mut huge = file.clone();
            huge[n - 4..].copy_from_slice(&3.0e6f32.to_le_bytes());
            let e = decode_in_pieces(&huge, &spec, piece).unwrap_err();
            assert!(matches!(e, UpdateError::OutOfBounds { value, .. } if value == 3.0e6));
            assert!(e.to_string().contains("over the bound"), "{e}");
        }
        // A header length past the limit is refused before anything is buffered.
        let mut d = UpdateDecoder::new(&spec, 100);
        let e = d.feed(&(1u64 << 40).to_le_bytes()).unwrap_err();
        assert_eq!(
            e,
            UpdateError::HeaderTooLarge {
                len: 1 << 40,
                limit: 100
            }
        );
    }

    #[test]
    fn headers_that_do_not_tile_the_data_are_refused() {
        let spec = ModelSpec::new(vec![
            LayerSpec::new("x", [2], DType::F32),
            LayerSpec::new("y", [2], DType::F32),
        ])
        .unwrap();
        let file = |header: &str| {
            let mut h = header.as_bytes().to_vec();
            while !h.len().is_multiple_of(8) {
                h.push(b' ');
            }
            let mut f = (h.len() as u64).to_le_bytes().to_vec();
            f.extend_from_slice(&h);
            f.extend_from_slice(&[0; 16]);
            f
        };
        let ok = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},"y":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}"#;
        assert_eq!(decode_in_pieces(&file(ok), &spec, 3).unwrap(), vec![0.0; 4]);
        for bad in [
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}}"#,
            r#"{"x":{"dtype":"F16","shape":[2],"data_offsets":[0,4]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            r#"not json"#,
        ] {
            assert!(decode_in_pieces(&file(bad), &spec, 5).is_err(), "{bad}");
        }
    }

    /// A valid file of [`spec`] with these values, mangled: `flips` (position, byte) pairs
    /// written over it, then cut to `keep` of its length (per mille) when `cut`.
    fn mangled(values: &[f32], flips: &[(usize, u8)], cut: Option<u16>) -> Vec<u8> {
        let mut f = update_to_safetensors(values, &spec()).unwrap();
        for &(at, byte) in flips {
            let n = f.len();
            f[at % n] = byte;
        }
        if let Some(keep) = cut {
            f.truncate(f.len() * usize::from(keep) / 1000);
        }
        f
    }

    proptest::proptest! {
        /// Whatever the pieces, a valid file decodes to its values.
        #[test]
        fn valid_files_decode_in_any_pieces(
            values in proptest::collection::vec(-1.0e6f32..1.0e6, 54),
            piece in 1usize..200,
        ) {
            let file = update_to_safetensors(&values, &spec()).unwrap();
            proptest::prop_assert_eq!(decode_in_pieces(&file, &spec(), piece).unwrap(), values);
        }

        /// Mangled or cut files never panic, and whatever the pieces they get the same answer:
        /// what one whole feed gets.
        #[test]
        fn mangled_files_get_one_answer_whatever_the_pieces(
            values in proptest::collection::vec(-10.0f32..10.0, 54),
            flips in proptest::collection::vec((0usize..4096, proptest::num::u8::ANY), 0..4),
            cut in proptest::option::of(0u16..1000),
            piece in 1usize..64,
        ) {
            let f = mangled(&values, &flips, cut);
            let whole = decode_in_pieces(&f, &spec(), f.len().max(1));
            let pieces = decode_in_pieces(&f, &spec(), piece);
            proptest::prop_assert_eq!(&pieces, &whole);
            if let Ok(u) = pieces {
                proptest::prop_assert_eq!(u.len(), values.len());
                proptest::prop_assert!(u.iter().all(|v| v.is_finite()));
            }
        }

        /// Arbitrary bytes, whatever header length they claim, are refused or decoded without
        /// a panic, and nothing larger than the model's update is allocated.
        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
            piece in 1usize..64,
        ) {
            if let Ok(u) = decode_in_pieces(&bytes, &spec(), piece) {
                proptest::prop_assert_eq!(u.len(), 54);
            }
        }
    }
}
