//! MPI across two hosts for real: two network namespaces on this machine joined by a veth
//! pair stand for two hosts, Open MPI's TCP transport only, launched through `pipec launch`
//! with a hostfile and an rsh agent that enters each namespace. Needs root (network
//! namespaces) and Open MPI; where namespaces cannot be made the test says so and passes.

#![cfg(feature = "mpi")]

mod common;
use common::replans;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn pipec() -> &'static str {
    env!("CARGO_BIN_EXE_pipec")
}

/// `pipec`, planned with the specs' own device figures (no measurement of this machine's CPU).
fn pipec_command() -> Command {
    let mut c = Command::new(pipec());
    c.env("PIPEC_CPU_CALIBRATION", "off");
    c
}

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Two namespaces `a` and `b` with 10.78.0.1 and 10.78.0.2 on a veth pair; removed (with
/// every process left in them) on drop.
struct TwoHosts {
    a: String,
    b: String,
    veth_a: String,
}

impl TwoHosts {
    fn new() -> Option<TwoHosts> {
        let id = std::process::id() % 100_000;
        let (a, b) = (format!("pipec-a{id}"), format!("pipec-b{id}"));
        let (va, vb) = (format!("pva{id}"), format!("pvb{id}"));
        if !sh(&["ip", "netns", "add", &a]) {
            return None;
        }
        let hosts = TwoHosts { a: a.clone(), b: b.clone(), veth_a: va.clone() };
        let ok = sh(&["ip", "netns", "add", &b])
            && sh(&["ip", "link", "add", &va, "type", "veth", "peer", "name", &vb])
            && sh(&["ip", "link", "set", &va, "netns", &a])
            && sh(&["ip", "link", "set", &vb, "netns", &b])
            && sh(&["ip", "netns", "exec", &a, "ip", "addr", "add", "10.78.0.1/24", "dev", &va])
            && sh(&["ip", "netns", "exec", &b, "ip", "addr", "add", "10.78.0.2/24", "dev", &vb])
            && [(&a, &va), (&b, &vb)].iter().all(|(ns, dev)| {
                sh(&["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
                    && sh(&["ip", "netns", "exec", ns, "ip", "link", "set", dev, "up"])
            });
        ok.then_some(hosts)
    }

    fn link_down(&self) {
        assert!(sh(&["ip", "netns", "exec", &self.a, "ip", "link", "set", &self.veth_a, "down"]), "link down");
    }

    fn link_up(&self) {
        assert!(sh(&["ip", "netns", "exec", &self.a, "ip", "link", "set", &self.veth_a, "up"]), "link up");
    }

    /// The rsh agent Open MPI starts its remote daemon with: it enters the host's namespace,
    /// after making sure, as ssh would by connecting, that host a's link to it is up (ssh
    /// waits minutes on a host it cannot reach; so does this).
    fn agent(&self, dir: &Path) -> PathBuf {
        let path = dir.join("agent.sh");
        let script = format!(
            "#!/bin/sh\nhost=\"$1\"; shift\ncase \"$host\" in 10.78.0.1) ns={} ;; 10.78.0.2) ns={} ;; *) echo \"unknown host $host\" >&2; exit 1 ;; esac\n[ \"$ns\" = {} ] || ip -netns {} link show {} | grep -q ',UP' || exec sleep 600\nexec ip netns exec \"$ns\" sh -c \"$*\"\n",
            self.a, self.b, self.a, self.a, self.veth_a
        );
        std::fs::write(&path, script).expect("agent");
        assert!(sh(&["chmod", "+x", path.to_str().expect("p")]));
        path
    }

    /// `pipec launch --exec` from host a, with Open MPI on TCP over the veth pair only.
    fn launch(&self, dir: &Path, spec: &Path, out: &Path, timeout: u64) -> Command {
        self.launch_within(dir, spec, out, timeout, 120)
    }

    /// [`TwoHosts::launch`] with a start-up bound of `start` seconds.
    fn launch_within(&self, dir: &Path, spec: &Path, out: &Path, timeout: u64, start: u64) -> Command {
        let mut c = self.launch_bare(dir, spec, out);
        c.args(["--exec", "--timeout", &timeout.to_string(), "--start-timeout", &start.to_string()]);
        c
    }

    /// `pipec launch SPEC --hostfile … -o OUT` from host a, before its flags.
    fn launch_bare(&self, dir: &Path, spec: &Path, out: &Path) -> Command {
        let hostfile = dir.join("hosts");
        std::fs::write(&hostfile, "10.78.0.1 slots=1\n10.78.0.2 slots=1\n").expect("hostfile");
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.a, pipec(), "launch"])
            .arg(spec)
            .arg("--hostfile")
            .arg(&hostfile)
            .arg("-o")
            .arg(out)
            .env("OMPI_MCA_plm_rsh_agent", self.agent(dir))
            .env("OMPI_MCA_btl", "tcp,self")
            .env("OMPI_MCA_btl_tcp_if_include", "10.78.0.0/24")
            .env("OMPI_MCA_oob_tcp_if_include", "10.78.0.0/24")
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = sh(&["kill", "-9", pid]);
                }
            }
            let _ = sh(&["ip", "netns", "del", ns]);
        }
    }
}

