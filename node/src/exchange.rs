//! The hub exchange in the node: the network driver of `kindred_routing::exchange::Exchange`.
//!
//! The exchange core decides everything (who searches, whom the node pushes to, joining,
//! admission, what a member accepts, bans, deadlines); the simulator drives the
//! same core in virtual time. This driver does what the core asks, over the network and on the
//! node's own model and data:
//! - **Messages**: a push and its answer, a merge fetch and the merge, ride the routing task's
//!   exchange RPCs ([`kindred_routing::exchange_rpc`]); a hub's model is its snapshot
//!   (`GetSnapshot`). A member fetches its merge with a long poll as soon as its hub accepts its
//!   push: the hub parks the request ([`PARK_MS`] at most, then the member asks again) and
//!   answers it when the merge is ready, so a merge costs no extra round trip and no request
//!   ever outlives its timeout.
//! - **Searches** are routing lookups that fetch no body (`top_m` 0): the candidates' headers,
//!   ranked by sketch cosine. A header does not name its sender's hub, so each candidate
//!   stands for itself; a member pushed to answers with its hub ([`HubAnswer::NotHub`]) and the
//!   pusher follows.
//! - **Compute**, inline on the round's task: a hub merges its own sent update with its
//!   admitted members' (`kindred_distill::synthesize_with`) and distills the merge a layer at a
//!   time as it is formed, with a distiller of its own (its own error feedback; released when
//!   a round passes without a merge), sealed under the merge domain
//!   ([`kindred_proto::seal_merge`]); a member checks a merge by direction and norm against its
//!   own sent update (`check_aggregate`), by its output layer against the node's labels
//!   (`check_head`, a doubt: [`MergeVerdict::Doubt`]) and, when the core asks, on its own
//!   training shard (`check_by_data`); a
//!   joining member checks its hub's model the same way and
//!   `check_adoption` decides whether it takes the model or keeps its own.
//! - **Time**: the core's clock is the wall clock in milliseconds; rounds follow
//!   [`crate::run`]'s schedule, and the core's deadline is [`DEADLINE_SHARE`] of the round, so the
//!   node applies, evaluates and checkpoints before the next round starts.
//!
//! Ranks are `kindred_routing::hub_rank_at` of each peer's identity in the round's rank
//! window, computed here, never taken from the network; a peer behind NAT (the routing task
//! saw only relayed addresses for it, or a relayed address in its identify), and this node
//! while it is one, ranks after every dialable peer (`kindred_routing::relay_only_rank`): a
//! hub must accept its members' connections. What persists across a restart is
//! the core's snapshot and the hub distiller's state ([`HubDriver::persist`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use kindred_distill::{
    AggregateCheck, AggregateRejection, Distiller, DistillerState, MIN_GAIN_SHARE, PeerUpdate,
    ShardScores, Update, UpdateView, check_adoption, check_aggregate, check_by_data, check_head,
    decode_iter, decode_update, synthesize_with,
};
use kindred_proto::{Embedding, HeaderFields, ModelSpec, OutcomePacket, PacketBody, seal_merge};
use kindred_routing::exchange::{
    Answer, Apply, Exchange, ExchangeConfig, Input, MergeVerdict, Millis, ModelVerdict, Output,
    Role, RoundReport, SeenHeader, Snapshot, Ticket,
};
use kindred_routing::{
    ExchangeCall, ExchangeError, ExchangeReply, HubAnswer, InboundCall, InboundExchange,
    PartnerQuery, PushedPacket, RoutingHandle, ServedWith, SnapshotError, hub_rank_at,
    relay_only_rank,
};
use libp2p::PeerId;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::engine::{Engine, EngineError, Outgoing};
use crate::merged::MergedUpdate;
use crate::store::Store;

/// The core's deadline, as a share of the round: the rest is for applying, evaluating and
/// checkpointing before the next round.
pub const DEADLINE_SHARE: f64 = 0.9;
/// Longest a hub holds a member's merge fetch before answering "not ready", after which the
/// member asks again at once while the round lasts. Well below the transport's 10 s request
/// timeout: a merge of a 10^8-parameter model (10 MB) made just before the limit still has
/// 6 s to arrive (at 8 s it timed out, `kindred bench-model --params 100000000`).
pub const PARK_MS: u64 = 4_000;
/// Inbound exchange requests waiting for the node, at most (past that, pushes are answered
/// busy by the routing task).
pub const INBOX: usize = 512;
/// How far a hub's model may be from a joining member's, as a multiple of the member's
/// cumulative update (`check_adoption`); the simulator's value.
const ADOPT_MAX_RATIO: f32 = 1.0;
/// Version of the persisted record ([`HubDriver::persist`]).
const RECORD_VERSION: u16 = 1;

/// Why the hub exchange failed in a way the round cannot go on from.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    /// The persisted exchange state does not read back.
    #[error("exchange state: {0}")]
    State(String),
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

type Handle = u64;

/// A payload the core passes around by handle.
#[derive(Debug)]
enum Blob {
    /// The node's own packet of a round.
    Own {
        header: Vec<u8>,
        body: Vec<u8>,
        sent: Arc<Update>,
        samples: u64,
        loss: f32,
    },
    /// A member's pushed update, kept sparse when its packet is (a hub holds one per member
    /// until it merges).
    Pushed { update: Update, samples: u64 },
    /// A hub's model as its cumulative update, the int8 snapshot body it served (`None`: it
    /// has none to serve yet): a quarter of the model in f32, decoded a layer at a time where
    /// it is read ([`kindred_distill::decode_iter`]), never whole.
    Model(Option<PacketBody>),
    /// A merge: a hub's own (with `raw`, the merge before distillation, and the sealed bytes
    /// it serves) or one received from its hub.
    Merge {
        update: Update,
        raw: Option<Vec<f32>>,
        sealed: Option<(Vec<u8>, Vec<u8>)>,
        contributors: Vec<PeerId>,
    },
}

/// A merge a hub serves its members for one round.
#[derive(Debug)]
struct Served {
    header: Vec<u8>,
    body: Vec<u8>,
    listed: Vec<PeerId>,
    /// Members it is served to: whether each still gets the listing, and the sketch cosine of
    /// its push with the hub's own packet (the member keeps it as its anchor: the merge header
    /// carries no embedding).
    to: HashMap<PeerId, (bool, f32)>,
    /// The lineage of the hub's model, served with the merge.
    lineage: u64,
}

/// What one of the driver's network operations brought back.
enum Event {
    /// An operation with nothing to report (a penalty sent to the routing task).
    Done,
    Search {
        round: u64,
        found: Vec<(PeerId, f32)>,
        /// Providers were found but none met: their headers could not be read.
        unreached: bool,
        seconds: f64,
    },
    Model {
        ticket: Ticket,
        model: Option<Option<PacketBody>>,
    },
    Answer {
        from: PeerId,
        round: u64,
        answer: Result<ExchangeReply, ExchangeError>,
        bytes: usize,
    },
    Merge {
        from: PeerId,
        round: u64,
        /// When the fetch was sent (wall clock, ms).
        asked_ms: u64,
        reply: Result<ExchangeReply, ExchangeError>,
    },
}

