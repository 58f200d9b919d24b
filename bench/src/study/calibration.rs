//! The simulator's calibration, measured at the start of every study: the floors (shard apply, delta cut, raw
//! quinn) and one 1-worker unshaped run per push scheme give the CPU costs; [`sim_of`] turns a measured run plus
//! this calibration into the [`SimConfig`] the simulator replays. Nothing here is assumed: every cost comes from
//! this invocation.

use anyhow::{Context, Result};
use serde::Serialize;

use tether_bench::sim::SimConfig;

use super::runs::{base_spec, measure, Env, Measured, Outcome, Spec};
use super::StudyArgs;

/// CPU costs for the simulator, from the floors and the 1-worker runs measured at the start of the study.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Calibration {
    pub(super) apply_ns_per_param: f64,
    pub(super) serve_ns_per_param: f64,
    pub(super) cpu_ns_per_byte: f64,
    pub(super) unshaped_bps: f64,
    pub(super) cores: u32,
    /// Per scheme, from a 1-worker unshaped run on the study's shard count.
    pub(super) per_scheme: Vec<SchemeCost>,
    pub(super) floors: Vec<crate::floors::Floor>,
}

/// What one round costs with a scheme, from a 1-worker unshaped run (whole-process CPU, `getrusage`).
#[derive(Debug, Clone, Serialize)]
pub(super) struct SchemeCost {
    pub(super) scheme: String,
    /// Worker CPU per round on the critical path: the compute phase (clip, error feedback and encode included).
    pub(super) worker_cpu_per_round_s: f64,
    /// The rest of the worker process's CPU per round (transport threads, pull decoding).
    pub(super) worker_io_per_round_s: f64,
    /// Shard process CPU per round per parameter (apply, serve, QUIC), ns.
    pub(super) shard_ns_per_param: f64,
    /// The measured pull wait minus its transfers and one-way latencies.
    pub(super) pull_overhead_s: f64,
}

/// Runs the floors on one shard of the study's model, then one 1-worker unshaped run per scheme (q4, fp32).
pub(super) fn calibrate(env: &Env, a: &StudyArgs, log: &mut Vec<String>) -> Result<Calibration> {
    let mut cal = from_floors(a)?;
    for scheme in ["q4", "none"] {
        let spec = Spec {
            workers: 1,
            scheme: scheme.into(),
            error_feedback: scheme != "none",
            rate: None,
            epochs: 1,
            eval: false,
            ..base_spec(a)
        };
        let m = measure(
            env,
            &format!("calibration {scheme} 1w×{}s", a.shards),
            spec,
            a,
            log,
        )?;
        let cost = scheme_cost(&cal, &m, scheme, a.shards);
        cal.per_scheme.push(cost);
    }
    Ok(cal)
}

/// The floors' CPU costs and this machine's unshaped rate and cores, with no scheme measured yet.
fn from_floors(a: &StudyArgs) -> Result<Calibration> {
    let floors = crate::floors::run(&crate::floors::FloorArgs {
        shard_params: 235_146 / a.shards as usize,
        scheme: "q4".into(),
        optimizer: "adam".into(),
        seconds: 1.0,
    })?;
    let get = |prefix: &str| floors.iter().find(|f| f.name.starts_with(prefix));
    let apply = get("shard apply").map_or(3.0, |f| 4.0 / f.fp32_gbps);
    let cut = get("delta cut").map_or(1.0, |f| 4.0 / f.fp32_gbps);
    let quinn = get("raw quinn").context("raw quinn floor")?;
    // CPU per wire byte of both ends together, halved per side.
    let per_byte = quinn.cpu_s_per_gb * quinn.fp32_gbps / quinn.bytes_gbps / 2.0;
    Ok(Calibration {
        apply_ns_per_param: apply,
        // A pull reply needs a delta cut once per version moved, shared by the workers; charged per reply.
        serve_ns_per_param: cut,
        cpu_ns_per_byte: per_byte,
        unshaped_bps: quinn.bytes_gbps * 8e9,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        per_scheme: Vec::new(),
        floors,
    })
}

