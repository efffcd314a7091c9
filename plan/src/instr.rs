//! The closed instruction set that the compiler emits and the executor interprets, one
//! ordered stream per device. Every instruction names the buffers it reads and writes, so the
//! verifier can check data flow without knowing what the instruction computes.

use serde::{Deserialize, Serialize};
use std::fmt;

pub use crate::vocab::{CollectiveKind, CollectivePayload, TokenExchange};

/// Identifies a device of the cluster (0-based, node-major).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeviceId(pub u32);

/// Identifies a pipeline stage (a virtual stage for interleaved schedules): a contiguous
/// range of layers with its own weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StageId(pub u32);

/// Identifies a microbatch within a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MicrobatchId(pub u32);

/// Identifies a group of devices that take part in one collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct GroupId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "d{}", self.0)
    }
}
impl fmt::Display for StageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}", self.0)
    }
}
impl fmt::Display for MicrobatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}", self.0)
    }
}
impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// A set of devices as a report writes it: runs of three or more consecutive ids as ranges,
/// and past one device the count — `d0–d127 (128 devices)`, `d0–d3, d8–d11 (8 devices)`,
/// `d0,d1` — so a report at 128 devices names them in a line. Past eight runs the rest is
/// elided (`…`).
pub fn devices_text(ids: &[DeviceId]) -> String {
    let mut sorted: Vec<u32> = ids.iter().map(|d| d.0).collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for id in &sorted {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == *id => *end = *id,
            _ => runs.push((*id, *id)),
        }
    }
    const SHOWN: usize = 8;
    let mut parts: Vec<String> = Vec::new();
    for &(start, end) in runs.iter().take(SHOWN) {
        match end - start {
            0 => parts.push(format!("d{start}")),
            1 => parts.push(format!("d{start},d{end}")),
            _ => parts.push(format!("d{start}–d{end}")),
        }
    }
    if runs.len() > SHOWN {
        parts.push("…".into());
    }
    let ranged = runs.iter().any(|(s, e)| e - s > 1) || runs.len() > SHOWN;
    let text = parts.join(if ranged { ", " } else { "," });
    if ranged {
        format!("{text} ({} devices)", sorted.len())
    } else {
        text
    }
}

/// A buffer an instruction reads or writes. Activation buffers are per (stage, microbatch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "buffer", rename_all = "snake_case")]
pub enum Buffer {
    /// The input of `stage` for `mb` (received, or loaded for the first stage).
    Input { stage: StageId, mb: MicrobatchId },
    /// The labels of `mb` (the last stage's loss needs them).
    Labels { mb: MicrobatchId },
    /// What `stage` keeps from its forward of `mb` for the backward (activations).
    Saved { stage: StageId, mb: MicrobatchId },
    /// The output of `stage` for `mb` (to be sent to the next stage).
    Output { stage: StageId, mb: MicrobatchId },
    /// The gradient w.r.t. the output of `stage` for `mb` (received from the next stage).
    OutputGrad { stage: StageId, mb: MicrobatchId },
    /// The gradient w.r.t. the input of `stage` for `mb` (sent to the previous stage).
    InputGrad { stage: StageId, mb: MicrobatchId },
    /// The accumulated weight gradients of `stage`.
    WeightGrad { stage: StageId },
    /// The weights of `stage` (whole: what a forward and a backward compute with).
    Weights { stage: StageId },
    /// ZeRO: the replica's shard of `stage`'s master weights (and their optimizer state).
    WeightShard { stage: StageId },
    /// ZeRO: the replica's shard of `stage`'s reduced weight gradients, summed over the
    /// replicas and the microbatches reduced so far.
    GradShard { stage: StageId },
    /// A stashed weight version of `stage` for `mb` (PipeDream weight stashing).
    Stash { stage: StageId, mb: MicrobatchId },
    /// What a collective of `stage` over `group` holds while it is in flight (between its
    /// `Collective` and its `WaitCollective`).
    InFlight { stage: StageId, group: GroupId },
    /// Gradient clipping: the whole model's gradient norm, summed over every device.
    GradNorm,
}

/// Expert parallelism: one mixture-of-experts layer of a stage and the bytes per member of
/// each all-to-all its passes post there ([`Instr::all_to_alls_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertExchange {
    pub layer: u32,
    pub bytes: u64,
    /// The layer's backward runs its mixture's forward again first (recompute inside the
    /// blocks), dispatching and combining again before it exchanges the gradients.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub again: bool,
}

