//! Lowering and checking of the `strategy` section: the layout (PipeDream notation or
//! dp/pp/tp degrees), the schedule and its options, microbatches and the partition. This is
//! where the spec's sections meet, so the cross-section checks live here too: strategy vs
//! cluster size, stages vs layers, microbatches vs batch size, partition ranges vs layers.

use pipec_plan::schedule::LayoutFacts;
use pipec_plan::vocab::{CpComm, RecomputeModule, RecomputeOp, Sharding};

use crate::ast::{
    AutoStrategy, BlockRecompute, Choice, Cluster, Model, Partition, Recompute, ReduceMode, Schedule, ScheduleKind,
    Strategy, SyncMode, Training, MAX_STAGE_MICROBATCHES,
};
use crate::cx::Fields;
use crate::cx::Lower;
use crate::diagnostic::Diagnostic;
use crate::dsl::{self, LayerRef, StagesNotation};
use crate::span::Span;
use crate::yaml::{Node, Value};

/// How many candidates a microbatch search may try: bounded work for any input.
const SEARCH_BUDGET: usize = 1 << 21;

/// The count nearest `current` (the larger on a tie) that divides `batch` (when known) and
/// meets `fits`; bounded work for any input, `None` when nothing is found.
fn nearest_microbatches(current: usize, batch: Option<usize>, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let better = |best: Option<usize>, n: usize| match best {
        Some(b) if (b.abs_diff(current), usize::MAX - b) <= (n.abs_diff(current), usize::MAX - n) => Some(b),
        _ => Some(n),
    };
    let mut best = None;
    match batch {
        Some(batch) => {
            for n in divisors(batch)? {
                if fits(n) {
                    best = better(best, n);
                }
            }
        }
        // no batch size: outward from the current count
        None => {
            for delta in 1..SEARCH_BUDGET {
                for n in [current.saturating_add(delta), current.saturating_sub(delta)] {
                    if n > 0 && fits(n) {
                        best = better(best, n);
                    }
                }
                if best.is_some() {
                    break;
                }
            }
        }
    }
    best
}

pub(crate) fn lower_strategy(
    cx: &mut Lower<'_>,
    node: &Node,
    owner: Span,
    model: Option<&Model>,
    cluster: Option<&Cluster>,
    training: Option<&Training>,
) -> Option<Strategy> {
    if is_auto(node) {
        let all = AutoStrategy {
            layout: true,
            tp: true,
            schedule: true,
            microbatches: true,
            recompute: true,
            ep: true,
            cp: false,
            cp_comm: true,
            sequence_parallel: true,
            tp_overlap: true,
            moe_dispatch: true,
            ep_overlap: true,
            asynchronous: false,
            max_depth: None,
            headroom: pipec_plan::rules::DEFAULT_MEMORY_HEADROOM,
            schedules: None,
        };
        return Some(placeholder_strategy(node, owner, cluster, all));
    }
    let f = cx.fields(node, &["strategy"], owner)?;
    if auto_reason(&f).is_some() {
        return lower_auto_strategy(cx, node, &f, owner, (model, cluster));
    }
    let tp = match f.get("tp") {
        None => Some(1),
        Some(n) => cx.uint(n, 1).and_then(|tp| {
            // Megatron's split pairs consecutive layers of a chain
            if let (true, Some(m)) = (tp > 1, model) {
                if !m.is_chain() {
                    cx.push(
                        Diagnostic::error(
                            "E0411",
                            "tensor parallelism splits chains of layers, and this model has branches or joins",
                            n.span,
                            "tensor parallelism",
                        )
                        .with_label(m.layers_span, "a model with branches")
                        .with_help("use `tp: 1` and pipeline or data parallelism for this model"),
                    );
                    return None;
                }
            }
            Some(tp)
        }),
    };
    let schedule = cx
        .required(&f, "schedule", "strategy")
        .and_then(|n| lower_schedule(cx, n, f.key_span("schedule").unwrap_or(owner)));
    if let (Some(s), Some(t)) = (&schedule, training) {
        let per_step = s.kind.updates_per_step() && s.staleness == 0;
        if t.recipe.running_stats == pipec_plan::recipe::RunningStats::PerForward && !per_step {
            cx.push(
                Diagnostic::error(
                    "E0504",
                    format!(
                        "`running_stats: per_forward` folds a step's microbatches in order, and `{}` does not update once per step",
                        s.kind
                    ),
                    s.span,
                    "updates on its own clock",
                )
                .with_help("use `running_stats: per_update` (each update folds the mean of its microbatches' statistics), or a synchronous schedule"),
            );
        }
    }
    let microbatches_node = f.get("microbatches");
    let microbatches = match microbatches_node {
        None => Some(1),
        Some(n) => cx.uint(n, 1),
    };
    let recompute = match f.get("recompute") {
        None => Some(Recompute::Off),
        Some(n) => lower_recompute(cx, n, model),
    };
    let overlap = match f.get("overlap") {
        None => Some(true),
        Some(n) => cx.boolean(n),
    };
    let sequence_parallel = lower_sequence_parallel(cx, &f, tp);
    let tp_overlap = lower_tp_overlap(cx, &f, tp);
    let sharding = lower_sharding(cx, &f);
    let bucket = lower_bucket(cx, &f);
    let ep = match f.get("ep") {
        None => Some(1),
        Some(n) => cx.uint(n, 1),
    };
    let cp = match f.get("cp") {
        None => Some(1),
        Some(n) => cx.uint(n, 1),
    };
    let cp_comm = lower_cp_comm(cx, &f, cp);
    let moe_dispatch = lower_moe_dispatch(cx, &f, ep);
    let ep_overlap = lower_ep_overlap(cx, &f, ep, schedule.as_ref().map(|s| s.kind));
    let whole_experts = lower_etp(cx, &f, (tp, ep, sequence_parallel));
    let written = lower_layout(cx, &f, owner, schedule.as_ref().map(|s| s.kind));

    // the batch's split into microbatches does not depend on the schedule: with a broken
    // schedule it is still checked, so both are reported at once
    if let (None, Some(n), Some(t), Some(node)) = (&schedule, microbatches, training, microbatches_node) {
        if t.batch_size % n != 0 {
            let help =
                format!("choose microbatches among the divisors of {}: {}", t.batch_size, divisors_hint(t.batch_size));
            cx.push(batch_indivisible(t, n, node.span, &help));
        }
    }
    let (tp, schedule, microbatches, recompute, written) = (tp?, schedule?, microbatches?, recompute?, written?);
    let (overlap, sequence_parallel, sharding, ep, bucket) = (overlap?, sequence_parallel?, sharding?, ep?, bucket?);
    let (cp, tp_overlap, cp_comm, moe_dispatch, ep_overlap) = (cp?, tp_overlap?, cp_comm?, moe_dispatch?, ep_overlap?);
    let whole_experts = whole_experts?;
    // an expert-parallel group's replicas (its `ep` devices are, with whole experts, the
    // tensor-parallel ranks of ep / tp replicas)
    let ep_replicas = crate::ast::expert_group_replicas(ep, tp, whole_experts);
    // a stage replica is `tp` × `cp` devices
    let layout = resolve_layout(cx, &f, owner, written, cluster, tp * cp)?;
    // ZeRO shards over a stage's data- and context-parallel members together
    let members: Vec<usize> = layout.replicas.iter().map(|r| r * cp).collect();
    let mut ok = check_sharding(cx, &f, sharding, &members, Some(&schedule));
    ok &= check_expert_parallelism(cx, &f, (ep, ep_replicas), model, Some(&members), cp, Some(&schedule));
    ok &= check_context_parallelism(cx, &f, cp, model, Some(&schedule));
    let partition_node = f.get("partition");
    // `partition: auto` with no layout written: PipeDream's planner picks the stages and
    // their replication when compiling (at most one per layer); until then the layout is
    // one stage per device
    let planned = (!layout.fixed
        && schedule.virtual_stages == 1
        && schedule.kind.auto_replicates()
        && partition_node.is_some_and(is_auto))
    .then(|| model.map_or(layout.replicas.len(), |m| m.layers.len().clamp(1, layout.replicas.len())));
    ok &= check_device_count(cx, &layout, tp, cp, cluster);
    let stages = planned.unwrap_or(layout.replicas.len());
    check_size(cx, stages, &schedule, microbatches, microbatches_node.map_or(owner, |n| n.span))?;
    let written_mb = MicrobatchesWritten { count: microbatches, span: microbatches_node.map(|n| n.span), owner };
    ok &= check_schedule_and_microbatches(cx, &layout, planned.is_some(), &schedule, written_mb, model, training);
    if ep_overlap {
        ok &= check_ep_overlap(cx, &f, &schedule, &layout.replicas, microbatches);
    }

    let chunks = layout.replicas.len() * schedule.virtual_stages;
    let partition = lower_partition(cx, partition_node, model, chunks)?;
    // recomputed stages exist (a planned layout's stages are known when compiling)
    if let (None, Some(s), Some(n)) = (planned, recompute.beyond(chunks), f.get("recompute")) {
        // the list item that names it
        let at = match &n.value {
            Value::Seq(items) => items.iter().find(|i| matches!(i.value, Value::Int(v) if v == s as i64)),
            _ => None,
        };
        cx.push(recompute_beyond(s, chunks, at.map_or(n.span, |i| i.span), layout.span));
        ok = false;
    }
    if !ok {
        return None;
    }
    let mut strategy = Strategy {
        replicas: layout.replicas,
        tp,
        schedule,
        microbatches,
        partition,
        recompute,
        overlap,
        bucket,
        sequence_parallel,
        tp_overlap,
        cp_comm,
        moe_dispatch,
        ep_overlap,
        sharding,
        ep,
        whole_experts,
        cp: 1,
        auto: None,
        layout_span: layout.span,
        layout_fixed: layout.fixed,
        partition_span: partition_node.map_or(owner, |n| n.span),
        microbatches_span: microbatches_node.map(|n| n.span),
        span: node.span,
    };
    strategy.split_sequences(cp);
    Some(strategy)
}

