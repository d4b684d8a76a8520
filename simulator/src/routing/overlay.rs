//! The routing model as a partner-discovery service for the learning tier.
//!
//! An [`Overlay`] is a static Kademlia network of the learning run's virtual nodes (converged
//! k-buckets, log-normal link latencies). Each round, [`Overlay::round`] runs what every node's
//! routing layer does with its freshly distilled update: announce the band keys of its SimHash
//! (hot bands sharded as `kindred-routing` would shard them), then look up its band keys and its
//! first multi-probe keys (every shard of a hot one, or a few in a refresh, as the routing core
//! does), each a real simulated `ADD_PROVIDER` / `GET_PROVIDERS` lookup. What a node finds is
//! exactly the set of providers those lookups returned, and its DHT traffic is what those lookups
//! sent and received.

use kindred_proto::{ModelId, SIMHASH_BITS, SimHash};
use kindred_routing::keys::{
    KeyConfig, KeyContext, NetworkId, ProbeError, ProbeSequence, RoundWindow, ShardPolicy,
    announce_shard, lookup_shards, shard_key,
};
use rayon::prelude::*;

use super::Micros;
use super::churn::Timelines;
use super::ids::{Ids, key_point};
use super::latency::Latency;
use super::lookup::{self, Job, KadParams, Kind, Net};
use super::records::Records;
use super::table::{Tables, buckets_for};
use super::traffic::{MessageSizes, Phase, Traffic};
use super::workload::Shards;

const SECOND: Micros = 1_000_000;

/// What a node's routing layer does in an overlay round (`kindred_routing::RoundPlan`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Search {
    /// Neither announce nor look up (the node follows peers, or is away).
    #[default]
    Idle,
    /// Announce, and look up every shard of each hot band.
    Full,
    /// Announce, and look up a few shards of each hot band.
    Refresh,
    /// Look up every shard of each hot band, announce nothing (a node that expects to join a
    /// hub: `kindred_routing::is_hub_candidate`).
    Lookup,
}

/// A static overlay of `n` nodes.
#[derive(Debug, Clone)]
pub struct Overlay {
    ids: Ids,
    tables: Tables,
    timelines: Timelines,
    latency: Latency,
    kad: KadParams,
    sizes: MessageSizes,
    keys: KeyConfig,
    shards: ShardPolicy,
    probes: usize,
    /// Shards of a hot band a refresh asks (`kindred_routing::LookupConfig::refresh_shards`).
    refresh_shards: u32,
    /// Use steady-state hot-band shard counts (false: every band on one key, as in a network's
    /// first round window, before any node has seen a hot band).
    sharding: bool,
    network: NetworkId,
    model: ModelId,
    seed: u64,
    /// Rounds per key window (the node's `key_window`): keys, and a rotating layout's bands
    /// ([`KeyConfig::rotating`]), change once per window. Default 1.
    key_window: u64,
}

/// What one round of announcements and lookups found and cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OverlayRound {
    /// Per node, the distinct providers its lookups returned (never itself), in discovery order.
    pub found: Vec<Vec<u32>>,
    /// Per node, DHT bytes it sent plus received this round.
    pub node_bytes: Vec<u64>,
    /// All DHT bytes on the wire this round.
    pub total_bytes: u64,
    /// Of which announcements (`FIND_NODE` walks and `ADD_PROVIDER`).
    pub announce_bytes: u64,
    /// Requests of every announcement (walks and `ADD_PROVIDER`s).
    pub announce_rpcs: u64,
    /// DHT lookups run (announcements and lookups).
    pub lookups: usize,
    /// Mean requests per `GET_PROVIDERS` lookup.
    pub rpcs_mean: f64,
    /// Mean hops per `GET_PROVIDERS` lookup.
    pub hops_mean: f64,
    /// Requests of every `GET_PROVIDERS` lookup, in job order.
    pub provider_rpcs: Vec<u32>,
    /// `GET_PROVIDERS` lookups per node.
    pub key_lookups: Vec<u32>,
}

impl Overlay {
    /// An overlay of `n` nodes with `kindred-routing`'s defaults (16 × 16 bands, 8 probes).
    pub fn new(n: usize, seed: u64, model: ModelId) -> Self {
        let ids = Ids::random(n, seed ^ 0x0E7_1A7);
        let tables = Tables::converged(&ids, buckets_for(n), 20, &|_| true, seed);
        Self {
            ids,
            tables,
            timelines: Timelines::always_on(n),
            latency: Latency::default(),
            kad: KadParams::default(),
            sizes: MessageSizes::default(),
            keys: KeyConfig::default(),
            shards: ShardPolicy::default(),
            probes: kindred_routing::LookupConfig::default().probes,
            refresh_shards: kindred_routing::LookupConfig::default().refresh_shards,
            sharding: true,
            network: NetworkId::from_name("kindred-sim"),
            model,
            seed,
            key_window: 1,
        }
    }

    /// Use `probes` multi-probe keys per lookup.
    pub fn with_probes(mut self, probes: usize) -> Self {
        self.probes = probes;
        self
    }

