//! The compiler's passes against each other: what the simulator prices inside pipec's
//! passes is what the declaration pass says its executor issues there, ZeRO-3's gathers of
//! whole weights where it declares them.

use pipec_plan::in_pass::PassKind;
use pipec_plan::{CollectiveKind, Instr, PassOp, PeerDim, Phase};

/// A spec of `specs/` with `edits` (text → replacement) made.
fn spec(name: &str, edits: &[(&str, &str)]) -> pipec_grammar::spec::Spec {
    let mut text = std::fs::read_to_string(format!("../specs/{name}.yaml")).expect("the spec");
    for (from, to) in edits {
        assert!(text.contains(from), "{name}: {from:?}");
        text = text.replace(from, to);
    }
    let checked = pipec_grammar::check_source(&text);
    checked.spec.unwrap_or_else(|| panic!("{name}: {:?}", checked.diagnostics))
}

/// What the simulator prices inside pipec's passes is what the plan declares its
/// executor issues there: per stage and pass, the cost model's tensor-parallel
/// collectives are the declared ones (layer, operation, count), its context-parallel
/// exchanges are at the declared layers and operations (it prices a block's keys and
/// values as one collective of both's bytes, and a ring's passes as the all-gather they
/// add up to), and each pass's declared expert-parallel dispatch and combine are the
/// plan's `all_to_all` instructions after it, which the simulator prices (the row
/// counts, a few bytes, are not priced). Sequence parallelism is the exception `pipec
/// run` names: the cost model prices Megatron-LM's all-gathers and reduce-scatters, the
/// executor runs all-reduces.
#[test]
fn the_collectives_priced_inside_passes_are_those_declared() {
    let one_stage = |more: &'static str| ("stages: \"1-1\"", more);
    let cases = [
        ("gpt-tiny tp 2", PeerDim::Tensor, spec("gpt-tiny", &[one_stage("stages: \"1\"\n  tp: 2")])),
        ("gpt-tiny cp 2", PeerDim::Context, spec("gpt-tiny", &[one_stage("stages: \"1\"\n  cp: 2")])),
        (
            "gpt-tiny cp 2 ring",
            PeerDim::Context,
            spec("gpt-tiny", &[one_stage("stages: \"1\"\n  cp: 2\n  cp_comm: ring")]),
        ),
        ("llama-tiny tp 2", PeerDim::Tensor, spec("llama-tiny", &[one_stage("stages: \"1\"\n  tp: 2")])),
        ("moe-tiny", PeerDim::Expert, spec("moe-tiny", &[])),
    ];
    for (what, dim, spec) in cases {
        let mut checked = 0;
        let options = crate::CompileOptions::default();
        let model = crate::model::cost_model(&spec, &options).expect("costs");
        let plan = crate::compile::compile(&spec, &options).into_compiled().expect("compiles").plan;
        for st in &plan.stages {
            let d = st.replicas[0];
            let stream = &plan.streams[&d];
            for (kind, forward) in [(PassKind::Forward, true), (PassKind::Backward, false)] {
                let list = plan.in_pass.of(d, st.id, kind, false);
                let declared = |dim: PeerDim| {
                    let mut v: Vec<(u32, PassOp)> =
                        list.iter().filter(|e| e.over == dim).map(|e| (e.layer, e.op)).collect();
                    v.sort_by_key(|(l, op)| (*l, op.name()));
                    v
                };
                let priced = |pick: fn(&crate::cost::LayerCost, bool) -> &[(CollectiveKind, u64)]| {
                    let mut v: Vec<(u32, PassOp)> = (st.layers[0]..st.layers[1])
                        .flat_map(|i| pick(&model.costs[i], forward).iter().map(move |(k, _)| (i as u32, *k)))
                        .map(|(i, k)| (i, pass_op(k)))
                        .collect();
                    v.sort_by_key(|(l, op)| (*l, op.name()));
                    v
                };
                let at = format!("{what}: {} {kind}", st.id);
                let tp = priced(|c, f| if f { &c.tp_forward } else { &c.tp_backward });
                assert_eq!(declared(PeerDim::Tensor), tp, "{at}: tensor parallelism");
                let mut cp = declared(PeerDim::Context);
                for e in &mut cp {
                    if e.1 == PassOp::RingPass {
                        e.1 = PassOp::AllGather;
                    }
                }
                cp.dedup();
                let mut cp_priced = priced(|c, f| if f { &c.cp_forward } else { &c.cp_backward });
                cp_priced.dedup();
                assert_eq!(cp, cp_priced, "{at}: context parallelism");
                // expert parallelism: a mixture's dispatch and combine, each an instruction
                // after the pass, beside the forward's row counts
                let ep = declared(PeerDim::Expert);
                let pass = stream.iter().position(|i| {
                    PassKind::of(i) == Some(kind) && i.stage() == st.id && i.microbatch().is_some_and(|m| m.0 == 0)
                });
                let instructions = pass
                    .map_or(0, |p| stream[p + 1..].iter().take_while(|i| matches!(i, Instr::AllToAll { .. })).count());
                let layers: std::collections::BTreeSet<u32> = ep.iter().map(|(l, _)| *l).collect();
                // (the forward's row counts, which the backward reuses)
                let per_mixture = if forward { 3 } else { 2 };
                assert_eq!(ep.len(), per_mixture * layers.len(), "{at}: a mixture's exchanges: {ep:?}");
                assert_eq!(instructions, 2 * layers.len(), "{at}: the plan's all-to-alls after the pass");
                checked += declared(dim).len();
            }
        }
        assert!(checked > 0, "{what}: no collective over {dim} was compared");
    }
}

