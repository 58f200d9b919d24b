//! Cluster certificates for mutual TLS (`tether-server keygen`): the authority and the per-node bundles.
//!
//! The cluster CA ([`Authority`]) lives in its own folder (`ca.pem`, `ca.key`, and `issued.txt`, a log of every
//! serial it signed) and stays where keygen ran. Each node gets a bundle folder holding only the CA certificate and
//! its own certificate and key (0600): `server-K/` (CN `tether-server-K`, SANs: the shard's own host plus
//! `localhost` and `127.0.0.1`), `worker-R/` (CN `tether-worker-R`, bound to rank R) and, only on request,
//! `client/` (CN [`CLIENT_CN`], may claim any rank: a development convenience). Every certificate has a random
//! 127-bit serial (the handle of `cluster.revoked`) and a validity period. Keys are ECDSA P-256 from ring.
//!
//! A shard's bundle also holds [`CHECKPOINT_KEY_FILE`] (0600): the [`CheckpointKey`] its checkpoints are
//! authenticated with. Re-issuing a shard's certificate keeps the key that is there, so the shard's checkpoints stay
//! loadable. Bundles are never replaced silently: [`issue`] and [`generate`] refuse a folder that already holds one
//! and name its serial; [`reissue`] replaces it and returns the serial to put in `cluster.revoked`.

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

/// Common-name prefix of per-shard standby certificates (`tether-standby-K`).
pub const STANDBY_CN_PREFIX: &str = "tether-standby-";
/// Common name of the witness's certificate (the third vote of every replicated shard).
pub const WITNESS_CN: &str = "tether-witness";

/// Common name of the cluster CA.
pub const CA_CN: &str = "tether-cluster-ca";

/// Default validity of issued certificates, in days.
pub const DEFAULT_DAYS: u32 = 365;

/// Longest serial number accepted (RFC 5280: at most 20 octets).
pub const MAX_SERIAL_BYTES: usize = 20;

/// File name of a shard's checkpoint key inside its bundle.
pub const CHECKPOINT_KEY_FILE: &str = "checkpoint.key";

/// Length of a checkpoint key in bytes.
pub const CHECKPOINT_KEY_BYTES: usize = 32;

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
    /// Refusing to replace an existing node bundle without `--force`.
    #[error(
        "{path} already holds a bundle (certificate serial {}); add --force to replace it, then list that serial \
         in cluster.revoked",
        serial.as_deref().unwrap_or("unreadable")
    )]
    BundleExists {
        /// The bundle folder.
        path: PathBuf,
        /// The serial of the certificate in it, when it can be read.
        serial: Option<String>,
    },
    /// A checkpoint key file is missing, unreadable or malformed, or refusing to overwrite one.
    #[error("checkpoint key {path}: {reason}")]
    CheckpointKey {
        /// The key file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
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
    /// Shard `shard`'s standby, reachable at `hosts`: serves as shard `shard` after a takeover and dials its primary
    /// as a client while it follows it.
    Standby {
        /// The shard index it replicates.
        shard: u32,
        /// Its own host names or addresses.
        hosts: Vec<String>,
    },
    /// The witness (`tether-witness`), reachable at `hosts`: the third vote that fences replicated shards.
    Witness {
        /// Its own host names or addresses.
        hosts: Vec<String>,
    },
}

impl Node {
    /// The bundle folder's name: `server-K`, `worker-R` or `client`.
    pub fn bundle_name(&self) -> String {
        match self {
            Node::Server { shard, .. } => format!("server-{shard}"),
            Node::Worker { rank } => worker_file_stem(*rank),
            Node::SharedClient => "client".into(),
            Node::Standby { shard, .. } => format!("standby-{shard}"),
            Node::Witness { .. } => "witness".into(),
        }
    }

