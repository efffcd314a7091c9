//! One process, one worker thread per device: the plan's devices placed on this process's
//! backend (the CPU, or GPUs), connected by in-process channels, trained by
//! [`run_workers`]; what `pipec run` does without `--transport`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use pipec_plan::Plan;

use pipec_plan::checkpoint;

use super::job::{
    gpu_placement, validate, working_devices, BackendKind, Placement, RunError, RunOptions, RunReport, StepMetrics,
};
use super::threads::run_workers;
use crate::backend::{self, kernels::ExecBackend, CpuBackend};
use crate::comm::transport;
use crate::error::ExecError;

/// Runs a plan in this process: one thread per device, channels between them.
pub fn run(plan: &Plan, options: &RunOptions, on_step: &mut dyn FnMut(&StepMetrics)) -> Result<RunReport, RunError> {
    validate(plan)?;
    match options.backend {
        BackendKind::Cpu => {
            backend::resident::check_host_memory(plan, &working_devices(plan)).map_err(RunError::setup)?;
            let devices = working_devices(plan).into_iter().map(|d| (d, (Default::default(), "cpu".to_string())));
            run_in_process::<CpuBackend>(plan, options, devices.collect(), on_step)
        }
        BackendKind::Cuda => {
            // placed and judged once: by the caller where it did (and warned), else here
            let map = match &options.gpus {
                Some(map) => map.clone(),
                None => gpu_placement(plan, options)?.0,
            };
            #[cfg(feature = "cuda")]
            {
                type B = burn::backend::Autodiff<burn::backend::Cuda>;
                let devices = map
                    .into_iter()
                    .map(|(d, g)| (d, (burn::backend::cuda::CudaDevice::new(g), format!("GPU {g}"))))
                    .collect();
                run_in_process::<B>(plan, options, devices, on_step)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = map;
                Err(RunError::setup("CUDA support is not built in"))
            }
        }
    }
}

/// Runs a plan in this process on Burn's wgpu backend: CubeCL's code path, as CUDA runs it,
/// on any Vulkan driver (the tests run it on Mesa's software one). Consecutive devices
/// alternate between two device clients (`DefaultDevice` and `Cpu`, the same adapter where
/// there is one), so a tensor reaching another device's client is an error here, as it
/// would be between two GPUs. Not a user backend: `pipec run` has no `--backend wgpu`.
#[cfg(feature = "wgpu")]
pub fn run_wgpu(
    plan: &Plan,
    options: &RunOptions,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<RunReport, RunError> {
    use burn::backend::wgpu::WgpuDevice;
    validate(plan)?;
    let clients = [WgpuDevice::DefaultDevice, WgpuDevice::Cpu];
    let devices = working_devices(plan).into_iter().enumerate().map(|(i, d)| {
        let device = clients[i % clients.len()].clone();
        let name = format!("wgpu {device:?}");
        (d, (device, name))
    });
    run_in_process::<burn::backend::Autodiff<burn::backend::Wgpu>>(plan, options, devices.collect(), on_step)
}

fn run_in_process<B: ExecBackend>(
    plan: &Plan,
    options: &RunOptions,
    placement: Placement<B>,
    on_step: &mut dyn FnMut(&StepMetrics),
) -> Result<RunReport, RunError> {
    let devices = working_devices(plan);
    let abort = Arc::new(AtomicBool::new(false));
    let endpoints = transport::in_process::connect(&devices, abort.clone(), options.timeout);
    let dir = options.checkpoint_dir.clone();
    let identity = checkpoint::Identity::of(plan);
    let mut sink = |steps: usize, stages: checkpoint::Shards, loss_scale| match &dir {
        Some(d) => checkpoint::write(d, steps, &identity, &stages, loss_scale).map(Some).map_err(ExecError::Checkpoint),
        None => Ok(None),
    };
    run_workers::<B, _>(plan, options, &placement, endpoints, abort, on_step, &mut sink)
}
