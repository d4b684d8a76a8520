//! An update kept as its nonzero entries when they are few.
//!
//! Why: what a node holds of other nodes' updates is mostly top-k packets at a few percent
//! density plus small dense layers. Decoded dense, each of them cost a model-sized vector: a
//! hub held one per member's push through its merge, and a node the update it applied and
//! published (`kindred bench-model`: at 10^8 parameters, 400 MB apiece beside a model of 400 MB).
//! [`Update`] keeps the nonzero entries, 12 bytes each, when at most a quarter of the elements
//! are nonzero (so never more than three quarters of the dense form), and the elements
//! otherwise. [`synthesize`](crate::synthesize) merges either form, with the same sums.
//!
//! ```
//! use kindred_distill::Update;
//! let dense = vec![0.0, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0, -2.0];
//! let kept = Update::from_dense(dense.clone());
//! assert!(kept.is_sparse());
//! assert_eq!(kept.to_dense(), dense);
//! ```

/// An update of `len` elements: every element, or its nonzero entries when at most a quarter of
/// them are nonzero.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// Every element, flat in model order.
    Dense(Vec<f32>),
    /// The nonzero elements.
    Sparse(SparseUpdate),
}

/// The nonzero elements of an update: positions strictly increasing and below the update's
/// length, each with its value; zero elsewhere. Built by [`Update::from_dense`],
/// [`UpdateBuilder`] and [`crate::decode_update`], which keep those rules.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SparseUpdate {
    len: usize,
    indices: Vec<u64>,
    values: Vec<f32>,
}

impl SparseUpdate {
    /// Elements of the whole update.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the update has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions of the nonzero elements, increasing.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// The values at [`SparseUpdate::indices`].
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The element at `index` (zero where nothing is kept).
    pub fn get(&self, index: usize) -> f32 {
        match self.indices.binary_search(&(index as u64)) {
            Ok(k) => self.values.get(k).copied().unwrap_or(0.0),
            Err(_) => 0.0,
        }
    }

    /// The kept entries at positions `[start, end)`, in order.
    pub(crate) fn entries_in(
        &self,
        start: usize,
        end: usize,
    ) -> impl Iterator<Item = (usize, f32)> + '_ {
        let from = self.indices.partition_point(|&i| i < start as u64);
        self.indices
            .iter()
            .zip(&self.values)
            .skip(from)
            .take_while(move |(i, _)| **i < end as u64)
            .map(|(&i, &v)| (i as usize, v))
    }
}

impl Update {
    /// The smaller form of `dense` (see the type's docs).
    pub fn from_dense(dense: Vec<f32>) -> Self {
        let nonzero = dense.iter().filter(|v| **v != 0.0).count();
        if nonzero > dense.len() / 4 {
            return Self::Dense(dense);
        }
        let mut b = UpdateBuilder::with_capacity(dense.len(), nonzero);
        for (i, &v) in dense.iter().enumerate() {
            b.push(i, v);
        }
        b.finish()
    }

    /// Elements of the whole update.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    /// Whether the update has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether only the nonzero entries are kept.
    pub fn is_sparse(&self) -> bool {
        matches!(self, Self::Sparse(_))
    }

    /// Every element, flat in model order.
    pub fn to_dense(&self) -> Vec<f32> {
        let mut out = vec![0.0; self.len()];
        self.fill(0, &mut out);
        out
    }

    /// Elements `[start, start + out.len())` into `out` (what lies past the end is left).
    pub fn fill(&self, start: usize, out: &mut [f32]) {
        match self {
            Self::Dense(v) => {
                let src = v.get(start..).unwrap_or_default();
                let n = src.len().min(out.len());
                out.get_mut(..n)
                    .unwrap_or_default()
                    .copy_from_slice(src.get(..n).unwrap_or_default());
            }
            Self::Sparse(s) => {
                let n = s.len.saturating_sub(start).min(out.len());
                out.get_mut(..n).unwrap_or_default().fill(0.0);
                for (i, v) in s.entries_in(start, start.saturating_add(n)) {
                    if let Some(slot) = out.get_mut(i - start) {
                        *slot = v;
                    }
                }
            }
        }
    }

