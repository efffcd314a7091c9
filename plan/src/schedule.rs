//! What each pipeline schedule is, described once: the layouts it accepts (which drive the
//! front end's E0405 diagnostics and its microbatch fixes), where its model chunks go, how
//! often it updates the weights, how many weight versions it keeps, and whether it trains
//! like one device. Every property is an exhaustive `match` on [`ScheduleKind`], so a new
//! schedule cannot compile until each is decided. The compute order itself is generated in
//! the compiler (`pipec_compiler::schedule::generate`, also an exhaustive match).

use crate::vocab::{ScheduleKind, SyncMode};
use crate::{MicrobatchId, StageId};

/// How weights are versioned and updated across the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updates {
    /// One update per step after every gradient is in (flush schedules, BSP).
    PerStep,
    /// PipeDream: update after every backward, stash the weights each forward used.
    PerMicrobatch,
    /// PipeDream-2BW: update after every `k` local backwards, two weight versions.
    Every(usize),
}

impl Updates {
    /// Local backwards per optimizer step, as the verifier counts them: None for one step
    /// after all of them; asynchronous data parallelism (`asp`) updates per microbatch.
    pub fn every(self, asp: bool) -> Option<usize> {
        match self {
            Updates::PerStep if asp => Some(1),
            Updates::PerStep => None,
            Updates::PerMicrobatch => Some(1),
            Updates::Every(k) => Some(k),
        }
    }
}

/// How many versions of a stage's weights a device may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightVersions {
    /// The current weights only (flush schedules).
    One,
    /// PipeDream-2BW's double buffer.
    Two,
    /// PipeDream's weight stashing: one per microbatch in flight (counted from the streams).
    Stashed,
}

impl WeightVersions {
    /// The most versions the memory model counts per stage (None: just the weights).
    pub fn cap(self) -> Option<u32> {
        match self {
            WeightVersions::One => None,
            WeightVersions::Two => Some(2),
            WeightVersions::Stashed => Some(u32::MAX),
        }
    }
}

/// Where the `ranks × v` model chunks of a layout go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChunkPlacement {
    /// Chunk c on rank c mod D (one chunk per rank, or Megatron's interleaving).
    RoundRobin,
    /// Zero-bubble V: chunks 0..D down the ranks, D..2D back up.
    V,
    /// Chimera: every stage on two ranks, a down and an up pipeline (pairs of replicas).
    Bidirectional,
    /// DualPipe: every stage on two ranks as Chimera's, the down pipeline taking the first
    /// half of the microbatches and the up pipeline the second.
    Halves,
}

impl ChunkPlacement {
    /// The rank that runs chunk `c` of `ranks × v` chunks.
    pub fn rank_of_chunk(self, c: usize, ranks: usize) -> usize {
        match self {
            ChunkPlacement::V if c >= ranks => (2 * ranks).saturating_sub(1 + c),
            ChunkPlacement::V | ChunkPlacement::RoundRobin | ChunkPlacement::Bidirectional | ChunkPlacement::Halves => {
                c % ranks.max(1)
            }
        }
    }

    /// Whether a stage's replicas come in pairs of copies running in opposite directions
    /// (down, up, down, up, ...: Chimera, DualPipe).
    pub fn paired(self) -> bool {
        matches!(self, ChunkPlacement::Bidirectional | ChunkPlacement::Halves)
    }

    /// Expert parallelism: the expert group of a stage's replica `replica` (indices into
    /// the stage's replicas) and its position in it, `ep` members to a group. Consecutive
    /// replicas group together; with paired copies, the same direction's copies of
    /// consecutive pipeline pairs (they run their passes at the same time).
    pub fn expert_group(self, replica: usize, ep: usize) -> (Vec<usize>, usize) {
        let ep = ep.max(1);
        let position = self.expert_position(replica, ep);
        if self.paired() {
            let (pair, direction) = (replica / 2, replica % 2);
            let first = pair - position;
            ((first..first + ep).map(|p| 2 * p + direction).collect(), position)
        } else {
            let first = replica - position;
            ((first..first + ep).collect(), position)
        }
    }

    /// Expert parallelism: `replica`'s position in its expert group (which 1/ep of the
    /// experts it holds).
    pub fn expert_position(self, replica: usize, ep: usize) -> usize {
        let unit = if self.paired() { replica / 2 } else { replica };
        unit % ep.max(1)
    }

