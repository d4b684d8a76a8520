//! The hub exchange as a sans-IO state machine: one core, two drivers (DESIGN.md §6a).
//!
//! # Why one core
//! Kindred's results come from the hub exchange: a cohort's members push their packets to one
//! hub, which merges them robustly and answers with one distilled merge, so each member moves
//! two compressed updates a round whatever the cohort's size. The node runs it over libp2p and
//! the simulator runs thousands of virtual nodes in virtual time; if each wrote its own rules,
//! the simulator's figures would describe code that users never run. So the rules live here,
//! in a state machine per node that takes inputs with a time and returns outputs, in the style
//! of quinn-proto: no sockets, no clock, no tasks, no reads of another node's state. The
//! drivers carry messages and do the heavy compute (the robust merge, distilling it, the checks
//! by direction, norm and data) when the core asks, and report back. Payloads are the driver's
//! handles (`M`: an id, an `Arc`, an index), so a core costs a few hundred bytes and 10^6 of
//! them fit a simulator.
//!
//! # Roles
//! A node trains alone for [`ExchangeConfig::local_rounds`] rounds (its embedding must describe
//! its data), counted, like its warm-up searches and candidate rounds, from the first round it
//! runs: round numbers are the swarm's (the node's are its wall clock's), so a node that joins
//! late warms up like one that started with the swarm. Then, each round:
//! 1. **Search.** A node that is its own hub searches its band keys in exchange rounds
//!    `0..warmup_searches` and then every [`ExchangeConfig::search_every`] (a tree's roots
//!    every [`ExchangeConfig::tree_search_every`]), and in the round
//!    after a search that taught it new peers (`kindred-sim cohorts --nodes 1000000`, seed 1:
//!    every task 99% in one tree by round 9 with, round 16 without) or found peers it could
//!    not reach yet ([`Exchange::search_unreached`]) (and, while it
//!    knows nobody, in exchange round 4 and the last round of every key window
//!    ([`ExchangeConfig::key_window`]), and in the round after it lost every peer it knew);
//!    while cohorts form ([`ExchangeConfig::candidate_rounds`]) only hub candidates ([`crate::is_hub_candidate`])
//!    and nodes whose earlier search found nobody announce, the others look up only. While its
//!    view is small after its first search (a small task, or a fragment of one) it looks up
//!    [`ExchangeConfig::probes`] multi-probe keys too, and [`ExchangeConfig::search_probes`]
//!    in every search after the warm-up. It learns the headers the cosine gate
//!    admits and the hubs they name ([`Cohort::learn`]); a *stranded* node, one that took
//!    fewer than two pushes as its own hub or applied its own update as a member for
//!    [`ExchangeConfig::stranded_after`] rounds in a row,
//!    learns the nearest few below the gate as well, and takes the model of a hub its data
//!    accepts even when it is far from its own (step 2).
//! 2. **Join and push.** Its hub is the lowest rank it knows ([`Cohort::hub`]). Views need not
//!    be symmetric: a node may outrank a cohort that never found it, and wait for pushes that
//!    never come. So a hub nobody pushed to for [`ExchangeConfig::idle_rounds`] pushes to its
//!    next rank for one round; that hub learns of it and hands its cohort over. So does a node
//!    back after missing rounds ([`ExchangeConfig::catch_up_after`]), whose model fell behind
//!    its cohort's: it takes the next rank's model before it heads them again. A node that has
//!    not joined that hub first fetches the hub's model and has its own data check it
//!    ([`ModelVerdict`]); if the data refuses it the node does not push, so another task's node
//!    never enters a merge. Then it pushes its packet with its view.
//! 3. **Admit and merge.** A hub takes pushes until it closes its admission
//!    ([`Timing::collect_permille`]), then admits those its cosine gate passes, measured
//!    against the nearest pusher and its [`Cohort::anchor`], refuses the others, and asks its
//!    driver for the merge. A member it refuses has drifted from the cohort's model (it missed
//!    merges): it joins the hub anew next round, and takes the hub's model if its data accepts
//!    it and the hub refuses it again. From exchange round [`ExchangeConfig::data_checks_from`] its own
//!    data checks the merge: refused, it heads another task's cohort and serves nobody.
//!    Otherwise it serves the merge with its view ([`Cohort::listed`]) and learns its members'.
//! 4. **Check and apply.** A member has every merge checked (direction and norm; and on its
//!    data once it has joined) and applies it, or applies its own update and bans the hub for
//!    [`ExchangeConfig::ban_rounds`] (at its second merge in a row that only the output-layer
//!    check doubts: [`MergeVerdict::Doubt`]). The first merge of a hub it joins comes with the
//!    hub's model, adopted first, so the cohort holds one model. A new rank window that moves
//!    the hub to another peer of the node's cohort needs no model fetch (`mates`). Each merge
//!    names the lineage of its hub's model ([`Exchange::lineage`]): a member whose model is of
//!    another (it applied its own update once, or its hub took another tree's model) fetches
//!    its hub's model next round, so the cohort stays one model whatever way it formed.
//!
//! # Time and faults
//! Every wait has a deadline inside the round: a search ends by [`Timing::search_permille`], a
//! join by the admission's close, a push or a model fetch waits [`Timing::answer_ms`] for its
//! answer and is sent once more ([`ExchangeConfig::retries`]; the first request's model, if it
//! comes after all, is taken as the retry's would be), a member accepted with no
//! merge by [`Timing::merge_ask_permille`] asks for it again ([`Output::FetchMerge`]), and
//! everything ends at the round's deadline, where a member with no merge applies its own
//! update. A hub silent to a push and its retry, or whose model cannot be fetched, is gone:
//! the member drops it at once, for [`ExchangeConfig::dropped_rounds`] rounds in which peers
//! that still name it do not bring it back, and a failed fetch takes the next rank within the
//! round. One that is busy or serves nothing by the deadline is a *miss*; after
//! [`ExchangeConfig::max_misses`] misses in a row the member forgets it. Either way the member
//! takes the next rank (the hub is relearned, and its model checked again, if it comes back).
//! A node that is not its own hub answers a push with the hub it pushes to
//! ([`Answer::NotHub`]), once its own data has checked that hub's model (until then it holds
//! the push), and the pusher follows within the round. A member whose data refuses a hub's
//! model forgets it (bans it the second time) and takes the next rank within the round too;
//! one whose merge check fails bans the hub and takes the next rank from its next round. Every
//! round started ends with exactly one [`Output::Finished`], at the latest when the driver
//! calls [`Exchange::handle_timeout`] at the deadline.
//!
//! # Bounded hubs: a cohort as a tree
//! One hub merging a whole cohort does not scale: at 10^6 nodes and 4 tasks it would take
//! 250,000 pushes a round. With [`ExchangeConfig::fanout`] `Some(m)` a hub admits at most `m`
//! pushes, and answers the next pusher [`Answer::Full`], naming the held pusher it named least
//! often this round. That member takes the pusher as its *child*: a member holding children is
//! a sub-hub, which closes their admission one level before its own hub closes
//! ([`Timing::level_permille`]; its depth comes with its hub's [`Answer::Accepted`]), merges
//! them with its own packet ([`Output::Merge`] with `up`) and pushes that merge up in place of
//! its packet. Merges come back down the same way: a sub-hub checks its hub's merge as any
//! member does, applies it and serves it to its children, so the whole cohort applies one
//! merge; if none comes, its children get its merge of theirs. A cohort of `n` nodes is then
//! a tree of depth about log_m n, and no node merges more than `m` updates. A member keeps
//! pushing to the (sub-)hub whose merge it applied last, and a (sub-)hub keeps a place for
//! each peer it served last round until that one pushes: the tree stays put from round to
//! round. A sub-hub pushes its packet at once (that keeps its place, and the answer tells it
//! its depth) and its children's merge in its place later. Only members of their hub take
//! children, or pushers their own hub named to them ([`Output::Push::via`]): a node that
//! joins another cohort's hub names that hub to its old members instead, so each of them
//! checks and takes that hub's model itself, and the cohort keeps one model. In a tree a
//! hub's own data checks every merge it makes, from the first exchange round: a sub-hub's
//! merge came up checked by nobody's data.
//!
//! # Views on the wire
//! A push names the member's view and a merge the hub's ([`Cohort::listed`]), each the
//! [`ExchangeConfig::max_listed`] lowest ranks, and only when it changed since that peer last
//! received it: views spread both ways until a connected cohort agrees on one hub, and then
//! cost nothing (a view of 64 peers is 2.5 KB of `PeerId`s, where the rest of a member's round
//! is about 18 KB).
//!
//! # Trust
//! Nothing a peer says is taken on faith: ranks are the driver's [`crate::hub_rank_at`] of
//! identities in the round's rank window ([`ExchangeConfig::rank_window`],
//! [`Exchange::rerank`]), never read from messages; cosines are measured by the driver on
//! signed headers; a merge is applied only after the driver's checks pass
//! ([`MergeVerdict::Pass`]); a model only after the node's data accepted it. A peer's answers
//! can waste a member's round (a miss), not change its model. Ranks by window keep one ground
//! identity from being a hub for longer than a window; they do not stop an attacker who grinds
//! a key per window ahead of time (the window number is public: [`crate::hub_rank_at`] says
//! why). Such a hub still faces every member's checks, and one failed merge bans it
//! ([`ExchangeConfig::ban_rounds`]; two doubted ones in a row): with a fifth of the nodes hostile and ranked lowest in
//! every window, honest nodes lost 0.38 ± 0.27 point (`kindred-sim learn --nodes 64 --setting
//! label --hostile 0.2 --hostile-low-rank --seed 1..3`).
//!
//! # Persistence
//! [`Exchange::snapshot`] is what survives a restart (the view, its bans and their ends, the hub
//! joined, the misses, the first round), versioned ([`SNAPSHOT_VERSION`]);
//! [`Exchange::restore`] takes it back. A round in flight is not part of it: a restored node
//! begins at its next round, as a crashed one would.

