//! `pipec profile`: measures every layer's forward and backward on the chosen backend at the
//! plan's microbatch size, and the bytes it keeps and outputs, producing the per-layer
//! profile the cost model accepts (`pipec compile --profile`). A backward is measured as the
//! executor runs it: the autodiff pass and the weight gradients added into the step's sums.

use std::time::Instant;

use crate::backend::kernels::ExecBackend;
use burn::module::Module;
use burn::prelude::*;
use pipec_plan::model::Source;
use pipec_plan::profile::{Profile, ProfiledLayer};
use pipec_plan::Plan;

use crate::backend::rng::Rng;
use crate::error::ExecError;
use crate::interp::data::Targets;
use crate::interp::stage::StageOptim;
use crate::interp::values::require_grad;
use crate::nn::layers::{Act, StageGraph, StageModel};
use crate::nn::params::{
    accumulate, add_deferred_into_sums, backward_deferring, backward_into_model_sums, collect_grads, sum_keys,
    FlatGrads,
};

/// The median of `v` (the upper one of an even count; 0 for none).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn random_input<B: Backend>(shape: &[usize], tokens: Option<usize>, dev: &B::Device) -> Act<B> {
    let n: usize = shape.iter().product();
    let mut rng = Rng::keyed(&[99, n as u64]);
    match (tokens, shape.len()) {
        (Some(v), _) => Act::Tokens(Tensor::from_data(
            TensorData::new((0..n).map(|_| rng.below(v as u64) as i64).collect::<Vec<i64>>(), shape.to_vec()),
            dev,
        )),
        (None, 2) => Act::D2(Tensor::from_data(TensorData::new(rng.normal_vec(n), shape.to_vec()), dev)),
        (None, 3) => Act::D3(Tensor::from_data(TensorData::new(rng.normal_vec(n), shape.to_vec()), dev)),
        _ => Act::D4(Tensor::from_data(TensorData::new(rng.normal_vec(n), shape.to_vec()), dev)),
    }
}

fn sum<B: Backend>(a: &Act<B>) -> Option<Tensor<B, 1>> {
    match a {
        Act::D2(t) => Some(t.clone().sum()),
        Act::D3(t) => Some(t.clone().sum()),
        Act::D4(t) => Some(t.clone().sum()),
        Act::Tokens(_) | Act::Bundle(_) => None,
    }
}

/// What a timed pass reduces its output to before the backward: the sum (a layer inside
/// the model), or the model's loss on random targets (the last layer and the whole model,
/// as the executor ends its last stage: the loss's work is in their passes, as the cost
/// model prices it in the last layer's).
#[derive(Debug)]
pub enum Reduce {
    Sum,
    Loss(pipec_plan::vocab::Loss, Targets),
}

impl Reduce {
    /// Layer `i`'s of `plan` (`i` past the last layer: the whole model's), its targets drawn
    /// once for a microbatch of the last layer's output.
    pub fn of(plan: &Plan, i: usize) -> Reduce {
        let Some(last) = plan.layers.last().filter(|_| i + 1 >= plan.layers.len()) else { return Reduce::Sum };
        let (rows, classes) = match last.output_shape.split_last() {
            Some((c, rest)) => (plan.training.microbatch_size * rest.iter().product::<usize>(), *c),
            None => return Reduce::Sum,
        };
        let mut rng = Rng::keyed(&[98, rows as u64]);
        let targets = match plan.model.loss {
            pipec_plan::vocab::Loss::CrossEntropy => {
                Targets::Classes((0..rows).map(|_| rng.below(classes.max(1) as u64) as i64).collect())
            }
            pipec_plan::vocab::Loss::Mse => Targets::Values(rng.normal_vec(rows * classes)),
        };
        Reduce::Loss(plan.model.loss, targets)
    }
}

/// A layer's (or a model's) measured passes, in milliseconds.
pub(crate) struct Passes {
    pub(crate) forward: f64,
    pub(crate) backward: f64,
    /// Of a backward timed split (`time_passes`' `split`), its weight half; else 0.
    pub(crate) weights: f64,
    pub(crate) update: f64,
}

