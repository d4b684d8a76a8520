//! The RPC messages: round trips over their whole input space, and every rejection path a
//! hostile peer can reach.
#![allow(clippy::unwrap_used)]

mod common;

use kindred_proto::rpc::*;
use kindred_proto::{MAX_BODY_BYTES, MAX_CHUNK_BYTES, MAX_HEADER_BYTES, PacketId, decode_header};
use prop::collection::vec;
use proptest::prelude::*;

fn arb_query() -> impl Strategy<Value = HeaderQuery> {
    prop_oneof![
        prop::collection::vec(any::<[u8; 32]>(), 1..=MAX_QUERY_ITEMS).prop_map(HeaderQuery::Keys),
        prop::collection::vec(any::<[u8; 32]>().prop_map(PacketId), 1..=40)
            .prop_map(HeaderQuery::Ids),
        Just(HeaderQuery::Latest),
    ]
}

/// A header: short, or the largest accepted.
fn arb_header() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => vec(any::<u8>(), 0..300),
        1 => Just(vec![0xab; MAX_HEADER_BYTES]),
    ]
}

/// One encoded peer id, from one byte to the longest accepted.
fn arb_peer_id() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 1..=MAX_PEER_ID_BYTES),
        Just(vec![0xcd]),
        Just(vec![0xef; MAX_PEER_ID_BYTES]),
    ]
}

/// A peer list: empty, short, or the longest accepted of the longest ids.
fn arb_peers() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop_oneof![
        4 => vec(arb_peer_id(), 0..20),
        1 => Just(vec![vec![0xef; MAX_PEER_ID_BYTES]; MAX_KNOWN_PEERS]),
        1 => Just(vec![vec![0x01]; MAX_KNOWN_PEERS]),
    ]
}

fn arb_push_answer() -> impl Strategy<Value = PushAnswer> {
    prop_oneof![
        Just(PushAnswer::Accepted),
        arb_peer_id().prop_map(|hub| PushAnswer::NotHub { hub }),
        Just(PushAnswer::Busy),
        Just(PushAnswer::Late),
        any::<bool>().prop_map(|foreign| PushAnswer::Refused { foreign }),
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
        (
            any::<u64>(),
            any::<u64>(),
            arb_header(),
            vec(any::<u8>(), 0..2000),
            arb_peers()
        )
            .prop_map(|(id, round, header, body, known)| RpcRequest::Push {
                id: RequestId(id),
                round,
                header,
                body,
                known,
            }),
        (any::<u64>(), any::<u64>()).prop_map(|(id, round)| RpcRequest::GetMerge {
            id: RequestId(id),
            round
        }),
        (
            any::<u64>(),
            any::<[u8; 32]>(),
            any::<u64>(),
            1..=MAX_CHUNK_BYTES as u32
        )
            .prop_map(|(id, body_hash, offset, len)| RpcRequest::GetChunk {
                id: RequestId(id),
                body_hash,
                offset,
                len,
            }),
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
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..300)).prop_map(|(id, header)| {
            RpcResponse::SnapshotHeader {
                id: RequestId(id),
                header,
            }
        }),
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..2000)).prop_map(|(id, bytes)| {
            RpcResponse::Chunk {
                id: RequestId(id),
                bytes,
            }
        }),
        (
            any::<u64>(),
            arb_header(),
            -10_000i16..=10_000,
            any::<u64>(),
            arb_peers()
        )
            .prop_map(
                |(id, header, cosine, lineage, listed)| RpcResponse::MergeHeader {
                    id: RequestId(id),
                    header,
                    cosine: SketchCosine::from_permyriad(cosine).unwrap_or_default(),
                    lineage,
                    listed,
                }
            ),
        (any::<u64>(), arb_push_answer()).prop_map(|(id, answer)| RpcResponse::PushAnswer {
            id: RequestId(id),
            answer
        }),
        (
            any::<u64>(),
            arb_header(),
            vec(any::<u8>(), 0..2000),
            -10_000i16..=10_000,
            any::<u64>(),
            arb_peers()
        )
            .prop_map(
                |(id, header, body, cosine, lineage, listed)| RpcResponse::Merge {
                    id: RequestId(id),
                    header,
                    body,
                    cosine: SketchCosine::from_permyriad(cosine).unwrap_or_default(),
                    lineage,
                    listed,
                }
            ),
    ]
}

