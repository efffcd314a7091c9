//! `pipec check`: static validation of spec files.

use std::path::{Path, PathBuf};

use pipec_grammar::diagnostic::{render_human, render_json};

use crate::{Format, EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

/// Reads a spec file, with a one-line error on failure.
pub fn read_spec(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    String::from_utf8(bytes).map_err(|_| format!("cannot read `{}`: it is not UTF-8 text", path.display()))
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
        let result = pipec_grammar::check_source_in(
            &source,
            Some(path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))),
        );
        match format {
            Format::Human => {
                if !result.diagnostics.is_empty() {
                    eprint!("{}", render_human(&name, &source, &result.diagnostics, color));
                }
                let errors = result.diagnostics.iter().filter(|d| d.is_error()).count();
                let warnings = result.diagnostics.len() - errors;
                if errors == 0 {
                    eprintln!(
                        "{name}: ok{}",
                        if warnings > 0 { format!(" ({warnings} warning(s))") } else { String::new() }
                    );
                } else {
                    eprintln!("{name}: {errors} error(s), {warnings} warning(s)");
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
