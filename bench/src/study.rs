//! `tether-bench study`: the re-runnable study behind `BENCHMARKS.md`. Real clusters of `tether-server` and
//! `tether-worker` processes on the link harness ([`crate::netns`]), one node per process: the push schemes (with
//! and without error feedback, and local-step rounds) across 100 Mbit/s, 1 Gbit/s, 10 Gbit/s and unshaped links;
//! BSP / SSP / async under transient and persistent stragglers; 1–8 workers × 1–4 shards; then the simulator,
//! calibrated from the floors and each run's own step times, validated against those runs and asked to predict
//! 64–1,024 workers × 8–64 shards. Every figure is a median over `--repeats` runs with its spread; comparisons are
//! ratios of medians from this one invocation.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use tether_bench::sim::{simulate, SimConfig};
use tether_bench::stats::{relative_error, time_to, Spread};

use crate::cluster::{certificates, cpu_seconds, pull_lines, sibling, Proc, RunConfig};
use crate::plot::{lines, Series};
use tether_bench::netns::{has_netem, Rate, Star};

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct StudyArgs {
    /// The report to write.
    #[arg(long, default_value = "BENCHMARKS.md")]
    pub out: PathBuf,
    /// Folder for the PNG plots (relative paths resolve against the report's folder).
    #[arg(long, default_value = "bench/plots")]
    pub plots: PathBuf,
    /// Runs per configuration (the median and the spread are reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: u32,
    /// Epochs per training run.
    #[arg(long, default_value_t = 2)]
    pub epochs: u32,
    /// Target test accuracy for "time to target".
    #[arg(long, default_value_t = 0.80)]
    pub target: f64,
    /// Workers of the compression and straggler runs.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Shards of the compression and straggler runs.
    #[arg(long, default_value_t = 2)]
    pub shards: u32,
    /// Sections to run (comma-separated): ingest, compression, links, stragglers, scaling, sim.
    #[arg(
        long,
        default_value = "ingest,compression,links,stragglers,scaling,sim"
    )]
    pub sections: String,
    /// Fashion-MNIST folder (the embedded digits set is used when it is missing).
    #[arg(long, default_value = "/usr/share/datasets/fashion-mnist")]
    pub data_dir: PathBuf,
}

/// One real training run on the harness.
#[derive(Debug, Clone, Serialize)]
struct Spec {
    workers: u32,
    shards: u32,
    scheme: String,
    error_feedback: bool,
    local_steps: u32,
    staleness: String,
    rate: Rate,
    /// When set, the shards sit on unshaped links and every worker's link is `(up, down)` (the `links` section);
    /// else every node's link is `rate` both ways.
    worker_link: Option<(Rate, Rate)>,
    /// topk2 both ways (bucket 4096, keep 16, outer lr 1.4: the quickstart's defaults) instead of `scheme`.
    sparse: bool,
    /// `train.local_steps_max` (0: H pinned).
    local_steps_max: u32,
    /// `P:F` for every worker (transient) …
    straggle_all: Option<String>,
    /// … or for worker 0 only (persistent).
    straggle_first: Option<String>,
    epochs: u32,
    /// Whether worker 0 evaluates (for time to target); off for throughput runs (evaluation is not training).
    eval: bool,
}

/// What it measured.
#[derive(Debug, Clone, Serialize)]
struct Outcome {
    wall_s: f64,
    time_to_target: Option<f64>,
    final_accuracy: f64,
    wire_bytes: f64,
    push_bytes: f64,
    pull_bytes: f64,
    rounds_per_worker: f64,
    samples_per_s: f64,
    rounds_per_s: f64,
    stall_fraction: f64,
    compute_per_round_s: f64,
    staleness_histogram: Vec<(u64, u64)>,
    max_lead: u64,
    params: u64,
    /// Bytes per-step fp32 synchronisation of the same steps would have moved, both ways.
    fp32_bytes: f64,
    /// Largest bytes one push carried (the largest burst on a worker's uplink).
    max_push_bytes: f64,
    /// Inner steps per round at the end (the largest over workers).
    h_picked: u64,
    /// CPU seconds of the worker processes (all threads), and of the shard processes.
    worker_cpu_s: f64,
    shard_cpu_s: f64,
}

fn rate_name(r: Rate) -> String {
    match r {
        None => "unshaped".into(),
        Some(b) if b >= 1_000_000_000 => format!("{} Gbit/s", b / 1_000_000_000),
        Some(b) => format!("{} Mbit/s", b / 1_000_000),
    }
}

struct Env {
    server: PathBuf,
    worker: PathBuf,
    data: String,
    batch: u64,
    train_len: u64,
}

/// How a run with push `scheme` pulls (`pull_lines` mode, delta scheme): fp32 pushes with fp32 pulls (the per-step
/// fp32 reference), bf16 with bf16 pulls, q8 with q8 deltas, q4 and q2 with q4 deltas (the default).
fn pull_of(scheme: &str) -> (&'static str, &'static str) {
    match scheme {
        "none" => ("f32", "q4"),
        "bf16" | "fp16" => ("bf16", "q4"),
        "q8" => ("delta", "q8"),
        _ => ("delta", "q4"),
    }
}

/// The table's name for how a run with push `scheme` pulls (`f32`, `bf16`, `q4 delta`, ...).
fn pull_name(scheme: &str) -> String {
    match pull_of(scheme) {
        ("delta", delta) => format!("{delta} delta"),
        (mode, _) => mode.to_string(),
    }
}

