//! What goes in and out of an [`Exchange`](super::Exchange): time, inputs, outputs.

use serde::{Deserialize, Serialize};

/// A point on the driver's clock, in milliseconds. The core never reads a clock: every input
/// carries one, and [`Exchange::poll_timeout`](super::Exchange::poll_timeout) answers with one.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Millis(pub u64);

impl Millis {
    /// `self` plus `ms` milliseconds, saturating at the end of time.
    pub fn saturating_add(self, ms: u64) -> Self {
        Self(self.0.saturating_add(ms))
    }
}

/// The id of a request the core makes of its driver (a model fetch, a merge to compute, a check
/// to run): the input that reports its result echoes it, and a result whose ticket the core no
/// longer waits for (a past round, a crash) is dropped.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Ticket(pub u64);

/// A peer's header as a search returned it, with what the driver measured of it.
///
/// `rank` and `hub_rank` are the driver's [`crate::hub_rank_at`] of the identities in the
/// node's rank window, never values taken from the network; `cosine` is the sketch cosine of the header's embedding with the
/// node's own packet.
#[derive(Debug, Clone, PartialEq)]
pub struct SeenHeader<P> {
    /// The header's sender.
    pub peer: P,
    /// Its rank in the hub order.
    pub rank: u64,
    /// Sketch cosine of its embedding with the node's own.
    pub cosine: f32,
    /// The hub its header names (its own hub as of its last round; itself if it is one).
    pub hub: P,
    /// That hub's rank.
    pub hub_rank: u64,
}

/// A hub's answer to a push.
///
/// [`Answer::Accepted`], [`Answer::NotHub`], [`Answer::Full`], [`Answer::Busy`] and
/// [`Answer::Late`] come at once;
/// [`Answer::Refused`] when the hub closes its admission (the cosine gate is measured against
/// all pushers), or after its own data refused the merge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer<P> {
    /// Queued for this round's admission: a merge or a refusal follows.
    Accepted {
        /// The answering hub's depth in its cohort's tree (0: the root; always 0 without
        /// [`super::ExchangeConfig::fanout`]): the pusher, if it takes children, closes their
        /// admission one level earlier.
        depth: u8,
    },
    /// The peer pushed to is not its own hub: `hub` is whom it pushes to (rank as computed by
    /// the receiving driver).
    NotHub {
        /// The hub the answering node names.
        hub: P,
        /// Its rank.
        rank: u64,
    },
    /// The hub holds (or keeps places for) as many pushes as it admits
    /// ([`super::ExchangeConfig::fanout`]): push to `hint`, one of those members, which takes
    /// the pusher as its child.
    Full {
        /// The member to push to.
        hint: P,
        /// Its rank (as computed by the receiving driver).
        rank: u64,
    },
    /// The hub holds as many pushes as it merges, or is not taking part this round.
    Busy,
    /// The push came after the hub closed its admission for the round.
    Late,
    /// The hub's cosine gate did not admit the pusher (another task, or a drifted model), or,
    /// with `foreign`, the hub's own data refused the merge of its admitted pushers (it heads
    /// another task's cohort).
    Refused {
        /// The hub's data refused the merge, not its gate the pusher.
        foreign: bool,
    },
}

impl<P> Answer<P> {
    /// The answer with a [`Answer::NotHub`] hint ranked by `rank`, the receiving driver's
    /// [`crate::hub_rank_at`] (a rank is never taken from the network).
    pub fn ranked_by(self, rank: impl FnOnce(&P) -> u64) -> Self {
        match self {
            Self::NotHub { hub, .. } => {
                let rank = rank(&hub);
                Self::NotHub { hub, rank }
            }
            Self::Full { hint, .. } => {
                let rank = rank(&hint);
                Self::Full { hint, rank }
            }
            other => other,
        }
    }
}

/// What a node's own data made of a hub's model before it joins the hub
/// (`kindred_distill::check_by_data`, then `kindred_distill::check_adoption`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelVerdict {
    /// The data accepts the model and it is near the node's own: the node takes it when the
    /// hub's first merge passes.
    Adopt,
    /// The data accepts the model but it is far from the node's own (or there was nothing to
    /// fetch): the node keeps its model and applies the hub's merges to it.
    Keep,
    /// The data refuses the model (another task's, or corrupted): the node does not push,
    /// forgets the hub (bans it if it refused its model before) and takes the next rank.
    Refuse,
}

/// What the driver's checks made of a merge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MergeVerdict {
    /// Every check asked for passed.
    Pass,
    /// Direction or norm against the node's own update failed (`check_aggregate`): the node
    /// bans the hub ([`super::ExchangeConfig::ban_rounds`]).
    Aggregate,
    /// The node's own data refused it (`check_by_data`): the node bans the hub.
    Data,
    /// The merge's output layer does not point at the node's labels (`check_head`): refused,
    /// and the hub is banned if its next merge is doubted too. One round's output layer is
    /// noisy: in the node's NAT test (cohorts of two) 1 of 251 honest merges failed the
    /// check, and a ban for it cut the member off its only dialable hub; another task's merge
    /// fails it every round.
    Doubt,
}

