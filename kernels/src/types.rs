//! Plain values that kernels take and return, shared by every backend.

/// Statistics of one tensor, computed in the same pass that produced it.
///
/// Sums are taken per fixed-size chunk in `f32` lanes and combined in `f64` in chunk order, so the
/// result is identical whatever the thread count.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Stats {
    /// Number of elements.
    pub len: usize,
    /// Arithmetic mean (0 for an empty tensor).
    pub mean: f32,
    /// Population variance, `E[x²] − E[x]²`, clamped at 0 (0 for an empty tensor).
    pub variance: f32,
    /// Largest absolute value.
    pub abs_max: f32,
    /// Euclidean norm.
    pub l2: f32,
}

impl Stats {
    /// Statistics from raw sums over `len` elements.
    pub fn from_sums(len: usize, sum: f64, sum_sq: f64, abs_max: f32) -> Self {
        if len == 0 {
            return Self::default();
        }
        let n = len as f64;
        let mean = sum / n;
        Self {
            len,
            mean: mean as f32,
            variance: (sum_sq / n - mean * mean).max(0.0) as f32,
            abs_max,
            l2: sum_sq.sqrt() as f32,
        }
    }

    /// Mean of the squares, `variance + mean²`: the energy per element, what a magnitude-based
    /// policy compares across layers.
    pub fn mean_square(&self) -> f32 {
        self.variance + self.mean * self.mean
    }
}

/// The entries a top-k selection kept, in increasing index order.
#[derive(Debug, Clone, PartialEq, Default)]
#[must_use = "the selected entries were zeroed in the residual; dropping them loses them"]
pub struct Selection {
    /// Positions of the kept entries, strictly increasing.
    pub indices: Vec<u32>,
    /// The kept values (signed, as they were in the input), one per index.
    pub values: Vec<f32>,
    /// The smallest kept magnitude (0 when nothing was kept).
    pub threshold: f32,
    /// How the selection was made.
    pub method: SelectMethod,
}

/// How a top-k selection found its threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SelectMethod {
    /// Radix histogram of magnitudes over the whole slice (two passes).
    #[default]
    Exact,
    /// DGC-style: a threshold estimated from a sample, one scanning pass, exact-count fix-up among
    /// the candidates found.
    Sampled {
        /// Entries at or above the sampled threshold, of which the top `k` were kept.
        candidates: usize,
    },
    /// The sampled threshold found fewer than `k` candidates, so the exact method ran.
    SampledFellBack,
}

/// How int8 quantisation rounds `x / scale`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// Round to nearest, ties to even.
    #[default]
    Nearest,
    /// Stochastic rounding: `floor(x / scale + u)` with `u` uniform in `[0, 1)` drawn per element
    /// from `seed` and the element's position, so it is unbiased and reproducible.
    Stochastic {
        /// Seed of the per-element uniforms.
        seed: u64,
    },
}

/// Parameters of a count-sketch.
///
/// Elements are hashed by their *global* position (so a model's layers can be sketched one at a
/// time into one sketch): positions are grouped in blocks of 64; block `b` lands at bucket offset
/// `h(b) mod buckets` and each element `j` of the block goes to bucket `(offset + j) mod buckets`
/// with its own random sign. Two elements of different blocks collide with probability
/// `1/buckets`, as in a classic count-sketch, elements of one block never collide (for
/// `buckets ≥ 64`), and signs are independent per element, so `⟨S(x), S(y)⟩` is an unbiased
/// estimate of `⟨x, y⟩`. Blocks make the kernel a contiguous, vectorisable add instead of a
/// scatter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CountSketch {
    /// Hash seed: network-wide, so that sketches of different nodes are comparable.
    pub seed: u64,
    /// Number of buckets D.
    pub buckets: usize,
}

impl CountSketch {
    /// Elements per hashing block.
    pub const BLOCK: u64 = 64;

    /// Salt separating a block's sign word from its offset hash.
    const SIGN_SALT: u64 = 0xD6E8_FEB8_6659_FD93;

