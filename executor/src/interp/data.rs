//! Training data: deterministic synthetic tasks from the seed, or a CSV/NPY file. Data is
//! produced on the host, per microbatch, identically wherever a microbatch runs.

use std::path::Path;

use pipec_plan::datafile;
use pipec_plan::model::Loss;
use pipec_plan::plan::DataPlan;
use pipec_plan::Plan;

use crate::backend::rng::Rng;

/// The inputs of some samples, flattened sample-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Inputs {
    Features(Vec<f32>),
    Tokens(Vec<i64>),
}

/// The targets of some samples.
#[derive(Debug, Clone, PartialEq)]
pub enum Targets {
    Classes(Vec<i64>),
    Values(Vec<f32>),
}

/// Where samples come from.
#[derive(Debug, Clone)]
enum Source {
    Synthetic {
        classification: bool,
        /// Distinct samples cycled through; 0: a fresh batch every step.
        samples: usize,
        teacher: Vec<f32>,
        cache: Option<std::sync::Arc<(Inputs, Targets)>>,
    },
    Loaded {
        inputs: Inputs,
        targets: Targets,
        samples: usize,
    },
    /// A language model's synthetic text: token sequences from a fixed random successor
    /// table (each token followed by its successor with probability 0.9, by a random token
    /// otherwise), so that the next token is mostly predictable.
    SyntheticText {
        samples: usize,
        successor: Vec<u32>,
    },
}

/// A data set for a plan.
#[derive(Debug, Clone)]
pub struct Dataset {
    seed: u64,
    /// Elements per input sample.
    numel: usize,
    /// Output size of the model (classes, or regression targets).
    outputs: usize,
    vocab: Option<usize>,
    /// Class labels per sample (a language model's sequence length; 1 otherwise).
    positions: usize,
    /// Draw each epoch's samples in an order of its own (`training.shuffle`).
    shuffle: bool,
    /// Samples held out for validation: the data set's last ones.
    held_out: usize,
    source: Source,
}

impl Dataset {
    /// Builds the data set a plan asks for; a missing or ill-shaped file is an error.
    pub fn for_plan(plan: &Plan) -> Result<Dataset, String> {
        let numel: usize = plan.model.input.iter().product();
        let out_shape = plan.layers.last().map(|l| l.output_shape.clone()).unwrap_or_default();
        let outputs: usize = out_shape.iter().product();
        let classification = plan.model.loss == Loss::CrossEntropy;
        let vocab = plan.model.token_vocab;
        let seed = plan.training.seed;
        let expect = datafile::Expect::of(&plan.model.input, &out_shape, plan.model.loss, vocab);
        let lm = pipec_plan::model::language_model_positions(&plan.model.input, &out_shape, vocab);
        let source = match &plan.training.data {
            DataPlan::Synthetic { task, samples } if lm.is_some() && *task == pipec_plan::Task::Classification => {
                let v = vocab.unwrap_or(1);
                let mut rng = Rng::keyed(&[seed, 2]);
                Source::SyntheticText {
                    samples: samples.unwrap_or(0),
                    successor: (0..v).map(|_| rng.below(v as u64) as u32).collect(),
                }
            }
            DataPlan::Text { path, tokenizer: None } => {
                token_source(path, datafile::TokenFile::Text, lm, vocab, &expect)?
            }
            DataPlan::Text { path, tokenizer: Some(t) } => {
                token_source(path, datafile::TokenFile::Tokenized(t.into()), lm, vocab, &expect)?
            }
            DataPlan::Tokens { path, dtype: Some(d) } => {
                token_source(path, datafile::TokenFile::Raw(*d), lm, vocab, &expect)?
            }
            DataPlan::Tokens { path, dtype: None } => token_source(path, datafile::TokenFile::Npy, lm, vocab, &expect)?,
            DataPlan::Images { path, resize, mean, std } => {
                let t = pipec_plan::images::Transform { resize: *resize, mean: mean.clone(), std: std.clone() };
                let s = pipec_plan::images::load_folder(
                    Path::new(path),
                    &plan.model.input,
                    &expect,
                    &t,
                    datafile::Extent::All,
                )?;
                loaded(s, &expect)
            }
            DataPlan::Synthetic { task, samples } => {
                if classification != (*task == pipec_plan::Task::Classification) {
                    return Err(format!(
                        "the synthetic task `{task}` does not fit the `{}` loss",
                        plan.model.loss.name()
                    ));
                }
                let rows = vocab.unwrap_or(numel);
                let mut rng = Rng::keyed(&[seed, 2]);
                Source::Synthetic {
                    classification,
                    samples: samples.unwrap_or(0),
                    teacher: rng.normal_vec(rows * outputs),
                    cache: None,
                }
            }
            DataPlan::Csv { path } => {
                loaded(datafile::load_csv(Path::new(path), &expect, datafile::Extent::All)?, &expect)
            }
            DataPlan::Npy { path, labels } => {
                let labels = labels.as_deref().map(Path::new);
                loaded(datafile::load_npy(Path::new(path), labels, &expect, datafile::Extent::All)?, &expect)
            }
        };
        let shuffle = plan.training.recipe.shuffle;
        let mut data =
            Dataset { seed, numel, outputs, vocab, positions: expect.positions, shuffle, held_out: 0, source };
        // validation holds out the data set's last samples
        if let Some(v) = plan.training.recipe.validation {
            let n = data.size().ok_or("validation needs a data set of a finite size")?;
            if let Some(problem) = plan.training.recipe.held_out_problem(n, plan.training.batch_size) {
                return Err(problem);
            }
            data.held_out = v.held_out(n, plan.training.batch_size).0;
        }
        // A finite synthetic data set of moderate size is generated once, not every step.
        if let Source::Synthetic { samples, .. } = data.source {
            // (what the cost model prices as not drawn as training runs)
            let drawn = pipec_plan::plan::synthetic_draw(Some(samples), (numel, outputs), vocab.is_some(), false);
            if drawn.is_none() {
                let all: Vec<usize> = (0..samples).collect();
                let generated = data.samples(&all);
                if let Source::Synthetic { cache, .. } = &mut data.source {
                    *cache = Some(std::sync::Arc::new(generated));
                }
            }
        }
        Ok(data)
    }

