//! The protocol simulator, shared by the random-schedule test and the scripted scenario tests: a deterministic
//! in-memory harness for the protocol cores (quinn-proto's `Pair`, grown to N workers × M shards):
//! the real [`WorkerProtocol`]s and [`ShardProtocol`]s (over real `ShardCore`s, the real codec and real rkyv/bincode
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
//! [`WorkerProtocol::handle_reply`] the driver calls; settled rounds are read with the same [`Settled::verdict`].
//! Every used reply must give the worker, bit for bit, the values the shard answered with, and the read guarantee is
//! checked on what the worker computes on. Half the schedules pull deltas of the shards' public copies (lossless f32
//! deltas, so the slots stay readable): there the worker's rebuilt copy must equal the shard's public copy.
//!
//! A schedule is a script of verbs on [`Sim`]: [`Sim::step`] / [`Sim::deliver`] move one event (or timer tick) at a
//! time, [`Sim::run_until`] and [`Sim::advance`] run to a condition or a time, [`Sim::break_link`],
//! [`Sim::stall_link`], [`Sim::crash_shard`] and [`Sim::crash_worker`] inject faults, the accessors read every
//! node, and [`Sim::check`] runs the checker after any step. A random schedule ([`Sim::new`]) draws its script from
//! its seed as it goes ([`script::inject`]); a scripted one ([`Sim::scripted`]) starts calm and does only what its
//! test says.
//!
//! Module map: `mod.rs` the world and its verbs, `net` the messages and their delivery, `check` the checker,
//! `script` fault mixes and the random script.

#![allow(dead_code)] // each test binary uses a different subset of the verbs

mod check;
pub mod hostile;
mod net;
pub mod script;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use tether::common::codec::{CodecConfig, Encoder, Scheme};
use tether::common::config::Staleness;
use tether::common::layout::Layout;
use tether::common::protocol::{Precision, PullMode};
use tether::common::testing::{flat_layout, sgd, TestRng};
use tether::server::protocol::{ConnId, Handled, Input, ShardProtocol};
use tether::server::quorum::QuorumSettings;
use tether::server::replication::{self as replica, image, Entry, EntryRef, Standby as StandbyLog};
use tether::server::shard::{Membership, ShardCore, ShardSpec};
use tether::worker::protocol::WorkerProtocol;

use net::{Conn, Ev};
pub use script::{Fault, Faults};

/// Workers in every schedule.
pub const WORKERS: usize = 3;
/// Shards in every schedule.
pub const SHARDS: usize = 2;
/// Rounds each worker runs.
pub const ROUNDS: u64 = 8;
/// Slots per worker per shard: rounds plus room for clock jumps on rejoin.
pub const SLOTS: u64 = 16;
/// The shards' eviction timeout.
pub const TIMEOUT_MS: u64 = 1_000;
/// The workers' heartbeat period.
pub const HEARTBEAT_MS: u64 = 200;
/// The timer granularity: workers and shards handle their timeouts on every multiple.
pub const TICK_MS: u64 = 50;
/// Virtual time after which a schedule that has not finished counts as stuck.
pub const TIME_LIMIT_MS: u64 = 600_000;
/// Events after which a schedule counts as stuck.
pub const EVENT_LIMIT: usize = 200_000;

/// Where a simulated worker is in its loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Waiting for its pull.
    Pulling,
    /// Computing a step on what it pulled.
    Computing,
    /// All rounds pushed, waiting for their outcomes.
    Settling,
    /// Said goodbye.
    Done,
    /// Down until its restart.
    Crashed,
}

/// One worker: the real protocol state machine and the simulated trainer around it.
struct SimWorker {
    protocol: WorkerProtocol,
    incarnation: u64,
    phase: Phase,
    /// The live connection per shard.
    conns: Vec<Option<ConnId>>,
    connecting: Vec<bool>,
    params: Vec<f32>,
    rounds: u64,
    /// A scripted step time, instead of the fault mix's.
    step_ms: Option<u64>,
}

/// A shard's standby: its own protocol core, fed every input the primary takes through the encoded log.
struct Standby {
    proto: ShardProtocol,
    follower: StandbyLog,
}

