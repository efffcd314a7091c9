//! `pipec search`: every strategy of a spec's model on its cluster, ranked by the compiler's
//! prediction under memory (`pipec_compiler::search`); prints the best as a `strategy` to
//! paste, the runner-ups and why they lost.

use std::path::Path;

use pipec_compiler::search::{search, SearchOptions};
use pipec_compiler::CompileOptions;
use pipec_plan::vocab::ScheduleKind;

use crate::check_cmd::read_spec;
use crate::Format;
use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// What the user pins, from the command line.
pub struct SearchArgs<'a> {
    pub path: &'a Path,
    pub profile: Option<&'a Path>,
    pub allow_async: bool,
    pub max_depth: Option<usize>,
    pub headroom_percent: Option<f64>,
    pub schedules: &'a [String],
    pub top: usize,
    pub exact_top: bool,
    pub format: Format,
}

pub fn run(a: SearchArgs<'_>) -> u8 {
    let source = match read_spec(a.path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    if a.max_depth == Some(0) {
        eprintln!("error: --max-depth must be at least 1 (a pipeline has at least one stage)");
        return EXIT_USAGE;
    }
    if let Some(h) = a.headroom_percent.filter(|h| !(0.0..100.0).contains(h)) {
        eprintln!("error: --headroom must be a percentage in [0, 100), got {h}");
        return EXIT_USAGE;
    }
    let mut schedules = Vec::new();
    for name in a.schedules {
        match <ScheduleKind as pipec_plan::vocab::Choice>::from_name(name.as_str()) {
            Some(k) => schedules.push(k),
            None => {
                let names: Vec<&str> =
                    <ScheduleKind as pipec_plan::vocab::Choice>::ALL.iter().map(|k| k.name()).collect();
                eprintln!("error: unknown schedule `{name}` (one of: {})", names.join(", "));
                return EXIT_USAGE;
            }
        }
    }
    let profile = match a.profile.map(crate::compile_cmd::read_profile).transpose() {
        Ok(p) => p,
        Err(code) => return code,
    };
    let base = a.path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let checked = pipec_grammar::check_source_in(&source, Some(base));
    let Some(spec) = checked.spec else {
        let name = a.path.display().to_string();
        let errors: Vec<_> = checked.diagnostics.into_iter().filter(|d| d.is_error()).collect();
        eprint!("{}", pipec_grammar::diagnostic::render_human(&name, &source, &errors, false));
        eprintln!("{name}: fix these errors first (`pipec check`)");
        return EXIT_DIAGNOSTICS;
    };
    // an `auto` strategy's pinned fields and constraints, the flags over them
    let mut options = match &spec.strategy.auto {
        Some(auto) => SearchOptions::from_spec(&spec, auto),
        None => SearchOptions::for_precision_of(&spec),
    };
    options.synchronous_only &= !a.allow_async;
    options.max_pipeline_depth = a.max_depth.or(options.max_pipeline_depth);
    if let Some(h) = a.headroom_percent {
        options.headroom = h / 100.0;
    }
    if !schedules.is_empty() {
        options.schedules = Some(schedules);
    }
    if a.exact_top {
        options.ranked = a.top.max(1);
    }
    let compile_options = CompileOptions { profile, base_dir: Some(base.to_path_buf()), ..CompileOptions::default() };
    let report = search(&source, &spec, &compile_options, &options);
    match a.format {
        Format::Human => print!("{}", report.explain(&options, a.top)),
        Format::Json => println!("{}", report.to_json(&options, a.top)),
    }
    if !report.ranked(options.headroom).is_empty() {
        EXIT_OK
    } else {
        EXIT_DIAGNOSTICS
    }
}
