//! Fencing of a replicated shard, pure (the shard nodes and the witness of tether-server drive it): at most one of a shard's two nodes serves (applies pushes, answers pulls)
//! at any time, under any partition, pause or restart. No sockets, no clocks: time comes in as `now_ms` (each
//! process's own monotonic clock) and answers come out as values; tether-server's `node.rs` and `witness.rs` move the bytes.
//!
//! Three voters decide: the shard's designated primary (node 0), its standby (node 1) and a witness process. Each
//! holds a [`Voter`]. A node serves only while it holds a [`Lease`]: a majority (two of the three, itself included)
//! granted its term within the last `lease_ms`. A voter that grants a term promises not to grant a higher term to
//! another holder for `lease_ms` after it heard the request; the holder counts its lease from when it *sent* the
//! request, shortened by [`DRIFT_DIVISOR`], so every promise of a granting majority outlives the lease it made. Any
//! two majorities share a voter, so a second node can win a term only after the first node's lease ran out.
//! Assumption: the clocks' rates (not their offsets) differ by less than 1/[`DRIFT_DIVISOR`].
//!
//! Terms are ballots: node `n` only claims terms `t` with `t % 2 == n`, so no two nodes ever hold one term.
//!
//! No acknowledged update is lost (PacificA's rule): a voter also records which incarnation of the other node holds
//! every update the holder acknowledged ([`Successor`]), and grants a takeover only to that incarnation. A holder
//! acknowledges an update its standby has not acknowledged only after a majority recorded [`Successor::Nobody`].
//! A restarted voter grants nothing for `lease_ms` (it may have promised before it died); the witness also persists
//! its [`VoterState`], so a restart never forgets who holds the shard's state.

use serde::{Deserialize, Serialize};

/// The holder's lease is `lease_ms - lease_ms / DRIFT_DIVISOR` from the send time of the request that won it.
pub const DRIFT_DIVISOR: u64 = 8;

/// The number of nodes of a shard (designated primary 0, standby 1); terms are ballots over them.
pub const NODES: u64 = 2;

/// Which incarnation of the shard's non-holding node holds every update the holder acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Successor {
    /// Either node (a shard that has served nobody: both hold the same initial or checkpointed state).
    Any,
    /// This incarnation of the other node follows the holder's log and acknowledged every released update.
    Node(u64),
    /// None: the holder serves alone, and only it holds what it acknowledged.
    Nobody,
}

/// Why a voter did not grant a request (a stable wire value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    /// The term is not one the requesting node may claim (`term % 2 != node`), or it is zero.
    #[error("the term is not one this node may claim")]
    WrongNode,
    /// The voter restarted less than a lease ago and grants nothing yet.
    #[error("the voter restarted less than a lease ago")]
    Quiet,
    /// A higher term was granted already (or the same term to another incarnation).
    #[error("a newer term was granted")]
    Stale,
    /// Another node's lease is still promised.
    #[error("another node holds the lease")]
    Held,
    /// The requester does not hold every acknowledged update (it is not the recorded successor).
    #[error("the requester may lack acknowledged updates")]
    NotSynced,
    /// A registration (term 0): the voter noted the requester's incarnation and grants nothing.
    #[error("registration noted")]
    Registered,
}

/// A voter's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Vote {
    /// The term is granted; the promise runs `lease_ms` from the voter's receipt.
    Granted {
        /// The term granted.
        term: u64,
    },
    /// Refused; `term` is the highest term the voter granted (a requester learns from it).
    Refused {
        /// The voter's newest term.
        term: u64,
        /// Why.
        why: Refusal,
    },
}

/// What a voter must remember across restarts (the witness writes it to disk before it answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VoterState {
    /// The highest term granted (0: none).
    pub term: u64,
    /// The incarnation `term` was granted to.
    pub holder: Option<u64>,
    /// The holder's newest round this voter took (older rounds of the same holder, delivered late, are refused).
    pub round: u64,
    /// Who may take over from the holder.
    pub successor: Successor,
    /// The newest incarnation heard from each node (an older one is dead: a process restarted).
    pub known: [Option<u64>; 2],
}

