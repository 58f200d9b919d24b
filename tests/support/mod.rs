//! Shared harness of the multi-process fault, hostile-input, load and metrics tests: builds the real
//! `tether-server` / `tether-worker` binaries once (the `test` profile, the very build `cargo test --workspace`
//! already made), lays out a cluster in a temp directory
//! (keygen certificates, `cluster.toml` on free loopback ports), and runs processes under guards that SIGKILL them
//! when the test ends, however it ends. Every wait is bounded in time. [`hostile`] is the hostile peer the attack
//! tests use.
#![allow(dead_code)] // each test binary uses a different subset of the harness

pub mod hostile;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Paths of the binaries under test.
pub struct Bins {
    /// `tether-server`.
    pub server: PathBuf,
    /// `tether-worker`.
    pub worker: PathBuf,
}

/// Builds `tether-server` and `tether-worker` once per test binary and returns their paths.
///
/// `cargo build --profile test --workspace --bins` selects the same packages and features as `cargo test
/// --workspace`, so under the README's test command it finds every unit fresh and only checks fingerprints; a release
/// build here used to compile the whole graph a second time (4 of the suite's 8 minutes on 2 cores). Run alone
/// (`cargo test --test faults`), it builds what is missing, so the binaries are never stale. Cargo holds no lock on
/// the target directory while tests run, so the nested build cannot wait on its parent.
pub fn bins() -> &'static Bins {
    static BINS: OnceLock<Bins> = OnceLock::new();
    BINS.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        // A clean environment: the variables `cargo test` sets for this process would otherwise change build-script
        // fingerprints and force a full rebuild of the release dependencies on every run.
        let mut cmd = Command::new(cargo);
        cmd.env_clear();
        for var in [
            "PATH",
            "HOME",
            "CARGO_HOME",
            "RUSTUP_HOME",
            "RUSTUP_TOOLCHAIN",
            "CARGO_TARGET_DIR",
            "RUSTFLAGS",
            "TMPDIR",
        ] {
            if let Some(v) = std::env::var_os(var) {
                cmd.env(var, v);
            }
        }
        let status = cmd
            .current_dir(&root)
            .args(["build", "--profile", "test", "--workspace", "--bins"])
            .status()
            .expect("cannot run cargo");
        assert!(status.success(), "building the binaries failed");
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let bins = Bins {
            server: target.join("debug/tether-server"),
            worker: target.join("debug/tether-worker"),
        };
        assert!(
            bins.server.exists() && bins.worker.exists(),
            "binaries missing under {}",
            target.display()
        );
        bins
    })
}

/// Serializes the heavy multi-process tests of one binary (the CI machine has two cores).
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

/// A free loopback UDP port (bound, then released: good enough on a test machine).
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A free loopback TCP address for a metrics endpoint.
pub fn free_tcp_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A child process killed (SIGKILL) and reaped when dropped.
pub struct Proc {
    /// What it is, for messages.
    pub name: String,
    /// The child.
    pub child: Option<Child>,
    /// Its combined log.
    pub log: PathBuf,
}

impl Proc {
    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("process already reaped").id()
    }

    /// Whether it is still running.
    pub fn alive(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().map(|s| s.is_none()).unwrap_or(false),
            None => false,
        }
    }

    /// Sends SIGTERM (graceful shutdown: final checkpoint and report).
    pub fn terminate(&self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
    }

    /// SIGKILL now and reap.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits up to `limit` for the process to exit; panics (with its log tail) when it does not or fails.
    pub fn wait_success(&mut self, limit: Duration) {
        self.wait_exit(limit, true)
    }

    /// Waits up to `limit` for the process to exit with a failure; panics when it does not or succeeds.
    pub fn wait_failure(&mut self, limit: Duration) {
        self.wait_exit(limit, false)
    }

    fn wait_exit(&mut self, limit: Duration, success: bool) {
        let deadline = Instant::now() + limit;
        let c = self.child.as_mut().expect("process already reaped");
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                assert!(
                    status.success() == success,
                    "{} exited with {status}; log tail:\n{}",
                    self.name,
                    self.log_tail(3000)
                );
                self.child = None;
                return;
            }
            if Instant::now() > deadline {
                let tail = self.log_tail(3000);
                self.kill9();
                panic!(
                    "{} did not finish within {limit:?}; log tail:\n{tail}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The last `n` bytes of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut cut = s.len().saturating_sub(n);
        while !s.is_char_boundary(cut) {
            cut += 1;
        }
        s[cut..].to_string()
    }

    /// Its whole log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Peak resident set (VmHWM) and current resident set (VmRSS) in KiB, from /proc.
    pub fn memory_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc status"))
        };
        (field("VmHWM:"), field("VmRSS:"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The knobs of a test cluster.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Shards.
    pub shards: usize,
    /// Workers.
    pub workers: u32,
    /// SSP bound (`"inf"` for async).
    pub staleness: String,
    /// Eviction timeout.
    pub worker_timeout_ms: u64,
    /// Model kind (`mlp` | `logreg`).
    pub model: String,
    /// MLP hidden sizes.
    pub hidden: Vec<usize>,
    /// Epochs.
    pub epochs: u32,
    /// Batch size.
    pub batch: usize,
    /// Checkpoint interval in updates.
    pub checkpoint_every: u64,
    /// Evaluation interval in steps (0 = only the final evaluation).
    pub eval_every: u64,
    /// Per-worker bundles from keygen (else only the shared development client bundle, `--dev-shared-client`).
    pub per_worker_certs: bool,
    /// `train.clip_norm` (None: the default).
    pub clip_norm: Option<f32>,
    /// Extra `[cluster]` lines (e.g. `quorum = 2`).
    pub cluster_extra: String,
    /// Replicated shards: a standby bundle and address per shard (`cluster.standbys`).
    pub standbys: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            shards: 2,
            workers: 2,
            staleness: "2".into(),
            worker_timeout_ms: 1500,
            model: "mlp".into(),
            hidden: vec![64],
            epochs: 20,
            batch: 64,
            checkpoint_every: 50,
            eval_every: 0,
            per_worker_certs: true,
            clip_norm: None,
            cluster_extra: String::new(),
            standbys: false,
        }
    }
}

