//! The update a round applied, as an external trainer fetches it (`GET /v1/merged`).
//!
//! Why chunks: the update a member applies is a hub's merge, a top-k packet at a few percent
//! density plus small dense layers, kept as its nonzero entries ([`kindred_distill::Update`]).
//! Copied whole into a safetensors file for the API, it cost a model-sized buffer that stayed
//! resident through the whole next round (`kindred bench-model`: one of the largest terms of a
//! node's RSS after the model, its residual and the pushes). The API writes the file in bounded
//! chunks as the trainer reads ([`safetensors_chunks`]), byte for byte the file
//! [`to_safetensors`] returns. A round that adopts its hub's model changes every parameter:
//! that change is written to a staging file as it is computed and served from there
//! ([`MergedUpdate::Staged`]), never held in memory beside the model.
//!
//! ```
//! use kindred_distill::Update;
//! use kindred_node::merged::{MergedUpdate, safetensors_len, to_safetensors};
//! use kindred_proto::{DType, LayerSpec, ModelSpec};
//! let spec = ModelSpec::new(vec![LayerSpec::new("w", [8], DType::F32)])?;
//! let merge = Update::from_dense(vec![0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0]);
//! assert!(merge.is_sparse());
//! let kept = MergedUpdate::from(merge);
//! let file = to_safetensors(&kept, &spec)?;
//! assert_eq!(file.len(), safetensors_len(&kept, &spec)?);
//! assert_eq!(&file[file.len() - 4..], (-2.0f32).to_le_bytes());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io;
use std::sync::Arc;

use axum::body::Bytes;
use kindred_distill::Update;
use kindred_proto::ModelSpec;

use crate::staged::StagedUpdate;

/// Bytes per chunk of [`safetensors_chunks`] (the header is one chunk of its own).
pub const CHUNK_BYTES: usize = 4 << 20;

/// What a round changed in the node's model, as its trainer fetches it.
#[derive(Debug)]
pub enum MergedUpdate {
    /// In memory: a merge's few percent of entries (or any change of the built-in trainer).
    Kept(Update),
    /// In a staging file: every parameter, after an adoption.
    Staged(StagedUpdate),
}

