//! The built-in models: a small MLP and a small CNN for 28 × 28 digits, trained with candle.
//!
//! Kindred exchanges *updates*, so a model here is just an architecture plus one flat `f32`
//! parameter vector in [`ModelSpec`] order: that is what the distiller compresses, what peers
//! merge, and what checkpoints store. Training runs plain minibatch SGD for a number of local
//! steps; the round's update is the parameter change it produced.

use candle_core::{Device, Tensor, Var};
use kindred_proto::{DType, LayerSpec, ModelSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::mnist::{CLASSES, PIXELS};
use super::task::Examples;

/// Why a model operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A parameter vector has the wrong length for the architecture.
    #[error("parameter vector has {found} values, the model has {expected}")]
    ParamLength {
        /// Parameters of the architecture.
        expected: usize,
        /// Values given.
        found: usize,
    },
    /// A parameter or update holds NaN or infinity.
    #[error("parameters or update contain non-finite values")]
    NonFinite,
    /// There is nothing to train or evaluate on.
    #[error("no examples to train or evaluate on")]
    NoExamples,
    /// The architecture is invalid (e.g. zero hidden units).
    #[error("invalid architecture: {0}")]
    Arch(String),
    /// candle failed.
    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

/// A built-in architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    /// 784 → `hidden` (ReLU) → 10.
    Mlp {
        /// Hidden units.
        hidden: u32,
    },
    /// conv 5×5×8 → pool → conv 5×5×16 → pool → linear 256 → 10.
    Cnn,
}

impl Arch {
    /// The default MLP (784-64-10, 50,890 parameters).
    pub const MLP: Self = Self::Mlp { hidden: 64 };

    /// The layers, in the order of the flat parameter vector.
    ///
    /// # Errors
    /// [`ModelError::Arch`] for a zero-width MLP.
    pub fn spec(self) -> Result<ModelSpec, ModelError> {
        let f = DType::F32;
        let layers = match self {
            Self::Mlp { hidden: 0 } => return Err(ModelError::Arch("hidden must be > 0".into())),
            Self::Mlp { hidden } => vec![
                LayerSpec::new("fc1.weight", [hidden, PIXELS as u32], f),
                LayerSpec::new("fc1.bias", [hidden], f),
                LayerSpec::new("fc2.weight", [CLASSES as u32, hidden], f),
                LayerSpec::new("fc2.bias", [CLASSES as u32], f),
            ],
            Self::Cnn => vec![
                LayerSpec::new("conv1.weight", [8, 1, 5, 5], f),
                LayerSpec::new("conv1.bias", [8], f),
                LayerSpec::new("conv2.weight", [16, 8, 5, 5], f),
                LayerSpec::new("conv2.bias", [16], f),
                LayerSpec::new("fc.weight", [CLASSES as u32, 256], f),
                LayerSpec::new("fc.bias", [CLASSES as u32], f),
            ],
        };
        ModelSpec::new(layers).map_err(|e| ModelError::Arch(e.to_string()))
    }

    /// Width of the output layer's input (its weight is `[classes, width]`).
    pub fn head_width(self) -> usize {
        match self {
            Self::Mlp { hidden } => hidden as usize,
            Self::Cnn => 256,
        }
    }

    /// Fan-in of each layer (for initialisation), in spec order.
    fn fan_in(self) -> Vec<usize> {
        match self {
            Self::Mlp { hidden } => vec![PIXELS, PIXELS, hidden as usize, hidden as usize],
            Self::Cnn => vec![25, 25, 200, 200, 256, 256],
        }
    }
}

/// Local training hyper-parameters for one round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// SGD steps per round.
    pub steps: usize,
    /// Minibatch size.
    pub batch: usize,
    /// Learning rate.
    pub lr: f64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            steps: 20,
            batch: 32,
            lr: 0.1,
        }
    }
}

/// What one round of local training did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainStats {
    /// Mean training loss over the steps.
    pub loss: f32,
    /// Samples seen (steps × batch).
    pub samples: u64,
}

/// A built-in model: an architecture and its parameters.
#[derive(Debug)]
pub struct Model {
    arch: Arch,
    spec: ModelSpec,
    vars: Vec<Var>,
}

