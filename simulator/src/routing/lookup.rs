//! One DHT lookup, run to completion as a sans-IO state machine with its own event queue.
//!
//! The initiator seeds a [`ClosestIter`] with the 20 closest entries of its own table, sends
//! requests as the iterator asks, and feeds it the answers in virtual-time order: a request to a
//! live node is answered after the link's RTT with the responder's closest table entries (and,
//! for `GET_PROVIDERS`, the providers it holds); a request to a node that has left fails after
//! the dial timeout. The lookup sees the network as it is at the start of its epoch (tables and
//! records) and as it is at each instant (who is online); what it changes (failed entries
//! dropped, new contacts learned, records stored) is returned and applied by the caller between
//! epochs, in job order, so results do not depend on which thread ran which lookup.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::Micros;
use super::churn::Timelines;
use super::ids::Ids;
use super::iter::{ClosestIter, IterConfig, Next};
use super::latency::Latency;
use super::records::{Announcement, Records};
use super::table::Tables;
use super::traffic::{MessageSizes, Phase, Traffic};

/// Kademlia parameters of the model (defaults: libp2p-kad's as configured by
/// `kindred-routing`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KadParams {
    /// k-bucket size, and closer peers per answer. Default 20 (libp2p's `K_VALUE`: libp2p-kad
    /// answers `FIND_NODE` and `GET_PROVIDERS` with up to 20 closer peers whatever the
    /// replication factor).
    pub bucket_size: usize,
    /// Replication factor: providers per answer, closest peers a
    /// lookup must reach, holders per provider record (`kindred_routing::KadConfig`'s).
    pub replication: usize,
    /// Lookup parallelism `α` (`kindred_routing::KadConfig`'s).
    pub alpha: usize,
    /// Per-peer timeout of the iterator. Default 10 s (libp2p).
    pub peer_timeout: Micros,
    /// How long dialling a departed node takes to fail. Default 5 s (`kindred-routing`'s
    /// transport handshake timeout).
    pub dial_timeout: Micros,
    /// Deadline of a whole lookup. Default 20 s (`kindred_routing::KadConfig`).
    pub query_timeout: Micros,
    /// Providers a node stores per key. Default 64 (`kindred_routing::KadConfig`).
    pub max_providers_per_key: usize,
    /// A `GET_PROVIDERS` lookup ends once this many responses carried providers (other than
    /// the initiator); 0 runs to Kademlia's own termination. Default 2
    /// (`kindred_routing::LookupConfig::provider_quorum`).
    pub provider_quorum: usize,
    /// A `GET_PROVIDERS` lookup whose initiator's table holds fewer than 20 peers (one
    /// answer's worth) also ends once this many responses came back and none carried
    /// providers. Default 2 (`kindred_routing::LookupConfig::empty_quorum`).
    pub empty_quorum: usize,
    /// Most distinct providers a round lookup keeps (and asks for headers). Default 768
    /// (`kindred_routing::LookupConfig::max_providers`).
    pub max_providers: usize,
}

impl Default for KadParams {
    fn default() -> Self {
        let kad = kindred_routing::KadConfig::default();
        Self {
            bucket_size: 20,
            replication: kad.replication_factor.get(),
            alpha: kad.parallelism.get(),
            peer_timeout: 10_000_000,
            dial_timeout: 5_000_000,
            query_timeout: kad.query_timeout.as_micros() as Micros,
            max_providers_per_key: kad.max_providers_per_key,
            provider_quorum: kindred_routing::LookupConfig::default().provider_quorum,
            empty_quorum: kindred_routing::LookupConfig::default().empty_quorum,
            max_providers: kindred_routing::LookupConfig::default().max_providers,
        }
    }
}

