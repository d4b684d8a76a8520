//! Peer scoring and bans: a deterministic state machine over `(peer, offence, now)`.
//!
//! Every peer starts at 0. Verified, useful responses earn a little (capped); invalid data costs
//! a lot: a malformed or oversize message, or a header with a forged signature, is never an
//! accident of the network, so three such offences within a few minutes take a peer below the
//! ban threshold. Negative scores recover linearly with time, so an honest peer that once sent a
//! stale header is not punished forever. A peer at or below the threshold is banned for a fixed
//! period: the caller disconnects it, refuses its connections and stops asking it anything; when
//! the ban expires the peer starts again from 0.
//!
//! No clocks or sockets here: every method takes `now`. The type is generic over the peer id so
//! the simulator can score `u32` virtual nodes with the same code.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kindred_routing::scoring::{PeerScores, ScoreConfig, Severity};
//!
//! let mut scores = PeerScores::new(ScoreConfig::default());
//! let t0 = Instant::now();
//! assert!(scores.penalize(&"mallory", Severity::Major, t0).is_none());
//! assert!(scores.penalize(&"mallory", Severity::Major, t0).is_none());
//! let ban = scores.penalize(&"mallory", Severity::Major, t0).unwrap();
//! assert!(scores.is_banned(&"mallory", t0));
//! assert_eq!(scores.poll_unban(ban.until + Duration::from_secs(1)), Some("mallory"));
//! ```

use std::collections::HashMap;
use std::hash::Hash;
use std::time::{Duration, Instant};

/// How bad an offence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Severity {
    /// Plausibly an honest mistake or a race (stale round, wrong window, unexpected sender).
    Minor,
    /// Cannot happen with an honest peer (malformed or oversize message, forged signature,
    /// a body that does not match its signed header).
    Major,
}

/// Scoring parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreConfig {
    /// Points lost per [`Severity::Minor`] offence.
    pub minor_penalty: f64,
    /// Points lost per [`Severity::Major`] offence.
    pub major_penalty: f64,
    /// Points earned per useful response.
    pub reward: f64,
    /// Highest score a peer can bank.
    pub max_score: f64,
    /// A peer whose score falls to this value or below is banned.
    pub ban_threshold: f64,
    /// How long a ban lasts.
    pub ban_duration: Duration,
    /// Points a negative score recovers per second.
    pub recovery_per_sec: f64,
    /// Most peers tracked; when full, the entry closest to a neutral score is forgotten.
    pub max_tracked: usize,
}

impl Default for ScoreConfig {
    /// Minor −10, major −40, reward +1 (cap 20), ban at −100 for 10 minutes, recovery 2 points a
    /// minute, 8,192 peers tracked.
    fn default() -> Self {
        Self {
            minor_penalty: 10.0,
            major_penalty: 40.0,
            reward: 1.0,
            max_score: 20.0,
            ban_threshold: -100.0,
            ban_duration: Duration::from_secs(600),
            recovery_per_sec: 2.0 / 60.0,
            max_tracked: 8192,
        }
    }
}

/// A ban decision: the caller must disconnect `peer` and refuse it until `until`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a ban must be enforced by disconnecting and blocking the peer"]
pub struct Ban<P> {
    /// The banned peer.
    pub peer: P,
    /// When the ban ends.
    pub until: Instant,
}

#[derive(Debug, Clone)]
struct PeerState {
    score: f64,
    updated: Instant,
    banned_until: Option<Instant>,
}

/// Scores and bans of remote peers.
#[derive(Debug, Clone)]
pub struct PeerScores<P> {
    config: ScoreConfig,
    peers: HashMap<P, PeerState>,
}

