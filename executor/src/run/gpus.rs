//! Which GPU each plan device runs on, and whether the plan fits it. In one process (the
//! in-process transport) the plan's devices with work take this machine's GPUs in device
//! order: device 0 → GPU 0, device 1 → GPU 1, …. Under MPI or TCP each rank takes the GPU of
//! its local rank on its host (`OMPI_COMM_WORLD_LOCAL_RANK`, or the PMIx/Slurm/torchrun
//! equivalents) among the GPUs it sees; where its launcher gave it fewer GPUs than that
//! (`CUDA_VISIBLE_DEVICES` set per rank: Slurm's `--gpus-per-task`, Kubernetes' one GPU a
//! pod) it takes its local rank modulo the GPUs it sees — the first of its own. Then the
//! ranks compare what they found ([`verdict`]): two ranks on one GPU (by its UUID, so a
//! binding by any name is seen) are an error unless the user asks for GPUs to be shared
//! (`--share-gpus`: what tests on a one-GPU machine need), and so is a GPU whose memory is
//! less than the plan's peak of the devices it runs. Pure functions of what was found, so
//! the mapping and the checks are unit-tested without a GPU.

use pipec_plan::{DeviceId, Plan};

use crate::backend::resident::gib;

/// What a process found of one GPU before it allocates anything on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The index among the GPUs this process sees (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    /// The GPU's UUID as `nvidia-smi -L` writes it (`GPU-…`): the same GPU under any name.
    pub uuid: String,
    pub name: String,
    /// Its memory in bytes, and the part of it free when asked.
    pub total: u64,
    pub free: u64,
}

impl Gpu {
    /// The words for a message: its index, its name and what `CUDA_VISIBLE_DEVICES` made of it.
    fn describe(&self, visible: Option<&str>) -> String {
        let bound = match visible.map(str::trim).filter(|v| !v.is_empty()) {
            Some(v) => format!(", CUDA_VISIBLE_DEVICES={v}"),
            None => String::new(),
        };
        format!("GPU {} ({}, {}{bound})", self.ordinal, self.name, self.uuid)
    }
}

/// A UUID's 16 bytes as `nvidia-smi -L` writes them.
pub fn uuid_text(bytes: [u8; 16]) -> String {
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("GPU-{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

/// The GPU of each device of one process, in device order.
pub fn in_process(devices: &[DeviceId], gpus: usize, share: bool) -> Result<Vec<(DeviceId, usize)>, String> {
    if gpus == 0 {
        return Err("this machine has no CUDA device".into());
    }
    if devices.len() > gpus && !share {
        return Err(format!(
            "the plan runs {} devices in this process and this machine has {gpus} GPU(s): use a machine with {} GPUs, run one process per GPU with `--transport mpi`, or pass `--share-gpus` to put several devices on one GPU",
            devices.len(),
            devices.len()
        ));
    }
    Ok(devices.iter().enumerate().map(|(i, d)| (*d, i % gpus)).collect())
}

/// The GPU of a rank started by MPI or `pipec launch`: its local rank among the `gpus` it
/// sees. A rank that sees fewer GPUs than its local rank takes one of them where its view
/// was narrowed for it (`visible`: `CUDA_VISIBLE_DEVICES`), the ranks' comparison
/// ([`verdict`]) then finding any two on one GPU; with the whole host in view it is an
/// error here unless GPUs are shared.
pub fn for_local_rank(local_rank: usize, gpus: usize, visible: Option<&str>, share: bool) -> Result<usize, String> {
    if gpus == 0 {
        return Err("this host has no CUDA device".into());
    }
    let narrowed = visible.is_some_and(|v| !v.trim().is_empty());
    if local_rank >= gpus && !share && !narrowed {
        return Err(format!(
            "local rank {local_rank} has no GPU of its own (this host has {gpus}): start at most {gpus} rank(s) per host (see `pipec launch`), give each rank its own GPU (CUDA_VISIBLE_DEVICES, Slurm's --gpus-per-task=1), or pass `--share-gpus`"
        ));
    }
    Ok(local_rank % gpus)
}

/// This process's rank among the ranks on its host, as its launcher says (Open MPI, PMIx,
/// Slurm, or torchrun's `LOCAL_RANK`).
pub fn local_rank_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
}

/// The GPUs this process may see, as its launcher set them.
pub fn visible_from_env() -> Option<String> {
    std::env::var("CUDA_VISIBLE_DEVICES").ok()
}

/// What one rank found, as it sends it to rank 0: its GPU, with `CUDA_VISIBLE_DEVICES`
/// for the messages, or why it has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub found: Result<Gpu, String>,
    pub visible: Option<String>,
}

