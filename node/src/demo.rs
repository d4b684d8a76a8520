//! `kindred demo`: a local swarm of real node processes on loopback, and what it achieved.
//!
//! The demo starts `nodes` copies of this very binary (`kindred run`), each with its own data
//! directory, identity, shard of the MNIST training split and one of `clusters` label-permutation
//! tasks (cluster `c` learns `y → (y + c) mod 10`). Node 0 is everyone's bootstrap peer. After the
//! rounds, it reads every node's `summary.json` and compares with **local-only training** — the
//! same model, seed, shard, task and number of SGD steps, never merging — computed in-process.
//!
//! Reported: held-out accuracy per cluster for both; bytes each node sent per round over all its
//! connections (Kademlia, identify, ping and the packet RPCs), and the packet RPCs' share of them
//! (headers and bodies served, requests made), against a full-precision ring all-reduce of the
//! same model (`2 (N−1)/N × 4 × params` bytes sent per node per round); and partner purity (the
//! share of merge partners from the node's own cluster).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::api::Status;
use crate::config::{ExchangeKind, NodeConfig, TrainerConfig};
use crate::run::SUMMARY_FILE;
use crate::trainer::{Examples, Mnist, Model, Split};

/// What to run.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Node processes.
    pub nodes: usize,
    /// Label-permutation clusters.
    pub clusters: usize,
    /// Rounds per node.
    pub rounds: u64,
    /// Round length, seconds.
    pub round_secs: f64,
    /// Seed of the data split and initial weights.
    pub seed: u64,
    /// Local SGD steps per round.
    pub steps: usize,
    /// DHT search period of every node ([`NodeConfig::discovery_every`]).
    pub discovery_every: u64,
    /// Snapshot pull period of every node ([`NodeConfig::snapshot_every`]).
    pub snapshot_every: u64,
    /// The exchange every node runs.
    pub exchange: ExchangeKind,
    /// Where to keep node directories (a temporary directory when `None`).
    pub dir: Option<PathBuf>,
    /// The `kindred` binary to start the nodes with.
    pub binary: PathBuf,
}

/// Results of one cluster.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ClusterResult {
    /// Cluster index (its label shift).
    pub cluster: usize,
    /// Nodes in it.
    pub nodes: usize,
    /// Mean final accuracy with Kindred.
    pub acc_kindred: f64,
    /// Mean final accuracy of local-only training.
    pub acc_local: f64,
}

/// Results of one node.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NodeResult {
    /// The node's peer id.
    pub peer: String,
    /// Its cluster.
    pub cluster: usize,
    /// Final accuracy with Kindred.
    pub acc_kindred: f64,
    /// Final accuracy of local-only training.
    pub acc_local: f64,
    /// Merge partners over all rounds.
    pub partners: usize,
    /// Share of them from its own cluster (1 when it had none).
    pub purity: f64,
    /// Rounds in which it pulled toward a partner's model snapshot.
    pub pulls: usize,
}

/// The demo's results.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct DemoReport {
    /// Node processes.
    pub nodes: usize,
    /// Rounds each node completed (minimum over nodes).
    pub rounds: u64,
    /// Mean final accuracy with Kindred.
    pub acc_kindred: f64,
    /// Mean final accuracy of local-only training.
    pub acc_local: f64,
    /// Mean RPC bytes a node sent per round.
    pub bytes_per_node_round: f64,
    /// Mean bytes a node sent per round over all its connections, every protocol (Kademlia,
    /// identify, ping and the RPCs; joining the swarm included).
    pub wire_bytes_per_node_round: f64,
    /// Mean bytes a node sent over all its connections in its warm-up, its first
    /// [`WARMUP_ROUNDS`] rounds: joining the swarm (connections, identify, the Kademlia
    /// bootstrap), its local rounds and first searches, and joining a cohort. Once per node.
    pub wire_bytes_warmup_per_node: f64,
    /// Mean bytes a node sent per round over all its connections after its warm-up (its local
    /// rounds and first searches, [`WARMUP_ROUNDS`]): what a long run costs per round.
    pub wire_bytes_per_node_round_steady: f64,
    /// [`DemoReport::wire_bytes_per_node_round`] by protocol (`kademlia`, `rpc`, `identify`,
    /// `ping`, `autonat`, `other`).
    pub wire_bytes_per_node_round_by_protocol: BTreeMap<String, f64>,
    /// [`DemoReport::wire_bytes_warmup_per_node`] by protocol.
    pub wire_bytes_warmup_by_protocol: BTreeMap<String, f64>,
    /// Bytes a node sends per round in a full-precision ring all-reduce.
    pub bytes_allreduce: f64,
    /// Share of merge partners from the node's own cluster.
    pub partner_purity: f64,
    /// Snapshot rounds in which a node had a partner to fetch a snapshot from, over all nodes.
    pub snapshot_rounds: usize,
    /// Of those, the rounds in which it pulled toward the partner's model.
    pub snapshot_pulls: usize,
    /// The exchange the nodes ran (`hub` or `pairwise`).
    pub exchange: String,
    /// Hub changes over all nodes (rounds whose hub differs from the node's previous exchange
    /// round's; hub exchange only).
    pub hub_changes: usize,
    /// Rounds in which a member expected a merge and applied its own update, over all nodes
    /// (hub exchange only).
    pub missed_merges: usize,
    /// Wall time of the whole demo.
    pub seconds: f64,
    /// Per-cluster accuracy.
    pub clusters: Vec<ClusterResult>,
    /// Per-node results.
    pub per_node: Vec<NodeResult>,
}