mod config;
mod hub;
mod io;
mod member;
mod round;
mod view;

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use crate::Cohort;
pub use config::{ExchangeConfig, Timing};
pub use io::{
    Answer, Apply, Input, MergeVerdict, Millis, ModelVerdict, Output, Recipient, Role, RoundReport,
    SeenHeader, Ticket,
};
use round::{Round, Step};
use view::{View, ViewState};

/// The version of [`Snapshot`] this build writes and reads.
pub const SNAPSHOT_VERSION: u16 = 5;

/// Rounds at most that a node back after missing rounds spends joining its next rank
/// ([`ExchangeConfig::catch_up_after`]) before it heads its cohort again, caught up or not.
pub const CATCH_UP_ROUNDS: u64 = 3;

/// Why [`Exchange::restore`] refused a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RestoreError {
    /// The snapshot was written by another version of the exchange.
    #[error("exchange snapshot version {found}, this build reads {supported}")]
    Version {
        /// The snapshot's version.
        found: u16,
        /// The version this build reads ([`SNAPSHOT_VERSION`]).
        supported: u16,
    },
}

/// What persists of an [`Exchange`] ([`Exchange::snapshot`]): serialize it with serde (postcard
/// in the node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot<P> {
    version: u16,
    view: ViewState<P>,
    joined: Option<P>,
    misses: Option<(P, u32)>,
    first_round: Option<u64>,
    last_round: Option<u64>,
    next_ticket: u64,
    window: u64,
    lineage: u64,
    lineage_seed: u64,
    lineage_epoch: u64,
}

