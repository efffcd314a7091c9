//! The collectives declared inside passes (`pipec_plan::in_pass`): every member of a
//! tensor-, context- or expert-parallel group, or of a stage's replicas (ZeRO's shard, the
//! gradients' reduction), declares the same ones, in the same order, over the passes it
//! runs — a pass feeding its stage's bucketed reduction by its own list; and a declaration
//! over a group names one the device is in.
//!
//! The members' streams are walked side by side, pass by pass, without expanding the
//! declarations: memory stays that of the table at thousands of devices.
//!
//! ZeRO-3's gathers of stages' whole weights, declared by instruction, are checked per
//! stage's shard group: its members start them at the same passes ([`check_gathers`]).

use std::collections::BTreeMap;

use rustc_hash::{FxHashMap, FxHashSet};

use pipec_plan::in_pass::{InPass, InPassTable, PassKind};
use pipec_plan::plan::bucketed_passes;
use pipec_plan::vocab::Sharding;
use pipec_plan::{Choice, DeviceId, PeerDim, StageId};

use super::{VerifyInput, Violation};

/// The members of `device`'s group over `dim` for `stage` (None: the device holds no
/// replica of the stage, or the group would be the device alone).
fn group_of(input: &VerifyInput<'_>, stage: StageId, device: DeviceId, dim: PeerDim) -> Option<Vec<DeviceId>> {
    let s = stage.0 as usize;
    let replicas = input.placement.replicas.get(s)?;
    let tp = input.tp.max(1) as u32;
    // the replica whose tensor-parallel ranks hold the device (a leader and the devices after it)
    let (i, rank) = replicas
        .iter()
        .enumerate()
        .find_map(|(i, r)| (device.0 >= r.0 && device.0 < r.0 + tp).then(|| (i, device.0 - r.0)))?;
    let of_replicas = |size: usize| -> Option<Vec<DeviceId>> {
        let (members, _) = input.chunks.expert_group(i, size);
        members.into_iter().map(|j| replicas.get(j).map(|r| DeviceId(r.0 + rank))).collect()
    };
    let members = match dim {
        PeerDim::Tensor => (0..tp).map(|t| DeviceId(replicas[i].0 + t)).collect(),
        PeerDim::Context => of_replicas(input.context_parallel.max(1))?,
        PeerDim::Expert => of_replicas(input.expert_parallel.get(s).copied().unwrap_or(1).max(1))?,
        PeerDim::Shard | PeerDim::Data => replicas.iter().map(|r| DeviceId(r.0 + rank)).collect(),
    };
    (members.len() > 1).then_some(members)
}

/// One pass's declarations over one group: its place in the stream, what it is, and its
/// entries over the group's dimension.
struct Pass<'t> {
    index: usize,
    stage: StageId,
    kind: PassKind,
    entries: &'t [InPass],
}

