//! One routing run: build a network, let it churn, announce every publisher's semantic keys,
//! run the measured round lookups, and check what they found against brute force.
//!
//! # Timeline (virtual time)
//! 1. `[0, warmup)`: only with churn. Nodes leave and rejoin on their timelines; a rejoining node
//!    starts from an empty table, fills it by bootstrap and looks up its own id (a real
//!    `FIND_NODE` lookup, so the nodes near it learn it); every online node refreshes its buckets
//!    every `refresh_interval` (libp2p's periodic bootstrap), dropping dead entries and
//!    refilling. Tables reach their steady-state staleness.
//! 2. `[T, T + 10 s)`: every online publisher announces its `L` band keys (each hot band on the
//!    shard its id picks), one `ADD_PROVIDER` lookup per key, storing the record at the closest
//!    nodes found.
//! 3. `[T + 30 s, T + 90 s)`: `lookups` queriers (random online publishers) each run a round
//!    lookup: one `GET_PROVIDERS` per band key (every shard of a hot band) and per multi-probe
//!    key, all in parallel.
//!
//! Time advances in epochs (default 5 s). Within an epoch, lookups run in parallel against the
//! tables and records of the epoch's start and the exact online state of every instant; their
//! effects (dead entries dropped, contacts learned, records stored) are applied at the epoch's
//! end in job order. Churn transitions and refreshes are applied in time order at epoch starts.
//!
//! # Measures
//! Per measured `GET_PROVIDERS` of a key that another publisher announced: hops, requests,
//! latency to the first provider, duration, success (a provider record came back). Per round
//! lookup: recall@k of the providers found, ranked by cosine, against the true k nearest online
//! publishers (ann-benchmarks' rule: a result counts if it is at least as close as the true
//! k-th neighbour), for every probe count up to the configured one. Per node: bytes of
//! announcements and lookups.

use std::time::Instant;

use kindred_proto::ModelId;
use kindred_routing::keys::{
    KeyConfig, KeyContext, NetworkId, ProbeSequence, RoundWindow, ShardPolicy, announce_shard,
    shard_key,
};
use rayon::prelude::*;

use super::Micros;
use super::churn::{ChurnConfig, Timelines};
use super::ids::{Ids, key_point};
use super::latency::Latency;
use super::lookup::{self, Job, KadParams, Kind, Net, Outcome};
use super::records::Records;
use super::table::{Tables, buckets_for};
use super::traffic::{MessageSizes, Phase, Traffic};
use super::workload::{Embeddings, Shards, Signatures, Workload, WorkloadError, dot};
use crate::stats::{mean, quantile};

const SECOND: Micros = 1_000_000;
const ANNOUNCE_SPREAD: Micros = 10 * SECOND;
const QUERY_DELAY: Micros = 30 * SECOND;
const QUERY_SPREAD: Micros = 60 * SECOND;
/// Lookups run per parallel batch.
const JOB_CHUNK: usize = 1 << 18;

/// Everything one run depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingConfig {
    /// Online nodes (with churn, the pool is `nodes / availability` identities).
    pub nodes: usize,
    /// Measured round lookups.
    pub lookups: usize,
    /// Seed of everything random.
    pub seed: u64,
    /// Kademlia parameters.
    pub kad: KadParams,
    /// Link latencies.
    pub latency: Latency,
    /// Churn; `None` for a static network.
    pub churn: Option<ChurnConfig>,
    /// Bucket refresh period of every node. Default 5 min (libp2p's periodic bootstrap).
    pub refresh_interval: Micros,
    /// Churn before the measured round. Default 15 min (ignored without churn).
    pub warmup: Micros,
    /// Epoch length. Default 5 s.
    pub epoch: Micros,
    /// LSH band layout. Default `kindred-routing`'s (16 × 16).
    pub keys: KeyConfig,
    /// Multi-probe keys per round lookup. Default `kindred-routing`'s (8).
    pub probes: usize,
    /// Hot-key sharding. Default `kindred-routing`'s.
    pub shards: ShardPolicy,
    /// Fraction of online nodes that publish an update this round. Default 1.
    pub publish_fraction: f64,
    /// Synthetic embeddings.
    pub workload: Workload,
    /// `k` of recall@k. Default 5.
    pub recall_k: usize,
    /// Round lookups checked against brute force; `None` picks `2·10^8 / publishers` clamped to
    /// `[100, 1000]` (brute force costs publishers × dim per query).
    pub recall_queries: Option<usize>,
    /// Message sizes.
    pub sizes: MessageSizes,
}

