//! Admission of incoming QUIC connections, in two budgets that one peer cannot exhaust alone. Pure bookkeeping, no
//! I/O: the accept loop asks [`Admission::handshake`] what to do with a new connection attempt before any TLS work
//! (accept it, send a stateless retry, or refuse it), and the connection task asks [`Admission::connection`] for a
//! slot once the TLS handshake has authenticated the peer. Each grant is a ticket whose drop gives the slot back, so
//! a task that ends for any reason frees what it held.
//!
//! Invariants: at most [`AdmissionLimits::handshakes`] TLS handshakes are in progress, at most
//! [`AdmissionLimits::handshakes_per_ip`] of them from one IP address, and, under load or when the address already
//! has one in progress, only from addresses that proved with a retry token that they receive what is sent to them
//! (a spoofed source cannot hold a handshake slot); at most [`AdmissionLimits::connections`] authenticated
//! connections are served, at most [`AdmissionLimits::per_identity`] per certificate identity. Over a limit the new
//! attempt is turned away at once, never queued, and the budgets are unchanged.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tether_common::net::PeerIdentity;

/// TLS handshakes in progress at once, over all peers.
pub const MAX_HANDSHAKES: usize = 64;
/// TLS handshakes in progress at once from one IP address.
pub const MAX_HANDSHAKES_PER_IP: usize = 8;
/// With at least this many handshakes in progress, a new attempt from an unvalidated address gets a stateless retry.
pub const RETRY_ABOVE: usize = 16;
/// Authenticated connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// Authenticated connections at once per certificate identity (a worker needs one per shard; a reconnect may
/// briefly overlap the connection it replaces).
pub const MAX_CONNECTIONS_PER_IDENTITY: usize = 4;

/// The sizes of the two budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// TLS handshakes in progress at once.
    pub handshakes: usize,
    /// TLS handshakes in progress at once from one IP address.
    pub handshakes_per_ip: usize,
    /// Handshakes in progress from which on unvalidated addresses are sent a retry.
    pub retry_above: usize,
    /// Authenticated connections at once.
    pub connections: usize,
    /// Authenticated connections at once per per-worker certificate.
    pub per_identity: usize,
    /// Authenticated connections at once under the shared development certificate, which stands for every rank.
    pub shared_client: usize,
}

impl AdmissionLimits {
    /// The documented limits for a cluster of `workers` ranks (the shared development certificate may hold
    /// `per_identity` connections for each of them).
    pub fn for_workers(workers: u32) -> Self {
        Self {
            handshakes: MAX_HANDSHAKES,
            handshakes_per_ip: MAX_HANDSHAKES_PER_IP,
            retry_above: RETRY_ABOVE,
            connections: MAX_CONNECTIONS,
            per_identity: MAX_CONNECTIONS_PER_IDENTITY,
            shared_client: MAX_CONNECTIONS_PER_IDENTITY.saturating_mul(workers.max(1) as usize),
        }
    }

    fn identity_cap(&self, identity: PeerIdentity) -> usize {
        match identity {
            PeerIdentity::Worker(_) => self.per_identity,
            PeerIdentity::Client => self.shared_client,
        }
    }
}

/// What to do with a new connection attempt before any TLS work.
#[derive(Debug)]
pub enum HandshakeVerdict {
    /// Run the TLS handshake, holding this ticket until it ends.
    Accept(HandshakeTicket),
    /// Answer with a stateless retry: the peer must prove it receives packets at its address.
    Retry,
    /// Refuse at once (QUIC `CONNECTION_REFUSED`; a client retries later).
    Refuse(HandshakeRefusal),
}

/// Why a connection attempt was refused before its TLS handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeRefusal {
    /// Every handshake slot is taken.
    Full,
    /// The address already has its share of handshakes in progress.
    PerIp,
}

/// Why an authenticated connection was refused a slot (a verdict sent to the peer as an `Overloaded` close).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotRefusal {
    /// Every connection slot is taken.
    Full(usize),
    /// This certificate already holds its share.
    PerIdentity {
        /// The certificate's identity.
        identity: PeerIdentity,
        /// Connections it holds.
        held: usize,
    },
}

impl std::fmt::Display for SlotRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotRefusal::Full(n) => write!(f, "the shard serves its maximum of {n} connections"),
            SlotRefusal::PerIdentity { identity, held } => write!(
                f,
                "{identity} already holds {held} connections, the most one certificate may hold"
            ),
        }
    }
}

#[derive(Debug, Default)]
struct Counts {
    handshakes: usize,
    per_ip: HashMap<IpAddr, usize>,
    connections: usize,
    per_identity: HashMap<PeerIdentity, usize>,
}

/// The two budgets of one shard, shared by its accept loop and connection tasks.
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    counts: Mutex<Counts>,
}

