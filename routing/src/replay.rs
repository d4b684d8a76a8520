//! Replay protection: `(sender, model)` high-water marks on the round number.
//!
//! A signed packet stays valid forever, so anyone can re-serve an old one. A node therefore keeps,
//! per sender and model, the highest round it has accepted and which packet that was, and drops:
//! - a packet for an older round (**stale**): an old update must not be merged again;
//! - the very packet it already holds (**duplicate**): it is already indexed;
//! - a *different* packet for the same round (**conflict**): a sender signs one update per
//!   round; a second one is either a replay of a re-sealed update or equivocation.
//!
//! The table is bounded; when full, the entry with the oldest round is forgotten, which at worst
//! lets a very old packet of a long-silent sender through once, to be dropped again by the
//! round-window check. The node persists marks across restarts through [`ReplayGuard::marks`]
//! and [`ReplayGuard::restore`].
//!
//! ```
//! use kindred_proto::{ModelId, PacketId};
//! use kindred_routing::replay::{Admission, ReplayGuard, ReplayReject};
//!
//! let mut guard = ReplayGuard::new(1024);
//! let m = ModelId([0; 32]);
//! assert_eq!(guard.admit("alice", m, 5, PacketId([1; 32])), Ok(Admission::New));
//! assert_eq!(guard.admit("alice", m, 5, PacketId([1; 32])), Ok(Admission::Duplicate));
//! assert_eq!(guard.admit("alice", m, 4, PacketId([2; 32])), Err(ReplayReject::Stale { round: 4, high_water: 5 }));
//! assert_eq!(guard.admit("alice", m, 5, PacketId([3; 32])), Err(ReplayReject::Conflict { round: 5 }));
//! assert_eq!(guard.admit("alice", m, 6, PacketId([4; 32])), Ok(Admission::New));
//! ```

use std::collections::HashMap;
use std::hash::Hash;

use kindred_proto::{ModelId, PacketId};

/// A packet that passed the replay check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// First packet seen for this round (or a newer round): recorded as the new high-water mark.
    New,
    /// Exactly the packet already recorded for this round: nothing new to index.
    Duplicate,
}

/// A packet dropped by the replay check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayReject {
    /// The sender already had a packet for a later round accepted.
    #[error("round {round} is older than the sender's high-water mark {high_water}")]
    Stale {
        /// The packet's round.
        round: u64,
        /// The highest round accepted from this sender for this model.
        high_water: u64,
    },
    /// A different packet for the round already recorded.
    #[error("a different packet for round {round} was already accepted from this sender")]
    Conflict {
        /// The round.
        round: u64,
    },
}

impl ReplayReject {
    /// A short, stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Stale { .. } => "stale_round",
            Self::Conflict { .. } => "round_conflict",
        }
    }
}

/// High-water marks per `(sender, model)`.
#[derive(Debug, Clone)]
pub struct ReplayGuard<P> {
    marks: HashMap<(P, ModelId), (u64, PacketId)>,
    capacity: usize,
}

impl<P: Hash + Eq + Clone> ReplayGuard<P> {
    /// An empty guard holding at most `capacity` marks.
    pub fn new(capacity: usize) -> Self {
        Self {
            marks: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// Check a verified packet and record it when it is new.
    ///
    /// # Errors
    /// [`ReplayReject`] when the packet is stale or conflicts with the recorded one.
    pub fn admit(
        &mut self,
        sender: P,
        model: ModelId,
        round: u64,
        id: PacketId,
    ) -> Result<Admission, ReplayReject> {
        let key = (sender, model);
        if let Some(&(high_water, held)) = self.marks.get(&key) {
            if round < high_water {
                return Err(ReplayReject::Stale { round, high_water });
            }
            if round == high_water {
                return if held == id {
                    Ok(Admission::Duplicate)
                } else {
                    Err(ReplayReject::Conflict { round })
                };
            }
        } else if self.marks.len() >= self.capacity {
            self.evict_oldest();
        }
        self.marks.insert(key, (round, id));
        Ok(Admission::New)
    }

    fn evict_oldest(&mut self) {
        let oldest = self
            .marks
            .iter()
            .min_by_key(|(_, (round, _))| *round)
            .map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            self.marks.remove(&k);
        }
    }

    /// The recorded high-water mark of `(sender, model)`.
    pub fn high_water(&self, sender: &P, model: &ModelId) -> Option<(u64, PacketId)> {
        self.marks.get(&(sender.clone(), *model)).copied()
    }

    /// Every mark, for persisting.
    pub fn marks(&self) -> impl Iterator<Item = (&P, &ModelId, u64, PacketId)> {
        self.marks
            .iter()
            .map(|((p, m), (round, id))| (p, m, *round, *id))
    }

    /// Restore a persisted mark (keeps the higher round when one is already present).
    pub fn restore(&mut self, sender: P, model: ModelId, round: u64, id: PacketId) {
        let key = (sender, model);
        match self.marks.get(&key) {
            Some(&(r, _)) if r >= round => {}
            existing => {
                if existing.is_none() && self.marks.len() >= self.capacity {
                    self.evict_oldest();
                }
                self.marks.insert(key, (round, id));
            }
        }
    }

    /// Number of marks held.
    pub fn len(&self) -> usize {
        self.marks.len()
    }

    /// Whether no mark is held.
    pub fn is_empty(&self) -> bool {
        self.marks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_are_independent_and_capacity_is_bounded() {
        let mut g = ReplayGuard::new(3);
        let (a, b) = (ModelId([1; 32]), ModelId([2; 32]));
        assert_eq!(g.admit(1u8, a, 9, PacketId([0; 32])), Ok(Admission::New));
        assert_eq!(g.admit(1u8, b, 1, PacketId([1; 32])), Ok(Admission::New));
        assert_eq!(g.admit(2u8, a, 5, PacketId([2; 32])), Ok(Admission::New));
        assert_eq!(g.len(), 3);
        // Full: the oldest round (sender 1, model b, round 1) goes.
        assert_eq!(g.admit(3u8, a, 7, PacketId([3; 32])), Ok(Admission::New));
        assert_eq!(g.len(), 3);
        assert_eq!(g.high_water(&1, &b), None);
        assert_eq!(g.high_water(&1, &a), Some((9, PacketId([0; 32]))));
    }

    #[test]
    fn restore_keeps_the_higher_mark() {
        let mut g = ReplayGuard::new(8);
        let m = ModelId([0; 32]);
        g.restore("x", m, 4, PacketId([4; 32]));
        g.restore("x", m, 2, PacketId([2; 32]));
        assert_eq!(g.high_water(&"x", &m), Some((4, PacketId([4; 32]))));
        assert_eq!(
            g.admit("x", m, 3, PacketId([3; 32])),
            Err(ReplayReject::Stale {
                round: 3,
                high_water: 4
            })
        );
        assert_eq!(g.marks().count(), 1);
    }
}
