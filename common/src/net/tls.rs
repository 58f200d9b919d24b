//! TLS material and rustls configurations (ring provider, TLS 1.3, ALPN `tether/1`, mutual authentication): a
//! node's bundle (see [`crate::pki`]) and the files it came from, and the verifiers, which add the cluster's deny list of revoked serials to
//! webpki's chain, validity-period and usage checks on both sides.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};

use super::NetError;
use crate::protocol::ALPN;

/// The cluster CA plus one identity (certificate chain and private key), parsed from PEM files.
#[derive(Debug)]
pub struct TlsFiles {
    /// The cluster CA certificate (the only trust root).
    pub ca: CertificateDer<'static>,
    /// This endpoint's certificate chain, leaf first.
    pub cert: Vec<CertificateDer<'static>>,
    /// This endpoint's private key.
    pub key: PrivateKeyDer<'static>,
    /// Serials (big-endian, no leading zeros) whose certificates are refused at the handshake.
    pub revoked: Arc<[Vec<u8>]>,
    /// The files the identity was read from (what a user fixes when a peer refuses it).
    pub paths: TlsPaths,
}

/// Where a [`TlsFiles`] was loaded from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsPaths {
    /// The cluster CA certificate.
    pub ca: PathBuf,
    /// This endpoint's certificate chain.
    pub cert: PathBuf,
    /// This endpoint's private key.
    pub key: PathBuf,
}

impl fmt::Display for TlsPaths {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CA {}, certificate {}, key {}",
            self.ca.display(),
            self.cert.display(),
            self.key.display()
        )
    }
}

impl Clone for TlsFiles {
    fn clone(&self) -> Self {
        TlsFiles {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
            revoked: self.revoked.clone(),
            paths: self.paths.clone(),
        }
    }
}

