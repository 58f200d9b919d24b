//! The study's PNG plots (plotters, bitmap backend): line charts of named series, optionally on log axes. A leaf:
//! it owns what it draws ([`Series`], [`PredictionRow`]) and imports nothing from the study, which calls it.

use std::path::Path;

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use serde::Serialize;

/// Registers DejaVu Sans as `sans-serif` once (plotters' ab_glyph backend has no font of its own).
fn ensure_font() -> Result<()> {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *FONT.get_or_init(|| {
        let Ok(bytes) = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf") else {
            return false;
        };
        let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, leaked).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!("plots need /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf (apt-get install fonts-dejavu-core)"))
    }
}

/// One named series of (x, y) points.
pub type Series = (String, Vec<(f64, f64)>);

/// A line chart with markers; `log` = (x log, y log).
pub fn lines(
    path: &Path,
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
    log: (bool, bool),
) -> Result<()> {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|p| p.0.is_finite() && p.1.is_finite())
        .collect();
    ensure_font()?;
    if pts.is_empty() {
        return Err(anyhow!("plot {title}: no finite points"));
    }
    let lo = |v: f64, log: bool| {
        if log {
            v.max(1e-9) / 1.3
        } else {
            v - (v.abs() * 0.05).max(1e-9)
        }
    };
    let hi = |v: f64, log: bool| {
        if log {
            v * 1.3
        } else {
            v + (v.abs() * 0.05).max(1e-9)
        }
    };
    let (x0, x1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.0), a.1.max(p.0)));
    let (y0, y1) = pts
        .iter()
        .fold((f64::MAX, f64::MIN), |a, p| (a.0.min(p.1), a.1.max(p.1)));
    let (x0, x1, y0, y1) = (
        lo(x0, log.0),
        hi(x1, log.0),
        lo(y0.min(if log.1 { y0 } else { 0.0 }), log.1),
        hi(y1, log.1),
    );
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let mut b = ChartBuilder::on(&root);
    b.caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64);
    macro_rules! draw {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(x)
                .y_desc(y)
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
            for (i, (name, s)) in series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let s: Vec<(f64, f64)> = s
                    .iter()
                    .copied()
                    .filter(|p| p.0.is_finite() && p.1.is_finite())
                    .collect();
                chart
                    .draw_series(LineSeries::new(s.clone(), color.stroke_width(2)))
                    .map_err(|e| anyhow!("{e}"))?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(s.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(|e| anyhow!("{e}"))?;
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
        }};
    }
    match log {
        (false, false) => draw!(b
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|e| anyhow!("{e}"))?),
        (true, false) => draw!(b
            .build_cartesian_2d((x0..x1).log_scale(), y0..y1)
            .map_err(|e| anyhow!("{e}"))?),
        (false, true) => draw!(b
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(|e| anyhow!("{e}"))?),
        (true, true) => draw!(b
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(|e| anyhow!("{e}"))?),
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}

/// One row of the simulator's prediction grid: what the prediction plot draws and the study tabulates.
#[derive(Debug, Clone, Serialize)]
pub struct PredictionRow {
    /// Workers.
    pub workers: u32,
    /// Shards.
    pub shards: u32,
    /// Link, Gbit/s.
    pub link_gbit: f64,
    /// Samples/s at the base's batch of 128 per round.
    pub samples_per_s: f64,
    /// Rounds/s, all workers.
    pub rounds_per_s: f64,
    /// Busiest shard CPU.
    pub shard_cpu_util: f64,
    /// Busiest shard link.
    pub shard_link_util: f64,
    /// Mean stall fraction.
    pub stall: f64,
    /// The bounding resource.
    pub limit: String,
}

/// The prediction plot: cluster throughput against workers, one line per (link, shards).
pub fn prediction(path: &Path, rows: &[PredictionRow]) -> Result<()> {
    let mut series: Vec<Series> = Vec::new();
    for r in rows {
        let name = format!("{} Gbit/s, {} shards", r.link_gbit, r.shards);
        match series.iter_mut().find(|s| s.0 == name) {
            Some(s) => s.1.push((r.workers as f64, r.samples_per_s)),
            None => series.push((name, vec![(r.workers as f64, r.samples_per_s)])),
        }
    }
    lines(
        path,
        "Predicted throughput (simulator)",
        "workers",
        "samples/s",
        &series,
        (true, true),
    )
}
