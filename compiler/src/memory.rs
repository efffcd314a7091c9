//! Memory feasibility: the bytes each device needs, broken down, with the activation counts
//! taken from the generated streams themselves (how many microbatches each stage really
//! keeps at once), not from a formula table.

use std::collections::{BTreeMap, HashMap};

use pipec_plan::plan::MemoryBreakdown;
use pipec_plan::vocab::Sharding;
use pipec_plan::{DeviceId, Instr, StageId};

/// A stage's weights, gradients and optimizer state on one replica.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ModelState {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    /// Training in fp32, the weights are their own master copy; a ZeRO-1 or 2 replica keeps
    /// its shard's master copy beside the whole weights the all-gather overwrites: these
    /// bytes (of the whole model), sharded like the optimizer state. 0 under mixed
    /// precision, whose optimizer state holds the master copy already.
    pub master: u64,
}

impl ModelState {
    /// What one of `d` replicas keeps of this (whole) state under `sharding`: ZeRO's 1/d of
    /// each part it shards.
    pub fn sharded(self, sharding: Sharding, d: u64) -> ModelState {
        let (optimizer, gradients, weights) = sharding.shards();
        let share = |bytes: u64, sharded: bool| if sharded { bytes.div_ceil(d.max(1)) } else { bytes };
        let master = if optimizer && !weights { share(self.master, true) } else { 0 };
        ModelState {
            weights: share(self.weights, weights),
            gradients: share(self.gradients, gradients),
            optimizer: share(self.optimizer, optimizer).saturating_add(master),
            master: 0,
        }
    }

    /// [`ModelState::sharded`] of a stage whose parameters are `experts` of `parameters`
    /// routed experts under expert parallelism `ep`: the dense part over all `d` replicas,
    /// the experts' part over the `d / ep` replicas holding the same experts (Megatron's
    /// expert-data-parallel group). Every part of the state is per parameter, so each
    /// splits in the parameters' proportion.
    pub fn sharded_by_expert(self, sharding: Sharding, d: u64, experts: u64, parameters: u64, ep: u64) -> ModelState {
        if ep <= 1 || experts == 0 || parameters == 0 {
            return self.sharded(sharding, d);
        }
        let share = |bytes: u64| ((bytes as u128 * experts.min(parameters) as u128) / parameters as u128) as u64;
        let expert = ModelState {
            weights: share(self.weights),
            gradients: share(self.gradients),
            optimizer: share(self.optimizer),
            master: share(self.master),
        };
        let dense = ModelState {
            weights: self.weights - expert.weights,
            gradients: self.gradients - expert.gradients,
            optimizer: self.optimizer - expert.optimizer,
            master: self.master - expert.master,
        };
        let (a, b) = (dense.sharded(sharding, d), expert.sharded(sharding, (d / ep).max(1)));
        ModelState {
            weights: a.weights + b.weights,
            gradients: a.gradients + b.gradients,
            optimizer: a.optimizer + b.optimizer,
            master: 0,
        }
    }

    pub fn total(self) -> u64 {
        self.weights.saturating_add(self.gradients).saturating_add(self.optimizer)
    }
}

