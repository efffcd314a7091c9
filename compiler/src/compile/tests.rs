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
/// counts, a few bytes, are not priced). With `sequence_parallel` the executor runs
/// tensor parallelism's all-reduces, and they are what is priced.
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
        (
            "gpt-tiny tp 2 sequence_parallel",
            PeerDim::Tensor,
            spec("gpt-tiny", &[one_stage("stages: \"1\"\n  tp: 2\n  sequence_parallel: true")]),
        ),
        (
            "llama-tiny tp 2 sequence_parallel",
            PeerDim::Tensor,
            spec("llama-tiny", &[one_stage("stages: \"1\"\n  tp: 2\n  sequence_parallel: true")]),
        ),
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

/// Sequence parallelism is priced as the engine runs it (`Spec::sequence_split`): for
/// Megatron-LM a block's all-gathers and reduce-scatters, with its activations outside
/// attention and the MLP split along the sequence (less kept than without); for pipec's
/// executor tensor parallelism's all-reduces on whole activations, the figures of the
/// layout without it.
#[test]
fn sequence_parallelism_is_priced_as_the_engine_runs_it() {
    use pipec_plan::model::Op;
    let layout = ("stages: \"1-1\"", "stages: \"1\"\n  tp: 2");
    let sp = ("stages: \"1-1\"", "stages: \"1\"\n  tp: 2\n  sequence_parallel: true");
    let megatron = ("model:", "engine: megatron\nmodel:");
    let options = crate::CompileOptions::default();
    let blocks = |spec: &pipec_grammar::spec::Spec| {
        let model = crate::model::cost_model(spec, &options).expect("costs");
        model
            .graph
            .ops()
            .zip(model.costs)
            .filter(|((_, n), _)| matches!(n.op, Op::TransformerBlock { .. }))
            .map(|(_, c)| c)
            .collect::<Vec<_>>()
    };
    let kinds = |c: &crate::cost::LayerCost| c.tp_forward.iter().map(|(k, _)| *k).collect::<Vec<_>>();
    for name in ["gpt-tiny", "llama-tiny"] {
        let (plain, split) = (spec(name, &[layout]), spec(name, &[sp]));
        assert!(!split.sequence_split(), "{name}: pipec's executor does not split the sequence");
        for (a, b) in blocks(&plain).iter().zip(blocks(&split)) {
            assert_eq!(kinds(a), kinds(&b), "{name}");
            assert_eq!((a.forward_s, a.backward_s), (b.forward_s, b.backward_s), "{name}");
        }
        let (plain, split) = (spec(name, &[layout, megatron]), spec(name, &[sp, megatron]));
        assert!(split.sequence_split(), "{name}: Megatron-LM splits it");
        let (a, b) = (blocks(&plain), blocks(&split));
        assert!(!a.is_empty() && a.len() == b.len());
        for (a, b) in a.iter().zip(&b) {
            assert_eq!(kinds(a), vec![CollectiveKind::AllReduce; 2], "{name}");
            let expected = [
                CollectiveKind::AllGather,
                CollectiveKind::ReduceScatter,
                CollectiveKind::AllGather,
                CollectiveKind::ReduceScatter,
            ];
            assert_eq!(kinds(b), expected, "{name}");
            assert!(
                b.activation_bytes_per_sample < a.activation_bytes_per_sample,
                "{name}: {} < {}",
                b.activation_bytes_per_sample,
                a.activation_bytes_per_sample
            );
        }
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

/// The tensor-parallel sum pipec's executor runs at the update's side is priced at the
/// instruction the plan declares it at: one ring all-reduce over the group of the partial
/// gradients' fp32 values (`tp_partial_values`), the optimizer step waiting for it without
/// gradient clipping, the `grad_norm` all-reduce with it (the device sums before it starts
/// the norm's). Llama-tiny on one stage with TP 2: its 2 blocks' two RMSNorm gains each.
#[test]
fn the_update_sums_are_priced_where_they_are_declared() {
    let layout = ("stages: \"1-1\"", "stages: \"1\"\n  tp: 2");
    for clip in [false, true] {
        let recipe = ("  seed: 11\n", if clip { "  seed: 11\n  clip_grad_norm: 1.0\n" } else { "  seed: 11\n" });
        let spec = spec("llama-tiny", &[layout, recipe]);
        let options = crate::CompileOptions::default();
        let model = crate::model::cost_model(&spec, &options).expect("costs");
        let compiled = crate::compile(&spec, &options).into_compiled().expect("compiles");
        let (plan, timeline) = (&compiled.plan, &compiled.timeline);
        let ops: Vec<pipec_plan::model::Op> = model.graph.ops().map(|(_, n)| n.op.clone()).collect();
        let st = &plan.stages[0];
        let range = st.layers[0]..st.layers[1];
        let partial = pipec_plan::in_pass::tp_partial_ids(&ops, range.clone(), spec.model.loss, 2, false).expect("ids");
        assert_eq!(partial.len(), 4, "two norms a block");
        let values = pipec_plan::in_pass::tp_partial_values(&ops, range.clone(), spec.model.loss, (2, 1), false)
            .expect("values");
        assert_eq!(values, 4 * 64, "four gains of the blocks' width");
        let sums = crate::cluster::ring_time(CollectiveKind::AllReduce, model.cluster.intra, 2, 4.0 * values as f64);
        let update: f64 = model.costs[range].iter().map(|c| c.update_s).sum();
        for (d, stream) in &plan.streams {
            let at: Vec<usize> = (0..stream.len())
                .filter(|&i| {
                    let kind = PassKind::of(&stream[i]);
                    let update_side =
                        |k: &PassKind| matches!(k, PassKind::GradNorm | PassKind::GradientShard | PassKind::Update);
                    kind.filter(update_side)
                        .is_some_and(|k| !plan.in_pass.of(*d, stream[i].stage(), k, false).is_empty())
                })
                .collect();
            assert_eq!(at.len(), 1, "{d}: one instruction sums, once a step");
            let i = at[0];
            let declared = plan.in_pass.of(*d, stream[i].stage(), PassKind::of(&stream[i]).expect("a kind"), false);
            assert_eq!(declared.len(), 1, "{d}: one sum of the stage's partial gradients");
            let took: Vec<f64> = timeline
                .events
                .iter()
                .filter(|e| e.device == *d && e.index == i && !e.background)
                .map(|e| e.end - e.start)
                .collect();
            if clip {
                assert!(matches!(stream[i], Instr::Collective { .. }), "{d}: {}", stream[i]);
                assert!(took.iter().any(|t| (t - sums).abs() < 1e-12), "{d}: {took:?} against {sums:e}");
            } else {
                assert!(matches!(stream[i], Instr::OptimizerStep { .. }), "{d}: {}", stream[i]);
                assert_eq!(took.len(), 1, "{d}");
                assert!((took[0] - update - sums).abs() < 1e-12, "{d}: {} against {update:e} + {sums:e}", took[0]);
            }
        }
    }
}

/// pipec's executor exchanges each mixture's per-expert row counts over its group before
/// the dispatch (the first of the three expert exchanges a forward declares): the
/// simulator prices it at each dispatch the plan lists, one all-to-all of an fp32 value
/// per expert, so a dispatch takes longer than its combine (which carries as many bytes)
/// by exactly that; and the forward's all-to-all seconds the plan reports count it.
#[test]
fn the_expert_row_counts_are_priced_before_each_dispatch() {
    use pipec_plan::TokenExchange;
    let spec = spec("moe-tiny", &[]);
    let options = crate::CompileOptions::default();
    let model = crate::model::cost_model(&spec, &options).expect("costs");
    let compiled = crate::compile(&spec, &options).into_compiled().expect("compiles");
    let (plan, timeline) = (&compiled.plan, &compiled.timeline);
    let mut checked = 0;
    for st in plan.stages.iter().filter(|s| s.expert_parallel > 1) {
        for d in &st.replicas {
            let stream = &plan.streams[d];
            let took = |i: usize| -> f64 {
                timeline.events.iter().filter(|e| e.device == *d && e.index == i).map(|e| e.end - e.start).sum()
            };
            let first = stream
                .iter()
                .position(|i| matches!(i, Instr::Forward { stage, .. } if *stage == st.id))
                .expect("a forward");
            let after: Vec<usize> =
                (first + 1..stream.len()).take_while(|&j| matches!(stream[j], Instr::AllToAll { .. })).collect();
            assert_eq!(after.len(), 2 * st.all_to_alls.len(), "{d}: a dispatch and a combine a mixture");
            let shown: f64 = after.iter().map(|&j| took(j)).sum();
            assert!((shown - st.all_to_all_s[0]).abs() < 1e-12, "{d}: {shown:e} against {:e}", st.all_to_all_s[0]);
            for pair in after.chunks(2) {
                let (Instr::AllToAll { exchange: a, layer, group, .. }, Instr::AllToAll { exchange: b, .. }) =
                    (&stream[pair[0]], &stream[pair[1]])
                else {
                    unreachable!("all-to-alls")
                };
                assert_eq!((*a, *b), (TokenExchange::Dispatch, TokenExchange::Combine), "{d}");
                let members = &plan.groups.iter().find(|g| g.id == *group).expect("the group").devices;
                let experts = spec.model.layers[*layer as usize].op.moe().expect("a mixture").experts as u64;
                let counts = model.cluster.collective_time(CollectiveKind::AllToAll, members, 4 * experts);
                assert!(counts > 0.0);
                let extra = took(pair[0]) - took(pair[1]);
                assert!(
                    (extra - counts).abs() < 1e-12,
                    "{d}: the dispatch takes {extra:e} more, the counts {counts:e}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no dispatch was compared");
}

/// ZeRO-3's per-product gathers on pipec's executor are priced one for one from what the
/// plan declares: a pass's `zero` all-gathers are `in_pass::product_gathers`' weights in
/// order (a forward gathers each weight matrix once, and here, blocks only, the backward
/// again for their input gradients), and the pass waits for the first and
/// for what its compute does not cover of the others, each a ring all-gather of the
/// matrix's fp32 values; the norms and biases go with the stage's whole gather. gpt-tiny
/// (its tied table and output layer gathered whole) over 2 replicas of one stage.
#[test]
fn the_per_product_gathers_are_priced_one_for_one() {
    let spec = spec("gpt-tiny", &[("stages: \"1-1\"", "stages: \"2\"\n  zero: 3")]);
    let options = crate::CompileOptions::default();
    let model = crate::model::cost_model(&spec, &options).expect("costs");
    let compiled = crate::compile(&spec, &options).into_compiled().expect("compiles");
    let (plan, timeline) = (&compiled.plan, &compiled.timeline);
    let st = &plan.stages[0];
    assert_eq!(st.replicas.len(), 2);
    let ops: Vec<pipec_plan::model::Op> = model.graph.ops().map(|(_, n)| n.op.clone()).collect();
    let tied = model.graph.tie_ends();
    let range = st.layers[0]..st.layers[1];
    let tracked = model.graph.tracked_inputs(std::slice::from_ref(&range));
    let layers =
        pipec_plan::in_pass::Layers { ops: &ops, tied: &tied, tracked: &tracked, loss: spec.model.loss, within: None };
    let layout = pipec_plan::in_pass::Layout { tp: 1, cp: 1, ring: false, ep: 1, zero3: true, inside: false };
    let gathers = |kind| pipec_plan::in_pass::product_gathers(&layers, range.clone(), layout, (kind, true, true));
    let (forward, backward) =
        (gathers(PassKind::Forward).expect("forward"), gathers(PassKind::Backward).expect("backward"));
    // the forward gathers every matrix of the layers gathered per product once
    let mut all: Vec<(u32, u64)> = range
        .clone()
        .filter(|&i| !tied[i])
        .flat_map(|i| pipec_plan::in_pass::product_weight_values(&ops[i]).into_iter().map(move |v| (i as u32, v)))
        .collect();
    let mut sorted = forward.clone();
    sorted.sort_unstable();
    all.sort_unstable();
    assert_eq!(sorted, all);
    // (the backward reads each block's four matrices again for its input gradients)
    let mut again = backward.clone();
    again.sort_unstable();
    assert_eq!(again, all);
    // intra_node: 10 GB/s, 5 us; a ring all-gather over 2 members sends half its bytes
    let ring = |values: u64| 4.0 * values as f64 / 2.0 / 10e9 + 5e-6;
    let c = &model.costs[range.clone()];
    for d in &st.replicas {
        for (kind, list) in [(PassKind::Forward, &forward), (PassKind::Backward, &backward)] {
            // what the plan declares is what is priced
            let declared: Vec<u32> = plan
                .in_pass
                .of(*d, st.id, kind, false)
                .iter()
                .filter(|e| e.over == PeerDim::Shard)
                .map(|e| e.layer)
                .collect();
            assert_eq!(declared, list.iter().map(|(l, _)| *l).collect::<Vec<_>>(), "{d} {kind}");
            let (compute, last) = match kind {
                PassKind::Forward => {
                    (c.iter().map(|c| c.forward_s).sum::<f64>(), c.last().map_or(0.0, |c| c.forward_s))
                }
                _ => (c.iter().map(|c| c.backward_s).sum::<f64>(), c.first().map_or(0.0, |c| c.backward_s)),
            };
            let g: Vec<f64> = list.iter().map(|&(_, v)| ring(v)).collect();
            let wait = g[0].max(g.iter().sum::<f64>() - compute + last);
            // each forward here gathers the stage whole too (its norms, biases and the
            // tied table: the stage's parameters but the matrices), then waits as priced
            let whole: u64 = st.parameters - all.iter().map(|(_, v)| v).sum::<u64>();
            let phase = if kind == PassKind::Forward { Phase::Forward } else { Phase::Backward };
            for e in timeline.events.iter().filter(|e| e.device == *d && e.phase == phase && !e.background) {
                let gathers_whole = plan.in_pass.gathers_of(*d).iter().any(|g| g.at as usize == e.index);
                assert_eq!(gathers_whole, kind == PassKind::Forward, "{d} {kind}");
                let expected = compute + wait + if gathers_whole { ring(whole) } else { 0.0 };
                let took = e.end - e.start;
                assert!((took - expected).abs() < 1e-12, "{d} {kind}: {took:e} against {expected:e}");
            }
        }
    }
}

/// Under context parallelism a mixture with a balancing loss (or a capacity) gathers the
/// group's routing counts in each forward, as the plan declares: priced inside the forward
/// (the cost model's `cp_forward`, the plan's `context_s`) as one all-gather over the group
/// of each member's fp32 counts per sample, half of its positions and expert; without the
/// loss nothing is gathered.
/// moe-tiny (8 experts, a balancing loss) on one stage, `cp: 2`.
#[test]
fn the_routing_counts_under_context_parallelism_are_priced() {
    let layout = [("stages: \"2-2\"", "stages: \"2\"\n  cp: 2"), ("  ep: 2\n", "")];
    let with = spec("moe-tiny", &layout);
    let without = spec("moe-tiny", &[layout[0], layout[1], (", aux_loss=0.05)", ")")]);
    let options = crate::CompileOptions::default();
    let plan = |s: &pipec_grammar::spec::Spec| crate::compile(s, &options).into_compiled().expect("compiles").plan;
    let (a, b) = (plan(&with), plan(&without));
    let declared = |p: &pipec_plan::Plan| {
        let (st, d) = (&p.stages[0], p.stages[0].replicas[0]);
        p.in_pass.of(d, st.id, PassKind::Forward, false).iter().filter(|e| e.over == PeerDim::Context).count()
    };
    // two mixtures: one gather of counts each, beside each block's keys and values
    assert_eq!(declared(&a), declared(&b) + 2);
    let model = crate::model::cost_model(&with, &options).expect("costs");
    let members = &a.groups.iter().find(|g| g.id == a.stages[0].group.expect("a group")).expect("the group").devices;
    let values = 2 * model.microbatch_size as u64 * 2 * 8;
    let counts = model.cluster.collective_time(CollectiveKind::AllGather, &members[..2], 4 * values);
    let (fa, fb) = (a.stages[0].context_s, b.stages[0].context_s);
    assert!(counts > 0.0);
    assert!((fa[0] - fb[0] - 2.0 * counts).abs() < 1e-12, "{fa:?} against {fb:?} + 2 × {counts:e}");
    assert_eq!(fa[1], fb[1]);
}

/// What pipec's executor runs again in a backward (recompute inside the blocks) is priced
/// in it: a tensor-parallel block's forward all-reduces again where both its halves run
/// again (a block recomputed whole), half of them where its MLP half alone does; and under
/// a split backward (zero bubble) all of it in the input half, none in the weight half.
#[test]
fn what_a_backward_runs_again_is_priced_in_it() {
    use crate::simulate::CostModel;
    let figures = |edits: &[(&str, &str)]| {
        let spec = spec("llama-tiny", edits);
        let options = crate::CompileOptions::default();
        let (model, layout) = crate::bound::Memo::default().model_and_layout(&spec, &options).expect("compiles");
        let stages = crate::figures::stage_figures(&spec, &model, &layout);
        (spec, model, stages)
    };
    let tp = ("stages: \"1-1\"", "stages: \"1\"\n  tp: 2");
    let recompute = |policy: &'static str| -> (&'static str, &'static str) {
        (
            "  partition: balanced\n",
            Box::leak(format!("  partition: balanced\n  recompute: {policy}\n").into_boxed_str()),
        )
    };
    let backward = |edits: &[(&str, &str)]| figures(edits).2.tp_times[0].1;
    let kept = backward(&[tp]);
    let (mlp, whole) = (backward(&[tp, recompute("{ modules: [mlp] }")]), backward(&[tp, recompute("{ layers: 2 }")]));
    assert!(mlp > kept, "{mlp} > {kept}");
    assert!(((whole - kept) - 2.0 * (mlp - kept)).abs() <= 1e-12 * whole, "{kept} {mlp} {whole}");
    // zero bubble: the input half carries what runs again
    let zb = ("schedule: 1f1b", "schedule: zb-h1");
    let (spec, model, stages) = figures(&[zb, recompute("{ modules: [mlp] }")]);
    let rerun = stages.rerun[0];
    assert!(rerun > 0.0);
    let cost = crate::plan_cost::PlanCost::new(&spec, &model, &stages, Default::default());
    let (stage, mb, d) = (pipec_plan::StageId(0), pipec_plan::MicrobatchId(0), pipec_plan::DeviceId(0));
    let input = cost.compute(d, &Instr::BackwardInput { stage, mb });
    let weight = cost.compute(d, &Instr::BackwardWeight { stage, mb });
    // the weight half is the weight gradients' kernels alone, the input half the rest
    let weights = stages.weight_grads[0];
    assert!(weights > 0.0 && (weight - weights).abs() <= 1e-12 * weight, "{weight} against {weights}");
    assert!(input - rerun > weight, "{input} − {rerun} against {weight}");
    assert!((input + weight - stages.times[0].1).abs() <= 1e-12 * input);
    // without the recompute the weight half is the same and the input half lighter by it
    let (spec, model, plain) = figures(&[zb]);
    let cost = crate::plan_cost::PlanCost::new(&spec, &model, &plain, Default::default());
    let (input_plain, weight_plain) =
        (cost.compute(d, &Instr::BackwardInput { stage, mb }), cost.compute(d, &Instr::BackwardWeight { stage, mb }));
    assert!((weight_plain - weight).abs() <= 1e-12 * weight, "{weight_plain} against {weight}");
    assert!((input - input_plain - rerun).abs() <= 1e-9 * input, "{input} − {input_plain} against {rerun}");
}
