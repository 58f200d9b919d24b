//! The simulator's prediction: 64–1,024 workers × 8–64 shards × {10, 100} Gbit/s on a 100M-parameter base, its
//! table and the per-link saturation summary. Pure: simulation in, text out (shared by `tether-bench simulate
//! --predict` and the study's last section).

use std::fmt::Write as _;

use anyhow::Result;

use tether_bench::sim::{simulate, SimConfig};

use crate::plot::PredictionRow;

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
        compute_quantiles_s: Vec::new(),
    }
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

/// The grid as a Markdown table, one row per (link, workers, shards).
pub(super) fn prediction_table(rows: &[PredictionRow]) -> String {
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

/// Per link and worker count, the smallest shard count within 5% of the best, as a Markdown table.
pub(super) fn saturation(rows: &[PredictionRow]) -> String {
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
