//! Predictions held against published runs: the table `bench/specs/published/published.csv`
//! (one row per spec in that folder: a published iteration time, and for Korthikanti et al.
//! 2022's runs the published memory per GPU) and what the compiler predicts for each spec.
//! `pipec-bench fidelity` prints the comparison; `tests/fidelity.rs` fails past its bounds.

use std::path::Path;

use crate::bound::Memo;
use crate::options::CompileOptions;
use crate::predict::predict;

/// One published run.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// The spec's file name, in the table's folder.
    pub spec: String,
    /// Seconds per iteration (absent: a layout published for its memory only).
    pub step_s: Option<f64>,
    /// GiB per GPU of weights, gradients and optimizer state, on a device holding
    /// transformer blocks only.
    pub model_state_gib: Option<f64>,
    /// GiB per GPU of activations on the first pipeline stage's devices.
    pub activations_gib: Option<f64>,
}

/// A table's rows after its header (`#` lines and empty ones skipped): each row's line
/// number and cells; Err where the header is not `header` or a row has another count of
/// cells.
fn table_rows<'a>(text: &'a str, header: &[&str]) -> Result<Vec<(usize, Vec<&'a str>)>, String> {
    let mut rows = Vec::new();
    let mut seen = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if !seen {
            if cells != header {
                return Err(format!("line {}: expected the header `{}`", n + 1, header.join(",")));
            }
            seen = true;
            continue;
        }
        if cells.len() != header.len() {
            return Err(format!("line {}: {} cells, expected {}", n + 1, cells.len(), header.len()));
        }
        rows.push((n + 1, cells));
    }
    if !seen {
        return Err("the table has no header".into());
    }
    Ok(rows)
}

/// Reads the table: `spec,step_s,model_state_gib,activations_gib` rows after a header, `#`
/// lines ignored, an empty cell for a figure not published.
pub fn read_published(text: &str) -> Result<Vec<Published>, String> {
    let mut rows = Vec::new();
    for (n, cells) in table_rows(text, &["spec", "step_s", "model_state_gib", "activations_gib"])? {
        let figure = |cell: &str| -> Result<Option<f64>, String> {
            if cell.is_empty() {
                return Ok(None);
            }
            match cell.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                _ => Err(format!("line {n}: `{cell}` is not a positive number")),
            }
        };
        rows.push(Published {
            spec: cells[0].to_string(),
            step_s: figure(cells[1])?,
            model_state_gib: figure(cells[2])?,
            activations_gib: figure(cells[3])?,
        });
    }
    Ok(rows)
}

/// What the compiler predicts for one spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Predicted {
    /// The simulated step.
    pub step_s: f64,
    /// The smallest weights + gradients + optimizer state of any device (a device holding
    /// transformer blocks only, in a pipeline), GiB.
    pub model_state_gib: f64,
    /// The first device's activations (the first stage keeps the most in flight), GiB.
    pub activations_gib: f64,
    /// The largest device's predicted peak memory, GiB.
    pub peak_gib: f64,
    /// Whether every device fits its memory.
    pub fits: bool,
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Checks `source` (relative paths against `base`) and predicts its step and memory the way
/// the strategy search does (`predict::predict`: one pipeline replica of a symmetric
/// plan, the whole plan's figures).
pub fn predict_source(source: &str, base: Option<&Path>) -> Result<Predicted, String> {
    let checked = pipec_grammar::check_source_in(source, base);
    let errors = |d: &[pipec_grammar::diagnostic::Diagnostic]| {
        d.iter().filter(|d| d.is_error()).map(|d| format!("{}: {}", d.code, d.message)).collect::<Vec<_>>().join("; ")
    };
    let spec = checked.spec.ok_or_else(|| errors(&checked.diagnostics))?;
    if spec.strategy.auto.is_some() {
        return Err("the strategy has `auto` fields: a published run names its layout".into());
    }
    let options = CompileOptions { base_dir: base.map(Path::to_path_buf), ..CompileOptions::default() };
    let figures = predict(&spec, &options, &mut Memo::default()).map_err(|d| errors(&d))?;
    let state = |m: &pipec_plan::plan::MemoryBreakdown| (m.weights + m.gradients + m.optimizer) as f64 / GIB;
    let model_state_gib = figures.memory.iter().map(|(_, m)| state(m)).fold(f64::INFINITY, f64::min);
    let activations_gib =
        figures.memory.iter().min_by_key(|(d, _)| d.0).map_or(0.0, |(_, m)| m.activations as f64 / GIB);
    let peak_gib = figures.memory.iter().map(|(_, m)| m.total as f64 / GIB).fold(0.0, f64::max);
    Ok(Predicted { step_s: figures.step_s, model_state_gib, activations_gib, peak_gib, fits: figures.fits })
}

