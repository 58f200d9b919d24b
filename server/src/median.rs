//! Medians of f32 series: [`lower_median`] of a slice, and [`RunningMedian`], the median of the last `window` values
//! pushed (a sliding window, oldest out first). The shard's gradient-norm guard and the loss-spike detector both
//! judge a new value against it. Values are ordered by [`f32::total_cmp`], so NaN and ±∞ sort deterministically
//! instead of panicking. Pure: no I/O, no clocks; the window never holds more than `window` values.

use std::collections::VecDeque;

/// The lower median of `values` (the middle one, or the lower of the two middle ones), sorting them in place;
/// `None` when empty.
pub fn lower_median(values: &mut [f32]) -> Option<f32> {
    values.sort_by(f32::total_cmp);
    values.get(values.len().checked_sub(1)? / 2).copied()
}

/// The last `window` values pushed and their median.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RunningMedian {
    window: usize,
    values: VecDeque<f32>,
    /// Scratch for sorting: keeps the median query free of allocation.
    #[serde(skip)]
    sorted: Vec<f32>,
}

impl RunningMedian {
    /// Checks a decoded window (a peer's state image): a window of at least one holding at most that many values.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.window == 0 || self.values.len() > self.window {
            return Err(format!(
                "a median window of {} holds {} values",
                self.window,
                self.values.len()
            ));
        }
        Ok(())
    }

    /// An empty window of `window` values (at least 1).
    pub fn new(window: usize) -> Self {
        let window = window.max(1);
        Self {
            window,
            values: VecDeque::with_capacity(window),
            sorted: Vec::with_capacity(window),
        }
    }

    /// Adds `value`, dropping the oldest one once the window is full.
    pub fn push(&mut self, value: f32) {
        if self.values.len() == self.window {
            self.values.pop_front();
        }
        self.values.push_back(value);
    }

    /// Values held (at most the window).
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether the window holds `window` values.
    pub fn is_full(&self) -> bool {
        self.values.len() == self.window
    }

    /// The lower median of the values held (as [`lower_median`]); `None` when empty.
    pub fn lower(&mut self) -> Option<f32> {
        let rank = self.values.len().checked_sub(1)? / 2;
        self.ranked(rank)
    }

    /// The upper median of the values held (the higher of the two middle ones for an even count); `None` when
    /// empty.
    pub fn upper(&mut self) -> Option<f32> {
        let rank = self.values.len() / 2;
        self.ranked(rank)
    }

    /// The `rank`-th smallest value held (0-based).
    fn ranked(&mut self, rank: usize) -> Option<f32> {
        self.sorted.clear();
        self.sorted.extend(self.values.iter().copied());
        self.sorted.sort_by(f32::total_cmp);
        self.sorted.get(rank).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lower_median_of_slices() {
        assert_eq!(lower_median(&mut []), None);
        assert_eq!(lower_median(&mut [5.0]), Some(5.0));
        assert_eq!(lower_median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(lower_median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.0));
        assert_eq!(lower_median(&mut [1.0, f32::INFINITY]), Some(1.0));
    }

    #[test]
    fn the_window_keeps_the_newest_values() {
        let mut m = RunningMedian::new(3);
        assert_eq!(m.len(), 0);
        assert_eq!((m.lower(), m.upper()), (None, None));
        for v in [10.0, 20.0, 30.0] {
            m.push(v);
        }
        assert!(m.is_full());
        assert_eq!((m.lower(), m.upper()), (Some(20.0), Some(20.0)));
        // 10 leaves: {20, 30, 1}.
        m.push(1.0);
        assert_eq!(m.len(), 3);
        assert_eq!(m.lower(), Some(20.0));
        // 20 leaves: {30, 1, 2}.
        m.push(2.0);
        assert_eq!(m.lower(), Some(2.0));
    }

    #[test]
    fn lower_and_upper_differ_only_for_even_counts() {
        let mut m = RunningMedian::new(4);
        for v in [4.0, 1.0, 3.0] {
            m.push(v);
        }
        assert_eq!((m.lower(), m.upper()), (Some(3.0), Some(3.0)));
        m.push(2.0);
        assert_eq!((m.lower(), m.upper()), (Some(2.0), Some(3.0)));
    }

    #[test]
    fn a_zero_window_holds_one_value() {
        let mut m = RunningMedian::new(0);
        m.push(1.0);
        m.push(7.0);
        assert_eq!(m.len(), 1);
        assert_eq!(m.upper(), Some(7.0));
    }
}
