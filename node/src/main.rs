//! `kindred`: the node a user runs, one per GPU host.
//!
//! ```text
//! kindred init       create the data directory: identity keypair and kindred.toml
//! kindred run        join a swarm and train, distill, announce, merge — round after round
//! kindred status     ask a running node (through its local API) how it is doing
//! kindred swarm-key  make a pre-shared key for a private swarm
//! kindred demo       a local swarm of 16 real node processes on loopback, with a results table
//! ```
//!
//! Every `run` option can be set in `kindred.toml`, overridden by a `KINDRED_*` environment
//! variable, overridden by the flag.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use kindred_node::bench_model::{self, BenchModelOptions};
use kindred_node::config::{ExchangeKind, LogFormat, ModelKind, NodeConfig, TrainerKind};
use kindred_node::demo::{self, DemoOptions};
use kindred_node::store::Store;
use tokio::sync::watch;

/// Kindred node: decentralised training that merges only with peers whose updates are similar.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create a data directory: identity keypair and a kindred.toml with the given settings.
    Init(InitArgs),
    /// Run the node until interrupted (or for --rounds rounds).
    Run(RunArgs),
    /// Print the status of a running node.
    Status(StatusArgs),
    /// Generate a pre-shared key file for a private swarm.
    SwarmKey(SwarmKeyArgs),
    /// Start a local swarm of real node processes on loopback and print a results table.
    Demo(DemoArgs),
    /// Time and memory of one round at a real model size, between node processes on loopback.
    BenchModel(BenchModelArgs),
}

#[derive(Debug, Args)]
struct DirArgs {
    /// Data directory (identity, store, config).
    #[arg(long, env = "KINDRED_DIR", default_value = "kindred-data")]
    data_dir: PathBuf,
}

/// Settings that override kindred.toml.
#[derive(Debug, Args)]
struct Overrides {
    /// Network name (nodes of different networks never meet).
    #[arg(long, env = "KINDRED_NETWORK")]
    network: Option<String>,
    /// Listen multiaddr (repeatable), e.g. /ip4/0.0.0.0/tcp/4001.
    #[arg(long, env = "KINDRED_LISTEN", value_delimiter = ',')]
    listen: Vec<String>,
    /// Bootstrap peer multiaddr with /p2p/PEER_ID (repeatable).
    #[arg(long, env = "KINDRED_BOOTSTRAP", value_delimiter = ',')]
    bootstrap: Vec<String>,
    /// Pre-shared key file: join a private swarm.
    #[arg(long, env = "KINDRED_SWARM_KEY")]
    swarm_key: Option<PathBuf>,
    /// Ask the router (UPnP) to forward the listen ports to this host (`--upnp` or
    /// `--upnp=false`).
    #[arg(long, env = "KINDRED_UPNP", num_args = 0..=1, default_missing_value = "true")]
    upnp: Option<bool>,
    /// Serve relay v2 reservations to peers behind NAT (a public node; `--relay-server` or
    /// `--relay-server=false`). Circuits carry hole punching only, never exchange data.
    #[arg(long, env = "KINDRED_RELAY_SERVER", num_args = 0..=1, default_missing_value = "true")]
    relay_server: Option<bool>,
    /// Local API address (status, metrics, external trainer).
    #[arg(long, env = "KINDRED_API")]
    api: Option<SocketAddr>,
    /// Round length in seconds (default 10). A push or a model fetch waits a sixth of it:
    /// across the internet (100-200 ms round trips, hole punches) keep it at 6 or more.
    #[arg(long, env = "KINDRED_ROUND_SECS")]
    round_secs: Option<f64>,
    /// Stop after this many rounds.
    #[arg(long, env = "KINDRED_ROUNDS")]
    rounds: Option<u64>,
    /// Peers merged per round (default 16).
    #[arg(long, env = "KINDRED_PARTNERS")]
    partners: Option<usize>,
    /// Search the DHT every this many rounds (after the first 3), following the partners found
    /// in between; 1 searches every round.
    #[arg(long, env = "KINDRED_DISCOVERY_EVERY")]
    discovery_every: Option<u64>,
    /// Pull toward one merged partner's model snapshot every this many rounds (0: never).
    #[arg(long, env = "KINDRED_SNAPSHOT_EVERY")]
    snapshot_every: Option<u64>,
    /// The exchange: `hub` (default: members push to their cohort's hub, which merges) or
    /// `pairwise` (every node fetches its partners' bodies and merges them itself).
    #[arg(long, env = "KINDRED_EXCHANGE")]
    exchange: Option<ExchangeKind>,
    /// Top-k density of the hub exchange's packets and merges (default 0.067; 0.01 or less for
    /// models of 10^8 parameters and more).
    #[arg(long, env = "KINDRED_DENSITY")]
    density: Option<f32>,
    /// Where updates come from.
    #[arg(long, env = "KINDRED_TRAINER")]
    trainer: Option<TrainerKind>,
    /// Model: a built-in one, or `synthetic` (external trainer, `--params` parameters).
    #[arg(long, env = "KINDRED_MODEL")]
    model: Option<ModelKind>,
    /// Parameters of a synthetic model.
    #[arg(long, env = "KINDRED_PARAMS")]
    params: Option<u64>,
    /// Label shift of this node's task (concept-shift cluster).
    #[arg(long, env = "KINDRED_LABEL_SHIFT")]
    label_shift: Option<u8>,
    /// Rotation of this node's digits in quarter turns (feature-shift cluster).
    #[arg(long, env = "KINDRED_ROTATION")]
    rotation: Option<u8>,
    /// This node's shard of the training split.
    #[arg(long, env = "KINDRED_SHARD")]
    shard: Option<usize>,
    /// Number of shards.
    #[arg(long, env = "KINDRED_SHARDS")]
    shards: Option<usize>,
    /// Log format.
    #[arg(long, env = "KINDRED_LOG_FORMAT")]
    log_format: Option<LogFormat>,
}