/// Bytes a stage needs, independent of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StageBytes {
    pub parameters: u64,
    /// Parameter bytes at the training precision (one tensor-parallel rank's shard).
    pub weights: u64,
    /// Gradient bytes (at the precision gradients are accumulated in).
    pub gradients: u64,
    /// Optimizer state (and the fp32 master copy under mixed precision).
    pub optimizer: u64,
    /// Bytes kept per microbatch for the backward.
    pub activations_per_microbatch: u64,
    /// With recompute: what each microbatch in flight keeps (the input of every recompute
    /// unit: the stage input, each transformer block's or LSTM's input; what the layers
    /// after the stage's last block keep, which no engine recomputes; and the loss's input
    /// on the last stage).
    pub checkpoint_per_microbatch: u64,
    /// With recompute: the largest unit's activations for one microbatch, live while it is
    /// recomputed and its backward runs.
    pub recompute_unit_peak: u64,
    /// Without a whole-stage recompute: what one microbatch's backward of a layer holds
    /// beyond the kept tensors — what the blocks' recompute policy dropped and brings back,
    /// and the gradients at the block's widest point — the largest of the stage's layers.
    pub backward_transient: u64,
    /// The last stage: what the loss's backward holds beside the kept log-probabilities
    /// (their gradient in fp32 and cast to the activations' precision); it runs before any
    /// layer's backward, so it is not added to theirs.
    pub loss_transient: u64,
    /// Largest message (activation or gradient) the stage sends or receives.
    pub largest_message: u64,
    /// ZeRO-3: the whole weights gathered at once (the layer computing and the next,
    /// prefetched); 0 otherwise.
    pub gathered_weights: u64,
    /// ZeRO-2 and 3: the whole gradients one reduce-scatter takes at once (the stage's
    /// largest gradient bucket, or its whole gradient when it reduces in one), held beside
    /// the shard until the collective takes them; 0 otherwise.
    pub scattered_gradients: u64,
    /// The stage's model state before ZeRO shards it (`weights`, `gradients` and
    /// `optimizer` are one replica's share of it); its gradients are what the replicas
    /// reduce each step (an all-reduce, or under ZeRO a reduce-scatter of as many bytes).
    pub whole: ModelState,
    /// Replicas of the stage (what `zero` shards over).
    pub replicas: u64,
    /// Of `activations_per_microbatch`, the attention cores' `[heads, seq, seq]` tensors
    /// (what flash attention or selective recompute does not keep).
    pub attention_core_per_microbatch: u64,
    /// Of `activations_per_microbatch`, context parallelism's gathered keys and values
    /// (what `cp_comm: ring` does not keep).
    pub gathered_kv_per_microbatch: u64,
}

impl StageBytes {
    /// What one microbatch's backward holds on the stage beyond what it keeps: with
    /// `recomputed`, the largest recompute unit rebuilt and its layer's transient, else the
    /// largest layer's; on the last stage at least the loss's backward (which runs before
    /// any layer's).
    pub fn transient(&self, recomputed: bool) -> u64 {
        let layers = if recomputed {
            self.recompute_unit_peak.saturating_add(self.backward_transient)
        } else {
            self.backward_transient
        };
        layers.max(self.loss_transient)
    }
}

/// The documented workspace reserve: 5% of the device memory, at most 1 GiB (allocator
/// fragmentation, framework context, kernels' scratch space).
pub fn workspace_reserve(capacity: f64) -> u64 {
    (capacity * 0.05).min(1024.0 * 1024.0 * 1024.0) as u64
}

/// The peak, per stage, of a count that `opens` raises and `closes` lowers, walking the
/// stream in order.
fn peak_count(
    stream: &[Instr],
    opens: impl Fn(&Instr) -> bool,
    closes: impl Fn(&Instr) -> bool,
) -> BTreeMap<StageId, u32> {
    let mut now: HashMap<StageId, u32> = HashMap::new();
    let mut peak: BTreeMap<StageId, u32> = BTreeMap::new();
    for ins in stream {
        if opens(ins) {
            let c = now.entry(ins.stage()).or_insert(0);
            *c += 1;
            let p = peak.entry(ins.stage()).or_insert(0);
            *p = (*p).max(*c);
        } else if closes(ins) {
            if let Some(c) = now.get_mut(&ins.stage()) {
                *c = c.saturating_sub(1);
            }
        }
    }
    peak
}

/// Peak microbatches in flight per stage held by the device: forwards whose saved
/// activations are not yet freed.
pub fn peak_in_flight(stream: &[Instr]) -> BTreeMap<StageId, u32> {
    peak_count(stream, |i| matches!(i, Instr::Forward { .. }), |i| matches!(i, Instr::Free { .. }))
}

