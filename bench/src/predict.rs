//! The default sync's prediction and the simulator's calibration against a many-worker run. Pure: configurations
//! in, rows and Markdown out; the binary prints and writes them (`tether-bench simulate --predict-default`).
//!
//! The default sync is the quickstart's as `tether-bench scale` runs it: local-step rounds of H = [`INNER_STEPS`]
//! inner steps under BSP, topk2 both ways (keep [`TOPK2_KEEP`] on [`TOPK2_BUCKET`]-value blocks), the outer Nesterov
//! step on every push, rounds closing at a quorum of ⌈3W/4⌉ with a grace window of half the median round, a standby
//! per shard, [`SHARD_COSTS`] on shards of 16 threads, every node on its own host. Efficiency is the existing
//! prediction's (`1 − stall`: the mean fraction of a worker's time not spent waiting for pulls); `vs_ideal` is the
//! throughput over that of the same run with infinite links and free shards. What limits a point is found by
//! counterfactuals: the resource whose removal gains the most efficiency ([`predict_point`]).

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use tether_common::codec::{max_encoded_len, CodecConfig, Rounding, Scheme};

use crate::sim::{simulate_free, simulate_sync, Free, OuterStep, SimConfig, SimError, SyncModel};
use crate::stats::relative_error;

/// Model parameters of the prediction.
pub const PARAMS: u64 = 100_000_000;
/// Inner steps per round (the quickstart's `--local-steps`).
pub const INNER_STEPS: u32 = 16;
/// Compute per inner step, seconds: a round computes `INNER_STEPS × STEP_S` = 1.6 s.
pub const STEP_S: f64 = 0.1;
/// Samples per inner step per worker (samples/s = rounds/s × `INNER_STEPS × BATCH`).
pub const BATCH: u64 = 128;
/// topk2's block (the quickstart's `--bucket` with topk2).
pub const TOPK2_BUCKET: usize = 4096;
/// topk2 keeps one value in this many per block (the quickstart's `--keep`).
pub const TOPK2_KEEP: u32 = 16;
/// Simulated rounds per worker per point.
pub const ROUNDS: u64 = 10;
/// Workers of the grid.
pub const WORKERS: [u32; 5] = [64, 128, 256, 512, 1024];
/// Shards of the grid.
pub const SHARDS: [u32; 4] = [8, 16, 32, 64];
/// Per-host link rates of the grid, Gbit/s.
pub const LINKS_GBIT: [f64; 3] = [1.0, 10.0, 100.0];
/// A push's shard CPU when stepping at close (open, decode, norm, add into the round's sum) as a share of a push
/// stepped as it comes: `cargo run --release -p tether-server --example apply_threads -- 4000000 1.5 3 1,2`, topk2
/// with the outer Nesterov step, 8 pushes a round, 1 thread, the means of three repeats: a push stepped as it comes
/// took 2.04 ns per parameter, the Nesterov passes alone 1.14, and a push at close with the round's step shared out
/// 1.37, so a push at close costs 1.37 − 1.14 / 8 = 1.23 ns (0.60 of 2.04) and the step 1.14 (0.56).
pub const AT_CLOSE_PUSH_SHARE: f64 = 0.60;
/// The outer step at close over the range, as a share of a push stepped as it comes (see [`AT_CLOSE_PUSH_SHARE`]).
pub const AT_CLOSE_STEP_SHARE: f64 = 0.56;

/// The calibration's goal: relative error on round time and on stall.
pub const CALIBRATION_GOAL: f64 = 0.15;
/// Rate of an unshaped link of the namespace harness, Gbit/s (one UDP flow through the star's bridge on the 2-core
/// dev VM, `bench/tests/netns.rs`).
pub const UNSHAPED_GBIT: f64 = 1.68;

/// What a shard's CPU costs: **put measured numbers here** (`cargo run --release -p tether-server --example
/// apply_threads -- 1562500 1.5 3 1,2` with topk2 pushes and the outer Nesterov step: `apply_ns_per_param` = 4 /
/// its 1-thread GB/s, `speedup_at_2` = its 2-thread GB/s over its 1-thread GB/s; `cut_ns_per_param` from its delta
/// cut the same way).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ShardCosts {
    /// One push at 1 thread (open, decode, norm, outer Nesterov over the range), ns per shard parameter.
    pub apply_ns_per_param: f64,
    /// One cut of the public copy at 1 thread, ns per shard parameter.
    pub cut_ns_per_param: f64,
    /// Kernel speedup at 2 threads over 1.
    pub speedup_at_2: f64,
    /// Threads per shard (`shard.threads`).
    pub threads: u32,
    /// Serial CPU per message (request handling, mailbox, wake-ups), seconds.
    pub msg_s: f64,
    /// QUIC CPU per wire byte, each side, ns.
    pub cpu_ns_per_byte: f64,
}

/// The shard costs the prediction uses, measured on the 2-core VM with the chunked kernels
/// (`cargo run --release -p tether-server --example apply_threads -- 4000000 2 3 1,2`, the medians of three runs,
/// docs/performance.md): a topk2 push with the outer Nesterov step applies at 1.86 GB/s fp32-equivalent at 1
/// thread (4 / 1.86 = 2.15 ns/param) and 1.46 times that at 2; a delta cut (measured with q4 pulls) runs at
/// 1.13 GB/s (3.54 ns/param). The per-message and QUIC figures are the per-step prediction's
/// (`study::prediction_base`).
pub const SHARD_COSTS: ShardCosts = ShardCosts {
    apply_ns_per_param: 2.15,
    cut_ns_per_param: 3.54,
    speedup_at_2: 1.46,
    threads: 16,
    msg_s: 20e-6,
    cpu_ns_per_byte: 1.5,
};

