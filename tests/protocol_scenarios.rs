//! Two-sided scenarios: the real worker and shard protocol state machines of the protocol simulator (`tests/sim`) driven
//! through a script of verbs, each for one rule that used to be tested against hand-written stub messages on one
//! side: duplicated messages are taken once and the spare replies dropped, a push resent after a broken link is
//! idempotent by (worker, clock, shard), a parked pull is answered when the min clock moves, a silent worker is
//! evicted and rejoins, a goodbye drains before the link closes, crashed shards and workers come back without
//! losing or doubling an acknowledged round, and a step far longer than the timeout is not silence. Every scenario
//! ends with the simulator's checker (the read guarantee on every reply used, read from the weights).

mod sim;

use sim::hostile::{Move, HOSTILE};
use sim::{Faults, Phase, Sim, ROUNDS, SHARDS, TIMEOUT_MS, WORKERS};
use tether::common::config::Staleness;

/// Steps any scripted wait may take before it counts as stuck.
const STEPS: usize = 100_000;

/// A calm scripted schedule under bound `s`.
fn calm(seed: u64, s: u32) -> Sim {
    Sim::scripted(seed, Faults::calm(Staleness::Bounded(s)))
}

/// Every shard applied exactly one update per round of every worker.
fn assert_each_round_applied_once(sim: &Sim) {
    for k in 0..SHARDS {
        assert_eq!(
            sim.applied(k),
            Some(WORKERS as u64 * ROUNDS),
            "shard {k} applied another number of updates"
        );
    }
}

#[test]
fn every_message_sent_twice_is_taken_once_and_the_spare_replies_are_dropped() {
    // Worker rule: a reply to a request that is not the current one is never used (the spare copy of each reply
    // arrives after its pull completed). Shard rule: a resent round is acknowledged, not applied again.
    let mut faults = Faults::calm(Staleness::Bounded(1));
    faults.duplicate_per_mille = 1000;
    let mut sim = Sim::scripted(7, faults);
    sim.run().expect("run completes");
    assert_each_round_applied_once(&sim);
    let stale: u64 = (0..WORKERS)
        .map(|w| sim.protocol(w).stats().stale_replies)
        .sum();
    assert!(sim.used_replies() >= WORKERS as u64 * ROUNDS * SHARDS as u64);
    assert!(
        stale >= sim.used_replies(),
        "every used reply had a spare copy that was dropped: {stale} stale, {} used",
        sim.used_replies()
    );
    for w in 0..WORKERS {
        assert_eq!(sim.protocol(w).stats().pushes_refused, 0);
    }
}

#[test]
fn every_round_skipped_and_sent_twice_moves_each_clock_once() {
    let mut faults = Faults::calm(Staleness::Bounded(0));
    faults.duplicate_per_mille = 1000;
    faults.skip_per_mille = 1000;
    let mut sim = Sim::scripted(8, faults);
    sim.run().expect("run completes");
    for k in 0..SHARDS {
        let p = sim.shard(k).expect("no shard crashed");
        assert!(
            p.weights().iter().all(|v| *v == 0.0),
            "a skip marker changed weights"
        );
        // A second copy of a skip moving the clock again would make the next round a replay, refused.
        assert_eq!(p.core().stats().rejected_total(), 0, "shard {k}");
    }
    for w in 0..WORKERS {
        assert_eq!(sim.protocol(w).clock(), ROUNDS);
        assert_eq!(sim.protocol(w).stats().pushes_refused, 0);
    }
}

