//! What a worker holds between instructions: activations (on the device, and as host
//! messages for the wire), what a forward keeps for its backward, and a backward's weight
//! gradients not yet summed.

use burn::backend::autodiff::NodeId;
use burn::module::{Module, ModuleMapper, Param};
use burn::prelude::*;

use crate::backend::dense::Deferred;
use crate::backend::kernels::ExecBackend;
use crate::comm::transport::{Message, Tag};
use crate::error::{ExecError, Result};
use crate::nn::block::Half;
use crate::nn::layers::{Act, StageModel};
use crate::nn::params::{host_f32, FlatGrads};
use crate::parallel::tensor_parallel::Segment;

/// One backward's weight gradients, not yet in the stage's running sums.
pub(crate) struct WeightGrads<B: ExecBackend> {
    /// The gradients Burn's autodiff handed back, flat in visiting order.
    pub(crate) rest: FlatGrads<B>,
    /// The dense weights' gradients a split backward's input half put off.
    pub(crate) deferred: Option<PutOff<B>>,
}

/// Weight gradients put off ([`Deferred`]), with the stage's parameter keys they are summed
/// under (`params::sum_keys`).
pub(crate) type PutOff<B> =
    (Vec<Option<NodeId>>, Deferred<<B as burn::tensor::backend::AutodiffBackend>::InnerBackend>);

impl<B: ExecBackend> WeightGrads<B> {
    pub(crate) fn all(rest: FlatGrads<B>) -> Self {
        WeightGrads { rest, deferred: None }
    }
}

/// What a forward keeps for its microbatch's backward: the stage input (detached under
/// recompute), what the backward starts from, and the weights the forward used.
pub(crate) struct Kept<B: ExecBackend> {
    pub(crate) input: Act<B>,
    pub(crate) saved: Saved<B>,
    pub(crate) model: StageModel<B>,
    /// The stage's load-balancing losses (tracked; mixtures of experts with `aux_loss`).
    pub(crate) aux: Option<Tensor<B, 1>>,
}

/// What a forward kept for its backward.
pub(crate) enum Saved<B: ExecBackend> {
    /// The stage output (tracked).
    Output(Act<B>),
    /// The last stage's loss (tracked).
    Loss(Tensor<B, 1>),
    /// Activation recompute: only the input is kept; the recompute fills this in.
    Nothing,
    /// A tensor-parallel stage: its forward segments, and (last stage) the loss computed
    /// on a leaf copy of the output.
    Tp(Vec<Segment<B>>, Option<(Act<B>, Tensor<B, 1>)>),
    /// A stage with gradient buckets: its forward cut at the buckets' bounds (one segment
    /// per bucket, the first layers' first), and (last stage) the loss on the last
    /// segment's output.
    Segmented(Vec<Segment<B>>, Option<Tensor<B, 1>>),
    /// Recompute inside the blocks (`crate::interp::block_recompute`): the forward cut into
    /// pieces, each keeping its graph or only its input, and (last stage) the loss on the
    /// last piece's output.
    /// `starts`: the layer (a position in the stage) each piece begins, where it begins one.
    Pieces { pieces: Vec<Piece<B>>, starts: Vec<Option<usize>>, loss: Option<Tensor<B, 1>> },
}

/// A step of a stage's forward: one of its layers whole, or one half of a transformer block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unit {
    Layer(usize),
    Half(usize, Half),
}

/// A piece of a stage's forward cut for recompute.
#[derive(Clone)]
pub(crate) enum Piece<B: ExecBackend> {
    /// Keeps its graph from `leaf` to `out`, and its load-balancing losses (tracked).
    Kept { leaf: Act<B>, out: Act<B>, aux: Option<Tensor<B, 1>> },
    /// Keeps only its `input` (a leaf); `units` run again in the backward.
    Again { input: Act<B>, units: Vec<Unit> },
}

