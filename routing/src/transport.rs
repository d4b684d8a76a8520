//! The transport stack: TCP → optional pnet → Noise → yamux, under one deadline; beside it QUIC
//! in a public swarm; DNS names resolved in front of both. In-memory for tests.
//!
//! A private swarm is a pre-shared key: with one, every connection starts with the libp2p pnet
//! handshake (XSalsa20 keyed by the swarm key), and a peer without the same key produces only
//! noise that the Noise handshake rejects. The whole upgrade (pnet, multistream-select, Noise,
//! yamux) runs under `handshake_timeout`, so a wrong key or a silent peer fails in seconds rather
//! than holding a connection slot. pnet wraps a byte stream and QUIC has its own encryption
//! (TLS 1.3 over UDP), so a private swarm is TCP only: it never dials or listens on QUIC.
//!
//! A public swarm runs QUIC too (`/udp/…/quic-v1`): one round trip to a connection where TCP
//! takes three handshakes, streams that do not block each other, and the transport that UDP hole
//! punching needs behind NAT. Bootstrap peers may be named by DNS (`/dns4/…`, `/dns/…`),
//! resolved through the system's resolver configuration.
//!
//! Beside them, relay v2 circuits ([`relayed_transport`]): a connection to a peer behind NAT
//! through a relay, upgraded like a TCP one (pnet in a private swarm, Noise, yamux), so that
//! hole punching can open a direct connection beside it.

use std::time::Duration;

use futures::future::Either;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, MemoryTransport};
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::{PeerId, Transport, dns, noise, quic, relay, tcp, yamux};

use crate::config::TransportKind;

/// Why the transport could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The identity key cannot be used for Noise.
    #[error("noise configuration failed: {0}")]
    Noise(#[from] noise::Error),
}

/// Whether `addr` is a QUIC address (`/udp/…/quic-v1`), which a private swarm cannot use.
///
/// ```
/// use kindred_routing::transport::is_quic;
///
/// assert!(is_quic(&"/ip4/127.0.0.1/udp/4001/quic-v1".parse().unwrap()));
/// assert!(!is_quic(&"/ip4/127.0.0.1/tcp/4001".parse().unwrap()));
/// ```
pub fn is_quic(addr: &libp2p::Multiaddr) -> bool {
    addr.iter().any(|p| {
        matches!(
            p,
            libp2p::multiaddr::Protocol::QuicV1 | libp2p::multiaddr::Protocol::Quic
        )
    })
}

/// Whether a listen address can be taken as reachable by peers without a test: a public IP, a
/// DNS name, loopback (one host) or in-memory (one process). Addresses in private ranges (RFC 1918, shared CGNAT space,
/// link-local, IPv6 unique-local) are usually behind NAT: AutoNAT decides for them
/// ([`crate::reachability`]).
///
/// ```
/// use kindred_routing::transport::looks_reachable;
///
/// assert!(looks_reachable(&"/ip4/203.0.113.7/tcp/4001".parse().unwrap()));
/// assert!(looks_reachable(&"/ip4/127.0.0.1/tcp/4001".parse().unwrap()));
/// assert!(!looks_reachable(&"/ip4/192.168.1.2/tcp/4001".parse().unwrap()));
/// assert!(!looks_reachable(&"/ip4/100.64.0.9/udp/4001/quic-v1".parse().unwrap()));
/// ```
pub fn looks_reachable(addr: &libp2p::Multiaddr) -> bool {
    use libp2p::multiaddr::Protocol;
    if crate::direct_only::is_relayed(addr) {
        return false;
    }
    match addr.iter().next() {
        Some(Protocol::Ip4(ip)) => {
            let [a, b, ..] = ip.octets();
            let cgnat = a == 100 && (64..128).contains(&b);
            ip.is_loopback()
                || !(ip.is_private() || ip.is_link_local() || ip.is_unspecified() || cgnat)
        }
        Some(Protocol::Ip6(ip)) => {
            let first = ip.segments()[0];
            let unique_local = first & 0xfe00 == 0xfc00;
            let link_local = first & 0xffc0 == 0xfe80;
            ip.is_loopback() || !(ip.is_unspecified() || unique_local || link_local)
        }
        // A DNS name is the operator's statement; memory addresses are one process's.
        Some(Protocol::Dns(_) | Protocol::Dns4(_) | Protocol::Dns6(_) | Protocol::Memory(_)) => {
            true
        }
        _ => false,
    }
}

/// Why a swarm key file could not be parsed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SwarmKeyError {
    /// Not in the `/key/swarm/psk/1.0.0/` + `/base16/` + 64 hex digits format.
    #[error("invalid swarm key: {0}")]
    Invalid(#[from] libp2p::pnet::KeyParseError),
}