#[test]
fn a_push_lost_with_its_link_is_resent_byte_for_byte_and_applied_once() {
    let mut faults = Faults::calm(Staleness::Bounded(1));
    faults.late_per_mille = 0;
    let mut sim = Sim::scripted(11, faults);
    // Worker 0 sent its round to shard 0, which has not received it: the link breaks and the push is lost.
    let in_flight = |s: &Sim| {
        let round = s.protocol(0).clock().saturating_sub(1);
        let sent = s
            .sent()
            .iter()
            .any(|&(w, k, c, _)| (w, k, c) == (0, 0, round));
        let taken = s
            .pushes()
            .iter()
            .any(|&(w, k, c, _)| (w, k, c) == (0, 0, round));
        s.protocol(0).clock() >= 2 && sent && !taken
    };
    sim.run_until(in_flight, STEPS).expect("worker 0 pushes");
    let round = sim.protocol(0).clock() - 1;
    assert!(sim.break_link(0, 0));
    sim.run().expect("run completes");
    // The rejoin named the unsettled round and the same bytes went out again on the new link.
    let copies: Vec<&bytes::Bytes> = sim
        .sent()
        .iter()
        .filter(|&&(w, k, c, _)| (w, k, c) == (0, 0, round))
        .map(|(_, _, _, b)| b)
        .collect();
    assert_eq!(copies.len(), 2, "round {round} sent, lost, resent");
    assert_eq!(copies[0], copies[1], "byte for byte");
    assert!(sim.protocol(0).stats().resent >= 1);
    assert!(sim.settled(0, 0, round));
    assert_eq!(sim.slot_value(0, 0, round), Some(1.0), "applied once");
    assert_each_round_applied_once(&sim);
}

#[test]
fn a_dead_links_late_push_after_the_resend_is_acknowledged_not_applied_again() {
    // Idempotent by (worker, clock, shard) across connections: every message of a broken link still arrives.
    let mut faults = Faults::calm(Staleness::Bounded(1));
    faults.late_per_mille = 1000;
    let mut sim = Sim::scripted(12, faults);
    sim.run_until(
        |s| s.protocol(0).clock() >= 1 && s.phase(0) == Phase::Computing,
        STEPS,
    )
    .expect("worker 0 computes");
    let round = sim.protocol(0).clock();
    // The link holds the coming push back past the rejoin and the resend, then breaks.
    assert!(sim.stall_link(0, 0, 2 * TIMEOUT_MS / 5));
    sim.run_until(
        |s| {
            s.sent()
                .iter()
                .any(|&(w, k, c, _)| (w, k, c) == (0, 0, round))
        },
        STEPS,
    )
    .expect("worker 0 pushes");
    assert!(sim.break_link(0, 0));
    sim.run().expect("run completes");
    let arrived: Vec<&bytes::Bytes> = sim
        .pushes()
        .iter()
        .filter(|&&(w, k, c, _)| (w, k, c) == (0, 0, round))
        .map(|(_, _, _, b)| b)
        .collect();
    assert_eq!(arrived.len(), 2, "the resend and the late copy both arrive");
    assert_eq!(arrived[0], arrived[1], "byte for byte");
    assert_eq!(sim.slot_value(0, 0, round), Some(1.0), "applied once");
    assert_each_round_applied_once(&sim);
}

#[test]
fn a_parked_pull_is_answered_when_the_min_clock_moves() {
    let mut sim = calm(12, 0);
    // Worker 1 is slow (well inside the timeout): at s = 0 the others' next pulls wait for its rounds.
    sim.set_step_ms(1, Some(TIMEOUT_MS / 2));
    sim.run_until(|s| s.shard(0).is_some_and(|p| p.parked() > 0), STEPS)
        .expect("a pull parks");
    // At s = 0 a pull waits exactly when its clock is past the min clock.
    let min = sim.shard(0).expect("up").core().clocks().min_clock();
    let at: Vec<u64> = (0..WORKERS)
        .filter(|&w| w != 1 && sim.protocol(w).pulling() && sim.protocol(w).clock() > min)
        .map(|w| sim.protocol(w).clock())
        .collect();
    assert!(!at.is_empty(), "{}", sim.state());
    assert_eq!(
        sim.shard(0).expect("up").core().clocks().clock_of(1),
        Some(min),
        "worker 1 holds the min clock back"
    );
    sim.run_until(|s| s.shard(0).is_some_and(|p| p.parked() == 0), STEPS)
        .expect("the parked pull is answered");
    // Answered only once worker 1's round made the min clock reach the pull's clock.
    let min = sim.shard(0).expect("up").core().clocks().min_clock();
    assert!(at.iter().all(|&c| min >= c), "min {min}, parked at {at:?}");
    sim.set_step_ms(1, None);
    sim.run().expect("run completes");
    assert_eq!(sim.max_lead(), 0, "s = 0 read from the weights");
    assert_each_round_applied_once(&sim);
}

