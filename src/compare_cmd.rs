//! `pipec compare`: the spec compiled under every schedule, side by side. Each candidate is
//! the spec's text with its `schedule` value replaced, checked and compiled like any spec,
//! so a schedule that does not fit the strategy gets the same diagnostic `pipec check`
//! would give. Nothing is written.

use std::path::Path;

use pipec_compiler::render::human_time;
use pipec_compiler::{compile, CompileOptions};

use crate::check_cmd::read_spec;
use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The schedules tried, as they would be written in a spec.
const CANDIDATES: &[&str] = &["gpipe", "1f1b", "{ kind: interleaved, virtual_stages: 2 }", "zb-h1", "zbv", "chimera", "pipedream", "2bw", "dp-only"];

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
    /// Compiled: step time (s), bubble fraction, samples/s, tightest memory headroom,
    /// whether the schedule trains like one device, whether it fits in memory.
    Planned {
        step_s: f64,
        bubble: f64,
        throughput: f64,
        headroom: f64,
        synchronous: bool,
        fits: bool,
    },
    /// The schedule does not apply; the first error says why.
    NotApplicable(String),
}

/// Compiles `source` under every candidate schedule, and with each of `microbatches` (the
/// spec's own count when empty). `Err` when the spec itself has errors, or a sweep is asked
/// for and the spec has no `microbatches` key to vary.
pub fn compare(source: &str, base_dir: Option<&Path>, profile: Option<pipec_plan::profile::Profile>, microbatches: &[usize]) -> Result<Vec<Row>, Vec<pipec_grammar::Diagnostic>> {
    let checked = pipec_grammar::check_source_in(source, base_dir);
    let Some(spec) = checked.spec else {
        return Err(checked.diagnostics.into_iter().filter(|d| d.is_error()).collect());
    };
    let span = spec.strategy.schedule.span;
    let counts: Vec<usize> = if microbatches.is_empty() { vec![spec.strategy.microbatches] } else { microbatches.to_vec() };
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
    let options = CompileOptions {
        profile,
        base_dir: base_dir.map(Path::to_path_buf),
    };
    let mut rows = Vec::new();
    for &count in &counts {
        for candidate in CANDIDATES {
            let mut edits = vec![(span, (*candidate).to_string())];
            if let Some(m) = mb_span {
                edits.push((m, count.to_string()));
            }
            edits.sort_by_key(|(s, _)| std::cmp::Reverse(s.start));
            let mut text = source.to_string();
            for (s, with) in edits {
                text.replace_range(s.start..s.end, &with);
            }
            let checked = pipec_grammar::check_source_in(&text, base_dir);
            let outcome = match checked.spec {
                None => {
                    let first = checked.diagnostics.iter().find(|d| d.is_error()).map_or_else(|| "does not apply".to_string(), |d| d.message.clone());
                    Outcome::NotApplicable(first)
                }
                Some(spec) => match compile(&spec, &options) {
                    Err(diags) => Outcome::NotApplicable(diags.first().map_or_else(|| "does not compile".to_string(), |d| d.message.clone())),
                    Ok(c) => {
                        let p = &c.plan;
                        let headroom = p
                            .devices
                            .iter()
                            .filter(|d| d.memory.capacity > 0)
                            .map(|d| 1.0 - d.memory.total as f64 / d.memory.capacity as f64)
                            .fold(f64::INFINITY, f64::min);
                        Outcome::Planned {
                            step_s: p.simulation.step_time_s,
                            bubble: p.simulation.bubble_fraction,
                            throughput: p.simulation.throughput_samples_per_s,
                            headroom,
                            synchronous: p.schedule.synchronous,
                            fits: !c.has_errors(),
                        }
                    }
                },
            };
            rows.push(Row {
                schedule: (*candidate).to_string(),
                microbatches: count,
                outcome,
            });
        }
    }
    Ok(rows)
}

