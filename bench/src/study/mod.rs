//! `tether-bench study`: the re-runnable study behind `BENCHMARKS.md`. Real clusters of `tether-server` and
//! `tether-worker` processes on the link harness ([`crate::netns`]), one node per process: the push schemes (with
//! and without error feedback, and local-step rounds) across 100 Mbit/s, 1 Gbit/s, 10 Gbit/s and unshaped links;
//! BSP / SSP / async under transient and persistent stragglers; 1–8 workers × 1–4 shards; then the simulator,
//! calibrated from the floors and each run's own step times, validated against those runs and asked to predict
//! 64–1,024 workers × 8–64 shards. Every figure is a median over `--repeats` runs with its spread; comparisons are
//! ratios of medians from this one invocation.
//!
//! [`run`] is the call order: prepare, calibrate, the report's head, one function per `--sections` entry (each
//! measures its runs, then appends its tables and draws its plots), the run log, then the file. The runs live in
//! `runs`, the simulator's costs in `calibration`, the prediction grid in `prediction`, the report's fixed parts in
//! `report`; the plots are drawn by [`crate::plot`], which imports nothing from here.

mod calibration;
mod compression;
mod ingest;
mod links;
mod prediction;
mod report;
mod runs;
mod scaling;
mod simulator;
mod stragglers;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;

pub use prediction::{predict, prediction_base, print_prediction};
use runs::{Env, Measured, Spec};

/// What to run.
#[derive(Debug, Clone, clap::Args)]
pub struct StudyArgs {
    /// The report to write.
    #[arg(long, default_value = "BENCHMARKS.md")]
    pub out: PathBuf,
    /// Folder for the PNG plots (relative paths resolve against the report's folder).
    #[arg(long, default_value = "bench/plots")]
    pub plots: PathBuf,
    /// Runs per configuration (the median and the spread are reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: u32,
    /// Epochs per training run.
    #[arg(long, default_value_t = 2)]
    pub epochs: u32,
    /// Target test accuracy for "time to target".
    #[arg(long, default_value_t = 0.80)]
    pub target: f64,
    /// Workers of the compression and straggler runs.
    #[arg(long, default_value_t = 4)]
    pub workers: u32,
    /// Shards of the compression and straggler runs.
    #[arg(long, default_value_t = 2)]
    pub shards: u32,
    /// Sections to run (comma-separated): ingest, compression, links, stragglers, scaling, sim.
    #[arg(
        long,
        default_value = "ingest,compression,links,stragglers,scaling,sim"
    )]
    pub sections: String,
    /// Fashion-MNIST folder (the embedded digits set is used when it is missing).
    #[arg(long, default_value = "/usr/share/datasets/fashion-mnist")]
    pub data_dir: PathBuf,
}

/// What every section reads and appends to: the arguments, the binaries and data, the plots folder, the run log.
struct Study<'a> {
    args: &'a StudyArgs,
    env: Env,
    plots: PathBuf,
    log: Vec<String>,
}

impl<'a> Study<'a> {
    /// Creates the plots folder, finds the binaries and the data set, and announces the study on stderr.
    fn prepare(a: &'a StudyArgs) -> Result<Study<'a>> {
        let out_dir = a.out.parent().map(Path::to_path_buf).unwrap_or_default();
        let plots = if a.plots.is_absolute() {
            a.plots.clone()
        } else {
            out_dir.join(&a.plots)
        };
        std::fs::create_dir_all(&plots)?;
        let env = Env::find(&a.data_dir)?;
        eprintln!(
            "study: {}, {} repeats, {} epochs, target {}",
            env.dataset(),
            a.repeats,
            a.epochs,
            a.target
        );
        Ok(Study {
            args: a,
            env,
            plots,
            log: Vec::new(),
        })
    }

    /// Whether `--sections` names `section`.
    fn has(&self, section: &str) -> bool {
        self.args
            .sections
            .split(',')
            .map(str::trim)
            .any(|s| s == section)
    }

    /// Runs `spec` `--repeats` times under `label`, into the run log.
    fn measure(&mut self, label: &str, spec: Spec) -> Result<Measured> {
        runs::measure(&self.env, label, spec, self.args, &mut self.log)
    }
}

/// Runs the study and writes the report.
pub fn run(a: &StudyArgs) -> Result<()> {
    let started = Instant::now();
    let mut study = Study::prepare(a)?;
    let cal = calibration::calibrate(&study.env, a, &mut study.log)?;
    let mut md = report::head(a, study.env.dataset(), &cal);
    let mut validation_pool: Vec<Measured> = Vec::new();
    if study.has("ingest") {
        ingest::section(a, &mut md)?;
    }
    if study.has("compression") {
        compression::section(&mut study, &mut md)?;
    }
    if study.has("links") {
        links::section(&mut study, &mut md)?;
    }
    if study.has("stragglers") {
        stragglers::section(&mut study, &mut md)?;
    }
    if study.has("scaling") {
        validation_pool.extend(scaling::section(&mut study, &mut md)?);
    }
    if study.has("sim") {
        simulator::section(&mut study, &mut md, &cal, validation_pool)?;
    }
    report::tail(&mut md, &study.log, started);
    std::fs::write(&a.out, md)?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Draws a plot; a plot that cannot be drawn is reported, not fatal (the tables are the record).
fn plot_or_warn(r: Result<()>, name: &str) {
    if let Err(e) = r {
        eprintln!(
            "study: plot {name} not drawn: {}",
            tether_common::error_chain::ErrorChain(e.as_ref())
        );
    }
}
