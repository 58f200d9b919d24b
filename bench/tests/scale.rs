//! The CI-sized many-worker run: 32 worker processes and 4 shards, each with a standby, and the witness, spread over
//! 8 network-namespace hosts, training the quickstart's MLP with the quickstart's sync and a quorum of 3/4, while a
//! random worker or shard node is SIGKILLed every 5 s and started again. It must complete (every worker finishes,
//! every shard node exits 0 by itself), learn, keep each worker within the memory of its share of the data, and put
//! traffic on every host's link. Without Fashion-MNIST it trains on the embedded digits for 1,200 epochs. Needs root (`ip netns`); without it the test says so and passes unless
//! `TETHER_REQUIRE_NETNS=1` (set in CI) makes that a failure. `TETHER_TEST_KEEP_LOGS=DIR` keeps the run's folder.

use std::path::{Path, PathBuf};

use tether_bench::netns::is_root;
use tether_bench::scale::{run, Nemesis, ScaleSpec};

/// The folder holding the binaries `cargo test` built beside this test.
fn bins() -> PathBuf {
    let me = std::env::current_exe().expect("current_exe");
    let dir = me
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf();
    for b in ["tether-server", "tether-worker"] {
        assert!(
            dir.join(b).exists(),
            "{} is missing: build the workspace's binaries",
            dir.join(b).display()
        );
    }
    dir
}

#[test]
fn thirty_two_workers_and_four_shards_with_standbys_on_eight_hosts_complete_under_kills() {
    if !is_root() {
        assert!(
            std::env::var("TETHER_REQUIRE_NETNS").is_err(),
            "TETHER_REQUIRE_NETNS is set but this is not root"
        );
        eprintln!("skipped: the many-worker run needs root");
        return;
    }
    let fashion = Path::new("/usr/share/datasets/fashion-mnist").is_dir()
        && std::env::var_os("TETHER_DATA_DIR").is_none();
    let mut spec = ScaleSpec::quickstart(8, 32, 4);
    // The digits give each of 32 workers 45 rows (2 steps of 16 an epoch): 1,200 epochs are about 150 rounds, 30 to
    // 60 s here under the kills, so that several kills every 5 s fall inside training (at 800 epochs, one run ended
    // at the second kill; 2,400 took 124 s of the 170 s limit).
    spec.epochs = if fashion { 2 } else { 1200 };
    spec.dataset = if fashion { "fashion-mnist" } else { "digits" }.into();
    spec.nemesis = Nemesis::Kill { every_s: 5.0 };
    // 41 processes share the machine's cores: a lease of 3 s rides out a start-up where every worker loads its data
    // at once (at 1 s, leases were seen lost under a parallel build; the run is about completing under kills).
    spec.failover_ms = 3000;
    spec.limit_s = 170.0;
    let temp = tempfile::tempdir().expect("temp dir");
    let dir = match std::env::var_os("TETHER_TEST_KEEP_LOGS") {
        Some(keep) => PathBuf::from(keep).join("scale"),
        None => temp.path().to_path_buf(),
    };
    let report = run(&spec, &bins(), &dir).expect("the run");
    println!("{}", report.text());
    assert!(
        report.completed,
        "the run did not complete:\n{}",
        report.text()
    );
    assert!(
        report.events.iter().any(|(_, e)| e.starts_with("SIGKILL")),
        "no process was killed:\n{}",
        report.text()
    );
    let floor = if fashion { 0.70 } else { 0.85 };
    assert!(
        report.accuracy >= floor,
        "rank 0 at {} < {floor}:\n{}",
        report.accuracy,
        report.text()
    );
    // A worker holds its share of the training set (and rank 0 the test set): tens of MiB, not the ~200 MB of
    // a whole Fashion-MNIST in f32.
    let limit = 50 * 1024 * 1024;
    assert!(
        report.worker_peak_rss[1] > 0 && report.worker_peak_rss[1] <= limit,
        "a worker peaked at {} bytes:\n{}",
        report.worker_peak_rss[1],
        report.text()
    );
    assert!(
        report.links.iter().all(|l| l.sent > 0 && l.received > 0),
        "a host link carried nothing:\n{}",
        report.text()
    );
    assert!(
        report.rounds >= 2.0 && report.round_s[0] > 0.0,
        "{}",
        report.text()
    );
    for k in 0..4 {
        for node in [format!("s{k}"), format!("b{k}")] {
            let u = &report.shard_nodes[&node];
            assert!(u.cpu_s > 0.0 && u.peak_rss > 0, "{node}: {u:?}");
        }
    }
}
