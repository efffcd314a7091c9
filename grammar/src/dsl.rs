//! The small languages inside spec strings, parsed with nom + nom_locate:
//! layer chains (`linear(784, 1024) -> relu`), quantities with units (`16GiB`, `10Gbps`),
//! PipeDream strategy strings (`2-1-1`, `straight`) and partition ranges (`0..4`, `a..=b`).
//!
//! Every parser works on the string's own text and reports errors as offsets into it; the
//! caller shifts them to file offsets (see [`crate::spec`]), so an error lands under the
//! exact character.

use nom::branch::alt;
use nom::bytes::complete::{tag, take_while, take_while1};
use nom::character::complete::{char, digit1, multispace0};
use nom::combinator::{opt, recognize};
use nom::sequence::pair;
use nom::{IResult, Parser};
use nom_locate::LocatedSpan;

/// Input type of every DSL parser: the text plus its offset from the string's start.
pub type In<'a> = LocatedSpan<&'a str>;

/// A parse error inside a DSL string, relative to that string.
#[derive(Debug, Clone, PartialEq)]
pub struct DslError {
    /// Byte offset of the error in the string.
    pub offset: usize,
    /// Length of the offending text (at least one character where there is one).
    pub len: usize,
    /// What the parser wanted at that place.
    pub expected: String,
    /// What it found instead ("end of text" at the end).
    pub found: String,
}

impl DslError {
    fn at(input: In<'_>, expected: impl Into<String>) -> Self {
        let rest = input.fragment();
        let (len, found) = match rest.chars().next() {
            None => (0, "end of text".to_string()),
            Some(c) => {
                let word: String = if c.is_alphanumeric() || c == '_' {
                    rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '.').collect()
                } else {
                    c.to_string()
                };
                (word.len(), format!("`{word}`"))
            }
        };
        DslError { offset: input.location_offset(), len, expected: expected.into(), found }
    }
}

/// nom's error type for the DSL parsers: the position and what was expected there.
#[derive(Debug, Clone, PartialEq)]
pub struct PErr<'a> {
    input: In<'a>,
    expected: &'static str,
}

impl<'a> nom::error::ParseError<In<'a>> for PErr<'a> {
    fn from_error_kind(input: In<'a>, _kind: nom::error::ErrorKind) -> Self {
        PErr { input, expected: "" }
    }
    fn append(_input: In<'a>, _kind: nom::error::ErrorKind, other: Self) -> Self {
        other
    }
}

type PResult<'a, O> = IResult<In<'a>, O, PErr<'a>>;

/// Runs `p`; on failure reports "expected `what`" at the position `p` started from, unless a
/// deeper parser already said what it expected.
fn expect<'a, O>(
    mut p: impl Parser<In<'a>, Output = O, Error = PErr<'a>>,
    what: &'static str,
) -> impl FnMut(In<'a>) -> PResult<'a, O> {
    move |i: In<'a>| {
        p.parse(i)
            .map_err(|e| e.map(|err| if err.expected.is_empty() { PErr { input: i, expected: what } } else { err }))
    }
}

/// Turns a recoverable error into a failure (no backtracking past this point).
fn cut<'a, O>(mut p: impl FnMut(In<'a>) -> PResult<'a, O>) -> impl FnMut(In<'a>) -> PResult<'a, O> {
    move |i| match p(i) {
        Err(nom::Err::Error(e)) => Err(nom::Err::Failure(e)),
        other => other,
    }
}

fn ws(i: In<'_>) -> PResult<'_, In<'_>> {
    multispace0.parse(i)
}

fn ident(i: In<'_>) -> PResult<'_, In<'_>> {
    recognize(pair(
        take_while1(|c: char| c.is_ascii_alphabetic() || c == '_'),
        take_while(|c: char| c.is_ascii_alphanumeric() || c == '_'),
    ))
    .parse(i)
}