/// What the node's exchange did in a round: for its status, metrics and round log line. The
/// counters (pushes, refusals, bans, bytes) cover the time since the previous round's report,
/// so what the node served between rounds (a late merge fetch, an early push) is counted in
/// the next round's.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HubRoundStats {
    /// `hub`, `member` or `local`.
    pub role: String,
    /// The hub pushed to (the node itself as a hub or alone).
    pub hub: String,
    /// Peers in the node's cohort view.
    pub cohort: usize,
    /// What was applied: `own`, `merge`, `adopt+merge`, `adopt` or `nothing`.
    pub applied: String,
    /// A merge was expected and did not come.
    pub missed: bool,
    /// Pushes received (as a hub).
    pub pushes_received: u64,
    /// Members whose updates are in the merge served (as a hub).
    pub merged: usize,
    /// Members the merge was served to (as a hub).
    pub served: usize,
    /// Merges refused by the node's checks.
    pub refused: u64,
    /// Peers banned by the exchange.
    pub bans: u64,
    /// Peers whose updates are in the merge applied (the hub's members for a member; its
    /// own members for a hub).
    pub partners: Vec<PeerId>,
    /// Bytes of the packets pushed (header and body, each push answered).
    pub push_bytes: u64,
    /// Bytes of merges received (a member) or served (a hub).
    pub merge_bytes: u64,
    /// Wall time of each DHT search that ended since the last round's stats (the lookup
    /// itself, not the wait for the round's announcements), seconds.
    #[serde(default)]
    pub search_seconds: Vec<f64>,
}

/// The persisted part of the driver.
#[derive(Serialize, Deserialize)]
struct Record {
    version: u16,
    snapshot: Snapshot<PeerId>,
}

/// The hub exchange of one node.
pub struct HubDriver {
    core: Exchange<PeerId, Handle>,
    own: PeerId,
    spec: Arc<ModelSpec>,
    routing: RoutingHandle,
    inbox: mpsc::Receiver<InboundExchange>,
    /// The hub's merge distiller (its own error feedback).
    distiller: Distiller,
    /// Whether that distiller's residual holds anything: set by a merge, cleared when the node
    /// ends a round without having merged (the residual is released then, not kept).
    merge_residual: bool,
    /// The last round the node merged in.
    merged_round: Option<u64>,
    check: AggregateCheck,
    blobs: HashMap<Handle, Blob>,
    next_handle: Handle,
    /// Pushes waiting for the core's answer, by pusher and round.
    pushes: HashMap<(PeerId, u64), kindred_routing::ExchangeResponder>,
    /// Merge fetches parked until the merge is served, with when to give up.
    parked: HashMap<(PeerId, u64), (kindred_routing::ExchangeResponder, u64)>,
    /// Merges served, by round (this one and the last).
    served: BTreeMap<u64, Served>,
    /// Answers to pushes already answered (a refusal at the admission's close): given to the
    /// pusher's merge fetch.
    later: HashMap<(PeerId, u64), HubAnswer>,
    /// Operations in flight.
    ops: FuturesUnordered<BoxFuture<'static, Event>>,
    /// Merge fetches in flight, by hub and round.
    polling: HashSet<(PeerId, u64)>,
    /// The round's own packet handle and header, once ready.
    current: Option<(u64, Handle)>,
    /// The node's newest own header and its SimHash margins (what a search looks up with and
    /// pushes are compared to).
    own_header: Option<(kindred_proto::VerifiedHeader, Vec<f32>)>,
    /// When the round's searches may look up ([`SEARCH_AFTER`]).
    search_after: u64,
    /// How long after its own announcement a search waits before it looks up
    /// ([`SEARCH_MARGIN`] of the round).
    search_margin: u64,
    /// The most a search's lookup is put off at random ([`SEARCH_JITTER`] of the round).
    search_jitter: u64,
    finished: Option<RoundReport<PeerId, Handle>>,
    stats: HubRoundStats,
    /// Peers that others cannot dial (this node too, when it is one), as the routing task
    /// last said: ranked after every dialable peer ([`relay_only_rank`]).
    relay_only: HashSet<PeerId>,
    /// The node and every peer of its cohort are behind NAT: its hub is one of them, reached
    /// only where a hole was punched (said once in the log when it starts and ends).
    no_dialable_peer: bool,
}

impl HubDriver {
    /// Start the node's exchange: serve pushes and merge fetches from now on, restoring the
    /// state `store` holds if any (a node that restarts keeps its cohort view, its joined hub
    /// and its hub's error feedback).
    ///
    /// # Errors
    /// [`HubError`] when the persisted state does not read back or the routing task stopped.
    pub async fn start(
        engine: &Engine,
        routing: RoutingHandle,
        config: ExchangeConfig,
    ) -> Result<Self, HubError> {
        let own = engine.peer_id();
        let mut distiller = engine.new_distiller()?;
        // The exchange's state is worth keeping (the view, the joined hub, the hub's error
        // feedback) but not worth refusing to start over: without it the node searches again.
        let core = match restore(engine, &config, &mut distiller) {
            Ok(Some(core)) => {
                tracing::info!(hub = ?core.joined(), cohort = core.cohort().len(),
                    "exchange state restored");
                core
            }
            Ok(None) => Exchange::new(own, rank(&own, 0), config),
            Err(e) => {
                tracing::warn!(error = %e, "exchange state not restored; starting it afresh");
                distiller = engine.new_distiller()?;
                Exchange::new(own, rank(&own, 0), config)
            }
        };
        let inbox = routing
            .serve_exchange(INBOX)
            .await
            .ok_or_else(|| HubError::State("the routing task has stopped".into()))?;
        Ok(Self {
            core,
            own,
            spec: engine.spec().clone(),
            routing,
            inbox,
            merge_residual: distiller.round() > 0,
            merged_round: None,
            distiller,
            check: AggregateCheck::default(),
            blobs: HashMap::new(),
            next_handle: 0,
            pushes: HashMap::new(),
            parked: HashMap::new(),
            served: BTreeMap::new(),
            later: HashMap::new(),
            ops: FuturesUnordered::new(),
            polling: HashSet::new(),
            current: None,
            own_header: None,
            search_after: 0,
            search_margin: 0,
            search_jitter: 0,
            finished: None,
            stats: HubRoundStats::default(),
            relay_only: HashSet::new(),
            no_dialable_peer: false,
        })
    }

