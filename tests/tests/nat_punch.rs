//! Hole-punch success by NAT type, measured in network namespaces (root only; `--ignored`).
//!
//! A relay on the "internet" and home hosts behind cone and symmetric NATs
//! ([`kindred_tests::netns`]), on internet-like links (50 ms each way, 1% loss). For each pair
//! of NAT types, `TRIES` fresh pairs of routing nodes (new identities, a port each) run at
//! once: the listener holds a reservation with the relay, the dialer connects to the relay,
//! then dials the listener's circuit address; DCUtR then tries to open a direct connection. A try succeeds when the dialer holds a direct connection
//! to the listener within [`PUNCH_WAIT`]. The last line is one JSON object:
//! `{"tries":20,"cone_cone":{"direct":20,"median_ms":…},"cone_symmetric":…,"symmetric_symmetric":…}`.
//!
//! ```text
//! cargo test -p kindred-tests --test nat_punch -- --ignored --nocapture
//! ```
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use kindred_routing::{MemoryStore, NetworkId, RelayServerConfig, RoutingConfig, RoutingHandle};
use kindred_tests::netns::{Nat, Topology, in_netns};
use libp2p::identity::Keypair;
use libp2p::{Multiaddr, PeerId};

const TRIES: u16 = 20;
const PUNCH_WAIT: Duration = Duration::from_secs(20);
const RELAY_IP: &str = "203.0.113.10";

fn config(listen: Vec<Multiaddr>) -> RoutingConfig {
    let mut c = RoutingConfig::new(NetworkId::from_name("nat-punch"));
    c.transport.listen = listen;
    c.transport.listen_addrs_are_external = true;
    c
}

async fn spawn(config: RoutingConfig) -> RoutingHandle {
    let store = Arc::new(MemoryStore::default());
    kindred_routing::spawn(Keypair::generate_ed25519(), config, store)
        .await
        .unwrap()
        .0
}

/// Run `f` on a current-thread runtime inside namespace `ns`, on its own thread.
fn in_ns<T: Send + 'static>(
    ns: String,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    std::thread::spawn(move || {
        in_netns(&ns, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(f())
        })
    })
}

