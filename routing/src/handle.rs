//! The node-facing API of the tokio driver: [`spawn`] a routing task, then use the cloneable
//! [`RoutingHandle`] and the bounded [`RoutingEvent`] stream.
//!
//! ```no_run
//! use std::sync::Arc;
//! use kindred_routing::*;
//!
//! # async fn run(keypair: libp2p::identity::Keypair, packet: kindred_proto::SealedPacket,
//! #     margins: Vec<f32>, spec: Arc<kindred_proto::ModelSpec>) -> anyhow::Result<()> {
//! let store = Arc::new(MemoryStore::default());
//! let mut config = RoutingConfig::new(NetworkId::from_name("my-swarm"));
//! config.transport.listen = vec!["/ip4/0.0.0.0/tcp/4001".parse()?];
//! let (routing, mut events) = spawn(keypair, config, store.clone()).await?;
//! routing.dial("/ip4/192.0.2.1/tcp/4001".parse()?).await?;
//! routing.bootstrap().await?;
//!
//! // Each round: store the packet, announce it, look up partners.
//! store.insert(&packet);
//! routing.announce(packet.header.clone()).await?;
//! let partners = routing.find_partners(PartnerQuery::new(packet.header.clone(), margins, spec)).await?;
//! for p in &partners.packets {
//!     println!("merge with {} (cosine {:.2})", p.packet.header.header().sender, p.cosine);
//! }
//! while let Ok(event) = events.try_recv() {
//!     println!("{event:?}");
//! }
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::Duration;

use kindred_proto::{ModelId, ModelSpec, OutcomePacket, PacketId, VerifiedHeader};
use libp2p::identity::Keypair;
use libp2p::swarm::Config as SwarmConfig;
use libp2p::{Multiaddr, PeerId, Swarm, Transport};
use tokio::sync::{mpsc, oneshot};

use crate::behaviour::Behaviour;
use crate::config::RoutingConfig;
use crate::core::{AnnounceError, AnnounceReport, RoutingCore};
use crate::driver::Driver;
use crate::lookup::{LookupError, PartnerQuery, Partners};
use crate::metrics::RoutingMetrics;
use crate::snapshot::SnapshotError;
use crate::store::PacketStore;
use crate::transport::{TransportError, build_transport, relayed_transport};
use crate::wire::{WireCounters, count_bytes};

/// How long [`spawn`] waits for its listeners to report an address.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);

/// Something the node may want to log or act on. Delivered on a bounded channel: when the node
/// does not keep up, further events are dropped (and counted in [`NodeInfo::dropped_events`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RoutingEvent {
    /// A first connection to `peer` was established.
    PeerConnected {
        /// The peer.
        peer: PeerId,
    },
    /// The last connection to `peer` closed.
    PeerDisconnected {
        /// The peer.
        peer: PeerId,
    },
    /// `peer` was banned after sending invalid data.
    PeerBanned {
        /// The peer.
        peer: PeerId,
        /// Ban length.
        duration: Duration,
        /// The offence that tipped it over (a reject reason label).
        reason: &'static str,
    },
    /// The ban of `peer` ended.
    PeerUnbanned {
        /// The peer.
        peer: PeerId,
    },
}

/// One replay high-water mark: the highest round accepted from `sender` for `model`, and the
/// packet accepted for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayMark {
    /// The sender.
    pub sender: PeerId,
    /// The model.
    pub model: ModelId,
    /// The highest round accepted.
    pub round: u64,
    /// The packet accepted for that round.
    pub packet: PacketId,
}

