//! Test and benchmark support: planted-cluster embeddings, sealed packets, and a harness that
//! runs N real routing nodes in one process.
//!
//! Embeddings come from vectors around a few random unit directions plus Gaussian noise, turned
//! into what `kindred-distill` will hand over: a Gaussian-projection SimHash with per-bit margins
//! and an int8 sketch. Packets are sealed with `kindred_proto::seal` under per-node ed25519
//! identities (the same identities the swarms use), so every header and body on the wire is
//! real and verifiable.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kindred_proto::{
    DType, DenseValues, Embedding, HeaderFields, LayerPayload, LayerSpec, ModelSpec, PacketBody,
    SealedPacket, SimHash, seal,
};
use kindred_routing::{
    KadMode, MemoryStore, NetworkId, PartnerQuery, Partners, RoutingConfig, RoutingHandle,
    TransportKind, spawn,
};
use libp2p::identity::{Keypair, ed25519};
use libp2p::{Multiaddr, PeerId};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Dimension of the planted vectors (and of the int8 sketch).
pub const DIM: usize = 64;

/// Standard normal sample (Box–Muller).
pub fn gauss(rng: &mut impl Rng) -> f32 {
    let u1: f32 = rng.random_range(f32::EPSILON..1.0);
    let u2: f32 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

/// Cluster directions and the SimHash projection.
pub struct Planted {
    pub centers: Vec<Vec<f32>>,
    /// 256 rows of `DIM` Gaussian weights.
    pub projection: Vec<Vec<f32>>,
}

impl Planted {
    pub fn new(rng: &mut impl Rng, clusters: usize) -> Self {
        let centers = (0..clusters)
            .map(|_| {
                let v: Vec<f32> = (0..DIM).map(|_| gauss(rng)).collect();
                let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                v.into_iter().map(|x| x / n).collect()
            })
            .collect();
        let projection = (0..256)
            .map(|_| (0..DIM).map(|_| gauss(rng)).collect())
            .collect();
        Self {
            centers,
            projection,
        }
    }

    /// A vector of `cluster`: its unit direction plus noise of expected norm `noise` (so about
    /// `atan(noise)` away from the direction), as an embedding with its SimHash margins.
    pub fn sample(&self, rng: &mut impl Rng, cluster: usize, noise: f32) -> (Embedding, Vec<f32>) {
        let scale = noise / (DIM as f32).sqrt();
        let x: Vec<f32> = self.centers[cluster]
            .iter()
            .map(|c| c + scale * gauss(rng))
            .collect();
        self.embed(&x)
    }

    /// SimHash, margins and int8 sketch of `x`.
    pub fn embed(&self, x: &[f32]) -> (Embedding, Vec<f32>) {
        let mut simhash = [0u8; 32];
        let mut margins = Vec::with_capacity(256);
        for (j, row) in self.projection.iter().enumerate() {
            let p: f32 = row.iter().zip(x).map(|(a, b)| a * b).sum();
            if p > 0.0 {
                simhash[j / 8] |= 1 << (j % 8);
            }
            margins.push(p.abs());
        }
        let max = x
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()))
            .max(f32::MIN_POSITIVE);
        let sketch_scale = max / 127.0;
        let sketch = x
            .iter()
            .map(|v| (v / sketch_scale).round().clamp(-127.0, 127.0) as i8)
            .collect();
        (
            Embedding {
                simhash: SimHash(simhash),
                sketch,
                sketch_scale,
            },
            margins,
        )
    }
}

/// The tiny model every test node "trains".
pub fn spec() -> ModelSpec {
    ModelSpec::new(vec![
        LayerSpec::new("w", [4, 8], DType::F32),
        LayerSpec::new("b", [4], DType::F32),
    ])
    .unwrap()
}

/// Deterministic identity number `n`.
pub fn identity(n: u64) -> ed25519::Keypair {
    let mut seed = [0u8; 32];
    seed[..8].copy_from_slice(&n.to_le_bytes());
    seed[8] = 0x6b;
    ed25519::Keypair::from(ed25519::SecretKey::try_from_bytes(seed).unwrap())
}