/// E0412: `recompute` names stage `stage` of a plan with `stages` stages.
pub fn recompute_beyond(stage: usize, stages: usize, at: Span, layout: Span) -> Diagnostic {
    Diagnostic::error(
        "E0412",
        format!(
            "`recompute` names stage {stage}, but the strategy has {stages} stage(s) (0 to {})",
            stages.saturating_sub(1)
        ),
        at,
        format!("stage {stage}"),
    )
    .with_label(layout, format!("{stages} stage(s)"))
    .with_help("name stages from 0 (one per virtual stage for interleaved schedules), or `recompute: true` for all")
}

/// `sequence_parallel`: a boolean, and only with tensor parallelism (E0413).
fn lower_sequence_parallel(cx: &mut Lower<'_>, f: &Fields<'_>, tp: Option<usize>) -> Option<bool> {
    let message = "sequence parallelism splits what tensor parallelism leaves whole, and `tp` is 1";
    lower_tensor_parallel_flag(cx, f, tp, ("sequence_parallel", "E0413", message))
}

/// `tp_overlap`: a boolean, and only with tensor parallelism (E0423).
fn lower_tp_overlap(cx: &mut Lower<'_>, f: &Fields<'_>, tp: Option<usize>) -> Option<bool> {
    let message = "`tp_overlap` overlaps tensor parallelism's collectives, and `tp` is 1: there are none";
    lower_tensor_parallel_flag(cx, f, tp, ("tp_overlap", "E0423", message))
}

/// `moe_dispatch`: `all_to_all` (the default) or `deepep`, and DeepEP only where there is
/// expert parallelism to dispatch over.
fn lower_moe_dispatch(cx: &mut Lower<'_>, f: &Fields<'_>, ep: Option<usize>) -> Option<pipec_plan::vocab::MoeDispatch> {
    use pipec_plan::vocab::MoeDispatch;
    let Some(n) = f.get("moe_dispatch") else { return Some(MoeDispatch::AllToAll) };
    let dispatch = cx.choose::<MoeDispatch>(n, &["strategy", "moe_dispatch"])?;
    if dispatch == MoeDispatch::DeepEp && ep == Some(1) {
        cx.push(
            Diagnostic::error(
                "E0105",
                "`moe_dispatch: deepep` sends tokens to other devices' experts, and `ep` is 1: there is no exchange",
                n.span,
                "nothing to dispatch",
            )
            .with_help("set `ep` to the expert-parallel degree, or remove `moe_dispatch`"),
        );
        return None;
    }
    Some(dispatch)
}

/// `etp`: expert tensor parallelism, 1 or `tp` (the default), as torchtitan allows
/// (`parallel_dims.py`: "ETP=TP or ETP=1"). `etp: 1` beside `tp` > 1 folds the
/// tensor-parallel ranks into the expert-parallel group: `ep` counts devices and must be a
/// multiple of `tp`, and each rank dispatches its sequence share, which needs
/// `sequence_parallel` (Megatron-LM's MoE layer refuses tensor parallelism without it,
/// `moe_layer.py`) (E0428). Returns whether experts are whole (`etp: 1`). The values not
/// yet known (`auto`: None) are checked by the search.
fn lower_etp(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    (tp, ep, sp): (Option<usize>, Option<usize>, Option<bool>),
) -> Option<bool> {
    let Some(n) = f.get("etp") else { return Some(false) };
    let etp = cx.uint(n, 1)?;
    let problem = match (tp, ep) {
        (Some(tp), _) if etp != 1 && etp != tp => Some((
            format!("`etp: {etp}` splits each expert over {etp} devices, and `tp` is {tp}: an expert is split like the block (`etp: {tp}`) or whole (`etp: 1`)"),
            format!("write `etp: 1` or remove `etp` (the same as `etp: {tp}`)"),
        )),
        (None, _) if etp != 1 => Some((
            format!("`etp: {etp}` must equal the tensor-parallel degree, which the search chooses"),
            "write `etp: 1` (experts whole), or write `tp` too".to_string(),
        )),
        (Some(tp), Some(ep)) if etp == 1 && tp > 1 && !ep.is_multiple_of(tp) => Some((
            format!("`etp: 1` folds the {tp} tensor-parallel ranks of each replica into the expert-parallel group, and `ep: {ep}` is not a multiple of {tp}"),
            format!("write `ep` as a multiple of {tp} (the group's devices: {tp} per replica), or remove `etp`"),
        )),
        (Some(tp), _) if etp == 1 && tp > 1 && sp == Some(false) => Some((
            "`etp: 1` has each tensor-parallel rank dispatch its share of the sequence, which needs `sequence_parallel: true`".to_string(),
            "add `sequence_parallel: true` (Megatron-LM refuses a mixture of experts beside tensor parallelism without it), or remove `etp`".to_string(),
        )),
        _ => None,
    };
    if let Some((message, help)) = problem {
        cx.push(Diagnostic::error("E0428", message, n.span, "expert tensor parallelism").with_help(help));
        return None;
    }
    Some(etp == 1)
}

/// `ep_overlap`: a boolean, and only where there are all-to-alls to overlap (`ep` above 1,
/// or `auto`: None) on a schedule that combines 1F1B (the schedule written; None: the
/// search's, which keeps it only on such schedules) (E0427). The layout's part of the rule
/// is [`check_ep_overlap`]'s.
fn lower_ep_overlap(cx: &mut Lower<'_>, f: &Fields<'_>, ep: Option<usize>, kind: Option<ScheduleKind>) -> Option<bool> {
    let Some(n) = f.get("ep_overlap") else { return Some(false) };
    let on = cx.boolean(n)?;
    if !on {
        return Some(false);
    }
    if ep == Some(1) {
        cx.push(
            Diagnostic::error(
                "E0427",
                "`ep_overlap` overlaps expert parallelism's all-to-alls, and `ep` is 1: there are none",
                n.span,
                "needs `ep` > 1",
            )
            .with_help("set `ep` to the expert-parallel degree, or remove `ep_overlap`"),
        );
        return None;
    }
    if let Some((kind, why)) =
        kind.and_then(|k| pipec_plan::schedule::Pairing::combined_1f1b_schedule_obstacle(k).map(|w| (k, w)))
    {
        cx.push(ep_overlap_obstacle(n.span, &format!("not with `{kind}`"), &why));
        return None;
    }
    Some(true)
}

/// E0427: Megatron-LM's combined 1F1B cannot run, for the reason `why`
/// (`Pairing::combined_1f1b_obstacle`).
fn ep_overlap_obstacle(at: Span, label: &str, why: &str) -> Diagnostic {
    Diagnostic::error("E0427", format!("`ep_overlap` cannot pair this layout's passes: {why}"), at, label.to_string())
        .with_help("use `schedule: 1f1b` or `dp-only` on one stage, or `interleaved` with a pipeline and enough microbatches; or remove `ep_overlap`")
}

/// `ep_overlap` on the resolved layout: a pipeline only on the interleaved schedule, with a
/// 1F1B phase on every rank (E0427).
fn check_ep_overlap(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    schedule: &Schedule,
    replicas: &[usize],
    microbatches: usize,
) -> bool {
    let Some(n) = f.get("ep_overlap") else { return true };
    let obstacle = pipec_plan::schedule::Pairing::combined_1f1b_obstacle(
        schedule.kind,
        replicas,
        schedule.virtual_stages,
        microbatches,
    );
    let Some(why) = obstacle else { return true };
    cx.push(ep_overlap_obstacle(n.span, "here", &why));
    false
}

/// `cp_comm`: `all_gather` (the default) or `ring`, and a ring only where there is
/// context parallelism: a `cp` above 1 or `auto` (`cp` None) (E0424).
fn lower_cp_comm(cx: &mut Lower<'_>, f: &Fields<'_>, cp: Option<usize>) -> Option<CpComm> {
    let Some(n) = f.get("cp_comm") else { return Some(CpComm::AllGather) };
    let comm = cx.choose::<CpComm>(n, &["strategy", "cp_comm"])?;
    if comm == CpComm::Ring && cp == Some(1) {
        cx.push(
            Diagnostic::error(
                "E0424",
                "`cp_comm: ring` passes keys and values around a context-parallel group, and `cp` is 1: there is none",
                n.span,
                "needs `cp` > 1",
            )
            .with_help("set `cp` to the context-parallel degree (or `cp: auto`), or remove `cp_comm`"),
        );
        return None;
    }
    Some(comm)
}

