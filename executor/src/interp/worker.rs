//! The interpreter: one worker per device executes its instruction stream, step after step,
//! with an exhaustive `match` on the instruction set. Nothing runs that the plan does not say.
//! `exec` dispatches each instruction to one method: the compute instructions are in
//! `compute`, the collectives in `collectives`, the rest (data, messages, updates) here; a
//! stage's state and optimizer are in `stage`, what the worker holds between instructions
//! in `values`.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use burn::prelude::*;
use pipec_plan::plan::{instruction_code, Segment as StreamSegment};
use pipec_plan::{DeviceId, Instr, MicrobatchId, Plan, ReduceMode, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::exchanger::{Comm, CommTrace};
use crate::comm::transport::{Message, Tag};
use crate::error::{ExecError, Result};
use crate::interp::data::{Dataset, Inputs, Targets};
use crate::interp::parts::{Passes, PeerGroups, Progress, Transfers, Zero3Gathers};
use crate::interp::stage::StageState;
use crate::interp::values::{host_to_act, require_grad};
use crate::nn::layers::Act;
use crate::nn::params::{flatten_grads, layout, snapshot};

/// Per mixture-of-experts block (by its layer index), the tokens each of its experts took.
pub type ExpertTokens = std::collections::BTreeMap<usize, Vec<u64>>;

/// Adds one block's per-expert token counts (`layer`, `took`) to `into`.
pub fn add_expert_tokens(into: &mut ExpertTokens, layer: usize, took: &[u64]) {
    let sum = into.entry(layer).or_insert_with(|| vec![0; took.len()]);
    sum.iter_mut().zip(took).for_each(|(a, b)| *a += b);
}

/// Everything a worker reports about one step.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    pub device: DeviceId,
    pub step: usize,
    /// (microbatch, loss) for every microbatch whose loss this device computed.
    pub losses: Vec<(u32, f32)>,
    /// (microbatch, load-balancing loss) for every microbatch whose forward ran a stage of
    /// this device with a mixture of experts weighing that loss (per stage: its blocks'
    /// losses, summed).
    pub aux_losses: Vec<(u32, f32)>,
    /// Per mixture-of-experts block on this device (by layer): the tokens each expert took
    /// over the step's forwards.
    pub expert_tokens: ExpertTokens,
    /// (instruction index, start s, end s) from the step's start.
    pub trace: Vec<(usize, f64, f64)>,
    /// What the communication threads ran during the step: (instruction index, start s,
    /// end s) from the start of the run.
    pub comm: CommTrace,
    /// When the step started, in seconds from the start of the run (of this process).
    pub started: f64,
    pub step_seconds: f64,
    /// Peak microbatches kept for the backward at once, per stage.
    pub peak_in_flight: HashMap<StageId, u32>,
    /// ZeRO-3 (a device holding a stage sharded so): the all-gathers of its stages' whole
    /// weights this step ran, and how many of them were prefetched during the pass before.
    pub weight_gathers: Option<u32>,
    pub prefetched_gathers: Option<u32>,
    /// ZeRO-3: the all-gathers of single weights by the products reading them
    /// (`zero::per_product`) this step.
    pub product_gathers: Option<u32>,
    /// Peak weight versions alive at once (live + stashed), per stage.
    pub peak_versions: HashMap<StageId, u32>,
    /// Validation (a forward-only run of a held-out batch): per microbatch whose loss this
    /// device computed, its correct predictions and predictions (a classifier's samples, a
    /// language model's tokens; none for a regression).
    pub correct: Vec<(f64, f64)>,
    /// Validation after this step: the summed loss, microbatches, correct predictions and
    /// predictions of every held-out batch on this device.
    pub validation: Option<[f64; 4]>,
    /// The model state this device holds (the run's last step only).
    pub held: Option<HeldState>,
    /// The process's resident memory, when it runs this device alone (the last step only).
    pub resident: Option<crate::backend::resident::Resident>,
    /// Gradient clipping by the global norm (or fp16's overflow check): the step's norm,
    /// before clipping (unscaled).
    pub grad_norm: Option<f64>,
    /// fp16's dynamic loss scaling: the scale the step's loss was multiplied by, whether the
    /// step's updates were skipped (a gradient was not finite), and the scale after the
    /// step (what a checkpoint of it keeps).
    pub loss_scale: Option<f64>,
    pub skipped: bool,
    pub next_loss_scale: Option<pipec_plan::recipe::LossScale>,
    /// Seconds this worker waited for checkpoint writes since its previous report.
    pub checkpoint_wait_s: f64,
    /// Seconds this worker took to copy its state for the checkpoint after this step (0:
    /// none after it).
    pub checkpoint_copy_s: f64,
}