/// Which half of the step-time table a row is in: the rows a constant is fitted on, or the
/// rows it is judged on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    Calibration,
    HeldOut,
}

/// One published 2025–26 run with a published step time (`bench/specs/published-2025/steps.csv`).
#[derive(Debug, Clone, PartialEq)]
pub struct StepRow {
    /// The spec's file name, in the table's folder.
    pub spec: String,
    /// Seconds per step: published, or the published tokens/s/GPU turned into one
    /// (global batch × sequence / (tokens/s/GPU × GPUs)).
    pub step_s: f64,
    /// How `step_s` was read: `step` or `tokens`.
    pub from: String,
    pub half: Half,
    pub moe: bool,
    pub fp8: bool,
}

/// Reads the step-time table: `spec,step_s,from,half,moe,fp8` after a header, `#` lines
/// ignored.
pub fn read_steps(text: &str) -> Result<Vec<StepRow>, String> {
    let mut rows = Vec::new();
    for (n, cells) in table_rows(text, &["spec", "step_s", "from", "half", "moe", "fp8"])? {
        let [spec, step, from, half, moe, fp8] = cells.as_slice() else { continue };
        let step_s = match step.parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => v,
            _ => return Err(format!("line {n}: `{step}` is not a positive number of seconds")),
        };
        let half = match *half {
            "calibration" => Half::Calibration,
            "held-out" => Half::HeldOut,
            other => return Err(format!("line {n}: half `{other}` is neither `calibration` nor `held-out`")),
        };
        let yes = |cell: &str| match cell {
            "yes" => Ok(true),
            "no" => Ok(false),
            other => Err(format!("line {n}: `{other}` is neither yes nor no")),
        };
        if !matches!(*from, "step" | "tokens") {
            return Err(format!("line {n}: from `{from}` is neither `step` nor `tokens`"));
        }
        rows.push(StepRow {
            spec: spec.to_string(),
            step_s,
            from: from.to_string(),
            half,
            moe: yes(moe)?,
            fp8: yes(fp8)?,
        });
    }
    Ok(rows)
}

/// One engine × device kind's constants refitted on its calibration rows of `rows` (their
/// checked `specs`, in the same order): the rows they are fitted on, the table's constants
/// and the refitted ones (Err: the rows cannot be matched).
///
/// The kernel efficiency is fitted on the kind's calibration rows the experts' constant does
/// not act on (dense, or a mixture of experts in the training precision); the routed
/// experts' constant then on its FP8 mixture-of-experts calibration rows, the kernel
/// efficiency held. A kind without rows of both sorts fits its kernel efficiency on all of
/// them, its experts' constant 1.
pub struct Refit {
    pub kind: (pipec_plan::engine::performance::KernelFamily, String),
    pub calibration: Vec<usize>,
    pub held_out: Vec<usize>,
    pub table: pipec_plan::engine::performance::Performance,
    pub fitted: Result<f64, String>,
    /// The routed experts' constant refitted (None: the kind has not both an FP8 mixture of
    /// experts and another calibration row: it is 1).
    pub fitted_experts: Option<Result<f64, String>>,
}

/// The highest routed experts' constant a fit takes: grouped products 4× faster than a
/// dense product of their size would be a misread row.
const HIGHEST_EXPERTS: f64 = 4.0;

/// Every engine × device kind of the table, refitted ([`Refit`]), in a stable order.
pub fn refit_all(rows: &[StepRow], specs: &[StepSpec]) -> Vec<Refit> {
    let mut kinds: Vec<_> = specs.iter().map(StepSpec::kind).collect();
    kinds.sort_by_key(|k| format!("{k:?}"));
    kinds.dedup();
    kinds
        .into_iter()
        .map(|kind| {
            let members: Vec<usize> = (0..rows.len()).filter(|&i| specs[i].kind() == kind).collect();
            let (calibration, held_out): (Vec<usize>, Vec<usize>) =
                members.iter().partition(|&&i| rows[i].half == Half::Calibration);
            let first = calibration.first().or(held_out.first()).copied().unwrap_or(0);
            let (dense, moe): (Vec<usize>, Vec<usize>) =
                calibration.iter().partition(|&&i| !(rows[i].moe && rows[i].fp8));
            let published = |of: &[usize]| of.iter().map(|&i| rows[i].step_s).collect::<Vec<f64>>();
            // without a dense row the efficiency is fitted on every row, the experts at 1
            let on = if dense.is_empty() { calibration.clone() } else { dense.clone() };
            let fitted = if on.is_empty() {
                Err("no calibration row".to_string())
            } else {
                fit_efficiency(&published(&on), |e| on.iter().map(|&i| specs[i].step_at(Some(e), Some(1.0))).collect())
            };
            let fitted_experts = match (&fitted, dense.is_empty() || moe.is_empty()) {
                (_, true) => None,
                (Err(e), false) => Some(Err(e.clone())),
                (Ok(e), false) => Some(fit_efficiency_in(&published(&moe), HIGHEST_EXPERTS, |x| {
                    moe.iter().map(|&i| specs[i].step_at(Some(*e), Some(x))).collect()
                })),
            };
            Refit { kind, table: specs[first].efficiency().clone(), calibration, held_out, fitted, fitted_experts }
        })
        .collect()
}

