//! The strategy search: every way to lay a spec's model out on its cluster — tensor-parallel
//! degree within a node, pipeline depth and data-parallel degree, schedule, microbatch
//! count, recompute — ranked by the same prediction `pipec compile` makes, under every
//! device's memory.
//!
//! Each candidate is written as the spec's own text with its `strategy` replaced, so it goes
//! through the same front end as a user's spec (every constraint `pipec check` knows) and
//! the winner is text the user can paste. The search is branch and bound over bounds that
//! tighten as a candidate is reached ([`Known`]): first its work spread evenly over the
//! devices ([`crate::bound::work_bound`]); then its own lower bound
//! ([`crate::bound::lower_bound`]: per device, its compute plus the pipeline's unavoidable
//! fill and drain and its communication engine's reduce-scatters, with the simulator's
//! costs; and whether its memory — model state, and the activations its schedule's order
//! keeps at once — overflows a device, which it does exactly as the memory pass would for a
//! symmetric synchronous plan); then its schedule's order run on one pipeline replica
//! ([`crate::bound::timeline_bound`]); then it is compiled and simulated. The search stops
//! when the next bound is no better than the last of the best plans it ranks
//! ([`SearchOptions::ranked`]). Since no simulation beats its bound, the winner and the
//! runner-ups are the best of the whole space under the compiler's model (a brute force
//! over the same space checks it in the tests).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashSet};
use std::fmt::Write as _;
use std::time::Instant;

use pipec_grammar::check_source_in;
use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::{AutoStrategy, Partition, Recompute, Schedule, Spec};
use pipec_plan::engine::capability;
use pipec_plan::plan::Fp8Plan;
use pipec_plan::schedule::LayoutFacts;
use pipec_plan::vocab::{CpComm, ScheduleKind, Sharding};

use crate::bound::{lower_bound, timeline_bound, work_bound, Memo};
use crate::compile::{compile, CompileResult};
use crate::options::CompileOptions;
use crate::predict::predict_if_fits;

/// What the user pins.
#[derive(Debug, Clone)]
pub struct SearchOptions {
    /// Only schedules that train like one device (the default).
    pub synchronous_only: bool,
    /// The most pipeline stages (ranks) to consider.
    pub max_pipeline_depth: Option<usize>,
    /// The memory headroom every device must keep (a fraction of its capacity).
    pub headroom: f64,
    /// Only these schedules (all that apply when None).
    pub schedules: Option<Vec<ScheduleKind>>,
    /// A written schedule's model chunks per device (`virtual_stages`, for the schedules
    /// with several); None: interleaved with 2 and 4, ZBV and DualPipeV with 2.
    pub virtual_stages: Option<usize>,
    /// Compile and simulate every valid candidate instead of pruning by the bound (tests).
    pub exhaustive: bool,
    /// Fields the user fixed: the tensor-parallel degree, the layout (replicas per stage),
    /// the microbatch count, recompute.
    pub tp: Option<usize>,
    pub layout: Option<Vec<usize>>,
    pub microbatches: Option<usize>,
    pub recompute: Option<Recompute>,
    /// `zero` written: every replicated candidate shards so (otherwise the search shards
    /// the optimizer state of replicated stages, never slower in the model, and the weights
    /// too where that alone makes a plan fit).
    pub sharding: Option<Sharding>,
    /// `sequence_parallel: true` written: kept on every candidate with tensor parallelism.
    pub sequence_parallel: bool,
    /// `tp_overlap: true` written: kept on every candidate with tensor parallelism.
    pub tp_overlap: bool,
    /// `sequence_parallel` not written: on beside tensor parallelism under an engine that
    /// runs it (what the engines' recipes run; it keeps less, and its collectives move what
    /// the all-reduces did).
    pub sequence_parallel_free: bool,
    /// `tp_overlap` not written: tried on and off beside sequence parallelism under an
    /// engine that overlaps tensor parallelism's collectives (its products run in steps,
    /// each less efficient, while it hides the collectives).
    pub tp_overlap_free: bool,
    /// `moe_dispatch` not written: DeepEP tried beside the all-to-all on every candidate
    /// with expert parallelism, under an engine that runs it.
    pub moe_dispatch_free: bool,
    /// `ep_overlap` not written: tried on and off on every candidate with expert
    /// parallelism whose schedule pairs passes, under an engine that overlaps the exchanges.
    pub ep_overlap_free: bool,
    /// `cp_comm` written: kept on every candidate with context parallelism; None: both
    /// tried.
    pub cp_comm: Option<CpComm>,
    /// `ep` written: every candidate divides the experts so (otherwise, for a model with
    /// expert blocks, every degree that divides the replicas and the experts is tried).
    pub ep: Option<usize>,
    /// `etp: 1` written: every candidate with tensor and expert parallelism keeps each
    /// expert whole, `ep` counting the group's devices (a multiple of `tp`), with sequence
    /// parallelism.
    pub whole_experts: bool,
    /// `cp` written: every candidate splits the sequence so; None (`cp: auto`): every degree
    /// the model, the sequence and the devices allow is tried.
    pub cp: Option<usize>,
    /// How many of the best plans that fit the search finds exactly: the winner (1, the
    /// default) and as many runner-ups (`pipec search --exact-top`); the branch and bound
    /// stops when no bound can beat the last of them. Other runner-ups in the report are
    /// plans simulated on the way.
    pub ranked: usize,
    /// `training.precision: auto` where FP8 runs ([`fp8_obstacle`]): every candidate is tried
    /// in bf16 and in FP8 as this says; None: in the spec's written precision.
    pub fp8: Option<Fp8Plan>,
    /// Under `training.precision: auto`, why FP8 is not tried (shown in the report).
    pub fp8_not_tried: Option<String>,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            synchronous_only: true,
            max_pipeline_depth: None,
            headroom: pipec_plan::rules::DEFAULT_MEMORY_HEADROOM,
            schedules: None,
            virtual_stages: None,
            exhaustive: false,
            tp: None,
            layout: None,
            microbatches: None,
            recompute: None,
            sharding: None,
            sequence_parallel: false,
            tp_overlap: false,
            sequence_parallel_free: true,
            tp_overlap_free: true,
            moe_dispatch_free: true,
            ep_overlap_free: true,
            cp_comm: None,
            ep: None,
            whole_experts: false,
            cp: Some(1),
            ranked: 1,
            fp8: None,
            fp8_not_tried: None,
        }
    }
}

impl SearchOptions {
    /// What a spec's `auto` strategy leaves free and pins.
    pub fn from_spec(spec: &Spec, auto: &AutoStrategy) -> SearchOptions {
        let st = &spec.strategy;
        let (fp8, fp8_not_tried) = precision_choices(spec);
        SearchOptions {
            // PyTorch's per-forward running statistics fold a whole step in order
            synchronous_only: !auto.asynchronous
                || spec.training.recipe.running_stats == pipec_plan::recipe::RunningStats::PerForward,
            max_pipeline_depth: auto.max_depth,
            headroom: auto.headroom,
            schedules: if auto.schedule { auto.schedules.clone() } else { Some(vec![st.schedule.kind]) },
            virtual_stages: (!auto.schedule && st.schedule.kind.default_virtual_stages() > 1)
                .then_some(st.schedule.virtual_stages),
            exhaustive: false,
            tp: (!auto.tp).then_some(st.tp),
            layout: (!auto.layout).then(|| st.replicas.clone()),
            microbatches: (!auto.microbatches).then_some(st.microbatches),
            recompute: (!auto.recompute).then(|| st.recompute.clone()),
            sharding: (st.sharding != Sharding::None).then_some(st.sharding),
            sequence_parallel: st.sequence_parallel,
            tp_overlap: st.tp_overlap,
            sequence_parallel_free: auto.sequence_parallel,
            tp_overlap_free: auto.tp_overlap,
            moe_dispatch_free: auto.moe_dispatch,
            ep_overlap_free: auto.ep_overlap,
            cp_comm: (!auto.cp_comm).then_some(st.cp_comm),
            ep: (!auto.ep).then_some(st.ep),
            whole_experts: st.whole_experts,
            cp: (!auto.cp).then_some(st.cp.max(1)),
            ranked: 1,
            fp8,
            fp8_not_tried,
        }
    }

    /// The defaults, with the spec's `precision: auto` (for `pipec search` on a written
    /// strategy, which it ignores).
    pub fn for_precision_of(spec: &Spec) -> SearchOptions {
        let (fp8, fp8_not_tried) = precision_choices(spec);
        SearchOptions { fp8, fp8_not_tried, ..SearchOptions::default() }
    }
}

/// What `training.precision: auto` tries besides bf16: FP8 training as the spec's `fp8`
/// says where it runs, or why not ([`fp8_obstacle`]); (None, None) without `auto`.
pub fn precision_choices(spec: &Spec) -> (Option<Fp8Plan>, Option<String>) {
    match spec.training.precision_search {
        None => (None, None),
        Some(p) => match fp8_obstacle(spec, p.fp8) {
            None => (Some(p.fp8), None),
            Some(why) => (None, Some(why)),
        },
    }
}

/// The `training.precision` a precision choice is written as (`fp8`: FP8 training; None:
/// bf16, the baseline of `precision: auto`).
fn precision_name(fp8: Option<Fp8Plan>) -> &'static str {
    if fp8.is_some() {
        "fp8"
    } else {
        "bf16"
    }
}

/// How much room a compiled plan leaves, as `precision: auto` ranks its precisions: 2 when it
/// keeps the memory headroom (no W0602), 1 when it fits short of it, 0 when it does not fit
/// or does not compile (an error).
pub(crate) fn room(diagnostics: &[Diagnostic]) -> u8 {
    match (diagnostics.iter().any(Diagnostic::is_error), diagnostics.iter().any(|d| d.code == "W0602")) {
        (true, _) => 0,
        (false, true) => 1,
        (false, false) => 2,
    }
}

