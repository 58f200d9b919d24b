//! Cluster certificates for mutual TLS (`tether-server keygen`): the authority and the per-node bundles.
//!
//! The cluster CA ([`Authority`]) lives in its own folder (`ca.pem`, `ca.key`, and `issued.txt`, a log of every
//! serial it signed) and stays where keygen ran. Each node gets a bundle folder holding only the CA certificate and
//! its own certificate and key (0600): `server-K/` (CN `tether-server-K`, SANs: the shard's own host plus
//! `localhost` and `127.0.0.1`), `worker-R/` (CN `tether-worker-R`, bound to rank R) and, only on request,
//! `client/` (CN [`CLIENT_CN`], may claim any rank: a development convenience). Every certificate has a random
//! 127-bit serial (the handle of `cluster.revoked`) and a validity period. Keys are ECDSA P-256 from ring.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};

/// Common name of the shared development client certificate (may claim any rank).
pub const CLIENT_CN: &str = "tether-client";

/// Common-name prefix of per-worker certificates (`tether-worker-R`).
pub const WORKER_CN_PREFIX: &str = "tether-worker-";

/// Common-name prefix of per-shard server certificates (`tether-server-K`).
pub const SERVER_CN_PREFIX: &str = "tether-server-";

/// Common name of the cluster CA.
pub const CA_CN: &str = "tether-cluster-ca";

/// Default validity of issued certificates, in days.
pub const DEFAULT_DAYS: u32 = 365;

/// Longest serial number accepted (RFC 5280: at most 20 octets).
pub const MAX_SERIAL_BYTES: usize = 20;

/// Why certificate generation or loading failed.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A host is neither an IP address nor a valid DNS name.
    #[error("invalid host {host:?} for a certificate: {reason}")]
    BadHost {
        /// The host as given.
        host: String,
        /// Why it was refused.
        reason: String,
    },
    /// The request does not make sense (no nodes, host count mismatch, zero days, ...).
    #[error("{0}")]
    Invalid(String),
    /// Key or certificate generation failed.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// The CA folder holds no usable authority.
    #[error("cannot use the CA in {path}: {reason}")]
    BadAuthority {
        /// The CA folder.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// Refusing to overwrite an existing CA key.
    #[error("{0} already holds a CA key; add nodes with `keygen issue --ca {0}` instead")]
    AuthorityExists(PathBuf),
    /// Reading or writing a file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// A node a certificate is issued to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// Shard `shard`, reachable at `hosts` (DNS names or IPs; `localhost` and `127.0.0.1` are always added).
    Server {
        /// The shard index.
        shard: u32,
        /// Its own host names or addresses.
        hosts: Vec<String>,
    },
    /// Worker `rank` (may claim only that rank).
    Worker {
        /// The rank.
        rank: u32,
    },
    /// The shared development client (may claim any rank).
    SharedClient,
}

impl Node {
    /// The bundle folder's name: `server-K`, `worker-R` or `client`.
    pub fn bundle_name(&self) -> String {
        match self {
            Node::Server { shard, .. } => format!("server-{shard}"),
            Node::Worker { rank } => worker_file_stem(*rank),
            Node::SharedClient => "client".into(),
        }
    }

    /// The file stem inside the bundle: `server`, `worker` or `client`.
    pub fn stem(&self) -> &'static str {
        match self {
            Node::Server { .. } => "server",
            Node::Worker { .. } => "worker",
            Node::SharedClient => "client",
        }
    }

    /// The certificate's common name.
    pub fn common_name(&self) -> String {
        match self {
            Node::Server { shard, .. } => server_cn(*shard),
            Node::Worker { rank } => worker_cn(*rank),
            Node::SharedClient => CLIENT_CN.into(),
        }
    }
}

/// File stem / bundle name of worker `rank` (`worker-R`).
pub fn worker_file_stem(rank: u32) -> String {
    format!("worker-{rank}")
}

/// Common name of worker `rank`'s certificate.
pub fn worker_cn(rank: u32) -> String {
    format!("{WORKER_CN_PREFIX}{rank}")
}

/// Common name of shard `shard`'s certificate.
pub fn server_cn(shard: u32) -> String {
    format!("{SERVER_CN_PREFIX}{shard}")
}