fn finish<'a, O>(res: PResult<'a, O>, what_next: &'static str) -> Result<O, DslError> {
    match res {
        Ok((rest, out)) => {
            let (rest, _) = ws(rest).map_err(|_| DslError::at(rest, what_next))?;
            if rest.fragment().is_empty() {
                Ok(out)
            } else {
                Err(DslError::at(rest, what_next))
            }
        }
        Err(nom::Err::Error(e)) | Err(nom::Err::Failure(e)) => {
            Err(DslError::at(e.input, if e.expected.is_empty() { what_next } else { e.expected }))
        }
        Err(nom::Err::Incomplete(_)) => {
            Err(DslError { offset: 0, len: 0, expected: what_next.into(), found: "end of text".into() })
        }
    }
}

// ---------------------------------------------------------------------------------------
// Layer chains
// ---------------------------------------------------------------------------------------

/// A span relative to the DSL string.
pub type Rel = (usize, usize);

fn rel(s: In<'_>) -> Rel {
    (s.location_offset(), s.location_offset() + s.fragment().len())
}

/// An argument value in a layer call.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgValue {
    Int(i64),
    Float(f64),
    Ident(String),
}

impl std::fmt::Display for ArgValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArgValue::Int(v) => write!(f, "{v}"),
            ArgValue::Float(v) => write!(f, "{v}"),
            ArgValue::Ident(v) => write!(f, "{v}"),
        }
    }
}

/// One argument: `1024` or `k=3`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arg {
    pub key: Option<(String, Rel)>,
    pub value: ArgValue,
    pub value_span: Rel,
    pub span: Rel,
}

/// One layer call: `conv2d(3, 64, k=3, pad=1) as stem`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCall {
    pub name: String,
    pub name_span: Rel,
    pub args: Vec<Arg>,
    /// `as NAME`: the label partitions can refer to.
    pub label: Option<(String, Rel)>,
    pub span: Rel,
}

/// A layer item: an optional `repeat N:` around a chain of calls joined by `->`.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerItem {
    pub repeat: Option<(u64, Rel)>,
    pub chain: Vec<LayerCall>,
}

