//! The tokio driver of a node: the routing task, the local API and the round schedule.
//!
//! Rounds follow the wall clock: round `r` starts at `r × round_secs` since the Unix epoch, so
//! nodes agree on round numbers (and thus on the DHT keys of a round's window) without a
//! coordinator, and a restarted node rejoins at the current round.
//!
//! With the hub exchange (the default, [`crate::exchange`]) a round is: train, distill, seal;
//! the exchange core runs the round until its deadline (90% of the round), serving peers
//! between rounds too; apply what it ends with; seal the model snapshot joining members fetch;
//! checkpoint with the exchange's state. With the pairwise exchange (`--exchange pairwise`):
//!
//! | at | step |
//! |---|---|
//! | 0 | train (or take the external trainer's update), distill, seal, store, announce |
//! | [`LOOKUP_AT`] × T | look up partners (search the DHT in discovery rounds, otherwise ask the followed partners, see [`Follower`]); the lookup's deadline is [`LOOKUP_BUDGET`] × T |
//! | when it returns | verify, synthesize, apply, seal the model snapshot peers may fetch |
//! | then, every `snapshot_every` rounds | fetch a merged partner's snapshot and pull toward it, the next partner if one has none (deadline [`SNAPSHOT_DEADLINE`] × T) |
//! | then | evaluate, checkpoint, report |
//!
//! A slow or silent peer costs at most the lookup deadline: whatever was found by then is merged.
//! On SIGINT/SIGTERM the loop abandons the round in progress (the last committed round stays
//! intact, by construction of the store), flushes the store, writes `summary.json` and returns.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use kindred_distill::{Pull, PullConfig, Update};
use kindred_proto::PacketId;
use kindred_routing::{
    Follower, NetworkId, PacketStore, PartnerQuery, RoundPlan, RoutingConfig, RoutingHandle,
    SnapshotError, StoredSnapshot, spawn as spawn_routing,
};
use libp2p::pnet::PreSharedKey;
use libp2p::{Multiaddr, PeerId};
use tokio::sync::{mpsc, watch};

use crate::api::{self, MAX_HISTORY, RoundRecord, RoundTimings, Shared, SnapshotRecord, Status};
use crate::config::{ExchangeKind, NodeConfig};
use crate::engine::{Engine, EngineError, ExternalUpdate, MergeReport, PeerPacket};
use crate::exchange::{HubDriver, HubRoundStats, exchange_config};
use crate::merged::MergedUpdate;
use crate::metrics::NodeMetrics;
use crate::staged::StagedUpdate;
use crate::store::{MAX_KNOWN_PEERS, Store, StoreError};

/// When in a round the partner lookup starts, as a fraction of the round length.
pub const LOOKUP_AT: f64 = 0.45;
/// Deadline of the partner lookup, as a fraction of the round length.
pub const LOOKUP_BUDGET: f64 = 0.4;
/// Deadline of a snapshot fetch, as a fraction of the round length after its start.
pub const SNAPSHOT_DEADLINE: f64 = 0.97;

/// The summary a node writes to `summary.json` in its data directory when it stops.
pub const SUMMARY_FILE: &str = "summary.json";

/// The node's newest sealed model snapshot (header and body bytes), shared with the routing task
/// that serves it. Kept in memory only: a restarted node seals its restored model at start-up.
type SnapshotSlot = Arc<RwLock<Option<Arc<StoredSnapshot>>>>;

/// Serve a node's packets to peers from its store, and its model snapshot from memory.
#[derive(Debug)]
struct StoreSource {
    store: Store,
    snapshot: SnapshotSlot,
}

impl PacketStore for StoreSource {
    fn header(&self, id: &PacketId) -> Option<Vec<u8>> {
        self.store.packet_header(id).ok().flatten()
    }

    fn body(&self, id: &PacketId) -> Option<Vec<u8>> {
        self.store.packet_body(id).ok().flatten()
    }

    fn snapshot(&self) -> Option<Arc<StoredSnapshot>> {
        self.snapshot
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Read a swarm key file (the libp2p `/key/swarm/psk/1.0.0/` text format).
///
/// # Errors
/// When the file cannot be read or is not a swarm key.
pub fn read_swarm_key(path: &Path) -> anyhow::Result<PreSharedKey> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading swarm key {}", path.display()))?;
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = std::os::unix::fs::PermissionsExt::mode(&meta.permissions());
        if key_file_too_open(mode) {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", mode & 0o777),
                "the swarm key file is readable by group or others: anyone who can read it can \
                 join the private swarm; fix with `chmod 600 {}`",
                path.display()
            );
        }
    }
    text.parse::<PreSharedKey>()
        .map_err(|e| anyhow::anyhow!("{} is not a swarm key: {e}", path.display()))
}

/// Whether a swarm key file with unix permission bits `mode` is readable (or writable) by its
/// group or by others: the key is a secret and should be mode `0600`.
pub fn key_file_too_open(mode: u32) -> bool {
    mode & 0o077 != 0
}

