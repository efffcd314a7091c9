//! The model's layers as Burn modules, built from the plan's operators with deterministic
//! initial weights (the same on every device and in every run), and their forward pass on
//! activations of any rank.

use burn::module::{Module, Param};
use burn::prelude::*;
use burn::tensor::activation;
use burn::tensor::module::{adaptive_avg_pool2d, avg_pool2d, embedding};
use burn::tensor::ops::ConvOptions;
use pipec_plan::model::{NormKind, Op, Pooling, Source};

use crate::backend::kernels::{self, Gelu, Kernels};
use crate::backend::norm::per_sample;
use crate::backend::pool::PoolWindow;
use crate::backend::rng::Rng;
use crate::error::{ExecError, Result};
pub use crate::nn::block::*;
pub use crate::nn::parts::*;

/// A 2-D convolution.
#[derive(Module, Debug)]
pub struct Conv<B: Backend> {
    pub weight: Param<Tensor<B, 4>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub stride: usize,
    #[module(skip)]
    pub padding: usize,
}

/// Batch normalisation over a [batch, C, H, W] activation, per channel.
///
/// In training it normalises with the microbatch's own statistics (biased variance) and
/// hands them (mean, unbiased variance; detached) to the caller, which folds them into the
/// running statistics once per optimizer update (see `StageState::fold_statistics`). The
/// running statistics are state, not parameters: the optimizer never sees them, a microbatch
/// copy carries them along, checkpoints keep them (`RUNNING_MEAN_SLOT`, `RUNNING_VAR_SLOT`).
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    pub gamma: Param<Tensor<B, 1>>,
    pub beta: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub running_mean: Vec<f32>,
    #[module(skip)]
    pub running_var: Vec<f32>,
    /// The layer's global index.
    #[module(skip)]
    pub index: usize,
}

/// Batch normalisation's ε (PyTorch's default).
pub const BN_EPS: f64 = 1e-5;
/// How far one update moves the running statistics toward the new batch statistics
/// (PyTorch's default `momentum`).
pub const BN_MOMENTUM: f32 = 0.1;
/// Checkpoint slots of the running statistics (the parameters take slots 0 and 1).
pub const RUNNING_MEAN_SLOT: u64 = 2;
pub const RUNNING_VAR_SLOT: u64 = 3;

/// The checkpoint id of a state slot of layer `index` (the same scheme as its parameters').
pub fn state_id(index: usize, slot: u64) -> u64 {
    pid(index, slot)
}

impl<B: Backend> BatchNorm<B> {
    fn new(index: usize, channels: usize, device: &B::Device) -> Self {
        BatchNorm {
            gamma: param(pid(index, 0), vec![1.0; channels], [channels], device),
            beta: param(pid(index, 1), vec![0.0; channels], [channels], device),
            running_mean: vec![0.0; channels],
            running_var: vec![1.0; channels],
            index,
        }
    }
}

impl<B: Kernels> BatchNorm<B> {
    /// Normalises `x`; in training, pushes [mean ‖ unbiased variance] (2·C values) to `stats`.
    fn forward(&self, x: Tensor<B, 4>, training: bool, stats: &mut Vec<Tensor<B, 1>>) -> Result<Tensor<B, 4>> {
        let [n, c, h, w] = x.dims();
        let per_channel = n * h * w;
        if !training {
            let dev = x.device();
            let stat = |v: &[f32]| Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [c]), &dev);
            let scale = self.gamma.val() / (stat(&self.running_var) + BN_EPS).sqrt();
            let centred = x - per_sample(stat(&self.running_mean), n);
            return Ok(centred * per_sample(scale, n) + per_sample(self.beta.val(), n));
        }
        if per_channel < 2 {
            return Err(ExecError::Shape(format!(
                "batchnorm2d (layer {}) needs more than one value per channel in a microbatch to compute a variance, got {n}×{h}×{w} (raise the microbatch size)",
                self.index
            )));
        }
        // the backward keeps the input alone of its size (`Kernels::batch_norm`)
        let (y, mean, var) = crate::backend::kernels::batch_norm(x, self.gamma.val(), self.beta.val(), BN_EPS);
        let unbiased = var.detach() * (per_channel as f64 / (per_channel - 1) as f64);
        stats.push(Tensor::cat(vec![mean.detach(), unbiased], 0));
        Ok(y)
    }
}

