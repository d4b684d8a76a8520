//! A node's own round: its packet, its search, and, as a member, joining and pushing to its
//! hub, its hub's answers and merges, and its checks of them.

use super::Exchange;
use super::io::{
    Answer, Apply, MergeVerdict, Millis, ModelVerdict, Output, Role, SeenHeader, Ticket,
};
use super::round::{Joining, Step, Sub, current};
use crate::is_hub_candidate;

/// Most search results a stranded node learns below the cosine gate, the nearest first
/// ([`super::ExchangeConfig::stranded_after`]): each costs it a model fetch at most.
const STRANDED_LEARNS: usize = 4;

impl<P: Clone + Ord + std::fmt::Debug, M: Clone> Exchange<P, M> {
    /// Whether the node took fewer than two pushes as its own hub, or applied its own update as
    /// a member, for [`super::ExchangeConfig::stranded_after`] exchange rounds in a row.
    fn is_stranded(&self) -> bool {
        self.config.stranded_after > 0 && self.stranded >= self.config.stranded_after
    }

    pub(super) fn packet_ready(&mut self, now: Millis, round: u64, packet: M) {
        let exchange_round = self.exchange_round(round);
        let alone = self.view.hub() == *self.view.own();
        let knows = self.view.cohort().len();
        let cfg = &self.config;
        let Some(r) = current(&mut self.round, round) else {
            return;
        };
        if !matches!(r.step, Step::Packet) || r.packet.is_some() {
            return;
        }
        r.packet = Some(packet);
        let Some(x) = exchange_round else {
            // A local round: the node trains alone.
            self.finish(Apply::Nothing, false);
            return;
        };
        // Nodes that are their own hub search: two cohorts of one task that found no peer of
        // each other merge when one's hub meets the other's. A node that knows nobody also
        // searches once soon after the warm-up (exchange round 4), in the last round of every
        // key window, when the window's announcements are all in (members do not announce: a
        // search finds hubs, which announce once per `search_every` of their rounds), and in
        // the round after it lost every peer it knew (it refused a lying hub). While cohorts
        // form, only hub candidates announce.
        let every = match cfg.fanout {
            Some(_) => cfg.tree_search_every,
            None => cfg.search_every,
        }
        .max(1);
        let window_ends = (round + 1).is_multiple_of(cfg.key_window.max(1));
        // Taken whatever else schedules a search: it speaks of the last search only.
        let again = std::mem::take(&mut self.search_again);
        let scheduled = x < cfg.warmup_searches
            || x.is_multiple_of(every)
            || again
            || (knows == 0 && (x == 4 || window_ends || r.lost_peers));
        if alone && scheduled {
            let scheduled_announce =
                x >= cfg.candidate_rounds || is_hub_candidate(self.view.own_rank(), cfg.candidates);
            // A node whose earlier search found nobody announces too: no candidate of its task
            // announced where it looked (a small task may have none). Its task's other nodes
            // do the same, so that search meets them on the band keys; it probes only if it
            // still finds nobody.
            let found_nobody = x > 0 && knows == 0 && !scheduled_announce;
            let announce = scheduled_announce || found_nobody;
            // A view still small after the first search is a small task or a fragment: few
            // records to meet, so probe. (The first search of every node would cost a large
            // swarm a probe walk per node on its busiest keys.)
            // A hub's searches after the warm-up probe too: two cohorts of one task whose
            // band keys differ in one bit each meet only through probes (sketches move
            // little between searches, so the same bits differ each time).
            let small = knows < cfg.probe_below && x > 0 && !found_nobody;
            let probes = if small {
                cfg.probes
            } else if x >= cfg.warmup_searches {
                cfg.search_probes
            } else {
                0
            };
            r.step = Step::Search {
                until: r.at(cfg.timing.search_permille),
            };
            self.out.push_back(Output::Search {
                round,
                announce,
                probes,
            });
        } else {
            self.choose(now);
        }
    }

