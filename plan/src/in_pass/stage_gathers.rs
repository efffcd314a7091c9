//! ZeRO-3's gathers of a stage's whole weights — those its products do not gather
//! themselves ([`super::zero3_gather`]), the stage being FSDP's unit — declared per device:
//! at which instruction of its step each gather starts, and of which stage.
//!
//! The rule ([`stage_gathers`]) is what the executor does, and the executor does what the
//! plan declares: a step starts with every sharded stage's whole weights dropped; a pass
//! that needs them (a forward, recompute, backward or input-gradient pass) finds them
//! gathered, or prefetched by the pass before, or gathers them itself; they are dropped
//! again once nothing kept for a backward holds them — after a forward that keeps only its
//! input (a recomputed stage but the last), after the free of a microbatch when no
//! other kept graph or pending weight gradient of the stage remains — and at the update.
//! While a pass computes, the whole weights of the stage the device's next weight-reading
//! pass needs are gathered ahead (FSDP's prefetch) when that is another stage sharded here,
//! not gathered nor already being gathered, and nothing between the two passes changes it
//! (no pass, update or collective of that stage; its sends, receives and frees may come
//! between).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::instr::{Instr, MicrobatchId, Phase, StageId};

/// One gather of a stage's whole weights: it starts at instruction `at` of the device's
/// step stream, a pass that needs `stage`'s weights (its own gather) or the pass before
/// one that does (a prefetch). Written in plan files as `[at, stage]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StageGather {
    pub at: u32,
    pub stage: StageId,
}

impl Serialize for StageGather {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (self.at, self.stage).serialize(s)
    }
}

impl<'de> Deserialize<'de> for StageGather {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (at, stage) = <(u32, StageId)>::deserialize(d)?;
        Ok(StageGather { at, stage })
    }
}

/// Whether a pass reads its stage's whole weights (a weight pass reads the gradients its
/// input-gradient pass left).
pub fn reads_weights(ins: &Instr) -> bool {
    match ins.phase() {
        Phase::Forward | Phase::Recompute | Phase::Backward | Phase::BackwardInput => true,
        Phase::BackwardWeight | Phase::Communication | Phase::Collective | Phase::Optimizer | Phase::Memory => false,
    }
}

/// The first pass after position `at` of `stream` that reads its stage's whole weights:
/// the pass a gather ahead started at `at` is for.
pub fn next_reader(stream: &[Instr], at: usize) -> Option<usize> {
    (at + 1..stream.len()).find(|&j| reads_weights(&stream[j]))
}

/// The stages a device's `stream` runs that are `sharded` at ZeRO-3, each with whether its
/// forward keeps only its input: a `recompute`d stage but the model's `last`, whose
/// forward keeps its loss — what [`stage_gathers`] reads.
pub fn zero3_stages(
    stream: &[Instr],
    sharded: impl Fn(StageId) -> bool,
    recompute: impl Fn(StageId) -> bool,
    last: StageId,
) -> BTreeMap<StageId, bool> {
    stream.iter().map(Instr::stage).filter(|s| sharded(*s)).map(|s| (s, recompute(s) && s != last)).collect()
}

/// What a device keeps of a sharded stage between its passes.
#[derive(Default)]
struct Held {
    gathered: bool,
    /// Per microbatch kept for a backward: whether its autodiff graph (and with it the
    /// weights) is kept, rather than only its input.
    kept: BTreeMap<MicrobatchId, bool>,
    /// Microbatches whose input-gradient pass ran and whose weight pass has not.
    pending: BTreeSet<MicrobatchId>,
}

impl Held {
    /// Drops the whole weights unless something kept for a backward holds them.
    fn release_unpinned(&mut self) {
        if !self.kept.values().any(|graph| *graph) && self.pending.is_empty() {
            self.gathered = false;
        }
    }
}

/// The gathers of stages' whole weights in a device's step `stream`, in issue order;
/// `zero3`: the stages the device holds sharded at ZeRO stage 3, each with whether its
/// forward keeps only its input ([`zero3_stages`]).
pub fn stage_gathers(stream: &[Instr], zero3: &BTreeMap<StageId, bool>) -> Vec<StageGather> {
    let mut held: BTreeMap<StageId, Held> = zero3.keys().map(|s| (*s, Held::default())).collect();
    let mut ahead: BTreeSet<StageId> = BTreeSet::new();
    let mut out = Vec::new();
    for (at, ins) in stream.iter().enumerate() {
        let stage = ins.stage();
        if reads_weights(ins) {
            if let Some(h) = held.get_mut(&stage) {
                if !h.gathered && !ahead.remove(&stage) {
                    out.push(StageGather { at: at as u32, stage });
                }
                h.gathered = true;
            }
            if let Some(next) = prefetch(stream, at, &held, &ahead) {
                out.push(StageGather { at: at as u32, stage: next });
                ahead.insert(next);
            }
        }
        let Some(h) = held.get_mut(&stage) else { continue };
        let mb = ins.microbatch();
        match ins.phase() {
            Phase::Forward => {
                h.kept.extend(mb.map(|m| (m, !zero3[&stage])));
                h.release_unpinned();
            }
            Phase::Recompute => h.kept.extend(mb.map(|m| (m, true))),
            Phase::BackwardInput => h.pending.extend(mb),
            Phase::BackwardWeight => {
                if let Some(m) = mb {
                    h.pending.remove(&m);
                }
            }
            Phase::Memory if matches!(ins, Instr::Free { .. }) => {
                if let Some(m) = mb {
                    h.kept.remove(&m);
                }
                h.release_unpinned();
            }
            Phase::Optimizer if matches!(ins, Instr::ShardStep { .. }) => h.gathered = false,
            Phase::Backward | Phase::Communication | Phase::Collective | Phase::Memory | Phase::Optimizer => {}
        }
    }
    out
}

