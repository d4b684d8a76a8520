//! Bytes on a node's connections, by protocol: Kademlia, the packet and exchange RPCs,
//! identify, ping, AutoNAT, relay and hole punching.
//!
//! # Why
//! "Fewer bytes than an all-reduce" is a claim about everything a node sends, so the node counts
//! every byte above the muxer. A total alone cannot say where the bytes go: control traffic
//! (Kademlia's walks and bootstraps, identify, ping) and the exchange are tuned by different
//! knobs. Each stream of a connection carries one protocol, named in its multistream-select
//! negotiation, which every stream starts with in clear (the encryption is below the muxer). So
//! [`count_bytes`] wraps each connection's muxer and each of its streams, reads the protocol
//! name from the stream's first bytes in either direction (the dialer's proposal: written by
//! the node on its outbound streams, read on inbound ones), and counts the stream's bytes under
//! it, those of the negotiation included. A stream whose first [`SNIFF_BYTES`] name no protocol of the
//! node's is counted as [`WireProtocol::Other`].
//!
//! ```
//! use kindred_routing::wire::{WireCounters, WireProtocol};
//!
//! let counters = WireCounters::default();
//! let totals = counters.snapshot();
//! assert_eq!(totals.total(), (0, 0));
//! assert_eq!(totals.get(WireProtocol::Kademlia), (0, 0));
//! ```

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};

use futures::{AsyncRead, AsyncWrite};
use libp2p::PeerId;
use libp2p::Transport;
use libp2p::core::muxing::{StreamMuxer, StreamMuxerBox, StreamMuxerEvent, SubstreamBox};
use libp2p::core::transport::Boxed;

use crate::behaviour::KAD_PROTOCOL;
use crate::codec::RPC_PROTOCOL;

/// Bytes of a stream's start searched for its protocol's name. A multistream-select header
/// and one proposal take about 40.
pub const SNIFF_BYTES: usize = 256;

/// The protocols a node's streams carry, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WireProtocol {
    /// Kademlia (`/kindred/kad/1.0.0`): walks, provider records, bootstraps.
    Kademlia,
    /// The packet and exchange RPCs (`/kindred/rpc/1.0.0`).
    Rpc,
    /// identify and identify push.
    Identify,
    /// ping.
    Ping,
    /// AutoNAT probes and dial-back answers (`/libp2p/autonat/1.0.0`).
    Autonat,
    /// Relay v2 reservations and circuits (hop and stop), the circuits' contents included.
    Relay,
    /// DCUtR hole-punch coordination.
    Dcutr,
    /// Anything else, and streams whose protocol was not seen.
    Other,
}

impl WireProtocol {
    /// Every protocol, in label order.
    pub const ALL: [Self; 8] = [
        Self::Kademlia,
        Self::Rpc,
        Self::Identify,
        Self::Ping,
        Self::Autonat,
        Self::Relay,
        Self::Dcutr,
        Self::Other,
    ];

    /// A stable label, for metrics and JSON.
    ///
    /// ```
    /// assert_eq!(kindred_routing::wire::WireProtocol::Kademlia.label(), "kademlia");
    /// ```
    pub fn label(self) -> &'static str {
        match self {
            Self::Kademlia => "kademlia",
            Self::Rpc => "rpc",
            Self::Identify => "identify",
            Self::Ping => "ping",
            Self::Autonat => "autonat",
            Self::Relay => "relay",
            Self::Dcutr => "dcutr",
            Self::Other => "other",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Kademlia => 0,
            Self::Rpc => 1,
            Self::Identify => 2,
            Self::Ping => 3,
            Self::Autonat => 4,
            Self::Relay => 5,
            Self::Dcutr => 6,
            Self::Other => 7,
        }
    }

    /// The protocol a multistream-select proposal names, if the node speaks it.
    fn of_name(name: &[u8]) -> Option<Self> {
        match name {
            n if n == KAD_PROTOCOL.as_ref().as_bytes() => Some(Self::Kademlia),
            n if n == RPC_PROTOCOL.as_ref().as_bytes() => Some(Self::Rpc),
            b"/ipfs/id/1.0.0" | b"/ipfs/id/push/1.0.0" => Some(Self::Identify),
            b"/ipfs/ping/1.0.0" => Some(Self::Ping),
            b"/libp2p/autonat/1.0.0" => Some(Self::Autonat),
            b"/libp2p/circuit/relay/0.2.0/hop" | b"/libp2p/circuit/relay/0.2.0/stop" => {
                Some(Self::Relay)
            }
            b"/libp2p/dcutr" => Some(Self::Dcutr),
            _ => None,
        }
    }
}

/// Byte counters by protocol and direction, shared by every connection of a transport wrapped
/// with [`count_bytes`].
#[derive(Debug, Default, Clone)]
pub struct WireCounters {
    counts: Arc<[[AtomicU64; 2]; WireProtocol::ALL.len()]>,
}

/// Bytes (received, sent) by protocol at one instant ([`WireCounters::snapshot`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WireBytes {
    counts: [(u64, u64); WireProtocol::ALL.len()],
}

