//! PipeDream's published profiles (tests/reference/pipedream-profiles, MIT) as
//! `pipec plan-profile` reads them, and pipec's `auto` against PipeDream's own optimizer
//! (its plans recorded in `pipedream-plans.json` by `run_pipedream.py`).

use std::ops::Range;

use pipec_compiler::pipedream::{
    chain, parse_pipedream_profile, pipedream_cut_bytes, pipedream_price, plan_like_pipedream, recorded_runs,
    PipeDreamNode, RecordedPlan, RecordedRun,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/reference/pipedream-profiles/");

fn load(file: &str) -> Vec<PipeDreamNode> {
    let path = format!("{DIR}{file}");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    parse_pipedream_profile(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn profile(model: &str) -> Vec<PipeDreamNode> {
    load(&format!("{model}/graph.txt"))
}

/// The recorded runs whose PipeDream optimizer finished, with PipeDream's plan.
fn finished_runs() -> Vec<(RecordedRun, RecordedPlan)> {
    let file = std::fs::read_to_string(format!("{DIR}pipedream-plans.json")).expect("pipedream-plans.json");
    recorded_runs(&file).expect("reads").into_iter().filter_map(|r| r.plan.clone().map(|p| (r, p))).collect()
}

/// Every profile whose PipeDream optimizer run finished on flat 16 GPUs and on 4 x 4 and 2 x 8
/// servers: pipec's plan, priced with PipeDream's objective, is at most 1.01x PipeDream's.
#[test]
fn pipec_plans_are_as_good_as_pipedreams_by_its_own_objective() {
    let runs = finished_runs();
    assert!(runs.len() >= 20, "only {} recorded runs", runs.len());
    let mut worse = Vec::new();
    for (run, theirs) in &runs {
        let c = chain(&load(&run.profile));
        let plan = plan_like_pipedream(&c, run.per_server, run.servers, run.bandwidths).expect("plans");
        assert!(plan.replicas.iter().sum::<usize>() <= run.per_server * run.servers);
        let price = pipedream_price(&c, &plan.ranges, &plan.replicas, run.per_server, run.bandwidths);
        if price > 1.01 * theirs.time_s {
            worse.push(format!(
                "{} on {}: pipec {} at {:.3} ms, PipeDream {:.3} ms",
                run.model,
                run.cluster,
                plan.notation(),
                price * 1e3,
                theirs.time_s * 1e3
            ));
        }
        // on one level pipec's own prediction is PipeDream's objective (pipec also charges
        // the first stage's output, which PipeDream leaves to the second stage)
        if run.servers == 1 {
            let gap = (plan.time_per_microbatch - price).abs() / price;
            assert!(
                gap <= 0.05,
                "{} {}: predicted {} vs priced {}",
                run.model,
                run.cluster,
                plan.time_per_microbatch,
                price
            );
        }
    }
    assert!(worse.is_empty(), "{}", worse.join("\n"));
}

/// The pricing helper against PipeDream itself: where the graph has one topological order
/// (every node feeds the next), every downset is a prefix, PipeDream's states are pipec's
/// layers after the Input node, so its recorded plans can be priced here and must come out
/// at the time PipeDream printed.
#[test]
fn the_pricing_helper_reproduces_pipedreams_times_on_chains() {
    let mut checked = 0;
    for (run, theirs) in finished_runs().iter().filter(|(r, _)| r.servers == 1) {
        let nodes = load(&run.profile);
        let one_order = nodes.iter().enumerate().take(nodes.len() - 1).all(|(i, n)| n.successors.contains(&(i + 1)));
        if !one_order {
            continue;
        }
        // state k is the first k + 1 layers after the Input node (position 0 here)
        let ranges: Vec<Range<usize>> = theirs
            .stages
            .iter()
            .map(|(r, _)| if r.start == 0 { 0..r.end + 1 } else { r.start + 1..r.end + 1 })
            .collect();
        let replicas: Vec<usize> = theirs.stages.iter().map(|s| s.1).collect();
        assert_eq!(ranges.last().map(|r| r.end), Some(nodes.len()), "{}", run.model);
        let price = pipedream_price(&chain(&nodes), &ranges, &replicas, run.per_server, run.bandwidths);
        assert!((price - theirs.time_s).abs() <= 1e-9 * theirs.time_s, "{}: {price} vs {}", run.model, theirs.time_s);
        checked += 1;
    }
    assert!(checked >= 2, "checked {checked} chain profiles");
}

const MODELS: [&str; 14] = [
    "alexnet",
    "vgg16",
    "squeezenet1_0",
    "resnet18",
    "resnet50",
    "resnext50",
    "inception_v3",
    "resnet101",
    "resnext101",
    "densenet121",
    "nasnetamobile",
    "nasnetalarge",
    "gnmt",
    "gnmt_large",
];

#[test]
fn every_published_profile_loads_with_its_input_zeroed() {
    // the published graphs, and PipeDream's branch-compressed forms its optimizer runs on
    let compressed = ["inception_v3", "nasnetamobile", "nasnetalarge"].map(|m| format!("{m}/graph-compressed.txt"));
    let files = MODELS.iter().map(|m| format!("{m}/graph.txt")).chain(compressed);
    for file in files {
        let model = file.as_str();
        let nodes = load(model);
        assert!(nodes.len() > 5, "{model}: {} nodes", nodes.len());
        for n in &nodes {
            let values = [n.forward_ms, n.backward_ms, n.activation_size, n.parameter_size];
            assert!(values.iter().all(|v| v.is_finite() && *v >= 0.0), "{model} {}: {values:?}", n.id);
            assert!(n.successors.iter().all(|&s| s < nodes.len()));
        }
        // data loading is not a layer: PipeDream's optimizer gives the Input node no time
        let inputs: Vec<&PipeDreamNode> = nodes.iter().filter(|n| n.description.starts_with("Input")).collect();
        assert!(!inputs.is_empty(), "{model}: no Input node");
        assert!(inputs.iter().all(|n| n.forward_ms == 0.0 && n.backward_ms == 0.0), "{model}");
    }
}

#[test]
fn gnmt_lists_of_output_sizes_are_summed() {
    let lstm = profile("gnmt").into_iter().find(|n| n.id == "node7").expect("node7");
    assert_eq!(lstm.activation_size, 6291456.0 + 131072.0 + 131072.0);
}

#[test]
fn a_cut_is_charged_every_edge_that_crosses_it() {
    // a -> b -> c with a skip a -> c: a cut between b and c carries a's and b's outputs
    let text = "node1 -- Input0 -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=10.0, parameter_size=0.0\n\
                node2 -- Conv -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=20.0, parameter_size=4.0\n\
                node3 -- Add -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=30.0, parameter_size=0.0\n\
                \tnode1 -- node2\n\tnode2 -- node3\n\tnode1 -- node3\n";
    let nodes = parse_pipedream_profile(text).expect("parses");
    assert_eq!(pipedream_cut_bytes(&nodes), vec![10.0, 30.0, 0.0]);
    // ResNet-18: inside a residual block the cut carries the block's input as well
    let resnet = profile("resnet18");
    let cuts = pipedream_cut_bytes(&resnet);
    let more = (1..resnet.len()).filter(|&j| cuts[j - 1] > resnet[j - 1].activation_size).count();
    assert!(more > 0, "no cut inside a block carries more than the last layer's output");
}

/// PipeDream's VGG-16 profile on 16 GPUs at 2.5 GB/s with the 15-1 layout its optimizer
/// chooses: pipec's flush-free steady state (the simulated time one more step adds, per
/// 64-sample minibatch) against PipeDream's optimizer's 46.32 ms for the same plan
/// (`pipedream-plans.json`, flat 16 run; docs/benchmarks.md).
#[test]
fn vgg16_flush_free_steady_state_is_within_ten_percent_of_pipedreams_prediction() {
    use pipec_compiler::periodic::{build, steady_state, verify_periodic, PeriodicInput};
    use pipec_compiler::schedule::Placement;
    use pipec_plan::{DeviceId, GroupId, Instr, ScheduleKind};
    let nodes = profile("vgg16");
    let ranges = [0..26, 26..41];
    let sum = |r: &Range<usize>, f: &dyn Fn(&PipeDreamNode) -> f64| -> f64 { nodes[r.clone()].iter().map(f).sum() };
    let forward: Vec<f64> = ranges.iter().map(|r| sum(r, &|n| n.forward_ms / 1e3)).collect();
    let backward: Vec<f64> = ranges.iter().map(|r| sum(r, &|n| n.backward_ms / 1e3)).collect();
    let params: Vec<u64> = ranges.iter().map(|r| sum(r, &|n| n.parameter_size) as u64).collect();
    let cut = pipedream_cut_bytes(&nodes);
    let output: Vec<u64> = ranges.iter().map(|r| cut[r.end - 1] as u64).collect();
    // one 64-sample minibatch of the profile = one microbatch; 2 rounds of 15 per step
    let n = 30;
    let replicas = vec![(0..15).map(DeviceId).collect::<Vec<_>>(), vec![DeviceId(15)]];
    let placement = Placement {
        replicas: replicas.clone(),
        route: vec![(0..n).map(|m| (m % 15) as u32).collect(), vec![0; n]],
        devices: 16,
        microbatches: n,
    };
    let groups = vec![Some(GroupId(0)), None];
    let members: std::collections::HashMap<GroupId, Vec<DeviceId>> = [(GroupId(0), replicas[0].clone())].into();
    let updates = ScheduleKind::PipeDream.updates(2);
    let periodic = |overlap: bool| {
        let p = build(&PeriodicInput {
            kind: ScheduleKind::PipeDream,
            placement: &placement,
            ranks: 2,
            output_bytes: &output,
            gradient_bytes: &params,
            groups: &groups,
            updates,
            recompute: &[],
            overlap,
        })
        .expect("periodic");
        assert!(verify_periodic(&p, &placement, &members, updates.every(false), &[]).is_empty());
        p
    };
    // the stage times from the profile, 2.5 GB/s links, ring all-reduce (the simulator's)
    struct Profiled {
        forward: Vec<f64>,
        backward: Vec<f64>,
    }
    impl pipec_compiler::simulate::CostModel for Profiled {
        fn compute(&self, _: DeviceId, i: &Instr) -> f64 {
            match i {
                Instr::Forward { stage, .. } => self.forward[stage.0 as usize],
                Instr::Backward { stage, .. } => self.backward[stage.0 as usize],
                _ => 0.0,
            }
        }
        fn transfer(&self, _: DeviceId, _: DeviceId, bytes: u64) -> f64 {
            bytes as f64 / 2.5e9
        }
        fn collective(&self, _: pipec_plan::CollectiveKind, _: GroupId, members: &[DeviceId], bytes: u64) -> f64 {
            let m = members.len() as f64;
            2.0 * (m - 1.0) / m * bytes as f64 / 2.5e9
        }
    }
    let cost = Profiled { forward, backward };
    let s = steady_state(&periodic(true), &members, &cost).expect("simulates");
    let waiting = steady_state(&periodic(false), &members, &cost).expect("simulates");
    let per_minibatch = s.step_time / n as f64;
    let pipedream = 0.04632;
    assert!(
        (per_minibatch - pipedream).abs() <= 0.10 * pipedream,
        "pipec {:.2} ms per minibatch, PipeDream's optimizer {:.2} ms",
        per_minibatch * 1e3,
        pipedream * 1e3
    );
    // overlapping the replicas' all-reduce with the next forward never costs time
    assert!(s.step_time <= waiting.step_time + 1e-12);
    eprintln!(
        "VGG-16 15-1: pipec steady state {:.2} ms per minibatch overlapped, {:.2} ms waiting for each all-reduce (first step {:.1} ms), PipeDream {:.2} ms; all-reduce per step on d0 {:.1} ms in flight, {:.1} ms exposed",
        per_minibatch * 1e3,
        waiting.step_time / n as f64 * 1e3,
        s.first_step_time * 1e3,
        pipedream * 1e3,
        s.collectives[&DeviceId(0)].0 * 1e3,
        s.collectives[&DeviceId(0)].1 * 1e3,
    );
}