/// A boolean `key` that means something only with tensor parallelism: `code` with `message`
/// where it is true and `tp` is 1.
fn lower_tensor_parallel_flag(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    tp: Option<usize>,
    (key, code, message): (&str, &'static str, &str),
) -> Option<bool> {
    let Some(n) = f.get(key) else { return Some(false) };
    let on = cx.boolean(n)?;
    if on && tp == Some(1) {
        cx.push(Diagnostic::error(code, message, n.span, "needs `tp` > 1").with_help(format!(
            "set `tp` to the tensor-parallel degree (2 to the devices of a node), or remove `{key}`"
        )));
        return None;
    }
    Some(on)
}

/// `zero`: ZeRO's stage, 0 to 3.
fn lower_sharding(cx: &mut Lower<'_>, f: &Fields<'_>) -> Option<Sharding> {
    let Some(n) = f.get("zero") else { return Some(Sharding::None) };
    let level = cx.uint(n, 0)?;
    match Sharding::of_level(level as u64) {
        Some(s) => Some(s),
        None => {
            cx.push(
                Diagnostic::error("E0105", format!("ZeRO has stages 0 to 3, found {level}"), n.span, "0, 1, 2 or 3")
                    .with_help("1 shards the optimizer state, 2 also the gradients, 3 also the weights"),
            );
            None
        }
    }
}

/// `bucket`: a size in bytes (at least 1 KiB), or `none` (the default).
fn lower_bucket(cx: &mut Lower<'_>, f: &Fields<'_>) -> Option<Option<u64>> {
    let Some(n) = f.get("bucket") else { return Some(None) };
    if matches!(&n.value, Value::Str(s) if s == "none") {
        return Some(None);
    }
    let bytes = cx.quantity(n, crate::dsl::Dimension::Bytes, false)?;
    if bytes < 1024.0 {
        cx.push(
            Diagnostic::error(
                "E0105",
                format!("a gradient bucket of {bytes} bytes is too small"),
                n.span,
                "at least 1KiB",
            )
            .with_help("PyTorch DDP's default is `25MiB`; `none` reduces each stage's gradients in one all-reduce"),
        );
        return None;
    }
    Some(Some(bytes as u64))
}

/// E0414: sharding across data-parallel replicas needs a stage with more than one; E0415:
/// and a schedule that updates every stage once per step (the replicas' shards are
/// reduced, updated and gathered together).
fn check_sharding(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    sharding: Sharding,
    replicas: &[usize],
    schedule: Option<&crate::ast::Schedule>,
) -> bool {
    let Some(at) = f.get("zero").map(|n| n.span) else { return true };
    if sharding == Sharding::None {
        return true;
    }
    if let Some(schedule) = schedule {
        let asp = schedule.sync == pipec_plan::vocab::SyncMode::Asp;
        if asp || schedule.kind.updates(replicas.len()) != pipec_plan::schedule::Updates::PerStep {
            let why = if asp {
                "asynchronous data parallelism applies each replica's gradients on a parameter server".to_string()
            } else {
                format!("`{}` updates each stage on its own clock, not once per step", schedule.kind.name())
            };
            cx.push(
                Diagnostic::error(
                    "E0415",
                    format!("`zero: {}` needs every replica to update together once per step, and {why}", sharding.level()),
                    at,
                    "sharded across replicas",
                )
                .with_label(schedule.span, "this schedule")
                .with_help("use a synchronous schedule (gpipe, 1f1b, interleaved, zb-h1, ...; dp-only with `sync: bsp`), or remove `zero`"),
            );
            return false;
        }
    }
    if replicas.iter().any(|&r| r > 1) {
        return true;
    }
    cx.push(
        Diagnostic::error(
            "E0414",
            format!("`zero: {}` shards across data-parallel replicas, and no stage is replicated", sharding.level()),
            at,
            "nothing to shard over",
        )
        .with_help("replicate stages (`dp` > 1, or PipeDream's `stages: \"2-2\"`), or remove `zero`"),
    );
    false
}

/// `recompute`: `true`, `false`, `selective`, a list of stage indices (sorted, without
/// repeats), or a mapping of what every transformer block recomputes.
fn lower_recompute(cx: &mut Lower<'_>, node: &Node, model: Option<&Model>) -> Option<Recompute> {
    match &node.value {
        Value::Map(_) => lower_block_recompute(cx, node, model).map(Recompute::Blocks),
        Value::Bool(true) => Some(Recompute::All),
        Value::Bool(false) => Some(Recompute::Off),
        Value::Str(s) if s == "selective" => Some(Recompute::Selective),
        Value::Str(s) if s == "full" => Some(Recompute::All),
        Value::Seq(items) => {
            let mut stages = Vec::with_capacity(items.len());
            for item in items {
                stages.push(cx.uint(item, 0)?);
            }
            stages.sort_unstable();
            stages.dedup();
            Some(if stages.is_empty() { Recompute::Off } else { Recompute::Stages(stages) })
        }
        _ => {
            cx.wrong_type(
                node,
                "`true`, `false`, `selective`, a list of stage indices such as `[0, 1]`, or a mapping such as `{ modules: [core_attn, mlp] }`",
            );
            None
        }
    }
}

/// `recompute` as a mapping: `modules` (Megatron-LM's) or `ops` (torchtitan's op-level
/// policy), `layers` (the first blocks of every stage whole), `offload`; E0425 where they do
/// not go together or say nothing.
fn lower_block_recompute(cx: &mut Lower<'_>, node: &Node, model: Option<&Model>) -> Option<BlockRecompute> {
    let f = cx.fields(node, &["strategy", "recompute"], node.span)?;
    let names = |cx: &mut Lower<'_>, key: &str| -> Option<Vec<Node>> {
        match f.get(key) {
            None => Some(Vec::new()),
            Some(n) => match &n.value {
                Value::Seq(items) => Some(items.clone()),
                _ => {
                    cx.wrong_type(n, "a list of names such as `[core_attn, mlp]`");
                    None
                }
            },
        }
    };
    let modules = names(cx, "modules").and_then(|items| {
        let chosen: Option<Vec<RecomputeModule>> =
            items.iter().map(|n| cx.choose::<RecomputeModule>(n, &["strategy", "recompute", "modules"])).collect();
        if let (Some(chosen), Some(model)) = (&chosen, model) {
            for (module, n) in chosen.iter().zip(&items) {
                if let Some(why) = module_applies_to_nothing(*module, model) {
                    cx.push(
                        Diagnostic::warning(
                            "W0426",
                            format!("`{}` recomputes nothing in this model: {why}", module.name()),
                            n.span,
                            "applies to no block",
                        )
                        .with_help("remove it"),
                    );
                }
            }
        }
        chosen
    });
    let ops = names(cx, "ops").and_then(|items| {
        let chosen: Option<Vec<RecomputeOp>> =
            items.iter().map(|n| cx.choose::<RecomputeOp>(n, &["strategy", "recompute", "ops"])).collect();
        chosen
    });
    let layers = f.get("layers").map_or(Some(0), |n| cx.uint(n, 1));
    let offload = f.get("offload").map_or(Some(false), |n| cx.boolean(n));
    let (mut modules, mut ops, layers, offload) = (modules?, ops?, layers?, offload?);
    modules.sort();
    modules.dedup();
    ops.sort();
    ops.dedup();
    let problem = if !modules.is_empty() && !ops.is_empty() {
        Some((
            f.key_span("ops").unwrap_or(node.span),
            "`modules` and `ops` are two ways to say what a block recomputes: name one".to_string(),
            "keep `modules` (Megatron-LM's recompute_modules) or `ops` (the operations whose outputs are kept), not both",
        ))
    } else if modules.is_empty() && ops.is_empty() && layers == 0 && !offload {
        Some((
            node.span,
            "this `recompute` mapping says nothing to recompute".to_string(),
            "name `modules`, `ops` or `layers`, or write `recompute: false`",
        ))
    } else {
        None
    };
    if let Some((span, message, help)) = problem {
        cx.push(Diagnostic::error("E0425", message, span, "here").with_help(help));
        return None;
    }
    Some(BlockRecompute { modules, ops, layers, offload })
}

/// Whether a value is the word `auto`.
pub(crate) fn is_auto(node: &Node) -> bool {
    matches!(&node.value, Value::Str(s) if s == "auto")
}

/// What makes a written strategy a searched one: its first `auto` value or its `search`
/// mapping (None: the strategy is written whole).
fn auto_reason(f: &Fields<'_>) -> Option<Span> {
    ["stages", "dp", "pp", "tp", "schedule", "microbatches", "recompute", "ep", "cp"]
        .iter()
        .filter_map(|k| f.get(k).filter(|n| is_auto(n)).map(|n| n.span))
        .chain(f.key_span("search"))
        .next()
}

