//! libp2p-kad's closest-peers iterator, state for state, over `u32` node indices.
//!
//! This is `libp2p_kad::query::peers::closest::ClosestPeersIter` (libp2p-kad 0.49) with the
//! same states (not contacted, waiting, unresponsive, failed, succeeded), the same progress rule
//! (a response makes progress if it brings a peer closer than the `num_results`-th known one, or
//! fewer than `num_results` are known), the same stall rule (after `α` responses without
//! progress, up to `num_results` requests may be in flight) and the same termination (the
//! `num_results` closest known peers have all answered, or nobody is left to ask). The
//! simulator's request counts are therefore those the real swarm makes, which calibration checks.
//!
//! It is sans-IO: [`ClosestIter::next`] says whom to contact at `now`, and the caller reports
//! answers with [`ClosestIter::on_success`] and failures with [`ClosestIter::on_failure`].
//! Each peer also carries its *hop*: 1 for the initiator's own table entries, one more than the
//! peer that reported it otherwise.

use super::Micros;

/// Iterator parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IterConfig {
    /// Requests in flight while making progress (`α`).
    pub parallelism: usize,
    /// Closest peers that must answer for the iterator to finish.
    pub num_results: usize,
    /// After this long without an answer a peer stops counting against the parallelism.
    pub peer_timeout: Micros,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PeerState {
    NotContacted,
    Waiting(Micros),
    Unresponsive,
    Failed,
    Succeeded,
}

#[derive(Debug, Clone, Copy)]
struct Peer {
    dist: u64,
    node: u32,
    hop: u8,
    state: PeerState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Iterating { no_progress: usize },
    Stalled,
    Finished,
}

/// What to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Send a request to this peer.
    Contact {
        /// The peer.
        node: u32,
        /// Its distance to the target.
        dist: u64,
        /// Its hop.
        hop: u8,
    },
    /// Wait: the parallelism is used up.
    WaitingAtCapacity,
    /// Wait: answers are outstanding and nobody new is left to ask.
    Waiting,
    /// Done.
    Finished,
}

/// The iterator. See the [module docs](self).
#[derive(Debug, Clone)]
pub struct ClosestIter {
    cfg: IterConfig,
    state: State,
    /// Sorted by distance; distances are distinct (distinct ids).
    peers: Vec<Peer>,
    num_waiting: usize,
    /// `peers[..settled]` are all in a final state (succeeded or failed), `settled_ok` of them
    /// succeeded: [`ClosestIter::next`] starts its sweep there. Pure acceleration; the sweep's
    /// outcome is the same as from the start.
    settled: usize,
    settled_ok: usize,
}

impl ClosestIter {
    /// Start from the initiator's closest known peers (`(distance, node)`, at most 20 are taken,
    /// as libp2p takes `K_VALUE`).
    pub fn new(cfg: IterConfig, seeds: impl IntoIterator<Item = (u64, u32)>) -> Self {
        let mut peers: Vec<Peer> = seeds
            .into_iter()
            .take(20)
            .map(|(dist, node)| Peer {
                dist,
                node,
                hop: 1,
                state: PeerState::NotContacted,
            })
            .collect();
        peers.sort_by_key(|p| p.dist);
        peers.dedup_by_key(|p| p.dist);
        Self {
            cfg,
            state: State::Iterating { no_progress: 0 },
            peers,
            num_waiting: 0,
            settled: 0,
            settled_ok: 0,
        }
    }

    fn find(&self, dist: u64) -> Option<usize> {
        self.peers.binary_search_by_key(&dist, |p| p.dist).ok()
    }

    /// Report `node` (at `dist`) answered with `closer` peers. Returns whether the answer was
    /// expected (the iterator was waiting for it or had given up on it).
    pub fn on_success(&mut self, dist: u64, closer: impl IntoIterator<Item = (u64, u32)>) -> bool {
        if self.state == State::Finished {
            return false;
        }
        let Some(i) = self.find(dist) else {
            return false;
        };
        let hop = match self.peers.get(i).map(|p| p.state) {
            Some(PeerState::Waiting(_)) => {
                self.num_waiting -= 1;
                self.peers.get(i).map_or(1, |p| p.hop)
            }
            Some(PeerState::Unresponsive) => self.peers.get(i).map_or(1, |p| p.hop),
            _ => return false,
        };
        if let Some(p) = self.peers.get_mut(i) {
            p.state = PeerState::Succeeded;
        }
        let num_results = self.cfg.num_results;
        let cur_range = self
            .peers
            .get(num_results.saturating_sub(1))
            .or_else(|| self.peers.last())
            .map_or(dist, |p| p.dist);
        let mut progress = self.peers.len() < num_results;
        for (d, node) in closer {
            if let Err(pos) = self.peers.binary_search_by_key(&d, |p| p.dist) {
                if pos < self.settled {
                    self.settled = pos;
                    self.settled_ok = self
                        .peers
                        .iter()
                        .take(pos)
                        .filter(|p| p.state == PeerState::Succeeded)
                        .count();
                }
                self.peers.insert(
                    pos,
                    Peer {
                        dist: d,
                        node,
                        hop: hop.saturating_add(1),
                        state: PeerState::NotContacted,
                    },
                );
                progress |= d < cur_range;
            }
        }
        self.state = match self.state {
            State::Iterating { no_progress } => {
                let no_progress = if progress { 0 } else { no_progress + 1 };
                if no_progress >= self.cfg.parallelism {
                    State::Stalled
                } else {
                    State::Iterating { no_progress }
                }
            }
            State::Stalled if progress => State::Iterating { no_progress: 0 },
            s => s,
        };
        true
    }

