//! Compact k-bucket routing tables for every node, in one flat array.
//!
//! Node `x` has `B` buckets of `k` slots; bucket `j < B − 1` holds nodes whose id shares exactly
//! `j` leading bits with `x`'s, and the last bucket holds everything sharing `B − 1` or more (at
//! most a handful of nodes once `B ≥ log2(N) + 2`, so folding the deep buckets together changes
//! nothing a lookup can observe). Slots are `u32` node indices; a bucket's live entries are a
//! prefix of its slots, with the count in a separate byte array. For 10^6 nodes, `B = 22` and
//! `k = 20` this is 1.76 GB of slots, allocated once.
//!
//! Ordering by distance uses the bucket structure as libp2p-kad's `ClosestBucketsIter` does:
//! for a target `t` falling in bucket `c` of `x`, every entry of bucket `c` is closer to `t` than
//! any entry of a deeper bucket, those are closer than bucket `c − 1`, which is closer than
//! `c − 2`, and so on. So the `m` closest entries are found by sorting at most a bucket or two.

use std::ops::Range;

use kindred_kernels::rng::SplitMix64;
use rayon::prelude::*;

use super::ids::{Ids, cpl};

/// Empty slot marker.
const EMPTY: u32 = u32::MAX;

/// The k-bucket tables of all nodes.
#[derive(Debug, Clone)]
pub struct Tables {
    k: usize,
    buckets: usize,
    slots: Vec<u32>,
    lens: Vec<u8>,
}

/// Number of buckets a network of `n` nodes needs: `ceil(log2 n) + 2`, at least 4.
pub fn buckets_for(n: usize) -> usize {
    let log = usize::BITS - n.max(1).saturating_sub(1).leading_zeros();
    (log as usize + 2).clamp(4, 64)
}

impl Tables {
    /// Empty tables for `n` nodes with `buckets` buckets of `k ≤ 255` slots.
    pub fn new(n: usize, buckets: usize, k: usize) -> Self {
        let k = k.clamp(1, 255);
        let buckets = buckets.clamp(1, 64);
        Self {
            k,
            buckets,
            slots: vec![EMPTY; n * buckets * k],
            lens: vec![0; n * buckets],
        }
    }

    /// Tables in which every bucket holds `k` (or all, if fewer) nodes drawn uniformly from the
    /// live nodes of its id range: the converged state a network reaches after bootstrap and
    /// bucket refreshes. Built in parallel; a pure function of `seed`.
    pub fn converged(
        ids: &Ids,
        buckets: usize,
        k: usize,
        alive: &(impl Fn(u32) -> bool + Sync),
        seed: u64,
    ) -> Self {
        let mut t = Self::new(ids.len(), buckets, k);
        let (b, k) = (t.buckets, t.k);
        t.slots
            .par_chunks_mut(b * k)
            .zip(t.lens.par_chunks_mut(b))
            .enumerate()
            .for_each(|(node, (slots, lens))| {
                let mut rng = crate::rng::stream(seed, &[0x7AB1E, node as u64]);
                for j in 0..b {
                    fill(ids, node as u32, j, b, k, slots, lens, alive, &mut rng);
                }
            });
        t
    }

    /// Slots per bucket.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Buckets per node.
    pub fn buckets(&self) -> usize {
        self.buckets
    }

    /// Number of nodes.
    pub fn nodes(&self) -> usize {
        self.lens.len() / self.buckets
    }

    /// Bytes held by the tables.
    pub fn heap_bytes(&self) -> usize {
        self.slots.len() * 4 + self.lens.len()
    }

    /// Which bucket of the node with id `own` holds `other`.
    #[inline]
    pub fn bucket_of(&self, own: u64, other: u64) -> usize {
        (cpl(own, other) as usize).min(self.buckets - 1)
    }

    /// The entries of bucket `j` of `node`.
    #[inline]
    pub fn bucket(&self, node: u32, j: usize) -> &[u32] {
        let base = (node as usize * self.buckets + j) * self.k;
        let len = self
            .lens
            .get(node as usize * self.buckets + j)
            .copied()
            .unwrap_or(0) as usize;
        self.slots.get(base..base + len).unwrap_or(&[])
    }

    /// All entries of `node`.
    pub fn entries(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        (0..self.buckets).flat_map(move |j| self.bucket(node, j).iter().copied())
    }

    /// Number of entries of `node`.
    pub fn len_of(&self, node: u32) -> usize {
        (0..self.buckets).map(|j| self.bucket(node, j).len()).sum()
    }