    pub(super) fn search_done(&mut self, now: Millis, round: u64, headers: Vec<SeenHeader<P>>) {
        let Some(r) = current(&mut self.round, round) else {
            return;
        };
        let waiting = matches!(r.step, Step::Search { .. });
        let mut ranked: Vec<SeenHeader<P>> = headers
            .into_iter()
            .filter(|h| !self.view.is_own(&h.peer))
            .collect();
        ranked.sort_by(|a, b| b.cosine.total_cmp(&a.cosine).then(a.peer.cmp(&b.peer)));
        ranked.truncate(self.config.max_providers);
        // A stranded node's sketch may have drifted under the gate's floor: it learns the
        // nearest it found as well, for its data to judge
        // ([`super::ExchangeConfig::stranded_after`]).
        let nearest: Vec<SeenHeader<P>> = if self.is_stranded() {
            ranked.iter().take(STRANDED_LEARNS).cloned().collect()
        } else {
            Vec::new()
        };
        self.config.gate.retain_admitted(&mut ranked, |h| h.cosine);
        for h in nearest {
            if !ranked.iter().any(|r| r.peer == h.peer) {
                ranked.push(h);
            }
        }
        // A header names its sender's hub: the node learns the peer and its hub.
        let learned = self.view.learn(
            ranked
                .into_iter()
                .flat_map(|h| [(h.peer, h.rank), (h.hub, h.hub_rank)]),
        );
        tracing::debug!(round, learned, "exchange: search done");
        self.search_again = learned > 0 && self.view.hub() == *self.view.own();
        if waiting {
            self.set_step(Step::Packet);
            self.choose(now);
        }
    }

    /// The node's packet is ready and its search over: be the hub, or join and push to it.
    pub(super) fn choose(&mut self, now: Millis) {
        let mut hub = self.view.hub();
        // A hub nobody pushed to for `idle_rounds` pushes to its next rank this round: that
        // hub learns of it and hands its cohort over ([`ExchangeConfig::idle_rounds`]). One
        // back after missing rounds does too, taking that hub's model first
        // ([`ExchangeConfig::catch_up_after`]).
        if self.view.is_own(&hub)
            && (self.idle >= self.config.idle_rounds.max(1) || self.catching_up())
            && let Some(next) = self.view.cohort().members().next()
        {
            tracing::debug!(
                ?next,
                idle = self.idle,
                catching_up = self.catching_up(),
                "exchange: its own hub pushes to its next rank"
            );
            hub = next.clone();
        }
        // In a tree, a member keeps pushing to the (sub-)hub whose merge it applied last, while
        // that one is in its view: its hub placed it there ([`Answer::Full`]).
        if self.config.fanout.is_some()
            && !self.view.is_own(&hub)
            && !self.catching_up()
            && let Some(parent) = self
                .joined
                .clone()
                .filter(|p| *p != hub && !self.view.is_own(p) && self.view.knows(p))
        {
            hub = parent;
        }
        let is_own = self.view.is_own(&hub);
        let rank = self.rank_of(&hub);
        // A node back after missing rounds joins anew (its model is behind its hub's), and so
        // does one whose model is of another lineage than its hub's (`Exchange::lineage`).
        let member = self.joined.as_ref() == Some(&hub) && !self.catching_up();
        let joined = member && !self.rebase;
        // In a tree, one that fetches its own hub's model again keeps its place and children.
        let rebase_in_tree = member && self.rebase && self.config.fanout.is_some();
        let collect = self.config.timing.collect_permille;
        let answer_ms = self.config.timing.answer_ms;
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        if r.packet.is_none() {
            return;
        }
        let (until, deadline) = (r.at(collect), r.deadline);
        if is_own {
            self.head(now);
            return;
        }
        r.role = Role::Member;
        r.hub = Some(hub.clone());
        r.via = None;
        if joined {
            if self.config.fanout.is_some() {
                // A member of its hub already: its packet goes up at once (it keeps its place
                // at its hub, and its answer tells it its depth); its children's merge
                // replaces it when its level closes.
                self.keep_children();
            } else {
                self.redirect_held(&hub, rank);
            }
            self.push(now, Joining::Member);
        } else {
            if rebase_in_tree {
                self.keep_children();
            }
            // Pushes it holds stay held until its data accepts the new hub's model: a hint
            // names only a hub the node checked, or a cohort follows it into another task's
            // hub and pays a model fetch each (`kindred-sim learn --setting rotation`: 60 KB
            // per node in a search round, against 22 KB).
            // Joining: fetch the hub's model and check it on the node's own data first.
            // A join started late in the round (after a redirect) still gets `answer_ms`.
            let close = until.max(now.saturating_add(answer_ms)).min(deadline);
            let ticket = self.ticket();
            self.set_step(Step::Fetch {
                ticket,
                earlier: None,
                until: now.saturating_add(answer_ms).min(close),
                close,
            });
            self.out.push_back(Output::FetchModel { ticket, hub });
        }
    }

