//! Fault tests across real processes (release `tether-server` / `tether-worker`, certificates from keygen, loopback
//! QUIC): a worker killed with SIGKILL and restarted, a shard killed and resumed from its checkpoint, a worker cut
//! off by a packet-dropping UDP proxy and healed, a 3x straggler under SSP, and a seeded loop of random kills
//! (`TETHER_KILL_LOOP_N`, default 3). Every process is SIGKILLed when its test ends; every wait is bounded.
//! Figures are printed (run with `--nocapture` to see them).

mod support;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use support::{max_step_gap, num, run_undisturbed, serial, Cluster, Proc, Spec, UdpProxy};
use tether::common::testing::TestRng;

/// Per-step delay of every worker: stretches the digits run to ~3 s so faults land mid-run.
const STEP_DELAY: &str = "10";

fn spec() -> Spec {
    Spec::default()
}

/// Final test accuracy of the undisturbed run of `spec()` (computed once per test binary).
fn baseline_accuracy() -> f64 {
    static ACC: OnceLock<f64> = OnceLock::new();
    *ACC.get_or_init(|| {
        let (w0, shards) = run_undisturbed(&spec(), &["--step-delay-ms", STEP_DELAY]);
        let acc = num(&w0, "final_test_accuracy");
        println!(
            "undisturbed: accuracy {acc:.4}, wall {:.2} s, updates {:?}",
            num(&w0, "wall_seconds"),
            shards
                .iter()
                .map(|s| num(s, "updates_applied"))
                .collect::<Vec<_>>()
        );
        assert!(acc > 0.85, "undisturbed digits run reached only {acc}");
        acc
    })
}

fn worker_args(report: &str) -> Vec<&str> {
    vec!["--report", report, "--step-delay-ms", STEP_DELAY]
}

/// Starts every shard and workers 0 and 1, and SIGKILLs worker 1 a second in; returns the shards and worker 0.
fn start_and_kill_worker_1(c: &Cluster) -> (Vec<Proc>, Proc) {
    let servers = c.servers(&[]);
    let w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1-killed.json"));
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        w1.alive(),
        "worker 1 ended before the kill:\n{}",
        w1.log_tail(2000)
    );
    w1.kill9();
    (servers, w0)
}

#[test]
fn killed_worker_stalls_others_at_most_the_timeout_and_rejoins() {
    let _serial = serial();
    let base = baseline_accuracy();
    let c = Cluster::new(spec());
    let timeout_s = c.spec.worker_timeout_ms as f64 / 1000.0;
    let (mut servers, mut w0) = start_and_kill_worker_1(&c);
    let killed_at = Instant::now();
    // Restart after the eviction timeout, so the survivor's stall can only have ended through eviction.
    std::thread::sleep(Duration::from_millis(c.spec.worker_timeout_ms + 500));
    let mut w1b = c.worker(1, &worker_args("w1.json"));
    w0.wait_success(Duration::from_secs(90));
    w1b.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let r0 = c.report("w0.json");
    let r1 = c.report("w1.json");
    let gap = max_step_gap(&r0);
    let acc = num(&r0, "final_test_accuracy");
    let steps = c.steps_per_worker() as f64;
    let applied: Vec<f64> = (0..2)
        .map(|k| num(&c.report(&format!("server-{k}.json")), "updates_applied"))
        .collect();
    println!(
        "worker kill: survivor's longest stall {gap:.2} s (timeout {timeout_s} s), accuracy {acc:.4} vs {base:.4} \
         undisturbed, restarted worker ran {} steps, shard updates {applied:?}, total {:.1} s after the kill",
        num(&r1, "steps"),
        killed_at.elapsed().as_secs_f64()
    );
    // The stall ends with the eviction: timeout + one eviction tick (timeout/4) + scheduling slack.
    assert!(
        gap <= timeout_s * 1.25 + 1.0,
        "survivor stalled {gap:.2} s, timeout is {timeout_s} s"
    );
    assert!(
        acc >= base - 0.01,
        "accuracy {acc} fell more than 1 pt below the undisturbed {base}"
    );
    // The restarted worker trained a full run again, and the shards applied its pushes on top of the others'.
    assert_eq!(num(&r1, "steps"), steps);
    for a in applied {
        assert!(
            a >= 2.0 * steps,
            "shard applied {a} updates, survivor + restarted worker pushed {}",
            2.0 * steps
        );
    }
    assert!(servers
        .iter()
        .all(|s| s.log_text().matches("worker session started").count() >= 3));
}

