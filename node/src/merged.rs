//! The update a round applied, as an external trainer fetches it (`GET /v1/merged`).
//!
//! Why its own type: the update a member applies is a hub's merge, a top-k packet at a few
//! percent density plus small dense layers. Kept dense, and then copied into a safetensors file
//! for the API, it cost two model-sized vectors beside a round's peak, and the published one
//! stayed resident through the whole next round (`kindred bench-model`: the largest terms of a
//! node's RSS after the model, its residual and the pushes). [`MergedUpdate`] keeps the
//! nonzero entries only when they are few, and the API writes the safetensors file from it in
//! bounded chunks as the trainer reads ([`MergedUpdate::safetensors_chunks`]), byte for byte
//! the file [`MergedUpdate::to_safetensors`] returns.
//!
//! ```
//! use kindred_node::merged::MergedUpdate;
//! let dense = vec![0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0];
//! let kept = MergedUpdate::from_dense(dense.clone());
//! assert!(kept.is_sparse());
//! assert_eq!(kept.to_dense(), dense);
//! ```

use std::sync::Arc;

use axum::body::Bytes;
use kindred_proto::ModelSpec;

/// Bytes per chunk of [`MergedUpdate::safetensors_chunks`] (the header is one chunk of its own).
pub const CHUNK_BYTES: usize = 4 << 20;

/// An applied update: dense, or its nonzero entries when at most a quarter of them are nonzero
/// (12 bytes an entry against 4 an element, so sparse is at most 75% of dense).
#[derive(Debug, Clone, PartialEq)]
pub enum MergedUpdate {
    /// Every element, flat in model order.
    Dense(Vec<f32>),
    /// The nonzero elements: `indices` strictly increasing, below `len`; `values[i]` at
    /// `indices[i]`, zero elsewhere.
    Sparse {
        /// Elements of the whole update.
        len: usize,
        /// Flat positions, increasing.
        indices: Vec<u64>,
        /// Values at those positions.
        values: Vec<f32>,
    },
}

impl MergedUpdate {
    /// The smaller form of `dense` (see the type's docs).
    pub fn from_dense(dense: Vec<f32>) -> Self {
        let nonzero = dense.iter().filter(|v| **v != 0.0).count();
        if nonzero > dense.len() / 4 {
            return Self::Dense(dense);
        }
        let mut indices = Vec::with_capacity(nonzero);
        let mut values = Vec::with_capacity(nonzero);
        for (i, &v) in dense.iter().enumerate() {
            if v != 0.0 {
                indices.push(i as u64);
                values.push(v);
            }
        }
        Self::Sparse {
            len: dense.len(),
            indices,
            values,
        }
    }

    /// Elements of the whole update.
    pub fn len(&self) -> usize {
        match self {
            Self::Dense(v) => v.len(),
            Self::Sparse { len, .. } => *len,
        }
    }

