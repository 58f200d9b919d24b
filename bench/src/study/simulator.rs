//! The `sim` section: throughput-only validation runs (1–8 workers on 1 Gbit/s and 100 Mbit/s, q4 and fp32, and
//! transient stragglers under BSP and s = 3) join the scaling cells; the calibrated simulator replays each and the
//! table shows its error (goal ≤ 15%); then the 64–1,024-worker prediction on the calibrated base, with its plot.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use anyhow::Result;

use tether_bench::sim::{simulate, SimConfig};
use tether_bench::stats::relative_error;

use super::calibration::{sim_of, Calibration};
use super::prediction::{predict, prediction_base, prediction_table, saturation};
use super::runs::{base_spec, rate_name, Measured, Spec};
use super::{plot_or_warn, Study};

/// Measures the validation runs into `pool`, appends the validation table and the prediction.
pub(super) fn section(
    study: &mut Study<'_>,
    md: &mut String,
    cal: &Calibration,
    mut pool: Vec<Measured>,
) -> Result<()> {
    pool.extend(measure_validation(study)?);
    render_validation(md, cal, &pool)?;
    render_prediction(md, &study.plots, cal)
}

/// Throughput-only runs (no evaluation): 1–8 workers on the two shaped links with both pushes, then transient
/// stragglers under BSP and s = 3.
fn measure_validation(study: &mut Study<'_>) -> Result<Vec<Measured>> {
    let mut pool = Vec::new();
    for rate in [Some(1_000_000_000), Some(100_000_000)] {
        for scheme in ["q4", "none"] {
            for workers in [1u32, 2, 4, 8] {
                let spec = Spec {
                    workers,
                    scheme: scheme.into(),
                    error_feedback: scheme != "none",
                    rate,
                    epochs: 1,
                    eval: false,
                    ..base_spec(study.args)
                };
                let label = format!("{scheme} {workers}w");
                pool.push(study.measure(&label, spec)?);
            }
        }
    }
    for (label, staleness) in [("transient BSP", "0"), ("transient s=3", "3")] {
        let spec = Spec {
            staleness: staleness.into(),
            straggle_all: Some("0.1:3".into()),
            epochs: 1,
            eval: false,
            ..base_spec(study.args)
        };
        pool.push(study.measure(label, spec)?);
    }
    Ok(pool)
}

/// The paragraph on how the simulator was calibrated in this invocation.
fn render_calibration(md: &mut String, cal: &Calibration) {
    let _ = writeln!(md, "## Simulator validation\n");
    let _ = writeln!(
        md,
        "`tether-bench simulate` replays the SSP gate and the pull → compute → push pipeline (see `bench/src/sim.rs`). \
         Calibration, all measured in this invocation (the floors above: shard apply {:.2} ns/param, pull serve \
         {:.2} ns/param, QUIC {:.3} ns per wire byte per side, are what the prediction uses): unshaped links at \
         {:.1} Gbit/s (raw quinn), {} shared cores; whole-process CPU per round (getrusage of the worker and the \
         shard processes) and the fixed pull overhead from one 1-worker unshaped run per scheme on the same shards ({}); bytes per parameter from each run; 50 µs one way. The simulator \
         then predicts the 1–8-worker runs on the shaped links, where the workers and shards share the cores. \
         Throughput runs do not evaluate. Error = |sim − real| / real for both figures. The goal is ≤ 15% on \
         every row.\n",
        cal.apply_ns_per_param,
        cal.serve_ns_per_param,
        cal.cpu_ns_per_byte,
        cal.unshaped_bps / 1e9,
        cal.cores,
        cal.per_scheme
            .iter()
            .map(|c| format!(
                "{}: worker {:.2} ms compute + {:.2} ms transport CPU per round, shard {:.2} ns per parameter \
                 per round, {:.2} ms per pull",
                c.scheme,
                c.worker_cpu_per_round_s * 1e3,
                c.worker_io_per_round_s * 1e3,
                c.shard_ns_per_param,
                c.pull_overhead_s * 1e3
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

/// The calibration paragraph, the table of simulated against real for every run in `pool`, and the goal line.
fn render_validation(md: &mut String, cal: &Calibration, pool: &[Measured]) -> Result<()> {
    render_calibration(md, cal);
    let _ = writeln!(md, "| run | link | real rounds/s (min–max) | sim rounds/s | error | real stall | sim stall | error |\n|---|---|---|---|---|---|---|---|");
    let mut worst: f64 = 0.0;
    for m in pool {
        let Some(o) = m.runs.first() else { continue };
        let (row, error) = validation_row(m, &sim_of(m, o, cal))?;
        worst = worst.max(error);
        let _ = writeln!(md, "{row}");
    }
    let within = pool
        .iter()
        .filter(|m| {
            let sp = m.spread(|o| o.rounds_per_s);
            (sp.max - sp.min) / sp.median <= 0.3
        })
        .count();
    let _ = writeln!(
        md,
        "\n**Goal simulator error ≤ 15% on every row: worst {:.1}%** ({}). {} of {} rows' real runs stay within \
         ±15% of their own median (min–max); on the others the machine's own noise exceeds the goal.\n",
        worst * 100.0,
        if worst <= 0.15 { "met" } else { "missed" },
        within,
        pool.len()
    );
    Ok(())
}

/// One validation row: `m` simulated on `config` against its real medians; the row and its larger error.
fn validation_row(m: &Measured, config: &SimConfig) -> Result<(String, f64)> {
    let real_t = m.spread(|o| o.rounds_per_s).median;
    let real_s = m.spread(|o| o.stall_fraction).median;
    let sim = simulate(config)?;
    let e1 = relative_error(sim.rounds_per_s, real_t);
    let e2 = relative_error(sim.stall_fraction, real_s);
    let row = format!(
        "| {} {}w×{}s s={} {} | {} | {} | {:.2} | {:.1}% | {real_s:.3} | {:.3} | {:.1}% |",
        m.label,
        m.spec.workers,
        m.spec.shards,
        m.spec.staleness,
        m.spec
            .straggle_all
            .as_deref()
            .map(|s| format!("straggle {s}"))
            .or(m.spec.straggle_first.as_deref().map(|s| format!("w0 {s}")))
            .unwrap_or_default(),
        rate_name(m.spec.rate),
        m.spread(|o| o.rounds_per_s).show(1),
        sim.rounds_per_s,
        e1 * 100.0,
        sim.stall_fraction,
        e2 * 100.0
    );
    Ok((row, e1.max(e2)))
}

/// The prediction grid on the calibrated base: its paragraph, table, saturation summary and plot.
fn render_prediction(md: &mut String, plots: &Path, cal: &Calibration) -> Result<()> {
    let base = SimConfig {
        pull_overhead_s: cal.per_scheme.first().map_or(200e-6, |c| c.pull_overhead_s),
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
    plot_or_warn(
        crate::plot::prediction(&plots.join("prediction.png"), &rows),
        "prediction",
    );
    let _ = writeln!(md, "\n![prediction](bench/plots/prediction.png)\n");
    Ok(())
}
