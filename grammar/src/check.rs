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

/// Checks a spec's source text.
pub fn check_source(source: &str) -> CheckResult {
    thread_local! {
        static SCHEMA: SchemaIndex = SchemaIndex::default();
    }
    SCHEMA.with(|schema| check_with_schema(source, schema))
}

fn check_with_schema(source: &str, schema: &SchemaIndex) -> CheckResult {
    let root = match yaml::parse(source) {
        Ok(root) => root,
        Err(e) => {
            return CheckResult {
                spec: None,
                diagnostics: vec![Diagnostic::error("E0101", format!("YAML syntax error: {}", e.message), e.span, "here").with_help("fix the YAML syntax; the rest of the spec is checked once it parses")],
            };
        }
    };
    let lowered = lower(source, &root, schema);
    let mut diagnostics = lowered.diagnostics;
    sort_and_dedup(&mut diagnostics);
    let has_errors = diagnostics.iter().any(Diagnostic::is_error);
    let spec = match (lowered.model, lowered.cluster, lowered.strategy, lowered.training) {
        (Some(model), Some(cluster), Some(strategy), Some(training)) if !has_errors => Some(Spec { name: lowered.name, model, cluster, strategy, training }),
        _ => None,
    };
    CheckResult { spec, diagnostics }
}
