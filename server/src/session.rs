//! One task per QUIC connection: authenticate the peer from its certificate, run the hello/welcome handshake, then
//! forward control messages and gradient pushes to the `ShardActor`. Every frame is size-checked before it is read
//! and validated before it is forwarded; a protocol violation closes only this connection with a typed code and
//! never reaches shard state. Pulls that the SSP gate parks are answered from their own small task.

use std::sync::Arc;
use std::time::Duration;

use actix::Addr;
use tracing::{debug, info, warn};

use tether_common::net::{
    close_with, peer_identity, recv_bulk, reject, send_bulk, server_accept_hello, ControlChannel,
    NetError,
};
use tether_common::protocol::{
    decode_push, encode_params, Control, ErrorCode, FrameKind, FrameLimits, ParamReply,
    ProtocolError, Welcome,
};

use crate::actor::{ApplyPush, Heartbeat, Join, Leave, Pull, ShardActor};
use crate::shard::ShardError;

/// A peer must finish the handshake within this time.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A bulk frame must arrive completely within this time once its stream is open (slow-loris bound).
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);
/// On goodbye, wait at most this long for the worker's last pushes to be handled before it leaves the table.
const GOODBYE_DRAIN: Duration = Duration::from_secs(10);

/// What every session of one shard shares.
#[derive(Clone)]
pub struct SessionContext {
    /// The shard's actor.
    pub shard_actor: Addr<ShardActor>,
    /// Shard index.
    pub shard: u32,
    /// Shard range.
    pub range: (u64, u64),
    /// Layout fingerprint peers must match.
    pub layout_hash: u64,
    /// SSP bound announced in the welcome.
    pub staleness: Option<u32>,
    /// Frame size limits for this shard.
    pub limits: FrameLimits,
}

/// Serves one incoming connection until it closes.
pub async fn serve_connection(incoming: quinn::Incoming, ctx: Arc<SessionContext>) {
    let peer = incoming.remote_address();
    let conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, incoming).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            debug!(%peer, error = %e, "TLS/QUIC handshake refused");
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
    let Ok(info) = ctx.shard_actor.send(Join { worker, clock: 0 }).await else {
        close_with(&conn, ErrorCode::Shutdown, "shard is shutting down");
        return;
    };
    let welcome = Welcome {
        shard: ctx.shard,
        range_start: ctx.range.0,
        range_end: ctx.range.1,
        staleness: ctx.staleness,
        min_clock: info.clock,
        version: info.version,
    };
    if control.send(&welcome.into()).await.is_err() {
        return;
    }
    info!(shard = ctx.shard, worker, %peer, clock = info.clock, "worker session started");
    let (applied_tx, applied_rx) = tokio::sync::watch::channel(0u64);
    let pushes = tokio::spawn(push_loop(conn.clone(), ctx.clone(), worker, applied_tx));
    control_loop(&conn, &mut control, &ctx, worker, applied_rx).await;
    pushes.abort();
    debug!(shard = ctx.shard, worker, "worker session ended");
}

async fn control_loop(
    conn: &quinn::Connection,
    control: &mut ControlChannel,
    ctx: &Arc<SessionContext>,
    worker: u32,
    mut applied: tokio::sync::watch::Receiver<u64>,
) {
    // The clock the worker last announced in a heartbeat: on goodbye, its pushes up to there are handled first.
    let mut announced = 0u64;
    loop {
        let msg = match control.recv().await {
            Ok(m) => m,
            Err(NetError::Protocol(p)) => {
                reject(conn, Some(control), &p).await;
                return;
            }
            Err(_) => return,
        };
        let sent = match msg {
            Control::Heartbeat { clock } => {
                announced = clock;
                ctx.shard_actor.send(Heartbeat { worker }).await.is_ok()
            }
            // The worker announces its clock: after a restart or a refused round it may be ahead of our table.
            Control::Clock { clock } => ctx.shard_actor.send(Join { worker, clock }).await.is_ok(),
            Control::PullRequest { clock, precision } => {
                let conn = conn.clone();
                let ctx = ctx.clone();
                tokio::spawn(async move { answer_pull(conn, ctx, worker, clock, precision).await });
                true
            }
            Control::Goodbye => {
                // Pushes travel on their own streams and may still be queued behind this message.
                let drained = applied.wait_for(|c| *c >= announced);
                let _ = tokio::time::timeout(GOODBYE_DRAIN, drained).await;
                let _ = ctx.shard_actor.send(Leave { worker }).await;
                info!(shard = ctx.shard, worker, "worker left");
                return;
            }
            Control::Error { code, message } => {
                warn!(shard = ctx.shard, worker, ?code, %message, "worker reported an error");
                return;
            }
            other => {
                let e = ProtocolError::UnexpectedMessage(format!(
                    "{} after the handshake",
                    other.name()
                ));
                reject(conn, Some(control), &e).await;
                return;
            }
        };
        if !sent {
            close_with(conn, ErrorCode::Shutdown, "shard is shutting down");
            return;
        }
    }
}

