//! Admission of incoming QUIC connections, in two budgets that one peer cannot exhaust alone. Bookkeeping only, no
//! I/O: the accept loop asks [`Admission::handshake`] what to do with a new connection attempt before any TLS work
//! (queue it for a handshake slot, send a stateless retry, or refuse it), and the connection task asks
//! [`Admission::connection`] for a slot once the TLS handshake has authenticated the peer. Each grant is a value
//! whose drop gives the slot back, so a task that ends for any reason frees what it held.
//!
//! Invariants: at most [`AdmissionLimits::handshakes`] TLS handshakes are in progress, at most
//! [`AdmissionLimits::handshakes_per_ip`] of them from one IP address (more from that address wait their turn, up to
//! [`AdmissionLimits::waiting_per_ip`]), and, under load or when the address already has one pending, only from
//! addresses that proved with a retry token that they receive what is sent to them (a spoofed source cannot hold a
//! handshake slot or a place in the queue); at most [`AdmissionLimits::connections`] authenticated connections are
//! served, at most [`AdmissionLimits::per_identity`] per certificate identity. Over a limit the attempt is turned
//! away at once, never queued behind others, and the budgets are unchanged.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tether_common::net::PeerIdentity;

/// TLS handshakes in progress at once, over all peers.
pub const MAX_HANDSHAKES: usize = 64;
/// TLS handshakes in progress at once from one IP address.
pub const MAX_HANDSHAKES_PER_IP: usize = 8;
/// Attempts from one IP address waiting for one of its handshake slots.
pub const MAX_WAITING_PER_IP: usize = 1024;
/// The longest an attempt waits for a handshake slot of its address before it is refused.
pub const MAX_HANDSHAKE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);
/// With at least this many handshakes pending, a new attempt from an unvalidated address gets a stateless retry.
pub const RETRY_ABOVE: usize = 16;
/// Authenticated connections served at once.
pub const MAX_CONNECTIONS: usize = 1024;
/// Authenticated connections at once per certificate identity (a worker needs one per shard; a reconnect may
/// briefly overlap the connection it replaces).
pub const MAX_CONNECTIONS_PER_IDENTITY: usize = 4;

/// The shared development certificate may hold the connections of at least this many ranks (a development cluster
/// often runs test clients beside its workers under it).
pub const SHARED_CLIENT_MIN_RANKS: u32 = 16;

/// The sizes of the two budgets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// TLS handshakes in progress at once.
    pub handshakes: usize,
    /// TLS handshakes in progress at once from one IP address.
    pub handshakes_per_ip: usize,
    /// Attempts from one IP address waiting for one of its handshake slots.
    pub waiting_per_ip: usize,
    /// Handshakes pending (waiting or in progress) from which on unvalidated addresses are sent a retry.
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
    /// `per_identity` connections for each of them, and for at least [`SHARED_CLIENT_MIN_RANKS`]).
    pub fn for_workers(workers: u32) -> Self {
        Self {
            handshakes: MAX_HANDSHAKES,
            handshakes_per_ip: MAX_HANDSHAKES_PER_IP,
            waiting_per_ip: MAX_WAITING_PER_IP,
            retry_above: RETRY_ABOVE,
            connections: MAX_CONNECTIONS,
            per_identity: MAX_CONNECTIONS_PER_IDENTITY,
            shared_client: MAX_CONNECTIONS_PER_IDENTITY
                .saturating_mul(workers.max(SHARED_CLIENT_MIN_RANKS) as usize),
        }
    }

    fn identity_cap(&self, identity: PeerIdentity) -> usize {
        match identity {
            PeerIdentity::Worker(_) => self.per_identity,
            PeerIdentity::Client => self.shared_client,
            // One replication link, and a spare while a restarted standby's old connection times out.
            PeerIdentity::Standby(_) | PeerIdentity::Shard(_) => 2,
        }
    }
}