impl<B: ExecBackend> Piece<B> {
    /// The devices of the tensors it holds.
    pub(crate) fn devices(&self) -> Vec<B::Device> {
        match self {
            Piece::Kept { leaf, out, aux } => {
                let mut d = [leaf.devices(), out.devices()].concat();
                d.extend(aux.iter().map(Tensor::device));
                d
            }
            Piece::Again { input, .. } => input.devices(),
        }
    }
}

impl<B: ExecBackend> Kept<B> {
    /// The device of each tensor it holds: the input, what the backward starts from, the
    /// weights and the balancing losses.
    pub(crate) fn devices(&self) -> Vec<B::Device> {
        let mut out = self.input.devices();
        let segments = |s: &[Segment<B>]| s.iter().flat_map(|s| [s.leaf.devices(), s.out.devices()].concat()).collect();
        let saved: Vec<B::Device> = match &self.saved {
            Saved::Output(a) => a.devices(),
            Saved::Loss(l) => vec![l.device()],
            Saved::Nothing => Vec::new(),
            Saved::Tp(s, last) => {
                let mut d: Vec<B::Device> = segments(s);
                if let Some((a, l)) = last {
                    d.extend(a.devices());
                    d.push(l.device());
                }
                d
            }
            Saved::Segmented(s, loss) => {
                let mut d: Vec<B::Device> = segments(s);
                d.extend(loss.iter().map(Tensor::device));
                d
            }
            Saved::Pieces { pieces, loss, .. } => {
                let mut d: Vec<B::Device> = pieces.iter().flat_map(|p| p.devices()).collect();
                d.extend(loss.iter().map(Tensor::device));
                d
            }
        };
        out.extend(saved);
        out.extend(self.model.devices());
        out.extend(self.aux.iter().map(Tensor::device));
        out
    }
}

impl<B: ExecBackend> Saved<B> {
    /// Whether only the input was kept (activation recompute): no autodiff graph, so no
    /// weight is held for the backward.
    pub(crate) fn is_nothing(&self) -> bool {
        matches!(self, Saved::Nothing)
    }

    /// Whether the forward was cut into pieces for recompute inside the blocks.
    pub(crate) fn is_pieces(&self) -> bool {
        matches!(self, Saved::Pieces { .. })
    }
}

/// What a stage's forward produced.
pub(crate) struct Forwarded<B: ExecBackend> {
    /// What the backward starts from.
    pub(crate) saved: Saved<B>,
    /// The output to send to the next stage (every stage but the last).
    pub(crate) output: Option<Act<B>>,
    /// The loss this device reports (the last stage; on one rank of a tensor-parallel group).
    pub(crate) loss: Option<Tensor<B, 1>>,
    /// Batch normalisation's statistics of this microbatch, in layer order.
    pub(crate) stats: Vec<Tensor<B, 1>>,
    /// The last stage's scores (the loss's input), whole on this device: what validation's
    /// accuracy reads.
    pub(crate) scores: Option<Act<B>>,
    /// The stage's load-balancing losses (tracked), and per mixture-of-experts block its
    /// layer and the tokens each expert took.
    pub(crate) aux: Option<Tensor<B, 1>>,
    pub(crate) expert_tokens: Vec<(usize, Vec<u64>)>,
}

/// A copy of a stage's weights that is a fresh autodiff leaf: every microbatch's forward
/// builds its own graph on its own copy (sharing the weights' storage, not their graph
/// nodes). Burn 0.21's graph memory management loses the input gradient of one microbatch
/// when several microbatch graphs share the weight nodes and are back-propagated one by one
/// (reproduced single-threaded; see ARCHITECTURE.md). The copy is also exactly what
/// weight stashing needs: the backward differentiates at the weights the forward used.
pub(crate) struct FreshLeaves;

impl<B: ExecBackend> ModuleMapper<B> for FreshLeaves {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, _) = param.consume();
        Param::initialized(id, tensor.detach().require_grad())
    }
}

