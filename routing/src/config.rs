//! Configuration: the sans-IO core's parameters ([`CoreConfig`]) and the libp2p driver's
//! ([`RoutingConfig`]). Every default is documented with the reason for its value.

use std::num::NonZeroUsize;
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::pnet::PreSharedKey;

use crate::discovery::Discovery;
use crate::keys::{KeyConfig, NetworkId, ShardPolicy};
use crate::scoring::ScoreConfig;

/// Parameters of one round lookup (defaults for [`crate::PartnerQuery`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LookupConfig {
    /// Multi-probe keys looked up besides the `L` band keys. Default 8: each probe is one more
    /// O(log N) DHT lookup, and the first few (single low-margin bit flips) recover most of the
    /// neighbours the exact bands miss.
    pub probes: usize,
    /// Bodies fetched: the `m` best-ranked candidates the [`LookupConfig::gate`] admits.
    /// Default 16. Each partner is one more gradient in the merge; with the gate keeping
    /// other tasks out, more partners bring a node closer to its task's full average
    /// (`kindred-sim learn --nodes 64`, 16 nodes per task, seeds 4-6: 1.4 points below the
    /// oracle's cluster average with 10 partners, 0.8 with 16, on label4 and rotation4). A
    /// body costs about 3.5 KB for the MNIST MLP, against ≈ 0.7 MB of Kademlia traffic for one
    /// discovery round.
    pub top_m: usize,
    /// Which candidates are close enough to fetch and to follow. Default
    /// [`CosineGate::default`].
    pub gate: CosineGate,
    /// A provider lookup ends early once this many DHT nodes have answered with provider
    /// records for its key. Default 2: every node holding a key's records got them from the
    /// same announcers, so further holders mostly repeat the same providers, and one extra
    /// holder covers an announcer that reached a slightly different set of nodes. 0 lets every
    /// lookup run to Kademlia's own termination.
    pub provider_quorum: usize,
    /// In a swarm small enough that the node's routing table holds fewer peers than one DHT
    /// answer lists (libp2p's `K_VALUE`, 20), a provider lookup also ends once this many DHT
    /// nodes have answered without a record for its key. Default 2, as
    /// [`LookupConfig::provider_quorum`]. There every answer lists every peer the node knows,
    /// so a walk has no second hop: it asks the key's closest peers first, and they hold its
    /// records if anyone announced it. Yet libp2p's iterator, stalled from its second answer on
    /// (no answer brings a closer peer), keeps `k` requests in flight until the `k` closest
    /// have answered: in the 16-node `kindred demo` a lookup of a key nobody announced took
    /// 9-15 requests, each answered with a list of 15 peers (about 1.3 KB); with this, 3.
    /// The table's size is the only sign of a small swarm libp2p gives: a node that joined a
    /// swarm of a few dozen and has not met 20 of them yet may end a walk before it reached the
    /// key's holders; its tables fill within its first rounds (the join, libp2p's bootstraps,
    /// the peers that dial it), and a search that found nobody is repeated
    /// (`ExchangeConfig::search_every`'s rules). 0 lets such lookups run to Kademlia's own
    /// termination.
    pub empty_quorum: usize,
    /// Shards of each hot band a refresh lookup ([`crate::PartnerQuery::refresh`]) asks,
    /// instead of all of them. Default 2. A full lookup asks every shard, so the traffic of
    /// looking up a hot band grows with the number of peers announcing under it (16 shards of
    /// about 16 providers each for a task of 250 nodes) rather than with log N. A node that
    /// already follows peers searches only to meet new ones, and two shards of each band and
    /// probe find it plenty: in `kindred-sim learn --nodes 1000 --rounds 30 --setting label
    /// --seed 1` a refresh lookup finds 96 candidates instead of 212 and moves 1.0 MB of Kademlia
    /// traffic per node instead of 2.8 MB, and final accuracy is 84.00% against 83.74% asking
    /// every shard (BENCHMARKS.md, "Refresh lookups"). 0, or at least the band's shard count,
    /// asks every shard.
    pub refresh_shards: u32,
    /// Ranked candidate headers returned. Default 32.
    pub candidates: usize,
    /// Deadline of a whole round lookup; what was found by then is returned. Default 30 s.
    pub timeout: Duration,
    /// Most distinct providers asked for headers per lookup: each is a header request and a
    /// connection unless one is open. Default 768. In `kindred-sim routing` at 10^5 nodes a
    /// round lookup finds about 614 providers (hot bands are sharded), and the nearest five are
    /// among the first 256 asked only about two times in three (recall@5 0.68, against 0.93
    /// with 768).
    pub max_providers: usize,
    /// Header requests (and the dials they need) in flight per lookup. Default 32.
    pub header_concurrency: usize,
    /// Round lookups in flight per node. Default 8.
    pub max_concurrent: usize,
}