    /// Run round `round` (started at `start_ms`, `round_ms` long) of the exchange with the
    /// node's packet `out`, until the core finishes it (by [`DEADLINE_SHARE`] of the round at
    /// the latest); apply what it says, and return what it did and the update applied.
    ///
    /// # Errors
    /// [`HubError`] when the engine cannot apply what the round ends with.
    pub async fn round(
        &mut self,
        engine: &mut Engine,
        out: &Outgoing,
        round: u64,
        start_ms: u64,
        round_ms: u64,
    ) -> Result<(HubRoundStats, MergedUpdate), HubError> {
        // Counters run on from between rounds ([`HubDriver::idle_until`]).
        self.finished = None;
        let deadline_ms = start_ms + (round_ms as f64 * DEADLINE_SHARE) as u64;
        self.search_after = start_ms + (round_ms as f64 * SEARCH_AFTER) as u64;
        self.search_margin = (round_ms as f64 * SEARCH_MARGIN) as u64;
        self.search_jitter = (round_ms as f64 * SEARCH_JITTER) as u64;
        let window = self.core.window_of(round);
        let reach_changed = self.refresh_reachability().await;
        if window != self.core.rank_window() || reach_changed {
            let relay_only = &self.relay_only;
            self.core
                .rerank(window, |p| reachable_rank(p, window, relay_only));
        }
        // Blobs of past rounds are not asked for again (the core drops their tickets).
        self.blobs.clear();
        self.served.retain(|&r, _| r + 1 >= round);
        self.later.retain(|&(_, r), _| r + 1 >= round);
        // A push the core never answered (its round is over) is dropped: its stream closes.
        self.pushes.retain(|&(_, r), _| r + 1 >= round);
        let packet = self.put(Blob::Own {
            header: out.packet.header_bytes.clone(),
            body: out.packet.body_bytes.clone(),
            sent: out.sent.clone(),
            samples: out.samples,
            loss: out.loss,
        });
        self.current = Some((round, packet));
        self.own_header = Some((out.packet.header.clone(), out.margins.clone()));
        let now = Millis(now_ms());
        self.core.handle(
            now,
            Input::RoundStart {
                round,
                deadline: Millis(deadline_ms),
            },
        );
        self.core.handle(now, Input::PacketReady { round, packet });
        self.pump(engine, deadline_ms).await?;
        let report = self.finished.take();
        let delta = match report {
            Some(report) => tokio::task::block_in_place(|| self.finish(engine, &report))?,
            None => {
                // Not reachable while the core keeps its contract; apply the own update.
                tracing::warn!(
                    round,
                    "the exchange did not finish its round by the deadline"
                );
                engine.apply(None, Some(out.sent.view()))?
            }
        };
        self.stats.cohort = self.core.cohort().len();
        // The round's vectors (own and pushed updates, merges, models) are not read after its
        // end: the core asks nothing more of a finished round, and late merge fetches are
        // served from `served`. Dropped now rather than at the next round's start, they do not
        // sit beside the next upload and packet (a few model-sized vectors).
        self.blobs.clear();
        Ok((std::mem::take(&mut self.stats), delta))
    }

    /// Serve peers (pushes, merge fetches) until `until_ms`: between rounds.
    ///
    /// # Errors
    /// [`HubError`] when the engine fails a check it was asked for.
    pub async fn idle_until(&mut self, engine: &mut Engine, until_ms: u64) -> Result<(), HubError> {
        self.pump_until(engine, until_ms).await
    }

    /// Persist the core's snapshot and the hub distiller's state; call before the round's
    /// checkpoint, which makes them durable with it.
    ///
    /// # Errors
    /// [`HubError::Store`] when writing fails.
    pub fn persist(&self, store: &Store) -> Result<(), HubError> {
        let record = Record {
            version: RECORD_VERSION,
            snapshot: self.core.snapshot(),
        };
        let bytes = postcard::to_allocvec(&record).map_err(|e| HubError::State(e.to_string()))?;
        // A released residual is not written (a zero vector the model's size each round); the
        // distiller then restarts its round count with the node.
        let blob = if self.merge_residual && self.distiller.round() > 0 {
            Some(store.put_blob_parts(&self.distiller.encoded_state().parts())?)
        } else {
            None
        };
        store.put_exchange(&bytes, blob)?;
        Ok(())
    }

    fn put(&mut self, blob: Blob) -> Handle {
        let h = self.next_handle;
        self.next_handle += 1;
        self.blobs.insert(h, blob);
        h
    }

    /// Drive the core until its round finishes or `deadline_ms` passes.
    async fn pump(&mut self, engine: &mut Engine, deadline_ms: u64) -> Result<(), HubError> {
        // The core finishes by its deadline once its timer fires there; a little slack for the
        // timer itself.
        let limit = deadline_ms.saturating_add(200);
        loop {
            self.drain_blocking(engine)?;
            if self.finished.is_some() {
                return Ok(());
            }
            if now_ms() >= limit {
                return Ok(());
            }
            self.step(limit).await;
        }
    }

    async fn pump_until(&mut self, engine: &mut Engine, until_ms: u64) -> Result<(), HubError> {
        loop {
            self.drain_blocking(engine)?;
            if now_ms() >= until_ms {
                return Ok(());
            }
            self.step(until_ms).await;
        }
    }

    /// Wait for the next thing to happen (an inbound request, an operation's end, the core's
    /// timer, a parked fetch to give up, or `limit_ms`) and handle it.
    async fn step(&mut self, limit_ms: u64) {
        let mut wake = limit_ms;
        if let Some(t) = self.core.poll_timeout() {
            wake = wake.min(t.0);
        }
        if let Some(t) = self.parked.values().map(|(_, at)| *at).min() {
            wake = wake.min(t);
        }
        let sleep = tokio::time::sleep(Duration::from_millis(wake.saturating_sub(now_ms())));
        tokio::select! {
            // Decoding a pushed or merged update (and verifying its hash) takes seconds at a
            // large model's size: off the runtime's worker, as the merges below.
            Some(inbound) = self.inbox.recv() => {
                tokio::task::block_in_place(|| self.on_inbound(inbound));
            }
            Some(event) = self.ops.next(), if !self.ops.is_empty() => {
                tokio::task::block_in_place(|| self.on_event(event));
            }
            () = sleep => {
                let now = now_ms();
                self.core.handle_timeout(Millis(now));
                let expired: Vec<_> = self
                    .parked
                    .iter()
                    .filter(|(_, (_, at))| *at <= now)
                    .map(|(k, _)| *k)
                    .collect();
                for key in expired {
                    if let Some((reply, _)) = self.parked.remove(&key) {
                        reply.not_ready();
                    }
                }
            }
        }
    }

    fn rank(&self, peer: &PeerId) -> u64 {
        reachable_rank(peer, self.core.rank_window(), &self.relay_only)
    }

    /// Whether this node and every peer of its cohort are behind NAT (as of its last round).
    pub fn no_dialable_peer(&self) -> bool {
        self.no_dialable_peer
    }