    /// Whether the update has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether only the nonzero entries are kept.
    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::Sparse { .. })
    }

    /// Every element, flat in model order.
    pub fn to_dense(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.fill(0, &mut out);
        out
    }

    /// Elements `[start, start + out.len())` into `out`.
    fn fill(&self, start: usize, out: &mut [f32]) {
        match self {
            Self::Dense(v) => {
                if let Some(src) = v.get(start..start + out.len()) {
                    out.copy_from_slice(src);
                }
            }
            Self::Sparse {
                indices, values, ..
            } => {
                out.fill(0.0);
                let from = indices.partition_point(|&i| i < start as u64);
                let end = (start + out.len()) as u64;
                for (&i, &v) in indices.iter().zip(values).skip(from) {
                    if i >= end {
                        break;
                    }
                    if let Some(slot) = out.get_mut(i as usize - start) {
                        *slot = v;
                    }
                }
            }
        }
    }

    /// Little-endian bytes of elements `[start, start + n)`, `n` = what fits in
    /// [`CHUNK_BYTES`] (or what is left).
    fn chunk_le(&self, start: usize) -> Vec<u8> {
        let n = (CHUNK_BYTES / 4).min(self.len().saturating_sub(start));
        let mut values = vec![0.0f32; n];
        self.fill(start, &mut values);
        kindred_distill::f32_le_bytes(&values).into_owned()
    }

    /// The safetensors file of this update for `spec` (one f32 tensor per layer, in spec
    /// order): what `GET /v1/merged` serves.
    ///
    /// # Errors
    /// When the update does not have the spec's length.
    pub fn to_safetensors(&self, spec: &ModelSpec) -> Result<Vec<u8>, String> {
        let mut out = safetensors_header(spec, self.len())?;
        out.reserve(self.len() * 4);
        for start in (0..self.len()).step_by(CHUNK_BYTES / 4) {
            out.extend_from_slice(&self.chunk_le(start));
        }
        Ok(out)
    }

    /// Bytes of [`MergedUpdate::to_safetensors`].
    ///
    /// # Errors
    /// When the update does not have the spec's length.
    pub fn safetensors_len(&self, spec: &ModelSpec) -> Result<usize, String> {
        Ok(safetensors_header(spec, self.len())?.len() + self.len() * 4)
    }

    /// The safetensors file in chunks of at most [`CHUNK_BYTES`] after the header, each made
    /// when the iterator reaches it: the file is never whole in memory.
    ///
    /// # Errors
    /// When the update does not have the spec's length.
    pub fn safetensors_chunks(
        self: Arc<Self>,
        spec: &ModelSpec,
    ) -> Result<impl Iterator<Item = Bytes> + Send + 'static, String> {
        let header = safetensors_header(spec, self.len())?;
        let len = self.len();
        let data = (0..len)
            .step_by(CHUNK_BYTES / 4)
            .map(move |start| Bytes::from(self.chunk_le(start)));
        Ok(std::iter::once(Bytes::from(header)).chain(data))
    }
}

/// Collects an update entry by entry in position order (the external trainer's apply): sparse
/// while at most a quarter of its elements are nonzero, dense from then on, so it never holds
/// more than a dense vector and a quarter's entries.
#[derive(Debug)]
pub struct SparseBuilder {
    len: usize,
    indices: Vec<u64>,
    values: Vec<f32>,
    dense: Option<Vec<f32>>,
}

impl SparseBuilder {
    /// A builder of an update of `len` elements.
    pub fn new(len: usize) -> Self {
        Self {
            len,
            indices: Vec::new(),
            values: Vec::new(),
            dense: None,
        }
    }

    /// Record `value` at `index` (below `len`); zeros are skipped. Indices must increase.
    pub fn push(&mut self, index: usize, value: f32) {
        if value == 0.0 {
            return;
        }
        if let Some(dense) = &mut self.dense {
            if let Some(slot) = dense.get_mut(index) {
                *slot = value;
            }
            return;
        }
        self.indices.push(index as u64);
        self.values.push(value);
        if self.indices.len() > self.len / 4 {
            let sparse = MergedUpdate::Sparse {
                len: self.len,
                indices: std::mem::take(&mut self.indices),
                values: std::mem::take(&mut self.values),
            };
            self.dense = Some(sparse.to_dense());
        }
    }

    /// The update.
    pub fn finish(self) -> MergedUpdate {
        match self.dense {
            Some(dense) => MergedUpdate::Dense(dense),
            None => MergedUpdate::Sparse {
                len: self.len,
                indices: self.indices,
                values: self.values,
            },
        }
    }
}

