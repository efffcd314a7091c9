//! `pipec emit`: a spec's plan (compiled here) or a `plan.json` as another engine's launch
//! configuration, written as a new folder whole or not at all (the translation is
//! `pipec_plan::engine::emit`).

use std::path::Path;

use pipec_compiler::{compile, CompileOptions};
use pipec_plan::engine::EngineTarget;
use pipec_plan::vocab::Engine;
use pipec_plan::Plan;

use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

pub fn run(input: &Path, engine: Option<Engine>, out: &Path) -> u8 {
    let plan = match read_plan(input) {
        Ok(p) => p,
        Err((code, e)) => {
            eprintln!("error: {e}");
            return code;
        }
    };
    let target = match (engine, &plan.engine) {
        (Some(e), named) if named.name == e => named.clone(),
        (Some(e), _) => EngineTarget::newest(e),
        (None, named) if !named.is_pipec() => named.clone(),
        (None, _) => {
            eprintln!("error: `{}` names no engine: give --engine megatron, torchtitan or deepspeed", input.display());
            return EXIT_USAGE;
        }
    };
    let files = match pipec_plan::engine::emit::emit(&plan, &target) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_DIAGNOSTICS;
        }
    };
    let bytes: Vec<(String, Vec<u8>)> = files.into_iter().map(|(n, t)| (n, t.into_bytes())).collect();
    match pipec_plan::output::write_folder_atomic(out, &bytes) {
        Ok(()) => {
            let names: Vec<&str> = bytes.iter().map(|(n, _)| n.as_str()).collect();
            println!("wrote {} for {target}: {}", out.display(), names.join(", "));
            EXIT_OK
        }
        Err(e) => {
            eprintln!("error: {e}");
            EXIT_USAGE
        }
    }
}

/// The plan in `input`: a `plan.json` read as one, or a spec (`.yaml`/`.yml`) compiled
/// (its diagnostics printed when it does not check). Another extension is refused: a file
/// of one kind is never read as another.
fn read_plan(input: &Path) -> Result<Plan, (u8, String)> {
    let ext = input.extension().and_then(|e| e.to_str()).unwrap_or("");
    match ext {
        "json" => {
            let text = crate::check_cmd::read_text(input, crate::check_cmd::MAX_PLAN_BYTES, true)
                .map_err(|e| (EXIT_USAGE, e))?;
            let plan = Plan::from_json(&text).map_err(|e| (EXIT_USAGE, format!("`{}`: {e}", input.display())))?;
            let problems = plan.check();
            if let Some(p) = problems.first() {
                return Err((EXIT_USAGE, format!("`{}`: {p}", input.display())));
            }
            Ok(plan)
        }
        "yaml" | "yml" => {
            let source = crate::check_cmd::read_spec(input).map_err(|e| (EXIT_USAGE, e))?;
            let base = input.parent().map(Path::to_path_buf);
            let checked = pipec_grammar::check_source_in(&source, base.as_deref());
            let Some(spec) = checked.spec.filter(|_| !checked.diagnostics.iter().any(|d| d.is_error())) else {
                return Err((
                    EXIT_DIAGNOSTICS,
                    format!("`{}` does not check: run `pipec check {}`", input.display(), input.display()),
                ));
            };
            let options =
                CompileOptions { source: Some(source.as_str().into()), base_dir: base, ..CompileOptions::default() };
            let result = compile(&spec, &options);
            // a plan over a device's memory is still written out, with the compiler's word
            for d in result.diagnostics.iter().filter(|d| d.is_error()) {
                eprintln!("warning: pipec predicts this run does not fit ({}): {}", d.code, d.message);
            }
            result.into_compiled().map(|c| c.plan).map_err(|_| {
                (
                    EXIT_DIAGNOSTICS,
                    format!("`{}` does not compile: run `pipec compile {}`", input.display(), input.display()),
                )
            })
        }
        _ => Err((EXIT_USAGE, format!("`{}`: give a spec (.yaml) or a plan (plan.json)", input.display()))),
    }
}
