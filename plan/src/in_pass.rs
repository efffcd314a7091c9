//! The collectives a pass makes inside itself, declared in the plan: tensor parallelism's
//! all-reduces (Megatron's `g` after a row-parallel product, `f`'s gradient before a
//! column-parallel one, the vocabulary-parallel loss's three sums), context parallelism's
//! key and value gathers or ring passes, expert parallelism's count, dispatch and combine
//! exchanges, ZeRO-3's per-product weight gathers with their prefetch. Each is one [`InPass`]: the layer that makes it, its group ([`PeerDim`],
//! resolved against the device and stage of the pass) and what it does ([`PassOp`]).
//!
//! [`declare`] is the rule: what pipec's executor issues, in issue order, in a pass of one
//! kind ([`PassKind`]) of a stage. The compiler writes it per device into the plan
//! ([`InPassTable`], lists shared between the devices that run the same ones), the verifier
//! checks that every member of a group declares the same ones in the same order, and the
//! executor records what its passes issue and, in debug builds, fails a pass that issues
//! anything else.
//!
//! The pass that feeds its stage's bucketed replica reduction (`plan::reduced_in_buckets`,
//! the step's last gradient of a stage with gradient buckets) has a list of its own: the
//! one of its kind with each bucket's all-reduce (DDP) or reduce-scatter (ZeRO) over the
//! replicas, `dp`, where the bucket's gradients are complete.
//!
//! On the update's side, the `grad_norm` all-reduce, ZeRO's `gradient_shard` reduce-scatter
//! and the update list the tensor-parallel sums of the gradients that are partial on each
//! rank, where the first of them reads a stage's gradients whole, and of the stage's own
//! norm where an update clips by it ([`update_sums`]).
//!
//! ZeRO-3's gathers of a stage's whole weights (those its products do not gather
//! themselves) and their prefetch depend on what the device keeps between passes, not on
//! the kind of pass: each device declares them by instruction ([`stage_gathers`]), the
//! verifier checks that the members of each stage's shard group start them at the same
//! passes, and the executor starts exactly those.

mod stage_gathers;

pub use stage_gathers::{next_reader, reads_weights, stage_gathers, zero3_stages, StageGather};

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::instr::{DeviceId, Instr, StageId};
use crate::model::{Op, TpSplit};
use crate::vocab::{Choice, CollectivePayload, Loss, NormKind, PassOp, PeerDim};

/// The kinds of instruction that can make collectives inside themselves: the passes, and
/// on the update's side the gradient norm's all-reduce, ZeRO's gradient reduce-scatter and
/// the update, which sum the gradients that are partial on each tensor-parallel rank
/// ([`update_sums`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PassKind {
    Forward,
    Recompute,
    Backward,
    BackwardInput,
    BackwardWeight,
    /// The `grad_norm` collective (it settles every stage the device holds).
    GradNorm,
    /// ZeRO's `gradient_shard` collective (it settles its stage first).
    GradientShard,
    /// An optimizer step or a ZeRO shard step.
    Update,
}

impl PassKind {
    /// The pass an instruction runs, if it is one.
    pub fn of(ins: &Instr) -> Option<PassKind> {
        match ins {
            Instr::Forward { .. } => Some(PassKind::Forward),
            Instr::Recompute { .. } => Some(PassKind::Recompute),
            Instr::Backward { .. } => Some(PassKind::Backward),
            Instr::BackwardInput { .. } => Some(PassKind::BackwardInput),
            Instr::BackwardWeight { .. } => Some(PassKind::BackwardWeight),
            Instr::Collective { payload: CollectivePayload::GradNorm, .. } => Some(PassKind::GradNorm),
            Instr::Collective { payload: CollectivePayload::GradientShard, .. } => Some(PassKind::GradientShard),
            Instr::OptimizerStep { .. } | Instr::ShardStep { .. } => Some(PassKind::Update),
            Instr::Collective {
                payload:
                    CollectivePayload::Gradients
                    | CollectivePayload::TiedGradient
                    | CollectivePayload::TiedGradientShard
                    | CollectivePayload::Weights,
                ..
            }
            | Instr::LoadMicrobatch { .. }
            | Instr::SendActivation { .. }
            | Instr::RecvActivation { .. }
            | Instr::SendGradient { .. }
            | Instr::RecvGradient { .. }
            | Instr::WaitCollective { .. }
            | Instr::Free { .. }
            | Instr::StashWeights { .. }
            | Instr::RestoreWeights { .. }
            | Instr::PushGradient { .. }
            | Instr::ApplyGradient { .. }
            | Instr::PushWeights { .. }
            | Instr::PullWeights { .. }
            | Instr::AllToAll { .. } => None,
        }
    }

    /// Its name in messages and plan files.
    pub fn name(self) -> &'static str {
        match self {
            PassKind::Forward => "forward",
            PassKind::Recompute => "recompute",
            PassKind::Backward => "backward",
            PassKind::BackwardInput => "backward_input",
            PassKind::BackwardWeight => "backward_weight",
            PassKind::GradNorm => "grad_norm",
            PassKind::GradientShard => "gradient_shard",
            PassKind::Update => "update",
        }
    }

    /// Whether it is a pass (whose collectives [`declare`] lists), else an instruction of
    /// the update's side ([`update_sums`]).
    pub fn is_pass(self) -> bool {
        match self {
            PassKind::Forward
            | PassKind::Recompute
            | PassKind::Backward
            | PassKind::BackwardInput
            | PassKind::BackwardWeight => true,
            PassKind::GradNorm | PassKind::GradientShard | PassKind::Update => false,
        }
    }

    /// Whether the pass runs the forward's collectives (else the backward's, or none).
    fn forward(self) -> bool {
        match self {
            PassKind::Forward | PassKind::Recompute => true,
            PassKind::Backward
            | PassKind::BackwardInput
            | PassKind::BackwardWeight
            | PassKind::GradNorm
            | PassKind::GradientShard
            | PassKind::Update => false,
        }
    }
}

