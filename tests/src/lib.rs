//! Cross-crate and multi-process tests for Kindred.
//!
//! Tests that span crates live in `tests/tests/`; this library is their shared harness (the
//! rust-libp2p `swarm-test` pattern): it starts real `kindred` node processes on loopback, each
//! in its own data directory, talks to them through their local API, kills and restarts them.
//!
//! The `kindred` binary is the one `cargo test --workspace` builds next to the test binaries
//! (`target/<profile>/kindred`), or the one named by `KINDRED_BIN`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kindred_node::api::Status;
use kindred_node::config::{NodeConfig, TrainerConfig};

pub mod netns;

/// The `kindred` binary under test.
///
/// # Panics
/// When it cannot be found: build it with `cargo build -p kindred-node`.
pub fn kindred_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("KINDRED_BIN") {
        return PathBuf::from(p);
    }
    // target/<profile>/deps/<test binary> → target/<profile>/kindred
    let exe = std::env::current_exe().unwrap_or_default();
    let candidate = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join(format!("kindred{}", std::env::consts::EXE_SUFFIX)))
        .unwrap_or_default();
    assert!(
        candidate.is_file(),
        "kindred binary not found at {}: run `cargo build -p kindred-node` or set KINDRED_BIN",
        candidate.display()
    );
    candidate
}

/// `n` distinct loopback ports free for TCP and UDP, drawn outside the kernel's ephemeral range
/// ([`kindred_node::demo::free_ports`]).
///
/// # Panics
/// When no free port is found.
pub fn free_ports(n: usize) -> Vec<u16> {
    kindred_node::demo::free_ports(n).unwrap_or_else(|e| panic!("{e:#}"))
}

