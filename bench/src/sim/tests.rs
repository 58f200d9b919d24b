//! The simulator's tests: the per-step model's (unchanged) and one per mechanism of [`SyncModel`].

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
        SimConfig {
            compute_quantiles_s: vec![0.2],
            ..base()
        },
        SimConfig {
            compute_quantiles_s: vec![0.3, 0.2],
            ..base()
        },
        SimConfig {
            compute_quantiles_s: vec![0.1, f64::INFINITY],
            ..base()
        },
    ] {
        assert!(simulate(&cfg).is_err(), "{cfg:?}");
    }
}

#[test]
fn a_measured_distribution_is_drawn_from_its_quantiles() {
    use super::engine::inverse_cdf;
    let q = [0.1, 0.2, 0.6];
    assert_eq!(inverse_cdf(&q, 0.0), 0.1);
    assert!((inverse_cdf(&q, 0.25) - 0.15).abs() < 1e-12);
    assert!((inverse_cdf(&q, 0.75) - 0.4).abs() < 1e-12);
    assert_eq!(inverse_cdf(&q, 1.0), 0.6);
    // A point mass: every round computes 0.05 s (not `compute_s`), so 10 rounds of one worker with free links and
    // shards take 0.5 s.
    let r = simulate(&SimConfig {
        workers: 1,
        shards: 1,
        rounds: 10,
        compute_quantiles_s: vec![0.05, 0.05],
        ..base()
    })
    .unwrap();
    assert!((r.wall_s - 0.5).abs() < 1e-9, "{r:?}");
}

/// Local-step rounds with nothing else: BSP rounds, one cut per round.
fn rounds() -> SyncModel {
    SyncModel {
        local_steps: 16,
        ..SyncModel::per_step()
    }
}

#[test]
fn a_quorum_closes_rounds_without_the_slowest_worker_once_grace_passes() {
    // Worker 0 computes 0.3 s a round, the others 0.1 s; BSP waits for it every round.
    let cfg = SimConfig {
        workers: 4,
        staleness: Some(0),
        slow_worker: Some(3.0),
        rounds: 30,
        compute_s: 0.1,
        ..base()
    };
    let all = simulate_sync(&cfg, &rounds()).unwrap();
    assert!((all.round_p50_s - 0.3).abs() < 1e-6, "{all:?}");
    assert_eq!((all.quorum_closes, all.left_behind), (0, 0));
    // A quorum of 3: once the grace window (half the median round) passed after the third push, the round closes
    // without worker 0. Left behind, it is a laggard from then on (later rounds never wait for it, its late pushes
    // land in the open round), so the fast workers run at their own pace.
    let quorum = SyncModel {
        quorum: 3,
        grace_factor: 0.5,
        grace_max_s: 10.0,
        ..rounds()
    };
    let q = simulate_sync(&cfg, &quorum).unwrap();
    assert!(q.left_behind > 0 && q.quorum_closes > 0, "{q:?}");
    assert!((q.round_p50_s - 0.1).abs() < 1e-6, "{q:?}");
    // A grace window longer than the slow worker's lateness waits for it, as BSP does.
    let patient = simulate_sync(
        &cfg,
        &SyncModel {
            grace_factor: 100.0,
            ..quorum
        },
    )
    .unwrap();
    assert_eq!(patient.left_behind, 0, "{patient:?}");
    assert!((patient.round_p50_s - 0.3).abs() < 0.002, "{patient:?}");
}

#[test]
fn standbys_add_a_round_trip_to_every_reply() {
    // One worker, one shard, 1 ms one way, free CPU and links: each pull waits one more round trip (the standby's
    // log entry out, its acknowledgement back) before the reply leaves.
    let cfg = SimConfig {
        workers: 1,
        shards: 1,
        staleness: Some(0),
        latency_s: 1e-3,
        rounds: 20,
        ..base()
    };
    let plain = simulate_sync(&cfg, &rounds()).unwrap();
    let standby = simulate_sync(
        &cfg,
        &SyncModel {
            standbys: true,
            ..rounds()
        },
    )
    .unwrap();
    assert!(
        (standby.wall_s - plain.wall_s - 20.0 * 2e-3).abs() < 1e-9,
        "{plain:?} {standby:?}"
    );
    // The standby applies each push while the primary does (it is logged when the primary's apply starts), so a
    // costly apply adds no more than the round trip.
    let costly = SimConfig {
        apply_ns_per_param: 10.0, // 10 ms per push of 1M parameters
        ..cfg
    };
    let plain = simulate_sync(&costly, &rounds()).unwrap();
    let standby = simulate_sync(
        &costly,
        &SyncModel {
            standbys: true,
            ..rounds()
        },
    )
    .unwrap();
    let extra = (standby.wall_s - plain.wall_s) / 20.0;
    assert!((extra - 2e-3).abs() < 1e-9, "{extra}");
}