impl fmt::Display for PassKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One collective inside a pass: at `layer` (the model's index), `op` over `over`.
/// Written in plan files as `"layer:group:op"`, e.g. `"3:tp:all_reduce"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InPass {
    pub layer: u32,
    pub over: PeerDim,
    pub op: PassOp,
}

impl fmt::Display for InPass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.layer, self.over, self.op)
    }
}

impl std::str::FromStr for InPass {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a collective inside a pass (layer:group:op, e.g. 3:tp:all_reduce)");
        let mut parts = s.split(':');
        let (Some(layer), Some(over), Some(op), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        Ok(InPass {
            layer: layer.parse().map_err(|_| bad())?,
            over: PeerDim::from_name(over).ok_or_else(bad)?,
            op: PassOp::from_name(op).ok_or_else(bad)?,
        })
    }
}

impl Serialize for InPass {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for InPass {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// Which declared list the passes of one kind of one stage on a device issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassList {
    pub stage: StageId,
    pub pass: PassKind,
    /// The pass that feeds the stage's bucketed replica reduction
    /// (`plan::reduced_in_buckets`); its list holds the buckets' reductions too.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reduces: bool,
    /// Index into [`InPassTable::lists`].
    pub list: u32,
}

/// Every device's declared collectives inside its passes: the distinct lists once, and per
/// device which list each (stage, kind of pass) it runs issues (a pass not listed issues
/// none); and ZeRO-3's gathers of stages' whole weights, the distinct lists once and per
/// device the index of its own (none: it starts none).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InPassTable {
    pub lists: Vec<Vec<InPass>>,
    pub devices: BTreeMap<DeviceId, Vec<PassList>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gather_lists: Vec<Vec<StageGather>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gathers: BTreeMap<DeviceId, u32>,
}

impl InPassTable {
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.gathers.is_empty()
    }

    /// The gathers of stages' whole weights `device`'s step starts, in order.
    pub fn gathers_of(&self, device: DeviceId) -> &[StageGather] {
        self.gathers.get(&device).and_then(|i| self.gather_lists.get(*i as usize)).map_or(&[], Vec::as_slice)
    }

    /// Declares `list` as the gathers of stages' whole weights `device`'s step starts
    /// (nothing for an empty list), sharing an equal list already declared.
    pub fn insert_gathers(&mut self, device: DeviceId, list: Vec<StageGather>) {
        if list.is_empty() {
            self.gathers.remove(&device);
            return;
        }
        let at = shared(&mut self.gather_lists, list);
        self.gathers.insert(device, at);
    }

    /// What `device`'s passes of `kind` on `stage` issue, in order (empty: nothing); with
    /// `reduces`, the one that feeds the stage's bucketed reduction.
    pub fn of(&self, device: DeviceId, stage: StageId, kind: PassKind, reduces: bool) -> &[InPass] {
        self.devices
            .get(&device)
            .and_then(|l| l.iter().find(|p| p.stage == stage && p.pass == kind && p.reduces == reduces))
            .and_then(|p| self.lists.get(p.list as usize))
            .map_or(&[], Vec::as_slice)
    }

    /// Declares `list` for `device`'s passes of `kind` on `stage` (with `reduces`, the one
    /// feeding the bucketed reduction; nothing for an empty list), sharing an equal list
    /// already declared.
    pub fn insert(&mut self, device: DeviceId, stage: StageId, kind: PassKind, reduces: bool, list: Vec<InPass>) {
        if list.is_empty() {
            return;
        }
        let at = shared(&mut self.lists, list);
        let entries = self.devices.entry(device).or_default();
        entries.retain(|p| !(p.stage == stage && p.pass == kind && p.reduces == reduces));
        entries.push(PassList { stage, pass: kind, reduces, list: at });
    }

    /// The table's own consistency: every list index in range, no (stage, kind) twice on
    /// a device.
    pub fn check(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (d, entries) in &self.devices {
            for (i, p) in entries.iter().enumerate() {
                if p.list as usize >= self.lists.len() {
                    out.push(format!("in_pass: {d}'s list {} is not one of the {} lists", p.list, self.lists.len()));
                }
                if entries[..i].iter().any(|q| q.stage == p.stage && q.pass == p.pass && q.reduces == p.reduces) {
                    out.push(format!("in_pass: {d} declares its {:?} passes of {} twice", p.pass, p.stage));
                }
            }
        }
        for (d, i) in &self.gathers {
            if *i as usize >= self.gather_lists.len() {
                out.push(format!("in_pass: {d}'s gathers {i} are not one of the {} lists", self.gather_lists.len()));
            }
        }
        out
    }
}

/// The index of `list` in `lists`, where it is added unless an equal one is there.
fn shared<T: PartialEq>(lists: &mut Vec<T>, list: T) -> u32 {
    let at = lists.iter().position(|l| *l == list).unwrap_or_else(|| {
        lists.push(list);
        lists.len() - 1
    });
    at as u32
}

/// The parallel degrees a stage's passes run under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub cp: usize,
    /// Context parallelism around a ring (`cp_comm: ring`) rather than gathered.
    pub ring: bool,
    pub ep: usize,
    /// ZeRO-3 on a replicated stage.
    pub zero3: bool,
    /// The stage runs the model's recompute inside its blocks ([`Layers::within`]; not a
    /// stage that recomputes its whole forward).
    pub inside: bool,
}

impl Layout {
    /// Whether the stage's products gather their weights one at a time: ZeRO-3 without
    /// tensor or expert parallelism (beside either, the executor gathers a stage whole for
    /// its passes, between them).
    pub fn per_product(&self) -> bool {
        self.zero3 && self.tp <= 1 && self.ep <= 1
    }
}