impl<P> Snapshot<P> {
    /// The version it was written by.
    pub fn version(&self) -> u16 {
        self.version
    }
}

/// One node's hub exchange: its cohort view, its role each round, and every wait's deadline.
///
/// # Driving it
/// The driver feeds [`Input`]s with [`Exchange::handle`] and, whenever the clock reaches
/// [`Exchange::poll_timeout`], calls [`Exchange::handle_timeout`]; after either, it drains
/// [`Exchange::poll_output`] and carries out every [`Output`] (sends a message, runs a
/// search, computes or checks a merge and reports back with the echoed [`Ticket`]). Per round:
/// [`Input::RoundStart`], then [`Input::PacketReady`] when the node's packet is sealed; the
/// round ends with one [`Output::Finished`], by its deadline. `P` is the peer type, `M` the
/// driver's handle for a packet, a merge or a model.
///
/// ```
/// use kindred_routing::exchange::{Apply, Exchange, ExchangeConfig, Input, Millis, Output, Role};
///
/// let config = ExchangeConfig { local_rounds: 1, ..ExchangeConfig::default() };
/// let mut node: Exchange<&str, u32> = Exchange::new("me", 42, config);
///
/// // Round 0 is a local round: the node applies its own update.
/// node.handle(Millis(0), Input::RoundStart { round: 0, deadline: Millis(1_000) });
/// node.handle(Millis(10), Input::PacketReady { round: 0, packet: 7 });
/// match node.poll_output() {
///     Some(Output::Finished(report)) => {
///         assert_eq!((report.role, report.apply), (Role::Local, Apply::Own(7)));
///     }
///     other => panic!("{other:?}"),
/// }
///
/// // Round 1: alone, it is its own hub and searches; nobody is found, nobody pushes.
/// node.handle(Millis(1_000), Input::RoundStart { round: 1, deadline: Millis(2_000) });
/// node.handle(Millis(1_010), Input::PacketReady { round: 1, packet: 8 });
/// assert!(matches!(node.poll_output(), Some(Output::Search { round: 1, .. })));
/// node.handle(Millis(1_050), Input::SearchDone { round: 1, headers: Vec::new() });
/// // It waits for pushes until its admission closes, then applies its own update.
/// let close = node.poll_timeout().unwrap();
/// node.handle_timeout(close);
/// match node.poll_output() {
///     Some(Output::Finished(report)) => assert_eq!(report.apply, Apply::Own(8)),
///     other => panic!("{other:?}"),
/// }
/// assert_eq!(node.poll_timeout(), None); // nothing to wait for until the next round
/// ```
#[derive(Debug, Clone)]
pub struct Exchange<P, M> {
    config: ExchangeConfig,
    view: View<P>,
    /// The hub whose merge the node took last (itself once it served as a hub).
    joined: Option<P>,
    /// The hub that missed, and how many times in a row.
    misses: Option<(P, u32)>,
    /// A member: the hub its view was last told to (a merge came back), and that view's
    /// version; its pushes name no peers until the view changes.
    told: Option<(P, u64)>,
    /// A hub: the version of its view each member last received with a merge.
    listed_to: BTreeMap<P, u64>,
    /// Exchange rounds in a row the node was its own hub, knew peers from the round's start,
    /// and nobody pushed to it ([`ExchangeConfig::idle_rounds`]). Not persisted: a restart
    /// costs that many rounds.
    idle: u32,
    /// Exchange rounds in a row the node was its own hub and took fewer than two pushes, or a
    /// member that applied its own update ([`ExchangeConfig::stranded_after`]). Not persisted.
    stranded: u32,
    /// It searches again next round, as its own hub: its last search taught its view new
    /// peers (two trees of one task that missed each other then meet within the key window
    /// rather than at the next scheduled search), or found peers it could not reach yet
    /// ([`Exchange::search_unreached`]). Not persisted.
    search_again: bool,
    /// A node back after missing rounds ([`ExchangeConfig::catch_up_after`]) joins its next
    /// rank rather than head its cohort with a stale model, until it applies a merge there or
    /// until this round ([`CATCH_UP_ROUNDS`] after its return). Not persisted: a restart
    /// finds the gap again.
    catch_up_until: Option<u64>,
    /// The peers of the node's last cohort: a hub's members served its last merge, a member's
    /// peers listed by its hub with a merge it applied. A new rank window that makes one of them
    /// the node's hub moves the hub within the cohort, whose members hold one model: the node
    /// joins it without fetching that model (its data checks every merge of it). Not persisted.
    mates: Vec<P>,
    /// In a tree, the members (or children) the node served its last merge to: their places
    /// are kept for them ([`ExchangeConfig::fanout`]). Not persisted.
    served_last: Vec<P>,
    /// The first round the node ran: its local rounds, warm-up searches and candidate rounds
    /// count from there (round numbers are the swarm's, the same for every node).
    first_round: Option<u64>,
    last_round: Option<u64>,
    next_ticket: u64,
    /// The rank window the view's ranks are of ([`Exchange::rerank`]).
    window: u64,
    /// Whether peers can dial this node ([`Exchange::set_dialable`]). Not persisted.
    dialable: bool,
    /// Its depth as a member in its cohort's tree when last told ([`Answer::Accepted`]): a
    /// member that takes children before its hub answers closes their admission by it. Not
    /// persisted.
    depth: u8,
    /// The lineage of the node's model ([`Exchange::lineage`]).
    lineage: u64,
    /// What its fresh lineages derive from: its rank when it was made (a hash of its identity).
    lineage_seed: u64,
    /// How many fresh lineages it took.
    lineage_epoch: u64,
    /// It applied a merge of another lineage than its model's: it fetches its hub's model
    /// again next round, as when it joins ([`Exchange::lineage`]). Not persisted.
    rebase: bool,
    /// The hub whose last merge the node's data doubted ([`MergeVerdict::Doubt`]): banned if
    /// its next merge is doubted too. Not persisted.
    doubted: Option<P>,
    round: Option<Round<P, M>>,
    /// Outputs not yet polled: at most one per push held and a few more per input.
    out: VecDeque<Output<P, M>>,
}

