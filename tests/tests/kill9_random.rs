//! `kill -9` of a cohort's hub and of two members at random instants of their rounds, each
//! restarted after a random pause: every one comes back with the same identity, its round
//! counter, its error-feedback residuals, its exchange state (the hub it had joined) and its
//! store, nothing fails to read back, and it goes on with its rounds. CI runs one seed;
//! `cargo test -p kindred-tests --test kill9_random -- --ignored` runs ten.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::time::Duration;

use kindred_node::api::Status;
use kindred_tests::{TempDir, assert_restored, start_two_clusters, wait_for};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const ROUND_SECS: f64 = 2.0;
const NODES: usize = 6;

/// The hub a node pushed to in its last two rounds, if it was the same member both times.
fn joined_hub(s: &Status) -> Option<String> {
    let last: Vec<_> = s
        .history
        .iter()
        .rev()
        .take(2)
        .filter_map(|r| r.exchange.as_ref())
        .filter(|x| x.role == "member" && x.applied.contains("merge"))
        .map(|x| x.hub.clone())
        .collect();
    match last.as_slice() {
        [a, b] if a == b => Some(a.clone()),
        _ => None,
    }
}

fn kill_and_restart(seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = TempDir::new("kill9");
    let mut nodes = start_two_clusters(dir.path(), "kill9-test", NODES, ROUND_SECS);
    // Cohorts form: wait until some node is a member of a hub, two rounds running.
    let member = wait_for(Duration::from_secs(90), || {
        (0..NODES).find(|&i| nodes[i].status().and_then(|s| joined_hub(&s)).is_some())
    })
    .unwrap_or_else(|| panic!("no cohort formed:\n{}", nodes[0].log()));
    let hub_id = joined_hub(&nodes[member].status().unwrap()).unwrap();
    let hub = (0..NODES)
        .find(|&i| nodes[i].status().is_some_and(|s| s.peer_id == hub_id))
        .unwrap();
    // Two members (of any cohort) besides that hub, chosen at random.
    let mut others: Vec<usize> = (0..NODES).filter(|&i| i != hub).collect();
    let mut victims = vec![hub];
    while victims.len() < 3 {
        let k = rng.random_range(0..others.len());
        victims.push(others.swap_remove(k));
    }
    println!(
        "seed {seed}: killing hub {hub} and nodes {:?}",
        &victims[1..]
    );

    let mut before = Vec::new();
    for &i in &victims {
        std::thread::sleep(Duration::from_secs_f64(rng.random_range(0.0..ROUND_SECS)));
        let s = nodes[i].status().unwrap();
        before.push((s.peer_id.clone(), s.round.unwrap_or(0), joined_hub(&s)));
        nodes[i].kill9();
        assert!(!nodes[i].is_running());
    }
    for (k, &i) in victims.iter().enumerate() {
        std::thread::sleep(Duration::from_secs_f64(
            rng.random_range(0.0..ROUND_SECS * 2.0),
        ));
        nodes[i].start();
        let (peer, round, joined) = &before[k];
        let (restored, line) = assert_restored(&nodes[i], peer, *round);
        assert!(restored.residual_norm > 0.0, "node {i}: residuals restored");
        if let Some(hub) = joined {
            assert!(
                line.contains(hub.as_str()),
                "node {i}: joined hub {hub}: {line}"
            );
        }
        println!(
            "node {i}: restored round {} (last seen {round}), residual norm {:.4}, joined {joined:?}",
            restored.round, restored.residual_norm
        );
    }
    // Everyone goes on: three more rounds each after the restored one.
    for (i, node) in nodes.iter().enumerate() {
        let s = wait_for(Duration::from_secs(60), || {
            node.status().filter(|s| {
                let from = s.restored.as_ref().map_or(0, |r| r.round);
                s.history.iter().filter(|r| r.round > from).count() >= 3
            })
        });
        assert!(s.is_some(), "node {i} stopped its rounds:\n{}", node.log());
    }
    for node in &mut nodes {
        node.stop_cleanly(Duration::from_secs(30));
    }
}

#[test]
fn a_killed_hub_and_two_members_restart_with_their_state() {
    kill_and_restart(1);
}

#[test]
#[ignore = "ten runs, about 5 minutes"]
fn ten_runs_of_random_kills() {
    for seed in 1..=10 {
        kill_and_restart(seed);
    }
}
