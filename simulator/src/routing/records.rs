//! Provider records: who announced which key, and which nodes hold the announcement.
//!
//! An announcement is stored at the (up to `k`) closest nodes its publisher's lookup found. A
//! holder keeps the first `max_providers_per_key` providers of a key (libp2p's `MemoryStore`
//! ignores later ones) and answers `GET_PROVIDERS` with the first `k` of them in arrival order,
//! skipping the requester (libp2p-kad takes the replication factor), and only for announcements
//! it received in its current session: a restarted node has lost its in-memory store.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::Micros;
use super::churn::Timelines;

/// One stored announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ann {
    point: u64,
    stored: Micros,
    provider: u32,
    holders_at: u32,
    holders_len: u32,
}

/// Announcement pending storage (collected from one epoch's lookups).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// DHT point of the key.
    pub point: u64,
    /// When the holders received it.
    pub stored: Micros,
    /// The announcing node.
    pub provider: u32,
    /// Nodes it was stored at.
    pub holders: Vec<u32>,
}

/// All provider records of a run, sorted by key point then arrival time.
#[derive(Debug, Default, Clone)]
pub struct Records {
    anns: Vec<Ann>,
    holders: Vec<u32>,
    /// Key point → `(first, count)` in `anns`: one probe instead of a binary search over
    /// millions of records per simulated `GET_PROVIDERS` answer.
    index: HashMap<u64, (u32, u32), BuildHasherDefault<PointHasher>>,
}

/// Key points are uniform hashes already: use them as their own hash.
#[derive(Debug, Default, Clone, Copy)]
struct PointHasher(u64);

impl Hasher for PointHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

impl Records {
    /// No records.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of announcements stored.
    pub fn len(&self) -> usize {
        self.anns.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.anns.is_empty()
    }

    /// Bytes held.
    pub fn heap_bytes(&self) -> usize {
        self.anns.capacity() * std::mem::size_of::<Ann>()
            + self.holders.capacity() * 4
            + self.index.capacity() * 24
    }

    /// Store a batch of announcements (kept sorted by point, then arrival, then provider).
    pub fn extend(&mut self, batch: Vec<Announcement>) {
        if batch.is_empty() {
            return;
        }
        for a in batch {
            if a.holders.is_empty() {
                continue;
            }
            self.anns.push(Ann {
                point: a.point,
                stored: a.stored,
                provider: a.provider,
                holders_at: self.holders.len() as u32,
                holders_len: a.holders.len() as u32,
            });
            self.holders.extend(a.holders);
        }
        self.anns
            .sort_unstable_by_key(|a| (a.point, a.stored, a.provider));
        self.index.clear();
        self.index.reserve(self.anns.len());
        let mut i = 0;
        while let Some(first) = self.anns.get(i) {
            let mut j = i + 1;
            while self.anns.get(j).is_some_and(|a| a.point == first.point) {
                j += 1;
            }
            self.index.insert(first.point, (i as u32, (j - i) as u32));
            i = j;
        }
    }

    fn range(&self, point: u64) -> &[Ann] {
        match self.index.get(&point) {
            Some(&(a, n)) => self.anns.get(a as usize..(a + n) as usize).unwrap_or(&[]),
            None => &[],
        }
    }

    fn holders_of(&self, ann: &Ann) -> &[u32] {
        let a = ann.holders_at as usize;
        self.holders
            .get(a..a + ann.holders_len as usize)
            .unwrap_or(&[])
    }

    /// The providers `holder` returns for `point` at time `now` to `requester`, appended to
    /// `out`, as libp2p-kad answers: its store holds the first `store_cap` announcements it
    /// received in its current session (later ones are ignored), and an answer lists them in
    /// that order, skipping the requester, at most `answer_cap` of them (libp2p takes the
    /// replication factor).
    #[allow(clippy::too_many_arguments)]
    pub fn providers_at(
        &self,
        timelines: &Timelines,
        holder: u32,
        point: u64,
        now: Micros,
        requester: u32,
        store_cap: usize,
        answer_cap: usize,
        out: &mut Vec<u32>,
    ) {
        let (mut stored, mut answered) = (0, 0);
        for ann in self.range(point) {
            if stored >= store_cap || answered >= answer_cap {
                break;
            }
            if ann.stored <= now
                && self.holders_of(ann).contains(&holder)
                && timelines.up_throughout(holder, ann.stored, now)
            {
                stored += 1;
                if ann.provider != requester {
                    out.push(ann.provider);
                    answered += 1;
                }
            }
        }
    }

    /// Distinct providers that announced `point` (whatever became of their holders).
    pub fn announcers(&self, point: u64) -> impl Iterator<Item = u32> + '_ {
        self.range(point).iter().map(|a| a.provider)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_answer_in_arrival_order_up_to_the_cap() {
        let mut r = Records::new();
        let batch = (0..10u32)
            .map(|p| Announcement {
                point: 42,
                stored: 100 - u64::from(p),
                provider: p,
                holders: vec![1, 2],
            })
            .collect();
        r.extend(batch);
        r.extend(vec![Announcement {
            point: 43,
            stored: 0,
            provider: 99,
            holders: vec![2],
        }]);
        let t = Timelines::always_on(100);
        let mut out = Vec::new();
        r.providers_at(&t, 1, 42, 1000, 50, 64, 3, &mut out);
        assert_eq!(out, [9, 8, 7], "earliest arrivals first");
        out.clear();
        r.providers_at(&t, 1, 42, 1000, 8, 64, 3, &mut out);
        assert_eq!(
            out,
            [9, 7, 6],
            "the requester is skipped before the answer is capped"
        );
        out.clear();
        r.providers_at(&t, 1, 42, 1000, 50, 2, 5, &mut out);
        assert_eq!(out, [9, 8], "the store keeps the first arrivals only");
        out.clear();
        r.providers_at(&t, 3, 42, 1000, 50, 64, 64, &mut out);
        assert!(out.is_empty(), "not a holder");
        out.clear();
        r.providers_at(&t, 1, 42, 95, 50, 64, 64, &mut out);
        assert_eq!(out, [9, 8, 7, 6, 5], "not yet stored");
        assert_eq!(r.announcers(43).collect::<Vec<_>>(), [99]);
        assert_eq!(r.len(), 11);
    }
}
