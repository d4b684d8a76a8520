//! A node as its cohort's hub: the pushes it takes, its admission, its merge and what it
//! serves.

use super::Exchange;
use super::io::{Answer, Apply, Millis, Output, Recipient, Role, Ticket};
use super::round::{PushIn, Served, Step, Sub};

impl<P: Clone + Ord + std::fmt::Debug, M: Clone> Exchange<P, M> {
    /// A push: held for the admission if the node is (or may still be) its own hub, otherwise
    /// answered at once.
    pub(super) fn push_received(&mut self, now: Millis, round: u64, push: PushIn<P, M>) {
        let hub = self.view.hub();
        let own_hub = self.view.is_own(&hub);
        let rank = self.rank_of(&hub);
        let catching_up = self.catching_up();
        // The hub a node catching up joined this round, named to those that push to it.
        let joined_hub = self
            .round
            .as_ref()
            .filter(|_| catching_up)
            .and_then(|r| r.hub.clone())
            .map(|h| (self.rank_of(&h), h));
        let fanout = self.config.fanout;
        // In a tree, a member takes children only under a hub it is a member of already (one
        // joining a new hub names it, so that pushers take its model too), or those its own
        // hub named to it (they checked that hub's model).
        // A node never takes as its child the node it pushes to: a root that joined another
        // tree can be named its own old child by that tree's hub, and the two would then merge
        // only each other's pushes.
        let pushes_to_pusher = self.config.fanout.is_some()
            && !own_hub
            && self
                .round
                .as_ref()
                .is_some_and(|r| r.hub.as_ref().or(self.joined.as_ref()) == Some(&push.from));
        let established = !pushes_to_pusher
            && self.round.as_ref().is_some_and(|r| {
                let up = r.hub.as_ref().or(self.joined.as_ref());
                let member = match &r.hub {
                    Some(h) => self.joined.as_ref() == Some(h),
                    None => self.joined.as_ref().is_some_and(|j| !self.view.is_own(j)),
                };
                member || (push.via.is_some() && push.via.as_ref() == up)
            });
        let max = fanout.unwrap_or(self.config.max_pushers);
        let max_depth = self.config.max_depth();
        let timing = self.config.timing;
        let from = push.from.clone();
        let view = &self.view;
        let rank_in_view = |p: &P| view.rank_of(p);
        let answer = match self.round.as_mut() {
            Some(r) if r.number == round => match (&r.step, r.role) {
                (_, Role::Local) => Answer::Busy,
                _ if pushes_to_pusher && hub == from => Answer::Busy,
                // Its own hub, or joining a hub its data has not checked yet: held.
                (Step::Packet | Step::Search { .. } | Step::Collect { .. }, _) if own_hub => {
                    r.depth = 0;
                    let reserved = std::mem::take(&mut r.reserved);
                    let answer = hold(r, push, 0, max, fanout.map(|_| &reserved[..]), rank_in_view);
                    r.reserved = reserved;
                    answer
                }
                // A member of a tree takes children until its level closes.
                (step, Role::Member) if fanout.is_some() && !own_hub && established => {
                    let close = r.at(timing.close_permille(r.depth));
                    let open = matches!(r.sub, Sub::Open) && !matches!(step, Step::Done);
                    if open && r.depth < max_depth && now < close {
                        let reserved = std::mem::take(&mut r.reserved);
                        let depth = r.depth;
                        let answer = hold(r, push, depth, max, Some(&reserved[..]), rank_in_view);
                        r.reserved = reserved;
                        if !r.pushes.is_empty() {
                            r.sub_close = Some(close);
                        }
                        match answer {
                            // Full, with children on the deepest level: none of them can take
                            // the pusher (each would send it back here), so it goes up a level,
                            // where a place may be free.
                            Answer::Full { .. } if depth.saturating_add(1) >= max_depth => {
                                Answer::NotHub { hub, rank }
                            }
                            answer => answer,
                        }
                    } else if open && r.depth >= max_depth {
                        // Too deep to take children: the pusher enters the tree at the top,
                        // where the least-named members are.
                        Answer::NotHub { hub, rank }
                    } else {
                        Answer::Late
                    }
                }
                (Step::Fetch { .. } | Step::CheckModel { .. }, Role::Member)
                    if !pushes_to_pusher =>
                {
                    // In a tree, a would-be hub that holds its fan-out names a held pusher to
                    // the rest (`Answer::Full`), as a hub does: its whole cohort may push to it
                    // at once, redirected by a member whose root left. Its depth is a hub's:
                    // pushers it does not keep as a hub are sent to the hub it joins.
                    hold(r, push, 0, max, fanout.map(|_| &[][..]), rank_in_view)
                }
                (Step::Merging { .. } | Step::CheckOwn { .. } | Step::Done, Role::Hub) => {
                    Answer::Late
                }
                // Its own hub, catching up at its next rank (`ExchangeConfig::catch_up_after`):
                // it names that hub, so the pusher heads or joins it this round.
                (_, Role::Member) if own_hub && catching_up => match joined_hub {
                    Some((rank, hub)) => Answer::NotHub { hub, rank },
                    None => Answer::Late,
                },
                // Its own hub, pushing to its next rank as an idle hub
                // (`ExchangeConfig::idle_rounds`): a hub again next round.
                (_, Role::Member) if own_hub => Answer::Late,
                _ => Answer::NotHub { hub, rank },
            },
            // The node is past that round, or not yet in it.
            Some(r) if r.number > round => Answer::Late,
            _ => Answer::Busy,
        };
        self.out.push_back(Output::Answer {
            to: from,
            round,
            answer,
        });
    }