    /// Expert parallelism: the replicas (indices) holding the same experts as `replica`
    /// among a stage's `n`: those at its position in every expert group.
    pub fn same_experts(self, replica: usize, n: usize, ep: usize) -> Vec<usize> {
        let position = self.expert_position(replica, ep);
        (0..n).filter(|&i| self.expert_position(i, ep) == position).collect()
    }
}

/// The facts about a layout that a schedule's constraints read.
#[derive(Debug, Clone, Copy)]
pub struct LayoutFacts<'a> {
    /// Replicas of each pipeline stage (PipeDream notation).
    pub replicas: &'a [usize],
    pub microbatches: usize,
    /// PipeDream's vertical sync was asked for.
    pub vertical_sync: bool,
}

/// A layout the schedule cannot run, as the front end reports it (E0405).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub message: String,
    /// The label under the schedule's span.
    pub label: String,
    pub help: String,
    /// Whether another microbatch count would satisfy it (the front end then offers the
    /// nearest count that satisfies every constraint as a fix).
    pub about_microbatches: bool,
}

fn violation(message: impl Into<String>, label: &str, help: impl Into<String>, about_microbatches: bool) -> Violation {
    Violation { message: message.into(), label: label.into(), help: help.into(), about_microbatches }
}

/// When a schedule trains exactly like one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synchrony {
    Always,
    Never,
    /// Only with bulk-synchronous data parallelism (`sync: bsp`).
    WhenBsp,
}

/// How often a schedule updates the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cadence {
    PerStep,
    PerMicrobatch,
    /// Every `ranks` local backwards (PipeDream-2BW).
    EveryRanks,
}

/// The static description of a schedule: one row per schedule in [`ScheduleKind::traits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Traits {
    /// Model chunks per device when the spec does not say.
    pub default_virtual_stages: usize,
    /// Whether the backward is split into input- and weight-gradient passes (zero bubble).
    pub splits_backward: bool,
    pub synchrony: Synchrony,
    pub cadence: Cadence,
    pub weight_versions: WeightVersions,
    pub chunk_placement: ChunkPlacement,
    /// Whether `partition: auto` may choose the replication per stage (PipeDream's planner:
    /// one chunk per rank, stages replicated independently).
    pub auto_replicates: bool,
    /// Whether every stage must be replicated equally.
    pub even_replication: bool,
    /// A pipeline (a bubble warning makes sense), not data parallelism alone.
    pub pipeline: bool,
    /// DualPipe's overlapped pairs ([`overlapped_pair`]): a forward of one of a device's
    /// stages right before a whole backward of another runs with it as one unit, once both
    /// their inputs are in, each pass's all-to-alls hidden under the other's computation.
    pub overlaps_pairs: bool,
}

impl ScheduleKind {
    /// What the schedule is, in one row.
    pub fn traits(self) -> Traits {
        use ChunkPlacement::{Bidirectional, Halves, RoundRobin, V};
        use WeightVersions::{One, Stashed, Two};
        let row = |v, split, synchrony, cadence, weights, chunks, auto, even, pipeline| Traits {
            default_virtual_stages: v,
            splits_backward: split,
            synchrony,
            cadence,
            weight_versions: weights,
            chunk_placement: chunks,
            auto_replicates: auto,
            even_replication: even,
            pipeline,
            overlaps_pairs: false,
        };
        let paired = |t: Traits| Traits { overlaps_pairs: true, ..t };
        let (always, step) = (Synchrony::Always, Cadence::PerStep);
        // row(default virtual stages, splits backward, synchrony, cadence, weight versions,
        //     chunk placement, auto replicates, even replication, pipeline)
        match self {
            ScheduleKind::Gpipe => row(1, false, always, step, One, RoundRobin, true, false, true),
            ScheduleKind::OneFOneB => row(1, false, always, step, One, RoundRobin, true, false, true),
            ScheduleKind::Interleaved => row(2, false, always, step, One, RoundRobin, false, true, true),
            ScheduleKind::PipeDream => {
                row(1, false, Synchrony::Never, Cadence::PerMicrobatch, Stashed, RoundRobin, true, false, true)
            }
            ScheduleKind::TwoBw => {
                row(1, false, Synchrony::Never, Cadence::EveryRanks, Two, RoundRobin, true, false, true)
            }
            ScheduleKind::Chimera => row(1, false, always, step, One, Bidirectional, false, true, true),
            ScheduleKind::ZbH1 => row(1, true, always, step, One, RoundRobin, true, false, true),
            ScheduleKind::Zbv => row(2, true, always, step, One, V, false, true, true),
            ScheduleKind::DualPipeV => paired(row(2, true, always, step, One, V, false, true, true)),
            ScheduleKind::DualPipe => paired(row(1, true, always, step, One, Halves, false, true, true)),
            ScheduleKind::DpOnly => row(1, false, Synchrony::WhenBsp, step, One, RoundRobin, false, false, false),
        }
    }

