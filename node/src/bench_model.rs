//! `kindred bench-model`: one node's pipeline at a real model size, between real node processes.
//!
//! Everything else measured in this repository uses the 50,890-parameter MNIST MLP; what a user
//! runs is 10^6 to 10^9 parameters, where time and memory, not accuracy, decide whether Kindred
//! is usable. The benchmark starts `nodes` copies of this binary (`kindred run`) on loopback with
//! an external trainer and a transformer-shaped synthetic model of `params` parameters
//! ([`crate::trainer::synthetic_spec`]), and plays their trainers itself: every round it uploads
//! each node an update (`POST /v1/update`, streamed as it is generated, never held whole here)
//! and fetches the node's merge (`GET /v1/merged`). The nodes run the hub exchange as in
//! production: distill, seal, push to the cohort's hub, merge, apply, checkpoint.
//!
//! The updates share a direction (so the nodes form one cohort) with round and node-specific
//! noise, each layer at its own scale. Rounds are measured once the cohort is formed: after at least
//! `warmup` rounds, from the first round after which every node merged.
//!
//! Reported, from the nodes' own round records (`/v1/status`) and `/proc`:
//! - each stage's wall time (the distiller; the whole packet: distill, embed, seal, store; the
//!   exchange; snapshot, publish and checkpoint)
//!   and the round's, medians over the measured rounds (a round's time is its slowest node's);
//! - the distiller's rate per core: elements ÷ the CPU seconds the node process spent on it,
//!   all threads;
//! - peak resident memory of each node process (`VmHWM`), the largest and the sum (the sum of
//!   the peaks bounds the processes' peak together from above);
//! - bytes each node sent per round over all its connections (every protocol), against a
//!   full-precision ring all-reduce of the same model (`2 (N−1)/N × 4 × params` per node).

use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::api::{RoundRecord, Status};
use crate::config::{ExchangeKind, ModelKind, NodeConfig, TrainerConfig, TrainerKind};
use crate::demo::{NodeProcess, free_ports, init_node, spawn_node, work_dir};
use crate::trainer::synthetic_spec;
use kindred_proto::ModelSpec;

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchModelOptions {
    /// Model parameters.
    pub params: u64,
    /// Node processes.
    pub nodes: usize,
    /// Rounds measured (after the warm-up).
    pub rounds: u64,
    /// Rounds run before measuring, at least, while the nodes find each other and form their
    /// cohort: warm-up goes on (at most [`MAX_EXTRA_WARMUP`] more rounds) until every node
    /// merged in its last round.
    pub warmup: u64,
    /// Round length, seconds.
    pub round_secs: f64,
    /// Top-k density of the nodes' packets and merges ([`NodeConfig::density`]).
    pub density: f32,
    /// Seed of the synthetic updates.
    pub seed: u64,
    /// Where to keep node directories (a temporary directory when `None`).
    pub dir: Option<PathBuf>,
    /// The `kindred` binary to start the nodes with.
    pub binary: PathBuf,
}

impl BenchModelOptions {
    /// Node processes by default: 4, or 2 (a member and its hub) from 5 × 10^8 parameters,
    /// where four would not fit a 24 GiB host.
    pub fn default_nodes(params: u64) -> usize {
        if params >= 500_000_000 { 2 } else { 4 }
    }

    /// A round length that fits one round's work at `params` on a 2-core host: 5 s plus 2.5 s
    /// per 10^7 parameters.
    pub fn default_round_secs(params: u64) -> f64 {
        (5.0 + params as f64 * 2.5e-7).ceil()
    }
}

