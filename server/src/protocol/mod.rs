//! `ShardProtocol`: the server side of the Tether protocol for one shard, as a sans-IO state machine in the spirit
//! of quinn-proto. It owns the [`ShardCore`] and every protocol rule around it: which connection speaks for which
//! worker, the explicit rejoin at hello, heartbeats and eviction, idempotent pushes and skip markers (by worker and
//! clock), the checks on every pull (membership, clock) with a per-worker bound on parked pulls, and leaving.
//!
//! It takes messages and `now_ms` and returns outcomes; finished pull replies (the frame bodies, byte for byte what
//! goes on the wire: see [`reply`]), refusals and connections that must be closed come out of
//! [`ShardProtocol::poll_action`]. No sockets, actors, timers or threads: the `ShardActor` and the per-connection
//! connection tasks only move bytes and timers. Invariants:
//! - one session per identity: a hello supersedes the worker's older connection, which is closed with
//!   [`ErrorCode::Superseded`]; pushes, skips, pulls and heartbeats on it are refused or ignored and change nothing;
//! - only configured ranks join (`0..cluster.workers`), and a hello's clock claim is bounded (see
//!   [`crate::clock`]); a round more than `s + 1` ahead of the minimum clock is refused;
//! - a pull is answered only when the SSP gate of the clock table allows it, and only for a live member at a clock
//!   the protocol allows (`own ≤ clock ≤ own + s + 1`);
//! - a member at the minimum clock that makes no progress for the progress deadline while another worker's pull
//!   waits on the gate is evicted like a silent one;
//! - a push or skip for `(worker, clock)` changes the weights at most once; a resend of an applied one is
//!   acknowledged as [`Outcome::Duplicate`] and changes nothing;
//! - every peer-supplied number goes through checked arithmetic and fails with a typed [`ShardError`];
//! - at most [`MAX_PARKED_PER_WORKER`] pulls per worker wait on the gate, so no peer can take the others' slots.

mod input;
pub mod reply;

use std::collections::{BTreeMap, VecDeque};

use tether_common::config::Staleness;
use tether_common::protocol::{
    access_push, ArchivedPushFrame, ErrorCode, Outcome, ProtocolError, PublicRef, PullMode,
    ReplyHeader, Welcome,
};

use crate::checkpoint::ShardSnapshot;
use crate::shard::{Applied, Push, ShardCore, ShardError, ShardStats, MAX_CLOCK};

pub use input::{FrameBody, Handled, Input};
pub use reply::WireReply;

/// Identifies one connection to this shard; the shell assigns them, never reusing one.
pub type ConnId = u64;

/// At most this many pulls of one worker wait on the SSP gate at once (an honest worker has one per shard).
pub const MAX_PARKED_PER_WORKER: usize = 2;

/// After a goodbye, a worker's rounds still in flight are waited for at most this long before it leaves anyway.
pub const GOODBYE_DRAIN_MS: u64 = 10_000;

/// Outcomes of recent rounds remembered per worker, to answer resends idempotently.
const OUTCOME_WINDOW: usize = 128;

/// A pull the gate released: who asked for what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadyPull {
    /// The token [`ShardProtocol::pull`] returned.
    pub token: u64,
    /// The connection that asked.
    pub conn: ConnId,
    /// The worker.
    pub worker: u32,
    /// The worker's request id (travels back in the reply).
    pub request: u64,
    /// The pull's clock.
    pub clock: u64,
    /// How the worker wants its answer.
    pub mode: PullMode,
}

/// Something the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send this finished reply to the pull on its connection (a `reply.kind` frame whose body is `reply.chunks`).
    Answer {
        /// The pull it answers.
        pull: ReadyPull,
        /// The frame, as it goes on the wire.
        reply: WireReply,
    },
    /// Refuse this parked pull: it will never be answered (its worker left, was evicted or reconnected).
    Refuse {
        /// The pull's token.
        token: u64,
        /// The connection that asked.
        conn: ConnId,
        /// The worker's request id.
        request: u64,
        /// Why.
        error: ShardError,
    },
    /// Close this connection: with an error code (an evicted worker whose connection is still up reconnects and
    /// rejoins), or `None` for the orderly end after a goodbye whose rounds were all taken.
    Close {
        /// The connection.
        conn: ConnId,
        /// The close code (`None`: orderly).
        code: Option<ErrorCode>,
    },
}

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Parked {
    token: u64,
    conn: ConnId,
    worker: u32,
    request: u64,
    clock: u64,
    mode: PullMode,
}