/// Peak stashed weight versions alive at once per stage (PipeDream weight stashing).
pub fn peak_weight_versions(stream: &[Instr]) -> BTreeMap<StageId, u32> {
    peak_count(stream, |i| matches!(i, Instr::StashWeights { .. }), |i| matches!(i, Instr::RestoreWeights { .. }))
}

/// The memory a device needs for its stream. `layered_pairs`: the combined 1F1B's pairs run
/// layer by layer (`Spec::pairs_layer_by_layer`), so a pair's forward keeps at most what its
/// backward frees beyond the larger of the two.
pub fn device_memory(
    stream: &[Instr],
    stages: &[StageBytes],
    recompute: &[bool],
    weight_versions: Option<u32>,
    capacity: f64,
    layered_pairs: bool,
) -> MemoryBreakdown {
    let held: Vec<StageId> = {
        let mut v: Vec<StageId> = stream.iter().map(Instr::stage).collect();
        v.sort();
        v.dedup();
        v
    };
    let stashes = peak_weight_versions(stream);
    let mut m = MemoryBreakdown::default();
    for s in &held {
        let b = stages[s.0 as usize];
        // Versions: the live weights plus stashed ones. A stash holds the version a forward
        // used; when updates are rarer than forwards (2BW) many stashes share a version, so
        // the schedule's own bound caps the count.
        let stashed = stashes.get(s).copied().unwrap_or(0);
        let versions = match weight_versions {
            Some(cap) => (1 + stashed).min(cap.max(1)),
            None => 1,
        };
        m.weights = m.weights.saturating_add(b.weights.saturating_mul(u64::from(versions)));
        m.gradients = m.gradients.saturating_add(b.gradients);
        m.optimizer = m.optimizer.saturating_add(b.optimizer);
        m.buffers = m.buffers.max(
            b.largest_message
                .saturating_mul(4)
                .saturating_add(b.gathered_weights)
                .saturating_add(b.scattered_gradients),
        );
    }
    // Activations: the peak over the stream of what all held stages keep at once.
    let mut now: HashMap<StageId, u64> = HashMap::new();
    let mut peak_total = 0u64;
    let recomputed = |s: &StageId| recompute.get(s.0 as usize).copied().unwrap_or(false);
    // a recomputed stage rebuilds one unit of one microbatch at a time; another holds, in
    // one microbatch's backward of a layer, what the layer's recompute policy brings back
    // and the gradients at the block's widest point; the last stage's loss backward holds
    // the gradient of the log-probabilities before any of that
    let transient = held.iter().map(|s| stages[s.0 as usize].transient(recomputed(s))).max().unwrap_or(0);
    for (i, ins) in stream.iter().enumerate() {
        let per = |s: &StageId| {
            let b = stages[s.0 as usize];
            if recomputed(s) {
                b.checkpoint_per_microbatch
            } else {
                b.activations_per_microbatch
            }
        };
        match ins {
            Instr::Forward { stage, .. } => {
                let e = now.entry(*stage).or_insert(0);
                *e = e.saturating_add(per(stage));
                // a layered pair: while the forward keeps its layers, the backward frees its
                // own; both are held whole only in the larger's share
                let freed = layered_pairs
                    .then(|| pipec_plan::schedule::overlapped_pair(stream, i, pipec_plan::schedule::Pairing::OtherTask))
                    .flatten()
                    .map_or(0, |j| per(&stream[j].stage()).min(per(stage)));
                let total = now.values().fold(0u64, |a, &v| a.saturating_add(v));
                peak_total = peak_total.max(total.saturating_sub(freed));
            }
            Instr::Free { stage, .. } => {
                let e = now.entry(*stage).or_insert(0);
                *e = e.saturating_sub(per(stage));
            }
            _ => {}
        }
    }
    m.activations = peak_total;
    m.transient = transient;
    m.workspace = workspace_reserve(capacity);
    m.capacity = capacity as u64;
    m.total = [m.gradients, m.optimizer, m.activations, m.transient, m.buffers, m.workspace]
        .into_iter()
        .fold(m.weights, u64::saturating_add);
    m
}

