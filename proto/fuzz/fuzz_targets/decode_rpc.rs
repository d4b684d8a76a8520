//! Arbitrary bytes into the RPC decoders: they must return, never panic, never allocate past the
//! limits (run with `-rss_limit_mb`/`-malloc_limit_mb`), and whatever they accept must survive
//! re-encoding unchanged. The first byte picks the response limit (headers-, body-, snapshot-,
//! push-answer-, chunk- or merge-sized, the last being `MAX_RESPONSE_BYTES`), as a requester
//! does from the request it sent.
#![no_main]

use kindred_proto::MAX_CHUNK_BYTES;
use kindred_proto::rpc::{
    MAX_BODY_RESPONSE_BYTES, MAX_CHUNK_RESPONSE_BYTES, MAX_HEADERS_RESPONSE_BYTES, MAX_KNOWN_PEERS,
    MAX_PEER_ID_BYTES, MAX_PUSH_ANSWER_BYTES, MAX_PUSH_REQUEST_BYTES, MAX_QUERY_ITEMS,
    MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, MAX_SNAPSHOT_RESPONSE_BYTES, PushAnswer, RpcRequest,
    RpcResponse,
};
use libfuzzer_sys::fuzz_target;

/// A peer list as the decoder must leave it.
fn check_peers(peers: &[Vec<u8>]) {
    assert!(peers.len() <= MAX_KNOWN_PEERS);
    assert!(
        peers
            .iter()
            .all(|p| !p.is_empty() && p.len() <= MAX_PEER_ID_BYTES)
    );
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    if let Ok(request) = RpcRequest::decode(bytes) {
        match &request {
            RpcRequest::Push { known, .. } => {
                assert!(bytes.len() <= MAX_PUSH_REQUEST_BYTES);
                check_peers(known);
            }
            RpcRequest::GetHeaders { query, .. } => {
                assert!(bytes.len() <= MAX_REQUEST_BYTES);
                assert!(!query.is_empty() && query.len() <= MAX_QUERY_ITEMS);
            }
            RpcRequest::GetChunk { len, .. } => {
                assert!(bytes.len() <= MAX_REQUEST_BYTES);
                assert!((1..=MAX_CHUNK_BYTES).contains(&(*len as usize)));
            }
            _ => assert!(bytes.len() <= MAX_REQUEST_BYTES),
        }
        let again = request
            .encode()
            .unwrap_or_else(|e| panic!("accepted but not encodable: {e}"));
        assert_eq!(again.len(), request.encoded_len());
        assert_eq!(RpcRequest::decode(&again).ok(), Some(request));
    }
    let limit = match selector % 6 {
        0 => MAX_HEADERS_RESPONSE_BYTES,
        1 => MAX_BODY_RESPONSE_BYTES,
        2 => MAX_SNAPSHOT_RESPONSE_BYTES,
        3 => MAX_PUSH_ANSWER_BYTES,
        4 => MAX_CHUNK_RESPONSE_BYTES,
        _ => MAX_RESPONSE_BYTES,
    };
    if let Ok(response) = RpcResponse::decode(bytes, limit) {
        assert!(bytes.len() <= limit);
        match &response {
            RpcResponse::Merge { listed, cosine, .. }
            | RpcResponse::MergeHeader { listed, cosine, .. } => {
                check_peers(listed);
                assert!((-1.0..=1.0).contains(&cosine.to_f32()));
            }
            RpcResponse::PushAnswer {
                answer: PushAnswer::NotHub { hub },
                ..
            } => check_peers(std::slice::from_ref(hub)),
            RpcResponse::Chunk { bytes, .. } => assert!(bytes.len() <= MAX_CHUNK_BYTES),
            _ => {}
        }
        let again = response
            .encode()
            .unwrap_or_else(|e| panic!("accepted but not encodable: {e}"));
        assert_eq!(again.len(), response.encoded_len());
        assert_eq!(RpcResponse::decode(&again, limit).ok(), Some(response));
    }
});