    /// Whether bucket `j` of `node` has a free slot.
    #[inline]
    pub fn has_room(&self, node: u32, j: usize) -> bool {
        self.bucket(node, j).len() < self.k
    }

    /// Insert `other` into `node`'s table if its bucket has room and it is not there yet (an
    /// inbound or outbound contact). Returns whether it was inserted.
    pub fn insert(&mut self, ids: &Ids, node: u32, other: u32) -> bool {
        if node == other {
            return false;
        }
        let j = self.bucket_of(ids.id(node), ids.id(other));
        if self.bucket(node, j).contains(&other) || !self.has_room(node, j) {
            return false;
        }
        let li = node as usize * self.buckets + j;
        let Some(len) = self.lens.get_mut(li) else {
            return false;
        };
        let slot = li * self.k + *len as usize;
        if let Some(s) = self.slots.get_mut(slot) {
            *s = other;
            *len += 1;
            true
        } else {
            false
        }
    }

    /// Remove `other` from `node`'s table (a failed contact). Returns whether it was there.
    pub fn remove(&mut self, ids: &Ids, node: u32, other: u32) -> bool {
        let j = self.bucket_of(ids.id(node), ids.id(other));
        let li = node as usize * self.buckets + j;
        let base = li * self.k;
        let Some(len) = self.lens.get(li).map(|&l| l as usize) else {
            return false;
        };
        let Some(bucket) = self.slots.get_mut(base..base + len) else {
            return false;
        };
        let Some(pos) = bucket.iter().position(|&e| e == other) else {
            return false;
        };
        bucket.swap(pos, len - 1);
        if let Some(last) = bucket.last_mut() {
            *last = EMPTY;
        }
        if let Some(l) = self.lens.get_mut(li) {
            *l -= 1;
        }
        true
    }

    /// Empty `node`'s table (a restarted process starts from nothing).
    pub fn clear(&mut self, node: u32) {
        let b = self.buckets;
        let range = node as usize * b..(node as usize + 1) * b;
        if let Some(lens) = self.lens.get_mut(range.clone()) {
            lens.fill(0);
        }
        if let Some(slots) = self.slots.get_mut(range.start * self.k..range.end * self.k) {
            slots.fill(EMPTY);
        }
    }

    /// Drop the entries of `node` that `alive` says are down and fill every bucket's free slots
    /// with random live nodes of its range: the idealised effect of a bucket refresh (a lookup of
    /// a random id in each bucket's range contacts, and so liveness-checks, the bucket's
    /// region). Returns `(removed, added)`.
    pub fn refresh(
        &mut self,
        ids: &Ids,
        node: u32,
        alive: &impl Fn(u32) -> bool,
        rng: &mut SplitMix64,
    ) -> (usize, usize) {
        let (b, k) = (self.buckets, self.k);
        let range = node as usize * b..(node as usize + 1) * b;
        let Some(lens) = self.lens.get_mut(range.clone()) else {
            return (0, 0);
        };
        let Some(slots) = self.slots.get_mut(range.start * k..range.end * k) else {
            return (0, 0);
        };
        refresh_row(ids, node, b, k, slots, lens, alive, rng)
    }

    /// Refresh, in parallel, every node for which `due` returns the instant of its refresh:
    /// entries down at that instant are dropped and buckets refilled from nodes up then.
    /// Returns the total `(removed, added, refreshed nodes)`.
    pub fn par_refresh(
        &mut self,
        ids: &Ids,
        due: &(impl Fn(u32) -> Option<super::Micros> + Sync),
        alive_at: &(impl Fn(u32, super::Micros) -> bool + Sync),
        seed: u64,
    ) -> (usize, usize, usize) {
        let (b, k) = (self.buckets, self.k);
        self.slots
            .par_chunks_mut(b * k)
            .zip(self.lens.par_chunks_mut(b))
            .enumerate()
            .map(|(node, (slots, lens))| {
                let node = node as u32;
                let Some(at) = due(node) else {
                    return (0, 0, 0);
                };
                let mut rng = crate::rng::stream(seed, &[0x2EF2E5, u64::from(node), at]);
                let alive = |e: u32| alive_at(e, at);
                let (r, a) = refresh_row(ids, node, b, k, slots, lens, &alive, &mut rng);
                (r, a, 1)
            })
            .reduce(|| (0, 0, 0), |x, y| (x.0 + y.0, x.1 + y.1, x.2 + y.2))
    }

