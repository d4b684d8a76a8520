//! A private swarm: nodes with the pre-shared key form the swarm and merge; a node without the
//! key (same network name, same task) is never connected.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use kindred_tests::{NodeProc, TempDir, kindred_bin, node_config, wait_for};

#[test]
fn only_nodes_with_the_swarm_key_connect() {
    let dir = TempDir::new("private");
    let key = dir.path().join("swarm.key");
    let out = Command::new(kindred_bin())
        .args(["swarm-key", "--out"])
        .arg(&key)
        .output()
        .unwrap();
    assert!(out.status.success());

    let mut nodes: Vec<NodeProc> = Vec::new();
    for i in 0..4 {
        let mut c = node_config("private-test", 0, i, 4, 2.0);
        if let Some(first) = nodes.first() {
            c.bootstrap = vec![first.bootstrap_addr()];
        }
        // Nodes 0-2 hold the key; node 3 tries to join without it.
        if i < 3 {
            c.swarm_key = Some(key.clone());
        }
        nodes.push(NodeProc::init(dir.path().join(format!("node{i}")), c));
    }
    for node in &mut nodes {
        node.start();
    }
    // The keyed nodes find each other and merge.
    for node in &nodes[..3] {
        let s = wait_for(Duration::from_secs(60), || {
            node.status()
                .filter(|s| s.history.iter().any(|r| !r.partners.is_empty()))
        });
        assert!(s.is_some(), "keyed node never merged:\n{}", node.log());
    }
    // The outsider ran for several rounds and never had a connection; nobody merged with it.
    let outsider = wait_for(Duration::from_secs(30), || {
        nodes[3].status().filter(|s| s.history.len() >= 3)
    })
    .unwrap_or_else(|| panic!("outsider did not run:\n{}", nodes[3].log()));
    assert_eq!(
        outsider.connected,
        0,
        "outsider connected:\n{}",
        nodes[3].log()
    );
    assert!(outsider.history.iter().all(|r| r.partners.is_empty()));
    for node in &nodes[..3] {
        let s = node.status().unwrap();
        assert!(
            s.history
                .iter()
                .all(|r| !r.partners.contains(&outsider.peer_id))
        );
        assert!(s.connected >= 1);
    }
    // The refusal is logged when the handshake fails, which under load can come after the
    // outsider's first rounds: wait for it (bounded).
    let refused = wait_for(Duration::from_secs(30), || {
        nodes[3]
            .log()
            .contains("bootstrap dial failed")
            .then_some(())
    });
    assert!(
        refused.is_some(),
        "the outsider tried to join and was refused:\n{}",
        nodes[3].log()
    );
}