impl Model {
    /// A freshly initialised model: uniform in ±1/√fan_in (PyTorch's default), from `seed`.
    ///
    /// # Errors
    /// [`ModelError`] for an invalid architecture.
    pub fn new(arch: Arch, seed: u64) -> Result<Self, ModelError> {
        let spec = arch.spec()?;
        let mut rng = StdRng::seed_from_u64(seed);
        let mut params = Vec::with_capacity(spec.numel() as usize);
        for (layer, fan_in) in spec.layers().iter().zip(arch.fan_in()) {
            let bound = 1.0 / (fan_in as f32).sqrt();
            params.extend((0..layer.numel()).map(|_| rng.random_range(-bound..bound)));
        }
        Self::from_params(arch, &params)
    }

    /// A model with the given flat parameters.
    ///
    /// # Errors
    /// [`ModelError::ParamLength`] or [`ModelError::NonFinite`] for a bad vector.
    pub fn from_params(arch: Arch, params: &[f32]) -> Result<Self, ModelError> {
        let spec = arch.spec()?;
        check(&spec, params)?;
        let mut vars = Vec::with_capacity(spec.layers().len());
        let mut offset = 0;
        for layer in spec.layers() {
            let n = layer.numel() as usize;
            let dims: Vec<usize> = layer.shape().iter().map(|&d| d as usize).collect();
            let slice = params.get(offset..offset + n).unwrap_or_default();
            vars.push(Var::from_slice(slice, dims, &Device::Cpu)?);
            offset += n;
        }
        Ok(Self { arch, spec, vars })
    }