    /// The raw offset hash and sign word of block `block`.
    #[inline]
    pub(crate) fn block_hash(&self, block: u64) -> (u64, u64) {
        let h = crate::rng::hash_index(self.seed, block);
        (h, crate::rng::mix64(h ^ Self::SIGN_SALT))
    }

    /// A block's bucket offset in `[0, buckets)` from its hash: Lemire's multiply-shift range
    /// reduction (a 64-bit division per block is measurably slow).
    #[inline]
    pub(crate) fn offset(h: u64, buckets: usize) -> u64 {
        ((u128::from(h) * buckets as u128) >> 64) as u64
    }

    /// Where global position `index` lands: its bucket and whether its sign is flipped. `None`
    /// when the sketch has no buckets. This is the definition the kernels implement in bulk; every
    /// backend must agree with it.
    ///
    /// ```
    /// use kindred_kernels::CountSketch;
    /// let s = CountSketch { seed: 1, buckets: 1024 };
    /// let (b0, _) = s.locate(128).unwrap();
    /// let (b1, _) = s.locate(129).unwrap();
    /// assert_eq!(b1, (b0 + 1) % 1024); // one block, consecutive buckets
    /// ```
    pub fn locate(&self, index: u64) -> Option<(usize, bool)> {
        if self.buckets == 0 {
            return None;
        }
        let (h, signs) = self.block_hash(index / Self::BLOCK);
        let pos = index % Self::BLOCK;
        let offset = Self::offset(h, self.buckets);
        let bucket = ((offset + pos) % self.buckets as u64) as usize;
        Some((bucket, (signs >> pos) & 1 == 1))
    }
}

/// A SimHash signature with the margin of every bit.
#[derive(Debug, Clone, PartialEq)]
pub struct SimHashOutput {
    /// 256 bits, bit `i` in bit `i % 8` of byte `i / 8` (the layout of `kindred_proto::SimHash`);
    /// set when the projection on hyperplane `i` is positive.
    pub bits: [u8; 32],
    /// `|⟨gᵢ, v⟩| / ‖v‖` per bit: how far the vector is from flipping bit `i`. Multi-probe lookups
    /// flip the lowest-margin bits first. All zero for a zero vector.
    pub margins: [f32; 256],
}

/// The count-sketch part of a fused pass: sketch `update − center` into `out`.
#[derive(Debug)]
pub struct SketchInto<'a> {
    /// Sketch parameters.
    pub sketch: &'a CountSketch,
    /// Centre subtracted from the update before sketching (finite), or `None`.
    pub center: Option<&'a [f32]>,
    /// Global position of the first element (see [`CountSketch`]).
    pub first_index: u64,
    /// The buckets, added into (`sketch.buckets` entries).
    pub out: &'a mut [f32],
}

/// What a fused distillation pass computed besides the new residual.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fused {
    /// Statistics of the new residual.
    pub stats: Stats,
    /// `‖update − center‖²` when a sketch was requested (0 otherwise).
    pub sketch_sum_sq: f64,
    /// Every entry whose new residual magnitude reached the threshold; empty without a
    /// threshold. Feed to [`crate::Kernels::topk_candidates`].
    pub candidates: Candidates,
}

/// Entries of a slice at or above a magnitude threshold, in increasing index order, with their
/// values (so finishing a selection never has to gather them back from memory).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Candidates {
    /// Positions, strictly increasing.
    pub indices: Vec<u32>,
    /// The values at those positions.
    pub values: Vec<f32>,
}

impl Candidates {
    /// Number of entries.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// Append `other` (whose indices must all be larger).
    pub fn extend(&mut self, other: &Self) {
        self.indices.extend_from_slice(&other.indices);
        self.values.extend_from_slice(&other.values);
    }

    #[inline]
    pub(crate) fn push(&mut self, index: u32, value: f32) {
        self.indices.push(index);
        self.values.push(value);
    }
}