    /// Ask the routing task which peers others cannot dial (this node too: while AutoNAT
    /// says it is private, while it holds a relay reservation, and before AutoNAT's first
    /// verdict if none of its addresses looks dialable); whether that changed.
    async fn refresh_reachability(&mut self) -> bool {
        use kindred_routing::reachability::NatStatus;
        let Some(info) = self.routing.info().await else {
            return false;
        };
        let mut relay_only: HashSet<PeerId> = info.relay_only.into_iter().collect();
        let dialable_addr = info
            .external_addrs
            .iter()
            .any(|a| !kindred_routing::direct_only::is_relayed(a));
        let unreachable = match info.reachability {
            NatStatus::Private => true,
            NatStatus::Unknown => !dialable_addr,
            NatStatus::Public => false,
        };
        let dialable = !unreachable && info.relays.is_empty();
        self.core.set_dialable(dialable);
        if !dialable {
            relay_only.insert(self.own);
        }
        let cohort = self.core.cohort();
        let no_dialable_peer =
            !dialable && !cohort.is_empty() && cohort.members().all(|p| relay_only.contains(p));
        if no_dialable_peer != self.no_dialable_peer {
            self.no_dialable_peer = no_dialable_peer;
            if no_dialable_peer {
                tracing::warn!(
                    cohort = cohort.len(),
                    "exchange: no dialable peer in this node's cohort (all behind NAT): its hub \
                     is one of them, reached only where a hole punch succeeds; a node with a \
                     forwarded port or a public address would head it"
                );
            } else {
                tracing::info!("exchange: the cohort has a dialable peer again");
            }
        }
        if relay_only == self.relay_only {
            return false;
        }
        tracing::debug!(
            peers = relay_only.len(),
            own = relay_only.contains(&self.own),
            "exchange: peers behind NAT rank after every dialable one"
        );
        self.relay_only = relay_only;
        true
    }

    /// [`Self::drain`] with the runtime told that this thread blocks: merging, checking and
    /// applying a large model's updates take seconds, and the tasks queued on this worker (the
    /// routing task among them, serving the merge a member is fetching) move to another
    /// meanwhile instead of waiting for it.
    fn drain_blocking(&mut self, engine: &mut Engine) -> Result<(), HubError> {
        tokio::task::block_in_place(|| self.drain(engine))
    }

    /// Carry out every output the core has.
    fn drain(&mut self, engine: &mut Engine) -> Result<(), HubError> {
        while let Some(output) = self.core.poll_output() {
            self.carry(engine, output)?;
        }
        Ok(())
    }

    fn carry(
        &mut self,
        engine: &mut Engine,
        output: Output<PeerId, Handle>,
    ) -> Result<(), HubError> {
        match output {
            Output::Search {
                round,
                announce,
                probes,
            } => {
                let routing = self.routing.clone();
                let Some((header, margins)) = self.own_header.clone() else {
                    self.core.handle(
                        Millis(now_ms()),
                        Input::SearchDone {
                            round,
                            headers: Vec::new(),
                        },
                    );
                    return Ok(());
                };
                let mut query = PartnerQuery::new(header.clone(), margins, self.spec.clone());
                query.top_m = Some(0);
                query.probes = Some(probes);
                // Put off at random, so that nodes behind NAT do not dial each other at once.
                let jitter = rand::random_range(0..=self.search_jitter);
                let (not_before, margin) = (self.search_after, self.search_margin);
                self.ops.push(Box::pin(async move {
                    if announce {
                        match routing.announce(header).await {
                            Ok(_) => tracing::debug!(round, "announced"),
                            Err(e) => tracing::warn!(round, error = %e, "announce failed"),
                        }
                    }
                    // Peers that trained a little longer announce a little later: a lookup
                    // made the moment this node's own packet is out misses them.
                    let wait = not_before
                        .max(now_ms().saturating_add(margin))
                        .saturating_sub(now_ms())
                        .saturating_add(jitter);
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                    let started = std::time::Instant::now();
                    let mut unreached = false;
                    let found: Vec<(PeerId, f32)> = match routing.find_partners(query).await {
                        Ok(p) => {
                            let s = &p.stats;
                            // Providers whose headers could not be read (behind NAT, the
                            // hole punch still under way): the core searches again next
                            // round. Headers read from others (another task's public
                            // node) do not make up for them.
                            unreached = s.providers_unread > 0;
                            tracing::debug!(
                                round,
                                announce,
                                probes,
                                keys = s.key_lookups,
                                providers = s.providers,
                                headers = s.headers_accepted,
                                unread = s.providers_unread,
                                candidates = p.candidates.len(),
                                best = p.candidates.first().map(|c| c.cosine),
                                timed_out = s.timed_out,
                                "search done"
                            );
                            p.candidates
                                .iter()
                                .map(|c| (c.header.header().sender, c.cosine))
                                .collect()
                        }
                        Err(e) => {
                            tracing::warn!(round, error = %e, "search failed");
                            Vec::new()
                        }
                    };
                    let seconds = started.elapsed().as_secs_f64();
                    Event::Search {
                        round,
                        found,
                        unreached,
                        seconds,
                    }
                }));
            }
            Output::FetchModel { ticket, hub } => {
                let routing = self.routing.clone();
                let spec = self.spec.clone();
                self.ops.push(Box::pin(async move {
                    let model = match routing.fetch_snapshot(hub, spec.clone(), 0).await {
                        // Kept as fetched (its layers were checked as they decoded); what
                        // reads it checks that every value decodes.
                        Ok(snapshot) => match decode_iter(&snapshot.body, &spec) {
                            Ok(_) => Some(Some(snapshot.body)),
                            Err(e) => {
                                tracing::debug!(%hub, error = %e, "hub model not usable");
                                None
                            }
                        },
                        // Nothing to serve yet (a hub's first round): join with its merge.
                        Err(SnapshotError::NotFound) => Some(None),
                        Err(e) => {
                            tracing::debug!(%hub, error = %e, "hub model not fetched");
                            None
                        }
                    };
                    Event::Model { ticket, model }
                }));
            }
            Output::CheckModel { ticket, hub, model } => {
                let verdict = self.check_model(engine, model)?;
                tracing::debug!(%hub, ?verdict, "hub model checked");
                self.core
                    .handle(Millis(now_ms()), Input::ModelChecked { ticket, verdict });
            }
            Output::Push {
                to,
                round,
                packet,
                known,
                ..
            } => {
                let Some(Blob::Own { header, body, .. }) = self.blobs.get(&packet) else {
                    return Ok(());
                };
                let bytes = header.len() + body.len();
                let call = ExchangeCall::Push(PushedPacket {
                    round,
                    header: header.clone(),
                    body: body.clone(),
                    known: known.into_iter().map(|(p, _)| p).collect(),
                });
                let routing = self.routing.clone();
                self.ops.push(Box::pin(async move {
                    let answer = routing.exchange_call(to, call).await;
                    Event::Answer {
                        from: to,
                        round,
                        answer,
                        bytes,
                    }
                }));
            }
            Output::Answer { to, round, answer } => {
                let answer = match answer {
                    Answer::Accepted { .. } => HubAnswer::Accepted,
                    Answer::NotHub { hub, .. } => HubAnswer::NotHub(hub),
                    // The node runs one hub per cohort (`ExchangeConfig::fanout` is `None`):
                    // the wire has no tree answers yet, and a hint reads as a redirect.
                    Answer::Full { hint, .. } => HubAnswer::NotHub(hint),
                    Answer::Busy => HubAnswer::Busy,
                    Answer::Late => HubAnswer::Late,
                    Answer::Refused { foreign } => HubAnswer::Refused { foreign },
                };
                tracing::debug!(%to, round, ?answer, "push answered");
                if let Some(reply) = self.pushes.remove(&(to, round)) {
                    reply.answer(&answer);
                } else if let Some((reply, _)) = self.parked.remove(&(to, round)) {
                    // The push was answered already: a later answer goes to its merge fetch.
                    reply.answer(&answer);
                } else {
                    self.later.insert((to, round), answer);
                }
            }
            Output::Merge {
                ticket,
                round,
                own,
                members,
                ..
            } => {
                let began = std::time::Instant::now();
                let merge = self.hub_merge(engine, round, own, &members)?;
                tracing::debug!(
                    round,
                    members = members.len(),
                    made = merge.is_some(),
                    ms = began.elapsed().as_millis() as u64,
                    "hub merge computed"
                );
                let merge = merge.map(|m| self.put(m));
                self.core
                    .handle(Millis(now_ms()), Input::MergeComputed { ticket, merge });
            }
            Output::CheckMerge {
                ticket,
                hub,
                merge,
                own,
                by_data,
            } => {
                let verdict = self.check_merge(engine, &hub, merge, own, by_data)?;
                if verdict != MergeVerdict::Pass {
                    self.stats.refused += 1;
                }
                self.core
                    .handle(Millis(now_ms()), Input::MergeChecked { ticket, verdict });
            }
            Output::ServeMerge {
                to,
                round,
                merge,
                lineage,
                listed,
            } => {
                let Some(Blob::Merge {
                    sealed: Some((header, body)),
                    contributors,
                    ..
                }) = self.blobs.get(&merge)
                else {
                    return Ok(());
                };
                self.stats.merged = contributors.len();
                self.stats.served = to.len();
                self.stats.partners = contributors.clone();
                let served = Served {
                    header: header.clone(),
                    body: body.clone(),
                    listed: listed.into_iter().map(|(p, _)| p).collect(),
                    to: to
                        .into_iter()
                        .map(|r| (r.peer, (r.listed, r.cosine)))
                        .collect(),
                    lineage,
                };
                let waiting: Vec<_> = self
                    .parked
                    .keys()
                    .filter(|(p, r)| *r == round && served.to.contains_key(p))
                    .copied()
                    .collect();
                self.served.insert(round, served);
                for key in waiting {
                    if let Some((reply, _)) = self.parked.remove(&key) {
                        self.serve(key.0, key.1, reply);
                    }
                }
            }
            Output::FetchMerge { hub, round } => self.poll_merge(hub, round),
            Output::Ban { peer } => {
                self.stats.bans += 1;
                tracing::warn!(%peer, "exchange: peer banned (its merge failed a check, or its model twice)");
                let routing = self.routing.clone();
                self.ops.push(Box::pin(async move {
                    routing.report_invalid(peer, "exchange_ban").await;
                    Event::Done
                }));
            }
            Output::Finished(report) => {
                // A merge fetch still parked for this round gets nothing more from this node.
                let round = report.round;
                let done: Vec<_> = self
                    .parked
                    .keys()
                    .filter(|(_, r)| *r <= round)
                    .copied()
                    .collect();
                for key in done {
                    if let Some((reply, _)) = self.parked.remove(&key) {
                        reply.not_ready();
                    }
                }
                self.finished = Some(report);
            }
        }
        Ok(())
    }

