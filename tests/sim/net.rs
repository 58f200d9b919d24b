//! The simulated network between the nodes: messages on ordered lanes (each QUIC stream stays FIFO, streams do not
//! order among each other), connections that break or stall, the timed event queue, and the moves that carry
//! messages between the real [`WorkerProtocol`]s and [`ShardProtocol`]s (draining their transmits and actions,
//! delivering what arrives). Every reply a worker uses and every reply a shard answers passes the checker on the way.

use std::cmp::Reverse;
use std::collections::BTreeMap;

use tether::common::protocol::{
    access_push, Control, ErrorCode, FrameKind, Outcome, PullMode, Welcome,
};
use tether::server::protocol::{Action, ConnId, FrameBody, Handled, Input};
use tether::worker::protocol::{Event, Settled, Transmit, Verdict};

use super::{bound, Phase, Sim, TICK_MS, TIMEOUT_MS, WORKERS};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Lane {
    ControlUp,
    PushUp,
    ControlDown,
    ReplyDown,
}

#[derive(Debug, Clone)]
pub(super) enum Payload {
    Control(Control),
    Push(bytes::Bytes),
    /// A pull reply as it travels: the frame the shard protocol finished, byte for byte.
    Reply {
        kind: FrameKind,
        body: rkyv::util::AlignedVec,
        /// Harness bookkeeping, not on the wire: the values the worker must end up with (the weights, or the public
        /// copy for a delta reply), and the shard's live members and their join clocks when it answered.
        expect: Vec<f32>,
        live: Vec<(usize, u64)>,
    },
}

#[derive(Debug, Clone)]
pub(super) struct Msg {
    pub(super) conn: ConnId,
    pub(super) worker: usize,
    pub(super) shard: usize,
    pub(super) lane: Lane,
    pub(super) payload: Payload,
}

#[derive(Debug)]
pub(super) enum Ev {
    Deliver(Msg),
    /// A connect attempt of `worker` to `shard` with this hello clock reaches the shard.
    ConnectArrive {
        worker: usize,
        shard: usize,
        incarnation: u64,
        clock: u64,
    },
    /// The welcome reaches the worker.
    Welcomed {
        worker: usize,
        shard: usize,
        incarnation: u64,
        conn: ConnId,
        welcome: Welcome,
    },
    /// A connect attempt failed (shard down).
    ConnectFailed {
        worker: usize,
        shard: usize,
        incarnation: u64,
    },
    ComputeDone {
        worker: usize,
        incarnation: u64,
    },
    WorkerRestart {
        worker: usize,
    },
    ShardRestart {
        shard: usize,
    },
    Unstall {
        conn: ConnId,
    },
}

pub(super) struct Conn {
    pub(super) worker: usize,
    pub(super) shard: usize,
    pub(super) alive: bool,
    /// Messages on this connection are held back until this time (a stalled link).
    pub(super) stalled_until: u64,
    /// Last delivery time per lane, to keep lanes FIFO.
    pub(super) lane_tail: BTreeMap<Lane, u64>,
}

