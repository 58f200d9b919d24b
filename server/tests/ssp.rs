//! SSP semantics of the clock table, checked against a reference model by simulating one shard: random
//! interleavings of pushes (applied, then `advance`), pulls (held until the table's gate opens), crashes with eviction
//! by time passing, graceful leaves and rejoins, for 1..=5 workers and s ∈ {0, 1, 3, inf}. Parking itself (bounds,
//! release order, refusals) belongs to `ShardProtocol` and is checked by the protocol harness (`tests/protocol_sim.rs`)
//! and `protocol.rs`'s tests; here a held pull is only the gate question `can_answer`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use proptest::prelude::*;
use tether_common::config::Staleness;
use tether_common::splitmix::{mix64, GAMMA};
use tether_server::clock::{ClockError, ClockTable, StalenessHistogram, MAX_CLOCK};

const TIMEOUT: u64 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Running and heartbeating.
    Running,
    /// Silent; still live in the table until evicted.
    Crashed,
    /// Not live: evicted (`forgotten == false`) or left (`forgotten == true`).
    Gone { forgotten: bool },
}

#[derive(Debug, Clone)]
struct Worker {
    state: State,
    /// Next round to compute = the clock of its next pull.
    r: u64,
    /// Pushed rounds not yet applied, oldest first.
    inflight: VecDeque<u64>,
    parked: bool,
    /// Clock it (re)joined at; rounds below it from earlier incarnations may be missing.
    joined_at: u64,
    /// Number of (re)joins so far.
    incarnation: u32,
    /// Reference clock (completed, applied rounds) while live in the reference model.
    clock: u64,
    last_active: u64,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Pull(usize),
    Apply(usize),
    Crash(usize),
    Tick(u64),
    Rejoin(usize),
    Leave(usize),
}

struct Sim {
    s: Option<u64>,
    table: ClockTable,
    /// Held pulls as (clock, worker), in arrival order.
    held: Vec<(u64, usize)>,
    workers: Vec<Worker>,
    /// Applied updates as (worker, round, incarnation): after a leave a worker restarts at m and may redo rounds.
    applied: BTreeSet<(usize, u64, u32)>,
    now: u64,
    /// Reference floor: the last minimum clock over two or more live workers (the join value with nobody live).
    floor: u64,
    max_lead: u64,
    answered: u64,
}

impl Sim {
    fn new(n: usize, staleness: Staleness) -> Self {
        let mut table = ClockTable::new(staleness, TIMEOUT);
        let workers = (0..n)
            .map(|w| {
                assert_eq!(table.join(w as u32, 0), 0);
                Worker {
                    state: State::Running,
                    r: 0,
                    inflight: VecDeque::new(),
                    parked: false,
                    joined_at: 0,
                    incarnation: 0,
                    clock: 0,
                    last_active: 0,
                }
            })
            .collect();
        Sim {
            s: staleness.bound().map(u64::from),
            table,
            held: Vec::new(),
            workers,
            applied: BTreeSet::new(),
            now: 0,
            floor: 0,
            max_lead: 0,
            answered: 0,
        }
    }

    fn is_live(&self, w: usize) -> bool {
        matches!(self.workers[w].state, State::Running | State::Crashed)
    }

    fn ref_min(&self) -> Option<u64> {
        (0..self.workers.len())
            .filter(|&w| self.is_live(w))
            .map(|w| self.workers[w].clock)
            .min()
    }

