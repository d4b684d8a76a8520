//! Arbitrary bytes into the RPC decoders: they must return, never panic, never allocate past the
//! limits (run with `-rss_limit_mb`/`-malloc_limit_mb`), and whatever they accept must survive
//! re-encoding unchanged. The first byte picks the response limit (headers-, body- or
//! snapshot-sized), as a requester does from the request it sent.
#![no_main]

use kindred_proto::rpc::{
    MAX_BODY_RESPONSE_BYTES, MAX_HEADERS_RESPONSE_BYTES, MAX_QUERY_ITEMS, MAX_REQUEST_BYTES,
    MAX_SNAPSHOT_RESPONSE_BYTES, RpcRequest, RpcResponse,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, bytes)) = data.split_first() else {
        return;
    };
    if let Ok(request) = RpcRequest::decode(bytes) {
        assert!(bytes.len() <= MAX_REQUEST_BYTES);
        if let RpcRequest::GetHeaders { query, .. } = &request {
            assert!(!query.is_empty() && query.len() <= MAX_QUERY_ITEMS);
        }
        let again = request
            .encode()
            .unwrap_or_else(|e| panic!("accepted but not encodable: {e}"));
        assert_eq!(again.len(), request.encoded_len());
        assert_eq!(RpcRequest::decode(&again).ok(), Some(request));
    }
    let limit = match selector % 3 {
        0 => MAX_HEADERS_RESPONSE_BYTES,
        1 => MAX_BODY_RESPONSE_BYTES,
        _ => MAX_SNAPSHOT_RESPONSE_BYTES,
    };
    if let Ok(response) = RpcResponse::decode(bytes, limit) {
        assert!(bytes.len() <= limit);
        let again = response
            .encode()
            .unwrap_or_else(|e| panic!("accepted but not encodable: {e}"));
        assert_eq!(again.len(), response.encoded_len());
        assert_eq!(RpcResponse::decode(&again, limit).ok(), Some(response));
    }
});