/// One instruction of a device's stream.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Instr {
    /// Load microbatch `mb`'s inputs (first stage) and/or labels (last stage).
    LoadMicrobatch { stage: StageId, mb: MicrobatchId, inputs: bool, labels: bool },
    /// Forward of `stage` on `mb`. On the last stage it also computes the loss from the
    /// labels, which seeds the gradient (`OutputGrad`) its backward starts from.
    Forward { stage: StageId, mb: MicrobatchId },
    /// Full backward of `stage` on `mb`: input gradient and weight gradient.
    Backward { stage: StageId, mb: MicrobatchId },
    /// Zero-bubble split: gradient w.r.t. the stage input only.
    BackwardInput { stage: StageId, mb: MicrobatchId },
    /// Zero-bubble split: gradient w.r.t. the weights, after `BackwardInput`.
    BackwardWeight { stage: StageId, mb: MicrobatchId },
    /// Re-run the forward of `stage` on `mb` from its saved input (activation recompute).
    Recompute { stage: StageId, mb: MicrobatchId },
    /// Send `stage`'s output activation for `mb` to `peer` (which runs `stage + 1`).
    SendActivation { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// Receive the input activation of `stage` for `mb` from `peer`.
    RecvActivation { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// Send the gradient w.r.t. `stage`'s input for `mb` to `peer` (which runs `stage - 1`).
    SendGradient { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// Receive the gradient w.r.t. `stage`'s output for `mb` from `peer`.
    RecvGradient { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// Start a collective: `kind` over the members of `group`, on what `payload` names of
    /// `stage`, `bytes` per member. It runs on the device's communication engine, which
    /// takes a device's collectives one at a time in the order they were started, while
    /// the device goes on computing; `WaitCollective` waits for it, and nothing may touch
    /// what it carries in between. Its uses:
    /// - `Gradients`: the weight gradients of `stage` (with its batch statistics), summed
    ///   over the stage's replica group (ring all-reduce, or a parameter server when the
    ///   plan says so).
    /// - `TiedGradient`: weight tying across stages: the gradient of the tied weight
    ///   `stage` holds (an embedding table, or the output projection that is its
    ///   transpose) summed with the other copies' over every device holding one, after the
    ///   replica all-reduces, so every copy applies the same sum. In the group the first
    ///   device holding each tied stage contributes its gradient, the others zero.
    /// - `GradientShard` (ZeRO): the weight gradients of `stage` reduce-scattered over its
    ///   replica group; the start takes them (the next backward accumulates afresh), the
    ///   wait adds this replica's chunk of the sum to its gradient shard.
    /// - `TiedGradientShard` (ZeRO): `TiedGradient` on shards: every device contributes its
    ///   shard of the tied weight's gradient in place (zeros elsewhere) and takes its own
    ///   shard of the sum back.
    /// - `Weights` (ZeRO stages 1 and 2): the updated weight shards of `stage` all-gathered
    ///   over its replica group into the whole weights.
    /// - `GradNorm` (gradient clipping): the device's share of the squared norm of the whole
    ///   model's gradient, after every reduction of its stages' gradients, summed over every
    ///   device; each update scales its gradients by the clipping factor of the sum.
    Collective { kind: CollectiveKind, payload: CollectivePayload, stage: StageId, group: GroupId, bytes: u64 },
    /// Wait until the last collective `stage` started over `group` has finished: its
    /// result is in place afterwards (the summed gradient, for an optimizer step).
    WaitCollective { payload: CollectivePayload, stage: StageId, group: GroupId },
    /// Expert parallelism: an all-to-all that the pass just before it (a forward,
    /// recompute or input-gradient backward of `stage` on `mb`) posts at its
    /// mixture-of-experts layer `layer`, over the expert group `group`, `bytes` per member
    /// (what the busiest member receives under the plan's routing assumption). The pass
    /// starts it on the device's communication engine and waits for it before going on:
    /// the pass ends when its last exchange does. A pass posts one list, in order
    /// ([`Instr::all_to_alls_of`]), and every member of the group posts the same list.
    AllToAll { stage: StageId, mb: MicrobatchId, layer: u32, exchange: TokenExchange, group: GroupId, bytes: u64 },
    /// Keep the weights `mb`'s forward uses, for its backward (PipeDream weight stashing):
    /// the current ones, or with `version` (vertical sync) the stage's weights after that
    /// many of this step's updates — the version the first stage used for `mb`.
    StashWeights {
        stage: StageId,
        mb: MicrobatchId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        version: Option<u32>,
    },
    /// Swap in the weights stashed for `mb` before its backward; the newest weights return
    /// after the backward.
    RestoreWeights { stage: StageId, mb: MicrobatchId },
    /// Apply the accumulated gradients of `stage` and clear them.
    OptimizerStep { stage: StageId },
    /// ZeRO: apply the replica's reduced gradient shard to its shard of the master weights
    /// and optimizer state, and clear it. The whole weights are stale afterwards until a
    /// `weights` all-gather lands (stages 1 and 2; under stage 3 every pass gathers them).
    ShardStep { stage: StageId },
    /// Drop what `stage` kept for `mb`.
    Free { stage: StageId, mb: MicrobatchId },
    /// Asynchronous data parallelism: send this microbatch's weight gradient to the
    /// parameter server `peer` and clear it.
    PushGradient { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// On the parameter server: receive worker `peer`'s gradient of `mb` and apply it to the
    /// master weights at once (one optimizer update).
    ApplyGradient { peer: DeviceId, stage: StageId, mb: MicrobatchId, bytes: u64 },
    /// On the parameter server: send the current master weights to worker `peer`.
    PushWeights { peer: DeviceId, stage: StageId, round: u32, bytes: u64 },
    /// On a worker: replace its (stale) weights with the parameter server's.
    PullWeights { peer: DeviceId, stage: StageId, round: u32, bytes: u64 },
}

/// What a point-to-point message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Payload {
    /// A stage's output activation, to the next stage.
    Activation,
    /// The gradient w.r.t. a stage's input, to the previous stage.
    Gradient,
    /// Asynchronous data parallelism: a worker's weight gradient, to the parameter server.
    WeightGradient,
    /// Asynchronous data parallelism: the parameter server's weights, to a worker.
    Weights,
}

impl Payload {
    /// The payload's code on the wire (MPI headers).
    pub fn code(self) -> u8 {
        match self {
            Payload::Activation => 0,
            Payload::Gradient => 1,
            Payload::WeightGradient => 3,
            Payload::Weights => 4,
        }
    }
    /// The payload with wire code `code`.
    pub fn from_code(code: u8) -> Option<Payload> {
        [Payload::Activation, Payload::Gradient, Payload::WeightGradient, Payload::Weights]
            .into_iter()
            .find(|p| p.code() == code)
    }
}

/// The identity of a point-to-point message, the same at both ends: the payload, the stage
/// that sends it, and the microbatch (or, for weights, the round). A link delivers messages
/// in order; a receive names the message it expects next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MessageId {
    pub payload: Payload,
    /// The sending stage (`stage - 1` for an activation a stage receives).
    pub stage: StageId,
    /// The microbatch, or the parameter server's round for weights.
    pub index: u32,
}

impl MessageId {
    /// `stage`'s output activation for `mb`.
    pub fn activation(stage: StageId, mb: MicrobatchId) -> MessageId {
        MessageId { payload: Payload::Activation, stage, index: mb.0 }
    }
    /// The gradient `stage` sends back for `mb` (w.r.t. its input).
    pub fn gradient(stage: StageId, mb: MicrobatchId) -> MessageId {
        MessageId { payload: Payload::Gradient, stage, index: mb.0 }
    }
    /// A worker's weight gradient of `stage` for `mb`, to the parameter server.
    pub fn weight_gradient(stage: StageId, mb: MicrobatchId) -> MessageId {
        MessageId { payload: Payload::WeightGradient, stage, index: mb.0 }
    }
    /// The parameter server's weights of `stage` after `round`.
    pub fn weights(stage: StageId, round: u32) -> MessageId {
        MessageId { payload: Payload::Weights, stage, index: round }
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.payload {
            Payload::Activation => "activation",
            Payload::Gradient => "gradient",
            Payload::WeightGradient => "weight gradient",
            Payload::Weights => "weights",
        };
        match self.payload {
            Payload::Weights => write!(f, "{what} of {} round {}", self.stage, self.index),
            _ => write!(f, "{what} of {} {}", self.stage, MicrobatchId(self.index)),
        }
    }
}

/// Which end of a message an instruction is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum End {
    Send,
    Recv,
}

/// A point-to-point instruction seen as a message: which end, the other device, what it
/// carries and how many bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub end: End,
    pub peer: DeviceId,
    /// None only for a receive no stage can send (an activation into stage 0).
    pub id: Option<MessageId>,
    pub bytes: u64,
}

