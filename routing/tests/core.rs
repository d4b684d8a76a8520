//! The sans-IO core, driven by hand: requests are delivered between cores as plain values, time
//! is a variable. Covers the whole lookup (keys, providers, headers, ranking, bodies), what a node
//! serves, replay filtering, scoring and bans, deadlines, provider quorum and hot-key sharding.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_proto::rpc::{HeaderQuery, RequestId, RpcErrorCode, RpcRequest, RpcResponse};
use kindred_proto::{PacketId, SealedPacket};
use kindred_routing::keys::{KeyContext, ShardPolicy, shard_key};
use kindred_routing::{
    CoreConfig, MemoryStore, NetworkId, Output, PartnerQuery, Partners, RequestFailure,
    RoundWindow, RoutingCore,
};
use libp2p::PeerId;
use libp2p::identity::{Keypair, ed25519};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use support::*;

/// How a misbehaving peer answers a request with this id.
type Responder = Box<dyn Fn(RequestId) -> Result<RpcResponse, RequestFailure>>;

fn peer_of(key: &ed25519::Keypair) -> PeerId {
    Keypair::from(key.clone()).public().to_peer_id()
}

/// A node of the harness: its core, store, identity and current packet.
struct Node {
    core: RoutingCore,
    store: MemoryStore,
    key: ed25519::Keypair,
    packet: SealedPacket,
    margins: Vec<f32>,
}

impl Node {
    fn peer(&self) -> PeerId {
        peer_of(&self.key)
    }
}

fn config() -> CoreConfig {
    CoreConfig::new(NetworkId::from_name("kindred-test"))
}

/// `n` nodes of one cluster (noise 0.1), round `round`.
fn cluster(n: usize, round: u64, config: &CoreConfig, seed: u64) -> Vec<Node> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let planted = Planted::new(&mut rng, 1);
    (0..n)
        .map(|i| {
            let key = identity(seed * 100 + i as u64);
            let (embedding, margins) = planted.sample(&mut rng, 0, 0.1);
            let packet = packet(&key, round, embedding, i as f32);
            let store = MemoryStore::default();
            store.insert(&packet);
            Node {
                core: RoutingCore::new(peer_of(&key), config.clone()),
                store,
                key,
                packet,
                margins,
            }
        })
        .collect()
}

fn drain(core: &mut RoutingCore) -> Vec<Output> {
    std::iter::from_fn(|| core.poll_output()).collect()
}

/// The keys of the provider lookups `core` has started (draining its outputs).
fn provider_lookups(core: &mut RoutingCore) -> Vec<[u8; 32]> {
    drain(core)
        .into_iter()
        .filter_map(|o| match o {
            Output::GetProviders { key, .. } => Some(key),
            _ => None,
        })
        .collect()
}

/// Announce `node`'s packet, report every key published; returns the keys.
fn announce(node: &mut Node, now: Instant) -> Vec<[u8; 32]> {
    let id = node.core.announce(&node.packet.header, now).unwrap();
    let mut keys = Vec::new();
    // A packet with nothing to publish finishes at once, in the first batch of outputs.
    let mut finished = Vec::new();
    for out in drain(&mut node.core) {
        match out {
            Output::StartProviding { announce, key } => {
                assert_eq!(announce, id);
                keys.push(key);
            }
            Output::AnnounceFinished { .. } => finished.push(out),
            _ => {}
        }
    }
    let requests_before = node.core.metrics().announce_kad_requests;
    for _ in &keys {
        node.core.handle_provide_result(id, true, 16);
    }
    assert_eq!(
        node.core.metrics().announce_kad_requests - requests_before,
        16 * keys.len() as u64
    );
    finished.extend(drain(&mut node.core));
    assert!(matches!(
        finished.as_slice(),
        [Output::AnnounceFinished { announce, report }]
            if *announce == id && report.keys == keys.len() && report.failed == 0
    ));
    keys
}

/// Run `lookup`'s network side: the DHT knows `providers` (peer, keys it announced), and
/// `respond` answers each request as that peer would. Returns the finished lookup and every
/// other output seen (bans, quorum finishes...).
fn run_lookup(
    core: &mut RoutingCore,
    query: PartnerQuery,
    providers: &[(PeerId, Vec<[u8; 32]>)],
    now: Instant,
    mut respond: impl FnMut(PeerId, &RpcRequest) -> Result<RpcResponse, RequestFailure>,
) -> (Partners, Vec<Output>) {
    let lookup = core.start_lookup(query, now).unwrap();
    let mut queue: Vec<Output> = drain(core);
    let mut others = Vec::new();
    let mut guard = 0;
    while let Some(out) = queue.pop() {
        guard += 1;
        assert!(guard < 10_000, "lookup does not converge");
        match out {
            Output::GetProviders { lookup: l, key } => {
                assert_eq!(l, lookup);
                let holders: Vec<PeerId> = providers
                    .iter()
                    .filter(|(_, keys)| keys.contains(&key))
                    .map(|(p, _)| *p)
                    .collect();
                core.handle_providers(lookup, key, holders, now);
                core.handle_key_lookup_done(lookup, key, 4, now);
            }
            Output::SendRequest { peer, request } => {
                let response = respond(peer, &request);
                core.handle_response(peer, request.id(), response, now);
            }
            Output::LookupFinished {
                lookup: l,
                partners,
            } => {
                assert_eq!(l, lookup);
                others.append(&mut queue);
                others.extend(drain(core));
                return (*partners, others);
            }
            other => others.push(other),
        }
        queue.extend(drain(core));
    }
    panic!("lookup never finished");
}

/// Answer as `node` would.
fn serve(node: &mut Node, from: PeerId, request: &RpcRequest, now: Instant) -> RpcResponse {
    node.core.handle_request(from, request, &node.store, now)
}

#[test]
fn a_lookup_finds_ranks_and_fetches_a_similar_peer() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(2, 3, &cfg, 1);
    let keys_b = announce(&mut nodes[1], now);
    let (a, b) = nodes.split_at_mut(1);
    let (a, b) = (&mut a[0], &mut b[0]);
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let (partners, others) = run_lookup(
        &mut a.core,
        query,
        &[(b.peer(), keys_b)],
        now,
        |peer, req| {
            assert_eq!(peer, b.peer());
            Ok(serve(b, peer_of(&a.key), req, now))
        },
    );
    assert!(others.iter().all(|o| !matches!(o, Output::Ban { .. })));
    // Round 3 is past the warm-up, so it belongs to the window that opened at round 2.
    assert_eq!(partners.window, RoundWindow(2));
    assert_eq!(partners.candidates.len(), 1);
    assert_eq!(partners.packets.len(), 1);
    let got = &partners.packets[0];
    assert_eq!(got.packet.id(), b.packet.id());
    assert_eq!(got.body_bytes, b.packet.body_bytes);
    assert!(got.cosine > 0.9, "{}", got.cosine);
    let s = &partners.stats;
    assert_eq!(s.key_lookups, 24);
    assert_eq!(s.kad_requests.len(), 24);
    assert_eq!(
        (s.providers, s.header_requests, s.headers_accepted),
        (1, 1, 1)
    );
    assert_eq!((s.body_requests, s.bodies_accepted), (1, 1));
    assert!(!s.timed_out);

    // Both sides counted the traffic, per kind and per peer.
    let (ma, mb) = (a.core.metrics(), b.core.metrics());
    assert_eq!(ma.headers.requests_sent.messages, 1);
    assert_eq!(mb.headers.requests_received, ma.headers.requests_sent);
    assert_eq!(mb.body.responses_sent, ma.body.responses_received);
    assert!(mb.body.responses_sent.bytes >= b.packet.body_bytes.len() as u64);
    assert_eq!(ma.peers[&b.peer()].bytes_in, mb.peers[&a.peer()].bytes_out);
    assert_eq!(ma.key_lookups, 24);
    assert_eq!(ma.kad_requests, 24 * 4);
}

