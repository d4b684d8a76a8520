//! Model snapshots over real libp2p connections (loopback TCP): a node serves the snapshot its
//! store holds, a peer fetches and verifies it, a node without one answers `NotFound`, and by
//! default a node refuses its snapshot to a peer it has not served a body to.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use kindred_proto::{
    DType, DenseValues, Embedding, HeaderFields, LayerPayload, LayerSpec, ModelSpec, PacketBody,
    seal_snapshot,
};
use kindred_routing::{
    MemoryStore, NetworkId, RoutingConfig, RoutingHandle, SnapshotError, TransportKind, spawn,
};
use libp2p::identity::{Keypair, ed25519};

const LIMIT: Duration = Duration::from_secs(20);

async fn node(key: &ed25519::Keypair, store: Arc<MemoryStore>, open: bool) -> RoutingHandle {
    let mut config = RoutingConfig::new(NetworkId::from_name("snapshots"));
    if open {
        // Serve anyone: this test has no lookup through which `a` would fetch `b`'s body first.
        config.core.snapshot_grant = None;
    }
    config.transport.kind = TransportKind::Tcp;
    config.transport.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    let (handle, _events) = spawn(Keypair::from(key.clone()), config, store)
        .await
        .unwrap();
    handle
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_fetches_and_verifies_a_served_snapshot() {
    // A layer big enough that the answer spans many yamux frames (1 MiB of f16).
    let spec = Arc::new(ModelSpec::new(vec![LayerSpec::new("w", [1 << 19], DType::F32)]).unwrap());
    let body = PacketBody {
        layers: vec![LayerPayload::Dense(DenseValues::F16(
            (0..1u32 << 19)
                .map(|i| half::f16::from_f32((i % 97) as f32 / 97.0))
                .collect(),
        ))],
    };
    let (key_a, key_b) = (ed25519::Keypair::generate(), ed25519::Keypair::generate());
    let (store_a, store_b) = (
        Arc::new(MemoryStore::default()),
        Arc::new(MemoryStore::default()),
    );
    let a = node(&key_a, store_a, true).await;
    let b = node(&key_b, store_b.clone(), true).await;
    a.dial(b.listen_addrs()[0].clone()).await.unwrap();

    // Nothing to serve yet.
    let r = tokio::time::timeout(LIMIT, a.fetch_snapshot(b.peer_id(), spec.clone(), 0))
        .await
        .unwrap();
    assert_eq!(r.err(), Some(SnapshotError::NotFound));

    let fields = HeaderFields {
        round: 9,
        unix_ms: 0,
        samples: 0,
        loss: 0.0,
        embedding: Embedding::default(),
    };
    store_b.set_snapshot(&seal_snapshot(&key_b, &spec, fields.clone(), &body).unwrap());
    let got = tokio::time::timeout(LIMIT, a.fetch_snapshot(b.peer_id(), spec.clone(), 8))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.header.header().sender, b.peer_id());
    assert_eq!(got.header.header().round, 9);
    assert_eq!(got.body, body);

    // Too old for the asker: refused as stale, not held against the peer.
    let r = tokio::time::timeout(LIMIT, a.fetch_snapshot(b.peer_id(), spec.clone(), 10))
        .await
        .unwrap();
    assert_eq!(
        r.err(),
        Some(SnapshotError::Stale {
            found: 9,
            oldest: 10
        })
    );

    // A node with the default policy refuses a peer it never served a body to.
    let key_c = ed25519::Keypair::generate();
    let store_c = Arc::new(MemoryStore::default());
    let c = node(&key_c, store_c.clone(), false).await;
    a.dial(c.listen_addrs()[0].clone()).await.unwrap();
    store_c.set_snapshot(&seal_snapshot(&key_c, &spec, fields.clone(), &body).unwrap());
    let r = tokio::time::timeout(LIMIT, a.fetch_snapshot(c.peer_id(), spec.clone(), 0))
        .await
        .unwrap();
    assert_eq!(r.err(), Some(SnapshotError::Refused));
    c.shutdown().await;

    let (ma, mb) = (a.metrics().await.unwrap(), b.metrics().await.unwrap());
    assert_eq!(ma.snapshot.requests_sent.messages, 4);
    assert_eq!(mb.snapshot.responses_sent.messages, 3);
    assert!(ma.snapshot.responses_received.bytes > 2 * (1 << 19));
    assert!(ma.rejects.is_empty());
    assert!(a.info().await.unwrap().banned.is_empty());
    a.shutdown().await;
    b.shutdown().await;
}
