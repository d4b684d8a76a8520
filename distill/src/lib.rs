//! Kindred's distillation: turning a model update into a small outcome-packet body and an
//! embedding, and merging the updates of similar peers back into one.
//!
//! This crate will own the selective-compression policy (per layer and round: dense f16, top-k +
//! int8, or 1-bit sign, with a warm-up schedule and a byte-budget mode), the error-feedback
//! residuals that keep what was not sent for the next round, deterministic decoding, the update
//! embedding (centred, per-layer normalised, count-sketched, SimHashed) that routing keys on, and
//! synthesis: the robust, similarity-weighted merge of a node's own update with its peers'.
//!
//! It computes through `kindred-kernels` and speaks `kindred-proto` types; it does no networking
//! and no storage, so the node and the simulator run exactly the same code.