    /// Model chunks per device when the spec does not say.
    pub fn default_virtual_stages(self) -> usize {
        self.traits().default_virtual_stages
    }

    /// Whether the backward is split into input- and weight-gradient passes (zero bubble).
    pub fn splits_backward(self) -> bool {
        self.traits().splits_backward
    }

    /// Whether the schedule runs DualPipe's overlapped forward–backward pairs
    /// ([`overlapped_pair`]).
    pub fn overlaps_pairs(self) -> bool {
        self.traits().overlaps_pairs
    }

    /// Whether the schedule has the 1F1B phase Megatron-LM's combined 1F1B runs as pairs
    /// under `ep_overlap` (`schedules.py`: no pipelining, or the interleaved schedule; the
    /// plain pipelined 1F1B here too, as the same warm-up plus one): its order then runs one
    /// more forward before the first backward.
    pub fn combines_1f1b(self) -> bool {
        match self {
            ScheduleKind::OneFOneB | ScheduleKind::DpOnly | ScheduleKind::Interleaved => true,
            ScheduleKind::Gpipe
            | ScheduleKind::PipeDream
            | ScheduleKind::TwoBw
            | ScheduleKind::Chimera
            | ScheduleKind::ZbH1
            | ScheduleKind::Zbv
            | ScheduleKind::DualPipeV
            | ScheduleKind::DualPipe => false,
        }
    }

    /// Whether the schedule computes exactly what one device would (no stale weights).
    pub fn is_synchronous(self, sync: SyncMode) -> bool {
        match self.traits().synchrony {
            Synchrony::Always => true,
            Synchrony::Never => false,
            Synchrony::WhenBsp => sync == SyncMode::Bsp,
        }
    }