/// An input to [`Exchange::handle`](super::Exchange::handle).
///
/// `M` is the driver's handle for a payload (a packet, a merge, a model): the core stores and
/// hands back handles, never looks inside.
#[derive(Debug, Clone)]
pub enum Input<P, M> {
    /// Round `round` begins; it must be finished by `deadline`. A round still open is finished
    /// first (with the node's own update).
    RoundStart {
        /// The round number.
        round: u64,
        /// When it must be finished.
        deadline: Millis,
    },
    /// The node's own packet for `round` is sealed (what it would apply alone, and what it
    /// pushes).
    PacketReady {
        /// The round.
        round: u64,
        /// The packet.
        packet: M,
    },
    /// The search the core asked for ([`Output::Search`]) ended with these headers.
    SearchDone {
        /// The round of the search.
        round: u64,
        /// The headers found, in any order.
        headers: Vec<SeenHeader<P>>,
    },
    /// A peer pushed its packet to this node as its hub.
    PushReceived {
        /// The pusher.
        from: P,
        /// Its rank.
        rank: u64,
        /// The round it pushed for.
        round: u64,
        /// Its packet.
        packet: M,
        /// Sketch cosine of its packet with the node's own.
        cosine: f32,
        /// The peers its view holds, with ranks recomputed by the driver.
        known: Vec<(P, u64)>,
        /// The hub that named this node to the pusher ([`Output::Push::via`]), if any.
        via: Option<P>,
    },
    /// The hub this node pushed to answered.
    AnswerReceived {
        /// The answering peer.
        from: P,
        /// The round of the push.
        round: u64,
        /// Its answer.
        answer: Answer<P>,
    },
    /// The hub this node pushed to served its merge.
    MergeReceived {
        /// The hub.
        from: P,
        /// The round of the merge.
        round: u64,
        /// The merge.
        merge: M,
        /// The hub's sketch cosine with the node's push (its embedding against the hub's own),
        /// as the merge response carries it ([`kindred_proto::rpc::SketchCosine`]).
        cosine: f32,
        /// The lineage of the hub's model ([`Exchange::lineage`](super::Exchange::lineage)).
        lineage: u64,
        /// The hub's view ([`crate::Cohort::listed`]), ranks recomputed by the driver.
        listed: Vec<(P, u64)>,
    },
    /// A member asks again for the hub's merge of `round` ([`Output::FetchMerge`]).
    MergeAsked {
        /// The member.
        from: P,
        /// The round.
        round: u64,
    },
    /// The hub's model fetched for [`Output::FetchModel`]; `None` if the fetch failed.
    ModelReceived {
        /// The request's ticket.
        ticket: Ticket,
        /// The model.
        model: Option<M>,
    },
    /// The verdict of [`Output::CheckModel`].
    ModelChecked {
        /// The request's ticket.
        ticket: Ticket,
        /// The verdict.
        verdict: ModelVerdict,
    },
    /// The merge of [`Output::Merge`], synthesized and distilled; `None` if it could not be
    /// (nothing to serve this round).
    MergeComputed {
        /// The request's ticket.
        ticket: Ticket,
        /// The merge as members decode it.
        merge: Option<M>,
    },
    /// The verdict of [`Output::CheckMerge`].
    MergeChecked {
        /// The request's ticket.
        ticket: Ticket,
        /// The verdict.
        verdict: MergeVerdict,
    },
}

/// The node's part in a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A round before the exchange: the node trains alone.
    Local,
    /// The node was its own hub.
    Hub,
    /// The node pushed (or meant to push) to another hub.
    Member,
}

/// What the node applies at the end of a round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Apply<M> {
    /// Its own packet's update (alone, or no merge came, or the merge failed its checks): as its
    /// peers would have seen it, so its error feedback stays exact.
    Own(M),
    /// The hub's merge, after adopting `adopt` (the hub's model it checked before joining) when
    /// it joins with this merge.
    Merge {
        /// The merge.
        merge: M,
        /// The model to take first, if any.
        adopt: Option<M>,
    },
    /// The hub's model in place of its own; its update, trained on the model it leaves, is
    /// not applied.
    Adopt(M),
    /// Nothing: its own packet never became ready.
    Nothing,
}

/// How a round ended ([`Output::Finished`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundReport<P, M> {
    /// The round.
    pub round: u64,
    /// The node's part in it.
    pub role: Role,
    /// The hub it pushed to (itself as a hub or alone).
    pub hub: P,
    /// What to apply.
    pub apply: Apply<M>,
    /// It expected a merge from a hub that did not answer, was busy, or did not serve by the
    /// deadline.
    pub missed: bool,
}

