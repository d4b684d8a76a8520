//! Small statistics: percentiles, mean and spread, and least-squares fits.

/// The `q`-quantile (0 ≤ q ≤ 1) of `values` by the nearest-rank method on a sorted copy;
/// `NaN` when empty.
pub fn quantile<T: Copy + Into<f64>>(values: &[T], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v: Vec<f64> = values.iter().map(|&x| x.into()).collect();
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * v.len() as f64).ceil() as usize;
    v.get(rank.saturating_sub(1)).copied().unwrap_or(f64::NAN)
}

/// Mean of `values` (`NaN` when empty).
pub fn mean<T: Copy + Into<f64>>(values: &[T]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.iter().map(|&x| x.into()).sum::<f64>() / values.len() as f64
}

/// Sample standard deviation (`0` for fewer than two values).
pub fn sd<T: Copy + Into<f64>>(values: &[T]) -> f64 {
    if values.len() < 2 {
        return 0.0;
    }
    let m = mean(values);
    let ss: f64 = values.iter().map(|&x| (x.into() - m).powi(2)).sum();
    (ss / (values.len() - 1) as f64).sqrt()
}

/// Least-squares line `y = a + b·x`: returns `(a, b)`, or `None` with fewer than two distinct x.
pub fn linear_fit(xs: &[f64], ys: &[f64]) -> Option<(f64, f64)> {
    let n = xs.len().min(ys.len());
    if n < 2 {
        return None;
    }
    let mx = xs.iter().take(n).sum::<f64>() / n as f64;
    let my = ys.iter().take(n).sum::<f64>() / n as f64;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, y) in xs.iter().zip(ys) {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
    }
    if sxx <= 0.0 {
        return None;
    }
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v = [5u32, 1, 4, 2, 3];
        assert_eq!(quantile(&v, 0.5), 3.0);
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 5.0);
        assert_eq!(quantile(&v, 0.99), 5.0);
        assert!(quantile::<u32>(&[], 0.5).is_nan());
    }

    #[test]
    fn mean_sd_and_fit() {
        assert_eq!(mean(&[1.0f64, 2.0, 3.0]), 2.0);
        assert!((sd(&[1.0f64, 2.0, 3.0]) - 1.0).abs() < 1e-12);
        let xs = [1.0, 2.0, 3.0, 4.0];
        let ys = [3.0, 5.0, 7.0, 9.0];
        let (a, b) = linear_fit(&xs, &ys).unwrap();
        assert!((a - 1.0).abs() < 1e-12 && (b - 2.0).abs() < 1e-12);
        assert!(linear_fit(&[1.0, 1.0], &[2.0, 3.0]).is_none());
    }
}
