//! Assembly: everything the passes built → the `Plan` the executor runs.

use pipec_grammar::spec::{Data, Spec};
use pipec_plan::model::Source;
use pipec_plan::plan::{
    DataPlan, DevicePlan, DeviceSimulation, GroupPlan, LayerPlan, ModelPlan, ScheduleInfo, Simulation, StagePlan,
    TrainingPlan, PLAN_VERSION,
};
use pipec_plan::schedule::WeightVersions;
use pipec_plan::{Plan, StageId};

use crate::figures::StageFigures;
use crate::model::ModelCosts;
use crate::options::CompileOptions;
use crate::partition::Layout;
use crate::schedule::Placement;
use crate::simulation::Simulated;
use crate::streams::Lowered;

/// Assembly: everything above → `Plan`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn assemble(
    spec: &Spec,
    options: &CompileOptions,
    model: &ModelCosts,
    layout: Layout,
    placement: &Placement,
    stages: &StageFigures,
    lowered: Lowered,
    simulated: &Simulated,
    devices: Vec<DevicePlan>,
) -> Plan {
    let strategy = &spec.strategy;
    let kind = strategy.schedule.kind;
    let tp = strategy.tp.max(1);
    let counted = lowered.counted_streams().into_owned();
    let layers = layer_plans(model);
    let declared = stages.declared_buckets(spec.engine.target.name);
    let stage_plans: Vec<StagePlan> = layout
        .ranges
        .iter()
        .enumerate()
        .map(|(s, r)| StagePlan {
            id: StageId(s as u32),
            layers: [r.start, r.end],
            replicas: placement.replicas[s].clone(),
            route: placement.route[s].clone(),
            group: lowered.group_of[s],
            parameters: stages.bytes[s].parameters,
            forward_s: stages.times[s].0,
            backward_s: stages.times[s].1,
            update_s: stages.update[s],
            recompute: layout.recompute[s],
            selective_recompute: spec.strategy.recompute.selective(),
            activation_bytes_per_microbatch: if layout.recompute[s] {
                stages.bytes[s].checkpoint_per_microbatch
            } else {
                stages.bytes[s].activations_per_microbatch
            },
            output_bytes_per_microbatch: stages.output_bytes[s],
            tensor_parallel: if tp > 1 {
                placement.replicas[s].iter().map(|&l| crate::place::tensor_parallel_devices(l, tp).collect()).collect()
            } else {
                Vec::new()
            },
            expert_parallel: stages.expert_parallel[s] as u32,
            all_to_all_s: [stages.ep_times[s].0, stages.ep_times[s].1],
            all_to_alls: stages.all_to_alls[s].clone(),
            context_s: [stages.cp_times[s].0, stages.cp_times[s].1],
            gradient_buckets: declared[s].clone(),
        })
        .collect();
    let (ties, experts) = (lowered.ties, lowered.expert_groups);
    let groups: Vec<GroupPlan> = lowered
        .groups
        .into_iter()
        .map(|(id, (stage, devices))| GroupPlan {
            id,
            stage,
            devices,
            tie: ties.get(&id).copied(),
            experts: experts.contains(&id),
        })
        .collect();
    let simulation = simulation_plan(spec, simulated, &devices);
    let weight_versions = match kind.weight_versions() {
        WeightVersions::One => 1,
        WeightVersions::Two => 2,
        WeightVersions::Stashed => devices
            .iter()
            .filter_map(|d| counted.get(&d.id))
            .flat_map(|s| crate::memory::peak_weight_versions(s).into_values())
            .max()
            .map_or(1, |v| v as usize + 1),
    };
    Plan {
        version: PLAN_VERSION,
        name: spec.name.clone().unwrap_or_else(|| "pipec-job".into()),
        engine: spec.engine.target.clone(),
        engine_performance: spec
            .engine
            .performance
            .clone()
            .filter(|p| p.family != pipec_plan::engine::performance::KernelFamily::Pipec),
        model: ModelPlan {
            input: spec.model.input.clone(),
            loss: spec.model.loss,
            token_vocab: spec.model.token_vocab(),
            attention: spec.model.attention,
            mtp: spec.model.mtp,
        },
        training: training_plan(spec, model.microbatch_size, options),
        schedule: ScheduleInfo {
            kind,
            virtual_stages: layout.virtual_stages,
            synchronous: kind.is_synchronous(strategy.schedule.sync),
            weight_versions,
            reduce: strategy.schedule.reduce,
            staleness: lowered.asp.then_some(strategy.schedule.staleness),
            sequence_parallel: strategy.sequence_parallel,
            tp_overlap: strategy.tp_overlap && strategy.tp > 1,
            cp_comm: if strategy.cp > 1 { strategy.cp_comm } else { Default::default() },
            moe_dispatch: if strategy.ep > 1 { strategy.moe_dispatch } else { Default::default() },
            ep_overlap: strategy.combined_1f1b(),
            whole_experts: strategy.experts_whole() && strategy.ep > 1,
            sharding: strategy.sharding,
            block_recompute: match &strategy.recompute {
                pipec_grammar::spec::Recompute::Blocks(b) => Some(b.clone()),
                _ => None,
            },
        },
        partition: layout.notation,
        stages: stage_plans,
        devices,
        groups,
        layers,
        streams: lowered.streams,
        in_pass: lowered.in_pass,
        flush_free: lowered.periodic.map(|p| p.segments),
        eval: lowered.eval,
        simulation,
    }
}

