//! Training-data files — CSV and NPY — read and checked without Burn. The executor loads
//! them through here; `pipec check` reads the first bytes of the same files through the same
//! code, so a bad cell is reported before a run, with the spec's span, and never trains to
//! NaN. Every problem names the file and the line (CSV) or sample (NPY).

use std::io::Read;
use std::path::Path;

/// What the model needs from each sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    /// Input values per sample.
    pub numel: usize,
    /// The class count when targets are class indices (cross-entropy); None for regression.
    pub classes: Option<usize>,
    /// Target values per sample for regression (the model's output size).
    pub outputs: usize,
    /// The vocabulary when inputs are token ids (the first layer is an embedding).
    pub vocab: Option<usize>,
    /// Class labels per sample: 1, or a language model's sequence length (one next token
    /// per position).
    pub positions: usize,
}

impl Expect {
    /// What a model needs from its data.
    pub fn of(input: &[usize], output: &[usize], loss: crate::vocab::Loss, vocab: Option<usize>) -> Expect {
        let lm = crate::model::language_model_positions(input, output, vocab);
        let outputs: usize = output.iter().product();
        Expect {
            numel: input.iter().product(),
            classes: (loss == crate::vocab::Loss::CrossEntropy).then(|| if lm.is_some() { output[1] } else { outputs }),
            outputs,
            vocab,
            positions: lm.unwrap_or(1),
        }
    }

    pub fn targets_per_sample(&self) -> usize {
        if self.classes.is_some() {
            self.positions
        } else {
            self.outputs
        }
    }
}

/// Samples read from a file, sample-major.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Samples {
    pub inputs: Vec<f64>,
    pub targets: Vec<f64>,
    pub samples: usize,
}

/// How much of a file to read: all of it (training), or its first bytes (`pipec check`;
/// a cut last row is dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extent {
    All,
    Prefix(u64),
}

/// What a data file is, by its first bytes (its magic number): a file of one kind is never
/// read as another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed {
    /// `PAR1` (Apache Parquet).
    Parquet,
    /// `ARROW1` (an Arrow IPC file, Feather v2).
    ArrowFile,
    /// An Arrow IPC stream (`datasets`' `save_to_disk` `.arrow` files): a 0xFFFFFFFF
    /// continuation marker, then a message's length.
    ArrowStream,
    /// `\x93NUMPY`.
    Npy,
    /// JSON Lines: the first line is a JSON object.
    JsonLines,
    /// A gzip stream (`\x1f\x8b`).
    Gzip,
    /// A zip archive (`PK\x03\x04`: `.npz`, `.zip`).
    Zip,
}

impl Sniffed {
    /// The file's kind as a sentence names it.
    pub fn name(self) -> &'static str {
        match self {
            Sniffed::Parquet => "a Parquet file",
            Sniffed::ArrowFile => "an Arrow (Feather) file",
            Sniffed::ArrowStream => "an Arrow stream file (as `datasets` saves them)",
            Sniffed::Npy => "an NPY file",
            Sniffed::JsonLines => "a JSON Lines file",
            Sniffed::Gzip => "a gzip-compressed file",
            Sniffed::Zip => "a zip archive",
        }
    }

    /// What to write in the spec instead.
    pub fn advice(self) -> &'static str {
        match self {
            Sniffed::Parquet => "use `kind: parquet` with the text or token-id column's name (`column:`)",
            Sniffed::ArrowFile | Sniffed::ArrowStream => {
                "use `kind: arrow` with the text or token-id column's name (`column:`)"
            }
            Sniffed::Npy => "use `kind: tokens` (token ids) or `kind: npy` (features)",
            Sniffed::JsonLines => "use `kind: jsonl` with the text field's name (`field:`)",
            Sniffed::Gzip => "decompress it first (`gunzip`)",
            Sniffed::Zip => "unpack it first (an `.npz` holds `.npy` files)",
        }
    }
}

/// The kind a file's first bytes show, if they show one.
pub fn sniff(bytes: &[u8]) -> Option<Sniffed> {
    if bytes.starts_with(b"PAR1") {
        return Some(Sniffed::Parquet);
    }
    if bytes.starts_with(b"ARROW1") {
        return Some(Sniffed::ArrowFile);
    }
    if bytes.starts_with(&[0xff, 0xff, 0xff, 0xff]) && bytes.len() >= 8 {
        return Some(Sniffed::ArrowStream);
    }
    if bytes.starts_with(b"\x93NUMPY") {
        return Some(Sniffed::Npy);
    }
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return Some(Sniffed::Gzip);
    }
    if bytes.starts_with(b"PK\x03\x04") {
        return Some(Sniffed::Zip);
    }
    // JSON Lines: the first non-blank line is a whole JSON object
    let text = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(bytes);
    let start = text.iter().position(|b| !b.is_ascii_whitespace())?;
    if text[start] == b'{' {
        let line = text[start..].split(|&b| b == b'\n').next().unwrap_or_default();
        if matches!(serde_json::from_slice::<serde_json::Value>(line), Ok(serde_json::Value::Object(_))) {
            return Some(Sniffed::JsonLines);
        }
    }
    None
}

/// What a reader takes a file for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reading {
    Text,
    RawTokens,
    Npy,
    Csv,
}

impl Reading {
    /// The reader of a kind of token file.
    pub fn of(kind: &TokenFile) -> Reading {
        match kind {
            TokenFile::Text | TokenFile::Tokenized(_) => Reading::Text,
            TokenFile::Raw(_) => Reading::RawTokens,
            TokenFile::Npy => Reading::Npy,
        }
    }

    /// What the reader expects, as a sentence names it.
    pub fn name(self) -> &'static str {
        match self {
            Reading::Text => "a text file",
            Reading::RawTokens => "a raw token file",
            Reading::Npy => "an NPY file",
            Reading::Csv => "a CSV file",
        }
    }

    /// The kind a file's first bytes show when it is not one this reader takes.
    pub fn mismatch(self, bytes: &[u8]) -> Option<Sniffed> {
        sniff(bytes).filter(|k| !(self == Reading::Npy && *k == Sniffed::Npy))
    }
}

/// Refuses a file whose first bytes show another kind than `reading` takes, naming what it
/// is and what to write instead.
fn refuse_other_kind(bytes: &[u8], shown: &str, reading: Reading) -> Result<(), String> {
    match reading.mismatch(bytes) {
        Some(kind) => Err(format!("`{shown}` is {}, not {}: {}", kind.name(), reading.name(), kind.advice())),
        None => Ok(()),
    }
}

/// The kind a data file's first bytes show when `reading` does not take it (None for a
/// folder, a missing file or one that reads).
pub fn file_kind_mismatch(path: &Path, reading: Reading) -> Option<Sniffed> {
    let (bytes, _) = read_bytes(path, Extent::Prefix(4096)).ok()?;
    reading.mismatch(&bytes)
}

/// A folder where a file is expected, said as such.
pub fn folder_not_file(path: &Path, what: &str) -> String {
    format!("`{}` is a folder, not {what}", path.display())
}

fn read_bytes(path: &Path, extent: Extent) -> Result<(Vec<u8>, bool), String> {
    let shown = path.display();
    if path.is_dir() {
        return Err(folder_not_file(path, "a data file"));
    }
    let file = std::fs::File::open(path).map_err(|e| format!("cannot read the data file `{shown}`: {e}"))?;
    let mut bytes = Vec::new();
    let complete = match extent {
        Extent::All => {
            let mut f = file;
            f.read_to_end(&mut bytes).map_err(|e| format!("cannot read the data file `{shown}`: {e}"))?;
            true
        }
        Extent::Prefix(n) => {
            file.take(n + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| format!("cannot read the data file `{shown}`: {e}"))?;
            let complete = bytes.len() as u64 <= n;
            bytes.truncate(n as usize);
            complete
        }
    };
    Ok((bytes, complete))
}