/// The compute kind of an instruction, for timelines and schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Phase {
    Forward,
    Backward,
    BackwardInput,
    BackwardWeight,
    Recompute,
    Communication,
    Collective,
    Optimizer,
    Memory,
}

impl Phase {
    /// Every phase, in a step's order.
    pub const ALL: [Phase; 9] = [
        Phase::Forward,
        Phase::Recompute,
        Phase::Backward,
        Phase::BackwardInput,
        Phase::BackwardWeight,
        Phase::Communication,
        Phase::Collective,
        Phase::Optimizer,
        Phase::Memory,
    ];

    /// The phase as timelines and reports name it.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::BackwardInput => "backward (input)",
            Phase::BackwardWeight => "backward (weights)",
            Phase::Recompute => "recompute",
            Phase::Communication => "send/receive",
            Phase::Collective => "collective",
            Phase::Optimizer => "optimizer",
            Phase::Memory => "memory",
        }
    }
}

/// The pattern of every point-to-point instruction, binding its peer: one list for the
/// exhaustive matches below.
macro_rules! point_to_point {
    ($peer:ident) => {
        Instr::SendActivation { peer: $peer, .. }
            | Instr::RecvActivation { peer: $peer, .. }
            | Instr::SendGradient { peer: $peer, .. }
            | Instr::RecvGradient { peer: $peer, .. }
            | Instr::PushGradient { peer: $peer, .. }
            | Instr::ApplyGradient { peer: $peer, .. }
            | Instr::PushWeights { peer: $peer, .. }
            | Instr::PullWeights { peer: $peer, .. }
    };
}