/// The model state a device holds, in f32 values: its weights, the most gradient values it
/// held at once (whole sums and ZeRO shards), and its optimizer's state (momentum or Adam's
/// moments; under ZeRO also the master weights' shard) — what the plan's memory figures
/// predict, measured.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldState {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// A GPU's: the most bytes its memory pool held for live allocations, sampled after
    /// every instruction (`Kernels::pool_in_use`); None on the CPU.
    pub pool_peak: Option<u64>,
}

/// A worker: one device, its stages, its stream, and what it holds between instructions
/// (`interp::parts`: twelve fields in all).
pub(crate) struct Worker<'a, B: ExecBackend> {
    pub device: DeviceId,
    pub plan: &'a Plan,
    pub stream: &'a [Instr],
    pub data: &'a Dataset,
    pub comm: Comm,
    pub dev: B::Device,
    pub stages: HashMap<StageId, StageState<B>>,
    pub(crate) passes: Passes<B>,
    pub(crate) zero3: Zero3Gathers,
    pub(crate) transfers: Transfers,
    pub(crate) progress: Progress,
    pub(crate) groups: PeerGroups,
}

impl<'a, B: ExecBackend> Worker<'a, B> {
    // the worker's parts, each one of the run's: a struct of them would only be unpacked here
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        device: DeviceId,
        plan: &'a Plan,
        stream: &'a [Instr],
        data: &'a Dataset,
        comm: Comm,
        dev: B::Device,
        stages: HashMap<StageId, StageState<B>>,
        reduce: ReduceMode,
    ) -> Self {
        let exchanger = comm.exchanger();
        let experts = stages
            .keys()
            .filter_map(|s| crate::backend::port::PeerGroup::of(plan, *s, device, &exchanger).map(|g| (*s, g)))
            .collect();
        let contexts = stages
            .keys()
            .filter_map(|s| crate::nn::context::Context::of(plan, *s, device, &exchanger).map(|g| (*s, g)))
            .collect();
        let global_clip = stream
            .iter()
            .any(|i| matches!(i, Instr::Collective { payload: pipec_plan::CollectivePayload::GradNorm, .. }));
        Worker {
            device,
            plan,
            stream,
            data,
            comm,
            dev,
            stages,
            passes: Passes::default(),
            zero3: Zero3Gathers::default(),
            transfers: Transfers::new(reduce),
            progress: Progress::new(global_clip),
            groups: PeerGroups { experts, contexts },
        }
    }

    /// The segments step `step` runs: the plan's stream; for a flush-free pipeline the
    /// prologue first when the pipeline is empty (`filled` false), then the body, or the
    /// epilogue when the step must leave it empty (`drain`).
    pub fn segments(&self, filled: bool, drain: bool) -> Vec<(StreamSegment, &'a [Instr])> {
        let Some(f) = &self.plan.flush_free else { return vec![(StreamSegment::Body, self.stream)] };
        let of = |m: &'a BTreeMap<DeviceId, Vec<Instr>>| m.get(&self.device).map_or(&[][..], Vec::as_slice);
        let mut out = Vec::with_capacity(2);
        if !filled {
            out.push((StreamSegment::Prologue, of(&f.prologue)));
        }
        out.push(if drain { (StreamSegment::Epilogue, of(&f.epilogue)) } else { (StreamSegment::Body, self.stream) });
        out
    }

    /// Runs one step: its `segments` (see `segments`), each instruction's microbatch made
    /// absolute (`step·N + m`). With `drained`, nothing may be left in flight afterwards.
    /// On failure: the instruction's `instruction_code` and the error.
    pub fn step(
        &mut self,
        step: usize,
        segments: &[(StreamSegment, &[Instr])],
        drained: bool,
    ) -> std::result::Result<StepReport, (usize, ExecError)> {
        let start = Instant::now();
        let started = start.duration_since(self.progress.epoch).as_secs_f64();
        let mut report = StepReport { device: self.device, step, started, ..Default::default() };
        self.progress.current_step = step;
        self.progress.grad_norm = None;
        // the step's weight versions are kept only where a stream stashes one by number
        // (vertical sync): a clone held through the step would keep the update from
        // writing the weights in place
        let numbered = segments
            .iter()
            .any(|(_, stream)| stream.iter().any(|i| matches!(i, Instr::StashWeights { version: Some(_), .. })));
        for st in self.stages.values_mut() {
            st.versions = if numbered { st.model.iter().cloned().collect() } else { Vec::new() };
        }
        let base = (step * self.plan.training.microbatches) as u32;
        let mut versions: HashMap<StageId, u32> = HashMap::new();
        let all: Vec<(usize, Instr)> = segments
            .iter()
            .flat_map(|(segment, stream)| {
                stream.iter().enumerate().map(move |(index, ins)| {
                    (instruction_code(*segment, index), ins.map_microbatch(|m| MicrobatchId(base + m.0)))
                })
            })
            .collect();
        let instrs: Vec<Instr> = all.iter().map(|(_, i)| i.clone()).collect();
        self.transfers.bucketed = crate::interp::in_flight::bucketed_backwards(self.plan, &instrs);
        self.zero3.prefetched.clear();
        // ZeRO-3: a step starts with its sharded stages' whole weights dropped (those built,
        // or gathered by a validation), and gathers them where the plan declares
        // (`pipec_plan::in_pass::stage_gathers`; nothing is declared for a validation)
        self.zero3.declared.clear();
        if self.progress.evaluating.is_none() {
            for s in self.stages.keys().copied().collect::<Vec<_>>() {
                self.release_unpinned(s).map_err(|e| (0, e))?;
            }
            // (positions in the body: ZeRO runs no flush-free pipeline)
            let body = matches!(segments, [(StreamSegment::Body, _)]);
            for g in self.plan.in_pass.gathers_of(self.device).iter().filter(|_| body) {
                self.zero3.declared.entry(g.at as usize).or_default().push(g.stage);
            }
        }
        // the stages whose whole backward feeds its buckets run their forwards in segments
        self.transfers.segmented = self
            .transfers
            .bucketed
            .keys()
            .filter(|&&b| matches!(instrs[b], Instr::Backward { .. }))
            .map(|&b| instrs[b].stage())
            .collect();
        // the next message instruction not yet handed to the communication thread
        let mut issued = 0;
        let mut last = 0;
        for (at, (code, ins)) in all.iter().enumerate() {
            last = *code;
            // post the receives up to the next send: messages keep the stream's order, and a
            // send is issued when the compute reaches it
            while let Some((c, next)) = all.get(issued) {
                if sends(next) {
                    break;
                }
                if receives(next) && !self.comm.receives_directly() {
                    let tag = expected_message(next).map_err(|e| (*c, e))?;
                    let peer = next.peer().unwrap_or(self.device);
                    let ticket = self.comm.post_recv(peer, tag, *c).map_err(|e| (*c, e.into()))?;
                    self.transfers.posted.insert(issued, ticket);
                }
                issued += 1;
            }
            if sends(ins) {
                issued = at + 1;
            }
            let t0 = start.elapsed().as_secs_f64();
            self.exec(ins, *code, at, &mut report).map_err(|e| (*code, e))?;
            let t1 = start.elapsed().as_secs_f64();
            // an all-to-all ran inside the pass before it: the trace shows it where it ran
            let since = |i: Instant| i.saturating_duration_since(start).as_secs_f64();
            let (t0, t1) = self.transfers.exchanged.take().map_or((t0, t1), |(a, b)| (since(a), since(b)));
            report.trace.push((*code, t0, t1));
            let gradients: usize = self
                .stages
                .values()
                .map(|st| {
                    let whole: usize = st.acc.iter().flatten().map(|t| t.dims()[0]).sum();
                    let shard: usize = st
                        .shard
                        .as_ref()
                        .and_then(|s| s.grad.as_ref())
                        .map_or(0, |g| g.iter().map(|t| t.dims()[0]).sum());
                    whole + shard
                })
                .sum();
            self.progress.peak_gradients = self.progress.peak_gradients.max(gradients as u64);
            if let Some(now) = B::pool_in_use(&self.dev) {
                self.progress.pool_peak = Some(self.progress.pool_peak.unwrap_or(0).max(now));
            }
            for (s, n) in &self.passes.in_flight {
                let p = report.peak_in_flight.entry(*s).or_insert(0);
                *p = (*p).max(*n);
            }
            for (s, st) in &self.stages {
                let v = versions.entry(*s).or_insert(0);
                *v = (*v).max(1 + st.stash.len() as u32);
            }
        }
        self.exchanges_accounted(None).map_err(|e| (last, e))?;
        report.comm = self.comm.fence().map_err(|e| (last, e.into()))?;
        if !self.transfers.collectives.is_empty()
            || !self.transfers.posted.is_empty()
            || !self.transfers.buckets.is_empty()
        {
            return Err((
                last,
                ExecError::Missing("an all-reduce or a receive is left in flight at the end of the step"),
            ));
        }
        if drained
            && (!self.passes.saved.is_empty()
                || !self.passes.outputs.is_empty()
                || !self.passes.input_grads.is_empty()
                || self.stages.values().any(|st| !st.forward_stats.is_empty()))
        {
            return Err((last, ExecError::Missing("buffers are left over at the end of the step")));
        }
        report.peak_versions = versions;
        let gathers = std::mem::take(&mut self.zero3.weight_gathers);
        let prefetched = std::mem::take(&mut self.zero3.prefetched_gathers);
        let sharded = self.stages.keys().any(|s| self.sharded_at_3(*s));
        report.weight_gathers = sharded.then_some(gathers);
        report.prefetched_gathers = sharded.then_some(prefetched);
        report.product_gathers = sharded.then_some(std::mem::take(&mut self.zero3.product_gathers));
        report.grad_norm = self.progress.grad_norm;
        if let (Some(ls), Some(norm)) = (self.progress.loss_scale, self.progress.grad_norm) {
            // every device saw the same norm (the plan's `grad_norm`), so every device's
            // scale moves alike
            report.grad_norm = Some(norm / ls.scale);
            report.loss_scale = Some(ls.scale);
            report.skipped = !norm.is_finite();
            self.progress.loss_scale = Some(ls.next(norm.is_finite()));
        }
        report.next_loss_scale = self.progress.loss_scale;
        report.step_seconds = start.elapsed().as_secs_f64();
        Ok(report)
    }

    /// The message of the receive `ins` at position `at` of the step (traced as `code`):
    /// taken now where the worker receives directly (`Comm::receives_directly`), otherwise
    /// the one posted ahead.
    pub(crate) fn received(&mut self, ins: &Instr, code: usize, at: usize) -> Result<Message> {
        if self.comm.receives_directly() {
            let tag = expected_message(ins)?;
            let peer = ins.peer().unwrap_or(self.device);
            return Ok(self.comm.recv_now(peer, tag, code)?);
        }
        Ok(self.transfers.posted.remove(&at).ok_or(ExecError::Missing("the receive was not posted"))?.wait()?)
    }

    /// `Free`: drops what a microbatch's forward kept for its backward.
    fn free(&mut self, stage: StageId, mb: MicrobatchId) -> Result<()> {
        self.passes.saved.remove(&(stage, mb)).ok_or(ExecError::Missing("nothing is kept for this microbatch"))?;
        if let Some(c) = self.passes.in_flight.get_mut(&stage) {
            *c = c.saturating_sub(1);
        }
        self.release_unpinned(stage)
    }

    /// `StashWeights`: keeps the stage's current weights (or the step's `version`) for the
    /// microbatch's backward.
    fn stash_weights(&mut self, stage: StageId, mb: MicrobatchId, version: Option<u32>) -> Result<()> {
        let st = self.state(stage)?;
        let m = match version {
            None => st.model()?.clone(),
            Some(v) => st.versions.get(v as usize).cloned().ok_or_else(|| {
                ExecError::Plan(format!("weight version {v} does not exist yet ({} so far)", st.versions.len()))
            })?,
        };
        st.stash.insert(mb, m);
        Ok(())
    }

    /// Runs one instruction; a pass's collectives inside it are held against the plan's
    /// declaration (`pipec_plan::in_pass`): in debug builds a pass that issues anything
    /// else fails the run.
    pub(crate) fn exec(&mut self, ins: &Instr, code: usize, at: usize, report: &mut StepReport) -> Result<()> {
        let Some(kind) = pipec_plan::in_pass::PassKind::of(ins) else {
            return self.exec_instr(ins, code, at, report);
        };
        // what was issued before the pass is not its own (a checkpoint's reshard)
        drop(self.comm.ledger().take());
        let done = self.exec_instr(ins, code, at, report);
        let issued = self.comm.ledger().take();
        if cfg!(debug_assertions) && done.is_ok() {
            self.check_on_device(ins)?;
            if self.progress.evaluating.is_none() {
                self.check_declared(ins, (kind, at), &issued)?;
            }
        }
        done
    }

    fn exec_instr(&mut self, ins: &Instr, code: usize, at: usize, report: &mut StepReport) -> Result<()> {
        if !pipec_plan::TokenExchange::of_pass(ins.phase()).is_empty() {
            self.exchanges_accounted(Some(ins.stage()))?;
        }
        match *ins {
            Instr::LoadMicrobatch { stage, mb, inputs, labels } => self.load_microbatch(stage, mb, inputs, labels),
            Instr::RecvActivation { stage, mb, .. } => {
                let msg = self.received(ins, code, at)?;
                let act = require_grad(host_to_act::<B>(&msg.shape, msg.data, &self.dev)?);
                self.passes.inputs.insert((stage, mb), act);
                Ok(())
            }
            Instr::Forward { stage, mb } => {
                self.gather_weights(stage, at)?;
                let done = self.forward(stage, mb, report);
                self.products_gathered(stage, done)?;
                self.release_unpinned(stage)
            }
            Instr::Recompute { stage, mb } => {
                self.gather_weights(stage, at)?;
                let done = self.recompute(stage, mb);
                self.products_gathered(stage, done)
            }
            Instr::Backward { stage, mb } => {
                self.gather_weights(stage, at)?;
                let done = match self.transfers.bucketed.get(&at).copied() {
                    // the stage's last gradient of the step: its buckets start in the pass
                    Some(group) if self.passes.saved.get(&(stage, mb)).is_some_and(|k| k.saved.is_pieces()) => {
                        self.backward_in_pieces(stage, mb, false, Some((group, code))).map(|_| ())
                    }
                    Some(group) => self.backward_segments(stage, mb, Some((group, code))).map(|_| ()),
                    None => self.run_backward(stage, mb, false).and_then(|grads| self.add_gradient(stage, mb, grads)),
                };
                self.products_gathered(stage, done)?;
                // the stashed version has served its backward
                self.state(stage)?.stash.remove(&mb);
                Ok(())
            }
            Instr::BackwardInput { stage, mb } => {
                self.gather_weights(stage, at)?;
                // the input gradients, and every gradient but the dense weights' products,
                // which wait for the plan's BackwardWeight
                let grads = self.run_backward(stage, mb, true);
                let grads = self.products_gathered(stage, grads)?;
                self.passes.pending_weight_grads.insert((stage, mb), grads);
                Ok(())
            }
            Instr::BackwardWeight { stage, mb } => {
                let grads = self
                    .passes
                    .pending_weight_grads
                    .remove(&(stage, mb))
                    .ok_or(ExecError::Missing("the input-gradient pass of this microbatch did not run"))?;
                match self.transfers.bucketed.get(&at).copied() {
                    // the stage's last gradient of the step: its buckets start in the pass
                    Some(group) => self.weight_pass_in_buckets(stage, mb, grads, group, code),
                    None => self.add_gradient(stage, mb, grads),
                }
            }
            Instr::Free { stage, mb } => self.free(stage, mb),
            Instr::SendActivation { peer, stage, mb, .. } => {
                let msg = self.passes.outputs.remove(&(stage, mb));
                self.send(peer, msg, code, "the activation to send was not computed")
            }
            Instr::RecvGradient { stage, mb, .. } => {
                let msg = self.received(ins, code, at)?;
                self.passes.grads_in.insert((stage, mb), msg);
                Ok(())
            }
            Instr::SendGradient { peer, stage, mb, .. } => {
                let msg = self.passes.input_grads.remove(&(stage, mb));
                self.send(peer, msg, code, "the gradient to send was not computed")
            }
            Instr::Collective { kind, payload, stage, group, .. } => {
                self.start_collective(kind, payload, stage, group, code)
            }
            Instr::WaitCollective { payload, stage, group } => self.wait_collective(payload, stage, group),
            Instr::StashWeights { stage, mb, version } => self.stash_weights(stage, mb, version),
            Instr::RestoreWeights { stage, mb } => {
                // Burn's autodiff graph holds the exact weight tensors the forward used, so
                // the backward already differentiates at the stashed version; the stash is
                // what keeps that version alive (and counted) until then.
                if !self.state(stage)?.stash.contains_key(&mb) {
                    return Err(ExecError::Missing("no weights were stashed for this microbatch"));
                }
                Ok(())
            }
            Instr::PushGradient { peer, stage, .. } => {
                self.sum_local_ties(stage)?;
                let st = self.state(stage)?;
                if st.contributions != 1 {
                    return Err(ExecError::Plan(format!(
                        "{} microbatch gradients to push, expected one",
                        st.contributions
                    )));
                }
                let sizes = st.parameter_sizes()?;
                let mut flat = flatten_grads::<B>(&st.acc, &sizes)?;
                flat.extend(st.statistics_message()?);
                st.clear_gradients();
                let n = flat.len();
                Ok(self.comm.send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: flat }, code)?)
            }
            Instr::ApplyGradient { stage, .. } => {
                let msg = self.received(ins, code, at)?;
                self.apply_gradient(stage, &msg.data)
            }
            Instr::PushWeights { peer, stage, .. } => {
                let model = self.state(stage)?.model()?;
                let mut values: Vec<f32> = snapshot::<B, _>(model)?.into_iter().flat_map(|(_, _, v)| v).collect();
                values.extend(model.running_statistics());
                let n = values.len();
                Ok(self.comm.send(peer, Message { tag: expected_message(ins)?, shape: vec![n], data: values }, code)?)
            }
            Instr::PullWeights { stage, .. } => {
                let msg = self.received(ins, code, at)?;
                self.pull_weights(stage, &msg.data)
            }
            Instr::OptimizerStep { stage } => self.optimizer_step(stage),
            Instr::ShardStep { stage } => self.shard_step(stage),
            // made inside the pass before it: the plan's record of it is checked
            Instr::AllToAll { stage, layer, exchange, .. } => {
                let group = self.groups.experts.get(&stage).ok_or_else(|| {
                    ExecError::Plan(format!("`{ins}`: this device is in no expert-parallel group of {stage}"))
                })?;
                let made = group.account(ins, layer, exchange).map_err(ExecError::Plan)?;
                self.transfers.exchanged = Some((made.started, made.ended));
                Ok(())
            }
        }
    }

    /// Whether every all-to-all the passes of `stage` (every stage: None) made is one the
    /// plan lists after them (`Instr::AllToAll`).
    fn exchanges_accounted(&self, stage: Option<StageId>) -> Result<()> {
        for (s, group) in self.groups.experts.iter().filter(|(s, _)| stage.is_none_or(|x| x == **s)) {
            let left = group.unaccounted();
            if let Some(crate::backend::port::Made { layer, exchange, .. }) = left.first() {
                return Err(ExecError::Plan(format!(
                    "a pass of {s} made {} all-to-all(s) that the plan does not list after it, the first a {exchange} at layer {layer}",
                    left.len()
                )));
            }
        }
        Ok(())
    }

    /// Sends a computed message; `missing` says what was not computed.
    pub(crate) fn send(
        &mut self,
        peer: DeviceId,
        msg: Option<Message>,
        code: usize,
        missing: &'static str,
    ) -> Result<()> {
        Ok(self.comm.send(peer, msg.ok_or(ExecError::Missing(missing))?, code)?)
    }

    pub(crate) fn last_stage(&self) -> StageId {
        StageId(self.plan.stages.len().saturating_sub(1) as u32)
    }

    pub(crate) fn state(&mut self, s: StageId) -> Result<&mut StageState<B>> {
        self.stages.get_mut(&s).ok_or_else(|| ExecError::Plan(format!("{} does not hold {s}", self.device)))
    }

    /// The dropout key of a microbatch's forward (the same at its recompute): its step and
    /// number in the step, from its number in the run.
    pub(crate) fn mask_key(&self, mb: MicrobatchId) -> (u64, u64, u64) {
        // context parallelism: every chunk of a microbatch draws from the microbatch's key
        let t = &self.plan.training;
        let n = t.microbatches.max(1) as u64;
        let cp = t.context_parallel.max(1) as u64;
        (t.seed, u64::from(mb.0) / n, u64::from(mb.0) % n / cp)
    }

    /// The learning rate of the step being run (the plan's schedule).
    pub(crate) fn learning_rate(&self) -> f64 {
        self.plan.training.lr_at(self.progress.current_step)
    }

    pub(crate) fn load_microbatch(
        &mut self,
        stage: StageId,
        mb: MicrobatchId,
        inputs: bool,
        labels: bool,
    ) -> Result<()> {
        let t = &self.plan.training;
        // `mb` is the microbatch's number in the run: step·N + its number in the step; with
        // context parallelism, chunk c of the step's microbatch m is number m·cp + c
        let n = t.microbatches.max(1);
        let cp = t.context_parallel.max(1);
        let (step, k) = (mb.0 as usize / n, mb.0 as usize % n);
        let (x, y) = match self.progress.evaluating {
            Some(batch) => self.data.validation_microbatch(batch, k / cp, t.microbatch_size, t.batch_size),
            None => self.data.microbatch(step, k / cp, t.microbatch_size, t.batch_size),
        };
        let seq = self.plan.model.input.first().copied().unwrap_or(1);
        let (x, y, seq) = match self.groups.contexts.get(&stage) {
            Some(c) if cp > 1 => {
                if c.group.position != k % cp {
                    return Err(ExecError::Plan(format!(
                        "chunk {} of a microbatch was routed to context-parallel position {}",
                        k % cp,
                        c.group.position
                    )));
                }
                let at = pipec_plan::plan::context_positions(seq, cp, c.group.position);
                let b = t.microbatch_size;
                let x = match x {
                    Inputs::Tokens(v) => Inputs::Tokens(crate::nn::context::take_positions(&v, b, &at)?),
                    Inputs::Features(_) => {
                        return Err(ExecError::Data("context parallelism splits token sequences only".into()))
                    }
                };
                let y = match y {
                    Targets::Classes(v) => Targets::Classes(crate::nn::context::take_positions(&v, b, &at)?),
                    Targets::Values(_) => {
                        return Err(ExecError::Data("context parallelism splits next-token targets only".into()))
                    }
                };
                (x, y, at.len())
            }
            _ => (x, y, seq),
        };
        if inputs {
            let mut shape = vec![t.microbatch_size, seq];
            shape.extend(self.plan.model.input.iter().skip(1));
            let act = match x {
                Inputs::Features(v) => host_to_act::<B>(&shape, v, &self.dev)?,
                Inputs::Tokens(v) => Act::Tokens(Tensor::from_data(TensorData::new(v, shape), &self.dev)),
            };
            self.passes.inputs.insert((stage, mb), act);
        }
        if labels {
            self.passes.labels.insert(mb, y);
        }
        Ok(())
    }
}