/// Checks one sample's values against what the model needs; `at` says where it is.
fn check_sample(inputs: &[f64], targets: &[f64], expect: &Expect, at: &dyn Fn() -> String) -> Result<(), String> {
    for (j, &v) in inputs.iter().enumerate() {
        if !v.is_finite() {
            return Err(format!("{}: input value {} is {v}", at(), j + 1));
        }
        if let Some(vocab) = expect.vocab {
            if v.fract() != 0.0 || v < 0.0 || v >= vocab as f64 {
                return Err(format!("{}: token id {v} is not one of the vocabulary's 0..{vocab}", at()));
            }
        }
    }
    for &t in targets {
        match expect.classes {
            Some(classes) => {
                if !t.is_finite() || t.fract() != 0.0 {
                    return Err(format!("{}: the label {t} is not a class index (a whole number)", at()));
                }
                if t < 0.0 || t >= classes as f64 {
                    return Err(format!(
                        "{}: the label {t} is not one of the model's {classes} classes (0..{classes})",
                        at()
                    ));
                }
            }
            None if !t.is_finite() => return Err(format!("{}: the target value is {t}", at())),
            None => {}
        }
    }
    Ok(())
}

/// The delimiter of a CSV file: the most frequent of `,`, `;` and tab outside quotes on its
/// first data line (`,` when none appears).
fn sniff_delimiter(line: &str) -> char {
    let mut counts = [(',', 0usize), (';', 0), ('\t', 0)];
    let mut quoted = false;
    for c in line.chars() {
        if c == '"' {
            quoted = !quoted;
        } else if !quoted {
            if let Some(e) = counts.iter_mut().find(|e| e.0 == c) {
                e.1 += 1;
            }
        }
    }
    counts.iter().filter(|e| e.1 > 0).max_by_key(|e| e.1).map_or(',', |e| e.0)
}

/// The fields of one CSV line: split at `delimiter` outside double quotes, quotes removed
/// (`""` inside quotes is one quote), whitespace trimmed.
fn split_fields(line: &str, delimiter: char) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            '"' => quoted = !quoted,
            c if c == delimiter && !quoted => fields.push(std::mem::take(&mut field).trim().to_string()),
            c => field.push(c),
        }
    }
    fields.push(field.trim().to_string());
    fields
}

/// Reads a CSV file: one sample per row, its input values then its target(s); `,`, `;` or
/// tab separated, fields optionally double-quoted, lines starting with `#` ignored. The first
/// row is a header when none of its fields is a number; any other row must be all numbers.
pub fn load_csv(path: &Path, expect: &Expect, extent: Extent) -> Result<Samples, String> {
    let (bytes, complete) = read_bytes(path, extent)?;
    parse_csv(&bytes, complete, &path.display().to_string(), expect)
}

/// [`load_csv`] on a file's bytes (`complete` false: a prefix, whose cut last row is dropped).
pub fn parse_csv(bytes: &[u8], complete: bool, shown: &str, expect: &Expect) -> Result<Samples, String> {
    refuse_other_kind(bytes, shown, Reading::Csv)?;
    let text = match std::str::from_utf8(bytes) {
        Ok(t) => t,
        // a prefix may end inside a character
        Err(e) if !complete && e.error_len().is_none() => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or(""),
        Err(e) => return Err(format!("`{shown}` is not UTF-8 text (at byte {})", e.valid_up_to())),
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines: Vec<(usize, &str)> = text.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    if !complete {
        lines.pop(); // cut by the prefix
    }
    let per_row = expect.numel + expect.targets_per_sample();
    let mut out = Samples::default();
    let mut delimiter = None;
    let mut first = true;
    for (lineno, line) in lines {
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let d = *delimiter.get_or_insert_with(|| sniff_delimiter(trimmed));
        let fields = split_fields(trimmed, d);
        let parsed: Vec<Result<f64, String>> = fields.iter().map(|f| f.parse::<f64>().map_err(|_| f.clone())).collect();
        let is_first = std::mem::replace(&mut first, false);
        if is_first && parsed.iter().all(Result::is_err) {
            continue; // a header row of names
        }
        let mut values = Vec::with_capacity(per_row);
        for (k, p) in parsed.into_iter().enumerate() {
            match p {
                Ok(v) => values.push(v),
                Err(f) => return Err(format!("`{shown}` line {lineno}: field {} `{f}` is not a number", k + 1)),
            }
        }
        if values.len() != per_row {
            return Err(format!(
                "`{shown}` line {lineno}: {} fields, expected {} input value(s) and {} target(s) (separator `{}`)",
                values.len(),
                expect.numel,
                expect.targets_per_sample(),
                d.escape_default()
            ));
        }
        let (x, y) = values.split_at(expect.numel);
        check_sample(x, y, expect, &|| format!("`{shown}` line {lineno}"))?;
        out.inputs.extend_from_slice(x);
        out.targets.extend_from_slice(y);
        out.samples += 1;
    }
    if out.samples == 0 {
        return Err(format!("`{shown}` has no samples (rows of {per_row} numbers)"));
    }
    Ok(out)
}

/// An NPY element type pipec reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NpyKind {
    Float,
    Int,
}

/// An NPY array's header and (part of) its values.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    pub kind: NpyKind,
    /// The dtype as written (`<f4`, `|u1`, ...).
    pub descr: String,
    /// The values read (all of them, or those within a prefix).
    pub values: Vec<f64>,
}

/// Parses an NPY file's bytes (format 1.0–3.0, little-endian or single-byte integers and
/// floats, C order); with `complete` false the data may stop early.
pub fn parse_npy(bytes: &[u8], complete: bool, shown: &str) -> Result<NpyArray, String> {
    refuse_other_kind(bytes, shown, Reading::Npy)?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(format!("`{shown}` is not an NPY file (no \\x93NUMPY magic)"));
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        v => return Err(format!("`{shown}`: NPY format version {v} is not one pipec reads (1, 2, 3)")),
    };
    let header = bytes
        .get(start..start.saturating_add(header_len))
        .ok_or(format!("`{shown}`: the header says {header_len} bytes, the file has {}", bytes.len() - start))?;
    let header = std::str::from_utf8(header).map_err(|_| format!("`{shown}`: the header is not text"))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))?;
        Some(header[i + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    let descr = field("descr")
        .and_then(|d| d.strip_prefix('\''))
        .and_then(|d| d.split('\'').next())
        .ok_or(format!("`{shown}`: no dtype (`descr`) in the header"))?
        .to_string();
    if field("fortran_order").is_some_and(|f| f.starts_with("True")) {
        return Err(format!("`{shown}`: Fortran-ordered arrays are not supported (save with np.ascontiguousarray)"));
    }
    let shape_text = field("shape")
        .and_then(|s| s.strip_prefix('('))
        .and_then(|s| s.split(')').next())
        .ok_or(format!("`{shown}`: no shape in the header"))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|_| format!("`{shown}`: bad shape `({shape_text})`")))
        .collect::<Result<_, _>>()?;
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or(format!("`{shown}`: shape {shape:?} is too large"))?;
    let data = &bytes[start + header_len..];
    type Decode = fn(&[u8]) -> f64;
    let (kind, size, decode): (NpyKind, usize, Decode) = match descr.as_str() {
        "<f4" => (NpyKind::Float, 4, |c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        "<f8" => (NpyKind::Float, 8, |c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]])),
        "|i1" => (NpyKind::Int, 1, |c| f64::from(c[0] as i8)),
        "|u1" | "|b1" => (NpyKind::Int, 1, |c| f64::from(c[0])),
        "<i2" => (NpyKind::Int, 2, |c| f64::from(i16::from_le_bytes([c[0], c[1]]))),
        "<u2" => (NpyKind::Int, 2, |c| f64::from(u16::from_le_bytes([c[0], c[1]]))),
        "<i4" => (NpyKind::Int, 4, |c| f64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        "<u4" => (NpyKind::Int, 4, |c| f64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
        "<i8" => (NpyKind::Int, 8, |c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f64),
        "<u8" => (NpyKind::Int, 8, |c| u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]) as f64),
        other if other.starts_with('>') => {
            return Err(format!("`{shown}`: dtype `{other}` is big-endian; save with .astype('<{}')", &other[1..]))
        }
        other => {
            return Err(format!(
                "`{shown}`: dtype `{other}` is not supported (floats <f4/<f8, integers |u1 |i1 <i2 <u2 <i4 <u4 <i8 <u8)"
            ))
        }
    };
    let available = data.len() / size;
    if complete && available < n {
        return Err(format!("`{shown}`: truncated data ({available} of {n} values)"));
    }
    let values: Vec<f64> = data.chunks_exact(size).take(n).map(decode).collect();
    Ok(NpyArray { shape, kind, descr, values })
}