/// Wire bytes per parameter of one topk2 frame of `range` values (zstd off, so an upper bound: zstd squeezes the
/// position gaps), from the codec's own size rule (`max_encoded_len`: a 24-byte header, 8 bytes of scales per block,
/// a u16 gap and 2 bits per kept value). Keep 16 on 4096-value blocks: 0.1426 B/param.
pub fn topk2_bytes_per_param(bucket: usize, keep: u32, range: u64) -> f64 {
    let cfg = CodecConfig {
        scheme: Scheme::Topk2,
        bucket,
        rounding: Rounding::Stochastic,
        zstd: false,
        keep,
    };
    let range = range.max(1);
    max_encoded_len(&cfg, range as usize) as f64 / range as f64
}

/// The default sync at `workers` × `shards` with every host's link at `link_gbit`.
pub fn default_sync(workers: u32, shards: u32, link_gbit: f64) -> (SimConfig, SyncModel) {
    let bytes = topk2_bytes_per_param(TOPK2_BUCKET, TOPK2_KEEP, PARAMS / u64::from(shards.max(1)));
    let c = SHARD_COSTS;
    let cfg = SimConfig {
        workers,
        shards,
        params: PARAMS,
        staleness: Some(0),
        rounds: ROUNDS,
        compute_s: f64::from(INNER_STEPS) * STEP_S,
        compute_cv: 0.1,
        straggle: None,
        slow_worker: None,
        push_bytes_per_param: bytes,
        pull_bytes_per_param: bytes,
        // Error feedback, top-k selection and encode of the push, decode of the pull: part of the round's compute.
        worker_ns_per_param: 3.0,
        apply_ns_per_param: c.apply_ns_per_param,
        serve_ns_per_param: c.cut_ns_per_param,
        cpu_ns_per_byte: c.cpu_ns_per_byte,
        link_bps: link_gbit * 1e9,
        latency_s: 25e-6,
        seed: 7,
        cores: None,
        pull_overhead_s: 200e-6,
        worker_io_s: 0.0,
        shard_io_ns_per_param: 0.0,
        compute_quantiles_s: Vec::new(),
    };
    let sync = SyncModel {
        local_steps: INNER_STEPS,
        quorum: (workers * 3).div_ceil(4),
        grace_factor: 0.5,
        grace_max_s: 5.0,
        standbys: true,
        shard_threads: c.threads,
        speedup_at_2: c.speedup_at_2,
        shard_msg_s: c.msg_s,
        outer_step: OuterStep::EveryPush,
        hosts: None,
    };
    (cfg, sync)
}

/// One point of the prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DefaultRow {
    /// Workers.
    pub workers: u32,
    /// Shards.
    pub shards: u32,
    /// Every host's link, Gbit/s.
    pub link_gbit: f64,
    /// `1 − stall`: the mean fraction of a worker's time not spent waiting for pulls.
    pub efficiency: f64,
    /// Throughput over that of the same run with infinite links and free shards.
    pub vs_ideal: f64,
    /// Median round time, seconds.
    pub round_s: f64,
    /// Pull wait per round (median over workers), seconds.
    pub stall_s: f64,
    /// Samples per second, all workers (`INNER_STEPS × BATCH` per round).
    pub samples_per_s: f64,
    /// Busiest shard or standby CPU, fraction of the run.
    pub shard_cpu_util: f64,
    /// Busiest shard or standby NIC direction, fraction of the run.
    pub shard_link_util: f64,
    /// Busiest worker NIC direction, fraction of the run.
    pub worker_link_util: f64,
    /// Efficiency gained with free shard CPU, shard links, worker links (in that order), and all three.
    pub gains: [f64; 4],
    /// What limits it: `shard cpu`, `shard link`, `worker link` (two joined by `+` when only both together gain),
    /// `quorum wait` or `compute`.
    pub limit: String,
}

/// Efficiency gained by freeing a resource below which it is not named as the limit (2 points).
pub const LIMIT_GAIN: f64 = 0.02;

/// Simulates `cfg` under `sync`, then again with each resource free and with all free, and names the limit.
pub fn predict_point(cfg: &SimConfig, sync: &SyncModel) -> Result<DefaultRow, SimError> {
    let base = simulate_sync(cfg, sync)?;
    let eff = |r: &crate::sim::SimReport| 1.0 - r.stall_fraction;
    let e0 = eff(&base);
    let frees = [
        Free {
            shard_cpu: true,
            ..Free::NONE
        },
        Free {
            shard_link: true,
            ..Free::NONE
        },
        Free {
            worker_link: true,
            ..Free::NONE
        },
        Free::ALL,
    ];
    let mut gains = [0.0; 4];
    let mut ideal_rate = base.rounds_per_s;
    for (g, free) in gains.iter_mut().zip(frees) {
        let r = simulate_free(cfg, sync, free)?;
        *g = eff(&r) - e0;
        if free == Free::ALL {
            ideal_rate = r.rounds_per_s;
        }
    }
    Ok(DefaultRow {
        workers: cfg.workers,
        shards: cfg.shards,
        link_gbit: cfg.link_bps / 1e9,
        efficiency: e0,
        vs_ideal: base.rounds_per_s / ideal_rate,
        round_s: base.round_p50_s,
        stall_s: base.stall_per_round_s,
        samples_per_s: base.rounds_per_s * f64::from(INNER_STEPS) * BATCH as f64,
        shard_cpu_util: base.shard_cpu_util,
        shard_link_util: base.shard_link_util,
        worker_link_util: base.worker_link_util,
        gains,
        limit: limit_of(e0, gains),
    })
}