    /// The file stem inside the bundle: `server`, `worker` or `client`.
    pub fn stem(&self) -> &'static str {
        match self {
            Node::Server { .. } | Node::Standby { .. } | Node::Witness { .. } => "server",
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
            Node::Standby { shard, .. } => standby_cn(*shard),
            Node::Witness { .. } => WITNESS_CN.into(),
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

/// Common name of shard `shard`'s standby certificate.
pub fn standby_cn(shard: u32) -> String {
    format!("{STANDBY_CN_PREFIX}{shard}")
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

/// Fills `bytes` from the system's secure random source.
fn fill_random(bytes: &mut [u8]) -> Result<(), PkiError> {
    use ring::rand::SecureRandom;
    ring::rand::SystemRandom::new()
        .fill(bytes)
        .map_err(|_| PkiError::Invalid("the system random source failed".into()))
}

/// The secret key a shard authenticates its checkpoints with (HMAC-SHA256): 32 random bytes, stored as 64 hex digits
/// and a newline in [`CHECKPOINT_KEY_FILE`] (0600) in the shard's bundle.
#[derive(Clone, PartialEq, Eq)]
pub struct CheckpointKey([u8; CHECKPOINT_KEY_BYTES]);

impl std::fmt::Debug for CheckpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.write_str("CheckpointKey(..)")
    }
}

impl CheckpointKey {
    /// A new key from the system's secure random source.
    pub fn generate() -> Result<CheckpointKey, PkiError> {
        let mut bytes = [0u8; CHECKPOINT_KEY_BYTES];
        fill_random(&mut bytes)?;
        Ok(CheckpointKey(bytes))
    }

    /// A key with these bytes (tests and in-process clusters that derive their own).
    pub fn from_bytes(bytes: [u8; CHECKPOINT_KEY_BYTES]) -> CheckpointKey {
        CheckpointKey(bytes)
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; CHECKPOINT_KEY_BYTES] {
        &self.0
    }

    /// Reads a key file: 64 hex digits, surrounding whitespace ignored. Anything else is refused.
    pub fn load(path: &Path) -> Result<CheckpointKey, PkiError> {
        let bad = |reason: String| PkiError::CheckpointKey {
            path: path.to_path_buf(),
            reason,
        };
        let mut text = String::new();
        // A key file is 65 bytes; reading a little more than that is enough to refuse anything longer.
        std::io::Read::read_to_string(
            &mut std::io::Read::take(
                std::fs::File::open(path).map_err(|e| bad(e.to_string()))?,
                256,
            ),
            &mut text,
        )
        .map_err(|e| bad(e.to_string()))?;
        let hex = text.trim();
        if hex.len() != 2 * CHECKPOINT_KEY_BYTES || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad(format!(
                "expected {} hex digits (as `tether-server keygen` writes it)",
                2 * CHECKPOINT_KEY_BYTES
            )));
        }
        let mut bytes = [0u8; CHECKPOINT_KEY_BYTES];
        for (b, pair) in bytes.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
            // Both digits were checked to be ASCII hex above.
            let digits = std::str::from_utf8(pair).map_err(|e| bad(e.to_string()))?;
            *b = u8::from_str_radix(digits, 16).map_err(|e| bad(e.to_string()))?;
        }
        Ok(CheckpointKey(bytes))
    }

    /// Writes the key to `path` (0600). Refuses to replace an existing file unless `force`: a new key makes every
    /// checkpoint written with the old one unloadable.
    pub fn save(&self, path: &Path, force: bool) -> Result<(), PkiError> {
        if !force && path.exists() {
            return Err(PkiError::CheckpointKey {
                path: path.to_path_buf(),
                reason: "already exists; replacing it makes every checkpoint written with it unloadable \
                         (add --force to do so anyway)"
                    .into(),
            });
        }
        let hex: String = self.0.iter().map(|b| format!("{b:02x}")).collect();
        write_file(path, &format!("{hex}\n"), true)
    }
}

/// Writes a new checkpoint key into the bundle folder `bundle` (as `keygen checkpoint-key` does for bundles issued
/// before keys existed); refuses to replace an existing one unless `force`. Returns the key file's path.
pub fn write_checkpoint_key(bundle: &Path, force: bool) -> Result<PathBuf, PkiError> {
    if !bundle.is_dir() {
        return Err(PkiError::Invalid(format!(
            "{} is not a bundle folder",
            bundle.display()
        )));
    }
    let path = bundle.join(CHECKPOINT_KEY_FILE);
    CheckpointKey::generate()?.save(&path, force)?;
    Ok(path)
}

/// The serial of the certificate in `pem_path` (as keygen prints it), if the file holds a readable certificate.
fn serial_of(pem_path: &Path) -> Option<String> {
    let pem = std::fs::read(pem_path).ok()?;
    let der = rustls::pki_types::CertificateDer::from_pem_slice(&pem).ok()?;
    let (_, parsed) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    Some(format_serial(parsed.raw_serial()))
}