/// A strategy the search fills in: placeholders (one data-parallel stage on every device,
/// `dp-only`, one microbatch) where it is free; the fields written stay as written, and the
/// search keeps them (`auto`).
fn placeholder_strategy(node: &Node, owner: Span, cluster: Option<&Cluster>, auto: AutoStrategy) -> Strategy {
    let devices = cluster.map_or(1, Cluster::device_count).max(1);
    Strategy {
        replicas: vec![devices],
        tp: 1,
        schedule: Schedule::new(ScheduleKind::DpOnly, node.span),
        microbatches: 1,
        partition: Partition::Balanced,
        recompute: Recompute::Off,
        overlap: true,
        bucket: None,
        sequence_parallel: false,
        tp_overlap: false,
        cp_comm: CpComm::AllGather,
        moe_dispatch: Default::default(),
        ep_overlap: false,
        sharding: Sharding::None,
        ep: 1,
        whole_experts: false,
        cp: 1,
        auto: Some(auto),
        layout_span: node.span,
        layout_fixed: false,
        partition_span: owner,
        microbatches_span: None,
        span: node.span,
    }
}

/// A strategy with `auto` fields or `search` constraints: the fixed fields are read (and
/// checked on their own), the search does the rest.
fn lower_auto_strategy(
    cx: &mut Lower<'_>,
    node: &Node,
    f: &Fields<'_>,
    owner: Span,
    (model, cluster): (Option<&Model>, Option<&Cluster>),
) -> Option<Strategy> {
    let free = |key: &str| f.get(key).is_some_and(is_auto);
    let layout_free = free("stages") || free("dp") || free("pp");
    let mut auto = AutoStrategy {
        layout: layout_free || (f.get("stages").is_none() && f.get("dp").is_none() && f.get("pp").is_none()),
        tp: free("tp") || f.get("tp").is_none(),
        schedule: free("schedule") || f.get("schedule").is_none(),
        microbatches: free("microbatches") || f.get("microbatches").is_none(),
        recompute: free("recompute") || f.get("recompute").is_none(),
        ep: free("ep") || f.get("ep").is_none(),
        cp: free("cp"),
        cp_comm: f.get("cp_comm").is_none(),
        sequence_parallel: f.get("sequence_parallel").is_none(),
        tp_overlap: f.get("tp_overlap").is_none(),
        moe_dispatch: f.get("moe_dispatch").is_none(),
        ep_overlap: f.get("ep_overlap").is_none(),
        asynchronous: false,
        max_depth: None,
        headroom: pipec_plan::rules::DEFAULT_MEMORY_HEADROOM,
        schedules: None,
    };
    let mut ok = true;
    if let Some(n) = f.get("search") {
        let g = cx.fields(n, &["strategy", "search"], owner)?;
        if let Some(a) = g.get("async") {
            auto.asynchronous = cx.boolean(a).unwrap_or_else(|| {
                ok = false;
                false
            });
        }
        if let Some(d) = g.get("max_depth") {
            auto.max_depth = cx.uint(d, 1);
            ok &= auto.max_depth.is_some();
        }
        if let Some(h) = g.get("headroom") {
            match headroom(h) {
                Some(v) => auto.headroom = v,
                None => {
                    cx.push(Diagnostic::error(
                        "E0105",
                        "a memory headroom is a percentage below 100, e.g. `10%`",
                        h.span,
                        "expected a percentage",
                    ));
                    ok = false;
                }
            }
        }
        if let Some(list) = g.get("schedules") {
            match &list.value {
                Value::Seq(items) => {
                    let kinds: Vec<Option<ScheduleKind>> = items.iter().map(|i| schedule_name(cx, i)).collect();
                    ok &= kinds.iter().all(Option::is_some);
                    auto.schedules = Some(kinds.into_iter().flatten().collect());
                }
                _ => {
                    cx.wrong_type(list, "a list of schedule names");
                    ok = false;
                }
            }
        }
    }
    // the search lays stages out itself (balanced, or PipeDream's planner): a partition
    // written out would be lost
    if let Some(p) = f.get("partition").filter(|p| matches!(p.value, Value::Seq(_))) {
        let reason = auto_reason(f).unwrap_or(node.span);
        cx.push(
            Diagnostic::error(
                "E0410",
                "stage boundaries written out, and the strategy is left to the search",
                p.span,
                "an explicit partition",
            )
            .with_label(reason, "the search lays the stages out because of this")
            .with_help(
                "remove `partition` (the search splits stages with `partition: balanced` and tries PipeDream's \
                 planner), or write every strategy field",
            ),
        );
        ok = false;
    }
    let mut strategy = placeholder_strategy(node, owner, cluster, auto.clone());
    if !auto.tp {
        strategy.tp = f.get("tp").and_then(|n| cx.uint(n, 1))?;
    }
    if !auto.schedule {
        let n = f.get("schedule")?;
        strategy.schedule = lower_schedule(cx, n, f.key_span("schedule").unwrap_or(owner))?;
        // the search writes a schedule's kind and chunks: other options would be lost
        let plain = Schedule {
            virtual_stages: strategy.schedule.virtual_stages,
            ..Schedule::new(strategy.schedule.kind, strategy.schedule.span)
        };
        if strategy.schedule != plain {
            cx.push(
                Diagnostic::error(
                    "E0410",
                    "schedule options written (`sync`, `reduce`, `staleness` or `vertical_sync`), and the strategy is left to the search",
                    n.span,
                    "options the search does not keep",
                )
                .with_help("remove them (the search tries each schedule with its defaults), or write every strategy field"),
            );
            ok = false;
        }
    }
    if !auto.microbatches {
        let n = f.get("microbatches")?;
        strategy.microbatches = cx.uint(n, 1)?;
        strategy.microbatches_span = Some(n.span);
    }
    if !auto.recompute {
        strategy.recompute = f.get("recompute").and_then(|n| lower_recompute(cx, n, model))?;
    }
    if let Some(n) = f.get("overlap") {
        strategy.overlap = cx.boolean(n)?;
    }
    strategy.sequence_parallel = lower_sequence_parallel(cx, f, (!auto.tp).then_some(strategy.tp))?;
    strategy.tp_overlap = lower_tp_overlap(cx, f, (!auto.tp).then_some(strategy.tp))?;
    strategy.sharding = lower_sharding(cx, f)?;
    strategy.bucket = lower_bucket(cx, f)?;
    if !auto.ep {
        strategy.ep = f.get("ep").and_then(|n| cx.uint(n, 1))?;
    }
    let written_ep = (!auto.ep).then_some(strategy.ep);
    let written_tp = (!auto.tp).then_some(strategy.tp);
    strategy.whole_experts = lower_etp(cx, f, (written_tp, written_ep, Some(strategy.sequence_parallel)))?;
    strategy.moe_dispatch = lower_moe_dispatch(cx, f, written_ep)?;
    let written_kind = (!auto.schedule).then_some(strategy.schedule.kind);
    strategy.ep_overlap = lower_ep_overlap(cx, f, written_ep, written_kind)?;
    let written_cp = match f.get("cp") {
        Some(n) if !is_auto(n) => Some(cx.uint(n, 1)?),
        Some(_) => None,
        None => Some(1),
    };
    strategy.cp_comm = lower_cp_comm(cx, f, written_cp)?;
    match f.get("cp") {
        Some(n) if !is_auto(n) => {
            // a written degree the search keeps: checked against the model, and the schedule
            // when it is written too
            strategy.cp = cx.uint(n, 1)?;
            let schedule = (!auto.schedule).then_some(&strategy.schedule);
            ok &= check_context_parallelism(cx, f, strategy.cp, model, schedule);
        }
        // `cp: auto`: the search tries the degrees the model allows
        Some(n) => {
            if let Some(obstacle) = model.and_then(context_parallel_obstacle) {
                cx.push(not_split_along_the_sequence(
                    "`cp: auto` searches context parallelism".into(),
                    n.span,
                    obstacle,
                    "remove `cp`: this model is not split along its sequence",
                ));
                ok = false;
            }
        }
        None => {}
    }
    if !auto.layout {
        let kind = (!auto.schedule).then_some(strategy.schedule.kind);
        let written = lower_layout(cx, f, owner, kind)?;
        let layout = resolve_layout(cx, f, owner, written, cluster, strategy.tp * strategy.cp)?;
        ok &= check_device_count(cx, &layout, strategy.tp, strategy.cp, cluster);
        let schedule = (!auto.schedule).then_some(&strategy.schedule);
        let members: Vec<usize> = layout.replicas.iter().map(|r| r * strategy.cp).collect();
        ok &= check_sharding(cx, f, strategy.sharding, &members, schedule);
        // (whole experts beside a searched `tp`: the search groups the replicas)
        let ep = (strategy.ep, if strategy.whole_experts && auto.tp { 1 } else { strategy.ep_replicas() });
        ok &= check_expert_parallelism(cx, f, ep, model, Some(&members), strategy.cp, schedule);
        strategy.replicas = layout.replicas;
        strategy.layout_span = layout.span;
        strategy.layout_fixed = true;
    }
    if auto.layout {
        let schedule = (!auto.schedule).then_some(&strategy.schedule);
        let ep = (strategy.ep, strategy.ep_replicas());
        ok &= check_expert_parallelism(cx, f, ep, model, None, strategy.cp, schedule);
    }
    // the search keeps `ep_overlap` only where it can pair; a layout written whole is checked
    if strategy.ep_overlap && !auto.layout && !auto.schedule && !auto.microbatches {
        ok &= check_ep_overlap(cx, f, &strategy.schedule, &strategy.replicas, strategy.microbatches);
    }
    ok.then_some(strategy)
}

