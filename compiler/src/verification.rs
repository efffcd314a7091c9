//! The verification pass: the lowered streams through the static verifier (a flush-free
//! pipeline's unrolled over several steps), and the same checks on a plan read from a file.

use std::collections::{BTreeMap, HashMap};

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::{DeviceId, GroupId, Instr, StageId};

use crate::schedule::Placement;
use crate::streams::Lowered;
use crate::verify::{verify, VerifyInput};

/// Verification: a failure is a compiler bug, reported as E0603.
pub(crate) fn verify_lowered(spec: &Spec, placement: &Placement, lowered: &Lowered) -> Result<(), Vec<Diagnostic>> {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let groups = lowered.members();
    let expert_groups = lowered.expert_group_stages();
    let violations: Vec<String> = match &lowered.periodic {
        Some(p) => crate::periodic::verify_periodic(
            p,
            placement,
            &groups,
            lowered.updates.every(lowered.asp),
            &lowered.recompute,
        ),
        None => verify(&VerifyInput {
            streams: &lowered.streams,
            placement,
            groups: &groups,
            recompute: &lowered.recompute,
            update_every: lowered.updates.every(lowered.asp),
            asp_staleness: lowered.asp.then_some(strategy.schedule.staleness),
            tp: strategy.tp.max(1),
            sharding: strategy.sharding,
            clipping: spec.training.recipe.sums_norm(
                spec.training.precision,
                lowered.updates == pipec_plan::schedule::Updates::PerStep && !lowered.asp,
                lowered.streams.values().filter(|s| !s.is_empty()).count(),
            ),
            forward_only: false,
            expert_parallel: &lowered.expert_parallel,
            all_to_alls: &lowered.all_to_alls,
            expert_groups: &expert_groups,
            chunks: kind.chunk_placement(),
            context_parallel: strategy.cp.max(1),
            in_pass: Some(&lowered.in_pass),
        })
        .into_iter()
        .map(|v| v.message)
        .collect(),
    };
    let violations: Vec<String> = violations
        .into_iter()
        .chain(
            lowered
                .eval
                .iter()
                .flat_map(|eval| {
                    let experts = Experts {
                        groups: &groups,
                        expert_parallel: &lowered.expert_parallel,
                        all_to_alls: &lowered.all_to_alls,
                        expert_groups: &expert_groups,
                        chunks: kind.chunk_placement(),
                    };
                    verify_eval(eval, placement, strategy.tp.max(1), strategy.cp.max(1), &experts)
                })
                .map(|v| format!("validation: {v}")),
        )
        .collect();
    if violations.is_empty() {
        return Ok(());
    }
    let mut text = String::new();
    for v in violations.iter().take(8) {
        text.push_str(&format!("\n- {v}"));
    }
    Err(vec![Diagnostic::error(
        "E0603",
        format!(
            "internal compiler error: the {} plan failed verification ({} problem(s)):{text}",
            kind.name(),
            violations.len()
        ),
        strategy.schedule.span,
        "while compiling this schedule",
    )
    .with_help("this is a bug in pipec, not in the spec; please report it with the spec")])
}

/// What validation's streams need of expert parallelism: its groups and all-to-alls.
struct Experts<'a> {
    groups: &'a HashMap<GroupId, Vec<DeviceId>>,
    expert_parallel: &'a [usize],
    all_to_alls: &'a [Vec<pipec_plan::ExpertExchange>],
    expert_groups: &'a BTreeMap<GroupId, StageId>,
    chunks: pipec_plan::schedule::ChunkPlacement,
}

/// Per stage of a plan: its expert-parallel degree, its all-to-alls; and its expert groups.
type PlanExperts = (Vec<usize>, Vec<Vec<pipec_plan::ExpertExchange>>, BTreeMap<GroupId, StageId>);

fn plan_experts(plan: &pipec_plan::Plan) -> PlanExperts {
    (
        plan.stages.iter().map(|s| s.expert_parallel as usize).collect(),
        plan.stages.iter().map(|s| s.all_to_alls.clone()).collect(),
        plan.groups.iter().filter(|g| g.experts).map(|g| (g.id, g.stage)).collect(),
    )
}

/// Every group of a plan with its members.
fn group_members(plan: &pipec_plan::Plan) -> HashMap<GroupId, Vec<DeviceId>> {
    plan.groups.iter().map(|g| (g.id, g.devices.clone())).collect()
}

