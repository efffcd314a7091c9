//! The one diagnostic model of pipec. Every phase reports problems as [`Diagnostic`]s; this
//! module renders them for the terminal (miette), as JSON lines, and the language server
//! converts the same values to LSP diagnostics.

use std::fmt;

use crate::codes;
use crate::span::{LineIndex, Span};

/// How bad a diagnostic is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// A labelled span. The first label of a diagnostic is its primary one.
#[derive(Debug, Clone, PartialEq)]
pub struct Label {
    pub span: Span,
    pub message: String,
}

/// A machine-applicable fix: replace `span` with `replacement`, and each of `also`'s spans
/// with its text (one change in two places, e.g. a searched strategy and precision).
#[derive(Debug, Clone, PartialEq)]
pub struct Fix {
    pub title: String,
    pub span: Span,
    pub replacement: String,
    /// Further edits of the same fix, in spans apart from `span` and from each other.
    pub also: Vec<(Span, String)>,
}

impl Fix {
    /// Every edit of the fix, `span`'s first.
    pub fn edits(&self) -> Vec<(Span, String)> {
        std::iter::once((self.span, self.replacement.clone())).chain(self.also.iter().cloned()).collect()
    }

    /// `source` with the fix applied.
    pub fn apply(&self, source: &str) -> String {
        crate::span::splice(source, self.edits())
    }
}

/// One problem found in a spec.
#[derive(Debug, Clone, PartialEq)]
pub struct Diagnostic {
    /// Stable code, e.g. `E0102`; `pipec explain CODE` prints its explanation.
    pub code: &'static str,
    pub severity: Severity,
    pub message: String,
    /// Primary label first.
    pub labels: Vec<Label>,
    pub help: Option<String>,
    pub fix: Option<Fix>,
}

impl Diagnostic {
    /// An error with code `code` whose primary label is `label` at `span`.
    pub fn error(code: &'static str, message: impl Into<String>, span: Span, label: impl Into<String>) -> Self {
        debug_assert!(codes::lookup(code).is_some(), "unregistered diagnostic code {code}");
        Diagnostic {
            code,
            severity: Severity::Error,
            message: message.into(),
            labels: vec![Label { span, message: label.into() }],
            help: None,
            fix: None,
        }
    }

    /// A warning with code `code`.
    pub fn warning(code: &'static str, message: impl Into<String>, span: Span, label: impl Into<String>) -> Self {
        Diagnostic { severity: Severity::Warning, ..Diagnostic::error(code, message, span, label) }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    pub fn with_label(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label { span, message: message.into() });
        self
    }

    pub fn with_fix(mut self, title: impl Into<String>, span: Span, replacement: impl Into<String>) -> Self {
        self.fix = Some(Fix { title: title.into(), span, replacement: replacement.into(), also: Vec::new() });
        self
    }

    /// A fix of several edits (the first is the primary one); none when `edits` is empty.
    pub fn with_fix_edits(mut self, title: impl Into<String>, edits: Vec<(Span, String)>) -> Self {
        let mut edits = edits.into_iter();
        self.fix = edits.next().map(|(span, replacement)| Fix {
            title: title.into(),
            span,
            replacement,
            also: edits.collect(),
        });
        self
    }

    /// The primary span.
    pub fn span(&self) -> Span {
        self.labels.first().map(|l| l.span).unwrap_or_default()
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

/// Sorts diagnostics by position, then code, and drops exact duplicates.
pub fn sort_and_dedup(diags: &mut Vec<Diagnostic>) {
    diags.sort_by(|a, b| a.span().start.cmp(&b.span().start).then(a.code.cmp(b.code)).then(a.message.cmp(&b.message)));
    diags.dedup();
}

// ---------------------------------------------------------------------------------------
// Rendering
// ---------------------------------------------------------------------------------------

struct MietteView<'a> {
    diag: &'a Diagnostic,
    source: &'a miette::NamedSource<String>,
}

impl fmt::Debug for MietteView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diag.message)
    }
}

impl fmt::Display for MietteView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.diag.message)
    }
}

impl std::error::Error for MietteView<'_> {}

impl miette::Diagnostic for MietteView<'_> {
    fn code<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        Some(Box::new(self.diag.code))
    }
    fn severity(&self) -> Option<miette::Severity> {
        Some(match self.diag.severity {
            Severity::Error => miette::Severity::Error,
            Severity::Warning => miette::Severity::Warning,
        })
    }
    fn help<'b>(&'b self) -> Option<Box<dyn fmt::Display + 'b>> {
        self.diag.help.as_ref().map(|h| Box::new(h.clone()) as Box<dyn fmt::Display>)
    }
    fn source_code(&self) -> Option<&dyn miette::SourceCode> {
        Some(self.source)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = miette::LabeledSpan> + '_>> {
        Some(Box::new(self.diag.labels.iter().enumerate().map(|(i, l)| {
            let span = miette::SourceSpan::new(l.span.start.into(), l.span.len());
            let text = if l.message.is_empty() { None } else { Some(l.message.clone()) };
            if i == 0 {
                miette::LabeledSpan::new_primary_with_span(text, span)
            } else {
                miette::LabeledSpan::new_with_span(text, span)
            }
        })))
    }
}

