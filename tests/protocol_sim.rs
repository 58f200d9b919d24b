//! A deterministic in-memory harness for the protocol cores (quinn-proto's `Pair`, grown to N workers × M shards):
//! the real [`WorkerSession`]s and [`ShardProtocol`]s (over real `ShardCore`s, the real codec and real rkyv/bincode
//! frames) talk through a seeded scheduler that delays and reorders messages across streams (each stream stays FIFO,
//! as QUIC keeps it), duplicates them, breaks connections (in-flight messages are lost, or delivered late from the
//! dead connection), stalls links past the eviction timeout, stretches steps far past it, crashes and restarts shards
//! from their last checkpoint snapshot, and crashes and restarts workers.
//!
//! The weights make the history readable: every `(worker, clock)` round owns one slot per shard, its gradient is −1
//! there and 0 elsewhere, and the shard runs SGD with lr 1, so a slot reads 1 once that round is applied and 2 if it
//! was applied twice. The checker reads the weights themselves, not the shards' counters:
//! - on every pull reply a worker uses: the **read guarantee** — for each live member of the shard, every round from
//!   its (re)join up to `c − s` is in the values (applied, or a skip marker the shard took), so the clock lead is at
//!   most `s`; and no slot is above 1;
//! - evictions only of workers the shard really heard nothing from for the timeout;
//! - at the end: no slot above 1 (nothing applied twice), every round a shard acknowledged is still in its weights
//!   unless a crash rolled it back to the checkpoint, every surviving worker finished with every push settled.
//!
//! Replies travel as the finished frame bodies the shard protocol builds, and the workers read them with the same
//! [`WorkerSession::handle_reply`] the driver calls; settled rounds are read with the same [`Settled::verdict`].
//! Every used reply must give the worker, bit for bit, the values the shard answered with, and the read guarantee is
//! checked on what the worker computes on. Half the schedules pull deltas of the shards' public copies (lossless f32
//! deltas, so the slots stay readable): there the worker's rebuilt copy must equal the shard's public copy.
//!
//! `TETHER_SIM_SCHEDULES` sets how many schedules run (default 10,000, plus the seeds in `ALWAYS_RUN`),
//! `TETHER_SIM_SEED` replays one seed; a failing run prints its seed and the whole failure.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use tether::common::codec::{CodecConfig, Encoder, Scheme};
use tether::common::config::{OptimizerConfig, OptimizerKind, Staleness};
use tether::common::layout::{Init, Layout, TensorSpec};
use tether::common::protocol::{
    access_push, Control, FrameKind, Outcome, Precision, PullMode, Welcome,
};
use tether::common::testing::TestRng;
use tether::server::protocol::{Action, ConnId, Round, ShardProtocol};
use tether::server::shard::{ShardCore, ShardSpec};
use tether::worker::session::{Event, Settled, Transmit, Verdict, WorkerSession};

const WORKERS: usize = 3;
const SHARDS: usize = 2;
/// Rounds each worker runs.
const ROUNDS: u64 = 8;
/// Slots per worker per shard: rounds plus room for clock jumps on rejoin.
const SLOTS: u64 = 16;
const TIMEOUT_MS: u64 = 1_000;
const HEARTBEAT_MS: u64 = 200;
const TICK_MS: u64 = 50;
/// Virtual time after which a schedule that has not finished counts as stuck.
const TIME_LIMIT_MS: u64 = 600_000;
/// Events after which a schedule counts as stuck.
const EVENT_LIMIT: usize = 200_000;

/// Seeds that found real bugs beyond the default schedules; they run on every run besides the drawn ones.
/// - 2122289005: a checkpoint forgot an evicted worker's clock, and its resend after the restart applied twice.
const ALWAYS_RUN: [u64; 1] = [2_122_289_005];

/// How adversarial a schedule is (drawn per seed).
#[derive(Debug, Clone, Copy)]
struct Faults {
    staleness: Staleness,
    max_latency_ms: u64,
    duplicate_per_mille: u64,
    break_per_mille: u64,
    stall_per_mille: u64,
    shard_crash_per_mille: u64,
    worker_crash_per_mille: u64,
    slow_step_per_mille: u64,
    /// A slow step lasts this long plus up to `slow_step_jitter_ms`.
    slow_step_ms: u64,
    slow_step_jitter_ms: u64,
    skip_per_mille: u64,
    /// Workers pull deltas of the public copies (else full f32 values).
    delta: bool,
}

impl Faults {
    fn draw(rng: &mut TestRng) -> Faults {
        let staleness = match rng.below(4) {
            0 => Staleness::Bounded(0),
            1 => Staleness::Bounded(1),
            2 => Staleness::Bounded(3),
            _ => Staleness::Unbounded,
        };
        Faults {
            staleness,
            max_latency_ms: 1 + rng.below(80),
            duplicate_per_mille: rng.below(30),
            break_per_mille: rng.below(8),
            stall_per_mille: rng.below(3),
            shard_crash_per_mille: rng.below(3),
            worker_crash_per_mille: rng.below(2),
            slow_step_per_mille: rng.below(200),
            slow_step_ms: 3 * TIMEOUT_MS,
            slow_step_jitter_ms: 7 * TIMEOUT_MS,
            skip_per_mille: rng.below(100),
            delta: rng.chance(500),
        }
    }
}

/// Which ordered stream a message travels on (QUIC keeps each stream in order, not streams among each other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Lane {
    ControlUp,
    PushUp,
    ControlDown,
    ReplyDown,
}

