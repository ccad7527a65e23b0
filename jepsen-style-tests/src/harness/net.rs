//! Network namespaces for the log nodes, so that partitions are real: each node gets its own
//! namespace, a veth pair onto a bridge in the root namespace, and its own address
//! (10.77.K.i+1). Gateways, decoders and the harness stay in the root namespace (the bridge
//! address .254), as clients do in Jepsen; partitions cut only node-to-node traffic, with
//! iptables DROP rules inside the namespaces. Everything is removed on drop (including the one
//! FORWARD rule added in the root namespace for the bridge). Needs root, iproute2 and iptables.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Context, Result};

static NEXT: AtomicU32 = AtomicU32::new(0);

pub struct Netns {
    /// Short unique tag of this run's devices and namespaces.
    tag: String,
    pub ns: Vec<String>,
    pub ips: Vec<String>,
    bridge: String,
}

fn sh(args: &[&str]) -> Result<()> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("running {}", args[0]))?;
    if !out.status.success() {
        bail!(
            "`{}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl Netns {
    /// Creates `n` namespaces on a fresh bridge.
    pub fn create(n: usize) -> Result<Netns> {
        let k = (std::process::id() * 7 + NEXT.fetch_add(1, Ordering::Relaxed) * 13) % 250 + 1;
        let tag = format!("tl{k}");
        let bridge = format!("{tag}b");
        let mut me = Netns {
            tag: tag.clone(),
            ns: vec![],
            ips: vec![],
            bridge: bridge.clone(),
        };
        // Leftovers of a killed earlier run with the same tag.
        me.teardown();
        sh(&["ip", "link", "add", &bridge, "type", "bridge"])?;
        sh(&["ip", "addr", "add", &format!("10.77.{k}.254/24"), "dev", &bridge])?;
        sh(&["ip", "link", "set", &bridge, "up"])?;
        // With br_netfilter on (Docker hosts), bridged frames go through the root namespace's
        // FORWARD chain, whose policy Docker sets to DROP: let this bridge's own traffic pass.
        sh(&[
            "iptables", "-I", "FORWARD", "-i", &bridge, "-o", &bridge, "-j", "ACCEPT",
        ])?;
        for i in 0..n {
            let ns = format!("{tag}n{i}");
            let (host, peer) = (format!("{tag}h{i}"), format!("{tag}p{i}"));
            let ip = format!("10.77.{k}.{}", i + 1);
            sh(&["ip", "netns", "add", &ns])?;
            me.ns.push(ns.clone());
            sh(&["ip", "link", "add", &host, "type", "veth", "peer", "name", &peer])?;
            sh(&["ip", "link", "set", &peer, "netns", &ns])?;
            sh(&["ip", "link", "set", &host, "master", &bridge])?;
            sh(&["ip", "link", "set", &host, "up"])?;
            let ex = |args: &[&str]| {
                let mut v = vec!["ip", "netns", "exec", ns.as_str()];
                v.extend_from_slice(args);
                sh(&v)
            };
            ex(&["ip", "link", "set", "lo", "up"])?;
            ex(&["ip", "addr", "add", &format!("{ip}/24"), "dev", &peer])?;
            ex(&["ip", "link", "set", &peer, "up"])?;
            me.ips.push(ip);
        }
        Ok(me)
    }

    /// The command prefix that runs a program inside node `i`'s namespace.
    pub fn exec_prefix(&self, i: usize) -> Vec<String> {
        vec!["netns".into(), "exec".into(), self.ns[i].clone()]
    }

    /// Cuts traffic between nodes `a` and `b` (both directions).
    pub fn cut(&self, a: usize, b: usize) -> Result<()> {
        for (x, y) in [(a, b), (b, a)] {
            sh(&[
                "ip",
                "netns",
                "exec",
                &self.ns[x],
                "iptables",
                "-A",
                "INPUT",
                "-s",
                &self.ips[y],
                "-j",
                "DROP",
            ])?;
        }
        Ok(())
    }

    /// Removes every cut.
    pub fn heal(&self) -> Result<()> {
        for ns in &self.ns {
            sh(&["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"])?;
        }
        Ok(())
    }

    fn teardown(&mut self) {
        for i in 0..8 {
            let _ = sh(&["ip", "netns", "del", &format!("{}n{i}", self.tag)]);
        }
        while sh(&[
            "iptables",
            "-D",
            "FORWARD",
            "-i",
            &self.bridge,
            "-o",
            &self.bridge,
            "-j",
            "ACCEPT",
        ])
        .is_ok()
        {}
        let _ = sh(&["ip", "link", "del", &self.bridge]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Whether this machine can make namespaces (root, iproute2, iptables).
pub fn available() -> bool {
    let ok = |c: &str, a: &[&str]| Command::new(c).args(a).output().is_ok_and(|o| o.status.success());
    ok("ip", &["netns", "list"]) && ok("iptables", &["--version"]) && nix_root()
}

fn nix_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}