/// Run a node from `data_dir` with `config` until `shutdown` flips to `true` or the configured
/// number of rounds is done.
///
/// Call it on tokio's multi-thread runtime (`kindred run` builds one): the round's heavy steps
/// (distilling, merging, checkpointing) run in `tokio::task::block_in_place`, which the
/// current-thread runtime does not allow.
///
/// # Errors
/// When the store, the data, the routing task or the API cannot start.
pub async fn run(
    mut config: NodeConfig,
    data_dir: PathBuf,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<Status> {
    config.validate()?;
    let store = Store::open(&data_dir.join("store"))?;
    // Uploads a crash left half-written are never used: start with an empty staging directory.
    let staging = store.staging_dir();
    StagedUpdate::clear(&staging);
    let mut engine = tokio::task::block_in_place(|| Engine::open(store.clone(), &config))?;
    let peer_id = engine.peer_id();
    let snapshots = SnapshotSlot::default();
    if config.snapshot_every > 0 {
        first_snapshot(&engine, &mut config, &snapshots);
    }

    let mut routing_config = RoutingConfig::new(NetworkId::from_name(&config.network));
    routing_config.transport.listen = config
        .listen
        .iter()
        .map(|a| a.parse())
        .collect::<Result<_, _>>()
        .context("listen address")?;
    routing_config.transport.listen_addrs_are_external = true;
    routing_config.transport.upnp = config.upnp;
    routing_config.transport.relay_server = config
        .relay_server
        .then(|| config.relay_limits.server_config());
    if let Some(path) = &config.swarm_key {
        routing_config.transport.swarm_key = Some(read_swarm_key(path)?);
        // pnet wraps TCP only: a private swarm skips QUIC listen addresses (the default has one).
        let (quic, tcp): (Vec<_>, Vec<_>) = routing_config
            .transport
            .listen
            .drain(..)
            .partition(kindred_routing::transport::is_quic);
        if !quic.is_empty() {
            tracing::info!(skipped = ?quic, "private swarm: listening on TCP only");
        }
        routing_config.transport.listen = tcp;
    }
    let round_len = config.round_duration();
    routing_config.core.lookup.top_m = config.partners;
    routing_config.core.lookup.probes = config.probes;
    routing_config.core.lookup.timeout = round_len.mul_f64(LOOKUP_BUDGET);
    routing_config.core.discovery.every_rounds = config.discovery_every;
    if config.exchange == ExchangeKind::Hub {
        // A member joining its hub fetches the hub's model without having fetched a body.
        routing_config.core.snapshot_grant = None;
        // The hub exchange's keys: what the simulator's hub exchange searches with.
        routing_config.core.keys = kindred_routing::exchange::ExchangeConfig::keys();
        routing_config.core.lookup.probes = 0;
        // A push of this model: its body dense in f32 at most, a header, a view of peers.
        routing_config.transport.max_push_bytes = engine.spec().f32_bytes() as usize
            + kindred_proto::MAX_HEADER_BYTES
            + kindred_proto::rpc::MAX_KNOWN_PEERS * (kindred_proto::MAX_PEER_ID_BYTES + 2)
            + 32 * engine.spec().layers().len()
            + 64 * 1024;
        // A member's merge fetch waits at its hub while the merge is made (8 s at 10^9
        // parameters on a 2-core host) and then moves it: past the default deadline the hub's
        // answer is cut off and fetched again whole. The deadline is the transport's, so every
        // request of this node gets it; lookups keep their own budget per round.
        let t = &mut routing_config.transport;
        t.request_timeout = t
            .request_timeout
            .max(merge_fetch_timeout(engine.spec().f32_bytes()));
    }
    raise_open_file_limit(&routing_config);
    let mut following = Follower::new(
        routing_config.core.discovery,
        routing_config.core.lookup.gate,
    );
    let keypair = libp2p::identity::Keypair::from(engine.keypair().clone());
    let (routing, mut events) = spawn_routing(
        keypair,
        routing_config,
        Arc::new(StoreSource {
            store: store.clone(),
            snapshot: snapshots.clone(),
        }),
    )
    .await?;
    tracing::info!(%peer_id, listen = ?routing.listen_addrs(), "node started");
    // Replay protection survives restarts: a packet superseded before the crash stays refused.
    let marks = store.replay_marks()?;
    if !marks.is_empty() {
        tracing::info!(marks = marks.len(), "replay marks restored");
        routing.restore_replay_marks(marks).await;
    }

    // Log routing events (peers, bans) as they come; the channel is bounded by routing.
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            tracing::debug!(?event, "routing event");
        }
    });

    let (updates_tx, mut updates_rx) = mpsc::channel(1);
    let shared = Arc::new(Shared {
        status: Default::default(),
        merged: Default::default(),
        metrics: NodeMetrics::new(),
        spec: engine.spec().clone(),
        updates: updates_tx,
        staging,
    });
    shared.set_status(|s| {
        s.peer_id = peer_id.to_string();
        s.listen = routing
            .listen_addrs()
            .iter()
            .map(|a| format!("{a}/p2p/{peer_id}"))
            .collect();
        s.round = engine.last_round();
        s.restored = engine.restored();
    });
    if let Some(addr) = config.api {
        let mut stop = shutdown.clone();
        let local = api::serve(addr, shared.clone(), config.api_limits, async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
        .with_context(|| format!("binding the API to {addr}"))?;
        tracing::info!(api = %local, "API listening");
    }

    // Join in the background: rounds start on schedule even while bootstrap peers are down.
    // The peers known before a restart are tried too, beside the bootstrap peers: a node that
    // was everyone's bootstrap peer has none configured, and one whose bootstrap peers left
    // still knows others.
    {
        let routing = routing.clone();
        let bootstrap = config.bootstrap.clone();
        let known = store.known_peers().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "known peers not restored; joining through bootstrap only");
            Vec::new()
        });
        tokio::spawn(async move { join_swarm(&routing, &bootstrap, &known).await });
    }

    let t_ms = (config.round_secs * 1000.0).round().max(1.0) as u64;
    let mut hub = match config.exchange {
        ExchangeKind::Hub => {
            // Served from the start: a peer joining this node as its hub fetches the model.
            seal_snapshot(&engine, engine.last_round().unwrap_or(0), &snapshots);
            let exchange = exchange_config(t_ms, config.discovery_every);
            Some(HubDriver::start(&engine, routing.clone(), exchange).await?)
        }
        ExchangeKind::Pairwise => None,
    };
    tracing::info!(exchange = config.exchange.label(), "exchange");
    let mut round = (now_ms() / t_ms).max(engine.last_round().map_or(0, |r| r + 1));
    let mut done = 0u64;
    loop {
        if config.rounds.is_some_and(|n| done >= n) || *shutdown.borrow() {
            break;
        }
        // A round we are already too late for (a fifth of it gone) is skipped, not half-run.
        let now = now_ms();
        round = round.max(now / t_ms);
        if now > round * t_ms + t_ms / 5 {
            round += 1;
        }
        let start = round * t_ms;
        let mut ctx = RoundContext {
            config: &config,
            routing: &routing,
            shared: &shared,
            updates: &mut updates_rx,
            following: &mut following,
            snapshots: &snapshots,
        };
        let step = tokio::select! {
            r = async {
                match &mut hub {
                    Some(hub) => run_hub_round(&mut engine, &mut ctx, hub, round, start, t_ms).await,
                    None => run_round(&mut engine, &mut ctx, round, start, t_ms).await,
                }
            } => r,
            _ = shutdown.wait_for(|s| *s) => {
                tracing::info!(round, "shutting down: abandoning the round in progress");
                break;
            }
        };
        match step {
            Ok(()) => done += 1,
            Err(e) => tracing::warn!(round, error = %e, "round skipped"),
        }
        round += 1;
    }

    if let Some(m) = routing.metrics().await {
        shared.metrics.set_routing(m);
    }
    routing.shutdown().await;
    store.flush()?;
    let status = shared.status.read().map(|s| s.clone()).unwrap_or_default();
    let summary = serde_json::to_vec_pretty(&status)?;
    std::fs::write(data_dir.join(SUMMARY_FILE), summary)?;
    tracing::info!(rounds = done, "node stopped cleanly");
    Ok(status)
}

