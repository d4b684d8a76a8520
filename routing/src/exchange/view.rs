//! The exchange's [`Cohort`], with the record of its bans and strikes that a snapshot needs.
//!
//! [`Cohort`] keeps its bans and strike counts private and has no serde derives, so the view
//! notes them as the core calls into it, and a restored view is rebuilt through `Cohort`'s own
//! methods (learn, ban, failed, merged): the rules stay `Cohort`'s.

use serde::{Deserialize, Serialize};

use crate::{Cohort, HUB_STRIKES};

/// A node's cohort view and what it banned and struck.
#[derive(Debug, Clone)]
pub(super) struct View<P> {
    cohort: Cohort<P>,
    own: P,
    own_rank: u64,
    banned: Vec<P>,
    strikes: Vec<(P, u32)>,
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
    pub(super) banned: Vec<P>,
    pub(super) strikes: Vec<(P, u32)>,
    pub(super) anchor: Option<f32>,
}

impl<P: Clone + Ord> View<P> {
    pub(super) fn new(own: P, own_rank: u64, max_members: usize) -> Self {
        Self {
            cohort: Cohort::new(own.clone(), own_rank, max_members),
            own,
            own_rank,
            banned: Vec::new(),
            strikes: Vec::new(),
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

    /// [`Cohort::failed`]; returns whether it banned `p`.
    pub(super) fn failed(&mut self, p: &P) -> bool {
        let banned = self.cohort.failed(p);
        self.changed();
        if banned {
            self.note_ban(p);
        } else if let Some((_, c)) = self.strikes.iter_mut().find(|(q, _)| q == p) {
            *c += 1;
        } else {
            self.strikes.push((p.clone(), 1));
        }
        banned
    }

    /// [`Cohort::passed`].
    pub(super) fn passed(&mut self, p: &P) {
        self.cohort.passed(p);
        self.strikes.retain(|(q, _)| q != p);
    }

    /// The node's data refused `p`: it forgets the peer, and bans it if the peer failed its
    /// previous check too. Returns whether it banned it.
    pub(super) fn refuse(&mut self, p: &P) -> bool {
        let banned = self.failed(p);
        if !banned {
            self.cohort.forget(p);
        }
        banned
    }

    fn note_ban(&mut self, p: &P) {
        self.strikes.retain(|(q, _)| q != p);
        if *p != self.own && !self.banned.contains(p) {
            self.banned.push(p.clone());
        }
    }

    pub(super) fn state(&self) -> ViewState<P> {
        let anchor = self.cohort.anchor();
        ViewState {
            own: self.own.clone(),
            own_rank: self.own_rank,
            members: self.cohort.ranked().to_vec(),
            banned: self.banned.clone(),
            strikes: self.strikes.clone(),
            anchor: anchor.is_finite().then_some(anchor),
        }
    }

    /// Rebuild a view through [`Cohort`]'s own methods.
    pub(super) fn restore(state: ViewState<P>, max_members: usize) -> Self {
        let mut view = Self::new(state.own, state.own_rank, max_members);
        for p in &state.banned {
            view.cohort.ban(p);
            view.note_ban(p);
        }
        view.cohort
            .learn(state.members.into_iter().map(|(r, p)| (p, r)));
        for (p, n) in &state.strikes {
            // A recorded count is below the ban; never let a corrupt one ban here.
            for _ in 0..(*n).min(HUB_STRIKES.saturating_sub(1)) {
                view.failed(p);
            }
        }
        if let Some(a) = state.anchor {
            view.cohort.merged(a);
        }
        view
    }
}
