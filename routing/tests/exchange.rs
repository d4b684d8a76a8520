//! The exchange core alone, in the style of quinn-proto's `Pair`: N cores wired together by a
//! deterministic harness with a virtual clock and a lossy, reordering message queue. The harness
//! plays every driver: it carries messages, answers searches from a fake DHT, measures fake
//! cosines (the nodes of one task sit at 0.95-0.99, other tasks at 0.2, or at 0.96 for a
//! "lookalike" pair), computes merges as the set of tasks they hold, and checks them with fake
//! verdicts (a merge of another task, or a poisoned one, fails).
//!
//! Properties over loss and crash schedules: every node finishes every round it ran whole by
//! its deadline; no node applies a merge its checks did not pass; two tasks never merge each
//! other's updates; and once faults stop, every task's nodes converge to one hub within a
//! bounded number of rounds.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};

use kindred_routing::exchange::{
    Apply, Exchange, ExchangeConfig, Input, MergeVerdict, Millis, ModelVerdict, Output, Role,
    SeenHeader, Snapshot, Timing,
};
use kindred_routing::hub_rank;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const ROUND_MS: u64 = 1_000;
/// A round's deadline, before the next round starts.
const DEADLINE_MS: u64 = 990;
const TASKS: u32 = 2;

/// The driver's handle for a payload: what the fake checks look at.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Blob {
    Packet {
        node: u32,
        task: u32,
        round: u64,
    },
    Merge {
        hub: u32,
        round: u64,
        tasks: BTreeSet<u32>,
        poisoned: bool,
    },
    Model {
        hub: u32,
        task: u32,
    },
}

type Core = Exchange<u32, Blob>;

/// A fault schedule: node `node` crashes `offset_ms` into round `round` and comes back
/// `down` rounds later, restored from its snapshot if `restore`, or empty.
#[derive(Debug, Clone, Copy)]
struct Crash {
    round: u64,
    node: u32,
    offset_ms: u64,
    down: u64,
    restore: bool,
}

#[derive(Debug, Clone)]
enum Event {
    Deliver { to: u32, input: Input<u32, Blob> },
    Crash(Crash),
}

struct Node {
    core: Option<Core>,
    task: u32,
    rank: u64,
    hostile: bool,
    /// Persisted state (taken at every round's end), what a restart restores.
    saved: Option<Snapshot<u32>>,
    back_at: u64,
    /// The round its core started fresh (its local rounds count from there).
    first_round: u64,
    /// Rounds it ran from start to end without a crash.
    whole: BTreeSet<u64>,
    /// Finished reports: round → (time, hub, role, apply).
    reports: BTreeMap<u64, (u64, u32, Role, Apply<Blob>)>,
    /// Merges its checks passed.
    passed: BTreeSet<Blob>,
}

/// The harness: nodes, the virtual clock, the message queue.
struct Net {
    nodes: Vec<Node>,
    now: u64,
    queue: BTreeMap<(u64, u64), Event>,
    seq: u64,
    rng: ChaCha8Rng,
    loss: f64,
    /// Pairs of different tasks whose sketches look alike.
    lookalikes: BTreeSet<(u32, u32)>,
    /// Nodes that announced their keys (the fake DHT's provider records).
    announced: BTreeSet<u32>,
    /// Nodes no other node's search ever finds (their own searches find the others): views
    /// that are not symmetric, as a band miss leaves them.
    hidden: BTreeSet<u32>,
    violations: Vec<String>,
    /// Bounded hubs ([`ExchangeConfig::fanout`]).
    fanout: Option<usize>,
}

fn config() -> ExchangeConfig {
    tree_config(None)
}

/// The harness's config, with bounded hubs of fan-in `fanout` if `Some`.
fn tree_config(fanout: Option<usize>) -> ExchangeConfig {
    ExchangeConfig {
        fanout,
        local_rounds: 1,
        search_every: 4,
        timing: Timing {
            answer_ms: 100,
            ..Timing::default()
        },
        ..ExchangeConfig::default()
    }
}

