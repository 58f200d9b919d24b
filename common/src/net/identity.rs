//! Peer identity from the verified client certificate's common name.

use rustls::pki_types::CertificateDer;

use super::NetError;
use crate::pki::{CLIENT_CN, WORKER_CN_PREFIX};

/// Who the verified peer certificate says the peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerIdentity {
    /// A per-worker certificate (`tether-worker-R`): may only claim rank R.
    Worker(u32),
    /// The shared cluster client certificate (`tether-client`): may claim any rank.
    Client,
}

impl PeerIdentity {
    /// Whether this identity may claim `rank`.
    pub fn allows_rank(self, rank: u32) -> bool {
        match self {
            PeerIdentity::Worker(r) => r == rank,
            PeerIdentity::Client => true,
        }
    }

    /// The identity a common name denotes, if any.
    pub fn from_common_name(cn: &str) -> Option<PeerIdentity> {
        if cn == CLIENT_CN {
            return Some(PeerIdentity::Client);
        }
        let rank = cn.strip_prefix(WORKER_CN_PREFIX)?;
        // Reject "+1", "01" and the like: the name must be the canonical decimal form.
        let parsed: u32 = rank.parse().ok()?;
        (parsed.to_string() == rank).then_some(PeerIdentity::Worker(parsed))
    }

    /// The identity in a DER certificate's subject common name.
    pub fn from_certificate(der: &CertificateDer<'_>) -> Result<PeerIdentity, NetError> {
        let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| NetError::Identity(format!("unparsable certificate: {e}")))?;
        let mut names = cert.subject().iter_common_name();
        let cn = names
            .next()
            .and_then(|cn| cn.as_str().ok())
            .ok_or_else(|| NetError::Identity("certificate has no common name".into()))?;
        if names.next().is_some() {
            return Err(NetError::Identity(
                "certificate has several common names".into(),
            ));
        }
        PeerIdentity::from_common_name(cn).ok_or_else(|| {
            NetError::Identity(format!(
                "common name {cn:?} is not a Tether client identity"
            ))
        })
    }
}

impl std::fmt::Display for PeerIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerIdentity::Worker(r) => write!(f, "{WORKER_CN_PREFIX}{r}"),
            PeerIdentity::Client => f.write_str(CLIENT_CN),
        }
    }
}

/// The identity of an established connection's peer (from its verified certificate).
pub fn peer_identity(conn: &quinn::Connection) -> Result<PeerIdentity, NetError> {
    let any = conn
        .peer_identity()
        .ok_or_else(|| NetError::Identity("peer presented no certificate".into()))?;
    let certs = any
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| NetError::Identity("peer identity is not a certificate chain".into()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| NetError::Identity("empty certificate chain".into()))?;
    PeerIdentity::from_certificate(leaf)
}
