//! `pipec compare`: the spec compiled under every schedule, side by side. Each candidate is
//! the spec's text with its `schedule` value replaced, checked and compiled like any spec,
//! so a schedule that does not fit the strategy gets the same diagnostic `pipec check`
//! would give. Nothing is written.

use std::path::Path;

use pipec_compiler::render::human_time;
use pipec_compiler::{compile, CompileOptions, CompileResult};
use pipec_plan::vocab::{Choice, ScheduleKind};

use crate::check_cmd::read_spec;
use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// One row of the comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub schedule: String,
    /// The microbatch count compiled (the spec's own unless a sweep was asked for).
    pub microbatches: usize,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Planned(Prediction),
    /// The schedule does not apply; the first error says why.
    NotApplicable(String),
}

/// What the compiler predicts for a candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub step_s: f64,
    pub bubble: f64,
    pub throughput: f64,
    /// A language model's tokens per sample (its throughput in tokens is `throughput` times it).
    pub tokens_per_sample: Option<usize>,
    /// A language model's tokens/s per device.
    pub tokens_per_s_per_device: Option<f64>,
    /// A language model's model FLOPs utilization (`pipec_plan::flops`).
    pub mfu: Option<pipec_plan::flops::Mfu>,
    /// The tightest memory headroom over the devices.
    pub headroom: f64,
    /// Whether the schedule trains like one device.
    pub synchronous: bool,
    pub fits: bool,
    /// A flush-free pipeline's first step (its step time is then the steady state's).
    pub first_step_s: Option<f64>,
    /// The most weight versions a stage keeps alive at once (live + stashed).
    pub weight_versions: usize,
}

impl Prediction {
    /// What the numbers do not say: stale weights, no fit (short words for the hover).
    fn notes(&self, short: bool) -> String {
        let mut notes: Vec<String> = Vec::new();
        if !self.synchronous {
            notes.push(if short { "async" } else { "asynchronous (stale weights)" }.into());
        }
        if self.first_step_s.is_some() {
            notes.push(if short { "steady state" } else { "flush-free: steady-state step" }.into());
        }
        if self.weight_versions > 1 {
            notes.push(format!("{} weight versions", self.weight_versions));
        }
        if !self.fits {
            notes.push(if short { "does not fit" } else { "does not fit in memory" }.into());
        }
        notes.join(", ")
    }
}

/// The planned rows, those that fit first, each group fastest first.
fn fastest_first(rows: &[Row]) -> Vec<(&Row, &Prediction)> {
    let mut planned: Vec<(&Row, &Prediction)> = rows
        .iter()
        .filter_map(|r| match &r.outcome {
            Outcome::Planned(p) => Some((r, p)),
            Outcome::NotApplicable(_) => None,
        })
        .collect();
    planned.sort_by(|(_, a), (_, b)| (!a.fits).cmp(&!b.fits).then(a.step_s.total_cmp(&b.step_s)));
    planned
}

