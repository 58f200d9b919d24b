//! The event loop: one [`Engine`] owns every worker, shard, standby and host NIC of a run and steps through a
//! time-ordered heap of events until every worker finished its rounds. Deterministic: the only randomness is the
//! seeded compute-time draws, taken in event order. Ties in time run in the order the events were scheduled.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use tether_common::testing::TestRng;
use tether_server::quorum::{QuorumSettings, RoundCloser};

use super::resources::{cpu, send, Fifo, Nic, Pool};
use super::sync::{Free, OuterStep, SyncModel};
use super::{SimConfig, SimReport};
use crate::stats::quantile;

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
    /// Shard `k`'s open round may close now (its grace window, in ms, ended).
    Deadline { k: u32, ms: u64 },
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

/// What each message costs, in seconds, fixed for a run.
struct Costs {
    push_xfer: f64,
    pull_xfer: f64,
    /// Shard CPU per push (decode and outer step, or accumulate with [`OuterStep::AtClose`]).
    apply: f64,
    /// Shard CPU per pull reply (per step: a cut each; in rounds: the message and its bytes only).
    serve: f64,
    /// In rounds: one cut of the public copy when the gate moved since the last one.
    cut: f64,
    /// With [`OuterStep::AtClose`]: the dense outer step when the gate moves.
    outer: f64,
    /// A standby's handling of a logged pull.
    pull_entry: f64,
    shard_io: f64,
    worker_cpu: f64,
}

impl Costs {
    fn new(cfg: &SimConfig, sync: &SyncModel, free: Free) -> Costs {
        let range = cfg.params as f64 / f64::from(cfg.shards);
        let secs = |bytes: f64| bytes * 8.0 / cfg.link_bps;
        let push_bytes = cfg.push_bytes_per_param * range;
        let pull_bytes = cfg.pull_bytes_per_param * range;
        let speedup = sync.speedup(range);
        let shard = if free.shard_cpu { 0.0 } else { 1.0 };
        // Serial per message; bytes (transport) and parameters (kernels) over the threads.
        let msg = |bytes: f64, ns_per_param: f64| {
            shard
                * (sync.shard_msg_s
                    + (cfg.cpu_ns_per_byte * bytes + ns_per_param * range) * 1e-9 / speedup)
        };
        let kernel = |ns_per_param: f64| shard * ns_per_param * range * 1e-9 / speedup;
        let rounds = sync.rounds();
        let (apply, outer) = match sync.outer_step {
            OuterStep::AtClose {
                push_ns_per_param,
                step_ns_per_param,
            } if rounds => (
                msg(push_bytes, push_ns_per_param),
                kernel(step_ns_per_param),
            ),
            _ => (msg(push_bytes, cfg.apply_ns_per_param), 0.0),
        };
        Costs {
            push_xfer: secs(push_bytes),
            pull_xfer: secs(pull_bytes),
            apply,
            serve: if rounds {
                msg(pull_bytes, 0.0)
            } else {
                msg(pull_bytes, cfg.serve_ns_per_param)
            },
            cut: if rounds {
                kernel(cfg.serve_ns_per_param)
            } else {
                0.0
            },
            outer,
            pull_entry: shard * sync.shard_msg_s,
            shard_io: shard * cfg.shard_io_ns_per_param * range * 1e-9,
            worker_cpu: (cfg.worker_ns_per_param * cfg.params as f64
                + cfg.cpu_ns_per_byte * (push_bytes + pull_bytes) * f64::from(cfg.shards))
                * 1e-9,
        }
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
    host: usize,
    /// When each of its pushes was applied on shard 0 (the round times `tether-bench scale` reports).
    applied0: Vec<f64>,
}

/// One shard's clock table: each worker's applied rounds, and how many live workers stand at each clock.
struct Table {
    clocks: Vec<u64>,
    counts: BTreeMap<u64, u32>,
    live: u32,
    rounds: u64,
}

impl Table {
    fn new(workers: usize, rounds: u64) -> Table {
        Table {
            clocks: vec![0; workers],
            counts: BTreeMap::from([(0, workers as u32)]),
            live: workers as u32,
            rounds,
        }
    }

