//! Cluster certificates for mutual TLS (`tether-server keygen`).
//!
//! One self-signed cluster CA signs a server certificate (SANs: the given hosts plus `localhost` and
//! `127.0.0.1`), a shared client certificate (CN [`CLIENT_CN`], may claim any rank) and optionally one
//! certificate per worker (CN `tether-worker-R`, bound to rank R). Keys are ECDSA P-256 generated with ring and
//! written with mode 0600.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// Common name of the shared cluster client certificate.
pub const CLIENT_CN: &str = "tether-client";

/// Common-name prefix of per-worker certificates (`tether-worker-R`).
pub const WORKER_CN_PREFIX: &str = "tether-worker-";

/// Common name of the server certificate.
pub const SERVER_CN: &str = "tether-server";

/// Common name of the cluster CA.
pub const CA_CN: &str = "tether-cluster-ca";

/// Why certificate generation failed.
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
    /// Key or certificate generation failed.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
    /// Writing a file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// File stem of worker `rank`'s certificate and key (`worker-R`).
pub fn worker_file_stem(rank: u32) -> String {
    format!("worker-{rank}")
}

/// Common name of worker `rank`'s certificate.
pub fn worker_cn(rank: u32) -> String {
    format!("{WORKER_CN_PREFIX}{rank}")
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

fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), PkiError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |source| PkiError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if private {
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(io)?;
    if private {
        // An existing file keeps its old mode through `open`; force 0600.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(io)?;
    }
    file.write_all(contents.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Generates the cluster CA and the server, shared client and (with `workers = Some(N)`) per-worker
/// certificates into `out_dir`: `ca.pem ca.key server.pem server.key client.pem client.key [worker-R.pem
/// worker-R.key]`.
pub fn generate(out_dir: &Path, hosts: &[String], workers: Option<u32>) -> Result<(), PkiError> {
    std::fs::create_dir_all(out_dir).map_err(|source| PkiError::Io {
        path: out_dir.to_path_buf(),
        source,
    })?;

    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::default();
    ca_params.distinguished_name = name(CA_CN);
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    write_file(&out_dir.join("ca.pem"), &ca_cert.pem(), false)?;
    write_file(&out_dir.join("ca.key"), &ca_key.serialize_pem(), true)?;

    let mut server_hosts: Vec<String> = Vec::new();
    for host in hosts
        .iter()
        .map(String::as_str)
        .chain(["localhost", "127.0.0.1"])
    {
        let host = host.trim();
        if !host.is_empty() && !server_hosts.iter().any(|h| h == host) {
            server_hosts.push(host.to_string());
        }
    }
    let leaf = |cn: &str,
                sans: Vec<SanType>,
                eku: ExtendedKeyUsagePurpose,
                stem: &str|
     -> Result<(), PkiError> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::default();
        params.distinguished_name = name(cn);
        params.subject_alt_names = sans;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![eku];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &ca_cert, &ca_key)?;
        write_file(&out_dir.join(format!("{stem}.pem")), &cert.pem(), false)?;
        write_file(
            &out_dir.join(format!("{stem}.key")),
            &key.serialize_pem(),
            true,
        )
    };

    let sans = server_hosts
        .iter()
        .map(|h| san(h))
        .collect::<Result<Vec<_>, _>>()?;
    leaf(
        SERVER_CN,
        sans,
        ExtendedKeyUsagePurpose::ServerAuth,
        "server",
    )?;
    leaf(
        CLIENT_CN,
        Vec::new(),
        ExtendedKeyUsagePurpose::ClientAuth,
        "client",
    )?;
    for rank in 0..workers.unwrap_or(0) {
        leaf(
            &worker_cn(rank),
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
            &worker_file_stem(rank),
        )?;
    }
    Ok(())
}