/// `TRIES` pairs from `dialer_ns` (at `dialer_ip`) to `listener_ns` (at `listener_ip`) through
/// the relay: the time each dialer took to a direct connection, or `None`.
fn punch_pairs(
    relay: &Multiaddr,
    (dialer_ns, dialer_ip): (&str, &str),
    (listener_ns, listener_ip): (&str, &str),
    base_port: u16,
) -> Vec<Option<Duration>> {
    let (ids_tx, ids_rx) = std_mpsc::channel::<Vec<PeerId>>();
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let relay_l = relay.clone();
    let ip = listener_ip.to_string();
    let listeners = in_ns(listener_ns.to_string(), move || {
        Box::pin(async move {
            let mut handles = Vec::new();
            for i in 0..TRIES {
                let port = base_port + i;
                let c = config(vec![
                    format!("/ip4/{ip}/tcp/{port}").parse().unwrap(),
                    format!("/ip4/{ip}/udp/{port}/quic-v1").parse().unwrap(),
                    relay_l
                        .clone()
                        .with(libp2p::multiaddr::Protocol::P2pCircuit),
                ]);
                handles.push(spawn(c).await);
            }
            ids_tx
                .send(handles.iter().map(RoutingHandle::peer_id).collect())
                .unwrap();
            let mut done = done_rx;
            let _ = done.wait_for(|d| *d).await;
            for h in &handles {
                h.shutdown().await;
            }
        })
    });
    let targets = ids_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let relay_d = relay.clone();
    let ip = dialer_ip.to_string();
    let dialers = in_ns(dialer_ns.to_string(), move || {
        Box::pin(async move {
            let mut tries = Vec::new();
            for (i, target) in targets.into_iter().enumerate() {
                let port = base_port + i as u16;
                let c = config(vec![
                    format!("/ip4/{ip}/tcp/{port}").parse().unwrap(),
                    format!("/ip4/{ip}/udp/{port}/quic-v1").parse().unwrap(),
                ]);
                let h = spawn(c).await;
                let relay = relay_d.clone();
                tries.push(async move {
                    h.dial(relay.clone()).await.unwrap();
                    // identify tells the dialer its address as the relay sees it: DCUtR's
                    // candidates.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    let circuit = relay
                        .with(libp2p::multiaddr::Protocol::P2pCircuit)
                        .with(libp2p::multiaddr::Protocol::P2p(target));
                    let start = Instant::now();
                    let _ = h.dial(circuit).await;
                    let mut took = None;
                    while start.elapsed() < PUNCH_WAIT {
                        if h.info().await.is_some_and(|i| i.direct.contains(&target)) {
                            took = Some(start.elapsed());
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    h.shutdown().await;
                    took
                });
            }
            futures::future::join_all(tries).await
        })
    });
    let results = dialers.join().unwrap();
    done_tx.send(true).unwrap();
    listeners.join().unwrap();
    results
}

fn summary(results: &[Option<Duration>]) -> String {
    let mut ms: Vec<u128> = results.iter().flatten().map(Duration::as_millis).collect();
    ms.sort_unstable();
    let median = ms
        .get(ms.len() / 2)
        .map_or("null".to_string(), ToString::to_string);
    format!("{{\"direct\":{},\"median_ms\":{median}}}", ms.len())
}

#[test]
#[ignore = "needs root for network namespaces; a measurement (about a minute)"]
fn hole_punch_success_by_nat_type() {
    // Internet-like links: 1% loss each way on every NAT's WAN link, 50 ms each way between a
    // home host and its router (a punch crosses two: 200 ms round trip).
    let mut topo = Topology::new()
        .unwrap()
        .with_wan_loss(1)
        .with_home_delay(Duration::from_millis(50));
    let public = topo.public_host("pub", RELAY_IP).unwrap();
    let cone_a = topo
        .home_host("ca", "203.0.113.21", "192.168.1.2", Nat::Cone)
        .unwrap();
    let cone_b = topo
        .home_host("cb", "203.0.113.22", "192.168.2.2", Nat::Cone)
        .unwrap();
    let sym_a = topo
        .home_host("sa", "203.0.113.23", "192.168.3.2", Nat::Symmetric)
        .unwrap();
    let sym_b = topo
        .home_host("sb", "203.0.113.24", "192.168.4.2", Nat::Symmetric)
        .unwrap();

    let (relay_tx, relay_rx) = std_mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let relay = in_ns(public.clone(), move || {
        Box::pin(async move {
            let mut c = config(vec![format!("/ip4/{RELAY_IP}/tcp/4001").parse().unwrap()]);
            c.transport.relay_server = Some(RelayServerConfig {
                max_reservations: 1024,
                max_reservations_per_peer: 4,
                max_circuits: 1024,
                max_circuits_per_peer: 8,
                ..RelayServerConfig::default()
            });
            let h = spawn(c).await;
            let addr = format!("/ip4/{RELAY_IP}/tcp/4001/p2p/{}", h.peer_id());
            relay_tx.send(addr.parse::<Multiaddr>().unwrap()).unwrap();
            let mut stop = stop_rx;
            let _ = stop.wait_for(|s| *s).await;
            h.shutdown().await;
        })
    });
    let relay_addr = relay_rx.recv_timeout(Duration::from_secs(30)).unwrap();

    let cases = [
        (
            "cone_cone",
            (&cone_a, "192.168.1.2"),
            (&cone_b, "192.168.2.2"),
            5000,
        ),
        (
            "cone_symmetric",
            (&cone_a, "192.168.1.2"),
            (&sym_a, "192.168.3.2"),
            5100,
        ),
        (
            "symmetric_symmetric",
            (&sym_a, "192.168.3.2"),
            (&sym_b, "192.168.4.2"),
            5200,
        ),
    ];
    let mut fields = vec![format!("\"tries\":{TRIES}")];
    for (name, (dns, dip), (lns, lip), port) in cases {
        let results = punch_pairs(&relay_addr, (dns, dip), (lns, lip), port);
        let line = summary(&results);
        println!("{name}: {line}");
        fields.push(format!("\"{name}\":{line}"));
    }
    stop_tx.send(true).unwrap();
    relay.join().unwrap();
    println!("{{{}}}", fields.join(","));
}
