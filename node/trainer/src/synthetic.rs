//! Transformer-shaped model specs of any size, for measuring the pipeline on real model sizes.
//!
//! The built-in models are tiny (50,890 parameters); a user's model is 10^6 to 10^9. What costs
//! time and memory at those sizes depends on the layer mix — a few large matrices, many small
//! vectors — so a benchmark needs realistic layers, not one flat tensor. [`synthetic_spec`] lays
//! out a decoder-only transformer (GPT-2's layer names and shapes) whose parameter count is
//! exactly the one asked for: blocks of attention and MLP matrices with their biases and layer
//! norms, then a token embedding that takes the rest.

use kindred_proto::{DType, LayerSpec, MAX_LAYER_ELEMS, ModelSpec};

use crate::ModelError;

/// Fewest parameters a synthetic model may have.
pub const MIN_SYNTHETIC_PARAMS: u64 = 1 << 16;

/// Most parameters a synthetic model may have (4 × 10^9, about 16 GB in f32).
pub const MAX_SYNTHETIC_PARAMS: u64 = 4_000_000_000;

/// Parameters of one block of width `d`: qkv and output projections, a 4x MLP, their biases
/// and two layer norms (`12 d² + 13 d`).
fn block_params(d: u64) -> u64 {
    12 * d * d + 13 * d
}

/// The shape of a transformer of about `params` parameters: `(blocks, width)`.
///
/// Depth grows with size the way published models do (GPT-2 small: 12 blocks of 768; 1B-class
/// models: 16-24 blocks of 2048); the width then fills about 80% of the parameters with blocks
/// (more in the largest models, whose embedding stays under one layer's element limit), in
/// multiples of 16, leaving the rest to the embedding.
fn shape_for(params: u64) -> (u64, u64) {
    let blocks = match params {
        0..10_000_000 => 4,
        10_000_000..100_000_000 => 8,
        100_000_000..500_000_000 => 12,
        _ => 16,
    };
    let embedding = (params / 5).min(MAX_LAYER_ELEMS / 2);
    let target = (params - embedding) as f64 / blocks as f64;
    let mut d = (((target / 12.0).sqrt() / 16.0).floor() as u64 * 16).max(16);
    while d > 16 && blocks * block_params(d) + 2 * d >= params {
        d -= 16;
    }
    (blocks, d)
}

/// A decoder-only transformer spec with exactly `params` f32 parameters.
///
/// ```
/// use kindred_trainer::synthetic_spec;
/// let spec = synthetic_spec(1_000_000).unwrap();
/// assert_eq!(spec.numel(), 1_000_000);
/// assert!(spec.layers().iter().any(|l| l.name() == "h.0.mlp.c_fc.weight"));
/// ```
///
/// # Errors
/// [`ModelError::Arch`] when `params` is outside
/// [`MIN_SYNTHETIC_PARAMS`]..=[`MAX_SYNTHETIC_PARAMS`] or a layer would pass the wire format's
/// limits.
pub fn synthetic_spec(params: u64) -> Result<ModelSpec, ModelError> {
    if !(MIN_SYNTHETIC_PARAMS..=MAX_SYNTHETIC_PARAMS).contains(&params) {
        return Err(ModelError::Arch(format!(
            "a synthetic model has {MIN_SYNTHETIC_PARAMS} to {MAX_SYNTHETIC_PARAMS} parameters, not {params}"
        )));
    }
    let (blocks, d) = shape_for(params);
    let f = DType::F32;
    let dim = |n: u64| {
        u32::try_from(n).map_err(|_| ModelError::Arch(format!("dimension {n} is over u32")))
    };
    let (d32, d3, d4) = (dim(d)?, dim(3 * d)?, dim(4 * d)?);
    let mut layers = Vec::with_capacity(blocks as usize * 12 + 4);
    for b in 0..blocks {
        let p = |s: &str| format!("h.{b}.{s}");
        layers.extend([
            LayerSpec::new(p("ln_1.weight"), [d32], f),
            LayerSpec::new(p("ln_1.bias"), [d32], f),
            LayerSpec::new(p("attn.c_attn.weight"), [d3, d32], f),
            LayerSpec::new(p("attn.c_attn.bias"), [d3], f),
            LayerSpec::new(p("attn.c_proj.weight"), [d32, d32], f),
            LayerSpec::new(p("attn.c_proj.bias"), [d32], f),
            LayerSpec::new(p("ln_2.weight"), [d32], f),
            LayerSpec::new(p("ln_2.bias"), [d32], f),
            LayerSpec::new(p("mlp.c_fc.weight"), [d4, d32], f),
            LayerSpec::new(p("mlp.c_fc.bias"), [d4], f),
            LayerSpec::new(p("mlp.c_proj.weight"), [d32, d4], f),
            LayerSpec::new(p("mlp.c_proj.bias"), [d32], f),
        ]);
    }
    layers.push(LayerSpec::new("ln_f.weight", [d32], f));
    layers.push(LayerSpec::new("ln_f.bias", [d32], f));
    // The embedding takes what is left, in whole rows; a bias-like tail takes the remainder.
    let rest = params - blocks * block_params(d) - 2 * d;
    let (rows, tail) = (rest / d, rest % d);
    if rows * d > MAX_LAYER_ELEMS {
        return Err(ModelError::Arch(format!(
            "the embedding of a {params}-parameter model would have {} elements, over the limit of {MAX_LAYER_ELEMS}",
            rows * d
        )));
    }
    if rows > 0 {
        layers.push(LayerSpec::new("wte.weight", [dim(rows)?, d32], f));
    }
    if tail > 0 {
        layers.push(LayerSpec::new("lm_head.bias", [dim(tail)?], f));
    }
    ModelSpec::new(layers).map_err(|e| ModelError::Arch(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_size_is_exact_and_shaped_like_a_transformer() {
        for params in [
            MIN_SYNTHETIC_PARAMS,
            1_000_000,
            12_345_679,
            100_000_000,
            1_000_000_000,
            MAX_SYNTHETIC_PARAMS,
        ] {
            let spec = synthetic_spec(params).unwrap();
            assert_eq!(spec.numel(), params, "{params}");
            let largest = spec.layers().iter().map(LayerSpec::numel).max().unwrap();
            assert!(largest <= MAX_LAYER_ELEMS);
            // Most parameters sit in the blocks' matrices, as in real models.
            let blocks: u64 = spec
                .layers()
                .iter()
                .filter(|l| l.name().starts_with("h.") && !l.is_1d())
                .map(LayerSpec::numel)
                .sum();
            assert!(blocks as f64 >= 0.5 * params as f64, "{params}: {blocks}");
        }
        let big = synthetic_spec(1_000_000_000).unwrap();
        let fc = big
            .layers()
            .iter()
            .find(|l| l.name() == "h.0.mlp.c_fc.weight")
            .unwrap();
        assert_eq!(fc.shape()[0], 4 * fc.shape()[1]);
    }

    #[test]
    fn sizes_out_of_range_are_refused() {
        for params in [0, MIN_SYNTHETIC_PARAMS - 1, MAX_SYNTHETIC_PARAMS + 1] {
            assert!(matches!(synthetic_spec(params), Err(ModelError::Arch(_))));
        }
    }
}
