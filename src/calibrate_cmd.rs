//! `pipec calibrate`: measure the device the executor runs on and write the device file a
//! spec names with `cluster.device: { file: FILE }`.

use std::path::PathBuf;

use pipec_grammar::dsl::Dimension;

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
        Backend::Cpu => match crate::this_cpu::measure_cpu(memory, reps, concurrent) {
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
    // the CPU's points are linear layers' forwards as training runs them (through
    // autodiff), beside their backwards; a GPU's the bare products
    let what = if backend == Backend::Cpu { "layer product (m·k·n)" } else { "matrix product (m·k·n)" };
    let backwards = measured.backward.len() == measured.products.len();
    let columns = if backwards {
        format!(" {:>12} {:>12} {:>12} {:>12} {:>12}", "input grad.", "fitted", "weight grad.", "fitted", "backward")
    } else {
        String::new()
    };
    eprintln!("{:>22} {:>14} {:>12} {:>12}{columns}", what, "FLOPs", "measured", "fitted");
    for (i, ((m, k, n), p)) in measured.products.iter().enumerate() {
        let bytes = pipec_executor::calibrate::product_bytes((*m, *k, *n));
        let fitted = d.matrix_time(p.size, bytes, pipec_plan::Precision::Fp32);
        // the split backward: its input half, its weight half, the whole
        let backward = match measured.backward.get(i).filter(|_| backwards) {
            Some(&[b, w]) => {
                let input = d.input_gradient_time(p.size, bytes, pipec_plan::Precision::Fp32);
                let weight = d.weight_gradient_time(p.size, bytes, pipec_plan::Precision::Fp32);
                let us = |s: f64| format!(" {:>9.1} µs", s * 1e6);
                [b - w, input, w, weight, b].map(us).concat()
            }
            None => String::new(),
        };
        eprintln!(
            "{:>22} {:>14.3e} {:>9.1} µs {:>9.1} µs{backward}",
            format!("{m}·{k}·{n}"),
            p.size,
            p.seconds * 1e6,
            fitted * 1e6
        );
    }
    for (what, fit) in
        [("input gradients (with their biases')", d.input_gradient), ("weight gradients", d.weight_gradient)]
    {
        if let Some(w) = fit {
            eprintln!(
                "{what} fitted as products of their own: {:.2} GFLOP/s (half of it at {:.3e} FLOPs), operands beyond {:.0} KiB at {:.2} GB/s",
                w.rate / 1e9,
                w.half,
                w.traffic.cached / 1024.0,
                w.traffic.bandwidth / 1e9
            );
        }
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
    if let Some(t) = d.memory_traffic {
        eprintln!(
            "element-wise kernels' bytes beyond {:.0} KiB at {:.2} GB/s (those within at the memory figure below)",
            t.cached / 1024.0,
            t.bandwidth / 1e9
        );
    }
    if let Some(r) = d.data {
        eprintln!(
            "synthetic data drawn as training runs: {:.1} ns a normal input value, {:.1} ns a token, {:.2} ns a term of the teacher's scores",
            r.feature * 1e9,
            r.token * 1e9,
            r.score * 1e9
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
        let backward = d.layer_overheads().1;
        eprintln!(
            "the executor's own work per layer pass: {:.1} µs a forward, {:.1} µs a backward (a spec on this file without an `overhead` plans with it)",
            s * 1e6,
            backward * 1e6
        );
    }
    if let Some(s) = d.step_pass {
        eprintln!("the executor's own work between a worker's steps: {:.1} µs (every step planned on this file is that much longer)", s * 1e6);
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