/// Persist what routing must find again after a restart, before the round's commit flushes it:
/// the replay marks (a packet superseded before the crash stays refused) and the peers to
/// rejoin through.
async fn persist_routing(store: &Store, routing: &RoutingHandle) -> Result<(), StoreError> {
    if let Some(marks) = routing.replay_marks().await {
        store.put_replay_marks(&marks)?;
    }
    match routing.known_peers(MAX_KNOWN_PEERS).await {
        Some(peers) if !peers.is_empty() => store.put_known_peers(&peers),
        _ => Ok(()),
    }
}

/// Join the swarm: rejoin through the peers known before a restart (`known`) and, at the same
/// time, dial every bootstrap address, so that stale known peers never hold up the bootstrap
/// peers (a dial to a host that is gone waits for its timeout).
async fn join_swarm(routing: &RoutingHandle, bootstrap: &[String], known: &[Multiaddr]) {
    let (rejoined, joined) = tokio::join!(
        rejoin_known(routing, known),
        dial_bootstrap(routing, bootstrap)
    );
    if joined > 0 {
        if let Err(e) = routing.bootstrap().await {
            tracing::warn!(error = %e, "DHT bootstrap failed");
        }
    } else if !rejoined && (!bootstrap.is_empty() || !known.is_empty()) {
        tracing::warn!("no known or bootstrap peer reachable; running alone until peers dial in");
    }
}

/// Put the peers known before a restart into the routing table and bootstrap the DHT through
/// them (the query dials them); whether that reached any.
async fn rejoin_known(routing: &RoutingHandle, known: &[Multiaddr]) -> bool {
    let mut added = 0usize;
    for addr in known {
        if let Some(peer) = peer_of(addr) {
            routing.add_peer(peer, addr.clone()).await;
            added += 1;
        }
    }
    if added == 0 {
        return false;
    }
    match routing.bootstrap().await {
        Ok(()) => {
            tracing::info!(known = added, "rejoined the DHT after a restart");
            true
        }
        Err(e) => {
            tracing::info!(known = added, error = %e, "the peers known before are unreachable");
            false
        }
    }
}

/// Dial every bootstrap address (retrying for a while: peers may still be starting) and put
/// those that answer into the routing table; how many did.
async fn dial_bootstrap(routing: &RoutingHandle, bootstrap: &[String]) -> usize {
    let mut joined = 0;
    for addr in bootstrap {
        let Ok(addr) = addr.parse::<Multiaddr>() else {
            tracing::warn!(%addr, "ignoring a bootstrap address that is not a multiaddr");
            continue;
        };
        for attempt in 0..20u32 {
            match routing.dial(addr.clone()).await {
                Ok(peer) => {
                    tracing::info!(%peer, %addr, "connected to bootstrap peer");
                    // Into the routing table now, so the bootstrap after it has a peer to
                    // start from (identify would add it only after its first exchange).
                    routing.add_peer(peer, addr.clone()).await;
                    joined += 1;
                    break;
                }
                Err(e) => {
                    if attempt == 0 {
                        tracing::warn!(%addr, error = %e, "bootstrap dial failed; retrying");
                    } else {
                        tracing::debug!(%addr, attempt, error = %e, "bootstrap dial failed");
                    }
                    tokio::time::sleep(Duration::from_millis(250 * u64::from(attempt + 1))).await;
                }
            }
        }
    }
    joined
}

/// The peer an address ends in (`…/p2p/<peer>`).
fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    match addr.iter().last()? {
        libp2p::multiaddr::Protocol::P2p(peer) => Some(peer),
        _ => None,
    }
}

async fn sleep_until_ms(t: u64) {
    let now = now_ms();
    if t > now {
        tokio::time::sleep(Duration::from_millis(t - now)).await;
    }
}

/// What a round works with besides the engine.
struct RoundContext<'a> {
    config: &'a NodeConfig,
    routing: &'a RoutingHandle,
    shared: &'a Shared,
    updates: &'a mut mpsc::Receiver<ExternalUpdate>,
    following: &'a mut Follower<PeerId>,
    snapshots: &'a SnapshotSlot,
}

/// Where a round's time went: the update in hand at `in_hand`, its packet made
/// `packet_seconds` later, the exchange over at `exchanged`, the round over now.
fn round_timings(
    out: &crate::engine::Outgoing,
    in_hand: std::time::Instant,
    packet_seconds: f64,
    exchanged: std::time::Instant,
) -> RoundTimings {
    RoundTimings {
        packet_seconds,
        distill_seconds: out.distill_time.0,
        distill_cpu_seconds: out.distill_time.1,
        exchange_seconds: (exchanged - in_hand).as_secs_f64() - packet_seconds,
        checkpoint_seconds: exchanged.elapsed().as_secs_f64(),
        round_seconds: in_hand.elapsed().as_secs_f64(),
    }
}

