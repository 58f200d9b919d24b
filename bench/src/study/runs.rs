//! One real training run on the link harness and its repeats. A [`Spec`] names the cluster (workers, shards, push
//! scheme, staleness, links, stragglers); [`real_run`] brings up a star of namespaces, one `tether-server` or
//! `tether-worker` process per node, waits for the workers, and reads their JSON reports into an [`Outcome`];
//! [`measure`] repeats it `--repeats` times into a [`Measured`]. Every run is a fresh star and a fresh temporary
//! folder: nothing carries over between runs.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use tether_bench::netns::{Rate, Star};
use tether_bench::stats::{time_to, Spread};

use super::StudyArgs;
use crate::cluster::{certificates, cpu_seconds, pull_lines, sibling, Proc, RunConfig};

/// One real training run on the harness.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Spec {
    pub(super) workers: u32,
    pub(super) shards: u32,
    pub(super) scheme: String,
    pub(super) error_feedback: bool,
    pub(super) local_steps: u32,
    pub(super) staleness: String,
    pub(super) rate: Rate,
    /// When set, the shards sit on unshaped links and every worker's link is `(up, down)` (the `links` section);
    /// else every node's link is `rate` both ways.
    pub(super) worker_link: Option<(Rate, Rate)>,
    /// topk2 both ways (bucket 4096, keep 16, outer lr 1.4: the quickstart's defaults) instead of `scheme`.
    pub(super) sparse: bool,
    /// `train.local_steps_max` (0: H pinned).
    pub(super) local_steps_max: u32,
    /// `P:F` for every worker (transient) …
    pub(super) straggle_all: Option<String>,
    /// … or for worker 0 only (persistent).
    pub(super) straggle_first: Option<String>,
    pub(super) epochs: u32,
    /// Whether worker 0 evaluates (for time to target); off for throughput runs (evaluation is not training).
    pub(super) eval: bool,
}

/// What it measured.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Outcome {
    pub(super) wall_s: f64,
    pub(super) time_to_target: Option<f64>,
    pub(super) final_accuracy: f64,
    pub(super) wire_bytes: f64,
    pub(super) push_bytes: f64,
    pub(super) pull_bytes: f64,
    pub(super) rounds_per_worker: f64,
    pub(super) samples_per_s: f64,
    pub(super) rounds_per_s: f64,
    pub(super) stall_fraction: f64,
    pub(super) compute_per_round_s: f64,
    pub(super) staleness_histogram: Vec<(u64, u64)>,
    pub(super) max_lead: u64,
    pub(super) params: u64,
    /// Bytes per-step fp32 synchronisation of the same steps would have moved, both ways.
    pub(super) fp32_bytes: f64,
    /// Largest bytes one push carried (the largest burst on a worker's uplink).
    pub(super) max_push_bytes: f64,
    /// Inner steps per round at the end (the largest over workers).
    pub(super) h_picked: u64,
    /// CPU seconds of the worker processes (all threads), and of the shard processes.
    pub(super) worker_cpu_s: f64,
    pub(super) shard_cpu_s: f64,
}

/// The table's name for a link rate (`unshaped`, `10 Gbit/s`, `100 Mbit/s`).
pub(super) fn rate_name(r: Rate) -> String {
    match r {
        None => "unshaped".into(),
        Some(b) if b >= 1_000_000_000 => format!("{} Gbit/s", b / 1_000_000_000),
        Some(b) => format!("{} Mbit/s", b / 1_000_000),
    }
}

/// The binaries every run starts and the data they train on.
pub(super) struct Env {
    server: PathBuf,
    worker: PathBuf,
    data: String,
    batch: u64,
    train_len: u64,
}

impl Env {
    /// The sibling `tether-server` and `tether-worker`, on Fashion-MNIST from `data_dir` or the embedded digits.
    pub(super) fn find(data_dir: &Path) -> Result<Env> {
        let (data, batch, train_len) = if data_dir.join("train-images-idx3-ubyte").exists()
            || data_dir.join("train-images-idx3-ubyte.gz").exists()
        {
            (
                format!(
                    "dataset = \"fashion-mnist\"\npath = \"{}\"",
                    data_dir.display()
                ),
                128,
                60_000,
            )
        } else {
            ("dataset = \"digits\"".to_string(), 32, 1_437)
        };
        Ok(Env {
            server: sibling("tether-server")?,
            worker: sibling("tether-worker")?,
            data,
            batch,
            train_len,
        })
    }

    /// The report's name for the data set.
    pub(super) fn dataset(&self) -> &'static str {
        if self.train_len == 60_000 {
            "Fashion-MNIST (60k/10k)"
        } else {
            "embedded digits (Fashion-MNIST absent)"
        }
    }
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
pub(super) fn pull_name(scheme: &str) -> String {
    match pull_of(scheme) {
        ("delta", delta) => format!("{delta} delta"),
        (mode, _) => mode.to_string(),
    }
}

