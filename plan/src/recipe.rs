//! The training recipe beside the optimizer: the learning rate over the steps, clipping
//! of the gradient's global norm, and the order samples are drawn in. A spec and a plan
//! share these types (`training.lr_schedule`, `training.clip_grad_norm`,
//! `training.shuffle`); each is a function of the step alone, so a resumed run continues
//! it exactly.

use serde::{Deserialize, Serialize};

pub use crate::vocab::{Decay, RunningStats};

/// What the training loop does beside the optimizer's update rule.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Recipe {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<LrSchedule>,
    /// Scale every gradient by min(1, max / (‖g‖ + 1e-6)) before the update, ‖g‖ the norm of
    /// the whole model's gradient (PyTorch's `clip_grad_norm_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip_grad_norm: Option<f64>,
    /// Draw a finite data set's samples in a new order every epoch (from the seed and the
    /// epoch), rather than in file order.
    #[serde(default, skip_serializing_if = "is_false")]
    pub shuffle: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<Validation>,
    /// When batch normalisation's running statistics move.
    #[serde(default, skip_serializing_if = "is_per_update")]
    pub running_stats: RunningStats,
}

fn is_per_update(r: &RunningStats) -> bool {
    *r == RunningStats::PerUpdate
}

/// Evaluation on held-out data: the last `split` of a finite data set is never trained on;
/// every `every` steps (and after the last) the model's loss (and accuracy, or a language
/// model's perplexity) over its whole batches is measured, forward passes only, dropout
/// off and batch normalisation on its running statistics.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Validation {
    pub every: usize,
    pub split: f64,
}

impl Validation {
    /// The samples held out of `samples`, and the batches of `batch` they make.
    pub fn held_out(&self, samples: usize, batch: usize) -> (usize, usize) {
        let held = ((samples as f64) * self.split).floor() as usize;
        (held, held / batch.max(1))
    }
}

fn is_false(b: &bool) -> bool {
    !b
}

impl Recipe {
    pub fn is_default(&self) -> bool {
        *self == Recipe::default()
    }

    /// Whether updates clip by the whole model's gradient norm, summed over every device in
    /// the plan (`grad_norm`): when clipping, under a schedule that updates every stage once
    /// per step (`per_step`). An asynchronous schedule updates each stage on its own clock,
    /// so there each update clips by its own stage's gradient norm.
    pub fn clips_globally(&self, per_step: bool) -> bool {
        self.clip_grad_norm.is_some() && per_step
    }

    /// Whether every update needs the whole model's gradient norm: to clip by it, or under
    /// fp16 to find an overflow anywhere (dynamic loss scaling skips the step on every device
    /// when any gradient is not finite, as PyTorch's `GradScaler` does) — under a schedule
    /// that updates every stage once per step (`per_step`).
    pub fn needs_global_norm(&self, precision: crate::Precision, per_step: bool) -> bool {
        (self.clip_grad_norm.is_some() || precision == crate::Precision::Fp16) && per_step
    }

    /// Whether the plan sums the global norm with a `grad_norm` all-reduce: when its
    /// updates need it ([`Recipe::needs_global_norm`]) on more than one device (`devices`
    /// with a stream); one device takes the norm of its own stages.
    pub fn sums_norm(&self, precision: crate::Precision, per_step: bool, devices: usize) -> bool {
        self.needs_global_norm(precision, per_step) && devices > 1
    }

    /// What is wrong with it, by the `training` key at fault, for an optimizer's peak `lr`
    /// and data of `finite` size (a finite data set can be shuffled, an endless one not): the
    /// rules a spec's front end and a plan file's check share.
    pub fn problems(&self, lr: f64, finite: bool) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if let Some(p) = self.lr_schedule.and_then(|s| s.problem(lr)) {
            out.push(("lr_schedule", p));
        }
        if let Some(c) = self.clip_grad_norm.filter(|c| !c.is_finite() || *c <= 0.0) {
            out.push(("clip_grad_norm", format!("clip_grad_norm must be larger than 0, found {c}")));
        }
        if self.shuffle && !finite {
            out.push((
                "shuffle",
                "shuffle needs a data set of a finite size: synthetic data without `samples` is a fresh batch every step".into(),
            ));
        }
        if let Some(v) = self.validation {
            if !(v.split > 0.0 && v.split < 1.0) {
                out.push((
                    "validation",
                    format!("validation.split is the share held out, in (0, 1); found {}", v.split),
                ));
            } else if v.every == 0 {
                out.push(("validation", "validation.every must be at least 1".into()));
            } else if !finite {
                out.push((
                    "validation",
                    "validation holds out part of a data set of a finite size: synthetic data without `samples` has none".into(),
                ));
            }
        }
        out
    }

    /// What is wrong with holding out validation data from `samples` samples in batches of
    /// `batch` (None: nothing, or no validation): at least one whole batch must be held out,
    /// and at least one whole batch left to train on.
    pub fn held_out_problem(&self, samples: usize, batch: usize) -> Option<String> {
        let v = self.validation?;
        let (held, batches) = v.held_out(samples, batch);
        if batches == 0 {
            return Some(format!(
                "validation.split {} of {samples} samples holds out {held}, less than one batch of {batch}",
                v.split
            ));
        }
        let left = samples.saturating_sub(held);
        (left < batch).then(|| {
            format!(
                "validation.split {} leaves {left} of the {samples} samples to train on, less than one batch of {batch}",
                v.split
            )
        })
    }
}