/// The safetensors header (8-byte little-endian length, then the JSON, padded with spaces to a
/// multiple of 8) of one f32 tensor per layer of `spec`, contiguous in spec order: what the
/// node serves and what `kindred bench-model`'s trainer uploads.
pub fn safetensors_f32_header(spec: &ModelSpec) -> Vec<u8> {
    let mut tensors = serde_json::Map::new();
    let mut offset: u64 = 0;
    for layer in spec.layers() {
        let bytes = layer.numel() * 4;
        tensors.insert(
            layer.name().to_string(),
            serde_json::json!({
                "dtype": "F32",
                "shape": layer.shape(),
                "data_offsets": [offset, offset + bytes],
            }),
        );
        offset += bytes;
    }
    let mut json = serde_json::Value::Object(tensors).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

/// [`safetensors_f32_header`] of an update of `len` elements, refused unless it fits `spec`.
fn safetensors_header(spec: &ModelSpec, len: usize) -> Result<Vec<u8>, String> {
    if len as u64 != spec.numel() {
        return Err(format!(
            "update has {len} values, the model {}",
            spec.numel()
        ));
    }
    Ok(safetensors_f32_header(spec))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kindred_proto::{DType, LayerSpec};

    fn spec() -> ModelSpec {
        ModelSpec::new(vec![
            LayerSpec::new("w", [3, 4], DType::F32),
            LayerSpec::new("b", [4], DType::F32),
        ])
        .unwrap()
    }

    fn parsed(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
        ["w", "b"]
            .iter()
            .map(|name| {
                let t = st.tensor(name).unwrap();
                assert_eq!(t.dtype(), safetensors::Dtype::F32);
                let values = t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (name.to_string(), t.shape().to_vec(), values)
            })
            .collect()
    }

    #[test]
    fn sparse_and_dense_serve_the_same_tensors_as_the_dense_file() {
        let spec = spec();
        let mut dense = vec![0.0f32; 16];
        dense[2] = 1.25;
        dense[15] = -3.0;
        let sparse = MergedUpdate::from_dense(dense.clone());
        assert!(sparse.is_sparse());
        let full = MergedUpdate::Dense(dense.clone());
        let expected = crate::api::update_to_safetensors(&dense, &spec).unwrap();
        for u in [&sparse, &full] {
            let file = u.to_safetensors(&spec).unwrap();
            assert_eq!(file.len(), u.safetensors_len(&spec).unwrap());
            assert_eq!(parsed(&file), parsed(&expected));
            assert_eq!(u.to_dense(), dense);
        }
    }

    #[test]
    fn a_quarter_nonzero_stays_sparse_and_more_goes_dense() {
        let mut v = vec![0.0f32; 16];
        for x in v.iter_mut().take(4) {
            *x = 1.0;
        }
        assert!(MergedUpdate::from_dense(v.clone()).is_sparse());
        v[4] = 1.0;
        assert!(!MergedUpdate::from_dense(v.clone()).is_sparse());
        let mut b = SparseBuilder::new(v.len());
        for (i, &x) in v.iter().enumerate() {
            b.push(i, x);
        }
        let built = b.finish();
        assert!(!built.is_sparse());
        assert_eq!(built.to_dense(), v);
    }

    #[test]
    fn chunks_split_large_updates_and_rebuild_the_file() {
        // Three chunks of data: the last one partial.
        let n = CHUNK_BYTES / 4 * 2 + 5;
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [n as u32], DType::F32)]).unwrap();
        let mut b = SparseBuilder::new(n);
        for i in (0..n).step_by(97) {
            b.push(i, i as f32);
        }
        let u = Arc::new(b.finish());
        assert!(u.is_sparse());
        let chunks: Vec<Bytes> = u.clone().safetensors_chunks(&spec).unwrap().collect();
        assert_eq!(chunks.len(), 4);
        assert!(chunks.iter().skip(1).all(|c| c.len() <= CHUNK_BYTES));
        let file: Vec<u8> = chunks.concat();
        assert_eq!(file, u.to_safetensors(&spec).unwrap());
        let dense = u.to_dense();
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let data = st.tensor("w").unwrap().data().to_vec();
        let expected: Vec<u8> = dense.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(data, expected);
    }

    #[test]
    fn a_wrong_length_is_refused() {
        assert!(
            MergedUpdate::Dense(vec![0.0; 3])
                .to_safetensors(&spec())
                .is_err()
        );
    }
}