/// `Some(serial or None)` when `out` already holds `node`'s bundle (its certificate or key exists).
fn existing_bundle(out: &Path, node: &Node) -> Option<(PathBuf, Option<String>)> {
    let dir = out.join(node.bundle_name());
    let stem = node.stem();
    let cert = dir.join(format!("{stem}.pem"));
    let key = dir.join(format!("{stem}.key"));
    (cert.exists() || key.exists()).then(|| (dir, serial_of(&cert)))
}

fn random_serial() -> Result<SerialNumber, PkiError> {
    let mut bytes = [0u8; 16];
    fill_random(&mut bytes)?;
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
            Node::Server { hosts, .. } | Node::Standby { hosts, .. } | Node::Witness { hosts } => {
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
                // Both nodes of a replicated shard also dial each other as clients (a standby its primary, a
                // restarted primary the standby that took over).
                params.extended_key_usages = vec![
                    ExtendedKeyUsagePurpose::ServerAuth,
                    ExtendedKeyUsagePurpose::ClientAuth,
                ];
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
    /// Writes the node's bundle `out/<bundle_name>/` (`ca.pem`, `<stem>.pem`, `<stem>.key` 0600; folder 0700; for a
    /// shard also a new [`CHECKPOINT_KEY_FILE`] unless one is there, which is kept) and returns its path. Overwrites
    /// an existing bundle's files: callers check first ([`issue`], [`generate`]).
    pub fn write_bundle(&self, out: &Path, ca_pem: &str) -> Result<PathBuf, PkiError> {
        let dir = out.join(self.node.bundle_name());
        // A standby holds its shard's checkpoint key: refused before anything is written when there is none.
        if let Node::Standby { shard, .. } = &self.node {
            let primary = out
                .join(format!("server-{shard}"))
                .join(CHECKPOINT_KEY_FILE);
            if !primary.exists() && !dir.join(CHECKPOINT_KEY_FILE).exists() {
                return Err(PkiError::CheckpointKey {
                    path: primary,
                    reason: "does not exist: a standby holds its shard's checkpoint key; issue the standby into \
                             the folder that holds server-K/"
                        .into(),
                });
            }
        }
        create_dir(&dir, true)?;
        let stem = self.node.stem();
        write_file(&dir.join("ca.pem"), ca_pem, false)?;
        write_file(&dir.join(format!("{stem}.pem")), &self.cert_pem, false)?;
        write_file(&dir.join(format!("{stem}.key")), &self.key_pem, true)?;
        let ckpt_key = dir.join(CHECKPOINT_KEY_FILE);
        match &self.node {
            Node::Server { .. } if !ckpt_key.exists() => {
                CheckpointKey::generate()?.save(&ckpt_key, false)?
            }
            // A standby writes and reads shard K's checkpoints: it holds the shard's own key.
            Node::Standby { shard, .. } if !ckpt_key.exists() => {
                let primary = out
                    .join(format!("server-{shard}"))
                    .join(CHECKPOINT_KEY_FILE);
                CheckpointKey::load(&primary)?.save(&ckpt_key, false)?;
            }
            _ => {}
        }
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
    /// Also write one standby bundle per shard (`standby-K`, with shard K's hosts and checkpoint key).
    pub standbys: bool,
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
        if self.standbys {
            let standbys: Vec<Node> = nodes
                .iter()
                .filter_map(|n| match n {
                    Node::Server { shard, hosts } => Some(Node::Standby {
                        shard: *shard,
                        hosts: hosts.clone(),
                    }),
                    _ => None,
                })
                .collect();
            nodes.extend(standbys);
            nodes.push(Node::Witness {
                hosts: self.hosts.clone(),
            });
        }
        nodes.extend((0..self.workers).map(|rank| Node::Worker { rank }));
        if self.shared_client {
            nodes.push(Node::SharedClient);
        }
        Ok(nodes)
    }
}

/// Creates the cluster CA in `ca_dir` and one bundle per node of `plan` under `out`. Refuses an existing CA, and an
/// `out` that already holds a bundle of one of the nodes (nothing is written then).
pub fn generate(out: &Path, ca_dir: &Path, plan: &Plan) -> Result<Vec<Issued>, PkiError> {
    let nodes = plan.nodes()?;
    if ca_dir.join("ca.key").exists() {
        return Err(PkiError::AuthorityExists(ca_dir.to_path_buf()));
    }
    if let Some((path, serial)) = nodes.iter().find_map(|n| existing_bundle(out, n)) {
        return Err(PkiError::BundleExists { path, serial });
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

/// Issues one more node from the CA in `ca_dir` (elastic scaling) and writes its bundle under `out`. Refuses
/// ([`PkiError::BundleExists`], naming the old serial) when `out` already holds that node's bundle.
pub fn issue(
    ca_dir: &Path,
    out: &Path,
    node: &Node,
    validity: &Validity,
) -> Result<Issued, PkiError> {
    if let Some((path, serial)) = existing_bundle(out, node) {
        return Err(PkiError::BundleExists { path, serial });
    }
    issue_into(ca_dir, out, node, validity)
}

/// Issues `node` a new certificate and key from the CA in `ca_dir`, replacing its bundle under `out` if there is
/// one (a shard's checkpoint key is kept). Returns the new certificate and the serial of the one it replaced (`None`
/// when there was no bundle, or its certificate could not be read): that serial belongs in `cluster.revoked`, since
/// the old certificate stays valid until it expires.
pub fn reissue(
    ca_dir: &Path,
    out: &Path,
    node: &Node,
    validity: &Validity,
) -> Result<(Issued, Option<String>), PkiError> {
    let replaced = existing_bundle(out, node).and_then(|(_, serial)| serial);
    Ok((issue_into(ca_dir, out, node, validity)?, replaced))
}

fn issue_into(
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
            standbys: true,
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
            standbys: false,
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

    #[test]
    fn checkpoint_keys_round_trip_and_malformed_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CHECKPOINT_KEY_FILE);
        let key = CheckpointKey::generate().unwrap();
        key.save(&path, false).unwrap();
        assert_eq!(CheckpointKey::load(&path).unwrap(), key);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        assert!(matches!(
            CheckpointKey::generate().unwrap().save(&path, false),
            Err(PkiError::CheckpointKey { .. })
        ));
        assert_eq!(CheckpointKey::load(&path).unwrap(), key, "not replaced");
        assert_eq!(
            format!("{key:?}"),
            "CheckpointKey(..)",
            "the secret is never printed"
        );
        for bad in ["", "abcd", &"zz".repeat(32), &"ab".repeat(33)] {
            std::fs::write(&path, bad).unwrap();
            assert!(CheckpointKey::load(&path).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn issue_refuses_an_existing_bundle_and_reissue_names_the_serial_it_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("certs");
        let issued = generate(
            &out,
            &dir.path().join("ca"),
            &Plan {
                hosts: vec![],
                servers: 1,
                workers: 1,
                shared_client: false,
                standbys: false,
                days: 1,
            },
        )
        .unwrap();
        let ca = dir.path().join("ca");
        let worker = Node::Worker { rank: 0 };
        let old = &issued.iter().find(|i| i.node == worker).unwrap().serial;
        let cert = out.join("worker-0/worker.pem");
        let before = std::fs::read(&cert).unwrap();
        match issue(&ca, &out, &worker, &Validity::days(1)) {
            Err(PkiError::BundleExists { serial, .. }) => assert_eq!(serial.as_ref(), Some(old)),
            other => panic!("expected BundleExists, got {other:?}"),
        }
        assert_eq!(std::fs::read(&cert).unwrap(), before, "bundle untouched");

        let (new, replaced) = reissue(&ca, &out, &worker, &Validity::days(1)).unwrap();
        assert_eq!(replaced.as_ref(), Some(old));
        assert_ne!(&new.serial, old);
        assert_eq!(serial_of(&cert).as_ref(), Some(&new.serial));

        // A shard's re-issued bundle keeps its checkpoint key: its checkpoints stay loadable.
        let server = Node::Server {
            shard: 0,
            hosts: vec![],
        };
        let key_path = out.join("server-0").join(CHECKPOINT_KEY_FILE);
        let key = CheckpointKey::load(&key_path).unwrap();
        assert!(issue(&ca, &out, &server, &Validity::days(1)).is_err());
        reissue(&ca, &out, &server, &Validity::days(1)).unwrap();
        assert_eq!(CheckpointKey::load(&key_path).unwrap(), key);
        // Worker bundles hold no checkpoint key.
        assert!(!out.join("worker-0").join(CHECKPOINT_KEY_FILE).exists());

        // generate into a folder that holds bundles refuses before writing a CA.
        let other_ca = dir.path().join("ca2");
        assert!(matches!(
            generate(
                &out,
                &other_ca,
                &Plan {
                    hosts: vec![],
                    servers: 1,
                    workers: 1,
                    shared_client: false,
                    standbys: false,
                    days: 1,
                },
            ),
            Err(PkiError::BundleExists { .. })
        ));
        assert!(!other_ca.join("ca.key").exists());
    }
}