    /// The minimum live clock (`u64::MAX` when nobody is live).
    fn min(&self) -> u64 {
        self.counts.keys().next().copied().unwrap_or(u64::MAX)
    }

    /// Worker `w`'s push was applied; a worker past its last round leaves the table (its goodbye).
    fn advance(&mut self, w: usize) {
        let c = self.clocks[w];
        if let Some(n) = self.counts.get_mut(&c) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&c);
            }
        }
        if c + 1 >= self.rounds {
            self.clocks[w] = u64::MAX;
            self.live -= 1;
        } else {
            self.clocks[w] = c + 1;
            *self.counts.entry(c + 1).or_insert(0) += 1;
        }
    }

    /// Live workers that pushed round `open` (clock above it), and those that owe it (clock at it).
    fn pushed_owing(&self, open: u64) -> (u32, u32) {
        let at_or_below: u32 = self.counts.range(..=open).map(|(_, n)| n).sum();
        let owing = self.counts.get(&open).copied().unwrap_or(0);
        (self.live - at_or_below, owing)
    }

    fn live_clocks(&self) -> impl Iterator<Item = u64> + Clone + '_ {
        self.clocks.iter().copied().filter(|&c| c != u64::MAX)
    }
}

struct Standby {
    cpu: Fifo,
    host: usize,
}

struct Shard {
    cpu: Fifo,
    io: Fifo,
    host: usize,
    standby: Option<Standby>,
    table: Table,
    /// The quorum rule of `server/src/quorum.rs`, when rounds may close without every live worker.
    closer: Option<RoundCloser>,
    /// The grace deadline (ms) an event is scheduled for.
    scheduled: Option<u64>,
    /// Pulls waiting for the gate, by clock: (arrival order, worker).
    parked: BTreeMap<u64, Vec<(u64, u32)>>,
    /// The gate when the public copy was last cut (0: the initial cut every worker holds).
    cut_gate: u64,
    /// When the standby acknowledges the newest entry logged so far.
    acked_at: f64,
}

impl Shard {
    /// Where the gate stands: the minimum live clock, or with quorum rounds the first round not closed.
    fn gate(&self) -> u64 {
        let m = self.table.min();
        match &self.closer {
            Some(c) if self.table.live > 0 => c.gate(m),
            _ => m,
        }
    }
}

const LEAD_BUCKETS: usize = 64;

/// One run: every node, the event heap and what is measured on the way.
pub(super) struct Engine<'a> {
    cfg: &'a SimConfig,
    sync: &'a SyncModel,
    free: Free,
    costs: Costs,
    mu: f64,
    sigma: f64,
    rng: TestRng,
    pool: Option<Pool>,
    nics: Vec<Nic>,
    workers: Vec<Worker>,
    shards: Vec<Shard>,
    heap: BinaryHeap<Timed>,
    seq: u64,
    parks: u64,
    lead_histogram: Vec<u64>,
}

