//! Keeps a behaviour off relayed connections: Kindred's packet and exchange RPCs run on direct
//! connections only.
//!
//! # Why
//! A relay v2 circuit is for signalling and hole punching, not for data: a relay grants each
//! circuit 2 minutes and 128 KiB by default, less than one model update, and its operator pays
//! for every byte. So the RPC behaviour never gets a handler on a relayed connection, and a
//! request to a peer reachable only through a relay waits for the direct connection that hole
//! punching (DCUtR) opens beside the circuit. It does not wait forever: if no direct connection
//! comes within the punch window (or the driver learns the punch failed,
//! [`DirectOnly::give_up`]), the wrapped behaviour is told the dial failed, and its pending
//! requests fail as for any unreachable peer.
//!
//! The wrapped behaviour sees neither the relayed connections' establishment nor their close,
//! so it counts a peer as connected only while a direct connection is open, and dials when it
//! has none.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use either::Either;
use futures::FutureExt;
use libp2p::core::transport::PortUse;
use libp2p::core::{Endpoint, Multiaddr};
use libp2p::swarm::behaviour::{ConnectionClosed, ConnectionEstablished, DialFailure, FromSwarm};
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, DialError, NetworkBehaviour, THandler, THandlerInEvent,
    THandlerOutEvent, ToSwarm, dummy,
};
use libp2p::{PeerId, multiaddr::Protocol};
use tokio::time::{Instant, Sleep};

/// How long a request to a peer reachable only through a relay waits for a direct connection
/// by default: DCUtR makes up to three attempts, each a round trip over the relay and a
/// simultaneous dial.
pub const DEFAULT_PUNCH_WINDOW: Duration = Duration::from_secs(15);

/// Whether `addr` goes through a relay (`/p2p-circuit`).
///
/// ```
/// use kindred_routing::direct_only::is_relayed;
///
/// let relayed = "/ip4/203.0.113.10/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit";
/// assert!(is_relayed(&relayed.parse().unwrap()));
/// assert!(!is_relayed(&"/ip4/203.0.113.10/tcp/4001".parse().unwrap()));
/// ```
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

/// `inner`, on direct connections only (module docs).
pub struct DirectOnly<B> {
    inner: B,
    punch_window: Duration,
    /// Open relayed connections, by peer.
    relayed: HashMap<PeerId, HashSet<ConnectionId>>,
    /// Open direct connections, by peer.
    direct: HashMap<PeerId, HashSet<ConnectionId>>,
    /// Peers `inner` wants to reach that have only a relayed connection, and until when it
    /// waits for a direct one.
    waiting: HashMap<PeerId, Instant>,
    /// Wakes `poll` at the earliest of `waiting`'s deadlines.
    timer: Option<Pin<Box<Sleep>>>,
}

impl<B> DirectOnly<B> {
    /// Wrap `inner`; a request waits at most `punch_window` for a direct connection.
    pub fn new(inner: B, punch_window: Duration) -> Self {
        Self {
            inner,
            punch_window,
            relayed: HashMap::new(),
            direct: HashMap::new(),
            waiting: HashMap::new(),
            timer: None,
        }
    }

    /// The wrapped behaviour.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The wrapped behaviour, to send requests and responses.
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// Whether a direct connection to `peer` is open.
    pub fn is_direct(&self, peer: &PeerId) -> bool {
        self.direct.get(peer).is_some_and(|c| !c.is_empty())
    }

    /// Peers with a direct connection open.
    pub fn direct_peers(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.direct.keys().copied()
    }

    /// Open (direct, relayed) connections.
    pub fn connection_counts(&self) -> (usize, usize) {
        let count = |m: &HashMap<PeerId, HashSet<ConnectionId>>| m.values().map(HashSet::len).sum();
        (count(&self.direct), count(&self.relayed))
    }

