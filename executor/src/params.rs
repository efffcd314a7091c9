//! A stage's parameters and gradients as plain values: what the interpreter moves between a
//! Burn module and the host (all-reduce, parameter server, checkpoints). Every visitor here
//! walks parameters in Burn's visiting order, which is the same on every device that holds
//! the stage.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::prelude::*;
use burn::tensor::backend::AutodiffBackend;

use crate::error::{ExecError, Result};

/// A stage's weight gradients, one flat tensor per parameter (None: no gradient yet).
pub(crate) type FlatGrads<B> = Vec<Option<Tensor<<B as AutodiffBackend>::InnerBackend, 1>>>;

/// One parameter: its id, shape and values.
pub(crate) type ParamValue = (ParamId, Vec<usize>, Vec<f32>);

/// A tensor's values on the host as f32 (what crosses a stage boundary or a collective).
pub(crate) fn host_f32(data: TensorData) -> Result<Vec<f32>> {
    data.convert::<f32>().into_vec::<f32>().map_err(|e| ExecError::Backend(format!("cannot read a tensor back: {e:?}")))
}

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

/// The present gradients of `acc`, concatenated in parameter order (what an all-reduce or a
/// push to the parameter server moves).
pub(crate) fn flatten_grads<B: AutodiffBackend>(acc: &[Option<Tensor<B::InnerBackend, 1>>]) -> Result<Vec<f32>> {
    let mut flat = Vec::new();
    for t in acc.iter().flatten() {
        flat.extend(host_f32(t.clone().into_data())?);
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
