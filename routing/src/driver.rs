//! The tokio driver: owns the libp2p swarm and a [`RoutingCore`], and translates between them.
//!
//! The driver makes no decisions. Swarm events become `handle_*` calls on the core, the core's
//! [`Output`]s become swarm calls, and commands from [`crate::RoutingHandle`]s start core
//! operations whose results are sent back when the matching output appears. One task, one
//! `select!` over commands, swarm events and the core's next deadline.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use kindred_proto::OutcomePacket;
use kindred_proto::rpc::{PushAnswer, RequestId, RpcErrorCode, RpcKind, RpcRequest, RpcResponse};
use libp2p::core::Endpoint;
use libp2p::core::transport::ListenerId;
use libp2p::kad::store::RecordStore;
use libp2p::kad::{self, GetProvidersOk, QueryId, QueryResult, RecordKey};
use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, OutboundFailure, OutboundRequestId};
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionDenied, ConnectionId, ListenError, NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, dcutr, identify, relay};
use tokio::sync::{mpsc, oneshot};

use crate::addr_book::AddrBook;
use crate::behaviour::{Behaviour, BehaviourEvent, KAD_PROTOCOL};
use crate::bootstrap::{BootstrapGovernor, Verdict};
use crate::codec::{CodecError, WireRequest};
use crate::config::{KadMode, RoutingConfig};
use crate::core::{AnnounceError, AnnounceId, AnnounceReport, Output, RequestFailure, RoutingCore};
use crate::exchange_rpc::{
    ExchangeCallId, ExchangeError, ExchangeReply, ExchangeResponder, Inbound, InboundCall,
    InboundExchange, PullId,
};
use crate::handle::{BootstrapError, Command, DialError, NodeInfo, ReplayMark, RoutingEvent};
use crate::identity_gate::{BAD_IDENTITY, IdentityDenied};
use crate::keys::{SemanticKey, dht_key};
use crate::lookup::{LookupError, LookupId, Partners};
use crate::reachability::{NatStatus, Reachability};
use crate::snapshot::{SnapshotError, SnapshotFetchId};
use crate::store::PacketStore;
use crate::wire::WireCounters;

/// Listen addresses taken from one identify message.
const MAX_IDENTIFY_ADDRS: usize = 16;
/// Providers whose addresses are kept for their header requests (several lookups' worth).
const ADDR_BOOK_PEERS: usize = 8192;
/// Relays a node that peers cannot dial keeps a reservation with.
const MAX_RESERVATIONS: usize = 2;
/// Relays remembered as candidates for a reservation.
const MAX_RELAYS: usize = 16;
/// Pause before a relay whose reservation ended is asked again.
const RESERVATION_RETRY: std::time::Duration = std::time::Duration::from_secs(30);
/// Peers remembered as met through a relay.
const MAX_VIA_RELAY: usize = 4096;
/// The relay v2 hop protocol: a peer that lists it in identify serves reservations.
const RELAY_HOP_PROTOCOL: &str = "/libp2p/circuit/relay/0.2.0/hop";

#[derive(Debug, Clone, Copy)]
enum QueryCtx {
    Provide(AnnounceId),
    Providers(LookupId, SemanticKey),
    Bootstrap,
}

pub(crate) struct Driver {
    swarm: Swarm<Behaviour>,
    core: RoutingCore,
    store: Arc<dyn PacketStore>,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<RoutingEvent>,
    config: RoutingConfig,
    queries: HashMap<QueryId, QueryCtx>,
    lookup_queries: HashMap<LookupId, HashMap<SemanticKey, QueryId>>,
    requests: HashMap<OutboundRequestId, RequestId>,
    announce_replies: HashMap<AnnounceId, oneshot::Sender<Result<AnnounceReport, AnnounceError>>>,
    lookup_replies: HashMap<LookupId, oneshot::Sender<Result<Partners, LookupError>>>,
    snapshot_replies:
        HashMap<SnapshotFetchId, oneshot::Sender<Result<OutcomePacket, SnapshotError>>>,
    exchange_replies:
        HashMap<ExchangeCallId, oneshot::Sender<Result<ExchangeReply, ExchangeError>>>,
    /// Where peers' exchange requests go ([`crate::RoutingHandle::serve_exchange`]).
    exchange_sink: Option<mpsc::Sender<InboundExchange>>,
    /// Inbound exchange requests the node has yet to answer: each resolves to the response
    /// channel, the peer and the node's answer (`None`: dropped unanswered).
    answering: FuturesUnordered<BoxFuture<'static, Answering>>,
    /// Pushes held while their bodies are pulled ([`Inbound::Pull`]).
    pulling: HashMap<
        PullId,
        (
            request_response::ResponseChannel<RpcResponse>,
            PeerId,
            RequestId,
            RpcKind,
        ),
    >,
    dials: HashMap<ConnectionId, oneshot::Sender<Result<PeerId, DialError>>>,
    bootstraps: HashMap<QueryId, oneshot::Sender<Result<(), BootstrapError>>>,
    /// Which of libp2p's own bootstraps run ([`crate::bootstrap`]).
    bootstrap_governor: BootstrapGovernor<QueryId>,
    addr_book: AddrBook,
    dropped_events: u64,
    /// Byte counters of every connection, by protocol ([`crate::wire::count_bytes`]).
    wire: WireCounters,
    /// The same, of the connections through relays only.
    relayed_wire: WireCounters,
    /// NAT traversal: relays known, reservations held, hole punches.
    nat: NatTraversal,
}

