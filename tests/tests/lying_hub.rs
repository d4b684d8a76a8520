//! Hostile nodes that train like their cohort, rank lowest (so they become the cohort's hubs in
//! turn), and serve corrupted merges (the node's `adversary` feature, `KINDRED_ADVERSARY`):
//! sign-flipped (`flip`), 10x (`scale`) or another task's (`foreign`: the output layer's rows
//! rolled by one class, the merge of the next label-shift task; it keeps an honest merge's
//! direction and norm, and its output layer points at the wrong classes,
//! `kindred_distill::check_head`). One swarm holds one liar of each kind, ranked under every
//! honest node: a member meets them lowest first, and leaves each for the next rank. No honest
//! member ever applies a liar's merge; a member that receives one refuses it and bans the liar
//! (in the same round, or at its second merge in a row when only the output layer gives it
//! away), never names it again, goes on merging with honest hubs, and ends ahead of training
//! alone.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kindred_routing::exchange::ExchangeConfig;
use kindred_routing::hub_rank_at;
use kindred_tests::{NodeProc, TempDir, assert_beats_local_only, node_config, wait_for};

const ROUND_SECS: f64 = 2.0;
const HONEST: usize = 4;
/// As in the demo, each node holds 1/16 of the training digits: a cohort of four then holds
/// four times a node's own data, which is what merging is worth against training alone.
const SHARDS: usize = 16;
/// One liar of each kind.
const ATTACKS: [&str; 3] = ["flip", "scale", "foreign"];

/// A peer's hub rank in rank window `window`, as every node computes it.
fn rank(peer: &str, window: u64) -> u64 {
    let id: libp2p::PeerId = peer.parse().unwrap();
    hub_rank_at(&id.to_bytes(), window)
}

