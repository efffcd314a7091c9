//! `pipec calibrate --measured SPEC`: fit the spec's engine's kernel efficiency on its
//! device kind to one measured step of the user's own run, and write the calibration file
//! a spec names with `engine: { calibration: FILE }` (`pipec_plan::engine::performance`).
//!
//! The step is given (`--step 2.84s`) or read from a log: Megatron-LM's `elapsed time per
//! iteration (ms)`, torchtitan's `tps` (tokens per second per device, turned into a step by
//! the spec's batch and sequence), or `pipec run`'s metrics.jsonl (`step_time_s`). A log's
//! first iteration is set aside (compilation and warm-up) and the median of the rest kept.

use std::path::{Path, PathBuf};

use pipec_compiler::fidelity::{fit_efficiency_in, StepSpec};
use pipec_grammar::dsl::Dimension;
use pipec_plan::engine::performance::{CalibrationFile, Measured, CALIBRATION_FORMAT};

use crate::output::write_atomic;
use crate::plan_profile_cmd::quantity;
use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The largest log read.
const MAX_LOG: u64 = 256 << 20;

/// A step read from a log: its seconds and where they came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LogStep {
    pub step_s: f64,
    pub source: String,
}

/// What a log's lines give: step seconds (Megatron, pipec) or tokens per second per device
/// (torchtitan), one per reported iteration.
#[derive(Debug, Clone, PartialEq)]
pub enum LogFigures {
    StepSeconds { kind: &'static str, values: Vec<f64> },
    TokensPerDevice(Vec<f64>),
}

/// Reads the iterations a log reports; Err says why it is not a log pipec reads.
pub fn read_log(text: &str) -> Result<LogFigures, String> {
    let (mut megatron, mut titan, mut pipec) = (Vec::new(), Vec::new(), Vec::new());
    for line in text.lines() {
        let line = strip_ansi(line);
        if let Some(ms) = number_after(&line, "elapsed time per iteration (ms):") {
            megatron.push(ms / 1e3);
        } else if line.contains("step:") && line.contains("tps:") {
            if let Some(tps) = number_after(&line, "tps:") {
                titan.push(tps);
            }
        } else if line.trim_start().starts_with('{') && line.contains("\"step_time_s\"") {
            let value: serde_json::Value =
                serde_json::from_str(line.trim()).map_err(|e| format!("a metrics line is not JSON: {e}"))?;
            if let Some(s) = value.get("step_time_s").and_then(|v| v.as_f64()) {
                pipec.push(s);
            }
        }
    }
    let kinds = [!megatron.is_empty(), !titan.is_empty(), !pipec.is_empty()].iter().filter(|k| **k).count();
    if kinds > 1 {
        return Err("the log mixes lines of more than one engine: give one run's log".into());
    }
    if !megatron.is_empty() {
        return Ok(LogFigures::StepSeconds {
            kind: "Megatron-LM's `elapsed time per iteration (ms)`",
            values: megatron,
        });
    }
    if !titan.is_empty() {
        return Ok(LogFigures::TokensPerDevice(titan));
    }
    if !pipec.is_empty() {
        return Ok(LogFigures::StepSeconds { kind: "pipec run's metrics.jsonl `step_time_s`", values: pipec });
    }
    Err("no iteration found: expected Megatron-LM's `elapsed time per iteration (ms): …`, torchtitan's `step: … tps: …` or pipec's metrics.jsonl lines".into())
}

/// The median of the iterations after the first (all of them when there is one).
pub fn steady(values: &[f64]) -> Option<f64> {
    let kept = if values.len() > 1 { &values[1..] } else { values };
    let mut v: Vec<f64> = kept.iter().copied().filter(|x| x.is_finite() && *x > 0.0).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { 0.5 * (v[n / 2 - 1] + v[n / 2]) })
}

