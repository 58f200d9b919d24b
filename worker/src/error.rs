//! The worker crate's error: everything that ends a worker, each cause kept as its typed source (the data loader's,
//! the model's, the configuration's, the transport's, the protocol's) so that callers can match on it and the
//! binary prints the whole chain.

use tether_common::codec::CodecError;
use tether_common::config::ConfigError;
use tether_common::net::NetError;
use tether_common::protocol::ProtocolError;

use crate::data::DataError;
use crate::model::CandleError;

/// Errors that end a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
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
}