#[test]
fn killed_server_resumes_from_checkpoint_and_loses_at_most_one_interval() {
    let _serial = serial();
    let base = baseline_accuracy();
    let c = Cluster::new(spec());
    let mut servers = c.servers(&[]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    std::thread::sleep(Duration::from_millis(1200));
    servers[0].kill9();
    let on_disk = c.checkpoint_versions(0);
    let resumed_from = *on_disk.last().expect("no checkpoint before the kill");
    std::thread::sleep(Duration::from_millis(500));
    let n = c.spec.workers.to_string();
    servers[0] = c.server(
        0,
        &[
            "--resume",
            "--exit-after-workers",
            &n,
            "--report",
            "server-0.json",
        ],
    );
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let log = servers[0].log_text();
    assert!(
        log.contains("resumed from checkpoint"),
        "restarted shard did not resume:\n{log}"
    );
    let after = num(&c.report("server-0.json"), "updates_applied") as u64;
    let final_version = resumed_from + after;
    assert_eq!(
        c.checkpoint_versions(0).last().copied(),
        Some(final_version),
        "final checkpoint version"
    );
    let pushed = c.steps_per_worker() * u64::from(c.spec.workers);
    let lost = pushed as i64 - final_version as i64;
    let r0 = c.report("w0.json");
    let acc = num(&r0, "final_test_accuracy");
    println!(
        "server kill: resumed from v{resumed_from}, applied {after} after the restart, final v{final_version}, \
         pushed {pushed}: lost {lost} updates (checkpoint every {}); accuracy {acc:.4} vs {base:.4}",
        c.spec.checkpoint_every
    );
    assert!(
        lost >= 0,
        "shard applied more updates ({final_version}) than were pushed ({pushed})"
    );
    // Lost: what was applied after the newest checkpoint plus what was in flight (≤ workers × (s + 1) pushes).
    let in_flight = u64::from(c.spec.workers) * 3;
    assert!(
        lost as u64 <= c.spec.checkpoint_every + in_flight,
        "lost {lost} updates"
    );
    assert!(
        acc >= base - 0.01,
        "accuracy {acc} fell more than 1 pt below the undisturbed {base}"
    );
}

#[test]
fn partitioned_worker_heals_and_ssp_bound_holds() {
    let _serial = serial();
    let c = Cluster::new(spec());
    // The worker is cut off from both shards (its link to the cluster fails), so both evict it. A worker cut off
    // from one shard only keeps heartbeating the other, which keeps waiting for it: per-shard membership makes the
    // survivors stall for such a partial partition's length, not the timeout (docs/protocol.md, "partial partitions").
    let proxies = [UdpProxy::start(c.servers[0]), UdpProxy::start(c.servers[1])];
    let via_proxy = c.write_config("cluster-proxy.toml", &[proxies[0].addr, proxies[1].addr]);
    let via_proxy = via_proxy.display().to_string();
    let mut servers = c.servers(&[]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(
        1,
        &[
            "--config",
            &via_proxy,
            "--report",
            "w1.json",
            "--step-delay-ms",
            STEP_DELAY,
        ],
    );
    std::thread::sleep(Duration::from_millis(800));
    proxies.iter().for_each(|p| p.set_cut(true));
    // Longer than the eviction timeout: the shards evict the silent worker and the other worker goes on.
    std::thread::sleep(Duration::from_millis(2 * c.spec.worker_timeout_ms));
    proxies.iter().for_each(|p| p.set_cut(false));
    let dropped: u64 = proxies
        .iter()
        .map(|p| p.dropped.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let r0 = c.report("w0.json");
    let r1 = c.report("w1.json");
    let s0 = c.report("server-0.json");
    let bound = 2.0;
    println!(
        "partition: {dropped} packets dropped; survivor's longest stall {:.2} s; cut-off worker {} steps; \
         shard 0 applied {} rejected {} max lead {}",
        max_step_gap(&r0),
        num(&r1, "steps"),
        num(&s0, "updates_applied"),
        num(&s0, "updates_rejected"),
        num(&s0, "max_clock_lead_observed")
    );
    assert!(
        dropped > 0,
        "the proxy dropped nothing: the partition did not happen"
    );
    assert_eq!(num(&r1, "steps"), c.steps_per_worker() as f64);
    let stall = max_step_gap(&r0);
    assert!(
        stall <= c.spec.worker_timeout_ms as f64 / 1000.0 * 1.25 + 1.0,
        "the survivor stalled {stall:.2} s"
    );
    for k in 0..2 {
        let s = c.report(&format!("server-{k}.json"));
        assert!(
            num(&s, "max_clock_lead_observed") <= bound,
            "shard {k}: {s}"
        );
    }
    // After the heal the worker's pushes count again: it was not silently refused for the rest of the run.
    for k in 0..2 {
        let refused = num(&c.report(&format!("server-{k}.json")), "updates_rejected");
        assert!(
            refused <= 3.0,
            "shard {k} refused {refused} pushes of the healed worker"
        );
    }
}

#[test]
fn straggler_3x_slower_keeps_everyone_within_the_bound() {
    let _serial = serial();
    let c = Cluster::new(spec());
    let mut servers = c.servers(&[]);
    let started = Instant::now();
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &["--report", "w1.json", "--step-delay-ms", "30"]);
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let wall = started.elapsed().as_secs_f64();
    let leads: Vec<f64> = (0..2)
        .map(|k| {
            num(
                &c.report(&format!("server-{k}.json")),
                "max_clock_lead_observed",
            )
        })
        .chain(
            ["w0.json", "w1.json"]
                .iter()
                .map(|f| num(&c.report(f), "max_clock_lead_observed")),
        )
        .collect();
    let (t0, t1) = (
        num(&c.report("w0.json"), "wall_seconds"),
        num(&c.report("w1.json"), "wall_seconds"),
    );
    println!("straggler: max clock leads (shard 0, shard 1, w0, w1) {leads:?}; fast worker {t0:.2} s, straggler {t1:.2} s, run {wall:.1} s");
    assert!(
        leads.iter().all(|&l| l <= 2.0),
        "clock lead beyond s = 2: {leads:?}"
    );
    // SSP couples the fast worker to the straggler: it cannot finish much earlier than s steps ahead allows.
    let straggler_step = t1 / c.steps_per_worker() as f64;
    assert!(
        t0 >= t1 - (2.0 + 2.0) * straggler_step - 0.5,
        "fast worker finished {t0:.2} s vs straggler {t1:.2} s"
    );
}

/// One fault round: start a cluster, kill a random process at a random time, restart it, run to the end.
fn kill_round(rng: &mut TestRng) -> Result<String, String> {
    let c = Cluster::new(spec());
    let n = c.spec.workers.to_string();
    let mut servers = c.servers(&[]);
    let mut workers: Vec<Proc> = (0..c.spec.workers)
        .map(|r| c.worker(r, &worker_args(&format!("w{r}.json"))))
        .collect();
    let at = 300 + rng.below(1200);
    let victim = rng.below(u64::from(c.spec.workers) + c.spec.shards as u64) as usize;
    let pause = rng.below(c.spec.worker_timeout_ms * 2);
    std::thread::sleep(Duration::from_millis(at));
    let what = if victim < workers.len() {
        if !workers[victim].alive() {
            return Err(format!("worker {victim} ended before the kill at {at} ms"));
        }
        workers[victim].kill9();
        std::thread::sleep(Duration::from_millis(pause));
        workers[victim] = c.worker(victim as u32, &worker_args(&format!("w{victim}.json")));
        format!("worker {victim} killed at {at} ms, restarted {pause} ms later")
    } else {
        let k = victim - workers.len();
        servers[k].kill9();
        std::thread::sleep(Duration::from_millis(pause));
        let report = format!("server-{k}.json");
        servers[k] = c.server(
            k,
            &["--resume", "--exit-after-workers", &n, "--report", &report],
        );
        format!("shard {k} killed at {at} ms, resumed {pause} ms later")
    };
    let finish = |p: &mut Proc, limit: u64| -> Result<(), String> {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.wait_success(Duration::from_secs(limit))
        }))
        .map_err(|_| format!("{what}: {} failed:\n{}", p.name, p.log_tail(1500)))
    };
    for w in &mut workers {
        finish(w, 90)?;
    }
    for s in &mut servers {
        finish(s, 30)?;
    }
    let acc = num(&c.report("w0.json"), "final_test_accuracy");
    if acc < 0.85 {
        return Err(format!("{what}: accuracy {acc}"));
    }
    Ok(format!("{what}: accuracy {acc:.4}"))
}

