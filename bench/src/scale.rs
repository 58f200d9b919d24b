//! Many-worker runs on the link harness: a real cluster of `tether-worker` and `tether-server` processes spread
//! over a star of network namespaces ("hosts", [`Star`]), each host behind its own shaped link, with standbys, the
//! witness and a quorum, training the quickstart's MLP with the quickstart's sync. A nemesis may SIGKILL a random
//! worker or shard node every period (started again 1 s later with the same flags) or cut one host off from every
//! other for a while. The run's [`ScaleReport`] gives round times and stalls (from the workers' histories and
//! reports), each shard node's CPU seconds and peak memory, every worker's peak memory (sampled from `/proc`), the
//! bytes each host's link carried each way, and rank 0's accuracy.
//!
//! The placement ([`Placement`]), the configuration text ([`config_text`]) and the summary ([`summarize`]) are pure;
//! [`run`] does the I/O: namespaces, certificates, processes, signals, sampling. Needs root (namespaces, iptables).
//! Every process is killed and every namespace deleted when the run ends, whatever happened.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tether_common::pki::{Authority, Node, Validity};
use tether_common::splitmix::SplitMix64;

use crate::netns::{HarnessError, Star};
use crate::stats::quantile;

/// A run on the namespace bed (a many-worker run, or a command held on the star) failed to start or to collect
/// its results.
#[derive(Debug, thiserror::Error)]
pub enum ScaleError {
    /// The namespaces or links could not be set up or read.
    #[error(transparent)]
    Harness(#[from] HarnessError),
    /// A file or process operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Certificates could not be issued.
    #[error("certificates: {0}")]
    Pki(String),
    /// The request is inconsistent.
    #[error("scale run: {0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, ScaleError>;

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ScaleError {
    let what = what.into();
    move |source| ScaleError::Io { what, source }
}

/// What the nemesis does during a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Nemesis {
    /// Nothing.
    None,
    /// Every `every_s` seconds, SIGKILL one random process among workers 1.. and the shard nodes (primaries and
    /// standbys); it is started again 1 s later with the same flags.
    Kill {
        /// Period in seconds.
        every_s: f64,
    },
    /// At `at_s` seconds, cut host `host` off from every other host (both ways) for `for_s` seconds.
    Cut {
        /// The host cut off.
        host: usize,
        /// When, seconds after the workers start.
        at_s: f64,
        /// How long.
        for_s: f64,
    },
}

/// One many-worker run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleSpec {
    /// Namespace hosts (at least 2: standbys live on another host than their primary).
    pub hosts: usize,
    /// Worker processes.
    pub workers: u32,
    /// Shards (one primary each, and a standby each when `standbys`).
    pub shards: u32,
    /// Whether every shard has a standby (and the witness runs).
    pub standbys: bool,
    /// Every host's link rate in bits/s, both ways (`None`: unshaped).
    pub rate_bps: Option<u64>,
    /// The nemesis.
    pub nemesis: Nemesis,
    /// Epochs over the training set (each worker walks its share this many times).
    pub epochs: u32,
    /// Per-worker batch.
    pub batch: usize,
    /// Inner steps per round (the quickstart's 16).
    pub local_steps: u32,
    /// The inner Adam step's learning rate (the quickstart's 1e-3).
    #[serde(default = "since::lr")]
    pub lr: f64,
    /// The push and pull codec: `topk2` (the quickstart's, bucket 4096, keep 16) or `q4`.
    #[serde(default = "since::scheme")]
    pub scheme: String,
    /// The pull codec (`compression.pull_scheme`), `topk2` or `q4`; `None`: `scheme`'s, as the quickstart (and
    /// every report written before the field existed).
    #[serde(default)]
    pub pull_scheme: Option<String>,
    /// `cluster.staleness`: 0 (BSP rounds, the quickstart's) or more rounds a worker may run ahead of the gate.
    #[serde(default)]
    pub staleness: u32,
    /// topk2's kept values per 4,096-value bucket (`compression.keep`, the quickstart's 16).
    #[serde(default = "since::keep")]
    pub keep: u32,
    /// The inner optimizer (`optimizer.kind`): `adam` (the quickstart's), `sgd`, `momentum` or `nesterov`.
    #[serde(default = "since::inner")]
    pub inner: String,
    /// Adam's β2 (`optimizer.beta2`, the product's default 0.999).
    #[serde(default = "since::beta2")]
    pub beta2: f64,
    /// Adam's ε (`optimizer.eps`, the product's default 1e-8).
    #[serde(default = "since::eps")]
    pub eps: f64,
    /// `optimizer.outer.lr` (the quickstart's 1.4).
    #[serde(default = "since::outer_lr")]
    pub outer_lr: f64,
    /// `optimizer.outer.momentum` (the quickstart's 0.5).
    #[serde(default = "since::outer_momentum")]
    pub outer_momentum: f64,
    /// `optimizer.outer.at_close`: one outer step per round when it closes (false: on every push, the default).
    #[serde(default)]
    pub at_close: bool,
    /// `cluster.quorum` (0: every live worker).
    pub quorum: u32,
    /// `fashion-mnist` or `digits`.
    pub dataset: String,
    /// `cluster.failover_ms`: how long a silent link or an unrenewed lease lasts (the default is 1000).
    #[serde(default = "since::failover_ms")]
    pub failover_ms: u64,
    /// Seed of the nemesis's choices.
    pub seed: u64,
    /// `model.seed`: the initial weights (the product's default, 42).
    #[serde(default = "since::model_seed")]
    pub model_seed: u64,
    /// `train.seed`: data shuffling and stochastic rounding (the product's default, 7).
    #[serde(default = "since::train_seed")]
    pub train_seed: u64,
    /// Stop the run (killing everything) after this many seconds.
    pub limit_s: f64,
}