/// The stage whose whole weights the pass at `at` gathers ahead: the stage of the device's
/// next weight-reading pass, when it is another sharded stage whose weights are not here
/// nor on their way, and nothing between the two changes it.
fn prefetch(stream: &[Instr], at: usize, held: &BTreeMap<StageId, Held>, ahead: &BTreeSet<StageId>) -> Option<StageId> {
    let current = stream[at].stage();
    let j = next_reader(stream, at)?;
    let next = stream[j].stage();
    let h = held.get(&next)?;
    if next == current || h.gathered || ahead.contains(&next) {
        return None;
    }
    let quiet = stream[at + 1..j].iter().all(|i| {
        i.stage() != next
            || match i.phase() {
                Phase::Communication | Phase::BackwardWeight => true,
                Phase::Memory => !matches!(i, Instr::StashWeights { .. } | Instr::RestoreWeights { .. }),
                Phase::Forward
                | Phase::Backward
                | Phase::BackwardInput
                | Phase::Recompute
                | Phase::Collective
                | Phase::Optimizer => false,
            }
    });
    quiet.then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StageId = StageId(0);
    const S1: StageId = StageId(1);

    fn f(stage: StageId, m: u32) -> Instr {
        Instr::Forward { stage, mb: MicrobatchId(m) }
    }
    fn r(stage: StageId, m: u32) -> Instr {
        Instr::Recompute { stage, mb: MicrobatchId(m) }
    }
    fn b(stage: StageId, m: u32) -> Instr {
        Instr::Backward { stage, mb: MicrobatchId(m) }
    }
    fn free(stage: StageId, m: u32) -> Instr {
        Instr::Free { stage, mb: MicrobatchId(m) }
    }
    fn at(list: &[StageGather]) -> Vec<(u32, u32)> {
        list.iter().map(|g| (g.at, g.stage.0)).collect()
    }

    /// A recomputed stage keeps only its inputs: its weights go after every forward and
    /// after every free, so each forward and each recompute gathers (2 per microbatch); a
    /// stage whose forwards keep their graphs gathers once, at its first pass.
    #[test]
    fn a_recomputed_stage_gathers_for_every_pass_and_one_keeping_graphs_once() {
        let stream = [
            f(S0, 0),
            f(S0, 1),
            r(S0, 1),
            b(S0, 1),
            free(S0, 1),
            r(S0, 0),
            b(S0, 0),
            free(S0, 0),
            Instr::ShardStep { stage: S0 },
        ];
        let recomputed = stage_gathers(&stream, &BTreeMap::from([(S0, true)]));
        assert_eq!(at(&recomputed), [(0, 0), (1, 0), (2, 0), (5, 0)]);
        let keeping = [f(S0, 0), f(S0, 1), b(S0, 1), free(S0, 1), b(S0, 0), free(S0, 0)];
        assert_eq!(at(&stage_gathers(&keeping, &BTreeMap::from([(S0, false)]))), [(0, 0)]);
        // a stage not sharded at ZeRO-3 gathers nothing
        assert!(stage_gathers(&stream, &BTreeMap::new()).is_empty());
    }

    /// Two chunks on one device: the pass of one gathers the other's weights ahead when the
    /// next weight-reading pass needs them and nothing of that chunk runs in between, and the
    /// pass that needs them does not gather them again.
    #[test]
    fn the_next_chunks_weights_are_gathered_ahead_during_a_pass() {
        let send = Instr::SendActivation { peer: crate::instr::DeviceId(1), stage: S0, mb: MicrobatchId(0), bytes: 4 };
        let stream = [f(S0, 0), send, f(S1, 0), b(S1, 0), free(S1, 0), b(S0, 0), free(S0, 0)];
        let both = BTreeMap::from([(S0, false), (S1, false)]);
        // S0's forward gathers S0, and S1 ahead; both keep their graphs until their frees
        assert_eq!(at(&stage_gathers(&stream, &both)), [(0, 0), (0, 1)]);
        // S1 recomputed: its weights go after its forward, so its backward gathers them
        // again (S0's, kept by its graph, need no gathering ahead)
        let recomputed = BTreeMap::from([(S0, false), (S1, true)]);
        assert_eq!(at(&stage_gathers(&stream, &recomputed)), [(0, 0), (0, 1), (3, 1)]);
        // an update of the next chunk between the two passes: no gathering ahead
        let updated = [f(S0, 0), Instr::ShardStep { stage: S1 }, f(S1, 0), b(S1, 0), b(S0, 0)];
        assert_eq!(at(&stage_gathers(&updated, &both)), [(0, 0), (2, 1)]);
    }
}
