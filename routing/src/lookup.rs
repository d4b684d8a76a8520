//! Round lookups: from a node's own header to ranked, verified partners and their bodies.
//!
//! One lookup runs three phases, all inside [`RoutingCore`]:
//! 1. **Discover**: look up providers of the `L` band keys (every shard of a hot band, or a few in
//!    a refresh) plus the first `P` multi-probe keys, all in parallel. Each new provider is asked
//!    once, with at most [`crate::LookupConfig::header_concurrency`] requests in flight, for the
//!    headers it announced under the keys it was found under.
//! 2. **Verify and index**: every header is decoded and its signature checked
//!    ([`kindred_proto::decode_header`]), then checked against the request: signed by the peer
//!    that served it, same model, same round window, and actually carrying the band the key
//!    stands for. Replays (stale round, duplicate, conflicting packet for a round) are dropped.
//!    Survivors go into the local [`crate::index::SemanticIndex`].
//! 3. **Rank and fetch**: once discovery is over, the window's index is searched for the nearest
//!    sketches; candidates the cosine gate admits are fetched best first, by id, from their
//!    senders, until `top_m` bodies verified by [`kindred_proto::decode_body`] are in hand.
//!
//! A lookup ends when all three phases are done or at its deadline, whichever comes first, and
//! always yields what it has found ([`Partners`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_proto::rpc::{
    HeaderQuery, MAX_QUERY_ITEMS, RequestId, RpcKind, RpcRequest, RpcResponse,
};
use kindred_proto::{
    DecodeError, ModelId, ModelSpec, OutcomePacket, PacketId, VerifiedHeader, decode_body,
    decode_header,
};
use libp2p::PeerId;

use crate::config::CosineGate;
use crate::core::{Output, Pending, RequestFailure, RoutingCore, Want};
use crate::index::IndexedHeader;
use crate::keys::{
    KeyContext, ProbeError, ProbeSequence, RoundWindow, SemanticKey, lookup_shards, shard_key,
};
use crate::replay::Admission;
use crate::scoring::Severity;

/// Identifies one round lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LookupId(pub u64);

/// What a node looks for: partners for its own packet.
#[derive(Debug, Clone)]
pub struct PartnerQuery {
    /// The node's own header for the round (gives model, round window and embedding).
    pub header: VerifiedHeader,
    /// Per-bit SimHash margins (|projection|, 256 values) for multi-probe ordering; may be empty
    /// when `probes` is 0.
    pub margins: Vec<f32>,
    /// The model spec bodies are verified against; without one, no body is fetched.
    pub spec: Option<Arc<ModelSpec>>,
    /// Multi-probe keys; `None` uses the configured default.
    pub probes: Option<usize>,
    /// Bodies to fetch; `None` uses the configured default.
    pub top_m: Option<usize>,
    /// Which candidates bodies are fetched from; `None` uses the configured default.
    pub gate: Option<CosineGate>,
    /// Peers to follow instead of searching the DHT ([`crate::Discovery`]). Empty (the default):
    /// a full lookup. Otherwise no key is looked up: each of these peers is asked for its newest
    /// header, and only they are ranked and fetched from.
    pub follow: Vec<PeerId>,
    /// A refresh: the node already follows peers and searches the DHT only to meet new ones
    /// (a periodic discovery round, [`crate::RoundPlan::Refresh`]). Each hot band and probe is
    /// looked up on [`crate::LookupConfig::refresh_shards`] of its shards rather than all.
    pub refresh: bool,
}

impl PartnerQuery {
    /// A query with the configured defaults.
    pub fn new(header: VerifiedHeader, margins: Vec<f32>, spec: Arc<ModelSpec>) -> Self {
        Self {
            header,
            margins,
            spec: Some(spec),
            probes: None,
            top_m: None,
            gate: None,
            follow: Vec::new(),
            refresh: false,
        }
    }

    /// Follow `peers` instead of searching the DHT (see [`PartnerQuery::follow`]).
    pub fn following(mut self, peers: Vec<PeerId>) -> Self {
        self.follow = peers;
        self
    }

    /// Search as a refresh (see [`PartnerQuery::refresh`]).
    pub fn refreshing(mut self) -> Self {
        self.refresh = true;
        self
    }
}

/// One ranked candidate partner (a verified header).
#[derive(Debug, Clone)]
pub struct Candidate {
    /// The verified header.
    pub header: VerifiedHeader,
    /// Its encoded bytes as received.
    pub header_bytes: Vec<u8>,
    /// Sketch cosine with the node's own embedding.
    pub cosine: f32,
}

