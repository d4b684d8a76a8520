//! Crash-safe persistence of a distiller's state.
//!
//! A node killed between rounds must restart with the same residuals (or the mass they hold is
//! lost for good), the same round counter (the warm-up schedule and replay marks depend on it) and
//! the same running mean (or its embeddings jump). [`DistillerState`] is that state as a plain
//! serde value; [`DistillerState::to_bytes`] / [`DistillerState::from_bytes`] give it a compact,
//! versioned, checksummed encoding:
//!
//! `postcard(WireState) ‖ blake3(postcard bytes)`, where the vectors are raw little-endian byte
//! strings: the residual in bf16 (as the distiller holds it), the running mean in f32. States of
//! version 1 (residual in f32) are still read, and rounded to bf16.
//!
//! Decoding treats the bytes as untrusted (a torn write, a bad disk): it bounds the total size by
//! what a state for *this* spec can take before parsing, checks the checksum, parses into borrowed
//! slices (no allocation), checks version, model id and every length against the spec, and only
//! then allocates and converts, rejecting NaN and infinities. The node writes these bytes
//! atomically (temp + fsync + rename); this module only makes sure that whatever it reads back is
//! either exactly what was written or a typed error.

use std::borrow::Cow;

use half::bf16;
use kindred_proto::{ModelId, ModelSpec};
use serde::{Deserialize, Serialize};

use crate::distiller::Distiller;
use crate::error::RestoreError;

/// Format version of [`DistillerState::to_bytes`].
pub const STATE_VERSION: u16 = 2;
/// The version before: the residual in f32.
const STATE_VERSION_F32: u16 = 1;

const CHECKSUM_LEN: usize = 32;
/// Bytes of everything but the two vectors, generously (version, id, counters, length varints).
const FIXED_MAX: usize = 128;

/// Everything a [`Distiller`] must carry across a restart.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistillerState {
    /// The model the residuals belong to.
    pub model: ModelId,
    /// The next round to distill.
    pub round: u64,
    /// Error-feedback residual, flat in model order, in bf16 as the distiller holds it.
    pub residual: Vec<bf16>,
    /// Running mean of accepted peer updates, flat in model order; empty if none was accepted.
    pub mean: Vec<f32>,
    /// Peer updates folded into the mean.
    pub mean_count: u64,
}

#[derive(Serialize, Deserialize)]
struct WireState<'a> {
    version: u16,
    model: [u8; 32],
    round: u64,
    mean_count: u64,
    residual: &'a [u8],
    mean: &'a [u8],
}

fn le_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
    out
}

/// A vector as little-endian bytes, the encoding of every f32 vector this crate persists: the
/// vector's own memory on little-endian targets (no copy), a copy elsewhere.
///
/// ```
/// let bytes = kindred_distill::f32_le_bytes(&[1.0, -2.0]);
/// assert_eq!(&bytes[..4], &1.0f32.to_le_bytes());
/// ```
pub fn f32_le_bytes(v: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(le_bytes(v))
    }
}

/// A bf16 vector as little-endian bytes (no copy on little-endian targets).
fn bf16_le_bytes(v: &[bf16]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// [`DistillerState::to_bytes`]'s encoding as parts that borrow the vectors, so a large state
/// is written without being copied ([`EncodedState::parts`]); the parts concatenated are
/// exactly `to_bytes`.
#[derive(Debug)]
pub struct EncodedState<'a> {
    /// The fixed fields and the residual's length, as postcard encodes them.
    head: Vec<u8>,
    residual: Cow<'a, [u8]>,
    /// The mean's length.
    mid: Vec<u8>,
    mean: Cow<'a, [u8]>,
    checksum: [u8; CHECKSUM_LEN],
}

impl<'a> EncodedState<'a> {
    fn new(
        model: ModelId,
        round: u64,
        mean_count: u64,
        residual: &'a [bf16],
        mean: &'a [f32],
    ) -> Self {
        #[derive(Serialize)]
        struct Fixed {
            version: u16,
            model: [u8; 32],
            round: u64,
            mean_count: u64,
        }
        let fixed = Fixed {
            version: STATE_VERSION,
            model: model.0,
            round,
            mean_count,
        };
        let (residual, mean) = (bf16_le_bytes(residual), f32_le_bytes(mean));
        // postcard writes a struct as its fields in order and a byte string as its length
        // (a varint) and its bytes: the same bytes as `WireState`, without the copy.
        let mut head = postcard::to_allocvec(&fixed).unwrap_or_default();
        head = postcard::to_extend(&(residual.len() as u64), head).unwrap_or_default();
        let mid = postcard::to_allocvec(&(mean.len() as u64)).unwrap_or_default();
        let mut hasher = blake3::Hasher::new();
        for part in [&head[..], &residual, &mid, &mean] {
            hasher.update(part);
        }
        Self {
            head,
            residual,
            mid,
            mean,
            checksum: *hasher.finalize().as_bytes(),
        }
    }

