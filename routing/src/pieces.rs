//! Bodies too large for one message, moved in pieces.
//!
//! A model snapshot is the whole model, and a hub's merge of a large model outgrows a message
//! too (64 MiB, [`kindred_proto::MAX_BODY_BYTES`]). Such a body is answered with its signed
//! header alone; the receiver then asks for the body a piece at a time by its blake3 hash
//! ([`RpcRequest::GetChunk`], [`crate::CoreConfig::chunk_bytes`] each). Two halves live here:
//! - `Download`, the receiver's side: the body so far, the next piece to ask for, every piece
//!   exactly as long as asked, and [`CHUNK_RETRIES`] requests in a row that may fail (a timeout,
//!   a dropped connection) before the fetch gives up: a failed piece is asked for again from
//!   where the body stopped, so the fetch resumes instead of starting over. The whole body is
//!   checked against the header's length and hash by the caller's decoder before anything
//!   reads it; pieces are not checked one by one (a peer that lies wastes one fetch, and is
//!   then penalised like any other invalid answer).
//! - `ServedBodies`, the sender's side for bodies that are not the store's snapshot (a hub's
//!   large merges, a member's large push, which its hub pulls): each body by its hash, served
//!   only to the peers it was answered to, for [`SERVED_BODY_TTL`], at most four bodies at once
//!   (the oldest goes first).
//!
//! The snapshot fetch, the merge fetch and the hub's pull of a push share the rest: when a
//! body leaves in pieces, how the next piece is asked for, and what a failed request comes to
//! (a protocol breach penalised, a piece asked for again, or the transfer given up).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kindred_proto::rpc::{RequestId, RpcErrorCode, RpcKind, RpcRequest};
use kindred_proto::{MAX_BODY_BYTES, MAX_CHUNK_BYTES};
use libp2p::PeerId;

use crate::core::{Output, RequestFailure, RoutingCore};
use crate::scoring::Severity;

/// Pieces of a large body asked for again in a row, at most, before its fetch fails.
pub const CHUNK_RETRIES: u32 = 3;

/// How long a peer answered with a large merge's header may fetch its pieces.
pub const SERVED_BODY_TTL: Duration = Duration::from_secs(120);

/// The length of the next piece: `chunk` bytes (within 1..=[`MAX_CHUNK_BYTES`]) or what is left.
fn piece_len(chunk: usize, left: usize) -> usize {
    chunk.clamp(1, MAX_CHUNK_BYTES).min(left)
}

/// A large body being fetched in pieces, after its signed header came.
#[derive(Debug)]
pub(crate) struct Download {
    /// The signed header (checked when it came; decoded again with the whole body).
    header: Vec<u8>,
    body_hash: [u8; 32],
    body_len: usize,
    /// The body so far: every piece asked for, in order.
    body: Vec<u8>,
    /// Failed requests in a row left before the fetch fails.
    retries_left: u32,
}

impl Download {
    /// A fetch of the `body_len`-byte body hashing to `body_hash` that `header` announced.
    /// `body_len` comes from a header verified under its domain, so it is at most
    /// [`kindred_proto::MAX_PIECED_BODY_BYTES`]: reserved once, filled as the pieces come.
    pub(crate) fn new(header: Vec<u8>, body_hash: [u8; 32], body_len: usize) -> Self {
        Self {
            header,
            body_hash,
            body_len,
            body: Vec::with_capacity(body_len),
            retries_left: CHUNK_RETRIES,
        }
    }

    /// The request for the next piece: `chunk` bytes from where the body stopped.
    pub(crate) fn request(&self, id: RequestId, chunk: usize) -> RpcRequest {
        RpcRequest::GetChunk {
            id,
            body_hash: self.body_hash,
            offset: self.body.len() as u64,
            // At most MAX_CHUNK_BYTES, so it fits.
            len: piece_len(chunk, self.left()) as u32,
        }
    }

    fn left(&self) -> usize {
        self.body_len.saturating_sub(self.body.len())
    }