impl<P: Clone + Ord + std::fmt::Debug, M: Clone> Exchange<P, M> {
    /// A node `own` of rank `own_rank` ([`crate::hub_rank_at`] of its identity in window 0)
    /// that knows nobody.
    pub fn new(own: P, own_rank: u64, config: ExchangeConfig) -> Self {
        let view = View::new(own, own_rank, config.max_members);
        Self {
            config,
            view,
            joined: None,
            misses: None,
            told: None,
            listed_to: BTreeMap::new(),
            idle: 0,
            stranded: 0,
            search_again: false,
            catch_up_until: None,
            mates: Vec::new(),
            served_last: Vec::new(),
            first_round: None,
            last_round: None,
            next_ticket: 0,
            window: 0,
            dialable: true,
            depth: 1,
            lineage: lineage_of(own_rank, 0),
            lineage_seed: own_rank,
            lineage_epoch: 0,
            rebase: false,
            doubted: None,
            round: None,
            out: VecDeque::new(),
        }
    }

    /// The node whose first round is `round` (by default the first [`Input::RoundStart`] it
    /// is given): a driver that runs the node's local rounds itself, without the core (the
    /// simulator), says where they began.
    ///
    /// ```
    /// use kindred_routing::exchange::{Exchange, ExchangeConfig, Input, Millis, Output, Role};
    ///
    /// // Local rounds 0 and 1 ran outside the core; round 2 is the first exchange round.
    /// let mut node: Exchange<&str, u32> =
    ///     Exchange::new("me", 42, ExchangeConfig::default()).with_first_round(0);
    /// node.handle(Millis(0), Input::RoundStart { round: 2, deadline: Millis(1_000) });
    /// node.handle(Millis(10), Input::PacketReady { round: 2, packet: 7 });
    /// assert!(matches!(node.poll_output(), Some(Output::Search { round: 2, .. })));
    /// ```
    pub fn with_first_round(mut self, round: u64) -> Self {
        self.first_round = Some(round);
        self
    }

    /// What persists of the node ([`Snapshot`]).
    pub fn snapshot(&self) -> Snapshot<P> {
        Snapshot {
            version: SNAPSHOT_VERSION,
            view: self.view.state(),
            joined: self.joined.clone(),
            misses: self.misses.clone(),
            first_round: self.first_round,
            last_round: self.last_round,
            next_ticket: self.next_ticket,
            window: self.window,
            lineage: self.lineage,
            lineage_seed: self.lineage_seed,
            lineage_epoch: self.lineage_epoch,
        }
    }