fn number(i: In<'_>) -> PResult<'_, (ArgValue, In<'_>)> {
    let (rest, text) = recognize((
        opt(char('-')),
        digit1,
        opt(pair(char('.'), digit1)),
        opt((alt((char('e'), char('E'))), opt(alt((char('+'), char('-')))), digit1)),
    ))
    .parse(i)?;
    let s = *text.fragment();
    let v = if s.contains(['.', 'e', 'E']) {
        s.parse::<f64>().map(ArgValue::Float).ok()
    } else {
        s.parse::<i64>().map(ArgValue::Int).ok()
    };
    match v {
        Some(v) => Ok((rest, (v, text))),
        None => Err(nom::Err::Failure(PErr { input: i, expected: "a number that fits" })),
    }
}

fn arg_value(i: In<'_>) -> PResult<'_, (ArgValue, In<'_>)> {
    alt((number, |i| ident(i).map(|(r, t)| (r, (ArgValue::Ident(t.fragment().to_string()), t))))).parse(i)
}

fn arg(i: In<'_>) -> PResult<'_, Arg> {
    let start = i;
    // `key = value` or `value`
    let keyed = (ident, ws, char('='), ws).parse(i);
    let (i, key) = match keyed {
        Ok((rest, (k, _, _, _))) => (rest, Some((k.fragment().to_string(), rel(k)))),
        Err(_) => (i, None),
    };
    let (rest, (value, vtext)) = expect(arg_value, "an argument (a number, a name or key=value)")(i)?;
    let span = (start.location_offset(), rest.location_offset());
    Ok((rest, Arg { key, value, value_span: rel(vtext), span }))
}

fn args(i: In<'_>) -> PResult<'_, Vec<Arg>> {
    let (mut i, _) = (char('('), ws).parse(i)?;
    let mut out = Vec::new();
    if let Ok((rest, _)) = char::<In<'_>, PErr<'_>>(')').parse(i) {
        return Ok((rest, out));
    }
    loop {
        let (rest, a) = cut(arg)(i)?;
        out.push(a);
        let (rest, _) = ws(rest)?;
        if let Ok((rest, _)) = char::<In<'_>, PErr<'_>>(',').parse(rest) {
            let (rest, _) = ws(rest)?;
            i = rest;
            continue;
        }
        let (rest, _) = cut(expect(char(')'), "`,` or `)`"))(rest)?;
        return Ok((rest, out));
    }
}

fn layer_call(i: In<'_>) -> PResult<'_, LayerCall> {
    let start = i;
    let (i, name) = expect(ident, "a layer (e.g. `linear(784, 1024)` or `relu`)")(i)?;
    let (i, _) = ws(i)?;
    let (i, call_args) = if i.fragment().starts_with('(') { args(i)? } else { (i, Vec::new()) };
    let end_of_call = i;
    let (i2, _) = ws(i)?;
    let (i, label) = match (tag::<&str, In<'_>, PErr<'_>>("as"), take_while1(|c: char| c == ' ' || c == '\t')).parse(i2)
    {
        Ok((rest, _)) => {
            let (rest, l) = cut(expect(ident, "a layer label after `as`"))(rest)?;
            (rest, Some((l.fragment().to_string(), rel(l))))
        }
        Err(_) => (end_of_call, None),
    };
    let span = (start.location_offset(), i.location_offset());
    Ok((i, LayerCall { name: name.fragment().to_string(), name_span: rel(name), args: call_args, label, span }))
}

fn chain(i: In<'_>) -> PResult<'_, Vec<LayerCall>> {
    let (mut i, first) = layer_call(i)?;
    let mut out = vec![first];
    loop {
        let (rest, _) = ws(i)?;
        match tag::<&str, In<'_>, PErr<'_>>("->").parse(rest) {
            Ok((rest, _)) => {
                let (rest, _) = ws(rest)?;
                let (rest, call) = cut(layer_call)(rest)?;
                out.push(call);
                i = rest;
            }
            Err(_) => return Ok((i, out)),
        }
    }
}

fn repeat_prefix(i: In<'_>) -> PResult<'_, (u64, Rel)> {
    let (i, _) = (tag("repeat"), take_while1(|c: char| c == ' ' || c == '\t')).parse(i)?;
    let (i, n) = cut(expect(digit1, "a repeat count"))(i)?;
    let (i, _) = ws(i)?;
    let (i, _) = cut(expect(char(':'), "`:` after the repeat count"))(i)?;
    let (i, _) = ws(i)?;
    let count = n.fragment().parse::<u64>().unwrap_or(u64::MAX);
    Ok((i, (count, rel(n))))
}

/// Parses one layer item: `[repeat N:] call (-> call)*`.
pub fn parse_layer_item(text: &str) -> Result<LayerItem, DslError> {
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        let (i, repeat) = opt(repeat_prefix).parse(i)?;
        let (i, chain) = chain(i)?;
        Ok((i, LayerItem { repeat, chain }))
    })(i);
    finish(res, "`->` or the end of the layer chain")
}

/// Parses `repeat N` (the key of a `repeat N: ...` mapping item).
pub fn parse_repeat_key(text: &str) -> Option<Result<(u64, Rel), DslError>> {
    let t = text.trim_start();
    if !t.starts_with("repeat") {
        return None;
    }
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        let (i, _) = (tag("repeat"), take_while1(|c: char| c == ' ' || c == '\t')).parse(i)?;
        let (i, n) = cut(expect(digit1, "a repeat count"))(i)?;
        Ok((i, (n.fragment().parse::<u64>().unwrap_or(u64::MAX), rel(n))))
    })(i);
    Some(finish(res, "the end of `repeat N`"))
}

/// Parses a bare chain (the value of a `repeat N:` mapping item).
pub fn parse_chain(text: &str) -> Result<Vec<LayerCall>, DslError> {
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        chain(i)
    })(i);
    finish(res, "`->` or the end of the layer chain")
}

// ---------------------------------------------------------------------------------------
// Quantities with units
// ---------------------------------------------------------------------------------------

/// The physical dimension of a quantity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dimension {
    Bytes,
    Bandwidth,
    Time,
    FlopRate,
    Power,
}