/// What to do with a new connection attempt before any TLS work.
#[derive(Debug)]
pub enum HandshakeVerdict {
    /// Wait for a handshake slot of the address ([`HandshakeTurn::admitted`]), then run the TLS handshake.
    Queue(HandshakeTurn),
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
    /// The address already has its share of handshakes in progress and of attempts waiting.
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

/// One address's pending handshakes: its slots, and how many attempts wait for or hold one.
#[derive(Debug)]
struct Address {
    slots: Arc<Semaphore>,
    pending: usize,
}

#[derive(Debug, Default)]
struct Counts {
    handshakes: usize,
    pending: usize,
    per_ip: HashMap<IpAddr, Address>,
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
        // Every update under the lock is a few plain integer and map operations that cannot panic halfway, so a
        // poisoned lock still holds consistent counts.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides on a connection attempt from `ip` (an IPv6 address counts as its /64, which one host usually
    /// holds whole); `validated` says whether it carried a valid retry token.
    pub fn handshake(self: &Arc<Self>, ip: IpAddr, validated: bool) -> HandshakeVerdict {
        let ip = address_key(ip);
        let mut c = self.counts();
        let from_ip = c.per_ip.get(&ip).map_or(0, |a| a.pending);
        if !validated && (from_ip > 0 || c.pending >= self.limits.retry_above) {
            return HandshakeVerdict::Retry;
        }
        if from_ip >= self.limits.handshakes_per_ip + self.limits.waiting_per_ip {
            return HandshakeVerdict::Refuse(HandshakeRefusal::PerIp);
        }
        let per_ip = self.limits.handshakes_per_ip;
        let address = c.per_ip.entry(ip).or_insert_with(|| Address {
            slots: Arc::new(Semaphore::new(per_ip)),
            pending: 0,
        });
        address.pending += 1;
        let slots = address.slots.clone();
        c.pending += 1;
        HandshakeVerdict::Queue(HandshakeTurn {
            pending: Pending {
                admission: self.clone(),
                ip,
            },
            slots,
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

    /// Handshakes in progress, attempts pending (waiting or in progress) and connections held now.
    pub fn in_use(&self) -> (usize, usize, usize) {
        let c = self.counts();
        (c.handshakes, c.pending, c.connections)
    }
}

/// The address an attempt is counted against: IPv4 (also when mapped into IPv6) as is, IPv6 by its /64 prefix.
fn address_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6((u128::from(v6) & !((1u128 << 64) - 1)).into()),
        },
    }
}

/// An attempt counted against its address until dropped.
#[derive(Debug)]
struct Pending {
    admission: Arc<Admission>,
    ip: IpAddr,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let mut c = self.admission.counts();
        c.pending = c.pending.saturating_sub(1);
        if let Some(a) = c.per_ip.get_mut(&self.ip) {
            a.pending = a.pending.saturating_sub(1);
            if a.pending == 0 {
                c.per_ip.remove(&self.ip);
            }
        }
    }
}

/// An attempt queued for one of its address's handshake slots.
#[derive(Debug)]
pub struct HandshakeTurn {
    pending: Pending,
    slots: Arc<Semaphore>,
}

impl HandshakeTurn {
    /// Waits for a handshake slot of the address, then takes one of the shard's; refused if those are all taken.
    /// Cancel-safe: dropping the future gives everything back.
    pub async fn admitted(self) -> Result<HandshakeTicket, HandshakeRefusal> {
        // The semaphore is never closed, so acquiring cannot fail; a refusal is the safe answer if it did.
        let ip_slot = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| HandshakeRefusal::Full)?;
        let admission = self.pending.admission.clone();
        let mut c = admission.counts();
        if c.handshakes >= admission.limits.handshakes {
            return Err(HandshakeRefusal::Full);
        }
        c.handshakes += 1;
        Ok(HandshakeTicket {
            _ip_slot: ip_slot,
            _pending: self.pending,
            admission: admission.clone(),
        })
    }
}

/// A TLS handshake slot; dropping it gives the slot back.
#[derive(Debug)]
pub struct HandshakeTicket {
    _ip_slot: OwnedSemaphorePermit,
    _pending: Pending,
    admission: Arc<Admission>,
}

impl Drop for HandshakeTicket {
    fn drop(&mut self) {
        let mut c = self.admission.counts();
        c.handshakes = c.handshakes.saturating_sub(1);
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
    use std::time::Duration;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            handshakes: 4,
            handshakes_per_ip: 2,
            waiting_per_ip: 1,
            retry_above: 3,
            connections: 3,
            per_identity: 2,
            shared_client: 3,
        }
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    fn queued(v: HandshakeVerdict) -> HandshakeTurn {
        match v {
            HandshakeVerdict::Queue(t) => t,
            other => panic!("expected Queue, got {other:?}"),
        }
    }