/// The whole model as the declaration reads it: its operators, which are either end of a
/// weight tie, whose input carries a gradient within its stage (a stage's own input does
/// past the first stage; the model's data does not), and its loss.
#[derive(Debug, Clone, Copy)]
pub struct Layers<'a> {
    pub ops: &'a [Op],
    pub tied: &'a [bool],
    pub tracked: &'a [bool],
    pub loss: Loss,
    /// Recompute inside the blocks: what a stage's backward runs again of its forward
    /// (`BlockRecompute::run_again`) where its layout says it runs it.
    pub within: Option<&'a crate::recompute::BlockRecompute>,
}

/// How ZeRO-3 gathers an operator's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zero3Gather {
    /// Each product gathers its own weight (the executor's `zero::per_product`) unless the
    /// layer is tied.
    PerProduct,
    /// With the stage, for its passes; `large`: a weight of the model's size class (a
    /// convolution's, a positional table), which `pipec run`'s caveats name.
    WithStage { large: bool },
    /// No weights.
    Nothing,
}

/// The one table of how ZeRO-3 gathers each operator's weights: a new operator is a
/// compile error here until it says.
pub fn zero3_gather(op: &Op) -> Zero3Gather {
    match op {
        Op::Linear { .. } | Op::Embedding { .. } | Op::Lstm { .. } => Zero3Gather::PerProduct,
        // a mixture of experts' tokens decide which experts run: its gathers would not pair
        Op::TransformerBlock { moe: None, .. } => Zero3Gather::PerProduct,
        Op::TransformerBlock { moe: Some(_), .. } => Zero3Gather::WithStage { large: true },
        Op::Conv2d { .. } | Op::PosEmbedding { .. } => Zero3Gather::WithStage { large: true },
        Op::BatchNorm2d { .. } | Op::LayerNorm { .. } | Op::RmsNorm { .. } => Zero3Gather::WithStage { large: false },
        crate::model::weightless!() => Zero3Gather::Nothing,
    }
}

/// Whether pipec's executor gathers layer `op`'s weights product by product under
/// `layout` (ZeRO-3 without tensor or expert parallelism, a layer not `tied`, of a kind
/// gathered per product); else, under ZeRO-3, whole with its stage.
pub fn gathered_per_product(op: &Op, tied: bool, layout: Layout) -> bool {
    layout.per_product() && !tied && zero3_gather(op) == Zero3Gather::PerProduct
}

/// The weights a layer gathers per product under `layout` ([`gathered_per_product`]), by
/// the slot its products read them as, with each one's number of values
/// ([`product_weight_values`]).
fn product_weights(layers: &Layers<'_>, k: usize, layout: Layout) -> Vec<u64> {
    let op = &layers.ops[k];
    if !gathered_per_product(op, layers.tied.get(k).copied().unwrap_or(false), layout) {
        return Vec::new();
    }
    product_weight_values(op)
}

/// The values of each weight matrix of `op` a product reads, in the order the products
/// read them: a linear layer's weight or a token table (one); an LSTM's input and
/// recurrent weights; a block's attention projections (`BlockDims::projections`: the fused
/// QKV, or multi-head latent attention's down and up projections; then the output) and its
/// MLP's up and down projections (its norms and biases are small: under ZeRO-3 pipec's
/// executor gathers them with the stage). Empty for an operator gathered with its stage.
pub fn product_weight_values(op: &Op) -> Vec<u64> {
    let m = |a: usize, b: usize| (a as u64).saturating_mul(b as u64);
    match zero3_gather(op) {
        Zero3Gather::PerProduct => {}
        Zero3Gather::WithStage { .. } | Zero3Gather::Nothing => return Vec::new(),
    }
    match op {
        Op::Linear { in_features, out_features, .. } => vec![m(*in_features, *out_features)],
        Op::Embedding { vocab, dim, .. } => vec![m(*vocab, *dim)],
        // W_ih [4h, in], W_hh [4h, h]
        Op::Lstm { input, hidden } => vec![m(4 * hidden, *input), m(4 * hidden, *hidden)],
        _ => match op.block_dims() {
            Some(b) => {
                let attention = b.projections().into_iter().map(|p| m(p.input, p.output));
                attention.chain([m(b.d, b.up_width), m(b.ff, b.d)]).collect()
            }
            None => Vec::new(),
        },
    }
}

/// A block's attention products before its core (`BlockDims::projections` but the output
/// projection): standard attention's one fused product, multi-head latent attention's down
/// and two up projections. None for another operator.
fn attention_products(op: &Op) -> Option<usize> {
    op.block_dims().map(|b| b.projections().len().saturating_sub(1).max(1))
}

/// What a pass does in order, before the per-product gatherer turns its reads into gathers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Collective(InPass),
    /// A product reads weight `i` of the stage's per-product weights.
    Read(usize),
}

/// What a pass issues: a collective of its own, or the per-product gather of the stage's
/// weight `i`.
enum Issued {
    Collective(InPass),
    Gather(usize),
}

impl Issued {
    fn either(self, gather: impl Fn(usize) -> InPass) -> InPass {
        match self {
            Issued::Collective(c) => c,
            Issued::Gather(i) => gather(i),
        }
    }
}

/// The all-gathers the executor's per-product gatherer (`zero::Gatherer`) issues for a
/// pass's `events`, in place of its reads of the stage's `n` weights: each weight not kept
/// from the product before nor gathered ahead, and with each the next one ahead (the next
/// in the stage's order, or the one before in a pass moving down it — one that first
/// reads the last weight, or then one before the last it read).
fn gathered(events: Vec<Event>, n: usize) -> Vec<Issued> {
    let gather = Issued::Gather;
    let (mut out, mut kept, mut at, mut ahead) = (Vec::new(), None, None::<usize>, None);
    for e in events {
        let id = match e {
            Event::Collective(c) => {
                out.push(Issued::Collective(c));
                continue;
            }
            Event::Read(id) => id,
        };
        if kept == Some(id) {
            continue;
        }
        let came = ahead.take() == Some(id);
        let down = match at {
            Some(before) => before > id,
            None => id + 1 == n && id > 0,
        };
        at = Some(id);
        let next = if down { id.checked_sub(1) } else { Some(id + 1) }.filter(|&x| x < n);
        if !came {
            out.push(gather(id));
        }
        if let Some(x) = next {
            out.push(gather(x));
            ahead = Some(x);
        }
        kept = Some(id);
    }
    out
}