    /// A piece came for [`Download::request`] of `chunk` bytes: whether the body is now whole.
    ///
    /// # Errors
    /// `"chunk_length"` when the piece is not exactly as long as asked (the peer's fault).
    pub(crate) fn piece(&mut self, bytes: &[u8], chunk: usize) -> Result<bool, &'static str> {
        if bytes.len() != piece_len(chunk, self.left()) {
            return Err("chunk_length");
        }
        self.body.extend_from_slice(bytes);
        self.retries_left = CHUNK_RETRIES;
        Ok(self.left() == 0)
    }

    /// A request for a piece failed (not the peer's fault): whether to ask for it again.
    pub(crate) fn retry(&mut self) -> bool {
        let again = self.retries_left > 0;
        self.retries_left = self.retries_left.saturating_sub(1);
        again
    }

    /// Bytes received and the body's length.
    pub(crate) fn progress(&self) -> (usize, usize) {
        (self.body.len(), self.body_len)
    }

    /// The header and the whole body.
    pub(crate) fn into_parts(self) -> (Vec<u8>, Vec<u8>) {
        (self.header, self.body)
    }
}

/// A body served in pieces.
#[derive(Debug)]
struct Served {
    body: Arc<Vec<u8>>,
    peers: HashSet<PeerId>,
    at: Instant,
}

/// Large bodies this node serves in pieces besides its snapshot (a hub's merges, a member's
/// push), by hash.
#[derive(Debug, Default)]
pub(crate) struct ServedBodies {
    bodies: HashMap<[u8; 32], Served>,
}

impl ServedBodies {
    /// Most bodies served at once: a hub serves one merge a round (members may fetch the last
    /// round's while the next is made) and pushes one packet. Past it the oldest goes.
    pub(crate) const CAPACITY: usize = 4;

    /// Serve `body` (hashing to `hash`) to `peer` from `now`.
    pub(crate) fn offer(&mut self, peer: PeerId, hash: [u8; 32], body: Vec<u8>, now: Instant) {
        self.bodies
            .retain(|_, s| now.saturating_duration_since(s.at) < SERVED_BODY_TTL);
        if let Some(s) = self.bodies.get_mut(&hash) {
            s.peers.insert(peer);
            s.at = now;
            return;
        }
        if self.bodies.len() >= Self::CAPACITY
            && let Some(oldest) = self
                .bodies
                .iter()
                .min_by_key(|(_, s)| s.at)
                .map(|(h, _)| *h)
        {
            self.bodies.remove(&oldest);
        }
        self.bodies.insert(
            hash,
            Served {
                body: Arc::new(body),
                peers: HashSet::from([peer]),
                at: now,
            },
        );
    }

    /// The piece `peer` asks for, if the body hashing to `hash` is served here: `None` when it
    /// is not (another source may hold it), `Some(Err(Refused))` when it is but not to `peer`,
    /// `Some(Err(NotFound))` past its end.
    pub(crate) fn piece(
        &self,
        peer: &PeerId,
        hash: &[u8; 32],
        offset: u64,
        len: u32,
        now: Instant,
    ) -> Option<Result<Vec<u8>, RpcErrorCode>> {
        let s = self
            .bodies
            .get(hash)
            .filter(|s| now.saturating_duration_since(s.at) < SERVED_BODY_TTL)?;
        if !s.peers.contains(peer) {
            return Some(Err(RpcErrorCode::Refused));
        }
        Some(slice(&s.body, offset, len).ok_or(RpcErrorCode::NotFound))
    }
}

/// What one response did to a transfer whose body may come in pieces.
pub(crate) enum Step<T> {
    /// The transfer ends with this.
    Done(T),
    /// Ask for the next piece (or the same one again).
    Next,
}

