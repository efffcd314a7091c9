//! pipec's compiler: from a checked spec to a verified, simulated plan. One module per
//! phase; [`compile::compile`] lists the passes in order.

pub mod cluster;
pub mod compile;
pub mod cost;
pub mod ir;
pub mod lower;
pub mod memory;
pub mod partition;
pub mod periodic;
pub mod pipedream;
pub mod render;
pub mod schedule;
pub mod search;
pub mod simulate;
pub mod verify;

pub use compile::{compile, CompileOptions, CompileResult, Compiled};