#[test]
fn a_node_serves_only_what_it_announced_and_bodies_only_by_id() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(2, 1, &cfg, 2);
    let keys = announce(&mut nodes[0], now);
    let asker = nodes[1].peer();
    let b = &mut nodes[0];
    let id = RequestId(5);
    // Unknown keys: nothing.
    let r = serve(
        b,
        asker,
        &RpcRequest::GetHeaders {
            id,
            query: HeaderQuery::Keys(vec![[7; 32]]),
        },
        now,
    );
    assert_eq!(
        r,
        RpcResponse::Headers {
            id,
            headers: vec![]
        }
    );
    // An announced key: the header, once, even when several keys match.
    let r = serve(
        b,
        asker,
        &RpcRequest::GetHeaders {
            id,
            query: HeaderQuery::Keys(keys.clone()),
        },
        now,
    );
    assert_eq!(
        r,
        RpcResponse::Headers {
            id,
            headers: vec![b.packet.header_bytes.clone()]
        }
    );
    // By id.
    let r = serve(
        b,
        asker,
        &RpcRequest::GetHeaders {
            id,
            query: HeaderQuery::Ids(vec![b.packet.id(), PacketId([0; 32])]),
        },
        now,
    );
    assert_eq!(
        r,
        RpcResponse::Headers {
            id,
            headers: vec![b.packet.header_bytes.clone()]
        }
    );
    // Bodies by id only; unknown ids are not found.
    let r = serve(
        b,
        asker,
        &RpcRequest::GetBody {
            id,
            packet: b.packet.id(),
        },
        now,
    );
    assert_eq!(
        r,
        RpcResponse::Body {
            id,
            body: b.packet.body_bytes.clone()
        }
    );
    let r = serve(
        b,
        asker,
        &RpcRequest::GetBody {
            id,
            packet: PacketId([1; 32]),
        },
        now,
    );
    assert_eq!(
        r,
        RpcResponse::Error {
            id,
            code: RpcErrorCode::NotFound
        }
    );
    let m = b.core.metrics();
    assert_eq!(m.headers.requests_received.messages, 3);
    assert_eq!(m.body.requests_received.messages, 2);
    assert_eq!(m.peers[&asker].requests_in, 5);
    // Another node's packet cannot be announced.
    let other = nodes[1].packet.header.clone();
    assert!(nodes[0].core.announce(&other, now).is_err());
}

#[test]
fn hub_exchange_requests_are_refused_until_the_node_serves_them() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(2, 1, &cfg, 2);
    let asker = nodes[1].peer();
    let b = &mut nodes[0];
    let requests = [
        RpcRequest::Push {
            id: RequestId(6),
            round: 1,
            header: b.packet.header_bytes.clone(),
            body: b.packet.body_bytes.clone(),
            known: vec![asker.to_bytes()],
        },
        RpcRequest::GetMerge {
            id: RequestId(7),
            round: 1,
        },
    ];
    for request in &requests {
        assert_eq!(
            serve(b, asker, request, now),
            RpcResponse::Error {
                id: request.id(),
                code: RpcErrorCode::Refused
            }
        );
    }
    let m = b.core.metrics();
    assert_eq!(m.push.requests_received.messages, 1);
    assert_eq!(m.push.responses_sent.messages, 1);
    assert_eq!(m.merge.requests_received.messages, 1);
    assert_eq!(m.merge.responses_sent.messages, 1);
    assert_eq!(m.headers.requests_received.messages, 0);
}

#[test]
fn invalid_responses_are_rejected_scored_and_end_in_a_ban() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(2, 1, &cfg, 3);
    let keys_b = announce(&mut nodes[1], now);
    let b_peer = nodes[1].peer();
    let mut forged = nodes[1].packet.header_bytes.clone();
    let last = forged.len() - 1;
    forged[last] ^= 1;
    let a = &mut nodes[0];
    let offences: Vec<Responder> = vec![
        Box::new(|_| Err(RequestFailure::Protocol("rpc_malformed"))),
        Box::new(|id| {
            Ok(RpcResponse::Headers {
                id: RequestId(id.0 + 1),
                headers: vec![],
            })
        }),
        Box::new(move |id| {
            Ok(RpcResponse::Headers {
                id,
                headers: vec![forged.clone()],
            })
        }),
    ];
    let mut bans = Vec::new();
    for offence in &offences {
        let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
        let providers = [(b_peer, keys_b.clone())];
        let (partners, others) = run_lookup(&mut a.core, query, &providers, now, |_, req| {
            offence(req.id())
        });
        assert!(partners.packets.is_empty());
        bans.extend(
            others
                .into_iter()
                .filter(|o| matches!(o, Output::Ban { .. })),
        );
    }
    let m = a.core.metrics();
    assert_eq!(m.rejects.get("rpc_malformed"), Some(&1));
    assert_eq!(m.rejects.get("id_mismatch"), Some(&1));
    assert_eq!(m.rejects.get("bad_signature"), Some(&1));
    assert!(
        matches!(bans.as_slice(), [Output::Ban { peer, reason: "bad_signature", .. }] if *peer == b_peer)
    );
    assert!(a.core.is_banned(&b_peer, now));
    // A banned peer is neither asked nor served.
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let (partners, _) = run_lookup(&mut a.core, query, &[(b_peer, keys_b)], now, |_, _| {
        panic!("asked a banned peer")
    });
    assert_eq!(partners.stats.providers, 0);
    let r = a.core.handle_request(
        b_peer,
        &RpcRequest::GetBody {
            id: RequestId(1),
            packet: PacketId([0; 32]),
        },
        &a.store,
        now,
    );
    assert!(matches!(
        r,
        RpcResponse::Error {
            code: RpcErrorCode::Refused,
            ..
        }
    ));
    // The ban expires.
    let later = now + Duration::from_secs(601);
    assert!(a.core.poll_timeout().unwrap() <= later);
    a.core.handle_timeout(later);
    assert!(matches!(drain(&mut a.core).as_slice(), [Output::Unban { peer }] if *peer == b_peer));
    assert!(!a.core.is_banned(&b_peer, later));
}

#[test]
fn network_failures_are_counted_but_not_scored() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(2, 1, &cfg, 4);
    let keys_b = announce(&mut nodes[1], now);
    let b_peer = nodes[1].peer();
    let a = &mut nodes[0];
    for _ in 0..5 {
        let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
        let (_, others) = run_lookup(
            &mut a.core,
            query,
            &[(b_peer, keys_b.clone())],
            now,
            |_, _| Err(RequestFailure::Timeout),
        );
        assert!(others.iter().all(|o| !matches!(o, Output::Ban { .. })));
    }
    assert_eq!(a.core.metrics().request_failures.get("timeout"), Some(&5));
    assert_eq!(a.core.scores().score(&b_peer, now), 0.0);
}

