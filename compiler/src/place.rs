//! Placement: `Layout` → `Placement`, which device runs each stage for each microbatch.

use pipec_grammar::diagnostic::Diagnostic;
use pipec_grammar::spec::Spec;
use pipec_plan::schedule::ChunkPlacement;
use pipec_plan::vocab::{ScheduleKind, SyncMode};
use pipec_plan::DeviceId;

use crate::cluster::ClusterGraph;
use crate::partition::Layout;
use crate::schedule::Placement;

/// Assigns devices: pipeline rank r's replicas get consecutive devices (a tensor-parallel
/// group of `tp` devices each, led by its first), so replicas and TP groups stay inside a
/// node when they can.
///
/// Placement: `Layout` → `Placement`.
pub(crate) fn place(spec: &Spec, layout: &Layout, cluster: &ClusterGraph) -> Result<Placement, Vec<Diagnostic>> {
    let strategy = &spec.strategy;
    place_chunks(strategy.schedule.kind.chunk_placement(), layout, strategy.tp.max(1), strategy.microbatches, cluster)
        .map_err(|msg| vec![Diagnostic::error("E0405", msg, strategy.schedule.span, "this schedule")])
}

pub(crate) fn place_chunks(
    chunks: ChunkPlacement,
    layout: &Layout,
    tp: usize,
    microbatches: usize,
    cluster: &ClusterGraph,
) -> Result<Placement, String> {
    let ranks = layout.replicas.len();
    let rank_devices = rank_devices(&layout.replicas, tp);
    let base = layout.replicas.iter().sum::<usize>() * tp;
    if base > cluster.device_count() {
        return Err(format!("the layout needs {base} devices, the cluster has {}", cluster.device_count()));
    }
    let stages = layout.ranges.len();
    let mut replicas = Vec::with_capacity(stages);
    let mut route = Vec::with_capacity(stages);
    if matches!(chunks, ChunkPlacement::Bidirectional | ChunkPlacement::Halves) {
        // R = the stages' (equal) replication: R pipeline pairs, pair q made of the q-th
        // replica device of every rank. In pair q, stage s's down copy runs on rank s's
        // device and its up copy on rank D−1−s's. Microbatches come in units of R·D (the last
        // may be smaller), dealt round-robin to the pairs; of each pair's share of a unit,
        // the first half goes down and the second half up. DualPipe (`Halves`): the
        // microbatches dealt round-robin to the pairs, the first half of each pair's share
        // down and the second half up.
        let pairs = layout.replicas[0].max(1);
        if layout.replicas.iter().any(|&r| r != pairs) {
            return Err("Chimera needs every stage replicated equally".into());
        }
        let copy = |m: usize| paired_copy(chunks, pairs, ranks, microbatches, m);
        for s in 0..stages {
            replicas.push((0..pairs).flat_map(|q| [rank_devices[s][q], rank_devices[ranks - 1 - s][q]]).collect());
            route.push((0..microbatches).map(copy).collect());
        }
    } else {
        for c in 0..stages {
            let devs = rank_devices[chunks.rank_of_chunk(c, ranks)].clone();
            let n = devs.len() as u32;
            route.push((0..microbatches as u32).map(|m| m % n).collect());
            replicas.push(devs);
        }
    }
    Ok(Placement { replicas, route, devices: cluster.device_count(), microbatches })
}

/// Under Chimera (`Bidirectional`) and DualPipe (`Halves`), the copy of a stage that
/// microbatch `m` of `microbatches` takes: `2q` (pair q's down copy) or `2q + 1` (its up
/// copy), for `pairs` pipeline pairs of `ranks` ranks (`place_chunks` says how they are
/// dealt).
pub(crate) fn paired_copy(chunks: ChunkPlacement, pairs: usize, ranks: usize, microbatches: usize, m: usize) -> u32 {
    if chunks == ChunkPlacement::Halves {
        let (q, k) = (m % pairs, m / pairs);
        let share = (microbatches - q).div_ceil(pairs);
        return (2 * q + usize::from(2 * k >= share)) as u32;
    }
    let unit = pairs * ranks;
    let unit_start = m - m % unit;
    let unit_len = unit.min(microbatches - unit_start);
    let (o, q) = (m - unit_start, (m - unit_start) % pairs);
    let share = (unit_len - q).div_ceil(pairs);
    (2 * q + usize::from(o / pairs >= share / 2)) as u32
}