#[test]
fn two_shard_threads_divide_shard_bound_rounds_by_the_speedup() {
    // Eight workers push 4M parameters into one shard at 10 ns/param: 8 × 40 ms of shard CPU per 1 ms round.
    let cfg = SimConfig {
        workers: 8,
        shards: 1,
        params: 4_000_000,
        staleness: Some(0),
        rounds: 20,
        compute_s: 1e-3,
        apply_ns_per_param: 10.0,
        ..base()
    };
    let run = |threads, speedup_at_2| {
        simulate_sync(
            &cfg,
            &SyncModel {
                shard_threads: threads,
                speedup_at_2,
                ..rounds()
            },
        )
        .unwrap()
    };
    let one = run(1, 1.8);
    assert_eq!(one.limit, "shard cpu");
    assert!((one.round_p50_s - 0.321).abs() < 1e-3, "{one:?}");
    let ratio = one.round_p50_s / run(2, 1.8).round_p50_s;
    assert!(ratio > 1.77 && ratio < 1.8, "{ratio}");
    let ideal = one.round_p50_s / run(2, 2.0).round_p50_s;
    assert!(ideal > 1.97 && ideal <= 2.0, "{ideal}");
    // A range of one chunk runs on one thread whatever `shard_threads` says.
    let s = SyncModel {
        shard_threads: 16,
        ..rounds()
    };
    assert_eq!(s.speedup(65_536.0), 1.0);
    assert_eq!(s.speedup(4_000_000.0), 16.0);
}

#[test]
fn fewer_bytes_per_parameter_cut_link_bound_rounds() {
    // Eight workers into one shard at 1 Gbit/s: the shard's NIC carries every push and reply.
    let run = |bytes| {
        simulate_sync(
            &SimConfig {
                workers: 8,
                shards: 1,
                staleness: Some(0),
                link_bps: 1e9,
                push_bytes_per_param: bytes,
                pull_bytes_per_param: bytes,
                rounds: 20,
                compute_s: 1e-4,
                ..base()
            },
            &rounds(),
        )
        .unwrap()
    };
    // q4 with zstd against topk2 keep 16 on 4096-value blocks (`predict::topk2_bytes_per_param`).
    let (q4, topk2) = (run(0.55), run(0.1426));
    assert_eq!(q4.limit, "shard link");
    let ratio = q4.round_p50_s / topk2.round_p50_s;
    assert!(ratio > 3.0 && ratio < 0.55 / 0.1426 + 0.01, "{ratio}");
}

#[test]
fn traffic_within_a_host_skips_its_nic() {
    // Four workers push 4 MB each per round into one shard at 1 Gbit/s. On two hosts, workers 0 and 2 share the
    // shard's host, so its NIC carries half the pushes.
    let cfg = SimConfig {
        workers: 4,
        shards: 1,
        staleness: Some(0),
        link_bps: 1e9,
        push_bytes_per_param: 4.0,
        pull_bytes_per_param: 0.0,
        rounds: 20,
        ..base()
    };
    let own = simulate_sync(&cfg, &rounds()).unwrap();
    let two = simulate_sync(
        &cfg,
        &SyncModel {
            hosts: Some(2),
            ..rounds()
        },
    )
    .unwrap();
    let ratio = own.round_p50_s / two.round_p50_s;
    assert!(ratio > 1.8 && ratio < 2.05, "{own:?} {two:?}");
    // Placement as `tether-bench scale` makes it.
    let spec = crate::scale::ScaleSpec::quickstart(8, 64, 8);
    let real = crate::scale::Placement::new(&spec).unwrap();
    let map = engine::HostMap::new(64, 8, Some(8));
    assert_eq!(
        (map.worker, map.primary, map.standby),
        (real.worker, real.primary, real.standby)
    );
}

#[test]
fn an_outer_step_at_close_costs_one_dense_pass_per_round() {
    let cfg = SimConfig {
        workers: 8,
        shards: 1,
        params: 4_000_000,
        staleness: Some(0),
        rounds: 20,
        compute_s: 1e-3,
        apply_ns_per_param: 10.0,
        ..base()
    };
    let every = simulate_sync(&cfg, &rounds()).unwrap();
    let at_close = simulate_sync(
        &cfg,
        &SyncModel {
            outer_step: OuterStep::AtClose {
                push_ns_per_param: 0.5,
                step_ns_per_param: 10.0,
            },
            ..rounds()
        },
    )
    .unwrap();
    // 8 × 40 ms against 8 × 2 ms + 40 ms.
    assert!((at_close.round_p50_s - 0.057).abs() < 1e-3, "{at_close:?}");
    assert!(every.round_p50_s / at_close.round_p50_s > 5.0);
}

#[test]
fn free_resources_take_no_time() {
    let cfg = SimConfig {
        workers: 8,
        shards: 2,
        staleness: Some(0),
        link_bps: 1e9,
        apply_ns_per_param: 5.0,
        rounds: 10,
        ..base()
    };
    let sync = SyncModel {
        standbys: true,
        ..rounds()
    };
    let free = simulate_free(&cfg, &sync, Free::ALL).unwrap();
    assert!((free.wall_s - 0.1).abs() < 1e-9, "{free:?}");
    assert!(
        free.shard_cpu_util == 0.0 && free.shard_link_util == 0.0 && free.worker_link_util == 0.0
    );
    let slow = simulate_sync(&cfg, &sync).unwrap();
    assert!(slow.wall_s > 0.2, "{slow:?}");
}

#[test]
fn a_quorum_above_the_workers_is_refused() {
    let sync = SyncModel {
        quorum: 5,
        ..rounds()
    };
    assert!(simulate_sync(&base(), &sync).is_err());
    let sync = SyncModel {
        speedup_at_2: 2.5,
        ..rounds()
    };
    assert!(simulate_sync(&base(), &sync).is_err());
}
