//! `pipec launch`: the exact mpirun command that runs a plan with one process per device.

use std::path::Path;

use crate::run_cmd::load_plan;
use crate::{EXIT_DIAGNOSTICS, EXIT_USAGE};

/// Parses an Open MPI hostfile: `host [slots=N]` per line, `#` comments.
pub fn parse_hostfile(text: &str) -> Result<Vec<(String, usize)>, String> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let host = parts.next().ok_or(format!("line {}: no host", i + 1))?.to_string();
        let mut slots = 1;
        for p in parts {
            if let Some(v) = p.strip_prefix("slots=") {
                slots = v.parse().map_err(|_| format!("line {}: bad slots `{v}`", i + 1))?;
            }
        }
        hosts.push((host, slots));
    }
    Ok(hosts)
}

fn quote(s: &str) -> String {
    if s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-=:".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

pub fn run(file: &Path, hostfile: Option<&Path>, out: Option<&Path>, exec: bool) -> u8 {
    let plan = match load_plan(file, false) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let ranks = plan.streams.values().filter(|s| !s.is_empty()).count();
    let per_node = plan.devices.iter().filter(|d| d.node == 0).count().max(1);
    let mut cmd: Vec<String> = vec!["mpirun".into()];
    if std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false)
    {
        cmd.push("--allow-run-as-root".into());
    }
    if let Some(h) = hostfile {
        let text = match crate::check_cmd::read_text(h, crate::check_cmd::MAX_SPEC_BYTES, false) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: hostfile: {e}");
                return EXIT_USAGE;
            }
        };
        let hosts = match parse_hostfile(&text) {
            Ok(h) => h,
            Err(e) => {
                eprintln!("error: `{}`: {e}", h.display());
                return EXIT_USAGE;
            }
        };
        let nodes = plan.devices.iter().map(|d| d.node).max().map(|n| n as usize + 1).unwrap_or(1);
        if hosts.len() < nodes || hosts.iter().take(nodes).any(|(_, s)| *s != per_node) {
            eprintln!(
                "error: the plan's cluster has {nodes} node(s) of {per_node} device(s); the hostfile lists {}; give each of {nodes} host(s) `slots={per_node}` so rank i runs device i on node i / {per_node}",
                hosts.iter().map(|(h, s)| format!("{h} (slots={s})")).collect::<Vec<_>>().join(", ")
            );
            return EXIT_DIAGNOSTICS;
        }
        cmd.push("--hostfile".into());
        cmd.push(h.display().to_string());
        cmd.push("--map-by".into());
        cmd.push("slot".into());
    } else if ranks > std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) {
        cmd.push("--oversubscribe".into());
    }
    cmd.push("-np".into());
    cmd.push(ranks.to_string());
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "pipec".into());
    cmd.extend([exe, "run".into(), file.display().to_string(), "--transport".into(), "mpi".into()]);
    if let Some(o) = out {
        cmd.push("-o".into());
        cmd.push(o.display().to_string());
    }
    println!("{}", cmd.iter().map(|c| quote(c)).collect::<Vec<_>>().join(" "));
    if !exec {
        return 0;
    }
    match std::process::Command::new(&cmd[0]).args(&cmd[1..]).status() {
        Ok(s) => s.code().map(|c| c.clamp(0, 255) as u8).unwrap_or(EXIT_DIAGNOSTICS),
        Err(e) => {
            eprintln!("error: cannot start mpirun: {e} (install Open MPI: apt-get install openmpi-bin)");
            EXIT_USAGE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostfiles() {
        let h = parse_hostfile("# cluster\nnode1 slots=4\nnode2 slots=4 # second\n\nnode3\n").expect("parses");
        assert_eq!(h, vec![("node1".into(), 4), ("node2".into(), 4), ("node3".into(), 1)]);
        assert!(parse_hostfile("a slots=x").is_err());
    }
}
