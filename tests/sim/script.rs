//! Fault schedules: how adversarial one schedule is ([`Faults`], drawn per seed), and the random script drawn from
//! the seed step by step ([`inject`]): each fault it draws is carried out at once through the harness's verbs, so
//! a seed names one schedule, and replaying the seed replays it.

use tether::common::config::Staleness;
use tether::common::testing::TestRng;
use tether::server::protocol::ConnId;

use super::{Sim, SHARDS, TIMEOUT_MS, WORKERS};

/// How adversarial a schedule is (drawn per seed).
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    /// The bound every worker and shard runs under.
    pub staleness: Staleness,
    /// Each message takes 1 to this many ms.
    pub max_latency_ms: u64,
    /// Chance a message arrives twice.
    pub duplicate_per_mille: u64,
    /// Chance per event that a random live connection breaks.
    pub break_per_mille: u64,
    /// Chance per event that a random live connection stalls (past the eviction timeout, often).
    pub stall_per_mille: u64,
    /// Chance per event that a random shard crashes (back to its last checkpoint).
    pub shard_crash_per_mille: u64,
    /// Chance per event that a random worker crashes (and restarts from nothing).
    pub worker_crash_per_mille: u64,
    /// Chance a step is slow.
    pub slow_step_per_mille: u64,
    /// A slow step lasts this long plus up to `slow_step_jitter_ms`.
    pub slow_step_ms: u64,
    /// See `slow_step_ms`.
    pub slow_step_jitter_ms: u64,
    /// Chance a message on its way to a shard when its connection broke still arrives (a dead connection's last
    /// streams).
    pub late_per_mille: u64,
    /// Chance a round is a skip marker instead of a gradient.
    pub skip_per_mille: u64,
    /// Workers pull deltas of the public copies (else full f32 values).
    pub delta: bool,
    /// A hostile member joins the shards (see `hostile.rs`); drawn from the hostile member's own generator.
    pub hostile: bool,
    /// Quorum rounds: pushes that close a round (0 = every live worker); drawn from the quorum's own generator.
    pub quorum: u32,
    /// Every shard has a standby fed its input log; a shard crash is then a failover to the standby, with nothing
    /// rolled back (once per shard: a crash after it is a restart from the checkpoint). Drawn from its own generator.
    pub standbys: bool,
    /// The shards step at round close (`optimizer.outer.at_close`): a push waits in its round's sum until the round
    /// closes. Drawn from its own generator, only under a bounded staleness (the product refuses it otherwise).
    pub at_close: bool,
}

impl Faults {
    /// The fault mix of one seed: the first draws of its generator.
    pub fn draw(rng: &mut TestRng) -> Faults {
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
            late_per_mille: 500,
            delta: rng.chance(500),
            hostile: false,
            quorum: 0,
            standbys: false,
            at_close: false,
        }
    }

    /// No faults at all: short latencies, every message once, every step quick, full f32 pulls. The start of a
    /// scripted scenario, which then injects its faults through the verbs.
    pub fn calm(staleness: Staleness) -> Faults {
        Faults {
            staleness,
            max_latency_ms: 5,
            duplicate_per_mille: 0,
            break_per_mille: 0,
            stall_per_mille: 0,
            shard_crash_per_mille: 0,
            worker_crash_per_mille: 0,
            slow_step_per_mille: 0,
            slow_step_ms: 0,
            slow_step_jitter_ms: 0,
            skip_per_mille: 0,
            late_per_mille: 500,
            delta: false,
            hostile: false,
            quorum: 0,
            standbys: false,
            at_close: false,
        }
    }
}

/// One fault of a random script, carried out through the harness's verbs.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// The connection breaks (the worker notices).
    Break(ConnId),
    /// The connection holds every message back until this time.
    Stall {
        /// The stalled connection.
        conn: ConnId,
        /// When it flows again.
        until: u64,
    },
    /// The shard crashes and later restarts from its last checkpoint.
    CrashShard(usize),
    /// The worker crashes and later restarts from nothing.
    CrashWorker(usize),
}

/// The next part of the random script after one event: each fault of the seed's mix drawn in turn, and carried out
/// before the next is drawn (a break changes which connections a stall can pick).
pub fn inject(sim: &mut Sim) {
    let f = sim.faults;
    if sim.rng.chance(f.break_per_mille) {
        if let Some(c) = random_live_conn(sim) {
            sim.apply(Fault::Break(c));
        }
    }
    if sim.rng.chance(f.stall_per_mille) {
        if let Some(conn) = random_live_conn(sim) {
            let until = sim.now + TIMEOUT_MS / 2 + sim.rng.below(3 * TIMEOUT_MS);
            sim.apply(Fault::Stall { conn, until });
        }
    }
    if sim.rng.chance(f.shard_crash_per_mille) {
        let k = sim.rng.below(SHARDS as u64) as usize;
        sim.apply(Fault::CrashShard(k));
    }
    if sim.rng.chance(f.worker_crash_per_mille) {
        let w = sim.rng.below(WORKERS as u64) as usize;
        sim.apply(Fault::CrashWorker(w));
    }
}

fn random_live_conn(sim: &mut Sim) -> Option<ConnId> {
    let alive: Vec<ConnId> = sim
        .conns
        .iter()
        .filter(|(_, c)| c.alive)
        .map(|(id, _)| *id)
        .collect();
    (!alive.is_empty()).then(|| alive[sim.rng.below(alive.len() as u64) as usize])
}
