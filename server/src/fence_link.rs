//! The fence's shell on a node of a replicated shard: holds the node's [`Lease`] and its own [`Voter`] (persisted
//! beside the shard's checkpoints), runs a round every quarter lease while the node campaigns or leads, and carries
//! each round to the two other voters (the shard's other node and the witness) over mutual-TLS QUIC, one control
//! stream each, answers in request order. The actor asks [`Fence::serving`] before it applies, answers or releases
//! anything; the decisions themselves are `tether_common::fence`'s.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch, Notify};
use tracing::{debug, info, warn};

use tether_common::fence::{Lease, LeaseEvent, Request, Successor, Vote, Voter, VoterState};
use tether_common::net::{
    connect, peer_is_witness, peer_shard, ControlChannel, NetError, TlsFiles,
};
use tether_common::protocol::{Control, ProtocolError};

use crate::address::{host_of, resolve};

/// Index of the witness among a shard's voters (nodes are 0 and 1).
pub const WITNESS_VOTER: u8 = 2;

struct Inner {
    lease: Lease,
    voter: Voter,
    successor: Successor,
    /// A claim whose own vote waits until another voter granted it (so a node that cannot win never raises its
    /// own voter's term, which would depose the holder when that holder asks this voter).
    claim: Option<(u64, Request)>,
}

/// One node's fence: its lease, its own vote, and what the actor needs to know of them.
pub struct Fence {
    shard: u32,
    node: u64,
    base: Instant,
    lease_ms: u64,
    state_path: Option<PathBuf>,
    inner: Mutex<Inner>,
    /// Lease end in ms since `base` (0: none): read on every serve decision without the lock.
    until: AtomicU64,
    solo: AtomicBool,
    want: watch::Sender<bool>,
    deposed: Notify,
    /// Starts a round at once (a new successor should be recorded without waiting for the next renewal).
    round_now: Notify,
    /// Called (outside the lock) when a majority recorded that this node serves alone.
    on_solo: Mutex<Option<Box<dyn Fn() + Send>>>,
}

/// Reads a persisted voter state; a missing file is a voter that remembers nothing, an unreadable one too (logged:
/// it then waits a lease before it votes, like any restarted voter).
pub fn load_voter_state(path: &std::path::Path) -> VoterState {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            warn!(path = %path.display(), error = %e, "unreadable fence state; starting from none");
            VoterState::default()
        }),
        Err(_) => VoterState::default(),
    }
}

