//! `pipec profile`: measure every layer on the chosen backend and write the profile the
//! cost model accepts (`pipec compile --profile FILE`).

use std::path::{Path, PathBuf};

use crate::output::write_atomic;
use crate::run_cmd::{load_plan, Backend};
use crate::{EXIT_DIAGNOSTICS, EXIT_OK, EXIT_USAGE};

pub fn run(
    file: &Path,
    out: Option<PathBuf>,
    backend: Backend,
    reps: usize,
    concurrent: Option<usize>,
    color: bool,
) -> u8 {
    let plan = match load_plan(file, color) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let measured = match backend {
        Backend::Cpu => {
            // the plan's devices run as threads of one process and share these cores
            let threads = concurrent.unwrap_or_else(|| plan.devices.len().clamp(1, crate::this_cpu::cores())).max(1);
            eprintln!("profiling on the CPU with {threads} concurrent worker(s)");
            pipec_executor::profile::profile_cpu_concurrent(&plan, threads, 2, reps.max(1))
        }
        Backend::Cuda => {
            if let Err(e) = pipec_executor::cuda_available() {
                eprintln!("error: {e}");
                return EXIT_USAGE;
            }
            #[cfg(feature = "cuda")]
            {
                pipec_executor::profile::profile_cuda(&plan, 2, reps.max(1))
            }
            #[cfg(not(feature = "cuda"))]
            {
                Err(pipec_executor::error::ExecError::Setup("CUDA support is not built in".to_string()))
            }
        }
    };
    let mut profile = match measured {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: profiling failed: {e}");
            return EXIT_DIAGNOSTICS;
        }
    };
    profile.backend = format!("{backend:?}").to_lowercase();
    let layers = &profile.layers;
    let path = out.unwrap_or_else(|| PathBuf::from("out").join(&plan.name).join("profile.json"));
    let text = serde_json::to_string_pretty(&profile).unwrap_or_default() + "\n";
    if let Err(e) = write_atomic(&path, text.as_bytes()) {
        eprintln!("error: {e}");
        return EXIT_USAGE;
    }
    let total_f: f64 = layers.iter().map(|l| l.forward_ms).sum();
    let total_b: f64 = layers.iter().map(|l| l.backward_ms).sum();
    eprintln!(
        "{}: {} layers at microbatch {}: forward {total_f:.3} ms, backward {total_b:.3} ms per microbatch; wrote {}",
        plan.name,
        layers.len(),
        plan.training.microbatch_size,
        path.display()
    );
    EXIT_OK
}
