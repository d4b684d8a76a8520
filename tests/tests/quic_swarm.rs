//! A public swarm over QUIC: nodes whose only bootstrap address is a peer's QUIC address, named
//! by DNS (`/dns4/localhost/udp/…/quic-v1`), join the swarm and merge with it.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kindred_tests::{NodeProc, TempDir, node_config, wait_for};

#[test]
fn nodes_join_through_a_dns_named_quic_address_and_merge() {
    let dir = TempDir::new("public-quic");
    let mut nodes = vec![NodeProc::init_listening(
        dir.path().join("node0"),
        node_config("quic-test", 0, 0, 3, 2.0),
        true,
    )];
    let port = nodes[0].listen.rsplit('/').next().unwrap().to_string();
    let quic = format!("/dns4/localhost/udp/{port}/quic-v1/p2p/{}", nodes[0].peer);
    for i in 1..3 {
        let mut c = node_config("quic-test", 0, i, 3, 2.0);
        c.bootstrap = vec![quic.clone()];
        nodes.push(NodeProc::init(dir.path().join(format!("node{i}")), c));
    }
    for node in &mut nodes {
        node.start();
    }
    for node in &nodes {
        let s = wait_for(Duration::from_secs(60), || {
            node.status()
                .filter(|s| s.history.iter().any(|r| !r.partners.is_empty()))
        });
        assert!(s.is_some(), "node never merged:\n{}", node.log());
    }
    for node in &nodes[1..] {
        let log = node.log();
        assert!(
            log.lines()
                .any(|l| l.contains("connected to bootstrap peer") && l.contains("quic-v1")),
            "no QUIC bootstrap connection:\n{log}"
        );
    }
}
