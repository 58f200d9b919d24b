//! `WorkerProtocol`: the worker side of the Tether protocol as a sans-IO state machine, in the spirit of
//! quinn-proto. It holds the worker's clock, what each shard expects next, the pushes sent but not yet settled
//! (kept byte for byte for resends), the pull round in progress with one request id per shard, the copies of the
//! shards' public weights ([`reply`]) and the heartbeat timers. It takes messages, reply frame bodies and `now_ms`
//! and returns [`Transmit`]s (what to send where), [`Event`]s (what the trainer must know) and parameter values;
//! the driver in `driver.rs` and the protocol harness only move bytes and timers.
//!
//! Invariants:
//! - a pull reply is used only when it answers the shard's current request of the current round, at its clock;
//!   a reply to a superseded request (a reconnect, a refusal, a clock jump) is dropped, never read into the model;
//!   a reply that does not validate or decode changes neither the model nor the public copy, and resets its link;
//! - a shard whose welcome announces another staleness bound than the worker's own is refused
//!   ([`ProtocolError::StalenessMismatch`]);
//! - the clock moves by a push or a skip marker on the push path, or by an explicit rejoin in a hello;
//! - a shard that welcomes us below our hello's clock (it bounds clock claims: it restarted from an older
//!   checkpoint, or is behind) gets skip markers for the rounds in between (at most [`MAX_GAP_ROUNDS`]; those
//!   rounds' updates are not in its weights), then our pending pushes at their clocks;
//! - a round the shard refuses as too far ahead of its minimum clock ([`ErrorCode::ClockFromFuture`]) stays
//!   pending and is resent, with the rounds after it, at the next heartbeat tick; a pull is asked only once the
//!   shard can take it (`clock ≤ oldest pending round + s + 1`);
//! - a push stays pending until its shard gives it an outcome, and is resent byte for byte on every reconnect
//!   (shards make it idempotent by worker and clock); it is never recomputed;
//! - heartbeats go to every connected shard on a timer that does not depend on steps, so a long step is never
//!   silence;
//! - a used reply whose rollback epoch differs from the last one seen from its shard raises
//!   [`Event::RolledBack`] before the pull completes, so the trainer drops what it built on the discarded
//!   trajectory before it computes on the restored parameters.

pub mod reply;

use std::collections::VecDeque;

use bytes::Bytes;
use rkyv::util::AlignedVec;
use tether_common::config::Staleness;
use tether_common::protocol::{
    access_delta, access_push, encode_push, Control, ErrorCode, FrameKind, Hello, Outcome,
    ProtocolError, PublicRef, PullMode, PushFrame, Welcome,
};

pub use reply::{rebuild_public, DeltaDecoder, PullReply, Replica};

/// The most rounds a welcome may lie below our hello's clock: the gap is filled with one skip marker per round, so a
/// shard claiming a larger one (no honest checkpoint is that old) is refused instead of costing unbounded memory.
pub const MAX_GAP_ROUNDS: u64 = 1 << 16;

/// Something to send.
#[derive(Debug, Clone, PartialEq)]
pub enum Transmit {
    /// A control message on the shard's control stream.
    Control {
        /// The shard.
        shard: usize,
        /// The message.
        msg: Control,
    },
    /// A push frame body (or skip marker) on its own stream, in clock order.
    Push {
        /// The shard.
        shard: usize,
        /// The push round.
        clock: u64,
        /// The rkyv push frame body.
        bytes: Bytes,
    },
}

/// Something the trainer must know or do.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Every shard answered the pull for `clock`.
    PullDone {
        /// The pull's clock.
        clock: u64,
    },
    /// A push or skip marker got its outcome at one shard (or was dropped by a rejoin that jumped over it).
    Settled(Settled),
    /// The link to this shard must be (re)established: close it if it is up, then connect with
    /// [`WorkerProtocol::hello`].
    Reconnect {
        /// The shard.
        shard: usize,
    },
    /// The shard rolled back to a snapshot after a loss spike (its epoch changed): the error-feedback residual of
    /// this shard and the inner optimizer state were built on the discarded trajectory and must be reset.
    RolledBack {
        /// The shard.
        shard: usize,
        /// Its new epoch.
        epoch: u64,
    },
}

