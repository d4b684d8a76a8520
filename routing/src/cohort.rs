//! Who aggregates a cluster's updates: one node's view of its cohort, for the hub exchange.
//!
//! Merging partners' bodies pairwise makes every node fetch one body per partner: at 16
//! partners that is about 16 compressed updates per node per round, and each node still
//! averages only a sixteenth of its task's updates (`kindred-sim learn --setting iid`: 90.1%
//! against 91.4% for the all-reduce, at 1.5x fewer bytes). A **hub exchange** aggregates
//! instead: every member of a cohort pushes its packet to one member, the hub, which merges
//! them robustly (`kindred_distill::synthesize`), distills the merged update with its own
//! error feedback and sends it back. Each member moves two compressed updates a round, whatever
//! the cohort's size, and all members apply the same merged update, so their models do not
//! drift apart.
//!
//! No coordinator picks the hub. Each member holds a [`Cohort`]: the peers it knows to be of its
//! task (found through the semantic keys, admitted by the cosine gate, or listed by its hub), each
//! with a **rank** derived from its identity ([`hub_rank`]). A member's hub is the
//! lowest-ranked peer it knows, itself included, and the hub's answer lists the hub's own view
//! (less the lower ranks it has not joined yet, [`Cohort::listed`]), so the views of a connected
//! cohort grow to the same set within a few rounds and its members agree on the hub. A hub whose
//! merged update (or model) fails a member's check is banned by that member ([`Cohort::ban`]),
//! which moves on to the next rank; its driver lifts the ban after a while ([`Cohort::unban`],
//! the exchange's `ban_rounds`). A hub admits pushers against the nearest of them and its [`Cohort::anchor`], the
//! cosine of its own task's nearest peer at its last merge, so a hub left by its own task's
//! members is not taken over by another task's.
//!
//! ```
//! use kindred_routing::cohort::Cohort;
//!
//! let mut view = Cohort::new("me", 50, 8);
//! assert_eq!(view.hub(), "me"); // alone: its own hub
//! view.learn([("a", 70), ("b", 20)]);
//! assert_eq!(view.hub(), "b"); // the lowest rank
//! view.ban(&"b"); // its merged update failed the check
//! assert_eq!(view.hub(), "me");
//! view.learn([("b", 20)]); // a banned peer is not learned again
//! assert_eq!(view.hub(), "me");
//! view.unban(&"b");
//! view.learn([("b", 20)]);
//! assert_eq!(view.hub(), "b");
//! ```

/// The rank of a peer identity (its encoded bytes) in the hub order: the first 8 bytes of its
/// blake3 hash. Every member computes the same rank for the same peer.
///
/// An identity's fixed rank can be ground: mint keys until one ranks below every peer, and it
/// is the hub of every cohort that admits it. The exchange ranks by [`hub_rank_at`] instead.
pub fn hub_rank(identity: &[u8]) -> u64 {
    let h = blake3::hash(identity);
    let mut word = [0u8; 8];
    word.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(word)
}

/// The rank of a peer identity in the hub order of rank window `window`
/// (`kindred_routing::exchange::ExchangeConfig::rank_window` rounds each): the first 8 bytes of
/// a blake3 hash, in its own key-derivation context, of the window and the identity.
///
/// What it protects against: an identity ground once for a low rank holds it for one window
/// only, and ranks in other windows are independent of it, so one lucky key does not make a
/// permanent hub. What it does not: the window number is public, so a patient attacker grinds
/// a key per window ahead of time and runs it when its window comes. No value in a swarm
/// without a coordinator is both agreed by every member and unknown to an attacker in
/// advance; what bounds the damage of a hostile hub are the members' checks of every merge
/// and model (direction, norm, their own data) and their bans (`kindred-sim learn --hostile
/// 0.2 --hostile-low-rank`, where attackers rank lowest in every window).
///
/// ```
/// use kindred_routing::hub_rank_at;
///
/// let id = b"some peer id";
/// assert_eq!(hub_rank_at(id, 3), hub_rank_at(id, 3));
/// assert_ne!(hub_rank_at(id, 3), hub_rank_at(id, 4));
/// ```
pub fn hub_rank_at(identity: &[u8], window: u64) -> u64 {
    let mut h = blake3::Hasher::new_derive_key("kindred 2026-11-25 hub rank by window");
    h.update(&window.to_le_bytes());
    h.update(identity);
    let mut word = [0u8; 8];
    word.copy_from_slice(&h.finalize().as_bytes()[..8]);
    u64::from_le_bytes(word)
}

