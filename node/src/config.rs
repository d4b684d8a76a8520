//! Node configuration: a TOML file written by `kindred init`, overridden by environment variables
//! and command-line flags (in that order of precedence, flags last).
//!
//! Every field has a default, so a config file only names what differs; unknown keys are errors,
//! so a typo never silently falls back to a default.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kindred_proto::ModelSpec;
use serde::{Deserialize, Serialize};

use crate::api::ApiLimits;
use crate::trainer::{Arch, Rotation, Task, TrainConfig};

/// The config file's name inside a data directory.
pub const CONFIG_FILE: &str = "kindred.toml";

/// Why a config could not be loaded or is invalid.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read or written.
    #[error("config file {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for a node config.
    #[error("config file {}: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's error, with line and column.
        source: toml::de::Error,
    },
    /// A value is out of range.
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A built-in architecture, as named in the config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// 784-64-10 MLP.
    #[default]
    Mlp,
    /// Small CNN.
    Cnn,
    /// A transformer-shaped spec of `trainer.params` parameters
    /// ([`crate::trainer::synthetic_spec`]), external trainer only: what `kindred bench-model`
    /// measures the pipeline with at real model sizes.
    Synthetic,
}

impl ModelKind {
    /// The built-in architecture the node can train (`None` for [`ModelKind::Synthetic`]).
    pub fn arch(self) -> Option<Arch> {
        match self {
            Self::Mlp => Some(Arch::MLP),
            Self::Cnn => Some(Arch::Cnn),
            Self::Synthetic => None,
        }
    }
}

/// Where updates come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TrainerKind {
    /// The built-in candle trainer on MNIST.
    #[default]
    Builtin,
    /// A local process pushes updates through the HTTP API (`POST /v1/update`).
    External,
}

/// How a node exchanges updates with its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ExchangeKind {
    /// The hub exchange (`kindred_routing::exchange`): members push their packet to their
    /// cohort's hub, which merges and serves one merge back.
    #[default]
    Hub,
    /// Every node fetches the bodies of its most similar peers and merges them itself (more
    /// bytes: one body per partner), with model snapshots every `snapshot_every` rounds.
    Pairwise,
}

impl ExchangeKind {
    /// `"hub"` or `"pairwise"`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Hub => "hub",
            Self::Pairwise => "pairwise",
        }
    }
}

/// What a node run with `relay_server` grants peers behind NAT (the `[relay_limits]` table of
/// `kindred.toml`). Circuits carry signalling and hole punching only, never exchange data, so
/// small limits fit; the defaults are libp2p's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayLimits {
    /// Reservations held at once. Default 128.
    pub max_reservations: usize,
    /// Circuits open at once. Default 16.
    pub max_circuits: usize,
    /// A circuit's longest life, seconds. Default 120.
    pub max_circuit_secs: u64,
    /// Bytes a circuit carries at most. Default 131,072.
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        let d = kindred_routing::RelayServerConfig::default();
        Self {
            max_reservations: d.max_reservations,
            max_circuits: d.max_circuits,
            max_circuit_secs: d.max_circuit_duration.as_secs(),
            max_circuit_bytes: d.max_circuit_bytes,
        }
    }
}

impl RelayLimits {
    /// The routing layer's relay settings.
    pub fn server_config(&self) -> kindred_routing::RelayServerConfig {
        kindred_routing::RelayServerConfig {
            max_reservations: self.max_reservations,
            max_circuits: self.max_circuits,
            max_circuit_duration: std::time::Duration::from_secs(self.max_circuit_secs),
            max_circuit_bytes: self.max_circuit_bytes,
            ..kindred_routing::RelayServerConfig::default()
        }
    }
}

