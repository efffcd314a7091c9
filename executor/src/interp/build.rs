//! Building a device's stages from the plan: each stage's model (its layers, tensor-
//! parallel shard or expert holding), optimizer and ZeRO shard.

use std::collections::HashMap;

use pipec_plan::{DeviceId, Plan, StageId};

use crate::backend::kernels::ExecBackend;
use crate::error::{ExecError, Result};
use crate::interp::stage::{stage_graph, StageState, TpInfo};
use crate::nn::layers::StageModel;
use crate::nn::params::layout;
pub(crate) use crate::parallel::optim::StageOptim;
use crate::parallel::optim::Storage;

pub(crate) fn build_stages<B: ExecBackend>(
    plan: &Plan,
    device: DeviceId,
    dev: &B::Device,
) -> Result<HashMap<StageId, StageState<B>>> {
    let mut out = HashMap::new();
    for s in &plan.stages {
        if !s.replicas.contains(&device) && !s.tensor_parallel.iter().any(|g| g.contains(&device)) {
            continue;
        }
        let all = plan.model_ops();
        let layers = crate::parallel::tensor_parallel::StageLayers {
            all: &all,
            range: s.layers[0]..s.layers[1],
            loss: plan.model.loss,
            whole_experts: plan.schedule.whole_experts,
        };
        let ops = layers.ops();
        let (model, tp) = match s.tensor_parallel.iter().find(|g| g.contains(&device)) {
            Some(group) if group.len() > 1 => {
                let rank = group.iter().position(|d| *d == device).unwrap_or(0);
                let model = crate::parallel::tensor_parallel::build_stage::<B>(
                    &layers,
                    plan.training.seed,
                    dev,
                    rank,
                    group.len(),
                )?;
                let partial_ids = crate::parallel::tensor_parallel::partial_parameter_ids(&layers, group.len())?;
                (model, Some(TpInfo { rank, members: group.clone(), partial_ids }))
            }
            _ => {
                let mut model = StageModel::<B>::new(ops, s.layers[0], plan.training.seed, dev);
                model.graph = stage_graph(plan, s.layers[0], s.layers[1]);
                (model, None)
            }
        };
        // a projection tied to an embedding starts as the transpose of its table
        let mut model = model;
        model.recompute_attention_cores(plan);
        for l in &plan.layers[s.layers[0]..s.layers[1]] {
            let (Some(a), pipec_plan::model::Op::Linear { in_features: dim, out_features: vocab, .. }) =
                (l.tied, &l.op)
            else {
                continue;
            };
            let table = crate::nn::layers::embedding_values(a, plan.training.seed, *vocab, *dim);
            let mut weight = crate::nn::layers::transpose(&table, *vocab, *dim);
            // a vocabulary-parallel rank's columns: the transpose of its rows of the table
            if let Some(t) = &tp {
                let split = crate::parallel::tensor_parallel::shardings(&layers, t.members.len())?;
                if let Some(s) = split.get(&crate::nn::layers::pid(l.index, 0)) {
                    weight = crate::parallel::tensor_parallel::shard(&weight, *s, t.members.len(), t.rank);
                }
            }
            let id = crate::nn::layers::pid(l.index, 0);
            let mut weight = Some(weight);
            model = crate::nn::params::set_params(model, |p, _| if p == id { weight.take() } else { None }).0;
        }
        let params = layout::<B, _>(&model);
        let optim = StageOptim::new(&plan.training.optimizer, &params, Storage::of(&plan.training));
        let experts = crate::parallel::experts::Holding::of(plan, s.id, device, &params);
        // (a ZeRO-sharded stage's shards are cut from the whole weights first)
        let model = match &experts {
            Some(h) if !h.sharded => h.evict(model),
            _ => model,
        };
        out.insert(
            s.id,
            StageState {
                model: Some(model),
                tp,
                optim,
                acc: Vec::new(),
                contributions: 0,
                forward_stats: HashMap::new(),
                stats: None,
                stats_count: 0.0,
                stash: HashMap::new(),
                versions: Vec::new(),
                shard: None,
                experts,
                settled: false,
            },
        );
        if let Some((group, rank, d)) = crate::parallel::zero::shard_group(plan, s.id, device) {
            let st = out.get_mut(&s.id).ok_or(ExecError::Missing("the stage just built"))?;
            let experts = st.experts.as_ref().map(|h| (h, device));
            let mut shard = crate::parallel::zero::ShardState::new(plan, st.model()?, group, rank, d, experts, dev)?;
            // ZeRO-3: the linear weights gathered by their products (not beside tensor or
            // expert parallelism, whose stages are gathered whole: the rule the plan's
            // declared collectives follow, `pipec_plan::in_pass::Layout::per_product`)
            if shard.level == pipec_plan::vocab::Sharding::Parameters && st.tp.is_none() && st.experts.is_none() {
                shard.per_product = crate::parallel::zero::per_product(plan, st.model()?, &shard.layout);
            }
            st.shard = Some(shard);
            crate::interp::sharded::stand_in_per_product(st)?;
            if let Some(h) = &st.experts {
                st.model = st.model.take().map(|m| h.evict(m));
            }
        }
    }
    Ok(out)
}
