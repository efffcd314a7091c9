//! The vocabulary shared by pipec's compiler and executor: the model's operators, and the
//! plan format (devices, stages, per-device instruction streams) that the compiler writes to
//! `plan.json` and the executor interprets.

pub mod model;