/// Context parallelism (`cp` > 1): a language model whose layers mix positions only in
/// attention (E0420: a chain from a token embedding without token types through
/// transformer blocks without experts and per-token layers, to a cross-entropy over every
/// position), a sequence of 2·cp equal chunks (E0421), and groups whose members run every
/// pass together: a synchronous schedule that updates once per step with one copy of each
/// stage per replica (E0422).
fn check_context_parallelism(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    cp: usize,
    model: Option<&Model>,
    schedule: Option<&crate::ast::Schedule>,
) -> bool {
    let Some(at) = f.get("cp").map(|n| n.span) else { return true };
    if cp <= 1 {
        return true;
    }
    let mut ok = true;
    if let Some(m) = model {
        if let Some(obstacle) = context_parallel_obstacle(m) {
            cx.push(not_split_along_the_sequence(
                format!("`cp: {cp}` splits every sequence over devices"),
                at,
                obstacle,
                "use `cp` with a language model of transformer blocks (token embedding, blocks, per-token layers, cross-entropy), or remove `cp`",
            ));
            ok = false;
        } else if let Some(&seq) = m.input.first() {
            if !seq.is_multiple_of(2 * cp) {
                let fits: Vec<String> =
                    (2..=seq / 2).filter(|k| seq.is_multiple_of(2 * k)).take(6).map(|k| k.to_string()).collect();
                cx.push(
                    Diagnostic::error(
                        "E0421",
                        format!(
                            "`cp: {cp}` splits each sequence into {} equal chunks, and {seq} positions do not divide",
                            2 * cp
                        ),
                        at,
                        format!("{} chunks", 2 * cp),
                    )
                    .with_label(m.input_span, format!("{seq} positions"))
                    .with_help(if fits.is_empty() {
                        "remove `cp`: the sequence is too short to split".to_string()
                    } else {
                        format!("choose cp from {} (2·cp must divide the sequence)", fits.join(", "))
                    }),
                );
                ok = false;
            }
        }
    }
    let why = schedule.and_then(|s| s.kind.context_parallel_obstacle(s.sync).map(|why| format!("`{}` {why}", s.kind)));
    if let Some(why) = why {
        cx.push(
            Diagnostic::error("E0422", format!("`cp: {cp}` cannot be combined with this strategy: {why}"), at, "context parallelism")
                .with_help("use a synchronous schedule with one copy of each stage (gpipe, 1f1b, interleaved, zb-h1, dp-only), or remove `cp`"),
        );
        ok = false;
    }
    ok
}

/// E0420: `what` (a `cp` at `at`) on a model that is not split along its sequence, for the
/// reason and at the layer [`context_parallel_obstacle`] gives.
fn not_split_along_the_sequence(what: String, at: Span, (span, why): (Span, String), help: &str) -> Diagnostic {
    Diagnostic::error("E0420", format!("{what}, and {why}"), at, "context parallelism")
        .with_label(span, "here")
        .with_help(help)
}

/// Why a model cannot be split along its sequence (None: it can), and where.
pub fn context_parallel_obstacle(m: &Model) -> Option<(Span, String)> {
    use pipec_plan::model::Op;
    if !m.is_chain() {
        return Some((m.layers_span, "this model has branches or joins (a chain of layers is split)".into()));
    }
    if m.loss != pipec_plan::vocab::Loss::CrossEntropy {
        return Some((m.loss_span, "only a cross-entropy over every position is split".into()));
    }
    let first = m.layers.first()?;
    if !matches!(first.op, Op::Embedding { types: 0, sep: None, .. }) {
        return Some((first.span, "its first layer is not a token embedding without token types".into()));
    }
    let last = m.layers.last()?;
    if last.output_shape.len() != 2 {
        return Some((last.span, "its output is not one row per position".into()));
    }
    m.layers.iter().find_map(|l| {
        let why = match &l.op {
            Op::Embedding { .. } if !std::ptr::eq(l, first) => "a second embedding",
            Op::Embedding { .. }
            | Op::PosEmbedding { .. }
            | Op::TransformerBlock { .. }
            | Op::Linear { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Dropout { .. }
            | Op::Relu
            | Op::Gelu
            | Op::GeluTanh
            | Op::Tanh
            | Op::Sigmoid => return None,
            _ => "this layer mixes positions, or is not per token",
        };
        Some((l.span, format!("{} ({why})", l.op.name())))
    })
}

/// `ep`: expert parallelism needs expert blocks whose experts it divides (E0416, E0418),
/// replicated stages whose `members` (replicas times `cp`: expert groups are drawn from a
/// stage's data- and context-parallel members; pipeline pairs under Chimera and DualPipe)
/// it divides (E0417), and replicas that run every pass in step (E0419: an asynchronous schedule's
/// replicas run their passes at different times). Every ZeRO level combines with it.
fn check_expert_parallelism(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    (ep, ep_replicas): (usize, usize),
    model: Option<&Model>,
    members: Option<&[usize]>,
    cp: usize,
    schedule: Option<&crate::ast::Schedule>,
) -> bool {
    let Some(at) = f.get("ep").map(|n| n.span) else { return true };
    if ep <= 1 {
        return true;
    }
    let mut ok = true;
    if let Some(m) = model {
        let experts: Vec<(&crate::ast::Layer, usize)> =
            m.layers.iter().filter_map(|l| l.op.moe().map(|moe| (l, moe.experts))).collect();
        if experts.is_empty() {
            cx.push(
                Diagnostic::error(
                    "E0416",
                    format!("`ep: {ep}` divides a mixture of experts over devices, and the model has no expert blocks"),
                    at,
                    "nothing to divide",
                )
                .with_label(m.layers_span, "no `experts=` block")
                .with_help("remove `ep`, or give the transformer blocks `experts=E` (a multiple of ep)"),
            );
            ok = false;
        } else if let Some((layer, e)) = experts.iter().find(|(_, e)| e % ep != 0) {
            let fits: Vec<String> = (2..=*e).filter(|k| e % k == 0).map(|k| k.to_string()).collect();
            cx.push(
                Diagnostic::error(
                    "E0418",
                    format!("`ep: {ep}` does not divide this block's {e} experts: every member holds an equal share"),
                    at,
                    format!("{ep} members"),
                )
                .with_label(layer.span, format!("{e} experts"))
                .with_help(if fits.is_empty() {
                    "remove `ep`: a block with one expert has nothing to divide".to_string()
                } else {
                    format!("choose ep from {}", fits.join(", "))
                }),
            );
            ok = false;
        }
    }
    // with whole experts (`etp: 1`) a group's `ep` devices are the tensor-parallel ranks of
    // ep / tp replicas
    let written = if ep != ep_replicas { format!("`ep: {ep}` with `etp: 1`") } else { format!("`ep: {ep}`") };
    let ep = ep_replicas;
    if let Some(r) = members.filter(|r| r.iter().any(|&n| n % ep != 0)) {
        let stage = r.iter().position(|&n| n % ep != 0).unwrap_or(0);
        let has = if cp > 1 {
            format!("{} member(s): its replicas times `cp: {cp}`", r[stage])
        } else {
            format!("{} replica(s)", r[stage])
        };
        cx.push(
            Diagnostic::error(
                "E0417",
                format!("{written} groups each stage's replicas {ep} at a time, and stage {stage} has {has}"),
                at,
                "expert-parallel groups",
            )
            .with_label(f.key_span("stages").or(f.key_span("dp")).unwrap_or(at), "this layout")
            .with_help(if cp > 1 {
                // the fewest replicas whose cp-fold members ep divides
                let need = (1..=ep).find(|n| (n * cp).is_multiple_of(ep)).unwrap_or(ep);
                format!("make every stage's replicas times {cp} a multiple of {ep} (`dp: {need}` or a multiple of it), or lower `ep`")
            } else {
                format!("make every stage's replicas a multiple of {ep} (`dp: {ep}` or more), or lower `ep`")
            }),
        );
        ok = false;
    }
    // a schedule whose replicas run their passes at different times (Chimera's and
    // DualPipe's two copies of a stage group by direction: `ChunkPlacement::expert_group`)
    let asynchronous = schedule.is_some_and(|s| {
        s.sync == pipec_plan::vocab::SyncMode::Asp
            || s.kind.updates(members.map_or(1, <[usize]>::len)) != pipec_plan::schedule::Updates::PerStep
    });
    if asynchronous {
        cx.push(
            Diagnostic::error(
                "E0419",
                format!("`ep: {ep}` cannot be combined with this schedule: its replicas run their passes at different times, and an expert group's members exchange tokens inside every pass"),
                at,
                "expert parallelism",
            )
            .with_help("use a synchronous schedule, or remove `ep`"),
        );
        ok = false;
    }
    ok
}

/// A schedule's name in `search.schedules`.
fn schedule_name(cx: &mut Lower<'_>, node: &Node) -> Option<ScheduleKind> {
    let text = match &node.value {
        Value::Str(s) => s.as_str(),
        _ => {
            cx.wrong_type(node, "a schedule name");
            return None;
        }
    };
    if let Some(k) = <ScheduleKind as Choice>::from_name(text) {
        return Some(k);
    }
    let names: Vec<&str> = <ScheduleKind as Choice>::ALL.iter().map(|k| k.name()).collect();
    let mut d = Diagnostic::error(
        "E0105",
        format!("`{text}` is not a schedule"),
        node.span,
        format!("expected one of {}", names.join(", ")),
    );
    if let Some(s) = crate::diagnostic::did_you_mean(text, names.iter().copied()) {
        d = d.with_help(format!("did you mean `{s}`?")).with_fix(format!("replace with `{s}`"), node.span, s);
    }
    cx.push(d);
    None
}

/// `10%` (or a fraction below 1, `0.1`) as a fraction.
fn headroom(node: &Node) -> Option<f64> {
    let v = match &node.value {
        Value::Str(s) => s.strip_suffix('%')?.trim().parse::<f64>().ok()? / 100.0,
        Value::Int(i) => *i as f64,
        Value::Float(x) => *x,
        _ => return None,
    };
    (0.0..1.0).contains(&v).then_some(v)
}

/// The layout as written: PipeDream notation, dp/pp degrees, or nothing (one stage per
/// device, or one replicated stage for `dp-only`).
enum WrittenLayout {
    Replicas(Vec<usize>, Vec<Span>),
    Straight,
    DpOnly,
}

/// The layout with the cluster's device count filled in: replicas per stage, the span of
/// each stage's number (or of the whole layout), and whether the user wrote it.
struct Layout {
    replicas: Vec<usize>,
    replica_spans: Vec<Span>,
    span: Span,
    fixed: bool,
}

/// Reads `stages` or `dp`/`pp` (not both).
fn lower_layout(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    owner: Span,
    schedule: Option<ScheduleKind>,
) -> Option<(WrittenLayout, Span, bool)> {
    let stages_node = f.get("stages");
    let dp_node = f.get("dp");
    let pp_node = f.get("pp");
    if let (Some(s), Some(other)) = (stages_node, dp_node.or(pp_node)) {
        let key = if dp_node.is_some() { "dp" } else { "pp" };
        cx.push(
            Diagnostic::error(
                "E0410",
                format!("`stages` and `{key}` both give the layout"),
                f.key_span(key).unwrap_or(other.span),
                "second layout",
            )
            .with_label(s.span, "first layout")
            .with_help("keep one: `stages: \"2-2\"` is the same as `dp: 2, pp: 2`"),
        );
        return None;
    }
    let fixed = stages_node.is_some() || dp_node.is_some() || pp_node.is_some();
    if let Some(s) = stages_node {
        return lower_stages_notation(cx, s).map(|l| (l, s.span, fixed));
    }
    if dp_node.is_some() || pp_node.is_some() {
        let span = dp_node.or(pp_node).map_or(owner, |n| n.span);
        let degree = |cx: &mut Lower<'_>, n: Option<&Node>| match n {
            None => Some(1),
            Some(n) => cx.uint(n, 1),
        };
        let (dp, pp) = (degree(cx, dp_node), degree(cx, pp_node));
        return Some((WrittenLayout::Replicas(vec![dp?; pp?], vec![span; pp?]), span, fixed));
    }
    let layout = if schedule == Some(ScheduleKind::DpOnly) { WrittenLayout::DpOnly } else { WrittenLayout::Straight };
    Some((layout, owner, fixed))
}

