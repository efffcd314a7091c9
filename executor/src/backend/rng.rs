//! A small deterministic random generator (SplitMix64) for parameter initialisation, data
//! and dropout masks: the same numbers on every device, every run and every backend, so a
//! pipeline and one device start from the same weights and see the same data.

/// SplitMix64: fast, well distributed, seedable from any 64-bit key.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for a key made of several parts (seed, layer, slot, ...).
    pub fn keyed(parts: &[u64]) -> Self {
        let mut h = 0x9E37_79B9_7F4A_7C15u64;
        for p in parts {
            h ^= p.wrapping_add(0x9E37_79B9_7F4A_7C15).wrapping_add(h << 6).wrapping_add(h >> 2);
            h = Rng(h).next_u64();
        }
        Rng(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The uniform draw `i` steps on ([`Rng::uniform`]'s (i+1)-th value from here),
    /// without drawing those before it: SplitMix64's state moves by one constant a draw.
    pub fn uniform_at(&self, i: u64) -> f64 {
        Rng(self.0.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15))).uniform()
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// `n` values uniform in [-k, k].
    pub fn uniform_vec(&mut self, n: usize, k: f64) -> Vec<f32> {
        (0..n).map(|_| ((self.uniform() * 2.0 - 1.0) * k) as f32).collect()
    }

    /// `n` standard normal values.
    pub fn normal_vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32).collect()
    }

    /// Uniform integer in 0..n.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_keyed() {
        let a: Vec<u64> = (0..4).map(|_| Rng::keyed(&[1, 2]).next_u64()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        assert_ne!(Rng::keyed(&[1, 2]).next_u64(), Rng::keyed(&[2, 1]).next_u64());
        let mut r = Rng::keyed(&[7]);
        let xs = r.normal_vec(20000);
        let mean: f64 = xs.iter().map(|&x| f64::from(x)).sum::<f64>() / xs.len() as f64;
        let var: f64 = xs.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        // a draw far on equals the one reached by drawing every one before it
        let start = Rng::keyed(&[3, 4]);
        let mut walk = start.clone();
        let drawn: Vec<f64> = (0..100).map(|_| walk.uniform()).collect();
        assert!((0..100).all(|i| start.uniform_at(i) == drawn[i as usize]));
    }
}