/// Defaults of the fields added after the first reports were written: what such a report reads for them (the
/// quickstart's).
mod since {
    /// The inner learning rate.
    pub(super) fn lr() -> f64 {
        1e-3
    }
    /// The push codec.
    pub(super) fn scheme() -> String {
        "topk2".into()
    }
    /// The lease and silent-link timeout.
    pub(super) fn failover_ms() -> u64 {
        1000
    }
    /// The outer learning rate.
    pub(super) fn outer_lr() -> f64 {
        1.4
    }
    /// The outer momentum.
    pub(super) fn outer_momentum() -> f64 {
        0.5
    }
    /// topk2's keep.
    pub(super) fn keep() -> u32 {
        16
    }
    /// The inner optimizer.
    pub(super) fn inner() -> String {
        "adam".into()
    }
    /// Adam's β2.
    pub(super) fn beta2() -> f64 {
        0.999
    }
    /// Adam's ε.
    pub(super) fn eps() -> f64 {
        1e-8
    }
    /// The initial weights' seed.
    pub(super) fn model_seed() -> u64 {
        42
    }
    /// The data order's seed.
    pub(super) fn train_seed() -> u64 {
        7
    }
}

impl ScaleSpec {
    /// The quickstart's sync at `workers` × `shards` on `hosts` hosts, with standbys and a quorum of 3/4 of the
    /// workers; the global batch is the quickstart's 4 × 128 = 512, so every worker takes `512 / workers` (at least
    /// 8) and a run walks the same samples per round as the quickstart.
    pub fn quickstart(hosts: usize, workers: u32, shards: u32) -> ScaleSpec {
        ScaleSpec {
            hosts,
            workers,
            shards,
            standbys: true,
            rate_bps: None,
            nemesis: Nemesis::None,
            epochs: 5,
            batch: (512 / workers.max(1) as usize).max(8),
            local_steps: 16,
            lr: 1e-3,
            scheme: "topk2".into(),
            pull_scheme: None,
            staleness: 0,
            keep: 16,
            inner: "adam".into(),
            beta2: 0.999,
            eps: 1e-8,
            outer_lr: 1.4,
            outer_momentum: 0.5,
            at_close: false,
            quorum: (workers * 3).div_ceil(4),
            dataset: "fashion-mnist".into(),
            failover_ms: 1000,
            seed: 1,
            model_seed: 42,
            train_seed: 7,
            limit_s: 600.0,
        }
    }
}

/// Where each process runs: host indices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Host of shard `k`'s primary.
    pub primary: Vec<usize>,
    /// Host of shard `k`'s standby (empty without standbys).
    pub standby: Vec<usize>,
    /// Host of the witness (with standbys).
    pub witness: Option<usize>,
    /// Host of worker `r`.
    pub worker: Vec<usize>,
}

impl Placement {
    /// Primaries round-robin from host 0, each standby on the next host after its primary, the witness on the last
    /// host, workers round-robin.
    pub fn new(spec: &ScaleSpec) -> Result<Placement> {
        if spec.hosts < 2 || spec.hosts > 200 {
            return Err(ScaleError::Invalid(format!(
                "{} hosts (2..=200)",
                spec.hosts
            )));
        }
        if spec.workers == 0 || spec.shards == 0 || spec.shards > 100 {
            return Err(ScaleError::Invalid(format!(
                "{} workers × {} shards",
                spec.workers, spec.shards
            )));
        }
        let h = spec.hosts;
        let shards = spec.shards as usize;
        Ok(Placement {
            primary: (0..shards).map(|k| k % h).collect(),
            standby: if spec.standbys {
                (0..shards).map(|k| (k + 1) % h).collect()
            } else {
                Vec::new()
            },
            witness: spec.standbys.then_some(h - 1),
            worker: (0..spec.workers as usize).map(|r| r % h).collect(),
        })
    }
}

/// Port of shard `k`'s primary; its standby listens at +100, the witness at 7300.
fn primary_port(k: usize) -> usize {
    7000 + k
}

/// The run's cluster.toml: the quickstart's MLP (256-128) with its sync (BSP rounds of `local_steps` inner Adam
/// steps, topk2 both ways with error feedback, outer Nesterov lr 1.4 momentum 0.5), quorum rounds, one compute
/// thread per worker (they share the box's cores).
pub fn config_text(spec: &ScaleSpec, place: &Placement) -> String {
    let addr = |host: usize, port: usize| format!("\"{}:{port}\"", Star::addr(host));
    let list = |v: Vec<String>| v.join(", ");
    let servers = list(
        place
            .primary
            .iter()
            .enumerate()
            .map(|(k, &h)| addr(h, primary_port(k)))
            .collect(),
    );
    let mut cluster = format!(
        "[cluster]\nservers = [{servers}]\nworkers = {}\nstaleness = {}\nquorum = {}\ngrace_factor = 0.5\n\
         worker_timeout_ms = 10000\n",
        spec.workers, spec.staleness, spec.quorum
    );
    if let Some(w) = place.witness {
        let standbys = list(
            place
                .standby
                .iter()
                .enumerate()
                .map(|(k, &h)| addr(h, primary_port(k) + 100))
                .collect(),
        );
        cluster.push_str(&format!(
            "standbys = [{standbys}]\nwitness = {}\nfailover_ms = {}\n",
            addr(w, 7300),
            spec.failover_ms
        ));
    }
    let pull_scheme = spec.pull_scheme.as_deref().unwrap_or(&spec.scheme);
    format!(
        "{cluster}[model]\nkind = \"mlp\"\nhidden = [256, 128]\nseed = {}\n[data]\ndataset = \"{}\"\n\
         [train]\nbatch = {}\nepochs = {}\neval_every = 1000000\nlocal_steps = {}\nthreads = 1\nseed = {}\n\
         [optimizer]\nkind = \"{}\"\nlr = {:e}\nbeta2 = {}\neps = {:e}\n[optimizer.outer]\nlr = {}\nmomentum = {}\nat_close = {}\n\
         [compression]\nscheme = \"{scheme}\"\npull_scheme = \"{pull_scheme}\"\n{codec}",
        spec.model_seed,
        spec.dataset,
        spec.batch,
        spec.epochs,
        spec.local_steps,
        spec.train_seed,
        spec.inner,
        spec.lr,
        spec.beta2,
        spec.eps,
        spec.outer_lr,
        spec.outer_momentum,
        spec.at_close,
        scheme = spec.scheme,
        pull_scheme = pull_scheme,
        codec = if spec.scheme == "topk2" || pull_scheme == "topk2" {
            format!("bucket = 4096\nkeep = {}\n", spec.keep)
        } else {
            String::new()
        },
    )
}

