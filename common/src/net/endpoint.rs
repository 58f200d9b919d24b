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
    endpoint(listen, Some(config), tuning, Some(ServerKeys::derive(tls)))
}

/// Keys a server derives from its private key so that they survive a restart: the stateless-reset key, and the key
/// of the hashed connection-ID generator (a restarted endpoint must recognise its previous life's connection IDs as
/// its own, or it drops their packets silently instead of answering with a reset). With both, a client of a
/// restarted server learns at once that its connection is gone and reconnects, instead of waiting for the idle
/// timeout.
struct ServerKeys {
    reset: Arc<dyn quinn::crypto::HmacKey>,
    cid: u64,
}

impl ServerKeys {
    fn derive(tls: &TlsFiles) -> ServerKeys {
        let derive = |label: &[u8]| {
            let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
            ctx.update(label);
            ctx.update(tls.key.secret_der());
            ctx.finish()
        };
        let reset = derive(b"tether stateless reset v1");
        let cid = derive(b"tether connection id v1");
        let mut cid_key = [0u8; 8];
        cid_key.copy_from_slice(&cid.as_ref()[..8]);
        ServerKeys {
            reset: Arc::new(ring::hmac::Key::new(
                ring::hmac::HMAC_SHA256,
                reset.as_ref(),
            )),
            cid: u64::from_le_bytes(cid_key),
        }
    }
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

/// Connects to shard `shard` at `addr` and checks that its certificate, besides naming `server_name`, is shard
/// `shard`'s own (`tether-server-K`): a shard's key cannot pose as another shard. On a mismatch the connection is
/// closed before anything is sent on it.
pub async fn connect_shard(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    shard: u32,
) -> Result<quinn::Connection, NetError> {
    let conn = connect(endpoint, addr, server_name).await?;
    match super::identity::peer_shard(&conn) {
        Ok(named) if named == shard => Ok(conn),
        Ok(named) => {
            let why = format!("dialled shard {shard} at {addr}, which proved to be shard {named}");
            super::close_with(&conn, crate::protocol::ErrorCode::Unauthorized, &why);
            Err(NetError::Identity(why))
        }
        Err(e) => {
            super::close_with(
                &conn,
                crate::protocol::ErrorCode::Unauthorized,
                &e.to_string(),
            );
            Err(e)
        }
    }
}

/// An endpoint on `bind` whose advertised UDP payload size lets the peer's path-MTU discovery reach the tuned
/// size, with the tuned socket buffers. Must be called inside a tokio runtime.
fn endpoint(
    bind: SocketAddr,
    server: Option<quinn::ServerConfig>,
    tuning: &TransportTuning,
    keys: Option<ServerKeys>,
) -> Result<quinn::Endpoint, NetError> {
    let mut config = match keys {
        Some(k) => {
            let mut c = quinn::EndpointConfig::new(k.reset);
            let cid_key = k.cid;
            c.cid_generator(move || {
                Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key))
            });
            c
        }
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