/// Parses a certificate serial as written by keygen (hex, optionally with `:` separators) into its big-endian
/// bytes without leading zeros; `None` if it is not hex, empty or longer than [`MAX_SERIAL_BYTES`].
pub fn parse_serial(text: &str) -> Option<Vec<u8>> {
    let hex: String = text.trim().chars().filter(|&c| c != ':').collect();
    if hex.is_empty() || hex.len() > 2 * MAX_SERIAL_BYTES + 2 || !hex.is_ascii() {
        return None;
    }
    let padded = if hex.len() % 2 == 1 {
        format!("0{hex}")
    } else {
        hex
    };
    let mut bytes = Vec::with_capacity(padded.len() / 2);
    for pair in padded.as_bytes().chunks(2) {
        // ASCII checked above, so the pair is valid UTF-8.
        let s = std::str::from_utf8(pair).ok()?;
        bytes.push(u8::from_str_radix(s, 16).ok()?);
    }
    let bytes = strip_serial(&bytes).to_vec();
    (bytes.len() <= MAX_SERIAL_BYTES).then_some(bytes)
}

/// A serial's bytes without the leading zero octets DER may carry.
pub fn strip_serial(bytes: &[u8]) -> &[u8] {
    let start = bytes.iter().position(|&b| b != 0).unwrap_or(bytes.len());
    &bytes[start..]
}

/// Formats serial bytes as keygen writes them (lowercase hex, no separators).
pub fn format_serial(bytes: &[u8]) -> String {
    strip_serial(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A validity period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// Not valid before.
    pub not_before: SystemTime,
    /// Not valid after.
    pub not_after: SystemTime,
}

impl Validity {
    /// From an hour ago (clock skew between nodes) to `days` from now.
    pub fn days(days: u32) -> Validity {
        let now = SystemTime::now();
        Validity {
            not_before: now - Duration::from_secs(3600),
            not_after: now + Duration::from_secs(86_400 * u64::from(days)),
        }
    }

    fn apply(&self, params: &mut CertificateParams) {
        params.not_before = self.not_before.into();
        params.not_after = self.not_after.into();
    }
}

fn name(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn.push(DnType::OrganizationName, "tether");
    dn
}

fn san(host: &str) -> Result<SanType, PkiError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let dns = host
        .to_string()
        .try_into()
        .map_err(|e: rcgen::Error| PkiError::BadHost {
            host: host.to_string(),
            reason: e.to_string(),
        })?;
    Ok(SanType::DnsName(dns))
}

fn random_serial() -> Result<SerialNumber, PkiError> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| PkiError::Invalid("the system random source failed".into()))?;
    // Positive and exactly 16 octets in DER: top bit clear, first octet non-zero.
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    Ok(SerialNumber::from_slice(&bytes))
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PkiError + '_ {
    move |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn create_dir(path: &Path, private: bool) -> Result<(), PkiError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).map_err(io_err(path))?;
    if private {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
            .map_err(io_err(path))?;
    }
    Ok(())
}

fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), PkiError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if private {
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io_err(path))?;
    if private {
        // An existing file keeps its old mode through `open`; force 0600.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(path))?;
    }
    file.write_all(contents.as_bytes()).map_err(io_err(path))?;
    file.sync_all().map_err(io_err(path))
}

/// The cluster certificate authority: its certificate and signing key.
pub struct Authority {
    cert: Certificate,
    key: KeyPair,
    pem: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").finish_non_exhaustive()
    }
}

fn ca_params(validity: &Validity) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = name(CA_CN);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity.apply(&mut params);
    params
}