/// A fetched, fully verified partner packet.
#[derive(Debug, Clone)]
pub struct FetchedPacket {
    /// Header and decoded body.
    pub packet: OutcomePacket,
    /// The encoded header as received.
    pub header_bytes: Vec<u8>,
    /// The encoded body as received.
    pub body_bytes: Vec<u8>,
    /// Sketch cosine with the node's own embedding.
    pub cosine: f32,
}

/// What one round lookup cost and found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LookupStats {
    /// DHT provider lookups issued (band keys and their shards, plus probes).
    pub key_lookups: u32,
    /// Kademlia requests of each completed provider lookup, from kad's query statistics.
    pub kad_requests: Vec<u32>,
    /// Distinct providers found.
    pub providers: u32,
    /// `GetHeaders` requests sent.
    pub header_requests: u32,
    /// Headers verified and accepted (new or already indexed).
    pub headers_accepted: u32,
    /// Headers rejected.
    pub headers_rejected: u32,
    /// Providers whose headers this lookup could not read: asked with no answer (a timeout, a
    /// dial or a connection that failed), or still waiting when the deadline came. A peer
    /// behind NAT whose hole punch is under way is one.
    pub providers_unread: u32,
    /// `GetBody` requests sent.
    pub body_requests: u32,
    /// Bodies verified.
    pub bodies_accepted: u32,
    /// Bodies rejected.
    pub bodies_rejected: u32,
    /// Wall time from start to finish.
    pub elapsed: Duration,
    /// Whether the deadline cut the lookup short.
    pub timed_out: bool,
}

/// The outcome of a round lookup.
#[derive(Debug, Clone)]
pub struct Partners {
    /// The round window searched.
    pub window: RoundWindow,
    /// Verified candidate headers of the window, best cosine first.
    pub candidates: Vec<Candidate>,
    /// Verified packets fetched, best cosine first (at most `top_m`, all admitted by the
    /// cosine gate).
    pub packets: Vec<FetchedPacket>,
    /// Costs and counts.
    pub stats: LookupStats,
}

/// Why a round lookup could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// Too many round lookups are already in flight.
    #[error("{limit} round lookups are already in flight")]
    Busy {
        /// The configured limit.
        limit: usize,
    },
    /// Multi-probes were asked for but the margins are unusable.
    #[error(transparent)]
    Probes(#[from] ProbeError),
    /// The node's own sketch is empty or all zero: there is nothing to rank against.
    #[error("the node's own embedding sketch is empty or all zero")]
    ZeroSketch,
    /// The routing driver has stopped.
    #[error("the routing driver has stopped")]
    Stopped,
}

