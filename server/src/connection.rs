//! One task per QUIC connection, the transport shell around the shard's protocol: authenticate the peer from its
//! certificate, run the hello/welcome handshake (the explicit rejoin), then move bytes. Control messages go to the
//! `ShardActor` (which runs the sans-IO [`crate::protocol::ShardProtocol`]); each push stream's frame is size-checked
//! before it is read and validated in place before it is forwarded, and its outcome goes back on the control
//! stream. Pulls run as bounded tasks per connection. A protocol violation closes only this connection with a typed
//! code and never reaches shard state. A connection from the shard's own standby (`tether-standby-K`) carries the
//! replication log instead ([`crate::replication`]): its entries go out on one unidirectional stream, its
//! acknowledgements come back on the control stream. While this process is itself a standby that follows, workers
//! are turned away with [`ErrorCode::NotPrimary`]. No protocol rule lives here.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tracing::{debug, info, warn};

use tether_common::net::{
    close_with, peer_identity, recv_bulk, reject, send_bulk_chunks, server_accept_hello,
    ControlChannel, ControlReceiver, ControlSender, NetError, PeerIdentity,
};
use tether_common::protocol::{
    access_push, Control, ErrorCode, FrameHeader, FrameKind, FrameLimits, Outcome, ProtocolError,
    PullMode,
};

use crate::actor::{
    ApplyPush, Closed, Goodbye, Heartbeat, Hello, Pull, ReplicaLost, ShardActor, StandbySynced,
    Subscribe,
};
use crate::admission::{Admission, HandshakeTicket};
use crate::protocol::ConnId;
use crate::replication::ack_watch::AckWatch;
use crate::shard::ShardError;

/// A peer must finish the TLS handshake, and then the hello, each within this time.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A bulk frame must arrive completely within this time once its stream is open (slow-loris bound).
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// At most this many pulls of one connection are in flight (asked, not yet answered); more are refused at once.
pub const MAX_INFLIGHT_PULLS: usize = 4;
/// Control messages queued for the writer of one connection before senders wait.
const CONTROL_QUEUE: usize = 256;

/// What every connection of one shard shares.
pub struct ConnectionContext {
    /// The shard's actor.
    pub shard_actor: Addr<ShardActor>,
    /// Shard index.
    pub shard: u32,
    /// Layout fingerprint peers must match.
    pub layout_hash: u64,
    /// Frame size limits for this shard.
    pub limits: FrameLimits,
    /// The next connection id.
    pub next_conn: AtomicU64,
    /// The handshake and connection budgets.
    pub admission: Arc<Admission>,
    /// This node's role as its actor publishes it: unless it is the primary, workers are turned away.
    pub role: tokio::sync::watch::Receiver<crate::replication::RoleKind>,
    /// A replicated shard's fence: the other node's lease requests are answered with this node's vote.
    pub fence: Option<Arc<crate::fence_link::Fence>>,
}

