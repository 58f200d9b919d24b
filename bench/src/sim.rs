//! The discrete-event simulator of a Tether cluster: plain Rust, parameters in, a [`SimReport`] out.
//!
//! What it models is what the worker's training loop (`tether_worker::PreparedWorker::run`) and the shard actor do. Each worker loops: pull at clock `c`
//! (one request per shard), wait until every shard answered, compute the round (a lognormal step time, optionally
//! stretched by a straggler model, plus the worker's codec work), push one frame to every shard without waiting for
//! the outcome, and pull again at `c + 1`. Each shard is one CPU (its actor) that serves applies and pull replies in
//! arrival order, and answers a pull for clock `c` only once every live worker's clock at that shard is at least
//! `c − s` (`ClockTable::can_answer`); a push moves its worker's clock there when it is applied. Every node has one
//! NIC: a FIFO per direction at the link rate, and a message holds the sender's egress and the receiver's ingress at
//! once (cut-through), then arrives a one-way latency later. QUIC's CPU per byte is charged to the sending and
//! receiving CPUs (the shard's actor CPU on the server side, as the connection tasks share its cores on the small
//! machines this is calibrated on).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use tether_common::testing::TestRng;

/// Everything the simulator needs; [`SimConfig::validate`] refuses nonsense.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimConfig {
    /// Workers.
    pub workers: u32,
    /// Shards (parameters split evenly).
    pub shards: u32,
    /// Model parameters.
    pub params: u64,
    /// Staleness bound (`None`: asynchronous).
    pub staleness: Option<u64>,
    /// Push rounds per worker.
    pub rounds: u64,
    /// Mean compute time of a round, seconds.
    pub compute_s: f64,
    /// Coefficient of variation of the compute time (lognormal).
    pub compute_cv: f64,
    /// Transient stragglers on every worker: `(probability, factor)` per round.
    pub straggle: Option<(f64, f64)>,
    /// A persistent straggler: worker 0 is this many times slower.
    pub slow_worker: Option<f64>,
    /// Wire bytes per parameter of a push.
    pub push_bytes_per_param: f64,
    /// Wire bytes per parameter of a pull reply.
    pub pull_bytes_per_param: f64,
    /// Worker CPU per model parameter per round (encode the push, decode the pull), ns.
    pub worker_ns_per_param: f64,
    /// Shard CPU per pushed parameter (validate, decode, optimizer step), ns.
    pub apply_ns_per_param: f64,
    /// Shard CPU per pulled parameter (the reply: cut, encode, copy), ns.
    pub serve_ns_per_param: f64,
    /// Transport CPU per wire byte, each side, ns.
    pub cpu_ns_per_byte: f64,
    /// Link rate per NIC direction, bits/s (`f64::INFINITY`: unshaped).
    pub link_bps: f64,
    /// One-way latency, seconds.
    pub latency_s: f64,
    /// Seed of the compute-time draws.
    pub seed: u64,
    /// Cores shared by every worker's and shard's CPU work (one machine, as the study's runs); `None`: each node
    /// has its own (a real cluster).
    #[serde(default)]
    pub cores: Option<u32>,
    /// Fixed cost of a pull reply beyond bytes and CPU (request handling, wake-ups), seconds.
    #[serde(default)]
    pub pull_overhead_s: f64,
    /// Worker CPU per round off the critical path (transport threads), seconds: it takes a core from the shared
    /// pool (with `cores`) but nothing waits for it.
    #[serde(default)]
    pub worker_io_s: f64,
    /// Shard CPU per pushed parameter off the actor's critical path (its transport threads), ns: it takes a core
    /// from the shared pool but nothing waits for it.
    #[serde(default)]
    pub shard_io_ns_per_param: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            workers: 4,
            shards: 2,
            params: 1 << 20,
            staleness: Some(3),
            rounds: 100,
            compute_s: 0.01,
            compute_cv: 0.1,
            straggle: None,
            slow_worker: None,
            push_bytes_per_param: 0.5,
            pull_bytes_per_param: 0.5,
            worker_ns_per_param: 2.0,
            apply_ns_per_param: 3.0,
            serve_ns_per_param: 1.0,
            cpu_ns_per_byte: 1.0,
            link_bps: 1e9,
            latency_s: 50e-6,
            seed: 1,
            cores: None,
            pull_overhead_s: 0.0,
            worker_io_s: 0.0,
            shard_io_ns_per_param: 0.0,
        }
    }
}