/// Writes `bytes` to `path` atomically (a temporary file, synced, then renamed).
pub fn write_atomic(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

impl Fence {
    /// Node `node` of shard `shard` with a new `incarnation`, leases of `lease_ms`, its vote persisted at
    /// `state_path` (restored from there).
    pub fn new(
        shard: u32,
        node: u64,
        incarnation: u64,
        lease_ms: u64,
        state_path: Option<PathBuf>,
    ) -> Arc<Fence> {
        let state = state_path
            .as_deref()
            .map(load_voter_state)
            .unwrap_or_default();
        let (want, _) = watch::channel(false);
        Arc::new(Fence {
            shard,
            node,
            base: Instant::now(),
            lease_ms,
            state_path,
            inner: Mutex::new(Inner {
                lease: Lease::new(node, incarnation, lease_ms),
                voter: Voter::new(state, lease_ms, 0),
                successor: Successor::Nobody,
                claim: None,
            }),
            until: AtomicU64::new(0),
            solo: AtomicBool::new(false),
            want,
            deposed: Notify::new(),
            round_now: Notify::new(),
            on_solo: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain values behind; keep serving decisions going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Milliseconds on this node's fence clock.
    pub fn now_ms(&self) -> u64 {
        self.base.elapsed().as_millis() as u64
    }

    /// The lease duration.
    pub fn lease_ms(&self) -> u64 {
        self.lease_ms
    }

    /// Whether this node may serve now.
    pub fn serving(&self) -> bool {
        self.now_ms() < self.until.load(Ordering::Acquire)
    }

    /// Whether a majority recorded in this term that this node serves alone (it may release what its standby did
    /// not acknowledge).
    pub fn solo(&self) -> bool {
        self.solo.load(Ordering::Acquire) && self.serving()
    }

    /// The term held or claimed.
    pub fn term(&self) -> u64 {
        self.lock().lease.term()
    }

    /// Registers what to call when a solo is recorded (the actor releases held outcomes).
    pub fn on_solo(&self, f: Box<dyn Fn() + Send>) {
        *self.on_solo.lock().unwrap_or_else(|p| p.into_inner()) = Some(f);
    }

    /// This node's own vote on `node`'s request (persisted before it is given).
    pub fn answer(&self, node: u64, req: &Request) -> Vote {
        let now = self.now_ms();
        let mut inner = self.lock();
        let before = inner.voter.state();
        let vote = inner.voter.request(node, req, now);
        let after = inner.voter.state();
        if after != before {
            if let Some(path) = &self.state_path {
                let bytes = serde_json::to_vec(&after).unwrap_or_default();
                if let Err(e) = write_atomic(path, &bytes) {
                    // A vote that cannot be remembered is not given.
                    warn!(shard = self.shard, error = %e, "cannot persist the fence state; refusing the vote");
                    inner.voter = Voter::new(before, self.lease_ms, now);
                    return Vote::Refused {
                        term: before.term,
                        why: tether_common::fence::Refusal::Quiet,
                    };
                }
            }
        }
        vote
    }

    /// Who may take over from this node: `Node(incarnation)` once a standby adopted the image and acknowledges
    /// the log, `Nobody` when it is gone.
    pub fn set_successor(&self, successor: Successor) {
        let mut inner = self.lock();
        inner.successor = successor;
        if matches!(successor, Successor::Node(_)) {
            inner.lease.clear_solo();
            self.solo.store(false, Ordering::Release);
        }
        drop(inner);
        // Recorded at once: until a majority knows, a takeover by the new standby would be refused.
        self.round_now.notify_one();
    }

    /// Starts (or stops) campaigning and renewing.
    pub fn want(&self, on: bool) {
        self.want.send_replace(on);
    }

    /// Resolves once this node lost its lease (deposed by a newer term, or not renewed in time).
    pub fn deposed(&self) -> tokio::sync::futures::Notified<'_> {
        self.deposed.notified()
    }

    fn publish(&self, inner: &Inner) {
        self.until.store(inner.lease.until_ms(), Ordering::Release);
        let solo = inner.lease.solo();
        let was = self.solo.swap(solo, Ordering::AcqRel);
        if solo && !was {
            if let Some(f) = self
                .on_solo
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
            {
                f();
            }
        }
    }

    fn round(&self) -> (u64, Request) {
        let now = self.now_ms();
        let mut inner = self.lock();
        // Not renewed in time: the lease ran out while held.
        if inner.lease.held() && now >= inner.lease.until_ms() && inner.lease.until_ms() > 0 {
            inner.lease.depose();
            self.publish(&inner);
            self.deposed.notify_waiters();
            info!(shard = self.shard, "lease ran out: stepping down");
        }
        let successor = inner.successor;
        let claiming = !inner.lease.held();
        let out = inner.lease.round(successor, now);
        inner.claim = claiming.then_some(out);
        drop(inner);
        out
    }

    /// Whether this round is a claim (its own vote waits for another voter's grant).
    fn is_claim(&self, round: u64) -> bool {
        self.lock().claim.is_some_and(|(id, _)| id == round)
    }

    fn take(&self, round: u64, voter: u8, vote: Vote) {
        if let Vote::Refused { term, why } = vote {
            if round > 0 {
                debug!(shard = self.shard, voter, term, %why, "vote refused");
            }
        }
        // Another voter granted this node's claim: now its own vote is given too.
        let own = match (vote, self.lock().claim) {
            (Vote::Granted { .. }, Some((id, req)))
                if id == round && u64::from(voter) != self.node =>
            {
                Some(req)
            }
            _ => None,
        };
        if let Some(req) = own {
            self.lock().claim = None;
            let v = self.answer(self.node, &req);
            self.take(round, self.node as u8, v);
        }
        let mut inner = self.lock();
        let held = inner.lease.held();
        let event = inner.lease.vote(round, voter, vote);
        self.publish(&inner);
        match event {
            LeaseEvent::Deposed => {
                drop(inner);
                info!(
                    shard = self.shard,
                    voter, "a newer term exists: stepping down"
                );
                self.deposed.notify_waiters();
            }
            LeaseEvent::Holding if !held => {
                info!(shard = self.shard, term = inner.lease.term(), "lease won");
            }
            _ => {}
        }
    }

    /// Gives up the lease at once (the node steps down).
    pub fn depose(&self) {
        let mut inner = self.lock();
        inner.lease.depose();
        self.publish(&inner);
    }
}

/// A voter the fence asks over the network.
#[derive(Clone)]
pub struct RemoteVoter {
    /// Voter index (0 and 1 for the shard's nodes, [`WITNESS_VOTER`]).
    pub index: u8,
    /// `host:port`.
    pub addr: String,
}

/// Runs the fence of `fence` against `voters` until the task is aborted: a round every quarter lease while the node
/// wants to lead. `tls` is the node's own identity (it dials as a client).
pub async fn run(fence: Arc<Fence>, voters: Vec<RemoteVoter>, tls: TlsFiles) {
    let tuning = tether_common::net::TransportTuning::for_failover(fence.lease_ms);
    let endpoint = match tether_common::net::client_endpoint(&tls, &tuning) {
        Ok(e) => e,
        Err(e) => {
            warn!(shard = fence.shard, error = %e, "fence: no client endpoint; this node never leads");
            return;
        }
    };
    let links: Vec<mpsc::Sender<(u64, Request)>> = voters
        .into_iter()
        .map(|v| {
            let (tx, rx) = mpsc::channel(4);
            tokio::spawn(voter_link(fence.clone(), endpoint.clone(), v, rx));
            tx
        })
        .collect();
    let mut want = fence.want.subscribe();
    let every = Duration::from_millis((fence.lease_ms / 4).max(10));
    let registration = fence.lock().lease.registration();
    loop {
        if !*want.borrow_and_update() {
            // Not campaigning: register every lease, so that voters learn which incarnation of this node runs (an
            // older one is dead, and what only it held died with it).
            fence.answer(fence.node, &registration);
            for link in &links {
                let _ = link.try_send((0, registration));
            }
            tokio::select! {
                _ = tokio::time::sleep(4 * every) => {}
                r = want.changed() => if r.is_err() { return; },
            }
            continue;
        }
        let (id, req) = fence.round();
        if !fence.is_claim(id) {
            let own = fence.answer(fence.node, &req);
            fence.take(id, fence.node as u8, own);
        }
        for link in &links {
            // A link that is behind (its voter is slow or unreachable) skips this round.
            let _ = link.try_send((id, req));
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = want.changed() => {}
            _ = fence.round_now.notified() => {}
        }
    }
}

/// One voter's link: dials it, sends each round's request, and hands its answers (in order) to the fence;
/// reconnects after a failure.
async fn voter_link(
    fence: Arc<Fence>,
    endpoint: quinn::Endpoint,
    voter: RemoteVoter,
    mut rounds: mpsc::Receiver<(u64, Request)>,
) {
    loop {
        let session = async {
            let addr = resolve(&voter.addr).map_err(|e| NetError::Identity(e.to_string()))?;
            let host = host_of(&voter.addr);
            let conn = tokio::time::timeout(
                Duration::from_millis(fence.lease_ms),
                connect(&endpoint, addr, &host),
            )
            .await
            .map_err(|_| NetError::Identity(format!("{} did not answer", voter.addr)))??;
            // The voter must be who it claims: the witness, or this shard's other node.
            let genuine = if voter.index == WITNESS_VOTER {
                peer_is_witness(&conn)?
            } else {
                peer_shard(&conn)? == fence.shard
            };
            if !genuine {
                return Err(NetError::Identity(format!(
                    "{} is not this shard's voter {}",
                    voter.addr, voter.index
                )));
            }
            let (mut tx, mut rx) = ControlChannel::open(&conn).await?.split();
            let pending: Mutex<VecDeque<u64>> = Mutex::new(VecDeque::new());
            let writer = async {
                while let Some((id, request)) = rounds.recv().await {
                    pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_back(id);
                    tx.send(&Control::LeaseRequest {
                        shard: fence.shard,
                        request,
                    })
                    .await?;
                }
                Ok::<_, NetError>(())
            };
            let reader = async {
                loop {
                    match rx.recv().await? {
                        Control::LeaseVote { round, vote } => {
                            let due = pending
                                .lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .pop_front();
                            // Each request gets one answer, in order: anything else (a second answer, an answer
                            // to a request never sent) would count a promise for a round it was not made for.
                            if due != Some(round) {
                                let due = due.map_or("none".into(), |d| d.to_string());
                                warn!(shard = fence.shard, voter = voter.index, round, %due, "a voter answered a round that was not due; dropping its link");
                                return Err(NetError::Protocol(ProtocolError::UnexpectedMessage(
                                    format!("a vote for round {round} where {due} was due"),
                                )));
                            }
                            fence.take(round, voter.index, vote);
                        }
                        other => {
                            return Err::<(), _>(NetError::Identity(format!(
                                "{} instead of a vote",
                                other.name()
                            )))
                        }
                    }
                }
            };
            tokio::try_join!(writer, reader).map(|_| ())
        };
        if let Err(e) = session.await {
            debug!(shard = fence.shard, voter = voter.index, addr = %voter.addr, error = %e, "fence link down");
        }
        if rounds.is_closed() {
            return;
        }
        // Rounds queued while the link was down are stale: drop them.
        while rounds.try_recv().is_ok() {}
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Answers a voter's requests on an accepted control stream: `first` (already read) and every later one, each
/// with `answer`'s vote for `node` on shard `shard`; ends when the stream does.
pub async fn serve_votes(
    mut control: ControlChannel,
    shard: u32,
    node: u64,
    first: Request,
    answer: impl Fn(&Request) -> Vote,
) -> Result<(), NetError> {
    let mut req = first;
    loop {
        let vote = answer(&req);
        control
            .send(&Control::LeaseVote {
                round: req.round,
                vote,
            })
            .await?;
        match control.recv().await? {
            Control::LeaseRequest { shard: s, request } if s == shard => req = request,
            Control::LeaseRequest { shard: s, .. } => {
                return Err(NetError::Identity(format!(
                    "a vote for shard {s} on shard {shard}'s link (node {node})"
                )))
            }
            other => {
                return Err(NetError::Identity(format!(
                    "{} on a vote link",
                    other.name()
                )))
            }
        }
    }
}