#[test]
fn random_kill_loop_survives() {
    let _serial = serial();
    let n: u64 = std::env::var("TETHER_KILL_LOOP_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .min(1000);
    let seed: u64 = std::env::var("TETHER_KILL_LOOP_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let mut rng = TestRng::new(seed);
    let mut failures = Vec::new();
    for i in 0..n {
        match kill_round(&mut rng) {
            Ok(line) => println!("kill loop {i}: survived: {line}"),
            Err(e) => {
                println!("kill loop {i}: FAILED: {e}");
                failures.push(e);
            }
        }
    }
    println!(
        "kill loop (seed {seed}): survived {}/{n}",
        n - failures.len() as u64
    );
    assert!(
        failures.is_empty(),
        "{} of {n} kill rounds failed:\n{}",
        failures.len(),
        failures.join("\n---\n")
    );
}

/// Regression (protocol cores): heartbeats were sent only while a pull waited, so a step longer than the timeout
/// got the worker evicted every step and half its pushes refused. Now a step of 3 × `worker_timeout` is no silence.
#[test]
fn a_step_three_times_the_timeout_finishes_with_every_push_applied() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 1,
        workers: 2,
        worker_timeout_ms: 1000,
        epochs: 1,
        batch: 128,
        checkpoint_every: 0,
        ..Spec::default()
    });
    let steps = c.steps_per_worker();
    let mut servers = c.servers(&[]);
    let mut w0 = c.worker(0, &["--report", "w0.json"]);
    let mut w1 = c.worker(1, &["--report", "w1.json", "--step-delay-ms", "3000"]);
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    servers[0].wait_success(Duration::from_secs(30));
    let s0 = c.report("server-0.json");
    let refused: Vec<f64> = ["w0.json", "w1.json"]
        .iter()
        .map(|r| num(&c.report(r), "pushes_refused"))
        .collect();
    let reconnects: Vec<f64> = ["w0.json", "w1.json"]
        .iter()
        .map(|r| num(&c.report(r), "reconnects"))
        .collect();
    println!(
        "slow step (3 s, timeout 1 s): shard applied {} of {} pushes, rejected {}, workers refused {refused:?}, \
         reconnects {reconnects:?}, slow worker's wall {:.1} s",
        num(&s0, "updates_applied"),
        2 * steps,
        num(&s0, "updates_rejected"),
        num(&c.report("w1.json"), "wall_seconds")
    );
    assert_eq!(num(&s0, "updates_applied"), (2 * steps) as f64);
    assert_eq!(num(&s0, "updates_rejected"), 0.0);
    assert_eq!(refused, vec![0.0, 0.0]);
    assert_eq!(reconnects, vec![0.0, 0.0]);
    assert!(
        !servers[0].log_text().contains("evicted silent workers"),
        "a slow worker was evicted:\n{}",
        servers[0].log_tail(3000)
    );
}