/// A member a hub serves its merge to ([`Output::ServeMerge`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Recipient<P> {
    /// The member.
    pub peer: P,
    /// Whether it gets the hub's listing (the others got this view with an earlier merge, and
    /// get an empty one).
    pub listed: bool,
    /// The sketch cosine of its push with the hub's own packet, as the hub admitted it
    /// ([`Input::PushReceived`]): served back with the merge, the member's anchor.
    pub cosine: f32,
}

/// An action the driver must carry out.
#[derive(Debug, Clone)]
#[must_use = "outputs must be carried out by the driver"]
pub enum Output<P, M> {
    /// Search the band keys of the node's own packet: look them up, with the first `probes`
    /// multi-probe keys ([`crate::keys::ProbeSequence`]), and announce the band keys too if
    /// `announce`; report with [`Input::SearchDone`].
    Search {
        /// The round.
        round: u64,
        /// Announce as well as look up.
        announce: bool,
        /// Multi-probe keys to look up besides the band keys ([`ExchangeConfig::probes`]).
        ///
        /// [`ExchangeConfig::probes`]: super::ExchangeConfig::probes
        probes: usize,
    },
    /// Fetch `hub`'s model; report with [`Input::ModelReceived`].
    FetchModel {
        /// The request's ticket.
        ticket: Ticket,
        /// The hub.
        hub: P,
    },
    /// Check `model` on the node's own data; report with [`Input::ModelChecked`].
    CheckModel {
        /// The request's ticket.
        ticket: Ticket,
        /// The hub it came from.
        hub: P,
        /// The model.
        model: M,
    },
    /// Push the node's packet to its hub `to`, with its view.
    Push {
        /// The hub.
        to: P,
        /// The round.
        round: u64,
        /// The node's packet.
        packet: M,
        /// Its view, the lowest ranks first, at most [`super::ExchangeConfig::max_listed`]
        /// peers (what the hub may learn); empty when this hub got this view already.
        known: Vec<(P, u64)>,
        /// The hub whose [`Answer::Full`] named `to` (the node checked that hub's model): `to`
        /// takes the node as its child even while it joins that hub itself.
        via: Option<P>,
    },
    /// Answer a push.
    Answer {
        /// The pusher.
        to: P,
        /// The round of the push.
        round: u64,
        /// The answer.
        answer: Answer<P>,
    },
    /// Merge the node's own packet with its admitted members' (robust synthesis), distill the
    /// merge with the node's error feedback, and report with [`Input::MergeComputed`].
    Merge {
        /// The request's ticket.
        ticket: Ticket,
        /// The round.
        round: u64,
        /// The node's own packet.
        own: M,
        /// The admitted members and their packets, nearest first.
        members: Vec<(P, M)>,
        /// A sub-hub's merge of its children ([`super::ExchangeConfig::fanout`]): it goes up
        /// to the node's hub in place of its packet, not down to members.
        up: bool,
    },
    /// Check `merge` against the node's own packet `own` (direction and norm), and on the
    /// node's own data if `by_data`; report with [`Input::MergeChecked`].
    CheckMerge {
        /// The request's ticket.
        ticket: Ticket,
        /// The hub that made it (the node itself as a hub).
        hub: P,
        /// The merge.
        merge: M,
        /// The node's own packet.
        own: M,
        /// Check it on the node's own data too.
        by_data: bool,
    },
    /// Send the merge to the admitted members, with the hub's view.
    ServeMerge {
        /// The members: each with whether it gets `listed` and its push's cosine.
        to: Vec<Recipient<P>>,
        /// The round.
        round: u64,
        /// The merge.
        merge: M,
        /// The lineage of the hub's model, which members compare with their own
        /// ([`Exchange::lineage`](super::Exchange::lineage)).
        lineage: u64,
        /// The hub's view ([`crate::Cohort::listed`]), at most
        /// [`super::ExchangeConfig::max_listed`] peers, the lowest ranks first.
        listed: Vec<(P, u64)>,
    },
    /// Ask hub `hub` again for its merge of `round` (the member was accepted and no merge
    /// came): deliver as [`Input::MergeAsked`].
    FetchMerge {
        /// The hub.
        hub: P,
        /// The round.
        round: u64,
    },
    /// The node banned `peer` for [`super::ExchangeConfig::ban_rounds`] (its merge failed a
    /// check, its model twice, or its data refused the node's): the driver may penalise it at
    /// the network layer too.
    Ban {
        /// The peer.
        peer: P,
    },
    /// The round is over: apply [`RoundReport::apply`]. Exactly one per round started, at the
    /// latest at its deadline.
    Finished(RoundReport<P, M>),
}
