//! The state of the round in flight: its deadlines and where it stands.

use super::io::{Millis, Role, Ticket};

/// A push a hub holds until its admission closes.
#[derive(Debug, Clone)]
pub(super) struct PushIn<P, M> {
    pub(super) from: P,
    pub(super) rank: u64,
    pub(super) packet: M,
    pub(super) cosine: f32,
    pub(super) known: Vec<(P, u64)>,
    pub(super) via: Option<P>,
}

/// What a member brings to its hub's first merge.
#[derive(Debug, Clone)]
pub(super) enum Joining<M> {
    /// It has joined the hub already.
    Member,
    /// Its data accepted the hub's model, near its own: adopt it with the first merge.
    Adopt(M),
    /// Its data accepted the hub's model, far from its own: keep its own.
    Keep,
}

/// Where a round stands. Every step but [`Step::Done`] ends at the round's deadline at the
/// latest; those with a timer of their own ([`Round::timer`]) end earlier.
#[derive(Debug, Clone)]
pub(super) enum Step<P, M> {
    /// Waiting for the node's own packet.
    Packet,
    /// Waiting for the search.
    Search { until: Millis },
    /// A member waiting for its hub's model: `until` this attempt gives up, `close` the last
    /// moment to fetch (the hub's admission closes).
    Fetch {
        ticket: Ticket,
        /// The fetch this one sent again: its answer, late, is as good (a slow link or a hole
        /// still being punched answers after the retry left).
        earlier: Option<Ticket>,
        until: Millis,
        close: Millis,
    },
    /// A member waiting for its data's verdict on the hub's model.
    CheckModel {
        ticket: Ticket,
        model: M,
        until: Millis,
    },
    /// A member that pushed, waiting for the answer and the merge; once accepted, it asks for
    /// the merge at `ask` if none came.
    Pushed {
        joining: Joining<M>,
        accepted: bool,
        answer_by: Millis,
        ask: Option<Millis>,
    },
    /// A member waiting for its checks of the merge.
    CheckMerge {
        joining: Joining<M>,
        ticket: Ticket,
        merge: M,
        cosine: f32,
        /// The lineage its hub served with it.
        lineage: u64,
        listed: Vec<(P, u64)>,
    },
    /// A hub taking pushes.
    Collect { until: Millis },
    /// A hub waiting for its merge.
    Merging {
        ticket: Ticket,
        admitted: Vec<PushIn<P, M>>,
    },
    /// A hub waiting for its data's verdict on its merge.
    CheckOwn {
        ticket: Ticket,
        merge: M,
        admitted: Vec<PushIn<P, M>>,
    },
    /// Finished.
    Done,
}

/// A member's children in its cohort's tree ([`super::ExchangeConfig::fanout`]): pushes it
/// holds ([`Round::pushes`]) until its level closes, then merges with its own packet.
#[derive(Debug, Clone)]
pub(super) enum Sub<P, M> {
    /// Taking children (if any push comes).
    Open,
    /// Its level closed; the merge of its children and its own packet is being computed.
    Merging {
        ticket: Ticket,
        children: Vec<PushIn<P, M>>,
    },
    /// That merge, pushed up in place of its packet; its children (with their pushes' cosines)
    /// get the merge it applies.
    Up { merge: M, children: Vec<(P, f32)> },
    /// No children this round (its level closed, or the round is past its push).
    Closed,
}

/// The round in flight.
#[derive(Debug, Clone)]
pub(super) struct Round<P, M> {
    pub(super) number: u64,
    pub(super) start: Millis,
    pub(super) deadline: Millis,
    pub(super) packet: Option<M>,
    pub(super) step: Step<P, M>,
    pub(super) role: Role,
    /// The hub a member joins or pushed to.
    pub(super) hub: Option<P>,
    /// Pushes held before and during the admission (a hub's).
    pub(super) pushes: Vec<PushIn<P, M>>,
    pub(super) redirects: u32,
    /// The version of its view a member's push carried ([`super::View::version`]).
    pub(super) told_version: u64,
    /// Pushes and fetches sent again this round.
    pub(super) retries: u32,
    /// What a hub served this round, for members that ask again.
    pub(super) served: Option<Served<P, M>>,
    /// Somebody pushed to the node this round (a hub nobody pushes to is idle).
    pub(super) heard: bool,
    /// Pushes the node (a hub) took this round.
    pub(super) held: u32,
    /// The node knew peers when the round started (only then can a hub be idle: peers that
    /// met it in this round's searches push from the next).
    pub(super) knew_peers: bool,
    /// The node knew peers when its last round started and knows none now (it refused or lost
    /// them all): it searches this round rather than wait for its next scheduled search.
    pub(super) lost_peers: bool,
    /// The node's depth in its cohort's tree this round (0: a hub; a member one below the
    /// hub it pushed to, once that hub's answer says where it stands).
    pub(super) depth: u8,
    /// A member's children ([`Sub`]).
    pub(super) sub: Sub<P, M>,
    /// When a member holding children closes their admission.
    pub(super) sub_close: Option<Millis>,
    /// [`super::Answer::Full`] hints followed this round, and the hub of the last one.
    pub(super) full_hints: u32,
    pub(super) via: Option<P>,
    /// A full (sub-)hub: how often it named each held pusher in a [`super::Answer::Full`].
    pub(super) hinted: Vec<(P, u32)>,
    /// In a tree, the peers the node served last round, whose places it keeps for them, and
    /// how many of those places are still kept.
    pub(super) reserved: Vec<P>,
    pub(super) waiting: Option<usize>,
}

/// A hub's merge of the round, kept for the members that ask for it again.
#[derive(Debug, Clone)]
pub(super) struct Served<P, M> {
    pub(super) merge: M,
    pub(super) listed: Vec<(P, u64)>,
    /// The members, each with its push's cosine.
    pub(super) members: Vec<(P, f32)>,
}

impl<P, M> Round<P, M> {
    /// The point `permille` thousandths into the round.
    pub(super) fn at(&self, permille: u16) -> Millis {
        let span = self.deadline.0.saturating_sub(self.start.0);
        let part = u128::from(span) * u128::from(permille.min(1000)) / 1000;
        self.start
            .saturating_add(u64::try_from(part).unwrap_or(span))
    }

    /// The earliest of the step's own timer and a sub-hub's close, if any.
    pub(super) fn timer(&self) -> Option<Millis> {
        match (self.step_timer(), self.sub_close) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The step's own timer, if it has one.
    pub(super) fn step_timer(&self) -> Option<Millis> {
        match &self.step {
            Step::Search { until }
            | Step::Fetch { until, .. }
            | Step::CheckModel { until, .. }
            | Step::Collect { until } => Some(*until),
            Step::Pushed {
                accepted: false,
                answer_by,
                ..
            } => Some(*answer_by),
            Step::Pushed {
                accepted: true,
                ask,
                ..
            } => *ask,
            _ => None,
        }
    }

    pub(super) fn is_done(&self) -> bool {
        matches!(self.step, Step::Done)
    }
}

/// The round in flight, if it is `number` and not finished.
pub(super) fn current<P, M>(
    round: &mut Option<Round<P, M>>,
    number: u64,
) -> Option<&mut Round<P, M>> {
    round
        .as_mut()
        .filter(|r| r.number == number && !r.is_done())
}
