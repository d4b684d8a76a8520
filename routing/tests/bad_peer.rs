//! A hostile peer announces itself under a victim's semantic keys and answers its header requests
//! with garbage, then an oversize frame, then a header with a forged signature. The victim counts
//! each reject by reason, bans the peer after the third, disconnects it, keeps working with its
//! honest partner, and nothing panics.
//!
//! A second hostile peer opens the RPC protocol itself and sends requests that are not requests
//! (garbage, a 4 GiB length prefix): libp2p reports such failed reads to nobody, so the codec
//! hands them to the driver as invalid requests, and the victim scores and bans the sender the
//! same way.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod support;

use std::io;
use std::sync::Arc;
use std::time::Duration;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, StreamExt};
use kindred_proto::rpc::{MAX_HEADERS_RESPONSE_BYTES, RpcRequest, RpcResponse};
use kindred_routing::behaviour::KAD_PROTOCOL;
use kindred_routing::codec::RPC_PROTOCOL;
use kindred_routing::keys::{KeyContext, dht_key};
use kindred_routing::transport::build_transport;
use kindred_routing::{
    MemoryStore, NetworkId, PartnerQuery, RoundWindow, RoutingEvent, TransportKind, spawn,
};
use libp2p::identity::Keypair;
use libp2p::kad::store::MemoryStore as KadStore;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, StreamProtocol, Swarm, identify, kad};
use support::*;
use tokio::sync::{mpsc, oneshot};

/// Reads request frames, writes whatever bytes it is given verbatim (as a response or as a
/// request), and reads any response to the end (bounded).
#[derive(Clone, Default)]
struct RawCodec;

impl request_response::Codec for RawCodec {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = Vec<u8>;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Vec<u8>> {
        let mut len = [0u8; 4];
        io.read_exact(&mut len).await?;
        let mut buf = vec![0u8; (u32::from_be_bytes(len) as usize).min(1 << 16)];
        io.read_exact(&mut buf).await?;
        Ok(buf)
    }

    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Vec<u8>> {
        let mut buf = Vec::new();
        io.take(1 << 16).read_to_end(&mut buf).await?;
        Ok(buf)
    }

    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        bytes: Vec<u8>,
    ) -> io::Result<()> {
        io.write_all(&bytes).await
    }

    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        bytes: Vec<u8>,
    ) -> io::Result<()> {
        io.write_all(&bytes).await?;
        io.close().await
    }
}

#[derive(NetworkBehaviour)]
struct Evil {
    kad: kad::Behaviour<KadStore>,
    identify: identify::Behaviour,
    rpc: request_response::Behaviour<RawCodec>,
}