/// What the driver knows and holds to be reachable behind NAT.
#[derive(Debug, Default)]
struct NatTraversal {
    /// The remote address of each outbound direct connection: where a relay was reached.
    dialed: HashMap<ConnectionId, Multiaddr>,
    /// Relays that said so in identify, each with the address this node reached it at.
    relays: HashMap<PeerId, Multiaddr>,
    /// The listener of each relay reservation asked for or held.
    reservations: HashMap<PeerId, ListenerId>,
    /// Relays whose reservation ended, and when to ask them again.
    retry_at: HashMap<PeerId, Instant>,
    /// Peers met through a relay (bounded: cleared when full): never asked for AutoNAT
    /// dial-backs, which would pass through the hole punched with them.
    via_relay: HashSet<PeerId>,
    /// Peers whose identify named a relayed address: they hold a reservation, so they found
    /// themselves behind NAT (bounded: cleared when full).
    behind_relay: HashSet<PeerId>,
    reservations_accepted: u64,
    hole_punches: u64,
    hole_punch_failures: u64,
    /// A digest of the swarm's external addresses when last changed: a change means the
    /// node's provider records carry stale addresses ([`RoutingCore::addresses_changed`]).
    external: u64,
    /// This node's probes, which settle AutoNAT's verdict ([`Reachability`]).
    probes: Reachability,
    /// The settled verdict the node acts on and reports.
    reachability: NatStatus,
}

