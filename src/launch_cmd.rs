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

pub fn run(
    file: &Path,
    hostfile: Option<&Path>,
    out: Option<&Path>,
    exec: bool,
    timeout: Option<u64>,
    start_timeout: std::time::Duration,
) -> u8 {
    let plan = match load_plan(file, false) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let ranks = pipec_executor::working_devices(&plan).len();
    let per_node = plan.devices.iter().filter(|d| d.node == 0).count().max(1);
    let mut cmd: Vec<String> = vec!["mpirun".into()];
    // which devices each host runs, to name them when Open MPI loses a host
    let mut host_devices: Vec<(String, String)> = Vec::new();
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
        for (k, (host, _)) in hosts.iter().take(nodes).enumerate() {
            let devices: Vec<String> =
                plan.devices.iter().filter(|d| d.node as usize == k).map(|d| d.id.to_string()).collect();
            host_devices.push((host.clone(), format!("node {k}: {}", devices.join(", "))));
        }
        cmd.push("--hostfile".into());
        cmd.push(h.display().to_string());
        cmd.push("--map-by".into());
        cmd.push("slot".into());
    } else if ranks > std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) {
        cmd.push("--oversubscribe".into());
    }
    // Open MPI notices a host that stopped answering (a link down) within a few seconds
    // instead of after its 300 s TCP keepalive default, and then ends the job
    for (param, value) in
        [("oob_tcp_keepalive_time", "1"), ("oob_tcp_keepalive_intvl", "1"), ("oob_tcp_keepalive_probes", "5")]
    {
        cmd.extend(["--mca".into(), param.into(), value.into()]);
    }
    cmd.push("-np".into());
    cmd.push(ranks.to_string());
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "pipec".into());
    cmd.extend([exe, "run".into(), file.display().to_string(), "--transport".into(), "mpi".into()]);
    if let Some(o) = out {
        cmd.push("-o".into());
        cmd.push(o.display().to_string());
    }
    if let Some(t) = timeout {
        cmd.push("--timeout".into());
        cmd.push(t.to_string());
    }
    println!("{}", cmd.iter().map(|c| quote(c)).collect::<Vec<_>>().join(" "));
    if !exec {
        return 0;
    }
    let agent = std::env::var("OMPI_MCA_plm_rsh_agent").unwrap_or_else(|_| "ssh".into());
    supervise(&cmd, &host_devices, start_timeout, &agent)
}

