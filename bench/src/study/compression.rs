//! The `compression` section: every push scheme (fp32, bf16, q8, q4, q2, with and without error feedback, and q4
//! local-step rounds) on every link (unshaped, 10 Gbit/s, 1 Gbit/s, 100 Mbit/s); time to target, final accuracy and
//! bytes, the goal q4 ≥ 4× fp32 at 1 Gbit/s, and two plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Result;

use tether_bench::netns::Rate;

use super::runs::{base_spec, pull_name, rate_name, Measured, Spec};
use super::{plot_or_warn, Study, StudyArgs};
use crate::plot::{lines, Series};

/// The links, fastest first (the plot's x axis is their index).
const RATES: [Rate; 4] = [
    None,
    Some(10_000_000_000),
    Some(1_000_000_000),
    Some(100_000_000),
];

/// (label, push scheme, error feedback, local steps per round; 0: per-step pushes).
const CONFIGS: [(&str, &str, bool, u32); 8] = [
    ("fp32", "none", false, 0),
    ("bf16", "bf16", true, 0),
    ("q8", "q8", true, 0),
    ("q4", "q4", true, 0),
    ("q2", "q2", true, 0),
    ("q4, no EF", "q4", false, 0),
    ("q2, no EF", "q2", false, 0),
    ("q4 + local steps 8 (BSP rounds)", "q4", true, 8),
];

/// Measures the grid, appends its table and goal, draws its plots.
pub(super) fn section(study: &mut Study<'_>, md: &mut String) -> Result<()> {
    let grid = measure_grid(study)?;
    render_table(md, study.args, &grid);
    draw_plots(&study.plots, &grid);
    let _ = writeln!(md, "![time to target](bench/plots/schemes_time_to_target.png)\n![bytes vs accuracy](bench/plots/bytes_vs_accuracy.png)\n");
    Ok(())
}

/// Every configuration on every link, links outermost.
fn measure_grid(study: &mut Study<'_>) -> Result<Vec<Measured>> {
    let mut grid: Vec<Measured> = Vec::new();
    for rate in RATES {
        for (label, scheme, ef, h) in &CONFIGS {
            let spec = Spec {
                scheme: scheme.to_string(),
                error_feedback: *ef,
                local_steps: *h,
                // Local-step rounds are synchronous (BSP), as in the quickstart.
                staleness: if *h > 0 { "0".into() } else { "3".into() },
                rate,
                ..base_spec(study.args)
            };
            grid.push(study.measure(label, spec)?);
        }
    }
    Ok(grid)
}

/// The table, one row per (link, push), each against fp32 on its link, then the 1 Gbit/s goal.
fn render_table(md: &mut String, a: &StudyArgs, grid: &[Measured]) {
    let _ = writeln!(md, "## Push schemes across link speeds\n");
    let _ = writeln!(
        md,
        "Time to {:.2} test accuracy (worker 0 evaluates every 24 steps), final accuracy after {} epochs, and bytes \
         on the wire (pushes + pulls, all workers). SSP s = 3, per-step pushes unless said.\n",
        a.target, a.epochs
    );
    let _ = writeln!(md, "| link | push | pull | time to target s | final accuracy | wire MB | vs fp32 time |\n|---|---|---|---|---|---|---|");
    for rate in RATES {
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
    if let (Some(f), Some(q4)) = (q(Some(1_000_000_000), "fp32"), q(Some(1_000_000_000), "q4")) {
        let _ = writeln!(
            md,
            "\n**Goal q4 vs fp32 at 1 Gbit/s, time to target ≥ 4×: measured {:.2}×** ({}).\n",
            f / q4,
            if f / q4 >= 4.0 { "met" } else { "missed" }
        );
    }
}

/// Time to target against the link, and final accuracy against bytes on the wire, one line per configuration.
fn draw_plots(plots: &Path, grid: &[Measured]) {
    let mut series: Vec<Series> = Vec::new();
    for (label, ..) in &CONFIGS {
        let pts: Vec<(f64, f64)> = RATES
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
    for (label, ..) in &CONFIGS {
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
}