/// Renders diagnostics as miette's graphical report, with colour or without.
pub fn render_human(file: &str, source: &str, diags: &[Diagnostic], color: bool) -> String {
    let named = miette::NamedSource::new(file, source.to_string());
    let theme = if color { miette::GraphicalTheme::unicode() } else { miette::GraphicalTheme::unicode_nocolor() };
    let handler = miette::GraphicalReportHandler::new_themed(theme).with_width(100).with_context_lines(1);
    let mut out = String::new();
    for d in diags {
        let view = MietteView { diag: d, source: &named };
        let mut one = String::new();
        if handler.render_report(&mut one, &view).is_err() {
            one = format!("{}[{}]: {}\n", d.severity.as_str(), d.code, d.message);
        }
        out.push_str(&one);
        out.push('\n');
    }
    out
}

/// One diagnostic as a JSON object (1-based lines and columns, byte offsets too).
pub fn to_json(file: &str, source: &str, index: &LineIndex, d: &Diagnostic) -> serde_json::Value {
    let labels: Vec<serde_json::Value> = d
        .labels
        .iter()
        .map(|l| {
            let s = index.line_col(source, l.span.start);
            let e = index.line_col(source, l.span.end);
            serde_json::json!({
                "label": l.message,
                "line": s.line,
                "column": s.column,
                "end_line": e.line,
                "end_column": e.column,
                "byte_start": l.span.start,
                "byte_end": l.span.end,
            })
        })
        .collect();
    let mut obj = serde_json::json!({
        "file": file,
        "code": d.code,
        "severity": d.severity.as_str(),
        "message": d.message,
        "help": d.help,
        "labels": labels,
    });
    if let (Some(fix), Some(map)) = (&d.fix, obj.as_object_mut()) {
        map.insert(
            "fix".into(),
            serde_json::json!({
                "title": fix.title,
                "byte_start": fix.span.start,
                "byte_end": fix.span.end,
                "replacement": fix.replacement,
                "edits": fix.edits().iter().map(|(span, text)| serde_json::json!({
                    "byte_start": span.start,
                    "byte_end": span.end,
                    "replacement": text,
                })).collect::<Vec<_>>(),
            }),
        );
    }
    obj
}

/// Renders diagnostics as JSON lines, one object per diagnostic.
pub fn render_json(file: &str, source: &str, diags: &[Diagnostic]) -> String {
    let index = LineIndex::new(source);
    let mut out = String::new();
    for d in diags {
        out.push_str(&to_json(file, source, &index, d).to_string());
        out.push('\n');
    }
    out
}

/// "did you mean" for `word` among `candidates` (Jaro-Winkler and edit distance).
pub fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut best: Option<(&str, f64)> = None;
    for c in candidates {
        let jw = strsim::jaro_winkler(&word.to_lowercase(), &c.to_lowercase());
        let lev = strsim::levenshtein(&word.to_lowercase(), &c.to_lowercase());
        let ok = jw > 0.8 || lev <= 2.max(word.len() / 3);
        if ok && best.is_none_or(|(_, s)| jw > s) {
            best = Some((c, jw));
        }
    }
    best.map(|(c, _)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(did_you_mean("microbatch", ["microbatches", "recompute"]), Some("microbatches"));
        assert_eq!(did_you_mean("shedule", ["stages", "schedule"]), Some("schedule"));
        assert_eq!(did_you_mean("zzz", ["stages", "schedule"]), None);
    }

    #[test]
    fn json_has_one_based_positions() {
        let src = "a: 1\nbb: 2\n";
        let d = Diagnostic::error("E0102", "unknown key `bb`", Span::new(5, 7), "here");
        let j = to_json("f.yaml", src, &LineIndex::new(src), &d);
        assert_eq!(j["labels"][0]["line"], 2);
        assert_eq!(j["labels"][0]["column"], 1);
        assert_eq!(j["labels"][0]["end_column"], 3);
    }

    /// A fix of several edits: the primary one first, each in JSON, applied together.
    #[test]
    fn a_fix_of_several_edits_is_applied_and_written_whole() {
        let src = "a: 1\nbb: 2\n";
        let d = Diagnostic::warning("W0606", "chosen", Span::new(3, 4), "here")
            .with_fix_edits("write both", vec![(Span::new(3, 4), "10".into()), (Span::new(9, 10), "20".into())]);
        let fix = d.fix.as_ref().expect("a fix");
        assert_eq!((fix.span, fix.replacement.as_str(), fix.also.len()), (Span::new(3, 4), "10", 1));
        assert_eq!(fix.apply(src), "a: 10\nbb: 20\n");
        let j = to_json("f.yaml", src, &LineIndex::new(src), &d);
        assert_eq!(j["fix"]["replacement"], "10");
        assert_eq!(j["fix"]["edits"].as_array().map(Vec::len), Some(2));
        assert_eq!(j["fix"]["edits"][1]["byte_start"], 9);
        assert_eq!(j["fix"]["edits"][1]["replacement"], "20");
        assert!(Diagnostic::warning("W0606", "chosen", Span::new(3, 4), "here")
            .with_fix_edits("none", vec![])
            .fix
            .is_none());
    }
}