impl Default for VoterState {
    fn default() -> Self {
        VoterState {
            term: 0,
            holder: None,
            round: 0,
            successor: Successor::Any,
            known: [None, None],
        }
    }
}

impl VoterState {
    /// Whether incarnation `inc` of node `node` is known to be dead (its node has since run another).
    fn dead(&self, node: u64, inc: u64) -> bool {
        self.known[node as usize % 2].is_some_and(|k| k != inc)
    }

    /// Whether the candidate `inc` of node `node` may take over from the recorded holder without losing an
    /// acknowledged update that a live process still holds: it is the recorded successor, or the holder's process
    /// is dead (its node has since run another incarnation) and the candidate is the other node, which then holds
    /// the most of the shard's state that survives (updates the dead holder alone held died with it).
    fn may_succeed(&self, node: u64, inc: u64) -> bool {
        let Some(holder) = self.holder else {
            return true;
        };
        let holder_node = self.term % NODES;
        match self.successor {
            Successor::Any => true,
            Successor::Node(i) if i == inc => true,
            _ => node != holder_node && self.dead(holder_node, holder),
        }
    }
}

/// One request a node sends to every voter: claim or renew `term`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// The term claimed.
    pub term: u64,
    /// The requesting process's incarnation (random per process start).
    pub incarnation: u64,
    /// The request's number among its incarnation's requests (increasing).
    pub round: u64,
    /// Who may take over from the requester once it holds the term.
    pub successor: Successor,
}

/// One voter (a node's own vote, the other node's, or the witness's).
#[derive(Debug, Clone)]
pub struct Voter {
    state: VoterState,
    promise_until: u64,
    quiet_until: u64,
    lease_ms: u64,
}

impl Voter {
    /// A voter that starts (or restarts) at `now_ms` with `state` (the default for one that remembers nothing): it
    /// grants nothing for a lease, because it may have promised before.
    pub fn new(state: VoterState, lease_ms: u64, now_ms: u64) -> Voter {
        Voter {
            state,
            promise_until: 0,
            quiet_until: now_ms.saturating_add(lease_ms),
            lease_ms,
        }
    }

    /// What it remembers.
    pub fn state(&self) -> VoterState {
        self.state
    }

    /// Answers `node`'s request (`node` comes from the requester's certificate, never from its message): a
    /// registration (term 0) only notes the requester's incarnation, a claim is granted or refused; the state
    /// changes only on a grant, besides the incarnation noted.
    pub fn request(&mut self, node: u64, req: &Request, now_ms: u64) -> Vote {
        if node < NODES {
            self.state.known[node as usize] = Some(req.incarnation);
        }
        let refuse = |why| Vote::Refused {
            term: self.state.term,
            why,
        };
        if req.term == 0 && node < NODES {
            return refuse(Refusal::Registered);
        }
        if req.term == 0 || req.term % NODES != node {
            return refuse(Refusal::WrongNode);
        }
        if req.term < self.state.term {
            return refuse(Refusal::Stale);
        }
        let same_holder = self.state.holder == Some(req.incarnation);
        if req.term == self.state.term {
            if !same_holder || req.round <= self.state.round {
                return refuse(Refusal::Stale);
            }
        } else if !same_holder && self.state.holder.is_some() {
            // A takeover: only once the holder's promise ran out, and only by the node holding its updates. A
            // restarted voter may have promised its recorded holder before it died: it grants no takeover until
            // that promise has run out, unless the holder is dead too (promises only ever go to the recorded
            // holder, so its renewals are answered at once).
            if let Some(h) = self.state.holder {
                if now_ms < self.quiet_until && !self.state.dead(self.state.term % NODES, h) {
                    return refuse(Refusal::Quiet);
                }
            }
            if now_ms < self.promise_until {
                return refuse(Refusal::Held);
            }
            if !self.state.may_succeed(node, req.incarnation) {
                return refuse(Refusal::NotSynced);
            }
        }
        self.state = VoterState {
            term: req.term,
            holder: Some(req.incarnation),
            round: req.round,
            successor: req.successor,
            known: self.state.known,
        };
        self.promise_until = now_ms.saturating_add(self.lease_ms);
        Vote::Granted { term: req.term }
    }
}