    /// The encoding in order; write them one after another.
    pub fn parts(&self) -> [&[u8]; 5] {
        [
            &self.head,
            &self.residual,
            &self.mid,
            &self.mean,
            &self.checksum,
        ]
    }

    /// The parts concatenated.
    pub fn to_vec(&self) -> Vec<u8> {
        self.parts().concat()
    }
}

fn from_le(what: &'static str, bytes: &[u8]) -> Result<Vec<f32>, RestoreError> {
    let mut out = Vec::with_capacity(bytes.len() / 4);
    for (index, c) in bytes.chunks_exact(4).enumerate() {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if !v.is_finite() {
            return Err(RestoreError::NonFinite { what, index });
        }
        out.push(v);
    }
    Ok(out)
}

fn bf16_from_le(bytes: &[u8]) -> Result<Vec<bf16>, RestoreError> {
    let mut out = Vec::with_capacity(bytes.len() / 2);
    for (index, c) in bytes.chunks_exact(2).enumerate() {
        let v = bf16::from_le_bytes([c[0], c[1]]);
        if !v.is_finite() {
            return Err(RestoreError::NonFinite {
                what: "residual",
                index,
            });
        }
        out.push(v);
    }
    Ok(out)
}

impl DistillerState {
    /// Encode: versioned, checksummed, vectors as raw little-endian bf16 (residual) and f32
    /// (mean).
    pub fn to_bytes(&self) -> Vec<u8> {
        EncodedState::new(
            self.model,
            self.round,
            self.mean_count,
            &self.residual,
            &self.mean,
        )
        .to_vec()
    }

    /// Decode bytes written by [`DistillerState::to_bytes`] for a model with this `spec`.
    ///
    /// # Errors
    /// [`RestoreError`] for oversized, corrupted, truncated, foreign or malformed bytes.
    pub fn from_bytes(bytes: &[u8], spec: &ModelSpec) -> Result<Self, RestoreError> {
        let numel = usize::try_from(spec.numel()).unwrap_or(usize::MAX);
        let vector_bytes = numel.saturating_mul(4);
        let max = vector_bytes
            .saturating_mul(2)
            .saturating_add(FIXED_MAX + CHECKSUM_LEN);
        if bytes.len() > max {
            return Err(RestoreError::Oversize {
                len: bytes.len(),
                max,
            });
        }
        let Some(split) = bytes.len().checked_sub(CHECKSUM_LEN) else {
            return Err(RestoreError::Checksum);
        };
        let (payload, sum) = bytes.split_at(split);
        if blake3::hash(payload).as_bytes() != sum {
            return Err(RestoreError::Checksum);
        }
        let (wire, rest) = postcard::take_from_bytes::<WireState<'_>>(payload)
            .map_err(|_| RestoreError::Malformed("not a distiller state"))?;
        if !rest.is_empty() {
            return Err(RestoreError::Malformed("trailing bytes"));
        }
        let residual_bytes = match wire.version {
            STATE_VERSION => numel.saturating_mul(2),
            STATE_VERSION_F32 => vector_bytes,
            found => {
                return Err(RestoreError::Version {
                    found,
                    supported: STATE_VERSION,
                });
            }
        };
        if wire.model != spec.id().0 {
            return Err(RestoreError::ModelMismatch);
        }
        if wire.residual.len() != residual_bytes {
            return Err(RestoreError::Length {
                what: "residual",
                expected: residual_bytes,
                found: wire.residual.len(),
            });
        }
        let mean_ok = if wire.mean_count == 0 {
            wire.mean.is_empty()
        } else {
            wire.mean.len() == vector_bytes
        };
        if !mean_ok {
            return Err(RestoreError::Length {
                what: "mean",
                expected: if wire.mean_count == 0 {
                    0
                } else {
                    vector_bytes
                },
                found: wire.mean.len(),
            });
        }
        Ok(Self {
            model: ModelId(wire.model),
            round: wire.round,
            residual: if wire.version == STATE_VERSION {
                bf16_from_le(wire.residual)?
            } else {
                let wide = from_le("residual", wire.residual)?;
                let mut narrow = bytemuck::zeroed_vec(wide.len());
                kindred_kernels::narrow_bf16(&wide, &mut narrow);
                narrow
            },
            mean: from_le("mean", wire.mean)?,
            mean_count: wire.mean_count,
        })
    }
}

