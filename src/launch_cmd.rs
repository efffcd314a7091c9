//! `pipec launch`: the exact mpirun command that runs a plan with one process per device.

use std::path::{Path, PathBuf};

use pipec_plan::Plan;

use crate::elastic::{self, Losses, Shape};
use crate::output::write_atomic;
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

/// `pipec launch`'s arguments.
pub struct LaunchArgs<'a> {
    pub file: &'a Path,
    pub hostfile: Option<&'a Path>,
    pub out: Option<&'a Path>,
    pub exec: bool,
    pub timeout: Option<u64>,
    pub start_timeout: std::time::Duration,
    /// `--elastic`: re-plan and resume when an attempt fails.
    pub elastic: Option<Elastic>,
    /// Start the ranks with Slurm's `srun` instead of `mpirun`.
    pub slurm: bool,
}

/// `--elastic`'s bounds.
#[derive(Clone, Copy, Debug)]
pub struct Elastic {
    /// Fewer devices left than this ends the job.
    pub min_devices: usize,
    /// Restarts allowed; one more failure ends the job.
    pub max_restarts: usize,
}

/// One attempt's job: the plan, the file its ranks run (the spec, or a re-plan's
/// plan.json), the hosts of a multi-host cluster, and the checkpoint it resumes from.
#[derive(Clone)]
struct Attempt {
    plan: Plan,
    file: PathBuf,
    hosts: Option<(PathBuf, Vec<(String, usize)>)>,
    resume: Option<PathBuf>,
    out: Option<PathBuf>,
    timeout: Option<u64>,
    slurm: bool,
    /// Slurm nodes this attempt must not use (lost in an earlier one).
    exclude: Vec<String>,
    /// Where this attempt's ranks record their failures (`pipec run --record-failures`),
    /// when the launcher runs the job and watches it.
    failures: Option<PathBuf>,
}

pub fn run(args: LaunchArgs<'_>) -> u8 {
    let plan = match load_plan(args.file, false) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let hosts = match args.hostfile.map(read_hostfile).transpose() {
        Ok(h) => h,
        Err(code) => return code,
    };
    let attempt = Attempt {
        plan,
        file: args.file.to_path_buf(),
        hosts: args.hostfile.map(Path::to_path_buf).zip(hosts),
        resume: None,
        out: args.out.map(Path::to_path_buf),
        timeout: args.timeout,
        slurm: args.slurm,
        exclude: Vec::new(),
        failures: None,
    };
    if let Some(e) = args.elastic {
        return run_elastic(&args, e, attempt);
    }
    let mut attempt = attempt;
    if args.exec {
        attempt.failures = Some(failures_dir(&attempt, 1));
    }
    let (cmd, host_devices) = match command(&attempt) {
        Ok(c) => c,
        Err(code) => return code,
    };
    println!("{}", cmd.iter().map(|c| quote(c)).collect::<Vec<_>>().join(" "));
    if !args.exec {
        return 0;
    }
    supervise(&cmd, &host_devices, args.start_timeout, &agent(), attempt.failures.as_deref(), &mut || false).code
}

/// Where the ranks of attempt `n` record their failures: under its output directory (the
/// one `pipec run` writes to: `-o`, or `out/<plan name>`), one folder per attempt, so a
/// rank of an earlier attempt still ending cannot fail a later one.
fn failures_dir(a: &Attempt, n: usize) -> PathBuf {
    a.out
        .clone()
        .unwrap_or_else(|| PathBuf::from("out").join(&a.plan.name))
        .join(pipec_executor::process_run::FAILURES_DIR)
        .join(format!("attempt-{n}"))
}

/// Open MPI's launch agent (`OMPI_MCA_plm_rsh_agent`, by default ssh).
fn agent() -> String {
    std::env::var("OMPI_MCA_plm_rsh_agent").unwrap_or_else(|_| "ssh".into())
}

fn read_hostfile(h: &Path) -> Result<Vec<(String, usize)>, u8> {
    let text = crate::check_cmd::read_text(h, crate::check_cmd::MAX_SPEC_BYTES, false).map_err(|e| {
        eprintln!("error: hostfile: {e}");
        EXIT_USAGE
    })?;
    parse_hostfile(&text).map_err(|e| {
        eprintln!("error: `{}`: {e}", h.display());
        EXIT_USAGE
    })
}

/// Each host of a multi-host job, with the devices it runs in words (`node 1: d2, d3`).
type HostDevices = Vec<(String, String)>;

/// The mpirun command of an attempt, and which devices each host runs (to name them when
/// Open MPI loses a host).
fn command(a: &Attempt) -> Result<(Vec<String>, HostDevices), u8> {
    let plan = &a.plan;
    let (mut cmd, host_devices) = if a.slurm { srun(plan, &a.exclude)? } else { mpirun(a)? };
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "pipec".into());
    cmd.extend([exe, "run".into(), a.file.display().to_string(), "--transport".into(), "mpi".into()]);
    if let Some(o) = &a.out {
        cmd.push("-o".into());
        cmd.push(o.display().to_string());
    }
    if let Some(t) = a.timeout {
        cmd.push("--timeout".into());
        cmd.push(t.to_string());
    }
    if let Some(f) = &a.failures {
        cmd.push("--record-failures".into());
        cmd.push(f.display().to_string());
    }
    if let Some(r) = &a.resume {
        cmd.push("--resume".into());
        cmd.push(r.display().to_string());
    }
    Ok((cmd, host_devices))
}

