//! A node restarts with persisted peers that no longer answer: one accepts the TCP connection
//! and never speaks, the slowest way to fail (the handshake's 5 s timeout). It still reaches its
//! configured bootstrap peer at once: the rejoin through known peers and the bootstrap dials
//! run side by side, so stale peers never hold up a bootstrap peer that is there.
#![allow(clippy::unwrap_used)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kindred_node::store::Store;
use kindred_tests::{NodeProc, TempDir, node_config, wait_for};
use libp2p::Multiaddr;

#[test]
fn stale_known_peers_do_not_hold_up_the_bootstrap_peer() {
    let dir = TempDir::new("stale-known");
    let mut first = NodeProc::init(
        dir.path().join("node0"),
        node_config("stale-test", 0, 0, 2, 2.0),
    );
    let mut c = node_config("stale-test", 0, 1, 2, 2.0);
    c.bootstrap = vec![first.bootstrap_addr()];
    let mut second = NodeProc::init(dir.path().join("node1"), c);

    // The peer the second node knew: it accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let gone = libp2p::identity::Keypair::generate_ed25519()
        .public()
        .to_peer_id();
    let stale: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}/p2p/{gone}")
        .parse()
        .unwrap();
    {
        let store = Store::open(&second.dir.join("store")).unwrap();
        store.put_known_peers(&[stale]).unwrap();
        store.flush().unwrap();
    }

    first.start();
    wait_for(Duration::from_secs(30), || first.status()).unwrap();
    second.start();
    wait_for(Duration::from_secs(30), || second.status()).unwrap();
    let up = Instant::now();
    let connected = wait_for(Duration::from_secs(30), || {
        second
            .log()
            .contains("connected to bootstrap peer")
            .then(|| up.elapsed())
    })
    .unwrap_or_else(|| panic!("never reached its bootstrap peer:\n{}", second.log()));
    // Waiting for the stale peer first would take its 5 s handshake timeout.
    assert!(
        connected < Duration::from_secs(3),
        "the bootstrap peer was reached {connected:?} after the API came up:\n{}",
        second.log()
    );
    drop(silent);

    for node in [&mut first, &mut second] {
        node.stop_cleanly(Duration::from_secs(20));
    }
}
