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

use crate::cluster::{certificates, sibling, Proc, RunConfig};
use crate::netns::{has_netem, Rate, Star};
use crate::plot::{lines, Series};

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
    #[arg(long, default_value_t = 0.83)]
    pub target: f64,
    /// Workers of the compression and straggler runs.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Shards of the compression and straggler runs.
    #[arg(long, default_value_t = 2)]
    pub shards: u32,
    /// Sections to run (comma-separated): compression, stragglers, scaling, sim.
    #[arg(long, default_value = "compression,stragglers,scaling,sim")]
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
    /// `P:F` for every worker (transient) …
    straggle_all: Option<String>,
    /// … or for worker 0 only (persistent).
    straggle_first: Option<String>,
    epochs: u32,
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

fn real_run(env: &Env, s: &Spec, target: f64) -> Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let nodes = (s.shards + s.workers) as usize;
    let star = Star::up(nodes, s.rate)?;
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
            "epochs = {}\nbatch = {}\neval_every = {}\nlocal_steps = {}",
            s.epochs,
            env.batch,
            if s.local_steps > 0 {
                s.local_steps * 2
            } else {
                25
            },
            s.local_steps
        ),
        optimizer: "kind = \"adam\"\nlr = 0.001".into(),
        compression: format!(
            "scheme = \"{}\"\nerror_feedback = {}\nzstd = true\npull = \"delta\"",
            s.scheme, s.error_feedback
        ),
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
        workers.push(Proc::spawn(c, dir.path().join(format!("worker-{r}.log")))?);
    }
    for (r, p) in workers.iter_mut().enumerate() {
        if !p.wait_exit(Duration::from_secs(900))? {
            bail!("worker {r} failed:\n{}", p.log_tail(3000));
        }
    }
    for p in &mut shards {
        p.wait_exit(Duration::from_secs(30))?;
    }
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
    fn ttt(&self) -> Spread {
        self.spread(|o| o.time_to_target.unwrap_or(f64::NAN))
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
        straggle_all: None,
        straggle_first: None,
        epochs: a.epochs,
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

/// The simulator's view of a measured run: its own step times and bytes, the floors' CPU costs, the link's rate.
fn sim_of(m: &Measured, o: &Outcome, cal: &Calibration) -> SimConfig {
    let rounds = o.rounds_per_worker.round().max(1.0) as u64;
    let per = (o.params as f64 * rounds as f64 * f64::from(m.spec.workers)).max(1.0);
    let (straggle, slow) = match (&m.spec.straggle_all, &m.spec.straggle_first) {
        (Some(s), _) => (parse_pf(s), None),
        (None, Some(s)) => (None, parse_pf(s).map(|p| p.1)),
        _ => (None, None),
    };
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
        // The run's compute time per round includes its straggler waits; the simulator adds its own.
        compute_s: o.compute_per_round_s / straggle.map_or(1.0, |(p, f)| 1.0 + p * (f - 1.0)),
        compute_cv: 0.15,
        straggle,
        slow_worker: slow,
        push_bytes_per_param: o.push_bytes / per,
        pull_bytes_per_param: o.pull_bytes / per,
        worker_ns_per_param: 0.0,
        apply_ns_per_param: cal.apply_ns_per_param,
        serve_ns_per_param: cal.serve_ns_per_param,
        cpu_ns_per_byte: cal.cpu_ns_per_byte,
        link_bps: m.spec.rate.map_or(cal.unshaped_bps, |b| b as f64),
        latency_s: 50e-6,
        seed: 3,
    }
}

fn parse_pf(s: &str) -> Option<(f64, f64)> {
    let (p, f) = s.split_once(':')?;
    Some((p.parse().ok()?, f.parse().ok()?))
}

/// CPU costs for the simulator, from the floors measured at the start of the study.
#[derive(Debug, Clone, Serialize)]
struct Calibration {
    apply_ns_per_param: f64,
    serve_ns_per_param: f64,
    cpu_ns_per_byte: f64,
    unshaped_bps: f64,
    floors: Vec<crate::floors::Floor>,
}