impl<'a> Engine<'a> {
    /// Places the nodes on hosts and sets every worker's first pull at time 0.
    pub(super) fn new(cfg: &'a SimConfig, sync: &'a SyncModel, free: Free) -> Engine<'a> {
        let (nw, ns) = (cfg.workers as usize, cfg.shards as usize);
        // Lognormal with the given mean and coefficient of variation.
        let sigma2 = (1.0 + cfg.compute_cv * cfg.compute_cv).ln();
        let map = HostMap::new(nw, ns, sync.hosts);
        let settings = QuorumSettings {
            quorum: sync.quorum,
            grace_factor: sync.grace_factor as f32,
            grace_max_ms: (sync.grace_max_s * 1e3).round() as u64,
        };
        let mut e = Engine {
            cfg,
            sync,
            free,
            costs: Costs::new(cfg, sync, free),
            mu: cfg.compute_s.max(1e-12).ln() - sigma2 / 2.0,
            sigma: sigma2.sqrt(),
            rng: TestRng::new(cfg.seed),
            pool: cfg.cores.map(|c| Pool {
                free: vec![0.0; c as usize],
            }),
            nics: vec![Nic::default(); map.hosts],
            workers: (0..nw)
                .map(|w| Worker {
                    clock: 0,
                    waiting: 0,
                    pull_started: 0.0,
                    stalled: 0.0,
                    computing: 0.0,
                    finished: None,
                    cpu: Fifo::default(),
                    io: Fifo::default(),
                    host: map.worker[w],
                    applied0: Vec::new(),
                })
                .collect(),
            shards: (0..ns)
                .map(|k| Shard {
                    cpu: Fifo::default(),
                    io: Fifo::default(),
                    host: map.primary[k],
                    standby: sync.standbys.then(|| Standby {
                        cpu: Fifo::default(),
                        host: map.standby[k],
                    }),
                    table: Table::new(nw, cfg.rounds),
                    closer: (sync.quorum > 0).then(|| RoundCloser::new(settings)),
                    scheduled: None,
                    parked: BTreeMap::new(),
                    cut_gate: 0,
                    acked_at: 0.0,
                })
                .collect(),
            heap: BinaryHeap::new(),
            seq: 0,
            parks: 0,
            lead_histogram: vec![0; LEAD_BUCKETS],
        };
        for w in 0..nw as u32 {
            e.start_pull(w, 0.0);
        }
        e
    }

    fn at(&mut self, t: f64, ev: Ev) {
        self.seq += 1;
        self.heap.push(Timed {
            t,
            seq: self.seq,
            ev,
        });
    }

    /// Moves `d` seconds of bytes between two hosts; `free_*` sides take no time (counterfactuals).
    fn hop(
        &mut self,
        from: usize,
        to: usize,
        free_from: bool,
        free_to: bool,
        t: f64,
        d: f64,
    ) -> f64 {
        if from == to {
            return t;
        }
        send(
            &mut self.nics,
            (!free_from).then_some(from),
            (!free_to).then_some(to),
            t,
            d,
        )
    }

    fn start_pull(&mut self, w: u32, t: f64) {
        let ns = self.shards.len() as u32;
        let wk = &mut self.workers[w as usize];
        wk.waiting = ns;
        wk.pull_started = t;
        let c = wk.clock;
        for k in 0..ns {
            self.at(t + self.cfg.latency_s, Ev::PullArrive { w, k, c });
        }
    }

    /// Logs an entry of `xfer` seconds of bytes to shard `k`'s standby at `t`, which spends `cost` on it; moves when
    /// the standby acknowledges the newest entry.
    fn replicate(&mut self, k: usize, t: f64, xfer: f64, cost: f64) {
        let Some(b_host) = self.shards[k].standby.as_ref().map(|b| b.host) else {
            return;
        };
        let p_host = self.shards[k].host;
        let free = self.free.shard_link;
        let arrive = self.hop(p_host, b_host, free, free, t, xfer) + self.cfg.latency_s;
        let s = &mut self.shards[k];
        if let Some(b) = s.standby.as_mut() {
            let done = cpu(&mut self.pool, &mut b.cpu, arrive, cost);
            s.acked_at = s.acked_at.max(done + self.cfg.latency_s);
        }
    }

    fn can_answer(&self, gate: u64, c: u64) -> bool {
        match self.cfg.staleness {
            None => true,
            Some(b) => gate >= c.saturating_sub(b),
        }
    }

    /// Serves one pull at shard `k` (gate open) at `t`: CPU (and a cut when the gate moved since the last), the
    /// standby's acknowledgement, then the reply's transfer.
    fn serve(&mut self, k: usize, w: u32, t: f64) {
        let rounds = self.sync.rounds();
        let s = &mut self.shards[k];
        let gate = s.gate();
        let cut = rounds && gate > s.cut_gate;
        let mut d = self.costs.serve;
        if cut {
            d += self.costs.cut;
            s.cut_gate = gate;
        }
        let ready = cpu(&mut self.pool, &mut s.cpu, t, d);
        if cut {
            // The standby cuts at the same point of the log (it drains the same replies).
            self.replicate(k, t, 0.0, self.costs.cut);
        }
        let s = &self.shards[k];
        let release = if s.standby.is_some() {
            ready.max(s.acked_at)
        } else {
            ready
        };
        let (from, to) = (s.host, self.workers[w as usize].host);
        let (fs, fw) = (self.free.shard_link, self.free.worker_link);
        let done = self.hop(from, to, fs, fw, release, self.costs.pull_xfer);
        self.at(
            done + self.cfg.latency_s + self.cfg.pull_overhead_s,
            Ev::ReplyArrive { w },
        );
    }

    fn lead(&mut self, c: u64, gate: u64) {
        self.lead_histogram[(c.saturating_sub(gate.min(c)) as usize).min(LEAD_BUCKETS - 1)] += 1;
    }

    fn on_pull(&mut self, w: u32, k: u32, c: u64, t: f64) {
        let k = k as usize;
        // Every input is logged before the protocol takes it; the reply waits for the newest entry.
        self.replicate(k, t, 0.0, self.costs.pull_entry);
        let gate = self.shards[k].gate();
        if self.can_answer(gate, c) {
            self.lead(c, gate);
            self.serve(k, w, t);
        } else {
            self.parks += 1;
            let seq = self.parks;
            self.shards[k].parked.entry(c).or_default().push((seq, w));
        }
    }

    fn on_reply(&mut self, w: u32, t: f64) {
        let wk = &mut self.workers[w as usize];
        wk.waiting -= 1;
        if wk.waiting > 0 {
            return;
        }
        wk.stalled += t - wk.pull_started;
        let mut compute = if self.cfg.compute_quantiles_s.is_empty() {
            (self.mu + self.sigma * self.rng.normal()).exp()
        } else {
            inverse_cdf(&self.cfg.compute_quantiles_s, self.rng.next_f64())
        };
        if let Some((p, f)) = self.cfg.straggle {
            if self.rng.next_f64() < p {
                compute *= f;
            }
        }
        if w == 0 {
            compute *= self.cfg.slow_worker.unwrap_or(1.0);
        }
        let d = compute + self.costs.worker_cpu;
        wk.computing += d;
        let end = cpu(&mut self.pool, &mut wk.cpu, t, d);
        self.at(end, Ev::ComputeDone { w });
    }

    fn on_compute_done(&mut self, w: u32, t: f64) {
        let wi = w as usize;
        if self.cfg.worker_io_s > 0.0 {
            if let Some(p) = &mut self.pool {
                p.run(t, self.cfg.worker_io_s, &mut self.workers[wi].io);
            }
        }
        let (fw, fs) = (self.free.worker_link, self.free.shard_link);
        for k in 0..self.shards.len() {
            let (from, to) = (self.workers[wi].host, self.shards[k].host);
            let done = self.hop(from, to, fw, fs, t, self.costs.push_xfer);
            self.at(done + self.cfg.latency_s, Ev::PushArrive { w, k: k as u32 });
        }
        let wk = &mut self.workers[wi];
        wk.clock += 1;
        if wk.clock < self.cfg.rounds {
            self.start_pull(w, t);
        } else {
            wk.finished = Some(t);
        }
    }

    fn on_push(&mut self, w: u32, k: u32, t: f64) {
        let ki = k as usize;
        let s = &mut self.shards[ki];
        if self.costs.shard_io > 0.0 {
            if let Some(p) = &mut self.pool {
                p.run(t, self.costs.shard_io, &mut s.io);
            }
        }
        let done = cpu(&mut self.pool, &mut s.cpu, t, self.costs.apply);
        // Logged when the actor takes it (when its apply starts); the standby applies it too.
        self.replicate(
            ki,
            done - self.costs.apply,
            self.costs.push_xfer,
            self.costs.apply,
        );
        self.at(done, Ev::Applied { w, k });
    }

    fn on_applied(&mut self, w: u32, k: u32, t: f64) {
        let ki = k as usize;
        if ki == 0 {
            self.workers[w as usize].applied0.push(t);
        }
        let before = self.shards[ki].gate();
        self.shards[ki].table.advance(w as usize);
        self.settle(ki, t, (t * 1e3) as u64);
        let after = self.shards[ki].gate();
        if after > before {
            self.gate_moved(ki, t, after);
        }
    }

    /// Whether the deadline event is still the open round's; if so, settles at it.
    fn on_deadline(&mut self, k: u32, ms: u64, t: f64) -> bool {
        let ki = k as usize;
        let s = &mut self.shards[ki];
        if s.scheduled != Some(ms) || s.closer.as_ref().and_then(RoundCloser::deadline) != Some(ms)
        {
            return false;
        }
        s.scheduled = None;
        let before = s.gate();
        self.settle(ki, t, ms);
        let after = self.shards[ki].gate();
        if after > before {
            self.gate_moved(ki, t, after);
        }
        true
    }

    /// Lets shard `k`'s quorum rule close what it may at `now_ms` (called only where it could change something: a
    /// quorum pushed the open round, or a grace window is pending) and schedules the next grace deadline.
    fn settle(&mut self, k: usize, t: f64, now_ms: u64) {
        let s = &mut self.shards[k];
        let Some(closer) = s.closer.as_mut() else {
            return;
        };
        if s.table.live == 0 {
            return;
        }
        let min = s.table.min();
        let open = closer.gate(min);
        let quorum = closer.settings().quorum.min(s.table.live);
        let (pushed, owing) = s.table.pushed_owing(open);
        let pending = closer.deadline();
        let due = pushed >= quorum && (owing == 0 || pending.is_none_or(|d| now_ms >= d));
        if !(due || (pushed < quorum && pending.is_some())) {
            return;
        }
        closer.settle(s.table.live_clocks(), min, now_ms);
        if let Some(d) = closer.deadline() {
            if s.scheduled != Some(d) {
                s.scheduled = Some(d);
                self.at((d as f64 / 1e3).max(t), Ev::Deadline { k: k as u32, ms: d });
            }
        }
    }

    /// Shard `k`'s gate moved to `gate` at `t`: the outer step (with [`OuterStep::AtClose`]), then the parked pulls
    /// it lets through, in arrival order.
    fn gate_moved(&mut self, k: usize, t: f64, gate: u64) {
        if self.costs.outer > 0.0 {
            cpu(&mut self.pool, &mut self.shards[k].cpu, t, self.costs.outer);
            self.replicate(k, t, 0.0, self.costs.outer);
        }
        let Some(b) = self.cfg.staleness else {
            return;
        };
        let limit = gate.saturating_add(b);
        let s = &mut self.shards[k];
        let released = match limit.checked_add(1) {
            Some(above) => {
                let rest = s.parked.split_off(&above);
                std::mem::replace(&mut s.parked, rest)
            }
            None => std::mem::take(&mut s.parked),
        };
        let mut pulls: Vec<(u64, u32, u64)> = released
            .into_iter()
            .flat_map(|(c, v)| v.into_iter().map(move |(seq, w)| (seq, w, c)))
            .collect();
        pulls.sort_unstable_by_key(|p| p.0);
        for (_, w, c) in pulls {
            self.lead(c, gate);
            self.serve(k, w, t);
        }
    }

    /// Runs every event and reports.
    pub(super) fn run(mut self) -> SimReport {
        let mut now = 0.0;
        while let Some(Timed { t, ev, .. }) = self.heap.pop() {
            match ev {
                Ev::PullArrive { w, k, c } => self.on_pull(w, k, c, t),
                Ev::ReplyArrive { w } => self.on_reply(w, t),
                Ev::ComputeDone { w } => self.on_compute_done(w, t),
                Ev::PushArrive { w, k } => self.on_push(w, k, t),
                Ev::Applied { w, k } => self.on_applied(w, k, t),
                Ev::Deadline { k, ms } => {
                    if !self.on_deadline(k, ms, t) {
                        // A stale deadline is no event of the run: it must not stretch the span.
                        continue;
                    }
                }
            }
            now = t;
        }
        self.report(now)
    }

    fn report(mut self, now: f64) -> SimReport {
        let cfg = self.cfg;
        let nw = self.workers.len();
        // Until the last worker's last round is computed (as `wall_seconds` of a worker's report); events after it
        // are its last pushes being applied.
        let wall = self
            .workers
            .iter()
            .map(|w| w.finished.unwrap_or(now))
            .fold(0.0, f64::max)
            .max(1e-12);
        let stall_fraction = self
            .workers
            .iter()
            .map(|w| w.stalled / w.finished.unwrap_or(wall).max(1e-12))
            .sum::<f64>()
            / nw as f64;
        // Utilizations over the whole span, the tail of last pushes included.
        let span = now.max(wall);
        let compute_util = self.workers.iter().map(|w| w.computing).sum::<f64>() / nw as f64 / span;
        let shard_cpu_util = self
            .shards
            .iter()
            .flat_map(|s| std::iter::once(s.cpu.busy).chain(s.standby.as_ref().map(|b| b.cpu.busy)))
            .fold(0.0, f64::max)
            / span;
        let nic_util = |h: usize| {
            let n = &self.nics[h];
            n.inn.busy.max(n.out.busy) / span
        };
        let shard_link_util = self
            .shards
            .iter()
            .flat_map(|s| std::iter::once(s.host).chain(s.standby.as_ref().map(|b| b.host)))
            .map(nic_util)
            .fold(0.0, f64::max);
        let worker_link_util = self
            .workers
            .iter()
            .map(|w| nic_util(w.host))
            .fold(0.0, f64::max);
        let waiting = if self.sync.rounds() {
            "quorum wait"
        } else {
            "staleness gate"
        };
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
                waiting.to_string()
            } else {
                "compute".to_string()
            }
        });
        let gaps: Vec<f64> = self
            .workers
            .iter()
            .flat_map(|w| w.applied0.windows(2).map(|p| p[1] - p[0]))
            .collect();
        let stalls: Vec<f64> = self
            .workers
            .iter()
            .map(|w| w.stalled / cfg.rounds as f64)
            .collect();
        let (quorum_closes, left_behind) = self
            .shards
            .first()
            .and_then(|s| s.closer.as_ref())
            .map_or((0, 0), |c| (c.quorum_closes(), c.left_behind_total()));
        let last = self
            .lead_histogram
            .iter()
            .rposition(|&c| c > 0)
            .map_or(1, |i| i + 1);
        self.lead_histogram.truncate(last);
        SimReport {
            wall_s: wall,
            rounds_per_s: (cfg.rounds * u64::from(cfg.workers)) as f64 / wall,
            stall_fraction,
            shard_cpu_util,
            shard_link_util,
            worker_link_util,
            compute_util,
            limit,
            lead_histogram: self.lead_histogram,
            round_p50_s: quantile(&gaps, 0.5),
            stall_per_round_s: quantile(&stalls, 0.5),
            quorum_closes,
            left_behind,
        }
    }
}

