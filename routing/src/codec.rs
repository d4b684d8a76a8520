//! The request-response codec for `/kindred/rpc/1.0.0`: length-prefixed postcard frames.
//!
//! Each stream carries one request and its response, each as `u32 big-endian length ‖ bytes`.
//! The length is compared with the limit *before* anything is read or allocated: requests may be
//! at most [`MAX_REQUEST_BYTES`] (a push, which carries a packet body, up to
//! [`MAX_PUSH_REQUEST_BYTES`], once its first byte shows it is one), and a response at most the limit of the request that caused it
//! (a headers response is small, a body response may be large). The codec instance that writes a
//! request is the one that reads its response (libp2p clones it per outbound stream), so it
//! remembers which limit applies.
//!
//! A *response* that fails to decode surfaces as an `io::Error` of kind `InvalidData` wrapping a
//! typed [`CodecError`]; [`CodecError::from_io`] recovers it from the outbound failure so the
//! driver can score the peer by the exact reason.
//!
//! A *request* that fails to decode cannot go the same way: libp2p-request-response reports a
//! failed `read_request` to nobody (the handler drops the stream and the behaviour only logs an
//! "unknown request id" at debug level), so a peer could send garbage or a 4 GiB length prefix
//! forever without being scored. [`RpcCodec::read_request`] therefore *succeeds* on a complete
//! but invalid request and yields [`WireRequest::Invalid`]: the driver receives it as an ordinary
//! inbound request, penalises the peer (reject label `bad_request`) and drops the response
//! channel, so nothing is answered and the stream is closed. An oversize length prefix is judged
//! on the prefix alone: nothing past the four bytes is read or allocated. A stream that ends in
//! the middle of a frame, or fails in the transport, is still an `io::Error` and is not scored:
//! that can be the network's doing.

use std::io;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use kindred_proto::rpc::{
    MAX_PUSH_REQUEST_BYTES, MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, PUSH_TAG, RpcDecodeError,
    RpcEncodeError, RpcRequest, RpcResponse,
};
use libp2p::StreamProtocol;
use libp2p::request_response::Codec;

/// The protocol name.
pub const RPC_PROTOCOL: StreamProtocol = StreamProtocol::new("/kindred/rpc/1.0.0");

/// Why a frame could not be read or written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    /// The length prefix exceeds the limit; nothing was read past it.
    #[error("frame of {len} bytes is over the limit of {max}")]
    FrameTooLarge {
        /// Claimed length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The stream ended inside the frame.
    #[error("frame is truncated")]
    Truncated,
    /// The frame's bytes are not a valid message.
    #[error(transparent)]
    Decode(#[from] RpcDecodeError),
    /// The local message breaks a wire limit and was not sent.
    #[error(transparent)]
    Encode(#[from] RpcEncodeError),
}

impl CodecError {
    /// A short, stable label for metrics and scoring.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::FrameTooLarge { .. } => "rpc_oversize",
            Self::Truncated => "rpc_truncated",
            Self::Decode(e) => e.reason(),
            Self::Encode(_) => "rpc_encode",
        }
    }

    /// The codec error inside an `io::Error` produced by this codec, if it is one.
    pub fn from_io(err: &io::Error) -> Option<&Self> {
        err.get_ref().and_then(|e| e.downcast_ref::<Self>())
    }
}

impl From<CodecError> for io::Error {
    fn from(e: CodecError) -> Self {
        Self::new(io::ErrorKind::InvalidData, e)
    }
}

/// A request as read off the wire: what [`RpcCodec`] carries as its request type.
///
/// Outbound, only [`WireRequest::Valid`] is ever written (`From<RpcRequest>` builds it). Inbound,
/// [`WireRequest::Invalid`] stands for a complete frame that is not a request, or a length prefix
/// over [`MAX_REQUEST_BYTES`], so that the driver sees, scores and drops it (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireRequest {
    /// A request that decoded.
    Valid(RpcRequest),
    /// Bytes that are not a request, and why (`FrameTooLarge` or `Decode`).
    Invalid(CodecError),
}

impl From<RpcRequest> for WireRequest {
    fn from(request: RpcRequest) -> Self {
        Self::Valid(request)
    }
}

/// Why a frame could not be read: the peer's fault (a typed [`CodecError`]) or the stream's.
enum FrameError {
    Codec(CodecError),
    Io(io::Error),
}

impl From<FrameError> for io::Error {
    fn from(e: FrameError) -> Self {
        match e {
            FrameError::Codec(c) => c.into(),
            FrameError::Io(e) => e,
        }
    }
}

/// Length-prefixed postcard codec with per-kind response limits.
#[derive(Debug, Clone)]
pub struct RpcCodec {
    response_limit: usize,
    push_limit: usize,
}

impl Default for RpcCodec {
    fn default() -> Self {
        Self {
            response_limit: MAX_RESPONSE_BYTES,
            push_limit: MAX_PUSH_REQUEST_BYTES,
        }
    }
}