    /// The node as `snapshot` left it, between rounds.
    ///
    /// # Errors
    /// [`RestoreError::Version`] if another version of the exchange wrote the snapshot.
    pub fn restore(config: ExchangeConfig, snapshot: Snapshot<P>) -> Result<Self, RestoreError> {
        if snapshot.version != SNAPSHOT_VERSION {
            return Err(RestoreError::Version {
                found: snapshot.version,
                supported: SNAPSHOT_VERSION,
            });
        }
        let view = View::restore(snapshot.view, config.max_members);
        Ok(Self {
            config,
            view,
            joined: snapshot.joined,
            misses: snapshot.misses,
            told: None,
            listed_to: BTreeMap::new(),
            idle: 0,
            stranded: 0,
            search_again: false,
            catch_up_until: None,
            mates: Vec::new(),
            served_last: Vec::new(),
            first_round: snapshot.first_round,
            last_round: snapshot.last_round,
            next_ticket: snapshot.next_ticket,
            window: snapshot.window,
            dialable: true,
            depth: 1,
            lineage: snapshot.lineage,
            lineage_seed: snapshot.lineage_seed,
            lineage_epoch: snapshot.lineage_epoch,
            rebase: false,
            doubted: None,
            round: None,
            out: VecDeque::new(),
        })
    }

    /// The driver's search of `round` found providers whose headers it could not read: peers
    /// it could not reach yet (behind NAT, their hole punch under way). A node that is its own
    /// hub and knows fewer than [`ExchangeConfig::probe_below`] peers then searches again the
    /// next round, as after a search that taught it new peers, rather than at its next scheduled
    /// search, up to a key window later. A hub with a cohort does not chase them: a peer that
    /// left stays a provider of its keys until their window ends.
    ///
    /// ```
    /// use kindred_routing::exchange::{Exchange, ExchangeConfig, Input, Millis, Output};
    ///
    /// let config = ExchangeConfig { local_rounds: 0, warmup_searches: 1, ..ExchangeConfig::default() };
    /// let mut node: Exchange<&str, u32> = Exchange::new("me", 42, config);
    /// node.handle(Millis(0), Input::RoundStart { round: 1, deadline: Millis(1_000) });
    /// node.handle(Millis(10), Input::PacketReady { round: 1, packet: 7 });
    /// assert!(matches!(node.poll_output(), Some(Output::Search { round: 1, .. })));
    /// node.handle(Millis(50), Input::SearchDone { round: 1, headers: Vec::new() });
    /// node.search_unreached(1);
    /// node.handle_timeout(node.poll_timeout().unwrap());
    /// assert!(matches!(node.poll_output(), Some(Output::Finished(_))));
    /// // Round 2 is no scheduled search, but the last one reached nobody it found.
    /// node.handle(Millis(1_000), Input::RoundStart { round: 2, deadline: Millis(2_000) });
    /// node.handle(Millis(1_010), Input::PacketReady { round: 2, packet: 8 });
    /// assert!(matches!(node.poll_output(), Some(Output::Search { round: 2, .. })));
    /// ```
    pub fn search_unreached(&mut self, round: u64) {
        if self.round.as_ref().is_some_and(|r| r.number == round)
            && self.view.hub() == *self.view.own()
            && self.view.cohort().len() < self.config.probe_below
        {
            self.search_again = true;
        }
    }

    /// Whether peers can dial this node (the driver's reachability: AutoNAT, relay
    /// reservations). A hub must accept every member's connection, so the driver also ranks a
    /// node that cannot be dialed after every dialable peer ([`crate::relay_only_rank`]); this
    /// flag covers the rounds before its peers know: a hub that names such a node as the hub
    /// (it does not know yet that the node is behind NAT) is not followed, the node misses
    /// that round's merge and keeps its hub, and the hub learns within a round or two.
    /// Default true.
    pub fn set_dialable(&mut self, dialable: bool) {
        self.dialable = dialable;
    }

    /// The rank window of `round` ([`ExchangeConfig::rank_window`]).
    pub fn window_of(&self, round: u64) -> u64 {
        round / self.config.rank_window.max(1)
    }

    /// The rank window the view's ranks are of (0 for a new node).
    pub fn rank_window(&self) -> u64 {
        self.window
    }

    /// Rank the node and every peer it knows by `rank`, the driver's [`crate::hub_rank_at`]
    /// of `window`. The driver calls it before a round of another window starts
    /// ([`Exchange::window_of`]), and ranks everything it hands in with that window from then
    /// on.
    pub fn rerank(&mut self, window: u64, rank: impl Fn(&P) -> u64) {
        self.window = window;
        self.view.rerank(rank);
        self.told = None;
        self.listed_to.clear();
        // The window moved the hub within the node's cohort: no model to fetch.
        let hub = self.view.hub();
        if self.joined.is_some() && !self.view.is_own(&hub) && self.mates.contains(&hub) {
            tracing::debug!(
                ?hub,
                "exchange: a new rank window moves the hub within the cohort"
            );
            self.joined = Some(hub);
        }
    }

