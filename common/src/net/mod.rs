//! The authenticated QUIC transport: a thin shell over [`crate::protocol`] using quinn 0.11 and rustls 0.23
//! (ring provider only, passed explicitly; never a process-default provider).
//!
//! Invariants: TLS 1.3 only, ALPN `tether/1`; servers require a client certificate signed by the cluster CA, so
//! a peer without one never gets a connection and no frame of theirs is read; a protocol violation closes only
//! that connection, with the violation's [`ErrorCode`] as the QUIC application close code.

mod endpoint;
mod handshake;
mod identity;
mod refusal;
mod streams;
mod tls;
mod tuning;

pub use endpoint::{client_endpoint, client_endpoint_on, connect, connect_shard, server_endpoint};
pub use handshake::{client_handshake, server_accept_hello};
pub use identity::{
    certificate_serial, peer_identity, peer_is_witness, peer_shard, server_shard, PeerIdentity,
};
pub use refusal::{HandshakeRefusal, RefusedBy};
pub use streams::{
    close_with, recv_bulk, recv_bulk_any, reject, send_bulk, send_bulk_chunks, BulkFrame,
    ControlChannel, ControlReceiver, ControlSender,
};
pub use tls::{TlsFiles, TlsPaths};
pub use tuning::TransportTuning;

use std::path::PathBuf;

use crate::protocol::{ErrorCode, ProtocolError, ReadFrameError};

/// Everything that can go wrong in the transport.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// A TLS file is missing or does not hold what it should.
    #[error("certificate file {path}: {reason}")]
    Certificate {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The TLS or QUIC configuration could not be built from valid files.
    #[error("TLS configuration: {0}")]
    Tls(String),
    /// A transport setting is out of range.
    #[error("transport configuration: {0}")]
    Config(String),
    /// The UDP socket could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// The cause.
        source: std::io::Error,
    },
    /// A connection could not be started (bad server name, endpoint closing).
    #[error("cannot connect: {0}")]
    Connect(#[from] quinn::ConnectError),
    /// The connection failed or was closed (by us or the peer); a TLS alert becomes [`NetError::Refused`].
    #[error("connection lost: {0}")]
    Connection(quinn::ConnectionError),
    /// The TLS handshake ended with an alert: retrying with the same certificate, key and CA cannot succeed.
    #[error("TLS handshake refused: {0}")]
    Refused(HandshakeRefusal),
    /// Writing to a stream failed.
    #[error("stream write failed: {0}")]
    Write(#[from] quinn::WriteError),
    /// Reading from a stream failed below the protocol (reset, connection lost).
    #[error("stream read failed: {0}")]
    Read(std::io::Error),
    /// A stream was already closed.
    #[error("stream closed: {0}")]
    ClosedStream(#[from] quinn::ClosedStream),
    /// The peer closed the control stream.
    #[error("peer closed the control stream")]
    ControlClosed,
    /// The peer's bytes or message order violate the protocol.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// A server address did not resolve.
    #[error("cannot resolve {0}")]
    Resolve(String),
    /// A server stayed unreachable past the reconnect deadline (every attempt failed transiently).
    #[error("{server} unreachable for {waited:?} (last attempt: {last})")]
    Unreachable {
        /// The address as configured.
        server: String,
        /// How long the client kept trying.
        waited: std::time::Duration,
        /// Why the last attempt failed.
        last: String,
    },
    /// The peer's certificate is missing or names no Tether identity.
    #[error("peer identity: {0}")]
    Identity(String),
}

impl NetError {
    /// Whether retrying cannot help until a file or a configuration changes: a TLS refusal, a certificate naming
    /// the wrong node, a protocol violation or refusal (e.g. another protocol version), a peer that closed the
    /// connection with an error code other than `Overloaded`, or a QUIC version mismatch. Everything else
    /// (unreachable, timed out, reset, not resolved yet, a shard whose connection budget is full, a connection the
    /// peer dropped without a code) is transient.
    pub fn is_permanent(&self) -> bool {
        if self.is_not_primary() || self.is_unseeded() {
            return false;
        }
        // Code 0 is no refusal: quinn closes with it when the peer drops a connection (a node that lost its lease
        // ends its sessions), and a shard ends a session in order with it. Found at 32 workers x 4 shards: a standby
        // whose primary stepped down mid-hello took the close for a refusal and exited.
        matches!(
            self,
            NetError::Refused(_)
                | NetError::Identity(_)
                | NetError::Protocol(_)
                | NetError::Connection(quinn::ConnectionError::VersionMismatch)
        ) || self
            .remote_close_code()
            .is_some_and(|code| code != 0 && code != u64::from(ErrorCode::Overloaded.code()))
    }

    /// Whether the peer is a standby still following its primary ([`ErrorCode::NotPrimary`]): the shard's other
    /// address serves.
    pub fn is_not_primary(&self) -> bool {
        let not_primary = u64::from(ErrorCode::NotPrimary.code());
        match self {
            NetError::Protocol(p) => p.code() == ErrorCode::NotPrimary,
            _ => self.remote_close_code() == Some(not_primary),
        }
    }

    /// Whether the peer is a node of a replicated shard that holds no state yet ([`ErrorCode::Unseeded`]).
    pub fn is_unseeded(&self) -> bool {
        match self {
            NetError::Protocol(p) => p.code() == ErrorCode::Unseeded,
            _ => self.remote_close_code() == Some(u64::from(ErrorCode::Unseeded.code())),
        }
    }

    /// The error code to close the connection with, when this error is the peer's fault.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            NetError::Protocol(e) => Some(e.code()),
            NetError::Identity(_) => Some(ErrorCode::Unauthorized),
            _ => None,
        }
    }

    /// The application close code the peer closed the connection with, if it did.
    pub fn remote_close_code(&self) -> Option<u64> {
        match self {
            NetError::Connection(quinn::ConnectionError::ApplicationClosed(close)) => {
                Some(close.error_code.into_inner())
            }
            _ => None,
        }
    }
}

impl From<quinn::ConnectionError> for NetError {
    fn from(e: quinn::ConnectionError) -> NetError {
        match HandshakeRefusal::classify(&e) {
            Some(refusal) => NetError::Refused(refusal),
            None => NetError::Connection(e),
        }
    }
}

impl From<ReadFrameError> for NetError {
    fn from(e: ReadFrameError) -> NetError {
        match e {
            ReadFrameError::Protocol(p) => NetError::Protocol(p),
            ReadFrameError::Io(io) => NetError::Read(io),
        }
    }
}