#[derive(Debug)]
pub(crate) struct KeyState {
    band: u16,
    value: u64,
    done: bool,
    /// DHT responses that carried providers.
    answers: usize,
    providers: HashSet<PeerId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProviderStatus {
    Queued,
    Asked,
}

#[derive(Debug)]
struct ProviderState {
    keys: Vec<SemanticKey>,
    status: ProviderStatus,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Discover,
    Fetch,
}

#[derive(Debug)]
pub(crate) struct Lookup {
    pub(crate) deadline: Instant,
    started: Instant,
    window: RoundWindow,
    model: ModelId,
    own: VerifiedHeader,
    spec: Option<Arc<ModelSpec>>,
    top_m: usize,
    gate: CosineGate,
    /// `(band, value)` → (shards the band is split into, shards looked up).
    shards_used: HashMap<(u16, u64), (u32, u32)>,
    keys: HashMap<SemanticKey, KeyState>,
    keys_pending: usize,
    providers: HashMap<PeerId, ProviderState>,
    queue: VecDeque<PeerId>,
    headers_in_flight: usize,
    phase: Phase,
    candidates: Vec<Candidate>,
    body_queue: VecDeque<usize>,
    bodies_in_flight: usize,
    packets: Vec<FetchedPacket>,
    stats: LookupStats,
    /// The peers followed, when this lookup follows instead of searching the DHT.
    followed: Option<HashSet<PeerId>>,
}

impl Lookup {
    /// A lookup in the discover phase with nothing asked or found yet.
    fn new(
        query: PartnerQuery,
        model: ModelId,
        window: RoundWindow,
        (top_m, gate): (usize, CosineGate),
        deadline: Instant,
        now: Instant,
    ) -> Self {
        Self {
            deadline,
            started: now,
            window,
            model,
            own: query.header,
            spec: query.spec,
            top_m,
            gate,
            shards_used: HashMap::new(),
            keys: HashMap::new(),
            keys_pending: 0,
            providers: HashMap::new(),
            queue: VecDeque::new(),
            headers_in_flight: 0,
            phase: Phase::Discover,
            candidates: Vec::new(),
            body_queue: VecDeque::new(),
            bodies_in_flight: 0,
            packets: Vec::new(),
            stats: LookupStats::default(),
            followed: None,
        }
    }
}

impl RoutingCore {
    /// Start a round lookup for partners of `query.header`.
    ///
    /// Emits one [`Output::GetProviders`] per key; the result arrives as
    /// [`Output::LookupFinished`].
    ///
    /// # Errors
    /// [`LookupError`] when too many lookups run, the margins are unusable for the probes asked
    /// for, or the own sketch has no direction.
    pub fn start_lookup(
        &mut self,
        query: PartnerQuery,
        now: Instant,
    ) -> Result<LookupId, LookupError> {
        let cfg = &self.config.lookup;
        if self.lookups.len() >= cfg.max_concurrent {
            return Err(LookupError::Busy {
                limit: cfg.max_concurrent,
            });
        }
        let h = query.header.header();
        if !h.embedding.sketch.iter().any(|&x| x != 0) {
            return Err(LookupError::ZeroSketch);
        }
        let probes = query.probes.unwrap_or(cfg.probes);
        let top_m = query.top_m.unwrap_or(cfg.top_m);
        let gate = query.gate.unwrap_or(cfg.gate);
        let deadline = now + cfg.timeout;
        let window = self.window_of(h.round);
        let ctx = KeyContext::new(self.config.network, h.model, window, self.config.keys);

        if !query.follow.is_empty() {
            return Ok(self.start_following(query, top_m, gate, window, now));
        }
        // Band values: the signature's own, then the probes'.
        let mut origins: Vec<(u16, u64)> = (0..ctx.config().bands())
            .map(|b| (b as u16, ctx.config().band_value(&h.embedding.simhash, b)))
            .collect();
        if probes > 0 {
            let seq = ProbeSequence::new(&h.embedding.simhash, &query.margins, ctx.config())?;
            origins.extend(seq.take(probes).map(|p| (p.band, p.value)));
        }
        // 0: every shard.
        let limit = if query.refresh { cfg.refresh_shards } else { 0 };
        let mut keys = HashMap::new();
        let mut shards_used = HashMap::new();
        for &(band, value) in &origins {
            let shards = self.hot.shards(band, value);
            let base = ctx.band_key(usize::from(band), value);
            let mut asked = 0;
            for s in lookup_shards(&self.local_bytes, &base, shards, limit) {
                asked += 1;
                keys.entry(shard_key(&base, s)).or_insert(KeyState {
                    band,
                    value,
                    done: false,
                    answers: 0,
                    providers: HashSet::new(),
                });
            }
            shards_used.insert((band, value), (shards, asked));
        }
        let id = LookupId(self.next_id());
        for key in keys.keys() {
            self.outputs.push_back(Output::GetProviders {
                lookup: id,
                key: *key,
            });
        }
        self.index.advance(window);
        self.metrics.lookups_started += 1;
        let stats = LookupStats {
            key_lookups: keys.len() as u32,
            ..LookupStats::default()
        };
        tracing::debug!(
            lookup = id.0,
            ?window,
            keys = keys.len(),
            "round lookup started"
        );
        let model = h.model;
        let mut lookup = Lookup::new(query, model, window, (top_m, gate), deadline, now);
        lookup.shards_used = shards_used;
        lookup.keys_pending = keys.len();
        lookup.keys = keys;
        lookup.stats = stats;
        self.lookups.insert(id, lookup);
        self.advance(id, now);
        Ok(id)
    }

    /// A lookup that asks the followed peers for their newest headers instead of searching
    /// the DHT.
    fn start_following(
        &mut self,
        mut query: PartnerQuery,
        top_m: usize,
        gate: CosineGate,
        window: RoundWindow,
        now: Instant,
    ) -> LookupId {
        let max_providers = self.config.lookup.max_providers;
        let mut followed = HashSet::new();
        let mut queue = VecDeque::new();
        let mut providers = HashMap::new();
        for peer in std::mem::take(&mut query.follow) {
            if peer == self.local || followed.len() >= max_providers || !followed.insert(peer) {
                continue;
            }
            queue.push_back(peer);
            providers.insert(
                peer,
                ProviderState {
                    keys: Vec::new(),
                    status: ProviderStatus::Queued,
                },
            );
        }
        let id = LookupId(self.next_id());
        self.index.advance(window);
        self.metrics.lookups_started += 1;
        tracing::debug!(
            lookup = id.0,
            ?window,
            peers = queue.len(),
            "following partners"
        );
        let model = query.header.header().model;
        let deadline = now + self.config.lookup.timeout;
        let mut lookup = Lookup::new(query, model, window, (top_m, gate), deadline, now);
        lookup.providers = providers;
        lookup.queue = queue;
        lookup.stats.providers = followed.len() as u32;
        lookup.followed = Some(followed);
        self.lookups.insert(id, lookup);
        self.advance(id, now);
        id
    }