impl Default for LookupConfig {
    fn default() -> Self {
        Self {
            probes: 8,
            top_m: 16,
            gate: CosineGate::default(),
            provider_quorum: 2,
            empty_quorum: 2,
            refresh_shards: 2,
            candidates: 32,
            timeout: Duration::from_secs(30),
            max_providers: 768,
            header_concurrency: 32,
            max_concurrent: 8,
        }
    }
}

/// Which ranked candidates a node fetches bodies from and follows: those at or above an
/// absolute floor and not much farther from the node than its nearest candidate.
///
/// Distance here is `1 − sketch cosine`. Within a task, cumulative updates point the same way
/// up to noise; across tasks they differ by the tasks' difference as well. In `kindred-sim learn
/// --setting rotation --seed 1` a node's own cluster sits at 0.96-0.99 and the nearest other
/// cluster at 0.71-0.88 with 64 nodes of 125 digits (rounds 2-29); with 1,000 nodes of 32 digits
/// the noisier updates put the node's own cluster at 0.82-0.95. So the bound is a ratio to the
/// nearest candidate's distance, not a fixed gap: a fixed 0.05 cut a node down to 3.5 partners
/// at 1,000 nodes. A floor alone lets the nearest other task in as soon as a node's own task has
/// fewer peers in view than it fetches; the ratio does not, whatever the task's size.
///
/// ```
/// use kindred_routing::CosineGate;
///
/// let gate = CosineGate::default(); // floor 0.5, at most 4x the nearest distance
/// assert!(gate.admits(0.99, 0.97)); // distance 0.03 ≤ 4 × 0.02 (0.01, floored)
/// assert!(!gate.admits(0.99, 0.88)); // the next task
/// assert!(gate.admits(0.94, 0.82)); // a noisier task: 0.18 ≤ 4 × 0.06
/// assert!(!gate.admits(0.45, 0.45)); // below the floor
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineGate {
    /// Candidates below this sketch cosine are never admitted, however few others there are.
    /// Default 0.5: unrelated updates sit near 0.
    pub min: f32,
    /// Candidates farther than this multiple of the nearest candidate's distance
    /// (`1 − cosine`, at least [`CosineGate::MIN_DISTANCE`]) are not admitted. Default 4: in
    /// the runs above the next task is 10-12 times farther than the nearest peer of the own
    /// one, and the own task's peers are within 3 times.
    pub max_distance_ratio: f32,
}

impl Default for CosineGate {
    fn default() -> Self {
        Self {
            min: 0.5,
            max_distance_ratio: 4.0,
        }
    }
}

impl CosineGate {
    /// The nearest distance the ratio is taken against is at least this, so a near-copy of the
    /// node's own update does not shut every other candidate out. Two nodes that pull toward
    /// each other's snapshots in the same round become near-copies (sketch cosine 0.992-0.999),
    /// and with a floor of 0.005 the gate then admitted little but the copy: at 1,000 nodes
    /// (`kindred-sim learn --nodes 1000 --setting label --seed 1`) 16 nodes ended following 1-2
    /// peers, at 68-78% accuracy. With 0.02 none do (85.11% against 84.87%, purity 0.997 both),
    /// and the next task (at least 0.12 away at 64 nodes) stays out. It also bounds what a peer
    /// copying a node's embedding can do: the node still admits everything within 0.08.
    pub const MIN_DISTANCE: f32 = 0.02;

    /// Whether a candidate at `cosine` is admitted when the best candidate is at `best`.
    pub fn admits(&self, best: f32, cosine: f32) -> bool {
        let nearest = (1.0 - best).max(Self::MIN_DISTANCE);
        cosine >= self.min && 1.0 - cosine <= self.max_distance_ratio * nearest
    }

    /// Keep the candidates of `items` the gate admits, measured against the best of them, in
    /// their order. The one place the best is taken, for the lookup's body fetches, the peers
    /// followed and the simulator.
    ///
    /// ```
    /// use kindred_routing::CosineGate;
    ///
    /// let mut ranked = vec![("b", 0.97), ("c", 0.88), ("a", 0.99), ("d", 0.3)];
    /// CosineGate::default().retain_admitted(&mut ranked, |r| r.1);
    /// assert_eq!(ranked, vec![("b", 0.97), ("a", 0.99)]);
    /// ```
    pub fn retain_admitted<T>(&self, items: &mut Vec<T>, cosine: impl Fn(&T) -> f32) {
        self.retain_admitted_near(f32::NEG_INFINITY, items, cosine);
    }