/// A replica's devices: its tensor-parallel leader and the `tp` − 1 after it.
pub(crate) fn tensor_parallel_devices(leader: DeviceId, tp: usize) -> impl Iterator<Item = DeviceId> {
    (0..tp.max(1) as u32).map(move |t| DeviceId(leader.0 + t))
}

/// The devices of each pipeline rank's replicas (the tensor-parallel leaders): consecutive,
/// `tp` apart, rank after rank.
pub(crate) fn rank_devices(replicas: &[usize], tp: usize) -> Vec<Vec<DeviceId>> {
    let mut base = 0usize;
    let mut out = Vec::with_capacity(replicas.len());
    for &r in replicas {
        out.push((0..r).map(|j| DeviceId((base + j * tp) as u32)).collect());
        base += r * tp;
    }
    out
}

/// One pipeline replica of a symmetric plan: replica 0 of every pipeline rank (its
/// tensor-parallel leader), running its share of the microbatches (renumbered), with the
/// plan's device ids. What it simulates is exactly what every replica and every
/// tensor-parallel member of the whole plan does when the plan is symmetric: every rank on
/// the same number `r` of replicas, the microbatches a multiple of `r` (each replica, or
/// each of Chimera's pipeline pairs, then gets the same pattern: Chimera's last, partial
/// unit too), tensor-parallel groups inside a node, and
/// between any two ranks the same link for every replica. The simulator's costs are the
/// same on every device and collectives are costed over the whole group (`summed_over`),
/// so each replica's timeline is replica 0's. Returns the view and how many devices of the
/// plan each of its devices stands for, or None for a plan that is not symmetric (or is
/// its own one replica).
pub(crate) fn one_replica(
    spec: &Spec,
    layout: &Layout,
    microbatches: usize,
    cluster: &ClusterGraph,
) -> Option<(Placement, usize)> {
    let leaders = symmetric_leaders(&layout.replicas, spec.strategy.tp, cluster)?;
    one_replica_of(spec, layout, microbatches, cluster, &leaders)
}

/// Whether the schedule's replicas run alike (not asynchronous data parallelism, whose
/// workers each run at their own pace against the parameter server).
pub(crate) fn replicas_run_alike(spec: &Spec) -> bool {
    let schedule = &spec.strategy.schedule;
    !(schedule.kind == ScheduleKind::DpOnly && schedule.sync == SyncMode::Asp)
}

/// The part of [`one_replica`]'s symmetry that depends only on the layout's shape (not on
/// the microbatches or the schedule): every rank on the same number of replicas,
/// tensor-parallel groups inside a node, the same link between any two ranks for every
/// replica. Returns each rank's replica-0 device (its
/// tensor-parallel leader), or None for a layout that is not symmetric or is its own one
/// replica. The search computes it once per layout shape (`bound::Skeleton`).
pub(crate) fn symmetric_leaders(replicas: &[usize], tp: usize, cluster: &ClusterGraph) -> Option<Vec<DeviceId>> {
    let tp = tp.max(1);
    let r = *replicas.first()?;
    let symmetric = r > 0 && replicas.iter().all(|&x| x == r) && cluster.devices_per_node.is_multiple_of(tp);
    if !symmetric || r * tp == 1 {
        return None;
    }
    let rd = rank_devices(replicas, tp);
    // the ranks' devices are distinct, so two ranks' link is intra-node exactly when their
    // devices share a node: every replica q has the same links as replica 0 when the nodes
    // of replica q's devices are those of replica 0's renamed one to one (checked both
    // ways, in one pass per replica rather than one per pair of ranks)
    let mut forward: rustc_hash::FxHashMap<u32, u32> = Default::default();
    let mut backward: rustc_hash::FxHashMap<u32, u32> = Default::default();
    for q in 1..r {
        forward.clear();
        backward.clear();
        for devices in &rd {
            let (first, here) = (cluster.node_of(devices[0]), cluster.node_of(devices[q]));
            if *forward.entry(first).or_insert(here) != here || *backward.entry(here).or_insert(first) != first {
                return None;
            }
        }
    }
    Some(rd.iter().map(|d| d[0]).collect())
}

