//! Private swarms over loopback TCP: a node with the swarm key joins; a node with a different key,
//! or none, cannot connect in either direction, and each refusal happens within 10 seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_routing::{
    DialError, MemoryStore, NetworkId, RoutingConfig, RoutingHandle, TransportKind, spawn,
};
use libp2p::identity::Keypair;
use libp2p::pnet::PreSharedKey;

const LIMIT: Duration = Duration::from_secs(10);

async fn node(key: Option<PreSharedKey>) -> RoutingHandle {
    let mut config = RoutingConfig::new(NetworkId::from_name("private"));
    config.transport.kind = TransportKind::Tcp;
    config.transport.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    config.transport.swarm_key = key;
    let (handle, _events) = spawn(
        Keypair::generate_ed25519(),
        config,
        Arc::new(MemoryStore::default()),
    )
    .await
    .unwrap();
    handle
}

/// Dial and report the outcome and how long it took, failing the test past the limit.
async fn timed_dial(
    from: &RoutingHandle,
    to: &RoutingHandle,
) -> (Result<libp2p::PeerId, DialError>, Duration) {
    let start = Instant::now();
    let result = tokio::time::timeout(LIMIT, from.dial(to.listen_addrs()[0].clone()))
        .await
        .expect("a dial must resolve within 10 s, never hang");
    (result, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_holders_of_the_swarm_key_connect() {
    let key = PreSharedKey::new([0x42; 32]);
    let other = PreSharedKey::new([0x24; 32]);
    assert_ne!(
        key.fingerprint().to_string(),
        other.fingerprint().to_string()
    );

    let host = node(Some(key)).await;
    let member = node(Some(key)).await;
    let stranger = node(Some(other)).await;
    let public = node(None).await;

    let (joined, took) = timed_dial(&member, &host).await;
    assert_eq!(joined.unwrap(), host.peer_id());
    println!("right key: connected in {took:?}");

    // Every refusal, both directions, at once: each must resolve within the limit.
    let attempts = [
        ("wrong key, dialing in", &stranger, &host),
        ("wrong key, dialed out", &host, &stranger),
        ("no key, dialing in", &public, &host),
        ("no key, dialed out", &host, &public),
    ];
    let results =
        futures::future::join_all(attempts.iter().map(|(_, from, to)| timed_dial(from, to))).await;
    for ((name, _, _), (result, took)) in attempts.iter().zip(results) {
        println!("{name}: {result:?} after {took:?}");
        assert!(
            matches!(result, Err(DialError::Failed(_))),
            "{name}: {result:?}"
        );
        assert!(took < LIMIT);
    }

    let info = host.info().await.unwrap();
    assert!(info.connected.contains(&member.peer_id()));
    assert!(!info.connected.contains(&stranger.peer_id()));
    assert!(!info.connected.contains(&public.peer_id()));
    // No external address configured: Kademlia is a client (`KadMode::Auto`) until AutoNAT
    // confirms the listen address (the member dials it back, from 5 s after start).
    let confirmed = info.reachability == kindred_routing::reachability::NatStatus::Public;
    assert_eq!(info.external_addrs.is_empty(), !confirmed, "{info:?}");
    assert_eq!(info.kad_server, confirmed, "{info:?}");

    for h in [host, member, stranger, public] {
        h.shutdown().await;
    }
}
