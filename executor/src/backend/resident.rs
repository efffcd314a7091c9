//! The process's resident memory, from Linux's `/proc/self/status`: what `pipec run`
//! measures beside a plan's memory prediction when a process runs one device (one MPI rank,
//! or a one-device plan). Elsewhere (no `/proc`) nothing is measured.

/// Resident memory of one process running one device: at the start (before its stages are
/// built, after the data set is read and the transport is up) and at its peak during the
/// run, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resident {
    pub baseline: u64,
    pub peak: u64,
}

impl Resident {
    /// What the run added at its peak to what the process held before it.
    pub fn growth(&self) -> u64 {
        self.peak.saturating_sub(self.baseline)
    }
}

/// A `/proc/self/status` field in bytes (`VmRSS`, `VmHWM`: given in kB).
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    let kb: u64 = line[field.len() + 1..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The memory the kernel says new allocations can still get without swapping
/// (`MemAvailable` in `/proc/meminfo`, given in kB); None where that cannot be read.
pub fn available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line["MemAvailable:".len()..].split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// Refuses a CPU run whose devices' model state (weights, gradients and optimizer state,
/// as the plan counts them: less than the executor's fp32 copies hold) is more than this
/// machine has available — a run that would be killed for memory, not a diagnostic.
pub fn check_host_memory(plan: &pipec_plan::Plan, devices: &[pipec_plan::DeviceId]) -> Result<(), String> {
    let state: u64 = plan
        .devices
        .iter()
        .filter(|d| devices.contains(&d.id))
        .map(|d| d.memory.weights + d.memory.gradients + d.memory.optimizer)
        .fold(0, u64::saturating_add);
    match available() {
        Some(free) if state > free => Err(format!(
            "the {} device(s) this process runs hold {} of model state (weights, gradients, optimizer) by the plan, and this machine has {} available: the run would be killed for memory",
            devices.len(),
            gib(state),
            gib(free)
        )),
        _ => Ok(()),
    }
}

/// Bytes as GiB with one decimal, for the messages that hold memory against a plan's
/// (this machine's here, a GPU's in `run::gpus`).
pub(crate) fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Resident memory now, with the peak counter restarted from it (writing 5 to
/// `/proc/self/clear_refs` resets `VmHWM`); None where that cannot be done.
pub fn start() -> Option<u64> {
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    status_bytes("VmRSS")
}

/// The peak resident memory since [`start`].
pub fn peak() -> Option<u64> {
    status_bytes("VmHWM")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On Linux: the peak counter restarts at the resident size and sees a large
    /// allocation that is touched and freed.
    #[test]
    fn the_peak_sees_an_allocation_after_a_restart() {
        let Some(baseline) = start() else { return };
        let before = peak().expect("VmHWM");
        assert!(before >= baseline / 2, "the peak restarts near the resident size: {before} vs {baseline}");
        let block = vec![1u8; 64 << 20];
        std::hint::black_box(&block);
        drop(block);
        let after = peak().expect("VmHWM");
        assert!(after >= before + (48 << 20), "a 64 MiB block touched: peak {before} -> {after}");
    }
}
