//! Training data: deterministic synthetic tasks from the seed, or a CSV/NPY file. Data is
//! produced on the host, per microbatch, identically wherever a microbatch runs.

use pipec_plan::model::Loss;
use pipec_plan::plan::DataPlan;
use pipec_plan::Plan;

use crate::rng::Rng;

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
    source: Source,
}

impl Dataset {
    /// Builds the data set a plan asks for; a missing or ill-shaped file is an error.
    pub fn for_plan(plan: &Plan) -> Result<Dataset, String> {
        let numel: usize = plan.model.input.iter().product();
        let outputs: usize = plan.layers.last().map(|l| l.output_shape.iter().product()).unwrap_or(1);
        let classification = plan.model.loss == Loss::CrossEntropy;
        let vocab = plan.model.token_vocab;
        let seed = plan.training.seed;
        let source = match &plan.training.data {
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
            DataPlan::Csv { path } => load_csv(path, numel, classification, outputs, vocab)?,
            DataPlan::Npy { path, labels } => load_npy(path, labels.as_deref(), numel, classification, outputs, vocab)?,
        };
        let mut data = Dataset { seed, numel, outputs, vocab, source };
        // A finite synthetic data set of moderate size is generated once, not every step.
        if let Source::Synthetic { samples, .. } = data.source {
            if samples > 0 && samples * (numel + outputs) <= 64 << 20 {
                let all: Vec<usize> = (0..samples).collect();
                let generated = data.samples(&all);
                if let Source::Synthetic { cache, .. } = &mut data.source {
                    *cache = Some(std::sync::Arc::new(generated));
                }
            }
        }
        Ok(data)
    }

    /// The samples of microbatch `mb` of step `step`.
    pub fn microbatch(&self, step: usize, mb: usize, microbatch_size: usize, batch_size: usize) -> (Inputs, Targets) {
        let first = step * batch_size + mb * microbatch_size;
        let indices: Vec<usize> = (first..first + microbatch_size).collect();
        self.samples(&indices)
    }

    fn samples(&self, indices: &[usize]) -> (Inputs, Targets) {
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
        }
    }

    /// The samples at `indices` (modulo the data set's `samples`) of a data set held in
    /// memory: inputs of `numel` values each, one class or `outputs` values of target each.
    fn gather(&self, inputs: &Inputs, targets: &Targets, samples: usize, indices: &[usize]) -> (Inputs, Targets) {
        fn rows<T: Copy>(all: &[T], width: usize, indices: &[usize], samples: usize) -> Vec<T> {
            indices
                .iter()
                .flat_map(|&g| all[(g % samples) * width..(g % samples + 1) * width].iter().copied())
                .collect()
        }
        let inputs = match inputs {
            Inputs::Features(all) => Inputs::Features(rows(all, self.numel, indices, samples)),
            Inputs::Tokens(all) => Inputs::Tokens(rows(all, self.numel, indices, samples)),
        };
        let targets = match targets {
            Targets::Classes(all) => Targets::Classes(rows(all, 1, indices, samples)),
            Targets::Values(all) => Targets::Values(rows(all, self.outputs, indices, samples)),
        };
        (inputs, targets)
    }
}

fn check_labels(classes: &[i64], outputs: usize, what: &str) -> Result<(), String> {
    if let Some((i, c)) = classes.iter().enumerate().find(|(_, &c)| c < 0 || c as usize >= outputs) {
        return Err(format!("{what}: sample {i} has label {c}, but the model has {outputs} classes (0..{outputs})"));
    }
    Ok(())
}

/// A file's target column(s): class indices (checked against the model's outputs) or
/// regression values.
fn to_targets(values: Vec<f64>, classification: bool, outputs: usize, what: &str) -> Result<Targets, String> {
    if classification {
        let c: Vec<i64> = values.iter().map(|&t| t as i64).collect();
        check_labels(&c, outputs, what)?;
        Ok(Targets::Classes(c))
    } else {
        Ok(Targets::Values(values.into_iter().map(|t| t as f32).collect()))
    }
}

fn to_inputs(values: Vec<f64>, vocab: Option<usize>, what: &str) -> Result<Inputs, String> {
    match vocab {
        None => Ok(Inputs::Features(values.into_iter().map(|v| v as f32).collect())),
        Some(v) => {
            let toks: Vec<i64> = values.iter().map(|&x| x as i64).collect();
            if let Some(bad) = toks.iter().find(|&&t| t < 0 || t as usize >= v) {
                return Err(format!("{what}: token id {bad} is outside the vocabulary 0..{v}"));
            }
            Ok(Inputs::Tokens(toks))
        }
    }
}

