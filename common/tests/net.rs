//! Real QUIC over loopback: mutual TLS refusals and hostile peers against a small server built from the session
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
        min_clock: 0,
        version: 0,
        clock: hello.clock,
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
                shard: SHARD,
                request: meta.clock,
                clock: meta.clock,
                version,
                min_clock: 0,
                range_start: RANGE.0,
                range_end: RANGE.1,
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
    let tls = TlsFiles::load(dir, "server").unwrap();
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

fn certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    pki::generate(dir.path(), &["tether.test".to_string()], Some(3)).unwrap();
    dir
}

async fn client(dir: &Path, stem: &str, addr: SocketAddr) -> quinn::Connection {
    let tls = TlsFiles::load(dir, stem).unwrap();
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

#[tokio::test]
async fn keygen_writes_files_with_private_keys() {
    use std::os::unix::fs::PermissionsExt;
    let dir = certs();
    for f in [
        "ca.pem",
        "ca.key",
        "server.pem",
        "server.key",
        "client.pem",
        "client.key",
        "worker-2.pem",
        "worker-2.key",
    ] {
        let meta = std::fs::metadata(dir.path().join(f)).unwrap();
        if f.ends_with(".key") {
            assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{f}");
        }
    }
    assert!(!dir.path().join("worker-3.pem").exists());
    let err = TlsFiles::load(dir.path(), "worker-9").unwrap_err();
    assert!(err.to_string().contains("worker-9.pem"), "{err}");
    std::fs::write(dir.path().join("bad.pem"), "not pem").unwrap();
    std::fs::copy(dir.path().join("client.key"), dir.path().join("bad.key")).unwrap();
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
    let tls = TlsFiles::load(dir.path(), "client").unwrap();
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
    let mut foreign = TlsFiles::load(other.path(), "client").unwrap();
    foreign.ca = TlsFiles::load(dir.path(), "client").unwrap().ca;
    let endpoint = client_endpoint(&foreign, &TransportTuning::default()).unwrap();
    expect_refused(
        tokio::time::timeout(WAIT, connect(&endpoint, addr, "127.0.0.1"))
            .await
            .unwrap(),
    )
    .await;

    // No certificate at all.
    let ca = TlsFiles::load(dir.path(), "client").unwrap().ca;
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
        assert_eq!(reply.clock.to_native(), clock);
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
        assert!(welcome.is_err(), "{how:?} was welcomed");
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