    /// The hub closes its admission: it admits the pushers its cosine gate passes, measured
    /// against the nearest of them and its anchor (so another task's nodes cannot take over a
    /// hub its own task's members left), refuses the others and asks for the merge.
    pub(super) fn close_admission(&mut self) {
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        let Some(own) = r.packet.clone() else { return };
        let round = r.number;
        let pushes = std::mem::take(&mut r.pushes);
        let pushes = self.admit(round, pushes);
        if pushes.is_empty() {
            self.finish(Apply::Nothing, false);
            return;
        }
        tracing::debug!(round, admitted = pushes.len(), "exchange: hub merges");
        let ticket = self.ask_merge_of(round, own, &pushes, false);
        self.set_step(Step::Merging {
            ticket,
            admitted: pushes,
        });
    }

    /// Ask the driver for the merge of `own` and the admitted `pushes` (`up`: a sub-hub's).
    fn ask_merge_of(&mut self, round: u64, own: M, pushes: &[PushIn<P, M>], up: bool) -> Ticket {
        let ticket = self.ticket();
        let members = pushes
            .iter()
            .map(|p| (p.from.clone(), p.packet.clone()))
            .collect();
        self.out.push_back(Output::Merge {
            ticket,
            round,
            own,
            members,
            up,
        });
        ticket
    }

    /// Answer every one of `pushes` with `answer`.
    pub(super) fn answer_all(&mut self, round: u64, pushes: Vec<PushIn<P, M>>, answer: Answer<P>) {
        for p in pushes {
            self.out.push_back(Output::Answer {
                to: p.from,
                round,
                answer: answer.clone(),
            });
        }
    }

    /// The pushes a (sub-)hub admits when its admission closes, nearest first: those its cosine
    /// gate passes, measured against the nearest of them and its anchor. The others are
    /// refused.
    fn admit(&mut self, round: u64, mut pushes: Vec<PushIn<P, M>>) -> Vec<PushIn<P, M>> {
        pushes.sort_by(|a, b| b.cosine.total_cmp(&a.cosine).then(a.from.cmp(&b.from)));
        let all: Vec<P> = pushes.iter().map(|p| p.from.clone()).collect();
        self.config
            .gate
            .retain_admitted_near(self.view.anchor(), &mut pushes, |p| p.cosine);
        for p in all
            .into_iter()
            .filter(|p| !pushes.iter().any(|a| a.from == *p))
        {
            self.out.push_back(Output::Answer {
                to: p,
                round,
                answer: Answer::Refused { foreign: false },
            });
        }
        pushes
    }