    fn step(&mut self, op: Op) {
        let n = self.workers.len();
        match op {
            Op::Pull(w) => {
                let w = w % n;
                let wk = &mut self.workers[w];
                if wk.state == State::Running && !wk.parked {
                    wk.parked = true;
                    let c = wk.r;
                    self.held.push((c, w));
                }
            }
            Op::Apply(w) => {
                let w = w % n;
                let now = self.now;
                let wk = &mut self.workers[w];
                if wk.state == State::Running {
                    if let Some(round) = wk.inflight.pop_front() {
                        assert!(
                            self.applied.insert((w, round, wk.incarnation)),
                            "round applied twice"
                        );
                        wk.clock = round + 1;
                        wk.last_active = now;
                        self.table.advance(w as u32, round + 1, now).unwrap();
                    }
                }
            }
            Op::Crash(w) => {
                let w = w % n;
                if self.workers[w].state == State::Running {
                    let wk = &mut self.workers[w];
                    wk.state = State::Crashed;
                    wk.inflight.clear();
                    wk.parked = false;
                    self.held.retain(|&(_, pw)| pw != w);
                }
            }
            Op::Tick(dt) => {
                self.now += dt;
                for w in 0..n {
                    if self.workers[w].state == State::Running {
                        self.table.heartbeat(w as u32, self.now);
                        self.workers[w].last_active = self.now;
                    }
                }
                let expected: Vec<u32> = (0..n)
                    .filter(|&w| {
                        self.is_live(w) && self.now - self.workers[w].last_active >= TIMEOUT
                    })
                    .map(|w| w as u32)
                    .collect();
                let evicted = self.table.evict_silent(self.now);
                assert_eq!(evicted, expected, "eviction at t={}", self.now);
                for w in evicted {
                    assert_eq!(self.workers[w as usize].state, State::Crashed);
                    self.workers[w as usize].state = State::Gone { forgotten: false };
                }
            }
            Op::Rejoin(w) => {
                let w = w % n;
                let st = self.workers[w].state;
                if st != State::Running {
                    let m = self.ref_min().unwrap_or(self.floor);
                    let expected = match st {
                        State::Crashed => self.workers[w].clock,
                        State::Gone { forgotten: false } => self.workers[w].clock.max(m),
                        State::Gone { forgotten: true } => m,
                        State::Running => unreachable!(),
                    };
                    let c = self.table.join(w as u32, self.now);
                    assert_eq!(c, expected, "join clock of worker {w}");
                    assert!(c >= m, "rejoined below the min clock");
                    let wk = &mut self.workers[w];
                    let incarnation = wk.incarnation + 1;
                    *wk = Worker {
                        state: State::Running,
                        r: c,
                        inflight: VecDeque::new(),
                        parked: false,
                        joined_at: c,
                        incarnation,
                        clock: c,
                        last_active: self.now,
                    };
                }
            }
            Op::Leave(w) => {
                let w = w % n;
                if self.is_live(w) {
                    self.table.leave(w as u32);
                    let wk = &mut self.workers[w];
                    wk.state = State::Gone { forgotten: true };
                    wk.inflight.clear();
                    wk.parked = false;
                    self.held.retain(|&(_, pw)| pw != w);
                }
            }
        }
        self.drain();
        self.check_model();
    }