/// A layer without weights; `index` is its global layer index (dropout masks use it).
#[derive(Module, Debug, Clone)]
pub struct Stateless {
    #[module(skip)]
    pub op: Op,
    #[module(skip)]
    pub index: usize,
}

/// An embedding table [vocab, d] (or a positional table [max_len, d]), with a token
/// embedding's optional token-type table.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub types: Option<TokenTypes<B>>,
}

/// A token embedding's token-type (segment) table [types, d], BERT's: position p of a row
/// has the type "number of `sep` tokens before p", at most types − 1 (type 0 everywhere
/// without `sep`).
#[derive(Module, Debug)]
pub struct TokenTypes<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    #[module(skip)]
    pub sep: Option<usize>,
}

impl<B: Backend> TokenTypes<B> {
    /// Layer `index`'s table (slot 1), deterministic: 0.02·N(0, 1) as GPT-2's positions.
    pub(crate) fn new(
        index: usize,
        seed: u64,
        types: usize,
        dim: usize,
        sep: Option<usize>,
        device: &B::Device,
    ) -> Self {
        let mut rng = Rng::keyed(&[seed, 10, index as u64, 1]);
        let table = rng.normal_vec(types * dim).into_iter().map(|v| 0.02 * v).collect();
        TokenTypes { weight: param(pid(index, 1), table, [types, dim], device), sep }
    }

    /// Each position's type id for token ids [batch, seq].
    pub(crate) fn type_ids(&self, ids: &Tensor<B, 2, Int>) -> Result<Tensor<B, 2, Int>> {
        let [rows, seq] = ids.dims();
        let last = self.weight.dims()[0].saturating_sub(1) as i64;
        let mut types = vec![0i64; rows * seq];
        if let Some(sep) = self.sep {
            let host: Vec<i64> = ids
                .clone()
                .into_data()
                .convert::<i64>()
                .into_vec()
                .map_err(|e| ExecError::Shape(format!("token ids: {e:?}")))?;
            for (row, out) in host.chunks(seq).zip(types.chunks_mut(seq)) {
                let mut seen = 0i64;
                for (id, t) in row.iter().zip(out) {
                    *t = seen.min(last);
                    if *id == sep as i64 {
                        seen += 1;
                    }
                }
            }
        }
        Ok(Tensor::from_data(TensorData::new(types, [rows, seq]), &ids.device()))
    }

    /// `x` [batch, seq, d] plus each position's token-type row.
    pub(crate) fn add(&self, x: Tensor<B, 3>, ids: &Tensor<B, 2, Int>) -> Result<Tensor<B, 3>> {
        Ok(x + embedding(self.weight.val(), self.type_ids(ids)?))
    }
}

/// Rows `first..first + rows` of an embedding table: a tensor-parallel rank's part of the
/// vocabulary (a token-type table is whole on every rank).
#[derive(Module, Debug)]
pub struct VocabEmbed<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub first: usize,
    pub types: Option<TokenTypes<B>>,
}

impl<B: Backend> VocabEmbed<B> {
    pub(crate) fn new(
        index: usize,
        table: Vec<f32>,
        shape: [usize; 2],
        first: usize,
        types: Option<TokenTypes<B>>,
        device: &B::Device,
    ) -> Self {
        VocabEmbed { weight: param(pid(index, 0), table, shape, device), first, types }
    }