fn framed(bytes: &[u8]) -> Vec<u8> {
    let mut out = (bytes.len() as u32).to_be_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

/// The hostile node: provides `keys`, then answers the n-th header request with offence n.
async fn run_evil(
    key: Keypair,
    victim: (libp2p::PeerId, Multiaddr),
    keys: Vec<[u8; 32]>,
    forged_header: Vec<u8>,
    ready: oneshot::Sender<Multiaddr>,
    mut stop: mpsc::Receiver<()>,
) -> usize {
    let peer = key.public().to_peer_id();
    let transport =
        build_transport(&key, TransportKind::Memory, None, Duration::from_secs(5)).unwrap();
    let mut kad =
        kad::Behaviour::with_config(peer, KadStore::new(peer), kad::Config::new(KAD_PROTOCOL));
    kad.set_mode(Some(kad::Mode::Server));
    let behaviour = Evil {
        kad,
        identify: identify::Behaviour::new(identify::Config::new(
            "/kindred/1.0.0".into(),
            key.public(),
        )),
        rpc: request_response::Behaviour::with_codec(
            RawCodec,
            [(RPC_PROTOCOL, ProtocolSupport::Inbound)],
            request_response::Config::default(),
        ),
    };
    let mut swarm = Swarm::new(
        transport,
        behaviour,
        peer,
        libp2p::swarm::Config::with_tokio_executor()
            .with_idle_connection_timeout(Duration::from_secs(60)),
    );
    swarm.listen_on("/memory/0".parse().unwrap()).unwrap();
    let listen = loop {
        if let SwarmEvent::NewListenAddr { address, .. } = swarm.select_next_some().await {
            break address;
        }
    };
    swarm.add_external_address(listen.clone());
    swarm
        .behaviour_mut()
        .kad
        .add_address(&victim.0, victim.1.clone());
    swarm.dial(victim.1.clone()).unwrap();
    let mut pending: usize = keys.len();
    let mut ready = Some((ready, listen));
    let mut started = false;
    let mut served = 0usize;
    loop {
        tokio::select! {
            _ = stop.recv() => return served,
            event = swarm.select_next_some() => match event {
                SwarmEvent::ConnectionEstablished { peer_id, .. } if peer_id == victim.0 && !started => {
                    started = true;
                    for k in &keys {
                        swarm.behaviour_mut().kad.start_providing(kad::RecordKey::new(&dht_key(k))).unwrap();
                    }
                }
                SwarmEvent::Behaviour(EvilEvent::Kad(kad::Event::OutboundQueryProgressed {
                    result: kad::QueryResult::StartProviding(_),
                    ..
                })) => {
                    pending = pending.saturating_sub(1);
                    if pending == 0
                        && let Some((tx, addr)) = ready.take() {
                            let _ = tx.send(addr);
                        }
                }
                SwarmEvent::Behaviour(EvilEvent::Rpc(request_response::Event::Message {
                    message: request_response::Message::Request { request, channel, .. },
                    ..
                })) => {
                    let id = RpcRequest::decode(&request).unwrap().id();
                    let reply = match served {
                        // Not postcard at all.
                        0 => framed(&[0xff; 40]),
                        // A frame claiming to be larger than any headers response.
                        1 => ((MAX_HEADERS_RESPONSE_BYTES + 1) as u32).to_be_bytes().to_vec(),
                        // Well-formed, but the header's signature is forged.
                        _ => framed(
                            &RpcResponse::Headers { id, headers: vec![forged_header.clone()] }
                                .encode()
                                .unwrap(),
                        ),
                    };
                    served += 1;
                    let _ = swarm.behaviour_mut().rpc.send_response(channel, reply);
                }
                _ => {}
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sending_invalid_data_is_banned() {
    use rand::SeedableRng;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let planted = Planted::new(&mut rng, 1);
    let model = Arc::new(spec());

    // Victim and an honest partner from the same cluster.
    let mut nodes = Vec::new();
    for i in 0..2u64 {
        let key = identity(900 + i);
        let (embedding, margins) = planted.sample(&mut rng, 0, 0.1);
        let packet = packet(&key, 4, embedding, i as f32);
        let store = Arc::new(MemoryStore::default());
        store.insert(&packet);
        let (handle, events) = spawn(
            Keypair::from(key),
            node_config(TransportKind::Memory),
            store.clone(),
        )
        .await
        .unwrap();
        nodes.push((handle, events, packet, margins));
    }
    let (victim, mut events, own, margins) = nodes.remove(0);
    let (honest, _honest_events, honest_packet, _) = nodes.remove(0);
    let victim_addr = victim.listen_addrs()[0].clone();
    honest.dial(victim_addr.clone()).await.unwrap();
    // The victim adds the honest peer to its routing table once identify has run on the new
    // connection, which can lag the dial: retry the bootstrap (bounded) until it has a peer.
    let mut attempts = 0;
    loop {
        match victim.bootstrap().await {
            Ok(()) => break,
            Err(e) if attempts < 100 => {
                attempts += 1;
                tracing::debug!("bootstrap not ready yet: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("victim never learned the honest peer: {e}"),
        }
    }
    honest.announce(honest_packet.header.clone()).await.unwrap();

    // The attacker provides the victim's own band keys, so the victim is sure to ask it.
    let h = own.header.header();
    let ctx = KeyContext::new(
        NetworkId::from_name("kindred-test"),
        h.model,
        RoundWindow(h.round),
        Default::default(),
    );
    let keys: Vec<[u8; 32]> = ctx.band_keys(&h.embedding.simhash).collect();
    let evil_key = identity(666);
    let mut forged = packet(&evil_key, 4, h.embedding.clone(), 9.0).header_bytes;
    let last = forged.len() - 1;
    forged[last] ^= 0x01; // last byte of the signature
    let (ready_tx, ready_rx) = oneshot::channel();
    let (stop_tx, stop_rx) = mpsc::channel(1);
    let evil = tokio::spawn(run_evil(
        Keypair::from(evil_key.clone()),
        (victim.peer_id(), victim_addr),
        keys,
        forged,
        ready_tx,
        stop_rx,
    ));
    let evil_peer = Keypair::from(evil_key).public().to_peer_id();
    tokio::time::timeout(Duration::from_secs(20), ready_rx)
        .await
        .expect("the attacker announces in time")
        .unwrap();

    for round in 0..3 {
        let query = PartnerQuery::new(own.header.clone(), margins.clone(), model.clone());
        let partners = tokio::time::timeout(Duration::from_secs(30), victim.find_partners(query))
            .await
            .expect("lookups finish despite the attacker")
            .unwrap();
        // The honest partner is still found and fetched every time.
        assert_eq!(partners.packets.len(), 1, "round {round}");
        assert_eq!(
            partners.packets[0].packet.header.header().sender,
            honest.peer_id()
        );
    }

    let metrics = victim.metrics().await.unwrap();
    println!("rejects: {:?}, bans: {}", metrics.rejects, metrics.bans);
    assert_eq!(metrics.rejects.get("rpc_malformed"), Some(&1));
    assert_eq!(metrics.rejects.get("rpc_oversize"), Some(&1));
    assert_eq!(metrics.rejects.get("bad_signature"), Some(&1));
    assert_eq!(metrics.bans, 1);
    let info = victim.info().await.unwrap();
    assert_eq!(info.banned, vec![evil_peer]);
    let mut banned_event = false;
    while let Ok(event) = events.try_recv() {
        if let RoutingEvent::PeerBanned { peer, .. } = event {
            assert_eq!(peer, evil_peer);
            banned_event = true;
        }
    }
    assert!(banned_event);
    // Disconnected, and a fresh lookup no longer asks it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!victim.info().await.unwrap().connected.contains(&evil_peer));
    let query = PartnerQuery::new(own.header.clone(), margins.clone(), model.clone());
    let partners = victim.find_partners(query).await.unwrap();
    assert_eq!(partners.packets.len(), 1);

    // The honest partner's round is remembered (for the node to persist) and restorable.
    let marks = victim.replay_marks().await.unwrap();
    assert!(
        marks.iter().any(|m| m.sender == honest.peer_id()
            && m.round == 4
            && m.packet == honest_packet.id())
    );
    victim.restore_replay_marks(marks.clone()).await;
    assert_eq!(victim.replay_marks().await.unwrap().len(), marks.len());

    stop_tx.send(()).await.unwrap();
    let served = evil.await.unwrap();
    assert_eq!(served, 3, "the banned attacker is asked nothing more");
    victim.shutdown().await;
    honest.shutdown().await;
}

/// A client of `/kindred/rpc/1.0.0` that writes arbitrary bytes as its requests.
#[derive(NetworkBehaviour)]
struct Spammer {
    rpc: request_response::Behaviour<RawCodec>,
}

/// A peer that sends undecodable and oversize requests is scored for each (`bad_request`),
/// banned after the third, disconnected, and refused when it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_sending_garbage_requests_is_banned() {
    let (victim, mut events) = spawn(
        Keypair::from(identity(920)),
        node_config(TransportKind::Memory),
        Arc::new(MemoryStore::default()),
    )
    .await
    .unwrap();
    let victim_peer = victim.peer_id();
    let victim_addr = victim.listen_addrs()[0].clone();

    let key = Keypair::from(identity(667));
    let attacker = key.public().to_peer_id();
    let transport =
        build_transport(&key, TransportKind::Memory, None, Duration::from_secs(5)).unwrap();
    let rpc = request_response::Behaviour::with_codec(
        RawCodec,
        [(RPC_PROTOCOL, ProtocolSupport::Outbound)],
        request_response::Config::default().with_request_timeout(Duration::from_secs(5)),
    );
    let mut swarm = Swarm::new(
        transport,
        Spammer { rpc },
        attacker,
        libp2p::swarm::Config::with_tokio_executor()
            .with_idle_connection_timeout(Duration::from_secs(60)),
    );

    // Not postcard; a 4 GiB length prefix (the victim must not read or allocate past it); text.
    let mut oversize = u32::MAX.to_be_bytes().to_vec();
    oversize.extend_from_slice(&[0xab; 16]);
    let mut garbage = vec![
        framed(&[0xff; 40]),
        oversize,
        framed(b"GET / HTTP/1.1\r\n\r\n"),
    ]
    .into_iter();

    // One request at a time: the next goes out once the previous one has been dealt with (the
    // victim closes the stream without an answer). Done when the victim has banned the attacker
    // and the attacker has seen its connection closed.
    swarm.dial(victim_addr.clone()).unwrap();
    let mut outcomes = 0;
    let mut disconnected = false;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let attack = async {
        for _ in 0..2000 {
            tokio::select! {
                event = swarm.select_next_some() => match event {
                    SwarmEvent::ConnectionEstablished { peer_id, .. } if peer_id == victim_peer => {
                        if let Some(bytes) = garbage.next() {
                            swarm.behaviour_mut().rpc.send_request(&victim_peer, bytes);
                        }
                    }
                    SwarmEvent::Behaviour(SpammerEvent::Rpc(
                        request_response::Event::Message { .. }
                        | request_response::Event::OutboundFailure { .. },
                    )) => {
                        outcomes += 1;
                        if let Some(bytes) = garbage.next() {
                            swarm.behaviour_mut().rpc.send_request(&victim_peer, bytes);
                        }
                    }
                    SwarmEvent::ConnectionClosed { peer_id, num_established: 0, .. }
                        if peer_id == victim_peer => disconnected = true,
                    _ => {}
                },
                _ = tick.tick() => {
                    if disconnected && victim.info().await.unwrap().banned.contains(&attacker) {
                        return;
                    }
                }
            }
        }
        panic!("the attack never ended");
    };
    tokio::time::timeout(Duration::from_secs(20), attack)
        .await
        .expect("the victim bans and disconnects the attacker");
    assert!(
        outcomes >= 2,
        "the attacker's first requests were dealt with"
    );

    let metrics = victim.metrics().await.unwrap();
    println!("rejects: {:?}, bans: {}", metrics.rejects, metrics.bans);
    assert_eq!(metrics.rejects.get("bad_request"), Some(&2));
    assert_eq!(metrics.rejects.get("rpc_oversize"), Some(&1));
    assert_eq!(metrics.bans, 1);
    let info = victim.info().await.unwrap();
    assert_eq!(info.banned, vec![attacker]);
    assert!(!info.connected.contains(&attacker));
    let mut banned_event = false;
    while let Ok(event) = events.try_recv() {
        if let RoutingEvent::PeerBanned { peer, reason, .. } = event {
            assert_eq!((peer, reason), (attacker, "bad_request"));
            banned_event = true;
        }
    }
    assert!(banned_event);

    // Coming back does not help: the connection is refused (or closed as soon as the victim
    // sees who it is), well before any idle timeout.
    swarm.dial(victim_addr).unwrap();
    let refused = async {
        for _ in 0..1000 {
            match swarm.select_next_some().await {
                SwarmEvent::OutgoingConnectionError { .. } => return,
                SwarmEvent::ConnectionClosed { peer_id, .. } if peer_id == victim_peer => return,
                _ => {}
            }
        }
        panic!("no answer to the dial");
    };
    tokio::time::timeout(Duration::from_secs(10), refused)
        .await
        .expect("the banned attacker cannot reconnect");
    assert!(!victim.info().await.unwrap().connected.contains(&attacker));
    victim.shutdown().await;
}
