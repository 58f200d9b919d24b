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
    endpoint(listen, Some(config), tuning, Some(reset_key(tls)))
}

/// The stateless-reset key of a server, derived from its private key: a restarted server answers packets of its
/// previous life's connections with resets the clients recognise, so they reconnect at once instead of waiting
/// for the idle timeout.
fn reset_key(tls: &TlsFiles) -> Arc<dyn quinn::crypto::HmacKey> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"tether stateless reset v1");
    ctx.update(tls.key.secret_der());
    Arc::new(ring::hmac::Key::new(
        ring::hmac::HMAC_SHA256,
        ctx.finish().as_ref(),
    ))
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
    let mut endpoint = endpoint(bind, None, tuning, None)?;
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

/// An endpoint on `bind` whose advertised UDP payload size lets the peer's path-MTU discovery reach the tuned
/// size, with the tuned socket buffers. Must be called inside a tokio runtime.
fn endpoint(
    bind: SocketAddr,
    server: Option<quinn::ServerConfig>,
    tuning: &TransportTuning,
    reset_key: Option<Arc<dyn quinn::crypto::HmacKey>>,
) -> Result<quinn::Endpoint, NetError> {
    let mut config = match reset_key {
        Some(k) => quinn::EndpointConfig::new(k),
        None => quinn::EndpointConfig::default(),
    };
    config
        .max_udp_payload_size(tuning.max_udp_payload_size.max(1200))
        .map_err(|e| NetError::Config(format!("max UDP payload size: {e}")))?;
    let bind_error = |source| NetError::Bind { addr: bind, source };
    let socket = std::net::UdpSocket::bind(bind).map_err(bind_error)?;
    if let Some(bytes) = tuning.socket_buffer_bytes {
        set_socket_buffers(&socket, bytes);
    }
    let runtime = quinn::default_runtime().ok_or_else(|| {
        bind_error(std::io::Error::other(
            "no async runtime (call inside tokio)",
        ))
    })?;
    quinn::Endpoint::new(config, server, socket, runtime).map_err(bind_error)
}

/// Asks the kernel for `bytes` of UDP send and receive buffer (capped by `net.core.{r,w}mem_max`), so bursts of
/// packets are not dropped while the receiving task waits for a CPU. Best effort: failure only costs speed.
fn set_socket_buffers(socket: &std::net::UdpSocket, bytes: usize) {
    use std::os::fd::AsRawFd;
    let value = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: the fd is a live socket owned by `socket`, and the option value points to a c_int of the
        // size passed.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            tracing::debug!(option, error = %std::io::Error::last_os_error(), "cannot size UDP socket buffer");
        }
    }
}
