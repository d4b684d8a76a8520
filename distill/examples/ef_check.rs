//! Does error feedback matter? A learning check on the real MNIST files.
//!
//! ```text
//! cargo run --release -p kindred-distill --example ef_check -- --seed 1
//! ```
//!
//! Trains the same small MLP (784-128-10, ReLU, plain SGD, same initialisation, same batches)
//! three times on a seed-controlled split of the MNIST test set (8,000 train / 2,000 eval): with
//! dense updates, with every update distilled by the default [`Policy`] (top-k + int8 at 2% after
//! warm-up for the large layer, dense f16 for the small ones) **with** error feedback, and with the
//! same policy **without** error feedback. The data is read from `KINDRED_DATA` or
//! `../shared/data/mnist` beside the workspace. Progress goes to stderr; the last stdout line is
//! `{"acc_dense", "acc_topk_ef", "acc_topk_no_ef", "compression_ratio", ...}`, where the ratio is
//! f32 bytes over encoded body bytes of the error-feedback run, all rounds included.

#![allow(clippy::print_stdout, clippy::print_stderr, clippy::unwrap_used)]

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use candle_core::{D, DType as CDType, Device, Tensor, Var};
use clap::Parser;
use kindred_distill::{Distiller, EmbeddingConfig, Policy, decode};
use kindred_kernels::rng::SplitMix64;
use kindred_proto::{DType, LayerSpec, ModelSpec};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Dense vs top-k with and without error feedback on MNIST")]
struct Args {
    /// Seed of the split, the initialisation and the batch order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// SGD steps per run.
    #[arg(long, default_value_t = 1500)]
    steps: usize,
    /// Batch size.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f64,
    /// Hidden units.
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Directory holding t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz.
    #[arg(long, env = "KINDRED_DATA")]
    data: Option<PathBuf>,
}

const TRAIN: usize = 8000;
const PIXELS: usize = 784;

fn read_gz(path: &Path) -> Result<Vec<u8>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(file)
        .take(64 << 20)
        .read_to_end(&mut out)
        .with_context(|| format!("decompressing {}", path.display()))?;
    Ok(out)
}

fn be_u32(bytes: &[u8], at: usize) -> Result<usize> {
    let b = bytes.get(at..at + 4).context("truncated idx header")?;
    Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
}

/// Images scaled to [0, 1] and labels, from the idx files.
fn load_mnist(dir: &Path) -> Result<(Vec<f32>, Vec<u32>)> {
    let images = read_gz(&dir.join("t10k-images-idx3-ubyte.gz"))?;
    let labels = read_gz(&dir.join("t10k-labels-idx1-ubyte.gz"))?;
    ensure!(be_u32(&images, 0)? == 0x803, "bad image file magic");
    ensure!(be_u32(&labels, 0)? == 0x801, "bad label file magic");
    let n = be_u32(&images, 4)?;
    ensure!(
        be_u32(&images, 8)? * be_u32(&images, 12)? == PIXELS,
        "images are not 28x28"
    );
    ensure!(be_u32(&labels, 4)? == n, "image and label counts differ");
    let pixels = images
        .get(16..16 + n * PIXELS)
        .context("truncated images")?;
    let labels = labels.get(8..8 + n).context("truncated labels")?;
    ensure!(labels.iter().all(|&l| l < 10), "label out of range");
    Ok((
        pixels.iter().map(|&p| f32::from(p) / 255.0).collect(),
        labels.iter().map(|&l| u32::from(l)).collect(),
    ))
}

struct Data {
    x: Vec<f32>,
    y: Vec<u32>,
    train: Vec<usize>,
    eval: Vec<usize>,
}

fn batch_tensors(data: &Data, idx: &[usize], dev: &Device) -> Result<(Tensor, Tensor)> {
    let mut xs = Vec::with_capacity(idx.len() * PIXELS);
    let mut ys = Vec::with_capacity(idx.len());
    for &i in idx {
        xs.extend_from_slice(&data.x[i * PIXELS..(i + 1) * PIXELS]);
        ys.push(data.y[i]);
    }
    Ok((
        Tensor::from_vec(xs, (idx.len(), PIXELS), dev)?,
        Tensor::from_vec(ys, idx.len(), dev)?,
    ))
}