/// The built-in trainer's task and schedule.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerConfig {
    /// Built-in or external.
    pub kind: TrainerKind,
    /// The model.
    pub model: ModelKind,
    /// Rotation of this node's digits in quarter turns (feature-shift cluster).
    pub rotation: u8,
    /// Label shift of this node's digits (concept-shift cluster).
    pub label_shift: u8,
    /// This node's shard of the training split.
    pub shard: usize,
    /// Number of shards the training split is cut into.
    pub shards: usize,
    /// SGD steps per round.
    pub steps: usize,
    /// Minibatch size.
    pub batch: usize,
    /// Learning rate.
    pub lr: f64,
    /// Seed of the data split and model initialisation (the same across a swarm, so every node
    /// starts from the same weights).
    pub seed: u64,
    /// Parameters of a [`ModelKind::Synthetic`] model (unused by the others).
    pub params: u64,
}

impl TrainerConfig {
    /// The model spec every update must match.
    ///
    /// # Errors
    /// [`crate::trainer::ModelError::Arch`] for a synthetic size out of range.
    pub fn spec(&self) -> Result<ModelSpec, crate::trainer::ModelError> {
        match self.model.arch() {
            Some(arch) => arch.spec(),
            None => crate::trainer::synthetic_spec(self.params),
        }
    }
}

impl Default for TrainerConfig {
    fn default() -> Self {
        let t = TrainConfig::default();
        Self {
            kind: TrainerKind::Builtin,
            model: ModelKind::Mlp,
            rotation: 0,
            label_shift: 0,
            shard: 0,
            shards: 1,
            steps: t.steps,
            batch: t.batch,
            lr: t.lr,
            seed: 1,
            params: 0,
        }
    }
}

impl TrainerConfig {
    /// The node's task.
    pub fn task(&self) -> Task {
        Task {
            rotation: Rotation::quarter_turns(usize::from(self.rotation)),
            label_shift: self.label_shift % 10,
        }
    }

    /// Local training hyper-parameters.
    pub fn train(&self) -> TrainConfig {
        TrainConfig {
            steps: self.steps,
            batch: self.batch,
            lr: self.lr,
        }
    }
}

/// A node's configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NodeConfig {
    /// Network name: nodes of different networks never share keys.
    pub network: String,
    /// Multiaddrs to listen on. Default TCP and QUIC on port 4001 (`/ip4/0.0.0.0/tcp/4001`,
    /// `/ip4/0.0.0.0/udp/4001/quic-v1`); a private swarm (`swarm_key`) listens on TCP only and
    /// skips QUIC addresses.
    pub listen: Vec<String>,
    /// Multiaddrs (with `/p2p/<peer id>`) of peers to join through.
    pub bootstrap: Vec<String>,
    /// Pre-shared key file of a private swarm (`kindred swarm-key` makes one).
    pub swarm_key: Option<PathBuf>,
    /// Ask the local network's gateway (UPnP) to forward the listen ports to this host.
    /// Default false.
    pub upnp: bool,
    /// Serve relay v2 reservations and circuits to peers behind NAT, so they can be reached
    /// for hole punching (a public node), within `relay_limits`. Default false.
    pub relay_server: bool,
    /// What a relay this node serves grants (the `[relay_limits]` table).
    pub relay_limits: RelayLimits,
    /// Address of the local HTTP API (status, metrics, external trainer). Loopback by default.
    pub api: Option<SocketAddr>,
    /// Target length of one round, seconds.
    pub round_secs: f64,
    /// Stop after this many rounds (run forever when absent).
    pub rounds: Option<u64>,
    /// Peers merged per round: the top-m by similarity the cosine gate admits. Default
    /// `kindred-routing`'s 16.
    pub partners: usize,
    /// Multi-probe lookups per round besides the exact band keys.
    pub probes: usize,
    /// After its first 3 rounds a node searches the DHT for partners every this many rounds,
    /// and follows the partners it found in between (1: search every round).
    pub discovery_every: u64,
    /// Every this many rounds (0: never) a node fetches the model snapshot of one partner it
    /// merged that round, picked at random from the half whose updates agree most with its own
    /// (the next of that half when one has none to give, at most
    /// [`crate::run::SNAPSHOT_TRIES`] asked), and moves `snapshot_share` of the way toward it.
    /// Merging updates alone lets the models of nodes with the same data drift apart; this pulls
    /// them back together, for one int8 model (at most one byte per parameter) fetched per
    /// pull. With 0 the merge's cosine gate also stays at 0 instead of following the peers'
    /// noise level (`kindred_distill::SynthConfig::for_node`).
    pub snapshot_every: u64,
    /// Share of the distance to the partner's model a pull covers, in (0, 1]; the step is also
    /// clipped to twice the norm of the node's own merged update that round.
    pub snapshot_share: f32,
    /// The exchange: `hub` (default) or `pairwise`.
    pub exchange: ExchangeKind,
    /// Top-k density of the hub exchange's packets and merges, in (0, 1]. Default
    /// [`kindred_distill::Policy::HUB_DENSITY`] (6.7%), measured on the MNIST MLP, whose large
    /// layers hold 50,000 elements. Layers of millions of elements carry the same signal in a
    /// smaller share (deep gradient compression keeps 0.1%): a node of a 10^8-10^9-parameter
    /// model sends about 6x fewer bytes and distils faster at 1%; what that costs in accuracy
    /// depends on the model and is the user's to measure. Not used by the pairwise exchange.
    pub density: f32,
    /// Log format.
    pub log_format: LogFormat,
    /// Trainer.
    pub trainer: TrainerConfig,
    /// Timeouts of the local HTTP API (see [`crate::api`] for all its limits).
    pub api_limits: ApiLimits,
}