/// Serves one incoming connection until it closes: the TLS handshake holds `handshake` (given back as soon as it
/// ends), then the authenticated peer needs a connection slot of its identity's share, held until the end.
pub async fn serve_connection(
    incoming: quinn::Incoming,
    handshake: HandshakeTicket,
    ctx: Arc<ConnectionContext>,
) {
    let peer = incoming.remote_address();
    let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await;
    drop(handshake);
    let conn = match tls {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            match NetError::from(e) {
                // An operator must see a peer turned away for its certificate (or ours): it will not get in.
                NetError::Refused(refusal) => {
                    warn!(%peer, %refusal, "TLS handshake refused")
                }
                other => debug!(%peer, error = %other, "QUIC handshake failed"),
            }
            return;
        }
        Err(_) => {
            debug!(%peer, "handshake timed out");
            return;
        }
    };
    let identity = match peer_identity(&conn) {
        Ok(i) => i,
        Err(e) => {
            warn!(%peer, error = %e, "refusing peer without a Tether identity");
            close_with(&conn, ErrorCode::Unauthorized, &e.to_string());
            return;
        }
    };
    let _slot = match ctx.admission.connection(identity) {
        Ok(slot) => slot,
        Err(why) => {
            warn!(shard = ctx.shard, %peer, %identity, %why, "connection refused: connection budget");
            close_with(&conn, ErrorCode::Overloaded, &why.to_string());
            return;
        }
    };
    match identity {
        // The other node of this shard (its standby, or its designated primary restarted): the actor decides whether
        // this node leads and can seed it, or tells it to wait (NotPrimary) or to lead itself (Unseeded).
        PeerIdentity::Standby(k) | PeerIdentity::Shard(k) if k == ctx.shard => {
            let node = u64::from(matches!(identity, PeerIdentity::Standby(_)));
            serve_standby(conn, ctx, node).await;
            return;
        }
        PeerIdentity::Standby(k) | PeerIdentity::Shard(k) => {
            warn!(shard = ctx.shard, %peer, node_of = k, "refusing a node of another shard");
            close_with(&conn, ErrorCode::Unauthorized, "not a node of this shard");
            return;
        }
        _ if *ctx.role.borrow() != crate::replication::RoleKind::Primary => {
            debug!(shard = ctx.shard, %peer, "turning a worker away: this standby follows its primary");
            close_with(
                &conn,
                ErrorCode::NotPrimary,
                "standby following its primary",
            );
            return;
        }
        _ => {}
    }
    let handshake = async {
        let mut control = ControlChannel::accept(&conn).await?;
        let hello = server_accept_hello(&mut control, ctx.layout_hash, identity).await?;
        Ok::<_, NetError>((control, hello))
    };
    let (mut control, hello) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "hello refused");
            return;
        }
        Err(_) => {
            close_with(
                &conn,
                ErrorCode::BadFrame,
                "no hello within the handshake timeout",
            );
            return;
        }
    };
    let worker = hello.rank;
    let id: ConnId = ctx.next_conn.fetch_add(1, Ordering::Relaxed);
    let (kick_tx, kick_rx) = oneshot::channel();
    let welcome = match ctx
        .shard_actor
        .send(Hello {
            conn: id,
            worker,
            clock: hello.clock,
            kick: kick_tx,
        })
        .await
    {
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            let e = ProtocolError::Rejected {
                code: e.code(),
                message: e.to_string(),
            };
            reject(&conn, Some(&mut control), &e).await;
            return;
        }
        Err(_) => {
            close_with(&conn, ErrorCode::Shutdown, "shard is shutting down");
            return;
        }
    };
    if control.send(&welcome.into()).await.is_err() {
        ctx.shard_actor.do_send(Closed { conn: id });
        return;
    }
    info!(shard = ctx.shard, worker, %peer, clock = welcome.clock, "worker session started");
    let (sender, receiver) = control.split();
    let (out_tx, out_rx) = mpsc::channel(CONTROL_QUEUE);
    let writer = tokio::spawn(control_writer(sender, out_rx));
    let pushes = tokio::spawn(push_loop(
        conn.clone(),
        ctx.clone(),
        id,
        worker,
        out_tx.clone(),
    ));
    let connection = WorkerConnection {
        conn: conn.clone(),
        ctx: ctx.clone(),
        id,
        worker,
        out: out_tx,
        pulls: Arc::new(Semaphore::new(MAX_INFLIGHT_PULLS)),
    };
    tokio::select! {
        _ = connection.control_loop(receiver) => {}
        code = kick_rx => match code {
            Ok(Some(ErrorCode::Superseded)) => {
                info!(shard = ctx.shard, worker, "closing a connection a newer session of its worker superseded");
                close_with(&conn, ErrorCode::Superseded, "superseded by a newer session of this worker");
            }
            Ok(Some(code)) => {
                info!(shard = ctx.shard, worker, ?code, "closing the connection of an evicted worker");
                close_with(&conn, code, "evicted: reconnect and rejoin");
            }
            Ok(None) => {
                info!(shard = ctx.shard, worker, "worker left");
                // Let the writer deliver the last outcomes, then end in order.
                tokio::time::sleep(Duration::from_millis(50)).await;
                conn.close(0u32.into(), b"goodbye");
            }
            Err(_) => {}
        }
    }
    pushes.abort();
    writer.abort();
    ctx.shard_actor.do_send(Closed { conn: id });
    debug!(shard = ctx.shard, worker, "worker session ended");
}

