//! The value rules a spec and a plan file share. The front end reports a broken rule as a
//! spanned diagnostic; [`crate::Plan::check`] reports it naming the plan field. One table,
//! two readers: a hand-edited plan.json gets every check its spec would have had.

use std::path::{Component, Path};

/// What a real-valued setting must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// Finite and > 0.
    Positive,
    /// Finite and ≥ 0.
    NonNegative,
    /// In [0, 1).
    Fraction,
}

impl Bound {
    pub fn admits(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Bound::Positive => v > 0.0,
                Bound::NonNegative => v >= 0.0,
                Bound::Fraction => (0.0..1.0).contains(&v),
            }
    }

    /// "must be …" in words.
    pub fn describe(self) -> &'static str {
        match self {
            Bound::Positive => "larger than 0",
            Bound::NonNegative => "0 or larger",
            Bound::Fraction => "in [0, 1)",
        }
    }
}

/// The bound of an optimizer setting (`training.optimizer.<key>`).
pub fn optimizer_bound(key: &str) -> Bound {
    match key {
        "lr" | "eps" => Bound::Positive,
        "momentum" | "beta1" | "beta2" => Bound::Fraction,
        _ => Bound::NonNegative,
    }
}

/// The least value of an integer setting of `training` (`steps`, `batch_size`,
/// `checkpoint.every`, `data.samples`; `seed` may be 0).
pub fn training_minimum(key: &str) -> u64 {
    match key {
        "seed" => 0,
        _ => 1,
    }
}

/// Why `path` may not name something under the output folder: it must be a relative path
/// that stays inside (no root, no drive, no `..`, not empty). A spec or plan from someone
/// else must never make pipec write outside the folder the user chose.
pub fn inside_output_folder(path: &str) -> Result<(), String> {
    if path.is_empty() {
        return Err("is empty".into());
    }
    for c in Path::new(path).components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err(format!("`{path}` climbs out of the output folder with `..`")),
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!("`{path}` is absolute; it must be relative to the output folder"))
            }
        }
    }
    if path.chars().any(char::is_control) {
        return Err(format!("`{}` contains a control character", path.escape_debug()));
    }
    Ok(())
}

/// The share of a device's memory a plan leaves free by default: the strategy search keeps
/// it on every device and W0602 warns past it (`strategy.search.headroom` overrides both).
/// What the plan's figures do not hold but a GPU run does: the caching allocator's reserve
/// beyond the peak allocated (Megatron-Bridge's Moonlight-16B recompute study on H100,
/// skills/nemo-mbridge-perf-activation-recompute/SKILL.md: 36.6 GB peak allocated, about
/// 40 GB reserved, 9%), and outside the allocator the CUDA context and NCCL's channel
/// buffers (several hundred MiB on an 80 GB device).
pub const DEFAULT_MEMORY_HEADROOM: f64 = 0.10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_admit_exactly_their_range() {
        assert!(Bound::Positive.admits(1e-9) && !Bound::Positive.admits(0.0) && !Bound::Positive.admits(-1.0));
        assert!(Bound::NonNegative.admits(0.0) && !Bound::NonNegative.admits(-1e-12));
        assert!(Bound::Fraction.admits(0.0) && Bound::Fraction.admits(0.999) && !Bound::Fraction.admits(1.0));
        for b in [Bound::Positive, Bound::NonNegative, Bound::Fraction] {
            assert!(!b.admits(f64::NAN) && !b.admits(f64::INFINITY), "{b:?}");
        }
    }

    #[test]
    fn output_paths_stay_inside() {
        for ok in ["checkpoints", "a/b", "./ckpt", "run-1"] {
            assert!(inside_output_folder(ok).is_ok(), "{ok}");
        }
        for bad in ["", "../escaped", "a/../../b", "/etc", "/tmp/x", "a\u{0}b"] {
            assert!(inside_output_folder(bad).is_err(), "{bad:?}");
        }
    }
}
