//! One core per device: the in-process workers' threads pinned each to a core of their
//! own, where there are cores enough.
//!
//! Left to the scheduler, a thread that wakes another may have it queued on its own core
//! while the other core idles: on this project's 2-core machine a worker's collective
//! thread, woken by its peer's, waited 370–400 µs a step for the core its worker computed
//! on, and the two workers fell half a step out of step (`specs/csv-classifier.yaml`:
//! 0.6–1.2 ms steps where 0.45 ms of work each). A device is one core (the kernels run
//! single-threaded, `backend::flex_gemm`): pinned, its compute thread and the
//! communication threads it starts (which inherit its core) share that core only.
//! One process per device (MPI, TCP) is left as the launcher bound it, and nothing is
//! pinned where `PIPEC_AFFINITY=off` (several runs sharing a machine's cores, say).

#![allow(unsafe_code)]

/// The environment variable that turns the pinning off (`off`).
pub const SWITCH: &str = "PIPEC_AFFINITY";

/// Pins the calling thread (and the threads it starts after) to the `index`th core this
/// process may run on, where `workers` threads, two or more, fit one a core; the core, or
/// None (a lone worker, whose process its launcher placed; too few cores; [`SWITCH`] off;
/// not Linux: nothing is changed).
pub(crate) fn pin(index: usize, workers: usize) -> Option<usize> {
    if workers < 2 || switched_off(std::env::var(SWITCH).ok().as_deref()) {
        return None;
    }
    imp::pin(index, workers)
}

/// Whether [`SWITCH`]'s value turns the pinning off.
fn switched_off(value: Option<&str>) -> bool {
    value == Some("off")
}

#[cfg(target_os = "linux")]
mod imp {
    use std::mem::{size_of, zeroed};

    pub(super) fn pin(index: usize, workers: usize) -> Option<usize> {
        // SAFETY: a zeroed cpu_set_t is the empty set; sched_getaffinity and
        // sched_setaffinity read and write only the set passed with its size, for this
        // thread (pid 0)
        unsafe {
            let mut allowed: libc::cpu_set_t = zeroed();
            if libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut allowed) != 0 {
                return None;
            }
            let cores: Vec<usize> = (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &allowed)).collect();
            if workers > cores.len() {
                return None;
            }
            let core = *cores.get(index)?;
            let mut one: libc::cpu_set_t = zeroed();
            libc::CPU_SET(core, &mut one);
            (libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &one) == 0).then_some(core)
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub(super) fn pin(_index: usize, _workers: usize) -> Option<usize> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread is pinned to a core of its own where the workers fit, and left alone where
    /// they do not or where it is alone; `PIPEC_AFFINITY=off` and only that turns it off.
    #[test]
    fn a_worker_is_pinned_to_its_own_core_only_where_the_workers_fit() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let pinned: Vec<Option<usize>> =
            (0..cores).map(|i| std::thread::spawn(move || imp::pin(i, cores)).join().expect("thread")).collect();
        if cfg!(target_os = "linux") {
            let mut got: Vec<usize> = pinned.iter().map(|c| c.expect("pinned")).collect();
            got.dedup();
            assert_eq!(got.len(), cores, "{pinned:?}");
        }
        assert_eq!(std::thread::spawn(move || imp::pin(0, cores + 1)).join().expect("thread"), None);
        assert_eq!(std::thread::spawn(|| pin(0, 1)).join().expect("thread"), None, "a lone worker");
        assert!(switched_off(Some("off")));
        assert!(!switched_off(None) && !switched_off(Some("on")) && !switched_off(Some("")));
    }
}
