//! Refuses connections from peers whose identity key is weak, non-canonical or not ed25519.
//!
//! Why this exists: the Noise handshake proves the remote holds its identity key by an ed25519
//! signature checked with libp2p's *permissive* verification, which accepts small-order
//! ("weak") public keys. For such a key a signature can be forged without any secret, so anyone
//! can complete a handshake as that `PeerId`, and everything keyed by peer (scores, bans, replay
//! marks, provider records) could be shared by many anonymous parties. Kindred's packets are
//! checked strictly ([`kindred_proto::check_peer`] and the packet verification in
//! `kindred-proto`), so the connection layer must refuse the same identities: this behaviour sits
//! first in [`crate::behaviour::Behaviour`] and denies an established connection (inbound or
//! outbound) whose peer fails [`kindred_proto::check_peer`], before Kademlia, identify or the
//! RPCs see it. A dial to a known weak peer id (e.g. one another node advertised) is refused
//! before it starts.
//!
//! Denials are logged, counted by [`IdentityGate::denied`], and surface as swarm connection
//! errors whose cause downcasts to [`IdentityDenied`]; the driver counts them in
//! [`crate::RoutingMetrics::rejects`] under `bad_identity`.

use std::convert::Infallible;
use std::task::{Context, Poll};

use kindred_proto::IdentityError;
use libp2p::core::Endpoint;
use libp2p::core::transport::PortUse;
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, FromSwarm, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{Multiaddr, PeerId};

/// The reject label under which denied connections are counted.
pub const BAD_IDENTITY: &str = "bad_identity";

/// Why a connection was denied: the peer's identity fails the strict key check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("peer {peer} refused: {reason}")]
pub struct IdentityDenied {
    /// The refused peer.
    pub peer: PeerId,
    /// What is wrong with its key.
    pub reason: IdentityError,
}

/// A `NetworkBehaviour` that denies connections to and from peers with unacceptable identity
/// keys (see the module docs). It has no protocol and emits no events.
#[derive(Debug, Default)]
pub struct IdentityGate {
    denied: u64,
}

impl IdentityGate {
    /// A gate with no denials counted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Connections (and dials) denied so far.
    pub fn denied(&self) -> u64 {
        self.denied
    }

    /// `Ok` for an acceptable peer; otherwise count, log and deny.
    fn check(&mut self, peer: PeerId) -> Result<(), ConnectionDenied> {
        kindred_proto::check_peer(&peer).map_err(|reason| {
            self.denied += 1;
            tracing::warn!(%peer, %reason, "refusing peer with an unacceptable identity key");
            ConnectionDenied::new(IdentityDenied { peer, reason })
        })
    }
}

impl NetworkBehaviour for IdentityGate {
    type ConnectionHandler = dummy::ConnectionHandler;
    type ToSwarm = Infallible;

    fn handle_pending_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: Option<PeerId>,
        _: &[Multiaddr],
        _: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        if let Some(peer) = peer {
            self.check(peer)?;
        }
        Ok(Vec::new())
    }

    fn handle_established_inbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.check(peer)?;
        Ok(dummy::ConnectionHandler)
    }

    fn handle_established_outbound_connection(
        &mut self,
        _: ConnectionId,
        peer: PeerId,
        _: &Multiaddr,
        _: Endpoint,
        _: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        self.check(peer)?;
        Ok(dummy::ConnectionHandler)
    }

    fn on_swarm_event(&mut self, _: FromSwarm<'_>) {}

    fn on_connection_handler_event(
        &mut self,
        _: PeerId,
        _: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {}
    }

    fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use libp2p::identity::{Keypair, PublicKey, ed25519};

    /// A peer id for the ed25519 identity point (y = 1, order 1): libp2p accepts the key, and a
    /// Noise handshake under it needs no secret.
    fn weak_peer() -> PeerId {
        let mut bytes = [0u8; 32];
        bytes[0] = 1;
        let key = ed25519::PublicKey::try_from_bytes(&bytes).expect("libp2p accepts the point");
        PublicKey::from(key).to_peer_id()
    }

    fn addr(port: u16) -> Multiaddr {
        format!("/ip4/127.0.0.1/tcp/{port}").parse().unwrap()
    }

    #[test]
    fn weak_peers_are_denied_honest_peers_accepted() {
        let mut gate = IdentityGate::new();
        let honest = Keypair::generate_ed25519().public().to_peer_id();
        let weak = weak_peer();
        let id = ConnectionId::new_unchecked(1);
        let (local, remote) = (addr(4001), addr(4002));

        assert!(
            gate.handle_established_inbound_connection(id, honest, &local, &remote)
                .is_ok()
        );
        assert!(
            gate.handle_established_outbound_connection(
                id,
                honest,
                &remote,
                Endpoint::Dialer,
                PortUse::Reuse
            )
            .is_ok()
        );
        assert_eq!(gate.denied(), 0);

        let denied = gate
            .handle_established_inbound_connection(id, weak, &local, &remote)
            .err()
            .expect("a weak inbound peer is denied");
        assert_eq!(
            denied.downcast_ref::<IdentityDenied>(),
            Some(&IdentityDenied {
                peer: weak,
                reason: IdentityError::Weak
            })
        );
        assert!(
            gate.handle_established_outbound_connection(
                id,
                weak,
                &remote,
                Endpoint::Dialer,
                PortUse::Reuse
            )
            .is_err()
        );
        // A dial to a known weak peer id never starts; unknown peers are not judged yet.
        assert!(
            gate.handle_pending_outbound_connection(id, Some(weak), &[], Endpoint::Dialer)
                .is_err()
        );
        assert!(
            gate.handle_pending_outbound_connection(id, None, &[], Endpoint::Dialer)
                .is_ok()
        );
        assert_eq!(gate.denied(), 3);
    }

    /// Through the composed behaviour: the gate runs before the other behaviours.
    #[test]
    fn the_composed_behaviour_denies_weak_peers() {
        let key = Keypair::generate_ed25519();
        let config = crate::RoutingConfig::new(crate::NetworkId::from_name("gate-test"));
        let (_, relay) = libp2p::relay::client::new(key.public().to_peer_id());
        let mut behaviour = crate::behaviour::Behaviour::new(&key, &config, relay);
        let honest = Keypair::generate_ed25519().public().to_peer_id();
        let id = ConnectionId::new_unchecked(7);
        let (local, remote) = (addr(4001), addr(4002));
        let denied = behaviour
            .handle_established_inbound_connection(id, weak_peer(), &local, &remote)
            .err()
            .expect("a weak peer is denied");
        assert!(denied.downcast_ref::<IdentityDenied>().is_some());
        assert!(
            behaviour
                .handle_established_inbound_connection(
                    ConnectionId::new_unchecked(8),
                    honest,
                    &local,
                    &remote
                )
                .is_ok()
        );
        assert_eq!(behaviour.identity_gate.denied(), 1);
    }
}