/// A snapshot of the driver's connectivity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// This node.
    pub peer_id: PeerId,
    /// Addresses it listens on.
    pub listen_addrs: Vec<Multiaddr>,
    /// Peers with an open connection.
    pub connected: Vec<PeerId>,
    /// Peers in the Kademlia routing table.
    pub routing_table: usize,
    /// Peers banned now.
    pub banned: Vec<PeerId>,
    /// Events dropped because the event channel was full.
    pub dropped_events: u64,
    /// Kademlia bootstraps that libp2p started on its own and the driver ended early
    /// ([`crate::KadConfig::bootstrap_throttle`]).
    pub bootstraps_cut: u64,
    /// Whether Kademlia runs in server mode (answers other peers' queries). Under
    /// [`crate::KadMode::Auto`] that is once an external address is confirmed.
    pub kad_server: bool,
    /// Addresses confirmed reachable from other peers (the swarm's external addresses).
    pub external_addrs: Vec<Multiaddr>,
    /// Whether other peers can dial this node, from AutoNAT dial-back tests.
    pub reachability: crate::reachability::NatStatus,
    /// Relays this node holds (or asked for) a reservation with: peers reach it through them.
    pub relays: Vec<PeerId>,
    /// Peers with a direct connection open (not through a relay).
    pub direct: Vec<PeerId>,
    /// Peers behind NAT: found with relayed addresses only (their provider records), or
    /// naming a relayed address in identify (they hold a reservation). Never a cohort's hub
    /// while a dialable peer is in it ([`crate::relay_only_rank`]).
    pub relay_only: Vec<PeerId>,
}

/// Why the routing task could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The transport could not be built.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A listen address was refused.
    #[error("cannot listen on {addr}: {reason}")]
    Listen {
        /// The address.
        addr: Multiaddr,
        /// Why.
        reason: String,
    },
    /// A listener reported no address in time.
    #[error("listeners did not report an address within {0:?}")]
    ListenTimeout(Duration),
}

/// Why a dial failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DialError {
    /// The connection could not be established (refused, handshake failed or timed out, wrong
    /// swarm key, banned peer, over the limits...).
    #[error("dial failed: {0}")]
    Failed(String),
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

/// Why a bootstrap failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// The routing table is empty: add or dial a peer first.
    #[error("no known peers to bootstrap from")]
    NoKnownPeers,
    /// The bootstrap query failed.
    #[error("bootstrap failed: {0}")]
    Failed(String),
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