/// Regression (protocol cores): when a shard died, the replies still queued on the other links were read by the
/// next pull, one behind from then on, and the clock lead broke the bound. Shard 1 is killed with SIGKILL while the
/// BSP gate holds pulls parked on shard 0, then resumed; every pull must still answer its own request.
#[test]
fn killing_a_shard_while_pulls_are_parked_on_the_other_keeps_bsp() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 2,
        workers: 2,
        staleness: "0".into(),
        worker_timeout_ms: 1500,
        epochs: 4,
        batch: 128,
        checkpoint_every: 5,
        ..Spec::default()
    });
    let steps = c.steps_per_worker();
    let mut s0 = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    let mut s1 = c.server(
        1,
        &["--exit-after-workers", "2", "--report", "server-1.json"],
    );
    let mut w0 = c.worker(0, &["--report", "w0.json"]);
    // The slow worker keeps the fast one's pulls parked on both shards (BSP waits for its pushes).
    let mut w1 = c.worker(1, &["--report", "w1.json", "--step-delay-ms", "400"]);
    std::thread::sleep(Duration::from_millis(2500));
    assert!(w0.alive() && w1.alive(), "workers ended before the kill");
    s1.kill9();
    std::thread::sleep(Duration::from_millis(500));
    let mut s1b = c.server(
        1,
        &[
            "--resume",
            "--exit-after-workers",
            "2",
            "--report",
            "server-1.json",
        ],
    );
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    s0.wait_success(Duration::from_secs(30));
    s1b.wait_success(Duration::from_secs(30));
    let r: Vec<serde_json::Value> = ["w0.json", "w1.json"].iter().map(|n| c.report(n)).collect();
    let shard0 = c.report("server-0.json");
    let shard1 = c.report("server-1.json");
    println!(
        "shard kill under BSP: leads {:?}, stale replies dropped {:?}, reconnects {:?}, refused {:?}; shard 0 applied \
         {} of {}, shard 1 (resumed) lead {}",
        r.iter().map(|x| num(x, "max_clock_lead_observed")).collect::<Vec<_>>(),
        r.iter().map(|x| num(x, "stale_replies_dropped")).collect::<Vec<_>>(),
        r.iter().map(|x| num(x, "reconnects")).collect::<Vec<_>>(),
        r.iter().map(|x| num(x, "pushes_refused")).collect::<Vec<_>>(),
        num(&shard0, "updates_applied"),
        2 * steps,
        num(&shard1, "max_clock_lead_observed"),
    );
    for (i, x) in r.iter().enumerate() {
        assert_eq!(num(x, "steps"), steps as f64, "worker {i}");
        assert_eq!(
            num(x, "max_clock_lead_observed"),
            0.0,
            "worker {i} led under BSP"
        );
        assert_eq!(num(x, "pushes_refused"), 0.0, "worker {i}");
    }
    assert!(r.iter().map(|x| num(x, "reconnects")).sum::<f64>() >= 2.0);
    // The surviving shard applied every push exactly once (resends after the reconnect were duplicates).
    assert_eq!(num(&shard0, "updates_applied"), (2 * steps) as f64);
    assert_eq!(num(&shard0, "max_clock_lead_observed"), 0.0);
    assert_eq!(num(&shard1, "max_clock_lead_observed"), 0.0);
}