/// Which host each node sits on: one per node, or `tether-bench scale`'s round-robin over `hosts` (primaries from
/// host 0, each standby on the next host, workers from host 0).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HostMap {
    pub(super) worker: Vec<usize>,
    pub(super) primary: Vec<usize>,
    pub(super) standby: Vec<usize>,
    pub(super) hosts: usize,
}

impl HostMap {
    pub(super) fn new(workers: usize, shards: usize, hosts: Option<u32>) -> HostMap {
        match hosts {
            None => HostMap {
                worker: (0..workers).collect(),
                primary: (workers..workers + shards).collect(),
                standby: (workers + shards..workers + 2 * shards).collect(),
                hosts: workers + 2 * shards,
            },
            Some(h) => {
                let h = h as usize;
                HostMap {
                    worker: (0..workers).map(|w| w % h).collect(),
                    primary: (0..shards).map(|k| k % h).collect(),
                    standby: (0..shards).map(|k| (k + 1) % h).collect(),
                    hosts: h,
                }
            }
        }
    }
}

/// The value at probability `u` (in 0..1) of the distribution given by equally spaced quantiles `q` (at least 2,
/// ascending), linear between them.
pub(super) fn inverse_cdf(q: &[f64], u: f64) -> f64 {
    let Some(last) = q.len().checked_sub(1) else {
        return 0.0;
    };
    let x = u.clamp(0.0, 1.0) * last as f64;
    let i = (x.floor() as usize).min(last);
    let j = (i + 1).min(last);
    q[i] + (q[j] - q[i]) * (x - i as f64)
}