fn load_csv(
    path: &str,
    numel: usize,
    classification: bool,
    outputs: usize,
    vocab: Option<usize>,
) -> Result<Source, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read the data file `{path}`: {e}"))?;
    let targets_per_row = if classification { 1 } else { outputs };
    let mut feats = Vec::new();
    let mut targets = Vec::new();
    let mut samples = 0;
    for (lineno, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let values: Result<Vec<f64>, _> = line.split(',').map(|v| v.trim().parse::<f64>()).collect();
        let values = match values {
            Ok(v) => v,
            Err(_) if samples == 0 && feats.is_empty() => continue, // a header row
            Err(e) => return Err(format!("`{path}` line {}: {e}", lineno + 1)),
        };
        if values.len() != numel + targets_per_row {
            return Err(format!("`{path}` line {}: {} columns, expected {} input values and {targets_per_row} target column(s) for the model's input of {numel}", lineno + 1, values.len(), numel));
        }
        feats.extend_from_slice(&values[..numel]);
        targets.extend_from_slice(&values[numel..]);
        samples += 1;
    }
    if samples == 0 {
        return Err(format!("`{path}` has no samples"));
    }
    let inputs = to_inputs(feats, vocab, path)?;
    let targets = to_targets(targets, classification, outputs, path)?;
    Ok(Source::Loaded { inputs, targets, samples })
}

/// Reads a `.npy` file (format 1.0–3.0, little-endian f4/f8/i4/i8, C order).
pub fn read_npy(path: &str) -> Result<(Vec<usize>, Vec<f64>), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read the data file `{path}`: {e}"))?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(format!("`{path}` is not an NPY file"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("`{path}`: NPY version {v} is not supported")),
    };
    let header =
        std::str::from_utf8(bytes.get(start..start + header_len).ok_or(format!("`{path}`: truncated header"))?)
            .map_err(|_| format!("`{path}`: header is not text"))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        Some(header[i + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    let descr = field("descr")
        .and_then(|d| d.strip_prefix('\''))
        .and_then(|d| d.split('\'').next())
        .ok_or(format!("`{path}`: no dtype in header"))?;
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err(format!("`{path}`: Fortran-ordered arrays are not supported"));
    }
    let shape_text = field("shape")
        .and_then(|s| s.strip_prefix('('))
        .and_then(|s| s.split(')').next())
        .ok_or(format!("`{path}`: no shape in header"))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| format!("`{path}`: bad shape `{shape_text}`")))
        .collect::<Result<_, _>>()?;
    let data = &bytes[start + header_len..];
    let n: usize = shape.iter().product();
    let values: Vec<f64> = match descr {
        "<f4" => {
            data.chunks_exact(4).take(n).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()
        }
        "<f8" => data.chunks_exact(8).take(n).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
        "<i4" => {
            data.chunks_exact(4).take(n).map(|c| f64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))).collect()
        }
        "<i8" => {
            data.chunks_exact(8).take(n).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64).collect()
        }
        other => return Err(format!("`{path}`: dtype `{other}` is not supported (use <f4, <f8, <i4 or <i8)")),
    };
    if values.len() != n {
        return Err(format!("`{path}`: truncated data ({} of {n} values)", values.len()));
    }
    Ok((shape, values))
}

fn load_npy(
    path: &str,
    labels: Option<&str>,
    numel: usize,
    classification: bool,
    outputs: usize,
    vocab: Option<usize>,
) -> Result<Source, String> {
    let (shape, values) = read_npy(path)?;
    let samples = shape.first().copied().unwrap_or(0);
    if samples == 0 || shape[1..].iter().product::<usize>() != numel {
        return Err(format!(
            "`{path}` has shape {shape:?}; the model needs (samples, ...) with {numel} values per sample"
        ));
    }
    let labels = labels.ok_or(format!("npy data needs a `labels` file beside `{path}`"))?;
    let (lshape, lvalues) = read_npy(labels)?;
    let per = if classification { 1 } else { outputs };
    if lshape.first().copied() != Some(samples) || lvalues.len() != samples * per {
        return Err(format!("`{labels}` has shape {lshape:?}; expected {samples} samples with {per} target(s) each"));
    }
    let targets = to_targets(lvalues, classification, outputs, labels)?;
    Ok(Source::Loaded { inputs: to_inputs(values, vocab, path)?, targets, samples })
}
