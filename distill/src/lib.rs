//! Kindred's distillation: turning a model update into a small outcome-packet body and an
//! embedding, and merging the updates of similar peers back into one.
//!
//! - [`Distiller`]: per-node state (error-feedback residuals in bf16, the round counter, the
//!   running mean that centres embeddings) and [`Distiller::distill`], which turns one update into
//!   a [`kindred_proto::PacketBody`] ready for `kindred_proto::seal`, an
//!   [`kindred_proto::Embedding`] for the header, the SimHash bit margins routing probes with, and
//!   a [`Report`] of what each layer cost.
//! - [`Policy`]: per layer and round, dense f16 / top-k (int8 or 4-bit) / 1-bit sign, with a
//!   warm-up schedule and a byte-budget mode.
//! - [`decode`]: a body back to a dense update, deterministically.
//! - [`Embedder`]: the embedding alone (centred, per-layer normalised, count-sketched, SimHashed),
//!   cheap enough for the simulator to run for thousands of virtual nodes.
//! - [`synthesize`]: the robust, similarity-weighted merge of the own update with peers', which
//!   rejects scaled and sign-flipped updates and says why ([`synthesize_with`]: the merge read
//!   a range at a time, as a hub distills it, never whole).
//! - [`snapshot`] and [`pull`]: a model as an int8 body (sparse where mostly zero), and the gossip-averaging step that
//!   moves a node part of the way toward a partner's model (merging updates alone lets models
//!   drift apart).
//! - [`check_aggregate`], [`check_head`], [`check_adoption`] and [`check_by_data`]: what a
//!   member of a hub exchange checks before applying the merged update its hub sent back, and
//!   before adopting its hub's model.
//! - [`DistillerState`]: what the node persists so a crash loses nothing.
//!
//! An **update** is always one flat `&[f32]` holding every layer of the
//! [`kindred_proto::ModelSpec`] in order ([`Layout`] gives each layer's range).
//!
//! It computes through `kindred-kernels` and speaks `kindred-proto` types; it does no networking
//! and no storage, so the node and the simulator run exactly the same code.
//!
//! ```
//! use kindred_distill::*;
//! use kindred_proto::{DType, LayerSpec, ModelSpec};
//!
//! let spec = ModelSpec::new(vec![
//!     LayerSpec::new("fc.weight", [256, 256], DType::F32),
//!     LayerSpec::new("fc.bias", [256], DType::F32),
//! ])?;
//! let mut distiller = Distiller::new(spec.clone(), Policy::default(), EmbeddingConfig::default())?;
//! let update: Vec<f32> = (0..spec.numel()).map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5).collect();
//! for _ in 0..6 {
//!     let _ = distiller.distill(&update)?; // warm-up rounds
//! }
//! let out = distiller.distill(&update)?;
//! assert_eq!(out.body.layers.len(), 2);
//! assert!(out.report.ratio > 50.0, "{}", out.report.ratio);
//! let dense = decode(&out.body, &spec)?;
//! assert_eq!(dense.len(), update.len());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod aggregate;
mod consensus;
mod decode;
mod distiller;
mod embed;
mod error;
mod layout;
mod policy;
mod source;
mod state;
mod synth;
mod update;

pub use aggregate::{
    AggregateCheck, AggregateRejection, HEAD_MARGIN, HeadScores, MIN_GAIN_SHARE,
    MIN_HEAD_ALIGNMENT, MIN_HEAD_EXAMPLES, ShardScores, check_adoption, check_aggregate,
    check_by_data, check_head,
};
pub use consensus::{
    ConsensusError, Pull, PullConfig, pull, snapshot, snapshot_encoded, snapshot_partner,
    snapshot_partners,
};
pub use decode::{DecodedValues, decode, decode_iter, decode_update};
pub use distiller::{Distilled, Distiller, LayerReport, Report};
pub use embed::{Embedded, Embedder, EmbeddingConfig};
pub use error::{ConfigError, DecodeError, DistillError, EmbedError, RestoreError, SynthError};
pub use layout::Layout;
pub use policy::{LayerPlan, Policy, TopKValues};
pub use source::{Filled, LayerSource};
pub use state::{DistillerState, EncodedState, STATE_VERSION, f32_le_bytes};
pub use synth::{
    Contribution, MergeFill, MergeRule, PeerUpdate, Rejection, SynthConfig, Synthesis, UpdateRef,
    Verdict, cap_samples, synthesize, synthesize_with,
};
pub use update::{SparseUpdate, Update, UpdateBuilder, UpdateView};

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
