//! The sans-IO routing core: every decision a node makes about announcing, looking up, fetching,
//! serving, scoring and banning, with no sockets, tasks or clocks.
//!
//! [`RoutingCore`] is driven in the quinn-proto style, *handle_\* in, poll_\* out*:
//!
//! 1. Commands ([`RoutingCore::announce`], [`RoutingCore::start_lookup`],
//!    [`RoutingCore::fetch_snapshot`]) and network inputs
//!    (`handle_providers`, `handle_key_lookup_done`, `handle_provide_result`,
//!    `handle_response`, `handle_request`, `handle_bad_request`) update the state.
//! 2. After each call, drain [`RoutingCore::poll_output`] until it returns `None` and carry out
//!    every [`Output`] (start a DHT query, send a request, ban a peer, complete a lookup...).
//! 3. Call [`RoutingCore::handle_timeout`] whenever the instant from
//!    [`RoutingCore::poll_timeout`] has passed (lookup deadlines, ban expiries), then drain again.
//!
//! Every input carries `now`, so the same core runs under the tokio driver ([`crate::spawn`]),
//! in deterministic unit tests, and in the simulator's virtual time.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

use kindred_proto::rpc::{RequestId, RpcKind, RpcRequest};
use kindred_proto::{PacketId, VerifiedHeader};
use libp2p::PeerId;

use crate::config::CoreConfig;
use crate::index::SemanticIndex;
use crate::keys::{KeyContext, RoundWindow, SemanticKey, announce_shard, next_shard_count};
use crate::lookup::{Lookup, LookupId, Partners};
use crate::metrics::RoutingMetrics;
use crate::replay::ReplayGuard;
use crate::scoring::{PeerScores, Severity};
use crate::snapshot::{SnapshotError, SnapshotFetch, SnapshotFetchId, SnapshotGrants};

/// Identifies one announcement (one packet's keys being published).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AnnounceId(pub u64);

/// Result of publishing a packet's keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnounceReport {
    /// The packet announced.
    pub packet: PacketId,
    /// Its round window.
    pub window: RoundWindow,
    /// Keys published.
    pub keys: usize,
    /// Keys whose publication failed (no peers reachable, local record store full...).
    pub failed: usize,
}

/// Why a packet cannot be announced.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AnnounceError {
    /// Only the node's own packets are announced: a provider serves its own update.
    #[error("packet {packet} was sealed by {sender}, not by this node")]
    NotOwnPacket {
        /// The packet.
        packet: PacketId,
        /// Its sender.
        sender: PeerId,
    },
    /// The packet's round window is already older than the retention horizon.
    #[error("round window {window:?} is older than the newest announced window {latest:?} allows")]
    StaleWindow {
        /// The packet's window.
        window: RoundWindow,
        /// The newest window announced so far.
        latest: RoundWindow,
    },
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

/// Why a request to a peer produced no usable response, as reported by the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestFailure {
    /// No response in time.
    Timeout,
    /// The connection closed first.
    ConnectionClosed,
    /// The peer could not be dialled.
    DialFailure,
    /// The response stream ended early (a dropped connection, or a peer cutting it short).
    Truncated,
    /// The peer does not speak the protocol.
    Unsupported,
    /// The response broke the protocol (undecodable, oversize): the peer's fault.
    Protocol(&'static str),
    /// Another transport error.
    Io,
}

impl RequestFailure {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::ConnectionClosed => "connection_closed",
            Self::DialFailure => "dial_failure",
            Self::Truncated => "truncated",
            Self::Unsupported => "unsupported_protocol",
            Self::Protocol(reason) => reason,
            Self::Io => "io",
        }
    }
}

