//! The transport stack: TCP (or in-memory) → optional pnet → Noise → yamux, under one deadline.
//!
//! A private swarm is a pre-shared key: with one, every connection starts with the libp2p pnet
//! handshake (XSalsa20 keyed by the swarm key), and a peer without the same key produces only
//! noise that the Noise handshake rejects. The whole upgrade (pnet, multistream-select, Noise,
//! yamux) runs under `handshake_timeout`, so a wrong key or a silent peer fails in seconds rather
//! than holding a connection slot. pnet wraps a byte stream, so a private swarm never listens on
//! QUIC (which has its own encryption); Kindred's transport is TCP only.

use std::time::Duration;

use futures::future::Either;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Boxed, MemoryTransport};
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::pnet::{PnetConfig, PreSharedKey};
use libp2p::{PeerId, Transport, noise, tcp, yamux};

use crate::config::TransportKind;

/// Why the transport could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The identity key cannot be used for Noise.
    #[error("noise configuration failed: {0}")]
    Noise(#[from] noise::Error),
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

/// Build the authenticated, multiplexed transport for `keypair`.
///
/// # Errors
/// [`TransportError::Noise`] when Noise cannot use the key.
pub fn build_transport(
    keypair: &Keypair,
    kind: TransportKind,
    swarm_key: Option<PreSharedKey>,
    handshake_timeout: Duration,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, TransportError> {
    let noise = noise::Config::new(keypair)?;
    let yamux = yamux::Config::default();
    let transport = match kind {
        TransportKind::Tcp => {
            let tcp = tcp::tokio::Transport::new(tcp::Config::new().nodelay(true));
            with_pnet(tcp, swarm_key)
                .upgrade(Version::V1Lazy)
                .authenticate(noise)
                .multiplex(yamux)
                .timeout(handshake_timeout)
                .boxed()
        }
        TransportKind::Memory => with_pnet(MemoryTransport::default(), swarm_key)
            .upgrade(Version::V1Lazy)
            .authenticate(noise)
            .multiplex(yamux)
            .timeout(handshake_timeout)
            .boxed(),
    };
    Ok(transport)
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
