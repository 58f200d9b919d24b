//! What a worker is asked to do: [`WorkerOptions`] (rank, configuration, shard addresses, TLS, data, hooks) and the
//! [`Straggle`] emulation it may be told to apply. Plain values; nothing here starts or computes anything.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use tether_common::config::Config;
use tether_common::metrics::WorkerMetrics;
use tether_common::net::TlsFiles;

use super::report::Progress;
use crate::data::{Dataset, Partition, TestSet};
use crate::model::ModelFactory;
use crate::step::GradientFault;

/// Everything a worker needs to run.
#[derive(Clone)]
pub struct WorkerOptions {
    /// Rank (0-based).
    pub rank: u32,
    /// Cluster configuration.
    pub config: Config,
    /// Shard addresses (`host:port`), index = shard; resolved again at every (re)connect, so a restarted server
    /// may come back at another address under the same name.
    pub servers: Vec<String>,
    /// TLS server name per shard (a SAN of its certificate).
    pub server_names: Vec<String>,
    /// This worker's certificate and the cluster CA.
    pub tls: TlsFiles,
    /// Training set (the worker uses its partition): the whole set, or only this worker's share when `share` is set.
    pub train: Arc<Dataset>,
    /// The partition over `train` when `train` holds only this worker's share, in partition order
    /// ([`crate::data::load_configured_share`]); `None`: `train` is the whole set and the worker partitions it.
    pub share: Option<Partition>,
    /// Test set; when set, this worker evaluates every `train.eval_every` steps.
    pub test: Option<TestSet>,
    /// Progress events.
    pub progress: Option<mpsc::UnboundedSender<Progress>>,
    /// Injected gradient faults.
    pub faults: Vec<GradientFault>,
    /// Metrics to record into.
    pub metrics: Option<WorkerMetrics>,
    /// Give up when a shard stays unreachable this long.
    pub reconnect_deadline: Duration,
    /// Sleep this long after each compute (simulates a straggler).
    pub step_delay: Duration,
    /// Transient or persistent stragglers: some steps take `factor` × their compute time.
    pub straggle: Option<Straggle>,
    /// A user model to train instead of the one `[model]` describes (the shards must use its layout).
    pub model: Option<ModelFactory>,
    /// Workers sharing this host's cores, this one included: with `train.threads = 0` each computes on an equal
    /// share of them ([`crate::threads::compute_threads`]).
    pub colocated: u32,
    /// Record every settled push and used read here (JSON lines, [`crate::WorkerHistoryLine`]).
    pub history: Option<std::path::PathBuf>,
}

/// Straggler emulation: with `probability`, a round is stretched to `factor` × its compute time (the worker waits
/// the difference, keeping the protocol alive). `probability = 1` is a persistently slow worker.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Straggle {
    /// Chance that a round is slow, in [0, 1].
    pub probability: f64,
    /// How much slower a slow round is (≥ 1).
    pub factor: f64,
}

impl Straggle {
    /// Parses `P:F` (e.g. `0.1:3`, `1:2`).
    pub fn parse(s: &str) -> Option<Straggle> {
        let (p, f) = s.split_once(':')?;
        let (probability, factor) = (p.trim().parse::<f64>().ok()?, f.trim().parse::<f64>().ok()?);
        ((0.0..=1.0).contains(&probability) && factor.is_finite() && factor >= 1.0).then_some(
            Straggle {
                probability,
                factor,
            },
        )
    }

    /// The extra wait after a round of `compute` at `round` for `rank` (deterministic per rank and round).
    pub fn extra(&self, rank: u32, round: u64, compute: Duration) -> Duration {
        let z = tether_common::splitmix::splitmix64(u64::from(rank) << 40 ^ round);
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        if u < self.probability {
            compute.mul_f64(self.factor - 1.0)
        } else {
            Duration::ZERO
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Straggle;
    use std::time::Duration;

    #[test]
    fn straggle_parses_and_stretches_the_asked_share_of_rounds() {
        assert_eq!(
            Straggle::parse("0.1:3"),
            Some(Straggle {
                probability: 0.1,
                factor: 3.0
            })
        );
        for bad in ["", "0.1", "1.5:3", "0.1:0.5", "x:2", "0.1:inf", "-0.1:2"] {
            assert_eq!(Straggle::parse(bad), None, "{bad}");
        }
        let s = Straggle::parse("0.1:3").unwrap();
        let step = Duration::from_millis(10);
        let slow = (0..10_000)
            .filter(|&r| s.extra(1, r, step) == Duration::from_millis(20))
            .count();
        assert!((800..1200).contains(&slow), "{slow} of 10,000 rounds slow");
        // Deterministic per (rank, round), and different across ranks.
        assert_eq!(s.extra(1, 7, step), s.extra(1, 7, step));
        let a: Vec<_> = (0..200).map(|r| s.extra(0, r, step)).collect();
        let b: Vec<_> = (0..200).map(|r| s.extra(1, r, step)).collect();
        assert_ne!(a, b);
        let always = Straggle::parse("1:2").unwrap();
        assert!((0..100).all(|r| always.extra(0, r, step) == step));
    }
}
