//! Summary statistics of repeated measurements: quantiles (nearest rank), median and spread, ratios. Plain Rust.

/// The `q`-quantile (0..=1) of `xs` by nearest rank; `NaN` when empty.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v: Vec<f64> = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Median and spread (min, max) of repeated measurements.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Spread {
    /// The median.
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Spread {
    /// Of `xs` (NaN fields when empty).
    pub fn of(xs: &[f64]) -> Spread {
        let finite: Vec<f64> = xs.iter().copied().filter(|x| x.is_finite()).collect();
        Spread {
            median: quantile(&finite, 0.5),
            min: finite.iter().copied().fold(f64::NAN, f64::min),
            max: finite.iter().copied().fold(f64::NAN, f64::max),
        }
    }

    /// `median (min–max)` with `digits` decimals.
    pub fn show(&self, digits: usize) -> String {
        if self.median.is_nan() {
            return "—".into();
        }
        format!(
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = digits
        )
    }
}

/// Relative error `|sim − real| / real`.
pub fn relative_error(sim: f64, real: f64) -> f64 {
    ((sim - real) / real).abs()
}

/// The first time a `(step, seconds, value)` curve reaches `target` (values rising), if it does.
pub fn time_to(curve: &[(u64, f64, f64)], target: f64) -> Option<f64> {
    curve.iter().find(|p| p.2 >= target).map(|p| p.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let xs = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!(quantile(&xs, 0.5), 3.0);
        assert_eq!(quantile(&xs, 0.0), 1.0);
        assert_eq!(quantile(&xs, 1.0), 5.0);
        assert_eq!(quantile(&xs, 0.99), 5.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn spread_ignores_non_finite_and_time_to_finds_the_first_crossing() {
        let s = Spread::of(&[3.0, f64::NAN, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let curve = [
            (0, 0.5, 0.2),
            (10, 1.0, 0.86),
            (20, 1.5, 0.84),
            (30, 2.0, 0.9),
        ];
        assert_eq!(time_to(&curve, 0.85), Some(1.0));
        assert_eq!(time_to(&curve, 0.95), None);
        assert!((relative_error(1.1, 1.0) - 0.1).abs() < 1e-12);
    }
}