#[test]
fn with_quorum_rounds_a_killed_worker_stalls_nobody_for_the_eviction_timeout() {
    let _serial = serial();
    // BSP, two workers, a quorum of one, a long eviction timeout: the survivor's rounds close after the grace window
    // (half the median round time), not after the 4 s a plain BSP round waits for the eviction.
    let c = Cluster::new(Spec {
        staleness: "0".into(),
        worker_timeout_ms: 4000,
        cluster_extra: "quorum = 1\n".into(),
        ..spec()
    });
    let (mut servers, mut w0) = start_and_kill_worker_1(&c);
    // Restarted after the eviction timeout: a plain BSP survivor would stall until the eviction.
    std::thread::sleep(Duration::from_millis(4500));
    let mut w1b = c.worker(1, &worker_args("w1.json"));
    w0.wait_success(Duration::from_secs(90));
    w1b.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let r0 = c.report("w0.json");
    let gap = max_step_gap(&r0);
    let acc = num(&r0, "final_test_accuracy");
    println!("quorum 1 of 2, worker killed: survivor's longest stall {gap:.2} s (eviction timeout 4 s), accuracy {acc:.4}");
    assert!(
        gap < 2.0,
        "survivor stalled {gap:.2} s: it waited for the eviction"
    );
    assert!(acc > 0.85, "accuracy {acc}");
}

