//! Real QUIC over loopback: mutual TLS refusals and hostile peers against a small server built from the transport
//! helpers. Every wait is bounded.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tether_common::net::*;
use tether_common::pki;
use tether_common::protocol::*;

const LAYOUT: u64 = 0x5eed_1a40_u64;
const SHARD: u32 = 0;
const RANGE: (u64, u64) = (0, 1000);
const WAIT: Duration = Duration::from_secs(10);

fn limits() -> FrameLimits {
    FrameLimits::for_shard(RANGE.1 - RANGE.0, 4096)
}

#[derive(Default)]
struct Counters {
    /// Connections whose TLS handshake completed.
    established: AtomicU64,
    /// Unidirectional streams the server started reading.
    bulk_streams: AtomicU64,
}

async fn handle(conn: quinn::Connection, counters: Arc<Counters>) -> Result<(), NetError> {
    let identity = match peer_identity(&conn) {
        Ok(id) => id,
        Err(e) => {
            close_with(&conn, ErrorCode::Unauthorized, &e.to_string());
            return Err(e);
        }
    };
    let mut control = ControlChannel::accept(&conn).await?;
    let hello = server_accept_hello(&mut control, LAYOUT, identity).await?;
    let welcome = Welcome {
        shard: SHARD,
        range_start: RANGE.0,
        range_end: RANGE.1,
        staleness: Some(2),
        fragments: 1,
        min_clock: 0,
        version: 0,
        clock: hello.clock,
        initial: None,
        term: 0,
    };
    control.send(&welcome.into()).await?;
    let limits = limits();
    let mut version = 0;
    loop {
        let stream = conn.accept_uni().await?;
        counters.bulk_streams.fetch_add(1, Ordering::Relaxed);
        let step = async {
            let frame = recv_bulk(stream, &limits, FrameKind::Push).await?;
            let push = access_push(&frame.body)?;
            push.check_target(SHARD, RANGE.0, RANGE.1)?;
            let meta = push.meta();
            if meta.worker != hello.rank {
                return Err(NetError::Protocol(ProtocolError::Unauthorized {
                    claimed: meta.worker,
                    identity: identity.to_string(),
                }));
            }
            version += 1;
            let reply = ParamReply {
                header: ReplyHeader {
                    shard: SHARD,
                    request: meta.clock,
                    clock: meta.clock,
                    version,
                    min_clock: 0,
                    epoch: 0,
                    range_start: RANGE.0,
                    range_end: RANGE.1,
                    term: 0,
                },
                precision: Precision::Bf16,
                values: vec![0; 2 * (RANGE.1 - RANGE.0) as usize],
            };
            send_bulk(&conn, FrameKind::Params, &encode_params(&reply)?).await
        };
        if let Err(e) = step.await {
            if let NetError::Protocol(p) = &e {
                reject(&conn, Some(&mut control), p).await;
            }
            return Err(e);
        }
    }
}

async fn start_server(dir: &Path) -> (SocketAddr, quinn::Endpoint, Arc<Counters>) {
    start_server_with(TlsFiles::for_server(dir, SHARD).unwrap()).await
}

async fn start_server_with(tls: TlsFiles) -> (SocketAddr, quinn::Endpoint, Arc<Counters>) {
    let endpoint = server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        &tls,
        &TransportTuning::default(),
    )
    .unwrap();
    let addr = endpoint.local_addr().unwrap();
    let counters = Arc::new(Counters::default());
    let (ep, c) = (endpoint.clone(), counters.clone());
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            let c = c.clone();
            tokio::spawn(async move {
                if let Ok(conn) = incoming.await {
                    c.established.fetch_add(1, Ordering::Relaxed);
                    let _ = handle(conn, c).await;
                }
            });
        }
    });
    (addr, endpoint, counters)
}