    /// The lineage of the node's model: a number that names the sequence of merges the model
    /// is made of. Every member applying a hub's merges holds the hub's model only if it
    /// started from it; a node that applied anything else (its own update, a model without
    /// that round's merge) takes a fresh lineage, a member that adopts its hub's model takes
    /// the hub's, and a hub serves its lineage with every merge ([`Output::ServeMerge`]). A
    /// member handed a merge of another lineage than its own fetches its hub's model next
    /// round and takes it if its data accepts it, as when it joins.
    ///
    /// Why: when a fragment's root joins another tree (a rank move among `mates`, an idle root
    /// pushing up) only the root takes that tree's model; its members keep applying the
    /// tree's merges to their fragment's model for good. At `kindred-sim learn --nodes 1000
    /// --setting label --fanout 64` (seed 1) the nodes ended 0.56 point under their task's mean
    /// model: 92 different models ran from round 11 (133 by round 29), every task 99% in one
    /// tree.
    ///
    /// ```
    /// use kindred_routing::exchange::{Exchange, ExchangeConfig, Input, Millis};
    ///
    /// let config = ExchangeConfig { local_rounds: 1, ..ExchangeConfig::default() };
    /// let mut node: Exchange<&str, u32> = Exchange::new("me", 42, config);
    /// let first = node.lineage();
    /// // A local round: the node applies its own update, a model nobody else holds.
    /// node.handle(Millis(0), Input::RoundStart { round: 0, deadline: Millis(1_000) });
    /// node.handle(Millis(10), Input::PacketReady { round: 0, packet: 7 });
    /// assert!(node.poll_output().is_some());
    /// assert_ne!(node.lineage(), first);
    /// ```
    pub fn lineage(&self) -> u64 {
        self.lineage
    }

    /// The node's model is its own from now on: a fresh lineage.
    fn fresh_lineage(&mut self) {
        self.lineage_epoch = self.lineage_epoch.wrapping_add(1);
        self.lineage = lineage_of(self.lineage_seed, self.lineage_epoch);
    }

    /// The node's cohort view.
    pub fn cohort(&self) -> &Cohort<P> {
        self.view.cohort()
    }

    /// The hub the node would push to now: the lowest rank of its view, itself included.
    pub fn hub(&self) -> P {
        self.view.hub()
    }

    /// The hub whose merge the node took last (itself if it served as a hub).
    pub fn joined(&self) -> Option<&P> {
        self.joined.as_ref()
    }

    /// The round in flight, if one is not finished.
    pub fn round(&self) -> Option<u64> {
        self.round
            .as_ref()
            .filter(|r| !r.is_done())
            .map(|r| r.number)
    }

    /// The config it runs with.
    pub fn config(&self) -> &ExchangeConfig {
        &self.config
    }

    /// The next action for the driver, if any.
    pub fn poll_output(&mut self) -> Option<Output<P, M>> {
        self.out.pop_front()
    }

    /// When [`Exchange::handle_timeout`] must next be called, if anything waits: never later
    /// than the round's deadline.
    pub fn poll_timeout(&self) -> Option<Millis> {
        let r = self.round.as_ref().filter(|r| !r.is_done())?;
        Some(r.timer().map_or(r.deadline, |t| t.min(r.deadline)))
    }

    /// Time has reached `now`: expire what waited until then.
    pub fn handle_timeout(&mut self, now: Millis) {
        // Each pass finishes the round or moves it to a later step; a round has few steps.
        for _ in 0..8 {
            let Some(r) = self.round.as_ref().filter(|r| !r.is_done()) else {
                return;
            };
            if now >= r.deadline {
                self.expire();
                return;
            }
            if r.sub_close.is_some_and(|t| now >= t) {
                self.close_sub();
                continue;
            }
            match r.step_timer() {
                Some(t) if now >= t => self.step_timeout(now),
                _ => return,
            }
        }
    }

    /// Feed one input at `now`. Timers up to `now` expire first; an input the node does not
    /// wait for (another round, an unknown ticket, a peer it did not push to) is dropped.
    pub fn handle(&mut self, now: Millis, input: Input<P, M>) {
        self.handle_timeout(now);
        match input {
            Input::RoundStart { round, deadline } => self.round_start(now, round, deadline),
            Input::PacketReady { round, packet } => self.packet_ready(now, round, packet),
            Input::SearchDone { round, headers } => self.search_done(now, round, headers),
            Input::PushReceived {
                from,
                rank,
                round,
                packet,
                cosine,
                known,
                via,
            } => self.push_received(
                now,
                round,
                round::PushIn {
                    from,
                    rank,
                    packet,
                    cosine,
                    known,
                    via,
                },
            ),
            Input::AnswerReceived {
                from,
                round,
                answer,
            } => self.answer_received(now, from, round, answer),
            Input::MergeReceived {
                from,
                round,
                merge,
                cosine,
                lineage,
                listed,
            } => self.merge_received(from, round, merge, (cosine, lineage), listed),
            Input::MergeAsked { from, round } => self.merge_asked(from, round),
            Input::ModelReceived { ticket, model } => self.model_received(now, ticket, model),
            Input::ModelChecked { ticket, verdict } => self.model_checked(now, ticket, verdict),
            Input::MergeComputed { ticket, merge } => self.merge_computed(ticket, merge),
            Input::MergeChecked { ticket, verdict } => self.merge_checked(ticket, verdict),
        }
    }

    fn ticket(&mut self) -> Ticket {
        let t = Ticket(self.next_ticket);
        self.next_ticket = self.next_ticket.wrapping_add(1);
        t
    }

    /// Rounds since the exchange began, or `None` in a local round.
    /// The node's exchange round of swarm round `round`: its rounds since its first, past its
    /// local rounds (`None` in a local round).
    fn exchange_round(&self, round: u64) -> Option<u64> {
        let first = self.first_round.unwrap_or(round);
        round.checked_sub(first.saturating_add(self.config.local_rounds))
    }