#[test]
fn replays_and_mismatched_headers_are_dropped() {
    let now = Instant::now();
    let mut cfg = config();
    cfg.discovery = kindred_routing::Discovery {
        warmup_rounds: 0,
        every_rounds: 10,
        follow: 10,
    }; // rounds 20..29 share a window
    let mut nodes = cluster(2, 25, &cfg, 5);
    let keys_b = announce(&mut nodes[1], now);
    let b_key = nodes[1].key.clone();
    let b_peer = nodes[1].peer();
    let b_embedding = nodes[1].packet.header.header().embedding.clone();
    let current = nodes[1].packet.header_bytes.clone();
    let older = packet(&b_key, 24, b_embedding.clone(), 1.0).header_bytes;
    let conflicting = packet(&b_key, 25, b_embedding.clone(), 2.0).header_bytes;
    let other_window = packet(&b_key, 35, b_embedding.clone(), 3.0).header_bytes;
    let mut unrelated = b_embedding;
    for byte in &mut unrelated.simhash.0 {
        *byte = !*byte;
    }
    let off_key = packet(&b_key, 26, unrelated, 4.0).header_bytes;
    let foreign = nodes[0].packet.header_bytes.clone();

    let a = &mut nodes[0];
    let mut lookup_with = |headers: Vec<Vec<u8>>| {
        let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
        run_lookup(
            &mut a.core,
            query,
            &[(b_peer, keys_b.clone())],
            now,
            |_, req| match req {
                RpcRequest::GetHeaders { id, .. } => Ok(RpcResponse::Headers {
                    id: *id,
                    headers: headers.clone(),
                }),
                other => Ok(RpcResponse::Error {
                    id: other.id(),
                    code: RpcErrorCode::NotFound,
                }),
            },
        )
        .0
    };
    let p = lookup_with(vec![current.clone()]);
    assert_eq!(p.stats.headers_accepted, 1);
    // The same packet again is a harmless duplicate, still ranked from the index.
    let p = lookup_with(vec![current]);
    assert_eq!((p.stats.headers_accepted, p.candidates.len()), (1, 1));
    let p = lookup_with(vec![older, conflicting, other_window, off_key, foreign]);
    assert_eq!((p.stats.headers_accepted, p.stats.headers_rejected), (0, 5));
    let m = a.core.metrics();
    for reason in [
        "stale_round",
        "round_conflict",
        "wrong_window",
        "key_mismatch",
        "foreign_sender",
    ] {
        assert_eq!(m.rejects.get(reason), Some(&1), "{reason}: {:?}", m.rejects);
    }
}

/// Providers as the DHT knows them: each peer with the keys it announced.
type Providers = Vec<(PeerId, Vec<[u8; 32]>)>;

/// Three nodes of one cluster in round 1: B and C announced. Returns them (A first) and the
/// DHT's view of B's and C's keys.
fn a_and_two_providers(now: Instant) -> (Vec<Node>, Providers) {
    let mut nodes = cluster(3, 1, &config(), 6);
    let keys_b = announce(&mut nodes[1], now);
    let keys_c = announce(&mut nodes[2], now);
    let providers = vec![(nodes[1].peer(), keys_b), (nodes[2].peer(), keys_c)];
    (nodes, providers)
}

/// A looks up partners with its own packet's query, changed by `tune`; B and C answer as
/// themselves, each answer passed through `in_transit`.
fn lookup_from_a(
    nodes: &mut [Node],
    providers: &[(PeerId, Vec<[u8; 32]>)],
    now: Instant,
    tune: impl FnOnce(&mut PartnerQuery),
    in_transit: impl Fn(RpcResponse) -> RpcResponse,
) -> Partners {
    let (head, tail) = nodes.split_at_mut(1);
    let a = &mut head[0];
    let a_peer = a.peer();
    let mut query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    tune(&mut query);
    run_lookup(&mut a.core, query, providers, now, |peer, req| {
        let node = tail.iter_mut().find(|n| n.peer() == peer).unwrap();
        Ok(in_transit(serve(node, a_peer, req, now)))
    })
    .0
}

#[test]
fn a_bad_body_is_rejected_and_the_next_candidate_fetched() {
    let now = Instant::now();
    let (mut nodes, providers) = a_and_two_providers(now);
    let partners = lookup_from_a(
        &mut nodes,
        &providers,
        now,
        |q| q.top_m = Some(1),
        |response| match response {
            // Every body is corrupted in transit: one byte flipped.
            RpcResponse::Body { id, mut body } => {
                body[0] ^= 0x80;
                RpcResponse::Body { id, body }
            }
            other => other,
        },
    );
    assert!(partners.packets.is_empty());
    assert_eq!(
        partners.stats.body_requests, 2,
        "falls back to the second candidate"
    );
    assert_eq!(partners.stats.bodies_rejected, 2);
    assert_eq!(
        nodes[0].core.metrics().rejects.get("body_hash_mismatch"),
        Some(&2)
    );
}

#[test]
fn providers_whose_headers_could_not_be_read_are_counted() {
    let now = Instant::now();
    let (mut nodes, providers) = a_and_two_providers(now);
    let c_peer = providers[1].0;
    // C does not answer (behind NAT, its hole punch failed); B does.
    let (head, tail) = nodes.split_at_mut(1);
    let a = &mut head[0];
    let a_peer = a.peer();
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let (partners, _) = run_lookup(&mut a.core, query, &providers, now, |peer, req| {
        if peer == c_peer {
            return Err(RequestFailure::Timeout);
        }
        let node = tail.iter_mut().find(|n| n.peer() == peer).unwrap();
        Ok(serve(node, a_peer, req, now))
    });
    assert_eq!(partners.candidates.len(), 1, "B's header was read");
    assert_eq!(partners.stats.providers_unread, 1, "C's was not");

    // A header request still waiting at the lookup's deadline is unread too.
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let id = a.core.start_lookup(query, now).unwrap();
    for out in drain(&mut a.core) {
        if let Output::GetProviders { key, .. } = out {
            a.core.handle_providers(id, key, [c_peer], now);
            a.core.handle_key_lookup_done(id, key, 4, now);
        }
    }
    let asked = drain(&mut a.core);
    assert!(
        asked
            .iter()
            .any(|o| matches!(o, Output::SendRequest { peer, .. } if *peer == c_peer)),
        "{asked:?}"
    );
    let deadline = a.core.poll_timeout().unwrap();
    a.core.handle_timeout(deadline);
    let out = drain(&mut a.core);
    let [Output::LookupFinished { partners, .. }] = out.as_slice() else {
        panic!("{out:?}");
    };
    assert!(partners.stats.timed_out);
    assert_eq!(partners.stats.providers_unread, 1);
}