impl Net {
    fn new(n: u32, seed: u64, loss: f64, hostile: &[u32], lookalike: f64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let nodes = (0..n)
            .map(|i| {
                let rank = hub_rank(&u64::from(i).to_le_bytes());
                Node {
                    core: Some(Exchange::new(i, rank, config())),
                    task: i % TASKS,
                    rank,
                    hostile: hostile.contains(&i),
                    saved: None,
                    back_at: 0,
                    first_round: 0,
                    whole: BTreeSet::new(),
                    reports: BTreeMap::new(),
                    passed: BTreeSet::new(),
                }
            })
            .collect::<Vec<_>>();
        let mut lookalikes = BTreeSet::new();
        for a in 0..n {
            for b in a + 1..n {
                if a % TASKS != b % TASKS && rng.random_bool(lookalike) {
                    lookalikes.insert((a, b));
                }
            }
        }
        Self {
            nodes,
            now: 0,
            queue: BTreeMap::new(),
            seq: 0,
            rng,
            loss,
            lookalikes,
            announced: BTreeSet::new(),
            hidden: BTreeSet::new(),
            violations: Vec::new(),
            fanout: None,
        }
    }

    /// The same nodes with bounded hubs of fan-in `m`: cohorts become trees.
    fn with_fanout(mut self, m: usize) -> Self {
        self.fanout = Some(m);
        for (i, n) in self.nodes.iter_mut().enumerate() {
            n.core = Some(Exchange::new(i as u32, n.rank, tree_config(self.fanout)));
        }
        self
    }

    fn node(&self, i: u32) -> &Node {
        &self.nodes[i as usize]
    }

    fn is_up(&self, i: u32) -> bool {
        self.nodes.get(i as usize).is_some_and(|n| n.core.is_some())
    }

    fn cosine(&self, a: u32, b: u32) -> f32 {
        let (lo, hi) = (a.min(b), a.max(b));
        if self.node(a).task == self.node(b).task {
            let h = hub_rank(&[lo.to_le_bytes(), hi.to_le_bytes()].concat());
            0.95 + 0.04 * (h % 1000) as f32 / 1000.0
        } else if self.lookalikes.contains(&(lo, hi)) {
            0.96
        } else {
            0.2
        }
    }

    fn schedule(&mut self, delay: u64, event: Event) {
        self.seq += 1;
        self.queue.insert((self.now + delay, self.seq), event);
    }

    /// A message between nodes: lost with probability `loss`, else delayed 1-40 ms (so
    /// messages overtake each other).
    fn send(&mut self, to: u32, input: Input<u32, Blob>) {
        if self.rng.random_bool(self.loss) {
            return;
        }
        let delay = self.rng.random_range(1..40);
        self.schedule(delay, Event::Deliver { to, input });
    }

    /// A result of the node's own driver (search, compute, check): never lost.
    fn local(&mut self, to: u32, delay: u64, input: Input<u32, Blob>) {
        self.schedule(delay, Event::Deliver { to, input });
    }

    fn handle(&mut self, i: u32, input: Input<u32, Blob>) {
        let now = Millis(self.now);
        if let Some(core) = self.nodes[i as usize].core.as_mut() {
            core.handle(now, input);
        }
        self.pump(i);
    }

    /// Carry out every output of node `i`: the driver's part.
    fn pump(&mut self, i: u32) {
        loop {
            let Some(out) = self.nodes[i as usize]
                .core
                .as_mut()
                .and_then(Core::poll_output)
            else {
                return;
            };
            self.carry_out(i, out);
        }
    }