/// A cluster laid out in a temp directory: certificates, `cluster.toml`, logs, reports, checkpoints.
pub struct Cluster {
    /// The temp directory (removed on drop).
    pub dir: tempfile::TempDir,
    /// The spec it was built from.
    pub spec: Spec,
    /// Shard addresses, index = shard.
    pub servers: Vec<SocketAddr>,
    /// Standby addresses, index = shard (empty without standbys).
    pub standbys: Vec<SocketAddr>,
    /// The witness's address (with standbys).
    pub witness: Option<SocketAddr>,
}

impl Cluster {
    /// Generates certificates and writes `cluster.toml` (shards on free loopback ports).
    pub fn new(spec: Spec) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let servers: Vec<SocketAddr> = (0..spec.shards)
            .map(|_| SocketAddr::from(([127, 0, 0, 1], free_udp_port())))
            .collect();
        let mut keygen = Command::new(&bins().server);
        keygen
            .args(["keygen", "--out"])
            .arg(dir.path().join("certs"))
            .args(["--servers", &spec.shards.to_string()]);
        if spec.standbys {
            keygen.arg("--standbys");
        }
        if spec.per_worker_certs {
            keygen.args(["--workers", &spec.workers.to_string()]);
        } else {
            keygen.arg("--dev-shared-client");
        }
        let out = keygen.output().unwrap();
        assert!(
            out.status.success(),
            "keygen failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let standbys = if spec.standbys {
            (0..spec.shards)
                .map(|_| SocketAddr::from(([127, 0, 0, 1], free_udp_port())))
                .collect()
        } else {
            Vec::new()
        };
        let witness = spec
            .standbys
            .then(|| SocketAddr::from(([127, 0, 0, 1], free_udp_port())));
        let c = Cluster {
            dir,
            spec,
            servers,
            standbys,
            witness,
        };
        c.write_config("cluster.toml", &c.servers.clone());
        c
    }

    /// Writes a config named `name` with these shard addresses (e.g. one pointing a worker at a proxy).
    pub fn write_config(&self, name: &str, servers: &[SocketAddr]) -> PathBuf {
        let s = &self.spec;
        let servers: Vec<String> = servers.iter().map(|a| format!("\"{a}\"")).collect();
        let staleness = if s.staleness == "inf" {
            "\"inf\"".to_string()
        } else {
            s.staleness.clone()
        };
        let hidden: Vec<String> = s.hidden.iter().map(|h| h.to_string()).collect();
        let standbys: Vec<String> = self.standbys.iter().map(|a| format!("\"{a}\"")).collect();
        let cluster_extra = if standbys.is_empty() {
            s.cluster_extra.clone()
        } else {
            format!(
                "{}standbys = [{}]\nwitness = \"{}\"\n",
                s.cluster_extra,
                standbys.join(", "),
                self.witness.map(|w| w.to_string()).unwrap_or_default()
            )
        };
        let text = format!(
            "[cluster]\nservers = [{}]\nworkers = {}\nstaleness = {staleness}\nworker_timeout_ms = {}\n{}\
             [model]\nkind = \"{}\"\nhidden = [{}]\nseed = 42\n\
             [data]\ndataset = \"digits\"\n\
             [train]\nepochs = {}\nbatch = {}\neval_every = {}\n{}\
             [optimizer]\nkind = \"adam\"\nlr = 0.003\n\
             schedule = {{ kind = \"warmup_cosine\", warmup = 20, total = {}, min_ratio = 0.02 }}\n\
             [checkpoint]\nevery_updates = {}\nkeep = 3\n",
            servers.join(", "),
            s.workers,
            s.worker_timeout_ms,
            cluster_extra,
            s.model,
            hidden.join(", "),
            s.epochs,
            s.batch,
            s.eval_every,
            s.clip_norm.map(|c| format!("clip_norm = {c}\n")).unwrap_or_default(),
            // The cosine reaches its floor at the end of the run, so the final accuracy is stable run to run.
            self.steps_per_worker() * u64::from(s.workers),
            s.checkpoint_every,
        );
        let path = self.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// A path inside the cluster directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Steps each worker runs (digits: 1,437 training samples split evenly).
    pub fn steps_per_worker(&self) -> u64 {
        let part = 1437 / self.spec.workers as usize;
        let batch = self.spec.batch.min(part.max(1));
        (part / batch).max(1) as u64 * u64::from(self.spec.epochs)
    }

    fn spawn(&self, name: String, bin: &Path, args: &[String]) -> Proc {
        let log = self.dir.path().join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(bin)
            .current_dir(self.dir.path())
            .args(args)
            .env(
                "RUST_LOG",
                std::env::var("TETHER_TEST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Proc {
            name,
            child: Some(child),
            log,
        }
    }

    /// Starts shard `k` with extra flags and waits (bounded) until it says it is listening.
    pub fn server(&self, k: usize, extra: &[&str]) -> Proc {
        let mut args = vec![
            "--config".into(),
            self.path("cluster.toml").display().to_string(),
            "--shard".into(),
            k.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = self.spawn(format!("server-{k}"), &bins().server, &args);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !p.log_text().contains("listening on") {
            assert!(p.alive(), "server {k} died at start:\n{}", p.log_tail(3000));
            assert!(
                Instant::now() < deadline,
                "server {k} did not start:\n{}",
                p.log_tail(3000)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    /// Starts shard `k`'s standby (`--standby`) with extra flags and waits (bounded) until it says it is listening.
    /// Starts the witness (the fence's third vote) and waits (bounded) until it listens.
    pub fn witness(&self) -> Proc {
        let args = vec![
            "witness".to_string(),
            "--config".into(),
            self.path("cluster.toml").display().to_string(),
        ];
        let mut p = self.spawn("witness".into(), &bins().server, &args);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !p.log_text().contains("witness listening on") {
            assert!(
                p.alive(),
                "the witness died at start:\n{}",
                p.log_tail(3000)
            );
            assert!(
                Instant::now() < deadline,
                "the witness did not start:\n{}",
                p.log_tail(3000)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    pub fn standby(&self, k: usize, extra: &[&str]) -> Proc {
        let mut args = vec![
            "--config".into(),
            self.path("cluster.toml").display().to_string(),
            "--shard".into(),
            k.to_string(),
            "--standby".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut p = self.spawn(format!("standby-{k}"), &bins().server, &args);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !p.log_text().contains("listening on") {
            assert!(
                p.alive(),
                "standby {k} died at start:\n{}",
                p.log_tail(3000)
            );
            assert!(
                Instant::now() < deadline,
                "standby {k} did not start:\n{}",
                p.log_tail(3000)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        p
    }

    /// Starts worker `rank` with extra flags (config `cluster.toml` unless `--config` is among them).
    pub fn worker(&self, rank: u32, extra: &[&str]) -> Proc {
        let mut args: Vec<String> = Vec::new();
        if !extra.contains(&"--config") {
            args.extend([
                "--config".into(),
                self.path("cluster.toml").display().to_string(),
            ]);
        }
        args.extend(["--rank".into(), rank.to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let n = (0..)
            .find(|i| !self.path(&format!("worker-{rank}-{i}.log")).exists())
            .unwrap();
        self.spawn(format!("worker-{rank}-{n}"), &bins().worker, &args)
    }

    /// Starts every shard with `--exit-after-workers N --report server-K.json` plus `extra`.
    pub fn servers(&self, extra: &[&str]) -> Vec<Proc> {
        (0..self.spec.shards)
            .map(|k| {
                let report = format!("server-{k}.json");
                let n = self.spec.workers.to_string();
                let mut args = vec!["--exit-after-workers", &n, "--report", &report];
                args.extend_from_slice(extra);
                self.server(k, &args)
            })
            .collect()
    }

    /// Reads a JSON report written in the cluster directory.
    pub fn report(&self, name: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(self.path(name))
            .unwrap_or_else(|e| panic!("report {name}: {e}"));
        serde_json::from_str(&text).unwrap()
    }

    /// Checkpoint versions present for shard `k`, ascending.
    pub fn checkpoint_versions(&self, k: usize) -> Vec<u64> {
        let dir = self.path(&format!("ckpt/shard-{k}"));
        let mut v: Vec<u64> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.strip_prefix('v')?.parse().ok())
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort_unstable();
        v
    }
}

/// Runs an undisturbed cluster (every shard, every worker; rank 0 reports) and returns rank 0's report.
pub fn run_undisturbed(
    spec: &Spec,
    worker_extra: &[&str],
) -> (serde_json::Value, Vec<serde_json::Value>) {
    let c = Cluster::new(spec.clone());
    let mut servers = c.servers(&[]);
    let mut workers: Vec<Proc> = (0..spec.workers)
        .map(|r| {
            let report = format!("w{r}.json");
            let mut args = vec!["--report", report.as_str()];
            args.extend_from_slice(worker_extra);
            c.worker(r, &args)
        })
        .collect();
    for w in &mut workers {
        w.wait_success(Duration::from_secs(120));
    }
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let shards = (0..spec.shards)
        .map(|k| c.report(&format!("server-{k}.json")))
        .collect();
    (c.report("w0.json"), shards)
}

/// A JSON field as f64 (panics with the field name when absent).
pub fn num(v: &serde_json::Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("report has no number {key}: {v}"))
}

/// Largest gap in seconds between consecutive entries of a report's `loss_curve` ([step, seconds, loss]).
pub fn max_step_gap(report: &serde_json::Value) -> f64 {
    let curve = report["loss_curve"].as_array().expect("loss_curve");
    let times: Vec<f64> = curve.iter().map(|p| p[1].as_f64().unwrap()).collect();
    times.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max)
}

/// HTTP GET `path` on a loopback TCP address; returns the body (bounded in time).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok(body)
}

/// The value of a Prometheus sample line `name{labels} value` (exact name+labels match), if present.
pub fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(name_and_labels)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A UDP relay between one client and one upstream address on loopback that can drop every packet (both ways)
/// while `cut` is set: a network partition of one link, healed by clearing the flag.
pub struct UdpProxy {
    /// The address clients should use instead of the upstream.
    pub addr: SocketAddr,
    /// While true, every packet is dropped.
    pub cut: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Packets dropped so far.
    pub dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl UdpProxy {
    /// Starts relaying to `upstream` on a background thread with its own tokio runtime.
    pub fn start(upstream: SocketAddr) -> UdpProxy {
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        use std::sync::Arc;
        let front = UdpSocket::bind("127.0.0.1:0").unwrap();
        let back = UdpSocket::bind("127.0.0.1:0").unwrap();
        back.connect(upstream).unwrap();
        front.set_nonblocking(true).unwrap();
        back.set_nonblocking(true).unwrap();
        let addr = front.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (cut2, dropped2, stop2) = (cut.clone(), dropped.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let front = tokio::net::UdpSocket::from_std(front).unwrap();
                let back = tokio::net::UdpSocket::from_std(back).unwrap();
                let mut client: Option<SocketAddr> = None;
                let mut a = vec![0u8; 65536];
                let mut b = vec![0u8; 65536];
                let mut tick = tokio::time::interval(Duration::from_millis(50));
                while !stop2.load(Ordering::Relaxed) {
                    tokio::select! {
                        r = front.recv_from(&mut a) => {
                            let Ok((n, from)) = r else { continue };
                            client = Some(from);
                            if cut2.load(Ordering::Relaxed) {
                                dropped2.fetch_add(1, Ordering::Relaxed);
                            } else {
                                let _ = back.send(&a[..n]).await;
                            }
                        }
                        r = back.recv(&mut b) => {
                            let Ok(n) = r else { continue };
                            match client {
                                Some(c) if !cut2.load(Ordering::Relaxed) => { let _ = front.send_to(&b[..n], c).await; }
                                _ => { dropped2.fetch_add(1, Ordering::Relaxed); }
                            }
                        }
                        _ = tick.tick() => {}
                    }
                }
            });
        });
        UdpProxy {
            addr,
            cut,
            dropped,
            stop,
            thread: Some(thread),
        }
    }

    /// Drops (true) or relays (false) every packet from now on.
    pub fn set_cut(&self, cut: bool) {
        self.cut.store(cut, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for UdpProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Cluster {
    /// With `TETHER_TEST_KEEP_LOGS=DIR`, every process log of the cluster is copied to DIR before the temp
    /// directory goes (to read why a real-process test failed).
    fn drop(&mut self) {
        let Some(keep) = std::env::var_os("TETHER_TEST_KEEP_LOGS") else {
            return;
        };
        let keep = PathBuf::from(keep);
        let _ = std::fs::create_dir_all(&keep);
        if let Ok(entries) = std::fs::read_dir(self.dir.path()) {
            for e in entries.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(&p, keep.join(e.file_name()));
                }
            }
        }
    }
}
