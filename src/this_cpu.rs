//! `pipec run` on the CPU of a spec whose device is written inline (`device: { kind: cpu,
//! memory, throughput }`, no device file): the run is planned and predicted for this
//! machine's CPU instead, as `pipec calibrate --concurrent N` measures it (N: the workers the
//! run starts), measured once and kept in a cache file named after this CPU, its worker
//! count and pipec's version. The spec's memory figure is kept. `PIPEC_CPU_CALIBRATION=off`
//! keeps the spec's figures; `PIPEC_CACHE_DIR` moves the cache (default
//! `$XDG_CACHE_HOME/pipec`, else `~/.cache/pipec`).
//!
//! Beside the kernels, the measurement fits the executor's own work per layer pass that
//! the kernels do not show (the spec's `overhead`), from a short training run of an
//! embedded pipeline that is not the spec's ([`layer_overhead`]). Both are
//! [`measure_cpu`], what `pipec calibrate` measures on the CPU too: the cache file is the
//! device file `pipec calibrate --concurrent N` writes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use pipec_executor::calibrate::{Calibration, LinkCalibration};
use pipec_plan::device::DeviceModel;

/// The environment variable that turns the calibration off (`off`).
pub const SWITCH: &str = "PIPEC_CPU_CALIBRATION";

/// How many repetitions each calibration point takes (`pipec calibrate`'s default).
const REPS: usize = 15;

/// This machine's CPU as a device, and where it came from.
pub struct ThisCpu {
    /// The device as `pipec calibrate --concurrent N` measures it, the executor's own work
    /// per layer pass (`layer_pass`) among its figures.
    pub device: DeviceModel,
    pub cache: PathBuf,
    /// Seconds the measurement took; None when it came from the cache.
    pub measured_s: Option<f64>,
}

impl ThisCpu {
    /// Seconds of the executor's work per layer forward beyond the kernels: the spec's
    /// `overhead`.
    pub fn overhead(&self) -> f64 {
        self.device.layer_overheads().0
    }

    /// The same per layer backward (twice the forward's where none was measured apart).
    pub fn overhead_backward(&self) -> f64 {
        self.device.layer_overheads().1
    }

    /// The line `pipec run` prints about it.
    pub fn note(&self) -> String {
        let how = match self.measured_s {
            Some(s) => format!("measured now in {s:.1} s and cached at {}", self.cache.display()),
            None => format!("measured before, from {}", self.cache.display()),
        };
        format!(
            "note: the spec's CPU device is written inline, so this run is planned and predicted for this machine's CPU ({:.2} GFLOP/s fp32 products, {:.1} µs of the executor's work a layer pass and {:.1} µs a step, {how}); {SWITCH}=off keeps the spec's figures",
            self.device.matrix.fp32 / 1e9,
            self.overhead() * 1e6,
            self.device.step_overhead() * 1e6
        )
    }
}