#[test]
fn candidates_far_below_the_best_are_ranked_but_not_fetched() {
    let now = Instant::now();
    let (mut nodes, providers) = a_and_two_providers(now);
    let mut lookup = |max_distance_ratio: f32| {
        let gate = kindred_routing::CosineGate {
            min: 0.0,
            max_distance_ratio,
        };
        lookup_from_a(&mut nodes, &providers, now, |q| q.gate = Some(gate), |r| r)
    };
    let wide = lookup(1000.0);
    assert_eq!(wide.candidates.len(), 2);
    assert_eq!(wide.packets.len(), 2);
    let (best, second) = (wide.candidates[0].cosine, wide.candidates[1].cosine);
    assert!(best > second, "{best} vs {second}");
    // A ratio between the two candidates' distances: both ranked, only the best fetched.
    let nearest = (1.0 - best).max(kindred_routing::CosineGate::MIN_DISTANCE);
    let narrow = lookup(((1.0 - best) + (1.0 - second)) / 2.0 / nearest);
    assert_eq!(narrow.candidates.len(), 2);
    assert_eq!(narrow.stats.body_requests, 1);
    assert_eq!(narrow.packets.len(), 1);
    assert_eq!(
        narrow.packets[0].packet.header.id(),
        wide.candidates[0].header.id()
    );
}

#[test]
fn a_lookup_past_its_deadline_returns_what_it_has() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(1, 1, &cfg, 7);
    let a = &mut nodes[0];
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let id = a.core.start_lookup(query, now).unwrap();
    let outputs = drain(&mut a.core);
    assert_eq!(outputs.len(), 24);
    let deadline = a.core.poll_timeout().unwrap();
    assert_eq!(deadline, now + cfg.lookup.timeout);
    a.core.handle_timeout(deadline - Duration::from_millis(1));
    assert!(drain(&mut a.core).is_empty());
    a.core.handle_timeout(deadline);
    let out = drain(&mut a.core);
    let [Output::LookupFinished { lookup, partners }] = out.as_slice() else {
        panic!("{out:?}");
    };
    assert_eq!(*lookup, id);
    assert!(partners.stats.timed_out);
    assert_eq!(a.core.metrics().lookups_timed_out, 1);
    // Late DHT results are ignored.
    a.core.handle_key_lookup_done(id, [0; 32], 3, deadline);
    assert!(drain(&mut a.core).is_empty());
}

#[test]
fn provider_lookups_end_at_the_quorum() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(3, 1, &cfg, 8);
    let (b, c) = (nodes[1].peer(), nodes[2].peer());
    let a = &mut nodes[0];
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let id = a.core.start_lookup(query, now).unwrap();
    let Some(Output::GetProviders { key, .. }) = drain(&mut a.core).into_iter().next() else {
        panic!("no key lookup");
    };
    let own = a.peer();
    // Empty answers and answers naming only ourselves do not count.
    a.core.handle_providers(id, key, [], now);
    a.core.handle_providers(id, key, [own], now);
    a.core.handle_providers(id, key, [b], now);
    assert!(
        drain(&mut a.core)
            .iter()
            .all(|o| !matches!(o, Output::FinishProviderLookup { .. }))
    );
    a.core.handle_providers(id, key, [b, c], now);
    let out = drain(&mut a.core);
    assert!(
        out.iter()
            .any(|o| matches!(o, Output::FinishProviderLookup { key: k, .. } if *k == key))
    );
}

/// In a swarm whose routing table is whole (fewer peers than one DHT answer lists), a key
/// nobody announced costs `empty_quorum` answers, not Kademlia's full termination; in a larger
/// swarm, or once an answer carried a record, the empty answers end nothing.
#[test]
fn lookups_of_empty_keys_end_early_only_in_a_whole_table() {
    let now = Instant::now();
    let cfg = config();
    assert_eq!(cfg.lookup.empty_quorum, 2);
    let mut nodes = cluster(2, 1, &cfg, 8);
    let b = nodes[1].peer();
    let a = &mut nodes[0];
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let id = a.core.start_lookup(query, now).unwrap();
    let keys = provider_lookups(&mut a.core);
    assert!(keys.len() >= 3, "{keys:?}");
    let finished = |out: &[Output], key| {
        out.iter()
            .filter(|o| matches!(o, Output::FinishProviderLookup { key: k, .. } if *k == key))
            .count()
    };
    // A whole table: the first answer does not end the walk, the second does, once.
    let whole = keys[0];
    a.core.handle_providers(id, whole, [], now);
    a.core.handle_walk_progress(id, whole, 1, true);
    assert_eq!(finished(&drain(&mut a.core), whole), 0);
    for answered in 2..5 {
        a.core.handle_providers(id, whole, [], now);
        a.core.handle_walk_progress(id, whole, answered, true);
    }
    assert_eq!(finished(&drain(&mut a.core), whole), 1);
    // A larger swarm: the walk runs to Kademlia's termination.
    let large = keys[1];
    for answered in 1..10 {
        a.core.handle_providers(id, large, [], now);
        a.core.handle_walk_progress(id, large, answered, false);
    }
    assert_eq!(finished(&drain(&mut a.core), large), 0);
    // A key with a record: the provider quorum decides, not the empty answers.
    let held = keys[2];
    a.core.handle_providers(id, held, [b], now);
    a.core.handle_walk_progress(id, held, 1, true);
    a.core.handle_providers(id, held, [], now);
    a.core.handle_walk_progress(id, held, 2, true);
    assert_eq!(finished(&drain(&mut a.core), held), 0);
}

/// The driver notes a provider's addresses on `ProviderFound` and dials it with them when its
/// header request goes out: so each new provider is reported once, before its request, never
/// the node itself, and no more than the lookup's provider cap.
#[test]
fn each_new_provider_is_reported_once_before_its_header_request() {
    let now = Instant::now();
    let mut cfg = config();
    cfg.lookup.max_providers = 2;
    let mut nodes = cluster(4, 1, &cfg, 9);
    let (b, c, d) = (nodes[1].peer(), nodes[2].peer(), nodes[3].peer());
    let a = &mut nodes[0];
    let own = a.peer();
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let id = a.core.start_lookup(query, now).unwrap();
    let keys = provider_lookups(&mut a.core);
    assert!(keys.len() >= 2);
    a.core.handle_providers(id, keys[0], [own, b, b, c, d], now);
    a.core.handle_providers(id, keys[1], [c, b], now);
    let out = drain(&mut a.core);
    let found: Vec<PeerId> = out
        .iter()
        .filter_map(|o| match o {
            Output::ProviderFound { peer, .. } => Some(*peer),
            _ => None,
        })
        .collect();
    assert_eq!(
        found,
        vec![b, c],
        "once each, in arrival order, up to the cap of 2"
    );
    let position = |want: &dyn Fn(&Output) -> bool| out.iter().position(want);
    for p in [b, c] {
        let reported = position(&|o| matches!(o, Output::ProviderFound { peer, .. } if *peer == p));
        let asked = position(&|o| matches!(o, Output::SendRequest { peer, .. } if *peer == p));
        assert!(
            reported.is_some() && asked.is_some() && reported < asked,
            "{p}: reported at {reported:?}, asked at {asked:?}"
        );
    }
}

/// Bands with 3 providers are hot (up to 4 shards); no multi-probe keys.
fn sharding_config() -> CoreConfig {
    let mut cfg = config();
    cfg.shards = ShardPolicy {
        threshold: 3,
        max_shards: 4,
    };
    cfg.lookup.probes = 0;
    cfg
}

