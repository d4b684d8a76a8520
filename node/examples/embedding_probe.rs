//! Diagnostic: how similar are the embeddings of nodes with the same task, and of nodes with
//! different tasks, round by round? Trains `--nodes` MLPs in `--clusters` label-permutation
//! clusters with oracle merging, and prints mean intra- and inter-cluster sketch cosines and
//! the share of pairs that meet under at least one LSH band, for several embedding inputs.
#![allow(clippy::unwrap_used, clippy::print_stdout, missing_docs)]

use kindred_distill::{Embedder, EmbeddingConfig, Layout};
use kindred_node::trainer::{Arch, Examples, Mnist, Model, Split, Task, TrainConfig};
use kindred_proto::Embedding;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn bands_meet(a: &Embedding, b: &Embedding, bands: usize, bits: usize) -> bool {
    (0..bands).any(|i| a.simhash.bits(i * bits, bits) == b.simhash.bits(i * bits, bits))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |k: &str, d: usize| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (nodes, clusters, rounds, seed) = (
        get("--nodes", 8),
        get("--clusters", 2),
        get("--rounds", 8),
        get("--seed", 1) as u64,
    );
    let mnist = Mnist::load().unwrap();
    let split = Split::new(mnist.len(), 0.2, seed);
    let arch = Arch::MLP;
    let layout = Layout::new(&arch.spec().unwrap());
    let emb = Embedder::new(EmbeddingConfig {
        center: false,
        ..EmbeddingConfig::default()
    })
    .unwrap();
    let data: Vec<Examples> = (0..nodes)
        .map(|i| {
            Examples::new(
                &mnist,
                &split.shard(i, nodes),
                Task::label_cluster(i % clusters),
            )
        })
        .collect();
    let mut models: Vec<Model> = (0..nodes)
        .map(|_| Model::new(arch, seed).unwrap())
        .collect();
    let init = models[0].params().unwrap();
    let mut ema: Vec<Vec<f32>> = vec![vec![0.0; init.len()]; nodes];
    let mut rngs: Vec<StdRng> = (0..nodes)
        .map(|i| StdRng::seed_from_u64(i as u64))
        .collect();
    let cfg = TrainConfig::default();
    for r in 0..rounds {
        let mut updates = Vec::new();
        for i in 0..nodes {
            let before = models[i].params().unwrap();
            models[i].train(&data[i], &cfg, &mut rngs[i]).unwrap();
            let after = models[i].params().unwrap();
            models[i].set_params(&before).unwrap();
            updates.push(
                after
                    .iter()
                    .zip(&before)
                    .map(|(a, b)| a - b)
                    .collect::<Vec<f32>>(),
            );
        }
        for i in 0..nodes {
            for (e, u) in ema[i].iter_mut().zip(&updates[i]) {
                *e = 0.9 * *e + u;
            }
        }
        let variants: [(&str, Vec<Vec<f32>>); 3] = [
            ("update", updates.clone()),
            ("ema", ema.clone()),
            (
                "displacement",
                models
                    .iter()
                    .map(|m| {
                        m.params()
                            .unwrap()
                            .iter()
                            .zip(&init)
                            .map(|(a, b)| a - b)
                            .collect()
                    })
                    .collect(),
            ),
        ];
        for (name, vs) in &variants {
            let e: Vec<Embedding> = vs
                .iter()
                .map(|v| emb.embed(&layout, v, None).unwrap().embedding)
                .collect();
            let (mut intra, mut inter, mut ni, mut nx, mut mi16, mut mx16, mut mi8, mut mx8) =
                (0.0, 0.0, 0, 0, 0, 0, 0, 0);
            for a in 0..nodes {
                for b in a + 1..nodes {
                    let c = e[a].cosine(&e[b]) as f64;
                    let m16 = bands_meet(&e[a], &e[b], 16, 16) as usize;
                    let m8 = bands_meet(&e[a], &e[b], 32, 8) as usize;
                    if a % clusters == b % clusters {
                        intra += c;
                        ni += 1;
                        mi16 += m16;
                        mi8 += m8
                    } else {
                        inter += c;
                        nx += 1;
                        mx16 += m16;
                        mx8 += m8
                    }
                }
            }
            println!(
                "round {r} {name:>12}: cos intra {:.3} inter {:.3} | meet16x16 intra {:.2} inter {:.2} | meet32x8 intra {:.2} inter {:.2}",
                intra / ni as f64,
                inter / nx.max(1) as f64,
                mi16 as f64 / ni as f64,
                mx16 as f64 / nx.max(1) as f64,
                mi8 as f64 / ni as f64,
                mx8 as f64 / nx.max(1) as f64
            );
        }
        // Oracle merge: average updates within each cluster.
        for c in 0..clusters {
            let members: Vec<usize> = (0..nodes).filter(|i| i % clusters == c).collect();
            let mut avg = vec![0f32; init.len()];
            for &i in &members {
                for (a, u) in avg.iter_mut().zip(&updates[i]) {
                    *a += u / members.len() as f32;
                }
            }
            for &i in &members {
                models[i].apply_update(&avg).unwrap();
            }
        }
    }
}
