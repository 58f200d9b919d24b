//! The `ShardActor` shell: a parked pull released by the push that opens the SSP gate, eviction of a silent worker
//! within `worker_timeout` (and not before, and its connection kicked), the per-worker parked-pull cap answering
//! `Overloaded` without touching other workers, and `CheckpointNow` writing a checkpoint that a fresh actor resumes
//! from bit for bit.

use std::time::{Duration, Instant};

use actix::Addr;
use tether_common::codec::{CodecConfig, Encoder};
use tether_common::config::{OptimizerConfig, OptimizerKind, Staleness};
use tether_common::layout::{mlp_layout, Layout};
use tether_common::pki::CheckpointKey;
use tether_common::protocol::{
    decode_params, encode_push, encode_values, ErrorCode, FrameKind, Outcome, ParamReply,
    Precision, PullMode, PushFrame,
};
use tether_server::actor::{
    ApplyPush, CheckpointNow, GetStats, GetWeights, Heartbeat, Hello, Pull, ShardActor,
};
use tether_server::checkpoint::CheckpointStore;
use tether_server::protocol::WireReply;
use tether_server::protocol::MAX_PARKED_PER_WORKER;
use tether_server::shard::{ShardCore, ShardError, ShardSpec};
use tokio::sync::oneshot;

fn layout() -> Layout {
    mlp_layout(&[32, 16, 4])
}

fn core(staleness: Staleness, timeout_ms: u64) -> ShardCore {
    let spec = ShardSpec {
        shard: 0,
        shards: 1,
        seed: 3,
        optimizer: OptimizerConfig {
            kind: OptimizerKind::Adam,
            lr: 1e-2,
            ..OptimizerConfig::default()
        },
        staleness,
        worker_timeout_ms: timeout_ms,
        spike_factor: 0.0,
    };
    ShardCore::new(&layout(), &spec)
}

fn start(
    core: ShardCore,
    store: Option<CheckpointStore>,
    timeout_ms: u64,
) -> (Addr<ShardActor>, actix::Arbiter) {
    ShardActor::new(core, store, 0, timeout_ms, None).start_on_own_arbiter()
}

fn gradient(n: usize, worker: u32, clock: u64) -> Vec<u8> {
    let g: Vec<f32> = (0..n)
        .map(|i| ((i as f32 + worker as f32 * 7.0 + clock as f32 * 3.0) * 0.37).sin() * 1e-2)
        .collect();
    let mut out = Vec::new();
    Encoder::new(CodecConfig::default())
        .unwrap()
        .encode(&g, u64::from(worker) << 32 | clock, &mut out)
        .unwrap();
    out
}

/// Pushes round `clock` of `worker`; the shard version after it, or the outcome when it was not applied.
async fn push(
    addr: &Addr<ShardActor>,
    worker: u32,
    clock: u64,
    read_version: u64,
) -> Result<u64, Outcome> {
    let n = layout().len();
    let body = encode_push(&PushFrame {
        worker,
        clock,
        shard: 0,
        range_start: 0,
        range_end: n as u64,
        read_version,
        loss: 0.0,
        skip: false,
        payload: gradient(n, worker, clock),
    })
    .unwrap();
    match addr
        .send(ApplyPush {
            conn: u64::from(worker),
            body,
        })
        .await
        .unwrap()
        .unwrap()
        .outcome
    {
        Outcome::Applied => Ok(addr.send(GetStats).await.unwrap().0),
        other => Err(other),
    }
}

/// Joins `worker` on connection `worker` (one connection per worker in these tests); returns its clock.
async fn join(addr: &Addr<ShardActor>, worker: u32) -> u64 {
    join_kicked(addr, worker).await.0
}

async fn join_kicked(
    addr: &Addr<ShardActor>,
    worker: u32,
) -> (u64, oneshot::Receiver<Option<ErrorCode>>) {
    let (kick, kicked) = oneshot::channel();
    let joined = addr
        .send(Hello {
            conn: u64::from(worker),
            worker,
            clock: 0,
            kick,
        })
        .await
        .unwrap()
        .unwrap();
    (joined.clock, kicked)
}