fn pass_op(k: CollectiveKind) -> PassOp {
    match k {
        CollectiveKind::AllReduce => PassOp::AllReduce,
        CollectiveKind::AllGather => PassOp::AllGather,
        CollectiveKind::ReduceScatter => PassOp::ReduceScatter,
        CollectiveKind::AllToAll => PassOp::AllToAll,
    }
}

/// ZeRO-3 beside tensor parallelism on pipec's executor: the stage's weights are
/// gathered whole where the plan declares (here once a step, at each device's first
/// forward, its forwards keeping their graphs), and the simulator prices each such
/// gather in the pass that waits for it: the first forward takes one whole gather of
/// the stage's fp32 shard values longer than the others — at least a ring all-gather of
/// its tensor-parallel rank's share over the 2 replicas, at most one of all its
/// parameters; no other forward waits.
#[test]
fn the_declared_whole_stage_gathers_are_priced_in_the_pass_that_waits() {
    let text = std::fs::read_to_string("../specs/gpt-tiny.yaml")
        .expect("the spec")
        .replace("devices_per_node: 2", "devices_per_node: 4")
        .replace("stages: \"1-1\"", "stages: \"2\"\n  tp: 2\n  zero: 3")
        .replace("schedule: 1f1b", "schedule: gpipe");
    let checked = pipec_grammar::check_source(&text);
    let spec = checked.spec.unwrap_or_else(|| panic!("{:?}", checked.diagnostics));
    let compiled = crate::compile(&spec, &crate::CompileOptions::default()).into_compiled().expect("compiles");
    let (plan, timeline) = (&compiled.plan, &compiled.timeline);
    let params = plan.stages[0].parameters as f64;
    // intra_node: 10 GB/s, 5 us; a ring all-gather over 2 members sends half its bytes
    let ring = |bytes: f64| bytes / 2.0 / 10e9 + 5e-6;
    for (d, stream) in &plan.streams {
        let gathers = plan.in_pass.gathers_of(*d);
        assert_eq!(gathers.len(), 1, "{d}: {gathers:?}");
        let forwards: Vec<(usize, f64)> = timeline
            .events
            .iter()
            .filter(|e| e.device == *d && e.phase == Phase::Forward && !e.background)
            .map(|e| (e.index, e.end - e.start))
            .collect();
        assert!(matches!(stream[forwards[0].0], Instr::Forward { .. }));
        assert_eq!(forwards[0].0, gathers[0].at as usize, "{d}: the gather is at its first forward");
        let waited = forwards[0].1 - forwards[1].1;
        assert!(forwards[1..].iter().all(|(_, t)| (t - forwards[1].1).abs() < 1e-12), "{d}: {forwards:?}");
        assert!(
            waited >= ring(params / 2.0 * 4.0) * 0.99 && waited <= ring(params * 4.0) * 1.01,
            "{d}: the first forward waits {waited:e} s more, {params} parameters"
        );
    }
}
