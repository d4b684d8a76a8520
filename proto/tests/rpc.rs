//! The RPC messages: round trips over their whole input space, and every rejection path a
//! hostile peer can reach.
#![allow(clippy::unwrap_used)]

mod common;

use kindred_proto::rpc::*;
use kindred_proto::{MAX_BODY_BYTES, MAX_HEADER_BYTES, PacketId, decode_header};
use proptest::prelude::*;

fn arb_query() -> impl Strategy<Value = HeaderQuery> {
    prop_oneof![
        prop::collection::vec(any::<[u8; 32]>(), 1..=MAX_QUERY_ITEMS).prop_map(HeaderQuery::Keys),
        prop::collection::vec(any::<[u8; 32]>().prop_map(PacketId), 1..=40)
            .prop_map(HeaderQuery::Ids),
        Just(HeaderQuery::Latest),
    ]
}

fn arb_request() -> impl Strategy<Value = RpcRequest> {
    prop_oneof![
        (any::<u64>(), arb_query()).prop_map(|(id, query)| RpcRequest::GetHeaders {
            id: RequestId(id),
            query
        }),
        (any::<u64>(), any::<[u8; 32]>()).prop_map(|(id, p)| RpcRequest::GetBody {
            id: RequestId(id),
            packet: PacketId(p)
        }),
        any::<u64>().prop_map(|id| RpcRequest::GetSnapshot { id: RequestId(id) }),
    ]
}

fn arb_response() -> impl Strategy<Value = RpcResponse> {
    prop_oneof![
        (
            any::<u64>(),
            prop::collection::vec(prop::collection::vec(any::<u8>(), 0..300), 0..12)
        )
            .prop_map(|(id, headers)| RpcResponse::Headers {
                id: RequestId(id),
                headers
            }),
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..2000)).prop_map(|(id, body)| {
            RpcResponse::Body {
                id: RequestId(id),
                body,
            }
        }),
        (
            any::<u64>(),
            prop::collection::vec(any::<u8>(), 0..300),
            prop::collection::vec(any::<u8>(), 0..2000)
        )
            .prop_map(|(id, header, body)| RpcResponse::Snapshot {
                id: RequestId(id),
                header,
                body,
            }),
        (any::<u64>(), prop::bool::ANY).prop_map(|(id, nf)| RpcResponse::Error {
            id: RequestId(id),
            code: if nf {
                RpcErrorCode::NotFound
            } else {
                RpcErrorCode::Refused
            },
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn requests_round_trip(request in arb_request()) {
        let bytes = request.encode().unwrap();
        prop_assert_eq!(bytes.len(), request.encoded_len());
        prop_assert!(bytes.len() <= MAX_REQUEST_BYTES);
        prop_assert_eq!(RpcRequest::decode(&bytes).unwrap(), request);
    }

    #[test]
    fn responses_round_trip(response in arb_response()) {
        let bytes = response.encode().unwrap();
        prop_assert_eq!(bytes.len(), response.encoded_len());
        prop_assert_eq!(RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).unwrap(), response);
    }

    #[test]
    fn every_strict_prefix_is_rejected(request in arb_request(), response in arb_response(), cut in any::<prop::sample::Index>()) {
        let bytes = request.encode().unwrap();
        let n = cut.index(bytes.len());
        prop_assert!(RpcRequest::decode(&bytes[..n]).is_err());
        let bytes = response.encode().unwrap();
        let n = cut.index(bytes.len());
        prop_assert!(RpcResponse::decode(&bytes[..n], MAX_RESPONSE_BYTES).is_err());
    }

    #[test]
    fn trailing_bytes_are_rejected(request in arb_request(), response in arb_response(), extra in 1usize..8) {
        let mut bytes = request.encode().unwrap();
        bytes.extend(std::iter::repeat_n(0u8, extra));
        prop_assert_eq!(RpcRequest::decode(&bytes), Err(RpcDecodeError::TrailingBytes { extra }));
        let mut bytes = response.encode().unwrap();
        bytes.extend(std::iter::repeat_n(0u8, extra));
        prop_assert_eq!(
            RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
            Err(RpcDecodeError::TrailingBytes { extra })
        );
    }

    /// Arbitrary bytes: never a panic, and whatever is accepted is stable under re-encoding.
    #[test]
    fn arbitrary_bytes_decode_or_fail_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(request) = RpcRequest::decode(&bytes) {
            let again = request.encode().unwrap();
            prop_assert_eq!(RpcRequest::decode(&again).unwrap(), request);
        }
        if let Ok(response) = RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES) {
            let again = response.encode().unwrap();
            prop_assert_eq!(RpcResponse::decode(&again, MAX_RESPONSE_BYTES).unwrap(), response);
        }
    }
}

