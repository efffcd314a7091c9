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