    /// In a tree, a member of its hub: pushes it holds are its children, admitted until its
    /// level closes at its last known depth (`Timing::close_permille`).
    fn keep_children(&mut self) {
        let depth = self.depth.max(1);
        let close = self.config.timing.close_permille(depth);
        if let Some(r) = self.round.as_mut() {
            r.depth = depth;
            if !r.pushes.is_empty() && matches!(r.sub, Sub::Open) {
                r.sub_close = Some(r.at(close));
            }
        }
    }

    /// The node heads its cohort this round: it collects pushes until its admission closes.
    pub(super) fn head(&mut self, now: Millis) {
        let collect = self.config.timing.collect_permille;
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        let until = r.at(collect);
        let was_member = self.config.fanout.is_some() && r.role == Role::Member && r.depth > 0;
        r.role = Role::Hub;
        r.depth = 0;
        r.hub = None;
        r.step = Step::Collect { until };
        // Children it held as a member (one whose hub left) are its members now: admitted
        // with the rest when its admission closes, not merged up at a member's level close,
        // and told their new depth, or they take no children of their own (`kindred-sim
        // cohorts --nodes 100000 --churn 0.3 --seed 3`, round 14: the new root merged as a
        // sub-hub, its members sent its task's other nodes back to it; the task lost the round).
        if matches!(r.sub, Sub::Open) {
            r.sub_close = None;
            if was_member {
                for p in &r.pushes {
                    self.out.push_back(Output::Answer {
                        to: p.from.clone(),
                        round: r.number,
                        answer: Answer::Accepted { depth: 0 },
                    });
                }
            }
        }
        if now >= until {
            self.close_admission();
        }
    }

    /// In a tree, the node is its own hub but pushes to its next rank this round, as an idle
    /// hub ([`crate::exchange::ExchangeConfig::idle_rounds`]), not to catch up.
    fn idle_push(&self) -> bool {
        self.config.fanout.is_some()
            && self.view.is_own(&self.view.hub())
            && !self.catching_up()
            && self
                .round
                .as_ref()
                .is_some_and(|r| r.role == Role::Member && !r.is_done())
    }

    /// Pushes the node held as a would-be hub (or, in a tree, while it joined a hub it was no
    /// member of: those pushers must join that hub, and take its model, themselves) go to
    /// `hub`, its checked hub; in a tree it keeps those `hub` named to them, as its children.
    /// An idle hub pushing to its next rank (its view's hub is itself) answers them late
    /// instead: it outranks `hub`, and is a hub again next round.
    fn redirect_held(&mut self, hub: &P, rank: u64) {
        let idle_push = self.view.is_own(&self.view.hub()) && !self.catching_up();
        let tree = self.config.fanout.is_some();
        let Some(r) = self.round.as_mut() else { return };
        let round = r.number;
        let (kept, redirected): (Vec<_>, Vec<_>) = std::mem::take(&mut r.pushes)
            .into_iter()
            .partition(|p| tree && !idle_push && p.via.as_ref() == Some(hub));
        r.pushes = kept;
        for p in redirected {
            let answer = if idle_push {
                Answer::Late
            } else {
                Answer::NotHub {
                    hub: hub.clone(),
                    rank,
                }
            };
            self.out.push_back(Output::Answer {
                to: p.from,
                round,
                answer,
            });
        }
    }

    /// No answer to a fetch in time: ask again, with a new ticket.
    pub(super) fn fetch_again(&mut self, now: Millis, close: Millis) {
        let answer_ms = self.config.timing.answer_ms;
        let ticket = self.ticket();
        let Some(r) = self.round.as_mut() else { return };
        let Some(hub) = r.hub.clone() else { return };
        let earlier = match &r.step {
            Step::Fetch { ticket, .. } => Some(*ticket),
            _ => None,
        };
        r.retries += 1;
        r.step = Step::Fetch {
            ticket,
            earlier,
            until: now.saturating_add(answer_ms).min(close),
            close,
        };
        self.out.push_back(Output::FetchModel { ticket, hub });
    }

