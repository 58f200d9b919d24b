//! Loss-spike rollback across real processes: two `tether-server` shards with `[rollback]` on in cluster.toml, one
//! `tether-worker --inject push@200:1000` (a push scaled 1000× past the clip). Both shards' JSON reports must show the
//! same single rollback (alarm round and restored round), the shard's `tether_rollbacks_total` must count it, and the
//! worker must end with an accuracy the spike would otherwise have destroyed (the in-process test in
//! `tests/rollback.rs` measures that contrast).

mod support;

use std::time::{Duration, Instant};

use support::{free_tcp_addr, http_get, metric, num, Cluster, Spec};

#[test]
fn binaries_roll_back_an_injected_spike_together_and_report_it() {
    let c = Cluster::new(Spec {
        shards: 2,
        workers: 1,
        ..Spec::default()
    });
    // This test's own cluster.toml: momentum SGD on the shards (Adam's normalisation would absorb a scaled push), and
    // the gradient-norm guard off (it would refuse the injected push before any spike).
    let servers: Vec<String> = c.servers.iter().map(|a| format!("\"{a}\"")).collect();
    let config = format!(
        "[cluster]\nservers = [{}]\nworkers = 1\nstaleness = 0\nworker_timeout_ms = 3000\n\
         [model]\nkind = \"mlp\"\nhidden = [64]\nseed = 42\n\
         [data]\ndataset = \"digits\"\n\
         [train]\nepochs = 10\nbatch = 32\neval_every = 0\n\
         [optimizer]\nkind = \"momentum\"\nlr = 0.05\nmomentum = 0.9\n\
         [checkpoint]\nevery_updates = 0\n\
         [rollback]\nenabled = true\nfactor = 10.0\nrounds = 2\nwindow = 16\nevery = 10\nkeep = 3\n\
         [guard]\nfactor = 0\nmax_norm = inf\n",
        servers.join(", ")
    );
    std::fs::write(c.path("cluster.toml"), config).unwrap();
    let metrics_addr = free_tcp_addr().to_string();
    let mut shards = vec![
        c.server(
            0,
            &[
                "--exit-after-workers",
                "1",
                "--report",
                "server-0.json",
                "--metrics",
                &metrics_addr,
            ],
        ),
        c.server(
            1,
            &["--exit-after-workers", "1", "--report", "server-1.json"],
        ),
    ];
    // A short delay per step keeps the run long enough for the metrics to be scraped after the rollback.
    let mut w = c.worker(
        0,
        &[
            "--report",
            "w0.json",
            "--inject",
            "push@200:1000",
            "--step-delay-ms",
            "3",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    while Instant::now() < deadline && w.alive() {
        if let Ok(text) = http_get(metrics_addr.parse().unwrap(), "/metrics") {
            last = text;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    w.wait_success(Duration::from_secs(60));
    for s in &mut shards {
        s.wait_success(Duration::from_secs(30));
    }
    let reports: Vec<_> = (0..2)
        .map(|k| c.report(&format!("server-{k}.json")))
        .collect();
    let logs: Vec<Vec<(u64, u64, u64)>> = reports
        .iter()
        .map(|r| serde_json::from_value(r["rollback_log"].clone()).unwrap())
        .collect();
    println!(
        "rollback logs {logs:?}, lost {}",
        num(&reports[0], "rounds_lost")
    );
    for (k, r) in reports.iter().enumerate() {
        assert_eq!(num(r, "rollbacks"), 1.0, "shard {k}");
        assert_eq!(num(r, "rollbacks_missed"), 0.0, "shard {k}");
        assert_eq!(logs[k].len(), 1);
        assert_eq!(logs[k][0].0, k as u64);
        let (alarm, restored) = (logs[k][0].1, logs[k][0].2);
        assert!(restored <= 200 && alarm > 200, "shard {k}: {logs:?}");
        assert_eq!(num(r, "rounds_lost"), (alarm + 1 - restored) as f64);
    }
    assert_eq!(
        (logs[0][0].1, logs[0][0].2),
        (logs[1][0].1, logs[1][0].2),
        "the shards rolled back to different rounds"
    );
    assert_eq!(
        metric(&last, "tether_rollbacks_total"),
        Some(1.0),
        "metrics: {}",
        last.lines()
            .filter(|l| l.contains("rollback"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let acc = num(&c.report("w0.json"), "final_test_accuracy");
    assert!(acc > 0.9, "accuracy {acc} after the rollback");
}
