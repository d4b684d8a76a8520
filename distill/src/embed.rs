//! The update embedding that routing keys on and ranks by.
//!
//! An update is turned into a short, comparable fingerprint in four steps:
//!
//! 1. **Centre** it by a running mean of accepted peer updates, so the component every update
//!    shares (the common descent direction) does not make all nodes look alike;
//! 2. **L2-normalise each layer**, so one large or loud layer does not decide similarity alone;
//! 3. **Count-sketch** the concatenation into `sketch_dim` buckets with the network-wide seed,
//!    which preserves inner products (and so cosines) in expectation;
//! 4. **SimHash** the sketch into 256 bits by seeded Gaussian hyperplanes (routing's LSH bands),
//!    keeping each bit's margin for multi-probe, and quantise the sketch to int8 for exact cosine
//!    re-ranking of candidates.
//!
//! Count-sketch is linear, so steps 1-3 are one pass per layer: each layer is sketched (centred on
//! the fly) into scratch buckets, which are added to the total scaled by `1/‖layer‖`. Nothing here
//! needs anything but the update, the mean and an [`Embedder`], so the simulator can embed
//! thousands of virtual nodes' updates with one shared `Embedder`.

use kindred_kernels::{
    Backend, CountSketch, Kernels, Rounding, SIMHASH_BITS, SimHasher, SketchError,
};
use kindred_proto::{Embedding, MAX_SKETCH_LEN, SimHash};

use crate::error::{ConfigError, EmbedError};
use crate::layout::Layout;
use crate::source::{LayerSource, Terms};

/// Network-wide embedding parameters: every node of a network must use the same values, or their
/// embeddings are not comparable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmbeddingConfig {
    /// Seed of the count-sketch hashes and SimHash hyperplanes. Default 0x6b696e64 ("kind").
    pub seed: u64,
    /// Buckets of the count-sketch, which is also the length of the int8 sketch carried in the
    /// header (1..=[`MAX_SKETCH_LEN`]). Default 512.
    pub sketch_dim: usize,
    /// Centre updates by the running mean of accepted peer updates. Default `true`.
    pub center: bool,
    /// Weight of the past in the running mean once it has seen `1 / (1 − decay)` updates (before
    /// that it is the plain average of what it has seen). Default 0.99.
    pub mean_decay: f32,
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        Self {
            seed: 0x6b69_6e64,
            sketch_dim: 512,
            center: true,
            mean_decay: 0.99,
        }
    }
}

impl EmbeddingConfig {
    /// Check that every field is in range.
    ///
    /// # Errors
    /// [`ConfigError::Embedding`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.sketch_dim == 0 || self.sketch_dim > MAX_SKETCH_LEN {
            return Err(ConfigError::Embedding {
                field: "sketch_dim",
                reason: "must be in 1..=MAX_SKETCH_LEN",
            });
        }
        if !(self.mean_decay.is_finite() && (0.0..1.0).contains(&self.mean_decay)) {
            return Err(ConfigError::Embedding {
                field: "mean_decay",
                reason: "must be in [0, 1)",
            });
        }
        Ok(())
    }
}

/// An update's embedding and the margins of its SimHash bits.
#[derive(Debug, Clone, PartialEq)]
pub struct Embedded {
    /// The embedding for the packet header.
    pub embedding: Embedding,
    /// `|projection| / ‖sketch‖` per SimHash bit (256 values): routing's multi-probe flips the
    /// lowest-margin bits first.
    pub margins: [f32; SIMHASH_BITS],
}

/// Computes embeddings: the configuration plus the SimHash hyperplanes drawn from it.
///
/// ```
/// use kindred_distill::{Embedder, EmbeddingConfig, Layout};
/// use kindred_proto::{DType, LayerSpec, ModelSpec};
/// let spec = ModelSpec::new(vec![LayerSpec::new("w", [64, 64], DType::F32)])?;
/// let embedder = Embedder::new(EmbeddingConfig::default())?;
/// let layout = Layout::new(&spec);
/// let update: Vec<f32> = (0..4096).map(|i| (i as f32 * 0.37).sin()).collect();
/// let a = embedder.embed(&layout, &update, None)?;
/// let twice: Vec<f32> = update.iter().map(|x| 2.0 * x).collect();
/// let b = embedder.embed(&layout, &twice, None)?;
/// assert_eq!(a.embedding.simhash, b.embedding.simhash); // per-layer normalised
/// assert!(a.embedding.cosine(&b.embedding) > 0.999);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Embedder {
    config: EmbeddingConfig,
    sketch: CountSketch,
    hasher: SimHasher,
    backend: Backend,
}

