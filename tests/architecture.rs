//! The crate-dependency rules ARCHITECTURE.md states, checked on the resolved dependency
//! graph (`cargo metadata`): the front end links no graph library and no Burn, the compiler
//! no Burn, and the shared vocabulary nothing but serde (schemars only behind its `schema`
//! feature, which only the front end turns on).

use std::collections::{BTreeSet, HashMap};
use std::process::Command;

use serde_json::Value;

/// The packages `root` links through normal (not dev) dependencies, by name.
fn linked_packages(metadata: &Value, root: &str) -> BTreeSet<String> {
    let packages: HashMap<&str, &str> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().expect("id"), p["name"].as_str().expect("name")))
        .collect();
    let nodes: HashMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .expect("resolve.nodes")
        .iter()
        .map(|n| (n["id"].as_str().expect("id"), n))
        .collect();
    let root_id = packages.iter().find(|(_, name)| **name == root).map(|(id, _)| *id).expect("root package");
    let mut seen = BTreeSet::new();
    let mut stack = vec![root_id];
    while let Some(id) = stack.pop() {
        for dep in nodes[id]["deps"].as_array().into_iter().flatten() {
            let normal = dep["dep_kinds"].as_array().into_iter().flatten().any(|k| k["kind"].is_null());
            let pkg = dep["pkg"].as_str().expect("pkg");
            if normal && seen.insert(packages[pkg].to_string()) {
                stack.push(pkg);
            }
        }
    }
    seen
}

fn metadata(features: &[&str]) -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    // the host's platform only: packages of other platforms need not be downloaded
    let host = String::from_utf8(Command::new("rustc").arg("-vV").output().expect("rustc -vV").stdout)
        .expect("utf-8")
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_string))
        .expect("host triple");
    cmd.args(["metadata", "--format-version", "1", "--offline", "--filter-platform", &host, "--manifest-path"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
    if !features.is_empty() {
        cmd.args(["--features", &features.join(",")]);
    }
    let out = cmd.output().expect("cargo metadata runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("metadata is JSON")
}

#[test]
fn each_crate_links_only_what_its_layer_may() {
    // With every feature of the binary on (cuda and mpi pull in the most).
    let m = metadata(&["cuda", "mpi"]);
    let grammar = linked_packages(&m, "pipec-grammar");
    for banned in ["petgraph", "burn", "burn-core", "burn-flex", "pipec-compiler", "pipec-executor"] {
        assert!(!grammar.contains(banned), "pipec-grammar links {banned}");
    }
    assert!(grammar.contains("pipec-plan") && grammar.contains("nom"), "{grammar:?}");

    let compiler = linked_packages(&m, "pipec-compiler");
    for banned in ["burn", "burn-core", "burn-flex", "pipec-executor"] {
        assert!(!compiler.contains(banned), "pipec-compiler links {banned}");
    }
    assert!(compiler.contains("petgraph"), "{compiler:?}");

    let executor = linked_packages(&m, "pipec-executor");
    assert!(executor.contains("burn") && !executor.contains("pipec-grammar"), "{executor:?}");

    // The vocabulary: serde and nothing of pipec; schemars comes with the front end's feature.
    let plan = linked_packages(&m, "pipec-plan");
    assert!(plan.iter().all(|p| !p.starts_with("pipec") && !p.starts_with("burn")), "{plan:?}");
}

/// The paths a use list or path names after `crate::`, to their second segment:
/// `a::b::X` → `a::b` and `a`; `{a::X, b}` → `a::X`, `a`, `b`; `a::{b, c::Y}` → `a::b`,
/// `a::c`, `a` (the caller keeps those that are modules).
fn named_paths(rest: &str) -> Vec<String> {
    fn ident(s: &str) -> (&str, &str) {
        let n = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
        (&s[..n], &s[n..])
    }
    /// The top-level items of a `{...}` group (the text after its `{`).
    fn items(group: &str) -> Vec<&str> {
        let (mut depth, mut start, mut out) = (0, 0, Vec::new());
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push(group[start..i].trim());
                    return out;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(group[start..i].trim());
                    start = i + 1;
                }
                _ => {}
            }
        }
        out
    }
    let mut out = Vec::new();
    let firsts = match rest.strip_prefix('{') {
        Some(group) => items(group),
        None => vec![rest],
    };
    for item in firsts {
        let (a, after) = ident(item);
        if a.is_empty() {
            continue;
        }
        out.push(a.to_string());
        if let Some(tail) = after.strip_prefix("::") {
            let seconds = match tail.strip_prefix('{') {
                Some(group) => items(group),
                None => vec![tail],
            };
            for s in seconds {
                let (b, _) = ident(s);
                if !b.is_empty() {
                    out.push(format!("{a}::{b}"));
                }
            }
        }
    }
    out
}