/// CPU and memory of one process name over its incarnations.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcUsage {
    /// CPU seconds (user + system), summed over incarnations.
    pub cpu_s: f64,
    /// Largest peak resident set (VmHWM) seen, bytes.
    pub peak_rss: u64,
    /// Times it was started.
    pub starts: u32,
}

/// Bytes one host's link carried.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct LinkBytes {
    /// Sent by the host.
    pub sent: u64,
    /// Received by the host.
    pub received: u64,
}

/// What a worker's report and history said, as the summary needs it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerOutcome {
    /// Rounds settled on shard 0 (from its history).
    pub rounds: u64,
    /// Seconds the worker ran (its report's `wall_seconds`; the last incarnation's).
    pub wall_s: f64,
    /// Seconds it waited for pulls (`pull_wait_seconds`).
    pub pull_wait_s: f64,
    /// Seconds it computed rounds (`compute_seconds`).
    #[serde(default)]
    pub compute_s: f64,
    /// Seconds between consecutive settled rounds on shard 0, from its history.
    pub round_gaps_s: Vec<f64>,
    /// Each round's compute from its history: from the last reply of clock `c` to its push of `c` settling on
    /// shard 0, seconds.
    #[serde(default)]
    pub round_computes_s: Vec<f64>,
    /// Wire bytes it pushed and pulled (its report's `wire_bytes_pushed` and `wire_bytes_pulled`).
    #[serde(default)]
    pub wire_bytes: [f64; 2],
    /// Its model's parameters (its report's `params`).
    #[serde(default)]
    pub params: f64,
    /// Inner steps it ran (its report's `steps`; the last incarnation's).
    #[serde(default)]
    pub steps: f64,
    /// Whether its last incarnation exited 0 with a report, or was killed by the nemesis after every shard took its
    /// goodbye.
    pub finished: bool,
}

/// Figures of one run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScaleReport {
    /// The run's description.
    pub spec: ScaleSpec,
    /// Where processes ran.
    pub placement: Placement,
    /// Seconds from the workers' start to the last worker's exit (or the limit).
    pub wall_s: f64,
    /// Whether every worker finished and every shard node exited 0 by itself.
    pub completed: bool,
    /// Rank 0's final test accuracy (NaN without a report).
    pub accuracy: f64,
    /// Rounds per worker (median).
    pub rounds: f64,
    /// Round time: median, 90th percentile and largest gap between consecutive settled rounds, seconds.
    pub round_s: [f64; 3],
    /// Stall: pull wait per round, median over workers, seconds.
    pub stall_s: f64,
    /// Compute per round (the workers' `compute_seconds` over their rounds), median over workers, seconds.
    #[serde(default)]
    pub compute_per_round_s: f64,
    /// A worker's CPU time per round (user + system over all its incarnations, over its rounds), median over
    /// workers, seconds: what its rounds cost the machine's cores, where `compute_per_round_s` is their wall time.
    #[serde(default)]
    pub worker_cpu_per_round_s: f64,
    /// Cores of the machine the run shared (`available_parallelism`; 0 in reports from before the field).
    #[serde(default)]
    pub cores: u32,
    /// Spread of a round's compute: the coefficient of variation of every worker's per-round compute (from the
    /// histories: last reply to the push settling on shard 0); 0 in reports from before the field.
    #[serde(default)]
    pub compute_cv: f64,
    /// Wire bytes per model parameter of one push and of one pull reply, summed over the shards (the workers'
    /// reported bytes over their rounds, `steps / local_steps`); 0 in reports from before the field.
    #[serde(default)]
    pub wire_bytes_per_param: [f64; 2],
    /// The distribution of a round's compute over every worker's rounds (from the histories, as `compute_cv`): its
    /// quantiles at 0, 5, …, 100 %, seconds; empty in reports from before the field.
    #[serde(default)]
    pub compute_quantiles_s: Vec<f64>,
    /// Rounds per worker whose gap exceeded 3× the median round (stalls), summed over workers.
    pub long_rounds: u64,
    /// Per shard node (`s{k}` primaries, `b{k}` standbys, `witness`): CPU and peak memory.
    pub shard_nodes: BTreeMap<String, ProcUsage>,
    /// Peak resident set of the workers: median and largest, bytes.
    pub worker_peak_rss: [u64; 2],
    /// Bytes per host link.
    pub links: Vec<LinkBytes>,
    /// The nemesis's actions: `(seconds, what)`.
    pub events: Vec<(f64, String)>,
    /// Processes that did not end as they should, with the tail of their log.
    pub failures: Vec<String>,
}

/// What a run collected, before it is summarized.
#[derive(Debug, Clone, Default)]
pub struct Collected {
    /// Seconds from the workers' start to the last worker's exit (or the limit).
    pub wall_s: f64,
    /// Each worker's outcome, by rank.
    pub workers: Vec<WorkerOutcome>,
    /// CPU and memory per process name (`w{r}`, `s{k}`, `b{k}`, `witness`).
    pub usage: BTreeMap<String, ProcUsage>,
    /// Bytes per host link.
    pub links: Vec<LinkBytes>,
    /// The nemesis's actions.
    pub events: Vec<(f64, String)>,
    /// Processes that did not end as they should.
    pub failures: Vec<String>,
    /// Rank 0's final test accuracy.
    pub accuracy: f64,
}

