//! Peers push malformed packets to an honest node running the hub exchange: a tampered
//! header, a body that is not the one its header signed, another peer's packet, a packet
//! replayed into another round, a truncated header, a push over the node's push limit and a
//! header of garbage. Each is rejected with its own reason in the node's metrics, the
//! sender is banned (its next push is refused), and the node keeps running its rounds.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::time::Duration;

use kindred_node::trainer::{Arch, Model};
use kindred_proto::{
    DenseValues, Embedding, HeaderFields, LayerPayload, ModelSpec, PacketBody, SealedPacket, seal,
};
use kindred_routing::{
    ExchangeCall, ExchangeError, ExchangeReply, MemoryStore, NetworkId, PushedPacket,
    RoutingConfig, spawn,
};
use kindred_tests::{NodeProc, TempDir, node_config, wait_for};
use libp2p::identity::{Keypair, ed25519};

/// A packet of `round` for the MLP, signed by `key`: every layer dense zeros but one value.
fn packet(key: &ed25519::Keypair, spec: &ModelSpec, round: u64) -> SealedPacket {
    let layers = spec
        .layers()
        .iter()
        .map(|l| {
            let mut v = vec![0.0f32; l.numel() as usize];
            v[0] = 0.01;
            LayerPayload::Dense(DenseValues::F32(v))
        })
        .collect();
    let fields = HeaderFields {
        round,
        unix_ms: 0,
        samples: 32,
        loss: 0.5,
        embedding: Embedding::default(),
    };
    seal(key, spec, fields, &PacketBody { layers }).unwrap()
}

/// Connect as `key` to `node` and make `calls` to it in turn; returns each answer.
async fn attack(
    key: &ed25519::Keypair,
    node: &NodeProc,
    peer: libp2p::PeerId,
    calls: Vec<(&'static str, ExchangeCall)>,
) -> Vec<(&'static str, Result<ExchangeReply, ExchangeError>)> {
    let mut config = RoutingConfig::new(NetworkId::from_name("badpush-test"));
    config.transport.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()];
    let (routing, _events) = spawn(
        Keypair::from(key.clone()),
        config,
        Arc::new(MemoryStore::default()),
    )
    .await
    .unwrap();
    routing
        .dial(node.bootstrap_addr().parse().unwrap())
        .await
        .unwrap();
    let mut answers = Vec::new();
    for (what, call) in calls {
        let answer = routing.exchange_call(peer, call).await;
        println!("{what}: {answer:?}");
        answers.push((what, answer));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    routing.shutdown().await;
    answers
}

#[test]
fn malformed_pushes_are_rejected_by_reason_and_the_sender_banned() {
    let dir = TempDir::new("badpush");
    let mut node = NodeProc::init(
        dir.path().join("node"),
        node_config("badpush-test", 0, 0, 1, 2.0),
    );
    node.start();
    let peer: libp2p::PeerId = wait_for(Duration::from_secs(30), || node.status())
        .unwrap()
        .peer_id
        .parse()
        .unwrap();

    let spec = Model::new(Arch::MLP, 1).unwrap().spec().clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // Two attackers: the first sends three invalid pushes (a ban) and then a valid one, the
    // second another peer's packet.
    let ours = ed25519::Keypair::generate();
    let second = ed25519::Keypair::generate();
    let theirs = ed25519::Keypair::generate();
    let own = packet(&ours, &spec, 7);
    let mut tampered = own.clone();
    let in_signature = tampered.header_bytes.len() - 20;
    tampered.header_bytes[in_signature] ^= 0x01;
    let mut wrong_body = own.clone();
    wrong_body.body_bytes[3] ^= 0x40;
    let foreign = packet(&theirs, &spec, 7);
    let push = |p: &SealedPacket, round: u64| {
        ExchangeCall::Push(PushedPacket {
            round,
            header: p.header_bytes.clone(),
            body: p.body_bytes.clone(),
            known: Vec::new(),
        })
    };
    let first = runtime.block_on(attack(
        &ours,
        &node,
        peer,
        vec![
            ("replayed into round 9", push(&own, 9)),
            ("tampered header", push(&tampered, 7)),
            ("body not the signed one", push(&wrong_body, 7)),
            ("valid, after the ban", push(&own, 7)),
        ],
    ));
    let other = runtime.block_on(attack(
        &second,
        &node,
        peer,
        vec![("another peer's packet", push(&foreign, 7))],
    ));
    // A third: a truncated header, a push over the node's push limit (a body of 1 MB, where
    // the MLP's dense f32 body is 204 KB), a header of garbage, then a valid push.
    let third = ed25519::Keypair::generate();
    let own_third = packet(&third, &spec, 7);
    let mut truncated = own_third.clone();
    truncated
        .header_bytes
        .truncate(own_third.header_bytes.len() / 2);
    let mut oversize = own_third.clone();
    oversize.body_bytes = vec![0u8; 1 << 20];
    let mut garbage = own_third.clone();
    garbage.header_bytes = vec![0xff; own_third.header_bytes.len()];
    let last = runtime.block_on(attack(
        &third,
        &node,
        peer,
        vec![
            ("truncated header", push(&truncated, 7)),
            ("oversize push", push(&oversize, 7)),
            ("garbage header", push(&garbage, 7)),
            ("valid, after the ban", push(&own_third, 7)),
        ],
    ));
    // Invalid pushes are answered with nothing (the stream closes); the banned sender is refused
    // (or, banned, cannot connect at all).
    for (what, answer) in first
        .iter()
        .take(3)
        .chain(&other)
        .chain(last.iter().take(3))
    {
        assert!(
            !matches!(answer, Ok(ExchangeReply::Answer(_))),
            "{what} was answered: {answer:?}"
        );
    }
    for (_, after_ban) in [&first[3], &last[3]] {
        assert!(
            matches!(
                after_ban,
                Err(ExchangeError::Refused | ExchangeError::Failed(_))
            ),
            "a push after the ban got {after_ban:?}"
        );
    }

    // The node's metrics take the routing counters at each round's end.
    let reasons = [
        "round_mismatch",
        "bad_signature",
        "body_hash_mismatch",
        "foreign_sender",
        "truncated",
        "rpc_oversize",
        "malformed",
    ];
    let line = |r: &str| format!("kindred_rejects_total{{reason=\"{r}\"}} 1");
    let metrics = wait_for(Duration::from_secs(15), || {
        node.metrics()
            .filter(|m| reasons.iter().all(|r| m.contains(&line(r))))
    })
    .unwrap_or_else(|| {
        panic!(
            "not every reject counted once:\n{}",
            node.metrics().unwrap_or_default()
        )
    });
    assert!(!metrics.contains("kindred_bans_total 0"), "{metrics}");
    // The node goes on with its rounds.
    let before = node.status().unwrap().round.unwrap_or(0);
    let later = wait_for(Duration::from_secs(20), || {
        node.status()?.round.filter(|&r| r > before)
    });
    assert!(
        later.is_some() && node.is_running(),
        "the node stopped:\n{}",
        node.log()
    );
}