impl<P: Hash + Eq + Clone> PeerScores<P> {
    /// An empty table.
    pub fn new(config: ScoreConfig) -> Self {
        Self {
            config,
            peers: HashMap::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ScoreConfig {
        &self.config
    }

    fn current(&self, state: &PeerState, now: Instant) -> f64 {
        if state.score >= 0.0 {
            return state.score;
        }
        let elapsed = now.saturating_duration_since(state.updated).as_secs_f64();
        (state.score + elapsed * self.config.recovery_per_sec).min(0.0)
    }

    /// The peer's score now (0 for an unknown peer).
    pub fn score(&self, peer: &P, now: Instant) -> f64 {
        self.peers.get(peer).map_or(0.0, |s| self.current(s, now))
    }

    /// Whether the peer is banned at `now`.
    pub fn is_banned(&self, peer: &P, now: Instant) -> bool {
        self.peers
            .get(peer)
            .and_then(|s| s.banned_until)
            .is_some_and(|until| until > now)
    }

    fn entry(&mut self, peer: &P, now: Instant) -> &mut PeerState {
        if !self.peers.contains_key(peer) && self.peers.len() >= self.config.max_tracked.max(1) {
            self.forget_most_neutral(now);
        }
        self.peers.entry(peer.clone()).or_insert(PeerState {
            score: 0.0,
            updated: now,
            banned_until: None,
        })
    }

    fn forget_most_neutral(&mut self, now: Instant) {
        let victim = self
            .peers
            .iter()
            .filter(|(_, s)| s.banned_until.is_none())
            .min_by(|a, b| {
                self.current(a.1, now)
                    .abs()
                    .total_cmp(&self.current(b.1, now).abs())
            })
            .map(|(p, _)| p.clone());
        if let Some(p) = victim {
            self.peers.remove(&p);
        }
    }

    /// Record an offence. Returns the ban to enforce when this offence takes the peer to the
    /// threshold; an already banned peer is not banned again.
    pub fn penalize(&mut self, peer: &P, severity: Severity, now: Instant) -> Option<Ban<P>> {
        let penalty = match severity {
            Severity::Minor => self.config.minor_penalty,
            Severity::Major => self.config.major_penalty,
        };
        let (threshold, duration) = (self.config.ban_threshold, self.config.ban_duration);
        let current = self.score(peer, now);
        let state = self.entry(peer, now);
        if state.banned_until.is_some_and(|u| u > now) {
            return None;
        }
        state.score = current - penalty;
        state.updated = now;
        if state.score <= threshold {
            let until = now + duration;
            state.banned_until = Some(until);
            return Some(Ban {
                peer: peer.clone(),
                until,
            });
        }
        None
    }

    /// Record a useful, valid response.
    pub fn reward(&mut self, peer: &P, now: Instant) {
        let (reward, max) = (self.config.reward, self.config.max_score);
        let current = self.score(peer, now);
        let state = self.entry(peer, now);
        state.score = (current + reward).min(max);
        state.updated = now;
    }

    /// The next peer whose ban has expired by `now`, if any; it is reset to a neutral score.
    /// Call repeatedly until `None`.
    pub fn poll_unban(&mut self, now: Instant) -> Option<P> {
        let peer = self
            .peers
            .iter()
            .find(|(_, s)| s.banned_until.is_some_and(|u| u <= now))
            .map(|(p, _)| p.clone())?;
        if let Some(state) = self.peers.get_mut(&peer) {
            state.banned_until = None;
            state.score = 0.0;
            state.updated = now;
        }
        Some(peer)
    }

    /// When the earliest current ban ends.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.peers.values().filter_map(|s| s.banned_until).min()
    }

    /// Peers banned at `now`.
    pub fn banned(&self, now: Instant) -> impl Iterator<Item = &P> {
        self.peers
            .iter()
            .filter(move |(_, s)| s.banned_until.is_some_and(|u| u > now))
            .map(|(p, _)| p)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn three_major_offences_ban_and_the_ban_expires() {
        let mut s = PeerScores::new(ScoreConfig::default());
        let t = Instant::now();
        assert!(s.penalize(&1u32, Severity::Major, t).is_none());
        assert!(s.penalize(&1, Severity::Major, t).is_none());
        assert!(!s.is_banned(&1, t));
        let ban = s.penalize(&1, Severity::Major, t).unwrap();
        assert_eq!(ban.until, t + Duration::from_secs(600));
        assert!(s.is_banned(&1, t));
        // No double ban while banned.
        assert!(s.penalize(&1, Severity::Major, t).is_none());
        assert_eq!(s.next_expiry(), Some(ban.until));
        assert_eq!(s.poll_unban(t + Duration::from_secs(599)), None);
        assert_eq!(s.poll_unban(ban.until), Some(1));
        assert_eq!(s.poll_unban(ban.until), None);
        assert!(!s.is_banned(&1, ban.until));
        assert_eq!(s.score(&1, ban.until), 0.0);
    }

    #[test]
    fn scores_recover_and_rewards_cap() {
        let mut s = PeerScores::new(ScoreConfig::default());
        let t = Instant::now();
        s.penalize(&7u32, Severity::Major, t);
        assert_eq!(s.score(&7, t), -40.0);
        // 2 points a minute: after 10 minutes, -20.
        let later = t + Duration::from_secs(600);
        assert!((s.score(&7, later) + 20.0).abs() < 1e-9);
        assert_eq!(s.score(&7, t + Duration::from_secs(3600)), 0.0);
        // Slow offenders are never banned: one major offence an hour.
        let mut now = t;
        for _ in 0..20 {
            now += Duration::from_secs(3600);
            assert!(s.penalize(&7, Severity::Major, now).is_none());
        }
        for _ in 0..100 {
            s.reward(&8, t);
        }
        assert_eq!(s.score(&8, t), 20.0);
        // Banked credit delays a ban by half an offence, no more: 20 → -20 → -60 → -70 → -110.
        assert!(s.penalize(&8, Severity::Major, t).is_none());
        assert!(s.penalize(&8, Severity::Major, t).is_none());
        assert!(s.penalize(&8, Severity::Minor, t).is_none());
        assert!(s.penalize(&8, Severity::Major, t).is_some());
    }

    #[test]
    fn table_is_bounded_and_keeps_bans() {
        let mut s = PeerScores::new(ScoreConfig {
            max_tracked: 4,
            ..ScoreConfig::default()
        });
        let t = Instant::now();
        for _ in 0..3 {
            let _ = s.penalize(&0u32, Severity::Major, t);
        }
        for p in 1..100u32 {
            s.reward(&p, t);
        }
        assert!(s.peers.len() <= 4);
        assert!(s.is_banned(&0, t));
        assert_eq!(s.banned(t).count(), 1);
    }
}