/// A plan of two nodes with one device each, `steps` steps.
fn spec(dir: &Path, steps: usize) -> PathBuf {
    let text = format!(
        "name: two-hosts\nmodel:\n  input: [16]\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 2: linear(32, 32) -> relu\n    - linear(32, 4)\n  loss: cross_entropy\ncluster:\n  nodes: 2\n  devices_per_node: 1\n  device: {{ memory: 1GiB, throughput: 10GFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\n    inter_node: {{ bandwidth: 1GB/s, latency: 50us }}\nstrategy:\n  stages: straight\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: {steps}\n  optimizer: {{ kind: adam, lr: 0.005 }}\n  seed: 3\n"
    );
    let path = dir.join(format!("two-{steps}.yaml"));
    std::fs::write(&path, text).expect("spec");
    path
}

fn losses(dir: &Path) -> Vec<f64> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("json")["loss"].as_f64().expect("loss"))
        .collect()
}

#[test]
// every path that gives up on the job kills and waits for it; the lint cannot follow the
// helper closure that does so
#[allow(clippy::zombie_processes)]
fn two_hosts_train_like_one_and_a_link_down_stops_the_job_naming_the_peer() {
    let Some(hosts) = TwoHosts::new() else {
        eprintln!("SKIP: network namespaces cannot be made here (needs root and CAP_NET_ADMIN)");
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    // the same losses as the threaded run
    let short = spec(dir.path(), 6);
    let threads = dir.path().join("threads");
    let out: Output = pipec_command().arg("run").arg(&short).arg("-o").arg(&threads).output().expect("runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let mpi = dir.path().join("mpi");
    let out = hosts.launch(dir.path(), &short, &mpi, 10).output().expect("launch runs");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(losses(&threads).len(), 6);
    assert_eq!(losses(&threads), losses(&mpi), "two hosts train to the threaded run's losses");
    // the link goes down mid-run: the job ends within the timeout, naming the lost peer
    let long = spec(dir.path(), 1_000_000);
    let run = dir.path().join("long");
    let log = dir.path().join("long.log");
    let mut child = hosts
        .launch(dir.path(), &long, &run, 4)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("starts");
    // never wait on a job that does not end: kill it, then fail
    let mut wait_until = |deadline: Instant, what: &str, done: &dyn Fn() -> bool| {
        while !done() {
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{what}:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_until(Instant::now() + Duration::from_secs(180), "no steps after 180 s", &|| losses(&run).len() >= 3);
    hosts.link_down();
    let down = Instant::now();
    let mut status = None;
    while status.is_none() {
        status = child.try_wait().expect("wait");
        if status.is_none() && down.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!(
                "the job still ran 60 s after its link went down:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.expect("ended").success(), "{stderr}");
    // whichever notices first names the peer: a rank's receive timeout, or Open MPI losing
    // the other host's daemon (named by `pipec launch` with the devices it ran)
    assert!(
        stderr.contains("nothing arrived from d1")
            || stderr.contains("nothing arrived from d0")
            || stderr.contains("(node 1: d1)")
            || stderr.contains("(node 0: d0)"),
        "{stderr}"
    );
    eprintln!("the job ended {:.1} s after the link went down (timeout 4 s)", down.elapsed().as_secs_f64());
}

#[test]
fn a_host_unreachable_at_start_up_stops_the_launch_naming_it() {
    // no rank starts, so neither a rank's receive timeout nor the abort grace applied, and
    // `pipec launch --exec` still ran at 240 s
    let Some(hosts) = TwoHosts::new() else {
        eprintln!("SKIP: network namespaces cannot be made here (needs root and CAP_NET_ADMIN)");
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    hosts.link_down();
    let start = Instant::now();
    let mut child = hosts
        .launch_within(dir.path(), &spec(dir.path(), 4), &dir.path().join("out"), 4, 8)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starts");
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the launch still ran 60 s after it began (start-up bound 8 s)");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().expect("ended");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("had not started 8 s after launch"), "{stderr}");
    assert!(stderr.contains("host 10.78.0.2 (node 1: d1) did not answer"), "{stderr}");
    assert!(!stderr.contains("host 10.78.0.1 (node 0"), "the reachable host is not named: {stderr}");
    eprintln!("the launch ended {:.1} s after it began (start-up bound 8 s)", start.elapsed().as_secs_f64());
}

/// `--elastic` across the two hosts: host b is cut off mid-run, the launcher finds it no
/// longer answers, plans again for host a alone (the spec's `straight` still applies) and
/// resumes from the newest checkpoint; the steps from it equal a fresh resume of it on
/// that plan. Then the link comes back: at the next checkpoint the launcher finds host b
/// answering, stops the job as a signal does (at a step boundary, with a checkpoint of
/// it: no step is lost) and resumes it on both hosts, as a fresh resume of that
/// checkpoint on the spec's own plan would.
#[test]
fn an_elastic_job_goes_on_without_a_host_that_was_cut_off_and_grows_when_it_returns() {
    let Some(hosts) = TwoHosts::new() else {
        eprintln!("SKIP: network namespaces cannot be made here (needs root and CAP_NET_ADMIN)");
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let steps = 800;
    let text = std::fs::read_to_string(spec(dir.path(), steps))
        .expect("spec")
        .replace("  seed: 3\n", "  seed: 3\n  checkpoint: { every: 5 }\n");
    let spec_path = dir.path().join("elastic.yaml");
    std::fs::write(&spec_path, text).expect("spec");
    let out = dir.path().join("out");
    let log = dir.path().join("elastic.log");
    let mut child = hosts
        .launch_bare(dir.path(), &spec_path, &out)
        .args(["--exec", "--elastic", "--timeout", "4"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log"))
        .spawn()
        .expect("starts");
    let step_lines = || common::steps(&out);
    let start = Instant::now();
    while step_lines().len() < 7 {
        if start.elapsed() > Duration::from_secs(60) || child.try_wait().expect("wait").is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("no step 7 to cut the link at:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    hosts.link_down();
    let down = Instant::now();
    let events = || replans(&out);
    let mut up = false;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if !up && !events().is_empty() {
            hosts.link_up();
            up = true;
        }
        if down.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the elastic job had not ended 180 s after the link went down:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stderr = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("lost host 10.78.0.2 (node 1: d1)"), "{stderr}");
    let events = events();
    assert_eq!(events.len(), 2, "{stderr}");
    let e = &events[0];
    assert_eq!(e["reason"], "lost", "{e}");
    assert_eq!((e["old_devices"].as_u64(), e["new_devices"].as_u64()), (Some(2), Some(1)), "{e}");
    assert!(e.get("searched_because").is_none(), "straight applies on one device: {e}");
    assert_eq!(std::fs::read_to_string(out.join("elastic/hostfile-1")).expect("hostfile"), "10.78.0.1 slots=1\n");
    let trained = step_lines();
    assert_eq!(trained.iter().map(|s| s.0).collect::<Vec<_>>(), (0..steps as u64).collect::<Vec<_>>());
    // a fresh resume of the same checkpoint on the re-planned (one-device) plan
    let resumed = e["resume_step"].as_u64().expect("resume step") as usize;
    assert!(resumed >= 5, "{e}");
    // (step, loss) of a fresh `pipec run FILE --resume` of the checkpoint after `step` steps
    let resume_afresh = |file: &Path, step: usize, name: &str| {
        let fresh = dir.path().join(name);
        let run = pipec_command()
            .arg("run")
            .arg(file)
            .arg("--resume")
            .arg(out.join(format!("checkpoints/step-{step:06}")))
            .arg("-o")
            .arg(&fresh)
            .output()
            .expect("runs");
        assert_eq!(run.status.code(), Some(0), "{}", String::from_utf8_lossy(&run.stderr));
        common::steps(&fresh)
    };
    let again = resume_afresh(&out.join("elastic/plan-1.json"), resumed, "fresh");
    let grown = &events[1];
    assert_eq!(grown["reason"], "returned", "{grown}");
    assert_eq!((grown["old_devices"].as_u64(), grown["new_devices"].as_u64()), (Some(1), Some(2)), "{grown}");
    assert!(stderr.contains("host 10.78.0.2 answered again"), "{stderr}");
    let regrown = grown["resume_step"].as_u64().expect("resume step") as usize;
    assert!(regrown > resumed, "{grown}");
    assert_eq!(grown["steps_lost"].as_u64(), Some(0), "{grown}");
    assert_eq!(trained[resumed..regrown].to_vec(), again[..regrown - resumed].to_vec());
    // from the second checkpoint on, the spec's own two-device plan (in one process: the
    // threaded run equals MPI's)
    assert_eq!(trained[regrown..].to_vec(), resume_afresh(&spec_path, regrown, "fresh-grown"));
    eprintln!("re-planned twice and finished {:.1} s after the link went down", down.elapsed().as_secs_f64());
}