#[derive(Debug, Clone)]
enum Payload {
    Control(Control),
    Push(bytes::Bytes),
    /// A pull reply as it travels: the frame the shard protocol finished, byte for byte.
    Reply {
        kind: FrameKind,
        body: rkyv::util::AlignedVec,
        /// Harness bookkeeping, not on the wire: the values the worker must end up with (the weights, or the public
        /// copy for a delta reply), and the shard's live members and their join clocks when it answered.
        expect: Vec<f32>,
        live: Vec<(usize, u64)>,
    },
}

#[derive(Debug, Clone)]
struct Msg {
    conn: ConnId,
    worker: usize,
    shard: usize,
    lane: Lane,
    payload: Payload,
}

#[derive(Debug)]
enum Ev {
    Deliver(Msg),
    /// A connect attempt of `worker` to `shard` with this hello clock reaches the shard.
    ConnectArrive {
        worker: usize,
        shard: usize,
        incarnation: u64,
        clock: u64,
    },
    /// The welcome reaches the worker.
    Welcomed {
        worker: usize,
        shard: usize,
        incarnation: u64,
        conn: ConnId,
        welcome: Welcome,
    },
    /// A connect attempt failed (shard down).
    ConnectFailed {
        worker: usize,
        shard: usize,
        incarnation: u64,
    },
    ComputeDone {
        worker: usize,
        incarnation: u64,
    },
    WorkerRestart {
        worker: usize,
    },
    ShardRestart {
        shard: usize,
    },
    Unstall {
        conn: ConnId,
    },
}

struct Conn {
    worker: usize,
    shard: usize,
    alive: bool,
    /// Messages on this connection are held back until this time (a stalled link).
    stalled_until: u64,
    /// Last delivery time per lane, to keep lanes FIFO.
    lane_tail: BTreeMap<Lane, u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Pulling,
    Computing,
    Settling,
    Done,
    Crashed,
}

struct SimWorker {
    session: WorkerSession,
    incarnation: u64,
    phase: Phase,
    /// The live connection per shard.
    conns: Vec<Option<ConnId>>,
    connecting: Vec<bool>,
    params: Vec<f32>,
    rounds: u64,
}

struct SimShard {
    proto: Option<ShardProtocol>,
    snapshot: tether::server::checkpoint::ShardSnapshot,
    snapshot_every: u64,
    /// Per worker: the clock its last welcome named (rounds below it are not required in reads).
    joined_at: BTreeMap<usize, u64>,
    /// Per worker: the rounds whose skip marker this shard took.
    skipped: BTreeMap<usize, BTreeSet<u64>>,
    /// Rounds whose push a worker learned was applied (or applied before).
    acked: BTreeSet<(usize, u64)>,
    /// Rounds a crash rolled back (they were applied after the snapshot).
    rolled_back: BTreeSet<(usize, u64)>,
    /// Per worker: when this shard last received anything from it (any connection).
    last_heard: BTreeMap<usize, u64>,
    /// Per worker: its newest connection to this shard.
    newest_conn: BTreeMap<usize, ConnId>,
    /// Evictions the shard made.
    evictions: u64,
}

struct Sim {
    /// The scheduler's only source of randomness.
    rng: TestRng,
    faults: Faults,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    events: BTreeMap<u64, Ev>,
    conns: BTreeMap<ConnId, Conn>,
    next_conn: ConnId,
    workers: Vec<SimWorker>,
    shards: Vec<SimShard>,
    layout: Layout,
    encoder: Encoder,
    log: Vec<String>,
    used_replies: u64,
    max_lead: u64,
}

fn layout() -> Layout {
    let n = SHARDS * WORKERS * SLOTS as usize;
    Layout::new(vec![TensorSpec::new("slots", &[n], Init::Zeros)])
}

fn spec(shard: usize, staleness: Staleness) -> ShardSpec {
    ShardSpec {
        shard: shard as u32,
        shards: SHARDS as u32,
        seed: 1,
        optimizer: OptimizerConfig {
            kind: OptimizerKind::Sgd,
            lr: 1.0,
            ..OptimizerConfig::default()
        },
        staleness,
        worker_timeout_ms: TIMEOUT_MS,
        spike_factor: 0.0,
    }
}

/// Pull deltas in f32: exact for the 0/1 slots, so the checker can still read the history.
fn lossless() -> CodecConfig {
    CodecConfig {
        scheme: Scheme::None,
        zstd: false,
        ..CodecConfig::default()
    }
}

fn pull_mode(f: &Faults) -> PullMode {
    if f.delta {
        PullMode::Delta { have: None }
    } else {
        PullMode::Full(Precision::F32)
    }
}

fn slot(worker: usize, clock: u64) -> usize {
    worker * SLOTS as usize + clock as usize
}