    fn carry_out(&mut self, i: u32, out: Output<u32, Blob>) {
        let me = self.node(i);
        let (task, hostile) = (me.task, me.hostile);
        match out {
            Output::Search {
                round, announce, ..
            } => {
                if announce {
                    self.announced.insert(i);
                }
                let headers: Vec<SeenHeader<u32>> = self
                    .announced
                    .iter()
                    .filter(|&&j| j != i && self.is_up(j) && !self.hidden.contains(&j))
                    .map(|&j| {
                        let hub = self.node(j).core.as_ref().map_or(j, Core::hub);
                        SeenHeader {
                            peer: j,
                            rank: self.node(j).rank,
                            cosine: self.cosine(i, j),
                            hub,
                            hub_rank: self.node(hub).rank,
                        }
                    })
                    .collect();
                let headers = headers
                    .into_iter()
                    .filter(|_| !self.rng.random_bool(self.loss))
                    .collect();
                self.local(i, 30, Input::SearchDone { round, headers });
            }
            Output::FetchModel { ticket, hub } => {
                // A request and its response: either may be lost, and a node that is down
                // does not answer.
                if self.is_up(hub) && !self.rng.random_bool(self.loss) {
                    let model = Blob::Model {
                        hub,
                        task: self.node(hub).task,
                    };
                    self.send(
                        i,
                        Input::ModelReceived {
                            ticket,
                            model: Some(model),
                        },
                    );
                }
            }
            Output::CheckModel { ticket, model, .. } => {
                let verdict = match model {
                    Blob::Model { task: t, hub } if t == task => {
                        if hub % 4 == 0 {
                            ModelVerdict::Keep
                        } else {
                            ModelVerdict::Adopt
                        }
                    }
                    _ => ModelVerdict::Refuse,
                };
                self.local(i, 5, Input::ModelChecked { ticket, verdict });
            }
            Output::Push {
                to,
                round,
                packet,
                known,
                via,
            } => {
                if self.is_up(to) {
                    let input = Input::PushReceived {
                        from: i,
                        rank: self.node(i).rank,
                        round,
                        packet,
                        cosine: self.cosine(to, i),
                        known,
                        via,
                    };
                    self.send(to, input);
                }
            }
            Output::Answer { to, round, answer } => {
                // The receiving driver computes a hinted hub's rank itself.
                let answer = answer.ranked_by(|hub| self.node(*hub).rank);
                if self.is_up(to) {
                    self.send(
                        to,
                        Input::AnswerReceived {
                            from: i,
                            round,
                            answer,
                        },
                    );
                }
            }
            Output::Merge {
                ticket,
                round,
                own,
                members,
                ..
            } => {
                // A sub-hub's merge brings its children's tasks (and poison) with it.
                let mut tasks = BTreeSet::new();
                let mut poisoned = hostile;
                for (_, p) in std::iter::once((i, own)).chain(members) {
                    match p {
                        Blob::Packet { task, .. } => {
                            tasks.insert(task);
                        }
                        Blob::Merge {
                            tasks: t,
                            poisoned: p,
                            ..
                        } => {
                            tasks.extend(t);
                            poisoned |= p;
                        }
                        Blob::Model { .. } => {}
                    }
                }
                if !hostile && tasks.len() > 1 {
                    self.violations
                        .push(format!("hub {i} round {round} merges tasks {tasks:?}"));
                }
                let merge = Blob::Merge {
                    hub: i,
                    round,
                    tasks,
                    poisoned,
                };
                self.local(
                    i,
                    10,
                    Input::MergeComputed {
                        ticket,
                        merge: Some(merge),
                    },
                );
            }
            Output::CheckMerge { ticket, merge, .. } => {
                let verdict = match &merge {
                    // A hostile hub vouches for its own merge.
                    _ if hostile => MergeVerdict::Pass,
                    Blob::Merge { poisoned: true, .. } => MergeVerdict::Aggregate,
                    Blob::Merge { tasks, .. } if *tasks == BTreeSet::from([task]) => {
                        MergeVerdict::Pass
                    }
                    _ => MergeVerdict::Data,
                };
                if verdict == MergeVerdict::Pass {
                    self.nodes[i as usize].passed.insert(merge);
                }
                self.local(i, 5, Input::MergeChecked { ticket, verdict });
            }
            Output::ServeMerge {
                to,
                round,
                merge,
                lineage,
                listed,
            } => {
                // A hostile sub-hub poisons the merge it passes down.
                let merge = match merge {
                    Blob::Merge {
                        hub, round, tasks, ..
                    } if hostile && hub != i => Blob::Merge {
                        hub: i,
                        round,
                        tasks,
                        poisoned: true,
                    },
                    other => other,
                };
                for r in to {
                    if self.is_up(r.peer) {
                        let input = Input::MergeReceived {
                            from: i,
                            round,
                            merge: merge.clone(),
                            cosine: r.cosine,
                            lineage,
                            listed: if r.listed { listed.clone() } else { Vec::new() },
                        };
                        self.send(r.peer, input);
                    }
                }
            }
            Output::FetchMerge { hub, round } => {
                if self.is_up(hub) {
                    self.send(hub, Input::MergeAsked { from: i, round });
                }
            }
            Output::Ban { .. } => {}
            Output::Finished(report) => self.finished(i, report),
        }
    }