/// The spec with its precision chosen (`fp8`: FP8 training as it says; None: bf16, the
/// baseline `precision: auto` is checked with).
pub fn with_precision(spec: &Spec, fp8: Option<Fp8Plan>) -> Spec {
    let training = pipec_grammar::spec::Training { fp8, precision_search: None, ..spec.training.clone() };
    Spec { training, ..spec.clone() }
}

/// Why `precision: auto` does not try FP8 training as `fp8` says on the spec's engine and
/// device: pipec's executor has no FP8 products (it trains an FP8 plan in bf16), the engine
/// does not run the recipe (its capability table), or the device has no FP8 rate (FP8
/// products would run at the bf16 rate, after their casts). None: it is tried.
pub fn fp8_obstacle(spec: &Spec, fp8: Fp8Plan) -> Option<String> {
    let target = &spec.engine.target;
    if target.is_pipec() {
        return Some(
            "pipec's executor has no FP8 products (`pipec run` trains an FP8 plan in bf16): name the engine that runs the plan (`engine:`)".into(),
        );
    }
    let training = pipec_grammar::spec::Training { fp8: Some(fp8), ..spec.training.clone() };
    let layout = pipec_grammar::engine_check::layout_of(&spec.model, &spec.strategy, &training, spec.engine.compiled);
    if let Some(r) =
        capability::refusals(target, &layout).into_iter().find(|r| r.feature == capability::Feature::Precision)
    {
        return Some(r.message);
    }
    if spec.cluster.device.matrix.fp8 <= 0.0 {
        return Some(format!(
            "the device ({}) has no FP8 matrix rate: its products would run at the bf16 rate after their casts",
            spec.cluster.device.name
        ));
    }
    None
}

/// One point of the space.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    pub tp: usize,
    /// Replicas per pipeline rank (for a layout left to PipeDream's planner, its choice
    /// once bounded; empty when it found none).
    pub replicas: Vec<usize>,
    /// The layout is PipeDream's planner's (`partition: auto`, no stages written).
    pub planner: bool,
    pub schedule: ScheduleKind,
    /// Model chunks per device (interleaved, zbv; 1 otherwise).
    pub chunks: usize,
    pub microbatches: usize,
    pub recompute: Recompute,
    /// ZeRO's sharding across the replicas of each stage.
    pub sharding: Sharding,
    /// Megatron's sequence parallelism (with `tp` > 1).
    pub sequence_parallel: bool,
    /// Tensor parallelism's collectives overlapped with computation (with `tp` > 1).
    pub tp_overlap: bool,
    /// How context parallelism exchanges keys and values (with `cp` > 1).
    pub cp_comm: CpComm,
    /// Expert parallelism's degree (1: every replica holds every expert): replicas, or with
    /// whole experts the group's devices.
    pub ep: usize,
    /// Each routed expert whole on one device beside tensor parallelism (`etp: 1`).
    pub whole_experts: bool,
    /// How expert parallelism dispatches tokens (the spec's `moe_dispatch`, with `ep` > 1).
    pub moe_dispatch: pipec_plan::vocab::MoeDispatch,
    /// Megatron-LM's expert-parallel overlap (the spec's `ep_overlap`), on a candidate with
    /// `ep` > 1 whose schedule combines 1F1B.
    pub ep_overlap: bool,
    /// Context parallelism's degree (1: none); `replicas` and `microbatches` are as written
    /// (each replica of cp members, each microbatch of cp chunks).
    pub cp: usize,
    /// Whether the spec overlaps communication (written into the strategy only when not).
    pub overlap: bool,
    /// The spec's gradient buckets (`bucket`, in bytes; written when set).
    pub bucket: Option<u64>,
    /// FP8 training as this says (None: the spec's precision, bf16 under `precision: auto`).
    pub fp8: Option<Fp8Plan>,
    pub outcome: Outcome,
}

impl Candidate {
    /// The layout written into the strategy (None: PipeDream's planner lays it out).
    fn layout(&self) -> Option<&[usize]> {
        (!self.planner).then_some(self.replicas.as_slice())
    }

    /// The `strategy` mapping as YAML flow text (written when asked: a large search
    /// enumerates tens of thousands of candidates and shows a few).
    pub fn strategy(&self) -> String {
        let overlap = self.overlap;
        // the schedules with several chunks per device write how many
        let schedule = if self.schedule.default_virtual_stages() > 1 {
            format!("{{ kind: {}, virtual_stages: {} }}", self.schedule.name(), self.chunks)
        } else {
            self.schedule.name().to_string()
        };
        let overlap = if overlap { "" } else { ", overlap: false" };
        let bucket = match self.bucket {
            None => String::new(),
            Some(b) if b % (1 << 20) == 0 => format!(", bucket: {}MiB", b >> 20),
            Some(b) if b % (1 << 10) == 0 => format!(", bucket: {}KiB", b >> 10),
            Some(b) => format!(", bucket: {b}B"),
        };
        // PipeDream's planner lays out what has no stages written
        let (stages, partition) = match self.layout() {
            Some(l) => (format!("stages: \"{}\", ", notation(l)), "balanced"),
            None => (String::new(), "auto"),
        };
        let zero = match self.sharding {
            Sharding::None => String::new(),
            s => format!(", zero: {}", s.level()),
        };
        let sp = if self.sequence_parallel { ", sequence_parallel: true" } else { "" };
        let overlap_tp = if self.tp_overlap { ", tp_overlap: true" } else { "" };
        let ep = match (self.ep, self.moe_dispatch, self.ep_overlap) {
            (1, _, _) => String::new(),
            (n, dispatch, overlap) => {
                let dispatch = match dispatch {
                    pipec_plan::vocab::MoeDispatch::AllToAll => String::new(),
                    d => format!(", moe_dispatch: {d}"),
                };
                let overlap = if overlap { ", ep_overlap: true" } else { "" };
                let etp = if self.whole_experts { ", etp: 1" } else { "" };
                format!(", ep: {n}{etp}{dispatch}{overlap}")
            }
        };
        let cp = match (self.cp, self.cp_comm) {
            (1, _) => String::new(),
            (n, CpComm::AllGather) => format!(", cp: {n}"),
            (n, comm) => format!(", cp: {n}, cp_comm: {comm}"),
        };
        format!(
            "{{ {stages}tp: {}, schedule: {schedule}, microbatches: {}, partition: {partition}, recompute: {}{zero}{sp}{overlap_tp}{ep}{cp}{overlap}{bucket} }}",
            self.tp,
            self.microbatches,
            self.recompute.text()
        )
    }

    /// The spec the strategy text gives, without reading the text (for the bound): `base`
    /// with the strategy's fields set as the front end sets them (a layout left to
    /// PipeDream's planner: one stage per device until it plans). Written into `s`, a spec
    /// cloned from `base` once: every field set here is overwritten, the rest are `base`'s
    /// (the bound reads thousands of candidates, and cloning the model for each was a tenth
    /// of a large search).
    fn spec_in<'a>(&self, base: &Spec, s: &'a mut Spec) -> &'a Spec {
        let layout = self.layout();
        let st = &mut s.strategy;
        st.replicas = layout.map_or_else(|| vec![1; base.cluster.device_count() / self.tp.max(1)], <[usize]>::to_vec);
        st.tp = self.tp;
        st.schedule = Schedule::new(self.schedule, st.schedule.span);
        if self.schedule.default_virtual_stages() > 1 {
            st.schedule.virtual_stages = self.chunks;
        }
        st.microbatches = self.microbatches;
        st.partition = if layout.is_some() { Partition::Balanced } else { Partition::Auto };
        st.recompute = self.recompute.clone();
        st.sharding = self.sharding;
        st.sequence_parallel = self.sequence_parallel;
        st.tp_overlap = self.tp_overlap;
        st.cp_comm = self.cp_comm;
        st.ep = self.ep;
        st.whole_experts = self.whole_experts;
        st.moe_dispatch = self.moe_dispatch;
        st.ep_overlap = self.ep_overlap;
        // as the front end lowers context parallelism (the layout and microbatches as written)
        st.split_sequences(self.cp);
        st.auto = None;
        st.layout_fixed = layout.is_some();
        s.training.fp8 = self.fp8;
        s
    }

    /// The `training.precision` a searched precision (`precision: auto`) is written as.
    pub fn precision(&self) -> &'static str {
        precision_name(self.fp8)
    }

    /// The edits that write the candidate into the spec: its strategy, and under
    /// `precision: auto` its precision.
    pub fn edits(&self, spec: &Spec) -> Vec<(pipec_grammar::span::Span, String)> {
        std::iter::once((spec.strategy.span, self.strategy()))
            .chain(spec.training.precision_search.map(|p| (p.span, self.precision().to_string())))
            .collect()
    }

    /// Pipeline ranks.
    pub fn pp(&self) -> usize {
        self.replicas.len()
    }
    /// The most replicas of any rank (the data-parallel degree of an equal layout).
    pub fn dp(&self) -> usize {
        self.replicas.iter().copied().max().unwrap_or(0)
    }
}

/// What became of a candidate.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The front end refused it (the first error's message).
    Invalid(String),
    /// Its model state with the activations its schedule keeps at once overflows a device:
    /// found by the bound, without lowering it (or, for a plan the bound cannot walk, by its
    /// streams).
    TooBig,
    /// Its bound is no better than a plan already found.
    Pruned { bound_s: f64 },
    /// Compiled: simulated when it fits (its step is infinite when it does not).
    Planned(Prediction),
}

impl Outcome {
    /// Too big for memory: by its bound (model state and one microbatch), or lowered and found so
    /// (then not simulated).
    pub fn too_big(&self) -> bool {
        match self {
            Outcome::TooBig => true,
            Outcome::Planned(p) => !p.fits && !p.step_s.is_finite(),
            _ => false,
        }
    }

    /// Compiled and simulated.
    pub fn simulated(&self) -> bool {
        matches!(self, Outcome::Planned(p) if p.step_s.is_finite())
    }
}