    /// The update as [`synthesize`](crate::synthesize) reads it.
    pub fn view(&self) -> UpdateView<'_> {
        match self {
            Self::Dense(v) => UpdateView::Dense(v),
            Self::Sparse(s) => UpdateView::Sparse(s),
        }
    }
}

/// A borrowed update, dense or sparse: what the merge rules read.
#[derive(Debug, Clone, Copy)]
pub enum UpdateView<'a> {
    /// Every element.
    Dense(&'a [f32]),
    /// The nonzero elements.
    Sparse(&'a SparseUpdate),
}

impl<'a> UpdateView<'a> {
    /// Elements of the whole update.
    pub fn len(&self) -> usize {
        match self {
            Self::Dense(v) => v.len(),
            Self::Sparse(s) => s.len,
        }
    }

    /// Whether the update has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element at `index` (zero past the end).
    pub fn get(&self, index: usize) -> f32 {
        match self {
            Self::Dense(v) => v.get(index).copied().unwrap_or(0.0),
            Self::Sparse(s) => s.get(index),
        }
    }

    /// The first position whose value is not finite.
    pub fn first_non_finite(&self) -> Option<usize> {
        match self {
            Self::Dense(v) => v.iter().position(|x| !x.is_finite()),
            Self::Sparse(s) => s
                .values
                .iter()
                .position(|x| !x.is_finite())
                .and_then(|k| s.indices.get(k))
                .map(|&i| i as usize),
        }
    }

    /// Its nonzero elements as `(position, value)` in position order (a dense update's zeros
    /// skipped).
    pub fn nonzero(self) -> impl Iterator<Item = (usize, f32)> + 'a {
        let (dense, sparse) = match self {
            Self::Dense(v) => (Some(v), None),
            Self::Sparse(s) => (None, Some(s)),
        };
        let dense = dense.into_iter().flat_map(|v| {
            v.iter()
                .enumerate()
                .filter(|(_, x)| **x != 0.0)
                .map(|(i, &x)| (i, x))
        });
        let sparse = sparse.into_iter().flat_map(|s| s.entries_in(0, s.len));
        dense.chain(sparse)
    }

    /// `acc[j] += factor · self[start + j]` in f64 for every nonzero element in the block.
    pub(crate) fn add_scaled(&self, start: usize, factor: f64, acc: &mut [f64]) {
        match self {
            Self::Dense(v) => {
                for (a, &x) in acc.iter_mut().zip(v.get(start..).unwrap_or_default()) {
                    *a += factor * f64::from(x);
                }
            }
            Self::Sparse(s) => {
                for (i, x) in s.entries_in(start, start.saturating_add(acc.len())) {
                    if let Some(a) = acc.get_mut(i - start) {
                        *a += factor * f64::from(x);
                    }
                }
            }
        }
    }
}

impl<'a> From<&'a [f32]> for UpdateView<'a> {
    fn from(v: &'a [f32]) -> Self {
        Self::Dense(v)
    }
}

impl<'a> From<&'a Vec<f32>> for UpdateView<'a> {
    fn from(v: &'a Vec<f32>) -> Self {
        Self::Dense(v)
    }
}

impl<'a, const N: usize> From<&'a [f32; N]> for UpdateView<'a> {
    fn from(v: &'a [f32; N]) -> Self {
        Self::Dense(v)
    }
}

impl<'a> From<&'a Update> for UpdateView<'a> {
    fn from(u: &'a Update) -> Self {
        u.view()
    }
}

/// Collects an update entry by entry in position order: sparse while at most a quarter of its
/// elements are nonzero, dense from then on, so it never holds more than a dense vector and a
/// quarter's entries.
///
/// ```
/// use kindred_distill::UpdateBuilder;
/// let mut b = UpdateBuilder::new(8);
/// b.push(1, 0.5);
/// b.push(6, -1.0);
/// let u = b.finish();
/// assert!(u.is_sparse());
/// assert_eq!(u.to_dense(), [0.0, 0.5, 0.0, 0.0, 0.0, 0.0, -1.0, 0.0]);
/// ```
#[derive(Debug)]
pub struct UpdateBuilder {
    sparse: SparseUpdate,
    dense: Option<Vec<f32>>,
}

