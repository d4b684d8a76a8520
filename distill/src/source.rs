//! Updates read one layer at a time.
//!
//! A model-sized vector is the unit of memory at a large model's size: a node holds its model
//! (or cumulative update) and its residual, and every other whole update in memory at a round's
//! peak is one more. The distiller and the embedder read an update a layer at a time anyway,
//! so they take it through [`LayerSource`]: a plain slice is read in place, and an update that
//! is computed (a sum of vectors, a hub's merge) is formed one layer at a time in a buffer the
//! size of the largest layer, never whole.

use std::ops::Range;

/// An update read a layer at a time, in model order ([`crate::Layout`]'s ranges).
///
/// ```
/// use kindred_distill::{Filled, LayerSource};
///
/// let update = [1.0f32, 2.0, 3.0];
/// let mut slice: &[f32] = &update;
/// assert_eq!(slice.layer(1..3), &[2.0, 3.0]);
/// let mut computed = Filled::new(|start: usize, out: &mut [f32]| {
///     for (k, o) in out.iter_mut().enumerate() {
///         *o = (start + k) as f32 + 1.0;
///     }
/// });
/// assert_eq!(computed.layer(1..3), &[2.0, 3.0]);
/// ```
pub trait LayerSource {
    /// The update's values at `range` (one layer's), valid until the next call: the same
    /// values each time a range is read (a distiller reads every layer twice). A range past the
    /// update's end reads as empty.
    fn layer(&mut self, range: Range<usize>) -> &[f32];
}

impl LayerSource for &[f32] {
    fn layer(&mut self, range: Range<usize>) -> &[f32] {
        self.get(range).unwrap_or_default()
    }
}

/// An update that a function writes a layer at a time into a reused buffer:
/// `fill(start, out)` writes every value at positions `start..start + out.len()` (the buffer
/// holds the last layer's values before, not zeros).
#[derive(Debug)]
pub struct Filled<F> {
    fill: F,
    buffer: Vec<f32>,
}

impl<F: FnMut(usize, &mut [f32])> Filled<F> {
    /// The update `fill` writes.
    pub fn new(fill: F) -> Self {
        Self {
            fill,
            buffer: Vec::new(),
        }
    }
}

impl<F: FnMut(usize, &mut [f32])> LayerSource for Filled<F> {
    fn layer(&mut self, range: Range<usize>) -> &[f32] {
        // Grown to the largest layer read so far, never shrunk: a smaller layer after a larger
        // one is not zeroed again before `fill` overwrites it.
        if self.buffer.len() < range.len() {
            self.buffer.resize(range.len(), 0.0);
        }
        let out = self.buffer.get_mut(..range.len()).unwrap_or_default();
        (self.fill)(range.start, out);
        out
    }
}

/// The weighted sum `Σ coefficient · vector` of model-sized vectors, formed a layer at a time;
/// one term of coefficient 1 is read in place.
pub(crate) struct Terms<'a> {
    terms: &'a [(&'a [f32], f32)],
    sum: Vec<f32>,
}

impl<'a> Terms<'a> {
    pub(crate) fn new(terms: &'a [(&'a [f32], f32)]) -> Self {
        Self {
            terms,
            sum: Vec::new(),
        }
    }
}

impl LayerSource for Terms<'_> {
    fn layer(&mut self, range: Range<usize>) -> &[f32] {
        if let [(t, c)] = self.terms
            && *c == 1.0
        {
            return t.get(range).unwrap_or_default();
        }
        self.sum.clear();
        self.sum.resize(range.len(), 0.0);
        for (t, c) in self.terms {
            let part = t.get(range.clone()).unwrap_or_default();
            for (s, &v) in self.sum.iter_mut().zip(part) {
                *s += c * v;
            }
        }
        &self.sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Distiller, EmbeddingConfig, Policy};
    use kindred_proto::{DType, LayerSpec, ModelSpec};

    fn distiller() -> Distiller {
        let spec = ModelSpec::new(vec![
            LayerSpec::new("w", [64, 64], DType::F32),
            LayerSpec::new("b", [64], DType::F32),
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        Distiller::new(spec, Policy::default(), EmbeddingConfig::default())
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_source_that_is_short_or_not_finite_changes_nothing() {
        let mut d = distiller();
        let good: Vec<f32> = (0..64 * 64 + 64).map(|i| (i % 13) as f32 * 1e-3).collect();
        assert!(d.distill(&good).is_ok());
        let (residual, round) = (d.residual(), d.round());
        // A layer read shorter than its range.
        struct Short(Vec<f32>);
        impl LayerSource for Short {
            fn layer(&mut self, range: Range<usize>) -> &[f32] {
                self.0 = vec![1e-3; range.len().saturating_sub(1)];
                &self.0
            }
        }
        assert!(d.distill_from(&mut Short(Vec::new())).is_err());
        // A NaN in the last layer.
        let mut nan = Filled::new(|start: usize, out: &mut [f32]| {
            out.fill(1e-3);
            if start > 0
                && let Some(o) = out.last_mut()
            {
                *o = f32::NAN;
            }
        });
        assert!(d.distill_from(&mut nan).is_err());
        assert_eq!((d.residual(), d.round()), (residual, round));
    }

    /// Without its validating pass the distiller makes the same packets and residuals; only the
    /// update's own embedding is left out.
    #[test]
    fn a_checked_update_distils_as_a_validated_one() {
        let (mut validated, mut checked) = (distiller(), distiller());
        for round in 0..4u64 {
            let update: Vec<f32> = (0..64 * 64 + 64)
                .map(|i| ((i as u64 * 7919 + round * 31) % 1000) as f32 * 1e-3 - 0.5)
                .collect();
            let a = validated.distill(&update).unwrap_or_else(|e| panic!("{e}"));
            let mut slice: &[f32] = &update;
            let b = checked
                .distill_checked_from(&mut slice)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((a.body, a.report), (b.body, b.report), "round {round}");
            assert_eq!(b.embedding, kindred_proto::Embedding::default());
            assert_eq!(validated.residual(), checked.residual(), "round {round}");
        }
    }

    #[test]
    fn terms_sum_a_layer_at_a_time() {
        let (a, b) = ([1.0f32, 2.0, 3.0, 4.0], [0.5f32, 0.5, 0.5, 0.5]);
        let terms = [(&a[..], 1.0), (&b[..], -2.0)];
        let mut sum = Terms::new(&terms);
        assert_eq!(sum.layer(0..2), &[0.0, 1.0]);
        assert_eq!(sum.layer(2..4), &[2.0, 3.0]);
        let one = [(&a[..], 1.0)];
        assert_eq!(Terms::new(&one).layer(1..3), &[2.0, 3.0]);
        let mut slice: &[f32] = &a;
        assert!(slice.layer(3..9).is_empty());
    }
}
