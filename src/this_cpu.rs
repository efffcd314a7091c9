//! `pipec run` on the CPU of a spec whose device is written inline (`device: { kind: cpu,
//! memory, throughput }`, no device file): the run is planned and predicted for this
//! machine's CPU instead, as `pipec calibrate --concurrent N` measures it (N: the workers the
//! run starts), measured once and kept in a cache file named after this CPU, its worker
//! count and pipec's version. The spec's memory figure is kept. `PIPEC_CPU_CALIBRATION=off`
//! keeps the spec's figures; `PIPEC_CACHE_DIR` moves the cache (default
//! `$XDG_CACHE_HOME/pipec`, else `~/.cache/pipec`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use pipec_plan::device::DeviceModel;

/// The environment variable that turns the calibration off (`off`).
pub const SWITCH: &str = "PIPEC_CPU_CALIBRATION";

/// How many repetitions each calibration point takes (`pipec calibrate`'s default).
const REPS: usize = 15;

/// This machine's CPU as a device, and where it came from.
pub struct ThisCpu {
    pub device: DeviceModel,
    pub cache: PathBuf,
    /// Seconds the measurement took; None when it came from the cache.
    pub measured_s: Option<f64>,
}

impl ThisCpu {
    /// The line `pipec run` prints about it.
    pub fn note(&self) -> String {
        let how = match self.measured_s {
            Some(s) => format!("measured now in {s:.1} s and cached at {}", self.cache.display()),
            None => format!("measured before, from {}", self.cache.display()),
        };
        format!(
            "note: the spec's CPU device is written inline, so this run is planned and predicted for this machine's CPU ({:.2} GFLOP/s fp32 products, {how}); {SWITCH}=off keeps the spec's figures",
            self.device.matrix.fp32 / 1e9
        )
    }
}

/// Whether the calibration is turned off by the environment.
pub fn switched_off() -> bool {
    std::env::var(SWITCH).is_ok_and(|v| matches!(v.trim(), "off" | "0" | "false" | "no"))
}

/// Whether a spec's device is a CPU written inline: `kind: cpu` with figures alone, no
/// device file (which has measured functions, operand traffic and size curves) or preset
/// (whose products follow a size curve).
pub fn written_inline(d: &DeviceModel) -> bool {
    use pipec_plan::device::Curve;
    d.name == "cpu"
        && d.functions.is_empty()
        && d.product_traffic.is_none()
        && d.optimizer.is_none()
        && d.matrix_efficiency == Curve::FLAT
}

/// The cache folder: `PIPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/pipec`, else `~/.cache/pipec`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("PIPEC_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("pipec")))
        .or_else(|| var("HOME").map(|h| h.join(".cache/pipec")))
}

/// This machine's CPU for a run of `workers` workers: from the cache, or measured by
/// `measure` and cached (a cache file that does not read as a device file is measured
/// again and replaced).
pub fn this_cpu_with(
    workers: usize,
    dir: &Path,
    cpu: &str,
    measure: impl FnOnce() -> Result<DeviceModel, String>,
) -> Result<ThisCpu, String> {
    let cache = pipec_executor::calibrate::cache_file(dir, cpu, workers);
    if let Some(device) = std::fs::read_to_string(&cache).ok().and_then(|t| DeviceModel::from_json(&t).ok()) {
        return Ok(ThisCpu { device, cache, measured_s: None });
    }
    let start = Instant::now();
    let device = measure()?;
    let measured_s = start.elapsed().as_secs_f64();
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot make the cache folder `{}`: {e}", dir.display()))?;
    let text = serde_json::to_string_pretty(&device).map_err(|e| e.to_string())? + "\n";
    pipec_plan::output::write_atomic(&cache, text.as_bytes())?;
    Ok(ThisCpu { device, cache, measured_s: Some(measured_s) })
}

/// [`this_cpu_with`] on this machine, measured as `pipec calibrate --concurrent workers`
/// measures (its links too, for two workers or more); `memory` the spec's.
pub fn this_cpu(workers: usize, memory: f64) -> Result<ThisCpu, String> {
    let dir = cache_dir().ok_or("no cache folder (set PIPEC_CACHE_DIR)")?;
    let mut found = this_cpu_with(workers, &dir, &pipec_executor::calibrate::cpu_name(), || {
        eprintln!("measuring this machine's CPU for {workers} worker(s), once (cached for later runs) ...");
        let mut c = pipec_executor::calibrate::calibrate_cpu_concurrent(memory, REPS, workers)?;
        if workers > 1 {
            c.device.link = Some(pipec_executor::calibrate::calibrate_links(workers, REPS).link);
        }
        Ok(c.device)
    })?;
    found.device.memory = memory;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(rate: f64) -> DeviceModel {
        let mut d = DeviceModel::uniform("cpu", 1e9, rate);
        d.memory_bandwidth = 1e10;
        d
    }

    #[test]
    fn a_cpu_is_measured_once_per_worker_count_and_read_back_after() {
        let dir = tempfile::tempdir().expect("tmp");
        let first = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(3e9))).expect("measured");
        assert!(first.measured_s.is_some() && first.cache.is_file());
        // the second run reads it; the measurement is not called
        let again = this_cpu_with(2, dir.path(), "cpu a", || Err("measured twice".into())).expect("cached");
        assert_eq!((again.measured_s, again.device.matrix.fp32), (None, 3e9));
        assert_eq!(again.cache, first.cache);
        // another worker count or CPU is measured anew
        let four = this_cpu_with(4, dir.path(), "cpu a", || Ok(device(5e9))).expect("measured");
        assert!(four.measured_s.is_some() && four.cache != first.cache);
        let other = this_cpu_with(2, dir.path(), "cpu b", || Ok(device(7e9))).expect("measured");
        assert_eq!(other.device.matrix.fp32, 7e9);
        // a cache file that is not a device file is measured again and replaced
        std::fs::write(&first.cache, "{ not json").expect("write");
        let mended = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(9e9))).expect("measured");
        assert!(mended.measured_s.is_some());
        assert!(DeviceModel::from_json(&std::fs::read_to_string(&first.cache).expect("read")).is_ok());
        // a failed measurement writes nothing
        let failed = this_cpu_with(8, dir.path(), "cpu a", || Err("no".into()));
        assert!(failed.is_err());
        assert!(!pipec_executor::calibrate::cache_file(dir.path(), "cpu a", 8).exists());
    }

    #[test]
    fn only_an_inline_cpu_device_is_replaced() {
        assert!(written_inline(&DeviceModel::uniform("cpu", 1e9, 2e10)));
        assert!(!written_inline(&DeviceModel::uniform("device", 1e9, 2e10)));
        let mut h100 = pipec_plan::device::preset("h100-sxm").expect("preset").model();
        assert!(!written_inline(&h100));
        // a preset renamed by `kind: cpu` is still a preset
        h100.name = "cpu".into();
        assert!(!written_inline(&h100));
    }
}
