//! Random inputs and the error measure both kernel test suites use.

#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::Rng;

/// `n` values drawn uniformly from [-2, 2).
pub fn randn(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect()
}

/// Max |a - b| over paired elements.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