/// Keygen output: CA in `ca/`, bundles `server-0/`, `server-1/`, `worker-0..2/` and the shared `client/`.
fn certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    pki::generate_dev(dir.path(), &["tether.test".to_string()], 2, 3).unwrap();
    dir
}

/// The identity in bundle `dir/name` (`worker-R`, `server-K`, `client`).
fn bundle(dir: &Path, name: &str) -> TlsFiles {
    let stem = name.split('-').next().unwrap();
    TlsFiles::load(&dir.join(name), stem).unwrap()
}

async fn client(dir: &Path, name: &str, addr: SocketAddr) -> quinn::Connection {
    let tls = bundle(dir, name);
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
        .await
        .unwrap()
        .unwrap()
}

fn push_frame(worker: u32, clock: u64) -> PushFrame {
    PushFrame {
        worker,
        clock,
        shard: SHARD,
        range_start: RANGE.0,
        range_end: RANGE.1,
        read_version: 0,
        loss: 1.0,
        skip: false,
        payload: vec![7; 600],
    }
}

async fn close_code(conn: &quinn::Connection) -> u64 {
    match tokio::time::timeout(WAIT, conn.closed())
        .await
        .expect("server did not close the connection")
    {
        quinn::ConnectionError::ApplicationClosed(close) => close.error_code.into_inner(),
        other => panic!("expected an application close, got {other:?}"),
    }
}

/// Every file under `dir`, relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn keygen_separates_the_authority_from_per_node_bundles() {
    use std::os::unix::fs::PermissionsExt;
    let dir = certs();
    let files = files_under(dir.path());
    // The CA key exists once, in the CA folder; each bundle holds the CA certificate and its own pair only.
    let keys: Vec<&String> = files.iter().filter(|f| f.ends_with("ca.key")).collect();
    assert_eq!(keys, vec!["ca/ca.key"], "{files:?}");
    for (bundle_name, stem) in [
        ("server-0", "server"),
        ("server-1", "server"),
        ("standby-1", "server"),
        ("worker-0", "worker"),
        ("worker-2", "worker"),
        ("client", "client"),
    ] {
        let mut inside: Vec<String> = std::fs::read_dir(dir.path().join(bundle_name))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        inside.sort();
        // A shard's bundle also holds the key its checkpoints are authenticated with.
        let mut expected = vec![
            "ca.pem".to_string(),
            format!("{stem}.key"),
            format!("{stem}.pem"),
        ];
        if stem == "server" {
            expected.insert(1, pki::CHECKPOINT_KEY_FILE.to_string());
        }
        assert_eq!(inside, expected, "{bundle_name}");
        for private in expected.iter().filter(|f| f.ends_with(".key")) {
            let key = std::fs::metadata(dir.path().join(bundle_name).join(private)).unwrap();
            assert_eq!(
                key.permissions().mode() & 0o777,
                0o600,
                "{bundle_name}/{private}"
            );
        }
    }
    let ca_key = std::fs::metadata(dir.path().join("ca/ca.key")).unwrap();
    assert_eq!(ca_key.permissions().mode() & 0o777, 0o600);
    assert!(!dir.path().join("worker-3").exists());
    // issued.txt lists every serial with its name.
    let log = std::fs::read_to_string(dir.path().join("ca/issued.txt")).unwrap();
    // 2 shards, their 2 standbys, the witness, 3 workers and the shared client.
    assert_eq!(log.lines().count(), 9, "{log}");
    assert!(
        log.lines().any(|l| l.contains(" tether-server-1 ")),
        "{log}"
    );
    // A second keygen into the same CA folder is refused rather than replacing the authority.
    let again = pki::generate_dev(dir.path(), &[], 1, 1).unwrap_err();
    assert!(
        matches!(again, pki::PkiError::AuthorityExists(_)),
        "{again}"
    );

    // Nodes load their own bundle, from keygen's folder or mounted alone, and refuse another node's.
    assert!(TlsFiles::for_server(dir.path(), 1).is_ok());
    assert!(TlsFiles::for_server(&dir.path().join("server-1"), 1).is_ok());
    let err = TlsFiles::for_server(&dir.path().join("server-0"), 1).unwrap_err();
    assert!(err.to_string().contains("shard 0"), "{err}");
    assert!(TlsFiles::for_worker(&dir.path().join("worker-2"), 2).is_ok());
    let err = TlsFiles::for_worker(&dir.path().join("worker-2"), 1).unwrap_err();
    assert!(err.to_string().contains("rank 1"), "{err}");
    std::fs::copy(dir.path().join("client/ca.pem"), dir.path().join("ca.pem")).unwrap();
    let err = TlsFiles::load(dir.path(), "worker-9").unwrap_err();
    assert!(err.to_string().contains("worker-9.pem"), "{err}");
    std::fs::write(dir.path().join("bad.pem"), "not pem").unwrap();
    std::fs::copy(
        dir.path().join("client/client.key"),
        dir.path().join("bad.key"),
    )
    .unwrap();
    let err = TlsFiles::load(dir.path(), "bad").unwrap_err();
    assert!(
        matches!(&err, NetError::Certificate { path, .. } if path.ends_with("bad.pem")),
        "{err}"
    );
}