/// Everything a lookup reads: the network as of its epoch.
#[derive(Debug, Clone, Copy)]
pub struct Net<'a> {
    /// Node ids.
    pub ids: &'a Ids,
    /// Routing tables.
    pub tables: &'a Tables,
    /// Who is online when.
    pub timelines: &'a Timelines,
    /// Link RTTs.
    pub latency: &'a Latency,
    /// Provider records.
    pub records: &'a Records,
    /// Kademlia parameters.
    pub params: &'a KadParams,
    /// Message sizes.
    pub sizes: &'a MessageSizes,
    /// Byte counters.
    pub traffic: &'a Traffic,
    /// Run seed (link latencies).
    pub seed: u64,
}

/// What a lookup is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `FIND_NODE`, wanting the 20 closest (a bootstrap's self-lookup).
    FindNode,
    /// `GET_PROVIDERS`.
    GetProviders,
    /// `ADD_PROVIDER`: find the closest nodes, then store the record at them.
    AddProvider,
}

/// A lookup to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Job {
    /// Its kind.
    pub kind: Kind,
    /// The initiating node (online at `start`).
    pub querier: u32,
    /// Target point.
    pub target: u64,
    /// Start time.
    pub start: Micros,
    /// Traffic accounting bucket.
    pub phase: Phase,
}