    /// Report the request to the peer at `dist` failed. Returns whether it was expected.
    pub fn on_failure(&mut self, dist: u64) -> bool {
        if self.state == State::Finished {
            return false;
        }
        let Some(i) = self.find(dist) else {
            return false;
        };
        let Some(p) = self.peers.get_mut(i) else {
            return false;
        };
        match p.state {
            PeerState::Waiting(_) => {
                self.num_waiting -= 1;
                p.state = PeerState::Failed;
            }
            PeerState::Unresponsive => p.state = PeerState::Failed,
            _ => return false,
        }
        true
    }

    fn at_capacity(&self) -> bool {
        match self.state {
            State::Stalled => self.num_waiting >= self.cfg.num_results.max(self.cfg.parallelism),
            State::Iterating { .. } => self.num_waiting >= self.cfg.parallelism,
            State::Finished => true,
        }
    }

    /// Advance at `now`: the next peer to contact, or why not.
    pub fn next(&mut self, now: Micros) -> Next {
        if self.state == State::Finished {
            return Next::Finished;
        }
        // Extend the settled prefix.
        while let Some(p) = self.peers.get(self.settled) {
            match p.state {
                PeerState::Succeeded => self.settled_ok += 1,
                PeerState::Failed => {}
                _ => break,
            }
            self.settled += 1;
        }
        let at_capacity = self.at_capacity();
        if self.settled_ok >= self.cfg.num_results {
            self.state = State::Finished;
            return Next::Finished;
        }
        let mut result_counter = Some(self.settled_ok);
        for p in self.peers.iter_mut().skip(self.settled) {
            match p.state {
                PeerState::Waiting(timeout) => {
                    if now >= timeout {
                        self.num_waiting -= 1;
                        p.state = PeerState::Unresponsive;
                    } else if at_capacity {
                        return Next::WaitingAtCapacity;
                    } else {
                        result_counter = None;
                    }
                }
                PeerState::Succeeded => {
                    if let Some(c) = result_counter.as_mut() {
                        *c += 1;
                        if *c >= self.cfg.num_results {
                            self.state = State::Finished;
                            return Next::Finished;
                        }
                    }
                }
                PeerState::NotContacted => {
                    if at_capacity {
                        return Next::WaitingAtCapacity;
                    }
                    p.state = PeerState::Waiting(now + self.cfg.peer_timeout);
                    self.num_waiting += 1;
                    return Next::Contact {
                        node: p.node,
                        dist: p.dist,
                        hop: p.hop,
                    };
                }
                PeerState::Unresponsive | PeerState::Failed => {}
            }
        }
        if self.num_waiting > 0 {
            Next::Waiting
        } else {
            self.state = State::Finished;
            Next::Finished
        }
    }

    /// Stop now.
    pub fn finish(&mut self) {
        self.state = State::Finished;
    }

    /// Whether the iterator is done.
    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    /// The closest peers that answered, closest first, at most `num_results`, with their hops.
    pub fn result(&self) -> impl Iterator<Item = (u32, u8)> + '_ {
        self.peers
            .iter()
            .filter(|p| p.state == PeerState::Succeeded)
            .map(|p| (p.node, p.hop))
            .take(self.cfg.num_results)
    }

    /// Peers known to the iterator.
    pub fn known(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> IterConfig {
        IterConfig {
            parallelism: 3,
            num_results: 2,
            peer_timeout: 10,
        }
    }

    #[test]
    fn respects_parallelism_and_finishes_on_the_closest() {
        let mut it = ClosestIter::new(cfg(), [(40, 4), (10, 1), (30, 3), (20, 2)]);
        let mut sent = Vec::new();
        while let Next::Contact { node, .. } = it.next(0) {
            sent.push(node);
        }
        assert_eq!(sent, [1, 2, 3], "closest first, α at a time");
        assert_eq!(it.next(0), Next::WaitingAtCapacity);
        // Peer 1 reports a closer peer 0.
        assert!(it.on_success(10, [(5, 0)]));
        assert_eq!(
            it.next(1),
            Next::Contact {
                node: 0,
                dist: 5,
                hop: 2
            }
        );
        assert!(it.on_success(5, []));
        // 0 and 1 answered, but 2 (within the two closest? no: 0 and 1 are the two closest)
        // finish once the closest two have answered.
        assert_eq!(it.next(2), Next::Finished);
        let result: Vec<_> = it.result().collect();
        assert_eq!(result, [(0, 2), (1, 1)]);
    }

    #[test]
    fn failures_and_timeouts_free_the_parallelism() {
        let mut it = ClosestIter::new(cfg(), [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]);
        for _ in 0..3 {
            assert!(matches!(it.next(0), Next::Contact { .. }));
        }
        assert!(it.on_failure(1));
        assert!(!it.on_failure(1), "reported twice");
        assert!(matches!(it.next(1), Next::Contact { node: 4, .. }));
        // At t = 10 peers 2 and 3 time out and stop counting; like libp2p, the capacity is
        // judged before the sweep, so the freed slots are used on the next call.
        assert_eq!(it.next(10), Next::WaitingAtCapacity);
        assert!(matches!(it.next(10), Next::Contact { node: 5, .. }));
        // A late answer from an unresponsive peer still counts.
        assert!(it.on_success(2, []));
        assert!(it.on_success(3, []));
        assert_eq!(it.next(11), Next::Finished);
        assert_eq!(it.result().map(|r| r.0).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn runs_out_of_peers() {
        let mut it = ClosestIter::new(cfg(), [(1, 1)]);
        assert!(matches!(it.next(0), Next::Contact { .. }));
        assert_eq!(it.next(0), Next::Waiting);
        assert!(it.on_failure(1));
        assert_eq!(it.next(0), Next::Finished);
        assert_eq!(it.result().count(), 0);
    }
}