    /// The `m` entries of `node`'s table closest to `target`, closest first, skipping `exclude`;
    /// written to `out` as `(distance, node)`.
    pub fn closest(
        &self,
        ids: &Ids,
        node: u32,
        target: u64,
        m: usize,
        exclude: u32,
        out: &mut Vec<(u64, u32)>,
    ) {
        out.clear();
        let (b, k) = (self.buckets, self.k);
        let base = node as usize * b;
        let Some(row) = self.slots.get(base * k..(base + b) * k) else {
            return;
        };
        let c = self.bucket_of(ids.id(node), target);
        let id = ids.as_slice();
        // Live entries are a prefix of each bucket and free slots hold `EMPTY`, so a bucket is
        // read up to its first free slot without touching the length array (one cache miss
        // fewer per call: this runs once per simulated request).
        let push = |out: &mut Vec<(u64, u32)>, j: usize| {
            for &e in row.get(j * k..(j + 1) * k).unwrap_or(&[]) {
                if e == EMPTY {
                    break;
                }
                if e != exclude {
                    out.push((id.get(e as usize).copied().unwrap_or(0) ^ target, e));
                }
            }
        };
        // Sort `out[from..]`, keeping only what can still make the first `m`.
        let settle = |out: &mut Vec<(u64, u32)>, from: usize| {
            let want = m.saturating_sub(from);
            let tail = out.len() - from;
            if tail > want && want > 0 {
                if let Some(rest) = out.get_mut(from..) {
                    rest.select_nth_unstable_by_key(want - 1, |x| x.0);
                }
                out.truncate(from + want);
            }
            if let Some(rest) = out.get_mut(from..) {
                rest.sort_unstable_by_key(|x| x.0);
            }
        };
        push(out, c);
        settle(out, 0);
        if out.len() < m {
            let start = out.len();
            for j in c + 1..b {
                push(out, j);
            }
            settle(out, start);
        }
        let mut j = c;
        while out.len() < m && j > 0 {
            j -= 1;
            let start = out.len();
            push(out, j);
            settle(out, start);
        }
        out.truncate(m);
    }
}

/// Refresh one node's row (see [`Tables::refresh`]).
#[allow(clippy::too_many_arguments)]
fn refresh_row(
    ids: &Ids,
    node: u32,
    b: usize,
    k: usize,
    slots: &mut [u32],
    lens: &mut [u8],
    alive: &impl Fn(u32) -> bool,
    rng: &mut SplitMix64,
) -> (usize, usize) {
    let (mut removed, mut added) = (0, 0);
    for j in 0..b {
        let Some(len) = lens.get_mut(j) else { continue };
        let Some(bucket) = slots.get_mut(j * k..(j + 1) * k) else {
            continue;
        };
        let mut w = 0;
        for r in 0..*len as usize {
            let e = bucket.get(r).copied().unwrap_or(EMPTY);
            if alive(e) {
                if let Some(s) = bucket.get_mut(w) {
                    *s = e;
                }
                w += 1;
            } else {
                removed += 1;
            }
        }
        for s in bucket.iter_mut().skip(w) {
            *s = EMPTY;
        }
        *len = w as u8;
        fill(ids, node, j, b, k, slots, lens, alive, rng);
        added += lens.get(j).copied().unwrap_or(0) as usize - w;
    }
    (removed, added)
}

/// Node indices of bucket `j` of `node` (excluding `node` itself, which the last bucket's range
/// contains).
fn bucket_range(ids: &Ids, node: u32, j: usize, buckets: usize) -> Range<u32> {
    let own = ids.id(node);
    if j + 1 < buckets {
        ids.prefix_range(own ^ (1u64 << (63 - j)), j as u32 + 1)
    } else {
        ids.prefix_range(own, j as u32)
    }
}

