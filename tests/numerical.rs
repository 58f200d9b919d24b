//! Numerical guard across real processes: one worker gets a NaN gradient at step 5 and a 1000x gradient at step 30
//! (`--inject`), the shards run with `--spike-factor 10`, and worker-side clipping is off so the spike reaches the
//! wire. The worker must refuse to push the NaN (and report it), the shards must reject the spike (reason
//! `norm_spike` in metrics and report), and the run must reach the undisturbed accuracy within one point.

mod support;

use std::time::{Duration, Instant};

use support::{free_tcp_addr, http_get, metric, num, run_undisturbed, Cluster, Spec};

fn spec() -> Spec {
    Spec {
        clip_norm: Some(0.0),
        ..Spec::default()
    }
}

#[test]
fn nan_and_spiked_gradients_are_refused_and_the_run_still_converges() {
    let (base_w0, _) = run_undisturbed(&spec(), &["--step-delay-ms", "10"]);
    let base = num(&base_w0, "final_test_accuracy");
    let c = Cluster::new(spec());
    let metrics_addr = free_tcp_addr().to_string();
    let n = c.spec.workers.to_string();
    let mut servers = vec![
        c.server(
            0,
            &[
                "--exit-after-workers",
                &n,
                "--report",
                "server-0.json",
                "--spike-factor",
                "10",
                "--metrics",
                &metrics_addr,
            ],
        ),
        c.server(
            1,
            &[
                "--exit-after-workers",
                &n,
                "--report",
                "server-1.json",
                "--spike-factor",
                "10",
            ],
        ),
    ];
    let mut w0 = c.worker(0, &["--report", "w0.json", "--step-delay-ms", "10"]);
    let mut w1 = c.worker(
        1,
        &[
            "--report",
            "w1.json",
            "--step-delay-ms",
            "10",
            "--inject",
            "nan@5",
            "--inject",
            // After the worker's own window is warm (16 norms): the guard judges a worker only then.
            "scale@30:1000",
        ],
    );
    // Scrape shard 0 while the workers run (bounded); keep the last answer.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline && (w0.alive() || w1.alive()) {
        if let Ok(text) = http_get(metrics_addr.parse().unwrap(), "/metrics") {
            last = text;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let spikes = metric(
        &last,
        r#"tether_updates_rejected_total{reason="norm_spike"}"#,
    );
    let reasons: Vec<&str> = last
        .lines()
        .filter(|l| l.starts_with("tether_updates_rejected_total{"))
        .collect();
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
    let r0 = c.report("w0.json");
    let r1 = c.report("w1.json");
    let shard_rejected: Vec<f64> = (0..2)
        .map(|k| num(&c.report(&format!("server-{k}.json")), "updates_rejected"))
        .collect();
    let acc = num(&r0, "final_test_accuracy");
    println!(
        "numerical guard: worker 1 skipped {} non-finite gradient(s); shards rejected {shard_rejected:?} \
         (shard 0: {reasons:?}); accuracy {acc:.4} vs {base:.4} undisturbed",
        num(&r1, "nonfinite_skipped")
    );
    assert_eq!(
        num(&r1, "nonfinite_skipped"),
        1.0,
        "the NaN gradient was not refused exactly once"
    );
    assert_eq!(num(&r0, "nonfinite_skipped"), 0.0);
    // The spike is rejected by both shards. Error feedback carries the spiked step's quantisation residual into
    // the worker's next push or two, which the guard may refuse as well: only norm spikes are ever rejected.
    assert!(
        spikes.unwrap_or(0.0) >= 1.0,
        "shard 0 counted no norm_spike rejection: {reasons:?}"
    );
    assert!(
        reasons
            .iter()
            .all(|l| l.contains("norm_spike") || l.ends_with(" 0")),
        "{reasons:?}"
    );
    let total: f64 = shard_rejected.iter().sum();
    assert!(
        shard_rejected.iter().all(|&r| (1.0..=4.0).contains(&r)),
        "rejections per shard: {shard_rejected:?} ({total})"
    );
    // The skipped and rejected rounds advanced the clock: both workers ran every step.
    assert_eq!(num(&r1, "steps"), c.steps_per_worker() as f64);
    assert!(
        acc >= base - 0.01,
        "accuracy {acc} fell more than 1 pt below the undisturbed {base}"
    );
}
