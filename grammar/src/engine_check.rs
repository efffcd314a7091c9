//! `engine:` held to the named engine's capabilities (`pipec_plan::engine::capability`):
//! each thing the engine does not run is E0702, located at the key that asks for it, with the
//! nearest value the engine runs as its fix. A strategy the search completes (`auto`) is held
//! to them candidate by candidate (`pipec_compiler::search`), its model and precision here.

use pipec_plan::engine::capability::{refusals, Feature, Layout, RecomputeKind};
use pipec_plan::engine::gpt::GptShape;

use crate::ast::{EngineChoice, Model, Recompute, Strategy, Training};
use crate::cx::Lower;
use crate::diagnostic::Diagnostic;
use crate::span::Span;
use crate::yaml::Node;

/// The layout a written strategy asks for, as the capability tables see it (`compiled`:
/// the engine compiles the model, torchtitan's `compile`).
pub fn layout_of(model: &Model, strategy: &Strategy, training: &Training, compiled: bool) -> Layout {
    let cp = strategy.cp.max(1);
    let recompute = match &strategy.recompute {
        Recompute::Off => RecomputeKind::Off,
        Recompute::All => RecomputeKind::Full,
        Recompute::Stages(v) if v.len() >= strategy.stage_count() => RecomputeKind::Full,
        Recompute::Stages(v) if v.is_empty() => RecomputeKind::Off,
        Recompute::Stages(_) => RecomputeKind::SomeStages,
        Recompute::Selective => RecomputeKind::Selective,
        // recompute inside the blocks (by module, by operation, some blocks whole, offload):
        // held to the engines part by part (`block_recompute`)
        Recompute::Blocks(_) => RecomputeKind::Selective,
    };
    let ops: Vec<pipec_plan::model::Op> = model.layers.iter().map(|l| l.op.clone()).collect();
    let tied = model.layers.iter().any(|l| l.tied.is_some());
    Layout {
        replicas: strategy.replicas.iter().map(|r| (r / cp).max(1)).collect(),
        tp: strategy.tp,
        cp,
        ep: strategy.ep.max(1),
        etp: strategy.etp(),
        schedule: strategy.schedule.kind,
        virtual_stages: strategy.schedule.virtual_stages.max(1),
        microbatches: strategy.written_microbatches(),
        synchronous: strategy.schedule.kind.is_synchronous(strategy.schedule.sync),
        reduce: strategy.schedule.reduce,
        sharding: strategy.sharding,
        sequence_parallel: strategy.sequence_parallel,
        tp_overlap: strategy.tp_overlap,
        cp_comm: strategy.cp_comm,
        moe_dispatch: strategy.moe_dispatch,
        ep_overlap: strategy.combined_1f1b(),
        recompute,
        block_recompute: match &strategy.recompute {
            Recompute::Blocks(b) => Some(b.clone()),
            Recompute::Off | Recompute::All | Recompute::Stages(_) | Recompute::Selective => None,
        },
        precision: training.precision,
        fp8: training.fp8.map(|f| f.recipe),
        master_weights: training.master_weights,
        grad_precision: training.grad_precision,
        state_precision: training.state_precision,
        adam: matches!(
            training.optimizer.kind(),
            pipec_plan::vocab::OptimizerKind::Adam | pipec_plan::vocab::OptimizerKind::AdamW
        ),
        blocks: model.layers.iter().filter(|l| l.op.block_dims().is_some()).count(),
        // a partition written out: the blocks of each chunk
        chunk_blocks: match &strategy.partition {
            crate::ast::Partition::Explicit(ranges) => Some(
                ranges
                    .iter()
                    .map(|r| {
                        model
                            .layers
                            .get(r.clone())
                            .map_or(0, |ls| ls.iter().filter(|l| l.op.block_dims().is_some()).count())
                    })
                    .collect(),
            ),
            crate::ast::Partition::Auto | crate::ast::Partition::Balanced => None,
        },
        gpt: GptShape::of(&ops, tied).is_some(),
        mtp: model.mtp.map_or(0, |m| m.depth),
        compiled,
    }
}

/// E0702 for everything `engine` cannot run of the written strategy (nothing for pipec or
/// a strategy the search completes).
pub(crate) fn check_engine(
    cx: &mut Lower<'_>,
    engine: &EngineChoice,
    sections: (Option<&Node>, Option<&Node>),
    model: &Model,
    strategy: &Strategy,
    training: &Training,
) {
    if engine.target.is_pipec() {
        return;
    }
    let (strategy_fields, training_fields) = sections;
    let target = &engine.target;
    // a strategy the search completes is held to the engine candidate by candidate; what
    // no strategy changes (the model, the precision) is reported here
    let searched = strategy.auto.is_some();
    let all = refusals(target, &layout_of(model, strategy, training, engine.compiled));
    for refusal in all.into_iter().filter(|r| {
        !searched
            || matches!(
                r.feature,
                Feature::Model | Feature::Mtp | Feature::Precision | Feature::Optimizer | Feature::GradPrecision
            )
    }) {
        let written = match refusal.feature {
            Feature::Layout => Some(strategy.layout_span),
            Feature::Schedule | Feature::Synchrony | Feature::Reduce => Some(strategy.schedule.span),
            Feature::Microbatches => strategy.microbatches_span,
            Feature::Model => Some(model.layers_span),
            Feature::Mtp => Some(model.mtp_span),
            Feature::Precision => value_span(training_fields, "precision"),
            Feature::Optimizer => value_span(training_fields, "optimizer"),
            Feature::GradPrecision => value_span(training_fields, "grad_precision"),
            other => value_span(strategy_fields, other.key()),
        };
        let span = written.or(engine.span).unwrap_or(strategy.span);
        let mut d =
            Diagnostic::error("E0702", refusal.message.clone(), span, format!("{} does not run this", target.name))
                .with_help(help(&refusal.nearest, refusal.feature, target.name.to_string(), refusal.source));
        if let (Some(nearest), Some(at)) = (&refusal.nearest, written.filter(|_| fixable(refusal.feature))) {
            d = d.with_fix(format!("use {nearest}"), at, nearest.clone());
        }
        cx.push(d);
    }
}

/// Whether a refusal's nearest value replaces the value written at its key.
fn fixable(feature: Feature) -> bool {
    !matches!(feature, Feature::Layout | Feature::Model | Feature::Mtp | Feature::Reduce)
}

fn help(nearest: &Option<String>, feature: Feature, engine: String, source: &str) -> String {
    let key = feature.key();
    let fix = match (nearest, feature) {
        (Some(v), _) => format!("the nearest {engine} runs: `{key}: {v}`"),
        (None, Feature::Mtp) => format!("remove `{key}` (next-token prediction alone)"),
        (None, _) => format!("change `{key}` to what {engine} runs"),
    };
    // pipec's executor plans multi-token prediction but does not train it
    let other = if feature == Feature::Mtp { "`engine: megatron` trains it" } else { "`engine: pipec` runs it" };
    format!("{fix}, or name another engine ({other}); {engine}'s rule: {source}")
}

/// The span of `key`'s value in the mapping `node`, when written.
fn value_span(node: Option<&Node>, key: &str) -> Option<Span> {
    node?.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v.span)
}
