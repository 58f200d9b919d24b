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

    /// The first round of worker `w` from `from` on that `values` (shard `k`'s) do not hold: its rounds read from the
    /// weights, and the skip markers the shard took.
    fn progress(&self, k: usize, w: usize, from: u64, values: &[f32]) -> u64 {
        let skipped = self.shards[k].skipped.get(&w);
        let mut progress = from;
        while progress < SLOTS
            && (values[slot(w, progress)] == 1.0 || skipped.is_some_and(|s| s.contains(&progress)))
        {
            progress += 1;
        }
        progress
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
        let need = bound(self.faults.staleness).map(|s| clock.saturating_sub(s));
        let mut progresses = Vec::with_capacity(live.len());
        for &(w, from) in live {
            let progress = self.progress(k, w, from, values);
            progresses.push(progress);
            if let Some(need) = need.filter(|_| self.faults.quorum == 0) {
                if progress < need {
                    return Err(format!(
                        "read guarantee broken: shard {k} answered worker {reader}'s pull at clock {clock} (s={}) \
                         but worker {w}'s rounds {progress}..{need} are missing (joined at {from})",
                        clock - need
                    ));
                }
            }
        }
        if progresses.is_empty() {
            return Ok(());
        }
        // With quorum rounds the guarantee holds for a quorum: at least `min(q, live)` workers' rounds up to
        // `clock − s` are all in the values. A round closed while more members were live stays closed when some are
        // evicted later, so every worker that ever joined counts (its rounds stay in the weights); the others are
        // late, and their rounds come in later (nothing lost is checked separately). Without a quorum this is the
        // per-member check above.
        let q = match self.faults.quorum {
            0 => progresses.len(),
            q => (q as usize).min(progresses.len()),
        };
        let mut all = progresses.clone();
        if self.faults.quorum > 0 {
            for w in (0..WORKERS).filter(|w| !live.iter().any(|(l, _)| l == w)) {
                if let Some(&from) = self.shards[k].joined_at.get(&w) {
                    all.push(self.progress(k, w, from, values));
                }
            }
            // The hostile member counts towards a quorum like any member; its rounds own no slots, so its progress is
            // the highest clock its row held (it may have said goodbye since).
            if self.faults.hostile {
                all.push(self.shards[k].hostile_high);
            }
        }
        all.sort_unstable_by(|a, b| b.cmp(a));
        let quorum_progress = all[q - 1];
        if let Some(need) = need {
            if quorum_progress < need {
                return Err(format!(
                    "quorum read guarantee broken: shard {k} answered worker {reader}'s pull at clock {clock} but only \
                     {} workers hold every round up to {need} (quorum {q} of {} live; progress {all:?})",
                    all.iter().filter(|p| **p >= need).count(),
                    progresses.len()
                ));
            }
        }
        self.max_lead = self.max_lead.max(clock.saturating_sub(quorum_progress));
        Ok(())
    }

    /// Nothing applied twice; nothing acknowledged lost except what a crash rolled back to its checkpoint. Holds
    /// after every step.
    pub fn check(&self) -> Result<(), String> {
        for (k, s) in self.shards.iter().enumerate() {
            let Some(p) = &s.proto else {
                continue;
            };
            let weights = super::effective_weights(p.core());
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
