//! The cohort tier: the exchange core forms one bounded, pure tree per task.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use kindred_simulator::cohorts::{CohortsConfig, CohortsReport, run};

fn run_quiet(cfg: &CohortsConfig) -> CohortsReport {
    run(cfg, &|_, _, _| {}).expect("cohort run")
}

#[test]
fn each_task_forms_one_bounded_pure_tree_within_a_few_rounds() {
    let cfg = CohortsConfig::new(3000, 4, 10);
    let r = run_quiet(&cfg);
    let formed = r.rounds_to_99.expect("every task in one tree");
    assert!(formed <= cfg.local_rounds + 4, "formed in round {formed}");
    assert!(
        r.largest_tree_share_min >= 0.99,
        "{}",
        r.largest_tree_share_min
    );
    assert!(r.purity_min >= 0.99, "purity {}", r.purity_min);
    // Bounded hubs: at most M pushes a merge, depth within ⌈log_M N⌉ + 1.
    assert!(r.members_per_hub_max <= 64, "{}", r.members_per_hub_max);
    assert!((1..=3).contains(&r.depth_max), "depth {}", r.depth_max);
    let last = r.per_round.last().expect("rounds");
    assert!(last.trees <= 5, "about one tree per task: {last:?}");
    // Every node pushes once and takes one merge a round: bytes stay near two packets.
    assert!(
        r.bytes_per_node_round > 15_000.0 && r.bytes_per_node_round < 80_000.0,
        "{}",
        r.bytes_per_node_round
    );
}

#[test]
fn one_hub_per_cohort_merges_everyone_without_a_fanout() {
    // Tasks of 200 nodes: under the 256 pushes one hub takes.
    let mut cfg = CohortsConfig::new(400, 2, 8);
    cfg.fanout = None;
    let r = run_quiet(&cfg);
    let last = r.per_round.last().expect("rounds");
    assert!(last.largest_tree_share_min >= 0.95, "{last:?}");
    assert_eq!(r.depth_max, 1, "members push to their hub only");
    assert!(r.members_per_hub_max > 100, "{}", r.members_per_hub_max);
}

#[test]
fn replaced_nodes_join_their_tasks_tree() {
    let mut cfg = CohortsConfig::new(1000, 2, 16);
    cfg.churn_per_hour = 3.0;
    let r = run_quiet(&cfg);
    let replaced: usize = r.per_round.iter().map(|x| x.replaced).sum();
    assert!(replaced > 300, "{replaced}");
    assert!(r.purity_min >= 0.99, "purity {}", r.purity_min);
    // 5% of the nodes are new each round, and a new node spends its first exchange round
    // joining (fetching and checking its hub's model): the rest are in their task's tree.
    let last = r.per_round.last().expect("rounds");
    assert!(last.largest_tree_share_min >= 0.9, "{last:?}");
    assert!(last.alone <= 80, "{last:?}");
}

#[test]
fn a_seed_gives_the_same_rounds() {
    let cfg = CohortsConfig::new(500, 3, 6);
    let strip = |r: CohortsReport| {
        r.per_round
            .into_iter()
            .map(|mut x| {
                x.seconds = 0.0;
                x
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(strip(run_quiet(&cfg)), strip(run_quiet(&cfg)));
}

#[test]
fn bad_options_are_errors() {
    assert!(run(&CohortsConfig::new(1, 1, 1), &|_, _, _| {}).is_err());
    let mut cfg = CohortsConfig::new(100, 2, 2);
    cfg.fanout = Some(1);
    assert!(run(&cfg, &|_, _, _| {}).is_err());
    cfg.fanout = Some(8);
    cfg.msg_loss = 1.5;
    assert!(run(&cfg, &|_, _, _| {}).is_err());
}

#[test]
fn a_task_whose_root_leaves_is_back_in_one_tree_the_next_round() {
    // 5% of the nodes leave each round, roots too. A member whose (sub-)hub left, or whose
    // parent answers busy (it lost its own hub and pushes to this node now), chooses again
    // within the round: a task whose root leaves loses at most that round. (Before, on these
    // seeds, whole tasks stayed out of every tree 2-3 rounds in a row.)
    for seed in [5, 6, 7] {
        let mut cfg = CohortsConfig::new(1000, 2, 16);
        cfg.churn_per_hour = 3.0;
        cfg.seed = seed;
        let r = run_quiet(&cfg);
        let low: Vec<u64> = r
            .per_round
            .iter()
            .filter(|x| x.round >= cfg.local_rounds + 2 && x.largest_tree_share_min < 0.9)
            .map(|x| x.round)
            .collect();
        assert!(
            low.windows(2).all(|w| w[1] > w[0] + 1),
            "seed {seed}: rounds with a task out of its tree {low:?}"
        );
    }
}