/// Frees what Burn's autodiff still holds of operations no live tensor reaches: its server
/// registers every operation, untracked ones too (burn-autodiff 0.21, `OpsPrep::finish`), and
/// clears those no tensor reaches only inside a backward, so the tensors of a forward whose
/// graph was dropped, or that ran untracked, stay held until the next backward — under
/// GPipe, after every microbatch's forward. A backward of a one-value graph clears them now
/// (measured: `tests/training.rs`, recompute by layers).
pub(crate) fn release_dropped_graphs<B: ExecBackend>(dev: &B::Device) {
    drop(Tensor::<B, 1>::from_floats([0.0f32], dev).require_grad().sum().backward());
}

pub(crate) fn microbatch_copy<B: ExecBackend>(model: &StageModel<B>) -> StageModel<B> {
    model.clone().map(&mut FreshLeaves)
}

/// A copy of a stage's weights that no gradient is taken of: a forward on it (and on an
/// untracked input) saves nothing for a backward — the forward of what the backward
/// recomputes ([`release_dropped_graphs`] frees what Burn still holds of it).
pub(crate) fn untracked_copy<B: ExecBackend>(model: &StageModel<B>) -> StageModel<B> {
    struct Untracked;
    impl<B: ExecBackend> ModuleMapper<B> for Untracked {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, _) = param.consume();
            Param::initialized(id, tensor.detach())
        }
    }
    model.clone().map(&mut Untracked)
}

/// An activation from the wire. A bundle (several tensors crossing one boundary) travels
/// as one message of shape `[0, k, rank₁, dims₁…, rank₂, dims₂…]` — no tensor has a zero
/// dimension — with the parts' values one after another.
pub(crate) fn host_to_act<B: Backend>(shape: &[usize], data: Vec<f32>, dev: &B::Device) -> Result<Act<B>> {
    if shape.first() == Some(&0) {
        let bad = || ExecError::Shape(format!("a malformed bundle header {shape:?}"));
        let k = *shape.get(1).ok_or_else(bad)?;
        let (mut pos, mut offset) = (2usize, 0usize);
        let mut parts = Vec::with_capacity(k.min(64));
        for _ in 0..k {
            let rank = *shape.get(pos).ok_or_else(bad)?;
            let dims = shape.get(pos + 1..pos + 1 + rank).ok_or_else(bad)?;
            let n: usize = dims.iter().product();
            let values = data.get(offset..offset + n).ok_or_else(bad)?.to_vec();
            parts.push(host_to_act::<B>(dims, values, dev)?);
            pos += 1 + rank;
            offset += n;
        }
        if pos != shape.len() || offset != data.len() {
            return Err(bad());
        }
        return Ok(Act::Bundle(parts));
    }
    let td = TensorData::new(data, shape.to_vec());
    Ok(match shape.len() {
        2 => Act::D2(Tensor::from_data(td, dev)),
        3 => Act::D3(Tensor::from_data(td, dev)),
        4 => Act::D4(Tensor::from_data(td, dev)),
        n => return Err(ExecError::Shape(format!("cannot carry a rank-{n} activation"))),
    })
}

/// An activation's wire form: its shape (a bundle's header) and values.
pub(crate) fn act_to_host<B: Backend>(a: &Act<B>) -> Result<(Vec<usize>, Vec<f32>)> {
    let data = match a {
        Act::D2(t) => t.clone().into_data(),
        Act::D3(t) => t.clone().into_data(),
        Act::D4(t) => t.clone().into_data(),
        Act::Tokens(_) => return Err(ExecError::Shape("token ids cannot cross a stage boundary".into())),
        Act::Bundle(parts) => {
            let mut shape = vec![0, parts.len()];
            let mut values = Vec::new();
            for p in parts {
                let (s, v) = act_to_host(p)?;
                shape.push(s.len());
                shape.extend(s);
                values.extend(v);
            }
            return Ok((shape, values));
        }
    };
    let shape = data.shape.to_vec();
    Ok((shape, host_f32(data)?))
}

pub(crate) fn act_to_message<B: Backend>(a: &Act<B>, tag: Tag) -> Result<Message> {
    let (shape, data) = act_to_host(a)?;
    Ok(Message { tag, shape, data })
}