/// The limit from the efficiency and the gains of freeing shard CPU, shard links, worker links and all three.
pub fn limit_of(efficiency: f64, gains: [f64; 4]) -> String {
    let mut named = [
        ("shard cpu", gains[0]),
        ("shard link", gains[1]),
        ("worker link", gains[2]),
    ];
    named.sort_by(|a, b| b.1.total_cmp(&a.1));
    if named[0].1 >= LIMIT_GAIN {
        named[0].0.to_string()
    } else if gains[3] >= LIMIT_GAIN {
        format!("{}+{}", named[0].0, named[1].0)
    } else if 1.0 - efficiency >= 0.05 {
        "quorum wait".to_string()
    } else {
        "compute".to_string()
    }
}

/// The grid: [`LINKS_GBIT`] × [`SHARDS`] × [`WORKERS`] of [`default_sync`], on up to `threads` threads (the rows'
/// order and values do not depend on it).
pub fn predict_default(threads: usize) -> Result<Vec<DefaultRow>, SimError> {
    let points: Vec<(u32, u32, f64)> = LINKS_GBIT
        .iter()
        .flat_map(|&l| {
            SHARDS
                .iter()
                .flat_map(move |&s| WORKERS.iter().map(move |&w| (w, s, l)))
        })
        .collect();
    let threads = threads.clamp(1, points.len());
    let mut out: Vec<Option<Result<DefaultRow, SimError>>> =
        (0..points.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        for (i, slot) in out.chunks_mut(points.len().div_ceil(threads)).enumerate() {
            let first = i * points.len().div_ceil(threads);
            let points = &points;
            scope.spawn(move || {
                for (j, r) in slot.iter_mut().enumerate() {
                    let (w, s, l) = points[first + j];
                    let (cfg, sync) = default_sync(w, s, l);
                    *r = Some(predict_point(&cfg, &sync));
                }
            });
        }
    });
    // Every slot was filled by its thread (a panic there propagates out of the scope).
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| unreachable!("every point is simulated")))
        .collect()
}

/// Where a curve flattens: per link and workers, the first shard count whose doubling gains under 1 point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flattening {
    /// Link, Gbit/s.
    pub link_gbit: f64,
    /// Workers.
    pub workers: u32,
    /// The shard count (`None`: still gaining at the largest count of the grid).
    pub shards: Option<u32>,
    /// Efficiency there (or at the largest count).
    pub efficiency: f64,
    /// Limit there (or at the largest count).
    pub limit: String,
}

/// Efficiency gained by doubling the shards below which a curve counts as flat (1 point).
pub const FLAT_GAIN: f64 = 0.01;

/// Where each (link, workers) curve of `rows` flattens.
pub fn flattening(rows: &[DefaultRow]) -> Vec<Flattening> {
    let mut out = Vec::new();
    for &link in &LINKS_GBIT {
        for &w in &WORKERS {
            let mut curve: Vec<&DefaultRow> = rows
                .iter()
                .filter(|r| r.link_gbit == link && r.workers == w)
                .collect();
            curve.sort_by_key(|r| r.shards);
            let Some(last) = curve.last() else { continue };
            let flat = curve
                .windows(2)
                .find(|p| {
                    p[1].shards == 2 * p[0].shards && p[1].efficiency - p[0].efficiency < FLAT_GAIN
                })
                .map(|p| p[0]);
            let at = flat.unwrap_or(last);
            out.push(Flattening {
                link_gbit: link,
                workers: w,
                shards: flat.map(|r| r.shards),
                efficiency: at.efficiency,
                limit: at.limit.clone(),
            });
        }
    }
    out
}

/// Every row as a Markdown table.
pub fn markdown(rows: &[DefaultRow]) -> String {
    let mut s = String::from(
        "| link | workers | shards | efficiency | vs ideal | round s | stall s | samples/s | shard CPU | shard link \
         | worker link | limit |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "| {} Gbit/s | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
            r.link_gbit,
            r.workers,
            r.shards,
            r.efficiency,
            r.vs_ideal,
            r.round_s,
            r.stall_s,
            r.samples_per_s,
            r.shard_cpu_util,
            r.shard_link_util,
            r.worker_link_util,
            r.limit
        );
    }
    s
}

/// Per link, efficiency and limit as a workers × shards matrix.
pub fn matrix(rows: &[DefaultRow]) -> String {
    let mut s = String::new();
    for &link in &LINKS_GBIT {
        let _ = writeln!(s, "\n**{link} Gbit/s per host**\n");
        s.push_str("| workers |");
        for k in SHARDS {
            let _ = write!(s, " {k} shards |");
        }
        s.push_str("\n|---|");
        s.push_str(&"---|".repeat(SHARDS.len()));
        s.push('\n');
        for w in WORKERS {
            let _ = write!(s, "| {w} |");
            for k in SHARDS {
                match rows
                    .iter()
                    .find(|r| r.link_gbit == link && r.workers == w && r.shards == k)
                {
                    Some(r) => {
                        let _ = write!(s, " {:.2} {} |", r.efficiency, r.limit);
                    }
                    None => s.push_str(" — |"),
                }
            }
            s.push('\n');
        }
    }
    s
}

