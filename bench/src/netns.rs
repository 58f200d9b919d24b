//! The link harness: a star of network namespaces joined by veth pairs to a bridge in a hub namespace, each node's
//! link shaped with `tc tbf` in both directions (egress on the node's end, ingress as egress on the hub's end).
//! This kernel has no netem, so no delay is added (the study says so). Every namespace and link is the harness's
//! own: created by [`Star::up`], deleted on drop; addresses are 10.203.0.0/24 inside those namespaces only. Needs
//! root.

use std::process::Command;

use anyhow::{bail, Context, Result};

/// A link rate: `None` is unshaped.
pub type Rate = Option<u64>;

/// `tc` rate text of `bits_per_s`.
fn tc_rate(bps: u64) -> String {
    format!("{}kbit", bps / 1000)
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Whether this kernel has the netem qdisc (it decides whether the harness can add delay).
pub fn has_netem() -> bool {
    std::path::Path::new("/sys/module/sch_netem").exists()
        || Command::new("modprobe")
            .args(["-n", "sch_netem"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
}

/// A star of `nodes` namespaces.
pub struct Star {
    tag: String,
    nodes: usize,
}

impl Star {
    /// Creates the hub and `nodes` node namespaces, each with its link shaped to `rate`.
    pub fn up(nodes: usize, rate: Rate) -> Result<Star> {
        if nodes == 0 || nodes > 200 {
            bail!("link harness: 1..=200 nodes");
        }
        let tag = format!("tb{}", std::process::id() % 100_000);
        let star = Star { tag, nodes: 0 };
        let mut star = star;
        let hub = star.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "set", "lo", "up"])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 0..nodes {
            let ns = star.node(i);
            ip(&["netns", "add", &ns])?;
            star.nodes = i + 1;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let (end, peer) = ("e0".to_string(), format!("h{i}"));
            ip(&[
                "link", "add", &end, "netns", &ns, "type", "veth", "peer", "name", &peer, "netns",
                &hub,
            ])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(i)),
                "dev",
                &end,
            ])?;
            ip(&["-n", &ns, "link", "set", &end, "up"])?;
            ip(&["-n", &hub, "link", "set", &peer, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &peer, "up"])?;
            if let Some(bps) = rate {
                // Bucket: 4 ms of traffic, at least 64 KiB (tbf needs ≥ one packet; QUIC datagrams are ≤ 1,500 B).
                let burst = format!("{}", (bps / 8 / 250).max(64 * 1024));
                for (netns, dev) in [(&ns, &end), (&hub, &peer)] {
                    let out = Command::new("ip")
                        .args([
                            "netns", "exec", netns, "tc", "qdisc", "add", "dev", dev, "root",
                            "tbf", "rate",
                        ])
                        .arg(tc_rate(bps))
                        .args(["burst", &burst, "latency", "50ms"])
                        .output()
                        .context("run tc")?;
                    if !out.status.success() {
                        bail!(
                            "tc on {netns}/{dev}: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                    }
                }
            }
        }
        Ok(star)
    }

    fn hub(&self) -> String {
        format!("{}h", self.tag)
    }

    fn node(&self, i: usize) -> String {
        format!("{}n{i}", self.tag)
    }

    /// Node `i`'s address.
    pub fn addr(i: usize) -> String {
        format!("10.203.0.{}", i + 1)
    }

    /// A command running `program` inside node `i`.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.node(i)]).arg(program);
        c
    }
}

impl Drop for Star {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.node(i)]);
        }
        let _ = ip(&["netns", "del", &self.hub()]);
    }
}
