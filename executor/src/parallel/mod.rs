//! One module per parallel dimension: tensor parallelism's shards, expert parallelism's
//! groups and holdings, ZeRO's shards and gathers, and resharding between layouts.

pub mod tensor_parallel;
pub mod experts;
pub(crate) mod zero;
pub(crate) mod reshard;