/// Open MPI's `mpirun` for an attempt, up to the command it starts.
fn mpirun(a: &Attempt) -> Result<(Vec<String>, HostDevices), u8> {
    let plan = &a.plan;
    let ranks = pipec_executor::working_devices(plan).len();
    let Shape { nodes, per_node } = Shape::of(plan);
    let mut cmd: Vec<String> = vec!["mpirun".into()];
    let mut host_devices: Vec<(String, String)> = Vec::new();
    if std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false)
    {
        cmd.push("--allow-run-as-root".into());
    }
    if let Some((h, hosts)) = &a.hosts {
        if hosts.len() < nodes || hosts.iter().take(nodes).any(|(_, s)| *s != per_node) {
            eprintln!(
                "error: the plan's cluster has {nodes} node(s) of {per_node} device(s); the hostfile lists {}; give each of {nodes} host(s) `slots={per_node}` so rank i runs device i on node i / {per_node}",
                hosts.iter().map(|(h, s)| format!("{h} (slots={s})")).collect::<Vec<_>>().join(", ")
            );
            return Err(EXIT_DIAGNOSTICS);
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
    } else if ranks > crate::this_cpu::cores() {
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
    Ok((cmd, host_devices))
}

/// Slurm's `srun` for a plan, up to the command it starts: one task per device with work,
/// node by node (task i runs device i on node i / devices per node), wired to MPI through
/// PMIx, the step ended when any task fails. Inside an allocation its node count is checked
/// against the plan's (`SLURM_JOB_NUM_NODES`); `exclude` names nodes it must not use.
fn srun(plan: &Plan, exclude: &[String]) -> Result<(Vec<String>, HostDevices), u8> {
    let ranks = pipec_executor::working_devices(plan).len();
    let Shape { nodes, per_node } = Shape::of(plan);
    let allocated = std::env::var("SLURM_JOB_NUM_NODES").ok().and_then(|n| n.trim().parse::<usize>().ok());
    if let Some(have) = allocated.filter(|have| *have < nodes + exclude.len()) {
        eprintln!(
            "error: the plan's cluster has {nodes} node(s) but this Slurm allocation has {have} (SLURM_JOB_NUM_NODES){}: allocate {nodes} (`salloc --nodes={nodes} --ntasks-per-node={per_node}`)",
            if exclude.is_empty() { String::new() } else { format!(", {} of them lost", exclude.len()) }
        );
        return Err(EXIT_DIAGNOSTICS);
    }
    let mut cmd = vec![
        "srun".to_string(),
        format!("--nodes={nodes}"),
        format!("--ntasks={ranks}"),
        format!("--ntasks-per-node={per_node}"),
        "--distribution=block".into(),
        "--mpi=pmix".into(),
        "--kill-on-bad-exit=1".into(),
    ];
    if !exclude.is_empty() {
        cmd.push(format!("--exclude={}", exclude.join(",")));
    }
    Ok((cmd, HostDevices::new()))
}

/// `--elastic`: runs attempts until one succeeds. After a failure the devices it lost (a
/// rank ended by a signal; a host Open MPI lost or that no longer answers the launch agent)
/// leave the cluster, the spec is planned again for what is left ([`elastic::replan`]), and
/// the next attempt resumes from the newest complete checkpoint with the same global
/// batch. A failure that lost no device restarts the same plan. While hosts are missing,
/// each new checkpoint has them asked again; when one answers, the job is stopped and
/// planned again with it, from that checkpoint. Each re-plan is printed and recorded in
/// `metrics.jsonl`; the job stops when fewer than `min_devices` are left, when
/// `max_restarts` restarts after failures have been spent, or when the launcher is
/// interrupted.
fn run_elastic(args: &LaunchArgs<'_>, e: Elastic, mut attempt: Attempt) -> u8 {
    if !args.exec {
        eprintln!("error: --elastic supervises the job: add --exec");
        return EXIT_USAGE;
    }
    if args.file.extension().is_some_and(|x| x == "json") {
        eprintln!(
            "error: --elastic plans again from the spec when devices are lost: give the spec (.yaml), not a plan.json"
        );
        return EXIT_USAGE;
    }
    let Some(checkpoints) = attempt.plan.training.checkpoint_dir.clone() else {
        eprintln!(
            "error: --elastic resumes from the newest checkpoint: give the spec `training.checkpoint: {{ every: N }}`"
        );
        return EXIT_USAGE;
    };
    let source = match crate::check_cmd::read_spec(args.file) {
        Ok(s) => s,
        Err(err) => {
            eprintln!("error: {err}");
            return EXIT_USAGE;
        }
    };
    let base_dir = args.file.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf();
    let dir = args.out.map(Path::to_path_buf).unwrap_or_else(|| PathBuf::from("out").join(&attempt.plan.name));
    attempt.out = Some(dir.clone());
    let full = Shape::of(&attempt.plan);
    let mut shape = full;
    // the spec's hosts (the hostfile's, or the Slurm allocation's nodes in its order)
    let names: Vec<String> = if attempt.slurm {
        let list = std::env::var("SLURM_JOB_NODELIST").unwrap_or_default();
        elastic::expand_nodelist(&list).into_iter().take(full.nodes).collect()
    } else {
        attempt
            .hosts
            .as_ref()
            .map(|(_, h)| h.iter().take(full.nodes).map(|x| x.0.clone()).collect())
            .unwrap_or_default()
    };
    let mut hosts = Hosts { present: vec![true; names.len()], spec: names.clone(), names };
    let mut plans = Replanner { source, base_dir, dir: dir.clone(), made: 0, first: attempt.clone(), full };
    // an interrupt (Ctrl-C reaches mpirun and the launcher alike) ends the job, not an attempt
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        let _ = signal_hook::flag::register(sig, interrupted.clone());
    }
    let agent = agent();
    let latest = dir.join(&checkpoints).join("latest");
    let mut restarts = 0;
    let mut n = 0;
    loop {
        n += 1;
        attempt.failures = Some(failures_dir(&attempt, n));
        let (cmd, host_devices) = match command(&attempt) {
            Ok(c) => c,
            Err(code) => return code,
        };
        println!("{}", cmd.iter().map(|c| quote(c)).collect::<Vec<_>>().join(" "));
        // (a Slurm allocation does not grow: its lost nodes are not asked again)
        let missing = if attempt.slurm { HostDevices::new() } else { hosts.missing() };
        let mut comeback =
            Comeback::new((&latest, &dir.join("metrics.jsonl")), missing, args.hostfile, hosts.running(), &agent);
        let failures = attempt.failures.as_deref();
        let ended = supervise(&cmd, &host_devices, args.start_timeout, &agent, failures, &mut || comeback.poll());
        let mut change: Vec<String> = Vec::new();
        let left = if ended.stopped {
            // hosts answered: plan again with them, from the checkpoint just published
            hosts.take_back(&comeback.back, &mut change);
            Shape { nodes: hosts.running().len(), per_node: full.per_node }
        } else {
            if ended.code == 0 {
                return 0;
            }
            // a usage error (mpirun missing, a flag or file refused) fails every attempt alike
            if ended.code == EXIT_USAGE {
                return ended.code;
            }
            if interrupted.load(std::sync::atomic::Ordering::Relaxed) {
                eprintln!("error: interrupted: the job was stopped and is not restarted");
                return ended.code;
            }
            if restarts >= e.max_restarts {
                eprintln!(
                    "error: --elastic: the job failed again and its {} restart(s) are spent (--max-restarts): stopping",
                    e.max_restarts
                );
                return ended.code;
            }
            restarts += 1;
            let silent = if attempt.slurm { Vec::new() } else { silent_hosts(&host_devices, &agent) };
            let left = hosts.lose(&attempt.plan, &ended.losses, &silent, (shape, &host_devices), &mut change);
            if left.devices() < e.min_devices.max(1) {
                eprintln!(
                    "error: --elastic: {} device(s) are left after losing {}, fewer than the minimum of {} (--min-devices): stopping",
                    left.devices(),
                    change.join(", "),
                    e.min_devices.max(1)
                );
                return ended.code;
            }
            left
        };
        let checkpoint = pipec_plan::checkpoint::locate_in(&dir, Some(&checkpoints)).ok();
        let resumed_at =
            checkpoint.as_deref().and_then(|c| pipec_plan::checkpoint::completed_steps(c).ok()).unwrap_or(0);
        let (next, searched_because) = match plans.next(&attempt, checkpoint, (shape, left), &hosts) {
            Ok(n) => n,
            Err(code) => return code,
        };
        let steps_done = completed_steps_in(&dir.join("metrics.jsonl"));
        let (reason, what) = if ended.stopped {
            ("returned", format!("{} answered again", change.join(", ")))
        } else if change.is_empty() {
            ("failed", "no device identified as lost: the same plan again".to_string())
        } else {
            ("lost", format!("lost {}", change.join(", ")))
        };
        let record = elastic::replan_record(
            reason,
            &change,
            (&attempt.plan, &next.plan),
            (resumed_at, steps_done),
            searched_because.as_deref(),
        );
        if let Err(err) = pipec_plan::output::append_line(&dir.join("metrics.jsonl"), &record.to_string()) {
            eprintln!("warning: --elastic: the re-plan is not recorded: {err}");
        }
        let count = if ended.stopped { String::new() } else { format!("restart {restarts} of {}: ", e.max_restarts) };
        eprintln!(
            "elastic: {count}{what}; {} → {} (predicted step {}); resuming from step {resumed_at} ({} step(s) lost)",
            elastic::layout(&attempt.plan),
            elastic::layout(&next.plan),
            pipec_compiler::render::human_time(next.plan.simulation.step_time_s),
            steps_done.saturating_sub(resumed_at)
        );
        if let Some(why) = &searched_because {
            eprintln!(
                "elastic: the spec's strategy does not apply on {} device(s) ({why}): the search chose the new layout",
                left.devices()
            );
        }
        shape = left;
        attempt = next;
    }
}

