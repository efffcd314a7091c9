//! Which GPU each plan device runs on. In one process (the in-process transport) the
//! plan's devices with work take this machine's GPUs in device order: device 0 → GPU 0,
//! device 1 → GPU 1, …; under MPI each rank takes the GPU of its local rank on its host
//! (`OMPI_COMM_WORLD_LOCAL_RANK`, or the PMIx/Slurm equivalents). Fewer GPUs than devices is
//! an error unless the user asks for GPUs to be shared (`--share-gpus`: round robin), which
//! is what tests on a one-GPU machine need. Pure functions of a device count, so the mapping
//! is unit-tested without a GPU.

use pipec_plan::DeviceId;

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

/// The GPU of an MPI rank: its local rank on its host.
pub fn for_local_rank(local_rank: usize, gpus: usize, share: bool) -> Result<usize, String> {
    if gpus == 0 {
        return Err("this host has no CUDA device".into());
    }
    if local_rank >= gpus && !share {
        return Err(format!(
            "local rank {local_rank} has no GPU of its own (this host has {gpus}): start at most {gpus} rank(s) per host (see `pipec launch`), or pass `--share-gpus`"
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Vec<DeviceId> {
        (0..n).map(DeviceId).collect()
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
        assert_eq!(for_local_rank(3, 4, false), Ok(3));
        assert!(for_local_rank(4, 4, false).expect_err("no GPU").contains("local rank 4"));
        assert_eq!(for_local_rank(5, 4, true), Ok(1));
    }
}
