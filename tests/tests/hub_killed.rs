//! The hub of a cohort is killed (`kill -9`) mid-round: its members still finish every round
//! before the deadline, the cohort has a new hub within 3 rounds, and the old hub, restarted
//! with its store, rejoins the swarm (through the peers it knew, even as everyone's bootstrap
//! peer) and keeps its exchange state; every node ends ahead of training alone.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::collections::BTreeSet;
use std::time::Duration;

use kindred_node::api::Status;
use kindred_tests::{NodeProc, TempDir, assert_beats_local_only, start_two_clusters, wait_for};

const ROUND_SECS: f64 = 3.0;
const NODES: usize = 8;

/// The node's role and hub in its last round (`None` before its first exchange round).
fn role_and_hub(s: &Status) -> Option<(String, String)> {
    let x = s.history.last()?.exchange.as_ref()?;
    Some((x.role.clone(), x.hub.clone()))
}

#[test]
fn a_killed_hub_is_replaced_and_its_members_never_miss_a_round() {
    let dir = TempDir::new("hubkill");
    let mut nodes = start_two_clusters(dir.path(), "hubkill-test", NODES, ROUND_SECS);
    let ids: Vec<String> = nodes
        .iter()
        .map(|n| {
            wait_for(Duration::from_secs(30), || n.status())
                .unwrap()
                .peer_id
        })
        .collect();

    // Wait for round 6 and a hub of cluster 0 (even nodes) with members.
    let (hub_index, hub_id) = wait_for(Duration::from_secs(90), || {
        let statuses: Vec<Status> = nodes.iter().filter_map(NodeProc::status).collect();
        if statuses.len() < NODES || statuses.iter().any(|s| s.history.len() < 6) {
            return None;
        }
        let members: Vec<String> = statuses
            .iter()
            .step_by(2)
            .filter_map(role_and_hub)
            .filter(|(role, _)| role == "member")
            .map(|(_, hub)| hub)
            .collect();
        let hub = members.first()?.clone();
        let index = ids.iter().position(|id| *id == hub)?;
        (index % 2 == 0).then_some((index, hub))
    })
    .unwrap_or_else(|| {
        panic!(
            "no cohort formed in cluster 0:\n{}",
            nodes.iter().map(NodeProc::log).collect::<String>()
        )
    });
    // Mid-round.
    std::thread::sleep(Duration::from_secs_f64(ROUND_SECS * 0.5));
    let killed_at = nodes[hub_index].status().unwrap().round.unwrap();
    nodes[hub_index].kill9();
    println!("killed hub {hub_id} (node {hub_index}) after round {killed_at}");

    // The other cluster-0 nodes go on: 8 more rounds each (3 to find a new hub, 5 to merge).
    let others: Vec<usize> = (0..NODES).step_by(2).filter(|&i| i != hub_index).collect();
    for &i in &others {
        let ok = wait_for(Duration::from_secs(60), || {
            let s = nodes[i].status()?;
            (s.round? >= killed_at + 8).then_some(())
        });
        assert!(ok.is_some(), "node {i} stalled:\n{}", nodes[i].log());
    }
    for &i in &others {
        let s = nodes[i].status().unwrap();
        let after: Vec<_> = s.history.iter().filter(|r| r.round > killed_at).collect();
        // Every round after the kill was finished (none skipped: each finished by its deadline).
        let rounds: BTreeSet<u64> = after.iter().map(|r| r.round).collect();
        let expected: BTreeSet<u64> = (killed_at + 1..=killed_at + 6).collect();
        assert!(
            expected.is_subset(&rounds),
            "node {i} skipped rounds after the kill: {rounds:?}"
        );
        // Within 3 rounds of the kill it has a hub other than the killed one, and takes merges.
        let late: Vec<_> = after.iter().filter(|r| r.round > killed_at + 3).collect();
        for r in &late {
            let x = r.exchange.as_ref().unwrap();
            assert_ne!(
                x.hub, hub_id,
                "node {i} still names the killed hub in round {}",
                r.round
            );
        }
        assert!(
            late.iter()
                .any(|r| r.exchange.as_ref().unwrap().applied.contains("merge")),
            "node {i} merged nothing after the kill: {:?}\n{}",
            late.iter().map(|r| &r.exchange).collect::<Vec<_>>(),
            others.iter().map(|&j| nodes[j].log()).collect::<String>()
        );
    }

    // The old hub comes back with its store and exchange state, and rejoins.
    nodes[hub_index].start();
    let back = wait_for(Duration::from_secs(60), || {
        let s = nodes[hub_index].status()?;
        (s.history.len() >= 3).then_some(s)
    })
    .unwrap_or_else(|| panic!("the old hub did not come back:\n{}", nodes[hub_index].log()));
    assert_eq!(back.peer_id, hub_id);
    assert!(back.restored.is_some(), "{}", nodes[hub_index].log());
    assert!(
        nodes[hub_index].log().contains("exchange state restored"),
        "{}",
        nodes[hub_index].log()
    );
    let (role, _) = role_and_hub(&back).unwrap();
    assert!(role == "hub" || role == "member", "rejoined as {role}");
    // It rejoined its cohort (through the peers it knew: node 0 has no bootstrap peer), not
    // three rounds alone.
    assert!(
        back.history
            .iter()
            .filter_map(|r| r.exchange.as_ref())
            .any(|x| x.applied.contains("merge")),
        "the old hub merged nothing since its restart: {:?}\n{}",
        back.history.iter().map(|r| &r.exchange).collect::<Vec<_>>(),
        nodes[hub_index].log()
    );

    // Every node, the restarted hub included, ends ahead of training alone.
    assert_beats_local_only(&nodes);

    for node in &mut nodes {
        node.stop_cleanly(Duration::from_secs(20));
    }
}