/// An elastic job's hosts: the spec's, by node (a replacement takes a missing one's
/// place), and which of them the job runs on now.
struct Hosts {
    names: Vec<String>,
    present: Vec<bool>,
    /// The hosts the job started with.
    spec: Vec<String>,
}

impl Hosts {
    fn running(&self) -> Vec<String> {
        self.names.iter().zip(&self.present).filter(|(_, p)| **p).map(|(h, _)| h.clone()).collect()
    }

    fn missing(&self) -> HostDevices {
        let gone = self.names.iter().zip(&self.present).enumerate().filter(|(_, (_, p))| !**p);
        gone.map(|(k, (h, _))| (h.clone(), format!("node {k} of the spec"))).collect()
    }

    /// Hosts that answered rejoin; one that was not in the job takes the place of the
    /// first missing host. Each is named in `change`.
    fn take_back(&mut self, back: &[String], change: &mut Vec<String>) {
        for h in back {
            let slot = self.names.iter().position(|x| x == h).or_else(|| self.present.iter().position(|p| !p));
            if let Some(k) = slot {
                if self.names[k] != *h {
                    change.push(format!("host {h} (in place of {})", self.names[k]));
                    self.names[k] = h.clone();
                } else {
                    change.push(format!("host {h}"));
                }
                self.present[k] = true;
            }
        }
    }