/// The cores this process may run on (1 where the system does not say).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
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
/// `measure` (a device file with the executor's work per layer pass) and cached (a cache
/// file that does not read as one is measured again and replaced).
pub fn this_cpu_with(
    workers: usize,
    dir: &Path,
    cpu: &str,
    measure: impl FnOnce() -> Result<DeviceModel, String>,
) -> Result<ThisCpu, String> {
    let cache = pipec_executor::calibrate::cache_file(dir, cpu, workers);
    if let Some(device) = read_cached(&cache) {
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

/// A cache file's measurement: a device file with the executor's work per layer pass and
/// per step.
fn read_cached(cache: &Path) -> Option<DeviceModel> {
    let text = std::fs::read_to_string(cache).ok()?;
    DeviceModel::from_json(&text)
        .ok()
        .filter(|d| d.layer_pass.is_some() && d.layer_pass_backward.is_some() && d.step_pass.is_some())
}

/// Whether this machine's CPU for `workers` workers is in the cache already: [`this_cpu`]
/// then reads it and measures nothing.
pub fn in_cache(workers: usize) -> bool {
    cache_dir().is_some_and(|dir| {
        read_cached(&pipec_executor::calibrate::cache_file(&dir, &pipec_executor::calibrate::cpu_name(), workers))
            .is_some()
    })
}

/// [`this_cpu_with`] on this machine, measured as `pipec calibrate --concurrent workers`
/// measures it ([`measure_cpu`]); `memory` the spec's.
pub fn this_cpu(workers: usize, memory: f64) -> Result<ThisCpu, String> {
    let dir = cache_dir().ok_or("no cache folder (set PIPEC_CACHE_DIR)")?;
    let mut found = this_cpu_with(workers, &dir, &pipec_executor::calibrate::cpu_name(), || {
        eprintln!("measuring this machine's CPU for {workers} worker(s), once (cached for later runs) ...");
        let mut device = measure_cpu(memory, REPS, workers)?.0.device;
        // the kernels are measured either way: a failed fit plans with no overhead, as said
        device.layer_pass = device.layer_pass.or(Some(0.0));
        device.layer_pass_backward = device.layer_pass_backward.or(Some(0.0));
        device.step_pass = device.step_pass.or(Some(0.0));
        Ok(device)
    })?;
    found.device.memory = memory;
    Ok(found)
}

/// What `pipec calibrate` measures on the CPU for `workers` workers at once: the kernels;
/// the transport between the workers, where there are two or more (the in-process channels
/// `pipec run` uses), as the device's link; and the executor's own work per layer pass
/// ([`layer_overhead`]; none where it could not be fitted, said on stderr).
pub fn measure_cpu(memory: f64, reps: usize, workers: usize) -> Result<(Calibration, Option<LinkCalibration>), String> {
    let mut measured = pipec_executor::calibrate::calibrate_cpu_concurrent(memory, reps, workers)?;
    let links = (workers > 1).then(|| pipec_executor::calibrate::calibrate_links(workers, reps));
    measured.device.link = links.as_ref().map(|c| c.link);
    let d = &mut measured.device;
    (d.layer_pass, d.layer_pass_backward, d.step_pass) = match layer_overhead(d, workers) {
        Ok(o) => (Some(o.forward), Some(o.backward), Some(o.step)),
        Err(e) => {
            eprintln!("warning: the executor's work per layer pass could not be measured ({e})");
            (None, None, None)
        }
    };
    Ok((measured, links))
}

/// The executor's own work that its kernels do not show, as [`layer_overhead`] measures it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overheads {
    /// Seconds per layer forward (the spec's `overhead`).
    pub forward: f64,
    /// Seconds per layer backward.
    pub backward: f64,
    /// Seconds a worker spends between one step's last instruction and the next step's
    /// first (the device's `step_pass`).
    pub step: f64,
}

/// The executor's work per layer pass beyond its kernels on `device` (the spec's
/// `overhead`: per layer forward, twice per backward), and per step. An embedded pipeline — one stage per
/// worker, 1F1B, widths and depth unlike README's example, which it is checked against —
/// is planned for `device` with no overhead and trained for [`STEPS`] steps on `workers`
/// threads; its forward and backward passes after the first two steps took the measured
/// time, their plan predicts the kernels': the median over the forwards of each one's
/// excess per layer is the forward's overhead, the backwards' the backward's (never below
/// zero). Measured apart since 2026-12-07: README's example's backwards had run at 0.7 of
/// their prediction with twice the forward's, its forwards at 1.15. The work per step is
/// the median, over the workers and the steps after the first two, of the time between a
/// worker's last instruction of a step and its first of the next (since 2026-12-08: 21–34
/// µs a step on a 2-core Xeon; none of it is any instruction's).
pub fn layer_overhead(device: &DeviceModel, workers: usize) -> Result<Overheads, String> {
    use pipec_plan::Instr;
    let workers = workers.max(1);
    let stages = vec!["1"; workers].join("-");
    let source = format!(
        "name: overhead\nmodel:\n  input: [48]\n  layers:\n    - linear(48, 96) -> relu\n    - repeat {}: linear(96, 96) -> relu\n    - linear(96, 6)\n  loss: cross_entropy\ncluster:\n  nodes: 1\n  devices_per_node: {workers}\n  device: {{ kind: cpu, memory: 1GiB, throughput: 1TFLOP/s }}\n  links:\n    intra_node: {{ bandwidth: 10GB/s, latency: 5us }}\nstrategy:\n  stages: \"{stages}\"\n  schedule: {}\n  microbatches: 6\ntraining:\n  batch_size: 48\n  steps: {STEPS}\n  optimizer: {{ kind: sgd, lr: 0.01 }}\n  seed: 11\n  data: {{ kind: synthetic, task: classification, samples: 480 }}\n",
        2 * workers - 1,
        if workers > 1 { "1f1b" } else { "gpipe" },
    );
    let checked = pipec_grammar::check::check_source(&source);
    let mut spec =
        checked.spec.ok_or_else(|| format!("the overhead spec does not check: {:?}", checked.diagnostics))?;
    spec.cluster.device = DeviceModel { memory: spec.cluster.device.memory, ..device.clone() };
    spec.cluster.overhead = 0.0;
    let compiled = pipec_compiler::compile(&spec, &pipec_compiler::CompileOptions::default())
        .into_compiled()
        .map_err(|d| format!("the overhead spec does not compile: {d:?}"))?;
    let plan = compiled.plan;
    let report = pipec_executor::run(&plan, &pipec_executor::RunOptions::default(), &mut |_| {})
        .map_err(|e| format!("the overhead run failed: {e}"))?;
    // each pass's excess per layer pass it ran; their median (a pass the machine paused in
    // the middle of moves it no more than any other)
    let (mut forwards, mut backwards): (Vec<f64>, Vec<f64>) = (Vec::new(), Vec::new());
    for &(dev, step, index, start, end) in &report.timeline {
        let Some(ins) = plan.instruction(dev, index).filter(|_| step >= 2) else { continue };
        let (excess, predicted) = match *ins {
            Instr::Forward { stage, .. } => (&mut forwards, plan.stage(stage).map(|s| s.forward_s)),
            Instr::Backward { stage, .. } => (&mut backwards, plan.stage(stage).map(|s| s.backward_s)),
            _ => continue,
        };
        let (Some(predicted), Some(st)) = (predicted, plan.stage(ins.stage())) else { continue };
        excess.push(((end - start) - predicted) / (st.layers[1] - st.layers[0]).max(1) as f64);
    }
    // each worker's time from its last instruction of a step to its first of the next
    let mut spans: std::collections::BTreeMap<(pipec_plan::DeviceId, usize), (f64, f64)> = Default::default();
    for &(dev, step, _, start, end) in &report.timeline {
        let span = spans.entry((dev, step)).or_insert((start, end));
        *span = (span.0.min(start), span.1.max(end));
    }
    let steps: Vec<f64> = spans
        .iter()
        .filter(|((_, step), _)| *step >= 2)
        .filter_map(|(&(dev, step), &(_, end))| spans.get(&(dev, step + 1)).map(|next| next.0 - end))
        .collect();
    let median = |mut v: Vec<f64>| -> Result<f64, String> {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).map(|m| m.max(0.0)).ok_or_else(|| "the overhead run timed no passes".to_string())
    };
    Ok(Overheads { forward: median(forwards)?, backward: median(backwards)?, step: median(steps)? })
}

