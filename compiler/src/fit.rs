//! The memory pass: each device's memory from its stream, and whether the plan fits —
//! E0601 with what would fit, W0602 near capacity, W0605 for a large bubble.

use std::collections::HashMap;

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::plan::DevicePlan;
use pipec_plan::vocab::{Attention, Choice, ScheduleKind, Sharding};
use pipec_plan::{DeviceId, StageId};

use crate::figures::StageFigures;
use crate::memory::{device_memory, human_bytes, StageBytes};
use crate::model::ModelCosts;
use crate::schedule::Placement;
use crate::streams::Lowered;

/// Memory: per-device breakdowns from the streams, E0601/W0602, and the bubble warning.
pub(crate) fn check_memory(
    spec: &Spec,
    model: &ModelCosts,
    placement: &Placement,
    stages: &StageFigures,
    lowered: &Lowered,
    bubble: f64,
    device_ids: &[DeviceId],
) -> (Vec<DevicePlan>, Vec<Diagnostic>) {
    let strategy = &spec.strategy;
    let tp = strategy.tp.max(1);
    let cluster = &model.cluster;
    let weight_cap = strategy.schedule.kind.weight_versions().cap();
    let empty = Vec::new();
    let counted = lowered.counted_streams();
    // tensor-parallel followers hold a shard the size of their group leader's: the
    // leader's figures, found once per group
    let mut of_leader: HashMap<DeviceId, DevicePlan> = HashMap::new();
    let devices: Vec<DevicePlan> = device_ids
        .iter()
        .map(|&id| {
            let leader = DeviceId(id.0 - id.0 % tp as u32);
            let figures = of_leader.entry(leader).or_insert_with(|| {
                let stream = counted.get(&leader).unwrap_or(&empty);
                DevicePlan {
                    id: leader,
                    node: 0,
                    stages: placement.stages_of(leader).into_iter().map(|s| StageId(s as u32)).collect(),
                    memory: device_memory(
                        stream,
                        &stages.bytes,
                        &lowered.recompute,
                        weight_cap,
                        cluster.memory,
                        spec.pairs_layer_by_layer(),
                    ),
                    peak_in_flight: crate::memory::peak_in_flight(stream),
                }
            });
            DevicePlan { id, node: cluster.node_of(id), ..figures.clone() }
        })
        .collect();
    let mut diagnostics = Vec::new();
    memory_diagnostics(spec, &devices, &stages.bytes, &lowered.recompute, placement, &mut diagnostics);
    if bubble > 0.5 && strategy.schedule.kind.is_pipeline() {
        diagnostics.push(
            Diagnostic::warning(
                "W0605",
                format!("the predicted bubble is {:.0}% of device time", bubble * 100.0),
                strategy.schedule.span,
                "this schedule",
            )
            .with_help(format!(
                "more microbatches (now {}) or a schedule with smaller bubbles (interleaved, zb-h1) would use the devices better",
                strategy.microbatches
            )),
        );
    }
    (devices, diagnostics)
}

/// The memory share a plan leaves free: the spec's `search.headroom`, else
/// [`pipec_plan::rules::DEFAULT_MEMORY_HEADROOM`] (the allocator's reserve, CUDA's context and
/// NCCL's buffers).
fn headroom(spec: &Spec) -> f64 {
    spec.strategy.auto.as_ref().map_or(pipec_plan::rules::DEFAULT_MEMORY_HEADROOM, |a| a.headroom)
}