/// Compiles `source` under every candidate schedule, and with each of `microbatches` (the
/// spec's own count when empty). `Err` when the spec itself has errors, or a sweep is asked
/// for and the spec has no `microbatches` key to vary.
pub fn compare(
    source: &str,
    base_dir: Option<&Path>,
    profile: Option<pipec_plan::profile::Profile>,
    microbatches: &[usize],
) -> Result<Vec<Row>, Vec<pipec_grammar::Diagnostic>> {
    let checked = pipec_grammar::check_source_in(source, base_dir);
    let Some(spec) = checked.spec else {
        return Err(checked.diagnostics.into_iter().filter(|d| d.is_error()).collect());
    };
    let span = spec.strategy.schedule.span;
    let counts: Vec<usize> =
        if microbatches.is_empty() { vec![spec.strategy.microbatches] } else { microbatches.to_vec() };
    // the edits, in the order they appear in the text
    let mb_span = match (spec.strategy.microbatches_span, microbatches.is_empty()) {
        (Some(s), _) => Some(s),
        (None, true) => None,
        (None, false) => {
            return Err(vec![pipec_grammar::Diagnostic::error(
                "E0104",
                "a microbatch sweep needs a `microbatches` key to vary",
                spec.strategy.span,
                "in this strategy",
            )
            .with_help("add `microbatches: N` to the strategy")]);
        }
    };
    let options = CompileOptions { profile, base_dir: base_dir.map(Path::to_path_buf), ..CompileOptions::default() };
    let mut rows = Vec::new();
    for &count in &counts {
        // every schedule, as it would be written in a spec (with its default options)
        for candidate in ScheduleKind::ALL.iter().map(|k| k.name()) {
            let mut edits = vec![(span, candidate.to_string())];
            if let Some(m) = mb_span {
                edits.push((m, count.to_string()));
            }
            let text = pipec_grammar::splice(source, edits);
            let checked = pipec_grammar::check_source_in(&text, base_dir);
            let outcome = match checked.spec {
                None => {
                    let first = checked
                        .diagnostics
                        .iter()
                        .find(|d| d.is_error())
                        .map_or_else(|| "does not apply".to_string(), |d| d.message.clone());
                    Outcome::NotApplicable(first)
                }
                Some(spec) => match compile(&spec, &options) {
                    CompileResult { compiled: None, diagnostics } => Outcome::NotApplicable(
                        diagnostics.first().map_or_else(|| "does not compile".to_string(), |d| d.message.clone()),
                    ),
                    ref result @ CompileResult { compiled: Some(ref c), .. } => Outcome::Planned(Prediction {
                        step_s: c.plan.simulation.step_time_s,
                        bubble: c.plan.simulation.bubble_fraction,
                        throughput: c.plan.simulation.throughput_samples_per_s,
                        tokens_per_sample: c.plan.tokens_per_sample(),
                        tokens_per_s_per_device: c.plan.simulation.tokens_per_s_per_device,
                        mfu: c.plan.simulation.mfu.clone(),
                        headroom: c.plan.memory_headroom(),
                        synchronous: c.plan.schedule.synchronous,
                        fits: !result.has_errors(),
                        first_step_s: c.plan.simulation.first_step_time_s,
                        weight_versions: c.plan.schedule.weight_versions,
                    }),
                },
            };
            rows.push(Row { schedule: candidate.to_string(), microbatches: count, outcome });
        }
    }
    Ok(rows)
}

/// The comparison as a table, fastest feasible schedule first, the others after.
pub fn table(rows: &[Row]) -> String {
    // a language model's throughput in tokens too
    let language_model =
        rows.iter().any(|r| matches!(&r.outcome, Outcome::Planned(p) if p.tokens_per_sample.is_some()));
    // tokens/s, tokens/s per device and MFU
    let tokens = |p: Option<&Prediction>| match (language_model, p) {
        (false, _) => String::new(),
        (true, None) => format!(" {:>12} {:>12} {:>6}", "", "", ""),
        (true, Some(p)) => format!(
            " {:>12.0} {:>12.0} {:>6}",
            p.throughput * p.tokens_per_sample.unwrap_or(0) as f64,
            p.tokens_per_s_per_device.unwrap_or(0.0),
            p.mfu.as_ref().map_or_else(|| "—".to_string(), |m| format!("{:.1}%", m.fraction * 100.0))
        ),
    };
    let mut s = format!(
        "{:<42} {:>11} {:>7} {:>12}{} {:>9} {:>12}  {}\n",
        "schedule",
        "step",
        "bubble",
        "samples/s",
        if language_model { format!(" {:>12} {:>12} {:>6}", "tokens/s", "tokens/s/dev", "MFU") } else { String::new() },
        "headroom",
        "microbatches",
        "notes"
    );
    for (r, p) in fastest_first(rows) {
        s.push_str(&format!(
            "{:<42} {:>11} {:>6.1}% {:>12.1}{} {:>8.1}% {:>12}  {}\n",
            r.schedule,
            human_time(p.step_s),
            p.bubble * 100.0,
            p.throughput,
            tokens(Some(p)),
            p.headroom * 100.0,
            r.microbatches,
            p.notes(false)
        ));
    }
    for r in rows {
        if let Outcome::NotApplicable(why) = &r.outcome {
            s.push_str(&format!(
                "{:<42} {:>11} {:>7} {:>12}{} {:>9} {:>12}  {why}\n",
                r.schedule,
                "n/a",
                "",
                "",
                tokens(None),
                "",
                r.microbatches
            ));
        }
    }
    // what the MFU column counts, once (every row's model, device and engine are the spec's)
    if let Some(m) = rows.iter().find_map(|r| match &r.outcome {
        Outcome::Planned(p) => p.mfu.as_ref(),
        Outcome::NotApplicable(_) => None,
    }) {
        s.push_str(&format!("MFU: {}\n", m.basis_text()));
    }
    s
}