/// A published run's spec, checked, ready to be predicted at any kernel efficiency.
pub struct StepSpec {
    spec: pipec_grammar::spec::Spec,
    base: Option<std::path::PathBuf>,
    performance: pipec_plan::engine::performance::Performance,
}

fn error_list(d: &[pipec_grammar::diagnostic::Diagnostic]) -> String {
    d.iter().filter(|d| d.is_error()).map(|d| format!("{}: {}", d.code, d.message)).collect::<Vec<_>>().join("; ")
}

impl StepSpec {
    /// Checks `source` (relative paths against `base`).
    pub fn check(source: &str, base: Option<&Path>) -> Result<StepSpec, String> {
        let checked = pipec_grammar::check_source_in(source, base);
        let spec = checked.spec.ok_or_else(|| error_list(&checked.diagnostics))?;
        let performance = spec.engine.performance.clone().ok_or("the spec's engine has no performance profile")?;
        Ok(StepSpec { spec, base: base.map(Path::to_path_buf), performance })
    }

    /// The kernels and the device kind the spec's constant is for.
    pub fn kind(&self) -> (pipec_plan::engine::performance::KernelFamily, String) {
        (self.performance.family, pipec_plan::engine::performance::device_kind(&self.spec.cluster.device))
    }

    /// The device the spec's plan runs on (its figures scaled by the engine's constant).
    pub fn device(&self) -> &pipec_plan::device::DeviceModel {
        &self.spec.cluster.device
    }

    /// Devices in the cluster.
    pub fn devices(&self) -> usize {
        self.spec.cluster.nodes * self.spec.cluster.devices_per_node
    }

    /// Tokens a step trains on (global batch × sequence) for a language model; None for
    /// another model.
    pub fn tokens_per_step(&self) -> Option<f64> {
        let seq = self.spec.model.token_vocab().and(self.spec.model.input.first().copied())?;
        Some(self.spec.training.batch_size as f64 * seq as f64)
    }

    /// The highest efficiency [`step`](Self::step) takes: where a matrix product reaches the
    /// highest peak the device allows (`pipec_plan::engine::performance::peak_cap`).
    pub fn max_efficiency(&self) -> f64 {
        let device = &self.spec.cluster.device;
        self.performance.efficiency * pipec_plan::engine::performance::peak_cap(device)
            / device.matrix_efficiency.peak.max(1e-9)
    }

    /// The constant the spec is priced with: its table's, or a calibration file's.
    pub fn efficiency(&self) -> &pipec_plan::engine::performance::Performance {
        &self.performance
    }

    /// The predicted step with the engine's kernel efficiency `efficiency` in place of the
    /// table's (None: the table's).
    pub fn step(&self, efficiency: Option<f64>) -> Result<f64, String> {
        self.step_at(efficiency, None)
    }

    /// [`step`](Self::step) with the routed experts' constant `experts` in place of the
    /// table's too (None: the table's).
    pub fn step_at(&self, efficiency: Option<f64>, experts: Option<f64>) -> Result<f64, String> {
        let mut spec = self.spec.clone();
        if let (Some(x), Some(p)) = (experts, spec.engine.performance.as_mut()) {
            p.experts = x;
        }
        if let Some(e) = efficiency {
            // the device's peaks were scaled by the table's constant: rescale them to `e`
            let wanted = spec.cluster.device.matrix_efficiency.peak * e / self.performance.efficiency;
            if wanted > pipec_plan::engine::performance::peak_cap(&spec.cluster.device) * (1.0 + 1e-12) {
                return Err(format!("an efficiency of {e} puts matrix products past the device's peak"));
            }
            spec.cluster.run_engine_at(e / self.performance.efficiency);
        }
        let options = CompileOptions { base_dir: self.base.clone(), ..CompileOptions::default() };
        predict(&spec, &options, &mut Memo::default()).map(|f| f.step_s).map_err(|d| error_list(&d))
    }
}