/// Hand-built prefix: enum tag, then a varint.
fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

#[test]
fn oversize_request_is_rejected_before_parsing() {
    let bytes = vec![0u8; MAX_REQUEST_BYTES + 1];
    assert!(matches!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::Oversize {
            what: "request",
            ..
        })
    ));
}

#[test]
fn key_list_limits() {
    // Tag 0 (by keys), id 1, then a packed list of MAX + 1 keys.
    let mut bytes = vec![0u8, 1];
    let len = (MAX_QUERY_ITEMS + 1) * 32;
    varint(len as u64, &mut bytes);
    bytes.resize(bytes.len() + len, 7);
    assert_eq!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::Oversize {
            what: "query",
            len: (MAX_QUERY_ITEMS + 1) as u64,
            max: MAX_QUERY_ITEMS as u64
        })
    );
    // A ragged list.
    let mut bytes = vec![1u8, 1];
    varint(33, &mut bytes);
    bytes.resize(bytes.len() + 33, 7);
    assert!(matches!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::Malformed { .. })
    ));
    // An empty list.
    assert!(matches!(
        RpcRequest::decode(&[0, 1, 0]),
        Err(RpcDecodeError::Malformed {
            detail: "empty query"
        })
    ));
    // A list that claims more bytes than are present.
    assert_eq!(
        RpcRequest::decode(&[0, 1, 0x80, 0x02, 1, 2, 3]),
        Err(RpcDecodeError::Truncated)
    );
}

#[test]
fn unknown_tags_are_malformed() {
    assert!(matches!(
        RpcRequest::decode(&[5, 0]),
        Err(RpcDecodeError::Malformed { .. })
    ));
    assert!(matches!(
        RpcResponse::decode(&[4, 0], MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Malformed { .. })
    ));
    // Error response with an unknown code.
    assert!(matches!(
        RpcResponse::decode(&[2, 0, 9], MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Malformed { .. })
    ));
}

#[test]
fn snapshot_limits() {
    // A snapshot header over the header limit: rejected before it is copied.
    let mut bytes = vec![3u8, 5];
    varint((MAX_HEADER_BYTES + 1) as u64, &mut bytes);
    bytes.resize(bytes.len() + MAX_HEADER_BYTES + 1, 0);
    bytes.push(0);
    assert!(matches!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Oversize { what: "header", .. })
    ));
    // A claimed body longer than the bytes present is truncated, not allocated.
    let mut bytes = vec![3u8, 5, 1, 0];
    varint(MAX_BODY_BYTES as u64, &mut bytes);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Truncated)
    );
    // A snapshot answer is larger than a body request allows once its body is the largest.
    let request = RpcRequest::GetSnapshot { id: RequestId(2) };
    assert_eq!(request.response_limit(), MAX_SNAPSHOT_RESPONSE_BYTES);
    assert_eq!(request.kind().label(), "snapshot");
    let too_big = RpcResponse::Snapshot {
        id: RequestId(2),
        header: vec![0; 10],
        body: vec![0; MAX_BODY_BYTES + 1],
    };
    assert!(matches!(
        too_big.encode(),
        Err(RpcEncodeError::Oversize { what: "body", .. })
    ));
}

#[test]
fn header_list_limits() {
    // More headers than allowed: rejected on the count alone.
    let mut bytes = vec![0u8, 5];
    varint((MAX_HEADERS_PER_RESPONSE + 1) as u64, &mut bytes);
    assert!(matches!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Oversize {
            what: "header list",
            ..
        })
    ));
    // A count the remaining bytes cannot hold: rejected before the list is allocated.
    let mut bytes = vec![0u8, 5];
    varint(MAX_HEADERS_PER_RESPONSE as u64, &mut bytes);
    bytes.push(0);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Truncated)
    );
    // One header over the header limit.
    let mut bytes = vec![0u8, 5, 1];
    varint((MAX_HEADER_BYTES + 1) as u64, &mut bytes);
    bytes.resize(bytes.len() + MAX_HEADER_BYTES + 1, 0);
    assert!(matches!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Oversize { what: "header", .. })
    ));
}