/// The learning rate over the steps: a linear warm-up from 0 to the optimizer's `lr`, then
/// a decay to `min_lr` at step `decay_steps`, held there after. The rule of Hugging Face's
/// `get_{linear,cosine}_schedule_with_warmup` (with a floor): step t < warmup uses
/// lr·t/warmup; after it, with p = (t − warmup)/(decay_steps − warmup) clamped to [0, 1],
/// linear gives min + (lr − min)(1 − p) and cosine min + (lr − min)(1 + cos πp)/2.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub warmup: usize,
    pub decay: Decay,
    /// The step the decay reaches `min_lr` (a spec's default: its `steps`).
    pub decay_steps: usize,
    pub min_lr: f64,
}

impl LrSchedule {
    /// The learning rate of step `step` (counted from 0) for a peak of `lr`.
    pub fn lr(&self, lr: f64, step: usize) -> f64 {
        if step < self.warmup {
            return lr * step as f64 / self.warmup as f64;
        }
        let span = self.decay_steps.saturating_sub(self.warmup);
        let p = if span == 0 { 1.0 } else { ((step - self.warmup) as f64 / span as f64).min(1.0) };
        match self.decay {
            Decay::Constant => lr,
            Decay::Linear => self.min_lr + (lr - self.min_lr) * (1.0 - p),
            Decay::Cosine => self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos()),
        }
    }

    /// What is wrong with it for a peak of `lr`, in words (None: nothing).
    pub fn problem(&self, lr: f64) -> Option<String> {
        if !self.min_lr.is_finite() || self.min_lr < 0.0 {
            return Some(format!("min_lr must be 0 or larger, found {}", self.min_lr));
        }
        if self.min_lr > lr {
            return Some(format!(
                "min_lr ({}) is above the optimizer's lr ({lr}): the schedule would rise",
                self.min_lr
            ));
        }
        if self.decay != Decay::Constant && self.decay_steps <= self.warmup {
            return Some(format!(
                "decay_steps ({}) must be past the warm-up ({} steps) for a decay to happen",
                self.decay_steps, self.warmup
            ));
        }
        None
    }
}

/// The factor PyTorch's `clip_grad_norm_` scales gradients by: min(1, max / (norm + 1e-6)).
pub fn clip_factor(max_norm: f64, norm: f64) -> f64 {
    (max_norm / (norm + 1e-6)).min(1.0)
}

/// fp16's dynamic loss scale (PyTorch's `torch.amp.GradScaler`, with its defaults): the loss
/// is multiplied by `scale` before the backward so that small gradients survive fp16, and
/// the gradients are divided by it before the update. A step whose gradients are not all
/// finite is skipped on every device and halves the scale; `GROWTH_INTERVAL` finite steps
/// in a row double it. A checkpoint keeps it, so a resumed run scales as the uninterrupted
/// one would.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScale {
    pub scale: f64,
    /// Finite steps since the scale last changed.
    pub good_steps: u32,
}

impl LossScale {
    /// `GradScaler`'s `init_scale`, `growth_factor`, `backoff_factor` and `growth_interval`.
    pub const INITIAL: f64 = 65536.0;
    pub const GROWTH: f64 = 2.0;
    pub const BACKOFF: f64 = 0.5;
    pub const GROWTH_INTERVAL: u32 = 2000;

    pub fn initial() -> Self {
        LossScale { scale: Self::INITIAL, good_steps: 0 }
    }

    /// The scale after a step whose gradients were all finite (`finite`) or not.
    pub fn next(self, finite: bool) -> Self {
        if !finite {
            return LossScale { scale: self.scale * Self::BACKOFF, good_steps: 0 };
        }
        if self.good_steps + 1 >= Self::GROWTH_INTERVAL {
            return LossScale { scale: self.scale * Self::GROWTH, good_steps: 0 };
        }
        LossScale { scale: self.scale, good_steps: self.good_steps + 1 }
    }
}

/// The index of the sample at position `at` of the endless sequence a training run draws
/// from `samples` samples: epoch after epoch, each a permutation of them from `seed` and
/// the epoch when `shuffle` is set, the samples in order otherwise.
pub fn sample_at(at: usize, samples: usize, seed: u64, shuffle: bool) -> usize {
    if samples == 0 {
        return at;
    }
    let (epoch, i) = (at / samples, at % samples);
    if !shuffle {
        return i;
    }
    permutation_index(i, samples, seed, epoch as u64)
}

