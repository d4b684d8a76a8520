//! Parameters of an [`Exchange`](super::Exchange).

use crate::CosineGate;

/// When, inside a round, the exchange's phases end, as thousandths of the round (from its
/// start to its deadline), and how long a push may wait for its answer.
///
/// A round's phases: the node's own packet, a search (if scheduled), a member's join (fetch
/// and check its hub's model) and push, the hub's admission, the merge, the members' checks.
/// Only the search and the admission have a share of their own: the rest end at the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// A search not reported by this share of the round goes on with the peers already known.
    /// Default 250.
    pub search_permille: u16,
    /// A hub closes its admission at this share of the round and asks for its merge; a member
    /// not joined by then gives up the round. Default 600.
    pub collect_permille: u16,
    /// Milliseconds a push or a model fetch waits for its answer before it is sent again
    /// ([`ExchangeConfig::retries`]) or the hub counts as gone for the round. Default 5,000.
    pub answer_ms: u64,
    /// A member accepted by its hub that has no merge by this share of the round asks the hub
    /// for it ([`super::Output::FetchMerge`]): the merge it was sent may have been lost.
    /// Default 800.
    pub merge_ask_permille: u16,
    /// With bounded hubs ([`ExchangeConfig::fanout`]), a sub-hub at depth `d` of its cohort's
    /// tree closes its admission `d` times this share before the root does
    /// ([`Timing::collect_permille`]), so its merge reaches its parent before the parent
    /// closes. Default 100 (a level is 6 s of a 60-s round: a merge and a push).
    pub level_permille: u16,
}

impl Timing {
    /// When a hub at depth `depth` of its tree closes its admission, in thousandths of the
    /// round (the root, depth 0, at [`Timing::collect_permille`]).
    pub fn close_permille(&self, depth: u8) -> u16 {
        self.collect_permille
            .saturating_sub(self.level_permille.saturating_mul(u16::from(depth)))
    }
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            search_permille: 250,
            collect_permille: 600,
            answer_ms: 5_000,
            merge_ask_permille: 800,
            level_permille: 100,
        }
    }
}