/// Standard deviation over mean (0 for fewer than two values or a zero mean).
fn coefficient_of_variation(xs: &[f64]) -> f64 {
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 || mean <= 0.0 {
        return 0.0;
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    var.sqrt() / mean
}

/// Builds the report's figures from what the run collected.
pub fn summarize(spec: &ScaleSpec, placement: Placement, c: Collected) -> ScaleReport {
    let Collected {
        wall_s,
        workers,
        usage,
        links,
        events,
        failures,
        accuracy,
    } = c;
    let mut gaps: Vec<f64> = workers
        .iter()
        .flat_map(|w| w.round_gaps_s.iter().copied())
        .collect();
    gaps.sort_by(f64::total_cmp);
    let median_gap = quantile(&gaps, 0.5);
    let long_rounds = gaps.iter().filter(|&&g| g > 3.0 * median_gap).count() as u64;
    let mut stalls: Vec<f64> = workers
        .iter()
        .filter(|w| w.rounds > 0)
        .map(|w| w.pull_wait_s / w.rounds as f64)
        .collect();
    stalls.sort_by(f64::total_cmp);
    let mut computes: Vec<f64> = workers
        .iter()
        .filter(|w| w.rounds > 0)
        .map(|w| w.compute_s / w.rounds as f64)
        .collect();
    computes.sort_by(f64::total_cmp);
    let mut cpus: Vec<f64> = workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.rounds > 0)
        .filter_map(|(r, w)| {
            usage
                .get(&format!("w{r}"))
                .map(|u| u.cpu_s / w.rounds as f64)
        })
        .collect();
    cpus.sort_by(f64::total_cmp);
    let mut all_computes: Vec<f64> = workers
        .iter()
        .flat_map(|w| w.round_computes_s.iter().copied())
        .collect();
    let compute_cv = coefficient_of_variation(&all_computes);
    all_computes.sort_by(f64::total_cmp);
    let compute_quantiles_s = if all_computes.len() < 2 {
        Vec::new()
    } else {
        (0..=20)
            .map(|i| quantile(&all_computes, f64::from(i) / 20.0))
            .collect()
    };
    // Rounds each worker's reported bytes cover (its last incarnation's steps over H), times its parameters.
    let param_rounds: f64 = workers
        .iter()
        .map(|w| (w.steps / f64::from(spec.local_steps.max(1))).floor() * w.params)
        .sum();
    let wire_bytes_per_param = if param_rounds > 0.0 {
        [0, 1].map(|i| workers.iter().map(|w| w.wire_bytes[i]).sum::<f64>() / param_rounds)
    } else {
        [0.0; 2]
    };
    let mut rounds: Vec<f64> = workers.iter().map(|w| w.rounds as f64).collect();
    rounds.sort_by(f64::total_cmp);
    let mut rss: Vec<u64> = usage
        .iter()
        .filter(|(name, _)| name.starts_with('w'))
        .map(|(_, u)| u.peak_rss)
        .collect();
    rss.sort_unstable();
    let shard_nodes = usage
        .into_iter()
        .filter(|(name, _)| !name.starts_with('w'))
        .collect();
    ScaleReport {
        spec: spec.clone(),
        placement,
        wall_s,
        completed: failures.is_empty() && workers.iter().all(|w| w.finished),
        accuracy,
        rounds: quantile(&rounds, 0.5),
        round_s: [
            median_gap,
            quantile(&gaps, 0.9),
            gaps.last().copied().unwrap_or(f64::NAN),
        ],
        stall_s: quantile(&stalls, 0.5),
        compute_per_round_s: quantile(&computes, 0.5),
        worker_cpu_per_round_s: quantile(&cpus, 0.5),
        cores: std::thread::available_parallelism().map_or(0, |n| n.get() as u32),
        compute_cv,
        wire_bytes_per_param,
        compute_quantiles_s,
        long_rounds,
        shard_nodes,
        worker_peak_rss: [
            rss.get(rss.len() / 2).copied().unwrap_or(0),
            rss.last().copied().unwrap_or(0),
        ],
        links,
        events,
        failures,
    }
}

impl ScaleReport {
    /// A few lines for a terminal or a results file.
    pub fn text(&self) -> String {
        let s = &self.spec;
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let mut out = format!(
            "{} workers × {} shards{} on {} hosts, links {}, nemesis {:?}: {} in {:.1} s, rank 0 accuracy {:.4}\n",
            s.workers,
            s.shards,
            if s.standbys { " with standbys" } else { "" },
            s.hosts,
            s.rate_bps
                .map_or("unshaped".to_string(), |r| format!("{} Mbit/s", r / 1_000_000)),
            s.nemesis,
            if self.completed {
                "completed"
            } else {
                "NOT completed"
            },
            self.wall_s,
            self.accuracy
        );
        out.push_str(&format!(
            "  rounds per worker {:.0}; round time p50 {:.3} s, p90 {:.3} s, max {:.3} s; stall (pull wait per round) \
             {:.3} s; compute per round {:.3} s ({:.3} CPU s, cv {:.2}); {} rounds over 3× the median; wire bytes per \
             parameter {:.4} a push, {:.4} a pull\n",
            self.rounds,
            self.round_s[0],
            self.round_s[1],
            self.round_s[2],
            self.stall_s,
            self.compute_per_round_s,
            self.worker_cpu_per_round_s,
            self.compute_cv,
            self.long_rounds,
            self.wire_bytes_per_param[0],
            self.wire_bytes_per_param[1],
        ));
        out.push_str(&format!(
            "  worker peak RSS median {:.1} MiB, largest {:.1} MiB\n",
            mib(self.worker_peak_rss[0]),
            mib(self.worker_peak_rss[1])
        ));
        for (name, u) in &self.shard_nodes {
            out.push_str(&format!(
                "  {name}: {:.1} CPU s, peak RSS {:.1} MiB, started {}×\n",
                u.cpu_s,
                mib(u.peak_rss),
                u.starts
            ));
        }
        for (h, l) in self.links.iter().enumerate() {
            out.push_str(&format!(
                "  host {h}: sent {:.1} MiB, received {:.1} MiB\n",
                mib(l.sent),
                mib(l.received)
            ));
        }
        for (t, e) in &self.events {
            out.push_str(&format!("  {t:.1} s: {e}\n"));
        }
        for f in &self.failures {
            out.push_str(&format!("  FAILURE {f}\n"));
        }
        out
    }
}

/// One started process (an incarnation of a named role).
struct Proc {
    name: String,
    host: usize,
    args: Vec<String>,
    program: PathBuf,
    child: Child,
    log: PathBuf,
    /// CPU seconds of earlier incarnations.
    cpu_before: f64,
    /// Last sampled CPU seconds of this incarnation.
    cpu_now: f64,
    peak_rss: u64,
    starts: u32,
    status: Option<std::process::ExitStatus>,
    /// Its last incarnation was killed by the harness and not started again: a shard node the nemesis killed after
    /// the workers finished, or a worker killed after every shard took its goodbye.
    left_killed: bool,
}