/// Where the curves flatten, as a Markdown table.
pub fn flattening_markdown(flat: &[Flattening]) -> String {
    let mut s = String::from(
        "| link | workers | flattens at (doubling gains < 1 pt) | efficiency there | limit there |\n|---|---|---|---|---|\n",
    );
    for f in flat {
        let at = f.shards.map_or_else(
            || format!("> {} (still gaining)", SHARDS[SHARDS.len() - 1]),
            |k| format!("{k} shards"),
        );
        let _ = writeln!(
            s,
            "| {} Gbit/s | {} | {at} | {:.2} | {} |",
            f.link_gbit, f.workers, f.efficiency, f.limit
        );
    }
    s
}

/// The efficiency the issue asks of the default sync at 1,024 workers × 64 shards.
pub const EFFICIENCY_GOAL: f64 = 0.9;

/// One change to [`default_sync`] that [`what_it_takes`] tries, alone and with the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lever {
    /// `cluster.staleness = 1`: a worker starts its next round before the last one's pull (a config key today).
    StalenessOne,
    /// The shards sum a round's pushes (0.2 ns/param each) and run one dense outer step when it closes, as DiLoCo
    /// does; the shards do not implement it (they step on every push).
    OuterAtClose,
    /// A compute spread (cv) of 0.02 per round instead of 0.1: steady accelerator steps.
    SteadyCompute,
    /// `train.local_steps = 32` instead of 16: half the rounds per sample (a change to the recipe).
    LocalSteps32,
}

impl Lever {
    /// Every lever, in the order of the search's bit mask.
    pub const ALL: [Lever; 4] = [
        Lever::StalenessOne,
        Lever::OuterAtClose,
        Lever::SteadyCompute,
        Lever::LocalSteps32,
    ];

    /// A short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            Lever::StalenessOne => "staleness 1",
            Lever::OuterAtClose => "outer step at close",
            Lever::SteadyCompute => "compute cv 0.02",
            Lever::LocalSteps32 => "H = 32",
        }
    }

    /// Changes `cfg` and `sync` as the lever says.
    pub fn apply(self, cfg: &mut SimConfig, sync: &mut SyncModel) {
        match self {
            Lever::StalenessOne => cfg.staleness = Some(1),
            Lever::OuterAtClose => {
                sync.outer_step = OuterStep::AtClose {
                    push_ns_per_param: AT_CLOSE_PUSH_SHARE * cfg.apply_ns_per_param,
                    step_ns_per_param: AT_CLOSE_STEP_SHARE * cfg.apply_ns_per_param,
                }
            }
            Lever::SteadyCompute => cfg.compute_cv = 0.02,
            Lever::LocalSteps32 => {
                sync.local_steps = 2 * INNER_STEPS;
                cfg.compute_s = f64::from(2 * INNER_STEPS) * STEP_S;
            }
        }
    }
}

/// One combination of levers at one link rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeverRow {
    /// Every host's link, Gbit/s.
    pub link_gbit: f64,
    /// The levers pulled (empty: the default sync).
    pub levers: Vec<Lever>,
    /// `1 − stall`.
    pub efficiency: f64,
    /// What limits it ([`limit_of`]).
    pub limit: String,
}

/// The default sync at `workers` × `shards` under every combination of [`Lever::ALL`], at each of [`LINKS_GBIT`],
/// on up to `threads` threads (the rows' order and values do not depend on it): link-major, then by bit mask.
pub fn what_it_takes(workers: u32, shards: u32, threads: usize) -> Result<Vec<LeverRow>, SimError> {
    let combos = 1usize << Lever::ALL.len();
    let points: Vec<(f64, usize)> = LINKS_GBIT
        .iter()
        .flat_map(|&l| (0..combos).map(move |m| (l, m)))
        .collect();
    let per = points.len().div_ceil(threads.clamp(1, points.len()));
    let mut out: Vec<Option<Result<LeverRow, SimError>>> =
        (0..points.len()).map(|_| None).collect();
    std::thread::scope(|scope| {
        for (i, slot) in out.chunks_mut(per).enumerate() {
            let points = &points;
            scope.spawn(move || {
                for (j, r) in slot.iter_mut().enumerate() {
                    let (link, mask) = points[i * per + j];
                    let levers: Vec<Lever> = Lever::ALL
                        .iter()
                        .enumerate()
                        .filter(|(b, _)| mask & (1 << b) != 0)
                        .map(|(_, &l)| l)
                        .collect();
                    let (mut cfg, mut sync) = default_sync(workers, shards, link);
                    for l in &levers {
                        l.apply(&mut cfg, &mut sync);
                    }
                    *r = Some(predict_point(&cfg, &sync).map(|row| LeverRow {
                        link_gbit: link,
                        levers,
                        efficiency: row.efficiency,
                        limit: row.limit,
                    }));
                }
            });
        }
    });
    // Every slot was filled by its thread (a panic there propagates out of the scope).
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| unreachable!("every combination is simulated")))
        .collect()
}

/// The minimal sets of levers that reach `goal`: per link, the combinations at or over the goal none of whose
/// proper subsets is (not only those of the fewest levers).
pub fn minimal_lever_sets(rows: &[LeverRow], goal: f64) -> Vec<&LeverRow> {
    let reaches: Vec<&LeverRow> = rows.iter().filter(|r| r.efficiency >= goal).collect();
    reaches
        .iter()
        .filter(|r| {
            !reaches.iter().any(|o| {
                o.link_gbit == r.link_gbit
                    && o.levers.len() < r.levers.len()
                    && o.levers.iter().all(|l| r.levers.contains(l))
            })
        })
        .copied()
        .collect()
}

