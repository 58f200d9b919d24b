//! Streamed fragments (Streaming DiLoCo, `train.fragments`): the worker's own model θ, which inner steps move
//! without pause, and the anchor each part of it was last synchronized at. Round `c` pushes part `c mod F` of every
//! shard ([`tether_common::layout::fragment_part`]) as the pseudo-gradient `anchor − θ` over that part, and the
//! anchor moves to θ there. When the pull that followed the push arrives (one round later: it overlaps the next
//! round's inner steps), the part is merged: `θ ← global + (θ − anchor)` and `anchor ← global`, so the inner steps
//! taken since the push are kept and land in the part's next pseudo-gradient. Every inner update is thus pushed
//! exactly once. Pure: no I/O, no clock; buffers are allocated once.

use std::ops::Range;

use tether_common::layout::fragment_part;

/// θ and the anchors of one worker's streamed fragments.
#[derive(Debug, Clone)]
pub struct FragmentStream {
    shards: Vec<Range<usize>>,
    fragments: u32,
    theta: Vec<f32>,
    anchor: Vec<f32>,
}

impl FragmentStream {
    /// A stream of a model split into `shards` ranges, each in `fragments` parts; θ and anchors start empty
    /// (see [`FragmentStream::start`]).
    pub fn new(shards: Vec<Range<usize>>, fragments: u32) -> Self {
        Self {
            shards,
            fragments: fragments.max(1),
            theta: Vec::new(),
            anchor: Vec::new(),
        }
    }

    /// Number of fragments.
    pub fn fragments(&self) -> u32 {
        self.fragments
    }

    /// Whether [`FragmentStream::start`] has run.
    pub fn started(&self) -> bool {
        !self.theta.is_empty()
    }

    /// The absolute ranges (one per shard) that round `clock` synchronizes.
    pub fn parts(&self, clock: u64) -> impl Iterator<Item = Range<usize>> + '_ {
        parts(&self.shards, clock, self.fragments)
    }

    /// θ and every anchor become `global` (the first pull).
    pub fn start(&mut self, global: &[f32]) {
        self.theta.clear();
        self.theta.extend_from_slice(global);
        self.anchor.clear();
        self.anchor.extend_from_slice(global);
    }

    /// Shards that rolled back: θ and anchors over their ranges become `global` (the local trajectory there is
    /// discarded with the shards' own).
    pub fn reload(&mut self, global: &[f32], shards: &[usize]) {
        for &k in shards {
            if let Some(r) = self.shards.get(k).cloned() {
                self.theta[r.clone()].copy_from_slice(&global[r.clone()]);
                self.anchor[r.clone()].copy_from_slice(&global[r]);
            }
        }
    }

    /// Merges the part pushed in round `clock` with `global`, the pull that followed it: `θ ← global + (θ − anchor)`,
    /// `anchor ← global` over that part. If the round was not pushed (a skip), the anchor is still the one the
    /// part's local progress was measured from, and the same formula keeps all of it.
    pub fn merge(&mut self, global: &[f32], clock: u64) {
        for p in parts(&self.shards, clock, self.fragments) {
            for ((t, a), &g) in self.theta[p.clone()]
                .iter_mut()
                .zip(&mut self.anchor[p.clone()])
                .zip(&global[p])
            {
                *t = g + (*t - *a);
                *a = g;
            }
        }
    }

    /// Writes round `clock`'s pseudo-gradient `anchor − θ` over its parts into `grad` (other entries untouched) and
    /// returns whether it is finite. Then [`FragmentStream::pushed`] or [`FragmentStream::discard`].
    pub fn pseudo_gradient(&self, clock: u64, grad: &mut [f32]) -> bool {
        let mut finite = true;
        for p in self.parts(clock) {
            for ((g, &a), &t) in grad[p.clone()]
                .iter_mut()
                .zip(&self.anchor[p.clone()])
                .zip(&self.theta[p])
            {
                *g = a - t;
                finite &= g.is_finite();
            }
        }
        finite
    }

    /// Round `clock`'s pseudo-gradient was encoded: the anchor of its parts moves to θ.
    pub fn pushed(&mut self, clock: u64) {
        for p in parts(&self.shards, clock, self.fragments) {
            self.anchor[p.clone()].copy_from_slice(&self.theta[p]);
        }
    }

    /// θ went non-finite: it goes back to the anchors (finite: they come from pulls and earlier θ).
    pub fn discard(&mut self) {
        self.theta.copy_from_slice(&self.anchor);
    }

    /// The worker's own model, which inner steps move.
    pub fn theta_mut(&mut self) -> &mut [f32] {
        &mut self.theta
    }

    /// The worker's own model.
    pub fn theta(&self) -> &[f32] {
        &self.theta
    }
}