/// Parameters of the exchange (the simulator's `HubConfig` names the same ones).
#[derive(Debug, Clone, PartialEq)]
pub struct ExchangeConfig {
    /// Rounds a node trains alone before it takes part (its embedding must describe its data).
    /// Default 2.
    pub local_rounds: u64,
    /// Exchange rounds, from the first, in which every node that is its own hub searches.
    /// Default 3: the first rounds' cohorts are fragments, and a fragment's hub meets the
    /// others' members (whose headers name their hub) by searching again.
    pub warmup_searches: u64,
    /// After those, a node that is its own hub searches every this many rounds (one hub per
    /// cohort; a tree's roots: [`ExchangeConfig::tree_search_every`]), with
    /// [`ExchangeConfig::search_probes`] multi-probe keys. Default 10. A node that knows nobody
    /// also searches in exchange round 4 and in the last round of every key window
    /// ([`ExchangeConfig::key_window`]): one miss of the warm-up's searches (the band keys are a
    /// coin toss for a young model) must not leave it alone for `search_every` rounds.
    pub search_every: u64,
    /// With bounded hubs ([`ExchangeConfig::fanout`]) a root searches every this many rounds
    /// after the warm-up instead. Default 2. Only roots search in a tree, one node in `m` at
    /// most, so frequent searches cost the swarm little, and each one joins fragments of a
    /// task that missed each other: `kindred-sim learn --nodes 1000 --rounds 30 --setting
    /// label --fanout 64 --seed 1` had 99% of every task in one tree at round 10 with searches
    /// every 2 rounds, 12 with 5, 22 with 10, for 1% more bytes (BENCHMARKS.md, cohorts).
    pub tree_search_every: u64,
    /// Rounds per window of the semantic keys (the routing's `Discovery::every_rounds`; swarm
    /// rounds `w·key_window .. (w+1)·key_window` share one): what is announced in a window is
    /// found under its keys until the window ends. A node that knows nobody searches in the
    /// last round of each window, when every announcement of the window is in: hubs announce
    /// once per [`ExchangeConfig::search_every`] of *their* rounds, and nodes start their
    /// rounds at different times, so a schedule counted in the node's own rounds (it searched
    /// in exchange rounds 4, 8, 16) can miss its task's announcements window after window
    /// (a node of a 16-node demo: all 18 exchange rounds). Default 10.
    pub key_window: u64,
    /// Exchange rounds in a row a node that is its own hub and knew peers from the round's
    /// start takes no push before it pushes to its next rank for a round: views need not be
    /// symmetric (it found a cohort whose hub it outranks, the cohort never found it), and the
    /// push is what tells that hub, which then hands the cohort over. Default 2.
    pub idle_rounds: u32,
    /// A node whose round starts more than this many rounds after the last one it ran (it was
    /// down, or stalled) first joins its next rank (or its hub, anew) and takes that model,
    /// after its data checked it: it trained nothing while its cohort went on, and members
    /// joining it would adopt its model, behind theirs (in the node's hub-killed test, a hub
    /// back after 6 rounds took its cohort back 2 points). Meanwhile it names that hub to
    /// whoever pushes to it. It heads its cohort again once it applied a merge there, or after
    /// [`super::CATCH_UP_ROUNDS`] rounds. Default 2 (a round skipped because it started late is
    /// not a return).
    pub catch_up_after: u64,
    /// Multi-probe keys (the signature's lowest-margin bits flipped,
    /// [`crate::keys::ProbeSequence`]) a search looks up besides its band keys when, from its
    /// second exchange round on, the node's view holds fewer than
    /// [`ExchangeConfig::probe_below`] peers. Default 3.
    ///
    /// A task of many nodes has many records under its band keys, and a search meets one of
    /// them without probes; a small task (or a fragment of one) has a few, and a band of 4 bits
    /// that misses them by one bit left nodes of 4-node tasks alone, or a task in two cohorts,
    /// for up to 11 exchange rounds (`kindred-sim learn --nodes 8 --clusters 2 --steps 50
    /// --rounds 20`, seeds 1-16; in real nodes, one node never merged in 20 rounds). With the
    /// probes every task there is one cohort by its third exchange round (BENCHMARKS.md, "Small
    /// swarms"). Probing in the first search too cost 33% more bytes at 1,000 nodes, where
    /// every node's first search probes the busiest keys.
    pub probes: usize,
    /// Multi-probe keys a hub's searches after the warm-up look up besides its band keys.
    /// Default 1. Two cohorts of one task whose hubs' band keys differ in a bit each (sketches
    /// move little between searches, so the same bits differ each time) meet only through a
    /// probe: without it, `kindred-sim experiment --seed 1` ended iid seed 3 as two cohorts
    /// of 32; with it, as one (BENCHMARKS.md, results experiment).
    pub search_probes: usize,
    /// A view of fewer peers than this searches with [`ExchangeConfig::probes`]. Default 3:
    /// a hub that knows 3 peers may head a whole 4-node task, and at 4 every search of such a
    /// hub probed (in the 16-node demo, 6 keys instead of 3 in most searches).
    pub probe_below: usize,
    /// One node in this many, the lowest ranks, is a hub candidate
    /// ([`crate::is_hub_candidate`]). Default 4.
    pub candidates: u64,
    /// Exchange rounds, from the first, in which only hub candidates announce (the others look
    /// up only), and nodes whose earlier search found nobody: a small task may have no
    /// candidate. Default 2.
    pub candidate_rounds: u64,
    /// Most peers the cohort view holds. Default 1,024.
    pub max_members: usize,
    /// Most providers of a search the node considers, the nearest first. Default 768
    /// ([`crate::LookupConfig::max_providers`]).
    pub max_providers: usize,
    /// Most pushes a hub takes in a round; further pushers are answered busy. Default 256.
    /// With bounded hubs ([`ExchangeConfig::fanout`]) the fanout bounds them instead.
    pub max_pushers: usize,
    /// Bounded hubs: `Some(m)` and a hub admits at most `m` pushes a round; the next pusher is
    /// told to push to one of them ([`super::Answer::Full`]), which takes it as a child: a
    /// member holding children is a *sub-hub*, which merges them with its own packet when its
    /// level closes ([`Timing::level_permille`]), pushes that merge up in place of its packet,
    /// and passes the merge it gets from above down to its children. A cohort is then a tree of
    /// fan-in `m` and depth log_m of its size, and no node merges more than `m` updates a round
    /// (DESIGN §8). A member keeps pushing to the (sub-)hub whose merge it applied last while
    /// that one serves it. `None` (the default): one hub merges the whole cohort, up to
    /// [`ExchangeConfig::max_pushers`]; the node's wire does not carry the tree's answers yet.
    pub fanout: Option<usize>,
    /// Exchange rounds in a row after which a node that merged with fewer than two others (its
    /// own hub that took fewer than two pushes, or a member that applied its own update) is
    /// *stranded*: its searches learn the 4 nearest peers they find even below the cosine
    /// gate, and it takes the model of a hub its data accepts even when far from its own.
    /// Default 3; 0 turns it off.
    ///
    /// Why: a node alone trains on its own shard, and its sketch drifts from its task's, whose
    /// nodes move together; once under the gate's floor no search brings it back, and a model
    /// far from its own it kept at a distance, so the hub's gate refused its packet again. At
    /// `kindred-sim learn --nodes 1000 --rounds 30 --setting label --fanout 64` 2-5 nodes a
    /// seed (and pairs that found only each other) trained alone all 30 rounds, at 45-65%
    /// against their task's 88-90%. Its data, not its sketch, tells its task from another
    /// (`kindred_distill::check_by_data`), and it asks a few hubs a model each.
    pub stranded_after: u32,
    /// Misses in a row (no answer, busy, no merge by the deadline) after which a member
    /// forgets its hub and moves to the next rank. Default 2.
    pub max_misses: u32,
    /// Rounds a hub stays out of a member's view once it answered nothing (a push or a model
    /// fetch, and the retry), or its model could not be fetched. Default 3. The peers of a
    /// dead hub still name it in their views and headers; forgotten only, it came back with
    /// each of them, and a tree tried it again and again: `kindred-sim cohorts --nodes 10000
    /// --tasks 8 --rounds 20 --churn 0.3 --seed 4` had a whole task out of every tree for 10 of
    /// its last 16 rounds after its root left, 3 with this. Longer costs members whose hub only
    /// lost their messages: at 10 rounds, `learn --nodes 64 --setting label --msg-loss 0.05`
    /// lost 0.22 point against 0.17 at 3 (BENCHMARKS.md, ideas).
    pub dropped_rounds: u64,
    /// Rounds a peer stays banned once its merge failed the node's check, its model failed it
    /// twice, or its data refused the node's. Default 100. One failed merge bans: a liar that
    /// ground a low rank costs each member one round, where banning at a second failure cost
    /// two, as searches bring the liar back (`kindred-sim learn --nodes 64 --setting label
    /// --hostile 0.2 --hostile-low-rank`, seeds 1-3: honest nodes 0.07-0.54 point under the
    /// clean run, against 0.13-1.09). An honest merge fails a check about once in 2,400 (6 of
    /// about 14,600 in clean 64-node runs of iid, label and rotation, seeds 1-3), so a ban that
    /// ends loses no honest peer for good.
    pub ban_rounds: u64,
    /// Exchange round from which merges are checked on the node's data too (a member's first
    /// merge from a hub is not: its data checked the hub's model before it pushed). Default 1.
    pub data_checks_from: u64,
    /// Rounds per rank window: ranks are [`crate::hub_rank_at`] of the round's window, so a
    /// ground identity is a low rank for one window only. Default 100: each change of window
    /// moves most cohorts to a new hub, which each member joins anew (a model fetch, about
    /// 52 KB for the MNIST MLP), so short windows cost bytes.
    pub rank_window: u64,
    /// Redirects ([`super::Answer::NotHub`]) a member follows within one round. Default 2.
    pub max_redirects: u32,
    /// Times a member sends a push or a model fetch again when no answer came in
    /// [`Timing::answer_ms`], per round. Default 1: at 5% message loss it halves the rounds a
    /// member misses its merge (`kindred-sim learn --msg-loss 0.05`).
    pub retries: u32,
    /// Most peers a push's view or a merge's listing names, the lowest ranks first: what a
    /// hub needs to hand over to a lower rank, and a member to fall back to the next. A list
    /// is sent only when it changed since the peer last received one. Default 32.
    pub max_listed: usize,
    /// The gate of search results and of a hub's admission.
    pub gate: CosineGate,
    /// Deadlines inside a round.
    pub timing: Timing,
}

