//! `pipec run`'s measured speed as trainers report it: samples/s, and for a language model
//! tokens/s, tokens/s per device and MFU — the plan's FLOPs per token (the count of the engine
//! it is for, `pipec_plan::flops`) over the peak of the device the run used.

use pipec_executor::{BackendKind, StepMetrics};
use pipec_plan::flops::{Peak, Utilization};
use pipec_plan::Plan;

/// What a run's steps' speed is reported as.
pub struct RunSpeed {
    /// A language model's basis (None for any other model: samples/s only).
    utilization: Option<Utilization>,
    /// Why a language model's MFU is not shown.
    no_mfu: Option<String>,
}

impl RunSpeed {
    /// The speed of `plan`'s steps run on `backend` by its working devices.
    pub fn of(plan: &Plan, backend: BackendKind) -> RunSpeed {
        let devices = pipec_executor::working_devices(plan).len();
        let peak = run_peak(plan, backend);
        let utilization = plan.utilization(devices, peak.as_ref().ok().cloned());
        let no_mfu = match (&utilization, peak) {
            (None, _) => None,
            (Some(u), _) if u.flops_per_token.is_none() => {
                Some("MFU not counted: the model has a layer outside the engine's FLOP count".to_string())
            }
            (Some(_), Err(why)) => Some(why),
            (Some(_), Ok(_)) => None,
        };
        RunSpeed { utilization, no_mfu }
    }

    /// The line a run prints before its steps: what its MFU counts against which peak, or
    /// why it shows none; None for a model that is not a language model.
    pub fn basis_line(&self) -> Option<String> {
        let u = self.utilization.as_ref()?;
        if let Some(why) = &self.no_mfu {
            return Some(why.clone());
        }
        // the basis is the same at any speed
        u.mfu(1.0).map(|m| format!("MFU (measured, per device of the run): {}", m.basis_text()))
    }

    /// A step's speed: "12 samples/s 3072 tokens/s 768 tokens/s/device MFU 1.2%".
    pub fn text(&self, m: &StepMetrics) -> String {
        let Some(u) = &self.utilization else { return format!("{:.0} samples/s", m.samples_per_s) };
        let mfu = u.mfu(m.samples_per_s).map(|x| format!(" MFU {:.1}%", x.fraction * 100.0)).unwrap_or_default();
        format!(
            "{:.0} samples/s {:.0} tokens/s {:.0} tokens/s/device{mfu}",
            m.samples_per_s,
            m.samples_per_s * u.tokens_per_sample as f64,
            u.tokens_per_s_per_device(m.samples_per_s)
        )
    }

    /// A language model's `tokens_per_s`, `tokens_per_s_per_device` and `mfu` (a fraction,
    /// when its peak is known) on a step's metrics line.
    pub fn add_to(&self, m: &StepMetrics, line: &mut serde_json::Value) {
        let Some(u) = &self.utilization else { return };
        line["tokens_per_s"] = (m.samples_per_s * u.tokens_per_sample as f64).into();
        line["tokens_per_s_per_device"] = u.tokens_per_s_per_device(m.samples_per_s).into();
        if let Some(x) = u.mfu(m.samples_per_s) {
            line["mfu"] = x.fraction.into();
        }
    }
}

/// The peak of the device the run used: the plan's device, when it is of the backend's kind
/// (a CPU device model for the CPU backend, a GPU one for CUDA); otherwise why it is not
/// known.
fn run_peak(plan: &Plan, backend: BackendKind) -> Result<Peak, String> {
    let Some(peak) = plan.simulation.mfu.as_ref().map(|m| m.peak.clone()) else {
        return Err("MFU not shown: the plan states no device peak (compile it again with this pipec)".to_string());
    };
    match (backend, peak.is_cpu()) {
        (BackendKind::Cpu, true) | (BackendKind::Cuda, false) => Ok(peak),
        (BackendKind::Cpu, false) => Err(format!(
            "MFU not shown: the peak of this run's CPU is not known (the plan describes {}; a spec with `kind: cpu` or a `pipec calibrate` device file gives it)",
            peak.device
        )),
        (BackendKind::Cuda, true) => Err(format!(
            "MFU not shown: the peak of this run's GPU is not known (the plan describes {}; name the GPU's preset in `cluster.device`)",
            peak.device
        )),
    }
}