impl Dimension {
    pub fn describe(self) -> &'static str {
        match self {
            Dimension::Bytes => "a size in bytes (e.g. `16GiB`, `80GB`)",
            Dimension::Bandwidth => "a bandwidth (e.g. `900GB/s`, `10Gbps`)",
            Dimension::Time => "a time (e.g. `5us`, `2ms`)",
            Dimension::FlopRate => "a compute throughput (e.g. `312TFLOP/s`)",
            Dimension::Power => "a power (e.g. `500W`)",
        }
    }
    pub fn noun(self) -> &'static str {
        match self {
            Dimension::Bytes => "a size",
            Dimension::Bandwidth => "a bandwidth",
            Dimension::Time => "a time",
            Dimension::FlopRate => "a compute throughput",
            Dimension::Power => "a power",
        }
    }
}

/// Every unit pipec knows: its spelling, dimension and factor to the base unit
/// (bytes, bytes/s, seconds, FLOP/s, watts).
pub const UNITS: &[(&str, Dimension, f64)] = &[
    ("B", Dimension::Bytes, 1.0),
    ("KB", Dimension::Bytes, 1e3),
    ("MB", Dimension::Bytes, 1e6),
    ("GB", Dimension::Bytes, 1e9),
    ("TB", Dimension::Bytes, 1e12),
    ("KiB", Dimension::Bytes, 1024.0),
    ("MiB", Dimension::Bytes, 1048576.0),
    ("GiB", Dimension::Bytes, 1073741824.0),
    ("TiB", Dimension::Bytes, 1099511627776.0),
    ("B/s", Dimension::Bandwidth, 1.0),
    ("KB/s", Dimension::Bandwidth, 1e3),
    ("MB/s", Dimension::Bandwidth, 1e6),
    ("GB/s", Dimension::Bandwidth, 1e9),
    ("TB/s", Dimension::Bandwidth, 1e12),
    ("KiB/s", Dimension::Bandwidth, 1024.0),
    ("MiB/s", Dimension::Bandwidth, 1048576.0),
    ("GiB/s", Dimension::Bandwidth, 1073741824.0),
    ("bps", Dimension::Bandwidth, 0.125),
    ("Kbps", Dimension::Bandwidth, 125.0),
    ("Mbps", Dimension::Bandwidth, 125e3),
    ("Gbps", Dimension::Bandwidth, 125e6),
    ("Tbps", Dimension::Bandwidth, 125e9),
    // bits per second as network cards are quoted (`200Gb/s` HDR InfiniBand): b is a bit
    ("Kb/s", Dimension::Bandwidth, 125.0),
    ("Mb/s", Dimension::Bandwidth, 125e3),
    ("Gb/s", Dimension::Bandwidth, 125e6),
    ("Tb/s", Dimension::Bandwidth, 125e9),
    ("Gbit/s", Dimension::Bandwidth, 125e6),
    ("ns", Dimension::Time, 1e-9),
    ("us", Dimension::Time, 1e-6),
    ("µs", Dimension::Time, 1e-6),
    ("ms", Dimension::Time, 1e-3),
    ("s", Dimension::Time, 1.0),
    ("FLOP/s", Dimension::FlopRate, 1.0),
    ("GFLOP/s", Dimension::FlopRate, 1e9),
    ("TFLOP/s", Dimension::FlopRate, 1e12),
    ("PFLOP/s", Dimension::FlopRate, 1e15),
    ("GFLOPS", Dimension::FlopRate, 1e9),
    ("TFLOPS", Dimension::FlopRate, 1e12),
    ("PFLOPS", Dimension::FlopRate, 1e15),
    ("W", Dimension::Power, 1.0),
    ("kW", Dimension::Power, 1e3),
];