/// A compiled candidate's prediction.
#[derive(Debug, Clone, PartialEq)]
pub struct Prediction {
    pub bound_s: f64,
    pub step_s: f64,
    pub bubble: f64,
    /// The tightest memory headroom over the devices (negative: it does not fit).
    pub headroom: f64,
    /// The longest exposed all-reduce per step on any device.
    pub exposed_all_reduce_s: f64,
    pub fits: bool,
}

/// The search's result.
#[derive(Debug, Clone)]
pub struct SearchReport {
    pub candidates: Vec<Candidate>,
    pub seconds: f64,
    /// What the model's state needs, for the report when nothing fits.
    pub need: crate::fit::MemoryNeed,
    /// Samples per step, what turns a step time into samples/s.
    pub batch_size: usize,
    /// A language model's basis for tokens/s per device and MFU (`Spec::utilization`).
    pub utilization: Option<pipec_plan::flops::Utilization>,
    /// How the spec's engine runs its kernels on its device (`Spec::engine`), the steps'
    /// pricing.
    pub kernels: Option<pipec_plan::engine::performance::Performance>,
}

impl SearchReport {
    pub fn count(&self, f: impl Fn(&Outcome) -> bool) -> usize {
        self.candidates.iter().filter(|c| f(&c.outcome)).count()
    }

    /// The planned candidates that fit and keep the headroom, fastest first.
    pub fn ranked(&self, headroom: f64) -> Vec<(usize, &Prediction)> {
        let mut out: Vec<(usize, &Prediction)> = self
            .candidates
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match &c.outcome {
                Outcome::Planned(p) if p.fits && p.headroom >= headroom => Some((i, p)),
                _ => None,
            })
            .collect();
        out.sort_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s).then(a.0.cmp(&b.0)));
        out
    }
}

/// A candidate waiting in the branch and bound, by its bound (then its index, so the order
/// is the candidates' when bounds tie).
#[derive(Debug, Clone, Copy)]
struct Queued {
    bound_s: f64,
    index: usize,
    /// How its bound was found.
    known: Known,
}

/// The bounds a candidate goes through in the branch and bound, each no less than the one
/// before and each found only when the candidate is reached under the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// Its work spread evenly over the devices (`work_bound`), or the bound of the
    /// candidate it was derived from.
    Work,
    /// Its own `lower_bound` (which also tells it fits, and lays out a PipeDream-planner
    /// layout).
    Bound,
    /// Its schedule's order run on one pipeline replica (`timeline_bound`): next, it is
    /// lowered and simulated.
    Timeline,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        self.bound_s.total_cmp(&other.bound_s).then(self.index.cmp(&other.index))
    }
}

fn divisors(n: usize) -> impl Iterator<Item = usize> {
    (1..=n).filter(move |d| n.is_multiple_of(*d))
}

/// The schedules the search tries for a pipeline of `pp` ranks, each with its model chunks
/// per device: interleaved with 2 and 4, ZBV (and DualPipeV, for a model with expert blocks:
/// the schedule made for them) with their 2, the others 1.
fn schedules_for(pp: usize, options: &SearchOptions, experts: bool) -> Vec<(ScheduleKind, usize)> {
    use pipec_plan::vocab::Choice;
    let mut all: Vec<(u8, ScheduleKind)> =
        ScheduleKind::ALL.iter().filter_map(|&k| tried(k, pp, options, experts).map(|rank| (rank, k))).collect();
    all.sort_by_key(|&(rank, _)| rank);
    all.into_iter()
        .map(|(_, k)| k)
        .filter(|k| options.schedules.as_ref().is_none_or(|only| only.contains(k)))
        .flat_map(|k| match (k, options.virtual_stages) {
            (ScheduleKind::Interleaved | ScheduleKind::Zbv | ScheduleKind::DualPipeV, Some(v)) => vec![(k, v)],
            (ScheduleKind::Interleaved, None) => vec![(k, 2), (k, 4)],
            (ScheduleKind::Zbv | ScheduleKind::DualPipeV, None) => vec![(k, 2)],
            (other, _) => vec![(other, 1)],
        })
        .collect()
}

/// Whether the search tries `kind` on `pp` stages, and where in its order (ties between
/// equal candidates go to the earlier): an exhaustive rule, so a new schedule is a compile
/// error here until it says. DualPipe and DualPipeV only where there are experts to overlap
/// with, the asynchronous schedules unless the search is held to synchronous ones.
fn tried(kind: ScheduleKind, pp: usize, options: &SearchOptions, experts: bool) -> Option<u8> {
    let piped = pp > 1;
    let (rank, when) = match kind {
        ScheduleKind::DpOnly => (0, !piped),
        ScheduleKind::Gpipe => (1, piped),
        ScheduleKind::OneFOneB => (2, piped),
        ScheduleKind::Interleaved => (3, piped),
        ScheduleKind::ZbH1 => (4, piped),
        ScheduleKind::Zbv => (5, piped),
        ScheduleKind::Chimera => (6, piped),
        ScheduleKind::DualPipeV => (7, piped && experts),
        ScheduleKind::DualPipe => (8, piped && experts),
        ScheduleKind::PipeDream => (9, piped && !options.synchronous_only),
        ScheduleKind::TwoBw => (10, piped && !options.synchronous_only),
    };
    when.then_some(rank)
}

fn notation(replicas: &[usize]) -> String {
    replicas.iter().map(ToString::to_string).collect::<Vec<_>>().join("-")
}