/// Runs `model` forward and backward on `input()` `warmup` times unmeasured, then `reps`
/// times, and updates it with the plan's optimizer after every `per_version` passes, as in
/// a step that runs that many microbatches per update; the medians of the forwards, the
/// backwards and the updates. A backward is timed as the executor runs it: the autodiff
/// pass and the weight gradients added into the step's sums. An update is the optimizer
/// step (`StageOptim::update`), with a learning rate of zero, which costs the same work and
/// keeps the weights at their values. Both counts are rounded up to whole groups. With
/// `split`, each backward runs as a split backward's two halves (the weight gradients of
/// the dense weights put off, then added into the sums: `BackwardInput`, `BackwardWeight`),
/// the weight half timed apart too.
pub(crate) fn time_passes<B: ExecBackend>(
    mut model: StageModel<B>,
    dev: &B::Device,
    optimizer: &pipec_plan::plan::OptimizerPlan,
    (warmup, reps, per_version): (usize, usize, usize),
    (what, reduce, split): (&str, &Reduce, bool),
    mut input: impl FnMut() -> Act<B>,
) -> Result<Passes, ExecError> {
    let (mut fwd, mut bwd, mut wgt, mut upd) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut optim = StageOptim::<B>::new(optimizer, &crate::nn::params::layout::<B, _>(&model), Default::default());
    let mut acc = FlatGrads::<B>::new();
    let per_version = per_version.max(1);
    let (warmup, reps) = (warmup.div_ceil(per_version) * per_version, reps.max(1).div_ceil(per_version) * per_version);
    for r in 0..warmup + reps {
        let x = input();
        // the input made before the clock starts (a GPU queues its kernels)
        let _ = B::sync(dev);
        let t0 = Instant::now();
        let mut side = crate::nn::layers::Collected { mask_key: Some((0, 0, r as u64)), ..Default::default() };
        let y = model.forward(x, true, &mut side)?;
        let s = match reduce {
            Reduce::Sum => sum(&y).ok_or_else(|| ExecError::Shape(format!("{what} produced token ids")))?,
            Reduce::Loss(loss, targets) => crate::interp::compute::loss_of(*loss, y, targets, dev)?,
        };
        // make the forward really run before the clock stops (lazy backends)
        let _ = s.clone().into_scalar();
        let t1 = Instant::now();
        // as the executor runs it: dense weight gradients added into the sums inside the
        // backward, the rest collected and added after
        // (the keys read from the model every pass: an update makes new weights)
        // (split: the dense weights' gradients put off to a weight half timed apart)
        let (mut grads, deferred) = if split {
            let keys = sum_keys(&model);
            let (grads, deferred) = backward_deferring::<B>(&keys, || s.backward());
            (grads, Some((keys, deferred)))
        } else {
            (backward_into_model_sums::<B, _>(&model, &mut acc, || s.backward()), None)
        };
        accumulate::<B>(&mut acc, collect_grads(&model, &mut grads));
        let half = deferred.map(|(keys, deferred)| {
            let _ = B::sync(dev);
            let half = Instant::now();
            add_deferred_into_sums::<B>(&mut acc, &keys, deferred);
            half
        });
        // the backward's kernels run before the clock stops (else the next forward's wait
        // would count them)
        let _ = B::sync(dev);
        let t2 = Instant::now();
        if r >= warmup {
            fwd.push((t1 - t0).as_secs_f64() * 1e3);
            bwd.push((t2 - t1).as_secs_f64() * 1e3);
            wgt.push(half.map_or(0.0, |h| (t2 - h).as_secs_f64() * 1e3));
        }
        if (r + 1) % per_version == 0 {
            let t3 = Instant::now();
            model = optim.update(0.0, model, &std::mem::take(&mut acc), 1.0);
            // make the update really run (lazy backends): read one value of every weight
            sync_weights(&model);
            if r >= warmup {
                upd.push(t3.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    Ok(Passes { forward: median(fwd), backward: median(bwd), weights: median(wgt), update: median(upd) })
}

/// Waits for every weight of `model` (one value each; lazy backends run what they queued).
fn sync_weights<B: ExecBackend>(model: &StageModel<B>) {
    struct Sync;
    impl<B: Backend> burn::module::ModuleVisitor<B> for Sync {
        fn visit_float<const D: usize>(&mut self, param: &burn::module::Param<Tensor<B, D>>) {
            let t = param.val();
            let n = t.shape().num_elements();
            if n > 0 {
                let _ = t.reshape([n]).narrow(0, 0, 1).into_data();
            }
        }
    }
    model.visit(&mut Sync);
}

/// How many forwards a layer's weights serve between two updates on one device: under a
/// flush schedule the microbatches of a step routed to one replica of the layer's stage; one
/// under the asynchronous schedules, which update as often as every microbatch.
pub fn forwards_per_version(plan: &Plan, layer: usize) -> usize {
    if !plan.schedule.synchronous {
        return 1;
    }
    let replicas =
        plan.stages.iter().find(|s| (s.layers[0]..s.layers[1]).contains(&layer)).map_or(1, |s| s.replicas.len().max(1));
    (plan.training.microbatches / replicas).max(1)
}

/// Measures every layer of the plan: `warmup` unmeasured runs, then the median of `reps`;
/// then the whole model once as one graph, and scales the layers' times to add up to it.
pub fn profile_layers<B: ExecBackend>(
    plan: &Plan,
    dev: &B::Device,
    warmup: usize,
    reps: usize,
) -> Result<Profile, ExecError> {
    let mb = plan.training.microbatch_size;
    let precision = 4u64;
    let mut out = Vec::new();
    for (i, layer) in plan.layers.iter().enumerate() {
        let mut model = StageModel::<B>::new(std::slice::from_ref(&layer.op), i, plan.training.seed, dev);
        model.recompute_attention_cores(plan);
        // in a graph model a layer may read several tensors: each gets an input of its shape
        let sources: Vec<Source> = {
            let mut v = layer.operands();
            v.sort();
            v.dedup();
            v
        };
        if plan.layers.iter().any(|l| l.inputs.is_some()) {
            model.graph = Some(StageGraph {
                operands: vec![layer.operands()],
                first: i,
                inputs: sources.clone(),
                outputs: vec![Source::Layer(i)],
            });
        }
        let shapes: Vec<Vec<usize>> = sources
            .iter()
            .map(|s| {
                let per_sample = match *s {
                    Source::Layer(p) => plan.layers.get(p).map(|l| l.output_shape.clone()).unwrap_or_default(),
                    Source::Input => plan.model.input.clone(),
                };
                std::iter::once(mb).chain(per_sample).collect()
            })
            .collect();
        let tokens = if layer.op.takes_token_ids() { plan.model.token_vocab } else { None };
        let params: usize = model.num_params();
        let per_version = forwards_per_version(plan, i);
        let reduce = Reduce::of(plan, i);
        let counts = (warmup, reps, per_version);
        let passes = time_passes(model, dev, &plan.training.optimizer, counts, ("a layer", &reduce, false), || {
            let parts: Vec<Act<B>> = shapes.iter().map(|shape| random_input::<B>(shape, tokens, dev)).collect();
            let x = Act::from_parts(parts);
            if i == 0 {
                x
            } else {
                require_grad(x)
            }
        })?;
        out.push(ProfiledLayer {
            index: i,
            name: layer.op.name().to_string(),
            forward_ms: passes.forward,
            backward_ms: passes.backward,
            update_ms: passes.update,
            activation_bytes: layer.activation_bytes_per_sample * mb as u64,
            output_bytes: layer.output_shape.iter().product::<usize>() as u64 * precision * mb as u64,
            parameter_bytes: params as u64 * precision,
        });
    }
    // Calibrate against the whole model run as one graph: a layer measured alone misses what
    // a long autodiff graph costs (bookkeeping, memory traffic between layers). Scale the
    // layers' times so they add up to the whole model's.
    let all_ops = plan.model_ops();
    let mut whole = StageModel::<B>::new(&all_ops, 0, plan.training.seed, dev);
    whole.recompute_attention_cores(plan);
    whole.graph = crate::interp::stage::stage_graph(plan, 0, plan.layers.len());
    let mut shape = vec![mb];
    shape.extend(&plan.model.input);
    let tokens = plan.model.token_vocab;
    let per_version = forwards_per_version(plan, 0);
    let reduce = Reduce::of(plan, plan.layers.len());
    let counts = (warmup, reps, per_version);
    let whole = time_passes(whole, dev, &plan.training.optimizer, counts, ("the model", &reduce, false), || {
        random_input::<B>(&shape, tokens, dev)
    })?;
    let sums = |f: fn(&ProfiledLayer) -> f64| out.iter().map(f).sum::<f64>();
    let scale = |whole: f64, sum: f64| if whole > 0.0 && sum > 0.0 { whole / sum } else { 1.0 };
    let (sf, sb, su) = (
        scale(whole.forward, sums(|l| l.forward_ms)),
        scale(whole.backward, sums(|l| l.backward_ms)),
        scale(whole.update, sums(|l| l.update_ms)),
    );
    for l in &mut out {
        l.forward_ms *= sf;
        l.backward_ms *= sb;
        l.update_ms *= su;
    }
    Ok(Profile {
        version: 1,
        batch_size: mb,
        backend: std::any::type_name::<B>().rsplit("::").next().unwrap_or("burn").trim_end_matches('>').to_lowercase(),
        layers: out,
    })
}

/// Profiles on the CPU backend.
pub fn profile_cpu(plan: &Plan, warmup: usize, reps: usize) -> Result<Profile, ExecError> {
    profile_cpu_concurrent(plan, 1, warmup, reps)
}

/// Profiles on the CPU backend with `threads` copies of the measurement running at once,
/// each on its own thread, and averages their times: on the CPU every device of a plan is
/// a worker thread of one process, so its layers run while the other workers load the same
/// cores, caches and memory bus — this measures them under that load.
pub fn profile_cpu_concurrent(plan: &Plan, threads: usize, warmup: usize, reps: usize) -> Result<Profile, ExecError> {
    type B = burn::backend::Autodiff<burn::backend::Flex>;
    let threads = threads.max(1);
    if threads == 1 {
        return profile_layers::<B>(plan, &Default::default(), warmup, reps);
    }
    let barrier = std::sync::Barrier::new(threads);
    let results: Vec<Result<Profile, ExecError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|i| {
                let barrier = &barrier;
                s.spawn(move || {
                    // each on a core of its own, as the run's workers are (`super::affinity`)
                    super::affinity::pin(i, threads);
                    barrier.wait();
                    profile_layers::<B>(plan, &Default::default(), warmup, reps)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(ExecError::Panic("a profiling thread panicked".into()))))
            .collect()
    });
    let profiles: Vec<Profile> = results.into_iter().collect::<Result<_, _>>()?;
    let mut out = profiles[0].clone();
    let n = profiles.len() as f64;
    for (i, layer) in out.layers.iter_mut().enumerate() {
        layer.forward_ms = profiles.iter().map(|p| p.layers[i].forward_ms).sum::<f64>() / n;
        layer.backward_ms = profiles.iter().map(|p| p.layers[i].backward_ms).sum::<f64>() / n;
        layer.update_ms = profiles.iter().map(|p| p.layers[i].update_ms).sum::<f64>() / n;
    }
    Ok(out)
}

/// Profiles on the CUDA backend.
#[cfg(feature = "cuda")]
pub fn profile_cuda(plan: &Plan, warmup: usize, reps: usize) -> Result<Profile, ExecError> {
    type B = burn::backend::Autodiff<burn::backend::Cuda>;
    profile_layers::<B>(plan, &burn::backend::cuda::CudaDevice::new(0), warmup, reps)
}