impl Driver {
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        core: RoutingCore,
        store: Arc<dyn PacketStore>,
        commands: mpsc::Receiver<Command>,
        events: mpsc::Sender<RoutingEvent>,
        config: RoutingConfig,
        (wire, relayed_wire): (WireCounters, WireCounters),
    ) -> Self {
        let bootstrap_governor = BootstrapGovernor::new(config.kad.bootstrap_throttle);
        Self {
            swarm,
            core,
            store,
            commands,
            events,
            config,
            queries: HashMap::new(),
            lookup_queries: HashMap::new(),
            requests: HashMap::new(),
            announce_replies: HashMap::new(),
            lookup_replies: HashMap::new(),
            snapshot_replies: HashMap::new(),
            exchange_replies: HashMap::new(),
            exchange_sink: None,
            answering: FuturesUnordered::new(),
            pulling: HashMap::new(),
            dials: HashMap::new(),
            bootstraps: HashMap::new(),
            bootstrap_governor,
            addr_book: AddrBook::new(ADDR_BOOK_PEERS),
            dropped_events: 0,
            wire,
            relayed_wire,
            nat: NatTraversal::default(),
        }
    }

    pub(crate) async fn run(mut self) {
        let mut shutdown = None;
        loop {
            let deadline = self.core.poll_timeout();
            let sleep = async move {
                match deadline {
                    Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
                    None => futures::future::pending().await,
                }
            };
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown { reply }) => {
                        shutdown = Some(reply);
                        break;
                    }
                    Some(command) => self.on_command(command),
                    None => break,
                },
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                Some((channel, peer, kind, response)) = self.answering.next(),
                    if !self.answering.is_empty() => self.send_answer(channel, peer, kind, response),
                () = sleep => self.core.handle_timeout(Instant::now()),
            }
            self.drain_outputs();
        }
        tracing::debug!(peer = %self.core.local_peer(), "routing driver stopped");
        drop(self.swarm);
        if let Some(reply) = shutdown {
            let _ = reply.send(());
        }
    }

    fn emit(&mut self, event: RoutingEvent) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.events.try_send(event) {
            self.dropped_events += 1;
        }
    }

    fn on_command(&mut self, command: Command) {
        let now = Instant::now();
        match command {
            Command::Dial { addr, reply } => {
                let opts = DialOpts::unknown_peer_id().address(addr).build();
                let id = opts.connection_id();
                match self.swarm.dial(opts) {
                    Ok(()) => {
                        self.dials.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(DialError::Failed(e.to_string())));
                    }
                }
            }
            Command::Disconnect { peer, reply } => {
                let _ = reply.send(self.swarm.disconnect_peer_id(peer).is_ok());
            }
            Command::AddPeer { peer, addr } => {
                self.swarm
                    .behaviour_mut()
                    .kad
                    .add_address(&peer, addr.clone());
                self.swarm.add_peer_address(peer, addr);
            }
            Command::Bootstrap { reply } => {
                // Kademlia's join: a lookup of the node's own id. The peers nearest to it learn
                // it and it learns them; farther buckets fill from the node's lookups and
                // libp2p's periodic bootstrap ([`crate::bootstrap`]).
                let me = *self.swarm.local_peer_id();
                let kad = &mut self.swarm.behaviour_mut().kad;
                if kad.kbuckets().all(|b| b.num_entries() == 0) {
                    let _ = reply.send(Err(BootstrapError::NoKnownPeers));
                } else {
                    let id = kad.get_n_closest_peers(me, self.config.kad.replication_factor);
                    self.queries.insert(id, QueryCtx::Bootstrap);
                    self.bootstrap_governor.on_join(now);
                    self.bootstraps.insert(id, reply);
                }
            }
            Command::Announce { header, reply } => match self.core.announce(&header, now) {
                Ok(id) => {
                    self.announce_replies.insert(id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::FindPartners { query, reply } => match self.core.start_lookup(*query, now) {
                Ok(id) => {
                    self.lookup_replies.insert(id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::FetchSnapshot {
                peer,
                spec,
                oldest_round,
                reply,
            } => {
                let fetch = self.core.fetch_snapshot(peer, spec, oldest_round, now);
                self.snapshot_replies.insert(fetch, reply);
            }
            Command::ExchangeCall { peer, call, reply } => {
                let id = self.core.exchange_call(peer, call, now);
                self.exchange_replies.insert(id, reply);
            }
            Command::ServeExchange { capacity, reply } => {
                let (tx, rx) = mpsc::channel(capacity.max(1));
                self.exchange_sink = Some(tx);
                let _ = reply.send(rx);
            }
            Command::ReportInvalid { peer, reason } => {
                self.core.report_invalid(peer, reason, now);
                self.drain_outputs();
            }
            Command::Metrics { reply } => {
                let mut metrics = self.core.metrics().clone();
                metrics.wire = self.wire.snapshot();
                (metrics.wire_bytes_in, metrics.wire_bytes_out) = metrics.wire.total();
                metrics.relayed_wire = self.relayed_wire.snapshot();
                let (direct, relayed) = self.swarm.behaviour().rpc.connection_counts();
                metrics.connections_direct = direct as u64;
                metrics.connections_relayed = relayed as u64;
                metrics.relay_reservations = self.nat.reservations_accepted;
                metrics.hole_punches = self.nat.hole_punches;
                metrics.hole_punch_failures = self.nat.hole_punch_failures;
                let _ = reply.send(metrics);
            }
            Command::Info { reply } => {
                let routing_table = self.routing_table_len();
                let info = NodeInfo {
                    peer_id: *self.swarm.local_peer_id(),
                    listen_addrs: self.swarm.listeners().cloned().collect(),
                    connected: self.swarm.connected_peers().copied().collect(),
                    routing_table,
                    banned: self.core.scores().banned(now).copied().collect(),
                    dropped_events: self.dropped_events,
                    bootstraps_cut: self.bootstrap_governor.cut_total(),
                    kad_server: self.swarm.behaviour().kad.mode() == kad::Mode::Server,
                    external_addrs: self.swarm.external_addresses().cloned().collect(),
                    reachability: self.nat.reachability,
                    relays: self.nat.reservations.keys().copied().collect(),
                    direct: self.swarm.behaviour().rpc.direct_peers().collect(),
                    relay_only: self
                        .addr_book
                        .relay_only()
                        .chain(self.nat.behind_relay.iter().copied())
                        .collect::<HashSet<_>>()
                        .into_iter()
                        .collect(),
                };
                let _ = reply.send(info);
            }
            Command::ReplayMarks { reply } => {
                let marks = self
                    .core
                    .replay()
                    .marks()
                    .map(|(sender, model, round, packet)| ReplayMark {
                        sender: *sender,
                        model: *model,
                        round,
                        packet,
                    })
                    .collect();
                let _ = reply.send(marks);
            }
            Command::KnownPeers { limit, reply } => {
                let _ = reply.send(self.known_peers(limit));
            }
            Command::RestoreReplayMarks { marks } => {
                let replay = self.core.replay_mut();
                for m in marks {
                    replay.restore(m.sender, m.model, m.round, m.packet);
                }
            }
            Command::Shutdown { reply } => {
                // Handled in `run`.
                let _ = reply.send(());
            }
        }
    }

    /// Carry out every pending output of the core.
    fn drain_outputs(&mut self) {
        let now = Instant::now();
        while let Some(output) = self.core.poll_output() {
            match output {
                Output::StartProviding { announce, key } => {
                    match self
                        .swarm
                        .behaviour_mut()
                        .kad
                        .start_providing(RecordKey::new(&dht_key(&key)))
                    {
                        Ok(id) => {
                            self.queries.insert(id, QueryCtx::Provide(announce));
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot store own provider record");
                            self.core.handle_provide_result(announce, false, 0);
                        }
                    }
                }
                Output::StopProviding { key } => {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .stop_providing(&RecordKey::new(&dht_key(&key)));
                }
                Output::GetProviders { lookup, key } => {
                    let id = self
                        .swarm
                        .behaviour_mut()
                        .kad
                        .get_providers(RecordKey::new(&dht_key(&key)));
                    self.queries.insert(id, QueryCtx::Providers(lookup, key));
                    self.lookup_queries
                        .entry(lookup)
                        .or_default()
                        .insert(key, id);
                }
                Output::ProviderFound { peer, key } => {
                    if !self.swarm.is_connected(&peer) {
                        // Addresses from a provider record this node holds itself, plus those
                        // Kademlia learned for its running queries (asked now, while the query
                        // that found the provider still runs), kept for the header request.
                        // Kademlia's answer reads only the peer id: the connection id and role
                        // passed are placeholders, and nothing is dialled.
                        let behaviour = self.swarm.behaviour_mut();
                        let stored: Vec<_> = behaviour
                            .kad
                            .store_mut()
                            .providers(&RecordKey::new(&dht_key(&key)))
                            .into_iter()
                            .filter(|r| r.provider == peer)
                            .flat_map(|r| r.addresses)
                            .collect();
                        let learned = NetworkBehaviour::handle_pending_outbound_connection(
                            &mut behaviour.kad,
                            ConnectionId::new_unchecked(0),
                            Some(peer),
                            &[],
                            Endpoint::Dialer,
                        )
                        .unwrap_or_default();
                        self.addr_book
                            .insert(peer, stored.into_iter().chain(learned));
                    }
                }
                Output::FinishProviderLookup { lookup, key } => {
                    let id = self
                        .lookup_queries
                        .get(&lookup)
                        .and_then(|keys| keys.get(&key))
                        .copied();
                    if let Some(id) = id
                        && let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id)
                    {
                        q.finish();
                    }
                }
                Output::SendRequest { peer, request } => {
                    let known = self.addr_book.get(&peer);
                    if !known.is_empty() && !self.swarm.is_connected(&peer) {
                        // Dial with the addresses noted when the peer was found; the request
                        // below waits for this connection (a dial under way makes its own a
                        // no-op).
                        let opts = DialOpts::peer_id(peer)
                            .addresses(known.to_vec())
                            .extend_addresses_through_behaviour()
                            .condition(PeerCondition::DisconnectedAndNotDialing)
                            .build();
                        if let Err(e) = self.swarm.dial(opts) {
                            tracing::trace!(%peer, error = %e, "provider dial not started");
                        }
                    }
                    let id = request.id();
                    let out = self
                        .swarm
                        .behaviour_mut()
                        .rpc
                        .inner_mut()
                        .send_request(&peer, request.into());
                    self.requests.insert(out, id);
                }
                Output::Ban {
                    peer,
                    until,
                    reason,
                } => {
                    let behaviour = self.swarm.behaviour_mut();
                    behaviour.blocked.block_peer(peer);
                    behaviour.kad.remove_peer(&peer);
                    self.emit(RoutingEvent::PeerBanned {
                        peer,
                        duration: until.saturating_duration_since(now),
                        reason,
                    });
                }
                Output::Unban { peer } => {
                    self.swarm.behaviour_mut().blocked.unblock_peer(peer);
                    self.emit(RoutingEvent::PeerUnbanned { peer });
                }
                Output::AnnounceFinished { announce, report } => {
                    if let Some(reply) = self.announce_replies.remove(&announce) {
                        let _ = reply.send(Ok(report));
                    }
                }
                Output::LookupFinished { lookup, partners } => {
                    // Stop DHT queries still running for it (a lookup cut short by its deadline).
                    for id in self
                        .lookup_queries
                        .remove(&lookup)
                        .unwrap_or_default()
                        .into_values()
                    {
                        if self.queries.remove(&id).is_some()
                            && let Some(mut q) = self.swarm.behaviour_mut().kad.query_mut(&id)
                        {
                            q.finish();
                        }
                    }
                    if let Some(reply) = self.lookup_replies.remove(&lookup) {
                        let _ = reply.send(Ok(*partners));
                    }
                }
                Output::SnapshotFetched { fetch, result } => {
                    if let Some(reply) = self.snapshot_replies.remove(&fetch) {
                        let _ = reply.send(result.map(|s| *s));
                    }
                }
                Output::ExchangeDone { call, result } => {
                    if let Some(reply) = self.exchange_replies.remove(&call) {
                        let _ = reply.send(result);
                    }
                }
                Output::PushPulled { pull, call } => {
                    if let Some((channel, peer, id, kind)) = self.pulling.remove(&pull) {
                        match call {
                            Some(call) => self.hand_to_node(peer, id, kind, call, channel),
                            None => {
                                let busy = RpcResponse::PushAnswer {
                                    id,
                                    answer: PushAnswer::Busy,
                                };
                                self.send_answer(channel, peer, kind, Some(busy));
                            }
                        }
                    }
                }
            }
        }
    }

    /// Applies [`crate::bootstrap`]'s policy to the bootstraps in libp2p's query pool. Runs after
    /// every swarm event, so a cut bootstrap's later steps end before they send anything.
    fn govern_bootstraps(&mut self) {
        let now = Instant::now();
        let kad = &mut self.swarm.behaviour_mut().kad;
        let bootstraps: Vec<QueryId> = kad
            .iter_queries()
            .filter(|q| matches!(q.info(), kad::QueryInfo::Bootstrap { .. }))
            .map(|q| q.id())
            .collect();
        for id in bootstraps {
            match self.bootstrap_governor.on_seen(id, now) {
                Verdict::Run => {
                    self.queries.entry(id).or_insert(QueryCtx::Bootstrap);
                }
                Verdict::Cut => {
                    if let Some(mut query) = kad.query_mut(&id) {
                        query.finish();
                    }
                }
            }
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        self.on_swarm_event_inner(event);
        self.govern_bootstraps();
        self.reserve_relays();
    }

    /// The swarm's external addresses may have changed (a behaviour confirmed or expired one,
    /// or the driver added a listen address): if they did, the next announcement publishes
    /// every key again, since the records so far name the old addresses (or none, before a
    /// relay reservation). Compared by digest: a behaviour may confirm an address it
    /// confirmed before.
    fn external_addresses_touched(&mut self) {
        let digest = self
            .swarm
            .external_addresses()
            .map(|a| {
                let mut h = std::hash::DefaultHasher::new();
                std::hash::Hash::hash(a, &mut h);
                std::hash::Hasher::finish(&h)
            })
            .fold(0u64, u64::wrapping_add);
        if digest != self.nat.external {
            self.nat.external = digest;
            tracing::debug!(
                addresses = self.swarm.external_addresses().count(),
                "external addresses changed: the next announcement publishes every key again"
            );
            self.core.addresses_changed();
        }
    }

    fn on_swarm_event_inner(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => self.on_kad(*e),
            SwarmEvent::Behaviour(BehaviourEvent::Rpc(e)) => self.on_rpc(e),
            SwarmEvent::Behaviour(BehaviourEvent::Identify(e)) => {
                if let identify::Event::Received {
                    peer_id,
                    info,
                    connection_id,
                } = *e
                {
                    if info
                        .protocols
                        .iter()
                        .any(|p| p.as_ref() == RELAY_HOP_PROTOCOL)
                    {
                        self.learn_relay(peer_id, connection_id);
                    }
                    if info.listen_addrs.iter().any(crate::direct_only::is_relayed) {
                        if self.nat.behind_relay.len() >= MAX_VIA_RELAY {
                            self.nat.behind_relay.clear();
                        }
                        self.nat.behind_relay.insert(peer_id);
                    } else {
                        self.nat.behind_relay.remove(&peer_id);
                    }
                    if !self.nat.via_relay.contains(&peer_id) {
                        // A dial-back server (see `crate::reachability`).
                        self.swarm.behaviour_mut().autonat.add_server(peer_id, None);
                    }
                    if info.protocols.contains(&KAD_PROTOCOL) {
                        for addr in info.listen_addrs.into_iter().take(MAX_IDENTIFY_ADDRS) {
                            self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                        }
                    }
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::RelayClient(e)) => self.on_relay_client(e),
            SwarmEvent::Behaviour(BehaviourEvent::RelayServer(e)) => on_relay_server(&e),
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(e)) => self.on_dcutr(e),
            SwarmEvent::Behaviour(BehaviourEvent::Autonat(e)) => self.on_autonat(e),
            SwarmEvent::Behaviour(BehaviourEvent::Upnp(e)) => match e {
                libp2p::upnp::Event::NewExternalAddr {
                    local_addr,
                    external_addr,
                } => {
                    tracing::info!(%local_addr, %external_addr, "UPnP: the gateway forwards a port")
                }
                libp2p::upnp::Event::ExpiredExternalAddr {
                    local_addr,
                    external_addr,
                } => tracing::warn!(
                    %local_addr, %external_addr,
                    "UPnP: the gateway stopped forwarding a port"
                ),
                libp2p::upnp::Event::GatewayNotFound => {
                    tracing::info!("UPnP: no gateway answered (is UPnP on in the router?)");
                }
                libp2p::upnp::Event::NonRoutableGateway => tracing::warn!(
                    "UPnP: the gateway is not on the public internet (a NAT behind a NAT): no \
                     port mapped"
                ),
            },
            SwarmEvent::Behaviour(_) => {}
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                num_established,
                endpoint,
                ..
            } => {
                if let libp2p::core::ConnectedPoint::Dialer { address, .. } = &endpoint
                    && !endpoint.is_relayed()
                {
                    self.nat.dialed.insert(connection_id, address.clone());
                }
                if endpoint.is_relayed() {
                    if self.nat.via_relay.len() >= MAX_VIA_RELAY {
                        self.nat.via_relay.clear();
                    }
                    self.nat.via_relay.insert(peer_id);
                    self.swarm.behaviour_mut().autonat.remove_server(&peer_id);
                }
                if let Some(reply) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Ok(peer_id));
                }
                if num_established.get() == 1 {
                    self.emit(RoutingEvent::PeerConnected { peer: peer_id });
                }
            }
            SwarmEvent::IncomingConnectionError {
                error: ListenError::Denied { cause },
                ..
            } => self.note_denied(&cause),
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                error,
                ..
            } => {
                if let libp2p::swarm::DialError::Denied { cause } = &error {
                    self.note_denied(cause);
                }
                if let Some(reply) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Err(DialError::Failed(error.to_string())));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                self.nat.dialed.remove(&connection_id);
                if num_established == 0 {
                    self.swarm.behaviour_mut().autonat.remove_server(&peer_id);
                    self.emit(RoutingEvent::PeerDisconnected { peer: peer_id });
                }
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                let closed = self
                    .nat
                    .reservations
                    .iter()
                    .find(|(_, l)| **l == listener_id)
                    .map(|(p, _)| *p);
                if let Some(relay) = closed {
                    // Asked again after a pause (the relay restarting, or refusing for now).
                    self.nat.reservations.remove(&relay);
                    self.nat
                        .retry_at
                        .insert(relay, Instant::now() + RESERVATION_RETRY);
                    tracing::info!(%relay, ?reason, "relay: reservation ended");
                }
            }
            SwarmEvent::NewListenAddr { address, .. }
                if self.config.transport.listen_addrs_are_external
                    && crate::transport::looks_reachable(&address) =>
            {
                self.swarm.add_external_address(address);
                self.external_addresses_touched();
            }
            SwarmEvent::ExternalAddrConfirmed { .. } | SwarmEvent::ExternalAddrExpired { .. } => {
                self.external_addresses_touched();
            }
            _ => {}
        }
    }

    /// `peer` serves relay reservations: a candidate, at the address this node dialed it at.
    fn learn_relay(&mut self, peer: PeerId, connection: ConnectionId) {
        let Some(addr) = self.nat.dialed.get(&connection) else {
            return;
        };
        if self.nat.relays.len() >= MAX_RELAYS && !self.nat.relays.contains_key(&peer) {
            return;
        }
        let addr = addr
            .iter()
            .filter(|p| !matches!(p, Protocol::P2p(_)))
            .collect::<Multiaddr>();
        self.nat.relays.insert(peer, addr);
        self.reserve_relays();
    }

    /// While peers cannot dial this node, hold reservations with up to [`MAX_RESERVATIONS`]
    /// relays, so that it has a circuit address for peers to reach it by and punch a hole
    /// from, and keep Kademlia in client mode (the circuit address would make it a server,
    /// and its DHT answers would cross relays); once they can, give them up.
    fn on_reachability(&mut self) {
        let private = self.is_private();
        if self.config.kad.mode == KadMode::Auto {
            let mode = private.then_some(kad::Mode::Client);
            self.swarm.behaviour_mut().kad.set_mode(mode);
        }
        if private {
            self.reserve_relays();
        } else {
            for (relay, listener) in self.nat.reservations.drain() {
                tracing::info!(%relay, "relay: reservation given up (peers dial this node)");
                self.swarm.remove_listener(listener);
            }
        }
    }

    fn is_private(&self) -> bool {
        self.nat.reachability == NatStatus::Private
    }

    /// While private, ask relays for reservations up to [`MAX_RESERVATIONS`] (a relay whose
    /// reservation ended is asked again after [`RESERVATION_RETRY`]). Cheap when there is
    /// nothing to do: it runs after every swarm event.
    fn reserve_relays(&mut self) {
        if self.nat.reservations.len() >= MAX_RESERVATIONS
            || self.nat.relays.len() <= self.nat.reservations.len()
            || !self.is_private()
        {
            return;
        }
        let now = Instant::now();
        self.nat.retry_at.retain(|_, at| *at > now);
        let wanted: Vec<(PeerId, Multiaddr)> = self
            .nat
            .relays
            .iter()
            .filter(|(p, _)| {
                !self.nat.reservations.contains_key(p) && !self.nat.retry_at.contains_key(p)
            })
            .take(MAX_RESERVATIONS.saturating_sub(self.nat.reservations.len()))
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        for (relay, addr) in wanted {
            let circuit = addr.with(Protocol::P2p(relay)).with(Protocol::P2pCircuit);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    tracing::info!(%circuit, "relay: asking for a reservation");
                    self.nat.reservations.insert(relay, listener);
                }
                Err(e) => {
                    tracing::warn!(%circuit, error = %e, "relay: cannot listen through it");
                    self.nat.relays.remove(&relay);
                }
            }
        }
    }

    fn on_relay_client(&mut self, e: relay::client::Event) {
        match e {
            relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            } => {
                if !renewal {
                    self.nat.reservations_accepted += 1;
                    tracing::info!(relay = %relay_peer_id,
                        "relay: reservation accepted; peers reach this node through it to punch a hole");
                }
            }
            other => tracing::debug!(event = ?other, "relay client"),
        }
    }

    fn on_dcutr(&mut self, e: dcutr::Event) {
        match e.result {
            Ok(_) => {
                self.nat.hole_punches += 1;
                tracing::info!(peer = %e.remote_peer_id, "hole punched: a direct connection beside the relayed one");
            }
            Err(error) => {
                self.nat.hole_punch_failures += 1;
                tracing::info!(peer = %e.remote_peer_id, %error,
                    "hole punch failed: no direct connection (exchange RPCs to it fail)");
                let peer = e.remote_peer_id;
                self.swarm.behaviour_mut().rpc.give_up(&peer);
                // DCUtR does not try a relayed connection again, and a circuit lasts minutes:
                // closed, the next request to the peer opens a fresh one and punches anew
                // (two peers that dialed each other through the relay at once, each punching
                // over its own circuit, can fail every attempt).
                if !self.swarm.behaviour().rpc.is_direct(&peer) {
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
            }
        }
    }

    /// An AutoNAT probe finished (either role), or AutoNAT's verdict on this node changed: the
    /// node acts on that verdict as its probes settle it ([`Reachability`]).
    fn on_autonat(&mut self, e: libp2p::autonat::Event) {
        use libp2p::autonat::{Event, OutboundProbeError, OutboundProbeEvent, ResponseError};
        match &e {
            Event::OutboundProbe(OutboundProbeEvent::Response { .. }) => {
                self.nat.probes.probe(true);
            }
            Event::OutboundProbe(OutboundProbeEvent::Error {
                error: OutboundProbeError::Response(ResponseError::DialError),
                ..
            }) => self.nat.probes.probe(false),
            _ => {}
        }
        tracing::debug!(event = ?e, "AutoNAT");
        let autonat = self.swarm.behaviour().autonat.nat_status();
        let was = self.nat.reachability;
        let status = self.nat.probes.settled(NatStatus::from(&autonat));
        if status == was {
            if NatStatus::from(&autonat) != status {
                tracing::debug!(
                    %status, autonat = %NatStatus::from(&autonat),
                    "reachability: a probe failed; held until more fail in a row"
                );
            }
            return;
        }
        self.nat.reachability = status;
        self.on_reachability();
        match (status, &autonat) {
            (NatStatus::Public, libp2p::autonat::NatStatus::Public(addr)) => tracing::info!(
                %status, %addr, %was,
                "reachability: peers dialled this node back"
            ),
            (NatStatus::Public, _) => tracing::info!(%status, %was, "reachability: public again"),
            (NatStatus::Private, _) => tracing::info!(
                %status, %was,
                "reachability: peers could not dial this node back (behind NAT or a firewall: \
                 forward the listen port)"
            ),
            (NatStatus::Unknown, _) => tracing::info!(%status, %was, "reachability: unknown"),
        }
    }

    /// Count a connection the identity gate refused (other denials are the ban list's or the
    /// limits', already accounted for).
    fn note_denied(&mut self, cause: &ConnectionDenied) {
        if let Some(denied) = cause.downcast_ref::<IdentityDenied>() {
            self.core
                .reject(&denied.peer, BAD_IDENTITY, None, Instant::now());
        }
    }

    fn on_kad(&mut self, event: kad::Event) {
        let now = Instant::now();
        let kad::Event::OutboundQueryProgressed {
            id,
            result,
            stats,
            step,
        } = event
        else {
            return;
        };
        if step.last && matches!(result, QueryResult::Bootstrap(_)) {
            self.bootstrap_governor.on_done(id);
        }
        let Some(&ctx) = self.queries.get(&id) else {
            return;
        };
        match (ctx, result) {
            (QueryCtx::Providers(lookup, key), QueryResult::GetProviders(result)) => {
                if let Ok(GetProvidersOk::FoundProviders { providers, .. }) = result {
                    self.core.handle_providers(lookup, key, providers, now);
                    let whole_table = self.routing_table_len() < kad::K_VALUE.get();
                    self.core
                        .handle_walk_progress(lookup, key, stats.num_successes(), whole_table);
                }
                if step.last {
                    self.queries.remove(&id);
                    self.core
                        .handle_key_lookup_done(lookup, key, stats.num_requests(), now);
                }
            }
            (QueryCtx::Provide(announce), QueryResult::StartProviding(result)) => {
                if step.last {
                    self.queries.remove(&id);
                    if let Err(e) = &result {
                        tracing::debug!(error = %e, "provider record not stored remotely");
                    }
                    self.core
                        .handle_provide_result(announce, result.is_ok(), stats.num_requests());
                }
            }
            (QueryCtx::Bootstrap, QueryResult::GetClosestPeers(result)) => {
                tracing::debug!(
                    requests = stats.num_requests(),
                    failures = stats.num_failures(),
                    duration = ?stats.duration(),
                    found = result.as_ref().map_or(0, |ok| ok.peers.len()),
                    "join lookup done"
                );
                if step.last {
                    self.bootstrap_done(id, result.map(|_| ()).map_err(|e| e.to_string()));
                }
            }
            (QueryCtx::Bootstrap, QueryResult::Bootstrap(result)) => {
                tracing::debug!(
                    requests = stats.num_requests(),
                    failures = stats.num_failures(),
                    duration = ?stats.duration(),
                    last = step.last,
                    "bootstrap step"
                );
                let done = step.last || result.as_ref().map_or(true, |ok| ok.num_remaining == 0);
                if done {
                    self.bootstrap_done(id, result.map(|_| ()).map_err(|e| e.to_string()));
                }
            }
            (ctx, other) => {
                tracing::debug!(?ctx, ?other, "unexpected query result");
                if step.last {
                    self.queries.remove(&id);
                }
            }
        }
    }

    /// Peers in the Kademlia routing table.
    fn routing_table_len(&mut self) -> usize {
        self.swarm
            .behaviour_mut()
            .kad
            .kbuckets()
            .map(|b| b.num_entries())
            .sum()
    }

    /// Up to `limit` routing-table peers, connected first, each with the first (oldest)
    /// address Kademlia holds for it, as `<addr>/p2p/<peer>`.
    fn known_peers(&mut self, limit: usize) -> Vec<Multiaddr> {
        let mut peers: Vec<(bool, Multiaddr)> = Vec::new();
        for bucket in self.swarm.behaviour_mut().kad.kbuckets() {
            for entry in bucket.iter() {
                let peer = *entry.node.key.preimage();
                let Some(addr) = entry.node.value.iter().next() else {
                    continue;
                };
                if let Ok(addr) = addr.clone().with_p2p(peer) {
                    let connected = entry.status == kad::NodeStatus::Connected;
                    peers.push((connected, addr));
                }
            }
        }
        // Stable: within each group, the routing table's order (nearest buckets first).
        peers.sort_by_key(|(connected, _)| !connected);
        peers.into_iter().take(limit).map(|(_, a)| a).collect()
    }

    /// A bootstrap query ended: answer whoever asked for it.
    fn bootstrap_done(&mut self, id: QueryId, result: Result<(), String>) {
        self.queries.remove(&id);
        if let Some(reply) = self.bootstraps.remove(&id) {
            let _ = reply.send(result.map_err(BootstrapError::Failed));
        }
    }

    fn on_rpc(&mut self, event: request_response::Event<WireRequest, kindred_proto::RpcResponse>) {
        let now = Instant::now();
        match event {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request: WireRequest::Invalid(error),
                    channel,
                    ..
                } => {
                    // Scored like a bad response; dropping the channel answers nothing and closes
                    // the stream.
                    self.core.handle_bad_request(peer, error.reason(), now);
                    drop(channel);
                }
                request_response::Message::Request {
                    request:
                        WireRequest::Valid(
                            request @ (RpcRequest::Push { .. } | RpcRequest::GetMerge { .. }),
                        ),
                    channel,
                    ..
                } => self.on_exchange_request(peer, request, channel, now),
                request_response::Message::Request {
                    request: WireRequest::Valid(request),
                    channel,
                    ..
                } => {
                    let response = self.core.handle_request(peer, &request, &*self.store, now);
                    if self
                        .swarm
                        .behaviour_mut()
                        .rpc
                        .inner_mut()
                        .send_response(channel, response)
                        .is_err()
                    {
                        tracing::debug!(%peer, "requester went away before the response");
                    }
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some(id) = self.requests.remove(&request_id) {
                        self.core.handle_response(peer, id, Ok(response), now);
                    }
                }
            },
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                if let Some(id) = self.requests.remove(&request_id) {
                    self.core
                        .handle_response(peer, id, Err(outbound_failure(&error)), now);
                }
            }
            // Undecodable and oversize requests arrive as `WireRequest::Invalid` above; what is
            // left here (a timeout, a closed connection, a failed write of our response) is not
            // evidence against the peer.
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, %error, "inbound request failed");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
    }
}