impl Sim {
    pub(super) fn at(&mut self, t: u64, ev: Ev) {
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq)));
        self.events.insert(self.seq, ev);
    }

    pub(super) fn send(&mut self, msg: Msg) {
        let Some(c) = self.conns.get_mut(&msg.conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        let latency = 1 + self.rng.below(self.faults.max_latency_ms);
        let tail = c.lane_tail.get(&msg.lane).copied().unwrap_or(0);
        let t = (self.now + latency).max(tail).max(c.stalled_until);
        c.lane_tail.insert(msg.lane, t);
        let dup = self.rng.chance(self.faults.duplicate_per_mille);
        if dup {
            self.at(t, Ev::Deliver(msg.clone()));
        }
        self.at(t, Ev::Deliver(msg));
    }

    /// Moves a worker's transmits onto the network and acts on its events.
    pub(super) fn drain_worker(&mut self, w: usize) {
        loop {
            let mut progressed = false;
            while let Some(t) = self.workers[w].protocol.poll_transmit() {
                progressed = true;
                let (shard, lane, payload) = match t {
                    Transmit::Control { shard, msg } => {
                        (shard, Lane::ControlUp, Payload::Control(msg))
                    }
                    Transmit::Push {
                        shard,
                        clock,
                        bytes,
                    } => {
                        if self.workers[w].conns[shard].is_some() {
                            self.sent.push((w, shard, clock, bytes.clone()));
                        }
                        (shard, Lane::PushUp, Payload::Push(bytes))
                    }
                };
                if let Some(conn) = self.workers[w].conns[shard] {
                    self.send(Msg {
                        conn,
                        worker: w,
                        shard,
                        lane,
                        payload,
                    });
                }
            }
            while let Some(e) = self.workers[w].protocol.poll_event() {
                progressed = true;
                match e {
                    Event::PullDone { clock } => {
                        if self.workers[w].phase == Phase::Pulling {
                            let t = if let Some(ms) = self.workers[w].step_ms {
                                self.now + ms
                            } else if self.rng.chance(self.faults.slow_step_per_mille) {
                                // A step far longer than the eviction timeout: heartbeats must keep us live.
                                self.now
                                    + self.faults.slow_step_ms
                                    + self.rng.below(self.faults.slow_step_jitter_ms + 1)
                            } else {
                                self.now + 1 + self.rng.below(40)
                            };
                            self.workers[w].phase = Phase::Computing;
                            let inc = self.workers[w].incarnation;
                            self.at(
                                t,
                                Ev::ComputeDone {
                                    worker: w,
                                    incarnation: inc,
                                },
                            );
                            self.note(format!("w{w} pull done at clock {clock}"));
                        }
                    }
                    Event::Settled(settled) => {
                        // An accepted update: the worker learned that its push is in (applied now or before).
                        let Settled {
                            shard,
                            clock,
                            outcome,
                            ..
                        } = settled;
                        self.settled.insert((w, shard, clock));
                        if settled.verdict() == Verdict::Taken {
                            self.shards[shard].acked.insert((w, clock));
                        }
                        self.note(format!("w{w} s{shard} round {clock}: {outcome:?}"));
                    }
                    Event::Reconnect { shard } => {
                        if let Some(conn) = self.workers[w].conns[shard].take() {
                            self.break_conn(conn, false);
                        }
                        self.start_connect(w, shard);
                    }
                    // The simulated shards run without loss-spike rollback: their epoch never changes.
                    Event::RolledBack { shard, epoch } => {
                        panic!("w{w}: shard {shard} reported rollback epoch {epoch}")
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    pub(super) fn start_connect(&mut self, w: usize, shard: usize) {
        if self.workers[w].connecting[shard] {
            return;
        }
        self.workers[w].connecting[shard] = true;
        let hello = self.workers[w].protocol.hello(shard);
        let inc = self.workers[w].incarnation;
        let t = self.now + 1 + self.rng.below(50);
        if self.shards[shard].proto.is_some() {
            self.at(
                t,
                Ev::ConnectArrive {
                    worker: w,
                    shard,
                    incarnation: inc,
                    clock: hello.clock,
                },
            );
        } else {
            self.at(
                t + 100,
                Ev::ConnectFailed {
                    worker: w,
                    shard,
                    incarnation: inc,
                },
            );
        }
    }

    /// Breaks a connection. Messages still in flight towards the shard may yet arrive (a dead connection's last
    /// streams), the rest are lost.
    pub(super) fn break_conn(&mut self, conn: ConnId, notify_worker: bool) {
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        if !c.alive {
            return;
        }
        c.alive = false;
        let (w, k) = (c.worker, c.shard);
        self.note(format!("conn {conn} (w{w} s{k}) broken"));
        self.feed(k, Input::Closed { conn });
        if notify_worker
            && w < WORKERS
            && self.workers[w].conns[k] == Some(conn)
            && self.workers[w].phase != Phase::Crashed
        {
            self.workers[w].conns[k] = None;
            self.workers[w].protocol.disconnected(k);
            self.drain_worker(w);
        }
    }

    pub(super) fn drain_shard(&mut self, k: usize) -> Result<(), String> {
        self.observe_quorum(k);
        loop {
            let Some(action) = self.shards[k].proto.as_mut().and_then(|p| p.poll_action()) else {
                return Ok(());
            };
            match action {
                Action::Answer { pull: p, reply } => {
                    let proto = self.shards[k]
                        .proto
                        .as_ref()
                        .expect("shard is up: it produced an action");
                    // What the reply must give the worker: the weights, or the public copy it was cut from.
                    let expect = match p.mode {
                        PullMode::Delta { .. } => {
                            proto.public().map(|(_, v)| v.to_vec()).ok_or_else(|| {
                                format!("shard {k} answered a delta pull without a public copy")
                            })?
                        }
                        PullMode::Full(_) => proto.weights().to_vec(),
                    };
                    let mut body = rkyv::util::AlignedVec::new();
                    for c in &reply.chunks {
                        body.extend_from_slice(c);
                    }
                    let live = self.live_members(k);
                    // The values the worker will compute on must satisfy the guarantee for the pull's clock.
                    self.check_read(k, p.worker as usize, p.clock, &expect, &live)?;
                    self.send(Msg {
                        conn: p.conn,
                        worker: p.worker as usize,
                        shard: k,
                        lane: Lane::ReplyDown,
                        payload: Payload::Reply {
                            kind: reply.kind,
                            body,
                            expect,
                            live,
                        },
                    });
                }
                Action::Refuse {
                    conn,
                    request,
                    error,
                    ..
                } => {
                    let worker = self.conns.get(&conn).map(|c| c.worker);
                    if let Some(worker) = worker {
                        self.send(Msg {
                            conn,
                            worker,
                            shard: k,
                            lane: Lane::ControlDown,
                            payload: Payload::Control(Control::PullRefused {
                                request,
                                code: error.code(),
                            }),
                        });
                    }
                }
                Action::Close { conn, code: None } => {
                    // The orderly end after a goodbye whose rounds were all taken.
                    self.break_conn(conn, false);
                }
                Action::Close {
                    conn,
                    code: Some(ErrorCode::Superseded),
                } => {
                    // A newer hello of the same worker replaced this connection. An honest worker abandons a
                    // connection before it says hello on a new one, so its live session is never the one closed.
                    let w = self.conns[&conn].worker;
                    if w < WORKERS
                        && self.workers[w].conns[k] == Some(conn)
                        && self.workers[w].phase != Phase::Crashed
                    {
                        return Err(format!(
                            "shard {k} superseded worker {w}'s live connection {conn}: an honest worker fought itself"
                        ));
                    }
                    self.superseded.insert(conn);
                    self.break_conn(conn, false);
                }
                Action::Close {
                    conn,
                    code: Some(_),
                } => {
                    let c = &self.conns[&conn];
                    let (w, now) = (c.worker, self.now);
                    let heard = self.shards[k].last_heard.get(&w).copied().unwrap_or(0);
                    // The liveness rule, checked independently: only a worker silent for the timeout is evicted.
                    if now.saturating_sub(heard) + TICK_MS < TIMEOUT_MS {
                        return Err(format!(
                            "shard {k} evicted worker {w} at {now} ms, last heard at {heard} ms (timeout {TIMEOUT_MS})"
                        ));
                    }
                    self.shards[k].evictions += 1;
                    self.break_conn(conn, true);
                }
            }
        }
    }

    /// Shard `k` takes a push frame (or skip marker) of worker `w` on connection `conn` through its protocol, and the
    /// checker reads what it did: a round applied more than `s + 1` ahead of the minimum clock, or from a connection a
    /// newer session superseded, fails the schedule. The outcome goes back on the connection.
    pub(super) fn take_push(
        &mut self,
        k: usize,
        conn: ConnId,
        w: usize,
        bytes: bytes::Bytes,
    ) -> Result<(), String> {
        let now = self.now;
        let frame = access_push(&bytes).map_err(|e| format!("a bad frame was built: {e}"))?;
        let meta = frame.meta();
        self.pushes.push((w, k, meta.clock, bytes.clone()));
        let Some(proto) = self.shards[k].proto.as_ref() else {
            return Ok(());
        };
        // The rounds a push may be ahead of are counted from the q-th most advanced live clock (the minimum without
        // a quorum) read from the table's rows, or the highest it reached since the shard started (a round closed
        // then stays closed when members leave): never from the gate the shard computed.
        let live_before = proto.core().clocks().live();
        let min_before = match self.faults.quorum {
            0 => proto.core().clocks().min_clock(),
            _ => self
                .quorum_clock(k)
                .unwrap_or(0)
                .max(self.shards[k].quorum_high),
        };
        let gate_before = proto.core().clocks().gate();
        let push = Input::Push {
            conn,
            now_ms: now,
            body: FrameBody::copy_from(&bytes),
        };
        let outcome = match self.feed(k, push) {
            Some(Handled::Round(outcome, _)) => outcome,
            other => return Err(format!("a push handled as {other:?}")),
        };
        self.observe_quorum(k);
        if outcome == Outcome::Applied {
            if let Some(s) = bound(self.faults.staleness) {
                if live_before > 0 && meta.clock > min_before + s + 1 {
                    return Err(format!(
                        "shard {k} applied w{w}'s round {} more than s + 1 = {} ahead of the quorum's clock {min_before}",
                        meta.clock,
                        s + 1
                    ));
                }
            }
            if !meta.skip && live_before > 0 && meta.clock < gate_before {
                self.late_merges += 1;
            }
            if self.shards[k].newest_conn.get(&w) != Some(&conn) {
                return Err(format!(
                    "shard {k} applied w{w}'s round {} from connection {conn}, superseded by {:?}",
                    meta.clock,
                    self.shards[k].newest_conn.get(&w)
                ));
            }
            if w < WORKERS {
                let high = &mut self.shards[k].honest_high;
                *high = (*high).max(meta.clock + 1);
            }
        }
        if outcome == Outcome::Applied && meta.skip {
            self.shards[k]
                .skipped
                .entry(w)
                .or_default()
                .insert(meta.clock);
        }
        self.note(format!(
            "s{k} took w{w} round {} (skip {}) on conn {conn}: {outcome:?}",
            meta.clock, meta.skip
        ));
        self.maybe_snapshot(k);
        self.send(Msg {
            conn,
            worker: w,
            shard: k,
            lane: Lane::ControlDown,
            payload: Payload::Control(Control::PushOutcome {
                clock: meta.clock,
                outcome,
                term: self.shards[k].proto.as_ref().map_or(0, |p| p.term()),
            }),
        });
        self.drain_shard(k)
    }

    /// Delivers one message: to the shard (a heartbeat, pull, goodbye or push, answered through its protocol) or to
    /// the worker (an outcome, refusal or reply, read through its protocol), checking every reply the worker uses.
    pub(super) fn deliver_msg(&mut self, msg: Msg) -> Result<(), String> {
        let Some(c) = self.conns.get(&msg.conn) else {
            return Ok(());
        };
        let upward = matches!(msg.lane, Lane::ControlUp | Lane::PushUp);
        if !c.alive {
            // Towards the shard, a dead connection's last streams may still arrive; towards the worker, nothing does.
            if !upward || !self.rng.chance(self.faults.late_per_mille) {
                return Ok(());
            }
        }
        let (w, k, conn) = (msg.worker, msg.shard, msg.conn);
        if upward {
            if self.shards[k].proto.is_none() {
                return Ok(());
            }
            // A sign of life is a message on the worker's newest connection to this shard; a dead or superseded
            // connection's late streams (pushes included) are old news.
            if self.shards[k].newest_conn.get(&w) == Some(&conn) {
                self.shards[k].last_heard.insert(w, self.now);
            }
            let now = self.now;
            match msg.payload {
                Payload::Control(Control::Heartbeat { .. }) => {
                    self.feed(
                        k,
                        Input::Heartbeat {
                            conn,
                            worker: w as u32,
                            now_ms: now,
                        },
                    );
                }
                Payload::Control(Control::PullRequest {
                    request,
                    clock,
                    mode,
                }) => {
                    let pull = Input::Pull {
                        conn,
                        worker: w as u32,
                        request,
                        clock,
                        mode,
                        now_ms: now,
                    };
                    if let Some(Handled::Pull(Err(e))) = self.feed(k, pull) {
                        self.send(Msg {
                            conn,
                            worker: w,
                            shard: k,
                            lane: Lane::ControlDown,
                            payload: Payload::Control(Control::PullRefused {
                                request,
                                code: e.code(),
                            }),
                        });
                    }
                }
                Payload::Control(Control::Goodbye { clock }) => {
                    self.feed(
                        k,
                        Input::Goodbye {
                            conn,
                            worker: w as u32,
                            clock,
                            now_ms: now,
                        },
                    );
                }
                Payload::Control(other) => return Err(format!("worker sent {other:?}")),
                Payload::Push(bytes) => self.take_push(k, conn, w, bytes)?,
                Payload::Reply { .. } => return Err("reply travelling up".into()),
            }
            self.drain_shard(k)?;
        } else {
            // The hostile member reads nothing it is sent.
            if w >= WORKERS
                || self.workers[w].phase == Phase::Crashed
                || self.workers[w].conns[k] != Some(conn)
            {
                return Ok(());
            }
            match msg.payload {
                Payload::Control(Control::PushOutcome {
                    clock,
                    outcome,
                    term,
                }) => self.workers[w]
                    .protocol
                    .outcome(k, clock, outcome, term)
                    .map_err(|e| format!("worker {w} refused shard {k}'s outcome: {e}"))?,
                Payload::Control(Control::PullRefused { request, code }) => {
                    self.workers[w].protocol.pull_refused(k, request, code)
                }
                Payload::Reply {
                    kind,
                    body,
                    expect,
                    live,
                } => {
                    // The driver's own reply path: validate, judge, decode into the parameters.
                    let sw = &mut self.workers[w];
                    let used = sw
                        .protocol
                        .handle_reply(k, kind, &body, Some(&mut sw.params))
                        .map_err(|e| format!("worker {w} cannot use shard {k}'s reply: {e}"))?;
                    if used {
                        self.used_replies += 1;
                        let (start, end) = self.ranges(k);
                        let got = &self.workers[w].params[start..end];
                        if got
                            .iter()
                            .zip(&expect)
                            .any(|(a, b)| a.to_bits() != b.to_bits())
                        {
                            return Err(format!(
                                "worker {w} read shard {k}'s {kind:?} reply into other bits than the shard answered with"
                            ));
                        }
                        if kind == FrameKind::Delta
                            && self.workers[w].protocol.public_values()[start..end] != expect[..]
                        {
                            return Err(format!(
                                "worker {w} holds another public copy of shard {k} than the shard"
                            ));
                        }
                        // What the worker computes on must satisfy the guarantee for the clock it pulls at.
                        let pulling_at = self.workers[w].protocol.clock();
                        let values = self.workers[w].params[start..end].to_vec();
                        self.check_read(k, w, pulling_at, &values, &live)?;
                    }
                }
                other => return Err(format!("shard sent {other:?}")),
            }
            self.drain_worker(w);
        }
        Ok(())
    }
}