/// Reads an NPY file (see [`parse_npy`]).
pub fn read_npy(path: &Path, extent: Extent) -> Result<NpyArray, String> {
    let (bytes, complete) = read_bytes(path, extent)?;
    parse_npy(&bytes, complete, &path.display().to_string())
}

/// Reads NPY inputs (`(samples, ...)`) and labels (`(samples,)` class indices, or
/// `(samples, outputs)` regression targets).
pub fn load_npy(path: &Path, labels: Option<&Path>, expect: &Expect, extent: Extent) -> Result<Samples, String> {
    let shown = path.display();
    let x = read_npy(path, extent)?;
    let samples = x.shape.first().copied().unwrap_or(0);
    if samples == 0 || x.shape[1..].iter().product::<usize>() != expect.numel {
        return Err(format!(
            "`{shown}` has shape {:?}; the model needs (samples, ...) with {} values per sample",
            x.shape, expect.numel
        ));
    }
    let labels = labels.ok_or(format!("npy data needs a `labels` file beside `{shown}`"))?;
    let lshown = labels.display();
    let y = read_npy(labels, extent)?;
    let per = expect.targets_per_sample();
    if y.shape.first().copied() != Some(samples) || y.shape[1..].iter().product::<usize>() != per {
        return Err(format!(
            "`{lshown}` has shape {:?}; expected {samples} samples with {per} target(s) each",
            y.shape
        ));
    }
    if expect.classes.is_some() && y.kind == NpyKind::Float {
        return Err(format!(
            "`{lshown}` holds {} values; class labels are integers (save with .astype(np.int64))",
            y.descr
        ));
    }
    let read = (x.values.len() / expect.numel.max(1)).min(y.values.len() / per.max(1));
    for i in 0..read {
        let (xi, yi) = (&x.values[i * expect.numel..(i + 1) * expect.numel], &y.values[i * per..(i + 1) * per]);
        check_sample(xi, yi, expect, &|| format!("`{shown}` sample {i}"))?;
    }
    Ok(Samples {
        inputs: x.values[..read * expect.numel].to_vec(),
        targets: y.values[..read * per].to_vec(),
        samples: if extent == Extent::All { samples } else { read },
    })
}

/// Where a language model's token stream comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenFile {
    /// UTF-8 text, one token per character.
    Text,
    /// UTF-8 text cut into tokens by a Hugging Face `tokenizer.json` (BPE, Unigram,
    /// WordPiece; no special tokens added).
    Tokenized(std::path::PathBuf),
    /// Raw little-endian integers.
    Raw(crate::vocab::TokenDtype),
    /// A one-dimensional `.npy` array of integers.
    Npy,
}

/// The token ids of a file, each checked to be in `0..vocab`. Text files number their
/// distinct characters in code-point order; more distinct characters than `vocab` is an
/// error that says how large the vocabulary must be.
///
/// Text (`TokenFile::Text` or `Tokenized`) may also be a folder, whose `.txt` files are
/// read, or a pattern of file names (`corpus/*.txt`, `?` and `*` in the last part), each
/// in name order and joined with a newline between files.
pub fn load_tokens(path: &Path, kind: TokenFile, vocab: usize, extent: Extent) -> Result<Vec<u32>, String> {
    let text = matches!(kind, TokenFile::Text | TokenFile::Tokenized(_));
    let (bytes, complete) = match text_files(path)? {
        Some(files) if text => read_text_files(&files, extent)?,
        _ => read_bytes(path, extent)?,
    };
    parse_tokens(&bytes, complete, kind, vocab, &path.display().to_string())
}

/// Whether a text path names several files: a folder (its `.txt` files) or a pattern of
/// file names; None for a plain path. A folder or pattern with no file is an error.
pub fn text_files(path: &Path) -> Result<Option<Vec<std::path::PathBuf>>, String> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let (folder, pattern) = if path.is_dir() {
        (path.to_path_buf(), "*.txt".to_string())
    } else if name.contains(['*', '?']) {
        (path.parent().map_or_else(|| std::path::PathBuf::from("."), Path::to_path_buf), name.to_string())
    } else {
        return Ok(None);
    };
    let shown = path.display();
    let entries = std::fs::read_dir(&folder).map_err(|e| format!("cannot list `{}`: {e}", folder.display()))?;
    let mut files: Vec<std::path::PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| wildcard(&pattern, n)))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("`{shown}` names no text file (a folder's `*.txt`, or a pattern such as `corpus/*.txt`)"));
    }
    Ok(Some(files))
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters and `?`
/// for one.
fn wildcard(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // the classic two-pointer match with backtracking to the last star
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == '*')
}

/// Several text files' bytes, a newline between files, each checked to be text; with a
/// prefix, as many files as its bytes reach.
fn read_text_files(files: &[std::path::PathBuf], extent: Extent) -> Result<(Vec<u8>, bool), String> {
    let mut out = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let left = match extent {
            Extent::All => Extent::All,
            Extent::Prefix(n) if (out.len() as u64) < n => Extent::Prefix(n - out.len() as u64),
            Extent::Prefix(_) => return Ok((out, false)),
        };
        let (bytes, complete) = read_bytes(file, left)?;
        refuse_other_kind(&bytes, &file.display().to_string(), Reading::Text)?;
        if i > 0 {
            out.push(b'\n');
        }
        out.extend_from_slice(&bytes);
        if !complete {
            return Ok((out, false));
        }
    }
    Ok((out, true))
}

/// A JSON Lines file of records, each a JSON object whose `field` holds a string of text:
/// a language model's tokens are the records' texts one after the other, cut by
/// `tokenizer` (a `tokenizer.json`; without one, one token per character), with an
/// end-of-text token between records (`eot`, the tokenizer's token; by default the first of
/// its special tokens named like one — `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>`,
/// `[SEP]`; a newline between records without a tokenizer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Records {
    pub format: RecordFormat,
    pub path: std::path::PathBuf,
    /// The JSON field, or the Parquet or Arrow column, holding each record's text (or, for
    /// Parquet and Arrow, its token ids: a list of integers, taken as they are).
    pub field: String,
    pub tokenizer: Option<std::path::PathBuf>,
    pub eot: Option<String>,
}