#[test]
fn a_worker_beyond_the_configured_count_joins_mid_run_and_finishes_alone_after_the_others_leave() {
    let _serial = serial();
    // Two configured workers, room for a third; BSP rounds at a quorum of two.
    let c = Cluster::new(Spec {
        staleness: "0".into(),
        cluster_extra: "max_workers = 3\nquorum = 2\n".into(),
        ..spec()
    });
    // The joiner's certificate comes from the cluster's CA after the cluster was set up, as an operator adds one.
    for rank in ["2", "3"] {
        let out = std::process::Command::new(&support::bins().server)
            .args(["keygen", "issue", "--ca"])
            .arg(c.path("certs/ca"))
            .arg("--out")
            .arg(c.path("certs"))
            .args(["--worker", rank])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "keygen issue: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut servers: Vec<Proc> = (0..c.spec.shards)
        .map(|k| {
            c.server(
                k,
                &[
                    "--exit-after-workers",
                    "3",
                    "--report",
                    &format!("server-{k}.json"),
                ],
            )
        })
        .collect();
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    std::thread::sleep(Duration::from_millis(800));
    assert!(
        w0.alive() && w1.alive(),
        "the configured workers ended before the join"
    );
    let mut w2 = c.worker(2, &worker_args("w2.json"));
    // A rank beyond max_workers, with a valid certificate, is refused with a message naming the limit.
    let mut w3 = c.worker(3, &worker_args("w3.json"));
    w3.wait_failure(Duration::from_secs(30));
    assert!(w3.log_text().contains("may join"), "{}", w3.log_tail(1000));
    for w in [&mut w0, &mut w1, &mut w2] {
        w.wait_success(Duration::from_secs(120));
    }
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let steps: Vec<f64> = ["w0.json", "w1.json", "w2.json"]
        .iter()
        .map(|r| num(&c.report(r), "steps"))
        .collect();
    let applied: Vec<f64> = (0..2)
        .map(|k| num(&c.report(&format!("server-{k}.json")), "updates_applied"))
        .collect();
    let acc = num(&c.report("w0.json"), "final_test_accuracy");
    let loss2 = num(&c.report("w2.json"), "final_train_loss");
    println!(
        "elastic join: steps {steps:?}, shard updates {applied:?}, rank 0's accuracy {acc:.4}, joiner's final \
         training loss {loss2:.3}"
    );
    // Every worker ran its whole run (the joiner alone at the end: the quorum shrank with the goodbyes), and every
    // push of all three is in the shards.
    let total: f64 = steps.iter().sum();
    assert!(steps.iter().all(|s| *s == steps[0]), "{steps:?}");
    for a in applied {
        assert!(a >= total, "shard applied {a} updates of {total} pushed");
    }
    assert!(acc > 0.85, "rank 0's accuracy {acc}");
    assert!(
        loss2 < 0.5,
        "the joiner trained on the shared weights: final training loss {loss2}"
    );
    assert!(servers
        .iter()
        .all(|s| s.log_text().matches("worker session started").count() >= 3));
}

#[test]
fn a_shard_killed_for_good_fails_over_to_its_standby_without_losing_an_applied_update() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        standbys: true,
        ..spec()
    });
    let n = c.spec.workers.to_string();
    // Primaries and standbys alike exit once both workers finished, each writing its report.
    let _witness = c.witness();
    let mut servers = c.servers(&[]);
    let mut standbys: Vec<Proc> = (0..c.spec.shards)
        .map(|k| {
            c.standby(
                k,
                &[
                    "--exit-after-workers",
                    &n,
                    "--report",
                    &format!("standby-{k}.json"),
                ],
            )
        })
        .collect();
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        w0.alive() && w1.alive(),
        "the workers ended before the kill"
    );
    // Shard 0's primary dies for good; nobody starts it again.
    servers[0].kill9();
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    standbys[0].wait_success(Duration::from_secs(30));
    servers[1].wait_success(Duration::from_secs(30));
    standbys[1].wait_success(Duration::from_secs(30));
    let (r0, r1) = (c.report("w0.json"), c.report("w1.json"));
    let steps = num(&r0, "steps") + num(&r1, "steps");
    let took_over = c.report("standby-0.json");
    let survivor = c.report("server-1.json");
    let (applied0, applied1) = (
        num(&took_over, "updates_applied"),
        num(&survivor, "updates_applied"),
    );
    let acc = num(&r0, "final_test_accuracy");
    println!(
        "shard 0 killed for good: standby took over; applied {applied0} (shard 1: {applied1}) for {steps} steps, \
         accuracy {acc:.4}, longest stall {:.2} s",
        max_step_gap(&r0)
    );
    assert!(
        standbys[0].log_text().contains("standby took over"),
        "the standby never took over:\n{}",
        standbys[0].log_tail(3000)
    );
    // Every step pushed once to each shard; every push applied exactly once, before or after the takeover.
    assert_eq!(applied1, steps, "shard 1 lost or doubled an update");
    assert_eq!(
        applied0, steps,
        "the standby lost or doubled an update the primary applied"
    );
    assert!(acc > 0.85, "accuracy {acc}");
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_restarted_primary_is_seeded_by_the_standby_that_took_over_and_takes_over_in_turn() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        standbys: true,
        epochs: 8,
        ..spec()
    });
    let n = c.spec.workers.to_string();
    let exit_args = |report: &str| -> Vec<String> {
        vec![
            "--exit-after-workers".into(),
            n.clone(),
            "--report".into(),
            report.into(),
        ]
    };
    let (a0, s0, s1) = (
        exit_args("server-0.json"),
        exit_args("standby-0.json"),
        exit_args("standby-1.json"),
    );
    let _witness = c.witness();
    let mut servers = c.servers(&[]);
    let mut standby0 = c.standby(0, &strs(&s0));
    let mut standby1 = c.standby(1, &strs(&s1));
    // Slower steps than the other tests: two failovers and a re-seeding must land while the workers train.
    let slow = |report: &'static str| vec!["--report", report, "--step-delay-ms", "100"];
    let mut w0 = c.worker(0, &slow("w0.json"));
    let mut w1 = c.worker(1, &slow("w1.json"));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w0.log_text().contains("progress") {
        assert!(
            w0.alive() && Instant::now() < deadline,
            "worker 0 never trained:\n{}",
            w0.log_tail(3000)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        w0.alive() && w1.alive(),
        "the workers ended before the kill"
    );
    // Shard 0's primary dies; its standby takes over. The primary's process comes back a second later with the same
    // flags, finds the node that took over leading, and is seeded from its state image.
    servers[0].kill9();
    std::thread::sleep(Duration::from_millis(1000));
    let mut again = c.server(0, &strs(&a0));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !again.log_text().contains("seeded from the primary's image") {
        assert!(
            again.alive(),
            "the restarted primary died:\n{}",
            again.log_tail(3000)
        );
        assert!(
            Instant::now() < deadline,
            "the restarted primary was never seeded:\n{}\nstandby:\n{}",
            again.log_tail(3000),
            standby0.log_tail(3000)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        w0.alive() || w1.alive(),
        "the workers ended before the second kill"
    );
    // Now the node that took over dies for good: the restarted primary takes over in turn.
    standby0.kill9();
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    again.wait_success(Duration::from_secs(30));
    servers[1].wait_success(Duration::from_secs(30));
    standby1.wait_success(Duration::from_secs(30));
    let (r0, r1) = (c.report("w0.json"), c.report("w1.json"));
    let steps = num(&r0, "steps") + num(&r1, "steps");
    let (applied0, applied1) = (
        num(&c.report("server-0.json"), "updates_applied"),
        num(&c.report("server-1.json"), "updates_applied"),
    );
    let acc = num(&r0, "final_test_accuracy");
    println!(
        "two failovers of shard 0 (primary, then the standby that took over): applied {applied0} (shard 1: \
         {applied1}) for {steps} steps, accuracy {acc:.4}, longest stall {:.2} s",
        max_step_gap(&r0)
    );
    assert!(
        again.log_text().contains("standby took over"),
        "the restarted primary never took over:\n{}",
        again.log_tail(3000)
    );
    // Every step pushed once to each shard; every push applied exactly once across three nodes' lives.
    assert_eq!(applied1, steps, "shard 1 lost or doubled an update");
    assert_eq!(
        applied0, steps,
        "shard 0 lost or doubled an update across two failovers"
    );
    assert!(acc > 0.85, "accuracy {acc}");
}

/// Threads that spin until dropped: two of them, with the cluster's processes, keep both cores of a 2-core machine
/// busy.
struct CpuLoad {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<u64>>,
}

impl CpuLoad {
    fn start(threads: usize) -> CpuLoad {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut spins = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        spins = std::hint::black_box(spins.wrapping_add(1));
                    }
                    spins
                })
            })
            .collect();
        CpuLoad { stop, threads }
    }
}

