//! Kindred's compute kernels: the arithmetic that distillation runs on every layer of every update,
//! over plain slices.
//!
//! This crate will own residual accumulation with per-tensor statistics, top-k selection by
//! magnitude, int8 quantisation, 1-bit sign packing, count-sketch and SimHash. Each kernel has one
//! definition dispatched through a `Backend`: a CPU backend (rayon for large slices, code shaped
//! so the compiler vectorises it) that is always built, and a CUDA backend behind the `cuda`
//! feature and a runtime check, so the same binary runs on hosts with and without a GPU.
//!
//! It knows nothing of layers, packets or compression policy: those live in `kindred-distill`.