#[test]
fn hot_bands_are_sharded_in_the_next_window() {
    let now = Instant::now();
    let cfg = sharding_config();
    let mut nodes = cluster(1, 1, &cfg, 9);
    let crowd: Vec<PeerId> = (0..3).map(|i| peer_of(&identity(7000 + i))).collect();
    let a = &mut nodes[0];
    let h = a.packet.header.header().clone();
    let ctx = KeyContext::new(cfg.network, h.model, RoundWindow(1), cfg.keys);
    let hot_key = ctx.band_key(0, cfg.keys.band_value(&h.embedding.simhash, 0));
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let providers = [
        (crowd[0], vec![hot_key]),
        (crowd[1], vec![hot_key]),
        (crowd[2], vec![hot_key]),
    ];
    let (partners, _) = run_lookup(&mut a.core, query, &providers, now, |_, req| {
        Ok(RpcResponse::Headers {
            id: req.id(),
            headers: vec![],
        })
    });
    assert_eq!(partners.stats.key_lookups, 16);

    // Next round: band 0 is looked up under both of its shards.
    let next = packet(&a.key, 2, h.embedding.clone(), 0.0);
    let ctx2 = KeyContext::new(cfg.network, h.model, RoundWindow(2), cfg.keys);
    let base = ctx2.band_key(0, cfg.keys.band_value(&h.embedding.simhash, 0));
    let query = PartnerQuery::new(next.header.clone(), a.margins.clone(), Arc::new(spec()));
    a.core.start_lookup(query, now).unwrap();
    let keys = provider_lookups(&mut a.core);
    assert_eq!(keys.len(), 17);
    assert!(keys.contains(&base) && keys.contains(&shard_key(&base, 1)));
    // And the node announces band 0 under one of them.
    a.packet = next;
    let announced = announce(a, now);
    assert!(announced.contains(&base) || announced.contains(&shard_key(&base, 1)));
}

#[test]
fn a_refresh_lookup_asks_a_few_shards_of_a_hot_band_and_keeps_its_count() {
    let now = Instant::now();
    let mut cfg = sharding_config();
    cfg.lookup.refresh_shards = 1;
    let mut nodes = cluster(1, 1, &cfg, 11);
    let crowd: Vec<PeerId> = (0..3).map(|i| peer_of(&identity(7100 + i))).collect();
    let a = &mut nodes[0];
    let h = a.packet.header.header().clone();
    let band_key = |window: u64| {
        KeyContext::new(cfg.network, h.model, RoundWindow(window), cfg.keys)
            .band_key(0, cfg.keys.band_value(&h.embedding.simhash, 0))
    };
    let ok = |_, req: &RpcRequest| {
        Ok(RpcResponse::Headers {
            id: req.id(),
            headers: vec![],
        })
    };
    // Window 1: three providers under band 0 make it hot, split two ways.
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let providers: Vec<_> = crowd.iter().map(|&p| (p, vec![band_key(1)])).collect();
    let (partners, _) = run_lookup(&mut a.core, query, &providers, now, ok);
    assert_eq!(partners.stats.key_lookups, 16);

    // Window 2, a refresh: one of the two shards is asked; its three providers stand for six.
    let p2 = packet(&a.key, 2, h.embedding.clone(), 0.0);
    let base = band_key(2);
    let both = vec![base, shard_key(&base, 1)];
    let providers: Vec<_> = crowd.iter().map(|&p| (p, both.clone())).collect();
    let query = PartnerQuery::new(p2.header.clone(), a.margins.clone(), Arc::new(spec()));
    let (partners, _) = run_lookup(&mut a.core, query.refreshing(), &providers, now, ok);
    assert_eq!(partners.stats.key_lookups, 16);
    assert_eq!(partners.stats.providers, 3);

    // Window 10 (the next discovery round), a full lookup: band 0 now has four shards, and
    // every one is asked.
    let p3 = packet(&a.key, 10, h.embedding.clone(), 0.0);
    let base = band_key(10);
    let query = PartnerQuery::new(p3.header.clone(), a.margins.clone(), Arc::new(spec()));
    a.core.start_lookup(query, now).unwrap();
    let keys = provider_lookups(&mut a.core);
    assert_eq!(keys.len(), 19);
    assert!((0..4).all(|s| keys.contains(&shard_key(&base, s))));
}

#[test]
fn the_index_ranks_by_cosine_and_evicts_whole_windows() {
    use kindred_routing::index::{IndexError, SemanticIndex};
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    let planted = Planted::new(&mut rng, 2);
    let mut index = SemanticIndex::new(2, 100);
    let mut sealed = Vec::new();
    for i in 0..40u64 {
        let (embedding, _) = planted.sample(&mut rng, (i % 2) as usize, 0.3);
        let p = packet(&identity(5000 + i), 7, embedding, 0.0);
        index
            .insert(RoundWindow(7), p.header.clone(), p.header_bytes.clone())
            .unwrap();
        sealed.push(p);
    }
    // Re-inserting is a no-op.
    index
        .insert(RoundWindow(7), sealed[0].header.clone(), vec![])
        .unwrap();
    assert_eq!(index.len(), 40);
    // The nearest neighbours of a cluster-0 vector are the cluster-0 packets, best first, and
    // agree with brute force.
    let query = &sealed[0].header.header().embedding;
    let found = index.nearest(RoundWindow(7), &query.sketch, 10);
    assert_eq!(found.len(), 10);
    let mut brute: Vec<(PacketId, f32)> = sealed
        .iter()
        .map(|p| (p.id(), query.cosine(&p.header.header().embedding)))
        .collect();
    brute.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (i, (entry, cosine)) in found.iter().enumerate() {
        assert_eq!(entry.header.id(), brute[i].0);
        assert!((cosine - brute[i].1).abs() < 1e-6);
    }
    assert!(found.windows(2).all(|w| w[0].1 >= w[1].1));
    // Other windows and other sketch lengths are separate.
    assert!(index.nearest(RoundWindow(8), &query.sketch, 5).is_empty());
    assert!(
        index
            .nearest(RoundWindow(7), &query.sketch[..10], 5)
            .is_empty()
    );
    // A zero sketch has no direction.
    let mut zero = query.clone();
    zero.sketch = vec![0; 64];
    let p = packet(&identity(6000), 7, zero, 0.0);
    assert_eq!(
        index.insert(RoundWindow(7), p.header, p.header_bytes),
        Err(IndexError::ZeroSketch)
    );
    // Retaining 2 windows: advancing to window 8 keeps window 7, window 9 drops it.
    assert_eq!(index.advance(RoundWindow(8)), 0);
    assert_eq!(index.len(), 40);
    assert_eq!(index.advance(RoundWindow(9)), 40);
    assert!(index.is_empty());
    assert!(index.get(&sealed[0].id()).is_none());
    let p = &sealed[1];
    assert_eq!(
        index.insert(RoundWindow(7), p.header.clone(), vec![]),
        Err(IndexError::Evicted(RoundWindow(7)))
    );
    // Capacity per window.
    let mut small = SemanticIndex::new(1, 3);
    for p in &sealed[..3] {
        small
            .insert(RoundWindow(0), p.header.clone(), vec![])
            .unwrap();
    }
    assert_eq!(
        small.insert(RoundWindow(0), sealed[3].header.clone(), vec![]),
        Err(IndexError::Full(3))
    );
}

