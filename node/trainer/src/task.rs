//! Tasks: what a node learns, as a transform of MNIST, and which digits it learns from.
//!
//! Kindred's promise is that nodes with *different* tasks do not pollute each other. To test that
//! honestly, clusters of nodes get genuinely different tasks from the same digits:
//!
//! - **feature shift**: every image rotated by 0, 90, 180 or 270 degrees;
//! - **concept shift**: labels permuted, `y → (y + shift) mod 10`, so two clusters with different
//!   shifts disagree on *every* digit's label.
//!
//! Each node trains on its own shard of the training split and is evaluated on the held-out split
//! under its own transform.

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::mnist::{CLASSES, Mnist, PIXELS};

/// Rotation of every image, counter-clockwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Rotation {
    /// Unrotated.
    #[default]
    R0,
    /// 90 degrees.
    R90,
    /// 180 degrees.
    R180,
    /// 270 degrees.
    R270,
}

impl Rotation {
    /// Rotation number `k` (mod 4) in quarter turns.
    pub fn quarter_turns(k: usize) -> Self {
        match k % 4 {
            0 => Self::R0,
            1 => Self::R90,
            2 => Self::R180,
            _ => Self::R270,
        }
    }

    /// Source pixel for output pixel `(r, c)` of a 28 × 28 image.
    fn source(self, r: usize, c: usize) -> (usize, usize) {
        const L: usize = 27;
        match self {
            Self::R0 => (r, c),
            Self::R90 => (c, L - r),
            Self::R180 => (L - r, L - c),
            Self::R270 => (L - c, r),
        }
    }
}

/// A node's task: how its images are rotated and its labels permuted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Task {
    /// Image rotation (feature shift).
    pub rotation: Rotation,
    /// Label shift (concept shift): label `y` becomes `(y + label_shift) % 10`.
    pub label_shift: u8,
}

impl Task {
    /// The plain MNIST task.
    pub const IDENTITY: Self = Self {
        rotation: Rotation::R0,
        label_shift: 0,
    };

    /// Cluster `c`'s task under feature shift: rotation by `c` quarter turns.
    pub fn rotation_cluster(c: usize) -> Self {
        Self {
            rotation: Rotation::quarter_turns(c),
            label_shift: 0,
        }
    }

    /// Cluster `c`'s task under concept shift: labels shifted by `c` (so clusters 0..10 differ on
    /// every label).
    pub fn label_cluster(c: usize) -> Self {
        Self {
            rotation: Rotation::R0,
            label_shift: (c % CLASSES) as u8,
        }
    }

    /// Apply the task to one image (784 pixels) into `out`.
    pub fn image_into(&self, image: &[f32], out: &mut [f32]) {
        for r in 0..28 {
            for c in 0..28 {
                let (sr, sc) = self.rotation.source(r, c);
                if let (Some(o), Some(&p)) = (out.get_mut(r * 28 + c), image.get(sr * 28 + sc)) {
                    *o = p;
                }
            }
        }
    }

    /// Apply the task to a label.
    pub fn label(&self, y: u8) -> u8 {
        (y + self.label_shift) % CLASSES as u8
    }
}

/// Digits prepared for one task: images as a row-major `n × 784` matrix and labels.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Examples {
    /// `len() × 784` pixels.
    pub images: Vec<f32>,
    /// Labels under the task.
    pub labels: Vec<u32>,
}

impl Examples {
    /// The digits at `indices` of `mnist`, transformed by `task`. Indices past the end are skipped.
    pub fn new(mnist: &Mnist, indices: &[usize], task: Task) -> Self {
        let mut images = vec![0f32; indices.len() * PIXELS];
        let mut labels = Vec::with_capacity(indices.len());
        let mut n = 0;
        for &i in indices {
            if let (Some(img), Some(y)) = (mnist.image(i), mnist.label(i)) {
                if let Some(out) = images.get_mut(n * PIXELS..(n + 1) * PIXELS) {
                    task.image_into(img, out);
                }
                labels.push(u32::from(task.label(y)));
                n += 1;
            }
        }
        images.truncate(n * PIXELS);
        Self { images, labels }
    }

    /// Number of digits.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

/// A seeded split of `n` digits into a training part and a held-out evaluation part.
///
/// ```
/// use kindred_trainer::Split;
/// let s = Split::new(10_000, 0.2, 7);
/// assert_eq!((s.train.len(), s.eval.len()), (8_000, 2_000));
/// assert_eq!(s, Split::new(10_000, 0.2, 7));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// Indices to train on.
    pub train: Vec<usize>,
    /// Held-out indices.
    pub eval: Vec<usize>,
}

impl Split {
    /// Shuffle `0..n` with `seed` and hold out `eval_fraction` of it.
    pub fn new(n: usize, eval_fraction: f64, seed: u64) -> Self {
        let mut idx: Vec<usize> = (0..n).collect();
        idx.shuffle(&mut StdRng::seed_from_u64(seed));
        let n_eval = ((n as f64) * eval_fraction.clamp(0.0, 1.0)).round() as usize;
        let train = idx.split_off(n_eval);
        Self { train, eval: idx }
    }

    /// Shard `shard` of `shards` of the training part (round-robin, so shards differ by at most
    /// one digit).
    pub fn shard(&self, shard: usize, shards: usize) -> Vec<usize> {
        let shards = shards.max(1);
        self.train
            .iter()
            .skip(shard % shards)
            .step_by(shards)
            .copied()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotations_compose_to_identity() {
        let img: Vec<f32> = (0..PIXELS).map(|i| i as f32).collect();
        let mut once = vec![0.0; PIXELS];
        let mut twice = vec![0.0; PIXELS];
        let r90 = Task {
            rotation: Rotation::R90,
            label_shift: 0,
        };
        r90.image_into(&img, &mut once);
        assert_ne!(once, img);
        let mut acc = img.clone();
        for _ in 0..4 {
            r90.image_into(&acc, &mut twice);
            acc.copy_from_slice(&twice);
        }
        assert_eq!(acc, img);
        // 90 then 90 is 180.
        r90.image_into(&once, &mut twice);
        let mut r180 = vec![0.0; PIXELS];
        Task::rotation_cluster(2).image_into(&img, &mut r180);
        assert_eq!(twice, r180);
        // The top-left pixel moves to the bottom-left under a counter-clockwise quarter turn.
        assert_eq!(once[27 * 28], img[0]);
    }

    #[test]
    fn label_clusters_disagree_on_every_digit() {
        for a in 0..4 {
            for b in 0..4 {
                if a != b {
                    let (ta, tb) = (Task::label_cluster(a), Task::label_cluster(b));
                    assert!((0..10).all(|y| ta.label(y) != tb.label(y)));
                }
            }
        }
    }

    #[test]
    fn shards_partition_the_training_split() {
        let s = Split::new(103, 0.1, 1);
        let mut all: Vec<usize> = (0..4).flat_map(|i| s.shard(i, 4)).collect();
        all.sort_unstable();
        let mut train = s.train.clone();
        train.sort_unstable();
        assert_eq!(all, train);
        assert!(s.eval.iter().all(|i| !train.contains(i)));
    }
}