    /// Whether the node is back from missing rounds and still catching up (`catch_up_until`).
    fn catching_up(&self) -> bool {
        self.catch_up_until.is_some()
    }

    fn set_step(&mut self, step: Step<P, M>) {
        if let Some(r) = self.round.as_mut() {
            r.step = step;
        }
    }

    fn round_start(&mut self, now: Millis, round: u64, deadline: Millis) {
        if self.last_round.is_some_and(|last| round <= last) {
            tracing::debug!(round, "exchange: stale round start dropped");
            return;
        }
        // A round still open ends now, as at its deadline.
        self.expire();
        self.view.lift_bans(round);
        if self.first_round.is_none() {
            self.first_round = Some(round);
        }
        if self
            .last_round
            .is_some_and(|last| round > last.saturating_add(self.config.catch_up_after))
        {
            self.catch_up_until = Some(round.saturating_add(CATCH_UP_ROUNDS));
        } else if self.catch_up_until.is_some_and(|until| round >= until) {
            self.catch_up_until = None;
        }
        let role = if self.exchange_round(round).is_some() {
            Role::Member
        } else {
            Role::Local
        };
        self.last_round = Some(round);
        let knows = !self.view.cohort().is_empty();
        let lost_peers = !knows && self.round.as_ref().is_some_and(|r| r.knew_peers);
        self.round = Some(Round {
            number: round,
            start: now,
            deadline: deadline.max(now),
            packet: None,
            step: Step::Packet,
            role,
            hub: None,
            pushes: Vec::new(),
            redirects: 0,
            told_version: 0,
            retries: 0,
            served: None,
            heard: false,
            held: 0,
            knew_peers: knows,
            lost_peers,
            depth: if self.view.is_own(&self.view.hub()) {
                0
            } else {
                self.depth.max(1)
            },
            sub: round::Sub::Open,
            sub_close: None,
            full_hints: 0,
            via: None,
            hinted: Vec::new(),
            reserved: std::mem::take(&mut self.served_last),
            waiting: None,
        });
    }

    fn merge_checked(&mut self, ticket: Ticket, verdict: MergeVerdict) {
        let Some(r) = self.round.as_ref() else { return };
        match &r.step {
            Step::CheckMerge {
                joining,
                ticket: t,
                merge,
                cosine,
                lineage,
                listed,
            } if *t == ticket => {
                let (joining, merge, listed) = (joining.clone(), merge.clone(), listed.clone());
                let served = (*cosine, *lineage);
                self.member_verdict(joining, merge, served, listed, verdict);
            }
            Step::CheckOwn {
                ticket: t, merge, ..
            } if *t == ticket => {
                let merge = merge.clone();
                if verdict == MergeVerdict::Pass {
                    self.serve(merge);
                } else {
                    self.hub_refused_merge();
                }
            }
            _ => {}
        }
    }

    /// Ban `p` for [`ExchangeConfig::ban_rounds`] from the round now open (or the last one).
    /// A hub relearned after its ban is joined anew: its model is checked again.
    fn refuse(&mut self, p: &P) {
        if self.view.is_own(p) {
            return;
        }
        if self.joined.as_ref() == Some(p) {
            self.joined = None;
        }
        let round = self
            .round
            .as_ref()
            .map(|r| r.number)
            .or(self.last_round)
            .unwrap_or(0);
        self.view
            .ban(p, round.saturating_add(self.config.ban_rounds.max(1)));
        self.out.push_back(Output::Ban { peer: p.clone() });
    }

    /// `hub` missed: after `max_misses` in a row the node forgets it (and checks its model
    /// again if it relearns it).
    fn miss(&mut self, hub: &P) {
        let count = match self.misses.as_mut() {
            Some((p, c)) if p == hub => {
                *c += 1;
                *c
            }
            _ => {
                self.misses = Some((hub.clone(), 1));
                1
            }
        };
        if count >= self.config.max_misses.max(1) {
            // Alive (it answers, late or busy): forgotten only, and learned again from the
            // next listing, so its members come back to it. (Set aside like a gone hub, the
            // 64-node fault runs measured the same figures: BENCHMARKS.md, ideas.)
            tracing::debug!(?hub, count, "exchange: hub forgotten after misses");
            self.view.forget(hub);
            self.misses = None;
            if self.joined.as_ref() == Some(hub) {
                self.joined = None;
            }
        }
    }

    /// `hub` answered nothing (a push or a model fetch and its retry), or its model could not
    /// be fetched: it leaves the view for [`ExchangeConfig::dropped_rounds`] rounds, so that
    /// peers still naming it do not bring it back (a node back after a crash rejoins as a
    /// member meanwhile). Not a ban: nothing is reported to the driver.
    pub(super) fn drop_hub(&mut self, hub: &P) {
        let round = self.round.as_ref().map_or(0, |r| r.number);
        self.view
            .ban(hub, round.saturating_add(self.config.dropped_rounds.max(1)));
        self.misses = None;
        if self.joined.as_ref() == Some(hub) {
            self.joined = None;
        }
    }

    /// The hub this round's member step waits on.
    fn member_hub(&self) -> Option<P> {
        self.round.as_ref().and_then(|r| r.hub.clone())
    }