/// How a file of records is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordFormat {
    /// JSON Lines: a JSON object per line.
    Jsonl,
    /// Apache Parquet (Snappy-compressed or not), read by the `parquet` crate.
    Parquet,
    /// Arrow IPC (a file, Feather v2, or a stream), or a `datasets` `save_to_disk` folder
    /// (`state.json`'s `data-*.arrow` files in order), read by the `arrow-ipc` crate.
    Arrow,
}

/// A column of records: their texts, or their token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Column {
    Texts(Vec<String>),
    Ids(Vec<Vec<u32>>),
}

/// The records' column (with a prefix, about as many bytes of it as the prefix).
pub fn load_records(records: &Records, extent: Extent) -> Result<Column, String> {
    match records.format {
        RecordFormat::Jsonl => load_jsonl(&records.path, &records.field, extent).map(Column::Texts),
        RecordFormat::Parquet => columnar::parquet(&records.path, &records.field, extent),
        RecordFormat::Arrow => columnar::arrow(&records.path, &records.field, extent),
    }
}

/// The special tokens taken for end-of-text, in order of preference.
const END_OF_TEXT: &[&str] = &["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]"];

/// The texts of a JSON Lines file's records (with a prefix, the whole lines it holds).
pub fn load_jsonl(path: &Path, field: &str, extent: Extent) -> Result<Vec<String>, String> {
    let (bytes, complete) = read_bytes(path, extent)?;
    let shown = path.display().to_string();
    match sniff(&bytes) {
        Some(Sniffed::JsonLines) | None => {}
        Some(other) => return Err(format!("`{shown}` is {}, not a JSON Lines file: {}", other.name(), other.advice())),
    }
    let text = match std::str::from_utf8(&bytes) {
        Ok(t) => t,
        Err(e) if !complete && e.error_len().is_none() => std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or(""),
        Err(e) => return Err(format!("`{shown}` is not UTF-8 text (byte {} is not valid UTF-8)", e.valid_up_to())),
    };
    let mut lines: Vec<(usize, &str)> = text.lines().enumerate().map(|(i, l)| (i + 1, l)).collect();
    if !complete {
        lines.pop(); // cut by the prefix
    }
    let mut records = Vec::new();
    for (n, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("`{shown}` line {n} is not a JSON object: {e}"))?;
        let serde_json::Value::Object(record) = value else {
            return Err(format!("`{shown}` line {n} is not a JSON object"));
        };
        match record.get(field) {
            Some(serde_json::Value::String(t)) => records.push(t.clone()),
            Some(other) => return Err(format!("`{shown}` line {n}: `{field}` holds {other}, not a string of text")),
            None => {
                let keys: Vec<String> = record.keys().map(|k| format!("`{k}`")).collect();
                return Err(format!(
                    "`{shown}` line {n} has no field `{field}` (it has {}): name the text's field with `field:`",
                    keys.join(", ")
                ));
            }
        }
    }
    if records.is_empty() {
        return Err(format!("`{shown}` holds no record"));
    }
    Ok(records)
}

/// The token ids of a JSON Lines file's records (see [`Records`]), each checked to be in
/// `0..vocab`.
pub fn load_record_tokens(records: &Records, vocab: usize, extent: Extent) -> Result<Vec<u32>, String> {
    let shown = records.path.display().to_string();
    let texts = match load_records(records, extent)? {
        Column::Texts(t) => t,
        // token ids as they are, one record after the other
        Column::Ids(rows) => {
            let ids: Vec<u32> = rows.concat();
            if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
                return Err(format!("`{shown}`: token {i} has id {id}, outside the model's vocabulary 0..{vocab}"));
            }
            return Ok(ids);
        }
    };
    let Some(path) = &records.tokenizer else {
        // one token per character, a newline between records
        let joined = texts.join("\n");
        return parse_tokens(joined.as_bytes(), true, TokenFile::Text, vocab, &shown);
    };
    let tokenizer = load_tokenizer(path)?;
    let size = tokenizer.get_vocab_size(true);
    if size > vocab {
        return Err(format!(
            "the tokenizer `{}` has {size} tokens, more than the model's vocabulary of {vocab}: make the embedding's vocabulary (and the output layer) at least {size}",
            path.display()
        ));
    }
    let eot = match &records.eot {
        Some(token) => tokenizer.token_to_id(token).ok_or_else(|| {
            format!("`eot: {token}` is not a token of the tokenizer `{}`", path.display())
        })?,
        None => END_OF_TEXT.iter().find_map(|t| tokenizer.token_to_id(t)).ok_or_else(|| {
            format!(
                "the tokenizer `{}` has none of the usual end-of-text tokens ({}): name the one to put between records with `eot:`",
                path.display(),
                END_OF_TEXT.join(", ")
            )
        })?,
    };
    let mut ids = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        if i > 0 {
            ids.push(eot);
        }
        let encoding = tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| format!("`{shown}` record {} does not tokenize: {e}", i + 1))?;
        ids.extend_from_slice(encoding.get_ids());
    }
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
        return Err(format!("`{shown}`: token {i} has id {id}, outside the model's vocabulary 0..{vocab}"));
    }
    Ok(ids)
}

/// Where the token ids of `records` are kept for training: a raw `uint32` token file in a
/// `.pipec-tokens` folder beside the data, named by a digest of what made it (the data
/// file's and the tokenizer's paths, sizes and modification times, the field and the
/// end-of-text token), so a changed input is read again. `pipec compile` and `pipec run`
/// write it ([`write_token_cache`]); the executor reads it as `kind: tokens` data.
pub fn token_cache(records: &Records) -> std::path::PathBuf {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    let mut stamp = |p: &Path| {
        h.update(p.display().to_string().as_bytes());
        if let Ok(m) = std::fs::metadata(p) {
            h.update(m.len().to_le_bytes());
            let modified = m.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            h.update(modified.map_or(0, |d| d.as_nanos()).to_le_bytes());
        }
    };
    stamp(&records.path);
    if let Some(t) = &records.tokenizer {
        stamp(t);
    }
    h.update([0, records.format as u8]);
    h.update(records.field.as_bytes());
    h.update([0]);
    h.update(records.eot.as_deref().unwrap_or("").as_bytes());
    let digest: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let stem = records.path.file_stem().and_then(|s| s.to_str()).unwrap_or("records");
    let folder = records.path.parent().unwrap_or(Path::new("."));
    folder.join(".pipec-tokens").join(format!("{stem}-{digest}.u32"))
}

/// Writes the token cache of `records` (whole, atomically) unless it is there already;
/// returns its path and, when it wrote it now, how many tokens it holds.
pub fn write_token_cache(records: &Records, vocab: usize) -> Result<(std::path::PathBuf, Option<usize>), String> {
    let cache = token_cache(records);
    if cache.is_file() {
        return Ok((cache, None));
    }
    let ids = load_record_tokens(records, vocab, Extent::All)?;
    let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
    crate::output::write_atomic(&cache, &bytes)?;
    Ok((cache, Some(ids.len())))
}

/// The largest `tokenizer.json` read (the largest published ones are tens of MiB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// A Hugging Face `tokenizer.json` file, read whole (at most [`MAX_TOKENIZER_BYTES`]).
pub fn load_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    let shown = path.display();
    let len = std::fs::metadata(path).map_err(|e| format!("cannot read the tokenizer `{shown}`: {e}"))?.len();
    if len > MAX_TOKENIZER_BYTES {
        return Err(format!("the tokenizer `{shown}` has {len} bytes, more than a tokenizer.json holds"));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read the tokenizer `{shown}`: {e}"))?;
    tokenizer_from_bytes(&bytes, &shown.to_string())
}