impl RoutingConfig {
    /// Defaults for `nodes` nodes and `lookups` round lookups.
    pub fn new(nodes: usize, lookups: usize) -> Self {
        let lookup = kindred_routing::LookupConfig::default();
        Self {
            nodes,
            lookups,
            seed: 1,
            kad: KadParams::default(),
            latency: Latency::default(),
            churn: None,
            refresh_interval: 300 * SECOND,
            warmup: 900 * SECOND,
            epoch: 5 * SECOND,
            keys: KeyConfig::default(),
            probes: lookup.probes,
            shards: ShardPolicy::default(),
            publish_fraction: 1.0,
            workload: Workload::default(),
            recall_k: 5,
            recall_queries: None,
            sizes: MessageSizes::default(),
        }
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RoutingError {
    /// Too few nodes or lookups, or a parameter out of range.
    #[error("invalid routing configuration: {0}")]
    Config(String),
    /// The workload could not be hashed.
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    /// Multi-probe margins were unusable.
    #[error("multi-probe failed: {0}")]
    Probe(#[from] kindred_routing::keys::ProbeError),
}

/// Percentiles and mean of one measure.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Summary {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
}

impl Summary {
    /// Summary of `values` (all `NaN` when empty).
    pub fn of<T: Copy + Into<f64>>(values: &[T]) -> Self {
        Self {
            p50: quantile(values, 0.5),
            p90: quantile(values, 0.9),
            p99: quantile(values, 0.99),
            mean: mean(values),
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RoutingReport {
    /// Configured online nodes.
    pub nodes: usize,
    /// Node identities (more than `nodes` with churn).
    pub pool: usize,
    /// Nodes online when the round started.
    pub online: usize,
    /// Publishers (nodes that announced).
    pub publishers: usize,
    /// Measured round lookups.
    pub lookups: usize,
    /// Measured `GET_PROVIDERS` lookups of keys another publisher announced.
    pub key_lookups: usize,
    /// DHT lookups per round lookup (bands with their shards, plus probes).
    pub key_lookups_per_query: f64,
    /// Hops per measured key lookup.
    pub hops: Summary,
    /// Requests per measured key lookup.
    pub rpcs: Summary,
    /// Milliseconds to the first provider (successful lookups).
    pub latency_ms: Summary,
    /// Milliseconds to the end of the lookup.
    pub duration_ms: Summary,
    /// Share of measured key lookups that returned a provider.
    pub success: f64,
    /// Measured key lookups cut short by the query timeout.
    pub timed_out: usize,
    /// `k` of recall@k.
    pub recall_k: usize,
    /// Round lookups checked against brute force.
    pub recall_queries: usize,
    /// Mean recall@k with the configured probes.
    pub recall: f64,
    /// Mean recall@k with the first `p` probes, `p = 0..=probes`.
    pub recall_by_probes: Vec<f64>,
    /// Mean recall@k if every provider found were ranked, not only the first `max_providers`
    /// (a diagnostic: the routing core does cap).
    pub recall_uncapped: f64,
    /// Mean recall@k if the provider cap kept the providers returned under the most keys
    /// instead of the first to arrive (a diagnostic for the routing core).
    pub recall_by_key_count: f64,
    /// Mean cosine of the true k-th nearest neighbour (the workload's difficulty).
    pub neighbour_cosine: f64,
    /// Share of the found top-k in the querier's own task cluster.
    pub found_same_task: f64,
    /// Mean distinct providers a round lookup asks for headers (those found, up to the cap):
    /// one header request, and a connection unless one is open, each.
    pub providers_asked: f64,
    /// Requests per announcement lookup (including the `ADD_PROVIDER` messages).
    pub announce_rpcs: Summary,
    /// Announcement lookups run.
    pub announce_lookups: usize,
    /// DHT bytes a node sends (≈ receives) per round: its announcements plus one round lookup.
    pub dht_bytes_per_node_round: f64,
    /// Per-node bytes sent + received in the measured round (announcements of all, lookups of
    /// the measured queriers, and serving both), over online nodes.
    pub node_bytes: Summary,
    /// Bytes of bootstrap lookups during the run.
    pub maintenance_bytes: u64,
    /// Hot `(band, value)` pairs (more than one shard).
    pub hot_bands: usize,
    /// Churn rate per hour (0 without churn).
    pub churn_per_hour: f64,
    /// Nodes that rejoined during the run.
    pub rejoins: usize,
    /// Bucket refreshes run.
    pub refreshes: usize,
    /// Share of table entries (of online nodes) pointing at departed nodes when the round
    /// started.
    pub stale_entries: f64,
    /// Mean table entries per online node when the round started.
    pub table_entries: f64,
    /// Wall-clock seconds of the whole run.
    pub seconds: f64,
    /// Seconds spent building ids, timelines, tables, embeddings.
    pub setup_seconds: f64,
    /// Seconds spent simulating.
    pub sim_seconds: f64,
    /// Seconds spent on brute-force recall.
    pub recall_seconds: f64,
}

pub use crate::ProgressFn;

/// What a job is, for bookkeeping its outcome.
#[derive(Debug, Clone, Copy)]
enum Tag {
    Bootstrap,
    Announce,
    Query { q: u32, probe: u8 },
}

#[derive(Debug, Clone)]
struct QueryRec {
    querier: u32,
    start: Micros,
    /// Every provider record received, as `(arrival after start, provider, probe index)`;
    /// probe 0 is the band keys. Kept only for the round lookups checked against brute force.
    found: Vec<(Micros, u32, u8)>,
}

#[derive(Debug, Clone, Copy)]
struct KeyRec {
    querier: u32,
    point: u64,
    hops: u8,
    rpcs: u32,
    found: bool,
    timed_out: bool,
    first_ms: f32,
    duration_ms: f32,
}

/// Run one routing experiment.
///
/// # Errors
/// [`RoutingError`] for an invalid configuration or a failing kernel.
pub fn run(cfg: &RoutingConfig, progress: ProgressFn<'_>) -> Result<RoutingReport, RoutingError> {
    let wall = Instant::now();
    if cfg.nodes < 2 * cfg.kad.replication.max(2) {
        return Err(RoutingError::Config(format!(
            "need at least {} nodes",
            2 * cfg.kad.replication.max(2)
        )));
    }
    if cfg.epoch == 0 || cfg.kad.alpha == 0 || cfg.kad.replication == 0 {
        return Err(RoutingError::Config(
            "epoch, alpha and replication must be positive".into(),
        ));
    }
    let churn = cfg.churn.filter(|c| c.rate_per_hour > 0.0);
    let pool = match churn {
        Some(c) => (cfg.nodes as f64 / c.availability.clamp(0.01, 1.0)).ceil() as usize,
        None => cfg.nodes,
    };
    if pool > u32::MAX as usize / 2 {
        return Err(RoutingError::Config("too many nodes".into()));
    }
    let round = if churn.is_some() { cfg.warmup } else { 0 };
    let horizon = round + QUERY_DELAY + QUERY_SPREAD + cfg.kad.query_timeout + cfg.epoch;
    progress("setup", 0, 4);
    let ids = Ids::random(pool, cfg.seed);
    let timelines = match &churn {
        Some(c) => Timelines::generate(pool, c, horizon, cfg.seed),
        None => Timelines::always_on(pool),
    };
    progress("setup", 1, 4);
    let mut tables = Tables::converged(
        &ids,
        buckets_for(pool),
        cfg.kad.bucket_size,
        &|i| timelines.online(i, 0),
        cfg.seed,
    );
    progress("setup", 2, 4);
    let emb = Embeddings::generate(pool, &cfg.workload, cfg.seed);
    let publishers: Vec<u32> = (0..pool as u32)
        .filter(|&i| {
            timelines.online(i, round)
                && crate::rng::unit_open(crate::rng::hash_words(cfg.seed, &[0x9B, u64::from(i)]))
                    <= cfg.publish_fraction
        })
        .collect();
    if publishers.len() < 2 {
        return Err(RoutingError::Config("fewer than two publishers".into()));
    }
    let sigs = Signatures::compute(&emb, &publishers, pool, cfg.seed ^ 0x51A)?;
    let shards = Shards::steady_state(
        &sigs,
        &publishers,
        cfg.keys,
        cfg.shards,
        cfg.kad.replication,
    );
    progress("setup", 3, 4);
    let ctx = KeyContext::new(
        NetworkId::from_name("kindred-sim"),
        ModelId(*blake3::hash(b"kindred-sim/routing-workload").as_bytes()),
        RoundWindow(0),
        cfg.keys,
    );
    let announce_at: Vec<(Micros, u32)> = {
        let mut v: Vec<(Micros, u32)> = publishers
            .iter()
            .map(|&i| {
                let u = crate::rng::hash_words(cfg.seed, &[0xA7, u64::from(i)]) % ANNOUNCE_SPREAD;
                (round + u, i)
            })
            .collect();
        v.sort_unstable();
        v
    };
    let queries: Vec<(Micros, u32)> = {
        let mut rng = crate::rng::stream(cfg.seed, &[0x0E7]);
        let mut v = Vec::with_capacity(cfg.lookups);
        let mut attempts = 0usize;
        while v.len() < cfg.lookups && attempts < cfg.lookups * 100 + 1000 {
            attempts += 1;
            let q = publishers
                .get(rng.below(publishers.len() as u64) as usize)
                .copied()
                .unwrap_or(0);
            let at = round + QUERY_DELAY + rng.below(QUERY_SPREAD);
            if timelines.online(q, at) {
                v.push((at, q));
            }
        }
        v.sort_unstable();
        v
    };
    let setup_seconds = wall.elapsed().as_secs_f64();
    let recall_queries = cfg
        .recall_queries
        .unwrap_or_else(|| (200_000_000 / publishers.len().max(1)).clamp(100, 1000))
        .min(queries.len());

    let mut records = Records::new();
    let traffic = Traffic::new(pool);
    let mut report = RoutingReport {
        nodes: cfg.nodes,
        pool,
        publishers: publishers.len(),
        lookups: queries.len(),
        hot_bands: shards.hot_count(),
        churn_per_hour: churn.map_or(0.0, |c| c.rate_per_hour),
        setup_seconds,
        ..RoutingReport::default()
    };
    let mut query_recs: Vec<QueryRec> = Vec::with_capacity(queries.len());
    let mut key_recs: Vec<KeyRec> = Vec::new();
    let mut announce_rpcs: Vec<u32> = Vec::new();
    let (mut ai, mut qi) = (0usize, 0usize);
    let epochs = horizon.div_ceil(cfg.epoch);
    let sim_start = Instant::now();
    let mut stale_measured = false;
    for e in 0..epochs {
        let (e0, e1) = (e * cfg.epoch, (e + 1) * cfg.epoch);
        if !stale_measured && e1 > round {
            let (stale, entries) = staleness(&ids, &tables, &timelines, round);
            report.stale_entries = stale;
            report.table_entries = entries;
            report.online = (0..pool as u32)
                .filter(|&i| timelines.online(i, round))
                .count();
            stale_measured = true;
        }
        let mut jobs: Vec<Job> = Vec::new();
        let mut tags: Vec<Tag> = Vec::new();
        // Churn: rejoining nodes restart from nothing and bootstrap.
        if churn.is_some() {
            for tr in timelines.transitions(e0, e1) {
                if !tr.up {
                    continue;
                }
                tables.clear(tr.node);
                let mut rng = crate::rng::stream(cfg.seed, &[0x10_1E, u64::from(tr.node), tr.at]);
                tables.refresh(&ids, tr.node, &|x| timelines.online(x, tr.at), &mut rng);
                report.rejoins += 1;
                jobs.push(Job {
                    kind: Kind::FindNode,
                    querier: tr.node,
                    target: ids.id(tr.node),
                    start: tr.at,
                    phase: Phase::Maintenance,
                });
                tags.push(Tag::Bootstrap);
            }
            let period = cfg.refresh_interval.max(1);
            let due = |node: u32| {
                let phase = crate::rng::hash_words(cfg.seed, &[0xFE, u64::from(node)]) % period;
                let wait = (phase + period - e0 % period) % period;
                let at = e0 + wait;
                (at < e1 && timelines.online(node, at)).then_some(at)
            };
            let (_, _, n) =
                tables.par_refresh(&ids, &due, &|x, at| timelines.online(x, at), cfg.seed);
            report.refreshes += n;
        }
        // Announcements starting this epoch.
        while let Some(&(at, node)) = announce_at.get(ai) {
            if at >= e1 {
                break;
            }
            ai += 1;
            if !timelines.online(node, at) {
                continue;
            }
            let sig = sigs.sig(node);
            let salt = ids.id(node).to_le_bytes();
            for band in 0..cfg.keys.bands() {
                let value = cfg.keys.band_value(&sig, band);
                let base = ctx.band_key(band, value);
                let n = shards.get(band as u16, value);
                let key = shard_key(&base, announce_shard(&salt, &base, n));
                jobs.push(Job {
                    kind: Kind::AddProvider,
                    querier: node,
                    target: key_point(&key),
                    start: at,
                    phase: Phase::Announce,
                });
                tags.push(Tag::Announce);
            }
        }
        // Round lookups starting this epoch.
        while let Some(&(at, node)) = queries.get(qi) {
            if at >= e1 {
                break;
            }
            let q = query_recs.len() as u32;
            qi += 1;
            let sig = sigs.sig(node);
            let margins = sigs.margins(&emb, node)?;
            let mut origins: Vec<(u16, u64, u8)> = (0..cfg.keys.bands())
                .map(|b| (b as u16, cfg.keys.band_value(&sig, b), 0u8))
                .collect();
            if cfg.probes > 0 {
                let seq = ProbeSequence::new(&sig, &margins, cfg.keys)?;
                origins.extend(
                    seq.take(cfg.probes)
                        .enumerate()
                        .map(|(i, p)| (p.band, p.value, (i + 1).min(255) as u8)),
                );
            }
            for (band, value, probe) in origins {
                let base = ctx.band_key(usize::from(band), value);
                for s in 0..shards.get(band, value) {
                    jobs.push(Job {
                        kind: Kind::GetProviders,
                        querier: node,
                        target: key_point(&shard_key(&base, s)),
                        start: at,
                        phase: Phase::Query,
                    });
                    tags.push(Tag::Query { q, probe });
                }
            }
            query_recs.push(QueryRec {
                querier: node,
                start: at,
                found: Vec::new(),
            });
        }
        if jobs.is_empty() {
            progress("simulate", e + 1, epochs);
            continue;
        }
        // Run the epoch's lookups in parallel, in chunks (bounding the memory of outcomes);
        // their effects on tables and records wait for the end of the epoch.
        let mut stored = Vec::new();
        let mut dead: Vec<(u32, u32)> = Vec::new();
        let mut learned: Vec<(u32, u32)> = Vec::new();
        for (chunk_jobs, chunk_tags) in jobs.chunks(JOB_CHUNK).zip(tags.chunks(JOB_CHUNK)) {
            let outcomes: Vec<Outcome> = {
                let net = Net {
                    ids: &ids,
                    tables: &tables,
                    timelines: &timelines,
                    latency: &cfg.latency,
                    records: &records,
                    params: &cfg.kad,
                    sizes: &cfg.sizes,
                    traffic: &traffic,
                    seed: cfg.seed,
                };
                chunk_jobs
                    .par_iter()
                    .map(|j| lookup::run(&net, j))
                    .collect()
            };
            for ((job, tag), out) in chunk_jobs.iter().zip(chunk_tags).zip(outcomes) {
                dead.extend(out.dead.iter().map(|&d| (job.querier, d)));
                learned.extend_from_slice(&out.learned);
                match *tag {
                    Tag::Bootstrap => {}
                    Tag::Announce => {
                        announce_rpcs.push(out.rpcs);
                        if let Some(a) = out.stored {
                            stored.push(a);
                        }
                    }
                    Tag::Query { q, probe } => {
                        if (q as usize) < recall_queries
                            && let Some(rec) = query_recs.get_mut(q as usize)
                        {
                            rec.found.extend(
                                out.provider_at
                                    .iter()
                                    .zip(&out.providers)
                                    .map(|(&at, &p)| (at, p, probe)),
                            );
                        }
                        key_recs.push(KeyRec {
                            querier: job.querier,
                            point: job.target,
                            hops: out.hops,
                            rpcs: out.rpcs,
                            found: !out.providers.is_empty(),
                            timed_out: out.timed_out,
                            first_ms: out.first_provider.map_or(f32::NAN, |t| t as f32 / 1000.0),
                            duration_ms: out.duration as f32 / 1000.0,
                        });
                    }
                }
            }
        }
        for (node, d) in dead {
            tables.remove(&ids, node, d);
        }
        for (node, other) in learned {
            tables.insert(&ids, node, other);
        }
        records.extend(stored);
        progress("simulate", e + 1, epochs);
    }
    report.sim_seconds = sim_start.elapsed().as_secs_f64();

    // Key lookups of keys someone else announced.
    let measured: Vec<&KeyRec> = key_recs
        .iter()
        .filter(|k| records.announcers(k.point).any(|p| p != k.querier))
        .collect();
    report.key_lookups = measured.len();
    report.key_lookups_per_query = key_recs.len() as f64 / query_recs.len().max(1) as f64;
    let hops: Vec<f64> = measured.iter().map(|k| f64::from(k.hops)).collect();
    let rpcs: Vec<f64> = measured.iter().map(|k| f64::from(k.rpcs)).collect();
    let lat: Vec<f64> = measured
        .iter()
        .filter(|k| k.found)
        .map(|k| f64::from(k.first_ms))
        .collect();
    let dur: Vec<f64> = measured.iter().map(|k| f64::from(k.duration_ms)).collect();
    report.hops = Summary::of(&hops);
    report.rpcs = Summary::of(&rpcs);
    report.latency_ms = Summary::of(&lat);
    report.duration_ms = Summary::of(&dur);
    report.success =
        measured.iter().filter(|k| k.found).count() as f64 / measured.len().max(1) as f64;
    report.timed_out = measured.iter().filter(|k| k.timed_out).count();
    report.announce_rpcs = Summary::of(&announce_rpcs);
    report.announce_lookups = announce_rpcs.len();

    // Traffic.
    let ann = traffic.announce.load(std::sync::atomic::Ordering::Relaxed) as f64;
    let qry = traffic.query.load(std::sync::atomic::Ordering::Relaxed) as f64;
    report.dht_bytes_per_node_round =
        ann / publishers.len().max(1) as f64 + qry / query_recs.len().max(1) as f64;
    let per_node = traffic.per_node();
    let online_bytes: Vec<f64> = (0..pool as u32)
        .filter(|&i| timelines.online(i, round))
        .map(|i| per_node.get(i as usize).copied().unwrap_or(0) as f64)
        .collect();
    report.node_bytes = Summary::of(&online_bytes);
    report.maintenance_bytes = traffic
        .maintenance
        .load(std::sync::atomic::Ordering::Relaxed);

    // Recall against brute force.
    let recall_start = Instant::now();
    let rq = recall_queries;
    report.recall_k = cfg.recall_k;
    report.recall_queries = rq;
    let k = cfg.recall_k.max(1);
    let probes = cfg.probes.min(254);
    let per_query: Vec<RecallOf> = query_recs
        .iter()
        .take(rq)
        .collect::<Vec<_>>()
        .par_iter()
        .map(|rec| {
            recall_of(
                rec,
                &emb,
                &publishers,
                &timelines,
                k,
                probes,
                cfg.kad.max_providers,
                cfg.kad.query_timeout,
            )
        })
        .collect();
    if !per_query.is_empty() {
        let avg = |f: &dyn Fn(&RecallOf) -> f64| {
            per_query.iter().map(f).sum::<f64>() / per_query.len() as f64
        };
        report.recall_by_probes = (0..=probes)
            .map(|p| avg(&|r| r.by_probe.get(p).copied().unwrap_or(0.0)))
            .collect();
        report.recall = report.recall_by_probes.last().copied().unwrap_or(0.0);
        report.recall_uncapped = avg(&|r| r.uncapped);
        report.recall_by_key_count = avg(&|r| r.by_keys);
        report.neighbour_cosine = avg(&|r| r.kth);
        report.found_same_task = avg(&|r| r.same_task);
        report.providers_asked = avg(&|r| r.asked);
    }
    report.recall_seconds = recall_start.elapsed().as_secs_f64();
    report.seconds = wall.elapsed().as_secs_f64();
    Ok(report)
}

/// Share of table entries of online nodes that point at offline nodes at `t`, and mean entries
/// per online node (over a sample of at most 20,000 nodes).
fn staleness(ids: &Ids, tables: &Tables, timelines: &Timelines, t: Micros) -> (f64, f64) {
    let n = ids.len() as u32;
    let step = (n / 20_000).max(1);
    let (mut stale, mut total, mut nodes) = (0usize, 0usize, 0usize);
    for node in (0..n).step_by(step as usize) {
        if !timelines.online(node, t) {
            continue;
        }
        nodes += 1;
        for e in tables.entries(node) {
            total += 1;
            if !timelines.online(e, t) {
                stale += 1;
            }
        }
    }
    (
        stale as f64 / total.max(1) as f64,
        total as f64 / nodes.max(1) as f64,
    )
}

/// What brute force says about one round lookup.
struct RecallOf {
    /// Recall@k with the first `p` probes, `p = 0..=probes` (provider cap applied).
    by_probe: Vec<f64>,
    /// Recall@k with every provider found ranked (no cap), all probes.
    uncapped: f64,
    /// Recall@k if the cap kept the providers found under the most keys.
    by_keys: f64,
    /// Cosine of the true k-th neighbour.
    kth: f64,
    /// Share of the found top-k in the querier's task.
    same_task: f64,
    /// Distinct providers asked for headers (found, up to the cap).
    asked: f64,
}

/// Recall@k of one round lookup against brute force.
///
/// The routing core keeps the first `max_providers` distinct providers in arrival order and
/// ranks only their headers, so that is what is ranked here, per probe count (a lookup with
/// fewer probes receives a subset of the records, in the same order).
#[allow(clippy::too_many_arguments)]
fn recall_of(
    rec: &QueryRec,
    emb: &Embeddings,
    publishers: &[u32],
    timelines: &Timelines,
    k: usize,
    probes: usize,
    max_providers: usize,
    timeout: Micros,
) -> RecallOf {
    let q = rec.querier;
    let qv = emb.vec(q);
    // True top-k among online publishers.
    let mut best: Vec<f32> = Vec::with_capacity(k + 1);
    for &p in publishers {
        if p == q || !timelines.online(p, rec.start) {
            continue;
        }
        let c = dot(qv, emb.vec(p));
        if best.len() < k || c > best.last().copied().unwrap_or(f32::MIN) {
            let pos = best.partition_point(|&b| b >= c);
            best.insert(pos, c);
            best.truncate(k);
        }
    }
    let kth = best.last().copied().unwrap_or(f32::MIN);
    let denom = best.len().max(1) as f64;
    let end = rec.start + timeout;
    let mut arrivals = rec.found.clone();
    arrivals.sort_unstable();
    // Rank the first `max_providers` distinct providers (arrival order) among those received
    // by lookups with probe index ≤ `pr`; count the hits in the top k.
    let ranked = |pr: usize, cap: usize| -> Vec<(f32, u32)> {
        let mut seen: Vec<u32> = Vec::new();
        let mut known = std::collections::HashSet::new();
        for &(_, p, probe) in &arrivals {
            if usize::from(probe) <= pr && known.insert(p) {
                seen.push(p);
                if seen.len() >= cap {
                    break;
                }
            }
        }
        let mut v: Vec<(f32, u32)> = seen
            .into_iter()
            .filter(|&p| p != q && timelines.online(p, end))
            .map(|p| (dot(qv, emb.vec(p)), p))
            .collect();
        v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        v.truncate(k);
        v
    };
    let hits = |top: &[(f32, u32)]| top.iter().filter(|f| f.0 >= kth - 1e-6).count() as f64 / denom;
    let by_probe: Vec<f64> = (0..=probes)
        .map(|pr| hits(&ranked(pr, max_providers)))
        .collect();
    let top = ranked(probes, max_providers);
    let same_task = top
        .iter()
        .filter(|f| emb.cluster(f.1) == emb.cluster(q))
        .count() as f64
        / top.len().max(1) as f64;
    // Alternative the core could use: keep the providers returned under the most keys (each
    // shared band is evidence of similarity), earliest first among equals.
    let by_keys = {
        let mut count: std::collections::HashMap<u32, (u32, Micros)> =
            std::collections::HashMap::new();
        for &(at, p, _) in &arrivals {
            let e = count.entry(p).or_insert((0, at));
            e.0 += 1;
            e.1 = e.1.min(at);
        }
        let mut order: Vec<(u32, Micros, u32)> =
            count.into_iter().map(|(p, (n, at))| (n, at, p)).collect();
        order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut v: Vec<(f32, u32)> = order
            .into_iter()
            .take(max_providers)
            .filter(|&(_, _, p)| p != q && timelines.online(p, end))
            .map(|(_, _, p)| (dot(qv, emb.vec(p)), p))
            .collect();
        v.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        v.truncate(k);
        hits(&v)
    };
    RecallOf {
        by_probe,
        by_keys,
        uncapped: hits(&ranked(probes, usize::MAX)),
        kth: f64::from(kth),
        same_task,
        asked: {
            let mut distinct: Vec<u32> = arrivals.iter().map(|f| f.1).collect();
            distinct.sort_unstable();
            distinct.dedup();
            distinct
                .iter()
                .filter(|&&p| p != q)
                .count()
                .min(max_providers) as f64
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quiet(_: &str, _: u64, _: u64) {}

    #[test]
    fn small_static_run_finds_providers_and_neighbours() {
        let mut cfg = RoutingConfig::new(2000, 60);
        cfg.seed = 3;
        let r = run(&cfg, &quiet).unwrap();
        assert_eq!(r.lookups, 60);
        assert!(r.key_lookups > 100, "{}", r.key_lookups);
        assert!(r.success > 0.99, "success {}", r.success);
        assert!(r.hops.p50 >= 1.0 && r.hops.p50 <= 4.0, "hops {:?}", r.hops);
        // A lookup asks at least the provider quorum's holders.
        assert!(r.rpcs.p50 >= cfg.kad.provider_quorum as f64, "{:?}", r.rpcs);
        assert!(r.recall > 0.5, "recall {}", r.recall);
        assert_eq!(r.recall_by_probes.len(), cfg.probes + 1);
        assert!(r.recall_by_probes.windows(2).all(|w| w[0] <= w[1] + 1e-12));
        assert!(r.dht_bytes_per_node_round > 0.0);
        assert_eq!(r.stale_entries, 0.0);
    }

    #[test]
    fn churn_leaves_stale_entries_that_lookups_survive() {
        let mut cfg = RoutingConfig::new(1500, 40);
        cfg.churn = Some(ChurnConfig {
            rate_per_hour: 3.0,
            ..ChurnConfig::default()
        });
        cfg.warmup = 600 * SECOND;
        let r = run(&cfg, &quiet).unwrap();
        assert!(r.pool > r.nodes, "the pool covers offline identities");
        assert!(
            r.rejoins > 10 && r.refreshes > 1000,
            "{} {}",
            r.rejoins,
            r.refreshes
        );
        assert!(
            r.stale_entries > 0.0 && r.stale_entries < 0.2,
            "{}",
            r.stale_entries
        );
        assert!(r.success > 0.97, "success {}", r.success);
        assert!(r.maintenance_bytes > 0);
    }

    #[test]
    fn same_seed_same_figures() {
        let mut cfg = RoutingConfig::new(600, 20);
        cfg.churn = Some(ChurnConfig {
            rate_per_hour: 3.0,
            ..ChurnConfig::default()
        });
        cfg.warmup = 120 * SECOND;
        let a = run(&cfg, &quiet).unwrap();
        let b = run(&cfg, &quiet).unwrap();
        let strip = |mut r: RoutingReport| {
            r.seconds = 0.0;
            r.setup_seconds = 0.0;
            r.sim_seconds = 0.0;
            r.recall_seconds = 0.0;
            r
        };
        assert_eq!(strip(a.clone()), strip(b));
        cfg.seed = 2;
        let c = run(&cfg, &quiet).unwrap();
        assert_ne!(strip(a), strip(c));
    }
}
