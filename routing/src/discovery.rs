//! When a node searches the DHT for partners, and how it keeps them in between.
//!
//! A full round lookup — announce the band keys, look up the band and probe keys, ask every
//! provider for headers — is most of what Kindred puts on the wire: about 780 KB of Kademlia
//! traffic per node per round at 64 nodes (`kindred-sim learn --discovery-every 1`, whose byte
//! model `kindred-sim calibrate` checks against a real swarm), where the 16 packet bodies a
//! node merges are about 55 KB. Yet once training settles, a node's nearest peers stay its
//! nearest peers for many rounds. So the DHT is searched only in **discovery rounds**: the first
//! [`Discovery::warmup_rounds`] rounds, while updates still change direction quickly, and then
//! every [`Discovery::every_rounds`] rounds (to meet peers that joined or moved). In the rounds
//! between, a node **follows** the best peers its last lookup ranked: it asks each for its newest
//! header ([`kindred_proto::rpc::HeaderQuery::Latest`]) and ranks and fetches as usual, with no
//! DHT traffic at all. A followed peer the cosine gate no longer admits is dropped until the
//! next discovery round.
//!
//! A discovery round after a node's warm-up, while it follows peers, is a **refresh**
//! ([`RoundPlan::Refresh`]): the node searches to meet new peers, not to find its nearest ones
//! from nothing, so each hot band is looked up on [`crate::LookupConfig::refresh_shards`] of its
//! shards instead of all of them. A hot band's shards together list every peer announcing under
//! it, so asking all of them costs traffic in proportion to the size of the node's task; a few
//! keep a refresh near the cost of a warm-up search.
//!
//! Key windows follow the same schedule ([`Discovery::window`]): a window opens at each discovery
//! round, so the keys announced then stay valid — and findable by a node that joins mid-window —
//! until the next one. A node announces once per window; later packets of the same window are
//! served under the keys whose band value they still carry, without new DHT records.
//!
//! ```
//! use kindred_routing::{CosineGate, Discovery, RoundWindow};
//!
//! let d = Discovery::default(); // rounds 0, 1, 2, then every 10th
//! assert!(d.is_discovery_round(2) && !d.is_discovery_round(3) && d.is_discovery_round(10));
//! assert_eq!(d.window(7), RoundWindow(2));
//! assert_eq!(d.window(15), RoundWindow(10));
//! // The best peers the cosine gate admits, at most `follow` of them, are followed.
//! let gate = CosineGate { min: 0.5, max_distance_ratio: 3.5 };
//! let next = d.next_follow([("a", 0.9), ("b", 0.4), ("c", 0.7), ("d", 0.6)], gate);
//! assert_eq!(next, vec!["a", "c"]);
//! ```
//!
//! [`Follower`] is one node's side of the schedule, a sans-IO state machine: the node
//! (`kindred-node`) and every virtual node of the simulator (`kindred-sim learn`) ask it each
//! round whether to search or whom to ask, and tell it what the round's lookup ranked.

use crate::config::CosineGate;
use crate::keys::RoundWindow;

/// The discovery schedule and the number of peers followed between discovery rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Discovery {
    /// Rounds from round 0 that are all discovery rounds. Default 3: an update's direction
    /// settles over the first rounds, and a partner found in round 0 may belong to another task
    /// by round 3 (`kindred-sim learn --setting rotation`: merge purity 0.93 in rounds 3-9 with
    /// one discovery round, 1.00 with three).
    pub warmup_rounds: u64,
    /// After the warm-up, a discovery round every this many rounds (round numbers divisible by
    /// it). Default 10; 1 searches the DHT every round.
    pub every_rounds: u64,
    /// Peers followed between discovery rounds: the best this many of the last lookup's
    /// candidates the cosine gate admits ([`CosineGate`]). Default 32, twice the default
    /// `top_m`, so the bodies fetched can still change as peers drift.
    pub follow: usize,
}

impl Default for Discovery {
    fn default() -> Self {
        Self {
            warmup_rounds: 3,
            every_rounds: 10,
            follow: 32,
        }
    }
}

impl Discovery {
    /// Search the DHT every round (keys change every round, nobody is followed).
    pub const EVERY_ROUND: Self = Self {
        warmup_rounds: 0,
        every_rounds: 1,
        follow: 0,
    };

    /// Whether `round` is a discovery round: announce, and search the DHT.
    pub fn is_discovery_round(&self, round: u64) -> bool {
        round < self.warmup_rounds
            || self.every_rounds <= 1
            || round.is_multiple_of(self.every_rounds)
    }