/// One round; see the module docs for the schedule.
async fn run_round(
    engine: &mut Engine,
    ctx: &mut RoundContext<'_>,
    round: u64,
    start: u64,
    t_ms: u64,
) -> anyhow::Result<()> {
    let (routing, shared) = (ctx.routing, ctx.shared);
    let (updates, following) = (&mut *ctx.updates, &mut *ctx.following);
    sleep_until_ms(start.saturating_sub(prefetch_lead_ms(t_ms))).await;
    let early = early_update(engine, updates);
    sleep_until_ms(start).await;
    let began = std::time::Instant::now();
    take_update(engine, updates, early, start, t_ms).await?;
    let in_hand = std::time::Instant::now();
    let out = tokio::task::block_in_place(|| engine.make_packet(round, now_ms()))?;
    let packet_seconds = in_hand.elapsed().as_secs_f64();
    let packet_bytes = (out.packet.header_bytes.len() + out.packet.body_bytes.len()) as u64;
    if let Err(e) = routing.announce(out.packet.header.clone()).await {
        tracing::warn!(round, error = %e, "announce failed");
    }

    sleep_until_ms(start + (t_ms as f64 * LOOKUP_AT) as u64).await;
    let lookup_began = std::time::Instant::now();
    let mut query = PartnerQuery::new(
        out.packet.header.clone(),
        out.margins.clone(),
        engine.spec().clone(),
    );
    let mode = match following.start_round(round) {
        RoundPlan::Search => "search",
        RoundPlan::Refresh => {
            query = query.refreshing();
            "refresh"
        }
        RoundPlan::Follow(peers) => {
            query = query.following(peers.to_vec());
            "follow"
        }
    };
    let searched = mode != "follow";
    let budget = Duration::from_millis((t_ms as f64 * LOOKUP_BUDGET) as u64 + 200);
    let mut candidates = Vec::new();
    let found = match tokio::time::timeout(budget, routing.find_partners(query)).await {
        Ok(Ok(p)) => {
            candidates = p.candidates.iter().map(|c| c.cosine).collect();
            following.lookup_done(
                p.candidates
                    .iter()
                    .map(|c| (c.header.header().sender, c.cosine)),
            );
            tracing::debug!(round, stats = ?p.stats, "lookup");
            p.packets
        }
        Ok(Err(e)) => {
            tracing::warn!(round, error = %e, "partner lookup failed");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!(round, "partner lookup hit its deadline");
            Vec::new()
        }
    };
    let lookup_ms = lookup_began.elapsed().as_millis() as u64;
    let peers: Vec<PeerPacket> = found
        .into_iter()
        .map(|f| {
            let h = f.packet.header.header();
            PeerPacket {
                sender: h.sender,
                id: f.packet.id(),
                samples: h.samples,
                body: f.packet.body,
            }
        })
        .collect();

    let mut report = tokio::task::block_in_place(|| engine.merge(&out, &peers))?;
    let snapshot = exchange_snapshots(engine, ctx, &mut report, round, start + t_ms).await;
    let exchanged = std::time::Instant::now();
    let accuracy = tokio::task::block_in_place(|| engine.accuracy())?;
    let merged = Update::from_dense(std::mem::take(&mut report.merged)).into();
    // Routing state first: the round commit below flushes it with it.
    persist_routing(engine.store(), routing).await?;
    tokio::task::block_in_place(|| engine.checkpoint(round))?;
    let timings = round_timings(&out, in_hand, packet_seconds, exchanged);

    let m = &shared.metrics;
    record_round(
        m,
        began,
        report.partners.len(),
        packet_bytes,
        out.loss,
        accuracy,
    );
    m.lookup_seconds.observe(lookup_ms as f64 / 1000.0);
    m.lookups
        .get_or_create(&vec![("mode", mode.to_string())])
        .inc();
    for (_, reason) in &report.rejected {
        m.merge_verdicts
            .get_or_create(&vec![("verdict", (*reason).to_string())])
            .inc();
    }
    m.merge_verdicts
        .get_or_create(&vec![("verdict", "accepted".to_string())])
        .inc_by(report.partners.len() as u64);
    if let Some(s) = &snapshot {
        m.snapshot_pulls
            .get_or_create(&vec![("outcome", s.outcome.clone())])
            .inc();
    }
    let (info, routing_metrics) = publish_round(routing, shared, round, merged).await;
    let record = RoundRecord {
        round,
        loss: out.loss,
        accuracy,
        partners: report.partners.iter().map(ToString::to_string).collect(),
        rejected: report
            .rejected
            .iter()
            .map(|(p, r)| (p.to_string(), (*r).to_string()))
            .collect(),
        packet_bytes,
        f32_bytes: engine.spec().f32_bytes(),
        lookup_ms,
        snapshot: snapshot.clone(),
        exchange: None,
        wire_bytes_sent: routing_metrics.as_ref().map_or(0, |m| m.wire_bytes_out),
        wire_sent_by_protocol: routing_metrics
            .as_ref()
            .map(|m| by_protocol(&m.wire).1)
            .unwrap_or_default(),
        timings,
    };
    tracing::info!(
        round,
        loss = format_args!("{:.4}", out.loss),
        accuracy = accuracy
            .map(|a| format!("{:.2}%", a * 100.0))
            .unwrap_or_else(|| "-".into()),
        partners = report.partners.len(),
        rejected = report.rejected.len(),
        candidates = candidates.len(),
        searched,
        best_cosine = candidates
            .first()
            .map(|c| format!("{c:.2}"))
            .unwrap_or_default(),
        bytes_out = packet_bytes,
        lookup_ms,
        snapshot = snapshot.as_ref().map(|s| s.outcome.as_str()).unwrap_or("-"),
        snapshot_tries = snapshot.as_ref().map_or(0, |s| s.tries),
        "round done"
    );
    update_status(
        shared,
        round,
        record,
        info.as_ref(),
        routing_metrics.as_ref(),
    );
    Ok(())
}