    /// Answers every pull the gate now allows and checks the SSP guarantees at the moment of answering.
    fn drain(&mut self) {
        let (ready, held): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|&(c, _)| self.table.can_answer(c));
        self.held = held;
        for (c, w) in ready {
            assert!(self.table.can_answer(c));
            assert_eq!(self.workers[w].state, State::Running);
            let lead = self.table.lead(c);
            if let Some(s) = self.s {
                // BOUND: the clock lead of an answered pull never exceeds s (table and reference agree).
                assert!(lead <= s, "lead {lead} > s {s}");
                if let Some(m) = self.ref_min() {
                    assert!(c.saturating_sub(m) <= s);
                }
                // READ GUARANTEE: every update of every live worker from rounds < c − s has been applied.
                for v in 0..self.workers.len() {
                    if !self.is_live(v) {
                        continue;
                    }
                    for k in self.workers[v].joined_at..c.saturating_sub(s) {
                        assert!(
                            self.applied.contains(&(v, k, self.workers[v].incarnation)),
                            "pull {c} of worker {w} answered without round {k} of worker {v} (s={s})"
                        );
                    }
                }
                // No live member got more than s rounds ahead of this reader: none of their rounds above c + s is
                // applied yet. (Rounds of members that left are history: with nobody live, a newcomer joins at the
                // floor, which a lone member's rounds never move.)
                let live_now =
                    |v: usize, inc: u32| self.is_live(v) && self.workers[v].incarnation == inc;
                if let Some(&(_, k, _)) = self
                    .applied
                    .iter()
                    .filter(|(v, _, inc)| live_now(*v, *inc))
                    .max_by_key(|(_, k, _)| *k)
                {
                    assert!(
                        k <= c + s,
                        "round {k} applied before pull {c} answered (s={s})"
                    );
                }
            }
            self.max_lead = self.max_lead.max(lead);
            self.answered += 1;
            let wk = &mut self.workers[w];
            wk.parked = false;
            wk.inflight.push_back(c);
            wk.r = c + 1;
        }
    }

    fn check_model(&mut self) {
        let live = (0..self.workers.len()).filter(|&w| self.is_live(w)).count();
        assert_eq!(self.table.live(), live);
        // The floor is the last minimum over two or more live workers; with nobody live, m is the floor.
        let m = match self.ref_min() {
            Some(m) => {
                if live >= 2 {
                    self.floor = self.floor.max(m);
                }
                m
            }
            None => self.floor,
        };
        assert_eq!(self.table.min_clock(), m);
        assert_eq!(self.table.floor(), self.floor);
        for w in 0..self.workers.len() {
            let want = self.is_live(w).then_some(self.workers[w].clock);
            assert_eq!(self.table.clock_of(w as u32), want, "clock of worker {w}");
        }
        // Nothing answerable is left parked; an unbounded table never parks.
        for &(c, _) in &self.held {
            assert!(!self.table.can_answer(c));
            assert!(self.s.is_some());
        }
    }

    /// No deadlock: with every running worker pushing, all parked pulls are answered and everyone reaches `target`.
    fn run_to_completion(&mut self, extra_rounds: u64) {
        self.step(Op::Tick(TIMEOUT)); // crashed workers are evicted and stop blocking
        let n = self.workers.len();
        let target = self.workers.iter().map(|w| w.r).max().unwrap_or(0) + extra_rounds;
        let bound = (target + 2) * (n as u64 + 1) * 4 + 16;
        for _ in 0..bound {
            let done = self.workers.iter().all(|w| {
                w.state != State::Running || (w.r >= target && !w.parked && w.inflight.is_empty())
            });
            if done {
                assert!(self.held.is_empty(), "pulls left parked after completion");
                return;
            }
            for w in 0..n {
                let wk = &self.workers[w];
                if wk.state == State::Running && !wk.parked && wk.r < target {
                    self.step(Op::Pull(w));
                }
                while !self.workers[w].inflight.is_empty() {
                    self.step(Op::Apply(w));
                }
            }
        }
        panic!("deadlock: parked pulls never answered: {:?}", self.held);
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0usize..5).prop_map(Op::Pull),
        5 => (0usize..5).prop_map(Op::Apply),
        1 => (0usize..5).prop_map(Op::Crash),
        2 => (1u64..=2 * TIMEOUT / 3).prop_map(Op::Tick),
        1 => (0usize..5).prop_map(Op::Rejoin),
        1 => (0usize..5).prop_map(Op::Leave),
    ]
}