    /// The hub answered neither a push (or fetch) nor its retry: it is gone (crashed, or
    /// unreachable), and the member drops it at once rather than after
    /// [`crate::exchange::ExchangeConfig::max_misses`] rounds (a hub alive but busy or late
    /// answers). At `kindred-sim learn --setting label --hub-crash 0.1 --down-rounds 3` (64
    /// nodes, seeds 1-3) this spares members a second lost round per crash.
    ///
    /// In a tree the member then chooses again within the round's redirect budget (its next
    /// rank, or itself), as after a failed model fetch: a sub-hub that left at the round's start
    /// would otherwise cost its whole subtree the round, and a root that left its whole task
    /// (`kindred-sim cohorts --nodes 10000 --churn 0.3`).
    pub(super) fn gone(&mut self, now: Millis) {
        if let Some(hub) = self.member_hub() {
            tracing::debug!(?hub, "exchange: hub gone");
            self.drop_hub(&hub);
            if self.config.fanout.is_some() && self.choose_again(now, &hub) {
                return;
            }
        }
        self.finish(Apply::Nothing, true);
    }

    /// Accepted, but no merge by [`crate::exchange::Timing::merge_ask_permille`]: ask the hub
    /// for it (once).
    pub(super) fn ask_merge(&mut self) {
        let Some(r) = self.round.as_mut() else { return };
        let Step::Pushed { ask, .. } = &mut r.step else {
            return;
        };
        *ask = None;
        let Some(hub) = r.hub.clone() else { return };
        self.out.push_back(Output::FetchMerge {
            hub,
            round: r.number,
        });
    }

    pub(super) fn push(&mut self, now: Millis, joining: Joining<M>) {
        let version = self.view.version();
        let answer_ms = self.config.timing.answer_ms;
        let max_listed = self.config.max_listed;
        // A sub-hub whose children's merge is made pushes that in place of its packet.
        let Some((packet, hub)) = self.round.as_ref().and_then(|r| {
            let packet = match &r.sub {
                Sub::Up { merge, .. } => merge.clone(),
                _ => r.packet.clone()?,
            };
            Some((packet, r.hub.clone()?))
        }) else {
            return;
        };
        // The hub heard this view already: the push names no peers.
        let known = if self.told.as_ref() == Some(&(hub.clone(), version)) {
            Vec::new()
        } else {
            let mut known = self.view.ranked();
            known.truncate(max_listed);
            known
        };
        let Some(r) = self.round.as_mut() else { return };
        r.told_version = version;
        r.step = Step::Pushed {
            joining,
            accepted: false,
            answer_by: now.saturating_add(answer_ms).min(r.deadline),
            ask: None,
        };
        self.out.push_back(Output::Push {
            to: hub,
            round: r.number,
            packet,
            known,
            via: r.via.clone(),
        });
    }

    pub(super) fn model_received(&mut self, now: Millis, ticket: Ticket, model: Option<M>) {
        let Some(r) = self.round.as_ref() else { return };
        let (
            Step::Fetch {
                ticket: t,
                earlier,
                close,
                ..
            },
            Some(hub),
        ) = (&r.step, r.hub.clone())
        else {
            return;
        };
        // The retried fetch's answer counts only if it brought the model: its failure says
        // nothing about the retry still in flight.
        if *t != ticket && !(*earlier == Some(ticket) && model.is_some()) {
            return;
        }
        let until = *close;
        match model {
            Some(model) => {
                let ticket = self.ticket();
                self.set_step(Step::CheckModel {
                    ticket,
                    model: model.clone(),
                    until,
                });
                self.out
                    .push_back(Output::CheckModel { ticket, hub, model });
            }
            None => {
                // The fetch failed (the hub is unreachable, or sent what does not decode): it
                // cannot take the node in. Dropped, as a silent hub is, and the node chooses
                // again within the round: members of a departed root learn it again from each
                // other's views, and each lost a round per try (`kindred-sim cohorts --nodes
                // 10000 --churn 0.3 --seed 4`: a task out of every tree for 4 rounds, 3 with
                // the next rank taken at once; seed 6: 3 rounds, 1).
                tracing::debug!(?hub, "exchange: hub model not fetched");
                self.drop_hub(&hub);
                self.next_rank(now, &hub);
            }
        }
    }