/// The pattern of every instruction about one microbatch, binding it: one list for
/// `microbatch` and `map_microbatch`.
macro_rules! about_microbatch {
    ($mb:ident) => {
        Instr::LoadMicrobatch { mb: $mb, .. }
            | Instr::Forward { mb: $mb, .. }
            | Instr::Backward { mb: $mb, .. }
            | Instr::BackwardInput { mb: $mb, .. }
            | Instr::BackwardWeight { mb: $mb, .. }
            | Instr::Recompute { mb: $mb, .. }
            | Instr::SendActivation { mb: $mb, .. }
            | Instr::RecvActivation { mb: $mb, .. }
            | Instr::SendGradient { mb: $mb, .. }
            | Instr::RecvGradient { mb: $mb, .. }
            | Instr::StashWeights { mb: $mb, .. }
            | Instr::RestoreWeights { mb: $mb, .. }
            | Instr::Free { mb: $mb, .. }
            | Instr::PushGradient { mb: $mb, .. }
            | Instr::ApplyGradient { mb: $mb, .. }
            | Instr::AllToAll { mb: $mb, .. }
    };
}

/// The pattern of every instruction about no single microbatch (the rest of
/// `about_microbatch`'s list, so the matches stay exhaustive).
macro_rules! about_no_microbatch {
    () => {
        Instr::Collective { .. }
            | Instr::WaitCollective { .. }
            | Instr::OptimizerStep { .. }
            | Instr::ShardStep { .. }
            | Instr::PushWeights { .. }
            | Instr::PullWeights { .. }
    };
}

/// The pattern of every instruction that involves no other device (neither a message nor
/// a collective).
macro_rules! on_device {
    () => {
        Instr::LoadMicrobatch { .. }
            | Instr::Forward { .. }
            | Instr::Backward { .. }
            | Instr::BackwardInput { .. }
            | Instr::BackwardWeight { .. }
            | Instr::Recompute { .. }
            | Instr::StashWeights { .. }
            | Instr::RestoreWeights { .. }
            | Instr::OptimizerStep { .. }
            | Instr::ShardStep { .. }
            | Instr::Free { .. }
    };
}

impl CollectivePayload {
    /// The one collective kind that carries this payload (what the executor runs).
    pub fn kind(self) -> CollectiveKind {
        match self {
            CollectivePayload::Gradients
            | CollectivePayload::TiedGradient
            | CollectivePayload::TiedGradientShard
            | CollectivePayload::GradNorm => CollectiveKind::AllReduce,
            CollectivePayload::GradientShard => CollectiveKind::ReduceScatter,
            CollectivePayload::Weights => CollectiveKind::AllGather,
        }
    }

    /// Whether a collective of `kind` can carry this payload.
    pub fn takes(self, kind: CollectiveKind) -> bool {
        self.kind() == kind
    }

    /// The buffer of `stage` a collective with this payload reads at its start.
    pub fn source(self, stage: StageId) -> Buffer {
        match self {
            // the tied weight's gradient is part of the stage's weight gradients; the norm
            // reads every held stage's (the verifier checks they are all reduced)
            CollectivePayload::Gradients
            | CollectivePayload::TiedGradient
            | CollectivePayload::GradientShard
            | CollectivePayload::GradNorm => Buffer::WeightGrad { stage },
            CollectivePayload::TiedGradientShard => Buffer::GradShard { stage },
            CollectivePayload::Weights => Buffer::WeightShard { stage },
        }
    }

    /// The buffer of `stage` its wait writes.
    pub fn target(self, stage: StageId) -> Buffer {
        match self {
            CollectivePayload::Gradients | CollectivePayload::TiedGradient => Buffer::WeightGrad { stage },
            CollectivePayload::GradientShard | CollectivePayload::TiedGradientShard => Buffer::GradShard { stage },
            CollectivePayload::Weights => Buffer::Weights { stage },
            CollectivePayload::GradNorm => Buffer::GradNorm,
        }
    }

    /// Whether it sums a tied weight over the devices holding either tied stage.
    pub fn ties(self) -> bool {
        matches!(self, CollectivePayload::TiedGradient | CollectivePayload::TiedGradientShard)
    }