#[tokio::test]
async fn identities_come_from_certificates_and_server_name_is_checked() {
    let dir = certs();
    let (addr, _server, _) = start_server(dir.path()).await;
    let conn = client(dir.path(), "worker-1", addr).await;
    // The client sees the server certificate; the server side identity is checked by the hostile test.
    assert!(conn.peer_identity().is_some());
    assert_eq!(
        PeerIdentity::from_common_name("tether-worker-7"),
        Some(PeerIdentity::Worker(7))
    );
    assert_eq!(PeerIdentity::from_common_name("tether-worker-07"), None);
    assert_eq!(
        PeerIdentity::from_common_name("tether-client"),
        Some(PeerIdentity::Client)
    );
    assert_eq!(PeerIdentity::from_common_name("tether-server"), None);

    // A name that is not in the server's SANs is refused by the client.
    let tls = bundle(dir.path(), "client");
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    let res = tokio::time::timeout(WAIT, connect(&endpoint, addr, "elsewhere.example"))
        .await
        .unwrap();
    assert!(res.is_err());
    // SAN host names given to keygen work.
    let ok = tokio::time::timeout(WAIT, connect(&endpoint, addr, "tether.test"))
        .await
        .unwrap();
    assert!(ok.is_ok());
}

async fn expect_refused(conn: Result<quinn::Connection, NetError>) {
    let Ok(conn) = conn else { return };
    // TLS 1.3: the client may finish its side before the server rejects its certificate; then nothing works.
    let attempt = async {
        let mut control = ControlChannel::open(&conn).await?;
        client_handshake(&mut control, Hello::new(0, LAYOUT)).await
    };
    let res = tokio::time::timeout(WAIT, attempt)
        .await
        .expect("refused client hung");
    assert!(res.is_err(), "a refused client completed a handshake");
}

