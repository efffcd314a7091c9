//! The executor's synthetic data draws, timed for `pipec calibrate`.

use pipec_plan::device::DrawRates;

use super::median_seconds;
use crate::interp::data::Dataset;

/// Seconds per value of the executor's synthetic draws (`DrawRates`): the medians of `reps`
/// draws of 16 samples of 2,048 normal features scored over 1 and over 33 outputs (their
/// difference: 32 score terms a feature) and of 2,048 tokens scored over 1, each solved for
/// its values.
pub fn draw_rates(reps: usize) -> DrawRates {
    const N: usize = 2048;
    let indices: Vec<usize> = (0..16).collect();
    let per_sample = |data: Dataset| {
        median_seconds(0, reps.max(3), || {
            std::hint::black_box(data.samples(&indices));
        }) / indices.len() as f64
    };
    let (one, many, tokens) = (
        per_sample(Dataset::endless(N, None, 1)),
        per_sample(Dataset::endless(N, None, 33)),
        per_sample(Dataset::endless(N, Some(512), 1)),
    );
    let score = ((many - one) / (32 * N) as f64).max(0.0);
    let each = |t: f64| ((t - score * N as f64) / N as f64).max(0.0);
    DrawRates { feature: each(one), token: each(tokens), score }
}