/// What one run measured (`--json` prints it as the last line).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BenchModelReport {
    /// Model parameters.
    pub params: u64,
    /// Layers of the synthetic model.
    pub layers: usize,
    /// Node processes.
    pub nodes: usize,
    /// Rounds measured.
    pub rounds: u64,
    /// Top-k density of the nodes' packets and merges.
    pub density: f32,
    /// Rounds run before measuring: at least the warm-up asked for, and until every node
    /// merged in its last round.
    pub warmup_rounds: u64,
    /// The model in f32, bytes.
    pub model_f32_bytes: u64,
    /// Largest peak resident memory of one node process, bytes.
    pub peak_rss_bytes: u64,
    /// Sum of the node processes' peaks, bytes (bounds their peak together from above).
    pub peak_rss_total_bytes: u64,
    /// Distillation rate per core: elements ÷ CPU seconds of the distill step, 10^9/s (median).
    pub distill_gelem_s: f64,
    /// The distiller's step (compression with error feedback), wall seconds (median over nodes
    /// and rounds).
    pub distill_seconds: f64,
    /// The whole packet: distill, embed, seal and store, wall seconds (median).
    pub packet_seconds: f64,
    /// The exchange (push, merge, apply), wall seconds (median).
    pub exchange_seconds: f64,
    /// Snapshot, publishing the merge and the checkpoint, wall seconds (median).
    pub checkpoint_seconds: f64,
    /// A round, update in hand to checkpoint, of the slowest node, seconds (median over rounds).
    pub round_seconds: f64,
    /// Uploading one update to a node (generated as it is sent), seconds (median).
    pub upload_seconds: f64,
    /// Fetching one merge from a node, seconds (median).
    pub fetch_seconds: f64,
    /// One node's packet (header and body), bytes (median).
    pub packet_bytes: u64,
    /// Bytes each node sent per round over all its connections (mean).
    pub wire_bytes_per_node_round: u64,
    /// A full-precision ring all-reduce of the same model, bytes sent per node.
    pub bytes_allreduce: u64,
    /// `bytes_allreduce ÷ wire_bytes_per_node_round`.
    pub allreduce_ratio: f64,
    /// What the measured rounds applied, node-rounds by outcome (`merge`, `own`, ...).
    pub applied: BTreeMap<String, u64>,
    /// Wall time of the whole run, seconds.
    pub seconds: f64,
}

