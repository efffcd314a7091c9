//! The declaration pass: every device's collectives inside its passes
//! (`pipec_plan::in_pass::declare`, per stage and kind of pass the device runs), into the
//! table the verifier checks and the plan carries.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::in_pass::{declare, update_sums, Buckets, InPassTable, Layers, Layout, PassKind};
use pipec_plan::plan::{bucketed_passes, GradientBucket};
use pipec_plan::{CollectivePayload, Instr, PassOp, StageId};

use crate::ir::Graph;
use crate::streams::Lowered;

/// Whether each update of a tensor-parallel stage sums its squared gradient norm over the
/// group (`pipec_plan::in_pass::update_sums`): gradient clipping under a schedule that
/// does not sum the global norm once a step (as `Schedule::updates_every_step` reads the
/// plan: asynchronous data parallelism's staleness is `lowered.asp`).
pub(crate) fn clip_each_update(spec: &Spec, lowered: &Lowered) -> bool {
    let per_step = spec.strategy.schedule.kind.updates_per_step() && !lowered.asp;
    spec.training.recipe.clip_grad_norm.is_some() && !per_step
}

/// The table of `lowered`'s streams for the stages of `ranges` of `graph` with their
/// gradient `buckets`, placed by `placement`.
pub(crate) fn in_pass_table(
    spec: &Spec,
    graph: &Graph,
    (ranges, buckets): (&[std::ops::Range<usize>], &[Vec<GradientBucket>]),
    placement: &crate::schedule::Placement,
    lowered: &Lowered,
) -> Result<InPassTable, Vec<Diagnostic>> {
    let ops = graph.op_list();
    let tied = graph.tie_ends();
    let tracked = graph.tracked_inputs(ranges);
    let within = spec.strategy.recompute.within_blocks();
    let layers = Layers { ops, tied: &tied, tracked: &tracked, loss: spec.model.loss, within: within.as_ref() };
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
        let recompute = |s: StageId| lowered.recompute.get(s.0 as usize).copied().unwrap_or(false);
        let sharded = pipec_plan::in_pass::zero3_stages(stream, zero3, recompute, StageId(last as u32));
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
                inside: !recompute(stage),
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
        let whole_experts = strategy.experts_whole() && strategy.ep > 1;
        let first_layer = |s: StageId| ranges.get(s.0 as usize).map_or(0, |r| r.start as u32);
        let mut partial = std::collections::BTreeMap::new();
        for stage in stream.iter().map(Instr::stage).filter(|_| tp > 1) {
            if partial.contains_key(&stage) {
                continue;
            }
            // one all-reduce of the stage's partial gradients, at its first layer
            let range = ranges.get(stage.0 as usize).cloned().unwrap_or_default();
            let ids = pipec_plan::in_pass::tp_partial_ids(ops, range, spec.model.loss, tp, whole_experts)
                .map_err(at_updates)?;
            partial.insert(stage, if ids.is_empty() { Vec::new() } else { vec![first_layer(stage)] });
        }
        let clip_each_update = clip_each_update(spec, lowered);
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