fn real_run(env: &Env, s: &Spec, target: f64) -> Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let nodes = (s.shards + s.workers) as usize;
    let star = match s.worker_link {
        None => Star::up(nodes, s.rate)?,
        Some(link) => {
            let mut links = vec![(None, None); s.shards as usize];
            links.extend(std::iter::repeat_n(link, s.workers as usize));
            Star::up_links(&links)?
        }
    };
    let hosts: Vec<String> = (0..s.shards as usize).map(Star::addr).collect();
    let servers: Vec<String> = hosts.iter().map(|h| format!("{h}:7000")).collect();
    certificates(dir.path(), &hosts, s.shards, s.workers)?;
    let rc = RunConfig {
        servers,
        workers: s.workers,
        staleness: s.staleness.clone(),
        model: "kind = \"mlp\"\nhidden = [256, 128]\nseed = 42".into(),
        data: env.data.clone(),
        train: format!(
            "epochs = {}\nbatch = {}\neval_every = {}\nlocal_steps = {}\nlocal_steps_max = {}",
            s.epochs, env.batch, 24, s.local_steps, s.local_steps_max
        ),
        // Local-step rounds as the quickstart runs them: the shards' outer Nesterov at lr 0.7 (1.4 with topk2),
        // momentum 0.5.
        optimizer: if s.local_steps > 0 {
            format!(
                "kind = \"adam\"\nlr = 0.001\n[optimizer.outer]\nkind = \"nesterov\"\nlr = {}\nmomentum = 0.5",
                if s.sparse { 1.4 } else { 0.7 }
            )
        } else {
            "kind = \"adam\"\nlr = 0.001".into()
        },
        compression: if s.sparse {
            "scheme = \"topk2\"\nerror_feedback = true\nzstd = true\npull = \"delta\"\npull_scheme = \"topk2\"\n\
             bucket = 4096\nkeep = 16"
                .into()
        } else {
            format!(
                "scheme = \"{}\"\nerror_feedback = {}\nzstd = true\n{}",
                s.scheme,
                s.error_feedback,
                {
                    let (mode, delta) = pull_of(&s.scheme);
                    pull_lines(mode, delta)
                }
            )
        },
    };
    std::fs::write(dir.path().join("cluster.toml"), rc.text())?;
    let mut shards = Vec::new();
    for k in 0..s.shards {
        let mut c = star.command(k as usize, &env.server);
        c.current_dir(dir.path()).args([
            "--config",
            "cluster.toml",
            "--shard",
            &k.to_string(),
            "--exit-after-workers",
            &s.workers.to_string(),
            "--report",
            &format!("server-{k}.json"),
        ]);
        let mut p = Proc::spawn(c, dir.path().join(format!("server-{k}.log")))?;
        p.wait_for("listening on", Duration::from_secs(30))?;
        shards.push(p);
    }
    let mut workers = Vec::new();
    for r in 0..s.workers {
        let mut c = star.command((s.shards + r) as usize, &env.worker);
        c.current_dir(dir.path()).args([
            "--config",
            "cluster.toml",
            "--rank",
            &r.to_string(),
            "--report",
            &format!("worker-{r}.json"),
        ]);
        let straggle = s.straggle_all.clone().or(if r == 0 {
            s.straggle_first.clone()
        } else {
            None
        });
        if let Some(st) = straggle {
            c.args(["--straggle", &st]);
        }
        if !s.eval {
            c.args(["--eval", "false"]);
        }
        workers.push(Proc::spawn(c, dir.path().join(format!("worker-{r}.log")))?);
    }
    let cpu0 = cpu_seconds(libc::RUSAGE_CHILDREN);
    for (r, p) in workers.iter_mut().enumerate() {
        if !p.wait_exit(Duration::from_secs(900))? {
            bail!("worker {r} failed:\n{}", p.log_tail(3000));
        }
    }
    let cpu1 = cpu_seconds(libc::RUSAGE_CHILDREN);
    for p in &mut shards {
        p.wait_exit(Duration::from_secs(30))?;
    }
    let cpu2 = cpu_seconds(libc::RUSAGE_CHILDREN);
    drop(star);
    let read = |name: &str| -> Result<serde_json::Value> {
        let t = std::fs::read_to_string(dir.path().join(name)).with_context(|| name.to_string())?;
        Ok(serde_json::from_str(&t)?)
    };
    let ws: Vec<serde_json::Value> = (0..s.workers)
        .map(|r| read(&format!("worker-{r}.json")))
        .collect::<Result<_>>()?;
    let ss: Vec<serde_json::Value> = (0..s.shards)
        .map(|k| read(&format!("server-{k}.json")))
        .collect::<Result<_>>()?;
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let wall = ws.iter().map(|w| f(w, "wall_seconds")).fold(0.0, f64::max);
    let curve: Vec<(u64, f64, f64)> =
        serde_json::from_value(ws[0]["accuracy_curve"].clone()).unwrap_or_default();
    let steps: f64 = ws.iter().map(|w| f(w, "steps")).sum();
    let per_round = f64::from(s.local_steps.max(1));
    let rounds = steps / per_round;
    let push_bytes: f64 = ws.iter().map(|w| f(w, "wire_bytes_pushed")).sum();
    let pull_bytes: f64 = ws.iter().map(|w| f(w, "wire_bytes_pulled")).sum();
    let stall = ws
        .iter()
        .map(|w| f(w, "pull_wait_seconds") / f(w, "wall_seconds").max(1e-9))
        .sum::<f64>()
        / ws.len() as f64;
    let compute: f64 = ws.iter().map(|w| f(w, "compute_seconds")).sum();
    let mut hist: Vec<(u64, u64)> = Vec::new();
    for sv in &ss {
        for b in sv["staleness_histogram"].as_array().into_iter().flatten() {
            let lo = b["lo"].as_u64().unwrap_or(0);
            let n = b["count"].as_u64().unwrap_or(0);
            match hist.iter_mut().find(|h| h.0 == lo) {
                Some(h) => h.1 += n,
                None => hist.push((lo, n)),
            }
        }
    }
    hist.sort();
    Ok(Outcome {
        wall_s: wall,
        time_to_target: time_to(&curve, target),
        final_accuracy: curve.last().map_or(f64::NAN, |p| p.2),
        wire_bytes: push_bytes + pull_bytes,
        push_bytes,
        pull_bytes,
        rounds_per_worker: rounds / f64::from(s.workers),
        samples_per_s: steps * env.batch as f64 / wall,
        rounds_per_s: rounds / wall,
        stall_fraction: stall,
        compute_per_round_s: compute / rounds.max(1.0),
        staleness_histogram: hist,
        max_lead: ss
            .iter()
            .map(|v| v["max_clock_lead_observed"].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0),
        params: ws[0]["params"].as_u64().unwrap_or(0),
        fp32_bytes: ws
            .iter()
            .map(|w| f(w, "fp32_bytes_pushed") + f(w, "fp32_bytes_pulled"))
            .sum(),
        max_push_bytes: ws
            .iter()
            .map(|w| f(w, "max_push_bytes"))
            .fold(0.0, f64::max),
        h_picked: ws
            .iter()
            .map(|w| w["local_steps_picked"].as_u64().unwrap_or(0))
            .max()
            .unwrap_or(0),
        worker_cpu_s: cpu1 - cpu0,
        shard_cpu_s: cpu2 - cpu1,
    })
}

/// A configuration run `repeats` times.
struct Measured {
    label: String,
    spec: Spec,
    runs: Vec<Outcome>,
}