/// [`one_replica`] given the layout's [`symmetric_leaders`].
pub(crate) fn one_replica_of(
    spec: &Spec,
    layout: &Layout,
    microbatches: usize,
    cluster: &ClusterGraph,
    leaders: &[DeviceId],
) -> Option<(Placement, usize)> {
    let tp = spec.strategy.tp.max(1);
    let r = *layout.replicas.first()?;
    if !microbatches.is_multiple_of(r) || !replicas_run_alike(spec) {
        return None;
    }
    let one = Layout {
        recompute: layout.recompute.clone(),
        replicas: vec![1; layout.replicas.len()],
        virtual_stages: layout.virtual_stages,
        ranges: layout.ranges.clone(),
        notation: String::new(),
    };
    let mut view =
        place_chunks(spec.strategy.schedule.kind.chunk_placement(), &one, tp, microbatches / r, cluster).ok()?;
    // rank i's one device is i·tp there: replica 0 of rank i here
    for replicas in &mut view.replicas {
        for d in replicas.iter_mut() {
            *d = leaders[d.0 as usize / tp];
        }
    }
    Some((view, r * tp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_grammar::spec::Link;
    use pipec_plan::device::DeviceModel;

    /// The one-pass check of `symmetric_leaders` against its definition: between any two
    /// ranks, every replica's devices on the same link level as replica 0's.
    #[test]
    fn symmetric_leaders_is_the_pairwise_definition() {
        let link = Link { bandwidth: 1e9, latency: 1e-6, efficiency: 1.0 };
        let mut checked = (0, 0);
        for per_node in [1, 2, 3, 4, 8] {
            for nodes in [1, 2, 3, 4, 6] {
                let cluster = ClusterGraph {
                    nodes,
                    devices_per_node: per_node,
                    memory: 1e9,
                    device: DeviceModel::uniform("x", 1e9, 1e12),
                    intra: link,
                    inter: link,
                };
                for tp in [1, 2, 4] {
                    for ranks in 1..=6 {
                        for r in 1..=6 {
                            if ranks * r * tp > cluster.device_count() {
                                continue;
                            }
                            let replicas = vec![r; ranks];
                            let fast = symmetric_leaders(&replicas, tp, &cluster);
                            let rd = rank_devices(&replicas, tp);
                            let pairwise = per_node % tp == 0
                                && r * tp > 1
                                && (0..ranks).all(|a| {
                                    (a + 1..ranks).all(|b| {
                                        let level = cluster.level(rd[a][0], rd[b][0]);
                                        (1..r).all(|q| cluster.level(rd[a][q], rd[b][q]) == level)
                                    })
                                });
                            assert_eq!(
                                fast.is_some(),
                                pairwise,
                                "{ranks} ranks × {r} replicas, tp {tp}, {nodes} × {per_node}"
                            );
                            if let Some(leaders) = fast {
                                assert_eq!(leaders, rd.iter().map(|d| d[0]).collect::<Vec<_>>());
                            }
                            if pairwise {
                                checked.0 += 1
                            } else {
                                checked.1 += 1
                            }
                        }
                    }
                }
            }
        }
        // both answers occur often
        assert!(checked.0 > 50 && checked.1 > 50, "{checked:?}");
    }
}