/// Steps of [`layer_overhead`]'s run (the first two are not timed).
const STEPS: usize = 12;

#[cfg(test)]
mod tests {
    use super::*;

    fn device(rate: f64, layer_pass: f64) -> DeviceModel {
        let mut d = DeviceModel::uniform("cpu", 1e9, rate);
        d.memory_bandwidth = 1e10;
        d.layer_pass = Some(layer_pass);
        d.layer_pass_backward = Some(layer_pass / 2.0);
        d.step_pass = Some(1e-5);
        d
    }

    #[test]
    fn a_cpu_is_measured_once_per_worker_count_and_read_back_after() {
        let dir = tempfile::tempdir().expect("tmp");
        let first = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(3e9, 2e-6))).expect("measured");
        assert!(first.measured_s.is_some() && first.cache.is_file());
        // the second run reads it; the measurement is not called
        let again = this_cpu_with(2, dir.path(), "cpu a", || Err("measured twice".into())).expect("cached");
        assert_eq!((again.measured_s, again.device.matrix.fp32, again.overhead()), (None, 3e9, 2e-6));
        assert_eq!(again.overhead_backward(), 1e-6, "measured apart");
        assert_eq!(again.cache, first.cache);
        // another worker count or CPU is measured anew
        let four = this_cpu_with(4, dir.path(), "cpu a", || Ok(device(5e9, 0.0))).expect("measured");
        assert!(four.measured_s.is_some() && four.cache != first.cache);
        let other = this_cpu_with(2, dir.path(), "cpu b", || Ok(device(7e9, 0.0))).expect("measured");
        assert_eq!(other.device.matrix.fp32, 7e9);
        // a device file without the executor's work per layer pass is measured again
        let bare = DeviceModel { layer_pass: None, ..device(3e9, 0.0) };
        std::fs::write(&first.cache, serde_json::to_string(&bare).expect("json")).expect("write");
        let refit = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(4e9, 1e-6))).expect("measured");
        assert_eq!((refit.measured_s.is_some(), refit.device.matrix.fp32, refit.overhead()), (true, 4e9, 1e-6));
        // and one measured before the backward's was measured apart
        let forward_only = DeviceModel { layer_pass_backward: None, ..device(3e9, 2e-6) };
        std::fs::write(&first.cache, serde_json::to_string(&forward_only).expect("json")).expect("write");
        let refit = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(4e9, 1e-6))).expect("measured");
        assert!(refit.measured_s.is_some());
        // and so is the format before it was one (the device beside the overhead)
        let before = serde_json::json!({ "device": device(3e9, 0.0), "overhead_s": 2e-6 }).to_string();
        std::fs::write(&first.cache, before).expect("write");
        let again = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(6e9, 3e-6))).expect("measured");
        assert_eq!((again.measured_s.is_some(), again.overhead()), (true, 3e-6));
        // a cache file that is not a device file is measured again and replaced
        std::fs::write(&first.cache, "{ not json").expect("write");
        let mended = this_cpu_with(2, dir.path(), "cpu a", || Ok(device(9e9, 0.0))).expect("measured");
        assert!(mended.measured_s.is_some());
        assert!(read_cached(&first.cache).is_some(), "a device file a spec can name");
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

    #[test]
    fn the_overhead_is_the_executors_time_beyond_the_kernels_predicted() {
        // kernels predicted at a petaFLOP/s with no launch: nearly all the measured time is
        // the executor's own, some microseconds a layer pass even in a debug build
        let fast = DeviceModel { memory_bandwidth: 1e15, ..DeviceModel::uniform("cpu", 1e9, 1e15) };
        let Overheads { forward, backward, step } = layer_overhead(&fast, 2).expect("measured");
        assert!(forward > 1e-6 && forward < 1e-2, "{forward}");
        assert!(backward > 1e-6 && backward < 1e-2, "{backward}");
        // between the steps the workers do work of their own: more than nothing, far less
        // than a step of this pipeline
        assert!(step > 1e-7 && step < 1e-2, "{step}");
        // kernels predicted at a kiloFLOP/s: slower than anything measured, so no overhead
        // per pass (the work between steps is no kernel's: measured all the same)
        let slow = DeviceModel { memory_bandwidth: 1e3, ..DeviceModel::uniform("cpu", 1e9, 1e3) };
        let o = layer_overhead(&slow, 1).expect("measured");
        assert_eq!((o.forward, o.backward), (0.0, 0.0));
        assert!(o.step > 0.0 && o.step < 1e-2, "{o:?}");
    }
}