/// An action the driver must carry out.
#[derive(Debug)]
#[must_use = "outputs must be carried out by the driver"]
pub enum Output {
    /// Publish a provider record for `key` (Kademlia `start_providing`), then report with
    /// [`RoutingCore::handle_provide_result`].
    StartProviding {
        /// The announcement this key belongs to.
        announce: AnnounceId,
        /// The key.
        key: SemanticKey,
    },
    /// Stop re-publishing `key` (its window expired).
    StopProviding {
        /// The key.
        key: SemanticKey,
    },
    /// Look up providers of `key` (Kademlia `get_providers`); report providers with
    /// [`RoutingCore::handle_providers`] and the end with
    /// [`RoutingCore::handle_key_lookup_done`].
    GetProviders {
        /// The round lookup asking.
        lookup: LookupId,
        /// The key.
        key: SemanticKey,
    },
    /// `peer` was just found as a provider: note its addresses now, because Kademlia keeps them
    /// only while the query that found it runs, and the header request that dials it may come
    /// after that. Nothing is dialled yet: dialling every provider on arrival would open
    /// hundreds of connections at once at scale.
    ProviderFound {
        /// The provider.
        peer: PeerId,
        /// The key it provides (its record in the local store, if any, also has addresses).
        key: SemanticKey,
    },
    /// Enough DHT nodes answered for `key`: finish its provider lookup (Kademlia
    /// `query.finish()`); [`RoutingCore::handle_key_lookup_done`] is still expected.
    FinishProviderLookup {
        /// The round lookup.
        lookup: LookupId,
        /// The key.
        key: SemanticKey,
    },
    /// Send `request` to `peer`; report the outcome with [`RoutingCore::handle_response`].
    SendRequest {
        /// Destination.
        peer: PeerId,
        /// The request (its id is the one to report back).
        request: RpcRequest,
    },
    /// Disconnect `peer` and refuse it until `until`.
    Ban {
        /// The peer.
        peer: PeerId,
        /// When the ban ends.
        until: Instant,
        /// The offence that tipped it over.
        reason: &'static str,
    },
    /// The ban of `peer` has ended: accept it again.
    Unban {
        /// The peer.
        peer: PeerId,
    },
    /// An announcement finished.
    AnnounceFinished {
        /// Which.
        announce: AnnounceId,
        /// What happened.
        report: AnnounceReport,
    },
    /// A round lookup finished (complete, or cut short by its deadline).
    LookupFinished {
        /// Which.
        lookup: LookupId,
        /// The ranked candidates and fetched packets.
        partners: Box<Partners>,
    },
    /// A snapshot fetch ([`RoutingCore::fetch_snapshot`]) finished.
    SnapshotFetched {
        /// Which.
        fetch: SnapshotFetchId,
        /// The verified snapshot, or why there is none.
        result: Result<Box<kindred_proto::OutcomePacket>, SnapshotError>,
    },
    /// An exchange call ([`RoutingCore::exchange_call`]) finished.
    ExchangeDone {
        /// Which.
        call: crate::exchange_rpc::ExchangeCallId,
        /// What came back.
        result: Result<crate::exchange_rpc::ExchangeReply, crate::exchange_rpc::ExchangeError>,
    },
    /// A push's body pulled in pieces ([`crate::exchange_rpc::Inbound::Pull`]) is whole: the
    /// push for the node to answer; `None` if the pull failed (answer busy: the pusher's
    /// exchange tries again).
    PushPulled {
        /// Which.
        pull: crate::exchange_rpc::PullId,
        /// The push, whole.
        call: Option<crate::exchange_rpc::InboundCall>,
    },
}

#[derive(Debug)]
pub(crate) struct AnnounceState {
    pub(crate) packet: PacketId,
    pub(crate) window: RoundWindow,
    pub(crate) keys: usize,
    pub(crate) pending: usize,
    pub(crate) failed: usize,
}

