//! `pipec launch --elastic`: what the launcher does between two attempts of a job — which
//! devices a failed attempt lost, the cluster that is left, the plan for it (the spec's
//! strategy when it still applies, otherwise the strategy search) and the record of the
//! re-plan in `metrics.jsonl`.
//!
//! A re-plan edits the spec's text, not its parsed form: the values of `cluster.nodes` and
//! `cluster.devices_per_node` (and, when the spec's strategy no longer applies, the
//! `strategy` value, which becomes `auto`) are replaced where they are written, and the
//! result goes through `check` and `compile` like any spec. So every rule a spec obeys
//! holds for the re-planned one, and the file written beside the run
//! (`elastic/spec-N.yaml`) is the user's spec with those values changed.

use std::path::Path;

use pipec_compiler::{compile, CompileOptions};
use pipec_grammar::yaml::{self, Node};
use pipec_grammar::{splice, Span};
use pipec_plan::Plan;

/// A cluster's shape as a spec writes it: nodes × devices per node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub nodes: usize,
    pub per_node: usize,
}

impl Shape {
    /// The cluster a plan was compiled for: its nodes, and the devices on each (devices are
    /// numbered node by node, every node alike).
    pub fn of(plan: &Plan) -> Shape {
        Shape {
            nodes: plan.devices.iter().map(|d| d.node as usize + 1).max().unwrap_or(1),
            per_node: plan.devices.iter().filter(|d| d.node == 0).count().max(1),
        }
    }

    pub fn devices(&self) -> usize {
        self.nodes * self.per_node
    }
}

/// The value of `key` in a mapping node.
fn get<'a>(map: &'a Node, key: &str) -> Option<&'a Node> {
    map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

/// `source` with its cluster resized to `shape`: the values of `cluster.nodes` and
/// `cluster.devices_per_node` replaced where they are written. A spec without a `nodes` key
/// has one node, and can only keep it.
pub fn resize(source: &str, shape: Shape) -> Result<String, String> {
    let root = yaml::parse(source).map_err(|e| format!("the spec no longer parses: {}", e.message))?;
    let cluster = get(&root, "cluster").ok_or("the spec has no `cluster`")?;
    let per_node = get(cluster, "devices_per_node").ok_or("the spec's cluster has no `devices_per_node`")?;
    let mut edits = vec![(per_node.span, shape.per_node.to_string())];
    match get(cluster, "nodes") {
        Some(nodes) => edits.push((nodes.span, shape.nodes.to_string())),
        None if shape.nodes == 1 => {}
        None => return Err(format!("the spec's cluster has no `nodes` key to set to {}", shape.nodes)),
    }
    Ok(splice(source, edits))
}

/// `source` with its strategy replaced by `auto` (the strategy search).
fn searched(source: &str) -> Result<String, String> {
    let root = yaml::parse(source).map_err(|e| format!("the spec no longer parses: {}", e.message))?;
    let (key, value) = root
        .as_map()
        .and_then(|m| m.iter().find(|(k, _)| k.as_str() == Some("strategy")))
        .ok_or("the spec has no `strategy`")?;
    // from the key's end: a block mapping's lines go with their value
    Ok(splice(source, vec![(Span::new(key.span.end, value.span.end), ": auto".into())]))
}

/// Checks and compiles a spec's text (relative paths from `base_dir`): its plan, or its
/// first error.
pub fn compile_text(text: &str, base_dir: &Path) -> Result<Plan, String> {
    let checked = pipec_grammar::check_source_in(text, Some(base_dir));
    if let Some(d) = checked.diagnostics.iter().find(|d| d.is_error()) {
        return Err(format!("{} {}", d.code, d.message));
    }
    let spec = checked.spec.ok_or("the spec does not check")?;
    let options = CompileOptions { profile: None, base_dir: Some(base_dir.to_path_buf()), source: Some(text.into()) };
    let result = compile(&spec, &options);
    if let Some(d) = result.diagnostics.iter().find(|d| d.is_error()) {
        return Err(format!("{} {}", d.code, d.message));
    }
    result.compiled.map(|c| c.plan).ok_or_else(|| "the spec does not compile".into())
}

