//! Bring-up of a real cluster for the bench and the study: certificates, `cluster.toml`, `tether-server` child
//! processes (so that their CPU time is theirs: `getrusage(RUSAGE_CHILDREN)`), optionally inside network namespaces,
//! and in-process synthetic workers that run the real trainer (protocol, driver, codec) on a model whose gradient
//! costs a memcpy.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tether_common::layout::Layout;
use tether_worker::model::Model;

/// The sibling binary `name` of this executable (cargo puts every binary of a profile in one folder).
pub fn sibling(name: &str) -> Result<PathBuf> {
    let me = std::env::current_exe().context("current_exe")?;
    let p = me
        .parent()
        .context("executable without a folder")?
        .join(name);
    if !p.exists() {
        bail!(
            "{} not found (build it: cargo build --release -p tether-server -p tether-worker)",
            p.display()
        );
    }
    Ok(p)
}

/// CPU seconds (user + system) from `getrusage(who)`.
pub fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed struct we own; RUSAGE_SELF/CHILDREN are valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrusage(who, &mut u) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Hidden width of the `[64, H, 10]` MLP (digits' 64 features) closest to `params` parameters.
pub fn hidden_for(params: u64) -> u64 {
    (params.saturating_sub(10) / 75).max(1)
}

/// A free UDP port on `ip` (bound, read and released; another process could take it first, rarely).
pub fn free_port(ip: &str) -> Result<u16> {
    let s = std::net::UdpSocket::bind((ip, 0)).with_context(|| format!("bind {ip}:0"))?;
    Ok(s.local_addr()?.port())
}

/// The `[compression]` pull keys of pull `mode` (`delta` | `bf16` | `f32`); deltas use `delta_scheme`.
pub fn pull_lines(mode: &str, delta_scheme: &str) -> String {
    match mode {
        "f32" => "pull = \"full\"".into(),
        "bf16" => "pull = \"full\"\npull_bf16 = true".into(),
        _ => format!("pull = \"delta\"\npull_scheme = \"{delta_scheme}\""),
    }
}

/// The `[cluster]`…`[checkpoint]` text of a run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Shard addresses.
    pub servers: Vec<String>,
    /// Workers.
    pub workers: u32,
    /// `0`, `3`, … or `inf`.
    pub staleness: String,
    /// `[model]` lines (kind, hidden, seed).
    pub model: String,
    /// `[data]` lines.
    pub data: String,
    /// `[train]` lines.
    pub train: String,
    /// `[optimizer]` lines.
    pub optimizer: String,
    /// `[compression]` lines.
    pub compression: String,
}

impl RunConfig {
    /// The TOML text (certificates in `certs/` next to it, checkpoints effectively off).
    pub fn text(&self) -> String {
        let servers: Vec<String> = self.servers.iter().map(|a| format!("\"{a}\"")).collect();
        let staleness = if self.staleness == "inf" {
            "\"inf\"".to_string()
        } else {
            self.staleness.clone()
        };
        format!(
            "[cluster]\nservers = [{}]\nworkers = {}\nstaleness = {staleness}\nworker_timeout_ms = 20000\n\
             tls_dir = \"certs\"\n[model]\n{}\n[data]\n{}\n[train]\n{}\n[optimizer]\n{}\n[compression]\n{}\n\
             [checkpoint]\nevery_updates = 1000000000\nkeep = 1\n",
            servers.join(", "),
            self.workers,
            self.model,
            self.data,
            self.train,
            self.optimizer,
            self.compression
        )
    }
}

/// A spawned process with its log, killed on drop if still running.
pub struct Proc {
    /// The child.
    pub child: Child,
    /// Its log file.
    pub log: PathBuf,
}

impl Proc {
    /// Spawns `cmd` (already holding its program and arguments) with stdout and stderr into `log`.
    pub fn spawn(mut cmd: Command, log: PathBuf) -> Result<Proc> {
        let f = std::fs::File::create(&log).with_context(|| log.display().to_string())?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(f.try_clone()?)
            .stderr(f)
            .env(
                "RUST_LOG",
                std::env::var("TETHER_BENCH_LOG")
                    .unwrap_or_else(|_| "warn,tether_server=info".into()),
            )
            .spawn()
            .with_context(|| format!("spawn {cmd:?}"))?;
        Ok(Proc { child, log })
    }

    /// Waits (bounded) until the log contains `needle`; fails if the process dies first.
    pub fn wait_for(&mut self, needle: &str, limit: Duration) -> Result<()> {
        let end = Instant::now() + limit;
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if text.contains(needle) {
                return Ok(());
            }
            if let Some(st) = self.child.try_wait()? {
                bail!(
                    "{} exited ({st}) before {needle:?}:\n{}",
                    self.log.display(),
                    tail(&text, 2000)
                );
            }
            if Instant::now() > end {
                bail!(
                    "{}: no {needle:?} within {limit:?}:\n{}",
                    self.log.display(),
                    tail(&text, 2000)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits (bounded) for exit; kills it after `limit`. Returns whether it exited successfully in time.
    pub fn wait_exit(&mut self, limit: Duration) -> Result<bool> {
        let end = Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st.success());
            }
            if Instant::now() > end {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Ok(false);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The last `n` bytes of the log.
    pub fn log_tail(&self, n: usize) -> String {
        tail(&std::fs::read_to_string(&self.log).unwrap_or_default(), n)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let mut cut = s.len().saturating_sub(n);
    while !s.is_char_boundary(cut) {
        cut += 1;
    }
    s[cut..].to_string()
}

/// Writes certificates for `servers` shards (SANs `hosts`) and `workers` workers into `dir/certs`.
pub fn certificates(dir: &Path, hosts: &[String], servers: u32, workers: u32) -> Result<()> {
    let certs = dir.join("certs");
    tether_common::pki::generate(
        &certs,
        &certs.join("ca"),
        &tether_common::pki::Plan {
            hosts: hosts.to_vec(),
            servers,
            workers,
            shared_client: false,
            standbys: false,
            days: tether_common::pki::DEFAULT_DAYS,
        },
    )?;
    Ok(())
}

/// A model with a real layout whose "gradient" is a fixed noise vector (a memcpy): the bench measures the
/// parameter server, not the model.
pub struct Synthetic {
    layout: Layout,
    grad: Arc<Vec<f32>>,
    features: usize,
    classes: usize,
}

impl Synthetic {
    /// A factory of synthetic models over `layout` (one noise vector shared by every instance).
    pub fn factory(layout: Layout, features: usize, classes: usize) -> tether_worker::ModelFactory {
        let grad = Arc::new(tether_common::testing::noise(layout.len(), 0x5EED, 1e-3));
        Arc::new(move || {
            Box::new(Synthetic {
                layout: layout.clone(),
                grad: grad.clone(),
                features,
                classes,
            }) as Box<dyn Model>
        })
    }
}

impl Model for Synthetic {
    fn layout(&self) -> &Layout {
        &self.layout
    }
    fn classes(&self) -> usize {
        self.classes
    }
    fn features(&self) -> usize {
        self.features
    }
    fn loss_and_grad(&mut self, _params: &[f32], _x: &[f32], _y: &[u32], grad: &mut [f32]) -> f32 {
        grad.copy_from_slice(&self.grad);
        1.0
    }
    fn predict(&mut self, _params: &[f32], _x: &[f32], out: &mut [u32]) {
        out.fill(0);
    }
}