impl Distiller {
    /// The state encoded as [`DistillerState::to_bytes`] does, borrowing the residual and the
    /// mean instead of copying them (what a node persists every round).
    pub fn encoded_state(&self) -> EncodedState<'_> {
        let mean: &[f32] = if self.mean_count > 0 { &self.mean } else { &[] };
        EncodedState::new(
            self.spec.id(),
            self.round,
            self.mean_count,
            &self.residual,
            mean,
        )
    }

    /// A snapshot of the state to persist.
    pub fn state(&self) -> DistillerState {
        DistillerState {
            model: self.spec.id(),
            round: self.round,
            residual: self.residual.clone(),
            mean: if self.mean_count > 0 {
                self.mean.clone()
            } else {
                Vec::new()
            },
            mean_count: self.mean_count,
        }
    }

    /// Replace this distiller's state with a saved one, after checking it belongs to this spec.
    /// On error nothing changes.
    ///
    /// ```
    /// use kindred_distill::{Distiller, DistillerState, EmbeddingConfig, Policy};
    /// use kindred_proto::{DType, LayerSpec, ModelSpec};
    /// let spec = ModelSpec::new(vec![LayerSpec::new("w", [50, 50], DType::F32)])?;
    /// let mut a = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default())?;
    /// let _ = a.distill(&vec![0.01; 2500])?;
    /// let bytes = a.state().to_bytes();
    ///
    /// let mut b = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default())?;
    /// b.restore(DistillerState::from_bytes(&bytes, &spec)?)?;
    /// assert_eq!(b.round(), 1);
    /// assert_eq!(b.residual(), a.residual());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`RestoreError`] when the state is for another model, a vector has the wrong length, or a
    /// value is not finite.
    pub fn restore(&mut self, state: DistillerState) -> Result<(), RestoreError> {
        if state.model != self.spec.id() {
            return Err(RestoreError::ModelMismatch);
        }
        let n = self.layout.len();
        if state.residual.len() != n {
            return Err(RestoreError::Length {
                what: "residual",
                expected: n * 2,
                found: state.residual.len() * 2,
            });
        }
        let mean_len = if state.mean_count == 0 { 0 } else { n };
        if state.mean.len() != mean_len {
            return Err(RestoreError::Length {
                what: "mean",
                expected: mean_len * 4,
                found: state.mean.len() * 4,
            });
        }
        if let Some(index) = state.residual.iter().position(|x| !x.is_finite()) {
            return Err(RestoreError::NonFinite {
                what: "residual",
                index,
            });
        }
        if let Some(index) = state.mean.iter().position(|x| !x.is_finite()) {
            return Err(RestoreError::NonFinite {
                what: "mean",
                index,
            });
        }
        self.round = state.round;
        self.residual = state.residual;
        self.mean = state.mean;
        self.mean_count = state.mean_count;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_borrowed_parts_are_the_postcard_encoding_byte_for_byte() {
        let residual: Vec<bf16> = (0..1000)
            .map(|i| bf16::from_f32(i as f32 * 0.25 - 3.0))
            .collect();
        for mean in [Vec::new(), vec![1.5f32; 1000]] {
            let model = ModelId([7; 32]);
            let residual_le: Vec<u8> = residual.iter().flat_map(|x| x.to_le_bytes()).collect();
            let mean_le = le_bytes(&mean);
            let wire = WireState {
                version: STATE_VERSION,
                model: model.0,
                round: 300,
                mean_count: 129,
                residual: &residual_le,
                mean: &mean_le,
            };
            let mut expected = postcard::to_allocvec(&wire).unwrap();
            let sum = blake3::hash(&expected);
            expected.extend_from_slice(sum.as_bytes());
            let encoded = EncodedState::new(model, 300, 129, &residual, &mean);
            assert_eq!(encoded.to_vec(), expected);
        }
    }

    /// A node that persisted its residual in f32 (version 1) restarts on it, rounded to bf16.
    #[test]
    fn a_version_1_state_is_read_with_its_residual_rounded() {
        use kindred_proto::{DType, LayerSpec};
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [1000], DType::F32)]).unwrap();
        let residual: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let encode = |version: u16, residual: &[u8]| {
            let wire = WireState {
                version,
                model: spec.id().0,
                round: 5,
                mean_count: 0,
                residual,
                mean: &[],
            };
            let mut bytes = postcard::to_allocvec(&wire).unwrap();
            let sum = blake3::hash(&bytes);
            bytes.extend_from_slice(sum.as_bytes());
            bytes
        };
        let state = DistillerState::from_bytes(&encode(1, &le_bytes(&residual)), &spec).unwrap();
        let rounded: Vec<bf16> = residual.iter().map(|&r| bf16::from_f32(r)).collect();
        assert_eq!((state.round, state.residual), (5, rounded));
        // Each version's residual has its own length.
        let half_length = &le_bytes(&residual)[..2000];
        assert!(matches!(
            DistillerState::from_bytes(&encode(1, half_length), &spec),
            Err(RestoreError::Length { .. })
        ));
        assert!(matches!(
            DistillerState::from_bytes(&encode(3, half_length), &spec),
            Err(RestoreError::Version { found: 3, .. })
        ));
    }
}