/// The largest request of this kind a receiver takes.
fn request_limit(request: &RpcRequest) -> usize {
    match request {
        RpcRequest::Push { .. } => MAX_PUSH_REQUEST_BYTES,
        _ => MAX_REQUEST_BYTES,
    }
}

/// The request kind a response answers.
fn answered_kind(response: &RpcResponse) -> Option<RpcKind> {
    match response {
        RpcResponse::Headers { .. } => Some(RpcKind::Headers),
        RpcResponse::Body { .. } => Some(RpcKind::Body),
        RpcResponse::Snapshot { .. } | RpcResponse::SnapshotHeader { .. } => {
            Some(RpcKind::Snapshot)
        }
        RpcResponse::Chunk { .. } => Some(RpcKind::Chunk),
        RpcResponse::PushAnswer { .. } => Some(RpcKind::Push),
        RpcResponse::Merge { .. } | RpcResponse::MergeHeader { .. } => Some(RpcKind::Merge),
        RpcResponse::Error { .. } => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn requests_round_trip(request in arb_request()) {
        let bytes = request.encode().unwrap();
        prop_assert_eq!(bytes.len(), request.encoded_len());
        prop_assert!(bytes.len() <= request_limit(&request));
        prop_assert_eq!(RpcRequest::decode(&bytes).unwrap(), request);
    }

    #[test]
    fn responses_round_trip(response in arb_response()) {
        let bytes = response.encode().unwrap();
        prop_assert_eq!(bytes.len(), response.encoded_len());
        prop_assert_eq!(RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).unwrap(), response.clone());
        // Within the limit of the request it answers, too.
        if let Some(kind) = answered_kind(&response) {
            let limit = match kind {
                RpcKind::Headers => MAX_HEADERS_RESPONSE_BYTES,
                RpcKind::Body => MAX_BODY_RESPONSE_BYTES,
                RpcKind::Snapshot => MAX_SNAPSHOT_RESPONSE_BYTES,
                RpcKind::Push => MAX_PUSH_ANSWER_BYTES,
                RpcKind::Merge => MAX_MERGE_RESPONSE_BYTES,
                RpcKind::Chunk => MAX_CHUNK_RESPONSE_BYTES,
            };
            prop_assert_eq!(RpcResponse::decode(&bytes, limit).unwrap(), response);
        }
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
    // The first tags past the last variants (`GetChunk` and `MergeHeader`).
    assert!(matches!(
        RpcRequest::decode(&[8, 0]),
        Err(RpcDecodeError::Malformed { .. })
    ));
    assert!(matches!(
        RpcResponse::decode(&[9, 0], MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Malformed { .. })
    ));
    // A push answer with an unknown answer tag.
    assert!(matches!(
        RpcResponse::decode(&[4, 0, 5], MAX_RESPONSE_BYTES),
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

/// The hub exchange's messages, built by hand: a push's fixed part (tag 5, id 1, round 1, an
/// empty header and body), ready for its peer list.
fn push_prefix() -> Vec<u8> {
    vec![5u8, 1, 1, 0, 0]
}

/// A merge response's fixed part (tag 5, id 1, an empty header and body, cosine 0, lineage 0),
/// ready for its list.
fn merge_prefix() -> Vec<u8> {
    vec![5u8, 1, 0, 0, 0, 0]
}

fn push_with(known: Vec<Vec<u8>>) -> RpcRequest {
    RpcRequest::Push {
        id: RequestId(1),
        round: 1,
        header: vec![],
        body: vec![],
        known,
    }
}

fn merge_with(listed: Vec<Vec<u8>>) -> RpcResponse {
    RpcResponse::Merge {
        id: RequestId(1),
        header: vec![],
        body: vec![],
        cosine: SketchCosine::default(),
        lineage: 0,
        listed,
    }
}

#[test]
fn hub_exchange_messages_round_trip() {
    let requests = [
        RpcRequest::Push {
            id: RequestId(9),
            round: 12,
            header: vec![0xaa; 200],
            body: vec![0xbb; 5000],
            known: vec![vec![0x11; 38], vec![0x22; MAX_PEER_ID_BYTES], vec![0x33]],
        },
        push_with(vec![]),
        RpcRequest::GetMerge {
            id: RequestId(u64::MAX),
            round: u64::MAX,
        },
    ];
    for request in requests {
        let bytes = request.encode().unwrap();
        assert_eq!(bytes.len(), request.encoded_len());
        assert_eq!(RpcRequest::decode(&bytes).unwrap(), request);
    }
    let push = push_with(vec![]);
    assert_eq!(push.kind(), RpcKind::Push);
    assert_eq!(push.kind().label(), "push");
    assert_eq!(push.response_limit(), MAX_PUSH_ANSWER_BYTES);
    assert_eq!(push.id(), RequestId(1));
    let get_merge = RpcRequest::GetMerge {
        id: RequestId(4),
        round: 1,
    };
    assert_eq!(get_merge.kind(), RpcKind::Merge);
    assert_eq!(get_merge.kind().label(), "merge");
    assert_eq!(get_merge.response_limit(), MAX_MERGE_RESPONSE_BYTES);
    assert_eq!(get_merge.id(), RequestId(4));

    let answers = [
        PushAnswer::Accepted,
        PushAnswer::NotHub {
            hub: vec![0x44; 38],
        },
        PushAnswer::Busy,
        PushAnswer::Late,
        PushAnswer::Refused { foreign: false },
        PushAnswer::Refused { foreign: true },
    ];
    let mut responses: Vec<_> = answers
        .into_iter()
        .map(|answer| RpcResponse::PushAnswer {
            id: RequestId(3),
            answer,
        })
        .collect();
    responses.push(RpcResponse::Merge {
        id: RequestId(3),
        header: vec![0xaa; 300],
        body: vec![0xbb; 7000],
        cosine: SketchCosine::from_f32(-0.25),
        lineage: u64::MAX,
        listed: vec![vec![0x55; 38]; 40],
    });
    responses.push(merge_with(vec![]));
    for response in responses {
        let bytes = response.encode().unwrap();
        assert_eq!(bytes.len(), response.encoded_len());
        let limit = if matches!(response, RpcResponse::Merge { .. }) {
            get_merge.response_limit()
        } else {
            push.response_limit()
        };
        assert_eq!(RpcResponse::decode(&bytes, limit).unwrap(), response);
    }
}

/// One vector per new variant (fields spaced apart): these encodings are the wire format, and
/// appending the variants left the earlier ones' tags alone.
#[test]
fn hub_exchange_encodings_are_pinned() {
    let push = RpcRequest::Push {
        id: RequestId(7),
        round: 3,
        header: vec![0xaa, 0xbb],
        body: vec![1, 2, 3],
        known: vec![vec![0x10], vec![0x20, 0x21]],
    };
    let get_merge = RpcRequest::GetMerge {
        id: RequestId(7),
        round: 300,
    };
    let answer = |answer| RpcResponse::PushAnswer {
        id: RequestId(7),
        answer,
    };
    let merge = RpcResponse::Merge {
        id: RequestId(7),
        header: vec![0xaa],
        body: vec![],
        cosine: SketchCosine::from_f32(0.97),
        lineage: 300,
        listed: vec![vec![0x10]],
    };
    let chunk = RpcRequest::GetChunk {
        id: RequestId(7),
        body_hash: [0xab; 32],
        offset: 300,
        len: 128,
    };
    let golden_chunk = format!("07 07 {} ac02 8001", "ab".repeat(32));
    let requests: [(&RpcRequest, &str); 4] = [
        (&push, "05 07 03 02aabb 03010203 02 0110 022021"),
        (&get_merge, "06 07 ac02"),
        (&RpcRequest::GetSnapshot { id: RequestId(7) }, "04 07"),
        (&chunk, &golden_chunk),
    ];
    for (request, golden) in requests {
        let bytes = request.encode().unwrap();
        assert_eq!(hex::encode(&bytes), golden.replace(' ', ""), "{request:?}");
        assert_eq!(&RpcRequest::decode(&bytes).unwrap(), request);
    }
    let responses = [
        (answer(PushAnswer::Accepted), "04 07 00"),
        (
            answer(PushAnswer::NotHub {
                hub: vec![0x00, 0x24],
            }),
            "04 07 01 020024",
        ),
        (answer(PushAnswer::Busy), "04 07 02"),
        (answer(PushAnswer::Late), "04 07 03"),
        (
            answer(PushAnswer::Refused { foreign: false }),
            "04 07 04 00",
        ),
        (answer(PushAnswer::Refused { foreign: true }), "04 07 04 01"),
        (merge, "05 07 01aa 00 c89701 ac02 01 0110"),
        (
            RpcResponse::SnapshotHeader {
                id: RequestId(7),
                header: vec![0xaa, 0xbb],
            },
            "06 07 02aabb",
        ),
        (
            RpcResponse::Chunk {
                id: RequestId(7),
                bytes: vec![1, 2, 3],
            },
            "07 07 03010203",
        ),
        (
            RpcResponse::MergeHeader {
                id: RequestId(7),
                header: vec![0xaa],
                cosine: SketchCosine::from_f32(0.97),
                lineage: 300,
                listed: vec![vec![0x10]],
            },
            "08 07 01aa c89701 ac02 01 0110",
        ),
        (
            RpcResponse::Error {
                id: RequestId(7),
                code: RpcErrorCode::Refused,
            },
            "02 07 01",
        ),
    ];
    for (response, golden) in responses {
        let bytes = response.encode().unwrap();
        assert_eq!(hex::encode(&bytes), golden.replace(' ', ""), "{response:?}");
        assert_eq!(
            RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).unwrap(),
            response
        );
    }
}

/// A merge's cosine is ten-thousandths within ±10,000: one step past either end is malformed.
#[test]
fn a_merge_cosine_out_of_range_is_refused() {
    let merge = |permyriad: i16| {
        let mut bytes = vec![5u8, 7, 1, 0xaa, 0];
        bytes.extend(postcard::to_allocvec(&permyriad).unwrap());
        bytes.extend([0, 0]);
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES)
    };
    for edge in [-10_000, 0, 10_000] {
        let Ok(RpcResponse::Merge { cosine, .. }) = merge(edge) else {
            panic!("cosine {edge} refused");
        };
        assert_eq!(cosine.permyriad(), edge);
    }
    for outside in [-10_001, 10_001, i16::MIN, i16::MAX] {
        assert_eq!(
            merge(outside),
            Err(RpcDecodeError::Malformed {
                detail: "cosine out of range"
            }),
            "{outside}"
        );
    }
}

#[test]
fn peer_lists_over_the_count_limit_are_refused() {
    let too_many = vec![vec![0x10]; MAX_KNOWN_PEERS + 1];
    assert_eq!(
        push_with(too_many.clone()).encode(),
        Err(RpcEncodeError::Oversize {
            what: "known peer list",
            len: (MAX_KNOWN_PEERS + 1) as u64,
            max: MAX_KNOWN_PEERS as u64,
        })
    );
    assert!(matches!(
        merge_with(too_many).encode(),
        Err(RpcEncodeError::Oversize {
            what: "listed peer list",
            ..
        })
    ));
    // The same lists crafted by hand: refused on the count, whatever follows.
    for (prefix, what) in [
        (push_prefix(), "known peer list"),
        (merge_prefix(), "listed peer list"),
    ] {
        let mut bytes = prefix;
        varint((MAX_KNOWN_PEERS + 1) as u64, &mut bytes);
        for _ in 0..=MAX_KNOWN_PEERS {
            bytes.extend([1, 0x10]);
        }
        let expected = Some(RpcDecodeError::Oversize {
            what,
            len: (MAX_KNOWN_PEERS + 1) as u64,
            max: MAX_KNOWN_PEERS as u64,
        });
        if what == "known peer list" {
            assert_eq!(RpcRequest::decode(&bytes).err(), expected);
        } else {
            assert_eq!(
                RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).err(),
                expected
            );
        }
    }
    // A full list is fine.
    let full = push_with(vec![vec![0x10]; MAX_KNOWN_PEERS]);
    assert_eq!(RpcRequest::decode(&full.encode().unwrap()).unwrap(), full);
}

#[test]
fn peer_ids_over_the_length_limit_or_empty_are_refused() {
    let long = vec![0x10; MAX_PEER_ID_BYTES + 1];
    let oversize = RpcEncodeError::Oversize {
        what: "peer id",
        len: (MAX_PEER_ID_BYTES + 1) as u64,
        max: MAX_PEER_ID_BYTES as u64,
    };
    assert_eq!(
        push_with(vec![vec![1], long.clone()]).encode(),
        Err(oversize.clone())
    );
    assert_eq!(
        merge_with(vec![long.clone()]).encode(),
        Err(oversize.clone())
    );
    let redirect = |hub| RpcResponse::PushAnswer {
        id: RequestId(1),
        answer: PushAnswer::NotHub { hub },
    };
    assert_eq!(redirect(long.clone()).encode(), Err(oversize));
    assert_eq!(
        push_with(vec![vec![]]).encode(),
        Err(RpcEncodeError::EmptyPeerId)
    );
    assert_eq!(
        merge_with(vec![vec![]]).encode(),
        Err(RpcEncodeError::EmptyPeerId)
    );
    assert_eq!(redirect(vec![]).encode(), Err(RpcEncodeError::EmptyPeerId));

    let oversize = Some(RpcDecodeError::Oversize {
        what: "peer id",
        len: (MAX_PEER_ID_BYTES + 1) as u64,
        max: MAX_PEER_ID_BYTES as u64,
    });
    let empty = Some(RpcDecodeError::Malformed {
        detail: "empty peer id",
    });
    // In a push's list (second entry), a merge's list, and a redirect.
    let mut bytes = push_prefix();
    bytes.extend([2, 1, 0x10]);
    varint(long.len() as u64, &mut bytes);
    bytes.extend(&long);
    assert_eq!(RpcRequest::decode(&bytes).err(), oversize.clone());
    let mut bytes = merge_prefix();
    bytes.push(1);
    varint(long.len() as u64, &mut bytes);
    bytes.extend(&long);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).err(),
        oversize.clone()
    );
    let mut bytes = vec![4u8, 1, 1];
    varint(long.len() as u64, &mut bytes);
    bytes.extend(&long);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).err(),
        oversize.clone()
    );
    let mut bytes = push_prefix();
    bytes.extend([2, 0, 2, 0x10, 0x11]);
    assert_eq!(RpcRequest::decode(&bytes).err(), empty.clone());
    let mut bytes = merge_prefix();
    bytes.extend([2, 0, 2, 0x10, 0x11]);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES).err(),
        empty.clone()
    );
    assert_eq!(
        RpcResponse::decode(&[4, 1, 1, 0], MAX_RESPONSE_BYTES).err(),
        empty
    );
}