    /// Whether its members name different stages (a tie's, or the gradient norm over every
    /// device), so that only kinds and sizes must agree among them.
    pub fn crosses_stages(self) -> bool {
        self.ties() || self == CollectivePayload::GradNorm
    }

    /// Whether it carries a stage's gradients over its replicas (what an update needs
    /// first when the stage is replicated).
    pub fn reduces_replicas(self) -> bool {
        matches!(self, CollectivePayload::Gradients | CollectivePayload::GradientShard)
    }
}

impl Instr {
    /// Starts summing `stage`'s weight gradients over its replica group `group`.
    pub fn all_reduce_gradients(stage: StageId, group: GroupId, bytes: u64) -> Instr {
        Instr::collective(CollectivePayload::Gradients, stage, group, bytes)
    }

    /// Starts the collective that carries `payload` of `stage` over `group` (its one kind).
    pub fn collective(payload: CollectivePayload, stage: StageId, group: GroupId, bytes: u64) -> Instr {
        Instr::Collective { kind: payload.kind(), payload, stage, group, bytes }
    }

    /// Waits for `stage`'s collective over `group` carrying `payload`.
    pub fn wait(payload: CollectivePayload, stage: StageId, group: GroupId) -> Instr {
        Instr::WaitCollective { payload, stage, group }
    }

    /// The all-to-alls `pass` posts, in order, on a stage whose mixture-of-experts layers
    /// exchange `layers` (layer, bytes per member) over expert group `group`: at each layer
    /// (a forward's and a recompute's first to last, a backward's last to first) the
    /// exchanges of [`TokenExchange::of_pass`], a backward's after a forward's where the
    /// layer runs its forward again there ([`ExpertExchange::again`]). Empty for an
    /// instruction that is not such a pass. The one rule the lowering, the verifier and the
    /// executor read.
    pub fn all_to_alls_of(pass: &Instr, layers: &[ExpertExchange], group: GroupId) -> Vec<Instr> {
        let Some(mb) = pass.microbatch() else { return Vec::new() };
        let phase = pass.phase();
        let exchanges = TokenExchange::of_pass(phase);
        if exchanges.is_empty() {
            return Vec::new();
        }
        let backward = matches!(phase, Phase::Backward | Phase::BackwardInput);
        let ordered: Vec<&ExpertExchange> =
            if backward { layers.iter().rev().collect() } else { layers.iter().collect() };
        let again = TokenExchange::of_pass(Phase::Recompute);
        ordered
            .into_iter()
            .flat_map(|l| {
                let rerun = if backward && l.again { again } else { &[] };
                rerun.iter().chain(exchanges).map(move |&exchange| Instr::AllToAll {
                    stage: pass.stage(),
                    mb,
                    layer: l.layer,
                    exchange,
                    group,
                    bytes: l.bytes,
                })
            })
            .collect()
    }

    /// The stage the instruction belongs to.
    pub fn stage(&self) -> StageId {
        match *self {
            Instr::LoadMicrobatch { stage, .. }
            | Instr::Forward { stage, .. }
            | Instr::Backward { stage, .. }
            | Instr::BackwardInput { stage, .. }
            | Instr::BackwardWeight { stage, .. }
            | Instr::Recompute { stage, .. }
            | Instr::SendActivation { stage, .. }
            | Instr::RecvActivation { stage, .. }
            | Instr::SendGradient { stage, .. }
            | Instr::RecvGradient { stage, .. }
            | Instr::Collective { stage, .. }
            | Instr::WaitCollective { stage, .. }
            | Instr::StashWeights { stage, .. }
            | Instr::RestoreWeights { stage, .. }
            | Instr::OptimizerStep { stage }
            | Instr::ShardStep { stage }
            | Instr::Free { stage, .. }
            | Instr::PushGradient { stage, .. }
            | Instr::ApplyGradient { stage, .. }
            | Instr::PushWeights { stage, .. }
            | Instr::PullWeights { stage, .. }
            | Instr::AllToAll { stage, .. } => stage,
        }
    }

    /// The other device of a point-to-point instruction.
    pub fn peer(&self) -> Option<DeviceId> {
        self.transfer().map(|t| t.peer)
    }

    /// The collective group of a collective instruction.
    pub fn group(&self) -> Option<GroupId> {
        match *self {
            Instr::Collective { group, .. } | Instr::WaitCollective { group, .. } | Instr::AllToAll { group, .. } => {
                Some(group)
            }
            _ => None,
        }
    }

    /// The microbatch, if the instruction is about one.
    pub fn microbatch(&self) -> Option<MicrobatchId> {
        match *self {
            about_microbatch!(mb) => Some(mb),
            about_no_microbatch!() => None,
        }
    }

