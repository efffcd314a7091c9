//! `pipec check`: static validation of spec files.

use std::path::{Path, PathBuf};

use pipec_grammar::diagnostic::{render_human, render_json};

use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// The largest spec file read (a spec of 10,000 layers is well below 1 MiB).
pub const MAX_SPEC_BYTES: u64 = 16 << 20;
/// The largest plan, profile or hostfile read: a plan's streams grow with devices ×
/// microbatches, and this bounds what a mistyped path (`/dev/zero`) can make pipec read.
pub const MAX_PLAN_BYTES: u64 = 1 << 30;

/// Reads a UTF-8 text file of at most `limit` bytes, with a one-line error on failure. A
/// file whose first bytes hold a NUL, or (for `json`) do not start a JSON value, is refused
/// before more is read.
pub fn read_text(path: &Path, limit: u64, json: bool) -> Result<String, String> {
    use std::io::Read;
    let shown = path.display();
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    if file.metadata().is_ok_and(|m| m.is_dir()) {
        return Err(format!("cannot read `{shown}`: it is a directory"));
    }
    let mut reader = file.take(limit + 1);
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = reader.read(&mut chunk).map_err(|e| format!("cannot read `{shown}`: {e}"))?;
        if n == 0 {
            break;
        }
        if bytes.is_empty() {
            let head = &chunk[..n];
            if head.contains(&0) {
                return Err(format!("cannot read `{shown}`: it is not a text file (it holds NUL bytes)"));
            }
            let first = head.iter().find(|b| !b.is_ascii_whitespace());
            if json && first.is_some_and(|b| !matches!(b, b'{' | b'[')) {
                return Err(format!("cannot read `{shown}`: it is not JSON"));
            }
        }
        bytes.extend_from_slice(&chunk[..n]);
    }
    if bytes.len() as u64 > limit {
        return Err(format!("cannot read `{shown}`: it is larger than {} MiB", limit >> 20));
    }
    String::from_utf8(bytes).map_err(|_| format!("cannot read `{shown}`: it is not UTF-8 text"))
}

/// Reads a spec file, with a one-line error on failure.
pub fn read_spec(path: &Path) -> Result<String, String> {
    read_text(path, MAX_SPEC_BYTES, false)
}

/// A clean spec whose strategy is written (no `auto` field, so no search runs) is planned
/// too (`pipec_compiler::check_plan`, one pipeline replica), and the plan-level diagnostics
/// are added to the front end's — a weight tied across stages under an asynchronous
/// schedule (E0411), a plan that does not fit in memory (E0601), the warnings about memory
/// and the bubble — so that `check` is clean exactly when `compile` has nothing to say that
/// needs no search.
pub fn with_plan_diagnostics(
    mut result: pipec_grammar::CheckResult,
    source: &str,
    base: &Path,
) -> pipec_grammar::CheckResult {
    let Some(spec) = result.spec.as_ref() else { return result };
    let options = pipec_compiler::CompileOptions {
        source: Some(source.into()),
        base_dir: Some(base.to_path_buf()),
        ..Default::default()
    };
    result.diagnostics.extend(pipec_compiler::check_plan(spec, &options));
    pipec_grammar::diagnostic::sort_and_dedup(&mut result.diagnostics);
    if result.has_errors() {
        result.spec = None;
    }
    result
}

pub fn run(files: &[PathBuf], format: Format, color: bool) -> u8 {
    let mut worst = EXIT_OK;
    for path in files {
        let source = match read_spec(path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                worst = EXIT_USAGE;
                continue;
            }
        };
        let name = path.display().to_string();
        let base = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let result = with_plan_diagnostics(pipec_grammar::check_source_in(&source, Some(base)), &source, base);
        match format {
            Format::Human => {
                if !result.diagnostics.is_empty() {
                    eprint!("{}", render_human(&name, &source, &result.diagnostics, color));
                }
                let errors = result.diagnostics.iter().filter(|d| d.is_error()).count();
                let warnings = result.diagnostics.len() - errors;
                if errors == 0 {
                    let size =
                        result.spec.as_ref().map(|s| format!(", {}", s.model.parameters_text())).unwrap_or_default();
                    println!(
                        "{name}: ok{size}{}",
                        if warnings > 0 { format!(" ({warnings} warning(s))") } else { String::new() }
                    );
                } else {
                    println!("{name}: {errors} error(s), {warnings} warning(s)");
                }
            }
            Format::Json => print!("{}", render_json(&name, &source, &result.diagnostics)),
        }
        if result.has_errors() && worst == EXIT_OK {
            worst = EXIT_DIAGNOSTICS;
        }
    }
    worst
}
