//! `[cluster]`: who is in the cluster (shard addresses, worker count, TLS bundle, revoked certificates) and how it
//! synchronises (the SSP staleness bound, eviction and heartbeat periods). `servers` is the one key of `cluster.toml`
//! without a default; an empty list is refused by validation.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The staleness bound `s` of SSP: a worker may run at most `s` clocks ahead of the slowest live worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Staleness {
    /// At most this many clocks ahead (`0` is BSP).
    Bounded(u32),
    /// Fully asynchronous: pulls never wait.
    #[default]
    Unbounded,
}

impl Staleness {
    /// The bound as an option (`None` = unbounded).
    pub fn bound(self) -> Option<u32> {
        match self {
            Staleness::Bounded(s) => Some(s),
            Staleness::Unbounded => None,
        }
    }

    /// From an option (`None` = unbounded).
    pub fn from_bound(b: Option<u32>) -> Self {
        b.map_or(Staleness::Unbounded, Staleness::Bounded)
    }
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Staleness::Bounded(s) => write!(f, "{s}"),
            Staleness::Unbounded => f.write_str("inf"),
        }
    }
}

impl FromStr for Staleness {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "inf" | "async" | "unbounded" => Ok(Staleness::Unbounded),
            n => n.parse::<u32>().map(Staleness::Bounded).map_err(|_| {
                format!("staleness must be a non-negative integer or \"inf\", got {n:?}")
            }),
        }
    }
}

impl Serialize for Staleness {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Staleness::Bounded(b) => s.serialize_u32(*b),
            Staleness::Unbounded => s.serialize_str("inf"),
        }
    }
}

impl<'de> Deserialize<'de> for Staleness {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(i64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => u32::try_from(n).map(Staleness::Bounded).map_err(|_| {
                serde::de::Error::custom(format!(
                    "staleness must be 0..=4294967295 or \"inf\", got {n}"
                ))
            }),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `[cluster]`: who is in the cluster and how it synchronises.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// Shard K listens on `servers[K]` (required: the default, none, is refused by validation).
    pub servers: Vec<String>,
    /// Number of workers (default 4): the data is split into this many shares, and local-step rounds expect as many.
    pub workers: u32,
    /// Elastic membership: ranks `workers..max_workers` may join mid-run with a valid certificate (`keygen issue`);
    /// such a worker reads the share of rank `rank mod workers` in its own order (default 0: no ranks beyond
    /// `workers`; else at least `workers`, at most 4096).
    pub max_workers: u32,
    /// SSP bound (default 3; `0` = BSP, `"inf"` = async).
    pub staleness: Staleness,
    /// A worker silent this long is evicted from the clock table (default 5000).
    pub worker_timeout_ms: u64,
    /// Workers send a heartbeat this often when otherwise idle (default 500).
    pub heartbeat_ms: u64,
    /// A live worker at the minimum clock whose clock has not moved for this long while another worker's pull waits
    /// on the SSP gate is evicted like a silent one (default 120000; at least `worker_timeout_ms`): a member that
    /// heartbeats but never pushes cannot hold the gate for ever.
    pub progress_timeout_ms: u64,
    /// Quorum rounds: a round closes once this many live workers pushed it and the grace window passed, without
    /// waiting for the rest; their late pushes are applied in the next round (default 0: every live worker, plain
    /// SSP; at most `workers`).
    pub quorum: u32,
    /// The grace window after a round's quorum is reached, as a multiple of the median recent round time (default
    /// 0.5; within 5 ms and `worker_timeout_ms`; used only with `quorum` > 0).
    pub grace_factor: f32,
    /// Replicated shards: shard K's standby listens on `standbys[K]` (default none; else one address per shard, none
    /// of them a server's or another standby's). A standby follows its primary's every input over mutual-TLS QUIC and
    /// takes over, with every applied update, when the primary dies; workers then fail over to it.
    pub standbys: Vec<String>,
    /// With standbys: the witness (`tether-server witness`), the third vote that fences every replicated shard: a
    /// node serves only while two of {primary, standby, witness} granted it a lease of `failover_ms`, so at most one
    /// node of a shard serves at any time (required with standbys; default none).
    pub witness: Option<String>,
    /// With standbys: a link to a shard that stays silent this long counts as dead, for workers (which then fail over)
    /// and for the standby (which then takes over) (default 1000; 200 to `worker_timeout_ms`).
    pub failover_ms: u64,
    /// Directory of the node's TLS bundle (default "certs"): keygen's output folder holding `server-K/` and
    /// `worker-R/` bundles, or one node's own bundle mounted alone.
    pub tls_dir: PathBuf,
    /// Serials of revoked node certificates (hex, as keygen prints them and `ca/issued.txt` lists them): refused
    /// at the TLS handshake, by shards and workers alike (default none).
    pub revoked: Vec<String>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            servers: Vec::new(),
            workers: 4,
            max_workers: 0,
            staleness: Staleness::Bounded(3),
            worker_timeout_ms: 5000,
            heartbeat_ms: 500,
            progress_timeout_ms: 120_000,
            quorum: 0,
            grace_factor: 0.5,
            standbys: Vec::new(),
            witness: None,
            failover_ms: 1000,
            tls_dir: PathBuf::from("certs"),
            revoked: Vec::new(),
        }
    }
}

impl ClusterConfig {
    /// A cluster section with the given server addresses and every other key at its default.
    pub fn with_servers(servers: Vec<String>) -> Self {
        Self {
            servers,
            ..Self::default()
        }
    }

    /// The ranks that may join: `0..rank_limit()` (`max_workers`, or `workers` when it is 0).
    pub fn rank_limit(&self) -> u32 {
        self.workers.max(self.max_workers)
    }

    /// Where shard `k` may be reached: its server, then its standby when there is one (workers try them in turn).
    pub fn shard_addresses(&self, k: usize) -> Vec<String> {
        self.servers
            .get(k)
            .into_iter()
            .chain(self.standbys.get(k))
            .cloned()
            .collect()
    }

    /// Whether shards have standbys.
    pub fn replicated(&self) -> bool {
        !self.standbys.is_empty()
    }

    /// The revoked serials as bytes (validated by [`super::Config::validate`]; an unparsable entry is skipped here).
    pub fn revoked_serials(&self) -> Vec<Vec<u8>> {
        self.revoked
            .iter()
            .filter_map(|s| crate::pki::parse_serial(s))
            .collect()
    }
}
