//! The simulation pass: streams and the plan's cost model → the simulated step (`Simulated`).

use std::collections::{BTreeMap, HashMap};

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::DeviceId;

use crate::figures::StageFigures;
use crate::model::ModelCosts;
use crate::plan_cost::PlanCost;
use crate::simulate::{simulate, utilisation, Timeline};
use crate::streams::Lowered;

/// The simulated step: the timeline and each device's busy time and bubble.
pub(crate) struct Simulated {
    /// The step's timeline (a flush-free pipeline's: two steps, fill to drain, indices
    /// being `plan::instruction_code`s).
    pub(crate) timeline: Timeline,
    /// Seconds per step (a flush-free pipeline's steady state) and, flush-free, the first
    /// step's.
    pub(crate) step_time: f64,
    pub(crate) first_step: Option<f64>,
    /// (device, busy seconds, bubble fraction) for every device of the cluster.
    pub(crate) per_device: Vec<(DeviceId, f64, f64)>,
    /// Idle share of device-time over the step.
    pub(crate) bubble: f64,
    /// Per device: its all-reduces' seconds in flight and exposed, per step.
    pub(crate) collectives: BTreeMap<DeviceId, (f64, f64)>,
    /// Per device: seconds per step of its own instructions, by kind.
    pub(crate) by_phase: BTreeMap<DeviceId, BTreeMap<String, f64>>,
}

impl Simulated {
    /// Seconds per step `device`'s overlapped pairs hid (`Timeline::overlapped`).
    pub(crate) fn overlapped(&self, device: DeviceId) -> f64 {
        self.timeline.overlapped.get(&device).copied().unwrap_or(0.0)
    }
}

/// Seconds of each device's own instructions by kind in `timeline`, over `steps` steps.
fn time_by_phase(timeline: &Timeline, steps: f64) -> BTreeMap<DeviceId, BTreeMap<String, f64>> {
    let mut out: BTreeMap<DeviceId, BTreeMap<String, f64>> = BTreeMap::new();
    for e in timeline.events.iter().filter(|e| !e.background && e.end > e.start) {
        *out.entry(e.device).or_default().entry(e.phase.name().to_string()).or_insert(0.0) += (e.end - e.start) / steps;
    }
    out
}

/// Simulation: streams + cost model → `Simulated`, with figures for `device_ids`.
pub(crate) fn simulate_plan(
    spec: &Spec,
    model: &ModelCosts,
    stages: &StageFigures,
    lowered: &Lowered,
    device_ids: &[DeviceId],
) -> Result<Simulated, Vec<Diagnostic>> {
    let sim_cost = PlanCost::new(spec, model, stages, lowered.summed_over.clone()).with_expert_groups(
        &lowered.groups,
        &lowered.ties,
        &stages.expert_share(),
    );
    if let Some(p) = &lowered.periodic {
        let steady = crate::periodic::steady_state(p, &lowered.members(), &sim_cost).map_err(|e| {
            vec![Diagnostic::error(
                "E0603",
                format!("internal compiler error: the verified plan failed in simulation: {e}"),
                spec.strategy.schedule.span,
                "while compiling this schedule",
            )]
        })?;
        let per_device = device_ids
            .iter()
            .map(|d| {
                let busy = steady.busy.get(d).copied().unwrap_or(0.0);
                let idle = if steady.step_time > 0.0 { (1.0 - busy / steady.step_time).max(0.0) } else { 0.0 };
                (*d, busy, if p.body.get(d).is_some_and(|s| !s.is_empty()) { idle } else { 1.0 })
            })
            .collect();
        // the two-step timeline's events name their instruction by segment and index
        let mut timeline = steady.two_steps;
        let codes: HashMap<DeviceId, Vec<usize>> = p
            .body
            .iter()
            .map(|(d, body)| {
                let pro = p.segments.prologue.get(d).map_or(0, Vec::len);
                let epi = p.segments.epilogue.get(d).map_or(0, Vec::len);
                use pipec_plan::plan::{instruction_code, Segment};
                let codes = (0..pro)
                    .map(|i| instruction_code(Segment::Prologue, i))
                    .chain((0..body.len()).map(|i| instruction_code(Segment::Body, i)))
                    .chain((0..epi).map(|i| instruction_code(Segment::Epilogue, i)))
                    .collect();
                (*d, codes)
            })
            .collect();
        for e in &mut timeline.events {
            if let Some(c) = codes.get(&e.device).and_then(|c| c.get(e.index)) {
                e.index = *c;
            }
        }
        // the timeline runs two steps, fill to drain
        let by_phase = time_by_phase(&timeline, 2.0);
        return Ok(Simulated {
            by_phase,
            timeline,
            step_time: steady.step_time,
            first_step: Some(steady.first_step_time),
            per_device,
            bubble: steady.bubble,
            collectives: steady.collectives,
        });
    }
    let timeline = simulate(&lowered.streams, &lowered.members(), &sim_cost).map_err(|stuck| {
        vec![Diagnostic::error(
            "E0603",
            format!("internal compiler error: the verified plan deadlocked in simulation: {}", stuck.reason),
            spec.strategy.schedule.span,
            "while compiling this schedule",
        )]
    })?;
    let (per_device, bubble) = utilisation(&timeline, device_ids);
    let collectives = crate::simulate::collective_times(&timeline);
    let by_phase = time_by_phase(&timeline, 1.0);
    Ok(Simulated {
        step_time: timeline.step_time,
        first_step: None,
        timeline,
        per_device,
        bubble,
        collectives,
        by_phase,
    })
}
