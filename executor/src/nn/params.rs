//! A stage's parameters and gradients as plain values: what the interpreter moves between a
//! Burn module and the host (all-reduce, parameter server, checkpoints). Every visitor here
//! walks parameters in Burn's visiting order, which is the same on every device that holds
//! the stage.

use burn::backend::autodiff::NodeId;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::TensorPrimitive;

use crate::backend::dense::{add_deferred, with_deferred_weight_gradients, with_gradient_sums, Deferred, Sums};

use crate::error::{ExecError, Result};

/// A stage's weight gradients, one flat tensor per parameter (None: no gradient yet).
pub(crate) type FlatGrads<B> = Vec<Option<Tensor<<B as AutodiffBackend>::InnerBackend, 1>>>;

/// One parameter: its id, shape and values.
pub(crate) type ParamValue = (ParamId, Vec<usize>, Vec<f32>);

pub(crate) use crate::backend::port::host_f32;

/// Takes every parameter's gradient out of `grads`, flattened, in visiting order.
pub(crate) fn collect_grads<B: AutodiffBackend, M: Module<B>>(model: &M, grads: &mut B::Gradients) -> FlatGrads<B> {
    struct Collect<'a, B: AutodiffBackend> {
        grads: &'a mut B::Gradients,
        out: FlatGrads<B>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let g = param.val().grad_remove(self.grads).map(|g| {
                let n = g.shape().num_elements();
                g.reshape([n])
            });
            self.out.push(g);
        }
    }
    let mut c = Collect::<B> { grads, out: Vec::new() };
    model.visit(&mut c);
    c.out
}

/// Every parameter's key for in-place gradient sums ([`crate::backend::kernels::Kernels::sum_key`]), in
/// visiting order (the order of [`collect_grads`]).
pub(crate) fn sum_keys<B: crate::backend::kernels::ExecBackend, M: Module<B>>(model: &M) -> Vec<Option<NodeId>> {
    struct Keys(Vec<Option<NodeId>>);
    impl<B: crate::backend::kernels::ExecBackend> ModuleVisitor<B> for Keys {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(B::sum_key(&param.val().into_primitive().tensor()));
        }
    }
    let mut keys = Keys(Vec::new());
    model.visit(&mut keys);
    keys.0
}

/// Runs `backward` with the running sums in `acc` of the parameters keyed in `keys` lent to
/// the dense products ([`with_gradient_sums`]): their weight gradients are added into `acc`
/// inside the backward, and Burn's gradients returned hold the rest.
pub(crate) fn backward_into_sums<B: crate::backend::kernels::ExecBackend>(
    acc: &mut FlatGrads<B>,
    keys: &[Option<NodeId>],
    backward: impl FnOnce() -> B::Gradients,
) -> B::Gradients {
    let sums = lend_sums::<B>(acc, keys);
    let (grads, sums) = with_gradient_sums::<B::InnerBackend, _>(sums, backward);
    return_sums::<B>(acc, keys, sums);
    grads
}

/// [`backward_into_sums`] with the keys of `model`'s parameters read now: an update makes
/// new weights, and keys read before it reach none of them (their gradients would be made
/// apart and added after, as no step does).
pub(crate) fn backward_into_model_sums<B: crate::backend::kernels::ExecBackend, M: Module<B>>(
    model: &M,
    acc: &mut FlatGrads<B>,
    backward: impl FnOnce() -> B::Gradients,
) -> B::Gradients {
    backward_into_sums::<B>(acc, &sum_keys(model), backward)
}

/// The input half of a split backward: runs `backward` with the weight gradients of the
/// parameters keyed in `keys` put off ([`with_deferred_weight_gradients`]); Burn's
/// gradients returned hold the rest. [`add_deferred_into_sums`] is the weight half.
pub(crate) fn backward_deferring<B: crate::backend::kernels::ExecBackend>(
    keys: &[Option<NodeId>],
    backward: impl FnOnce() -> B::Gradients,
) -> (B::Gradients, Deferred<B::InnerBackend>) {
    with_deferred_weight_gradients::<B::InnerBackend, _>(keys.iter().flatten().copied(), backward)
}

