//! 64 real nodes (libp2p memory transport, Noise, yamux, Kademlia) holding updates from 4 planted
//! clusters: every node finds its 5 most similar peers by semantic keys, fetches bodies only
//! from its own cluster, and each DHT lookup stays within 3·log2(N) Kademlia requests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod support;

use std::time::{Duration, Instant};

use kindred_routing::TransportKind;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_nodes_find_their_cluster() {
    let started = Instant::now();
    let spec = SwarmSpec {
        nodes: 64,
        clusters: 4,
        noise: 0.25,
        seed: 7,
        kind: TransportKind::Memory,
        join: Join::Bootstrap,
        configure: Box::new(|_| {}),
    };
    let run = async {
        let t = Instant::now();
        let nodes = start_swarm(&spec).await;
        let mut tables = Vec::new();
        for n in &nodes {
            let info = n.handle.info().await.unwrap();
            tables.push((info.routing_table, info.connected.len()));
        }
        println!(
            "started and bootstrapped in {:.1}s; routing table mean {:.1}, connections mean {:.1}",
            t.elapsed().as_secs_f64(),
            tables.iter().map(|t| t.0).sum::<usize>() as f64 / tables.len() as f64,
            tables.iter().map(|t| t.1).sum::<usize>() as f64 / tables.len() as f64,
        );
        let t = Instant::now();
        let failed = announce_all(&nodes).await;
        println!("announced in {:.1}s", t.elapsed().as_secs_f64());
        let t = Instant::now();
        let figures = measure(&nodes, 16).await;
        println!("looked up in {:.1}s", t.elapsed().as_secs_f64());
        let metrics = nodes[0].handle.metrics().await.unwrap();
        shutdown(nodes).await;
        (failed, figures, metrics)
    };
    let (failed, figures, metrics) = tokio::time::timeout(Duration::from_secs(110), run)
        .await
        .expect("the 64-node run must finish well within CI's 2 minutes");

    let budget = 3.0 * (spec.nodes as f64).log2();
    let requests = &figures.requests_per_lookup;
    let mean = requests.iter().map(|&r| f64::from(r)).sum::<f64>() / requests.len() as f64;
    println!(
        "nodes={} recall@5={:.3} requests/lookup p50={} p95={} max={} mean={:.1} (budget {:.0}) \
         key lookups/round={:.1} header requests/round={:.1} bodies={} cross-cluster={} \
         lookup ms p50={:.1} p95={:.1} announce failures={} elapsed={:.1}s",
        figures.nodes,
        figures.recall_at_5,
        percentile(requests, 50.0),
        percentile(requests, 95.0),
        requests.last().copied().unwrap_or(0),
        mean,
        budget,
        figures.key_lookups_per_round,
        figures.header_requests_per_round,
        figures.bodies,
        figures.cross_cluster_bodies,
        percentile(&figures.lookup_ms, 50.0),
        percentile(&figures.lookup_ms, 95.0),
        failed,
        started.elapsed().as_secs_f64(),
    );

    assert!(figures.recall_at_5 >= 0.9, "recall {}", figures.recall_at_5);
    assert_eq!(figures.cross_cluster_bodies, 0);
    assert!(figures.bodies > 0);
    assert!(!requests.is_empty());
    assert!(
        f64::from(percentile(requests, 50.0)) <= budget && mean <= budget,
        "requests per lookup over 3·log2(N): p50 {} mean {mean:.1}",
        percentile(requests, 50.0)
    );
    // Node 0 served headers and bodies and counted them.
    assert!(metrics.headers.requests_received.messages > 0);
    assert!(metrics.headers.responses_sent.bytes > 0);
    assert_eq!(metrics.bans, 0, "honest nodes must not ban each other");
    // The connection counters see everything the RPC counters see, and Kademlia's traffic too.
    let rpc = |k: &kindred_routing::metrics::KindTraffic| {
        (
            k.requests_received.bytes + k.responses_received.bytes,
            k.requests_sent.bytes + k.responses_sent.bytes,
        )
    };
    let (h_in, h_out) = rpc(&metrics.headers);
    let (b_in, b_out) = rpc(&metrics.body);
    assert!(
        metrics.wire_bytes_in > h_in + b_in && metrics.wire_bytes_out > h_out + b_out,
        "wire {} / {} against RPC {} / {}",
        metrics.wire_bytes_in,
        metrics.wire_bytes_out,
        h_in + b_in,
        h_out + b_out
    );
    // By protocol: the RPC streams carry at least the RPC messages (plus their framing and
    // negotiation), Kademlia and identify carry traffic too, and every stream names its
    // protocol.
    use kindred_routing::wire::WireProtocol;
    let (rpc_in, rpc_out) = metrics.wire.get(WireProtocol::Rpc);
    println!(
        "wire bytes by protocol: {:?}; RPC messages in {} out {}",
        metrics.wire,
        h_in + b_in,
        h_out + b_out
    );
    assert!(rpc_in >= h_in + b_in && rpc_out >= h_out + b_out);
    for p in [WireProtocol::Kademlia, WireProtocol::Identify] {
        let (i, o) = metrics.wire.get(p);
        assert!(i > 0 && o > 0, "{p:?}: {i} / {o}");
    }
    assert_eq!(metrics.wire.get(WireProtocol::Other), (0, 0));
}
