//! Churn: every node alternates online sessions and offline gaps with heavy-tailed lengths.
//!
//! Session lengths are Lomax (Pareto type II) with shape `α` and mean `S = 1/r` hours, where
//! `r` is the churn rate: the expected fraction of the online population that leaves per hour
//! (30 % per hour means a mean session of 3 h 20 min). Offline gaps are Lomax with the same shape
//! and mean `S·(1 − a)/a`, so a node is online a fraction `a` (the availability) of the time.
//! Nodes keep their identity across sessions (a libp2p node keeps its key), but a restarted node
//! has lost its in-memory routing table and provider records.
//!
//! The run starts in steady state: each node starts online with probability `a`, and its first
//! session or gap is drawn from the equilibrium residual distribution. Every node's whole
//! timeline up to the horizon is drawn up front from its own random stream, so whether a node is
//! up at any instant is a pure function of the seed, and lookups running in parallel can ask.

use super::Micros;

/// Churn parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChurnConfig {
    /// Fraction of online nodes leaving per hour (`> 0`).
    pub rate_per_hour: f64,
    /// Lomax shape `α > 1` of session and gap lengths (smaller is heavier-tailed).
    pub shape: f64,
    /// Long-run fraction of time a node is online, in `(0, 1)`.
    pub availability: f64,
}

impl Default for ChurnConfig {
    /// 30 % per hour, shape 2 (finite mean, infinite variance), availability 0.8.
    fn default() -> Self {
        Self {
            rate_per_hour: 0.3,
            shape: 2.0,
            availability: 0.8,
        }
    }
}

/// Every node's online/offline timeline.
#[derive(Debug, Clone)]
pub struct Timelines {
    /// Bit `i`: node `i` online at time 0.
    initial: Vec<u64>,
    /// Node `i`'s toggle times are `toggles[offsets[i]..offsets[i + 1]]`.
    offsets: Vec<u32>,
    toggles: Vec<Micros>,
}

/// A node coming up or going down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Transition {
    /// When.
    pub at: Micros,
    /// Which node.
    pub node: u32,
    /// Whether it comes up (`true`) or goes down.
    pub up: bool,
}

impl Timelines {
    /// `n` nodes that never leave.
    pub fn always_on(n: usize) -> Self {
        Self {
            initial: vec![u64::MAX; n.div_ceil(64)],
            offsets: vec![0; n + 1],
            toggles: Vec::new(),
        }
    }

    /// `n` nodes, those for which `leaves` holds going down for good at time 0 (tests and
    /// failure scenarios).
    pub fn from_fn(n: usize, leaves: impl Fn(u32) -> bool) -> Self {
        let mut t = Self::always_on(n);
        t.offsets.clear();
        t.offsets.push(0);
        for i in 0..n as u32 {
            if leaves(i) {
                t.toggles.push(0);
            }
            t.offsets.push(t.toggles.len() as u32);
        }
        t
    }

    /// Timelines of `n` nodes from time 0 to `horizon`.
    pub fn generate(n: usize, cfg: &ChurnConfig, horizon: Micros, seed: u64) -> Self {
        use rayon::prelude::*;
        const HOUR: f64 = 3600e6;
        let alpha = cfg.shape.max(1.05);
        let a = cfg.availability.clamp(1e-3, 1.0 - 1e-3);
        let on_mean = HOUR / cfg.rate_per_hour.max(1e-9);
        let off_mean = on_mean * (1.0 - a) / a;
        let per_node: Vec<(bool, Vec<Micros>)> = (0..n)
            .into_par_iter()
            .map(|i| {
                let mut rng = crate::rng::stream(seed, &[0xC4_0124, i as u64]);
                let mut u = || crate::rng::unit_open(rng.next_u64());
                let up0 = u() <= a;
                let mean = |up: bool| if up { on_mean } else { off_mean };
                let mut t = crate::rng::lomax_residual(u(), alpha, mean(up0));
                let mut up = up0;
                let mut toggles = Vec::new();
                while t < horizon as f64 {
                    toggles.push(t as Micros);
                    up = !up;
                    t += crate::rng::lomax(u(), alpha, mean(up)).max(1.0);
                }
                (up0, toggles)
            })
            .collect();
        let mut initial = vec![0u64; n.div_ceil(64)];
        let mut offsets = Vec::with_capacity(n + 1);
        let mut toggles = Vec::new();
        offsets.push(0);
        for (i, (up, ts)) in per_node.into_iter().enumerate() {
            if up && let Some(w) = initial.get_mut(i / 64) {
                *w |= 1 << (i % 64);
            }
            toggles.extend(ts);
            offsets.push(toggles.len() as u32);
        }
        Self {
            initial,
            offsets,
            toggles,
        }
    }