/// The weight half of a split backward: adds the gradients [`backward_deferring`] put off
/// into the running sums in `acc` (the same products and sums as [`backward_into_sums`]).
pub(crate) fn add_deferred_into_sums<B: crate::backend::kernels::ExecBackend>(
    acc: &mut FlatGrads<B>,
    keys: &[Option<NodeId>],
    deferred: Deferred<B::InnerBackend>,
) {
    let sums = lend_sums::<B>(acc, keys);
    let sums = add_deferred::<B::InnerBackend>(sums, deferred);
    return_sums::<B>(acc, keys, sums);
}

/// Moves the running sums of the keyed parameters out of `acc` (flat, in visiting order)
/// for a backward to add into.
fn lend_sums<B: AutodiffBackend>(acc: &mut FlatGrads<B>, keys: &[Option<NodeId>]) -> Sums<B::InnerBackend> {
    if acc.len() < keys.len() {
        acc.resize(keys.len(), None);
    }
    let mut sums = Sums::<B::InnerBackend>::new();
    for (a, key) in acc.iter_mut().zip(keys) {
        if let Some(key) = key {
            sums.insert(*key, a.take().map(|t| t.into_primitive().tensor()));
        }
    }
    sums
}

/// Puts the sums back into `acc`, flat (the inverse of [`lend_sums`]).
fn return_sums<B: AutodiffBackend>(acc: &mut FlatGrads<B>, keys: &[Option<NodeId>], mut sums: Sums<B::InnerBackend>) {
    for (a, key) in acc.iter_mut().zip(keys) {
        if let Some(sum) = key.and_then(|k| sums.remove(&k)).flatten() {
            let t = Tensor::<B::InnerBackend, 2>::from_primitive(TensorPrimitive::Float(sum));
            let n = t.shape().num_elements();
            *a = Some(t.reshape([n]));
        }
    }
}

/// The optimizer's view of flat gradients: each one reshaped to its parameter and scaled.
pub(crate) fn to_optimizer_grads<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    flat: &[Option<Tensor<B::InnerBackend, 1>>],
    scale: f64,
) -> GradientsParams {
    struct Register<'a, B: AutodiffBackend> {
        flat: &'a [Option<Tensor<B::InnerBackend, 1>>],
        scale: f64,
        next: usize,
        out: GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(Some(g)) = self.flat.get(self.next) {
                let shaped: Tensor<B::InnerBackend, D> = g.clone().reshape(param.shape());
                let shaped = if self.scale == 1.0 { shaped } else { shaped * self.scale };
                self.out.register::<B::InnerBackend, D>(param.id, shaped);
            }
            self.next += 1;
        }
    }
    let mut reg = Register::<B> { flat, scale, next: 0, out: GradientsParams::new() };
    model.visit(&mut reg);
    reg.out
}

/// Adds `flat` into `acc`, parameter by parameter.
pub(crate) fn accumulate<B: AutodiffBackend>(acc: &mut FlatGrads<B>, flat: FlatGrads<B>) {
    if acc.len() < flat.len() {
        acc.resize(flat.len(), None);
    }
    for (a, g) in acc.iter_mut().zip(flat) {
        *a = match (a.take(), g) {
            (Some(x), Some(y)) => Some(x + y),
            (x, None) => x,
            (None, y) => y,
        };
    }
}

/// Rounds every accumulated gradient of `acc` to `precision` (nothing for fp32): gradients
/// accumulated in the plan's `grad_precision`, as Megatron-LM's bf16 main grads are without
/// `accumulate_allreduce_grads_in_fp32`.
pub(crate) fn round_grads<B: AutodiffBackend>(acc: &mut FlatGrads<B>, precision: pipec_plan::Precision) {
    let dtype = match precision {
        pipec_plan::Precision::Fp32 => return,
        pipec_plan::Precision::Bf16 => burn::tensor::FloatDType::BF16,
        pipec_plan::Precision::Fp16 => burn::tensor::FloatDType::F16,
    };
    for g in acc.iter_mut() {
        *g = g.take().map(|t| t.cast(dtype).cast(burn::tensor::FloatDType::F32));
    }
}