/// Checks `table` against the streams of `input` (all tensor-parallel ranks together).
pub(super) fn check_declared(input: &VerifyInput<'_>, table: &InPassTable, out: &mut Vec<Violation>) {
    // every (device, stage, dimension) declared over, to its group; and per (device,
    // stage, kind of pass, dimension) the entries over that dimension
    let mut groups: BTreeMap<(PeerDim, Vec<DeviceId>), usize> = BTreeMap::new();
    let mut group_at: FxHashMap<(DeviceId, StageId, PeerDim), usize> = FxHashMap::default();
    // (keyed by whether the list is the one of a pass feeding the bucketed reduction)
    let mut over: FxHashMap<(DeviceId, StageId, PassKind, bool, PeerDim), Vec<InPass>> = FxHashMap::default();
    let mut reducing_lists: FxHashSet<(DeviceId, StageId, PassKind)> = FxHashSet::default();
    for (dev, lists) in &table.devices {
        for p in lists {
            if p.reduces {
                reducing_lists.insert((*dev, p.stage, p.pass));
            }
            let list = table.lists.get(p.list as usize).map_or(&[][..], Vec::as_slice);
            for dim in PeerDim::ALL.iter().copied().filter(|d| list.iter().any(|e| e.over == *d)) {
                let entries = list.iter().copied().filter(|e| e.over == dim).collect();
                over.insert((*dev, p.stage, p.pass, p.reduces, dim), entries);
                if group_at.contains_key(&(*dev, p.stage, dim)) {
                    continue;
                }
                match group_of(input, p.stage, *dev, dim) {
                    Some(members) => {
                        let next = groups.len();
                        let g = *groups.entry((dim, members)).or_insert(next);
                        group_at.insert((*dev, p.stage, dim), g);
                    }
                    None => out.push(Violation {
                        device: Some(*dev),
                        index: None,
                        message: format!(
                            "its {} passes of {} declare collectives over {dim}, but {dev} is in no {dim} group of {} with other members",
                            p.pass, p.stage, p.stage
                        ),
                    }),
                }
            }
        }
    }
    // per device, the passes feeding a bucketed replica reduction (on a stage with buckets
    // where the table declares a list of its own for them)
    let reducing: FxHashMap<DeviceId, FxHashSet<usize>> = input
        .streams
        .iter()
        .map(|(d, stream)| (*d, bucketed_passes(stream, |_| true).into_iter().map(|(pass, _)| pass).collect()))
        .collect();
    for ((dim, members), g) in &groups {
        let passes = |d: DeviceId| {
            let (group_at, over, reducing_lists) = (&group_at, &over, &reducing_lists);
            let reducing = reducing.get(&d);
            input.streams.get(&d).into_iter().flatten().enumerate().filter_map(move |(index, ins)| {
                let kind = PassKind::of(ins)?;
                let stage = ins.stage();
                if group_at.get(&(d, stage, *dim)) != Some(g) {
                    return None;
                }
                let reduces =
                    reducing.is_some_and(|r| r.contains(&index)) && reducing_lists.contains(&(d, stage, kind));
                let entries = over.get(&(d, stage, kind, reduces, *dim))?;
                Some(Pass { index, stage, kind, entries })
            })
        };
        // the members side by side, each stream walked once
        let mut walks: Vec<_> = members.iter().map(|&d| passes(d)).collect();
        let mut differ = vec![false; members.len()];
        let mut k = 0;
        loop {
            let now: Vec<Option<Pass<'_>>> = walks.iter_mut().map(Iterator::next).collect();
            if now.iter().all(Option::is_none) {
                break;
            }
            for (m, pass) in now.iter().enumerate().skip(1) {
                if !differ[m] && !same(now[0].as_ref(), pass.as_ref()) {
                    differ[m] = true;
                    out.push(difference(now[0].as_ref(), pass.as_ref(), k, members[m], *dim, members));
                }
            }
            k += now[0].as_ref().map_or(0, |p| p.entries.len());
        }
    }
}

/// Whether two members' passes at one place of their walks declare the same.
fn same(a: Option<&Pass<'_>>, b: Option<&Pass<'_>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.stage == b.stage && a.kind == b.kind && a.entries == b.entries,
        (None, None) => true,
        (Some(_), None) | (None, Some(_)) => false,
    }
}

/// The violation of member `d` whose pass `mine` differs from the group's first member's
/// `reference`, `k` collectives into their walks.
fn difference(
    reference: Option<&Pass<'_>>,
    mine: Option<&Pass<'_>>,
    k: usize,
    d: DeviceId,
    dim: PeerDim,
    members: &[DeviceId],
) -> Violation {
    let say = |p: Option<&Pass<'_>>, i: usize| {
        p.and_then(|p| p.entries.get(i).map(|e| format!("{e} in a {} of {}", p.kind, p.stage)))
            .unwrap_or_else(|| "nothing".to_string())
    };
    let at = match (reference, mine) {
        (Some(r), Some(m)) if r.stage == m.stage && r.kind == m.kind => {
            (0..).find(|&i| r.entries.get(i) != m.entries.get(i)).unwrap_or(0)
        }
        _ => 0,
    };
    let names: Vec<String> = members.iter().map(ToString::to_string).collect();
    Violation {
        device: Some(d),
        index: mine.map(|m| m.index),
        message: format!(
            "its {dim} group ({})'s collectives inside passes differ from collective {} on: {}, where {} declares {}; a group's members must issue the same ones in the same order",
            names.join(", "),
            k + at,
            say(mine, at),
            members[0],
            say(reference, at)
        ),
    }
}