/// Rounds of a node's warm-up ([`DemoReport::wire_bytes_warmup_per_node`]), left out of
/// [`DemoReport::wire_bytes_per_node_round_steady`]:
/// the exchange's local rounds and warm-up searches (`ExchangeConfig::local_rounds` and
/// `warmup_searches`, 2 + 3), or the pairwise exchange's warm-up discovery rounds.
pub const WARMUP_ROUNDS: usize = 5;

/// Run the demo.
///
/// # Errors
/// When the MNIST files are missing, a node cannot be started, or nodes do not finish in time.
pub fn run(opts: DemoOptions) -> anyhow::Result<DemoReport> {
    if opts.nodes < 2 || opts.clusters == 0 || opts.clusters > opts.nodes || opts.rounds == 0 {
        bail!("the demo needs at least 2 nodes, 1..=nodes clusters and at least 1 round");
    }
    let started = Instant::now();
    let (base, _cleanup) = work_dir(opts.dir.as_deref(), "demo")?;
    // Fail early, in this process, with the clear error if the data is missing.
    let mnist = Mnist::load()?;

    let exe = &opts.binary;
    let ports = free_ports(opts.nodes * 2)?;
    let mut children = Vec::with_capacity(opts.nodes);
    let mut bootstrap: Option<String> = None;
    let mut cluster_of = HashMap::new();
    let mut configs = Vec::with_capacity(opts.nodes);
    for i in 0..opts.nodes {
        let dir = base.join(format!("node{i:02}"));
        std::fs::create_dir_all(&dir)?;
        let cluster = i % opts.clusters;
        let c = NodeConfig {
            network: format!("kindred-demo-{}", opts.seed),
            listen: vec![format!("/ip4/127.0.0.1/tcp/{}", ports[2 * i])],
            bootstrap: bootstrap.iter().cloned().collect(),
            api: Some(SocketAddr::from(([127, 0, 0, 1], ports[2 * i + 1]))),
            round_secs: opts.round_secs,
            rounds: Some(opts.rounds),
            discovery_every: opts.discovery_every,
            snapshot_every: opts.snapshot_every,
            exchange: opts.exchange,
            trainer: TrainerConfig {
                label_shift: cluster as u8,
                shard: i,
                shards: opts.nodes,
                seed: opts.seed,
                steps: opts.steps,
                ..TrainerConfig::default()
            },
            ..NodeConfig::default()
        };
        c.save(&dir)?;
        let peer = init_node(exe, &dir)?;
        if bootstrap.is_none() {
            bootstrap = Some(format!("/ip4/127.0.0.1/tcp/{}/p2p/{peer}", ports[0]));
        }
        cluster_of.insert(peer, cluster);
        configs.push((dir, c));
    }
    tracing::info!(nodes = opts.nodes, clusters = opts.clusters, dir = %base.display(), "starting nodes");
    for (dir, _) in &configs {
        children.push(spawn_node(exe, dir)?);
    }

    // Local-only baseline, computed while the swarm runs.
    let mut local = vec![0f64; opts.nodes];
    for (i, (_, c)) in configs.iter().enumerate() {
        local[i] = local_only_accuracy(&mnist, &c.trainer, opts.rounds)?;
    }

    // Nodes stop by themselves after their rounds; allow generous slack for start-up.
    let deadline = Instant::now()
        + Duration::from_secs_f64(opts.round_secs * (opts.rounds as f64 + 4.0) + 60.0);
    for child in &mut children {
        loop {
            if child.0.try_wait()?.is_some() {
                break;
            }
            if Instant::now() > deadline {
                bail!(
                    "a node did not finish in time; logs are in {}",
                    base.display()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    let mut summaries = Vec::with_capacity(opts.nodes);
    for (dir, _) in &configs {
        let text = std::fs::read_to_string(dir.join(SUMMARY_FILE)).with_context(|| {
            format!(
                "reading {}/{SUMMARY_FILE} (see node.log there)",
                dir.display()
            )
        })?;
        summaries.push(serde_json::from_str::<Status>(&text)?);
    }
    let params = configs[0].1.trainer.spec()?.numel() as f64;
    Ok(report(
        &opts,
        &summaries,
        &local,
        &cluster_of,
        params,
        started.elapsed().as_secs_f64(),
    ))
}

fn report(
    opts: &DemoOptions,
    summaries: &[Status],
    local: &[f64],
    cluster_of: &HashMap<String, usize>,
    params: f64,
    seconds: f64,
) -> DemoReport {
    let n = summaries.len();
    let final_acc = |s: &Status| {
        s.history
            .last()
            .and_then(|r| r.accuracy)
            .map_or(0.0, f64::from)
    };
    let (mut same, mut partners) = (0usize, 0usize);
    let (mut snapshot_rounds, mut snapshot_pulls) = (0usize, 0usize);
    let mut bytes = 0f64;
    let mut wire = 0f64;
    let (mut warmup, mut steady, mut steady_nodes) = (0f64, 0f64, 0usize);
    let mut by_protocol: BTreeMap<String, f64> = BTreeMap::new();
    let mut warmup_by_protocol: BTreeMap<String, f64> = BTreeMap::new();
    let mut per_node = Vec::with_capacity(n);
    let (mut hub_changes, mut missed_merges) = (0usize, 0usize);
    for (i, s) in summaries.iter().enumerate() {
        let mine = cluster_of.get(&s.peer_id);
        let (mut node_same, mut node_partners, mut pulls) = (0, 0, 0);
        let mut last_hub: Option<&str> = None;
        for r in &s.history {
            if let Some(x) = r.exchange.as_ref().filter(|x| x.role != "local") {
                if last_hub.is_some_and(|h| h != x.hub) {
                    hub_changes += 1;
                }
                last_hub = Some(&x.hub);
                missed_merges += usize::from(x.missed);
            }
            if let Some(p) = &r.snapshot {
                snapshot_rounds += 1;
                if matches!(p.outcome.as_str(), "pulled" | "clipped") {
                    pulls += 1;
                }
            }
            node_partners += r.partners.len();
            node_same += r
                .partners
                .iter()
                .filter(|p| cluster_of.get(*p) == mine)
                .count();
        }
        same += node_same;
        partners += node_partners;
        snapshot_pulls += pulls;
        let rounds = s.history.len().max(1) as f64;
        bytes += s.bytes_sent as f64 / rounds;
        wire += s.wire_bytes_sent as f64 / rounds;
        for (p, b) in &s.wire_sent_by_protocol {
            *by_protocol.entry(p.clone()).or_default() += *b as f64 / rounds;
        }
        if let (Some(warm), Some(last)) = (s.history.get(WARMUP_ROUNDS - 1), s.history.last())
            && s.history.len() > WARMUP_ROUNDS
        {
            warmup += warm.wire_bytes_sent as f64;
            for (p, b) in &warm.wire_sent_by_protocol {
                *warmup_by_protocol.entry(p.clone()).or_default() += *b as f64;
            }
            let after = (s.history.len() - WARMUP_ROUNDS) as f64;
            steady += last.wire_bytes_sent.saturating_sub(warm.wire_bytes_sent) as f64 / after;
            steady_nodes += 1;
        }
        per_node.push(NodeResult {
            peer: s.peer_id.clone(),
            cluster: mine.copied().unwrap_or(usize::MAX),
            acc_kindred: final_acc(s),
            acc_local: local.get(i).copied().unwrap_or(0.0),
            partners: node_partners,
            purity: if node_partners == 0 {
                1.0
            } else {
                node_same as f64 / node_partners as f64
            },
            pulls,
        });
    }
    let clusters = (0..opts.clusters)
        .map(|c| {
            let members: Vec<usize> = (0..n).filter(|i| i % opts.clusters == c).collect();
            let mean = |f: &dyn Fn(usize) -> f64| {
                members.iter().map(|&i| f(i)).sum::<f64>() / members.len().max(1) as f64
            };
            ClusterResult {
                cluster: c,
                nodes: members.len(),
                acc_kindred: mean(&|i| final_acc(&summaries[i])),
                acc_local: mean(&|i| local[i]),
            }
        })
        .collect();
    DemoReport {
        nodes: n,
        rounds: summaries
            .iter()
            .map(|s| s.history.len() as u64)
            .min()
            .unwrap_or(0),
        acc_kindred: summaries.iter().map(final_acc).sum::<f64>() / n.max(1) as f64,
        acc_local: local.iter().sum::<f64>() / n.max(1) as f64,
        bytes_per_node_round: bytes / n.max(1) as f64,
        wire_bytes_per_node_round: wire / n.max(1) as f64,
        wire_bytes_warmup_per_node: warmup / steady_nodes.max(1) as f64,
        wire_bytes_per_node_round_steady: steady / steady_nodes.max(1) as f64,
        wire_bytes_per_node_round_by_protocol: by_protocol
            .into_iter()
            .map(|(p, b)| (p, b / n.max(1) as f64))
            .collect(),
        wire_bytes_warmup_by_protocol: warmup_by_protocol
            .into_iter()
            .map(|(p, b)| (p, b / steady_nodes.max(1) as f64))
            .collect(),
        bytes_allreduce: 2.0 * (n as f64 - 1.0) / n as f64 * 4.0 * params,
        partner_purity: if partners == 0 {
            0.0
        } else {
            same as f64 / partners as f64
        },
        snapshot_rounds,
        snapshot_pulls,
        exchange: opts.exchange.label().to_string(),
        hub_changes,
        missed_merges,
        seconds,
        clusters,
        per_node,
    }
}

/// "4.2x fewer" or "1.4x more": `ours` against `baseline`.
fn versus(baseline: f64, ours: f64) -> String {
    if ours <= baseline {
        format!("{:.1}x fewer", baseline / ours.max(1.0))
    } else {
        format!("{:.1}x more", ours / baseline.max(1.0))
    }
}

/// Print the results table (and the JSON line).
#[allow(clippy::print_stdout)]
pub fn print(r: &DemoReport, json: bool) {
    println!(
        "\nKindred demo: {} nodes, {} rounds, {:.0} s, {} exchange",
        r.nodes, r.rounds, r.seconds, r.exchange
    );
    println!(
        "{:>8} {:>6} {:>16} {:>16}",
        "cluster", "nodes", "Kindred acc %", "local-only acc %"
    );
    for c in &r.clusters {
        println!(
            "{:>8} {:>6} {:>16.2} {:>16.2}",
            c.cluster,
            c.nodes,
            c.acc_kindred * 100.0,
            c.acc_local * 100.0
        );
    }
    println!(
        "{:>8} {:>6} {:>16.2} {:>16.2}",
        "all",
        r.nodes,
        r.acc_kindred * 100.0,
        r.acc_local * 100.0
    );
    println!(
        "bytes sent per node per round (Kademlia, identify, ping and packet RPCs): Kindred {:.0}, full-precision all-reduce {:.0} ({})",
        r.wire_bytes_per_node_round,
        r.bytes_allreduce,
        versus(r.bytes_allreduce, r.wire_bytes_per_node_round)
    );
    println!(
        "  of which exchange RPCs: {:.0}; the warm-up (rounds 1-{}: joining, local rounds, first searches): {:.0} once per node; after it: {:.0} per round ({})",
        r.bytes_per_node_round,
        WARMUP_ROUNDS,
        r.wire_bytes_warmup_per_node,
        r.wire_bytes_per_node_round_steady,
        versus(r.bytes_allreduce, r.wire_bytes_per_node_round_steady)
    );
    let breakdown = |m: &BTreeMap<String, f64>| {
        m.iter()
            .map(|(p, b)| format!("{p} {b:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  by protocol, per round: {}; of the warm-up: {}",
        breakdown(&r.wire_bytes_per_node_round_by_protocol),
        breakdown(&r.wire_bytes_warmup_by_protocol)
    );
    println!(
        "partner purity: {:.1}% of merge partners from the node's own cluster",
        r.partner_purity * 100.0
    );
    if r.exchange == "hub" {
        println!(
            "hub exchange: {} hub changes and {} missed merges over all nodes and rounds",
            r.hub_changes, r.missed_merges
        );
    } else {
        println!(
            "model snapshots: pulled toward a partner's model in {} of {} snapshot rounds",
            r.snapshot_pulls, r.snapshot_rounds
        );
    }
    if json {
        println!(
            "{}",
            serde_json::json!({
                "nodes": r.nodes,
                "rounds": r.rounds,
                "acc_kindred": r.acc_kindred,
                "acc_local": r.acc_local,
                "bytes_per_node_round": r.bytes_per_node_round,
                "wire_bytes_per_node_round": r.wire_bytes_per_node_round,
                "wire_bytes_warmup_per_node": r.wire_bytes_warmup_per_node,
                "wire_bytes_per_node_round_steady": r.wire_bytes_per_node_round_steady,
                "wire_bytes_per_node_round_by_protocol": r.wire_bytes_per_node_round_by_protocol,
                "wire_bytes_warmup_by_protocol": r.wire_bytes_warmup_by_protocol,
                "bytes_allreduce": r.bytes_allreduce,
                "partner_purity": r.partner_purity,
                "snapshot_rounds": r.snapshot_rounds,
                "snapshot_pulls": r.snapshot_pulls,
                "exchange": r.exchange,
                "hub_changes": r.hub_changes,
                "missed_merges": r.missed_merges,
                "seconds": r.seconds,
            })
        );
    }
}

/// Held-out accuracy of **local-only training**: the model, seed, shard, task and steps per
/// round of `trainer`, trained alone for `rounds` rounds (minibatches drawn from the seed and
/// the shard), never merging. The baseline a node's accuracy is compared with.
///
/// # Errors
/// When the model cannot be built or trained.
pub fn local_only_accuracy(
    mnist: &Mnist,
    trainer: &TrainerConfig,
    rounds: u64,
) -> anyhow::Result<f64> {
    let split = Split::new(mnist.len(), crate::engine::EVAL_FRACTION, trainer.seed);
    let task = trainer.task();
    let train = Examples::new(mnist, &split.shard(trainer.shard, trainer.shards), task);
    let eval = Examples::new(mnist, &split.eval, task);
    let Some(arch) = trainer.model.arch() else {
        bail!("local-only training needs a built-in model, not a synthetic one");
    };
    let mut model = Model::new(arch, trainer.seed)?;
    let mut rng = StdRng::seed_from_u64(trainer.seed ^ (trainer.shard as u64) << 32);
    for _ in 0..rounds {
        model.train(&train, &trainer.train(), &mut rng)?;
    }
    Ok(f64::from(model.accuracy(&eval)?))
}

/// GET `path` from a node's local API.
///
/// # Errors
/// When the node cannot be reached or answers with an error.
pub fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut resp = ureq::get(&format!("http://{addr}{path}")).call()?;
    Ok(resp.body_mut().read_to_string()?)
}

/// `n` distinct loopback ports, free for TCP and UDP, for node processes to listen on (TCP, QUIC).
///
/// Each is bound once to check it is free, then released for a node to take a moment later.
/// They are drawn below the kernel's ephemeral range (where the OS picks ports for `bind(0)` and
/// for the local end of every outgoing connection): a port drawn there could be taken, between
/// the check and the node's bind, by one of the swarm's own outgoing connections. Ports handed out
/// once in this process are not handed out again.
///
/// # Example
/// ```
/// let ports = kindred_node::demo::free_ports(2).unwrap();
/// assert_ne!(ports[0], ports[1]);
/// ```
///
/// # Errors
/// When no free port is found in a bounded number of draws.
pub fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    static HANDED_OUT: std::sync::Mutex<BTreeSet<u16>> = std::sync::Mutex::new(BTreeSet::new());
    let (lo, hi) = non_ephemeral_ports();
    let mut handed = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let mut ports = Vec::with_capacity(n);
    let mut draws = 0u32;
    while ports.len() < n {
        draws += 1;
        anyhow::ensure!(
            draws <= 100_000,
            "no free loopback port in {lo}..={hi} after {} draws",
            draws - 1
        );
        let port = rand::random_range(lo..=hi);
        // Free for TCP and for UDP (QUIC listens on a UDP port).
        if handed.contains(&port)
            || TcpListener::bind(("127.0.0.1", port)).is_err()
            || UdpSocket::bind(("127.0.0.1", port)).is_err()
        {
            continue;
        }
        handed.insert(port);
        ports.push(port);
    }
    Ok(ports)
}

/// A range of ports outside the kernel's ephemeral range (Linux: `ip_local_port_range`, 32768 to
/// 60999 by default; elsewhere, the IANA dynamic range 49152 and above is assumed).
fn non_ephemeral_ports() -> (u16, u16) {
    let ephemeral = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(str::parse::<u16>);
            Some((it.next()?.ok()?, it.next()?.ok()?))
        })
        .unwrap_or((49_152, 65_535));
    if ephemeral.0 >= 12_000 {
        (10_000, ephemeral.0 - 1)
    } else if ephemeral.1 <= 63_000 {
        (ephemeral.1 + 1, 65_535)
    } else {
        // The whole range is ephemeral: nothing better than drawing from it.
        (1_024, 65_535)
    }
}

/// The directory node directories go in: `dir`, or a fresh temporary one (removed when the
/// guard drops) named after `tag`.
pub(crate) fn work_dir(
    dir: Option<&Path>,
    tag: &str,
) -> anyhow::Result<(PathBuf, Option<RemoveOnDrop>)> {
    let (base, cleanup) = match dir {
        Some(d) => (d.to_path_buf(), None),
        None => {
            let d = std::env::temp_dir().join(format!("kindred-{tag}-{}", std::process::id()));
            (d.clone(), Some(RemoveOnDrop(d)))
        }
    };
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok((base, cleanup))
}

/// `kindred init` a node directory (its config already saved there): creates the identity and
/// returns the node's peer id.
pub(crate) fn init_node(exe: &Path, dir: &Path) -> anyhow::Result<String> {
    let out = Command::new(exe)
        .args(["init", "--data-dir"])
        .arg(dir)
        .env("RUST_LOG", "warn")
        .output()
        .context("running kindred init")?;
    if !out.status.success() {
        bail!(
            "kindred init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Start `kindred run` on an initialised node directory, logging to `node.log` there.
pub(crate) fn spawn_node(exe: &Path, dir: &Path) -> anyhow::Result<NodeProcess> {
    let log = std::fs::File::create(dir.join("node.log"))?;
    let mut command = Command::new(exe);
    command
        .args(["run", "--data-dir"])
        .arg(dir)
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| crate::DEFAULT_LOG_FILTER.into()),
        )
        .stdout(Stdio::null())
        .stderr(log);
    stop_with_parent(&mut command);
    let child = command.spawn().context("starting a node")?;
    Ok(NodeProcess(child))
}

/// Have the kernel send a child `SIGTERM` when the thread that started it exits, so a harness
/// killed by a signal (which runs no `Drop`) leaves no node running (`timeout` on `kindred
/// bench-model` left one running; a node peaks at 8.8 GiB at 10^9 parameters). The
/// harness starts its nodes on the thread that runs it to the end. Linux only; elsewhere the
/// nodes outlive a killed harness.
fn stop_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: `getpid` before the fork; in the child, `prctl`, `getppid` and `_exit` only,
        // all async-signal-safe, and no allocation.
        #[allow(unsafe_code)]
        unsafe {
            let parent = libc::getpid();
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the call: nobody would send the signal.
                if libc::getppid() != parent {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// A node process, killed if the harness exits early.
pub(crate) struct NodeProcess(pub(crate) Child);

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A directory removed when dropped.
pub(crate) struct RemoveOnDrop(pub(crate) PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::versus;

    #[test]
    fn traffic_is_compared_as_fewer_or_more() {
        assert_eq!(versus(400.0, 100.0), "4.0x fewer");
        assert_eq!(versus(100.0, 140.0), "1.4x more");
        assert_eq!(versus(100.0, 0.0), "100.0x fewer");
    }
}