    /// A step's own timer passed (not the deadline).
    fn step_timeout(&mut self, now: Millis) {
        let Some(r) = self.round.as_ref() else { return };
        match &r.step {
            Step::Search { .. } => {
                self.set_step(Step::Packet);
                self.choose(now);
            }
            Step::Fetch { close, .. } => {
                let close = *close;
                if r.retries < self.config.retries && now < close {
                    self.fetch_again(now, close);
                } else {
                    self.gone(now);
                }
            }
            Step::Pushed {
                accepted: false,
                joining,
                ..
            } => {
                if r.retries < self.config.retries {
                    let joining = joining.clone();
                    if let Some(r) = self.round.as_mut() {
                        r.retries += 1;
                    }
                    self.push(now, joining);
                } else {
                    self.gone(now);
                }
            }
            Step::Pushed { accepted: true, .. } => self.ask_merge(),
            Step::CheckModel { .. } => self.finish(Apply::Nothing, false),
            Step::Collect { .. } => self.close_admission(),
            _ => {}
        }
    }

    /// The round's deadline: whatever it waited for, it ends now.
    fn expire(&mut self) {
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        let round = r.number;
        let missed = match &mut r.step {
            Step::Fetch { .. } | Step::Pushed { .. } => true,
            Step::Merging { admitted, .. } | Step::CheckOwn { admitted, .. } => {
                for p in std::mem::take(admitted) {
                    self.out.push_back(Output::Answer {
                        to: p.from,
                        round,
                        answer: Answer::Busy,
                    });
                }
                false
            }
            _ => false,
        };
        if missed && let Some(hub) = self.member_hub() {
            self.miss(&hub);
        }
        self.finish(Apply::Nothing, missed);
    }

    /// End the round with `apply`; [`Apply::Nothing`] here stands for "its own packet, if it
    /// has one". Pushes still held are answered.
    fn finish(&mut self, apply: Apply<M>, missed: bool) {
        let own = self.view.own().clone();
        let Some(r) = self.round.as_mut().filter(|r| !r.is_done()) else {
            return;
        };
        let apply = match (apply, r.packet.clone()) {
            (Apply::Nothing, Some(p)) => Apply::Own(p),
            (apply, _) => apply,
        };
        let (round, role) = (r.number, r.role);
        if matches!(apply, Apply::Own(_) | Apply::Adopt(_)) {
            // Its own update, or its hub's model without the round's merge: a model nobody
            // else holds.
            self.fresh_lineage();
        }
        if role == Role::Hub {
            self.rebase = false;
        }
        let Some(r) = self.round.as_mut() else { return };
        // A sub-hub's children get the merge it applies from above, or, when none came, its
        // merge of them (which they check; the sub-hub itself applies its own update, as a
        // member with no merge does: nobody checked that merge for it).
        r.sub_close = None;
        let sub = std::mem::replace(&mut r.sub, round::Sub::Closed);
        let down = match sub {
            round::Sub::Up { merge, children } => match &apply {
                Apply::Merge { merge: above, .. } => Some((above.clone(), children)),
                Apply::Adopt(_) | Apply::Own(_) | Apply::Nothing => Some((merge, children)),
            },
            round::Sub::Merging { children, .. } => {
                for p in children {
                    self.out.push_back(Output::Answer {
                        to: p.from,
                        round,
                        answer: Answer::Busy,
                    });
                }
                None
            }
            round::Sub::Open | round::Sub::Closed => None,
        };
        if role == Role::Member && matches!(apply, Apply::Merge { .. } | Apply::Adopt(_)) {
            // It took its hub's model (and merge): caught up.
            self.catch_up_until = None;
        }
        let merged_with_others = match role {
            // The hub of a pair that found each other and nobody else is stranded too.
            Role::Hub => r.held >= 2,
            Role::Member => matches!(apply, Apply::Merge { .. } | Apply::Adopt(_)),
            Role::Local => true,
        };
        self.stranded = if merged_with_others {
            0
        } else {
            self.stranded.saturating_add(1)
        };
        match role {
            Role::Hub if !r.heard && r.knew_peers => self.idle = self.idle.saturating_add(1),
            Role::Hub if !r.heard => {}
            Role::Hub | Role::Member => self.idle = 0,
            Role::Local => {}
        }
        let hub = match role {
            Role::Member => r.hub.clone().unwrap_or(own),
            Role::Hub | Role::Local => own,
        };
        r.step = Step::Done;
        let answer = if role == Role::Local {
            Answer::Busy
        } else {
            Answer::Late
        };
        for p in std::mem::take(&mut r.pushes) {
            self.out.push_back(Output::Answer {
                to: p.from,
                round,
                answer: answer.clone(),
            });
        }
        if let Some((merge, children)) = down {
            self.serve_children(round, merge, children);
        }
        self.out.push_back(Output::Finished(RoundReport {
            round,
            role,
            hub,
            apply,
            missed,
        }));
    }
}

/// Lineage `epoch` of a node whose seed is `seed` (splitmix64): distinct nodes and epochs give
/// distinct lineages but for a 2^-64 chance.
fn lineage_of(seed: u64, epoch: u64) -> u64 {
    let mut z = seed
        .wrapping_add(epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;