    /// The looked-up vectors of the ids this rank holds, zeros for the others (summed over
    /// the group, every id's vector).
    pub(crate) fn partial(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        let rows = self.weight.dims()[0];
        let local = ids - self.first as i64;
        let held = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(rows as i64));
        let index = local.clamp(0, rows as i64 - 1);
        let mask = held.float().unsqueeze_dim::<3>(2);
        embedding(self.weight.val(), index) * mask
    }
}

/// One LSTM layer (PyTorch's gate order i, f, g, o and its two biases), weights stored as
/// [in, 4·hidden] and [hidden, 4·hidden] (the transpose of PyTorch's) like `Dense`.
#[derive(Module, Debug)]
pub struct Lstm<B: Backend> {
    pub w_ih: Param<Tensor<B, 2>>,
    pub w_hh: Param<Tensor<B, 2>>,
    pub b_ih: Param<Tensor<B, 1>>,
    pub b_hh: Param<Tensor<B, 1>>,
}

impl<B: Kernels> Lstm<B> {
    fn new(index: usize, seed: u64, input: usize, hidden: usize, device: &B::Device) -> Self {
        // PyTorch's initialisation: every weight and bias uniform in ±1/√hidden
        let k = 1.0 / (hidden as f64).sqrt();
        let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
        let mut u = |n: usize| rng.uniform_vec(n, k);
        let (w_ih, w_hh, b_ih, b_hh) = (u(input * 4 * hidden), u(hidden * 4 * hidden), u(4 * hidden), u(4 * hidden));
        Lstm {
            w_ih: param(pid(index, 0), w_ih, [input, 4 * hidden], device),
            w_hh: param(pid(index, 1), w_hh, [hidden, 4 * hidden], device),
            b_ih: param(pid(index, 2), b_ih, [4 * hidden], device),
            b_hh: param(pid(index, 3), b_hh, [4 * hidden], device),
        }
    }

    /// [batch, seq, in] → every step's hidden state [batch, seq, hidden], from zero state.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let [n, s, i] = x.dims();
        // (from the bias: under ZeRO-3 the weights may be one-value stand-ins, gathered by
        // their products)
        let h4 = self.b_ih.dims()[0];
        let hidden = h4 / 4;
        // the input's part of every step's gates at once
        let bias = (self.b_ih.val() + self.b_hh.val()).unsqueeze::<2>();
        let xw = B::dense(x.reshape([n * s, i]), self.w_ih.val()).reshape([n, s, h4]);
        let dev = xw.device();
        let mut h = Tensor::<B, 2>::zeros([n, hidden], &dev);
        let mut c = Tensor::<B, 2>::zeros([n, hidden], &dev);
        let mut outs = Vec::with_capacity(s);
        for t in 0..s {
            let gates = xw.clone().narrow(1, t, 1).reshape([n, h4]) + B::dense(h, self.w_hh.val()) + bias.clone();
            let gate = |k: usize| gates.clone().narrow(1, k * hidden, hidden);
            let (ig, fg, gg, og) = (
                activation::sigmoid(gate(0)),
                activation::sigmoid(gate(1)),
                gate(2).tanh(),
                activation::sigmoid(gate(3)),
            );
            c = fg * c + ig * gg;
            h = og * c.clone().tanh();
            outs.push(h.clone().unsqueeze_dim::<3>(1));
        }
        Tensor::cat(outs, 1)
    }
}

/// One layer of a stage.
#[derive(Module, Debug)]
pub enum Layer<B: Backend> {
    Dense(Dense<B>),
    Conv(Conv<B>),
    Norm(Norm<B>),
    BatchNorm(BatchNorm<B>),
    Embedding(Embed<B>),
    /// A learned positional embedding table [max_len, d].
    PosEmbedding(Embed<B>),
    Lstm(Lstm<B>),
    Block(Block<B>),
    Stateless(Stateless),
    /// Tensor parallelism: a column-parallel shard (this rank's output features).
    ColumnLinear(Dense<B>),
    /// Tensor parallelism: a row-parallel shard (this rank's input features); its output is
    /// a partial sum completed by an all-reduce, then the (replicated) bias is added.
    RowLinear(Dense<B>),
    /// Tensor parallelism: a transformer block with this rank's heads and MLP columns.
    ParallelBlock(Block<B>),
    /// Tensor parallelism: this rank's rows of a language model's embedding table.
    VocabEmbedding(VocabEmbed<B>),
    /// Tensor parallelism: this rank's output columns of the model's output layer (its
    /// scores for its part of the vocabulary).
    VocabLinear(Dense<B>),
}