impl Overrides {
    fn apply(self, c: &mut NodeConfig) {
        fn set<T>(dst: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *dst = v;
            }
        }
        set(&mut c.network, self.network);
        if !self.listen.is_empty() {
            c.listen = self.listen;
        }
        if !self.bootstrap.is_empty() {
            c.bootstrap = self.bootstrap;
        }
        if self.swarm_key.is_some() {
            c.swarm_key = self.swarm_key;
        }
        set(&mut c.upnp, self.upnp);
        set(&mut c.relay_server, self.relay_server);
        if self.api.is_some() {
            c.api = self.api;
        }
        set(&mut c.round_secs, self.round_secs);
        if self.rounds.is_some() {
            c.rounds = self.rounds;
        }
        set(&mut c.partners, self.partners);
        set(&mut c.discovery_every, self.discovery_every);
        set(&mut c.snapshot_every, self.snapshot_every);
        set(&mut c.exchange, self.exchange);
        set(&mut c.density, self.density);
        set(&mut c.log_format, self.log_format);
        let t = &mut c.trainer;
        set(&mut t.kind, self.trainer);
        set(&mut t.model, self.model);
        set(&mut t.params, self.params);
        set(&mut t.label_shift, self.label_shift);
        set(&mut t.rotation, self.rotation);
        set(&mut t.shard, self.shard);
        set(&mut t.shards, self.shards);
    }
}

#[derive(Debug, Args)]
struct InitArgs {
    #[command(flatten)]
    dir: DirArgs,
    #[command(flatten)]
    settings: Overrides,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    dir: DirArgs,
    #[command(flatten)]
    settings: Overrides,
}