pub(crate) fn memory_diagnostics(
    spec: &Spec,
    devices: &[DevicePlan],
    stage_bytes: &[StageBytes],
    recompute: &[bool],
    placement: &Placement,
    out: &mut Vec<Diagnostic>,
) {
    let strategy = &spec.strategy;
    let worst = devices.iter().max_by(|a, b| {
        (a.memory.total as f64 / a.memory.capacity.max(1) as f64)
            .total_cmp(&(b.memory.total as f64 / b.memory.capacity.max(1) as f64))
    });
    let Some(worst) = worst else { return };
    let m = &worst.memory;
    let share = m.total as f64 / m.capacity.max(1) as f64;
    let breakdown = format!(
        "weights {} + gradients {} + optimizer {} + activations {} + backward's transient {} + buffers {} + workspace {} = {}",
        human_bytes(m.weights),
        human_bytes(m.gradients),
        human_bytes(m.optimizer),
        human_bytes(m.activations),
        human_bytes(m.transient),
        human_bytes(m.buffers),
        human_bytes(m.workspace),
        human_bytes(m.total)
    );
    // the devices over capacity, the most over first
    let mut over: Vec<&DevicePlan> = devices.iter().filter(|d| d.memory.total > d.memory.capacity).collect();
    over.sort_by_key(|d| (std::cmp::Reverse(d.memory.total - d.memory.capacity), d.id));
    if !over.is_empty() {
        // What would fit: recompute keeps only stage inputs; 1F1B bounds in-flight
        // microbatches; a larger device by the missing amount.
        let mut ideas = Vec::new();
        if worst.stages.iter().any(|s| !recompute.get(s.0 as usize).copied().unwrap_or(false)) {
            let held_acts: u64 = m.activations;
            let saved: u64 = worst
                .stages
                .iter()
                .map(|s| {
                    stage_bytes[s.0 as usize].checkpoint_per_microbatch
                        * u64::from(worst.peak_in_flight.get(s).copied().unwrap_or(1))
                })
                .sum::<u64>()
                + worst.stages.iter().map(|s| stage_bytes[s.0 as usize].activations_per_microbatch).max().unwrap_or(0);
            let with = m.total - held_acts + saved;
            if with <= m.capacity {
                ideas.push(format!("`recompute: true` ({} on {})", human_bytes(with), worst.id));
            }
        }
        ideas.extend(sharding_and_attention_ideas(spec, worst, stage_bytes, recompute));
        if strategy.schedule.kind == ScheduleKind::Gpipe {
            ideas.push(
                "`schedule: 1f1b` (keeps at most one microbatch per later stage in flight instead of all)".to_string(),
            );
        }
        let per_stage_weights: u64 = worst.stages.iter().map(|s| stage_bytes[s.0 as usize].weights).sum();
        if per_stage_weights > 0 && placement.stages() < spec.model.layers.len() {
            ideas.push(format!("more pipeline stages (now {}), so each device holds fewer layers", placement.stages()));
        }
        ideas.push(format!("a device with at least {}", human_bytes(m.total)));
        out.push(
            Diagnostic::error(
                "E0601",
                format!(
                    "device {} needs {} but has {} ({} device(s) over capacity: {})",
                    worst.id,
                    human_bytes(m.total),
                    human_bytes(m.capacity),
                    over.len(),
                    worst_few(&over)
                ),
                strategy.layout_span,
                format!(
                    "device {} holds {}",
                    worst.id,
                    worst.stages.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
                ),
            )
            .with_label(spec.cluster.memory_span, format!("{} per device", human_bytes(m.capacity)))
            .with_help(format!("{breakdown}. What would fit: {}", ideas.join("; "))),
        );
    } else if share > 1.0 - headroom(spec) {
        out.push(
            Diagnostic::warning(
                "W0602",
                format!(
                    "device {} uses {:.0}% of its memory, leaving less than the {:.0}% headroom a GPU run needs beside the plan's figures",
                    worst.id,
                    share * 100.0,
                    headroom(spec) * 100.0
                ),
                strategy.layout_span,
                format!("{} of {}", human_bytes(m.total), human_bytes(m.capacity)),
            )
            .with_label(spec.cluster.memory_span, "device memory")
            .with_help(breakdown),
        );
    }
}