/// Removes terminal colour codes (torchtitan colours its log).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ … final letter
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// The number after `label` on `line` (thousands separators allowed: `5,762`).
fn number_after(line: &str, label: &str) -> Option<f64> {
    let at = line.find(label)? + label.len();
    let text: String = line[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ',' || *c == 'e' || *c == '-' || *c == '+')
        .filter(|c| *c != ',')
        .collect();
    text.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// The measured step: `--step` or a log turned into seconds for `spec`'s batch.
fn measured_step(
    step: Option<&str>,
    log: Option<&Path>,
    tokens_per_step: Option<f64>,
    devices: f64,
) -> Result<LogStep, String> {
    match (step, log) {
        (Some(_), Some(_)) => Err("give --step or --log, not both".into()),
        (None, None) => Err("--measured needs the measured step: --step SECONDS or --log FILE".into()),
        (Some(text), None) => {
            let trimmed = text.trim();
            let seconds = match trimmed.parse::<f64>() {
                Ok(v) => v,
                Err(_) => quantity(trimmed, Dimension::Time, "--step")?,
            };
            if !(seconds.is_finite() && seconds > 0.0) {
                return Err(format!("--step {text}: a step is a positive time"));
            }
            Ok(LogStep { step_s: seconds, source: format!("--step {trimmed}") })
        }
        (None, Some(path)) => {
            let size = std::fs::metadata(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?.len();
            if size > MAX_LOG {
                return Err(format!("{} has {size} bytes; a log is read up to {MAX_LOG}", path.display()));
            }
            let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            let text = String::from_utf8_lossy(&bytes);
            let figures = read_log(&text).map_err(|e| format!("{}: {e}", path.display()))?;
            let shown = path.display();
            match figures {
                LogFigures::StepSeconds { kind, values } => {
                    let s = steady(&values).ok_or_else(|| format!("{shown}: no positive step in the log"))?;
                    Ok(LogStep {
                        step_s: s,
                        source: format!(
                            "{shown}: median of {} iterations of {kind}",
                            values.len().saturating_sub(1).max(1)
                        ),
                    })
                }
                LogFigures::TokensPerDevice(values) => {
                    let tokens = tokens_per_step.ok_or_else(|| {
                        format!("{shown} reports tokens/s (torchtitan) and the spec's model is not a language model: give --step")
                    })?;
                    let tps = steady(&values).ok_or_else(|| format!("{shown}: no positive tps in the log"))?;
                    Ok(LogStep {
                        step_s: tokens / (tps * devices),
                        source: format!(
                            "{shown}: torchtitan's tps, median {tps:.1} tokens/s/device of {} iterations, × {devices} devices over {tokens} tokens a step",
                            values.len().saturating_sub(1).max(1)
                        ),
                    })
                }
            }
        }
    }
}

pub fn run(spec: &Path, step: Option<&str>, log: Option<&Path>, out: Option<PathBuf>) -> u8 {
    let source = match std::fs::read_to_string(spec) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: cannot read {}: {e}", spec.display());
            return EXIT_USAGE;
        }
    };
    let base = spec.parent().map(Path::to_path_buf);
    let checked = match StepSpec::check(&source, base.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {}: {e}", spec.display());
            return EXIT_DIAGNOSTICS;
        }
    };
    let measured = match measured_step(step, log, checked.tokens_per_step(), checked.devices() as f64) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}; nothing written");
            return EXIT_USAGE;
        }
    };
    let before = match checked.step(None) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}: {e}", spec.display());
            return EXIT_DIAGNOSTICS;
        }
    };
    let fitted =
        fit_efficiency_in(&[measured.step_s], checked.max_efficiency(), |e| checked.step(Some(e)).map(|s| vec![s]));
    let efficiency = match fitted {
        Ok(e) => e,
        Err(e) => {
            // a device file `pipec calibrate` measured holds this machine's rates at their
            // peak already: a faster run means the file was measured slow
            let hint = if checked.device().measured() && measured.step_s < before {
                "; the executor's work on a device file runs at most a third faster than `pipec calibrate` measured it on this machine, and this run was faster still: measure the device again (`pipec calibrate`, while the machine is otherwise idle)"
            } else {
                "; is the step of this spec's layout and batch?"
            };
            eprintln!(
                "error: the measured step of {:.4} s cannot be matched by this engine's kernel efficiency ({e}): pipec predicts {before:.4} s at its current figures{hint}; nothing written",
                measured.step_s
            );
            return EXIT_DIAGNOSTICS;
        }
    };
    let (family, _) = checked.kind();
    let device = checked.device();
    let file = CalibrationFile {
        format: CALIBRATION_FORMAT.into(),
        family,
        device: device.name.clone(),
        power: device.power,
        efficiency,
        measured: Measured {
            spec: spec.display().to_string(),
            step_s: measured.step_s,
            source: measured.source.clone(),
            predicted_before_s: before,
        },
    };
    let out = out.unwrap_or_else(|| PathBuf::from("calibration.json"));
    let text = match serde_json::to_string_pretty(&file) {
        Ok(t) => t + "\n",
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_DIAGNOSTICS;
        }
    };
    if let Err(e) = write_atomic(&out, text.as_bytes()) {
        eprintln!("error: {e}");
        return EXIT_DIAGNOSTICS;
    }
    println!(
        "{}: measured step {:.4} s ({}); pipec predicted {before:.4} s with {}'s kernel efficiency {:.4} on {}; fitted {efficiency:.4}",
        spec.display(),
        measured.step_s,
        measured.source,
        family.describe(),
        checked.efficiency().efficiency,
        pipec_plan::engine::performance::device_kind(device),
    );
    println!(
        "wrote {} — name it in specs of this engine on this device kind: `engine: {{ name: …, calibration: {} }}`",
        out.display(),
        out.display()
    );
    EXIT_OK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_logs_give_their_iterations() {
        let megatron = " [2026-05-01 10:00:00] iteration        1/     100 | consumed samples:          128 | elapsed time per iteration (ms): 15000.3 | learning rate: 1.0E-05 |\n \
                        [2026-05-01 10:00:09] iteration        2/     100 | consumed samples:          256 | elapsed time per iteration (ms): 9070.1 | throughput per GPU (TFLOP/s/GPU): 650.2 |\n \
                        [2026-05-01 10:00:18] iteration        3/     100 | consumed samples:          384 | elapsed time per iteration (ms): 9072.5 |\n";
        let LogFigures::StepSeconds { values, .. } = read_log(megatron).expect("megatron") else { panic!("kind") };
        assert_eq!(values, vec![15.0003, 9.0701, 9.0725]);
        assert_eq!(steady(&values), Some((9.0701 + 9.0725) / 2.0), "the first iteration set aside");
        let titan = "\u{1b}[31mstep:  1  \u{1b}[32mloss:  12.2  \u{1b}[33mmemory: 40.1GiB(42%)  \u{1b}[34mtps: 1,200  \u{1b}[36mtflops: 70  mfu: 7.1%\u{1b}[39m\n\
                     step: 10  loss:  9.1  memory: 45.0GiB(47%)  tps: 5,762  tflops: 334  mfu: 33.8%\n";
        assert_eq!(read_log(titan), Ok(LogFigures::TokensPerDevice(vec![1200.0, 5762.0])));
        let pipec = "{\"step\":1,\"loss\":2.3,\"step_time_s\":0.5,\"samples_per_s\":10}\n{\"step\":2,\"loss\":2.2,\"step_time_s\":0.25,\"samples_per_s\":20}\n";
        assert!(matches!(read_log(pipec), Ok(LogFigures::StepSeconds { values, .. }) if values == vec![0.5, 0.25]));
        assert!(read_log("hello\nworld\n").expect_err("no iteration").contains("no iteration"));
        assert!(read_log(&format!("{megatron}{titan}")).expect_err("mixed").contains("more than one engine"));
        assert_eq!(steady(&[]), None);
        assert_eq!(steady(&[3.0]), Some(3.0));
    }

    #[test]
    fn the_step_is_given_or_read_and_never_both() {
        assert_eq!(measured_step(Some("2.5"), None, None, 8.0).map(|m| m.step_s), Ok(2.5));
        assert_eq!(measured_step(Some("250ms"), None, None, 8.0).map(|m| m.step_s), Ok(0.25));
        assert!(measured_step(Some("-1"), None, None, 8.0).is_err());
        assert!(measured_step(Some("fast"), None, None, 8.0).is_err());
        assert!(measured_step(None, None, None, 8.0).is_err());
        assert!(measured_step(Some("1"), Some(Path::new("x.log")), None, 8.0).is_err());
    }
}