    pub(super) fn model_checked(&mut self, now: Millis, ticket: Ticket, verdict: ModelVerdict) {
        let Some(r) = self.round.as_ref() else { return };
        let (
            Step::CheckModel {
                ticket: t, model, ..
            },
            Some(hub),
        ) = (&r.step, r.hub.clone())
        else {
            return;
        };
        if *t != ticket {
            return;
        }
        let model = model.clone();
        match verdict {
            ModelVerdict::Adopt | ModelVerdict::Keep => {
                // A member fetching its own hub's model again (another lineage's merge came):
                // its data accepts the model of the merges it applies, so it takes it; in a
                // tree it keeps its children.
                let rebase = self.rebase && self.joined.as_ref() == Some(&hub);
                if !(rebase && self.config.fanout.is_some()) {
                    let rank = self.rank_of(&hub);
                    self.redirect_held(&hub, rank);
                }
                let joining = if verdict == ModelVerdict::Adopt || rebase || self.is_stranded() {
                    Joining::Adopt(model)
                } else {
                    Joining::Keep
                };
                self.push(now, joining);
            }
            ModelVerdict::Refuse => {
                // Its update never enters another task's (or a liar's) merge. It is early in
                // the round: the node takes the next rank now, as after a redirect, so a hub
                // its data refuses costs it a model fetch, not a round. The node forgets the
                // hub, and bans it if its data refused its model before. Models fail the check
                // more often than merges do, and not only liars' (at 1,000 nodes, hubs of the
                // node's own task whose models went another way): banned at the first refusal,
                // `kindred-sim learn --nodes 1000 --setting label --seed 1` ended at 86.53%
                // against 87.03%; never banned, a liar's model is fetched again whenever a
                // search finds it, and seed 2 of `--hostile 0.2 --hostile-low-rank` lost 1.30
                // points against 0.54.
                tracing::debug!(?hub, "exchange: its data refuses the hub's model");
                if self.view.model_refused(&hub) {
                    self.refuse(&hub);
                } else {
                    self.view.forget(&hub);
                }
                self.next_rank(now, &hub);
            }
        }
    }

    /// `left` is no longer the node's hub (refused): within the round's redirect budget it
    /// chooses again (another hub to join, or itself), otherwise it ends the round alone.
    fn next_rank(&mut self, now: Millis, left: &P) {
        if self.round.is_some() && !self.choose_again(now, left) {
            self.finish(Apply::Nothing, false);
        }
    }

    /// The node left `left` this round: if its view now names another hub and the round's
    /// redirect budget allows, it chooses again (another hub to join, or itself). Whether it
    /// did; if not, the caller ends the round.
    fn choose_again(&mut self, now: Millis, left: &P) -> bool {
        let max_redirects = self.config.max_redirects;
        let moved = self.view.hub() != *left;
        let Some(r) = self.round.as_mut() else {
            return false;
        };
        r.redirects += 1;
        if !moved || r.redirects > max_redirects {
            return false;
        }
        r.step = Step::Packet;
        self.choose(now);
        true
    }