/// Serves this shard's standby (the primary's side of replication): checks its hello against this shard, then streams
/// the log on one unidirectional stream and hands its acknowledgements to the actor until the link ends; then the
/// shard stops holding replies for it.
async fn serve_standby(conn: quinn::Connection, ctx: Arc<ConnectionContext>, node: u64) {
    let peer = conn.remote_address();
    let start = async {
        let mut control = ControlChannel::accept(&conn).await?;
        let hello = control.recv().await?;
        Ok::<_, NetError>((control, hello))
    };
    let (mut control, hello) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, start).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => {
            debug!(shard = ctx.shard, %peer, error = %e, "standby hello failed");
            return;
        }
        Err(_) => {
            close_with(
                &conn,
                ErrorCode::BadFrame,
                "no hello within the handshake timeout",
            );
            return;
        }
    };
    // The other node asks for this node's vote (see `crate::fence_link`).
    if let Control::LeaseRequest { shard, request } = hello {
        let Some(fence) = ctx.fence.clone().filter(|_| shard == ctx.shard) else {
            let e = ProtocolError::Rejected {
                code: ErrorCode::WrongShard,
                message: format!("shard {} takes no votes for shard {shard}", ctx.shard),
            };
            reject(&conn, Some(&mut control), &e).await;
            return;
        };
        let answer = move |r: &tether_common::fence::Request| fence.answer(node, r);
        if let Err(e) =
            crate::fence_link::serve_votes(control, ctx.shard, node, request, answer).await
        {
            debug!(shard = ctx.shard, %peer, error = %e, "vote link ended");
        }
        return;
    }
    let Control::ReplicaHello {
        shard,
        layout_hash,
        config_digest,
        incarnation,
    } = hello
    else {
        let e = ProtocolError::UnexpectedMessage(format!("{} from a standby", hello.name()));
        reject(&conn, Some(&mut control), &e).await;
        return;
    };
    if shard != ctx.shard {
        let e = ProtocolError::Rejected {
            code: ErrorCode::WrongShard,
            message: format!("this is shard {}, not shard {shard}", ctx.shard),
        };
        reject(&conn, Some(&mut control), &e).await;
        return;
    }
    let sub = match ctx
        .shard_actor
        .send(Subscribe {
            config_digest,
            layout_hash,
        })
        .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => {
            warn!(shard = ctx.shard, %peer, error = %e, "standby refused");
            let e = ProtocolError::Rejected {
                code: e.code(),
                message: e.to_string(),
            };
            reject(&conn, Some(&mut control), &e).await;
            return;
        }
        Err(_) => return,
    };
    let (acked, mut log, image_seq, link_id) = (sub.acked, sub.log, sub.seq, sub.link);
    // A standby that stops acknowledging while entries wait, and no longer takes the log's bytes, is dropped after
    // one lease (the primary then serves on alone, once the fence records it): `AckWatch` decides.
    let ack_deadline = Duration::from_millis(ctx.fence.as_ref().map_or(1000, |f| f.lease_ms()));
    let written = AtomicU64::new(image_seq);
    let link = async {
        control
            .send(&Control::ReplicaWelcome {
                lineage: sub.lineage,
                seq: image_seq,
            })
            .await?;
        let (_sender, mut receiver) = control.split();
        let mut stream = conn.open_uni().await?;
        let header = FrameHeader::encode(FrameKind::ReplicaImage, sub.image.len())?;
        stream.write_all(&header).await.map_err(NetError::Write)?;
        stream
            .write_all(&sub.image)
            .await
            .map_err(NetError::Write)?;
        drop(sub.image);
        info!(shard = ctx.shard, %peer, "standby following: replies wait for its acknowledgement");
        let writer = async {
            while let Some(entry) = log.recv().await {
                let header = FrameHeader::encode(FrameKind::Replica, entry.len())?;
                stream.write_all(&header).await.map_err(NetError::Write)?;
                stream.write_all(&entry).await.map_err(NetError::Write)?;
                written.fetch_add(1, Ordering::AcqRel);
            }
            Ok::<_, NetError>(())
        };
        let watchdog = async {
            let mut watch = AckWatch::new(ack_deadline);
            // Sent less declared lost: retransmissions into a cut link are not the log flowing.
            let delivered = || {
                let s = conn.stats();
                s.udp_tx.bytes.saturating_sub(s.path.lost_bytes)
            };
            let mut before = delivered();
            loop {
                tokio::time::sleep(ack_deadline / 4).await;
                let now_delivered = delivered();
                let w = written.load(Ordering::Acquire);
                let now_acked = (*acked.borrow()).min(w);
                if watch.tick(
                    std::time::Instant::now(),
                    now_acked,
                    w,
                    now_delivered.saturating_sub(before),
                ) {
                    return Err::<(), _>(NetError::Protocol(ProtocolError::Rejected {
                        code: ErrorCode::Overloaded,
                        message: "the standby stopped acknowledging the log".into(),
                    }));
                }
                before = now_delivered;
            }
        };
        let mut synced = false;
        let reader = async {
            loop {
                match receiver.recv().await? {
                    Control::ReplicaAck { seq } => {
                        // Never more than was sent: a standby cannot release what it has not taken.
                        let seq = seq.min(written.load(Ordering::Acquire));
                        acked.send_if_modified(|a| {
                            let newer = seq > *a && *a != u64::MAX;
                            if newer {
                                *a = seq;
                            }
                            newer
                        });
                        if !synced && seq >= image_seq {
                            synced = true;
                            ctx.shard_actor.do_send(StandbySynced {
                                link: link_id,
                                incarnation,
                            });
                        }
                    }
                    other => {
                        return Err(NetError::Protocol(ProtocolError::UnexpectedMessage(
                            format!("{} from a standby", other.name()),
                        )))
                    }
                }
            }
        };
        tokio::select! {
            r = writer => r,
            r = reader => r,
            r = watchdog => r,
        }
    };
    let ended = link.await;
    // Replies that wait for this standby now wait for the fence to record that the primary serves alone.
    ctx.shard_actor.do_send(ReplicaLost(link_id));
    match ended {
        Err(NetError::Protocol(p)) => reject(&conn, None, &p).await,
        Err(e) => {
            warn!(shard = ctx.shard, %peer, error = %e, "replication link to the standby ended")
        }
        Ok(()) => {}
    }
}