/// A request from a handle to the driver task.
#[derive(Debug)]
pub(crate) enum Command {
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<PeerId, DialError>>,
    },
    AddPeer {
        peer: PeerId,
        addr: Multiaddr,
    },
    Disconnect {
        peer: PeerId,
        reply: oneshot::Sender<bool>,
    },
    Bootstrap {
        reply: oneshot::Sender<Result<(), BootstrapError>>,
    },
    Announce {
        header: Box<VerifiedHeader>,
        reply: oneshot::Sender<Result<AnnounceReport, AnnounceError>>,
    },
    FindPartners {
        query: Box<PartnerQuery>,
        reply: oneshot::Sender<Result<Partners, LookupError>>,
    },
    FetchSnapshot {
        peer: PeerId,
        spec: Arc<ModelSpec>,
        oldest_round: u64,
        reply: oneshot::Sender<Result<OutcomePacket, SnapshotError>>,
    },
    ExchangeCall {
        peer: PeerId,
        call: crate::exchange_rpc::ExchangeCall,
        reply: oneshot::Sender<
            Result<crate::exchange_rpc::ExchangeReply, crate::exchange_rpc::ExchangeError>,
        >,
    },
    ServeExchange {
        capacity: usize,
        reply: oneshot::Sender<mpsc::Receiver<crate::exchange_rpc::InboundExchange>>,
    },
    ReportInvalid {
        peer: PeerId,
        reason: &'static str,
    },
    Metrics {
        reply: oneshot::Sender<RoutingMetrics>,
    },
    Info {
        reply: oneshot::Sender<NodeInfo>,
    },
    ReplayMarks {
        reply: oneshot::Sender<Vec<ReplayMark>>,
    },
    KnownPeers {
        limit: usize,
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    RestoreReplayMarks {
        marks: Vec<ReplayMark>,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
}

/// A cloneable handle to a running routing task. Dropping every handle stops the task.
///
/// Every method sends one command over a bounded channel and awaits the reply. Cancel safety:
/// dropping a returned future abandons the reply, not the work (an announcement or lookup
/// already started runs to completion in the driver).
#[derive(Debug, Clone)]
pub struct RoutingHandle {
    commands: mpsc::Sender<Command>,
    peer_id: PeerId,
    listen_addrs: Vec<Multiaddr>,
}

impl RoutingHandle {
    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// The addresses the node listened on at start-up (port 0 resolved).
    pub fn listen_addrs(&self) -> &[Multiaddr] {
        &self.listen_addrs
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(make(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Connect to `addr`, returning the peer's id once the connection (transport, swarm key,
    /// Noise, yamux) is established.
    ///
    /// # Errors
    /// [`DialError::Failed`] when the connection fails, which with a wrong or missing swarm key
    /// happens within the handshake timeout.
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId, DialError> {
        self.ask(|reply| Command::Dial { addr, reply })
            .await
            .unwrap_or(Err(DialError::Stopped))
    }

    /// Close every connection to `peer` (a request to it later dials it again, as after a
    /// dropped connection); whether one was open.
    pub async fn disconnect(&self, peer: PeerId) -> bool {
        self.ask(|reply| Command::Disconnect { peer, reply })
            .await
            .unwrap_or(false)
    }

    /// Add a known peer address to the routing table (a bootstrap node, say).
    pub async fn add_peer(&self, peer: PeerId, addr: Multiaddr) {
        let _ = self.commands.send(Command::AddPeer { peer, addr }).await;
    }

    /// Join the DHT: look up the node's own id through the known peers (Kademlia's join: the
    /// peers nearest to it learn it and it learns them) and wait for the lookup to finish.
    /// Farther buckets fill from later lookups and libp2p's periodic bootstrap.
    ///
    /// # Errors
    /// [`BootstrapError`] when no peer is known or the query fails.
    pub async fn bootstrap(&self) -> Result<(), BootstrapError> {
        self.ask(|reply| Command::Bootstrap { reply })
            .await
            .unwrap_or(Err(BootstrapError::Stopped))
    }

    /// Announce the node's own packet (already in the store) under its semantic keys for its
    /// round window; resolves once every key is published.
    ///
    /// # Errors
    /// [`AnnounceError`] when the packet is not this node's, its window expired, or the driver
    /// stopped.
    pub async fn announce(&self, header: VerifiedHeader) -> Result<AnnounceReport, AnnounceError> {
        self.ask(|reply| Command::Announce {
            header: Box::new(header),
            reply,
        })
        .await
        .unwrap_or(Err(AnnounceError::Stopped))
    }

    /// Look up partners for the node's packet: ranked verified headers and the verified bodies
    /// of the best `top_m`.
    ///
    /// # Errors
    /// [`LookupError`] when the lookup cannot start; a lookup that started always returns what
    /// it found by its deadline.
    pub async fn find_partners(&self, query: PartnerQuery) -> Result<Partners, LookupError> {
        self.ask(|reply| Command::FindPartners {
            query: Box::new(query),
            reply,
        })
        .await
        .unwrap_or(Err(LookupError::Stopped))
    }

    /// Fetch `peer`'s model snapshot (its cumulative update, sealed with
    /// [`kindred_proto::seal_snapshot`]), verified against `spec`: signed by `peer`, of this
    /// model, from round `oldest_round` or later.
    ///
    /// # Errors
    /// [`SnapshotError`]: the peer has none, refused, sent an invalid or stale one (an invalid
    /// one also costs the peer score), the request failed, or the driver stopped.
    pub async fn fetch_snapshot(
        &self,
        peer: PeerId,
        spec: Arc<ModelSpec>,
        oldest_round: u64,
    ) -> Result<OutcomePacket, SnapshotError> {
        self.ask(|reply| Command::FetchSnapshot {
            peer,
            spec,
            oldest_round,
            reply,
        })
        .await
        .unwrap_or(Err(SnapshotError::Stopped))
    }

    /// Send a hub-exchange call to `peer` ([`crate::exchange_rpc`]): a push, answered at once,
    /// or a merge fetch, whose merge comes back verified (signed by `peer` under the merge
    /// domain, of the spec's model and the round asked).
    ///
    /// # Errors
    /// [`crate::ExchangeError`]: refused, failed (timeout, connection), invalid (the peer was
    /// penalised), or the driver stopped.
    pub async fn exchange_call(
        &self,
        peer: PeerId,
        call: crate::exchange_rpc::ExchangeCall,
    ) -> Result<crate::exchange_rpc::ExchangeReply, crate::exchange_rpc::ExchangeError> {
        self.ask(|reply| Command::ExchangeCall { peer, call, reply })
            .await
            .unwrap_or(Err(crate::exchange_rpc::ExchangeError::Stopped))
    }

    /// Serve the hub exchange from now on: peers' pushes and merge fetches arrive on the
    /// returned channel (at most `capacity` waiting; past that a push is answered busy and a
    /// merge fetch not-ready) for the node to answer. Until this is called, and after the
    /// receiver is dropped, both are refused. `None` when the driver has stopped.
    pub async fn serve_exchange(
        &self,
        capacity: usize,
    ) -> Option<mpsc::Receiver<crate::exchange_rpc::InboundExchange>> {
        self.ask(|reply| Command::ServeExchange { capacity, reply })
            .await
    }

    /// `peer` sent exchange traffic that does not verify (`reason`, a short stable label such
    /// as a [`kindred_proto::DecodeError::reason`]): count it and penalise the peer like one
    /// that sent a bad packet.
    pub async fn report_invalid(&self, peer: PeerId, reason: &'static str) {
        let _ = self
            .commands
            .send(Command::ReportInvalid { peer, reason })
            .await;
    }

    /// A snapshot of the counters.
    ///
    /// # Errors
    /// `None` when the driver has stopped.
    pub async fn metrics(&self) -> Option<RoutingMetrics> {
        self.ask(|reply| Command::Metrics { reply }).await
    }

    /// Connectivity snapshot; `None` when the driver has stopped.
    pub async fn info(&self) -> Option<NodeInfo> {
        self.ask(|reply| Command::Info { reply }).await
    }

    /// The replay high-water marks, for the node to persist (sled) and restore after a restart
    /// with [`RoutingHandle::restore_replay_marks`]; `None` when the driver has stopped.
    pub async fn replay_marks(&self) -> Option<Vec<ReplayMark>> {
        self.ask(|reply| Command::ReplayMarks { reply }).await
    }

    /// Up to `limit` peers of the routing table, connected ones first, each as one dialable
    /// address ending in `/p2p/<peer>`: what the node persists so that after a restart it
    /// rejoins through the peers it knew, even when it was everyone's bootstrap peer or its
    /// own bootstrap peers are gone. `None` when the driver has stopped.
    pub async fn known_peers(&self, limit: usize) -> Option<Vec<Multiaddr>> {
        self.ask(|reply| Command::KnownPeers { limit, reply }).await
    }

    /// Restore persisted replay marks (call before the first lookup after a restart). A mark
    /// never lowers one already held.
    pub async fn restore_replay_marks(&self, marks: Vec<ReplayMark>) {
        let _ = self
            .commands
            .send(Command::RestoreReplayMarks { marks })
            .await;
    }

    /// Stop the routing task and close its connections; resolves once it has stopped.
    pub async fn shutdown(&self) {
        let _ = self.ask(|reply| Command::Shutdown { reply }).await;
    }
}

/// Build the swarm, start listening, and spawn the driver task on the current tokio runtime.
///
/// `keypair` must be the identity that seals the node's packets, so that a packet's sender is
/// the peer that serves it. Returns once every listener has an address.
///
/// # Errors
/// [`SpawnError`] when the transport cannot be built or a listener fails.
pub async fn spawn(
    keypair: Keypair,
    config: RoutingConfig,
    store: Arc<dyn PacketStore>,
) -> Result<(RoutingHandle, mpsc::Receiver<RoutingEvent>), SpawnError> {
    use futures::StreamExt;
    use libp2p::swarm::SwarmEvent;

    let mut config = config;
    let k = config.kad.replication_factor.get();
    if config.core.shards.threshold > k {
        // Kademlia returns at most k providers per response: a larger count is unobservable.
        tracing::warn!(
            threshold = config.core.shards.threshold,
            k,
            "shard threshold above the replication factor; using k"
        );
        config.core.shards.threshold = k;
    }
    let peer_id = keypair.public().to_peer_id();
    let wire = WireCounters::default();
    let relayed_wire = WireCounters::default();
    let (relay_transport, relay_client) = libp2p::relay::client::new(peer_id);
    // Circuits are counted apart: their bytes also cross the connection to the relay, counted
    // there as relay traffic.
    let relayed = count_bytes(
        relayed_transport(
            &keypair,
            relay_transport,
            config.transport.swarm_key,
            config.transport.handshake_timeout,
        )?,
        relayed_wire.clone(),
    );
    let direct = count_bytes(
        build_transport(
            &keypair,
            config.transport.kind,
            config.transport.swarm_key,
            config.transport.handshake_timeout,
        )?,
        wire.clone(),
    );
    // Relay first: it declines every address that is not a circuit as unsupported, so the
    // direct transports get those; the DNS resolver in front of them fails circuit addresses
    // with an error of its own, which would end the dial.
    let transport = relayed
        .or_transport(direct)
        .map(|either, _| either.into_inner())
        .boxed();
    let behaviour = Behaviour::new(&keypair, &config, relay_client);
    let mut swarm = Swarm::new(
        transport,
        behaviour,
        peer_id,
        SwarmConfig::with_tokio_executor()
            .with_idle_connection_timeout(config.transport.idle_timeout),
    );
    let mut listeners = Vec::new();
    for addr in &config.transport.listen {
        if config.transport.swarm_key.is_some() && crate::transport::is_quic(addr) {
            return Err(SpawnError::Listen {
                addr: addr.clone(),
                reason: "a private swarm (swarm key) runs over TCP only: pnet cannot wrap QUIC"
                    .into(),
            });
        }
        let id = swarm
            .listen_on(addr.clone())
            .map_err(|e| SpawnError::Listen {
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
        listeners.push(id);
    }
    for addr in &config.transport.external {
        swarm.add_external_address(addr.clone());
    }
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + LISTEN_TIMEOUT;
    while !listeners.is_empty() {
        let event = tokio::time::timeout_at(deadline, swarm.select_next_some())
            .await
            .map_err(|_| SpawnError::ListenTimeout(LISTEN_TIMEOUT))?;
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                listeners.retain(|l| *l != listener_id);
                if config.transport.listen_addrs_are_external
                    && crate::transport::looks_reachable(&address)
                {
                    swarm.add_external_address(address.clone());
                }
                listen_addrs.push(address);
            }
            SwarmEvent::ListenerClosed {
                addresses, reason, ..
            } => {
                return Err(SpawnError::Listen {
                    addr: addresses.first().cloned().unwrap_or_else(Multiaddr::empty),
                    reason: format!("{reason:?}"),
                });
            }
            SwarmEvent::ListenerError { error, .. } => {
                return Err(SpawnError::Listen {
                    addr: Multiaddr::empty(),
                    reason: error.to_string(),
                });
            }
            other => tracing::trace!(?other, "event before start"),
        }
    }
    let (command_tx, command_rx) = mpsc::channel(config.command_capacity.max(1));
    let (event_tx, event_rx) = mpsc::channel(config.event_capacity.max(1));
    let core = RoutingCore::new(peer_id, config.core.clone());
    let driver = Driver::new(
        swarm,
        core,
        store,
        command_rx,
        event_tx,
        config,
        (wire, relayed_wire),
    );
    tokio::spawn(driver.run());
    Ok((
        RoutingHandle {
            commands: command_tx,
            peer_id,
            listen_addrs,
        },
        event_rx,
    ))
}
