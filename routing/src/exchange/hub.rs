//! A node as its cohort's hub: the pushes it takes, its admission, its merge and what it
//! serves.

use super::Exchange;
use super::io::{Answer, Apply, Output, Role, Ticket};
use super::round::{PushIn, Served, Step};

impl<P: Clone + Ord + std::fmt::Debug, M: Clone> Exchange<P, M> {
    /// A push: held for the admission if the node is (or may still be) its own hub, otherwise
    /// answered at once.
    pub(super) fn push_received(&mut self, round: u64, push: PushIn<P, M>) {
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
        let max = self.config.max_pushers;
        let from = push.from.clone();
        let answer = match self.round.as_mut() {
            Some(r) if r.number == round => match (&r.step, r.role) {
                (_, Role::Local) => Answer::Busy,
                // Its own hub, or joining a hub its data has not checked yet: held.
                (Step::Packet | Step::Search { .. } | Step::Collect { .. }, _) if own_hub => {
                    hold(r, push, max)
                }
                (Step::Fetch { .. } | Step::CheckModel { .. }, Role::Member) => hold(r, push, max),
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
        let anchor = self.view.anchor();
        let gate = self.config.gate;
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        let Some(own) = r.packet.clone() else { return };
        let round = r.number;
        let mut pushes = std::mem::take(&mut r.pushes);
        pushes.sort_by(|a, b| b.cosine.total_cmp(&a.cosine).then(a.from.cmp(&b.from)));
        let all: Vec<P> = pushes.iter().map(|p| p.from.clone()).collect();
        gate.retain_admitted_near(anchor, &mut pushes, |p| p.cosine);
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
        if pushes.is_empty() {
            self.finish(Apply::Nothing, false);
            return;
        }
        let ticket = self.ticket();
        let members = pushes
            .iter()
            .map(|p| (p.from.clone(), p.packet.clone()))
            .collect();
        tracing::debug!(round, admitted = pushes.len(), "exchange: hub merges");
        self.set_step(Step::Merging {
            ticket,
            admitted: pushes,
        });
        self.out.push_back(Output::Merge {
            ticket,
            round,
            own,
            members,
        });
    }

    pub(super) fn merge_computed(&mut self, ticket: Ticket, merge: Option<M>) {
        let check = self.round.as_ref().is_some_and(|r| {
            self.exchange_round(r.number)
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
            members.push(p.from);
        }
        self.joined = Some(own.clone());
        self.view.merged(nearest);
        let mut listed = self.view.listed(self.joined.as_ref());
        listed.truncate(self.config.max_listed);
        // A member gets the listing when it changed since the member last got one.
        let version = self.view.version();
        if self.listed_to.len() > self.config.max_members.saturating_mul(2) {
            self.listed_to.clear();
        }
        let to = members
            .iter()
            .map(|p| {
                let fresh = self.listed_to.insert(p.clone(), version) != Some(version);
                (p.clone(), fresh)
            })
            .collect();
        self.mates.clone_from(&members);
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
            listed,
        });
        self.finish(Apply::Merge { merge, adopt: None }, false);
    }

    /// A member asks again for the merge of `round` (the one it was sent may have been lost):
    /// served once more, with the listing, if the hub served it this round.
    pub(super) fn merge_asked(&mut self, from: P, round: u64) {
        let Some(served) = self
            .round
            .as_ref()
            .filter(|r| r.number == round)
            .and_then(|r| r.served.as_ref())
            .filter(|s| s.members.contains(&from))
        else {
            return;
        };
        self.out.push_back(Output::ServeMerge {
            to: vec![(from, true)],
            round,
            merge: served.merge.clone(),
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

/// Hold `push` for the round's admission (a pusher's newer push replaces its older one), or
/// answer busy when `max` are held.
fn hold<P: PartialEq, M>(
    r: &mut super::round::Round<P, M>,
    push: PushIn<P, M>,
    max: usize,
) -> Answer<P> {
    r.heard = true;
    if let Some(held) = r.pushes.iter_mut().find(|p| p.from == push.from) {
        *held = push;
        Answer::Accepted
    } else if r.pushes.len() < max {
        r.pushes.push(push);
        Answer::Accepted
    } else {
        Answer::Busy
    }
}