    fn on_inbound(&mut self, inbound: InboundExchange) {
        let InboundExchange { peer, call, reply } = inbound;
        let now = Millis(now_ms());
        match call {
            InboundCall::Push(PushedPacket {
                round,
                header,
                body,
                known,
            }) => {
                let packet = match OutcomePacket::decode(&header, &body, &self.spec) {
                    Ok(p) => p,
                    Err(e) => return self.invalid(peer, e.reason()),
                };
                let h = packet.header.header();
                if h.sender != peer {
                    return self.invalid(peer, "foreign_sender");
                }
                if h.round != round {
                    return self.invalid(peer, "round_mismatch");
                }
                let Ok(update) = decode_update(&packet.body, &self.spec) else {
                    return self.invalid(peer, "undecodable_update");
                };
                self.stats.pushes_received += 1;
                let cosine = self
                    .own_header
                    .as_ref()
                    .map_or(0.0, |(own, _)| own.header().embedding.cosine(&h.embedding));
                let samples = h.samples;
                let handle = self.put(Blob::Pushed { update, samples });
                if let Some(old) = self.pushes.insert((peer, round), reply) {
                    old.answer(&HubAnswer::Busy);
                }
                let known = known.into_iter().map(|p| (p, self.rank(&p))).collect();
                let rank = self.rank(&peer);
                self.core.handle(
                    now,
                    Input::PushReceived {
                        from: peer,
                        rank,
                        round,
                        packet: handle,
                        cosine,
                        known,
                        via: None,
                    },
                );
            }
            InboundCall::GetMerge { round } => {
                if self
                    .served
                    .get(&round)
                    .is_some_and(|s| s.to.contains_key(&peer))
                {
                    return self.serve(peer, round, reply);
                }
                if let Some(answer) = self.later.remove(&(peer, round)) {
                    return reply.answer(&answer);
                }
                let give_up = now.0 + PARK_MS;
                if let Some((old, _)) = self.parked.insert((peer, round), (reply, give_up)) {
                    old.not_ready();
                }
                self.core
                    .handle(now, Input::MergeAsked { from: peer, round });
            }
        }
    }

    fn invalid(&mut self, peer: PeerId, reason: &'static str) {
        tracing::debug!(%peer, reason, "invalid push");
        let routing = self.routing.clone();
        self.ops.push(Box::pin(async move {
            routing.report_invalid(peer, reason).await;
            Event::Done
        }));
    }

    fn serve(&mut self, peer: PeerId, round: u64, reply: kindred_routing::ExchangeResponder) {
        let Some(s) = self.served.get_mut(&round) else {
            return reply.not_ready();
        };
        let (listed, cosine) = match s.to.get_mut(&peer) {
            Some((listed, cosine)) => (std::mem::replace(listed, false), *cosine),
            None => return reply.not_ready(),
        };
        self.stats.merge_bytes += (s.header.len() + s.body.len()) as u64;
        let names: &[PeerId] = if listed { &s.listed } else { &[] };
        let with = ServedWith {
            cosine,
            lineage: s.lineage,
        };
        reply.merge(s.header.clone(), s.body.clone(), with, names);
    }

    fn poll_merge(&mut self, hub: PeerId, round: u64) {
        if !self.polling.insert((hub, round)) {
            return;
        }
        let routing = self.routing.clone();
        let call = ExchangeCall::GetMerge {
            round,
            spec: self.spec.clone(),
        };
        let asked_ms = now_ms();
        self.ops.push(Box::pin(async move {
            let reply = routing.exchange_call(hub, call).await;
            Event::Merge {
                from: hub,
                round,
                asked_ms,
                reply,
            }
        }));
    }