impl Measured {
    fn spread(&self, f: impl Fn(&Outcome) -> f64) -> Spread {
        Spread::of(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
    /// Time to target over the runs that reached it; the median is NaN unless every run did.
    fn ttt(&self) -> Spread {
        let mut s = self.spread(|o| o.time_to_target.unwrap_or(f64::NAN));
        if self.runs.iter().any(|o| o.time_to_target.is_none()) {
            s.median = f64::NAN;
        }
        s
    }

    /// The time to target as a table cell: `median (min–max)`, or how many runs reached it.
    fn ttt_cell(&self) -> String {
        let reached = self
            .runs
            .iter()
            .filter(|o| o.time_to_target.is_some())
            .count();
        if reached == self.runs.len() {
            self.ttt().show(1)
        } else {
            format!("not reached ({reached} of {} runs)", self.runs.len())
        }
    }
}

/// Draws a plot; a plot that cannot be drawn is reported, not fatal (the tables are the record).
fn plot_or_warn(r: Result<()>, name: &str) {
    if let Err(e) = r {
        eprintln!(
            "study: plot {name} not drawn: {}",
            tether_common::error_chain::ErrorChain(e.as_ref())
        );
    }
}

fn measure(
    env: &Env,
    label: &str,
    spec: Spec,
    a: &StudyArgs,
    log: &mut Vec<String>,
) -> Result<Measured> {
    let mut runs = Vec::new();
    for i in 0..a.repeats {
        let t = Instant::now();
        let o = real_run(env, &spec, a.target)?;
        let line = format!(
            "{label} [{}] run {}: wall {:.1} s, to target {}, acc {:.4}, stall {:.2}, {:.1} MB",
            rate_name(spec.rate),
            i + 1,
            o.wall_s,
            o.time_to_target.map_or("—".into(), |t| format!("{t:.1} s")),
            o.final_accuracy,
            o.stall_fraction,
            o.wire_bytes / 1e6
        );
        eprintln!("{line}  ({:.0} s)", t.elapsed().as_secs_f64());
        log.push(line);
        runs.push(o);
    }
    Ok(Measured {
        label: label.into(),
        spec,
        runs,
    })
}

fn base_spec(a: &StudyArgs) -> Spec {
    Spec {
        workers: a.workers,
        shards: a.shards,
        scheme: "q4".into(),
        error_feedback: true,
        local_steps: 0,
        staleness: "3".into(),
        rate: Some(1_000_000_000),
        worker_link: None,
        sparse: false,
        local_steps_max: 0,
        straggle_all: None,
        straggle_first: None,
        epochs: a.epochs,
        eval: true,
    }
}

/// The base of the prediction: a 100M-parameter model, 0.5 s rounds (cv 0.1), q4 pushes and q4 delta pulls,
/// s = 3, costs of the shard apply path and of QUIC as measured on the 2-core dev VM (overridden by the study's
/// own floors when it runs).
pub fn prediction_base() -> SimConfig {
    SimConfig {
        workers: 64,
        shards: 8,
        params: 100_000_000,
        staleness: Some(3),
        rounds: 10,
        compute_s: 0.5,
        compute_cv: 0.1,
        straggle: None,
        slow_worker: None,
        push_bytes_per_param: 0.55,
        pull_bytes_per_param: 0.55,
        worker_ns_per_param: 3.0,
        apply_ns_per_param: 2.5,
        serve_ns_per_param: 1.0,
        cpu_ns_per_byte: 1.5,
        link_bps: 10e9,
        latency_s: 25e-6,
        seed: 7,
        cores: None,
        pull_overhead_s: 200e-6,
        worker_io_s: 0.0,
        shard_io_ns_per_param: 0.0,
    }
}

/// One row of the prediction grid.
#[derive(Debug, Clone, Serialize)]
pub struct PredictionRow {
    /// Workers.
    pub workers: u32,
    /// Shards.
    pub shards: u32,
    /// Link, Gbit/s.
    pub link_gbit: f64,
    /// Samples/s at the base's batch of 128 per round.
    pub samples_per_s: f64,
    /// Rounds/s, all workers.
    pub rounds_per_s: f64,
    /// Busiest shard CPU.
    pub shard_cpu_util: f64,
    /// Busiest shard link.
    pub shard_link_util: f64,
    /// Mean stall fraction.
    pub stall: f64,
    /// The bounding resource.
    pub limit: String,
}

/// The 64–1,024 workers × 8–64 shards × {10, 100} Gbit/s grid on `base`.
pub fn predict(base: &SimConfig) -> Result<Vec<PredictionRow>> {
    let mut rows = Vec::new();
    for link in [10.0, 100.0] {
        for shards in [8u32, 16, 32, 64] {
            for workers in [64u32, 128, 256, 512, 1024] {
                let c = SimConfig {
                    workers,
                    shards,
                    link_bps: link * 1e9,
                    ..base.clone()
                };
                let r = simulate(&c)?;
                rows.push(PredictionRow {
                    workers,
                    shards,
                    link_gbit: link,
                    samples_per_s: r.rounds_per_s * 128.0,
                    rounds_per_s: r.rounds_per_s,
                    shard_cpu_util: r.shard_cpu_util,
                    shard_link_util: r.shard_link_util,
                    stall: r.stall_fraction,
                    limit: r.limit,
                });
            }
        }
    }
    Ok(rows)
}

fn prediction_table(rows: &[PredictionRow]) -> String {
    let mut s = String::from(
        "| link | workers | shards | samples/s | efficiency vs ideal | shard CPU | shard link | stall | limit |\n\
         |---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} Gbit/s | {} | {} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            r.link_gbit,
            r.workers,
            r.shards,
            r.samples_per_s,
            1.0 - r.stall,
            r.shard_cpu_util,
            r.shard_link_util,
            r.stall,
            r.limit
        );
    }
    s
}

/// Prints the grid and, per link and worker count, the smallest shard count within 5% of the best.
pub fn print_prediction(rows: &[PredictionRow]) {
    print!("{}", prediction_table(rows));
    print!("{}", saturation(rows));
}

fn saturation(rows: &[PredictionRow]) -> String {
    let mut s = String::from("\n| link | workers | shards that saturate (within 5% of the best) | limit there |\n|---|---|---|---|\n");
    for link in [10.0, 100.0] {
        for w in [64u32, 128, 256, 512, 1024] {
            let set: Vec<&PredictionRow> = rows
                .iter()
                .filter(|r| r.link_gbit == link && r.workers == w)
                .collect();
            let best = set.iter().map(|r| r.samples_per_s).fold(0.0, f64::max);
            if let Some(r) = set
                .iter()
                .filter(|r| r.samples_per_s >= 0.95 * best)
                .min_by_key(|r| r.shards)
            {
                let _ = writeln!(s, "| {link} Gbit/s | {w} | {} | {} |", r.shards, r.limit);
            }
        }
    }
    s
}

/// The simulator's view of a measured run: the CPU per round and the pull overhead of the 1-worker calibration run
/// of its scheme, the floors' CPU costs, the run's bytes per parameter, the link's rate and this machine's cores.
fn sim_of(m: &Measured, o: &Outcome, cal: &Calibration) -> SimConfig {
    let rounds = o.rounds_per_worker.round().max(1.0) as u64;
    let per = (o.params as f64 * rounds as f64 * f64::from(m.spec.workers)).max(1.0);
    let (straggle, slow) = match (&m.spec.straggle_all, &m.spec.straggle_first) {
        (Some(s), _) => (parse_pf(s), None),
        (None, Some(s)) => (None, parse_pf(s).map(|p| p.1)),
        _ => (None, None),
    };
    let (compute_s, worker_io_s, pull_overhead_s, shard_ns) = cal
        .per_scheme
        .iter()
        .find(|c| c.scheme == m.spec.scheme)
        .map_or(
            (o.compute_per_round_s, 0.0, 0.0, cal.apply_ns_per_param),
            |c| {
                (
                    c.worker_cpu_per_round_s,
                    c.worker_io_per_round_s,
                    c.pull_overhead_s,
                    c.shard_ns_per_param,
                )
            },
        );
    SimConfig {
        workers: m.spec.workers,
        shards: m.spec.shards,
        params: o.params.max(1),
        staleness: if m.spec.staleness == "inf" {
            None
        } else {
            m.spec.staleness.parse().ok()
        },
        rounds,
        compute_s,
        compute_cv: 0.1,
        straggle,
        slow_worker: slow,
        push_bytes_per_param: o.push_bytes / per,
        pull_bytes_per_param: o.pull_bytes / per,
        // Whole-process CPU of the calibration run: the worker's compute phase is on its critical path, the rest of
        // its CPU is not; the shard's actor work (apply, the delta cut) is the floors' apply and serve cost, the rest
        // of the shard process's CPU (QUIC, connection tasks) is off the actor's path.
        worker_ns_per_param: 0.0,
        apply_ns_per_param: cal.apply_ns_per_param,
        serve_ns_per_param: cal.serve_ns_per_param,
        cpu_ns_per_byte: 0.0,
        shard_io_ns_per_param: (shard_ns - cal.apply_ns_per_param - cal.serve_ns_per_param)
            .max(0.0),
        link_bps: m.spec.rate.map_or(cal.unshaped_bps, |b| b as f64),
        latency_s: 50e-6,
        seed: 3,
        cores: Some(cal.cores),
        pull_overhead_s,
        worker_io_s,
    }
}

fn parse_pf(s: &str) -> Option<(f64, f64)> {
    let (p, f) = s.split_once(':')?;
    Some((p.parse().ok()?, f.parse().ok()?))
}

/// CPU costs for the simulator, from the floors and the 1-worker runs measured at the start of the study.
#[derive(Debug, Clone, Serialize)]
struct Calibration {
    apply_ns_per_param: f64,
    serve_ns_per_param: f64,
    cpu_ns_per_byte: f64,
    unshaped_bps: f64,
    cores: u32,
    /// Per scheme, from a 1-worker unshaped run on the study's shard count.
    per_scheme: Vec<SchemeCost>,
    floors: Vec<crate::floors::Floor>,
}

/// What one round costs with a scheme, from a 1-worker unshaped run (whole-process CPU, `getrusage`).
#[derive(Debug, Clone, Serialize)]
struct SchemeCost {
    scheme: String,
    /// Worker CPU per round on the critical path: the compute phase (clip, error feedback and encode included).
    worker_cpu_per_round_s: f64,
    /// The rest of the worker process's CPU per round (transport threads, pull decoding).
    worker_io_per_round_s: f64,
    /// Shard process CPU per round per parameter (apply, serve, QUIC), ns.
    shard_ns_per_param: f64,
    /// The measured pull wait minus its transfers and one-way latencies.
    pull_overhead_s: f64,
}

fn calibrate(env: &Env, a: &StudyArgs, log: &mut Vec<String>) -> Result<Calibration> {
    let floors = crate::floors::run(&crate::floors::FloorArgs {
        shard_params: 235_146 / a.shards as usize,
        scheme: "q4".into(),
        optimizer: "adam".into(),
        seconds: 1.0,
    })?;
    let get = |prefix: &str| floors.iter().find(|f| f.name.starts_with(prefix));
    let apply = get("shard apply").map_or(3.0, |f| 4.0 / f.fp32_gbps);
    let cut = get("delta cut").map_or(1.0, |f| 4.0 / f.fp32_gbps);
    let quinn = get("raw quinn").context("raw quinn floor")?;
    // CPU per wire byte of both ends together, halved per side.
    let per_byte = quinn.cpu_s_per_gb * quinn.fp32_gbps / quinn.bytes_gbps / 2.0;
    let mut cal = Calibration {
        apply_ns_per_param: apply,
        // A pull reply needs a delta cut once per version moved, shared by the workers; charged per reply.
        serve_ns_per_param: cut,
        cpu_ns_per_byte: per_byte,
        unshaped_bps: quinn.bytes_gbps * 8e9,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        per_scheme: Vec::new(),
        floors,
    };
    for scheme in ["q4", "none"] {
        let spec = Spec {
            workers: 1,
            scheme: scheme.into(),
            error_feedback: scheme != "none",
            rate: None,
            epochs: 1,
            eval: false,
            ..base_spec(a)
        };
        let m = measure(
            env,
            &format!("calibration {scheme} 1w×{}s", a.shards),
            spec,
            a,
            log,
        )?;
        let rounds = |o: &Outcome| o.rounds_per_worker.max(1.0);
        let compute = m.spread(|o| o.compute_per_round_s).median;
        let worker_cpu = m.spread(|o| o.worker_cpu_s / rounds(o)).median;
        let shard_ns = m
            .spread(|o| o.shard_cpu_s / rounds(o) / o.params.max(1) as f64 * 1e9)
            .median;
        // What the simulator does not model of a pull: the measured wait minus its transfer, the delta cut and
        // the latencies (each shard answers in parallel).
        let shards = f64::from(a.shards.max(1));
        let overhead = m
            .spread(|o| {
                let per_shard_bytes = o.pull_bytes / rounds(o) / shards;
                let wait = o.stall_fraction * o.wall_s / rounds(o);
                let serve = cal.serve_ns_per_param * o.params as f64 / shards * 1e-9;
                (wait - per_shard_bytes * 8.0 / cal.unshaped_bps - serve - 100e-6).max(0.0)
            })
            .median;
        cal.per_scheme.push(SchemeCost {
            scheme: scheme.to_string(),
            worker_cpu_per_round_s: compute.min(worker_cpu),
            worker_io_per_round_s: (worker_cpu - compute).max(0.0),
            shard_ns_per_param: shard_ns,
            pull_overhead_s: overhead,
        });
    }
    Ok(cal)
}

/// The study's ingest run: one shard of a 4M-parameter layout fed by two synthetic workers for 60 rounds.
const INGEST_RUN: [&str; 9] = [
    "ingest",
    "--workers",
    "2",
    "--shards",
    "1",
    "--params",
    "4000000",
    "--rounds",
    "60",
];

/// A flat `perf` profile of shard 0 during a q4 ingest run (top 15 symbols), when `perf` is installed.
fn profile_shard(me: &Path) -> Result<Option<String>> {
    if Command::new("perf")
        .arg("--version")
        .output()
        .map_or(true, |o| !o.status.success())
    {
        return Ok(None);
    }
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("perf.data");
    let out = Command::new(me)
        .args(INGEST_RUN)
        .env("TETHER_BENCH_PERF", &data)
        .output()?;
    if !out.status.success() || !data.exists() {
        eprintln!(
            "study: the profiled ingest run failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return Ok(None);
    }
    let rep = Command::new("perf")
        .args([
            "report",
            "--stdio",
            "--no-children",
            "--sort",
            "symbol",
            "-i",
        ])
        .arg(&data)
        .output()?;
    let text = String::from_utf8_lossy(&rep.stdout);
    let top: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .take(15)
        // perf pads the symbol column and appends empty "-  -" columns.
        .map(|l| l.trim_end().trim_end_matches(['-', ' ']))
        .collect();
    Ok(Some(top.join("\n") + "\n"))
}

/// Runs the study and writes the report.
pub fn run(a: &StudyArgs) -> Result<()> {
    let started = Instant::now();
    let sections: Vec<&str> = a.sections.split(',').map(str::trim).collect();
    let has = |s: &str| sections.contains(&s);
    let out_dir = a.out.parent().map(Path::to_path_buf).unwrap_or_default();
    let plots = if a.plots.is_absolute() {
        a.plots.clone()
    } else {
        out_dir.join(&a.plots)
    };
    std::fs::create_dir_all(&plots)?;
    let (data, batch, train_len) = if a.data_dir.join("train-images-idx3-ubyte").exists()
        || a.data_dir.join("train-images-idx3-ubyte.gz").exists()
    {
        (
            format!(
                "dataset = \"fashion-mnist\"\npath = \"{}\"",
                a.data_dir.display()
            ),
            128,
            60_000,
        )
    } else {
        ("dataset = \"digits\"".to_string(), 32, 1_437)
    };
    let env = Env {
        server: sibling("tether-server")?,
        worker: sibling("tether-worker")?,
        data,
        batch,
        train_len,
    };
    let dataset = if env.train_len == 60_000 {
        "Fashion-MNIST (60k/10k)"
    } else {
        "embedded digits (Fashion-MNIST absent)"
    };
    eprintln!(
        "study: {dataset}, {} repeats, {} epochs, target {}",
        a.repeats, a.epochs, a.target
    );
    let mut log = Vec::new();
    let cal = calibrate(&env, a, &mut log)?;
    let mut md = String::new();
    let host = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let date = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let _ = writeln!(md, "# Tether benchmarks\n");
    let _ = writeln!(
        md,
        "Written by `scripts/study.sh` (`tether-bench study --repeats {} --epochs {} --target {} --sections {}`) on \
         {date}: {host}, {cores} cores. Data: {dataset}; model MLP 784-256-128-10 (235,146 parameters) unless said; \
         Adam 1e-3 on the shards; {} workers × {} shards; q4 delta pulls. Every training run is real: one \
         `tether-server` or `tether-worker` process per network namespace, each namespace's link shaped with `tc tbf` \
         in both directions{}. Figures are medians over {} runs with (min–max); comparisons are ratios of medians \
         from this one invocation. The machine has {cores} cores for every process of a run, so compute slows as \
         workers are added: the link figures show what the network costs, not what a real cluster's compute would \
         be.\n",
        a.repeats,
        a.epochs,
        a.target,
        a.sections,
        a.workers,
        a.shards,
        if has_netem() { " (netem present but not used)" } else { " (this kernel has no netem: no added delay, links differ in rate only)" },
        a.repeats
    );
    let _ = writeln!(
        md,
        "## Floors (the figures the shard's ingest sits against)\n"
    );
    let _ = writeln!(
        md,
        "`tether-bench floors --shard-params {}` (one shard of the study's model):\n",
        235_146 / a.shards
    );
    let _ = writeln!(
        md,
        "| floor | fp32-eq GB/s | bytes GB/s | CPU-s per fp32 GB |\n|---|---|---|---|"
    );
    for f in &cal.floors {
        let _ = writeln!(
            md,
            "| {} | {:.3} | {:.3} | {:.3} |",
            f.name, f.fp32_gbps, f.bytes_gbps, f.cpu_s_per_gb
        );
    }
    let _ = writeln!(md);
    let mut validation_pool: Vec<Measured> = Vec::new();

    if has("ingest") {
        let _ = writeln!(md, "## Server ingest (tether-bench ingest)\n");
        let _ = writeln!(
            md,
            "One shard of a 4M-parameter layout, 2 synthetic workers running the real trainer (a memcpy gradient: \
             clip, error feedback, encode, push; delta pulls), s = inf, Adam on the shard, 60 rounds each, on a \
             namespace loopback unshaped and shaped to 10 Gbit/s (one bucket for both directions). \
             `tether-bench ingest --scheme S` in a namespace; medians over {} runs.\n",
            a.repeats
        );
        let _ = writeln!(
            md,
            "| link | push | ingest fp32-eq GB/s | × link rate | push wire GB/s | pull wire GB/s | shard CPU-s/GB | worker CPU-s/GB | push p50/p99 ms | pull p50/p99 ms |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        let me = std::env::current_exe()?;
        let mut at10 = None;
        for rate in [None, Some(10_000_000_000u64)] {
            for scheme in ["q4", "none"] {
                let mut reps: Vec<serde_json::Value> = Vec::new();
                for _ in 0..a.repeats {
                    let ns = tether_bench::netns::Loop::up(rate)?;
                    let dir = tempfile::tempdir()?;
                    let json = dir.path().join("ingest.json");
                    let out = ns
                        .command(&me)
                        .args(INGEST_RUN)
                        .args(["--scheme", scheme, "--json"])
                        .arg(&json)
                        .output()?;
                    if !out.status.success() {
                        bail!("ingest failed: {}", String::from_utf8_lossy(&out.stderr));
                    }
                    let v: serde_json::Value =
                        serde_json::from_str(&std::fs::read_to_string(&json)?)?;
                    reps.push(v["ingest"].clone());
                }
                let sp = |k: &str| {
                    Spread::of(
                        &reps
                            .iter()
                            .map(|r| r[k].as_f64().unwrap_or(f64::NAN))
                            .collect::<Vec<_>>(),
                    )
                };
                let pair = |k: &str, i: usize| {
                    Spread::of(
                        &reps
                            .iter()
                            .map(|r| r[k][i].as_f64().unwrap_or(f64::NAN))
                            .collect::<Vec<_>>(),
                    )
                    .median
                };
                let ingest = sp("ingest_fp32_gbps");
                let link = rate.map(|b| b as f64 / 8e9);
                if rate.is_some() && scheme == "q4" {
                    at10 = Some(ingest.median / link.unwrap_or(1.0));
                }
                let line = format!(
                    "| {} | {scheme} | {} | {} | {:.3} | {:.3} | {:.2} | {:.2} | {:.1} / {:.1} | {:.1} / {:.1} |",
                    rate_name(rate),
                    ingest.show(3),
                    link.map_or("—".into(), |l| format!("{:.2}×", ingest.median / l)),
                    sp("push_wire_gbps").median,
                    sp("pull_wire_gbps").median,
                    sp("server_cpu_s_per_gb").median,
                    sp("worker_cpu_s_per_gb").median,
                    pair("push_ms", 0),
                    pair("push_ms", 1),
                    pair("pull_ms", 0),
                    pair("pull_ms", 1),
                );
                eprintln!("{line}");
                let _ = writeln!(md, "{line}");
            }
        }
        if let Some(p) = profile_shard(&me)? {
            let _ = writeln!(
                md,
                "\nProfile of the shard process in the q4 run (`perf record -F 999`, flat; `TETHER_BENCH_PERF=FILE \
                 tether-bench ingest`), the top symbols by samples:\n\n```\n{p}```\n"
            );
        }
        if let Some(r) = at10 {
            let _ = writeln!(
                md,
                "\n**Goal server ingest at 10 Gbit/s ≥ 2× the link rate: measured {r:.2}×** ({}).\n",
                if r >= 2.0 { "met" } else { "missed" }
            );
        }
    }

    if has("compression") {
        let rates: [Rate; 4] = [
            None,
            Some(10_000_000_000),
            Some(1_000_000_000),
            Some(100_000_000),
        ];
        let configs: Vec<(&str, &str, bool, u32)> = vec![
            ("fp32", "none", false, 0),
            ("bf16", "bf16", true, 0),
            ("q8", "q8", true, 0),
            ("q4", "q4", true, 0),
            ("q2", "q2", true, 0),
            ("q4, no EF", "q4", false, 0),
            ("q2, no EF", "q2", false, 0),
            ("q4 + local steps 8 (BSP rounds)", "q4", true, 8),
        ];
        let mut grid: Vec<Measured> = Vec::new();
        for rate in rates {
            for (label, scheme, ef, h) in &configs {
                let spec = Spec {
                    scheme: scheme.to_string(),
                    error_feedback: *ef,
                    local_steps: *h,
                    // Local-step rounds are synchronous (BSP), as in the quickstart.
                    staleness: if *h > 0 { "0".into() } else { "3".into() },
                    rate,
                    ..base_spec(a)
                };
                grid.push(measure(&env, label, spec, a, &mut log)?);
            }
        }
        let _ = writeln!(md, "## Push schemes across link speeds\n");
        let _ = writeln!(
            md,
            "Time to {:.2} test accuracy (worker 0 evaluates every 24 steps), final accuracy after {} epochs, and bytes \
             on the wire (pushes + pulls, all workers). SSP s = 3, per-step pushes unless said.\n",
            a.target, a.epochs
        );
        let _ = writeln!(md, "| link | push | pull | time to target s | final accuracy | wire MB | vs fp32 time |\n|---|---|---|---|---|---|---|");
        for rate in rates {
            let fp32 = grid
                .iter()
                .find(|m| m.spec.rate == rate && m.spec.scheme == "none")
                .map(|m| m.ttt().median);
            for m in grid.iter().filter(|m| m.spec.rate == rate) {
                let t = m.ttt();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} |",
                    rate_name(rate),
                    m.label,
                    pull_name(&m.spec.scheme),
                    m.ttt_cell(),
                    m.spread(|o| o.final_accuracy).show(4),
                    m.spread(|o| o.wire_bytes / 1e6).show(1),
                    fp32.map_or("—".into(), |f| format!("{:.2}×", f / t.median))
                );
            }
        }
        let q = |rate: Rate, label: &str| {
            grid.iter()
                .find(|m| m.spec.rate == rate && m.label == label)
                .map(|m| m.ttt().median)
        };
        if let (Some(f), Some(q4)) = (q(Some(1_000_000_000), "fp32"), q(Some(1_000_000_000), "q4"))
        {
            let _ = writeln!(
                md,
                "\n**Goal q4 vs fp32 at 1 Gbit/s, time to target ≥ 4×: measured {:.2}×** ({}).\n",
                f / q4,
                if f / q4 >= 4.0 { "met" } else { "missed" }
            );
        }
        let mut series: Vec<Series> = Vec::new();
        for (label, ..) in &configs {
            let pts: Vec<(f64, f64)> = rates
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    grid.iter()
                        .find(|m| m.spec.rate == *r && m.label == *label)
                        .map(|m| (i as f64, m.ttt().median))
                })
                .collect();
            series.push((label.to_string(), pts));
        }
        plot_or_warn(
            lines(
                &plots.join("schemes_time_to_target.png"),
                "Time to target: unshaped (0), 10G (1), 1G (2), 100M (3)",
                "link",
                "seconds",
                &series,
                (false, true),
            ),
            "plot",
        );
        let mut bytes: Vec<Series> = Vec::new();
        for (label, ..) in &configs {
            let pts: Vec<(f64, f64)> = grid
                .iter()
                .filter(|m| m.label == *label)
                .flat_map(|m| {
                    m.runs
                        .iter()
                        .map(|o| (o.wire_bytes / 1e6, o.final_accuracy))
                })
                .collect();
            bytes.push((label.to_string(), pts));
        }
        plot_or_warn(
            lines(
                &plots.join("bytes_vs_accuracy.png"),
                "Final accuracy against bytes on the wire",
                "wire MB (log)",
                "accuracy",
                &bytes,
                (true, false),
            ),
            "plot",
        );
        let _ = writeln!(md, "![time to target](bench/plots/schemes_time_to_target.png)\n![bytes vs accuracy](bench/plots/bytes_vs_accuracy.png)\n");
    }

    if has("links") {
        let mbit = |m: u64| Some(m * 1_000_000);
        let links: [(&str, Option<(Rate, Rate)>); 3] = [
            ("unshaped", None),
            ("10 Mbit/s both ways", Some((mbit(10), mbit(10)))),
            ("100 down / 10 up Mbit/s", Some((mbit(10), mbit(100)))),
        ];
        let configs: [(&str, bool, u32); 3] = [
            ("q4 both ways, H = 16 (the quickstart before)", false, 0),
            ("topk2 both ways, H = 16 (the quickstart now)", true, 0),
            ("topk2 both ways, link-aware H 16..=64", true, 64),
        ];
        let mut grid: Vec<(usize, Measured)> = Vec::new();
        for (li, (_, link)) in links.iter().enumerate() {
            for (label, sparse, hmax) in configs {
                let spec = Spec {
                    local_steps: 16,
                    local_steps_max: hmax,
                    sparse,
                    staleness: "0".into(),
                    rate: None,
                    worker_link: *link,
                    ..base_spec(a)
                };
                grid.push((li, measure(&env, label, spec, a, &mut log)?));
            }
        }
        let _ = writeln!(
            md,
            "## Slow links: sparse pseudo-gradients and link-aware local steps\n"
        );
        let _ = writeln!(
            md,
            "Local-step rounds (BSP, H = 16 inner Adam steps) as the quickstart runs them, {} epochs. The shards sit on \
             unshaped links; each worker's link is shaped as the row says (tc tbf on both ends of its veth: `up` is \
             what the worker sends). topk2 is block top-k with 2-bit values, 1 in 16 per block of 4096, both ways, \
             outer lr 1.4. \"vs unshaped\" divides the same configuration's wall time by its unshaped one; \"vs fp32 \
             sync\" is the bytes per-step fp32 synchronisation of the same steps would move, over the bytes moved; \
             \"largest push\" is the largest round of pushes one worker sent (its largest burst).\n",
            a.epochs
        );
        let _ = writeln!(
            md,
            "| link | sync | time to target s | final accuracy | wall s | vs unshaped | wire MB push / pull | vs fp32 sync | largest push KB | H at the end |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for (li, (lname, _)) in links.iter().enumerate() {
            for (_, m) in grid.iter().filter(|(l, _)| *l == li) {
                let base = grid
                    .iter()
                    .find(|(l, b)| *l == 0 && b.label == m.label)
                    .map(|(_, b)| b.spread(|o| o.wall_s).median);
                let wall = m.spread(|o| o.wall_s);
                let _ = writeln!(
                    md,
                    "| {lname} | {} | {} | {} | {} | {} | {} / {} | {:.0}× | {:.1} | {} |",
                    m.label,
                    m.ttt_cell(),
                    m.spread(|o| o.final_accuracy).show(4),
                    wall.show(1),
                    base.map_or("—".into(), |b| format!("{:.2}×", wall.median / b)),
                    m.spread(|o| o.push_bytes / 1e6).show(2),
                    m.spread(|o| o.pull_bytes / 1e6).show(2),
                    m.spread(|o| o.fp32_bytes / o.wire_bytes.max(1.0)).median,
                    m.spread(|o| o.max_push_bytes / 1e3).median,
                    m.spread(|o| o.h_picked as f64).median
                );
            }
        }
        let _ = writeln!(md);
    }

    if has("stragglers") {
        let modes = [
            ("BSP", "0"),
            ("SSP s=1", "1"),
            ("SSP s=3", "3"),
            ("SSP s=8", "8"),
            ("async", "inf"),
        ];
        let mut rows: Vec<(String, Measured)> = Vec::new();
        for (kind, all, first) in [
            ("transient (p=0.1, 3×)", Some("0.1:3"), None),
            ("persistent (worker 0, 2×)", None, Some("1:2")),
        ] {
            for (name, s) in modes {
                let spec = Spec {
                    staleness: s.into(),
                    straggle_all: all.map(String::from),
                    straggle_first: first.map(String::from),
                    ..base_spec(a)
                };
                rows.push((kind.to_string(), measure(&env, name, spec, a, &mut log)?));
            }
        }
        let _ = writeln!(md, "## Bounded staleness under stragglers (1 Gbit/s, q4)\n");
        let _ = writeln!(md, "| stragglers | mode | time to target s | final accuracy | stall fraction | vs BSP | max lead | staleness histogram (lo:count) |\n|---|---|---|---|---|---|---|---|");
        for (kind, m) in &rows {
            let bsp = rows
                .iter()
                .find(|(k, b)| k == kind && b.label == "BSP")
                .map(|(_, b)| b.ttt().median);
            let hist = m
                .runs
                .first()
                .map(|o| {
                    o.staleness_histogram
                        .iter()
                        .map(|(l, c)| format!("{l}:{c}"))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .unwrap_or_default();
            let _ = writeln!(
                md,
                "| {kind} | {} | {} | {} | {} | {} | {} | {hist} |",
                m.label,
                m.ttt_cell(),
                m.spread(|o| o.final_accuracy).show(4),
                m.spread(|o| o.stall_fraction).show(2),
                bsp.map_or("—".into(), |b| format!("{:.2}×", b / m.ttt().median)),
                m.runs.iter().map(|o| o.max_lead).max().unwrap_or(0)
            );
        }
        let find = |kind: &str, label: &str| {
            rows.iter()
                .find(|(k, m)| k.starts_with(kind) && m.label == label)
                .map(|(_, m)| m)
        };
        if let (Some(b), Some(s3)) = (find("transient", "BSP"), find("transient", "SSP s=3")) {
            let ratio = b.ttt().median / s3.ttt().median;
            let loss = (b.spread(|o| o.final_accuracy).median
                - s3.spread(|o| o.final_accuracy).median)
                * 100.0;
            let _ = writeln!(
                md,
                "\n**Goal SSP s=3 vs BSP under transient stragglers, time to target ≥ 1.5× at ≤ 0.5 pt: measured {ratio:.2}× at {loss:+.2} pt** ({}). A persistent straggler gains only s rounds of slack: every mode but async ends at its pace (the table's second half).\n",
                if ratio >= 1.5 && loss <= 0.5 { "met" } else { "missed" }
            );
        }
        let mut series: Vec<Series> = Vec::new();
        for (kind, m) in &rows {
            if let Some(o) = m.runs.first() {
                let total: u64 = o
                    .staleness_histogram
                    .iter()
                    .map(|h| h.1)
                    .sum::<u64>()
                    .max(1);
                series.push((
                    format!("{} {}", kind.split(' ').next().unwrap_or(""), m.label),
                    o.staleness_histogram
                        .iter()
                        .map(|(l, c)| (*l as f64, *c as f64 / total as f64))
                        .collect(),
                ));
            }
        }
        plot_or_warn(
            lines(
                &plots.join("staleness_histograms.png"),
                "Staleness of applied pushes",
                "staleness (versions)",
                "fraction",
                &series,
                (false, false),
            ),
            "plot",
        );
        let _ = writeln!(md, "![staleness](bench/plots/staleness_histograms.png)\n");
    }

    if has("scaling") {
        let mut cells: Vec<Measured> = Vec::new();
        for shards in [1u32, 2, 4] {
            for workers in [1u32, 2, 4, 8] {
                let spec = Spec {
                    workers,
                    shards,
                    epochs: 1,
                    eval: false,
                    ..base_spec(a)
                };
                cells.push(measure(
                    &env,
                    &format!("{workers}w×{shards}s"),
                    spec,
                    a,
                    &mut log,
                )?);
            }
        }
        let _ = writeln!(
            md,
            "## Scaling: workers × shards (1 Gbit/s, q4, s = 3, one epoch)\n"
        );
        let _ = writeln!(md, "Efficiency = samples/s ÷ (workers × the 1-worker samples/s at the same shard count). On {cores} cores the workers share the CPU, so efficiency here measures the system's overhead plus CPU sharing, not a cluster's.\n");
        let _ = writeln!(
            md,
            "| shards | workers | samples/s | efficiency | stall fraction |\n|---|---|---|---|---|"
        );
        let mut series: Vec<Series> = Vec::new();
        for shards in [1u32, 2, 4] {
            let one = cells
                .iter()
                .find(|m| m.spec.shards == shards && m.spec.workers == 1)
                .map(|m| m.spread(|o| o.samples_per_s).median);
            let mut pts = Vec::new();
            for m in cells.iter().filter(|m| m.spec.shards == shards) {
                let sps = m.spread(|o| o.samples_per_s);
                let eff = one.map_or(f64::NAN, |o| sps.median / (o * f64::from(m.spec.workers)));
                let _ = writeln!(
                    md,
                    "| {shards} | {} | {} | {eff:.2} | {} |",
                    m.spec.workers,
                    sps.show(0),
                    m.spread(|o| o.stall_fraction).show(2)
                );
                pts.push((f64::from(m.spec.workers), sps.median));
            }
            series.push((format!("{shards} shards"), pts));
        }
        plot_or_warn(
            lines(
                &plots.join("scaling.png"),
                "Samples/s against workers",
                "workers",
                "samples/s",
                &series,
                (false, false),
            ),
            "plot",
        );
        let _ = writeln!(md, "\n![scaling](bench/plots/scaling.png)\n");
        validation_pool.extend(cells);
    }

    if has("sim") {
        // Validation runs: throughput only (no evaluation), 1–8 workers on the two shaped links, both pushes.
        for rate in [Some(1_000_000_000), Some(100_000_000)] {
            for scheme in ["q4", "none"] {
                for workers in [1u32, 2, 4, 8] {
                    let spec = Spec {
                        workers,
                        scheme: scheme.into(),
                        error_feedback: scheme != "none",
                        rate,
                        epochs: 1,
                        eval: false,
                        ..base_spec(a)
                    };
                    let label = format!("{scheme} {workers}w");
                    validation_pool.push(measure(&env, &label, spec, a, &mut log)?);
                }
            }
        }
        for (label, staleness) in [("transient BSP", "0"), ("transient s=3", "3")] {
            let spec = Spec {
                staleness: staleness.into(),
                straggle_all: Some("0.1:3".into()),
                epochs: 1,
                eval: false,
                ..base_spec(a)
            };
            validation_pool.push(measure(&env, label, spec, a, &mut log)?);
        }
        let _ = writeln!(md, "## Simulator validation\n");
        let _ = writeln!(
            md,
            "`tether-bench simulate` replays the SSP gate and the pull → compute → push pipeline (see `bench/src/sim.rs`). \
             Calibration, all measured in this invocation (the floors above: shard apply {:.2} ns/param, pull serve \
             {:.2} ns/param, QUIC {:.3} ns per wire byte per side, are what the prediction uses): unshaped links at \
             {:.1} Gbit/s (raw quinn), {} shared cores; whole-process CPU per round (getrusage of the worker and the \
             shard processes) and the fixed pull overhead from one 1-worker unshaped run per scheme on the same shards ({}); bytes per parameter from each run; 50 µs one way. The simulator \
             then predicts the 1–8-worker runs on the shaped links, where the workers and shards share the cores. \
             Throughput runs do not evaluate. Error = |sim − real| / real for both figures. The goal is ≤ 15% on \
             every row.\n",
            cal.apply_ns_per_param,
            cal.serve_ns_per_param,
            cal.cpu_ns_per_byte,
            cal.unshaped_bps / 1e9,
            cal.cores,
            cal.per_scheme
                .iter()
                .map(|c| format!(
                    "{}: worker {:.2} ms compute + {:.2} ms transport CPU per round, shard {:.2} ns per parameter \
                     per round, {:.2} ms per pull",
                    c.scheme,
                    c.worker_cpu_per_round_s * 1e3,
                    c.worker_io_per_round_s * 1e3,
                    c.shard_ns_per_param,
                    c.pull_overhead_s * 1e3
                ))
                .collect::<Vec<_>>()
                .join("; ")
        );
        let _ = writeln!(md, "| run | link | real rounds/s (min–max) | sim rounds/s | error | real stall | sim stall | error |\n|---|---|---|---|---|---|---|---|");
        let mut worst: f64 = 0.0;
        for m in &validation_pool {
            let real_t = m.spread(|o| o.rounds_per_s).median;
            let real_s = m.spread(|o| o.stall_fraction).median;
            let Some(o) = m.runs.first() else { continue };
            let sim = simulate(&sim_of(m, o, &cal))?;
            let e1 = relative_error(sim.rounds_per_s, real_t);
            let e2 = relative_error(sim.stall_fraction, real_s);
            worst = worst.max(e1).max(e2);
            let _ = writeln!(
                md,
                "| {} {}w×{}s s={} {} | {} | {} | {:.2} | {:.1}% | {real_s:.3} | {:.3} | {:.1}% |",
                m.label,
                m.spec.workers,
                m.spec.shards,
                m.spec.staleness,
                m.spec
                    .straggle_all
                    .as_deref()
                    .map(|s| format!("straggle {s}"))
                    .or(m.spec.straggle_first.as_deref().map(|s| format!("w0 {s}")))
                    .unwrap_or_default(),
                rate_name(m.spec.rate),
                m.spread(|o| o.rounds_per_s).show(1),
                sim.rounds_per_s,
                e1 * 100.0,
                sim.stall_fraction,
                e2 * 100.0
            );
        }
        let within = validation_pool
            .iter()
            .filter(|m| {
                let sp = m.spread(|o| o.rounds_per_s);
                (sp.max - sp.min) / sp.median <= 0.3
            })
            .count();
        let _ = writeln!(
            md,
            "\n**Goal simulator error ≤ 15% on every row: worst {:.1}%** ({}). {} of {} rows' real runs stay within \
             ±15% of their own median (min–max); on the others the machine's own noise exceeds the goal.\n",
            worst * 100.0,
            if worst <= 0.15 { "met" } else { "missed" },
            within,
            validation_pool.len()
        );
        let base = SimConfig {
            pull_overhead_s: cal.per_scheme.first().map_or(200e-6, |c| c.pull_overhead_s),
            apply_ns_per_param: cal.apply_ns_per_param,
            serve_ns_per_param: cal.serve_ns_per_param,
            cpu_ns_per_byte: cal.cpu_ns_per_byte,
            ..prediction_base()
        };
        let t = Instant::now();
        let rows = predict(&base)?;
        let _ = writeln!(md, "## Prediction: 64–1,024 workers × 8–64 shards\n");
        let _ = writeln!(
            md,
            "A 100M-parameter model, 0.5 s compute per round (cv 0.1), batch 128, q4 pushes and q4 delta pulls at {:.2} \
             B/param each way, s = 3, the CPU costs calibrated above, one NIC per node. {} simulations in {:.1} s \
             (`tether-bench simulate --predict bench/plots/prediction.png`).\n",
            base.push_bytes_per_param,
            rows.len(),
            t.elapsed().as_secs_f64()
        );
        md.push_str(&prediction_table(&rows));
        md.push_str(&saturation(&rows));
        plot_or_warn(
            crate::plot::prediction(&plots.join("prediction.png"), &rows),
            "prediction",
        );
        let _ = writeln!(md, "\n![prediction](bench/plots/prediction.png)\n");
    }
    let _ = writeln!(md, "## Run log\n\n```");
    for l in &log {
        let _ = writeln!(md, "{l}");
    }
    let _ = writeln!(
        md,
        "```\n\nStudy wall time: {:.0} s.",
        started.elapsed().as_secs_f64()
    );
    std::fs::write(&a.out, md)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}