/// `stages: "2-1-1"` or `stages: straight`.
fn lower_stages_notation(cx: &mut Lower<'_>, s: &Node) -> Option<WrittenLayout> {
    match &s.value {
        Value::Int(i) => {
            cx.push(
                Diagnostic::error("E0401", format!("`stages: {i}` is a number; PipeDream notation is a string"), s.span, "quote this")
                    .with_help(format!("`\"{i}\"` means one stage replicated on {i} workers; for {i} unreplicated stages write `straight` or `{}`", vec!["1"; (*i).clamp(1, 16) as usize].join("-")))
                    .with_fix("quote the notation", s.span, format!("\"{i}\"")),
            );
            None
        }
        Value::Str(text) => match dsl::parse_stages(text) {
            Ok(StagesNotation::Straight) => Some(WrittenLayout::Straight),
            Ok(StagesNotation::Replicas(parts)) => {
                let mut ok = true;
                for (n, r) in &parts {
                    if *n == 0 || *n > 1_000_000 {
                        let span = cx.dsl_span(s, *r);
                        cx.push(Diagnostic::error(
                            "E0401",
                            format!("a stage needs at least one worker, found {n}"),
                            span,
                            "must be ≥ 1",
                        ));
                        ok = false;
                    }
                }
                ok.then(|| {
                    WrittenLayout::Replicas(
                        parts.iter().map(|p| p.0 as usize).collect(),
                        parts.iter().map(|p| cx.dsl_span(s, p.1)).collect(),
                    )
                })
            }
            Err(e) => {
                cx.dsl_error("E0401", s, &e, "strategy syntax error");
                None
            }
        },
        _ => {
            cx.wrong_type(s, "PipeDream notation like \"2-1-1\" or `straight`");
            None
        }
    }
}

/// Resolves `straight` and dp-only against the cluster's device count.
fn resolve_layout(
    cx: &mut Lower<'_>,
    f: &Fields<'_>,
    owner: Span,
    (written, span, fixed): (WrittenLayout, Span, bool),
    cluster: Option<&Cluster>,
    tp: usize,
) -> Option<Layout> {
    let (replicas, replica_spans) = match written {
        WrittenLayout::Replicas(r, spans) => (r, spans),
        WrittenLayout::Straight | WrittenLayout::DpOnly => {
            let devices = cluster.map(Cluster::device_count)?;
            if devices % tp != 0 {
                cx.push(
                    Diagnostic::error(
                        "E0402",
                        format!("tp = {tp} does not divide the cluster's {devices} devices"),
                        f.key_span("tp").unwrap_or(owner),
                        "tensor-parallel degree",
                    )
                    .with_help("choose a tp that divides nodes × devices_per_node"),
                );
                return None;
            }
            let n = devices / tp;
            if matches!(written, WrittenLayout::DpOnly) {
                (vec![n], vec![span])
            } else {
                (vec![1; n], vec![span; n])
            }
        }
    };
    Some(Layout { replicas, replica_spans, span, fixed })
}

/// Strategy vs cluster: the layout uses every device (E0402); false when it does not.
fn check_device_count(cx: &mut Lower<'_>, layout: &Layout, tp: usize, cp: usize, cluster: Option<&Cluster>) -> bool {
    let Some(c) = cluster else { return true };
    let devices = c.device_count();
    let replicas = &layout.replicas;
    let needed = replicas.iter().sum::<usize>() * tp * cp;
    if needed == devices || !(layout.fixed || tp * cp > 1) {
        return true;
    }
    let notation = replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-");
    let sum = replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("+");
    let factors: String =
        [("tp", tp), ("cp", cp)].iter().filter(|(_, n)| *n > 1).map(|(k, n)| format!(" × {k} {n}")).collect();
    let needs = if factors.is_empty() { format!("{sum} = {needed}") } else { format!("({sum}){factors} = {needed}") };
    let mut d = Diagnostic::error(
        "E0402",
        format!("the strategy `{notation}` needs {needed} devices, but the cluster has {devices}"),
        layout.span,
        format!("needs {needs} devices"),
    )
    .with_label(c.devices_span, format!("{} node(s) × {} device(s) = {devices}", c.nodes, c.devices_per_node))
    .with_help(if needed < devices {
        format!("use all {devices} devices (e.g. `stages: straight`), or shrink the cluster")
    } else {
        format!("the cluster needs {needed} devices: raise `devices_per_node`/`nodes`, or use fewer stages or replicas")
    });
    // the cluster resized to the strategy, when the nodes divide it
    if needed.is_multiple_of(c.nodes.max(1)) && needed / c.nodes.max(1) >= 1 {
        let per_node = needed / c.nodes.max(1);
        d = d.with_fix(
            format!("use {per_node} device{} per node", if per_node == 1 { "" } else { "s" }),
            c.devices_span,
            per_node.to_string(),
        );
    }
    cx.push(d);
    false
}

/// Size: the streams hold about 8 instructions per (stage chunk, microbatch); `None` (with
/// E0105) past what pipec plans.
fn check_size(cx: &mut Lower<'_>, stages: usize, schedule: &Schedule, microbatches: usize, span: Span) -> Option<()> {
    let chunks = stages.saturating_mul(schedule.virtual_stages.max(1));
    if chunks.saturating_mul(microbatches) <= MAX_STAGE_MICROBATCHES {
        return Some(());
    }
    cx.push(
        Diagnostic::error(
            "E0105",
            format!("{chunks} stage(s) × {microbatches} microbatches = {} forward passes per step is more than pipec plans ({} at most)", chunks.saturating_mul(microbatches), MAX_STAGE_MICROBATCHES),
            span,
            "too many microbatches",
        )
        .with_help("use fewer microbatches: beyond a few times the pipeline depth they no longer shrink the bubble"),
    );
    None
}

/// The microbatch count as written: its value and span (`None`: not written, 1 assumed).
#[derive(Clone, Copy)]
struct MicrobatchesWritten {
    count: usize,
    span: Option<Span>,
    owner: Span,
}