/// Per-worker protocol state besides its clock-table row.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
struct Member {
    /// The connection that speaks for the worker now (pulls and heartbeats on older ones are ignored).
    conn: Option<ConnId>,
    /// Outcomes of the most recent rounds, oldest first, for idempotent resends.
    outcomes: VecDeque<(u64, Outcome)>,
    /// Said goodbye at this clock on this connection; leaves once its rounds below it are taken, or at the deadline.
    leaving: Option<Leaving>,
}

#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
struct Leaving {
    conn: ConnId,
    clock: u64,
    deadline_ms: u64,
}

impl Member {
    fn remember(&mut self, clock: u64, outcome: Outcome) {
        if self.outcomes.len() == OUTCOME_WINDOW {
            self.outcomes.pop_front();
        }
        self.outcomes.push_back((clock, outcome));
    }

    fn outcome_of(&self, clock: u64) -> Option<Outcome> {
        self.outcomes
            .iter()
            .rev()
            .find(|(c, _)| *c == clock)
            .map(|(_, o)| *o)
    }
}

/// One push or skip marker as the protocol sees it.
#[derive(Debug, Clone, Copy)]
pub enum Round<'a> {
    /// A gradient push.
    Push(Push<'a>),
    /// A skip marker: `worker` finished round `clock` without an update.
    Skip {
        /// The worker.
        worker: u32,
        /// The round.
        clock: u64,
    },
}

impl<'a> Round<'a> {
    /// The round a validated push frame carries: a skip marker or a push of its payload.
    pub fn from_frame(frame: &'a ArchivedPushFrame) -> Round<'a> {
        let meta = frame.meta();
        if meta.skip {
            Round::Skip {
                worker: meta.worker,
                clock: meta.clock,
            }
        } else {
            Round::Push(Push {
                worker: meta.worker,
                clock: meta.clock,
                shard: meta.shard,
                range: (meta.range_start, meta.range_end),
                read_version: meta.read_version,
                payload: frame.payload(),
            })
        }
    }

    fn worker(&self) -> u32 {
        match self {
            Round::Push(p) => p.worker,
            Round::Skip { worker, .. } => *worker,
        }
    }

    fn clock(&self) -> u64 {
        match self {
            Round::Push(p) => p.clock,
            Round::Skip { clock, .. } => *clock,
        }
    }
}

/// What waits in the action queue: a released pull is turned into its finished reply only when polled.
#[derive(Debug, Clone)]
enum Queued {
    Answer(ReadyPull),
    Do(Action),
}

/// The server side of the protocol for one shard.
///
/// Call order (as quinn-proto's `Connection`): the shell owns one `ShardProtocol` per shard and feeds every input
/// through the one entry, [`handle`](Self::handle), as an [`Input`] carrying the current `now_ms` (the replication
/// log carries the same inputs, so a standby feeds the same entry), then drains [`poll_action`](Self::poll_action)
/// until it returns `None` and carries every action out:
/// - a connection authenticated and sent its hello → [`Input::Hello`] (send the returned [`Welcome`]);
/// - any control message from a worker → [`Input::Heartbeat`] (pulls and goodbyes count as well);
/// - a validated push frame → [`Input::Push`]; send back the outcome;
/// - a pull request → [`Input::Pull`]; an `Err` is refused at once, an `Ok` token is answered or refused later
///   through [`Action::Answer`] / [`Action::Refuse`] (the reply is finished: send `reply.chunks` as they are);
/// - a goodbye → [`Input::Goodbye`]; a connection closed → [`Input::Closed`]; a requester gone before its answer
///   → [`Input::Cancel`];
/// - on a timer (a fraction of the eviction timeout) → [`Input::Tick`], which evicts silent workers and ends
///   goodbye drains.
///
/// The typed methods ([`hello`](Self::hello), [`push_frame`](Self::push_frame), ...) build the input and feed
/// [`handle`](Self::handle) too; they are for harnesses and tests, which keep no log.
///
/// Read-only views ([`version`](Self::version), [`stats`](Self::stats), [`snapshot`](Self::snapshot), ...) serve
/// metrics and checkpoints; they change nothing.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct ShardProtocol {
    core: ShardCore,
    members: BTreeMap<u32, Member>,
    parked: Vec<Parked>,
    /// Empty whenever an image is taken (the shell drains it after every input).
    #[serde(skip)]
    actions: VecDeque<Queued>,
    next_token: u64,
    /// The highest connection id any input named: a shard that takes over hands out ids above it.
    max_conn: ConnId,
    /// Converted values of full replies, kept between replies so the allocation is reused.
    #[serde(skip)]
    scratch: Vec<u8>,
    /// The fence term this node serves in (0: unfenced), stamped on every welcome and reply it builds. Node-local:
    /// not in images or the log (a standby that takes over serves in its own term).
    #[serde(skip)]
    term: u64,
}