/// The deadline of a hub exchange node's requests for a model of `f32_bytes`: 10 s, plus a
/// second per 100 MB of the model (50 s at 10^9 parameters).
fn merge_fetch_timeout(f32_bytes: u64) -> Duration {
    Duration::from_secs(10) + Duration::from_secs_f64(f32_bytes as f64 / 100e6)
}

/// The trainer's update if it came already, its staged file being read back into the page
/// cache ([`crate::staged::StagedUpdate::prefetch`]): called [`prefetch_lead_ms`] before the
/// round.
fn early_update(
    engine: &Engine,
    updates: &mut mpsc::Receiver<ExternalUpdate>,
) -> Option<ExternalUpdate> {
    if !engine.is_external() {
        return None;
    }
    let update = updates.try_recv().ok()?;
    update.update.prefetch();
    Some(update)
}

/// Hand an external trainer's update for the round that started at `start` to the engine:
/// `early`, or the first to come by the announce deadline (a quarter of the round in);
/// [`EngineError::NoUpdate`] when none came. A node with a built-in trainer takes none.
async fn take_update(
    engine: &mut Engine,
    updates: &mut mpsc::Receiver<ExternalUpdate>,
    early: Option<ExternalUpdate>,
    start: u64,
    t_ms: u64,
) -> anyhow::Result<()> {
    if !engine.is_external() {
        return Ok(());
    }
    let update = match early {
        Some(u) => Some(u),
        None => {
            let deadline = Duration::from_millis((start + t_ms / 4).saturating_sub(now_ms()));
            tokio::time::timeout(deadline, updates.recv())
                .await
                .ok()
                .flatten()
        }
    };
    match update {
        Some(u) => Ok(engine.push_external(u)?),
        None => Err(EngineError::NoUpdate.into()),
    }
}

/// How long before its round a node has the trainer's staged update read back
/// into the page cache: 5% of the round, at most 10 s (0.15 s at the demo's 3 s rounds, 0.5 s
/// at the default 10 s, 10 s at 10^9 parameters' 255 s). Long enough for a few GB at disk
/// speed, short enough that the host has no time to drop the pages again.
fn prefetch_lead_ms(t_ms: u64) -> u64 {
    (t_ms / 20).min(10_000)
}

/// One round of the hub exchange: train, distill and seal; let the exchange core run the
/// round ([`HubDriver::round`]) and apply what it ends with; seal the model snapshot joining
/// members fetch; checkpoint with the exchange's state; report.
async fn run_hub_round(
    engine: &mut Engine,
    ctx: &mut RoundContext<'_>,
    hub: &mut HubDriver,
    round: u64,
    start: u64,
    t_ms: u64,
) -> anyhow::Result<()> {
    let (routing, shared) = (ctx.routing, ctx.shared);
    // Between rounds the node still serves its members' late merge fetches and early pushes.
    // A trainer's update that came early has its file read back into the page cache shortly
    // before the round, while the node waits (`StagedUpdate::prefetch`).
    hub.idle_until(engine, start.saturating_sub(prefetch_lead_ms(t_ms)))
        .await?;
    let early = early_update(engine, ctx.updates);
    hub.idle_until(engine, start).await?;
    let began = std::time::Instant::now();
    take_update(engine, ctx.updates, early, start, t_ms).await?;
    if engine.is_external() {
        // The trainer sends its next update once it has taken the last merge: that merge is
        // released now rather than held beside this round's (a model's worth after an
        // adoption). A fetch under way keeps its copy until it is sent.
        *shared
            .merged
            .write()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }
    let in_hand = std::time::Instant::now();
    let mut out = tokio::task::block_in_place(|| engine.make_packet(round, now_ms()))?;
    // The hub exchange merges what peers decode (`sent`); the full update is not needed again.
    out.full = Vec::new();
    let packet_seconds = in_hand.elapsed().as_secs_f64();
    let packet_bytes = (out.packet.header_bytes.len() + out.packet.body_bytes.len()) as u64;
    let (stats, merged) = hub.round(engine, &out, round, start, t_ms).await?;
    let exchanged = std::time::Instant::now();
    seal_snapshot(engine, round, ctx.snapshots);
    let accuracy = tokio::task::block_in_place(|| engine.accuracy())?;
    tokio::task::block_in_place(|| hub.persist(engine.store()))?;
    persist_routing(engine.store(), routing).await?;
    tokio::task::block_in_place(|| engine.checkpoint(round))?;
    let timings = round_timings(&out, in_hand, packet_seconds, exchanged);

    let m = &shared.metrics;
    record_round(
        m,
        began,
        stats.partners.len(),
        packet_bytes,
        out.loss,
        accuracy,
    );
    record_exchange(m, &stats);
    let (info, routing_metrics) = publish_round(routing, shared, round, merged).await;
    tracing::info!(
        round,
        loss = format_args!("{:.4}", out.loss),
        accuracy = accuracy
            .map(|a| format!("{:.2}%", a * 100.0))
            .unwrap_or_else(|| "-".into()),
        role = %stats.role,
        hub = %stats.hub,
        cohort = stats.cohort,
        applied = %stats.applied,
        missed = stats.missed,
        pushes = stats.pushes_received,
        merged = stats.merged,
        served = stats.served,
        refused = stats.refused,
        bytes_out = packet_bytes,
        wire_out = routing_metrics.as_ref().map_or(0, |m| m.wire_bytes_out),
        rpc_out = routing_metrics.as_ref().map_or(0, rpc_bytes_out),
        packet_s = format_args!("{:.2}", timings.packet_seconds),
        exchange_s = format_args!("{:.2}", timings.exchange_seconds),
        round_s = format_args!("{:.2}", timings.round_seconds),
        "round done"
    );
    let record = RoundRecord {
        round,
        loss: out.loss,
        accuracy,
        partners: stats.partners.iter().map(ToString::to_string).collect(),
        rejected: Vec::new(),
        packet_bytes,
        f32_bytes: engine.spec().f32_bytes(),
        lookup_ms: 0,
        snapshot: None,
        exchange: Some(stats),
        wire_bytes_sent: routing_metrics.as_ref().map_or(0, |m| m.wire_bytes_out),
        wire_sent_by_protocol: routing_metrics
            .as_ref()
            .map(|m| by_protocol(&m.wire).1)
            .unwrap_or_default(),
        timings,
    };
    update_status(
        shared,
        round,
        record,
        info.as_ref(),
        routing_metrics.as_ref(),
    );
    shared.set_status(|s| s.no_dialable_peer = hub.no_dialable_peer());
    Ok(())
}

