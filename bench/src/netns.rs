//! The link harness: a star of network namespaces joined by veth pairs to a bridge in a hub namespace, each node's
//! link shaped with `tc tbf` in both directions (egress on the node's end, ingress as egress on the hub's end), or
//! one namespace with its loopback shaped. This kernel has no netem, so no delay is added (the study says so).
//! Every namespace and link is the harness's own: created by [`Star::up`] / [`Loop::up`], deleted on drop (with
//! every rule inside); addresses are 10.203.0.0/24 inside those namespaces only. The nemesis cuts links between
//! two nodes, one way or both ([`Star::cut_one_way`], [`Star::cut`]) and heals them ([`Star::heal`]); pausing and
//! killing processes is the caller's (signals). Needs root and iptables.

use std::process::Command;

/// A harness command failed.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// `ip` or `tc` could not run, or refused.
    #[error("{command}: {reason}")]
    Command {
        /// What ran.
        command: String,
        /// Its stderr, or why it did not start.
        reason: String,
    },
    /// A request out of range.
    #[error("link harness: {0}")]
    Invalid(&'static str),
}

type Result<T> = std::result::Result<T, HarnessError>;

/// A link rate in bits/s: `None` is unshaped.
pub type Rate = Option<u64>;

/// Runs `program args`, turning a failure into a [`HarnessError`].
fn run(program: &str, args: &[&str]) -> Result<()> {
    let command = || format!("{program} {}", args.join(" "));
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| HarnessError::Command {
            command: command(),
            reason: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(HarnessError::Command {
            command: command(),
            reason: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args)
}

/// `tc qdisc add dev DEV root tbf` at `bps` inside namespace `ns`. Bucket: 4 ms of traffic, at least 64 KiB (tbf
/// needs at least one packet; QUIC datagrams are ≤ 1,500 B).
fn shape(ns: &str, dev: &str, bps: u64) -> Result<()> {
    let burst = (bps / 8 / 250).max(64 * 1024).to_string();
    let rate = format!("{}kbit", bps / 1000);
    #[rustfmt::skip]
    let args = [
        "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
        "rate", &rate, "burst", &burst, "latency", "50ms",
    ];
    run("ip", &args)
}

/// Whether this process runs as root (the harness needs it for namespaces and iptables).
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// Whether this kernel has the netem qdisc (it decides whether the harness could add delay).
pub fn has_netem() -> bool {
    std::path::Path::new("/sys/module/sch_netem").exists()
        || Command::new("modprobe")
            .args(["-n", "sch_netem"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
}

/// A namespace name unique to this process, `kind` and call (tests in one process build several harnesses at once).
fn tag(kind: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("t{kind}{}x{n}", std::process::id() % 100_000)
}

/// A star of `nodes` namespaces around a bridge.
pub struct Star {
    tag: String,
    nodes: usize,
}

impl Star {
    /// Creates the hub and `nodes` node namespaces, each with its link shaped to `rate`.
    pub fn up(nodes: usize, rate: Rate) -> Result<Star> {
        Star::up_links(&vec![(rate, rate); nodes])
    }

    /// Creates the hub and one node namespace per entry of `links`, node `i`'s link shaped to `links[i] = (up,
    /// down)`: `up` on the node's end (what it sends), `down` on the hub's end (what it receives).
    pub fn up_links(links: &[(Rate, Rate)]) -> Result<Star> {
        let nodes = links.len();
        if nodes == 0 || nodes > 200 {
            return Err(HarnessError::Invalid("1..=200 nodes"));
        }
        // From here on, drop deletes whatever was created.
        let mut star = Star {
            tag: tag("b"),
            nodes: 0,
        };
        let hub = star.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "set", "lo", "up"])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, &(up, down)) in links.iter().enumerate() {
            let ns = star.node(i);
            ip(&["netns", "add", &ns])?;
            star.nodes = i + 1;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let peer = format!("h{i}");
            #[rustfmt::skip]
            ip(&["link", "add", "e0", "netns", &ns, "type", "veth", "peer", "name", &peer, "netns", &hub])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", Self::addr(i)),
                "dev",
                "e0",
            ])?;
            ip(&["-n", &ns, "link", "set", "e0", "up"])?;
            ip(&["-n", &hub, "link", "set", &peer, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &peer, "up"])?;
            if let Some(bps) = up {
                shape(&ns, "e0", bps)?;
            }
            if let Some(bps) = down {
                shape(&hub, &peer, bps)?;
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

    /// Nemesis: node `to` stops hearing node `from` (a one-way cut; iptables inside `to`'s namespace). Healed by
    /// [`Star::heal`] or with the star.
    pub fn cut_one_way(&self, from: usize, to: usize) -> Result<()> {
        self.check(from)?;
        self.check(to)?;
        #[rustfmt::skip]
        let args = ["netns", "exec", &self.node(to), "iptables", "-A", "INPUT", "-s", &Self::addr(from), "-j", "DROP"];
        run("ip", &args)
    }

    /// Nemesis: cuts the link between nodes `a` and `b` both ways.
    pub fn cut(&self, a: usize, b: usize) -> Result<()> {
        self.cut_one_way(a, b)?;
        self.cut_one_way(b, a)
    }

    /// Nemesis: heals every cut (flushes every node's rules).
    pub fn heal(&self) -> Result<()> {
        for i in 0..self.nodes {
            run(
                "ip",
                &["netns", "exec", &self.node(i), "iptables", "-F", "INPUT"],
            )?;
        }
        Ok(())
    }

    fn check(&self, i: usize) -> Result<()> {
        if i < self.nodes {
            Ok(())
        } else {
            Err(HarnessError::Invalid("no such node"))
        }
    }

    /// Bytes node `i`'s end of its link sent and received so far (`ip -j -s link show e0` inside its namespace).
    pub fn link_bytes(&self, i: usize) -> Result<(u64, u64)> {
        self.check(i)?;
        let ns = self.node(i);
        let command = || format!("ip -n {ns} -j -s link show e0");
        let out = Command::new("ip")
            .args(["-n", &ns, "-j", "-s", "link", "show", "e0"])
            .output()
            .map_err(|e| HarnessError::Command {
                command: command(),
                reason: e.to_string(),
            })?;
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| HarnessError::Command {
                command: command(),
                reason: e.to_string(),
            })?;
        let stats = &v[0]["stats64"];
        Ok((
            stats["tx"]["bytes"].as_u64().unwrap_or(0),
            stats["rx"]["bytes"].as_u64().unwrap_or(0),
        ))
    }

    /// The namespaces this star holds (hub first).
    pub fn namespaces(&self) -> Vec<String> {
        std::iter::once(self.hub())
            .chain((0..self.nodes).map(|i| self.node(i)))
            .collect()
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

/// One namespace whose loopback is shaped to `rate`: every process inside shares that one bucket (a single-host
/// cluster behind one link). Deleted on drop.
pub struct Loop {
    name: String,
}

impl Loop {
    /// Creates it.
    pub fn up(rate: Rate) -> Result<Loop> {
        let name = tag("l");
        ip(&["netns", "add", &name])?;
        let l = Loop { name };
        ip(&["-n", &l.name, "link", "set", "lo", "up"])?;
        if let Some(bps) = rate {
            shape(&l.name, "lo", bps)?;
        }
        Ok(l)
    }

    /// A command running `program` inside.
    pub fn command(&self, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}