/// E0601's ideas from the memory strategies, each offered only when it makes `worst` fit:
/// a higher ZeRO level (the lowest that fits), flash attention or selective recompute (the
/// attention cores' `[heads, seq, seq]` tensors no longer kept), context parallelism's
/// ring (its gathered keys and values and the attention cores no longer kept), or the first pair of ZeRO and flash
/// attention that fits when neither alone does.
fn sharding_and_attention_ideas(
    spec: &Spec,
    worst: &DevicePlan,
    stage_bytes: &[StageBytes],
    recompute: &[bool],
) -> Vec<String> {
    let m = &worst.memory;
    let held: Vec<&StageBytes> = worst.stages.iter().filter_map(|s| stage_bytes.get(s.0 as usize)).collect();
    let current = spec.strategy.sharding;
    // the held stages' model state at a ZeRO level: each stage's share of its whole state
    let state_at = |level: Sharding| -> u64 { held.iter().map(|b| b.whole.sharded(level, b.replicas).total()).sum() };
    let state_now = state_at(current);
    // a part of what the non-recomputed held stages keep per microbatch, times their
    // microbatches in flight
    let kept_in_flight = |part: fn(&StageBytes) -> u64| -> u64 {
        worst
            .stages
            .iter()
            .filter(|s| !recompute.get(s.0 as usize).copied().unwrap_or(false))
            .map(|s| {
                stage_bytes.get(s.0 as usize).map_or(0, part)
                    * u64::from(worst.peak_in_flight.get(s).copied().unwrap_or(1))
            })
            .sum()
    };
    // flash attention: the attention cores
    let cores = kept_in_flight(|b| b.attention_core_per_microbatch);
    let total_with = |level: Sharding, flash: bool| {
        (m.total - state_now + state_at(level)).saturating_sub(if flash { cores } else { 0 })
    };
    let replicated = held.iter().any(|b| b.replicas > 1);
    let levels: Vec<Sharding> = if replicated {
        Sharding::ALL.iter().copied().filter(|l| l.level() > current.level()).collect()
    } else {
        vec![]
    };
    let flash_word = if spec.model.attention == Attention::Standard {
        "`attention: flash` (or `recompute: selective`)"
    } else {
        "`recompute: selective`"
    };
    let mut ideas = Vec::new();
    if let Some(&level) = levels.iter().find(|&&l| total_with(l, false) <= m.capacity) {
        ideas.push(format!("`zero: {}` ({} on {})", level.level(), human_bytes(total_with(level, false)), worst.id));
    }
    if cores > 0 && total_with(current, true) <= m.capacity {
        ideas.push(format!("{flash_word} ({} on {})", human_bytes(total_with(current, true)), worst.id));
    }
    // context parallelism around the ring: the gathered keys and values no longer kept,
    // nor the attention cores (the ring's blocks keep each row's log-sum-exp instead:
    // `CostContext::attention_kernel`)
    let gathered = kept_in_flight(|b| b.gathered_kv_per_microbatch);
    let ring_total = m.total.saturating_sub(gathered + cores);
    if gathered > 0 && ring_total <= m.capacity {
        ideas.push(format!("`cp_comm: ring` ({} on {})", human_bytes(ring_total), worst.id));
    }
    if ideas.is_empty() && cores > 0 {
        if let Some(&level) = levels.iter().find(|&&l| total_with(l, true) <= m.capacity) {
            ideas.push(format!(
                "`zero: {}` with {flash_word} ({} on {})",
                level.level(),
                human_bytes(total_with(level, true)),
                worst.id
            ));
        }
    }
    ideas
}

/// The devices most over capacity, with how much over, and how many more there are: a
/// message stays one line on a 1,024-device plan.
pub(crate) fn worst_few(over: &[&DevicePlan]) -> String {
    const SHOWN: usize = 3;
    let named: Vec<String> = over
        .iter()
        .take(SHOWN)
        .map(|d| format!("{} by {}", d.id, human_bytes(d.memory.total - d.memory.capacity)))
        .collect();
    match over.len().saturating_sub(SHOWN) {
        0 => named.join(", "),
        rest => format!("{} and {rest} more", named.join(", ")),
    }
}