struct Mlp {
    params: Vec<Var>,
}

impl Mlp {
    fn new(init: &[Vec<f32>], spec: &ModelSpec, dev: &Device) -> Result<Self> {
        let params = init
            .iter()
            .zip(spec.layers())
            .map(|(v, l)| {
                let shape: Vec<usize> = l.shape().iter().map(|&d| d as usize).collect();
                Var::from_tensor(&Tensor::from_slice(v, shape, dev)?)
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self { params })
    }

    fn logits(&self, x: &Tensor) -> Result<Tensor> {
        let [w1, b1, w2, b2] = &self.params[..] else {
            bail!("the MLP has four parameter tensors");
        };
        let h = x.matmul(&w1.t()?)?.broadcast_add(b1)?.relu()?;
        Ok(h.matmul(&w2.t()?)?.broadcast_add(b2)?)
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let logits = self.logits(x)?;
        let log_probs = logits.broadcast_sub(&logits.log_sum_exp(D::Minus1)?.unsqueeze(1)?)?;
        let picked = log_probs.gather(&y.unsqueeze(1)?, 1)?;
        Ok(picked.mean_all()?.neg()?)
    }

    /// `-lr * grad`, flat in spec order.
    fn step_update(&self, loss: &Tensor, lr: f32) -> Result<Vec<f32>> {
        let grads = loss.backward()?;
        let mut out = Vec::new();
        for p in &self.params {
            let g = grads.get(p).context("missing gradient")?;
            out.extend(g.flatten_all()?.to_vec1::<f32>()?.iter().map(|v| -lr * v));
        }
        Ok(out)
    }

    fn apply(&self, update: &[f32]) -> Result<()> {
        let mut at = 0;
        for p in &self.params {
            let n = p.elem_count();
            let delta = Tensor::from_slice(&update[at..at + n], p.shape(), p.device())?;
            p.set(&(p.as_tensor() + delta)?)?;
            at += n;
        }
        Ok(())
    }

    fn accuracy(&self, data: &Data, dev: &Device) -> Result<f64> {
        let mut correct = 0usize;
        for chunk in data.eval.chunks(500) {
            let (x, y) = batch_tensors(data, chunk, dev)?;
            let pred = self.logits(&x)?.argmax(D::Minus1)?;
            let hits = pred
                .eq(&y)?
                .to_dtype(CDType::U32)?
                .sum_all()?
                .to_scalar::<u32>()?;
            correct += hits as usize;
        }
        Ok(correct as f64 / data.eval.len() as f64)
    }
}

enum Mode {
    Dense,
    Distilled(Box<Distiller>),
}

struct Run {
    accuracy: f64,
    f32_bytes: u64,
    body_bytes: u64,
}

fn train(
    args: &Args,
    data: &Data,
    spec: &ModelSpec,
    init: &[Vec<f32>],
    mut mode: Mode,
    name: &str,
) -> Result<Run> {
    let dev = Device::Cpu;
    let mlp = Mlp::new(init, spec, &dev)?;
    // Same batch order in every run.
    let mut rng = SplitMix64::new(args.seed ^ 0xBA7C);
    let (mut f32_bytes, mut body_bytes) = (0u64, 0u64);
    let mut idx = vec![0usize; args.batch];
    for step in 0..args.steps {
        for slot in &mut idx {
            *slot = data.train[rng.below(data.train.len() as u64) as usize];
        }
        let (x, y) = batch_tensors(data, &idx, &dev)?;
        let loss = mlp.loss(&x, &y)?;
        let update = mlp.step_update(&loss, args.lr as f32)?;
        let applied = match &mut mode {
            Mode::Dense => update,
            Mode::Distilled(d) => {
                let out = d.distill(&update)?;
                f32_bytes += out.report.f32_bytes;
                body_bytes += out.report.body_bytes as u64;
                decode(&out.body, spec)?
            }
        };
        mlp.apply(&applied)?;
        if (step + 1) % 500 == 0 || step + 1 == args.steps {
            eprintln!(
                "# {name}: step {:>5}/{} loss {:.4} eval acc {:.4}",
                step + 1,
                args.steps,
                loss.to_scalar::<f32>()?,
                mlp.accuracy(data, &dev)?
            );
        }
    }
    Ok(Run {
        accuracy: mlp.accuracy(data, &dev)?,
        f32_bytes,
        body_bytes,
    })
}

fn main() -> Result<()> {
    let args = Args::parse();
    println!("seed {}", args.seed);
    let dir = args
        .data
        .clone()
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/mnist"));
    let (x, y) = load_mnist(&dir)?;
    ensure!(x.len() / PIXELS > TRAIN, "need more than {TRAIN} images");
    let mut order: Vec<usize> = (0..y.len()).collect();
    let mut rng = SplitMix64::new(args.seed);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let data = Data {
        x,
        y,
        train: order[..TRAIN].to_vec(),
        eval: order[TRAIN..].to_vec(),
    };
    eprintln!(
        "# MNIST from {}: {} train, {} eval",
        dir.display(),
        data.train.len(),
        data.eval.len()
    );

    let h = u32::try_from(args.hidden)?;
    let spec = ModelSpec::new(vec![
        LayerSpec::new("fc1.weight", [h, PIXELS as u32], DType::F32),
        LayerSpec::new("fc1.bias", [h], DType::F32),
        LayerSpec::new("fc2.weight", [10, h], DType::F32),
        LayerSpec::new("fc2.bias", [10], DType::F32),
    ])?;
    // He initialisation, seeded; biases zero.
    let mut init_rng = SplitMix64::new(args.seed ^ 0x1417);
    let init: Vec<Vec<f32>> = spec
        .layers()
        .iter()
        .map(|l| {
            let n = l.numel() as usize;
            if l.shape().len() == 1 {
                return vec![0.0; n];
            }
            let std = (2.0 / f64::from(l.shape()[1])).sqrt();
            (0..n)
                .map(|_| (init_rng.next_gaussian() * std) as f32)
                .collect()
        })
        .collect();

    let dense = train(&args, &data, &spec, &init, Mode::Dense, "dense")?;
    let distiller = |error_feedback| -> Result<Mode> {
        let policy = Policy {
            error_feedback,
            seed: args.seed,
            ..Policy::default()
        };
        Ok(Mode::Distilled(Box::new(Distiller::new(
            spec.clone(),
            policy,
            EmbeddingConfig::default(),
        )?)))
    };
    let ef = train(&args, &data, &spec, &init, distiller(true)?, "topk+ef")?;
    let no_ef = train(&args, &data, &spec, &init, distiller(false)?, "topk, no ef")?;
    let ratio = ef.f32_bytes as f64 / ef.body_bytes.max(1) as f64;
    eprintln!(
        "# accuracy: dense {:.4}, top-k with EF {:.4} ({:+.2} points), top-k without EF {:.4} ({:+.2} points); compression {ratio:.1}x",
        dense.accuracy,
        ef.accuracy,
        (ef.accuracy - dense.accuracy) * 100.0,
        no_ef.accuracy,
        (no_ef.accuracy - dense.accuracy) * 100.0,
    );
    println!(
        "{}",
        json!({
            "acc_dense": dense.accuracy,
            "acc_topk_ef": ef.accuracy,
            "acc_topk_no_ef": no_ef.accuracy,
            "compression_ratio": (ratio * 100.0).round() / 100.0,
            "seed": args.seed,
            "steps": args.steps,
            "body_bytes_per_round": ef.body_bytes / args.steps.max(1) as u64,
            "f32_bytes_per_round": spec.f32_bytes(),
        })
    );
    Ok(())
}