    /// The architecture.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The layer spec (and so the model id) of the parameter vector.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The flat parameter vector.
    ///
    /// # Errors
    /// [`ModelError::Candle`] if a tensor cannot be read.
    pub fn params(&self) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(self.spec.numel() as usize);
        for v in &self.vars {
            out.extend(v.as_tensor().flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Replace every parameter.
    ///
    /// # Errors
    /// [`ModelError::ParamLength`] or [`ModelError::NonFinite`]; the model is unchanged then.
    pub fn set_params(&mut self, params: &[f32]) -> Result<(), ModelError> {
        check(&self.spec, params)?;
        let mut offset = 0;
        for (v, layer) in self.vars.iter().zip(self.spec.layers()) {
            let n = layer.numel() as usize;
            let slice = params.get(offset..offset + n).unwrap_or_default();
            v.set(&Tensor::from_slice(slice, v.shape(), &Device::Cpu)?)?;
            offset += n;
        }
        Ok(())
    }

    /// Add an update (for example a merged one) to the parameters.
    ///
    /// # Errors
    /// As [`Model::set_params`].
    pub fn apply_update(&mut self, update: &[f32]) -> Result<(), ModelError> {
        check(&self.spec, update)?;
        let mut params = self.params()?;
        for (p, u) in params.iter_mut().zip(update) {
            *p += u;
        }
        self.set_params(&params)
    }

    /// Run `cfg.steps` SGD steps on minibatches drawn from `examples`.
    ///
    /// # Errors
    /// [`ModelError::NoExamples`] for an empty set, [`ModelError::Candle`] on a tensor failure.
    pub fn train(
        &mut self,
        examples: &Examples,
        cfg: &TrainConfig,
        rng: &mut StdRng,
    ) -> Result<TrainStats, ModelError> {
        if examples.is_empty() {
            return Err(ModelError::NoExamples);
        }
        let batch = cfg.batch.clamp(1, examples.len());
        let mut total = 0f64;
        let mut images = Vec::with_capacity(batch * PIXELS);
        let mut labels = Vec::with_capacity(batch);
        for _ in 0..cfg.steps {
            images.clear();
            labels.clear();
            for _ in 0..batch {
                let i = rng.random_range(0..examples.len());
                images.extend_from_slice(
                    examples
                        .images
                        .get(i * PIXELS..(i + 1) * PIXELS)
                        .unwrap_or_default(),
                );
                labels.push(examples.labels.get(i).copied().unwrap_or_default());
            }
            let x = Tensor::from_slice(&images, (batch, PIXELS), &Device::Cpu)?;
            let y = Tensor::from_slice(&labels, batch, &Device::Cpu)?;
            let loss = candle_nn::loss::cross_entropy(&self.forward(&x)?, &y)?;
            let grads = loss.backward()?;
            for v in &self.vars {
                if let Some(g) = grads.get(v.as_tensor()) {
                    v.set(&(v.as_tensor() - (g * cfg.lr)?)?)?;
                }
            }
            total += f64::from(loss.to_scalar::<f32>()?);
        }
        let steps = cfg.steps.max(1);
        Ok(TrainStats {
            loss: (total / steps as f64) as f32,
            samples: (cfg.steps * batch) as u64,
        })
    }

    /// Fraction of `examples` classified correctly.
    ///
    /// # Errors
    /// [`ModelError::NoExamples`] for an empty set, [`ModelError::Candle`] on a tensor failure.
    pub fn accuracy(&self, examples: &Examples) -> Result<f32, ModelError> {
        if examples.is_empty() {
            return Err(ModelError::NoExamples);
        }
        let mut correct = 0usize;
        for (chunk, labels) in examples
            .images
            .chunks(512 * PIXELS)
            .zip(examples.labels.chunks(512))
        {
            let x = Tensor::from_slice(chunk, (labels.len(), PIXELS), &Device::Cpu)?;
            let pred = self.forward(&x)?.argmax(1)?.to_vec1::<u32>()?;
            correct += pred.iter().zip(labels).filter(|(p, y)| p == y).count();
        }
        Ok(correct as f32 / examples.len() as f32)
    }

    /// Mean cross-entropy loss on `examples`.
    ///
    /// # Errors
    /// As [`Model::accuracy`].
    pub fn loss(&self, examples: &Examples) -> Result<f32, ModelError> {
        if examples.is_empty() {
            return Err(ModelError::NoExamples);
        }
        let x = Tensor::from_slice(&examples.images, (examples.len(), PIXELS), &Device::Cpu)?;
        let y = Tensor::from_slice(&examples.labels, examples.len(), &Device::Cpu)?;
        Ok(candle_nn::loss::cross_entropy(&self.forward(&x)?, &y)?.to_scalar::<f32>()?)
    }

    /// How far each update of the output layer in `heads` (its weight then its bias, the last
    /// [`Model::head_len`] values of an update), put on this model's features of `examples`,
    /// points at the examples' own labels: the cosine between a head and the direction in which,
    /// at first order, it raises each example's label's logit above the mean logit. For class
    /// `c` that direction is the mean feature vector of the examples labelled `c` (a 1 appended
    /// for the bias) less `1/C` of the mean over all examples; it is computed once for all heads.
    ///
    /// A merge of the member's own task moves each class's row toward that class's features
    /// on the member's data; another task's (its classes in another order) moves rows toward
    /// other classes' features. Unlike the cosine with the member's own update, the reference
    /// is the shard's class means, not one round's minibatch noise, so it does not fade late in
    /// training. A zero head scores 0.
    ///
    /// ```
    /// use kindred_trainer::{Arch, Examples, Model};
    ///
    /// let model = Model::new(Arch::MLP, 1).unwrap();
    /// // Two examples, labels 0 and 1, each a different half of the image lit.
    /// let mut images = vec![0.0; 2 * 784];
    /// images[..392].fill(1.0);
    /// images[784 + 392..].fill(1.0);
    /// let examples = Examples { images, labels: vec![0, 1] };
    /// // An output layer that raises class 0 on example 0's features, and its sign flip.
    /// let features = model.features(&examples).unwrap();
    /// let mut head = vec![0.0; model.head_len()];
    /// head[..64].copy_from_slice(&features[..64]);
    /// let flipped: Vec<f32> = head.iter().map(|x| -x).collect();
    /// let [raised, lowered] = model.head_alignment([&head, &flipped], &examples).unwrap();
    /// assert!(raised > 0.0 && lowered < 0.0);
    /// ```
    ///
    /// # Errors
    /// [`ModelError::ParamLength`] for a head of another length, [`ModelError::NonFinite`],
    /// [`ModelError::NoExamples`] (none with a label under [`CLASSES`]), [`ModelError::Candle`]
    /// on a tensor failure.
    pub fn head_alignment<const N: usize>(
        &self,
        heads: [&[f32]; N],
        examples: &Examples,
    ) -> Result<[f32; N], ModelError> {
        for head in heads {
            if head.len() != self.head_len() {
                return Err(ModelError::ParamLength {
                    expected: self.head_len(),
                    found: head.len(),
                });
            }
            if head.iter().any(|v| !v.is_finite()) {
                return Err(ModelError::NonFinite);
            }
        }
        let direction = self.label_direction(examples)?;
        let r2: f64 = direction.iter().map(|r| r * r).sum();
        Ok(heads.map(|head| {
            let (mut dot, mut d2) = (0f64, 0f64);
            for (&d, r) in head.iter().zip(&direction) {
                let d = f64::from(d);
                dot += d * r;
                d2 += d * d;
            }
            if d2 == 0.0 || r2 == 0.0 {
                0.0
            } else {
                (dot / (d2 * r2).sqrt()) as f32
            }
        }))
    }

    /// The direction [`Model::head_alignment`] measures against, laid out as the output layer
    /// is: the weight's rows, then the bias.
    fn label_direction(&self, examples: &Examples) -> Result<Vec<f64>, ModelError> {
        let width = self.head_width();
        // Per class: the sum of its examples' features and its count.
        let mut sums = vec![0f64; CLASSES * width];
        let mut counts = [0f64; CLASSES];
        let features = self.features(examples)?;
        for (h, &y) in features.chunks_exact(width).zip(&examples.labels) {
            let c = y as usize;
            let (Some(count), Some(row)) =
                (counts.get_mut(c), sums.get_mut(c * width..(c + 1) * width))
            else {
                continue;
            };
            *count += 1.0;
            for (s, &h) in row.iter_mut().zip(h) {
                *s += f64::from(h);
            }
        }
        let n: f64 = counts.iter().sum();
        if n == 0.0 {
            return Err(ModelError::NoExamples);
        }
        let classes = CLASSES as f64;
        let mut mean = vec![0f64; width];
        for row in sums.chunks_exact(width) {
            for (m, s) in mean.iter_mut().zip(row) {
                *m += s / n;
            }
        }
        let mut direction = Vec::with_capacity(self.head_len());
        for row in sums.chunks_exact(width) {
            direction.extend(row.iter().zip(&mean).map(|(s, m)| s / n - m / classes));
        }
        direction.extend(counts.iter().map(|count| count / n - 1.0 / classes));
        Ok(direction)
    }

    /// Values of the output layer, weight and bias: the last ones of a parameter vector.
    pub fn head_len(&self) -> usize {
        CLASSES * (self.head_width() + 1)
    }

    /// The output layer's input for each of `examples`, `[examples, features]` flattened.
    ///
    /// # Errors
    /// [`ModelError::NoExamples`] for an empty set, [`ModelError::Candle`] on a tensor failure.
    pub fn features(&self, examples: &Examples) -> Result<Vec<f32>, ModelError> {
        if examples.is_empty() {
            return Err(ModelError::NoExamples);
        }
        let mut out = Vec::with_capacity(examples.len() * self.head_width());
        for chunk in examples.images.chunks(512 * PIXELS) {
            let x = Tensor::from_slice(chunk, (chunk.len() / PIXELS, PIXELS), &Device::Cpu)?;
            out.extend(self.hidden(&x)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(out)
    }

    /// Width of the output layer's input.
    fn head_width(&self) -> usize {
        self.arch.head_width()
    }

    /// Logits for a batch of flattened images `[batch, 784]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let last = self.vars.len().saturating_sub(2);
        let (w, b) = (self.var(last)?, self.var(last + 1)?);
        Ok(self.hidden(x)?.matmul(&w.t()?)?.broadcast_add(b)?)
    }

    /// Parameter tensor `i` in spec order.
    fn var(&self, i: usize) -> Result<&Tensor, ModelError> {
        self.vars
            .get(i)
            .map(Var::as_tensor)
            .ok_or_else(|| ModelError::Arch("layer missing".into()))
    }

    /// The output layer's input for a batch of flattened images `[batch, 784]`.
    fn hidden(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        let t = |i: usize| self.var(i);
        let linear = |x: &Tensor, w: &Tensor, b: &Tensor| -> Result<Tensor, ModelError> {
            Ok(x.matmul(&w.t()?)?.broadcast_add(b)?)
        };
        match self.arch {
            Arch::Mlp { .. } => Ok(linear(x, t(0)?, t(1)?)?.relu()?),
            Arch::Cnn => {
                let bias = |b: &Tensor| b.reshape((1, (), 1, 1));
                let x = x.reshape(((), 1, 28, 28))?;
                let x = x
                    .conv2d(t(0)?, 0, 1, 1, 1)?
                    .broadcast_add(&bias(t(1)?)?)?
                    .relu()?;
                let x = x.max_pool2d(2)?;
                let x = x
                    .conv2d(t(2)?, 0, 1, 1, 1)?
                    .broadcast_add(&bias(t(3)?)?)?
                    .relu()?;
                Ok(x.max_pool2d(2)?.flatten_from(1)?)
            }
        }
    }
}

fn check(spec: &ModelSpec, values: &[f32]) -> Result<(), ModelError> {
    if values.len() as u64 != spec.numel() {
        return Err(ModelError::ParamLength {
            expected: spec.numel() as usize,
            found: values.len(),
        });
    }
    if values.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Mnist, Split, Task};

    #[test]
    fn params_round_trip_and_updates_apply() {
        let mut m = Model::new(Arch::MLP, 1).unwrap();
        assert_eq!(m.spec().numel(), 50_890);
        let p = m.params().unwrap();
        assert_eq!(Model::new(Arch::MLP, 1).unwrap().params().unwrap(), p);
        let delta = vec![0.5; p.len()];
        m.apply_update(&delta).unwrap();
        let q = m.params().unwrap();
        assert!(p.iter().zip(&q).all(|(a, b)| (b - a - 0.5).abs() < 1e-6));
        assert!(matches!(
            m.apply_update(&[1.0]),
            Err(ModelError::ParamLength { .. })
        ));
        let mut nan = delta;
        nan[3] = f32::NAN;
        assert!(matches!(m.apply_update(&nan), Err(ModelError::NonFinite)));
        assert_eq!(
            m.params().unwrap(),
            q,
            "a rejected update leaves the model unchanged"
        );
    }

    #[test]
    fn a_rounds_output_layer_points_at_its_labels_and_a_relabelled_one_does_not() {
        let mnist = Mnist::load().unwrap();
        let split = Split::new(mnist.len(), 0.2, 3);
        let shard = Examples::new(&mnist, &split.train[..600], Task::IDENTITY);
        let mut rng = StdRng::seed_from_u64(5);
        for arch in [Arch::MLP, Arch::Cnn] {
            let mut m = Model::new(arch, 7).unwrap();
            let cfg = TrainConfig::default();
            m.train(&shard, &cfg, &mut rng).unwrap();
            let before = m.params().unwrap();
            let mut trained = Model::from_params(arch, &before).unwrap();
            trained.train(&shard, &cfg, &mut rng).unwrap();
            let after = trained.params().unwrap();
            let tail = before.len() - m.head_len();
            let head: Vec<f32> = after[tail..]
                .iter()
                .zip(&before[tail..])
                .map(|(a, b)| a - b)
                .collect();
            // The same rows for the next label (y → y + 1): another task's update.
            let width = m.head_width();
            let mut relabelled = head.clone();
            relabelled[..CLASSES * width].rotate_right(width);
            relabelled[CLASSES * width..].rotate_right(1);
            let zero = vec![0.0; head.len()];
            let [own, other, none] = m
                .head_alignment([&head, &relabelled, &zero], &shard)
                .unwrap();
            assert!(own > 0.2 && other < 0.0, "{arch:?}: {own} vs {other}");
            assert_eq!(none, 0.0);
            assert!(matches!(
                m.head_alignment([&head, &head[1..]], &shard),
                Err(ModelError::ParamLength { .. })
            ));
        }
    }

    #[test]
    fn both_architectures_learn_mnist() {
        let mnist = Mnist::load().unwrap();
        let split = Split::new(mnist.len(), 0.2, 3);
        let train = Examples::new(&mnist, &split.train[..2000], Task::IDENTITY);
        let eval = Examples::new(&mnist, &split.eval[..500], Task::IDENTITY);
        for (arch, steps) in [(Arch::MLP, 150), (Arch::Cnn, 200)] {
            let mut m = Model::new(arch, 7).unwrap();
            let before = m.accuracy(&eval).unwrap();
            let mut rng = StdRng::seed_from_u64(5);
            let cfg = TrainConfig {
                steps,
                batch: 32,
                lr: 0.1,
            };
            let stats = m.train(&train, &cfg, &mut rng).unwrap();
            let after = m.accuracy(&eval).unwrap();
            assert!(stats.loss.is_finite());
            assert!(
                after > 0.7 && after > before + 0.4,
                "{arch:?}: {before} -> {after}"
            );
        }
    }
}