    /// What a failed attempt of `plan` on a cluster of `shape` (its hosts `host_devices`)
    /// lost — the devices of the ranks a signal ended, and the hosts Open MPI or srun
    /// reported lost or that are `silent` — named in `change`; the cluster left.
    fn lose(
        &mut self,
        plan: &Plan,
        losses: &Losses,
        silent: &[String],
        (shape, host_devices): (Shape, &HostDevices),
        change: &mut Vec<String>,
    ) -> Shape {
        let working = pipec_executor::working_devices(plan);
        let mut device_nodes = Vec::new();
        for r in &losses.ranks {
            if let Some(d) = working.get(*r) {
                device_nodes.push(plan.devices.get(d.0 as usize).map_or(0, |x| x.node as usize));
                change.push(format!("{d} (rank {r})"));
            }
        }
        let mut lost_nodes = Vec::new();
        let current: Vec<usize> = (0..self.names.len()).filter(|k| self.present[*k]).collect();
        for (k, original) in current.iter().enumerate() {
            let host = &self.names[*original];
            let gone = silent.iter().any(|s| s.starts_with(&format!("host {host} ")));
            if gone || losses.host.as_deref() == Some(host.as_str()) {
                lost_nodes.push(k);
                let devices = host_devices.get(k).map_or_else(|| format!("node {k}"), |(_, d)| d.clone());
                change.push(format!("host {host} ({devices})"));
            }
        }
        // nodes are whole: on several, a node with a lost device leaves with its host
        if shape.nodes > 1 {
            for k in device_nodes.iter().chain(&lost_nodes) {
                if let Some(&original) = current.get(*k) {
                    if self.present[original] && !lost_nodes.contains(k) {
                        change.push(format!("and with it host {}", self.names[original]));
                    }
                    self.present[original] = false;
                }
            }
        } else if !lost_nodes.is_empty() {
            self.present.iter_mut().for_each(|p| *p = false);
        }
        elastic::shrink(shape, &device_nodes, &lost_nodes)
    }
}

/// Makes an elastic job's next attempt: the first one's again once the spec's cluster is
/// whole, the same plan when nothing changed, otherwise a re-plan of the spec's text whose
/// spec, plan and hostfile are written to `OUT/elastic/` (numbered by `made`).
struct Replanner {
    source: String,
    base_dir: PathBuf,
    dir: PathBuf,
    made: usize,
    first: Attempt,
    full: Shape,
}