/// After a round: the routing layer's counters into the metrics, and the update the round
/// applied where an external trainer fetches it (`GET /v1/merged`). Returns the routing task's
/// connectivity and counters for the status.
async fn publish_round(
    routing: &RoutingHandle,
    shared: &Shared,
    round: u64,
    merged: MergedUpdate,
) -> (
    Option<kindred_routing::NodeInfo>,
    Option<kindred_routing::RoutingMetrics>,
) {
    let info = routing.info().await;
    let routing_metrics = routing.metrics().await;
    if let Some(rm) = &routing_metrics {
        shared.metrics.set_routing(rm.clone());
    }
    if let Some(i) = &info {
        shared.metrics.set_reachability(i);
    }
    *shared
        .merged
        .write()
        .unwrap_or_else(PoisonError::into_inner) = Some((round, Arc::new(merged)));
    (info, routing_metrics)
}

/// A round's figures common to both exchanges into the node's metrics.
fn record_round(
    m: &NodeMetrics,
    began: std::time::Instant,
    partners: usize,
    packet_bytes: u64,
    loss: f32,
    accuracy: Option<f32>,
) {
    m.rounds.inc();
    m.round_seconds.observe(began.elapsed().as_secs_f64());
    m.partners.observe(partners as f64);
    m.packet_bytes.observe(packet_bytes as f64);
    m.loss.set(f64::from(loss));
    if let Some(a) = accuracy {
        m.accuracy.set(f64::from(a));
    }
}

/// Bytes received and sent by protocol, keyed by the protocol's label.
fn by_protocol(
    wire: &kindred_routing::wire::WireBytes,
) -> (
    std::collections::BTreeMap<String, u64>,
    std::collections::BTreeMap<String, u64>,
) {
    let mut received = std::collections::BTreeMap::new();
    let mut sent = std::collections::BTreeMap::new();
    for (p, i, o) in wire.by_protocol() {
        received.insert(p.label().to_string(), i);
        sent.insert(p.label().to_string(), o);
    }
    (received, sent)
}

/// Bytes the node's packet RPCs sent, every peer together.
fn rpc_bytes_out(m: &kindred_routing::RoutingMetrics) -> u64 {
    m.peers
        .values()
        .chain(std::iter::once(&m.other_peers))
        .map(|p| p.bytes_out)
        .sum()
}

/// The exchange's figures of a round into the node's metrics.
fn record_exchange(m: &NodeMetrics, stats: &HubRoundStats) {
    m.exchange_rounds
        .get_or_create(&vec![("role", stats.role.clone())])
        .inc();
    let merges = |outcome: &str| {
        m.exchange_merges
            .get_or_create(&vec![("outcome", outcome.to_string())])
    };
    merges("served").inc_by(stats.served as u64);
    merges("refused").inc_by(stats.refused);
    if stats.missed {
        merges("missed").inc();
    }
    if stats.applied.contains("merge") && stats.role == "member" {
        merges("applied").inc();
    }
    for &seconds in &stats.search_seconds {
        m.lookup_seconds.observe(seconds);
        m.lookups
            .get_or_create(&vec![("mode", "search".to_string())])
            .inc();
    }
    m.exchange_pushes.inc_by(stats.pushes_received);
    m.exchange_bans.inc_by(stats.bans);
    m.exchange_cohort.set(stats.cohort as i64);
    m.exchange_is_hub.set(i64::from(stats.role == "hub"));
}

/// Seal the node's model as the snapshot peers fetch (a member joining this node as its hub).
fn seal_snapshot(engine: &Engine, round: u64, slot: &SnapshotSlot) {
    // The last round's snapshot is no longer the node's model: released before the new one
    // is made rather than held beside it (a peer asking meanwhile gets none, as before a
    // node's first snapshot, and its fetch moves on).
    *slot.write().unwrap_or_else(PoisonError::into_inner) = None;
    match tokio::task::block_in_place(|| engine.seal_snapshot(round, now_ms())) {
        Ok(sealed) => {
            *slot.write().unwrap_or_else(PoisonError::into_inner) =
                Some(Arc::new(StoredSnapshot::sealed(sealed)));
        }
        Err(e) => tracing::warn!(round, error = %e, "cannot seal a model snapshot"),
    }
}

/// A finished round into the node's status.
fn update_status(
    shared: &Shared,
    round: u64,
    record: RoundRecord,
    info: Option<&kindred_routing::NodeInfo>,
    routing_metrics: Option<&kindred_routing::RoutingMetrics>,
) {
    shared.set_status(|s| {
        s.round = Some(round);
        if let Some(i) = info {
            s.connected = i.connected.len();
            s.reachability = i.reachability;
            s.banned = i.banned.len();
            s.relays = i.relays.iter().map(ToString::to_string).collect();
        }
        if let Some(rm) = routing_metrics {
            s.rejects = rm
                .rejects
                .iter()
                .map(|(k, v)| ((*k).to_string(), *v))
                .collect();
            let peers = rm.peers.values().chain(std::iter::once(&rm.other_peers));
            (s.bytes_sent, s.bytes_received) =
                peers.fold((0, 0), |(o, i), p| (o + p.bytes_out, i + p.bytes_in));
            (s.wire_bytes_sent, s.wire_bytes_received) = (rm.wire_bytes_out, rm.wire_bytes_in);
            (s.wire_received_by_protocol, s.wire_sent_by_protocol) = by_protocol(&rm.wire);
            s.relayed_connections = rm.connections_relayed;
            let (rpc_in, rpc_out) = rm
                .relayed_wire
                .get(kindred_routing::wire::WireProtocol::Rpc);
            s.relayed_rpc_bytes = rpc_in + rpc_out;
            s.hole_punches = rm.hole_punches;
            s.relay_reservations = rm.relay_reservations;
        }
        if let (Some(i), Some(rm)) = (info, routing_metrics) {
            s.direct_peers = i
                .direct
                .iter()
                .map(|p| {
                    let t = rm.peers.get(p).copied().unwrap_or_default();
                    (p.to_string(), t.bytes_in + t.bytes_out)
                })
                .collect();
        }
        s.history.push(record);
        if s.history.len() > MAX_HISTORY {
            s.history.remove(0);
        }
    });
}