impl WireBytes {
    /// Bytes received and sent under `protocol`.
    pub fn get(&self, protocol: WireProtocol) -> (u64, u64) {
        self.counts
            .get(protocol.index())
            .copied()
            .unwrap_or_default()
    }

    /// Bytes received and sent, every protocol together.
    pub fn total(&self) -> (u64, u64) {
        self.counts
            .iter()
            .fold((0, 0), |(i, o), (a, b)| (i + a, o + b))
    }

    /// (protocol, received, sent) for every protocol.
    pub fn by_protocol(&self) -> impl Iterator<Item = (WireProtocol, u64, u64)> + '_ {
        WireProtocol::ALL.into_iter().map(|p| {
            let (i, o) = self.get(p);
            (p, i, o)
        })
    }
}

impl WireCounters {
    /// The counts so far.
    pub fn snapshot(&self) -> WireBytes {
        let mut counts = [(0, 0); WireProtocol::ALL.len()];
        for (slot, [i, o]) in counts.iter_mut().zip(self.counts.iter()) {
            *slot = (i.load(Ordering::Relaxed), o.load(Ordering::Relaxed));
        }
        WireBytes { counts }
    }

    fn add(&self, protocol: WireProtocol, received: u64, sent: u64) {
        if let Some([i, o]) = self.counts.get(protocol.index()) {
            i.fetch_add(received, Ordering::Relaxed);
            o.fetch_add(sent, Ordering::Relaxed);
        }
    }
}

/// Count every byte `transport`'s connections carry, by protocol, into `counters`.
pub fn count_bytes(
    transport: Boxed<(PeerId, StreamMuxerBox)>,
    counters: WireCounters,
) -> Boxed<(PeerId, StreamMuxerBox)> {
    transport
        .map(move |(peer, muxer), _| {
            let counted = CountingMuxer {
                inner: muxer,
                counters: counters.clone(),
            };
            (peer, StreamMuxerBox::new(counted))
        })
        .boxed()
}

/// What a stream's first bytes say of its protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sniff {
    /// A proposal of a protocol the node speaks.
    Known(WireProtocol),
    /// Not yet: the bytes so far end inside a message, or named only the multistream header
    /// and protocols the node does not speak.
    More,
    /// Not a multistream-select negotiation.
    Unknown,
}

/// Reads the multistream-select messages (an unsigned-varint length, then that many bytes
/// ending in `\n`) at the start of `bytes`, for the first proposal of a protocol the node speaks.
fn sniff(bytes: &[u8]) -> Sniff {
    let mut rest = bytes;
    loop {
        let (len, after) = match varint(rest) {
            Varint::Value(len, after) => (len, after),
            Varint::Incomplete => return Sniff::More,
            Varint::TooLong => return Sniff::Unknown,
        };
        let Some(message) = after.get(..len) else {
            return Sniff::More;
        };
        let Some(name) = message.strip_suffix(b"\n") else {
            return Sniff::Unknown;
        };
        if let Some(p) = WireProtocol::of_name(name) {
            return Sniff::Known(p);
        }
        rest = after.get(len..).unwrap_or_default();
        if rest.is_empty() {
            return Sniff::More;
        }
    }
}

enum Varint<'a> {
    Value(usize, &'a [u8]),
    Incomplete,
    /// Longer than a multistream-select message's two bytes of length.
    TooLong,
}

/// An unsigned LEB128 varint of at most 2 bytes (multistream-select messages are shorter than
/// 16 KiB) and what follows it.
fn varint(bytes: &[u8]) -> Varint<'_> {
    let mut value = 0usize;
    for (i, &b) in bytes.iter().enumerate().take(2) {
        value |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Varint::Value(value, bytes.get(i + 1..).unwrap_or_default());
        }
    }
    if bytes.len() >= 2 {
        Varint::TooLong
    } else {
        Varint::Incomplete
    }
}

/// A connection's muxer whose streams are [`CountedStream`]s.
struct CountingMuxer {
    inner: StreamMuxerBox,
    counters: WireCounters,
}

impl CountingMuxer {
    fn wrap(&self, inner: SubstreamBox) -> SubstreamBox {
        SubstreamBox::new(CountedStream {
            inner,
            counters: self.counters.clone(),
            protocol: None,
            seen: Vec::new(),
            pending: (0, 0),
        })
    }
}

impl StreamMuxer for CountingMuxer {
    type Substream = SubstreamBox;
    type Error = io::Error;