/// ZeRO-3's gathers of stages' whole weights (`pipec_plan::in_pass::stage_gathers`): each
/// starts at a pass that reads weights, of a stage the device holds sharded at stage 3
/// among other replicas, and the members of each stage's shard group start theirs at the
/// same passes — the same kind of pass of the same stage, its same occurrence in the
/// step — in the same order.
pub(super) fn check_gathers(input: &VerifyInput<'_>, table: &InPassTable, out: &mut Vec<Violation>) {
    // per (stage gathered, its shard group): each member's gathers, each as the pass it
    // starts in (kind, stage, how many passes of that kind and stage came before)
    type At = (PassKind, StageId, usize);
    let mut groups: BTreeMap<(StageId, Vec<DeviceId>), BTreeMap<DeviceId, Vec<At>>> = BTreeMap::new();
    for (d, stream) in input.streams {
        let gathers = table.gathers_of(*d);
        if gathers.is_empty() {
            continue;
        }
        let mut seen: FxHashMap<(PassKind, StageId), usize> = FxHashMap::default();
        let mut ordinal = vec![None; stream.len()];
        for (i, ins) in stream.iter().enumerate() {
            if let Some(kind) = PassKind::of(ins) {
                let n = seen.entry((kind, ins.stage())).or_insert(0);
                ordinal[i] = Some((kind, ins.stage(), *n));
                *n += 1;
            }
        }
        let held: FxHashSet<StageId> = stream.iter().map(pipec_plan::Instr::stage).collect();
        for g in gathers {
            let at = g.at as usize;
            let problem = match stream.get(at) {
                None => Some(format!("is past the end of its stream ({} instructions)", stream.len())),
                Some(ins) if !pipec_plan::in_pass::reads_weights(ins) => {
                    Some(format!("starts at `{ins}`, which reads no weights"))
                }
                Some(_) if !held.contains(&g.stage) => Some(format!("is of {}, which {d} does not hold", g.stage)),
                Some(_) if input.sharding != Sharding::Parameters => {
                    Some("is declared, but the plan does not shard parameters (ZeRO-3)".to_string())
                }
                Some(_) => None,
            };
            if let Some(p) = problem {
                out.push(Violation {
                    device: Some(*d),
                    index: Some(at),
                    message: format!("its gather of {}'s whole weights at instruction {at} {p}", g.stage),
                });
                continue;
            }
            let Some(members) = group_of(input, g.stage, *d, PeerDim::Shard) else {
                out.push(Violation {
                    device: Some(*d),
                    index: Some(at),
                    message: format!(
                        "it gathers {}'s whole weights, but {d} shares no ZeRO shard of {} with other replicas",
                        g.stage, g.stage
                    ),
                });
                continue;
            };
            if let Some(o) = ordinal[at] {
                groups.entry((g.stage, members)).or_default().entry(*d).or_default().push(o);
            }
        }
    }
    for ((stage, members), by_member) in groups {
        let empty = Vec::new();
        let reference = by_member.get(&members[0]).unwrap_or(&empty);
        for m in &members[1..] {
            let mine = by_member.get(m).unwrap_or(&empty);
            let Some(k) = (0..reference.len().max(mine.len())).find(|&k| reference.get(k) != mine.get(k)) else {
                continue;
            };
            let say = |a: Option<&At>| match a {
                Some((kind, s, n)) => format!("at its {} {kind} of {s}", ordinal_name(*n)),
                None => "nowhere".to_string(),
            };
            let names: Vec<String> = members.iter().map(ToString::to_string).collect();
            out.push(Violation {
                device: Some(*m),
                index: None,
                message: format!(
                    "its ZeRO-3 gathers of {stage}'s whole weights differ from its shard group's ({}): gather {k} starts {}, where {} starts it {}; a group's members must issue the same ones in the same order",
                    names.join(", "),
                    say(mine.get(k)),
                    members[0],
                    say(reference.get(k)),
                ),
            });
        }
    }
}

/// "first", "second", … for occurrence `n` (from 0).
fn ordinal_name(n: usize) -> String {
    match n {
        0 => "first".to_string(),
        1 => "second".to_string(),
        2 => "third".to_string(),
        n => format!("{}th", n + 1),
    }
}