/// A `tokenizer.json`'s bytes as a tokenizer.
pub fn tokenizer_from_bytes(bytes: &[u8], shown: &str) -> Result<tokenizers::Tokenizer, String> {
    tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| format!("the tokenizer `{shown}` does not load: {e}"))
}

/// [`load_tokens`] on a file's bytes (`complete` false: a prefix, which may end inside a
/// character or a token).
pub fn parse_tokens(
    bytes: &[u8],
    complete: bool,
    kind: TokenFile,
    vocab: usize,
    shown: &str,
) -> Result<Vec<u32>, String> {
    let utf8 = || match std::str::from_utf8(bytes) {
        Ok(t) => Ok(t),
        // a prefix may end inside a character
        Err(e) if !complete && e.error_len().is_none() => {
            Ok(std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap_or_default())
        }
        Err(e) => Err(format!("`{shown}` is not UTF-8 text (byte {} is not valid UTF-8)", e.valid_up_to())),
    };
    refuse_other_kind(bytes, shown, Reading::of(&kind))?;
    let ids: Vec<u64> = match kind {
        TokenFile::Tokenized(tokenizer) => {
            let text = utf8()?;
            let t = load_tokenizer(&tokenizer)?;
            let size = t.get_vocab_size(true);
            if size > vocab {
                return Err(format!(
                    "the tokenizer `{}` has {size} tokens, more than the model's vocabulary of {vocab}: make the embedding's vocabulary (and the output layer) at least {size}",
                    tokenizer.display()
                ));
            }
            let encoding = t.encode(text, false).map_err(|e| format!("`{shown}` does not tokenize: {e}"))?;
            encoding.get_ids().iter().map(|&i| u64::from(i)).collect()
        }
        TokenFile::Text => {
            let text = utf8()?;
            let mut chars: Vec<char> = text.chars().collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            chars.sort_unstable();
            if chars.len() > vocab {
                return Err(format!(
                    "`{shown}` has {} distinct characters{}, more than the model's vocabulary of {vocab}: make the embedding's vocabulary (and the output layer) at least {}",
                    chars.len(),
                    if complete { "" } else { " in its first bytes" },
                    chars.len()
                ));
            }
            text.chars().map(|c| chars.binary_search(&c).unwrap_or(0) as u64).collect()
        }
        TokenFile::Raw(dtype) => {
            let width = match dtype {
                crate::vocab::TokenDtype::Uint16 => 2,
                crate::vocab::TokenDtype::Uint32 => 4,
            };
            if complete && !bytes.len().is_multiple_of(width) {
                return Err(format!(
                    "`{shown}` holds {} bytes, not a whole number of {dtype} tokens ({width} bytes each)",
                    bytes.len()
                ));
            }
            bytes
                .chunks_exact(width)
                .map(|c| {
                    if width == 2 {
                        u64::from(u16::from_le_bytes([c[0], c[1]]))
                    } else {
                        u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    }
                })
                .collect()
        }
        TokenFile::Npy => {
            let a = parse_npy(bytes, complete, shown)?;
            if a.shape.len() != 1 || a.kind != NpyKind::Int {
                return Err(format!(
                    "`{shown}` holds {} values of shape {:?}; token ids are a one-dimensional integer array",
                    a.descr, a.shape
                ));
            }
            let mut out = Vec::with_capacity(a.values.len());
            for (i, v) in a.values.iter().enumerate() {
                if *v < 0.0 {
                    return Err(format!("`{shown}`: token {i} is {v}, not a token id"));
                }
                out.push(*v as u64);
            }
            out
        }
    };
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, id)| **id >= vocab as u64) {
        return Err(format!(
            "`{shown}`: token {i} has id {id}, outside the model's vocabulary 0..{vocab} (the embedding's vocabulary must exceed every id)"
        ));
    }
    Ok(ids.into_iter().map(|v| v as u32).collect())
}

/// A token stream cut into a language model's samples: window k is tokens
/// `k·seq .. k·seq + seq` and its targets the same window shifted by one. A stream shorter
/// than one window (`seq + 1` tokens) is an error.
pub fn token_windows(tokens: &[u32], seq: usize, shown: &str) -> Result<Samples, String> {
    if seq == 0 || tokens.len() < seq + 1 {
        return Err(format!(
            "`{shown}` holds {} token(s), fewer than one window of {} (the sequence length {seq} and the next token)",
            tokens.len(),
            seq + 1
        ));
    }
    let samples = (tokens.len() - 1) / seq;
    let mut inputs = Vec::with_capacity(samples * seq);
    let mut targets = Vec::with_capacity(samples * seq);
    for k in 0..samples {
        inputs.extend(tokens[k * seq..k * seq + seq].iter().map(|&t| f64::from(t)));
        targets.extend(tokens[k * seq + 1..k * seq + seq + 1].iter().map(|&t| f64::from(t)));
    }
    Ok(Samples { inputs, targets, samples })
}

#[cfg(test)]
mod tests {

    /// tests/records: files pyarrow 24 wrote from specs/data/architecture.txt's 31
    /// paragraphs (`body`), and a `datasets` save_to_disk folder of two Arrow streams.
    fn records(format: RecordFormat, file: &str, field: &str) -> Records {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/records").join(file);
        Records { format, path, field: field.into(), tokenizer: None, eot: None }
    }

    #[test]
    fn parquet_arrow_and_datasets_folders_read_the_same_records() {
        let text =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../specs/data/architecture.txt"))
                .expect("text");
        let paragraphs: Vec<String> = text.split("\n\n").filter(|p| !p.trim().is_empty()).map(String::from).collect();
        assert_eq!(paragraphs.len(), 31);
        for (format, file) in [
            (RecordFormat::Parquet, "text.parquet"),
            (RecordFormat::Arrow, "text-uncompressed.feather"),
            (RecordFormat::Arrow, "dataset"),
        ] {
            let got = load_records(&records(format, file, "body"), Extent::All).expect(file);
            assert_eq!(got, Column::Texts(paragraphs.clone()), "{file}");
        }
        // a prefix stops after about as many bytes
        let Column::Texts(first) =
            load_records(&records(RecordFormat::Arrow, "dataset", "body"), Extent::Prefix(100)).expect("prefix")
        else {
            panic!("text")
        };
        assert!(!first.is_empty() && first.len() < 31, "{}", first.len());
        // token ids as a dataset holds them: list<int64>, taken as they are
        let ids = load_record_tokens(&records(RecordFormat::Parquet, "ids.parquet", "input_ids"), 512, Extent::All)
            .expect("ids");
        assert_eq!(ids.len(), 31 * 40);
        assert_eq!(&ids[..3], &[0, 1, 2]);
        let e = load_record_tokens(&records(RecordFormat::Parquet, "ids.parquet", "input_ids"), 100, Extent::All)
            .expect_err("outside the vocabulary");
        assert!(e.contains("outside the model's vocabulary 0..100"), "{e}");
        // a missing column is named with the ones there are; a compressed Arrow file says so
        let e = load_records(&records(RecordFormat::Parquet, "text.parquet", "text"), Extent::All).expect_err("column");
        assert!(
            e.contains(
                "has no column `text` (it has `body`, `source`): name the text's or token ids' column with `column:`"
            ),
            "{e}"
        );
        let e = load_records(&records(RecordFormat::Arrow, "text.feather", "body"), Extent::All).expect_err("lz4");
        assert!(e.contains("text.feather") && e.to_lowercase().contains("lz4"), "{e}");
    }