    fn finished(&mut self, i: u32, report: kindred_routing::exchange::RoundReport<u32, Blob>) {
        let round_start = report.round * ROUND_MS;
        let now = self.now;
        let node = &mut self.nodes[i as usize];
        if now > round_start + DEADLINE_MS {
            self.violations
                .push(format!("node {i} finished round {} at {now}", report.round));
        }
        let previous = node.reports.insert(
            report.round,
            (now, report.hub, report.role, report.apply.clone()),
        );
        if previous.is_some() {
            self.violations
                .push(format!("node {i} finished round {} twice", report.round));
        }
        if node.hostile {
            return;
        }
        if let Apply::Merge { merge, .. } = &report.apply {
            let checked = node.passed.contains(merge);
            // A hub's merge in the first exchange round is not checked by its data (its
            // members' data checked its model).
            let unchecked_ok = report.role == Role::Hub
                && report.round == node.first_round + config().local_rounds;
            if !checked && !unchecked_ok {
                self.violations.push(format!(
                    "node {i} applies unchecked {merge:?} in round {}",
                    report.round
                ));
            }
            match merge {
                Blob::Merge {
                    tasks, poisoned, ..
                } if *poisoned || *tasks != BTreeSet::from([node.task]) => {
                    self.violations.push(format!("node {i} applies {merge:?}"));
                }
                _ => {}
            }
        }
    }

    /// The next thing that happens, up to `until`.
    fn next_time(&self, until: u64) -> Option<u64> {
        let queued = self.queue.keys().next().map(|k| k.0);
        let timers = self
            .nodes
            .iter()
            .filter_map(|n| n.core.as_ref()?.poll_timeout().map(|t| t.0))
            .min();
        [queued, timers]
            .into_iter()
            .flatten()
            .min()
            .filter(|&t| t <= until)
    }

    /// Run the clock to `until`: deliver events, fire timers.
    fn drive(&mut self, until: u64) {
        while let Some(t) = self.next_time(until) {
            self.now = self.now.max(t);
            while let Some(entry) = self.queue.first_entry() {
                if entry.key().0 > self.now {
                    break;
                }
                match entry.remove() {
                    Event::Deliver { to, input } => self.handle(to, input),
                    Event::Crash(c) => self.crash(c),
                }
            }
            for i in 0..self.nodes.len() as u32 {
                let due = self.nodes[i as usize]
                    .core
                    .as_ref()
                    .and_then(Core::poll_timeout)
                    .is_some_and(|t| t.0 <= self.now);
                if due {
                    let now = Millis(self.now);
                    if let Some(c) = self.nodes[i as usize].core.as_mut() {
                        c.handle_timeout(now);
                    }
                    self.pump(i);
                }
            }
        }
        self.now = until;
    }

    fn crash(&mut self, c: Crash) {
        let node = &mut self.nodes[c.node as usize];
        if node.core.take().is_some() {
            node.whole.remove(&c.round);
            node.back_at = c.round + c.down;
            if !c.restore {
                node.saved = None;
            }
        }
    }