    pub fn phase(&self) -> Phase {
        match self {
            Instr::Forward { .. } => Phase::Forward,
            Instr::Backward { .. } => Phase::Backward,
            Instr::BackwardInput { .. } => Phase::BackwardInput,
            Instr::BackwardWeight { .. } => Phase::BackwardWeight,
            Instr::Recompute { .. } => Phase::Recompute,
            Instr::SendActivation { .. }
            | Instr::RecvActivation { .. }
            | Instr::SendGradient { .. }
            | Instr::RecvGradient { .. }
            | Instr::PushGradient { .. }
            | Instr::PushWeights { .. }
            | Instr::PullWeights { .. }
            | Instr::AllToAll { .. } => Phase::Communication,
            Instr::ApplyGradient { .. } => Phase::Optimizer,
            Instr::Collective { .. } | Instr::WaitCollective { .. } => Phase::Collective,
            Instr::OptimizerStep { .. } | Instr::ShardStep { .. } => Phase::Optimizer,
            Instr::LoadMicrobatch { .. }
            | Instr::StashWeights { .. }
            | Instr::RestoreWeights { .. }
            | Instr::Free { .. } => Phase::Memory,
        }
    }

    /// The message a point-to-point instruction sends or receives; None for every other
    /// instruction. The one place that says which send matches which receive.
    pub fn transfer(&self) -> Option<Transfer> {
        let (end, peer, id, bytes) = match *self {
            Instr::SendActivation { peer, stage, mb, bytes } => {
                (End::Send, peer, Some(MessageId::activation(stage, mb)), bytes)
            }
            Instr::RecvActivation { peer, stage, mb, bytes } => {
                (End::Recv, peer, stage.0.checked_sub(1).map(|s| MessageId::activation(StageId(s), mb)), bytes)
            }
            Instr::SendGradient { peer, stage, mb, bytes } => {
                (End::Send, peer, Some(MessageId::gradient(stage, mb)), bytes)
            }
            Instr::RecvGradient { peer, stage, mb, bytes } => {
                (End::Recv, peer, stage.0.checked_add(1).map(|s| MessageId::gradient(StageId(s), mb)), bytes)
            }
            Instr::PushGradient { peer, stage, mb, bytes } => {
                (End::Send, peer, Some(MessageId::weight_gradient(stage, mb)), bytes)
            }
            Instr::ApplyGradient { peer, stage, mb, bytes } => {
                (End::Recv, peer, Some(MessageId::weight_gradient(stage, mb)), bytes)
            }
            Instr::PushWeights { peer, stage, round, bytes } => {
                (End::Send, peer, Some(MessageId::weights(stage, round)), bytes)
            }
            Instr::PullWeights { peer, stage, round, bytes } => {
                (End::Recv, peer, Some(MessageId::weights(stage, round)), bytes)
            }
            Instr::Collective { .. } | Instr::WaitCollective { .. } | Instr::AllToAll { .. } | on_device!() => {
                return None
            }
        };
        Some(Transfer { end, peer, id, bytes })
    }

    /// The instruction that sends message `id` to `peer` (the inverse of [`Instr::transfer`]
    /// for sends).
    pub fn send(id: MessageId, peer: DeviceId, bytes: u64) -> Instr {
        let (stage, mb) = (id.stage, MicrobatchId(id.index));
        match id.payload {
            Payload::Activation => Instr::SendActivation { peer, stage, mb, bytes },
            Payload::Gradient => Instr::SendGradient { peer, stage, mb, bytes },
            Payload::WeightGradient => Instr::PushGradient { peer, stage, mb, bytes },
            Payload::Weights => Instr::PushWeights { peer, stage, round: id.index, bytes },
        }
    }

    /// The instruction with its microbatch (if any) mapped by `f`: a periodic stream's
    /// microbatch numbers are relative to its step.
    pub fn map_microbatch(&self, f: impl Fn(MicrobatchId) -> MicrobatchId) -> Instr {
        let mut out = self.clone();
        match &mut out {
            about_microbatch!(mb) => *mb = f(*mb),
            about_no_microbatch!() => {}
        }
        out
    }

    /// The instruction with every device it names mapped by `device` and its collective
    /// group by `group` (a tensor-parallel member runs its leader's stream shifted this way).
    pub fn map_devices(&self, device: impl Fn(DeviceId) -> DeviceId, group: impl Fn(GroupId) -> GroupId) -> Instr {
        let mut out = self.clone();
        match &mut out {
            point_to_point!(peer) => *peer = device(*peer),
            Instr::Collective { group: g, .. }
            | Instr::WaitCollective { group: g, .. }
            | Instr::AllToAll { group: g, .. } => *g = group(*g),
            on_device!() => {}
        }
        out
    }

