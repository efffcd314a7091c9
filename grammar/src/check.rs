//! The front end's entry point: source text in, spec and diagnostics out. Never panics and
//! never stops at the first problem.

use crate::diagnostic::{sort_and_dedup, Diagnostic};
use crate::schema::SchemaIndex;
use crate::spec::{lower, Spec};
use crate::yaml;

/// What checking a spec produced: the spec when it has no errors, and every diagnostic.
#[derive(Debug)]
pub struct CheckResult {
    pub spec: Option<Spec>,
    pub diagnostics: Vec<Diagnostic>,
}

impl CheckResult {
    pub fn has_errors(&self) -> bool {
        self.diagnostics.iter().any(Diagnostic::is_error)
    }
}

/// Checks a spec's source text (data paths are not checked: the file's place is unknown).
pub fn check_source(source: &str) -> CheckResult {
    check_source_in(source, None)
}

/// Checks a spec's source text; with `base_dir`, the spec's directory, the data files it
/// names must exist there.
pub fn check_source_in(source: &str, base_dir: Option<&std::path::Path>) -> CheckResult {
    thread_local! {
        static SCHEMA: SchemaIndex = SchemaIndex::default();
    }
    SCHEMA.with(|schema| check_with_schema(source, schema, base_dir))
}

fn check_with_schema(source: &str, schema: &SchemaIndex, base_dir: Option<&std::path::Path>) -> CheckResult {
    let root = match yaml::parse(source) {
        Ok(root) => root,
        Err(e) => {
            return CheckResult {
                spec: None,
                diagnostics: vec![Diagnostic::error(
                    "E0101",
                    format!("YAML syntax error: {}", e.message),
                    e.span,
                    "here",
                )
                .with_help("fix the YAML syntax; the rest of the spec is checked once it parses")],
            };
        }
    };
    let lowered = lower(source, &root, schema, base_dir);
    let mut diagnostics = lowered.diagnostics;
    sort_and_dedup(&mut diagnostics);
    let has_errors = diagnostics.iter().any(Diagnostic::is_error);
    let spec = match (lowered.model, lowered.cluster, lowered.strategy, lowered.training) {
        (Some(model), Some(cluster), Some(strategy), Some(training)) if !has_errors => {
            Some(Spec { name: lowered.name, engine: lowered.engine, model, cluster, strategy, training })
        }
        _ => None,
    };
    CheckResult { spec, diagnostics }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const EXAMPLE: &str = include_str!("../../specs/mlp-1f1b.yaml");
    const HYBRID: &str = include_str!("../../specs/hybrid.yaml");
    const INCEPTION: &str = include_str!("../../specs/inception.yaml");
    const RESNET: &str = include_str!("../../specs/resnet50.yaml");

    /// A spec with one random edit: a deleted range, an inserted string, a duplicated or
    /// swapped line.
    fn mutate(src: &str, kind: u8, at: usize, len: usize, text: &str) -> String {
        let mut s = src.to_string();
        let clamp = |i: usize, s: &str| {
            let mut i = i.min(s.len());
            while !s.is_char_boundary(i) {
                i -= 1;
            }
            i
        };
        match kind % 4 {
            0 => {
                let a = clamp(at, &s);
                let b = clamp(at + len, &s);
                s.replace_range(a..b, "");
            }
            1 => {
                let a = clamp(at, &s);
                s.insert_str(a, text);
            }
            2 => {
                let lines: Vec<&str> = src.lines().collect();
                let i = at % lines.len().max(1);
                let mut out: Vec<&str> = lines.clone();
                out.insert(i, lines[i]);
                s = out.join("\n");
            }
            _ => {
                let mut lines: Vec<&str> = src.lines().collect();
                let n = lines.len().max(1);
                lines.swap(at % n, (at + len) % n);
                s = lines.join("\n");
            }
        }
        s
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn mutated_specs_never_panic_and_errors_have_valid_spans(
            which in 0u8..4, kind in 0u8..4, at in 0usize..2000, len in 0usize..40,
            text in "[ -~\\n\\t:\\-\\[\\]{}\"'#&*!|>%@`µ]{0,12}",
        ) {
            // the graph specs exercise blocks, named tensors and joins
            let base = [EXAMPLE, HYBRID, INCEPTION, RESNET][which as usize];
            let src = mutate(base, kind, at, len, &text);
            let result = check_source(&src);
            for d in &result.diagnostics {
                for l in &d.labels {
                    prop_assert!(l.span.start <= l.span.end && l.span.end <= src.len(), "{} label {:?} outside {} bytes", d.code, l.span, src.len());
                    prop_assert!(src.is_char_boundary(l.span.start) && src.is_char_boundary(l.span.end));
                }
                prop_assert!(crate::codes::lookup(d.code).is_some());
            }
            // Rendering never panics either.
            let _ = crate::diagnostic::render_human("f.yaml", &src, &result.diagnostics, false);
            let _ = crate::diagnostic::render_json("f.yaml", &src, &result.diagnostics);
            prop_assert_eq!(result.spec.is_some(), !result.has_errors());
        }

        #[test]
        fn arbitrary_text_never_panics(src in "\\PC{0,300}") {
            let result = check_source(&src);
            for d in &result.diagnostics {
                for l in &d.labels {
                    prop_assert!(l.span.end <= src.len());
                }
            }
        }
    }
}
