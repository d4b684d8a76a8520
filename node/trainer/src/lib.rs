//! The built-in trainer: real MNIST digits, per-node tasks and shards, and small candle models.
//!
//! A node (and every virtual node of the simulator) trains the same way: take the model's flat
//! parameters, run a few SGD steps on its shard under its task, and hand the parameter change —
//! the update — to the distiller. The external-trainer API lets a PyTorch job on the same host
//! replace this module.

mod mnist;
mod model;
mod synthetic;
mod task;

pub use mnist::{CANONICAL_URL, CLASSES, DataError, Mnist, PIXELS, TEST_IMAGES, TEST_LABELS};
pub use model::{Arch, Model, ModelError, TrainConfig, TrainStats};
pub use synthetic::{MAX_SYNTHETIC_PARAMS, MIN_SYNTHETIC_PARAMS, synthetic_spec};
pub use task::{Examples, Rotation, Split, Task};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
