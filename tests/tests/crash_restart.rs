//! `kill -9` of three nodes mid-round, everyone's bootstrap peer (node 0) among them, then
//! restart: same PeerId, round counter, residuals and exchange state restored, store opens
//! cleanly, and they rejoin (node 0 through the peers it knew) and keep merging. Then every
//! node stops cleanly (exit 0) on SIGTERM.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::Duration;

use kindred_tests::{TempDir, assert_restored, start_two_clusters, wait_for};

const ROUND_SECS: f64 = 2.0;

#[test]
fn killed_nodes_restart_with_identity_round_and_residuals() {
    let dir = TempDir::new("crash");
    let n = 4;
    let mut nodes = start_two_clusters(dir.path(), "crash-test", n, ROUND_SECS);
    // Let everyone complete a few rounds with partners.
    for node in &nodes {
        let ok = wait_for(Duration::from_secs(60), || {
            node.status().filter(|s| s.history.len() >= 3).map(|_| ())
        });
        assert!(
            ok.is_some(),
            "node never completed 3 rounds:\n{}",
            node.log()
        );
    }

    // kill -9 nodes 0, 1 and 2 at an arbitrary point of a round.
    std::thread::sleep(Duration::from_millis(700));
    let killed = [0, 1, 2];
    let mut before = Vec::new();
    for i in killed {
        let s = nodes[i].status().unwrap();
        before.push((s.peer_id.clone(), s.round.unwrap()));
        nodes[i].kill9();
        assert!(!nodes[i].is_running());
    }
    std::thread::sleep(Duration::from_secs_f64(ROUND_SECS * 1.5));

    for (k, i) in killed.into_iter().enumerate() {
        nodes[i].start();
        let (peer, round) = &before[k];
        // Identity, checkpoint, distiller state and the hub exchange's state (its view, its
        // hub, the hub's error feedback), persisted with every committed round.
        let (restored, _) = assert_restored(&nodes[i], peer, *round);
        assert!(
            restored.residual_norm > 0.0,
            "error-feedback residuals restored"
        );
        println!(
            "node {i}: restored round {} residual norm {:.4}",
            restored.round, restored.residual_norm
        );
    }

    // Node 0 has no bootstrap peer: it rejoins through the peers it persisted, at once.
    let rejoined = wait_for(Duration::from_secs(20), || {
        nodes[0]
            .log()
            .contains("rejoined the DHT after a restart")
            .then_some(())
    });
    assert!(
        rejoined.is_some(),
        "node 0 did not rejoin:\n{}",
        nodes[0].log()
    );

    // They continue: new rounds after the restored one, merging with their cluster again.
    for i in killed {
        let s = wait_for(Duration::from_secs(60), || {
            nodes[i]
                .status()
                .filter(|s| s.history.iter().filter(|r| !r.partners.is_empty()).count() >= 2)
        })
        .unwrap_or_else(|| panic!("restarted node did not rejoin:\n{}", nodes[i].log()));
        let restored = s.restored.unwrap().round;
        assert!(
            s.history.iter().all(|r| r.round > restored),
            "rounds continue after the restored one"
        );
    }

    // Graceful shutdown: SIGTERM, clean exit, summary written.
    for node in &mut nodes {
        node.stop_cleanly(Duration::from_secs(30));
        assert!(node.dir.join("summary.json").is_file());
    }
}