#[test]
fn a_silent_worker_is_evicted_its_link_closed_and_it_rejoins() {
    let mut sim = calm(13, 1);
    sim.run_until(|s| s.protocol(2).clock() >= 2, STEPS)
        .expect("worker 2 runs");
    assert!(sim.stall_link(2, 0, 3 * TIMEOUT_MS));
    sim.run_until(|s| s.evictions(0) > 0, STEPS)
        .expect("shard 0 evicts the silent worker");
    assert!(!sim.linked(2, 0), "the eviction closed the link");
    let p = sim.shard(0).expect("up");
    assert!(!p.core().clocks().is_live(2));
    // The simulator's checker already failed the run had the shard evicted a worker it heard from.
    sim.run().expect("run completes after the rejoin");
    assert_eq!(sim.phase(2), Phase::Done);
    assert_eq!(sim.protocol(2).clock(), ROUNDS);
}

#[test]
fn a_goodbye_drains_before_the_link_closes() {
    let mut sim = calm(14, 1);
    sim.run().expect("run completes");
    for k in 0..SHARDS {
        let p = sim.shard(k).expect("up");
        assert_eq!(p.live(), 0, "shard {k}: every worker left");
        assert_eq!(p.stats().left, WORKERS as u64);
        for w in 0..WORKERS {
            assert!(!sim.linked(w, k), "w{w} s{k} still linked");
        }
    }
    // Every round was taken before its worker's link closed.
    assert_each_round_applied_once(&sim);
}

#[test]
fn a_crashed_shard_restarts_from_its_checkpoint_and_loses_nothing_acknowledged() {
    let mut sim = calm(15, 1);
    sim.run_until(|s| s.applied(0).is_some_and(|n| n >= 6), STEPS)
        .expect("shard 0 takes rounds");
    sim.crash_shard(0);
    assert!(sim.shard(0).is_none());
    assert!((0..WORKERS).all(|w| !sim.linked(w, 0)));
    sim.run_until(|s| s.shard(0).is_some(), STEPS)
        .expect("shard 0 restarts");
    sim.check()
        .expect("nothing acknowledged lost but the rolled-back rounds");
    sim.run().expect("run completes");
    for w in 0..WORKERS {
        assert_eq!(sim.protocol(w).clock(), ROUNDS);
    }
}

#[test]
fn a_crashed_worker_restarts_and_no_round_counts_twice() {
    let mut sim = calm(16, 1);
    sim.run_until(|s| s.protocol(1).clock() >= 3, STEPS)
        .expect("worker 1 runs");
    sim.crash_worker(1);
    assert_eq!(sim.phase(1), Phase::Crashed);
    sim.run_until(|s| s.phase(1) != Phase::Crashed, STEPS)
        .expect("worker 1 restarts");
    // The checker reads every slot: a round taken from both incarnations would read 2.
    sim.run().expect("run completes");
    assert_eq!(sim.phase(1), Phase::Done);
}