/// What a lookup did and found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// Requests sent (including ones that failed, and `ADD_PROVIDER` messages).
    pub rpcs: u32,
    /// Requests that failed (the peer had left).
    pub failed: u32,
    /// Hops: for `GET_PROVIDERS` the hop of the first peer that returned a provider, otherwise
    /// (or if none did) the hop of the closest peer that answered.
    pub hops: u8,
    /// Time from start to the first provider received.
    pub first_provider: Option<Micros>,
    /// Time from start to the end of the lookup.
    pub duration: Micros,
    /// Whether the query deadline cut it short.
    pub timed_out: bool,
    /// Distinct providers found (not the initiator).
    pub providers: Vec<u32>,
    /// When each provider of `providers` first arrived (time from start).
    pub provider_at: Vec<Micros>,
    /// The closest peers that answered (at most the replication factor or 20 for `FIND_NODE`).
    pub closest: Vec<u32>,
    /// Peers found dead (to drop from the initiator's table).
    pub dead: Vec<u32>,
    /// `(node, learned)` table insertions: contacts whose bucket had room.
    pub learned: Vec<(u32, u32)>,
    /// The record stored by an `ADD_PROVIDER`.
    pub stored: Option<Announcement>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum EvKind {
    Response,
    Failure,
    Tick,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Ev {
    at: Micros,
    seq: u32,
    kind: EvKind,
    node: u32,
    dist: u64,
    /// When the request reached the peer.
    arrive: Micros,
}

/// Node `y`'s answer to `job`'s request, which reached it at `arrive`: its closer peers into
/// `closer` and the providers it holds into `providers`, with the answer's bytes counted.
/// libp2p-kad answers with up to `K_VALUE` closer peers whatever the replication factor, and its
/// iterator takes them all as candidates.
fn answer(
    net: &Net<'_>,
    job: &Job,
    y: u32,
    arrive: Micros,
    closer: &mut Vec<(u64, u32)>,
    providers: &mut Vec<u32>,
) {
    let p = net.params;
    let q = job.querier;
    net.tables
        .closest(net.ids, y, job.target, p.bucket_size, q, closer);
    providers.clear();
    if job.kind == Kind::GetProviders {
        net.records.providers_at(
            net.timelines,
            y,
            job.target,
            arrive,
            q,
            p.max_providers_per_key,
            p.replication,
            providers,
        );
    }
    let entries = (closer.len() + providers.len()) as u32;
    net.traffic.message(
        job.phase,
        y,
        q,
        net.sizes.response_base + entries * net.sizes.peer_entry,
    );
}

/// libp2p-kad's `K_VALUE`: a walk is seeded with this many of the initiator's closest table
/// entries (and a `FIND_NODE` lookup wants this many results).
const K_VALUE: usize = 20;

/// Run `job` on `net` to completion.
pub fn run(net: &Net<'_>, job: &Job) -> Outcome {
    let p = net.params;
    let num_results = match job.kind {
        Kind::FindNode => K_VALUE,
        _ => p.replication,
    };
    let mut scratch: Vec<(u64, u32)> = Vec::with_capacity(64);
    net.tables.closest(
        net.ids,
        job.querier,
        job.target,
        K_VALUE,
        u32::MAX,
        &mut scratch,
    );
    let mut it = ClosestIter::new(
        IterConfig {
            parallelism: p.alpha,
            num_results,
            peer_timeout: p.peer_timeout,
        },
        scratch.iter().copied(),
    );
    let mut out = Outcome::default();
    let mut queue: BinaryHeap<Reverse<Ev>> = BinaryHeap::new();
    let mut seq = 0u32;
    let mut hops_of: Vec<(u32, u8)> = Vec::new();
    let mut provs: Vec<u32> = Vec::new();
    let mut feed: Vec<(u64, u32)> = Vec::with_capacity(80);
    let mut carried = 0usize;
    let mut answered = 0usize;
    // The seed did not fill: the initiator's table is whole, and the walk asks the key's
    // closest peers first.
    let whole_table = scratch.len() < K_VALUE;
    let deadline = job.start + p.query_timeout;
    let mut now = job.start;
    let q = job.querier;
    let sizes = net.sizes;
    'run: loop {
        loop {
            match it.next(now) {
                Next::Contact { node, dist, hop } => {
                    out.rpcs += 1;
                    hops_of.push((node, hop));
                    let rtt = net.latency.rtt(net.seed, q, node);
                    let arrive = now + rtt / 2;
                    seq += 1;
                    let ev = if net.timelines.online(node, arrive) {
                        net.traffic.message(job.phase, q, node, sizes.request);
                        Ev {
                            at: now + rtt,
                            seq,
                            kind: EvKind::Response,
                            node,
                            dist,
                            arrive,
                        }
                    } else {
                        Ev {
                            at: now + p.dial_timeout,
                            seq,
                            kind: EvKind::Failure,
                            node,
                            dist,
                            arrive,
                        }
                    };
                    if ev.at > now + p.peer_timeout {
                        seq += 1;
                        queue.push(Reverse(Ev {
                            at: now + p.peer_timeout,
                            seq,
                            kind: EvKind::Tick,
                            node,
                            dist,
                            arrive,
                        }));
                    }
                    queue.push(Reverse(ev));
                }
                Next::Finished => break 'run,
                Next::Waiting | Next::WaitingAtCapacity => break,
            }
        }
        let Some(Reverse(ev)) = queue.pop() else {
            break;
        };
        if ev.at > deadline {
            out.timed_out = true;
            now = deadline;
            it.finish();
            break;
        }
        now = ev.at;
        match ev.kind {
            EvKind::Response => {
                let y = ev.node;
                answer(net, job, y, ev.arrive, &mut scratch, &mut provs);
                let mut new_provider = false;
                for &pr in &provs {
                    if pr != q && !out.providers.contains(&pr) {
                        out.providers.push(pr);
                        out.provider_at.push(now - job.start);
                        new_provider = true;
                    }
                }
                if new_provider && out.first_provider.is_none() {
                    out.first_provider = Some(now - job.start);
                    out.hops = hop_of(&hops_of, y);
                }
                learn(net, &mut out.learned, q, y);
                learn(net, &mut out.learned, y, q);
                feed.clear();
                feed.extend(scratch.iter().copied());
                feed.extend(
                    provs
                        .iter()
                        .filter(|&&pr| pr != q)
                        .map(|&pr| (net.ids.id(pr) ^ job.target, pr)),
                );
                it.on_success(ev.dist, feed.iter().copied());
                answered += 1;
                // The routing core finishes a provider lookup once `quorum` holders answered...
                if provs.iter().any(|&pr| pr != q) {
                    carried += 1;
                    if p.provider_quorum > 0 && carried == p.provider_quorum {
                        it.finish();
                        break;
                    }
                }
                // ... and, in a swarm whose tables are whole, once `empty_quorum` answered
                // without a record.
                if job.kind == Kind::GetProviders
                    && whole_table
                    && carried == 0
                    && p.empty_quorum > 0
                    && answered >= p.empty_quorum
                {
                    it.finish();
                    break;
                }
            }
            EvKind::Failure => {
                out.failed += 1;
                out.dead.push(ev.node);
                it.on_failure(ev.dist);
            }
            EvKind::Tick => {}
        }
    }
    // Requests still in flight when the lookup ended were answered all the same: the answers
    // are on the wire even though the iterator no longer reads them.
    for Reverse(ev) in queue {
        if ev.kind == EvKind::Response && ev.arrive <= deadline {
            answer(net, job, ev.node, ev.arrive, &mut scratch, &mut provs);
        }
    }
    out.duration = now - job.start;
    out.closest = it.result().map(|(n, _)| n).collect();
    if out.first_provider.is_none() {
        out.hops = it.result().next().map_or(0, |(_, h)| h);
    }
    if job.kind == Kind::AddProvider && !out.timed_out {
        let mut holders = Vec::with_capacity(out.closest.len());
        let mut stored = now;
        for &h in &out.closest {
            out.rpcs += 1;
            let rtt = net.latency.rtt(net.seed, q, h);
            let arrive = now + rtt / 2;
            if net.timelines.online(h, arrive) {
                net.traffic.message(job.phase, q, h, sizes.add_provider);
                holders.push(h);
                stored = stored.max(arrive);
            }
        }
        out.stored = Some(Announcement {
            point: job.target,
            stored,
            provider: q,
            holders,
        });
    }
    out
}