/// What a round of `scheme` costs, from its 1-worker calibration run `m` on `shards` shards.
fn scheme_cost(cal: &Calibration, m: &Measured, scheme: &str, shards: u32) -> SchemeCost {
    let rounds = |o: &Outcome| o.rounds_per_worker.max(1.0);
    let compute = m.spread(|o| o.compute_per_round_s).median;
    let worker_cpu = m.spread(|o| o.worker_cpu_s / rounds(o)).median;
    let shard_ns = m
        .spread(|o| o.shard_cpu_s / rounds(o) / o.params.max(1) as f64 * 1e9)
        .median;
    // What the simulator does not model of a pull: the measured wait minus its transfer, the delta cut and
    // the latencies (each shard answers in parallel).
    let shards = f64::from(shards.max(1));
    let overhead = m
        .spread(|o| {
            let per_shard_bytes = o.pull_bytes / rounds(o) / shards;
            let wait = o.stall_fraction * o.wall_s / rounds(o);
            let serve = cal.serve_ns_per_param * o.params as f64 / shards * 1e-9;
            (wait - per_shard_bytes * 8.0 / cal.unshaped_bps - serve - 100e-6).max(0.0)
        })
        .median;
    SchemeCost {
        scheme: scheme.to_string(),
        worker_cpu_per_round_s: compute.min(worker_cpu),
        worker_io_per_round_s: (worker_cpu - compute).max(0.0),
        shard_ns_per_param: shard_ns,
        pull_overhead_s: overhead,
    }
}

/// The simulator's view of a measured run: the CPU per round and the pull overhead of the 1-worker calibration run
/// of its scheme, the floors' CPU costs, the run's bytes per parameter, the link's rate and this machine's cores.
pub(super) fn sim_of(m: &Measured, o: &Outcome, cal: &Calibration) -> SimConfig {
    let rounds = o.rounds_per_worker.round().max(1.0) as u64;
    let per = (o.params as f64 * rounds as f64 * f64::from(m.spec.workers)).max(1.0);
    let (straggle, slow) = match (&m.spec.straggle_all, &m.spec.straggle_first) {
        (Some(s), _) => (parse_pf(s), None),
        (None, Some(s)) => (None, parse_pf(s).map(|p| p.1)),
        _ => (None, None),
    };
    let (compute_s, worker_io_s, pull_overhead_s, shard_ns) = cal
        .per_scheme
        .iter()
        .find(|c| c.scheme == m.spec.scheme)
        .map_or(
            (o.compute_per_round_s, 0.0, 0.0, cal.apply_ns_per_param),
            |c| {
                (
                    c.worker_cpu_per_round_s,
                    c.worker_io_per_round_s,
                    c.pull_overhead_s,
                    c.shard_ns_per_param,
                )
            },
        );
    SimConfig {
        workers: m.spec.workers,
        shards: m.spec.shards,
        params: o.params.max(1),
        staleness: if m.spec.staleness == "inf" {
            None
        } else {
            m.spec.staleness.parse().ok()
        },
        rounds,
        compute_s,
        compute_cv: 0.1,
        straggle,
        slow_worker: slow,
        push_bytes_per_param: o.push_bytes / per,
        pull_bytes_per_param: o.pull_bytes / per,
        // Whole-process CPU of the calibration run: the worker's compute phase is on its critical path, the rest of
        // its CPU is not; the shard's actor work (apply, the delta cut) is the floors' apply and serve cost, the rest
        // of the shard process's CPU (QUIC, connection tasks) is off the actor's path.
        worker_ns_per_param: 0.0,
        apply_ns_per_param: cal.apply_ns_per_param,
        serve_ns_per_param: cal.serve_ns_per_param,
        cpu_ns_per_byte: 0.0,
        shard_io_ns_per_param: (shard_ns - cal.apply_ns_per_param - cal.serve_ns_per_param)
            .max(0.0),
        link_bps: m.spec.rate.map_or(cal.unshaped_bps, |b| b as f64),
        latency_s: 50e-6,
        seed: 3,
        cores: Some(cal.cores),
        compute_quantiles_s: Vec::new(),
        pull_overhead_s,
        worker_io_s,
    }
}

/// Parses a `P:F` straggling flag.
fn parse_pf(s: &str) -> Option<(f64, f64)> {
    let (p, f) = s.split_once(':')?;
    Some((p.parse().ok()?, f.parse().ok()?))
}