/// A sealed packet of `key` for `round` carrying `embedding`.
pub fn packet(key: &ed25519::Keypair, round: u64, embedding: Embedding, fill: f32) -> SealedPacket {
    let body = PacketBody {
        layers: vec![
            LayerPayload::Dense(DenseValues::F32(vec![fill; 32])),
            LayerPayload::Dense(DenseValues::F32(vec![-fill; 4])),
        ],
    };
    let fields = HeaderFields {
        round,
        unix_ms: 1_700_000_000_000 + round,
        samples: 100,
        loss: 0.5,
        embedding,
    };
    seal(key, &spec(), fields, &body).unwrap()
}

/// Indices of the `k` most similar other embeddings of each embedding (brute force).
pub fn ground_truth(embeddings: &[Embedding], k: usize) -> Vec<Vec<usize>> {
    (0..embeddings.len())
        .map(|i| {
            let mut others: Vec<(usize, f32)> = (0..embeddings.len())
                .filter(|&j| j != i)
                .map(|j| (j, embeddings[i].cosine(&embeddings[j])))
                .collect();
            others.sort_by(|a, b| b.1.total_cmp(&a.1));
            others.into_iter().take(k).map(|(j, _)| j).collect()
        })
        .collect()
}

/// One node of a test swarm.
pub struct TestNode {
    pub handle: RoutingHandle,
    pub store: Arc<MemoryStore>,
    pub packet: SealedPacket,
    pub margins: Vec<f32>,
    pub cluster: usize,
}

/// Node configuration shared by tests and the benchmark.
pub fn node_config(kind: TransportKind) -> RoutingConfig {
    let mut config = RoutingConfig::new(NetworkId::from_name("kindred-test"));
    config.transport.kind = kind;
    config.transport.listen = vec![match kind {
        TransportKind::Tcp => "/ip4/127.0.0.1/tcp/0".parse().unwrap(),
        TransportKind::Memory => "/memory/0".parse().unwrap(),
    }];
    // In-process peers can all reach each other: Kademlia switches to server mode.
    config.transport.listen_addrs_are_external = true;
    config.kad.mode = KadMode::Auto;
    // Tests and the benchmark measure full round lookups: every round searches the DHT and
    // opens its own key window (the benchmark's warm-up rounds re-announce).
    config.core.discovery = kindred_routing::Discovery::EVERY_ROUND;
    config
}

/// How nodes fill their routing tables before the measured round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Join {
    /// The real join path: dial node 0, then a Kademlia bootstrap (16 nodes at a time).
    Bootstrap,
    /// A converged table without the join traffic: each node is given the addresses of its
    /// `closest` XOR-nearest peers and `random` others, as Kademlia tables look after a while.
    /// For swarms too large to bootstrap in one process on a small machine.
    Seeded { closest: usize, random: usize },
}

/// Parameters of a planted-cluster swarm.
pub struct SwarmSpec {
    pub nodes: usize,
    pub clusters: usize,
    pub noise: f32,
    pub seed: u64,
    pub kind: TransportKind,
    /// How routing tables are filled.
    pub join: Join,
    /// Applied to every node's configuration.
    pub configure: Box<dyn Fn(&mut RoutingConfig)>,
}