/// One shard: the real protocol core (none while crashed), its last checkpoint, and what the checker tracks of it.
struct SimShard {
    proto: Option<ShardProtocol>,
    /// The standby that follows it (replicated schedules, until it takes over).
    standby: Option<Standby>,
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
    /// The highest clock an honest worker reached on this shard (a round taken, or a welcome): the join value of a
    /// newcomer nobody else is live with may not exceed it.
    honest_high: u64,
    /// The highest q-th most advanced live clock seen since the shard (re)started, read from the table's rows after
    /// every protocol call: no round above it can have closed (quorum schedules; the minimum without one).
    quorum_high: u64,
    /// The highest clock the hostile member's row held since the shard (re)started: it counts towards quorums
    /// while live, and its row is gone after a goodbye while the rounds it helped close stay closed.
    hostile_high: u64,
}

/// The simulated world: N workers, M shards, the network between them, and the checker's records.
pub struct Sim {
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
    /// Pushes applied for a round the shard had already closed (quorum rounds: merged into the open one).
    late_merges: u64,
    /// Shards that failed over to their standby.
    failovers: u64,
    /// The first way a standby diverged from its primary (a violation, reported by the next step).
    diverged: Option<String>,
    /// Whether each event is followed by the next part of the random script drawn from the seed.
    random: bool,
    /// Every push frame a shard received: (worker, shard, clock, bytes).
    pushes: Vec<(usize, usize, u64, bytes::Bytes)>,
    /// Every push frame a worker sent on a link: (worker, shard, clock, bytes).
    sent: Vec<(usize, usize, u64, bytes::Bytes)>,
    /// Every (worker, shard, clock) whose outcome a worker learned.
    settled: BTreeSet<(usize, usize, u64)>,
    /// The hostile member's own generator (so schedules without it draw as before it existed).
    hostile_rng: TestRng,
    /// A check that failed outside an event's own result (a hostile move of the random script).
    failure: Option<String>,
    /// Connections a newer hello of the same worker superseded.
    superseded: BTreeSet<ConnId>,
}

fn layout() -> Layout {
    flat_layout(SHARDS * WORKERS * SLOTS as usize)
}

/// A shard core of this world: its spec, the configured ranks (the honest workers and the hostile member) and how
/// its rounds close.
fn shard_core(layout: &Layout, shard: usize, faults: &Faults) -> ShardCore {
    let mut core = ShardCore::new(layout, &spec(shard, faults.staleness));
    core.set_membership(Membership {
        workers: Some(WORKERS as u32 + 1),
        progress_timeout_ms: u64::MAX,
    });
    core.set_quorum(QuorumSettings {
        quorum: faults.quorum,
        grace_factor: GRACE_FACTOR,
        grace_max_ms: TIMEOUT_MS,
    });
    core.set_outer_at_close(faults.at_close);
    core
}

/// The values a shard's weights hold once its open rounds close: the weights, less the open rounds' sums of a shard
/// stepping at round close (under SGD at lr 1 a round's pushes add minus their sum), so that a slot reads 1 from
/// the push that owns it on, whether the shard steps on every push or at close.
pub(crate) fn effective_weights(core: &ShardCore) -> Vec<f32> {
    let mut weights = core.weights().to_vec();
    if core.outer_at_close() {
        for (_, sum) in core.snapshot().pending {
            for (w, s) in weights.iter_mut().zip(&sum) {
                *w -= s;
            }
        }
    }
    weights
}

/// [`effective_weights`] of a checkpoint snapshot.
fn effective_snapshot(snap: &tether::server::checkpoint::ShardSnapshot) -> Vec<f32> {
    let mut weights = snap.weights.clone();
    for (_, sum) in &snap.pending {
        for (w, s) in weights.iter_mut().zip(sum) {
            *w -= s;
        }
    }
    weights
}

/// Whether a random schedule's shards step at round close (a third of the bounded ones), from its own generator.
fn at_close_of(seed: u64, staleness: Staleness) -> bool {
    matches!(staleness, Staleness::Bounded(_))
        && TestRng::new(seed ^ 0xa7c1_05e0_0000_0000).chance(333)
}

/// The grace window of quorum schedules, as a multiple of the median round time.
pub const GRACE_FACTOR: f32 = 0.5;

/// The quorum's generator of `seed`: a third of the schedules close rounds at a quorum of 1 or 2 of the 3 workers.
/// Drawn apart from the fault mix, so the schedules without a quorum are the same as before quorums existed.
fn quorum_of(seed: u64) -> u32 {
    let mut rng = TestRng::new(seed ^ 0x0c0a_11e0_0000_0000);
    if rng.chance(333) {
        1 + rng.below(2) as u32
    } else {
        0
    }
}