impl Authority {
    /// A new self-signed cluster CA valid for `validity`.
    pub fn new(validity: &Validity) -> Result<Authority, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = ca_params(validity);
        params.serial_number = Some(random_serial()?);
        let cert = params.self_signed(&key)?;
        let pem = cert.pem();
        Ok(Authority { cert, key, pem })
    }

    /// Loads the CA from `dir/ca.pem` and `dir/ca.key`, checking that the key belongs to the certificate.
    pub fn load(dir: &Path) -> Result<Authority, PkiError> {
        let bad = |reason: String| PkiError::BadAuthority {
            path: dir.to_path_buf(),
            reason,
        };
        let pem =
            std::fs::read_to_string(dir.join("ca.pem")).map_err(|e| bad(format!("ca.pem: {e}")))?;
        let key_pem =
            std::fs::read_to_string(dir.join("ca.key")).map_err(|e| bad(format!("ca.key: {e}")))?;
        let key = KeyPair::from_pem(&key_pem).map_err(|e| bad(format!("ca.key: {e}")))?;
        let der = rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| bad(format!("ca.pem: {e}")))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref())
            .map_err(|e| bad(format!("ca.pem: {e}")))?;
        let cn = parsed
            .subject()
            .iter_common_name()
            .next()
            .and_then(|c| c.as_str().ok());
        if cn != Some(CA_CN) {
            return Err(bad(format!("ca.pem names {cn:?}, not {CA_CN:?}")));
        }
        if parsed.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(bad("ca.key is not the key of ca.pem".into()));
        }
        // Signing needs an rcgen `Certificate` for the issuer: the same name and key as ca.pem (which is what a
        // verifier matches), re-signed here; its own serial and validity are never seen by anyone.
        let cert = ca_params(&Validity::days(1)).self_signed(&key)?;
        Ok(Authority { cert, key, pem })
    }

    /// Writes `dir/ca.pem` and `dir/ca.key` (folder 0700, key 0600); refuses to overwrite an existing key.
    pub fn save(&self, dir: &Path) -> Result<(), PkiError> {
        create_dir(dir, true)?;
        let key_path = dir.join("ca.key");
        if key_path.exists() {
            return Err(PkiError::AuthorityExists(dir.to_path_buf()));
        }
        write_file(&dir.join("ca.pem"), &self.pem, false)?;
        write_file(&key_path, &self.key.serialize_pem(), true)
    }

    /// The CA certificate in PEM.
    pub fn ca_pem(&self) -> &str {
        &self.pem
    }

    /// Issues `node` a certificate valid for `validity`.
    pub fn issue(&self, node: &Node, validity: &Validity) -> Result<Issued, PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(&node.common_name());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.use_authority_key_identifier_extension = true;
        let serial = random_serial()?;
        params.serial_number = Some(serial.clone());
        validity.apply(&mut params);
        match node {
            Node::Server { hosts, .. } => {
                let mut names: Vec<&str> = Vec::new();
                for host in hosts
                    .iter()
                    .map(String::as_str)
                    .chain(["localhost", "127.0.0.1"])
                {
                    let host = host.trim();
                    if !host.is_empty() && !names.contains(&host) {
                        names.push(host);
                    }
                }
                params.subject_alt_names = names.into_iter().map(san).collect::<Result<_, _>>()?;
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
            Node::Worker { .. } | Node::SharedClient => {
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            }
        }
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            node: node.clone(),
            serial: format_serial(&serial.to_bytes()),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            validity: *validity,
        })
    }
}

/// A certificate and key issued to one node.
pub struct Issued {
    /// Whom it was issued to.
    pub node: Node,
    /// Its serial, as `cluster.revoked` takes it.
    pub serial: String,
    /// The certificate in PEM.
    pub cert_pem: String,
    key_pem: String,
    /// Its validity period.
    pub validity: Validity,
}

impl std::fmt::Debug for Issued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issued")
            .field("node", &self.node)
            .field("serial", &self.serial)
            .finish_non_exhaustive()
    }
}

impl Issued {
    /// Writes the node's bundle `out/<bundle_name>/` (`ca.pem`, `<stem>.pem`, `<stem>.key` 0600; folder 0700) and
    /// returns its path.
    pub fn write_bundle(&self, out: &Path, ca_pem: &str) -> Result<PathBuf, PkiError> {
        let dir = out.join(self.node.bundle_name());
        create_dir(&dir, true)?;
        let stem = self.node.stem();
        write_file(&dir.join("ca.pem"), ca_pem, false)?;
        write_file(&dir.join(format!("{stem}.pem")), &self.cert_pem, false)?;
        write_file(&dir.join(format!("{stem}.key")), &self.key_pem, true)?;
        Ok(dir)
    }

    /// The line `issued.txt` records: serial, common name, expiry (Unix seconds).
    fn log_line(&self) -> String {
        let expiry = self
            .validity
            .not_after
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        format!("{} {} {expiry}\n", self.serial, self.node.common_name())
    }
}

fn log_issued(ca_dir: &Path, issued: &[Issued]) -> Result<(), PkiError> {
    let path = ca_dir.join("issued.txt");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_err(&path))?;
    for i in issued {
        file.write_all(i.log_line().as_bytes())
            .map_err(io_err(&path))?;
    }
    file.sync_all().map_err(io_err(&path))
}

/// What `keygen` writes for a new cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Shard host names: one for all shards, or one per shard (shard K gets `hosts[K]`).
    pub hosts: Vec<String>,
    /// Shards (bundles `server-0..`).
    pub servers: u32,
    /// Workers (bundles `worker-0..`).
    pub workers: u32,
    /// Also write the shared any-rank `client/` bundle (development only).
    pub shared_client: bool,
    /// Validity of every certificate, CA included, in days.
    pub days: u32,
}