#[derive(Debug, Args)]
struct StatusArgs {
    #[command(flatten)]
    dir: DirArgs,
    /// The node's API address (default: from the data directory's kindred.toml).
    #[arg(long)]
    api: Option<SocketAddr>,
    /// Print the raw JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct SwarmKeyArgs {
    /// Where to write the key (refuses to overwrite).
    #[arg(long, default_value = "swarm.key")]
    out: PathBuf,
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// Node processes.
    #[arg(long, default_value_t = 16)]
    nodes: usize,
    /// Label-permutation clusters.
    #[arg(long, default_value_t = 4)]
    clusters: usize,
    /// Rounds each node runs.
    #[arg(long, default_value_t = 20)]
    rounds: u64,
    /// Round length in seconds.
    #[arg(long, default_value_t = 3.0)]
    round_secs: f64,
    /// Seed (data split, model initialisation).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Local SGD steps per round (batch 32). Each node holds only 1/N of the training digits, so
    /// long local training overfits: the regime where learning with similar peers pays.
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Nodes search the DHT every this many rounds after their first 3 (1: every round).
    #[arg(long, default_value_t = 10)]
    discovery_every: u64,
    /// Nodes pull toward a merged partner's model snapshot every this many rounds (0: never).
    #[arg(long, default_value_t = 2)]
    snapshot_every: u64,
    /// The exchange every node runs: `hub` or `pairwise`.
    #[arg(long, default_value = "hub")]
    exchange: ExchangeKind,
    /// Keep the nodes' data directories here (default: a fresh temporary directory, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// End with one JSON line of the results.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Args)]
struct BenchModelArgs {
    /// Parameters of the synthetic (transformer-shaped) model.
    #[arg(long)]
    params: u64,
    /// Node processes (default 4, or 2 from 5 × 10^8 parameters).
    #[arg(long)]
    nodes: Option<usize>,
    /// Rounds measured.
    #[arg(long, default_value_t = 3)]
    rounds: u64,
    /// Rounds before measuring, while the nodes form their cohort.
    #[arg(long, default_value_t = 3)]
    warmup: u64,
    /// Round length in seconds (default: 5 plus 2.5 per 10^7 parameters).
    #[arg(long)]
    round_secs: Option<f64>,
    /// Top-k density of the nodes' packets and merges (the node's `--density`).
    #[arg(long, default_value_t = kindred_distill::Policy::HUB_DENSITY)]
    density: f32,
    /// Seed of the synthetic updates.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Keep the nodes' data directories here (default: a fresh temporary directory, removed).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// End with one JSON line of the results.
    #[arg(long)]
    json: bool,
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(kindred_node::DEFAULT_LOG_FILTER));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        // Colours only on a terminal: logs written to a file or a journal stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Init(args) => init(args),
        Command::Run(args) => run(args),
        Command::Status(args) => status(args),
        Command::SwarmKey(args) => swarm_key(args),
        Command::Demo(args) => {
            init_logging(LogFormat::Text);
            let report = demo::run(DemoOptions {
                nodes: args.nodes,
                clusters: args.clusters,
                rounds: args.rounds,
                round_secs: args.round_secs,
                seed: args.seed,
                steps: args.steps,
                discovery_every: args.discovery_every,
                snapshot_every: args.snapshot_every,
                exchange: args.exchange,
                dir: args.dir,
                binary: std::env::current_exe()?,
            })?;
            demo::print(&report, args.json);
            Ok(())
        }
        Command::BenchModel(args) => {
            init_logging(LogFormat::Text);
            let report = bench_model::run(&BenchModelOptions {
                params: args.params,
                nodes: args
                    .nodes
                    .unwrap_or_else(|| BenchModelOptions::default_nodes(args.params)),
                rounds: args.rounds,
                warmup: args.warmup,
                round_secs: args
                    .round_secs
                    .unwrap_or_else(|| BenchModelOptions::default_round_secs(args.params)),
                density: args.density,
                seed: args.seed,
                dir: args.dir,
                binary: std::env::current_exe()?,
            })?;
            bench_model::print(&report, args.json);
            Ok(())
        }
    }
}

fn init(args: InitArgs) -> anyhow::Result<()> {
    init_logging(LogFormat::Text);
    let dir = args.dir.data_dir;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut config = NodeConfig::load(&dir)?;
    args.settings.apply(&mut config);
    config.validate()?;
    config.save(&dir)?;
    let store = Store::open(&dir.join("store"))?;
    let key = store.identity_or_create()?;
    let peer = libp2p_identity::PublicKey::from(key.public()).to_peer_id();
    tracing::info!(dir = %dir.display(), %peer, "initialised");
    write_stdout(&format!("{peer}\n"))
}

fn run(args: RunArgs) -> anyhow::Result<()> {
    let dir = args.dir.data_dir;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut config = NodeConfig::load(&dir)?;
    args.settings.apply(&mut config);
    init_logging(config.log_format);
    map_large_allocations();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let (tx, rx) = watch::channel(false);
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("signal received: finishing");
            let _ = tx.send(true);
        });
        kindred_node::run::run(config, dir, rx).await.map(|_| ())
    })
}