/// The kernel efficiency that makes `predict(e)` (seconds per row at efficiency `e`) match
/// `published` in the mean of the log ratios — the geometric mean of predicted/published
/// is 1 — found by bisection on log e in [0.05, 1.33] to 0.02% (a step's time falls as its kernels'
/// efficiency rises). Err: the rows cannot be matched inside that range.
pub fn fit_efficiency(published: &[f64], predict: impl FnMut(f64) -> Result<Vec<f64>, String>) -> Result<f64, String> {
    fit_efficiency_in(published, 1.0 / 0.75, predict)
}

/// [`fit_efficiency`] with `highest` the top of the range (a device whose curves already
/// peak at 1, a calibrated CPU's, takes at most 1).
pub fn fit_efficiency_in(
    published: &[f64],
    highest: f64,
    mut predict: impl FnMut(f64) -> Result<Vec<f64>, String>,
) -> Result<f64, String> {
    let mut gap = |e: f64| -> Result<f64, String> {
        let p = predict(e)?;
        Ok(p.iter().zip(published).map(|(p, m)| (p / m).ln()).sum::<f64>() / published.len().max(1) as f64)
    };
    let (mut lo, mut hi) = (0.05f64.ln(), highest.max(0.06).ln());
    if gap(hi.exp())? > 0.0 {
        return Err("even at the highest efficiency the prediction is slower than the runs".into());
    }
    if gap(lo.exp())? < 0.0 {
        return Err("even at the lowest efficiency the prediction is faster than the runs".into());
    }
    for _ in 0..14 {
        let mid = 0.5 * (lo + hi);
        if gap(mid.exp())? > 0.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((0.5 * (lo + hi)).exp())
}

/// `predicted / published − 1`.
pub fn relative_error(predicted: f64, published: f64) -> f64 {
    predicted / published - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_reads_its_rows_and_refuses_what_is_not_one() {
        let text = "# a comment\nspec,step_s,model_state_gib,activations_gib\na.yaml,1.5,,\nb.yaml,,45.5,9.5\n";
        let rows = read_published(text).expect("reads");
        assert_eq!(rows.len(), 2);
        assert_eq!((rows[0].step_s, rows[0].model_state_gib), (Some(1.5), None));
        assert_eq!((rows[1].step_s, rows[1].activations_gib), (None, Some(9.5)));
        assert!(read_published("a.yaml,1,,\n").is_err(), "no header");
        assert!(read_published("spec,step_s,model_state_gib,activations_gib\na.yaml,-1,,\n").is_err());
        assert!(read_published("spec,step_s,model_state_gib,activations_gib\na.yaml,1\n").is_err());
        assert_eq!(relative_error(1.1, 1.0), 1.1 / 1.0 - 1.0);
    }

    #[test]
    fn the_step_table_reads_its_halves_and_refuses_what_is_not_one() {
        let head = "spec,step_s,from,half,moe,fp8\n";
        let rows =
            read_steps(&format!("# c\n{head}a.yaml,2.5,tokens,calibration,yes,no\nb.yaml,1,step,held-out,no,yes\n"))
                .expect("reads");
        assert_eq!((rows[0].half, rows[0].moe, rows[0].fp8), (Half::Calibration, true, false));
        assert_eq!((rows[1].half, rows[1].step_s, rows[1].from.as_str()), (Half::HeldOut, 1.0, "step"));
        for bad in [
            "a.yaml,0,step,held-out,no,no",
            "a.yaml,1,guess,held-out,no,no",
            "a.yaml,1,step,both,no,no",
            "a.yaml,1,step,held-out,maybe,no",
            "a.yaml,1,step",
        ] {
            assert!(read_steps(&format!("{head}{bad}\n")).is_err(), "{bad}");
        }
        assert!(read_steps("a.yaml,1,step,held-out,no,no\n").is_err(), "no header");
        // the bisection finds the efficiency that makes a step of a + b/e match
        let fitted = fit_efficiency(&[3.0], |e| Ok(vec![1.0 + 1.0 / e])).expect("fits");
        assert!((fitted - 0.5).abs() < 1e-3, "{fitted}");
        assert!(fit_efficiency(&[0.5], |e| Ok(vec![1.0 + 1.0 / e])).is_err(), "faster than any efficiency");
    }
}