/// A refused configuration.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SimError {
    /// A field is out of range.
    #[error("simulator parameter {field} = {value}: {why}")]
    Parameter {
        /// The field.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong.
        why: &'static str,
    },
}

impl SimConfig {
    /// Checks every field (sizes bounded so that a run stays within seconds and memory).
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |field, value: String, why| Err(SimError::Parameter { field, value, why });
        if self.workers == 0 || self.workers > 65_536 {
            return bad("workers", self.workers.to_string(), "must be 1..=65536");
        }
        if self.shards == 0 || self.shards > 4096 || u64::from(self.shards) > self.params {
            return bad(
                "shards",
                self.shards.to_string(),
                "must be 1..=4096 and ≤ params",
            );
        }
        if self.rounds == 0
            || self
                .rounds
                .saturating_mul(u64::from(self.workers) * u64::from(self.shards))
                > 1 << 28
        {
            return bad(
                "rounds",
                self.rounds.to_string(),
                "rounds × workers × shards must be 1..=2^28",
            );
        }
        let nonneg = [
            ("compute_s", self.compute_s),
            ("compute_cv", self.compute_cv),
            ("push_bytes_per_param", self.push_bytes_per_param),
            ("pull_bytes_per_param", self.pull_bytes_per_param),
            ("worker_ns_per_param", self.worker_ns_per_param),
            ("apply_ns_per_param", self.apply_ns_per_param),
            ("serve_ns_per_param", self.serve_ns_per_param),
            ("cpu_ns_per_byte", self.cpu_ns_per_byte),
            ("latency_s", self.latency_s),
            ("pull_overhead_s", self.pull_overhead_s),
            ("worker_io_s", self.worker_io_s),
            ("shard_io_ns_per_param", self.shard_io_ns_per_param),
        ];
        for (field, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return bad(field, v.to_string(), "must be finite and ≥ 0");
            }
        }
        if self.link_bps.is_nan() || self.link_bps <= 0.0 {
            return bad("link_bps", self.link_bps.to_string(), "must be > 0");
        }
        if let Some((p, f)) = self.straggle {
            if !((0.0..=1.0).contains(&p) && f.is_finite() && f >= 1.0) {
                return bad(
                    "straggle",
                    format!("{p}:{f}"),
                    "needs P in [0, 1] and F ≥ 1",
                );
            }
        }
        if let Some(c) = self.cores {
            if c == 0 || c > 4096 {
                return bad("cores", c.to_string(), "must be 1..=4096");
            }
        }
        if let Some(f) = self.slow_worker {
            if !(f.is_finite() && f >= 1.0) {
                return bad("slow_worker", f.to_string(), "must be ≥ 1");
            }
        }
        Ok(())
    }
}

/// What a simulated run measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SimReport {
    /// Until the last worker finished, seconds.
    pub wall_s: f64,
    /// Push rounds per second, all workers together.
    pub rounds_per_s: f64,
    /// Mean over workers of (time waiting for pulls) / (that worker's run time).
    pub stall_fraction: f64,
    /// Busiest shard CPU, fraction of the wall time.
    pub shard_cpu_util: f64,
    /// Busiest shard NIC direction, fraction of the wall time.
    pub shard_link_util: f64,
    /// Busiest worker NIC direction, fraction of the wall time.
    pub worker_link_util: f64,
    /// Mean worker compute (rounds' own time), fraction of the wall time.
    pub compute_util: f64,
    /// What bounds throughput: `shard cpu`, `shard link`, `worker link`, `staleness gate` or `compute`.
    pub limit: String,
    /// Clock lead (`c − m`) of each answered pull: count per lead value (index = lead, capped at the last bucket).
    pub lead_histogram: Vec<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ev {
    /// A pull request of worker `w` at clock `c` reaches shard `k`.
    PullArrive { w: u32, k: u32, c: u64 },
    /// Shard `k`'s reply reaches worker `w`.
    ReplyArrive { w: u32 },
    /// Worker `w` finished computing its round.
    ComputeDone { w: u32 },
    /// Worker `w`'s push reaches shard `k`.
    PushArrive { w: u32, k: u32 },
    /// Shard `k` finished applying worker `w`'s push.
    Applied { w: u32, k: u32 },
}