/// Every combination as a Markdown table: a row per combination, a column per link.
pub fn levers_markdown(rows: &[LeverRow]) -> String {
    let mut s = String::from("| levers |");
    for l in LINKS_GBIT {
        let _ = write!(s, " {l} Gbit/s |");
    }
    s.push_str("\n|---|");
    s.push_str(&"---|".repeat(LINKS_GBIT.len()));
    s.push('\n');
    let mut combos: Vec<&Vec<Lever>> = Vec::new();
    for r in rows {
        if !combos.contains(&&r.levers) {
            combos.push(&r.levers);
        }
    }
    for c in combos {
        let name = if c.is_empty() {
            "the default sync".to_string()
        } else {
            c.iter().map(|l| l.name()).collect::<Vec<_>>().join(" + ")
        };
        let _ = write!(s, "| {name} |");
        for l in LINKS_GBIT {
            match rows.iter().find(|r| r.link_gbit == l && &r.levers == c) {
                Some(r) if r.efficiency >= EFFICIENCY_GOAL => {
                    let _ = write!(s, " **{:.2}** {} |", r.efficiency, r.limit);
                }
                Some(r) => {
                    let _ = write!(s, " {:.2} {} |", r.efficiency, r.limit);
                }
                None => s.push_str(" — |"),
            }
        }
        s.push('\n');
    }
    s
}

/// A many-worker run's figures, as `tether-bench scale` reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScaleMeasurement {
    /// Workers.
    pub workers: u32,
    /// Shards (each with a standby when `standbys`).
    pub shards: u32,
    /// Namespace hosts.
    pub hosts: u32,
    /// Every host's link, Gbit/s (`None`: unshaped, [`UNSHAPED_GBIT`]).
    pub link_gbit: Option<f64>,
    /// Measured round time, median (`round_s[0]` of the report), seconds.
    pub round_p50_s: f64,
    /// Measured stall: pull wait per round, median over workers (`stall_s`), seconds.
    pub stall_per_round_s: f64,
    /// Measured compute per round: the time a round is not waiting for pulls (inner steps, encode, push), seconds.
    pub compute_per_round_s: f64,
    /// Whether shards had standbys (the scale run's default).
    pub standbys: bool,
    /// `cluster.quorum` (the scale run's default: ⌈3W/4⌉).
    pub quorum: u32,
    /// The cores every process of the run shared, with a worker's CPU time per round: when set, [`scale_config`]
    /// simulates one machine of that many cores (`SimConfig::cores`) and that CPU time as the compute, instead of
    /// the measured wall time on nodes of their own.
    #[serde(default)]
    pub shared_cores: Option<(u32, f64)>,
    /// The measured spread of a round's compute (the scale report's `compute_cv`): when set, [`scale_config`]
    /// simulates it instead of 0.1, and nothing is fitted.
    #[serde(default)]
    pub compute_cv: Option<f64>,
    /// The measured wire bytes per parameter of a push and of a pull (the scale report's `wire_bytes_per_param`):
    /// when set, [`scale_config`] sends them instead of topk2's upper bound.
    #[serde(default)]
    pub wire_bytes_per_param: Option<[f64; 2]>,
    /// The measured distribution of a round's compute (the scale report's `compute_quantiles_s`): when set,
    /// [`scale_config`] draws each round's compute from it (it supersedes `compute_cv`).
    #[serde(default)]
    pub compute_quantiles_s: Option<Vec<f64>>,
}

impl ScaleMeasurement {
    /// A run with the scale run's defaults (standbys, quorum ⌈3W/4⌉) and these figures.
    pub fn new(
        workers: u32,
        shards: u32,
        hosts: u32,
        link_gbit: Option<f64>,
        round_p50_s: f64,
        stall_per_round_s: f64,
        compute_per_round_s: f64,
    ) -> ScaleMeasurement {
        ScaleMeasurement {
            workers,
            shards,
            hosts,
            link_gbit,
            round_p50_s,
            stall_per_round_s,
            compute_per_round_s,
            standbys: true,
            quorum: (workers * 3).div_ceil(4),
            shared_cores: None,
            compute_cv: None,
            wire_bytes_per_param: None,
            compute_quantiles_s: None,
        }
    }
}

/// The simulator against a measured run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationCheck {
    /// Measured median round time, seconds.
    pub measured_round_s: f64,
    /// Simulated median round time, seconds.
    pub sim_round_s: f64,
    /// `|sim − measured| / measured` of the round time.
    pub round_error: f64,
    /// Measured stall per round, seconds.
    pub measured_stall_s: f64,
    /// Simulated stall per round, seconds.
    pub sim_stall_s: f64,
    /// `|sim − measured| / measured` of the stall.
    pub stall_error: f64,
    /// Both errors within [`CALIBRATION_GOAL`].
    pub within_goal: bool,
}

/// The calibration's arithmetic: relative errors of simulated round time and stall against measured ones.
pub fn check(
    measured_round_s: f64,
    measured_stall_s: f64,
    sim_round_s: f64,
    sim_stall_s: f64,
) -> CalibrationCheck {
    let round_error = relative_error(sim_round_s, measured_round_s);
    let stall_error = relative_error(sim_stall_s, measured_stall_s);
    CalibrationCheck {
        measured_round_s,
        sim_round_s,
        round_error,
        measured_stall_s,
        sim_stall_s,
        stall_error,
        within_goal: round_error <= CALIBRATION_GOAL && stall_error <= CALIBRATION_GOAL,
    }
}