fn hop_of(hops: &[(u32, u8)], node: u32) -> u8 {
    hops.iter().find(|(n, _)| *n == node).map_or(0, |(_, h)| *h)
}

/// Record that `node` heard from `other`, if `other`'s bucket in `node`'s table has room.
fn learn(net: &Net<'_>, learned: &mut Vec<(u32, u32)>, node: u32, other: u32) {
    let j = net.tables.bucket_of(net.ids.id(node), net.ids.id(other));
    if net.tables.has_room(node, j) && !net.tables.bucket(node, j).contains(&other) {
        learned.push((node, other));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::table::buckets_for;

    struct World {
        ids: Ids,
        tables: Tables,
        timelines: Timelines,
        latency: Latency,
        records: Records,
        params: KadParams,
        sizes: MessageSizes,
        traffic: Traffic,
    }

    impl World {
        fn new(n: usize, seed: u64) -> Self {
            let ids = Ids::random(n, seed);
            let tables = Tables::converged(&ids, buckets_for(n), 20, &|_| true, seed);
            Self {
                traffic: Traffic::new(n),
                ids,
                tables,
                timelines: Timelines::always_on(n),
                latency: Latency::default(),
                records: Records::new(),
                params: KadParams::default(),
                sizes: MessageSizes::default(),
            }
        }

        fn net(&self) -> Net<'_> {
            Net {
                ids: &self.ids,
                tables: &self.tables,
                timelines: &self.timelines,
                latency: &self.latency,
                records: &self.records,
                params: &self.params,
                sizes: &self.sizes,
                traffic: &self.traffic,
                seed: 5,
            }
        }
    }

    fn job(kind: Kind, querier: u32, target: u64) -> Job {
        Job {
            kind,
            querier,
            target,
            start: 1_000,
            phase: Phase::Query,
        }
    }

    #[test]
    fn lookups_converge_on_the_true_closest_nodes() {
        let w = World::new(3000, 1);
        let mut exact = 0;
        let mut overlap = 0;
        let trials = 200u64;
        for t in 0..trials {
            let target = kindred_kernels::rng::mix64(t + 1000);
            let q = (t * 13 % 3000) as u32;
            let out = run(&w.net(), &job(Kind::FindNode, q, target));
            let truth = w.ids.closest(target, 21, |i| i != q);
            assert_eq!(
                out.closest.first(),
                truth.first(),
                "the closest node is always found"
            );
            // libp2p stops once the 20 closest peers it *knows* have answered; with k peers per
            // answer it can miss some of the true 20 closest, but not the k closest.
            let k = w.params.replication;
            if out.closest[..k] == truth[..k] {
                exact += 1;
            }
            overlap += out
                .closest
                .iter()
                .filter(|c| truth[..20].contains(c))
                .count();
            assert!(!out.timed_out && out.failed == 0);
            assert!(out.rpcs >= 20 && out.rpcs < 200, "{}", out.rpcs);
            assert!(out.hops >= 1 && out.hops <= 6, "{}", out.hops);
        }
        assert!(
            exact as f64 >= 0.95 * trials as f64,
            "exact top-k in {exact}/{trials}"
        );
        let recall = overlap as f64 / (20 * trials) as f64;
        assert!(recall > 0.9, "top-20 recall {recall}");
    }

    #[test]
    fn announced_providers_are_found() {
        let mut w = World::new(2000, 2);
        let mut stored = Vec::new();
        for p in 0..5u32 {
            let out = run(
                &w.net(),
                &job(Kind::AddProvider, p * 300, 0xABCD_EF01_2345_6789),
            );
            let a = out.stored.unwrap();
            // Stored at the replication-factor closest nodes.
            let k = w.params.replication;
            let truth = w
                .ids
                .closest(0xABCD_EF01_2345_6789, k + 1, |i| i != p * 300);
            assert!(
                a.holders.iter().all(|h| truth.contains(h)),
                "{:?}",
                a.holders
            );
            assert_eq!(a.holders.len(), k);
            stored.push(a);
        }
        w.records.extend(stored);
        for q in [7u32, 1999, 600] {
            let mut j = job(Kind::GetProviders, q, 0xABCD_EF01_2345_6789);
            j.start = 10_000_000; // after the records were stored
            let out = run(&w.net(), &j);
            let mut found = out.providers.clone();
            found.sort_unstable();
            let expect: Vec<u32> = (0..5).map(|p| p * 300).filter(|&p| p != q).collect();
            assert_eq!(found, expect);
            assert!(out.first_provider.is_some() && out.hops >= 1);
        }
        let miss = run(&w.net(), &job(Kind::GetProviders, 5, 42));
        assert!(miss.providers.is_empty() && miss.first_provider.is_none());
    }

    #[test]
    fn departed_nodes_fail_and_refresh_repairs_the_tables() {
        let mut w = World::new(2000, 3);
        // A third of the nodes leave for good at t = 0 (all their routing-table entries stale).
        let alive = |i: u32| !i.is_multiple_of(3);
        w.timelines = Timelines::from_fn(2000, |i| !alive(i));
        let before = (0..60u64)
            .map(|t| {
                let q = (t * 31 % 2000) as u32 | 1;
                let target = kindred_kernels::rng::mix64(t + 77);
                let out = run(&w.net(), &job(Kind::FindNode, q, target));
                // Even with stale tables the lookup ends on live nodes only.
                let truth = w.ids.closest(target, 1, |i| alive(i) && i != q);
                assert_eq!(out.closest.first(), truth.first());
                assert!(out.dead.iter().all(|&d| !alive(d)));
                out.failed
            })
            .sum::<u32>();
        assert!(before > 60, "stale entries cause failures: {before}");
        let mut rng = kindred_kernels::rng::SplitMix64::new(1);
        for n in 0..2000u32 {
            w.tables.refresh(&w.ids, n, &alive, &mut rng);
        }
        let after: u32 = (0..60u64)
            .map(|t| {
                let q = (t * 31 % 2000) as u32 | 1;
                run(
                    &w.net(),
                    &job(Kind::FindNode, q, kindred_kernels::rng::mix64(t + 77)),
                )
                .failed
            })
            .sum();
        assert_eq!(after, 0, "no failures after repair");
    }
}