type Reply = oneshot::Receiver<Result<WireReply, ShardError>>;

/// Sends a pull of `worker` at `clock`; the receiver resolves when the gate opens. A refusal is an error here.
async fn pull(
    addr: &Addr<ShardActor>,
    worker: u32,
    clock: u64,
    precision: Precision,
) -> Result<Reply, ShardError> {
    addr.send(Pull {
        conn: u64::from(worker),
        worker,
        request: clock,
        clock,
        mode: PullMode::Full(precision),
    })
    .await
    .unwrap()
}

/// The full reply a finished frame carries, read back as a worker reads it.
fn params(reply: WireReply) -> ParamReply {
    assert_eq!(
        reply.kind,
        FrameKind::Params,
        "a full pull answered with the public copy"
    );
    decode_params(&reply.chunks.concat()).expect("the shard builds valid replies")
}

fn values(reply: &ParamReply) -> &[u8] {
    &reply.values
}

fn f32_values(reply: &ParamReply) -> Vec<u32> {
    values(reply)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[actix_rt::test]
async fn parked_pull_is_released_by_the_push_that_opens_the_gate() {
    let (addr, arbiter) = start(core(Staleness::Bounded(0), 60_000), None, 60_000);
    assert_eq!(join(&addr, 0).await, 0);
    assert_eq!(join(&addr, 1).await, 0);
    // Round 0 is open to both.
    let r = params(
        pull(&addr, 0, 0, Precision::F32)
            .await
            .unwrap()
            .await
            .unwrap()
            .unwrap(),
    );
    assert_eq!(
        (r.header.version, r.header.clock, r.header.min_clock),
        (0, 0, 0)
    );
    assert_eq!(push(&addr, 0, 0, 0).await, Ok(1));
    let mut rx = pull(&addr, 0, 1, Precision::F32).await.unwrap();
    // BSP: worker 1 has not pushed round 0, so the pull stays parked.
    assert!(
        tokio::time::timeout(Duration::from_millis(150), &mut rx)
            .await
            .is_err(),
        "answered too early"
    );
    assert_eq!(push(&addr, 1, 0, 0).await, Ok(2));
    let reply = params(
        tokio::time::timeout(Duration::from_secs(5), rx)
            .await
            .expect("pull not released")
            .unwrap()
            .unwrap(),
    );
    assert_eq!(
        (
            reply.header.version,
            reply.header.clock,
            reply.header.min_clock
        ),
        (2, 1, 1)
    );
    let (version, weights) = addr.send(GetWeights).await.unwrap();
    assert_eq!(version, 2);
    assert_eq!(
        f32_values(&reply),
        bits(&weights),
        "the reply carries both round-0 updates"
    );
    let (_, stats, live) = addr.send(GetStats).await.unwrap();
    assert_eq!((stats.updates_applied, stats.max_lead, live), (2, 0, 2));
    arbiter.stop();
}

#[actix_rt::test]
async fn bf16_pull_rounds_each_value() {
    let (addr, arbiter) = start(core(Staleness::Unbounded, 60_000), None, 60_000);
    join(&addr, 0).await;
    let r = params(
        pull(&addr, 0, 0, Precision::Bf16)
            .await
            .unwrap()
            .await
            .unwrap()
            .unwrap(),
    );
    let (_, weights) = addr.send(GetWeights).await.unwrap();
    assert_eq!(values(&r).len(), 2 * weights.len());
    for (b, w) in values(&r).chunks_exact(2).zip(&weights) {
        let v = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
        assert!((v - w).abs() <= w.abs() / 128.0, "{v} vs {w}");
    }
    let mut le = Vec::new();
    encode_values(&weights, Precision::Bf16, &mut le);
    assert_eq!(le, values(&r));
    arbiter.stop();
}

#[actix_rt::test]
async fn a_silent_worker_stops_blocking_within_the_timeout() {
    const TIMEOUT_MS: u64 = 600;
    // The actor sweeps every timeout/4.
    const TICK_MS: u64 = TIMEOUT_MS / 4;
    let (addr, arbiter) = start(core(Staleness::Bounded(0), TIMEOUT_MS), None, TIMEOUT_MS);
    join(&addr, 0).await;
    let silent_since = Instant::now();
    let (_, kicked) = join_kicked(&addr, 1).await;
    assert_eq!(push(&addr, 0, 0, 0).await, Ok(1));
    let mut rx = pull(&addr, 0, 1, Precision::F32).await.unwrap();
    // Worker 0 keeps heartbeating (as a live worker does); worker 1 says nothing.
    let deadline = silent_since + Duration::from_millis(TIMEOUT_MS + 2 * TICK_MS + 1_000);
    let reply = loop {
        match tokio::time::timeout(Duration::from_millis(50), &mut rx).await {
            Ok(r) => break params(r.unwrap().unwrap()),
            Err(_) => {
                assert!(
                    Instant::now() < deadline,
                    "pull still parked long after the timeout"
                );
                addr.send(Heartbeat { conn: 0, worker: 0 }).await.unwrap();
            }
        }
    };
    let waited = silent_since.elapsed();
    // Both ends of the actor's millisecond clock are truncated, so allow 2 ms below the timeout.
    assert!(
        waited >= Duration::from_millis(TIMEOUT_MS - 2),
        "answered after {waited:?}, before the timeout"
    );
    // The sweep runs every tick; allow two ticks plus scheduling slack on a loaded machine.
    assert!(
        waited <= Duration::from_millis(TIMEOUT_MS + 2 * TICK_MS + 300),
        "answered only after {waited:?}"
    );
    assert_eq!(
        (
            reply.header.clock,
            reply.header.min_clock,
            reply.header.version
        ),
        (1, 1, 1)
    );
    let (_, _, live) = addr.send(GetStats).await.unwrap();
    assert_eq!(live, 1, "worker 1 was evicted, worker 0 was not");
    assert_eq!(
        kicked.await,
        Ok(Some(ErrorCode::Evicted)),
        "the evicted worker's connection is closed so that it rejoins"
    );
    // The evicted worker's push is refused until it rejoins, and then it rejoins at the current minimum.
    assert_eq!(
        push(&addr, 1, 0, 0).await,
        Err(Outcome::Refused(ErrorCode::Evicted))
    );
    assert_eq!(join(&addr, 1).await, 1);
    assert_eq!(push(&addr, 1, 1, 1).await, Ok(2));
    arbiter.stop();
}

#[actix_rt::test]
async fn the_parked_pull_cap_is_per_worker_and_refuses_overloaded() {
    let (addr, arbiter) = start(core(Staleness::Bounded(0), 60_000), None, 60_000);
    join(&addr, 0).await;
    join(&addr, 1).await;
    join(&addr, 2).await;
    // BSP: a pull at clock 1 waits for every worker's round 0.
    let mut parked = Vec::new();
    for _ in 0..MAX_PARKED_PER_WORKER {
        parked.push(pull(&addr, 0, 1, Precision::F32).await.unwrap());
    }
    assert_eq!(
        pull(&addr, 0, 1, Precision::F32).await.unwrap_err(),
        ShardError::Overloaded
    );
    // Another worker's pulls are not affected by worker 0's flood.
    let honest = pull(&addr, 1, 1, Precision::F32).await;
    assert!(honest.is_ok(), "worker 1 refused: {honest:?}");
    // A pull the gate allows is still answered at once.
    let ok = pull(&addr, 2, 0, Precision::F32).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_secs(5), ok)
        .await
        .unwrap()
        .unwrap()
        .is_ok());
    // Clocks the protocol cannot have reached, or has passed, are refused with typed errors.
    assert!(matches!(
        pull(&addr, 2, 2, Precision::F32).await,
        Err(ShardError::ClockFromFuture { .. })
    ));
    assert!(matches!(
        pull(&addr, 2, u64::MAX, Precision::F32).await,
        Err(ShardError::ClockFromFuture { .. })
    ));
    // Requesters that went away free their slots (swept on the actor's tick).
    parked.clear();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match pull(&addr, 0, 1, Precision::F32).await {
            Ok(_) => break,
            Err(ShardError::Overloaded) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("slots not freed: {e}"),
        }
    }
    arbiter.stop();
}