/// A quantity split into its number and unit (relative spans into the string).
#[derive(Debug, Clone, PartialEq)]
pub struct RawQuantity {
    pub number: f64,
    pub number_span: Rel,
    pub unit: String,
    pub unit_span: Rel,
}

/// Parses `<number><unit>` with optional space between (`16GiB`, `1.5 TB/s`).
pub fn parse_quantity(text: &str) -> Result<RawQuantity, DslError> {
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        let (i, num) = expect(
            recognize((
                digit1,
                opt(pair(char('.'), digit1)),
                opt((alt((char('e'), char('E'))), opt(alt((char('+'), char('-')))), digit1)),
            )),
            "a number followed by a unit",
        )(i)?;
        let (i, _) = take_while(|c: char| c == ' ').parse(i)?;
        let (i, unit) = expect(take_while1(|c: char| c.is_alphabetic() || c == '/'), "a unit")(i)?;
        Ok((i, (num, unit)))
    })(i);
    let (num, unit) = finish(res, "the end of the quantity")?;
    let number = num.fragment().parse::<f64>().map_err(|_| DslError {
        offset: num.location_offset(),
        len: num.fragment().len(),
        expected: "a number".into(),
        found: format!("`{}`", num.fragment()),
    })?;
    Ok(RawQuantity { number, number_span: rel(num), unit: unit.fragment().to_string(), unit_span: rel(unit) })
}

/// Looks a unit up: its dimension and factor.
pub fn lookup_unit(unit: &str) -> Option<(Dimension, f64)> {
    UNITS.iter().find(|(u, _, _)| *u == unit).map(|(_, d, f)| (*d, *f))
}

// ---------------------------------------------------------------------------------------
// Strategy strings and partition ranges
// ---------------------------------------------------------------------------------------

/// A PipeDream configuration string: replicas per stage, or `straight`.
#[derive(Debug, Clone, PartialEq)]
pub enum StagesNotation {
    /// `2-1-1`: one entry per stage, the number of workers replicating it, with spans.
    Replicas(Vec<(u64, Rel)>),
    /// `straight`: one unreplicated stage per device.
    Straight,
}

/// Parses `2-1-1` or `straight`.
pub fn parse_stages(text: &str) -> Result<StagesNotation, DslError> {
    if text.trim() == "straight" {
        return Ok(StagesNotation::Straight);
    }
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        let (mut i, first) = expect(digit1, "a replica count (PipeDream notation like `2-1-1`) or `straight`")(i)?;
        let mut out = vec![first];
        loop {
            match char::<In<'_>, PErr<'_>>('-').parse(i) {
                Ok((rest, _)) => {
                    let (rest, n) = cut(expect(digit1, "a replica count after `-`"))(rest)?;
                    out.push(n);
                    i = rest;
                }
                Err(_) => return Ok((i, out)),
            }
        }
    })(i);
    let parts = finish(res, "`-` and the next stage's replica count")?;
    Ok(StagesNotation::Replicas(
        parts.iter().map(|p| (p.fragment().parse::<u64>().unwrap_or(u64::MAX), rel(*p))).collect(),
    ))
}

/// One end of a partition range: a layer index or a layer label.
#[derive(Debug, Clone, PartialEq)]
pub enum LayerRef {
    Index(u64),
    Name(String),
}

/// A stage's layers in an explicit partition: `3`, `head`, `0..4` (end excluded),
/// `2..=5` or `stem..=block3` (end included), `4..` (to the last layer).
#[derive(Debug, Clone, PartialEq)]
pub struct RangeExpr {
    pub start: (LayerRef, Rel),
    /// None for a single layer; Some((None, ..)) for an open end.
    pub end: Option<(Option<(LayerRef, Rel)>, bool)>,
}