/// The smallest term above `seen` that `node` may claim.
pub fn next_term(node: u64, seen: u64) -> u64 {
    let t = seen + 1;
    t + (node + NODES - t % NODES) % NODES
}

/// What a [`Lease`] learned from a vote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseEvent {
    /// Nothing changed.
    None,
    /// A majority granted the term: the node holds (or extended) its lease.
    Holding,
    /// A voter knows a newer term: the node no longer holds the shard (it stops serving at once).
    Deposed,
}

/// A request that went out and the votes it has so far.
#[derive(Debug, Clone, Copy)]
struct Round {
    id: u64,
    sent_ms: u64,
    successor: Successor,
    granted: u8,
}

/// Rounds kept waiting for late votes.
const ROUNDS_KEPT: usize = 8;

/// Voters of a shard (the two nodes and the witness).
pub const VOTERS: u8 = 3;

/// One node's side: the term it claims and how long its lease lasts. Call order: [`Lease::round`] → send the
/// request to every voter (the node's own included) → [`Lease::vote`] for each answer; [`Lease::serving`] says
/// whether the node may serve at a given time.
#[derive(Debug, Clone)]
pub struct Lease {
    node: u64,
    incarnation: u64,
    lease_ms: u64,
    term: u64,
    seen: u64,
    held: bool,
    until_ms: u64,
    solo_term: Option<u64>,
    /// Only a `Nobody` round from this one on may record a solo (older ones predate the standby's attachment).
    solo_from: u64,
    next_round: u64,
    rounds: Vec<Round>,
}

impl Lease {
    /// Node `node` (0: designated primary, 1: standby) of incarnation `incarnation`, holding nothing.
    pub fn new(node: u64, incarnation: u64, lease_ms: u64) -> Lease {
        Lease {
            node,
            incarnation,
            lease_ms,
            term: 0,
            seen: 0,
            held: false,
            until_ms: 0,
            solo_term: None,
            solo_from: 0,
            next_round: 1,
            rounds: Vec::new(),
        }
    }

    /// Starts a round at `now_ms`: renews the held term, or claims the next free one. Returns the round's id and the
    /// request to send to every voter.
    pub fn round(&mut self, successor: Successor, now_ms: u64) -> (u64, Request) {
        if !self.held {
            // Claim again the term a previous round claimed, unless a voter reported one at least as new.
            if self.term == 0 || self.seen >= self.term {
                self.term = next_term(self.node, self.seen.max(self.term));
            }
            self.until_ms = 0;
        }
        let id = self.next_round;
        self.next_round += 1;
        if self.rounds.len() == ROUNDS_KEPT {
            self.rounds.remove(0);
        }
        self.rounds.push(Round {
            id,
            sent_ms: now_ms,
            successor,
            granted: 0,
        });
        let req = Request {
            term: self.term,
            incarnation: self.incarnation,
            round: id,
            successor,
        };
        (id, req)
    }

    /// A registration: tells a voter this incarnation runs (a voter learns from it that older incarnations of this
    /// node are dead); it claims nothing, and its answer can be dropped.
    pub fn registration(&self) -> Request {
        Request {
            term: 0,
            incarnation: self.incarnation,
            round: 0,
            successor: Successor::Nobody,
        }
    }