#[test]
fn a_count_the_bytes_cannot_hold_is_truncated() {
    // 1,000 entries claimed, one present: refused before the list is allocated.
    let mut bytes = push_prefix();
    varint(1000, &mut bytes);
    bytes.extend([1, 0x10]);
    assert_eq!(RpcRequest::decode(&bytes), Err(RpcDecodeError::Truncated));
    let mut bytes = merge_prefix();
    varint(1000, &mut bytes);
    bytes.extend([1, 0x10]);
    assert_eq!(
        RpcResponse::decode(&bytes, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Truncated)
    );
    // Two entries claimed and three bytes left: fewer than two bytes an entry.
    let mut bytes = push_prefix();
    bytes.extend([2, 1, 0x10]);
    assert_eq!(RpcRequest::decode(&bytes), Err(RpcDecodeError::Truncated));
    // A push whose body claims more bytes than are present.
    let mut bytes = vec![5u8, 1, 1, 0];
    varint(MAX_BODY_BYTES as u64, &mut bytes);
    bytes.extend([0; 16]);
    assert_eq!(RpcRequest::decode(&bytes), Err(RpcDecodeError::Truncated));
}

#[test]
fn only_a_push_may_exceed_the_request_limit() {
    // A GetMerge padded past MAX_REQUEST_BYTES: refused on its length once its tag is read.
    let mut bytes = vec![6u8, 1, 2];
    bytes.resize(MAX_REQUEST_BYTES + 1, 0);
    assert_eq!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::Oversize {
            what: "request",
            len: (MAX_REQUEST_BYTES + 1) as u64,
            max: MAX_REQUEST_BYTES as u64,
        })
    );
    // Padded to exactly the limit, it is parsed and its padding refused.
    bytes.truncate(MAX_REQUEST_BYTES);
    assert_eq!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::TrailingBytes {
            extra: MAX_REQUEST_BYTES - 3
        })
    );
    // Garbage whose first byte is no tag at all, over the request limit.
    let garbage = vec![0xffu8; MAX_REQUEST_BYTES + 1];
    assert!(matches!(
        RpcRequest::decode(&garbage),
        Err(RpcDecodeError::Oversize {
            what: "request",
            ..
        })
    ));
    // A push is taken past it.
    let push = RpcRequest::Push {
        id: RequestId(1),
        round: 1,
        header: vec![0xaa; MAX_HEADER_BYTES],
        body: vec![0xbb; 4 * MAX_REQUEST_BYTES],
        known: vec![vec![0x10; 38]; 64],
    };
    let bytes = push.encode().unwrap();
    assert!(bytes.len() > MAX_REQUEST_BYTES);
    assert_eq!(RpcRequest::decode(&bytes).unwrap(), push);
    // But not past its own limit: the length alone refuses it.
    let huge = vec![5u8; MAX_PUSH_REQUEST_BYTES + 1];
    assert_eq!(
        RpcRequest::decode(&huge),
        Err(RpcDecodeError::Oversize {
            what: "request",
            len: (MAX_PUSH_REQUEST_BYTES + 1) as u64,
            max: MAX_PUSH_REQUEST_BYTES as u64,
        })
    );
}