fn notation_list(stages: &[usize]) -> String {
    stages.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

/// `recompute` in the JSON report: `true`, `false` or the list of stages.
fn recompute_json(r: &Recompute) -> serde_json::Value {
    match r {
        Recompute::Off => false.into(),
        Recompute::All => true.into(),
        Recompute::Stages(v) => v.clone().into(),
        Recompute::Selective => "selective".into(),
        Recompute::Blocks(b) => serde_json::to_value(b).unwrap_or(serde_json::Value::Null),
    }
}

/// Whether a candidate's ZeRO levels are yet to be tried: an unsharded layout with a
/// replicated stage under a schedule that updates once per step, and no level written.
fn shardable(c: &Candidate, options: &SearchOptions) -> bool {
    let replicated = c.layout().is_some_and(|l| l.iter().any(|&r| r * c.cp > 1) && c.schedule.updates_per_step());
    replicated && c.sharding == Sharding::None && options.sharding.is_none()
}

/// The expert-parallel degrees to try on a layout of `members` per stage (its replicas
/// times the context-parallel degree): the written one, or for a model with expert blocks
/// (`experts`: each block's count) every degree dividing every stage's members and every
/// block's experts, under a schedule whose replicas run their passes
/// together (one update per step: the front end's E0417–E0419).
/// With whole experts (`etp: 1` beside `tp` > 1) a degree counts the group's devices: tp
/// times the replicas it groups; a written `ep` stays as written, where it folds.
fn expert_degrees(
    experts: &[usize],
    options: &SearchOptions,
    members: Option<&[usize]>,
    (schedule, tp, whole): (ScheduleKind, usize, bool),
) -> Vec<usize> {
    let fold = if whole { tp.max(1) } else { 1 };
    let Some(l) = members else { return vec![options.ep.unwrap_or(1)] };
    let together = schedule.updates_per_step();
    // `e` devices (replicas when not folded) to a group
    let fits = |e: usize| {
        e == 1
            || (together
                && e.is_multiple_of(fold)
                && l.iter().all(|r| r.is_multiple_of(e / fold))
                && experts.iter().all(|x| x.is_multiple_of(e)))
    };
    match options.ep {
        Some(e) if fold > 1 => [e].into_iter().filter(|&e| fits(e)).collect(),
        Some(e) => vec![e],
        None if experts.is_empty() => vec![1],
        None => divisors(l.iter().copied().max().unwrap_or(1)).map(|e| e * fold).filter(|&e| fits(e)).collect(),
    }
}

/// The expert-parallel degrees to try with whether each keeps the routed experts whole:
/// split like the block, or whole (`etp: 1`), as written, or both under an engine that runs
/// whole experts beside tensor parallelism (pipec's executor does not).
fn expert_choices(
    spec: &Spec,
    options: &SearchOptions,
    (experts, members): (&[usize], Option<&[usize]>),
    (schedule, tp): (ScheduleKind, usize),
) -> Vec<(usize, bool)> {
    let folds: &[bool] = if options.whole_experts {
        &[true]
    } else if tp > 1 && !experts.is_empty() && runs_whole_experts(spec) {
        &[false, true]
    } else {
        &[false]
    };
    let mut out: Vec<(usize, bool)> = Vec::new();
    for &whole in folds {
        for ep in expert_degrees(experts, options, members, (schedule, tp, whole)) {
            let choice = (ep, whole && ep > 1);
            if !out.contains(&choice) {
                out.push(choice);
            }
        }
    }
    out
}

/// The (sequence parallelism, tensor-parallel overlap) pairs a candidate of `tp` ranks
/// tries: as written; sequence parallelism where whole experts dispatch each rank's sequence
/// share, or unwritten under an engine that runs it; the overlap, unwritten, both ways
/// beside sequence parallelism under an engine that overlaps the collectives (pipec's
/// executor runs them in line, and its sequence parallelism keeps what tensor parallelism
/// does: neither is added there).
fn tensor_parallel_choices(spec: &Spec, options: &SearchOptions, tp: usize, whole: bool) -> Vec<(bool, bool)> {
    if tp <= 1 {
        return vec![(false, false)];
    }
    let runs = |c| another_engine_runs(spec, c);
    let sp = options.sequence_parallel
        || whole
        || (options.sequence_parallel_free && runs(capability::Capability::SequenceParallel));
    let overlaps: &[bool] = if options.tp_overlap {
        &[true]
    } else if options.tp_overlap_free && sp && runs(capability::Capability::TpOverlap) {
        &[false, true]
    } else {
        &[false]
    };
    overlaps.iter().map(|&o| (sp, o)).collect()
}

/// The (dispatch, expert-parallel overlap) pairs a candidate with `ep` exchanging ranks
/// tries: as written; DeepEP beside the all-to-all when `moe_dispatch` is not written and
/// the engine runs it; the overlap, where the schedule pairs passes (`pairs`), on when
/// written, both ways when not written and the engine overlaps the exchanges (pipec's
/// executor runs DeepEP's dispatch as an all-to-all and a pair's passes one after the
/// other: neither is added there).
fn expert_exchange_choices(
    spec: &Spec,
    options: &SearchOptions,
    ep: usize,
    pairs: bool,
) -> Vec<(pipec_plan::vocab::MoeDispatch, bool)> {
    use pipec_plan::vocab::MoeDispatch;
    if ep <= 1 {
        return vec![(MoeDispatch::default(), false)];
    }
    let runs = |c| another_engine_runs(spec, c);
    let dispatches = if options.moe_dispatch_free && runs(capability::Capability::DeepEpDispatch) {
        vec![MoeDispatch::AllToAll, MoeDispatch::DeepEp]
    } else {
        vec![spec.strategy.moe_dispatch]
    };
    let overlaps: &[bool] = if !pairs {
        &[false]
    } else if spec.strategy.ep_overlap {
        &[true]
    } else if options.ep_overlap_free && runs(capability::Capability::EpOverlap) {
        &[false, true]
    } else {
        &[false]
    };
    dispatches.into_iter().flat_map(|d| overlaps.iter().map(move |&o| (d, o))).collect()
}

/// Whether the spec's engine, other than pipec's own executor, runs `what` (its capability
/// table): what the search adds unwritten only where an engine runs it as priced (pipec's
/// executor refuses whole experts beside tensor parallelism, and runs the overlaps in line,
/// sequence parallelism as tensor parallelism and DeepEP as an all-to-all).
fn another_engine_runs(spec: &Spec, what: capability::Capability) -> bool {
    let target = &spec.engine.target;
    !target.is_pipec() && capability::find(target, |c| *c == what).is_some()
}

/// Whether the spec's engine runs routed experts whole beside tensor parallelism (its
/// capability table; never pipec's executor, whose `pipec run` refuses it).
fn runs_whole_experts(spec: &Spec) -> bool {
    another_engine_runs(spec, capability::Capability::WholeExperts)
}

/// The context-parallel degrees to try on `machines` devices per tensor-parallel rank: the
/// written one, or with `cp: auto` every divisor of them that cuts the sequence into 2·cp
/// equal chunks, for a model that splits along its sequence (the front end's E0420, E0421).
fn context_degrees(spec: &Spec, options: &SearchOptions, machines: usize) -> Vec<usize> {
    if let Some(cp) = options.cp {
        return if machines.is_multiple_of(cp.max(1)) { vec![cp.max(1)] } else { Vec::new() };
    }
    let seq = spec.model.input.first().copied().unwrap_or(1);
    let splits = pipec_grammar::context_parallel_obstacle(&spec.model).is_none();
    divisors(machines).filter(|&cp| cp == 1 || (splits && seq.is_multiple_of(2 * cp))).collect()
}

/// A candidate at each ZeRO level (the distributed optimizer updates 1/d of the weights;
/// sharding gradients and weights saves memory and changes how the reduction overlaps the
/// backward): their bounds are never below the unsharded one's. Their strategy text is
/// written when they are bounded.
fn sharded_variants(c: &Candidate) -> Vec<Candidate> {
    [Sharding::Optimizer, Sharding::Gradients, Sharding::Parameters]
        .into_iter()
        .map(|sharding| Candidate { sharding, ..c.clone() })
        .collect()
}

/// Whether the spec's engine runs stages replicated unequally (PipeDream's planner's
/// layouts).
fn runs_uneven_replicas(spec: &Spec) -> bool {
    capability::find(&spec.engine.target, |c| *c == capability::Capability::UnevenReplicas).is_some()
}

/// Holds a candidate to the spec's engine (`engine:`): the ZeRO level and sequence
/// parallelism the search chooses itself are moved to the nearest the engine runs when the
/// spec does not fix them; what else the engine does not run is the candidate's refusal.
fn held_to_engine(spec: &Spec, options: &SearchOptions, c: &mut Candidate, scratch: &mut Spec) -> Option<String> {
    if spec.engine.target.is_pipec() {
        return None;
    }
    for _ in 0..3 {
        let layout = pipec_grammar::engine_check::layout_of(
            &spec.model,
            &c.spec_in(spec, scratch).strategy,
            &spec.training,
            spec.engine.compiled,
        );
        let refused = capability::refusals(&spec.engine.target, &layout);
        let first = refused.first()?;
        let adjustable = refused.iter().find_map(|r| match (r.feature, r.nearest.as_deref()) {
            (capability::Feature::Sharding, Some(level)) if options.sharding.is_none() => {
                level.parse().ok().and_then(Sharding::of_level).map(|s| Candidate { sharding: s, ..c.clone() })
            }
            (capability::Feature::SequenceParallel, Some("true")) if c.tp > 1 => {
                Some(Candidate { sequence_parallel: true, ..c.clone() })
            }
            _ => None,
        });
        match adjustable {
            Some(next) if next != *c => *c = next,
            _ => return Some(first.message.clone()),
        }
    }
    None
}

/// The first error's message among `diagnostics` (what an invalid candidate reports).
fn first_error(diagnostics: &[Diagnostic]) -> String {
    diagnostics
        .iter()
        .find(|d| d.is_error())
        .map_or_else(|| "refused without an error message".into(), |d| d.message.clone())
}

/// `source` with its `strategy` value replaced by `strategy`.
pub fn with_strategy(source: &str, spec: &Spec, strategy: &str) -> String {
    pipec_grammar::splice(source, vec![(spec.strategy.span, strategy.to_string())])
}

/// `source` with the candidate written in: its strategy, and under `precision: auto` its
/// precision.
pub fn with_candidate(source: &str, spec: &Spec, c: &Candidate) -> String {
    pipec_grammar::splice(source, c.edits(spec))
}

/// Searches the strategies of `spec` (whose text is `source`): every candidate of the
/// space with its bound ([`candidates`]), then the branch and bound over them
/// ([`branch_and_bound`]).
pub fn search(source: &str, spec: &Spec, compile_options: &CompileOptions, options: &SearchOptions) -> SearchReport {
    let started = Instant::now();
    let mut memo = Memo::default();
    let (mut candidates, valid) = candidates(spec, compile_options, options, &mut memo);
    branch_and_bound(source, spec, compile_options, options, &mut memo, &mut candidates, valid);
    SearchReport {
        candidates,
        seconds: started.elapsed().as_secs_f64(),
        need: crate::fit::MemoryNeed::of(spec),
        batch_size: spec.training.batch_size,
        utilization: spec.utilization(),
        kernels: spec.engine.performance.clone(),
    }
}

/// Every candidate of the space the options leave: tensor-parallel degree × layout ×
/// schedule × microbatches × recompute, each checked against its schedule's layout rules
/// and bounded; returns them with the valid ones' bounds (by index).
fn candidates(
    spec: &Spec,
    compile_options: &CompileOptions,
    options: &SearchOptions,
    memo: &mut Memo,
) -> (Vec<Candidate>, Vec<(usize, f64)>) {
    let devices = spec.cluster.device_count();
    let per_node = spec.cluster.devices_per_node.max(1);
    let layers = spec.model.layers.len();
    let batch = spec.training.batch_size;
    let mut candidates = Vec::new();
    let mut valid: Vec<(usize, f64)> = Vec::new();
    let mut scratch = spec.clone();
    let tps: Vec<usize> = match options.tp {
        Some(t) => vec![t],
        None => divisors(per_node).filter(|t| *t == 1 || spec.model.is_chain()).collect(),
    };
    // recompute on every stage or none; a plan that does not fit without it is also tried
    // with only the stages of its devices short of memory recomputed (in the branch and bound)
    let recomputes: Vec<Recompute> =
        options.recompute.clone().map_or_else(|| vec![Recompute::Off, Recompute::All], |r| vec![r]);
    // the precisions: as written, or under `precision: auto` bf16 and FP8 where it runs
    let precisions: Vec<Option<Fp8Plan>> = match options.fp8 {
        Some(fp8) => vec![None, Some(fp8)],
        None => vec![spec.training.fp8],
    };
    // each expert block's experts
    let expert_counts: Vec<usize> = spec.model.layers.iter().filter_map(|l| l.op.moe()).map(|m| m.experts).collect();
    let experts = !expert_counts.is_empty();
    for (tp, cp) in
        tps.into_iter().flat_map(|tp| context_degrees(spec, options, devices / tp).into_iter().map(move |cp| (tp, cp)))
    {
        let machines = devices / (tp * cp);
        // the layouts: the user's, or every pipeline depth with equal replication, and the
        // one PipeDream's planner picks (stage boundaries and replication per stage)
        let mut layouts: Vec<Option<Vec<usize>>> = match &options.layout {
            Some(l) => vec![Some(l.clone())],
            None => divisors(machines).filter(|p| *p <= layers).map(|pp| Some(vec![machines / pp; pp])).collect(),
        };
        // (PipeDream's planner lays out replicas, not context-parallel groups)
        if options.layout.is_none() && machines > 1 && cp == 1 && runs_uneven_replicas(spec) {
            layouts.push(None);
        }
        let too_deep = |pp: usize| options.max_pipeline_depth.is_some_and(|m| pp > m);
        for layout in layouts.into_iter().filter(|l| l.as_ref().is_none_or(|l| !too_deep(l.len()))) {
            let schedules: Vec<(ScheduleKind, usize)> = match &layout {
                Some(l) => schedules_for(l.len(), options, experts)
                    .into_iter()
                    .filter(|(_, c)| l.len() * c <= layers)
                    .collect(),
                // the planner lays out one chunk per rank, for the schedules it can replicate
                None => schedules_for(2, options, experts).into_iter().filter(|(k, _)| k.auto_replicates()).collect(),
            };
            // microbatch counts dividing the batch, an equal share per replica
            let dp = layout.as_ref().map_or(1, |l| l[0]);
            let counts: Vec<usize> = match options.microbatches {
                Some(n) => vec![n],
                None => divisors(batch).filter(|n| n.is_multiple_of(dp)).collect(),
            };
            // a stage's expert groups are drawn from its data- and context-parallel members
            let members: Option<Vec<usize>> = layout.as_ref().map(|l| l.iter().map(|r| r * cp).collect());
            // how context parallelism exchanges keys and values: as written, or both
            let comms: Vec<CpComm> = match (cp, options.cp_comm) {
                (1, _) => vec![CpComm::AllGather],
                (_, Some(written)) => vec![written],
                (_, None) => vec![CpComm::AllGather, CpComm::Ring],
            };
            // context parallelism's groups run every pass together (the front end's E0422)
            let schedules = schedules
                .into_iter()
                .filter(|(k, _)| cp == 1 || k.context_parallel_obstacle(pipec_plan::vocab::SyncMode::Bsp).is_none());
            for (schedule, chunks) in schedules {
                let degrees = expert_choices(spec, options, (&expert_counts, members.as_deref()), (schedule, tp));
                for (ep, whole) in degrees {
                    let tensor_parallel = tensor_parallel_choices(spec, options, tp, whole);
                    for &microbatches in &counts {
                        // the combined 1F1B's pairs, for expert-parallel overlap
                        let pairs = layout.as_ref().is_some_and(|l| {
                            pipec_plan::schedule::Pairing::combined_1f1b_obstacle(schedule, l, chunks, microbatches)
                                .is_none()
                        });
                        let exchanges = expert_exchange_choices(spec, options, ep, pairs);
                        let choices = recomputes
                            .iter()
                            .flat_map(|r| comms.iter().map(move |c| (r, c)))
                            .flat_map(|(r, c)| precisions.iter().map(move |p| (r, c, p)))
                            .flat_map(|(r, c, p)| tensor_parallel.iter().map(move |t| (r, c, p, t)))
                            .flat_map(|(r, c, p, t)| exchanges.iter().map(move |e| (r, c, p, t, e)));
                        for (
                            recompute,
                            &cp_comm,
                            &fp8,
                            &(sequence_parallel, tp_overlap),
                            &(moe_dispatch, ep_overlap),
                        ) in choices
                        {
                            let mut c = Candidate {
                                tp,
                                replicas: layout.clone().unwrap_or_default(),
                                planner: layout.is_none(),
                                schedule,
                                chunks,
                                microbatches,
                                recompute: recompute.clone(),
                                // a written ZeRO level where a stage is replicated; the
                                // others are derived from the unsharded candidate when it is
                                // planned (their bounds are never below its)
                                sharding: match (&layout, options.sharding) {
                                    (Some(l), Some(written)) if l.iter().any(|&r| r > 1) => written,
                                    _ => Sharding::None,
                                },
                                sequence_parallel,
                                tp_overlap,
                                cp_comm,
                                ep,
                                whole_experts: whole && tp > 1,
                                moe_dispatch,
                                ep_overlap,
                                cp,
                                overlap: spec.strategy.overlap,
                                bucket: spec.strategy.bucket,
                                fp8,
                                outcome: Outcome::TooBig,
                            };
                            c.outcome = admitted(spec, (options, compile_options), memo, &mut scratch, &mut c);
                            if let Outcome::Pruned { bound_s } = c.outcome {
                                valid.push((candidates.len(), bound_s));
                            }
                            candidates.push(c);
                        }
                    }
                }
            }
        }
    }
    (candidates, valid)
}

/// What becomes of a new candidate before the branch and bound: the schedule's layout rules
/// (the front end's) and the engine's tables, then its work spread evenly (the candidate is
/// bounded, and PipeDream's planner lays it out, only when the branch and bound reaches it;
/// the text itself is checked before compiling).
fn admitted(
    spec: &Spec,
    (options, compile_options): (&SearchOptions, &CompileOptions),
    memo: &mut Memo,
    scratch: &mut Spec,
    c: &mut Candidate,
) -> Outcome {
    let broken = c.layout().and_then(|l| {
        let facts = LayoutFacts { replicas: l, microbatches: c.microbatches, vertical_sync: false };
        c.schedule.check_layout(&facts).into_iter().next()
    });
    match broken.map(|v| v.message).or_else(|| held_to_engine(spec, options, c, scratch)) {
        Some(v) => Outcome::Invalid(v),
        None => match work_bound(c.spec_in(spec, scratch), compile_options, memo) {
            Ok(b) => Outcome::Pruned { bound_s: b },
            Err(d) => Outcome::Invalid(first_error(&d)),
        },
    }
}

/// Branch and bound: compiles and simulates the candidates in order of their bound until no
/// bound can beat the best plan that fits; a candidate laid out by PipeDream's planner is
/// planned and bounded again when reached, and a plan short of memory without recompute
/// adds the candidate that recomputes only its short stages.
fn branch_and_bound(
    source: &str,
    spec: &Spec,
    compile_options: &CompileOptions,
    options: &SearchOptions,
    memo: &mut Memo,
    candidates: &mut Vec<Candidate>,
    valid: Vec<(usize, f64)>,
) {
    // branch and bound: compile in order of the bound until no bound can beat the best;
    // a candidate laid out by PipeDream's planner is planned and bounded again when reached
    let mut queue: BinaryHeap<Reverse<Queued>> =
        valid.into_iter().map(|(i, b)| Reverse(Queued { bound_s: b, index: i, known: Known::Work })).collect();
    // the best steps found so far among plans that fit with the headroom (ascending, as
    // many as are ranked)
    let ranked = options.ranked.max(1);
    let mut best: Vec<f64> = Vec::with_capacity(ranked + 1);
    let mut scratch = spec.clone();
    // the derived candidates queued so far, by their strategy's text
    let mut derived_once = HashSet::new();
    // whether the fastest plan found (best[0]) is a standard layout, and whether any is:
    // once the ranked plans are found, an unusual winner has the best standard layout found
    // beside it, so the search goes on through the standard candidates alone until one fits
    let (mut winner_standard, mut standard_found) = (true, false);
    while let Some(Reverse(Queued { bound_s, index: i, known })) = queue.pop() {
        if !options.exhaustive && best.len() == ranked && bound_s >= best[ranked - 1] {
            if winner_standard || standard_found {
                break;
            }
            if standard_family(&candidates[i]).is_none() {
                continue;
            }
        }
        let c = &mut candidates[i];
        // reached under a bound of less (its work spread evenly, or the bound of the
        // candidate it was derived from): bounded now (and laid out by PipeDream's planner),
        // and queued again under its own bound
        if known == Known::Work {
            let b = match lower_bound(c.spec_in(spec, &mut scratch), compile_options, memo) {
                Ok(b) => b,
                Err(d) => {
                    c.outcome = Outcome::Invalid(first_error(&d));
                    continue;
                }
            };
            if c.planner {
                c.replicas.clone_from(&b.replicas);
                if let Some(m) = options.max_pipeline_depth.filter(|m| c.pp() > *m) {
                    c.outcome = Outcome::Invalid(format!(
                        "PipeDream's planner chose {} stages, more than the {m} allowed",
                        c.pp()
                    ));
                    continue;
                }
            }
            let bound_s = b.step_s.max(bound_s);
            if !b.overflows {
                c.outcome = Outcome::Pruned { bound_s };
                queue.push(Reverse(Queued { bound_s, index: i, known: Known::Bound }));
                continue;
            }
            c.outcome = Outcome::TooBig;
            // what may fit instead: the ZeRO levels when the model state is what overflows,
            // and recomputing only the stages short of memory; each bounded when reached,
            // queued under this bound (never above theirs)
            let mut derived = Vec::new();
            if !b.overflows_any_sharding && shardable(c, options) {
                derived.extend(sharded_variants(c));
            }
            derived.extend(recompute_short_stages(c, &b.stage_headroom, options));
            // recompute inside the blocks keeps more than recomputing whole forwards: tried
            // where that could fit at this ZeRO level (the levels above derive their own);
            // the bound's least is read off a candidate keeping everything, whose backward's
            // transient no recompute choice lowers
            if !b.overflows_any_recompute || c.recompute != Recompute::Off {
                derived.extend(recompute_inside_blocks(spec, c, &b.stage_headroom, options));
            }
            for d in derived {
                queue_derived(candidates, &mut queue, (d, &mut derived_once), bound_s);
            }
            continue;
        }
        // its schedule's own bubble before it is lowered: queued again when that bounds it
        // above where it stood
        if known == Known::Bound {
            let timed = timeline_bound(candidates[i].spec_in(spec, &mut scratch), compile_options, memo).unwrap_or(0.0);
            if timed > bound_s {
                candidates[i].outcome = Outcome::Pruned { bound_s: timed };
                queue.push(Reverse(Queued { bound_s: timed, index: i, known: Known::Timeline }));
                continue;
            }
        }
        let text = with_candidate(source, spec, &candidates[i]);
        let checked = check_source_in(&text, compile_options.base_dir.as_deref());
        let s = match checked.spec {
            Some(s) if !checked.diagnostics.iter().any(Diagnostic::is_error) => s,
            _ => {
                candidates[i].outcome = Outcome::Invalid(first_error(&checked.diagnostics));
                continue;
            }
        };
        // the compiler's figures, from one pipeline replica when the plan is symmetric (not
        // simulated when its streams do not fit); candidates are not verified: the winner
        // is, when it is compiled for the plan
        let f = match predict_if_fits(&s, compile_options, memo) {
            Ok(f) => f,
            Err(d) => {
                candidates[i].outcome = Outcome::Invalid(first_error(&d));
                continue;
            }
        };
        let prediction = Prediction {
            bound_s,
            step_s: f.step_s,
            bubble: f.bubble,
            headroom: f.headroom,
            exposed_all_reduce_s: f.exposed_all_reduce_s,
            fits: f.fits,
        };
        let fits = f.fits;
        if fits && prediction.headroom >= options.headroom {
            let at = best.partition_point(|&t| t <= prediction.step_s);
            best.insert(at, prediction.step_s);
            best.truncate(ranked);
            let standard = standard_family(&candidates[i]).is_some();
            standard_found |= standard;
            if at == 0 {
                winner_standard = standard;
            }
        }
        candidates[i].outcome = Outcome::Planned(prediction);
        if shardable(&candidates[i], options) {
            for derived in sharded_variants(&candidates[i]) {
                queue_derived(candidates, &mut queue, (derived, &mut derived_once), bound_s);
            }
        }
        let derived: Vec<Candidate> = recompute_short_stages(&candidates[i], &f.stage_headroom, options)
            .into_iter()
            .chain(recompute_inside_blocks(spec, &candidates[i], &f.stage_headroom, options))
            .collect();
        for d in derived {
            queue_derived(candidates, &mut queue, (d, &mut derived_once), bound_s);
        }
    }
}

/// Short of memory without recompute (by its plan's figures, or by its bound when that
/// overflows): the candidate recomputing only the stages of the devices short of it (every
/// stage recomputed is its own candidate already).
fn recompute_short_stages(c: &Candidate, stage_headroom: &[f64], options: &SearchOptions) -> Option<Candidate> {
    let short: Vec<usize> = (0..stage_headroom.len()).filter(|&s| stage_headroom[s] < options.headroom).collect();
    (c.recompute == Recompute::Off
        && options.recompute.is_none()
        && !short.is_empty()
        && short.len() < stage_headroom.len())
    .then(|| Candidate { recompute: Recompute::Stages(short), ..c.clone() })
}

/// Short of memory: the candidates recomputing inside the blocks, at the granularities the
/// spec's engine runs ([`block_granularities`]), each chain walked one step at a time — a
/// candidate keeping everything derives the first of every chain, and one recomputing
/// inside the blocks that is still short derives the next of its own chain, which keeps
/// less and runs more again (a lighter choice that fits is faster than a heavier one on
/// the same layout). Recomputing every forward is a candidate of its own already.
fn recompute_inside_blocks(
    spec: &Spec,
    c: &Candidate,
    stage_headroom: &[f64],
    options: &SearchOptions,
) -> Vec<Candidate> {
    let short = stage_headroom.iter().any(|&h| h < options.headroom);
    if options.recompute.is_some() || !short {
        return Vec::new();
    }
    let blocks = spec.model.layers.iter().filter(|l| l.op.block_dims().is_some()).count();
    let chunk_blocks = blocks.div_ceil((c.pp() * c.chunks).max(1));
    let chains = block_granularities(spec, chunk_blocks);
    let next: Vec<Recompute> = match &c.recompute {
        Recompute::Off => chains.into_iter().filter_map(|chain| chain.into_iter().next()).collect(),
        Recompute::All | Recompute::Stages(_) => Vec::new(),
        now @ (Recompute::Selective | Recompute::Blocks(_)) => chains
            .into_iter()
            .find_map(|chain| chain.iter().position(|r| r == now).and_then(|i| chain.get(i + 1).cloned()))
            .into_iter()
            .collect(),
    };
    // an engine whose expert-parallel overlap refuses full recompute (Megatron-LM's) refuses
    // it of the first blocks too
    let overlap_refuses_layers = c.ep_overlap
        && capability::CONSTRAINTS.iter().any(|r| {
            r.engine == spec.engine.target.name && r.what == capability::Constraint::EpOverlapWithoutFullRecompute
        });
    next.into_iter()
        .filter(|r| !(overlap_refuses_layers && matches!(r, Recompute::Blocks(b) if b.layers > 0)))
        .map(|recompute| Candidate { recompute, ..c.clone() })
        .collect()
}

/// The recompute granularities inside the blocks that the spec's engine runs, for chunks of
/// `chunk_blocks` transformer blocks, in chains that each keep less than the one before:
/// - the attention cores alone (Korthikanti et al.'s selective recompute), where the
///   model's attention keeps its scores (a fused kernel recomputes them anyway), under an
///   engine that recomputes named modules (torchtitan writes `selective` as its op-level
///   policy, the next chain);
/// - Megatron-LM's modules: the norms, the MLP (dense blocks) or the experts' activation
///   (mixtures of experts), both, the whole mixture of experts with the norms; then
///   torchtitan's op-level policy;
/// - the first quarter, half and three quarters of each chunk's blocks whole.
///
/// Under pipec's own engine, which runs a policy as the halves of each block it touches
/// (`BlockRecompute::executor_halves`), policies that run the same halves are tried once,
/// fewer halves first; none for a model with branches, which its executor does not cut.
pub fn block_granularities(spec: &Spec, chunk_blocks: usize) -> Vec<Vec<Recompute>> {
    use capability::{BlockRecomputePart as Part, Capability, RecomputeKind};
    use pipec_plan::plan::BlockRecompute;
    use pipec_plan::vocab::RecomputeModule as M;
    let target = &spec.engine.target;
    let runs = |what: Capability| capability::find(target, |c| *c == what).is_some();
    let kinds: Vec<bool> =
        spec.model.layers.iter().filter_map(|l| l.op.block_dims()).map(|b| b.moe.is_some()).collect();
    if kinds.is_empty() {
        return Vec::new();
    }
    let (dense, experts) = (kinds.iter().any(|m| !m), kinds.iter().any(|m| *m));
    let mut chains = Vec::new();
    // (torchtitan writes `selective` as its op-level policy: tried as that policy below)
    if spec.model.attention == pipec_plan::vocab::Attention::Standard
        && runs(Capability::Recompute(RecomputeKind::Selective))
        && runs(Capability::BlockRecompute(Part::Modules))
    {
        chains.push(vec![Recompute::Selective]);
    }
    let modules = |list: Vec<M>| {
        let mut modules = list;
        modules.sort();
        BlockRecompute { modules, ..Default::default() }
    };
    let mut inside = Vec::new();
    if runs(Capability::BlockRecompute(Part::Modules)) {
        let mlp: Vec<M> =
            [(dense, M::Mlp), (experts, M::MoeAct)].into_iter().filter_map(|(on, m)| on.then_some(m)).collect();
        inside.push(modules(vec![M::Layernorm]));
        inside.push(modules(mlp.clone()));
        inside.push(modules([vec![M::Layernorm], mlp].concat()));
        if experts {
            let whole = if dense { vec![M::Layernorm, M::Mlp, M::Moe] } else { vec![M::Layernorm, M::Moe] };
            inside.push(modules(whole));
        }
    }
    if runs(Capability::BlockRecompute(Part::OpPolicy)) {
        inside.push(BlockRecompute { ops: Part::OP_POLICY.to_vec(), ..Default::default() });
    }
    let mut layers: Vec<BlockRecompute> = Vec::new();
    if runs(Capability::BlockRecompute(Part::FirstLayers)) {
        let mut counts: Vec<usize> = [1, 2, 3].iter().map(|q| (chunk_blocks * q).div_ceil(4)).collect();
        counts.dedup();
        layers.extend(
            counts
                .into_iter()
                .filter(|&n| n > 0 && n < chunk_blocks)
                .map(|layers| BlockRecompute { layers, ..Default::default() }),
        );
    }
    if target.is_pipec() {
        // pipec's executor cuts a stage into pieces along a chain of layers only
        if !spec.model.is_chain() {
            inside.clear();
            layers.clear();
        }
        let halves = |b: &BlockRecompute| {
            let h = b.executor_halves();
            usize::from(h.attention) + usize::from(h.mlp)
        };
        inside.retain(|b| halves(b) > 0);
        inside.sort_by_key(halves);
        inside.dedup_by_key(|b| b.executor_halves());
    }
    for chain in [inside, layers] {
        if !chain.is_empty() {
            chains.push(chain.into_iter().map(Recompute::Blocks).collect());
        }
    }
    chains
}

/// A candidate derived from another (a ZeRO level, recomputing the short stages or inside
/// the blocks): queued under that one's bound (never above its own), bounded when the search
/// reaches it; once only, though two candidates derive it (a ZeRO level of one recompute
/// choice, the same recompute choice of that ZeRO level), by its strategy's text.
fn queue_derived(
    candidates: &mut Vec<Candidate>,
    queue: &mut BinaryHeap<Reverse<Queued>>,
    (mut derived, once): (Candidate, &mut HashSet<String>),
    bound_s: f64,
) {
    if !once.insert(format!("{} {}", derived.strategy(), derived.precision())) {
        return;
    }
    derived.outcome = Outcome::Pruned { bound_s };
    queue.push(Reverse(Queued { bound_s, index: candidates.len(), known: Known::Work }));
    candidates.push(derived);
}

/// The standard layout family a candidate belongs to — the layouts teams run at scale:
/// data parallelism (sharded: FSDP/ZeRO), data parallelism with tensor parallelism, and the
/// pipelines Megatron-LM, torchtitan and DeepSpeed all run (1F1B, interleaved, GPipe; every
/// stage replicated alike, with tensor and expert parallelism); None for the others
/// (Chimera, the zero-bubble schedules, DualPipe, PipeDream's asynchronous ones, unequal
/// replication).
pub fn standard_family(c: &Candidate) -> Option<&'static str> {
    let even = !c.replicas.is_empty() && c.replicas.iter().all(|&r| r == c.dp());
    // one stage is data parallelism whatever the schedule is called
    let one_stage = c.pp() == 1;
    let family = match c.schedule {
        _ if one_stage && c.tp > 1 => "DP + TP",
        _ if one_stage && c.sharding == Sharding::None => "data parallelism",
        _ if one_stage => "FSDP / ZeRO data parallelism",
        // (one stage: above)
        ScheduleKind::DpOnly => "data parallelism",
        ScheduleKind::OneFOneB | ScheduleKind::Interleaved | ScheduleKind::Gpipe if c.ep > 1 => "PP + EP",
        ScheduleKind::OneFOneB | ScheduleKind::Interleaved | ScheduleKind::Gpipe => "PP (1F1B, interleaved, GPipe)",
        ScheduleKind::PipeDream
        | ScheduleKind::TwoBw
        | ScheduleKind::Chimera
        | ScheduleKind::ZbH1
        | ScheduleKind::Zbv
        | ScheduleKind::DualPipeV
        | ScheduleKind::DualPipe => return None,
    };
    even.then_some(family)
}