    /// Takes voter `voter`'s answer (0..[`VOTERS`]) to round `id`; a voter's second answer to a round counts once.
    pub fn vote(&mut self, id: u64, voter: u8, vote: Vote) -> LeaseEvent {
        let Some(round) = self.rounds.iter_mut().find(|r| r.id == id) else {
            return LeaseEvent::None;
        };
        if voter >= VOTERS {
            return LeaseEvent::None;
        }
        match vote {
            Vote::Granted { term } if term == self.term => {
                round.granted |= 1 << voter;
                if round.granted.count_ones() * 2 <= u32::from(VOTERS) {
                    return LeaseEvent::None;
                }
                let until = round.sent_ms + self.lease_ms - self.lease_ms / DRIFT_DIVISOR;
                if round.successor == Successor::Nobody && round.id >= self.solo_from {
                    self.solo_term = Some(self.term);
                }
                self.held = true;
                self.until_ms = self.until_ms.max(until);
                LeaseEvent::Holding
            }
            Vote::Granted { .. } => LeaseEvent::None,
            Vote::Refused { term, .. } => {
                self.seen = self.seen.max(term);
                if self.held && term > self.term {
                    self.depose();
                    return LeaseEvent::Deposed;
                }
                LeaseEvent::None
            }
        }
    }

    /// Gives up the term (the node steps down).
    pub fn depose(&mut self) {
        self.held = false;
        self.until_ms = 0;
        self.solo_term = None;
        self.rounds.clear();
    }

    /// Whether the node may serve at `now_ms`: it holds its term and the lease has not run out.
    pub fn serving(&self, now_ms: u64) -> bool {
        self.held && now_ms < self.until_ms
    }

    /// When the lease runs out (0: none held).
    pub fn until_ms(&self) -> u64 {
        if self.held {
            self.until_ms
        } else {
            0
        }
    }

    /// Whether the node holds a term (its lease may still have run out).
    pub fn held(&self) -> bool {
        self.held
    }

    /// The term claimed or held.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Whether a majority recorded, in this term, that nobody else holds the acknowledged updates: the node may then
    /// release outcomes its standby did not acknowledge.
    pub fn solo(&self) -> bool {
        self.held && self.solo_term == Some(self.term)
    }

    /// Forgets a recorded solo (a standby attached: from now on releases wait for it again).
    pub fn clear_solo(&mut self) {
        self.solo_term = None;
        self.solo_from = self.next_round;
    }