    async fn admitted(a: &Arc<Admission>, from: IpAddr, validated: bool) -> HandshakeTicket {
        queued(a.handshake(from, validated))
            .admitted()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_second_unvalidated_attempt_from_one_address_must_prove_it() {
        let a = Admission::new(limits());
        let _first = admitted(&a, ip(1), false).await;
        assert!(matches!(a.handshake(ip(1), false), HandshakeVerdict::Retry));
        // Another address is still let straight in, and the first one again once it proved its address.
        let _other = admitted(&a, ip(2), false).await;
        let _second = admitted(&a, ip(1), true).await;
        assert_eq!(a.in_use(), (3, 3, 0));
    }

    #[tokio::test]
    async fn one_address_waits_its_turn_and_its_queue_is_bounded() {
        let a = Admission::new(limits());
        let held: Vec<_> = [
            admitted(&a, ip(1), true).await,
            admitted(&a, ip(1), true).await,
        ]
        .into();
        let waiting = queued(a.handshake(ip(1), true));
        assert!(matches!(
            a.handshake(ip(1), true),
            HandshakeVerdict::Refuse(HandshakeRefusal::PerIp)
        ));
        assert_eq!(a.in_use(), (2, 3, 0), "a refusal changes nothing");
        // The third from that address waits; another address (validated: the shard is under load) does not.
        let turn = tokio::spawn(waiting.admitted());
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!turn.is_finished(), "took a third slot of one address");
        let _honest = admitted(&a, ip(2), true).await;
        drop(held);
        let third = tokio::time::timeout(Duration::from_secs(5), turn)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(a.in_use(), (2, 2, 0));
        drop(third);
        assert_eq!(a.in_use(), (1, 1, 0));
    }

    #[tokio::test]
    async fn under_load_unvalidated_addresses_get_a_retry_and_the_budget_is_never_exceeded() {
        let a = Admission::new(limits());
        let mut held = Vec::new();
        for k in 1..=3 {
            held.push(admitted(&a, ip(k), false).await);
        }
        assert!(matches!(a.handshake(ip(9), false), HandshakeVerdict::Retry));
        held.push(admitted(&a, ip(9), true).await);
        let over = queued(a.handshake(ip(10), true));
        assert_eq!(over.admitted().await.unwrap_err(), HandshakeRefusal::Full);
        assert_eq!(a.in_use(), (4, 4, 0));
        drop(held);
        assert_eq!(a.in_use(), (0, 0, 0));
    }

    #[tokio::test]
    async fn a_turn_dropped_while_waiting_gives_its_place_back() {
        let a = Admission::new(limits());
        let held = [
            admitted(&a, ip(1), true).await,
            admitted(&a, ip(1), true).await,
        ];
        let waiting = queued(a.handshake(ip(1), true));
        let abandoned = tokio::time::timeout(Duration::from_millis(20), waiting.admitted()).await;
        assert!(abandoned.is_err());
        assert_eq!(a.in_use(), (2, 2, 0));
        drop(held);
        assert_eq!(a.in_use(), (0, 0, 0));
    }

    #[test]
    fn an_ipv6_host_counts_as_its_prefix() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        assert_eq!(address_key(a), address_key(b));
        assert_ne!(address_key(a), address_key(other));
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(address_key(mapped), ip(1));
        assert_eq!(address_key(ip(1)), ip(1));
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
        assert_eq!(a.in_use(), (0, 0, 3));
        drop(w0);
        drop(held);
        assert_eq!(a.in_use(), (0, 0, 0));
        let _back = a.connection(w1).unwrap();
    }

    #[test]
    fn the_shared_development_certificate_has_a_share_per_rank() {
        let l = AdmissionLimits::for_workers(100);
        assert_eq!(l.shared_client, 100 * MAX_CONNECTIONS_PER_IDENTITY);
        assert_eq!(
            l.identity_cap(PeerIdentity::Worker(7)),
            MAX_CONNECTIONS_PER_IDENTITY
        );
        assert_eq!(
            AdmissionLimits::for_workers(2).shared_client,
            SHARED_CLIENT_MIN_RANKS as usize * MAX_CONNECTIONS_PER_IDENTITY
        );
    }
}