impl ExchangeConfig {
    /// The deepest level of a tree whose sub-hubs still take children: one whose admission
    /// closes after the round's searches end ([`Timing::search_permille`]), so that a member
    /// that searched can still reach it. 3 with the default timing.
    pub fn max_depth(&self) -> u8 {
        let t = &self.timing;
        (0..=u8::MAX)
            .take_while(|&d| t.close_permille(d) > t.search_permille)
            .last()
            .unwrap_or(0)
    }

    /// The semantic keys the hub exchange searches and announces under: 3 bands of 4 bits
    /// (multi-probe keys only while a view is small, [`ExchangeConfig::probes`]). A search only
    /// has to find one peer of the node's cohort (views spread the rest), so a few coarse bands
    /// do, and each band key is one Kademlia walk: the pairwise exchange's 16 bands of 16 bits
    /// and 8 probes are 40 walks a search. The 12 bits move along the SimHash from one round
    /// window to the next ([`crate::KeyConfig::rotating`]): two cohorts of one task whose hubs
    /// differ in those bits met in a later window (`kindred-sim learn --nodes 1000 --setting
    /// label --fanout 64`, seed 1: at the end the worst task's largest tree held 66% of its
    /// nodes with fixed bands, 98.4% with moving ones).
    ///
    /// ```
    /// let keys = kindred_routing::exchange::ExchangeConfig::keys();
    /// assert_eq!((keys.bands(), keys.band_bits()), (3, 4));
    /// ```
    pub fn keys() -> crate::KeyConfig {
        crate::KeyConfig::new(3, 4)
            .map(crate::KeyConfig::rotating)
            .unwrap_or_default()
    }
}

impl Default for ExchangeConfig {
    fn default() -> Self {
        Self {
            local_rounds: 2,
            warmup_searches: 3,
            search_every: 10,
            tree_search_every: 2,
            key_window: 10,
            idle_rounds: 2,
            catch_up_after: 2,
            probes: 3,
            search_probes: 1,
            probe_below: 3,
            candidates: 4,
            candidate_rounds: 2,
            max_members: 1024,
            max_providers: 768,
            max_pushers: 256,
            fanout: None,
            stranded_after: 3,
            max_misses: 2,
            dropped_rounds: 3,
            ban_rounds: 100,
            data_checks_from: 1,
            rank_window: 100,
            max_redirects: 2,
            retries: 1,
            max_listed: 32,
            gate: CosineGate::default(),
            timing: Timing::default(),
        }
    }
}
