//! The `links` section: local-step rounds (BSP, H = 16) on slow worker links (10 Mbit/s both ways, 100 down / 10
//! up) against unshaped: q4 both ways, topk2 both ways, and topk2 with link-aware H; wall time, bytes against
//! per-step fp32 synchronisation, the largest push and the H picked.

use std::fmt::Write as _;

use anyhow::Result;

use tether_bench::netns::Rate;

use super::runs::{base_spec, Measured, Spec};
use super::{Study, StudyArgs};

/// `Some(m)` Mbit/s.
const fn mbit(m: u64) -> Rate {
    Some(m * 1_000_000)
}

/// The workers' links (up, down), unshaped first (the "vs unshaped" reference).
const LINKS: [(&str, Option<(Rate, Rate)>); 3] = [
    ("unshaped", None),
    ("10 Mbit/s both ways", Some((mbit(10), mbit(10)))),
    ("100 down / 10 up Mbit/s", Some((mbit(10), mbit(100)))),
];

/// (label, topk2 both ways, `local_steps_max`; 0: H pinned at 16).
const CONFIGS: [(&str, bool, u32); 3] = [
    ("q4 both ways, H = 16 (the quickstart before)", false, 0),
    ("topk2 both ways, H = 16 (the quickstart now)", true, 0),
    ("topk2 both ways, link-aware H 16..=64", true, 64),
];

/// Measures every configuration on every link, then appends the table.
pub(super) fn section(study: &mut Study<'_>, md: &mut String) -> Result<()> {
    let grid = measure_grid(study)?;
    render_table(md, study.args, &grid);
    Ok(())
}

/// Every configuration on every link, as (index into [`LINKS`], measured).
fn measure_grid(study: &mut Study<'_>) -> Result<Vec<(usize, Measured)>> {
    let mut grid: Vec<(usize, Measured)> = Vec::new();
    for (li, (_, link)) in LINKS.iter().enumerate() {
        for (label, sparse, hmax) in CONFIGS {
            let spec = Spec {
                local_steps: 16,
                local_steps_max: hmax,
                sparse,
                staleness: "0".into(),
                rate: None,
                worker_link: *link,
                ..base_spec(study.args)
            };
            grid.push((li, study.measure(label, spec)?));
        }
    }
    Ok(grid)
}

/// The table, one row per (link, configuration), each against its own unshaped run.
fn render_table(md: &mut String, a: &StudyArgs, grid: &[(usize, Measured)]) {
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
    for (li, (lname, _)) in LINKS.iter().enumerate() {
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