impl UpdateBuilder {
    /// A builder of an update of `len` elements.
    pub fn new(len: usize) -> Self {
        Self::with_capacity(len, 0)
    }

    /// A builder of an update of `len` elements, room for `entries` nonzero ones (at most a
    /// quarter of `len` is reserved).
    pub fn with_capacity(len: usize, entries: usize) -> Self {
        let entries = entries.min(len / 4);
        Self {
            sparse: SparseUpdate {
                len,
                indices: Vec::with_capacity(entries),
                values: Vec::with_capacity(entries),
            },
            dense: None,
        }
    }

    /// Record `value` at `index`: skipped if zero, at or past the length, or not after the
    /// last recorded position.
    pub fn push(&mut self, index: usize, value: f32) {
        if value == 0.0 || index >= self.sparse.len {
            return;
        }
        if let Some(dense) = &mut self.dense {
            if let Some(slot) = dense.get_mut(index) {
                *slot = value;
            }
            return;
        }
        if self
            .sparse
            .indices
            .last()
            .is_some_and(|&l| l >= index as u64)
        {
            return;
        }
        self.sparse.indices.push(index as u64);
        self.sparse.values.push(value);
        if self.sparse.indices.len() > self.sparse.len / 4 {
            let sparse = std::mem::take(&mut self.sparse);
            self.sparse.len = sparse.len;
            self.dense = Some(Update::Sparse(sparse).to_dense());
        }
    }

    /// The update.
    pub fn finish(self) -> Update {
        match self.dense {
            Some(dense) => Update::Dense(dense),
            None => Update::Sparse(self.sparse),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quarter_nonzero_stays_sparse_and_more_goes_dense() {
        let mut v = vec![0.0f32; 16];
        for x in v.iter_mut().take(4) {
            *x = 1.0;
        }
        assert!(Update::from_dense(v.clone()).is_sparse());
        v[4] = 1.0;
        assert!(!Update::from_dense(v.clone()).is_sparse());
        let mut b = UpdateBuilder::new(v.len());
        for (i, &x) in v.iter().enumerate() {
            b.push(i, x);
        }
        let built = b.finish();
        assert!(!built.is_sparse());
        assert_eq!(built.to_dense(), v);
    }

    #[test]
    fn views_read_the_same_elements_in_either_form() {
        let mut dense = vec![0.0f32; 40];
        dense[3] = 1.5;
        dense[17] = -2.0;
        dense[39] = 4.0;
        let sparse = Update::from_dense(dense.clone());
        let full = Update::Dense(dense.clone());
        assert!(sparse.is_sparse());
        for u in [&sparse, &full] {
            let v = u.view();
            assert_eq!(v.len(), 40);
            assert!((0..41).all(|i| v.get(i) == dense.get(i).copied().unwrap_or(0.0)));
            let nz: Vec<_> = v.nonzero().collect();
            assert_eq!(nz, [(3, 1.5), (17, -2.0), (39, 4.0)]);
            let mut acc = vec![1.0f64; 16];
            v.add_scaled(16, 2.0, &mut acc);
            assert_eq!(acc[1], -3.0);
            assert!(acc.iter().enumerate().all(|(j, a)| j == 1 || *a == 1.0));
            let mut out = vec![9.0f32; 8];
            u.fill(36, &mut out);
            assert_eq!(&out[..4], &[0.0, 0.0, 0.0, 4.0]);
        }
        let mut bad = dense.clone();
        bad[17] = f32::NAN;
        assert_eq!(Update::from_dense(bad).view().first_non_finite(), Some(17));
    }

    #[test]
    fn a_builder_skips_entries_out_of_order_or_out_of_range() {
        let mut b = UpdateBuilder::new(16);
        b.push(5, 1.0);
        b.push(5, 2.0);
        b.push(2, 3.0);
        b.push(16, 4.0);
        b.push(9, 0.0);
        let u = b.finish();
        let Update::Sparse(s) = &u else {
            panic!("dense: {u:?}")
        };
        assert_eq!((s.indices(), s.values()), (&[5u64][..], &[1.0f32][..]));
    }
}