impl ShardProtocol {
    /// Wraps a shard core (fresh or restored).
    pub fn new(core: ShardCore) -> Self {
        Self {
            core,
            members: BTreeMap::new(),
            parked: Vec::new(),
            actions: VecDeque::new(),
            next_token: 0,
            max_conn: 0,
            scratch: Vec::new(),
            term: 0,
        }
    }

    /// Sets the fence term that the welcomes and replies built from now on carry (the shell calls it whenever it
    /// is about to serve).
    pub fn set_term(&mut self, term: u64) {
        self.term = term;
    }

    /// The fence term welcomes and replies carry.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Completes a decoded protocol (a peer's state image, see [`crate::replication::image`]) with `local`'s settings and
    /// scratch, after checking its shapes: outcome windows and parked pulls within their bounds, every parked token
    /// below the next one, and the core (see [`ShardCore::adopt_local`]). Changes only `self`.
    pub(crate) fn adopt_local(&mut self, local: &ShardProtocol) -> Result<(), String> {
        if self
            .members
            .values()
            .any(|m| m.outcomes.len() > OUTCOME_WINDOW)
        {
            return Err("an outcome window is longer than the protocol keeps".into());
        }
        for p in &self.parked {
            if p.token >= self.next_token {
                return Err("a parked pull's token was never handed out".into());
            }
            if self.parked.iter().filter(|q| q.worker == p.worker).count() > MAX_PARKED_PER_WORKER {
                return Err(format!("worker {} has too many parked pulls", p.worker));
            }
        }
        self.core.adopt_local(&local.core)?;
        self.actions.clear();
        self.scratch.clear();
        self.term = local.term;
        Ok(())
    }

    /// Whether actions wait in the queue (an image is taken only with none pending).
    pub(crate) fn has_pending_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    /// The highest connection id any hello named: a shard that takes over hands out ids above it.
    pub fn max_conn(&self) -> ConnId {
        self.max_conn
    }

    /// The shard core (weights, version, clock table, counters), read-only.
    pub fn core(&self) -> &ShardCore {
        &self.core
    }

    /// Mutable access to the core, for restores and tests; protocol state is not touched.
    pub fn core_mut(&mut self) -> &mut ShardCore {
        &mut self.core
    }

    /// Shard index.
    pub fn shard(&self) -> u32 {
        self.core.shard()
    }

    /// Shard version (updates applied, counting a restore's).
    pub fn version(&self) -> u64 {
        self.core.version()
    }

    /// The shard's rollback epoch (loss-spike rollbacks made).
    pub fn epoch(&self) -> u64 {
        self.core.epoch()
    }

