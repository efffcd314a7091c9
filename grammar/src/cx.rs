//! The lowering context: the source, the schema, the diagnostics collected so far, and the
//! readers of scalar values (integers, floats, quantities with units, named choices, ...)
//! that every section's lowering uses. Each reader reports its own mistakes and returns None.

use pipec_plan::rules::{inside_output_folder, Bound};
use pipec_plan::vocab::Choice;

use crate::diagnostic::{did_you_mean, Diagnostic};
use crate::dsl::{self, Dimension, DslError, Rel};
use crate::schema::SchemaIndex;
use crate::span::Span;
use crate::yaml::{Node, Value};

/// A mapping node whose keys were checked against the schema.
pub(crate) struct Fields<'n> {
    pub(crate) entries: &'n [(Node, Node)],
    /// The span of the key that owns this mapping (for "missing key" labels).
    pub(crate) owner: Span,
}

impl<'n> Fields<'n> {
    pub(crate) fn get(&self, key: &str) -> Option<&'n Node> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }
    pub(crate) fn key_span(&self, key: &str) -> Option<Span> {
        self.entries.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(k, _)| k.span)
    }
}

pub(crate) struct Lower<'a> {
    pub src: &'a str,
    pub schema: &'a SchemaIndex,
    pub diags: Vec<Diagnostic>,
    /// The spec file's directory, when known: data paths are checked against it.
    pub base_dir: Option<&'a std::path::Path>,
    /// The last scalar whose string offsets were mapped to file offsets, and where its text
    /// starts in the file ([`text_start`]): a chain of many calls maps one offset per call,
    /// and comparing the scalar's text each time made a 240,000-layer chain quadratic.
    span_base: std::cell::Cell<Option<(Span, Option<usize>)>>,
}

impl<'a> Lower<'a> {
    pub(crate) fn new(src: &'a str, schema: &'a SchemaIndex) -> Self {
        Lower { src, schema, diags: Vec::new(), base_dir: None, span_base: std::cell::Cell::new(None) }
    }