    /// The buffers this instruction reads.
    pub fn reads(&self) -> Vec<Buffer> {
        use Buffer as B;
        match *self {
            Instr::LoadMicrobatch { .. } => vec![],
            Instr::Forward { stage, mb } => vec![B::Input { stage, mb }, B::Weights { stage }],
            Instr::Backward { stage, mb } | Instr::BackwardInput { stage, mb } => {
                vec![B::Saved { stage, mb }, B::OutputGrad { stage, mb }, B::Weights { stage }]
            }
            Instr::BackwardWeight { stage, mb } => vec![B::Saved { stage, mb }, B::OutputGrad { stage, mb }],
            Instr::Recompute { stage, mb } => vec![B::Input { stage, mb }, B::Weights { stage }],
            Instr::SendActivation { stage, mb, .. } => vec![B::Output { stage, mb }],
            Instr::SendGradient { stage, mb, .. } => vec![B::InputGrad { stage, mb }],
            Instr::RecvActivation { .. } | Instr::RecvGradient { .. } => vec![],
            Instr::Collective { payload, stage, .. } => vec![payload.source(stage)],
            Instr::OptimizerStep { stage } => vec![B::WeightGrad { stage }],
            Instr::ShardStep { stage } => vec![B::GradShard { stage }, B::WeightShard { stage }],
            Instr::WaitCollective { stage, group, .. } => vec![B::InFlight { stage, group }],
            Instr::StashWeights { stage, .. } => vec![B::Weights { stage }],
            Instr::RestoreWeights { stage, mb } => vec![B::Stash { stage, mb }],
            Instr::Free { stage, mb } => vec![B::Saved { stage, mb }],
            Instr::PushGradient { stage, .. } => vec![B::WeightGrad { stage }],
            Instr::ApplyGradient { stage, .. } | Instr::PushWeights { stage, .. } => vec![B::Weights { stage }],
            // rows inside its pass: no buffer of the plan's
            Instr::PullWeights { .. } | Instr::AllToAll { .. } => vec![],
        }
    }

    /// The buffers this instruction writes.
    pub fn writes(&self) -> Vec<Buffer> {
        use Buffer as B;
        match *self {
            Instr::LoadMicrobatch { stage, mb, inputs, labels } => {
                let mut w = Vec::new();
                if inputs {
                    w.push(B::Input { stage, mb });
                }
                if labels {
                    w.push(B::Labels { mb });
                }
                w
            }
            Instr::Forward { stage, mb } | Instr::Recompute { stage, mb } => {
                vec![B::Saved { stage, mb }, B::Output { stage, mb }]
            }
            Instr::Backward { stage, mb } => vec![B::InputGrad { stage, mb }, B::WeightGrad { stage }],
            Instr::BackwardInput { stage, mb } => vec![B::InputGrad { stage, mb }],
            Instr::BackwardWeight { stage, .. } => vec![B::WeightGrad { stage }],
            Instr::RecvActivation { stage, mb, .. } => vec![B::Input { stage, mb }],
            Instr::RecvGradient { stage, mb, .. } => vec![B::OutputGrad { stage, mb }],
            Instr::SendActivation { .. } | Instr::SendGradient { .. } | Instr::Free { .. } => vec![],
            Instr::Collective { stage, group, .. } => vec![B::InFlight { stage, group }],
            Instr::WaitCollective { payload, stage, .. } => vec![payload.target(stage)],
            Instr::OptimizerStep { stage } => vec![B::Weights { stage }, B::WeightGrad { stage }],
            Instr::ShardStep { stage } => vec![B::WeightShard { stage }, B::GradShard { stage }],
            Instr::StashWeights { stage, mb, .. } => vec![B::Stash { stage, mb }],
            Instr::RestoreWeights { stage, .. } => vec![B::Weights { stage }],
            Instr::PushGradient { stage, .. } => vec![B::WeightGrad { stage }],
            Instr::ApplyGradient { stage, .. } | Instr::PullWeights { stage, .. } => vec![B::Weights { stage }],
            Instr::PushWeights { .. } | Instr::AllToAll { .. } => vec![],
        }
    }
}

