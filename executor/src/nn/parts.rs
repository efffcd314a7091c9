//! The pieces every layer family shares: activations, a stage's graph wiring, deterministic
//! parameters, the dense product and the norms, and what a forward collects beside its
//! output.

use burn::module::{Module, Param, ParamId};
use burn::prelude::*;
use pipec_plan::model::{NormKind, Source};

use crate::backend::kernels::Kernels;
use crate::backend::rng::Rng;
use crate::error::{ExecError, Result};

/// An activation flowing between layers: its rank varies along the model.
#[derive(Debug, Clone)]
pub enum Act<B: Backend> {
    /// Token ids [batch, seq].
    Tokens(Tensor<B, 2, Int>),
    D2(Tensor<B, 2>),
    D3(Tensor<B, 3>),
    D4(Tensor<B, 4>),
    /// Several tensors crossing one stage boundary together (a graph model's boundary:
    /// `pipec_plan::model::crossing`), in that order.
    Bundle(Vec<Act<B>>),
}

impl<B: Backend> Act<B> {
    /// The device of each tensor it carries.
    pub fn devices(&self) -> Vec<B::Device> {
        match self {
            Act::Tokens(t) => vec![t.device()],
            Act::D2(t) => vec![t.device()],
            Act::D3(t) => vec![t.device()],
            Act::D4(t) => vec![t.device()],
            Act::Bundle(parts) => parts.iter().flat_map(Act::devices).collect(),
        }
    }

    pub fn dims(&self) -> Vec<usize> {
        match self {
            Act::Tokens(t) => t.dims().to_vec(),
            Act::D2(t) => t.dims().to_vec(),
            Act::D3(t) => t.dims().to_vec(),
            Act::D4(t) => t.dims().to_vec(),
            Act::Bundle(parts) => parts.first().map(Act::dims).unwrap_or_default(),
        }
    }

    /// The tensors it carries: itself, or a bundle's parts.
    pub fn parts(self) -> Vec<Act<B>> {
        match self {
            Act::Bundle(parts) => parts,
            one => vec![one],
        }
    }

    /// One tensor as itself, several as a bundle.
    pub fn from_parts(mut parts: Vec<Act<B>>) -> Self {
        if parts.len() == 1 {
            parts.remove(0)
        } else {
            Act::Bundle(parts)
        }
    }
}

/// A stage of a graph model: which tensors each layer reads, which arrive at the stage
/// and which leave it (`pipec_plan::model::crossing` at its two ends).
#[derive(Debug, Clone)]
pub struct StageGraph {
    /// Per layer of the stage, its operands (model-wide sources).
    pub operands: Vec<Vec<Source>>,
    /// The global index of the stage's first layer.
    pub first: usize,
    /// What the stage receives, in order (the model's input on the first stage).
    pub inputs: Vec<Source>,
    /// What the stage sends on, in order (the model's output on the last stage).
    pub outputs: Vec<Source>,
}

pub(crate) fn param<B: Backend, const D: usize>(
    id: u64,
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Param<Tensor<B, D>> {
    Param::initialized(ParamId::from(id), Tensor::from_data(TensorData::new(values, shape), device).require_grad())
}

/// Deterministic parameter ids: layer index and slot, so checkpoints and optimizer state are
/// portable between layouts.
pub(crate) use pipec_plan::checkpoint::param_id as pid;

/// The deterministic initial table of embedding layer `index` ([vocab, dim], row-major):
/// normal with standard deviation 1/√dim — the scale of the dense layers' weights, so a
/// token's embedding is not drowned by the blocks' outputs, and a tied output projection's
/// first scores have unit scale (GPT-2's 0.02 at its d = 768 is about the same); an output
/// projection tied to it starts from its transpose.
pub(crate) fn embedding_values(index: usize, seed: u64, vocab: usize, dim: usize) -> Vec<f32> {
    let std = 1.0 / (dim.max(1) as f32).sqrt();
    Rng::keyed(&[seed, 10, index as u64, 0]).normal_vec(vocab * dim).into_iter().map(|v| std * v).collect()
}

pub(crate) use pipec_plan::hf::transpose;

/// A dense projection (weight [in, out], optional bias).
#[derive(Module, Debug)]
pub struct Dense<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
}

/// The deterministic initial weight values of a dense projection ([in, out], row-major).
pub(crate) fn dense_values(layer: usize, slot: u64, seed: u64, fan_in: usize, fan_out: usize, gain: f64) -> Vec<f32> {
    let k = (gain * 3.0 / fan_in as f64).sqrt();
    let mut rng = Rng::keyed(&[seed, 10, layer as u64, slot]);
    rng.uniform_vec(fan_in * fan_out, k)
}