    /// Live members of the clock table.
    pub fn live(&self) -> usize {
        self.core.clocks().live()
    }

    /// The shard's counters.
    pub fn stats(&self) -> &ShardStats {
        self.core.stats()
    }

    /// The current weights.
    pub fn weights(&self) -> &[f32] {
        self.core.weights()
    }

    /// The newest cut of the public copy and its values, once a delta pull created one.
    pub fn public(&self) -> Option<(PublicRef, &[f32])> {
        self.core.public().map(|p| (p.newest(), p.values()))
    }

    /// Whether the loss-spike detector suspects a spike now (a checkpoint taken now could capture it).
    pub fn spike_suspected(&self) -> bool {
        self.core.rollback().is_some_and(|r| r.suspect())
    }

    /// A consistent copy of everything a checkpoint holds.
    pub fn snapshot(&self) -> ShardSnapshot {
        self.core.snapshot()
    }

    /// Pulls waiting on the SSP gate.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }

    /// The next thing the shell must do, if any. A released pull comes out as its finished reply, built from the
    /// weights (or the public copy) as they are now and counted in the shard's stats; a reply that cannot be built
    /// (a public cut of non-finite weights) comes out as a refusal.
    pub fn poll_action(&mut self) -> Option<Action> {
        match self.actions.pop_front()? {
            Queued::Do(action) => Some(action),
            Queued::Answer(pull) => Some(self.finish(pull)),
        }
    }

    /// Builds the reply to a released pull.
    fn finish(&mut self, pull: ReadyPull) -> Action {
        let range = self.core.range();
        let header = ReplyHeader {
            shard: self.core.shard(),
            request: pull.request,
            clock: pull.clock,
            version: self.core.version(),
            min_clock: self.core.clocks().gate(),
            epoch: self.core.epoch(),
            range_start: range.start,
            range_end: range.end,
            term: self.term,
        };
        let built = match pull.mode {
            PullMode::Full(precision) => {
                reply::full_reply(header, self.core.weights(), precision, &mut self.scratch)
                    .map_err(|e| ShardError::Codec(e.to_string()))
            }
            PullMode::Delta { have } => self
                .core
                .answer_public(have)
                .map_err(|e| ShardError::Codec(e.to_string()))
                .and_then(|a| {
                    reply::delta_reply(header, a).map_err(|e| ShardError::Codec(e.to_string()))
                }),
        };
        match built {
            Ok(reply) => {
                self.core.answered(pull.clock, reply.payload_bytes);
                Action::Answer { pull, reply }
            }
            Err(error) => {
                tracing::warn!(shard = self.core.shard(), error = %error, "cannot build a pull reply");
                Action::Refuse {
                    token: pull.token,
                    conn: pull.conn,
                    request: pull.request,
                    error,
                }
            }
        }
    }

    /// Feeds one input: the one entry through which anything changes this protocol (see the type's docs).
    pub fn handle(&mut self, input: &Input) -> Handled {
        match input {
            Input::Hello {
                conn,
                worker,
                clock,
                now_ms,
            } => Handled::Welcome(self.on_hello(*conn, *worker, *clock, *now_ms)),
            Input::Heartbeat {
                conn,
                worker,
                now_ms,
            } => {
                self.on_heartbeat(*conn, *worker, *now_ms);
                Handled::Done
            }
            Input::Goodbye {
                conn,
                worker,
                clock,
                now_ms,
            } => {
                self.on_goodbye(*conn, *worker, *clock, *now_ms);
                Handled::Done
            }
            Input::Closed { conn } => {
                self.on_closed(*conn);
                Handled::Done
            }
            Input::Push { conn, now_ms, body } => match access_push(body.as_slice()) {
                Ok(frame) => {
                    let (outcome, result) = self.on_push_frame(*conn, frame, *now_ms);
                    Handled::Round(outcome, result)
                }
                Err(e) => Handled::BadFrame(e),
            },
            Input::Pull {
                conn,
                worker,
                request,
                clock,
                mode,
                now_ms,
            } => Handled::Pull(self.on_pull(*conn, *worker, *request, *clock, *mode, *now_ms)),
            Input::Cancel { token } => {
                self.on_cancel(*token);
                Handled::Done
            }
            Input::Tick { now_ms } => Handled::Evicted(self.on_tick(*now_ms)),
        }
    }

