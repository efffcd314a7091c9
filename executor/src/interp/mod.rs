//! The instruction interpreter: a device's `Worker` running its stream, the stage states it
//! owns, the values passed between instructions, and the collectives, buckets, clipping and
//! checkpoint copies it performs.

pub(crate) mod block_recompute;
pub(crate) mod buckets;
pub(crate) mod build;
pub(crate) mod checkpointing;
pub(crate) mod checks;
pub(crate) mod clip;
pub(crate) mod collectives;
pub(crate) mod compute;
pub mod data;
pub(crate) mod gathers;
pub(crate) mod grad_norm;
pub(crate) mod in_flight;
pub(crate) mod parts;
pub mod sharded;
pub(crate) mod stage;
pub(crate) mod updates;
pub(crate) mod values;
pub(crate) mod worker;
