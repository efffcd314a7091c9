//! `pipec calibrate`: measure the device the executor runs on and write the device file a
//! spec names with `cluster.device: { file: FILE }`.

use std::path::PathBuf;

use pipec_grammar::dsl::Dimension;

use pipec_executor::calibrate::{Calibration, LinkCalibration};
use pipec_plan::device::DeviceModel;

use crate::output::write_atomic;
use crate::plan_profile_cmd::quantity;
use crate::run_cmd::Backend;
use crate::{EXIT_OK, EXIT_USAGE};

pub fn run(out: PathBuf, backend: Backend, memory: &str, reps: usize, concurrent: usize) -> u8 {
    let memory = match quantity(memory, Dimension::Bytes, "memory") {
        Ok(m) if m > 0.0 => m,
        Ok(_) => {
            eprintln!("error: --memory must be above 0");
            return EXIT_USAGE;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return EXIT_USAGE;
        }
    };
    let (measured, links) = match backend {
        Backend::Cpu => match measure_cpu(memory, reps, concurrent) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}; nothing written");
                return crate::EXIT_DIAGNOSTICS;
            }
        },
        Backend::Cuda if concurrent > 1 => {
            eprintln!("error: --concurrent is for the CPU backend (a GPU is one device)");
            return EXIT_USAGE;
        }
        Backend::Cuda => {
            if let Err(e) = pipec_executor::cuda_available() {
                eprintln!("error: {e}");
                return EXIT_USAGE;
            }
            #[cfg(feature = "cuda")]
            {
                (pipec_executor::calibrate::calibrate_cuda(memory, reps), None)
            }
            #[cfg(not(feature = "cuda"))]
            {
                eprintln!("error: CUDA support is not built in");
                return EXIT_USAGE;
            }
        }
    };
    let d = &measured.device;
    // the CPU's points are linear layers' products as training runs them (forward and
    // backward through autodiff, a third of the pass each); a GPU's the bare products
    let what = if backend == Backend::Cpu { "layer product (m·k·n)" } else { "matrix product (m·k·n)" };
    eprintln!("{:>22} {:>14} {:>12} {:>12}", what, "FLOPs", "measured", "fitted");
    for ((m, k, n), p) in &measured.products {
        let bytes = pipec_executor::calibrate::product_bytes((*m, *k, *n));
        let fitted = d.matrix_time(p.size, bytes, pipec_plan::Precision::Fp32);
        eprintln!(
            "{:>22} {:>14.3e} {:>9.1} µs {:>9.1} µs",
            format!("{m}·{k}·{n}"),
            p.size,
            p.seconds * 1e6,
            fitted * 1e6
        );
    }
    eprintln!("{:>22} {:>14} {:>12} {:>12}", "element-wise add", "bytes", "measured", "fitted");
    for (n, p) in &measured.adds {
        let fitted = d.vector_time(*n as f64, p.size);
        eprintln!("{:>22} {:>14.3e} {:>9.1} µs {:>9.1} µs", n, p.size, p.seconds * 1e6, fitted * 1e6);
    }
    eprintln!("{:>22} {:>14} {:>12} {:>12}", "element-wise function", "elements", "measured", "per element");
    for (name, p) in &measured.functions {
        eprintln!("{:>22} {:>14} {:>9.1} µs {:>9.2} ns", name, p.size, p.seconds * 1e6, p.seconds / p.size * 1e9);
    }
    eprintln!(
        "fp32 products {:.2} GFLOP/s (half of it at {:.3e} FLOPs), memory {:.2} GB/s (half at {:.3e} bytes), launch {:.2} µs",
        d.matrix.fp32 / 1e9,
        d.matrix_efficiency.half,
        d.memory_bandwidth / 1e9,
        d.memory_efficiency.half,
        d.launch * 1e6
    );
    if let Some(a) = d.attention {
        eprintln!(
            "{:>22} {:>14} {:>12} {:>12} {:>12} {:>12}",
            "attention (b·s·heads·dh)", "", "forward", "fitted", "backward", "fitted"
        );
        for ((b, s, h, dh), f, w) in &measured.attention {
            let (bh, s_, dh_) = ((b * h) as f64, *s as f64, *dh as f64);
            eprintln!(
                "{:>22} {:>14} {:>9.1} µs {:>9.1} µs {:>9.1} µs {:>9.1} µs",
                format!("{b}·{s}·{h}·{dh}"),
                "",
                f * 1e6,
                a.forward.seconds(bh, s_, dh_) * 1e6,
                w * 1e6,
                a.backward.seconds(bh, s_, dh_) * 1e6
            );
        }
    }
    if let Some(t) = d.product_traffic {
        eprintln!(
            "products' operands beyond {:.0} KiB at {:.2} GB/s (a product: the 2-norm of its compute and that traffic)",
            t.cached / 1024.0,
            t.bandwidth / 1e9
        );
    }
    if let Some(o) = d.optimizer {
        eprintln!("{:>22} {:>14} {:>14}", "optimizer update", "per tensor", "per parameter");
        for (name, r) in [("sgd", o.sgd), ("momentum", o.momentum), ("adam", o.adam)] {
            eprintln!("{:>22} {:>11.1} µs {:>11.3} ns", name, r.per_tensor * 1e6, r.per_parameter * 1e9);
        }
    }
    if let Some(c) = &links {
        eprintln!("{:>22} {:>14} {:>12}", "message (one way)", "bytes", "measured");
        for p in &c.p2p {
            eprintln!("{:>22} {:>14.3e} {:>9.1} µs", "", p.size, p.seconds * 1e6);
        }
        eprintln!("{:>22} {:>14} {:>12}", format!("all-reduce over {}", c.devices), "bytes", "measured");
        for p in &c.all_reduce {
            eprintln!("{:>22} {:>14.3e} {:>9.1} µs", "", p.size, p.seconds * 1e6);
        }
        let l = c.link;
        eprintln!(
            "link {:.2} GB/s, {:.2} µs per message, all-reduce bus bandwidth {:.2} GB/s (efficiency {:.3})",
            l.bandwidth / 1e9,
            l.latency * 1e6,
            l.bandwidth * l.efficiency / 1e9,
            l.efficiency
        );
    }
    if let Some(s) = d.layer_pass {
        eprintln!(
            "the executor's own work per layer pass: {:.1} µs a forward, twice that a backward (a spec on this file without an `overhead` plans with it)",
            s * 1e6
        );
    }
    let text = serde_json::to_string_pretty(d).unwrap_or_default() + "\n";
    if let Err(e) = write_atomic(&out, text.as_bytes()) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    eprintln!("wrote {} (use it in a spec: `device: {{ file: {} }}`)", out.display(), out.display());
    if links.is_some() {
        eprintln!("and for the links between its workers: `intra_node: {{ file: {} }}`", out.display());
    }
    EXIT_OK
}