/// The simulator's configuration of a `tether-bench scale` run: the quickstart's MLP (235,146 parameters) with its
/// sync (H = 16, topk2 keep 16 on 4096-value blocks both ways, BSP, grace 0.5 within its 10 s worker timeout),
/// the run's placement, quorum and standbys, the measured compute per round (cv 0.1), and [`SHARD_COSTS`] on
/// shards of one thread (every process shares the VM's cores); with [`ScaleMeasurement::shared_cores`], one machine
/// of those cores running every worker's CPU time per round. Adjust the returned values and call
/// [`calibrate_with`] to try other costs.
pub fn scale_config(m: &ScaleMeasurement) -> (SimConfig, SyncModel) {
    const MLP_PARAMS: u64 = 235_146;
    let shards = m.shards.max(1);
    let bound = topk2_bytes_per_param(TOPK2_BUCKET, TOPK2_KEEP, MLP_PARAMS / u64::from(shards));
    let [push_bytes, pull_bytes] = m
        .wire_bytes_per_param
        .filter(|b| b.iter().all(|&x| x > 0.0))
        .unwrap_or([bound; 2]);
    let c = SHARD_COSTS;
    let cfg = SimConfig {
        workers: m.workers,
        shards,
        params: MLP_PARAMS,
        staleness: Some(0),
        rounds: 30,
        compute_s: m.compute_per_round_s,
        compute_cv: m.compute_cv.filter(|&cv| cv > 0.0).unwrap_or(0.1),
        straggle: None,
        slow_worker: None,
        push_bytes_per_param: push_bytes,
        pull_bytes_per_param: pull_bytes,
        // The measured compute already holds the worker's codec work.
        worker_ns_per_param: 0.0,
        apply_ns_per_param: c.apply_ns_per_param,
        serve_ns_per_param: c.cut_ns_per_param,
        cpu_ns_per_byte: c.cpu_ns_per_byte,
        link_bps: m.link_gbit.unwrap_or(UNSHAPED_GBIT) * 1e9,
        latency_s: 50e-6,
        seed: 7,
        cores: None,
        pull_overhead_s: 200e-6,
        worker_io_s: 0.0,
        shard_io_ns_per_param: 0.0,
        compute_quantiles_s: m
            .compute_quantiles_s
            .as_deref()
            .map(|q| shifted_to_mean(q, m.compute_per_round_s))
            .unwrap_or_default(),
    };
    let (cores, compute_s) = match m.shared_cores {
        Some((cores, cpu_s)) if cores > 0 && cpu_s > 0.0 => (Some(cores), cpu_s),
        _ => (None, m.compute_per_round_s),
    };
    let cfg = SimConfig {
        cores,
        compute_s,
        ..cfg
    };
    let sync = SyncModel {
        local_steps: INNER_STEPS,
        quorum: m.quorum.min(m.workers),
        grace_factor: 0.5,
        grace_max_s: 10.0,
        standbys: m.standbys,
        shard_threads: 1,
        speedup_at_2: c.speedup_at_2,
        shard_msg_s: c.msg_s,
        outer_step: OuterStep::EveryPush,
        hosts: Some(m.hosts.max(1)),
    };
    (cfg, sync)
}

/// The quantiles `q` (equally spaced, ascending) moved by one constant so that their distribution's mean is `mean`
/// (none below 0). The histories' compute of a round ends when its push settled on shard 0, so it holds the push's
/// round trip through a busy shard; the workers' own compute time does not. The shape is the histories', the mean
/// the workers'.
pub fn shifted_to_mean(q: &[f64], mean: f64) -> Vec<f64> {
    let n = q.len();
    if n < 2 || !(mean.is_finite() && mean > 0.0) {
        return q.to_vec();
    }
    let inner: f64 = q[1..n - 1].iter().sum();
    let current = (q[0] / 2.0 + inner + q[n - 1] / 2.0) / (n - 1) as f64;
    let shift = current - mean;
    q.iter().map(|v| (v - shift).max(0.0)).collect()
}

/// Simulates the measured run with [`scale_config`] and reports the errors on round time and stall.
pub fn calibrate(m: &ScaleMeasurement) -> Result<CalibrationCheck, SimError> {
    let (cfg, sync) = scale_config(m);
    calibrate_with(m, &cfg, &sync)
}

/// Simulates `cfg` under `sync` and reports its errors against `m`.
pub fn calibrate_with(
    m: &ScaleMeasurement,
    cfg: &SimConfig,
    sync: &SyncModel,
) -> Result<CalibrationCheck, SimError> {
    let r = simulate_sync(cfg, sync)?;
    Ok(check(
        m.round_p50_s,
        m.stall_per_round_s,
        r.round_p50_s,
        r.stall_per_round_s,
    ))
}

/// A scale run as the calibration reads it, with the simulator's verdict under a fitted compute spread.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CalibratedRun {
    /// What was measured.
    pub measured: ScaleMeasurement,
    /// The simulator against it.
    pub check: CalibrationCheck,
}

