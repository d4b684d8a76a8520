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

#[cfg(test)]
mod tests {
    use super::*;

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