    /// Why context-parallel groups cannot run under this schedule (None: they can): their
    /// members exchange keys and values inside every pass, so they must run their passes
    /// together and update once per step, with one copy of each stage per pipeline.
    pub fn context_parallel_obstacle(self, sync: SyncMode) -> Option<&'static str> {
        if sync == SyncMode::Asp || !self.updates_per_step() || !self.is_synchronous(sync) {
            Some("runs a group's members' passes at different times, and they exchange keys and values inside every attention")
        } else if self.chunk_placement() != ChunkPlacement::RoundRobin {
            Some("places two copies of a stage per pipeline, which context-parallel groups do not span yet")
        } else {
            None
        }
    }

    /// Whether every stage updates once per step (whatever the pipeline's depth): what the
    /// rules that need a whole step's microbatches before an update ask (global gradient
    /// clipping, PyTorch's per-forward batch-norm statistics).
    pub fn updates_per_step(self) -> bool {
        matches!(self.traits().cadence, Cadence::PerStep)
    }

    /// The update cadence over `ranks` pipeline ranks.
    pub fn updates(self, ranks: usize) -> Updates {
        match self.traits().cadence {
            Cadence::PerStep => Updates::PerStep,
            Cadence::PerMicrobatch => Updates::PerMicrobatch,
            Cadence::EveryRanks => Updates::Every(ranks.max(1)),
        }
    }

    /// How many weight versions a stage keeps.
    pub fn weight_versions(self) -> WeightVersions {
        self.traits().weight_versions
    }

    /// Where the model chunks go.
    pub fn chunk_placement(self) -> ChunkPlacement {
        self.traits().chunk_placement
    }

    /// Whether `partition: auto` may choose the replication per stage.
    pub fn auto_replicates(self) -> bool {
        self.traits().auto_replicates
    }

    /// Whether a bubble warning makes sense (a pipeline, not data parallelism alone).
    pub fn is_pipeline(self) -> bool {
        self.traits().pipeline
    }

    /// Every constraint the layout breaks, in the order the front end reports them (it
    /// reports the first). A microbatch count is acceptable to the schedule when none of
    /// the violations is `about_microbatches`.
    pub fn check_layout(self, facts: &LayoutFacts<'_>) -> Vec<Violation> {
        let stages = facts.replicas.len();
        let microbatches = facts.microbatches;
        let first_replicas = facts.replicas.first().copied().unwrap_or(1).max(1);
        let uneven = facts.replicas.iter().any(|&r| r != first_replicas);
        let mut out = Vec::new();
        match self {
            ScheduleKind::Interleaved => {
                if stages < 2 {
                    out.push(violation(
                        "`interleaved` needs at least 2 pipeline stages",
                        "with one stage",
                        "use `1f1b` or `dp-only` for a single stage, or more stages",
                        false,
                    ));
                } else {
                    // each pipeline replica runs its share of the microbatches in groups of
                    // one per stage: every share must divide by the stages
                    let gcd = |mut a: usize, mut b: usize| {
                        while b != 0 {
                            (a, b) = (b, a % b);
                        }
                        a
                    };
                    let lcm = facts.replicas.iter().fold(1usize, |l, &r| {
                        let r = r.max(1);
                        (l / gcd(l, r)).saturating_mul(r)
                    });
                    let need = stages.saturating_mul(lcm);
                    if !microbatches.is_multiple_of(need) {
                        let what = if lcm > 1 {
                            format!("a multiple of {need} ({stages} stages × {lcm} replicas: each replica's share divisible by the stages)")
                        } else {
                            format!("divisible by the {stages} stages")
                        };
                        out.push(violation(
                            format!("`interleaved` needs microbatches {what}, found {microbatches}"),
                            "interleaved",
                            "Megatron's interleaved schedule runs each pipeline's microbatches in groups of one per stage",
                            true,
                        ));
                    }
                }
            }
            ScheduleKind::Chimera => {
                if !stages.is_multiple_of(2) || stages < 2 {
                    out.push(violation(
                        format!("`chimera` needs an even number of stages, found {stages}"),
                        "chimera",
                        "Chimera pairs a down and an up pipeline: use 2, 4, 6, ... stages",
                        false,
                    ));
                }
                if !microbatches.is_multiple_of(2) {
                    out.push(violation(
                        format!("`chimera` needs an even number of microbatches, found {microbatches}"),
                        "chimera",
                        "half of the microbatches go down, half go up",
                        true,
                    ));
                } else if first_replicas > 1
                    && microbatches.is_multiple_of(first_replicas)
                    && !microbatches.is_multiple_of(2 * first_replicas)
                {
                    let r = first_replicas;
                    out.push(violation(
                        format!(
                            "`chimera` with stages replicated {r} times needs microbatches divisible by {}, found {microbatches}",
                            2 * r
                        ),
                        "chimera",
                        format!("the microbatches are dealt to {r} pipeline pairs, each sending half of its share down and half up: use a multiple of {}", 2 * r),
                        true,
                    ));
                }
            }
            ScheduleKind::DpOnly => {
                if stages != 1 {
                    out.push(violation(
                        format!("`dp-only` runs the whole model as one stage, but the layout has {stages} stages"),
                        "dp-only",
                        "write `stages: \"N\"` (one stage on N workers) or choose a pipeline schedule",
                        false,
                    ));
                }
            }
            ScheduleKind::Zbv => {
                if stages < 2 {
                    out.push(violation(
                        "`zbv` needs at least 2 pipeline stages",
                        "zbv",
                        "use `zb-h1` or `1f1b`",
                        false,
                    ));
                }
            }
            ScheduleKind::DualPipeV => {
                if stages < 2 {
                    out.push(violation(
                        "`dualpipev` needs at least 2 pipeline stages",
                        "dualpipev",
                        "use `zb-h1` or `1f1b`",
                        false,
                    ));
                }
                let per_replica = microbatches / first_replicas;
                if per_replica < 2 * stages {
                    out.push(violation(
                        format!(
                            "`dualpipev` needs at least {} microbatches per pipeline (2 × {stages} devices), found {per_replica}",
                            2 * stages
                        ),
                        "dualpipev",
                        "DualPipeV fills both chunks of every device before its steady state: use more microbatches",
                        true,
                    ));
                }
            }
            ScheduleKind::DualPipe => {
                if !stages.is_multiple_of(2) || stages < 2 {
                    out.push(violation(
                        format!("`dualpipe` needs an even number of stages, found {stages}"),
                        "dualpipe",
                        "DualPipe runs two pipelines in opposite directions, each half the stages in each half of the devices: use 2, 4, 6, ... stages",
                        false,
                    ));
                }
                // R pipeline pairs side by side (`dp: R`): each pair's share of the microbatches
                // even (half down, half up) and at least 2D
                let r = first_replicas;
                if !microbatches.is_multiple_of(2 * r) || microbatches / r < 2 * stages {
                    let per = if r > 1 { format!(" per pipeline pair ({r} pairs)") } else { String::new() };
                    out.push(violation(
                        format!(
                            "`dualpipe` needs an even number of microbatches{per}, at least {} (2 × {stages} devices), found {}",
                            2 * stages,
                            microbatches / r
                        ),
                        "dualpipe",
                        format!("half of each pair's microbatches go down and half up, and each direction fills its pipeline before its steady state: use a multiple of {} of at least {}", 2 * r, 2 * stages * r),
                        true,
                    ));
                }
            }
            ScheduleKind::PipeDream => {
                if facts.vertical_sync && facts.replicas.iter().any(|&r| r != 1) {
                    out.push(violation(
                        "vertical sync needs unreplicated stages",
                        "vertical_sync",
                        "replicated stages update at different rates, so their weight versions do not line up; use `straight` or drop `vertical_sync`",
                        false,
                    ));
                }
            }
            ScheduleKind::Gpipe | ScheduleKind::OneFOneB | ScheduleKind::TwoBw | ScheduleKind::ZbH1 => {}
        }
        let needs_even_replication = self.traits().even_replication;
        if needs_even_replication && uneven {
            out.push(violation(
                format!("`{}` needs every stage replicated equally", self),
                "uneven replication",
                "use `dp`/`pp` degrees or notation like `2-2-2-2`",
                false,
            ));
        }
        out
    }

    /// Whether `microbatches` suits this schedule on `replicas` (every replica count
    /// divides it, and no constraint of the schedule on microbatches is broken).
    pub fn accepts_microbatches(self, replicas: &[usize], microbatches: usize, vertical_sync: bool) -> bool {
        replicas.iter().all(|&r| microbatches.is_multiple_of(r.max(1)))
            && !self
                .check_layout(&LayoutFacts { replicas, microbatches, vertical_sync })
                .iter()
                .any(|v| v.about_microbatches)
    }
}

