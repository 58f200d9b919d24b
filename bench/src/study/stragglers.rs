//! The `stragglers` section: BSP, SSP s = 1, 3, 8 and async under transient stragglers (every worker, p = 0.1,
//! 3×) and a persistent one (worker 0, 2×); time to target, stall, max lead and the staleness histograms; the goal
//! SSP s = 3 ≥ 1.5× BSP at ≤ 0.5 pt.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use super::runs::{base_spec, Measured, Spec};
use super::{plot_or_warn, Study};
use crate::plot::{lines, Series};

/// (mode, staleness bound).
const MODES: [(&str, &str); 5] = [
    ("BSP", "0"),
    ("SSP s=1", "1"),
    ("SSP s=3", "3"),
    ("SSP s=8", "8"),
    ("async", "inf"),
];

/// (kind, `P:F` for every worker, `P:F` for worker 0).
const KINDS: [(&str, Option<&str>, Option<&str>); 2] = [
    ("transient (p=0.1, 3×)", Some("0.1:3"), None),
    ("persistent (worker 0, 2×)", None, Some("1:2")),
];

/// Measures every mode under both kinds, appends the table and the goal, draws the histograms.
pub(super) fn section(study: &mut Study<'_>, md: &mut String) -> Result<()> {
    let rows = measure_rows(study)?;
    render_table(md, &rows);
    render_goal(md, &rows);
    draw_histograms(&study.plots, &rows);
    let _ = writeln!(md, "![staleness](bench/plots/staleness_histograms.png)\n");
    Ok(())
}

/// Every mode under every kind of straggler, as (kind, measured).
fn measure_rows(study: &mut Study<'_>) -> Result<Vec<(String, Measured)>> {
    let mut rows: Vec<(String, Measured)> = Vec::new();
    for (kind, all, first) in KINDS {
        for (name, s) in MODES {
            let spec = Spec {
                staleness: s.into(),
                straggle_all: all.map(String::from),
                straggle_first: first.map(String::from),
                ..base_spec(study.args)
            };
            rows.push((kind.to_string(), study.measure(name, spec)?));
        }
    }
    Ok(rows)
}

/// The table, one row per (kind, mode), each against BSP under the same kind.
fn render_table(md: &mut String, rows: &[(String, Measured)]) {
    let _ = writeln!(md, "## Bounded staleness under stragglers (1 Gbit/s, q4)\n");
    let _ = writeln!(md, "| stragglers | mode | time to target s | final accuracy | stall fraction | vs BSP | max lead | staleness histogram (lo:count) |\n|---|---|---|---|---|---|---|---|");
    for (kind, m) in rows {
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
}

/// The goal line: SSP s = 3 against BSP under transient stragglers.
fn render_goal(md: &mut String, rows: &[(String, Measured)]) {
    let find = |kind: &str, label: &str| {
        rows.iter()
            .find(|(k, m)| k.starts_with(kind) && m.label == label)
            .map(|(_, m)| m)
    };
    if let (Some(b), Some(s3)) = (find("transient", "BSP"), find("transient", "SSP s=3")) {
        let ratio = b.ttt().median / s3.ttt().median;
        let loss = (b.spread(|o| o.final_accuracy).median - s3.spread(|o| o.final_accuracy).median)
            * 100.0;
        let _ = writeln!(
            md,
            "\n**Goal SSP s=3 vs BSP under transient stragglers, time to target ≥ 1.5× at ≤ 0.5 pt: measured {ratio:.2}× at {loss:+.2} pt** ({}). A persistent straggler gains only s rounds of slack: every mode but async ends at its pace (the table's second half).\n",
            if ratio >= 1.5 && loss <= 0.5 { "met" } else { "missed" }
        );
    }
}

/// The staleness histogram of each row's first run, as fractions of its pushes.
fn draw_histograms(plots: &Path, rows: &[(String, Measured)]) {
    let mut series: Vec<Series> = Vec::new();
    for (kind, m) in rows {
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
}