#[actix_rt::test]
async fn checkpoint_now_writes_what_a_fresh_actor_resumes_from() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("shard-0");
    let (addr, arbiter) = start(
        core(Staleness::Bounded(1), 60_000),
        Some(CheckpointStore::new(
            root.clone(),
            2,
            CheckpointKey::from_bytes([1; 32]),
        )),
        60_000,
    );
    join(&addr, 0).await;
    join(&addr, 1).await;
    let mut version = 0;
    for clock in 0..4 {
        for w in 0..2 {
            version = push(&addr, w, clock, version).await.unwrap();
        }
    }
    assert_eq!(addr.send(CheckpointNow).await.unwrap(), Ok(Some(8)));
    let (v, weights) = addr.send(GetWeights).await.unwrap();
    assert_eq!(v, 8);
    // Crash: the actor goes away without a final checkpoint.
    arbiter.stop();

    let mut fresh = core(Staleness::Bounded(1), 60_000);
    let r = fresh.range();
    let store = CheckpointStore::new(root, 2, CheckpointKey::from_bytes([1; 32]));
    let (snap, skipped) = store
        .load_latest(fresh.layout_hash(), 0, (r.start, r.end))
        .unwrap()
        .unwrap();
    assert!(skipped.is_empty());
    fresh.restore(snap, 0).unwrap();
    let mut reference = core(Staleness::Bounded(1), 60_000);
    reference.join(0, 0);
    reference.join(1, 0);
    let (addr, arbiter) = start(fresh, Some(store), 60_000);
    let (v, resumed) = addr.send(GetWeights).await.unwrap();
    assert_eq!(v, 8);
    assert_eq!(bits(&resumed), bits(&weights));
    // Workers reconnect (their connections died with the shard) and rejoin at their restored clock 4, and the run
    // continues identically to an uninterrupted core fed the same pushes.
    for w in 0..2u32 {
        assert_eq!(join(&addr, w).await, 4);
    }
    let n = layout().len();
    for clock in 0..6u64 {
        for w in 0..2u32 {
            let f = gradient(n, w, clock);
            let p = tether_server::shard::Push {
                worker: w,
                clock,
                shard: 0,
                range: (0, n as u64),
                read_version: reference.version(),
                payload: &f,
            };
            reference.apply(&p, 0).unwrap();
            if clock >= 4 {
                let rv = reference.version() - 1;
                assert_eq!(push(&addr, w, clock, rv).await, Ok(reference.version()));
            }
        }
    }
    let (v, after) = addr.send(GetWeights).await.unwrap();
    assert_eq!(v, 12);
    assert_eq!(bits(&after), bits(reference.weights()));
    arbiter.stop();
}