impl RpcCodec {
    /// A codec that reads pushes of at most `limit` bytes (capped at
    /// [`MAX_PUSH_REQUEST_BYTES`], and never below [`MAX_REQUEST_BYTES`]).
    pub fn with_push_limit(mut self, limit: usize) -> Self {
        self.push_limit = limit.clamp(MAX_REQUEST_BYTES, MAX_PUSH_REQUEST_BYTES);
        self
    }
}

async fn read_frame<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    max: usize,
) -> Result<Vec<u8>, FrameError> {
    let len = read_len(io).await?;
    if len > max {
        return Err(too_large(len, max));
    }
    read_body(io, len, Vec::new()).await
}

/// Reads a request frame: at most [`MAX_REQUEST_BYTES`], or `push_limit` (at most
/// [`MAX_PUSH_REQUEST_BYTES`]) for a frame whose first byte is a push's tag ([`PUSH_TAG`]; the one request that carries a packet
/// body). The tag is read before anything past it, so no other request can make this node read
/// more than the ordinary limit.
async fn read_request_frame<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    push_limit: usize,
) -> Result<Vec<u8>, FrameError> {
    let len = read_len(io).await?;
    if len <= MAX_REQUEST_BYTES {
        return read_body(io, len, Vec::new()).await;
    }
    if len > push_limit {
        return Err(too_large(len, push_limit));
    }
    let mut tag = [0u8; 1];
    io.read_exact(&mut tag).await.map_err(eof_is_truncated)?;
    if tag[0] != PUSH_TAG {
        return Err(too_large(len, MAX_REQUEST_BYTES));
    }
    read_body(io, len, tag.to_vec()).await
}

fn too_large(len: usize, max: usize) -> FrameError {
    FrameError::Codec(CodecError::FrameTooLarge {
        len: len as u64,
        max: max as u64,
    })
}

fn eof_is_truncated(e: io::Error) -> FrameError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        FrameError::Codec(CodecError::Truncated)
    } else {
        FrameError::Io(e)
    }
}

async fn read_len<T: AsyncRead + Unpin + Send>(io: &mut T) -> Result<usize, FrameError> {
    let mut prefix = [0u8; 4];
    io.read_exact(&mut prefix).await.map_err(eof_is_truncated)?;
    Ok(u32::from_be_bytes(prefix) as usize)
}

/// The rest of a frame of `len` bytes, `buf` holding those already read.
async fn read_body<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    len: usize,
    mut buf: Vec<u8>,
) -> Result<Vec<u8>, FrameError> {
    // Grow with the data actually received rather than trusting the prefix up front.
    buf.reserve(len.min(64 * 1024));
    let rest = len.saturating_sub(buf.len());
    io.take(rest as u64)
        .read_to_end(&mut buf)
        .await
        .map_err(FrameError::Io)?;
    if buf.len() != len {
        return Err(FrameError::Codec(CodecError::Truncated));
    }
    Ok(buf)
}

async fn write_frame<T: AsyncWrite + Unpin + Send>(io: &mut T, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len()).map_err(|_| CodecError::FrameTooLarge {
        len: bytes.len() as u64,
        max: u64::from(u32::MAX),
    })?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(bytes).await?;
    io.close().await
}

impl Codec for RpcCodec {
    type Protocol = StreamProtocol;
    type Request = WireRequest;
    type Response = RpcResponse;