/// An inbound exchange request being answered by the node.
type Answering = (
    request_response::ResponseChannel<RpcResponse>,
    PeerId,
    RpcKind,
    Option<RpcResponse>,
);

impl Driver {
    /// A peer's push or merge fetch: to the node if it serves the exchange (answered when its
    /// [`ExchangeResponder`] is used), refused otherwise.
    fn on_exchange_request(
        &mut self,
        peer: PeerId,
        request: RpcRequest,
        channel: request_response::ResponseChannel<RpcResponse>,
        now: Instant,
    ) {
        let serving = self.exchange_sink.as_ref().is_some_and(|s| !s.is_closed());
        let id = request.id();
        let kind = request.kind();
        let call = match self.core.exchange_request(peer, request, serving, now) {
            Inbound::Call(call) => call,
            Inbound::Respond(response) => {
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .rpc
                    .inner_mut()
                    .send_response(channel, response);
                return;
            }
            Inbound::Drop => return,
            // Held until the body is whole ([`Output::PushPulled`]).
            Inbound::Pull(pull) => {
                self.pulling.insert(pull, (channel, peer, id, kind));
                return;
            }
        };
        self.hand_to_node(peer, id, kind, call, channel);
    }

    /// Give an exchange request to the node, which answers through its responder; a node
    /// that is behind gets it answered busy (a push) or not-ready (a merge fetch).
    fn hand_to_node(
        &mut self,
        peer: PeerId,
        id: RequestId,
        kind: RpcKind,
        call: InboundCall,
        channel: request_response::ResponseChannel<RpcResponse>,
    ) {
        let (tx, rx) = oneshot::channel();
        let inbound = InboundExchange {
            peer,
            call,
            reply: ExchangeResponder::new(id, tx),
        };
        let Some(sink) = &self.exchange_sink else {
            return;
        };
        if let Err(e) = sink.try_send(inbound) {
            // The node is behind: a push is answered busy, a merge fetch not-ready, both of
            // which the peer's exchange handles like any hub's.
            tracing::debug!(%peer, full = matches!(e, mpsc::error::TrySendError::Full(_)),
                "exchange request not taken");
            let response = if kind == RpcKind::Push {
                RpcResponse::PushAnswer {
                    id,
                    answer: PushAnswer::Busy,
                }
            } else {
                RpcResponse::Error {
                    id,
                    code: RpcErrorCode::NotFound,
                }
            };
            self.send_answer(channel, peer, kind, Some(response));
            return;
        }
        self.answering.push(Box::pin(
            async move { (channel, peer, kind, rx.await.ok()) },
        ));
    }