    /// [`CosineGate::retain_admitted`], measured against the best of `items` and `reference`:
    /// the cosine of a peer the node already knows to be of its task (a hub's
    /// [`crate::Cohort::anchor`]). A hub whose own task's members have left is then not taken
    /// over by another task's nodes, which sit near each other but far from it.
    ///
    /// ```
    /// use kindred_routing::CosineGate;
    ///
    /// let gate = CosineGate::default();
    /// let mut pushers = vec![("x", 0.74), ("y", 0.72)]; // another task's nodes
    /// let mut alone = pushers.clone();
    /// gate.retain_admitted_near(f32::NEG_INFINITY, &mut alone, |r| r.1);
    /// assert_eq!(alone.len(), 2); // measured against each other, both pass
    /// gate.retain_admitted_near(0.97, &mut pushers, |r| r.1); // its own task was at 0.97
    /// assert!(pushers.is_empty());
    /// ```
    pub fn retain_admitted_near<T>(
        &self,
        reference: f32,
        items: &mut Vec<T>,
        cosine: impl Fn(&T) -> f32,
    ) {
        let best = items.iter().map(&cosine).fold(reference, f32::max);
        items.retain(|t| self.admits(best, cosine(t)));
    }
}

/// Parameters of the sans-IO [`crate::RoutingCore`].
#[derive(Debug, Clone, PartialEq)]
pub struct CoreConfig {
    /// The network's id (hashed into every key).
    pub network: NetworkId,
    /// LSH band layout. Default 16 × 16.
    pub keys: KeyConfig,
    /// When the node searches the DHT and when key windows open ([`Discovery`]). Default:
    /// rounds 0, 1 and 2, then every 10th; the 32 best peers are followed in between.
    pub discovery: Discovery,
    /// Windows whose announcements and indexed headers are kept. Default 2 (the current and the
    /// previous one, so a lookup racing a window change still finds its peers).
    pub retain_windows: u64,
    /// Round lookup parameters.
    pub lookup: LookupConfig,
    /// When hot keys are sharded. The threshold must not exceed the Kademlia replication
    /// factor, which caps the providers one response returns ([`crate::spawn`] clamps it).
    pub shards: ShardPolicy,
    /// Peer scoring and bans.
    pub scoring: ScoreConfig,
    /// Most `(sender, model)` replay marks kept. Default 65,536.
    pub replay_capacity: usize,
    /// Most headers indexed per window. Default 16,384.
    pub index_capacity: usize,
    /// Most hot bands remembered. Default 4,096.
    pub hot_band_capacity: usize,
    /// Who may fetch this node's model snapshot: a peer earns one fetch each time this node
    /// serves it a packet body (a partner merging its update), valid for this long. A snapshot
    /// is the whole model (up to 2 GiB, in pieces past 64 MiB) against a 9-byte request, so
    /// serving anyone who asks would make every node a traffic amplifier. Default 2 min; `None`
    /// serves anyone (tests, trusted swarms).
    pub snapshot_grant: Option<Duration>,
    /// Largest body answered whole in one response (a snapshot, a hub's merge); a larger one is
    /// answered with its header alone and fetched in pieces ([`crate::pieces`]). Default (and
    /// most) [`kindred_proto::MAX_BODY_BYTES`].
    pub inline_body_bytes: usize,
    /// Bytes this node asks for in each piece of a peer's large body. Default (and most)
    /// [`kindred_proto::MAX_CHUNK_BYTES`]: a piece must arrive within one request's timeout.
    pub chunk_bytes: usize,
}

impl CoreConfig {
    /// Defaults for `network`.
    pub fn new(network: NetworkId) -> Self {
        Self {
            network,
            keys: KeyConfig::default(),
            discovery: Discovery::default(),
            retain_windows: 2,
            lookup: LookupConfig::default(),
            shards: ShardPolicy::default(),
            scoring: ScoreConfig::default(),
            replay_capacity: 65_536,
            index_capacity: 16_384,
            hot_band_capacity: 4096,
            snapshot_grant: Some(Duration::from_secs(120)),
            inline_body_bytes: kindred_proto::MAX_BODY_BYTES,
            chunk_bytes: kindred_proto::MAX_CHUNK_BYTES,
        }
    }
}