#[test]
fn between_discovery_rounds_a_node_follows_its_partners_without_the_dht() {
    let now = Instant::now();
    let cfg = config();
    // Round 2 is the last warm-up discovery round; rounds 3..9 share its window.
    let mut nodes = cluster(3, 2, &cfg, 11);
    let keys_b = announce(&mut nodes[1], now);
    let keys_c = announce(&mut nodes[2], now);
    let (b_peer, c_peer) = (nodes[1].peer(), nodes[2].peer());
    let (first, rest) = nodes.split_at_mut(1);
    let a = &mut first[0];
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
    let (found, _) = run_lookup(
        &mut a.core,
        query,
        &[(b_peer, keys_b.clone()), (c_peer, keys_c)],
        now,
        |peer, req| {
            let node = rest.iter_mut().find(|n| n.peer() == peer).unwrap();
            Ok(serve(node, peer_of(&a.key), req, now))
        },
    );
    assert_eq!(found.window, RoundWindow(2));
    let discovery = kindred_routing::Discovery::default();
    let follow = discovery.next_follow(
        found
            .candidates
            .iter()
            .map(|c| (c.header.header().sender, c.cosine)),
        kindred_routing::CosineGate {
            min: 0.0,
            max_distance_ratio: 1000.0,
        },
    );
    assert_eq!(follow.len(), 2);
    assert!(!discovery.searches(3, 3, follow.len()));

    // Round 3: B seals a new packet. Its window was announced already: no DHT record.
    let b = &mut rest[0];
    let embedding = b.packet.header.header().embedding.clone();
    b.packet = packet(&b.key, 3, embedding, 7.0);
    b.store.insert(&b.packet);
    b.core.announce(&b.packet.header, now).unwrap();
    let outs = drain(&mut b.core);
    assert!(
        matches!(outs.as_slice(), [Output::AnnounceFinished { report, .. }] if report.keys == 0),
        "{outs:?}"
    );
    // Keys B still carries now serve its round-3 packet.
    let by_key = RpcRequest::GetHeaders {
        id: RequestId(1),
        query: HeaderQuery::Keys(keys_b.clone()),
    };
    let RpcResponse::Headers { headers, .. } = serve(b, peer_of(&a.key), &by_key, now) else {
        panic!("headers expected");
    };
    assert_eq!(headers, vec![b.packet.header_bytes.clone()]);

    // A, at round 3, follows B and C: no provider lookup, one `Latest` request each.
    a.packet = packet(&a.key, 3, a.packet.header.header().embedding.clone(), 0.5);
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()))
        .following(follow.clone());
    let mut asked = Vec::new();
    let (partners, others) = run_lookup(&mut a.core, query, &[], now, |peer, req| {
        if let RpcRequest::GetHeaders { query, .. } = req {
            assert_eq!(query, &HeaderQuery::Latest);
            asked.push(peer);
        }
        let node = rest.iter_mut().find(|n| n.peer() == peer).unwrap();
        Ok(serve(node, peer_of(&a.key), req, now))
    });
    assert!(!others.iter().any(|o| matches!(
        o,
        Output::GetProviders { .. } | Output::ProviderFound { .. } | Output::Ban { .. }
    )));
    asked.sort();
    let mut want = vec![b_peer, c_peer];
    want.sort();
    assert_eq!(asked, want);
    assert_eq!(partners.stats.key_lookups, 0);
    assert_eq!(partners.window, RoundWindow(2));
    // B's round-3 packet is the one candidate: C's newest is still its round-2 packet, which A
    // may already have merged.
    assert_eq!(partners.candidates.len(), 1);
    assert_eq!(partners.packets.len(), 1);
    let b_got = &partners.packets[0];
    assert_eq!(b_got.packet.header.header().round, 3);
    assert_eq!(b_got.packet.id(), rest[0].packet.id());
}

#[test]
fn a_followed_peer_cannot_answer_for_someone_else() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(3, 5, &cfg, 12);
    let (b_peer, c_header) = (nodes[1].peer(), nodes[2].packet.header_bytes.clone());
    let a = &mut nodes[0];
    let query = PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()))
        .following(vec![b_peer, a.core.local_peer()]);
    let mut requests = 0;
    let (partners, _) = run_lookup(&mut a.core, query, &[], now, |peer, req| {
        requests += 1;
        assert_eq!(peer, b_peer, "the node never asks itself");
        // B answers with C's (validly signed) header.
        Ok(RpcResponse::Headers {
            id: req.id(),
            headers: vec![c_header.clone()],
        })
    });
    assert_eq!(requests, 1);
    assert!(partners.candidates.is_empty());
    assert_eq!(a.core.metrics().rejects.get("foreign_sender"), Some(&1));
}

#[test]
fn a_later_packet_of_a_window_publishes_new_keys_only_during_warm_up() {
    let now = Instant::now();
    let cfg = config();
    // Rounds 1,000,001..=1,000,009 share the window that opened at round 1,000,000.
    let mut nodes = cluster(1, 1_000_001, &cfg, 13);
    let node = &mut nodes[0];
    let first = announce(node, now);
    assert_eq!(first.len(), 16);
    let mut flipped = node.packet.header.header().embedding.clone();
    let mut published = Vec::new();
    for (i, round) in (1_000_002..1_000_006).enumerate() {
        // A different signature each round: every band value changes.
        for byte in &mut flipped.simhash.0 {
            *byte = byte.wrapping_add(0x55);
        }
        node.packet = packet(&node.key, round, flipped.clone(), i as f32);
        node.store.insert(&node.packet);
        let keys = announce(node, now);
        assert!(keys.iter().all(|k| !first.contains(k)));
        published.push(keys.len());
        // Whatever was published, the newest packet is what followers get.
        let latest = RpcRequest::GetHeaders {
            id: RequestId(9),
            query: HeaderQuery::Latest,
        };
        let RpcResponse::Headers { headers, .. } = serve(node, peer_of(&node.key), &latest, now)
        else {
            panic!("headers expected");
        };
        assert_eq!(headers, vec![node.packet.header_bytes.clone()]);
    }
    // The first three announcements are the warm-up: the 2nd and 3rd publish their new keys;
    // after it, a window is published once.
    assert_eq!(published, vec![16, 16, 0, 0]);
}

#[test]
fn a_node_whose_addresses_changed_publishes_its_keys_again_in_the_window() {
    let now = Instant::now();
    let cfg = config();
    let mut nodes = cluster(1, 1_000_001, &cfg, 13);
    let node = &mut nodes[0];
    let embedding = node.packet.header.header().embedding.clone();
    let next = |node: &mut Node, round: u64| {
        node.packet = packet(&node.key, round, embedding.clone(), 0.5);
        node.store.insert(&node.packet);
        announce(node, now)
    };
    let first = announce(node, now);
    assert_eq!(first.len(), 16);
    // The same keys again, in the warm-up: nothing new to publish.
    assert!(next(node, 1_000_002).is_empty());
    // A relay reservation gave the node an address its records lack: every key again, once.
    node.core.addresses_changed();
    let again = next(node, 1_000_003);
    assert_eq!(again, first);
    assert!(next(node, 1_000_004).is_empty());
}