    fn on_event(&mut self, event: Event) {
        let now = Millis(now_ms());
        match event {
            Event::Done => {}
            Event::Search {
                round,
                found,
                unreached,
                seconds,
            } => {
                self.stats.search_seconds.push(seconds);
                let headers = found
                    .into_iter()
                    .filter(|(p, _)| *p != self.own)
                    .map(|(peer, cosine)| {
                        let rank = self.rank(&peer);
                        SeenHeader {
                            peer,
                            rank,
                            cosine,
                            hub: peer,
                            hub_rank: rank,
                        }
                    })
                    .collect();
                self.core.handle(now, Input::SearchDone { round, headers });
                if unreached {
                    self.core.search_unreached(round);
                }
            }
            Event::Model { ticket, model } => {
                let model = model.map(|m| self.put(Blob::Model(m)));
                self.core
                    .handle(now, Input::ModelReceived { ticket, model });
            }
            Event::Answer {
                from,
                round,
                answer,
                bytes,
            } => {
                let answer = match answer {
                    Ok(ExchangeReply::Answer(a)) => a,
                    Ok(_) => return,
                    Err(e) => {
                        tracing::debug!(%from, round, error = %e, "push not answered");
                        return;
                    }
                };
                self.stats.push_bytes += bytes as u64;
                tracing::debug!(%from, round, ?answer, "push's answer");
                let answer = self.core_answer(answer);
                let accepted = matches!(answer, Answer::Accepted { .. });
                self.core.handle(
                    now,
                    Input::AnswerReceived {
                        from,
                        round,
                        answer,
                    },
                );
                if accepted {
                    self.poll_merge(from, round);
                }
            }
            Event::Merge {
                from,
                round,
                asked_ms,
                reply,
            } => {
                self.polling.remove(&(from, round));
                let (merge, bytes, cosine, lineage, listed) = match reply {
                    Ok(ExchangeReply::Merge {
                        merge,
                        bytes,
                        cosine,
                        lineage,
                        listed,
                    }) => (merge, bytes, cosine, lineage, listed),
                    Ok(ExchangeReply::Answer(answer)) => {
                        let answer = self.core_answer(answer);
                        self.core.handle(
                            now,
                            Input::AnswerReceived {
                                from,
                                round,
                                answer,
                            },
                        );
                        return;
                    }
                    Ok(ExchangeReply::NotReady) => {
                        // A long poll the hub held to its limit: its merge is still being made
                        // (large models take seconds), so ask again while the round lasts.
                        // A quick "not ready" is left to the core's own ask.
                        let held = now.0.saturating_sub(asked_ms) >= PARK_MS / 2;
                        let current = self.current.is_some_and(|(r, _)| r == round);
                        if held && current {
                            self.poll_merge(from, round);
                        }
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(%from, round, error = %e, "merge not fetched");
                        return;
                    }
                };
                let Ok(update) = decode_update(&merge.body, &self.spec) else {
                    return self.invalid(from, "undecodable_update");
                };
                self.stats.merge_bytes += bytes as u64;
                let handle = self.put(Blob::Merge {
                    update,
                    raw: None,
                    sealed: None,
                    contributors: Vec::new(),
                });
                let listed = listed.into_iter().map(|p| (p, self.rank(&p))).collect();
                self.core.handle(
                    now,
                    Input::MergeReceived {
                        from,
                        round,
                        merge: handle,
                        cosine,
                        lineage,
                        listed,
                    },
                );
            }
        }
    }

    /// A hub's answer as the core takes it, a redirect's hub ranked here.
    fn core_answer(&self, answer: HubAnswer) -> Answer<PeerId> {
        match answer {
            HubAnswer::Accepted => Answer::Accepted { depth: 0 },
            HubAnswer::NotHub(hub) => Answer::NotHub {
                hub,
                rank: self.rank(&hub),
            },
            HubAnswer::Busy => Answer::Busy,
            HubAnswer::Late => Answer::Late,
            HubAnswer::Refused { foreign } => Answer::Refused { foreign },
        }
    }