impl Embedder {
    /// Draw the hyperplanes for `config` (about a millisecond; share one `Embedder` per network).
    ///
    /// # Errors
    /// [`ConfigError`] when the configuration is out of range.
    pub fn new(config: EmbeddingConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            sketch: CountSketch {
                seed: config.seed,
                buckets: config.sketch_dim,
            },
            hasher: SimHasher::new(config.seed, config.sketch_dim)?,
            backend: Backend::cpu(),
        })
    }

    /// Use another kernel backend.
    pub fn with_backend(mut self, backend: Backend) -> Self {
        self.backend = backend;
        self
    }

    /// The kernel backend embeddings are computed on.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The configuration.
    pub fn config(&self) -> &EmbeddingConfig {
        &self.config
    }

    /// Embed `update` (laid out by `layout`), centred by `mean` when given and
    /// [`EmbeddingConfig::center`] is set. Also validates the update: this is the first thing
    /// [`crate::Distiller::distill`] runs.
    ///
    /// # Errors
    /// [`EmbedError`] on a length mismatch or a non-finite value.
    pub fn embed(
        &self,
        layout: &Layout,
        update: &[f32],
        mean: Option<&[f32]>,
    ) -> Result<Embedded, EmbedError> {
        self.embed_sum(layout, &[(update, 1.0)], mean)
    }

    /// Embed the weighted sum `Σ coefficient · vector` of model-sized vectors without
    /// materialising it: the sum is formed one layer at a time in a buffer the size of the
    /// largest layer (a node keys on `model − origin + update`, three vectors of a model's size
    /// each, and a fourth would be one more model in memory at a round's peak). One term of
    /// coefficient 1 is read in place, as [`Embedder::embed`] does.
    ///
    /// ```
    /// use kindred_distill::{Embedder, EmbeddingConfig, Layout};
    /// use kindred_proto::{DType, LayerSpec, ModelSpec};
    ///
    /// let spec = ModelSpec::new(vec![
    ///     LayerSpec::new("w", [8, 8], DType::F32),
    ///     LayerSpec::new("b", [8], DType::F32),
    /// ])?;
    /// let layout = Layout::new(&spec);
    /// let embedder = Embedder::new(EmbeddingConfig::default())?;
    /// let (a, b): (Vec<f32>, Vec<f32>) = (0..72).map(|i| ((i as f32).sin(), 0.5)).unzip();
    /// let difference: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x - y).collect();
    /// assert_eq!(
    ///     embedder.embed_sum(&layout, &[(&a, 1.0), (&b, -1.0)], None)?,
    ///     embedder.embed(&layout, &difference, None)?,
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`EmbedError`] on a length mismatch or a non-finite value (of the sum).
    pub fn embed_sum(
        &self,
        layout: &Layout,
        terms: &[(&[f32], f32)],
        mean: Option<&[f32]>,
    ) -> Result<Embedded, EmbedError> {
        let expected = layout.len();
        if let Some((t, _)) = terms.iter().find(|(t, _)| t.len() != expected) {
            return Err(EmbedError::Length {
                expected,
                found: t.len(),
            });
        }
        self.embed_layers(layout, &mut Terms::new(terms), mean)
    }

    /// Embed the update `source` reads a layer at a time ([`LayerSource`]), centred by `mean`
    /// when given and [`EmbeddingConfig::center`] is set: what [`Embedder::embed`] does for a
    /// slice, for an update that is never whole in memory (a hub's merge, formed a layer at a
    /// time).
    ///
    /// ```
    /// use kindred_distill::{Embedder, EmbeddingConfig, Filled, Layout};
    /// use kindred_proto::{DType, LayerSpec, ModelSpec};
    ///
    /// let spec = ModelSpec::new(vec![LayerSpec::new("w", [8, 8], DType::F32)])?;
    /// let layout = Layout::new(&spec);
    /// let embedder = Embedder::new(EmbeddingConfig::default())?;
    /// let update: Vec<f32> = (0..64).map(|i| (i as f32).cos()).collect();
    /// let mut source = Filled::new(|start: usize, out: &mut [f32]| {
    ///     out.copy_from_slice(&update[start..start + out.len()])
    /// });
    /// assert_eq!(
    ///     embedder.embed_layers(&layout, &mut source, None)?,
    ///     embedder.embed(&layout, &update, None)?,
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`EmbedError`] on a mean of the wrong length or a non-finite value.
    pub fn embed_layers(
        &self,
        layout: &Layout,
        source: &mut impl LayerSource,
        mean: Option<&[f32]>,
    ) -> Result<Embedded, EmbedError> {
        let expected = layout.len();
        let mean = match mean {
            Some(m) if self.config.center => {
                if m.len() != expected {
                    return Err(EmbedError::Length {
                        expected,
                        found: m.len(),
                    });
                }
                Some(m)
            }
            _ => None,
        };
        let dim = self.config.sketch_dim;
        let mut total = vec![0f32; dim];
        let mut scratch = vec![0f32; dim];
        for (layer, range) in layout.ranges().enumerate() {
            let x = source.layer(range.clone());
            if x.len() != range.len() {
                return Err(EmbedError::Length {
                    expected: layout.len(),
                    found: range.start + x.len(),
                });
            }
            let c = mean.and_then(|m| m.get(range.clone()));
            let sketch = |x: &[f32], c: Option<&[f32]>, scratch: &mut [f32]| {
                scratch.fill(0.0);
                self.backend
                    .count_sketch(&self.sketch, x, c, range.start as u64, scratch)
                    .map_err(|e| match e {
                        SketchError::NonFinite { index, value } => EmbedError::NonFinite {
                            layer,
                            index,
                            value,
                        },
                        source => EmbedError::Sketch { layer, source },
                    })
            };
            let mut sum_sq = sketch(x, c, &mut scratch)?;
            if scratch.iter().any(|v| !v.is_finite()) {
                // Finite values whose bucket sums overflow f32 (values near `f32::MAX`: a
                // hostile update, or a model a merge without the robust rules broke): sketch a
                // copy scaled down by a power of two, which the normalisation undoes. Only
                // this case pays for the copy; every other embedding is computed as before.
                let (xs, cs) = scaled_down(x, c);
                sum_sq = sketch(&xs, cs.as_deref(), &mut scratch)?;
            }
            add_normalised(&mut total, &scratch, sum_sq);
        }
        self.finish(&total)
    }

    /// SimHash and int8-quantise a finished sketch (the sum of per-layer normalised sketches).
    fn finish(&self, total: &[f32]) -> Result<Embedded, EmbedError> {
        let dim = self.config.sketch_dim;
        let hash = self.hasher.hash(total).map_err(EmbedError::SimHash)?;
        let mut sketch = vec![0i8; dim];
        let sketch_scale = self
            .backend
            .quantize_i8(total, Rounding::Nearest, &mut sketch)
            .map_err(EmbedError::Quantize)?;
        Ok(Embedded {
            embedding: Embedding {
                simhash: SimHash(hash.bits),
                sketch,
                sketch_scale,
            },
            margins: hash.margins,
        })
    }
}

/// `x` and `c` multiplied by the power of two that brings their largest magnitude to at most
/// 4 (`2^-126` at the least, so that the factor itself stays a normal f32).
fn scaled_down(x: &[f32], c: Option<&[f32]>) -> (Vec<f32>, Option<Vec<f32>>) {
    let max = x
        .iter()
        .chain(c.unwrap_or_default())
        .fold(0f32, |m, v| m.max(v.abs()));
    let exponent = if max > 1.0 {
        (max.log2().ceil() as i32).clamp(0, 126)
    } else {
        0
    };
    let factor = 2f32.powi(-exponent);
    let scale = |v: &[f32]| v.iter().map(|a| a * factor).collect::<Vec<f32>>();
    (scale(x), c.map(scale))
}

/// `total += layer / sqrt(sum_sq)`: one layer's sketch, L2-normalised (skipped for an all-zero
/// layer).
fn add_normalised(total: &mut [f32], layer: &[f32], sum_sq: f64) {
    if sum_sq > 0.0 && sum_sq.is_finite() {
        let inv = (1.0 / sum_sq.sqrt()) as f32;
        for (t, s) in total.iter_mut().zip(layer) {
            *t += s * inv;
        }
    }
}
