//! The simulation pass: streams and the plan's cost model → the simulated step (`Simulated`).

use std::collections::{BTreeMap, HashMap};

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::{DeviceId, Phase};

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
    // each sum in the events' order; a device's sums are looked up once per run of its
    // events, not once per event (the timeline's events come device by device), and the
    // names allocated once per device and phase
    type Sums = [Option<f64>; Phase::ALL.len()];
    let mut sums: BTreeMap<DeviceId, Sums> = BTreeMap::new();
    let mut current: Option<(DeviceId, Sums)> = None;
    for e in timeline.events.iter().filter(|e| !e.background && e.end > e.start) {
        if current.as_ref().is_none_or(|(d, _)| *d != e.device) {
            sums.extend(current.take());
            current = Some((e.device, sums.remove(&e.device).unwrap_or_default()));
        }
        if let (Some((_, phases)), Some(k)) = (current.as_mut(), Phase::ALL.iter().position(|p| *p == e.phase)) {
            *phases[k].get_or_insert(0.0) += (e.end - e.start) / steps;
        }
    }
    sums.extend(current);
    sums.into_iter()
        .map(|(d, phases)| {
            let named = Phase::ALL.iter().zip(phases).filter_map(|(p, s)| Some((p.name().to_string(), s?)));
            (d, named.collect())
        })
        .collect()
}

/// Simulation: streams + cost model → `Simulated`, with figures for `device_ids`.
pub(crate) fn simulate_plan(
    spec: &Spec,
    model: &ModelCosts,
    stages: &StageFigures,
    lowered: &Lowered,
    device_ids: &[DeviceId],
) -> Result<Simulated, Vec<Diagnostic>> {
    let sim_cost = PlanCost::new(spec, model, stages, lowered.summed_over.clone())
        .with_expert_groups(&lowered.groups, &lowered.ties, &stages.expert_share())
        .with_stage_gathers(&lowered.streams, stages, &lowered.recompute)
        .with_update_sums(&lowered.streams, stages, crate::in_pass::clip_each_update(spec, lowered))
        .with_ep_counts(&lowered.streams, stages);
    // the executor's own work a step beside the instructions (the device's `step_pass`)
    let between = spec.cluster.device.step_overhead();
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
            step_time: steady.step_time + between,
            first_step: Some(steady.first_step_time + between),
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
        step_time: timeline.step_time + between,
        first_step: None,
        timeline,
        per_device,
        bubble,
        collectives,
        by_phase,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::Event;

    /// The sums by device and phase are the events' own, added in their order, whether a
    /// device's events come in one run or several.
    #[test]
    fn time_by_phase_sums_each_devices_phases_in_the_events_order() {
        let event = |device: u32, phase: Phase, start: f64, end: f64, background: bool| Event {
            device: DeviceId(device),
            index: 0,
            start,
            end,
            phase,
            background,
            all_to_all: false,
        };
        let events = vec![
            event(1, Phase::Forward, 0.0, 0.1, false),
            event(1, Phase::Forward, 0.1, 0.3, false),
            event(0, Phase::Backward, 0.0, 0.7, false),
            // on the communication engine, and of no length: not the device's time
            event(0, Phase::Collective, 0.0, 5.0, true),
            event(0, Phase::Optimizer, 1.0, 1.0, false),
            event(1, Phase::Forward, 0.3, 0.6, false),
            event(1, Phase::Collective, 0.6, 0.9, false),
        ];
        let timeline = Timeline { events, step_time: 1.0, overlapped: BTreeMap::new() };
        let sums = time_by_phase(&timeline, 2.0);
        let of = |d: u32| sums[&DeviceId(d)].iter().map(|(k, v)| (k.as_str(), *v)).collect::<Vec<_>>();
        assert_eq!(of(0), vec![("backward", (0.7 - 0.0) / 2.0)]);
        assert_eq!(
            of(1),
            vec![
                ("collective", (0.9 - 0.6) / 2.0),
                ("forward", (0.1 - 0.0) / 2.0 + (0.3 - 0.1) / 2.0 + (0.6 - 0.3) / 2.0)
            ]
        );
    }
}