/// Formats bytes for people: `1.50 GiB`.
pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < units.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// The per-device memory table `pipec compile` prints.
pub fn table(devices: &[(DeviceId, Vec<StageId>, usize, &MemoryBreakdown)]) -> String {
    // devices whose rows read the same are one row, named by their set (`d0–d127 (128 devices)`)
    let mut groups: Vec<(String, Vec<DeviceId>)> = Vec::new();
    for (id, stages, replicas, m) in devices {
        let st: Vec<String> = stages.iter().map(ToString::to_string).collect();
        let share = if m.capacity > 0 { m.total as f64 / m.capacity as f64 * 100.0 } else { 0.0 };
        let row = format!(
            "{:<10} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>5.1}%",
            st.join(","),
            replicas,
            human_bytes(m.weights),
            human_bytes(m.gradients),
            human_bytes(m.optimizer),
            human_bytes(m.activations),
            human_bytes(m.total),
            human_bytes(m.capacity),
            share
        );
        match groups.iter_mut().find(|(r, _)| *r == row) {
            Some((_, ids)) => ids.push(*id),
            None => groups.push((row, vec![*id])),
        }
    }
    let names: Vec<String> = groups.iter().map(|(_, ids)| pipec_plan::instr::devices_text(ids)).collect();
    let width = names.iter().map(|n| n.chars().count()).max().unwrap_or(0).max(7);
    let mut out = format!(
        "{:<width$} {:<10} {:>8} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>6}\n",
        "device", "stages", "replicas", "weights", "gradients", "optimizer", "activations", "total", "capacity", "use"
    );
    for ((row, _), name) in groups.iter().zip(&names) {
        // (padded by characters: a range's dash is one character of three bytes)
        let pad = width - name.chars().count();
        out.push_str(&format!("{name}{} {row}\n", " ".repeat(pad)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_plan::{MicrobatchId, StageId};

    /// The combined 1F1B without a pipeline (F0, F1 B0, F2 B1, F2's backward): run layer by
    /// layer (Megatron-LM) a pair holds one microbatch's activations, its forward keeping
    /// what its backward frees; run pass after pass (pipec's executor) two.
    #[test]
    fn a_layered_pair_holds_one_microbatch_and_a_pass_by_pass_pair_two() {
        let (s, m) = (StageId(0), MicrobatchId);
        let mut stream = vec![Instr::Forward { stage: s, mb: m(0) }];
        for k in 1..3 {
            stream.push(Instr::Forward { stage: s, mb: m(k) });
            stream.push(Instr::Backward { stage: s, mb: m(k - 1) });
            stream.push(Instr::Free { stage: s, mb: m(k - 1) });
        }
        stream.push(Instr::Backward { stage: s, mb: m(2) });
        stream.push(Instr::Free { stage: s, mb: m(2) });
        let bytes = StageBytes { activations_per_microbatch: 1000, ..StageBytes::default() };
        let memory = |layered| device_memory(&stream, &[bytes], &[false], None, 1e12, layered).activations;
        assert_eq!((memory(true), memory(false)), (1000, 2000));
        // the plain 1F1B order holds one either way: nothing pairs
        let plain: Vec<Instr> = (0..3)
            .flat_map(|k| {
                [
                    Instr::Forward { stage: s, mb: m(k) },
                    Instr::Backward { stage: s, mb: m(k) },
                    Instr::Free { stage: s, mb: m(k) },
                ]
            })
            .collect();
        assert_eq!(device_memory(&plain, &[bytes], &[false], None, 1e12, true).activations, 1000);
    }
}