    pub(super) fn answer_received(&mut self, now: Millis, from: P, round: u64, answer: Answer<P>) {
        let max_redirects = self.config.max_redirects;
        let ask_permille = self.config.timing.merge_ask_permille;
        let timing = self.config.timing;
        let max_hints = u32::from(self.config.max_depth()).saturating_add(1);
        let idle_push = self.idle_push();
        let Some(r) = current(&mut self.round, round) else {
            return;
        };
        let ask_at = r.at(ask_permille);
        let deadline = r.deadline;
        let pushed_up = matches!(r.sub, Sub::Up { .. });
        let Step::Pushed {
            joining,
            accepted,
            ask,
            ..
        } = &mut r.step
        else {
            return;
        };
        let Some(hub) = r.hub.clone().filter(|h| *h == from) else {
            return;
        };
        match answer {
            Answer::Accepted { depth } => {
                if !*accepted {
                    *accepted = true;
                    *ask = Some(ask_at.max(now)).filter(|&t| t < deadline);
                }
                // One level below its hub: its children's admission closes by that.
                r.depth = depth.saturating_add(1);
                if r.sub_close.is_some() {
                    r.sub_close = Some(r.at(timing.close_permille(r.depth)));
                }
                self.depth = r.depth;
            }
            // The answer to a sub-hub's merge pushed in place of its accepted packet: the hub
            // merges the packet.
            Answer::Late | Answer::Busy | Answer::Full { .. } if *accepted && pushed_up => {}
            // In a tree, an idle hub its next rank does not take heads its own cohort for the
            // rest of the round: its cohort may come to it in this round (their root left),
            // and two idle hubs pushing to each other must not both end it (`kindred-sim
            // cohorts --nodes 100000 --churn 0.3 --seed 3`: a whole task lost a round so).
            // (Heading as soon as it is pushed to kept trees from forming: at 10^5 nodes no
            // task had 2% of its nodes in one tree in rounds 3-6.)
            Answer::Late | Answer::Busy if idle_push => {
                if matches!(answer, Answer::Busy) {
                    self.miss(&hub);
                }
                self.head(now);
            }
            Answer::Late => self.finish(Apply::Nothing, false),
            Answer::Full { hint, rank } => {
                // The hub admits no more: it names one of its members to push to, in its
                // cohort (no model to fetch).
                r.full_hints += 1;
                if r.full_hints > max_hints {
                    self.finish(Apply::Nothing, true);
                    return;
                }
                let joining = joining.clone();
                r.via = Some(hub);
                r.hub = Some(hint.clone());
                self.view.learn([(hint, rank)]);
                self.push(now, joining);
            }
            // Its tree parent takes no push from it: the parent lost its own hub and now pushes
            // to this node, which outranks it (or joins it). The node leaves the parent and,
            // within the round's redirect budget, chooses again (its next rank, or itself), so
            // the two never end the round waiting on each other: `kindred-sim cohorts --nodes
            // 10000 --churn 0.3 --seed 4` lost a whole task's round that way after its root left.
            Answer::Busy if self.config.fanout.is_some() && self.joined.as_ref() == Some(&hub) => {
                self.joined = None;
                if !self.choose_again(now, &hub) {
                    self.miss(&hub);
                    self.finish(Apply::Nothing, true);
                }
            }
            Answer::Busy => {
                self.miss(&hub);
                self.finish(Apply::Nothing, true);
            }
            Answer::NotHub { hub: hint, .. } if !self.dialable && self.view.is_own(&hint) => {
                // The hub takes this node for the hub: it does not know yet that peers cannot
                // dial it (`Exchange::set_dialable`). Not followed; the hub stays.
                self.finish(Apply::Nothing, true);
            }
            Answer::NotHub { hub: hint, rank } => {
                r.redirects += 1;
                let redirects = r.redirects;
                if self.config.fanout.is_some() && self.joined.as_ref() == Some(&hub) {
                    // Its (sub-)hub no longer takes it: it is no longer the parent it sticks to.
                    self.joined = None;
                }
                self.view.learn([(hint, rank)]);
                if self.view.hub() == hub {
                    // The hub names a hub this node will not take (banned, itself, or one it
                    // outranks: a hub back from a crash catching up, `catch_up_after`). It
                    // forgets that hub and, within the round's redirect budget, chooses
                    // again: the next rank, or itself.
                    self.view.forget(&hub);
                    if redirects > max_redirects {
                        self.finish(Apply::Nothing, false);
                    } else {
                        self.set_step(Step::Packet);
                        self.choose(now);
                    }
                } else if redirects > max_redirects {
                    self.finish(Apply::Nothing, false);
                } else {
                    self.set_step(Step::Packet);
                    self.choose(now);
                }
            }
            Answer::Refused { foreign: true } => {
                // The hub's data refused its cohort's merge: it is another task's node.
                self.refuse(&hub);
                self.finish(Apply::Nothing, false);
            }
            Answer::Refused { foreign: false } => {
                // Refused by a hub it has not joined: its model may have drifted from the
                // cohort's. It takes the hub's model its data accepted, and its next push is
                // admitted. A member of the hub joins it anew next round (its model drifted:
                // it missed merges), and one that keeps its model forgets the hub.
                if let Joining::Adopt(model) = joining {
                    let model = model.clone();
                    self.joined = Some(hub);
                    self.finish(Apply::Adopt(model), false);
                } else if matches!(joining, Joining::Member) {
                    self.joined = None;
                    self.finish(Apply::Nothing, false);
                } else {
                    self.view.forget(&hub);
                    self.finish(Apply::Nothing, false);
                }
            }
        }
    }