fn describe(c: &Candidate) -> String {
    let chunks = if c.chunks > 1 { format!(" ({} chunks)", c.chunks) } else { String::new() };
    let layout = if c.planner {
        format!("stages \"{}\" (PipeDream's planner)", notation(&c.replicas))
    } else {
        format!("pp {} × dp {}", c.pp(), c.dp())
    };
    // a single replica of a single stage is no data parallelism, whatever the schedule's name
    let schedule = if c.schedule == ScheduleKind::DpOnly && c.dp() == 1 && !c.planner {
        "one device".to_string()
    } else {
        c.schedule.name().to_string()
    };
    let zero = match c.sharding.level() {
        0 => String::new(),
        z => format!(", zero {z}"),
    };
    let zero = if c.ep > 1 {
        format!("{zero}, ep {}{}", c.ep, if c.whole_experts { " (experts whole)" } else { "" })
    } else {
        zero
    };
    let zero = if c.cp > 1 { format!("{zero}, cp {}", c.cp) } else { zero };
    let zero = if c.fp8.is_some() { format!("{zero}, FP8") } else { zero };
    format!(
        "{schedule}{chunks} · tp {} × {layout}, {} microbatches{}{zero}",
        c.tp,
        c.microbatches,
        match &c.recompute {
            Recompute::Off => String::new(),
            Recompute::All => ", recompute".into(),
            Recompute::Stages(v) => format!(", recompute stages {}", notation_list(v)),
            Recompute::Selective => ", selective recompute".into(),
            Recompute::Blocks(b) => format!(", recompute {}", b.text()),
        }
    )
}