/// A plan for the cluster that is left.
pub struct Replanned {
    /// The spec's text for that cluster (and strategy).
    pub text: String,
    pub plan: Plan,
    /// Why the spec's own strategy did not apply (then the search chose this one).
    pub searched_because: Option<String>,
}

/// Plans `source` (the spec's text, relative paths from `base_dir`) on a cluster of `shape`:
/// with the spec's strategy when it still checks, compiles and fits, otherwise with the
/// strategy search.
pub fn replan(source: &str, base_dir: &Path, shape: Shape) -> Result<Replanned, String> {
    let text = resize(source, shape)?;
    let kept = match compile_text(&text, base_dir) {
        Ok(plan) => return Ok(Replanned { text, plan, searched_because: None }),
        Err(e) => e,
    };
    let text = searched(&text)?;
    match compile_text(&text, base_dir) {
        Ok(plan) => Ok(Replanned { text, plan, searched_because: Some(kept) }),
        Err(e) => Err(format!(
            "no plan for {} device(s): the spec's strategy does not apply ({kept}), and the search found none ({e})",
            shape.devices()
        )),
    }
}

/// A plan's layout in words: `"2-1-1" 1f1b, 4 microbatches on 4 device(s)`.
pub fn layout(plan: &Plan) -> String {
    format!(
        "\"{}\" {}, {} microbatches on {} device(s)",
        plan.partition,
        plan.schedule.kind,
        plan.training.microbatches,
        pipec_executor::working_devices(plan).len()
    )
}

/// What one failed attempt lost, read from mpirun's output.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Losses {
    /// Ranks whose process ended on a signal (Open MPI: "process rank N … exited on signal").
    pub ranks: Vec<usize>,
    /// The host Open MPI lost the daemon of ("Remote daemon: … on node HOST").
    pub host: Option<String>,
}