/// Calibrates on `runs[0]` and validates on the rest: the one free parameter, the spread of a worker's compute per
/// round (`compute_cv`: on a box where every process shares two cores, time slicing dominates it), is fitted on the
/// first run (the value in 0.02..=1.0, step 0.02, with the smallest largest error on round time and stall); the
/// other runs are simulated with it unchanged. Returns the fitted spread and every run's check.
pub fn calibrate_runs(runs: &[ScaleMeasurement]) -> Result<(f64, Vec<CalibratedRun>), SimError> {
    let Some(first) = runs.first() else {
        return Ok((0.1, Vec::new()));
    };
    let with_cv = |m: &ScaleMeasurement, cv: f64| {
        let (mut cfg, sync) = scale_config(m);
        cfg.compute_cv = cv;
        calibrate_with(m, &cfg, &sync)
    };
    let mut best = (f64::INFINITY, 0.1);
    for step in 1..=50 {
        let cv = f64::from(step) * 0.02;
        let c = with_cv(first, cv)?;
        let worst = c.round_error.max(c.stall_error);
        if worst < best.0 {
            best = (worst, cv);
        }
    }
    let cv = best.1;
    let checked = runs
        .iter()
        .map(|m| {
            Ok(CalibratedRun {
                measured: m.clone(),
                check: with_cv(m, cv)?,
            })
        })
        .collect::<Result<Vec<_>, SimError>>()?;
    Ok((cv, checked))
}

