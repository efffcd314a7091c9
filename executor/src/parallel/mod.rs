//! One module per parallel dimension: tensor parallelism's shards, expert parallelism's
//! groups and holdings, ZeRO's shards and gathers, and resharding between layouts.

pub mod experts;
pub(crate) mod groups;
pub(crate) mod optim;
pub(crate) mod reshard;
pub mod tensor_parallel;
pub(crate) mod zero;
pub(crate) mod zero_units;
