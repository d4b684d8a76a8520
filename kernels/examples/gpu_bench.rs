//! GPU bench of the CUDA kernels (feature `cuda`): parity with the CPU kernels on fresh random
//! data, then timings on device-resident buffers against a device-to-device copy (the bandwidth
//! ceiling) and against torch on the same tensors, in the same job.
//!
//! ```text
//! cargo build --release -p kindred-kernels --features cuda --example gpu_bench
//! target/release/examples/gpu_bench --elems 100000000 --k-frac 0.01 --iters 20
//! ```
//!
//! It runs `python3 kernels/examples/gpu_bench_torch.py` (override with `--torch PATH`, skip with
//! `--torch none`) for the torch timings; without torch `torch_ms` is `null`. Output: one JSON line
//! per kernel, `{"kernel","elems","ms","gb_s","d2d_gb_s","torch_ms","parity"}`, where `gb_s` is
//! the bytes the kernel must move (listed per kernel below) over its time, and `d2d_gb_s` the
//! read+write bandwidth of a device-to-device copy of `elems` f32 measured in the same run.
//! Without a usable GPU it prints why and exits with status 2.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::collections::HashMap;
use std::process::{Command, ExitCode};

use kindred_kernels::cudarc::driver::CudaSlice;
use kindred_kernels::cudarc::driver::sys::CUevent_flags;
use kindred_kernels::rng::SplitMix64;
use kindred_kernels::{Backend, CountSketch, CpuBackend, CudaBackend, Kernels, Rounding};

struct Args {
    elems: usize,
    k_frac: f64,
    iters: usize,
    torch: String,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        elems: 100_000_000,
        k_frac: 0.01,
        iters: 20,
        torch: "kernels/examples/gpu_bench_torch.py".to_owned(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--elems" => a.elems = v.parse().map_err(|e| bad(&e))?,
            "--k-frac" => a.k_frac = v.parse().map_err(|e| bad(&e))?,
            "--iters" => a.iters = v.parse::<usize>().map_err(|e| bad(&e))?.max(1),
            "--torch" => a.torch = v,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_gaussian() as f32).collect()
}