impl<B: Kernels> Layer<B> {
    /// Builds layer `index` of the model with its deterministic initial weights.
    pub fn new(index: usize, op: &Op, seed: u64, device: &B::Device) -> Self {
        let he = 2.0; // He initialisation for layers followed by ReLU-like activations
        match *op {
            Op::Linear { in_features, out_features, bias } => {
                Layer::Dense(Dense::new(index, 0, seed, in_features, out_features, bias, he, device))
            }
            Op::Conv2d { in_channels, out_channels, kernel, stride, padding, bias } => {
                let fan_in = in_channels * kernel * kernel;
                let k = (he * 3.0 / fan_in as f64).sqrt();
                let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
                Layer::Conv(Conv {
                    weight: param(
                        pid(index, 0),
                        rng.uniform_vec(out_channels * fan_in, k),
                        [out_channels, in_channels, kernel, kernel],
                        device,
                    ),
                    bias: bias.then(|| param(pid(index, 1), vec![0.0; out_channels], [out_channels], device)),
                    stride,
                    padding,
                })
            }
            Op::LayerNorm { dim, eps } => Layer::Norm(Norm::of(NormKind::LayerNorm, index, 0, dim, eps, device)),
            Op::RmsNorm { dim, eps } => Layer::Norm(Norm::of(NormKind::RmsNorm, index, 0, dim, eps, device)),
            Op::BatchNorm2d { channels } => Layer::BatchNorm(BatchNorm::new(index, channels, device)),
            Op::Embedding { vocab, dim, types, sep } => Layer::Embedding(Embed {
                weight: param(pid(index, 0), embedding_values(index, seed, vocab, dim), [vocab, dim], device),
                types: (types > 0).then(|| TokenTypes::new(index, seed, types, dim, sep, device)),
            }),
            Op::PosEmbedding { max_len, dim } => {
                let mut rng = Rng::keyed(&[seed, 10, index as u64, 0]);
                let table = rng.normal_vec(max_len * dim).into_iter().map(|v| 0.02 * v).collect();
                Layer::PosEmbedding(Embed { weight: param(pid(index, 0), table, [max_len, dim], device), types: None })
            }
            Op::Lstm { input, hidden } => Layer::Lstm(Lstm::new(index, seed, input, hidden, device)),
            Op::TransformerBlock { .. } => match Block::build(index, op, seed, device, |_, w| w, (1, 0), false) {
                Some(b) => Layer::Block(b),
                None => Layer::Stateless(Stateless { op: op.clone(), index }),
            },
            _ => Layer::Stateless(Stateless { op: op.clone(), index }),
        }
    }

