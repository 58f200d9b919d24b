//! `tether-bench hosts`: a star of shaped namespace hosts ([`Star`]) held up while a command runs, for peers that
//! place their own processes (the PyTorch GPT through Tether's launcher, torchft's DiLoCo). The command runs in
//! the root namespace with the hosts named in its environment (`TETHER_HOSTS_NETNS`, `TETHER_HOSTS_ADDRS`: host
//! `i`'s namespace and address, comma-separated) and starts each process with `ip netns exec`. While it runs, every
//! host's link counters are sampled; the report gives bytes each way per host (on the wire: IP, UDP/TCP and TLS
//! included) and the largest burst, the most bytes a link carried in one direction within any one-second window.
//! The burst arithmetic is pure ([`burst`]); [`run`] does the I/O.

use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::netns::Star;
use crate::scale::ScaleError;

/// Environment variable naming each host's namespace, comma-separated, host 0 first.
pub const ENV_NETNS: &str = "TETHER_HOSTS_NETNS";
/// Environment variable naming each host's address, comma-separated, host 0 first.
pub const ENV_ADDRS: &str = "TETHER_HOSTS_ADDRS";

/// What to run on how many hosts.
#[derive(Debug, Clone)]
pub struct HostsSpec {
    /// Namespace hosts.
    pub hosts: usize,
    /// Every host's link, bits/s both ways (`None`: unshaped).
    pub rate_bps: Option<u64>,
    /// How often the link counters are read.
    pub sample: Duration,
    /// The command and its arguments.
    pub command: Vec<String>,
    /// The command is killed after this long.
    pub limit: Duration,
}

/// One host's link over the run, counted at the host's end.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HostLink {
    /// Bytes the host sent.
    pub sent: u64,
    /// Bytes the host received.
    pub received: u64,
    /// The most bytes it sent within any one-second window.
    pub burst_sent_1s: u64,
    /// The most bytes it received within any one-second window.
    pub burst_received_1s: u64,
}

/// The report of one hosts run.
#[derive(Debug, Clone, Serialize)]
pub struct HostsReport {
    /// Namespace hosts.
    pub hosts: usize,
    /// Every host's link, Mbit/s (`None`: unshaped).
    pub rate_mbit: Option<f64>,
    /// The command's exit status (`None`: killed by a signal or at the limit).
    pub exit: Option<i32>,
    /// Whether it was killed at the limit.
    pub timed_out: bool,
    /// Wall time of the command, seconds.
    pub seconds: f64,
    /// Counter samples taken.
    pub samples: usize,
    /// Per host, host 0 first.
    pub links: Vec<HostLink>,
    /// The command, as given.
    pub command: Vec<String>,
}

/// The most a cumulative counter grew within any `window` of the samples `(t, value)` (times ascending, values
/// non-decreasing): for each sample, its growth since the earliest sample at most `window` before it. Sampling at
/// intervals much shorter than the window keeps the error below one interval's bytes.
pub fn burst(samples: &[(Duration, u64)], window: Duration) -> u64 {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..samples.len() {
        while samples[hi].0.saturating_sub(samples[lo].0) > window {
            lo += 1;
        }
        best = best.max(samples[hi].1.saturating_sub(samples[lo].1));
    }
    best
}

/// Sums a host's counter samples into its [`HostLink`].
fn host_link(sent: &[(Duration, u64)], received: &[(Duration, u64)]) -> HostLink {
    let total = |s: &[(Duration, u64)]| match (s.first(), s.last()) {
        (Some(a), Some(b)) => b.1.saturating_sub(a.1),
        _ => 0,
    };
    let second = Duration::from_secs(1);
    HostLink {
        sent: total(sent),
        received: total(received),
        burst_sent_1s: burst(sent, second),
        burst_received_1s: burst(received, second),
    }
}