fn layer_ref(i: In<'_>) -> PResult<'_, (LayerRef, Rel)> {
    alt((
        |i| {
            digit1(i).map(|(r, d): (In<'_>, In<'_>)| {
                (r, (LayerRef::Index(d.fragment().parse().unwrap_or(u64::MAX)), rel(d)))
            })
        },
        |i| ident(i).map(|(r, n): (In<'_>, In<'_>)| (r, (LayerRef::Name(n.fragment().to_string()), rel(n)))),
    ))
    .parse(i)
}

/// Parses a partition range expression.
pub fn parse_range(text: &str) -> Result<RangeExpr, DslError> {
    let i = In::new(text);
    let res = (|i| {
        let (i, _) = ws(i)?;
        let (i, start) = expect(layer_ref, "a layer index or label")(i)?;
        let (i, _) = ws(i)?;
        let dots: PResult<'_, In<'_>> = tag("..").parse(i);
        match dots {
            Err(_) => Ok((i, RangeExpr { start, end: None })),
            Ok((i, _)) => {
                let (i, inclusive) = opt(char('=')).parse(i)?;
                let (i, _) = ws(i)?;
                let (i, end) = if inclusive.is_some() {
                    let (i, e) = cut(expect(layer_ref, "the last layer of the range"))(i)?;
                    (i, Some(e))
                } else {
                    opt(layer_ref).parse(i)?
                };
                Ok((i, RangeExpr { start, end: Some((end, inclusive.is_some())) }))
            }
        }
    })(i);
    finish(res, "`..`, `..=` or the end of the range")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_with_args_labels_and_repeat() {
        let item = parse_layer_item("repeat 6: linear(1024, 1024, bias=false) -> relu as act").expect("parses");
        assert_eq!(item.repeat.map(|r| r.0), Some(6));
        assert_eq!(item.chain.len(), 2);
        assert_eq!(item.chain[0].name, "linear");
        assert_eq!(item.chain[0].args.len(), 3);
        assert_eq!(item.chain[0].args[2].key.as_ref().map(|k| k.0.as_str()), Some("bias"));
        assert_eq!(item.chain[1].label.as_ref().map(|l| l.0.as_str()), Some("act"));
    }

    #[test]
    fn errors_land_under_the_offending_character() {
        let e = parse_layer_item("linear(784, 1024 -> relu").expect_err("bad");
        assert_eq!(e.offset, 17);
        assert_eq!(e.expected, "`,` or `)`");
        let e = parse_layer_item("linear(784, 1024) relu").expect_err("bad");
        assert_eq!(e.offset, 18);
        let e = parse_stages("2-x-1").expect_err("bad");
        assert_eq!(e.offset, 2);
        let e = parse_layer_item("linear(784,) -> relu").expect_err("bad");
        assert_eq!(e.offset, 11);
    }

    #[test]
    fn quantities_split_number_and_unit() {
        let q = parse_quantity("1.5 TB/s").expect("parses");
        assert_eq!(q.number, 1.5);
        assert_eq!(q.unit, "TB/s");
        assert_eq!(lookup_unit(&q.unit), Some((Dimension::Bandwidth, 1e12)));
        assert_eq!(parse_quantity("16GiB").map(|q| q.unit_span), Ok((2, 5)));
        assert!(parse_quantity("GiB").is_err());
    }

    #[test]
    fn ranges() {
        let r = parse_range("stem..=block3").expect("parses");
        assert_eq!(r.start.0, LayerRef::Name("stem".into()));
        assert_eq!(r.end.as_ref().map(|e| e.1), Some(true));
        let r = parse_range("4..").expect("parses");
        assert_eq!(r.end, Some((None, false)));
        assert!(parse_range("4...5").is_err());
    }
}