fn calibrate(params_per_shard: usize) -> Result<Calibration> {
    let floors = crate::floors::run(&crate::floors::FloorArgs {
        shard_params: params_per_shard,
        scheme: "q4".into(),
        optimizer: "adam".into(),
        seconds: 1.0,
    })?;
    let get = |prefix: &str| floors.iter().find(|f| f.name.starts_with(prefix));
    let apply = get("shard apply").map_or(3.0, |f| 4.0 / f.fp32_gbps);
    let decode = get("q4 decode").map_or(1.0, |f| 4.0 / f.fp32_gbps);
    let quinn = get("raw quinn").context("raw quinn floor")?;
    // CPU per wire byte of both ends together, halved per side.
    let per_byte = quinn.cpu_s_per_gb * quinn.fp32_gbps / quinn.bytes_gbps / 2.0;
    Ok(Calibration {
        apply_ns_per_param: apply,
        // A pull reply cuts and encodes (about a decode's work) once per delta, shared by the workers.
        serve_ns_per_param: decode,
        cpu_ns_per_byte: per_byte,
        unshaped_bps: quinn.bytes_gbps * 8e9,
        floors,
    })
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
    let cal = calibrate(235_146 / a.shards as usize)?;
    let mut log = Vec::new();
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

    if has("compression") {
        let rates: [Rate; 4] = [
            None,
            Some(10_000_000_000),
            Some(1_000_000_000),
            Some(100_000_000),
        ];
        let configs: Vec<(&str, &str, bool, u32)> = vec![
            ("fp32 (none)", "none", false, 0),
            ("bf16", "bf16", true, 0),
            ("q8", "q8", true, 0),
            ("q4", "q4", true, 0),
            ("q2", "q2", true, 0),
            ("q4, no EF", "q4", false, 0),
            ("q2, no EF", "q2", false, 0),
            ("q4 + local steps 8", "q4", true, 8),
        ];
        let mut grid: Vec<Measured> = Vec::new();
        for rate in rates {
            for (label, scheme, ef, h) in &configs {
                let spec = Spec {
                    scheme: scheme.to_string(),
                    error_feedback: *ef,
                    local_steps: *h,
                    rate,
                    ..base_spec(a)
                };
                grid.push(measure(&env, label, spec, a, &mut log)?);
            }
        }
        let _ = writeln!(md, "## Push schemes across link speeds\n");
        let _ = writeln!(
            md,
            "Time to {:.2} test accuracy (worker 0 evaluates every 25 rounds), final accuracy after {} epochs, and bytes \
             on the wire (pushes + pulls, all workers). SSP s = 3, per-step pushes unless said.\n",
            a.target, a.epochs
        );
        let _ = writeln!(md, "| link | scheme | time to target s | final accuracy | wire MB | vs fp32 time |\n|---|---|---|---|---|---|");
        for rate in rates {
            let fp32 = grid
                .iter()
                .find(|m| m.spec.rate == rate && m.spec.scheme == "none")
                .map(|m| m.ttt().median);
            for m in grid.iter().filter(|m| m.spec.rate == rate) {
                let t = m.ttt();
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} |",
                    rate_name(rate),
                    m.label,
                    t.show(1),
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
        if let (Some(f), Some(q4)) = (
            q(Some(1_000_000_000), "fp32 (none)"),
            q(Some(1_000_000_000), "q4"),
        ) {
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
        lines(
            &plots.join("schemes_time_to_target.png"),
            "Time to target: unshaped (0), 10G (1), 1G (2), 100M (3)",
            "link",
            "seconds",
            &series,
            (false, true),
        )?;
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
        lines(
            &plots.join("bytes_vs_accuracy.png"),
            "Final accuracy against bytes on the wire",
            "wire MB (log)",
            "accuracy",
            &bytes,
            (true, false),
        )?;
        let _ = writeln!(md, "![time to target](bench/plots/schemes_time_to_target.png)\n![bytes vs accuracy](bench/plots/bytes_vs_accuracy.png)\n");
        validation_pool.extend(
            grid.into_iter()
                .filter(|m| m.spec.rate == Some(100_000_000) || m.spec.rate == Some(1_000_000_000))
                .filter(|m| {
                    m.spec.local_steps == 0
                        && (m.spec.scheme == "q4" || m.spec.scheme == "none")
                        && m.spec.error_feedback == (m.spec.scheme != "none")
                }),
        );
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
                m.ttt().show(1),
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
        lines(
            &plots.join("staleness_histograms.png"),
            "Staleness of applied pushes",
            "staleness (versions)",
            "fraction",
            &series,
            (false, false),
        )?;
        let _ = writeln!(md, "![staleness](bench/plots/staleness_histograms.png)\n");
        validation_pool.extend(
            rows.into_iter()
                .map(|(_, m)| m)
                .filter(|m| m.spec.staleness == "0" || m.spec.staleness == "3"),
        );
    }

    if has("scaling") {
        let mut cells: Vec<Measured> = Vec::new();
        for shards in [1u32, 2, 4] {
            for workers in [1u32, 2, 4, 8] {
                let spec = Spec {
                    workers,
                    shards,
                    epochs: 1,
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
        lines(
            &plots.join("scaling.png"),
            "Samples/s against workers",
            "workers",
            "samples/s",
            &series,
            (false, false),
        )?;
        let _ = writeln!(md, "\n![scaling](bench/plots/scaling.png)\n");
        validation_pool.extend(cells);
    }

    if has("sim") {
        let _ = writeln!(md, "## Simulator validation\n");
        let _ = writeln!(
            md,
            "`tether-bench simulate` replays the SSP gate and the pull → compute → push pipeline (see `bench/src/sim.rs`). \
             Calibration: shard apply {:.2} ns/param and pull serve {:.2} ns/param from the floors above, QUIC {:.3} ns \
             per wire byte per side from the raw-quinn floor, unshaped links at {:.1} Gbit/s (raw quinn), each run's \
             own compute time per round and bytes per parameter, 50 µs one way. Error = |sim − real| / real; the goal \
             is ≤ 15% on every row.\n",
            cal.apply_ns_per_param,
            cal.serve_ns_per_param,
            cal.cpu_ns_per_byte,
            cal.unshaped_bps / 1e9
        );
        let _ = writeln!(md, "| run | link | real rounds/s | sim rounds/s | error | real stall | sim stall | error (of 1 − stall) |\n|---|---|---|---|---|---|---|---|");
        let mut worst: f64 = 0.0;
        for m in &validation_pool {
            let real_t = m.spread(|o| o.rounds_per_s).median;
            let real_s = m.spread(|o| o.stall_fraction).median;
            let Some(o) = m.runs.first() else { continue };
            let sim = simulate(&sim_of(m, o, &cal))?;
            let e1 = relative_error(sim.rounds_per_s, real_t);
            // The stall fraction is compared as the busy fraction 1 − stall (a relative error on a small stall
            // fraction is meaningless).
            let e2 = relative_error(1.0 - sim.stall_fraction, 1.0 - real_s);
            worst = worst.max(e1).max(e2);
            let _ = writeln!(
                md,
                "| {} {}w×{}s s={} {} | {} | {real_t:.2} | {:.2} | {:.1}% | {real_s:.3} | {:.3} | {:.1}% |",
                m.label,
                m.spec.workers,
                m.spec.shards,
                m.spec.staleness,
                m.spec.straggle_all.as_deref().map(|s| format!("straggle {s}")).or(m.spec.straggle_first.as_deref().map(|s| format!("w0 {s}"))).unwrap_or_default(),
                rate_name(m.spec.rate),
                sim.rounds_per_s,
                e1 * 100.0,
                sim.stall_fraction,
                e2 * 100.0
            );
        }
        let _ = writeln!(
            md,
            "\n**Goal simulator error ≤ 15% on every row: worst {:.1}%** ({}).\n",
            worst * 100.0,
            if worst <= 0.15 { "met" } else { "missed" }
        );
        let base = SimConfig {
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
        crate::plot::prediction(&plots.join("prediction.png"), &rows)?;
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
