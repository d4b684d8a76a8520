//! Throughput of every kernel and of the whole `distill` pipeline, next to memcpy bandwidth
//! measured in the same run.
//!
//! ```text
//! cargo run --release -p kindred-distill --example distill_bench -- --elems 16777216
//! ```
//!
//! Prints one JSON line per kernel and size: `{"kernel", "elems", "gelem_s", "gb_s",
//! "memcpy_gb_s", "threads", "backend", "bytes_per_elem", "median_ms", "runs"}`. Figures are medians of
//! `--runs` timed runs after one warm-up run. `gb_s` counts the bytes the kernel must move at
//! minimum (`bytes_per_elem` × elems, e.g. 12 for `residual += update`: two reads and a write);
//! `memcpy_gb_s` is the bytes per second one `copy_from_slice` of the same number of f32 copies.
//! `threads` is 1 for the single-core figures the acceptance targets are about; lines with more
//! threads use rayon's pool; with `--cuda`, lines with `"backend": "cuda"` (and `threads` 0) run
//! on the GPU from host slices. The pipeline lines also carry `ratio_to_memcpy`
//! (`gb_s / memcpy_gb_s`).

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::hint::black_box;
use std::time::Instant;

use cpu_time::ThreadTime;

use anyhow::{Context, Result};
use clap::Parser;
use kindred_distill::{Distiller, EmbeddingConfig, Policy, PullConfig, decode, pull, snapshot};
use kindred_kernels::rng::SplitMix64;
use kindred_kernels::{
    Backend, CountSketch, Kernels, Rounding, SelectMethod, SimHasher, SketchInto,
};
use kindred_proto::{
    DType, Embedding, HeaderFields, LayerSpec, ModelSpec, OutcomePacket, seal_snapshot,
};
use libp2p_identity::ed25519;
use serde_json::json;

#[derive(Parser)]
#[command(about = "Kernel and pipeline throughput next to memcpy bandwidth")]
struct Args {
    /// Elements (f32) per benchmark; several sizes may be given, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "16777216")]
    elems: Vec<usize>,
    /// Timed runs per figure (the median is reported).
    #[arg(long, default_value_t = 7)]
    runs: usize,
    /// Top-k density.
    #[arg(long, default_value_t = 0.01)]
    density: f64,
    /// Also measure with rayon's pool (all cores), not only on one thread.
    #[arg(long)]
    parallel: bool,
    /// Also measure on the CUDA backend (build with `--features kindred-kernels/cuda`); the
    /// kernels take host slices, so these figures include the transfers to and from the GPU.
    #[arg(long)]
    cuda: bool,
    /// Seed of the random data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Only run figures whose name contains one of these (comma-separated); default all.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

/// Wall-clock and thread-CPU seconds of one timed call.
#[derive(Clone, Copy)]
struct Timing {
    wall: f64,
    cpu: f64,
}

/// Medians (wall and thread CPU time, separately) of `runs` calls of `f(state)`, after one untimed
/// warm-up call; `setup(state)` runs before each call, outside the clock. CPU time is what the
/// calling thread itself used: on a shared machine it is the better single-core figure, and
/// multi-threaded runs count only the calling thread, so it is reported for one-thread lines only.
fn time<S, T>(
    runs: usize,
    state: &mut S,
    mut setup: impl FnMut(&mut S),
    mut f: impl FnMut(&mut S) -> T,
) -> Timing {
    setup(state);
    black_box(f(state));
    let mut walls = Vec::with_capacity(runs);
    let mut cpus = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        setup(state);
        let c = ThreadTime::now();
        let t = Instant::now();
        black_box(f(state));
        walls.push(t.elapsed().as_secs_f64());
        cpus.push(c.elapsed().as_secs_f64());
    }
    walls.sort_by(f64::total_cmp);
    cpus.sort_by(f64::total_cmp);
    Timing {
        wall: walls[walls.len() / 2],
        cpu: cpus[cpus.len() / 2],
    }
}

struct Line {
    kernel: &'static str,
    elems: usize,
    bytes_per_elem: f64,
    t: Timing,
    threads: usize,
    backend: &'static str,
}

