//! The `ingest` section: one shard fed by two synthetic workers (`tether-bench ingest`, this binary) in a
//! namespace, unshaped and at 10 Gbit/s, q4 and fp32 pushes; the goal ingest ≥ 2× the link rate; and a flat `perf`
//! profile of the shard when `perf` is installed.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{bail, Result};

use tether_bench::netns::Rate;
use tether_bench::stats::Spread;

use super::runs::rate_name;
use super::StudyArgs;

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

/// Measures every (link, push) row, appends the table, the profile and the goal.
pub(super) fn section(a: &StudyArgs, md: &mut String) -> Result<()> {
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
            let reps = measure_ingest(&me, rate, scheme, a.repeats)?;
            let (line, ingest) = ingest_row(rate, scheme, &reps);
            if let (Some(link), "q4") = (rate, scheme) {
                at10 = Some(ingest / (link as f64 / 8e9));
            }
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
    Ok(())
}

/// Runs `tether-bench ingest --scheme scheme` `repeats` times in a fresh namespace on `rate`; each run's `ingest`
/// report.
fn measure_ingest(
    me: &Path,
    rate: Rate,
    scheme: &str,
    repeats: u32,
) -> Result<Vec<serde_json::Value>> {
    let mut reps: Vec<serde_json::Value> = Vec::new();
    for _ in 0..repeats {
        let ns = tether_bench::netns::Loop::up(rate)?;
        let dir = tempfile::tempdir()?;
        let json = dir.path().join("ingest.json");
        let out = ns
            .command(me)
            .args(INGEST_RUN)
            .args(["--scheme", scheme, "--json"])
            .arg(&json)
            .output()?;
        if !out.status.success() {
            bail!("ingest failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
        reps.push(v["ingest"].clone());
    }
    Ok(reps)
}

/// One table row from the runs' reports, and the median fp32-equivalent ingest in GB/s.
fn ingest_row(rate: Rate, scheme: &str, reps: &[serde_json::Value]) -> (String, f64) {
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
    (line, ingest.median)
}

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
