//! Network namespaces for NAT tests: an "internet" bridge, hosts on it, and home networks behind
//! NAT routers (nftables), built with `ip` and `nft` and removed when the [`Topology`] drops,
//! a failed test included.
//!
//! Each router drops what arrives unasked on its WAN side (as home routers do: no reset, no
//! ICMP answer), so a hole punch's first packet, which meets a NAT with no mapping yet, leaves
//! no state behind. A cone router masquerades keeping the host's port (endpoint-independent
//! mapping: the port a peer observes is the port every peer can punch to); a symmetric one
//! picks a random port for every new destination (`masquerade fully-random`), so the port a
//! relay observes is useless to anyone else.
//!
//! [`Topology::with_wan_loss`] drops a share of the packets each way on every router's WAN
//! link (nftables `numgen`). [`Topology::with_home_delay`] delays every frame between a home
//! host and its router, each way: `tc netem` would do it in the kernel, but not every kernel
//! has it (this one has no `sch_netem`), so the link is two TAP devices, one in each namespace,
//! joined by a thread that holds each frame for the delay ([`DelayedLink`]). Frames keep their
//! order; a direction holding more than [`DelayedLink::MAX_QUEUED_BYTES`] drops what arrives
//! (tail drop, as a router's queue).

use std::collections::VecDeque;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How a router maps its home network's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    /// Endpoint-independent mapping, the host's port kept.
    Cone,
    /// A random port for every new destination.
    Symmetric,
}

/// A set of namespaces, all removed on drop.
#[derive(Debug)]
pub struct Topology {
    prefix: String,
    namespaces: Vec<String>,
    /// Percent of packets dropped each way on routers' WAN links.
    wan_loss: u8,
    /// Delay each way between a home host and its router (zero: a plain veth pair).
    home_delay: Duration,
    /// The delayed links' pumps, stopped before the namespaces are removed.
    links: Vec<DelayedLink>,
}

/// The "internet" prefix length (one /24 of TEST-NET-3).
const WAN_PREFIX: u8 = 24;

impl Topology {
    /// A new topology with an empty "internet" bridge, or why namespaces cannot be made here.
    ///
    /// # Errors
    /// The first `ip` command that failed (not root, no `ip`, no namespace support).
    pub fn new() -> Result<Self, String> {
        // Unique per process and per topology within it.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let prefix = format!("kn{}x{n}", std::process::id() % 100_000);
        let mut t = Self {
            prefix,
            namespaces: Vec::new(),
            wan_loss: 0,
            home_delay: Duration::ZERO,
            links: Vec::new(),
        };
        let inet = t.add_ns("inet")?;
        run("ip", &["-n", &inet, "link", "add", "br0", "type", "bridge"])?;
        run("ip", &["-n", &inet, "link", "set", "br0", "up"])?;
        Ok(t)
    }

    /// Routers made from now on drop `percent` of their WAN packets each way.
    #[must_use]
    pub fn with_wan_loss(mut self, percent: u8) -> Self {
        self.wan_loss = percent.min(100);
        self
    }

    /// Home hosts made from now on reach their router through a link that delays every frame
    /// by `delay` each way.
    #[must_use]
    pub fn with_home_delay(mut self, delay: Duration) -> Self {
        self.home_delay = delay;
        self
    }

    /// The full name of namespace `short`.
    pub fn ns(&self, short: &str) -> String {
        format!("{}{short}", self.prefix)
    }