/// Half of a transformer block, as the executor's tensor-parallel segments cut it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// A layer without collectives of its own in the backward.
    Plain,
    Attention,
    Mlp,
}

/// The gradient buckets a pass reduces: it feeds its stage's bucketed replica reduction
/// (`plan::reduced_in_buckets`), and each bucket's reduction starts as soon as the pass
/// has completed its gradients.
#[derive(Debug, Clone, Copy)]
pub struct Buckets<'a> {
    /// Each bucket's first layer (the model's index).
    pub starts: &'a [usize],
    /// An all-reduce (DDP) or, on a sharded stage, a reduce-scatter into the replicas'
    /// shards (ZeRO).
    pub op: PassOp,
}

/// What pipec's executor issues, in order, inside a pass of `kind` of the stage holding
/// layers `range` of `layers`, under `layout`: `first` is the model's first stage (whose
/// first segment's input gradient is not needed), `last` its last (whose forward and
/// recompute compute the loss); `buckets`: the pass feeds the stage's bucketed reduction.
pub fn declare(
    layers: &Layers<'_>,
    range: std::ops::Range<usize>,
    layout: Layout,
    kind: PassKind,
    first: bool,
    last: bool,
    buckets: Option<Buckets<'_>>,
) -> Result<Vec<InPass>, String> {
    let (events, weights) = pass_events(layers, range, layout, (kind, first, last), buckets)?;
    let gather = |i: usize| InPass { layer: weights[i].0, over: PeerDim::Shard, op: PassOp::AllGather };
    Ok(gathered(events, weights.len()).into_iter().map(|g| g.either(gather)).collect())
}

/// The weights ZeRO-3's per-product gatherer gathers in a pass of `kind` (as [`declare`]
/// lists them: its `zero` all-gathers, in order), each as its layer and its number of
/// values ([`product_weight_values`]): what the cost model prices.
pub fn product_gathers(
    layers: &Layers<'_>,
    range: std::ops::Range<usize>,
    layout: Layout,
    (kind, first, last): (PassKind, bool, bool),
) -> Result<Vec<(u32, u64)>, String> {
    let (events, weights) = pass_events(layers, range, layout, (kind, first, last), None)?;
    Ok(gathered(events, weights.len())
        .into_iter()
        .filter_map(|g| match g {
            Issued::Gather(i) => Some(weights[i]),
            Issued::Collective(_) => None,
        })
        .collect())
}

/// A pass's events in order, before the per-product gatherer turns its reads into gathers,
/// and the stage's per-product weights (each its layer and values) the reads name.
type PassEvents = (Vec<Event>, Vec<(u32, u64)>);