#[derive(Debug)]
struct Timed {
    t: f64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    fn cmp(&self, o: &Self) -> Ordering {
        // Earliest first out of a max-heap; ties in insertion order.
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

/// A FIFO resource: reserving `d` seconds from `t` starts when it is free.
#[derive(Debug, Clone, Copy, Default)]
struct Fifo {
    free: f64,
    busy: f64,
}

impl Fifo {
    fn reserve(&mut self, t: f64, d: f64) -> f64 {
        let start = self.free.max(t);
        self.free = start + d;
        self.busy += d;
        self.free
    }
}

/// Holds two FIFOs (egress and ingress) for one message: it starts when both are free.
fn transfer(out: &mut Fifo, inn: &mut Fifo, t: f64, d: f64) -> f64 {
    let start = t.max(out.free).max(inn.free);
    out.free = start + d;
    inn.free = start + d;
    out.busy += d;
    inn.busy += d;
    start + d
}

/// Cores shared by every CPU activity (each activity also holds its own node's serial `Fifo`): a job arriving at
/// `t` takes the core that frees first, in arrival order.
struct Pool {
    free: Vec<f64>,
}

impl Pool {
    fn run(&mut self, t: f64, d: f64, serial: &mut Fifo) -> f64 {
        let (i, f) = self
            .free
            .iter()
            .copied()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .unwrap_or((0, 0.0));
        let start = t.max(f).max(serial.free);
        let end = start + d;
        if let Some(c) = self.free.get_mut(i) {
            *c = end;
        }
        serial.free = end;
        serial.busy += d;
        end
    }
}

/// Runs `d` seconds of CPU on `serial` (a node's own CPU), on the shared pool when there is one.
fn cpu(pool: &mut Option<Pool>, serial: &mut Fifo, t: f64, d: f64) -> f64 {
    match pool {
        Some(p) => p.run(t, d, serial),
        None => serial.reserve(t, d),
    }
}

struct Worker {
    clock: u64,
    waiting: u32,
    pull_started: f64,
    stalled: f64,
    computing: f64,
    finished: Option<f64>,
    cpu: Fifo,
    io: Fifo,
    nic_out: Fifo,
    nic_in: Fifo,
}

struct Shard {
    cpu: Fifo,
    io: Fifo,
    nic_out: Fifo,
    nic_in: Fifo,
    /// Applied rounds per worker (the clock table row).
    clocks: Vec<u64>,
    /// Pulls waiting for the gate: (worker, clock).
    parked: Vec<(u32, u64)>,
}

const LEAD_BUCKETS: usize = 64;

/// Runs the simulation to the end (every worker ran `rounds` rounds).
pub fn simulate(cfg: &SimConfig) -> Result<SimReport, SimError> {
    cfg.validate()?;
    let (nw, ns) = (cfg.workers as usize, cfg.shards as usize);
    let shard_params = cfg.params as f64 / ns as f64;
    let secs = |bytes: f64| bytes * 8.0 / cfg.link_bps;
    let push_bytes = cfg.push_bytes_per_param * shard_params;
    let pull_bytes = cfg.pull_bytes_per_param * shard_params;
    let apply_cost =
        (cfg.apply_ns_per_param * shard_params + cfg.cpu_ns_per_byte * push_bytes) * 1e-9;
    let shard_io = cfg.shard_io_ns_per_param * shard_params * 1e-9;
    let serve_cost =
        (cfg.serve_ns_per_param * shard_params + cfg.cpu_ns_per_byte * pull_bytes) * 1e-9;
    let worker_cpu = (cfg.worker_ns_per_param * cfg.params as f64
        + cfg.cpu_ns_per_byte * (push_bytes + pull_bytes) * ns as f64)
        * 1e-9;
    // Lognormal with the given mean and coefficient of variation.
    let sigma2 = (1.0 + cfg.compute_cv * cfg.compute_cv).ln();
    let mu = cfg.compute_s.max(1e-12).ln() - sigma2 / 2.0;
    let mut rng = TestRng::new(cfg.seed);
    let mut pool = cfg.cores.map(|c| Pool {
        free: vec![0.0; c as usize],
    });

    let mut workers: Vec<Worker> = (0..nw)
        .map(|_| Worker {
            clock: 0,
            waiting: 0,
            pull_started: 0.0,
            stalled: 0.0,
            computing: 0.0,
            finished: None,
            cpu: Fifo::default(),
            io: Fifo::default(),
            nic_out: Fifo::default(),
            nic_in: Fifo::default(),
        })
        .collect();
    let mut shards: Vec<Shard> = (0..ns)
        .map(|_| Shard {
            cpu: Fifo::default(),
            io: Fifo::default(),
            nic_out: Fifo::default(),
            nic_in: Fifo::default(),
            clocks: vec![0; nw],
            parked: Vec::new(),
        })
        .collect();
    let mut lead_histogram = vec![0u64; LEAD_BUCKETS];
    let mut heap = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<Timed>, t: f64, ev: Ev| {
        seq += 1;
        heap.push(Timed { t, seq, ev });
    };
    let start_pull = |heap: &mut BinaryHeap<Timed>,
                      push: &mut dyn FnMut(&mut BinaryHeap<Timed>, f64, Ev),
                      w: &mut Worker,
                      wi: u32,
                      t: f64| {
        w.waiting = ns as u32;
        w.pull_started = t;
        for k in 0..ns as u32 {
            push(
                heap,
                t + cfg.latency_s,
                Ev::PullArrive {
                    w: wi,
                    k,
                    c: w.clock,
                },
            );
        }
    };
    for (wi, w) in workers.iter_mut().enumerate() {
        start_pull(&mut heap, &mut push, w, wi as u32, 0.0);
    }
    // Serves one pull at shard `k` (gate open): CPU, then the reply's transfer.
    let serve = |heap: &mut BinaryHeap<Timed>,
                 push: &mut dyn FnMut(&mut BinaryHeap<Timed>, f64, Ev),
                 pool: &mut Option<Pool>,
                 s: &mut Shard,
                 w: &mut Worker,
                 wi: u32,
                 t: f64| {
        let ready = cpu(pool, &mut s.cpu, t, serve_cost);
        let done = transfer(&mut s.nic_out, &mut w.nic_in, ready, secs(pull_bytes));
        push(
            heap,
            done + cfg.latency_s + cfg.pull_overhead_s,
            Ev::ReplyArrive { w: wi },
        );
    };
    let gate = |s: &Shard, c: u64| -> bool {
        match cfg.staleness {
            None => true,
            Some(b) => s.clocks.iter().copied().min().unwrap_or(0) >= c.saturating_sub(b),
        }
    };
    let mut now = 0.0;
    while let Some(Timed { t, ev, .. }) = heap.pop() {
        now = t;
        match ev {
            Ev::PullArrive { w, k, c } => {
                let s = &mut shards[k as usize];
                if gate(s, c) {
                    let m = s.clocks.iter().copied().min().unwrap_or(0);
                    lead_histogram[(c.saturating_sub(m) as usize).min(LEAD_BUCKETS - 1)] += 1;
                    serve(
                        &mut heap,
                        &mut push,
                        &mut pool,
                        s,
                        &mut workers[w as usize],
                        w,
                        t,
                    );
                } else {
                    s.parked.push((w, c));
                }
            }
            Ev::ReplyArrive { w } => {
                let wk = &mut workers[w as usize];
                wk.waiting -= 1;
                if wk.waiting == 0 {
                    wk.stalled += t - wk.pull_started;
                    let mut compute = (mu + sigma2.sqrt() * rng.normal()).exp();
                    if let Some((p, f)) = cfg.straggle {
                        if rng.next_f64() < p {
                            compute *= f;
                        }
                    }
                    if w == 0 {
                        compute *= cfg.slow_worker.unwrap_or(1.0);
                    }
                    let d = compute + worker_cpu;
                    wk.computing += d;
                    let end = cpu(&mut pool, &mut wk.cpu, t, d);
                    push(&mut heap, end, Ev::ComputeDone { w });
                }
            }
            Ev::ComputeDone { w } => {
                let wk = &mut workers[w as usize];
                if cfg.worker_io_s > 0.0 {
                    if let Some(p) = &mut pool {
                        p.run(t, cfg.worker_io_s, &mut wk.io);
                    }
                }
                for (k, s) in shards.iter_mut().enumerate() {
                    let done = transfer(&mut wk.nic_out, &mut s.nic_in, t, secs(push_bytes));
                    push(
                        &mut heap,
                        done + cfg.latency_s,
                        Ev::PushArrive { w, k: k as u32 },
                    );
                }
                wk.clock += 1;
                if wk.clock < cfg.rounds {
                    start_pull(&mut heap, &mut push, wk, w, t);
                } else {
                    wk.finished = Some(t);
                }
            }
            Ev::PushArrive { w, k } => {
                let s = &mut shards[k as usize];
                if shard_io > 0.0 {
                    if let Some(p) = &mut pool {
                        p.run(t, shard_io, &mut s.io);
                    }
                }
                let done = cpu(&mut pool, &mut s.cpu, t, apply_cost);
                push(&mut heap, done, Ev::Applied { w, k });
            }
            Ev::Applied { w, k } => {
                let s = &mut shards[k as usize];
                s.clocks[w as usize] += 1;
                if s.clocks[w as usize] >= cfg.rounds {
                    // A finished worker leaves the clock table (its goodbye); nobody waits on it.
                    s.clocks[w as usize] = u64::MAX;
                }
                let parked = std::mem::take(&mut s.parked);
                for (pw, pc) in parked {
                    if gate(s, pc) {
                        let m = s.clocks.iter().copied().min().unwrap_or(0);
                        lead_histogram
                            [(pc.saturating_sub(m.min(pc)) as usize).min(LEAD_BUCKETS - 1)] += 1;
                        serve(
                            &mut heap,
                            &mut push,
                            &mut pool,
                            s,
                            &mut workers[pw as usize],
                            pw,
                            t,
                        );
                    } else {
                        s.parked.push((pw, pc));
                    }
                }
            }
        }
    }
    // Until the last worker's last round is computed (as `wall_seconds` of a worker's report); events after it are
    // its last pushes being applied.
    let wall = workers
        .iter()
        .map(|w| w.finished.unwrap_or(now))
        .fold(0.0, f64::max)
        .max(1e-12);
    let stall_fraction = workers
        .iter()
        .map(|w| w.stalled / w.finished.unwrap_or(wall).max(1e-12))
        .sum::<f64>()
        / nw as f64;
    // Utilizations over the whole span, the tail of last pushes included.
    let span = now.max(wall);
    let compute_util = workers.iter().map(|w| w.computing).sum::<f64>() / nw as f64 / span;
    let shard_cpu_util = shards.iter().map(|s| s.cpu.busy).fold(0.0, f64::max) / span;
    let shard_link_util = shards
        .iter()
        .map(|s| s.nic_in.busy.max(s.nic_out.busy))
        .fold(0.0, f64::max)
        / span;
    let worker_link_util = workers
        .iter()
        .map(|w| w.nic_in.busy.max(w.nic_out.busy))
        .fold(0.0, f64::max)
        / span;
    let limit = [
        ("shard cpu", shard_cpu_util),
        ("shard link", shard_link_util),
        ("worker link", worker_link_util),
    ]
    .into_iter()
    .filter(|&(_, u)| u >= 0.7)
    .max_by(|a, b| a.1.total_cmp(&b.1))
    .map(|(n, _)| n.to_string())
    .unwrap_or_else(|| {
        if stall_fraction > 0.3 {
            "staleness gate".to_string()
        } else {
            "compute".to_string()
        }
    });
    let last = lead_histogram
        .iter()
        .rposition(|&c| c > 0)
        .map_or(1, |i| i + 1);
    lead_histogram.truncate(last);
    Ok(SimReport {
        wall_s: wall,
        rounds_per_s: (cfg.rounds * u64::from(cfg.workers)) as f64 / wall,
        stall_fraction,
        shard_cpu_util,
        shard_link_util,
        worker_link_util,
        compute_util,
        limit,
        lead_histogram,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> SimConfig {
        SimConfig {
            workers: 4,
            shards: 2,
            params: 1_000_000,
            rounds: 50,
            compute_s: 0.01,
            compute_cv: 0.0,
            worker_ns_per_param: 0.0,
            apply_ns_per_param: 0.0,
            serve_ns_per_param: 0.0,
            cpu_ns_per_byte: 0.0,
            link_bps: f64::INFINITY,
            latency_s: 0.0,
            ..SimConfig::default()
        }
    }

    #[test]
    fn compute_bound_run_takes_rounds_times_compute() {
        let r = simulate(&base()).unwrap();
        assert!((r.wall_s - 0.5).abs() < 1e-9, "{r:?}");
        assert!(r.stall_fraction < 1e-9);
        assert_eq!(r.limit, "compute");
    }

    #[test]
    fn link_bound_run_takes_the_bytes_over_the_rate() {
        // One worker, one shard: a pull and a push each carry 1e6 × 0.5 bytes = 4 Mbit, 4 ms at 1 Gbit/s.
        let cfg = |s| SimConfig {
            workers: 1,
            shards: 1,
            link_bps: 1e9,
            staleness: Some(s),
            ..base()
        };
        // BSP: pull (4 ms) → compute (10 ms) → push (4 ms) applied before the next pull is answered; the run ends
        // when the last round's compute does.
        let bsp = simulate(&cfg(0)).unwrap();
        assert!(
            (bsp.wall_s - (50.0 * 0.018 - 0.004)).abs() < 1e-6,
            "{bsp:?}"
        );
        // With slack the next pull overlaps the push (opposite directions of each NIC): 14 ms a round.
        let ssp = simulate(&cfg(3)).unwrap();
        assert!((ssp.wall_s - 50.0 * 0.014).abs() < 0.005, "{ssp:?}");
    }

    #[test]
    fn a_shared_shard_link_queues_the_workers() {
        // Eight workers push 4 MB each per round into one shard NIC at 1 Gbit/s: 256 Mbit per round ⇒ 0.256 s.
        let cfg = SimConfig {
            workers: 8,
            shards: 1,
            link_bps: 1e9,
            pull_bytes_per_param: 0.0,
            push_bytes_per_param: 4.0,
            rounds: 20,
            staleness: Some(0),
            ..base()
        };
        let r = simulate(&cfg).unwrap();
        assert!(
            r.rounds_per_s < 8.0 / 0.256 * 1.05 && r.rounds_per_s > 8.0 / 0.256 * 0.9,
            "{r:?}"
        );
        assert_eq!(r.limit, "shard link");
    }

    #[test]
    fn the_gate_holds_fast_workers_to_the_bound_behind_a_persistent_straggler() {
        for s in [0u64, 1, 3] {
            let cfg = SimConfig {
                staleness: Some(s),
                slow_worker: Some(2.0),
                rounds: 40,
                ..base()
            };
            let r = simulate(&cfg).unwrap();
            assert!(r.lead_histogram.len() as u64 <= s + 1, "s={s}: {r:?}");
            // Everyone is held to the slow worker: about 40 × 20 ms, give or take the s rounds of slack.
            assert!(
                r.wall_s >= 0.8 - 1e-9 && r.wall_s < 0.8 + 0.02 * (s as f64 + 1.0),
                "s={s}: {r:?}"
            );
        }
        let r = simulate(&SimConfig {
            staleness: None,
            slow_worker: Some(2.0),
            ..base()
        })
        .unwrap();
        assert!(r.stall_fraction < 1e-9, "{r:?}");
    }

    #[test]
    fn staleness_absorbs_transient_stragglers() {
        let run = |s| {
            simulate(&SimConfig {
                staleness: Some(s),
                straggle: Some((0.1, 3.0)),
                rounds: 200,
                workers: 8,
                ..base()
            })
            .unwrap()
            .wall_s
        };
        let (bsp, ssp) = (run(0), run(3));
        assert!(bsp > ssp * 1.1, "BSP {bsp} vs SSP {ssp}");
    }

    #[test]
    fn shared_cores_slow_oversubscribed_workers() {
        // Eight workers of 10 ms compute on 2 cores: each round of all eight takes 40 ms instead of 10.
        let own = simulate(&SimConfig {
            workers: 8,
            ..base()
        })
        .unwrap();
        let shared = simulate(&SimConfig {
            workers: 8,
            cores: Some(2),
            ..base()
        })
        .unwrap();
        assert!((own.wall_s - 0.5).abs() < 1e-9, "{own:?}");
        assert!((shared.wall_s - 2.0).abs() < 0.02, "{shared:?}");
    }

    #[test]
    fn nonsense_is_refused() {
        for cfg in [
            SimConfig {
                workers: 0,
                ..base()
            },
            SimConfig {
                link_bps: 0.0,
                ..base()
            },
            SimConfig {
                compute_s: f64::NAN,
                ..base()
            },
            SimConfig {
                straggle: Some((2.0, 3.0)),
                ..base()
            },
            SimConfig {
                rounds: u64::MAX,
                ..base()
            },
        ] {
            assert!(simulate(&cfg).is_err(), "{cfg:?}");
        }
    }
}