/// A fresh, unique temporary directory, removed when dropped.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// Create one named after `tag`.
    ///
    /// # Panics
    /// When it cannot be created.
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kindred-test-{tag}-{}-{:x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self(dir)
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::env::var_os("KINDRED_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// One `kindred run` process and its data directory.
#[derive(Debug)]
pub struct NodeProc {
    /// Data directory.
    pub dir: PathBuf,
    /// Its local API.
    pub api: SocketAddr,
    /// Its libp2p listen address (without `/p2p`).
    pub listen: String,
    /// Its peer id (from `kindred init`).
    pub peer: String,
    /// The network namespace it runs in ([`netns`]), if not the test's own.
    pub netns: Option<String>,
    child: Option<Child>,
}

impl NodeProc {
    /// Initialise a node in `dir` with `config` (its `listen` and `api` are set here), without
    /// starting it.
    ///
    /// # Panics
    /// When `kindred init` fails.
    pub fn init(dir: PathBuf, config: NodeConfig) -> Self {
        Self::init_listening(dir, config, false)
    }

    /// [`NodeProc::init`], listening on QUIC too (the same port number, over UDP) when `quic`.
    ///
    /// # Panics
    /// When `kindred init` fails.
    pub fn init_listening(dir: PathBuf, config: NodeConfig, quic: bool) -> Self {
        let ports = free_ports(2);
        let listen = format!("/ip4/127.0.0.1/tcp/{}", ports[0]);
        let mut addrs = vec![listen.clone()];
        if quic {
            addrs.push(format!("/ip4/127.0.0.1/udp/{}/quic-v1", ports[0]));
        }
        let api = SocketAddr::from(([127, 0, 0, 1], ports[1]));
        Self::init_with(dir, config, addrs, api)
    }

    /// [`NodeProc::init`] for a node in network namespace `ns` ([`netns`]) at address `ip`: it
    /// listens on TCP and QUIC port 4001 there and serves its API on that namespace's loopback.
    ///
    /// # Panics
    /// When `kindred init` fails.
    pub fn init_in_netns(dir: PathBuf, config: NodeConfig, ns: &str, ip: &str) -> Self {
        let addrs = vec![
            format!("/ip4/{ip}/tcp/4001"),
            format!("/ip4/{ip}/udp/4001/quic-v1"),
        ];
        let api = SocketAddr::from(([127, 0, 0, 1], 8700));
        let mut node = Self::init_with(dir, config, addrs, api);
        node.netns = Some(ns.to_string());
        node
    }

    /// `kindred init` in `dir` with `config` listening on `addrs` (the first is the one peers
    /// bootstrap through) and serving its API at `api`.
    fn init_with(
        dir: PathBuf,
        mut config: NodeConfig,
        addrs: Vec<String>,
        api: SocketAddr,
    ) -> Self {
        let listen = addrs.first().cloned().unwrap_or_default();
        config.listen = addrs;
        config.api = Some(api);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        config
            .save(&dir)
            .unwrap_or_else(|e| panic!("saving config: {e}"));
        let out = Command::new(kindred_bin())
            .args(["init", "--data-dir"])
            .arg(&dir)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap_or_else(|e| panic!("running kindred init: {e}"));
        assert!(
            out.status.success(),
            "kindred init: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let peer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        Self {
            dir,
            api,
            listen,
            peer,
            netns: None,
            child: None,
        }
    }

    /// The address other nodes bootstrap through.
    pub fn bootstrap_addr(&self) -> String {
        format!("{}/p2p/{}", self.listen, self.peer)
    }

    /// Start `kindred run` (logs appended to `node.log` in its directory).
    ///
    /// # Panics
    /// When the process cannot be started or is already running.
    pub fn start(&mut self) {
        self.start_with_env(&[]);
    }

    /// [`NodeProc::start`] with extra environment variables.
    ///
    /// # Panics
    /// When the process cannot be started or is already running.
    pub fn start_with_env(&mut self, env: &[(&str, &str)]) {
        assert!(self.child.is_none(), "node already running");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("node.log"))
            .unwrap_or_else(|e| panic!("{e}"));
        let mut command = match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(kindred_bin());
                c
            }
            None => Command::new(kindred_bin()),
        };
        let child = command
            .args(["run", "--data-dir"])
            .arg(&self.dir)
            .env("RUST_LOG", kindred_node::DEFAULT_LOG_FILTER)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting kindred run: {e}"));
        self.child = Some(child);
    }

    /// Its status, or `None` while the API is not up.
    pub fn status(&self) -> Option<Status> {
        let body = self.get("/v1/status")?;
        serde_json::from_str(&body).ok()
    }

    /// Its Prometheus metrics text, or `None` while the API is not up.
    pub fn metrics(&self) -> Option<String> {
        self.get("/metrics")
    }

    /// GET `path` from its API, from inside its namespace if it runs in one.
    fn get(&self, path: &str) -> Option<String> {
        let get = || kindred_node::demo::http_get(self.api, path).ok();
        match &self.netns {
            Some(ns) => netns::in_netns(ns, get),
            None => get(),
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// `kill -9`: no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, then wait up to `timeout` for a clean exit; returns the exit code.
    ///
    /// # Panics
    /// When the node does not exit in time (it is then killed).
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let pid = child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "node {} did not exit within {timeout:?} of SIGTERM",
                    self.peer
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGTERM, and a clean exit (code 0) within `within`.
    ///
    /// # Panics
    /// When the node exits otherwise, with its log.
    pub fn stop_cleanly(&mut self, within: Duration) {
        assert_eq!(
            self.terminate(within),
            Some(0),
            "clean exit:\n{}",
            self.log()
        );
    }

    /// The node's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Poll `f` every 200 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A config for a test node: label-permutation cluster `cluster`, shard `shard` of `shards`,
/// short rounds.
pub fn node_config(
    network: &str,
    cluster: u8,
    shard: usize,
    shards: usize,
    round_secs: f64,
) -> NodeConfig {
    NodeConfig {
        network: network.to_string(),
        round_secs,
        trainer: TrainerConfig {
            label_shift: cluster,
            shard,
            shards,
            ..TrainerConfig::default()
        },
        ..NodeConfig::default()
    }
}

/// Every node of `nodes` ends ahead of training alone: each node's last accuracy is compared
/// with local-only training on its own config (`kindred_node::demo::local_only_accuracy`) for as
/// many rounds as it trained, before a restart too. One node's accuracy on 2,000 held-out
/// digits carries about 0.7 point of sampling noise, so the nodes' mean margin must be positive
/// and no node may fall more than a point below its own baseline.
///
/// # Panics
/// When that does not hold, a node has no status or config, or MNIST cannot be read.
#[allow(clippy::print_stdout)] // the margins are the test's report
pub fn assert_beats_local_only<'a>(nodes: impl IntoIterator<Item = &'a NodeProc>) {
    let mnist = kindred_node::trainer::Mnist::load().unwrap_or_else(|e| panic!("MNIST: {e}"));
    let mut margins = Vec::new();
    for node in nodes {
        let s = node
            .status()
            .unwrap_or_else(|| panic!("no status:\n{}", node.log()));
        let acc = s
            .history
            .last()
            .and_then(|r| r.accuracy)
            .map_or(0.0, f64::from);
        // Rounds trained: this run's, and those before a restart (one update distilled each).
        let rounds = s.history.len() as u64 + s.restored.as_ref().map_or(0, |r| r.distiller_round);
        let config = NodeConfig::load(&node.dir).unwrap_or_else(|e| panic!("config: {e}"));
        let local = kindred_node::demo::local_only_accuracy(&mnist, &config.trainer, rounds)
            .unwrap_or_else(|e| panic!("local-only training: {e}"));
        println!(
            "node {}: {acc:.4} after {rounds} rounds, local-only {local:.4} ({:+.2} points)",
            node.peer,
            100.0 * (acc - local)
        );
        assert!(
            acc >= local - 0.01,
            "node {}: {acc:.4} is more than a point below local-only {local:.4}",
            node.peer
        );
        margins.push(acc - local);
    }
    let mean = margins.iter().sum::<f64>() / margins.len().max(1) as f64;
    assert!(
        mean > 0.0,
        "the nodes are {:+.2} points from local-only on average",
        100.0 * mean
    );
}

/// After a restart of `node`: its API comes up with identity `peer`, a checkpoint at or past
/// `round` with its distiller state, and its exchange state restored (logged when the exchange
/// driver starts, after the API), and nothing in its log says a record did not read back.
/// Returns the restored checkpoint and the exchange's restore log line.
///
/// # Panics
/// When any of that does not hold, with the node's log.
pub fn assert_restored(
    node: &NodeProc,
    peer: &str,
    round: u64,
) -> (kindred_node::engine::Restored, String) {
    let s = wait_for(Duration::from_secs(30), || node.status())
        .unwrap_or_else(|| panic!("the API never came up:\n{}", node.log()));
    assert_eq!(s.peer_id, peer, "same identity after restart");
    let restored = s
        .restored
        .unwrap_or_else(|| panic!("nothing restored:\n{}", node.log()));
    assert!(
        restored.round >= round,
        "restored round {} < last seen {round}",
        restored.round
    );
    assert!(restored.distiller_round > 0, "distiller state restored");
    let line = wait_for(Duration::from_secs(20), || {
        node.log()
            .lines()
            .find(|l| l.contains("exchange state restored"))
            .map(str::to_string)
    })
    .unwrap_or_else(|| panic!("exchange state not restored:\n{}", node.log()));
    let log = node.log();
    for bad in ["not restored", "does not read back", "corrupt"] {
        assert!(!log.contains(bad), "`{bad}` in the log:\n{log}");
    }
    (restored, line)
}

/// Start `n` node processes under `dir` (`node0`, `node1`, ...) on network `network`, node
/// `i` in label cluster `i % 2` with training shard `i` of `2n`, every node but the first
/// bootstrapping from the first. A node holds little data (a 2n-th of the digits), so merging
/// with its cluster pays and a test can ask every node to end ahead of training alone.
pub fn start_two_clusters(dir: &Path, network: &str, n: usize, round_secs: f64) -> Vec<NodeProc> {
    let mut nodes: Vec<NodeProc> = Vec::new();
    for i in 0..n {
        let mut c = node_config(network, (i % 2) as u8, i, 2 * n, round_secs);
        if let Some(first) = nodes.first() {
            c.bootstrap = vec![first.bootstrap_addr()];
        }
        nodes.push(NodeProc::init(dir.join(format!("node{i}")), c));
    }
    for node in &mut nodes {
        node.start();
    }
    nodes
}

/// A `python3` for the Python package's tests: `KINDRED_PYTHON` when set (CI sets it to a fresh
/// virtual environment where `pip install ./node/python` installed the package, and must), else
/// `python3` with `node/python` on `PYTHONPATH`. `None`, after one line saying why, when that
/// interpreter cannot import the package and its requirements (numpy, safetensors): the test
/// skips. On CI both are errors, never a skip.
#[allow(clippy::print_stderr)] // the skip line is the test's report
pub fn python_client() -> Option<Command> {
    let on_ci = std::env::var_os("CI").is_some();
    let venv = std::env::var_os("KINDRED_PYTHON");
    assert!(
        !on_ci || venv.is_some(),
        "on CI, KINDRED_PYTHON must name the python of a venv with `pip install ./node/python`"
    );
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("../node/python");
    let command = || match &venv {
        Some(python) => Command::new(python),
        None => {
            let mut c = Command::new("python3");
            c.env("PYTHONPATH", &package);
            c
        }
    };
    let ready = command()
        .args(["-c", "import numpy, safetensors, kindred"])
        .status()
        .is_ok_and(|s| s.success());
    if ready {
        return Some(command());
    }
    let why = "python3 cannot import numpy, safetensors or kindred (`pip install ./node/python`)";
    assert!(!on_ci, "on CI: {why}");
    eprintln!("skipping: {why}");
    None
}