fn emit(l: &Line, memcpy_gb_s: f64, runs: usize, extra: Option<(&str, f64)>) {
    let secs = l.t.wall;
    let gb_s = l.elems as f64 * l.bytes_per_elem / secs / 1e9;
    let mut v = json!({
        "kernel": l.kernel,
        "elems": l.elems,
        "gelem_s": round3(l.elems as f64 / secs / 1e9),
        "gb_s": round3(gb_s),
        "memcpy_gb_s": round3(memcpy_gb_s),
        "threads": l.threads,
        "backend": l.backend,
        "bytes_per_elem": l.bytes_per_elem,
        "median_ms": round3(secs * 1e3),
        "runs": runs,
    });
    if l.threads == 1 && l.backend == "cpu" {
        v["cpu_ms"] = json!(round3(l.t.cpu * 1e3));
        v["cpu_gelem_s"] = json!(round3(l.elems as f64 / l.t.cpu / 1e9));
    }
    if let Some((k, x)) = extra {
        v[k] = json!(round3(x));
    }
    if l.kernel.starts_with("distill") {
        v["ratio_to_memcpy"] = json!(round3(gb_s / memcpy_gb_s));
    }
    println!("{v}");
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Heavy-tailed values like real gradients: Gaussian times a log-uniform scale.
fn gradient_like(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|_| {
            let g = rng.next_gaussian();
            let s = (rng.next_f64() * 4.0 - 2.0).exp2();
            (g * s * 1e-3) as f32
        })
        .collect()
}

