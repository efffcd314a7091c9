//! The per-layer profile format: measured forward/backward times and bytes per layer.
//! `pipec profile` writes it; `pipec compile --profile` feeds it to the cost model (see
//! docs/plan-format.md).

use serde::{Deserialize, Serialize};

/// A measured per-layer profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub version: u32,
    /// The samples each measurement covers.
    pub batch_size: usize,
    pub backend: String,
    pub layers: Vec<ProfiledLayer>,
}

/// One measured layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfiledLayer {
    pub index: usize,
    pub name: String,
    pub forward_ms: f64,
    pub backward_ms: f64,
    /// One optimizer update of the layer's parameters, with what the backend does once per
    /// weight version (independent of the batch size; 0 in profiles that predate it).
    #[serde(default)]
    pub update_ms: f64,
    /// Bytes kept for the backward, for `batch_size` samples.
    pub activation_bytes: u64,
    /// Bytes of the output, for `batch_size` samples.
    pub output_bytes: u64,
    pub parameter_bytes: u64,
}

impl Profile {
    /// Whether the profile can be used: a positive batch size, layers numbered in order,
    /// every time finite and not negative (a profile with times of −1 predicted a step of
    /// 0.0 µs).
    pub fn check(&self) -> Result<(), String> {
        if self.batch_size == 0 {
            return Err("the profile's batch_size is 0".into());
        }
        for (i, l) in self.layers.iter().enumerate() {
            if l.index != i {
                return Err(format!("the profile's layer {i} has index {}", l.index));
            }
            for (field, v) in [("forward_ms", l.forward_ms), ("backward_ms", l.backward_ms), ("update_ms", l.update_ms)]
            {
                if !v.is_finite() || v < 0.0 {
                    return Err(format!(
                        "the profile's layer {i} (`{}`) has {field} {v}: a time must be finite and not negative",
                        l.name
                    ));
                }
            }
        }
        Ok(())
    }
}