/// The gradients of `acc`, concatenated over every parameter in visiting order (`sizes`:
/// each one's values) — what an all-reduce or a push to the parameter server moves.
pub(crate) fn flatten_grads<B: AutodiffBackend>(
    acc: &[Option<Tensor<B::InnerBackend, 1>>],
    sizes: &[usize],
) -> Result<Vec<f32>> {
    if acc.len() > sizes.len() {
        return Err(ExecError::Plan(format!("{} gradients for {} parameters", acc.len(), sizes.len())));
    }
    let mut flat = Vec::with_capacity(sizes.iter().sum());
    for (k, &n) in sizes.iter().enumerate() {
        match acc.get(k) {
            Some(Some(t)) => {
                let values = host_f32(t.clone().into_data())?;
                if values.len() != n {
                    return Err(ExecError::Plan(format!(
                        "a gradient of {} values for a parameter of {n}",
                        values.len()
                    )));
                }
                flat.extend(values);
            }
            // no microbatch reached it (an expert no token chose, or one another member of
            // an expert-parallel group computes): zeros, so that what members sum lines up
            _ => flat.resize(flat.len() + n, 0.0),
        }
    }
    Ok(flat)
}

/// Cuts `flat` back into one tensor per length in `sizes` (the inverse of `flatten_grads`).
pub(crate) fn unflatten<B: Backend>(flat: &[f32], sizes: &[usize], dev: &B::Device) -> Result<Vec<Tensor<B, 1>>> {
    let total: usize = sizes.iter().sum();
    if total != flat.len() {
        return Err(ExecError::Plan(format!("{} values for {} parameter value(s)", flat.len(), total)));
    }
    let mut offset = 0;
    Ok(sizes
        .iter()
        .map(|&n| {
            let t = Tensor::from_data(TensorData::new(flat[offset..offset + n].to_vec(), [n]), dev);
            offset += n;
            t
        })
        .collect())
}

/// Parameter ids and values of a model, in visiting order (for checkpoints and the
/// parameter server); the first parameter whose values could not be read back is an
/// error, never an empty tensor.
pub(crate) fn snapshot<B: Backend, M: Module<B>>(m: &M) -> Result<Vec<ParamValue>> {
    struct Snapshot {
        params: Vec<ParamValue>,
        error: Option<ExecError>,
    }
    impl<B: Backend> ModuleVisitor<B> for Snapshot {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let t = param.val();
            match host_f32(t.clone().into_data()) {
                Ok(values) => self.params.push((param.id, t.dims().to_vec(), values)),
                Err(e) => {
                    self.error.get_or_insert(ExecError::Backend(format!("parameter {}: {e}", param.id)));
                }
            }
        }
    }
    let mut s = Snapshot { params: Vec::new(), error: None };
    m.visit(&mut s);
    match s.error {
        Some(e) => Err(e),
        None => Ok(s.params),
    }
}

/// Every parameter's (id, shape), in visiting order.
pub(crate) fn layout<B: Backend, M: Module<B>>(m: &M) -> Vec<(u64, Vec<usize>)> {
    struct Layout(Vec<(u64, Vec<usize>)>);
    impl<B: Backend> ModuleVisitor<B> for Layout {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id.val(), param.val().dims().to_vec()));
        }
    }
    let mut l = Layout(Vec::new());
    m.visit(&mut l);
    l.0
}

/// Replaces every parameter of `model` with the values `source` gives for its (id, shape);
/// returns the model and the ids `source` had nothing for (those keep their values). The
/// one parameter mapper of the executor: checkpoints look values up by id, the parameter
/// server hands them out in visiting order.
pub(crate) fn set_params<B: Backend, M: Module<B>>(
    model: M,
    source: impl FnMut(u64, &[usize]) -> Option<Vec<f32>>,
) -> (M, Vec<u64>) {
    struct Set<F> {
        source: F,
        missing: Vec<u64>,
    }
    impl<B: Backend, F: FnMut(u64, &[usize]) -> Option<Vec<f32>>> ModuleMapper<B> for Set<F> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, _) = param.consume();
            let shape = tensor.dims();
            match (self.source)(id.val(), &shape) {
                Some(v) if v.len() == shape.iter().product::<usize>() => {
                    let t =
                        Tensor::<B, D>::from_data(TensorData::new(v, shape.to_vec()), &tensor.device()).require_grad();
                    Param::initialized(id, t)
                }
                _ => {
                    self.missing.push(id.val());
                    Param::initialized(id, tensor)
                }
            }
        }
    }
    let mut set = Set { source, missing: Vec::new() };
    let model = model.map(&mut set);
    (model, set.missing)
}

