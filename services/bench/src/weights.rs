//! Random weights for the synthetic models: every tensor of a checkpoint's layout drawn on the
//! CPU in float32, then converted to the compute dtype on the device.

use std::collections::HashMap;

use rand::Rng;
use wavefront_models::candle_core::{self as candle_core, DType, Device, Tensor};
use wavefront_models::candle_nn::VarBuilder;

/// A [`VarBuilder`] over `tensors` (name and shape, as a config's `checkpoint_tensors()` lists
/// them), each holding the values `init` gives it for its name and shape (row-major), in
/// `dtype` on `device`. `init` is called once per tensor, in the order of `tensors`.
pub fn var_builder(
    tensors: Vec<(String, Vec<usize>)>,
    device: &Device,
    dtype: DType,
    mut init: impl FnMut(&str, &[usize]) -> Vec<f32>,
) -> Result<VarBuilder<'static>, candle_core::Error> {
    let mut loaded = HashMap::new();
    for (name, shape) in tensors {
        let data = init(&name, &shape);
        let t = Tensor::from_vec(data, shape, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?;
        loaded.insert(name, t);
    }
    Ok(VarBuilder::from_tensors(loaded, dtype, device))
}

/// How one tensor of a synthetic model is filled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every value this constant.
    Const(f32),
    /// Uniform with this standard deviation.
    Uniform(f64),
}

/// [`var_builder`] from a fill rule per tensor. On the CPU the values are drawn from `rng` in
/// the order of `tensors` (reproducible); on a GPU they are drawn on the device (its own
/// generator: a model of tens of billions of parameters is never built in host memory).
pub fn var_builder_init(
    tensors: Vec<(String, Vec<usize>)>,
    device: &Device,
    dtype: DType,
    rng: &mut impl Rng,
    init: impl FnMut(&str, &[usize]) -> Init,
) -> Result<VarBuilder<'static>, candle_core::Error> {
    let loaded = tensors_init(tensors, device, dtype, rng, init)?;
    Ok(VarBuilder::from_tensors(loaded, dtype, device))
}

/// The tensors [`var_builder_init`] loads, by name, in `dtype` on `device` (each converted as
/// it is drawn, so a large model never sits on the device in float32), for a caller that edits
/// some before loading them.
pub fn tensors_init(
    tensors: Vec<(String, Vec<usize>)>,
    device: &Device,
    dtype: DType,
    rng: &mut impl Rng,
    mut init: impl FnMut(&str, &[usize]) -> Init,
) -> Result<HashMap<String, Tensor>, candle_core::Error> {
    let mut loaded = HashMap::new();
    for (name, shape) in tensors {
        let t = match init(&name, &shape) {
            Init::Const(c) => (Tensor::ones(shape.as_slice(), DType::F32, device)? * f64::from(c))?,
            Init::Uniform(std) if device.is_cpu() => {
                let n = shape.iter().product();
                Tensor::from_vec(uniform_with_std(rng, n, std), shape, device)?
            }
            Init::Uniform(std) => {
                let a = std * 3f64.sqrt();
                Tensor::rand(-a as f32, a as f32, shape.as_slice(), device)?
            }
        };
        loaded.insert(name, t.to_dtype(dtype)?);
    }
    Ok(loaded)
}

/// `n` values drawn uniformly from `[-a, a)`: standard deviation `a / sqrt(3)`.
pub fn uniform(rng: &mut impl Rng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// `n` values drawn uniformly with standard deviation `std`.
pub fn uniform_with_std(rng: &mut impl Rng, n: usize, std: f64) -> Vec<f32> {
    uniform(rng, n, (std * 3f64.sqrt()) as f32)
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;

    #[test]
    fn every_tensor_gets_its_values_in_the_dtype() -> anyhow::Result<()> {
        let tensors = vec![("a".to_owned(), vec![2, 3]), ("b.norm".to_owned(), vec![4])];
        let mut seen = Vec::new();
        let vb = var_builder(tensors, &Device::Cpu, DType::BF16, |name, shape| {
            seen.push(name.to_owned());
            let n = shape.iter().product();
            if name.ends_with("norm") {
                vec![1.0; n]
            } else {
                (0..n).map(|i| i as f32).collect()
            }
        })?;
        assert_eq!(seen, ["a", "b.norm"]);
        let a = vb.get((2, 3), "a")?;
        assert_eq!(a.dtype(), DType::BF16);
        assert_eq!(
            a.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        );
        assert_eq!(
            vb.get(4, "b.norm")?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?,
            [1.0; 4]
        );
        Ok(())
    }

    #[test]
    fn uniform_draws_stay_within_the_half_width() {
        let mut rng = StdRng::seed_from_u64(1);
        let v = uniform_with_std(&mut rng, 10_000, 0.5);
        let a = (0.5 * 3f64.sqrt()) as f32;
        assert!(v.iter().all(|x| (-a..a).contains(x)));
        let var = v.iter().map(|x| f64::from(x * x)).sum::<f64>() / v.len() as f64;
        assert!((var.sqrt() - 0.5).abs() < 0.02, "{var}");
    }
}