/// The star of namespaces for `s`: every node on `rate`, or unshaped shards and shaped workers.
fn star_for(s: &Spec) -> Result<Star> {
    let nodes = (s.shards + s.workers) as usize;
    Ok(match s.worker_link {
        None => Star::up(nodes, s.rate)?,
        Some(link) => {
            let mut links = vec![(None, None); s.shards as usize];
            links.extend(std::iter::repeat_n(link, s.workers as usize));
            Star::up_links(&links)?
        }
    })
}

/// The `cluster.toml` of a run: model, data, training, optimizer and compression from `s`.
fn cluster_config(env: &Env, s: &Spec, servers: Vec<String>) -> RunConfig {
    RunConfig {
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
    }
}

/// Starts every shard of `s` in its namespace and waits until each listens.
fn spawn_shards(star: &Star, env: &Env, s: &Spec, dir: &Path) -> Result<Vec<Proc>> {
    let mut shards = Vec::new();
    for k in 0..s.shards {
        let mut c = star.command(k as usize, &env.server);
        c.current_dir(dir).args([
            "--config",
            "cluster.toml",
            "--shard",
            &k.to_string(),
            "--exit-after-workers",
            &s.workers.to_string(),
            "--report",
            &format!("server-{k}.json"),
        ]);
        let mut p = Proc::spawn(c, dir.join(format!("server-{k}.log")))?;
        p.wait_for("listening on", Duration::from_secs(30))?;
        shards.push(p);
    }
    Ok(shards)
}

/// Starts every worker of `s` in its namespace, with its straggling and evaluation flags.
fn spawn_workers(star: &Star, env: &Env, s: &Spec, dir: &Path) -> Result<Vec<Proc>> {
    let mut workers = Vec::new();
    for r in 0..s.workers {
        let mut c = star.command((s.shards + r) as usize, &env.worker);
        c.current_dir(dir).args([
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
        workers.push(Proc::spawn(c, dir.join(format!("worker-{r}.log")))?);
    }
    Ok(workers)
}

/// Runs `s` once on a fresh star and reads what it measured.
fn real_run(env: &Env, s: &Spec, target: f64) -> Result<Outcome> {
    let dir = tempfile::tempdir()?;
    let star = star_for(s)?;
    let hosts: Vec<String> = (0..s.shards as usize).map(Star::addr).collect();
    let servers: Vec<String> = hosts.iter().map(|h| format!("{h}:7000")).collect();
    certificates(dir.path(), &hosts, s.shards, s.workers)?;
    let rc = cluster_config(env, s, servers);
    std::fs::write(dir.path().join("cluster.toml"), rc.text())?;
    let mut shards = spawn_shards(&star, env, s, dir.path())?;
    let mut workers = spawn_workers(&star, env, s, dir.path())?;
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
    read_reports(env, s, dir.path(), target, (cpu1 - cpu0, cpu2 - cpu1))
}

/// The merged staleness histogram of the shards' reports, as sorted (lo, count) buckets.
fn staleness_histogram(ss: &[serde_json::Value]) -> Vec<(u64, u64)> {
    let mut hist: Vec<(u64, u64)> = Vec::new();
    for sv in ss {
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
    hist
}

/// The run's outcome from the workers' and shards' JSON reports in `dir`; `cpu_s` = (workers', shards') CPU seconds.
fn read_reports(
    env: &Env,
    s: &Spec,
    dir: &Path,
    target: f64,
    cpu_s: (f64, f64),
) -> Result<Outcome> {
    let read = |name: &str| -> Result<serde_json::Value> {
        let t = std::fs::read_to_string(dir.join(name)).with_context(|| name.to_string())?;
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
        staleness_histogram: staleness_histogram(&ss),
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
        worker_cpu_s: cpu_s.0,
        shard_cpu_s: cpu_s.1,
    })
}

/// A configuration run `repeats` times.
pub(super) struct Measured {
    pub(super) label: String,
    pub(super) spec: Spec,
    pub(super) runs: Vec<Outcome>,
}

impl Measured {
    /// The median and range of `f` over the runs.
    pub(super) fn spread(&self, f: impl Fn(&Outcome) -> f64) -> Spread {
        Spread::of(&self.runs.iter().map(f).collect::<Vec<_>>())
    }
    /// Time to target over the runs that reached it; the median is NaN unless every run did.
    pub(super) fn ttt(&self) -> Spread {
        let mut s = self.spread(|o| o.time_to_target.unwrap_or(f64::NAN));
        if self.runs.iter().any(|o| o.time_to_target.is_none()) {
            s.median = f64::NAN;
        }
        s
    }

    /// The time to target as a table cell: `median (min–max)`, or how many runs reached it.
    pub(super) fn ttt_cell(&self) -> String {
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

/// Runs `spec` `--repeats` times, logging one line per run to stderr and to `log`.
pub(super) fn measure(
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

/// The study's default run: `--workers` × `--shards`, q4 with error feedback, s = 3, 1 Gbit/s, evaluating.
pub(super) fn base_spec(a: &StudyArgs) -> Spec {
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