impl Plan {
    /// The nodes the plan covers, servers first.
    pub fn nodes(&self) -> Result<Vec<Node>, PkiError> {
        if self.days == 0 {
            return Err(PkiError::Invalid("--days must be at least 1".into()));
        }
        if self.servers == 0 {
            return Err(PkiError::Invalid(
                "a cluster needs at least one server".into(),
            ));
        }
        if self.workers == 0 && !self.shared_client {
            return Err(PkiError::Invalid(
                "no client certificate would be written: give --workers N (or --dev-shared-client)"
                    .into(),
            ));
        }
        let per_shard = self.hosts.len() > 1;
        if per_shard && self.hosts.len() != self.servers as usize {
            return Err(PkiError::Invalid(format!(
                "{} hosts for {} servers: give one host per shard, or one for all",
                self.hosts.len(),
                self.servers
            )));
        }
        let mut nodes: Vec<Node> = (0..self.servers)
            .map(|shard| Node::Server {
                shard,
                hosts: if per_shard {
                    vec![self.hosts[shard as usize].clone()]
                } else {
                    self.hosts.clone()
                },
            })
            .collect();
        nodes.extend((0..self.workers).map(|rank| Node::Worker { rank }));
        if self.shared_client {
            nodes.push(Node::SharedClient);
        }
        Ok(nodes)
    }
}

/// Creates the cluster CA in `ca_dir` and one bundle per node of `plan` under `out`. Refuses an existing CA.
pub fn generate(out: &Path, ca_dir: &Path, plan: &Plan) -> Result<Vec<Issued>, PkiError> {
    let nodes = plan.nodes()?;
    if ca_dir.join("ca.key").exists() {
        return Err(PkiError::AuthorityExists(ca_dir.to_path_buf()));
    }
    let validity = Validity::days(plan.days);
    let ca = Authority::new(&validity)?;
    let issued = nodes
        .iter()
        .map(|n| ca.issue(n, &validity))
        .collect::<Result<Vec<_>, _>>()?;
    ca.save(ca_dir)?;
    for i in &issued {
        i.write_bundle(out, ca.ca_pem())?;
    }
    log_issued(ca_dir, &issued)?;
    Ok(issued)
}

/// Issues one more node from the CA in `ca_dir` (elastic scaling) and writes its bundle under `out`.
pub fn issue(
    ca_dir: &Path,
    out: &Path,
    node: &Node,
    validity: &Validity,
) -> Result<Issued, PkiError> {
    let ca = Authority::load(ca_dir)?;
    let issued = ca.issue(node, validity)?;
    issued.write_bundle(out, ca.ca_pem())?;
    log_issued(ca_dir, std::slice::from_ref(&issued))?;
    Ok(issued)
}

/// A dev/test shortcut: a CA in `dir/ca`, bundles for `servers` shards (loopback names plus `hosts`), `workers`
/// ranks and the shared client, valid for a year.
pub fn generate_dev(
    dir: &Path,
    hosts: &[String],
    servers: u32,
    workers: u32,
) -> Result<Vec<Issued>, PkiError> {
    generate(
        dir,
        &dir.join("ca"),
        &Plan {
            hosts: hosts.to_vec(),
            servers,
            workers,
            shared_client: true,
            days: DEFAULT_DAYS,
        },
    )
}

/// Gives `path` (and, for a folder, everything under it) to `uid:gid`: for init containers that run keygen as
/// root for nodes that run as another user.
pub fn chown_tree(path: &Path, uid: u32, gid: u32) -> Result<(), PkiError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err(path))?;
    if path.is_dir() {
        for entry in std::fs::read_dir(path).map_err(io_err(path))? {
            let entry = entry.map_err(io_err(path))?;
            chown_tree(&entry.path(), uid, gid)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serials_parse_in_every_written_form() {
        assert_eq!(parse_serial("40ab"), Some(vec![0x40, 0xab]));
        assert_eq!(parse_serial("00:40:AB"), Some(vec![0x40, 0xab]));
        assert_eq!(parse_serial("abc"), Some(vec![0x0a, 0xbc]));
        assert_eq!(parse_serial(""), None);
        assert_eq!(parse_serial("zz"), None);
        assert_eq!(parse_serial("é1"), None);
        assert_eq!(parse_serial(&"11".repeat(21)), None);
        assert_eq!(format_serial(&[0, 0x40, 0xab]), "40ab");
    }

    #[test]
    fn plans_refuse_what_cannot_work() {
        let plan = Plan {
            hosts: vec!["a".into(), "b".into()],
            servers: 3,
            workers: 1,
            shared_client: false,
            days: 1,
        };
        assert!(plan.nodes().is_err());
        let ok = Plan {
            servers: 2,
            ..plan.clone()
        };
        let nodes = ok.nodes().unwrap();
        assert_eq!(
            nodes[1],
            Node::Server {
                shard: 1,
                hosts: vec!["b".into()]
            }
        );
        assert!(Plan {
            workers: 0,
            servers: 2,
            ..plan.clone()
        }
        .nodes()
        .is_err());
        assert!(Plan {
            days: 0,
            servers: 2,
            ..plan
        }
        .nodes()
        .is_err());
    }
}