    fn send_answer(
        &mut self,
        channel: request_response::ResponseChannel<RpcResponse>,
        peer: PeerId,
        kind: RpcKind,
        response: Option<RpcResponse>,
    ) {
        // Dropped unanswered: the channel closes and the peer's request fails.
        let Some(response) = response else {
            return;
        };
        let response = self.core.offer_large_merge(peer, response, Instant::now());
        self.core.exchange_response_sent(&peer, kind, &response);
        if self
            .swarm
            .behaviour_mut()
            .rpc
            .inner_mut()
            .send_response(channel, response)
            .is_err()
        {
            tracing::debug!(%peer, "requester went away before the exchange answer");
        }
    }
}

fn outbound_failure(error: &OutboundFailure) -> RequestFailure {
    match error {
        OutboundFailure::Timeout => RequestFailure::Timeout,
        OutboundFailure::ConnectionClosed => RequestFailure::ConnectionClosed,
        OutboundFailure::DialFailure => RequestFailure::DialFailure,
        OutboundFailure::UnsupportedProtocols => RequestFailure::Unsupported,
        OutboundFailure::Io(e) => match CodecError::from_io(e) {
            // A stream cut short may be the network; everything else is the peer's doing.
            Some(CodecError::Truncated) => RequestFailure::Truncated,
            Some(c) => RequestFailure::Protocol(c.reason()),
            None => RequestFailure::Io,
        },
    }
}

/// A relay server's events, for the log.
fn on_relay_server(e: &relay::Event) {
    match e {
        relay::Event::ReservationReqAccepted {
            src_peer_id,
            renewed: false,
        } => {
            tracing::info!(peer = %src_peer_id, "relay server: reservation granted");
        }
        relay::Event::CircuitReqAccepted {
            src_peer_id,
            dst_peer_id,
        } => {
            tracing::debug!(src = %src_peer_id, dst = %dst_peer_id, "relay server: circuit opened");
        }
        other => tracing::debug!(event = ?other, "relay server"),
    }
}