#[test]
fn a_step_ten_times_the_timeout_is_not_silence() {
    // No faults but slow steps: every step lasts 10 × the eviction timeout; heartbeats keep every worker a member.
    let mut sim = Sim::with_faults(
        42,
        Faults {
            slow_step_per_mille: 1000,
            slow_step_ms: 10 * TIMEOUT_MS,
            delta: true,
            ..Faults::calm(Staleness::Bounded(1))
        },
    );
    sim.run().expect("run completes");
    let evictions: u64 = (0..SHARDS).map(|k| sim.evictions(k)).sum();
    assert_eq!(evictions, 0, "a slow worker was evicted");
    for k in 0..SHARDS {
        let p = sim.shard(k).expect("no shard crashed");
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
    for w in 0..WORKERS {
        assert_eq!(sim.protocol(w).stats().pushes_refused, 0);
    }
}

#[test]
fn a_lone_hostile_members_clock_never_becomes_where_honest_workers_rejoin() {
    // Issue 22's two-message brick, played against the real protocols: with every honest worker down, a hostile
    // member says hello at 2^40, runs its clock up alone with a flood of skip markers and says goodbye. The honest
    // workers restart and rejoin: the simulator's checker fails the run if one is welcomed above its claim, its own
    // row and every honest clock, and the run must finish with every round in the weights once.
    let mut sim = calm(21, 1);
    sim.run_until(|s| (0..WORKERS).all(|w| s.protocol(w).clock() >= 2), STEPS)
        .expect("the workers run");
    for w in 0..WORKERS {
        sim.crash_worker_for(w, 4 * TIMEOUT_MS);
    }
    sim.run_until(|s| s.shard(0).is_some_and(|p| p.live() == 0), STEPS)
        .expect("shard 0 evicts the silent workers");
    let honest = (0..WORKERS as u32)
        .filter_map(|w| {
            let p = sim.shard(0).expect("up");
            p.core()
                .clocks()
                .evicted()
                .find(|(v, _)| *v == w)
                .map(|(_, c)| c)
        })
        .max()
        .expect("evicted rows are kept");
    sim.hostile(Move::Hello {
        shard: 0,
        claim: 1 << 40,
    })
    .expect("a configured rank joins");
    let clock_of = |s: &Sim| {
        s.shard(0)
            .and_then(|p| p.core().clocks().clock_of(HOSTILE as u32))
            .unwrap_or(0)
    };
    assert!(
        clock_of(&sim) <= 2,
        "the claim was bounded by the floor + s + 1"
    );
    for _ in 0..2 {
        sim.hostile(Move::Flood {
            shard: 0,
            count: 16,
            skips: true,
        })
        .expect("flood");
        let target = clock_of(&sim) + 16;
        sim.run_until(|s| clock_of(s) >= target, STEPS)
            .expect("a lone member takes its own rounds");
    }
    let high = clock_of(&sim);
    assert!(high > honest + 20);
    sim.hostile(Move::Goodbye { shard: 0 }).expect("goodbye");
    let p = sim.shard(0).expect("up");
    assert_eq!(p.live(), 0);
    assert!(
        p.core().clocks().min_clock() <= honest,
        "the join value {} is not the departed member's clock {high}",
        p.core().clocks().min_clock()
    );
    sim.run().expect("the honest workers rejoin and finish");
    for w in 0..WORKERS {
        assert_eq!(sim.protocol(w).clock(), ROUNDS);
    }
}

#[test]
fn a_superseded_session_is_closed_and_its_late_rounds_change_nothing() {
    let mut sim = calm(22, 1);
    sim.run_until(|s| (0..WORKERS).all(|w| s.protocol(w).clock() >= 1), STEPS)
        .expect("the workers run");
    sim.hostile(Move::Hello { shard: 1, claim: 0 })
        .expect("a configured rank joins");
    let hostile_clock = |s: &Sim| {
        s.shard(1)
            .and_then(|p| p.core().clocks().clock_of(HOSTILE as u32))
    };
    let (before, clock) = (
        sim.shard(1).expect("up").weights().to_vec(),
        hostile_clock(&sim),
    );
    assert!(clock.is_some());
    // A second session; the first one's late rounds are refused (the checker fails the run if one is applied).
    sim.hostile(Move::Supersede { shard: 1 })
        .expect("supersede");
    let p = sim.shard(1).expect("up");
    assert_eq!(
        p.weights(),
        &before[..],
        "nothing from the old session changed a weight"
    );
    assert_eq!(hostile_clock(&sim), clock, "nor moved a clock");
    sim.hostile(Move::Beyond { shard: 1 })
        .expect("a rank beyond the configured workers is refused");
    sim.run().expect("the honest workers finish");
    assert_each_round_applied_once(&sim);
}