impl Proc {
    fn tail(&self) -> String {
        let t = std::fs::read_to_string(&self.log).unwrap_or_default();
        let mut cut = t.len().saturating_sub(1500);
        while !t.is_char_boundary(cut) {
            cut += 1;
        }
        t[cut..].to_string()
    }

    /// Reads this incarnation's CPU seconds and peak RSS from `/proc` (nothing once it has exited).
    fn sample(&mut self, ticks: f64) {
        let pid = self.child.id();
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // Fields after the command name, which is in parentheses and may hold spaces.
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                // utime and stime are fields 14 and 15 of stat, 12 and 13 after the name and state.
                if let (Some(u), Some(s)) = (f.get(11), f.get(12)) {
                    let t = u.parse::<f64>().unwrap_or(0.0) + s.parse::<f64>().unwrap_or(0.0);
                    self.cpu_now = self.cpu_now.max(t / ticks);
                }
            }
        }
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if let Some(kb) = status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            {
                self.peak_rss = self.peak_rss.max(kb * 1024);
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binaries directory, the working folder and the star of a run in progress.
struct Bed<'a> {
    star: Star,
    dir: &'a Path,
    bins: &'a Path,
}

impl Bed<'_> {
    /// Starts `program args` on `host` with its output appended to `log` (a first start and a restart alike).
    fn start_child(
        &self,
        host: usize,
        program: &Path,
        args: &[String],
        log: &Path,
        what: String,
    ) -> Result<Child> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io(format!("open {}", log.display())))?;
        self.star
            .command(host, program)
            .current_dir(self.dir)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(file.try_clone().map_err(io("log"))?)
            .stderr(file)
            .spawn()
            .map_err(io(what))
    }

    fn spawn(&self, name: &str, host: usize, program: &str, args: Vec<String>) -> Result<Proc> {
        let log = self.dir.join(format!("{name}.log"));
        let program = self.bins.join(program);
        let child = self.start_child(host, &program, &args, &log, format!("start {name}"))?;
        Ok(Proc {
            name: name.into(),
            host,
            args,
            program,
            child,
            log,
            cpu_before: 0.0,
            cpu_now: 0.0,
            peak_rss: 0,
            starts: 1,
            status: None,
            left_killed: false,
        })
    }

    /// Starts `p` again with the same flags (after a kill), keeping its CPU and memory figures.
    fn restart(&self, p: &mut Proc) -> Result<()> {
        let _ = p.child.kill();
        let _ = p.child.wait();
        p.child = self.start_child(
            p.host,
            &p.program,
            &p.args,
            &p.log,
            format!("restart {}", p.name),
        )?;
        p.cpu_before += p.cpu_now;
        p.cpu_now = 0.0;
        p.starts += 1;
        p.status = None;
        Ok(())
    }

    /// Cuts `host` off from every other host, both ways.
    fn isolate(&self, host: usize, hosts: usize) -> Result<()> {
        for other in (0..hosts).filter(|&o| o != host) {
            self.star.cut(host, other)?;
        }
        Ok(())
    }
}

/// Seconds a worker incarnation started again after its goodbye may run on once the shards left.
const AFTER_THE_JOB_S: f64 = 15.0;

/// Whether, for each of `shards` shards, a node of it (`s{k}` or `b{k}`) exited 0 by itself.
fn every_shard_took_every_goodbye(nodes: &[Proc], shards: usize) -> bool {
    (0..shards).all(|k| {
        let names = [format!("s{k}"), format!("b{k}")];
        nodes.iter().any(|p| {
            names.contains(&p.name) && !p.left_killed && p.status.is_some_and(|s| s.success())
        })
    })
}

/// Bytes host `i`'s end of its link sent and received.
fn link_bytes(star: &Star, i: usize) -> Result<LinkBytes> {
    let (sent, received) = star.link_bytes(i)?;
    Ok(LinkBytes { sent, received })
}

/// Issues one bundle per node and worker into `dir/certs`.
fn issue(dir: &Path, place: &Placement) -> Result<()> {
    let validity = Validity::days(1);
    let pki = |e: &dyn std::fmt::Display| ScaleError::Pki(e.to_string());
    let ca = Authority::new(&validity).map_err(|e| pki(&e))?;
    let certs = dir.join("certs");
    let host = |h: usize| vec![Star::addr(h)];
    let mut nodes: Vec<Node> = Vec::new();
    for (k, &h) in place.primary.iter().enumerate() {
        nodes.push(Node::Server {
            shard: k as u32,
            hosts: host(h),
        });
    }
    for (k, &h) in place.standby.iter().enumerate() {
        nodes.push(Node::Standby {
            shard: k as u32,
            hosts: host(h),
        });
    }
    if let Some(h) = place.witness {
        nodes.push(Node::Witness { hosts: host(h) });
    }
    for r in 0..place.worker.len() {
        nodes.push(Node::Worker { rank: r as u32 });
    }
    for n in &nodes {
        ca.issue(n, &validity)
            .map_err(|e| pki(&e))?
            .write_bundle(&certs, ca.ca_pem())
            .map_err(|e| pki(&e))?;
    }
    Ok(())
}

/// What a worker's history says: rounds settled on shard 0, the gaps between them, and each round's compute.
#[derive(Debug, Clone, Default, PartialEq)]
struct HistoryFigures {
    rounds: u64,
    gaps_s: Vec<f64>,
    computes_s: Vec<f64>,
}

