//! What the strategy search needs of a candidate: the figures `compile` would report,
//! without the verifier and the plan, from one pipeline replica of a symmetric plan.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::DeviceId;

use crate::bound::Memo;
use crate::figures::stage_figures;
use crate::fit::check_memory;
use crate::options::CompileOptions;
use crate::place::{one_replica, place};
use crate::simulation::simulate_plan;
use crate::streams::{check_ties, clip_norm_all_reduces, lower_streams, tensor_parallel_copies};

/// What the strategy search needs of a candidate: the figures of its compiled plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Figures {
    /// The simulated step (a flush-free schedule's steady state).
    pub step_s: f64,
    /// Idle share of the cluster's device-time.
    pub bubble: f64,
    /// The tightest memory headroom over the devices (negative: it does not fit).
    pub headroom: f64,
    /// The longest exposed all-reduce per step on any device.
    pub exposed_all_reduce_s: f64,
    /// No device is over its memory.
    pub fits: bool,
    /// Per stage: the tightest memory headroom of the devices holding it (what the search
    /// recomputes when a plan does not fit).
    pub stage_headroom: Vec<f64>,
    /// The memory of every device simulated (one replica's for a symmetric plan).
    pub memory: Vec<(DeviceId, pipec_plan::plan::MemoryBreakdown)>,
    /// What the memory check says (E0601, W0602; W0605 when it was simulated).
    pub diagnostics: Vec<Diagnostic>,
}

/// The figures `compile` would report for a checked spec, without the verifier and without
/// building the plan; for a symmetric plan from one pipeline replica (`one_replica`) —
/// exactly the whole plan's figures (tested against `compile`), at a fraction of the cost:
/// the GPT-3 search's candidates have up to 1,024 devices and 1,536 microbatches.
pub fn predict(spec: &Spec, options: &CompileOptions, memo: &mut Memo) -> Result<Figures, Vec<Diagnostic>> {
    predict_with(spec, options, memo, true)
}

/// [`predict`] for the strategy search: a plan that does not fit is not simulated (its
/// memory figures come from its streams alone; its step is infinite), since no plan that
/// does not fit is chosen — most of a large search's plans past the bound are too big.
pub(crate) fn predict_if_fits(
    spec: &Spec,
    options: &CompileOptions,
    memo: &mut Memo,
) -> Result<Figures, Vec<Diagnostic>> {
    predict_with(spec, options, memo, false)
}

fn predict_with(
    spec: &Spec,
    options: &CompileOptions,
    memo: &mut Memo,
    simulate_unfit: bool,
) -> Result<Figures, Vec<Diagnostic>> {
    let (model, layout) = memo.model_and_layout(spec, options)?;
    let model = &*model;
    let placement = place(spec, &layout, &model.cluster)?;
    check_ties(spec, &layout)?;
    let stages = stage_figures(spec, model, &layout);
    let (simulated_placement, stands_for) =
        one_replica(spec, &layout, placement.microbatches, &model.cluster).unwrap_or_else(|| (placement.clone(), 1));
    let mut lowered = lower_streams(spec, &layout, &simulated_placement, &placement.replicas, &stages, model.precision);
    let devices: Vec<DeviceId> = if stands_for == 1 {
        tensor_parallel_copies(&mut lowered, spec.strategy.tp.max(1));
        model.cluster.devices()
    } else {
        let mut d: Vec<DeviceId> = simulated_placement.replicas.iter().flatten().copied().collect();
        d.sort();
        d.dedup();
        d
    };
    // the whole plan's devices with a stream: every replica's tensor-parallel group
    let tp = spec.strategy.tp;
    let mut whole: Vec<DeviceId> =
        placement.replicas.iter().flatten().flat_map(|&d| crate::place::tensor_parallel_devices(d, tp)).collect();
    whole.sort();
    whole.dedup();
    clip_norm_all_reduces(spec, &mut lowered, &whole);
    // the memory first (the bubble only words a warning, which the search does not read)
    let (plans, mut diagnostics) = check_memory(spec, model, &simulated_placement, &stages, &lowered, 0.0, &devices);
    let fits = !diagnostics.iter().any(Diagnostic::is_error);
    let mut stage_headroom = vec![f64::INFINITY; layout.ranges.len()];
    for d in &plans {
        let Some(h) = d.memory.headroom() else { continue };
        for s in &d.stages {
            if let Some(x) = stage_headroom.get_mut(s.0 as usize) {
                *x = x.min(h);
            }
        }
    }
    let mut figures = Figures {
        stage_headroom,
        step_s: f64::INFINITY,
        bubble: 0.0,
        headroom: plans.iter().filter_map(|d| d.memory.headroom()).fold(f64::INFINITY, f64::min),
        exposed_all_reduce_s: 0.0,
        fits,
        memory: plans.into_iter().map(|d| (d.id, d.memory)).collect(),
        diagnostics: Vec::new(),
    };
    if !fits && !simulate_unfit {
        figures.diagnostics = diagnostics;
        return Ok(figures);
    }
    let simulated = simulate_plan(spec, model, &stages, &lowered, &devices)?;
    figures.bubble = if lowered.periodic.is_some() || stands_for == 1 {
        // a steady state's bubble is over the devices that run, alike in every replica
        simulated.bubble
    } else {
        let busy: f64 = simulated.per_device.iter().map(|(_, b, _)| b).sum::<f64>() * stands_for as f64;
        let time = simulated.step_time * model.cluster.device_count() as f64;
        if time > 0.0 {
            1.0 - busy / time
        } else {
            0.0
        }
    };
    figures.step_s = simulated.step_time;
    figures.exposed_all_reduce_s = simulated.collectives.values().map(|c| c.1).fold(0.0, f64::max);
    // the bubble's warning, now that it is known
    if simulate_unfit {
        diagnostics = check_memory(spec, model, &simulated_placement, &stages, &lowered, figures.bubble, &devices).1;
    }
    figures.diagnostics = diagnostics;
    Ok(figures)
}