/// A push or skip marker that got its outcome at one shard (or was dropped by a rejoin that jumped over it).
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The shard.
    pub shard: usize,
    /// The round.
    pub clock: u64,
    /// What became of it.
    pub outcome: Outcome,
    /// The frame as sent (for the residual policy on refusal).
    pub frame: Bytes,
    /// The fence term of the link it was settled on (0: unreplicated).
    pub term: u64,
}

/// What a settled round means for the worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The shard holds the round's update (applied now, or before: a resend acknowledged as a duplicate).
    Taken,
    /// A skip marker the shard took: the round is finished without an update.
    Skipped,
    /// Refused, or dropped by a rejoin: the update is not in the weights, and the residual policy applies to it.
    Refused,
}

impl Settled {
    /// What this outcome means: the one reading of a settled round that the driver (the residual policy) and the
    /// protocol harness (its checker) share.
    pub fn verdict(&self) -> Verdict {
        match self.outcome {
            Outcome::Refused(_) => Verdict::Refused,
            Outcome::Applied | Outcome::Duplicate => {
                // The protocol built the frame itself; one that did not read back would be a skip of nothing.
                let skip = access_push(&self.frame).map_or(true, |f| f.meta().skip);
                if skip {
                    Verdict::Skipped
                } else {
                    Verdict::Taken
                }
            }
        }
    }
}

/// Counters the protocol keeps for the worker's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProtocolStats {
    /// Pushes (and skip markers) a shard refused, or that a rejoin dropped.
    pub pushes_refused: u64,
    /// Resends a shard acknowledged as already applied.
    pub duplicates: u64,
    /// Pull replies dropped because they answered a superseded request.
    pub stale_replies: u64,
    /// Pulls a shard refused.
    pub pulls_refused: u64,
    /// Largest clock lead a used reply reported.
    pub max_clock_lead: u64,
    /// Pushes resent after a reconnect.
    pub resent: u64,
    /// Rollback epochs seen change (one per shard per rollback).
    pub rollbacks_seen: u64,
    /// Skip markers sent to fill the gap below a hello's clock that a shard did not take.
    pub gap_skips: u64,
    /// Public copies given up because the shard's node changed term (the next pull is whole).
    pub bases_dropped: u64,
    /// Rounds resent because a shard found them too far ahead of its minimum clock.
    pub held_back: u64,
    /// Shard copies held from their initial cut, computed here instead of pulled whole.
    pub initial_cuts: u64,
}

#[derive(Debug, Clone)]
struct Pending {
    clock: u64,
    frame: Bytes,
}

#[derive(Debug, Clone)]
struct Link {
    range: (u64, u64),
    up: bool,
    /// The round this shard expects for our next push or skip.
    next_clock: u64,
    /// Sent, not yet settled, oldest first.
    pending: VecDeque<Pending>,
    /// Shard version of the last values used from it.
    version: u64,
    /// The shard's public copy this worker holds (delta pulls).
    public: Option<PublicRef>,
    /// The fence term of the node that gave it (a delta is taken only against a copy from the same term).
    public_term: u64,
    /// The clock and the shard's minimum clock of the last reply used (what a history records of a read).
    read: (u64, u64),
    /// The shard's rollback epoch in the last reply used.
    epoch: u64,
    /// When we last sent a control message (heartbeat timer).
    last_sent_ms: u64,
    /// Our clock moved past what this shard holds: reconnect with a rejoin once nothing is pending.
    rejoin: bool,
    /// The hello clock of the connection being established.
    hello_clock: u64,
    /// A pending round was refused as too far ahead: resend the pending rounds at the next timer tick.
    retry: bool,
    /// The fence term of the node the link is connected to (0: an unreplicated shard): outcomes and replies in any
    /// other term are refused.
    term: u64,
    /// The newest term any welcome from this shard carried: a node welcoming us in an older one was deposed.
    newest_term: u64,
}

#[derive(Debug, Clone)]
struct PullRound {
    clock: u64,
    /// The outstanding request per shard (`None`: answered, or not sent yet).
    requests: Vec<Option<u64>>,
    done: Vec<bool>,
}