pub(crate) fn require_grad<B: ExecBackend>(a: Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.require_grad()),
        Act::D3(t) => Act::D3(t.require_grad()),
        Act::D4(t) => Act::D4(t.require_grad()),
        Act::Bundle(parts) => Act::Bundle(parts.into_iter().map(require_grad).collect()),
        other => other,
    }
}

/// Whether an activation carries a gradient: computed from a tensor that requires one (a
/// bundle: any of its parts).
pub(crate) fn carries_gradient<B: ExecBackend>(a: &Act<B>) -> bool {
    fn of<B: ExecBackend, const D: usize>(t: &Tensor<B, D>) -> bool {
        B::carries_gradient(&t.clone().into_primitive().tensor())
    }
    match a {
        Act::D2(t) => of(t),
        Act::D3(t) => of(t),
        Act::D4(t) => of(t),
        Act::Tokens(_) => false,
        Act::Bundle(parts) => parts.iter().any(carries_gradient),
    }
}

pub(crate) fn detach<B: ExecBackend>(a: &Act<B>) -> Act<B> {
    match a {
        Act::D2(t) => Act::D2(t.clone().detach()),
        Act::D3(t) => Act::D3(t.clone().detach()),
        Act::D4(t) => Act::D4(t.clone().detach()),
        Act::Tokens(t) => Act::Tokens(t.clone()),
        Act::Bundle(parts) => Act::Bundle(parts.iter().map(detach).collect()),
    }
}

/// Σ(out ⊙ g): back-propagating it injects the received gradient `g` at the output.
pub(crate) fn dot_with<B: ExecBackend>(out: &Act<B>, g: &Message, dev: &B::Device) -> Result<Tensor<B, 1>> {
    dot(out, host_to_act::<B>(&g.shape, g.data.clone(), dev)?)
}

pub(crate) fn dot<B: ExecBackend>(out: &Act<B>, grad: Act<B>) -> Result<Tensor<B, 1>> {
    Ok(match (out, grad) {
        (Act::D2(o), Act::D2(g)) => (o.clone() * g).sum(),
        (Act::D3(o), Act::D3(g)) => (o.clone() * g).sum(),
        (Act::D4(o), Act::D4(g)) => (o.clone() * g).sum(),
        (Act::Bundle(os), Act::Bundle(gs)) if os.len() == gs.len() => {
            let mut total: Option<Tensor<B, 1>> = None;
            for (o, g) in os.iter().zip(gs) {
                let d = dot(o, g)?;
                total = Some(match total {
                    Some(t) => t + d,
                    None => d,
                });
            }
            total.ok_or(ExecError::Missing("an empty bundle"))?
        }
        (o, g) => {
            return Err(ExecError::Shape(format!(
                "gradient of shape {:?} does not fit the output {:?}",
                g.dims(),
                o.dims()
            )))
        }
    })
}

/// The gradient that reached an input (a bundle's parts each: zeros where none reached one).
pub(crate) fn grad_of<B: ExecBackend>(x: &Act<B>, grads: &mut B::Gradients) -> Option<Act<B::InnerBackend>> {
    match x {
        Act::D2(t) => t.grad_remove(grads).map(Act::D2),
        Act::D3(t) => t.grad_remove(grads).map(Act::D3),
        Act::D4(t) => t.grad_remove(grads).map(Act::D4),
        Act::Tokens(_) => None,
        Act::Bundle(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                out.push(match grad_of(p, grads) {
                    Some(g) => g,
                    None => match p {
                        Act::D2(t) => Act::D2(t.clone().inner().zeros_like()),
                        Act::D3(t) => Act::D3(t.clone().inner().zeros_like()),
                        Act::D4(t) => Act::D4(t.clone().inner().zeros_like()),
                        _ => return None,
                    },
                });
            }
            Some(Act::Bundle(out))
        }
    }
}

pub(crate) fn input_grad<B: ExecBackend>(x: &Act<B>, grads: &mut B::Gradients, tag: Tag) -> Result<Option<Message>> {
    match grad_of(x, grads) {
        None => Ok(None),
        Some(g) => Ok(Some(act_to_message(&g, tag)?)),
    }
}
