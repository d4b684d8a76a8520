//! The composed libp2p `NetworkBehaviour`: identity gate, ban list, connection limits,
//! Kademlia, identify, ping, AutoNAT (v1, client and server, [`crate::reachability`]), UPnP port
//! mapping when asked for ([`crate::TransportConfig::upnp`]), relay v2 (a client in every node,
//! a server when asked for: [`crate::TransportConfig::relay_server`]), DCUtR hole punching, and
//! the header/body/exchange request-response protocol on direct connections only
//! ([`crate::direct_only`]).
//!
//! Order matters: the identity gate ([`crate::identity_gate`]: weak, non-canonical or
//! non-ed25519 identity keys, which the Noise handshake lets through), the ban list and the limits
//! come first so that such a peer, a banned peer or a connection over the limits is refused
//! before any other behaviour sees it.

use std::convert::Infallible;

use kindred_proto::rpc::RpcResponse;
use libp2p::autonat;
use libp2p::identity::Keypair;
use libp2p::kad::store::{MemoryStore, MemoryStoreConfig};
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{
    StreamProtocol, allow_block_list, connection_limits, dcutr, identify, kad, ping, relay,
    request_response, upnp,
};

use crate::codec::{RPC_PROTOCOL, RpcCodec, WireRequest};
use crate::config::{ConnectionConfig, KadConfig, KadMode, RelayServerConfig, RoutingConfig};
use crate::direct_only::DirectOnly;
use crate::identity_gate::IdentityGate;

/// Kademlia protocol name of Kindred's DHT.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/kindred/kad/1.0.0");

/// Identify protocol version string.
pub const IDENTIFY_VERSION: &str = "/kindred/1.0.0";

/// How often a node pings each connection (libp2p's default is 15 s). Nothing here acts on the
/// answers (no health policy drops a peer on a failed ping, as libp2p leaves to its users): the
/// node keeps ping so that peers which require it can ping it, and as light traffic on idle
/// connections. Every 15 s it was 300 bytes a node and round of the 16-node demo's 3-s rounds,
/// 2% of the bytes it sends after its warm-up.
pub const PING_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// Kindred's libp2p behaviour. Events surface as [`BehaviourEvent`].
#[derive(NetworkBehaviour)]
#[behaviour(to_swarm = "BehaviourEvent")]
pub struct Behaviour {
    /// Refuses peers whose identity key fails the strict check.
    pub identity_gate: IdentityGate,
    /// Banned peers: connections refused, existing ones closed.
    pub blocked: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    /// Connection limits.
    pub limits: connection_limits::Behaviour,
    /// The DHT: provider records of semantic keys.
    pub kad: kad::Behaviour<MemoryStore>,
    /// Exchange of listen addresses and protocols (fed into Kademlia).
    pub identify: identify::Behaviour,
    /// Liveness.
    pub ping: ping::Behaviour,
    /// AutoNAT: asks peers to dial this node back, and dials them back when they ask.
    pub autonat: autonat::Behaviour,
    /// Port mappings on the local network's gateway (UPnP IGD), when enabled.
    pub upnp: Toggle<upnp::tokio::Behaviour>,
    /// Relay v2 client: reservations with relays while this node is not reachable, and
    /// circuits to peers that are reachable only through one.
    pub relay_client: relay::client::Behaviour,
    /// Relay v2 server, when this node serves reservations.
    pub relay_server: Toggle<relay::Behaviour>,
    /// Hole punching: a relayed connection is upgraded to a direct one.
    pub dcutr: dcutr::Behaviour,
    /// The packet and exchange RPCs, on direct connections only.
    pub rpc: DirectOnly<request_response::Behaviour<RpcCodec>>,
}

/// What [`Behaviour`] reports to the swarm.
#[derive(Debug)]
pub enum BehaviourEvent {
    /// A Kademlia event (query progress, routing table updates); boxed, it is large.
    Kad(Box<kad::Event>),
    /// An identify event (a peer's listen addresses and protocols).
    Identify(Box<identify::Event>),
    /// A ping result.
    Ping(ping::Event),
    /// An AutoNAT probe, in either role, or a new verdict on this node.
    Autonat(autonat::Event),
    /// A gateway port mapping made, lost, or not possible.
    Upnp(upnp::Event),
    /// A reservation with a relay, or a circuit through one.
    RelayClient(relay::client::Event),
    /// A reservation or circuit this node serves as a relay.
    RelayServer(Box<relay::Event>),
    /// A hole punch's outcome.
    Dcutr(dcutr::Event),
    /// A request (possibly [`WireRequest::Invalid`]), response or failure of
    /// `/kindred/rpc/1.0.0`.
    Rpc(request_response::Event<WireRequest, RpcResponse>),
}

impl From<Infallible> for BehaviourEvent {
    fn from(never: Infallible) -> Self {
        match never {}
    }
}

impl From<kad::Event> for BehaviourEvent {
    fn from(e: kad::Event) -> Self {
        Self::Kad(Box::new(e))
    }
}

impl From<identify::Event> for BehaviourEvent {
    fn from(e: identify::Event) -> Self {
        Self::Identify(Box::new(e))
    }
}