fn pass_events(
    layers: &Layers<'_>,
    range: std::ops::Range<usize>,
    layout: Layout,
    (kind, first, last): (PassKind, bool, bool),
    buckets: Option<Buckets<'_>>,
) -> Result<PassEvents, String> {
    let ops = layers.ops;
    let stage = ops.get(range.clone()).ok_or_else(|| format!("layers {range:?} are not in the model"))?;
    let splits = if layout.tp > 1 {
        crate::model::stage_tp_splits(ops, range.clone(), layers.loss, layout.tp)?
    } else {
        vec![TpSplit::Replicated; stage.len()]
    };
    // the stage's per-product weights (ZeRO-3): each one's layer and values, and each
    // layer's first
    let mut weights: Vec<(u32, u64)> = Vec::new();
    let mut base = Vec::with_capacity(stage.len());
    let mut count = Vec::with_capacity(stage.len());
    for k in range.clone() {
        base.push(weights.len());
        let w = product_weights(layers, k, layout);
        count.push(w.len());
        weights.extend(w.into_iter().map(|v| (k as u32, v)));
    }
    let read = |k: usize, slot: usize| -> Option<Event> { (slot < count[k]).then(|| Event::Read(base[k] + slot)) };
    let tracked = |k: usize| layers.tracked.get(range.start + k).copied().unwrap_or(true);
    let at = |k: usize| (range.start + k) as u32;
    let tp = layout.tp > 1;
    let tp_sum = |k: usize| Event::Collective(InPass { layer: at(k), over: PeerDim::Tensor, op: PassOp::AllReduce });
    let mut events: Vec<Event> = Vec::new();
    if !kind.is_pass() {
        return Ok((events, weights));
    }
    // a bucket's reduction, once the pass has the gradients of its layers from `k` on
    let reduce = |k: usize| {
        buckets.filter(|b| b.starts.contains(&(range.start + k))).map(|b| InPass {
            layer: at(k),
            over: PeerDim::Data,
            op: b.op,
        })
    };
    if kind == PassKind::BackwardWeight {
        // the put-off weight products, bucket by bucket, the last layers' first
        let reductions = (0..stage.len()).rev().filter_map(reduce).map(Event::Collective).collect();
        return Ok((reductions, weights));
    }
    // a unit's forward: a layer's, or one half of a block's (the attention's products
    // before the core, its collectives, the output projection; the MLP's up projection, its
    // collectives, its down projection)
    let forward_of = |events: &mut Vec<Event>, k: usize, unit: Unit| {
        let (op, split) = (&stage[k], splits[k]);
        let block = attention_products(op);
        if unit != Unit::Mlp {
            events.extend(read(k, 0));
            if matches!(op, Op::Lstm { .. }) {
                events.extend(read(k, 1));
            }
            if matches!((split, op), (TpSplit::Vocab, Op::Embedding { .. }) | (TpSplit::Row, _)) {
                events.push(tp_sum(k));
            }
        }
        let Some(a) = block else { return };
        if unit != Unit::Mlp {
            for slot in 1..a {
                events.extend(read(k, slot));
            }
            attention(events, op, at(k), layout, true);
            events.extend(read(k, a));
            if tp {
                events.push(tp_sum(k));
            }
        }
        if unit != Unit::Attention {
            events.extend(read(k, a + 1));
            mlp(events, op, at(k), layout, true);
            events.extend(read(k, a + 2));
            if tp {
                events.push(tp_sum(k));
            }
        }
    };
    if kind.forward() {
        for k in 0..stage.len() {
            forward_of(&mut events, k, Unit::Plain);
        }
        // the vocabulary-parallel cross-entropy: each row's maximum, sum of exponentials
        // and target score summed over the group (a recompute computes it again)
        if last && splits.last() == Some(&TpSplit::Vocab) {
            events.extend(std::iter::repeat_n(tp_sum(stage.len() - 1), 3));
        }
        return Ok((events, weights));
    }
    // the backward: without tensor parallelism one pass over the layers in reverse; with
    // it, segment after segment (`executor::parallel::tensor_parallel`), each segment's
    // input gradient summed over the group unless it is already complete
    let mut segments: Vec<(bool, Vec<(usize, Unit)>)> = Vec::new();
    let (mut sum, mut units): (bool, Vec<(usize, Unit)>) = (false, Vec::new());
    for (k, (op, split)) in stage.iter().zip(&splits).enumerate() {
        let post_norm = op.block_dims().is_some_and(|b| b.post_norm);
        match split {
            TpSplit::Column | TpSplit::Vocab if tp && matches!(op, Op::Linear { .. }) => {
                if !units.is_empty() {
                    segments.push((sum, std::mem::take(&mut units)));
                }
                sum = true;
                units.push((k, Unit::Plain));
            }
            TpSplit::Block if tp => {
                if !units.is_empty() {
                    segments.push((sum, std::mem::take(&mut units)));
                }
                segments.push((true, vec![(k, Unit::Attention)]));
                if post_norm {
                    segments.push((false, vec![(k, Unit::Plain)]));
                }
                segments.push((true, vec![(k, Unit::Mlp)]));
                if post_norm {
                    segments.push((false, vec![(k, Unit::Plain)]));
                }
                sum = false;
            }
            _ if op.block_dims().is_some() => {
                units.push((k, Unit::Attention));
                units.push((k, Unit::Mlp));
            }
            _ => units.push((k, Unit::Plain)),
        }
    }
    segments.push((sum, units));
    // what the backward runs again before each unit's backward: a layer whole before its
    // last unit's, a block's half before that half's
    let again = match layers.within.filter(|_| layout.inside) {
        Some(policy) => policy.run_again(&stage.iter().map(|op| op.block_dims().is_some()).collect::<Vec<_>>()),
        None => vec![crate::recompute::RunAgain::Nothing; stage.len()],
    };
    for (i, (sum, units)) in segments.iter().enumerate().rev() {
        for &(k, unit) in units.iter().rev() {
            let op = &stage[k];
            // (a tensor-parallel stage runs a whole block again by its halves, its segments)
            use crate::recompute::RunAgain;
            match (again[k], unit) {
                (RunAgain::Whole, Unit::Mlp) if !tp => forward_of(&mut events, k, Unit::Plain),
                (RunAgain::Whole, Unit::Attention | Unit::Mlp) if tp => forward_of(&mut events, k, unit),
                (RunAgain::Halves(h), Unit::Attention) if h.attention => forward_of(&mut events, k, Unit::Attention),
                (RunAgain::Halves(h), Unit::Mlp) if h.mlp => forward_of(&mut events, k, Unit::Mlp),
                _ => {}
            }
            match unit {
                // a table's lookup reads nothing back; a product whose input carries no
                // gradient computes none
                Unit::Plain => match op {
                    Op::Lstm { .. } => {
                        events.extend(read(k, 1));
                        events.extend(read(k, 0).filter(|_| tracked(k)));
                    }
                    Op::Embedding { .. } => {}
                    _ => events.extend(read(k, 0).filter(|_| tracked(k))),
                },
                Unit::Attention => {
                    let a = attention_products(op).unwrap_or(1);
                    events.extend(read(k, a));
                    attention(&mut events, op, at(k), layout, false);
                    // the products in reverse, each reading its weight for its input's
                    // gradient: a product of the block's input (its norm's output, or under
                    // post-norm the input itself) only when that input carries one
                    let b = op.block_dims();
                    let post_norm = b.is_some_and(|b| b.post_norm);
                    let of_input =
                        |slot: usize| slot == 0 || (slot == 1 && b.and_then(|b| b.mla).is_some_and(|m| m.q_lora == 0));
                    for slot in (0..a).rev() {
                        events.extend(read(k, slot).filter(|_| !of_input(slot) || tracked(k) || !post_norm));
                    }
                }
                Unit::Mlp => {
                    let a = attention_products(op).unwrap_or(1);
                    events.extend(read(k, a + 2));
                    mlp(&mut events, op, at(k), layout, false);
                    events.extend(read(k, a + 1));
                }
            }
            // the bucket starting at this layer is complete once its first unit is
            if unit != Unit::Mlp {
                events.extend(reduce(k).map(Event::Collective));
            }
        }
        if i == 0 && first {
            break;
        }
        if tp && *sum {
            events.push(tp_sum(units.first().map_or(0, |u| u.0)));
        }
    }
    Ok((events, weights))
}

