//! `LocalCluster`: a whole Tether cluster in one process — M shard servers and N workers talking over loopback QUIC
//! with mutual TLS and freshly generated certificates — run to completion, returning the run report. It is what the
//! quickstart and the end-to-end tests run, and how an application embeds Tether.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::info;

use tether_common::config::{Config, Schedule};
use tether_common::net::TlsFiles;
use tether_common::report::RunReport;
use tether_server::actor::{GetPublic, GetWeights};
use tether_server::node::{start_shard, RunningShard, ShardOptions};
use tether_server::shard::ShardStats;
use tether_worker::data::load_configured;
use tether_worker::model;
use tether_worker::step::GradientFault;
use tether_worker::{
    prepare_worker, ModelFactory, Progress, Straggle, WorkerOptions, WorkerReport,
};

/// Errors running a local cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Bad configuration.
    #[error(transparent)]
    Config(#[from] tether_common::config::ConfigError),
    /// Data could not be loaded.
    #[error(transparent)]
    Data(#[from] tether_worker::data::DataError),
    /// Certificates could not be generated.
    #[error(transparent)]
    Pki(#[from] tether_common::pki::PkiError),
    /// TLS files could not be loaded.
    #[error(transparent)]
    Net(#[from] tether_common::net::NetError),
    /// A shard failed.
    #[error(transparent)]
    Server(#[from] tether_server::Error),
    /// A worker failed.
    #[error("worker {rank}: {source}")]
    Worker {
        /// Its rank.
        rank: u32,
        /// The cause.
        source: tether_worker::WorkerError,
    },
    /// A task panicked or the runtime could not start.
    #[error("runtime: {0}")]
    Runtime(String),
    /// I/O on the work directory.
    #[error("work directory {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// A shard's newest public-copy cut and its values at the end of a run (`None` without delta pulls).
pub type ShardPublic = Option<(tether_common::protocol::PublicRef, Vec<f32>)>;

/// Runs `fut` to completion on a fresh actix System over a 2-thread tokio runtime (what workers and shards need).
pub fn block_on_system<F: std::future::Future>(fut: F) -> F::Output {
    let rt = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("cannot build a tokio runtime") // only fails when the OS refuses threads
    };
    actix_rt::System::with_tokio_rt(rt).block_on(fut)
}

/// A cluster of `config.cluster.servers.len()` shards and `config.cluster.workers` workers in this process.
pub struct LocalCluster {
    /// The configuration; `cluster.servers` only sets the shard count (shards bind free loopback ports). A non-empty
    /// `cluster.standbys` gives every shard a standby and the cluster a witness, on free loopback ports too (the
    /// addresses given are replaced).
    pub config: Config,
    /// Where certificates and checkpoints go.
    pub work_dir: PathBuf,
    /// Progress events of every worker.
    pub progress: Option<mpsc::UnboundedSender<Progress>>,
    /// Gradient faults to inject, per worker rank.
    pub faults: Vec<(u32, GradientFault)>,
    /// Extra per-step delay per worker rank (stragglers).
    pub delays: Vec<(u32, Duration)>,
    /// Straggler emulation per worker rank.
    pub straggle: Vec<(u32, Straggle)>,
    /// Relative factor of the shards' gradient-norm guard, overriding `guard.factor` (0 = off; `None`: the
    /// configured one).
    pub spike_factor: Option<f32>,
    /// Evaluate every `train.eval_every` steps on rank 0 (the final accuracy is always measured).
    pub eval_during_training: bool,
    /// A user model to train instead of the built-in one `[model]` describes.
    pub model: Option<ModelFactory>,
    /// Kill shard K's primary this long after the workers start (a crash without a checkpoint), so that its standby
    /// takes over; needs `cluster.standbys`.
    pub kill_primaries: Vec<(u32, Duration)>,
}

/// Configuration for `shards` shards on loopback (ports are chosen when binding).
pub fn loopback_servers(shards: usize) -> Vec<String> {
    (0..shards).map(|_| "127.0.0.1:0".to_string()).collect()
}

impl LocalCluster {
    /// A cluster for `config` working in `work_dir`.
    pub fn new(config: Config, work_dir: PathBuf) -> Self {
        Self {
            config,
            work_dir,
            progress: None,
            faults: Vec::new(),
            delays: Vec::new(),
            straggle: Vec::new(),
            spike_factor: None,
            eval_during_training: true,
            model: None,
            kill_primaries: Vec::new(),
        }
    }

    /// Runs to completion on a fresh actix System over a multi-threaded tokio runtime.
    pub fn run(self) -> Result<RunReport, ClusterError> {
        self.run_with_workers().map(|(report, _, _)| report)
    }

    /// As [`LocalCluster::run`], also returning every worker's own report and each shard's final public copy.
    pub fn run_with_workers(
        self,
    ) -> Result<(RunReport, Vec<WorkerReport>, Vec<ShardPublic>), ClusterError> {
        block_on_system(self.run_in_system())
    }

    /// Runs to completion; call from inside an actix System whose tokio runtime is multi-threaded.
    pub async fn run_in_system(
        self,
    ) -> Result<(RunReport, Vec<WorkerReport>, Vec<ShardPublic>), ClusterError> {
        let mut cfg = self.config.clone();
        let started = Instant::now();
        let cpu_started = tether_common::cpu::process_cpu_seconds();
        let (train, test, note) = load_configured(&mut cfg)?;
        if let Some(n) = &note {
            info!("{n}");
        }
        // A warmup-cosine schedule with `total = 0` spans the whole run: one update per worker step.
        let per_worker = train.len() / cfg.cluster.workers.max(1) as usize;
        let run_updates = cfg.worker_steps((per_worker / cfg.train.batch.max(1)).max(1) as u64)
            * u64::from(cfg.cluster.workers);
        if let Schedule::WarmupCosine {
            total: total @ 0, ..
        } = &mut cfg.optimizer.schedule
        {
            *total = run_updates;
        }
        let (train, test) = (Arc::new(train), Arc::new(test));
        let certs = self.work_dir.join("certs");
        let workers = cfg.cluster.workers;
        let shards_n = cfg.cluster.servers.len();
        let replicated = cfg.cluster.replicated();
        if !replicated && !self.kill_primaries.is_empty() {
            return Err(ClusterError::Runtime(
                "kill_primaries needs cluster.standbys: a killed shard without a standby ends the run".into(),
            ));
        }
        // A fresh authority for every run: the work directory's old certificates (if any) are replaced.
        if certs.exists() {
            std::fs::remove_dir_all(&certs).map_err(|source| tether_common::pki::PkiError::Io {
                path: certs.clone(),
                source,
            })?;
        }
        tether_common::pki::generate(
            &certs,
            &certs.join("ca"),
            &tether_common::pki::Plan {
                hosts: Vec::new(),
                servers: shards_n as u32,
                workers,
                shared_client: false,
                standbys: replicated,
                days: tether_common::pki::DEFAULT_DAYS,
            },
        )?;
        cfg.cluster.tls_dir = certs.clone();
        if cfg.checkpoint.dir.is_relative() {
            cfg.checkpoint.dir = self.work_dir.join(&cfg.checkpoint.dir);
        }
        let mut witness = None;
        if replicated {
            // Every node must know every other's address before any starts (a primary dials its standby and both
            // dial the witness), so the ports are reserved first: held together, then released together.
            let ports = reserve_udp_ports(2 * shards_n + 1).map_err(|source| ClusterError::Io {
                path: self.work_dir.clone(),
                source,
            })?;
            let addr = |p: u16| format!("127.0.0.1:{p}");
            cfg.cluster.servers = ports[..shards_n].iter().map(|&p| addr(p)).collect();
            cfg.cluster.standbys = ports[shards_n..2 * shards_n]
                .iter()
                .map(|&p| addr(p))
                .collect();
            cfg.cluster.witness = Some(addr(ports[2 * shards_n]));
            // A new cluster: votes a previous run in this work directory recorded name nodes that no longer exist.
            let state = self.work_dir.join("witness.json");
            forget_votes(&cfg, &state)?;
            witness = Some(
                tether_server::witness::start_witness(&cfg, None, None, state)
                    .await
                    .map_err(ClusterError::Server)?,
            );
        }
        let layout = self.model.as_ref().map(|f| f().layout().clone());
        let shard_opts = |k: usize, standby: bool| ShardOptions {
            shard: k as u32,
            // Unreplicated shards bind any free port; replicated ones the addresses reserved above.
            listen: (!replicated).then(|| "127.0.0.1:0".parse().expect("literal address")),
            resume: false,
            tls: None,
            metrics: None,
            spike_factor: self.spike_factor,
            layout: layout.clone(),
            // The bundle `generate` just wrote holds the shard's checkpoint key.
            checkpoint_key: None,
            standby,
            history: None,
        };
        let mut shards: Vec<ShardNodes> = Vec::with_capacity(shards_n);
        for k in 0..shards_n {
            let primary = start_shard(&cfg, shard_opts(k, false)).await?;
            let standby = match replicated {
                true => Some(start_shard(&cfg, shard_opts(k, true)).await?),
                false => None,
            };
            shards.push(ShardNodes {
                primary: Some(primary),
                standby,
            });
        }
        if replicated {
            // Each pair finds its roles (the designated primary leads once the fence grants it); workers that
            // arrive first would only be sent between the two nodes until then.
            let deadline =
                Instant::now() + Duration::from_millis(4 * cfg.cluster.failover_ms + 5_000);
            while shards.iter().any(|s| s.serving().is_following()) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // Workers dial the primaries (and find the standbys through `cluster.standbys`).
        let servers: Vec<SocketAddr> = shards
            .iter()
            .map(|s| s.primary.as_ref().unwrap_or(s.serving()).local_addr)
            .collect();
        cfg.cluster.servers = servers.iter().map(|a| a.to_string()).collect();
        let mut tasks = Vec::new();
        for rank in 0..workers {
            let opts = WorkerOptions {
                rank,
                config: cfg.clone(),
                servers: cfg.cluster.servers.clone(),
                server_names: vec!["localhost".to_string(); shards_n],
                tls: TlsFiles::for_worker(&certs, rank)?,
                train: train.clone(),
                share: None,
                test: (rank == 0 && self.eval_during_training)
                    .then(|| tether_worker::data::TestSet::Dense(test.clone())),
                progress: self.progress.clone(),
                faults: self
                    .faults
                    .iter()
                    .filter(|(r, _)| *r == rank)
                    .map(|(_, f)| *f)
                    .collect(),
                metrics: None,
                reconnect_deadline: Duration::from_secs(30),
                step_delay: self
                    .delays
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map(|(_, d)| *d)
                    .unwrap_or_default(),
                straggle: self
                    .straggle
                    .iter()
                    .find(|(r, _)| *r == rank)
                    .map(|(_, s)| *s),
                model: self.model.clone(),
                colocated: workers,
                history: None,
            };
            let prepared =
                prepare_worker(opts).map_err(|source| ClusterError::Worker { rank, source })?;
            tasks.push((rank, tokio::spawn(prepared.run())));
        }
        // Primaries to kill, in time order: the standby takes over while the workers run.
        let workers_started = Instant::now();
        let mut kills = self.kill_primaries.clone();
        kills.sort_by_key(|&(_, at)| at);
        let mut late_kills = Vec::new();
        for (k, at) in kills {
            tokio::time::sleep_until((workers_started + at).into()).await;
            let Some(slot) = shards.get_mut(k as usize) else {
                return Err(ClusterError::Runtime(format!(
                    "kill_primaries names shard {k}, but the cluster has {shards_n}"
                )));
            };
            let Some(primary) = slot.take_primary() else {
                continue;
            };
            if tasks.iter().all(|(_, t)| t.is_finished()) {
                late_kills.push(k);
            }
            info!(shard = k, "killing the primary");
            primary.kill();
        }
        let mut reports = Vec::with_capacity(tasks.len());
        let mut first_error = None;
        for (rank, t) in tasks {
            match t.await {
                Ok(Ok(r)) => reports.push(r),
                Ok(Err(source)) => {
                    first_error.get_or_insert(ClusterError::Worker { rank, source });
                }
                Err(e) => {
                    first_error
                        .get_or_insert(ClusterError::Runtime(format!("worker {rank} task: {e}")));
                }
            }
        }
        // Every worker's goodbye is handled once its last pushes are applied; wait for that (bounded).
        let deadline = Instant::now() + Duration::from_secs(15);
        for s in &shards {
            while Instant::now() < deadline {
                match s.serving().stats().await {
                    Ok((_, st, _)) if st.finished.len() >= workers as usize => break,
                    Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    Err(_) => break,
                }
            }
        }
        // Final model straight from the serving nodes, then the shards' counters.
        let mut params = Vec::new();
        for s in &shards {
            let (_, w) = s
                .serving()
                .actor
                .send(GetWeights)
                .await
                .map_err(|_| ClusterError::Runtime("shard gone".into()))?;
            params.extend_from_slice(&w);
        }
        let mut publics = Vec::with_capacity(shards.len());
        for s in &shards {
            publics.push(
                s.serving()
                    .actor
                    .send(GetPublic)
                    .await
                    .map_err(|_| ClusterError::Runtime("shard gone".into()))?,
            );
        }
        let mut shard_stats = Vec::with_capacity(shards.len());
        let mut took_over = Vec::new();
        for (k, s) in shards.into_iter().enumerate() {
            let (stats, standby_serves) = s.shutdown().await?;
            shard_stats.push(stats);
            if standby_serves {
                took_over.push(k);
            }
        }
        if let Some(w) = witness {
            w.shutdown();
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let eval_cfg = cfg.clone();
        let test_eval = test.clone();
        let factory = self.model.clone();
        let (accuracy, test_loss) = tokio::task::spawn_blocking(move || {
            let mut m = match factory {
                Some(f) => f(),
                None => {
                    let (f, c) = tether_common::layout::model_io(&eval_cfg)
                        .unwrap_or((test_eval.features, test_eval.classes));
                    match model::build(&eval_cfg.model, f, c) {
                        Ok(m) => m,
                        // A model file's model: its workers (Python) would have failed first; nothing to evaluate.
                        Err(_) => return (f32::NAN, f32::NAN),
                    }
                }
            };
            let acc = model::accuracy(m.as_mut(), &params, &test_eval.x, &test_eval.y, 1000);
            let loss = model::mean_loss(m.as_mut(), &params, &test_eval.x, &test_eval.y, 1000);
            (acc, loss)
        })
        .await
        .map_err(|e| ClusterError::Runtime(e.to_string()))?;
        let wall = started.elapsed().as_secs_f64();
        let mut report = build_report(&cfg, &reports, &shard_stats, wall, f64::from(accuracy));
        if let Some(f) = &self.model {
            report.model = "user model".to_string();
            report.params = f().layout().len() as u64;
        }
        if let Some(n) = note {
            report.notes.push(n);
        }
        for k in took_over {
            report.notes.push(format!(
                "shard {k}: its standby took over and served to the end"
            ));
        }
        report.notes.push(format!("final test loss {test_loss:.4}"));
        // The final point of the validation curve is the shards' final model (as `final_test_accuracy`).
        let steps = report.steps;
        report
            .val_loss_curve
            .push((steps, wall, f64::from(test_loss)));
        report.finish_val_loss(cfg.data.dataset.is_text());
        if let (Some(a), Some(b)) = (cpu_started, tether_common::cpu::process_cpu_seconds()) {
            report.process_cpu_seconds = b - a;
        }
        Ok((report, reports, publics))
    }
}

/// One shard's nodes in a local cluster: its primary (until killed) and, when replicated, its standby.
struct ShardNodes {
    primary: Option<RunningShard>,
    standby: Option<RunningShard>,
}

impl ShardNodes {
    /// The node that serves: the one that leads, else the primary (the standby once the primary is gone).
    fn serving(&self) -> &RunningShard {
        let nodes = || self.primary.iter().chain(self.standby.iter());
        nodes()
            .find(|n| !n.is_following())
            .or_else(|| nodes().next())
            // A shard always keeps one node: only a primary with a standby beside it is ever taken.
            .expect("a shard with no node")
    }

    /// Takes the primary out (to kill it) when a standby remains to take over.
    fn take_primary(&mut self) -> Option<RunningShard> {
        self.standby.as_ref()?;
        self.primary.take()
    }

    /// Stops every node; returns the serving node's counters (taken first, while the pair still agrees on it) and
    /// whether the standby took over (it leads: it no longer follows).
    async fn shutdown(self) -> Result<(ShardStats, bool), ClusterError> {
        let standby_leads = self.standby.as_ref().is_some_and(|s| !s.is_following());
        let (serving, other) = match standby_leads {
            true => (self.standby, self.primary),
            false => (self.primary, self.standby),
        };
        let mut stats = None;
        if let Some(n) = serving {
            stats = Some(n.shutdown(false).await?.1);
        }
        if let Some(n) = other {
            let (_, st) = n.shutdown(false).await?;
            stats.get_or_insert(st);
        }
        stats
            .map(|st| (st, standby_leads))
            .ok_or_else(|| ClusterError::Runtime("a shard with no node".into()))
    }
}

/// Binds `n` UDP sockets on 127.0.0.1 at once and returns their ports (free a moment ago, and distinct).
fn reserve_udp_ports(n: usize) -> std::io::Result<Vec<u16>> {
    let sockets = (0..n)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()?;
    sockets
        .iter()
        .map(|s| s.local_addr().map(|a| a.port()))
        .collect()
}

/// Removes the witness's and the nodes' recorded votes: a new local cluster starts with new certificates and new
/// nodes, so a previous run's votes in the same work directory would only hold it back.
fn forget_votes(cfg: &Config, witness_state: &std::path::Path) -> Result<(), ClusterError> {
    let mut files = vec![witness_state.to_path_buf()];
    for k in 0..cfg.cluster.servers.len() {
        let dir = cfg.checkpoint.dir.join(format!("shard-{k}"));
        files.push(dir.join("fence-primary.json"));
        files.push(dir.join("fence-standby.json"));
    }
    for path in files {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(ClusterError::Io { path, source }),
        }
    }
    Ok(())
}

/// Merges worker and shard reports into the run report.
pub fn build_report(
    cfg: &Config,
    workers: &[WorkerReport],
    shards: &[ShardStats],
    wall_seconds: f64,
    final_test_accuracy: f64,
) -> RunReport {
    let mut loss_curve: Vec<(u64, f64, f64)> = Vec::new();
    // Training loss over time: mean over workers of the loss of each worker's step k, stamped with the latest time.
    let max_steps = workers
        .iter()
        .map(|w| w.loss_curve.len())
        .max()
        .unwrap_or(0);
    for k in 0..max_steps {
        let pts: Vec<&(u64, f64, f64)> =
            workers.iter().filter_map(|w| w.loss_curve.get(k)).collect();
        let loss = pts.iter().map(|p| p.2).sum::<f64>() / pts.len() as f64;
        let secs = pts.iter().map(|p| p.1).fold(0.0, f64::max);
        let step = pts.iter().map(|p| p.0).sum::<u64>();
        loss_curve.push((step, secs, loss));
    }
    let mut hist = tether_server::clock::StalenessHistogram::default();
    for s in shards {
        hist.merge(&s.staleness);
    }
    let workers_n = workers.len() as u64;
    // The evaluating worker's curves, with its steps scaled to the cluster's.
    let eval_curve = |curve: fn(&WorkerReport) -> &Vec<(u64, f64, f64)>| -> Vec<(u64, f64, f64)> {
        workers
            .iter()
            .find(|w| !curve(w).is_empty())
            .map(|w| {
                curve(w)
                    .iter()
                    .map(|&(s, t, a)| (s * workers_n.max(1), t, a))
                    .collect()
            })
            .unwrap_or_default()
    };
    let accuracy_curve = eval_curve(|w| &w.accuracy_curve);
    // The last point of each is the worker's own final evaluation; the caller adds the shards' final model.
    let mut val_loss_curve = eval_curve(|w| &w.val_loss_curve);
    val_loss_curve.pop();
    let mut report = RunReport::for_config(cfg);
    report.set_rollbacks(tether_server::rollback::report_fields(
        shards
            .iter()
            .map(|s| (s.rollbacks.as_slice(), s.rollbacks_missed)),
    ));
    // The traffic is the workers' (what they pushed and pulled); the shards add their updates and clock leads.
    for w in workers {
        report.add_worker(&w.counters());
    }
    if let Some(w) = workers.iter().find(|w| !w.local_steps_reason.is_empty()) {
        report.notes.push(format!(
            "link-aware local steps, worker {}: {}",
            w.rank, w.local_steps_reason
        ));
    }
    for s in shards {
        report.add_shard(&s.counters());
    }
    report.set_staleness(hist.max(), hist.report_buckets());
    report.set_curves(loss_curve, accuracy_curve, val_loss_curve);
    report.wall_seconds = wall_seconds;
    report.final_test_accuracy = final_test_accuracy;
    report
}
