//! Loss-spike rollback on the shard side, through the real `ShardProtocol` and `ShardCore` of two shards fed the
//! same encoded push frames: both detect the spike at the same round and restore the snapshot of the same round (the
//! weights checked against a copy the test took itself at that boundary), pushes read before the rollback are
//! refused with `RolledBack` and change nothing, delta pulls restart from a new public-copy lineage, the learning
//! rate is scaled for the configured rounds, and an alarm whose target snapshot is not held changes nothing.

use tether_common::codec::{CodecConfig, Encoder, Scheme};
use tether_common::config::{RollbackConfig, Staleness};
use tether_common::protocol::{encode_push, ErrorCode, Outcome, PushFrame};
use tether_common::testing::{flat_layout, sgd};
use tether_server::protocol::ShardProtocol;
use tether_server::public::Answer;
use tether_server::shard::{ShardCore, ShardSpec};

const N: usize = 16;
const SHARDS: u32 = 2;
const WORKERS: u32 = 2;

fn rollback_cfg(every: u64, keep: usize) -> RollbackConfig {
    RollbackConfig {
        enabled: true,
        factor: 3.0,
        rounds: 2,
        window: 4,
        every,
        keep,
        lr_scale: 0.5,
        lr_rounds: 3,
    }
}

fn shard(k: u32, rb: &RollbackConfig) -> ShardProtocol {
    let layout = flat_layout(N);
    let spec = ShardSpec {
        shard: k,
        shards: SHARDS,
        seed: 1,
        optimizer: sgd(1.0),
        staleness: Staleness::Bounded(0),
        worker_timeout_ms: 60_000,
        spike_factor: 0.0,
    };
    let mut core = ShardCore::new(&layout, &spec);
    core.set_rollback(rb);
    let mut p = ShardProtocol::new(core);
    for w in 0..WORKERS {
        p.hello(u64::from(w), w, 0, 0).unwrap();
    }
    p
}

/// The gradient of (worker, round): 0.01·(round + 1) on one slot, so every round leaves its trace in the weights.
fn payload(len: usize, worker: u32, clock: u64) -> Vec<u8> {
    let mut g = vec![0.0f32; len];
    g[(worker as usize + clock as usize) % len] = 0.01 * (clock + 1) as f32;
    let mut out = Vec::new();
    Encoder::new(CodecConfig {
        scheme: Scheme::None,
        ..CodecConfig::default()
    })
    .unwrap()
    .encode(&g, 0, &mut out)
    .unwrap();
    out
}

/// Sends (worker, clock) with `loss`, read at `read_version`, to shard `p` as a real encoded frame.
fn send(p: &mut ShardProtocol, worker: u32, clock: u64, read_version: u64, loss: f32) -> Outcome {
    let r = p.core().range();
    let frame = PushFrame {
        worker,
        clock,
        shard: p.core().shard(),
        range_start: r.start,
        range_end: r.end,
        read_version,
        loss,
        skip: false,
        payload: payload((r.end - r.start) as usize, worker, clock),
    };
    let bytes = encode_push(&frame).unwrap();
    p.push_frame(u64::from(worker), &bytes, 0).unwrap().0
}

/// One BSP round on every shard: each worker pushes with `loss`, read at the shard's current version.
fn round(shards: &mut [ShardProtocol], clock: u64, loss: f32) {
    for p in shards.iter_mut() {
        let v = p.core().version();
        for w in 0..WORKERS {
            assert_eq!(
                send(p, w, clock, v, loss),
                Outcome::Applied,
                "round {clock}"
            );
        }
    }
}

