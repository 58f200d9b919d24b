//! The checker, reading the weights themselves rather than the shards' counters: the read guarantee on every reply
//! a worker computes on, no slot above 1 (nothing applied twice), every acknowledged round still in the weights unless
//! a crash rolled it back, and at the end every surviving worker settled. [`Sim::check`] may be called after any step.

use super::{bound, slot, Sim, SLOTS, WORKERS};

impl Sim {
    /// The live members of shard `k` now, with the clock each last (re)joined at.
    pub(super) fn live_members(&self, k: usize) -> Vec<(usize, u64)> {
        let proto = self.shards[k]
            .proto
            .as_ref()
            .expect("shard is up while answering");
        (0..WORKERS)
            .filter(|w| proto.core().clocks().is_live(*w as u32))
            .map(|w| (w, self.shards[k].joined_at.get(&w).copied().unwrap_or(0)))
            .collect()
    }

    /// The read guarantee, from the values themselves: values used for a pull at `clock` hold, for every member that
    /// was live when the shard answered, every round from its (re)join up to `clock − s`.
    pub(super) fn check_read(
        &mut self,
        k: usize,
        reader: usize,
        clock: u64,
        values: &[f32],
        live: &[(usize, u64)],
    ) -> Result<(), String> {
        for (i, v) in values.iter().enumerate() {
            if *v != 0.0 && *v != 1.0 {
                return Err(format!(
                    "shard {k}: slot {i} reads {v}: an update applied twice or corrupted"
                ));
            }
        }
        let mut min_progress = u64::MAX;
        for &(w, from) in live {
            // Rounds of w present from its join on, reading the weights (and the skip markers the shard took).
            let mut progress = from;
            while progress < SLOTS
                && (values[slot(w, progress)] == 1.0
                    || self.shards[k]
                        .skipped
                        .get(&w)
                        .is_some_and(|s| s.contains(&progress)))
            {
                progress += 1;
            }
            min_progress = min_progress.min(progress);
            if let Some(s) = bound(self.faults.staleness) {
                let need = clock.saturating_sub(s);
                if progress < need {
                    return Err(format!(
                        "read guarantee broken: shard {k} answered worker {reader}'s pull at clock {clock} (s={s}) \
                         but worker {w}'s rounds {progress}..{need} are missing (joined at {from})"
                    ));
                }
            }
        }
        if min_progress != u64::MAX {
            self.max_lead = self.max_lead.max(clock.saturating_sub(min_progress));
        }
        Ok(())
    }

    /// Nothing applied twice; nothing acknowledged lost except what a crash rolled back to its checkpoint. Holds
    /// after every step.
    pub fn check(&self) -> Result<(), String> {
        for (k, s) in self.shards.iter().enumerate() {
            let Some(p) = &s.proto else {
                continue;
            };
            let weights = p.core().weights();
            for (i, v) in weights.iter().enumerate() {
                if *v != 0.0 && *v != 1.0 {
                    return Err(format!("shard {k}: slot {i} = {v} at {} ms", self.now));
                }
            }
            for &(w, c) in &s.acked {
                // A restarted worker's earlier incarnation may have taken that round with a skip marker: the round
                // counts once, whichever incarnation's frame arrived first.
                let skipped = s.skipped.get(&w).is_some_and(|r| r.contains(&c));
                if c < SLOTS
                    && weights[slot(w, c)] != 1.0
                    && !s.rolled_back.contains(&(w, c))
                    && !skipped
                {
                    return Err(format!(
                        "shard {k}: worker {w}'s round {c} was acknowledged but is not in the weights (lost update)"
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`Sim::check`], and every surviving worker finished with every push settled: the end of a schedule.
    pub fn check_end(&self) -> Result<(), String> {
        self.check()?;
        for (w, sw) in self.workers.iter().enumerate() {
            if !sw.protocol.settled() {
                return Err(format!("worker {w} finished with unsettled pushes"));
            }
        }
        Ok(())
    }
}