    /// The forward pass. `side.mask_key` makes dropout masks depend on (step, microbatch)
    /// only; batch normalisation in training appends its batch statistics to `side.stats`, a
    /// mixture of experts its load-balancing loss and token counts (`Collected`).
    pub fn forward(&self, x: Act<B>, training: bool, side: &mut Collected<B>) -> Result<Act<B>> {
        Ok(match (self, x) {
            (Layer::BatchNorm(bn), Act::D4(t)) => Act::D4(bn.forward(t, training, &mut side.stats)?),
            (Layer::Dense(d), Act::D2(t)) => Act::D2(d.forward2(t)),
            (Layer::Dense(d), Act::D3(t)) => Act::D3(d.forward3(t)),
            (Layer::Conv(c), Act::D4(t)) => Act::D4(crate::backend::kernels::conv2d(
                t,
                c.weight.val(),
                c.bias.as_ref().map(Param::val),
                ConvOptions::new([c.stride; 2], [c.padding; 2], [1, 1], 1),
            )),
            (Layer::Norm(n), Act::D2(t)) => Act::D2(n.forward(t)),
            (Layer::Norm(n), Act::D3(t)) => Act::D3(n.forward(t)),
            (Layer::Embedding(e), Act::Tokens(t)) => match &e.types {
                None => Act::D3(B::embed(e.weight.val(), t)),
                Some(types) => Act::D3(types.add(B::embed(e.weight.val(), t.clone()), &t)?),
            },
            (Layer::PosEmbedding(e), Act::D3(t)) => {
                let [_, s, d] = t.dims();
                let rows = match &side.context {
                    // context parallelism: the rows of this member's positions
                    Some(c) => {
                        let at: Vec<i64> = c.positions(s).into_iter().map(|p| p as i64).collect();
                        let dev = t.device();
                        e.weight.val().select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(at, [s]), &dev))
                    }
                    None => e.weight.val().narrow(0, 0, s),
                };
                // as rows of s·d values: flex adds a broadcast row in one pass, where a
                // broadcast [1, s, d] went value by value (0.1 ms for gpt-tiny's 4 × 64 × 64)
                let b = t.dims()[0];
                Act::D3((t.reshape([b, s * d]) + rows.reshape([1, s * d])).reshape([b, s, d]))
            }
            (Layer::Lstm(l), Act::D3(t)) => Act::D3(l.forward(t)),
            (Layer::Block(b), Act::D3(t)) => Act::D3(b.forward(t, training, side)?),
            (Layer::Stateless(st), x) => stateless(&st.op, st.index, x, side)?,
            (Layer::ColumnLinear(d), x) => d.forward_act(x)?,
            (layer, x) => {
                return Err(ExecError::Shape(format!(
                    "layer {} cannot take an activation of shape {:?}",
                    layer_name(layer),
                    x.dims()
                )))
            }
        })
    }
}

fn layer_name<B: Backend>(l: &Layer<B>) -> &'static str {
    match l {
        Layer::Dense(_) => "linear",
        Layer::Conv(_) => "conv2d",
        Layer::Norm(_) => "layernorm",
        Layer::BatchNorm(_) => "batchnorm2d",
        Layer::Embedding(_) => "embedding",
        Layer::PosEmbedding(_) => "pos_embedding",
        Layer::Lstm(_) => "lstm",
        Layer::Block(_) => "transformer_block",
        Layer::Stateless(st) => st.op.name(),
        Layer::ColumnLinear(_) | Layer::RowLinear(_) => "tensor-parallel linear",
        Layer::ParallelBlock(_) => "tensor-parallel transformer_block",
        Layer::VocabEmbedding(_) => "vocabulary-parallel embedding",
        Layer::VocabLinear(_) => "vocabulary-parallel linear",
    }
}

fn elementwise<B: Backend>(x: Act<B>, f: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>) -> Result<Act<B>> {
    // Apply on a 2-D view and restore the shape.
    let dims = x.dims();
    type Restore<B> = Box<dyn Fn(Tensor<B, 2>) -> Act<B>>;
    let (flat, restore): (Tensor<B, 2>, Restore<B>) = match x {
        Act::D2(t) => (t, Box::new(Act::D2)),
        Act::D3(t) => {
            let [a, b, c] = t.dims();
            (t.reshape([a, b * c]), Box::new(move |y: Tensor<B, 2>| Act::D3(y.reshape([a, b, c]))))
        }
        Act::D4(t) => {
            let [a, b, c, d] = t.dims();
            (t.reshape([a, b * c * d]), Box::new(move |y: Tensor<B, 2>| Act::D4(y.reshape([a, b, c, d]))))
        }
        Act::Tokens(_) | Act::Bundle(_) => {
            return Err(ExecError::Shape(format!("an element-wise layer cannot take token ids or a bundle {dims:?}")))
        }
    };
    Ok(restore(f(flat)))
}

