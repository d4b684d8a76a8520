//! Whether other peers can dial this node: AutoNAT's verdict.
//!
//! # Why it looks like this
//! Most GPU hosts sit behind NAT, and a node that nobody can dial must not head a cohort. Every
//! node runs AutoNAT in both roles: it asks connected peers to dial its addresses back, and
//! dials back peers that ask. A peer only dials addresses on the IP it observes the asker at,
//! so a node cannot aim others at a third party.
//!
//! **v1, not v2.** AutoNAT v2 tests each address on a fresh connection from a fresh port
//! (v1 can be fooled by a hole punched for the asking connection; Kindred punches no holes
//! yet), but a v2 server makes the asker send 30-100 KB first whenever the tested address is
//! not exactly the asking connection's (a dial from another port, a second transport): in the
//! 4-node demo one node in four paid 54 KB for its test, more than the rest of its warm-up. v2
//! also offers no test of an address already taken as reachable (identify sends no candidate
//! for it), and a node's listen addresses are. v1 costs a few hundred bytes per probe and
//! probes every 90 s until it is sure (three agreeing answers), then every 15 minutes. With
//! hole punching, v2's fresh-port dial-back is what stops a punched hole from passing: switch
//! then.
//!
//! [`NatStatus`] is the verdict the node reports (status, metrics, log).

use std::time::Duration;

use libp2p::autonat;
use serde::{Deserialize, Serialize};

/// Whether other peers can dial this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NatStatus {
    /// No AutoNAT probe has answered yet.
    #[default]
    Unknown,
    /// Peers dialled one of its addresses back.
    Public,
    /// Peers could not dial any of its addresses back: behind NAT or a firewall.
    Private,
}

impl NatStatus {
    /// `"unknown"`, `"public"` or `"private"`, as status and metrics show it.
    ///
    /// ```
    /// use kindred_routing::reachability::NatStatus;
    /// assert_eq!(NatStatus::default().as_str(), "unknown");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Public => "public",
            Self::Private => "private",
        }
    }
}

impl std::fmt::Display for NatStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&autonat::NatStatus> for NatStatus {
    fn from(s: &autonat::NatStatus) -> Self {
        match s {
            autonat::NatStatus::Public(_) => Self::Public,
            autonat::NatStatus::Private => Self::Private,
            autonat::NatStatus::Unknown => Self::Unknown,
        }
    }
}

/// The AutoNAT settings every node runs with: libp2p's defaults (probes every 90 s until three
/// answers agree, then every 15 minutes; at most 30 dial-backs a second for others), except
/// that the first probe goes out 5 s after start instead of 15, and that peers on private and
/// loopback addresses take part: a swarm on one LAN or one host gets a verdict too, and a
/// server only ever dials the IP it sees the asker at. Servers are not every connected peer but
/// those the driver names: identified peers this node never met through a relay. A peer met
/// through a relay may share a punched hole with this node, and its dial-back would pass
/// through the hole: a NATed node would take itself for public. (A server behind NAT is fine:
/// a dial-back only needs to dial out.)
pub fn autonat_config() -> autonat::Config {
    autonat::Config {
        boot_delay: Duration::from_secs(5),
        only_global_ips: false,
        use_connected: false,
        ..autonat::Config::default()
    }
}

/// Probes in a row that a peer could not dial back before a node that was dialled back before is
/// taken as private (AutoNAT takes one, whenever it was not yet sure of its verdict).
pub const PRIVATE_AFTER_FAILURES: u32 = 3;

/// AutoNAT's verdict with a memory of this node's probes ([`Reachability::settled`]).
///
/// A dial-back fails whenever the node being dialled does not answer in time, not only behind
/// NAT: two nodes of a 10^9-parameter model on one 2-core host, each busy for seconds
/// distilling or merging, failed one probe now and then, and AutoNAT, not yet sure after its
/// first few answers, flipped the node to private and back within minutes. A private node ranks
/// after every dialable peer, but its peers never learn that it thinks so: in `kindred
/// bench-model --params 1000000000` each of the two took the other for its hub and pushed to it
/// (both applied their own update that round; 2 of 6 runs). So a node that peers dialled back
/// once stays public until [`PRIVATE_AFTER_FAILURES`] probes in a row fail (about 4.5 minutes
/// at AutoNAT's 90 s retry); one never dialled back takes AutoNAT's verdict at once, as a node
/// behind NAT must.
///
/// ```
/// use kindred_routing::reachability::{NatStatus, Reachability};
/// let mut r = Reachability::default();
/// r.probe(true);
/// r.probe(false);
/// assert_eq!(r.settled(NatStatus::Private), NatStatus::Public);
/// r.probe(false);
/// r.probe(false);
/// assert_eq!(r.settled(NatStatus::Private), NatStatus::Private);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reachability {
    dialled_back: bool,
    failed_in_row: u32,
}

impl Reachability {
    /// A probe of this node ended with a verdict: peers dialled it back, or could not.
    pub fn probe(&mut self, dialled_back: bool) {
        if dialled_back {
            self.dialled_back = true;
            self.failed_in_row = 0;
        } else {
            self.failed_in_row = self.failed_in_row.saturating_add(1);
        }
    }

    /// The verdict to act on, given AutoNAT's.
    pub fn settled(&self, autonat: NatStatus) -> NatStatus {
        match autonat {
            NatStatus::Private
                if self.dialled_back && self.failed_in_row < PRIVATE_AFTER_FAILURES =>
            {
                NatStatus::Public
            }
            status => status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_dialled_back_once_needs_failures_in_a_row_to_turn_private() {
        // Never dialled back: AutoNAT's verdict at once (a node behind NAT).
        let mut natted = Reachability::default();
        assert_eq!(natted.settled(NatStatus::Unknown), NatStatus::Unknown);
        natted.probe(false);
        assert_eq!(natted.settled(NatStatus::Private), NatStatus::Private);
        // Dialled back, then a failure now and then: public throughout.
        let mut busy = Reachability::default();
        busy.probe(true);
        for _ in 0..10 {
            for _ in 1..PRIVATE_AFTER_FAILURES {
                busy.probe(false);
                assert_eq!(busy.settled(NatStatus::Private), NatStatus::Public);
            }
            busy.probe(true);
            assert_eq!(busy.settled(NatStatus::Public), NatStatus::Public);
        }
        // Failures in a row: private, until a peer dials it back again.
        for _ in 0..PRIVATE_AFTER_FAILURES {
            busy.probe(false);
        }
        assert_eq!(busy.settled(NatStatus::Private), NatStatus::Private);
        assert_eq!(busy.settled(NatStatus::Unknown), NatStatus::Unknown);
        busy.probe(true);
        assert_eq!(busy.settled(NatStatus::Private), NatStatus::Public);
    }

    #[test]
    fn libp2p_verdicts_map_to_the_reported_ones() {
        let addr = libp2p::Multiaddr::empty();
        assert_eq!(
            NatStatus::from(&autonat::NatStatus::Public(addr)),
            NatStatus::Public
        );
        assert_eq!(
            NatStatus::from(&autonat::NatStatus::Private),
            NatStatus::Private
        );
        assert_eq!(
            NatStatus::from(&autonat::NatStatus::Unknown),
            NatStatus::Unknown
        );
        assert_eq!(NatStatus::Private.to_string(), "private");
        let json = serde_json::to_string(&NatStatus::Public).unwrap_or_default();
        assert_eq!(json, "\"public\"");
    }
}