impl Losses {
    /// Reads one line of mpirun's output.
    pub fn read(&mut self, line: &str) {
        // Open MPI: "mpirun noticed that process rank 3 with PID 0 on node vm exited on signal 9 (Killed)."
        if let Some(rest) = line.split("process rank ").nth(1).filter(|_| line.contains("exited on signal")) {
            if let Some(rank) = rest.split_whitespace().next().and_then(|r| r.parse().ok()) {
                if !self.ranks.contains(&rank) {
                    self.ranks.push(rank);
                }
            }
        }
        // Open MPI: "Remote daemon: [[30846,0],1] on node 10.78.0.2"
        if let Some(host) = line.trim().strip_prefix("Remote daemon:").and_then(|r| r.split(" on node ").nth(1)) {
            self.host.get_or_insert_with(|| host.trim().to_string());
        }
        // Slurm: "srun: error: node03: task 5: Killed", "srun: error: node03: tasks 4-7: Killed"
        // (a task ended by a signal), "srun: error: Node failure on node03"
        if let Some(rest) = line.trim().strip_prefix("srun: error: ") {
            if let Some(host) = rest.strip_prefix("Node failure on ") {
                self.host.get_or_insert_with(|| host.trim().to_string());
            } else if rest.ends_with("Killed") || rest.contains("signal") {
                let tasks = rest.split(": ").find_map(|p| p.strip_prefix("tasks ").or_else(|| p.strip_prefix("task ")));
                for part in tasks.unwrap_or_default().split(',') {
                    let (a, b) = part.split_once('-').unwrap_or((part, part));
                    if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                        for rank in a..=b.min(a + 65_536) {
                            if !self.ranks.contains(&rank) {
                                self.ranks.push(rank);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The host names of a Slurm node list (`SLURM_JOB_NODELIST`): `node[01-03,07],gpu5` is
/// node01, node02, node03, node07 and gpu5 (zero padding kept). A name with more than one
/// bracket group is taken as written.
pub fn expand_nodelist(list: &str) -> Vec<String> {
    // split at the commas outside brackets
    let mut names = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                names.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    names.push(&list[start..]);
    let mut hosts = Vec::new();
    for name in names.into_iter().map(str::trim).filter(|n| !n.is_empty()) {
        let (Some(open), Some(close)) = (name.find('['), name.rfind(']')) else {
            hosts.push(name.to_string());
            continue;
        };
        let (prefix, ranges, suffix) = (&name[..open], &name[open + 1..close], &name[close + 1..]);
        if ranges.contains('[') || suffix.contains('[') {
            hosts.push(name.to_string());
            continue;
        }
        for r in ranges.split(',') {
            let (a, b) = r.split_once('-').unwrap_or((r, r));
            match (a.parse::<u64>(), b.parse::<u64>()) {
                (Ok(x), Ok(y)) if x <= y && y - x < 65_536 => {
                    for n in x..=y {
                        hosts.push(format!("{prefix}{n:0width$}{suffix}", width = a.len()));
                    }
                }
                _ => hosts.push(format!("{prefix}{r}{suffix}")),
            }
        }
    }
    hosts
}

/// The cluster left when devices on the nodes `device_nodes` (one entry per lost device)
/// and the whole nodes `hosts` are lost. On one node the lost devices come off its count;
/// a spec's nodes are alike, so on several nodes a node with a lost device is left out.
pub fn shrink(shape: Shape, device_nodes: &[usize], hosts: &[usize]) -> Shape {
    if shape.nodes == 1 {
        let gone = if hosts.contains(&0) { shape.per_node } else { device_nodes.len() };
        return Shape { nodes: 1, per_node: shape.per_node.saturating_sub(gone) };
    }
    let left = (0..shape.nodes).filter(|n| !device_nodes.contains(n) && !hosts.contains(n)).count();
    Shape { nodes: left, per_node: shape.per_node }
}

/// The `metrics.jsonl` line of a re-plan (the run that resumes keeps it beside the steps
/// before its checkpoint): why (`lost` devices, hosts that `returned`, or an attempt that
/// `failed` without losing any), which devices or hosts, the layouts before and after, the
/// new plan's predicted step, the step it resumes at and the steps trained since then.
pub fn replan_record(
    reason: &str,
    which: &[String],
    (old, new): (&Plan, &Plan),
    (resumed_at, steps_done): (usize, usize),
    searched_because: Option<&str>,
) -> serde_json::Value {
    let mut line = serde_json::json!({
        "event": "replan",
        "reason": reason,
        "devices": which,
        "old_layout": layout(old),
        "new_layout": layout(new),
        "old_devices": pipec_executor::working_devices(old).len(),
        "new_devices": pipec_executor::working_devices(new).len(),
        "predicted_step_s": new.simulation.step_time_s,
        "resume_step": resumed_at,
        "steps_lost": steps_done.saturating_sub(resumed_at),
    });
    if let Some(why) = searched_because {
        line["searched_because"] = why.into();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPEC: &str = "name: e\nmodel:\n  input: [16]\n  layers:\n    - linear(16, 32) -> relu\n    - repeat 2: linear(32, 32) -> relu\n    - linear(32, 4)\n  loss: cross_entropy\ncluster:\n  nodes: 1   # one machine\n  devices_per_node: 4\n  device: { memory: 1GiB, throughput: 10GFLOP/s }\n  links:\n    intra_node: { bandwidth: 10GB/s, latency: 5us }\nstrategy:\n  stages: \"2-1-1\"\n  schedule: 1f1b\n  microbatches: 4\ntraining:\n  batch_size: 32\n  steps: 4\n  optimizer: { kind: adam, lr: 0.005 }\n  seed: 3\n";

    #[test]
    fn resizing_changes_the_two_values_and_nothing_else() {
        let text = resize(SPEC, Shape { nodes: 2, per_node: 3 }).expect("resizes");
        assert_eq!(text, SPEC.replace("nodes: 1 ", "nodes: 2 ").replace("devices_per_node: 4", "devices_per_node: 3"));
        let flow = "cluster: { devices_per_node: 4, device: { memory: 1GiB } }\n";
        assert_eq!(
            resize(flow, Shape { nodes: 1, per_node: 2 }).expect("resizes"),
            "cluster: { devices_per_node: 2, device: { memory: 1GiB } }\n"
        );
        assert!(resize(flow, Shape { nodes: 2, per_node: 2 }).expect_err("no nodes key").contains("`nodes`"));
    }

    #[test]
    fn a_strategy_that_still_applies_is_kept_and_one_that_does_not_is_searched() {
        let base = Path::new(".");
        // 2-1-1 needs 4 devices: on 3 the search plans
        let r = replan(SPEC, base, Shape { nodes: 1, per_node: 3 }).expect("plans");
        assert!(r.searched_because.as_deref().is_some_and(|w| w.starts_with('E')), "{:?}", r.searched_because);
        assert!(r.text.contains("strategy: auto\ntraining:"), "{}", r.text);
        assert!(pipec_executor::working_devices(&r.plan).len() <= 3);
        // straight applies on any count
        let straight = SPEC.replace("\"2-1-1\"", "straight");
        let r = replan(&straight, base, Shape { nodes: 1, per_node: 3 }).expect("plans");
        assert_eq!(r.searched_because, None);
        assert_eq!(r.plan.partition, "1-1-1");
        // a model no layout of the devices left can hold is an error naming both tries
        let e = replan(&SPEC.replace("memory: 1GiB", "memory: 1KiB"), base, Shape { nodes: 1, per_node: 3 })
            .err()
            .expect("no plan");
        assert!(e.starts_with("no plan for 3 device(s)"), "{e}");
    }

    #[test]
    fn lost_ranks_and_hosts_are_read_from_open_mpis_words() {
        let mut l = Losses::default();
        l.read("mpirun noticed that process rank 3 with PID 0 on node vm exited on signal 9 (Killed).");
        l.read("mpirun noticed that process rank 3 with PID 0 on node vm exited on signal 9 (Killed).");
        l.read("error: rank 1 of 4 (device d1): nothing arrived from d3 within 10 s");
        l.read("  Remote daemon: [[30846,0],1] on node 10.78.0.2");
        assert_eq!(l, Losses { ranks: vec![3], host: Some("10.78.0.2".into()) });
    }

    #[test]
    fn slurms_words_and_node_lists_are_read() {
        let mut l = Losses::default();
        l.read("srun: error: node03: task 5: Killed");
        l.read("srun: error: node04: tasks 8-9,11: Killed");
        l.read("srun: error: Node failure on node07");
        l.read("srun: error: node03: task 6: Exited with exit code 1");
        assert_eq!(l, Losses { ranks: vec![5, 8, 9, 11], host: Some("node07".into()) });
        assert_eq!(expand_nodelist("node[01-03,07],gpu5"), ["node01", "node02", "node03", "node07", "gpu5"]);
        assert_eq!(expand_nodelist("a,b"), ["a", "b"]);
        assert_eq!(expand_nodelist("r[1-2]-n[1-2]"), ["r[1-2]-n[1-2]"]);
    }

    #[test]
    fn a_lost_device_shrinks_one_node_and_drops_a_node_of_several() {
        let one = Shape { nodes: 1, per_node: 4 };
        assert_eq!(shrink(one, &[0], &[]), Shape { nodes: 1, per_node: 3 });
        assert_eq!(shrink(one, &[0, 0], &[]), Shape { nodes: 1, per_node: 2 });
        assert_eq!(shrink(one, &[], &[0]), Shape { nodes: 1, per_node: 0 });
        let three = Shape { nodes: 3, per_node: 2 };
        assert_eq!(shrink(three, &[1, 1], &[]), Shape { nodes: 2, per_node: 2 });
        assert_eq!(shrink(three, &[0], &[2]), Shape { nodes: 1, per_node: 2 });
    }
}