    /// Providers reported for `key` by lookup `lookup`: one call per DHT response (Kademlia's
    /// `FoundProviders` events, which may be empty).
    pub fn handle_providers(
        &mut self,
        lookup: LookupId,
        key: SemanticKey,
        providers: impl IntoIterator<Item = PeerId>,
        now: Instant,
    ) {
        let local = self.local;
        let max_providers = self.config.lookup.max_providers;
        let quorum = self.config.lookup.provider_quorum;
        let Some(l) = self.lookups.get_mut(&lookup) else {
            return;
        };
        let Some(k) = l.keys.get_mut(&key) else {
            return;
        };
        let mut carried = false;
        for peer in providers {
            if peer == local {
                continue;
            }
            carried = true;
            if k.providers.len() < max_providers {
                k.providers.insert(peer);
            }
            if self.scores.is_banned(&peer, now) {
                continue;
            }
            let known = l.providers.len();
            match l.providers.get_mut(&peer) {
                Some(p)
                    if p.status == ProviderStatus::Queued
                        && p.keys.len() < MAX_QUERY_ITEMS
                        && !p.keys.contains(&key) =>
                {
                    p.keys.push(key);
                }
                Some(_) => {}
                None if known < max_providers => {
                    l.providers.insert(
                        peer,
                        ProviderState {
                            keys: vec![key],
                            status: ProviderStatus::Queued,
                        },
                    );
                    l.queue.push_back(peer);
                    l.stats.providers += 1;
                    self.outputs.push_back(Output::ProviderFound { peer, key });
                }
                None => {}
            }
        }
        // Kademlia reports every response, most with no providers; only holders count.
        if carried {
            k.answers += 1;
            if quorum > 0 && k.answers == quorum && !k.done {
                self.outputs
                    .push_back(Output::FinishProviderLookup { lookup, key });
            }
        }
        self.advance(lookup, now);
    }

    /// The DHT walk of `key` has had `answered` answers so far (Kademlia's
    /// `QueryStats::num_successes`). `whole_table`: the node's routing table holds fewer peers
    /// than one DHT answer lists, so the walk asked the key's closest peers first; then
    /// [`crate::LookupConfig::empty_quorum`] answers without a record end it (once: each
    /// answer is one step, so `answered` passes the quorum once).
    pub fn handle_walk_progress(
        &mut self,
        lookup: LookupId,
        key: SemanticKey,
        answered: u32,
        whole_table: bool,
    ) {
        let quorum = self.config.lookup.empty_quorum;
        let Some(k) = self
            .lookups
            .get_mut(&lookup)
            .and_then(|l| l.keys.get_mut(&key))
        else {
            return;
        };
        if whole_table
            && quorum > 0
            && k.answers == 0
            && usize::try_from(answered).is_ok_and(|a| a == quorum)
            && !k.done
        {
            self.outputs
                .push_back(Output::FinishProviderLookup { lookup, key });
        }
    }

    /// The provider lookup of `key` finished after `kad_requests` Kademlia requests.
    pub fn handle_key_lookup_done(
        &mut self,
        lookup: LookupId,
        key: SemanticKey,
        kad_requests: u32,
        now: Instant,
    ) {
        let Some(l) = self.lookups.get_mut(&lookup) else {
            return;
        };
        let Some(k) = l.keys.get_mut(&key) else {
            return;
        };
        if k.done {
            return;
        }
        k.done = true;
        l.keys_pending = l.keys_pending.saturating_sub(1);
        l.stats.kad_requests.push(kad_requests);
        self.metrics.key_lookups += 1;
        self.metrics.kad_requests += u64::from(kad_requests);
        self.advance(lookup, now);
    }

