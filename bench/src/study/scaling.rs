//! The `scaling` section: 1, 2, 4, 8 workers × 1, 2, 4 shards (1 Gbit/s, q4, s = 3, one epoch, no evaluation);
//! samples/s and efficiency against the 1-worker run at the same shard count, and a plot. Its runs also join the
//! simulator's validation pool.

use std::fmt::Write as _;

use anyhow::Result;

use super::runs::{base_spec, Measured, Spec};
use super::{plot_or_warn, report, Study};
use crate::plot::{lines, Series};

/// Shard counts, outermost.
const SHARDS: [u32; 3] = [1, 2, 4];

/// Measures every cell, appends the table, draws the plot; the cells, for the simulator's validation.
pub(super) fn section(study: &mut Study<'_>, md: &mut String) -> Result<Vec<Measured>> {
    let cells = measure_cells(study)?;
    let series = render_table(md, &cells);
    plot_or_warn(
        lines(
            &study.plots.join("scaling.png"),
            "Samples/s against workers",
            "workers",
            "samples/s",
            &series,
            (false, false),
        ),
        "plot",
    );
    let _ = writeln!(md, "\n![scaling](bench/plots/scaling.png)\n");
    Ok(cells)
}

/// Every (shards, workers) cell, shards outermost.
fn measure_cells(study: &mut Study<'_>) -> Result<Vec<Measured>> {
    let mut cells: Vec<Measured> = Vec::new();
    for shards in SHARDS {
        for workers in [1u32, 2, 4, 8] {
            let spec = Spec {
                workers,
                shards,
                epochs: 1,
                eval: false,
                ..base_spec(study.args)
            };
            cells.push(study.measure(&format!("{workers}w×{shards}s"), spec)?);
        }
    }
    Ok(cells)
}

/// The table, one row per cell; the plot's samples/s-against-workers series, one per shard count.
fn render_table(md: &mut String, cells: &[Measured]) -> Vec<Series> {
    let cores = report::cores();
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
    for shards in SHARDS {
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
    series
}