/// Replaces every parameter of `model` with the (shape, values) `source` gives for its id —
/// or, where it gives none, with a one-value stand-in (ZeRO-3 drops a stage's weights
/// between steps this way); returns the model and the ids given none.
pub(crate) fn replace_params<B: Backend, M: Module<B>>(
    model: M,
    source: impl FnMut(u64) -> Option<(Vec<usize>, Vec<f32>)>,
) -> (M, Vec<u64>) {
    struct Replace<F> {
        source: F,
        missing: Vec<u64>,
    }
    impl<B: Backend, F: FnMut(u64) -> Option<(Vec<usize>, Vec<f32>)>> ModuleMapper<B> for Replace<F> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, _) = param.consume();
            let device = tensor.device();
            drop(tensor);
            let t = match (self.source)(id.val()) {
                Some((shape, v)) if shape.len() == D && v.len() == shape.iter().product::<usize>() => {
                    Tensor::<B, D>::from_data(TensorData::new(v, shape), &device)
                }
                _ => {
                    self.missing.push(id.val());
                    Tensor::<B, D>::zeros([1; D], &device)
                }
            };
            Param::initialized(id, t.require_grad())
        }
    }
    let mut replace = Replace { source, missing: Vec::new() };
    let model = model.map(&mut replace);
    (model, replace.missing)
}