/// Start `spec.nodes` nodes, each holding one sealed packet of its cluster, connect them all to
/// node 0, and bootstrap every routing table.
pub async fn start_swarm(spec: &SwarmSpec) -> Vec<TestNode> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let planted = Planted::new(&mut rng, spec.clusters);
    let mut nodes = Vec::with_capacity(spec.nodes);
    for i in 0..spec.nodes {
        let key = identity(spec.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
        let cluster = i % spec.clusters;
        let (embedding, margins) = planted.sample(&mut rng, cluster, spec.noise);
        let packet = packet(&key, 1, embedding, i as f32);
        let store = Arc::new(MemoryStore::default());
        store.insert(&packet);
        let mut config = node_config(spec.kind);
        (spec.configure)(&mut config);
        let (handle, _events) = spawn(Keypair::from(key), config, store.clone())
            .await
            .unwrap();
        nodes.push(TestNode {
            handle,
            store,
            packet,
            margins,
            cluster,
        });
    }
    match spec.join {
        Join::Bootstrap => {
            let boot: (PeerId, Multiaddr) = (
                nodes[0].handle.peer_id(),
                nodes[0].handle.listen_addrs()[0].clone(),
            );
            for node in &nodes[1..] {
                node.handle.dial(boot.1.clone()).await.unwrap();
                node.handle.add_peer(boot.0, boot.1.clone()).await;
            }
            // Node 0 knows everyone by now, so one bootstrap round fills every routing table.
            // Nodes join a few at a time, as they would in a real network; a bootstrap that
            // times out still filled the table with what it found.
            for chunk in nodes[1..].chunks(16) {
                let runs = chunk.iter().map(|n| n.handle.bootstrap());
                for r in futures::future::join_all(runs).await {
                    if let Err(e) = r {
                        tracing::warn!("bootstrap: {e}");
                    }
                }
            }
        }
        Join::Seeded { closest, random } => {
            use libp2p::kad::KBucketKey;
            let keys: Vec<KBucketKey<PeerId>> = nodes
                .iter()
                .map(|n| KBucketKey::from(n.handle.peer_id()))
                .collect();
            for (i, node) in nodes.iter().enumerate() {
                let mut by_distance: Vec<usize> = (0..nodes.len()).filter(|&j| j != i).collect();
                by_distance.sort_by_key(|&j| keys[i].distance(&keys[j]));
                let mut chosen: Vec<usize> = by_distance.iter().take(closest).copied().collect();
                let rest = &by_distance[closest.min(by_distance.len())..];
                for _ in 0..random.min(rest.len()) {
                    chosen.push(rest[rng.random_range(0..rest.len())]);
                }
                for j in chosen {
                    let peer = &nodes[j].handle;
                    node.handle
                        .add_peer(peer.peer_id(), peer.listen_addrs()[0].clone())
                        .await;
                }
            }
        }
    }
    nodes
}