impl From<ping::Event> for BehaviourEvent {
    fn from(e: ping::Event) -> Self {
        Self::Ping(e)
    }
}

impl From<upnp::Event> for BehaviourEvent {
    fn from(e: upnp::Event) -> Self {
        Self::Upnp(e)
    }
}

impl From<relay::client::Event> for BehaviourEvent {
    fn from(e: relay::client::Event) -> Self {
        Self::RelayClient(e)
    }
}

impl From<relay::Event> for BehaviourEvent {
    fn from(e: relay::Event) -> Self {
        Self::RelayServer(Box::new(e))
    }
}

impl From<dcutr::Event> for BehaviourEvent {
    fn from(e: dcutr::Event) -> Self {
        Self::Dcutr(e)
    }
}

impl From<autonat::Event> for BehaviourEvent {
    fn from(e: autonat::Event) -> Self {
        Self::Autonat(e)
    }
}

impl From<request_response::Event<WireRequest, RpcResponse>> for BehaviourEvent {
    fn from(e: request_response::Event<WireRequest, RpcResponse>) -> Self {
        Self::Rpc(e)
    }
}

fn kad_config(cfg: &KadConfig) -> kad::Config {
    let mut c = kad::Config::new(KAD_PROTOCOL);
    c.set_replication_factor(cfg.replication_factor)
        .set_parallelism(cfg.parallelism)
        .set_query_timeout(cfg.query_timeout)
        .set_provider_record_ttl(Some(cfg.provider_ttl))
        .set_provider_publication_interval(Some(cfg.provider_ttl / 2))
        // Kindred stores no values, only provider records.
        .set_record_ttl(Some(cfg.provider_ttl));
    c
}

fn limits(cfg: &ConnectionConfig) -> connection_limits::ConnectionLimits {
    connection_limits::ConnectionLimits::default()
        .with_max_established_incoming(Some(cfg.max_established_incoming))
        .with_max_established_outgoing(Some(cfg.max_established_outgoing))
        .with_max_established_per_peer(Some(cfg.max_established_per_peer))
        .with_max_pending_incoming(Some(cfg.max_pending_incoming))
        .with_max_pending_outgoing(Some(cfg.max_pending_outgoing))
}

fn relay_config(cfg: &RelayServerConfig) -> relay::Config {
    relay::Config {
        max_reservations: cfg.max_reservations,
        max_reservations_per_peer: cfg.max_reservations_per_peer,
        max_circuits: cfg.max_circuits,
        max_circuits_per_peer: cfg.max_circuits_per_peer,
        max_circuit_duration: cfg.max_circuit_duration,
        max_circuit_bytes: cfg.max_circuit_bytes,
        ..relay::Config::default()
    }
}

impl Behaviour {
    /// The behaviour for `keypair` under `config`, with the relay client that goes with the
    /// transport's relay half ([`libp2p::relay::client::new`]).
    pub fn new(
        keypair: &Keypair,
        config: &RoutingConfig,
        relay_client: relay::client::Behaviour,
    ) -> Self {
        let peer = keypair.public().to_peer_id();
        let store = MemoryStore::with_config(
            peer,
            MemoryStoreConfig {
                max_records: 16,
                max_value_bytes: 1024,
                max_providers_per_key: config.kad.max_providers_per_key,
                max_provided_keys: 4096,
            },
        );
        let mut kad = kad::Behaviour::with_config(peer, store, kad_config(&config.kad));
        match config.kad.mode {
            KadMode::Auto => kad.set_mode(None),
            KadMode::Server => kad.set_mode(Some(kad::Mode::Server)),
            KadMode::Client => kad.set_mode(Some(kad::Mode::Client)),
        }
        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_VERSION.to_owned(), keypair.public())
                .with_agent_version(format!("kindred/{}", env!("CARGO_PKG_VERSION")))
                // A relay reservation made or given up changes whether peers may make this
                // node a hub: they hear of it at once.
                .with_push_listen_addr_updates(true),
        );
        let rpc = request_response::Behaviour::with_codec(
            RpcCodec::default().with_push_limit(config.transport.max_push_bytes),
            [(RPC_PROTOCOL, request_response::ProtocolSupport::Full)],
            request_response::Config::default()
                .with_request_timeout(config.transport.request_timeout)
                .with_max_concurrent_streams(64),
        );
        Self {
            identity_gate: IdentityGate::new(),
            blocked: allow_block_list::Behaviour::default(),
            limits: connection_limits::Behaviour::new(limits(&config.connections)),
            kad,
            identify,
            ping: ping::Behaviour::new(ping::Config::new().with_interval(PING_INTERVAL)),
            autonat: autonat::Behaviour::new(peer, crate::reachability::autonat_config()),
            upnp: Toggle::from(config.transport.upnp.then(upnp::tokio::Behaviour::default)),
            relay_client,
            relay_server: Toggle::from(
                config
                    .transport
                    .relay_server
                    .as_ref()
                    .map(|cfg| relay::Behaviour::new(peer, relay_config(cfg))),
            ),
            dcutr: dcutr::Behaviour::new(peer),
            rpc: DirectOnly::new(rpc, config.transport.punch_window),
        }
    }
}