impl<B: ExecBackend> Worker<'_, B> {
    /// Validation: runs the plan's forward-only stream over held-out batch `batch` after
    /// step `step`; this device's summed loss, microbatches, correct predictions and
    /// predictions (zeros where it computes no loss).
    pub(crate) fn evaluate(&mut self, step: usize, batch: usize) -> std::result::Result<[f64; 4], (usize, ExecError)> {
        let plan = self.plan;
        let Some(stream) = plan.eval.as_ref().and_then(|e| e.get(&self.device)) else { return Ok([0.0; 4]) };
        self.progress.evaluating = Some(batch);
        let r = self.step(step, &[(StreamSegment::Body, stream.as_slice())], true);
        self.progress.evaluating = None;
        let r = r?;
        let loss: f64 = r.losses.iter().map(|(_, l)| f64::from(*l)).sum();
        let (correct, total) = r.correct.iter().fold((0.0, 0.0), |(c, t), (a, b)| (c + a, t + b));
        Ok([loss, r.losses.len() as f64, correct, total])
    }

    /// The model state this device holds now (see [`HeldState`]).
    pub(crate) fn held_state(&self) -> Result<HeldState> {
        let values = |items: Vec<(burn::module::ParamId, crate::parallel::reshard::Item)>| -> Result<u64> {
            let mut n = 0;
            for (_, item) in &items {
                n += crate::parallel::reshard::tensor_values(item)?.iter().map(|t| t.len() as u64).sum::<u64>();
            }
            Ok(n)
        };
        let mut held = HeldState {
            gradients: self.progress.peak_gradients,
            pool_peak: self.progress.pool_peak,
            ..HeldState::default()
        };
        for st in self.stages.values() {
            held.weights +=
                layout::<B, _>(st.model()?).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum::<u64>();
            held.optimizer += values(st.optim.items().map_err(ExecError::Checkpoint)?)?;
            if let Some(shard) = &st.shard {
                held.optimizer += shard.layout.segment as u64;
                held.optimizer += values(shard.optim.items().map_err(ExecError::Checkpoint)?)?;
            }
        }
        Ok(held)
    }
}

/// Whether an instruction sends a message (issued when the compute reaches it) or
/// receives one (posted ahead).
pub(crate) fn sends(ins: &Instr) -> bool {
    ins.transfer().is_some_and(|t| t.end == pipec_plan::End::Send)
}

pub(crate) fn receives(ins: &Instr) -> bool {
    ins.transfer().is_some_and(|t| t.end == pipec_plan::End::Recv)
}

/// The message a point-to-point instruction sends or receives (the plan's identity, the
/// same at both ends); an activation received by the first stage has none.
pub(crate) fn expected_message(ins: &Instr) -> Result<Tag> {
    ins.transfer().and_then(|t| t.id).ok_or_else(|| ExecError::Plan(format!("`{ins}` names a message no stage sends")))
}