#[test]
fn a_search_that_only_meets_peers_ranks_their_earlier_headers_of_the_window() {
    let now = Instant::now();
    let cfg = config();
    // Rounds 1,000,001..=1,000,009 share the window that opened at round 1,000,000: B
    // announced in round 1,000,001, A looks up in round 1,000,003.
    let mut nodes = cluster(2, 1_000_001, &cfg, 17);
    let keys_b = announce(&mut nodes[1], now);
    let (a, b) = nodes.split_at_mut(1);
    let (a, b) = (&mut a[0], &mut b[0]);
    let embedding = a.packet.header.header().embedding.clone();
    a.packet = packet(&a.key, 1_000_003, embedding, 0.5);
    a.store.insert(&a.packet);
    let lookup = |a: &mut Node, b: &mut Node, top_m: usize| {
        let mut query =
            PartnerQuery::new(a.packet.header.clone(), a.margins.clone(), Arc::new(spec()));
        query.top_m = Some(top_m);
        let a_peer = peer_of(&a.key);
        run_lookup(
            &mut a.core,
            query,
            &[(b.peer(), keys_b.clone())],
            now,
            |_, req| Ok(serve(b, a_peer, req, now)),
        )
        .0
    };
    // Partners to merge must be this round's: B's packet of two rounds ago is no candidate.
    let merging = lookup(a, b, 2);
    assert_eq!(merging.stats.headers_accepted, 1);
    assert!(merging.candidates.is_empty());
    assert!(merging.packets.is_empty());
    // A search that fetches no body (the hub exchange's) meets B through it, once: B's header
    // is its newest of the window (already indexed, so not accepted again).
    let meeting = lookup(a, b, 0);
    assert_eq!(meeting.candidates.len(), 1);
    assert_eq!(meeting.candidates[0].header.id(), b.packet.id());
    assert!(meeting.packets.is_empty());
}

/// A merge fetch's answer: the hub's signed merge, with no embedding in its header, and the hub's
/// sketch cosine with the member's push, which the reply hands on; a merge of another round is a
/// replay.
#[test]
fn a_merge_reply_carries_the_hubs_cosine_and_lineage_and_a_merge_of_another_round_is_refused() {
    use kindred_proto::rpc::SketchCosine;
    use kindred_proto::{DenseValues, Embedding, HeaderFields, LayerPayload, PacketBody};
    use kindred_routing::{ExchangeCall, ExchangeError, ExchangeReply};

    let now = Instant::now();
    let hub_key = identity(41);
    let hub = peer_of(&hub_key);
    let mut member = RoutingCore::new(peer_of(&identity(42)), config());
    let body = PacketBody {
        layers: vec![
            LayerPayload::Dense(DenseValues::F32(vec![0.25; 32])),
            LayerPayload::Dense(DenseValues::F32(vec![-0.25; 4])),
        ],
    };
    let merge_of = |round| {
        let fields = HeaderFields {
            round,
            unix_ms: 1_700_000_000_000,
            samples: 300,
            loss: 0.4,
            embedding: Embedding::default(),
        };
        kindred_proto::seal_merge(&hub_key, &spec(), fields, &body).unwrap()
    };
    let mut fetch = |round: u64, merge: &SealedPacket| {
        let call = member.exchange_call(
            hub,
            ExchangeCall::GetMerge {
                round,
                spec: Arc::new(spec()),
            },
            now,
        );
        let request = drain(&mut member)
            .into_iter()
            .find_map(|o| match o {
                Output::SendRequest { request, .. } => Some(request),
                _ => None,
            })
            .unwrap();
        let response = RpcResponse::Merge {
            id: request.id(),
            header: merge.header_bytes.clone(),
            body: merge.body_bytes.clone(),
            cosine: SketchCosine::from_f32(0.9731),
            lineage: 0xFEED_0000_0000_0001,
            listed: vec![],
        };
        member.handle_response(hub, request.id(), Ok(response), now);
        drain(&mut member)
            .into_iter()
            .find_map(|o| match o {
                Output::ExchangeDone { call: c, result } if c == call => Some(result),
                _ => None,
            })
            .unwrap()
    };
    let merge = merge_of(7);
    match fetch(7, &merge) {
        Ok(ExchangeReply::Merge {
            cosine,
            lineage,
            merge: m,
            ..
        }) => {
            assert!((cosine - 0.9731).abs() < 1e-6, "{cosine}");
            assert_eq!(lineage, 0xFEED_0000_0000_0001);
            assert!(m.header.header().embedding.sketch.is_empty());
            assert_eq!(m.header.header().round, 7);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        fetch(8, &merge),
        Err(ExchangeError::Invalid("replayed_merge"))
    ));
}

/// A merge over the hub's inline limit leaves as its header and comes in pieces: the member
/// asks for each piece, a piece that does not come is asked for again from where the body
/// stopped, and the whole merge is verified as an inline one is. A body changed in one byte
/// under the honest header is refused once whole; pieces go only to the member answered.
#[test]
fn a_large_merge_comes_in_pieces_resumes_and_a_tampered_one_is_refused() {
    use kindred_proto::rpc::SketchCosine;
    use kindred_proto::{DenseValues, Embedding, HeaderFields, LayerPayload, PacketBody};
    use kindred_routing::{ExchangeCall, ExchangeError, ExchangeReply, MemoryStore};

    let now = Instant::now();
    let (hub_key, member_key) = (identity(51), identity(52));
    let (hub, member_id) = (peer_of(&hub_key), peer_of(&member_key));
    let mut cfg = config();
    cfg.inline_body_bytes = 64;
    cfg.chunk_bytes = 40;
    let mut member = RoutingCore::new(member_id, cfg.clone());
    let mut hub_core = RoutingCore::new(hub, cfg.clone());
    let store = MemoryStore::default();
    let body = PacketBody {
        layers: vec![
            LayerPayload::Dense(DenseValues::F32((0..32).map(|i| i as f32 / 8.0).collect())),
            LayerPayload::Dense(DenseValues::F32(vec![-0.25; 4])),
        ],
    };
    let fields = HeaderFields {
        round: 9,
        unix_ms: 1_700_000_000_000,
        samples: 300,
        loss: 0.4,
        embedding: Embedding::default(),
    };
    let merge = kindred_proto::seal_merge(&hub_key, &spec(), fields, &body).unwrap();
    assert!(merge.body_bytes.len() > 100, "{}", merge.body_bytes.len());
    // One fetch; `meddle(n, response)` sees the hub's answer to the member's `n`th piece
    // request and may change or drop it. Returns the result and the offsets asked for.
    let fetch = |member: &mut RoutingCore,
                 hub_core: &mut RoutingCore,
                 body: &[u8],
                 meddle: &mut dyn FnMut(usize, RpcResponse) -> Result<_, _>| {
        let call = member.exchange_call(
            hub,
            ExchangeCall::GetMerge {
                round: 9,
                spec: Arc::new(spec()),
            },
            now,
        );
        let mut outputs = drain(member);
        let first = outputs
            .iter()
            .find_map(|o| match o {
                Output::SendRequest { request, .. } => Some(request.id()),
                _ => None,
            })
            .unwrap();
        let answer = hub_core.offer_large_merge(
            member_id,
            RpcResponse::Merge {
                id: first,
                header: merge.header_bytes.clone(),
                body: body.to_vec(),
                cosine: SketchCosine::from_f32(0.5),
                lineage: 77,
                listed: vec![],
            },
            now,
        );
        assert!(
            matches!(answer, RpcResponse::MergeHeader { .. }),
            "{answer:?}"
        );
        member.handle_response(hub, first, Ok(answer), now);
        let (mut n, mut offsets) = (0, Vec::new());
        loop {
            outputs = drain(member);
            if let Some(result) = outputs.iter().find_map(|o| match o {
                Output::ExchangeDone { call: c, result } if *c == call => Some(result.clone()),
                _ => None,
            }) {
                return (result, offsets);
            }
            let request = outputs
                .into_iter()
                .find_map(|o| match o {
                    Output::SendRequest { request, .. } => Some(request),
                    _ => None,
                })
                .expect("a piece request or the call's end");
            let RpcRequest::GetChunk { offset, .. } = &request else {
                panic!("{request:?}");
            };
            offsets.push(*offset);
            let response = hub_core.handle_request(member_id, &request, &store, now);
            let result = meddle(n, response);
            n += 1;
            member.handle_response(hub, request.id(), result, now);
        }
    };
    let len = merge.body_bytes.len() as u64;
    let (result, offsets) = fetch(
        &mut member,
        &mut hub_core,
        &merge.body_bytes,
        &mut |n, r| {
            if n == 1 {
                Err(kindred_routing::RequestFailure::ConnectionClosed)
            } else {
                Ok(r)
            }
        },
    );
    match result {
        Ok(ExchangeReply::Merge {
            merge: m,
            lineage,
            bytes,
            ..
        }) => {
            assert_eq!(m.body, body);
            assert_eq!(lineage, 77);
            assert_eq!(bytes as u64, merge.header_bytes.len() as u64 + len);
        }
        other => panic!("{other:?}"),
    }
    let mut expected: Vec<u64> = (0..len.div_ceil(40)).map(|i| i * 40).collect();
    expected.insert(1, 40);
    assert_eq!(offsets, expected);
    assert!(member.metrics().rejects.is_empty());

    // One byte changed (a hub serving another body under its header): refused when whole, and
    // the hub penalised.
    let mut tampered = merge.body_bytes.clone();
    tampered[50] ^= 1;
    let mut liar = RoutingCore::new(hub, cfg);
    let (result, _) = fetch(&mut member, &mut liar, &tampered, &mut |_, r| Ok(r));
    assert_eq!(
        result.err(),
        Some(ExchangeError::Invalid("body_hash_mismatch"))
    );
    assert_eq!(member.metrics().rejects.get("body_hash_mismatch"), Some(&1));

    // Another peer is not served the pieces.
    let stranger = peer_of(&identity(53));
    let piece = RpcRequest::GetChunk {
        id: RequestId(1),
        body_hash: merge.header.header().body_hash,
        offset: 0,
        len: 40,
    };
    assert!(matches!(
        hub_core.handle_request(stranger, &piece, &store, now),
        RpcResponse::Error {
            code: RpcErrorCode::Refused,
            ..
        }
    ));
}

