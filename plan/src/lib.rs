//! The vocabulary shared by pipec's compiler and executor: the model's operators
//! ([`model`]), the closed instruction set ([`instr`]) and the plan format ([`plan`]) that the
//! compiler writes to `plan.json` and the executor interprets.

pub mod checkpoint;
pub mod datafile;
pub mod device;
pub mod engine;
pub mod features;
pub mod flops;
pub mod hf;
pub mod images;
pub mod in_pass;
pub mod instr;
pub mod model;
pub mod output;
pub mod plan;
pub mod profile;
pub mod recipe;
pub mod recompute;
pub mod rope;
pub mod rules;
pub mod schedule;
pub mod vocab;

pub use instr::{
    Buffer, DeviceId, End, ExpertExchange, GroupId, Instr, MessageId, MicrobatchId, Payload, Phase, StageId, Transfer,
};
pub use plan::Plan;
pub use vocab::{
    Attention, Choice, CollectiveKind, CollectivePayload, Engine, Loss, OptimizerKind, PassOp, PeerDim, Precision,
    ReduceMode, ScheduleKind, SyncMode, Task, TokenDtype, TokenExchange,
};