/// The parameters of the stage holding layers `range` of `ops` whose gradients are partial
/// on each of `tp` ranks and are summed over the group before they are read whole: the
/// norms feeding a block's column-parallel projections (gain and, for a layer norm, bias)
/// and a mixture of experts' router, which weighs the rank's partial expert outputs, and
/// with biases each expert's down projection's bias, which rank 0 alone adds to its partial
/// output (a post-norm block's norms follow its all-reduces instead: their gradients are
/// whole; with `whole_experts`, `etp: 1`, a routed expert runs whole on one rank, its
/// bias's gradient whole there).
/// Each as its checkpoint id (layer << 8 | slot), in the layers' order.
pub fn tp_partial_ids(
    ops: &[Op],
    range: std::ops::Range<usize>,
    loss: Loss,
    tp: usize,
    whole_experts: bool,
) -> Result<Vec<u64>, String> {
    Ok(partial_parameters(ops, range, loss, tp, whole_experts)?.into_iter().map(|p| p.id).collect())
}

/// The values one member of a tensor-parallel group sums at the update's side, in the one
/// all-reduce pipec's executor makes of a stage's [`tp_partial_ids`]: each parameter's
/// values (a norm's gain or bias: the block's width; a router: width × experts; an expert's
/// bias: the width), a routed expert's bias only where the member holds the expert — 1/`ep`
/// of them under expert parallelism, the same number at every position of the group.
pub fn tp_partial_values(
    ops: &[Op],
    range: std::ops::Range<usize>,
    loss: Loss,
    (tp, ep): (usize, usize),
    whole_experts: bool,
) -> Result<usize, String> {
    let partial = partial_parameters(ops, range, loss, tp, whole_experts)?;
    let (routed, other): (Vec<_>, Vec<_>) = partial.into_iter().partition(|p| p.routed_expert);
    let held = routed.iter().map(|p| p.values).sum::<usize>() / ep.max(1);
    Ok(other.iter().map(|p| p.values).sum::<usize>() + held)
}

/// One gradient that is partial on each tensor-parallel rank ([`tp_partial_ids`]).
struct PartialParameter {
    /// Its checkpoint id (layer << 8 | slot).
    id: u64,
    /// Its number of values.
    values: usize,
    /// A routed expert's down projection's bias, which only the expert's holders have.
    routed_expert: bool,
}

fn partial_parameters(
    ops: &[Op],
    range: std::ops::Range<usize>,
    loss: Loss,
    tp: usize,
    whole_experts: bool,
) -> Result<Vec<PartialParameter>, String> {
    if tp <= 1 {
        return Ok(Vec::new());
    }
    let splits = crate::model::stage_tp_splits(ops, range.clone(), loss, tp)?;
    let whole = |(id, values): (u64, usize)| PartialParameter { id, values, routed_expert: false };
    Ok(splits
        .iter()
        .enumerate()
        .filter_map(|(k, s)| {
            let b = ops.get(range.start + k)?.block_dims()?;
            (*s == TpSplit::Block && !b.post_norm).then_some(((range.start + k) as u64, b))
        })
        .flat_map(|(layer, b)| {
            let l = layer << 8;
            let bias = b.norm == NormKind::LayerNorm;
            let router = b.moe.map(|m| (l | crate::model::ROUTER_SLOT, b.d * m.experts));
            // the query and key norms' gains: every rank's heads use the whole gain
            let qk = |slot: u64| b.qk_norm.then_some((l | slot, b.qk_head));
            // multi-head latent attention's down projection and latents' norms: whole on
            // every rank, each rank's heads' share of their gradients
            let down = b.latent().map(|w| (l | crate::model::LATENT_DOWN_SLOT, w.down[0] * w.down[1]));
            let norms = b.latent().map(|w| (l | crate::model::LATENT_NORMS_SLOT, w.norms));
            // each expert's down projection's bias (routed and shared): rank 0 adds it to its
            // partial output, so its gradient is there alone
            let (routed, shared) = b.moe.filter(|_| b.bias).map_or((0, 0), |m| (m.experts, m.shared));
            let expert_biases = (0..routed + shared).filter(move |&e| !(whole_experts && e < routed)).map(move |e| {
                PartialParameter { id: l | (crate::model::expert_slot(e) + 3), values: b.d, routed_expert: e < routed }
            });
            [
                Some((l, b.d)),
                bias.then_some((l | 1, b.d)),
                Some((l | 6, b.d)),
                bias.then_some((l | 7, b.d)),
                router,
                qk(crate::model::Q_NORM_SLOT),
                qk(crate::model::K_NORM_SLOT),
                down,
                norms,
            ]
            .into_iter()
            .flatten()
            .map(whole)
            .chain(expert_biases)
        })
        .collect())
}

/// What the update's side of one device's step (`stream`) sums over the tensor-parallel
/// group, per instruction of a kind that may (its position and list, perhaps empty): the
/// first instruction to read a stage's accumulated gradients whole — the `grad_norm`
/// all-reduce (every stage the device holds, in stage order), ZeRO's `gradient_shard`
/// reduce-scatter, or the optimizer step — sums its partial ones (`partial`: a
/// tensor-parallel stage's sums, each one's layer: pipec's executor sums a stage's
/// [`tp_partial_ids`] in one all-reduce, declared at the stage's first layer), once until
/// the update or the reduce-scatter
/// (ZeRO-2 and 3 scatter every contribution) takes them; with `clip_each_update` (gradient
/// clipping by the stage's own norm, under a schedule that does not sum the global one)
/// each update of a tensor-parallel stage sums its squared norm too.
pub fn update_sums(
    stream: &[Instr],
    partial: &BTreeMap<StageId, Vec<u32>>,
    first_layer: &dyn Fn(StageId) -> u32,
    clip_each_update: bool,
) -> Vec<(usize, Vec<InPass>)> {
    let sum = |layer: u32| InPass { layer, over: PeerDim::Tensor, op: PassOp::AllReduce };
    let partial: BTreeMap<StageId, Vec<InPass>> =
        partial.iter().map(|(s, layers)| (*s, layers.iter().map(|&l| sum(l)).collect())).collect();
    update_sums_of(stream, &partial, &|s| sum(first_layer(s)), clip_each_update)
}