fn bound(s: Staleness) -> Option<u64> {
    match s {
        Staleness::Bounded(b) => Some(u64::from(b)),
        Staleness::Unbounded => None,
    }
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let mut rng = TestRng::new(seed);
        let faults = Faults::draw(&mut rng);
        Sim::build(rng, faults)
    }

    /// The schedule of `seed` under the given fault mix instead of the drawn one.
    fn with_faults(seed: u64, faults: Faults) -> Sim {
        let mut rng = TestRng::new(seed);
        let _drawn = Faults::draw(&mut rng);
        Sim::build(rng, faults)
    }

    fn build(mut rng: TestRng, faults: Faults) -> Sim {
        let layout = layout();
        let ranges: Vec<(u64, u64)> = (0..SHARDS)
            .map(|k| {
                let r = layout.shard_range(k, SHARDS);
                (r.start as u64, r.end as u64)
            })
            .collect();
        let workers = (0..WORKERS)
            .map(|w| SimWorker {
                session: WorkerSession::new(
                    w as u32,
                    layout.hash(),
                    ranges.clone(),
                    faults.staleness,
                    pull_mode(&faults),
                    HEARTBEAT_MS,
                ),
                incarnation: 0,
                phase: Phase::Pulling,
                conns: vec![None; SHARDS],
                connecting: vec![false; SHARDS],
                params: vec![0.0; layout.len()],
                rounds: 0,
            })
            .collect();
        let shards = (0..SHARDS)
            .map(|k| {
                let mut core = ShardCore::new(&layout, &spec(k, faults.staleness));
                core.set_public(lossless(), rng.next_u64());
                let snapshot = core.snapshot();
                SimShard {
                    proto: Some(ShardProtocol::new(core)),
                    snapshot,
                    snapshot_every: 1 + rng.below(6),
                    joined_at: BTreeMap::new(),
                    skipped: BTreeMap::new(),
                    acked: BTreeSet::new(),
                    rolled_back: BTreeSet::new(),
                    last_heard: BTreeMap::new(),
                    newest_conn: BTreeMap::new(),
                    evictions: 0,
                }
            })
            .collect();
        let encoder = Encoder::new(CodecConfig {
            scheme: Scheme::None,
            zstd: false,
            ..CodecConfig::default()
        })
        .expect("the none scheme is always valid");
        let mut sim = Sim {
            rng,
            faults,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            events: BTreeMap::new(),
            conns: BTreeMap::new(),
            next_conn: 0,
            workers,
            shards,
            layout,
            encoder,
            log: Vec::new(),
            used_replies: 0,
            max_lead: 0,
        };
        for w in 0..WORKERS {
            sim.drain_worker(w);
            sim.workers[w].session.start_pull(0);
            sim.drain_worker(w);
        }
        sim
    }

    fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    fn note(&mut self, s: String) {
        if self.log.len() < 4000 {
            self.log.push(format!("{:>7} {s}", self.now));
        }
    }

    fn send(&mut self, msg: Msg) {
        let Some(c) = self.conns.get_mut(&msg.conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        let latency = 1 + self.rng.below(self.faults.max_latency_ms);
        let tail = c.lane_tail.get(&msg.lane).copied().unwrap_or(0);
        let t = (self.now + latency).max(tail).max(c.stalled_until);
        c.lane_tail.insert(msg.lane, t);
        let dup = self.rng.chance(self.faults.duplicate_per_mille);
        if dup {
            self.at(t, Ev::Deliver(msg.clone()));
        }
        self.at(t, Ev::Deliver(msg));
    }

    fn ranges(&self, shard: usize) -> (usize, usize) {
        let r = self.layout.shard_range(shard, SHARDS);
        (r.start, r.end)
    }

    /// Moves a worker's transmits onto the network and acts on its events.
    fn drain_worker(&mut self, w: usize) {
        loop {
            let mut progressed = false;
            while let Some(t) = self.workers[w].session.poll_transmit() {
                progressed = true;
                let (shard, lane, payload) = match t {
                    Transmit::Control { shard, msg } => {
                        (shard, Lane::ControlUp, Payload::Control(msg))
                    }
                    Transmit::Push { shard, bytes, .. } => {
                        (shard, Lane::PushUp, Payload::Push(bytes))
                    }
                };
                if let Some(conn) = self.workers[w].conns[shard] {
                    self.send(Msg {
                        conn,
                        worker: w,
                        shard,
                        lane,
                        payload,
                    });
                }
            }
            while let Some(e) = self.workers[w].session.poll_event() {
                progressed = true;
                match e {
                    Event::PullDone { clock } => {
                        if self.workers[w].phase == Phase::Pulling {
                            let t = if self.rng.chance(self.faults.slow_step_per_mille) {
                                // A step far longer than the eviction timeout: heartbeats must keep us live.
                                self.now
                                    + self.faults.slow_step_ms
                                    + self.rng.below(self.faults.slow_step_jitter_ms + 1)
                            } else {
                                self.now + 1 + self.rng.below(40)
                            };
                            self.workers[w].phase = Phase::Computing;
                            let inc = self.workers[w].incarnation;
                            self.at(
                                t,
                                Ev::ComputeDone {
                                    worker: w,
                                    incarnation: inc,
                                },
                            );
                            self.note(format!("w{w} pull done at clock {clock}"));
                        }
                    }
                    Event::Settled(settled) => {
                        // An accepted update: the worker learned that its push is in (applied now or before).
                        let Settled {
                            shard,
                            clock,
                            outcome,
                            ..
                        } = settled;
                        if settled.verdict() == Verdict::Taken {
                            self.shards[shard].acked.insert((w, clock));
                        }
                        self.note(format!("w{w} s{shard} round {clock}: {outcome:?}"));
                    }
                    Event::Reconnect { shard } => {
                        if let Some(conn) = self.workers[w].conns[shard].take() {
                            self.break_conn(conn, false);
                        }
                        self.start_connect(w, shard);
                    }
                    // The simulated shards run without loss-spike rollback: their epoch never changes.
                    Event::RolledBack { shard, epoch } => {
                        panic!("w{w}: shard {shard} reported rollback epoch {epoch}")
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn start_connect(&mut self, w: usize, shard: usize) {
        if self.workers[w].connecting[shard] {
            return;
        }
        self.workers[w].connecting[shard] = true;
        let hello = self.workers[w].session.hello(shard);
        let inc = self.workers[w].incarnation;
        let t = self.now + 1 + self.rng.below(50);
        if self.shards[shard].proto.is_some() {
            self.at(
                t,
                Ev::ConnectArrive {
                    worker: w,
                    shard,
                    incarnation: inc,
                    clock: hello.clock,
                },
            );
        } else {
            self.at(
                t + 100,
                Ev::ConnectFailed {
                    worker: w,
                    shard,
                    incarnation: inc,
                },
            );
        }
    }

    /// Breaks a connection. Messages still in flight towards the shard may yet arrive (a dead connection's last
    /// streams), the rest are lost.
    fn break_conn(&mut self, conn: ConnId, notify_worker: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        c.alive = false;
        let (w, k) = (c.worker, c.shard);
        self.note(format!("conn {conn} (w{w} s{k}) broken"));
        if let Some(p) = self.shards[k].proto.as_mut() {
            p.closed(conn);
        }
        if notify_worker
            && self.workers[w].conns[k] == Some(conn)
            && self.workers[w].phase != Phase::Crashed
        {
            self.workers[w].conns[k] = None;
            self.workers[w].session.disconnected(k);
            self.drain_worker(w);
        }
    }

    fn drain_shard(&mut self, k: usize) -> Result<(), String> {
        loop {
            let Some(action) = self.shards[k].proto.as_mut().and_then(|p| p.poll_action()) else {
                return Ok(());
            };
            match action {
                Action::Answer { pull: p, reply } => {
                    let proto = self.shards[k]
                        .proto
                        .as_ref()
                        .expect("shard is up: it produced an action");
                    // What the reply must give the worker: the weights, or the public copy it was cut from.
                    let expect = match p.mode {
                        PullMode::Delta { .. } => {
                            proto.public().map(|(_, v)| v.to_vec()).ok_or_else(|| {
                                format!("shard {k} answered a delta pull without a public copy")
                            })?
                        }
                        PullMode::Full(_) => proto.weights().to_vec(),
                    };
                    let mut body = rkyv::util::AlignedVec::new();
                    for c in &reply.chunks {
                        body.extend_from_slice(c);
                    }
                    let live = self.live_members(k);
                    // The values the worker will compute on must satisfy the guarantee for the pull's clock.
                    self.check_read(k, p.worker as usize, p.clock, &expect, &live)?;
                    self.send(Msg {
                        conn: p.conn,
                        worker: p.worker as usize,
                        shard: k,
                        lane: Lane::ReplyDown,
                        payload: Payload::Reply {
                            kind: reply.kind,
                            body,
                            expect,
                            live,
                        },
                    });
                }
                Action::Refuse {
                    conn,
                    request,
                    error,
                    ..
                } => {
                    let worker = self.conns.get(&conn).map(|c| c.worker);
                    if let Some(worker) = worker {
                        self.send(Msg {
                            conn,
                            worker,
                            shard: k,
                            lane: Lane::ControlDown,
                            payload: Payload::Control(Control::PullRefused {
                                request,
                                code: error.code(),
                            }),
                        });
                    }
                }
                Action::Close { conn, code: None } => {
                    // The orderly end after a goodbye whose rounds were all taken.
                    self.break_conn(conn, false);
                }
                Action::Close {
                    conn,
                    code: Some(_),
                } => {
                    let c = &self.conns[&conn];
                    let (w, now) = (c.worker, self.now);
                    let heard = self.shards[k].last_heard.get(&w).copied().unwrap_or(0);
                    // The liveness rule, checked independently: only a worker silent for the timeout is evicted.
                    if now.saturating_sub(heard) + TICK_MS < TIMEOUT_MS {
                        return Err(format!(
                            "shard {k} evicted worker {w} at {now} ms, last heard at {heard} ms (timeout {TIMEOUT_MS})"
                        ));
                    }
                    self.shards[k].evictions += 1;
                    self.break_conn(conn, true);
                }
            }
        }
    }

    /// The live members of shard `k` now, with the clock each last (re)joined at.
    fn live_members(&self, k: usize) -> Vec<(usize, u64)> {
        let proto = self.shards[k]
            .proto
            .as_ref()
            .expect("shard is up while answering");
        (0..WORKERS)
            .filter(|w| proto.core().clocks().is_live(*w as u32))
            .map(|w| (w, self.shards[k].joined_at.get(&w).copied().unwrap_or(0)))
            .collect()
    }

    /// The read guarantee, from the values themselves: values used for a pull at `clock` hold, for every member that
    /// was live when the shard answered, every round from its (re)join up to `clock − s`.
    fn check_read(
        &mut self,
        k: usize,
        reader: usize,
        clock: u64,
        values: &[f32],
        live: &[(usize, u64)],
    ) -> Result<(), String> {
        for (i, v) in values.iter().enumerate() {
            if *v != 0.0 && *v != 1.0 {
                return Err(format!(
                    "shard {k}: slot {i} reads {v}: an update applied twice or corrupted"
                ));
            }
        }
        let mut min_progress = u64::MAX;
        for &(w, from) in live {
            // Rounds of w present from its join on, reading the weights (and the skip markers the shard took).
            let mut progress = from;
            while progress < SLOTS
                && (values[slot(w, progress)] == 1.0
                    || self.shards[k]
                        .skipped
                        .get(&w)
                        .is_some_and(|s| s.contains(&progress)))
            {
                progress += 1;
            }
            min_progress = min_progress.min(progress);
            if let Some(s) = bound(self.faults.staleness) {
                let need = clock.saturating_sub(s);
                if progress < need {
                    return Err(format!(
                        "read guarantee broken: shard {k} answered worker {reader}'s pull at clock {clock} (s={s}) \
                         but worker {w}'s rounds {progress}..{need} are missing (joined at {from})"
                    ));
                }
            }
        }
        if min_progress != u64::MAX {
            self.max_lead = self.max_lead.max(clock.saturating_sub(min_progress));
        }
        Ok(())
    }

    fn deliver(&mut self, msg: Msg) -> Result<(), String> {
        let Some(c) = self.conns.get(&msg.conn) else {
            return Ok(());
        };
        let upward = matches!(msg.lane, Lane::ControlUp | Lane::PushUp);
        if !c.alive {
            // Towards the shard, a dead connection's last streams may still arrive; towards the worker, nothing does.
            if !upward || !self.rng.chance(500) {
                return Ok(());
            }
        }
        let (w, k, conn) = (msg.worker, msg.shard, msg.conn);
        if upward {
            if self.shards[k].proto.is_none() {
                return Ok(());
            }
            // A sign of life is a message on the worker's newest connection to this shard; a dead connection's
            // late streams are old news.
            // (A push counts from any connection: it is this worker's, bound to its certificate.)
            if self.shards[k].newest_conn.get(&w) == Some(&conn) || msg.lane == Lane::PushUp {
                self.shards[k].last_heard.insert(w, self.now);
            }
            let now = self.now;
            match msg.payload {
                Payload::Control(Control::Heartbeat { .. }) => self.shards[k]
                    .proto
                    .as_mut()
                    .expect("up")
                    .heartbeat(conn, w as u32, now),
                Payload::Control(Control::PullRequest {
                    request,
                    clock,
                    mode,
                }) => {
                    let r = self.shards[k]
                        .proto
                        .as_mut()
                        .expect("up")
                        .pull(conn, w as u32, request, clock, mode, now);
                    if let Err(e) = r {
                        self.send(Msg {
                            conn,
                            worker: w,
                            shard: k,
                            lane: Lane::ControlDown,
                            payload: Payload::Control(Control::PullRefused {
                                request,
                                code: e.code(),
                            }),
                        });
                    }
                }
                Payload::Control(Control::Goodbye { clock }) => self.shards[k]
                    .proto
                    .as_mut()
                    .expect("up")
                    .goodbye(conn, w as u32, clock, now),
                Payload::Control(other) => return Err(format!("worker sent {other:?}")),
                Payload::Push(bytes) => {
                    let frame = access_push(&bytes)
                        .map_err(|e| format!("worker built a bad frame: {e}"))?;
                    let meta = frame.meta();
                    let round = Round::from_frame(frame);
                    let (outcome, _) = self.shards[k].proto.as_mut().expect("up").round(round, now);
                    let key = (w, meta.clock);
                    match outcome {
                        Outcome::Applied if meta.skip => {
                            self.shards[k].skipped.entry(w).or_default().insert(key.1);
                        }
                        _ => {}
                    }
                    self.note(format!(
                        "s{k} took w{w} round {} (skip {}): {outcome:?}",
                        meta.clock, meta.skip
                    ));
                    self.maybe_snapshot(k);
                    self.send(Msg {
                        conn,
                        worker: w,
                        shard: k,
                        lane: Lane::ControlDown,
                        payload: Payload::Control(Control::PushOutcome {
                            clock: meta.clock,
                            outcome,
                        }),
                    });
                }
                Payload::Reply { .. } => return Err("reply travelling up".into()),
            }
            self.drain_shard(k)?;
        } else {
            if self.workers[w].phase == Phase::Crashed || self.workers[w].conns[k] != Some(conn) {
                return Ok(());
            }
            match msg.payload {
                Payload::Control(Control::PushOutcome { clock, outcome }) => {
                    self.workers[w].session.outcome(k, clock, outcome)
                }
                Payload::Control(Control::PullRefused { request, code }) => {
                    self.workers[w].session.pull_refused(k, request, code)
                }
                Payload::Reply {
                    kind,
                    body,
                    expect,
                    live,
                } => {
                    // The driver's own reply path: validate, judge, decode into the parameters.
                    let sw = &mut self.workers[w];
                    let used = sw
                        .session
                        .handle_reply(k, kind, &body, Some(&mut sw.params))
                        .map_err(|e| format!("worker {w} cannot use shard {k}'s reply: {e}"))?;
                    if used {
                        self.used_replies += 1;
                        let (start, end) = self.ranges(k);
                        let got = &self.workers[w].params[start..end];
                        if got
                            .iter()
                            .zip(&expect)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            return Err(format!(
                                "worker {w} read shard {k}'s {kind:?} reply into other bits than the shard answered with"
                            ));
                        }
                        if kind == FrameKind::Delta
                            && self.workers[w].session.public_values()[start..end] != expect[..]
                        {
                            return Err(format!(
                                "worker {w} holds another public copy of shard {k} than the shard"
                            ));
                        }
                        // What the worker computes on must satisfy the guarantee for the clock it pulls at.
                        let pulling_at = self.workers[w].session.clock();
                        let values = self.workers[w].params[start..end].to_vec();
                        self.check_read(k, w, pulling_at, &values, &live)?;
                    }
                }
                other => return Err(format!("shard sent {other:?}")),
            }
            self.drain_worker(w);
        }
        Ok(())
    }

    fn maybe_snapshot(&mut self, k: usize) {
        let s = &mut self.shards[k];
        if let Some(p) = &s.proto {
            if p.core().version() >= s.snapshot.version + s.snapshot_every {
                s.snapshot = p.core().snapshot();
            }
        }
    }

    fn crash_shard(&mut self, k: usize) {
        let Some(p) = self.shards[k].proto.take() else {
            return;
        };
        let (start, _) = self.ranges(k);
        let before = p.core().weights().to_vec();
        let snap = self.shards[k].snapshot.clone();
        for w in 0..WORKERS {
            for c in 0..SLOTS {
                let i = slot(w, c);
                if before[i] == 1.0 && snap.weights[i] == 0.0 {
                    self.shards[k].rolled_back.insert((w, c));
                }
            }
        }
        let _ = start;
        self.note(format!("shard {k} crashed (back to v{})", snap.version));
        let dead: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.alive && c.shard == k)
            .map(|(id, _)| *id)
            .collect();
        for conn in dead {
            self.break_conn(conn, true);
        }
        let t = self.now + 100 + self.rng.below(3_000);
        self.at(t, Ev::ShardRestart { shard: k });
    }

    fn restart_shard(&mut self, k: usize) {
        let mut core = ShardCore::new(&self.layout, &spec(k, self.faults.staleness));
        core.restore(self.shards[k].snapshot.clone(), self.now)
            .expect("a snapshot of this shard restores");
        core.set_public(lossless(), self.rng.next_u64());
        // The restored table's rows are live as of now; their join points are what the snapshot holds.
        self.shards[k].proto = Some(ShardProtocol::new(core));
        for w in 0..WORKERS {
            self.shards[k].last_heard.insert(w, self.now);
        }
        self.note(format!("shard {k} restarted"));
    }

    fn crash_worker(&mut self, w: usize) {
        if matches!(self.workers[w].phase, Phase::Crashed | Phase::Done) {
            return;
        }
        self.workers[w].phase = Phase::Crashed;
        self.workers[w].incarnation += 1;
        let conns: Vec<ConnId> = self.workers[w]
            .conns
            .iter_mut()
            .filter_map(|c| c.take())
            .collect();
        for c in conns {
            self.break_conn(c, false);
        }
        self.note(format!("worker {w} crashed"));
        let t = self.now + 100 + self.rng.below(4 * TIMEOUT_MS);
        self.at(t, Ev::WorkerRestart { worker: w });
    }

    fn restart_worker(&mut self, w: usize) {
        let ranges: Vec<(u64, u64)> = (0..SHARDS)
            .map(|k| {
                let (a, b) = self.ranges(k);
                (a as u64, b as u64)
            })
            .collect();
        let sw = &mut self.workers[w];
        sw.session = WorkerSession::new(
            w as u32,
            self.layout.hash(),
            ranges,
            self.faults.staleness,
            pull_mode(&self.faults),
            HEARTBEAT_MS,
        );
        sw.phase = Phase::Pulling;
        sw.connecting = vec![false; SHARDS];
        self.note(format!("worker {w} restarted"));
        self.drain_worker(w);
        let now = self.now;
        self.workers[w].session.start_pull(now);
        self.drain_worker(w);
    }

    fn compute_done(&mut self, w: usize) -> Result<(), String> {
        let now = self.now;
        let clock = self.workers[w].session.clock();
        let skip = self.rng.chance(self.faults.skip_per_mille);
        if skip {
            self.workers[w]
                .session
                .skip(0.0)
                .map_err(|e| e.to_string())?;
        } else {
            let mut frames: Vec<Vec<u8>> = Vec::with_capacity(SHARDS);
            for k in 0..SHARDS {
                let (start, end) = self.ranges(k);
                let mut g = vec![0.0f32; end - start];
                if clock < SLOTS {
                    g[slot(w, clock)] = -1.0;
                }
                let mut out = Vec::new();
                self.encoder
                    .encode(&g, 0, &mut out)
                    .map_err(|e| e.to_string())?;
                frames.push(out);
            }
            self.workers[w]
                .session
                .push(&mut frames, 0.0)
                .map_err(|e| e.to_string())?;
        }
        self.workers[w].rounds += 1;
        let done = self.workers[w].session.clock() >= ROUNDS;
        self.workers[w].phase = if done {
            Phase::Settling
        } else {
            Phase::Pulling
        };
        if !done {
            self.workers[w].session.start_pull(now);
        }
        self.drain_worker(w);
        Ok(())
    }

    fn random_live_conn(&mut self) -> Option<ConnId> {
        let alive: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.alive)
            .map(|(id, _)| *id)
            .collect();
        (!alive.is_empty()).then(|| alive[self.rng.below(alive.len() as u64) as usize])
    }

    fn inject_faults(&mut self) {
        let f = self.faults;
        if self.rng.chance(f.break_per_mille) {
            if let Some(c) = self.random_live_conn() {
                self.break_conn(c, true);
            }
        }
        if self.rng.chance(f.stall_per_mille) {
            if let Some(c) = self.random_live_conn() {
                let until = self.now + TIMEOUT_MS / 2 + self.rng.below(3 * TIMEOUT_MS);
                if let Some(conn) = self.conns.get_mut(&c) {
                    conn.stalled_until = until;
                }
                self.note(format!("conn {c} stalled until {until}"));
                self.at(until, Ev::Unstall { conn: c });
            }
        }
        if self.rng.chance(f.shard_crash_per_mille) {
            let k = self.rng.below(SHARDS as u64) as usize;
            self.crash_shard(k);
        }
        if self.rng.chance(f.worker_crash_per_mille) {
            let w = self.rng.below(WORKERS as u64) as usize;
            self.crash_worker(w);
        }
    }

    /// A one-line picture of every node, for failure messages.
    fn state(&self) -> String {
        let mut out = String::new();
        for (w, sw) in self.workers.iter().enumerate() {
            out += &format!(
                "w{w}: {:?} clock {} pulling {} settled {}; ",
                sw.phase,
                sw.session.clock(),
                sw.session.pulling(),
                sw.session.settled()
            );
        }
        for (k, s) in self.shards.iter().enumerate() {
            if let Some(p) = &s.proto {
                let rows: Vec<(u32, u64)> = p.core().clocks().clocks().collect();
                out += &format!(
                    "s{k}: live {rows:?} min {} parked {}; ",
                    p.core().clocks().min_clock(),
                    p.parked()
                );
            }
        }
        out
    }

    fn finished(&self) -> bool {
        self.workers.iter().all(|w| w.phase == Phase::Done)
    }

    fn step(&mut self) -> Result<bool, String> {
        // With nothing queued, time still passes: timers fire (evictions) until the time limit calls it stuck.
        let (t, id) = self.queue.peek().map_or((u64::MAX, 0), |r| r.0);
        // Timers run on their own clocks: the next tick comes first when it is due before the next event (a tick may
        // schedule events earlier than the one queued next, so one tick at a time).
        let tick = (self.now / TICK_MS + 1) * TICK_MS;
        if tick <= t {
            self.now = tick;
            for w in 0..WORKERS {
                if !matches!(self.workers[w].phase, Phase::Crashed | Phase::Done) {
                    self.workers[w].session.handle_timeout(tick);
                    self.drain_worker(w);
                }
            }
            for k in 0..SHARDS {
                if let Some(p) = self.shards[k].proto.as_mut() {
                    p.tick(tick);
                    self.drain_shard(k)?;
                }
            }
            return Ok(false);
        }
        self.queue.pop();
        self.now = t;
        let ev = self
            .events
            .remove(&id)
            .expect("every queued id has its event");
        match ev {
            Ev::Deliver(msg) => self.deliver(msg)?,
            Ev::ConnectArrive {
                worker,
                shard,
                incarnation,
                clock,
            } => {
                if self.workers[worker].incarnation != incarnation {
                    return Ok(false);
                }
                let Some(p) = self.shards[shard].proto.as_mut() else {
                    let t = self.now + 100;
                    self.at(
                        t,
                        Ev::ConnectFailed {
                            worker,
                            shard,
                            incarnation,
                        },
                    );
                    return Ok(false);
                };
                let conn = self.next_conn;
                self.next_conn += 1;
                let joined = p
                    .hello(conn, worker as u32, clock, self.now)
                    .map_err(|e| format!("hello refused: {e}"))?;
                let r = self.layout.shard_range(shard, SHARDS);
                let welcome = Welcome {
                    shard: shard as u32,
                    range_start: r.start as u64,
                    range_end: r.end as u64,
                    // What the shard runs under, as a server announces its configured bound.
                    staleness: p.core().clocks().staleness().bound(),
                    min_clock: joined.min_clock,
                    version: joined.version,
                    clock: joined.clock,
                };
                self.shards[shard].joined_at.insert(worker, joined.clock);
                self.shards[shard].last_heard.insert(worker, self.now);
                self.shards[shard].newest_conn.insert(worker, conn);
                self.conns.insert(
                    conn,
                    Conn {
                        worker,
                        shard,
                        alive: true,
                        stalled_until: 0,
                        lane_tail: BTreeMap::new(),
                    },
                );
                self.drain_shard(shard)?;
                let t = self.now + 1 + self.rng.below(50);
                self.at(
                    t,
                    Ev::Welcomed {
                        worker,
                        shard,
                        incarnation,
                        conn,
                        welcome,
                    },
                );
            }
            Ev::Welcomed {
                worker,
                shard,
                incarnation,
                conn,
                welcome,
            } => {
                if self.workers[worker].incarnation != incarnation {
                    return Ok(false);
                }
                self.workers[worker].connecting[shard] = false;
                if !self.conns[&conn].alive {
                    self.start_connect(worker, shard);
                    return Ok(false);
                }
                self.workers[worker].conns[shard] = Some(conn);
                let now = self.now;
                self.workers[worker]
                    .session
                    .connected(shard, &welcome, now)
                    .map_err(|e| format!("worker {worker} refused a welcome: {e}"))?;
                self.note(format!(
                    "w{worker} connected to s{shard} at clock {} (conn {conn})",
                    welcome.clock
                ));
                self.drain_worker(worker);
            }
            Ev::ConnectFailed {
                worker,
                shard,
                incarnation,
            } => {
                if self.workers[worker].incarnation == incarnation {
                    self.workers[worker].connecting[shard] = false;
                    self.start_connect(worker, shard);
                }
            }
            Ev::ComputeDone {
                worker,
                incarnation,
            } => {
                if self.workers[worker].incarnation == incarnation
                    && self.workers[worker].phase == Phase::Computing
                {
                    self.compute_done(worker)?;
                }
            }
            Ev::WorkerRestart { worker } => self.restart_worker(worker),
            Ev::ShardRestart { shard } => self.restart_shard(shard),
            Ev::Unstall { conn } => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.stalled_until = 0;
                }
            }
        }
        // A worker whose rounds are all settled says goodbye and is done.
        for w in 0..WORKERS {
            if self.workers[w].phase == Phase::Settling
                && self.workers[w].session.settled()
                && self.workers[w].session.connected_to_all()
            {
                let now = self.now;
                self.workers[w].session.goodbye(now);
                self.drain_worker(w);
                self.workers[w].phase = Phase::Done;
            }
        }
        if !self.finished() {
            self.inject_faults();
        }
        Ok(self.finished())
    }

    fn run(&mut self) -> Result<(), String> {
        let mut n = 0;
        loop {
            n += 1;
            if n > EVENT_LIMIT || self.now > TIME_LIMIT_MS {
                return Err(format!(
                    "stuck: {n} events, {} ms: {}",
                    self.now,
                    self.state()
                ));
            }
            if self.step()? {
                break;
            }
        }
        // Deliver what is still in flight (the goodbyes) so the shards' final state is complete.
        while let Some(Reverse((t, id))) = self.queue.pop() {
            self.now = self.now.max(t);
            if let Some(Ev::Deliver(msg)) = self.events.remove(&id) {
                self.deliver(msg)?;
            }
        }
        self.check_end()
    }

    /// Nothing applied twice; nothing acknowledged lost except what a crash rolled back to its checkpoint.
    fn check_end(&self) -> Result<(), String> {
        for (k, s) in self.shards.iter().enumerate() {
            let Some(p) = &s.proto else {
                continue;
            };
            let weights = p.core().weights();
            for (i, v) in weights.iter().enumerate() {
                if *v != 0.0 && *v != 1.0 {
                    return Err(format!("shard {k}: slot {i} = {v} at the end"));
                }
            }
            for &(w, c) in &s.acked {
                // A restarted worker's earlier incarnation may have taken that round with a skip marker: the round
                // counts once, whichever incarnation's frame arrived first.
                let skipped = s.skipped.get(&w).is_some_and(|r| r.contains(&c));
                if c < SLOTS
                    && weights[slot(w, c)] != 1.0
                    && !s.rolled_back.contains(&(w, c))
                    && !skipped
                {
                    return Err(format!(
                        "shard {k}: worker {w}'s round {c} was acknowledged but is not in the weights (lost update)"
                    ));
                }
            }
        }
        for (w, sw) in self.workers.iter().enumerate() {
            if !sw.session.settled() {
                return Err(format!("worker {w} finished with unsettled pushes"));
            }
        }
        Ok(())
    }
}

