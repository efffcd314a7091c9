//! Rotary position embeddings' frequencies (RoFormer, arXiv 2104.09864), and their scaling
//! for contexts longer than the one a model was pretrained on — the `rope_type`s of Hugging
//! Face's configs: `linear`, `dynamic`, `yarn` and `llama3`. Each scaling changes only the
//! frequencies each pair of features turns at (and, for YaRN, multiplies the cosines and sines
//! by one factor), so the executor, the import and the export share these functions.
//! Formulas as transformers 5.24's `modeling_rope_utils` computes them.

use serde::{Deserialize, Serialize};

/// How a block's rotary frequencies are scaled (none: θ^(−2i/d) as RoFormer).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RopeScaling {
    #[default]
    None,
    /// Position interpolation (Chen et al., arXiv 2306.15595): every frequency divided by
    /// `factor`.
    Linear { factor: f64 },
    /// Dynamic NTK scaling: for a sequence longer than `max_positions`, the base raised to
    /// θ·(factor·s/max − (factor − 1))^(d/(d − 2)); unchanged up to `max_positions`.
    Dynamic { factor: f64, max_positions: usize },
    /// YaRN (Peng et al., arXiv 2309.00071): frequencies that turn fewer than `beta_slow`
    /// times over the `original` context interpolated by `factor`, those that turn more than
    /// `beta_fast` times kept, a linear ramp between; cosines and sines times
    /// `attention_factor`.
    Yarn { factor: f64, original: usize, beta_fast: f64, beta_slow: f64, attention_factor: f64, truncate: bool },
    /// Llama 3.1's: wavelengths longer than original/low_freq_factor divided by `factor`,
    /// shorter than original/high_freq_factor kept, a smooth blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original: usize },
}

/// The kinds, in the order the spec's `rope_scaling=` names them.
pub const KINDS: [&str; 5] = ["none", "linear", "dynamic", "yarn", "llama3"];

/// YaRN's default attention factor for a scaling `factor`: 0.1·ln(factor) + 1 (1 up to 1).
pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
    if factor <= 1.0 {
        1.0
    } else {
        0.1 * mscale * factor.ln() + 1.0
    }
}