#[tokio::test]
async fn foreign_and_missing_client_certificates_are_refused() {
    let dir = certs();
    let other = certs();
    let (addr, _server, counters) = start_server(dir.path()).await;

    // Certificate from another CA (the client still trusts the real CA, so only the server can refuse).
    let mut foreign = bundle(other.path(), "client");
    foreign.ca = bundle(dir.path(), "client").ca;
    let endpoint = client_endpoint(&foreign, &TransportTuning::default()).unwrap();
    expect_refused(
        tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
            .await
            .unwrap(),
    )
    .await;

    // No certificate at all.
    let ca = bundle(dir.path(), "client").ca;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(config).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    expect_refused(
        tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
            .await
            .unwrap(),
    )
    .await;

    assert_eq!(
        counters.established.load(Ordering::Relaxed),
        0,
        "server accepted a refused client"
    );
    assert_eq!(counters.bulk_streams.load(Ordering::Relaxed), 0);

    // The server still serves good clients.
    let conn = client(dir.path(), "client", addr).await;
    let mut control = ControlChannel::open(&conn).await.unwrap();
    tokio::time::timeout(WAIT, client_handshake(&mut control, Hello::new(0, LAYOUT)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counters.established.load(Ordering::Relaxed), 1);
}

/// A well-behaved worker: push, wait for the reply, repeat, until told to stop.
async fn good_worker(conn: quinn::Connection, replies: Arc<AtomicU64>, stop: Arc<AtomicBool>) {
    let mut control = ControlChannel::open(&conn).await.unwrap();
    let welcome = tokio::time::timeout(WAIT, client_handshake(&mut control, Hello::new(0, LAYOUT)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((welcome.range_start, welcome.range_end), RANGE);
    let limits = limits();
    for clock in 0..1_000_000u64 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let body = encode_push(&push_frame(0, clock)).unwrap();
        send_bulk(&conn, FrameKind::Push, &body).await.unwrap();
        let stream = tokio::time::timeout(WAIT, conn.accept_uni())
            .await
            .unwrap()
            .unwrap();
        let frame = tokio::time::timeout(WAIT, recv_bulk(stream, &limits, FrameKind::Params))
            .await
            .unwrap()
            .unwrap();
        let reply = access_params(&frame.body).unwrap();
        reply.check_shape(RANGE.0, RANGE.1).unwrap();
        assert_eq!(reply.header.clock.to_native(), clock);
        replies.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy)]
enum Hostile {
    LyingLength,
    Oversized,
    Truncated,
    InvalidRkyv,
    WrongVersion,
    WrongLayout,
    RankNotInCertificate,
    WrongShard,
}

async fn misbehave(conn: &quinn::Connection, how: Hostile) {
    let mut control = ControlChannel::open(conn).await.unwrap();
    let hello = match how {
        Hostile::WrongVersion => Hello {
            rank: 1,
            protocol_version: PROTOCOL_VERSION + 1,
            layout_hash: LAYOUT,
            clock: 0,
        },
        Hostile::WrongLayout => Hello::new(1, LAYOUT ^ 1),
        Hostile::RankNotInCertificate => Hello::new(2, LAYOUT),
        _ => Hello::new(1, LAYOUT),
    };
    let welcome = tokio::time::timeout(WAIT, client_handshake(&mut control, hello))
        .await
        .unwrap();
    if matches!(
        how,
        Hostile::WrongVersion | Hostile::WrongLayout | Hostile::RankNotInCertificate
    ) {
        let refusal = match welcome {
            Ok(_) => panic!("{how:?} was welcomed"),
            Err(e) => e.to_string(),
        };
        // The refusal names what the peer sent, never the shard's own layout hash.
        assert!(
            !refusal.contains(&format!("{LAYOUT:016x}")),
            "{how:?}: the refusal reveals the shard's layout hash: {refusal}"
        );
        return;
    }
    welcome.unwrap();
    let mut s = conn.open_uni().await.unwrap();
    let valid = encode_push(&push_frame(1, 0)).unwrap();
    match how {
        Hostile::LyingLength => {
            s.write_all(&FrameHeader::encode(FrameKind::Push, 64).unwrap())
                .await
                .unwrap();
            s.write_all(&valid).await.unwrap();
            s.finish().unwrap();
        }
        Hostile::Oversized => {
            // Only the header: the server must refuse without waiting for (or allocating) the body.
            s.write_all(&FrameHeader::encode(FrameKind::Push, limits().push + 1).unwrap())
                .await
                .unwrap();
        }
        Hostile::Truncated => {
            s.write_all(&FrameHeader::encode(FrameKind::Push, valid.len()).unwrap())
                .await
                .unwrap();
            s.write_all(&valid[..valid.len() / 2]).await.unwrap();
            s.finish().unwrap();
        }
        Hostile::InvalidRkyv => {
            let garbage = vec![0xA5; valid.len()];
            s.write_all(&encode_frame(FrameKind::Push, &garbage).unwrap())
                .await
                .unwrap();
            s.finish().unwrap();
        }
        Hostile::WrongShard => {
            let mut p = push_frame(1, 0);
            p.shard = 5;
            s.write_all(&encode_frame(FrameKind::Push, &encode_push(&p).unwrap()).unwrap())
                .await
                .unwrap();
            s.finish().unwrap();
        }
        _ => unreachable!(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_connections_are_closed_alone_with_their_code() {
    let dir = certs();
    let (addr, _server, counters) = start_server(dir.path()).await;
    let replies = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let good_conn = client(dir.path(), "client", addr).await;
    let good = tokio::spawn(good_worker(
        good_conn.clone(),
        replies.clone(),
        stop.clone(),
    ));

    let cases = [
        (Hostile::LyingLength, ErrorCode::BadFrame),
        (Hostile::Oversized, ErrorCode::Oversized),
        (Hostile::Truncated, ErrorCode::Truncated),
        (Hostile::InvalidRkyv, ErrorCode::ValidationFailed),
        (Hostile::WrongVersion, ErrorCode::BadVersion),
        (Hostile::WrongLayout, ErrorCode::BadLayoutHash),
        (Hostile::RankNotInCertificate, ErrorCode::Unauthorized),
        (Hostile::WrongShard, ErrorCode::WrongShard),
    ];
    // All hostile clients at once, while the good worker keeps pushing.
    let mut tasks = Vec::new();
    for (how, code) in cases {
        let dir = dir.path().to_path_buf();
        tasks.push(tokio::spawn(async move {
            let conn = client(&dir, "worker-1", addr).await;
            misbehave(&conn, how).await;
            (how, code, close_code(&conn).await)
        }));
    }
    for task in tasks {
        let (how, code, got) = tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
        assert_eq!(got, u64::from(code.code()), "{how:?}: expected {code}");
    }
    let during = replies.load(Ordering::Relaxed);
    // The good worker keeps getting answers after every hostile connection is gone.
    let deadline = tokio::time::Instant::now() + WAIT;
    while replies.load(Ordering::Relaxed) < during + 20 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::Relaxed);
    tokio::time::timeout(WAIT, good).await.unwrap().unwrap();
    assert!(
        replies.load(Ordering::Relaxed) >= during + 20,
        "good worker stalled"
    );
    assert!(
        during > 0,
        "good worker got no answers while hostile clients were served"
    );
    assert!(
        good_conn.close_reason().is_none(),
        "the good connection was closed"
    );
    assert_eq!(counters.established.load(Ordering::Relaxed), 9);
}

/// A certificate for `node` from the CA in `dir/ca`, valid over `validity`, as a bundle in a fresh folder.
fn issued_bundle(
    dir: &Path,
    node: &pki::Node,
    validity: pki::Validity,
) -> (tempfile::TempDir, TlsFiles) {
    let out = tempfile::tempdir().unwrap();
    let ca = pki::Authority::load(&dir.join("ca")).unwrap();
    ca.issue(node, &validity)
        .unwrap()
        .write_bundle(out.path(), ca.ca_pem())
        .unwrap();
    let tls = bundle(out.path(), &node.bundle_name());
    (out, tls)
}

fn expired() -> pki::Validity {
    let now = std::time::SystemTime::now();
    pki::Validity {
        not_before: now - Duration::from_secs(2 * 86_400),
        not_after: now - Duration::from_secs(86_400),
    }
}

#[tokio::test]
async fn a_shard_certificate_is_refused_when_presented_as_another_shard() {
    let dir = certs();
    let (addr, _server, counters) = start_server(dir.path()).await;
    let tls = bundle(dir.path(), "worker-0");
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    // Shard 0's (valid, CA-signed) certificate answering where the worker dialled shard 1.
    let err = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 1))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&err, NetError::Identity(m) if m.contains("shard 1") && m.contains("shard 0")),
        "{err}"
    );
    let conn = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 0))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(peer_shard(&conn).unwrap(), 0);
    // The refused dial sent nothing: the server never saw a stream from it.
    assert_eq!(counters.bulk_streams.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn expired_and_revoked_client_certificates_are_refused_before_any_frame() {
    let dir = certs();
    let worker0 = bundle(dir.path(), "worker-0");
    let revoked_serial = certificate_serial(&worker0.cert[0]).unwrap();
    let server_tls = TlsFiles::for_server(dir.path(), SHARD)
        .unwrap()
        .with_revoked(std::slice::from_ref(&revoked_serial));
    let (addr, _server, counters) = start_server_with(server_tls).await;

    // Expired: signed by the right CA, for a rank nobody else holds.
    let (_keep, old) = issued_bundle(dir.path(), &pki::Node::Worker { rank: 1 }, expired());
    let endpoint = client_endpoint(&old, &TransportTuning::default()).unwrap();
    expect_refused(
        tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
            .await
            .unwrap(),
    )
    .await;
    // Revoked: a valid certificate whose serial is on the deny list.
    let endpoint = client_endpoint(&worker0, &TransportTuning::default()).unwrap();
    expect_refused(
        tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        counters.established.load(Ordering::Relaxed),
        0,
        "a refused certificate got a connection"
    );
    assert_eq!(counters.bulk_streams.load(Ordering::Relaxed), 0);

    // Everyone else still gets in.
    let conn = client(dir.path(), "worker-1", addr).await;
    let mut control = ControlChannel::open(&conn).await.unwrap();
    tokio::time::timeout(WAIT, client_handshake(&mut control, Hello::new(1, LAYOUT)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(counters.established.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn workers_refuse_expired_and_revoked_shard_certificates() {
    let dir = certs();
    let tls = bundle(dir.path(), "worker-0");
    let (_keep, old) = issued_bundle(
        dir.path(),
        &pki::Node::Server {
            shard: 0,
            hosts: Vec::new(),
        },
        expired(),
    );
    let (old_addr, _old_server, old_counters) = start_server_with(old).await;
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    let res = tokio::time::timeout(WAIT, connect_shard(&endpoint, old_addr, "127.0.0.1", 0))
        .await
        .unwrap();
    assert!(res.is_err(), "an expired shard certificate was accepted");

    let (addr, _server, _) = start_server(dir.path()).await;
    let shard0 = TlsFiles::for_server(dir.path(), 0).unwrap();
    let serial = certificate_serial(&shard0.cert[0]).unwrap();
    let wary = tls.clone().with_revoked(&[serial]);
    let endpoint = client_endpoint(&wary, &TransportTuning::default()).unwrap();
    let res = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 0))
        .await
        .unwrap();
    assert!(res.is_err(), "a revoked shard certificate was accepted");
    assert_eq!(old_counters.bulk_streams.load(Ordering::Relaxed), 0);
    // Without the deny list the same shard is fine.
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    assert!(
        tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 0))
            .await
            .unwrap()
            .is_ok()
    );
}

#[tokio::test]
async fn a_node_issued_later_from_the_kept_authority_is_accepted() {
    let dir = certs();
    let (addr, _server, _) = start_server(dir.path()).await;
    let out = tempfile::tempdir().unwrap();
    let issued = pki::issue(
        &dir.path().join("ca"),
        out.path(),
        &pki::Node::Worker { rank: 7 },
        &pki::Validity::days(3),
    )
    .unwrap();
    let tls = TlsFiles::for_worker(out.path(), 7).unwrap();
    assert_eq!(
        pki::format_serial(&certificate_serial(&tls.cert[0]).unwrap()),
        issued.serial
    );
    let endpoint = client_endpoint(&tls, &TransportTuning::default()).unwrap();
    let conn = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 0))
        .await
        .unwrap()
        .unwrap();
    let mut control = ControlChannel::open(&conn).await.unwrap();
    tokio::time::timeout(WAIT, client_handshake(&mut control, Hello::new(7, LAYOUT)))
        .await
        .unwrap()
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("ca/issued.txt")).unwrap();
    assert!(
        log.contains(&format!("{} tether-worker-7 ", issued.serial)),
        "{log}"
    );
}

