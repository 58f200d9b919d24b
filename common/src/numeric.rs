//! Small numeric kernels shared by workers and servers (gradient norms). Pure functions, allocation-free.

/// Σ g² in f64 over eight independent accumulators (one serial chain would bound the loop by the add latency).
/// f32 squares summed in f64 cannot overflow for any realistic length, so a non-finite result means the input holds
/// a NaN or an infinity.
pub fn sum_of_squares(g: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let chunks = g.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a += f64::from(*x) * f64::from(*x);
        }
    }
    for (a, x) in acc.iter_mut().zip(rest) {
        *a += f64::from(*x) * f64::from(*x);
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_plain_sum_and_flags_non_finite_values() {
        let g: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let plain: f64 = g.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
        assert!((sum_of_squares(&g) - plain).abs() <= 1e-9 * plain);
        let mut bad = g.clone();
        bad[1001] = f32::NAN;
        assert!(!sum_of_squares(&bad).is_finite());
        bad[1001] = f32::INFINITY;
        assert!(!sum_of_squares(&bad).is_finite());
        assert_eq!(sum_of_squares(&[]), 0.0);
    }
}