impl Claim {
    /// Lines of text: `gpu`, ordinal, UUID, total, free, name, visible; or `error` and why.
    pub fn encode(&self) -> Vec<u8> {
        let visible = self.visible.as_deref().unwrap_or("-");
        match &self.found {
            Ok(g) => format!("gpu\n{}\n{}\n{}\n{}\n{}\n{visible}", g.ordinal, g.uuid, g.total, g.free, g.name),
            Err(e) => format!("error\n{e}"),
        }
        .into_bytes()
    }

    pub fn decode(bytes: &[u8]) -> Result<Claim, String> {
        let text = std::str::from_utf8(bytes).map_err(|_| "a rank's GPU claim is not text".to_string())?;
        let bad = || format!("a rank's GPU claim is malformed: {text:?}");
        let (kind, rest) = text.split_once('\n').ok_or_else(bad)?;
        match kind {
            "error" => Ok(Claim { found: Err(rest.to_string()), visible: None }),
            "gpu" => {
                let f: Vec<&str> = rest.split('\n').collect();
                let [ordinal, uuid, total, free, name, visible] = f[..] else { return Err(bad()) };
                let number = |s: &str| s.parse::<u64>().map_err(|_| bad());
                let gpu = Gpu {
                    ordinal: number(ordinal)? as usize,
                    uuid: uuid.to_string(),
                    name: name.to_string(),
                    total: number(total)?,
                    free: number(free)?,
                };
                Ok(Claim { found: Ok(gpu), visible: (visible != "-").then(|| visible.to_string()) })
            }
            _ => Err(bad()),
        }
    }
}

/// The plan's peak memory on `device` (0 for a device it does not hold).
pub fn plan_peak(plan: &Plan, device: DeviceId) -> u64 {
    plan.devices.iter().find(|p| p.id == device).map_or(0, |p| p.memory.total)
}

/// What the plan's devices found of their GPUs, each with its plan's peak memory, judged
/// together (`who`: the device's rank or name for the message): a device that found none;
/// two on one GPU unless `share`; a GPU with less memory than the peaks of the devices it
/// runs (memory another process holds is not counted: see [`free_memory_warning`]). None:
/// every device may start.
pub fn verdict(claims: &[(DeviceId, u64, Claim)], share: bool, who: &dyn Fn(DeviceId) -> String) -> Option<String> {
    let mut out: Vec<String> = Vec::new();
    // the same failure on every device is said once
    let errors: Vec<(DeviceId, &String)> =
        claims.iter().filter_map(|(d, _, c)| c.found.as_ref().err().map(|e| (*d, e))).collect();
    if errors.len() > 1 && errors.len() == claims.len() && errors.iter().all(|(_, e)| *e == errors[0].1) {
        out.push(format!("every device: {}", errors[0].1));
    } else {
        out.extend(errors.iter().map(|(d, e)| format!("{}: {e}", who(*d))));
    }
    type On<'a> = Vec<(DeviceId, u64, &'a Gpu, Option<&'a str>)>;
    let mut by_gpu: std::collections::BTreeMap<&str, On<'_>> = Default::default();
    for (d, peak, c) in claims {
        if let Ok(g) = &c.found {
            by_gpu.entry(g.uuid.as_str()).or_default().push((*d, *peak, g, c.visible.as_deref()));
        }
    }
    for on in by_gpu.values() {
        let (first, _, gpu, visible) = on[0];
        let names: Vec<String> = on.iter().map(|(d, ..)| who(*d)).collect();
        if on.len() > 1 && !share {
            out.push(format!(
                "{} all run on {}: give each rank its own GPU (one rank per GPU of a host; CUDA_VISIBLE_DEVICES or Slurm's --gpus-per-task=1 per rank), or pass `--share-gpus`",
                names.join(", "),
                gpu.describe(visible)
            ));
        }
        let held = on.iter().map(|(_, peak, ..)| *peak).fold(0u64, u64::saturating_add);
        if held > gpu.total {
            let whose = if on.len() == 1 {
                format!("{}'s plan", who(first))
            } else {
                format!("the plans of {}", names.join(", "))
            };
            out.push(format!(
                "{whose} peak at {} and {} has {}: the run would fail for memory; compile the spec for this GPU (its `cluster.device`) or with more devices",
                gib(held),
                gpu.describe(visible),
                gib(gpu.total)
            ));
        }
    }
    (!out.is_empty()).then(|| out.join("\n"))
}