    /// The outcome of a request sent for [`Output::SendRequest`]: the response, or why there is
    /// none. Responses for unknown ids (late, or after the lookup ended) are ignored.
    pub fn handle_response(
        &mut self,
        peer: PeerId,
        id: RequestId,
        result: Result<RpcResponse, RequestFailure>,
        now: Instant,
    ) {
        if let Some(fetch) = self.snapshot_fetches.remove(&id) {
            if fetch.peer != peer {
                // A driver bug, as below; the fetch still ends, so its caller is not left waiting.
                tracing::error!(%peer, expected = %fetch.peer, "response from an unexpected peer");
                self.outputs.push_back(Output::SnapshotFetched {
                    fetch: fetch.fetch,
                    result: Err(crate::SnapshotError::Failed("unexpected_peer")),
                });
                return;
            }
            return self.on_snapshot_response(peer, id, fetch, result, now);
        }
        if let Some(pull) = self.pulls.remove(&id) {
            if pull.peer != peer {
                tracing::error!(%peer, expected = %pull.peer, "response from an unexpected peer");
                self.outputs.push_back(Output::PushPulled {
                    pull: pull.pull,
                    call: None,
                });
                return;
            }
            return self.on_pull_response(peer, id, pull, result, now);
        }
        if let Some(call) = self.exchange_calls.remove(&id) {
            if call.peer != peer {
                tracing::error!(%peer, expected = %call.peer, "response from an unexpected peer");
                self.outputs.push_back(Output::ExchangeDone {
                    call: call.call,
                    result: Err(crate::ExchangeError::Failed("unexpected_peer")),
                });
                return;
            }
            return self.on_exchange_response(peer, id, call, result, now);
        }
        let Some(pending) = self.pending.remove(&id) else {
            return;
        };
        if pending.peer != peer {
            // The driver routes responses by request; a mismatch is a driver bug, not the
            // peer's fault.
            tracing::error!(%peer, expected = %pending.peer, "response from an unexpected peer");
            return;
        }
        let kind = match pending.want {
            Want::Headers { .. } | Want::Latest => RpcKind::Headers,
            Want::Body { .. } => RpcKind::Body,
        };
        match &result {
            Ok(response) => {
                self.metrics
                    .response_received(&peer, kind, response.encoded_len());
            }
            Err(RequestFailure::Protocol(reason)) => {
                self.metrics.request_failed(kind, reason);
                self.reject(&peer, reason, Some(Severity::Major), now);
            }
            Err(failure) => self.count_failure(kind, failure),
        }
        match pending.want {
            Want::Headers { .. } | Want::Latest => {
                let keys = match &pending.want {
                    Want::Headers { keys } => Some(&keys[..]),
                    _ => None,
                };
                let unanswered = matches!(
                    result,
                    Err(ref f) if !matches!(f, RequestFailure::Protocol(_))
                );
                if let Ok(response) = result {
                    self.on_headers(pending.lookup, peer, id, keys, response, now);
                }
                if let Some(l) = self.lookups.get_mut(&pending.lookup) {
                    l.headers_in_flight = l.headers_in_flight.saturating_sub(1);
                    l.stats.providers_unread += u32::from(unanswered);
                }
            }
            Want::Body { packet } => {
                if let Ok(response) = result {
                    self.on_body(pending.lookup, peer, id, packet, response, now);
                }
                if let Some(l) = self.lookups.get_mut(&pending.lookup) {
                    l.bodies_in_flight = l.bodies_in_flight.saturating_sub(1);
                }
            }
        }
        self.advance(pending.lookup, now);
    }