/// A layer without weights on `x`; dropout draws from `side.mask_key` (none while
/// evaluating) the whole microbatch's mask, as one device does, and keeps this device's part.
pub(crate) fn stateless<B: Kernels>(op: &Op, index: usize, x: Act<B>, side: &Collected<B>) -> Result<Act<B>> {
    match *op {
        Op::Relu => elementwise(x, activation::relu),
        Op::Gelu => elementwise(x, |x| kernels::gelu(x, Gelu::Erf)),
        Op::GeluTanh => elementwise(x, |x| kernels::gelu(x, Gelu::Tanh)),
        Op::Tanh => elementwise(x, activation::tanh),
        Op::Sigmoid => elementwise(x, activation::sigmoid),
        Op::Dropout { p } => {
            let Some(key) = side.mask_key.filter(|_| p > 0.0) else { return Ok(x) };
            let key = crate::backend::dropout::Site::Layer.key(key, index);
            // context parallelism: the mask of the whole sequence at this member's positions
            let mask = match &x {
                Act::D3(t) => {
                    let (whole, picks) = crate::nn::context::Context::sequence_cut(side.context.as_ref(), t.dims());
                    crate::backend::dropout::DropMask::new(p, &key, whole, picks)
                }
                _ => crate::backend::dropout::DropMask::whole(p, &key, x.dims()),
            };
            let mask = Some(std::sync::Arc::new(mask));
            elementwise(x, |t| crate::backend::kernels::dropped(t, &mask))
        }
        Op::Flatten => Ok(match x {
            Act::D2(t) => Act::D2(t),
            Act::D3(t) => {
                let [a, b, c] = t.dims();
                Act::D2(t.reshape([a, b * c]))
            }
            Act::D4(t) => {
                let [a, b, c, d] = t.dims();
                Act::D2(t.reshape([a, b * c * d]))
            }
            Act::Tokens(_) | Act::Bundle(_) => {
                return Err(ExecError::Shape("flatten cannot take token ids or a bundle".into()))
            }
        }),
        Op::MaxPool2d { kernel, stride, padding } => match x {
            Act::D4(t) => {
                let window = PoolWindow { kernel: [kernel; 2], stride: [stride; 2], padding: [padding; 2] };
                Ok(Act::D4(crate::backend::kernels::max_pool(t, window)))
            }
            other => Err(ExecError::Shape(format!("maxpool2d needs [batch, C, H, W], got {:?}", other.dims()))),
        },
        // padded zeros count in the average (PyTorch's default)
        Op::AvgPool2d { kernel, stride, padding } => match x {
            Act::D4(t) => Ok(Act::D4(avg_pool2d(t, [kernel; 2], [stride; 2], [padding; 2], true, false))),
            other => Err(ExecError::Shape(format!("avgpool2d needs [batch, C, H, W], got {:?}", other.dims()))),
        },
        Op::AdaptiveAvgPool2d { size } => match x {
            Act::D4(t) => Ok(Act::D4(adaptive_avg_pool2d(t, [size; 2]))),
            other => {
                Err(ExecError::Shape(format!("adaptive_avgpool2d needs [batch, C, H, W], got {:?}", other.dims())))
            }
        },
        Op::SeqPool { how } => match x {
            Act::D3(t) => {
                let [b, _, d] = t.dims();
                Ok(Act::D2(match how {
                    Pooling::First => t.narrow(1, 0, 1).reshape([b, d]),
                    // a product with a row of 1/s: its backward spreads each sample's
                    // gradient over the positions as a product too, where `mean_dim`'s
                    // broadcast a [b, 1, d] row through flex's general strided path (4.5–4.8
                    // ms of a [16, 64, 512] backward, against 0.1 ms priced;
                    // docs/benchmarks.md)
                    Pooling::Mean => {
                        let s = t.dims()[1];
                        let row = Tensor::<B, 3>::full([b, 1, s], 1.0 / s as f64, &t.device());
                        row.matmul(t).reshape([b, d])
                    }
                }))
            }
            other => Err(ExecError::Shape(format!("seq_pool needs [batch, seq, d], got {:?}", other.dims()))),
        },
        _ => Err(ExecError::Shape(format!("{} is not a stateless layer", op.name()))),
    }
}

