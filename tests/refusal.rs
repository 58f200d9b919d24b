//! Permanent TLS refusals end a worker at once, naming the refusal and the file to fix, and the shard logs the
//! refused handshake with the peer's address at its default level: a worker whose bundle is another cluster's (it
//! refuses the shard's certificate: unknown CA) and a worker whose certificate is revoked (the shard refuses it),
//! while a transient failure is still retried until the reconnect deadline. A real shard and real workers in one
//! process, on loopback.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether::common::config::{Config, DatasetKind};
use tether::common::net::{certificate_serial, RefusedBy, TlsFiles};
use tether::common::pki::{format_serial, generate_dev};
use tether::server::node::{start_shard, ShardOptions};
use tether::worker::data::load_configured as load_data;
use tether::worker::{prepare_worker, WorkerError, WorkerOptions};
use tether::{block_on_system, loopback_servers};

/// How long a refused worker may take to give up: far less than its reconnect deadline.
const PROMPT: Duration = Duration::from_secs(15);

/// Everything logged in this test process, as the shard's default subscriber would print it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        // A poisoned lock only means a writer panicked mid-line; the bytes are still there.
        let bytes = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;

    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// Runs worker `rank` with `tls` against the shards in `cfg`, giving up on an unreachable shard after `deadline`,
/// and returns its error and how long it took to get it.
async fn failed_worker(
    cfg: &Config,
    rank: u32,
    tls: TlsFiles,
    data: &(
        Arc<tether::worker::data::Dataset>,
        Arc<tether::worker::data::Dataset>,
    ),
    deadline: Duration,
) -> (WorkerError, Duration) {
    let opts = WorkerOptions {
        rank,
        config: cfg.clone(),
        servers: cfg.cluster.servers.clone(),
        server_names: vec!["localhost".to_string()],
        tls,
        train: data.0.clone(),
        share: None,
        test: None,
        progress: None,
        faults: Vec::new(),
        metrics: None,
        reconnect_deadline: deadline,
        step_delay: Duration::ZERO,
        straggle: None,
        model: None,
        colocated: 1,
        history: None,
    };
    let started = Instant::now();
    let prepared = prepare_worker(opts).expect("worker prepares");
    match tokio::time::timeout(PROMPT, prepared.run()).await {
        Ok(Err(e)) => (e, started.elapsed()),
        Ok(Ok(_)) => panic!("rank {rank} trained"),
        Err(_) => panic!("rank {rank} still retrying after {PROMPT:?}"),
    }
}