/// Element `i` of a permutation of `0..n` chosen by (seed, epoch), in O(log n) without
/// building it: a cycle-walked Feistel network over the next power of two (each round a
/// keyed mix of half the bits), so any sample's place in any epoch is found alone.
fn permutation_index(i: usize, n: usize, seed: u64, epoch: u64) -> usize {
    let bits = (usize::BITS - (n.max(2) - 1).leading_zeros()).max(2);
    let half = bits.div_ceil(2);
    let mask = (1u64 << half) - 1;
    let mix = |x: u64, round: u64| -> u64 {
        // SplitMix64 of the round's key and the half
        let mut z = x
            ^ seed.rotate_left(17)
            ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ round.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let permute = |x: u64| -> u64 {
        let (mut l, mut r) = (x >> half, x & mask);
        for round in 0..4 {
            let next = l ^ (mix(r, round) & mask);
            l = r;
            r = next;
        }
        (l << half) | r
    };
    // the network permutes 0..2^(2·half); walk the cycle until it lands inside 0..n
    let mut x = permute(i as u64);
    while x >= n as u64 {
        x = permute(x);
    }
    x as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Hugging Face's rules, by hand: warm-up from 0, the peak at the warm-up's end, the
    /// cosine's midpoint halfway between lr and min_lr, min_lr at decay_steps and after.
    #[test]
    fn validation_keeps_a_whole_batch_to_train_on_and_one_to_hold_out() {
        let r = Recipe { validation: Some(Validation { every: 1, split: 0.5 }), ..Recipe::default() };
        // 12 samples, batches of 8: 6 held out is less than a batch
        assert!(r.held_out_problem(12, 8).expect("too few held out").contains("less than one batch of 8"));
        // 20 samples, half held out: 10 held out (one batch), 10 left to train on (one batch)
        assert_eq!(r.held_out_problem(20, 8), None);
        // 90% of 20 held out: 18 held out, 2 left — fewer than a batch, which would train on
        // the same 2 samples every step
        let r = Recipe { validation: Some(Validation { every: 1, split: 0.9 }), ..Recipe::default() };
        let e = r.held_out_problem(20, 8).expect("too few left");
        assert!(e.contains("leaves 2 of the 20 samples to train on, less than one batch of 8"), "{e}");
    }

    #[test]
    fn the_schedule_follows_its_closed_forms() {
        let s = LrSchedule { warmup: 10, decay: Decay::Cosine, decay_steps: 110, min_lr: 0.1 };
        assert_eq!(s.lr(1.0, 0), 0.0);
        assert!((s.lr(1.0, 5) - 0.5).abs() < 1e-12);
        assert!((s.lr(1.0, 10) - 1.0).abs() < 1e-12);
        assert!((s.lr(1.0, 60) - 0.55).abs() < 1e-12);
        assert!((s.lr(1.0, 110) - 0.1).abs() < 1e-12 && (s.lr(1.0, 500) - 0.1).abs() < 1e-12);
        let l = LrSchedule { decay: Decay::Linear, ..s };
        assert!((l.lr(1.0, 35) - (0.1 + 0.9 * 0.75)).abs() < 1e-12);
        let c = LrSchedule { decay: Decay::Constant, warmup: 0, ..s };
        assert_eq!(c.lr(0.3, 0), 0.3);
        assert!(s.problem(1.0).is_none());
        assert!(LrSchedule { min_lr: 2.0, ..s }.problem(1.0).is_some());
        assert!(LrSchedule { decay_steps: 10, ..s }.problem(1.0).is_some());
    }

    /// GradScaler's rule, by hand: an overflow halves the scale and restarts the count;
    /// 2000 finite steps in a row double it (and only then).
    #[test]
    fn the_loss_scale_backs_off_at_an_overflow_and_grows_after_2000_finite_steps() {
        let s = LossScale::initial();
        assert_eq!(s.scale, 65536.0);
        let s = s.next(true).next(true).next(false);
        assert_eq!(s, LossScale { scale: 32768.0, good_steps: 0 });
        let mut t = s;
        for _ in 0..1999 {
            t = t.next(true);
        }
        assert_eq!(t, LossScale { scale: 32768.0, good_steps: 1999 });
        assert_eq!(t.next(true), LossScale { scale: 65536.0, good_steps: 0 });
        assert_eq!(t.next(false), LossScale { scale: 16384.0, good_steps: 0 });
    }

    /// Every epoch's order is a permutation, differs from the last and from the seed's
    /// other orders, and is the file's order without shuffling.
    #[test]
    fn each_epoch_is_a_permutation_of_the_samples() {
        for n in [1, 2, 3, 7, 64, 1000] {
            let mut orders = Vec::new();
            for epoch in 0..3 {
                let order: Vec<usize> = (0..n).map(|i| sample_at(epoch * n + i, n, 5, true)).collect();
                let mut sorted = order.clone();
                sorted.sort_unstable();
                assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "n {n}, epoch {epoch}");
                orders.push(order);
            }
            if n >= 7 {
                assert_ne!(orders[0], orders[1], "n {n}");
                let other: Vec<usize> = (0..n).map(|i| sample_at(i, n, 6, true)).collect();
                assert_ne!(orders[0], other, "n {n}: another seed");
            }
            assert!((0..2 * n).all(|at| sample_at(at, n, 5, false) == at % n));
        }
    }
}