/// The layers of one stage.
#[derive(Module, Debug)]
pub struct StageModel<B: Backend> {
    pub layers: Vec<Layer<B>>,
    /// A graph model's wiring (None: a chain, each layer reading the one before).
    #[module(skip)]
    pub graph: Option<StageGraph>,
}

impl<B: Kernels> StageModel<B> {
    /// Builds layers `range` of the model.
    pub fn new(ops: &[Op], first_index: usize, seed: u64, device: &B::Device) -> Self {
        StageModel {
            layers: ops.iter().enumerate().map(|(i, op)| Layer::new(first_index + i, op, seed, device)).collect(),
            graph: None,
        }
    }

    /// Selective recompute (or flash attention's memory): the transformer blocks of the
    /// layers the plan says so of ([`recomputes_attention_core`]) recompute
    /// their attention core in the backward instead of keeping it.
    pub fn recompute_attention_cores(&mut self, plan: &pipec_plan::Plan) {
        for layer in &mut self.layers {
            if let Layer::Block(b) | Layer::ParallelBlock(b) = layer {
                b.recompute_core = recomputes_attention_core(plan, b.index);
            }
        }
    }

    /// The stage's batch normalisation layers, in order.
    pub fn batch_norms(&self) -> impl Iterator<Item = &BatchNorm<B>> {
        self.layers.iter().filter_map(|l| match l {
            Layer::BatchNorm(bn) => Some(bn),
            _ => None,
        })
    }

    /// How many values the stage's batch statistics (and running statistics) take: per
    /// batch normalisation layer, a mean and a variance per channel.
    pub fn statistics_len(&self) -> usize {
        self.batch_norms().map(|bn| 2 * bn.running_mean.len()).sum()
    }

    /// The running statistics, per batch normalisation layer [mean ‖ variance].
    pub fn running_statistics(&self) -> Vec<f32> {
        self.batch_norms().flat_map(|bn| bn.running_mean.iter().chain(&bn.running_var).copied()).collect()
    }

    /// Replaces the running statistics with `values` (as `running_statistics` lays them out).
    pub fn set_running_statistics(&mut self, values: &[f32]) -> Result<()> {
        self.update_running(values, |_, new| new)
    }

    /// One update of the running statistics toward `mean_stats` (batch statistics averaged
    /// over the microbatches the update covers, laid out as `running_statistics`):
    /// running ← (1 − momentum)·running + momentum·batch.
    pub fn fold_statistics(&mut self, mean_stats: &[f32]) -> Result<()> {
        self.update_running(mean_stats, |old, new| (1.0 - BN_MOMENTUM) * old + BN_MOMENTUM * new)
    }

    /// running ← decay·running + `weighted` (statistics already weighted and summed).
    pub fn fold_weighted(&mut self, decay: f32, weighted: &[f32]) -> Result<()> {
        self.update_running(weighted, |old, new| decay * old + new)
    }

    fn update_running(&mut self, values: &[f32], f: impl Fn(f32, f32) -> f32) -> Result<()> {
        if values.len() != self.statistics_len() {
            return Err(ExecError::Shape(format!(
                "{} batch-normalisation statistics for a stage that keeps {}",
                values.len(),
                self.statistics_len()
            )));
        }
        let mut rest = values;
        for layer in &mut self.layers {
            if let Layer::BatchNorm(bn) = layer {
                let c = bn.running_mean.len();
                let (mean, tail) = rest.split_at(c);
                let (var, tail) = tail.split_at(c);
                for (r, v) in bn.running_mean.iter_mut().zip(mean) {
                    *r = f(*r, *v);
                }
                for (r, v) in bn.running_var.iter_mut().zip(var) {
                    *r = f(*r, *v);
                }
                rest = tail;
            }
        }
        Ok(())
    }

