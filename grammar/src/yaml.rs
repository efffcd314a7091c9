//! A YAML document as a tree of nodes, each carrying the byte span it came from.
//!
//! The spec is not deserialised straight into typed structs: serde stops at the first
//! structural error, and pipec must report every mistake at once. So the loader reads the
//! document into this untyped, fully spanned tree (through `serde-saphyr`'s `Spanned`), and
//! [`crate::spec`] lowers the tree into the typed spec, collecting one diagnostic per problem.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;
use std::fmt;

use crate::span::Span;

/// One YAML node with its span in the source (byte offsets).
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    pub value: Value,
    pub span: Span,
}

/// The value of a node. Plain scalars are typed the way YAML 1.2's core schema types them;
/// quoted scalars are always strings.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Node, Node)>),
}

impl Value {
    /// The name of this value's kind, as used in "expected X, found Y" messages.
    pub fn kind_name(&self) -> &'static str {
        match self {
            Value::Null => "nothing (null)",
            Value::Bool(_) => "a boolean",
            Value::Int(_) => "an integer",
            Value::Float(_) => "a number",
            Value::Str(_) => "a string",
            Value::Seq(_) => "a list",
            Value::Map(_) => "a mapping",
        }
    }
}

impl Node {
    /// The value as a string when it is a scalar string.
    pub fn as_str(&self) -> Option<&str> {
        match &self.value {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The entries of a mapping node.
    pub fn as_map(&self) -> Option<&[(Node, Node)]> {
        match &self.value {
            Value::Map(m) => Some(m),
            _ => None,
        }
    }

    /// Text of a scalar as the user wrote it, for messages (`2` for an integer, `x` for a string).
    pub fn scalar_text(&self) -> Option<String> {
        match &self.value {
            Value::Bool(b) => Some(b.to_string()),
            Value::Int(i) => Some(i.to_string()),
            Value::Float(f) => Some(f.to_string()),
            Value::Str(s) => Some(s.clone()),
            Value::Null | Value::Seq(_) | Value::Map(_) => None,
        }
    }

    /// Largest end offset of this node and all its children (block containers report a
    /// zero-length span at their start, so their extent is computed from their children).
    fn extent_end(&self) -> usize {
        let mut end = self.span.end;
        match &self.value {
            Value::Seq(items) => {
                for n in items {
                    end = end.max(n.extent_end());
                }
            }
            Value::Map(entries) => {
                for (k, v) in entries {
                    end = end.max(k.extent_end()).max(v.extent_end());
                }
            }
            _ => {}
        }
        end
    }

    fn fix_container_spans(&mut self, source: &str) {
        let is_container = matches!(self.value, Value::Seq(_) | Value::Map(_));
        match &mut self.value {
            Value::Seq(items) => items.iter_mut().for_each(|n| n.fix_container_spans(source)),
            Value::Map(entries) => entries.iter_mut().for_each(|(k, v)| {
                k.fix_container_spans(source);
                v.fix_container_spans(source);
            }),
            _ => {}
        }
        let mut end = self.extent_end();
        // A flow container (`[1, 2]`, `{a: 1}`) ends at its closing bracket.
        let opener = source.as_bytes().get(self.span.start).copied();
        if is_container && matches!(opener, Some(b'[') | Some(b'{')) {
            let closer = if opener == Some(b'[') { b']' } else { b'}' };
            let rest = source.as_bytes().get(end..).unwrap_or(&[]);
            if let Some(i) = rest.iter().position(|c| !c.is_ascii_whitespace() && *c != b',') {
                if rest[i] == closer {
                    end += i + 1;
                }
            }
        }
        if let Value::Map(entries) = &self.value {
            if let Some((k, _)) = entries.first() {
                self.span.start = self.span.start.min(k.span.start);
            }
        }
        self.span.end = end.max(self.span.start);
    }
}

/// A YAML syntax error: message and where it happened.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntaxError {
    pub message: String,
    pub span: Span,
}

/// Parses a YAML document into a spanned tree. An empty document is a `Null` node.
pub fn parse(source: &str) -> Result<Node, SyntaxError> {
    if source.trim().is_empty() {
        return Ok(Node { value: Value::Null, span: Span::new(0, 0) });
    }
    let options = serde_saphyr::options! {};
    match serde_saphyr::from_str_with_options::<Node>(source, options) {
        Ok(mut node) => {
            node.fix_container_spans(source);
            Ok(node)
        }
        Err(e) => {
            let span = e
                .location()
                .and_then(|loc| span_of(&loc, source))
                .unwrap_or_else(|| Span::new(source.len(), source.len()));
            let render = serde_saphyr::render_options! { snippets: serde_saphyr::SnippetMode::Off };
            let mut message = e.render_with_options(render);
            // The plain rendering appends " at line L column C"; the label shows that already.
            if let Some(i) = message.find(" at line ") {
                message.truncate(i);
            }
            // Drop hints addressed to the YAML library's users rather than to spec authors.
            if let Some(i) = message.find(", set DuplicateKeyPolicy") {
                message.truncate(i);
            }
            let mut span = span;
            if message.starts_with("multiple YAML documents") {
                // at the `---` that starts the second document, not at its first key
                message = "a spec is one YAML document, and this file starts a second one here".into();
                if let Some(i) = source[..span.start.min(source.len())].rfind("---") {
                    span = Span::new(i, i + 3);
                }
            } else if message.contains("tabs")
                && span.start > 0
                && source.as_bytes().get(span.start - 1) == Some(&b'\t')
            {
                // at the tab itself
                span = Span::new(span.start - 1, span.start);
                message.push_str(" (indent with spaces)");
            }
            Err(SyntaxError { message, span })
        }
    }
}

/// Where an error's location is in `source`, in bytes. Events carry byte offsets; the
/// scanner's errors carry only a character index (and a line and column), which is mapped
/// to the byte it names. Without a location, None.
fn span_of(loc: &serde_saphyr::Location, source: &str) -> Option<Span> {
    let sp = loc.span();
    let (start, len) = match (sp.byte_offset(), sp.byte_len()) {
        (Some(b), len) => (usize::try_from(b).ok()?, usize::try_from(len.unwrap_or(0)).ok()?),
        (None, _) if loc.line() > 0 => {
            // the character index, counted in chars; the marker's line and column agree with it
            let chars = usize::try_from(sp.offset()).ok()?;
            let byte = source.char_indices().nth(chars).map_or(source.len(), |(b, _)| b);
            let width = source[byte..].chars().next().map_or(0, char::len_utf8);
            (byte, width)
        }
        (None, _) => return None,
    };
    let start = start.min(source.len());
    let end = (start + len).min(source.len());
    Some(Span::new(start, end))
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let spanned: Spanned<Value> = Spanned::deserialize(d)?;
        let sp = spanned.referenced.span();
        let start = sp.byte_offset().and_then(|o| usize::try_from(o).ok()).unwrap_or(0);
        let len = sp.byte_len().and_then(|o| usize::try_from(o).ok()).unwrap_or(0);
        Ok(Node { value: spanned.value, span: Span::new(start, start + len) })
    }
}