    pub(crate) fn push(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    pub(crate) fn wrong_type(&mut self, node: &Node, expected: &str) {
        let found = node.value.kind_name();
        self.push(Diagnostic::error(
            "E0103",
            format!("expected {expected}, found {found}"),
            node.span,
            format!("expected {expected}"),
        ));
    }

    /// Checks that `node` is a mapping whose keys are all known at `path`.
    pub(crate) fn fields<'n>(&mut self, node: &'n Node, path: &[&str], owner: Span) -> Option<Fields<'n>> {
        let Some(entries) = node.as_map() else {
            let what = if path.is_empty() { "the spec".to_string() } else { format!("`{}`", path.join(".")) };
            let found = node.value.kind_name();
            let span = if node.span.is_empty() { owner } else { node.span };
            self.push(
                Diagnostic::error(
                    "E0103",
                    format!("{what} must be a mapping, found {found}"),
                    span,
                    "expected a mapping of keys",
                )
                .with_help(match self.schema.object_at(path) {
                    Some(doc) => {
                        format!("keys: {}", doc.keys.iter().map(|k| k.0.as_str()).collect::<Vec<_>>().join(", "))
                    }
                    None => "see docs/spec.md".into(),
                }),
            );
            return None;
        };
        let allowed = self.schema.object_at(path).unwrap_or_default();
        for (k, _) in entries {
            let Some(key) = k.as_str() else {
                self.push(Diagnostic::error(
                    "E0103",
                    format!("keys must be strings, found {}", k.value.kind_name()),
                    k.span,
                    "not a key name",
                ));
                continue;
            };
            if allowed.keys.iter().any(|(a, _)| a == key) {
                continue;
            }
            let where_ =
                if path.is_empty() { "at the top level".to_string() } else { format!("in `{}`", path.join(".")) };
            let mut d = Diagnostic::error("E0102", format!("unknown key `{key}` {where_}"), k.span, "unknown key");
            match did_you_mean(key, allowed.keys.iter().map(|(a, _)| a.as_str())) {
                Some(s) => {
                    d = d.with_help(format!("did you mean `{s}`?")).with_fix(format!("replace with `{s}`"), k.span, s);
                }
                None => {
                    let keys: Vec<&str> = allowed.keys.iter().map(|(a, _)| a.as_str()).collect();
                    d = d.with_help(format!("known keys {where_}: {}", keys.join(", ")));
                }
            }
            self.push(d);
        }
        Some(Fields { entries, owner })
    }

    /// A required key: reports E0104 at the owner when missing.
    pub(crate) fn required<'n>(&mut self, f: &Fields<'n>, key: &str, section: &str) -> Option<&'n Node> {
        let v = f.get(key);
        if v.is_none() {
            let doc = self.schema.doc_at(&[section, key]).or_else(|| {
                let path: Vec<&str> = section.split('.').chain(std::iter::once(key)).collect();
                self.schema.doc_at(&path)
            });
            let message = if section == "spec" {
                format!("the spec is missing the required section `{key}`")
            } else {
                format!("`{section}` is missing the required key `{key}`")
            };
            let mut d = Diagnostic::error("E0104", message, f.owner, format!("`{key}` is missing here"));
            if let Some(doc) = doc {
                d = d.with_help(format!("`{key}`: {}", first_sentence(&doc)));
            }
            self.push(d);
        }
        v
    }

    pub(crate) fn uint(&mut self, node: &Node, min: u64) -> Option<usize> {
        match &node.value {
            Value::Int(i) if *i >= min as i64 => usize::try_from(*i).ok(),
            Value::Int(i) => {
                self.push(Diagnostic::error(
                    "E0105",
                    format!("must be at least {min}, found {i}"),
                    node.span,
                    format!("must be ≥ {min}"),
                ));
                None
            }
            _ => {
                self.wrong_type(node, "an integer");
                None
            }
        }
    }

    /// A number within `bound` (the rule a plan file is held to as well, `pipec_plan::rules`).
    pub(crate) fn number(&mut self, node: &Node, bound: Bound) -> Option<f64> {
        let v = match &node.value {
            Value::Int(i) => *i as f64,
            Value::Float(f) => *f,
            _ => {
                self.wrong_type(node, "a number");
                return None;
            }
        };
        if !bound.admits(v) {
            let want = bound.describe();
            self.push(Diagnostic::error(
                "E0105",
                format!("must be {want}, found {v}"),
                node.span,
                format!("must be {want}"),
            ));
            return None;
        }
        Some(v)
    }

    pub(crate) fn boolean(&mut self, node: &Node) -> Option<bool> {
        match node.value {
            Value::Bool(b) => Some(b),
            _ => {
                self.wrong_type(node, "`true` or `false`");
                None
            }
        }
    }

    pub(crate) fn string<'n>(&mut self, node: &'n Node) -> Option<&'n str> {
        match &node.value {
            Value::Str(s) => Some(s),
            _ => {
                self.wrong_type(node, "a string");
                None
            }
        }
    }

    /// A path the run writes under its output folder (`pipec_plan::rules::inside_output_folder`):
    /// relative, no `..`; `code` is the diagnostic's code.
    pub(crate) fn output_path(&mut self, node: &Node, code: &'static str, example: &str) -> Option<String> {
        let text = self.string(node)?;
        match inside_output_folder(text) {
            Ok(()) => Some(text.to_string()),
            Err(e) => {
                self.push(
                    Diagnostic::error(code, format!("this path {e}"), node.span, "must stay inside the output folder")
                        .with_help(format!("pipec writes only inside the output folder (`-o`, default `out/<name>`); use a plain relative name like `{example}`")),
                );
                None
            }
        }
    }

    /// One of a fixed set of names (taken from the schema at `path`).
    pub(crate) fn choice(&mut self, node: &Node, path: &[&str]) -> Option<String> {
        let allowed: Vec<String> = self.schema.values_at(path).into_iter().map(|v| v.0).collect();
        let Some(text) = node.scalar_text().filter(|_| !matches!(node.value, Value::Seq(_) | Value::Map(_))) else {
            self.wrong_type(node, &format!("one of {}", quote_list(&allowed)));
            return None;
        };
        if allowed.contains(&text) {
            return Some(text);
        }
        let mut d = Diagnostic::error(
            "E0105",
            format!("`{text}` is not a valid `{}`", path.last().unwrap_or(&"value")),
            node.span,
            format!("expected one of {}", quote_list(&allowed)),
        );
        if let Some(s) = did_you_mean(&text, allowed.iter().map(String::as_str)) {
            d = d.with_help(format!("did you mean `{s}`?")).with_fix(format!("replace with `{s}`"), node.span, s);
        }
        self.push(d);
        None
    }

    /// Reads a named choice (schedule, precision, loss, ...): the value must be one of
    /// `C`'s spellings, which the schema at `path` lists (it is derived from `C`).
    pub(crate) fn choose<C: Choice>(&mut self, node: &Node, path: &[&str]) -> Option<C> {
        self.choice(node, path).and_then(|text| C::from_name(&text))
    }

    /// Maps a span relative to a DSL string to a file span.
    pub(crate) fn dsl_span(&self, node: &Node, rel: Rel) -> Span {
        let base = match self.span_base.get() {
            Some((span, base)) if span == node.span => base,
            _ => {
                let base = text_start(self.src, node);
                self.span_base.set(Some((node.span, base)));
                base
            }
        };
        span_at(node, base, rel)
    }

    pub(crate) fn dsl_error(&mut self, code: &'static str, node: &Node, e: &DslError, what: &str) {
        let span = self.dsl_span(node, (e.offset, e.offset + e.len));
        self.push(Diagnostic::error(
            code,
            format!("{what}: expected {}, found {}", e.expected, e.found),
            span,
            format!("expected {}", e.expected),
        ));
    }

    /// A quantity of the given dimension, in base units.
    pub(crate) fn quantity(&mut self, node: &Node, dim: Dimension, allow_zero: bool) -> Option<f64> {
        let text = match &node.value {
            Value::Str(s) => s.clone(),
            Value::Int(_) | Value::Float(_) => {
                self.push(
                    Diagnostic::error(
                        "E0201",
                        format!("`{}` has no unit", node.scalar_text().unwrap_or_default()),
                        node.span,
                        "missing unit",
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                return None;
            }
            _ => {
                self.wrong_type(node, dim.describe());
                return None;
            }
        };
        let q = match dsl::parse_quantity(&text) {
            Ok(q) => q,
            Err(e) => {
                let span = self.dsl_span(node, (e.offset, e.offset + e.len));
                self.push(
                    Diagnostic::error(
                        "E0201",
                        format!("malformed quantity `{text}`: expected {}", e.expected),
                        span,
                        format!("expected {}", e.expected),
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                return None;
            }
        };
        let unit_span = self.dsl_span(node, q.unit_span);
        match dsl::lookup_unit(&q.unit) {
            Some((d, factor)) if d == dim => {
                let v = q.number * factor;
                if v < 0.0 || (!allow_zero && v == 0.0) {
                    self.push(Diagnostic::error(
                        "E0203",
                        format!("{} must be larger than zero", dim.noun()),
                        node.span,
                        "out of range",
                    ));
                    return None;
                }
                Some(v)
            }
            Some((d, _)) => {
                self.push(
                    Diagnostic::error(
                        "E0202",
                        format!("expected {}, found {} `{}`", dim.noun(), d.noun(), q.unit),
                        unit_span,
                        format!("this is a unit of {}", d.noun()),
                    )
                    .with_help(format!("write {}", dim.describe())),
                );
                None
            }
            None => {
                let units = dsl::UNITS.iter().filter(|u| u.1 == dim).map(|u| u.0);
                let mut d = Diagnostic::error("E0201", format!("unknown unit `{}`", q.unit), unit_span, "unknown unit");
                // `gb/s`: bytes (`GB/s`) or bits (`Gb/s`), 8 times apart: name both, fix neither
                let cased: Vec<&str> = dsl::UNITS
                    .iter()
                    .filter(|u| u.1 == dim && u.0.eq_ignore_ascii_case(&q.unit))
                    .map(|u| u.0)
                    .collect();
                if cased.len() > 1 {
                    let named: Vec<String> = cased
                        .iter()
                        .map(|u| format!("`{u}` ({})", if u.contains('B') { "bytes" } else { "bits, 8 to a byte" }))
                        .collect();
                    self.push(d.with_help(format!("units are case-sensitive: did you mean {}?", named.join(" or "))));
                    return None;
                }
                match did_you_mean(&q.unit, units) {
                    Some(s) => {
                        d = d.with_help(format!("did you mean `{s}`?")).with_fix(
                            format!("replace with `{s}`"),
                            unit_span,
                            s,
                        )
                    }
                    None => d = d.with_help(format!("write {}", dim.describe())),
                }
                self.push(d);
                None
            }
        }
    }
}

/// Where a string scalar's text starts in the file: at its span's start when the file
/// spells it as is, one byte in when it is quoted without escapes; None when the text
/// differs from the file (escapes, folding), where offsets cannot be mapped.
fn text_start(src: &str, node: &Node) -> Option<usize> {
    #[cfg(test)]
    tests::SCANS.with(|n| n.set(n.get() + 1));
    let raw = src.get(node.span.range()).unwrap_or("");
    let text = node.as_str()?;
    if raw == text {
        Some(node.span.start)
    } else if raw.len() >= 2 && (raw.starts_with('"') || raw.starts_with('\'')) && &raw[1..raw.len() - 1] == text {
        Some(node.span.start + 1)
    } else {
        None
    }
}

/// Maps a span relative to a scalar's decoded text to a file span, given where that text
/// starts ([`text_start`]): exact when the source holds the text verbatim (plain or simply
/// quoted), else the whole scalar.
fn span_at(node: &Node, base: Option<usize>, rel: Rel) -> Span {
    let (Some(b), Some(text)) = (base, node.as_str()) else { return node.span };
    let len = rel.1.saturating_sub(rel.0).max(usize::from(rel.0 < text.len()));
    let len = if rel.0 < text.len() { len.min(text.len() - rel.0).max(1) } else { 0 };
    Span::new(b + rel.0, b + rel.0 + len)
}

pub(crate) fn first_sentence(doc: &str) -> String {
    let one_line = doc.replace('\n', " ");
    match one_line.find(". ") {
        Some(i) => one_line[..=i].to_string(),
        None => one_line,
    }
}

pub(crate) fn quote_list(items: &[String]) -> String {
    let q: Vec<String> = items.iter().map(|s| format!("`{s}`")).collect();
    match q.len() {
        0 => String::new(),
        1 => q[0].clone(),
        n => format!("{} or {}", q[..n - 1].join(", "), q[n - 1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// How many times a scalar's text was compared with the file ([`text_start`]).
        pub(super) static SCANS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn a_long_chain_is_scanned_once_not_once_per_call() {
        // mapping each call of a chain to the file compared the whole chain's text every
        // time: a 240,000-layer chain took 22 s to check, 480,000 more than 60 s
        let chain = vec!["linear(8, 8)"; 1000].join(" -> ");
        let src = format!("layers:\n  - {chain}\n");
        let root = crate::yaml::parse(&src).expect("yaml");
        let crate::yaml::Value::Map(entries) = &root.value else { panic!("a map") };
        let crate::yaml::Value::Seq(items) = &entries[0].1.value else { panic!("a list") };
        let node = &items[0];
        let schema = SchemaIndex::default();
        let cx = Lower::new(&src, &schema);
        SCANS.with(|n| n.set(0));
        let start = src.find("linear").expect("found");
        for k in 0..1000 {
            let at = k * "linear(8, 8) -> ".len();
            assert_eq!(cx.dsl_span(node, (at, at + 6)), Span::new(start + at, start + at + 6));
        }
        assert_eq!(SCANS.with(std::cell::Cell::get), 1);
    }
}
