//! Writing output files atomically: each file goes to a temporary name in the same
//! directory and is renamed into place, so no reader ever sees half a file.

use std::path::Path;

/// Writes `contents` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), String> {
    write_atomic_with(path, &mut |w| w.write_all(contents))
}

/// Writes what `write` produces to `path` through a buffered temporary file and a rename,
/// so a large file is streamed rather than made whole in memory first; on an error the
/// temporary file is removed and `path` is untouched.
pub fn write_atomic_with(
    path: &Path,
    write: &mut dyn FnMut(&mut dyn std::io::Write) -> std::io::Result<()>,
) -> Result<(), String> {
    use std::io::Write;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|f| {
        let mut out = std::io::BufWriter::new(f);
        write(&mut out)?;
        out.flush()
    });
    written.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write `{}`: {e}", tmp.display())
    })?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write `{}`: {e}", path.display())
    })
}

/// Writes a new folder `out` holding `files` (name, contents), whole or not at all: the
/// files go into a fresh folder beside it, renamed into place at once. `out` must not exist.
pub fn write_folder_atomic(out: &Path, files: &[(String, Vec<u8>)]) -> Result<(), String> {
    if out.exists() {
        return Err(format!("`{}` exists: a new folder is written", out.display()));
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(|e| format!("cannot create `{}`: {e}", parent.display()))?;
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("out");
    let tmp = parent.join(format!(".{name}.tmp{}", std::process::id()));
    let write = || -> Result<(), String> {
        std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create `{}`: {e}", tmp.display()))?;
        for (file, contents) in files {
            std::fs::write(tmp.join(file), contents).map_err(|e| format!("cannot write `{file}`: {e}"))?;
        }
        std::fs::rename(&tmp, out).map_err(|e| format!("cannot write `{}`: {e}", out.display()))
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })
}

/// Appends `line` and its newline to `file` (open for appending) in one write, so that
/// lines appended by several processes at once — a launcher's re-plan record beside a
/// rank of a job being stopped, still writing its steps — never interleave.
pub fn write_line(file: &mut std::fs::File, line: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut text = String::with_capacity(line.len() + 1);
    text.push_str(line);
    text.push('\n');
    file.write_all(text.as_bytes())
}

/// Appends one line to the file at `path` (made if absent, with its directory), in one
/// write ([`write_line`]).
pub fn append_line(path: &Path, line: &str) -> Result<(), String> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| format!("cannot create `{}`: {e}", parent.display()))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
    write_line(&mut f, line).map_err(|e| format!("cannot write `{}`: {e}", path.display()))
}

/// The JSON text of a plan file: one field per line down to the third level (a stage, a
/// device's stream) and everything deeper on one line (each instruction, each stage's
/// layer range and route), so that a plan of tens of thousands of instructions reads one
/// instruction per line. Parses back to the same value as any JSON.
pub fn json_text<T: serde::Serialize>(value: &T) -> Result<String, serde_json::Error> {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Layered::default());
    value.serialize(&mut ser)?;
    out.push(b'\n');
    // serde_json writes valid UTF-8
    Ok(String::from_utf8(out).unwrap_or_default())
}

/// The levels laid out one item per line; deeper containers are written on one line.
const LINED_LEVELS: usize = 3;

/// [`json_text`]'s layout: per open container, whether it is on one line and whether it
/// has an item yet.
#[derive(Default)]
struct Layered {
    open: Vec<(bool, bool)>,
}

impl Layered {
    fn begin<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        let flat = self.open.len() >= LINED_LEVELS || self.open.last().is_some_and(|o| o.0);
        self.open.push((flat, false));
        w.write_all(bracket)
    }

    fn end<W: ?Sized + std::io::Write>(&mut self, w: &mut W, bracket: &[u8]) -> std::io::Result<()> {
        let (flat, had) = self.open.pop().unwrap_or((true, false));
        if !flat && had {
            w.write_all(b"\n")?;
            indent(w, self.open.len())?;
        }
        w.write_all(bracket)
    }

    fn item<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        match self.open.last().copied() {
            Some((true, _)) if !first => w.write_all(b" "),
            Some((true, _)) => Ok(()),
            _ => {
                w.write_all(b"\n")?;
                indent(w, self.open.len())
            }
        }
    }

    fn done(&mut self) {
        if let Some(o) = self.open.last_mut() {
            o.1 = true;
        }
    }
}

fn indent<W: ?Sized + std::io::Write>(w: &mut W, levels: usize) -> std::io::Result<()> {
    for _ in 0..levels {
        w.write_all(b"  ")?;
    }
    Ok(())
}

impl serde_json::ser::Formatter for Layered {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.begin(w, b"[")
    }
    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.end(w, b"]")
    }
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.done();
        Ok(())
    }
    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.begin(w, b"{")
    }
    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.end(w, b"}")
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        self.item(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.done();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines appended at once by several writers — some keeping the file open, some opening
    /// it for each line, as a run's metrics and a launcher's records are — each stay whole.
    #[test]
    fn lines_appended_by_several_writers_at_once_stay_whole() {
        let dir = std::env::temp_dir().join(format!("pipec-lines-{}", std::process::id()));
        let path = dir.join("metrics.jsonl");
        let _ = std::fs::remove_dir_all(&dir);
        let (writers, lines) = (4usize, 400usize);
        let line =
            |w: usize, k: usize| format!("{{\"writer\": {w}, \"k\": {k}, \"pad\": \"{}\"}}", "x".repeat(200 + 37 * w));
        std::thread::scope(|s| {
            for w in 0..writers {
                let path = &path;
                s.spawn(move || {
                    if w % 2 == 0 {
                        for k in 0..lines {
                            append_line(path, &line(w, k)).expect("appends");
                        }
                    } else {
                        append_line(path, &line(w, 0)).expect("appends");
                        let mut f = std::fs::OpenOptions::new().append(true).open(path).expect("opens");
                        for k in 1..lines {
                            write_line(&mut f, &line(w, k)).expect("writes");
                        }
                    }
                });
            }
        });
        let text = std::fs::read_to_string(&path).expect("reads");
        let _ = std::fs::remove_dir_all(&dir);
        let mut seen = vec![0usize; writers];
        for l in text.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("a broken line ({e}): {l}"));
            let (w, k) = (v["writer"].as_u64().expect("writer") as usize, v["k"].as_u64().expect("k") as usize);
            assert_eq!(l, line(w, k));
            seen[w] += 1;
        }
        assert_eq!(seen, vec![lines; writers]);
    }

    /// Three levels one item per line, deeper ones on one line, and the same value back.
    #[test]
    fn a_plan_file_lays_each_deep_value_on_one_line() {
        let value = serde_json::json!({
            "version": 6,
            "streams": { "d0": [{ "op": "forward", "stage": 0, "mb": 1 }, { "op": "free", "stage": 0, "mb": 1 }] },
            "stages": [{ "id": 0, "layers": [0, 3], "empty": [], "none": {} }],
        });
        let text = json_text(&value).expect("serialises");
        let want = "{\n  \"stages\": [\n    {\n      \"empty\": [],\n      \"id\": 0,\n      \"layers\": [0, 3],\n      \"none\": {}\n    }\n  ],\n  \"streams\": {\n    \"d0\": [\n      {\"mb\": 1, \"op\": \"forward\", \"stage\": 0},\n      {\"mb\": 1, \"op\": \"free\", \"stage\": 0}\n    ]\n  },\n  \"version\": 6\n}\n";
        assert_eq!(text, want);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&text).expect("parses"), value);
    }
}
