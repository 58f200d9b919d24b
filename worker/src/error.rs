//! The worker crate's error: everything that ends a worker, each cause kept as its typed source (the data loader's,
//! the model's, the configuration's, the transport's, the protocol's) so that callers can match on it and the
//! binary prints the whole chain.

use tether_common::codec::CodecError;
use tether_common::config::ConfigError;
use tether_common::net::NetError;
use tether_common::protocol::{ErrorCode, ProtocolError};

use crate::data::DataError;
use crate::model::CandleError;

/// Errors that end a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The compute thread pool could not be started.
    #[error("cannot start the compute threads: {0}")]
    Threads(String),
    /// Configuration problem.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Codec setup or encode failure.
    #[error(transparent)]
    Codec(#[from] CodecError),
    /// The configured model could not be built.
    #[error("model: {0}")]
    Model(#[from] CandleError),
    /// The training data could not be loaded or partitioned.
    #[error("data: {0}")]
    Data(#[from] DataError),
    /// The data set does not fit the model.
    #[error(
        "data: dataset has {features} features / {classes} classes, model expects {model_features} / \
         {model_classes}"
    )]
    DataShape {
        /// Features per row of the data set.
        features: usize,
        /// Classes of the data set.
        classes: usize,
        /// Features the model reads.
        model_features: usize,
        /// Classes the model predicts.
        model_classes: usize,
    },
    /// The worker's QUIC endpoint could not be opened.
    #[error("client endpoint: {0}")]
    Endpoint(#[source] NetError),
    /// A shard stayed unreachable past the reconnect deadline, or refused us.
    #[error("shard {shard}: {source}")]
    Net {
        /// The shard.
        shard: usize,
        /// The cause.
        source: NetError,
    },
    /// A TLS handshake with a shard ended with an alert: retrying with the same files cannot succeed.
    #[error("shard {shard} at {server}: TLS handshake refused: {refusal}; check {check} (this worker's bundle: {paths})", check = .check.display())]
    Refused {
        /// The shard.
        shard: usize,
        /// Its address as configured.
        server: String,
        /// Who refused, and the alert.
        refusal: tether_common::net::HandshakeRefusal,
        /// The file to look at first: our CA when we refused the shard, our certificate when it refused us.
        check: std::path::PathBuf,
        /// Every file of this worker's TLS identity (boxed: errors stay small).
        paths: Box<tether_common::net::TlsPaths>,
    },
    /// A shard answered with something inconsistent with the layout.
    #[error("shard {shard}: {source}")]
    Protocol {
        /// The shard.
        shard: usize,
        /// What was wrong.
        source: ProtocolError,
    },
    /// The worker's own protocol state refused a push or skip marker.
    #[error("protocol state: {0}")]
    ProtocolState(#[source] ProtocolError),
    /// The worker actor stopped.
    #[error("worker actor is gone")]
    ActorGone,
    /// The history file could not be opened.
    #[error("cannot open the history file {path}: {source}")]
    History {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A remote worker's runtime could not be started.
    #[error("cannot start the worker's runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A call on a remote worker after `close`.
    #[error("the worker is closed")]
    Closed,
    /// A call on a remote worker whose session ended earlier with an error (reported then).
    #[error("the worker's session ended earlier: {0}")]
    Ended(String),
    /// A buffer or update of the wrong length for the layout.
    #[error("expected {expected} values (the layout's length), got {got}")]
    UpdateLength {
        /// The layout's length.
        expected: usize,
        /// The length given.
        got: usize,
    },
}

impl WorkerError {
    /// The shard and wire code when a shard refused this worker (closed the connection with an error code, or
    /// answered its bytes with one), with the shard's message; `None` for other failures.
    pub fn refusal(&self) -> Option<(usize, ErrorCode, String)> {
        match self {
            WorkerError::Net { shard, source } => {
                if let NetError::Connection(quinn::ConnectionError::ApplicationClosed(close)) =
                    source
                {
                    let code = ErrorCode::from_code(close.error_code.into_inner())?;
                    return Some((
                        *shard,
                        code,
                        String::from_utf8_lossy(&close.reason).into_owned(),
                    ));
                }
                source.code().map(|c| (*shard, c, source.to_string()))
            }
            WorkerError::Protocol { shard, source } => {
                Some((*shard, source.code(), source.to_string()))
            }
            _ => None,
        }
    }
}
