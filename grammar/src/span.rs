//! Byte spans into a source file, and the line index that turns them into line/column.

use std::ops::Range;

/// A half-open byte range `start..end` into the spec's source text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub const fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }
    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A sub-span `offset..offset+len` relative to this span's start.
    pub fn sub(&self, offset: usize, len: usize) -> Span {
        let start = (self.start + offset).min(self.end.max(self.start));
        Span::new(start, (start + len).min(self.end.max(start + len)))
    }
}

/// A value with the span it was written at.
#[derive(Debug, Clone, PartialEq)]
pub struct Sp<T> {
    pub value: T,
    pub span: Span,
}

impl<T> Sp<T> {
    pub fn new(value: T, span: Span) -> Self {
        Sp { value, span }
    }
}

impl<T> std::ops::Deref for Sp<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

/// 1-based line/column position. Columns count Unicode scalar values (characters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineCol {
    pub line: usize,
    pub column: usize,
}

/// Maps byte offsets to lines and columns (in characters or in UTF-16 code units).
#[derive(Debug, Clone)]
pub struct LineIndex {
    line_starts: Vec<usize>,
}

impl LineIndex {
    pub fn new(source: &str) -> Self {
        let mut line_starts = vec![0];
        for (i, b) in source.bytes().enumerate() {
            if b == b'\n' {
                line_starts.push(i + 1);
            }
        }
        LineIndex { line_starts }
    }

    /// The 0-based line holding byte `offset`.
    fn line_of(&self, offset: usize) -> usize {
        match self.line_starts.binary_search(&offset) {
            Ok(l) => l,
            Err(l) => l - 1,
        }
    }

    /// 1-based line and character column of byte `offset` (clamped to the source).
    pub fn line_col(&self, source: &str, offset: usize) -> LineCol {
        let offset = clamp_to_char_boundary(source, offset);
        let line = self.line_of(offset);
        let start = self.line_starts[line];
        let column = source[start..offset].chars().count() + 1;
        LineCol { line: line + 1, column }
    }

    /// 0-based line and UTF-16 column of byte `offset`, as the Language Server Protocol wants.
    pub fn utf16_position(&self, source: &str, offset: usize) -> (u32, u32) {
        let offset = clamp_to_char_boundary(source, offset);
        let line = self.line_of(offset);
        let start = self.line_starts[line];
        let col: usize = source[start..offset].chars().map(char::len_utf16).sum();
        (u32::try_from(line).unwrap_or(u32::MAX), u32::try_from(col).unwrap_or(u32::MAX))
    }

    /// Byte offset of a 0-based line and UTF-16 column (clamped to the line's end).
    pub fn offset_of_utf16(&self, source: &str, line: u32, col: u32) -> usize {
        let line = line as usize;
        let Some(&start) = self.line_starts.get(line) else {
            return source.len();
        };
        let end = self.line_starts.get(line + 1).copied().unwrap_or(source.len());
        let mut units = 0u32;
        for (i, ch) in source[start..end].char_indices() {
            if units >= col || ch == '\n' {
                return start + i;
            }
            units += u32::try_from(ch.len_utf16()).unwrap_or(2);
        }
        end
    }
}

fn clamp_to_char_boundary(source: &str, offset: usize) -> usize {
    let mut o = offset.min(source.len());
    while !source.is_char_boundary(o) {
        o -= 1;
    }
    o
}

/// `source` with each span replaced by its text: the edits are made from the last span to
/// the first, so each span still means what it meant in `source` (spans must not overlap;
/// one past the end is clamped to it).
pub fn splice(source: &str, mut edits: Vec<(Span, String)>) -> String {
    edits.sort_by_key(|(s, _)| std::cmp::Reverse(s.start));
    let mut text = source.to_string();
    for (span, with) in edits {
        let (a, b) = (span.start.min(text.len()), span.end.min(text.len()));
        text.replace_range(a..b, &with);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spliced_spans_keep_their_meaning_in_any_order() {
        let src = "a: 1\nb: 22\n";
        let edits = vec![(Span::new(3, 4), "333".to_string()), (Span::new(8, 10), "4".to_string())];
        assert_eq!(splice(src, edits.clone()), "a: 333\nb: 4\n");
        assert_eq!(splice(src, edits.into_iter().rev().collect()), "a: 333\nb: 4\n");
        assert_eq!(splice(src, vec![(Span::new(8, 99), "x".to_string())]), "a: 1\nb: x");
    }

    #[test]
    fn line_columns_are_one_based_and_count_characters() {
        let src = "ab\nµx\n";
        let idx = LineIndex::new(src);
        assert_eq!(idx.line_col(src, 0), LineCol { line: 1, column: 1 });
        assert_eq!(idx.line_col(src, 3), LineCol { line: 2, column: 1 });
        // 'µ' is two bytes, one character
        assert_eq!(idx.line_col(src, 5), LineCol { line: 2, column: 2 });
        assert_eq!(idx.utf16_position(src, 5), (1, 1));
        assert_eq!(idx.offset_of_utf16(src, 1, 1), 5);
    }
}