    /// Ask `shards` shards of each hot band in a refresh (0: all).
    pub fn with_refresh_shards(mut self, shards: u32) -> Self {
        self.refresh_shards = shards;
        self
    }

    /// Whether hot bands are sharded at their steady-state counts (default) or not at all (a
    /// first round window).
    pub fn with_sharding(mut self, sharding: bool) -> Self {
        self.sharding = sharding;
        self
    }

    /// Use the band layout `keys`.
    pub fn with_keys(mut self, keys: KeyConfig) -> Self {
        self.keys = keys;
        self
    }

    /// Rounds per key window (at least 1): the keys of a round are those of its window, as a
    /// node's (`kindred_routing::exchange::ExchangeConfig::key_window`).
    pub fn with_key_window(mut self, rounds: u64) -> Self {
        self.key_window = rounds.max(1);
        self
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether the overlay is empty.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Run round `round`: nodes that search (`searches[i]`) announce `sigs[i]`'s band keys
    /// (unless they only look up), then look up their band keys and the first probes ordered by
    /// `margins[i]`.
    ///
    /// # Errors
    /// [`ProbeError`] when probes are asked for and margins are unusable.
    pub fn round(
        &self,
        round: u64,
        sigs: &[SimHash],
        margins: &[[f32; SIMHASH_BITS]],
        searches: &[Search],
    ) -> Result<OverlayRound, ProbeError> {
        self.round_probing(round, sigs, margins, searches, |_| self.probes)
    }

    /// [`Overlay::round`], with node `i` looking up `probes(i)` multi-probe keys rather than
    /// the overlay's [`Overlay::with_probes`] (the hub exchange's core decides per search).
    ///
    /// # Errors
    /// [`ProbeError`] when probes are asked for and margins are unusable.
    pub fn round_probing(
        &self,
        round: u64,
        sigs: &[SimHash],
        margins: &[[f32; SIMHASH_BITS]],
        searches: &[Search],
        probes: impl Fn(usize) -> usize,
    ) -> Result<OverlayRound, ProbeError> {
        let n = self.ids.len();
        let window = RoundWindow(round / self.key_window.max(1));
        let ctx = KeyContext::new(self.network, self.model, window, self.keys);
        let search = |i: usize| searches.get(i).copied().unwrap_or_default();
        let is_active = |i: usize| search(i) != Search::Idle;
        let announces = |i: usize| matches!(search(i), Search::Full | Search::Refresh);
        let announced: Vec<SimHash> = (0..n)
            .filter(|&i| announces(i))
            .filter_map(|i| sigs.get(i).copied())
            .collect();
        let shards = Shards::from_signatures(
            if self.sharding { &announced } else { &[] },
            ctx.config(),
            self.shards,
            self.kad.replication,
        );
        let traffic = Traffic::new(n);
        let mut records = Records::new();
        let rand = |tag: u64, i: usize, span: Micros| {
            crate::rng::hash_words(self.seed, &[tag, round, i as u64]) % span
        };
        // Announce.
        let mut jobs = Vec::new();
        for i in (0..n).filter(|&i| announces(i)) {
            let sig = sigs.get(i).copied().unwrap_or_default();
            let salt = self.ids.id(i as u32).to_le_bytes();
            let start = rand(1, i, 10 * SECOND);
            for band in 0..self.keys.bands() {
                let value = ctx.config().band_value(&sig, band);
                let base = ctx.band_key(band, value);
                let s = shards.get(band as u16, value);
                let key = shard_key(&base, announce_shard(&salt, &base, s));
                jobs.push(Job {
                    kind: Kind::AddProvider,
                    querier: i as u32,
                    target: key_point(&key),
                    start,
                    phase: Phase::Announce,
                });
            }
        }
        let (stored, announce_rpcs): (Vec<_>, Vec<u32>) = {
            let net = self.net(&records, &traffic);
            jobs.par_iter()
                .map(|j| {
                    let o = lookup::run(&net, j);
                    (o.stored, o.rpcs)
                })
                .unzip()
        };
        let announce_rpcs: u64 = announce_rpcs.into_iter().map(u64::from).sum();
        let stored: Vec<_> = stored.into_iter().flatten().collect();
        let mut lookups = jobs.len();
        records.extend(stored);
        // Look up.
        let mut jobs = Vec::new();
        for i in (0..n).filter(|&i| is_active(i)) {
            let sig = sigs.get(i).copied().unwrap_or_default();
            let salt = self.ids.id(i as u32).to_le_bytes();
            // 0: every shard.
            let limit = match search(i) {
                Search::Refresh => self.refresh_shards,
                _ => 0,
            };
            let start = 30 * SECOND + rand(2, i, 10 * SECOND);
            let mut origins: Vec<(u16, u64)> = (0..self.keys.bands())
                .map(|b| (b as u16, ctx.config().band_value(&sig, b)))
                .collect();
            let take = probes(i);
            if take > 0 {
                let m = margins.get(i).map_or(&[][..], |m| &m[..]);
                let seq = ProbeSequence::new(&sig, m, ctx.config())?;
                origins.extend(seq.take(take).map(|p| (p.band, p.value)));
            }
            for (band, value) in origins {
                let base = ctx.band_key(usize::from(band), value);
                for s in lookup_shards(&salt, &base, shards.get(band, value), limit) {
                    jobs.push(Job {
                        kind: Kind::GetProviders,
                        querier: i as u32,
                        target: key_point(&shard_key(&base, s)),
                        start,
                        phase: Phase::Query,
                    });
                }
            }
        }
        lookups += jobs.len();
        let outcomes: Vec<(u32, Vec<u32>, u32, u8)> = {
            let net = self.net(&records, &traffic);
            jobs.par_iter()
                .map(|j| {
                    let o = lookup::run(&net, j);
                    (j.querier, o.providers, o.rpcs, o.hops)
                })
                .collect()
        };
        let mut found: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut key_lookups = vec![0u32; n];
        let (mut rpcs, mut hops) = (0u64, 0u64);
        for (q, providers, r, h) in &outcomes {
            rpcs += u64::from(*r);
            hops += u64::from(*h);
            if let Some(c) = key_lookups.get_mut(*q as usize) {
                *c += 1;
            }
            if let Some(f) = found.get_mut(*q as usize) {
                for p in providers {
                    if f.len() < self.kad.max_providers && !f.contains(p) {
                        f.push(*p);
                    }
                }
            }
        }
        let per = outcomes.len().max(1) as f64;
        let ord = std::sync::atomic::Ordering::Relaxed;
        Ok(OverlayRound {
            found,
            node_bytes: traffic.per_node(),
            total_bytes: traffic.announce.load(ord) + traffic.query.load(ord),
            announce_bytes: traffic.announce.load(ord),
            announce_rpcs,
            lookups,
            rpcs_mean: rpcs as f64 / per,
            hops_mean: hops as f64 / per,
            provider_rpcs: outcomes.iter().map(|o| o.2).collect(),
            key_lookups,
        })
    }

    fn net<'a>(&'a self, records: &'a Records, traffic: &'a Traffic) -> Net<'a> {
        Net {
            ids: &self.ids,
            tables: &self.tables,
            timelines: &self.timelines,
            latency: &self.latency,
            records,
            params: &self.kad,
            sizes: &self.sizes,
            traffic,
            seed: self.seed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn similar_signatures_find_each_other_and_strangers_do_not() {
        let n = 300;
        let overlay = Overlay::new(n, 4, ModelId([3; 32]));
        // Two groups: nodes 0..150 share a signature up to a few bits, 150..300 another.
        let mut sigs = Vec::new();
        let mut margins = Vec::new();
        for i in 0..n {
            let mut bytes = if i < 150 { [0x55u8; 32] } else { [0xA3u8; 32] };
            bytes[i % 32] ^= 1 << (i % 8); // one differing bit each
            sigs.push(SimHash(bytes));
            margins.push([1.0f32; SIMHASH_BITS]);
        }
        let active = vec![Search::Full; n];
        let r = overlay.round(7, &sigs, &margins, &active).unwrap();
        for i in [0usize, 77, 149] {
            let f = &r.found[i];
            assert!(f.len() >= 100, "node {i} found {}", f.len());
            assert!(f.iter().all(|&p| (p as usize) < 150 && p as usize != i));
        }
        assert!(r.total_bytes > 0 && r.node_bytes.iter().any(|&b| b > 0));
        assert!(r.rpcs_mean >= 2.0);
        // Inactive nodes neither announce nor look up.
        let mut active = vec![Search::Full; n];
        active[3] = Search::Idle;
        let r = overlay.round(8, &sigs, &margins, &active).unwrap();
        assert!(r.found[3].is_empty());
        assert!(r.found[4].iter().all(|&p| p != 3));
        // A node that only looks up still finds its group, and nobody finds it.
        let mut quiet = vec![Search::Full; n];
        quiet[5] = Search::Lookup;
        let q = overlay.round(8, &sigs, &margins, &quiet).unwrap();
        let all = overlay
            .round(8, &sigs, &margins, &vec![Search::Full; n])
            .unwrap();
        assert!(q.found[5].len() >= 100, "node 5 found {}", q.found[5].len());
        assert!(q.found.iter().all(|f| !f.contains(&5)));
        assert!(all.found[0].contains(&5));
        assert!(q.announce_bytes < all.announce_bytes);
        // A refresh asks two shards of each hot band: fewer lookups, fewer bytes, and still
        // only its own group.
        let full = r;
        let refresh = vec![Search::Refresh; n];
        let r = overlay.round(8, &sigs, &margins, &refresh).unwrap();
        assert!(
            r.lookups < full.lookups,
            "{} vs {}",
            r.lookups,
            full.lookups
        );
        assert!(r.total_bytes < full.total_bytes);
        for i in [0usize, 77, 149] {
            assert!(
                r.found[i].len() >= 20,
                "node {i} found {}",
                r.found[i].len()
            );
            assert!(r.found[i].iter().all(|&p| (p as usize) < 150));
        }
    }
}
