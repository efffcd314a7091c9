//! The plan: everything the executor needs to train, and everything the compiler predicted.
//! Serialised as `plan.json` (format documented in docs/plan-format.md, versioned by
//! [`PLAN_VERSION`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::instr::{DeviceId, GroupId, Instr, StageId};
use crate::model::{Loss, Op};

/// Bumped on every incompatible change of the format.
pub const PLAN_VERSION: u32 = 1;

/// A compiled training plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub version: u32,
    pub name: String,
    pub model: ModelPlan,
    pub training: TrainingPlan,
    pub schedule: ScheduleInfo,
    /// PipeDream notation of the layout, e.g. `2-1-1`.
    pub partition: String,
    pub stages: Vec<StagePlan>,
    pub devices: Vec<DevicePlan>,
    /// Collective groups (replicas of one stage).
    pub groups: Vec<GroupPlan>,
    /// The cost-model inputs per layer.
    pub layers: Vec<LayerPlan>,
    /// One ordered instruction stream per device.
    pub streams: BTreeMap<DeviceId, Vec<Instr>>,
    pub simulation: Simulation,
}

/// The model as the executor builds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelPlan {
    pub input: Vec<usize>,
    pub loss: Loss,
    /// The vocabulary when the input is token ids (first layer an embedding).
    pub token_vocab: Option<usize>,
}

/// Optimizer settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum OptimizerPlan {
    Sgd { lr: f64, momentum: f64, weight_decay: f64 },
    Adam { lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64 },
}

/// Where the data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataPlan {
    /// Deterministic data from the seed; `samples` distinct samples (0 = a fresh batch
    /// every step).
    Synthetic { task: String, samples: usize },
    /// A CSV file (absolute path), one sample per row, label last.
    Csv { path: String },
    /// NPY features and labels (absolute paths).
    Npy { path: String, labels: Option<String> },
}

/// The training loop's settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainingPlan {
    pub batch_size: usize,
    pub microbatches: usize,
    pub microbatch_size: usize,
    pub steps: usize,
    pub optimizer: OptimizerPlan,
    pub precision: String,
    pub seed: u64,
    pub data: DataPlan,
    pub checkpoint_every: Option<usize>,
    pub checkpoint_dir: Option<String>,
    pub recompute: bool,
}

/// The schedule that produced the streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScheduleInfo {
    pub kind: String,
    pub virtual_stages: usize,
    /// Whether training equals one-device training (no stale weights).
    pub synchronous: bool,
    /// Weight versions a stage may keep at once (1 for flush schedules).
    pub weight_versions: usize,
    /// `ring` or `ps` for gradient reduction.
    pub reduce: String,
    /// Asynchronous data parallelism (parameter server): the staleness bound; None otherwise.
    #[serde(default)]
    pub staleness: Option<usize>,
}

/// One pipeline stage (a virtual stage for interleaved schedules).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    pub id: StageId,
    /// Half-open layer range `[start, end)`.
    pub layers: [usize; 2],
    /// The devices holding a replica of this stage, one per replica.
    pub replicas: Vec<DeviceId>,
    /// route[mb] = index into `replicas` of the replica that runs microbatch mb.
    pub route: Vec<u32>,
    /// The collective group of the replicas (when there is more than one).
    pub group: Option<GroupId>,
    pub parameters: u64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// Bytes kept for the backward per microbatch (with recompute: the stage input only).
    pub activation_bytes_per_microbatch: u64,
    /// Bytes of the stage's output per microbatch (what is sent to the next stage).
    pub output_bytes_per_microbatch: u64,
    /// Megatron tensor parallelism: per replica, the devices that split the stage's layers
    /// (the replica's device first). Empty when the stage is not tensor-parallel. Every
    /// member runs the same stream with its peers shifted by its rank in the group; its
    /// forward and backward include the group's all-reduces.
    #[serde(default)]
    pub tensor_parallel: Vec<Vec<DeviceId>>,
}

/// Per-device memory, in bytes.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    pub weights: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub activations: u64,
    /// Communication buffers (in-flight sends and receives).
    pub buffers: u64,
    /// The documented workspace reserve.
    pub workspace: u64,
    pub total: u64,
    pub capacity: u64,
}

/// One device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    pub id: DeviceId,
    pub node: u32,
    pub stages: Vec<StageId>,
    pub memory: MemoryBreakdown,
    /// Peak number of microbatches whose activations a stage keeps at once, per stage held.
    pub peak_in_flight: BTreeMap<StageId, u32>,
}

/// A collective group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPlan {
    pub id: GroupId,
    pub stage: StageId,
    pub devices: Vec<DeviceId>,
}

/// Cost-model inputs of one layer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPlan {
    pub index: usize,
    pub op: Op,
    pub label: Option<String>,
    pub input_shape: Vec<usize>,
    pub output_shape: Vec<usize>,
    pub parameters: u64,
    pub parameter_bytes: u64,
    pub forward_flops_per_sample: f64,
    pub backward_flops_per_sample: f64,
    /// Seconds per microbatch (analytic or measured).
    pub forward_s: f64,
    pub backward_s: f64,
    /// Bytes kept for the backward, per sample.
    pub activation_bytes_per_sample: u64,
    /// Bytes of the layer's output, per sample.
    pub output_bytes_per_sample: u64,
}

/// What the simulator predicted for one step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Simulation {
    pub step_time_s: f64,
    /// Idle share of device-time over the step.
    pub bubble_fraction: f64,
    pub throughput_samples_per_s: f64,
    pub devices: Vec<DeviceSimulation>,
}

/// Per-device predictions.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DeviceSimulation {
    pub id: DeviceId,
    pub busy_s: f64,
    pub bubble_fraction: f64,
    pub peak_memory_bytes: u64,
}

impl Plan {
    /// The plan's streams in text form, one instruction per line under a `device dN:` header.
    pub fn streams_text(&self) -> String {
        let mut out = String::new();
        for (dev, stream) in &self.streams {
            out.push_str(&format!("device {dev}:\n"));
            for (i, ins) in stream.iter().enumerate() {
                out.push_str(&format!("  {i:4}  {ins}\n"));
            }
        }
        out
    }

    /// The stage by id.
    pub fn stage(&self, id: StageId) -> Option<&StagePlan> {
        self.stages.get(id.0 as usize).filter(|s| s.id == id)
    }

    /// Reads a plan from JSON, checking the version.
    pub fn from_json(text: &str) -> Result<Plan, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not a plan: {e}"))?;
        let version = v.get("version").and_then(serde_json::Value::as_u64).ok_or("not a plan: no `version`")?;
        if version != u64::from(PLAN_VERSION) {
            return Err(format!("plan format version {version} is not supported (this pipec reads version {PLAN_VERSION}); recompile the spec"));
        }
        serde_json::from_value(v).map_err(|e| format!("malformed plan: {e}"))
    }
}