#[test]
fn every_shard_rolls_back_to_the_same_round_and_refuses_stale_pushes() {
    let rb = rollback_cfg(5, 3);
    let mut shards: Vec<ShardProtocol> = (0..SHARDS).map(|k| shard(k, &rb)).collect();
    let mut at_ten = Vec::new();
    for clock in 0..13 {
        if clock == 10 {
            at_ten = shards.iter().map(|p| p.core().weights().to_vec()).collect();
        }
        round(&mut shards, clock, 1.0 + 0.01 * (clock % 2) as f32);
    }
    let read_before: Vec<u64> = shards.iter().map(|p| p.core().version()).collect();
    // The public copy workers hold before the spike.
    let held: Vec<_> = shards
        .iter_mut()
        .map(|p| p.core_mut().answer_public(None).unwrap().newest)
        .collect();
    // Rounds 13 and 14 spike; the alarm comes when round 14 completes (the second push of it).
    round(&mut shards, 13, 40.0);
    for p in &shards {
        assert_eq!(p.core().epoch(), 0, "one suspect round is not an alarm");
    }
    round(&mut shards, 14, 50.0);
    for (k, p) in shards.iter().enumerate() {
        let core = p.core();
        assert_eq!(core.epoch(), 1);
        let h = &core.stats().rollbacks;
        assert_eq!(h.len(), 1);
        assert_eq!(
            (h[0].shard, h[0].at_round, h[0].onset, h[0].to_round),
            (k as u32, 14, 13, 10)
        );
        // 15 rounds of 2 pushes were applied; the rollback is version 31, the snapshot was version 20.
        assert_eq!((h[0].from_version, h[0].snapshot_version), (30, 20));
        assert_eq!((core.version(), h[0].rounds_lost), (31, 5));
        assert_eq!(
            core.weights(),
            at_ten[k].as_slice(),
            "shard {k} holds round 10's weights"
        );
        // Snapshots after the restored one are gone.
        assert_eq!(core.rollback().unwrap().snapshot_rounds(), vec![0, 5, 10]);
    }
    // A push computed before the rollback (read version 26) is refused, the clock still advances, nothing changes.
    for (k, p) in shards.iter_mut().enumerate() {
        let before = p.core().weights().to_vec();
        assert_eq!(
            send(p, 0, 15, read_before[k], 1.0),
            Outcome::Refused(ErrorCode::RolledBack)
        );
        assert_eq!(p.core().weights(), before.as_slice());
        assert_eq!(p.core().clocks().clock_of(0), Some(16));
        // A resend gets the same answer from the protocol's memory, without reaching the core again.
        assert_eq!(
            send(p, 0, 15, read_before[k], 1.0),
            Outcome::Refused(ErrorCode::RolledBack)
        );
        assert_eq!(p.core().stats().rejected.get("rolled_back"), Some(&1));
    }
    // A push read after the rollback is applied, at half the learning rate (lr_scale 0.5 for rounds 15..18).
    for p in shards.iter_mut() {
        let v = p.core().version();
        let r = p.core().range();
        let before = p.core().weights().to_vec();
        assert_eq!(send(p, 1, 15, v, 1.0), Outcome::Applied);
        let slot = (1 + 15) % (r.end - r.start) as usize;
        let moved = before[slot] - p.core().weights()[slot];
        assert!((moved - 0.5 * 0.16).abs() < 1e-6, "moved {moved}");
    }
    // Delta pulls restart: a worker holding a cut of the old lineage gets the whole restored copy.
    for (k, p) in shards.iter_mut().enumerate() {
        let a = p.core_mut().answer_public(Some(held[k])).unwrap();
        assert!(matches!(a.answer, Answer::Full(_)));
        assert_ne!(a.newest.lineage, held[k].lineage);
    }
    // Training goes on, and an ordinary later round raises nothing.
    for clock in 16..20 {
        round(&mut shards, clock, 1.0);
    }
    for p in &shards {
        assert_eq!(p.core().epoch(), 1);
        assert_eq!(p.core().stats().rollbacks_missed, 0);
    }
}

#[test]
fn an_alarm_without_the_target_snapshot_changes_nothing() {
    // Keep only the newest snapshot: at the alarm (onset 10, target 5) the ring holds round 10 only.
    let rb = rollback_cfg(5, 1);
    let mut shards = vec![shard(0, &rb)];
    for clock in 0..10 {
        round(&mut shards, clock, 1.0);
    }
    round(&mut shards, 10, 30.0);
    let (weights, version) = (
        shards[0].core().weights().to_vec(),
        shards[0].core().version(),
    );
    round(&mut shards, 11, f32::NAN);
    let core = shards[0].core();
    assert_eq!(core.stats().rollbacks_missed, 1);
    assert!(core.stats().rollbacks.is_empty());
    assert_eq!(core.epoch(), 0);
    // Round 11 itself was applied (its push was fine); nothing was rolled back.
    assert_eq!(core.version(), version + 2);
    assert_ne!(core.weights(), weights.as_slice());
}

#[test]
fn without_rollback_the_same_spike_changes_nothing() {
    let mut off = rollback_cfg(5, 3);
    off.enabled = false;
    let mut shards = vec![shard(0, &off)];
    for clock in 0..16 {
        round(&mut shards, clock, if clock >= 13 { 50.0 } else { 1.0 });
    }
    let core = shards[0].core();
    assert_eq!(core.epoch(), 0);
    assert_eq!(core.version(), 32);
    assert!(core.rollback().is_none());
}

#[test]
fn a_minimum_clock_jumping_over_a_boundary_still_snapshots_it() {
    let rb = rollback_cfg(10, 3);
    let mut p = shard(0, &rb);
    p.hello(2, 2, 0, 0).unwrap();
    // Rounds are taken up to m + s + 1: with worker 2 stopped at round 9, the others reach clock 11.
    for clock in 0..11 {
        let v = p.core().version();
        for w in 0..WORKERS {
            assert_eq!(send(&mut p, w, clock, v, 1.0), Outcome::Applied);
        }
        if clock < 9 {
            assert_eq!(send(&mut p, 2, clock, v, 1.0), Outcome::Applied);
        }
    }
    // Worker 2 stopped at round 9: the minimum clock waits there.
    assert_eq!(p.core().clocks().min_clock(), 9);
    assert_eq!(p.core().rollback().unwrap().snapshot_rounds(), vec![0]);
    // It is evicted; the minimum jumps to 11, over boundary 10, which is snapshotted as what the shard holds then.
    for w in 0..WORKERS {
        p.heartbeat(u64::from(w), w, 60_500);
    }
    assert_eq!(p.tick(60_500), vec![2]);
    assert_eq!(p.core().clocks().min_clock(), 11);
    let ring = p.core().rollback().unwrap();
    assert_eq!(ring.snapshot_rounds(), vec![0, 10]);
    let ten = ring.point(10).unwrap();
    assert_eq!((ten.taken_at, ten.version), (11, p.core().version()));
}