/// Blocks of 1 MiB and more are mapped on their own and unmapped when freed (glibc's
/// `M_MMAP_THRESHOLD`), unless `MALLOC_MMAP_THRESHOLD_` says otherwise.
///
/// glibc raises that threshold to the largest block freed so far (up to 32 MiB), and serves
/// everything under it from heaps it seldom gives back. A node frees vectors of every size each
/// round (sparse updates, packets, a large model's layer buffers); left to that rule, the
/// holes they leave kept about one model more resident at 3 × 10^7 parameters
/// (`kindred bench-model`, peak 765 vs 620 MB a node; BENCHMARKS.md).
fn map_large_allocations() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
        // SAFETY: `mallopt` only sets a parameter of the allocator, and is called before the
        // runtime starts its threads.
        #[allow(unsafe_code)]
        let set = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20) };
        if set != 1 {
            tracing::warn!("could not set the allocator's mapping threshold");
        }
        // Setting the threshold also fixes the trim threshold at 128 KiB: a heap's free top
        // went back to the kernel after each layer of a large model's distill step, and its
        // pages were faulted in and zeroed again for the next (6% of a profile of the step at
        // 10^9 parameters). Blocks under 1 MiB are all a heap holds, so 16 MiB bounds the cost.
        // SAFETY: as above.
        #[allow(unsafe_code)]
        let set = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, 16 << 20) };
        if set != 1 {
            tracing::warn!("could not set the allocator's trim threshold");
        }
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

fn status(args: StatusArgs) -> anyhow::Result<()> {
    let api = match args.api {
        Some(a) => a,
        None => NodeConfig::load(&args.dir.data_dir)?
            .api
            .context("the node's config has no API address; pass --api")?,
    };
    let body = kindred_node::demo::http_get(api, "/v1/status")
        .with_context(|| format!("is a node running with its API on {api}?"))?;
    if args.json {
        return write_stdout(&format!("{body}\n"));
    }
    let s: kindred_node::api::Status = serde_json::from_str(&body)?;
    let last = s.history.last();
    let snapshot = s
        .history
        .iter()
        .rev()
        .find_map(|r| Some((r.round, r.snapshot.as_ref()?)))
        .map_or("-".into(), |(round, p)| {
            format!("{} (round {round}, from {})", p.outcome, p.from)
        });
    // The hub exchange: role, hub and cohort in the last round, and totals over the history.
    let exchange = last.and_then(|r| r.exchange.as_ref()).map_or("-".into(), |x| {
        let missed = s
            .history
            .iter()
            .filter(|r| r.exchange.as_ref().is_some_and(|x| x.missed))
            .count();
        let served: usize = s
            .history
            .iter()
            .filter_map(|r| r.exchange.as_ref())
            .map(|x| x.served)
            .sum();
        format!(
            "{} (hub {}, cohort {}, applied {}; over {} rounds: {missed} missed merges, {served} merges served)",
            x.role,
            x.hub,
            x.cohort,
            x.applied,
            s.history.len()
        )
    });
    let text = format!(
        "peer      {}\nround     {}\nconnected {}\nreachable {}\nbanned    {}\naccuracy  {}\nexchange  {}\npartners  {}\nsnapshot  {}\nrejects   {:?}\n",
        s.peer_id,
        s.round.map_or("-".into(), |r| r.to_string()),
        s.connected,
        s.reachability,
        s.banned,
        last.and_then(|r| r.accuracy)
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
        exchange,
        last.map_or(0, |r| r.partners.len()),
        snapshot,
        s.rejects,
    );
    write_stdout(&text)
}

fn swarm_key(args: SwarmKeyArgs) -> anyhow::Result<()> {
    use rand::RngCore;
    let mut key = [0u8; 32];
    rand::rng().fill_bytes(&mut key);
    let text = format!("/key/swarm/psk/1.0.0/\n/base16/\n{}\n", hex::encode(key));
    let mut options = std::fs::OpenOptions::new();
    // Never overwrite an existing key; create the new one readable by its owner only (the key is
    // a secret: whoever reads it can join the private swarm).
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(&args.out)
        .with_context(|| format!("creating {} (it must not exist yet)", args.out.display()))?;
    std::io::Write::write_all(&mut file, text.as_bytes())?;
    write_stdout(&format!(
        "wrote {}: pass it to every node with --swarm-key\n",
        args.out.display()
    ))
}

#[allow(clippy::print_stdout)]
fn write_stdout(s: &str) -> anyhow::Result<()> {
    print!("{s}");
    Ok(())
}