    pub(super) fn merge_received(
        &mut self,
        from: P,
        round: u64,
        merge: M,
        (cosine, lineage): (f32, u64),
        listed: Vec<(P, u64)>,
    ) {
        let by_data_from = self.config.data_checks_from;
        let exchange_round = self.exchange_round(round);
        let Some(r) = current(&mut self.round, round) else {
            return;
        };
        let (Step::Pushed { joining, .. }, Some(own)) = (&r.step, r.packet.clone()) else {
            return;
        };
        let Some(hub) = r.hub.clone().filter(|h| *h == from) else {
            return;
        };
        let joining = joining.clone();
        // The first merge of a hub it joins is not checked on its data: its data checked the
        // hub's model before it pushed.
        let by_data =
            matches!(joining, Joining::Member) && exchange_round.is_some_and(|x| x >= by_data_from);
        if self.misses.as_ref().is_some_and(|(p, _)| *p == hub) {
            self.misses = None;
        }
        let ticket = self.ticket();
        self.set_step(Step::CheckMerge {
            joining,
            ticket,
            merge: merge.clone(),
            cosine,
            lineage,
            listed,
        });
        self.out.push_back(Output::CheckMerge {
            ticket,
            hub,
            merge,
            own,
            by_data,
        });
    }

    pub(super) fn member_verdict(
        &mut self,
        joining: Joining<M>,
        merge: M,
        (cosine, lineage): (f32, u64),
        listed: Vec<(P, u64)>,
        verdict: MergeVerdict,
    ) {
        let Some(hub) = self.member_hub() else { return };
        match verdict {
            MergeVerdict::Pass => {
                self.doubted = None;
                let told = self.round.as_ref().map_or(0, |r| r.told_version);
                self.told = Some((hub.clone(), told));
                let member = matches!(joining, Joining::Member);
                let adopt = match joining {
                    Joining::Adopt(model) => Some(model),
                    Joining::Member | Joining::Keep => None,
                };
                if member {
                    // A merge of another lineage: its model is not its hub's, and never
                    // becomes it by merges alone. It fetches the hub's model next round.
                    self.rebase = lineage != self.lineage;
                } else {
                    // It took the hub's model, or its data chose to keep its own.
                    self.lineage = lineage;
                    self.rebase = false;
                }
                if !listed.is_empty() {
                    self.mates = listed.iter().map(|(p, _)| p.clone()).collect();
                } else if self.joined.as_ref() != Some(&hub) {
                    self.mates.clear();
                }
                self.joined = Some(hub);
                self.view.merged(cosine);
                // The hub's view, itself included, less the lower ranks it has not joined.
                self.view.learn(listed);
                self.finish(Apply::Merge { merge, adopt }, false);
            }
            MergeVerdict::Aggregate => {
                // A ban, and the node takes the next rank from its next round: a hub whose
                // merges fail (a liar that ground a low rank) costs each member one round.
                tracing::debug!(?hub, "exchange: merge fails its check");
                self.refuse(&hub);
                self.finish(Apply::Nothing, false);
            }
            MergeVerdict::Data => {
                tracing::debug!(?hub, "exchange: its data refuses the merge");
                self.refuse(&hub);
                self.finish(Apply::Nothing, false);
            }
            MergeVerdict::Doubt => {
                // Refused either way; banned at the second doubtful merge in a row, so a
                // liar serving another task's merges costs each member two rounds.
                if self.doubted.take().as_ref() == Some(&hub) {
                    tracing::debug!(?hub, "exchange: a second doubtful merge in a row");
                    self.refuse(&hub);
                } else {
                    tracing::debug!(?hub, "exchange: a doubtful merge refused");
                    self.doubted = Some(hub);
                }
                self.finish(Apply::Nothing, false);
            }
        }
    }

    /// `p`'s rank as the view holds it (its own for the node).
    pub(super) fn rank_of(&self, p: &P) -> u64 {
        self.view.rank_of(p)
    }
}