    /// Reads one request. A complete frame that does not decode, or a length prefix over
    /// [`MAX_REQUEST_BYTES`] (nothing after it is read), is `Ok(WireRequest::Invalid)` so the
    /// driver can score the sender; a truncated frame or a transport error is an `io::Error`.
    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<WireRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        let bytes = match read_request_frame(io, self.push_limit).await {
            Ok(bytes) => bytes,
            Err(FrameError::Codec(e @ CodecError::FrameTooLarge { .. })) => {
                return Ok(WireRequest::Invalid(e));
            }
            Err(e) => return Err(e.into()),
        };
        Ok(match RpcRequest::decode(&bytes) {
            Ok(request) => WireRequest::Valid(request),
            Err(e) => WireRequest::Invalid(CodecError::Decode(e)),
        })
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<RpcResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        let limit = self.response_limit;
        let bytes = read_frame(io, limit).await.map_err(io::Error::from)?;
        RpcResponse::decode(&bytes, limit).map_err(|e| CodecError::Decode(e).into())
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        request: WireRequest,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        // An invalid request only ever comes off the wire; there is nothing to send for it.
        let request = match request {
            WireRequest::Valid(request) => request,
            WireRequest::Invalid(e) => return Err(io::Error::new(io::ErrorKind::InvalidInput, e)),
        };
        self.response_limit = request.response_limit();
        let bytes = request.encode().map_err(CodecError::Encode)?;
        write_frame(io, &bytes).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        response: RpcResponse,
    ) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        let bytes = response.encode().map_err(CodecError::Encode)?;
        write_frame(io, &bytes).await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use futures::executor::block_on;
    use futures::io::Cursor;
    use kindred_proto::rpc::{HeaderQuery, RequestId};

    fn framed(bytes: &[u8]) -> Vec<u8> {
        let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
        out.extend_from_slice(bytes);
        out
    }

    #[test]
    fn round_trip_and_limits() {
        block_on(async {
            let mut codec = RpcCodec::default();
            let request = RpcRequest::GetHeaders {
                id: RequestId(3),
                query: HeaderQuery::Keys(vec![[1; 32]]),
            };
            let mut out = Cursor::new(Vec::new());
            codec
                .write_request(&RPC_PROTOCOL, &mut out, request.clone().into())
                .await
                .unwrap();
            let mut input = Cursor::new(out.into_inner());
            assert_eq!(
                codec.read_request(&RPC_PROTOCOL, &mut input).await.unwrap(),
                WireRequest::Valid(request)
            );

            // After a headers request, a body-sized response is refused on its prefix alone.
            let claim = (kindred_proto::rpc::MAX_HEADERS_RESPONSE_BYTES as u32 + 1).to_be_bytes();
            let mut input = Cursor::new(claim.to_vec());
            let err = codec
                .read_response(&RPC_PROTOCOL, &mut input)
                .await
                .unwrap_err();
            assert_eq!(CodecError::from_io(&err).unwrap().reason(), "rpc_oversize");

            // Garbage and truncation are typed.
            let mut input = Cursor::new(framed(&[9, 9, 9]));
            let err = codec
                .read_response(&RPC_PROTOCOL, &mut input)
                .await
                .unwrap_err();
            assert_eq!(CodecError::from_io(&err).unwrap().reason(), "rpc_malformed");
            let mut short = framed(&[0, 1, 0]);
            short.truncate(5);
            let err = codec
                .read_response(&RPC_PROTOCOL, &mut Cursor::new(short))
                .await
                .unwrap_err();
            assert_eq!(CodecError::from_io(&err).unwrap(), &CodecError::Truncated);
            let err = codec
                .read_request(&RPC_PROTOCOL, &mut Cursor::new(vec![0, 0]))
                .await
                .unwrap_err();
            assert_eq!(CodecError::from_io(&err).unwrap(), &CodecError::Truncated);
        });
    }

    /// Invalid requests are values the driver sees, not errors libp2p swallows.
    #[test]
    fn invalid_requests_are_yielded_not_failed() {
        block_on(async {
            let mut codec = RpcCodec::default();
            let read = |bytes: Vec<u8>| {
                let mut codec = codec.clone();
                async move {
                    codec
                        .read_request(&RPC_PROTOCOL, &mut Cursor::new(bytes))
                        .await
                        .unwrap()
                }
            };
            // Not postcard.
            let WireRequest::Invalid(e) = read(framed(&[0xff; 40])).await else {
                panic!("garbage decoded as a request");
            };
            assert_eq!(e.reason(), "rpc_malformed");
            // A 4 GiB claim followed by a few bytes: refused on the prefix alone.
            let mut huge = u32::MAX.to_be_bytes().to_vec();
            huge.extend_from_slice(&[7; 16]);
            assert_eq!(
                read(huge).await,
                WireRequest::Invalid(CodecError::FrameTooLarge {
                    len: u64::from(u32::MAX),
                    max: MAX_PUSH_REQUEST_BYTES as u64,
                })
            );
            // Over the ordinary limit and not a push: refused on its first byte, nothing more
            // read.
            let mut just_over = ((MAX_REQUEST_BYTES + 1) as u32).to_be_bytes().to_vec();
            just_over.push(0);
            let WireRequest::Invalid(e) = read(just_over).await else {
                panic!("oversize request accepted");
            };
            assert_eq!(
                e,
                CodecError::FrameTooLarge {
                    len: (MAX_REQUEST_BYTES + 1) as u64,
                    max: MAX_REQUEST_BYTES as u64,
                }
            );
            // A push carries a body: it may be longer.
            let push = RpcRequest::Push {
                id: kindred_proto::RequestId(3),
                round: 9,
                header: vec![1; 100],
                body: vec![2; MAX_REQUEST_BYTES * 2],
                known: vec![vec![3; 38]],
            };
            let bytes = push.encode().unwrap();
            assert!(bytes.len() > MAX_REQUEST_BYTES);
            assert_eq!(read(framed(&bytes)).await, WireRequest::Valid(push));
            // Nothing invalid is ever written.
            let err = codec
                .write_request(
                    &RPC_PROTOCOL,
                    &mut Cursor::new(Vec::new()),
                    WireRequest::Invalid(CodecError::Truncated),
                )
                .await
                .unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        });
    }
}
