//! TLS material and rustls configurations (ring provider, TLS 1.3, ALPN `tether/1`, mutual authentication).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

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
}

impl Clone for TlsFiles {
    fn clone(&self) -> Self {
        TlsFiles {
            ca: self.ca.clone(),
            cert: self.cert.clone(),
            key: self.key.clone_key(),
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
    /// Loads `ca.pem`, `{stem}.pem` and `{stem}.key` from `dir` (stem: `server`, `client`, `worker-R`).
    pub fn load(dir: &Path, stem: &str) -> Result<TlsFiles, NetError> {
        Self::from_paths(
            &dir.join("ca.pem"),
            &dir.join(format!("{stem}.pem")),
            &dir.join(format!("{stem}.key")),
        )
    }

    /// Loads a worker's identity: `worker-R.pem` when keygen wrote one, else the shared `client.pem`.
    pub fn load_worker(dir: &Path, rank: u32) -> Result<TlsFiles, NetError> {
        let stem = crate::pki::worker_file_stem(rank);
        if dir.join(format!("{stem}.pem")).exists() {
            Self::load(dir, &stem)
        } else {
            Self::load(dir, "client")
        }
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
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| NetError::Tls(e.to_string()))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.cert.clone(), self.key.clone_key())
            .map_err(|e| NetError::Tls(format!("client certificate/key: {e}")))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }
}