/// Parse a swarm key in the IPFS `swarm.key` format:
///
/// ```text
/// /key/swarm/psk/1.0.0/
/// /base16/
/// <64 hex digits>
/// ```
///
/// # Errors
/// [`SwarmKeyError::Invalid`] for anything else.
///
/// ```
/// let text = format!("/key/swarm/psk/1.0.0/\n/base16/\n{}", "ab".repeat(32));
/// let key = kindred_routing::transport::parse_swarm_key(&text)?;
/// assert_eq!(key.to_string().trim_end(), text);
/// # Ok::<(), kindred_routing::transport::SwarmKeyError>(())
/// ```
pub fn parse_swarm_key(text: &str) -> Result<PreSharedKey, SwarmKeyError> {
    Ok(text.trim().parse()?)
}

/// Build the authenticated, multiplexed transport for `keypair`: for [`TransportKind::Tcp`],
/// TCP, and QUIC when `swarm_key` is `None`, behind DNS resolution.
///
/// # Errors
/// [`TransportError::Noise`] when Noise cannot use the key.
pub fn build_transport(
    keypair: &Keypair,
    kind: TransportKind,
    swarm_key: Option<PreSharedKey>,
    handshake_timeout: Duration,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, TransportError> {
    let transport = match kind {
        TransportKind::Tcp => {
            let ip = ip_transport(keypair, swarm_key, handshake_timeout)?;
            match dns::tokio::Transport::system(ip) {
                Ok(resolving) => resolving.boxed(),
                Err(e) => {
                    // Without a resolver configuration the node still runs: it cannot dial
                    // addresses named by DNS, and says so once.
                    tracing::warn!(error = %e,
                        "no DNS resolver configuration: /dns addresses cannot be dialed");
                    ip_transport(keypair, swarm_key, handshake_timeout)?
                }
            }
        }
        TransportKind::Memory => with_pnet(MemoryTransport::default(), swarm_key)
            .upgrade(Version::V1Lazy)
            .authenticate(noise::Config::new(keypair)?)
            .multiplex(yamux::Config::default())
            .timeout(handshake_timeout)
            .boxed(),
    };
    Ok(transport)
}

/// Connections through relays: `relay`'s circuits, upgraded like TCP connections (pnet in a
/// private swarm, Noise, yamux) under `handshake_timeout`.
///
/// # Errors
/// [`TransportError::Noise`] when Noise cannot use the key.
pub fn relayed_transport(
    keypair: &Keypair,
    relay: relay::client::Transport,
    swarm_key: Option<PreSharedKey>,
    handshake_timeout: Duration,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, TransportError> {
    Ok(with_pnet(relay, swarm_key)
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair)?)
        .multiplex(yamux::Config::default())
        .timeout(handshake_timeout)
        .boxed())
}

/// TCP (with pnet in a private swarm), and QUIC beside it in a public one.
fn ip_transport(
    keypair: &Keypair,
    swarm_key: Option<PreSharedKey>,
    handshake_timeout: Duration,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, TransportError> {
    let private = swarm_key.is_some();
    let tcp = tcp::tokio::Transport::new(tcp::Config::new().nodelay(true));
    let tcp = with_pnet(tcp, swarm_key)
        .upgrade(Version::V1Lazy)
        .authenticate(noise::Config::new(keypair)?)
        .multiplex(yamux::Config::default())
        .timeout(handshake_timeout);
    if private {
        return Ok(tcp.boxed());
    }
    let mut config = quic::Config::new(keypair);
    config.handshake_timeout = handshake_timeout;
    Ok(quic::tokio::Transport::new(config)
        .or_transport(tcp)
        .map(|either, _| match either {
            Either::Left((peer, quic)) => (peer, StreamMuxerBox::new(quic)),
            Either::Right((peer, muxer)) => (peer, StreamMuxerBox::new(muxer)),
        })
        .boxed())
}

/// Put the pnet handshake in front of `base` when a swarm key is given.
fn with_pnet<T>(
    base: T,
    swarm_key: Option<PreSharedKey>,
) -> impl Transport<
    Output = impl futures::AsyncRead + futures::AsyncWrite + Unpin + Send + 'static,
    Error = impl std::error::Error + Send + Sync + 'static,
    ListenerUpgrade = impl Send + 'static,
    Dial = impl Send + 'static,
> + Send
+ Unpin
+ 'static
where
    T: Transport + Send + Unpin + 'static,
    T::Output: futures::AsyncRead + futures::AsyncWrite + Unpin + Send + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    base.and_then(move |socket, _| async move {
        match swarm_key {
            Some(key) => PnetConfig::new(key)
                .handshake(socket)
                .await
                .map(Either::Left),
            None => Ok(Either::Right(socket)),
        }
    })
}
