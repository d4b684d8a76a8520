//! [`Kernels`] on host slices for [`CudaBackend`]: long slices of the kernels the device runs go
//! there and back; everything else, and any device failure, runs on the CPU implementation.
//!
//! The CPU is also the authority on errors: a device run that finds a bad input (or fails for
//! any other reason) is discarded before anything is written back, and the CPU kernel reruns on
//! the untouched host slices and reports the exact typed error (with the offending index).

use half::bf16;
use tracing::debug;

use super::{CudaBackend, CudaError, DEVICE_MIN_LEN};
use crate::cpu::Kernels;
use crate::error::{
    AccumulateError, DequantizeError, QuantizeError, SignPackError, SignUnpackError, SimHashError,
    SketchError, TopKError,
};
use crate::simhash::SimHasher;
use crate::types::{
    Candidates, CountSketch, Fused, Rounding, SelectMethod, Selection, SimHashOutput, SketchInto,
    Stats,
};

/// Log a device failure that the CPU is about to retry.
fn fell_back(kernel: &str, e: &CudaError) {
    debug!(kernel, error = %e, "kernels: device run failed, rerunning on the CPU");
}

impl CudaBackend {
    fn accumulate_host(&self, residual: &mut [f32], update: &[f32]) -> Result<Stats, CudaError> {
        let s = self.stream();
        let mut r = s.clone_htod(residual)?;
        let u = s.clone_htod(update)?;
        let stats = self.accumulate_on_device(&mut r, &u)?;
        s.memcpy_dtoh(&r, residual)?;
        Ok(stats)
    }

    fn topk_host(&self, residual: &mut [f32], k: usize) -> Result<Selection, CudaError> {
        let s = self.stream();
        let mut r = s.clone_htod(residual)?;
        let sel = self.topk_on_device(&mut r, k)?;
        let indices = s.clone_dtoh(&sel.indices)?;
        let values = s.clone_dtoh(&sel.values)?;
        // Zero on the host what the device zeroed, instead of copying the slice back.
        for &i in &indices {
            if let Some(v) = residual.get_mut(i as usize) {
                *v = 0.0;
            }
        }
        Ok(Selection {
            indices,
            values,
            threshold: sel.threshold,
            method: SelectMethod::Exact,
        })
    }

    fn quantize_host(
        &self,
        x: &[f32],
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, CudaError> {
        let s = self.stream();
        let xd = s.clone_htod(x)?;
        let mut q = s.alloc_zeros::<i8>(x.len())?;
        let scale = self.quantize_i8_on_device(&xd, rounding, &mut q)?;
        s.memcpy_dtoh(&q, out)?;
        Ok(scale)
    }

    fn sign_pack_host(&self, x: &[f32], words: &mut [u64]) -> Result<f32, CudaError> {
        let s = self.stream();
        let xd = s.clone_htod(x)?;
        let mut w = s.alloc_zeros::<u64>(words.len())?;
        let scale = self.sign_pack_on_device(&xd, &mut w)?;
        s.memcpy_dtoh(&w, words)?;
        Ok(scale)
    }

    fn sketch_host(
        &self,
        sketch: &CountSketch,
        x: &[f32],
        center: Option<&[f32]>,
        first_index: u64,
        out: &mut [f32],
    ) -> Result<f64, CudaError> {
        let s = self.stream();
        let xd = s.clone_htod(x)?;
        let cd = center.map(|c| s.clone_htod(c)).transpose()?;
        let mut o = s.clone_htod(out)?;
        let sum_sq = self.count_sketch_on_device(sketch, &xd, cd.as_ref(), first_index, &mut o)?;
        s.memcpy_dtoh(&o, out)?;
        Ok(sum_sq)
    }
}

impl Kernels for CudaBackend {
    fn accumulate(&self, residual: &mut [f32], update: &[f32]) -> Result<Stats, AccumulateError> {
        if update.len() >= DEVICE_MIN_LEN && residual.len() == update.len() {
            match self.accumulate_host(residual, update) {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("accumulate", &e),
            }
        }
        self.cpu().accumulate(residual, update)
    }

    fn stats(&self, x: &[f32]) -> Result<Stats, AccumulateError> {
        if x.len() >= DEVICE_MIN_LEN {
            let run = || -> Result<Stats, CudaError> {
                let xd = self.stream().clone_htod(x)?;
                self.stats_on_device(&xd)
            };
            match run() {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("stats", &e),
            }
        }
        self.cpu().stats(x)
    }

