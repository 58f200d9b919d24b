//! `ChunkPool`: the threads a shard runs its chunked kernels on (the decode and optimizer step of a push, the delta
//! cut of a pull). A kernel splits its range into chunks whose boundaries depend only on the data (a fixed number of
//! values, a whole number of codec buckets), never on the thread count; the pool runs one job per chunk and hands
//! the results back in chunk order, and every reduction combines them in that order. So the same inputs give the same
//! bits at 1 thread or 64.
//!
//! The pool is its owner's own rayon pool (`ThreadPoolBuilder`), never the global one, and building it changes no
//! process-wide state. One thread, or a single job, runs inline on the caller: no pool, no hand-off.

use std::sync::Mutex;

use rayon::prelude::*;

/// Values per chunk the shard's kernels aim for: 256 KiB of f32, so a chunk's gradient stays in a core's L2 cache
/// between its decode and its norm. A constant: chunk boundaries must never follow the thread count.
pub const CHUNK_VALUES: usize = 1 << 16;

/// Threads that run a shard's chunk jobs (1: inline on the caller).
pub struct ChunkPool {
    threads: usize,
    pool: Option<rayon::ThreadPool>,
}

impl std::fmt::Debug for ChunkPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkPool")
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl Default for ChunkPool {
    /// A pool of one thread: jobs run inline on the caller.
    fn default() -> Self {
        ChunkPool::serial()
    }
}

/// Threads for a configured count: `threads`, or every core this process may use when it is 0.
pub fn resolve_threads(threads: u32) -> usize {
    if threads > 0 {
        threads as usize
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

impl ChunkPool {
    /// Runs every job inline on the caller.
    pub fn serial() -> Self {
        ChunkPool {
            threads: 1,
            pool: None,
        }
    }

    /// A pool of `threads` threads (at least 1) named `{name}.{i}`; one thread builds no pool at all.
    pub fn new(threads: usize, name: &str) -> Result<Self, rayon::ThreadPoolBuildError> {
        let threads = threads.max(1);
        if threads == 1 {
            return Ok(ChunkPool::serial());
        }
        let name = name.to_owned();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(move |i| format!("{name}.{i}"))
            .build()?;
        Ok(ChunkPool {
            threads,
            pool: Some(pool),
        })
    }

    /// The number of threads jobs run on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f` on every job and returns the results in job order. Jobs run on the pool's threads (inline when
    /// there is one thread or one job); which thread runs which job never shows in the results.
    pub fn map<J, R, F>(&self, jobs: Vec<J>, f: F) -> Vec<R>
    where
        J: Send,
        R: Send,
        F: Fn(J) -> R + Sync + Send,
    {
        match &self.pool {
            Some(pool) if jobs.len() > 1 => {
                pool.install(|| jobs.into_par_iter().with_max_len(1).map(f).collect())
            }
            _ => jobs.into_iter().map(f).collect(),
        }
    }

    /// [`ChunkPool::map`] with per-thread scratch: `f` gets one of `scratch`'s values (those of the thread it runs
    /// on) and a job. `scratch` is grown with `make` to one value per thread. Scratch must not carry anything from
    /// one job to the next that changes a result (encoders and buffers that are overwritten before use).
    pub fn map_with<S, J, R, F>(
        &self,
        scratch: &mut Vec<Mutex<S>>,
        make: impl Fn() -> S,
        jobs: Vec<J>,
        f: F,
    ) -> Vec<R>
    where
        S: Send,
        J: Send,
        R: Send,
        F: Fn(&mut S, J) -> R + Sync + Send,
    {
        while scratch.len() < self.threads {
            scratch.push(Mutex::new(make()));
        }
        let slots: &[Mutex<S>] = scratch;
        let inline = self.pool.is_none() || jobs.len() <= 1;
        self.map(jobs, |job| {
            // Each pool thread has its own slot, so the lock is never contended; inline, the caller uses slot 0.
            let i = if inline {
                0
            } else {
                rayon::current_thread_index().unwrap_or(0) % slots.len()
            };
            // A job that panicked poisons its slot; the scratch is overwritten before use, so it is still good.
            let mut s = slots[i].lock().unwrap_or_else(|p| p.into_inner());
            f(&mut s, job)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_back_in_job_order_on_the_pools_threads() {
        let pool = ChunkPool::new(3, "tether-test").unwrap();
        assert_eq!(pool.threads(), 3);
        let out = pool.map((0..100u64).collect(), |i| {
            let name = std::thread::current().name().map(str::to_owned);
            (i * i, name)
        });
        assert_eq!(
            out.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
            (0..100u64).map(|i| i * i).collect::<Vec<_>>()
        );
        assert!(out
            .iter()
            .all(|(_, n)| n.as_deref().is_some_and(|n| n.starts_with("tether-test."))));
        // One thread, or one job, runs on the caller.
        let me = std::thread::current().id();
        assert_eq!(
            ChunkPool::serial().map(vec![0], |_| std::thread::current().id()),
            [me]
        );
        assert_eq!(pool.map(vec![0], |_| std::thread::current().id()), [me]);
        assert_eq!(ChunkPool::new(1, "x").unwrap().threads(), 1);
    }

    #[test]
    fn scratch_is_one_value_per_thread() {
        let pool = ChunkPool::new(2, "tether-test").unwrap();
        let mut scratch = Vec::new();
        let out = pool.map_with(
            &mut scratch,
            Vec::<u32>::new,
            (0..64u32).collect(),
            |s, j| {
                s.push(j);
                j + 1
            },
        );
        assert_eq!(out, (1..=64).collect::<Vec<_>>());
        assert_eq!(scratch.len(), 2);
        let mut seen: Vec<u32> = scratch
            .into_iter()
            .flat_map(|m| m.into_inner().unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..64).collect::<Vec<_>>());
    }
}