/// Writes queued control messages in order until the queue or the stream closes.
async fn control_writer(mut sender: ControlSender, mut queue: mpsc::Receiver<Control>) {
    while let Some(msg) = queue.recv().await {
        if sender.send(&msg).await.is_err() {
            return;
        }
    }
}

struct WorkerConnection {
    conn: quinn::Connection,
    ctx: Arc<ConnectionContext>,
    id: ConnId,
    worker: u32,
    out: mpsc::Sender<Control>,
    pulls: Arc<Semaphore>,
}

impl WorkerConnection {
    async fn control_loop(&self, mut control: ControlReceiver) {
        let (ctx, worker, id) = (&self.ctx, self.worker, self.id);
        loop {
            let msg = match control.recv().await {
                Ok(m) => m,
                Err(NetError::Protocol(p)) => {
                    self.violation(&p).await;
                    return;
                }
                Err(_) => return,
            };
            let alive = match msg {
                Control::Heartbeat { .. } => ctx
                    .shard_actor
                    .send(Heartbeat { conn: id, worker })
                    .await
                    .is_ok(),
                Control::PullRequest {
                    request,
                    clock,
                    mode,
                } => self.pull(request, clock, mode).await,
                // The shard closes the connection (through the kick) once the worker's last rounds are taken; the
                // push loop keeps running until then.
                Control::Goodbye { clock } => ctx
                    .shard_actor
                    .send(Goodbye {
                        conn: id,
                        worker,
                        clock,
                    })
                    .await
                    .is_ok(),
                Control::Error { code, message } => {
                    warn!(shard = ctx.shard, worker, ?code, %message, "worker reported an error");
                    return;
                }
                other => {
                    let e = ProtocolError::UnexpectedMessage(format!(
                        "{} after the handshake",
                        other.name()
                    ));
                    self.violation(&e).await;
                    return;
                }
            };
            if !alive {
                close_with(&self.conn, ErrorCode::Shutdown, "shard is shutting down");
                return;
            }
        }
    }

    async fn violation(&self, e: &ProtocolError) {
        // The message goes through the writer (which owns the stream); the close carries the same code.
        let _ = self.out.try_send(Control::error(e));
        tokio::time::sleep(Duration::from_millis(20)).await;
        reject(&self.conn, None, e).await;
    }