    fn on_headers(
        &mut self,
        lookup: LookupId,
        peer: PeerId,
        id: RequestId,
        keys: Option<&[SemanticKey]>,
        response: RpcResponse,
        now: Instant,
    ) {
        let headers = match response {
            RpcResponse::Headers { id: echoed, .. } if echoed != id => {
                return self.reject(&peer, "id_mismatch", Some(Severity::Major), now);
            }
            RpcResponse::Headers { headers, .. } => headers,
            RpcResponse::Error { .. } => return,
            RpcResponse::Body { .. }
            | RpcResponse::Snapshot { .. }
            | RpcResponse::SnapshotHeader { .. }
            | RpcResponse::MergeHeader { .. }
            | RpcResponse::Chunk { .. }
            | RpcResponse::PushAnswer { .. }
            | RpcResponse::Merge { .. } => {
                return self.reject(&peer, "unexpected_response", Some(Severity::Major), now);
            }
        };
        let mut worst: Option<(&'static str, Severity)> = None;
        let mut accepted = 0u32;
        let mut rejected = 0u32;
        for bytes in headers {
            match self.check_header(lookup, peer, keys, &bytes) {
                Ok(header) => match self.admit_header(header, bytes) {
                    Ok(()) => accepted += 1,
                    Err(reason) => {
                        rejected += 1;
                        self.metrics.reject(reason);
                    }
                },
                Err((reason, severity)) => {
                    rejected += 1;
                    self.metrics.reject(reason);
                    if worst.is_none_or(|(_, s)| s == Severity::Minor) {
                        worst = Some((reason, severity));
                    }
                }
            }
        }
        if let Some(l) = self.lookups.get_mut(&lookup) {
            l.stats.headers_accepted += accepted;
            l.stats.headers_rejected += rejected;
        }
        self.metrics.headers_accepted += u64::from(accepted);
        // One penalty per response, for its worst header: a response is one act of the peer.
        match worst {
            Some((reason, severity)) => {
                if let Some(ban) = self.scores.penalize(&peer, severity, now) {
                    tracing::warn!(%peer, reason, "banning peer");
                    self.metrics.bans += 1;
                    self.outputs.push_back(Output::Ban {
                        peer: ban.peer,
                        until: ban.until,
                        reason,
                    });
                }
            }
            None if accepted > 0 => self.scores.reward(&peer, now),
            None => {}
        }
    }

    /// Verify one header against the request that fetched it: `keys` it was served under, or
    /// `None` for a followed peer's newest header.
    fn check_header(
        &self,
        lookup: LookupId,
        peer: PeerId,
        keys: Option<&[SemanticKey]>,
        bytes: &[u8],
    ) -> Result<VerifiedHeader, (&'static str, Severity)> {
        let header = decode_header(bytes).map_err(|e| (e.reason(), decode_severity(&e)))?;
        let l = self
            .lookups
            .get(&lookup)
            .ok_or(("lookup_gone", Severity::Minor))?;
        let h = header.header();
        if h.sender != peer {
            return Err(("foreign_sender", Severity::Minor));
        }
        if h.model != l.model {
            return Err(("wrong_model", Severity::Minor));
        }
        if self.window_of(h.round) != l.window {
            return Err(("wrong_window", Severity::Minor));
        }
        // A followed peer's newest header needs no key: the peer was found, and its header
        // checked against a key, in an earlier lookup.
        let Some(keys) = keys else {
            return if l.followed.as_ref().is_some_and(|f| f.contains(&peer)) {
                Ok(header)
            } else {
                Err(("key_mismatch", Severity::Minor))
            };
        };
        // The header must carry the band value of at least one key it was served under.
        let bands = self.config.keys.at_window(l.window);
        let matches = keys.iter().any(|k| {
            l.keys.get(k).is_some_and(|ks| {
                bands.band_value(&h.embedding.simhash, usize::from(ks.band)) == ks.value
            })
        });
        if !matches {
            return Err(("key_mismatch", Severity::Minor));
        }
        Ok(header)
    }

    /// Replay check and indexing of a verified header; returns a reject reason (not scored:
    /// replays and incomparable sketches are not proof of malice).
    fn admit_header(&mut self, header: VerifiedHeader, bytes: Vec<u8>) -> Result<(), &'static str> {
        let h = header.header();
        // Checked before the replay mark is taken, so an unusable header leaves no trace.
        if !h.embedding.sketch.iter().any(|&x| x != 0) {
            return Err("zero_sketch");
        }
        let window = self.window_of(h.round);
        match self.replay.admit(h.sender, h.model, h.round, header.id()) {
            Ok(Admission::Duplicate) => Ok(()),
            Ok(Admission::New) => {
                self.index
                    .insert(window, header, bytes)
                    .map_err(|e| e.reason())?;
                Ok(())
            }
            Err(e) => Err(e.reason()),
        }
    }