    #[test]
    fn json_lines_records_become_one_token_stream_with_a_separator_between_records() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("train.jsonl");
        std::fs::write(&path, "{\"text\": \"ab\", \"id\": 1}\n\n{\"text\": \"ba\"}\n").expect("write");
        let records = Records {
            format: RecordFormat::Jsonl,
            path: path.clone(),
            field: "text".into(),
            tokenizer: None,
            eot: None,
        };
        assert_eq!(load_jsonl(&path, "text", Extent::All).expect("records"), vec!["ab", "ba"]);
        // characters in code-point order ('\n' a b), a newline between records
        assert_eq!(load_record_tokens(&records, 8, Extent::All).expect("tokens"), vec![1, 2, 0, 2, 1]);
        let e = load_jsonl(&path, "body", Extent::All).expect_err("no such field");
        assert!(
            e.contains("line 1 has no field `body` (it has `id`, `text`): name the text's field with `field:`"),
            "{e}"
        );
        std::fs::write(&path, "{\"text\": 3}\n").expect("write");
        assert!(load_jsonl(&path, "text", Extent::All).expect_err("a number").contains("`text` holds 3, not a string"));
        // the cache is named by what made it, and written once
        std::fs::write(&path, "{\"text\": \"ab\"}\n").expect("write");
        let (cache, written) = write_token_cache(&records, 8).expect("cache");
        assert_eq!(written, Some(2));
        assert!(cache.starts_with(dir.path().join(".pipec-tokens")), "{}", cache.display());
        assert_eq!(write_token_cache(&records, 8).expect("cached"), (cache.clone(), None));
        let other = Records { field: "body".into(), ..records.clone() };
        assert_ne!(token_cache(&other), cache);
        let ids = load_tokens(&cache, TokenFile::Raw(crate::vocab::TokenDtype::Uint32), 8, Extent::All).expect("raw");
        assert_eq!(ids, vec![0, 1]);
    }

    #[test]
    fn a_file_of_one_kind_is_never_read_as_another() {
        let lm = TokenFile::Raw(crate::vocab::TokenDtype::Uint16);
        let parquet = b"PAR1\x15\x04\x15\x80\x01rest of a parquet file";
        let e = parse_tokens(parquet, true, lm.clone(), 128_256, "train.parquet").expect_err("parquet as tokens");
        assert_eq!(
            e,
            "`train.parquet` is a Parquet file, not a raw token file: use `kind: parquet` with the text or token-id column's name (`column:`)"
        );
        let jsonl = b"{\"text\": \"hello\"}\n{\"text\": \"world\"}\n";
        let e = parse_tokens(jsonl, true, TokenFile::Text, 256, "train.jsonl").expect_err("jsonl as text");
        assert!(e.contains("is a JSON Lines file, not a text file: use `kind: jsonl`"), "{e}");
        let arrow = b"\xff\xff\xff\xff\x78\x00\x00\x00\x10\x00";
        let e = parse_tokens(arrow, false, TokenFile::Text, 256, "data-00000-of-00001.arrow").expect_err("arrow");
        assert!(e.contains("an Arrow stream file"), "{e}");
        let e =
            parse_csv(b"ARROW1\x00\x00", true, "x.feather", &Expect::of(&[2], &[2], crate::Loss::CrossEntropy, None))
                .expect_err("feather as csv");
        assert!(e.contains("is an Arrow (Feather) file, not a CSV file"), "{e}");
        // text that only starts with a brace is text
        assert_eq!(sniff(b"{ not json"), None);
        assert_eq!(sniff(b"hello"), None);
    }

    #[test]
    fn text_may_be_a_folder_or_a_pattern_of_files_and_a_folder_is_named_as_one() {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(dir.path().join("b.txt"), "cd").expect("write");
        std::fs::write(dir.path().join("a.txt"), "ab").expect("write");
        std::fs::write(dir.path().join("notes.md"), "zz").expect("write");
        // a folder: its .txt files in name order, a newline between
        let ids = load_tokens(dir.path(), TokenFile::Text, 16, Extent::All).expect("folder");
        // distinct characters in code-point order: '\n' a b c d
        assert_eq!(ids, vec![1, 2, 0, 3, 4]);
        let pattern = dir.path().join("?.txt");
        assert_eq!(load_tokens(&pattern, TokenFile::Text, 16, Extent::All).expect("pattern"), ids);
        let e = load_tokens(&dir.path().join("*.csv"), TokenFile::Text, 16, Extent::All).expect_err("none");
        assert!(e.contains("names no text file"), "{e}");
        // a folder where a file is expected is said to be one
        let e = load_tokens(dir.path(), TokenFile::Raw(crate::vocab::TokenDtype::Uint16), 16, Extent::All)
            .expect_err("folder");
        assert!(e.ends_with("is a folder, not a data file"), "{e}");
        assert!(wildcard("data-*.arrow", "data-00000-of-00002.arrow") && !wildcard("*.txt", "a.txt.bak"));
    }
    use super::*;

    const CLS: Expect = Expect { numel: 2, classes: Some(3), outputs: 3, vocab: None, positions: 1 };

    fn csv(text: &str, expect: &Expect) -> Result<Samples, String> {
        let f = tempfile::NamedTempFile::new().expect("tmp");
        std::fs::write(f.path(), text).expect("write");
        let prefix = format!("`{}` ", f.path().display());
        load_csv(f.path(), expect, Extent::All).map_err(|e| e.replacen(&prefix, "", 1))
    }

    #[test]
    fn csv_reads_headers_quotes_and_other_separators() {
        let want = Samples { inputs: vec![0.5, 1.0, -2.0, 3.0], targets: vec![2.0, 0.0], samples: 2 };
        assert_eq!(csv("x,y,label\n0.5,1,2\n-2,3,0\n", &CLS).expect("plain"), want);
        assert_eq!(csv("\"x\";\"y\";\"label\"\n\"0.5\";1;2\n-2;3;0\n", &CLS).expect("quoted ;"), want);
        assert_eq!(csv("# comment\n0.5\t1\t2\n\n-2\t3\t0\n", &CLS).expect("tabs"), want);
        assert_eq!(csv("\u{feff}0.5,1,2\n-2,3,0", &CLS).expect("bom"), want);
    }

    #[test]
    fn every_bad_cell_is_an_error_with_its_line() {
        for (text, expect) in [
            ("x,y,label\n0.5,abc,2\n", "line 2: field 2 `abc` is not a number"),
            ("0.5,abc,2\n1,1,1\n", "line 1: field 2 `abc` is not a number"),
            ("0.5,1,2\nbad,row,here\n", "line 2: field 1 `bad` is not a number"),
            ("0.5,nan,2\n", "line 1: input value 2 is NaN"),
            ("inf,1,2\n", "line 1: input value 1 is inf"),
            ("0.5,1,1.5\n", "line 1: the label 1.5 is not a class index"),
            ("0.5,1,nan\n", "line 1: the label NaN is not a class index"),
            ("0.5,1,3\n", "line 1: the label 3 is not one of the model's 3 classes"),
            ("0.5,1\n", "line 1: 2 fields, expected 2 input value(s) and 1 target(s)"),
            ("x,y,label\n", "has no samples"),
        ] {
            let e = csv(text, &CLS).expect_err(text);
            assert!(e.contains(expect), "{text:?}: {e}");
        }
        let regression = Expect { classes: None, outputs: 1, ..CLS };
        assert!(csv("0.5,1,-inf\n", &regression).expect_err("inf").contains("the target value is -inf"));
        let tokens = Expect { vocab: Some(10), ..CLS };
        assert!(csv("1,2.5,0\n", &tokens).expect_err("frac").contains("token id 2.5"));
    }

    /// An NPY file of version `major` holding `values` as `descr`.
    fn npy(major: u8, descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        let prefix = if major == 1 { 10 } else { 12 };
        while (prefix + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut b = b"\x93NUMPY".to_vec();
        b.extend([major, 0]);
        if major == 1 {
            b.extend((header.len() as u16).to_le_bytes());
        } else {
            b.extend((header.len() as u32).to_le_bytes());
        }
        b.extend(header.as_bytes());
        b.extend(data);
        b
    }

    #[test]
    fn npy_versions_1_to_3_and_dtypes_read_the_same_values() {
        let f4: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        for major in 1..=3 {
            let a = parse_npy(&npy(major, "<f4", "(2,)", &f4), true, "x").expect("reads");
            assert_eq!((a.shape.clone(), a.values.clone(), a.kind), (vec![2], vec![1.5, -2.0], NpyKind::Float));
        }
        let u1 = parse_npy(&npy(1, "|u1", "(3,)", &[0, 7, 255]), true, "y").expect("u1");
        assert_eq!((u1.values, u1.kind), (vec![0.0, 7.0, 255.0], NpyKind::Int));
        let e = parse_npy(&npy(1, ">f4", "(2,)", &f4), true, "z").expect_err("big-endian");
        assert!(e.contains("big-endian"), "{e}");
        let e = parse_npy(&npy(1, "<f4", "(3,)", &f4), true, "t").expect_err("short");
        assert!(e.contains("truncated data (2 of 3 values)"), "{e}");
        let mut cut = npy(2, "<f4", "(2,)", &f4);
        cut.truncate(20);
        assert!(parse_npy(&cut, true, "c").expect_err("cut header").contains("the header says"));
    }

    #[test]
    fn npy_labels_must_be_integers_for_classification() {
        let dir = tempfile::tempdir().expect("tmp");
        let x: Vec<u8> = [0.5f32, 1.0, 2.0, f32::NAN].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("x.npy"), npy(1, "<f4", "(2, 2)", &x)).expect("x");
        let yf: Vec<u8> = [1.0f32, 0.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("yf.npy"), npy(1, "<f4", "(2,)", &yf)).expect("yf");
        let yi: Vec<u8> = [1i64, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("yi.npy"), npy(1, "<i8", "(2,)", &yi)).expect("yi");
        let (xp, yfp, yip) = (dir.path().join("x.npy"), dir.path().join("yf.npy"), dir.path().join("yi.npy"));
        let e = load_npy(&xp, Some(&yfp), &CLS, Extent::All).expect_err("float labels");
        assert!(e.contains("class labels are integers"), "{e}");
        let e = load_npy(&xp, Some(&yip), &CLS, Extent::All).expect_err("nan input");
        assert!(e.contains("sample 1: input value 2 is NaN"), "{e}");
    }

    #[test]
    fn a_tokenizer_json_cuts_text_as_hugging_faces_tokenizers_does() {
        // tests/reference/hf/tokenizer-sample.json: a sample of specs/data/architecture.txt
        // and its ids under specs/data/bpe-512.json, from Python's `tokenizers` 0.20.3
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let sample: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(root.join("tests/reference/hf/tokenizer-sample.json")).expect("fixture"),
        )
        .expect("json");
        let text = sample["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(sample["ids"].clone()).expect("ids");
        let tokenizer = TokenFile::Tokenized(root.join("specs/data/bpe-512.json"));
        let got = parse_tokens(text.as_bytes(), true, tokenizer.clone(), 512, "sample").expect("tokenizes");
        assert_eq!(got, want);
        assert!(got.len() < text.len() / 2, "BPE merges: {} tokens for {} bytes", got.len(), text.len());
        // a tokenizer larger than the model's vocabulary says how large it must be
        let e = parse_tokens(text.as_bytes(), true, tokenizer, 300, "sample").expect_err("overflow");
        assert!(e.contains("has 512 tokens") && e.contains("at least 512"), "{e}");
        let e = parse_tokens(b"x", true, TokenFile::Tokenized(root.join("specs/data/quadrants.csv")), 512, "x")
            .expect_err("not a tokenizer");
        assert!(e.contains("does not load"), "{e}");
    }

    #[test]
    fn token_files_and_windows() {
        let dir = std::env::temp_dir().join(format!("pipec-tokens-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let text = dir.join("t.txt");
        std::fs::write(&text, "abcab€").expect("w");
        // distinct characters in code-point order: a b c €
        assert_eq!(load_tokens(&text, TokenFile::Text, 4, Extent::All), Ok(vec![0, 1, 2, 0, 1, 3]));
        let e = load_tokens(&text, TokenFile::Text, 3, Extent::All).expect_err("overflow");
        assert!(e.contains("4 distinct characters") && e.contains("at least 4"), "{e}");
        // a prefix that ends inside the 3-byte € is read up to it
        assert_eq!(load_tokens(&text, TokenFile::Text, 4, Extent::Prefix(6)), Ok(vec![0, 1, 2, 0, 1]));
        let raw = dir.join("t.bin");
        std::fs::write(&raw, [1u8, 0, 2, 0, 0, 1]).expect("w");
        assert_eq!(
            load_tokens(&raw, TokenFile::Raw(crate::vocab::TokenDtype::Uint16), 300, Extent::All),
            Ok(vec![1, 2, 256])
        );
        let e = load_tokens(&raw, TokenFile::Raw(crate::vocab::TokenDtype::Uint16), 256, Extent::All).expect_err("id");
        assert!(e.contains("token 2 has id 256"), "{e}");
        assert!(load_tokens(&raw, TokenFile::Raw(crate::vocab::TokenDtype::Uint32), 300, Extent::All).is_err());
        let w = token_windows(&[5, 6, 7, 8, 9, 10, 11], 3, "x").expect("windows");
        assert_eq!(w.samples, 2);
        assert_eq!(w.inputs, vec![5.0, 6.0, 7.0, 8.0, 9.0, 10.0]);
        assert_eq!(w.targets, vec![6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
        let e = token_windows(&[1, 2, 3], 3, "x").expect_err("short");
        assert!(e.contains("fewer than one window of 4"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Parquet and Arrow columns through the Rust ecosystem's readers (`parquet`, `arrow-ipc`).
mod columnar {
    use std::path::{Path, PathBuf};

    use arrow_array::cast::AsArray;
    use arrow_array::types::{
        Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
    };
    use arrow_array::{Array, RecordBatch};
    use arrow_schema::{ArrowError, DataType};

    use super::{Column, Extent};

    /// A Parquet file's column.
    pub fn parquet(path: &Path, column: &str, extent: Extent) -> Result<Column, String> {
        let shown = path.display().to_string();
        if path.is_dir() {
            return Err(super::folder_not_file(path, "a Parquet file"));
        }
        let file = std::fs::File::open(path).map_err(|e| format!("cannot read the data file `{shown}`: {e}"))?;
        let builder = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| format!("`{shown}` is not a Parquet file pipec reads: {e}"))?;
        let index = builder.schema().index_of(column).map_err(|_| no_column(&shown, column, builder.schema()))?;
        let mask = parquet::arrow::ProjectionMask::roots(builder.parquet_schema(), [index]);
        let reader = builder.with_projection(mask).build().map_err(|e| format!("`{shown}` does not read: {e}"))?;
        let mut out = Gathered::new(extent);
        for batch in reader {
            if !out.add(batch, column, &shown)? {
                break;
            }
        }
        out.finish(&shown)
    }

    /// An Arrow IPC file or stream's column, or a `datasets` `save_to_disk` folder's (its
    /// `state.json` lists its `data-*.arrow` files; without one, they are read in name
    /// order).
    pub fn arrow(path: &Path, column: &str, extent: Extent) -> Result<Column, String> {
        let files = if path.is_dir() { dataset_files(path)? } else { vec![path.to_path_buf()] };
        let shown = path.display().to_string();
        let mut out = Gathered::new(extent);
        for file in &files {
            let file_shown = file.display().to_string();
            let open =
                std::fs::File::open(file).map_err(|e| format!("cannot read the data file `{file_shown}`: {e}"))?;
            let mut head = [0u8; 8];
            let is_file_format = {
                use std::io::Read;
                let mut f = &open;
                f.read(&mut head).map_err(|e| format!("cannot read `{file_shown}`: {e}"))? >= 6
                    && head.starts_with(b"ARROW1")
            };
            let open =
                std::fs::File::open(file).map_err(|e| format!("cannot read the data file `{file_shown}`: {e}"))?;
            let batches: Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>> = if is_file_format {
                Box::new(
                    arrow_ipc::reader::FileReader::try_new_buffered(open, None)
                        .map_err(|e| format!("`{file_shown}` is not an Arrow file pipec reads: {e}"))?,
                )
            } else {
                Box::new(
                    arrow_ipc::reader::StreamReader::try_new_buffered(open, None)
                        .map_err(|e| format!("`{file_shown}` is not an Arrow stream pipec reads: {e}"))?,
                )
            };
            for batch in batches {
                if !out.add(batch, column, &file_shown)? {
                    return out.finish(&shown);
                }
            }
        }
        out.finish(&shown)
    }

    /// The `data-*.arrow` files of a `datasets` folder, in the order its `state.json` lists.
    fn dataset_files(folder: &Path) -> Result<Vec<PathBuf>, String> {
        let shown = folder.display();
        if let Ok(text) = std::fs::read_to_string(folder.join("state.json")) {
            let state: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("`{shown}/state.json` is not JSON: {e}"))?;
            let listed: Option<Vec<PathBuf>> = state["_data_files"]
                .as_array()
                .map(|files| files.iter().filter_map(|f| f["filename"].as_str()).map(|n| folder.join(n)).collect());
            if let Some(files) = listed.filter(|f| !f.is_empty()) {
                return Ok(files);
            }
        }
        match super::text_files(&folder.join("data-*.arrow"))? {
            Some(files) => Ok(files),
            None => Err(format!(
                "`{shown}` is a folder without `data-*.arrow` files (a `datasets` save_to_disk folder has them)"
            )),
        }
    }

    fn no_column(shown: &str, column: &str, schema: &arrow_schema::Schema) -> String {
        let names: Vec<String> = schema.fields().iter().map(|f| format!("`{}`", f.name())).collect();
        format!(
            "`{shown}` has no column `{column}` (it has {}): name the text's or token ids' column with `column:`",
            names.join(", ")
        )
    }

    /// Records gathered batch by batch, up to a prefix's bytes.
    struct Gathered {
        texts: Vec<String>,
        ids: Vec<Vec<u32>>,
        bytes: u64,
        limit: Option<u64>,
    }

    impl Gathered {
        fn new(extent: Extent) -> Gathered {
            let limit = match extent {
                Extent::All => None,
                Extent::Prefix(n) => Some(n),
            };
            Gathered { texts: Vec::new(), ids: Vec::new(), bytes: 0, limit }
        }

        /// Adds a batch's column; false once the prefix is full.
        fn add(&mut self, batch: Result<RecordBatch, ArrowError>, column: &str, shown: &str) -> Result<bool, String> {
            let batch = batch.map_err(|e| format!("`{shown}` does not read: {e}"))?;
            let array = batch.column_by_name(column).ok_or_else(|| no_column(shown, column, &batch.schema()))?;
            if array.null_count() > 0 {
                return Err(format!("`{shown}`: the column `{column}` holds empty (null) records"));
            }
            let texts: Option<Vec<String>> = if let Some(a) = array.as_string_opt::<i32>() {
                Some(a.iter().map(|t| t.unwrap_or_default().to_string()).collect())
            } else if let Some(a) = array.as_string_opt::<i64>() {
                Some(a.iter().map(|t| t.unwrap_or_default().to_string()).collect())
            } else {
                array.as_string_view_opt().map(|a| a.iter().map(|t| t.unwrap_or_default().to_string()).collect())
            };
            match texts {
                Some(t) => {
                    self.bytes += t.iter().map(|x| x.len() as u64).sum::<u64>();
                    self.texts.extend(t);
                }
                None => {
                    let rows = id_rows(array.as_ref()).ok_or_else(|| {
                        format!(
                            "`{shown}`: the column `{column}` holds {}, neither text nor lists of token ids",
                            array.data_type()
                        )
                    })??;
                    self.bytes += rows.iter().map(|r| 4 * r.len() as u64).sum::<u64>();
                    self.ids.extend(rows);
                }
            }
            Ok(self.limit.is_none_or(|n| self.bytes < n))
        }

        fn finish(self, shown: &str) -> Result<Column, String> {
            match (self.texts.is_empty(), self.ids.is_empty()) {
                (false, true) => Ok(Column::Texts(self.texts)),
                (true, false) => Ok(Column::Ids(self.ids)),
                (true, true) => Err(format!("`{shown}` holds no record")),
                (false, false) => Err(format!("`{shown}` holds text in some files and token ids in others")),
            }
        }
    }

    /// A list column's rows of token ids (None when the column is not a list of integers).
    fn id_rows(array: &dyn Array) -> Option<Result<Vec<Vec<u32>>, String>> {
        let (offsets, values): (Vec<usize>, &dyn Array) = if let Some(l) = array.as_list_opt::<i32>() {
            (l.value_offsets().iter().map(|&o| o as usize).collect(), l.values().as_ref())
        } else if let Some(l) = array.as_list_opt::<i64>() {
            (l.value_offsets().iter().map(|&o| o as usize).collect(), l.values().as_ref())
        } else {
            return None;
        };
        let flat = integers(values)?;
        Some(flat.map(|flat| offsets.windows(2).map(|w| flat[w[0]..w[1]].to_vec()).collect()))
    }

    /// An integer array's values as token ids (a negative one is an error).
    fn integers(values: &dyn Array) -> Option<Result<Vec<u32>, String>> {
        fn ids<I: Into<i128> + Copy>(v: &[I]) -> Result<Vec<u32>, String> {
            v.iter()
                .map(|&x| {
                    let x: i128 = x.into();
                    u32::try_from(x).map_err(|_| format!("the token id {x} is not one (0 to 4,294,967,295)"))
                })
                .collect()
        }
        Some(match values.data_type() {
            DataType::Int8 => ids(values.as_primitive::<Int8Type>().values()),
            DataType::Int16 => ids(values.as_primitive::<Int16Type>().values()),
            DataType::Int32 => ids(values.as_primitive::<Int32Type>().values()),
            DataType::Int64 => ids(values.as_primitive::<Int64Type>().values()),
            DataType::UInt8 => ids(values.as_primitive::<UInt8Type>().values()),
            DataType::UInt16 => ids(values.as_primitive::<UInt16Type>().values()),
            DataType::UInt32 => ids(values.as_primitive::<UInt32Type>().values()),
            DataType::UInt64 => ids(values.as_primitive::<UInt64Type>().values()),
            _ => return None,
        })
    }
}