/// Which forward and whole backward next to each other in a device's stream run as one
/// overlapped pair, each pass's expert-parallel all-to-alls under the other's computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pairing {
    /// DualPipe's and DualPipeV's: a forward of one of the device's stages and a backward of
    /// another ([`ScheduleKind::overlaps_pairs`]).
    OtherStage,
    /// Megatron-LM's combined 1F1B (`ep_overlap`, `--overlap-moe-expert-parallel-comm`):
    /// a forward and the backward of any other microbatch or stage, the 1F1B phase's
    /// forward of one microbatch with the backward of an earlier one.
    OtherTask,
}

impl Pairing {
    /// The pairing a plan runs: DualPipe's by its schedule, else Megatron-LM's combined 1F1B
    /// where `ep_overlap` is on (the front end allows it only on schedules that
    /// [combine 1F1B](ScheduleKind::combines_1f1b)), else none.
    pub fn of(kind: ScheduleKind, ep_overlap: bool) -> Option<Pairing> {
        if kind.overlaps_pairs() {
            Some(Pairing::OtherStage)
        } else if ep_overlap && kind.combines_1f1b() {
            Some(Pairing::OtherTask)
        } else {
            None
        }
    }

    /// Why Megatron-LM's combined 1F1B (`ep_overlap`) cannot run on `kind` whatever the
    /// layout: a schedule without the 1F1B phase; None where it can on some layout.
    pub fn combined_1f1b_schedule_obstacle(kind: ScheduleKind) -> Option<String> {
        let why = if kind.overlaps_pairs() { " (it overlaps its own pairs)" } else { "" };
        (!kind.combines_1f1b())
            .then(|| format!("`{kind}` has no 1F1B phase to run as Megatron-LM's combined 1F1B{why}"))
    }