impl Replanner {
    /// The attempt after `attempt` on `left` (after `shape`), resuming from `checkpoint`,
    /// and why the search chose its plan, if it did.
    fn next(
        &mut self,
        attempt: &Attempt,
        checkpoint: Option<PathBuf>,
        (shape, left): (Shape, Shape),
        hosts: &Hosts,
    ) -> Result<(Attempt, Option<String>), u8> {
        let moved = hosts.names != hosts.spec;
        if left == self.full && !moved {
            return Ok((Attempt { resume: checkpoint, ..self.first.clone() }, None));
        }
        let mut next = Attempt { resume: checkpoint, ..attempt.clone() };
        if left == shape && !moved {
            return Ok((next, None));
        }
        let r = elastic::replan(&self.source, &self.base_dir, left).map_err(|err| {
            eprintln!("error: --elastic: {err}: stopping");
            EXIT_DIAGNOSTICS
        })?;
        self.made += 1;
        let n = self.made;
        let elastic_dir = self.dir.join("elastic");
        let plan_path = elastic_dir.join(format!("plan-{n}.json"));
        let plan_text = pipec_plan::output::json_text(&r.plan).unwrap_or_default();
        let mut written = write_atomic(&elastic_dir.join(format!("spec-{n}.yaml")), r.text.as_bytes())
            .and_then(|()| write_atomic(&plan_path, plan_text.as_bytes()));
        if attempt.slurm {
            next.exclude =
                hosts.names.iter().zip(&hosts.present).filter(|(_, p)| !**p).map(|(h, _)| h.clone()).collect();
        } else if !hosts.names.is_empty() {
            let kept: Vec<(String, usize)> = hosts.running().into_iter().map(|h| (h, left.per_node)).collect();
            let hostfile = elastic_dir.join(format!("hostfile-{n}"));
            let text: String = kept.iter().map(|(h, s)| format!("{h} slots={s}\n")).collect();
            written = written.and_then(|()| write_atomic(&hostfile, text.as_bytes()));
            next.hosts = Some((hostfile, kept));
        }
        written.map_err(|err| {
            eprintln!("error: --elastic: {err}");
            EXIT_USAGE
        })?;
        next.plan = r.plan;
        next.file = plan_path;
        Ok((next, r.searched_because))
    }
}

/// How a supervised job ended.
struct Ended {
    /// mpirun's exit code, or the launcher's own for a job it stopped.
    code: u8,
    /// What the job lost, as Open MPI reported it.
    losses: Losses,
    /// Stopped because `stop` asked.
    stopped: bool,
}

/// Watches for hosts to take the place of those that left the job: each time a new
/// checkpoint is published, the missing hosts and any host the hostfile lists now that the
/// job does not run on (a replacement added to it) are asked, through the launch agent and
/// in the background, whether they answer.
struct Comeback {
    latest: PathBuf,
    /// The job's `metrics.jsonl`: the job stops only once it records every step of the
    /// checkpoint it resumes from.
    metrics: PathBuf,
    seen: Option<String>,
    missing: HostDevices,
    /// The hostfile, read again at each checkpoint, and the hosts the job runs on now.
    hostfile: Option<PathBuf>,
    present: Vec<String>,
    agent: String,
    probe: Option<std::thread::JoinHandle<(Vec<String>, Vec<String>)>>,
    /// The hosts that answered, at most as many as are missing (missing ones first).
    back: Vec<String>,
    /// When hosts answered: from then the job stops as soon as its metrics are recorded.
    answered: Option<std::time::Instant>,
}

impl Comeback {
    fn new(
        (latest, metrics): (&Path, &Path),
        missing: HostDevices,
        hostfile: Option<&Path>,
        present: Vec<String>,
        agent: &str,
    ) -> Self {
        let seen = std::fs::read_to_string(latest).ok();
        Comeback {
            latest: latest.to_path_buf(),
            metrics: metrics.to_path_buf(),
            seen,
            missing,
            hostfile: hostfile.map(Path::to_path_buf),
            present,
            agent: agent.to_string(),
            probe: None,
            back: Vec::new(),
            answered: None,
        }
    }

    /// The hosts to ask: the missing ones, then those the hostfile lists that the job does
    /// not run on.
    fn candidates(&self) -> HostDevices {
        let mut c = self.missing.clone();
        let listed = self
            .hostfile
            .as_ref()
            .and_then(|h| std::fs::read_to_string(h).ok())
            .and_then(|t| parse_hostfile(&t).ok())
            .unwrap_or_default();
        for (h, _) in listed {
            if !self.present.contains(&h) && !c.iter().any(|(x, _)| *x == h) {
                c.push((h, "listed in the hostfile".into()));
            }
        }
        c
    }

    /// True when a host answered after a checkpoint: the job should stop to grow. It is
    /// true once `metrics.jsonl` records every step the newest checkpoint holds (rank 0
    /// writes a step's line after its checkpoint: a job stopped between the two would
    /// resume past a step no line records), or [`RECORD_WAIT`] after the answer.
    fn poll(&mut self) -> bool {
        if self.missing.is_empty() {
            return false;
        }
        if let Some(t) = self.answered {
            return t.elapsed() > RECORD_WAIT || self.recorded();
        }
        if self.probe.as_ref().is_some_and(|p| p.is_finished()) {
            let (asked, silent) = self.probe.take().and_then(|p| p.join().ok()).unwrap_or_default();
            self.back = asked
                .into_iter()
                .filter(|h| !silent.iter().any(|s| s.starts_with(&format!("host {h} "))))
                .take(self.missing.len())
                .collect();
            if self.back.is_empty() {
                return false;
            }
            self.answered = Some(std::time::Instant::now());
            return self.recorded();
        }
        let now = std::fs::read_to_string(&self.latest).ok();
        if self.probe.is_none() && now.is_some() && now != self.seen {
            self.seen = now;
            let (candidates, agent) = (self.candidates(), self.agent.clone());
            self.probe = Some(std::thread::spawn(move || {
                let silent = silent_hosts(&candidates, &agent);
                (candidates.into_iter().map(|(h, _)| h).collect(), silent)
            }));
        }
        false
    }