    fn own(&self, node: u32) -> &[Micros] {
        let i = node as usize;
        match (self.offsets.get(i), self.offsets.get(i + 1)) {
            (Some(&a), Some(&b)) => self.toggles.get(a as usize..b as usize).unwrap_or(&[]),
            _ => &[],
        }
    }

    fn initially_up(&self, node: u32) -> bool {
        let i = node as usize;
        self.initial
            .get(i / 64)
            .is_some_and(|w| (w >> (i % 64)) & 1 == 1)
    }

    /// Whether `node` is online at `t`.
    #[inline]
    pub fn online(&self, node: u32, t: Micros) -> bool {
        let own = self.own(node);
        let flips = own.partition_point(|&x| x <= t);
        self.initially_up(node) ^ (flips % 2 == 1)
    }

    /// Whether `node` was online over the whole of `[from, to]` (no restart in between).
    #[inline]
    pub fn up_throughout(&self, node: u32, from: Micros, to: Micros) -> bool {
        if !self.online(node, from) {
            return false;
        }
        let own = self.own(node);
        own.partition_point(|&x| x <= from) == own.partition_point(|&x| x <= to)
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.offsets.len().saturating_sub(1)
    }

    /// Whether there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every transition in `[from, to)`, in time order (ties by node).
    pub fn transitions(&self, from: Micros, to: Micros) -> Vec<Transition> {
        let mut out = Vec::new();
        for node in 0..self.len() as u32 {
            let own = self.own(node);
            let start = own.partition_point(|&x| x < from);
            for (j, &at) in own.iter().enumerate().skip(start) {
                if at >= to {
                    break;
                }
                // The j-th toggle brings the node to the state opposite its initial one if j is
                // even.
                let up = self.initially_up(node) ^ (j % 2 == 0);
                out.push(Transition { at, node, up });
            }
        }
        out.sort_unstable();
        out
    }

    /// Total number of transitions drawn.
    pub fn total_transitions(&self) -> usize {
        self.toggles.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steady_state_availability_and_rate() {
        let cfg = ChurnConfig {
            rate_per_hour: 2.0,
            shape: 2.5,
            availability: 0.7,
        };
        let hour = 3_600_000_000;
        let n = 20_000;
        let t = Timelines::generate(n, &cfg, 4 * hour, 5);
        for at in [0, hour, 3 * hour] {
            let up = (0..n as u32).filter(|&i| t.online(i, at)).count() as f64 / n as f64;
            assert!((up - 0.7).abs() < 0.02, "availability {up} at {at}");
        }
        // Departures per hour per online node ≈ rate.
        let downs = t
            .transitions(hour, 3 * hour)
            .iter()
            .filter(|tr| !tr.up)
            .count() as f64;
        let rate = downs / 2.0 / (0.7 * n as f64);
        assert!((rate - 2.0).abs() < 0.2, "rate {rate}");
    }

    #[test]
    fn transitions_agree_with_online() {
        let cfg = ChurnConfig {
            rate_per_hour: 20.0,
            ..ChurnConfig::default()
        };
        let t = Timelines::generate(300, &cfg, 3_600_000_000, 1);
        for tr in t.transitions(0, 3_600_000_000) {
            assert_eq!(t.online(tr.node, tr.at), tr.up);
            assert_eq!(t.online(tr.node, tr.at - 1), !tr.up);
            assert!(!t.up_throughout(tr.node, tr.at - 1, tr.at + 1));
        }
        let always = Timelines::always_on(10);
        assert!((0..10).all(|i| always.online(i, 12345) && always.up_throughout(i, 0, 99)));
    }
}