    /// Why Megatron-LM's combined 1F1B (`ep_overlap`) cannot run on `kind` over a pipeline
    /// of `replicas` per rank (as written), `chunks` model chunks per rank and `microbatches`
    /// in all; None where it can. As Megatron-LM runs it (`schedules.py`,
    /// `transformer_config.py`): without a pipeline, or on the interleaved schedule with a
    /// 1F1B phase on every rank — the first rank's warm-up ((ranks − 1)·2 + (chunks − 1)·
    /// group + 1 forwards) shorter than its passes — where each forward of the phase and
    /// the backward after it form a pair; a warm-up that takes every forward leaves only its
    /// last forward next to the first backward, a pair whose gradient waits on the forward's
    /// own output downstream.
    pub fn combined_1f1b_obstacle(
        kind: ScheduleKind,
        replicas: &[usize],
        chunks: usize,
        microbatches: usize,
    ) -> Option<String> {
        if let Some(why) = Pairing::combined_1f1b_schedule_obstacle(kind) {
            return Some(why);
        }
        let ranks = replicas.len();
        let per_replica = microbatches / replicas.first().copied().unwrap_or(1).max(1);
        let chunks = chunks.max(1);
        match kind {
            ScheduleKind::Interleaved => {
                let group = ranks.min(per_replica).max(1);
                let warmup = (ranks.saturating_sub(1)) * 2 + (chunks.saturating_sub(1)) * group + 1;
                let passes = per_replica * chunks;
                (ranks > 1 && warmup >= passes).then(|| {
                    format!(
                        "the first rank's warm-up ({warmup} forwards) takes all {passes} of its forwards: no 1F1B phase is left to pair; give each pipeline replica more microbatches"
                    )
                })
            }
            _ if ranks > 1 => Some(
                "beside a pipeline Megatron-LM runs its combined 1F1B only on the interleaved schedule".to_string(),
            ),
            _ => None,
        }
    }

    /// Whether a forward of `forward` (stage, microbatch) and a whole backward of
    /// `backward` may run as a pair.
    pub fn pairs(self, forward: (StageId, MicrobatchId), backward: (StageId, MicrobatchId)) -> bool {
        match self {
            Pairing::OtherStage => forward.0 != backward.0,
            Pairing::OtherTask => forward != backward,
        }
    }
}