/// The rule of [`update_sums`] over any description of a sum: `partial` each
/// tensor-parallel stage's sums of partial gradients, `norm_sum` the sum of a stage's
/// squared norm under `clip_each_update` (the declaration's entries; the cost model's
/// seconds).
pub fn update_sums_of<T: Clone>(
    stream: &[Instr],
    partial: &BTreeMap<StageId, Vec<T>>,
    norm_sum: &dyn Fn(StageId) -> T,
    clip_each_update: bool,
) -> Vec<(usize, Vec<T>)> {
    let mut settled: std::collections::BTreeSet<StageId> = Default::default();
    let settle = |s: StageId, settled: &mut std::collections::BTreeSet<StageId>, out: &mut Vec<T>| {
        if let Some(sums) = partial.get(&s).filter(|_| settled.insert(s)) {
            out.extend(sums.iter().cloned());
        }
    };
    let mut found = Vec::new();
    for (i, ins) in stream.iter().enumerate() {
        let Some(kind) = PassKind::of(ins) else { continue };
        let stage = ins.stage();
        let mut out = Vec::new();
        match kind {
            PassKind::GradNorm => {
                for &s in partial.keys() {
                    settle(s, &mut settled, &mut out);
                }
            }
            PassKind::GradientShard => {
                // it takes the gradients: the next contribution's are partial again
                settle(stage, &mut settled, &mut out);
                settled.remove(&stage);
            }
            PassKind::Update => {
                // an optimizer step reads the stage's gradients whole; a shard step the
                // shard its reduce-scatters summed
                if matches!(ins, Instr::OptimizerStep { .. }) {
                    settle(stage, &mut settled, &mut out);
                }
                if clip_each_update && partial.contains_key(&stage) {
                    out.push(norm_sum(stage));
                }
                // the update clears the stage's gradients: the next ones are partial again
                settled.remove(&stage);
            }
            PassKind::Forward
            | PassKind::Recompute
            | PassKind::Backward
            | PassKind::BackwardInput
            | PassKind::BackwardWeight => continue,
        }
        found.push((i, out));
    }
    found
}

/// A block's attention: context parallelism's keys and values gathered (forward; their
/// gradients reduce-scattered back in the backward) or passed around the ring (`cp − 1`
/// passes forward; backward the group's keys and values gathered and their gradients
/// reduce-scattered).
fn attention(out: &mut Vec<Event>, op: &Op, layer: u32, layout: Layout, forward: bool) {
    if layout.cp <= 1 || op.block_dims().is_none() {
        return;
    }
    let ops: Vec<PassOp> = match (layout.ring, forward) {
        (true, true) => vec![PassOp::RingPass; layout.cp - 1],
        (true, false) => vec![PassOp::AllGather, PassOp::ReduceScatter],
        (false, true) => vec![PassOp::AllGather; 2],
        (false, false) => vec![PassOp::ReduceScatter; 2],
    };
    out.extend(ops.into_iter().map(|op| Event::Collective(InPass { layer, over: PeerDim::Context, op })));
}