/// The memory a model's state (weights, gradients, optimizer state) needs, against the
/// cluster's: what "nothing fits" says would.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryNeed {
    pub parameters: u64,
    /// Weights, gradients and optimizer state per parameter at the training precision.
    pub bytes_per_parameter: f64,
    /// A device's memory less its workspace reserve.
    pub usable_per_device: f64,
    pub devices_per_node: usize,
    pub nodes: usize,
}

impl MemoryNeed {
    /// The spec's model on its cluster.
    pub fn of(spec: &Spec) -> MemoryNeed {
        let capacity = spec.cluster.memory;
        MemoryNeed {
            parameters: spec.model.parameters(),
            bytes_per_parameter: crate::model::state_bytes_per_parameter(spec),
            usable_per_device: capacity - crate::memory::workspace_reserve(capacity) as f64,
            devices_per_node: spec.cluster.devices_per_node.max(1),
            nodes: spec.cluster.nodes,
        }
    }

    /// The model state's bytes.
    pub fn state_bytes(&self) -> f64 {
        self.parameters as f64 * self.bytes_per_parameter
    }

    /// The fewest nodes whose devices hold the model state with it sharded over every
    /// device (ZeRO-3) and nothing else: a lower bound, as activations come on top.
    pub fn fewest_nodes(&self) -> usize {
        let per_node = self.usable_per_device * self.devices_per_node as f64;
        if per_node <= 0.0 {
            return usize::MAX;
        }
        (self.state_bytes() / per_node).ceil().max(1.0) as usize
    }

    /// The sentence that says what would fit.
    pub fn what_would_fit(&self) -> String {
        let human = |b: f64| crate::memory::human_bytes(b.max(0.0) as u64);
        let devices = self.nodes * self.devices_per_node;
        let fewest = self.fewest_nodes();
        let more = if fewest > self.nodes {
            format!(
                "at least {fewest} nodes of {} devices hold it sharded over every device (ZeRO-3), before activations",
                self.devices_per_node
            )
        } else {
            "the state fits sharded over every device (ZeRO-3): the activations are what does not — try more microbatches, recompute or a deeper pipeline".to_string()
        };
        format!(
            "the model's weights, gradients and optimizer state take {} ({} parameters × {:.0} B); the {devices} devices hold {} ({} each after the workspace reserve): {more}",
            human(self.state_bytes()),
            pipec_plan::model::thousands(self.parameters),
            self.bytes_per_parameter,
            human(self.usable_per_device * devices as f64),
            human(self.usable_per_device),
        )
    }
}

#[cfg(test)]
mod need_tests {
    use super::MemoryNeed;

    #[test]
    fn nothing_fits_says_how_much_the_state_takes_and_how_many_nodes_hold_it() {
        // Mixtral 8x7B in bf16 under Adam with fp32 gradients: 2 + 4 + 8 + 4 (master) bytes a
        // parameter, on one node of 8 H100s (80 GB, less the 1 GiB reserve)
        let usable = 80e9 * 1.0 - (1u64 << 30) as f64;
        let need = MemoryNeed {
            parameters: 46_702_792_704,
            bytes_per_parameter: 18.0,
            usable_per_device: usable,
            devices_per_node: 8,
            nodes: 1,
        };
        assert_eq!(need.fewest_nodes(), 2);
        let said = need.what_would_fit();
        assert!(said.contains("take 782.92 GiB (46,702,792,704 parameters × 18 B)"), "{said}");
        assert!(said.contains("at least 2 nodes of 8 devices"), "{said}");
        // a state that fits leaves the activations to blame
        let small = MemoryNeed { parameters: 1_000_000_000, ..need };
        assert_eq!(small.fewest_nodes(), 1);
        assert!(small.what_would_fit().contains("the activations are what does not"));
    }
}