impl<B: Kernels> Dense<B> {
    // the layer's identity (index, slot, seed) keys its initial weights; the rest is its shape
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        layer: usize,
        slot: u64,
        seed: u64,
        fan_in: usize,
        fan_out: usize,
        bias: bool,
        gain: f64,
        device: &B::Device,
    ) -> Self {
        Dense {
            weight: param(
                pid(layer, slot),
                dense_values(layer, slot, seed, fan_in, fan_out, gain),
                [fan_in, fan_out],
                device,
            ),
            bias: bias.then(|| param(pid(layer, slot + 1), vec![0.0; fan_out], [fan_out], device)),
        }
    }

    /// A dense projection from explicit values (a tensor-parallel shard).
    pub(crate) fn from_values(
        layer: usize,
        slot: u64,
        weight: Vec<f32>,
        shape: [usize; 2],
        bias: Option<Vec<f32>>,
        device: &B::Device,
    ) -> Self {
        Dense {
            weight: param(pid(layer, slot), weight, shape, device),
            bias: bias.map(|b| {
                let n = b.len();
                param(pid(layer, slot + 1), b, [n], device)
            }),
        }
    }

    /// x · W without the bias (a row-parallel partial sum).
    pub(crate) fn matmul_only(&self, x: Act<B>) -> Result<Act<B>> {
        Ok(match x {
            Act::D2(t) => Act::D2(B::dense(t, self.weight.val())),
            Act::D3(t) => {
                let [b, s, d] = t.dims();
                let y = B::dense(t.reshape([b * s, d]), self.weight.val());
                let out = y.dims()[1];
                Act::D3(y.reshape([b, s, out]))
            }
            other => return Err(ExecError::Shape(format!("a linear layer cannot take {:?}", other.dims()))),
        })
    }

    /// Adds the bias (after a row-parallel all-reduce).
    pub(crate) fn add_bias(&self, y: Act<B>) -> Act<B> {
        match (&self.bias, y) {
            (Some(b), Act::D2(t)) => Act::D2(t + b.val().unsqueeze::<2>()),
            (Some(b), Act::D3(t)) => Act::D3(t + b.val().unsqueeze::<3>()),
            (_, y) => y,
        }
    }

    pub(crate) fn forward_act(&self, x: Act<B>) -> Result<Act<B>> {
        Ok(match x {
            Act::D2(t) => Act::D2(self.forward2(t)),
            Act::D3(t) => Act::D3(self.forward3(t)),
            other => return Err(ExecError::Shape(format!("a linear layer cannot take {:?}", other.dims()))),
        })
    }

    pub(crate) fn forward2(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let y = B::dense(x, self.weight.val());
        match &self.bias {
            Some(b) => y + b.val().unsqueeze::<2>(),
            None => y,
        }
    }

    pub(crate) fn forward3(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let y = self.forward2(x.reshape([b * s, d]));
        let out = y.dims()[1];
        y.reshape([b, s, out])
    }
}

/// Normalisation over the last dimension: layer normalisation (a gain and a bias) or, with
/// no bias, RMSNorm (scaled only: x / √(mean(x²) + ε) · gain).
#[derive(Module, Debug)]
pub struct Norm<B: Backend> {
    pub gamma: Param<Tensor<B, 1>>,
    /// The layer norm's bias; None for RMSNorm.
    pub beta: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: Kernels> Norm<B> {
    /// A norm of `kind`: its gain in `slot`, a layer norm's bias in `slot + 1`.
    pub(crate) fn of(kind: NormKind, layer: usize, slot: u64, dim: usize, eps: f64, device: &B::Device) -> Self {
        Norm {
            gamma: param(pid(layer, slot), vec![1.0; dim], [dim], device),
            beta: (kind == NormKind::LayerNorm).then(|| param(pid(layer, slot + 1), vec![0.0; dim], [dim], device)),
            eps,
        }
    }

    pub(crate) fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        crate::backend::kernels::row_norm(x, self.gamma.val(), self.beta.as_ref().map(|b| b.val()), self.eps)
    }
}

/// RMSNorm over the last dimension of `x` with the gains `gain`: x / √(mean(x²) + ε) · gain
/// (a [`Norm`]'s without a bias; multi-head latent attention's latents').
pub(crate) fn rms_norm<B: Kernels, const D: usize>(x: Tensor<B, D>, gain: Tensor<B, 1>, eps: f64) -> Tensor<B, D> {
    crate::backend::kernels::row_norm(x, gain, None, eps)
}

/// What a stage's forward collects beside its output.
#[derive(Debug)]
pub struct Collected<B: Backend> {
    /// Batch normalisation's batch statistics, in layer order (training only).
    pub stats: Vec<Tensor<B, 1>>,
    /// The mixture-of-experts blocks' load-balancing losses, weighted and summed (training,
    /// blocks with `aux_loss` > 0 only).
    pub aux: Option<Tensor<B, 1>>,
    /// Per mixture-of-experts block, its layer and the tokens each of its experts took.
    pub expert_tokens: Vec<(usize, Vec<u64>)>,
    /// Expert parallelism: the stage's group, with which the blocks exchange tokens.
    pub experts: Option<crate::backend::port::PeerGroup>,
    /// Context parallelism: the stage's group, whose keys and values attention gathers,
    /// and this member's positions.
    pub context: Option<crate::nn::context::Context>,
    /// Training: the microbatch's dropout key, its step and number in the step (the same at
    /// its recompute); None while evaluating, when nothing is dropped.
    pub mask_key: Option<(u64, u64, u64)>,
}

impl<B: Backend> Default for Collected<B> {
    fn default() -> Self {
        Collected {
            stats: Vec::new(),
            aux: None,
            expert_tokens: Vec::new(),
            experts: None,
            context: None,
            mask_key: None,
        }
    }
}