/// The modules a file of a crate names through `crate::` (in `use` lists and paths), by
/// their paths from the crate root (`a`, or `a::b` for a file in folder `a`); the deepest
/// module a path names is kept. Comments are skipped.
fn module_references(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let named: Vec<String> = named_paths(rest).into_iter().filter(|m| modules.contains(m)).collect();
            for m in &named {
                // `a` is named for itself only when no `a::b` below it is
                if !named.iter().any(|n| n.starts_with(&format!("{m}::"))) {
                    out.insert(m.clone());
                }
            }
        }
    }
    out
}

/// A crate's modules (one file each, in its folders too; the crate root and each folder's
/// `mod.rs` excluded) by path from the root, with their text.
fn crate_modules(src: &std::path::Path) -> Vec<(String, String)> {
    rust_files(src)
        .into_iter()
        .filter(|p| p.file_stem().is_some_and(|s| !["lib", "main", "mod"].contains(&s.to_str().unwrap_or(""))))
        .map(|p| {
            let name = p.strip_prefix(src).expect("below src").with_extension("");
            let name = name.iter().map(|c| c.to_string_lossy()).collect::<Vec<_>>().join("::");
            (name, std::fs::read_to_string(&p).expect("read"))
        })
        .collect()
}

/// The Rust files below `dir`, in the order of their paths.
fn rust_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir).expect("src").flatten().map(|e| e.path()).collect();
    entries.sort();
    entries
        .into_iter()
        .flat_map(|p| {
            if p.is_dir() {
                rust_files(&p)
            } else if p.extension().is_some_and(|x| x == "rs") {
                vec![p]
            } else {
                Vec::new()
            }
        })
        .collect()
}

/// Each module's references to the crate's other modules.
fn module_edges(src: &std::path::Path) -> HashMap<String, BTreeSet<String>> {
    let files = crate_modules(src);
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    files
        .iter()
        .map(|(m, text)| {
            let mut refs = module_references(text, &modules);
            refs.remove(m);
            (m.clone(), refs)
        })
        .collect()
}

/// The import circles among a crate's modules: each strongly connected set of two or more
/// modules, as sorted names.
fn import_circles(src: &std::path::Path) -> Vec<Vec<String>> {
    let edges = module_edges(src);
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    // reachability, then the mutually reachable sets
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(m) = stack.pop() {
            for n in edges.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    stack.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: HashMap<&String, BTreeSet<String>> = modules.iter().map(|m| (m, reach(m))).collect();
    let mut circles: BTreeSet<Vec<String>> = BTreeSet::new();
    for m in &modules {
        let mut set: Vec<String> =
            modules.iter().filter(|n| *n != m && reaches[m].contains(*n) && reaches[n].contains(m)).cloned().collect();
        if !set.is_empty() {
            set.push(m.clone());
            set.sort();
            circles.insert(set);
        }
    }
    circles.into_iter().collect()
}

/// The executor's layers, lowest first: a module imports only modules of its own layer or
/// of a layer below (ARCHITECTURE.md, "The executor"). `error` is the one module at the
/// crate root beside `lib.rs`.
const EXECUTOR_LAYERS: [&str; 7] = ["comm", "error", "backend", "nn", "parallel", "interp", "run"];

/// The imports of the executor that run from a layer up to a layer above it.
fn upward_imports(src: &std::path::Path) -> Vec<String> {
    let layer_of = |m: &str| {
        let top = m.split("::").next().unwrap_or(m);
        EXECUTOR_LAYERS.iter().position(|l| *l == top)
    };
    let mut up = Vec::new();
    for (m, refs) in module_edges(src) {
        let Some(from) = layer_of(&m) else {
            up.push(format!("{m} is in no layer"));
            continue;
        };
        for r in refs {
            if layer_of(&r).is_none_or(|to| to > from) {
                up.push(format!("{m} -> {r}"));
            }
        }
    }
    up.sort();
    up
}

#[test]
fn no_import_circles_among_a_crates_modules() {
    // each phase is a function from one type to the next: a module uses the ones before it,
    // never one that uses it back (ARCHITECTURE.md)
    for krate in ["grammar", "plan", "compiler", "executor"] {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(krate).join("src");
        let circles = import_circles(&src);
        assert!(circles.is_empty(), "{krate}/src has import circles: {circles:?}");
    }
}

#[test]
fn the_executors_layers_import_only_downward() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("executor/src");
    let up = upward_imports(&src);
    assert!(up.is_empty(), "imports from a layer to one above it (or a module in no layer): {up:#?}");
    // every folder of executor/src is a layer
    for e in std::fs::read_dir(&src).expect("src").flatten().filter(|e| e.path().is_dir()) {
        let name = e.file_name().to_string_lossy().to_string();
        assert!(EXECUTOR_LAYERS.contains(&name.as_str()), "executor/src/{name} is not one of the layers");
    }
}