    pub(super) fn merge_computed(&mut self, ticket: Ticket, merge: Option<M>) {
        if self
            .round
            .as_ref()
            .is_some_and(|r| matches!(&r.sub, Sub::Merging { ticket: t, .. } if *t == ticket))
        {
            self.sub_merged(merge);
            return;
        }
        // In a tree the hub's data checks every merge: a sub-hub's merge was checked by
        // nobody's data before it came up.
        let check = self.round.as_ref().is_some_and(|r| {
            self.config.fanout.is_some()
                || self
                    .exchange_round(r.number)
                    .is_some_and(|x| x >= self.config.data_checks_from)
        });
        let own = self.view.own().clone();
        let Some(r) = self.round.as_mut() else { return };
        if !matches!(&r.step, Step::Merging { ticket: t, .. } if *t == ticket) {
            return;
        }
        let (Some(merge), Some(packet)) = (merge, r.packet.clone()) else {
            // Nothing to serve this round (the merge could not be distilled).
            if let Step::Merging { admitted, .. } = &mut r.step {
                let round = r.number;
                for p in std::mem::take(admitted) {
                    self.out.push_back(Output::Answer {
                        to: p.from,
                        round,
                        answer: Answer::Busy,
                    });
                }
            }
            self.finish(Apply::Nothing, false);
            return;
        };
        if !check {
            self.serve(merge);
            return;
        }
        // The hub's own data checks the merge against its own update: a cohort of another
        // task, which it ended up heading while models were young, scores far lower on it.
        let check_ticket = self.ticket();
        if let Some(r) = self.round.as_mut()
            && let Step::Merging { admitted, .. } = &mut r.step
        {
            let admitted = std::mem::take(admitted);
            r.step = Step::CheckOwn {
                ticket: check_ticket,
                merge: merge.clone(),
                admitted,
            };
        }
        self.out.push_back(Output::CheckMerge {
            ticket: check_ticket,
            hub: own,
            merge,
            own: packet,
            by_data: true,
        });
    }

    /// The round's number and the pushes the hub admitted, taken out of a merging round (`None`
    /// in any other step).
    fn take_admitted(&mut self) -> Option<(u64, Vec<PushIn<P, M>>)> {
        let r = self.round.as_mut()?;
        let admitted = match &mut r.step {
            Step::Merging { admitted, .. } | Step::CheckOwn { admitted, .. } => {
                std::mem::take(admitted)
            }
            _ => return None,
        };
        Some((r.number, admitted))
    }

    /// The hub serves its merge to its admitted members, with its view, and learns theirs.
    pub(super) fn serve(&mut self, merge: M) {
        let own = self.view.own().clone();
        let Some((round, admitted)) = self.take_admitted() else {
            return;
        };
        // Views spread both ways: the hub learns its members and the peers they know, so a
        // connected cohort ends with one hub.
        let nearest = admitted.first().map_or(f32::NEG_INFINITY, |p| p.cosine);
        let mut members = Vec::with_capacity(admitted.len());
        for p in admitted {
            self.view
                .learn(std::iter::once((p.from.clone(), p.rank)).chain(p.known));
            members.push((p.from, p.cosine));
        }
        self.joined = Some(own.clone());
        self.view.merged(nearest);
        let (to, listed) = self.listing(&members);
        self.mates = members.iter().map(|(p, _)| p.clone()).collect();
        self.served_last.clone_from(&self.mates);
        if let Some(r) = self.round.as_mut() {
            r.served = Some(Served {
                merge: merge.clone(),
                listed: listed.clone(),
                members,
            });
        }
        self.out.push_back(Output::ServeMerge {
            to,
            round,
            merge: merge.clone(),
            lineage: self.lineage,
            listed,
        });
        self.finish(Apply::Merge { merge, adopt: None }, false);
    }