    /// Stop waiting for a direct connection to `peer` (its hole punch failed): `inner`'s
    /// pending requests to it fail now.
    pub fn give_up(&mut self, peer: &PeerId) {
        if self.waiting.contains_key(peer) {
            self.waiting.insert(*peer, Instant::now());
            self.timer = None;
        }
    }

    fn wait_for_direct(&mut self, peer: PeerId) {
        let until = Instant::now() + self.punch_window;
        self.waiting.entry(peer).or_insert(until);
        self.timer = None;
    }

    fn note_closed(&mut self, peer: PeerId, id: ConnectionId) {
        for map in [&mut self.direct, &mut self.relayed] {
            if let Some(ids) = map.get_mut(&peer)
                && ids.remove(&id)
            {
                if ids.is_empty() {
                    map.remove(&peer);
                }
                return;
            }
        }
    }
}

impl<B: NetworkBehaviour> DirectOnly<B> {
    /// Tell `inner` the dial to each peer whose wait is over failed.
    fn expire(&mut self, now: Instant) {
        let over: Vec<PeerId> = self
            .waiting
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(p, _)| *p)
            .collect();
        for peer in over {
            self.waiting.remove(&peer);
            tracing::debug!(%peer, "no direct connection within the punch window");
            let error = DialError::Aborted;
            self.inner
                .on_swarm_event(FromSwarm::DialFailure(DialFailure {
                    peer_id: Some(peer),
                    error: &error,
                    connection_id: ConnectionId::new_unchecked(usize::MAX),
                }));
        }
    }
}

impl<B: NetworkBehaviour> NetworkBehaviour for DirectOnly<B> {
    type ConnectionHandler = Either<THandler<B>, dummy::ConnectionHandler>;
    type ToSwarm = B::ToSwarm;

    fn handle_pending_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<(), ConnectionDenied> {
        if is_relayed(local_addr) {
            return Ok(());
        }
        self.inner
            .handle_pending_inbound_connection(connection_id, local_addr, remote_addr)
    }