/// Torch timings by kernel name, from the companion script run on the same tensors (`r`, `u`,
/// written as raw little-endian f32 files for it); empty when it cannot run.
fn torch_times(a: &Args, k: usize, r: &[f32], u: &[f32]) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    if a.torch == "none" {
        return out;
    }
    let dir = std::env::temp_dir().join(format!("kindred-gpu-bench-{}", std::process::id()));
    let write = |name: &str, v: &[f32]| -> std::io::Result<()> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.join(name), bytes)
    };
    if let Err(e) = std::fs::create_dir_all(&dir)
        .and_then(|()| write("r.f32", r))
        .and_then(|()| write("u.f32", u))
    {
        eprintln!(
            "cannot write the tensors for torch to {}: {e}",
            dir.display()
        );
        return out;
    }
    let run = Command::new("python3")
        .arg(&a.torch)
        .arg("--data")
        .arg(&dir)
        .args(["--elems", &a.elems.to_string()])
        .args(["--k", &k.to_string()])
        .args(["--iters", &a.iters.to_string()])
        .output();
    match run {
        Ok(o) if o.status.success() => {
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(line)
                    && let (Some(k), Some(ms)) = (v["kernel"].as_str(), v["torch_ms"].as_f64())
                {
                    out.insert(k.to_owned(), ms);
                }
            }
        }
        Ok(o) => eprintln!(
            "torch script failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => eprintln!("cannot run python3 {}: {e}", a.torch),
    }
    let _ = std::fs::remove_dir_all(&dir);
    out
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Median milliseconds of `f(r)` over `iters` runs, timed by CUDA events on the backend's
/// stream (host synchronisations inside `f` count as the idle time they cost); with `reset`, `r`
/// is restored from it (untimed) before each run.
fn time(
    gpu: &CudaBackend,
    iters: usize,
    r: &mut CudaSlice<f32>,
    reset: Option<&CudaSlice<f32>>,
    mut f: impl FnMut(&mut CudaSlice<f32>) -> Res<()>,
) -> Res<f64> {
    let s = gpu.stream();
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let prep = |r: &mut CudaSlice<f32>| -> Res<()> {
        if let Some(src) = reset {
            s.memcpy_dtod(src, r)?;
        }
        Ok(())
    };
    prep(r)?;
    f(r)?; // warm-up
    let mut ms = Vec::with_capacity(iters);
    for _ in 0..iters {
        prep(r)?;
        let start = s.record_event(timing)?;
        f(r)?;
        let end = s.record_event(timing)?;
        ms.push(f64::from(start.elapsed_ms(&end)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

fn parity(gpu: &CudaBackend, n: usize, k: usize) -> Res<HashMap<&'static str, bool>> {
    let cpu = CpuBackend::new();
    let dev = Backend::Cuda(gpu.clone());
    let (r0, u) = (random(n, 1), random(n, 2));
    let mut p = HashMap::new();

    let (mut rc, mut rg) = (r0.clone(), r0.clone());
    let sc = cpu.accumulate(&mut rc, &u)?;
    let sg = dev.accumulate(&mut rg, &u)?;
    p.insert("accumulate", sc == sg && rc == rg);

    let mut ok = true;
    for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 7 }] {
        let (mut qc, mut qg) = (vec![0i8; n], vec![0i8; n]);
        let a = cpu.quantize_i8(&rc, rounding, &mut qc)?;
        let b = dev.quantize_i8(&rc, rounding, &mut qg)?;
        ok &= a.to_bits() == b.to_bits() && qc == qg;
    }
    p.insert("quantize_i8", ok);

    // Fused error feedback: v = r + u, q = quant(v), r = v - q * scale.
    let mut v = r0.clone();
    v.iter_mut().zip(&u).for_each(|(a, b)| *a += b);
    let mut qc = vec![0i8; n];
    let scale = cpu.quantize_i8(&v, Rounding::Nearest, &mut qc)?;
    let rc_ef: Vec<f32> = v
        .iter()
        .zip(&qc)
        .map(|(x, q)| x - f32::from(*q) * scale)
        .collect();
    let s = gpu.stream();
    let mut rd = s.clone_htod(&r0)?;
    let ud = s.clone_htod(&u)?;
    let mut qd = s.alloc_zeros::<i8>(n)?;
    let sg = gpu.quantize_i8_ef_on_device(&mut rd, Some(&ud), Rounding::Nearest, &mut qd)?;
    let ok = sg.to_bits() == scale.to_bits()
        && s.clone_dtoh(&qd)? == qc
        && s.clone_dtoh(&rd)?
            .iter()
            .zip(&rc_ef)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    p.insert("quantize_i8_ef", ok);

    let words = n.div_ceil(64);
    let (mut wc, mut wg) = (vec![0u64; words], vec![0u64; words]);
    let a = cpu.sign_pack(&rc, &mut wc)?;
    let b = dev.sign_pack(&rc, &mut wg)?;
    p.insert("sign_pack", a.to_bits() == b.to_bits() && wc == wg);

    let (mut tc, mut tg) = (rc.clone(), rc.clone());
    let a = cpu.topk_exact(&mut tc, k)?;
    let b = dev.topk_exact(&mut tg, k)?;
    p.insert(
        "topk",
        a.indices == b.indices && a.values == b.values && tc == tg,
    );

    let sketch = CountSketch {
        seed: 3,
        buckets: 1 << 16,
    };
    let (mut oc, mut og) = (vec![0f32; sketch.buckets], vec![0f32; sketch.buckets]);
    let a = cpu.count_sketch(&sketch, &u, Some(&r0), 5, &mut oc)?;
    let b = dev.count_sketch(&sketch, &u, Some(&r0), 5, &mut og)?;
    let scale = oc.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let close = oc
        .iter()
        .zip(&og)
        .all(|(x, y)| (x - y).abs() <= 1e-4 * scale);
    p.insert(
        "count_sketch",
        close && ((a - b) / a.max(1e-30)).abs() < 1e-6,
    );
    Ok(p)
}

fn run(a: &Args, gpu: &CudaBackend) -> Res<()> {
    let n = a.elems;
    let k = ((n as f64 * a.k_frac) as usize).clamp(1, n.max(1));
    eprintln!(
        "device: {} (sm_{}{}), {n} elements, k = {k}",
        gpu.device_name(),
        gpu.compute_capability().0,
        gpu.compute_capability().1
    );
    let parity = parity(gpu, n, k)?;
    let (r_host, u_host) = (random(n, 11), random(n, 12));
    let torch = torch_times(a, k, &r_host, &u_host);
    let s = gpu.stream().clone();
    let r0 = s.clone_htod(&r_host)?;
    let u = s.clone_htod(&u_host)?;
    let mut r: CudaSlice<f32> = s.clone_htod(&r_host)?;
    drop((r_host, u_host));
    let mut copy = s.alloc_zeros::<f32>(n)?;
    let d2d_ms = time(
        gpu,
        a.iters,
        &mut copy,
        None,
        |c| Ok(s.memcpy_dtod(&r0, c)?),
    )?;
    let d2d = 8.0 * n as f64 / d2d_ms / 1e6;
    let mut q = s.alloc_zeros::<i8>(n)?;
    let mut words = s.alloc_zeros::<u64>(n.div_ceil(64))?;
    let sketch = CountSketch {
        seed: 3,
        buckets: 1 << 16,
    };
    let mut buckets = s.alloc_zeros::<f32>(sketch.buckets)?;
    let abs_max = gpu.stats_on_device(&r0)?.abs_max * 2.0 + 8.0;

    let mut rows: Vec<(&str, &str, f64, f64)> = Vec::new(); // kernel, parity key, ms, bytes
    let ms = time(gpu, a.iters, &mut r, Some(&r0), |r| {
        gpu.accumulate_on_device(r, &u)?;
        Ok(())
    })?;
    rows.push(("accumulate", "accumulate", ms, 12.0 * n as f64));
    let ms = time(gpu, a.iters, &mut r, Some(&r0), |r| {
        gpu.quantize_i8_ef_with_abs_max(r, Some(&u), abs_max, Rounding::Nearest, &mut q)?;
        Ok(())
    })?;
    rows.push(("quantize_i8_ef", "quantize_i8_ef", ms, 13.0 * n as f64));
    let ms = time(gpu, a.iters, &mut r, Some(&r0), |r| {
        gpu.quantize_i8_ef_on_device(r, Some(&u), Rounding::Nearest, &mut q)?;
        Ok(())
    })?;
    rows.push((
        "quantize_i8_ef_with_absmax_pass",
        "quantize_i8_ef",
        ms,
        21.0 * n as f64,
    ));
    let ms = time(gpu, a.iters, &mut r, None, |_| {
        gpu.sign_pack_on_device(&r0, &mut words)?;
        Ok(())
    })?;
    rows.push((
        "sign_pack",
        "sign_pack",
        ms,
        4.0 * n as f64 + n as f64 / 8.0,
    ));
    let ms = time(gpu, a.iters, &mut r, Some(&r0), |r| {
        let _sel = gpu.topk_on_device(r, k)?;
        Ok(())
    })?;
    rows.push(("topk", "topk", ms, 4.0 * n as f64));
    let ms = time(gpu, a.iters, &mut r, None, |_| {
        gpu.count_sketch_on_device(&sketch, &u, None, 0, &mut buckets)?;
        Ok(())
    })?;
    rows.push(("count_sketch", "count_sketch", ms, 4.0 * n as f64));

    for (kernel, key, ms, bytes) in rows {
        let line = serde_json::json!({
            "kernel": kernel,
            "elems": n,
            "ms": ms,
            "gb_s": bytes / ms / 1e6,
            "d2d_gb_s": d2d,
            "torch_ms": torch.get(kernel).copied(),
            "parity": parity.get(key).copied().unwrap_or(false),
        });
        println!("{line}");
    }
    let line = serde_json::json!({
        "kernel": "d2d_copy", "elems": n, "ms": d2d_ms, "gb_s": d2d, "d2d_gb_s": d2d,
        "torch_ms": torch.get("d2d_copy").copied(), "parity": true,
    });
    println!("{line}");
    Ok(())
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            return ExitCode::from(1);
        }
    };
    let gpu = match CudaBackend::new(0) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu_bench: no usable GPU: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&a, &gpu) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_bench: {e}");
            ExitCode::from(1)
        }
    }
}