    /// A synthetic classification stream drawn as training runs (no sample kept) of `numel`
    /// inputs (token ids of `vocab` where given) scored over `outputs`: what `pipec
    /// calibrate` times its draws on (`crate::calibrate::draw_rates`).
    pub(crate) fn endless(numel: usize, vocab: Option<usize>, outputs: usize) -> Dataset {
        let mut rng = Rng::keyed(&[5, 2]);
        Dataset {
            seed: 5,
            numel,
            outputs,
            vocab,
            positions: 1,
            shuffle: false,
            held_out: 0,
            source: Source::Synthetic {
                classification: true,
                samples: 0,
                teacher: rng.normal_vec(vocab.unwrap_or(numel) * outputs),
                cache: None,
            },
        }
    }

    /// The samples of microbatch `mb` of step `step`: the run draws positions one after
    /// the other from an endless sequence of epochs (each the data set in order, or in an
    /// order of its own from the seed when shuffling), so a resumed run draws the same ones.
    pub fn microbatch(&self, step: usize, mb: usize, microbatch_size: usize, batch_size: usize) -> (Inputs, Targets) {
        let first = step * batch_size + mb * microbatch_size;
        let indices: Vec<usize> = match self.size() {
            Some(n) => (first..first + microbatch_size)
                .map(|at| pipec_plan::recipe::sample_at(at, n, self.seed, self.shuffle))
                .collect(),
            None => (first..first + microbatch_size).collect(),
        };
        self.samples(&indices)
    }

    /// The number of distinct samples training draws from (None: an endless synthetic
    /// stream): the data set less what validation holds out.
    pub fn size(&self) -> Option<usize> {
        let all = match &self.source {
            Source::Synthetic { samples, .. } | Source::SyntheticText { samples, .. } => {
                (*samples > 0).then_some(*samples)
            }
            Source::Loaded { samples, .. } => Some(*samples),
        };
        all.map(|n| n - self.held_out)
    }

    /// Whole batches of `batch_size` in what validation holds out.
    pub fn held_out_batches(&self, batch_size: usize) -> usize {
        self.held_out / batch_size.max(1)
    }

    /// The samples of microbatch `mb` of held-out batch `batch` (validation: the data
    /// set's last samples, in order).
    pub fn validation_microbatch(
        &self,
        batch: usize,
        mb: usize,
        microbatch_size: usize,
        batch_size: usize,
    ) -> (Inputs, Targets) {
        let first = self.size().unwrap_or(0) + batch * batch_size + mb * microbatch_size;
        let indices: Vec<usize> = (first..first + microbatch_size).collect();
        self.samples(&indices)
    }