#[test]
fn lying_hubs_are_refused_and_left() {
    let dir = TempDir::new("liars");
    // The rank window the test runs in; near a window's end, the test waits for the next one.
    let rank_window = ExchangeConfig::default().rank_window;
    let round_ms = (ROUND_SECS * 1000.0) as u64;
    let now_round = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            / round_ms
    };
    let left = rank_window - now_round() % rank_window;
    if left < 40 {
        std::thread::sleep(Duration::from_millis(left * round_ms + 100));
    }
    let window = now_round() / rank_window;
    // Honest identities outside the lowest twentieth of ranks, so that the liars' grinding
    // below (identities under all of them) succeeds within its draws: from a twentieth, 200
    // draws all miss with probability 4e-5.
    let mut nodes: Vec<NodeProc> = Vec::new();
    let mut draws = 0;
    while nodes.len() < HONEST {
        let i = nodes.len();
        let mut c = node_config("liar-test", 0, i, SHARDS, ROUND_SECS);
        if let Some(first) = nodes.first() {
            c.bootstrap = vec![first.bootstrap_addr()];
        }
        let node = NodeProc::init(dir.path().join(format!("node{i}-{draws}")), c);
        draws += 1;
        if rank(&node.peer, window) >= u64::MAX / 20 {
            nodes.push(node);
        }
    }
    // Each liar's identity: re-drawn until it ranks below every honest node (an attacker
    // grinding keys, which ranks by window make a per-window effort).
    let mut liars: Vec<(&str, NodeProc)> = Vec::new();
    for (k, attack) in ATTACKS.into_iter().enumerate() {
        let mut config = node_config("liar-test", 0, HONEST + k, SHARDS, ROUND_SECS);
        config.bootstrap = vec![nodes[0].bootstrap_addr()];
        let liar = (0..200)
            .map(|attempt| {
                NodeProc::init(
                    dir.path().join(format!("{attack}{attempt}")),
                    config.clone(),
                )
            })
            .find(|candidate| {
                nodes
                    .iter()
                    .all(|n| rank(&candidate.peer, window) < rank(&n.peer, window))
            })
            .expect("no identity ranked lowest in 200 draws");
        liars.push((attack, liar));
    }
    for node in &mut nodes {
        node.start();
    }
    for (attack, liar) in &mut liars {
        liar.start_with_env(&[("KINDRED_ADVERSARY", attack)]);
        println!("liar ({attack}) {}", liar.peer);
    }

    // Past the honest nodes' local rounds and first searches, and a round for each liar.
    for node in &nodes {
        let ok = wait_for(Duration::from_secs(90), || {
            node.status().filter(|s| s.history.len() >= 14).map(|_| ())
        });
        assert!(ok.is_some(), "node stalled:\n{}", node.log());
    }
    let liar_ids: Vec<String> = liars.iter().map(|(_, l)| l.peer.clone()).collect();
    let is_liar = |peer: &String| liar_ids.contains(peer);
    for (attack, liar) in &mut liars {
        assert!(
            liar.is_running(),
            "the {attack} liar crashed:\n{}",
            liar.log()
        );
        let led = liar.status().unwrap().history.iter().any(|r| {
            r.exchange
                .as_ref()
                .is_some_and(|x| x.role == "hub" && x.served > 0)
        });
        assert!(
            led,
            "the {attack} liar never served a merge:\n{}",
            liar.log()
        );
    }

    for node in &nodes {
        // A member that met a liar late gets five more rounds to show it merges elsewhere.
        let last_liar_met_at = |s: &kindred_node::api::Status| {
            s.history
                .iter()
                .filter_map(|r| Some((r.round, r.exchange.as_ref()?)))
                .filter(|(_, x)| is_liar(&x.hub) && x.refused > 0)
                .map(|(round, _)| round)
                .max()
        };
        let s = wait_for(Duration::from_secs(60), || {
            let s = node.status()?;
            let last = s.history.last()?.round;
            match last_liar_met_at(&s) {
                Some(met) if last < met + 6 => None,
                _ => Some(s),
            }
        })
        .unwrap_or_else(|| panic!("node stalled after meeting a liar:\n{}", node.log()));
        let rounds: Vec<_> = s
            .history
            .iter()
            .filter_map(|r| Some((r.round, r.exchange.as_ref()?)))
            .collect();
        // Never a liar's merge applied.
        for (round, x) in &rounds {
            assert!(
                !(is_liar(&x.hub) && x.applied.contains("merge")),
                "round {round}: applied a liar's merge: {x:?}"
            );
        }
        for (attack, liar) in &liars {
            // Its merge refused: the member bans the liar, takes the next rank from its next
            // round, and never names the liar again (the ban outlasts the test). A merge whose
            // direction or norm fails is banned at once; one whose output layer alone fails
            // (`foreign`) is a doubt, banned at the second in a row.
            let refused: Vec<_> = rounds
                .iter()
                .filter(|(_, x)| x.hub == liar.peer && x.refused > 0)
                .collect();
            let allowed = if *attack == "foreign" { 2 } else { 1 };
            let banned = refused.iter().take(allowed).find(|(_, x)| x.bans > 0);
            if let Some((first, x)) = refused.first() {
                assert!(
                    banned.is_some() || refused.len() < allowed,
                    "round {first}: refused the {attack} liar {} times without banning it: {x:?}",
                    refused.len()
                );
            }
            if let Some((at, _)) = banned {
                for (r, x) in rounds.iter().filter(|(r, _)| r > at) {
                    assert_ne!(
                        x.hub, liar.peer,
                        "round {r}: names the {attack} liar after banning it"
                    );
                }
            }
        }
        // It goes on merging with honest hubs.
        let met = last_liar_met_at(&s).unwrap_or(0);
        let late: Vec<_> = rounds.iter().filter(|(r, _)| *r > met + 2).collect();
        assert!(
            late.iter().any(|(_, x)| x.applied.contains("merge")),
            "merged nothing after leaving the liars: {late:?}"
        );
    }
    // Each liar's merges met an honest member's refusal (it was the hub of someone).
    for (attack, liar) in &liars {
        let refusals: u64 = nodes
            .iter()
            .filter_map(NodeProc::status)
            .flat_map(|s| s.history)
            .filter_map(|r| r.exchange)
            .filter(|x| x.hub == liar.peer)
            .map(|x| x.refused)
            .sum();
        assert!(
            refusals > 0,
            "no honest node ever refused a merge of the {attack} liar"
        );
    }

    // Every honest member ends ahead of training alone.
    assert_beats_local_only(&nodes);
}