/// Validation's forward-only streams through the verifier: each forward once on its routed
/// device (with the all-to-alls it posts), data flow, messages, and no deadlock.
fn verify_eval(
    streams: &BTreeMap<DeviceId, Vec<Instr>>,
    placement: &Placement,
    tp: usize,
    cp: usize,
    experts: &Experts<'_>,
) -> Vec<String> {
    let none = vec![false; placement.stages()];
    verify(&VerifyInput {
        streams,
        placement,
        groups: experts.groups,
        recompute: &none,
        update_every: None,
        asp_staleness: None,
        tp,
        sharding: pipec_plan::vocab::Sharding::None,
        clipping: false,
        forward_only: true,
        expert_parallel: experts.expert_parallel,
        all_to_alls: experts.all_to_alls,
        expert_groups: experts.expert_groups,
        chunks: experts.chunks,
        context_parallel: cp,
        in_pass: None,
    })
    .into_iter()
    .map(|v| v.message)
    .collect()
}

/// Checks a plan read from a file: its structure ([`pipec_plan::Plan::check`]), then its
/// streams with the same verifier every compile runs (exactly-once compute, data flow,
/// point-to-point and collective order, deadlock freedom). Empty when the plan is sound.
pub fn verify_plan(plan: &pipec_plan::Plan) -> Vec<String> {
    let problems = plan.check();
    if !problems.is_empty() {
        return problems;
    }
    match &plan.flush_free {
        // a flush-free pipeline: the streams of 1, 2 and 3 steps, unrolled
        Some(f) => {
            let placement = placement_of(plan);
            let groups = group_members(plan);
            let p = crate::periodic::Periodic {
                body: plan.streams.clone(),
                segments: f.clone(),
                microbatches: plan.training.microbatches,
            };
            let ranks = plan.stages.len() / plan.schedule.virtual_stages.max(1);
            crate::periodic::verify_periodic(
                &p,
                &placement,
                &groups,
                plan.schedule.kind.updates(ranks).every(false),
                &recomputed_stages(plan),
            )
        }
        None => verify_streams(plan, &plan.streams),
    }
    .into_iter()
    .chain(plan.eval.iter().flat_map(|eval| {
        let tp = plan.stages.first().and_then(|s| s.tensor_parallel.first()).map_or(1, Vec::len);
        let groups = group_members(plan);
        let (expert_parallel, all_to_alls, expert_groups) = plan_experts(plan);
        let chunks = plan.schedule.kind.chunk_placement();
        let experts = Experts {
            groups: &groups,
            expert_parallel: &expert_parallel,
            all_to_alls: &all_to_alls,
            expert_groups: &expert_groups,
            chunks,
        };
        verify_eval(eval, &placement_of(plan), tp, plan.training.context_parallel.max(1), &experts)
            .into_iter()
            .map(|v| format!("validation: {v}"))
    }))
    .collect()
}

/// Per stage of a plan: whether it recomputes its activations.
fn recomputed_stages(plan: &pipec_plan::Plan) -> Vec<bool> {
    plan.stages.iter().map(|s| s.recompute).collect()
}

/// The placement a plan's stages describe.
fn placement_of(plan: &pipec_plan::Plan) -> Placement {
    Placement {
        replicas: plan.stages.iter().map(|s| s.replicas.clone()).collect(),
        route: plan.stages.iter().map(|s| s.route.clone()).collect(),
        devices: plan.devices.len(),
        microbatches: plan.training.microbatches,
    }
}

/// Verifies `streams` as the streams of `plan` (whose other fields are assumed sound).
pub fn verify_streams(plan: &pipec_plan::Plan, streams: &BTreeMap<DeviceId, Vec<Instr>>) -> Vec<String> {
    let placement = placement_of(plan);
    let (expert_parallel, all_to_alls, expert_groups) = plan_experts(plan);
    let groups = group_members(plan);
    let kind = plan.schedule.kind;
    let ranks = plan.stages.len() / plan.schedule.virtual_stages.max(1);
    let input = VerifyInput {
        streams,
        placement: &placement,
        groups: &groups,
        recompute: &recomputed_stages(plan),
        update_every: kind.updates(ranks).every(plan.schedule.staleness.is_some()),
        asp_staleness: plan.schedule.staleness,
        tp: plan.stages.first().and_then(|s| s.tensor_parallel.first()).map_or(1, Vec::len),
        sharding: plan.schedule.sharding,
        clipping: plan.training.recipe.sums_norm(
            plan.training.precision,
            plan.schedule.updates_every_step(),
            streams.values().filter(|s| !s.is_empty()).count(),
        ),
        forward_only: false,
        expert_parallel: &expert_parallel,
        all_to_alls: &all_to_alls,
        expert_groups: &expert_groups,
        chunks: kind.chunk_placement(),
        context_parallel: plan.training.context_parallel.max(1),
        in_pass: Some(&plan.in_pass),
    };
    verify(&input).into_iter().map(|v| v.message).collect()
}