/// Why the winner beat a runner-up, in the terms that differ.
fn why(best: (&Candidate, &Prediction), other: (&Candidate, &Prediction)) -> String {
    let ((b, bp), (o, op)) = (best, other);
    // the same predicted step: nothing lost, the order between them is arbitrary
    if (op.step_s - bp.step_s).abs() <= 1e-9 * bp.step_s {
        return "ties with the best (the same predicted step)".into();
    }
    // only what the runner-up does worse explains its loss
    let mut reasons = Vec::new();
    if op.bubble - bp.bubble >= 0.01 {
        reasons.push(format!("bubble {:.0}% vs {:.0}%", op.bubble * 100.0, bp.bubble * 100.0));
    }
    if op.exposed_all_reduce_s - bp.exposed_all_reduce_s > 0.01 * bp.step_s {
        reasons.push(format!(
            "exposed all-reduce {} vs {}",
            crate::render::human_time(op.exposed_all_reduce_s),
            crate::render::human_time(bp.exposed_all_reduce_s)
        ));
    }
    let recomputed = |c: &Candidate| match &c.recompute {
        Recompute::Off => 0,
        Recompute::Selective => 1,
        Recompute::All => usize::MAX,
        Recompute::Stages(v) => 1 + v.len(),
        // more than the attention core, less than every forward
        Recompute::Blocks(b) => 2 + b.modules.len() + b.layers,
    };
    if recomputed(o) > recomputed(b) {
        reasons.push(match &o.recompute {
            Recompute::All => "recomputes every forward".into(),
            Recompute::Selective => "recomputes every attention core".into(),
            Recompute::Blocks(b) => format!("recomputes inside the blocks ({})", b.text()),
            Recompute::Stages(_) | Recompute::Off => "recomputes more stages' forwards".to_string(),
        });
    }
    if o.fp8.is_none() && b.fp8.is_some() {
        reasons.push("bf16 (the blocks' products at half the FP8 rate)".into());
    }
    if o.fp8.is_some() && b.fp8.is_none() {
        reasons.push("FP8 (its casts and weight copies cost more than its products save)".into());
    }
    if o.tp > b.tp {
        reasons.push(format!("tp {} (tensor-parallel all-reduces inside every pass)", o.tp));
    }
    if o.ep != b.ep {
        reasons.push(match o.ep {
            1 => "no expert parallelism (every replica computes every expert on its own tokens, and sums every expert's gradient over all replicas)".to_string(),
            e => format!("ep {e} (all-to-alls inside every pass of the expert stages)"),
        });
    }
    if o.cp != b.cp {
        reasons.push(match o.cp {
            1 => "no context parallelism (each device computes whole sequences)".to_string(),
            c => format!("cp {c} (keys and values gathered inside every attention)"),
        });
    }
    if o.sharding != b.sharding {
        reasons.push(match o.sharding {
            Sharding::None => "no ZeRO sharding (each replica updates every weight)".to_string(),
            Sharding::Optimizer => "zero 1 (the weights' all-gather waits for the update)".to_string(),
            Sharding::Gradients => "zero 2 (a reduce-scatter after every microbatch)".to_string(),
            Sharding::Parameters => "zero 3 (every pass gathers its layers' weights)".to_string(),
        });
    }
    if reasons.is_empty() {
        reasons.push("slower stages: the same shape of timeline, more time per stage".into());
    }
    reasons.join("; ")
}

