//! QUIC endpoints for servers and clients.

use std::net::SocketAddr;
use std::sync::Arc;

use super::{NetError, TlsFiles, TransportTuning};

/// A server endpoint on `listen` requiring cluster-CA client certificates.
pub fn server_endpoint(
    listen: SocketAddr,
    tls: &TlsFiles,
    tuning: &TransportTuning,
) -> Result<quinn::Endpoint, NetError> {
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls.server_config()?)
        .map_err(|e| NetError::Tls(format!("QUIC server crypto: {e}")))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(tuning.transport_config());
    quinn::Endpoint::server(config, listen).map_err(|source| NetError::Bind {
        addr: listen,
        source,
    })
}

/// A client endpoint on an ephemeral IPv4 port presenting `tls`'s certificate.
pub fn client_endpoint(
    tls: &TlsFiles,
    tuning: &TransportTuning,
) -> Result<quinn::Endpoint, NetError> {
    client_endpoint_on(SocketAddr::from(([0, 0, 0, 0], 0)), tls, tuning)
}

/// A client endpoint bound to `bind` presenting `tls`'s certificate.
pub fn client_endpoint_on(
    bind: SocketAddr,
    tls: &TlsFiles,
    tuning: &TransportTuning,
) -> Result<quinn::Endpoint, NetError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.client_config()?)
        .map_err(|e| NetError::Tls(format!("QUIC client crypto: {e}")))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(tuning.transport_config());
    let mut endpoint =
        quinn::Endpoint::client(bind).map_err(|source| NetError::Bind { addr: bind, source })?;
    endpoint.set_default_client_config(config);
    Ok(endpoint)
}

/// Connects to `addr`, checking the server certificate against `server_name` (a SAN: host name or IP).
pub async fn connect(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
) -> Result<quinn::Connection, NetError> {
    Ok(endpoint.connect(addr, server_name)?.await?)
}