/// The names the executor's modules take from its crate root (`crate::X` with `X` no layer).
fn crate_root_imports(src: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for (m, text) in crate_modules(src) {
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            let mut rest = code;
            while let Some(at) = rest.find("crate::") {
                rest = &rest[at + "crate::".len()..];
                let names: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
                    let group = group.split('}').next().unwrap_or("");
                    group.split(',').map(|n| n.trim().split("::").next().unwrap_or("").to_string()).collect()
                } else {
                    vec![rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect()]
                };
                for n in names.into_iter().filter(|n| !n.is_empty() && !EXECUTOR_LAYERS.contains(&n.as_str())) {
                    out.push(format!("{m} -> crate::{n}"));
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn the_executors_crate_root_only_declares_and_re_exports() {
    // lib.rs sits above every layer: a layer that took a name from it would import upward
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("executor/src");
    let taken = crate_root_imports(&src);
    assert!(taken.is_empty(), "modules naming the crate root's items: {taken:#?}");
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let defining = ["fn ", "struct ", "enum ", "impl", "const ", "static ", "type ", "trait ", "mod ", "macro_rules!"];
    for line in lib.lines().map(str::trim).filter(|l| !l.starts_with("//")) {
        let item = line.strip_prefix("pub(crate) ").or_else(|| line.strip_prefix("pub ")).unwrap_or(line);
        let defines = defining.iter().any(|d| item.starts_with(d)) && !line.starts_with("pub mod ");
        assert!(!defines, "lib.rs defines more than the layers and the API's re-exports: {line}");
    }
    // the check sees a name taken from the root
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::create_dir_all(dir.path().join("run")).expect("mkdir");
    std::fs::write(dir.path().join("run/a.rs"), "use crate::{interp::x, RunOptions};\nfn f() { crate::validate(); }")
        .expect("w");
    assert_eq!(crate_root_imports(dir.path()), vec!["run::a -> crate::RunOptions", "run::a -> crate::validate"]);
}

#[test]
fn the_layer_check_sees_an_import_up() {
    let dir = tempfile::tempdir().expect("tmp");
    for (path, text) in [
        ("comm/transport.rs", "pub struct T;"),
        ("backend/dense.rs", "use crate::comm::transport::T;"),
        ("backend/ring.rs", "use crate::{backend::dense, nn::layers::Block};"),
        ("nn/layers.rs", "use crate::backend::{dense, ring::Ring};"),
    ] {
        let p = dir.path().join(path);
        std::fs::create_dir_all(p.parent().expect("dir")).expect("mkdir");
        std::fs::write(p, text).expect("w");
    }
    assert_eq!(upward_imports(dir.path()), vec!["backend::ring -> nn::layers".to_string()]);
    assert_eq!(import_circles(dir.path()), vec![vec!["backend::ring".to_string(), "nn::layers".to_string()]]);
}

#[test]
fn the_circle_finder_finds_circles() {
    let modules: BTreeSet<String> = ["a", "b", "c"].map(String::from).into();
    let text = "use crate::{a::X, b};\nfn f() { crate::c::g(); } // crate::d\n";
    assert_eq!(module_references(text, &modules), ["a", "b", "c"].map(String::from).into());
    let dir = tempfile::tempdir().expect("tmp");
    std::fs::write(dir.path().join("a.rs"), "use crate::b::B;").expect("w");
    std::fs::write(dir.path().join("b.rs"), "fn f() { crate::c::g() }").expect("w");
    std::fs::write(dir.path().join("c.rs"), "use crate::{a::A};").expect("w");
    std::fs::write(dir.path().join("d.rs"), "use crate::a::A;").expect("w");
    assert_eq!(import_circles(dir.path()), vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]]);
}

/// Each function's name, file, first line and length in lines (its signature to its closing
/// brace) in the non-test Rust files below `src`: a `fn` line's braces counted to where
/// they close. Test modules (`tests.rs`, and whatever follows `#[cfg(test)]`) are left out.
fn function_lengths(src: &std::path::Path) -> Vec<(String, String, usize, usize)> {
    let mut out = Vec::new();
    for file in rust_files(src).into_iter().filter(|p| !p.ends_with("tests.rs")) {
        let path = file.display().to_string();
        let text = std::fs::read_to_string(&file).expect("source");
        let lines: Vec<&str> = text.lines().collect();
        let mut i = 0;
        while i < lines.len() {
            let l = lines[i].trim_start();
            if l.starts_with("#[cfg(test)]") {
                break;
            }
            let signature = l.trim_start_matches("pub(crate) ").trim_start_matches("pub ").trim_start_matches("const ");
            if let Some(rest) = signature.strip_prefix("fn ") {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                let (mut depth, mut opened, mut j) = (0i64, false, i);
                while j < lines.len() {
                    let line = lines[j];
                    depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
                    opened |= line.contains('{');
                    if (opened && depth <= 0) || (!opened && line.trim_end().ends_with(';')) {
                        break;
                    }
                    j += 1;
                }
                out.push((name, path.clone(), i + 1, j - i + 1));
            }
            i += 1;
        }
    }
    out
}

#[test]
fn no_function_of_the_compiler_or_the_executor_is_over_150_lines() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long: Vec<String> = ["compiler/src", "executor/src"]
        .iter()
        .flat_map(|src| function_lengths(&root.join(src)))
        .filter(|f| f.3 > 150)
        .map(|(name, path, line, n)| format!("{path}:{line} {name}: {n} lines"))
        .collect();
    long.sort();
    assert!(long.is_empty(), "functions over 150 lines:\n{}", long.join("\n"));
    // the measure sees a long function: this file's own are counted too
    let here = function_lengths(&root.join("tests"));
    assert!(here.iter().any(|f| f.0 == "function_lengths" && f.3 > 20), "{here:?}");
}

#[test]
fn no_file_of_the_executor_is_over_700_lines() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("executor/src");
    let files = rust_files(&src);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).expect("source").lines().count();
            (n > 700).then(|| format!("{}: {n} lines", f.display()))
        })
        .collect();
    assert!(long.is_empty(), "executor files over 700 lines:\n{}", long.join("\n"));
    // every file is seen: the worker, the layers and the kernels among them
    for known in ["interp/worker.rs", "nn/layers.rs", "backend/kernels.rs"] {
        assert!(files.iter().any(|f| f.ends_with(known)), "{known} not among {} files", files.len());
    }
}

#[test]
fn the_worker_holds_at_most_twelve_fields() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("executor/src/interp/worker.rs");
    let text = std::fs::read_to_string(path).expect("worker.rs");
    let start = text.find("pub(crate) struct Worker<").expect("the Worker struct");
    let body = &text[start..start + text[start..].find("\n}\n").expect("its end")];
    let fields: Vec<&str> = body
        .lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && l.contains(':') && l.ends_with(','))
        .collect();
    assert!(!fields.is_empty() && fields.len() <= 12, "{} fields: {fields:?}", fields.len());
}
