//! Where to reach the providers a round lookup found, until it asks them for headers.
//!
//! Kademlia learns a provider's addresses from the `GET_PROVIDERS` response that names it and
//! forgets them when that query ends, which, with the provider quorum, is usually long before the
//! lookup's queue reaches that provider. Dialling every provider on arrival kept the addresses
//! alive but opened hundreds of connections at once at scale, far past the pending and
//! established connection limits. So the driver notes the addresses on arrival here, and dials
//! with them when the header request is sent, at the lookup's header concurrency.

use std::collections::{HashMap, VecDeque};

use libp2p::{Multiaddr, PeerId};

/// Addresses kept per peer.
const MAX_ADDRS_PER_PEER: usize = 8;

/// A bounded map from peer to addresses; the oldest peer is forgotten first.
#[derive(Debug)]
pub(crate) struct AddrBook {
    addrs: HashMap<PeerId, Vec<Multiaddr>>,
    order: VecDeque<PeerId>,
    capacity: usize,
}

impl AddrBook {
    /// A book of at most `capacity` peers (at least one).
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            addrs: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Note addresses of `peer` (added to those known, duplicates dropped, at most
    /// [`MAX_ADDRS_PER_PEER`]); a new peer past capacity evicts the oldest.
    pub(crate) fn insert(&mut self, peer: PeerId, addrs: impl IntoIterator<Item = Multiaddr>) {
        let mut addrs = addrs.into_iter().peekable();
        if addrs.peek().is_none() {
            return;
        }
        if !self.addrs.contains_key(&peer) {
            while self.addrs.len() >= self.capacity {
                let Some(old) = self.order.pop_front() else {
                    break;
                };
                self.addrs.remove(&old);
            }
            self.order.push_back(peer);
        }
        let known = self.addrs.entry(peer).or_default();
        for a in addrs {
            if known.len() >= MAX_ADDRS_PER_PEER {
                break;
            }
            if !known.contains(&a) {
                known.push(a);
            }
        }
    }

    /// Peers whose every address noted goes through a relay: behind NAT.
    pub(crate) fn relay_only(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.addrs
            .iter()
            .filter(|(_, addrs)| addrs.iter().all(crate::direct_only::is_relayed))
            .map(|(p, _)| *p)
    }

    /// The addresses noted for `peer` (empty if none).
    pub(crate) fn get(&self, peer: &PeerId) -> &[Multiaddr] {
        self.addrs.get(peer).map_or(&[], Vec::as_slice)
    }

    /// Peers in the book.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.addrs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()
    }

    #[test]
    fn keeps_merges_and_bounds_addresses() {
        let mut book = AddrBook::new(2);
        let (a, b, c) = (PeerId::random(), PeerId::random(), PeerId::random());
        book.insert(a, [addr(1), addr(2)]);
        book.insert(a, [addr(2), addr(3)]);
        assert_eq!(book.get(&a), &[addr(1), addr(2), addr(3)]);
        book.insert(a, (10..30).map(addr));
        assert_eq!(book.get(&a).len(), MAX_ADDRS_PER_PEER);
        // No addresses: nothing noted, nothing evicted.
        book.insert(b, []);
        assert!(book.get(&b).is_empty());
        book.insert(b, [addr(4)]);
        assert_eq!(book.len(), 2);
        // A third peer evicts the oldest.
        book.insert(c, [addr(5)]);
        assert_eq!(book.len(), 2);
        assert!(book.get(&a).is_empty());
        assert_eq!(book.get(&b), &[addr(4)]);
        assert_eq!(book.get(&c), &[addr(5)]);
    }
}