/// Run the benchmark.
///
/// # Errors
/// When the model size is invalid, a node fails to start or misses its deadline (its log is in
/// the node's directory, kept with `dir`), or the node API answers with an error.
pub fn run(opts: &BenchModelOptions) -> anyhow::Result<BenchModelReport> {
    if opts.nodes < 2 || opts.rounds == 0 || opts.warmup == 0 {
        bail!("bench-model needs at least 2 nodes, 1 measured round and 1 warm-up round");
    }
    // The nodes' own check of the settings passed on to them, before any node starts.
    NodeConfig {
        round_secs: opts.round_secs,
        exchange: ExchangeKind::Hub,
        density: opts.density,
        ..NodeConfig::default()
    }
    .validate()?;
    let started = Instant::now();
    let spec = synthetic_spec(opts.params)?;
    let update_bytes = SyntheticUpdate::new(&spec, opts.seed, 0, 0).len();
    let cap = crate::api::update_body_cap(&spec) as u64;
    if update_bytes > cap {
        bail!(
            "an update of {} parameters is {update_bytes} bytes of safetensors, over the node API's \
             limit of {cap} bytes (`kindred_node::api::MAX_UPDATE_BYTES`): this size cannot be \
             uploaded to a node yet",
            opts.params
        );
    }
    let (base, _cleanup) = work_dir(opts.dir.as_deref(), "bench")?;
    let need = disk_needed(opts.nodes, spec.f32_bytes());
    if let Ok(free) = fs2::available_space(&base)
        && free < need
    {
        bail!(
            "{} nodes of {} parameters need about {:.1} GB free in {}, and {:.1} GB are: \
             free some, or pass --dir on a larger disk",
            opts.nodes,
            opts.params,
            need as f64 / 1e9,
            base.display(),
            free as f64 / 1e9
        );
    }

    let ports = free_ports(opts.nodes * 2)?;
    let mut nodes = Vec::with_capacity(opts.nodes);
    let mut bootstrap: Option<String> = None;
    for i in 0..opts.nodes {
        let dir = base.join(format!("node{i:02}"));
        std::fs::create_dir_all(&dir)?;
        let api = SocketAddr::from(([127, 0, 0, 1], ports[2 * i + 1]));
        let c = NodeConfig {
            network: format!("kindred-bench-{}", opts.seed),
            listen: vec![format!("/ip4/127.0.0.1/tcp/{}", ports[2 * i])],
            bootstrap: bootstrap.iter().cloned().collect(),
            api: Some(api),
            round_secs: opts.round_secs,
            rounds: None,
            discovery_every: 1,
            exchange: ExchangeKind::Hub,
            density: opts.density,
            trainer: TrainerConfig {
                kind: TrainerKind::External,
                model: ModelKind::Synthetic,
                params: opts.params,
                seed: opts.seed,
                ..TrainerConfig::default()
            },
            ..NodeConfig::default()
        };
        c.save(&dir)?;
        let peer = init_node(&opts.binary, &dir)?;
        if bootstrap.is_none() {
            bootstrap = Some(format!("/ip4/127.0.0.1/tcp/{}/p2p/{peer}", ports[0]));
        }
        nodes.push((dir, api));
    }
    tracing::info!(
        params = opts.params,
        layers = spec.layers().len(),
        nodes = opts.nodes,
        round_secs = opts.round_secs,
        dir = %base.display(),
        "starting nodes"
    );
    let mut children = Vec::with_capacity(opts.nodes);
    for (dir, _) in &nodes {
        children.push(spawn_node(&opts.binary, dir)?);
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs_f64(opts.round_secs * 4.0 + 60.0)))
        .build()
        .into();
    for (i, (_, api)) in nodes.iter().enumerate() {
        wait_ready(&agent, *api, &mut children[i], Duration::from_secs(120))
            .with_context(|| format!("node {i} did not start; see {}", base.display()))?;
    }

    let mut last_merged: Vec<Option<u64>> = vec![None; opts.nodes];
    let (mut uploads, mut fetches) = (Vec::new(), Vec::new());
    // Warm-up lasts at least `warmup` rounds and until every node merged in its last round
    // (its cohort formed and joined: a join's model fetch is not steady state).
    let mut warmup = None;
    let mut measured = 0;
    let mut r = 0u64;
    while measured < opts.rounds {
        let measuring = warmup.is_some();
        let round_started = Instant::now();
        let results = std::thread::scope(|s| {
            let handles: Vec<_> = nodes
                .iter()
                .enumerate()
                .map(|(i, (_, api))| {
                    let (agent, spec, after) = (&agent, &spec, last_merged[i]);
                    let deadline = Duration::from_secs_f64(opts.round_secs * 3.0 + 30.0);
                    s.spawn(move || {
                        let update = SyntheticUpdate::new(spec, opts.seed, r, i as u64);
                        let t0 = Instant::now();
                        upload(agent, *api, update)?;
                        let uploaded = t0.elapsed().as_secs_f64();
                        let (round, fetched) = fetch_merge(agent, *api, after, deadline)?;
                        Ok::<_, anyhow::Error>((uploaded, round, fetched))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a trainer thread panicked")))
                })
                .collect::<Vec<_>>()
        });
        for (i, res) in results.into_iter().enumerate() {
            let (uploaded, round, fetched) = res.with_context(|| {
                format!(
                    "node {i}, bench round {r}; node logs are in {}",
                    base.display()
                )
            })?;
            last_merged[i] = Some(round);
            if measuring {
                uploads.push(uploaded);
                fetches.push(fetched);
            }
        }
        tracing::info!(
            round = r,
            measured = measuring,
            seconds = format_args!("{:.1}", round_started.elapsed().as_secs_f64()),
            "bench round done"
        );
        r += 1;
        if measuring {
            measured += 1;
        } else if r >= opts.warmup {
            if all_merged(&agent, &nodes)? {
                warmup = Some(r);
            } else if r >= opts.warmup + MAX_EXTRA_WARMUP {
                // Measured anyway: `applied` in the report shows the rounds that did not merge.
                tracing::warn!(
                    rounds = r,
                    dir = %base.display(),
                    "not every node merged in the warm-up; measuring as it is"
                );
                warmup = Some(r);
            }
        }
    }

    // The nodes' own records of the rounds, and their memory peaks, before they are stopped.
    let mut histories = Vec::with_capacity(opts.nodes);
    let mut peaks = Vec::with_capacity(opts.nodes);
    for (i, (_, api)) in nodes.iter().enumerate() {
        let status: Status = serde_json::from_str(&get(&agent, *api, "/v1/status")?)?;
        histories.push(status.history);
        peaks.push(
            peak_rss_bytes(children[i].0.id())
                .context("reading a node's peak memory from /proc")?,
        );
    }
    drop(children);
    Ok(report(
        opts,
        warmup.unwrap_or(r),
        &spec,
        &histories,
        &peaks,
        &uploads,
        &fetches,
        started.elapsed().as_secs_f64(),
    ))
}

/// The figures from each node's round records (oldest first) and peak memory.
#[allow(clippy::too_many_arguments)]
fn report(
    opts: &BenchModelOptions,
    warmup: u64,
    spec: &ModelSpec,
    histories: &[Vec<RoundRecord>],
    peaks: &[u64],
    uploads: &[f64],
    fetches: &[f64],
    seconds: f64,
) -> BenchModelReport {
    let measured = opts.rounds as usize;
    let (mut distill, mut rate, mut exchange, mut checkpoint) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut packet_time = Vec::new();
    let mut packets = Vec::new();
    let mut applied = BTreeMap::new();
    let mut slowest: BTreeMap<u64, f64> = BTreeMap::new();
    let mut wire = Vec::new();
    for history in histories {
        // The measured rounds are each node's last ones; the record before them marks where
        // their bytes start.
        let from = history.len().saturating_sub(measured);
        for rec in history.get(from..).unwrap_or_default() {
            let t = &rec.timings;
            distill.push(t.distill_seconds);
            packet_time.push(t.packet_seconds);
            if let Some(cpu) = t.distill_cpu_seconds.filter(|&c| c > 0.0) {
                rate.push(opts.params as f64 / cpu / 1e9);
            }
            exchange.push(t.exchange_seconds);
            checkpoint.push(t.checkpoint_seconds);
            packets.push(rec.packet_bytes as f64);
            let slot = slowest.entry(rec.round).or_insert(0.0);
            *slot = slot.max(t.round_seconds);
            let outcome = rec
                .exchange
                .as_ref()
                .map_or_else(|| "none".to_string(), |e| e.applied.clone());
            *applied.entry(outcome).or_insert(0) += 1;
        }
        if let (Some(first), Some(last)) = (
            from.checked_sub(1).and_then(|i| history.get(i)),
            history.last(),
        ) {
            let rounds = history.len() - from;
            wire.push(
                last.wire_bytes_sent.saturating_sub(first.wire_bytes_sent) as f64 / rounds as f64,
            );
        }
    }
    let rounds: Vec<f64> = slowest.into_values().collect();
    let wire_per_round = mean(&wire).round() as u64;
    let n = opts.nodes as f64;
    let allreduce = (2.0 * (n - 1.0) / n * 4.0 * opts.params as f64).round() as u64;
    BenchModelReport {
        params: opts.params,
        layers: spec.layers().len(),
        nodes: opts.nodes,
        rounds: opts.rounds,
        density: opts.density,
        warmup_rounds: warmup,
        model_f32_bytes: spec.f32_bytes(),
        peak_rss_bytes: peaks.iter().copied().max().unwrap_or(0),
        peak_rss_total_bytes: peaks.iter().sum(),
        distill_gelem_s: round3(median(&rate)),
        distill_seconds: round3(median(&distill)),
        packet_seconds: round3(median(&packet_time)),
        exchange_seconds: round3(median(&exchange)),
        checkpoint_seconds: round3(median(&checkpoint)),
        round_seconds: round3(median(&rounds)),
        upload_seconds: round3(median(uploads)),
        fetch_seconds: round3(median(fetches)),
        packet_bytes: median(&packets).round() as u64,
        wire_bytes_per_node_round: wire_per_round,
        bytes_allreduce: allreduce,
        allreduce_ratio: if wire_per_round > 0 {
            round3(allreduce as f64 / wire_per_round as f64)
        } else {
            0.0
        },
        applied,
        seconds: round3(seconds),
    }
}

/// Print the report: a table, then (with `json`) one JSON line.
pub fn print(r: &BenchModelReport, json: bool) {
    let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
    let lines = [
        format!(
            "model: {} parameters in {} layers ({:.2} GiB in f32), {} node processes, {} rounds measured, density {}",
            r.params,
            r.layers,
            gib(r.model_f32_bytes),
            r.nodes,
            r.rounds,
            r.density
        ),
        format!(
            "peak RSS: {:.2} GiB per node at most ({:.2}x the f32 model), {:.2} GiB all nodes",
            gib(r.peak_rss_bytes),
            r.peak_rss_bytes as f64 / r.model_f32_bytes.max(1) as f64,
            gib(r.peak_rss_total_bytes)
        ),
        format!(
            "distill {:.3} s ({:.3} G elements/s per core), whole packet {:.3} s; exchange {:.3} s; checkpoint {:.3} s; round {:.3} s",
            r.distill_seconds,
            r.distill_gelem_s,
            r.packet_seconds,
            r.exchange_seconds,
            r.checkpoint_seconds,
            r.round_seconds
        ),
        format!(
            "trainer side: upload {:.3} s, merge fetch {:.3} s",
            r.upload_seconds, r.fetch_seconds
        ),
        format!(
            "wire: {} bytes per node per round (packet {} bytes) vs {} for a full-precision all-reduce: {:.1}x fewer",
            r.wire_bytes_per_node_round, r.packet_bytes, r.bytes_allreduce, r.allreduce_ratio
        ),
        format!(
            "applied: {:?}; after {} warm-up rounds; {:.1} s in all",
            r.applied, r.warmup_rounds, r.seconds
        ),
    ];
    let mut out = lines.join("\n");
    if json {
        out.push('\n');
        out.push_str(&serde_json::to_string(r).unwrap_or_default());
    }
    out.push('\n');
    if let Err(e) = std::io::Write::write_all(&mut std::io::stdout().lock(), out.as_bytes()) {
        tracing::warn!(error = %e, "writing the report failed");
    }
}

/// Most rounds warm-up goes on past [`BenchModelOptions::warmup`] waiting for every node to
/// merge.
pub const MAX_EXTRA_WARMUP: u64 = 10;

/// Whether every node's last round applied a merge (not its own update, not a join's adoption).
fn all_merged(agent: &ureq::Agent, nodes: &[(PathBuf, SocketAddr)]) -> anyhow::Result<bool> {
    for (_, api) in nodes {
        let status: Status = serde_json::from_str(&get(agent, *api, "/v1/status")?)?;
        let merged = status
            .history
            .last()
            .and_then(|r| r.exchange.as_ref())
            .is_some_and(|e| e.applied == "merge");
        if !merged {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Poll a node's status until it answers (or its process exits, or `limit` passes).
fn wait_ready(
    agent: &ureq::Agent,
    api: SocketAddr,
    child: &mut NodeProcess,
    limit: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if get(agent, api, "/v1/status").is_ok() {
            return Ok(());
        }
        if let Some(status) = child.0.try_wait()? {
            bail!("the node exited: {status}");
        }
        if Instant::now() > deadline {
            bail!("its API did not answer within {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn get(agent: &ureq::Agent, api: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut resp = agent.get(&format!("http://{api}{path}")).call()?;
    let status = resp.status();
    let body = resp
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_string()?;
    if !status.is_success() {
        bail!("GET {path}: {status}: {body}");
    }
    Ok(body)
}

/// Upload one update, streamed as it is generated.
fn upload(agent: &ureq::Agent, api: SocketAddr, mut update: SyntheticUpdate) -> anyhow::Result<()> {
    let len = update.len();
    let mut resp = agent
        .post(&format!("http://{api}/v1/update?samples=1000&loss=1.0"))
        .header("content-type", "application/octet-stream")
        .header("content-length", &len.to_string())
        .send(ureq::SendBody::from_reader(&mut update))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        bail!("POST /v1/update: {status}: {body}");
    }
    Ok(())
}

/// Wait for a merge newer than `after`, fetch it (counting its bytes) and return its round and
/// the seconds the fetch took.
fn fetch_merge(
    agent: &ureq::Agent,
    api: SocketAddr,
    after: Option<u64>,
    limit: Duration,
) -> anyhow::Result<(u64, f64)> {
    let path = match after {
        Some(a) => format!("/v1/merged?after={a}"),
        None => "/v1/merged".to_string(),
    };
    let deadline = Instant::now() + limit;
    loop {
        let t0 = Instant::now();
        let mut resp = agent.get(&format!("http://{api}{path}")).call()?;
        let status = resp.status().as_u16();
        if status == 200 {
            let round = resp
                .headers()
                .get("x-kindred-round")
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .context("a merge without its round")?;
            let bytes = std::io::copy(&mut resp.body_mut().as_reader(), &mut std::io::sink())?;
            anyhow::ensure!(bytes > 0, "an empty merge");
            return Ok((round, t0.elapsed().as_secs_f64()));
        }
        if status != 204 {
            bail!("GET {path}: {status}");
        }
        if Instant::now() > deadline {
            bail!(
                "no merge after round {after:?} within {} s",
                limit.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Disk a run's nodes need: each stages its update (the f32 model's size) and checkpoints its
/// model and residuals, with the last checkpoint kept until the next is written. At 10^9 a
/// member and its hub held 14 GB (1.75x the f32 model a node) by the end of a run; 2.5x a node
/// leaves room for a checkpoint being replaced.
fn disk_needed(nodes: usize, f32_bytes: u64) -> u64 {
    (nodes as f64 * 2.5 * f32_bytes as f64) as u64
}

/// A node's synthetic update for one round as a safetensors file, produced as it is read: the
/// task's direction, shared by every node in every round, plus half as much of a direction
/// shared by every node that round and half as much node-specific noise (cosine about 0.83
/// between two nodes' updates of a round, 0.67 a round apart), each layer at its own scale.
/// The task's part is what makes a real task's updates alike from one step to the next: with
/// directions drawn afresh each round, a node whose uploads landed a round off the others'
/// shared nothing with them, and stayed alone (3 of 7 runs of `--seed 3` at 10^6).
struct SyntheticUpdate {
    header: Vec<u8>,
    /// `(elements, scale)` per layer, in file order.
    layers: Vec<(u64, f32)>,
    task: u64,
    shared: u64,
    own: u64,
    pos: usize,
    layer: usize,
    elem: u64,
    buf: Vec<u8>,
    buf_pos: usize,
    total: u64,
}

impl SyntheticUpdate {
    fn new(spec: &ModelSpec, seed: u64, round: u64, node: u64) -> Self {
        let mut layers = Vec::with_capacity(spec.layers().len());
        for (i, l) in spec.layers().iter().enumerate() {
            // Per-layer scales between 0.5e-3 and 1.5e-3, as gradients differ by layer.
            let h = splitmix(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
            layers.push((
                l.numel(),
                1e-3 * (0.5 + (h >> 40) as f32 / (1u64 << 24) as f32),
            ));
        }
        let file = crate::merged::safetensors_f32_header(spec);
        Self {
            total: file.len() as u64 + spec.numel() * 4,
            header: file,
            layers,
            task: splitmix(seed ^ 0x7a5c_0d1e_55f0_2b4d),
            shared: splitmix(seed ^ (round + 1).wrapping_mul(0x5851_f42d_4c95_7f2d)),
            own: splitmix(
                seed ^ round.rotate_left(17) ^ (node + 1).wrapping_mul(0xd6e8_feb8_6659_fd93),
            ),
            pos: 0,
            layer: 0,
            elem: 0,
            buf: Vec::with_capacity(1 << 20),
            buf_pos: 0,
        }
    }

    fn len(&self) -> u64 {
        self.total
    }

    /// Generate the next stretch of tensor data into `buf` (empty at the end).
    fn refill(&mut self) {
        self.buf.clear();
        self.buf_pos = 0;
        while self.buf.len() < (1 << 20) {
            let Some(&(numel, scale)) = self.layers.get(self.layer) else {
                return;
            };
            let n = (numel - self.elem).min(((1 << 20) - self.buf.len()) as u64 / 4);
            for _ in 0..n {
                self.task = splitmix(self.task);
                self.shared = splitmix(self.shared);
                self.own = splitmix(self.own);
                let v = scale * (unit(self.task) + 0.5 * (unit(self.shared) + unit(self.own)));
                self.buf.extend_from_slice(&v.to_le_bytes());
            }
            self.elem += n;
            if self.elem == numel {
                self.layer += 1;
                self.elem = 0;
            }
        }
    }
}

impl Read for SyntheticUpdate {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.pos < self.header.len() {
            let n = out.len().min(self.header.len() - self.pos);
            out[..n].copy_from_slice(&self.header[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        if self.buf_pos == self.buf.len() {
            self.refill();
        }
        let n = out.len().min(self.buf.len() - self.buf_pos);
        out[..n].copy_from_slice(&self.buf[self.buf_pos..self.buf_pos + n]);
        self.buf_pos += n;
        Ok(n)
    }
}

/// The splitmix64 step: a fast generator, plenty for benchmark data.
fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform value in [-1, 1) from a generator state.
fn unit(x: u64) -> f32 {
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Peak resident memory of a process (`VmHWM` in `/proc/PID/status`), bytes.
fn peak_rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = text
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .context("no VmHWM line")?;
    Ok(kb * 1024)
}

fn median(xs: &[f64]) -> f64 {
    let mut v: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::update_from_safetensors;

    #[test]
    fn a_synthetic_update_is_a_valid_safetensors_file_of_the_model() {
        let spec = synthetic_spec(1 << 16).unwrap();
        let mut bytes = Vec::new();
        let mut update = SyntheticUpdate::new(&spec, 7, 0, 0);
        let len = update.len();
        update.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes.len() as u64, len);
        let a = update_from_safetensors(&bytes, &spec).unwrap();
        assert_eq!(a.len() as u64, spec.numel());
        assert!(a.iter().all(|v| v.is_finite() && v.abs() < 3e-3));

        // Another node's update shares the task's direction and the round's, not its noise;
        // one of the next round the task's only.
        let update_of = |round, node| {
            let mut bytes = Vec::new();
            SyntheticUpdate::new(&spec, 7, round, node)
                .read_to_end(&mut bytes)
                .unwrap();
            update_from_safetensors(&bytes, &spec).unwrap()
        };
        let cosine = |b: &[f32]| {
            let dot: f64 = a
                .iter()
                .zip(b)
                .map(|(x, y)| f64::from(*x) * f64::from(*y))
                .sum();
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            dot / (norm(&a) * norm(b))
        };
        let same_round = cosine(&update_of(0, 1));
        assert!((0.78..0.88).contains(&same_round), "cosine {same_round}");
        let next_round = cosine(&update_of(1, 1));
        assert!((0.6..0.74).contains(&next_round), "cosine {next_round}");
    }

    #[test]
    fn medians_skip_what_is_not_a_number() {
        assert_eq!(median(&[3.0, f64::NAN, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[1.0, 2.0]), 1.5);
    }
}