/// The comparison as a table, fastest feasible schedule first, the others after.
pub fn table(rows: &[Row]) -> String {
    let mut planned: Vec<&Row> = rows.iter().filter(|r| matches!(r.outcome, Outcome::Planned { .. })).collect();
    let key = |r: &Row| match r.outcome {
        Outcome::Planned { step_s, fits, .. } => (!fits, step_s),
        Outcome::NotApplicable(_) => (true, f64::INFINITY),
    };
    planned.sort_by(|a, b| {
        let (fa, sa) = key(a);
        let (fb, sb) = key(b);
        fa.cmp(&fb).then(sa.total_cmp(&sb))
    });
    let mut s = format!(
        "{:<42} {:>11} {:>7} {:>12} {:>9} {:>12}  {}\n",
        "schedule", "step", "bubble", "samples/s", "headroom", "microbatches", "notes"
    );
    for r in planned {
        if let Outcome::Planned {
            step_s,
            bubble,
            throughput,
            headroom,
            synchronous,
            fits,
        } = r.outcome
        {
            let mut notes = Vec::new();
            if !synchronous {
                notes.push("asynchronous (stale weights)");
            }
            if !fits {
                notes.push("does not fit in memory");
            }
            s.push_str(&format!(
                "{:<42} {:>11} {:>6.1}% {:>12.1} {:>8.1}% {:>12}  {}\n",
                r.schedule,
                human_time(step_s),
                bubble * 100.0,
                throughput,
                headroom * 100.0,
                r.microbatches,
                notes.join(", ")
            ));
        }
    }
    for r in rows {
        if let Outcome::NotApplicable(why) = &r.outcome {
            s.push_str(&format!("{:<42} {:>11} {:>7} {:>12} {:>9} {:>12}  {why}\n", r.schedule, "n/a", "", "", "", r.microbatches));
        }
    }
    s
}

/// The comparison as a Markdown table (the language server's hover), fastest first.
pub fn markdown(rows: &[Row]) -> String {
    let mut planned: Vec<(f64, String)> = Vec::new();
    let mut others = Vec::new();
    for r in rows {
        match &r.outcome {
            Outcome::Planned {
                step_s,
                bubble,
                headroom,
                synchronous,
                fits,
                ..
            } => {
                let mut notes = Vec::new();
                if !synchronous {
                    notes.push("async");
                }
                if !fits {
                    notes.push("does not fit");
                }
                planned.push((
                    if *fits { *step_s } else { f64::INFINITY },
                    format!(
                        "| `{}` | {} | {:.1}% | {:.1}% | {} |",
                        r.schedule,
                        human_time(*step_s),
                        bubble * 100.0,
                        headroom * 100.0,
                        notes.join(", ")
                    ),
                ));
            }
            Outcome::NotApplicable(_) => others.push(format!("`{}`", r.schedule)),
        }
    }
    planned.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut s = String::from("Other schedules (predicted):\n\n| schedule | step | bubble | headroom | |\n|---|---|---|---|---|\n");
    for (_, row) in planned {
        s.push_str(&row);
        s.push('\n');
    }
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
                Outcome::Planned {
                    step_s,
                    bubble,
                    throughput,
                    headroom,
                    synchronous,
                    fits,
                } => serde_json::json!({
                    "schedule": r.schedule, "microbatches": r.microbatches, "step_time_s": step_s, "bubble_fraction": bubble, "throughput_samples_per_s": throughput,
                    "memory_headroom": headroom, "synchronous": synchronous, "fits": fits,
                }),
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
    let profile = match profile.map(std::fs::read_to_string) {
        None => None,
        Some(Err(e)) => {
            eprintln!("error: cannot read the profile: {e}");
            return EXIT_USAGE;
        }
        Some(Ok(text)) => match serde_json::from_str(&text) {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!("error: not a pipec profile: {e}");
                return EXIT_USAGE;
            }
        },
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