async fn answer_pull(
    conn: quinn::Connection,
    ctx: Arc<SessionContext>,
    worker: u32,
    clock: u64,
    precision: tether_common::protocol::Precision,
) {
    let Ok(rx) = ctx
        .shard_actor
        .send(Pull {
            worker,
            clock,
            precision,
        })
        .await
    else {
        return;
    };
    // Parked until the SSP gate opens; the connection closing drops this task.
    let reply = tokio::select! {
        r = rx => r,
        _ = conn.closed() => return,
    };
    let reply = match reply {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            close_with(&conn, e.code(), &e.to_string());
            return;
        }
        Err(_) => return,
    };
    let frame = ParamReply {
        shard: ctx.shard,
        clock: reply.clock,
        version: reply.version,
        min_clock: reply.min_clock,
        range_start: ctx.range.0,
        range_end: ctx.range.1,
        precision,
        values: reply.values,
    };
    match encode_params(&frame) {
        Ok(bytes) => {
            if let Err(e) = send_bulk(&conn, FrameKind::Params, &bytes).await {
                debug!(shard = ctx.shard, worker, error = %e, "pull reply not delivered");
            }
        }
        Err(e) => warn!(shard = ctx.shard, worker, error = %e, "cannot encode pull reply"),
    }
}

async fn push_loop(
    conn: quinn::Connection,
    ctx: Arc<SessionContext>,
    worker: u32,
    applied: tokio::sync::watch::Sender<u64>,
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
        let push = match decode_push(&frame.body) {
            Ok(p) => p,
            Err(p) => {
                reject(&conn, None, &p).await;
                return;
            }
        };
        drop(frame);
        if push.worker != worker {
            close_with(&conn, ErrorCode::Unauthorized, "push names another worker");
            return;
        }
        let msg = ApplyPush {
            worker,
            clock: push.clock,
            shard: push.shard,
            range: (push.range_start, push.range_end),
            read_version: push.read_version,
            payload: push.payload,
        };
        let next_clock = push.clock + 1;
        let result = ctx.shard_actor.send(msg).await;
        applied.send_replace(next_clock);
        match result {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                let code = e.code();
                match e {
                    // Malformed or misaddressed frames are protocol violations: close this connection only.
                    ShardError::Codec(_)
                    | ShardError::WrongShard { .. }
                    | ShardError::BadRange { .. } => {
                        warn!(shard = ctx.shard, worker, error = %e, "closing connection after a bad push");
                        close_with(&conn, code, &e.to_string());
                        return;
                    }
                    // Evicted while its connection stayed up (a partition shorter than the idle timeout): closing
                    // makes the worker reconnect, and its handshake rejoins it at a clock the table accepts.
                    ShardError::NotMember(_) => {
                        info!(
                            shard = ctx.shard,
                            worker, "push from an evicted worker: closing so that it rejoins"
                        );
                        close_with(&conn, code, &e.to_string());
                        return;
                    }
                    // Refused but well-formed: counted by the shard, the session goes on.
                    _ => debug!(shard = ctx.shard, worker, error = %e, "push refused"),
                }
            }
            Err(_) => {
                close_with(&conn, ErrorCode::Shutdown, "shard is shutting down");
                return;
            }
        }
    }
}
