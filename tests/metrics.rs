//! Metrics contract: scrape `--metrics` of a real shard and a real worker during a run (HTTP GET /metrics over
//! loopback TCP) and check the docs/design.md §6 names are there with sane values.

mod support;

use std::time::{Duration, Instant};

use support::{free_tcp_addr, http_get, metric, Cluster, Spec};

#[test]
fn server_and_worker_metrics_carry_the_contract_names_with_sane_values() {
    let c = Cluster::new(Spec {
        checkpoint_every: 20,
        ..Spec::default()
    });
    let (saddr, waddr) = (free_tcp_addr(), free_tcp_addr());
    let (s, w) = (saddr.to_string(), waddr.to_string());
    let n = c.spec.workers.to_string();
    let mut servers = vec![
        c.server(0, &["--exit-after-workers", &n, "--metrics", &s]),
        c.server(1, &["--exit-after-workers", &n]),
    ];
    let mut w0 = c.worker(0, &["--metrics", &w, "--step-delay-ms", "10"]);
    let mut w1 = c.worker(1, &["--step-delay-ms", "10"]);
    // Scrape until the shard has applied updates and written a checkpoint while both workers are live (bounded).
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut server_text, mut worker_text) = (String::new(), String::new());
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        let (Ok(st), Ok(wt)) = (http_get(saddr, "/metrics"), http_get(waddr, "/metrics")) else {
            continue;
        };
        let ready = metric(&st, "tether_updates_applied_total").unwrap_or(0.0) >= 60.0
            && metric(&st, "tether_checkpoint_last_version").unwrap_or(0.0) > 0.0
            && metric(&wt, "tether_worker_steps_total").unwrap_or(0.0) >= 10.0;
        (server_text, worker_text) = (st, wt);
        if ready {
            break;
        }
    }
    println!("--- shard 0 metrics ---\n{server_text}\n--- worker 0 metrics ---\n{worker_text}");
    let get =
        |text: &str, name: &str| metric(text, name).unwrap_or_else(|| panic!("no sample {name}"));
    assert!(get(&server_text, "tether_updates_applied_total") >= 60.0);
    assert_eq!(get(&server_text, "tether_workers_live"), 2.0);
    let wire = get(&server_text, r#"tether_bytes_received_total{kind="wire"}"#);
    let fp32 = get(&server_text, r#"tether_bytes_received_total{kind="fp32"}"#);
    assert!(
        wire > 0.0 && fp32 / wire > 4.0,
        "q4 should be >4x smaller than fp32: wire {wire} fp32 {fp32}"
    );
    let applied = get(&server_text, "tether_updates_applied_total");
    assert_eq!(
        get(&server_text, "tether_staleness_count"),
        applied,
        "one staleness sample per applied update"
    );
    assert!(get(&server_text, "tether_staleness_sum") >= 0.0);
    assert!(get(&server_text, "tether_pull_wait_seconds_count") > 0.0);
    assert!(get(&server_text, "tether_checkpoint_last_version") > 0.0);
    let ck = get(&server_text, "tether_checkpoint_seconds");
    assert!(ck > 0.0 && ck < 10.0, "checkpoint seconds {ck}");
    let steps = get(&worker_text, "tether_worker_steps_total");
    assert!(steps >= 10.0);
    assert!((get(&worker_text, "tether_worker_step_seconds_count") - steps).abs() <= 1.0);
    let loss = get(&worker_text, "tether_worker_loss");
    assert!(loss.is_finite() && loss > 0.0 && loss < 10.0, "loss {loss}");
    assert!(
        get(
            &worker_text,
            r#"tether_worker_bytes_pushed_total{kind="wire"}"#
        ) > 0.0
    );
    w0.wait_success(Duration::from_secs(90));
    w1.wait_success(Duration::from_secs(90));
    for s in &mut servers {
        s.wait_success(Duration::from_secs(30));
    }
}