/// What an outbound request was for.
#[derive(Debug, Clone)]
pub(crate) enum Want {
    /// The peer's headers announced under `keys` (a peer found in the DHT).
    Headers {
        keys: Vec<SemanticKey>,
    },
    /// The peer's newest own header (a followed peer, [`crate::Discovery`]).
    Latest,
    Body {
        packet: PacketId,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Pending {
    pub(crate) peer: PeerId,
    pub(crate) lookup: LookupId,
    pub(crate) want: Want,
}

/// Shard counts learned for hot bands, keyed by `(band, value)`: independent of the window, so
/// what one window teaches applies to the next.
#[derive(Debug, Default)]
pub(crate) struct HotBands {
    shards: HashMap<(u16, u64), (u32, RoundWindow)>,
}

impl HotBands {
    pub(crate) fn shards(&self, band: u16, value: u64) -> u32 {
        self.shards.get(&(band, value)).map_or(1, |(s, _)| *s)
    }

    pub(crate) fn observe(
        &mut self,
        band: u16,
        value: u64,
        used: u32,
        providers: usize,
        window: RoundWindow,
        config: &CoreConfig,
    ) {
        let next = next_shard_count(used, providers, config.shards);
        if next <= 1 {
            self.shards.remove(&(band, value));
            return;
        }
        if !self.shards.contains_key(&(band, value))
            && self.shards.len() >= config.hot_band_capacity.max(1)
        {
            // Forget the band seen longest ago.
            if let Some(old) = self
                .shards
                .iter()
                .min_by_key(|(_, (_, w))| *w)
                .map(|(k, _)| *k)
            {
                self.shards.remove(&old);
            }
        }
        self.shards.insert((band, value), (next, window));
    }
}

/// The sans-IO routing state machine of one node. See the [module docs](self) for the call
/// order.
#[derive(Debug)]
pub struct RoutingCore {
    pub(crate) local: PeerId,
    pub(crate) local_bytes: Vec<u8>,
    pub(crate) config: CoreConfig,
    pub(crate) scores: PeerScores<PeerId>,
    pub(crate) replay: ReplayGuard<PeerId>,
    pub(crate) index: SemanticIndex,
    pub(crate) hot: HotBands,
    /// Keys this node announced, by window, for serving `GetHeaders` by key.
    pub(crate) announced: BTreeMap<RoundWindow, Vec<SemanticKey>>,
    /// The packet each announced key serves: the newest one carrying the key's band value.
    pub(crate) by_key: HashMap<SemanticKey, PacketId>,
    /// The node's newest own packet, served to peers that follow it
    /// ([`kindred_proto::rpc::HeaderQuery::Latest`]).
    pub(crate) latest_own: Option<PacketId>,
    /// Packets announced since the node started (its warm-up is the first few).
    pub(crate) announcements: u64,
    /// The node's addresses changed since its last announcement
    /// ([`RoutingCore::addresses_changed`]): the next one publishes every key again.
    pub(crate) republish: bool,
    pub(crate) announces: HashMap<AnnounceId, AnnounceState>,
    pub(crate) lookups: HashMap<LookupId, Lookup>,
    pub(crate) pending: HashMap<RequestId, Pending>,
    pub(crate) snapshot_fetches: HashMap<RequestId, SnapshotFetch>,
    pub(crate) snapshot_grants: SnapshotGrants,
    /// Large bodies served in pieces besides the snapshot (a hub's merges).
    pub(crate) served_bodies: crate::pieces::ServedBodies,
    pub(crate) exchange_calls: HashMap<RequestId, crate::exchange_rpc::PendingCall>,
    /// Inbound pushes whose bodies are being pulled, by the piece request in flight.
    pub(crate) pulls: HashMap<RequestId, crate::exchange_rpc::PendingPull>,
    pub(crate) outputs: VecDeque<Output>,
    pub(crate) metrics: RoutingMetrics,
    next_id: u64,
}

impl RoutingCore {
    /// A core for the node `local`.
    pub fn new(local: PeerId, config: CoreConfig) -> Self {
        Self {
            local,
            local_bytes: local.to_bytes(),
            scores: PeerScores::new(config.scoring.clone()),
            replay: ReplayGuard::new(config.replay_capacity),
            index: SemanticIndex::new(config.retain_windows, config.index_capacity),
            hot: HotBands::default(),
            announced: BTreeMap::new(),
            by_key: HashMap::new(),
            latest_own: None,
            announcements: 0,
            republish: false,
            announces: HashMap::new(),
            lookups: HashMap::new(),
            pending: HashMap::new(),
            snapshot_fetches: HashMap::new(),
            snapshot_grants: SnapshotGrants::default(),
            served_bodies: crate::pieces::ServedBodies::default(),
            exchange_calls: HashMap::new(),
            pulls: HashMap::new(),
            outputs: VecDeque::new(),
            metrics: RoutingMetrics::default(),
            next_id: 0,
            config,
        }
    }

    /// This node's peer id.
    pub fn local_peer(&self) -> PeerId {
        self.local
    }

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// Counters so far.
    pub fn metrics(&self) -> &RoutingMetrics {
        &self.metrics
    }

    /// Peer scores and bans.
    pub fn scores(&self) -> &PeerScores<PeerId> {
        &self.scores
    }

    /// Replay high-water marks (to persist them; restore through [`RoutingCore::replay_mut`]).
    pub fn replay(&self) -> &ReplayGuard<PeerId> {
        &self.replay
    }

    /// Mutable replay marks, to restore persisted ones at start-up.
    pub fn replay_mut(&mut self) -> &mut ReplayGuard<PeerId> {
        &mut self.replay
    }

    /// The local semantic index.
    pub fn index(&self) -> &SemanticIndex {
        &self.index
    }

    /// Whether `peer` is banned now.
    pub fn is_banned(&self, peer: &PeerId, now: Instant) -> bool {
        self.scores.is_banned(peer, now)
    }

    pub(crate) fn next_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    pub(crate) fn window_of(&self, round: u64) -> RoundWindow {
        self.config.discovery.window(round)
    }

    /// The next action to carry out, if any.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// The next instant at which [`RoutingCore::handle_timeout`] has work to do.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let lookups = self.lookups.values().map(|l| l.deadline).min();
        match (lookups, self.scores.next_expiry()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Expire lookups past their deadline and bans past their end.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<LookupId> = self
            .lookups
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.finish_lookup(id, now, true);
        }
        while let Some(peer) = self.scores.poll_unban(now) {
            tracing::info!(%peer, "ban expired");
            self.outputs.push_back(Output::Unban { peer });
        }
    }

    /// Announce the node's own packet: publish it under its band keys for its round window.
    ///
    /// Only the first packet of a window is published in full ([`crate::Discovery`]). A later one
    /// of the same window replaces the earlier under the keys it shares with it and is served to
    /// followers; it publishes only its new keys during the node's warm-up (its first
    /// `warmup_rounds` announcements, when it searches every round), and otherwise none, finishing
    /// at once with `keys: 0`.
    ///
    /// Each band key is replaced by one of its shards when the band is known to be hot. Emits one
    /// [`Output::StartProviding`] per key, and [`Output::StopProviding`] for keys of windows that
    /// fall out of retention; [`Output::AnnounceFinished`] follows once every key is reported.
    ///
    /// # Errors
    /// [`AnnounceError`] when the packet is not this node's or its window is already expired.
    pub fn announce(
        &mut self,
        header: &VerifiedHeader,
        now: Instant,
    ) -> Result<AnnounceId, AnnounceError> {
        let h = header.header();
        if h.sender != self.local {
            return Err(AnnounceError::NotOwnPacket {
                packet: header.id(),
                sender: h.sender,
            });
        }
        let window = self.window_of(h.round);
        let latest = self.announced.keys().next_back().copied().unwrap_or(window);
        let horizon = latest
            .0
            .saturating_sub(self.config.retain_windows.max(1) - 1);
        if window.0 < horizon {
            return Err(AnnounceError::StaleWindow { window, latest });
        }
        let ctx = KeyContext::new(self.config.network, h.model, window, self.config.keys);
        let id = AnnounceId(self.next_id());
        let mut keys = Vec::with_capacity(ctx.config().bands());
        for band in 0..ctx.config().bands() {
            let value = ctx.config().band_value(&h.embedding.simhash, band);
            let base = ctx.band_key(band, value);
            let shards = self.hot.shards(band as u16, value);
            let shard = announce_shard(&self.local_bytes, &base, shards);
            keys.push(crate::keys::shard_key(&base, shard));
        }
        self.latest_own = Some(header.id());
        let warming_up = self.announcements < self.config.discovery.warmup_rounds;
        self.announcements += 1;
        // The first packet of a window publishes all its keys. A later one publishes none,
        // except in the node's warm-up, when it searches every round and its peers must find
        // its current keys: then the keys not yet provided in this window are published too.
        // After the node's addresses changed, all its keys are published again: a provider
        // record carries the addresses it was published with, and a record without a dialable
        // one is not even handed out (a node behind NAT announces before its relay
        // reservation gives it an address).
        let provided = self.announced.get(&window);
        let publish: Vec<SemanticKey> = match provided {
            None => keys.clone(),
            Some(_) if self.republish => keys.clone(),
            Some(p) if warming_up => keys.iter().filter(|k| !p.contains(k)).copied().collect(),
            Some(_) => Vec::new(),
        };
        self.republish = false;
        // The keys this packet carries that are (or are being) provided now serve it; the
        // window's other keys keep serving the older packet whose band values they stand for.
        for key in &keys {
            if publish.contains(key) || provided.is_some_and(|p| p.contains(key)) {
                self.by_key.insert(*key, header.id());
            }
        }
        for key in &publish {
            self.outputs.push_back(Output::StartProviding {
                announce: id,
                key: *key,
            });
        }
        let in_window = self.announced.entry(window).or_default();
        for key in &publish {
            if !in_window.contains(key) {
                in_window.push(*key);
            }
        }
        let report = AnnounceReport {
            packet: header.id(),
            window,
            keys: publish.len(),
            failed: 0,
        };
        if publish.is_empty() {
            self.outputs.push_back(Output::AnnounceFinished {
                announce: id,
                report,
            });
        } else {
            self.announces.insert(
                id,
                AnnounceState {
                    packet: report.packet,
                    window,
                    keys: publish.len(),
                    pending: publish.len(),
                    failed: 0,
                },
            );
        }
        self.metrics.keys_announced += publish.len() as u64;
        self.expire_windows(now);
        tracing::debug!(packet = %header.id(), ?window, keys = publish.len(), "announcing");
        Ok(id)
    }

    /// The node's own addresses changed (a relay reservation, a confirmed or expired external
    /// address): the next [`RoutingCore::announce`] publishes all of its packet's keys again,
    /// even those already provided in the window, so that the records carry the new
    /// addresses.
    pub fn addresses_changed(&mut self) {
        self.republish = true;
    }

    /// Drop announcements and index windows older than the retention horizon.
    fn expire_windows(&mut self, _now: Instant) {
        let Some(&latest) = self.announced.keys().next_back() else {
            return;
        };
        let horizon = RoundWindow(
            latest
                .0
                .saturating_sub(self.config.retain_windows.max(1) - 1),
        );
        let keep = self.announced.split_off(&horizon);
        let expired = std::mem::replace(&mut self.announced, keep);
        for key in expired.into_values().flatten() {
            if self.by_key.remove(&key).is_some() {
                self.outputs.push_back(Output::StopProviding { key });
            }
        }
        self.index.advance(latest);
    }

    /// Report the outcome of one [`Output::StartProviding`], which took `kad_requests`
    /// Kademlia requests (its `FIND_NODE` walk and its `ADD_PROVIDER`s).
    pub fn handle_provide_result(&mut self, announce: AnnounceId, ok: bool, kad_requests: u32) {
        let Some(state) = self.announces.get_mut(&announce) else {
            return;
        };
        self.metrics.announce_kad_requests += u64::from(kad_requests);
        state.pending = state.pending.saturating_sub(1);
        if !ok {
            state.failed += 1;
            self.metrics.announce_failures += 1;
        }
        if state.pending == 0
            && let Some(state) = self.announces.remove(&announce)
        {
            self.outputs.push_back(Output::AnnounceFinished {
                announce,
                report: AnnounceReport {
                    packet: state.packet,
                    window: state.window,
                    keys: state.keys,
                    failed: state.failed,
                },
            });
        }
    }

    /// Count a reject and, with a severity, penalise the peer (possibly banning it).
    pub(crate) fn reject(
        &mut self,
        peer: &PeerId,
        reason: &'static str,
        severity: Option<Severity>,
        now: Instant,
    ) {
        self.metrics.reject(reason);
        tracing::debug!(%peer, reason, "rejected data from peer");
        let Some(severity) = severity else { return };
        if let Some(ban) = self.scores.penalize(peer, severity, now) {
            tracing::warn!(%peer, reason, "banning peer");
            self.metrics.bans += 1;
            self.outputs.push_back(Output::Ban {
                peer: ban.peer,
                until: ban.until,
                reason,
            });
        }
    }

    /// Record a failed request that is not (as far as this node can tell) the peer's fault.
    pub(crate) fn count_failure(&mut self, kind: RpcKind, failure: &RequestFailure) {
        self.metrics.request_failed(kind, failure.label());
    }
}