    /// [`Input::Hello`] through [`handle`](Self::handle).
    pub fn hello(
        &mut self,
        conn: ConnId,
        worker: u32,
        clock: u64,
        now_ms: u64,
    ) -> Result<Welcome, ShardError> {
        match self.handle(&Input::Hello {
            conn,
            worker,
            clock,
            now_ms,
        }) {
            Handled::Welcome(w) => w,
            // `handle` answers every hello with `Handled::Welcome`.
            other => unreachable!("a hello handled as {other:?}"),
        }
    }

    /// [`Input::Heartbeat`] through [`handle`](Self::handle).
    pub fn heartbeat(&mut self, conn: ConnId, worker: u32, now_ms: u64) {
        self.handle(&Input::Heartbeat {
            conn,
            worker,
            now_ms,
        });
    }

    /// [`Input::Push`] of a push frame body (copied into an aligned buffer) through [`handle`](Self::handle): the
    /// outcome and what the shard did, or the frame's validation error (nothing changed).
    pub fn push_frame(
        &mut self,
        conn: ConnId,
        body: &[u8],
        now_ms: u64,
    ) -> Result<(Outcome, Result<Option<Applied>, ShardError>), ProtocolError> {
        match self.handle(&Input::Push {
            conn,
            now_ms,
            body: FrameBody::copy_from(body),
        }) {
            Handled::Round(outcome, result) => Ok((outcome, result)),
            Handled::BadFrame(e) => Err(e),
            // `handle` answers every push with `Handled::Round` or `Handled::BadFrame`.
            other => unreachable!("a push handled as {other:?}"),
        }
    }

    /// [`Input::Pull`] through [`handle`](Self::handle).
    pub fn pull(
        &mut self,
        conn: ConnId,
        worker: u32,
        request: u64,
        clock: u64,
        mode: PullMode,
        now_ms: u64,
    ) -> Result<u64, ShardError> {
        match self.handle(&Input::Pull {
            conn,
            worker,
            request,
            clock,
            mode,
            now_ms,
        }) {
            Handled::Pull(t) => t,
            // `handle` answers every pull with `Handled::Pull`.
            other => unreachable!("a pull handled as {other:?}"),
        }
    }

    /// [`Input::Goodbye`] through [`handle`](Self::handle).
    pub fn goodbye(&mut self, conn: ConnId, worker: u32, clock: u64, now_ms: u64) {
        self.handle(&Input::Goodbye {
            conn,
            worker,
            clock,
            now_ms,
        });
    }

    /// [`Input::Closed`] through [`handle`](Self::handle).
    pub fn closed(&mut self, conn: ConnId) {
        self.handle(&Input::Closed { conn });
    }

    /// [`Input::Cancel`] through [`handle`](Self::handle).
    pub fn cancel(&mut self, token: u64) {
        self.handle(&Input::Cancel { token });
    }

    /// [`Input::Tick`] through [`handle`](Self::handle): the workers it evicted.
    pub fn tick(&mut self, now_ms: u64) -> Vec<u32> {
        match self.handle(&Input::Tick { now_ms }) {
            Handled::Evicted(e) => e,
            // `handle` answers every tick with `Handled::Evicted`.
            other => unreachable!("a tick handled as {other:?}"),
        }
    }