    /// A hub's merge of its own sent update and its members', distilled with its own error
    /// feedback and sealed under the merge domain; `None` when it cannot be made.
    fn hub_merge(
        &mut self,
        engine: &Engine,
        round: u64,
        own: Handle,
        members: &[(PeerId, Handle)],
    ) -> Result<Option<Blob>, HubError> {
        let Some(Blob::Own {
            sent,
            samples,
            loss,
            ..
        }) = self.blobs.get(&own)
        else {
            return Ok(None);
        };
        let mut peers = Vec::with_capacity(members.len());
        let mut refs = Vec::with_capacity(members.len());
        for (p, h) in members {
            if let Some(Blob::Pushed { update, samples }) = self.blobs.get(h) {
                peers.push(*p);
                refs.push(PeerUpdate {
                    update,
                    samples: *samples,
                });
            }
        }
        let synth = kindred_distill::SynthConfig::for_hub(refs.len());
        // The merge is distilled as it is formed, a layer at a time: never whole in memory (at a
        // large model's size, one model less at the hub's peak). A built-in trainer's data
        // check reads the merge whole, and so does the adversary's tampering.
        let whole = !engine.is_external() || cfg!(feature = "adversary");
        let distiller = &mut self.distiller;
        #[cfg(feature = "adversary")]
        let spec = &self.spec;
        let own_update = PeerUpdate {
            update: sent,
            samples: *samples,
        };
        let synthesis = match synthesize_with(own_update, &refs, &synth, |m| {
            if !whole {
                return (distiller.distill_from(&mut m.source()), None);
            }
            // What the hub's own data checks: the merge it made (a lying hub checks the honest
            // one and serves another).
            let raw = m.to_vec();
            #[cfg(feature = "adversary")]
            let served = {
                let mut served = raw.clone();
                adversary::tamper(&mut served, spec);
                served
            };
            #[cfg(not(feature = "adversary"))]
            let served = &raw;
            (distiller.distill(served.as_slice()), Some(raw))
        }) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(round, error = %e, "hub cannot merge");
                return Ok(None);
            }
        };
        self.merge_residual = true;
        self.merged_round = Some(round);
        let contributors: Vec<PeerId> = synthesis
            .accepted_by_agreement()
            .into_iter()
            .filter_map(|k| peers.get(k).copied())
            .collect();
        for (p, v) in peers.iter().zip(&synthesis.verdicts) {
            if let kindred_distill::Verdict::Rejected(r) = v {
                tracing::debug!(round, member = %p, reason = r.reason(), "hub leaves a push out");
            }
        }
        let (distilled, raw) = synthesis.merged;
        let distilled = match distilled {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(round, error = %e, "hub cannot distill its merge");
                return Ok(None);
            }
        };
        let total: u64 = std::iter::once(*samples)
            .chain(refs.iter().map(|r| r.samples))
            .fold(0u64, u64::saturating_add)
            .min(kindred_proto::MAX_SAMPLES);
        let fields = HeaderFields {
            round,
            unix_ms: now_ms(),
            samples: total,
            loss: *loss,
            // Members learn the hub's cosine with their push from the merge response.
            embedding: Embedding::default(),
        };
        let sealed = match seal_merge(engine.keypair(), &self.spec, fields, &distilled.body) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(round, error = %e, "hub cannot seal its merge");
                return Ok(None);
            }
        };
        let update = decode_update(&distilled.body, &self.spec)
            .map_err(|e| EngineError::Distill(e.to_string()))?;
        Ok(Some(Blob::Merge {
            update,
            // Only the hub's own data check reads it (none with an external trainer).
            raw: raw.filter(|_| !engine.is_external()),
            sealed: Some((sealed.header_bytes, sealed.body_bytes)),
            contributors,
        }))
    }

    /// A joining member's data on its hub's model: refused if it keeps too little of the
    /// node's own gain on its shard, adopted if it is near the node's model
    /// (`check_adoption`), kept at a distance otherwise (or with nothing to fetch, or no data
    /// here: an external trainer).
    fn check_model(&self, engine: &mut Engine, model: Handle) -> Result<ModelVerdict, HubError> {
        let Some(Blob::Model(Some(cumulative))) = self.blobs.get(&model) else {
            return Ok(ModelVerdict::Keep);
        };
        let spec = &self.spec;
        // The hub's model, `origin + cumulative`, is read a layer at a time where needed rather
        // than built: at a large model's size it would be one more model in f32. Its layout
        // was checked when it was fetched; a layer that does not decode ends the values early
        // (zeros for the data check, a length the adoption check refuses).
        let values = || decode_iter(cumulative, spec).into_iter().flatten();
        let offered = |engine: &Engine| -> Vec<f32> {
            let cumulative = values().chain(std::iter::repeat(0.0));
            engine
                .origin()
                .iter()
                .zip(cumulative)
                .map(|(o, c)| o + c)
                .collect()
        };
        let own = |engine: &Engine| engine.base().to_vec();
        if let Some(share) = data_refuses(engine, own, offered)? {
            tracing::debug!(share, "the node's data refuses the hub's model");
            return Ok(ModelVerdict::Refuse);
        }
        let offered = engine.origin().iter().zip(values()).map(|(o, c)| o + c);
        if let Err(e) = check_adoption(engine.base(), offered, engine.origin(), ADOPT_MAX_RATIO) {
            tracing::debug!(error = %e, "hub model kept at a distance");
            return Ok(ModelVerdict::Keep);
        }
        Ok(ModelVerdict::Adopt)
    }

    /// A merge's checks: a hub's own merge (before distillation) on its data; a member's hub's
    /// merge against its own sent update (direction and norm) and, if `by_data`, on its data.
    fn check_merge(
        &self,
        engine: &mut Engine,
        hub: &PeerId,
        merge: Handle,
        own: Handle,
        by_data: bool,
    ) -> Result<MergeVerdict, HubError> {
        let (Some(Blob::Merge { update, raw, .. }), Some(Blob::Own { sent, .. })) =
            (self.blobs.get(&merge), self.blobs.get(&own))
        else {
            return Ok(MergeVerdict::Aggregate);
        };
        /// The node's model moved by `u`, built when a check by data asks for it.
        fn moved<'a>(u: impl Into<UpdateView<'a>>) -> impl FnOnce(&Engine) -> Vec<f32> + 'a {
            let u = u.into();
            move |engine| {
                let mut m = engine.base().to_vec();
                for (i, u) in u.nonzero() {
                    if let Some(m) = m.get_mut(i) {
                        *m += u;
                    }
                }
                m
            }
        }
        if *hub == self.own {
            let raw = raw.as_deref().map_or(update.view(), UpdateView::from);
            return Ok(
                match data_refuses(engine, moved(sent.as_ref()), moved(raw))? {
                    Some(share) => {
                        tracing::debug!(share, "the hub's data refuses its merge");
                        MergeVerdict::Data
                    }
                    None => MergeVerdict::Pass,
                },
            );
        }
        if let Err(e) = check_aggregate(sent.as_ref(), update, &self.check) {
            tracing::info!(%hub, error = %e, "merge refused");
            return Ok(MergeVerdict::Aggregate);
        }
        if let Some(scores) = engine.head_scores(update, sent)? {
            tracing::debug!(%hub, merge = scores.merge, own = scores.own, "output layers");
            if check_head(scores).is_err() {
                tracing::info!(
                    %hub,
                    merge = scores.merge,
                    own = scores.own,
                    "merge refused by its output layer"
                );
                return Ok(MergeVerdict::Doubt);
            }
        }
        if by_data && let Some(share) = data_refuses(engine, moved(sent.as_ref()), moved(update))? {
            tracing::info!(%hub, share, "merge refused by the node's data");
            return Ok(MergeVerdict::Data);
        }
        Ok(MergeVerdict::Pass)
    }

    /// Apply what the round ended with; returns the change to the node's model.
    fn finish(
        &mut self,
        engine: &mut Engine,
        report: &RoundReport<PeerId, Handle>,
    ) -> Result<MergedUpdate, HubError> {
        self.stats.role = match report.role {
            Role::Local => "local",
            Role::Hub => "hub",
            Role::Member => "member",
        }
        .into();
        self.stats.hub = report.hub.to_string();
        self.stats.missed = report.missed;
        if self.merge_residual && self.merged_round != Some(report.round) {
            // What the node's merges left unsent was the cohort's it served, which it did not
            // serve this round (it follows another hub, or had no members): dropped rather than
            // added to a later cohort's merge, and its memory (half the model's) freed. The
            // simulator's driver does the same.
            self.distiller.reset_residual();
            self.merge_residual = false;
            tracing::debug!(hub = %report.hub, "merge residual released");
        }
        // The hub's model to adopt leaves the round's blobs (cleared after this).
        let adopt = match &report.apply {
            Apply::Merge { adopt: Some(h), .. } | Apply::Adopt(h) => match self.blobs.remove(h) {
                Some(Blob::Model(Some(body))) => Some(body),
                _ => None,
            },
            _ => None,
        };
        let update = |h: &Handle| match self.blobs.get(h) {
            Some(Blob::Merge { update, .. }) => Some(update.view()),
            Some(Blob::Own { sent, .. }) => Some(sent.view()),
            _ => None,
        };
        let (applied, delta) = match &report.apply {
            Apply::Own(p) => ("own", engine.apply(None, update(p))?),
            Apply::Merge { merge, .. } => {
                let label = if adopt.is_some() {
                    "adopt+merge"
                } else {
                    "merge"
                };
                if report.role == Role::Member {
                    self.stats.partners = vec![report.hub];
                }
                (label, engine.apply(adopt.as_ref(), update(merge))?)
            }
            Apply::Adopt(_) => ("adopt", engine.apply(adopt.as_ref(), None)?),
            Apply::Nothing => ("nothing", engine.apply(None, None)?),
        };
        self.stats.applied = applied.into();
        Ok(delta)
    }
}