#[test]
fn a_refused_tls_identity_stops_the_worker_at_once_and_the_shard_logs_it() {
    let log = Captured::default();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
        .with_ansi(false)
        .with_writer(log.clone())
        .init();
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    generate_dev(&certs, &[], 1, 2).unwrap();
    let foreign = dir.path().join("foreign");
    generate_dev(&foreign, &[], 1, 1).unwrap();

    let mut cfg = Config::with_servers(loopback_servers(1));
    cfg.cluster.workers = 2;
    cfg.cluster.tls_dir = certs.clone();
    cfg.data.dataset = DatasetKind::Digits;
    cfg.data.path = PathBuf::new();
    cfg.checkpoint.dir = dir.path().join("checkpoints");
    cfg.checkpoint.every_updates = 0;
    // Rank 1's certificate is from this cluster's CA, but revoked.
    let revoked = TlsFiles::for_worker(&certs, 1).unwrap();
    cfg.cluster.revoked = vec![format_serial(
        &certificate_serial(&revoked.cert[0]).unwrap(),
    )];
    let (train, test, _) = load_data(&mut cfg).unwrap();
    let data = (Arc::new(train), Arc::new(test));
    let other_ca = TlsFiles::for_worker(&foreign, 0).unwrap();
    let (other_ca_paths, revoked_paths) = (other_ca.paths.clone(), revoked.paths.clone());

    // What `tether-worker` waits by default for a shard that is down: a refusal must not wait for it.
    let patient = Duration::from_secs(60);
    let retry_for = Duration::from_secs(1);
    let (unknown_ca, revoked_err, transient) = block_on_system(async move {
        let shard = start_shard(
            &cfg,
            ShardOptions {
                listen: Some("127.0.0.1:0".parse().unwrap()),
                ..ShardOptions::default()
            },
        )
        .await
        .expect("shard starts");
        cfg.cluster.servers = vec![shard.local_addr.to_string()];
        let unknown_ca = failed_worker(&cfg, 0, other_ca, &data, patient).await;
        let revoked = failed_worker(&cfg, 1, revoked, &data, patient).await;
        shard.kill();
        // A failure that is not a refusal (here: an address quinn cannot dial) is retried until the deadline.
        cfg.cluster.servers = vec!["127.0.0.1:0".to_string()];
        let good = TlsFiles::for_worker(&cfg.cluster.tls_dir, 0).unwrap();
        let transient = failed_worker(&cfg, 0, good, &data, retry_for).await;
        (unknown_ca, revoked, transient)
    });

    // Another cluster's bundle: this worker refuses the shard's certificate; its CA file is the one to check.
    let (err, took) = unknown_ca;
    let text = err.to_string();
    let unknown_ca_text = text.clone();
    assert!(took < PROMPT, "{took:?}: {text}");
    match &err {
        WorkerError::Refused {
            refusal,
            check,
            paths,
            ..
        } => {
            assert_eq!(refusal.by, RefusedBy::Us, "{text}");
            // Another keygen's CA has our CA's name: its signature is what fails (decrypt_error), not the lookup.
            assert!(
                ["unknown_ca", "decrypt_error"].contains(&refusal.alert_name().as_str()),
                "{text}"
            );
            assert_eq!(check, &other_ca_paths.ca, "{text}");
            assert_eq!(**paths, other_ca_paths, "{text}");
        }
        other => panic!("not a refusal: {other}"),
    }
    assert!(
        text.contains("not signed by the trusted CA")
            && text.contains(&other_ca_paths.ca.display().to_string()),
        "{text}"
    );

    // A revoked certificate: the shard refuses it; the certificate file is the one to replace.
    let (err, took) = revoked_err;
    let text = err.to_string();
    let revoked_text = text.clone();
    assert!(took < PROMPT, "{took:?}: {text}");
    match &err {
        WorkerError::Refused { refusal, check, .. } => {
            assert_eq!(refusal.by, RefusedBy::Peer, "{text}");
            assert_eq!(refusal.alert_name(), "certificate_revoked", "{text}");
            assert_eq!(check, &revoked_paths.cert, "{text}");
        }
        other => panic!("not a refusal: {other}"),
    }
    assert!(
        text.contains("revoked") && text.contains(&revoked_paths.cert.display().to_string()),
        "{text}"
    );

    let (err, took) = transient;
    let text = err.to_string();
    assert!(took >= retry_for, "gave up after {took:?}: {text}");
    assert!(
        matches!(err, WorkerError::Net { .. })
            && text.contains("unreachable for 1s (last attempt: cannot connect"),
        "{text}"
    );

    // The shard said so at its default level, with each peer's address.
    let logged = log.text();
    let refusals: Vec<&str> = logged
        .lines()
        .filter(|l| {
            l.contains("WARN") && l.contains("tether_server") && l.contains("TLS handshake refused")
        })
        .collect();
    println!(
        "worker errors:\n{unknown_ca_text}\n{revoked_text}\n{text}\nshard log:\n{}",
        refusals.join("\n")
    );
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("peer=127.0.0.1:") && l.contains("not signed by the trusted CA")),
        "{logged}"
    );
    assert!(
        refusals
            .iter()
            .any(|l| l.contains("peer=127.0.0.1:") && l.contains("certificate_revoked")),
        "{logged}"
    );
}