    /// Forwards one pull request; returns false when the shard actor is gone.
    async fn pull(&self, request: u64, clock: u64, mode: PullMode) -> bool {
        let refuse = move |code| Control::PullRefused { request, code };
        let Ok(permit) = self.pulls.clone().try_acquire_owned() else {
            let _ = self.out.send(refuse(ErrorCode::Overloaded)).await;
            return true;
        };
        let msg = Pull {
            conn: self.id,
            worker: self.worker,
            request,
            clock,
            mode,
        };
        let rx = match self.ctx.shard_actor.send(msg).await {
            Ok(Ok(rx)) => rx,
            // A node that does not hold the lease closes the connection: the worker finds the shard's primary.
            Ok(Err(ShardError::NotPrimary)) => {
                close_with(&self.conn, ErrorCode::NotPrimary, "not the shard's primary");
                return false;
            }
            Ok(Err(e)) => {
                debug!(shard = self.ctx.shard, worker = self.worker, error = %e, "pull refused");
                let _ = self.out.send(refuse(e.code())).await;
                return true;
            }
            Err(_) => return false,
        };
        let (conn, ctx, out) = (self.conn.clone(), self.ctx.clone(), self.out.clone());
        let worker = self.worker;
        tokio::spawn(async move {
            let _permit = permit;
            // Parked until the SSP gate opens; the connection closing drops this task.
            let reply = tokio::select! {
                r = rx => r,
                _ = conn.closed() => return,
            };
            let reply = match reply {
                Ok(Ok(r)) => r,
                Ok(Err(ShardError::NotPrimary)) => {
                    close_with(
                        &conn,
                        ErrorCode::NotPrimary,
                        "no longer the shard's primary",
                    );
                    return;
                }
                Ok(Err(e)) => {
                    let _ = out.send(refuse(e.code())).await;
                    return;
                }
                Err(_) => return,
            };
            // The protocol finished the reply: it goes on the wire as it is.
            match send_bulk_chunks(&conn, reply.kind, reply.chunks).await {
                Ok(()) => {}
                Err(NetError::Protocol(e)) => {
                    warn!(shard = ctx.shard, worker, error = %e, "cannot encode pull reply")
                }
                Err(e) => debug!(shard = ctx.shard, worker, error = %e, "pull reply not delivered"),
            }
        });
        true
    }
}

/// Reads push streams in stream order (which is the worker's clock order), forwards each frame to the shard and
/// sends its outcome back on the control stream.
async fn push_loop(
    conn: quinn::Connection,
    ctx: Arc<ConnectionContext>,
    id: ConnId,
    worker: u32,
    out: mpsc::Sender<Control>,
) {
    loop {
        let stream = match conn.accept_uni().await {
            Ok(s) => s,
            Err(_) => return,
        };
        let frame = match tokio::time::timeout(
            FRAME_TIMEOUT,
            recv_bulk(stream, &ctx.limits, FrameKind::Push),
        )
        .await
        {
            Ok(Ok(f)) => f,
            Ok(Err(NetError::Protocol(p))) => {
                reject(&conn, None, &p).await;
                return;
            }
            Ok(Err(_)) => return,
            Err(_) => {
                close_with(
                    &conn,
                    ErrorCode::Truncated,
                    "push frame not completed in time",
                );
                return;
            }
        };
        // Validated in place; the shard actor reads the same buffer again, without a copy.
        let meta = match access_push(&frame.body) {
            Ok(p) => p.meta(),
            Err(p) => {
                reject(&conn, None, &p).await;
                return;
            }
        };
        if meta.worker != worker {
            close_with(&conn, ErrorCode::Unauthorized, "push names another worker");
            return;
        }
        let outcome = match ctx
            .shard_actor
            .send(ApplyPush {
                conn: id,
                body: frame.body,
            })
            .await
        {
            Ok(Ok(a)) => a,
            Ok(Err(p)) => {
                reject(&conn, None, &p).await;
                return;
            }
            Err(_) => {
                close_with(&conn, ErrorCode::Shutdown, "shard is shutting down");
                return;
            }
        };
        if out
            .send(Control::PushOutcome {
                clock: meta.clock,
                outcome: outcome.outcome,
                term: outcome.term,
            })
            .await
            .is_err()
        {
            return;
        }
        if let Outcome::Refused(code) = outcome.outcome {
            match code {
                // Malformed or misaddressed frames are protocol violations: close this connection only.
                ErrorCode::BadFrame | ErrorCode::WrongShard | ErrorCode::BadRange => {
                    warn!(
                        shard = ctx.shard,
                        worker,
                        ?code,
                        "closing connection after a bad push"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    close_with(&conn, code, "bad push");
                    return;
                }
                // Not a member (evicted while its connection stayed up): closing makes it reconnect and rejoin.
                ErrorCode::Evicted => {
                    info!(
                        shard = ctx.shard,
                        worker, "push from an evicted worker: closing so that it rejoins"
                    );
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    close_with(&conn, code, "evicted: reconnect and rejoin");
                    return;
                }
                _ => debug!(shard = ctx.shard, worker, ?code, "push refused"),
            }
        }
    }
}
