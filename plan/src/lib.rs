//! The vocabulary shared by pipec's compiler and executor: the model's operators
//! ([`model`]), the closed instruction set ([`instr`]) and the plan format ([`plan`]) that the
//! compiler writes to `plan.json` and the executor interprets.

pub mod instr;
pub mod model;
pub mod plan;
pub mod profile;

pub use instr::{Buffer, DeviceId, GroupId, Instr, MicrobatchId, Phase, StageId};
pub use plan::Plan;