/// Brings up the star, runs the command with the hosts in its environment while sampling every link, and tears the
/// star down. The command's own output passes through.
pub fn run(spec: &HostsSpec) -> Result<HostsReport, ScaleError> {
    let Some((program, args)) = spec.command.split_first() else {
        return Err(ScaleError::Invalid("no command to run".into()));
    };
    if spec.hosts == 0 || spec.hosts > 200 {
        return Err(ScaleError::Invalid("--hosts: 1..=200".into()));
    }
    let star = Star::up(spec.hosts, spec.rate_bps)?;
    let names = star.namespaces()[1..].join(",");
    let addrs: Vec<String> = (0..spec.hosts).map(Star::addr).collect();
    let mut child = Command::new(program)
        .args(args)
        .env(ENV_NETNS, &names)
        .env(ENV_ADDRS, addrs.join(","))
        .spawn()
        .map_err(|source| ScaleError::Io {
            what: format!("cannot start {program}"),
            source,
        })?;
    let t0 = Instant::now();
    let mut sent: Vec<Vec<(Duration, u64)>> = vec![Vec::new(); spec.hosts];
    let mut received = sent.clone();
    let sample = |sent: &mut Vec<Vec<(Duration, u64)>>,
                  received: &mut Vec<Vec<(Duration, u64)>>| {
        let t = t0.elapsed();
        for i in 0..spec.hosts {
            // A host whose counters cannot be read this once keeps its last sample (the next read catches up).
            if let Ok((s, r)) = star.link_bytes(i) {
                sent[i].push((t, s));
                received[i].push((t, r));
            }
        }
    };
    sample(&mut sent, &mut received);
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) => {}
            Err(source) => {
                let _ = child.kill();
                return Err(ScaleError::Io {
                    what: "cannot wait for the command".into(),
                    source,
                });
            }
        }
        if t0.elapsed() > spec.limit {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(spec.sample);
        sample(&mut sent, &mut received);
    };
    sample(&mut sent, &mut received);
    let seconds = t0.elapsed().as_secs_f64();
    let samples = sent.first().map_or(0, Vec::len);
    drop(star);
    Ok(HostsReport {
        hosts: spec.hosts,
        rate_mbit: spec.rate_bps.map(|b| b as f64 / 1e6),
        exit: status.and_then(|s| s.code()),
        timed_out,
        seconds,
        samples,
        links: sent
            .iter()
            .zip(&received)
            .map(|(s, r)| host_link(s, r))
            .collect(),
        command: spec.command.clone(),
    })
}

impl HostsReport {
    /// A table of the links, one line per host.
    pub fn text(&self) -> String {
        let mut out = format!(
            "hosts: {} host(s) at {}, command {} after {:.1} s ({} samples)\n",
            self.hosts,
            self.rate_mbit
                .map_or("unshaped links".into(), |m| format!("{m} Mbit/s")),
            match (self.exit, self.timed_out) {
                (_, true) => "killed at the limit".to_string(),
                (Some(c), _) => format!("exited {c}"),
                (None, _) => "killed by a signal".to_string(),
            },
            self.seconds,
            self.samples
        );
        out.push_str("host  sent MB  received MB  burst sent MB/1s  burst received MB/1s\n");
        for (i, l) in self.links.iter().enumerate() {
            out.push_str(&format!(
                "{i:>4} {:>8.2} {:>12.2} {:>17.2} {:>21.2}\n",
                l.sent as f64 / 1e6,
                l.received as f64 / 1e6,
                l.burst_sent_1s as f64 / 1e6,
                l.burst_received_1s as f64 / 1e6
            ));
        }
        out
    }
}

/// Appends `report` (a hosts or a scale report) as one JSON line to `path`.
pub fn append_json(path: &std::path::Path, report: &impl Serialize) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let line = serde_json::to_string(report).map_err(std::io::Error::other)?;
    writeln!(f, "{line}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn the_burst_is_the_most_growth_within_the_window() {
        // 1 MB/s for 3 s, then 5 MB in 0.5 s, then idle.
        let mut s = Vec::new();
        let mut v = 0u64;
        for i in 0..=30 {
            s.push((ms(i * 100), v));
            v += 100_000;
        }
        for i in 31..=35 {
            v += 1_000_000;
            s.push((ms(i * 100), v));
        }
        for i in 36..=60 {
            s.push((ms(i * 100), v));
        }
        // The best window runs from 2.5 s (2.5 MB) to 3.5 s (8.1 MB): the burst's 5 MB, the step into it (0.1 MB)
        // and 0.5 s at 1 MB/s.
        assert_eq!(burst(&s, Duration::from_secs(1)), 5_600_000);
        // A window longer than the run is the whole growth.
        assert_eq!(burst(&s, Duration::from_secs(100)), v);
        // Nothing, or one sample, is no burst.
        assert_eq!(burst(&[], Duration::from_secs(1)), 0);
        assert_eq!(burst(&s[..1], Duration::from_secs(1)), 0);
    }

    #[test]
    fn a_host_link_sums_its_counters_from_the_first_sample() {
        // Samples further apart than the window show no burst between them: 3 → 4 kB took 1.5 s.
        let sent = [(ms(0), 1_000), (ms(500), 3_000), (ms(2_000), 4_000)];
        let received = [(ms(0), 50), (ms(500), 50), (ms(1_400), 1_050)];
        assert_eq!(
            host_link(&sent, &received),
            HostLink {
                sent: 3_000,
                received: 1_000,
                burst_sent_1s: 2_000,
                burst_received_1s: 1_000,
            }
        );
    }
}