/// What one passing schedule saw.
struct Summary {
    replies: u64,
    lead: u64,
    evictions: u64,
}

/// Why one schedule failed, with its log and its fault mix.
struct Failure {
    error: String,
    log: Vec<String>,
    faults: Faults,
}

fn run_seed(seed: u64) -> Result<Summary, Box<Failure>> {
    let mut sim = Sim::new(seed);
    match sim.run() {
        Ok(()) => Ok(Summary {
            replies: sim.used_replies,
            lead: sim.max_lead,
            evictions: sim.shards.iter().map(|s| s.evictions).sum(),
        }),
        Err(error) => Err(Box::new(Failure {
            error,
            log: sim.log,
            faults: sim.faults,
        })),
    }
}

#[test]
fn protocol_cores_keep_the_read_guarantee_and_lose_nothing_under_fault_schedules() {
    let schedules: u64 = std::env::var("TETHER_SIM_SCHEDULES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let seeds: Vec<u64> = match std::env::var("TETHER_SIM_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(seed) => vec![seed],
        None => ALWAYS_RUN
            .into_iter()
            .chain((0..schedules).map(|i| 0x7e7e_0000 + i))
            .collect(),
    };
    let started = std::time::Instant::now();
    let (mut replies, mut lead, mut evictions) = (0, 0, 0);
    for &seed in &seeds {
        match run_seed(seed) {
            Ok(sum) => {
                replies += sum.replies;
                lead = lead.max(sum.lead);
                evictions += sum.evictions;
            }
            Err(f) => {
                let Failure { error, log, faults } = *f;
                let keep: usize = std::env::var("TETHER_SIM_LOG")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(60);
                let tail: Vec<&String> = log.iter().rev().take(keep).collect();
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
                panic!("seed {seed} failed ({faults:?}): {error}\nreplay: TETHER_SIM_SEED={seed} cargo test --test protocol_sim");
            }
        }
    }
    eprintln!(
        "{} schedules in {:.1} s: {replies} pull replies checked, largest lead {lead} (read from the weights), {evictions} evictions",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
}

#[test]
fn a_step_ten_times_the_timeout_is_not_silence() {
    // No faults but slow steps: every step lasts 10 × the eviction timeout; heartbeats keep every worker a member.
    let mut sim = Sim::with_faults(
        42,
        Faults {
            staleness: Staleness::Bounded(1),
            max_latency_ms: 5,
            duplicate_per_mille: 0,
            break_per_mille: 0,
            stall_per_mille: 0,
            shard_crash_per_mille: 0,
            worker_crash_per_mille: 0,
            slow_step_per_mille: 1000,
            slow_step_ms: 10 * TIMEOUT_MS,
            slow_step_jitter_ms: 0,
            skip_per_mille: 0,
            delta: true,
        },
    );
    sim.run().expect("run completes");
    let evictions: u64 = sim.shards.iter().map(|s| s.evictions).sum();
    assert_eq!(evictions, 0, "a slow worker was evicted");
    for (k, s) in sim.shards.iter().enumerate() {
        let p = s.proto.as_ref().unwrap();
        assert_eq!(
            p.core().stats().rejected_total(),
            0,
            "shard {k} refused pushes"
        );
        assert_eq!(
            p.core().stats().updates_applied,
            WORKERS as u64 * ROUNDS,
            "shard {k}"
        );
    }
    for w in &sim.workers {
        assert_eq!(w.session.stats().pushes_refused, 0);
    }
}
