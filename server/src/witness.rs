//! The witness (`tether-server witness`): the third vote of every replicated shard. One small process for the
//! whole cluster holds one [`Voter`] per shard, answers the shard nodes' lease requests over mutual-TLS QUIC (the
//! requester's node index comes from its certificate: `tether-server-K` is node 0, `tether-standby-K` node 1),
//! and writes what it granted to its state file before it answers, so a restart forgets no holder. It holds no
//! weights and sees no worker.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tracing::{debug, info, warn};

use tether_common::config::Config;
use tether_common::fence::{Refusal, Request, Vote, Voter, VoterState};
use tether_common::net::{
    close_with, peer_identity, server_endpoint, ControlChannel, NetError, PeerIdentity, TlsFiles,
    TransportTuning,
};
use tether_common::protocol::{Control, ErrorCode};

use crate::error::Error;
use crate::fence_link::{serve_votes, write_atomic};

/// The witness's voters and where it keeps them.
struct Ballots {
    voters: BTreeMap<u32, Voter>,
    path: PathBuf,
    base: Instant,
    lease_ms: u64,
}

impl Ballots {
    fn answer(&mut self, shard: u32, node: u64, req: &Request) -> Vote {
        let now = self.base.elapsed().as_millis() as u64;
        let Some(voter) = self.voters.get_mut(&shard) else {
            return Vote::Refused {
                term: 0,
                why: Refusal::WrongNode,
            };
        };
        let before = voter.state();
        let vote = voter.request(node, req, now);
        if voter.state() != before {
            let states: BTreeMap<u32, VoterState> =
                self.voters.iter().map(|(k, v)| (*k, v.state())).collect();
            let bytes = serde_json::to_vec_pretty(&states).unwrap_or_default();
            if let Err(e) = write_atomic(&self.path, &bytes) {
                // A grant the witness could not remember is not given.
                warn!(path = %self.path.display(), error = %e, "cannot persist the witness state; refusing");
                self.voters
                    .insert(shard, Voter::new(before, self.lease_ms, now));
                return Vote::Refused {
                    term: before.term,
                    why: Refusal::Quiet,
                };
            }
        }
        vote
    }
}

/// A running witness.
pub struct RunningWitness {
    /// The bound UDP address.
    pub local_addr: SocketAddr,
    endpoint: quinn::Endpoint,
    accept: tokio::task::JoinHandle<()>,
}

impl RunningWitness {
    /// Stops answering.
    pub fn shutdown(self) {
        self.accept.abort();
        self.endpoint
            .close(ErrorCode::Shutdown.close_code(), b"witness shutting down");
    }
}

/// Starts the witness of `cfg` on `listen` (default `cluster.witness`), with the `witness` bundle of
/// `cluster.tls_dir` (or `tls`), keeping its votes in `state` (restored from there).
pub async fn start_witness(
    cfg: &Config,
    listen: Option<SocketAddr>,
    tls: Option<TlsFiles>,
    state: PathBuf,
) -> Result<RunningWitness, Error> {
    let listen =
        match listen {
            Some(a) => a,
            None => crate::address::resolve(cfg.cluster.witness.as_deref().ok_or_else(|| {
                Error::Address("no --listen and no cluster.witness address".into())
            })?)?,
        };
    let tls = match tls {
        Some(t) => t,
        None => TlsFiles::for_witness(&cfg.cluster.tls_dir)?,
    }
    .with_revoked(&cfg.cluster.revoked_serials());
    let lease_ms = cfg.cluster.failover_ms;
    let saved: BTreeMap<u32, VoterState> = match std::fs::read(&state) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            Error::Address(format!(
                "the witness state {} is unreadable ({e}): it must not be dropped silently, since it records \
                 which node holds every acknowledged update; move it away only for a cluster that starts over",
                state.display()
            ))
        })?,
        Err(_) => BTreeMap::new(),
    };
    let voters = (0..cfg.cluster.servers.len() as u32)
        .map(|k| {
            let s = saved.get(&k).copied().unwrap_or_default();
            // A restarted witness waits a lease before it votes: it may have promised before.
            (k, Voter::new(s, lease_ms, 0))
        })
        .collect();
    let ballots = Arc::new(Mutex::new(Ballots {
        voters,
        path: state,
        base: Instant::now(),
        lease_ms,
    }));
    let endpoint = server_endpoint(listen, &tls, &TransportTuning::for_failover(lease_ms))?;
    let local_addr = endpoint.local_addr().map_err(|source| NetError::Bind {
        addr: listen,
        source,
    })?;
    let accept = tokio::spawn(accept_loop(endpoint.clone(), ballots));
    info!(%local_addr, lease_ms, "witness serving");
    Ok(RunningWitness {
        local_addr,
        endpoint,
        accept,
    })
}

async fn accept_loop(endpoint: quinn::Endpoint, ballots: Arc<Mutex<Ballots>>) {
    while let Some(incoming) = endpoint.accept().await {
        let ballots = ballots.clone();
        tokio::spawn(async move {
            let peer = incoming.remote_address();
            let conn =
                match tokio::time::timeout(crate::admission::MAX_HANDSHAKE_WAIT, incoming).await {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "witness: handshake failed");
                        return;
                    }
                    Err(_) => return,
                };
            // Only a shard's nodes vote-request; the node index is the certificate's.
            let (shard, node) = match peer_identity(&conn) {
                Ok(PeerIdentity::Shard(k)) => (k, 0),
                Ok(PeerIdentity::Standby(k)) => (k, 1),
                Ok(other) => {
                    warn!(%peer, identity = %other, "witness: refusing a peer that is no shard node");
                    close_with(&conn, ErrorCode::Unauthorized, "not a shard node");
                    return;
                }
                Err(e) => {
                    close_with(&conn, ErrorCode::Unauthorized, &e.to_string());
                    return;
                }
            };
            while let Ok(mut control) = ControlChannel::accept(&conn).await {
                let first = match control.recv().await {
                    Ok(Control::LeaseRequest { shard: s, request }) if s == shard => request,
                    Ok(_) => {
                        warn!(%peer, shard, "witness: a request for another shard, or no request");
                        close_with(&conn, ErrorCode::Unauthorized, "not this node's shard");
                        return;
                    }
                    Err(_) => return,
                };
                let ballots = ballots.clone();
                let answer = move |req: &Request| {
                    ballots
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .answer(shard, node, req)
                };
                if let Err(e) = serve_votes(control, shard, node, first, answer).await {
                    debug!(%peer, shard, error = %e, "witness: vote link ended");
                }
            }
        });
    }
}
