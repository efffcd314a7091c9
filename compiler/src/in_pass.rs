//! The declaration pass: every device's collectives inside its passes
//! (`pipec_plan::in_pass::declare`, per stage and kind of pass the device runs), into the
//! table the verifier checks and the plan carries.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::in_pass::{declare, InPassTable, Layers, Layout, PassKind};
use pipec_plan::model::{Op, Source};
use pipec_plan::StageId;

use crate::ir::Graph;
use crate::streams::Lowered;

/// The table of `lowered`'s streams for the stages of `ranges` of `graph`, placed by
/// `placement`.
pub(crate) fn in_pass_table(
    spec: &Spec,
    graph: &Graph,
    ranges: &[std::ops::Range<usize>],
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
        let mut seen: Vec<(StageId, PassKind)> = Vec::new();
        for ins in stream {
            let Some(kind) = PassKind::of(ins) else { continue };
            let stage = ins.stage();
            if seen.contains(&(stage, kind)) {
                continue;
            }
            seen.push((stage, kind));
            let s = stage.0 as usize;
            let layout = Layout {
                tp: strategy.tp.max(1),
                cp: strategy.cp.max(1),
                ring: strategy.cp_comm == pipec_plan::vocab::CpComm::Ring,
                ep: lowered.expert_parallel.get(s).copied().unwrap_or(1).max(1),
                zero3: strategy.sharding == pipec_plan::vocab::Sharding::Parameters
                    && placement.replicas.get(s).is_some_and(|r| r.len() > 1),
            };
            let range = ranges.get(s).cloned().unwrap_or_default();
            let list = declare(&layers, range, layout, kind, s == 0, s == last).map_err(|e| {
                vec![Diagnostic::error(
                    "E0603",
                    format!("internal compiler error: the collectives inside {stage}'s passes: {e}"),
                    strategy.schedule.span,
                    "while compiling this schedule",
                )
                .with_help("this is a bug in pipec, not in the spec; please report it with the spec")]
            })?;
            table.insert(*device, stage, kind, list);
        }
    }
    Ok(table)
}