/// The exchange core and the hub distiller as the store left them, if it holds them.
fn restore(
    engine: &Engine,
    config: &ExchangeConfig,
    distiller: &mut Distiller,
) -> Result<Option<Exchange<PeerId, Handle>>, HubError> {
    let Some((bytes, blob)) = engine.store().exchange()? else {
        return Ok(None);
    };
    let record: Record =
        postcard::from_bytes(&bytes).map_err(|e| HubError::State(format!("record: {e}")))?;
    if record.version != RECORD_VERSION {
        return Err(HubError::State(format!(
            "record version {}, this build reads {RECORD_VERSION}",
            record.version
        )));
    }
    if let Some(id) = blob {
        let state = DistillerState::from_bytes(&engine.store().get_blob(&id)?, engine.spec())
            .map_err(|e| HubError::State(format!("hub distiller: {e}")))?;
        distiller
            .restore(state)
            .map_err(|e| HubError::State(format!("hub distiller: {e}")))?;
    }
    Exchange::restore(config.clone(), record.snapshot)
        .map(Some)
        .map_err(|e| HubError::State(e.to_string()))
}

/// A lying hub, for adversarial tests only (feature `adversary`).
#[cfg(feature = "adversary")]
mod adversary {
    use kindred_proto::ModelSpec;

    /// Corrupt a hub's merge before it is distilled and served, as `KINDRED_ADVERSARY` says:
    /// `flip` negates it, `scale` multiplies it by 10, `foreign` makes it another task's merge;
    /// anything else leaves it.
    pub(super) fn tamper(update: &mut [f32], spec: &ModelSpec) {
        match std::env::var("KINDRED_ADVERSARY").as_deref() {
            Ok("flip") => update.iter_mut().for_each(|x| *x = -*x),
            Ok("scale") => update.iter_mut().for_each(|x| *x *= 10.0),
            Ok("foreign") => relabel(update, spec),
            _ => {}
        }
    }

    /// The merge of the next label-shift task (`y → y + 1`, as the demo's clusters): the
    /// output layer's rows, weights and bias, rolled by one class, so the update teaches label
    /// `y + 1` what the cohort's taught label `y`. Left as it is if the model does not end in
    /// a `[classes, hidden]` weight and a `[classes]` bias.
    fn relabel(update: &mut [f32], spec: &ModelSpec) {
        let layers = spec.layers();
        let [.., weight, bias] = layers else {
            return;
        };
        let (&[classes, hidden], &[bias_len]) = (weight.shape(), bias.shape()) else {
            return;
        };
        if classes != bias_len {
            return;
        }
        let total = update.len();
        let (w, b) = (weight.numel() as usize, bias.numel() as usize);
        let Some(start) = total.checked_sub(w + b) else {
            return;
        };
        let Some(tail) = update.get_mut(start..) else {
            return;
        };
        let (weights, biases) = tail.split_at_mut(w);
        weights.rotate_right(hidden as usize);
        biases.rotate_right(1);
    }
}

/// A peer's rank in rank window `window`.
/// `peer`'s rank in `window`, after every dialable peer's if it is in `relay_only`.
fn reachable_rank(peer: &PeerId, window: u64, relay_only: &HashSet<PeerId>) -> u64 {
    let r = rank(peer, window);
    if relay_only.contains(peer) {
        relay_only_rank(r)
    } else {
        r
    }
}

fn rank(peer: &PeerId, window: u64) -> u64 {
    hub_rank_at(&peer.to_bytes(), window)
}

/// The exchange's parameters for rounds of `round_ms` and key windows of `key_window` rounds
/// (the routing's discovery period, `NodeConfig::discovery_every`): the core's defaults, with
/// a push's answer awaited at most a sixth of the round (5 s in rounds of 30 s or more), and
/// one hub per cohort: the wire does not carry a tree's answers yet
/// ([`ExchangeConfig::fanout`]), so a hub takes up to `max_pushers` pushes.
pub fn exchange_config(round_ms: u64, key_window: u64) -> ExchangeConfig {
    let mut config = ExchangeConfig {
        key_window,
        fanout: None,
        ..ExchangeConfig::default()
    };
    config.timing.answer_ms = config.timing.answer_ms.min(round_ms / 6).max(100);
    // A search waits for the round's announcements ([`SEARCH_AFTER`]) before it looks up.
    config.timing.search_permille = SEARCH_PERMILLE;
    config
}

/// A search's lookup starts no earlier than this share of the round: every node announces
/// right after its training, at about the same time, and a lookup made before the others'
/// announcements have landed finds nobody (the simulator's routing model takes a round's
/// announcements before its lookups). A node announcing later than this is found in a later
/// search, or through a view.
pub const SEARCH_AFTER: f64 = 0.15;
/// A search looks up no sooner than this share of the round after the node's packet is out
/// (and announced): the swarm's nodes finish training at different times, and a node that
/// looked up the moment it announced missed the announcements of its task's slower nodes
/// round after round (in 8 real nodes on 2 cores, training took 80-90% of a 3-s round, and
/// its task's hub announced 0.1 s after a lone node's lookups in two rounds in a row).
pub const SEARCH_MARGIN: f64 = 0.1;
/// A search's lookup is put off by up to this share of the round, at random (see
/// [`SEARCH_AFTER`]): nodes behind NAT that find each other in one search then dial each other
/// one after the other, not at once (`nat_swarm`: two simultaneous dials through the relay made
/// two hole punches on one 4-tuple, and both failed, round after round).
pub const SEARCH_JITTER: f64 = 0.05;
/// When the core stops waiting for a search, in thousandths of the round (the core's default
/// is 250): the lookup starts at [`SEARCH_AFTER`].
const SEARCH_PERMILLE: u16 = 400;

/// Whether the node's data refuses `offered` parameters in place of `own`: `Some(share)` when,
/// on its training shard, `offered` keeps less than [`MIN_GAIN_SHARE`] of what `own` gained
/// over the common initial model (`check_by_data`); `None` when it accepts, or when there is
/// no data here (an external trainer). The parameters to score are built by `own` and
/// `offered` only when there is data: three model-sized vectors a node without data (and a
/// large model) does without.
fn data_refuses(
    engine: &mut Engine,
    own: impl FnOnce(&Engine) -> Vec<f32>,
    offered: impl FnOnce(&Engine) -> Vec<f32>,
) -> Result<Option<f32>, HubError> {
    if engine.is_external() {
        return Ok(None);
    }
    let (origin, own, offered) = (engine.origin().to_vec(), own(engine), offered(engine));
    let (Some(origin), Some(own), Some(offered)) = (
        engine.shard_accuracy(&origin)?,
        engine.shard_accuracy(&own)?,
        engine.shard_accuracy(&offered)?,
    ) else {
        return Ok(None);
    };
    let scores = ShardScores {
        origin,
        own,
        offered,
    };
    Ok(match check_by_data(scores, MIN_GAIN_SHARE) {
        Ok(_) => None,
        Err(AggregateRejection::Data(share)) => Some(share),
        Err(_) => Some(f32::NAN),
    })
}