    /// What a (sub-)hub serving `members` lists: its view, to each member whose last listing
    /// is out of date (`true`).
    fn listing(&mut self, members: &[(P, f32)]) -> Listing<P> {
        let mut listed = self.view.listed(self.joined.as_ref());
        // In a tree, a sub-hub lists the lowest rank it knows too (its tree's root, as far as
        // it knows): a member new to the tree enters it at the top.
        let top = self.view.hub();
        if self.config.fanout.is_some() && !listed.iter().any(|(p, _)| *p == top) {
            let rank = self.rank_of(&top);
            listed.insert(0, (top, rank));
        }
        listed.truncate(self.config.max_listed);
        // A member gets the listing when it changed since the member last got one.
        let version = self.view.version();
        if self.listed_to.len() > self.config.max_members.saturating_mul(2) {
            self.listed_to.clear();
        }
        let to = members
            .iter()
            .map(|(p, cosine)| Recipient {
                peer: p.clone(),
                listed: self.listed_to.insert(p.clone(), version) != Some(version),
                cosine: *cosine,
            })
            .collect();
        (to, listed)
    }

    /// A member's level closes: it admits the children its gate passes (as a hub admits its
    /// pushers) and asks for the merge of theirs and its own packet.
    pub(super) fn close_sub(&mut self) {
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        r.sub_close = None;
        if !matches!(r.sub, Sub::Open) {
            return;
        }
        let round = r.number;
        let pushes = std::mem::take(&mut r.pushes);
        r.sub = Sub::Closed;
        let Some(own) = r.packet.clone() else {
            self.answer_all(round, pushes, Answer::Busy);
            return;
        };
        let pushes = self.admit(round, pushes);
        if pushes.is_empty() {
            return;
        }
        tracing::debug!(round, children = pushes.len(), "exchange: sub-hub merges");
        let ticket = self.ask_merge_of(round, own, &pushes, true);
        if let Some(r) = self.round.as_mut() {
            r.sub = Sub::Merging {
                ticket,
                children: pushes,
            };
        }
    }

    /// The merge of a sub-hub's children and its own packet: pushed up in place of its packet
    /// (again, if it pushed already), or, if none could be made, its children hear busy.
    fn sub_merged(&mut self, merge: Option<M>) {
        let Some(r) = self.round.as_mut() else { return };
        let round = r.number;
        let Sub::Merging { children, .. } = std::mem::replace(&mut r.sub, Sub::Closed) else {
            return;
        };
        let Some(merge) = merge else {
            self.answer_all(round, children, Answer::Busy);
            return;
        };
        let mut ids = Vec::with_capacity(children.len());
        for p in children {
            self.view
                .learn(std::iter::once((p.from.clone(), p.rank)).chain(p.known));
            ids.push((p.from, p.cosine));
        }
        let Some(r) = self.round.as_mut() else { return };
        r.sub = Sub::Up {
            merge: merge.clone(),
            children: ids,
        };
        if matches!(r.step, Step::Pushed { .. })
            && let Some(to) = r.hub.clone()
        {
            // Its packet went up already: the merge replaces it in its hub's admission.
            let via = r.via.clone();
            self.out.push_back(Output::Push {
                to,
                round,
                packet: merge,
                known: Vec::new(),
                via,
            });
        }
    }

    /// A sub-hub's round ends with `down` to apply (its hub's merge, or, when none came, its
    /// children's merge): its children get it.
    pub(super) fn serve_children(&mut self, round: u64, down: M, children: Vec<(P, f32)>) {
        let (to, listed) = self.listing(&children);
        self.served_last = children.iter().map(|(p, _)| p.clone()).collect();
        if let Some(r) = self.round.as_mut() {
            r.served = Some(Served {
                merge: down.clone(),
                listed: listed.clone(),
                members: children,
            });
        }
        self.out.push_back(Output::ServeMerge {
            to,
            round,
            merge: down,
            lineage: self.lineage,
            listed,
        });
    }