/// A push over the member's inline limit goes without its body; the hub pulls the body from the
/// member in pieces (asking again for a piece that did not come) and hands the push on whole,
/// one pull per pusher at a time. The member serves those pieces to its hub only.
#[test]
fn a_large_push_is_pulled_by_the_hub_in_pieces() {
    use kindred_proto::{DenseValues, Embedding, HeaderFields, LayerPayload, PacketBody};
    use kindred_routing::exchange_rpc::Inbound;
    use kindred_routing::{ExchangeCall, InboundCall, MemoryStore, PushedPacket};

    let now = Instant::now();
    let (hub_key, member_key) = (identity(61), identity(62));
    let (hub, member_id) = (peer_of(&hub_key), peer_of(&member_key));
    let mut cfg = config();
    cfg.inline_body_bytes = 64;
    cfg.chunk_bytes = 40;
    let mut member = RoutingCore::new(member_id, cfg.clone());
    let mut hub_core = RoutingCore::new(hub, cfg);
    let store = MemoryStore::default();
    let body = PacketBody {
        layers: vec![
            LayerPayload::Dense(DenseValues::F32((0..32).map(|i| i as f32 / 4.0).collect())),
            LayerPayload::Dense(DenseValues::F32(vec![0.5; 4])),
        ],
    };
    let fields = HeaderFields {
        round: 4,
        unix_ms: 1_700_000_000_000,
        samples: 30,
        loss: 0.4,
        embedding: Embedding::default(),
    };
    let packet = kindred_proto::seal(&member_key, &spec(), fields, &body).unwrap();
    let len = packet.body_bytes.len() as u64;
    member.exchange_call(
        hub,
        ExchangeCall::Push(PushedPacket {
            round: 4,
            header: packet.header_bytes.clone(),
            body: packet.body_bytes.clone(),
            known: vec![],
        }),
        now,
    );
    let push = drain(&mut member)
        .into_iter()
        .find_map(|o| match o {
            Output::SendRequest { request, .. } => Some(request),
            _ => None,
        })
        .unwrap();
    let RpcRequest::Push { body: sent, .. } = &push else {
        panic!("{push:?}");
    };
    assert!(sent.is_empty(), "the body went with the push");
    let again = push.clone();
    let Inbound::Pull(pull) = hub_core.exchange_request(member_id, push, true, now) else {
        panic!("the hub did not pull the body");
    };
    // One pull per pusher at a time: the same push again is answered busy.
    assert!(matches!(
        hub_core.exchange_request(member_id, again, true, now),
        Inbound::Respond(RpcResponse::PushAnswer {
            answer: kindred_proto::rpc::PushAnswer::Busy,
            ..
        })
    ));
    let (mut n, mut offsets) = (0, Vec::new());
    let call = loop {
        let outputs = drain(&mut hub_core);
        if let Some(call) = outputs.iter().find_map(|o| match o {
            Output::PushPulled { pull: p, call } if *p == pull => Some(call.clone()),
            _ => None,
        }) {
            break call;
        }
        let request = outputs
            .into_iter()
            .find_map(|o| match o {
                Output::SendRequest { peer, request } if peer == member_id => Some(request),
                _ => None,
            })
            .expect("a piece request or the pull's end");
        let RpcRequest::GetChunk { offset, .. } = &request else {
            panic!("{request:?}");
        };
        offsets.push(*offset);
        let answer = member.handle_request(hub, &request, &store, now);
        let result = if n == 2 {
            Err(kindred_routing::RequestFailure::Timeout)
        } else {
            Ok(answer)
        };
        n += 1;
        hub_core.handle_response(member_id, request.id(), result, now);
    };
    match call {
        Some(InboundCall::Push(p)) => {
            assert_eq!(p.round, 4);
            assert_eq!(p.body, packet.body_bytes);
            assert_eq!(p.header, packet.header_bytes);
        }
        other => panic!("{other:?}"),
    }
    let mut expected: Vec<u64> = (0..len.div_ceil(40)).map(|i| i * 40).collect();
    expected.insert(2, 80);
    assert_eq!(offsets, expected);
    assert!(hub_core.metrics().rejects.is_empty());
    // Only the hub pushed to is served the body.
    let piece = RpcRequest::GetChunk {
        id: RequestId(3),
        body_hash: packet.header.header().body_hash,
        offset: 0,
        len: 40,
    };
    assert!(matches!(
        member.handle_request(peer_of(&identity(63)), &piece, &store, now),
        RpcResponse::Error {
            code: RpcErrorCode::Refused,
            ..
        }
    ));
}