/// What a failed request of a transfer comes to ([`RoutingCore::transfer_failed`]).
pub(crate) enum Failed {
    /// The answer broke the protocol: the peer is penalised and the transfer fails.
    Invalid(&'static str),
    /// A piece did not come: ask for it again, from where the body stopped.
    Retry,
    /// No answer (not the peer's fault) and no retry left: the transfer fails.
    GaveUp(&'static str),
}

impl RoutingCore {
    /// Whether a body of `len` bytes leaves in pieces rather than in its message
    /// ([`crate::CoreConfig::inline_body_bytes`], at most one message's).
    pub(crate) fn in_pieces(&self, len: usize) -> bool {
        len > self.config.inline_body_bytes.min(MAX_BODY_BYTES)
    }

    /// Ask `peer` for `download`'s next piece: the request's id, under which the caller files
    /// its transfer until the answer comes.
    pub(crate) fn ask_piece(&mut self, peer: PeerId, download: &Download) -> RequestId {
        let request = download.request(RequestId(self.next_id()), self.config.chunk_bytes);
        let id = request.id();
        self.metrics
            .request_sent(&peer, RpcKind::Chunk, request.encoded_len());
        self.outputs
            .push_back(Output::SendRequest { peer, request });
        id
    }

    /// A request of a transfer (its first, or a piece's, then with its `download`) failed.
    pub(crate) fn transfer_failed(
        &mut self,
        peer: PeerId,
        kind: RpcKind,
        failure: &RequestFailure,
        download: Option<&mut Download>,
        now: Instant,
    ) -> Failed {
        if let RequestFailure::Protocol(reason) = *failure {
            self.metrics.request_failed(kind, reason);
            self.reject(&peer, reason, Some(Severity::Major), now);
            return Failed::Invalid(reason);
        }
        self.count_failure(kind, failure);
        if let Some(d) = download
            && d.retry()
        {
            let (at, of) = d.progress();
            tracing::debug!(%peer, at, of, failure = failure.label(), "piece asked for again");
            return Failed::Retry;
        }
        Failed::GaveUp(failure.label())
    }
}

/// `len` bytes of `body` from `offset` (fewer at its end); `None` at or past the end.
pub(crate) fn slice(body: &[u8], offset: u64, len: u32) -> Option<Vec<u8>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.saturating_add(len as usize).min(body.len());
    (start < end)
        .then(|| body.get(start..end).map(<[u8]>::to_vec))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_download_takes_exact_pieces_and_retries_a_bounded_number_in_a_row() {
        let mut d = Download::new(vec![1], [7; 32], 10);
        let ask = |d: &Download| match d.request(RequestId(1), 4) {
            RpcRequest::GetChunk { offset, len, .. } => (offset, len),
            other => panic!("{other:?}"),
        };
        assert_eq!(ask(&d), (0, 4));
        assert_eq!(d.piece(&[0; 3], 4), Err("chunk_length"));
        assert_eq!(d.piece(&[0; 4], 4), Ok(false));
        for _ in 0..CHUNK_RETRIES {
            assert!(d.retry());
        }
        assert!(!d.retry());
        // A piece that comes resets the count.
        assert_eq!(d.piece(&[1; 4], 4), Ok(false));
        assert!(d.retry());
        assert_eq!(ask(&d), (8, 2));
        assert_eq!(d.piece(&[2; 2], 4), Ok(true));
        assert_eq!(d.progress(), (10, 10));
        let (header, body) = d.into_parts();
        assert_eq!((header, body.len()), (vec![1], 10));
    }

    #[test]
    fn a_served_body_goes_only_to_its_peers_while_it_lasts() {
        let (a, b) = (PeerId::random(), PeerId::random());
        let t0 = Instant::now();
        let mut served = ServedBodies::default();
        served.offer(a, [1; 32], (0..10).collect(), t0);
        assert_eq!(served.piece(&a, &[1; 32], 8, 4, t0), Some(Ok(vec![8, 9])));
        assert_eq!(
            served.piece(&b, &[1; 32], 0, 4, t0),
            Some(Err(RpcErrorCode::Refused))
        );
        assert_eq!(
            served.piece(&a, &[1; 32], 10, 4, t0),
            Some(Err(RpcErrorCode::NotFound))
        );
        assert_eq!(served.piece(&a, &[2; 32], 0, 4, t0), None);
        // The same body answered to another peer is kept once.
        served.offer(b, [1; 32], (0..10).collect(), t0);
        assert_eq!(served.piece(&b, &[1; 32], 0, 2, t0), Some(Ok(vec![0, 1])));
        assert_eq!(served.piece(&a, &[1; 32], 0, 2, t0 + SERVED_BODY_TTL), None);
        // At capacity the oldest goes.
        for i in 0..ServedBodies::CAPACITY as u8 {
            let at = t0 + Duration::from_secs(1 + u64::from(i));
            served.offer(a, [10 + i; 32], vec![i], at);
        }
        let late = t0 + Duration::from_secs(10);
        assert_eq!(served.piece(&a, &[1; 32], 0, 1, late), None);
        assert_eq!(served.piece(&a, &[10; 32], 0, 1, late), Some(Ok(vec![0])));
    }
}