#[test]
fn pushed_and_merged_packets_keep_their_limits() {
    let push = RpcRequest::Push {
        id: RequestId(1),
        round: 1,
        header: vec![0; MAX_HEADER_BYTES + 1],
        body: vec![],
        known: vec![],
    };
    assert!(matches!(
        push.encode(),
        Err(RpcEncodeError::Oversize { what: "header", .. })
    ));
    let merge = RpcResponse::Merge {
        id: RequestId(1),
        header: vec![],
        body: vec![0; MAX_BODY_BYTES + 1],
        cosine: SketchCosine::default(),
        lineage: 0,
        listed: vec![],
    };
    assert!(matches!(
        merge.encode(),
        Err(RpcEncodeError::Oversize { what: "body", .. })
    ));
    // A header over its limit, crafted: refused before the peer list is read.
    let mut bytes = vec![5u8, 1, 1];
    varint((MAX_HEADER_BYTES + 1) as u64, &mut bytes);
    bytes.resize(bytes.len() + MAX_HEADER_BYTES + 1, 0);
    bytes.extend([0, 0]);
    assert!(matches!(
        RpcRequest::decode(&bytes),
        Err(RpcDecodeError::Oversize { what: "header", .. })
    ));
    // A merge-sized answer is refused for a push: its answer is small.
    let push = push_with(vec![]);
    let big = RpcResponse::Merge {
        id: RequestId(1),
        header: vec![],
        body: vec![0; MAX_PUSH_ANSWER_BYTES],
        cosine: SketchCosine::default(),
        lineage: 0,
        listed: vec![],
    }
    .encode()
    .unwrap();
    assert!(matches!(
        RpcResponse::decode(&big, push.response_limit()),
        Err(RpcDecodeError::Oversize {
            what: "response",
            ..
        })
    ));
    // A refusal's flag is a postcard bool: anything but 0 or 1 is malformed.
    assert!(matches!(
        RpcResponse::decode(&[4, 1, 4, 2], MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Malformed { .. })
    ));
}