/// At start-up: check that the model fits a snapshot (turning snapshots off with one warning if
/// it does not), and after a restart serve the restored model until the first round completes.
fn first_snapshot(engine: &Engine, config: &mut NodeConfig, slot: &SnapshotSlot) {
    let round = engine.last_round();
    match tokio::task::block_in_place(|| engine.seal_snapshot(round.unwrap_or(0), now_ms())) {
        Ok(sealed) if round.is_some() => {
            *slot.write().unwrap_or_else(PoisonError::into_inner) =
                Some(Arc::new(StoredSnapshot::sealed(sealed)));
        }
        Ok(_) => {}
        Err(EngineError::Seal(e)) => {
            tracing::warn!(
                error = %e,
                params = engine.spec().numel(),
                "model snapshots are off: the model is over the snapshot limit"
            );
            config.snapshot_every = 0;
        }
        // Not finite now (a diverging model): snapshots stay on and each round tries again.
        Err(e) => tracing::warn!(error = %e, "cannot seal a model snapshot"),
    }
}

/// After the merge: seal the model snapshot peers fetch this round, and in a snapshot round
/// (`snapshot_every`) pull toward a merged partner's ([`pull_in_turn`]), giving up
/// [`SNAPSHOT_DEADLINE`] into the round that ends at `round_end_ms`. Returns what the pull did,
/// `None` outside snapshot rounds or without a partner.
async fn exchange_snapshots(
    engine: &mut Engine,
    ctx: &RoundContext<'_>,
    report: &mut MergeReport,
    round: u64,
    round_end_ms: u64,
) -> Option<SnapshotRecord> {
    let every = ctx.config.snapshot_every;
    if every == 0 {
        return None;
    }
    // Served from now on: the model as merged this round, before any pull. Sealed every round,
    // because a partner that is a round behind asks for the previous one.
    seal_snapshot(engine, round, ctx.snapshots);
    if !(round + 1).is_multiple_of(every) {
        return None;
    }
    let candidates = engine.snapshot_partners(round, &report.partners);
    let round_ms = ctx.config.round_secs * 1000.0;
    let deadline_ms = round_end_ms.saturating_sub(((1.0 - SNAPSHOT_DEADLINE) * round_ms) as u64);
    let deadline =
        tokio::time::Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
    // A partner still merging serves its previous round's model: one round old is accepted.
    let oldest = round.saturating_sub(1);
    let spec = engine.spec().clone();
    let pull_config = PullConfig {
        share: ctx.config.snapshot_share,
        ..PullConfig::default()
    };
    let reference = report.merged_norm();
    pull_in_turn(
        round,
        &candidates,
        deadline,
        reference,
        |partner| ctx.routing.fetch_snapshot(partner, spec.clone(), oldest),
        |snapshot| {
            tokio::task::block_in_place(|| engine.pull_toward(&snapshot, report, &pull_config))
        },
    )
    .await
}

/// Partners asked for a snapshot in one round, at most: the pick and two more of the
/// better-agreeing half, so a round's snapshot requests stay bounded whatever the half's size.
pub const SNAPSHOT_TRIES: usize = 3;

/// Ask `candidates` in turn (`Engine::snapshot_partners`) for a snapshot until one is fetched
/// and `pull` takes it, at most [`SNAPSHOT_TRIES`] of them, all before `deadline`.
///
/// A partner with nothing usable to give (`not_found`: it has not finished a round yet;
/// `refused`, `stale`, `invalid`, `unusable`, `failed`) is followed by the next, which is as good
/// a pick; the deadline, or a stopped routing task, ends the round's pull. The record names the
/// last partner asked and what came of it; `None` without candidates. `reference` is the norm
/// of the round's merged update, the step ratio's denominator.
async fn pull_in_turn<S, E, Fut>(
    round: u64,
    candidates: &[PeerId],
    deadline: tokio::time::Instant,
    reference: f64,
    mut fetch: impl FnMut(PeerId) -> Fut,
    mut pull: impl FnMut(S) -> Result<Pull, E>,
) -> Option<SnapshotRecord>
where
    Fut: std::future::Future<Output = Result<S, SnapshotError>>,
    E: std::fmt::Display,
{
    let mut record = None;
    for (tries, &partner) in (1u32..).zip(candidates.iter().take(SNAPSHOT_TRIES)) {
        let (outcome, step_ratio, last) =
            match tokio::time::timeout_at(deadline, fetch(partner)).await {
                Ok(Ok(snapshot)) => match pull(snapshot) {
                    Ok(p) => (
                        if p.clipped { "clipped" } else { "pulled" },
                        Some(p.step_norm / reference.max(f64::MIN_POSITIVE)),
                        true,
                    ),
                    Err(e) => {
                        tracing::warn!(round, %partner, error = %e, "partner snapshot not usable");
                        ("unusable", None, false)
                    }
                },
                Ok(Err(SnapshotError::Stopped)) => ("stopped", None, true),
                Ok(Err(e)) => {
                    tracing::debug!(round, %partner, error = %e, "no partner snapshot");
                    (snapshot_error_label(&e), None, false)
                }
                Err(_) => ("deadline", None, true),
            };
        record = Some(SnapshotRecord {
            from: partner.to_string(),
            outcome: outcome.to_string(),
            step_ratio,
            tries,
        });
        if last {
            break;
        }
    }
    record
}