/// The worker side of the protocol.
///
/// Call order (as quinn-proto's `Connection`): after [`new`](Self::new), and after every call below, the shell
/// drains [`poll_transmit`](Self::poll_transmit) (sends each message on its shard's link; a link that is down drops
/// it) and [`poll_event`](Self::poll_event) (acts on each event), until both return `None`; it sleeps until
/// [`poll_timeout`](Self::poll_timeout) and then calls [`handle_timeout`](Self::handle_timeout).
/// - [`Event::Reconnect`] → close the link if it is up, connect, send [`hello`](Self::hello) and, on the welcome,
///   call [`connected`](Self::connected) (an `Err` refuses the shard); a link that breaks →
///   [`disconnected`](Self::disconnected);
/// - a control message from a shard → [`outcome`](Self::outcome) (`PushOutcome`) or
///   [`pull_refused`](Self::pull_refused) (`PullRefused`);
/// - a reply frame from a shard → [`handle_reply`](Self::handle_reply) with the model's parameters while a pull is
///   waited for (`None` otherwise): it validates, judges and decodes the reply, writing used values into them;
/// - the trainer's step → [`start_pull`](Self::start_pull), then [`push`](Self::push) or [`skip`](Self::skip) once
///   computed; the pull is complete at [`Event::PullDone`]; at the end, once [`settled`](Self::settled),
///   [`goodbye`](Self::goodbye).
#[derive(Debug)]
pub struct WorkerProtocol {
    rank: u32,
    layout_hash: u64,
    staleness: Staleness,
    /// Streamed fragments (`train.fragments`; a shard announcing another count is refused).
    fragments: u32,
    mode: PullMode,
    heartbeat_ms: u64,
    clock: u64,
    links: Vec<Link>,
    round: Option<PullRound>,
    next_request: u64,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: ProtocolStats,
    replica: Replica,
    /// The latest `now_ms` any call brought (for messages sent from calls that take no time, such as outcomes).
    now_ms: u64,
    /// The loss of our latest round: gap skip markers report it, so the shards' spike detectors see a value of this
    /// run rather than a made-up one.
    last_loss: f32,
    /// The model's layout, when this worker computes a fresh shard's initial weights instead of pulling them
    /// ([`with_initial`](Self::with_initial)).
    initial: Option<std::sync::Arc<tether_common::layout::Layout>>,
}

impl WorkerProtocol {
    /// The state machine of worker `rank` over shards covering `ranges`, under the SSP bound `staleness` (a shard
    /// announcing another is refused), pulling in `mode` (for `Delta`, the `have` given is ignored: the protocol
    /// tracks each shard's copy), with heartbeats every `heartbeat_ms`. Every link starts down: the driver connects each shard
    /// (see [`Event::Reconnect`]).
    pub fn new(
        rank: u32,
        layout_hash: u64,
        ranges: Vec<(u64, u64)>,
        staleness: Staleness,
        mode: PullMode,
        heartbeat_ms: u64,
    ) -> Self {
        let mut s = Self {
            rank,
            layout_hash,
            staleness,
            fragments: 1,
            mode,
            heartbeat_ms: heartbeat_ms.max(1),
            clock: 0,
            links: ranges
                .into_iter()
                .map(|range| Link {
                    range,
                    up: false,
                    next_clock: 0,
                    pending: VecDeque::new(),
                    version: 0,
                    public: None,
                    public_term: 0,
                    read: (0, 0),
                    epoch: 0,
                    last_sent_ms: 0,
                    rejoin: false,
                    hello_clock: 0,
                    retry: false,
                    term: 0,
                    newest_term: 0,
                })
                .collect(),
            round: None,
            next_request: 0,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: ProtocolStats::default(),
            replica: Replica::default(),
            initial: None,
            now_ms: 0,
            last_loss: 0.0,
        };
        for shard in 0..s.links.len() {
            s.events.push_back(Event::Reconnect { shard });
        }
        s
    }