    /// A worker's hello on connection `conn`: the explicit rejoin (see [`ShardCore::join_at`]: a rank outside the
    /// configured workers or a claim past [`MAX_CLOCK`] is refused and changes nothing; a claim beyond the bound
    /// rejoins at the shard's value). The new connection supersedes the worker's older one: that one's parked pulls
    /// are refused and it is closed with [`ErrorCode::Superseded`]. Returns the finished [`Welcome`] the shell sends
    /// back (this shard, its range and bound, the worker's clock here, the min clock, the version).
    fn on_hello(
        &mut self,
        conn: ConnId,
        worker: u32,
        clock: u64,
        now_ms: u64,
    ) -> Result<Welcome, ShardError> {
        let clock = self.core.join_at(worker, clock, now_ms)?;
        self.max_conn = self.max_conn.max(conn);
        let member = self.members.entry(worker).or_default();
        let old = member.conn.replace(conn);
        if let Some(old) = old.filter(|c| *c != conn) {
            self.refuse_parked(|p| p.conn == old, ShardError::Superseded(worker));
            self.actions.push_back(Queued::Do(Action::Close {
                conn: old,
                code: Some(ErrorCode::Superseded),
            }));
        }
        self.release_ready();
        let range = self.core.range();
        Ok(Welcome {
            shard: self.core.shard(),
            range_start: range.start,
            range_end: range.end,
            staleness: self.core.clocks().staleness().bound(),
            fragments: self.core.fragments(),
            min_clock: self.core.clocks().gate(),
            version: self.core.version(),
            clock,
            initial: self.core.initial_cut(),
            term: self.term,
        })
    }

    /// Any message from `worker` on `conn` is a sign of life; on a superseded connection it is ignored.
    fn on_heartbeat(&mut self, conn: ConnId, worker: u32, now_ms: u64) {
        if self.is_current(conn, worker) {
            self.core.heartbeat(worker, now_ms);
        }
    }

    fn is_current(&self, conn: ConnId, worker: u32) -> bool {
        self.members.get(&worker).and_then(|m| m.conn) == Some(conn)
    }

    /// Why `worker` may not speak on `conn`: superseded by a newer session, or not a member at all.
    fn not_current(&self, worker: u32) -> ShardError {
        match self.members.get(&worker).and_then(|m| m.conn) {
            Some(_) => ShardError::Superseded(worker),
            None => ShardError::NotMember(worker),
        }
    }

    /// A push or skip marker on connection `conn`. Only the worker's current connection is heard: on any other the
    /// round is refused ([`ErrorCode::Superseded`], or evicted for a non-member) and changes nothing. Idempotent by
    /// `(worker, clock)`: a round that was applied before is acknowledged as [`Outcome::Duplicate`] and changes
    /// nothing; a round refused before is refused again with the same code. Returns the outcome the worker is told,
    /// and what the shard did now: the application details, nothing (a duplicate or skip), or the refusal in full.
    fn on_round(
        &mut self,
        conn: ConnId,
        round: Round<'_>,
        now_ms: u64,
    ) -> (Outcome, Result<Option<Applied>, ShardError>) {
        let (worker, clock) = (round.worker(), round.clock());
        if !self.is_current(conn, worker) {
            let error = self.not_current(worker);
            return (Outcome::Refused(error.code()), Err(error));
        }
        // Any push is a sign of life, whatever becomes of it.
        self.core.heartbeat(worker, now_ms);
        let current = self.core.clocks().clock_of(worker);
        if let Some(own) = current {
            if clock < own {
                let seen = self.members.get(&worker).and_then(|m| m.outcome_of(clock));
                let outcome = match seen {
                    Some(Outcome::Applied) | Some(Outcome::Duplicate) => Outcome::Duplicate,
                    Some(refused @ Outcome::Refused(_)) => refused,
                    // Before our window: it was applied, skipped or jumped over by a rejoin. A round the worker
                    // still holds and that we no longer know can only be one a rejoin jumped over (never applied).
                    None => Outcome::Refused(ErrorCode::Replay),
                };
                let result = match outcome {
                    Outcome::Refused(_) => Err(ShardError::Replay {
                        worker,
                        expected: own,
                        found: clock,
                    }),
                    _ => Ok(None),
                };
                return (outcome, result);
            }
        }
        let result = match round {
            Round::Push(push) => self.core.apply(&push, now_ms).map(Some),
            Round::Skip { worker, clock } => self.core.skip(worker, clock, now_ms).map(|_| None),
        };
        let outcome = match &result {
            Ok(_) => Outcome::Applied,
            Err(e) => Outcome::Refused(e.code()),
        };
        // Only rounds that moved the clock are remembered: those are the ones a resend may repeat.
        let advanced = self.core.clocks().clock_of(worker) > current;
        if advanced {
            self.members
                .entry(worker)
                .or_default()
                .remember(clock, outcome);
            self.release_ready();
            self.maybe_leave(worker, now_ms);
        }
        (outcome, result)
    }

