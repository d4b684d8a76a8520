//! Every CUDA kernel source compiles with NVRTC (feature `cuda`).
//!
//! Needs only `libnvrtc`, no GPU: CI gets it from the `nvidia-cuda-nvrtc-cu12` wheel with its
//! `lib/` directory on `LD_LIBRARY_PATH` (cudarc opens `libnvrtc.so.12` by name). Without an
//! NVRTC library the test prints why and passes, so a plain `cargo test --features cuda` still
//! works anywhere — unless `KINDRED_REQUIRE_NVRTC` is set, as CI does.

#![cfg(feature = "cuda")]
#![allow(clippy::print_stderr, clippy::unwrap_used, clippy::expect_used)]

use kindred_kernels::cuda::{KERNEL_NAMES, compile_kernels, nvrtc_available};

/// Architectures the kernels must compile for: Ampere (A100), Ada (L4), Hopper (H100/H200).
const ARCHES: &[&str] = &["compute_80", "compute_89", "compute_90"];

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if !nvrtc_available() {
        // CI provides NVRTC and sets this, so there the compile can never be skipped silently.
        assert!(
            std::env::var_os("KINDRED_REQUIRE_NVRTC").is_none(),
            "KINDRED_REQUIRE_NVRTC is set but no libnvrtc could be loaded"
        );
        eprintln!(
            "SKIPPED every_kernel_compiles_with_nvrtc: no libnvrtc could be loaded \
             (pip install nvidia-cuda-nvrtc-cu12 and put its nvidia/cuda_nvrtc/lib on \
             LD_LIBRARY_PATH)"
        );
        return;
    }
    for arch in ARCHES {
        let ptx = compile_kernels(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let text = String::from_utf8_lossy(ptx.as_bytes().expect("NVRTC returns a PTX image"));
        for name in KERNEL_NAMES {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "{arch}: kernel {name} missing from the PTX"
            );
        }
        // Rounding must match the CPU's: no multiply-add may be contracted into an FMA.
        assert!(!text.contains("fma.rn.f32"), "{arch}: f32 FMA in the PTX");
        eprintln!(
            "compiled {} kernels for {arch}: {} bytes of PTX",
            KERNEL_NAMES.len(),
            text.len()
        );
    }
}

#[test]
fn detection_never_panics() {
    // Missing libraries are values: detection on this host must not panic either way.
    let backend = kindred_kernels::Backend::detect();
    assert!(matches!(backend.name(), "cpu" | "cuda"));
}
