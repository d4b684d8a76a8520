//! A hostile process on the swarm serves forged, oversize and malformed headers and bodies that do
//! not match their hash: honest nodes running the pairwise exchange (which fetches them) reject
//! every one, count the rejects, ban it, never merge with it, and keep running.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::Duration;

use kindred_node::config::ExchangeKind;
use kindred_tests::{NodeProc, TempDir, free_ports, node_config, wait_for};

/// The DHT search period of every node here, the hostile one included.
const DISCOVERY_EVERY: u64 = 2;

#[test]
fn hostile_peer_is_banned_and_nobody_crashes() {
    let dir = TempDir::new("hostile");
    let mut nodes: Vec<NodeProc> = Vec::new();
    for i in 0..3 {
        let mut c = node_config("hostile-test", 0, i, 3, 2.0);
        // An honest node meets a peer it does not follow only in discovery rounds; searching
        // every other round lets three offences (a ban) accrue in seconds, not minutes.
        c.discovery_every = DISCOVERY_EVERY;
        // The hostile peer attacks the pairwise exchange's fetches (headers and bodies).
        c.exchange = ExchangeKind::Pairwise;
        if let Some(first) = nodes.first() {
            c.bootstrap = vec![first.bootstrap_addr()];
        }
        nodes.push(NodeProc::init(dir.path().join(format!("node{i}")), c));
    }
    for node in &mut nodes {
        node.start();
    }
    wait_for(Duration::from_secs(30), || nodes[0].status()).expect("bootstrap node up");

    let port = free_ports(1)[0];
    let log = std::fs::File::create(dir.path().join("hostile.log")).unwrap();
    let mut hostile = Command::new(env!("CARGO_BIN_EXE_hostile"))
        .args([
            "--network",
            "hostile-test",
            "--round-secs",
            "2",
            "--label-shift",
            "0",
            "--discovery-every",
            &DISCOVERY_EVERY.to_string(),
        ])
        .arg("--data-dir")
        .arg(dir.path().join("hostile"))
        .args(["--listen", &format!("/ip4/127.0.0.1/tcp/{port}")])
        .args(["--bootstrap", &nodes[0].bootstrap_addr()])
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();

    // Every honest node bans the hostile peer (3 major offences) within a few rounds.
    let banned = wait_for(Duration::from_secs(90), || {
        let all = nodes
            .iter()
            .filter_map(NodeProc::status)
            .collect::<Vec<_>>();
        (all.len() == nodes.len() && all.iter().filter(|s| s.banned >= 1).count() >= 2)
            .then_some(all)
    });
    let _ = hostile.kill();
    let _ = hostile.wait();
    let statuses = banned.unwrap_or_else(|| {
        panic!(
            "hostile peer not banned:\n{}",
            nodes.iter().map(NodeProc::log).collect::<String>()
        )
    });

    let honest: Vec<String> = statuses.iter().map(|s| s.peer_id.clone()).collect();
    for (node, s) in nodes.iter_mut().zip(&statuses) {
        assert!(node.is_running(), "an honest node crashed:\n{}", node.log());
        // Nobody merged with it: every partner is an honest node.
        for r in &s.history {
            assert!(
                r.partners.iter().all(|p| honest.contains(p)),
                "merged with the hostile peer"
            );
        }
        // Bans and rejects are exported as metrics.
        if s.banned >= 1 {
            let metrics = node.metrics().unwrap();
            assert!(!metrics.contains("kindred_bans_total 0"), "{metrics}");
            // Some reasons are exported at 0 from the start: at least one must have counted.
            assert!(
                metrics
                    .lines()
                    .filter(|l| l.starts_with("kindred_rejects_total{reason="))
                    .any(|l| !l.ends_with(" 0")),
                "{metrics}"
            );
        }
    }
    // Across the swarm, the rejects name the attacks.
    let reasons: std::collections::BTreeMap<String, u64> = statuses
        .iter()
        .flat_map(|s| s.rejects.clone())
        .fold(Default::default(), |mut acc, (k, v)| {
            *acc.entry(k).or_default() += v;
            acc
        });
    assert!(!reasons.is_empty(), "no rejects counted");
    eprintln!("rejects by reason: {reasons:?}");
}