    /// The stage's forward; batch normalisation layers in training append their batch
    /// statistics to `side.stats`, in layer order (and mixtures of experts their losses and
    /// counts, `Collected`).
    pub fn forward(&self, mut x: Act<B>, training: bool, side: &mut Collected<B>) -> Result<Act<B>> {
        let Some(g) = &self.graph else {
            for layer in &self.layers {
                x = layer.forward(x, training, side)?;
            }
            return Ok(x);
        };
        // every tensor by its source: what arrived, then each layer's output
        let arrived = x.parts();
        if arrived.len() != g.inputs.len() {
            return Err(ExecError::Shape(format!(
                "the stage expects {} input tensor(s), got {}",
                g.inputs.len(),
                arrived.len()
            )));
        }
        let mut env: std::collections::HashMap<Source, Act<B>> = g.inputs.iter().copied().zip(arrived).collect();
        for (k, (layer, operands)) in self.layers.iter().zip(&g.operands).enumerate() {
            let mut args = Vec::with_capacity(operands.len());
            for s in operands {
                args.push(env.get(s).cloned().ok_or(ExecError::Missing("a layer's operand is not on this stage"))?);
            }
            let out = match layer {
                Layer::Stateless(st) if matches!(st.op, Op::Add { .. } | Op::Concat { .. }) => join(&st.op, args)?,
                _ => {
                    let x = args.into_iter().next().ok_or(ExecError::Missing("a layer has no operand"))?;
                    layer.forward(x, training, side)?
                }
            };
            env.insert(Source::Layer(g.first + k), out);
        }
        let mut outs = Vec::with_capacity(g.outputs.len());
        for s in &g.outputs {
            outs.push(env.get(s).cloned().ok_or(ExecError::Missing("a tensor the stage sends on is not on it"))?);
        }
        Ok(Act::from_parts(outs))
    }
}

/// `add` (element-wise sum) or `concat` (along the first per-sample dimension).
fn join<B: Backend>(op: &Op, args: Vec<Act<B>>) -> Result<Act<B>> {
    macro_rules! joined {
        ($variant:ident) => {{
            let mut ts = Vec::with_capacity(args.len());
            for a in args {
                match a {
                    Act::$variant(t) => ts.push(t),
                    other => {
                        return Err(ExecError::Shape(format!(
                            "{} operands differ in rank: {:?}",
                            op.name(),
                            other.dims()
                        )))
                    }
                }
            }
            match op {
                Op::Add { .. } => {
                    let mut it = ts.into_iter();
                    let first = it.next().ok_or(ExecError::Missing("a join has no operand"))?;
                    Act::$variant(it.fold(first, |acc, t| acc + t))
                }
                _ => Act::$variant(Tensor::cat(ts, 1)),
            }
        }};
    }
    Ok(match args.first() {
        Some(Act::D2(_)) => joined!(D2),
        Some(Act::D3(_)) => joined!(D3),
        Some(Act::D4(_)) => joined!(D4),
        _ => return Err(ExecError::Shape(format!("{} takes feature tensors", op.name()))),
    })
}

/// Whether layer `layer`'s attention core is recomputed in its backward rather than kept: selective
/// recompute, a policy naming `core_attn`, or flash attention's memory (computed unfused).
pub(crate) fn recomputes_attention_core(plan: &pipec_plan::Plan, layer: usize) -> bool {
    plan.model.attention == pipec_plan::Attention::Flash
        || plan.schedule.block_recompute.as_ref().is_some_and(pipec_plan::plan::BlockRecompute::recomputes_core)
        || plan.stages.iter().any(|s| s.selective_recompute && (s.layers[0]..s.layers[1]).contains(&layer))
}
