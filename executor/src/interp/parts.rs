//! What a `Worker` holds between instructions, in parts that each serve one concern: the
//! values passed between a step's passes, ZeRO-3's weight gathers, the transfers and
//! reductions in flight, the run's progress, and the peer groups its passes exchange in.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use pipec_plan::{GroupId, MicrobatchId, ReduceMode, StageId};

use crate::backend::kernels::ExecBackend;
use crate::comm::exchanger::Ticket;
use crate::comm::transport::Message;
use crate::interp::data::Targets;
use crate::interp::in_flight::{BucketsInFlight, InFlight};
use crate::interp::values::{Kept, WeightGrads};
use crate::nn::layers::Act;

/// The values a step's passes hand each other, by (stage, microbatch): emptied by the step.
pub(crate) struct Passes<B: ExecBackend> {
    pub(crate) inputs: HashMap<(StageId, MicrobatchId), Act<B>>,
    pub(crate) labels: HashMap<MicrobatchId, Targets>,
    pub(crate) saved: HashMap<(StageId, MicrobatchId), Kept<B>>,
    pub(crate) outputs: HashMap<(StageId, MicrobatchId), Message>,
    pub(crate) grads_in: HashMap<(StageId, MicrobatchId), Message>,
    pub(crate) input_grads: HashMap<(StageId, MicrobatchId), Message>,
    /// Split backwards' weight halves to come (`BackwardWeight`).
    pub(crate) pending_weight_grads: HashMap<(StageId, MicrobatchId), WeightGrads<B>>,
    /// Microbatches kept for the backward, per stage.
    pub(crate) in_flight: HashMap<StageId, u32>,
}

impl<B: ExecBackend> Default for Passes<B> {
    fn default() -> Self {
        Passes {
            inputs: HashMap::new(),
            labels: HashMap::new(),
            saved: HashMap::new(),
            outputs: HashMap::new(),
            grads_in: HashMap::new(),
            input_grads: HashMap::new(),
            pending_weight_grads: HashMap::new(),
            in_flight: HashMap::new(),
        }
    }
}

/// ZeRO-3's gathers of whole weights.
#[derive(Default)]
pub(crate) struct Zero3Gathers {
    /// The all-gathers of whole weights since the step started, and those of them
    /// prefetched during the pass before (`Worker::gather_weights`).
    pub(crate) weight_gathers: u32,
    pub(crate) prefetched_gathers: u32,
    /// The all-gathers of single weights by their products since the step started.
    pub(crate) product_gathers: u32,
    /// Whole weights being gathered ahead of the pass that needs them, per stage.
    pub(crate) prefetched: HashMap<StageId, Vec<Ticket<Vec<f32>>>>,
    /// The gathers of whole weights the plan declares in this step, by position: the
    /// stages whose gathers the pass there starts, in order.
    pub(crate) declared: HashMap<usize, Vec<StageId>>,
}

/// The transfers and gradient reductions in flight.
pub(crate) struct Transfers {
    /// How the stream reduces gradients.
    pub(crate) reduce: ReduceMode,
    /// Receives posted ahead, by position in the step.
    pub(crate) posted: HashMap<usize, Ticket<Message>>,
    /// All-reduces in flight, per stage.
    pub(crate) collectives: HashMap<(StageId, GroupId), InFlight>,
    /// When the all-to-all the last instruction accounted for ran (inside its pass).
    pub(crate) exchanged: Option<(Instant, Instant)>,
    /// Gradient buckets: the step's backwards (positions) whose stage's all-reduce over
    /// the group runs in buckets (`buckets`), and the buckets started, per stage.
    pub(crate) bucketed: HashMap<usize, GroupId>,
    pub(crate) segmented: HashSet<StageId>,
    pub(crate) buckets: HashMap<StageId, BucketsInFlight>,
}

impl Transfers {
    pub(crate) fn new(reduce: ReduceMode) -> Self {
        Transfers {
            reduce,
            posted: HashMap::new(),
            collectives: HashMap::new(),
            exchanged: None,
            bucketed: HashMap::new(),
            segmented: HashSet::new(),
            buckets: HashMap::new(),
        }
    }
}

/// Where the run is.
pub(crate) struct Progress {
    /// The start of the run: step reports say when each step started from it.
    pub(crate) epoch: Instant,
    /// The step being run (the learning-rate schedule's).
    pub(crate) current_step: usize,
    /// Gradient clipping by the global norm: this step's norm (once summed); whether the
    /// stream sums it over every device.
    pub(crate) grad_norm: Option<f64>,
    pub(crate) global_clip: bool,
    /// fp16's dynamic loss scale at the start of the step (`crate::backend::amp::scales_loss`);
    /// None when the loss is not scaled.
    pub(crate) loss_scale: Option<pipec_plan::recipe::LossScale>,
    /// Validation: the held-out batch being evaluated (forwards only, dropout off, batch
    /// normalisation on its running statistics); None while training.
    pub(crate) evaluating: Option<usize>,
    /// The most gradient values held at once since the run started.
    pub(crate) peak_gradients: u64,
    /// The most bytes the device's memory pool has held (a GPU's; None on the CPU).
    pub(crate) pool_peak: Option<u64>,
}

impl Progress {
    pub(crate) fn new(global_clip: bool) -> Self {
        Progress {
            epoch: Instant::now(),
            current_step: 0,
            grad_norm: None,
            global_clip,
            loss_scale: None,
            evaluating: None,
            peak_gradients: 0,
            pool_peak: None,
        }
    }
}

/// The peer groups this device's passes exchange in, per stage it holds.
pub(crate) struct PeerGroups {
    /// Expert parallelism: this device's group for each expert-parallel stage.
    pub(crate) experts: HashMap<StageId, crate::backend::port::PeerGroup>,
    /// Context parallelism: this device's group and positions.
    pub(crate) contexts: HashMap<StageId, crate::nn::context::Context>,
}
