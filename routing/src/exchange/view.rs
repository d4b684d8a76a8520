//! The exchange's [`Cohort`], with the record of its bans that a snapshot needs.
//!
//! [`Cohort`] keeps its bans private, has no clock and no serde derives, so the view notes
//! each ban with the round it ends, lifts it then, and a restored view is rebuilt through
//! `Cohort`'s own methods (learn, ban, merged): the rules stay `Cohort`'s.

use serde::{Deserialize, Serialize};

use crate::Cohort;

/// A node's cohort view and whom it banned.
#[derive(Debug, Clone)]
pub(super) struct View<P> {
    cohort: Cohort<P>,
    own: P,
    own_rank: u64,
    /// Banned peers (and dropped hubs), each with the round that ends it.
    banned: Vec<(P, u64)>,
    /// Hubs whose model the node's data refused once (at most `max_members`, oldest dropped).
    model_refused: Vec<P>,
    max_members: usize,
    /// Bumped whenever the peers held may have changed: what the node told a peer of its view
    /// is current while the version is the same.
    version: u64,
}

/// A [`View`] as it persists.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct ViewState<P> {
    pub(super) own: P,
    pub(super) own_rank: u64,
    pub(super) members: Vec<(u64, P)>,
    pub(super) banned: Vec<(P, u64)>,
    pub(super) model_refused: Vec<P>,
    pub(super) anchor: Option<f32>,
}

impl<P: Clone + Ord> View<P> {
    pub(super) fn new(own: P, own_rank: u64, max_members: usize) -> Self {
        Self {
            cohort: Cohort::new(own.clone(), own_rank, max_members),
            own,
            own_rank,
            banned: Vec::new(),
            model_refused: Vec::new(),
            max_members,
            version: 0,
        }
    }

    /// Changes whenever the peers held may have changed.
    pub(super) fn version(&self) -> u64 {
        self.version
    }

    fn changed(&mut self) {
        self.version = self.version.wrapping_add(1);
    }

    pub(super) fn cohort(&self) -> &Cohort<P> {
        &self.cohort
    }

    pub(super) fn own(&self) -> &P {
        &self.own
    }

    pub(super) fn own_rank(&self) -> u64 {
        self.own_rank
    }

    /// Rank the node and its peers anew ([`Cohort::rerank`]).
    pub(super) fn rerank(&mut self, rank: impl Fn(&P) -> u64) {
        self.cohort.rerank(&rank);
        self.own_rank = rank(&self.own);
        self.changed();
    }

    pub(super) fn hub(&self) -> P {
        self.cohort.hub()
    }

    pub(super) fn is_own(&self, p: &P) -> bool {
        *p == self.own
    }

    /// Whether `p` is in the view.
    pub(super) fn knows(&self, p: &P) -> bool {
        self.cohort.ranked().iter().any(|(_, q)| q == p)
    }

    /// `p`'s rank as the view holds it (the node's own for itself; `u64::MAX` if unknown).
    pub(super) fn rank_of(&self, p: &P) -> u64 {
        if self.is_own(p) {
            return self.own_rank;
        }
        self.cohort
            .ranked()
            .iter()
            .find(|(_, q)| q == p)
            .map_or(u64::MAX, |(r, _)| *r)
    }

    pub(super) fn learn(&mut self, peers: impl IntoIterator<Item = (P, u64)>) -> usize {
        let learned = self.cohort.learn(peers);
        if learned > 0 {
            self.changed();
        }
        learned
    }

    pub(super) fn forget(&mut self, p: &P) {
        self.cohort.forget(p);
        self.changed();
    }

    pub(super) fn merged(&mut self, cosine: f32) {
        self.cohort.merged(cosine);
    }

    pub(super) fn anchor(&self) -> f32 {
        self.cohort.anchor()
    }

    pub(super) fn listed(&self, joined: Option<&P>) -> Vec<(P, u64)> {
        self.cohort.listed(joined)
    }

    pub(super) fn ranked(&self) -> Vec<(P, u64)> {
        self.cohort
            .ranked()
            .iter()
            .map(|(r, p)| (p.clone(), *r))
            .collect()
    }

    /// Ban `p` until round `until` (a later end than one it holds wins): its merge or model
    /// failed the node's check, or its data refused the node's; or, as a hub, it answered
    /// nothing ([`super::ExchangeConfig::dropped_rounds`]: kept out, not reported as a ban).
    pub(super) fn ban(&mut self, p: &P, until: u64) {
        if self.is_own(p) {
            return;
        }
        self.cohort.ban(p);
        self.changed();
        match self.banned.iter_mut().find(|(q, _)| q == p) {
            Some((_, end)) => *end = (*end).max(until),
            None => self.banned.push((p.clone(), until)),
        }
    }

    /// The node's data refused `p`'s model: returns whether it had refused it before (the
    /// record is then cleared, as the caller bans `p`).
    pub(super) fn model_refused(&mut self, p: &P) -> bool {
        if let Some(at) = self.model_refused.iter().position(|q| q == p) {
            self.model_refused.remove(at);
            return true;
        }
        if self.model_refused.len() >= self.max_members.max(1) {
            self.model_refused.remove(0);
        }
        self.model_refused.push(p.clone());
        false
    }

    /// Lift the bans that end by `round`: those peers may be learned again.
    pub(super) fn lift_bans(&mut self, round: u64) {
        let cohort = &mut self.cohort;
        self.banned.retain(|(p, until)| {
            let over = *until <= round;
            if over {
                cohort.unban(p);
            }
            !over
        });
    }

    pub(super) fn state(&self) -> ViewState<P> {
        let anchor = self.cohort.anchor();
        ViewState {
            own: self.own.clone(),
            own_rank: self.own_rank,
            members: self.cohort.ranked().to_vec(),
            banned: self.banned.clone(),
            model_refused: self.model_refused.clone(),
            anchor: anchor.is_finite().then_some(anchor),
        }
    }

    /// Rebuild a view through [`Cohort`]'s own methods.
    pub(super) fn restore(state: ViewState<P>, max_members: usize) -> Self {
        let mut view = Self::new(state.own, state.own_rank, max_members);
        for (p, until) in &state.banned {
            view.ban(p, *until);
        }
        for p in state.model_refused {
            view.model_refused(&p);
        }
        view.cohort
            .learn(state.members.into_iter().map(|(r, p)| (p, r)));
        if let Some(a) = state.anchor {
            view.cohort.merged(a);
        }
        view
    }
}