/// The rank of a peer that others cannot dial (behind NAT, reached only through a relay):
/// above every rank a dialable peer is likely to have, so it heads a cohort only if no member
/// can be dialed. A hub serves every member's push, so it must accept connections; a member
/// only dials out. The order among such peers is kept (reversed, the same on every node).
///
/// ```
/// use kindred_routing::cohort::relay_only_rank;
///
/// assert!(relay_only_rank(0) > u64::MAX - u64::MAX / 256);
/// assert!(relay_only_rank(1 << 20) < relay_only_rank(0));
/// ```
pub fn relay_only_rank(rank: u64) -> u64 {
    u64::MAX - (rank >> 8)
}

/// Whether a node of rank `rank` is a **hub candidate**: one node in `one_in`, the lowest
/// ranks. A member pushes to the lowest-ranked peer it knows, so a node of high rank ends as a
/// member and is found through its hub (pushes and answers list views), never through the DHT:
/// while cohorts form, only candidates need to announce their keys, and the others only look
/// them up. That spares most of the first rounds' announcements, each a Kademlia walk: in
/// `kindred-sim learn --setting iid` (64 nodes) announcing was 61% of round 0's 163 KB of DHT
/// traffic per node. `one_in` of 0 or 1 makes every node a candidate.
///
/// ```
/// use kindred_routing::cohort::is_hub_candidate;
///
/// assert!(is_hub_candidate(0, 4));
/// assert!(is_hub_candidate(u64::MAX / 4, 4));
/// assert!(!is_hub_candidate(u64::MAX / 4 + 1, 4));
/// assert!(is_hub_candidate(u64::MAX, 1));
/// ```
pub fn is_hub_candidate(rank: u64, one_in: u64) -> bool {
    rank <= u64::MAX / one_in.max(1)
}

/// One node's view of its cohort: the peers it knows, ranked, and those it banned.
///
/// A sans-IO state machine: the node and the simulator's virtual nodes tell it whom they found
/// or were told about, and ask it whom to push to.
#[derive(Debug, Clone)]
pub struct Cohort<P> {
    own: P,
    own_rank: u64,
    /// Known peers, sorted by `(rank, peer)`.
    members: Vec<(u64, P)>,
    banned: Vec<P>,
    max_members: usize,
    /// Sketch cosine of the nearest peer of the last merge the node took part in.
    anchor: Option<f32>,
}

impl<P: Clone + Ord> Cohort<P> {
    /// A view holding only the node itself (`own` at `own_rank`), keeping at most `max_members`
    /// peers (the lowest ranks win: those are the hubs).
    pub fn new(own: P, own_rank: u64, max_members: usize) -> Self {
        Self {
            own,
            own_rank,
            members: Vec::new(),
            banned: Vec::new(),
            max_members,
            anchor: None,
        }
    }

    /// Add `peers` (peer, rank), skipping the node itself, banned peers and peers already
    /// known. Returns how many new peers the view holds afterwards.
    ///
    /// A peer's rank must be a function of the peer ([`hub_rank`] of its identity, computed by
    /// the caller, never taken from the network): the view finds a peer by `(rank, peer)`.
    pub fn learn(&mut self, peers: impl IntoIterator<Item = (P, u64)>) -> usize {
        let mut added = Vec::new();
        for (peer, rank) in peers {
            if peer == self.own || self.banned.contains(&peer) {
                continue;
            }
            let entry = (rank, peer);
            if let Err(at) = self.members.binary_search(&entry)
                && at < self.max_members
            {
                self.members.insert(at, entry.clone());
                self.members.truncate(self.max_members);
                added.push(entry);
            }
        }
        added
            .iter()
            .filter(|e| self.members.binary_search(e).is_ok())
            .count()
    }

    /// The hub this node pushes to: the lowest-ranked of its known peers and itself.
    pub fn hub(&self) -> P {
        match self.members.first() {
            Some((rank, peer)) if (*rank, peer) < (self.own_rank, &self.own) => peer.clone(),
            _ => self.own.clone(),
        }
    }

    /// The known peers, lowest rank first.
    pub fn members(&self) -> impl Iterator<Item = &P> {
        self.members.iter().map(|(_, p)| p)
    }

