//! Public swarms over loopback: QUIC beside TCP (dialed, and its bytes counted like TCP's), a
//! peer named by DNS, a private swarm that refuses QUIC with a clear reason, AutoNAT finding a
//! listening node reachable, and UPnP on where no gateway answers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_routing::transport::is_quic;
use kindred_routing::wire::WireProtocol;
use kindred_routing::{
    MemoryStore, NetworkId, RoutingConfig, RoutingHandle, SpawnError, TransportKind, spawn,
};
use libp2p::Multiaddr;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::pnet::PreSharedKey;

const LIMIT: Duration = Duration::from_secs(10);

async fn node(listen: &[&str], key: Option<PreSharedKey>) -> Result<RoutingHandle, SpawnError> {
    node_with(listen, key, false).await
}

async fn node_with(
    listen: &[&str],
    key: Option<PreSharedKey>,
    upnp: bool,
) -> Result<RoutingHandle, SpawnError> {
    let mut config = RoutingConfig::new(NetworkId::from_name("public"));
    config.transport.kind = TransportKind::Tcp;
    config.transport.listen = listen.iter().map(|a| a.parse().unwrap()).collect();
    config.transport.swarm_key = key;
    config.transport.upnp = upnp;
    let (handle, _events) = spawn(
        Keypair::generate_ed25519(),
        config,
        Arc::new(MemoryStore::default()),
    )
    .await?;
    Ok(handle)
}

/// Ask `check` every 50 ms until it answers `Ok`; past `limit`, fail with its last `Err`.
async fn eventually<T, Fut>(limit: Duration, mut check: impl FnMut() -> Fut) -> T
where
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(why) => assert!(Instant::now() < deadline, "after {limit:?}: {why}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn dial(from: &RoutingHandle, to: Multiaddr) -> libp2p::PeerId {
    tokio::time::timeout(LIMIT, from.dial(to))
        .await
        .expect("a dial must resolve within 10 s")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_public_node_is_reached_over_quic_and_its_bytes_are_counted() {
    let host = node(
        &["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic-v1"],
        None,
    )
    .await
    .unwrap();
    assert_eq!(host.listen_addrs().len(), 2, "{:?}", host.listen_addrs());
    let quic = host
        .listen_addrs()
        .iter()
        .find(|a| is_quic(a))
        .cloned()
        .unwrap();
    // A peer that speaks QUIC only reaches the host over it.
    let peer = node(&["/ip4/127.0.0.1/udp/0/quic-v1"], None).await.unwrap();
    let start = Instant::now();
    assert_eq!(dial(&peer, quic).await, host.peer_id());
    println!("QUIC: connected in {:?}", start.elapsed());

    // identify runs on the new connection: its bytes are counted above QUIC as above yamux.
    let (sent, received) = eventually(LIMIT, || async {
        let wire = peer.metrics().await.unwrap().wire;
        match wire.get(WireProtocol::Identify) {
            (received, sent) if sent > 0 && received > 0 => Ok((sent, received)),
            _ => Err(format!("no identify bytes counted: {wire:?}")),
        }
    })
    .await;
    println!("identify over QUIC: {sent} B sent, {received} B received");
    for h in [host, peer] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_named_by_dns_is_dialed() {
    let host = node(&["/ip4/127.0.0.1/tcp/0"], None).await.unwrap();
    let port = host.listen_addrs()[0]
        .iter()
        .find_map(|p| match p {
            Protocol::Tcp(port) => Some(port),
            _ => None,
        })
        .unwrap();
    let named: Multiaddr = format!("/dns4/localhost/tcp/{port}/p2p/{}", host.peer_id())
        .parse()
        .unwrap();
    let peer = node(&["/ip4/127.0.0.1/tcp/0"], None).await.unwrap();
    assert_eq!(dial(&peer, named).await, host.peer_id());
    for h in [host, peer] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_swarm_refuses_to_listen_on_quic() {
    let key = PreSharedKey::new([0x42; 32]);
    let refused = node(&["/ip4/127.0.0.1/udp/0/quic-v1"], Some(key)).await;
    match refused {
        Err(SpawnError::Listen { addr, reason }) => {
            assert!(is_quic(&addr));
            assert!(reason.contains("TCP only"), "{reason}");
        }
        Err(e) => panic!("refused for another reason: {e}"),
        Ok(_) => panic!("a private swarm listened on QUIC"),
    }
    // Its TCP address is fine.
    let private = node(&["/ip4/127.0.0.1/tcp/0"], Some(key)).await.unwrap();
    private.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autonat_finds_a_listening_node_reachable() {
    use kindred_routing::reachability::NatStatus;
    let host = node(&["/ip4/127.0.0.1/tcp/0"], None).await.unwrap();
    let peer = node(&["/ip4/127.0.0.1/tcp/0"], None).await.unwrap();
    assert_eq!(peer.info().await.unwrap().reachability, NatStatus::Unknown);
    let start = Instant::now();
    dial(&peer, host.listen_addrs()[0].clone()).await;
    // Each side asks the other to dial its listen address back (the first probe 5 s after
    // start).
    eventually(Duration::from_secs(30), || async {
        let (a, b) = (host.info().await.unwrap(), peer.info().await.unwrap());
        match (a.reachability, b.reachability) {
            (NatStatus::Public, NatStatus::Public) => Ok(()),
            other => Err(format!("no verdict yet: (host, peer) {other:?}")),
        }
    })
    .await;
    println!("both public after {:?}", start.elapsed());
    for h in [host, peer] {
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upnp_without_a_gateway_leaves_the_node_working() {
    let host = node_with(&["/ip4/127.0.0.1/tcp/0"], None, true)
        .await
        .unwrap();
    let peer = node(&["/ip4/127.0.0.1/tcp/0"], None).await.unwrap();
    assert_eq!(
        dial(&peer, host.listen_addrs()[0].clone()).await,
        host.peer_id()
    );
    // The gateway search runs beside the swarm: the node answers while it goes on or fails.
    eventually(LIMIT, || async {
        let connected = host.info().await.unwrap().connected;
        if connected.contains(&peer.peer_id()) {
            Ok(())
        } else {
            Err("the host never saw the peer connect".to_owned())
        }
    })
    .await;
    for h in [host, peer] {
        h.shutdown().await;
    }
}