    /// A member asks again for the merge of `round` (the one it was sent may have been lost):
    /// served once more, with the listing, if the hub served it this round.
    pub(super) fn merge_asked(&mut self, from: P, round: u64) {
        let Some(served) = self
            .round
            .as_ref()
            .filter(|r| r.number == round)
            .and_then(|r| r.served.as_ref())
        else {
            return;
        };
        let Some(&(_, cosine)) = served.members.iter().find(|(p, _)| *p == from) else {
            return;
        };
        self.out.push_back(Output::ServeMerge {
            to: vec![Recipient {
                peer: from,
                listed: true,
                cosine,
            }],
            round,
            merge: served.merge.clone(),
            lineage: self.lineage,
            listed: served.listed.clone(),
        });
    }

    /// The hub's own data refused its merge: it heads another task's cohort. It serves nobody,
    /// and it and its pushers forget each other.
    pub(super) fn hub_refused_merge(&mut self) {
        let Some((round, admitted)) = self.take_admitted() else {
            return;
        };
        tracing::debug!(round, "exchange: hub's data refuses its merge");
        for p in admitted {
            self.refuse(&p.from);
            self.out.push_back(Output::Answer {
                to: p.from,
                round,
                answer: Answer::Refused { foreign: true },
            });
        }
        self.finish(Apply::Nothing, false);
    }
}

/// Whom a (sub-)hub serves, each with whether it gets the listing, and the listing.
type Listing<P> = (Vec<Recipient<P>>, Vec<(P, u64)>);

/// Hold `push` for the round's admission (a pusher's newer push replaces its older one), or,
/// when `max` are held, name one of them to push to (in a tree, `Some` of the peers served
/// last round: [`Answer::Full`]) or answer busy. A held pusher is told `depth`, the node's own
/// in its tree.
///
/// In a tree, the peers served last round keep their places until they push: one that pushes
/// late (a member that gathers its children first) is not pushed down its own tree by those
/// that push early, and the tree stays put from round to round.
fn hold<P: PartialEq + Clone, M>(
    r: &mut super::round::Round<P, M>,
    push: PushIn<P, M>,
    depth: u8,
    max: usize,
    tree: Option<&[P]>,
    rank: impl Fn(&P) -> u64,
) -> Answer<P> {
    r.heard = true;
    if let Some(held) = r.pushes.iter_mut().find(|p| p.from == push.from) {
        *held = push;
        return Answer::Accepted { depth };
    }
    let reserved = tree.unwrap_or_default();
    // Places kept for peers served last round that have not pushed yet (counted down as they
    // push: a push replaced above is not new).
    let waiting = *r.waiting.get_or_insert(reserved.len());
    let is_reserved = reserved.contains(&push.from);
    let others = if is_reserved {
        waiting.saturating_sub(1)
    } else {
        waiting
    };
    if r.pushes.len().saturating_add(others) < max {
        if is_reserved {
            r.waiting = Some(waiting.saturating_sub(1));
        }
        r.pushes.push(push);
        r.held = r.held.saturating_add(1);
        return Answer::Accepted { depth };
    }
    if tree.is_none() {
        return Answer::Busy;
    }
    // The member (held, or with a place kept) named least often this round: the levels below
    // fill evenly.
    let named = |p: &P| r.hinted.iter().find(|(q, _)| q == p).map_or(0, |(_, n)| *n);
    let Some(child) = r
        .pushes
        .iter()
        .map(|p| (p.from.clone(), p.rank))
        .chain(reserved.iter().map(|p| (p.clone(), rank(p))))
        .enumerate()
        .min_by_key(|(i, (p, _))| (named(p), *i))
        .map(|(_, child)| child)
    else {
        return Answer::Busy;
    };
    match r.hinted.iter_mut().find(|(q, _)| *q == child.0) {
        Some((_, n)) => *n += 1,
        None => r.hinted.push((child.0.clone(), 1)),
    }
    Answer::Full {
        hint: child.0,
        rank: child.1,
    }
}