impl Default for NodeConfig {
    fn default() -> Self {
        Self {
            network: "kindred".into(),
            listen: vec![
                "/ip4/0.0.0.0/tcp/4001".into(),
                "/ip4/0.0.0.0/udp/4001/quic-v1".into(),
            ],
            bootstrap: Vec::new(),
            swarm_key: None,
            upnp: false,
            relay_server: false,
            relay_limits: RelayLimits::default(),
            api: Some(SocketAddr::from(([127, 0, 0, 1], 7070))),
            round_secs: 10.0,
            rounds: None,
            partners: kindred_routing::LookupConfig::default().top_m,
            probes: 8,
            discovery_every: 10,
            snapshot_every: 2,
            snapshot_share: kindred_distill::PullConfig::default().share,
            exchange: ExchangeKind::Hub,
            density: kindred_distill::Policy::HUB_DENSITY,
            log_format: LogFormat::Text,
            trainer: TrainerConfig::default(),
            api_limits: ApiLimits::default(),
        }
    }
}

impl NodeConfig {
    /// Read `dir/kindred.toml`, or the defaults if the file does not exist.
    ///
    /// # Errors
    /// [`ConfigError`] if the file exists but cannot be read, parsed or validated.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join(CONFIG_FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(source) => return Err(ConfigError::Io { path, source }),
        };
        let config: Self =
            toml::from_str(&text).map_err(|source| ConfigError::Parse { path, source })?;
        config.validate()?;
        Ok(config)
    }

    /// Write the config to `dir/kindred.toml`.
    ///
    /// # Errors
    /// [`ConfigError::Io`] when the file cannot be written.
    pub fn save(&self, dir: &Path) -> Result<(), ConfigError> {
        let path = dir.join(CONFIG_FILE);
        let text = toml::to_string_pretty(self).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        std::fs::write(&path, text).map_err(|source| ConfigError::Io { path, source })
    }

    /// The distillation policy of the node's packets: [`kindred_distill::Policy::hub`] at
    /// [`NodeConfig::density`] for the hub exchange, the default for the pairwise one (each
    /// partner fetches one body per round, so sparser).
    pub fn packet_policy(&self) -> kindred_distill::Policy {
        match self.exchange {
            ExchangeKind::Hub => kindred_distill::Policy {
                density: self.density,
                ..kindred_distill::Policy::hub()
            },
            ExchangeKind::Pairwise => kindred_distill::Policy::default(),
        }
    }

    /// Check ranges.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.into()));
        if !(self.round_secs.is_finite() && self.round_secs > 0.0) {
            return bad("round_secs must be a positive number");
        }
        if self.network.is_empty() {
            return bad("network must not be empty");
        }
        if self.partners == 0 {
            return bad("partners must be at least 1");
        }
        if self.discovery_every == 0 {
            return bad("discovery_every must be at least 1");
        }
        if !(self.snapshot_share > 0.0 && self.snapshot_share <= 1.0) {
            return bad("snapshot_share must be in (0, 1]");
        }
        self.packet_policy()
            .validate()
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        self.api_limits.validate().map_err(ConfigError::Invalid)?;
        let r = &self.relay_limits;
        if r.max_reservations == 0 || r.max_circuits == 0 || r.max_circuit_secs == 0 {
            return bad("relay_limits: reservations, circuits and seconds must be at least 1");
        }
        let t = &self.trainer;
        if t.shards == 0 || t.shard >= t.shards {
            return bad("trainer.shard must be below trainer.shards");
        }
        if t.steps == 0 || t.batch == 0 || !(t.lr.is_finite() && t.lr > 0.0) {
            return bad("trainer.steps, trainer.batch and trainer.lr must be positive");
        }
        if t.model == ModelKind::Synthetic {
            if t.kind != TrainerKind::External {
                return bad("trainer.model = \"synthetic\" needs trainer.kind = \"external\"");
            }
            if let Err(e) = t.spec() {
                return Err(ConfigError::Invalid(format!("trainer.params: {e}")));
            }
        }
        Ok(())
    }

    /// Round length.
    pub fn round_duration(&self) -> Duration {
        Duration::from_secs_f64(self.round_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_round_trip_through_toml() {
        let c = NodeConfig::default();
        let text = toml::to_string_pretty(&c).unwrap();
        assert_eq!(toml::from_str::<NodeConfig>(&text).unwrap(), c);
        c.validate().unwrap();
    }

    #[test]
    fn partial_files_keep_defaults_and_typos_are_errors() {
        let c: NodeConfig =
            toml::from_str("round_secs = 2.5\n[trainer]\nlabel_shift = 3\n").unwrap();
        assert_eq!(c.round_secs, 2.5);
        assert_eq!(c.trainer.task().label_shift, 3);
        assert_eq!(c.partners, NodeConfig::default().partners);
        assert!(toml::from_str::<NodeConfig>("round_sec = 2.5").is_err());
        let bad: NodeConfig = toml::from_str("[trainer]\nshard = 4\nshards = 4\n").unwrap();
        assert!(matches!(bad.validate(), Err(ConfigError::Invalid(_))));
        let bad: NodeConfig = toml::from_str("snapshot_share = 1.5\n").unwrap();
        assert!(matches!(bad.validate(), Err(ConfigError::Invalid(_))));
        let off: NodeConfig = toml::from_str("snapshot_every = 0\n").unwrap();
        off.validate().unwrap();
        let sparse: NodeConfig = toml::from_str("density = 0.01\n").unwrap();
        sparse.validate().unwrap();
        for d in ["0.0", "1.5", "nan", "-0.01"] {
            let bad: NodeConfig = toml::from_str(&format!("density = {d}\n")).unwrap();
            assert!(
                matches!(bad.validate(), Err(ConfigError::Invalid(_))),
                "{d}"
            );
        }
        let api: NodeConfig = toml::from_str("[api_limits]\nheader_timeout_secs = 2.5\n").unwrap();
        assert_eq!(api.api_limits.header_timeout(), Duration::from_millis(2500));
        assert_eq!(api.api_limits.body_timeout_secs, 10.0);
        let bad: NodeConfig = toml::from_str("[api_limits]\nbody_timeout_secs = -1\n").unwrap();
        assert!(matches!(bad.validate(), Err(ConfigError::Invalid(_))));
        assert!(toml::from_str::<NodeConfig>("[api_limits]\nheader_timeout = 2\n").is_err());
    }
}