/// Serves `tls` on a loopback port, completing every handshake and holding the connections for `WAIT`.
fn hold_server(tls: &TlsFiles) -> (SocketAddr, quinn::Endpoint) {
    let endpoint = server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        tls,
        &TransportTuning::default(),
    )
    .unwrap();
    let accept = endpoint.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accept.accept().await {
            tokio::spawn(async move {
                if let Ok(conn) = incoming.await {
                    let _ = tokio::time::timeout(WAIT, conn.closed()).await;
                }
            });
        }
    });
    (endpoint.local_addr().unwrap(), endpoint)
}

#[tokio::test]
async fn a_standby_serves_as_its_own_shard_only_and_holds_its_shards_checkpoint_key() {
    let dir = certs();
    let key = |b: &str| std::fs::read(dir.path().join(b).join(pki::CHECKPOINT_KEY_FILE)).unwrap();
    assert_eq!(
        key("standby-1"),
        key("server-1"),
        "a standby writes its shard's checkpoints"
    );
    assert_ne!(key("standby-1"), key("server-0"));
    assert_eq!(
        PeerIdentity::from_common_name("tether-standby-3"),
        Some(PeerIdentity::Standby(3))
    );
    assert_eq!(PeerIdentity::from_common_name("tether-standby-03"), None);
    assert!(
        !PeerIdentity::Standby(0).allows_rank(0),
        "a standby claims no rank"
    );
    // Only shard 1's standby bundle loads as shard 1's standby.
    let standby = TlsFiles::for_standby(dir.path(), 1).unwrap();
    assert!(TlsFiles::for_standby(&dir.path().join("server-1"), 1).is_err());
    assert!(TlsFiles::for_standby(&dir.path().join("standby-0"), 1).is_err());
    // Workers that dial shard 1 accept its standby after a takeover; as shard 0 it is refused.
    let (addr, _server) = hold_server(&standby);
    let worker = bundle(dir.path(), "worker-0");
    let endpoint = client_endpoint(&worker, &TransportTuning::default()).unwrap();
    let ok = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 1))
        .await
        .unwrap();
    assert!(ok.is_ok(), "{:?}", ok.err());
    let wrong = tokio::time::timeout(WAIT, connect_shard(&endpoint, addr, "127.0.0.1", 0))
        .await
        .unwrap();
    assert!(
        matches!(wrong, Err(NetError::Identity(_))),
        "{:?}",
        wrong.err()
    );
    // The standby dials its primary as a client with its own certificate.
    let (primary, _p) = hold_server(&bundle(dir.path(), "server-1"));
    let as_client = client_endpoint(&standby, &TransportTuning::default()).unwrap();
    let conn = tokio::time::timeout(WAIT, connect_shard(&as_client, primary, "127.0.0.1", 1))
        .await
        .unwrap()
        .unwrap();
    drop(conn);
    // A standby issued where its shard's bundle (and key) is not is refused.
    let elsewhere = tempfile::tempdir().unwrap();
    let e = pki::issue(
        &dir.path().join("ca"),
        elsewhere.path(),
        &pki::Node::Standby {
            shard: 1,
            hosts: vec![],
        },
        &pki::Validity::days(1),
    )
    .unwrap_err();
    assert!(e.to_string().contains("checkpoint key"), "{e}");
    assert!(
        !elsewhere.path().join("standby-1").exists(),
        "nothing written"
    );
}
