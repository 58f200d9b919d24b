//! Peer identity from a verified certificate: the client's rank binding (`tether-worker-R`, or the shared
//! development `tether-client`), a standby dialling its primary (`tether-standby-K`), and the server's shard index
//! (`tether-server-K`, or its standby's `tether-standby-K` after a takeover), plus the serial the deny list
//! (`cluster.revoked`) matches.

use rustls::pki_types::CertificateDer;

use super::NetError;
use crate::pki::{CLIENT_CN, SERVER_CN_PREFIX, STANDBY_CN_PREFIX, WORKER_CN_PREFIX};

/// Who the verified peer certificate says the peer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerIdentity {
    /// A per-worker certificate (`tether-worker-R`): may only claim rank R.
    Worker(u32),
    /// The shared development client certificate (`tether-client`): may claim any rank.
    Client,
    /// Shard K's standby (`tether-standby-K`): may follow shard K, and claims no rank.
    Standby(u32),
    /// Shard K's designated primary (`tether-server-K`) dialling as a client: may follow shard K (a restarted
    /// primary whose standby took over), and claims no rank.
    Shard(u32),
}

/// A canonical decimal index after `prefix` ("+1", "01" and the like are refused).
fn index_after(cn: &str, prefix: &str) -> Option<u32> {
    let digits = cn.strip_prefix(prefix)?;
    let parsed: u32 = digits.parse().ok()?;
    (parsed.to_string() == digits).then_some(parsed)
}

/// The single subject common name of a DER certificate.
fn common_name(der: &CertificateDer<'_>) -> Result<String, NetError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| NetError::Identity(format!("unparsable certificate: {e}")))?;
    let mut names = cert.subject().iter_common_name();
    let cn = names
        .next()
        .and_then(|cn| cn.as_str().ok())
        .ok_or_else(|| NetError::Identity("certificate has no common name".into()))?
        .to_string();
    if names.next().is_some() {
        return Err(NetError::Identity(
            "certificate has several common names".into(),
        ));
    }
    Ok(cn)
}

/// The serial number of a DER certificate (big-endian, without leading zero octets).
pub fn certificate_serial(der: &CertificateDer<'_>) -> Result<Vec<u8>, NetError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref())
        .map_err(|e| NetError::Identity(format!("unparsable certificate: {e}")))?;
    Ok(crate::pki::strip_serial(cert.raw_serial()).to_vec())
}

impl PeerIdentity {
    /// Whether this identity may claim `rank`.
    pub fn allows_rank(self, rank: u32) -> bool {
        match self {
            PeerIdentity::Worker(r) => r == rank,
            PeerIdentity::Client => true,
            PeerIdentity::Standby(_) | PeerIdentity::Shard(_) => false,
        }
    }

    /// The identity a common name denotes, if any.
    pub fn from_common_name(cn: &str) -> Option<PeerIdentity> {
        if cn == CLIENT_CN {
            return Some(PeerIdentity::Client);
        }
        index_after(cn, WORKER_CN_PREFIX)
            .map(PeerIdentity::Worker)
            .or_else(|| index_after(cn, STANDBY_CN_PREFIX).map(PeerIdentity::Standby))
            .or_else(|| index_after(cn, SERVER_CN_PREFIX).map(PeerIdentity::Shard))
    }

    /// The identity in a DER certificate's subject common name.
    pub fn from_certificate(der: &CertificateDer<'_>) -> Result<PeerIdentity, NetError> {
        let cn = common_name(der)?;
        PeerIdentity::from_common_name(&cn).ok_or_else(|| {
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
            PeerIdentity::Standby(k) => write!(f, "{STANDBY_CN_PREFIX}{k}"),
            PeerIdentity::Shard(k) => write!(f, "{SERVER_CN_PREFIX}{k}"),
        }
    }
}

/// The shard index a server certificate names (`tether-server-K`, or shard K's standby `tether-standby-K`, which
/// serves as shard K after a takeover).
pub fn server_shard(der: &CertificateDer<'_>) -> Result<u32, NetError> {
    let cn = common_name(der)?;
    index_after(&cn, SERVER_CN_PREFIX)
        .or_else(|| index_after(&cn, STANDBY_CN_PREFIX))
        .ok_or_else(|| {
            NetError::Identity(format!("common name {cn:?} is not a Tether shard identity"))
        })
}

/// Whether an established connection's peer presented the witness's certificate (`tether-witness`).
pub fn peer_is_witness(conn: &quinn::Connection) -> Result<bool, NetError> {
    Ok(common_name(&peer_leaf(conn)?)? == crate::pki::WITNESS_CN)
}

/// The leaf certificate an established connection's peer presented (verified by the handshake).
fn peer_leaf(conn: &quinn::Connection) -> Result<CertificateDer<'static>, NetError> {
    let any = conn
        .peer_identity()
        .ok_or_else(|| NetError::Identity("peer presented no certificate".into()))?;
    let certs = any
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| NetError::Identity("peer identity is not a certificate chain".into()))?;
    certs
        .first()
        .cloned()
        .ok_or_else(|| NetError::Identity("empty certificate chain".into()))
}

/// The identity of an established connection's client peer (from its verified certificate).
pub fn peer_identity(conn: &quinn::Connection) -> Result<PeerIdentity, NetError> {
    PeerIdentity::from_certificate(&peer_leaf(conn)?)
}

/// The shard index an established connection's server peer proved with its certificate.
pub fn peer_shard(conn: &quinn::Connection) -> Result<u32, NetError> {
    server_shard(&peer_leaf(conn)?)
}
