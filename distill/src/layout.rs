//! Where each layer lives in a flat update.
//!
//! Every crate exchanges an *update* as one flat `&[f32]` holding every layer of a
//! [`ModelSpec`] in order: layer `i` occupies the `spec.layers()[i].numel()` values after layer
//! `i − 1`. [`Layout`] computes those ranges once.

use std::ops::Range;

use kindred_proto::ModelSpec;

/// Offsets of every layer of a spec in a flat update.
///
/// ```
/// use kindred_distill::Layout;
/// use kindred_proto::{DType, LayerSpec, ModelSpec};
/// let spec = ModelSpec::new(vec![
///     LayerSpec::new("w", [3, 4], DType::F32),
///     LayerSpec::new("b", [3], DType::F32),
/// ])?;
/// let layout = Layout::new(&spec);
/// assert_eq!(layout.len(), 15);
/// assert_eq!(layout.range(0), Some(0..12));
/// assert_eq!(layout.range(1), Some(12..15));
/// assert_eq!(layout.range(2), None);
/// # Ok::<(), kindred_proto::SpecError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// `offsets[i]..offsets[i + 1]` is layer `i`; `layers + 1` entries.
    offsets: Vec<usize>,
}

impl Layout {
    /// The layout of `spec`.
    pub fn new(spec: &ModelSpec) -> Self {
        let mut offsets = Vec::with_capacity(spec.layers().len() + 1);
        let mut at = 0usize;
        offsets.push(at);
        for layer in spec.layers() {
            // A validated spec has ≤ 4096 layers of < 2^32 elements: no overflow on 64-bit.
            at = at.saturating_add(usize::try_from(layer.numel()).unwrap_or(usize::MAX));
            offsets.push(at);
        }
        Self { offsets }
    }

    /// Total number of values in an update.
    pub fn len(&self) -> usize {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Whether the update is empty (never, for a validated spec).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// The range of layer `i`, or `None` past the last layer.
    pub fn range(&self, i: usize) -> Option<Range<usize>> {
        Some(*self.offsets.get(i)?..*self.offsets.get(i + 1)?)
    }

    /// Every layer's range, in order.
    pub fn ranges(&self) -> impl ExactSizeIterator<Item = Range<usize>> + '_ {
        self.offsets.windows(2).map(|w| match w {
            [a, b] => *a..*b,
            _ => 0..0,
        })
    }

    /// The offset of every layer, then the total (`layers + 1` values).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }
}
