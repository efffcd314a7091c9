//! The declaration pass: every device's collectives inside its passes
//! (`pipec_plan::in_pass::declare`, per stage and kind of pass the device runs), into the
//! table the verifier checks and the plan carries.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::in_pass::{declare, update_sums, Buckets, InPassTable, Layers, Layout, PassKind};
use pipec_plan::model::{Op, Source};
use pipec_plan::plan::{bucketed_passes, GradientBucket};
use pipec_plan::{CollectivePayload, Instr, PassOp, StageId};

use crate::ir::Graph;
use crate::streams::Lowered;

/// The table of `lowered`'s streams for the stages of `ranges` of `graph` with their
/// gradient `buckets`, placed by `placement`.
pub(crate) fn in_pass_table(
    spec: &Spec,
    graph: &Graph,
    (ranges, buckets): (&[std::ops::Range<usize>], &[Vec<GradientBucket>]),
    placement: &crate::schedule::Placement,
    lowered: &Lowered,
) -> Result<InPassTable, Vec<Diagnostic>> {
    let ops: Vec<Op> = graph.ops().map(|(_, n)| n.op.clone()).collect();
    let n = ops.len();
    // either end of a weight tie
    let mut tied = vec![false; n];
    for (i, (_, node)) in graph.ops().enumerate() {
        if let Some(t) = node.tied {
            tied[i] = true;
            if let Some(x) = tied.get_mut(t) {
                *x = true;
            }
        }
    }
    // whose input carries a gradient within its stage: a stage's input past the first
    // stage (received with its gradient to send back), a layer's output when its input
    // does or it has weights; never the model's data
    let (mut tracked, mut carries) = (vec![false; n], vec![false; n]);
    for r in ranges {
        for i in r.clone() {
            let node = graph.node(graph.op_at(i));
            let t = node.inputs.iter().any(|s| match *s {
                Source::Input => false,
                Source::Layer(p) if p < r.start => true,
                Source::Layer(p) => carries.get(p).copied().unwrap_or(true),
            });
            tracked[i] = t;
            carries[i] = t || node.op.parameter_count() > 0 || node.tied.is_some();
        }
    }
    let layers = Layers { ops: &ops, tied: &tied, tracked: &tracked, loss: spec.model.loss };
    let strategy = &spec.strategy;
    let mut table = InPassTable::default();
    let last = ranges.len().saturating_sub(1);
    for (device, stream) in &lowered.streams {
        let internal = |what: String| {
            vec![Diagnostic::error(
                "E0603",
                format!("internal compiler error: {what}"),
                strategy.schedule.span,
                "while compiling this schedule",
            )
            .with_help("this is a bug in pipec, not in the spec; please report it with the spec")]
        };
        // the passes feeding a bucketed replica reduction, with its operation
        let has_buckets = |s: StageId| buckets.get(s.0 as usize).is_some_and(|b| !b.is_empty());
        let reducing: std::collections::HashMap<usize, PassOp> = bucketed_passes(stream, has_buckets)
            .into_iter()
            .filter_map(|(pass, j)| {
                let Instr::Collective { payload, .. } = &stream[j] else { return None };
                let op = match payload {
                    CollectivePayload::Gradients => PassOp::AllReduce,
                    CollectivePayload::GradientShard => PassOp::ReduceScatter,
                    CollectivePayload::TiedGradient
                    | CollectivePayload::TiedGradientShard
                    | CollectivePayload::Weights
                    | CollectivePayload::GradNorm => return None,
                };
                Some((pass, op))
            })
            .collect();
        // ZeRO-3's gathers of the device's sharded stages' whole weights, by instruction
        let zero3 = |s: StageId| {
            strategy.sharding == pipec_plan::vocab::Sharding::Parameters
                && placement.replicas.get(s.0 as usize).is_some_and(|r| r.len() > 1)
        };
        let sharded: std::collections::BTreeMap<StageId, bool> = stream
            .iter()
            .map(Instr::stage)
            .filter(|s| zero3(*s))
            .map(|s| (s, lowered.recompute.get(s.0 as usize).copied().unwrap_or(false) && s.0 as usize != last))
            .collect();
        table.insert_gathers(*device, pipec_plan::in_pass::stage_gathers(stream, &sharded));
        let mut seen: Vec<(StageId, PassKind, bool)> = Vec::new();
        for (i, ins) in stream.iter().enumerate() {
            let Some(kind) = PassKind::of(ins).filter(|k| k.is_pass()) else { continue };
            let stage = ins.stage();
            let reduces = reducing.get(&i).copied();
            if seen.contains(&(stage, kind, reduces.is_some())) {
                continue;
            }
            seen.push((stage, kind, reduces.is_some()));
            let s = stage.0 as usize;
            let layout = Layout {
                tp: strategy.tp.max(1),
                cp: strategy.cp.max(1),
                ring: strategy.cp_comm == pipec_plan::vocab::CpComm::Ring,
                ep: lowered.expert_parallel.get(s).copied().unwrap_or(1).max(1),
                zero3: zero3(stage),
            };
            let range = ranges.get(s).cloned().unwrap_or_default();
            let starts: Vec<usize> =
                buckets.get(s).map(|b| b.iter().map(|b| b.layers[0]).collect()).unwrap_or_default();
            let reduce = reduces.map(|op| Buckets { starts: &starts, op });
            let list = declare(&layers, range, layout, kind, s == 0, s == last, reduce)
                .map_err(|e| internal(format!("the collectives inside {stage}'s passes: {e}")))?;
            table.insert(*device, stage, kind, reduces.is_some(), list);
        }
        // the update's side: the tensor-parallel sums of partial gradients (and norms)
        let at_updates = |e: String| internal(format!("the tensor-parallel sums at {device}'s updates: {e}"));
        let tp = strategy.tp.max(1);
        let mut partial = std::collections::BTreeMap::new();
        for stage in stream.iter().map(Instr::stage).filter(|_| tp > 1) {
            if partial.contains_key(&stage) {
                continue;
            }
            let range = ranges.get(stage.0 as usize).cloned().unwrap_or_default();
            let ids = pipec_plan::in_pass::tp_partial_ids(&ops, range, spec.model.loss, tp).map_err(at_updates)?;
            partial.insert(stage, ids.into_iter().map(|id| (id >> 8) as u32).collect::<Vec<u32>>());
        }
        let first_layer = |s: StageId| ranges.get(s.0 as usize).map_or(0, |r| r.start as u32);
        // (as `Schedule::updates_every_step` reads the plan: asynchronous data parallelism's
        // staleness is `lowered.asp`)
        let per_step = spec.strategy.schedule.kind.updates_per_step() && !lowered.asp;
        let clip_each_update = spec.training.recipe.clip_grad_norm.is_some() && !per_step;
        let mut lists: Vec<((StageId, PassKind), Vec<pipec_plan::in_pass::InPass>)> = Vec::new();
        for (i, list) in update_sums(stream, &partial, &first_layer, clip_each_update) {
            let Some(kind) = PassKind::of(&stream[i]) else { continue };
            let key = (stream[i].stage(), kind);
            // every instruction of one kind of a stage sums the same (one list per key)
            match lists.iter().find(|(k, _)| *k == key) {
                Some((_, l)) if *l != list => {
                    return Err(at_updates(format!("{} {}s sum differently", key.0, key.1)));
                }
                Some(_) => {}
                None => lists.push((key, list)),
            }
        }
        for ((stage, kind), list) in lists {
            table.insert(*device, stage, kind, false, list);
        }
    }
    Ok(table)
}

#[cfg(test)]
mod tests {
    use pipec_plan::in_pass::PassKind;
    use pipec_plan::{CollectiveKind, Instr, PassOp, PeerDim};

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
                    let instructions = pass.map_or(0, |p| {
                        stream[p + 1..].iter().take_while(|i| matches!(i, Instr::AllToAll { .. })).count()
                    });
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
}