#[actix_rt::test]
async fn a_standby_holds_back_outcomes_until_it_acknowledges_and_bad_standbys_are_refused() {
    use tether_server::actor::{Follow, GetLayoutHash, ReplicaLost, Subscribe, TakeOver};
    use tether_server::protocol::Input;
    use tether_server::replication::{self as replica, ReplicaError};
    const CONFIG: u64 = 7;
    let start_with_digest = || {
        ShardActor::new(core(Staleness::Unbounded, 60_000), None, 0, 60_000, None)
            .with_config_digest(CONFIG)
            .start_on_own_arbiter()
    };
    let (addr, arbiter) = start_with_digest();
    let layout_hash = addr.send(GetLayoutHash).await.unwrap();
    let subscribe = |config_digest, layout_hash| Subscribe {
        config_digest,
        layout_hash,
    };
    // Another configuration or layout: refused.
    for (c, l) in [(CONFIG + 1, layout_hash), (CONFIG, layout_hash ^ 1)] {
        let r = addr.send(subscribe(c, l)).await.unwrap();
        assert!(matches!(r, Err(ReplicaError::Mismatch(_))), "{:?}", r.err());
    }
    let mut sub = addr
        .send(subscribe(CONFIG, layout_hash))
        .await
        .unwrap()
        .unwrap();
    // One standby per shard.
    let again = addr.send(subscribe(CONFIG, layout_hash)).await.unwrap();
    assert!(matches!(again, Err(ReplicaError::Taken)));
    join(&addr, 0).await;
    // The push is applied at once, but its outcome waits for the standby's acknowledgement of its entry.
    let pushing = tokio::spawn({
        let addr = addr.clone();
        async move { push(&addr, 0, 0, 0).await }
    });
    let mut entries = Vec::new();
    while entries.len() < 2 {
        let bytes = tokio::time::timeout(Duration::from_secs(5), sub.log.recv())
            .await
            .unwrap()
            .unwrap();
        let e = replica::decode(&bytes).unwrap();
        if !matches!(e.input, Input::Tick { .. }) {
            entries.push(e);
        }
    }
    assert!(matches!(entries[0].input, Input::Hello { worker: 0, .. }));
    assert!(matches!(entries[1].input, Input::Push { .. }));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !pushing.is_finished(),
        "the outcome left before the standby had the push"
    );
    assert_eq!(
        addr.send(GetStats).await.unwrap().0,
        1,
        "applied at the primary"
    );
    sub.acked.send_replace(entries[1].seq);
    let outcome = tokio::time::timeout(Duration::from_secs(5), pushing)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outcome, Ok(1));
    // Once the standby is gone, nothing waits for it.
    addr.send(ReplicaLost(sub.link)).await.unwrap();
    drop(sub);
    assert_eq!(push(&addr, 0, 1, 1).await, Ok(2));
    arbiter.stop();
    // A standby that comes after workers joined and pushes were applied is seeded from the primary's image.
    let (late, arbiter) = start_with_digest();
    let l = late.send(GetLayoutHash).await.unwrap();
    join(&late, 0).await;
    for clock in 0..3u64 {
        assert_eq!(push(&late, 0, clock, clock).await, Ok(clock + 1));
    }
    let sub = late.send(subscribe(CONFIG, l)).await.unwrap().unwrap();
    let standby = || {
        ShardActor::new(core(Staleness::Unbounded, 60_000), None, 0, 60_000, None)
            .with_config_digest(CONFIG)
            .following()
            .start_on_own_arbiter()
    };
    let (seeded, seeded_arbiter) = standby();
    let (unseeded, unseeded_arbiter) = standby();
    // A node finding its role answers a peer's request: it holds no state yet (the designated primary leads).
    let r = unseeded.send(subscribe(CONFIG, l)).await.unwrap();
    assert!(
        matches!(r, Err(ReplicaError::NotLeading { seeded: false })),
        "{:?}",
        r.err()
    );
    // A bad image is refused and changes nothing; the primary's is adopted.
    let mut bad = sub.image.clone();
    bad.truncate(bad.len() / 2);
    let r = seeded
        .send(Follow {
            image: bad,
            seq: sub.seq,
        })
        .await
        .unwrap();
    assert!(matches!(r, Err(ReplicaError::Image(_))), "{r:?}");
    assert_eq!(seeded.send(GetWeights).await.unwrap().0, 0);
    seeded
        .send(Follow {
            image: sub.image.clone(),
            seq: sub.seq,
        })
        .await
        .unwrap()
        .unwrap();
    let (v, weights) = seeded.send(GetWeights).await.unwrap();
    assert_eq!((v, bits(&weights)), {
        let (v, w) = late.send(GetWeights).await.unwrap();
        (v, bits(&w))
    });
    // While it follows it tells a third node to wait, and serves no worker.
    let r = seeded.send(subscribe(CONFIG, l)).await.unwrap();
    assert!(
        matches!(r, Err(ReplicaError::NotLeading { seeded: true })),
        "{:?}",
        r.err()
    );
    // After a takeover it continues the primary's run: worker 0 rejoins at clock 3 and its next push applies.
    let (version, entries, _) = seeded.send(TakeOver).await.unwrap();
    assert_eq!((version, entries), (3, 0));
    assert_eq!(join(&seeded, 0).await, 3);
    assert_eq!(push(&seeded, 0, 3, 3).await, Ok(4));
    for a in [arbiter, seeded_arbiter, unseeded_arbiter] {
        a.stop();
    }
}