/// A chunk request asks for 1..=MAX_CHUNK_BYTES bytes, and a chunk carries no more: anything
/// else is refused on both sides before a byte is copied.
#[test]
fn a_chunk_outside_its_bounds_is_refused() {
    let request = |len: u32| RpcRequest::GetChunk {
        id: RequestId(1),
        body_hash: [0; 32],
        offset: 0,
        len,
    };
    assert_eq!(request(0).encode(), Err(RpcEncodeError::EmptyChunk));
    assert!(matches!(
        request(MAX_CHUNK_BYTES as u32 + 1).encode(),
        Err(RpcEncodeError::Oversize { what: "chunk", .. })
    ));
    let wire = |len: u32| {
        let mut bytes = vec![7u8, 1];
        bytes.extend([0u8; 32]);
        bytes.push(0);
        bytes.extend(postcard::to_allocvec(&len).unwrap());
        RpcRequest::decode(&bytes)
    };
    assert!(matches!(wire(0), Err(RpcDecodeError::Malformed { .. })));
    assert!(matches!(
        wire(MAX_CHUNK_BYTES as u32 + 1),
        Err(RpcDecodeError::Oversize { what: "chunk", .. })
    ));
    assert_eq!(
        wire(MAX_CHUNK_BYTES as u32),
        Ok(request(MAX_CHUNK_BYTES as u32))
    );

    let chunk = |len: usize| RpcResponse::Chunk {
        id: RequestId(1),
        bytes: vec![0; len],
    };
    let largest = chunk(MAX_CHUNK_BYTES).encode().unwrap();
    assert!(largest.len() <= MAX_CHUNK_RESPONSE_BYTES);
    assert_eq!(
        RpcResponse::decode(&largest, MAX_CHUNK_RESPONSE_BYTES).unwrap(),
        chunk(MAX_CHUNK_BYTES)
    );
    assert!(matches!(
        chunk(MAX_CHUNK_BYTES + 1).encode(),
        Err(RpcEncodeError::Oversize { what: "chunk", .. })
    ));
    // One byte over, framed by hand: refused by the chunk bound, even under the largest limit.
    let mut over = vec![7u8, 1];
    over.extend(postcard::to_allocvec(&(MAX_CHUNK_BYTES as u32 + 1)).unwrap());
    over.resize(over.len() + MAX_CHUNK_BYTES + 1, 0);
    assert!(matches!(
        RpcResponse::decode(&over, MAX_RESPONSE_BYTES),
        Err(RpcDecodeError::Oversize { what: "chunk", .. })
    ));
}
