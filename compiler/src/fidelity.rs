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

/// Reads the table: `spec,step_s,model_state_gib,activations_gib` rows after a header, `#`
/// lines ignored, an empty cell for a figure not published.
pub fn read_published(text: &str) -> Result<Vec<Published>, String> {
    let mut rows = Vec::new();
    let mut header = false;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let cells: Vec<&str> = line.split(',').map(str::trim).collect();
        if !header {
            if cells != ["spec", "step_s", "model_state_gib", "activations_gib"] {
                return Err(format!(
                    "line {}: expected the header `spec,step_s,model_state_gib,activations_gib`",
                    n + 1
                ));
            }
            header = true;
            continue;
        }
        let [spec, step, state, act] = cells.as_slice() else {
            return Err(format!("line {}: {} cells, expected 4", n + 1, cells.len()));
        };
        let figure = |cell: &str| -> Result<Option<f64>, String> {
            if cell.is_empty() {
                return Ok(None);
            }
            match cell.parse::<f64>() {
                Ok(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
                _ => Err(format!("line {}: `{cell}` is not a positive number", n + 1)),
            }
        };
        rows.push(Published {
            spec: spec.to_string(),
            step_s: figure(step)?,
            model_state_gib: figure(state)?,
            activations_gib: figure(act)?,
        });
    }
    if !header {
        return Err("the table has no header".into());
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
}