/// Simulates every run with its own measured compute and wire bytes ([`ScaleMeasurement::compute_cv`] or
/// [`ScaleMeasurement::compute_quantiles_s`], and [`ScaleMeasurement::wire_bytes_per_param`]): nothing is fitted,
/// so every run is a validation. Runs without those figures are left out.
pub fn validate_measured(runs: &[ScaleMeasurement]) -> Result<Vec<CalibratedRun>, SimError> {
    runs.iter()
        .filter(|m| {
            (m.compute_cv.is_some() || m.compute_quantiles_s.is_some())
                && m.wire_bytes_per_param.is_some()
        })
        .map(|m| {
            Ok(CalibratedRun {
                measured: m.clone(),
                check: calibrate(m)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_measured_spread_and_measured_bytes_replace_the_assumed_ones() {
        let mut m = ScaleMeasurement::new(64, 8, 8, Some(0.1), 0.55, 0.29, 0.26);
        let (assumed, _) = scale_config(&m);
        assert_eq!(assumed.compute_cv, 0.1);
        assert!(assumed.push_bytes_per_param > 0.14);
        assert!(validate_measured(std::slice::from_ref(&m))
            .unwrap()
            .is_empty());
        m.compute_cv = Some(0.3);
        m.wire_bytes_per_param = Some([0.08, 0.12]);
        let (cfg, _) = scale_config(&m);
        assert_eq!(cfg.compute_cv, 0.3);
        assert_eq!(
            (cfg.push_bytes_per_param, cfg.pull_bytes_per_param),
            (0.08, 0.12)
        );
        // Fewer bytes on a 100 Mbit/s link: a shorter simulated round.
        let fewer = validate_measured(std::slice::from_ref(&m)).unwrap();
        m.wire_bytes_per_param = Some([0.3, 0.3]);
        let more = validate_measured(std::slice::from_ref(&m)).unwrap();
        assert!(fewer[0].check.sim_round_s < more[0].check.sim_round_s);
        // A measured distribution supersedes the spread: a heavier tail, a longer wait for the round to close.
        m.wire_bytes_per_param = Some([0.08, 0.08]);
        let light = validate_measured(std::slice::from_ref(&m)).unwrap();
        let mut q: Vec<f64> = (0..=20).map(|i| 0.2 + 0.005 * f64::from(i)).collect();
        q[20] = 2.0;
        m.compute_quantiles_s = Some(q.clone());
        let drawn = scale_config(&m).0.compute_quantiles_s;
        let mean = (drawn[0] / 2.0 + drawn[1..20].iter().sum::<f64>() + drawn[20] / 2.0) / 20.0;
        assert!((mean - m.compute_per_round_s).abs() < 1e-9, "{drawn:?}");
        assert!(
            (drawn[20] - drawn[0] - (q[20] - q[0])).abs() < 1e-9,
            "the shape is kept: {drawn:?}"
        );
        let heavy = validate_measured(std::slice::from_ref(&m)).unwrap();
        assert!(
            heavy[0].check.sim_stall_s > light[0].check.sim_stall_s,
            "{heavy:?} {light:?}"
        );
    }

    fn lever_row(link: f64, levers: &[Lever], efficiency: f64) -> LeverRow {
        LeverRow {
            link_gbit: link,
            levers: levers.to_vec(),
            efficiency,
            limit: "compute".into(),
        }
    }

    #[test]
    fn minimal_lever_sets_keeps_only_the_minimal_combinations_per_link() {
        use Lever::*;
        let rows = vec![
            lever_row(1.0, &[], 0.5),
            lever_row(1.0, &[StalenessOne], 0.91),
            lever_row(1.0, &[StalenessOne, SteadyCompute], 0.95),
            lever_row(1.0, &[SteadyCompute, LocalSteps32], 0.92),
            lever_row(10.0, &[StalenessOne], 0.6),
            lever_row(10.0, &[StalenessOne, SteadyCompute], 0.9),
        ];
        let got: Vec<(f64, Vec<Lever>)> = minimal_lever_sets(&rows, 0.9)
            .into_iter()
            .map(|r| (r.link_gbit, r.levers.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (1.0, vec![StalenessOne]),
                (1.0, vec![SteadyCompute, LocalSteps32]),
                (10.0, vec![StalenessOne, SteadyCompute]),
            ]
        );
        let table = levers_markdown(&rows);
        assert!(
            table.contains("| the default sync | 0.50 compute |"),
            "{table}"
        );
        assert!(
            table.contains("| staleness 1 | **0.91** compute | 0.60 compute | — |"),
            "{table}"
        );
    }

    #[test]
    fn shared_cores_simulate_one_machine_running_the_workers_cpu_time() {
        let mut m = ScaleMeasurement::new(64, 8, 8, Some(1.0), 0.49, 0.27, 0.23);
        let (cfg, _) = scale_config(&m);
        assert_eq!((cfg.cores, cfg.compute_s), (None, 0.23));
        m.shared_cores = Some((2, 0.011));
        let (cfg, _) = scale_config(&m);
        assert_eq!((cfg.cores, cfg.compute_s), (Some(2), 0.011));
        m.shared_cores = Some((0, 0.011));
        assert_eq!(
            scale_config(&m).0.cores,
            None,
            "a report without its cores keeps the wall-time model"
        );
    }

    #[test]
    fn each_lever_changes_what_it_names() {
        let (cfg0, sync0) = default_sync(64, 8, 10.0);
        for l in Lever::ALL {
            let (mut cfg, mut sync) = (cfg0.clone(), sync0.clone());
            l.apply(&mut cfg, &mut sync);
            let changed = (cfg.staleness != cfg0.staleness) as u8
                + (sync.outer_step != sync0.outer_step) as u8
                + (cfg.compute_cv != cfg0.compute_cv) as u8
                + (sync.local_steps != sync0.local_steps) as u8;
            assert_eq!(changed, 1, "{l:?}");
        }
    }

    #[test]
    fn topk2_keep_16_on_4096_blocks_is_a_seventh_of_a_byte_per_parameter() {
        // 8 B of scales per 4096 values + (2 B + 2 bits) per kept value (1 in 16), and one 24-byte header.
        let expected = 8.0 / 4096.0 + 2.25 / 16.0;
        let b = topk2_bytes_per_param(4096, 16, 1 << 20);
        assert!((b - expected).abs() < 1e-4, "{b} vs {expected}");
        assert!((b - 0.1426).abs() < 1e-3);
    }

    #[test]
    fn the_calibration_arithmetic_is_relative_error_against_the_goal() {
        let c = check(1.0, 0.2, 1.1, 0.25);
        assert!((c.round_error - 0.1).abs() < 1e-12);
        assert!((c.stall_error - 0.25).abs() < 1e-12);
        assert!(!c.within_goal);
        let c = check(2.0, 0.5, 1.8, 0.55);
        assert!((c.round_error - 0.1).abs() < 1e-12 && (c.stall_error - 0.1).abs() < 1e-12);
        assert!(c.within_goal);
        // A simulated run of a scale measurement gives finite figures to compare.
        let m = ScaleMeasurement::new(16, 4, 4, Some(1.0), 0.5, 0.05, 0.45);
        let c = calibrate(&m).unwrap();
        assert!(
            c.sim_round_s.is_finite() && c.sim_stall_s.is_finite(),
            "{c:?}"
        );
        assert!(c.sim_round_s >= 0.45, "{c:?}");
    }

    #[test]
    fn the_limit_is_the_resource_whose_removal_gains_most() {
        assert_eq!(limit_of(0.3, [0.05, 0.4, 0.0, 0.6]), "shard link");
        assert_eq!(
            limit_of(0.6, [0.01, 0.01, 0.0, 0.1]),
            "shard cpu+shard link"
        );
        assert_eq!(limit_of(0.8, [0.0, 0.0, 0.0, 0.01]), "quorum wait");
        assert_eq!(limit_of(0.99, [0.0, 0.0, 0.0, 0.0]), "compute");
    }

    #[test]
    fn the_default_sync_at_1024_workers_and_64_shards_gives_finite_figures_and_a_limit() {
        let (mut cfg, sync) = default_sync(1024, 64, 10.0);
        cfg.rounds = 4;
        let r = predict_point(&cfg, &sync).unwrap();
        for v in [
            r.efficiency,
            r.vs_ideal,
            r.round_s,
            r.stall_s,
            r.samples_per_s,
        ] {
            assert!(v.is_finite() && v > 0.0, "{r:?}");
        }
        assert!(r.efficiency <= 1.0 && r.vs_ideal <= 1.0 + 1e-9, "{r:?}");
        assert!(
            [
                "shard cpu",
                "shard link",
                "worker link",
                "quorum wait",
                "compute"
            ]
            .iter()
            .any(|l| r.limit.contains(l)),
            "{r:?}"
        );
    }

    #[test]
    fn a_curve_flattens_where_doubling_gains_under_a_point() {
        let row = |shards, efficiency| DefaultRow {
            workers: 64,
            shards,
            link_gbit: 1.0,
            efficiency,
            vs_ideal: 1.0,
            round_s: 1.0,
            stall_s: 0.0,
            samples_per_s: 1.0,
            shard_cpu_util: 0.0,
            shard_link_util: 0.0,
            worker_link_util: 0.0,
            gains: [0.0; 4],
            limit: "compute".into(),
        };
        let rows = [row(8, 0.5), row(16, 0.7), row(32, 0.705), row(64, 0.71)];
        let f = flattening(&rows);
        assert_eq!(f[0].shards, Some(16));
        let rising = [row(8, 0.2), row(16, 0.4), row(32, 0.6), row(64, 0.8)];
        assert_eq!(flattening(&rising)[0].shards, None);
    }

    /// The whole prediction, printed (`cargo test -p tether-bench --lib print_the_default_sync_prediction --
    /// --ignored --nocapture`; the same as `tether-bench simulate --predict-default FILE`).
    #[test]
    #[ignore = "about a minute of simulation; run by hand to regenerate docs/simulator.md's tables"]
    fn print_the_default_sync_prediction() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let rows = predict_default(threads).unwrap();
        println!("{}", matrix(&rows));
        println!("{}", flattening_markdown(&flattening(&rows)));
        println!("{}", markdown(&rows));
    }
}