/// Schedule vs layout (E0405), stages vs layers (E0403, not for a layout PipeDream's
/// planner picks: `planned`), microbatches vs batch size and replication (E0404); every
/// microbatch diagnostic offers the nearest count that meets all of them. False when any
/// fails.
fn check_schedule_and_microbatches(
    cx: &mut Lower<'_>,
    layout: &Layout,
    planned: bool,
    schedule: &Schedule,
    mb: MicrobatchesWritten,
    model: Option<&Model>,
    training: Option<&Training>,
) -> bool {
    let replicas = &layout.replicas;
    let microbatches = mb.count;
    let mut ok = true;
    let mb_fix: Option<(Span, usize)> = mb.span.and_then(|span| {
        let fits =
            |n: usize| n != microbatches && schedule.kind.accepts_microbatches(replicas, n, schedule.vertical_sync);
        nearest_microbatches(microbatches, training.map(|t| t.batch_size), fits).map(|n| (span, n))
    });
    let with_mb_fix = |d: Diagnostic| match mb_fix {
        Some((span, n)) => {
            d.with_fix(format!("use {n} microbatch{}", if n == 1 { "" } else { "es" }), span, n.to_string())
        }
        None => d,
    };

    // the schedule's first broken constraint (pipec_plan::schedule)
    let facts = LayoutFacts { replicas, microbatches, vertical_sync: schedule.vertical_sync };
    if let Some(broken) = schedule.kind.check_layout(&facts).into_iter().next() {
        let d = Diagnostic::error("E0405", broken.message, schedule.span, broken.label).with_help(broken.help);
        cx.push(if broken.about_microbatches { with_mb_fix(d) } else { d });
        ok = false;
    }

    let (stages, v) = (replicas.len(), schedule.virtual_stages);
    if let Some(m) = model.filter(|_| !planned) {
        let chunks = stages * v;
        if chunks > m.layers.len() {
            let what = if v > 1 {
                format!("{stages} stages × {v} virtual stages = {chunks} chunks")
            } else {
                format!("{stages} stages")
            };
            cx.push(
                Diagnostic::error(
                    "E0403",
                    format!("{what} but the model has only {} layer(s)", m.layers.len()),
                    layout.span,
                    format!("{chunks} model chunks"),
                )
                .with_label(m.layers_span, format!("{} layer(s)", m.layers.len()))
                .with_help("use fewer stages, or a deeper model"),
            );
            ok = false;
        }
    }

    let Some(t) = training else { return ok };
    let mb_span = mb.span.unwrap_or(mb.owner);
    // every help names the counts that meet all the constraints at once
    let choices = microbatch_choices(t.batch_size, schedule, replicas);
    if t.batch_size % microbatches != 0 {
        cx.push(with_mb_fix(batch_indivisible(t, microbatches, mb_span, &choices)));
        ok = false;
    }
    if let Some((s, &r)) = replicas.iter().enumerate().find(|(_, &r)| r > 1 && !microbatches.is_multiple_of(r)) {
        let span = layout.replica_spans.get(s).copied().unwrap_or(layout.span);
        cx.push(with_mb_fix(
            Diagnostic::error(
                "E0404",
                format!("stage {s} has {r} replicas, which cannot share {microbatches} microbatches evenly"),
                mb_span,
                format!("{microbatches} microbatches"),
            )
            .with_label(span, format!("{r} replicas"))
            .with_help(format!("microbatches are routed round-robin to replicas, so a multiple of {r}; {choices}")),
        ));
        ok = false;
    }
    ok
}

/// The microbatch counts that meet every constraint at once — divide the batch, are shared
/// evenly by every stage's replicas, and suit the schedule on this layout (Chimera's pairs,
/// an interleaved schedule's rounds) — as a help's sentence.
fn microbatch_choices(batch: usize, schedule: &Schedule, replicas: &[usize]) -> String {
    let accepted = |n: usize| schedule.kind.accepts_microbatches(replicas, n, schedule.vertical_sync);
    let what = format!(
        "counts that divide the batch of {batch}{} and that `{}` accepts on this layout",
        if replicas.iter().any(|&r| r > 1) { ", are shared evenly by every stage's replicas" } else { "" },
        schedule.kind.name()
    );
    match divisors(batch) {
        Some(all) => {
            let fitting: Vec<String> = all.into_iter().filter(|&n| accepted(n)).map(|n| n.to_string()).collect();
            match fitting.len() {
                0 => format!("no count meets every constraint ({what}): change the batch size or the layout"),
                n if n > 10 => format!("use one of the {what}: {}, ...", fitting[..10].join(", ")),
                _ => format!("use one of the {what}: {}", fitting.join(", ")),
            }
        }
        None => format!("use one of the {what}"),
    }
}

/// E0404: the batch does not split into `microbatches`; `help` says which counts do.
fn batch_indivisible(t: &Training, microbatches: usize, mb_span: Span, help: &str) -> Diagnostic {
    Diagnostic::error(
        "E0404",
        format!("batch size {} is not divisible into {microbatches} microbatches", t.batch_size),
        mb_span,
        format!("{microbatches} microbatches"),
    )
    .with_label(t.batch_span, format!("batch size {}", t.batch_size))
    .with_help(help.to_string())
}

/// `partition: auto | balanced | [ranges per stage chunk]`.
fn lower_partition(cx: &mut Lower<'_>, node: Option<&Node>, model: Option<&Model>, chunks: usize) -> Option<Partition> {
    let Some(n) = node else { return Some(Partition::Balanced) };
    match &n.value {
        Value::Str(s) if s == "auto" => Some(Partition::Auto),
        Value::Str(s) if s == "balanced" => Some(Partition::Balanced),
        Value::Str(_) => {
            cx.choice(n, &["strategy", "partition"]);
            None
        }
        Value::Seq(entries) => model.and_then(|m| lower_explicit_partition(cx, n, entries, m, chunks)),
        _ => {
            cx.wrong_type(n, "`auto`, `balanced` or a list of layer ranges per stage");
            None
        }
    }
}

/// The divisors of `n`, ascending, found in pairs up to its square root; `None` past a
/// bounded amount of work (a batch size near 2^64 must not stall the checker).
fn divisors(n: usize) -> Option<Vec<usize>> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1usize;
    while d.checked_mul(d).is_some_and(|sq| sq <= n) {
        if d > SEARCH_BUDGET {
            return None;
        }
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    Some(small)
}

fn divisors_hint(n: usize) -> String {
    match divisors(n) {
        Some(d) if d.len() > 10 => {
            format!("{}, ...", d.iter().take(10).map(ToString::to_string).collect::<Vec<_>>().join(", "))
        }
        Some(d) => d.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
        None => "1, ...".into(),
    }
}