    /// Whether `metrics.jsonl` records every step of the checkpoint `latest` names (true
    /// when either cannot be read: nothing is waited for that may never come).
    fn recorded(&self) -> bool {
        let steps = std::fs::read_to_string(&self.latest).ok().and_then(|name| {
            let dir = self.latest.parent()?.join(name.trim());
            pipec_plan::checkpoint::completed_steps(&dir).ok()
        });
        steps.is_none_or(|n| completed_steps_in(&self.metrics) >= n)
    }
}

/// How long a job that is to grow may run on for its newest checkpoint's steps to be
/// recorded in `metrics.jsonl` (rank 0 writes each line once every rank has sent its
/// step's figures).
const RECORD_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// The steps the metrics file `path` records as completed (its last step + 1).
fn completed_steps_in(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .map(|s| s as usize + 1)
        .max()
        .unwrap_or(0)
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
/// `stop` is asked every 100 ms once the job runs; when it says so, mpirun is stopped.
fn supervise(
    cmd: &[String],
    host_devices: &[(String, String)],
    start_timeout: std::time::Duration,
    agent: &str,
    failures: Option<&Path>,
    stop: &mut dyn FnMut() -> bool,
) -> Ended {
    // the ranks' failure records of an earlier attempt are not this one's
    if let Some(f) = failures {
        let _ = std::fs::remove_dir_all(f);
    }
    use std::io::BufRead;
    use std::sync::atomic::{AtomicBool, Ordering};
    let mut child =
        match std::process::Command::new(&cmd[0]).args(&cmd[1..]).stderr(std::process::Stdio::piped()).spawn() {
            Ok(c) => c,
            Err(e) => {
                let hint = if cmd[0] == "srun" {
                    "Slurm's srun runs on a Slurm cluster"
                } else {
                    "install Open MPI: apt-get install openmpi-bin"
                };
                eprintln!("error: cannot start {}: {e} ({hint})", cmd[0]);
                return Ended { code: EXIT_USAGE, losses: Losses::default(), stopped: false };
            }
        };
    let launched_at = std::time::Instant::now();
    let aborted = std::sync::Arc::new(AtomicBool::new(false));
    let started = std::sync::Arc::new(AtomicBool::new(false));
    let losses = std::sync::Arc::new(std::sync::Mutex::new(Losses::default()));
    let reader = child.stderr.take().map(|stderr| {
        let aborted = aborted.clone();
        let started = started.clone();
        let losses = losses.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.starts_with(pipec_executor::MPI_STARTED) {
                    started.store(true, Ordering::Relaxed);
                    continue;
                }
                eprintln!("{line}");
                if let Ok(mut l) = losses.lock() {
                    l.read(&line);
                    if l.host.is_some() {
                        aborted.store(true, Ordering::Relaxed);
                    }
                }
                // a rank's own failure line (`mpi_run::report_failure`), or Open MPI's banner
                if line.starts_with("error: rank ") || line.contains("MPI_ABORT was invoked") {
                    aborted.store(true, Ordering::Relaxed);
                }
            }
        })
    });
    let name_lost_host = || {
        let host = losses.lock().ok().and_then(|l| l.host.clone());
        if let Some(host) = host {
            let devices =
                host_devices.iter().find(|(h, _)| *h == host).map(|(_, d)| format!(" ({d})")).unwrap_or_default();
            eprintln!("error: Open MPI lost host {host}{devices}: it stopped answering (host down or link lost), so the job was ended");
            return true;
        }
        false
    };
    let lost = || losses.lock().map(|l| l.clone()).unwrap_or_default();
    let mut since: Option<std::time::Instant> = None;
    // a failure a rank on this host recorded (`process_run::record_failures_in`), which
    // mpirun, blocked on a host it cannot reach, may not have forwarded: it starts the
    // same grace period as the rank's own line would
    let recorded = |aborted: &AtomicBool| {
        let Some(entries) = failures.and_then(|f| std::fs::read_dir(f).ok()) else { return };
        for path in entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "txt")) {
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            for line in text.lines() {
                eprintln!("{line} (recorded in {})", path.display());
                if let Ok(mut l) = losses.lock() {
                    l.read(line);
                }
            }
            aborted.store(true, Ordering::Relaxed);
        }
    };
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                // everything mpirun printed has been read before naming what was lost — but
                // within the grace period: a child of mpirun (its ssh to a host it lost) can
                // hold the pipe open after mpirun has ended, and the job must end anyway
                if let Some(r) = reader {
                    let until = std::time::Instant::now() + ABORT_GRACE;
                    while !r.is_finished() && std::time::Instant::now() < until {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    if r.is_finished() {
                        let _ = r.join();
                    }
                }
                let host_lost = name_lost_host();
                let code = match status.code() {
                    Some(0) if host_lost => EXIT_DIAGNOSTICS,
                    Some(c) => c.clamp(0, 255) as u8,
                    None => EXIT_DIAGNOSTICS,
                };
                return Ended { code, losses: lost(), stopped: false };
            }
            Ok(None) => {}
            Err(e) => {
                eprintln!("error: cannot wait for mpirun: {e}");
                return Ended { code: EXIT_USAGE, losses: lost(), stopped: false };
            }
        }
        if !aborted.load(Ordering::Relaxed) {
            recorded(&aborted);
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
                return Ended { code: EXIT_DIAGNOSTICS, losses: lost(), stopped: false };
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
            return Ended { code: EXIT_DIAGNOSTICS, losses: lost(), stopped: false };
        } else if started.load(Ordering::Relaxed) && stop() {
            stop_gracefully(&mut child);
            return Ended { code: EXIT_DIAGNOSTICS, losses: lost(), stopped: true };
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// How long a job asked to stop (SIGTERM to mpirun or srun, which forward it to every
/// rank) may take to end before it is killed.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Stops the job `child` runs as a signal would: SIGTERM reaches every rank, which stop at
/// the next step boundary they agree on and write a checkpoint of it (`pipec run`'s
/// stop), so a job stopped to grow loses no step. Killed if it has not ended
/// [`STOP_WAIT`] later. (Open MPI itself kills a rank one second after forwarding the
/// signal, `odls_base_sigkill_timeout`: a longer checkpoint is cut short there, and the
/// job resumes from its last periodic one.)
fn stop_gracefully(child: &mut std::process::Child) {
    let asked = std::time::Instant::now();
    if let Ok(pid) = libc::pid_t::try_from(child.id()) {
        // SAFETY: kill(2) touches no memory; the pid is a child not yet waited for, so it
        // names no other process
        #[allow(unsafe_code)]
        unsafe {
            libc::kill(pid, libc::SIGTERM)
        };
    }
    while asked.elapsed() < STOP_WAIT {
        if !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
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
    fn a_replacement_listed_in_the_hostfile_is_asked_after_the_next_checkpoint() {
        let dir = tempfile::tempdir().expect("tmp");
        let latest = dir.path().join("latest");
        std::fs::write(&latest, "step-000005").expect("w");
        let hostfile = dir.path().join("hosts");
        std::fs::write(&hostfile, "a slots=1\nb slots=1\n").expect("w");
        // the launch agent: only `spare` answers
        let agent = dir.path().join("agent.sh");
        std::fs::write(&agent, "#!/bin/sh\n[ \"$1\" = spare ]\n").expect("w");
        assert!(std::process::Command::new("chmod").arg("+x").arg(&agent).status().expect("chmod").success());
        let missing = vec![("b".to_string(), "node 1 of the spec".to_string())];
        let metrics = dir.path().join("metrics.jsonl");
        let agent = agent.display().to_string();
        let mut c = Comeback::new((&latest, &metrics), missing, Some(&hostfile), vec!["a".into()], &agent);
        assert!(!c.poll(), "nothing is asked before a new checkpoint");
        // b is listed but silent; the hostfile then gains `spare`, and a checkpoint comes
        std::fs::write(&hostfile, "a slots=1\nb slots=1\nspare slots=1\n").expect("w");
        std::fs::write(&latest, "step-000010").expect("w");
        let start = std::time::Instant::now();
        while !c.poll() {
            assert!(start.elapsed() < std::time::Duration::from_secs(30), "no answer");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(c.back, vec!["spare".to_string()]);
    }

    /// A host answers just after a checkpoint is published, before rank 0 has written the
    /// line of the checkpoint's last step: the job is not stopped until that line is
    /// written (stopped at once, it would resume past a step no line records).
    #[test]
    fn a_job_grows_only_once_its_newest_checkpoints_steps_are_recorded() {
        let dir = tempfile::tempdir().expect("tmp");
        let checkpoints = dir.path().join("checkpoints");
        let step = checkpoints.join("step-000010");
        std::fs::create_dir_all(&step).expect("dir");
        std::fs::write(step.join("state.json"), r#"{"completed_steps": 10}"#).expect("w");
        let latest = checkpoints.join("latest");
        let metrics = dir.path().join("metrics.jsonl");
        let lines = |n: usize| (0..n).map(|s| format!("{{\"step\": {s}, \"loss\": 1.0}}\n")).collect::<String>();
        std::fs::write(&metrics, lines(9)).expect("w");
        let missing = vec![("b".to_string(), "node 1 of the spec".to_string())];
        let mut c = Comeback::new((&latest, &metrics), missing, None, vec!["a".into()], "true");
        std::fs::write(&latest, "step-000010").expect("w");
        let start = std::time::Instant::now();
        while c.answered.is_none() {
            assert!(!c.poll(), "step 9 is not recorded yet");
            assert!(start.elapsed() < std::time::Duration::from_secs(30), "no answer");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(c.back, vec!["b".to_string()]);
        assert!(!c.poll() && !c.poll(), "step 9 is still not recorded");
        std::fs::write(&metrics, lines(10)).expect("w");
        assert!(c.poll(), "every step of the checkpoint is recorded");
    }

    /// A job stopped by the launcher is asked first, as a signal asks it: mpirun gets
    /// SIGTERM (it forwards it to every rank), and the job's own ending is waited for.
    #[test]
    fn a_stopped_job_gets_sigterm_and_ends_on_its_own() {
        let dir = tempfile::tempdir().expect("tmp");
        let ended = dir.path().join("ended");
        let fake = format!(
            "trap 'echo checkpointed > {e}; exit 130' TERM; echo '{s} 2 ranks' >&2; while true; do sleep 0.05; done",
            e = ended.display(),
            s = pipec_executor::MPI_STARTED
        );
        let cmd: Vec<String> = vec!["sh".into(), "-c".into(), fake];
        let started = std::time::Instant::now();
        let mut polls = 0;
        let out = supervise(&cmd, &[], std::time::Duration::from_secs(60), "ssh", None, &mut || {
            polls += 1;
            polls > 3
        });
        assert!(out.stopped);
        assert_eq!(std::fs::read_to_string(&ended).ok().as_deref(), Some("checkpointed\n"), "the trap ran");
        assert!(started.elapsed() < STOP_WAIT, "ended on its own after {:?}", started.elapsed());
    }

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
        let code = supervise(&cmd, &hosts, std::time::Duration::from_secs(60), "ssh", None, &mut || false).code;
        assert_eq!(code, EXIT_DIAGNOSTICS);
        let waited = started.elapsed();
        assert!(waited >= ABORT_GRACE && waited < ABORT_GRACE * 6, "stopped after {waited:?}");
    }

    /// An mpirun that has ended while a child of it (its ssh to a lost host) still holds its
    /// output open ends the job within the grace period, with mpirun's exit code and what
    /// it printed read.
    #[test]
    fn an_ended_mpirun_whose_child_holds_its_output_is_not_waited_for() {
        let fake = "echo 'error: rank 1 of 2 (device d1): nothing arrived from d0 within 4 s' >&2; sleep 30 >/dev/null & exit 3";
        let cmd: Vec<String> = ["sh", "-c", fake].map(String::from).to_vec();
        let started = std::time::Instant::now();
        let ended = supervise(&cmd, &[], std::time::Duration::from_secs(60), "ssh", None, &mut || false);
        assert_eq!(ended.code, 3);
        let waited = started.elapsed();
        assert!(waited < ABORT_GRACE * 3, "returned after {waited:?}");
    }

    /// An mpirun that forwards nothing (its event loop blocked on a host it cannot reach)
    /// while a rank on this host records its failure in the output directory is stopped
    /// after the grace period; the recorded line is printed and read for what was lost, and
    /// a record of an earlier attempt does not count.
    #[test]
    fn a_failure_recorded_by_a_rank_stops_a_silent_mpirun() {
        let dir = tempfile::tempdir().expect("tmp");
        let failures = dir.path().join(pipec_executor::process_run::FAILURES_DIR);
        std::fs::create_dir_all(&failures).expect("dir");
        std::fs::write(failures.join("rank-1.txt"), "error: rank 1 of 2: an earlier attempt's\n").expect("stale");
        // the rank's record appears a second after start; mpirun says nothing and hangs
        let fake = format!(
            "sleep 1; mkdir -p '{f}'; echo 'error: rank 0 of 2 (device d0): nothing arrived from d1 within 4 s' > '{f}/rank-0.txt'; exec sleep 120",
            f = failures.display()
        );
        let cmd: Vec<String> = vec!["sh".into(), "-c".into(), fake];
        let started = std::time::Instant::now();
        let hosts = [("10.0.0.2".to_string(), "node 1: d1".to_string())];
        let ended = supervise(&cmd, &hosts, std::time::Duration::from_secs(60), "ssh", Some(&failures), &mut || false);
        assert_eq!(ended.code, EXIT_DIAGNOSTICS);
        let waited = started.elapsed();
        assert!(waited >= ABORT_GRACE && waited < ABORT_GRACE * 6, "stopped after {waited:?}");
        assert!(!failures.join("rank-1.txt").exists(), "the earlier attempt's record was cleared");
        // without the record the same mpirun is waited for (stopped here by `stop`)
        let started_line = format!("echo '{} 2 ranks' >&2; exec sleep 120", pipec_executor::MPI_STARTED);
        let cmd: Vec<String> = vec!["sh".into(), "-c".into(), started_line];
        let mut polls = 0;
        let ended = supervise(&cmd, &hosts, std::time::Duration::from_secs(60), "ssh", Some(&failures), &mut || {
            polls += 1;
            polls > 30
        });
        assert!(ended.stopped, "nothing recorded: not aborted");
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
        assert_eq!(supervise(&cmd, &hosts, start_timeout, agent, None, &mut || false).code, EXIT_DIAGNOSTICS);
        let waited = started.elapsed();
        assert!(waited >= start_timeout && waited < start_timeout + PROBE_TIMEOUT * 3, "stopped after {waited:?}");
    }
}
