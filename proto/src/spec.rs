//! Model specs and their identity.
//!
//! Two nodes can only merge updates of the same architecture. The [`ModelSpec`] names every layer
//! with its shape and parameter dtype, in model order, and [`ModelId`] is the blake3 hash of its
//! canonical encoding: a packet names the `ModelId` it was made for, and a receiver decodes a body
//! only against the spec with that id.

use serde::{Deserialize, Serialize};

use crate::error::SpecError;
use crate::limits::{MAX_DIMS, MAX_LAYER_ELEMS, MAX_LAYERS, MAX_NAME_BYTES};

/// Domain separator hashed in front of a spec's encoding.
const MODEL_ID_DOMAIN: &[u8] = b"kindred/model-spec/v1\0";

/// Element type of a model parameter tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16.
    BF16,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
}

/// One named parameter tensor of a model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerSpec {
    name: String,
    shape: Vec<u32>,
    dtype: DType,
}

impl LayerSpec {
    /// Describe a layer. It is validated when it is put into a [`ModelSpec`].
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<u32>>, dtype: DType) -> Self {
        Self {
            name: name.into(),
            shape: shape.into(),
            dtype,
        }
    }

    /// The layer's name, unique within its model.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The layer's shape, outermost dimension first.
    pub fn shape(&self) -> &[u32] {
        &self.shape
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements (product of the shape). Bounded by [`MAX_LAYER_ELEMS`] once the layer is
    /// part of a validated [`ModelSpec`].
    pub fn numel(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |acc, &d| acc.saturating_mul(u64::from(d)))
    }

    /// Whether the layer is one-dimensional (a bias or a norm's scale).
    pub fn is_1d(&self) -> bool {
        self.shape.iter().filter(|&&d| d > 1).count() <= 1
    }
}

/// The architecture of a model: its layers, in order.
///
/// ```
/// use kindred_proto::{DType, LayerSpec, ModelSpec};
/// let spec = ModelSpec::new(vec![
///     LayerSpec::new("fc1.weight", [128, 784], DType::F32),
///     LayerSpec::new("fc1.bias", [128], DType::F32),
/// ])?;
/// assert_eq!(spec.numel(), 128 * 784 + 128);
/// // The id is a pure function of names, shapes and dtypes.
/// assert_eq!(spec.id(), ModelSpec::new(spec.layers().to_vec())?.id());
/// # Ok::<(), kindred_proto::SpecError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    layers: Vec<LayerSpec>,
    id: ModelId,
    numel: u64,
}

impl ModelSpec {
    /// Validate the layers and compute the model's id.
    ///
    /// # Errors
    /// [`SpecError`] when the layer count, a name, or a shape breaks the limits in
    /// [`crate::limits`], or two layers share a name.
    pub fn new(layers: Vec<LayerSpec>) -> Result<Self, SpecError> {
        if layers.is_empty() || layers.len() > MAX_LAYERS {
            return Err(SpecError::LayerCount {
                found: layers.len(),
                max: MAX_LAYERS,
            });
        }
        let mut names = std::collections::HashSet::with_capacity(layers.len());
        for (i, layer) in layers.iter().enumerate() {
            if layer.name.is_empty() || layer.name.len() > MAX_NAME_BYTES {
                return Err(SpecError::Name {
                    layer: i,
                    max: MAX_NAME_BYTES,
                });
            }
            if !names.insert(layer.name.as_str()) {
                return Err(SpecError::DuplicateName {
                    name: layer.name.clone(),
                });
            }
            let bad = |reason| SpecError::Shape {
                name: layer.name.clone(),
                shape: layer.shape.clone(),
                reason,
            };
            if layer.shape.is_empty() || layer.shape.len() > MAX_DIMS {
                return Err(bad("a shape needs 1 to 8 dimensions"));
            }
            if layer.shape.contains(&0) {
                return Err(bad("a dimension is zero"));
            }
            if layer.numel() > MAX_LAYER_ELEMS {
                return Err(bad("more than 2^32 - 1 elements"));
            }
        }
        let numel = layers.iter().map(LayerSpec::numel).sum();
        let id = ModelId::of(&layers);
        Ok(Self { layers, id, numel })
    }

    /// The layers in model order.
    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// The model's id: blake3 of its canonical encoding.
    pub fn id(&self) -> ModelId {
        self.id
    }

    /// Total number of parameters.
    pub fn numel(&self) -> u64 {
        self.numel
    }

    /// Bytes of one full-precision (f32) copy of every parameter: what a plain all-reduce moves.
    pub fn f32_bytes(&self) -> u64 {
        self.numel * 4
    }
}

/// blake3 of a [`ModelSpec`]'s canonical (postcard) encoding, with a domain separator.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ModelId(pub [u8; 32]);

impl ModelId {
    fn of(layers: &[LayerSpec]) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(MODEL_ID_DOMAIN);
        // Encoding a Vec of plain structs into a Vec cannot fail; fall back to the Debug form so
        // that even an impossible error yields a stable, spec-dependent id rather than a panic.
        match postcard::to_allocvec(layers) {
            Ok(bytes) => hasher.update(&bytes),
            Err(_) => hasher.update(format!("{layers:?}").as_bytes()),
        };
        Self(*hasher.finalize().as_bytes())
    }
}

impl std::fmt::Debug for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelId({self})")
    }
}

impl std::fmt::Display for ModelId {
    /// The first 8 bytes in hex, enough to tell models apart in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}