    /// The key window of `round`: the latest discovery round at or before it.
    pub fn window(&self, round: u64) -> RoundWindow {
        if self.is_discovery_round(round) {
            return RoundWindow(round);
        }
        let last_periodic = round - round % self.every_rounds;
        RoundWindow(last_periodic.max(self.warmup_rounds.saturating_sub(1)))
    }

    /// Whether a node searches the DHT in `round`, having run `rounds_run` rounds so far and
    /// following `followed` peers: in discovery rounds, in its own first
    /// [`Discovery::warmup_rounds`] rounds (a node that joins a running swarm warms up too), and
    /// whenever it has nobody to follow.
    pub fn searches(&self, round: u64, rounds_run: u64, followed: usize) -> bool {
        followed == 0
            || self.follow == 0
            || rounds_run < self.warmup_rounds
            || self.is_discovery_round(round)
    }

    /// The peers to follow after a lookup: the best [`Discovery::follow`] of `ranked`
    /// (`(peer, sketch cosine)`, in any order) that `gate` admits, best first, each once.
    pub fn next_follow<P: PartialEq + Clone>(
        &self,
        ranked: impl IntoIterator<Item = (P, f32)>,
        gate: CosineGate,
    ) -> Vec<P> {
        let mut above: Vec<(P, f32)> = ranked.into_iter().collect();
        above.sort_by(|a, b| b.1.total_cmp(&a.1));
        gate.retain_admitted(&mut above, |a| a.1);
        let mut out: Vec<P> = Vec::with_capacity(self.follow.min(above.len()));
        for (p, _) in above {
            if out.len() >= self.follow {
                break;
            }
            if !out.contains(&p) {
                out.push(p);
            }
        }
        out
    }
}

/// What a node does for partners in a round ([`Follower::start_round`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundPlan<'a, P> {
    /// Search the DHT: announce-window keys, providers, their headers.
    Search,
    /// Search the DHT to meet new peers while following some: a discovery round after the
    /// node's warm-up. Hot bands are looked up on a few of their shards
    /// ([`crate::PartnerQuery::refresh`]).
    Refresh,
    /// Ask these followed peers for their newest headers; no DHT traffic.
    Follow(&'a [P]),
}

/// One node's side of the [`Discovery`] schedule: the peers it follows and the rounds it has run.
///
/// The node and the simulator drive the same state machine, so a simulated swarm searches and
/// follows exactly when real nodes do. Call [`Follower::start_round`] once per round before the
/// partner lookup, and [`Follower::lookup_done`] with the candidates a lookup ranked (a failed
/// lookup reports nothing: the follow list is kept).
///
/// ```
/// use kindred_routing::{CosineGate, Discovery, Follower, RoundPlan};
///
/// let mut f = Follower::new(Discovery::default(), CosineGate::default());
/// for round in 0..3 {
///     // Warm-up: the first three rounds search.
///     assert_eq!(f.start_round(round), RoundPlan::Search);
///     f.lookup_done([("a", 0.9), ("b", 0.3), ("c", 0.88), ("d", 0.55)]);
/// }
/// // Then the best peers the gate admits are followed until round 10.
/// assert_eq!(f.start_round(3), RoundPlan::Follow(&["a", "c"][..]));
/// // A followed peer that fell behind is dropped.
/// f.lookup_done([("a", 0.9), ("c", 0.2)]);
/// assert_eq!(f.start_round(4), RoundPlan::Follow(&["a"][..]));
/// for round in 5..10 {
///     f.start_round(round);
/// }
/// // Round 10 searches again, to meet new peers.
/// assert_eq!(f.start_round(10), RoundPlan::Refresh);
/// ```
#[derive(Debug, Clone)]
pub struct Follower<P> {
    discovery: Discovery,
    gate: CosineGate,
    /// The best peers of the last lookup.
    peers: Vec<P>,
    /// Rounds started so far.
    rounds_run: u64,
}

impl<P: PartialEq + Clone> Follower<P> {
    /// A node that has run no round yet, following the candidates `gate` admits (the
    /// lookup's gate, [`crate::LookupConfig::gate`]).
    pub fn new(discovery: Discovery, gate: CosineGate) -> Self {
        Self {
            discovery,
            gate,
            peers: Vec::new(),
            rounds_run: 0,
        }
    }

