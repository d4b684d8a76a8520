//! 8 real node processes on loopback in 2 label-permutation clusters: every node's merge partners
//! come from its own cluster, nodes pull toward their partners' model snapshots, and merging beats
//! training alone.
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
        // 20 rounds, as the demo: at 8 a node of one CI run tied its local-only baseline (0.8680
        // both, on 2,000 held-out digits) and at 12 one fell 0.4 points short, though its cluster
        // was 1-2 points ahead; at 20 the smallest per-node margin over 16 node-runs was +1.3.
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
    for n in &report.per_node {
        assert!(n.partners > 0, "node {} merged with nobody", n.peer);
        assert!(
            n.purity >= 0.95,
            "node {}: partner purity {:.2}",
            n.peer,
            n.purity
        );
        assert!(
            n.acc_kindred > n.acc_local,
            "node {}: Kindred {:.4} does not beat local-only {:.4}",
            n.peer,
            n.acc_kindred,
            n.acc_local
        );
    }
}