/// The bit patterns of `values` (for exact comparisons).
fn bits_of(values: &[f32]) -> Vec<u32> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// Whether a random schedule's shards have standbys (a third of them), from the seed's own standby generator.
fn standbys_of(seed: u64) -> bool {
    TestRng::new(seed ^ 0x57a0_db70_0000_0000).chance(333)
}

fn spec(shard: usize, staleness: Staleness) -> ShardSpec {
    ShardSpec {
        shard: shard as u32,
        shards: SHARDS as u32,
        seed: 1,
        optimizer: sgd(1.0),
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

/// The hostile member's generator of `seed`: its first draw decides whether the seed's mix has one.
fn hostile_rng(seed: u64) -> TestRng {
    TestRng::new(seed ^ 0x4057_11e0_0000_0000)
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
    /// The random schedule of `seed`: its fault mix and its script, both drawn from the seed.
    pub fn new(seed: u64) -> Sim {
        let mut rng = TestRng::new(seed);
        let mut faults = Faults::draw(&mut rng);
        // Drawn from its own generator, like the quorum: the other schedules are the same as before standbys existed.
        faults.standbys = standbys_of(seed);
        // Drawn from the hostile member's own generator: the schedules without it are the same as before it existed.
        faults.hostile = hostile_rng(seed).chance(300);
        faults.quorum = quorum_of(seed);
        faults.at_close = at_close_of(seed, faults.staleness);
        Sim::build(rng, faults, seed)
    }

    /// The random schedule of `seed` under the given fault mix instead of the drawn one.
    pub fn with_faults(seed: u64, faults: Faults) -> Sim {
        let mut rng = TestRng::new(seed);
        let _drawn = Faults::draw(&mut rng);
        Sim::build(rng, faults, seed)
    }

    /// A scripted schedule: no random faults, only what the test does through the verbs (`seed` still draws the
    /// latencies and checkpoint periods).
    pub fn scripted(seed: u64, faults: Faults) -> Sim {
        let mut sim = Sim::with_faults(seed, faults);
        sim.random = false;
        sim
    }

    fn build(mut rng: TestRng, faults: Faults, seed: u64) -> Sim {
        let mut hostile_rng = hostile_rng(seed);
        let _mix = hostile_rng.chance(300);
        let layout = layout();
        let ranges: Vec<(u64, u64)> = (0..SHARDS)
            .map(|k| {
                let r = layout.shard_range(k, SHARDS);
                (r.start as u64, r.end as u64)
            })
            .collect();
        let workers = (0..WORKERS)
            .map(|w| SimWorker {
                protocol: WorkerProtocol::new(
                    w as u32,
                    layout.hash(),
                    ranges.clone(),
                    faults.staleness,
                    pull_mode(&faults),
                    HEARTBEAT_MS,
                )
                // Fresh shards' initial cuts are computed, not pulled (a restored shard offers none).
                .with_initial(std::sync::Arc::new(layout.clone())),
                incarnation: 0,
                phase: Phase::Pulling,
                conns: vec![None; SHARDS],
                connecting: vec![false; SHARDS],
                params: vec![0.0; layout.len()],
                rounds: 0,
                step_ms: None,
            })
            .collect();
        let shards = (0..SHARDS)
            .map(|k| {
                let mut core = shard_core(&layout, k, &faults);
                let lineage = rng.next_u64();
                core.set_public(lossless(), lineage);
                let snapshot = core.snapshot();
                // A standby starts from the same configuration and lineage, as the real one does.
                let standby = faults.standbys.then(|| {
                    let mut twin = shard_core(&layout, k, &faults);
                    twin.set_public(lossless(), lineage);
                    Standby {
                        proto: ShardProtocol::new(twin),
                        follower: StandbyLog::new(),
                    }
                });
                SimShard {
                    proto: Some(ShardProtocol::new(core)),
                    standby,
                    snapshot,
                    snapshot_every: 1 + rng.below(6),
                    joined_at: BTreeMap::new(),
                    skipped: BTreeMap::new(),
                    acked: BTreeSet::new(),
                    rolled_back: BTreeSet::new(),
                    last_heard: BTreeMap::new(),
                    newest_conn: BTreeMap::new(),
                    evictions: 0,
                    honest_high: 0,
                    quorum_high: 0,
                    hostile_high: 0,
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
            late_merges: 0,
            failovers: 0,
            diverged: None,
            random: true,
            pushes: Vec::new(),
            sent: Vec::new(),
            settled: BTreeSet::new(),
            hostile_rng,
            failure: None,
            superseded: BTreeSet::new(),
        };
        for w in 0..WORKERS {
            sim.drain_worker(w);
            sim.workers[w].protocol.start_pull(0);
            sim.drain_worker(w);
        }
        sim
    }

    fn note(&mut self, s: String) {
        if self.log.len() < 4000 {
            self.log.push(format!("{:>7} {s}", self.now));
        }
    }

    fn ranges(&self, shard: usize) -> (usize, usize) {
        let r = self.layout.shard_range(shard, SHARDS);
        (r.start, r.end)
    }

    fn maybe_snapshot(&mut self, k: usize) {
        let s = &mut self.shards[k];
        if let Some(p) = &s.proto {
            if p.core().version() >= s.snapshot.version + s.snapshot_every {
                s.snapshot = p.core().snapshot();
            }
        }
    }

    /// Feeds `input` to shard `k`'s primary through the protocol's one entry and then to its standby through the
    /// encoded log, as the actor and the replication link do; `None` when the primary is down.
    pub(crate) fn feed(&mut self, k: usize, input: Input) -> Option<Handled> {
        let handled = self.shards[k].proto.as_mut()?.handle(&input);
        self.replicate(k, input);
        Some(handled)
    }

    /// Feeds `input`, which shard `k`'s primary has just taken, to its standby through the encoded log (a
    /// failure to encode, decode or apply it is recorded as a violation).
    fn replicate(&mut self, k: usize, input: Input) {
        let Some(standby) = self.shards[k].standby.as_mut() else {
            return;
        };
        let entry = Entry {
            seq: standby.follower.applied() + 1,
            input,
        };
        let mut wire = Vec::new();
        let applied = replica::encode(
            &EntryRef {
                seq: entry.seq,
                input: &entry.input,
            },
            &mut wire,
        )
        .and_then(|()| replica::decode(&wire))
        .and_then(|e| standby.follower.accept(&mut standby.proto, &e));
        if let Err(e) = applied {
            self.diverged.get_or_insert(format!(
                "shard {k}'s standby refused entry {}: {e}",
                entry.seq
            ));
        }
    }

    /// Kills shard `k`'s primary for good and lets its standby take over: the standby must hold the primary's state
    /// bit for bit (nothing rolled back); the connections break as in a crash, and workers rejoin the standby.
    pub fn fail_over(&mut self, k: usize) {
        let Some(standby) = self.shards[k].standby.take() else {
            return;
        };
        let Some(primary) = self.shards[k].proto.take() else {
            return;
        };
        let bits = |p: &ShardProtocol| p.weights().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let same = bits(&primary) == bits(&standby.proto)
            && replica::state_digest(&primary.snapshot())
                == replica::state_digest(&standby.proto.snapshot())
            && primary.public().map(|(c, v)| (c, bits_of(v)))
                == standby.proto.public().map(|(c, v)| (c, bits_of(v)))
            // Everything else as well: members, outcome windows, parked pulls, quorum and guard state, counters.
            && image::encode(&primary, 0).ok() == image::encode(&standby.proto, 0).ok();
        if !same {
            self.diverged.get_or_insert(format!(
                "shard {k}'s standby does not hold the primary's state at the failover (v{} against v{})",
                standby.proto.version(),
                primary.version()
            ));
        }
        self.failovers += 1;
        self.note(format!(
            "shard {k} failed over to its standby at v{} ({} log entries)",
            standby.proto.version(),
            standby.follower.applied()
        ));
        self.break_shard_conns(k);
        // The dead primary's process comes back as the new primary's standby, seeded from its state image, so the
        // shard can fail over again.
        let mut core = shard_core(&self.layout, k, &self.faults);
        // Its own configuration's pull codec, as a real node sets it before it asks to be seeded.
        core.set_public(lossless(), 0);
        let mut twin = ShardProtocol::new(core);
        let seeded = image::encode(&standby.proto, self.now)
            .and_then(|bytes| image::restore(&bytes, &mut twin));
        match seeded {
            Ok(now) => {
                self.shards[k].standby = Some(Standby {
                    follower: StandbyLog::seeded(now, twin.max_conn(), 0),
                    proto: twin,
                });
            }
            Err(e) => {
                self.diverged
                    .get_or_insert(format!("shard {k}'s new standby cannot be seeded: {e}"));
            }
        }
        self.shards[k].proto = Some(standby.proto);
    }

    /// Breaks every live connection to shard `k` (its process is gone); the workers notice.
    fn break_shard_conns(&mut self, k: usize) {
        let dead: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.alive && c.shard == k)
            .map(|(id, _)| *id)
            .collect();
        for conn in dead {
            self.break_conn(conn, true);
        }
    }

    /// Crashes shard `k`: its connections break, and it restarts from its last checkpoint 0.1 to 3.1 s later. A
    /// shard with a standby fails over to it instead ([`Sim::fail_over`]).
    pub fn crash_shard(&mut self, k: usize) {
        if self.shards[k].standby.is_some() && self.shards[k].proto.is_some() {
            self.fail_over(k);
            return;
        }
        let Some(p) = self.shards[k].proto.take() else {
            return;
        };
        let (start, _) = self.ranges(k);
        let before = effective_weights(p.core());
        let snap = self.shards[k].snapshot.clone();
        let after = effective_snapshot(&snap);
        for w in 0..WORKERS {
            for c in 0..SLOTS {
                let i = slot(w, c);
                if before[i] == 1.0 && after[i] == 0.0 {
                    self.shards[k].rolled_back.insert((w, c));
                }
            }
        }
        let _ = start;
        self.note(format!("shard {k} crashed (back to v{})", snap.version));
        self.break_shard_conns(k);
        let t = self.now + 100 + self.rng.below(3_000);
        self.at(t, Ev::ShardRestart { shard: k });
    }

    fn restart_shard(&mut self, k: usize) {
        let mut core = shard_core(&self.layout, k, &self.faults);
        core.restore(self.shards[k].snapshot.clone(), self.now)
            .expect("a snapshot of this shard restores");
        core.set_public(lossless(), self.rng.next_u64());
        // The restored table's rows are live as of now; their join points are what the snapshot holds.
        self.shards[k].proto = Some(ShardProtocol::new(core));
        self.shards[k].quorum_high = 0;
        self.shards[k].hostile_high = 0;
        self.observe_quorum(k);
        for w in 0..WORKERS {
            self.shards[k].last_heard.insert(w, self.now);
        }
        self.note(format!("shard {k} restarted"));
    }

    /// Marks worker `w` crashed and breaks its connections; false when it was already down or done.
    fn break_worker(&mut self, w: usize) -> bool {
        if matches!(self.workers[w].phase, Phase::Crashed | Phase::Done) {
            return false;
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
        true
    }

    /// Crashes worker `w`: its connections break, and it restarts from nothing 0.1 to 4.1 s later.
    pub fn crash_worker(&mut self, w: usize) {
        if !self.break_worker(w) {
            return;
        }
        self.note(format!("worker {w} crashed"));
        let t = self.now + 100 + self.rng.below(4 * TIMEOUT_MS);
        self.at(t, Ev::WorkerRestart { worker: w });
    }

    /// Crashes worker `w` like [`crash_worker`](Self::crash_worker), but it restarts exactly `down_ms` later.
    pub fn crash_worker_for(&mut self, w: usize, down_ms: u64) {
        if !self.break_worker(w) {
            return;
        }
        self.note(format!("worker {w} crashed for {down_ms} ms"));
        let t = self.now + down_ms;
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
        sw.protocol = WorkerProtocol::new(
            w as u32,
            self.layout.hash(),
            ranges,
            self.faults.staleness,
            pull_mode(&self.faults),
            HEARTBEAT_MS,
        )
        .with_initial(std::sync::Arc::new(self.layout.clone()));
        sw.phase = Phase::Pulling;
        sw.connecting = vec![false; SHARDS];
        self.note(format!("worker {w} restarted"));
        self.drain_worker(w);
        let now = self.now;
        self.workers[w].protocol.start_pull(now);
        self.drain_worker(w);
    }

    fn compute_done(&mut self, w: usize) -> Result<(), String> {
        let now = self.now;
        let clock = self.workers[w].protocol.clock();
        let skip = self.rng.chance(self.faults.skip_per_mille);
        if skip {
            self.workers[w]
                .protocol
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
                .protocol
                .push(&mut frames, 0.0)
                .map_err(|e| e.to_string())?;
        }
        self.workers[w].rounds += 1;
        let done = self.workers[w].protocol.clock() >= ROUNDS;
        self.workers[w].phase = if done {
            Phase::Settling
        } else {
            Phase::Pulling
        };
        if !done {
            self.workers[w].protocol.start_pull(now);
        }
        self.drain_worker(w);
        Ok(())
    }

    /// A one-line picture of every node, for failure messages.
    pub fn state(&self) -> String {
        let mut out = String::new();
        for (w, sw) in self.workers.iter().enumerate() {
            out += &format!(
                "w{w}: {:?} clock {} pulling {} settled {}; ",
                sw.phase,
                sw.protocol.clock(),
                sw.protocol.pulling(),
                sw.protocol.settled()
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

    /// Whether every worker said goodbye.
    pub fn finished(&self) -> bool {
        self.workers.iter().all(|w| w.phase == Phase::Done)
    }

    /// One step: the next timer tick if it is due before the next event, else the next event (and, in a random
    /// schedule, the next part of its script).
    pub fn step(&mut self) -> Result<(), String> {
        let stepped = self.step_inner();
        match self.diverged.take() {
            Some(why) => Err(why),
            None => stepped,
        }
    }

    fn step_inner(&mut self) -> Result<(), String> {
        // With nothing queued, time still passes: timers fire (evictions) until the time limit calls it stuck.
        let (t, id) = self.queue.peek().map_or((u64::MAX, 0), |r| r.0);
        // Timers run on their own clocks: the next tick comes first when it is due before the next event (a tick may
        // schedule events earlier than the one queued next, so one tick at a time).
        let tick = (self.now / TICK_MS + 1) * TICK_MS;
        if tick <= t {
            self.now = tick;
            for w in 0..WORKERS {
                // A done worker whose rounds a shard's crash rolled back after its goodbye reconnects and resends
                // them; it keeps its timers until they are settled again.
                let sw = &self.workers[w];
                let idle = sw.phase == Phase::Crashed
                    || (sw.phase == Phase::Done && sw.protocol.settled());
                if !idle {
                    self.workers[w].protocol.handle_timeout(tick);
                    self.drain_worker(w);
                }
            }
            for k in 0..SHARDS {
                if self.feed(k, Input::Tick { now_ms: tick }).is_some() {
                    self.observe_quorum(k);
                    self.drain_shard(k)?;
                }
            }
            return Ok(());
        }
        self.queue.pop();
        self.now = t;
        let ev = self
            .events
            .remove(&id)
            .expect("every queued id has its event");
        match ev {
            Ev::Deliver(msg) => self.deliver_msg(msg)?,
            Ev::ConnectArrive {
                worker,
                shard,
                incarnation,
                clock,
            } => {
                if self.workers[worker].incarnation != incarnation {
                    return Ok(());
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
                    return Ok(());
                };
                let conn = self.next_conn;
                self.next_conn += 1;
                let clocks = p.core().clocks();
                let others_live =
                    (0..=hostile::HOSTILE as u32).any(|w| w != worker as u32 && clocks.is_live(w));
                let own_before = clocks
                    .clocks()
                    .chain(clocks.evicted())
                    .find(|(w, _)| *w == worker as u32)
                    .map_or(0, |(_, c)| c);
                // The shard protocol's own welcome, exactly what the connection shell sends.
                let hello = Input::Hello {
                    conn,
                    worker: worker as u32,
                    clock,
                    now_ms: self.now,
                };
                let welcome = match self.feed(shard, hello) {
                    Some(Handled::Welcome(w)) => w.map_err(|e| format!("hello refused: {e}"))?,
                    other => return Err(format!("a hello handled as {other:?}")),
                };
                // With nobody else live, the join value is evidence honest workers left, never a departed member's
                // clock (the hostile one's, run up alone).
                let high = self.shards[shard].honest_high;
                if !others_live && welcome.clock > clock.max(own_before).max(high) {
                    return Err(format!(
                        "shard {shard} welcomed w{worker} at {} with nobody else live: above its claim {clock}, its \
                         own row {own_before} and every honest clock {high} (a departed member's clock)",
                        welcome.clock
                    ));
                }
                let high = &mut self.shards[shard].honest_high;
                *high = (*high).max(welcome.clock);
                self.observe_quorum(shard);
                self.shards[shard].joined_at.insert(worker, welcome.clock);
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
                    return Ok(());
                }
                self.workers[worker].connecting[shard] = false;
                if !self.conns[&conn].alive {
                    self.start_connect(worker, shard);
                    return Ok(());
                }
                self.workers[worker].conns[shard] = Some(conn);
                let now = self.now;
                self.workers[worker]
                    .protocol
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
                && self.workers[w].protocol.settled()
                && self.workers[w].protocol.connected_to_all()
            {
                let now = self.now;
                self.workers[w].protocol.goodbye(now);
                self.drain_worker(w);
                self.workers[w].phase = Phase::Done;
                self.note(format!("worker {w} done"));
            }
        }
        if self.random && !self.finished() {
            script::inject(self);
            self.hostile_turn();
        }
        match self.failure.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Runs steps until `done` holds; an error if it does not within `max_steps` steps or the time limit.
    pub fn run_until(
        &mut self,
        mut done: impl FnMut(&Sim) -> bool,
        max_steps: usize,
    ) -> Result<(), String> {
        let mut n = 0;
        while !done(self) {
            n += 1;
            if n > max_steps || self.now > TIME_LIMIT_MS {
                return Err(format!(
                    "stuck: {n} events, {} ms: {}",
                    self.now,
                    self.state()
                ));
            }
            self.step()?;
        }
        Ok(())
    }

    /// Runs `n` steps (events or timer ticks).
    pub fn deliver(&mut self, n: usize) -> Result<(), String> {
        for _ in 0..n {
            self.step()?;
        }
        Ok(())
    }

    /// Runs until `ms` of virtual time have passed.
    pub fn advance(&mut self, ms: u64) -> Result<(), String> {
        let until = self.now + ms;
        self.run_until(|sim| sim.now >= until, EVENT_LIMIT)
    }

    /// Delivers every message still in flight, in time order, firing no timers and dropping every other event:
    /// the end of a schedule, so the shards' final state is complete.
    pub fn deliver_all(&mut self) -> Result<(), String> {
        while let Some(Reverse((t, id))) = self.queue.pop() {
            self.now = self.now.max(t);
            if let Some(Ev::Deliver(msg)) = self.events.remove(&id) {
                self.deliver_msg(msg)?;
            }
        }
        Ok(())
    }

    /// Runs the schedule to its end (every worker done), delivers what is in flight, and runs the end checks.
    pub fn run(&mut self) -> Result<(), String> {
        self.run_until(Sim::finished, EVENT_LIMIT)?;
        self.deliver_all()?;
        self.check_end()
    }

    /// Carries out one fault.
    pub fn apply(&mut self, fault: Fault) {
        match fault {
            Fault::Break(conn) => self.break_conn(conn, true),
            Fault::Stall { conn, until } => {
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.stalled_until = until;
                }
                self.note(format!("conn {conn} stalled until {until}"));
                self.at(until, Ev::Unstall { conn });
            }
            Fault::CrashShard(k) => self.crash_shard(k),
            Fault::CrashWorker(w) => self.crash_worker(w),
        }
    }

    /// Breaks worker `w`'s live link to shard `k` (the worker notices and reconnects); false if there was none.
    pub fn break_link(&mut self, w: usize, k: usize) -> bool {
        match self.workers[w].conns[k] {
            Some(conn) if self.conns.get(&conn).is_some_and(|c| c.alive) => {
                self.apply(Fault::Break(conn));
                true
            }
            _ => false,
        }
    }

    /// Holds back every message on worker `w`'s link to shard `k` for `ms`; false if there was no link.
    pub fn stall_link(&mut self, w: usize, k: usize, ms: u64) -> bool {
        match self.workers[w].conns[k] {
            Some(conn) => {
                let until = self.now + ms;
                self.apply(Fault::Stall { conn, until });
                true
            }
            None => false,
        }
    }

    /// Makes every later step of worker `w` take `ms` (`None`: back to the fault mix's step times).
    pub fn set_step_ms(&mut self, w: usize, ms: Option<u64>) {
        self.workers[w].step_ms = ms;
    }

    /// Virtual time now, in ms.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The fault mix this schedule runs under.
    pub fn faults(&self) -> Faults {
        self.faults
    }

    /// Where worker `w` is in its loop.
    pub fn phase(&self, w: usize) -> Phase {
        self.workers[w].phase
    }

    /// Worker `w`'s protocol (its clock, stats, pending pushes).
    pub fn protocol(&self, w: usize) -> &WorkerProtocol {
        &self.workers[w].protocol
    }

    /// Shard `k`'s protocol core, `None` while it is down.
    pub fn shard(&self, k: usize) -> Option<&ShardProtocol> {
        self.shards[k].proto.as_ref()
    }

    /// What shard `k` holds for worker `w`'s round `clock`: 1 once applied, 0 before, `None` while it is down.
    pub fn slot_value(&self, k: usize, w: usize, clock: u64) -> Option<f32> {
        self.shard(k).map(|p| p.weights()[slot(w, clock)])
    }

    /// Updates shard `k` applied, `None` while it is down.
    pub fn applied(&self, k: usize) -> Option<u64> {
        self.shard(k).map(|p| p.stats().updates_applied)
    }

    /// Whether worker `w` has a live link to shard `k`.
    pub fn linked(&self, w: usize, k: usize) -> bool {
        self.workers[w].conns[k].is_some_and(|c| self.conns.get(&c).is_some_and(|c| c.alive))
    }

    /// Evictions shard `k` made.
    pub fn evictions(&self, k: usize) -> u64 {
        self.shards[k].evictions
    }

    /// Pull replies the workers used (each one checked).
    pub fn used_replies(&self) -> u64 {
        self.used_replies
    }

    /// The largest clock lead read from the weights in a used reply.
    pub fn max_lead(&self) -> u64 {
        self.max_lead
    }

    /// The q-th most advanced live clock of shard `k` now (the minimum without a quorum), read from its table's rows;
    /// `None` when nobody is live or the shard is down.
    pub(super) fn quorum_clock(&self, k: usize) -> Option<u64> {
        let p = self.shards[k].proto.as_ref()?;
        let mut clocks: Vec<u64> = p.core().clocks().clocks().map(|(_, c)| c).collect();
        clocks.sort_unstable_by(|a, b| b.cmp(a));
        let q = match self.faults.quorum {
            0 => clocks.len(),
            q => (q as usize).min(clocks.len()),
        };
        clocks.get(q.checked_sub(1)?).copied()
    }

    /// Records shard `k`'s quorum clock after a protocol call (see `SimShard::quorum_high`).
    pub(super) fn observe_quorum(&mut self, k: usize) {
        if let Some(c) = self.quorum_clock(k) {
            let high = &mut self.shards[k].quorum_high;
            *high = (*high).max(c);
        }
        let hostile = self.shards[k].proto.as_ref().and_then(|p| {
            let clocks = p.core().clocks();
            clocks
                .clocks()
                .chain(clocks.evicted())
                .find(|(w, _)| *w == hostile::HOSTILE as u32)
                .map(|(_, c)| c)
        });
        if let Some(c) = hostile {
            let high = &mut self.shards[k].hostile_high;
            *high = (*high).max(c);
        }
    }

    /// Pushes applied after the shard had closed their round (quorum schedules).
    pub fn late_merges(&self) -> u64 {
        self.late_merges
    }

    /// Shards that failed over to their standby so far.
    pub fn failovers(&self) -> u64 {
        self.failovers
    }

    /// Every push frame a shard received, in arrival order: (worker, shard, clock, bytes).
    pub fn pushes(&self) -> &[(usize, usize, u64, bytes::Bytes)] {
        &self.pushes
    }

    /// Every push frame a worker sent on a link, in order: (worker, shard, clock, bytes).
    pub fn sent(&self) -> &[(usize, usize, u64, bytes::Bytes)] {
        &self.sent
    }

    /// Whether worker `w` learned the outcome of its round `clock` at shard `k` (any incarnation).
    pub fn settled(&self, w: usize, k: usize, clock: u64) -> bool {
        self.settled.contains(&(w, k, clock))
    }

    /// The schedule's log (the first 4,000 lines), for failure messages.
    pub fn log(&self) -> &[String] {
        &self.log
    }
}