/// A mixture-of-experts block's MLP: under context parallelism with a capacity or a
/// balancing loss the members' routing counts gathered (forward); with expert parallelism
/// the members' per-expert row counts, the dispatch and the combine exchanged (forward),
/// the combine's and the dispatch's gradients (backward).
fn mlp(out: &mut Vec<Event>, op: &Op, layer: u32, layout: Layout, forward: bool) {
    let Some(m) = op.moe() else { return };
    let push = |out: &mut Vec<Event>, over, op| out.push(Event::Collective(InPass { layer, over, op }));
    if forward && layout.cp > 1 && (m.capacity > 0.0 || m.aux_loss > 0.0) {
        push(out, PeerDim::Context, PassOp::AllGather);
    }
    if layout.ep > 1 {
        for _ in 0..if forward { 3 } else { 2 } {
            push(out, PeerDim::Expert, PassOp::AllToAll);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stage's partial gradients under tensor parallelism: per pre-norm block its two
    /// norms' gains, a router, and with biases each expert's; a member of an expert group
    /// sums the biases of the 1/ep of the routed experts it holds, and every shared one's.
    #[test]
    fn a_members_partial_gradients_count_the_experts_it_holds() {
        let mut block = Op::llama_block(16, 4, 2, 24);
        if let Op::TransformerBlock { moe, bias, .. } = &mut block {
            *moe = Some(crate::model::Moe { shared: 1, ..crate::model::Moe::new(4, 2) });
            *bias = true;
        }
        let ops = vec![block.clone(), block];
        let ids = tp_partial_ids(&ops, 0..2, Loss::CrossEntropy, 2, false).expect("ids");
        // two gains, a router and five experts' biases a block
        assert_eq!(ids.len(), 2 * 8);
        let values = |ep| tp_partial_values(&ops, 0..2, Loss::CrossEntropy, (2, ep), false).expect("values");
        let (gains, router, bias) = (2 * 16, 16 * 4, 16);
        assert_eq!(values(1), 2 * (gains + router + 5 * bias));
        assert_eq!(values(2), 2 * (gains + router + (2 + 1) * bias));
        assert_eq!(values(4), 2 * (gains + router + (1 + 1) * bias));
        // no tensor parallelism: nothing partial
        assert_eq!(tp_partial_values(&ops, 0..2, Loss::CrossEntropy, (1, 2), false), Ok(0));
        // routed experts whole on one rank (`etp: 1`): their biases' gradients are whole
        // there; the shared expert's stays split
        let whole = tp_partial_ids(&ops, 0..2, Loss::CrossEntropy, 2, true).expect("ids");
        assert_eq!(whole.len(), 2 * 4, "{whole:?}");
        let whole_values = tp_partial_values(&ops, 0..2, Loss::CrossEntropy, (2, 2), true).expect("values");
        assert_eq!(whole_values, 2 * (gains + router + bias));
    }

    #[test]
    fn an_entry_reads_back_as_written_and_a_bad_one_is_refused() {
        let e = InPass { layer: 3, over: PeerDim::Tensor, op: PassOp::AllReduce };
        assert_eq!(e.to_string(), "3:tp:all_reduce");
        assert_eq!("3:tp:all_reduce".parse::<InPass>(), Ok(e));
        for bad in ["3:tp", "x:tp:all_reduce", "3:pp:all_reduce", "3:tp:sum", "3:tp:all_reduce:1"] {
            assert!(bad.parse::<InPass>().is_err(), "{bad}");
        }
    }

    #[test]
    fn equal_lists_are_stored_once() {
        let e = InPass { layer: 0, over: PeerDim::Expert, op: PassOp::AllToAll };
        let mut t = InPassTable::default();
        t.insert(DeviceId(0), StageId(0), PassKind::Forward, false, vec![e; 3]);
        t.insert(DeviceId(1), StageId(0), PassKind::Forward, false, vec![e; 3]);
        t.insert(DeviceId(1), StageId(0), PassKind::Backward, false, Vec::new());
        assert_eq!(t.lists.len(), 1);
        assert_eq!(t.of(DeviceId(1), StageId(0), PassKind::Forward, false).len(), 3);
        assert!(t.of(DeviceId(1), StageId(0), PassKind::Backward, false).is_empty());
        assert!(t.check().is_empty());
    }

    #[test]
    fn a_tensor_parallel_language_model_sums_as_megatron_does() {
        let gpt = [
            Op::embedding(128, 64),
            Op::PosEmbedding { max_len: 64, dim: 64 },
            Op::block(64, 4, 256, true),
            Op::layer_norm(64),
            Op::Linear { in_features: 64, out_features: 128, bias: false },
        ];
        let layout = Layout { tp: 2, cp: 1, ring: false, ep: 1, zero3: false, inside: false };
        let layers = Layers {
            ops: &gpt,
            tied: &[false; 5],
            tracked: &[false, true, true, true, true],
            loss: Loss::CrossEntropy,
            within: None,
        };
        let ops = |kind, first, last, range: std::ops::Range<usize>| -> Vec<String> {
            declare(&layers, range, layout, kind, first, last, None)
                .expect("declared")
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        // the embedding's sum, the block's two, the loss's three
        assert_eq!(
            ops(PassKind::Forward, true, true, 0..5),
            [
                "0:tp:all_reduce",
                "2:tp:all_reduce",
                "2:tp:all_reduce",
                "4:tp:all_reduce",
                "4:tp:all_reduce",
                "4:tp:all_reduce"
            ]
        );
        // the output layer's input gradient, then the block's two halves'; the embedding's
        // segment on the first stage needs none
        assert_eq!(
            ops(PassKind::Backward, true, true, 0..5),
            ["4:tp:all_reduce", "2:tp:all_reduce", "2:tp:all_reduce"]
        );
        // a recompute of the last stage computes the loss again; a weight pass makes nothing
        assert_eq!(
            ops(PassKind::Recompute, false, true, 2..5),
            ["2:tp:all_reduce", "2:tp:all_reduce", "4:tp:all_reduce", "4:tp:all_reduce", "4:tp:all_reduce"]
        );
        assert_eq!(ops(PassKind::Recompute, false, false, 2..4), ["2:tp:all_reduce", "2:tp:all_reduce"]);
        assert!(ops(PassKind::BackwardWeight, false, true, 2..5).is_empty());
    }

    #[test]
    fn zero_3_gathers_each_product_weight_with_the_next_ahead() {
        let mlp = [
            Op::Linear { in_features: 8, out_features: 16, bias: true },
            Op::Relu,
            Op::Linear { in_features: 16, out_features: 16, bias: true },
            Op::Relu,
            Op::Linear { in_features: 16, out_features: 4, bias: true },
        ];
        let layout = Layout { tp: 1, cp: 1, ring: false, ep: 1, zero3: true, inside: false };
        let layers = Layers {
            ops: &mlp,
            tied: &[false; 5],
            tracked: &[false, true, true, true, true],
            loss: Loss::CrossEntropy,
            within: None,
        };
        let layers_of = |kind, first| -> Vec<u32> {
            let got = declare(&layers, 0..5, layout, kind, first, true, None).expect("declared");
            assert!(got.iter().all(|e| (e.over, e.op) == (PeerDim::Shard, PassOp::AllGather)));
            got.iter().map(|e| e.layer).collect()
        };
        // forward: each weight in turn, the next gathered ahead while one is used
        assert_eq!(layers_of(PassKind::Forward, true), [0, 2, 4]);
        // backward: down the order; the first layer's input carries no gradient on the
        // first stage, so its weight is read by no product, but was gathered ahead
        assert_eq!(layers_of(PassKind::Backward, true), [4, 2, 0]);
        assert!(layers_of(PassKind::BackwardWeight, true).is_empty());
        // a read out of the order: the weight gathered ahead is not it, so both are issued
        assert_eq!(gathered(vec![Event::Read(0), Event::Read(2)], 3).len(), 3);
        // a weight read again by the next product is kept, not gathered again
        assert_eq!(gathered(vec![Event::Read(0), Event::Read(0)], 1).len(), 1);
        // beside tensor or expert parallelism the stage is gathered whole between passes
        for layout in [Layout { tp: 2, ..layout }, Layout { ep: 2, ..layout }] {
            assert!(!layout.per_product());
            let got = declare(&layers, 0..5, layout, PassKind::Forward, true, true, None).expect("declared");
            assert!(got.iter().all(|e| e.over != PeerDim::Shard), "{got:?}");
        }
    }
}
