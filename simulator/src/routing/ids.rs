//! Node identities on the XOR metric.
//!
//! The model places every node and every key at a 64-bit point. libp2p-kad measures distance
//! between 256-bit SHA-256 digests; the model keeps their top 64 bits, which order every pair of
//! points the same way unless two of them agree on 64 leading bits (probability about
//! `n²/2^65`, under 10^-7 for 10^6 nodes and 16·10^6 keys). Node indices are positions in the
//! sorted id array, so the nodes sharing any id prefix form one contiguous index range: k-bucket
//! ranges and brute-force closest sets are binary searches.

use std::ops::Range;

use kindred_kernels::rng::SplitMix64;

/// Sorted, distinct node ids; node `i` is the node with the `i`-th smallest id.
#[derive(Debug, Clone)]
pub struct Ids {
    ids: Vec<u64>,
}

/// Common prefix length of two points (64 when equal).
#[inline]
pub fn cpl(a: u64, b: u64) -> u32 {
    (a ^ b).leading_zeros()
}

/// The 64-bit DHT point of a 32-byte key (the top 64 bits of its blake3 digest, big-endian).
pub fn key_point(key: &[u8; 32]) -> u64 {
    let h = blake3::hash(key);
    let mut top = [0u8; 8];
    top.copy_from_slice(h.as_bytes().get(..8).unwrap_or(&[0; 8]));
    u64::from_be_bytes(top)
}

impl Ids {
    /// `n` distinct uniformly random ids drawn from `seed`.
    pub fn random(n: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed ^ 0x1D5_1D5_1D5);
        let mut ids: Vec<u64> = (0..n).map(|_| rng.next_u64()).collect();
        ids.sort_unstable();
        ids.dedup();
        while ids.len() < n {
            ids.push(rng.next_u64());
            ids.sort_unstable();
            ids.dedup();
        }
        Self { ids }
    }

    /// Ids given explicitly (sorted and deduplicated here).
    pub fn from_ids(mut ids: Vec<u64>) -> Self {
        ids.sort_unstable();
        ids.dedup();
        Self { ids }
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The id of node `i` (0 past the end).
    #[inline]
    pub fn id(&self, i: u32) -> u64 {
        self.ids.get(i as usize).copied().unwrap_or(0)
    }

    /// All ids, ascending.
    pub fn as_slice(&self) -> &[u64] {
        &self.ids
    }

    /// Nodes whose ids agree with `point` on the top `bits` bits.
    pub fn prefix_range(&self, point: u64, bits: u32) -> Range<u32> {
        if bits == 0 {
            return 0..self.ids.len() as u32;
        }
        let bits = bits.min(64);
        let span: u128 = 1u128 << (64 - bits);
        let lo = u128::from(point) & !(span - 1);
        let hi = lo + span;
        let a = self.ids.partition_point(|&x| u128::from(x) < lo);
        let b = self.ids.partition_point(|&x| u128::from(x) < hi);
        a as u32..b as u32
    }

    /// Brute force: the `m` nodes closest to `point` by XOR distance among those `alive` says
    /// are up, closest first.
    pub fn closest(&self, point: u64, m: usize, alive: impl Fn(u32) -> bool) -> Vec<u32> {
        // Widen the prefix until the subtree around `point` holds `m` live nodes: every node
        // outside a subtree is farther than every node inside it.
        let mut bits = 64u32;
        loop {
            let r = self.prefix_range(point, bits);
            let live: Vec<u32> = r.clone().filter(|&i| alive(i)).collect();
            if live.len() >= m || bits == 0 {
                let mut live = live;
                live.sort_by_key(|&i| self.id(i) ^ point);
                live.truncate(m);
                return live;
            }
            bits -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_sorted_distinct_and_seeded() {
        let a = Ids::random(1000, 7);
        assert_eq!(a.len(), 1000);
        assert!(a.as_slice().windows(2).all(|w| w[0] < w[1]));
        assert_eq!(a.as_slice(), Ids::random(1000, 7).as_slice());
        assert_ne!(a.as_slice(), Ids::random(1000, 8).as_slice());
    }

    #[test]
    fn prefix_ranges_hold_exactly_the_prefix() {
        let ids = Ids::random(5000, 1);
        for (point, bits) in [
            (0u64, 0u32),
            (u64::MAX, 3),
            (0x8000_0000_0000_0000, 1),
            (12345, 9),
        ] {
            let r = ids.prefix_range(point, bits);
            for i in 0..ids.len() as u32 {
                let inside = bits == 0 || cpl(ids.id(i), point) >= bits;
                assert_eq!(r.contains(&i), inside, "{point:x}/{bits} node {i}");
            }
        }
        let exact = ids.id(17);
        assert_eq!(ids.prefix_range(exact, 64), 17..18);
    }

    #[test]
    fn closest_matches_a_full_scan() {
        let ids = Ids::random(3000, 2);
        for t in 0..50u64 {
            let point = kindred_kernels::rng::mix64(t + 1);
            let alive = |i: u32| !i.is_multiple_of(3);
            let got = ids.closest(point, 8, alive);
            let mut all: Vec<u32> = (0..3000).filter(|&i| alive(i)).collect();
            all.sort_by_key(|&i| ids.id(i) ^ point);
            assert_eq!(got, all[..8]);
        }
    }
}