impl Admission {
    /// Empty budgets of the given sizes.
    pub fn new(limits: AdmissionLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            counts: Mutex::new(Counts::default()),
        })
    }

    /// The sizes.
    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        // The counters stay consistent under every panic point (each update is one statement), so a poisoned lock
        // still holds valid counts.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides on a connection attempt from `ip`; `validated` says whether it carried a valid retry token.
    pub fn handshake(self: &Arc<Self>, ip: IpAddr, validated: bool) -> HandshakeVerdict {
        let mut c = self.counts();
        let from_ip = c.per_ip.get(&ip).copied().unwrap_or(0);
        if !validated && (from_ip > 0 || c.handshakes >= self.limits.retry_above) {
            return HandshakeVerdict::Retry;
        }
        if c.handshakes >= self.limits.handshakes {
            return HandshakeVerdict::Refuse(HandshakeRefusal::Full);
        }
        if from_ip >= self.limits.handshakes_per_ip {
            return HandshakeVerdict::Refuse(HandshakeRefusal::PerIp);
        }
        c.handshakes += 1;
        *c.per_ip.entry(ip).or_insert(0) += 1;
        HandshakeVerdict::Accept(HandshakeTicket {
            admission: self.clone(),
            ip,
        })
    }

    /// A connection slot for an authenticated peer, or why not.
    pub fn connection(
        self: &Arc<Self>,
        identity: PeerIdentity,
    ) -> Result<ConnectionTicket, SlotRefusal> {
        let mut c = self.counts();
        let held = c.per_identity.get(&identity).copied().unwrap_or(0);
        if held >= self.limits.identity_cap(identity) {
            return Err(SlotRefusal::PerIdentity { identity, held });
        }
        if c.connections >= self.limits.connections {
            return Err(SlotRefusal::Full(self.limits.connections));
        }
        c.connections += 1;
        *c.per_identity.entry(identity).or_insert(0) += 1;
        Ok(ConnectionTicket {
            admission: self.clone(),
            identity,
        })
    }

    /// Handshakes and connections held now.
    pub fn in_use(&self) -> (usize, usize) {
        let c = self.counts();
        (c.handshakes, c.connections)
    }
}

/// A TLS handshake slot; dropping it gives the slot back.
#[derive(Debug)]
pub struct HandshakeTicket {
    admission: Arc<Admission>,
    ip: IpAddr,
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        let mut c = self.admission.counts();
        c.handshakes = c.handshakes.saturating_sub(1);
        if let Some(n) = c.per_ip.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.per_ip.remove(&self.ip);
            }
        }
    }
}

/// An authenticated connection's slot; dropping it gives the slot back.
#[derive(Debug)]
pub struct ConnectionTicket {
    admission: Arc<Admission>,
    identity: PeerIdentity,
}

impl Drop for ConnectionTicket {
    fn drop(&mut self) {
        let mut c = self.admission.counts();
        c.connections = c.connections.saturating_sub(1);
        if let Some(n) = c.per_identity.get_mut(&self.identity) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.per_identity.remove(&self.identity);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            handshakes: 4,
            handshakes_per_ip: 2,
            retry_above: 3,
            connections: 3,
            per_identity: 2,
            shared_client: 3,
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn accepted(v: HandshakeVerdict) -> HandshakeTicket {
        match v {
            HandshakeVerdict::Accept(t) => t,
            other => panic!("expected Accept, got {other:?}"),
        }
    }

    #[test]
    fn a_second_unvalidated_attempt_from_one_address_must_prove_it() {
        let a = Admission::new(limits());
        let _first = accepted(a.handshake(ip(1), false));
        assert!(matches!(a.handshake(ip(1), false), HandshakeVerdict::Retry));
        // Another address is still let straight in, and the first one after it proved its address.
        let _other = accepted(a.handshake(ip(2), false));
        let _second = accepted(a.handshake(ip(1), true));
        assert_eq!(a.in_use(), (3, 0));
    }

    #[test]
    fn one_address_holds_at_most_its_share_of_handshakes() {
        let a = Admission::new(limits());
        let held: Vec<_> = (0..2).map(|_| accepted(a.handshake(ip(1), true))).collect();
        assert!(matches!(
            a.handshake(ip(1), true),
            HandshakeVerdict::Refuse(HandshakeRefusal::PerIp)
        ));
        assert_eq!(a.in_use(), (2, 0), "a refusal changes nothing");
        let _honest = accepted(a.handshake(ip(2), false));
        drop(held);
        assert_eq!(a.in_use(), (1, 0));
        let _again = accepted(a.handshake(ip(1), false));
    }

    #[test]
    fn under_load_unvalidated_addresses_get_a_retry_and_the_budget_is_never_exceeded() {
        let a = Admission::new(limits());
        let _held: Vec<_> = (1..=3).map(|k| accepted(a.handshake(ip(k), false))).collect();
        assert!(matches!(a.handshake(ip(9), false), HandshakeVerdict::Retry));
        let _fourth = accepted(a.handshake(ip(9), true));
        assert!(matches!(
            a.handshake(ip(10), true),
            HandshakeVerdict::Refuse(HandshakeRefusal::Full)
        ));
        assert_eq!(a.in_use(), (4, 0));
    }

    #[test]
    fn one_identity_cannot_take_every_connection_slot() {
        let a = Admission::new(limits());
        let w1 = PeerIdentity::Worker(1);
        let held: Vec<_> = (0..2).map(|_| a.connection(w1).unwrap()).collect();
        assert_eq!(
            a.connection(w1).unwrap_err(),
            SlotRefusal::PerIdentity {
                identity: w1,
                held: 2
            }
        );
        let w0 = a.connection(PeerIdentity::Worker(0)).unwrap();
        assert_eq!(
            a.connection(PeerIdentity::Worker(2)).unwrap_err(),
            SlotRefusal::Full(3)
        );
        assert_eq!(a.in_use(), (0, 3));
        drop(w0);
        drop(held);
        assert_eq!(a.in_use(), (0, 0));
        let _back = a.connection(w1).unwrap();
    }

    #[test]
    fn the_shared_development_certificate_has_a_share_per_rank() {
        let l = AdmissionLimits::for_workers(3);
        assert_eq!(l.shared_client, 3 * MAX_CONNECTIONS_PER_IDENTITY);
        assert_eq!(l.identity_cap(PeerIdentity::Worker(7)), MAX_CONNECTIONS_PER_IDENTITY);
        assert_eq!(AdmissionLimits::for_workers(0).shared_client, MAX_CONNECTIONS_PER_IDENTITY);
    }
}