    fn on_body(
        &mut self,
        lookup: LookupId,
        peer: PeerId,
        id: RequestId,
        packet: PacketId,
        response: RpcResponse,
        now: Instant,
    ) {
        let body = match response {
            RpcResponse::Body { id: echoed, .. } if echoed != id => {
                return self.reject(&peer, "id_mismatch", Some(Severity::Major), now);
            }
            RpcResponse::Body { body, .. } => body,
            RpcResponse::Error { .. } => {
                self.metrics.request_failed(RpcKind::Body, "not_found");
                return;
            }
            RpcResponse::Headers { .. }
            | RpcResponse::Snapshot { .. }
            | RpcResponse::SnapshotHeader { .. }
            | RpcResponse::MergeHeader { .. }
            | RpcResponse::Chunk { .. }
            | RpcResponse::PushAnswer { .. }
            | RpcResponse::Merge { .. } => {
                return self.reject(&peer, "unexpected_response", Some(Severity::Major), now);
            }
        };
        let Some(l) = self.lookups.get(&lookup) else {
            return;
        };
        let Some(candidate) = l.candidates.iter().find(|c| c.header.id() == packet) else {
            return;
        };
        let Some(spec) = l.spec.as_deref() else {
            return;
        };
        match decode_body(candidate.header.header(), spec, &body) {
            Ok(decoded) => {
                let fetched = FetchedPacket {
                    packet: OutcomePacket {
                        header: candidate.header.clone(),
                        body: decoded,
                    },
                    header_bytes: candidate.header_bytes.clone(),
                    body_bytes: body,
                    cosine: candidate.cosine,
                };
                self.scores.reward(&peer, now);
                self.metrics.bodies_accepted += 1;
                if let Some(l) = self.lookups.get_mut(&lookup) {
                    l.stats.bodies_accepted += 1;
                    l.packets.push(fetched);
                }
            }
            Err(e) => {
                if let Some(l) = self.lookups.get_mut(&lookup) {
                    l.stats.bodies_rejected += 1;
                }
                self.reject(&peer, e.reason(), Some(Severity::Major), now);
            }
        }
    }

    pub(crate) fn send(&mut self, lookup: LookupId, peer: PeerId, want: Want) {
        let id = RequestId(self.next_id());
        let request = match &want {
            Want::Latest => RpcRequest::GetHeaders {
                id,
                query: HeaderQuery::Latest,
            },
            Want::Headers { keys } => RpcRequest::GetHeaders {
                id,
                query: HeaderQuery::Keys(keys.clone()),
            },
            Want::Body { packet } => RpcRequest::GetBody {
                id,
                packet: *packet,
            },
        };
        self.metrics
            .request_sent(&peer, request.kind(), request.encoded_len());
        self.pending.insert(id, Pending { peer, lookup, want });
        self.outputs
            .push_back(Output::SendRequest { peer, request });
    }

    /// Move a lookup forward: send queued requests, rank when discovery is over, finish when
    /// fetching is over.
    fn advance(&mut self, id: LookupId, now: Instant) {
        let concurrency = self.config.lookup.header_concurrency.max(1);
        loop {
            let Some(l) = self.lookups.get_mut(&id) else {
                return;
            };
            match l.phase {
                Phase::Discover => {
                    if l.headers_in_flight < concurrency
                        && let Some(peer) = l.queue.pop_front()
                    {
                        let Some(p) = l.providers.get_mut(&peer) else {
                            continue;
                        };
                        p.status = ProviderStatus::Asked;
                        let keys = p.keys.clone();
                        if self.scores.is_banned(&peer, now) {
                            continue;
                        }
                        l.headers_in_flight += 1;
                        l.stats.header_requests += 1;
                        let want = if l.followed.is_some() {
                            Want::Latest
                        } else {
                            Want::Headers { keys }
                        };
                        self.send(id, peer, want);
                        continue;
                    }
                    if l.keys_pending == 0 && l.queue.is_empty() && l.headers_in_flight == 0 {
                        self.rank(id);
                        continue;
                    }
                    return;
                }
                Phase::Fetch => {
                    let wanted = l.top_m.saturating_sub(l.packets.len());
                    if l.bodies_in_flight < wanted
                        && let Some(i) = l.body_queue.pop_front()
                    {
                        let Some(c) = l.candidates.get(i) else {
                            continue;
                        };
                        let (peer, packet) = (c.header.header().sender, c.header.id());
                        // A body past one response's limit cannot be fetched whole.
                        let too_large =
                            c.header.header().body_len as usize > kindred_proto::MAX_BODY_BYTES;
                        if too_large || self.scores.is_banned(&peer, now) {
                            continue;
                        }
                        l.bodies_in_flight += 1;
                        l.stats.body_requests += 1;
                        self.send(id, peer, Want::Body { packet });
                        continue;
                    }
                    if l.bodies_in_flight == 0 {
                        self.finish_lookup(id, now, false);
                    }
                    return;
                }
            }
        }
    }