    fn add_ns(&mut self, short: &str) -> Result<String, String> {
        let name = self.ns(short);
        // A namespace left by an earlier run of the same pid is removed first.
        let _ = run("ip", &["netns", "del", &name]);
        run("ip", &["netns", "add", &name])?;
        self.namespaces.push(name.clone());
        run("ip", &["-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// Plug namespace `ns` into the internet bridge as `wan0` with address `ip`.
    fn plug(&self, ns: &str, ip: &str) -> Result<(), String> {
        let inet = self.ns("inet");
        let port = format!("p{}", self.namespaces.len());
        run(
            "ip",
            &[
                "-n", &inet, "link", "add", &port, "type", "veth", "peer", "name", "wan0", "netns",
                ns,
            ],
        )?;
        run("ip", &["-n", &inet, "link", "set", &port, "master", "br0"])?;
        run("ip", &["-n", &inet, "link", "set", &port, "up"])?;
        run(
            "ip",
            &[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{ip}/{WAN_PREFIX}"),
                "dev",
                "wan0",
            ],
        )?;
        run("ip", &["-n", ns, "link", "set", "wan0", "up"])
    }

    /// A host `short` on the internet at `ip`; returns its namespace.
    ///
    /// # Errors
    /// The `ip` command that failed.
    pub fn public_host(&mut self, short: &str, ip: &str) -> Result<String, String> {
        let ns = self.add_ns(short)?;
        self.plug(&ns, ip)?;
        Ok(ns)
    }

    /// A host `short` at `home_ip` on its own /24, behind a router with WAN address `wan_ip`
    /// doing `nat`; returns the host's namespace.
    ///
    /// # Errors
    /// The `ip` or `nft` command that failed.
    pub fn home_host(
        &mut self,
        short: &str,
        wan_ip: &str,
        home_ip: &str,
        nat: Nat,
    ) -> Result<String, String> {
        let router = self.add_ns(&format!("{short}r"))?;
        self.plug(&router, wan_ip)?;
        let host = self.add_ns(short)?;
        let gateway = home_gateway(home_ip)?;
        if self.home_delay.is_zero() {
            run(
                "ip",
                &[
                    "-n", &router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
                    "netns", &host,
                ],
            )?;
        } else {
            let link = DelayedLink::new((&router, "lan0"), (&host, "eth0"), self.home_delay)?;
            self.links.push(link);
        }
        run(
            "ip",
            &[
                "-n",
                &router,
                "addr",
                "add",
                &format!("{gateway}/24"),
                "dev",
                "lan0",
            ],
        )?;
        run("ip", &["-n", &router, "link", "set", "lan0", "up"])?;
        run(
            "ip",
            &[
                "-n",
                &host,
                "addr",
                "add",
                &format!("{home_ip}/24"),
                "dev",
                "eth0",
            ],
        )?;
        run("ip", &["-n", &host, "link", "set", "eth0", "up"])?;
        run(
            "ip",
            &["-n", &host, "route", "add", "default", "via", &gateway],
        )?;
        run(
            "ip",
            &[
                "netns",
                "exec",
                &router,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
        )?;
        let masquerade = match nat {
            Nat::Cone => "masquerade",
            Nat::Symmetric => "masquerade fully-random",
        };
        let rules = format!(
            "table ip nat {{\n chain post {{\n  type nat hook postrouting priority 100;\n  \
             oifname \"wan0\" {masquerade}\n }}\n}}\n\
             table inet filter {{\n chain input {{\n  type filter hook input priority 0;\n  \
             iifname \"wan0\" ct state new drop\n }}\n \
             chain forward {{\n  type filter hook forward priority 0;\n  \
             iifname \"wan0\" ct state new drop\n }}\n}}\n"
        );
        let rules = if self.wan_loss > 0 {
            let loss = self.wan_loss;
            format!(
                "{rules}table inet loss {{\n chain pre {{\n  type filter hook prerouting priority \
                 -300;\n  iifname \"wan0\" numgen random mod 100 < {loss} drop\n }}\n \
                 chain post {{\n  type filter hook postrouting priority 300;\n  \
                 oifname \"wan0\" numgen random mod 100 < {loss} drop\n }}\n}}\n"
            )
        } else {
            rules
        };
        let file = std::env::temp_dir().join(format!("{router}.nft"));
        std::fs::write(&file, rules).map_err(|e| format!("{}: {e}", file.display()))?;
        let loaded = run(
            "ip",
            &["netns", "exec", &router, "nft", "-f", &path_str(&file)],
        );
        let _ = std::fs::remove_file(&file);
        loaded?;
        Ok(host)
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // The pumps first: a TAP device goes with its namespace.
        self.links.clear();
        for ns in self.namespaces.iter().rev() {
            let _ = run("ip", &["netns", "del", ns]);
        }
    }
}

/// An Ethernet link between two namespaces that delays every frame by a fixed time each way:
/// a TAP device in each, and one thread per direction that reads frames from one and writes
/// each to the other once it is `delay` old. Stopped (threads joined, devices closed) on drop.
#[derive(Debug)]
pub struct DelayedLink {
    stop: Arc<AtomicBool>,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

impl DelayedLink {
    /// Bytes a direction may hold in flight before it drops what arrives.
    pub const MAX_QUEUED_BYTES: usize = 8 << 20;

    /// A link between interface `a.1` in namespace `a.0` and `b.1` in `b.0`, both left down
    /// and without addresses (as `ip link add … type veth` leaves them).
    ///
    /// # Errors
    /// A namespace that cannot be entered or a TAP device that cannot be made.
    pub fn new(a: (&str, &str), b: (&str, &str), delay: Duration) -> Result<Self, String> {
        let tap_a = Arc::new(tap_in(a.0, a.1)?);
        let tap_b = Arc::new(tap_in(b.0, b.1)?);
        let stop = Arc::new(AtomicBool::new(false));
        let pumps = [(&tap_a, &tap_b), (&tap_b, &tap_a)]
            .into_iter()
            .map(|(from, to)| {
                let (from, to, stop) = (Arc::clone(from), Arc::clone(to), Arc::clone(&stop));
                std::thread::spawn(move || pump(&from, &to, delay, &stop))
            })
            .collect();
        Ok(Self { stop, pumps })
    }
}

impl Drop for DelayedLink {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for pump in self.pumps.drain(..) {
            let _ = pump.join();
        }
    }
}

/// A TAP device named `name` in namespace `ns` (made from a thread that entered it).
fn tap_in(ns: &str, name: &str) -> Result<tun::Device, String> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("setns {path}: {e}"))?;
            let mut config = tun::Configuration::default();
            config.tun_name(name).layer(tun::Layer::L2);
            config.platform_config(|p| {
                p.ensure_root_privileges(false);
            });
            tun::create(&config).map_err(|e| format!("TAP device {name} in {ns}: {e}"))
        })
        .join()
        .unwrap_or_else(|_| Err(format!("making TAP device {name} in {ns} panicked")))
    })
}

