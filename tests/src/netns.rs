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
//! link (nftables `numgen`). Delay needs `tc netem`, which not every kernel has: none here.

use std::path::Path;
use std::process::Command;

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
        run(
            "ip",
            &[
                "-n", &router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
                "netns", &host,
            ],
        )?;
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
        for ns in self.namespaces.iter().rev() {
            let _ = run("ip", &["netns", "del", ns]);
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