impl SearchReport {
    /// Why the search chose nothing, in the terms of what stopped every candidate: the
    /// options leaving none to try, every candidate refused by the rules (the most common
    /// reasons, with counts), or memory (and the headroom asked for).
    pub fn nothing_chosen(&self, options: &SearchOptions) -> String {
        if self.candidates.is_empty() {
            let asked_async: Vec<&str> = options
                .schedules
                .iter()
                .flatten()
                .filter(|k| !k.is_synchronous(pipec_plan::vocab::SyncMode::Bsp))
                .map(|k| k.name())
                .collect();
            let why = if options.synchronous_only && !asked_async.is_empty() {
                format!(
                    "{} {} asynchronous and the search considers only schedules that train like one device: allow them with `--async` (`search: {{ asynchronous: true }}` in the spec)",
                    asked_async.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", "),
                    if asked_async.len() == 1 { "is" } else { "are" }
                )
            } else {
                "the pinned fields and constraints leave no layout, schedule and microbatch count to try".to_string()
            };
            return format!("no strategy was considered: {why}");
        }
        let memory = self.count(|o| matches!(o, Outcome::TooBig | Outcome::Planned(_)));
        if memory == 0 {
            let mut reasons: Vec<(usize, &str)> = Vec::new();
            for c in &self.candidates {
                if let Outcome::Invalid(m) = &c.outcome {
                    match reasons.iter_mut().find(|(_, r)| *r == m.as_str()) {
                        Some(e) => e.0 += 1,
                        None => reasons.push((1, m)),
                    }
                }
            }
            reasons.sort_by_key(|r| std::cmp::Reverse(r.0));
            let shown: Vec<String> = reasons.iter().take(3).map(|(n, r)| format!("{n} × {r}")).collect();
            let more =
                if reasons.len() > 3 { format!("; and {} other reason(s)", reasons.len() - 3) } else { String::new() };
            return format!(
                "no valid strategy: all {} candidates break a rule — {}{more}",
                self.candidates.len(),
                shown.join("; ")
            );
        }
        let best_fitting = self
            .candidates
            .iter()
            .filter_map(|c| match &c.outcome {
                Outcome::Planned(p) if p.fits => Some(p.headroom),
                _ => None,
            })
            .fold(None, |m: Option<f64>, h| Some(m.map_or(h, |m| m.max(h))));
        match best_fitting {
            Some(h) if options.headroom > 0.0 => format!(
                "no strategy keeps {:.1}% of device memory free (the roomiest that fits keeps {:.1}%)",
                options.headroom * 100.0,
                h * 100.0
            ),
            _ => format!("no strategy fits in device memory on this cluster: {}", self.need.what_would_fit()),
        }
    }

    /// The human report: the winner as a strategy to paste, the runner-ups and why they
    /// lost, and what the search did.
    pub fn explain(&self, options: &SearchOptions, top: usize) -> String {
        let mut s = String::new();
        let ranked = self.ranked(options.headroom);
        let _ = writeln!(
            s,
            "searched {} strategies in {:.3} s: {} invalid, {} too big for memory ({} by their bound, {} by their streams' activations), {} pruned by their bound, {} compiled and simulated",
            self.candidates.len(),
            self.seconds,
            self.count(|o| matches!(o, Outcome::Invalid(_))),
            self.count(Outcome::too_big),
            self.count(|o| matches!(o, Outcome::TooBig)),
            self.count(|o| o.too_big() && matches!(o, Outcome::Planned(_))),
            self.count(|o| matches!(o, Outcome::Pruned { .. })),
            self.count(Outcome::simulated)
        );
        let Some(&(bi, bp)) = ranked.first() else {
            let _ = writeln!(s, "{}", self.nothing_chosen(options));
            return s;
        };
        let b = &self.candidates[bi];
        let _ = writeln!(
            s,
            "best: {} — step {}{}, bubble {:.1}%, memory headroom {:.1}%",
            describe(b),
            crate::render::human_time(bp.step_s),
            self.speed_text(bp.step_s),
            bp.bubble * 100.0,
            bp.headroom * 100.0
        );
        if let Some(m) = self.utilization.as_ref().and_then(|u| u.mfu(self.samples_per_s(bp.step_s))) {
            let _ = writeln!(s, "MFU: {}", m.basis_text());
        }
        if let Some(p) = &self.kernels {
            let _ = writeln!(s, "{}", p.text());
        }
        let _ = writeln!(s, "strategy: {}", b.strategy());
        if let Some(why) = &options.fp8_not_tried {
            let _ = writeln!(s, "precision: bf16 (FP8 not tried: {why})");
        } else if options.fp8.is_some() {
            let _ = writeln!(s, "precision: {}", b.precision());
        }
        if let Some(line) = self.standard_beside(&ranked) {
            let _ = writeln!(s, "{line}");
        }
        if ranked.len() > 1 {
            s.push_str("runner-ups:\n");
        }
        for &(i, p) in ranked.iter().skip(1).take(top.saturating_sub(1)) {
            let c = &self.candidates[i];
            let _ = writeln!(
                s,
                "  {} — step {} (+{:.1}%){}, bubble {:.1}%, headroom {:.1}%: {}",
                describe(c),
                crate::render::human_time(p.step_s),
                (p.step_s / bp.step_s - 1.0) * 100.0,
                self.speed_text(p.step_s),
                p.bubble * 100.0,
                p.headroom * 100.0,
                why((b, bp), (c, p))
            );
        }
        s
    }

    /// Beside a winner that is no standard layout ([`standard_family`]): the fastest
    /// standard layout that fits, with its step against the winner's, or that none does.
    /// None when the winner is a standard layout.
    fn standard_beside(&self, ranked: &[(usize, &Prediction)]) -> Option<String> {
        let bp = ranked.first()?.1;
        Some(match self.best_standard(ranked)? {
            Some((i, p, family)) => format!(
                "the winner is no standard layout; the best standard one ({family}): {} — step {} (+{:.1}%){}: {}",
                describe(&self.candidates[i]),
                crate::render::human_time(p.step_s),
                (p.step_s / bp.step_s - 1.0) * 100.0,
                self.speed_text(p.step_s),
                self.candidates[i].strategy()
            ),
            None => "the winner is no standard layout, and no standard one (FSDP or data parallelism, DP + TP, a 1F1B, interleaved or GPipe pipeline) fits with the headroom".to_string(),
        })
    }

    /// Beside a winner that is no standard layout: the fastest ranked standard layout (its
    /// index, prediction and family), or None inside when none fits. None when the winner is
    /// a standard layout (or there is none).
    fn best_standard<'p>(
        &self,
        ranked: &[(usize, &'p Prediction)],
    ) -> Option<Option<(usize, &'p Prediction, &'static str)>> {
        let &(winner, _) = ranked.first()?;
        if standard_family(&self.candidates[winner]).is_some() {
            return None;
        }
        Some(ranked.iter().find_map(|&(i, p)| standard_family(&self.candidates[i]).map(|f| (i, p, f))))
    }

    /// Samples per second at a step of `step_s`.
    fn samples_per_s(&self, step_s: f64) -> f64 {
        if step_s > 0.0 {
            self.batch_size as f64 / step_s
        } else {
            0.0
        }
    }

    /// A language model's tokens/s per device and MFU at a step of `step_s` (", 5,762
    /// tokens/s/device, MFU 33.7%"); empty for any other model.
    fn speed_text(&self, step_s: f64) -> String {
        let Some(u) = &self.utilization else { return String::new() };
        let samples_per_s = self.samples_per_s(step_s);
        let mfu = u.mfu(samples_per_s).map(|m| format!(", MFU {:.1}%", m.fraction * 100.0)).unwrap_or_default();
        format!(", {:.0} tokens/s/device{mfu}", u.tokens_per_s_per_device(samples_per_s))
    }

    /// The report as JSON for tools.
    pub fn to_json(&self, options: &SearchOptions, top: usize) -> serde_json::Value {
        let ranked = self.ranked(options.headroom);
        let entry = |i: usize, p: &Prediction| {
            let c = &self.candidates[i];
            let mut v = serde_json::json!({
                "strategy": c.strategy(), "tp": c.tp, "pp": c.pp(), "dp": c.dp(), "stages": notation(&c.replicas),
                "planner": c.planner, "schedule": c.schedule.name(), "chunks": c.chunks,
                "microbatches": c.microbatches, "recompute": recompute_json(&c.recompute), "step_time_s": p.step_s,
                "bound_s": p.bound_s, "bubble_fraction": p.bubble, "memory_headroom": p.headroom,
                "exposed_all_reduce_s": p.exposed_all_reduce_s,
                "throughput_samples_per_s": self.samples_per_s(p.step_s),
                "fp8": c.fp8.map(|f| f.recipe.to_string()),
            });
            if let Some(u) = &self.utilization {
                v["tokens_per_s_per_device"] = u.tokens_per_s_per_device(self.samples_per_s(p.step_s)).into();
                if let Some(m) = u.mfu(self.samples_per_s(p.step_s)) {
                    v["mfu"] = serde_json::to_value(m).unwrap_or_default();
                }
            }
            v
        };
        serde_json::json!({
            "best": ranked.first().map(|(i, p)| entry(*i, p)),
            "none_because": ranked.is_empty().then(|| self.nothing_chosen(options)),
            "runner_ups": ranked.iter().skip(1).take(top.saturating_sub(1)).map(|(i, p)| entry(*i, p)).collect::<Vec<_>>(),
            // beside a winner that is no standard layout: the fastest standard one that fits
            "best_standard": self.best_standard(&ranked).flatten().map(|(i, p, family)| {
                let mut e = entry(i, p);
                e["family"] = family.into();
                e
            }),
            "fp8_not_tried": options.fp8_not_tried,
            "considered": self.candidates.len(),
            "invalid": self.count(|o| matches!(o, Outcome::Invalid(_))),
            "too_big": self.count(Outcome::too_big),
            "pruned": self.count(|o| matches!(o, Outcome::Pruned { .. })),
            "simulated": self.count(Outcome::simulated),
            "seconds": self.seconds,
        })
    }
}