#[test]
fn responses_over_the_callers_limit_are_rejected() {
    let response = RpcResponse::Body {
        id: RequestId(1),
        body: vec![0; 5000],
    };
    let bytes = response.encode().unwrap();
    let headers_request = RpcRequest::GetHeaders {
        id: RequestId(1),
        query: HeaderQuery::Keys(vec![[0; 32]]),
    };
    assert!(RpcResponse::decode(&bytes, 4000).is_err());
    assert!(RpcResponse::decode(&bytes, headers_request.response_limit()).is_ok());
    // A body response larger than any headers response is refused for a headers request.
    let big = RpcResponse::Body {
        id: RequestId(1),
        body: vec![0; MAX_HEADERS_RESPONSE_BYTES],
    }
    .encode()
    .unwrap();
    assert!(matches!(
        RpcResponse::decode(&big, headers_request.response_limit()),
        Err(RpcDecodeError::Oversize {
            what: "response",
            ..
        })
    ));
}

#[test]
fn encoders_refuse_what_receivers_reject() {
    let empty = RpcRequest::GetHeaders {
        id: RequestId(0),
        query: HeaderQuery::Ids(vec![]),
    };
    assert_eq!(empty.encode(), Err(RpcEncodeError::EmptyQuery));
    let long = RpcRequest::GetHeaders {
        id: RequestId(0),
        query: HeaderQuery::Keys(vec![[0; 32]; MAX_QUERY_ITEMS + 1]),
    };
    assert!(matches!(
        long.encode(),
        Err(RpcEncodeError::Oversize { .. })
    ));
    let many = RpcResponse::Headers {
        id: RequestId(0),
        headers: vec![vec![1]; MAX_HEADERS_PER_RESPONSE + 1],
    };
    assert!(matches!(
        many.encode(),
        Err(RpcEncodeError::Oversize { .. })
    ));
    let fat = RpcResponse::Headers {
        id: RequestId(0),
        headers: vec![vec![1; MAX_HEADER_BYTES + 1]],
    };
    assert!(matches!(fat.encode(), Err(RpcEncodeError::Oversize { .. })));
    let huge = RpcResponse::Body {
        id: RequestId(0),
        body: vec![0; MAX_BODY_BYTES + 1],
    };
    assert!(matches!(
        huge.encode(),
        Err(RpcEncodeError::Oversize { .. })
    ));
}

#[test]
fn sealed_headers_survive_the_trip() {
    let packet = common::sealed();
    let response = RpcResponse::Headers {
        id: RequestId(99),
        headers: vec![packet.header_bytes.clone()],
    };
    let bytes = response.encode().unwrap();
    let RpcResponse::Headers { id, headers } =
        RpcResponse::decode(&bytes, MAX_HEADERS_RESPONSE_BYTES).unwrap()
    else {
        panic!("wrong variant");
    };
    assert_eq!(id, RequestId(99));
    let header = decode_header(&headers[0]).unwrap();
    assert_eq!(header.id(), packet.id());
}

#[test]
fn a_latest_query_is_two_bytes_and_leaves_older_encodings_alone() {
    let latest = RpcRequest::GetHeaders {
        id: RequestId(5),
        query: HeaderQuery::Latest,
    };
    let bytes = latest.encode().unwrap();
    // Variant 3 (appended after the key, id and body requests), then the id.
    assert_eq!(bytes, vec![3, 5]);
    assert_eq!(bytes.len(), latest.encoded_len());
    assert_eq!(RpcRequest::decode(&bytes).unwrap(), latest);
    assert!(!HeaderQuery::Latest.is_empty());
    // The key query still encodes as variant 0.
    let keys = RpcRequest::GetHeaders {
        id: RequestId(5),
        query: HeaderQuery::Keys(vec![[9; 32]]),
    };
    assert_eq!(keys.encode().unwrap()[0], 0);
    // Trailing bytes after a latest query are refused.
    assert!(RpcRequest::decode(&[3, 5, 0]).is_err());
}