fn staleness() -> impl Strategy<Value = Staleness> {
    prop_oneof![
        Just(Staleness::Bounded(0)),
        Just(Staleness::Bounded(1)),
        Just(Staleness::Bounded(3)),
        Just(Staleness::Unbounded),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Random interleavings keep the read guarantee and the lead bound, match the reference model, and never
    /// deadlock.
    #[test]
    fn ssp_guarantees_hold_under_random_interleavings(
        n in 1usize..=5,
        s in staleness(),
        ops in prop::collection::vec(op(), 0..250),
    ) {
        let mut sim = Sim::new(n, s);
        for op in ops {
            sim.step(op);
        }
        sim.run_to_completion(3);
        if let Some(bound) = s.bound() {
            prop_assert!(sim.max_lead <= u64::from(bound));
        }
    }

    /// BSP (s = 0) equals a sequential run: each update depends non-linearly on the clock-c snapshot read, and the
    /// final sum is the same for every interleaving.
    #[test]
    fn bsp_equals_sequential(
        n in 1usize..=5,
        rounds in 1u64..6,
        ops in prop::collection::vec(
            prop_oneof![(0usize..5).prop_map(Op::Pull), (0usize..5).prop_map(Op::Apply)],
            0..200,
        ),
    ) {
        let mut bsp = Bsp {
            sim: Sim::new(n, Staleness::Bounded(0)),
            rounds,
            value_of: BTreeMap::new(),
            reads: BTreeMap::new(),
        };
        for op in ops {
            bsp.step(op);
        }
        // Finish every worker's rounds.
        for _ in 0..(rounds as usize + 2) * (n + 1) * 4 {
            for w in 0..n {
                bsp.step(Op::Pull(w));
                while !bsp.sim.workers[w].inflight.is_empty() {
                    bsp.step(Op::Apply(w));
                }
            }
        }
        prop_assert!(bsp.sim.workers.iter().all(|w| w.r == rounds && w.inflight.is_empty() && !w.parked));
        let got = bsp.value_of.values().fold(0u64, |a, v| a.wrapping_add(*v));
        prop_assert_eq!(got, sequential(n, rounds));
    }
}

/// A BSP shard whose state is the sum of applied updates, kept per (worker, round) so that a pull for clock c reads
/// the clock-c snapshot (rounds < c). If the gate ever answered a pull before every round < c was applied, the
/// snapshot would miss an update and the final sum would differ from the sequential run.
struct Bsp {
    sim: Sim,
    rounds: u64,
    value_of: BTreeMap<(usize, u64), u64>,
    reads: BTreeMap<(usize, u64), u64>,
}

impl Bsp {
    fn step(&mut self, op: Op) {
        let n = self.sim.workers.len();
        match op {
            Op::Pull(w) if self.sim.workers[w % n].r >= self.rounds => {}
            Op::Apply(w) => {
                let w = w % n;
                if let Some(&round) = self.sim.workers[w].inflight.front() {
                    let read = self.reads[&(w, round)];
                    self.value_of.insert((w, round), update(w, round, read));
                }
                self.sim.step(op);
            }
            op => self.sim.step(op),
        }
        // Record the read of every pull answered by this step, as of the moment it was answered.
        for (w, wk) in self.sim.workers.iter().enumerate() {
            for &c in &wk.inflight {
                if self.reads.contains_key(&(w, c)) {
                    continue;
                }
                // With s = 0 no round above c is applied when pull c is answered: no overlap.
                assert!(self.sim.applied.iter().all(|&(_, k, _)| k <= c));
                let snapshot = self
                    .value_of
                    .iter()
                    .filter(|((_, k), _)| *k < c)
                    .fold(0u64, |a, (_, v)| a.wrapping_add(*v));
                self.reads.insert((w, c), snapshot);
            }
        }
    }
}

/// A non-linear update of worker `w` at `round` given the value it read.
fn update(w: usize, round: u64, read: u64) -> u64 {
    mix64(read ^ (w as u64).wrapping_mul(GAMMA) ^ round.rotate_left(17))
}

fn sequential(n: usize, rounds: u64) -> u64 {
    let mut total = 0u64;
    for round in 0..rounds {
        let read = total;
        for w in 0..n {
            total = total.wrapping_add(update(w, round, read));
        }
    }
    total
}

#[test]
fn silent_worker_stops_blocking_exactly_at_timeout() {
    let mut t = ClockTable::new(Staleness::Bounded(0), TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    t.advance(0, 1, 10).unwrap();
    assert!(!t.can_answer(1), "w1 still at clock 0");
    t.heartbeat(0, 50);
    // Worker 1 last heard at t=0: not evicted before t=100.
    assert!(t.evict_silent(99).is_empty());
    assert!(!t.can_answer(1));
    assert_eq!(t.evict_silent(TIMEOUT), vec![1]);
    assert_eq!(t.live(), 1);
    assert!(t.is_evicted(1));
    assert!(
        t.can_answer(1),
        "the pull at clock 1 is released by the eviction"
    );
    assert_eq!(t.advance(1, 1, 120), Err(ClockError::Evicted { worker: 1 }));
}

#[test]
fn heartbeats_prevent_eviction() {
    let mut t = ClockTable::new(Staleness::Bounded(1), TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    for now in (50..1000).step_by(50) {
        t.heartbeat(1, now);
        t.advance(0, now / 50, now).unwrap();
        assert_eq!(t.evict_silent(now), Vec::<u32>::new());
    }
    assert_eq!(t.live(), 2);
}

#[test]
fn evicted_worker_rejoins_at_min_clock_and_blocks_again() {
    let mut t = ClockTable::new(Staleness::Bounded(0), TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    assert_eq!(t.evict_silent(TIMEOUT), vec![0, 1]);
    assert_eq!(t.live(), 0);
    assert!(t.can_answer(1_000), "an empty table blocks nothing");
    assert_eq!(t.lead(1_000), 0);
    t.join(0, 200);
    for c in 1..=3 {
        t.advance(0, c, 200 + c).unwrap();
    }
    assert_eq!(t.min_clock(), 3);
    // Worker 1 was evicted at clock 0 and comes back at m = 3, counted again.
    assert_eq!(t.join(1, 300), 3);
    assert_eq!(t.live(), 2);
    assert_eq!(t.clock_of(1), Some(3));
    t.advance(0, 4, 301).unwrap();
    assert!(!t.can_answer(4), "rejoined worker blocks BSP again");
    assert_eq!(
        t.advance(1, 5, 302),
        Err(ClockError::NotNext {
            worker: 1,
            expected: 4,
            got: 5
        })
    );
    t.advance(1, 4, 302).unwrap();
    assert!(t.can_answer(4));
}

#[test]
fn rejoin_never_moves_a_clock_backwards() {
    let mut t = ClockTable::new(Staleness::Bounded(3), TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    for c in 1..=3 {
        t.advance(1, c, 10).unwrap();
    }
    t.heartbeat(0, 60);
    assert_eq!(t.evict_silent(110), vec![1]); // worker 1 last seen at 10
    assert_eq!(t.min_clock(), 0);
    assert_eq!(
        t.join(1, 120),
        3,
        "evicted while ahead: keeps its own clock"
    );
    assert_eq!(t.join(0, 120), 0, "a live worker's join is idempotent");
    t.leave(1);
    assert_eq!(t.clock_of(1), None);
    assert_eq!(t.join(1, 130), 0, "after leaving, a worker starts at m");
    assert_eq!(
        t.advance(7, 1, 0),
        Err(ClockError::UnknownWorker { worker: 7 })
    );
}

#[test]
fn min_clock_of_empty_table_is_the_floor_that_no_lone_worker_moves() {
    let mut t = ClockTable::new(Staleness::Bounded(2), TIMEOUT);
    assert_eq!(t.min_clock(), 0);
    assert!(t.can_answer(u64::MAX));
    // Alone, worker 5 runs its clock to 2 and leaves: its clock is not where newcomers start.
    t.join(5, 0);
    t.advance(5, 1, 1).unwrap();
    t.advance(5, 2, 2).unwrap();
    assert!(t.can_answer(4) && !t.can_answer(5));
    t.leave(5);
    assert_eq!(t.live(), 0);
    assert_eq!(t.min_clock(), 0);
    assert_eq!(t.join(9, 3), 0);
    // A minimum held over two live workers is the floor once both are gone (left or evicted).
    t.join(8, 3);
    for c in 1..=2 {
        t.advance(8, c, 4).unwrap();
        t.advance(9, c, 4).unwrap();
    }
    t.leave(8);
    assert_eq!(t.evict_silent(4 + TIMEOUT), vec![9]);
    assert_eq!((t.live(), t.min_clock(), t.floor()), (0, 2, 2));
    assert_eq!(t.join(10, 5), 2);
}

#[test]
fn claims_are_bounded_by_the_other_live_workers_and_rounds_by_the_minimum() {
    let mut t = ClockTable::new(Staleness::Bounded(1), TIMEOUT);
    assert_eq!(
        t.join_claiming(0, 1 << 40, 0),
        0,
        "alone: the floor + s + 1 bounds the claim"
    );
    assert_eq!(t.join_claiming(1, 2, 0), 2, "worker 0's clock + s + 1");
    assert_eq!(
        t.join_claiming(1, 3, 0),
        2,
        "its own row does not raise its bound"
    );
    assert_eq!(t.claim_bound(0), 4);
    // Rounds: m = 0, s = 1: up to clock 2 may be taken.
    assert!(t.may_take(2) && !t.may_take(3));
    assert_eq!(
        t.restore(7, MAX_CLOCK + 1, 0),
        Err(ClockError::Unbounded {
            worker: 7,
            clock: MAX_CLOCK + 1
        })
    );
    assert_eq!(
        t.restore_evicted(7, u64::MAX, 0),
        Err(ClockError::Unbounded {
            worker: 7,
            clock: u64::MAX
        })
    );
    assert!(!t.is_live(7) && !t.is_evicted(7));
}

#[test]
fn unbounded_never_blocks() {
    let mut t = ClockTable::new(Staleness::Unbounded, TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    t.advance(0, 1, 0).unwrap();
    assert!(t.can_answer(u64::MAX));
    assert_eq!(t.lead(50), 50);
}

#[test]
fn the_gate_opens_exactly_at_m_equal_c_minus_s() {
    let mut t = ClockTable::new(Staleness::Bounded(1), TIMEOUT);
    t.join(0, 0);
    t.join(1, 0);
    assert!(t.can_answer(0) && t.can_answer(1) && !t.can_answer(2));
    t.advance(0, 1, 1).unwrap();
    assert!(!t.can_answer(2), "worker 1 still at 0");
    t.advance(1, 1, 1).unwrap();
    assert!(t.can_answer(2) && !t.can_answer(3));
}

#[test]
fn histogram_buckets_edges_and_labels() {
    let mut h = StalenessHistogram::new();
    assert_eq!((h.count(), h.max()), (0, 0));
    for v in [
        0,
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        15,
        16,
        31,
        32,
        63,
        64,
        1000,
        u64::MAX,
    ] {
        h.record(v);
    }
    let counts: Vec<u64> = h.buckets().iter().map(|b| b.count).collect();
    assert_eq!(counts, vec![1, 1, 1, 1, 1, 2, 2, 2, 2, 3]);
    let labels: Vec<String> = h.buckets().iter().map(|b| b.label()).collect();
    assert_eq!(
        labels,
        ["0", "1", "2", "3", "4", "5-7", "8-15", "16-31", "32-63", "64+"]
    );
    assert_eq!(h.count(), 16);
    assert_eq!(h.max(), u64::MAX);
    // Buckets tile 0..=u64::MAX with no gap or overlap.
    let b = h.buckets();
    assert_eq!(b[0].lower, 0);
    assert_eq!(b.last().unwrap().upper, u64::MAX);
    assert!(b.windows(2).all(|w| w[1].lower == w[0].upper + 1));
}

#[test]
fn histogram_merge_adds_counts() {
    let mut a = StalenessHistogram::new();
    let mut b = StalenessHistogram::new();
    for v in 0..10 {
        a.record(v);
    }
    for v in [3, 3, 70] {
        b.record(v);
    }
    a.merge(&b);
    assert_eq!(a.count(), 13);
    assert_eq!(a.max(), 70);
    assert_eq!(a.sum(), 45 + 76);
    assert_eq!(a.buckets()[3].count, 3);
    assert_eq!(a.buckets()[9].count, 1);
    assert_eq!(a.buckets().iter().map(|b| b.count).sum::<u64>(), a.count());
    let json = serde_json::to_string(&a).unwrap();
    let back: StalenessHistogram = serde_json::from_str(&json).unwrap();
    assert_eq!(back, a);
}