/// `compile` for a written strategy beside `training.precision: auto`: compiled in bf16 and,
/// where it runs, in FP8; the faster plan that keeps the headroom (W0602 absent) wins, else
/// the faster that fits, else bf16's result. A W0606 note says what was chosen against the
/// other, with a quick fix that writes the precision into the spec.
pub fn compile_precision(spec: &Spec, options: &CompileOptions) -> CompileResult {
    let Some(searched) = spec.training.precision_search else { return compile(spec, options) };
    let (fp8, not_tried) = precision_choices(spec);
    // (choice, its room, step, result)
    let mut tried: Vec<(Option<Fp8Plan>, u8, f64, CompileResult)> = std::iter::once(None)
        .chain(fp8.map(Some))
        .map(|choice| {
            let r = compile(&with_precision(spec, choice), options);
            let step = r.compiled.as_ref().map_or(f64::INFINITY, |c| c.plan.simulation.step_time_s);
            (choice, room(&r.diagnostics), step, r)
        })
        .collect();
    let chosen = (0..tried.len()).max_by(|&a, &b| tried[a].1.cmp(&tried[b].1).then(tried[b].2.total_cmp(&tried[a].2)));
    let Some(i) = chosen.filter(|&i| tried[i].1 > 0) else { return tried.swap_remove(0).3 };
    let others: Vec<String> = tried
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, (c, room, step, r))| match room {
            0 => format!("{}: {}", precision_name(*c), first_error(&r.diagnostics)),
            1 => format!(
                "{}: {} step, short of the memory headroom",
                precision_name(*c),
                crate::render::human_time(*step)
            ),
            _ => format!("{}: {} step", precision_name(*c), crate::render::human_time(*step)),
        })
        .chain(not_tried.map(|why| format!("FP8 not tried: {why}")))
        .collect();
    let (choice, _, step, mut result) = tried.swap_remove(i);
    let note = Diagnostic::warning(
        "W0606",
        format!(
            "`precision: auto` chose {} (predicted step {})",
            if choice.is_some() { "FP8 training" } else { "bf16" },
            crate::render::human_time(step)
        ),
        searched.span,
        "chosen by the precision search",
    )
    .with_help(if others.is_empty() { "the only precision tried".to_string() } else { others.join("; ") })
    .with_fix("write the chosen precision into the spec", searched.span, precision_name(choice));
    result.diagnostics.insert(0, note);
    result
}

/// `compile` for a spec whose strategy is `auto` (or has `auto` fields): searches, then
/// compiles the winner. The winner's diagnostics point at the strategy (the plan's own text
/// differs from the user's there); a W0606 note says what was chosen, with a quick fix that
/// writes it into the spec.
pub fn compile_auto(spec: &Spec, options: &CompileOptions, auto: &AutoStrategy) -> CompileResult {
    let span = spec.strategy.span;
    let Some(source) = options.source.as_deref() else {
        let d = Diagnostic::error(
            "E0607",
            "`auto` strategy fields are chosen from the spec's text, which this caller did not give",
            span,
            "searched strategy",
        )
        .with_help("compile the spec with `pipec compile` or `pipec search`");
        return CompileResult { compiled: None, diagnostics: vec![d] };
    };
    let search_options = SearchOptions::from_spec(spec, auto);
    let report = search(source, spec, options, &search_options);
    let Some(&(i, p)) = report.ranked(search_options.headroom).first() else {
        let d = Diagnostic::error("E0607", report.nothing_chosen(&search_options), span, "searched strategy")
            .with_help(report.explain(&search_options, 1).lines().next().unwrap_or_default().to_string());
        return CompileResult { compiled: None, diagnostics: vec![d] };
    };
    let chosen = &report.candidates[i];
    let text = with_candidate(source, spec, chosen);
    let Some(concrete) = check_source_in(&text, options.base_dir.as_deref()).spec else {
        let d =
            Diagnostic::error("E0607", "the chosen strategy does not check (a pipec bug)", span, "searched strategy");
        return CompileResult { compiled: None, diagnostics: vec![d] };
    };
    let inner = CompileOptions { source: None, ..options.clone() };
    let mut result = compile(&concrete, &inner);
    for d in &mut result.diagnostics {
        for l in &mut d.labels {
            l.span = span;
        }
        d.fix = None;
    }
    let note = Diagnostic::warning(
        "W0606",
        format!(
            "the search chose {} (predicted step {}, bubble {:.1}%)",
            describe(chosen),
            crate::render::human_time(p.step_s),
            p.bubble * 100.0
        ),
        span,
        "chosen by the strategy search",
    )
    .with_help(report.explain(&search_options, 3))
    .with_fix_edits(
        if spec.training.precision_search.is_some() {
            "write the chosen strategy and precision into the spec"
        } else {
            "write the chosen strategy into the spec"
        },
        chosen.edits(spec),
    );
    result.diagnostics.insert(0, note);
    result
}