/// `model` with one-value stand-ins (`[1; D]`, tracked) for the parameters `ids` names that
/// hold more than one value; the others as they are.
pub(crate) fn stand_ins<B: Backend, M: Module<B>>(model: M, ids: &std::collections::HashSet<u64>) -> M {
    struct StandIn<'a>(&'a std::collections::HashSet<u64>);
    impl<B: Backend> ModuleMapper<B> for StandIn<'_> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            if !self.0.contains(&param.id.val()) || param.shape().num_elements() <= 1 {
                return param;
            }
            let (id, tensor, _) = param.consume();
            let device = tensor.device();
            drop(tensor);
            Param::initialized(id, Tensor::<B, D>::zeros([1; D], &device).require_grad())
        }
    }
    model.map(&mut StandIn(ids))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::kernels::Kernels;
    use burn::module::Module;
    use burn::tensor::Distribution;

    type B = crate::backend::CpuBackend;

    #[derive(Module, Debug)]
    struct Two<B: Backend> {
        w1: Param<Tensor<B, 2>>,
        bias: Param<Tensor<B, 1>>,
        w2: Param<Tensor<B, 2>>,
    }

    fn random<const D: usize>(shape: [usize; D], seed: u64) -> Tensor<B, D> {
        <B as Backend>::seed(&Default::default(), seed);
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &Default::default())
    }

    fn loss(m: &Two<B>, x: Tensor<B, 2>) -> Tensor<B, 1> {
        let h = burn::tensor::activation::relu(B::dense(x, m.w1.val()) + m.bias.val().unsqueeze());
        B::dense(h, m.w2.val()).sum()
    }

    /// A model of `inner` inputs, `hidden` units and 8 outputs, its weights, bias and
    /// weights drawn with seeds `seed`, `seed + 1` and `seed + 2`.
    fn two((inner, hidden): (usize, usize), seed: u64) -> Two<B> {
        Two::<B> {
            w1: Param::from_tensor(random([inner, hidden], seed).require_grad()),
            bias: Param::from_tensor(random([hidden], seed + 1).require_grad()),
            w2: Param::from_tensor(random([hidden, 8], seed + 2).require_grad()),
        }
    }

    fn values(acc: &FlatGrads<B>) -> Vec<Vec<f32>> {
        acc.iter().map(|g| g.clone().expect("a gradient").into_data().to_vec::<f32>().expect("f32")).collect()
    }

    /// Two microbatches' gradients summed the usual way (each backward's gradients added into
    /// the sums) and with the dense weights' gradients added inside the backward: the same
    /// sums, and the second way really bypasses Burn's gradients for those weights.
    #[test]
    fn gradients_summed_inside_the_backward_equal_the_usual_sums() {
        let m = two((24, 40), 1);
        let xs = [random([16, 24], 4), random([16, 24], 5)];
        let mut usual: FlatGrads<B> = Vec::new();
        for x in &xs {
            accumulate::<B>(&mut usual, collect_grads(&m, &mut loss(&m, x.clone()).backward()));
        }
        let keys = sum_keys(&m);
        assert!(keys.iter().all(Option::is_some), "every parameter of an autodiff model has a key");
        let mut inside: FlatGrads<B> = Vec::new();
        for x in &xs {
            let mut grads = backward_into_sums::<B>(&mut inside, &keys, || loss(&m, x.clone()).backward());
            let rest = collect_grads(&m, &mut grads);
            // the weights' gradients went into the sums, the bias's through Burn's gradients
            assert!(rest[0].is_none() && rest[2].is_none(), "the dense weights' gradients bypass Burn's");
            assert!(rest[1].is_some(), "the bias's gradient is Burn's");
            accumulate::<B>(&mut inside, rest);
        }
        for (i, (a, b)) in values(&usual).iter().zip(values(&inside)).enumerate() {
            let scale = a.iter().fold(1e-6f32, |s, v| s.max(v.abs()));
            assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-6 * scale), "parameter {i}");
        }
        // with nothing installed, the backward hands every gradient to Burn's
        let all = collect_grads(&m, &mut loss(&m, xs[0].clone()).backward());
        assert!(all.iter().all(Option::is_some));
    }

    /// Keys read before an update reach none of the new weights: their gradients come
    /// back through Burn's, made apart; read from the updated model
    /// ([`backward_into_model_sums`], which `pipec profile` and `pipec calibrate` time a
    /// pass with) they go into the sums.
    #[test]
    fn the_sums_reach_the_weights_an_update_made() {
        let m = two((24, 40), 31);
        let stale = sum_keys(&m);
        // an update: new weight tensors
        let updated = two((24, 40), 35);
        let x = random([16, 24], 34);
        let mut acc: FlatGrads<B> = Vec::new();
        let mut grads = backward_into_sums::<B>(&mut acc, &stale, || loss(&updated, x.clone()).backward());
        let rest = collect_grads(&updated, &mut grads);
        assert!(rest[0].is_some() && rest[2].is_some(), "stale keys: the weights' gradients made apart");
        let mut acc: FlatGrads<B> = Vec::new();
        let mut grads = backward_into_model_sums::<B, _>(&updated, &mut acc, || loss(&updated, x.clone()).backward());
        let rest = collect_grads(&updated, &mut grads);
        assert!(rest[0].is_none() && rest[2].is_none(), "the updated weights' gradients went into the sums");
    }

    /// A split backward (zero-bubble's `BackwardInput` then `BackwardWeight`): the input
    /// half leaves the dense weights' sums alone and keeps their operands, the weight half
    /// adds them; the sums and the input gradient are the whole backward's bit for bit (two
    /// sizes, the second large enough for the transposed forward copies).
    #[test]
    fn a_split_backward_gives_the_whole_backwards_sums_bit_for_bit() {
        for (rows, inner, hidden) in [(16, 24, 40), (32, 64, 256)] {
            let m = two((inner, hidden), 21);
            let xs = [random([rows, inner], 24).require_grad(), random([rows, inner], 25).require_grad()];
            let keys = sum_keys(&m);
            let (mut whole, mut split): (FlatGrads<B>, FlatGrads<B>) = (Vec::new(), Vec::new());
            for x in &xs {
                let mut grads = backward_into_sums::<B>(&mut whole, &keys, || loss(&m, x.clone()).backward());
                let dx_whole = x.grad_remove(&mut grads).expect("an input gradient").into_data();
                accumulate::<B>(&mut whole, collect_grads(&m, &mut grads));

                let before = split.iter().map(|g| g.as_ref().map(|t| t.clone().into_data())).collect::<Vec<_>>();
                let (mut grads, deferred) = backward_deferring::<B>(&keys, || loss(&m, x.clone()).backward());
                assert_eq!(deferred.len(), 2, "both dense weights' products wait for the weight half");
                let dx_split = x.grad_remove(&mut grads).expect("an input gradient").into_data();
                assert_eq!(dx_split, dx_whole, "{rows} × {inner}: the input gradient is the whole backward's");
                let rest = collect_grads(&m, &mut grads);
                assert!(rest[0].is_none() && rest[2].is_none() && rest[1].is_some(), "only the bias's is Burn's");
                let after = split.iter().map(|g| g.as_ref().map(|t| t.clone().into_data())).collect::<Vec<_>>();
                assert_eq!(before, after, "the input half leaves the sums alone");
                add_deferred_into_sums::<B>(&mut split, &keys, deferred);
                accumulate::<B>(&mut split, rest);
            }
            for (i, (a, b)) in values(&whole).iter().zip(values(&split)).enumerate() {
                assert_eq!(a, &b, "{rows} × {inner}: parameter {i}");
            }
        }
    }

    #[derive(Module, Debug)]
    struct Convs<B: Backend> {
        w1: Param<Tensor<B, 4>>,
        bias: Param<Tensor<B, 1>>,
        w2: Param<Tensor<B, 4>>,
    }

    fn conv_loss(m: &Convs<B>, x: Tensor<B, 4>) -> Tensor<B, 1> {
        use crate::backend::kernels::conv2d;
        let same = burn::tensor::ops::ConvOptions::new([1, 1], [1, 1], [1, 1], 1);
        let strided = burn::tensor::ops::ConvOptions::new([2, 2], [0, 0], [1, 1], 1);
        let h = burn::tensor::activation::relu(conv2d(x, m.w1.val(), Some(m.bias.val()), same));
        conv2d(h, m.w2.val(), None, strided).sum()
    }

    /// The same for convolutions: the input half of a split backward keeps both weights'
    /// operands (not the bias's gradient, which is Burn's) and computes the input gradient
    /// alone; the weight half adds their gradients. The sums and the input gradient are the
    /// whole backward's bit for bit.
    #[test]
    fn a_split_backward_of_convolutions_gives_the_whole_backwards_sums_bit_for_bit() {
        let m = Convs::<B> {
            w1: Param::from_tensor(random([6, 3, 3, 3], 31).require_grad()),
            bias: Param::from_tensor(random([6], 32).require_grad()),
            w2: Param::from_tensor(random([4, 6, 2, 2], 33).require_grad()),
        };
        let xs = [random([2, 3, 9, 9], 34).require_grad(), random([2, 3, 9, 9], 35).require_grad()];
        let keys = sum_keys(&m);
        let (mut whole, mut split): (FlatGrads<B>, FlatGrads<B>) = (Vec::new(), Vec::new());
        for x in &xs {
            let mut grads = backward_into_sums::<B>(&mut whole, &keys, || conv_loss(&m, x.clone()).backward());
            let dx_whole = x.grad_remove(&mut grads).expect("an input gradient").into_data();
            accumulate::<B>(&mut whole, collect_grads(&m, &mut grads));

            let (mut grads, deferred) = backward_deferring::<B>(&keys, || conv_loss(&m, x.clone()).backward());
            assert_eq!(deferred.len(), 2, "both convolutions' weight gradients wait for the weight half");
            let dx_split = x.grad_remove(&mut grads).expect("an input gradient").into_data();
            assert_eq!(dx_split, dx_whole, "the input gradient is the whole backward's");
            let rest = collect_grads(&m, &mut grads);
            assert!(rest[0].is_none() && rest[2].is_none() && rest[1].is_some(), "only the bias's is Burn's");
            add_deferred_into_sums::<B>(&mut split, &keys, deferred);
            accumulate::<B>(&mut split, rest);
        }
        for (i, (a, b)) in values(&whole).iter().zip(values(&split)).enumerate() {
            assert_eq!(a, &b, "parameter {i}");
        }
    }
}