/// Whether Kademlia answers queries (server) or only asks (client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KadMode {
    /// Server once an external address is confirmed (reachable), client before: libp2p's
    /// default, right for most deployments.
    Auto,
    /// Always serve (a node known to be reachable, e.g. a bootstrap node).
    Server,
    /// Never serve (a node behind NAT without port forwarding).
    Client,
}

/// Kademlia parameters.
///
/// A provider lookup costs about `k + α` requests when the key's holders are already in the
/// routing table, and up to every peer within the `k` closest plus those contacted while
/// libp2p's iterator is stalled (it keeps `k` requests in flight until the `k` closest have
/// answered) otherwise; measured on loopback swarms that is ≈ `2k + α` at N = 16 to 256.
/// libp2p's default `k = 20` would cost at least 20 requests per lookup, over the `3·log2 N`
/// budget for every N below 2^7. `k = 5`, `α = 2` keeps a full lookup under budget from N = 16
/// (12 requests) up, and [`LookupConfig::provider_quorum`] ends most lookups of populated keys
/// after 3–5 requests ([`LookupConfig::empty_quorum`]: of empty keys too, in a small swarm).
/// Five replicas per provider record are plenty for records that live one
/// round window.
#[derive(Debug, Clone, PartialEq)]
pub struct KadConfig {
    /// Replication factor `k`: provider records are stored on the `k` closest nodes to a key, and
    /// a lookup ends once the `k` closest nodes it knows have answered. Default 5.
    pub replication_factor: NonZeroUsize,
    /// Parallelism `α` of iterative lookups. Default 2.
    pub parallelism: NonZeroUsize,
    /// Deadline of one DHT query. Default 20 s.
    pub query_timeout: Duration,
    /// How long provider records live. Default 1 h: keys change every window, so records only
    /// need to outlive a few rounds.
    pub provider_ttl: Duration,
    /// Most providers stored per key. Default 64: above the shard threshold, so hot keys are
    /// visible as such before they are split.
    pub max_providers_per_key: usize,
    /// Server or client.
    pub mode: KadMode,
    /// At most one bootstrap that libp2p starts on its own (after a peer enters a small routing
    /// table) runs to the end per this interval; the others are ended after their first
    /// requests. Bootstraps the node asks for always run. Default 60 s.
    pub bootstrap_throttle: Duration,
}

impl Default for KadConfig {
    fn default() -> Self {
        Self {
            replication_factor: NonZeroUsize::new(5).unwrap_or(NonZeroUsize::MIN),
            parallelism: NonZeroUsize::new(2).unwrap_or(NonZeroUsize::MIN),
            query_timeout: Duration::from_secs(20),
            provider_ttl: Duration::from_secs(3600),
            max_providers_per_key: 64,
            mode: KadMode::Auto,
            bootstrap_throttle: Duration::from_secs(60),
        }
    }
}

/// Which byte stream carries connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP (listen on `/ip4/…/tcp/…`).
    Tcp,
    /// libp2p's in-process memory transport (listen on `/memory/0`): tests and simulations.
    Memory,
}

/// Transport and connection-lifecycle parameters.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// TCP or in-memory.
    pub kind: TransportKind,
    /// Pre-shared key of a private swarm: connections are wrapped in libp2p pnet, and peers
    /// without the same key cannot connect.
    pub swarm_key: Option<PreSharedKey>,
    /// Deadline for the whole connection upgrade (pnet, Noise, yamux). Default 5 s: a peer with
    /// the wrong swarm key fails the handshake well within 10 s instead of hanging.
    pub handshake_timeout: Duration,
    /// Idle connections are closed after this. Default 60 s.
    pub idle_timeout: Duration,
    /// Deadline of one `GetHeaders`/`GetBody` exchange. Default 10 s.
    pub request_timeout: Duration,
    /// Largest hub-exchange push this node reads (its frame, header, body and peer list), at
    /// most [`kindred_proto::rpc::MAX_PUSH_REQUEST_BYTES`] (the default). A node that knows its
    /// model sets it to what a push of that model can be, so a peer cannot make it buffer
    /// 64 MiB per request stream.
    pub max_push_bytes: usize,
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Addresses known to be reachable from other peers (switch Kademlia to server mode).
    pub external: Vec<Multiaddr>,
    /// Treat the actual listen addresses as reachable where they look it
    /// ([`crate::transport::looks_reachable`]: a public IP, or loopback for one host's
    /// swarm); addresses in private ranges wait for AutoNAT's verdict. Default false.
    pub listen_addrs_are_external: bool,
    /// Ask the local network's gateway (UPnP IGD) to forward each listen port to this host;
    /// a mapped address becomes an external address. Default false: most gateways have UPnP
    /// off, and searching for one costs a multicast each start.
    pub upnp: bool,
    /// Serve relay v2 reservations and circuits to peers behind NAT (a public node), with
    /// these limits. Default `None`: a relay's operator pays for its circuits' bytes.
    pub relay_server: Option<RelayServerConfig>,
    /// How long a request to a peer reachable only through a relay waits for a hole-punched
    /// direct connection before it fails ([`crate::direct_only`]). Default 15 s.
    pub punch_window: Duration,
}

