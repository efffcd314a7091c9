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

/// The modules a file of a crate names through `crate::` (in `use` lists and paths), by
/// the file's own module name. Comments are skipped; `crate::{a, b::c}` names `a` and `b`.
fn module_references(text: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                // the top-level names of the group (nested groups belong to their item)
                let mut depth = 0;
                let mut name = String::new();
                let mut expect_name = true;
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            expect_name = true;
                            continue;
                        }
                        _ => {}
                    }
                    if depth == 0 && expect_name {
                        if c.is_alphanumeric() || c == '_' {
                            name.push(c);
                            continue;
                        }
                        if !name.is_empty() {
                            out.insert(std::mem::take(&mut name));
                            expect_name = false;
                        }
                    }
                }
                if !name.is_empty() {
                    out.insert(name);
                }
            } else {
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                out.insert(name);
            }
        }
    }
    out.retain(|m| modules.contains(m));
    out
}

/// The import circles among a crate's modules (one file each; the crate root excluded):
/// each strongly connected set of two or more modules, as sorted names.
fn import_circles(src: &std::path::Path) -> Vec<Vec<String>> {
    let files: Vec<(String, String)> = std::fs::read_dir(src)
        .expect("src")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_string();
            (stem != "lib" && stem != "main").then(|| (stem, std::fs::read_to_string(&p).expect("read")))
        })
        .collect();
    let modules: BTreeSet<String> = files.iter().map(|(m, _)| m.clone()).collect();
    let edges: HashMap<String, BTreeSet<String>> = files
        .iter()
        .map(|(m, text)| {
            let mut refs = module_references(text, &modules);
            refs.remove(m);
            (m.clone(), refs)
        })
        .collect();
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

#[test]
fn no_import_circles_among_a_crates_modules() {
    // each phase is a function from one type to the next: a module uses the ones before it,
    // never one that uses it back (ARCHITECTURE.md)
    for krate in ["grammar", "plan", "compiler"] {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(krate).join("src");
        let circles = import_circles(&src);
        assert!(circles.is_empty(), "{krate}/src has import circles: {circles:?}");
    }
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