    /// A validated push frame on connection `conn`: its reported loss goes to the loss-spike detector (see
    /// [`ShardCore::note_loss`]) when `conn` is the worker's current connection, then it is handled as
    /// [`round`](Self::round) handles its push or skip marker.
    fn on_push_frame(
        &mut self,
        conn: ConnId,
        frame: &ArchivedPushFrame,
        now_ms: u64,
    ) -> (Outcome, Result<Option<Applied>, ShardError>) {
        let meta = frame.meta();
        if self.is_current(conn, meta.worker) {
            self.core
                .note_loss(meta.worker, meta.clock, meta.read_version, meta.loss);
        }
        self.on_round(conn, Round::from_frame(frame), now_ms)
    }

    /// A pull request. Checks membership (a live worker speaking on its current connection) and the clock
    /// (`own ≤ clock ≤ own + s + 1`: an honest worker pulls at most `s + 1` rounds past its last applied push),
    /// then answers at once or parks the pull on the gate. Returns the pull's token; the answer comes out of
    /// [`poll_action`](Self::poll_action).
    fn on_pull(
        &mut self,
        conn: ConnId,
        worker: u32,
        request: u64,
        clock: u64,
        mode: PullMode,
        now_ms: u64,
    ) -> Result<u64, ShardError> {
        self.on_heartbeat(conn, worker, now_ms);
        if !self.is_current(conn, worker) {
            return Err(self.not_current(worker));
        }
        let own = self
            .core
            .clocks()
            .clock_of(worker)
            .ok_or(ShardError::NotMember(worker))?;
        if clock < own {
            return Err(ShardError::Replay {
                worker,
                expected: own,
                found: clock,
            });
        }
        let ahead = match self.core.clocks().staleness() {
            Staleness::Bounded(s) => u64::from(s) + 1,
            Staleness::Unbounded => MAX_CLOCK,
        };
        if clock > own.saturating_add(ahead) || clock > MAX_CLOCK {
            return Err(ShardError::ClockFromFuture {
                worker,
                expected: own,
                found: clock,
            });
        }
        let waiting = self.parked.iter().filter(|p| p.worker == worker).count();
        if waiting >= MAX_PARKED_PER_WORKER {
            return Err(ShardError::Overloaded);
        }
        let token = self.next_token;
        self.next_token += 1;
        self.parked.push(Parked {
            token,
            conn,
            worker,
            request,
            clock,
            mode,
        });
        self.release_ready();
        Ok(token)
    }

    /// A worker said goodbye on `conn` at `clock`: once the shard has taken its rounds below `clock` (they travel on
    /// the push path, which the goodbye may overtake) or [`GOODBYE_DRAIN_MS`] passed, it leaves the clock table
    /// (nobody waits on it), its parked pulls are refused and its connection is closed in order.
    fn on_goodbye(&mut self, conn: ConnId, worker: u32, clock: u64, now_ms: u64) {
        if !self.is_current(conn, worker) {
            return;
        }
        if let Some(m) = self.members.get_mut(&worker) {
            m.leaving = Some(Leaving {
                conn,
                clock,
                deadline_ms: now_ms.saturating_add(GOODBYE_DRAIN_MS),
            });
        }
        self.maybe_leave(worker, now_ms);
    }