/// What a node serving as a relay grants ([`TransportConfig::relay_server`]).
///
/// Circuits carry signalling and hole punching only (Kindred's RPCs never cross one), so
/// libp2p's defaults fit: 2 minutes and 128 KiB per circuit.
///
/// ```
/// let cfg = kindred_routing::RelayServerConfig::default();
/// assert_eq!(cfg.max_circuit_bytes, 128 * 1024);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayServerConfig {
    /// Reservations held at once. Default 128.
    pub max_reservations: usize,
    /// Reservations of one peer. Default 4.
    pub max_reservations_per_peer: usize,
    /// Circuits open at once. Default 16.
    pub max_circuits: usize,
    /// Circuits of one peer. Default 4.
    pub max_circuits_per_peer: usize,
    /// A circuit's longest life. Default 2 minutes.
    pub max_circuit_duration: Duration,
    /// Bytes a circuit carries at most. Default 128 KiB.
    pub max_circuit_bytes: u64,
}

impl Default for RelayServerConfig {
    fn default() -> Self {
        Self {
            max_reservations: 128,
            max_reservations_per_peer: 4,
            max_circuits: 16,
            max_circuits_per_peer: 4,
            max_circuit_duration: Duration::from_secs(120),
            max_circuit_bytes: 128 * 1024,
        }
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            kind: TransportKind::Tcp,
            swarm_key: None,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(10),
            max_push_bytes: kindred_proto::rpc::MAX_PUSH_REQUEST_BYTES,
            listen: Vec::new(),
            external: Vec::new(),
            listen_addrs_are_external: false,
            upnp: false,
            relay_server: None,
            punch_window: crate::direct_only::DEFAULT_PUNCH_WINDOW,
        }
    }
}

/// Connection limits (libp2p `connection-limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionConfig {
    /// Established inbound connections. Default 1024: at scale as many peers as a round lookup
    /// asks ([`LookupConfig::max_providers`]) may ask this node for headers in one round.
    pub max_established_incoming: u32,
    /// Established outbound connections. Default 1024 (room for a lookup's
    /// [`LookupConfig::max_providers`] header requests plus Kademlia's own).
    pub max_established_outgoing: u32,
    /// Established connections per peer. Default 3: one each way during simultaneous dials, and
    /// AutoNAT's dial-back, which arrives on a fresh connection from a peer already connected
    /// (and may meet the dial-back this node ran for that peer, still open).
    pub max_established_per_peer: u32,
    /// Inbound connections still handshaking. Default 64.
    pub max_pending_incoming: u32,
    /// Outbound connections still handshaking. Default 64.
    pub max_pending_outgoing: u32,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self {
            max_established_incoming: 1024,
            max_established_outgoing: 1024,
            max_established_per_peer: 3,
            max_pending_incoming: 64,
            max_pending_outgoing: 64,
        }
    }
}

/// Everything the tokio driver needs.
#[derive(Debug, Clone)]
pub struct RoutingConfig {
    /// Sans-IO core parameters.
    pub core: CoreConfig,
    /// Kademlia parameters.
    pub kad: KadConfig,
    /// Transport parameters.
    pub transport: TransportConfig,
    /// Connection limits.
    pub connections: ConnectionConfig,
    /// Capacity of the command channel from handles to the driver. Default 64.
    pub command_capacity: usize,
    /// Capacity of the event channel to the node; events past it are dropped (and counted).
    /// Default 256.
    pub event_capacity: usize,
}

impl RoutingConfig {
    /// Defaults for `network`, listening on nothing yet.
    pub fn new(network: NetworkId) -> Self {
        Self {
            core: CoreConfig::new(network),
            kad: KadConfig::default(),
            transport: TransportConfig::default(),
            connections: ConnectionConfig::default(),
            command_capacity: 64,
            event_capacity: 256,
        }
    }
}