    /// Play rounds `rounds`, with `crashes`.
    fn run(&mut self, rounds: std::ops::Range<u64>, crashes: &[Crash]) {
        for round in rounds {
            let start = round * ROUND_MS;
            self.drive(start);
            for i in 0..self.nodes.len() as u32 {
                let node = &mut self.nodes[i as usize];
                if node.core.is_none() && node.back_at <= round {
                    node.core = Some(match node.saved.clone() {
                        Some(s) => Exchange::restore(tree_config(self.fanout), s).unwrap(),
                        None => {
                            node.first_round = round;
                            Exchange::new(i, node.rank, tree_config(self.fanout))
                        }
                    });
                }
                let Some(core) = node.core.as_mut() else {
                    continue;
                };
                node.whole.insert(round);
                core.handle(
                    Millis(start),
                    Input::RoundStart {
                        round,
                        deadline: Millis(start + DEADLINE_MS),
                    },
                );
                let ready = self.rng.random_range(0..60);
                let packet = Blob::Packet {
                    node: i,
                    task: node.task,
                    round,
                };
                self.schedule(
                    ready,
                    Event::Deliver {
                        to: i,
                        input: Input::PacketReady { round, packet },
                    },
                );
            }
            for c in crashes.iter().filter(|c| c.round == round) {
                self.schedule(c.offset_ms, Event::Crash(*c));
            }
            self.drive(start + DEADLINE_MS);
            for node in &mut self.nodes {
                if let Some(core) = node.core.as_ref() {
                    node.saved = Some(core.snapshot());
                }
            }
        }
    }

    /// Every node that ran a round whole finished it.
    fn check_rounds(&mut self) {
        for (i, node) in self.nodes.iter().enumerate() {
            for round in &node.whole {
                if !node.reports.contains_key(round) {
                    self.violations
                        .push(format!("node {i} never finished round {round}"));
                }
            }
        }
    }

    /// The node at the top of `i`'s tree in `round`: the (sub-)hubs it pushed to, followed up
    /// to one that was its own hub.
    fn root(&self, i: u32, round: u64) -> Option<u32> {
        let mut at = i;
        for _ in 0..self.nodes.len() {
            match self.node(at).reports.get(&round)? {
                (_, hub, Role::Member, _) if *hub != at => at = *hub,
                _ => return Some(at),
            }
        }
        None
    }

    /// In `round`, each task's honest nodes are one tree, under one root, and applied one
    /// merge.
    fn converged_tree(&self, round: u64) -> Result<(), String> {
        for task in 0..TASKS {
            let nodes: Vec<u32> = (0..self.nodes.len() as u32)
                .filter(|&i| self.node(i).task == task && !self.node(i).hostile)
                .collect();
            let roots: BTreeSet<Option<u32>> = nodes.iter().map(|&i| self.root(i, round)).collect();
            if roots.len() != 1 {
                return Err(format!("task {task} round {round}: roots {roots:?}"));
            }
            let merges: BTreeSet<Option<&Blob>> = nodes
                .iter()
                .map(|&i| match self.node(i).reports.get(&round) {
                    Some((_, _, _, Apply::Merge { merge, .. })) => Some(merge),
                    _ => None,
                })
                .collect();
            if merges.len() != 1 || merges.contains(&None) {
                return Err(format!("task {task} round {round}: merges {merges:?}"));
            }
        }
        Ok(())
    }

    /// In `round`, each task's honest nodes are one cohort: one hub, whose merge every other
    /// node applied.
    fn converged(&self, round: u64) -> Result<(), String> {
        for task in 0..TASKS {
            let nodes: Vec<(usize, &Node)> = self
                .nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.task == task && !n.hostile)
                .collect();
            let hubs: BTreeSet<u32> = nodes
                .iter()
                .filter_map(|(_, n)| n.reports.get(&round).map(|r| r.1))
                .collect();
            if hubs.len() != 1 {
                return Err(format!("task {task} round {round}: hubs {hubs:?}"));
            }
            for (i, n) in &nodes {
                match n.reports.get(&round) {
                    Some((_, _, _, Apply::Merge { .. })) => {}
                    other => return Err(format!("node {i} round {round}: {other:?}")),
                }
            }
        }
        Ok(())
    }
}