    pub(crate) fn samples(&self, indices: &[usize]) -> (Inputs, Targets) {
        match &self.source {
            Source::Synthetic { samples, cache: Some(cache), .. } => {
                let (inputs, targets) = cache.as_ref();
                self.gather(inputs, targets, *samples, indices)
            }
            Source::Synthetic { classification, samples, teacher, .. } => {
                let mut feats = Vec::new();
                let mut toks = Vec::new();
                let mut classes = Vec::new();
                let mut values = Vec::new();
                for &g in indices {
                    let g = if *samples > 0 { g % samples } else { g };
                    let mut rng = Rng::keyed(&[self.seed, 1, g as u64]);
                    // scores[c] = x · teacher[:, c] (token inputs: sum of the tokens' rows)
                    let mut scores = vec![0f64; self.outputs];
                    match self.vocab {
                        Some(v) => {
                            for _ in 0..self.numel {
                                let t = rng.below(v as u64) as usize;
                                toks.push(t as i64);
                                for (c, s) in scores.iter_mut().enumerate() {
                                    *s += f64::from(teacher[t * self.outputs + c]);
                                }
                            }
                        }
                        None => {
                            let x = rng.normal_vec(self.numel);
                            for (i, xi) in x.iter().enumerate() {
                                for (c, s) in scores.iter_mut().enumerate() {
                                    *s += f64::from(*xi) * f64::from(teacher[i * self.outputs + c]);
                                }
                            }
                            feats.extend(x);
                        }
                    }
                    if *classification {
                        let best =
                            scores.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(c, _)| c).unwrap_or(0);
                        classes.push(best as i64);
                    } else {
                        let scale = (self.numel as f64).sqrt().max(1.0);
                        values.extend(scores.iter().map(|s| (s / scale) as f32));
                    }
                }
                let inputs = if self.vocab.is_some() { Inputs::Tokens(toks) } else { Inputs::Features(feats) };
                let targets = if *classification { Targets::Classes(classes) } else { Targets::Values(values) };
                (inputs, targets)
            }
            Source::Loaded { inputs, targets, samples } => self.gather(inputs, targets, *samples, indices),
            Source::SyntheticText { samples, successor } => {
                let v = successor.len() as u64;
                let (mut toks, mut next) = (Vec::new(), Vec::new());
                for &g in indices {
                    let g = if *samples > 0 { g % samples } else { g };
                    let mut rng = Rng::keyed(&[self.seed, 1, g as u64]);
                    let mut t = rng.below(v) as u32;
                    let mut seq = Vec::with_capacity(self.numel + 1);
                    seq.push(t);
                    for _ in 0..self.numel {
                        t = if rng.uniform() < 0.9 { successor[t as usize] } else { rng.below(v) as u32 };
                        seq.push(t);
                    }
                    toks.extend(seq[..self.numel].iter().map(|&t| i64::from(t)));
                    next.extend(seq[1..].iter().map(|&t| i64::from(t)));
                }
                (Inputs::Tokens(toks), Targets::Classes(next))
            }
        }
    }

    /// The samples at `indices` (modulo the data set's `samples`) of a data set held in
    /// memory: inputs of `numel` values each, one class or `outputs` values of target each.
    fn gather(&self, inputs: &Inputs, targets: &Targets, samples: usize, indices: &[usize]) -> (Inputs, Targets) {
        // one copy per row into a vector made at its size (an image-sized microbatch is
        // ~100 MB)
        fn rows<T: Copy>(all: &[T], width: usize, indices: &[usize], samples: usize) -> Vec<T> {
            let mut out = Vec::with_capacity(indices.len() * width);
            for &g in indices {
                out.extend_from_slice(&all[(g % samples) * width..(g % samples + 1) * width]);
            }
            out
        }
        let inputs = match inputs {
            Inputs::Features(all) => Inputs::Features(rows(all, self.numel, indices, samples)),
            Inputs::Tokens(all) => Inputs::Tokens(rows(all, self.numel, indices, samples)),
        };
        let targets = match targets {
            Targets::Classes(all) => Targets::Classes(rows(all, self.positions, indices, samples)),
            Targets::Values(all) => Targets::Values(rows(all, self.outputs, indices, samples)),
        };
        (inputs, targets)
    }
}

/// A language model's token file cut into windows of its sequence length (`lm`).
fn token_source(
    path: &str,
    kind: datafile::TokenFile,
    lm: Option<usize>,
    vocab: Option<usize>,
    expect: &datafile::Expect,
) -> Result<Source, String> {
    let (Some(seq), Some(v)) = (lm, vocab) else {
        return Err("token data trains a language model ([sequence] token ids in, [sequence, vocab] scores out), and this model is not one".into());
    };
    let tokens = datafile::load_tokens(Path::new(path), kind, v, datafile::Extent::All)?;
    Ok(loaded(datafile::token_windows(&tokens, seq, path)?, expect))
}

/// A file's samples as the executor holds them: class indices or regression values, and
/// features or token ids (checked by `pipec_plan::datafile`: finite, whole labels in range).
fn loaded(s: datafile::Samples, expect: &datafile::Expect) -> Source {
    let inputs = match expect.vocab {
        Some(_) => Inputs::Tokens(s.inputs.iter().map(|&v| v as i64).collect()),
        None => Inputs::Features(s.inputs.iter().map(|&v| v as f32).collect()),
    };
    let targets = match expect.classes {
        Some(_) => Targets::Classes(s.targets.iter().map(|&t| t as i64).collect()),
        None => Targets::Values(s.targets.iter().map(|&t| t as f32).collect()),
    };
    Source::Loaded { inputs, targets, samples: s.samples }
}