/// A warning where a GPU's free memory is less than the plan's peak on it (another process
/// holds the rest), or None.
pub fn free_memory_warning(device: DeviceId, peak: u64, claim: &Claim) -> Option<String> {
    let gpu = claim.found.as_ref().ok()?;
    (peak > gpu.free && peak <= gpu.total).then(|| {
        format!(
            "{device}'s plan peaks at {} and {} has {} free of {} (another process holds the rest)",
            gib(peak),
            gpu.describe(claim.visible.as_deref()),
            gib(gpu.free),
            gib(gpu.total)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn ids(n: u32) -> Vec<DeviceId> {
        (0..n).map(DeviceId).collect()
    }

    fn h100(ordinal: usize, uuid: u8, visible: Option<&str>) -> Claim {
        let gpu = Gpu {
            ordinal,
            uuid: uuid_text([uuid; 16]),
            name: "NVIDIA H100 80GB HBM3".into(),
            total: 80 * GIB,
            free: 79 * GIB,
        };
        Claim { found: Ok(gpu), visible: visible.map(String::from) }
    }

    fn rank(d: DeviceId) -> String {
        format!("rank {}", d.0)
    }

    #[test]
    fn each_device_gets_its_own_gpu_in_order() {
        let map = in_process(&ids(4), 8, false).expect("fits");
        assert_eq!(map, vec![(DeviceId(0), 0), (DeviceId(1), 1), (DeviceId(2), 2), (DeviceId(3), 3)]);
    }

    #[test]
    fn fewer_gpus_than_devices_is_an_error_unless_shared() {
        let e = in_process(&ids(4), 1, false).expect_err("4 devices, 1 GPU");
        assert!(e.contains("4 devices") && e.contains("--share-gpus"), "{e}");
        let shared = in_process(&ids(4), 3, true).expect("shared");
        assert_eq!(shared.iter().map(|m| m.1).collect::<Vec<_>>(), vec![0, 1, 2, 0]);
        assert!(in_process(&ids(1), 0, true).is_err());
    }

    #[test]
    fn an_mpi_rank_takes_its_local_ranks_gpu() {
        assert_eq!(for_local_rank(3, 4, None, false), Ok(3));
        let e = for_local_rank(4, 4, None, false).expect_err("no GPU");
        assert!(e.contains("local rank 4") && e.contains("--gpus-per-task"), "{e}");
        assert_eq!(for_local_rank(5, 4, None, true), Ok(1));
    }

    /// Slurm's `--gpus-per-task=1` and a pod's one GPU: each rank sees only its own, as
    /// GPU 0, whatever its local rank; the ranks' UUIDs differ, so they may start.
    #[test]
    fn a_rank_given_one_gpu_of_its_own_takes_it() {
        let claims: Vec<(DeviceId, u64, Claim)> = (0..4u32)
            .map(|r| {
                let visible = r.to_string();
                let ordinal = for_local_rank(r as usize, 1, Some(&visible), false).expect("its own GPU");
                assert_eq!(ordinal, 0);
                (DeviceId(r), 60 * GIB, h100(ordinal, r as u8, Some(&visible)))
            })
            .collect();
        assert_eq!(verdict(&claims, false, &rank), None);
        // two GPUs each (`--gpus-per-task=2`): local rank 3 takes the second of its own
        assert_eq!(for_local_rank(3, 2, Some("6,7"), false), Ok(1));
        // an empty CUDA_VISIBLE_DEVICES narrows nothing
        assert!(for_local_rank(1, 1, Some(" "), false).is_err());
    }

    /// The same CUDA_VISIBLE_DEVICES exported for every rank of a host puts ranks on one
    /// GPU: the UUIDs say so, and every rank stops with the same message.
    #[test]
    fn two_ranks_on_one_gpu_are_refused_unless_shared() {
        let claims: Vec<(DeviceId, u64, Claim)> = (0..3u32)
            .map(|r| {
                let ordinal = for_local_rank(r as usize, 2, Some("0,1"), false).expect("narrowed");
                (DeviceId(r), 10 * GIB, h100(ordinal, ordinal as u8, Some("0,1")))
            })
            .collect();
        let why = verdict(&claims, false, &rank).expect("ranks 0 and 2 share GPU 0");
        assert!(why.contains("rank 0, rank 2 all run on GPU 0") && why.contains("--share-gpus"), "{why}");
        assert!(why.contains(&uuid_text([0; 16])) && why.contains("CUDA_VISIBLE_DEVICES=0,1"), "{why}");
        assert_eq!(verdict(&claims, true, &rank), None);
    }

    /// The plan's peaks of the devices on one GPU are held against its memory, shared or not.
    #[test]
    fn a_plan_that_peaks_past_its_gpus_memory_is_refused_before_allocating() {
        let alone = [(DeviceId(2), 85 * GIB, h100(0, 9, None))];
        let why = verdict(&alone, false, &rank).expect("85 GiB on an 80 GiB GPU");
        assert!(why.contains("rank 2's plan peak at 85.0 GiB") && why.contains("has 80.0 GiB"), "{why}");
        let shared = [(DeviceId(0), 50 * GIB, h100(0, 1, None)), (DeviceId(1), 50 * GIB, h100(0, 1, None))];
        let why = verdict(&shared, true, &rank).expect("100 GiB of plans on one 80 GiB GPU");
        assert!(why.contains("the plans of rank 0, rank 1 peak at 100.0 GiB"), "{why}");
        assert_eq!(verdict(&[(DeviceId(0), 80 * GIB, h100(0, 1, None))], false, &rank), None);
        // free memory below the peak is a warning, not a refusal
        let w = free_memory_warning(DeviceId(0), 79 * GIB + 1, &h100(0, 1, None)).expect("warned");
        assert!(w.contains("79.0 GiB free of 80.0 GiB"), "{w}");
        assert_eq!(free_memory_warning(DeviceId(0), 40 * GIB, &h100(0, 1, None)), None);
    }

    #[test]
    fn a_failure_on_every_rank_is_said_once_and_others_by_rank() {
        let none = |e: &str| Claim { found: Err(e.into()), visible: None };
        let all = [(DeviceId(0), 0, none("no CUDA device")), (DeviceId(1), 0, none("no CUDA device"))];
        assert_eq!(verdict(&all, false, &rank).as_deref(), Some("every device: no CUDA device"));
        assert_eq!(verdict(&all[..1], false, &rank).as_deref(), Some("rank 0: no CUDA device"));
        let one = [(DeviceId(0), 0, h100(0, 1, None)), (DeviceId(1), 0, none("GPU 1 cannot be opened"))];
        assert_eq!(verdict(&one, false, &rank).as_deref(), Some("rank 1: GPU 1 cannot be opened"));
    }

    #[test]
    fn a_claim_round_trips_and_a_malformed_one_is_an_error() {
        for claim in [
            h100(3, 7, Some("GPU-abc,MIG-1")),
            h100(0, 0, None),
            Claim { found: Err("no driver".into()), visible: None },
        ] {
            assert_eq!(Claim::decode(&claim.encode()), Ok(claim));
        }
        for bad in [&b"gpu\n1\n2"[..], b"\xff", b"disk\n", b"gpu\nx\nu\n1\n1\nn\n-"] {
            assert!(Claim::decode(bad).is_err(), "{bad:?}");
        }
        assert_eq!(uuid_text([0xab; 16]), "GPU-abababab-abab-abab-abab-abababababab");
    }
}
