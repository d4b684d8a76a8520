//! 8 real node processes on loopback in 2 label-permutation clusters: every node's merge partners
//! come from its own cluster, nodes pull toward their partners' model snapshots, and merging beats
//! training alone (each cluster on average; no node falls behind by more than sampling noise).
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use kindred_node::config::ExchangeKind;
use kindred_node::demo::{self, DemoOptions};
use kindred_tests::{TempDir, kindred_bin};

#[test]
fn eight_nodes_two_clusters_merge_within_their_cluster_and_beat_local_training() {
    let dir = TempDir::new("clusters");
    let report = demo::run(DemoOptions {
        nodes: 8,
        clusters: 2,
        // 20 rounds, as the demo: at 8 or 12 a node's margin over local-only is within its
        // sampling noise (ties and 0.4-point shortfalls were seen while its cluster was ahead).
        rounds: 20,
        round_secs: 3.0,
        seed: 11,
        steps: 50,
        discovery_every: 10,
        snapshot_every: 2,
        exchange: ExchangeKind::Pairwise,
        dir: Some(dir.path().to_path_buf()),
        binary: kindred_bin(),
    })
    .unwrap();
    demo::print(&report, true);
    assert_eq!(report.rounds, 20, "every node completed its rounds");
    // Snapshot rounds are the odd ones; a node pulls in those it merged someone. A fetch may
    // miss its deadline on a loaded machine, but most must land.
    assert!(
        report.snapshot_rounds >= 8 * 5,
        "{}",
        report.snapshot_rounds
    );
    assert!(
        report.snapshot_pulls * 10 >= report.snapshot_rounds * 8,
        "pulled in {} of {} snapshot rounds",
        report.snapshot_pulls,
        report.snapshot_rounds
    );
    // All traffic (Kademlia, identify, ping) is more than the packet RPCs alone.
    assert!(report.wire_bytes_per_node_round > report.bytes_per_node_round);
    for n in &report.per_node {
        println!(
            "node {} cluster {}: Kindred {:.4} local {:.4} ({:+.2} points), {} partners, purity {:.2}, {} pulls",
            n.peer,
            n.cluster,
            n.acc_kindred,
            n.acc_local,
            100.0 * (n.acc_kindred - n.acc_local),
            n.partners,
            n.purity,
            n.pulls
        );
    }
    // Accuracy is measured on 2,000 held-out digits, so one node's figure carries about 0.7 point
    // of sampling noise. Over 4 runs (32 node-runs, 2026-11-26) the per-node margin over
    // local-only ranged from -0.65 to +3.45 points, a cluster's mean from +1.04 to +2.36 and the
    // swarm's from +1.64 to +2.34; a clean-clone CI run on 2026-11-29 had one node at -1.05 in
    // a swarm at +2.02 (clusters +1.80 and +2.25). Two such figures differ by up to a point and a
    // half from noise alone, so: the swarm beats training alone by a point on average, each
    // cluster beats it, and no node falls more than a point and a half below its own local-only
    // run (a node merging another cluster's updates falls by many points).
    let margin = |nodes: &[&demo::NodeResult]| {
        nodes
            .iter()
            .map(|n| n.acc_kindred - n.acc_local)
            .sum::<f64>()
            / nodes.len().max(1) as f64
    };
    let all: Vec<_> = report.per_node.iter().collect();
    assert!(
        margin(&all) >= 0.01,
        "Kindred beats local-only by {:+.2} points on average, not 1",
        100.0 * margin(&all)
    );
    for cluster in 0..2 {
        let nodes: Vec<_> = all
            .iter()
            .copied()
            .filter(|n| n.cluster == cluster)
            .collect();
        assert!(!nodes.is_empty(), "cluster {cluster} has no nodes");
        assert!(
            margin(&nodes) > 0.0,
            "cluster {cluster}: Kindred is {:+.2} points from local-only on average",
            100.0 * margin(&nodes)
        );
    }
    for n in &report.per_node {
        assert!(n.partners > 0, "node {} merged with nobody", n.peer);
        assert!(
            n.purity >= 0.95,
            "node {}: partner purity {:.2}",
            n.peer,
            n.purity
        );
        assert!(
            n.acc_kindred >= n.acc_local - 0.015,
            "node {}: Kindred {:.4} is more than 1.5 points below local-only {:.4}",
            n.peer,
            n.acc_kindred,
            n.acc_local
        );
    }
}