    /// The worker's clock: its next push round.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.links.len()
    }

    /// Counters for the report.
    pub fn stats(&self) -> ProtocolStats {
        self.stats
    }

    /// Whether every push and skip has its outcome.
    pub fn settled(&self) -> bool {
        self.links.iter().all(|l| l.pending.is_empty())
    }

    /// Whether every shard's link is up (a goodbye then reaches every shard).
    pub fn connected_to_all(&self) -> bool {
        self.links.iter().all(|l| l.up)
    }

    /// Whether a pull round is in progress.
    pub fn pulling(&self) -> bool {
        self.round.is_some()
    }

    /// The next message to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event for the trainer.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The hello for (re)connecting `shard`: it rejoins at the first round this shard has not settled, so pending
    /// pushes can be resent, or at our clock when nothing is pending.
    pub fn hello(&mut self, shard: usize) -> Hello {
        let link = &mut self.links[shard];
        let clock = link.pending.front().map_or(self.clock, |p| p.clock);
        link.hello_clock = clock;
        Hello::rejoin(self.rank, self.layout_hash, clock)
    }

    fn synced(&self, shard: usize) -> bool {
        let l = &self.links[shard];
        // The shard takes a pull only up to its own clock for us + s + 1; its clock is at least our oldest pending
        // round, so past that bound the pull waits for outcomes (a gap being filled, held-back rounds).
        let takes_pull = match self.staleness {
            Staleness::Bounded(s) => l
                .pending
                .front()
                .is_none_or(|p| self.clock <= p.clock.saturating_add(u64::from(s) + 1)),
            Staleness::Unbounded => true,
        };
        l.up && !l.rejoin && l.next_clock == self.clock && takes_pull
    }

    fn send_control(&mut self, shard: usize, msg: Control, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        self.links[shard].last_sent_ms = now_ms;
        self.transmits.push_back(Transmit::Control { shard, msg });
    }

    /// Streams the model in `fragments` parts (`train.fragments`): a shard whose welcome announces another count is
    /// refused ([`ProtocolError::FragmentsMismatch`]). Pushes are built by the caller, part by part; the protocol's
    /// rounds are unchanged.
    pub fn with_fragments(mut self, fragments: u32) -> Self {
        self.fragments = fragments.max(1);
        self
    }

    /// Computes a fresh shard's initial weights from `layout` instead of pulling them whole: with delta pulls, a
    /// welcome that offers its initial cut ([`tether_common::protocol::InitialCut`]) to a link holding no copy makes
    /// the link hold cut 0 once the values computed here match the cut's CRC. The first pull then carries only what
    /// changed since. `layout` must be the one the layout hash names.
    pub fn with_initial(self, layout: std::sync::Arc<tether_common::layout::Layout>) -> Self {
        self.with_initial_opt(Some(layout))
    }

    /// [`with_initial`](Self::with_initial) when `layout` is given; pulls the initial weights whole when `None`.
    pub fn with_initial_opt(
        mut self,
        layout: Option<std::sync::Arc<tether_common::layout::Layout>>,
    ) -> Self {
        self.initial = layout;
        self
    }

    /// `shard` welcomed us. Checks the welcome against the layout and our staleness bound, drops pending rounds a
    /// rejoin jumped over,
    /// resends the rest, adopts a higher clock (and schedules rejoins of the shards behind it), and asks for this
    /// round's values if a pull is in progress.
    pub fn connected(
        &mut self,
        shard: usize,
        welcome: &Welcome,
        now_ms: u64,
    ) -> Result<(), ProtocolError> {
        if welcome.fragments != self.fragments {
            return Err(ProtocolError::FragmentsMismatch {
                shard: welcome.shard,
                shard_fragments: welcome.fragments,
                ours: self.fragments,
            });
        }
        if welcome.term < self.links[shard].newest_term {
            return Err(ProtocolError::StaleTerm {
                shard: welcome.shard,
                got: welcome.term,
                expected: self.links[shard].newest_term,
            });
        }
        if welcome.staleness != self.staleness.bound() {
            return Err(ProtocolError::StalenessMismatch {
                shard: welcome.shard,
                shard_bound: welcome.staleness,
                ours: self.staleness.bound(),
            });
        }
        let link = &mut self.links[shard];
        if (welcome.range_start, welcome.range_end) != link.range {
            return Err(ProtocolError::BadRange {
                start: link.range.0,
                end: link.range.1,
                got_start: welcome.range_start,
                got_end: welcome.range_end,
            });
        }
        let gap = link.hello_clock.saturating_sub(welcome.clock);
        if gap > MAX_GAP_ROUNDS {
            return Err(ProtocolError::UnexpectedMessage(format!(
                "welcome at clock {} is more than {MAX_GAP_ROUNDS} rounds below the hello's {}",
                welcome.clock, link.hello_clock
            )));
        }
        self.now_ms = self.now_ms.max(now_ms);
        if gap > 0 {
            // The shard took our claim only up to its bound: finish the rounds in between there with skip markers,
            // ahead of the pending pushes (which are all at or above the hello's clock).
            let (start, end) = (welcome.clock, self.links[shard].hello_clock);
            let mut skips = Vec::with_capacity(gap as usize);
            for clock in start..end {
                skips.push(Pending {
                    clock,
                    frame: self.frame(shard, clock, Vec::new(), self.last_loss, true)?,
                });
            }
            self.stats.gap_skips += gap;
            let link = &mut self.links[shard];
            for p in skips.into_iter().rev() {
                link.pending.push_front(p);
            }
            tracing::info!(
                shard,
                from = start,
                to = end,
                "shard welcomed us below our clock: filling the gap with skip markers"
            );
        }
        // A copy read from a node of another term is not built on: after a failover the next pull is whole. A fenced
        // standby holds every cut its primary released, but a delta against a base from any other copy of the
        // shard would be applied to the wrong weights (the split brain before the fence: both copies cut their
        // public copy in one lineage's numbering, and a worker moving between them diverged).
        let link = &mut self.links[shard];
        if link.public.is_some() && link.public_term != welcome.term {
            link.public = None;
            self.stats.bases_dropped += 1;
        }
        self.adopt_initial(shard, welcome);
        let link = &mut self.links[shard];
        link.term = welcome.term;
        link.newest_term = welcome.term;
        link.retry = false;
        link.up = true;
        link.rejoin = false;
        link.last_sent_ms = now_ms;
        // Rounds below the welcome clock were jumped over (we were evicted and the others moved on): never applied.
        while link
            .pending
            .front()
            .is_some_and(|p| p.clock < welcome.clock)
        {
            let p = link
                .pending
                .pop_front()
                .expect("front exists: checked by is_some_and");
            self.stats.pushes_refused += 1;
            self.events.push_back(Event::Settled(Settled {
                shard,
                clock: p.clock,
                outcome: Outcome::Refused(ErrorCode::Evicted),
                frame: p.frame,
                term: link.term,
            }));
        }
        link.next_clock = link
            .pending
            .back()
            .map_or(welcome.clock, |p| p.clock + 1)
            .max(welcome.clock);
        for p in &link.pending {
            self.stats.resent += 1;
            self.transmits.push_back(Transmit::Push {
                shard,
                clock: p.clock,
                bytes: p.frame.clone(),
            });
        }
        let next = link.next_clock;
        if next > self.clock {
            self.adopt(next);
        } else if next < self.clock {
            self.mark_rejoin(shard);
        }
        self.request_missing(now_ms);
        Ok(())
    }

    /// Our clock jumps to `clock` (a shard made us rejoin ahead). Shards behind it must rejoin too, and a pull in
    /// progress restarts at the new clock (its answers so far were for another clock).
    fn adopt(&mut self, clock: u64) {
        self.clock = clock;
        for k in 0..self.links.len() {
            if self.links[k].up && self.links[k].next_clock < clock {
                self.mark_rejoin(k);
            }
        }
        if let Some(round) = &mut self.round {
            round.clock = clock;
            round.requests.iter_mut().for_each(|r| *r = None);
            round.done.iter_mut().for_each(|d| *d = false);
        }
    }

    fn mark_rejoin(&mut self, shard: usize) {
        let link = &mut self.links[shard];
        link.rejoin = true;
        if link.pending.is_empty() {
            link.up = false;
            self.events.push_back(Event::Reconnect { shard });
        }
    }

    /// The link to `shard` broke (or the driver closed it): requests on it are void; reconnect.
    pub fn disconnected(&mut self, shard: usize) {
        let link = &mut self.links[shard];
        let was_up = link.up;
        link.up = false;
        if let Some(round) = &mut self.round {
            round.requests[shard] = None;
        }
        if was_up {
            self.events.push_back(Event::Reconnect { shard });
        }
    }

    /// Starts the pull round for the current clock (a round in progress is superseded).
    pub fn start_pull(&mut self, now_ms: u64) {
        let n = self.links.len();
        self.round = Some(PullRound {
            clock: self.clock,
            requests: vec![None; n],
            done: vec![false; n],
        });
        self.request_missing(now_ms);
    }

    fn request_missing(&mut self, now_ms: u64) {
        let Some(round) = &self.round else {
            return;
        };
        let clock = round.clock;
        let missing: Vec<usize> = (0..self.links.len())
            .filter(|&k| !round.done[k] && round.requests[k].is_none())
            .collect();
        for k in missing {
            if !self.synced(k) {
                continue;
            }
            let request = self.next_request;
            self.next_request += 1;
            if let Some(round) = &mut self.round {
                round.requests[k] = Some(request);
            }
            let mode = match self.mode {
                PullMode::Delta { .. } => PullMode::Delta {
                    have: self.links[k].public,
                },
                full => full,
            };
            let msg = Control::PullRequest {
                request,
                clock,
                mode,
            };
            self.send_control(k, msg, now_ms);
        }
    }

    /// A pull reply arrived from `shard` while no pull is in progress: it answers nothing asked now; counted, dropped.
    pub fn stray_reply(&mut self) {
        self.stats.stale_replies += 1;
    }

    /// Holds cut 0 of `shard`'s public copy when its welcome offers the initial cut, this worker pulls deltas,
    /// holds no copy of the shard and computes the same values (see [`with_initial`](Self::with_initial)).
    fn adopt_initial(&mut self, shard: usize, welcome: &Welcome) {
        let (Some(layout), Some(initial), PullMode::Delta { .. }) =
            (&self.initial, &welcome.initial, self.mode)
        else {
            return;
        };
        let link = &mut self.links[shard];
        if link.public.is_some() {
            return;
        }
        let range = (link.range.0 as usize, link.range.1 as usize);
        if self.replica.adopt_initial(layout, initial, range) {
            link.public = Some(PublicRef {
                lineage: initial.lineage,
                seq: 0,
            });
            link.public_term = welcome.term;
            self.stats.initial_cuts += 1;
        } else {
            tracing::warn!(
                shard,
                "the initial weights computed here differ from the shard's: pulling them whole"
            );
        }
    }

    /// The public copy of `shard` this worker holds (delta pulls).
    pub fn public(&self, shard: usize) -> Option<PublicRef> {
        self.links[shard].public
    }

    /// The public copies of every shard this worker holds, indexed like the model (empty before the first delta
    /// reply).
    pub fn public_values(&self) -> &[f32] {
        self.replica.values()
    }

    /// The worker's copy of `shard` can no longer be trusted (a delta did not apply): the next pull asks for the
    /// whole copy.
    pub fn forget_public(&mut self, shard: usize) {
        self.links[shard].public = None;
    }

    /// A reply frame of `kind` arrived from `shard`. Validates it against the shard's range and, when `params` is
    /// given (a pull is waited for) and the reply answers the shard's current request of this round (see
    /// [`reply`](Self::reply)), writes its values into `params` (a delta reply through the shard's public copy,
    /// which it then holds). Returns whether the reply was used; a stale or stray one is counted and dropped. A
    /// reply that does not validate or decode is an error: it changes neither `params` nor the public copy, the copy
    /// is forgotten (the next pull asks for the whole of it) and the link is reset ([`Event::Reconnect`]).
    pub fn handle_reply(
        &mut self,
        shard: usize,
        kind: FrameKind,
        body: &AlignedVec,
        params: Option<&mut [f32]>,
    ) -> Result<bool, ProtocolError> {
        let used = self.read_reply(shard, kind, body, params);
        if used.is_err() {
            self.forget_public(shard);
            self.disconnected(shard);
        }
        used
    }

    fn read_reply(
        &mut self,
        shard: usize,
        kind: FrameKind,
        body: &AlignedVec,
        params: Option<&mut [f32]>,
    ) -> Result<bool, ProtocolError> {
        let range = self.links[shard].range;
        let read = match kind {
            FrameKind::Params => reply::read_full(body, shard, range)?,
            FrameKind::Delta if params.is_none() => {
                access_delta(body, range.0, range.1)?;
                self.stray_reply();
                return Ok(false);
            }
            FrameKind::Delta => {
                let held = self.links[shard].public;
                reply::read_delta(body, shard, range, held, &mut self.replica)?
            }
            other => {
                return Err(ProtocolError::UnexpectedMessage(format!(
                    "a {other:?} frame as a pull reply"
                )))
            }
        };
        let term = read.reply().header.term;
        if term != self.links[shard].term {
            // A node answering in another term than the one that welcomed us was deposed (or is not the node we
            // think): nothing it says is used.
            return Err(ProtocolError::StaleTerm {
                shard: shard as u32,
                got: term,
                expected: self.links[shard].term,
            });
        }
        let Some(params) = params else {
            self.stray_reply();
            return Ok(false);
        };
        if !self.reply(shard, read.reply()) {
            return Ok(false);
        }
        if let Err(e) = reply::apply(read, range, &mut self.replica, params) {
            // The copy of this shard is no longer known: the next pull asks for a whole one.
            self.links[shard].public = None;
            return Err(e);
        }
        Ok(true)
    }

    /// What a history records of the newest reply used from `shard`: the fence term of its link, the shard
    /// version it reflected, the pull's clock and the shard's minimum clock when it answered.
    pub fn read_of(&self, shard: usize) -> (u64, u64, u64, u64) {
        let l = &self.links[shard];
        (l.term, l.version, l.read.0, l.read.1)
    }

    /// Judges a pull reply from `shard`. Returns true when it answers the shard's current request of this round
    /// (then its values are used, and the worker holds `reply.public` from then on when given); false when it is
    /// stale and must be dropped. A used reply of another rollback epoch than the last one from this shard raises
    /// [`Event::RolledBack`] (ahead of the round's `PullDone`). [`handle_reply`](Self::handle_reply) calls it for
    /// every reply frame; call it directly only to judge replies without their bytes.
    pub fn reply(&mut self, shard: usize, reply: PullReply) -> bool {
        let PullReply { header, public } = reply;
        let (request, clock, version, min_clock, epoch) = (
            header.request,
            header.clock,
            header.version,
            header.min_clock,
            header.epoch,
        );
        let Some(round) = &mut self.round else {
            self.stats.stale_replies += 1;
            return false;
        };
        if round.requests[shard] != Some(request) || round.clock != clock {
            self.stats.stale_replies += 1;
            return false;
        }
        round.requests[shard] = None;
        round.done[shard] = true;
        self.links[shard].version = version;
        self.links[shard].read = (clock, min_clock);
        if self.links[shard].epoch != epoch {
            self.links[shard].epoch = epoch;
            self.stats.rollbacks_seen += 1;
            self.events.push_back(Event::RolledBack { shard, epoch });
        }
        if public.is_some() {
            self.links[shard].public = public;
            self.links[shard].public_term = self.links[shard].term;
        }
        self.stats.max_clock_lead = self
            .stats
            .max_clock_lead
            .max(clock.saturating_sub(min_clock));
        if round.done.iter().all(|d| *d) {
            self.events.push_back(Event::PullDone { clock });
            self.round = None;
        }
        true
    }

    /// `shard` refused a pull request. The current one is void: the link is reset, and the request is repeated
    /// after the reconnect (a refusal means the shard does not see us as we think: evicted, overloaded, behind).
    pub fn pull_refused(&mut self, shard: usize, request: u64, code: ErrorCode) {
        let current = self
            .round
            .as_ref()
            .is_some_and(|r| r.requests[shard] == Some(request));
        if !current {
            return;
        }
        self.stats.pulls_refused += 1;
        tracing::debug!(shard, request, ?code, "pull refused");
        self.disconnected(shard);
    }

    /// Pushes this round to every shard: `payloads[k]` is shard k's codec frame (moved into the frame and handed
    /// back, so its buffer is reused). The clock advances; the frames stay pending until settled.
    pub fn push(&mut self, payloads: &mut [Vec<u8>], loss: f32) -> Result<(), ProtocolError> {
        self.round_frames(Some(payloads), loss)
    }

    /// Finishes this round without an update (a skip marker on every shard's push path), reporting the round's
    /// loss (possibly non-finite) for the shards' spike detector. The clock advances.
    pub fn skip(&mut self, loss: f32) -> Result<(), ProtocolError> {
        self.round_frames(None, loss)
    }

    /// The push frame (or skip marker) of round `clock` for `shard`; hands `payload` back through the frame it
    /// builds when `payload_back` is given.
    fn encode_frame(
        &self,
        shard: usize,
        clock: u64,
        payload: Vec<u8>,
        loss: f32,
        skip: bool,
        payload_back: Option<&mut Vec<u8>>,
    ) -> Result<Bytes, ProtocolError> {
        let link = &self.links[shard];
        let frame = PushFrame {
            worker: self.rank,
            clock,
            shard: shard as u32,
            range_start: link.range.0,
            range_end: link.range.1,
            read_version: link.version,
            loss,
            skip,
            payload,
        };
        let bytes = encode_push(&frame);
        if let Some(back) = payload_back {
            *back = frame.payload;
        }
        Ok(Bytes::from_owner(bytes?))
    }

    fn frame(
        &self,
        shard: usize,
        clock: u64,
        payload: Vec<u8>,
        loss: f32,
        skip: bool,
    ) -> Result<Bytes, ProtocolError> {
        self.encode_frame(shard, clock, payload, loss, skip, None)
    }

    fn round_frames(
        &mut self,
        mut payloads: Option<&mut [Vec<u8>]>,
        loss: f32,
    ) -> Result<(), ProtocolError> {
        let clock = self.clock;
        let skip = payloads.is_none();
        let mut frames = Vec::with_capacity(self.links.len());
        for k in 0..self.links.len() {
            let payload = payloads
                .as_deref_mut()
                .map(|p| std::mem::take(&mut p[k]))
                .unwrap_or_default();
            let back = payloads.as_deref_mut().map(|p| &mut p[k]);
            frames.push(self.encode_frame(k, clock, payload, loss, skip, back)?);
        }
        self.last_loss = loss;
        for (k, frame) in frames.into_iter().enumerate() {
            let link = &mut self.links[k];
            link.pending.push_back(Pending {
                clock,
                frame: frame.clone(),
            });
            if link.up && link.next_clock == clock {
                link.next_clock = clock + 1;
                self.transmits.push_back(Transmit::Push {
                    shard: k,
                    clock,
                    bytes: frame,
                });
            }
        }
        self.clock = clock + 1;
        Ok(())
    }

    /// `shard` reports the outcome of round `clock`. Outcomes for rounds no longer pending (a resend's second
    /// answer) are ignored. A round refused as too far ahead of the shard's minimum clock stays pending and is
    /// resent at the next timer tick; once the oldest pending rounds settle, a pull that waited for them is asked.
    ///
    /// An outcome in another fence `term` than the link's comes from a deposed node: it settles nothing, the link
    /// is reset (the push stays pending and is resent to whoever serves) and the error says why.
    pub fn outcome(
        &mut self,
        shard: usize,
        clock: u64,
        outcome: Outcome,
        term: u64,
    ) -> Result<(), ProtocolError> {
        if term != self.links[shard].term {
            let expected = self.links[shard].term;
            self.disconnected(shard);
            return Err(ProtocolError::StaleTerm {
                shard: shard as u32,
                got: term,
                expected,
            });
        }
        self.settle(shard, clock, outcome);
        Ok(())
    }

    fn settle(&mut self, shard: usize, clock: u64, outcome: Outcome) {
        let link = &mut self.links[shard];
        let Some(i) = link.pending.iter().position(|p| p.clock == clock) else {
            return;
        };
        if outcome == Outcome::Refused(ErrorCode::ClockFromFuture) {
            if !link.retry {
                self.stats.held_back += 1;
            }
            link.retry = true;
            return;
        }
        let Some(p) = link.pending.remove(i) else {
            return;
        };
        match outcome {
            Outcome::Applied => {}
            Outcome::Duplicate => self.stats.duplicates += 1,
            Outcome::Refused(_) => self.stats.pushes_refused += 1,
        }
        self.events.push_back(Event::Settled(Settled {
            shard,
            clock,
            outcome,
            frame: p.frame,
            term: link.term,
        }));
        if link.rejoin && link.pending.is_empty() {
            link.up = false;
            self.events.push_back(Event::Reconnect { shard });
        }
        let now = self.now_ms;
        self.request_missing(now);
    }

    /// When the next heartbeat is due (ms), if any link is up.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.links
            .iter()
            .filter(|l| l.up)
            .map(|l| l.last_sent_ms.saturating_add(self.heartbeat_ms))
            .min()
    }

    /// Timers: a heartbeat to every connected shard we have not sent anything to for a heartbeat period, and the
    /// resend of rounds a shard found too far ahead.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        for k in 0..self.links.len() {
            let l = &mut self.links[k];
            if l.retry && l.up && !l.rejoin {
                l.retry = false;
                for p in &l.pending {
                    self.stats.resent += 1;
                    self.transmits.push_back(Transmit::Push {
                        shard: k,
                        clock: p.clock,
                        bytes: p.frame.clone(),
                    });
                }
            }
        }
        for k in 0..self.links.len() {
            let l = &self.links[k];
            if l.up && now_ms >= l.last_sent_ms.saturating_add(self.heartbeat_ms) {
                let clock = self.clock;
                self.send_control(k, Control::Heartbeat { clock }, now_ms);
            }
        }
    }

    /// Says goodbye to every connected shard (call once [`settled`](Self::settled)).
    pub fn goodbye(&mut self, now_ms: u64) {
        for k in 0..self.links.len() {
            if self.links[k].up {
                let clock = self.clock;
                self.send_control(k, Control::Goodbye { clock }, now_ms);
            }
        }
    }
}