impl Drop for CpuLoad {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// With both cores kept busy by two spinning threads besides the cluster (one shard with its standby and the witness,
/// two workers), the fence never moves the lease off a live primary: no step-down, no takeover, one term in the
/// history. `TETHER_FAILOVER_MS` sets `cluster.failover_ms` (default 1000, the config's default), to measure how low
/// it can go before load causes false takeovers (`scripts/false-takeovers.sh` sweeps it).
#[test]
fn no_false_takeover_under_full_cpu_load() {
    let _serial = serial();
    let failover: u64 = std::env::var("TETHER_FAILOVER_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let c = Cluster::new(Spec {
        shards: 1,
        standbys: true,
        epochs: 60,
        cluster_extra: format!("failover_ms = {failover}\n"),
        ..spec()
    });
    let t0 = Instant::now();
    let load = CpuLoad::start(2);
    let _witness = c.witness();
    let history = |n: &str| c.path(n).display().to_string();
    let (h0, h1) = (history("primary.history"), history("standby.history"));
    let mut primary = c.server(0, &["--exit-after-workers", "2", "--history", &h0]);
    let mut standby = c.standby(
        0,
        &[
            "--exit-after-workers",
            "2",
            "--history",
            &h1,
            "--report",
            "standby-0.json",
        ],
    );
    let started = Instant::now();
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    w0.wait_success(Duration::from_secs(240));
    w1.wait_success(Duration::from_secs(240));
    let loaded_for = started.elapsed().as_secs_f64();
    drop(load);
    primary.wait_success(Duration::from_secs(30));
    standby.wait_success(Duration::from_secs(30));
    eprintln!(
        "start {:.1} s, workers {loaded_for:.1} s, shard nodes done {:.1} s",
        (started - t0).as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    let (plog, slog) = (primary.log_text(), standby.log_text());
    let step_downs = plog.matches("lease ran out: stepping down").count()
        + slog.matches("lease ran out: stepping down").count();
    let leases_won = plog.matches("lease won").count() + slog.matches("lease won").count();
    let takeovers = slog.matches("standby took over").count();
    let mut terms = std::collections::BTreeSet::new();
    let mut applied_by = std::collections::BTreeMap::<String, u64>::new();
    for path in [&h0, &h1] {
        for line in std::fs::read_to_string(path).unwrap_or_default().lines() {
            let v: serde_json::Value = serde_json::from_str(line).expect("a history line");
            terms.insert(v["term"].as_u64().unwrap());
            *applied_by
                .entry(v["node"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    let r0 = c.report("w0.json");
    println!(
        "failover_ms {failover}, {loaded_for:.1} s under full load: {leases_won} lease(s) won, {step_downs} \
         step-down(s), {takeovers} takeover(s), terms {terms:?}, applied by {applied_by:?}, longest worker stall \
         {:.2} s",
        max_step_gap(&r0)
    );
    assert_eq!(takeovers, 0, "the standby took over from a live primary");
    // The primary waits for its standby to hold the last goodbye before it exits: the standby counts both workers
    // itself and ends on that, not on a SIGTERM or a takeover after its primary left.
    assert!(
        slog.contains("all workers finished"),
        "the standby did not see both workers finish:\n{}",
        standby.log_tail(2000)
    );
    assert_eq!(step_downs, 0, "a live primary lost its lease under load");
    assert_eq!(terms.len(), 1, "more than one term served: {terms:?}");
    assert_eq!(
        applied_by.keys().map(String::as_str).collect::<Vec<_>>(),
        ["primary"],
        "a node other than the primary applied pushes"
    );
}

/// A standby killed for good stalls its primary no longer than the detection bound: the primary holds outcomes back
/// until the follower is declared dead (no acknowledgement for `failover_ms`) and a majority recorded that it serves
/// alone (a fence round, a quarter lease), then serves on without losing an update.
/// Waits (bounded) until `standby` follows its primary's log.
fn wait_following(standby: &Proc) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !standby.log_text().contains("following its log") {
        assert!(
            Instant::now() < deadline,
            "the standby never followed:\n{}",
            standby.log_tail(3000)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_standby_stalls_its_primary_no_longer_than_the_detection_bound() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 1,
        standbys: true,
        epochs: 40,
        ..spec()
    });
    let failover_s = 1.0; // cluster.failover_ms's default
    let _witness = c.witness();
    let mut primary = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    let mut standby = c.standby(0, &[]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    // Kill it once it follows the log (seeded) and the workers train: bounded waits.
    wait_following(&standby);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        w0.alive() && w1.alive(),
        "the workers ended before the kill"
    );
    standby.kill9();
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    primary.wait_success(Duration::from_secs(30));
    let (r0, r1) = (c.report("w0.json"), c.report("w1.json"));
    let steps = num(&r0, "steps") + num(&r1, "steps");
    let applied = num(&c.report("server-0.json"), "updates_applied");
    let stall = max_step_gap(&r0).max(max_step_gap(&r1));
    println!(
        "standby killed for good: longest worker stall {stall:.2} s (failover_ms {failover_s} s), applied \
         {applied} for {steps} steps"
    );
    assert!(
        primary
            .log_text()
            .contains("serving without one once the fence records it")
            || primary.log_text().contains("serving without a standby"),
        "the primary never noticed its standby was gone:\n{}",
        primary.log_tail(3000)
    );
    assert_eq!(applied, steps, "the primary lost or doubled an update");
    // The bound: failover_ms to declare the follower dead, a quarter lease for the fence's record, plus scheduling
    // on a loaded 2-core machine.
    assert!(
        stall <= 2.0 * failover_s,
        "a dead standby stalled the workers {stall:.2} s, beyond 2 x failover_ms"
    );
}

/// A standby that stops reading and acknowledging the log (SIGSTOP: stuck but reachable, its connection still up) is
/// dropped by its primary within the failure bound: the workers stall no longer than with a dead standby, every
/// update is applied once, and the primary keeps its lease.
#[test]
fn a_standby_that_stops_acknowledging_is_dropped_within_the_detection_bound() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        shards: 1,
        standbys: true,
        epochs: 40,
        ..spec()
    });
    let failover_s = 1.0; // cluster.failover_ms's default
    let _witness = c.witness();
    let mut primary = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    let standby = c.standby(0, &[]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    wait_following(&standby);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        w0.alive() && w1.alive(),
        "the workers ended before the stop"
    );
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill")
            .args([sig, &standby.pid().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} failed");
    };
    signal("-STOP");
    std::thread::sleep(Duration::from_secs(5));
    signal("-CONT");
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    primary.wait_success(Duration::from_secs(30));
    let (r0, r1) = (c.report("w0.json"), c.report("w1.json"));
    let steps = num(&r0, "steps") + num(&r1, "steps");
    let applied = num(&c.report("server-0.json"), "updates_applied");
    let stall = max_step_gap(&r0).max(max_step_gap(&r1));
    let log = primary.log_text();
    println!(
        "standby stopped for 5 s: longest worker stall {stall:.2} s (failover_ms {failover_s} s), applied {applied} \
         for {steps} steps"
    );
    assert!(
        log.contains("stopped acknowledging") || log.contains("serving without"),
        "the primary never dropped its stuck standby:\n{}",
        primary.log_tail(3000)
    );
    assert!(
        !log.contains("no longer serving"),
        "a stuck standby deposed the primary:\n{}",
        primary.log_tail(3000)
    );
    assert_eq!(applied, steps, "the primary lost or doubled an update");
    assert!(
        stall <= 2.0 * failover_s,
        "a stuck standby stalled the workers {stall:.2} s, beyond 2 x failover_ms"
    );
}