fn lower_schedule(cx: &mut Lower<'_>, node: &Node, owner: Span) -> Option<Schedule> {
    let (kind, f) = match &node.value {
        Value::Map(_) => {
            let f = cx.fields(node, &["strategy", "schedule"], owner)?;
            let k = cx
                .required(&f, "kind", "strategy.schedule")
                .and_then(|k| cx.choose::<ScheduleKind>(k, &["strategy", "schedule", "kind"]))?;
            (k, Some(f))
        }
        _ => (cx.choose::<ScheduleKind>(node, &["strategy", "schedule"])?, None),
    };
    let mut sched = Schedule::new(kind, node.span);
    let Some(f) = f else { return Some(sched) };
    let mut ok = true;
    let not_for = |cx: &mut Lower<'_>, key: &str, only: &str| {
        if let Some(span) = f.key_span(key) {
            cx.push(
                Diagnostic::error(
                    "E0405",
                    format!("`{key}` is an option of {only}, not of `{}`", kind.name()),
                    span,
                    format!("not an option of `{}`", kind.name()),
                )
                .with_help("remove it"),
            );
        }
    };
    if let Some(n) = f.get("virtual_stages") {
        match kind {
            ScheduleKind::Interleaved => match cx.uint(n, 2) {
                Some(v) => sched.virtual_stages = v,
                None => ok = false,
            },
            ScheduleKind::Zbv | ScheduleKind::DualPipeV => {
                if cx.uint(n, 2) != Some(2) {
                    cx.push(Diagnostic::error(
                        "E0405",
                        format!("`{kind}` always has 2 virtual stages per device"),
                        n.span,
                        "must be 2",
                    ));
                    ok = false;
                }
            }
            _ => {
                not_for(cx, "virtual_stages", "`interleaved`");
                ok = false;
            }
        }
    }
    if let Some(n) = f.get("vertical_sync") {
        if kind == ScheduleKind::PipeDream {
            match cx.boolean(n) {
                Some(b) => sched.vertical_sync = b,
                None => ok = false,
            }
        } else {
            not_for(cx, "vertical_sync", "`pipedream`");
            ok = false;
        }
    }
    for key in ["sync", "reduce", "staleness"] {
        if kind != ScheduleKind::DpOnly && f.get(key).is_some() {
            not_for(cx, key, "`dp-only`");
            ok = false;
        }
    }
    if kind == ScheduleKind::DpOnly {
        if let Some(n) = f.get("sync") {
            match cx.choose::<SyncMode>(n, &["strategy", "schedule", "sync"]) {
                Some(sync) => sched.sync = sync,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("reduce") {
            match cx.choose::<ReduceMode>(n, &["strategy", "schedule", "reduce"]) {
                Some(reduce) => sched.reduce = reduce,
                None => ok = false,
            }
        }
        if let Some(n) = f.get("staleness") {
            if sched.sync != SyncMode::Asp {
                cx.push(Diagnostic::error(
                    "E0405",
                    "`staleness` applies to asynchronous data parallelism (`sync: asp`)",
                    f.key_span("staleness").unwrap_or(n.span),
                    "only with `sync: asp`",
                ));
                ok = false;
            } else {
                match cx.uint(n, 0) {
                    Some(s) => sched.staleness = s,
                    None => ok = false,
                }
            }
        } else if sched.sync == SyncMode::Asp {
            sched.staleness = 1;
        }
    }
    ok.then_some(sched)
}

/// One resolved range with the span it was written at.
struct StageRange {
    start: usize,
    end: usize,
    span: Span,
}

fn lower_explicit_partition(
    cx: &mut Lower<'_>,
    node: &Node,
    entries: &[Node],
    model: &Model,
    chunks: usize,
) -> Option<Partition> {
    let n_layers = model.layers.len();
    if entries.len() != chunks {
        cx.push(
            Diagnostic::error(
                "E0409",
                format!("the partition has {} stage(s), the strategy has {chunks}", entries.len()),
                node.span,
                format!("{} entries", entries.len()),
            )
            .with_help(format!(
                "give one entry per stage{}",
                if chunks > 0 { format!(" ({chunks} in all)") } else { String::new() }
            )),
        );
        return None;
    }
    // a layer's label is that layer; a labelled block call is the layers it expanded into
    let label_range = |name: &str| {
        model
            .layers
            .iter()
            .position(|l| l.label.as_deref() == Some(name))
            .map(|i| (i, i))
            .or_else(|| model.groups.iter().find(|g| g.label == name).map(|g| (g.first, g.last)))
    };
    let mut stages: Vec<Option<StageRange>> = Vec::new();
    let mut ok = true;
    for entry in entries {
        let items: Vec<&Node> = match &entry.value {
            Value::Seq(items) => items.iter().collect(),
            _ => vec![entry],
        };
        let mut ranges: Vec<StageRange> = Vec::new();
        for item in items {
            let text = match &item.value {
                Value::Str(s) => s.clone(),
                Value::Int(i) => i.to_string(),
                _ => {
                    cx.wrong_type(item, "a layer range like \"0..4\"");
                    ok = false;
                    continue;
                }
            };
            let r = match dsl::parse_range(&text) {
                Ok(r) => r,
                Err(e) => {
                    cx.dsl_error("E0408", item, &e, "partition range syntax error");
                    ok = false;
                    continue;
                }
            };
            let resolve = |cx: &mut Lower<'_>, (lr, rel): &(LayerRef, (usize, usize))| -> Option<(usize, usize)> {
                let span = cx.dsl_span(item, *rel);
                match lr {
                    LayerRef::Index(i) if (*i as usize) <= n_layers => Some((*i as usize, *i as usize)),
                    LayerRef::Index(i) => {
                        cx.push(
                            Diagnostic::error(
                                "E0408",
                                format!("layer {i} does not exist: the model has {n_layers} layers (0..{n_layers})"),
                                span,
                                "past the last layer",
                            )
                            .with_label(model.layers_span, format!("{n_layers} layers")),
                        );
                        None
                    }
                    LayerRef::Name(name) => match label_range(name) {
                        Some(r) => Some(r),
                        None => {
                            let labels = model
                                .layers
                                .iter()
                                .filter_map(|l| l.label.as_deref())
                                .chain(model.groups.iter().map(|g| g.label.as_str()));
                            let mut d = Diagnostic::error(
                                "E0408",
                                format!("no layer is labelled `{name}`"),
                                span,
                                "unknown label",
                            );
                            if let Some(s) = crate::diagnostic::did_you_mean(name, labels) {
                                d = d.with_help(format!("did you mean `{s}`?")).with_fix(
                                    format!("replace with `{s}`"),
                                    span,
                                    s,
                                );
                            } else {
                                d = d.with_help("label a layer with `as NAME`, e.g. `linear(1024, 10) as head`");
                            }
                            cx.push(d);
                            None
                        }
                    },
                }
            };
            let first = resolve(cx, &r.start);
            let start = first.map(|f| f.0);
            let end = match &r.end {
                None => first.map(|f| f.1 + 1),
                Some((None, _)) => Some(n_layers),
                Some((Some(e), inclusive)) => resolve(cx, e).map(|e| if *inclusive { e.1 + 1 } else { e.0 }),
            };
            match (start, end) {
                (Some(s), Some(e)) if s < e && e <= n_layers => {
                    ranges.push(StageRange { start: s, end: e, span: item.span })
                }
                (Some(s), Some(e)) => {
                    let why = if s >= n_layers {
                        format!("layer {s} does not exist (the model has {n_layers} layers)")
                    } else {
                        format!("the range {s}..{e} is empty")
                    };
                    cx.push(Diagnostic::error("E0408", why, item.span, "empty or out of range"));
                    ok = false;
                }
                _ => ok = false,
            }
        }
        // A stage's ranges must join into one contiguous range.
        ranges.sort_by_key(|r| r.start);
        let mut merged: Option<StageRange> = None;
        for r in ranges {
            merged = match merged {
                None => Some(r),
                Some(m) if r.start == m.end => Some(StageRange { start: m.start, end: r.end, span: m.span }),
                Some(m) if r.start < m.end => {
                    cx.push(
                        Diagnostic::error(
                            "E0406",
                            format!("layers {}..{} are listed twice in one stage", r.start, m.end.min(r.end)),
                            r.span,
                            "overlaps",
                        )
                        .with_label(m.span, "with this range"),
                    );
                    ok = false;
                    Some(m)
                }
                Some(m) => {
                    cx.push(
                        Diagnostic::error(
                            "E0407",
                            format!(
                                "a stage must hold contiguous layers; layers {}..{} are missing between its ranges",
                                m.end, r.start
                            ),
                            r.span,
                            "not contiguous",
                        )
                        .with_label(m.span, "previous range"),
                    );
                    ok = false;
                    Some(m)
                }
            };
        }
        if merged.is_none() && ok {
            cx.push(Diagnostic::error("E0408", "a stage has no layers", entry.span, "empty stage"));
            ok = false;
        }
        stages.push(merged);
    }
    if !ok {
        return None;
    }
    let stages: Vec<StageRange> = stages.into_iter().flatten().collect();
    let mut expected = 0usize;
    for (i, s) in stages.iter().enumerate() {
        if s.start < expected {
            let prev = &stages[i - 1];
            cx.push(
                Diagnostic::error(
                    "E0406",
                    format!(
                        "stage {i} starts at layer {} but stage {} already holds layers up to {}",
                        s.start,
                        i - 1,
                        expected - 1
                    ),
                    s.span,
                    format!("stage {i}"),
                )
                .with_label(prev.span, format!("stage {}", i - 1))
                .with_help(format!("start stage {i} at layer {expected}")),
            );
            ok = false;
        } else if s.start > expected {
            let gap_span = model.layers[expected].span;
            cx.push(
                Diagnostic::error(
                    "E0407",
                    format!("layers {expected}..{} belong to no stage", s.start),
                    s.span,
                    format!("stage {i} starts at layer {}", s.start),
                )
                .with_label(gap_span, format!("layer {expected} is in no stage"))
                .with_help(format!("start stage {i} at layer {expected}, or extend the stage before it")),
            );
            ok = false;
        }
        expected = expected.max(s.end);
    }
    if ok && expected < n_layers {
        let last = stages.last().map(|s| s.span).unwrap_or(node.span);
        cx.push(
            Diagnostic::error(
                "E0407",
                format!("layers {expected}..{n_layers} belong to no stage"),
                last,
                "the last stage ends here",
            )
            .with_label(model.layers[expected].span, format!("layer {expected} is in no stage"))
            .with_help(format!(
                "end the last stage with an open range, e.g. \"{}..\"",
                stages.last().map(|s| s.start).unwrap_or(0)
            )),
        );
        ok = false;
    }
    ok.then(|| Partition::Explicit(stages.iter().map(|s| s.start..s.end).collect()))
}

/// Why a recompute module finds nothing to recompute in `model` (W0426), if it does not.
fn module_applies_to_nothing(module: RecomputeModule, model: &Model) -> Option<&'static str> {
    let blocks: Vec<pipec_plan::model::BlockDims> = model.layers.iter().filter_map(|l| l.op.block_dims()).collect();
    let any = |rule: fn(&pipec_plan::model::BlockDims) -> bool| blocks.iter().any(rule);
    match module {
        RecomputeModule::CoreAttn | RecomputeModule::Layernorm => {
            (blocks.is_empty()).then_some("it has no transformer block")
        }
        RecomputeModule::Mlp => (!any(|b| b.moe.is_none())).then_some("every block's MLP is a mixture of experts"),
        RecomputeModule::MoeAct | RecomputeModule::Moe => {
            (!any(|b| b.moe.is_some())).then_some("no block is a mixture of experts")
        }
        RecomputeModule::SharedExperts => {
            (!any(|b| b.moe.is_some_and(|m| m.shared > 0))).then_some("no block has shared experts")
        }
        RecomputeModule::MlaUpProj => (!any(|b| b.mla.is_some())).then_some("no block has multi-head latent attention"),
    }
}
