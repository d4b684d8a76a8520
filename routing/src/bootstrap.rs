//! Which Kademlia bootstraps run to the end.
//!
//! libp2p-kad 0.49 starts a bootstrap 500 ms after any peer enters a routing table of fewer than
//! 20 peers, and the throttle is not configurable from outside the crate. A bootstrap is a lookup
//! of the node's own key followed by a lookup in every bucket farther than the nearest peer's,
//! and every `FIND_NODE` answer lists up to 20 peers. In a young or small swarm (under 21 nodes
//! a table never leaves that state) each new peer starts another one: on the 16-node demo that
//! was 85-88% of a node's warm-up bytes.
//!
//! A node joins with one lookup of its own id for `k` peers ([`crate::RoutingHandle::bootstrap`]),
//! which restarts the throttle. Of libp2p's own bootstraps the driver lets one per
//! [`crate::KadConfig::bootstrap_throttle`] run to the end (the periodic one, every 5 minutes,
//! always does) and ends the others as soon as it sees them, after their first `α` requests.
//! Lookups of semantic keys fill routing tables as they go, so no peer is lost to the cut; what
//! a table lacks in between is found by the next full bootstrap.
//!
//! The policy is a plain state machine over query ids and instants, so it is tested without a
//! swarm.

use std::collections::HashSet;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// What to do with a bootstrap that libp2p started on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Let it run to the end.
    Run,
    /// End it now.
    Cut,
}

/// Decides, per bootstrap query, whether it runs (see the module docs).
#[derive(Debug)]
pub(crate) struct BootstrapGovernor<Q> {
    throttle: Duration,
    last_full: Option<Instant>,
    running: HashSet<Q>,
    cut: HashSet<Q>,
    cut_total: u64,
}

impl<Q: Copy + Eq + Hash> BootstrapGovernor<Q> {
    /// At most one automatic bootstrap runs per `throttle`.
    pub(crate) fn new(throttle: Duration) -> Self {
        Self {
            throttle,
            last_full: None,
            running: HashSet::new(),
            cut: HashSet::new(),
            cut_total: 0,
        }
    }

    /// The node's join ([`crate::RoutingHandle::bootstrap`]) started: it counts as the latest
    /// full bootstrap. (It is a lookup of the node's own id, not one of libp2p's bootstraps, so
    /// it never reaches [`BootstrapGovernor::on_seen`].)
    pub(crate) fn on_join(&mut self, now: Instant) {
        self.last_full = Some(now);
    }

    /// A bootstrap query is in libp2p's pool (any of its steps); what to do with it.
    pub(crate) fn on_seen(&mut self, id: Q, now: Instant) -> Verdict {
        if self.running.contains(&id) {
            return Verdict::Run;
        }
        if self.cut.contains(&id) {
            return Verdict::Cut;
        }
        let due = self
            .last_full
            .is_none_or(|t| now.saturating_duration_since(t) >= self.throttle);
        if due {
            self.running.insert(id);
            self.last_full = Some(now);
            Verdict::Run
        } else {
            self.cut.insert(id);
            self.cut_total += 1;
            Verdict::Cut
        }
    }

    /// The query's last step finished.
    pub(crate) fn on_done(&mut self, id: Q) {
        self.running.remove(&id);
        self.cut.remove(&id);
    }

    /// Automatic bootstraps ended early so far.
    pub(crate) fn cut_total(&self) -> u64 {
        self.cut_total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_automatic_bootstrap_runs_per_throttle_and_the_others_are_cut() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut g = BootstrapGovernor::new(Duration::from_secs(60));
        assert_eq!(g.on_seen(1, t0), Verdict::Run, "the first one runs");
        assert_eq!(g.on_seen(2, t0 + s), Verdict::Cut);
        assert_eq!(
            g.on_seen(1, t0 + 2 * s),
            Verdict::Run,
            "later steps keep running"
        );
        assert_eq!(
            g.on_seen(2, t0 + 61 * s),
            Verdict::Cut,
            "a cut chain stays cut"
        );
        assert_eq!(
            g.on_seen(3, t0 + 61 * s),
            Verdict::Run,
            "the throttle has passed"
        );
        assert_eq!(g.cut_total(), 1);
        g.on_done(2);
        assert_eq!(g.on_seen(4, t0 + 62 * s), Verdict::Cut);
        assert_eq!(g.cut_total(), 2);
    }

    #[test]
    fn a_join_restarts_the_throttle() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut g = BootstrapGovernor::new(Duration::from_secs(60));
        g.on_join(t0 + 100 * s);
        assert_eq!(g.on_seen(8, t0 + 130 * s), Verdict::Cut);
        assert_eq!(g.on_seen(9, t0 + 160 * s), Verdict::Run);
        assert_eq!(g.cut_total(), 1);
    }
}