fn bad(path: &Path, reason: impl std::fmt::Display) -> NetError {
    NetError::Certificate {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NetError> {
    let bytes = std::fs::read(path).map_err(|e| bad(path, e))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(path, format!("not a PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(bad(path, "no certificate in file"));
    }
    Ok(certs)
}

impl TlsFiles {
    /// Loads `ca.pem`, `{stem}.pem` and `{stem}.key` from the bundle folder `dir` (stem: `server`, `worker`,
    /// `client`).
    pub fn load(dir: &Path, stem: &str) -> Result<TlsFiles, NetError> {
        Self::from_paths(
            &dir.join("ca.pem"),
            &dir.join(format!("{stem}.pem")),
            &dir.join(format!("{stem}.key")),
        )
    }

    /// A shard-side bundle (stem `server`) from `dir/name/`, or from `dir` itself when only that bundle is mounted
    /// there; `missing` says what keygen would have written.
    fn load_shard_bundle(
        dir: &Path,
        name: &str,
        missing: impl FnOnce() -> String,
    ) -> Result<TlsFiles, NetError> {
        let bundle = dir.join(name);
        if bundle.is_dir() {
            Self::load(&bundle, "server")
        } else if dir.join("server.pem").exists() {
            Self::load(dir, "server")
        } else {
            Err(bad(&bundle, missing()))
        }
    }

    /// Shard `shard`'s identity from `dir` (`cluster.tls_dir`): the bundle `dir/server-K/`, or `dir` itself when
    /// only that node's bundle is mounted there. Refuses a certificate issued to another shard.
    pub fn for_server(dir: &Path, shard: u32) -> Result<TlsFiles, NetError> {
        let tls = Self::load_shard_bundle(dir, &format!("server-{shard}"), || {
            format!("no bundle for shard {shard} (keygen writes server-{shard}/)")
        })?;
        let leaf = tls.cert.first().ok_or_else(|| bad(dir, "empty chain"))?;
        let named = super::identity::server_shard(leaf)?;
        if named != shard {
            return Err(NetError::Identity(format!(
                "the certificate in {} is shard {named}'s, not shard {shard}'s",
                dir.display()
            )));
        }
        Ok(tls)
    }

    /// Shard `shard`'s standby identity from `dir` (`cluster.tls_dir`): the bundle `dir/standby-K/`, or `dir` itself
    /// when only that bundle is mounted there. Refuses any certificate but shard `shard`'s standby's.
    pub fn for_standby(dir: &Path, shard: u32) -> Result<TlsFiles, NetError> {
        let tls = Self::load_shard_bundle(dir, &format!("standby-{shard}"), || {
            format!(
                "no bundle for shard {shard}'s standby (`keygen --standbys` writes standby-{shard}/; \
                 `keygen issue --standby {shard}` adds one)"
            )
        })?;
        let leaf = tls.cert.first().ok_or_else(|| bad(dir, "empty chain"))?;
        match super::PeerIdentity::from_certificate(leaf) {
            Ok(super::PeerIdentity::Standby(k)) if k == shard => Ok(tls),
            Ok(other) => Err(NetError::Identity(format!(
                "the certificate in {} is {other}'s, not shard {shard}'s standby's",
                dir.display()
            ))),
            Err(e) => Err(e),
        }
    }

    /// The witness's identity from `dir` (`cluster.tls_dir`): the bundle `dir/witness/`, or `dir` itself when only
    /// that bundle is mounted there. Refuses any certificate but the witness's.
    pub fn for_witness(dir: &Path) -> Result<TlsFiles, NetError> {
        let tls = Self::load_shard_bundle(dir, "witness", || {
            "no bundle for the witness (`keygen --standbys` writes witness/)".to_string()
        })?;
        let leaf = tls.cert.first().ok_or_else(|| bad(dir, "empty chain"))?;
        let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref())
            .map_err(|e| NetError::Identity(format!("unparsable certificate: {e}")))?;
        let is_witness = cert
            .subject()
            .iter_common_name()
            .filter_map(|cn| cn.as_str().ok())
            .eq([crate::pki::WITNESS_CN]);
        if !is_witness {
            return Err(NetError::Identity(format!(
                "the certificate in {} is not the witness's",
                dir.display()
            )));
        }
        Ok(tls)
    }

    /// Worker `rank`'s identity from `dir` (`cluster.tls_dir`): the bundle `dir/worker-R/` or, mounted alone,
    /// `dir` itself; else the shared development bundle `dir/client/`. Refuses a certificate that may not claim
    /// `rank`.
    pub fn for_worker(dir: &Path, rank: u32) -> Result<TlsFiles, NetError> {
        let own = dir.join(crate::pki::worker_file_stem(rank));
        let tls = if own.is_dir() {
            Self::load(&own, "worker")?
        } else if dir.join("worker.pem").exists() {
            Self::load(dir, "worker")?
        } else if dir.join("client").is_dir() {
            Self::load(&dir.join("client"), "client")?
        } else if dir.join("client.pem").exists() {
            Self::load(dir, "client")?
        } else {
            return Err(bad(
                &own,
                format!("no bundle for worker {rank} (keygen writes worker-{rank}/; `keygen issue` adds one)"),
            ));
        };
        let leaf = tls.cert.first().ok_or_else(|| bad(dir, "empty chain"))?;
        let identity = super::PeerIdentity::from_certificate(leaf)?;
        if !identity.allows_rank(rank) {
            return Err(NetError::Identity(format!(
                "the certificate in {} is {identity}, which may not act as rank {rank}",
                dir.display()
            )));
        }
        Ok(tls)
    }

    /// The same identity refusing peers whose certificate serial is in `revoked` (`cluster.revoked`).
    pub fn with_revoked(mut self, revoked: &[Vec<u8>]) -> TlsFiles {
        self.revoked = revoked
            .iter()
            .map(|s| crate::pki::strip_serial(s).to_vec())
            .collect();
        self
    }

    /// Loads from explicit paths.
    pub fn from_paths(ca: &Path, cert: &Path, key: &Path) -> Result<TlsFiles, NetError> {
        let ca_cert = read_certs(ca)?.remove(0);
        let cert_chain = read_certs(cert)?;
        let key_bytes = std::fs::read(key).map_err(|e| bad(key, e))?;
        let key_der = PrivateKeyDer::from_pem_slice(&key_bytes)
            .map_err(|e| bad(key, format!("not a PEM private key: {e}")))?;
        Ok(TlsFiles {
            ca: ca_cert,
            cert: cert_chain,
            key: key_der,
            revoked: Arc::from(Vec::new()),
            paths: TlsPaths {
                ca: ca.to_path_buf(),
                cert: cert.to_path_buf(),
                key: key.to_path_buf(),
            },
        })
    }

    fn roots(&self) -> Result<Arc<rustls::RootCertStore>, NetError> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(|e| NetError::Tls(format!("CA certificate rejected: {e}")))?;
        Ok(Arc::new(roots))
    }

    /// rustls server configuration: TLS 1.3, ALPN, client certificate required and verified against the CA.
    pub fn server_config(&self) -> Result<rustls::ServerConfig, NetError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| NetError::Tls(format!("client verifier: {e}")))?;
        let verifier = Arc::new(DenyList {
            inner: verifier,
            revoked: self.revoked.clone(),
        });
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| NetError::Tls(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.cert.clone(), self.key.clone_key())
            .map_err(|e| NetError::Tls(format!("server certificate/key: {e}")))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// rustls client configuration: TLS 1.3, ALPN, the CA as the only root, presenting our certificate.
    pub fn client_config(&self) -> Result<rustls::ClientConfig, NetError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            self.roots()?,
            provider.clone(),
        )
        .build()
        .map_err(|e| NetError::Tls(format!("server verifier: {e}")))?;
        let verifier = Arc::new(DenyList {
            inner: verifier,
            revoked: self.revoked.clone(),
        });
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| NetError::Tls(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_client_auth_cert(self.cert.clone(), self.key.clone_key())
            .map_err(|e| NetError::Tls(format!("client certificate/key: {e}")))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }
}

/// A webpki verifier plus the cluster's deny list: a chain that verifies is still refused when its leaf's serial
/// is revoked. Runs inside the handshake, so a revoked peer never gets a connection.
#[derive(Debug)]
struct DenyList<V: ?Sized> {
    inner: Arc<V>,
    revoked: Arc<[Vec<u8>]>,
}

impl<V: ?Sized> DenyList<V> {
    fn check(&self, end_entity: &CertificateDer<'_>) -> Result<(), rustls::Error> {
        if self.revoked.is_empty() {
            return Ok(());
        }
        let serial = super::identity::certificate_serial(end_entity)
            .map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
        if self.revoked.contains(&serial) {
            return Err(rustls::Error::InvalidCertificate(CertificateError::Revoked));
        }
        Ok(())
    }
}

impl ClientCertVerifier for DenyList<dyn ClientCertVerifier> {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        self.check(end_entity)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

impl ServerCertVerifier for DenyList<rustls::client::WebPkiServerVerifier> {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        self.check(end_entity)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