impl<'de> Deserialize<'de> for Value {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ValueVisitor)
    }
}

struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        Value::deserialize(d)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(i64::try_from(v).map(Value::Int).unwrap_or(Value::Float(v as f64)))
    }
    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Ok(i64::try_from(v).map(Value::Int).unwrap_or(Value::Float(v as f64)))
    }
    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        Ok(i64::try_from(v).map(Value::Int).unwrap_or(Value::Float(v as f64)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Ok(Value::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::Str(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::Str(v))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(n) = seq.next_element::<Node>()? {
            items.push(n);
        }
        Ok(Value::Seq(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut entries = Vec::new();
        while let Some(k) = map.next_key::<Node>()? {
            let v = map.next_value::<Node>()?;
            entries.push((k, v));
        }
        Ok(Value::Map(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_point_at_scalars_and_keys() {
        let src = "a: 1\nb:\n  c: \"x y\"\n  d: [1, 2]\n";
        let n = parse(src).expect("valid yaml");
        let m = n.as_map().expect("map");
        assert_eq!(&src[m[0].0.span.range()], "a");
        assert_eq!(&src[m[0].1.span.range()], "1");
        let inner = m[1].1.as_map().expect("inner map");
        assert_eq!(&src[inner[0].0.span.range()], "c");
        assert_eq!(&src[inner[0].1.span.range()], "\"x y\"");
        assert_eq!(inner[0].1.value, Value::Str("x y".into()));
        assert_eq!(&src[inner[1].1.span.range()], "[1, 2]");
        assert_eq!(m[1].1.span.end, src.len() - 1);
    }

    #[test]
    fn quoted_numbers_are_strings_and_plain_ones_ints() {
        let n = parse("a: \"211\"\nb: 211\nc: 2-1-1\n").expect("valid");
        let m = n.as_map().expect("map");
        assert_eq!(m[0].1.value, Value::Str("211".into()));
        assert_eq!(m[1].1.value, Value::Int(211));
        assert_eq!(m[2].1.value, Value::Str("2-1-1".into()));
    }

    #[test]
    fn syntax_errors_point_at_the_offending_token_not_the_end() {
        // (document, the 1-based line of the token at fault, its 1-based column)
        let cases = [
            ("a: [1, 2\nb: [3]\nc: 1\nd: 2\n", 2, 2),  // an unclosed flow list
            ("a: {x: 1\nb: 2\nc: 1\nd: 2\n", 2, 2),    // an unclosed flow mapping
            ("a:\n  b: 1\n c: 2\nd: 3\ne: 4\n", 3, 2), // a key indented less than its siblings
            ("a:\n\tb: 1\nc: 2\nd: 3\n", 2, 1),        // a tab as indentation
            ("a: \"x\nb: 2\nc: 3\nd: 4\n", 2, 1),      // an unterminated double-quoted string
            ("a: 'x\nb: 2\nc: 3\nd: 4\n", 2, 1),       // an unterminated single-quoted string
            ("a: x: y\nb: 1\nc: 2\n", 1, 5),           // a colon inside a plain value
            ("a: x\n- b\nc: 2\nd: 3\n", 2, 3),         // a list item among keys
            ("a: *nope\nb: 1\nc: 2\n", 1, 4),          // an alias to no anchor
            ("a: x\nbogus\nc: 2\nd: 3\n", 2, 1),       // a line with no colon
            ("a: x\nb: ]\nc: 2\nd: 3\n", 2, 4),        // a stray closing bracket
            ("a: x\n---\nb: 1\nc: 2\n", 2, 1),         // a second document
        ];
        for (src, line, column) in cases {
            let e = parse(src).expect_err(src);
            let index = crate::LineIndex::new(src);
            let crate::span::LineCol { line: l, column: c } = index.line_col(src, e.span.start);
            let last = src.lines().count();
            assert!(l < last, "{src:?}: {} located on the last line ({l}:{c})", e.message);
            assert_eq!((l, c), (line, column), "{src:?}: {}", e.message);
        }
    }

    #[test]
    fn syntax_errors_have_a_location() {
        let src = "a: [1, 2\nb: 3\n";
        let e = parse(src).expect_err("invalid");
        assert!(!e.message.is_empty());
        assert!(e.span.start <= src.len());
    }
}