/// A short, stable label for a failed snapshot fetch (metrics and the round record).
fn snapshot_error_label(e: &SnapshotError) -> &'static str {
    match e {
        SnapshotError::NotFound => "not_found",
        SnapshotError::Refused => "refused",
        SnapshotError::Invalid(_) => "invalid",
        SnapshotError::Stale { .. } => "stale",
        SnapshotError::Stopped => "stopped",
        _ => "failed",
    }
}

/// Raise the soft open-file limit so the routing layer's connection limits can be reached: every
/// connection is a socket, and at scale a round lookup dials hundreds of providers while as many
/// peers ask this node for headers. Many systems start processes at a soft limit of 1,024.
fn raise_open_file_limit(config: &RoutingConfig) {
    let c = &config.connections;
    // Sockets at the limits, plus room for the store, the API and the trainer.
    let wanted = [
        c.max_established_incoming,
        c.max_established_outgoing,
        c.max_pending_incoming,
        c.max_pending_outgoing,
    ]
    .iter()
    .map(|&n| u64::from(n))
    .sum::<u64>()
        + 512;
    match rlimit::increase_nofile_limit(wanted) {
        Ok(limit) if limit >= wanted => tracing::debug!(limit, "open-file limit"),
        Ok(limit) => tracing::warn!(
            limit,
            wanted,
            "the open-file limit is below what the connection limits need; raise the hard \
             limit (ulimit -Hn, or LimitNOFILE for a service) or connections will fail at scale"
        ),
        Err(error) => tracing::warn!(%error, wanted, "could not raise the open-file limit"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hub_exchange_request_waits_longer_for_a_larger_model() {
        // The MLP keeps the transport's default; 10^9 f32 parameters get 50 s.
        assert_eq!(merge_fetch_timeout(203_560).as_secs(), 10);
        assert_eq!(merge_fetch_timeout(4_000_000_000), Duration::from_secs(50));
        assert!(merge_fetch_timeout(400_000_000) > merge_fetch_timeout(40_000_000));
    }

    #[test]
    fn swarm_key_modes_open_to_group_or_others_are_flagged() {
        for private in [0o600, 0o400, 0o100600, 0o700] {
            assert!(!key_file_too_open(private), "{private:o}");
        }
        for open in [0o644, 0o640, 0o604, 0o666, 0o100644, 0o620, 0o602] {
            assert!(key_file_too_open(open), "{open:o}");
        }
    }

    /// What a fake partner answers, and whether the pull takes it.
    #[derive(Clone, Copy)]
    enum Answer {
        Snapshot,
        Unusable,
        Error(fn() -> SnapshotError),
        Hang,
    }

    /// Runs [`pull_in_turn`] over partners answering `answers` in order; returns the record and
    /// the partners asked.
    async fn run(answers: &[Answer]) -> (Option<SnapshotRecord>, Vec<usize>) {
        let peers: Vec<PeerId> = answers.iter().map(|_| PeerId::random()).collect();
        let answer_of = |p: PeerId| peers.iter().position(|&q| q == p).unwrap_or(usize::MAX);
        let asked = std::cell::RefCell::new(Vec::new());
        let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
        let record = pull_in_turn(
            7,
            &peers,
            deadline,
            2.0,
            |p| {
                let k = answer_of(p);
                asked.borrow_mut().push(k);
                let answer = answers.get(k).copied();
                async move {
                    match answer {
                        Some(Answer::Snapshot | Answer::Unusable) => Ok(answer),
                        Some(Answer::Error(e)) => Err(e()),
                        Some(Answer::Hang) | None => std::future::pending().await,
                    }
                }
            },
            |answer| match answer {
                Some(Answer::Snapshot) => Ok(Pull {
                    step_norm: 1.0,
                    wanted_norm: 1.0,
                    clipped: false,
                }),
                _ => Err("layers do not fit the model"),
            },
        )
        .await;
        let asked = asked.into_inner();
        if let Some(r) = &record {
            let last = asked.last().and_then(|&k| peers.get(k));
            assert_eq!(Some(r.from.clone()), last.map(ToString::to_string));
            assert_eq!(r.tries as usize, asked.len());
        }
        (record, asked)
    }

    fn outcome(r: &Option<SnapshotRecord>) -> &str {
        r.as_ref().map_or("none", |r| r.outcome.as_str())
    }

    #[tokio::test]
    async fn a_partner_without_a_snapshot_is_followed_by_the_next() {
        let (r, asked) = run(&[
            Answer::Error(|| SnapshotError::NotFound),
            Answer::Unusable,
            Answer::Snapshot,
            Answer::Snapshot,
        ])
        .await;
        assert_eq!(outcome(&r), "pulled");
        assert_eq!(asked, vec![0, 1, 2]);
        assert_eq!(r.and_then(|r| r.step_ratio), Some(0.5));
    }

    #[tokio::test]
    async fn at_most_three_partners_are_asked_in_a_round() {
        let (r, asked) = run(&[
            Answer::Error(|| SnapshotError::NotFound),
            Answer::Error(|| SnapshotError::Refused),
            Answer::Error(|| SnapshotError::Stale {
                found: 3,
                oldest: 6,
            }),
            Answer::Snapshot,
        ])
        .await;
        assert_eq!(SNAPSHOT_TRIES, 3);
        assert_eq!(outcome(&r), "stale");
        assert_eq!(asked, vec![0, 1, 2]);
    }

    #[tokio::test]
    async fn the_deadline_or_a_stopped_driver_ends_the_pull() {
        let (r, asked) = run(&[Answer::Hang, Answer::Snapshot]).await;
        assert_eq!((outcome(&r), asked), ("deadline", vec![0]));
        let (r, asked) = run(&[Answer::Error(|| SnapshotError::Stopped), Answer::Snapshot]).await;
        assert_eq!((outcome(&r), asked), ("stopped", vec![0]));
        let (r, asked) = run(&[]).await;
        assert_eq!((outcome(&r), asked), ("none", vec![]));
    }
}
