//! A hostile Kindred peer, for tests only.
//!
//! It trains and embeds like an honest node of the task it is given (so its semantic keys collide
//! with that cluster's and honest nodes ask it for headers), announces its packets — and then
//! serves poison: headers with forged signatures, oversize headers, garbage bytes, and bodies
//! that do not match their signed hash, rotating through them. Honest nodes must reject every one,
//! penalise it, ban it, and never crash or merge with it.
//!
//! Usage: `hostile --data-dir DIR --listen MULTIADDR --bootstrap MULTIADDR --label-shift N
//! [--round-secs S] [--network NAME] [--discovery-every N]` (stops on SIGTERM or after 10
//! minutes). `--discovery-every` must match the honest nodes' period, so that its key windows
//! are theirs.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use kindred_node::config::{NodeConfig, TrainerConfig};
use kindred_node::engine::Engine;
use kindred_node::store::Store;
use kindred_proto::{MAX_HEADER_BYTES, PacketId};
use kindred_routing::{NetworkId, PacketStore, RoutingConfig, spawn};

/// Served bytes per packet id: (header, body, attack mode, sender-forged header).
type Served = (Vec<u8>, Vec<u8>, u8, Option<Vec<u8>>);

/// What the hostile peer serves for a packet id, rotating per packet.
#[derive(Debug, Default)]
struct PoisonStore {
    packets: Mutex<HashMap<PacketId, Served>>,
}

impl PacketStore for PoisonStore {
    fn header(&self, id: &PacketId) -> Option<Vec<u8>> {
        let map = self.packets.lock().unwrap_or_else(PoisonError::into_inner);
        let (header, _, mode, forged) = map.get(id)?;
        let mut h = header.clone();
        Some(match mode % 4 {
            // Tampered: one bit of the signed round changed, so the signature no longer verifies.
            0 => {
                if let Some(b) = h.get_mut(34) {
                    *b ^= 0x01;
                }
                h
            }
            // Oversize.
            1 => vec![1u8; MAX_HEADER_BYTES * 4],
            // Malformed garbage.
            2 => (0..200u32).map(|i| (i * 37 % 251) as u8).collect(),
            // Forged: a validly encoded header naming another peer as sender, signed with our key.
            _ => forged.clone()?,
        })
    }

    fn body(&self, id: &PacketId) -> Option<Vec<u8>> {
        let map = self.packets.lock().unwrap_or_else(PoisonError::into_inner);
        let (_, body, _, _) = map.get(id)?;
        // Never the body the header committed to.
        Some(body.iter().rev().copied().collect())
    }
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = arg(&args, "--data-dir").context("--data-dir")?;
    let config = NodeConfig {
        network: arg(&args, "--network").unwrap_or_else(|| "kindred".into()),
        round_secs: arg(&args, "--round-secs").map_or(Ok(2.0), |s| s.parse())?,
        discovery_every: arg(&args, "--discovery-every").map_or(Ok(10), |s| s.parse())?,
        trainer: TrainerConfig {
            label_shift: arg(&args, "--label-shift").map_or(Ok(0), |s| s.parse())?,
            ..TrainerConfig::default()
        },
        ..NodeConfig::default()
    };
    let listen = arg(&args, "--listen").context("--listen")?;
    let bootstrap = arg(&args, "--bootstrap").context("--bootstrap")?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let store = Store::open(&std::path::Path::new(&dir).join("store"))?;
        let mut engine = Engine::open(store, &config)?;
        let poison = Arc::new(PoisonStore::default());
        let mut rc = RoutingConfig::new(NetworkId::from_name(&config.network));
        rc.transport.listen = vec![listen.parse()?];
        rc.transport.listen_addrs_are_external = true;
        rc.core.discovery.every_rounds = config.discovery_every;
        let keypair = libp2p::identity::Keypair::from(engine.keypair().clone());
        let (routing, _events) = spawn(keypair, rc, poison.clone()).await?;
        // The bootstrap peer is the victim whose identity forged headers claim.
        let victim = routing
            .dial(bootstrap.parse()?)
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let _ = routing.bootstrap().await;
        println!("{}", engine.peer_id());

        let t_ms = (config.round_secs * 1000.0) as u64;
        let stop = tokio::time::Instant::now() + Duration::from_secs(600);
        let mut mode = 0u8;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        while tokio::time::Instant::now() < stop {
            let now = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64;
            let round = now / t_ms + 1;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(round * t_ms - now)) => {}
                _ = term.recv() => break,
            }
            let out = engine.make_packet(round, round * t_ms)?;
            let mut claimed = out.packet.header.header().clone();
            claimed.sender = victim;
            let forged = kindred_proto::encode_header(&claimed, engine.keypair());
            poison
                .packets
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(
                    out.packet.id(),
                    (
                        out.packet.header_bytes.clone(),
                        out.packet.body_bytes.clone(),
                        mode,
                        Some(forged),
                    ),
                );
            mode = mode.wrapping_add(1);
            let _ = routing.announce(out.packet.header.clone()).await;
        }
        routing.shutdown().await;
        Ok(())
    })
}