/// Frames from `from` to `to`, each held until it is `delay` old, until `stop`.
fn pump(from: &tun::Device, to: &tun::Device, delay: Duration, stop: &AtomicBool) {
    // How often an idle pump looks at `stop`.
    const IDLE: Duration = Duration::from_millis(100);
    let mut queue: VecDeque<(Instant, Vec<u8>)> = VecDeque::new();
    let mut queued = 0usize;
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        while let Some((due, frame)) = queue.front() {
            if *due > now {
                break;
            }
            // A frame the device cannot take is lost, as on a wire.
            let _ = to.send(frame);
            queued -= frame.len();
            queue.pop_front();
        }
        // A frame arriving meanwhile ends the wait early.
        let wait = queue
            .front()
            .map_or(IDLE, |(due, _)| due.saturating_duration_since(now));
        match from.recv_timeout(&mut buf, wait) {
            Ok(n) => {
                let frame = buf.get(..n).unwrap_or_default();
                if queued + n <= DelayedLink::MAX_QUEUED_BYTES {
                    queued += n;
                    queue.push_back((Instant::now() + delay, frame.to_vec()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // The device is gone (its namespace removed): nothing more to carry.
            Err(_) => return,
        }
    }
}

/// The router's address on `home_ip`'s /24: `.1`.
fn home_gateway(home_ip: &str) -> Result<String, String> {
    let ip: std::net::Ipv4Addr = home_ip.parse().map_err(|e| format!("{home_ip}: {e}"))?;
    let [a, b, c, _] = ip.octets();
    Ok(format!("{a}.{b}.{c}.1"))
}

fn path_str(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

/// Run `program args`, its failure as an error with what it printed.
fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Run `f` on a thread that has entered namespace `ns` (to reach a node's loopback API there).
///
/// # Panics
/// When the namespace cannot be entered.
pub fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let path = format!("/var/run/netns/{ns}");
            let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}
