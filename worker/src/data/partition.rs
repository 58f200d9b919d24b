//! Which training samples each worker sees, and in what order. A seeded global permutation of `0..n` is cut into
//! `workers` contiguous, balanced, disjoint slices (their union is every sample exactly once); each epoch a worker
//! visits its slice in a Fisher–Yates order drawn from a SplitMix64 stream seeded by `(seed, rank, epoch)`. Pure and
//! deterministic; the [`Batcher`] reuses its buffers and never allocates per batch.

use tether_common::splitmix::{mix64, SplitMix64};

use super::{DataError, Dataset};

/// Fisher–Yates shuffle of `items` driven by `seed`.
pub(crate) fn shuffle<T>(items: &mut [T], seed: u64) {
    let mut rng = SplitMix64::new(mix64(seed));
    for i in (1..items.len()).rev() {
        // i + 1 ≤ len fits in u64, and the draw is ≤ i.
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

/// One worker's disjoint share of the training set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    rank: u32,
    workers: u32,
    seed: u64,
    /// Global sample indices owned by this worker, in partition order.
    indices: Vec<usize>,
}

impl Partition {
    /// The share of worker `rank` of `workers` over `n_samples` samples; every worker computes the same global
    /// permutation from `seed`, so the shares are disjoint and cover every sample once. Sizes differ by at most one.
    pub fn new(
        n_samples: usize,
        rank: u32,
        workers: u32,
        seed: u64,
    ) -> Result<Partition, DataError> {
        if workers == 0 || rank >= workers {
            return Err(DataError::Partition {
                reason: format!("rank {rank} of {workers} workers"),
            });
        }
        let mut all: Vec<usize> = (0..n_samples).collect();
        shuffle(&mut all, seed);
        let w = workers as usize;
        let r = rank as usize;
        let base = n_samples / w;
        let extra = n_samples % w;
        let start = r * base + r.min(extra);
        let len = base + usize::from(r < extra);
        Ok(Partition {
            rank,
            workers,
            seed,
            indices: all[start..start + len].to_vec(),
        })
    }

    /// The share of a worker of rank `rank` in a cluster that splits the data `workers` ways (elastic membership):
    /// a configured rank (`rank < workers`) gets its own share ([`Partition::new`]); a rank beyond them reads the
    /// share of `rank mod workers`, in an order of its own (seeded by its rank), so a joiner adds samples per second
    /// without moving anyone else's share.
    pub fn elastic(
        n_samples: usize,
        rank: u32,
        workers: u32,
        seed: u64,
    ) -> Result<Partition, DataError> {
        if workers == 0 {
            return Partition::new(n_samples, rank, workers, seed);
        }
        let mut p = Partition::new(n_samples, rank % workers, workers, seed)?;
        p.rank = rank;
        Ok(p)
    }

    /// The same partition over its own share stored in partition order (sample `k` of the share is global sample
    /// `indices()[k]`): indices `0..len`, same rank, workers and seed, so every epoch visits the share's samples in
    /// the order this partition visits the whole set's (the shuffle permutes positions, whatever the values).
    pub fn local(&self) -> Partition {
        Partition {
            rank: self.rank,
            workers: self.workers,
            seed: self.seed,
            indices: (0..self.indices.len()).collect(),
        }
    }

    /// This worker's rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of workers sharing the data.
    pub fn workers(&self) -> u32 {
        self.workers
    }

    /// Number of samples in this share.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether this share is empty (more workers than samples).
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The global sample indices of this share, in partition (not epoch) order.
    pub fn indices(&self) -> &[usize] {
        &self.indices
    }

    /// The visiting order of `epoch`: this share shuffled by a stream seeded with `(seed, rank, epoch)`.
    pub fn epoch_order(&self, epoch: u64) -> Vec<usize> {
        let mut order = Vec::with_capacity(self.indices.len());
        self.epoch_order_into(epoch, &mut order);
        order
    }

    /// As [`epoch_order`](Self::epoch_order), reusing `out`'s allocation.
    pub fn epoch_order_into(&self, epoch: u64, out: &mut Vec<usize>) {
        out.clear();
        out.extend_from_slice(&self.indices);
        let seed = mix64(mix64(self.seed ^ 0x5851_F42D_4C95_7F2D) ^ u64::from(self.rank)) ^ epoch;
        shuffle(out, seed);
    }
}

/// Walks a partition epoch by epoch and copies batches into caller-provided buffers without allocating.
#[derive(Debug, Clone)]
pub struct Batcher {
    partition: Partition,
    batch: usize,
    epoch: u64,
    order: Vec<usize>,
    pos: usize,
}

impl Batcher {
    /// A batcher of `batch` samples (at least 1) over `partition`, positioned at the start of epoch 0.
    pub fn new(partition: Partition, batch: usize) -> Batcher {
        let mut b = Batcher {
            order: Vec::with_capacity(partition.len()),
            partition,
            batch: batch.max(1),
            epoch: 0,
            pos: 0,
        };
        b.start_epoch(0);
        b
    }

    /// Restarts at the beginning of `epoch` with that epoch's order (reusing the order buffer).
    pub fn start_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.pos = 0;
        self.partition.epoch_order_into(epoch, &mut self.order);
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The batch size.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Batches per epoch, the last one possibly partial.
    pub fn batches_per_epoch(&self) -> usize {
        self.order.len().div_ceil(self.batch)
    }

    /// The partition walked.
    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    /// Copies the next batch of the epoch into `x` (row-major, `features` per row) and `y`; returns the number of
    /// rows written: at most `batch` and at most what the buffers hold, fewer at the end of the epoch, 0 once the
    /// epoch is exhausted (call [`start_epoch`](Self::start_epoch) for the next).
    pub fn next_into(&mut self, data: &Dataset, x: &mut [f32], y: &mut [u32]) -> usize {
        let f = data.features;
        let room = x.len().checked_div(f).unwrap_or(usize::MAX).min(y.len());
        let rows = self.batch.min(room).min(self.order.len() - self.pos);
        for (k, &i) in self.order[self.pos..self.pos + rows].iter().enumerate() {
            x[k * f..(k + 1) * f].copy_from_slice(data.row(i));
            y[k] = data.y[i];
        }
        self.pos += rows;
        rows
    }
}