#[test]
fn without_faults_each_task_forms_one_cohort_and_stays_pure() {
    let mut net = Net::new(12, 7, 0.0, &[], 0.0);
    net.run(0..8, &[]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    for round in 4..8 {
        net.converged(round).unwrap();
    }
    // Round 0 is local: everyone applied its own update.
    assert!(
        net.nodes
            .iter()
            .all(|n| matches!(n.reports[&0].3, Apply::Own(_)))
    );
}

/// The lowest rank of a task is found by nobody, but finds the others: it is its own hub and
/// nobody pushes to it, while the rest of its task forms a cohort under the next rank. After
/// `idle_rounds` it pushes to that hub, which learns of it and hands the cohort over.
#[test]
fn a_hub_nobody_found_pushes_to_its_next_rank_and_the_task_converges_under_it() {
    let mut net = Net::new(12, 7, 0.0, &[], 0.0);
    let lowest = (0..12u32)
        .filter(|&i| net.node(i).task == 0)
        .min_by_key(|&i| net.node(i).rank)
        .unwrap();
    net.hidden.insert(lowest);
    net.run(0..12, &[]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    for round in 9..12 {
        net.converged(round).unwrap();
        assert_eq!(net.nodes[lowest as usize].reports[&round].1, lowest);
    }
}

#[test]
fn a_crashed_hub_costs_its_members_their_merges_and_they_move_to_the_next_rank() {
    let mut net = Net::new(8, 3, 0.0, &[], 0.0);
    net.run(0..6, &[]);
    net.converged(5).unwrap();
    let hub = net.nodes[0].reports[&5].1;
    let crash = Crash {
        round: 6,
        node: hub,
        offset_ms: 1,
        down: 20,
        restore: false,
    };
    net.run(6..14, &[crash]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    let task = net.node(hub).task;
    // Its members applied their own updates while it was gone, then took the next rank.
    let members: Vec<&Node> = net
        .nodes
        .iter()
        .filter(|n| n.task == task && n.core.is_some())
        .collect();
    assert!(
        members
            .iter()
            .all(|n| matches!(n.reports[&6].3, Apply::Own(_)))
    );
    let next: BTreeSet<u32> = members.iter().map(|n| n.reports[&13].1).collect();
    assert_eq!(next.len(), 1);
    assert!(!next.contains(&hub));
    assert!(
        members
            .iter()
            .all(|n| matches!(n.reports[&13].3, Apply::Merge { .. }))
    );
}

#[test]
fn members_ban_a_hub_whose_merges_fail_their_checks() {
    // The lowest rank of task 0 among 8 nodes, made hostile.
    let lowest = (0..8u32)
        .filter(|i| i % TASKS == 0)
        .min_by_key(|i| hub_rank(&u64::from(*i).to_le_bytes()))
        .unwrap();
    let mut net = Net::new(8, 5, 0.0, &[lowest], 0.0);
    net.run(0..12, &[]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    for n in net.nodes.iter().filter(|n| n.task == 0 && !n.hostile) {
        assert!(
            !n.core
                .as_ref()
                .unwrap()
                .cohort()
                .members()
                .any(|p| *p == lowest)
        );
    }
    net.converged(11).unwrap();
}

/// Bounded hubs of fan-in 3: each task of 8 is a tree of depth 2 or more, under one root,
/// and every node applies the root's merge.
#[test]
fn with_bounded_hubs_each_task_forms_one_tree_under_one_root() {
    let mut net = Net::new(16, 7, 0.0, &[], 0.0).with_fanout(3);
    net.run(0..10, &[]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    for round in 6..10 {
        net.converged_tree(round).unwrap();
    }
    // Pushes between a node and its root in the last round (bounded: a cycle would fail).
    let depth = |i: u32| {
        let mut at = i;
        for d in 0..16 {
            match net.node(at).reports.get(&9) {
                Some((_, hub, Role::Member, _)) if *hub != at => at = *hub,
                _ => return d,
            }
        }
        panic!("node {i}: no root within 16 pushes");
    };
    let deepest = (0..16).map(depth).max();
    assert!(deepest >= Some(2), "{deepest:?}");
}

fn crashes(nodes: u32, until: u64) -> impl Strategy<Value = Vec<Crash>> {
    proptest::collection::vec(
        (1..until, 0..nodes, 0..DEADLINE_MS, 1u64..4, any::<bool>()),
        0..4,
    )
    .prop_map(move |v| {
        v.into_iter()
            .map(|(round, node, offset_ms, down, restore)| Crash {
                round,
                node,
                offset_ms,
                down: down.min(until - round),
                restore,
            })
            .collect()
    })
}

/// Rounds with faults, then rounds without, within which cohorts must converge: two search
/// periods and a few rounds to join.
const FAULTY: u64 = 10;
const SETTLE: u64 = 12;

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// Loss and crashes: every round ends by its deadline, nothing unchecked or foreign is
    /// applied, and once faults stop each task converges to one hub (or one tree).
    #[test]
    fn faults_never_break_the_invariants_and_cohorts_converge_once_they_stop(
        seed in any::<u64>(),
        nodes in 6u32..14,
        fanout in proptest::option::of(2usize..5),
        loss in 0.0f64..0.3,
        crashes in crashes(14, FAULTY),
    ) {
        let crashes: Vec<Crash> = crashes.into_iter().filter(|c| c.node < nodes).collect();
        let mut net = Net::new(nodes, seed, loss, &[], 0.0);
        if let Some(m) = fanout {
            net = net.with_fanout(m);
        }
        net.run(0..FAULTY, &crashes);
        net.loss = 0.0;
        net.run(FAULTY..FAULTY + SETTLE, &[]);
        net.check_rounds();
        prop_assert_eq!(&net.violations, &Vec::<String>::new());
        let last = FAULTY + SETTLE - 1;
        // With bounded hubs (trees of fan-in 2 to 4), one tree per task.
        let converged = match fanout {
            Some(_) => net.converged_tree(last),
            None => net.converged(last),
        };
        prop_assert_eq!(converged, Ok(()));
    }

    /// Lookalike sketches across tasks and hostile hubs (and sub-hubs, with bounded hubs): the
    /// checks keep every merge pure.
    #[test]
    fn lookalikes_and_hostile_hubs_never_get_into_an_applied_merge(
        seed in any::<u64>(),
        nodes in 6u32..14,
        fanout in proptest::option::of(2usize..5),
        loss in 0.0f64..0.2,
        lookalike in 0.0f64..0.5,
        hostile in proptest::collection::vec(0u32..14, 0..3),
    ) {
        let mut net = Net::new(nodes, seed, loss, &hostile, lookalike);
        if let Some(m) = fanout {
            net = net.with_fanout(m);
        }
        net.run(0..16, &[]);
        net.check_rounds();
        prop_assert_eq!(&net.violations, &Vec::<String>::new());
    }
}

#[test]
fn tmp_flaky_case() {
    let mut net = Net::new(11, 16669606071406030460, 0.13405731995398257, &[], 0.0).with_fanout(2);
    net.run(0..FAULTY, &[]);
    net.loss = 0.0;
    net.run(FAULTY..FAULTY + SETTLE + 8, &[]);
    for r in [9u64, 10, 11, 20] {
        for i in 0..11u32 {
            let n = net.node(i);
            if n.task == 0 {
                let rep = n.reports.get(&r).map(|(_, hub, role, apply)| {
                    (
                        hub,
                        role,
                        format!("{apply:?}").chars().take(90).collect::<String>(),
                    )
                });
                eprintln!(
                    "r{r} node {i} rank {} root {:?}: {:?}",
                    n.rank,
                    net.root(i, r),
                    rep
                );
            }
        }
    }
}

/// A full sub-hub one level above the deepest sends a pusher up a level instead of naming a
/// child that cannot take it: found by the property below (11 nodes, fan-out 2, 13% loss), where
/// the pusher bounced between a full sub-hub and its deepest children every round and never
/// merged.
#[test]
fn a_pusher_below_a_full_sub_hub_finds_a_place_higher_up() {
    let mut net = Net::new(
        11,
        16_669_606_071_406_030_460,
        0.134_057_319_953_982_57,
        &[],
        0.0,
    )
    .with_fanout(2);
    net.run(0..FAULTY, &[]);
    net.loss = 0.0;
    net.run(FAULTY..FAULTY + SETTLE, &[]);
    net.check_rounds();
    assert_eq!(net.violations, Vec::<String>::new());
    assert_eq!(net.converged_tree(FAULTY + SETTLE - 1), Ok(()));
}