    /// Rank the window's indexed headers against the own sketch and queue body fetches.
    fn rank(&mut self, id: LookupId) {
        let limit = self.config.lookup.candidates;
        let local = self.local;
        let Some(l) = self.lookups.get_mut(&id) else {
            return;
        };
        let own = l.own.header();
        let found: Vec<(&IndexedHeader, f32)> = match &l.followed {
            // Following: the followed peers' newest headers, however far down the window's
            // index they rank.
            Some(followed) => {
                let mut f: Vec<_> = followed
                    .iter()
                    .filter_map(|p| self.index.newest(l.window, p))
                    .map(|e| (e, own.embedding.cosine(&e.header.header().embedding)))
                    .collect();
                f.sort_by(|a, b| b.1.total_cmp(&a.1));
                f
            }
            None => self
                .index
                .nearest(l.window, &own.embedding.sketch, limit + 1),
        };
        // A lookup that fetches no body only meets peers (the hub exchange's searches): a
        // peer's newest header of the window, of whatever round, says who it is as well as
        // one of this round would. Nodes start their rounds at different times, so the rounds a
        // node searches in need not be those its task's hubs announce in (a lone node of 8
        // real nodes searched 5 times in 16 rounds and found its task's headers of the round
        // before, each time ranked out as stale).
        let meet_only = l.top_m == 0;
        let index = &self.index;
        l.candidates = found
            .into_iter()
            // Otherwise only this round's packets: a window spans several rounds, and a
            // peer's older packet may already have been merged.
            .filter(|(e, _)| {
                let h = e.header.header();
                let current = h.round == own.round
                    || (meet_only
                        && index
                            .newest(l.window, &h.sender)
                            .is_some_and(|n| n.header.id() == e.header.id()));
                h.sender != local && h.model == l.model && current
            })
            .take(limit)
            .map(|(e, cosine)| Candidate {
                header: e.header.clone(),
                header_bytes: e.header_bytes.clone(),
                cosine,
            })
            .collect();
        if l.spec.is_some() {
            let mut queue: Vec<usize> = (0..l.candidates.len()).collect();
            let candidates = &l.candidates;
            l.gate.retain_admitted(&mut queue, |&i| {
                candidates.get(i).map_or(f32::NEG_INFINITY, |c| c.cosine)
            });
            l.body_queue = queue.into();
        }
        l.phase = Phase::Fetch;
        // Learn which bands are hot for the next window.
        let mut per_origin: HashMap<(u16, u64), usize> = HashMap::new();
        for k in l.keys.values() {
            *per_origin.entry((k.band, k.value)).or_default() += k.providers.len();
        }
        let window = l.window;
        let used = l.shards_used.clone();
        for ((band, value), providers) in per_origin {
            let (shards, asked) = used.get(&(band, value)).copied().unwrap_or((1, 1));
            // The shards asked stand for all of them (announcers spread evenly).
            let estimate = providers.saturating_mul(shards as usize) / asked.max(1) as usize;
            self.hot
                .observe(band, value, shards, estimate, window, &self.config);
        }
    }

    pub(crate) fn finish_lookup(&mut self, id: LookupId, now: Instant, timed_out: bool) {
        let Some(mut l) = self.lookups.remove(&id) else {
            return;
        };
        if timed_out {
            self.metrics.lookups_timed_out += 1;
            if l.phase == Phase::Discover {
                let unread = l.headers_in_flight.saturating_add(l.queue.len());
                l.stats.providers_unread = l
                    .stats
                    .providers_unread
                    .saturating_add(u32::try_from(unread).unwrap_or(u32::MAX));
                // Rank what was found so far.
                self.lookups.insert(id, l);
                self.rank(id);
                let Some(again) = self.lookups.remove(&id) else {
                    return;
                };
                l = again;
            }
        }
        self.pending.retain(|_, p| p.lookup != id);
        l.packets.sort_by(|a, b| b.cosine.total_cmp(&a.cosine));
        l.stats.elapsed = now.saturating_duration_since(l.started);
        l.stats.timed_out = timed_out;
        self.metrics.lookups_finished += 1;
        tracing::debug!(
            lookup = id.0,
            candidates = l.candidates.len(),
            packets = l.packets.len(),
            kad_requests = ?l.stats.kad_requests,
            timed_out,
            "round lookup finished"
        );
        self.outputs.push_back(Output::LookupFinished {
            lookup: id,
            partners: Box::new(Partners {
                window: l.window,
                candidates: l.candidates,
                packets: l.packets,
                stats: l.stats,
            }),
        });
    }
}

/// How much a header that fails to decode says about the peer that served it.
pub(crate) fn decode_severity(e: &DecodeError) -> Severity {
    match e {
        // A newer peer may speak a version this node does not.
        DecodeError::UnknownVersion { .. } => Severity::Minor,
        _ => Severity::Major,
    }
}