    fn handle_established_inbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        local_addr: &Multiaddr,
        remote_addr: &Multiaddr,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        if is_relayed(local_addr) {
            return Ok(Either::Right(dummy::ConnectionHandler));
        }
        self.inner
            .handle_established_inbound_connection(connection_id, peer, local_addr, remote_addr)
            .map(Either::Left)
    }

    fn handle_pending_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        maybe_peer: Option<PeerId>,
        addresses: &[Multiaddr],
        effective_role: Endpoint,
    ) -> Result<Vec<Multiaddr>, ConnectionDenied> {
        self.inner.handle_pending_outbound_connection(
            connection_id,
            maybe_peer,
            addresses,
            effective_role,
        )
    }

    fn handle_established_outbound_connection(
        &mut self,
        connection_id: ConnectionId,
        peer: PeerId,
        addr: &Multiaddr,
        role_override: Endpoint,
        port_use: PortUse,
    ) -> Result<THandler<Self>, ConnectionDenied> {
        if is_relayed(addr) {
            return Ok(Either::Right(dummy::ConnectionHandler));
        }
        self.inner
            .handle_established_outbound_connection(
                connection_id,
                peer,
                addr,
                role_override,
                port_use,
            )
            .map(Either::Left)
    }

    fn on_swarm_event(&mut self, event: FromSwarm<'_>) {
        match event {
            FromSwarm::ConnectionEstablished(established) => {
                let peer = established.peer_id;
                if established.endpoint.is_relayed() {
                    self.relayed
                        .entry(peer)
                        .or_default()
                        .insert(established.connection_id);
                    if !self.is_direct(&peer) {
                        // `inner` may have dialed this peer and reached only its relay.
                        self.wait_for_direct(peer);
                    }
                    return;
                }
                let direct = self.direct.entry(peer).or_default();
                direct.insert(established.connection_id);
                // `inner` counts the direct connections only.
                let other_established = direct.len() - 1;
                self.waiting.remove(&peer);
                self.inner.on_swarm_event(FromSwarm::ConnectionEstablished(
                    ConnectionEstablished {
                        other_established,
                        ..established
                    },
                ));
            }
            FromSwarm::ConnectionClosed(closed) => {
                self.note_closed(closed.peer_id, closed.connection_id);
                if closed.endpoint.is_relayed() {
                    return;
                }
                let remaining_established =
                    self.direct.get(&closed.peer_id).map_or(0, HashSet::len);
                self.inner
                    .on_swarm_event(FromSwarm::ConnectionClosed(ConnectionClosed {
                        remaining_established,
                        ..closed
                    }));
            }
            FromSwarm::AddressChange(change) if change.old.is_relayed() => {}
            other => self.inner.on_swarm_event(other),
        }
    }

    fn on_connection_handler_event(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        event: THandlerOutEvent<Self>,
    ) {
        match event {
            Either::Left(event) => {
                self.inner
                    .on_connection_handler_event(peer_id, connection_id, event);
            }
            Either::Right(never) => libp2p::core::util::unreachable(never),
        }
    }

    fn poll(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<ToSwarm<Self::ToSwarm, THandlerInEvent<Self>>> {
        if !self.waiting.is_empty() {
            if self.timer.is_none()
                && let Some(first) = self.waiting.values().min()
            {
                self.timer = Some(Box::pin(tokio::time::sleep_until(*first)));
            }
            if let Some(timer) = self.timer.as_mut()
                && timer.poll_unpin(cx).is_ready()
            {
                self.timer = None;
                self.expire(Instant::now());
            }
        }
        loop {
            let event = match self.inner.poll(cx) {
                Poll::Ready(event) => event,
                Poll::Pending => return Poll::Pending,
            };
            if let ToSwarm::Dial { opts } = &event
                && let Some(peer) = opts.get_peer_id()
                && self.relayed.contains_key(&peer)
                && !self.is_direct(&peer)
            {
                // The swarm would not dial a connected peer; a direct connection is what DCUtR
                // is opening beside the relayed one.
                self.wait_for_direct(peer);
                cx.waker().wake_by_ref();
                continue;
            }
            return Poll::Ready(event.map_in(Either::Left));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use libp2p::core::ConnectedPoint;
    use libp2p::swarm::dial_opts::DialOpts;

    use super::*;

    /// What `inner` was told: (established, closed) with their counts, and dial failures.
    #[derive(Default)]
    struct Recorder {
        seen: Vec<String>,
        dials: VecDeque<PeerId>,
    }

    impl NetworkBehaviour for Recorder {
        type ConnectionHandler = dummy::ConnectionHandler;
        type ToSwarm = ();

        fn handle_established_inbound_connection(
            &mut self,
            _: ConnectionId,
            _: PeerId,
            _: &Multiaddr,
            _: &Multiaddr,
        ) -> Result<THandler<Self>, ConnectionDenied> {
            Ok(dummy::ConnectionHandler)
        }

        fn handle_established_outbound_connection(
            &mut self,
            _: ConnectionId,
            _: PeerId,
            _: &Multiaddr,
            _: Endpoint,
            _: PortUse,
        ) -> Result<THandler<Self>, ConnectionDenied> {
            Ok(dummy::ConnectionHandler)
        }

        fn on_swarm_event(&mut self, event: FromSwarm<'_>) {
            match event {
                FromSwarm::ConnectionEstablished(e) => {
                    self.seen.push(format!("up {}", e.other_established));
                }
                FromSwarm::ConnectionClosed(e) => {
                    self.seen.push(format!("down {}", e.remaining_established));
                }
                FromSwarm::DialFailure(_) => self.seen.push("dial failed".into()),
                _ => {}
            }
        }

        fn on_connection_handler_event(
            &mut self,
            _: PeerId,
            _: ConnectionId,
            never: THandlerOutEvent<Self>,
        ) {
            libp2p::core::util::unreachable(never)
        }

        fn poll(&mut self, _: &mut Context<'_>) -> Poll<ToSwarm<(), THandlerInEvent<Self>>> {
            match self.dials.pop_front() {
                Some(peer) => Poll::Ready(ToSwarm::Dial {
                    opts: DialOpts::peer_id(peer).build(),
                }),
                None => Poll::Pending,
            }
        }
    }

    fn point(addr: &str) -> ConnectedPoint {
        ConnectedPoint::Dialer {
            address: addr.parse().unwrap_or_else(|_| Multiaddr::empty()),
            role_override: Endpoint::Dialer,
            port_use: PortUse::Reuse,
        }
    }

    fn up(b: &mut DirectOnly<Recorder>, peer: PeerId, id: usize, at: &ConnectedPoint) {
        b.on_swarm_event(FromSwarm::ConnectionEstablished(ConnectionEstablished {
            peer_id: peer,
            connection_id: ConnectionId::new_unchecked(id),
            endpoint: at,
            failed_addresses: &[],
            other_established: 0,
        }));
    }

    fn down(b: &mut DirectOnly<Recorder>, peer: PeerId, id: usize, at: &ConnectedPoint) {
        b.on_swarm_event(FromSwarm::ConnectionClosed(ConnectionClosed {
            peer_id: peer,
            connection_id: ConnectionId::new_unchecked(id),
            endpoint: at,
            cause: None,
            remaining_established: 1,
        }));
    }

    const RELAYED: &str = "/ip4/203.0.113.10/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit";

    #[test]
    fn the_inner_behaviour_sees_direct_connections_only_with_their_counts() {
        let mut b = DirectOnly::new(Recorder::default(), DEFAULT_PUNCH_WINDOW);
        let peer = PeerId::random();
        let (relayed, direct) = (point(RELAYED), point("/ip4/203.0.113.22/tcp/4001"));
        up(&mut b, peer, 1, &relayed);
        up(&mut b, peer, 2, &direct);
        assert_eq!(b.connection_counts(), (1, 1));
        // The swarm counts the relayed connection as remaining; `inner` must not.
        down(&mut b, peer, 2, &direct);
        down(&mut b, peer, 1, &relayed);
        assert_eq!(b.inner().seen, ["up 0", "down 0"]);
        assert_eq!(b.connection_counts(), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dial_to_a_peer_behind_a_relay_waits_for_the_punch_then_fails() {
        let window = Duration::from_secs(15);
        let mut b = DirectOnly::new(Recorder::default(), window);
        let peer = PeerId::random();
        up(&mut b, peer, 1, &point(RELAYED));
        b.inner_mut().dials.push_back(peer);
        // The dial is held (the swarm would not dial a connected peer).
        let polled = futures::future::poll_fn(|cx| Poll::Ready(b.poll(cx).is_pending())).await;
        assert!(polled);
        assert!(b.inner().seen.is_empty());
        tokio::time::advance(window + Duration::from_millis(1)).await;
        let _ = futures::future::poll_fn(|cx| Poll::Ready(b.poll(cx).is_pending())).await;
        assert_eq!(b.inner().seen, ["dial failed"]);

        // A direct connection within the window ends the wait: nothing fails.
        let mut b = DirectOnly::new(Recorder::default(), window);
        up(&mut b, peer, 1, &point(RELAYED));
        b.inner_mut().dials.push_back(peer);
        let _ = futures::future::poll_fn(|cx| Poll::Ready(b.poll(cx).is_pending())).await;
        up(&mut b, peer, 2, &point("/ip4/203.0.113.22/tcp/4001"));
        tokio::time::advance(window * 2).await;
        let _ = futures::future::poll_fn(|cx| Poll::Ready(b.poll(cx).is_pending())).await;
        assert_eq!(b.inner().seen, ["up 0"]);
    }
}
