//! Bad input to the fence, against real processes (issue 36's deliverable 7): a node that claims a term it does not
//! hold, a standby certificate used to vote for another shard, and a voter that answers twice. Each probe uses the
//! real wire format with a real certificate of the cluster; each must get a typed refusal (or a closed link) and
//! change nothing: the shard keeps one primary in one term, and every update the workers pushed is applied once.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{num, serial, Cluster, Proc, Spec};
use tether::common::fence::{Refusal, Request, Successor, Vote, Voter, VoterState};
use tether::common::net::{
    client_endpoint, connect, server_endpoint, ControlChannel, NetError, TlsFiles, TransportTuning,
};
use tether::common::protocol::Control;

fn spec(shards: usize) -> Spec {
    Spec {
        shards,
        standbys: true,
        epochs: 30,
        staleness: "inf".into(),
        ..Spec::default()
    }
}

fn worker_args(report: &str) -> Vec<&str> {
    vec!["--report", report, "--step-delay-ms", "10"]
}

/// Waits (bounded) until `p`'s log says `what`.
fn wait_log(p: &mut Proc, what: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !p.log_text().contains(what) {
        assert!(p.alive(), "it died before {what:?}:\n{}", p.log_tail(3000));
        assert!(
            Instant::now() < deadline,
            "never logged {what:?}:\n{}",
            p.log_tail(3000)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `requests` on one control stream to the voter at `addr`, presenting `tls`, and collects the answers (an
/// `Err` ends the collection: the voter closed the link).
fn ask(
    tls: &TlsFiles,
    addr: SocketAddr,
    shard: u32,
    requests: &[Request],
) -> Vec<Result<Vote, String>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a test runtime builds");
    rt.block_on(async {
        let ep = client_endpoint(tls, &TransportTuning::default()).expect("a client endpoint");
        let conn = connect(&ep, addr, "127.0.0.1").await.expect("connects");
        let mut control = ControlChannel::open(&conn).await.expect("a control stream");
        let mut answers = Vec::new();
        for r in requests {
            let asked = async {
                control
                    .send(&Control::LeaseRequest { shard, request: *r })
                    .await?;
                control.recv().await
            };
            match tokio::time::timeout(Duration::from_secs(5), asked).await {
                Ok(Ok(Control::LeaseVote { round, vote })) => {
                    assert_eq!(round, r.round, "a vote names the round it answers");
                    answers.push(Ok(vote));
                }
                Ok(Ok(other)) => answers.push(Err(format!("{} instead of a vote", other.name()))),
                Ok(Err(e)) => {
                    answers.push(Err(e.to_string()));
                    break;
                }
                Err(_) => {
                    answers.push(Err("no answer in 5 s".into()));
                    break;
                }
            }
        }
        conn.close(0u32.into(), b"done");
        ep.wait_idle().await;
        answers
    })
}

/// A fake peer listening at `addr` with `tls`'s certificate, on its own runtime (the test spawns its handler there).
fn fake_peer(addr: SocketAddr, tls: &TlsFiles) -> (tokio::runtime::Runtime, quinn::Endpoint) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a test runtime builds");
    let ep = {
        let _in = rt.enter();
        server_endpoint(addr, tls, &TransportTuning::default()).expect("the fake peer binds")
    };
    (rt, ep)
}

fn claim(term: u64, round: u64) -> Request {
    Request {
        term,
        incarnation: 0xbad,
        round,
        successor: Successor::Any,
    }
}

/// A primary and its standby train two workers under the real witness while a holder of the standby's key claims
/// terms it was never granted and a holder of another shard's standby key asks shard 0's voters: every claim is
/// refused, and the shard keeps one primary in one term with every update applied once.
#[test]
fn false_term_claims_and_another_shards_standby_key_change_nothing() {
    let _serial = serial();
    let c = Cluster::new(spec(2));
    let certs = c.path("certs");
    let _witness = c.witness();
    let mut primary = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    // Shard 1 runs without its standby: its primary leads on the witness's vote.
    let _other = c.server(1, &["--exit-after-workers", "2"]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    // Shard 0's standby starts only after the probes that use its key (it holds the connections its key may).
    wait_log(&mut primary, "holding the lease", Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(500));
    let witness = c.witness.expect("a witness address");
    let standby0 = TlsFiles::for_standby(&certs, 0).expect("standby-0 bundle");
    let standby1 = TlsFiles::for_standby(&certs, 1).expect("standby-1 bundle");
    // The standby's key claims node 0's term (even), then a term far above the primary's while it holds the lease,
    // then registers a made-up incarnation.
    for (voter, addr) in [("witness", witness), ("primary", c.servers[0])] {
        let answers = ask(
            &standby0,
            addr,
            0,
            &[claim(2, 1), claim(1 << 40 | 1, 2), claim(0, 3)],
        );
        println!("{voter}: {answers:?}");
        assert!(
            matches!(
                answers[0],
                Ok(Vote::Refused {
                    why: Refusal::WrongNode,
                    ..
                })
            ),
            "{voter} answered node 0's term claimed by node 1 with {:?}",
            answers[0]
        );
        assert!(
            matches!(
                answers[1],
                Ok(Vote::Refused {
                    why: Refusal::Held,
                    ..
                })
            ),
            "{voter} answered a term claimed during the primary's lease with {:?}",
            answers[1]
        );
    }
    let _standby = c.standby(0, &[]);
    // Shard 1's standby key asks for shard 0's term: the link is closed without a vote.
    for (voter, addr) in [("witness", witness), ("primary", c.servers[0])] {
        let answers = ask(&standby1, addr, 0, &[claim(1, 1)]);
        println!("{voter}, another shard's standby: {answers:?}");
        assert!(
            matches!(answers.as_slice(), [Err(_)]),
            "{voter} answered shard 1's standby asking for shard 0: {answers:?}"
        );
    }
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    primary.wait_success(Duration::from_secs(30));
    let steps = num(&c.report("w0.json"), "steps") + num(&c.report("w1.json"), "steps");
    let applied = num(&c.report("server-0.json"), "updates_applied");
    let log = primary.log_text();
    assert!(
        !log.contains("no longer serving") && !log.contains("lease ran out"),
        "a false claim deposed the primary:\n{}",
        primary.log_tail(3000)
    );
    assert_eq!(applied, steps, "an update was lost or applied twice");
}

/// A voter that answers every request twice (the real voting rule, each answer sent a second time, as a duplicating
/// network or a broken witness would): the nodes drop its link at the second answer instead of counting it for a
/// later round, and the shard trains on with its standby's votes.
#[test]
fn a_voter_that_answers_twice_is_dropped_and_never_counted() {
    let _serial = serial();
    let c = Cluster::new(Spec {
        epochs: 15,
        ..spec(1)
    });
    let addr = c.witness.expect("a witness address");
    let tls = TlsFiles::for_witness(&c.path("certs")).expect("witness bundle");
    let (rt, ep) = fake_peer(addr, &tls);
    let base = Instant::now();
    let voter = std::sync::Arc::new(std::sync::Mutex::new(Voter::new(
        VoterState::default(),
        1000,
        0,
    )));
    let doubled = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    rt.spawn({
        let (ep, voter, doubled) = (ep.clone(), voter.clone(), doubled.clone());
        async move {
            while let Some(incoming) = ep.accept().await {
                let (voter, doubled) = (voter.clone(), doubled.clone());
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    let node = match tether::common::net::peer_identity(&conn) {
                        Ok(tether::common::net::PeerIdentity::Shard(_)) => 0,
                        Ok(tether::common::net::PeerIdentity::Standby(_)) => 1,
                        _ => return,
                    };
                    while let Ok(mut control) = ControlChannel::accept(&conn).await {
                        let (voter, doubled) = (voter.clone(), doubled.clone());
                        tokio::spawn(async move {
                            while let Ok(Control::LeaseRequest { request, .. }) =
                                control.recv().await
                            {
                                let now = base.elapsed().as_millis() as u64;
                                let vote = voter
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .request(node, &request, now);
                                let answer = Control::LeaseVote {
                                    round: request.round,
                                    vote,
                                };
                                for _ in 0..2 {
                                    if control.send(&answer).await.is_err() {
                                        return;
                                    }
                                }
                                doubled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        });
                    }
                });
            }
            Ok::<_, NetError>(())
        }
    });
    let mut primary = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    let mut standby = c.standby(0, &[]);
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    w0.wait_success(Duration::from_secs(120));
    w1.wait_success(Duration::from_secs(120));
    primary.wait_success(Duration::from_secs(30));
    let steps = num(&c.report("w0.json"), "steps") + num(&c.report("w1.json"), "steps");
    let applied = num(&c.report("server-0.json"), "updates_applied");
    let dropped = |p: &Proc| {
        p.log_text()
            .matches("a voter answered a round that was not due")
            .count()
    };
    let (by_primary, by_standby) = (dropped(&primary), dropped(&standby));
    println!(
        "answered twice {} times; links dropped by the primary {by_primary}, by the standby {by_standby}; applied \
         {applied} for {steps} steps",
        doubled.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        by_primary + by_standby > 0,
        "no node noticed the second answers:\n{}",
        primary.log_tail(3000)
    );
    assert_eq!(applied, steps, "an update was lost or applied twice");
    let _ = standby.alive();
    drop(rt);
}

/// A hostile seeder: whoever holds the standby's key answers the designated primary's request to be seeded with a
/// welcome and a malformed state image (random bytes), and the fence votes it asks for with refusals. The primary
/// refuses the image with a typed error, never exits for it, never adopts it, and leads from its own state on the
/// witness's vote: the workers train to the end with every update applied once.
#[test]
fn a_malformed_image_from_the_standbys_address_is_refused_and_the_primary_leads() {
    use tether::common::protocol::{FrameHeader, FrameKind};
    let _serial = serial();
    let c = Cluster::new(Spec {
        epochs: 10,
        ..spec(1)
    });
    let addr = c.standbys[0];
    let tls = TlsFiles::for_standby(&c.path("certs"), 0).expect("standby-0 bundle");
    let (rt, ep) = fake_peer(addr, &tls);
    let images = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    rt.spawn({
        let (ep, images) = (ep.clone(), images.clone());
        async move {
            let mut rng = tether::common::testing::TestRng::new(5);
            let garbage: Vec<u8> = (0..100_000).map(|_| rng.next_u64() as u8).collect();
            while let Some(incoming) = ep.accept().await {
                let (images, garbage) = (images.clone(), garbage.clone());
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    while let Ok(mut control) = ControlChannel::accept(&conn).await {
                        let (conn, images, garbage) =
                            (conn.clone(), images.clone(), garbage.clone());
                        tokio::spawn(async move {
                            while let Ok(msg) = control.recv().await {
                                let sent = match msg {
                                    Control::ReplicaHello { .. } => {
                                        let welcome = Control::ReplicaWelcome {
                                            lineage: 99,
                                            seq: 0,
                                        };
                                        if control.send(&welcome).await.is_err() {
                                            return;
                                        }
                                        let Ok(mut stream) = conn.open_uni().await else {
                                            return;
                                        };
                                        let Ok(header) = FrameHeader::encode(
                                            FrameKind::ReplicaImage,
                                            garbage.len(),
                                        ) else {
                                            return;
                                        };
                                        images.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                                        let _ = stream.write_all(&header).await;
                                        let _ = stream.write_all(&garbage).await;
                                        let _ = stream.finish();
                                        Ok(())
                                    }
                                    Control::LeaseRequest { request, .. } => {
                                        control
                                            .send(&Control::LeaseVote {
                                                round: request.round,
                                                vote: Vote::Refused {
                                                    term: 0,
                                                    why: Refusal::Quiet,
                                                },
                                            })
                                            .await
                                    }
                                    _ => return,
                                };
                                if sent.is_err() {
                                    return;
                                }
                            }
                        });
                    }
                });
            }
        }
    });
    let _witness = c.witness();
    let mut primary = c.server(
        0,
        &["--exit-after-workers", "2", "--report", "server-0.json"],
    );
    let mut w0 = c.worker(0, &worker_args("w0.json"));
    let mut w1 = c.worker(1, &worker_args("w1.json"));
    w0.wait_success(Duration::from_secs(180));
    w1.wait_success(Duration::from_secs(120));
    primary.wait_success(Duration::from_secs(30));
    let steps = num(&c.report("w0.json"), "steps") + num(&c.report("w1.json"), "steps");
    let applied = num(&c.report("server-0.json"), "updates_applied");
    let log = primary.log_text();
    let refused = log.matches("refused the peer's state image").count();
    println!(
        "malformed images sent {}, refused {refused}; applied {applied} for {steps} steps",
        images.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        refused > 0,
        "the primary never got or never refused the image:\n{}",
        primary.log_tail(3000)
    );
    assert!(
        !log.contains("seeded from the primary's image"),
        "the primary adopted a malformed image:\n{}",
        primary.log_tail(3000)
    );
    assert_eq!(applied, steps, "an update was lost or applied twice");
    drop(rt);
}