    fn poll_inbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        let this = self.get_mut();
        let inner = ready!(Pin::new(&mut this.inner).poll_inbound(cx))?;
        Poll::Ready(Ok(this.wrap(inner)))
    }

    fn poll_outbound(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Self::Substream, Self::Error>> {
        let this = self.get_mut();
        let inner = ready!(Pin::new(&mut this.inner).poll_outbound(cx))?;
        Poll::Ready(Ok(this.wrap(inner)))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<StreamMuxerEvent, Self::Error>> {
        Pin::new(&mut self.get_mut().inner).poll(cx)
    }
}

/// A stream counted under its protocol once its first bytes name it; until then its bytes are
/// held in `pending` (received, sent). Vectored reads and writes keep the traits' defaults,
/// which go through `poll_read` / `poll_write`, so every byte is counted in one place.
struct CountedStream {
    inner: SubstreamBox,
    counters: WireCounters,
    protocol: Option<WireProtocol>,
    /// The stream's first bytes, either direction, in the order seen (at most [`SNIFF_BYTES`]).
    seen: Vec<u8>,
    pending: (u64, u64),
}

impl CountedStream {
    fn count(&mut self, data: &[u8], received: bool) {
        let n = data.len() as u64;
        if let Some(p) = self.protocol {
            let (i, o) = if received { (n, 0) } else { (0, n) };
            self.counters.add(p, i, o);
            return;
        }
        if received {
            self.pending.0 += n;
        } else {
            self.pending.1 += n;
        }
        let room = SNIFF_BYTES.saturating_sub(self.seen.len());
        self.seen
            .extend_from_slice(data.get(..room.min(data.len())).unwrap_or_default());
        let found = match sniff(&self.seen) {
            Sniff::Known(p) => Some(p),
            Sniff::Unknown => Some(WireProtocol::Other),
            Sniff::More if self.seen.len() >= SNIFF_BYTES => Some(WireProtocol::Other),
            Sniff::More => None,
        };
        if let Some(p) = found {
            self.protocol = Some(p);
            let (i, o) = std::mem::take(&mut self.pending);
            self.counters.add(p, i, o);
            self.seen = Vec::new();
        }
    }
}

impl Drop for CountedStream {
    fn drop(&mut self) {
        // A stream that ended before it named a protocol.
        let (i, o) = std::mem::take(&mut self.pending);
        if i + o > 0 {
            self.counters.add(WireProtocol::Other, i, o);
        }
    }
}

impl AsyncRead for CountedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.inner).poll_read(cx, buf))?;
        this.count(buf.get(..n).unwrap_or_default(), true);
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for CountedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        this.count(buf.get(..n).unwrap_or_default(), false);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_close(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A multistream-select message: varint length, then `text` and `\n`.
    fn message(text: &str) -> Vec<u8> {
        let len = text.len() + 1;
        assert!(len < 128);
        let mut out = vec![len as u8];
        out.extend_from_slice(text.as_bytes());
        out.push(b'\n');
        out
    }

    #[test]
    fn a_proposal_names_the_protocol_whatever_the_chunking() {
        let mut bytes = message("/multistream/1.0.0");
        bytes.extend(message("/kindred/kad/1.0.0"));
        bytes.extend_from_slice(&[8, 1, 2, 3]);
        for cut in 0..bytes.len() {
            let s = sniff(&bytes[..cut]);
            let whole = cut >= bytes.len() - 4;
            assert_eq!(
                s,
                if whole {
                    Sniff::Known(WireProtocol::Kademlia)
                } else {
                    Sniff::More
                },
                "cut at {cut}"
            );
        }
        let id = [message("/multistream/1.0.0"), message("/ipfs/id/1.0.0")].concat();
        assert_eq!(sniff(&id), Sniff::Known(WireProtocol::Identify));
    }

    #[test]
    fn a_rejected_proposal_is_passed_over_and_garbage_is_unknown() {
        let bytes = [
            message("/multistream/1.0.0"),
            message("/other/1.0.0"),
            message("/ipfs/ping/1.0.0"),
        ]
        .concat();
        assert_eq!(sniff(&bytes), Sniff::Known(WireProtocol::Ping));
        assert_eq!(sniff(b"\x05abcde"), Sniff::Unknown);
        assert_eq!(sniff(&[0xff, 0xff, 0xff]), Sniff::Unknown);
        assert_eq!(sniff(&[0x85]), Sniff::More);
    }

    #[test]
    fn counts_go_to_the_protocol_once_named_and_to_other_otherwise() {
        let counters = WireCounters::default();
        let (a, _b) = memory_streams();
        let mut stream = CountedStream {
            inner: a,
            counters: counters.clone(),
            protocol: None,
            seen: Vec::new(),
            pending: (0, 0),
        };
        let hello = [message("/multistream/1.0.0"), message("/kindred/rpc/1.0.0")].concat();
        stream.count(&hello[..5], false);
        assert_eq!(counters.snapshot().total(), (0, 0));
        stream.count(&hello[5..], false);
        stream.count(&[0u8; 100], true);
        let s = counters.snapshot();
        assert_eq!(s.get(WireProtocol::Rpc), (100, hello.len() as u64));
        drop(stream);
        let (c, _d) = memory_streams();
        let mut garbage = CountedStream {
            inner: c,
            counters: counters.clone(),
            protocol: None,
            seen: Vec::new(),
            pending: (0, 0),
        };
        garbage.count(&[1], true);
        drop(garbage);
        assert_eq!(counters.snapshot().get(WireProtocol::Other), (1, 0));
    }

    /// In-memory streams, as substreams.
    fn memory_streams() -> (SubstreamBox, SubstreamBox) {
        let stream = || SubstreamBox::new(futures::io::Cursor::new(Vec::<u8>::new()));
        (stream(), stream())
    }
}