    /// Rank the node and every known peer anew (a new rank window, [`hub_rank_at`]): the
    /// lowest ranks are kept if the view is full.
    pub fn rerank(&mut self, rank: impl Fn(&P) -> u64) {
        self.own_rank = rank(&self.own);
        for (r, p) in &mut self.members {
            *r = rank(p);
        }
        self.members.sort();
        self.members.truncate(self.max_members);
    }

    /// The known peers with their ranks, lowest rank first (what a hub lists in its answer).
    pub fn ranked(&self) -> &[(u64, P)] {
        &self.members
    }

    /// What the node lists in its answer as a hub, with ranks: itself and its known peers, less
    /// those ranked below it other than `joined`, the hub whose merge it took last (if any).
    ///
    /// Why: a member pushes to the lowest rank it knows, so a lower-ranked peer that the hub
    /// lists becomes the members' hub. The hub has not yet seen whether that peer takes it: one
    /// found by a search may be another task's hub, which refuses it. Listed anyway, it sent a
    /// whole cohort to a hub that refused all of them, a round of merges lost each time, and
    /// a ban after the second time (`kindred-sim learn --setting rotation --seed 1`, rounds 11
    /// and 21: 30 members). So members learn a lower-ranked peer from their hub only once the
    /// hub has joined it.
    ///
    /// ```
    /// use kindred_routing::cohort::Cohort;
    ///
    /// let mut view = Cohort::new("hub", 50, 8);
    /// view.learn([("member", 70), ("found", 20)]);
    /// let listed = |joined| view.listed(joined).into_iter().map(|(p, _)| p).collect::<Vec<_>>();
    /// assert_eq!(listed(None), ["hub", "member"]); // "found" has not taken the hub yet
    /// assert_eq!(listed(Some(&"found")), ["found", "hub", "member"]);
    /// ```
    pub fn listed(&self, joined: Option<&P>) -> Vec<(P, u64)> {
        // `members` is sorted by `(rank, peer)`: one binary search splits it around the node
        // (`partition_point` is at most `len`, so the split cannot panic).
        let own = (self.own_rank, &self.own);
        let (below, above) = self.members.split_at(
            self.members
                .partition_point(|(rank, peer)| (*rank, peer) < own),
        );
        let entry = |(rank, peer): &(u64, P)| (peer.clone(), *rank);
        below
            .iter()
            .filter(|(_, peer)| Some(peer) == joined)
            .map(entry)
            .chain(std::iter::once((self.own.clone(), self.own_rank)))
            .chain(above.iter().map(entry))
            .collect()
    }

    /// Number of known peers.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether no peer is known: the node is alone, and its own hub.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Drop `peer` and learn it no more until [`Cohort::unban`]: its merged update or its
    /// model failed the node's check.
    pub fn ban(&mut self, peer: &P) {
        self.forget(peer);
        if *peer != self.own && !self.banned.contains(peer) {
            self.banned.push(peer.clone());
        }
    }

    /// Lift `peer`'s ban: it may be learned again.
    pub fn unban(&mut self, peer: &P) {
        self.banned.retain(|p| p != peer);
    }

    /// The node merged with a peer at sketch cosine `cosine`, the nearest of that merge: as a
    /// hub, its nearest admitted member; as a member, its hub. That is the node's reference for
    /// its own task ([`Cohort::anchor`]).
    pub fn merged(&mut self, cosine: f32) {
        if cosine.is_finite() {
            self.anchor = Some(cosine);
        }
    }

    /// The sketch cosine at which the node last merged with a peer of its task
    /// ([`Cohort::merged`]), or −∞ before its first merge. A hub's gate measures its pushers
    /// against the nearest of them *and* this ([`crate::CosineGate::retain_admitted_near`]):
    /// measured against each other only, the nodes of another task that push to a hub whose own
    /// members have gone (at sketch cosine 0.70-0.78 with it, against 0.96-0.99 within a task,
    /// `kindred-sim learn --setting rotation`) admitted one another, and their merge went to
    /// every one of them.
    ///
    /// ```
    /// use kindred_routing::cohort::Cohort;
    ///
    /// let mut view = Cohort::new("me", 50, 8);
    /// assert_eq!(view.anchor(), f32::NEG_INFINITY);
    /// view.merged(0.97);
    /// assert_eq!(view.anchor(), 0.97);
    /// ```
    pub fn anchor(&self) -> f32 {
        self.anchor.unwrap_or(f32::NEG_INFINITY)
    }