/// What `pipec calibrate` measures on the CPU for `workers` workers at once: the kernels;
/// the transport between the workers, where there are two or more (the in-process channels
/// `pipec run` uses), as the device's link; and the executor's own work per layer pass
/// ([`layer_overhead`]; none where it could not be fitted, said on stderr).
pub fn measure_cpu(memory: f64, reps: usize, workers: usize) -> Result<(Calibration, Option<LinkCalibration>), String> {
    let mut measured = pipec_executor::calibrate::calibrate_cpu_concurrent(memory, reps, workers)?;
    let links = (workers > 1).then(|| pipec_executor::calibrate::calibrate_links(workers, reps));
    measured.device.link = links.as_ref().map(|c| c.link);
    measured.device.layer_pass = match layer_overhead(&measured.device, workers) {
        Ok(s) => Some(s),
        Err(e) => {
            eprintln!("warning: the executor's work per layer pass could not be measured ({e})");
            None
        }
    };
    Ok((measured, links))
}

/// The executor's work per layer pass beyond its kernels on `device` (the spec's
/// `overhead`: per layer forward, twice per backward). An embedded pipeline — one stage per
/// worker, 1F1B, widths and depth unlike README's example, which it is checked against —
/// is planned for `device` with no overhead and trained for [`STEPS`] steps on `workers`
/// threads; its forward and backward passes after the first two steps took the measured
/// time, their plan predicts the kernels': the median over the passes of each one's excess
/// per layer pass it ran (a forward one per layer, a backward two) is the overhead (never
/// below zero).
pub fn layer_overhead(device: &DeviceModel, workers: usize) -> Result<f64, String> {
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
    let mut excess: Vec<f64> = Vec::new();
    for &(dev, step, index, start, end) in &report.timeline {
        let Some(ins) = plan.instruction(dev, index).filter(|_| step >= 2) else { continue };
        let (per_layer, predicted) = match *ins {
            Instr::Forward { stage, .. } => (1.0, plan.stage(stage).map(|s| s.forward_s)),
            Instr::Backward { stage, .. } => (2.0, plan.stage(stage).map(|s| s.backward_s)),
            _ => continue,
        };
        let (Some(predicted), Some(st)) = (predicted, plan.stage(ins.stage())) else { continue };
        excess.push(((end - start) - predicted) / (per_layer * (st.layers[1] - st.layers[0]).max(1) as f64));
    }
    if excess.is_empty() {
        return Err("the overhead run timed no passes".into());
    }
    excess.sort_by(f64::total_cmp);
    Ok(excess[excess.len() / 2].max(0.0))
}

/// Steps of [`layer_overhead`]'s run (the first two are not timed).
const STEPS: usize = 12;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_overhead_is_the_executors_time_beyond_the_kernels_predicted() {
        // kernels predicted at a petaFLOP/s with no launch: nearly all the measured time is
        // the executor's own, some microseconds a layer pass even in a debug build
        let fast = DeviceModel { memory_bandwidth: 1e15, ..DeviceModel::uniform("cpu", 1e9, 1e15) };
        let overhead = layer_overhead(&fast, 2).expect("measured");
        assert!(overhead > 1e-6 && overhead < 1e-2, "{overhead}");
        // kernels predicted at a kiloFLOP/s: slower than anything measured, so no overhead
        let slow = DeviceModel { memory_bandwidth: 1e3, ..DeviceModel::uniform("cpu", 1e9, 1e3) };
        assert_eq!(layer_overhead(&slow, 1).expect("measured"), 0.0);
    }
}