    /// Start `round`: whether to search the DHT or whom to follow ([`Discovery::searches`]). A
    /// search by a node past its warm-up that follows peers is a [`RoundPlan::Refresh`].
    pub fn start_round(&mut self, round: u64) -> RoundPlan<'_, P> {
        let search = self
            .discovery
            .searches(round, self.rounds_run, self.peers.len());
        let warmed_up = self.rounds_run >= self.discovery.warmup_rounds;
        self.rounds_run += 1;
        if !search {
            RoundPlan::Follow(&self.peers)
        } else if warmed_up && !self.peers.is_empty() {
            RoundPlan::Refresh
        } else {
            RoundPlan::Search
        }
    }

    /// The round's lookup ranked these candidates (`(peer, sketch cosine)`, in any order):
    /// follow the best of them ([`Discovery::next_follow`]).
    pub fn lookup_done(&mut self, ranked: impl IntoIterator<Item = (P, f32)>) {
        self.peers = self.discovery.next_follow(ranked, self.gate);
    }

    /// The peers followed now, best first.
    pub fn peers(&self) -> &[P] {
        &self.peers
    }

    /// Rounds started so far.
    pub fn rounds_run(&self) -> u64 {
        self.rounds_run
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_open_at_discovery_rounds() {
        let d = Discovery::default();
        let discovery: Vec<u64> = (0..35).filter(|&r| d.is_discovery_round(r)).collect();
        assert_eq!(discovery, vec![0, 1, 2, 10, 20, 30]);
        for r in 0..35u64 {
            let w = d.window(r);
            assert!(w.0 <= r && d.is_discovery_round(w.0), "round {r} → {w:?}");
            // No discovery round lies strictly between the window start and the round.
            assert!(
                ((w.0 + 1)..=r).all(|x| !d.is_discovery_round(x)),
                "round {r}"
            );
        }
        // A warm-up longer than the period.
        let long = Discovery {
            warmup_rounds: 12,
            every_rounds: 10,
            follow: 4,
        };
        assert_eq!(long.window(13), RoundWindow(11));
        assert_eq!(long.window(20), RoundWindow(20));
        // Every round: windows are rounds.
        let every = Discovery::EVERY_ROUND;
        assert!((0..20).all(|r| every.is_discovery_round(r) && every.window(r) == RoundWindow(r)));
        // A zero period never divides by zero.
        let zero = Discovery {
            every_rounds: 0,
            ..Discovery::default()
        };
        assert_eq!(zero.window(17), RoundWindow(17));
    }

    #[test]
    fn a_node_with_nobody_to_follow_searches() {
        let d = Discovery::default();
        assert!(d.searches(5, 5, 0));
        assert!(!d.searches(5, 5, 3));
        assert!(d.searches(10, 10, 3));
        assert!(Discovery::EVERY_ROUND.searches(5, 5, 3));
        // A node that joins at round 1,000,005 warms up for its own first rounds.
        assert!(d.searches(1_000_005, 2, 3));
        assert!(!d.searches(1_000_005, 3, 3));
    }

    #[test]
    fn the_best_peers_the_gate_admits_are_followed_once() {
        let d = Discovery {
            follow: 3,
            ..Discovery::default()
        };
        let ranked = [(1, 0.2), (2, 0.8), (3, 0.9), (2, 0.85), (4, 0.6), (5, 0.55)];
        let gate = |min, max_distance_ratio| CosineGate {
            min,
            max_distance_ratio,
        };
        assert_eq!(d.next_follow(ranked, gate(0.5, 10.0)), vec![3, 2, 4]);
        // Within 1.6 times the best's distance (0.1): peer 2 once, at its better cosine.
        assert_eq!(d.next_follow(ranked, gate(0.5, 1.6)), vec![3, 2]);
        assert!(d.next_follow(ranked, gate(0.95, 10.0)).is_empty());
        assert!(
            Discovery::EVERY_ROUND
                .next_follow(ranked, gate(0.0, 10.0))
                .is_empty()
        );
    }

    #[test]
    fn a_follower_searches_in_warm_up_and_discovery_rounds_and_when_alone() {
        let mut f = Follower::new(Discovery::default(), CosineGate::default());
        let (mut searched, mut refreshed) = (Vec::new(), Vec::new());
        for round in 0..25u64 {
            match f.start_round(round) {
                RoundPlan::Search => searched.push(round),
                RoundPlan::Refresh => refreshed.push(round),
                RoundPlan::Follow(_) => {}
            }
            // Nobody qualifies in round 12: the node searches in round 13 too, in full.
            let c = if round == 12 { 0.1 } else { 0.8 };
            f.lookup_done([(1u32, c), (2, c)]);
        }
        assert_eq!(searched, vec![0, 1, 2, 13]);
        assert_eq!(refreshed, vec![10, 20]);
        assert_eq!(f.rounds_run(), 25);
        assert_eq!(f.peers(), &[1, 2]);
        // A node that joins late warms up for its own first rounds.
        let mut late = Follower::new(Discovery::default(), CosineGate::default());
        for round in 1_000_005..1_000_008u64 {
            assert_eq!(late.start_round(round), RoundPlan::Search);
            late.lookup_done([(7u32, 0.9)]);
        }
        assert_eq!(late.start_round(1_000_008), RoundPlan::Follow(&[7][..]));
    }
}