    fn maybe_leave(&mut self, worker: u32, now_ms: u64) {
        let Some(leaving) = self.members.get(&worker).and_then(|m| m.leaving) else {
            return;
        };
        let taken = self
            .core
            .clocks()
            .clock_of(worker)
            .is_none_or(|c| c >= leaving.clock);
        if !taken && now_ms < leaving.deadline_ms {
            return;
        }
        self.core.leave(worker);
        self.members.remove(&worker);
        self.refuse_parked(|p| p.worker == worker, ShardError::NotMember(worker));
        self.actions.push_back(Queued::Do(Action::Close {
            conn: leaving.conn,
            code: None,
        }));
        self.release_ready();
    }

    /// Connection `conn` closed: its parked pulls are dropped. The worker stays in the table until it rejoins or
    /// its silence evicts it.
    fn on_closed(&mut self, conn: ConnId) {
        self.parked.retain(|p| p.conn != conn);
        for m in self.members.values_mut() {
            if m.conn == Some(conn) {
                m.conn = None;
            }
        }
    }

    /// A pull's requester went away before its answer (the shell noticed); drops it.
    fn on_cancel(&mut self, token: u64) {
        self.parked.retain(|p| p.token != token);
    }

    /// Evicts the workers silent for the timeout, and, while another worker's pull waits on the gate, those at the
    /// minimum clock that made no progress for the progress deadline ([`ShardCore::evict_stalled`]): they stop
    /// blocking the gate, their parked pulls are refused and their connections closed (so that, if they are alive
    /// after all, they reconnect and rejoin).
    fn on_tick(&mut self, now_ms: u64) -> Vec<u32> {
        let draining: Vec<u32> = self
            .members
            .iter()
            .filter(|(_, m)| m.leaving.is_some())
            .map(|(w, _)| *w)
            .collect();
        for w in draining {
            self.maybe_leave(w, now_ms);
        }
        let mut evicted = self.core.evict_silent(now_ms);
        if self.core.settle(now_ms) > 0 {
            self.release_ready();
        }
        let m = self.core.clocks().gate();
        let clocks = self.core.clocks();
        // A pull of a worker ahead of the gate waits on it: whoever sits at the gate holds it.
        let gate_held = self
            .parked
            .iter()
            .any(|p| clocks.clock_of(p.worker).is_some_and(|c| c > m));
        if gate_held {
            let stalled = self.core.evict_stalled(now_ms);
            if !stalled.is_empty() {
                tracing::warn!(
                    shard = self.core.shard(),
                    ?stalled,
                    "evicted for holding the gate without progress"
                );
            }
            evicted.extend(stalled);
            evicted.sort_unstable();
        }
        for &w in &evicted {
            self.refuse_parked(|p| p.worker == w, ShardError::NotMember(w));
            if let Some(conn) = self.members.get_mut(&w).and_then(|m| m.conn.take()) {
                self.actions.push_back(Queued::Do(Action::Close {
                    conn,
                    code: Some(ErrorCode::Evicted),
                }));
            }
        }
        if !evicted.is_empty() {
            self.release_ready();
        }
        evicted
    }

    /// When [`tick`](Self::tick) must run next for a round's grace window to end on time (quorum rounds); `None`
    /// when no round waits on one. The shell arms a timer for it besides its periodic tick.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.core.clocks().deadline()
    }

    fn refuse_parked(&mut self, which: impl Fn(&Parked) -> bool, error: ShardError) {
        let mut i = 0;
        while i < self.parked.len() {
            if which(&self.parked[i]) {
                let p = self.parked.swap_remove(i);
                self.actions.push_back(Queued::Do(Action::Refuse {
                    token: p.token,
                    conn: p.conn,
                    request: p.request,
                    error: error.clone(),
                }));
            } else {
                i += 1;
            }
        }
    }

    fn release_ready(&mut self) {
        let mut i = 0;
        while i < self.parked.len() {
            if self.core.can_answer(self.parked[i].clock) {
                let p = self.parked.remove(i);
                self.actions.push_back(Queued::Answer(ReadyPull {
                    token: p.token,
                    conn: p.conn,
                    worker: p.worker,
                    request: p.request,
                    clock: p.clock,
                    mode: p.mode,
                }));
            } else {
                i += 1;
            }
        }
    }
}