impl MergedUpdate {
    /// Elements of the update.
    pub fn len(&self) -> usize {
        match self {
            Self::Kept(u) => u.len(),
            Self::Staged(s) => s.len(),
        }
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Write elements `start..start + out.len()` into `out`.
    ///
    /// # Errors
    /// A staging file that cannot be read, or a range past its end.
    pub fn fill(&self, start: usize, out: &mut [f32]) -> io::Result<()> {
        match self {
            Self::Kept(u) => {
                u.fill(start, out);
                Ok(())
            }
            Self::Staged(s) => s.read(start, out),
        }
    }

    /// The whole update in memory.
    ///
    /// # Errors
    /// A staging file that cannot be read.
    pub fn to_dense(&self) -> io::Result<Vec<f32>> {
        match self {
            Self::Kept(u) => Ok(u.to_dense()),
            Self::Staged(s) => s.to_vec(),
        }
    }
}

impl From<Update> for MergedUpdate {
    fn from(u: Update) -> Self {
        Self::Kept(u)
    }
}

/// Little-endian bytes of elements `[start, start + n)` of `update`, `n` = what fits in
/// [`CHUNK_BYTES`] (or what is left).
fn chunk_le(update: &MergedUpdate, start: usize) -> io::Result<Vec<u8>> {
    let n = (CHUNK_BYTES / 4).min(update.len().saturating_sub(start));
    let mut values = vec![0.0f32; n];
    update.fill(start, &mut values)?;
    Ok(kindred_distill::f32_le_bytes(&values).into_owned())
}

/// The safetensors file of `update` for `spec` (one f32 tensor per layer, in spec order): what
/// `GET /v1/merged` serves.
///
/// # Errors
/// When the update does not have the spec's length.
pub fn to_safetensors(update: &MergedUpdate, spec: &ModelSpec) -> Result<Vec<u8>, String> {
    let mut out = safetensors_header(spec, update.len())?;
    out.reserve(update.len() * 4);
    for start in (0..update.len()).step_by(CHUNK_BYTES / 4) {
        out.extend_from_slice(&chunk_le(update, start).map_err(|e| e.to_string())?);
    }
    Ok(out)
}

/// Bytes of [`to_safetensors`].
///
/// # Errors
/// When the update does not have the spec's length.
pub fn safetensors_len(update: &MergedUpdate, spec: &ModelSpec) -> Result<usize, String> {
    Ok(safetensors_header(spec, update.len())?.len() + update.len() * 4)
}

/// The safetensors file in chunks of at most [`CHUNK_BYTES`] after the header, each made when
/// the iterator reaches it: the file is never whole in memory. A chunk whose staging file
/// cannot be read is an error (the response ends there, short of its length).
///
/// # Errors
/// When the update does not have the spec's length.
pub fn safetensors_chunks(
    update: Arc<MergedUpdate>,
    spec: &ModelSpec,
) -> Result<impl Iterator<Item = io::Result<Bytes>> + Send + 'static, String> {
    let header = safetensors_header(spec, update.len())?;
    let len = update.len();
    let data = (0..len)
        .step_by(CHUNK_BYTES / 4)
        .map(move |start| chunk_le(&update, start).map(Bytes::from));
    Ok(std::iter::once(Ok(Bytes::from(header))).chain(data))
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
        let sparse = Update::from_dense(dense.clone());
        assert!(sparse.is_sparse());
        let full = Update::Dense(dense.clone());
        let expected = crate::api::update_to_safetensors(&dense, &spec).unwrap();
        let dir = std::env::temp_dir().join(format!("kindred-merged-{}", std::process::id()));
        let staged = StagedUpdate::create(&dir, dense.len()).unwrap();
        staged
            .write_le(0, &kindred_distill::f32_le_bytes(&dense))
            .unwrap();
        let served = [
            MergedUpdate::from(sparse),
            MergedUpdate::from(full),
            MergedUpdate::Staged(staged),
        ];
        for u in &served {
            let file = to_safetensors(u, &spec).unwrap();
            assert_eq!(file.len(), safetensors_len(u, &spec).unwrap());
            assert_eq!(parsed(&file), parsed(&expected));
            assert_eq!(u.to_dense().unwrap(), dense);
        }
        drop(served);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn chunks_split_large_updates_and_rebuild_the_file() {
        // Three chunks of data: the last one partial.
        let n = CHUNK_BYTES / 4 * 2 + 5;
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [n as u32], DType::F32)]).unwrap();
        let mut b = kindred_distill::UpdateBuilder::new(n);
        for i in (0..n).step_by(97) {
            b.push(i, i as f32);
        }
        let u = b.finish();
        assert!(u.is_sparse());
        let u = Arc::new(MergedUpdate::from(u));
        let chunks: Vec<Bytes> = safetensors_chunks(u.clone(), &spec)
            .unwrap()
            .collect::<io::Result<_>>()
            .unwrap();
        assert_eq!(chunks.len(), 4);
        assert!(chunks.iter().skip(1).all(|c| c.len() <= CHUNK_BYTES));
        let file: Vec<u8> = chunks.concat();
        assert_eq!(file, to_safetensors(&u, &spec).unwrap());
        let dense = u.to_dense().unwrap();
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let data = st.tensor("w").unwrap().data().to_vec();
        let expected: Vec<u8> = dense.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(data, expected);
    }

    #[test]
    fn a_wrong_length_is_refused() {
        let short = MergedUpdate::from(Update::Dense(vec![0.0; 3]));
        assert!(to_safetensors(&short, &spec()).is_err());
    }
}