impl fmt::Display for Instr {
    /// The one-line text form documented in docs/plan-format.md.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Instr::LoadMicrobatch { stage, mb, inputs, labels } => {
                let what = match (inputs, labels) {
                    (true, true) => "inputs+labels",
                    (true, false) => "inputs",
                    (false, true) => "labels",
                    (false, false) => "nothing",
                };
                write!(f, "load {stage} {mb} {what}")
            }
            Instr::Forward { stage, mb } => write!(f, "fwd {stage} {mb}"),
            Instr::Backward { stage, mb } => write!(f, "bwd {stage} {mb}"),
            Instr::BackwardInput { stage, mb } => write!(f, "bwd_in {stage} {mb}"),
            Instr::BackwardWeight { stage, mb } => write!(f, "bwd_w {stage} {mb}"),
            Instr::Recompute { stage, mb } => write!(f, "recompute {stage} {mb}"),
            Instr::SendActivation { peer, stage, mb, bytes } => write!(f, "send_act {stage} {mb} -> {peer} {bytes}B"),
            Instr::RecvActivation { peer, stage, mb, bytes } => write!(f, "recv_act {stage} {mb} <- {peer} {bytes}B"),
            Instr::SendGradient { peer, stage, mb, bytes } => write!(f, "send_grad {stage} {mb} -> {peer} {bytes}B"),
            Instr::RecvGradient { peer, stage, mb, bytes } => write!(f, "recv_grad {stage} {mb} <- {peer} {bytes}B"),
            Instr::Collective { kind, payload, stage, group, bytes } => {
                write!(f, "{kind} {stage} {group} {payload} {bytes}B")
            }
            Instr::WaitCollective { payload, stage, group } => write!(f, "wait {stage} {group} {payload}"),
            Instr::StashWeights { stage, mb, version: None } => write!(f, "stash {stage} {mb}"),
            Instr::StashWeights { stage, mb, version: Some(v) } => write!(f, "stash {stage} {mb} v{v}"),
            Instr::RestoreWeights { stage, mb } => write!(f, "restore {stage} {mb}"),
            Instr::OptimizerStep { stage } => write!(f, "step {stage}"),
            Instr::ShardStep { stage } => write!(f, "step_shard {stage}"),
            Instr::Free { stage, mb } => write!(f, "free {stage} {mb}"),
            Instr::PushGradient { peer, stage, mb, bytes } => write!(f, "push_grad {stage} {mb} -> {peer} {bytes}B"),
            Instr::ApplyGradient { peer, stage, mb, bytes } => write!(f, "apply_grad {stage} {mb} <- {peer} {bytes}B"),
            Instr::PushWeights { peer, stage, round, bytes } => {
                write!(f, "push_weights {stage} r{round} -> {peer} {bytes}B")
            }
            Instr::PullWeights { peer, stage, round, bytes } => {
                write!(f, "pull_weights {stage} r{round} <- {peer} {bytes}B")
            }
            Instr::AllToAll { stage, mb, layer, exchange, group, bytes } => {
                write!(f, "all_to_all {stage} {mb} {group} L{layer} {exchange} {bytes}B")
            }
        }
    }
}

#[cfg(test)]
mod device_text_tests {
    use super::*;

    #[test]
    fn device_sets_are_written_as_ranges_with_their_count() {
        let ids = |r: std::ops::Range<u32>| r.map(DeviceId).collect::<Vec<_>>();
        assert_eq!(devices_text(&ids(0..128)), "d0–d127 (128 devices)");
        assert_eq!(devices_text(&[ids(0..4), ids(8..12)].concat()), "d0–d3, d8–d11 (8 devices)");
        assert_eq!(devices_text(&ids(0..2)), "d0,d1");
        assert_eq!(devices_text(&[DeviceId(5)]), "d5");
        let every_other: Vec<DeviceId> = (0..40).step_by(2).map(DeviceId).collect();
        assert_eq!(devices_text(&every_other), "d0, d2, d4, d6, d8, d10, d12, d14, … (20 devices)");
    }

    #[test]
    fn a_backward_that_runs_a_mixture_again_dispatches_and_combines_again_first() {
        let layers =
            [ExpertExchange { layer: 1, bytes: 8, again: true }, ExpertExchange { layer: 2, bytes: 8, again: false }];
        let (stage, mb, group) = (StageId(0), MicrobatchId(3), GroupId(1));
        let posted = |pass: Instr| -> Vec<(u32, TokenExchange)> {
            Instr::all_to_alls_of(&pass, &layers, group)
                .into_iter()
                .map(|i| match i {
                    Instr::AllToAll { layer, exchange, .. } => (layer, exchange),
                    other => panic!("{other:?}"),
                })
                .collect()
        };
        use TokenExchange::{Combine, CombineGrad, Dispatch, DispatchGrad};
        // a forward and a recompute as before; a backward, last layer first, the first
        // layer's forward exchanges again before its gradients'
        assert_eq!(posted(Instr::Forward { stage, mb }), [(1, Dispatch), (1, Combine), (2, Dispatch), (2, Combine)]);
        let backward =
            [(2, CombineGrad), (2, DispatchGrad), (1, Dispatch), (1, Combine), (1, CombineGrad), (1, DispatchGrad)];
        assert_eq!(posted(Instr::Backward { stage, mb }), backward);
        assert_eq!(posted(Instr::BackwardInput { stage, mb }), backward);
        assert!(posted(Instr::BackwardWeight { stage, mb }).is_empty());
    }
}
