//! Initial latent states of the recurrent-depth family.
//!
//! Upstream `initialize_state` draws `trunc_normal(0, σ, [-3σ, 3σ]) ·
//! sqrt(n_embd)` with `σ = init_values.std · init_scale` for every processed
//! position of every forward call. Each request owns its source, so its
//! draws never depend on other requests in the batch: a seeded RNG in
//! production, zeros for `init_scale = 0`, or rows recorded from a reference
//! run, consumed in call order (the fixtures' `<case>.init_draws`).

use std::sync::Arc;

use crate::migrate::RequestRng;
use rand::{Rng, SeedableRng};

use crate::request::ReplayDraws;
use crate::SchemeError;

/// Where a request's initial states come from.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum DrawSource {
    /// All-zero states (`init_scale = 0`).
    Zeros,
    /// Truncated normal with the given standard deviation, then scaled.
    Seeded {
        #[serde(with = "crate::migrate::rng")]
        rng: Box<RequestRng>,
        std: f64,
        scale: f64,
    },
    /// Recorded rows, in call order.
    Replay {
        draws: Arc<ReplayDraws>,
        next_row: usize,
    },
}

impl DrawSource {
    pub fn seeded(seed: u64, std: f64, scale: f64) -> Self {
        if std == 0.0 {
            return Self::Zeros;
        }
        Self::Seeded {
            rng: Box::new(RequestRng::seed_from_u64(seed)),
            std,
            scale,
        }
    }

    pub fn replay(draws: Arc<ReplayDraws>) -> Self {
        Self::Replay { draws, next_row: 0 }
    }

    /// Rows left to replay (`None`: unlimited).
    pub fn remaining(&self) -> Option<usize> {
        match self {
            Self::Replay { draws, next_row } => Some(draws.rows().saturating_sub(*next_row)),
            _ => None,
        }
    }

    /// The next `rows` draws of width `dim`, row-major. `bf16` rounds each
    /// value to bfloat16 precision (upstream draws new diffusion positions in
    /// bfloat16); replayed rows are already rounded.
    pub fn next(&mut self, rows: usize, dim: usize, bf16: bool) -> Result<Vec<f32>, SchemeError> {
        match self {
            Self::Zeros => Ok(vec![0.0; rows * dim]),
            Self::Seeded { rng, std, scale } => {
                let mut out = Vec::with_capacity(rows * dim);
                for _ in 0..rows * dim {
                    let v = (truncated_normal(rng) * *std * *scale) as f32;
                    out.push(if bf16 { round_bf16(v) } else { v });
                }
                Ok(out)
            }
            Self::Replay { draws, next_row } => {
                if draws.dim != dim {
                    return Err(SchemeError::Draws(format!(
                        "have width {} but the model needs {dim}",
                        draws.dim
                    )));
                }
                if *next_row + rows > draws.rows() {
                    return Err(SchemeError::Draws(format!(
                        "exhausted: {} rows recorded, {} needed",
                        draws.rows(),
                        *next_row + rows
                    )));
                }
                let out = draws.data[*next_row * dim..(*next_row + rows) * dim].to_vec();
                *next_row += rows;
                Ok(out)
            }
        }
    }
}

/// Standard normal truncated to [-3, 3] (rejection; accepts 99.7%).
fn truncated_normal(rng: &mut RequestRng) -> f64 {
    loop {
        // Box-Muller.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
        if z.abs() <= 3.0 {
            return z;
        }
    }
}

/// Rounds to the nearest bfloat16 (ties to even), returned as f32.
pub fn round_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    if v.is_nan() {
        return v;
    }
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7fff + lsb) & 0xffff_0000;
    f32::from_bits(rounded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_draws_are_reproducible_and_truncated() {
        let mut a = DrawSource::seeded(7, 0.1, 8.0);
        let mut b = DrawSource::seeded(7, 0.1, 8.0);
        let x = a.next(10, 16, false).unwrap();
        assert_eq!(x, b.next(10, 16, false).unwrap());
        assert!(x.iter().all(|v| v.abs() <= 3.0 * 0.1 * 8.0 + 1e-6));
        assert!(x.iter().any(|v| *v != 0.0));
    }

    #[test]
    fn replay_consumes_rows_in_order_and_reports_exhaustion() {
        let d = Arc::new(ReplayDraws {
            dim: 2,
            data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
        });
        let mut s = DrawSource::replay(d);
        assert_eq!(s.next(2, 2, false).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.next(1, 2, true).unwrap(), vec![5.0, 6.0]);
        assert!(s.next(1, 2, false).is_err());
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(round_bf16(1.0), 1.0);
        assert_eq!(round_bf16(1.0 + 1.0 / 512.0), 1.0);
        assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
    }
}