impl RopeScaling {
    /// The kind's name (`KINDS`).
    pub fn kind(&self) -> &'static str {
        match self {
            RopeScaling::None => KINDS[0],
            RopeScaling::Linear { .. } => KINDS[1],
            RopeScaling::Dynamic { .. } => KINDS[2],
            RopeScaling::Yarn { .. } => KINDS[3],
            RopeScaling::Llama3 { .. } => KINDS[4],
        }
    }

    /// What the cosines and sines are multiplied by (YaRN's attention factor; else 1).
    pub fn attention_factor(&self) -> f64 {
        match *self {
            RopeScaling::Yarn { attention_factor, .. } => attention_factor,
            RopeScaling::None
            | RopeScaling::Linear { .. }
            | RopeScaling::Dynamic { .. }
            | RopeScaling::Llama3 { .. } => 1.0,
        }
    }

    /// The inverse frequency of each of the `dim / 2` feature pairs of a rotary part of `dim`
    /// features with base `theta`, for a sequence of `seq` positions (which only dynamic
    /// scaling reads), each rounded to f32 as transformers keeps them.
    pub fn inv_freq(&self, theta: f64, dim: usize, seq: usize) -> Vec<f32> {
        let half = dim / 2;
        let d = dim as f64;
        let plain = |base: f64| -> Vec<f64> {
            (0..half).map(|i| f64::from((1.0 / base.powf((2 * i) as f64 / d)) as f32)).collect()
        };
        let freqs: Vec<f64> = match *self {
            RopeScaling::None => plain(theta),
            RopeScaling::Linear { factor } => plain(theta).into_iter().map(|f| f / factor).collect(),
            RopeScaling::Dynamic { factor, max_positions } => {
                let max = max_positions.max(1) as f64;
                let s = (seq as f64).max(max);
                plain(theta * (factor * s / max - (factor - 1.0)).powf(d / (d - 2.0)))
            }
            RopeScaling::Yarn { factor, original, beta_fast, beta_slow, truncate, .. } => {
                let correction = |rotations: f64| {
                    d * (original as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                (0..half)
                    .map(|i| {
                        let pos = f64::from(theta.powf((2 * i) as f64 / d) as f32);
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        (1.0 / (factor * pos)) * (1.0 - keep) + (1.0 / pos) * keep
                    })
                    .collect()
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original } => {
                let old = original as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                plain(theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        freqs.into_iter().map(|f| f as f32).collect()
    }

    /// What is wrong with the scaling's figures, as the argument and a fix; None when it is
    /// well formed.
    pub fn problem(&self) -> Option<String> {
        let positive = |name: &str, v: f64| (!(v > 0.0 && v.is_finite())).then(|| format!("{name} must be above 0"));
        match *self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => positive("rope_factor", factor),
            RopeScaling::Dynamic { factor, max_positions } => positive("rope_factor", factor).or_else(|| {
                (max_positions == 0)
                    .then(|| "dynamic scaling needs the pretrained context: rope_original=N".to_string())
            }),
            RopeScaling::Yarn { factor, original, beta_fast, beta_slow, attention_factor, .. } => {
                positive("rope_factor", factor)
                    .or_else(|| positive("rope_beta_fast", beta_fast))
                    .or_else(|| positive("rope_beta_slow", beta_slow))
                    .or_else(|| positive("rope_attention_factor", attention_factor))
                    .or_else(|| {
                        (original == 0).then(|| "yarn needs the pretrained context: rope_original=N".to_string())
                    })
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original } => {
                positive("rope_factor", factor)
                    .or_else(|| positive("rope_low_freq", low_freq_factor))
                    .or_else(|| {
                        (high_freq_factor <= low_freq_factor)
                            .then(|| "rope_high_freq must be above rope_low_freq".to_string())
                    })
                    .or_else(|| {
                        (original == 0).then(|| "llama3 needs the pretrained context: rope_original=N".to_string())
                    })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unscaled_frequencies_are_roformers() {
        let f = RopeScaling::None.inv_freq(10000.0, 8, 16);
        assert_eq!(f.len(), 4);
        for (i, v) in f.iter().enumerate() {
            assert!((f64::from(*v) - 10000f64.powf(-((2 * i) as f64) / 8.0)).abs() < 1e-7);
        }
    }

    #[test]
    fn llama3_keeps_the_high_frequencies_and_divides_the_low_ones() {
        // Llama 3.1: θ 500,000, 128 features, factor 8, low 1, high 4, 8,192 positions
        let s = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original: 8192 };
        let plain = RopeScaling::None.inv_freq(500_000.0, 128, 16);
        let scaled = s.inv_freq(500_000.0, 128, 16);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] / plain[63] - 0.125).abs() < 1e-6);
        // in between, the blend lies between the two
        let mid =
            (0..64).find(|&i| scaled[i] != plain[i] && (scaled[i] / plain[i] - 0.125).abs() > 1e-6).expect("a blend");
        assert!(scaled[mid] < plain[mid] && scaled[mid] > plain[mid] / 8.0);
    }

    #[test]
    fn dynamic_scaling_changes_nothing_up_to_its_context() {
        let s = RopeScaling::Dynamic { factor: 4.0, max_positions: 32 };
        assert_eq!(s.inv_freq(10000.0, 8, 32), RopeScaling::None.inv_freq(10000.0, 8, 32));
        let longer = s.inv_freq(10000.0, 8, 64);
        assert!(longer[1] < RopeScaling::None.inv_freq(10000.0, 8, 64)[1]);
    }

    #[test]
    fn yarn_interpolates_the_slow_frequencies_and_scales_the_attention() {
        let s = RopeScaling::Yarn {
            factor: 4.0,
            original: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: yarn_mscale(4.0, 1.0),
            truncate: true,
        };
        let (plain, scaled) = (RopeScaling::None.inv_freq(10000.0, 16, 8), s.inv_freq(10000.0, 16, 8));
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[7] / plain[7] - 0.25).abs() < 1e-6);
        assert!((s.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn ill_formed_scalings_are_named() {
        assert!(RopeScaling::Linear { factor: 0.0 }.problem().is_some_and(|p| p.contains("rope_factor")));
        let bad = RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 4.0, high_freq_factor: 1.0, original: 8192 };
        assert!(bad.problem().is_some_and(|p| p.contains("rope_high_freq")));
        assert_eq!(RopeScaling::Linear { factor: 2.0 }.problem(), None);
    }
}
