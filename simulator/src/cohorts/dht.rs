//! The DHT as the cohort tier sees it: provider records on semantic keys, and what they cost.
//!
//! A full Kademlia simulation of every search is what the routing tier does (one lookup there
//! walks the converged tables hop by hop), and at 10^6 nodes it costs about 20 ms of CPU a
//! lookup: a million searches a round would not fit the tier's budget. What the exchange needs
//! from the DHT is narrower, and the routing tier measured it: on a converged network a lookup
//! reaches the key's holders (100% success up to 10^6 nodes) in a number of requests that grows
//! with log N (p50 5 / 6 / 7 / 8 at 10^3 / 10^4 / 10^5 / 10^6). This model keeps exactly that:
//! records are stored at the key, a lookup returns them, and each walk is charged the routing
//! tier's requests at that N, each answered with 20 closer peers, with the routing tier's byte
//! model ([`MessageSizes`]).
//!
//! What a holder keeps: the key's [`PROVIDERS_PER_KEY`] latest providers (libp2p's store keeps
//! 20 a key), for the key window. A record carries the provider's SimHash sketch and its hub, so
//! that a lookup ranks the providers it found without asking each for its header.

use std::collections::HashMap;

use kindred_routing::keys::SemanticKey;

use crate::routing::traffic::MessageSizes;

/// Providers a key's holders keep, the latest first out.
pub const PROVIDERS_PER_KEY: usize = 20;

/// Holders a provider record is stored on (Kademlia's replication factor).
pub const REPLICAS: u64 = 20;

/// What a record carries besides the provider's entry: its 256-bit SimHash and its hub's id
/// (an encoded `PeerId` with its length).
const RECORD_EXTRA: u64 = 32 + 40;

/// Bytes of DHT operations at a network size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DhtCosts {
    /// Requests of one walk to a key's holders.
    pub rpcs: u64,
    /// The routing tier's message sizes.
    pub sizes: MessageSizes,
}

impl DhtCosts {
    /// The costs at `n` nodes: `⌈log10 n⌉ + 2` requests a walk, at least 4 (the routing tier's
    /// p50 at 10^3..10^6).
    ///
    /// ```
    /// use kindred_simulator::cohorts::DhtCosts;
    /// assert_eq!(DhtCosts::for_nodes(1_000_000).rpcs, 8);
    /// assert_eq!(DhtCosts::for_nodes(10_000).rpcs, 6);
    /// ```
    pub fn for_nodes(n: usize) -> Self {
        let digits = (n.max(1) as f64).log10().ceil() as u64;
        Self {
            rpcs: (digits + 2).max(4),
            sizes: MessageSizes::default(),
        }
    }

    /// A walk: each request answered with 20 closer peers.
    fn walk(&self) -> u64 {
        let s = &self.sizes;
        self.rpcs * u64::from(s.request + s.response_base + 20 * s.peer_entry)
    }

    /// A `GET_PROVIDERS` lookup that returned `found` records.
    pub fn lookup(&self, found: usize) -> u64 {
        self.walk() + found as u64 * (u64::from(self.sizes.peer_entry) + RECORD_EXTRA)
    }

    /// Announcing one key: a walk, then the record to each of its holders.
    pub fn announce(&self) -> u64 {
        self.walk() + REPLICAS * (u64::from(self.sizes.add_provider) + RECORD_EXTRA)
    }
}

/// Provider records of the current key window.
#[derive(Debug, Clone)]
pub struct Dht {
    costs: DhtCosts,
    window: u64,
    /// Per key (its first 8 bytes), its latest providers, oldest first.
    records: HashMap<u64, Vec<u32>>,
}

impl Dht {
    /// An empty DHT with these costs.
    pub fn new(costs: DhtCosts) -> Self {
        Self {
            costs,
            window: 0,
            records: HashMap::new(),
        }
    }

    /// The costs it charges.
    pub fn costs(&self) -> DhtCosts {
        self.costs
    }

    /// Enter key window `window`: the last window's records expire.
    pub fn set_window(&mut self, window: u64) {
        if window != self.window {
            self.window = window;
            self.records.clear();
        }
    }

    /// `provider` announces `key`; returns the bytes it cost.
    pub fn announce(&mut self, key: &SemanticKey, provider: u32) -> u64 {
        let list = self.records.entry(slot(key)).or_default();
        list.retain(|&p| p != provider);
        if list.len() >= PROVIDERS_PER_KEY {
            list.remove(0);
        }
        list.push(provider);
        self.costs.announce()
    }

    /// Look `key` up: its providers, and the bytes the lookup cost.
    pub fn lookup(&self, key: &SemanticKey) -> (&[u32], u64) {
        let found = self.records.get(&slot(key)).map_or(&[][..], Vec::as_slice);
        (found, self.costs.lookup(found.len()))
    }
}

fn slot(key: &SemanticKey) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(key.get(..8).unwrap_or(&[0; 8]));
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_keeps_its_latest_providers_until_the_window_ends() {
        let mut dht = Dht::new(DhtCosts::for_nodes(1000));
        let key = [7u8; 32];
        for p in 0..30 {
            assert!(dht.announce(&key, p) > 0);
        }
        dht.announce(&key, 15);
        let (found, bytes) = dht.lookup(&key);
        assert_eq!(found.len(), PROVIDERS_PER_KEY);
        assert_eq!(found.last(), Some(&15));
        assert!(!found.contains(&9), "the oldest went first");
        assert_eq!(bytes, dht.costs().lookup(PROVIDERS_PER_KEY));
        assert!(dht.lookup(&[8u8; 32]).0.is_empty());
        dht.set_window(1);
        assert!(dht.lookup(&key).0.is_empty());
    }

    #[test]
    fn a_walk_costs_more_requests_in_a_larger_network() {
        let small = DhtCosts::for_nodes(1000);
        let large = DhtCosts::for_nodes(1_000_000);
        assert_eq!((small.rpcs, large.rpcs), (5, 8));
        assert!(large.lookup(0) > small.lookup(0));
        assert!(small.lookup(20) > small.lookup(0));
    }
}
