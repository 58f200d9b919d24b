//! The fixed parts of `BENCHMARKS.md`: the head (title, how and where it was run, the floors table) and the tail
//! (the run log and the study's wall time). The sections in between are written by their own modules.

use std::fmt::Write as _;
use std::process::Command;
use std::time::Instant;

use tether_bench::netns::has_netem;

use super::calibration::Calibration;
use super::StudyArgs;

/// This machine's cores, as the report states them.
pub(super) fn cores() -> usize {
    std::thread::available_parallelism().map_or(0, |n| n.get())
}

/// The CPU model from `/proc/cpuinfo` (empty when unknown).
fn host_cpu() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default()
}

/// The time now, `YYYY-MM-DD HH:MM UTC` (empty when `date` fails).
fn utc_date() -> String {
    Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The report's head: title, the paragraph on how the study ran, then the floors it calibrated from.
pub(super) fn head(a: &StudyArgs, dataset: &str, cal: &Calibration) -> String {
    let mut md = String::new();
    let host = host_cpu();
    let cores = cores();
    let date = utc_date();
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
    floors_table(&mut md, a, cal);
    md
}

/// The floors table: what the shard's ingest sits against, on one shard of the study's model.
fn floors_table(md: &mut String, a: &StudyArgs, cal: &Calibration) {
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
}

/// The report's tail: every run's log line, then the study's wall time since `started`.
pub(super) fn tail(md: &mut String, log: &[String], started: Instant) {
    let _ = writeln!(md, "## Run log\n\n```");
    for l in log {
        let _ = writeln!(md, "{l}");
    }
    let _ = writeln!(
        md,
        "```\n\nStudy wall time: {:.0} s.",
        started.elapsed().as_secs_f64()
    );
}