    /// Drop `peer` until it is learned again: it refused the node (another task, or its own
    /// view lists the node as no member).
    pub fn forget(&mut self, peer: &P) {
        self.members.retain(|(_, p)| p != peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_anchor_is_the_last_merge_and_ignores_non_finite_cosines() {
        let mut view = Cohort::new(0u32, 50, 8);
        view.merged(0.9);
        view.merged(0.97);
        view.merged(f32::NAN);
        view.merged(f32::NEG_INFINITY);
        assert_eq!(view.anchor(), 0.97);
        // Banning or forgetting peers leaves it.
        view.learn([(1, 10)]);
        view.ban(&1);
        assert_eq!(view.anchor(), 0.97);
    }

    #[test]
    fn a_hub_lists_lower_ranks_only_once_it_has_joined_one() {
        let mut view = Cohort::new(5u32, 50, 8);
        view.learn([(1, 10), (2, 20), (6, 60), (7, 70)]);
        let peers = |joined| -> Vec<u32> { view.listed(joined).into_iter().map(|e| e.0).collect() };
        assert_eq!(peers(None), [5, 6, 7]);
        assert_eq!(peers(Some(&2)), [2, 5, 6, 7]);
        // A joined hub the view no longer holds (forgotten, banned) is not listed.
        assert_eq!(peers(Some(&9)), [5, 6, 7]);
        // A joined peer ranked above the node is listed once, as any peer above it.
        assert_eq!(peers(Some(&6)), [5, 6, 7]);
        // Ranks come with the peers; ties on rank are ordered by peer, as in `hub`.
        assert_eq!(view.listed(None)[0], (5, 50));
        let mut tie = Cohort::new(5u32, 50, 8);
        tie.learn([(4, 50), (6, 50)]);
        assert_eq!(tie.hub(), 4);
        let listed: Vec<u32> = tie.listed(None).into_iter().map(|e| e.0).collect();
        assert_eq!(listed, [5, 6]);
    }

    #[test]
    fn ranks_are_stable_and_spread() {
        assert_eq!(hub_rank(b"peer"), hub_rank(b"peer"));
        assert_ne!(hub_rank(b"peer-a"), hub_rank(b"peer-b"));
    }

    #[test]
    fn the_view_is_bounded_and_keeps_the_lowest_ranks() {
        let mut c = Cohort::new(0u32, u64::MAX, 3);
        assert_eq!(c.learn((1..=10).map(|p| (p, 100 - u64::from(p)))), 3);
        let kept: Vec<u32> = c.members().copied().collect();
        assert_eq!(kept, vec![10, 9, 8]);
        assert_eq!(c.hub(), 10);
        assert_eq!(c.learn([(10, 90)]), 0, "known");
        assert_eq!(c.learn([(0, 0)]), 0, "itself");
        c.forget(&10);
        assert_eq!(c.hub(), 9);
        assert_eq!(c.learn([(10, 90)]), 1, "a forgotten peer can be relearned");
        c.ban(&10);
        assert_eq!(c.learn([(10, 90)]), 0, "a banned peer is not relearned");
        assert_eq!(c.len(), 2);
        c.unban(&10);
        assert_eq!(c.learn([(10, 90)]), 1, "until its ban is lifted");
    }

    proptest! {
        /// Members that have learned the same peers agree on the hub, whatever the order.
        #[test]
        fn views_of_the_same_peers_agree_on_the_hub(
            ranks in proptest::collection::vec(any::<u64>(), 2..40),
            split in any::<prop::sample::Index>(),
        ) {
            let n = ranks.len() as u32;
            let peers: Vec<(u32, u64)> = (0..n).zip(ranks.iter().copied()).collect();
            let at = split.index(peers.len());
            let mut hubs = Vec::new();
            for own in 0..n {
                let mut c = Cohort::new(own, ranks[own as usize], 1024);
                c.learn(peers[at..].iter().copied());
                c.learn(peers[..at].iter().rev().copied());
                hubs.push(c.hub());
            }
            let best = peers.iter().min_by_key(|(p, r)| (*r, *p)).map(|(p, _)| *p);
            prop_assert!(hubs.iter().all(|h| Some(*h) == best));
        }
    }
}