/// Fill the free slots of bucket `j` (within one node's `slots`/`lens`) with distinct random live
/// nodes of its range.
#[allow(clippy::too_many_arguments)]
fn fill(
    ids: &Ids,
    node: u32,
    j: usize,
    buckets: usize,
    k: usize,
    slots: &mut [u32],
    lens: &mut [u8],
    alive: &impl Fn(u32) -> bool,
    rng: &mut SplitMix64,
) {
    let Some(len) = lens.get_mut(j) else { return };
    let Some(bucket) = slots.get_mut(j * k..(j + 1) * k) else {
        return;
    };
    let mut n = *len as usize;
    if n >= k {
        return;
    }
    let range = bucket_range(ids, node, j, buckets);
    let span = (range.end - range.start) as usize;
    let usable = |e: u32, bucket: &[u32], n: usize| {
        e != node && alive(e) && !bucket.iter().take(n).any(|&x| x == e)
    };
    if span <= 4 * k {
        // Small range: take a random subset of all its usable nodes.
        let mut cands: Vec<u32> = range.filter(|&e| usable(e, bucket, n)).collect();
        let take = (k - n).min(cands.len());
        for i in 0..take {
            let r = i + rng.below((cands.len() - i) as u64) as usize;
            cands.swap(i, r);
            if let (Some(s), Some(&c)) = (bucket.get_mut(n), cands.get(i)) {
                *s = c;
                n += 1;
            }
        }
    } else {
        // Large range: rejection sampling (the range holds more than 4k nodes, most alive).
        let mut attempts = 0;
        while n < k && attempts < 64 * k {
            attempts += 1;
            let e = range.start + rng.below(span as u64) as u32;
            if usable(e, bucket, n)
                && let Some(s) = bucket.get_mut(n)
            {
                *s = e;
                n += 1;
            }
        }
    }
    *len = n as u8;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_invariants(ids: &Ids, t: &Tables, alive: impl Fn(u32) -> bool) {
        for node in 0..ids.len() as u32 {
            let mut seen = std::collections::HashSet::new();
            for j in 0..t.buckets() {
                let b = t.bucket(node, j);
                assert!(b.len() <= t.k());
                for &e in b {
                    assert_ne!(e, node, "a node never lists itself");
                    assert!(seen.insert(e), "duplicate entry {e} at node {node}");
                    assert_eq!(
                        t.bucket_of(ids.id(node), ids.id(e)),
                        j,
                        "entry in wrong bucket"
                    );
                    assert!(alive(e));
                }
                // A bucket is full, or holds every live node of its range.
                let range = bucket_range(ids, node, j, t.buckets());
                let live = range.filter(|&e| e != node && alive(e)).count();
                assert_eq!(b.len(), live.min(t.k()), "node {node} bucket {j}");
            }
        }
    }

    #[test]
    fn converged_tables_satisfy_bucket_invariants() {
        let ids = Ids::random(3000, 4);
        let alive = |i: u32| i % 5 != 1;
        let t = Tables::converged(&ids, buckets_for(3000), 20, &alive, 9);
        assert_eq!(t.buckets(), 14);
        check_invariants(&ids, &t, alive);
        let again = Tables::converged(&ids, buckets_for(3000), 20, &alive, 9);
        assert_eq!(t.slots, again.slots, "same seed, same tables");
    }

    #[test]
    fn closest_matches_sorting_the_whole_table() {
        let ids = Ids::random(2000, 5);
        let t = Tables::converged(&ids, buckets_for(2000), 20, &|_| true, 1);
        let mut out = Vec::new();
        for q in 0..300u64 {
            let node = (q * 7 % 2000) as u32;
            let target = if q % 10 == 0 {
                ids.id(node) ^ 1
            } else {
                kindred_kernels::rng::mix64(q + 99)
            };
            let exclude = t.bucket(node, 0).first().copied().unwrap_or(u32::MAX);
            for m in [1, 8, 20, 60] {
                t.closest(&ids, node, target, m, exclude, &mut out);
                let mut all: Vec<(u64, u32)> = t
                    .entries(node)
                    .filter(|&e| e != exclude)
                    .map(|e| (ids.id(e) ^ target, e))
                    .collect();
                all.sort_unstable();
                all.truncate(m);
                assert_eq!(out, all, "node {node} m {m}");
            }
        }
    }

    #[test]
    fn insert_remove_refresh_keep_invariants() {
        let ids = Ids::random(1500, 6);
        let mut t = Tables::converged(&ids, buckets_for(1500), 20, &|_| true, 2);
        // Half the nodes leave; refresh repairs every table.
        let alive = |i: u32| i.is_multiple_of(2);
        let mut rng = SplitMix64::new(3);
        let mut removed = 0;
        for node in 0..1500u32 {
            removed += t.refresh(&ids, node, &alive, &mut rng).0;
        }
        assert!(removed > 1500 * 20, "{removed}");
        check_invariants(&ids, &t, alive);
        // Remove and re-insert.
        let node = 10u32;
        let victim = t.bucket(node, 0)[3];
        assert!(t.remove(&ids, node, victim));
        assert!(!t.remove(&ids, node, victim));
        assert!(t.insert(&ids, node, victim));
        assert!(!t.insert(&ids, node, victim), "no duplicates");
        assert!(!t.insert(&ids, node, node), "never itself");
        t.clear(node);
        assert_eq!(t.len_of(node), 0);
    }
}