/// Each layer's figures, as the plan lists them.
fn layer_plans(model: &ModelCosts) -> Vec<LayerPlan> {
    model
        .graph
        .ops()
        .zip(&model.costs)
        .enumerate()
        .map(|(index, ((_, node), c))| LayerPlan {
            index,
            op: node.op.clone(),
            label: node.label.clone(),
            inputs: (node.inputs != [Source::before(index)]).then(|| node.inputs.clone()),
            tied: node.tied,
            input_shape: node.input_shape.clone(),
            output_shape: node.output_shape.clone(),
            parameters: c.parameters,
            parameter_bytes: c.parameter_bytes,
            forward_flops_per_sample: c.forward_flops_per_sample,
            backward_flops_per_sample: c.backward_flops_per_sample,
            forward_s: c.forward_s,
            backward_s: c.backward_s,
            activation_bytes_per_sample: c.activation_bytes_per_sample,
            output_bytes_per_sample: c.output_bytes_per_sample,
        })
        .collect()
}

/// The simulated step: its time, bubble, throughput, tokens/s and MFU, and each device's
/// busy time, collectives and peak memory.
fn simulation_plan(spec: &Spec, simulated: &Simulated, devices: &[DevicePlan]) -> Simulation {
    let (step_time, bubble) = (simulated.step_time, simulated.bubble);
    let samples_per_s = if step_time > 0.0 { spec.training.batch_size as f64 / step_time } else { 0.0 };
    let utilization = spec.utilization();
    Simulation {
        step_time_s: step_time,
        first_step_time_s: simulated.first_step,
        bubble_fraction: bubble,
        throughput_samples_per_s: samples_per_s,
        tokens_per_s_per_device: utilization.as_ref().map(|u| u.tokens_per_s_per_device(samples_per_s)),
        mfu: utilization.and_then(|u| u.mfu(samples_per_s)),
        devices: simulated
            .per_device
            .iter()
            .map(|(d, busy, b)| {
                let (in_flight, exposed) = simulated.collectives.get(d).copied().unwrap_or((0.0, 0.0));
                DeviceSimulation {
                    id: *d,
                    busy_s: *busy,
                    bubble_fraction: *b,
                    peak_memory_bytes: devices[d.0 as usize].memory.total,
                    collective_s: in_flight,
                    exposed_collective_s: exposed,
                    by_phase: simulated.by_phase.get(d).cloned().unwrap_or_default(),
                    overlapped_s: simulated.overlapped(*d),
                }
            })
            .collect(),
    }
}

pub(crate) fn training_plan(spec: &Spec, microbatch_size: usize, options: &CompileOptions) -> TrainingPlan {
    let t = &spec.training;
    let resolve = |p: &str| -> String {
        let path = std::path::Path::new(p);
        match (&options.base_dir, path.is_absolute()) {
            (Some(base), false) => base.join(path).display().to_string(),
            _ => p.to_string(),
        }
    };
    TrainingPlan {
        batch_size: t.batch_size,
        microbatches: spec.strategy.microbatches,
        microbatch_size,
        context_parallel: spec.strategy.cp.max(1),
        steps: t.steps,
        optimizer: t.optimizer,
        precision: t.precision,
        grad_precision: t.grad_precision,
        fp8: t.fp8,
        state_precision: t.state_precision,
        master_weights: t.master_weights,
        seed: t.seed,
        data: match &t.data {
            Data::Synthetic { task, samples } => DataPlan::Synthetic { task: *task, samples: *samples },
            Data::Csv { path, .. } => DataPlan::Csv { path: resolve(path) },
            Data::Npy { path, labels, .. } => {
                DataPlan::Npy { path: resolve(path), labels: labels.as_deref().map(resolve) }
            }
            Data::Text { path, tokenizer, .. } => {
                DataPlan::Text { path: resolve(path), tokenizer: tokenizer.as_deref().map(resolve) }
            }
            Data::Tokens { path, dtype, .. } => DataPlan::Tokens { path: resolve(path), dtype: *dtype },
            // records (JSON Lines, Parquet, Arrow) train from their token cache, written by `pipec compile`
            // and `pipec run` before the plan runs (`pipec_plan::datafile::token_cache`)
            Data::Records { format, path, field, tokenizer, eot, .. } => {
                let base = options.base_dir.clone().unwrap_or_default();
                let records = pipec_grammar::ast::records(&base, *format, path, field, tokenizer, eot);
                let cache = pipec_plan::datafile::token_cache(&records);
                DataPlan::Tokens {
                    path: resolve(&cache.display().to_string()),
                    dtype: Some(pipec_plan::TokenDtype::Uint32),
                }
            }
            Data::Images { path, resize, mean, std, .. } => {
                DataPlan::Images { path: resolve(path), resize: *resize, mean: mean.clone(), std: std.clone() }
            }
        },
        checkpoint_every: t.checkpoint.as_ref().map(|c| c.every),
        checkpoint_sync: t.checkpoint.as_ref().is_some_and(|c| !c.asynchronous),
        checkpoint_dir: t.checkpoint.as_ref().map(|c| c.dir.clone()),
        recipe: t.recipe,
        // set by `pipec run --init`, which knows the folder
        init_from: None,
    }
}