    fn find_non_finite(&self, x: &[f32]) -> Option<(usize, f32)> {
        self.cpu().find_non_finite(x)
    }

    fn topk_exact(&self, residual: &mut [f32], k: usize) -> Result<Selection, TopKError> {
        if residual.len() >= DEVICE_MIN_LEN && k <= residual.len() {
            match self.topk_host(residual, k) {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("topk_exact", &e),
            }
        }
        self.cpu().topk_exact(residual, k)
    }

    fn topk_sampled(
        &self,
        residual: &mut [f32],
        k: usize,
        seed: u64,
    ) -> Result<Selection, TopKError> {
        self.cpu().topk_sampled(residual, k, seed)
    }

    fn quantize_i8(
        &self,
        x: &[f32],
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        if x.len() >= DEVICE_MIN_LEN && x.len() == out.len() {
            match self.quantize_host(x, rounding, out) {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("quantize_i8", &e),
            }
        }
        self.cpu().quantize_i8(x, rounding, out)
    }

    fn quantize_i8_piece(
        &self,
        x: &[f32],
        abs_max: f32,
        start: usize,
        rounding: Rounding,
        out: &mut [i8],
    ) -> Result<f32, QuantizeError> {
        // Pieces are what a host-memory model is quantised in: no device round trip.
        self.cpu()
            .quantize_i8_piece(x, abs_max, start, rounding, out)
    }

    fn dequantize_i8(&self, q: &[i8], scale: f32, out: &mut [f32]) -> Result<(), DequantizeError> {
        self.cpu().dequantize_i8(q, scale, out)
    }

    fn sign_pack(&self, x: &[f32], words: &mut [u64]) -> Result<f32, SignPackError> {
        if x.len() >= DEVICE_MIN_LEN && words.len() == x.len().div_ceil(64) {
            match self.sign_pack_host(x, words) {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("sign_pack", &e),
            }
        }
        self.cpu().sign_pack(x, words)
    }

    fn sign_unpack(
        &self,
        words: &[u64],
        scale: f32,
        out: &mut [f32],
    ) -> Result<(), SignUnpackError> {
        self.cpu().sign_unpack(words, scale, out)
    }

    fn count_sketch(
        &self,
        sketch: &CountSketch,
        x: &[f32],
        center: Option<&[f32]>,
        first_index: u64,
        out: &mut [f32],
    ) -> Result<f64, SketchError> {
        if x.len() >= DEVICE_MIN_LEN {
            match self.sketch_host(sketch, x, center, first_index, out) {
                Ok(s) => return Ok(s),
                Err(e) => fell_back("count_sketch", &e),
            }
        }
        self.cpu().count_sketch(sketch, x, center, first_index, out)
    }

    fn simhash(&self, hasher: &SimHasher, v: &[f32]) -> Result<SimHashOutput, SimHashError> {
        self.cpu().simhash(hasher, v)
    }

    fn accumulate_fused(
        &self,
        residual: &mut [f32],
        update: &[f32],
        sketch: Option<SketchInto<'_>>,
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        self.cpu()
            .accumulate_fused(residual, update, sketch, threshold)
    }

    fn sample_threshold(
        &self,
        residual: &[f32],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        self.cpu().sample_threshold(residual, update, k, seed)
    }

    fn topk_candidates(
        &self,
        residual: &mut [f32],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        self.cpu().topk_candidates(residual, candidates, k)
    }

    fn accumulate_fused_bf16(
        &self,
        residual: &mut [bf16],
        update: &[f32],
        threshold: Option<f32>,
    ) -> Result<Fused, AccumulateError> {
        self.cpu()
            .accumulate_fused_bf16(residual, update, threshold)
    }

    fn sample_threshold_bf16(
        &self,
        residual: &[bf16],
        update: &[f32],
        k: usize,
        seed: u64,
    ) -> Option<f32> {
        self.cpu().sample_threshold_bf16(residual, update, k, seed)
    }

    fn topk_candidates_bf16(
        &self,
        residual: &[bf16],
        candidates: Candidates,
        k: usize,
    ) -> Result<Selection, TopKError> {
        self.cpu().topk_candidates_bf16(residual, candidates, k)
    }
}