/// The overlapped pair ([`Pairing`]) that the forward at `forward_at` of `stream` opens: the
/// position of the whole backward that `pairing` pairs with it and that is the next pass the
/// device runs (only transfers, loads, frees, the forward's all-to-alls and the like between
/// them), or None. The two run as one unit: the backward's gradient is received before the
/// forward starts (`pipec_compiler`'s lowering puts its receive there), and the pair takes
/// the longer of their computations together and their all-to-alls together, as
/// DeepSeek-V3's overlap of one chunk's computation with the other's communication does.
pub fn overlapped_pair(stream: &[crate::Instr], forward_at: usize, pairing: Pairing) -> Option<usize> {
    use crate::{Instr, Phase};
    let Instr::Forward { stage, mb } = stream.get(forward_at)? else { return None };
    let (j, next) = stream.iter().enumerate().skip(forward_at + 1).find(|(_, i)| {
        matches!(
            i.phase(),
            Phase::Forward
                | Phase::Backward
                | Phase::BackwardInput
                | Phase::BackwardWeight
                | Phase::Recompute
                | Phase::Optimizer
                | Phase::Collective
        )
    })?;
    matches!(next, Instr::Backward { stage: b, mb: bm } if pairing.pairs((*stage, *mb), (*b, *bm))).then_some(j)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_placement_goes_down_and_back_up() {
        let ranks: Vec<usize> = (0..8).map(|c| ChunkPlacement::V.rank_of_chunk(c, 4)).collect();
        assert_eq!(ranks, [0, 1, 2, 3, 3, 2, 1, 0]);
        let ranks: Vec<usize> = (0..8).map(|c| ChunkPlacement::RoundRobin.rank_of_chunk(c, 4)).collect();
        assert_eq!(ranks, [0, 1, 2, 3, 0, 1, 2, 3]);
    }

    #[test]
    fn microbatch_constraints_match_their_closed_forms() {
        for n in 1..=48 {
            assert_eq!(ScheduleKind::Interleaved.accepts_microbatches(&[1, 1, 1, 1], n, false), n % 4 == 0, "{n}");
            // with 4 replicas of 2 stages, each replica's share must divide by 2
            assert_eq!(ScheduleKind::Interleaved.accepts_microbatches(&[4, 4], n, false), n % 8 == 0, "{n}");
            assert_eq!(ScheduleKind::Chimera.accepts_microbatches(&[1, 1], n, false), n % 2 == 0, "{n}");
            assert_eq!(ScheduleKind::Chimera.accepts_microbatches(&[3, 3], n, false), n % 6 == 0, "{n}");
            assert_eq!(ScheduleKind::OneFOneB.accepts_microbatches(&[2, 1, 1], n, false), n % 2 == 0, "{n}");
        }
    }

    #[test]
    fn layout_violations_in_report_order() {
        let facts = LayoutFacts { replicas: &[1, 1, 1], microbatches: 3, vertical_sync: false };
        let v = ScheduleKind::Chimera.check_layout(&facts);
        assert_eq!(v.len(), 2);
        assert!(v[0].message.contains("even number of stages") && !v[0].about_microbatches);
        assert!(v[1].message.contains("even number of microbatches") && v[1].about_microbatches);
        assert!(ScheduleKind::OneFOneB.check_layout(&facts).is_empty());
        let uneven = LayoutFacts { replicas: &[2, 1], microbatches: 4, vertical_sync: true };
        assert_eq!(ScheduleKind::Zbv.check_layout(&uneven)[0].label, "uneven replication");
        assert_eq!(ScheduleKind::PipeDream.check_layout(&uneven)[0].label, "vertical_sync");
    }

    #[test]
    fn a_pair_is_a_forward_then_a_whole_backward_of_another_stage_with_no_pass_between() {
        use crate::{DeviceId, Instr, MicrobatchId, StageId};
        let (s, m) = (StageId, MicrobatchId);
        let fwd = Instr::Forward { stage: s(0), mb: m(2) };
        let send = Instr::SendActivation { peer: DeviceId(1), stage: s(0), mb: m(2), bytes: 8 };
        let bwd = |stage| Instr::Backward { stage: s(stage), mb: m(0) };
        let other = Pairing::OtherStage;
        assert_eq!(overlapped_pair(&[fwd.clone(), send.clone(), bwd(1)], 0, other), Some(2));
        // the same stage's backward, a split backward, a recompute or a collective between
        assert_eq!(overlapped_pair(&[fwd.clone(), bwd(0)], 0, other), None);
        assert_eq!(overlapped_pair(&[fwd.clone(), Instr::BackwardInput { stage: s(1), mb: m(0) }], 0, other), None);
        assert_eq!(overlapped_pair(&[fwd.clone(), Instr::Recompute { stage: s(1), mb: m(0) }, bwd(1)], 0, other), None);
        // Megatron-LM's combined 1F1B pairs the same stage's backward of another microbatch,
        // never the forward's own backward
        assert_eq!(overlapped_pair(&[fwd.clone(), bwd(0)], 0, Pairing::OtherTask), Some(1));
        let own = Instr::Backward { stage: s(0), mb: m(2) };
        assert_eq!(overlapped_pair(&[fwd.clone(), own], 0, Pairing::OtherTask), None);
        let wait = Instr::WaitCollective {
            payload: crate::CollectivePayload::Gradients,
            stage: s(1),
            group: crate::GroupId(0),
        };
        assert_eq!(overlapped_pair(&[fwd.clone(), wait, bwd(1)], 0, other), None);
        // only a forward opens one
        assert_eq!(overlapped_pair(&[send, bwd(1)], 0, other), None);
        assert_eq!(overlapped_pair(&[fwd], 0, other), None);
    }
}