/// The comparison as a Markdown table (the language server's hover), fastest first.
pub fn markdown(rows: &[Row]) -> String {
    let mut s = String::from(
        "Other schedules (predicted):\n\n| schedule | step | bubble | headroom | |\n|---|---|---|---|---|\n",
    );
    for (r, p) in fastest_first(rows) {
        s.push_str(&format!(
            "| `{}` | {} | {:.1}% | {:.1}% | {} |\n",
            r.schedule,
            human_time(p.step_s),
            p.bubble * 100.0,
            p.headroom * 100.0,
            p.notes(true)
        ));
    }
    let others: Vec<String> = rows
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::NotApplicable(_)))
        .map(|r| format!("`{}`", r.schedule))
        .collect();
    if !others.is_empty() {
        s.push_str(&format!("\nNot applicable here: {}.", others.join(", ")));
    }
    s
}

/// The comparison as JSON lines, in the order the schedules were tried.
pub fn json_lines(rows: &[Row]) -> String {
    rows.iter()
        .map(|r| {
            let v = match &r.outcome {
                Outcome::Planned(p) => {
                    let mut v = serde_json::json!({
                        "schedule": r.schedule, "microbatches": r.microbatches, "step_time_s": p.step_s, "bubble_fraction": p.bubble,
                        "throughput_samples_per_s": p.throughput, "memory_headroom": p.headroom, "synchronous": p.synchronous, "fits": p.fits,
                        "weight_versions": p.weight_versions,
                    });
                    if let Some(seq) = p.tokens_per_sample {
                        v["throughput_tokens_per_s"] = (p.throughput * seq as f64).into();
                    }
                    if let Some(t) = p.tokens_per_s_per_device {
                        v["tokens_per_s_per_device"] = t.into();
                    }
                    if let Some(m) = &p.mfu {
                        v["mfu"] = serde_json::to_value(m).unwrap_or_default();
                    }
                    // a flush-free pipeline's figures are its steady state's
                    if let Some(first) = p.first_step_s {
                        v["steady_state"] = true.into();
                        v["first_step_time_s"] = first.into();
                    }
                    v
                }
                Outcome::NotApplicable(why) => serde_json::json!({"schedule": r.schedule, "microbatches": r.microbatches, "not_applicable": why}),
            };
            v.to_string() + "\n"
        })
        .collect()
}

pub fn run(path: &Path, profile: Option<&Path>, microbatches: &[usize], format: Format) -> u8 {
    let source = match read_spec(path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let profile = match profile.map(crate::compile_cmd::read_profile).transpose() {
        Ok(p) => p,
        Err(code) => return code,
    };
    let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match compare(&source, Some(base), profile, microbatches) {
        Ok(rows) => {
            match format {
                Format::Human => print!("{}", table(&rows)),
                Format::Json => print!("{}", json_lines(&rows)),
            }
            EXIT_OK
        }
        Err(diags) => {
            let name = path.display().to_string();
            eprint!("{}", pipec_grammar::diagnostic::render_human(&name, &source, &diags, false));
            eprintln!("{name}: fix these errors first (`pipec check`)");
            EXIT_DIAGNOSTICS
        }
    }
}