/// The absolute range of each shard's part that round `clock` synchronizes.
fn parts(
    shards: &[Range<usize>],
    clock: u64,
    fragments: u32,
) -> impl Iterator<Item = Range<usize>> + '_ {
    shards.iter().map(move |r| {
        let p = fragment_part(r.len(), clock, fragments);
        r.start + p.start..r.start + p.end
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inner steps, pushes and delayed merges over many rounds: the server's model (a plain sum of what was pushed,
    /// as a lr-1 SGD outer step with one worker) plus what is still unpushed always equals the model the inner steps
    /// alone would have produced. No inner update is lost or pushed twice.
    #[test]
    fn every_inner_update_is_pushed_exactly_once() {
        let shards = vec![0..10, 10..23];
        let mut s = FragmentStream::new(shards, 3);
        let init: Vec<f32> = (0..23).map(|i| i as f32 * 0.1).collect();
        let mut server = init.clone();
        let mut local_only = init.clone();
        s.start(&server);
        let mut grad = vec![0.0f32; 23];
        let mut pending: Option<u64> = None;
        for clock in 0..40u64 {
            // Inner steps of this round (the pull of the previous round is in flight meanwhile).
            for (i, (t, l)) in s.theta_mut().iter_mut().zip(&mut local_only).enumerate() {
                let d = ((clock as usize * 7 + i) % 5) as f32 * 0.01 - 0.02;
                *t += d;
                *l += d;
            }
            if let Some(c) = pending.take() {
                let pulled = server.clone();
                s.merge(&pulled, c);
            }
            assert!(s.pseudo_gradient(clock, &mut grad));
            for p in s.parts(clock).collect::<Vec<_>>() {
                for i in p {
                    server[i] -= grad[i];
                }
            }
            s.pushed(clock);
            pending = Some(clock);
        }
        // What is still unpushed: θ − anchor everywhere; the merge of the last push is still pending, so its part's
        // anchor equals the pushed θ and the server holds it.
        for i in 0..23 {
            let unpushed = s.theta[i] - s.anchor[i];
            let lhs = server[i] + unpushed;
            assert!(
                (lhs - local_only[i]).abs() < 1e-4,
                "index {i}: server {} + unpushed {unpushed} != {}",
                server[i],
                local_only[i]
            );
        }
    }

    #[test]
    fn a_round_touches_one_part_of_every_shard_and_parts_cover_each_shard_once() {
        let s = FragmentStream::new(vec![0..10, 10..23], 4);
        let mut seen = [0u32; 23];
        for clock in 0..4 {
            let parts: Vec<_> = s.parts(clock).collect();
            assert_eq!(parts.len(), 2);
            assert!(parts[0].end <= 10 && parts[1].start >= 10);
            for p in parts {
                for i in p {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert_eq!(
            s.parts(5).collect::<Vec<_>>(),
            s.parts(1).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_skipped_round_keeps_its_local_progress_for_the_next_push() {
        let mut s = FragmentStream::new(std::iter::once(0..4).collect(), 2);
        s.start(&[1.0; 4]);
        s.theta_mut().iter_mut().for_each(|t| *t -= 0.5);
        // Round 0 is skipped (not pushed); the pull after it brings another worker's update of part 0.
        s.merge(&[0.75, 0.75, 1.0, 1.0], 0);
        assert_eq!(s.theta(), &[0.25, 0.25, 0.5, 0.5]);
        let mut g = vec![0.0; 4];
        assert!(s.pseudo_gradient(0, &mut g));
        assert_eq!(&g[..2], &[0.5, 0.5]);
    }

    #[test]
    fn reload_resets_the_rolled_back_shard_only() {
        let mut s = FragmentStream::new(vec![0..2, 2..4], 2);
        s.start(&[0.0; 4]);
        s.theta_mut().iter_mut().for_each(|t| *t = 9.0);
        s.reload(&[1.0, 2.0, 3.0, 4.0], &[1, 7]);
        assert_eq!(s.theta(), &[9.0, 9.0, 3.0, 4.0]);
        let mut g = vec![0.0; 4];
        s.pseudo_gradient(1, &mut g);
        assert_eq!(g[3], 0.0);
    }
}