/// Give every node a new update for `round`: a fresh sample around its cluster direction
/// (the same directions and projection as [`start_swarm`]), sealed and stored.
pub fn next_round(nodes: &mut [TestNode], spec: &SwarmSpec, round: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let planted = Planted::new(&mut rng, spec.clusters);
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    for (i, node) in nodes.iter_mut().enumerate() {
        let (embedding, margins) = planted.sample(&mut rng, node.cluster, spec.noise);
        let key = identity(spec.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
        node.packet = packet(&key, round, embedding, i as f32);
        node.margins = margins;
        node.store.insert(&node.packet);
    }
}

/// Every node runs its round lookup, unmeasured (`parallel` at a time): a round that lets
/// nodes learn which bands are hot before a measured one.
pub async fn warm_up(nodes: &[TestNode], parallel: usize) {
    let spec = Arc::new(spec());
    for chunk in (0..nodes.len()).collect::<Vec<_>>().chunks(parallel.max(1)) {
        futures::future::join_all(chunk.iter().map(|&i| lookup(nodes, i, &spec))).await;
    }
}

/// Every node announces its packet, 8 nodes at a time (independent machines would not all
/// write to the DHT in the same instant, and in one process they share two cores); returns how
/// many keys failed to publish.
pub async fn announce_all(nodes: &[TestNode]) -> usize {
    let mut failed = 0;
    for chunk in nodes.chunks(8) {
        let runs = chunk
            .iter()
            .map(|n| n.handle.announce(n.packet.header.clone()));
        failed += futures::future::join_all(runs)
            .await
            .into_iter()
            .map(|r| r.unwrap().failed)
            .sum::<usize>();
    }
    failed
}

/// Round lookup of node `i`, timed.
pub async fn lookup(nodes: &[TestNode], i: usize, spec: &Arc<ModelSpec>) -> (Partners, Duration) {
    let n = &nodes[i];
    let query = PartnerQuery::new(n.packet.header.clone(), n.margins.clone(), spec.clone());
    let start = std::time::Instant::now();
    let partners = n.handle.find_partners(query).await.unwrap();
    (partners, start.elapsed())
}

/// Figures of one planted-cluster run.
#[derive(Debug, Clone)]
pub struct Figures {
    pub nodes: usize,
    pub recall_at_5: f64,
    pub requests_per_lookup: Vec<u32>,
    pub lookup_ms: Vec<f64>,
    pub cross_cluster_bodies: usize,
    pub bodies: usize,
    pub key_lookups_per_round: f64,
    pub header_requests_per_round: f64,
}

/// Percentile (nearest rank) of a sorted slice.
pub fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Run every node's round lookup (`parallel` at a time) and score the results against the
/// brute-force truth.
pub async fn measure(nodes: &[TestNode], parallel: usize) -> Figures {
    let spec = Arc::new(spec());
    let embeddings: Vec<Embedding> = nodes
        .iter()
        .map(|n| n.packet.header.header().embedding.clone())
        .collect();
    let truth = ground_truth(&embeddings, 5);
    let peer_index: std::collections::HashMap<PeerId, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.handle.peer_id(), i))
        .collect();
    let mut results = Vec::with_capacity(nodes.len());
    for chunk in (0..nodes.len()).collect::<Vec<_>>().chunks(parallel.max(1)) {
        let runs = chunk.iter().map(|&i| lookup(nodes, i, &spec));
        results.extend(futures::future::join_all(runs).await);
    }
    let mut recall_sum = 0.0;
    let mut requests = Vec::new();
    let mut lookup_ms = Vec::new();
    let mut cross = 0;
    let mut bodies = 0;
    let (mut keys, mut headers) = (0u64, 0u64);
    for (i, (partners, elapsed)) in results.iter().enumerate() {
        let found: Vec<usize> = partners
            .candidates
            .iter()
            .take(5)
            .filter_map(|c| peer_index.get(&c.header.header().sender).copied())
            .collect();
        let hits = truth[i].iter().filter(|t| found.contains(t)).count();
        let all: Vec<usize> = partners
            .candidates
            .iter()
            .filter_map(|c| peer_index.get(&c.header.header().sender).copied())
            .collect();
        let anywhere = truth[i].iter().filter(|t| all.contains(t)).count();
        tracing::debug!(
            node = i,
            hits,
            anywhere,
            candidates = all.len(),
            providers = partners.stats.providers,
            "recall detail"
        );
        recall_sum += hits as f64 / truth[i].len().max(1) as f64;
        for p in &partners.packets {
            bodies += 1;
            let from = peer_index[&p.packet.header.header().sender];
            if nodes[from].cluster != nodes[i].cluster {
                cross += 1;
            }
        }
        requests.extend(partners.stats.kad_requests.iter().copied());
        keys += u64::from(partners.stats.key_lookups);
        headers += u64::from(partners.stats.header_requests);
        lookup_ms.push(elapsed.as_secs_f64() * 1e3);
    }
    requests.sort_unstable();
    lookup_ms.sort_by(f64::total_cmp);
    Figures {
        nodes: nodes.len(),
        recall_at_5: recall_sum / nodes.len() as f64,
        requests_per_lookup: requests,
        lookup_ms,
        cross_cluster_bodies: cross,
        bodies,
        key_lookups_per_round: keys as f64 / nodes.len() as f64,
        header_requests_per_round: headers as f64 / nodes.len() as f64,
    }
}

/// Stop every node.
pub async fn shutdown(nodes: Vec<TestNode>) {
    futures::future::join_all(nodes.iter().map(|n| n.handle.shutdown())).await;
}