/// Reads a worker's history (JSON lines of `tether-worker --history`). A round's compute is the time from the last
/// shard's reply for clock `c` (its `read` records) to its push of `c` settling on shard 0: the inner steps, the
/// encoding and the push's round trip to shard 0 (0.14 s of it at 64 × 8 on two cores, where the shards are busy).
fn history_figures(history: &Path) -> HistoryFigures {
    let text = std::fs::read_to_string(history).unwrap_or_default();
    let mut settled: BTreeMap<u64, u64> = BTreeMap::new();
    let mut read: BTreeMap<u64, u64> = BTreeMap::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(c), Some(t)) = (v["clock"].as_u64(), v["t_us"].as_u64()) else {
            continue;
        };
        let applied = matches!(v["outcome"].as_str(), Some("applied" | "duplicate"));
        if v["kind"] == "push" && v["shard"] == 0 && applied {
            settled.entry(c).or_insert(t);
        } else if v["kind"] == "read" {
            let last = read.entry(c).or_insert(t);
            *last = (*last).max(t);
        }
    }
    let computes_s = settled
        .iter()
        .filter_map(|(c, &pushed)| {
            let from = *read.get(c)?;
            (pushed >= from).then(|| (pushed - from) as f64 / 1e6)
        })
        .collect();
    let times: Vec<u64> = settled.into_values().collect();
    let gaps_s = times
        .windows(2)
        .map(|w| w[1].saturating_sub(w[0]) as f64 / 1e6)
        .collect();
    HistoryFigures {
        rounds: times.len() as u64,
        gaps_s,
        computes_s,
    }
}