    /// The highest term any voter reported.
    pub fn seen(&self) -> u64 {
        self.seen.max(self.term)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: u64 = 1000;

    fn req(term: u64, incarnation: u64, successor: Successor) -> Request {
        use std::sync::atomic::{AtomicU64, Ordering};
        static ROUND: AtomicU64 = AtomicU64::new(1);
        Request {
            term,
            incarnation,
            round: ROUND.fetch_add(1, Ordering::Relaxed),
            successor,
        }
    }

    #[test]
    fn terms_are_ballots() {
        assert_eq!(next_term(0, 0), 2);
        assert_eq!(next_term(1, 0), 1);
        assert_eq!(next_term(0, 2), 4);
        assert_eq!(next_term(1, 2), 3);
        assert_eq!(next_term(1, 3), 5);
    }

    #[test]
    fn a_voter_refuses_a_wrong_node_a_quiet_start_and_a_held_lease() {
        // Restarted with a holder that may live: quiet for a lease. A dead holder (its node runs another
        // incarnation) was promised nothing that still matters.
        let held = VoterState {
            term: 1,
            holder: Some(5),
            known: [None, Some(5)],
            ..VoterState::default()
        };
        let mut q = Voter::new(held, L, 0);
        assert!(matches!(
            q.request(0, &req(2, 7, Successor::Any), 10),
            Vote::Refused {
                why: Refusal::Quiet,
                ..
            }
        ));
        assert!(matches!(
            q.request(1, &req(0, 6, Successor::Any), 20),
            Vote::Refused {
                why: Refusal::Registered,
                ..
            }
        ));
        assert_eq!(
            q.request(0, &req(2, 7, Successor::Any), 30),
            Vote::Granted { term: 2 }
        );
        let mut v = Voter::new(VoterState::default(), L, 0);
        assert!(matches!(
            v.request(1, &req(2, 7, Successor::Any), L),
            Vote::Refused {
                why: Refusal::WrongNode,
                ..
            }
        ));
        assert_eq!(
            v.request(0, &req(2, 7, Successor::Any), L),
            Vote::Granted { term: 2 }
        );
        // The standby may not take over while the promise runs, then may.
        assert!(matches!(
            v.request(1, &req(3, 9, Successor::Nobody), L + 10),
            Vote::Refused {
                why: Refusal::Held,
                ..
            }
        ));
        assert_eq!(
            v.request(1, &req(3, 9, Successor::Nobody), 2 * L),
            Vote::Granted { term: 3 }
        );
        // The old holder's renewal is now stale.
        assert!(matches!(
            v.request(0, &req(2, 7, Successor::Any), 2 * L + 1),
            Vote::Refused {
                term: 3,
                why: Refusal::Stale
            }
        ));
    }

    #[test]
    fn only_the_recorded_successor_takes_over() {
        let mut v = Voter::new(VoterState::default(), L, 0);
        assert!(matches!(
            v.request(0, &req(2, 7, Successor::Nobody), L),
            Vote::Granted { .. }
        ));
        assert!(matches!(
            v.request(1, &req(3, 9, Successor::Nobody), 3 * L),
            Vote::Refused {
                why: Refusal::NotSynced,
                ..
            }
        ));
        assert!(matches!(
            v.request(0, &req(2, 7, Successor::Node(9)), 3 * L),
            Vote::Granted { .. }
        ));
        // A restarted standby (another incarnation) is not the recorded one.
        assert!(matches!(
            v.request(1, &req(3, 10, Successor::Nobody), 5 * L),
            Vote::Refused {
                why: Refusal::NotSynced,
                ..
            }
        ));
        assert!(matches!(
            v.request(1, &req(3, 9, Successor::Nobody), 5 * L),
            Vote::Granted { .. }
        ));
        // A restarted primary may not renew the term its earlier incarnation held.
        let mut w = Voter::new(VoterState::default(), L, 0);
        w.request(0, &req(2, 7, Successor::Any), L);
        assert!(matches!(
            w.request(0, &req(2, 8, Successor::Any), L + 1),
            Vote::Refused {
                why: Refusal::Stale,
                ..
            }
        ));
    }

    #[test]
    fn a_lease_needs_a_majority_and_ends_before_the_promises() {
        let mut lease = Lease::new(0, 7, L);
        let (id, r) = lease.round(Successor::Any, 100);
        assert_eq!(r.term, 2);
        assert_eq!(
            lease.vote(id, 0, Vote::Granted { term: 2 }),
            LeaseEvent::None
        );
        assert!(!lease.serving(100));
        // The same voter twice is still one vote.
        assert_eq!(
            lease.vote(id, 0, Vote::Granted { term: 2 }),
            LeaseEvent::None
        );
        assert_eq!(
            lease.vote(id, 2, Vote::Granted { term: 2 }),
            LeaseEvent::Holding
        );
        assert!(lease.serving(100 + L - L / DRIFT_DIVISOR - 1));
        assert!(!lease.serving(100 + L - L / DRIFT_DIVISOR));
        let (id, _) = lease.round(Successor::Nobody, 500);
        assert!(!lease.solo());
        lease.vote(id, 0, Vote::Granted { term: 2 });
        lease.vote(id, 1, Vote::Granted { term: 2 });
        assert!(lease.solo());
        assert_eq!(
            lease.vote(
                id,
                1,
                Vote::Refused {
                    term: 3,
                    why: Refusal::Stale
                }
            ),
            LeaseEvent::Deposed
        );
        assert!(!lease.serving(501));
        let (_, r) = lease.round(Successor::Nobody, 600);
        assert_eq!(r.term, 4);
        // A round nobody answered with a newer term claims the same term again.
        let (_, r) = lease.round(Successor::Nobody, 900);
        assert_eq!(r.term, 4);
    }
}