fn bench_size(args: &Args, n: usize, backend: &Backend, threads: usize) -> Result<()> {
    let runs = args.runs;
    eprintln!("# {n} elements, {threads} thread(s): generating data");
    let update = gradient_like(n, args.seed);
    let residual0 = gradient_like(n, args.seed + 1);
    let k = ((n as f64 * args.density).ceil() as usize).min(n);

    // memcpy: f32 copy of the same size, in this run.
    let mut dst = vec![0f32; n];
    let t = time(
        runs,
        &mut dst,
        |_| {},
        |d| d.copy_from_slice(black_box(&update)),
    );
    let memcpy_gb_s = n as f64 * 4.0 / t.wall / 1e9;
    let want =
        |name: &str| args.only.is_empty() || args.only.iter().any(|o| name.contains(o.as_str()));
    let line = |kernel, bytes_per_elem, t| Line {
        kernel,
        elems: n,
        bytes_per_elem,
        t,
        threads,
        backend: backend.name(),
    };
    emit(&line("memcpy", 4.0, t), memcpy_gb_s, runs, None);

    let mut r = residual0.clone();
    if want("accumulate_stats") {
        let t = time(
            runs,
            &mut r,
            |_| {},
            |r| backend.accumulate(r, &update).unwrap(),
        );
        emit(&line("accumulate_stats", 12.0, t), memcpy_gb_s, runs, None);
    }
    if want("accumulate_fused") {
        // The fused pass alone: add + stats + count-sketch + top-k candidates.
        let sk = CountSketch {
            seed: 11,
            buckets: EmbeddingConfig::default().sketch_dim,
        };
        let threshold = backend.sample_threshold(&residual0, &update, k, 5);
        let mut out = vec![0f32; sk.buckets];
        let t = time(
            runs,
            &mut r,
            |r| r.copy_from_slice(&residual0),
            |r| {
                let sketch = SketchInto {
                    sketch: &sk,
                    center: None,
                    first_index: 0,
                    out: &mut out,
                };
                backend
                    .accumulate_fused(r, &update, Some(sketch), threshold)
                    .unwrap()
            },
        );
        emit(&line("accumulate_fused", 12.0, t), memcpy_gb_s, runs, None);
    }
    let reset = |r: &mut Vec<f32>| r.copy_from_slice(&residual0);
    if want("topk_exact") {
        let t = time(runs, &mut r, reset, |r| backend.topk_exact(r, k).unwrap());
        emit(&line("topk_exact", 4.0, t), memcpy_gb_s, runs, None);
    }
    if want("topk_sampled") {
        let mut candidates = 0.0;
        let t = time(runs, &mut r, reset, |r| {
            let sel = backend.topk_sampled(r, k, 7).unwrap();
            if let SelectMethod::Sampled { candidates: c } = sel.method {
                candidates = c as f64;
            }
        });
        emit(
            &line("topk_sampled", 4.0, t),
            memcpy_gb_s,
            runs,
            Some(("candidates_per_k", candidates / k as f64)),
        );
    }
    let mut q = vec![0i8; n];
    if want("int8_quantize") {
        let t = time(
            runs,
            &mut q,
            |_| {},
            |q| backend.quantize_i8(&update, Rounding::Nearest, q).unwrap(),
        );
        emit(&line("int8_quantize", 5.0, t), memcpy_gb_s, runs, None);
    }
    if want("int8_quantize_stochastic") {
        let t = time(
            runs,
            &mut q,
            |_| {},
            |q| {
                backend
                    .quantize_i8(&update, Rounding::Stochastic { seed: 3 }, q)
                    .unwrap()
            },
        );
        emit(
            &line("int8_quantize_stochastic", 5.0, t),
            memcpy_gb_s,
            runs,
            None,
        );
    }
    if want("int8_dequantize") {
        let scale = backend
            .quantize_i8(&update, Rounding::Nearest, &mut q)
            .unwrap();
        let t = time(
            runs,
            &mut dst,
            |_| {},
            |d| backend.dequantize_i8(&q, scale, d).unwrap(),
        );
        emit(&line("int8_dequantize", 5.0, t), memcpy_gb_s, runs, None);
    }
    let mut words = vec![0u64; n.div_ceil(64)];
    if want("sign_pack") {
        let t = time(
            runs,
            &mut words,
            |_| {},
            |w| backend.sign_pack(&update, w).unwrap(),
        );
        emit(&line("sign_pack", 4.125, t), memcpy_gb_s, runs, None);
    }
    if want("sign_unpack") {
        let t = time(
            runs,
            &mut dst,
            |_| {},
            |d| backend.sign_unpack(&words, 0.5, d).unwrap(),
        );
        emit(&line("sign_unpack", 4.125, t), memcpy_gb_s, runs, None);
    }
    let sketch = CountSketch {
        seed: 11,
        buckets: EmbeddingConfig::default().sketch_dim,
    };
    let mut buckets = vec![0f32; sketch.buckets];
    let zero = |b: &mut Vec<f32>| b.fill(0.0);
    if want("count_sketch") {
        let t = time(runs, &mut buckets, zero, |b| {
            backend.count_sketch(&sketch, &update, None, 0, b).unwrap()
        });
        emit(&line("count_sketch", 4.0, t), memcpy_gb_s, runs, None);
        let t = time(runs, &mut buckets, zero, |b| {
            backend
                .count_sketch(&sketch, &update, Some(&residual0), 0, b)
                .unwrap()
        });
        emit(
            &line("count_sketch_centered", 8.0, t),
            memcpy_gb_s,
            runs,
            None,
        );
    }

    // Model snapshots, what a node does each round (seal after the merge) and in snapshot rounds
    // (decode a partner's, pull toward it). Single-threaded plain loops: no backend.
    // An int8 snapshot is about one byte per parameter: past the body limit it cannot be sealed.
    let snapshot_fits = n + 64 <= kindred_proto::MAX_BODY_BYTES;
    if !snapshot_fits && (want("snapshot") || want("pull")) {
        eprintln!("# {n} elements: no snapshot figures (a snapshot would pass the body limit)");
    }
    if snapshot_fits && (want("snapshot") || want("pull")) {
        let spec = ModelSpec::new(vec![LayerSpec::new("w", [u32::try_from(n)?], DType::F32)])?;
        let origin = gradient_like(n, args.seed + 2);
        let params: Vec<f32> = origin.iter().zip(&update).map(|(o, u)| o + u).collect();
        let key = ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes([7; 32])?);
        let fields = || HeaderFields {
            round: 1,
            unix_ms: 0,
            samples: 0,
            loss: 0.0,
            embedding: Embedding::default(),
        };
        // Reads params and origin (8 bytes) and writes their difference (4), which the int8
        // quantiser reads twice (the scale, then the values: 8) before writing int8 (1).
        let t = time(
            runs,
            &mut (),
            |_| {},
            |_| snapshot(&params, &origin, &spec).unwrap(),
        );
        emit(&line("snapshot_int8", 21.0, t), memcpy_gb_s, runs, None);
        // The node's whole per-round step: the body, its encoding, blake3, the signature and the
        // receivers' own checks that `seal_snapshot` runs.
        let t = time(
            runs,
            &mut (),
            |_| {},
            |_| {
                let body = snapshot(&params, &origin, &spec).unwrap();
                seal_snapshot(&key, &spec, fields(), &body).unwrap()
            },
        );
        emit(&line("snapshot_seal", 10.0, t), memcpy_gb_s, runs, None);
        let sealed = seal_snapshot(&key, &spec, fields(), &snapshot(&params, &origin, &spec)?)?;
        let partner = decode(
            &OutcomePacket::decode_snapshot(&sealed.header_bytes, &sealed.body_bytes, &spec)?.body,
            &spec,
        )?;
        // Two passes over params, origin and the partner (the step's norm, then the step).
        let mut mine = params.clone();
        let start: Vec<f32> = update.iter().map(|u| u * 0.5).collect();
        let t = time(
            runs,
            &mut mine,
            |m| m.copy_from_slice(&start),
            |m| pull(m, &origin, &partner, f64::MAX, &PullConfig::default()).unwrap(),
        );
        emit(&line("snapshot_pull", 28.0, t), memcpy_gb_s, runs, None);
    }

    // The whole pipeline: one 16M-parameter layer, default policy past warm-up (1% top-k +
    // int8, sampled threshold), embedding (count-sketch + SimHash) included.
    let side = (n as f64).sqrt() as u32;
    let rows = u32::try_from(n / side as usize).context("size")?;
    let spec =
        ModelSpec::new(vec![LayerSpec::new("w", [rows, side], DType::F32)]).context("spec")?;
    if want("distill_pipeline") && spec.numel() as usize == n {
        let policy = Policy {
            density: args.density as f32,
            ..Policy::default()
        };
        let mut distiller = Distiller::new(spec.clone(), policy, EmbeddingConfig::default())?
            .with_backend(backend.clone());
        while distiller.policy().in_warmup(distiller.round()) {
            let _ = distiller.distill(&update)?;
        }
        let mut bytes = 0;
        let t = time(
            runs,
            &mut distiller,
            |_| {},
            |d| {
                bytes = d.distill(&update).unwrap().report.body_bytes;
            },
        );
        emit(
            &line("distill_pipeline", 12.0, t),
            memcpy_gb_s,
            runs,
            Some(("compression_ratio", (n * 4) as f64 / bytes as f64)),
        );
        distiller.accept_peer(&residual0)?;
        let t = time(
            runs,
            &mut distiller,
            |_| {},
            |d| d.distill(&update).unwrap(),
        );
        emit(
            &line("distill_pipeline_centered", 16.0, t),
            memcpy_gb_s,
            runs,
            None,
        );
    } else if want("distill_pipeline") {
        eprintln!("# {n} elements is not a rows x cols layer here; pipeline skipped");
    }
    if !want("simhash") {
        return Ok(());
    }
    let hasher = SimHasher::new(5, sketch.buckets)?;
    let v = gradient_like(sketch.buckets, 3);
    let t = time(
        runs,
        &mut (),
        |_| {},
        |_| backend.simhash(&hasher, &v).unwrap(),
    );
    let simhash = Line {
        kernel: "simhash",
        elems: sketch.buckets,
        bytes_per_elem: 4.0 * 257.0,
        t,
        threads: 1,
        backend: backend.name(),
    };
    emit(&simhash, memcpy_gb_s, runs, None);
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    for &n in &args.elems {
        anyhow::ensure!(n > 0, "--elems must be positive");
        bench_size(&args, n, &Backend::cpu_single_threaded(), 1)?;
        if args.parallel {
            let threads = rayon::current_num_threads();
            bench_size(&args, n, &Backend::cpu(), threads)?;
        }
        if args.cuda {
            let backend = Backend::detect();
            anyhow::ensure!(
                backend.name() == "cuda",
                "--cuda: no usable GPU (see the log line)"
            );
            bench_size(&args, n, &backend, 0)?;
        }
    }
    Ok(())
}