/// Runs `spec` with the binaries in `bins`, working in `dir` (logs, reports, histories stay there).
pub fn run(spec: &ScaleSpec, bins: &Path, dir: &Path) -> Result<ScaleReport> {
    let place = Placement::new(spec)?;
    if let Nemesis::Cut { host, .. } = spec.nemesis {
        if host >= spec.hosts {
            return Err(ScaleError::Invalid(format!(
                "cut host {host} of {}",
                spec.hosts
            )));
        }
    }
    let star = Star::up(spec.hosts, spec.rate_bps)?;
    std::fs::create_dir_all(dir).map_err(io("work folder"))?;
    issue(dir, &place)?;
    std::fs::write(dir.join("cluster.toml"), config_text(spec, &place)).map_err(io("config"))?;
    // Processes start in `dir`: a relative binaries folder would name another place there.
    let bins = &bins
        .canonicalize()
        .map_err(io(format!("binaries folder {}", bins.display())))?;
    let bed = Bed { star, dir, bins };
    // SAFETY: sysconf only reads a constant of the system.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let w = spec.workers.to_string();
    let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let mut shards: Vec<Proc> = Vec::new();
    if let Some(h) = place.witness {
        shards.push(bed.spawn(
            "witness",
            h,
            "tether-server",
            s(&["witness", "--config", "cluster.toml"]),
        )?);
    }
    for (k, &h) in place.primary.iter().enumerate() {
        let (ks, report) = (k.to_string(), format!("s{k}.json"));
        let args = s(&[
            "--config",
            "cluster.toml",
            "--shard",
            &ks,
            "--exit-after-workers",
            &w,
            "--report",
            &report,
        ]);
        shards.push(bed.spawn(&format!("s{k}"), h, "tether-server", args)?);
    }
    for (k, &h) in place.standby.iter().enumerate() {
        let (ks, report) = (k.to_string(), format!("b{k}.json"));
        let mut args = s(&[
            "--config",
            "cluster.toml",
            "--shard",
            &ks,
            "--exit-after-workers",
            &w,
            "--report",
            &report,
        ]);
        args.push("--standby".into());
        shards.push(bed.spawn(&format!("b{k}"), h, "tether-server", args)?);
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut workers: Vec<Proc> = Vec::new();
    for (r, &h) in place.worker.iter().enumerate() {
        let rs = r.to_string();
        let args = s(&[
            "--config",
            "cluster.toml",
            "--rank",
            &rs,
            "--report",
            &format!("w{r}.json"),
            "--history",
            &format!("w{r}.history"),
        ]);
        workers.push(bed.spawn(&format!("w{r}"), h, "tether-worker", args)?);
    }
    let t0 = Instant::now();
    let mut rng = SplitMix64::new(spec.seed);
    let mut events = Vec::new();
    let mut next_kill = match spec.nemesis {
        Nemesis::Kill { every_s } => Some(every_s),
        _ => None,
    };
    let mut pending_restart: Option<(f64, bool, usize)> = None;
    let mut cut_state = 0; // 0: not yet, 1: cut, 2: healed
    let mut job_over_at: Option<f64> = None;
    let limit = Duration::from_secs_f64(spec.limit_s);
    let mut last_sample = Instant::now() - Duration::from_secs(1);
    loop {
        let t = t0.elapsed().as_secs_f64();
        for p in workers.iter_mut().chain(shards.iter_mut()) {
            if p.status.is_none() {
                if let Ok(Some(st)) = p.child.try_wait() {
                    p.status = Some(st);
                }
            }
        }
        if last_sample.elapsed() >= Duration::from_millis(250) {
            for p in workers.iter_mut().chain(shards.iter_mut()) {
                if p.status.is_none() {
                    p.sample(ticks);
                }
            }
            last_sample = Instant::now();
        }
        // Every shard took every rank's goodbye when, for each shard, a node of it exited 0 by itself (they exit
        // only on `--exit-after-workers` distinct goodbyes). The job is then over for the cluster: a worker the
        // nemesis killed after its goodbye has nothing to rejoin.
        if job_over_at.is_none() && every_shard_took_every_goodbye(&shards, place.primary.len()) {
            job_over_at = Some(t);
            events.push((t, "every shard took every goodbye and exited".into()));
            if let Some((_, true, i)) = pending_restart {
                pending_restart = None;
                workers[i].left_killed = true;
                events.push((
                    t,
                    format!(
                        "{} not started again: killed after its goodbye",
                        workers[i].name
                    ),
                ));
            }
        }
        // An incarnation started again after its goodbye (the kill fell between its goodbye and its exit, and the
        // shards left while it started) finds no cluster; past a grace it is stopped and counted as killed.
        if job_over_at.is_some_and(|at| t >= at + AFTER_THE_JOB_S) {
            for p in workers
                .iter_mut()
                .filter(|p| p.status.is_none() && p.starts > 1)
            {
                let _ = p.child.kill();
                p.status = p.child.wait().ok();
                p.left_killed = true;
                events.push((
                    t,
                    format!("{} stopped: started again after its goodbye", p.name),
                ));
            }
        }
        // A killed worker waiting to be started again has not finished.
        let worker_pending = matches!(pending_restart, Some((_, true, _)));
        if !worker_pending && workers.iter().all(|p| p.status.is_some()) {
            // The job is over: a shard node killed now is not started again (it would find no workers and no peer to
            // follow, and never exit by itself).
            if let Some((_, is_worker, i)) = pending_restart.take() {
                let p = if is_worker {
                    &mut workers[i]
                } else {
                    &mut shards[i]
                };
                p.left_killed = true;
                events.push((
                    t,
                    format!("{} not started again: every worker finished", p.name),
                ));
            }
            break;
        }
        if t0.elapsed() > limit {
            break;
        }
        if let Some((at, is_worker, i)) = pending_restart {
            if t >= at {
                let p = if is_worker {
                    &mut workers[i]
                } else {
                    &mut shards[i]
                };
                bed.restart(p)?;
                events.push((t, format!("started {} again", p.name)));
                pending_restart = None;
            }
        }
        if let (Some(at), None, None) = (next_kill, pending_restart, job_over_at) {
            if t >= at {
                // Victims: live workers 1.. and live shard nodes (not the witness).
                let mut victims: Vec<(bool, usize)> = (1..workers.len())
                    .filter(|&i| workers[i].status.is_none())
                    .map(|i| (true, i))
                    .collect();
                victims.extend(
                    (0..shards.len())
                        .filter(|&i| shards[i].name != "witness" && shards[i].status.is_none())
                        .map(|i| (false, i)),
                );
                if !victims.is_empty() {
                    let (is_worker, i) = victims[rng.below(victims.len() as u64) as usize];
                    let p = if is_worker {
                        &mut workers[i]
                    } else {
                        &mut shards[i]
                    };
                    p.sample(ticks);
                    let _ = p.child.kill();
                    events.push((t, format!("SIGKILL {}", p.name)));
                    pending_restart = Some((t + 1.0, is_worker, i));
                }
                if let Nemesis::Kill { every_s } = spec.nemesis {
                    next_kill = Some(at + every_s);
                }
            }
        }
        if let Nemesis::Cut { host, at_s, for_s } = spec.nemesis {
            if cut_state == 0 && t >= at_s {
                bed.isolate(host, spec.hosts)?;
                events.push((t, format!("cut host {host} off")));
                cut_state = 1;
            } else if cut_state == 1 && t >= at_s + for_s {
                bed.star.heal()?;
                events.push((t, format!("healed host {host}")));
                cut_state = 2;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let wall_s = t0.elapsed().as_secs_f64();
    if cut_state == 1 {
        bed.star.heal()?;
    }
    // The shard nodes exit by themselves once every worker said goodbye; give them a bounded while.
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline
        && shards
            .iter_mut()
            .filter(|p| p.name != "witness")
            .any(|p| p.status.is_none() && !matches!(p.child.try_wait(), Ok(Some(_))))
    {
        for p in shards.iter_mut().filter(|p| p.status.is_none()) {
            p.sample(ticks);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // A node still running then did not learn that the job ended (seen: a standby that took over as its primary
    // exited on the last goodbye, before the standby held that goodbye). It is stopped as an operator would, with
    // SIGTERM, and must exit cleanly; the report's events name it.
    for p in shards.iter_mut().filter(|p| p.name != "witness") {
        if p.status.is_none() && matches!(p.child.try_wait(), Ok(None)) {
            // SAFETY: kill(2) on our own child's pid; it has not been reaped (try_wait just saw it running).
            unsafe {
                libc::kill(p.child.id() as libc::pid_t, libc::SIGTERM);
            }
            events.push((
                t0.elapsed().as_secs_f64(),
                format!("{} did not exit by itself; stopped with SIGTERM", p.name),
            ));
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(p.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    let links = (0..spec.hosts)
        .map(|i| link_bytes(&bed.star, i))
        .collect::<Result<Vec<_>>>()?;
    let mut failures = Vec::new();
    let mut usage = BTreeMap::new();
    for p in shards.iter_mut().chain(workers.iter_mut()) {
        if p.status.is_none() {
            p.status = p.child.try_wait().ok().flatten();
        }
        let ok = p.status.is_some_and(|s| s.success()) || p.left_killed;
        if !ok && p.name != "witness" {
            failures.push(format!(
                "{} ended with {:?}:\n{}",
                p.name,
                p.status,
                p.tail()
            ));
        }
        usage.insert(
            p.name.clone(),
            ProcUsage {
                cpu_s: p.cpu_before + p.cpu_now,
                peak_rss: p.peak_rss,
                starts: p.starts,
            },
        );
    }
    let outcomes: Vec<WorkerOutcome> = workers
        .iter()
        .enumerate()
        .map(|(r, p)| {
            let report: Option<serde_json::Value> =
                std::fs::read_to_string(dir.join(format!("w{r}.json")))
                    .ok()
                    .and_then(|t| serde_json::from_str(&t).ok());
            let f = |k: &str| report.as_ref().and_then(|v| v[k].as_f64()).unwrap_or(0.0);
            let h = history_figures(&dir.join(format!("w{r}.history")));
            WorkerOutcome {
                rounds: h.rounds,
                wall_s: f("wall_seconds"),
                pull_wait_s: f("pull_wait_seconds"),
                compute_s: f("compute_seconds"),
                round_gaps_s: h.gaps_s,
                round_computes_s: h.computes_s,
                wire_bytes: [f("wire_bytes_pushed"), f("wire_bytes_pulled")],
                params: f("params"),
                steps: f("steps"),
                // A worker the nemesis killed after every shard took its goodbye finished its part of the job.
                finished: (report.is_some() && p.status.is_some_and(|s| s.success()))
                    || p.left_killed,
            }
        })
        .collect();
    let accuracy = std::fs::read_to_string(dir.join("w0.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["final_test_accuracy"].as_f64())
        .unwrap_or(f64::NAN);
    drop(workers);
    drop(shards);
    Ok(summarize(
        spec,
        place,
        Collected {
            wall_s,
            workers: outcomes,
            usage,
            links,
            events,
            failures,
            accuracy,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_common::codec::Scheme;
    use tether_common::config::Config;

    #[test]
    fn a_history_gives_each_rounds_compute_from_its_last_reply_to_its_push_settling() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.history");
        let line = |t: u64, kind: &str, shard: u32, clock: u64, outcome: &str| {
            format!(
                r#"{{"t_us":{t},"kind":"{kind}","shard":{shard},"clock":{clock},"min_clock":0,"outcome":"{outcome}","version":0,"term":1}}"#
            )
        };
        let lines = [
            line(1_000_000, "read", 0, 0, ""),
            line(1_100_000, "read", 1, 0, ""),
            line(1_400_000, "push", 1, 0, "applied"),
            line(1_500_000, "push", 0, 0, "applied"),
            line(1_600_000, "read", 1, 1, ""),
            line(1_700_000, "read", 0, 1, ""),
            line(1_900_000, "push", 0, 1, "refused"),
            line(2_000_000, "push", 0, 1, "duplicate"),
            // A torn last line of a killed incarnation.
            r#"{"t_us":2100000,"kind":"re"#.to_string(),
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let h = history_figures(&path);
        assert_eq!(h.rounds, 2);
        assert_eq!(h.gaps_s, vec![0.5]);
        // Round 0: the last reply at 1.1 s to shard 0's settle at 1.5 s; round 1: 1.7 s to 2.0 s.
        assert_eq!(h.computes_s.len(), 2);
        assert!((h.computes_s[0] - 0.4).abs() < 1e-9 && (h.computes_s[1] - 0.3).abs() < 1e-9);
        assert_eq!(
            history_figures(&dir.path().join("none")),
            HistoryFigures::default()
        );
        let cv = coefficient_of_variation(&[1.0, 2.0, 3.0]);
        assert!((cv - 0.5).abs() < 1e-12, "{cv}");
        assert_eq!(coefficient_of_variation(&[2.0]), 0.0);
    }

    #[test]
    fn a_spec_written_before_the_newer_fields_reads_them_as_the_quickstarts() {
        // The spec of a report from the first scale runs (bench/results/scale-2026-12-07.jsonl).
        let old = r#"{"hosts":8,"workers":64,"shards":8,"standbys":true,"rate_bps":1000000000,"nemesis":"None",
            "epochs":5,"batch":8,"local_steps":16,"quorum":48,"dataset":"fashion-mnist","seed":1,"limit_s":600.0}"#;
        let spec: ScaleSpec = serde_json::from_str(old).unwrap();
        assert_eq!((spec.workers, spec.shards, spec.failover_ms), (64, 8, 1000));
        assert_eq!(
            (spec.scheme.as_str(), spec.pull_scheme.as_deref()),
            ("topk2", None)
        );
        assert_eq!(
            (spec.lr, spec.outer_lr, spec.outer_momentum, spec.staleness),
            (1e-3, 1.4, 0.5, 0)
        );
        assert_eq!((spec.model_seed, spec.train_seed), (42, 7));
        // A field the first reports had is still required.
        assert!(serde_json::from_str::<ScaleSpec>(&old.replace(r#""workers":64,"#, "")).is_err());
    }

    #[test]
    fn the_config_text_is_a_valid_config_with_the_specs_sync() {
        let mut spec = ScaleSpec::quickstart(8, 64, 8);
        let place = Placement::new(&spec).unwrap();
        let cfg = Config::parse(&config_text(&spec, &place), Path::new("/tmp")).unwrap();
        assert_eq!(cfg.cluster.servers.len(), 8);
        assert_eq!(cfg.cluster.standbys.len(), 8);
        assert_eq!((cfg.cluster.workers, cfg.cluster.quorum), (64, 48));
        assert_eq!((cfg.train.batch, cfg.train.local_steps), (8, 16));
        assert_eq!(cfg.compression.scheme, Scheme::Topk2);
        assert!((cfg.optimizer.lr - 1e-3).abs() < 1e-9);
        spec.scheme = "q4".into();
        spec.pull_scheme = Some("q4".into());
        spec.lr = 2.5e-4;
        spec.local_steps = 8;
        spec.staleness = 1;
        spec.outer_lr = 0.7;
        spec.outer_momentum = 0.9;
        let cfg = Config::parse(&config_text(&spec, &place), Path::new("/tmp")).unwrap();
        assert_eq!(
            cfg.cluster.staleness,
            tether_common::config::Staleness::Bounded(1)
        );
        assert!((cfg.optimizer.outer.lr - 0.7).abs() < 1e-6);
        assert!((cfg.optimizer.outer.momentum - 0.9).abs() < 1e-6);
        assert_eq!(cfg.compression.scheme, Scheme::Q4);
        assert_eq!(cfg.compression.pull_scheme, Scheme::Q4);
        assert!((cfg.optimizer.lr - 2.5e-4).abs() < 1e-9);
        assert_eq!(cfg.train.local_steps, 8);
        assert_eq!((cfg.model.seed, cfg.train.seed), (42, 7));
        assert_eq!(
            cfg.optimizer.kind,
            tether_common::config::OptimizerKind::Adam
        );
        assert!(
            (cfg.optimizer.beta2 - 0.999).abs() < 1e-6 && (cfg.optimizer.eps - 1e-8).abs() < 1e-12
        );
        spec.inner = "momentum".into();
        spec.beta2 = 0.95;
        spec.eps = 1e-6;
        spec.model_seed = 3;
        spec.train_seed = 11;
        let cfg = Config::parse(&config_text(&spec, &place), Path::new("/tmp")).unwrap();
        assert_eq!((cfg.model.seed, cfg.train.seed), (3, 11));
        assert_eq!(
            cfg.optimizer.kind,
            tether_common::config::OptimizerKind::Momentum
        );
        assert!(
            (cfg.optimizer.beta2 - 0.95).abs() < 1e-6 && (cfg.optimizer.eps - 1e-6).abs() < 1e-12
        );
        // topk2's keep reaches the config only with a topk2 codec.
        spec.scheme = "topk2".into();
        spec.pull_scheme = None;
        spec.keep = 64;
        let cfg = Config::parse(&config_text(&spec, &place), Path::new("/tmp")).unwrap();
        assert_eq!(
            (cfg.compression.scheme, cfg.compression.keep),
            (Scheme::Topk2, 64)
        );
    }
}