/// How long mpirun may take to end the job once a rank has aborted it (or Open MPI has
/// lost a host).
const ABORT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs mpirun, passing its output through. When a rank has aborted the job (its
/// `error: rank …` line, or Open MPI's "MPI_ABORT was invoked" banner) and mpirun is still
/// running `ABORT_GRACE` later — it waits on the daemon of a host it can no longer reach —
/// mpirun is stopped: the job must end within its timeout, whatever the network does.
///
/// When Open MPI reports that it lost a host's daemon (a host down or unreachable), it ends
/// the job itself, but can hang tearing it down, waiting on that host — before any rank's
/// receive timeout fired, so no rank reports a failure: that report starts the same grace
/// period. The devices that host ran are named once mpirun has ended.
///
/// Start-up is bounded too: until every rank has started (rank 0's `MPI_STARTED` line) no
/// rank's receive timeout runs, and mpirun waits as long as it takes to reach a host (ssh's
/// own connect timeout, minutes). Past `start_timeout` mpirun is stopped, and each host is
/// asked through Open MPI's own launch agent whether it answers; those that do not are named.
fn supervise(cmd: &[String], host_devices: &[(String, String)], start_timeout: std::time::Duration, agent: &str) -> u8 {
    use std::io::BufRead;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut child =
        match std::process::Command::new(&cmd[0]).args(&cmd[1..]).stderr(std::process::Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: cannot start mpirun: {e} (install Open MPI: apt-get install openmpi-bin)");
                return EXIT_USAGE;
            }
        };
    let launched_at = std::time::Instant::now();
    let aborted = std::sync::Arc::new(AtomicBool::new(false));
    let started = std::sync::Arc::new(AtomicBool::new(false));
    let lost_host = std::sync::Arc::new(std::sync::Mutex::new(None::<String>));
    let reader = child.stderr.take().map(|stderr| {
        let aborted = aborted.clone();
        let started = started.clone();
        let lost_host = lost_host.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.starts_with(pipec_executor::MPI_STARTED) {
                    started.store(true, Ordering::Relaxed);
                    continue;
                }
                eprintln!("{line}");
                // Open MPI: "Remote daemon: [[30846,0],1] on node 10.78.0.2"
                if let Some(host) = line.trim().strip_prefix("Remote daemon:").and_then(|r| r.split(" on node ").nth(1))
                {
                    if let Ok(mut slot) = lost_host.lock() {
                        slot.get_or_insert_with(|| host.trim().to_string());
                    }
                    aborted.store(true, Ordering::Relaxed);
                }
                // a rank's own failure line (`mpi_run::report_failure`), or Open MPI's banner
                if line.starts_with("error: rank ") || line.contains("MPI_ABORT was invoked") {
                    aborted.store(true, Ordering::Relaxed);
                }
            }
        })
    });
    let name_lost_host = || {
        let host = lost_host.lock().ok().and_then(|h| h.clone());
        if let Some(host) = host {
            let devices =
                host_devices.iter().find(|(h, _)| *h == host).map(|(_, d)| format!(" ({d})")).unwrap_or_default();
            eprintln!("error: Open MPI lost host {host}{devices}: it stopped answering (host down or link lost), so the job was ended");
            return true;
        }
        false
    };
    let mut since: Option<std::time::Instant> = None;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                // everything mpirun printed has been read before naming what was lost
                if let Some(r) = reader {
                    let _ = r.join();
                }
                let lost = name_lost_host();
                return match status.code() {
                    Some(0) if lost => EXIT_DIAGNOSTICS,
                    Some(c) => c.clamp(0, 255) as u8,
                    None => EXIT_DIAGNOSTICS,
                };
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("error: cannot wait for mpirun: {e}");
                return EXIT_USAGE;
            }
        }
        if aborted.load(Ordering::Relaxed) {
            let t = *since.get_or_insert_with(std::time::Instant::now);
            if t.elapsed() > ABORT_GRACE {
                let _ = child.kill();
                let _ = child.wait();
                name_lost_host();
                eprintln!(
                    "error: the job was aborted (a rank failed, or Open MPI lost a host) and mpirun had not ended it {} s later (a host it cannot reach?): stopped mpirun",
                    ABORT_GRACE.as_secs()
                );
                return EXIT_DIAGNOSTICS;
            }
        } else if !started.load(Ordering::Relaxed) && launched_at.elapsed() > start_timeout {
            let _ = child.kill();
            let _ = child.wait();
            let silent = silent_hosts(host_devices, agent);
            let named = if silent.is_empty() {
                "every host answered the launch agent, so Open MPI itself did not start the ranks (see its output above)"
                    .to_string()
            } else {
                format!("{} did not answer", silent.join(", "))
            };
            eprintln!(
                "error: the job had not started {} s after launch (not every rank was up): {named}; stopped mpirun (raise --start-timeout for a slow start)",
                start_timeout.as_secs()
            );
            return EXIT_DIAGNOSTICS;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// How long a host has to answer the launch agent when a job did not start.
const PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The hosts (with the devices they run) that do not run `true` through Open MPI's launch
/// `agent` (`OMPI_MCA_plm_rsh_agent`, by default ssh) within [`PROBE_TIMEOUT`], asked all
/// at once.
fn silent_hosts(host_devices: &[(String, String)], agent: &str) -> Vec<String> {
    let mut words = agent.split_whitespace().map(str::to_string);
    let Some(program) = words.next() else { return Vec::new() };
    let mut args: Vec<String> = words.collect();
    if Path::new(&program).file_name().is_some_and(|n| n == "ssh") {
        args.extend([
            "-o".into(),
            "BatchMode=yes".into(),
            "-o".into(),
            format!("ConnectTimeout={}", PROBE_TIMEOUT.as_secs()),
        ]);
    }
    let probes: Vec<_> = host_devices
        .iter()
        .map(|(host, devices)| {
            let child = std::process::Command::new(&program)
                .args(&args)
                .args([host.as_str(), "true"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn();
            (format!("host {host} ({devices})"), child)
        })
        .collect();
    let deadline = std::time::Instant::now() + PROBE_TIMEOUT;
    probes
        .into_iter()
        .filter_map(|(name, child)| {
            let Ok(mut child) = child else { return Some(name) };
            loop {
                match child.try_wait() {
                    Ok(Some(status)) => return (!status.success()).then_some(name),
                    Ok(None) if std::time::Instant::now() < deadline => {
                        std::thread::sleep(std::time::Duration::from_millis(50))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Some(name);
                    }
                }
            }
        })
        .collect()
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

    /// An mpirun that reports a lost host's daemon and then hangs tearing the job down (no
    /// rank ever reports a failure) is stopped after the grace period, not waited for.
    #[test]
    fn a_hanging_mpirun_that_lost_a_host_is_stopped() {
        let fake = "echo 'ORTE has lost communication with a remote daemon.' >&2; \
                    echo '  Remote daemon: [[1,0],1] on node 10.0.0.2' >&2; exec sleep 120";
        let cmd: Vec<String> = ["sh", "-c", fake].map(String::from).to_vec();
        let started = std::time::Instant::now();
        let hosts = [("10.0.0.2".to_string(), "node 1: d1".to_string())];
        let code = supervise(&cmd, &hosts, std::time::Duration::from_secs(60), "ssh");
        assert_eq!(code, EXIT_DIAGNOSTICS);
        let waited = started.elapsed();
        assert!(waited >= ABORT_GRACE && waited < ABORT_GRACE * 6, "stopped after {waited:?}");
    }

    /// An mpirun that never starts the ranks (a host it cannot reach: ssh waits minutes) is
    /// stopped once the start-up bound has passed, and the host that does not answer the
    /// launch agent is named.
    #[test]
    fn a_job_that_never_starts_is_stopped_and_the_silent_host_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let agent = dir.path().join("agent.sh");
        // 10.0.0.1 answers; 10.0.0.2 hangs, as ssh does on a host it cannot reach
        std::fs::write(&agent, "#!/bin/sh\ncase \"$1\" in 10.0.0.1) exit 0 ;; *) exec sleep 120 ;; esac\n")
            .expect("agent");
        std::process::Command::new("chmod").arg("+x").arg(&agent).status().expect("chmod");
        let agent = agent.to_str().expect("utf-8");
        let hosts =
            [("10.0.0.1".to_string(), "node 0: d0".to_string()), ("10.0.0.2".to_string(), "node 1: d1".to_string())];
        assert_eq!(silent_hosts(&hosts, agent), vec!["host 10.0.0.2 (node 1: d1)".to_string()]);
        let cmd: Vec<String> = ["sh", "-c", "exec sleep 120"].map(String::from).to_vec();
        let started = std::time::Instant::now();
        let start_timeout = std::time::Duration::from_secs(1);
        assert_eq!(supervise(&cmd, &hosts, start_timeout, agent), EXIT_DIAGNOSTICS);
        let waited = started.elapsed();
        assert!(waited >= start_timeout && waited < start_timeout + PROBE_TIMEOUT * 3, "stopped after {waited:?}");
    }
}
