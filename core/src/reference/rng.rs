//! SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and good enough for test data. The reference's
//! inputs and the benchmarks' host data both draw from it.

use super::tensor::Tensor;

/// A SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A stream starting from `state` (derive distinct states for independent streams).
    pub fn new(state: u64) -> SplitMix64 {
        SplitMix64(state)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in the open interval (0, 1), so `ln` of it never sees 0.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal by Box-Muller (one value per two uniforms keeps the stream layout simple).
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    pub(crate) fn normal_tensor(&mut self, shape: &[usize], factor: f64) -> Tensor {
        let n = shape.iter().product();
        let data = (0..n).map(|_| factor * self.normal()).collect();
        Tensor::from_vec(shape, data).expect("length matches shape by construction")
    }
}
