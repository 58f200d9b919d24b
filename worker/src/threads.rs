//! The worker's thread budget: how many threads a worker computes on ([`compute_threads`]) and its own compute
//! pool ([`ComputePool`]), a rayon pool that the model's step runs inside, so candle's matmuls and Tether's fused
//! kernels use that many threads and no more. The global rayon pool and the environment are left alone: a process
//! embedding several workers gives each its share of the cores without touching process-wide state.

use std::thread::available_parallelism;

use tether_common::config::Config;
use tether_common::cpu::thread_cpu_seconds;

use crate::error::WorkerError;

/// Compute threads for one worker: `train.threads` when set, else an equal share of this host's cores among the
/// `colocated` workers that run on it (at least 1), so that workers × threads ≤ cores.
pub fn compute_threads(cfg: &Config, colocated: u32) -> usize {
    if cfg.train.threads > 0 {
        return cfg.train.threads as usize;
    }
    let cores = available_parallelism().map_or(1, |n| n.get());
    (cores / colocated.max(1) as usize).max(1)
}

/// Workers that share this host's cores as far as `cluster.toml` tells: all of them when every shard address is on
/// loopback (the whole cluster runs on this host), else this one alone.
pub fn colocated_workers(cfg: &Config) -> u32 {
    let local = |a: &String| {
        let host = a.rsplit_once(':').map_or(a.as_str(), |(h, _)| h);
        let host = host.trim_start_matches('[').trim_end_matches(']');
        host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    };
    if cfg.cluster.servers.iter().all(local) {
        cfg.cluster.workers
    } else {
        1
    }
}

/// A worker's compute threads: a rayon pool of its own that every step, round and evaluation runs inside.
pub struct ComputePool {
    pool: rayon::ThreadPool,
    threads: usize,
}

impl ComputePool {
    /// A pool of `threads` threads named `tether-compute-{rank}.{i}`.
    pub fn new(threads: usize, rank: u32) -> Result<Self, WorkerError> {
        let threads = threads.max(1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("tether-compute-{rank}.{i}"))
            .build()
            .map_err(|e| WorkerError::Threads(e.to_string()))?;
        Ok(Self { pool, threads })
    }

    /// The number of threads.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on the pool; rayon work it starts (candle's matmuls, the fused kernels) stays on the pool.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// CPU seconds the pool's threads have used so far (0 where the platform does not say).
    pub fn cpu_seconds(&self) -> f64 {
        self.pool
            .broadcast(|_| thread_cpu_seconds().unwrap_or(0.0))
            .into_iter()
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_shares_the_cores_unless_set() {
        let mut cfg = Config::with_servers(vec!["127.0.0.1:7000".into()]);
        let cores = available_parallelism().map_or(1, |n| n.get());
        assert_eq!(compute_threads(&cfg, 1), cores);
        assert_eq!(compute_threads(&cfg, cores as u32 * 4), 1);
        assert!(compute_threads(&cfg, 2) * 2 <= cores.max(2));
        cfg.train.threads = 3;
        assert_eq!(compute_threads(&cfg, 8), 3);
    }

    #[test]
    fn a_cluster_on_loopback_shares_this_host_and_a_remote_one_does_not() {
        let mut cfg = Config::with_servers(vec!["127.0.0.1:7000".into(), "[::1]:7001".into()]);
        cfg.cluster.workers = 4;
        assert_eq!(colocated_workers(&cfg), 4);
        cfg.cluster.servers = vec!["localhost:7000".into()];
        assert_eq!(colocated_workers(&cfg), 4);
        cfg.cluster.servers = vec!["127.0.0.1:7000".into(), "10.0.0.2:7001".into()];
        assert_eq!(colocated_workers(&cfg), 1);
        cfg.cluster.servers = vec!["shard-0.tether:7000".into()];
        assert_eq!(colocated_workers(&cfg), 1);
    }

    #[test]
    fn work_runs_on_the_pool_and_its_cpu_time_is_counted() {
        let pool = ComputePool::new(2, 7).unwrap();
        assert_eq!(pool.threads(), 2);
        let before = pool.cpu_seconds();
        let (name, width) = pool.install(|| {
            // Spin until this thread has used 120 ms of CPU (not of wall time: on a loaded host a wall-clock spin
            // gets a fraction of that), for at most 20 s of wall time.
            let t0 = std::time::Instant::now();
            let cpu0 = tether_common::cpu::thread_cpu_seconds();
            let mut x = 1u64;
            while t0.elapsed().as_secs() < 20 {
                for _ in 0..10_000 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                }
                let spun = match (cpu0, tether_common::cpu::thread_cpu_seconds()) {
                    (Some(a), Some(b)) => b - a >= 0.12,
                    _ => t0.elapsed().as_millis() >= 120,
                };
                if spun {
                    break;
                }
            }
            std::hint::black_box(x);
            (
                std::thread::current().name().map(str::to_string),
                rayon::current_num_threads(),
            )
        });
        assert_eq!(
            name.as_deref().map(|n| n.starts_with("tether-compute-7.")),
            Some(true)
        );
        assert_eq!(
            width, 2,
            "rayon work inside install uses the pool's threads"
        );
        if tether_common::cpu::thread_cpu_seconds().is_some() {
            let used = pool.cpu_seconds() - before;
            assert!(
                used >= 0.11,
                "a 120 ms CPU spin on the pool counted {used} s"
            );
        }
    }
}
